//! The MN control plane: a sans-IO state machine over the MN's tables.
//!
//! The MN CPU is *off* the allocation path in offloaded mode: it arms each CN's chains once and
//! then only reacts to exceptions — a chain that failed (empty queue, a forged free, a bad
//! request, a fault), a CN that crashed or left, a CN over its quota, an RNIC reset — and to the
//! periodic tick that settles "tickets" left by pops of an empty queue. Every reaction reads and
//! writes the MWTable and the free queue through an [`MnPort`] and asks the port to carry out
//! device actions ([`Action`]) in order, so a backend only translates.
//!
//! Repair works from data alone: each chain lap sets markers in its scratch area and clears
//! them when it commits (see `mn_memory`), so after any failure the MN knows whether the lap
//! took a ticket, popped a group the CN never got, or was half-way through a free.

use crate::access::AccessFlags;
use crate::chain::builder::ChainEnv;
use crate::chain::ChainKind;
use crate::device::{ExecutionMode, MwBinding};
use crate::geometry::{PoolGeometry, MAX_GROUP_SIZE};
use crate::ids::{CnId, GroupId, Qpn, Rkey};
use crate::mn::host_engine::LapFailure;
use crate::mn::tenant::{TenantError, TenantId, TenantLimits, TenantTable};
use crate::wire::memory_map::{
    alloc_scratch, free_scratch, MnMemoryMap, ALLOC_REQUEST_BUF_OFF, ALLOC_SCRATCH_OFF, FREE_SCRATCH_OFF,
    SCRATCH_PER_CN,
};
use crate::wire::message::{
    AllocReply, ConnectInfo, ErrorCode, ErrorReply, Notice, Rebound, TakenBack, MAX_MESSAGE_LEN,
};
use crate::wire::mwtable::{MwTableEntry, ENTRY_SIZE};
use crate::wire::wqe::masked_add;
use core::fmt;
use zerocopy::IntoBytes;

mod audit;
pub mod capacity;
pub mod class_quota;
mod connect;
pub mod driver;
mod format;
mod group_window;
pub mod host_engine;
pub mod invariants;
mod lease;
pub mod plan;
pub mod provision;
mod quiesce;
mod quota;
mod reclaim;
mod repair;
pub mod tenant;
#[cfg(test)]
mod tests;
pub use quiesce::{scan_free, Chains, FreeCount, PushRefused, Quiesced, Whereabouts, ALL_ALLOC_CHAINS};

/// Most CNs one MN serves (fixed so the control plane needs no heap).
pub const MAX_CNS: usize = 32;
/// Most alloc chains one CN may have ([`MnConfig::alloc_chains`]): each is a whole alloc chain
/// (loop QP, management QP, scratch area), so a CN can have that many allocations in flight.
/// Defined with the protocol, whose messages name chains.
pub use crate::wire::message::MAX_ALLOC_CHAINS;
const _: () = assert!(crate::mn::tenant::MAX_TENANTS == MAX_CNS);
/// `reserved` value of an MWTable entry whose group the MN is reclaiming.
pub const ENTRY_RECLAIMING: u32 = 1;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MnConfig {
    pub geometry: PoolGeometry,
    pub max_cns: u32,
    /// Groups one CN may hold at once.
    pub quota: u32,
    pub mode: ExecutionMode,
    /// Host-engine mode on devices that let any QP invalidate a type-2 window.
    pub software_ownership_check: bool,
    pub queue_depth: u16,
    pub window_access: AccessFlags,
    /// Who zeroes chunks between owners (the plan's decision).
    pub scrub: ScrubPath,
    /// The CN lease (ns, 0: off): every CN is probed at half this period; a probe the
    /// transport cannot deliver (the CN's host vanished, or the CN stopped posting receives)
    /// gets the CN evicted and everything it held reclaimed.
    pub lease_ns: u64,
    /// The offloaded audit's period (ns, 0: only on explicit ticks): misbound and out-of-chunk
    /// windows taken back, every CN's holdings checked against its quota. A timer of its own,
    /// so an MN with the lease off still audits.
    pub audit_ns: u64,
    /// Offloaded: each CN's alloc chain pops the group for the CN's next request as soon as
    /// the previous reply went out, so a request passes only its WAIT and one ENABLE on the
    /// way to its reply (`chain::alloc`). It costs one group per armed chain withheld from the
    /// others — the default ([`MnConfig::pop_ahead_pays`]) turns it on only where that is a
    /// small share of the pool — with several alloc chains per CN, one group per chain
    /// ([`MemoryNode::set_pop_ahead`]).
    pub pop_ahead: bool,
    /// The chain layout variant (`chain::variant`): chosen from the device's answers to the
    /// open CORE-Direct questions; the paper's device's by default.
    pub chain_variant: crate::chain::variant::ChainVariant,
    /// MWTable entries the audit examines per tick (≥ 1): its work per tick is bounded by this,
    /// and a whole pass over the table takes `⌈chunks / audit_batch⌉` ticks
    /// ([`MemoryNode::audit_period_ns`]).
    pub audit_batch: u32,
    /// Alloc chains a CN may connect with (1..=[`MAX_ALLOC_CHAINS`]; each CN chooses up to
    /// this many at connect time). Every alloc chain serves one lap at a time and is re-armed
    /// only after its commit, so a CN's allocations overlap only across its chains. The memory
    /// map must hold a scratch area per chain (`max_cns × alloc_chains`,
    /// [`MemoryNode::scratch_slots`]), which also sizes the free queue's ring for one ticket per
    /// chain.
    pub alloc_chains: u8,
}

impl MnConfig {
    /// Whether popping ahead pays for the groups it withholds: offloaded, and at most an
    /// eighth of the pool held ahead when every CN slot is taken.
    pub const fn pop_ahead_pays(mode: ExecutionMode, chunks: u32, max_cns: u32) -> bool {
        matches!(mode, ExecutionMode::Offloaded) && (chunks as u64) >= 8 * max_cns as u64
    }
}

/// Default [`MnConfig::audit_batch`]: a pool of up to 16 Ki chunks is audited whole on every
/// tick (as before the audit became incremental); 1 Mi chunks take 64 ticks.
pub const DEFAULT_AUDIT_BATCH: u32 = 16 * 1024;

/// Default audit period: the cadence the audit had when it rode the default lease's probes.
pub const DEFAULT_AUDIT_NS: u64 = DEFAULT_LEASE_NS / 2;

/// Default lease: a CN whose host vanishes without a disconnect is reclaimed within about
/// this long plus the transport's retry budget.
pub const DEFAULT_LEASE_NS: u64 = 2_000_000_000;

/// Who clears a chunk between two owners.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum ScrubPath {
    /// The offloaded free chain writes zeros over the chunk from the private domain (the MN
    /// CPU still zeroes every chunk it handles itself: reclaims, repairs, resets).
    Nic,
    /// The MN CPU zeroes the chunk (host-engine frees and every reclaim).
    Cpu,
    /// Nobody: the operator turned scrubbing off.
    Off,
}

pub use crate::wire::memory_map::MnKeys;

/// The MN ends of one CN's QPs.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct CnQps {
    pub alloc: Qpn,
    pub free: Qpn,
    pub access: heapless::Vec<Qpn, { MAX_GROUP_SIZE - 1 }>,
    /// Loopback QPs the chains run on (offloaded mode only).
    pub alloc_loop: Option<Qpn>,
    pub free_loop: Option<Qpn>,
}

/// The MN ends of one of a CN's extra alloc chains (chain 1 and up; chain 0 is
/// [`CnQps::alloc`] / [`CnQps::alloc_loop`]): its management QP (an extra "Alloc QP" the CN
/// sends requests on and receives that chain's replies through) and its loop QP (offloaded).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct AllocChainQps {
    pub mgmt: Qpn,
    pub lp: Option<Qpn>,
}

