//! `FaultInjector<B>`: seeded, deterministic faults in front of any [`RdmaBackend`] —
//! smoltcp's `phy::FaultInjector` for RDMA. Behind the `test-nic` feature.
//!
//! Why a wrapper and not a feature of each backend: a fault test (the MN repairs a lap whose
//! bind failed, a CN whose QP went to ERR resynchronises, a registration failure stops
//! provisioning cleanly) then runs unchanged on the test NIC, the loopback model, the FPGA double
//! or verbs.
//!
//! Every fault produces only what a device may legally produce (IBTA Vol. 1 ch. 10.8 and 11.4;
//! `ibv_post_send(3)`, `ibv_poll_cq(3)`):
//! - [`Fault::FailSend`]: the matching post is *not* given to the device; it completes with the
//!   chosen status and the QP behaves as in ERR from then on: later posts on it (send and
//!   receive) complete with `WR_FLUSH_ERR` and `qp_state` says `Err`, until `reset_qp`. Work
//!   posted before it is ahead of it in the queue and keeps its device outcome; the injected
//!   completions are delivered only after the device reports that work done (`outstanding` is
//!   0 and its CQ drained), so a QP's completions stay in posting order (RC, IBTA 10.8.5). A
//!   remote status (`REM_ACCESS_ERR` ...) is reported without erroring the peer: the device
//!   never saw the request.
//! - [`Fault::FailRecv`]: the same for a posted receive (its completion `WR_FLUSH_ERR`, the QP
//!   in ERR).
//! - [`Fault::ErrorQp`]: the QP enters ERR asynchronously just before the matching post (which
//!   is flushed): from then on whatever the device completes on it — work already posted — is
//!   reported `WR_FLUSH_ERR` (flushed work has no defined effect, so data it moved is no
//!   contradiction), later posts are flushed too.
//! - [`Fault::Delay`]: completions of the matching QP are held back for a number of polls of
//!   their queue. Everything behind a held completion on that queue waits with it, so order
//!   within a QP is never changed; other QPs' completions overtake it, which RC allows.
//! - [`Fault::FailRegMr`] / [`Fault::FailAllocMw`]: the call fails with
//!   [`FaultError::Injected`] and the device is not asked.
//!
//! Nothing is corrupted: no byte of memory, no key, no binding is changed by the injector.

use crate::chain::mlx5::Mlx5Arm;
use crate::chain::mlx5::Mlx5Chain;
use crate::device::DataPath;
use crate::device::OffloadRings;
use crate::device::Provision;
use crate::device::WindowState;
use core::fmt;

use heapless::{Deque, Vec};

use crate::access::AccessFlags;
use crate::device::{Capabilities, Completion, Domain, MrKeys, MwBinding, QpState, RdmaBackend, WcOpcode, WcStatus};
use crate::ids::{Qpn, Rkey};
use crate::wire::wqe::{QueueSel, RecvWqe, Wqe};

/// QPs the injector can hold state for at once (an errored QP, held completions).
pub const TRACKED_QPS: usize = 16;
/// Completions held or injected per queue of a tracked QP.
pub const HELD_PER_QUEUE: usize = 32;
/// Rules armed at once.
pub const MAX_RULES: usize = 8;

/// What goes wrong.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Fault {
    /// A `post_send` completes with this (error) status; the QP is in ERR from then on.
    FailSend(WcStatus),
    /// A `post_recv` completes with `WR_FLUSH_ERR`; the QP is in ERR from then on.
    FailRecv,
    /// The QP enters ERR before a `post_send`: it and everything the device still completes
    /// on that QP are flushed.
    ErrorQp,
    /// Armed by the matching `post_send`: from then on every completion the device reports on
    /// that QP (both queues) is held for this many further polls of its queue.
    Delay(u32),
    FailRegMr,
    FailAllocMw,
    /// `reset_qp` refuses, as libibverbs does for an rdma_cm-connected QP (its peer must
    /// reconnect instead).
    FailReset,
}

/// When a rule fires, counted over the calls it matches (`post_send` for the send faults and
/// `Delay`, `post_recv` for `FailRecv`, `reg_mr` / `alloc_mw` / `reset_qp` for theirs).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Trigger {
    /// The n-th matching call (1-based), once.
    Nth(u32),
    /// Every matching call with probability `per_65536 / 65536`, from the seeded generator.
    Chance { per_65536: u32 },
}

/// A fault, which calls it applies to and when.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Rule {
    pub fault: Fault,
    /// Only calls on this QP (`None`: any QP; ignored by the registration faults).
    pub qp: Option<Qpn>,
    pub trigger: Trigger,
}

/// The calls the injector itself refused.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum FaultOp {
    RegMr,
    AllocMw,
    ResetQp,
}

