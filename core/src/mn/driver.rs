//! The generic MN driver: runs a [`MemoryNode`] on any [`MnDevice`].
//!
//! Everything a backend would otherwise re-implement lives here once: carrying out the MN's
//! actions (arming chains, unbinding, sending messages), turning error completions of chain
//! QPs into events, and — in host-engine mode — receiving requests and running the host
//! engine. A backend supplies QPs, memory and verbs; a deployment (the loopback cluster, the
//! verbs daemon) adds connection management and calls [`MnDriver::poll`].

use crate::chain::arm::MnDevice;
use crate::chain::arm::{arm, ArmError};
use crate::chain::builder::{parse_chain_wr_id, ChainEnv};
use crate::chain::{ChainError, ChainKind, ChainLayout};
use crate::device::{Completion, Domain, ExecutionMode, MwBinding, QpState, WcStatus};
use crate::ids::{CnId, GroupId, Qpn, Rkey};
use crate::mn::host_engine::{
    run_lap, HostEngineError, HostRegions, Lap, LapContext, LapFailure, LapOutcome, OwnerWrite, Progress,
    MAX_OWNER_WRITES,
};
use crate::mn::{Action, AllocChainQps, CnQps, Event, MemoryNode, MnError, MnPort, MAX_ALLOC_CHAINS};
use crate::wire::memory_map::{
    ALLOC_REQUEST_BUF_OFF, FREE_REQUEST_BUF_OFF, REQUEST_BUF_LEN, SEND_BUF_COUNT, SEND_BUF_LEN, SEND_BUF_OFF,
};
use crate::wire::message::Request;
use crate::wire::wqe::{QueueSel, RecvWqe, Sge, Wqe};
use core::fmt;

/// wr_ids of the driver's own work requests (not chain steps).
pub const WR_ID_SEND: u64 = 0x4F4D_0300_0000_0000;
pub const WR_ID_UNBIND: u64 = 0x4F4D_0400_0000_0000;
pub const WR_ID_REQUEST: u64 = 0x4F4D_0500_0000_0000;
pub const WR_ID_ATOMIC: u64 = 0x4F4D_0600_0000_0000;
pub const WR_ID_REBIND: u64 = 0x4F4D_0700_0000_0000;

#[derive(Debug)]
#[non_exhaustive]
pub enum DriverError<E> {
    Backend(E),
    Chain(ChainError),
    Arm(ArmError<E>),
    HostEngine(HostEngineError<E>),
    UnknownSlot(u32),
    /// The control plane refused (no free CN slot, unknown CN, inconsistent configuration…).
    Node(MnError<core::convert::Infallible>),
    /// The CN has no scratch area in the memory map (its slot is beyond the map).
    NoScratch(CnId),
    /// The MN's own queue atomic through its private loopback QP failed (status) or never
    /// completed (None).
    MnAtomic(Option<WcStatus>),
}

impl<E: fmt::Display> fmt::Display for DriverError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DriverError::Backend(e) => write!(f, "backend: {e}"),
            DriverError::Chain(e) => write!(f, "chain: {e}"),
            DriverError::Arm(e) => write!(f, "{e}"),
            DriverError::HostEngine(e) => write!(f, "{e}"),
            DriverError::UnknownSlot(s) => write!(f, "no CN in slot {s}"),
            DriverError::Node(e) => write!(f, "MN: {e}"),
            DriverError::NoScratch(cn) => write!(f, "CN {cn} has no scratch area in the MN's memory map"),
            DriverError::MnAtomic(Some(s)) => write!(f, "MN queue atomic on its private loopback QP failed: {s}"),
            DriverError::MnAtomic(None) => f.write_str("MN queue atomic on its private loopback QP never completed"),
        }
    }
}

impl<E: fmt::Display> From<MnError<DriverError<E>>> for DriverError<E> {
    fn from(e: MnError<DriverError<E>>) -> Self {
        match e.split() {
            Ok(reason) => DriverError::Node(reason),
            Err(port) => port,
        }
    }
}

/// What the driver did on the MN CPU (host-engine work and exception handling).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct DriverStats {
    pub laps: u64,
    pub laps_failed: u64,
    pub cpu_steps: u64,
    pub device_ops: u64,
    pub chain_failures: u64,
    pub messages_sent: u64,
    /// Messages a CN's QP refused to take (its connection was already gone).
    pub messages_dropped: u64,
    /// QPs a failed lap left in ERR that the device would not reset (an rdma_cm-connected QP:
    /// its CN must reconnect); only that CN's later requests fail.
    pub qps_left_in_error: u64,
    /// Host-engine laps ended by a quiesce ([`Action::StopLaps`]) after their device step landed.
    pub laps_stopped: u64,
    /// The MN's own unbinds ([`Action::Unbind`]) after which a backend that reports window
    /// state still shows the window bound under the same key: the device refused the
    /// invalidate without the QPN check (`UncheckedUnbind`). The MN's checked push keeps such
    /// a group out of the queue; this says why groups go to quarantine.
    pub unbinds_refused: u64,
}

/// What one [`MnDriver::poll`] saw.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct PollReport {
    /// Events the MN CPU handled (requests in host-engine mode, failures in both).
    pub events: u32,
    pub laps_committed: u32,
    /// Host-engine laps resumed after a device step completed (continuations, not events).
    pub laps_advanced: u32,
}

/// Host-engine laps in flight at once (one per CN and chain at most).
pub const MAX_LAPS_IN_FLIGHT: usize = 16;

/// The requester's QPs a host-engine lap's software checks compare against.
struct LapQps {
    access: heapless::Vec<Qpn, { crate::geometry::MAX_GROUP_SIZE - 1 }>,
    free: Qpn,
    /// The lap's chain's scratch area (an alloc chain's own, or the CN's first).
    scratch: u64,
}

impl LapQps {
    fn context<'a>(&'a self, mn: &MemoryNode, cn: CnId, scratch: u64) -> LapContext<'a> {
        LapContext {
            requester: cn,
            scratch,
            access_qpns: &self.access,
            free_qpn: self.free,
            software_ownership_check: mn.config().software_ownership_check,
            max_polls: 100_000,
            geometry: mn.config().geometry,
            table_base: mn.map().table_base,
        }
    }
}

/// A host-engine lap waiting for one of its device steps.
#[derive(Debug)]
struct InFlight {
    cn: CnId,
    kind: ChainKind,
    /// Which of the CN's alloc chains (0 for the free chain).
    chain: u8,
    lap: Lap,
    /// When its current step was posted, and MN polls since.
    since: u64,
    rounds: u32,
    /// The entry a free request named (scrubbed when the lap commits).
    entry: Option<u64>,
    done: Option<WcStatus>,
}

pub struct MnDriver<B: MnDevice> {
    pub backend: B,
    pub mn: MemoryNode,
    pub regions: HostRegions,
    /// A QP of the MN the driver may post management unbinds on (CN-facing domain: the
    /// windows live there).
    pub admin_qp: Qpn,
    /// Offloaded mode: a loopback QP of the MN-private domain through which the MN CPU issues
    /// its queue atomics ([`MnPort::fetch_add`]), so they are atomic with respect to the
    /// chains' own. Without one the CPU's read-modify-write is used (right only where no chain
    /// runs concurrently: host-engine mode).
    pub atomic_qp: Option<Qpn>,
    /// Host-engine mode: run laps of different CNs side by side (post a step, move on, resume
    /// on its completion); each CN's laps of one kind stay in order (its next request is not
    /// received before its lap ends). Off: one lap at a time, each step busy-waited — the
    /// engine before this one, kept for measurements.
    pub concurrent_laps: bool,
    /// Host-engine mode: how long a posted step may take (MN clock, ns) before the lap fails
    /// with [`LapFailure::Timeout`] and its CN is evicted.
    pub step_budget_ns: u64,
    laps: heapless::Vec<InFlight, MAX_LAPS_IN_FLIGHT>,
    pub stats: DriverStats,
    send_seq: [u8; crate::mn::MAX_CNS],
    /// Host-engine mode: whether the request buffer of each alloc chain (then, last, of the
    /// free chain) is posted, per CN slot ([`rq_index`]).
    request_posted: [[bool; MAX_ALLOC_CHAINS + 1]; crate::mn::MAX_CNS],
    /// Offloaded mode: the send WQEs each CN slot's [Alloc, Free] management QP had executed
    /// when the CN connected (or the RNIC was reset), so a counter sample counts its laps.
    lap_base: [[u64; 2]; crate::mn::MAX_CNS],
    /// Offloaded mode: the management rings' WQE counts per lap [Alloc, Free] — one lap's
    /// worth of executed send WQEs — kept when the loop QPs are sized for them
    /// ([`MnDriver::create_loop_qps`]; building both chain layouts is too large for the stack
    /// of a timer deep in a reaction).
    lap_wqes: Option<[u64; 2]>,
    now: u64,
}

