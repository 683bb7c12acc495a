//! What the model counts: executed and flushed WQEs, completions by status, MN CPU events,
//! and a deterministic digest (plus optional full trace) of every completion.

use crate::addr::{HostId, QpAddr};
use omw_core::device::{Completion, WcOpcode, WcStatus};
use omw_core::wire::wqe::Opcode;

/// Fabric-wide counters. Never reset (QP resets do not touch them).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Counters {
    /// Scheduler steps (executions, flushes, RNR NAKs).
    pub steps: u64,
    /// WQEs executed, successfully or not (flushes excluded).
    pub wqes_executed: u64,
    /// WQEs completed with `WrFlushErr` by an errored QP's send queue.
    pub wqes_flushed: u64,
    /// Receive WQEs flushed.
    pub recvs_flushed: u64,
    /// Times a SEND found no receive WQE (one per wait, not per retry).
    pub rnr_naks: u64,
    /// Request messages between NICs (QPs of the same host included).
    pub messages: u64,
    /// Messages a middleware dropped / delayed.
    pub messages_dropped: u64,
    pub messages_delayed: u64,
    /// Strict-mode SEND_WITH_INV whose invalidation failed (IBTA 9.9.6.3 class J): the
    /// responder erred and no NAK or completion reached the requester.
    pub silent_class_j: u64,
    /// WQEs fetched over PCIe after a gate opened (a WAIT passed or an ENABLE released a
    /// queue that had run dry) because the prefetch cache did not hold them.
    pub gated_fetches: u64,
    /// ENABLEs that completed without effect under the device behaviour
    /// (`SelfEnable::Ignored`, a RECV_EN under `RecvEnable::Doorbell`).
    pub enables_ignored: u64,
    /// Binds the device refused for their form alone (`ForeignBind::Refused`, mlx5 bytes a
    /// window's mkey cannot express).
    pub binds_refused: u64,
    /// CQEs not generated because their CQ had overrun (a device CQ without ignore-overrun
    /// whose consumer fell a ring behind).
    pub cqes_overrun: u64,
    completions: [u64; 32],
}

impl Counters {
    /// CQEs generated with `status` (send and receive CQs, signalled or not).
    pub fn completions(&self, status: WcStatus) -> u64 {
        self.completions[status as usize]
    }
    pub fn total_completions(&self) -> u64 {
        self.completions.iter().sum()
    }
    /// (status, count) for every status seen.
    pub fn completions_by_status(&self) -> impl Iterator<Item = (WcStatus, u64)> + '_ {
        WcStatus::ALL.into_iter().map(|s| (s, self.completions[s as usize])).filter(|(_, n)| *n > 0)
    }
    pub(crate) fn count_completion(&mut self, s: WcStatus) {
        self.completions[s as usize] += 1;
    }
}

/// Per-QP statistics and queue indices.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct QpStats {
    pub wqes_executed: u64,
    pub wqes_flushed: u64,
    /// CQEs over the QP's whole life (resets included).
    pub cqes_total: u64,
    /// CQ counts since the last reset (what a WAIT compares against).
    pub send_cq_count: u64,
    pub recv_cq_count: u64,
    /// Completions waiting to be polled (visible or not yet).
    pub send_cq_queued: usize,
    pub recv_cq_queued: usize,
    pub send_producer: u64,
    pub send_consumer: u64,
    pub send_limit: u64,
    pub recv_producer: u64,
    pub recv_consumer: u64,
    pub recv_limit: u64,
    /// Entries currently held in the prefetch cache.
    pub prefetched: usize,
}

/// Per-host statistics.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct HostStats {
    /// MN CPU events ([`crate::Fabric::advance_cpu`] and [`crate::Fabric::count_cpu_event`]).
    pub cpu_events: u64,
    /// Modelled CPU time charged through `advance_cpu`.
    pub cpu_busy_ns: u64,
    pub wqes_executed: u64,
    /// The NIC's busiest processing unit (send side) is busy until this time.
    pub nic_busy_until: u64,
    /// Total send-side occupancy of the NIC's units (WQE issue, binds' occupancy): divide by
    /// units × elapsed time for a utilisation.
    pub nic_send_busy_ns: u64,
    /// Total responder occupancy of the NIC's units (incoming requests).
    pub nic_rx_busy_ns: u64,
    pub mem_used: u64,
    pub crashed: bool,
}

/// What one scheduler step did.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum StepKind {
    /// A WQE was fetched, decoded and executed (its completion may be an error).
    Executed(Opcode),
    /// The fetched bytes did not decode: `LocQpOpErr`.
    Malformed,
    /// A WQE of an errored QP completed with `WrFlushErr`.
    Flushed,
    /// A SEND found no receive WQE and waits (RNR).
    RnrWait,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct StepInfo {
    /// Modelled time the step started.
    pub at: u64,
    pub qp: QpAddr,
    pub kind: StepKind,
}

/// One completion as generated (recorded when `NicConfig::trace` is on).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct TraceEvent {
    pub at: u64,
    pub host: HostId,
    pub completion: Completion,
}

pub(crate) fn wc_code(op: WcOpcode) -> u64 {
    match op {
        WcOpcode::Send(o) => o as u64,
        WcOpcode::Recv => 0x80,
        WcOpcode::RecvRdmaWithImm => 0x81,
    }
}

/// FNV-1a over the fields of a completion.
pub(crate) fn digest(mut h: u64, at: u64, host: u32, c: &Completion) -> u64 {
    for v in [
        at,
        host as u64,
        c.qpn.get() as u64,
        c.wr_id,
        c.status as u64,
        wc_code(c.opcode),
        c.byte_len as u64,
        c.imm.map_or(u64::MAX, |i| i as u64),
    ] {
        for b in v.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}
