//! `Tracer<B>`: every call a driver makes on an [`RdmaBackend`], and its result, handed to a
//! hook — smoltcp's `phy::Tracer` for RDMA. Behind the `test-nic` feature.
//!
//! Why: a conformance or fault test wants to see what the MN or a CN actually asked the device
//! to do (which QP a bind went to, which registrations were made with which rights) on any
//! backend, without each backend growing its own log. Nothing is buffered or allocated: the
//! hook sees borrowed views of the arguments and results while the call is on the stack.

use crate::chain::mlx5::Mlx5Arm;
use crate::chain::mlx5::Mlx5Chain;
use crate::device::DataPath;
use crate::device::OffloadRings;
use crate::device::Provision;
use crate::device::WindowState;
use core::cell::RefCell;
use core::fmt;

use crate::access::AccessFlags;
use crate::device::{Capabilities, Completion, Domain, MrKeys, MwBinding, QpState, RdmaBackend};
use crate::ids::{Qpn, Rkey};
use crate::wire::wqe::{QueueSel, RecvWqe, Wqe};

/// A call's result as the hook sees it: the value, or the backend's error as text.
pub type Outcome<'a, T> = Result<T, &'a dyn fmt::Display>;

/// One trait call, after it returned.
#[derive(Clone, Copy)]
#[non_exhaustive]
pub enum TraceEvent<'a> {
    Capabilities(Capabilities),
    PostSend {
        qp: Qpn,
        wqe: &'a Wqe,
        result: Outcome<'a, ()>,
    },
    PostRecv {
        qp: Qpn,
        wqe: &'a RecvWqe,
        result: Outcome<'a, ()>,
    },
    /// `completions`: what the call returned (empty on error).
    PollCq {
        qp: Qpn,
        queue: QueueSel,
        completions: &'a [Completion],
        result: Outcome<'a, usize>,
    },
    Enable {
        qp: Qpn,
        queue: QueueSel,
        count: u64,
        result: Outcome<'a, ()>,
    },
    ResetQp {
        qp: Qpn,
        result: Outcome<'a, ()>,
    },
    DestroyQp {
        qp: Qpn,
        result: Outcome<'a, ()>,
    },
    QpState {
        qp: Qpn,
        result: Outcome<'a, QpState>,
    },
    RegMr {
        domain: Domain,
        addr: u64,
        len: u64,
        access: AccessFlags,
        result: Outcome<'a, MrKeys>,
    },
    AllocMw {
        result: Outcome<'a, Rkey>,
    },
    ReadLocal {
        addr: u64,
        len: usize,
        result: Outcome<'a, ()>,
    },
    WriteLocal {
        addr: u64,
        data: &'a [u8],
        result: Outcome<'a, ()>,
    },
    RingBase {
        qp: Qpn,
        queue: QueueSel,
        result: Outcome<'a, u64>,
    },
    RingKeys {
        domain: Domain,
        result: Outcome<'a, MrKeys>,
    },
    SendWqesExecuted {
        qp: Qpn,
        result: Option<u64>,
    },
    RecvDoorbell {
        qp: Qpn,
        result: Outcome<'a, Option<crate::device::RecvDoorbell>>,
    },
    AllocMemory {
        len: u64,
        align: u64,
        result: Outcome<'a, u64>,
    },
    CreateLoopbackQp {
        domain: Domain,
        managed_send_depth: Option<u32>,
        result: Outcome<'a, Qpn>,
    },
    Outstanding {
        qp: Qpn,
        queue: QueueSel,
        result: Option<u64>,
    },
    MwBinding {
        rkey: Rkey,
        result: Option<MwBinding>,
    },
    MwSpan {
        rkey: Rkey,
        result: Option<(u64, u64)>,
    },
    CqNumbers {
        loop_qp: Qpn,
        mgmt_qp: Qpn,
        result: Option<[u32; 3]>,
    },
    CqProducerIndices {
        loop_qp: Qpn,
        mgmt_qp: Qpn,
        result: [u32; 3],
    },
    /// `None`: the device has no mlx5 form.
    ArmMlx5 {
        recv_copies: u32,
        result: Option<Outcome<'a, ()>>,
    },
}

