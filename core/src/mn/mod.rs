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
use crate::device::{ExecutionMode, MwBinding, WcStatus};
use crate::geometry::{PoolGeometry, MAX_GROUP_SIZE};
use crate::ids::{CnId, GroupId, Qpn, Rkey};
use crate::mn::tenant::{TenantError, TenantId, TenantLimits, TenantTable};
use crate::wire::memory_map::{
    alloc_scratch, free_scratch, MnMemoryMap, ALLOC_SCRATCH_OFF, FREE_SCRATCH_OFF, SCRATCH_PER_CN,
};
use crate::wire::message::{AllocReply, ConnectInfo, ErrorCode, ErrorReply, Notice, Rebound};
use crate::wire::mwtable::{MwTableEntry, ENTRY_SIZE};
use crate::wire::wqe::masked_add;
use core::fmt;
use zerocopy::IntoBytes;

pub mod driver;
pub mod host_engine;
pub mod invariants;
pub mod plan;
mod quiesce;
pub mod tenant;
#[cfg(test)]
mod tests;
pub use quiesce::{scan_free, Chains, FreeCount, PushRefused, Quiesced, Whereabouts};

/// Most CNs one MN serves (fixed so the control plane needs no heap).
pub const MAX_CNS: usize = 32;
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
}

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
    /// The alloc chain is parked (not armed) until the queue is available again.
    pub alloc_parked: bool,
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
}

/// What the MN asks its port to do. Each completes before `apply` returns.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Action {
    /// Bring a QP pair back to RTS with empty queues.
    ResetQp(Qpn),
    /// Build and arm a chain (offloaded mode).
    ArmChain { kind: ChainKind, env: ChainEnv },
    /// Post plain receive buffers for requests on a management QP (host-engine mode).
    PostRequestBuffers { qp: Qpn },
    /// Invalidate the window with this exact rkey if it is bound; nothing if it is not.
    Unbind { rkey: Rkey },
    /// Send a message to a CN: on the MN end of its first access QP (the only CN-facing send
    /// queue not carrying a chain); `slot` selects the CN's send buffers.
    Send { slot: u32, qp: Qpn, bytes: heapless::Vec<u8, 64> },
    /// Disconnect a CN's management QPs (quota enforcement).
    DisconnectMgmt { alloc: Qpn, free: Qpn },
    /// Destroy all QPs of a CN that left (its windows are already invalidated).
    ReleaseCn { qps: CnQps },
    /// Host-engine mode's quiesce: end the MN CPU's in-flight laps of `cn` (of the chains
    /// named), each once the device step it posted has completed or been flushed — so nothing
    /// of them lands after the MN decided. Offloaded mode stops chains with [`Action::ResetQp`].
    StopLaps { cn: CnId, alloc: bool, free: bool },
    /// Bind the (unbound) window `rkey.index()` again under `rkey`, over `[addr, addr+len)` of
    /// the MR `lkey`, to QP `qp` (a window someone else invalidated, restored for its owner).
    /// The port reports the outcome through [`MnPort::mw_binding`] where it can tell.
    Rebind { rkey: Rkey, qp: Qpn, addr: u64, len: u32, lkey: u32, access: AccessFlags },
}

/// Exceptions and timers the MN reacts to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Event {
    /// A chain completed a step with an error (`step` None: the trigger RECV).
    ChainFailed { cn: CnId, kind: ChainKind, step: Option<u8>, status: WcStatus },
    /// Host-engine mode: a lap committed (the MN CPU ran it).
    LapCommitted { cn: CnId, kind: ChainKind },
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
    /// else's ([`MemoryNode::on_remote_invalidation`]).
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
    pub available_notices: u64,
    pub groups_reclaimed: u64,
    pub forged_frees: u64,
    pub chains_rearmed: u64,
    pub quota_disconnects: u64,
    pub tickets_settled: u64,
    pub chunks_scrubbed: u64,
    /// CNs evicted because the transport could not reach them (stalled or vanished).
    pub cns_evicted: u64,
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

/// What the audit found of one owned group: its active owner, an access window bound outside
/// the owner's access QPs, a window reaching outside the group's own chunk.
type AuditFinding = (CnId, bool, bool);

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
    /// Slot addresses of pops that found the queue empty, not yet settled.
    tickets: heapless::Vec<u64, MAX_CNS>,
    /// CNs evicted since the deployment last asked ([`MemoryNode::take_evicted`]).
    evicted: heapless::Vec<CnId, MAX_CNS>,
    empty: bool,
    stats: MnStats,
    now: u64,
    /// The form the device fetches the chains in: it sizes their rings.
    wqe_format: crate::wire::wqe_format::WqeFormat,
    /// Why the last refused push was refused (tests and logs).
    last_push_refused: Option<PushRefused>,
    /// Remotely invalidated windows whose restore waits for their owner's lap to end.
    restores: heapless::Vec<PendingRestore, { 2 * MAX_CNS }>,
    /// Tenants CNs may be admitted as ([`MemoryNode::connect_as`]).
    tenants: TenantTable,
}

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
    Ok(MwTableEntry::read(&b).unwrap_or_default())
}
fn write_entry<P: MnPort>(p: &mut P, addr: u64, e: &MwTableEntry) -> R<P::Error> {
    p.write(addr, e.as_bytes()).map_err(MnError::Port)
}

impl MemoryNode {
    pub fn new(cfg: MnConfig, map: MnMemoryMap, keys: MnKeys) -> Result<Self, MnError<core::convert::Infallible>> {
        if cfg.max_cns as usize > MAX_CNS || map.max_cns < cfg.max_cns || map.geometry != cfg.geometry {
            return Err(MnError::BadConfig);
        }
        let mut cns = heapless::Vec::new();
        for _ in 0..cfg.max_cns {
            let _ = cns.push(None);
        }
        Ok(MemoryNode {
            cfg,
            map,
            keys,
            cns,
            next_cn: 1,
            tickets: heapless::Vec::new(),
            evicted: heapless::Vec::new(),
            empty: false,
            stats: MnStats::default(),
            now: 0,
            wqe_format: crate::wire::wqe_format::WqeFormat::Canonical,
            last_push_refused: None,
            restores: heapless::Vec::new(),
            tenants: TenantTable::new(),
        })
    }

