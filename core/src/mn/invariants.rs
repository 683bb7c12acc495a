//! The invariants of DESIGN.md §4 principle 4, as a check over the MN's memory and the
//! device's window state. Tests call it after every step; a violation names what broke.
//!
//! Valid at quiescent points: no chain lap in flight (the models are idle, or the MN has just
//! handled an event).

use crate::device::MwBinding;
use crate::geometry::MAX_GROUP_SIZE;
use crate::ids::{GroupId, Rkey};
use crate::mn::{MemoryNode, MnPort, ENTRY_RECLAIMING};
use crate::wire::mwtable::{MwTableEntry, ENTRY_SIZE};
use core::fmt;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum InvariantViolation {
    /// Memory could not be read.
    Unreadable,
    /// A live queue slot does not hold a valid entry address.
    BadQueueSlot { slot: u64, value: u64 },
    /// A group appears in the queue more than once.
    DuplicateInQueue(GroupId),
    /// A slot outside the live window (and not a ticket) is not zero.
    StaleSlot { slot: u64 },
    /// A group in the queue has an owner.
    OwnedGroupInQueue(GroupId),
    /// A group is neither in the queue, nor owned, nor being reclaimed.
    LostGroup(GroupId),
    /// A group is owned by a CN the MN does not know.
    UnknownOwner { group: GroupId, owner: u32 },
    /// A free group has a bound window.
    FreeGroupBound { group: GroupId, mw: usize },
    /// An allocated group's window is not bound where it should be.
    WindowMisbound { group: GroupId, mw: usize },
    /// Two groups share a window index.
    RkeyReused(Rkey),
    /// A CN holds more groups than its quota.
    OverQuota { owner: u32, held: u32 },
    /// An entry's chunk is not the one the geometry assigns to it.
    ChunkMismatch(GroupId),
    /// Host-engine mode: the MN's kept count of a CN's groups (what its quota decisions read)
    /// differs from the MWTable's.
    HeldCountDrift { owner: u32, kept: u32, table: u32 },
}

impl fmt::Display for InvariantViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invariant violated: {self:?}")
    }
}

fn rd<P: MnPort>(p: &mut P, a: u64) -> Result<u64, InvariantViolation> {
    let mut b = [0u8; 8];
    p.read(a, &mut b).map_err(|_| InvariantViolation::Unreadable)?;
    Ok(u64::from_le_bytes(b))
}

pub fn check<P: MnPort>(mn: &MemoryNode, port: &mut P) -> Result<(), InvariantViolation> {
    check_in::<{ crate::mn::group_window::WINDOW_WORDS }, P>(mn, port)
}