impl TraceEvent<'_> {
    /// The trait method's name.
    pub fn name(&self) -> &'static str {
        match self {
            TraceEvent::Capabilities(_) => "capabilities",
            TraceEvent::PostSend { .. } => "post_send",
            TraceEvent::PostRecv { .. } => "post_recv",
            TraceEvent::PollCq { .. } => "poll_cq",
            TraceEvent::Enable { .. } => "enable",
            TraceEvent::ResetQp { .. } => "reset_qp",
            TraceEvent::DestroyQp { .. } => "destroy_qp",
            TraceEvent::QpState { .. } => "qp_state",
            TraceEvent::RegMr { .. } => "reg_mr",
            TraceEvent::AllocMw { .. } => "alloc_mw",
            TraceEvent::ReadLocal { .. } => "read_local",
            TraceEvent::WriteLocal { .. } => "write_local",
            TraceEvent::RingBase { .. } => "ring_base",
            TraceEvent::RingKeys { .. } => "ring_keys",
            TraceEvent::SendWqesExecuted { .. } => "send_wqes_executed",
            TraceEvent::RecvDoorbell { .. } => "recv_doorbell",
            TraceEvent::AllocMemory { .. } => "alloc_memory",
            TraceEvent::CreateLoopbackQp { .. } => "create_loopback_qp",
            TraceEvent::Outstanding { .. } => "outstanding",
            TraceEvent::MwBinding { .. } => "mw_binding",
            TraceEvent::MwSpan { .. } => "mw_span",
            TraceEvent::CqNumbers { .. } => "cq_numbers",
            TraceEvent::CqProducerIndices { .. } => "cq_producer_indices",
            TraceEvent::ArmMlx5 { .. } => "arm_mlx5",
        }
    }
    /// Whether the call failed (an `Err` result).
    pub fn failed(&self) -> bool {
        match self {
            TraceEvent::PostSend { result, .. }
            | TraceEvent::PostRecv { result, .. }
            | TraceEvent::Enable { result, .. }
            | TraceEvent::ResetQp { result, .. }
            | TraceEvent::DestroyQp { result, .. }
            | TraceEvent::ReadLocal { result, .. }
            | TraceEvent::WriteLocal { result, .. } => result.is_err(),
            TraceEvent::PollCq { result, .. } => result.is_err(),
            TraceEvent::QpState { result, .. } => result.is_err(),
            TraceEvent::RegMr { result, .. } | TraceEvent::RingKeys { result, .. } => result.is_err(),
            TraceEvent::AllocMw { result } => result.is_err(),
            TraceEvent::RingBase { result, .. } | TraceEvent::AllocMemory { result, .. } => result.is_err(),
            TraceEvent::RecvDoorbell { result, .. } => result.is_err(),
            TraceEvent::CreateLoopbackQp { result, .. } => result.is_err(),
            TraceEvent::ArmMlx5 { result, .. } => result.as_ref().is_some_and(|r| r.is_err()),
            TraceEvent::Capabilities(_)
            | TraceEvent::CqNumbers { .. }
            | TraceEvent::CqProducerIndices { .. }
            | TraceEvent::Outstanding { .. }
            | TraceEvent::MwBinding { .. }
            | TraceEvent::MwSpan { .. }
            | TraceEvent::SendWqesExecuted { .. } => false,
        }
    }
}

impl fmt::Debug for TraceEvent<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.name(), if self.failed() { " (failed)" } else { "" })
    }
}

/// `B` with every call reported to `hook` (a `RefCell` so the `&self` calls can report too; the
/// hook cannot reach the tracer, so the borrow never nests).
pub struct Tracer<B, F> {
    inner: B,
    hook: RefCell<F>,
}