impl<B: MnDevice> fmt::Debug for MnDriver<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MnDriver").field("mode", &self.mn.mode()).field("stats", &self.stats).finish()
    }
}

struct Port<'a, B: MnDevice> {
    backend: &'a mut B,
    mn_mode: ExecutionMode,
    scratch: [Option<u64>; crate::mn::MAX_CNS],
    meta_lkey: u32,
    admin_qp: Qpn,
    atomic: Option<(Qpn, u64, u32, u32)>,
    send_seq: &'a mut [u8; crate::mn::MAX_CNS],
    stats: &'a mut DriverStats,
    /// QPs this reaction really reset (their posted receives are gone); distinct QPs of the CN
    /// records the reaction started with (it connects none).
    resets: heapless::Vec<Qpn, { MAX_QPS_PER_CN * crate::mn::MAX_CNS }>,
    /// Host-engine laps in flight ([`Action::StopLaps`] ends some).
    laps: &'a mut heapless::Vec<InFlight, MAX_LAPS_IN_FLIGHT>,
    /// Requests the MN decided to serve ([`Action::ServeLap`]); the driver runs their laps once
    /// the reaction is over.
    serve: heapless::Vec<(CnId, ChainKind, u8, u32), 4>,
    /// Owner changes of the laps [`Action::StopLaps`] ended: the driver hands them to the MN
    /// when its reaction returns.
    stopped_owners: heapless::Vec<OwnerWrite, { MAX_LAPS_IN_FLIGHT * MAX_OWNER_WRITES }>,
}

/// QPs the MN holds for one CN: the Alloc and Free QPs, their two chain loopback QPs
/// (offloaded), the access QPs, and each extra alloc chain's management and loop QPs.
const MAX_QPS_PER_CN: usize = 4 + crate::wire::message::MAX_ACCESS_QPS + 2 * (MAX_ALLOC_CHAINS - 1);

/// Where a chain's request buffer flag lives in [`MnDriver::request_posted`]'s row.
fn rq_index(kind: ChainKind, chain: u8) -> usize {
    match kind {
        ChainKind::Alloc => (chain as usize).min(MAX_ALLOC_CHAINS - 1),
        ChainKind::Free => MAX_ALLOC_CHAINS,
    }
}