/// What an interrupted alloc lap left, as its repair found it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum AllocRepair {
    /// Undone: nothing popped, or the popped group reclaimed (or it had moved on).
    Undone,
    /// The lap's ticket slot was empty: the queue was empty, the MN keeps the ticket.
    TookTicket,
    /// The lap's ticket slot holds a group it did not take — it found the slot empty and a push
    /// filled it before the repair, or its read of the slot failed: the group went to the
    /// tail. Not the CN's fault; it may retry at once.
    Requeued,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CnStatus {
    Active,
    /// Management QPs disconnected (quota); data access continues until it leaves.
    MgmtDisconnected,
}

#[derive(Clone, PartialEq, Eq, Debug)]
pub struct CnRecord {
    pub slot: u32,
    pub cn: CnId,
    pub qps: CnQps,
    pub status: CnStatus,
    /// Every alloc chain of the CN is parked (not armed) until the queue is available again.
    pub alloc_parked: bool,
    /// Which of its alloc chains are parked (bit j: chain j): each one whose pop found the
    /// queue empty holds its one ticket and waits for "available".
    pub parked_chains: u8,
    /// Host-engine mode: laps committed. Offloaded: last counter sample.
    pub allocs: u64,
    pub frees: u64,
    pub forged_frees: u32,
    pub bad_requests: u32,
    /// When the MN last probed it (the lease), and how many probes it sent.
    pub probed_at: u64,
    pub probes: u64,
    /// A probe went out and the CN has not answered since (no send to it completed, no
    /// request from it arrived). Still set at the next probe time: the CN is evicted.
    pub probe_outstanding: bool,
    /// The tenant it was admitted as ([`MemoryNode::connect_as`]): its quota and CN slots are
    /// the tenant's, shared with the tenant's other CNs. None: the per-CN quota.
    pub tenant: Option<TenantId>,
    /// Its alloc chains beyond the first ([`MnConfig::alloc_chains`]).
    pub extra_alloc: heapless::Vec<AllocChainQps, { MAX_ALLOC_CHAINS - 1 }>,
}

impl CnRecord {
    /// How many alloc chains the CN has (at least one).
    pub fn alloc_chain_count(&self) -> u8 {
        1 + self.extra_alloc.len() as u8
    }
    /// The MN ends (management, loop) of alloc chain `j` (0: the first).
    pub fn alloc_chain(&self, j: u8) -> Option<(Qpn, Option<Qpn>)> {
        match j {
            0 => Some((self.qps.alloc, self.qps.alloc_loop)),
            _ => self.extra_alloc.get(j as usize - 1).map(|c| (c.mgmt, c.lp)),
        }
    }
    /// Every alloc chain's MN ends, chain 0 first.
    pub fn alloc_chains(&self) -> impl Iterator<Item = (u8, Qpn, Option<Qpn>)> + '_ {
        (0..self.alloc_chain_count()).filter_map(|j| self.alloc_chain(j).map(|(m, l)| (j, m, l)))
    }
    /// Every QP the MN holds for the CN beyond [`CnQps`]: the extra alloc chains' management and
    /// loop QPs.
    pub fn extra_qps(&self) -> impl Iterator<Item = Qpn> + '_ {
        self.extra_alloc.iter().flat_map(|c| [Some(c.mgmt), c.lp]).flatten()
    }
}

/// What the MN asks its port to do. Each completes before `apply` returns.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Action {
    /// Bring a QP pair back to RTS with empty queues.
    ResetQp(Qpn),
    /// Build and arm a chain (offloaded mode).
    ArmChain { kind: ChainKind, env: ChainEnv },
    /// Host-engine mode: run a lap for the request that arrived in the CN's request buffer of
    /// `kind` (of alloc chain `chain`; 0 for the free chain) ([`Event::RequestArrived`]); the
    /// port reports its end as [`Event::LapCommitted`] or [`Event::ChainFailed`].
    ServeLap { cn: CnId, kind: ChainKind, chain: u8, len: u32 },
    /// Invalidate the window with this exact rkey if it is bound; nothing if it is not.
    Unbind { rkey: Rkey },
    /// Send a message to a CN: on the MN end of its first access QP (the only CN-facing send
    /// queue not carrying a chain); `slot` selects the CN's send buffers.
    Send { slot: u32, qp: Qpn, bytes: heapless::Vec<u8, MAX_MESSAGE_LEN> },
    /// Disconnect a CN's management QPs (quota enforcement).
    DisconnectMgmt { alloc: Qpn, free: Qpn },
    /// Destroy all QPs of a CN that left (its windows are already invalidated).
    ReleaseCn { qps: CnQps },
    /// Destroy QPs of a CN beyond its [`CnQps`] (its extra alloc chains': management and loop),
    /// when it leaves or — management QPs only — loses them for its quota.
    ReleaseQps { qps: heapless::Vec<Qpn, { 2 * (MAX_ALLOC_CHAINS - 1) }> },
    /// Host-engine mode's quiesce: end the MN CPU's in-flight laps of `cn` (of the chains
    /// named: `alloc` the alloc chains' bit mask), each once the device step it posted has
    /// completed or been flushed — so nothing of them lands after the MN decided. Offloaded
    /// mode stops chains with [`Action::ResetQp`].
    StopLaps { cn: CnId, alloc: u8, free: bool },
    /// Bind the (unbound) window `rkey.index()` again under `rkey`, over `[addr, addr+len)` of
    /// the MR `lkey`, to QP `qp` (a window someone else invalidated, restored for its owner).
    /// The port reports the outcome through [`MnPort::mw_binding`] where it can tell.
    Rebind { rkey: Rkey, qp: Qpn, addr: u64, len: u32, lkey: u32, access: AccessFlags },
}

/// Exceptions and timers the MN reacts to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Event {
    /// A chain lap failed (`step` None: the trigger RECV): the device's completion status when
    /// the NIC ran it ([`LapFailure::Status`]), the host engine's own finding when the CPU did.
    /// `chain`: which of the CN's alloc chains (0 for the free chain).
    ChainFailed { cn: CnId, kind: ChainKind, chain: u8, step: Option<u8>, failure: LapFailure },
    /// Host-engine mode: a request of `len` bytes (as the receive completion reported)
    /// arrived in the CN's request buffer of `kind`. The CN is alive; the MN answers it at
    /// once (an alloc while parked on its ticket: "empty"; one over the quota:
    /// `QuotaExceeded`) or has it served ([`Action::ServeLap`]).
    RequestArrived { cn: CnId, kind: ChainKind, chain: u8, len: u32 },
    /// Host-engine mode: a lap committed (the MN CPU ran it). `freed` is the MWTable entry a
    /// committed free returned to the queue: its chunk is scrubbed before any other lap runs.
    LapCommitted { cn: CnId, kind: ChainKind, chain: u8, freed: Option<u64> },
    /// A message the MN sent the CN completed: the CN is alive and receiving (its lease is
    /// renewed).
    CnAnswered { cn: CnId },
    /// Per-CN management-QP counters (offloaded mode's lazy quota enforcement).
    CounterSample { cn: CnId, allocs: u64, frees: u64 },
    /// The CN crashed or disconnected.
    CnGone { cn: CnId },
    /// The transport could not reach the CN (retry or RNR budget exhausted on a send to it,
    /// or a host-engine step that never completed): it stalled or its host vanished. The MN
    /// evicts it — repairs its laps, reclaims everything, releases its QPs — and tells the
    /// deployment ([`MemoryNode::take_evicted`]).
    CnUnresponsive { cn: CnId },
    /// The MN's RNIC was reset: every QP and window is gone.
    RnicReset,
    /// The periodic timer: audit, settle tickets.
    Tick,
    /// A receive on the MN end of `qp` completed with "invalidated `rkey`" (IBV_WC_WITH_INV:
    /// the sender's SEND_WITH_INV revoked a window). On soft-RoCE any QP may do that to any
    /// window (`rxe_invalidate_mw` checks no QP); the MN checks the window against the
    /// sender's own, restores it for its owner and evicts a sender that revoked someone
    /// else's (`MemoryNode::on_remote_invalidation`).
    RemoteInvalidation { qp: Qpn, rkey: Rkey },
    /// While pops of an empty queue hold tickets, the MN watches the tail (DESIGN.md §2) and
    /// settles each ticket as soon as a push fills its slot — before the tail can come round
    /// the ring to it again.
    WatchTail,
}

