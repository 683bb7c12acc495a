//! What a confused or hostile CN sends that an honest one never does (DESIGN.md §9: a CN can
//! post any verb with any bytes on its own QPs). The MN must survive all of it; the conformance
//! scenarios, the fuzz targets, the property tests and `omw cn`'s hostile subcommands (run
//! against a real MN in the soft-RoCE VM) send it through this one API, kept apart from the
//! honest [`CnDriver`] an application uses.

use crate::cn::driver::{CnDriver, CnError, CnQp};
use crate::cn::ClientError;
use crate::device::RdmaBackend;
use crate::ids::Qpn;
use crate::wire::message::{AllocRequest, FreeRequest};

/// The hostile requests, on any [`CnDriver`].
pub trait HostileCn {
    type Error;
    /// An allocation request naming `access_qpns` (MN ends, as many as the pool's access
    /// windows; extra ones are dropped) for the access windows instead of the CN's own. Its
    /// answer comes like an honest request's, with the returned token.
    fn alloc_naming(&mut self, now: u64, access_qpns: &[Qpn]) -> Result<u32, Self::Error>;
    /// A free request for any entry address, held or not (a forged free). The MN's refusal
    /// comes with the returned token.
    fn free_entry(&mut self, entry_addr: u64) -> Result<u32, Self::Error>;
    /// Any bytes (up to a message slot) as a request on any of the CN's QPs.
    fn send_raw(&mut self, qp: CnQp, bytes: &[u8]) -> Result<(), Self::Error>;
    /// Any bytes as a request on the Alloc QP of the CN's alloc chain `chain` (0: the first).
    fn send_raw_on_chain(&mut self, chain: usize, bytes: &[u8]) -> Result<(), Self::Error>;
}

impl<B: RdmaBackend, const N: usize, const S: usize> HostileCn for CnDriver<B, N, S> {
    type Error = CnError<B::Error>;

    fn alloc_naming(&mut self, now: u64, access_qpns: &[Qpn]) -> Result<u32, Self::Error> {
        let g = self.client().info().map(|i| i.access_qpns.len()).unwrap_or(0);
        // Only the access QPs are the hostile part: the reply target stays the one the client
        // chose for the chain the request goes on (each chain's reply lands in its own buffer;
        // naming chain 0's for every chain made the CN read a stale reply of its own).
        self.send_alloc_request(now, |_, req, len| {
            let mut r = AllocRequest::decode(&req[..len], g).map_err(ClientError::Wire)?;
            r.access_qpns = access_qpns.iter().copied().take(g).collect();
            r.encode(req).map_err(ClientError::Wire)
        })
    }

    fn free_entry(&mut self, entry_addr: u64) -> Result<u32, Self::Error> {
        let token = self.forged_token();
        let free = self.qps().free;
        self.send_request(free, Some(token), true, &FreeRequest { token, entry_addr }.encode())?;
        Ok(token)
    }

    fn send_raw(&mut self, qp: CnQp, bytes: &[u8]) -> Result<(), Self::Error> {
        let q = self.qps().get(qp).ok_or(CnError::NoSuchQp(qp))?;
        self.send_request(q, None, false, bytes)
    }

    fn send_raw_on_chain(&mut self, chain: usize, bytes: &[u8]) -> Result<(), Self::Error> {
        let q = self.alloc_qp(chain).ok_or(CnError::NoSuchQp(CnQp::Alloc))?;
        self.send_request(q, None, false, bytes)
    }
}