impl<B: MnDevice> MnPort for Port<'_, B> {
    type Error = DriverError<B::Error>;
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), Self::Error> {
        self.backend.read_local(addr, buf).map_err(DriverError::Backend)
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), Self::Error> {
        self.backend.write_local(addr, data).map_err(DriverError::Backend)
    }
    fn mw_binding(&mut self, rkey: Rkey) -> Option<MwBinding> {
        self.backend.mw_binding(rkey)
    }
    fn mw_span(&mut self, rkey: Rkey) -> Option<(u64, u64)> {
        self.backend.mw_span(rkey)
    }
    fn fetch_add(&mut self, addr: u64, add: u64, boundary: u64) -> Result<u64, Self::Error> {
        let Some((qp, result, lkey, rkey)) = self.atomic else {
            let mut b = [0u8; 8];
            self.read(addr, &mut b)?;
            let old = u64::from_le_bytes(b);
            self.write(addr, &crate::wire::wqe::masked_add(old, add, boundary).to_le_bytes())?;
            return Ok(old);
        };
        let b = &mut *self.backend;
        let w = Wqe::masked_fetch_add(result, lkey, addr, rkey, add, boundary).with_wr_id(WR_ID_ATOMIC);
        if b.qp_state(qp).map_err(DriverError::Backend)? != QpState::Rts {
            b.reset_qp(qp).map_err(DriverError::Backend)?;
        }
        b.post_send(qp, &w).map_err(DriverError::Backend)?;
        match crate::mn::host_engine::wait_for(b, qp, w.wr_id, 100_000) {
            Ok(WcStatus::Success) => {}
            Ok(s) => return Err(DriverError::MnAtomic(Some(s))),
            Err(crate::mn::host_engine::WaitError::Backend(e)) => return Err(DriverError::Backend(e)),
            Err(crate::mn::host_engine::WaitError::Timeout) => return Err(DriverError::MnAtomic(None)),
        }
        let mut old = [0u8; 8];
        b.read_local(result, &mut old).map_err(DriverError::Backend)?;
        Ok(u64::from_le_bytes(old))
    }
    fn apply(&mut self, action: Action) -> Result<(), Self::Error> {
        let b = &mut *self.backend;
        match action {
            Action::ResetQp(q) => {
                // In host-engine mode a healthy QP keeps its state (and the CN its receives).
                if self.mn_mode == ExecutionMode::HostEngine
                    && b.qp_state(q).map_err(DriverError::Backend)? != QpState::Err
                {
                    return Ok(());
                }
                if self.mn_mode == ExecutionMode::HostEngine {
                    // best effort: a QP the device cannot reset (libibverbs refuses for
                    // rdma_cm QPs) is left to its CN, as for a failed lap's errored QPs (the
                    // driver's recovery counted it in `qps_left_in_error` already)
                    if b.reset_qp(q).is_err() {
                        return Ok(());
                    }
                } else {
                    b.reset_qp(q).map_err(DriverError::Backend)?;
                }
                if !self.resets.contains(&q) {
                    let pushed = self.resets.push(q);
                    debug_assert!(pushed.is_ok(), "distinct QPs of the CN records: MAX_QPS_PER_CN x MAX_CNS");
                }
                Ok(())
            }
            Action::ArmChain { kind, env } => {
                let layout = build(kind, &env).map_err(DriverError::Chain)?;
                arm(b, &layout, 1).map_err(DriverError::Arm)
            }
            Action::ServeLap { cn, kind, chain, len } => {
                let pushed = self.serve.push((cn, kind, chain, len));
                debug_assert!(pushed.is_ok(), "one request arrives per reaction (RequestArrived): 4 > 1");
                Ok(())
            }
            Action::Unbind { rkey } => {
                let w = Wqe::unbind_mw(rkey.0).with_wr_id(WR_ID_UNBIND | rkey.0 as u64);
                // The admin QP may be in error from an earlier refused unbind or an RNIC reset:
                // bring it back, and retry once if the unbind itself was flushed.
                for _attempt in 0..2 {
                    // Checked before every attempt: an attempt whose completion did not arrive
                    // within the poll budget may still take effect, and a backend that tracks
                    // bindings then already reports the window unbound — posting the unbind
                    // again would be refused (or invalidate a free window).
                    match b.mw_binding(rkey) {
                        Some(MwBinding::Unbound) => break,
                        Some(MwBinding::Bound { rkey: r, .. }) if r != rkey => break,
                        _ => {}
                    }
                    if b.qp_state(self.admin_qp).map_err(DriverError::Backend)? != QpState::Rts {
                        b.reset_qp(self.admin_qp).map_err(DriverError::Backend)?;
                    }
                    b.post_send(self.admin_qp, &w).map_err(DriverError::Backend)?;
                    match crate::mn::host_engine::wait_for(b, self.admin_qp, w.wr_id, 10_000) {
                        // An unknown binding state may mean "not bound": MW_BIND_ERR is then fine.
                        Ok(WcStatus::Success | WcStatus::MwBindErr) => break,
                        Ok(_) | Err(_) => continue,
                    }
                }
                if b.qp_state(self.admin_qp).map_err(DriverError::Backend)? != QpState::Rts {
                    b.reset_qp(self.admin_qp).map_err(DriverError::Backend)?;
                }
                if matches!(b.mw_binding(rkey), Some(MwBinding::Bound { rkey: r, .. }) if r == rkey) {
                    self.stats.unbinds_refused += 1;
                }
                Ok(())
            }
            Action::Send { slot, qp, bytes } => {
                let s = self.scratch.get(slot as usize).copied().flatten().ok_or(DriverError::UnknownSlot(slot))?;
                let seq = &mut self.send_seq[slot as usize];
                let buf = s + SEND_BUF_OFF + (*seq as u64 % SEND_BUF_COUNT) * SEND_BUF_LEN;
                *seq = seq.wrapping_add(1);
                b.write_local(buf, &bytes).map_err(DriverError::Backend)?;
                let w = Wqe::send(buf, self.meta_lkey, bytes.len() as u32).with_wr_id(WR_ID_SEND | slot as u64);
                // fire and forget: the CN may be slow to post receives (RNR retries); a QP that
                // refuses the post (the CN's connection is gone) loses the message — the MN
                // learns of the departure from the connection manager or the lease, and one
                // CN's dead QP must never fail the MN's reaction to anything else
                match b.post_send(qp, &w) {
                    Ok(()) => self.stats.messages_sent += 1,
                    Err(_) => self.stats.messages_dropped += 1,
                }
                Ok(())
            }
            Action::DisconnectMgmt { alloc, free } => {
                // best effort, as for a departure: a QP already gone is as good as destroyed
                let _ = b.destroy_qp(alloc);
                let _ = b.destroy_qp(free);
                Ok(())
            }
            Action::StopLaps { cn, alloc, free } => {
                let stop = |k: ChainKind, chain: u8| match k {
                    ChainKind::Alloc => alloc & (1 << chain) != 0,
                    ChainKind::Free => free,
                };
                let mut i = 0;
                while i < self.laps.len() {
                    let l = &self.laps[i];
                    if l.cn != cn || !stop(l.kind, l.chain) {
                        i += 1;
                        continue;
                    }
                    let (waiting, done) = (l.lap.waiting(), l.done.is_some());
                    // The lap's posted device step (a bind, an invalidation, a READ) must land
                    // or be flushed before the MN decides: wait for its completion; a device
                    // that never completes it gets the QP reset (which flushes it).
                    if let Some(w) = waiting {
                        let landed = done || crate::mn::host_engine::wait_for(b, w.qp, w.wr_id, 10_000).is_ok();
                        if !landed {
                            // best effort, as for a failed lap's errored QPs: a QP the device
                            // cannot reset is left to its CN (nothing of the lap runs on it)
                            if b.reset_qp(w.qp).is_ok() {
                                if !self.resets.contains(&w.qp) {
                                    let pushed = self.resets.push(w.qp);
                                    debug_assert!(
                                        pushed.is_ok(),
                                        "a lap waits on a QP of its CN: MAX_QPS_PER_CN x MAX_CNS"
                                    );
                                }
                            } else {
                                self.stats.qps_left_in_error += 1;
                            }
                        }
                    }
                    // its changes of MWTable owners are counted once the MN's reaction is over
                    for w in self.laps[i].lap.owner_writes().iter() {
                        let pushed = self.stopped_owners.push(w);
                        debug_assert!(
                            pushed.is_ok(),
                            "a reaction stops laps in flight only: MAX_LAPS_IN_FLIGHT x MAX_OWNER_WRITES"
                        );
                    }
                    self.laps.swap_remove(i);
                    self.stats.laps_stopped += 1;
                }
                Ok(())
            }
            Action::Rebind { rkey, qp, addr, len, lkey, access } => {
                // rxe binds a type-2 window only through a BIND_MW posted on the QP it is to
                // be associated with; a device that binds to another QP takes it on the admin QP
                let on = if b.capabilities().contains(crate::device::Capabilities::BIND_TO_OTHER_QP)
                    && self.mn_mode == ExecutionMode::Offloaded
                {
                    self.admin_qp
                } else {
                    qp
                };
                // best effort: a QP in error cannot take the bind; the MN sees the window
                // unbound afterwards and gives the group up
                if b.qp_state(on).map_err(DriverError::Backend)? == QpState::Err && b.reset_qp(on).is_err() {
                    return Ok(());
                }
                let w = Wqe::bind_mw(rkey.0, addr, len, lkey, qp.get(), access)
                    .with_flags(crate::wire::wqe::WqeFlags::SIGNALED)
                    .with_wr_id(WR_ID_REBIND | rkey.0 as u64);
                if b.post_send(on, &w).is_err() {
                    return Ok(());
                }
                let mut buf = [Completion::EMPTY; 8];
                for _ in 0..10_000 {
                    let n = b.poll_cq(on, QueueSel::Send, &mut buf).map_err(DriverError::Backend)?;
                    let mut mine = false;
                    for c in &buf[..n] {
                        if c.wr_id == w.wr_id {
                            mine = true;
                        } else if let Some(l) = self
                            .laps
                            .iter_mut()
                            .find(|l| l.lap.waiting().is_some_and(|s| s.qp == on && s.wr_id == c.wr_id))
                        {
                            // a lap's device step (rxe binds on the window's own QP, where the
                            // host engine's binds go too): it is that lap's
                            l.done = Some(c.status);
                        }
                        // Anything else is an earlier rebind's completion, whose wait gave up on
                        // it: restores run in host-engine mode only, where messages go on the
                        // Alloc QP and nothing else is posted on a window's QP.
                    }
                    if mine {
                        break;
                    }
                }
                Ok(())
            }
            Action::ReleaseQps { qps } => {
                // best effort, as for a departure
                for q in qps {
                    let _ = b.destroy_qp(q);
                }
                Ok(())
            }
            Action::ReleaseCn { qps } => {
                // best effort, as for a disconnect: a QP the device already lost is as good as
                // destroyed, and one CN's departure must not fail the MN's reaction
                for q in [Some(qps.alloc), Some(qps.free), qps.alloc_loop, qps.free_loop].into_iter().flatten() {
                    let _ = b.destroy_qp(q);
                }
                for q in qps.access.iter() {
                    let _ = b.destroy_qp(*q);
                }
                Ok(())
            }
        }
    }
}

/// Build a chain layout for a kind.
pub fn build(kind: ChainKind, env: &ChainEnv) -> Result<ChainLayout, ChainError> {
    match kind {
        ChainKind::Alloc => crate::chain::alloc::build_alloc_chain(env),
        ChainKind::Free => crate::chain::free::build_free_chain(env),
    }
}

impl<B: MnDevice> MnDriver<B> {
    pub fn new(backend: B, mut mn: MemoryNode, regions: HostRegions, admin_qp: Qpn) -> Self {
        // the chains publish their own receives where the device lets them
        // (`ChainEnv::posts_receives`)
        let caps = backend.capabilities();
        mn.set_chains_post_receives(caps.contains(crate::device::Capabilities::RECV_DOORBELL_RECORD));
        // the chains' ring sizes and bytes follow the form the device fetches
        mn.set_wqe_format(caps.wqe_format());
        MnDriver {
            backend,
            mn,
            regions,
            admin_qp,
            atomic_qp: None,
            concurrent_laps: true,
            step_budget_ns: 400_000_000,
            laps: heapless::Vec::new(),
            stats: DriverStats::default(),
            send_seq: [0; crate::mn::MAX_CNS],
            request_posted: [[false; MAX_ALLOC_CHAINS + 1]; crate::mn::MAX_CNS],
            lap_base: [[0; 2]; crate::mn::MAX_CNS],
            lap_wqes: None,
            now: 0,
        }
    }

