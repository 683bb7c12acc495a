//! [`HostView`]: one host of the fabric seen through the core's backend contract.

use crate::addr::{HostId, QpAddr};
use crate::error::LoopbackError;
use crate::fabric::Fabric;
use crate::protection::MwState;
use crate::protection::PdId;
use omw_core::access::AccessFlags;
use omw_core::chain::mlx5::Mlx5Arm;
use omw_core::device::DataPath;
use omw_core::device::OffloadRings;
use omw_core::device::Provision;
use omw_core::device::WindowState;
use omw_core::device::{Capabilities, Completion, Domain, MrKeys, MwBinding, QpState};
use omw_core::ids::{Qpn, Rkey};
use omw_core::wire::wqe::{QueueSel, RecvWqe, Wqe};

/// A `&mut Fabric` plus the host it speaks for. [`Domain::CnFacing`] registrations and every
/// window go to PD 0; [`Domain::MnPrivate`] ones to the PD given with
/// [`HostView::with_private_pd`] (refused without one). `poll_cq` runs the whole fabric until idle first (bounded by
/// `NicConfig::poll_max_steps`), so a caller that polls in a loop always makes progress.
#[derive(Debug)]
pub struct HostView<'a> {
    fabric: &'a mut Fabric,
    host: HostId,
    private_pd: Option<PdId>,
}

impl Fabric {
    /// A view of one host implementing [`omw_core::device::RdmaBackend`]. Here, not in fabric.rs,
    /// so that the fabric does not depend on its own view (scripts/import-cycles).
    pub fn view(&mut self, h: HostId) -> HostView<'_> {
        HostView::new(self, h)
    }
}

impl<'a> HostView<'a> {
    pub fn new(fabric: &'a mut Fabric, host: HostId) -> Self {
        HostView { fabric, host, private_pd: None }
    }
    pub fn with_private_pd(mut self, pd: PdId) -> Self {
        self.private_pd = Some(pd);
        self
    }
    fn pd(&self, d: Domain) -> Result<PdId, LoopbackError> {
        match d {
            Domain::CnFacing => Ok(PdId(0)),
            Domain::MnPrivate => self.private_pd.ok_or(LoopbackError::NoSuchPd { host: self.host, pd: u32::MAX }),
        }
    }
    pub fn host(&self) -> HostId {
        self.host
    }
    pub fn fabric(&mut self) -> &mut Fabric {
        self.fabric
    }
    pub fn fabric_ref(&self) -> &Fabric {
        self.fabric
    }
    pub fn qp(&self, qpn: Qpn) -> QpAddr {
        QpAddr::new(self.host, qpn)
    }
}