impl<B, F> fmt::Debug for Tracer<B, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Tracer")
    }
}

impl<B: RdmaBackend, F: FnMut(&TraceEvent<'_>)> Tracer<B, F> {
    pub fn new(inner: B, hook: F) -> Self {
        Tracer { inner, hook: RefCell::new(hook) }
    }
    pub fn inner(&self) -> &B {
        &self.inner
    }
    pub fn inner_mut(&mut self) -> &mut B {
        &mut self.inner
    }
    pub fn into_inner(self) -> (B, F) {
        (self.inner, self.hook.into_inner())
    }
    fn emit(&self, ev: TraceEvent<'_>) {
        if let Ok(mut h) = self.hook.try_borrow_mut() {
            h(&ev);
        }
    }
}

fn outcome<T: Copy, E: fmt::Display>(r: &Result<T, E>) -> Outcome<'_, T> {
    match r {
        Ok(v) => Ok(*v),
        Err(e) => Err(e),
    }
}

impl<B: RdmaBackend, F: FnMut(&TraceEvent<'_>)> DataPath for Tracer<B, F> {
    type Error = B::Error;
    fn capabilities(&self) -> Capabilities {
        let c = self.inner.capabilities();
        self.emit(TraceEvent::Capabilities(c));
        c
    }
    fn post_send(&mut self, qp: Qpn, wqe: &Wqe) -> Result<(), B::Error> {
        let r = self.inner.post_send(qp, wqe);
        self.emit(TraceEvent::PostSend { qp, wqe, result: outcome(&r) });
        r
    }
    fn post_recv(&mut self, qp: Qpn, wqe: &RecvWqe) -> Result<(), B::Error> {
        let r = self.inner.post_recv(qp, wqe);
        self.emit(TraceEvent::PostRecv { qp, wqe, result: outcome(&r) });
        r
    }
    fn poll_cq(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize, B::Error> {
        let r = self.inner.poll_cq(qp, queue, out);
        let n = *r.as_ref().unwrap_or(&0);
        let completions = out.get(..n).unwrap_or(&[]);
        self.emit(TraceEvent::PollCq { qp, queue, completions, result: outcome(&r) });
        r
    }
    fn enable(&mut self, qp: Qpn, queue: QueueSel, count: u64) -> Result<(), B::Error> {
        let r = self.inner.enable(qp, queue, count);
        self.emit(TraceEvent::Enable { qp, queue, count, result: outcome(&r) });
        r
    }
    fn reset_qp(&mut self, qp: Qpn) -> Result<(), B::Error> {
        let r = self.inner.reset_qp(qp);
        self.emit(TraceEvent::ResetQp { qp, result: outcome(&r) });
        r
    }
    fn destroy_qp(&mut self, qp: Qpn) -> Result<(), B::Error> {
        let r = self.inner.destroy_qp(qp);
        self.emit(TraceEvent::DestroyQp { qp, result: outcome(&r) });
        r
    }
    fn qp_state(&self, qp: Qpn) -> Result<QpState, B::Error> {
        let r = self.inner.qp_state(qp);
        self.emit(TraceEvent::QpState { qp, result: outcome(&r) });
        r
    }
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> Result<(), B::Error> {
        let r = self.inner.read_local(addr, buf);
        self.emit(TraceEvent::ReadLocal { addr, len: buf.len(), result: outcome(&r) });
        r
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<(), B::Error> {
        let r = self.inner.write_local(addr, data);
        self.emit(TraceEvent::WriteLocal { addr, data, result: outcome(&r) });
        r
    }
    fn outstanding(&self, qp: Qpn, queue: QueueSel) -> Option<u64> {
        let r = self.inner.outstanding(qp, queue);
        self.emit(TraceEvent::Outstanding { qp, queue, result: r });
        r
    }
}

impl<B: RdmaBackend, F: FnMut(&TraceEvent<'_>)> Provision for Tracer<B, F> {
    fn reg_mr(&mut self, domain: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys, B::Error> {
        let r = self.inner.reg_mr(domain, addr, len, access);
        self.emit(TraceEvent::RegMr { domain, addr, len, access, result: outcome(&r) });
        r
    }
    fn alloc_mw(&mut self) -> Result<Rkey, B::Error> {
        let r = self.inner.alloc_mw();
        self.emit(TraceEvent::AllocMw { result: outcome(&r) });
        r
    }
    fn alloc_memory(&mut self, len: u64, align: u64) -> Result<u64, B::Error> {
        let r = self.inner.alloc_memory(len, align);
        self.emit(TraceEvent::AllocMemory { len, align, result: outcome(&r) });
        r
    }
    fn create_loopback_qp(&mut self, domain: Domain, managed_send_depth: Option<u32>) -> Result<Qpn, B::Error> {
        let r = self.inner.create_loopback_qp(domain, managed_send_depth);
        self.emit(TraceEvent::CreateLoopbackQp { domain, managed_send_depth, result: outcome(&r) });
        r
    }
}

impl<B: RdmaBackend, F: FnMut(&TraceEvent<'_>)> OffloadRings for Tracer<B, F> {
    fn ring_base(&self, qp: Qpn, queue: QueueSel) -> Result<u64, B::Error> {
        let r = self.inner.ring_base(qp, queue);
        self.emit(TraceEvent::RingBase { qp, queue, result: outcome(&r) });
        r
    }
    fn ring_keys(&self, domain: Domain) -> Result<MrKeys, B::Error> {
        let r = self.inner.ring_keys(domain);
        self.emit(TraceEvent::RingKeys { domain, result: outcome(&r) });
        r
    }
    fn send_wqes_executed(&self, qp: Qpn) -> Option<u64> {
        let r = self.inner.send_wqes_executed(qp);
        self.emit(TraceEvent::SendWqesExecuted { qp, result: r });
        r
    }
    fn recv_doorbell(&self, qp: Qpn) -> Result<Option<crate::device::RecvDoorbell>, B::Error> {
        let r = self.inner.recv_doorbell(qp);
        self.emit(TraceEvent::RecvDoorbell { qp, result: outcome(&r) });
        r
    }
}

impl<B: RdmaBackend, F: FnMut(&TraceEvent<'_>)> WindowState for Tracer<B, F> {
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        let r = self.inner.mw_binding(rkey);
        self.emit(TraceEvent::MwBinding { rkey, result: r });
        r
    }
    fn mw_span(&self, rkey: Rkey) -> Option<(u64, u64)> {
        let r = self.inner.mw_span(rkey);
        self.emit(TraceEvent::MwSpan { rkey, result: r });
        r
    }
}

impl<B: RdmaBackend + Mlx5Arm, F: FnMut(&TraceEvent<'_>)> Mlx5Arm for Tracer<B, F> {
    fn cq_numbers(&self, loop_qp: Qpn, mgmt_qp: Qpn) -> Option<[u32; 3]> {
        let r = self.inner.cq_numbers(loop_qp, mgmt_qp);
        self.emit(TraceEvent::CqNumbers { loop_qp, mgmt_qp, result: r });
        r
    }
    fn cq_producer_indices(&self, loop_qp: Qpn, mgmt_qp: Qpn) -> [u32; 3] {
        let r = self.inner.cq_producer_indices(loop_qp, mgmt_qp);
        self.emit(TraceEvent::CqProducerIndices { loop_qp, mgmt_qp, result: r });
        r
    }
    fn arm_mlx5(&mut self, chain: &Mlx5Chain, recv_copies: u32) -> Option<Result<(), Self::Error>> {
        let r = self.inner.arm_mlx5(chain, recv_copies);
        self.emit(TraceEvent::ArmMlx5 { recv_copies, result: r.as_ref().map(outcome) });
        r
    }
}

#[cfg(test)]
mod tests;