/// [`check`] with a window of `WORDS` × 64 groups: the queue is walked once per window, and
/// each window's part of the table after it (`group_window.rs`). The same checks as one pass;
/// where several fail, the first one found may differ (it is looked for window by window).
pub(crate) fn check_in<const WORDS: usize, P: MnPort>(mn: &MemoryNode, port: &mut P) -> Result<(), InvariantViolation> {
    use crate::mn::group_window::{GroupWindow, Mark};
    let map = *mn.map();
    let geo = map.geometry;
    let q = map.queue;
    let n = geo.chunk_count();
    let head = rd(port, q.head)?;
    let tail = rd(port, q.tail)?;
    let live = q.live_len(head, tail, map.max_cns);
    // the group each CN's alloc chain popped ahead for its next request (its `REPLY_ENTRY_ADDR`
    // marker, 0: none): owned by that CN, no window bound yet, not in its holdings
    // (one per alloc chain of the CN)
    let mut ahead = [[0u64; crate::mn::MAX_ALLOC_CHAINS]; crate::mn::MAX_CNS + 1];
    for r in mn.cns() {
        for j in 0..r.alloc_chain_count() {
            let s = mn.chain_scratch(r.slot, j).ok_or(InvariantViolation::Unreadable)?;
            let marker = s
                + crate::wire::memory_map::ALLOC_SCRATCH_OFF
                + crate::wire::memory_map::alloc_scratch::REPLY_ENTRY_ADDR;
            if let Some(a) = ahead.get_mut(r.slot as usize).and_then(|a| a.get_mut(j as usize)) {
                *a = rd(port, marker)?;
            }
        }
    }
    let mut held = [0u32; crate::mn::MAX_CNS + 1];
    // which groups of the window are in the queue
    let mut in_queue = GroupWindow::<WORDS>::new();
    for lo in GroupWindow::<WORDS>::starts(n) {
        in_queue.reset(lo);
        let mut mark = |g: GroupId| match in_queue.mark(g) {
            Mark::Again => Err(InvariantViolation::DuplicateInQueue(g)),
            Mark::First | Mark::Outside => Ok(()),
        };
        for at in q.walk(head, live) {
            let v = rd(port, at)?;
            let g = map.group_of_entry(v).ok_or(InvariantViolation::BadQueueSlot { slot: at, value: v })?;
            mark(g)?;
        }
        // slots outside [head, tail): zero, except unsettled tickets that a push already filled
        // (the first pass reads them all; once that holds, the later ones read the tickets)
        if lo == 0 {
            for slot in q.walk(tail, q.capacity - live) {
                let v = rd(port, slot)?;
                if v != 0 {
                    if !mn.tickets().contains(&slot) {
                        return Err(InvariantViolation::StaleSlot { slot });
                    }
                    let g = map.group_of_entry(v).ok_or(InvariantViolation::BadQueueSlot { slot, value: v })?;
                    mark(g)?;
                }
            }
        } else {
            let head_index = q.index_of(head) as u64 % q.capacity as u64;
            for &slot in mn.tickets() {
                let in_live = (q.index_of(slot) as u64 + q.capacity as u64 - head_index) % q.capacity as u64;
                let v = rd(port, slot)?;
                if v != 0 && in_live >= live as u64 {
                    let g = map.group_of_entry(v).ok_or(InvariantViolation::BadQueueSlot { slot, value: v })?;
                    mark(g)?;
                }
            }
        }
        check_groups(mn, port, &in_queue, &ahead, &mut held)?;
    }
    for r in mn.cns() {
        // a tenant's CNs share one quota: what they hold together
        let charged = crate::mn::tenant::charged_with(mn.cns().map(|r| (r.cn, r.tenant)), r.cn);
        let total: u32 = mn.cns().filter(|c| charged.contains(&c.cn.get())).map(|c| held[c.slot as usize]).sum();
        if total > mn.quota_of(r.cn) {
            return Err(InvariantViolation::OverQuota { owner: r.cn.get(), held: total });
        }
    }
    if mn.mode() == crate::device::ExecutionMode::HostEngine {
        for r in mn.cns() {
            let (kept, table) = (mn.held(r.cn).unwrap_or(0), held[r.slot as usize]);
            if kept != table {
                return Err(InvariantViolation::HeldCountDrift { owner: r.cn.get(), kept, table });
            }
        }
    }
    check_rkeys_distinct(&map, port)
}