#[derive(Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MnError<E> {
    Port(E),
    TooManyCns,
    UnknownCn(CnId),
    /// The memory map cannot hold this many CNs.
    BadConfig,
    /// Offloaded mode needs loopback QPs for a CN's chains.
    MissingLoopQps,
    WrongAccessQpCount {
        expected: usize,
        got: usize,
    },
    /// A connect as a tenant the MN does not know, or one whose CN slots are taken.
    Tenant(TenantError),
    /// A CN asked for more alloc chains than the MN allows ([`MnConfig::alloc_chains`]), or
    /// offered a chain without its loop QP in offloaded mode.
    AllocChains {
        allowed: u8,
        asked: u8,
    },
    /// More pops of the empty free queue are waiting for a push than the MN can track (one per
    /// CN slot, [`MAX_CNS`]: the queue's ring has room for that many beyond the groups).
    TicketsFull,
}

impl<E> MnError<E> {
    /// The port's own error, or the control plane's reason without a port error in it.
    pub fn split(self) -> Result<MnError<core::convert::Infallible>, E> {
        Ok(match self {
            MnError::Port(e) => return Err(e),
            MnError::TooManyCns => MnError::TooManyCns,
            MnError::UnknownCn(c) => MnError::UnknownCn(c),
            MnError::BadConfig => MnError::BadConfig,
            MnError::MissingLoopQps => MnError::MissingLoopQps,
            MnError::WrongAccessQpCount { expected, got } => MnError::WrongAccessQpCount { expected, got },
            MnError::Tenant(e) => MnError::Tenant(e),
            MnError::AllocChains { allowed, asked } => MnError::AllocChains { allowed, asked },
            MnError::TicketsFull => MnError::TicketsFull,
        })
    }
}

impl<E: fmt::Display> fmt::Display for MnError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MnError::Port(e) => write!(f, "MN port error: {e}"),
            MnError::TooManyCns => write!(f, "no free CN slot (at most {MAX_CNS} or the configured maximum)"),
            MnError::UnknownCn(c) => write!(f, "unknown CN {c}"),
            MnError::BadConfig => f.write_str("MN configuration inconsistent with its memory map"),
            MnError::MissingLoopQps => f.write_str("offloaded mode needs a loopback QP per chain"),
            MnError::WrongAccessQpCount { expected, got } => {
                write!(f, "CN offered {got} access QPs, the pool's group size needs {expected}")
            }
            MnError::Tenant(e) => write!(f, "{e}"),
            MnError::AllocChains { allowed, asked } => {
                write!(f, "CN asked for {asked} alloc chains, the MN allows 1 to {allowed} (each with its loop QP when offloaded)")
            }
            MnError::TicketsFull => write!(
                f,
                "more than one pop per alloc chain of the empty free queue waits for a push: the queue's ring has no room for more"
            ),
        }
    }
}

/// What the MN needs from its environment: its memory, and someone to carry out actions.
pub trait MnPort {
    type Error: fmt::Debug + fmt::Display;
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), Self::Error>;
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), Self::Error>;
    /// Carry out `action` completely before returning.
    fn apply(&mut self, action: Action) -> Result<(), Self::Error>;
    /// Where a window is bound, if the device can tell.
    fn mw_binding(&mut self, _rkey: Rkey) -> Option<MwBinding> {
        None
    }
    /// The range a bound window covers, if the device can tell.
    fn mw_span(&mut self, _rkey: Rkey) -> Option<(u64, u64)> {
        None
    }
    /// `masked_add(*addr, add, boundary)`, atomically **with respect to the NIC's atomics**,
    /// returning the old value. While chains run in the NIC (offloaded mode) a CPU
    /// read-modify-write of a queue counter races their fetch-and-adds (RDMA atomics are atomic
    /// only among the HCA's own operations), so a port for an offloading device issues it as a
    /// NIC atomic. The default is the CPU read-modify-write, right where no chain runs.
    fn fetch_add(&mut self, addr: u64, add: u64, boundary: u64) -> Result<u64, Self::Error> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        let old = u64::from_le_bytes(b);
        self.write(addr, &masked_add(old, add, boundary).to_le_bytes())?;
        Ok(old)
    }
}

/// Counters of what the MN CPU did.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct MnStats {
    pub events: u64,
    pub empty_notices: u64,
    /// "Alloc chain j parked" notices: popping ahead with several alloc chains per CN, a
    /// chain found the queue empty while others of its CN still served.
    pub chain_parked_notices: u64,
    pub available_notices: u64,
    /// "Taken back" notices: a single group of a CN that stays connected reclaimed (the
    /// audit's findings, a window that could not be bound again, an undone alloc lap whose
    /// reply may have gone out), the CN told which.
    pub taken_back_notices: u64,
    pub groups_reclaimed: u64,
    pub forged_frees: u64,
    pub chains_rearmed: u64,
    pub quota_disconnects: u64,
    pub tickets_settled: u64,
    pub chunks_scrubbed: u64,
    /// CNs evicted because the transport could not reach them (stalled or vanished).
    pub cns_evicted: u64,
    /// Evictions the deployment was not told of: more than [`MAX_CNS`] since it last took
    /// the list ([`MemoryNode::take_evicted`]). The CNs are gone all the same (their QPs
    /// destroyed, their groups reclaimed); only the deployment's own connection state stays.
    pub evictions_unreported: u64,
    pub probes_sent: u64,
    /// Windows found (audit) or about to be bound (host engine) over anything but their chunk.
    pub spans_refused: u64,
    /// Alloc repairs that found the popped group already moved on (freed, or held by another).
    pub stale_repairs: u64,
    /// Chains stopped before the MN decided about their groups ("quiesce, decide, push").
    pub quiesces: u64,
    /// The MN's own pushes refused by the check (already queued, popped in flight, a window
    /// still bound): each one a push that would have corrupted the queue.
    pub pushes_refused: u64,
    /// Groups left out of the queue because a window of theirs stayed bound.
    pub groups_quarantined: u64,
    /// Receives that reported a remote invalidation (SEND_WITH_INV), and of those the ones
    /// whose window was not the sender's own (another CN's, or no CN's): the sender is evicted.
    pub remote_invalidations: u64,
    pub foreign_invalidations: u64,
    /// Windows bound again for their owner after a remote invalidation (the owner was told
    /// the new key), and restores that failed (the group was reclaimed instead).
    pub windows_restored: u64,
    pub restores_failed: u64,
    /// Scans of the free queue the checked push made because no evidence placed the group
    /// (`mn/quiesce.rs`: at most one per interrupted lap, none per group of a reclaim).
    pub queue_scans: u64,
    /// Counts of a suspect's holdings in the MWTable (a whole-table scan, lazy quota only).
    pub quota_recounts: u64,
    /// MWTable entries the incremental audit examined, and its complete passes.
    pub audit_entries: u64,
    pub audit_passes: u64,
}

