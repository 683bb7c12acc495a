//! [`CnMemory`] on libibverbs: omw-verbs' [`CnClient`] connected to a real `omw mn`, its data
//! through access QP `window`. A chunk allocation the MN answers "empty" fails at once
//! ([`CnClient::try_alloc`]), so the store sees a full pool as an error, not a wait.

use crate::CnMemory;
use omw_core::cn::Allocation;
use omw_verbs::cn::CnClient;
use omw_verbs::VerbsError;

#[derive(Debug)]
pub struct VerbsCn<'a> {
    pub client: &'a mut CnClient,
    pub window: usize,
}

impl<'a> VerbsCn<'a> {
    pub fn new(client: &'a mut CnClient, window: usize) -> Self {
        VerbsCn { client, window }
    }
}

impl CnMemory for VerbsCn<'_> {
    type Chunk = Allocation;
    type Error = VerbsError;

    fn chunk_size(&self) -> u64 {
        self.client.info.chunk_size
    }
    fn alloc_chunk(&mut self) -> Result<Allocation, VerbsError> {
        self.client.try_alloc()
    }
    fn free_chunk(&mut self, chunk: Allocation) -> Result<(), VerbsError> {
        self.client.free(&chunk).map(|_| ())
    }
    fn write(&mut self, chunk: &Allocation, offset: u64, data: &[u8]) -> Result<(), VerbsError> {
        self.client.write(chunk, self.window, offset, data)
    }
    fn read(&mut self, chunk: &Allocation, offset: u64, buf: &mut [u8]) -> Result<(), VerbsError> {
        let v = self.client.read(chunk, self.window, offset, buf.len())?;
        buf.copy_from_slice(&v);
        Ok(())
    }
}