    /// The chains' rings are in `f` on this MN's device (`RdmaBackend::wqe_format`): their
    /// depths ([`MemoryNode::chain_ring_depths`]) follow.
    pub fn set_wqe_format(&mut self, f: crate::wire::wqe_format::WqeFormat) {
        self.wqe_format = f;
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
    pub fn stats(&self) -> MnStats {
        self.stats
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
    /// The CN whose management QP (MN end) is `qp`.
    pub fn cn_of_mgmt_qp(&self, qp: Qpn) -> Option<(CnId, ChainKind)> {
        self.cns().find_map(|r| {
            if r.qps.alloc == qp {
                Some((r.cn, ChainKind::Alloc))
            } else if r.qps.free == qp {
                Some((r.cn, ChainKind::Free))
            } else {
                None
            }
        })
    }
    /// The CN one of whose QPs (MN ends: management, access, chain loopback) is `qp`.
    pub fn cn_of_qp(&self, qp: Qpn) -> Option<CnId> {
        self.cn_of_chain_qp(qp)
            .map(|(cn, _)| cn)
            .or_else(|| self.cns().find(|r| r.qps.access.contains(&qp)).map(|r| r.cn))
    }

    /// The CN one of whose chain QPs (MN ends, incl. loopback) is `qp`.
    pub fn cn_of_chain_qp(&self, qp: Qpn) -> Option<(CnId, ChainKind)> {
        self.cn_of_mgmt_qp(qp).or_else(|| {
            self.cns().find_map(|r| {
                if r.qps.alloc_loop == Some(qp) {
                    Some((r.cn, ChainKind::Alloc))
                } else if r.qps.free_loop == Some(qp) {
                    Some((r.cn, ChainKind::Free))
                } else {
                    None
                }
            })
        })
    }

    /// The environment a CN's chain is built for.
    pub fn chain_env(&self, cn: CnId, kind: ChainKind) -> Option<ChainEnv> {
        let r = self.cn(cn)?;
        let (mgmt, lp) = match kind {
            ChainKind::Alloc => (r.qps.alloc, r.qps.alloc_loop),
            ChainKind::Free => (r.qps.free, r.qps.free_loop),
        };
        Some(ChainEnv {
            map: self.map,
            slot: r.slot,
            cn,
            // host-engine mode has no loop QP: the engine never posts to it
            loop_qpn: lp.map(|q| q.get()).unwrap_or(0xFF_FFFF),
            mgmt_qpn: mgmt.get(),
            free_qpn: r.qps.free.get(),
            keys: self.keys,
            queue_depth: self.cfg.queue_depth,
            window_access: self.cfg.window_access,
            owner_window_access: AccessFlags::REMOTE_READ,
        })
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

    /// The alloc and free chains as built for sizing (slot 0, placeholder QP numbers): their
    /// shapes — ring depths in either WQE format — are those of every CN's chains.
    pub fn chain_sizing_layouts(&self) -> Result<[crate::chain::ChainLayout; 2], crate::chain::ChainError> {
        let env = ChainEnv {
            map: self.map,
            slot: 0,
            cn: CnId::new(1).map_err(|_| crate::chain::ChainError::TooManySteps)?,
            loop_qpn: 1,
            mgmt_qpn: 2,
            free_qpn: 3,
            keys: self.keys,
            queue_depth: self.cfg.queue_depth,
            window_access: self.cfg.window_access,
            owner_window_access: AccessFlags::REMOTE_READ,
        };
        let a = crate::chain::alloc::build_alloc_chain(&env)?;
        let f = crate::chain::free::build_free_chain(&env)?;
        Ok([a, f])
    }

    pub fn scratch_of(&self, cn: CnId) -> Option<u64> {
        self.cn(cn).and_then(|r| self.map.scratch(r.slot))
    }

    // ------------------------------------------------------------------ initialisation

    /// Write a fresh MWTable (every group free, owner 0) and a full free queue. `rkey(g, i)`
    /// is the initial rkey of MW[i] of group g; `lkey(g)` the MR the group's windows bind in.
    pub fn format<P: MnPort>(
        &mut self,
        port: &mut P,
        rkey: impl Fn(GroupId, usize) -> Rkey,
        lkey: impl Fn(GroupId) -> u32,
    ) -> R<P::Error> {
        self.format_begin(port)?;
        let g = self.cfg.geometry;
        for i in 0..g.chunk_count() {
            let gid = GroupId(i);
            let rkeys: heapless::Vec<Rkey, MAX_GROUP_SIZE> = (0..g.group_size()).map(|k| rkey(gid, k)).collect();
            self.format_group(port, gid, lkey(gid), &rkeys)?;
        }
        self.format_end(port)
    }

    /// Formatting in steps, so a provisioner can register each chunk and allocate its windows
    /// as it goes (no table of keys held anywhere): zero the metadata first…
    pub fn format_begin<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
        let zero = [0u8; 256];
        let mut off = 0;
        while off < self.map.meta_len {
            let n = (self.map.meta_len - off).min(zero.len() as u64) as usize;
            port.write(self.map.meta_base + off, &zero[..n]).map_err(MnError::Port)?;
            off += n as u64;
        }
        Ok(())
    }

    /// …then write each group's entry (free, owner 0) and its queue slot…
    pub fn format_group<P: MnPort>(&mut self, port: &mut P, gid: GroupId, lkey: u32, rkeys: &[Rkey]) -> R<P::Error> {
        let g = self.cfg.geometry;
        let entry = self.map.entry_addr(gid).ok_or(MnError::BadConfig)?;
        let base = g.chunk_base(gid).ok_or(MnError::BadConfig)?;
        if rkeys.len() != g.group_size() {
            return Err(MnError::BadConfig);
        }
        let e = MwTableEntry::new(base, g.chunk_size() as u32, lkey, rkeys);
        write_entry(port, entry, &e)?;
        wr(port, self.map.queue.slot_addr(gid.0), entry)
    }

    /// …and last the queue's head and tail: every group free.
    pub fn format_end<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
        let g = self.cfg.geometry;
        wr(port, self.map.queue.head, self.map.queue.ring)?;
        wr(port, self.map.queue.tail, self.map.queue.slot_addr(g.chunk_count()))?;
        self.empty = false;
        self.tickets.clear();
        Ok(())
    }

    // ------------------------------------------------------------------ connections

    /// A CN connected with these MN-side QPs: assign it an id and a slot, prepare its scratch,
    /// arm its chains (or post request buffers), and tell it who it is.
    pub fn connect<P: MnPort>(&mut self, port: &mut P, qps: CnQps) -> Result<CnId, MnError<P::Error>> {
        self.connect_as(port, qps, None)
    }

    /// A tenant the deployment authenticates CNs as: its limits hold over all its CNs.
    pub fn add_tenant(&mut self, id: TenantId, limits: TenantLimits) -> Result<(), TenantError> {
        self.tenants.add(id, limits)
    }
    pub fn tenants(&self) -> &TenantTable {
        &self.tenants
    }

    /// [`MemoryNode::connect`] for a CN the deployment authenticated as `tenant` (None: as
    /// `connect`). Refused — before anything is set up — for an unknown tenant or one whose CN
    /// slots are all taken.
    pub fn connect_as<P: MnPort>(
        &mut self,
        port: &mut P,
        qps: CnQps,
        tenant: Option<TenantId>,
    ) -> Result<CnId, MnError<P::Error>> {
        if let Some(t) = tenant {
            let connected = self.cns().filter(|r| r.tenant == Some(t)).count();
            self.tenants.admit(t, connected).map_err(MnError::Tenant)?;
        }
        let need = self.cfg.geometry.access_windows();
        if qps.access.len() != need {
            return Err(MnError::WrongAccessQpCount { expected: need, got: qps.access.len() });
        }
        if self.cfg.mode == ExecutionMode::Offloaded && (qps.alloc_loop.is_none() || qps.free_loop.is_none()) {
            return Err(MnError::MissingLoopQps);
        }
        let slot = self.cns.iter().position(|c| c.is_none()).ok_or(MnError::TooManyCns)? as u32;
        let cn = CnId::new(self.next_cn).map_err(|_| MnError::BadConfig)?;
        self.next_cn += 1;
        self.stats.events += 1;
        let rec = CnRecord {
            slot,
            cn,
            qps: qps.clone(),
            status: CnStatus::Active,
            alloc_parked: false,
            allocs: 0,
            frees: 0,
            forged_frees: 0,
            bad_requests: 0,
            probed_at: self.now,
            probes: 0,
            probe_outstanding: false,
            tenant,
        };
        self.cns[slot as usize] = Some(rec);
        self.init_scratch(port, slot, cn)?;
        let info = ConnectInfo {
            cn,
            group_size: self.cfg.geometry.group_size() as u8,
            chunk_size: self.cfg.geometry.chunk_size(),
            alloc_qpn: qps.alloc,
            free_qpn: qps.free,
            access_qpns: qps.access.clone(),
            quota: self.quota_of(cn),
        };
        self.send(port, cn, &info.encode())?;
        self.arm(port, cn, ChainKind::Free)?;
        if self.empty {
            self.park(cn);
            self.send(port, cn, &Notice::Empty.encode())?;
        } else {
            self.arm(port, cn, ChainKind::Alloc)?;
        }
        Ok(cn)
    }

    fn init_scratch<P: MnPort>(&mut self, port: &mut P, slot: u32, cn: CnId) -> R<P::Error> {
        let s = self.map.scratch(slot).ok_or(MnError::BadConfig)?;
        port.write(s, &[0u8; SCRATCH_PER_CN as usize]).map_err(MnError::Port)?;
        let a = s + ALLOC_SCRATCH_OFF;
        port.write(a + alloc_scratch::OWNER, &cn.get().to_le_bytes()).map_err(MnError::Port)?;
        port.write(a + alloc_scratch::REPLY, &AllocReply::header_image()).map_err(MnError::Port)?;
        Ok(())
    }

    /// The MN end of the QP the MN's messages to `cn` travel on: a send queue on which no
    /// bind is ever posted, so a message stuck behind a CN that stopped posting receives can
    /// delay nothing but that CN. Offloaded: its first access QP (binds are posted on the
    /// chain QPs: the Alloc QP's send queue is the alloc chain's). Host engine: its Alloc QP
    /// (binds are posted on the Free and access QPs they bind to; the Alloc QP carries only
    /// replies, to the same CN).
    pub fn message_qp(&self, cn: CnId) -> Option<Qpn> {
        let r = self.cn(cn)?;
        Some(match self.cfg.mode {
            ExecutionMode::Offloaded => r.qps.access[0],
            ExecutionMode::HostEngine => r.qps.alloc,
        })
    }

    /// CNs evicted since the last call (the deployment drops their connections).
    pub fn take_evicted(&mut self) -> heapless::Vec<CnId, MAX_CNS> {
        core::mem::take(&mut self.evicted)
    }

    /// When the MN next needs a [`Event::Tick`] (the next lease probe), if ever. A deployment
    /// sleeps until then (or until a completion or a connection event), never longer.
    pub fn poll_timeout(&self) -> Option<u64> {
        if self.cfg.lease_ns == 0 {
            return None;
        }
        self.cns()
            .filter(|r| r.status == CnStatus::Active)
            .map(|r| r.probed_at.saturating_add(self.cfg.lease_ns / 2))
            .min()
    }

    fn send<P: MnPort>(&mut self, port: &mut P, cn: CnId, bytes: &[u8]) -> R<P::Error> {
        let Some(r) = self.cn(cn) else { return Ok(()) };
        let slot = r.slot;
        let qp = match self.cfg.mode {
            ExecutionMode::Offloaded => r.qps.access[0],
            ExecutionMode::HostEngine => r.qps.alloc,
        };
        let mut v = heapless::Vec::new();
        let _ = v.extend_from_slice(&bytes[..bytes.len().min(64)]);
        port.apply(Action::Send { slot, qp, bytes: v }).map_err(MnError::Port)
    }

    fn park(&mut self, cn: CnId) {
        if let Some(r) = self.cns.iter_mut().flatten().find(|r| r.cn == cn) {
            r.alloc_parked = true;
        }
    }

    /// (Re-)arm a chain: reset its QPs, then post it (offloaded) or post request buffers.
    fn arm<P: MnPort>(&mut self, port: &mut P, cn: CnId, kind: ChainKind) -> R<P::Error> {
        let r = self.cn(cn).ok_or(MnError::UnknownCn(cn))?.clone();
        if r.status != CnStatus::Active {
            return Ok(());
        }
        let (mgmt, lp) = match kind {
            ChainKind::Alloc => (r.qps.alloc, r.qps.alloc_loop),
            ChainKind::Free => (r.qps.free, r.qps.free_loop),
        };
        match self.cfg.mode {
            ExecutionMode::Offloaded => {
                let lp = lp.ok_or(MnError::MissingLoopQps)?;
                port.apply(Action::ResetQp(lp)).map_err(MnError::Port)?;
                port.apply(Action::ResetQp(mgmt)).map_err(MnError::Port)?;
                let env = self.chain_env(cn, kind).ok_or(MnError::UnknownCn(cn))?;
                port.apply(Action::ArmChain { kind, env }).map_err(MnError::Port)?;
            }
            ExecutionMode::HostEngine => {
                port.apply(Action::ResetQp(mgmt)).map_err(MnError::Port)?;
                port.apply(Action::PostRequestBuffers { qp: mgmt }).map_err(MnError::Port)?;
            }
        }
        if kind == ChainKind::Alloc {
            if let Some(rec) = self.cns.iter_mut().flatten().find(|x| x.cn == cn) {
                rec.alloc_parked = false;
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------------ events

    pub fn handle<P: MnPort>(&mut self, now: u64, event: Event, port: &mut P) -> R<P::Error> {
        self.now = now;
        self.stats.events += 1;
        match event {
            Event::ChainFailed { cn, kind, step, status } => self.on_chain_failed(port, cn, kind, step, status),
            Event::LapCommitted { cn, kind } => {
                if let Some(r) = self.cns.iter_mut().flatten().find(|r| r.cn == cn) {
                    match kind {
                        ChainKind::Alloc => r.allocs += 1,
                        ChainKind::Free => r.frees += 1,
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
                self.enforce_quota(port, cn)
            }
            Event::CnGone { cn } => self.on_cn_gone(port, cn),
            Event::CnUnresponsive { cn } => self.evict(port, cn),
            Event::RnicReset => self.on_rnic_reset(port),
            Event::Tick => {
                if self.cfg.mode == ExecutionMode::Offloaded {
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

    fn on_chain_failed<P: MnPort>(
        &mut self,
        port: &mut P,
        cn: CnId,
        kind: ChainKind,
        step: Option<u8>,
        status: WcStatus,
    ) -> R<P::Error> {
        let r = self.cn(cn).ok_or(MnError::UnknownCn(cn))?.clone();
        if r.status != CnStatus::Active {
            return Ok(());
        }
        // The CN did not answer its own reply (no receive posted, RNR budget gone) or its host
        // is gone (transport retries exhausted): repairing and re-arming would only stall
        // again. Evict it; every other CN is untouched.
        if matches!(status, WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr) {
            return self.evict(port, cn);
        }
        // Quiesce the failed chain before reading what it left behind. A failed alloc lap that
        // popped a group may have bound MW[0] to this CN's Free QP: the CN (knowing the
        // layouts) can then free it through its own free chain while the repair reclaims it —
        // so its free chain stops too, before anything is decided.
        let s = self.map.scratch(r.slot).ok_or(MnError::BadConfig)?;
        let mut q = self.quiesce(port, cn, Chains::only(kind))?;
        let popped = rd(port, s + ALLOC_SCRATCH_OFF + alloc_scratch::REPLY_ENTRY_ADDR)?;
        if kind == ChainKind::Alloc && popped != 0 {
            q = self.quiesce(port, cn, Chains::BOTH)?;
            self.repair_interrupted(port, &q, ChainKind::Free)?;
        }
        // ... and a failed free of the very group this CN's own alloc lap is still binding
        // (a hostile CN that guessed the entry before its reply) stops that alloc lap first
        if kind == ChainKind::Free
            && popped != 0
            && rd(port, s + FREE_SCRATCH_OFF + free_scratch::ENTRY_ADDR)? == popped
        {
            q = self.quiesce(port, cn, Chains::BOTH)?;
            self.repair_interrupted(port, &q, ChainKind::Alloc)?;
        }
        let other_stopped = q.chains().has(kind.other());
        match kind {
            ChainKind::Alloc => {
                let a = s + ALLOC_SCRATCH_OFF;
                let token = self.token_at(port, a + alloc_scratch::REQ_HDR)?;
                let repair = self.repair_alloc(port, &q, a)?;
                if repair == AllocRepair::TookTicket {
                    // the queue was empty: park this chain until frees refill it
                    self.park(cn);
                    self.send(port, cn, &ErrorReply { token, code: ErrorCode::Empty, detail: 0 }.encode())?;
                    if !self.empty {
                        self.empty = true;
                        self.broadcast(port, Notice::Empty)?;
                    }
                    if other_stopped {
                        self.arm(port, cn, ChainKind::Free)?;
                    }
                    return self.settle(port);
                }
                let code = if step.is_none() || status == WcStatus::LocLenErr {
                    ErrorCode::BadRequest
                } else {
                    ErrorCode::AllocFailed
                };
                // a lap that raced a push on an empty queue did nothing wrong: it only retries
                if repair != AllocRepair::Requeued {
                    if let Some(rec) = self.cns.iter_mut().flatten().find(|x| x.cn == cn) {
                        rec.bad_requests += 1;
                    }
                }
                self.send(port, cn, &ErrorReply { token, code, detail: status as u32 }.encode())?;
                // A CN parked on its ticket stays parked: re-arming it here (e.g. after a
                // flushed request buffer, or a bad request while parked) would let its next
                // request pop again and take a second ticket — more than the ring has room
                // for (capacity = groups + one ticket per CN + 1). Offloaded, a parked chain is
                // not armed; host engine, its request buffer is posted and requests are
                // answered "empty" until "available".
                if r.alloc_parked {
                    if self.cfg.mode == ExecutionMode::HostEngine {
                        self.arm(port, cn, ChainKind::Alloc)?;
                        self.park(cn);
                    }
                } else {
                    self.stats.chains_rearmed += 1;
                    self.arm(port, cn, ChainKind::Alloc)?;
                }
                if other_stopped {
                    self.stats.chains_rearmed += 1;
                    self.arm(port, cn, ChainKind::Free)?;
                }
                // the repair pushed a group: a ticket slot a free filled meanwhile must be
                // settled before the ring's head and tail can come round to it again
                self.settle(port)
            }
            ChainKind::Free => {
                let f = s + FREE_SCRATCH_OFF;
                let token = self.token_at(port, f + free_scratch::REQ_HDR)?;
                let finished = self.repair_free(port, &q, f)?;
                if !finished {
                    let code = if status == WcStatus::MwBindErr { ErrorCode::NotOwner } else { ErrorCode::BadRequest };
                    if code == ErrorCode::NotOwner {
                        self.stats.forged_frees += 1;
                    }
                    if let Some(rec) = self.cns.iter_mut().flatten().find(|x| x.cn == cn) {
                        if code == ErrorCode::NotOwner {
                            rec.forged_frees += 1;
                        } else {
                            rec.bad_requests += 1;
                        }
                    }
                    self.send(port, cn, &ErrorReply { token, code, detail: status as u32 }.encode())?;
                }
                self.stats.chains_rearmed += 1;
                self.arm(port, cn, ChainKind::Free)?;
                if other_stopped && !self.cn(cn).is_some_and(|r| r.alloc_parked) {
                    self.stats.chains_rearmed += 1;
                    self.arm(port, cn, ChainKind::Alloc)?;
                }
                self.settle(port)
            }
        }
    }

    fn token_at<P: MnPort>(&self, port: &mut P, hdr: u64) -> Result<u32, MnError<P::Error>> {
        let mut t = [0u8; 4];
        port.read(hdr + 4, &mut t).map_err(MnError::Port)?;
        Ok(u32::from_le_bytes(t))
    }

    /// Repair the lap of a chain that the MN stopped although it did not fail (another path
    /// quiesced the CN): finish or undo it from its markers, and tell the CN about a request
    /// that got no answer — an alloc is `AllocFailed` (nothing was allocated; retry), a free
    /// that the repair could not finish gets no reply (its group stays the CN's).
    fn repair_interrupted<P: MnPort>(&mut self, port: &mut P, q: &Quiesced, kind: ChainKind) -> R<P::Error> {
        let cn = q.cn();
        let Some(r) = self.cn(cn).cloned() else { return Ok(()) };
        let s = self.map.scratch(r.slot).ok_or(MnError::BadConfig)?;
        match kind {
            ChainKind::Alloc => {
                let a = s + ALLOC_SCRATCH_OFF;
                let hdr = rd(port, a + alloc_scratch::REQ_HDR)?;
                let token = self.token_at(port, a + alloc_scratch::REQ_HDR)?;
                let repair = self.repair_alloc(port, q, a)?;
                wr(port, a + alloc_scratch::REQ_HDR, 0)?;
                if repair == AllocRepair::TookTicket {
                    self.park(cn);
                    if r.status == CnStatus::Active && hdr != 0 {
                        self.send(port, cn, &ErrorReply { token, code: ErrorCode::Empty, detail: 0 }.encode())?;
                    }
                } else if hdr != 0 && r.status == CnStatus::Active {
                    self.send(port, cn, &ErrorReply { token, code: ErrorCode::AllocFailed, detail: 0 }.encode())?;
                }
            }
            ChainKind::Free => {
                let f = s + FREE_SCRATCH_OFF;
                self.repair_free(port, q, f)?;
                wr(port, f + free_scratch::REQ_HDR, 0)?;
            }
        }
        Ok(())
    }

    /// Undo an uncommitted alloc lap of `cn`: what the lap left behind.
    fn repair_alloc<P: MnPort>(
        &mut self,
        port: &mut P,
        q: &Quiesced,
        a: u64,
    ) -> Result<AllocRepair, MnError<P::Error>> {
        debug_assert!(q.chains().alloc);
        let cn = q.cn();
        let slot = rd(port, a + alloc_scratch::SLOT_ADDR)?;
        let entry = rd(port, a + alloc_scratch::REPLY_ENTRY_ADDR)?;
        wr(port, a + alloc_scratch::SLOT_ADDR, 0)?;
        wr(port, a + alloc_scratch::REPLY_ENTRY_ADDR, 0)?;
        if entry != 0 {
            // popped a group the CN never got: clear the slot if the pop left it, reclaim it
            if self.map.queue.contains_slot(slot) && rd(port, slot)? == entry {
                wr(port, slot, 0)?;
            }
            if let Some(g) = self.map.group_of_entry(entry) {
                // ... unless it moved on since the lap popped it: between the lap's failure and
                // this repair (the MN CPU runs after the NIC) the CN may have freed a group the
                // lap had already stamped and bound — it is then back in the queue — and someone
                // else may even hold it now. Reclaiming it again would push it twice.
                // The lap's own image of the entry (read at its pop) decides: every free
                // advances the keys, so keys that differ from the image mean a free happened.
                let e = read_entry(port, entry)?;
                let image = read_entry(port, a + alloc_scratch::REPLY_ENTRY)?;
                // (the image is this group's only if the lap's entry READ ran)
                let image_is_ours = self.cfg.geometry.chunk_base(g) == Some(image.base.get());
                let freed_since = image_is_ours && e.rkeys != image.rkeys;
                // where the group is now decides (the CN's chains are stopped): in the queue,
                // popped by another lap in flight, held by another CN, or held by this CN
                // through a later lap (its keys moved) — it moved on; nowhere at all (a free
                // advanced its keys but never pushed it) or stamped by this lap — reclaim it
                let w = self.whereabouts(port, entry)?;
                let moved_on = w.in_queue
                    || w.popped_by.is_some()
                    || (w.owner != 0 && w.owner != cn.get())
                    || (w.owner == cn.get() && freed_since);
                if moved_on {
                    self.stats.stale_repairs += 1;
                } else {
                    self.reclaim(port, q, g)?;
                }
            }
            return Ok(AllocRepair::Undone);
        }
        if slot != 0 && self.map.queue.contains_slot(slot) {
            // The lap's FAA took this slot's ticket. If the group is there, either the pop
            // itself failed (a broken chain, a fault), or the lap found the slot empty — its
            // empty probe failed, as designed on an empty queue — and a push (a free, a
            // reclaim) filled the slot before this repair ran (the MN CPU runs after the NIC).
            // Either way: move the group to the tail, nothing is lost, the CN may retry at
            // once. If the slot is empty the queue is empty: the MN holds the ticket until a
            // push fills the slot.
            let v = rd(port, slot)?;
            if v != 0 {
                wr(port, slot, 0)?;
                self.push_group(port, v)?;
                // no entry recorded: the lap stopped at its slot — found empty, or its read of
                // the slot failed; neither is a bad request
                return Ok(AllocRepair::Requeued);
            }
            if !self.tickets.contains(&slot) {
                let _ = self.tickets.push(slot);
            }
            return Ok(AllocRepair::TookTicket);
        }
        Ok(AllocRepair::Undone)
    }

    /// Finish or discard a half-done free, from this lap's own markers. Returns true when the
    /// group got freed.
    ///
    /// Only two things prove the requester may free the group: this lap's `PASSED` marker (set
    /// after MW[0] was invalidated on the requester's own Free QP), or — a lap that failed
    /// between that invalidation and the marker — the MWTable naming the requester as owner
    /// *and* MW[0] no longer bound. Anything else (an entry another lap is popping, a free
    /// entry, a foreign one) is left exactly as it is.
    fn repair_free<P: MnPort>(&mut self, port: &mut P, q: &Quiesced, f: u64) -> Result<bool, MnError<P::Error>> {
        let cn = q.cn();
        let free_qp = self.cn(cn).map(|r| r.qps.free);
        let entry = rd(port, f + free_scratch::ENTRY_ADDR)?;
        let passed = rd(port, f + free_scratch::PASSED)?;
        let push_slot = rd(port, f + free_scratch::PUSH_SLOT)?;
        for m in [free_scratch::ENTRY_ADDR, free_scratch::PASSED, free_scratch::PUSH_SLOT] {
            wr(port, f + m, 0)?;
        }
        let Some(g) = self.map.group_of_entry(entry) else { return Ok(false) };
        if passed != entry {
            // No PASSED marker. The request named `entry`; the CN owns it if the MWTable says
            // so and MW[0] is either already invalidated (the lap failed after its proof) or
            // still bound to this CN's own Free QP (the lap was stopped before its proof: the
            // device's binding is the same proof the chain would have made).
            let e = read_entry(port, entry)?;
            let proof = match port.mw_binding(e.rkey(0)) {
                Some(MwBinding::Unbound) => true,
                Some(MwBinding::Bound { qpn, .. }) => Some(qpn) == free_qp && e.reserved.get() == 0,
                None => false,
            };
            if e.owner() == cn.get() && proof {
                self.reclaim(port, q, g)?;
                return Ok(true);
            }
            return Ok(false);
        }
        // Ownership proven; every window was invalidated before the second half started.
        if self.map.queue.contains_slot(push_slot) {
            // the tail's fetch-and-add ran, so the write-back did too (in order): the slot is
            // this lap's; fill it if the push WRITE did not land — unless the group is
            // elsewhere already (the push landed and a pop took it since)
            self.fill_push_slot(port, q, push_slot, entry)?;
            return Ok(true);
        }
        self.reclaim(port, q, g)?;
        Ok(true)
    }

    /// Take a group back from wherever it is: invalidate its windows, then return it.
    fn reclaim<P: MnPort>(&mut self, port: &mut P, q: &Quiesced, g: GroupId) -> R<P::Error> {
        let addr = self.map.entry_addr(g).ok_or(MnError::BadConfig)?;
        let mut e = read_entry(port, addr)?;
        e.reserved = ENTRY_RECLAIMING.into();
        write_entry(port, addr, &e)?;
        for i in 0..self.cfg.geometry.group_size() {
            // The device's own key decides: a stopped lap may have bound the window under a
            // key the table does not hold yet (its write-back never ran). Invalidate that key,
            // and let the table continue from it, so no key the window ever had validates again.
            let rkey = match port.mw_binding(e.rkey(i)) {
                Some(MwBinding::Bound { rkey, .. }) if rkey != e.rkey(i) && rkey.index() == e.rkey(i).index() => {
                    if let Some(r) = e.rkeys.get_mut(i) {
                        *r = rkey.0.into();
                    }
                    rkey
                }
                _ => e.rkey(i),
            };
            port.apply(Action::Unbind { rkey }).map_err(MnError::Port)?;
        }
        write_entry(port, addr, &e)?;
        // no window reaches the chunk any more: clear what its holder left before it moves on
        self.scrub(port, g)?;
        if self.return_group(port, q, g, true)? {
            self.stats.groups_reclaimed += 1;
        }
        Ok(())
    }

    /// Zero a chunk on the MN CPU, so its next owner cannot read what the last one left. Done
    /// for every group the MN handles itself (host-engine frees, reclaims); the offloaded free
    /// chain cannot (the loopback QP has no write rights on the pool), see ARCHITECTURE.md.
    pub fn scrub<P: MnPort>(&mut self, port: &mut P, g: GroupId) -> R<P::Error> {
        static ZEROS: [u8; 4096] = [0; 4096];
        if self.cfg.scrub == ScrubPath::Off {
            return Ok(());
        }
        let Some(base) = self.cfg.geometry.chunk_base(g) else { return Ok(()) };
        let size = self.cfg.geometry.chunk_size();
        let mut off = 0;
        while off < size {
            let n = (size - off).min(ZEROS.len() as u64) as usize;
            port.write(base + off, &ZEROS[..n]).map_err(MnError::Port)?;
            off += n as u64;
        }
        self.stats.chunks_scrubbed += 1;
        Ok(())
    }

    /// [`Self::scrub`] for the group whose MWTable entry is at `entry_addr` (a free request's).
    pub fn scrub_entry<P: MnPort>(&mut self, port: &mut P, entry_addr: u64) -> R<P::Error> {
        match self.map.group_of_entry(entry_addr) {
            Some(g) => self.scrub(port, g),
            None => Ok(()),
        }
    }

    /// The raw push (only [`MemoryNode::push_group`] and `return_group` call it, after their
    /// checks). Push at the tail: take a slot with a fetch-and-add that is atomic with respect to the
    /// chains' own ([`MnPort::fetch_add`]), then fill it. Between the two a concurrent pop may
    /// take the slot and find it empty; it then holds a ticket that settles when this write
    /// lands (the pop's clear is conditional, so it never erases it).
    fn push<P: MnPort>(&mut self, port: &mut P, entry_addr: u64) -> R<P::Error> {
        let (tail, add, boundary) = self.map.queue.push_fetch_add();
        let slot = port.fetch_add(tail, add, boundary).map_err(MnError::Port)?;
        wr(port, slot, entry_addr)
    }

    /// Whether the free queue's live window (or a settled-later ticket slot) holds `entry`.
    /// A scan of at most the ring: used only on repair paths.
    fn queue_holds<P: MnPort>(&mut self, port: &mut P, entry: u64) -> Result<bool, MnError<P::Error>> {
        let q = self.map.queue;
        let head = rd(port, q.head)?;
        let tail = rd(port, q.tail)?;
        for at in q.walk(head, q.len(head, tail)) {
            if rd(port, at)? == entry {
                return Ok(true);
            }
        }
        for t in self.tickets.clone().iter() {
            if rd(port, *t)? == entry {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn broadcast<P: MnPort>(&mut self, port: &mut P, n: Notice) -> R<P::Error> {
        match n {
            Notice::Empty => self.stats.empty_notices += 1,
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
                self.push_group(port, v)?;
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
                let parked: heapless::Vec<CnId, MAX_CNS> =
                    self.cns().filter(|r| r.alloc_parked).map(|r| r.cn).collect();
                for cn in parked {
                    self.stats.chains_rearmed += 1;
                    self.arm(port, cn, ChainKind::Alloc)?;
                }
            }
        }
        Ok(())
    }

    fn owned_groups<P: MnPort>(
        &mut self,
        port: &mut P,
        cn: CnId,
    ) -> Result<heapless::Vec<GroupId, 64>, MnError<P::Error>> {
        // bounded batches keep this heap-free; callers loop until empty
        let mut out = heapless::Vec::new();
        for i in 0..self.cfg.geometry.chunk_count() {
            let g = GroupId(i);
            let e = read_entry(port, self.map.entry_addr(g).unwrap_or(0))?;
            if e.owner() == cn.get() && out.push(g).is_err() {
                break;
            }
        }
        Ok(out)
    }

    fn reclaim_all_of<P: MnPort>(&mut self, port: &mut P, q: &Quiesced) -> R<P::Error> {
        debug_assert!(q.chains() == Chains::BOTH);
        loop {
            let batch = self.owned_groups(port, q.cn())?;
            if batch.is_empty() {
                return Ok(());
            }
            for g in batch {
                self.reclaim(port, q, g)?;
            }
        }
    }

    /// Groups counted against `cn`'s quota according to the MWTable — the source of truth:
    /// management-QP counters can be inflated by laps that failed part-way, the table cannot.
    /// A CN of a tenant is charged what all the tenant's CNs hold.
    fn held_by<P: MnPort>(&mut self, port: &mut P, cn: CnId) -> Result<u32, MnError<P::Error>> {
        let charged = crate::mn::tenant::charged_with(self.cns().map(|r| (r.cn, r.tenant)), cn);
        let mut n = 0;
        for i in 0..self.cfg.geometry.chunk_count() {
            if charged.contains(&read_entry(port, self.map.entry_addr(GroupId(i)).unwrap_or(0))?.owner()) {
                n += 1;
            }
        }
        Ok(n)
    }

    /// The quota `cn` is held to: its tenant's (shared), or the per-CN one.
    pub fn quota_of(&self, cn: CnId) -> u32 {
        let t = self.cn(cn).and_then(|r| r.tenant).and_then(|t| self.tenants.get(t));
        t.map_or(self.cfg.quota, |l| l.quota)
    }

    /// Host-engine mode's exact quota: refuse an allocation that would exceed it (the CN is
    /// told `QuotaExceeded`; nothing is revoked). Returns whether the request was refused.
    pub fn refuse_over_quota<P: MnPort>(
        &mut self,
        port: &mut P,
        cn: CnId,
        token: u32,
    ) -> Result<bool, MnError<P::Error>> {
        let quota = self.quota_of(cn);
        if self.held_by(port, cn)? < quota {
            return Ok(false);
        }
        self.send(port, cn, &ErrorReply { token, code: ErrorCode::QuotaExceeded, detail: quota }.encode())?;
        Ok(true)
    }

    /// Host-engine mode: an alloc request arrived while the CN's alloc chain is parked (the
    /// queue is empty and the CN already holds its one ticket). It does not run — another pop
    /// would take a second ticket — but it is answered, so the CN learns "empty" for *this*
    /// request instead of waiting for a reply that never comes.
    pub fn refuse_parked<P: MnPort>(&mut self, port: &mut P, cn: CnId, token: u32) -> R<P::Error> {
        self.send(port, cn, &ErrorReply { token, code: ErrorCode::Empty, detail: 0 }.encode())
    }

    /// Offloaded mode's lazy quota (the chains cannot count): a CN found holding more than its
    /// quota is told `QuotaExceeded`, loses its management QPs and **every** group it holds
    /// (windows invalidated, groups back in the queue); its access QPs stay connected but every
    /// rkey it had is dead. Other CNs are unaffected.
    fn enforce_quota<P: MnPort>(&mut self, port: &mut P, cn: CnId) -> R<P::Error> {
        let Some(r) = self.cn(cn).cloned() else { return Ok(()) };
        let quota = self.quota_of(cn);
        if r.status != CnStatus::Active || self.held_by(port, cn)? <= quota {
            return Ok(());
        }
        self.stats.quota_disconnects += 1;
        self.send(port, cn, &ErrorReply { token: 0, code: ErrorCode::QuotaExceeded, detail: quota }.encode())?;
        // quiesce (loop and management QPs, so no half-run free pushes after this), decide
        // from the stopped laps' markers, then take everything back
        let q = self.quiesce(port, cn, Chains::BOTH)?;
        if let Some(rec) = self.cns.iter_mut().flatten().find(|x| x.cn == cn) {
            rec.status = CnStatus::MgmtDisconnected;
        }
        port.apply(Action::DisconnectMgmt { alloc: r.qps.alloc, free: r.qps.free }).map_err(MnError::Port)?;
        let s = self.map.scratch(r.slot).ok_or(MnError::BadConfig)?;
        self.repair_alloc(port, &q, s + ALLOC_SCRATCH_OFF)?;
        self.repair_free(port, &q, s + FREE_SCRATCH_OFF)?;
        self.reclaim_all_of(port, &q)?;
        self.settle(port)
    }

    /// Take one group back from a CN that stays connected: quiesce its chains, repair what
    /// their laps were doing, reclaim the group if it is still the CN's, re-arm the chains.
    fn take_back<P: MnPort>(&mut self, port: &mut P, cn: CnId, g: GroupId) -> R<P::Error> {
        let q = self.quiesce(port, cn, Chains::BOTH)?;
        self.repair_interrupted(port, &q, ChainKind::Alloc)?;
        self.repair_interrupted(port, &q, ChainKind::Free)?;
        let addr = self.map.entry_addr(g).ok_or(MnError::BadConfig)?;
        if read_entry(port, addr)?.owner() == cn.get() {
            self.reclaim(port, &q, g)?;
        }
        self.resume(port, &q)?;
        self.settle(port)
    }

    /// Re-arm the chains a quiesce stopped, for a CN that is still active (a parked alloc
    /// chain stays parked).
    fn resume<P: MnPort>(&mut self, port: &mut P, q: &Quiesced) -> R<P::Error> {
        let cn = q.cn();
        if q.chains().free {
            self.stats.chains_rearmed += 1;
            self.arm(port, cn, ChainKind::Free)?;
        }
        if q.chains().alloc && !self.cn(cn).is_some_and(|r| r.alloc_parked) {
            self.stats.chains_rearmed += 1;
            self.arm(port, cn, ChainKind::Alloc)?;
        }
        Ok(())
    }

    /// The MN's periodic audit (on every tick): offloaded chains bind access windows to
    /// whatever QPs a request names (DESIGN.md §2: "a bad qpn only hurts the caller"), so a
    /// group whose access window ended up bound outside its owner's access QPs is reclaimed —
    /// the owner loses it, nobody else gains it. Then every CN's holdings against its quota.
    fn audit<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
        // First find whose groups look wrong, touching nothing: the owner's chains are still
        // running (its free may be pushing the very group).
        let mut suspects: heapless::Vec<CnId, MAX_CNS> = heapless::Vec::new();
        for i in 0..self.cfg.geometry.chunk_count() {
            let Some((owner, misbound, outside)) = self.audit_group(port, GroupId(i))? else { continue };
            if (misbound || outside) && !suspects.contains(&owner) {
                let pushed = suspects.push(owner);
                debug_assert!(pushed.is_ok(), "one suspect per CN record: MAX_CNS bounds them");
            }
        }
        // Then, per suspect: quiesce, decide again from what can no longer move, push.
        for cn in suspects {
            let q = self.quiesce(port, cn, Chains::BOTH)?;
            self.repair_interrupted(port, &q, ChainKind::Alloc)?;
            self.repair_interrupted(port, &q, ChainKind::Free)?;
            for i in 0..self.cfg.geometry.chunk_count() {
                let gid = GroupId(i);
                let Some((owner, misbound, outside)) = self.audit_group(port, gid)? else { continue };
                if owner != cn || !(misbound || outside) {
                    continue;
                }
                if outside {
                    self.stats.spans_refused += 1;
                }
                self.reclaim(port, &q, gid)?;
            }
            self.resume(port, &q)?;
            self.settle(port)?;
        }
        let active: heapless::Vec<CnId, MAX_CNS> =
            self.cns().filter(|r| r.status == CnStatus::Active).map(|r| r.cn).collect();
        for cn in active {
            self.enforce_quota(port, cn)?;
        }
        Ok(())
    }

    /// One group as the audit sees it: its active owner, whether an access window is bound
    /// outside the owner's access QPs, whether a window reaches outside its own chunk.
    fn audit_group<P: MnPort>(
        &mut self,
        port: &mut P,
        gid: GroupId,
    ) -> Result<Option<AuditFinding>, MnError<P::Error>> {
        let g = self.cfg.geometry.group_size();
        let e = read_entry(port, self.map.entry_addr(gid).unwrap_or(0))?;
        if e.owner() == 0 {
            return Ok(None);
        }
        let Some(rec) = self.cns().find(|r| r.cn.get() == e.owner() && r.status == CnStatus::Active) else {
            return Ok(None);
        };
        let (cn, access) = (rec.cn, rec.qps.access.clone());
        let misbound = (1..g).any(
            |k| matches!(port.mw_binding(e.rkey(k)), Some(MwBinding::Bound { qpn, .. }) if !access.contains(&qpn)),
        );
        // defence in depth: every bound window of the group must lie inside its own chunk
        let (base, size) = (self.cfg.geometry.chunk_base(gid).unwrap_or(0), self.cfg.geometry.chunk_size());
        let outside =
            (0..g).any(|k| port.mw_span(e.rkey(k)).is_some_and(|(a, l)| a < base || a.saturating_add(l) > base + size));
        Ok(Some((cn, misbound, outside)))
    }

    /// Evict an unresponsive CN: what a departure does, plus the record for the deployment.
    fn evict<P: MnPort>(&mut self, port: &mut P, cn: CnId) -> R<P::Error> {
        if self.cn(cn).is_none() {
            return Ok(());
        }
        self.stats.cns_evicted += 1;
        let _ = self.evicted.push(cn);
        self.on_cn_gone(port, cn)
    }

    /// Evidence that `cn` is alive and receiving: a send to it completed, or a request from it
    /// arrived. Renews its lease.
    pub fn cn_answered(&mut self, cn: CnId) {
        if let Some(r) = self.cns.iter_mut().flatten().find(|r| r.cn == cn) {
            r.probe_outstanding = false;
        }
    }

    /// Lease probes for every CN whose half-period is up; a CN that has not answered the
    /// previous probe by then is evicted. The MN's own clock bounds it: a CN cannot stretch
    /// it with the RNR timer or retry counts it negotiated.
    fn probe_due<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
        if self.cfg.lease_ns == 0 {
            return Ok(());
        }
        let now = self.now;
        let due: heapless::Vec<(CnId, u64, bool), MAX_CNS> = self
            .cns()
            .filter(|r| r.status == CnStatus::Active && now >= r.probed_at.saturating_add(self.cfg.lease_ns / 2))
            .map(|r| (r.cn, r.probes, r.probe_outstanding))
            .collect();
        for (cn, seq, unanswered) in due {
            if unanswered {
                self.evict(port, cn)?;
                continue;
            }
            if let Some(r) = self.cns.iter_mut().flatten().find(|r| r.cn == cn) {
                r.probed_at = now;
                r.probes += 1;
                r.probe_outstanding = true;
            }
            self.stats.probes_sent += 1;
            self.send(port, cn, &Notice::Probe { seq }.encode())?;
        }
        Ok(())
    }

    fn on_cn_gone<P: MnPort>(&mut self, port: &mut P, cn: CnId) -> R<P::Error> {
        let r = self.cn(cn).ok_or(MnError::UnknownCn(cn))?.clone();
        // every chain of it stops (its management QPs too: a crash mid-alloc must not leave
        // binds running after the reclaim unbound the group)
        let q = self.quiesce(port, cn, Chains::BOTH)?;
        let s = self.map.scratch(r.slot).ok_or(MnError::BadConfig)?;
        // in-flight laps first (a pop the CN never saw, a half-done free), then what it owns;
        // a ticket its lap took stays with the MN (settle() places the group when it arrives)
        self.repair_alloc(port, &q, s + ALLOC_SCRATCH_OFF)?;
        self.repair_free(port, &q, s + FREE_SCRATCH_OFF)?;
        self.reclaim_all_of(port, &q)?;
        port.apply(Action::ReleaseCn { qps: r.qps.clone() }).map_err(MnError::Port)?;
        self.cns[r.slot as usize] = None;
        self.settle(port)
    }

    /// Policy: an RNIC reset **revokes** every allocation. All windows and QPs are gone, so
    /// the MWTable is rebuilt with every group free (keys advanced, so no old rkey ever
    /// validates again), the queue refilled, each CN told `Revoked`, and its chains re-armed.
    fn on_rnic_reset<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
        let cns: heapless::Vec<CnRecord, MAX_CNS> = self.cns().cloned().collect();
        for r in cns.iter() {
            // every chain stopped before the table is rebuilt ("quiesce, decide, push": the
            // decision is every group free, the push the queue's refill below)
            self.quiesce(port, r.cn, Chains::BOTH)?;
            for q in r.qps.access.iter() {
                port.apply(Action::ResetQp(*q)).map_err(MnError::Port)?;
            }
        }
        let g = self.cfg.geometry;
        for i in 0..g.chunk_count() {
            let addr = self.map.entry_addr(GroupId(i)).unwrap_or(0);
            let mut e = read_entry(port, addr)?;
            if e.owner() != 0 || e.reserved.get() != 0 {
                e.bump_keys();
                // whatever its holder wrote stays in the chunk: clear it before it is reused
                self.scrub(port, GroupId(i))?;
            }
            e.owner = 0.into();
            e.reserved = 0.into();
            write_entry(port, addr, &e)?;
        }
        for slot in self.map.queue.slots() {
            wr(port, slot, 0)?;
        }
        for (addr, v) in self.map.queue.fill(g.chunk_count(), |i| self.map.entry_addr(GroupId(i)).unwrap_or(0)) {
            wr(port, addr, v)?;
        }
        self.tickets.clear();
        self.empty = false;
        for r in cns.iter() {
            let s = self.map.scratch(r.slot).ok_or(MnError::BadConfig)?;
            self.init_scratch(port, r.slot, r.cn)?;
            let _ = s;
            if let Some(rec) = self.cns.iter_mut().flatten().find(|x| x.cn == r.cn) {
                rec.allocs = 0;
                rec.frees = 0;
            }
            self.send(port, r.cn, &ErrorReply { token: 0, code: ErrorCode::Revoked, detail: 0 }.encode())?;
            self.arm(port, r.cn, ChainKind::Free)?;
            self.arm(port, r.cn, ChainKind::Alloc)?;
        }
        Ok(())
    }

    // ------------------------------------------------------------------ remote invalidation

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
    pub fn on_remote_invalidation<P: MnPort>(&mut self, port: &mut P, qp: Qpn, rkey: Rkey) -> R<P::Error> {
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
        if rd(port, s + ALLOC_SCRATCH_OFF + alloc_scratch::REPLY_ENTRY_ADDR)? == addr
            || rd(port, s + FREE_SCRATCH_OFF + free_scratch::ENTRY_ADDR)? == addr
        {
            return Ok(Restore::Deferred);
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
        if let Some(r) = e.rkeys.get_mut(k) {
            *r = new.0.into();
        }
        write_entry(port, addr, &e)?;
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