/// A window invalidated behind its owner's back, waiting to be bound again while a lap of that
/// owner on the same group is still uncommitted.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct PendingRestore {
    owner: CnId,
    group: GroupId,
    mw: u8,
    /// The key the invalidation named (a port that cannot tell bindings restores only while
    /// the table still holds it).
    rkey: Rkey,
}

/// What the audit found of one owned group: its active owner (and the owner's slot), an access
/// window bound outside the owner's access QPs, a window reaching outside the group's own chunk.
#[derive(Clone, Copy, Debug)]
struct AuditFinding {
    cn: CnId,
    slot: u32,
    misbound: bool,
    outside: bool,
}

/// A window of the MWTable: its group, its index in the group, the group's owner (0: free).
type WindowHit = (GroupId, usize, u32);

/// What restoring one window came to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Restore {
    /// Bound again under the next key; the owner was told.
    Done,
    /// A lap of the owner on this group is uncommitted: try again after the next event.
    Deferred,
    /// Nothing to restore (the group moved on, its owner left, the window is bound), or the
    /// bind failed and the group was reclaimed.
    Settled,
}

#[derive(Debug)]
pub struct MemoryNode {
    cfg: MnConfig,
    map: MnMemoryMap,
    keys: MnKeys,
    cns: heapless::Vec<Option<CnRecord>, MAX_CNS>,
    next_cn: u32,
    /// Slot addresses of pops that found the queue empty, not yet settled (one per alloc
    /// chain at most).
    tickets: heapless::Vec<u64, { MAX_CNS * MAX_ALLOC_CHAINS }>,
    /// The pool's generation: an RNIC reset revokes every allocation and starts the next
    /// (`wire::message::AllocReply::generation`).
    generation: u32,
    /// CNs evicted since the deployment last asked ([`MemoryNode::take_evicted`]).
    evicted: heapless::Vec<CnId, MAX_CNS>,
    empty: bool,
    stats: MnStats,
    now: u64,
    /// The form the device fetches the chains in: it sizes their rings.
    wqe_format: crate::wire::wqe_format::WqeFormat,
    /// [`MemoryNode::set_chains_post_receives`].
    chains_post_receives: bool,
    /// Per CN slot: its proof word and key, for layouts that bind to the poster
    /// ([`MemoryNode::set_owner_proofs`], `chain::builder::OwnerProof`).
    owner_proofs: [Option<crate::chain::builder::OwnerProof>; MAX_CNS],
    /// Why the last refused push was refused (tests and logs).
    last_push_refused: Option<PushRefused>,
    /// The last chain failure the MN handled (tests and logs).
    last_chain_failure: Option<(CnId, ChainKind, Option<u8>, LapFailure)>,
    /// Remotely invalidated windows whose restore waits for their owner's lap to end.
    restores: heapless::Vec<PendingRestore, { 2 * MAX_CNS }>,
    /// Tenants CNs may be admitted as ([`MemoryNode::connect_as`]).
    tenants: TenantTable,
    /// When the next offloaded audit is due (offloaded mode, `audit_ns` > 0).
    audit_at: u64,
    /// Groups each CN slot holds by the MN's own count (`mn/quota.rs`): exact in host-engine
    /// mode; signed, because a lap's change and the MN's may be counted in either order.
    held: [i32; MAX_CNS],
    /// The incremental audit: the next entry it examines, what it counted per slot in the
    /// current pass, and the counts of the last complete pass.
    audit_cursor: u32,
    audit_pass: [u32; MAX_CNS],
    audit_held: [u32; MAX_CNS],
    /// Slots whose holdings were counted in the table during the current audit pass (bit per
    /// slot): a suspect is recounted at most once per pass.
    recounted_this_pass: u32,
    /// Per slot: the lap counters (allocs, frees) when the CN was last counted in the table.
    counted_at: [(u64, u64); MAX_CNS],
    /// Per slot, host-engine mode: the alloc chains (bit j: chain j) with a lap served
    /// ([`Action::ServeLap`]) that has neither committed nor been stopped — with several alloc
    /// chains a CN has up to that many in flight, and the exact quota counts them.
    alloc_in_flight: [u8; MAX_CNS],
    /// The quota in bytes across the MN's size classes, and what each CN holds in the other
    /// classes (`mn/class_quota.rs`).
    class_quota: class_quota::ClassQuota,
}
const _: () = assert!(MAX_CNS <= 32, "recounted_this_pass keeps a bit per CN slot");

type R<E> = Result<(), MnError<E>>;

fn rd<P: MnPort>(p: &mut P, addr: u64) -> Result<u64, MnError<P::Error>> {
    let mut b = [0u8; 8];
    p.read(addr, &mut b).map_err(MnError::Port)?;
    Ok(u64::from_le_bytes(b))
}
fn wr<P: MnPort>(p: &mut P, addr: u64, v: u64) -> R<P::Error> {
    p.write(addr, &v.to_le_bytes()).map_err(MnError::Port)
}
fn read_entry<P: MnPort>(p: &mut P, addr: u64) -> Result<MwTableEntry, MnError<P::Error>> {
    let mut b = [0u8; ENTRY_SIZE];
    p.read(addr, &mut b).map_err(MnError::Port)?;
    Ok(MwTableEntry::from_bytes(b))
}
fn write_entry<P: MnPort>(p: &mut P, addr: u64, e: &MwTableEntry) -> R<P::Error> {
    p.write(addr, e.as_bytes()).map_err(MnError::Port)
}

impl MemoryNode {
    pub fn new(cfg: MnConfig, map: MnMemoryMap, keys: MnKeys) -> Result<Self, MnError<core::convert::Infallible>> {
        if cfg.max_cns as usize > MAX_CNS
            || cfg.alloc_chains == 0
            || cfg.alloc_chains as usize > MAX_ALLOC_CHAINS
            || map.max_cns < cfg.max_cns * cfg.alloc_chains as u32
            || map.geometry != cfg.geometry
        {
            return Err(MnError::BadConfig);
        }
        let mut cns = heapless::Vec::new();
        cns.resize(cfg.max_cns as usize, None).map_err(|()| MnError::BadConfig)?;
        Ok(MemoryNode {
            cfg,
            map,
            keys,
            cns,
            next_cn: 1,
            tickets: heapless::Vec::new(),
            generation: 0,
            evicted: heapless::Vec::new(),
            empty: false,
            stats: MnStats::default(),
            now: 0,
            wqe_format: crate::wire::wqe_format::WqeFormat::Canonical,
            chains_post_receives: false,
            owner_proofs: [None; MAX_CNS],
            last_push_refused: None,
            last_chain_failure: None,
            restores: heapless::Vec::new(),
            tenants: TenantTable::new(),
            audit_at: cfg.audit_ns,
            held: [0; MAX_CNS],
            audit_cursor: 0,
            audit_pass: [0; MAX_CNS],
            audit_held: [0; MAX_CNS],
            recounted_this_pass: 0,
            counted_at: [(0, 0); MAX_CNS],
            alloc_in_flight: [0; MAX_CNS],
            class_quota: class_quota::ClassQuota::new(),
        })
    }

    /// The chains' rings are in `f` on this MN's device (`RdmaBackend::wqe_format`): their
    /// depths ([`MemoryNode::chain_ring_depths`]) follow.
    pub fn set_wqe_format(&mut self, f: crate::wire::wqe_format::WqeFormat) {
        self.wqe_format = f;
    }