impl DataPath for HostView<'_> {
    type Error = LoopbackError;
    fn capabilities(&self) -> Capabilities {
        self.fabric.capabilities()
    }
    fn post_send(&mut self, qp: Qpn, wqe: &Wqe) -> Result<(), LoopbackError> {
        self.fabric.post_send(self.qp(qp), wqe)
    }
    fn post_recv(&mut self, qp: Qpn, wqe: &RecvWqe) -> Result<(), LoopbackError> {
        self.fabric.post_recv(self.qp(qp), wqe)
    }
    fn poll_cq(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize, LoopbackError> {
        self.fabric.poll_cq(self.qp(qp), queue, out)
    }
    fn enable(&mut self, qp: Qpn, queue: QueueSel, count: u64) -> Result<(), LoopbackError> {
        self.fabric.enable(self.qp(qp), queue, count)
    }
    fn reset_qp(&mut self, qp: Qpn) -> Result<(), LoopbackError> {
        self.fabric.reset_qp(self.qp(qp))
    }
    fn destroy_qp(&mut self, qp: Qpn) -> Result<(), LoopbackError> {
        self.fabric.destroy_qp(self.qp(qp))
    }
    fn qp_state(&self, qp: Qpn) -> Result<QpState, LoopbackError> {
        self.fabric.qp_state(self.qp(qp))
    }
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> Result<(), LoopbackError> {
        self.fabric.read(self.host, addr, buf)
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<(), LoopbackError> {
        self.fabric.write(self.host, addr, data)
    }
    fn outstanding(&self, qp: Qpn, queue: QueueSel) -> Option<u64> {
        self.fabric.outstanding(self.qp(qp), queue)
    }
}

impl Provision for HostView<'_> {
    fn reg_mr(&mut self, d: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys, LoopbackError> {
        let pd = self.pd(d)?;
        self.fabric.reg_mr(self.host, pd, addr, len, access)
    }
    fn alloc_mw(&mut self) -> Result<Rkey, LoopbackError> {
        self.fabric.alloc_mw(self.host, PdId(0))
    }
    fn alloc_memory(&mut self, len: u64, align: u64) -> Result<u64, LoopbackError> {
        self.fabric.alloc(self.host, len, align)
    }
    fn create_loopback_qp(&mut self, d: Domain, managed: Option<u32>) -> Result<Qpn, LoopbackError> {
        let pd = self.pd(d)?;
        Ok(self.fabric.create_loopback_qp(self.host, pd, managed)?.qpn)
    }
}

impl OffloadRings for HostView<'_> {
    fn ring_base(&self, qp: Qpn, queue: QueueSel) -> Result<u64, LoopbackError> {
        self.fabric.ring_base(self.qp(qp), queue)
    }
    fn ring_keys(&self, d: Domain) -> Result<MrKeys, LoopbackError> {
        self.fabric.ring_keys_in(self.host, self.pd(d)?)
    }
    fn send_wqes_executed(&self, qp: Qpn) -> Option<u64> {
        self.fabric.qp_stats(self.qp(qp)).ok().map(|s| s.wqes_executed)
    }
    fn recv_doorbell(&self, qp: Qpn) -> Result<Option<omw_core::device::RecvDoorbell>, LoopbackError> {
        self.fabric.recv_doorbell(self.qp(qp))
    }
}

impl WindowState for HostView<'_> {
    fn mw_span(&self, rkey: Rkey) -> Option<(u64, u64)> {
        let info = self.fabric.mw_binding(self.host, rkey.index())?;
        match info.state {
            MwState::Bound(b) if info.rkey == rkey => Some((b.addr, b.len)),
            _ => None,
        }
    }
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        let info = self.fabric.mw_binding(self.host, rkey.index())?;
        Some(match info.state {
            MwState::Free => MwBinding::Unbound,
            MwState::Bound(b) => MwBinding::Bound { rkey: info.rkey, qpn: b.qpn },
        })
    }
}

impl Mlx5Arm for HostView<'_> {
    fn cq_numbers(&self, loop_qp: Qpn, mgmt_qp: Qpn) -> Option<[u32; 3]> {
        let f = &self.fabric;
        Some([
            f.cq_number(self.qp(loop_qp), QueueSel::Send).ok()?,
            f.cq_number(self.qp(mgmt_qp), QueueSel::Send).ok()?,
            f.cq_number(self.qp(mgmt_qp), QueueSel::Recv).ok()?,
        ])
    }
    fn arm_mlx5(
        &mut self,
        chain: &omw_core::chain::mlx5::Mlx5Chain,
        recv_copies: u32,
    ) -> Option<Result<(), LoopbackError>> {
        let q = |v: u32| Qpn::new(v).map(|q| self.qp(q)).map_err(|_| LoopbackError::BadArgument("chain QP number"));
        let qps = match (q(chain.qpns[0]), q(chain.qpns[1])) {
            (Ok(a), Ok(b)) => [a, b],
            (Err(e), _) | (_, Err(e)) => return Some(Err(e)),
        };
        Some(self.fabric.arm_mlx5(qps, chain, recv_copies))
    }
    fn cq_producer_indices(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> [u32; 3] {
        [0; 3]
    }
}