    /// Register one proof word per CN slot for layouts that bind to the poster
    /// (`chain::builder::OwnerProof`): an allocation of its own, so no other registration of
    /// the private domain covers a word, and one MR over each word; then hand them to the MN.
    /// Only while no CN is connected (`false` otherwise, nothing registered).
    pub fn register_owner_proofs(&mut self) -> Result<bool, B::Error> {
        use crate::chain::builder::OwnerProof;
        if self.mn.cns().next().is_some() {
            return Ok(false);
        }
        let slots = self.mn.config().max_cns.clamp(1, crate::mn::MAX_CNS as u32);
        let len = u64::from(OwnerProof::LEN);
        let words = self.backend.alloc_memory(len * u64::from(slots), 64)?;
        let mut proofs: heapless::Vec<OwnerProof, { crate::mn::MAX_CNS }> = heapless::Vec::new();
        for i in 0..u64::from(slots) {
            let addr = words + i * len;
            let k = self.backend.reg_mr(
                crate::device::Domain::MnPrivate,
                addr,
                len,
                crate::access::AccessFlags::LOCAL_WRITE,
            )?;
            let pushed = proofs.push(OwnerProof { addr, lkey: k.lkey });
            debug_assert!(pushed.is_ok(), "slots <= MAX_CNS");
        }
        Ok(self.mn.set_owner_proofs(&proofs))
    }

    /// Lay the chains out for `v` ([`MemoryNode::set_chain_variant`]), first registering the
    /// CN slots' proof words where `v` binds to the poster and the MN offloads. `Ok(false)`:
    /// refused (a CN is connected, or `v` binds to the poster and CNs have several alloc chains).
    pub fn set_chain_variant(&mut self, v: crate::chain::variant::ChainVariant) -> Result<bool, B::Error> {
        let offloaded = self.mn.mode() == ExecutionMode::Offloaded;
        if v.binds_to_poster && offloaded && self.mn.owner_proof(0).is_none() && !self.register_owner_proofs()? {
            return Ok(false);
        }
        Ok(self.mn.set_chain_variant(v))
    }

    /// Give the driver a private-domain loopback QP for its queue atomics (offloaded mode).
    pub fn with_atomic_qp(mut self, qp: Qpn) -> Self {
        self.atomic_qp = Some(qp);
        self
    }

    fn port(&mut self) -> (&mut MemoryNode, Port<'_, B>) {
        let mut scratch = [None; crate::mn::MAX_CNS];
        for r in self.mn.cns() {
            scratch[r.slot as usize] = self.mn.map().scratch(r.slot);
        }
        // slots not yet occupied still have scratch space (connect sends before the record exists)
        for (i, s) in scratch.iter_mut().enumerate() {
            if s.is_none() {
                *s = self.mn.map().scratch(i as u32);
            }
        }
        let port = Port {
            backend: &mut self.backend,
            mn_mode: self.mn.mode(),
            scratch,
            meta_lkey: self.regions.cn_meta_lkey,
            admin_qp: self.admin_qp,
            atomic: self
                .atomic_qp
                .filter(|_| self.mn.mode() == ExecutionMode::Offloaded)
                .map(|q| (q, self.mn.map().mn_scratch, self.regions.meta_lkey, self.regions.meta_rkey)),
            send_seq: &mut self.send_seq,
            stats: &mut self.stats,
            resets: heapless::Vec::new(),
            laps: &mut self.laps,
            serve: heapless::Vec::new(),
            stopped_owners: heapless::Vec::new(),
        };
        (&mut self.mn, port)
    }

    /// Lay out a fresh pool: every group free.
    pub fn format(
        &mut self,
        rkey: impl Fn(GroupId, usize) -> Rkey,
        lkey: impl Fn(GroupId) -> u32,
    ) -> Result<(), DriverError<B::Error>> {
        let (mn, mut port) = self.port();
        mn.format(&mut port, rkey, lkey).map_err(DriverError::from)
    }

    /// [`MemoryNode::format_begin`] through the driver's port.
    pub fn format_begin(&mut self) -> Result<(), DriverError<B::Error>> {
        let (mn, mut port) = self.port();
        mn.format_begin(&mut port).map_err(DriverError::from)
    }

    /// [`MemoryNode::format_group`] through the driver's port.
    pub fn format_group(&mut self, g: GroupId, lkey: u32, rkeys: &[Rkey]) -> Result<(), DriverError<B::Error>> {
        let (mn, mut port) = self.port();
        mn.format_group(&mut port, g, lkey, rkeys).map_err(DriverError::from)
    }

    /// [`MemoryNode::format_end`] through the driver's port.
    pub fn format_end(&mut self) -> Result<(), DriverError<B::Error>> {
        let (mn, mut port) = self.port();
        mn.format_end(&mut port).map_err(DriverError::from)
    }

    /// A CN's two chain loop QPs (offloaded mode; `None` for the host engine): managed send
    /// queues of exactly their rings' depths, both ends in the plan's loop domain.
    pub fn create_loop_qps(&mut self) -> Result<Option<(Qpn, Qpn)>, DriverError<B::Error>> {
        if self.mn.mode() != ExecutionMode::Offloaded {
            return Ok(None);
        }
        let d = self.mn.chain_ring_depths().map_err(DriverError::Chain)?;
        let w = self.mn.chain_mgmt_wqes_per_lap().map_err(DriverError::Chain)?;
        self.lap_wqes = Some([w[0].max(1), w[1].max(1)]);
        let a =
            self.backend.create_loopback_qp(Domain::MnPrivate, Some(d[0][0] as u32)).map_err(DriverError::Backend)?;
        let f =
            self.backend.create_loopback_qp(Domain::MnPrivate, Some(d[1][0] as u32)).map_err(DriverError::Backend)?;
        Ok(Some((a, f)))
    }

    /// The loop QP of one more alloc chain of a CN (offloaded mode; `None` for the host
    /// engine): as the first alloc chain's ([`MnDriver::create_loop_qps`]).
    pub fn create_alloc_loop_qp(&mut self) -> Result<Option<Qpn>, DriverError<B::Error>> {
        if self.mn.mode() != ExecutionMode::Offloaded {
            return Ok(None);
        }
        let d = self.mn.chain_ring_depths().map_err(DriverError::Chain)?;
        let w = self.mn.chain_mgmt_wqes_per_lap().map_err(DriverError::Chain)?;
        self.lap_wqes = Some([w[0].max(1), w[1].max(1)]);
        let a =
            self.backend.create_loopback_qp(Domain::MnPrivate, Some(d[0][0] as u32)).map_err(DriverError::Backend)?;
        Ok(Some(a))
    }

    /// A CN connected (its QPs already up): register it, arm or post, tell it who it is.
    pub fn connect(&mut self, qps: CnQps) -> Result<CnId, DriverError<B::Error>> {
        self.connect_as(qps, None)
    }

    /// [`MnDriver::connect`] for a CN authenticated as `tenant` ([`MemoryNode::connect_as`]).
    pub fn connect_as(
        &mut self,
        qps: CnQps,
        tenant: Option<crate::mn::tenant::TenantId>,
    ) -> Result<CnId, DriverError<B::Error>> {
        self.connect_with_chains(qps, &[], tenant)
    }

    /// [`MnDriver::connect_as`] for a CN with extra alloc chains
    /// ([`MemoryNode::connect_with_chains`]).
    pub fn connect_with_chains(
        &mut self,
        qps: CnQps,
        extra: &[AllocChainQps],
        tenant: Option<crate::mn::tenant::TenantId>,
    ) -> Result<CnId, DriverError<B::Error>> {
        let mut alloc = self.backend.send_wqes_executed(qps.alloc);
        for c in extra {
            alloc = alloc.map(|a| a + self.backend.send_wqes_executed(c.mgmt).unwrap_or(0));
        }
        let base = [alloc, self.backend.send_wqes_executed(qps.free)];
        let (mn, mut port) = self.port();
        let cn = mn.connect_with_chains(&mut port, qps.clone(), extra, tenant).map_err(DriverError::from)?;
        let resets = core::mem::take(&mut port.resets);
        drop(port);
        if let Some(slot) = self.mn.cn(cn).map(|r| r.slot as usize) {
            if let Some(b) = self.lap_base.get_mut(slot) {
                *b = base.map(|x| x.unwrap_or(0));
            }
        }
        // the slot may have served a CN that left: none of the new CN's QPs has a buffer yet
        if let Some(p) = self.mn.cn(cn).and_then(|r| self.request_posted.get_mut(r.slot as usize)) {
            *p = [false; MAX_ALLOC_CHAINS + 1];
        }
        self.forget_receives(&resets);
        self.keep_request_buffers()?;
        Ok(cn)
    }