/// A call's failure: the device's own, or the injector's.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum FaultError<E> {
    Device(E),
    Injected(FaultOp),
    /// The injector's own tables are full (more QPs with faults, or more held completions,
    /// than its fixed capacities).
    Full,
}

impl<E: fmt::Display> fmt::Display for FaultError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FaultError::Device(e) => write!(f, "{e}"),
            FaultError::Injected(op) => write!(f, "injected failure of {op:?}"),
            FaultError::Full => f.write_str("fault injector tables full"),
        }
    }
}

/// What the injector did so far.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct FaultStats {
    pub injected: u32,
    pub delayed: u32,
    pub flushed: u32,
}

#[derive(Default)]
struct Lane {
    /// Completions taken from the device, with the poll count at which each may be delivered.
    held: Deque<(Completion, u32), HELD_PER_QUEUE>,
    /// Completions the injector made, delivered after everything the device still owes.
    injected: Deque<Completion, HELD_PER_QUEUE>,
    polls: u32,
}

struct Track {
    qp: Qpn,
    /// In ERR as far as the caller can see.
    errored: bool,
    /// Whatever the device completes from now on is reported flushed ([`Fault::ErrorQp`]).
    flush_device: bool,
    delay: u32,
    lanes: [Lane; 2],
}

const fn lane(q: QueueSel) -> usize {
    match q {
        QueueSel::Send => 0,
        QueueSel::Recv => 1,
    }
}

/// `B` with faults. See the module doc for what each fault does.
pub struct FaultInjector<B> {
    inner: B,
    rng: u64,
    rules: Vec<(Rule, u32), MAX_RULES>,
    tracks: Vec<Track, TRACKED_QPS>,
    pub stats: FaultStats,
}

impl<B> fmt::Debug for FaultInjector<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultInjector").field("rules", &self.rules.len()).field("stats", &self.stats).finish()
    }
}

impl<B: RdmaBackend> FaultInjector<B> {
    pub fn new(inner: B, seed: u64) -> Self {
        // splitmix64 of the seed: distinct seeds give distinct, never-zero xorshift states
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        let rng = (z ^ (z >> 31)) | 1;
        FaultInjector { inner, rng, rules: Vec::new(), tracks: Vec::new(), stats: FaultStats::default() }
    }
    pub fn inner(&self) -> &B {
        &self.inner
    }
    pub fn inner_mut(&mut self) -> &mut B {
        &mut self.inner
    }
    pub fn into_inner(self) -> B {
        self.inner
    }

    /// Arm a rule; refused when [`MAX_RULES`] are armed.
    pub fn arm(&mut self, rule: Rule) -> Result<(), Rule> {
        self.rules.push((rule, 0)).map_err(|(r, _)| r)
    }
    /// Put `qp` into ERR now, as [`Fault::ErrorQp`] does.
    pub fn error_qp(&mut self, qp: Qpn) -> Result<(), FaultError<B::Error>> {
        let t = self.track(qp)?;
        t.errored = true;
        t.flush_device = true;
        self.stats.injected += 1;
        Ok(())
    }

    /// xorshift64*: deterministic for a seed.
    fn next_rand(&mut self) -> u32 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as u32
    }

    /// The first armed rule that matches `pred` and fires now.
    fn fire(&mut self, qp: Option<Qpn>, pred: impl Fn(Fault) -> bool) -> Option<Fault> {
        for i in 0..self.rules.len() {
            let (rule, seen) = self.rules[i];
            if !pred(rule.fault) || (rule.qp.is_some() && qp.is_some() && rule.qp != qp) {
                continue;
            }
            let seen = seen + 1;
            self.rules[i].1 = seen;
            let fires = match rule.trigger {
                Trigger::Nth(n) => seen == n,
                Trigger::Chance { per_65536 } => (self.next_rand() >> 16) < per_65536,
            };
            if fires {
                return Some(rule.fault);
            }
        }
        None
    }

    fn find(&self, qp: Qpn) -> Option<usize> {
        self.tracks.iter().position(|t| t.qp == qp)
    }

    fn track(&mut self, qp: Qpn) -> Result<&mut Track, FaultError<B::Error>> {
        let i = match self.find(qp) {
            Some(i) => i,
            None => {
                let t = Track {
                    qp,
                    errored: false,
                    flush_device: false,
                    delay: 0,
                    lanes: [Lane::default(), Lane::default()],
                };
                self.tracks.push(t).map_err(|_| FaultError::Full)?;
                self.tracks.len() - 1
            }
        };
        Ok(&mut self.tracks[i])
    }

    fn inject(&mut self, qp: Qpn, q: QueueSel, c: Completion) -> Result<(), FaultError<B::Error>> {
        let t = self.track(qp)?;
        t.lanes[lane(q)].injected.push_back(c).map_err(|_| FaultError::Full)
    }

    fn failed(qp: Qpn, wr_id: u64, opcode: WcOpcode, status: WcStatus) -> Completion {
        Completion { wr_id, status, opcode, qpn: qp, byte_len: 0, imm: None, invalidated: None }
    }
}

