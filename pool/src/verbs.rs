//! The pool client on real RDMA: each MN class reached with omw-verbs' blocking `CnClient`
//! (rdma_cm to the class's address, every call bounded by the client's timeout — a vanished MN
//! is a timeout or a transport error, never a hang).

use crate::entry::{ClassEntry, MnEntry};
use crate::session::{Connector, MnSession, SessionError};
use omw_core::cn::Allocation;
use omw_core::device::WcStatus;
use omw_core::wire::message::ErrorCode;
use omw_verbs::cn::{CnClient, CnOptions};
use omw_verbs::VerbsError;

/// Connects with these options (device, timeout, tenant credential).
#[derive(Debug, Clone)]
pub struct VerbsConnector {
    pub opts: CnOptions,
}

/// One `CnClient` connected to one MN class.
#[derive(Debug)]
pub struct VerbsSession {
    pub client: CnClient,
}

/// The verbs layer's failures sorted for placement.
pub fn classify(e: VerbsError) -> SessionError<VerbsError> {
    match e {
        VerbsError::PoolEmpty | VerbsError::Refused(ErrorCode::Empty) => SessionError::Empty,
        VerbsError::QuotaExceeded | VerbsError::Refused(ErrorCode::QuotaExceeded) => SessionError::QuotaExceeded,
        VerbsError::Disconnected
        | VerbsError::Timeout { .. }
        | VerbsError::PeerUnreachable { .. }
        | VerbsError::Refused(ErrorCode::Revoked)
        | VerbsError::Completion {
            status: WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr | WcStatus::WrFlushErr,
            ..
        } => SessionError::Lost(e),
        other => SessionError::Failed(other),
    }
}

impl Connector for VerbsConnector {
    type Session = VerbsSession;
    fn connect(&mut self, _mn: &MnEntry, class: &ClassEntry) -> Result<VerbsSession, SessionError<VerbsError>> {
        let addr =
            class.socket_addr().map_err(|e| SessionError::Failed(VerbsError::Config(format!("class address: {e}"))))?;
        let client = CnClient::connect(addr, &self.opts).map_err(SessionError::Failed)?;
        Ok(VerbsSession { client })
    }
}

impl MnSession for VerbsSession {
    type Error = VerbsError;
    fn geometry(&self) -> (u64, u8) {
        (self.client.info.chunk_size, self.client.info.group_size)
    }
    fn alloc(&mut self) -> Result<Allocation, SessionError<VerbsError>> {
        self.client.try_alloc().map_err(classify)
    }
    fn free(&mut self, a: &Allocation) -> Result<(), SessionError<VerbsError>> {
        self.client.free(a).map(|_| ()).map_err(classify)
    }
    fn write(&mut self, a: &Allocation, offset: u64, data: &[u8]) -> Result<(), SessionError<VerbsError>> {
        self.client.write(a, 0, offset, data).map_err(classify)
    }
    fn service(&mut self) -> Result<(), SessionError<VerbsError>> {
        self.client.pump().map(|_| ()).map_err(classify)
    }
    fn read(&mut self, a: &Allocation, offset: u64, buf: &mut [u8]) -> Result<(), SessionError<VerbsError>> {
        let v = self.client.read(a, 0, offset, buf.len()).map_err(classify)?;
        match v.get(..buf.len()) {
            Some(got) => {
                buf.copy_from_slice(got);
                Ok(())
            }
            None => Err(SessionError::Failed(VerbsError::Protocol(format!(
                "a read of {} B brought {} B",
                buf.len(),
                v.len()
            )))),
        }
    }
}