    pub fn handle(&mut self, now: u64, event: Event) -> Result<(), DriverError<B::Error>> {
        self.now = now;
        if event == Event::RnicReset {
            // the device's counters start again with its QPs
            self.rebase_lap_counters();
            // every QP went with the device, the MN's own too: bring them back now rather than
            // when their next use finds them in error — a backend that keeps its QPs' states
            // itself (DEVX) cannot tell from them (found by the ConnectX double: the first
            // queue atomic after a reset was flushed)
            self.backend.reset_qp(self.admin_qp).map_err(DriverError::Backend)?;
            if let Some(a) = self.atomic_qp {
                self.backend.reset_qp(a).map_err(DriverError::Backend)?;
            }
        }
        let (mn, mut port) = self.port();
        let r = mn.handle(now, event, &mut port).map_err(DriverError::from);
        let resets = core::mem::take(&mut port.resets);
        let serve = core::mem::take(&mut port.serve);
        let stopped = core::mem::take(&mut port.stopped_owners);
        for w in stopped {
            self.mn.account_owner_write(w);
        }
        self.forget_receives(&resets);
        // A reset discards posted work without completions: a lap waiting on such a QP has
        // lost its step (as a flush would report). A lap whose CN is gone ends.
        for l in self.laps.iter_mut() {
            if l.lap.waiting().is_some_and(|w| resets.contains(&w.qp)) {
                l.done = Some(WcStatus::WrFlushErr);
            }
        }
        let mn = &self.mn;
        self.laps.retain(|l| mn.cn(l.cn).is_some());
        r?;
        for (cn, kind, chain, len) in serve {
            self.serve_request(cn, kind, chain, len)?;
        }
        self.keep_request_buffers()
    }

    /// A reset dropped whatever receives these QPs had posted.
    fn forget_receives(&mut self, qps: &[Qpn]) {
        for qp in qps {
            if let Some((cn, kind, chain)) = self.mn.cn_of_mgmt_qp(*qp) {
                self.set_request_posted(cn, kind, chain, false);
            }
        }
    }

    fn set_request_posted(&mut self, cn: CnId, kind: ChainKind, chain: u8, v: bool) {
        if let Some(r) = self.mn.cn(cn) {
            if let Some(p) = self.request_posted.get_mut(r.slot as usize) {
                p[rq_index(kind, chain)] = v;
            }
        }
    }

    /// The one rule for host-engine request buffers: each management QP of an active CN has
    /// exactly one posted, unless a lap of that CN and kind holds it (the buffer's bytes are the
    /// lap's request until it ends; the CN's next request waits, its SEND retrying). Whatever
    /// happened — a lap ended, a request was answered without one, a reset dropped the receive,
    /// a CN connected — this is what puts the buffer back: every entry ends with it, and the
    /// serial engine runs it once it copied a request out.
    fn keep_request_buffers(&mut self) -> Result<(), DriverError<B::Error>> {
        if self.mn.mode() != ExecutionMode::HostEngine {
            return Ok(());
        }
        let cns: heapless::Vec<(CnId, u8), { crate::mn::MAX_CNS }> = self
            .mn
            .cns()
            .filter(|r| r.status == crate::mn::CnStatus::Active)
            .map(|r| (r.cn, r.alloc_chain_count()))
            .collect();
        for (cn, chains) in cns {
            for (kind, chain) in (0..chains).map(|j| (ChainKind::Alloc, j)).chain([(ChainKind::Free, 0)]) {
                if !self.laps.iter().any(|l| l.cn == cn && l.kind == kind && l.chain == chain) {
                    self.post_request_buffer(cn, kind, chain)?;
                }
            }
        }
        Ok(())
    }

    /// The scratch area of a CN's chain: alloc chain `chain`'s own, the CN's first for the free
    /// chain.
    fn chain_scratch(&self, cn: CnId, kind: ChainKind, chain: u8) -> Option<u64> {
        let r = self.mn.cn(cn)?;
        match kind {
            ChainKind::Alloc if chain < r.alloc_chain_count() => self.mn.chain_scratch(r.slot, chain),
            ChainKind::Alloc => None,
            ChainKind::Free => self.mn.map().scratch(r.slot),
        }
    }

    fn request_buf(&self, cn: CnId, kind: ChainKind, chain: u8) -> Option<u64> {
        let s = self.chain_scratch(cn, kind, chain)?;
        Some(s + if kind == ChainKind::Alloc { ALLOC_REQUEST_BUF_OFF } else { FREE_REQUEST_BUF_OFF })
    }

    /// Keep exactly one request buffer posted per management QP: a second one would leak a
    /// receive slot per failed request until the queue overflows (a remote denial of service).
    fn post_request_buffer(&mut self, cn: CnId, kind: ChainKind, chain: u8) -> Result<(), DriverError<B::Error>> {
        let Some(r) = self.mn.cn(cn) else { return Ok(()) };
        if self.request_posted.get(r.slot as usize).is_some_and(|p| p[rq_index(kind, chain)]) {
            return Ok(());
        }
        let qp = match kind {
            ChainKind::Alloc => r.alloc_chain(chain).ok_or(DriverError::NoScratch(cn))?.0,
            ChainKind::Free => r.qps.free,
        };
        let addr = self.request_buf(cn, kind, chain).ok_or(DriverError::NoScratch(cn))?;
        let wr_id = WR_ID_REQUEST | ((kind as u64) << 32) | ((chain as u64) << 36) | (cn.get() as u64 & 0xFFFF_FFFF);
        let w = RecvWqe::single(wr_id, Sge { addr, length: REQUEST_BUF_LEN, lkey: self.regions.cn_meta_lkey });
        self.backend.post_recv(qp, &w).map_err(DriverError::Backend)?;
        self.set_request_posted(cn, kind, chain, true);
        Ok(())
    }

