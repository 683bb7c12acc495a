//! [`CnMemory`] on the loopback cluster: CN `cn` of an omw-loopback [`Cluster`], its data
//! through access QP `window`.

use crate::CnMemory;
use omw_core::cn::{Allocation, ClientError};
use omw_core::wire::message::ErrorCode;
use omw_loopback::cluster::{Cluster, CnOpError};
use std::fmt;

#[derive(Debug)]
pub struct LoopbackCn<'a> {
    pub cluster: &'a mut Cluster,
    pub cn: usize,
    pub window: usize,
}

impl<'a> LoopbackCn<'a> {
    pub fn new(cluster: &'a mut Cluster, cn: usize, window: usize) -> Self {
        LoopbackCn { cluster, cn, window }
    }
}

/// A cluster CN operation failed.
#[derive(Debug)]
pub struct LoopbackError(pub CnOpError);

impl fmt::Display for LoopbackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "loopback CN: {}", self.0)
    }
}

impl std::error::Error for LoopbackError {}

impl LoopbackError {
    /// The MN has no chunk: it answered "empty", or said so recently and the CN is still
    /// backing off (no "available" since).
    pub fn is_pool_empty(&self) -> bool {
        matches!(self.0, CnOpError::Mn(ErrorCode::Empty) | CnOpError::Client(ClientError::Backoff { .. }))
    }
}

impl CnMemory for LoopbackCn<'_> {
    type Chunk = Allocation;
    type Error = LoopbackError;

    fn chunk_size(&self) -> u64 {
        self.cluster.cfg.chunk_size
    }
    fn alloc_chunk(&mut self) -> Result<Allocation, LoopbackError> {
        self.cluster.alloc(self.cn).map_err(LoopbackError)
    }
    fn free_chunk(&mut self, chunk: Allocation) -> Result<(), LoopbackError> {
        self.cluster.free(self.cn, &chunk).map_err(LoopbackError)
    }
    fn write(&mut self, chunk: &Allocation, offset: u64, data: &[u8]) -> Result<(), LoopbackError> {
        let st = self.cluster.write(self.cn, chunk, self.window, offset, data);
        if st.is_ok() {
            Ok(())
        } else {
            Err(LoopbackError(CnOpError::Device(st)))
        }
    }
    fn read(&mut self, chunk: &Allocation, offset: u64, buf: &mut [u8]) -> Result<(), LoopbackError> {
        let (st, v) = self.cluster.read(self.cn, chunk, self.window, offset, buf.len());
        if !st.is_ok() {
            return Err(LoopbackError(CnOpError::Device(st)));
        }
        buf.copy_from_slice(&v[..buf.len()]);
        Ok(())
    }
}