    /// Offloaded chains publish their own receives through the management QP's receive
    /// doorbell record (`ChainEnv::posts_receives`): the device has one a chain can write
    /// (`Capabilities::RECV_DOORBELL_RECORD`). Only while no CN is connected (their chains keep
    /// the layout they were armed with); `MnDriver::new` sets it from the device.
    pub fn set_chains_post_receives(&mut self, on: bool) -> bool {
        if self.cns().next().is_some() {
            return false;
        }
        self.chains_post_receives = on;
        true
    }

    pub fn config(&self) -> &MnConfig {
        &self.cfg
    }
    pub fn map(&self) -> &MnMemoryMap {
        &self.map
    }
    pub fn keys(&self) -> &MnKeys {
        &self.keys
    }
    pub fn mode(&self) -> ExecutionMode {
        self.cfg.mode
    }
    /// The pool's generation (`wire::message::AllocReply::generation`): RNIC resets so far.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    pub fn stats(&self) -> MnStats {
        self.stats
    }
    /// The last chain failure the MN handled: whose chain, which step (None: the RECV), why.
    pub fn last_chain_failure(&self) -> Option<(CnId, ChainKind, Option<u8>, LapFailure)> {
        self.last_chain_failure
    }
    /// Why the MN's last refused push was refused, if one was.
    pub fn last_push_refused(&self) -> Option<PushRefused> {
        self.last_push_refused
    }
    pub fn is_empty_state(&self) -> bool {
        self.empty
    }
    pub fn tickets(&self) -> &[u64] {
        &self.tickets
    }
    pub fn cns(&self) -> impl Iterator<Item = &CnRecord> {
        self.cns.iter().flatten()
    }
    pub fn cn(&self, cn: CnId) -> Option<&CnRecord> {
        self.cns().find(|r| r.cn == cn)
    }
    /// The CN whose management QP (MN end) is `qp`, which chain's it is, and for an alloc
    /// chain which one (0 for the free chain).
    pub fn cn_of_mgmt_qp(&self, qp: Qpn) -> Option<(CnId, ChainKind, u8)> {
        self.cns().find_map(|r| {
            if r.qps.free == qp {
                return Some((r.cn, ChainKind::Free, 0));
            }
            r.alloc_chains().find(|(_, m, _)| *m == qp).map(|(j, _, _)| (r.cn, ChainKind::Alloc, j))
        })
    }
    /// The CN one of whose QPs (MN ends: management, access, chain loopback) is `qp`.
    pub fn cn_of_qp(&self, qp: Qpn) -> Option<CnId> {
        self.cns()
            .find(|r| {
                r.qps.alloc == qp
                    || r.qps.free == qp
                    || r.qps.alloc_loop == Some(qp)
                    || r.qps.free_loop == Some(qp)
                    || r.qps.access.contains(&qp)
                    || r.extra_qps().any(|q| q == qp)
            })
            .map(|r| r.cn)
    }

    /// Scratch areas the memory map must hold: one per alloc chain of every CN slot (the first
    /// chain's area also holds the CN's free chain, request and send buffers).
    pub const fn scratch_slots(max_cns: u32, alloc_chains: u8) -> u32 {
        max_cns * alloc_chains as u32
    }

    /// The memory-map slot of alloc chain `j` of the CN in connection slot `slot`: chain 0 is
    /// the CN's own slot, chain j the slot `slot + j × max_cns` — so every chain's markers,
    /// reply image and request buffer lie in a scratch area of their own.
    pub fn chain_slot(&self, slot: u32, j: u8) -> u32 {
        slot + j as u32 * self.cfg.max_cns
    }

    /// The scratch area of alloc chain `j` of the CN in `slot`.
    pub fn chain_scratch(&self, slot: u32, j: u8) -> Option<u64> {
        if j as usize >= MAX_ALLOC_CHAINS {
            return None;
        }
        self.map.scratch(self.chain_slot(slot, j))
    }

    /// The scratch areas of every alloc chain of `cn`, chain 0 first.
    fn alloc_scratches(&self, cn: CnId) -> heapless::Vec<u64, MAX_ALLOC_CHAINS> {
        let mut v = heapless::Vec::new();
        if let Some(r) = self.cn(cn) {
            for j in 0..r.alloc_chain_count() {
                if let Some(s) = self.chain_scratch(r.slot, j) {
                    let pushed = v.push(s);
                    debug_assert!(pushed.is_ok(), "at most MAX_ALLOC_CHAINS chains per CN");
                }
            }
        }
        v
    }

    /// The environment a CN's chain is built for (its first alloc chain for `Alloc`).
    pub fn chain_env(&self, cn: CnId, kind: ChainKind) -> Option<ChainEnv> {
        self.chain_env_of(cn, kind, 0)
    }

    /// The environment of alloc chain `chain` of `cn` (`chain` 0 for the free chain): its own
    /// QPs and its own scratch area ([`MemoryNode::chain_slot`]).
    pub fn chain_env_of(&self, cn: CnId, kind: ChainKind, chain: u8) -> Option<ChainEnv> {
        let r = self.cn(cn)?;
        let (slot, (mgmt, lp)) = match kind {
            ChainKind::Alloc => (self.chain_slot(r.slot, chain), r.alloc_chain(chain)?),
            ChainKind::Free => (r.slot, (r.qps.free, r.qps.free_loop)),
        };
        self.map.scratch(slot)?;
        // host-engine mode has no loop QP: the engine never posts to it
        let loop_qpn = lp.map(|q| q.get()).unwrap_or(0xFF_FFFF);
        Some(self.env_for(slot, cn, [loop_qpn, mgmt.get(), r.qps.free.get()]))
    }

    /// The chain environment of CN `cn` in slot `slot` with QPs `[loop, mgmt, free]`.
    fn env_for(&self, slot: u32, cn: CnId, qpns: [u32; 3]) -> ChainEnv {
        ChainEnv {
            map: self.map,
            slot,
            cn,
            loop_qpn: qpns[0],
            mgmt_qpn: qpns[1],
            free_qpn: qpns[2],
            keys: self.keys,
            queue_depth: self.cfg.queue_depth,
            window_access: self.cfg.window_access,
            // bound to the poster, MW[0] proves nothing and grants nothing: it lives on the QP
            // the CN reaches its data through
            owner_window_access: match self.binds_to_poster() {
                true => AccessFlags::empty(),
                false => AccessFlags::REMOTE_READ,
            },
            pop_ahead: self.cfg.pop_ahead && self.cfg.mode == ExecutionMode::Offloaded,
            // a device's answers shape offloaded chains only: the host engine runs the layout
            // on the MN CPU
            variant: match self.cfg.mode {
                ExecutionMode::Offloaded => self.cfg.chain_variant,
                _ => crate::chain::variant::ChainVariant::default(),
            },
            posts_receives: self.chains_post_receives && self.cfg.mode == ExecutionMode::Offloaded,
            owner_proof: self.owner_proof(slot),
        }
    }

    /// Whether this MN's chains bind only to the QP that posts the bind
    /// (`ChainVariant::binds_to_poster`, offloaded): windows on the CN's Alloc QP, ownership by
    /// the owner's proof key.
    pub fn binds_to_poster(&self) -> bool {
        self.cfg.mode == ExecutionMode::Offloaded && self.cfg.chain_variant.binds_to_poster
    }

    /// Whether window `k` of a group CN `rec` owns may be bound to `qpn`: MW\[0\] to its Free
    /// QP, access windows to its access QPs — or, with chains that bind to the poster
    /// (`ChainVariant::binds_to_poster`), any window to the management QP of one of its alloc
    /// chains (the poster), and access windows still to the access QPs its requests may name
    /// where the device honours a foreign QPN.
    pub fn window_home(&self, rec: &CnRecord, k: usize, qpn: Qpn) -> bool {
        let poster = self.binds_to_poster() && rec.alloc_chains().any(|(_, m, _)| m == qpn);
        poster || if k == 0 { qpn == rec.qps.free } else { rec.qps.access.contains(&qpn) }
    }

    /// The step of `cn`'s free chain whose failure means "not the owner" where the chains bind
    /// to the poster (the proof READ, `chain::free`); `None` elsewhere — there the NIC's own
    /// refusal of the MW\[0\] invalidation says so (`LapFailure::not_owner`).
    pub fn owner_proof_step(&self, cn: CnId) -> Option<u8> {
        if !self.binds_to_poster() {
            return None;
        }
        let env = self.chain_env(cn, ChainKind::Free)?;
        crate::chain::free::build_free_chain(&env).ok()?.ownership_check
    }

    /// What an entry `rec` owns holds after its owner: the CN's proof key where its chains bind
    /// to the poster, else 0.
    pub fn proof_key_of(&self, rec: &CnRecord) -> u32 {
        match self.binds_to_poster() {
            true => self.owner_proof(rec.slot).map_or(0, |p| p.lkey),
            false => 0,
        }
    }

    /// The proof word of the CN in scratch slot `slot` (or of the CN whose alloc chain uses
    /// it), where the MN registered them ([`MemoryNode::set_owner_proofs`]).
    pub fn owner_proof(&self, slot: u32) -> Option<crate::chain::builder::OwnerProof> {
        let cn_slot = slot % self.cfg.max_cns.max(1);
        self.owner_proofs.get(cn_slot as usize).copied().flatten()
    }

    /// The CN slots' proof words and keys (slot `i` gets `proofs[i]`), registered by the MN's
    /// device (`MnDriver::register_owner_proofs`); only while no CN is connected.
    pub fn set_owner_proofs(&mut self, proofs: &[crate::chain::builder::OwnerProof]) -> bool {
        if self.cns().next().is_some() {
            return false;
        }
        self.owner_proofs = [None; MAX_CNS];
        for (slot, p) in self.owner_proofs.iter_mut().zip(proofs) {
            *slot = Some(*p);
        }
        true
    }

    /// Lay chains out for another variant ([`MnConfig::chain_variant`], from the device's
    /// answers: `chain::variant`); only while no CN is connected (connected CNs' chains are
    /// armed with the layout they have).
    ///
    /// Refused too (`false`) for a layout that binds to the poster on an MN whose CNs have
    /// several alloc chains: each chain's windows would be bound to that chain's own QP, while
    /// a CN names one QP for all its windows (`ConnectFlags::WINDOWS_ON_ALLOC_QP`), or without
    /// the CN slots' proof words (`MnDriver::register_owner_proofs`), which its free chains need.
    pub fn set_chain_variant(&mut self, v: crate::chain::variant::ChainVariant) -> bool {
        if self.cns().next().is_some() {
            return false;
        }
        let offloaded = self.cfg.mode == ExecutionMode::Offloaded;
        if v.binds_to_poster && offloaded && (self.cfg.alloc_chains > 1 || self.owner_proofs[0].is_none()) {
            return false;
        }
        self.cfg.chain_variant = v;
        true
    }

    /// Turn popping ahead on or off ([`MnConfig::pop_ahead`]); only while no CN is connected
    /// (connected CNs' chains are armed with the layout they have). With several alloc chains
    /// per CN every chain holds a group ahead; a chain whose pop found the queue empty is
    /// parked alone, and its CN told which ([`Notice::ChainParked`]) — "empty" only once all
    /// of them are.
    pub fn set_pop_ahead(&mut self, on: bool) -> bool {
        if self.cns().next().is_some() {
            return false;
        }
        self.cfg.pop_ahead = on;
        true
    }

    /// Send-queue depths the chain QPs must be created with, `[alloc, free] × [Loop, Mgmt]`
    /// (each ring is exactly one lap deep so it wraps onto its own bytes). Their management
    /// QPs' receive queues are one entry deep. Independent of QP numbers and of the CN.
    /// In mlx5 form the depths are WQEBBs ([`crate::chain::mlx5::ring_wqebbs`]).
    pub fn chain_ring_depths(&self) -> Result<[[u16; 2]; 2], crate::chain::ChainError> {
        let [a, f] = self.chain_sizing_layouts()?;
        match self.wqe_format {
            crate::wire::wqe_format::WqeFormat::Canonical => Ok([a.ring_depth, f.ring_depth]),
            crate::wire::wqe_format::WqeFormat::Mlx5 => {
                let w = |l: &crate::chain::ChainLayout| {
                    crate::chain::mlx5::ring_wqebbs(l).map_err(|e| match e {
                        crate::chain::mlx5::Mlx5ChainError::Invalid(e) => e,
                        _ => crate::chain::ChainError::NoMlx5Form,
                    })
                };
                Ok([w(&a)?, w(&f)?])
            }
        }
    }

    /// WQEs one lap executes on the alloc and on the free chain's management QP, in the form
    /// the device fetches them (mlx5: WQEs, not the WQEBBs a ring is sized in): what turns
    /// the device's count of executed WQEs into laps (offloaded mode's lazy quota).
    pub fn chain_mgmt_wqes_per_lap(&self) -> Result<[u64; 2], crate::chain::ChainError> {
        let [a, f] = self.chain_sizing_layouts()?;
        let per_lap = |l: &crate::chain::ChainLayout| {
            crate::chain::mlx5::lap_cost(l, self.wqe_format)
                .map(|c| c.wqes[crate::chain::Ring::Mgmt as usize] as u64)
                .map_err(|e| match e {
                    crate::chain::mlx5::Mlx5ChainError::Invalid(e) => e,
                    _ => crate::chain::ChainError::NoMlx5Form,
                })
        };
        Ok([per_lap(&a)?, per_lap(&f)?])
    }

    /// The alloc and free chains as built for sizing (slot 0, placeholder QP numbers): their
    /// shapes — ring depths in either WQE format — are those of every CN's chains.
    pub fn chain_sizing_layouts(&self) -> Result<[crate::chain::ChainLayout; 2], crate::chain::ChainError> {
        let cn = CnId::new(1).map_err(|_| crate::chain::ChainError::TooManySteps)?;
        let env = self.env_for(0, cn, [1, 2, 3]);
        let a = crate::chain::alloc::build_alloc_chain(&env)?;
        let f = crate::chain::free::build_free_chain(&env)?;
        Ok([a, f])
    }

    /// Whether alloc-chain step `step` runs before the request arrives (the chain pops its
    /// group ahead: `chain::alloc`), so its failure is not the requester's doing.
    pub(crate) fn alloc_prepares_before_request(&self, step: u8) -> bool {
        self.chain_sizing_layouts().is_ok_and(|[a, _]| a.prepares_before_request(step))
    }

    pub fn scratch_of(&self, cn: CnId) -> Option<u64> {
        self.cn(cn).and_then(|r| self.map.scratch(r.slot))
    }

    /// When the MN next needs a [`Event::Tick`] (the next lease probe or offloaded audit), if
    /// ever. A deployment sleeps until then (or until a completion or a connection event),
    /// never longer.
    pub fn poll_timeout(&self) -> Option<u64> {
        // every timer of the MN, one table: the lease's probes, the offloaded audit (the tail
        // watch while tickets are outstanding is the driver's: it polls the queue)
        let lease = (self.cfg.lease_ns > 0)
            .then(|| {
                self.cns()
                    .filter(|r| r.status == CnStatus::Active)
                    .map(|r| r.probed_at.saturating_add(self.cfg.lease_ns / 2))
                    .min()
            })
            .flatten();
        let audit = (self.cfg.mode == ExecutionMode::Offloaded && self.cfg.audit_ns > 0).then_some(self.audit_at);
        match (lease, audit) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Send one message (an encoder's fixed-size image: one longer than
    /// [`MAX_MESSAGE_LEN`] does not compile).
    fn send<const N: usize, P: MnPort>(&mut self, port: &mut P, cn: CnId, bytes: &[u8; N]) -> R<P::Error> {
        const { assert!(N <= MAX_MESSAGE_LEN) };
        let Some(r) = self.cn(cn) else { return Ok(()) };
        let slot = r.slot;
        let qp = match self.cfg.mode {
            ExecutionMode::Offloaded => r.qps.access[0],
            ExecutionMode::HostEngine => r.qps.alloc,
        };
        let mut v = heapless::Vec::new();
        let copied = v.extend_from_slice(bytes);
        debug_assert!(copied.is_ok(), "N <= MAX_MESSAGE_LEN, asserted at compile time");
        port.apply(Action::Send { slot, qp, bytes: v }).map_err(MnError::Port)
    }

    /// Park alloc chain `j` of `cn` (its pop found the queue empty).
    fn park(&mut self, cn: CnId, j: u8) {
        if let Some(r) = self.cns.iter_mut().flatten().find(|r| r.cn == cn) {
            r.parked_chains |= 1 << j;
            r.alloc_parked = r.parked_chains == (1u8 << r.alloc_chain_count()) - 1;
        }
    }

    /// Park every alloc chain of `cn`.
    fn park_all(&mut self, cn: CnId) {
        if let Some(r) = self.cns.iter_mut().flatten().find(|r| r.cn == cn) {
            r.parked_chains = (1u8 << r.alloc_chain_count()) - 1;
            r.alloc_parked = true;
        }
    }

    /// Whether alloc chain `j` of `cn` is parked.
    fn chain_parked(&self, cn: CnId, j: u8) -> bool {
        self.cn(cn).is_some_and(|r| r.parked_chains & (1 << j) != 0)
    }

    /// The alloc chains of `cn` in `mask` that are not parked.
    fn unparked(&self, cn: CnId, mask: u8) -> u8 {
        self.cn(cn).map_or(0, |r| mask & !r.parked_chains & ((1u8 << r.alloc_chain_count()) - 1))
    }

    /// (Re-)arm a chain: reset its QPs, then post it (offloaded) or post request buffers.
    /// `Alloc`: every alloc chain of the CN.
    fn arm<P: MnPort>(&mut self, port: &mut P, cn: CnId, kind: ChainKind) -> R<P::Error> {
        self.arm_chains(port, cn, kind, ALL_ALLOC_CHAINS)
    }

    /// [`MemoryNode::arm`] for the alloc chains in `mask` (bit j: chain j) alone.
    fn arm_chains<P: MnPort>(&mut self, port: &mut P, cn: CnId, kind: ChainKind, mask: u8) -> R<P::Error> {
        let r = self.cn(cn).ok_or(MnError::UnknownCn(cn))?.clone();
        if r.status != CnStatus::Active {
            return Ok(());
        }
        let chains = match kind {
            ChainKind::Alloc => r.alloc_chain_count(),
            ChainKind::Free => 1,
        };
        for j in (0..chains).filter(|j| kind == ChainKind::Free || mask & (1 << j) != 0) {
            let (mgmt, lp) = match kind {
                ChainKind::Alloc => r.alloc_chain(j).ok_or(MnError::UnknownCn(cn))?,
                ChainKind::Free => (r.qps.free, r.qps.free_loop),
            };
            match self.cfg.mode {
                ExecutionMode::Offloaded => {
                    let lp = lp.ok_or(MnError::MissingLoopQps)?;
                    port.apply(Action::ResetQp(lp)).map_err(MnError::Port)?;
                    port.apply(Action::ResetQp(mgmt)).map_err(MnError::Port)?;
                    let env = self.chain_env_of(cn, kind, j).ok_or(MnError::UnknownCn(cn))?;
                    port.apply(Action::ArmChain { kind, env }).map_err(MnError::Port)?;
                }
                ExecutionMode::HostEngine => {
                    // (the driver posts its request buffer again: a reset dropped it)
                    port.apply(Action::ResetQp(mgmt)).map_err(MnError::Port)?;
                }
            }
        }
        if kind == ChainKind::Alloc {
            if let Some(rec) = self.cns.iter_mut().flatten().find(|x| x.cn == cn) {
                rec.parked_chains &= !mask;
                rec.alloc_parked = false;
            }
        }
        Ok(())
    }

    pub fn handle<P: MnPort>(&mut self, now: u64, event: Event, port: &mut P) -> R<P::Error> {
        self.now = now;
        self.stats.events += 1;
        match event {
            Event::ChainFailed { cn, kind, chain, step, failure } => {
                self.last_chain_failure = Some((cn, kind, step, failure));
                self.on_chain_failed(port, cn, kind, chain, step, failure)
            }
            Event::RequestArrived { cn, kind, chain, len } => self.on_request(port, cn, kind, chain, len),
            Event::CnAnswered { cn } => {
                self.cn_answered(cn);
                Ok(())
            }
            Event::LapCommitted { cn, kind, chain, freed } => {
                if let Some(entry) = freed {
                    // the group is back in the queue, but no other lap runs a step before the
                    // MN returns (one thread; the NIC pops nothing in this mode): clear the
                    // chunk before its next owner can get it
                    self.scrub_entry(port, entry)?;
                }
                if let Some(r) = self.cns.iter_mut().flatten().find(|r| r.cn == cn) {
                    match kind {
                        ChainKind::Alloc => r.allocs += 1,
                        ChainKind::Free => r.frees += 1,
                    }
                    if kind == ChainKind::Alloc && (chain as usize) < MAX_ALLOC_CHAINS {
                        self.alloc_in_flight[r.slot as usize] &= !(1 << chain);
                    }
                }
                self.enforce_quota(port, cn)?;
                if kind == ChainKind::Free {
                    self.settle(port)?;
                }
                Ok(())
            }
            Event::CounterSample { cn, allocs, frees } => {
                if let Some(r) = self.cns.iter_mut().flatten().find(|r| r.cn == cn) {
                    r.allocs = allocs;
                    r.frees = frees;
                }
                // O(CNs) unless the counters make it a suspect (then counted in the table,
                // at most once per audit pass)
                self.enforce_quota(port, cn)
            }
            Event::CnGone { cn } => self.on_cn_gone(port, cn),
            Event::CnUnresponsive { cn } => self.evict(port, cn),
            Event::RnicReset => self.on_rnic_reset(port),
            Event::Tick => {
                if self.cfg.mode == ExecutionMode::Offloaded {
                    self.audit_at = now.saturating_add(self.cfg.audit_ns);
                    self.audit(port)?;
                }
                self.probe_due(port)?;
                self.settle(port)
            }
            Event::WatchTail => self.settle(port),
            Event::RemoteInvalidation { qp, rkey } => self.on_remote_invalidation(port, qp, rkey),
        }?;
        self.retry_restores(port)
    }

    fn broadcast<P: MnPort>(&mut self, port: &mut P, n: Notice) -> R<P::Error> {
        match n {
            Notice::Empty => self.stats.empty_notices += 1,
            Notice::ChainParked { .. } => self.stats.chain_parked_notices += 1,
            Notice::Available { .. } => self.stats.available_notices += 1,
            Notice::Probe { .. } => {}
        }
        let cns: heapless::Vec<CnId, MAX_CNS> =
            self.cns().filter(|r| r.status == CnStatus::Active).map(|r| r.cn).collect();
        for cn in cns {
            self.send(port, cn, &n.encode())?;
        }
        Ok(())
    }

    /// Settle tickets whose slot has since been filled (move the group to the tail), and
    /// announce "available" once no ticket is left and the queue holds groups.
    fn settle<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
        let mut i = 0;
        while i < self.tickets.len() {
            let slot = self.tickets[i];
            let v = rd(port, slot)?;
            if v != 0 {
                wr(port, slot, 0)?;
                self.push_group(port, v, quiesce::Known::TakenOut { slot })?;
                self.tickets.swap_remove(i);
                self.stats.tickets_settled += 1;
            } else {
                i += 1;
            }
        }
        if self.empty && self.tickets.is_empty() {
            let n = self.free_count(port)?.groups;
            if n > 0 {
                self.empty = false;
                self.broadcast(port, Notice::Available { free_groups: n as u64 })?;
                let parked: heapless::Vec<(CnId, u8), MAX_CNS> =
                    self.cns().filter(|r| r.parked_chains != 0).map(|r| (r.cn, r.parked_chains)).collect();
                for (cn, mask) in parked {
                    self.stats.chains_rearmed += 1;
                    self.arm_chains(port, cn, ChainKind::Alloc, mask)?;
                }
            }
        }
        Ok(())
    }

    /// A receive on the MN end of `qp` reported that its SEND_WITH_INV invalidated `rkey`.
    ///
    /// The window is looked up in the MWTable (exact rkey). If it belongs to a group the
    /// sender holds, the sender revoked its own window: a bad request, counted against it; the
    /// window is bound again (so the group stays consistent and its own free still proves
    /// ownership) and the sender told the new key. Otherwise — another CN's window, a free
    /// group's, or no window of the table — the sender is **evicted**, and a window another CN
    /// holds is restored for that CN: bound again to the same QP over the same chunk under the
    /// next key, the table updated, the owner sent a [`Rebound`] notice. The owner keeps its
    /// chunk and its bytes. Restores happen in host-engine mode only: offloading needs a device
    /// that checks the bound QP on invalidation, where only a window's own QP can revoke it.
    pub(super) fn on_remote_invalidation<P: MnPort>(&mut self, port: &mut P, qp: Qpn, rkey: Rkey) -> R<P::Error> {
        self.stats.remote_invalidations += 1;
        let Some(sender) = self.cn_of_qp(qp) else { return Ok(()) };
        let hit = self.window_of(port, rkey)?;
        let owner = hit.and_then(|(g, _, o)| CnId::new(o).ok().map(|o| (g, o)));
        let own = owner.is_some_and(|(_, o)| o == sender);
        if own {
            if let Some(rec) = self.cns.iter_mut().flatten().find(|r| r.cn == sender) {
                rec.bad_requests += 1;
            }
        } else {
            self.stats.foreign_invalidations += 1;
        }
        if let (Some((g, _, _)), Some((_, o)), true) = (hit, owner, own) {
            // Offloaded, a CN reaches its own windows' QP only where they live on its Alloc QP
            // (chains that bind to the poster): its SEND_WITH_INV there revoked one of its own
            // windows, and the MN cannot bind it again from its admin QP (a bind naming another
            // QP is what such a device refuses or redirects). The group is taken back, the CN
            // told (`TakenBack`); nobody else is affected.
            if self.binds_to_poster() {
                self.stats.restores_failed += 1;
                return self.take_back(port, o, g);
            }
        }
        if let (Some((g, k, _)), Some((_, o))) = (hit, owner) {
            if self.cfg.mode == ExecutionMode::HostEngine {
                let p = PendingRestore { owner: o, group: g, mw: k as u8, rkey };
                if self.restore_window(port, p)? == Restore::Deferred && self.restores.push(p).is_err() {
                    // more deferred restores than CNs can cause: give the group up safely
                    self.stats.restores_failed += 1;
                    self.take_back(port, o, g)?;
                }
            }
        }
        if !own {
            self.evict(port, sender)?;
        }
        Ok(())
    }

    /// The group, window index and owner of the MWTable window whose current rkey is `rkey`.
    fn window_of<P: MnPort>(&mut self, port: &mut P, rkey: Rkey) -> Result<Option<WindowHit>, MnError<P::Error>> {
        for i in 0..self.cfg.geometry.chunk_count() {
            let g = GroupId(i);
            let e = read_entry(port, self.map.entry_addr(g).ok_or(MnError::BadConfig)?)?;
            if let Some(k) = (0..self.cfg.geometry.group_size()).find(|k| e.rkey(*k) == rkey) {
                return Ok(Some((g, k, e.owner())));
            }
        }
        Ok(None)
    }

    /// Bind a remotely invalidated window again for its owner, unless the group moved on.
    fn restore_window<P: MnPort>(&mut self, port: &mut P, p: PendingRestore) -> Result<Restore, MnError<P::Error>> {
        let addr = self.map.entry_addr(p.group).ok_or(MnError::BadConfig)?;
        let mut e = read_entry(port, addr)?;
        let k = p.mw as usize;
        let Some(rec) = self.cn(p.owner).cloned() else { return Ok(Restore::Settled) };
        if e.owner() != p.owner.get() || e.reserved.get() != 0 || rec.status != CnStatus::Active {
            return Ok(Restore::Settled);
        }
        // a lap of the owner on this very group is uncommitted (it popped it and is binding,
        // or it is freeing it): its commit or its repair decides first
        let s = self.map.scratch(rec.slot).ok_or(MnError::BadConfig)?;
        if rd(port, s + FREE_SCRATCH_OFF + free_scratch::ENTRY_ADDR)? == addr {
            return Ok(Restore::Deferred);
        }
        for a in self.alloc_scratches(p.owner) {
            if rd(port, a + ALLOC_SCRATCH_OFF + alloc_scratch::REPLY_ENTRY_ADDR)? == addr {
                return Ok(Restore::Deferred);
            }
        }
        let old = e.rkey(k);
        match port.mw_binding(old) {
            Some(MwBinding::Bound { .. }) => return Ok(Restore::Settled),
            None if old != p.rkey => return Ok(Restore::Settled),
            _ => {}
        }
        let qp = match k {
            0 => rec.qps.free,
            _ => match rec.qps.access.get(k - 1) {
                Some(q) => *q,
                None => return Ok(Restore::Settled),
            },
        };
        let access = if k == 0 { AccessFlags::REMOTE_READ } else { self.cfg.window_access };
        let geo = self.cfg.geometry;
        let base = geo.chunk_base(p.group).ok_or(MnError::BadConfig)?;
        let new = old.next_key();
        port.apply(Action::Rebind {
            rkey: new,
            qp,
            addr: base,
            len: geo.chunk_size() as u32,
            lkey: e.lkey.get(),
            access,
        })
        .map_err(MnError::Port)?;
        e.set_rkey(k, new);
        self.put_entry(port, addr, &e)?;
        match port.mw_binding(new) {
            None => {}
            Some(MwBinding::Bound { rkey, qpn }) if rkey == new && qpn == qp => {}
            Some(_) => {
                // the owner's QP is gone or in error: its window cannot come back there
                self.stats.restores_failed += 1;
                self.take_back(port, p.owner, p.group)?;
                return Ok(Restore::Settled);
            }
        }
        self.stats.windows_restored += 1;
        self.send(port, p.owner, &Rebound { entry_addr: addr, mw: p.mw, rkey: new }.encode())?;
        Ok(Restore::Done)
    }

    /// Restores deferred behind a lap of their owner: retried after every event.
    fn retry_restores<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
        let mut i = 0;
        while i < self.restores.len() {
            let p = self.restores[i];
            if self.restore_window(port, p)? == Restore::Deferred {
                i += 1;
            } else {
                self.restores.swap_remove(i);
            }
        }
        Ok(())
    }
}