    /// Look at every CN's chain completions (errors become MN events) and, in host-engine
    /// mode, serve the requests that arrived.
    pub fn poll(&mut self, now: u64) -> Result<PollReport, DriverError<B::Error>> {
        self.now = now;
        let mut report = PollReport::default();
        type Chains = heapless::Vec<(ChainKind, u8, Qpn, Option<Qpn>), { MAX_ALLOC_CHAINS + 1 }>;
        let cns: heapless::Vec<(CnId, CnQps, Chains), { crate::mn::MAX_CNS }> = self
            .mn
            .cns()
            .filter(|r| r.status == crate::mn::CnStatus::Active)
            .map(|r| {
                // every alloc chain, then the free chain
                let chains = r
                    .alloc_chains()
                    .map(|(j, m, l)| (ChainKind::Alloc, j, m, l))
                    .chain([(ChainKind::Free, 0, r.qps.free, r.qps.free_loop)])
                    .collect();
                (r.cn, r.qps.clone(), chains)
            })
            .collect();
        let mut buf = [Completion::EMPTY; 16];
        for (cn, qps, chains) in cns.iter() {
            if self.mn.cn(*cn).is_none() {
                continue;
            }
            // messages: a send the transport could not deliver (retries or the RNR budget gone)
            // means the CN stopped answering or its host vanished: evict it
            // (host-engine mode sends them on the Alloc QP, drained with its device ops below)
            if let Some(mq) = self.mn.message_qp(*cn).filter(|q| *q != qps.alloc) {
                if self.dispatch_sends(*cn, mq)? {
                    report.events += 1;
                    self.handle(now, Event::CnUnresponsive { cn: *cn })?;
                    continue;
                }
            }
            for &(kind, chain, mgmt, lp) in chains.iter() {
                // serving the alloc side may have disconnected this CN (quota): its management
                // QPs are gone
                if self.mn.cn(*cn).map(|r| r.status) != Some(crate::mn::CnStatus::Active) {
                    break;
                }
                match self.mn.mode() {
                    ExecutionMode::Offloaded => {
                        let mut failure: Option<(Option<u8>, WcStatus)> = None;
                        let mut invalidated: heapless::Vec<Rkey, 16> = heapless::Vec::new();
                        let queues = [(lp, QueueSel::Send), (Some(mgmt), QueueSel::Send), (Some(mgmt), QueueSel::Recv)];
                        for (q, sel) in queues {
                            let Some(q) = q else { continue };
                            loop {
                                // a receive may report an invalidation: take no more of them
                                // than there is room to handle, the rest waits in the CQ for
                                // the next poll
                                let room = match sel {
                                    QueueSel::Recv => invalidated.capacity() - invalidated.len(),
                                    QueueSel::Send => buf.len(),
                                };
                                if room == 0 {
                                    break;
                                }
                                let want = room.min(buf.len());
                                let n = self.backend.poll_cq(q, sel, &mut buf[..want]).map_err(DriverError::Backend)?;
                                if n == 0 {
                                    break;
                                }
                                for c in &buf[..n] {
                                    if c.status.is_ok() {
                                        // a chain RECV a SEND_WITH_INV completed
                                        if let Some(r) = c.invalidated.filter(|_| sel == QueueSel::Recv) {
                                            let pushed = invalidated.push(r);
                                            debug_assert!(pushed.is_ok(), "no more receives taken than room left");
                                        }
                                        continue;
                                    }
                                    let step = parse_chain_wr_id(c.wr_id).map(|(_, _, s)| s).filter(|s| *s != 0xFF);
                                    let step = if sel == QueueSel::Recv { None } else { step };
                                    // The first real error is the cause. Flushes alone still mean
                                    // the chain is dead: its QP went to error because the peer's
                                    // side failed (a lost message, a crashed CN).
                                    let is_flush = c.status == WcStatus::WrFlushErr;
                                    match failure {
                                        None => failure = Some((step, c.status)),
                                        Some((_, WcStatus::WrFlushErr)) if !is_flush => {
                                            failure = Some((step, c.status))
                                        }
                                        _ => {}
                                    }
                                }
                            }
                        }
                        if let Some((step, status)) = failure {
                            self.stats.chain_failures += 1;
                            report.events += 1;
                            let failure = LapFailure::Status(status);
                            self.handle(now, Event::ChainFailed { cn: *cn, kind, chain, step, failure })?;
                        }
                        for rkey in invalidated {
                            report.events += 1;
                            self.handle(now, Event::RemoteInvalidation { qp: mgmt, rkey })?;
                        }
                    }
                    ExecutionMode::HostEngine => {
                        // drain send completions of earlier device ops and messages (the
                        // Alloc QP carries this CN's messages in host-engine mode)
                        if self.dispatch_sends(*cn, mgmt)? {
                            report.events += 1;
                            self.handle(now, Event::CnUnresponsive { cn: *cn })?;
                            break;
                        }
                        let n =
                            self.backend.poll_cq(mgmt, QueueSel::Recv, &mut buf[..1]).map_err(DriverError::Backend)?;
                        if n == 0 {
                            continue;
                        }
                        report.events += 1;
                        let c = buf[0];
                        // that receive is consumed, whatever its status
                        self.set_request_posted(*cn, kind, chain, false);
                        // A SEND_WITH_INV: no request of an honest CN. It is not served; the MN
                        // checks whose window it revoked (and may evict the sender).
                        if let Some(rkey) = c.invalidated.filter(|_| c.status.is_ok()) {
                            self.handle(now, Event::CnAnswered { cn: *cn })?;
                            self.handle(now, Event::RemoteInvalidation { qp: mgmt, rkey })?;
                            continue;
                        }
                        if !c.status.is_ok() {
                            // a flushed request buffer: the management QP is in error (the
                            // CN's side failed); the MN resets it and posts a buffer again
                            let failure = LapFailure::Status(c.status);
                            self.handle(now, Event::ChainFailed { cn: *cn, kind, chain, step: None, failure })?;
                            continue;
                        }
                        // the MN answers it or has it served (Action::ServeLap)
                        let before = self.stats.laps - self.stats.laps_failed;
                        self.handle(now, Event::RequestArrived { cn: *cn, kind, chain, len: c.byte_len })?;
                        report.laps_committed += (self.stats.laps - self.stats.laps_failed - before) as u32;
                    }
                }
            }
        }
        // keep resuming laps while their steps complete at once (a device that completes
        // posts synchronously, or completions that were already waiting), a bounded number of
        // rounds per poll
        for _ in 0..64 {
            let (advanced, committed) = self.progress_laps(now)?;
            report.laps_advanced += advanced;
            report.laps_committed += committed;
            if advanced == 0 {
                break;
            }
        }
        self.keep_request_buffers()?;
        Ok(report)
    }

    /// Host-engine laps waiting for a device step.
    pub fn laps_in_flight(&self) -> usize {
        self.laps.len()
    }

    /// Poll `qp`'s send CQ and route what it holds: a completion an in-flight lap waits for
    /// goes to that lap (none do on offloaded mode's message QP); one of the MN's messages to `cn` renews its lease (or, when the
    /// transport gave up on it, says the CN is unreachable: returns true); anything else was
    /// already accounted for and is dropped.
    fn dispatch_sends(&mut self, cn: CnId, qp: Qpn) -> Result<bool, DriverError<B::Error>> {
        let mut buf = [Completion::EMPTY; 16];
        let (mut unreachable, mut answered) = (false, false);
        loop {
            let n = self.backend.poll_cq(qp, QueueSel::Send, &mut buf).map_err(DriverError::Backend)?;
            if n == 0 {
                if answered {
                    self.handle(self.now, Event::CnAnswered { cn })?;
                }
                return Ok(unreachable);
            }
            for c in &buf[..n] {
                if let Some(l) =
                    self.laps.iter_mut().find(|l| l.lap.waiting().is_some_and(|w| w.qp == qp && w.wr_id == c.wr_id))
                {
                    l.done = Some(c.status);
                    continue;
                }
                if matches!(c.status, WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr) {
                    unreachable = true;
                } else if c.status.is_ok() {
                    answered = true;
                }
            }
        }
    }

    /// Resume the laps whose step completed; fail those past their budget. Returns (laps
    /// advanced or ended, laps committed).
    fn progress_laps(&mut self, now: u64) -> Result<(u32, u32), DriverError<B::Error>> {
        if self.laps.is_empty() {
            return Ok((0, 0));
        }
        // route completions of every QP a lap waits on
        let waits: heapless::Vec<(CnId, Qpn), MAX_LAPS_IN_FLIGHT> =
            self.laps.iter().filter_map(|l| l.lap.waiting().map(|w| (l.cn, w.qp))).collect();
        let mut unreachable: heapless::Vec<CnId, MAX_LAPS_IN_FLIGHT> = heapless::Vec::new();
        for (i, (cn, qp)) in waits.iter().enumerate() {
            if waits[..i].iter().any(|(_, q)| q == qp) {
                continue;
            }
            if self.dispatch_sends(*cn, *qp)? && !unreachable.contains(cn) {
                let pushed = unreachable.push(*cn);
                debug_assert!(pushed.is_ok(), "one CN per lap at most: MAX_LAPS_IN_FLIGHT");
            }
        }
        let (mut advanced, mut committed) = (0u32, 0u32);
        let mut i = 0;
        while i < self.laps.len() {
            let l = &mut self.laps[i];
            let outcome = match l.done.take() {
                Some(st) => {
                    advanced += 1;
                    l.lap.complete(st)
                }
                None => {
                    l.rounds = l.rounds.saturating_add(1);
                    // the MN's clock, or — where the clock does not move while nothing runs
                    // (a model) — a bound on polls
                    if now.saturating_sub(l.since) > self.step_budget_ns || l.rounds > 200_000 {
                        advanced += 1;
                        Some(l.lap.timed_out())
                    } else {
                        i += 1;
                        continue;
                    }
                }
            };
            let mut f = self.laps.swap_remove(i);
            let outcome = match outcome {
                Some(o) => o,
                None => match self.advance_lap(&mut f)? {
                    Some(o) => o,
                    None => {
                        f.since = now;
                        f.rounds = 0;
                        let pushed = self.laps.push(f);
                        debug_assert!(pushed.is_ok(), "still waiting: back in the table it was just taken out of");
                        continue;
                    }
                },
            };
            if self.finish_lap(f.cn, f.kind, f.chain, outcome, f.entry)? {
                committed += 1;
            }
        }
        for cn in unreachable {
            if self.mn.cn(cn).is_some() {
                self.handle(now, Event::CnUnresponsive { cn })?;
            }
        }
        Ok((advanced, committed))
    }