impl<B: RdmaBackend> DataPath for FaultInjector<B> {
    type Error = FaultError<B::Error>;
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn post_send(&mut self, qp: Qpn, wqe: &Wqe) -> Result<(), Self::Error> {
        let opcode = WcOpcode::Send(wqe.opcode);
        if !self.find(qp).is_some_and(|i| self.tracks[i].errored) {
            match self.fire(Some(qp), |f| matches!(f, Fault::FailSend(_) | Fault::ErrorQp | Fault::Delay(_))) {
                Some(Fault::FailSend(status)) => {
                    self.inject(qp, QueueSel::Send, Self::failed(qp, wqe.wr_id, opcode, status))?;
                    self.track(qp)?.errored = true;
                    self.stats.injected += 1;
                    return Ok(());
                }
                Some(Fault::ErrorQp) => self.error_qp(qp)?,
                Some(Fault::Delay(n)) => self.track(qp)?.delay = n,
                _ => {}
            }
        }
        if self.find(qp).is_some_and(|i| self.tracks[i].errored) {
            self.inject(qp, QueueSel::Send, Self::failed(qp, wqe.wr_id, opcode, WcStatus::WrFlushErr))?;
            self.stats.flushed += 1;
            return Ok(());
        }
        self.inner.post_send(qp, wqe).map_err(FaultError::Device)
    }
    fn post_recv(&mut self, qp: Qpn, wqe: &RecvWqe) -> Result<(), Self::Error> {
        let errored = self.find(qp).is_some_and(|i| self.tracks[i].errored);
        if errored || self.fire(Some(qp), |f| f == Fault::FailRecv).is_some() {
            self.inject(qp, QueueSel::Recv, Self::failed(qp, wqe.wr_id, WcOpcode::Recv, WcStatus::WrFlushErr))?;
            self.track(qp)?.errored = true;
            match errored {
                true => self.stats.flushed += 1,
                false => self.stats.injected += 1,
            }
            return Ok(());
        }
        self.inner.post_recv(qp, wqe).map_err(FaultError::Device)
    }
    fn poll_cq(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize, Self::Error> {
        let Some(i) = self.find(qp) else {
            return self.inner.poll_cq(qp, queue, out).map_err(FaultError::Device);
        };
        let l = lane(queue);
        // take what the device has, in order, into the lane (as far as it holds)
        let mut drained = false;
        let mut buf = [Completion::EMPTY; 8];
        loop {
            let room = HELD_PER_QUEUE - self.tracks[i].lanes[l].held.len();
            if room == 0 {
                break;
            }
            let want = room.min(buf.len());
            let n = self.inner.poll_cq(qp, queue, &mut buf[..want]).map_err(FaultError::Device)?;
            let t = &mut self.tracks[i];
            for c in &buf[..n] {
                let mut c = *c;
                if t.flush_device {
                    c = Completion { status: WcStatus::WrFlushErr, byte_len: 0, imm: None, ..c };
                    self.stats.flushed += 1;
                }
                let release = t.lanes[l].polls.saturating_add(t.delay);
                if t.delay > 0 {
                    self.stats.delayed += 1;
                }
                let pushed = t.lanes[l].held.push_back((c, release));
                debug_assert!(pushed.is_ok(), "no more completions taken from the device than the lane has room for");
            }
            if n < want {
                drained = true;
                break;
            }
        }
        let device_done = drained && self.inner.outstanding(qp, queue).is_none_or(|n| n == 0);
        let t = &mut self.tracks[i];
        let lane = &mut t.lanes[l];
        let mut k = 0;
        while k < out.len() {
            match lane.held.front() {
                Some((c, at)) if *at <= lane.polls => {
                    out[k] = *c;
                    lane.held.pop_front();
                    k += 1;
                }
                Some(_) => break,
                None if device_done => match lane.injected.pop_front() {
                    Some(c) => {
                        out[k] = c;
                        k += 1;
                    }
                    None => break,
                },
                None => break,
            }
        }
        lane.polls = lane.polls.wrapping_add(1);
        Ok(k)
    }
    fn enable(&mut self, qp: Qpn, queue: QueueSel, count: u64) -> Result<(), Self::Error> {
        self.inner.enable(qp, queue, count).map_err(FaultError::Device)
    }
    /// The device's reset, and the injector forgets the QP: not in ERR, nothing held (a reset
    /// empties the CQs).
    fn reset_qp(&mut self, qp: Qpn) -> Result<(), Self::Error> {
        if self.fire(Some(qp), |f| f == Fault::FailReset).is_some() {
            self.stats.injected += 1;
            return Err(FaultError::Injected(FaultOp::ResetQp));
        }
        if let Some(i) = self.find(qp) {
            self.tracks.swap_remove(i);
        }
        self.inner.reset_qp(qp).map_err(FaultError::Device)
    }
    fn destroy_qp(&mut self, qp: Qpn) -> Result<(), Self::Error> {
        if let Some(i) = self.find(qp) {
            self.tracks.swap_remove(i);
        }
        self.inner.destroy_qp(qp).map_err(FaultError::Device)
    }
    fn qp_state(&self, qp: Qpn) -> Result<QpState, Self::Error> {
        let s = self.inner.qp_state(qp).map_err(FaultError::Device)?;
        Ok(match self.find(qp).is_some_and(|i| self.tracks[i].errored) {
            true => QpState::Err,
            false => s,
        })
    }
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> Result<(), Self::Error> {
        self.inner.read_local(addr, buf).map_err(FaultError::Device)
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<(), Self::Error> {
        self.inner.write_local(addr, data).map_err(FaultError::Device)
    }
    /// The device's count: what the injector completed itself is completed, not outstanding.
    fn outstanding(&self, qp: Qpn, queue: QueueSel) -> Option<u64> {
        self.inner.outstanding(qp, queue)
    }
}

impl<B: RdmaBackend> Provision for FaultInjector<B> {
    fn reg_mr(&mut self, domain: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys, Self::Error> {
        if self.fire(None, |f| f == Fault::FailRegMr).is_some() {
            self.stats.injected += 1;
            return Err(FaultError::Injected(FaultOp::RegMr));
        }
        self.inner.reg_mr(domain, addr, len, access).map_err(FaultError::Device)
    }
    fn alloc_mw(&mut self) -> Result<Rkey, Self::Error> {
        if self.fire(None, |f| f == Fault::FailAllocMw).is_some() {
            self.stats.injected += 1;
            return Err(FaultError::Injected(FaultOp::AllocMw));
        }
        self.inner.alloc_mw().map_err(FaultError::Device)
    }
    fn alloc_memory(&mut self, len: u64, align: u64) -> Result<u64, Self::Error> {
        self.inner.alloc_memory(len, align).map_err(FaultError::Device)
    }
    fn create_loopback_qp(&mut self, domain: Domain, managed_send_depth: Option<u32>) -> Result<Qpn, Self::Error> {
        self.inner.create_loopback_qp(domain, managed_send_depth).map_err(FaultError::Device)
    }
}

impl<B: RdmaBackend> OffloadRings for FaultInjector<B> {
    fn ring_base(&self, qp: Qpn, queue: QueueSel) -> Result<u64, Self::Error> {
        self.inner.ring_base(qp, queue).map_err(FaultError::Device)
    }
    fn ring_keys(&self, domain: Domain) -> Result<MrKeys, Self::Error> {
        self.inner.ring_keys(domain).map_err(FaultError::Device)
    }
    fn send_wqes_executed(&self, qp: Qpn) -> Option<u64> {
        self.inner.send_wqes_executed(qp)
    }
    fn recv_doorbell(&self, qp: Qpn) -> Result<Option<crate::device::RecvDoorbell>, Self::Error> {
        self.inner.recv_doorbell(qp).map_err(FaultError::Device)
    }
}

impl<B: RdmaBackend> WindowState for FaultInjector<B> {
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        self.inner.mw_binding(rkey)
    }
    fn mw_span(&self, rkey: Rkey) -> Option<(u64, u64)> {
        self.inner.mw_span(rkey)
    }
}

/// Forwarded: faults act on posts and completions, which an mlx5-form chain's rings make too.
impl<B: RdmaBackend + Mlx5Arm> Mlx5Arm for FaultInjector<B> {
    fn cq_numbers(&self, loop_qp: Qpn, mgmt_qp: Qpn) -> Option<[u32; 3]> {
        self.inner.cq_numbers(loop_qp, mgmt_qp)
    }
    fn cq_producer_indices(&self, loop_qp: Qpn, mgmt_qp: Qpn) -> [u32; 3] {
        self.inner.cq_producer_indices(loop_qp, mgmt_qp)
    }
    fn arm_mlx5(&mut self, chain: &Mlx5Chain, recv_copies: u32) -> Option<Result<(), Self::Error>> {
        self.inner.arm_mlx5(chain, recv_copies).map(|r| r.map_err(FaultError::Device))
    }
}

#[cfg(test)]
mod tests;