/// The window's groups: each exactly one of free-in-queue, owned, reclaiming; its windows bound
/// as its state says; what each CN holds added to `held`.
fn check_groups<const WORDS: usize, P: MnPort>(
    mn: &MemoryNode,
    port: &mut P,
    in_queue: &crate::mn::group_window::GroupWindow<WORDS>,
    ahead: &[[u64; crate::mn::MAX_ALLOC_CHAINS]; crate::mn::MAX_CNS + 1],
    held: &mut [u32; crate::mn::MAX_CNS + 1],
) -> Result<(), InvariantViolation> {
    let map = *mn.map();
    let geo = map.geometry;
    for i in in_queue.range(geo.chunk_count()) {
        let g = GroupId(i);
        let addr = map.entry_addr(g).ok_or(InvariantViolation::Unreadable)?;
        let mut b = [0u8; ENTRY_SIZE];
        port.read(addr, &mut b).map_err(|_| InvariantViolation::Unreadable)?;
        let e = MwTableEntry::read(&b).ok_or(InvariantViolation::Unreadable)?;
        if geo.chunk_base(g) != Some(e.base.get()) || e.length.get() as u64 != geo.chunk_size() {
            return Err(InvariantViolation::ChunkMismatch(g));
        }
        let queued = in_queue.contains(g);
        let owner = e.owner();
        if queued && owner != 0 {
            return Err(InvariantViolation::OwnedGroupInQueue(g));
        }
        if !queued && owner == 0 && e.reserved.get() != ENTRY_RECLAIMING {
            return Err(InvariantViolation::LostGroup(g));
        }
        let rec = if owner != 0 {
            let r =
                mn.cns().find(|r| r.cn.get() == owner).ok_or(InvariantViolation::UnknownOwner { group: g, owner })?;
            if !ahead.get(r.slot as usize).is_some_and(|a| a.contains(&addr)) {
                held[r.slot as usize] += 1;
            }
            Some(r)
        } else {
            None
        };
        // window state
        for k in 0..geo.group_size() {
            let rkey = e.rkey(k);
            match (port.mw_binding(rkey), rec) {
                (None, _) => {}
                (Some(MwBinding::Unbound), None) => {}
                (Some(MwBinding::Bound { .. }), None) => {
                    return Err(InvariantViolation::FreeGroupBound { group: g, mw: k })
                }
                (Some(MwBinding::Bound { rkey: r, qpn }), Some(rec)) => {
                    let ok = r == rkey && mn.window_home(rec, k, qpn);
                    if !ok {
                        return Err(InvariantViolation::WindowMisbound { group: g, mw: k });
                    }
                }
                // popped ahead: its windows are bound when the request comes
                (Some(MwBinding::Unbound), Some(rec))
                    if ahead.get(rec.slot as usize).is_some_and(|a| a.contains(&addr)) => {}
                (Some(MwBinding::Unbound), Some(_)) => {
                    return Err(InvariantViolation::WindowMisbound { group: g, mw: k })
                }
            }
        }
    }
    Ok(())
}

/// No two groups share a window index (so no live rkey can repeat across groups).
fn check_rkeys_distinct<P: MnPort>(
    map: &crate::wire::memory_map::MnMemoryMap,
    port: &mut P,
) -> Result<(), InvariantViolation> {
    let n = map.geometry.chunk_count();
    let g = map.geometry.group_size();
    // Window indexes never change after formatting (only keys advance), so a full pairwise
    // check is done for small pools and a neighbour check for large ones, keeping the check
    // cheap enough to run after every step.
    let mut prev: [u32; MAX_GROUP_SIZE] = [u32::MAX; MAX_GROUP_SIZE];
    for i in 0..n {
        let addr = map.entry_addr(GroupId(i)).ok_or(InvariantViolation::Unreadable)?;
        let mut b = [0u8; ENTRY_SIZE];
        port.read(addr, &mut b).map_err(|_| InvariantViolation::Unreadable)?;
        let e = MwTableEntry::read(&b).ok_or(InvariantViolation::Unreadable)?;
        let mut cur = [0u32; MAX_GROUP_SIZE];
        for k in 0..g {
            cur[k] = e.rkey(k).index();
            if cur[..k].contains(&cur[k]) || prev[..g].contains(&cur[k]) {
                return Err(InvariantViolation::RkeyReused(e.rkey(k)));
            }
        }
        if n <= 64 {
            for j in 0..i {
                let a2 = map.entry_addr(GroupId(j)).ok_or(InvariantViolation::Unreadable)?;
                let mut b2 = [0u8; ENTRY_SIZE];
                port.read(a2, &mut b2).map_err(|_| InvariantViolation::Unreadable)?;
                let e2 = MwTableEntry::read(&b2).ok_or(InvariantViolation::Unreadable)?;
                for (k, idx) in cur.iter().enumerate().take(g) {
                    if (0..g).any(|k2| e2.rkey(k2).index() == *idx) {
                        return Err(InvariantViolation::RkeyReused(e.rkey(k)));
                    }
                }
            }
        }
        prev = cur;
    }
    Ok(())
}