    /// Run a lap's CPU steps up to its next device step. `Some` outcome when it ended.
    fn advance_lap(&mut self, f: &mut InFlight) -> Result<Option<LapOutcome>, DriverError<B::Error>> {
        let Some((layout, who)) = self.lap_setting(f.cn, f.kind, f.chain)? else {
            // its CN was evicted or left meanwhile: the repair saw to its markers
            return Ok(Some(f.lap.timed_out()));
        };
        let ctx = who.context(&self.mn, f.cn, who.scratch);
        match f.lap.advance(&mut self.backend, &layout, &self.regions, &ctx).map_err(DriverError::HostEngine)? {
            Progress::Done(o) => Ok(Some(o)),
            Progress::Waiting(_) => Ok(None),
        }
    }

    /// The layout a CN's lap runs and the QPs its software checks compare against (None: the
    /// CN is not connected).
    fn lap_setting(
        &self,
        cn: CnId,
        kind: ChainKind,
        chain: u8,
    ) -> Result<Option<(ChainLayout, LapQps)>, DriverError<B::Error>> {
        let (Some(env), Some(r)) = (self.mn.chain_env_of(cn, kind, chain), self.mn.cn(cn)) else { return Ok(None) };
        let layout = build(kind, &env).map_err(DriverError::Chain)?;
        Ok(Some((layout, LapQps { access: r.qps.access.clone(), free: r.qps.free, scratch: env.scratch() })))
    }

