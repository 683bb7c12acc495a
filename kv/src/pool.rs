//! [`CnMemory`] on a pool of MNs: each chunk placed by omw-pool's client on whichever MN has
//! room in the class, and every read, write and free routed to the chunk's own MN. The store
//! asks for chunks of one size; the pool picks the smallest class that holds it.

use crate::CnMemory;
use omw_pool::session::{Connector, MnSession};
use omw_pool::{PoolAlloc, PoolClient, PoolError};

/// A KV store's memory on a pool: chunks of at least `chunk_size` bytes.
pub struct PoolCn<'a, C: Connector> {
    pub client: &'a mut PoolClient<C>,
    chunk_size: u64,
}

impl<'a, C: Connector> PoolCn<'a, C> {
    /// Chunks of the pool's smallest class holding `chunk_size` bytes; the store uses exactly
    /// `chunk_size` of each.
    pub fn new(client: &'a mut PoolClient<C>, chunk_size: u64) -> Self {
        PoolCn { client, chunk_size }
    }
}

impl<C: Connector> CnMemory for PoolCn<'_, C> {
    type Chunk = PoolAlloc;
    type Error = PoolError<<C::Session as MnSession>::Error>;

    fn chunk_size(&self) -> u64 {
        self.chunk_size
    }
    fn alloc_chunk(&mut self) -> Result<PoolAlloc, Self::Error> {
        self.client.alloc(self.chunk_size)
    }
    fn free_chunk(&mut self, chunk: PoolAlloc) -> Result<(), Self::Error> {
        self.client.free(chunk)
    }
    fn write(&mut self, chunk: &PoolAlloc, offset: u64, data: &[u8]) -> Result<(), Self::Error> {
        self.client.write(chunk, offset, data)
    }
    fn read(&mut self, chunk: &PoolAlloc, offset: u64, buf: &mut [u8]) -> Result<(), Self::Error> {
        self.client.read(chunk, offset, buf)
    }
}