    /// When the driver next needs [`MnDriver::handle_timeout`], if ever: the MN's lease
    /// probes, and — while empty pops hold tickets — at once, so the tail is watched until a
    /// push settles them. A deployment sleeps until then or until a completion arrives
    /// (quinn-proto's `poll_timeout`), and decides no protocol timing itself.
    pub fn poll_timeout(&self) -> Option<u64> {
        let watch = (!self.mn.tickets().is_empty()).then_some(self.now);
        match (self.mn.poll_timeout(), watch) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Run the timers that are due at `now`: the tail watch, and the MN's tick (lease probes,
    /// the offloaded audit) — offloaded, each tick first samples every CN's lap counters
    /// ([`MnDriver::sample_counters`]). Returns how many MN events that was.
    pub fn handle_timeout(&mut self, now: u64) -> Result<u32, DriverError<B::Error>> {
        let mut events = 0;
        if !self.mn.tickets().is_empty() {
            self.handle(now, Event::WatchTail)?;
            events += 1;
        }
        if self.mn.poll_timeout().is_some_and(|t| t <= now) {
            events += self.tick(now)?;
        }
        Ok(events)
    }

    /// The MN's tick now, due or not (what [`MnDriver::handle_timeout`] runs when it is due): the
    /// lap counters sampled (offloaded), then [`Event::Tick`]. Returns the MN events handled.
    pub fn tick(&mut self, now: u64) -> Result<u32, DriverError<B::Error>> {
        let n = self.sample_counters(now)?;
        self.handle(now, Event::Tick)?;
        Ok(n + 1)
    }

    /// Offloaded mode's lazy quota enforcement: count each CN's laps from its management QPs'
    /// executed send WQEs (one ring's worth per lap; the device's own counters, so a CN whose
    /// host vanished is counted too — the alloc lap it left running still binds) and hand them
    /// to the MN ([`Event::CounterSample`]), which disconnects a CN over its quota. A device
    /// that cannot count leaves the MWTable audit to find it. Returns the samples handled.
    pub fn sample_counters(&mut self, now: u64) -> Result<u32, DriverError<B::Error>> {
        // (no ring sizes yet: no CN ever connected, nothing to count)
        let Some(per_lap) = self.lap_wqes.filter(|_| self.mn.mode() == ExecutionMode::Offloaded) else {
            return Ok(0);
        };
        let mut samples: heapless::Vec<(CnId, u64, u64), { crate::mn::MAX_CNS }> = heapless::Vec::new();
        for r in self.mn.cns() {
            // every alloc chain's laps count as the CN's allocations
            let mut a = Some(0u64);
            for (_, m, _) in r.alloc_chains() {
                a = a.zip(self.backend.send_wqes_executed(m)).map(|(x, y)| x + y);
            }
            let (Some(a), Some(f)) = (a, self.backend.send_wqes_executed(r.qps.free)) else {
                continue;
            };
            let base = self.lap_base.get(r.slot as usize).copied().unwrap_or([0; 2]);
            let sample = (r.cn, a.saturating_sub(base[0]) / per_lap[0], f.saturating_sub(base[1]) / per_lap[1]);
            let pushed = samples.push(sample);
            debug_assert!(pushed.is_ok(), "one sample per CN record: at most MAX_CNS");
        }
        let n = samples.len() as u32;
        for (cn, allocs, frees) in samples {
            self.handle(now, Event::CounterSample { cn, allocs, frees })?;
        }
        Ok(n)
    }

    fn rebase_lap_counters(&mut self) {
        for r in self.mn.cns() {
            if let Some(b) = self.lap_base.get_mut(r.slot as usize) {
                let alloc = r.alloc_chains().map(|(_, m, _)| self.backend.send_wqes_executed(m).unwrap_or(0)).sum();
                *b = [alloc, self.backend.send_wqes_executed(r.qps.free).unwrap_or(0)];
            }
        }
    }

    /// Host-engine mode: start (or, with `concurrent_laps` off, run) a lap for a request that
    /// arrived in the CN's request buffer. True when it committed right away.
    fn serve_request(&mut self, cn: CnId, kind: ChainKind, chain: u8, len: u32) -> Result<bool, DriverError<B::Error>> {
        let addr = self.request_buf(cn, kind, chain).ok_or(DriverError::NoScratch(cn))?;
        let mut req = [0u8; REQUEST_BUF_LEN as usize];
        let n = (len as usize).min(req.len());
        self.backend.read_local(addr, &mut req[..n]).map_err(DriverError::Backend)?;
        // Serial engine: the buffer is free again once copied (no lap holds it while this one
        // runs to its end). Concurrent engine: the lap holds it until it ends, so this CN's next
        // request of this kind waits (its laps share one scratch area) — its SEND retries.
        let serial = !self.concurrent_laps;
        if serial {
            self.keep_request_buffers()?;
        }
        // the entry a free names (the lap checks the request; a request too short to name one
        // fails there)
        let entry = match Request::new_checked(&req[..n]) {
            Ok(r) if kind == ChainKind::Free => r.free_entry_addr(),
            _ => None,
        };
        let (layout, who) = self.lap_setting(cn, kind, chain)?.ok_or(DriverError::Node(MnError::UnknownCn(cn)))?;
        let ctx = who.context(&self.mn, cn, who.scratch);
        // a request longer than the receive buffer was truncated by the device (LocLenErr)
        let outcome = if len as usize > req.len() {
            LapOutcome::Failed {
                step: None,
                failure: LapFailure::RequestTooLong,
                device_ops: 0,
                cpu_steps: 0,
                owners: crate::mn::host_engine::OwnerWrites::NONE,
            }
        } else if serial || self.laps.is_full() {
            run_lap(&mut self.backend, &layout, &self.regions, &req[..n], &ctx).map_err(DriverError::HostEngine)?
        } else {
            let started = Lap::start(&mut self.backend, &layout, &req[..n]).map_err(DriverError::HostEngine)?;
            match started {
                Err(o) => o,
                Ok(mut lap) => match lap
                    .advance(&mut self.backend, &layout, &self.regions, &ctx)
                    .map_err(DriverError::HostEngine)?
                {
                    Progress::Done(o) => o,
                    Progress::Waiting(_) => {
                        let f = InFlight { cn, kind, chain, lap, since: self.now, rounds: 0, entry, done: None };
                        let pushed = self.laps.push(f);
                        debug_assert!(pushed.is_ok(), "not full: a full table runs the lap to its end above");
                        return Ok(false);
                    }
                },
            }
        };
        self.finish_lap(cn, kind, chain, outcome, entry)
    }

    /// A lap ended: account for it, scrub a freed chunk, tell the MN (its request buffer is
    /// free again: posted as the entry that ended it ends). True when it committed.
    fn finish_lap(
        &mut self,
        cn: CnId,
        kind: ChainKind,
        chain: u8,
        outcome: LapOutcome,
        entry: Option<u64>,
    ) -> Result<bool, DriverError<B::Error>> {
        self.stats.laps += 1;
        let now = self.now;
        // the lap's own changes of MWTable owners, before the MN decides anything from its
        // counts (committed or not: a failed lap's write-back is in the table all the same)
        for w in outcome.owners().iter() {
            self.mn.account_owner_write(w);
        }
        let committed = match outcome {
            LapOutcome::Committed { device_ops, cpu_steps, .. } => {
                self.stats.cpu_steps += cpu_steps as u64;
                self.stats.device_ops += device_ops as u64;
                self.handle(now, Event::LapCommitted { cn, kind, chain, freed: entry })?;
                true
            }
            LapOutcome::Failed { step, failure, device_ops, cpu_steps, .. } => {
                self.stats.cpu_steps += cpu_steps as u64;
                self.stats.device_ops += device_ops as u64;
                self.stats.laps_failed += 1;
                if self.mn.cn(cn).is_some() {
                    self.handle(now, Event::ChainFailed { cn, kind, chain, step, failure })?;
                    self.recover_errored_qps(cn)?;
                }
                false
            }
        };
        Ok(committed)
    }

    /// A host-engine step fails on the QP it was posted on — a bind on the CN's Free or an
    /// access QP, not only the management QP the repair resets — and an errored QP refuses
    /// everything after it. Bring back every QP of the CN that the failure left in ERR, and
    /// only those (a healthy pair keeps the CN's work in flight).
    fn recover_errored_qps(&mut self, cn: CnId) -> Result<(), DriverError<B::Error>> {
        let Some(r) = self.mn.cn(cn) else { return Ok(()) };
        // another lap of this CN still in flight fails on the errored QP by itself (its
        // flushed steps complete) and recovers then; resetting now would discard those
        // completions and leave it waiting out its budget
        if self.mn.mode() != ExecutionMode::HostEngine || self.laps.iter().any(|l| l.cn == cn) {
            return Ok(());
        }
        let qps = r.qps.clone();
        let extra: heapless::Vec<Qpn, { MAX_ALLOC_CHAINS - 1 }> = r.extra_alloc.iter().map(|c| c.mgmt).collect();
        let mut reset: heapless::Vec<Qpn, { 2 + crate::wire::message::MAX_ACCESS_QPS + MAX_ALLOC_CHAINS - 1 }> =
            heapless::Vec::new();
        for q in [qps.alloc, qps.free].into_iter().chain(qps.access).chain(extra) {
            if self.backend.qp_state(q).map_err(DriverError::Backend)? != QpState::Err {
                continue;
            }
            // best effort: a device that cannot reset this QP leaves it to the CN to reconnect,
            // and must not turn one CN's broken connection into an error of the whole poll
            match self.backend.reset_qp(q) {
                Ok(()) => {
                    let pushed = reset.push(q);
                    debug_assert!(pushed.is_ok(), "the CN's Alloc QPs, Free and at most MAX_ACCESS_QPS access QPs");
                }
                Err(_) => self.stats.qps_left_in_error += 1,
            }
        }
        // a reset discards posted receives without completions: the request buffers go again
        // (keep_request_buffers, as every entry ends)
        self.forget_receives(&reset);
        Ok(())
    }

    /// The group CN `cn`'s alloc chain holds popped ahead for its next request
    /// (`chain::alloc`): owned by the CN in the MWTable, not yet handed out. Read from the
    /// chain's marker: exact where no lap is in flight (tests, tools, metrics).
    /// With several alloc chains, the first chain's (see [`MnDriver::groups_ahead_of`]).
    pub fn group_ahead_of(&self, cn: CnId) -> Option<GroupId> {
        self.group_ahead_on(cn, 0)
    }

    /// The group alloc chain `chain` of `cn` holds popped ahead ([`MnDriver::group_ahead_of`]).
    pub fn group_ahead_on(&self, cn: CnId, chain: u8) -> Option<GroupId> {
        if self.mn.mode() != ExecutionMode::Offloaded {
            return None;
        }
        let map = self.mn.map();
        let r = self.mn.cn(cn)?;
        if chain >= r.alloc_chain_count() {
            return None;
        }
        let marker = self.mn.chain_scratch(r.slot, chain)?
            + crate::wire::memory_map::ALLOC_SCRATCH_OFF
            + crate::wire::memory_map::alloc_scratch::REPLY_ENTRY_ADDR;
        let mut b = [0u8; 8];
        self.backend.read_local(marker, &mut b).ok()?;
        let g = map.group_of_entry(u64::from_le_bytes(b))?;
        (self.entry(g)?.owner() == cn.get()).then_some(g)
    }

    /// Groups the alloc chains of `cn` hold popped ahead, one per chain at most.
    pub fn groups_ahead_of(&self, cn: CnId) -> u32 {
        let chains = self.mn.cn(cn).map_or(0, |r| r.alloc_chain_count());
        (0..chains).filter(|j| self.group_ahead_on(cn, *j).is_some()).count() as u32
    }

    /// Groups every CN's alloc chains hold popped ahead ([`MnDriver::groups_ahead_of`]).
    pub fn groups_ahead(&self) -> u32 {
        self.mn.cns().map(|r| self.groups_ahead_of(r.cn)).sum()
    }

    /// The MWTable entry of a group (for tests and tools).
    pub fn entry(&self, g: GroupId) -> Option<crate::wire::mwtable::MwTableEntry> {
        let addr = self.mn.map().entry_addr(g)?;
        let mut b = [0u8; crate::wire::mwtable::ENTRY_SIZE];
        // a tool's look: a device that cannot read its own memory shows no entry
        self.backend.read_local(addr, &mut b).ok()?;
        Some(crate::wire::mwtable::MwTableEntry::from_bytes(b))
    }

    /// Check every invariant of DESIGN.md §4 principle 4 against the device's view.
    pub fn check_invariants(&mut self) -> Result<(), crate::mn::invariants::InvariantViolation> {
        let (mn, mut port) = self.port();
        crate::mn::invariants::check(mn, &mut port)
    }

    /// [`MnDriver::check_invariants`] scanning the pool in windows of `WORDS` × 64 groups.
    #[cfg(test)]
    pub(crate) fn check_invariants_in<const WORDS: usize>(
        &mut self,
    ) -> Result<(), crate::mn::invariants::InvariantViolation> {
        let (mn, mut port) = self.port();
        crate::mn::invariants::check_in::<WORDS, _>(mn, &mut port)
    }
}
