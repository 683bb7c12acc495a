//! Quiesce, decide, push: the one way the MN CPU hands a group back to the free queue.
//!
//! On real hardware the MN CPU runs *while* the NIC executes chains (DESIGN.md §9). Every MN
//! path that returns groups — the audit, lazy quota enforcement, crash and vanish reclaim,
//! lease eviction, RNIC-reset recovery, a failed lap's repair — races the chains of the CN
//! whose groups it returns: that CN's free chain can still push the same group (the queue then
//! holds it twice, and a later owner loses its chunk), the second half of a free that already
//! took a tail slot can still fill it (or never does: a hole in the live queue), and its alloc
//! chain can still bind the group it popped (a free group with a bound window). So each such
//! path does three things, in this order:
//!
//! 1. **Quiesce** ([`MemoryNode::quiesce`]): stop every chain of that CN that could still touch
//!    the group — offloaded, its loop *and* management QPs leave RTS (a reset drops their
//!    posted WQEs; the device finishes or flushes what it started); host engine, the MN
//!    driver's in-flight laps of that CN end once their posted device step has completed. The
//!    result is a [`Quiesced`] proof; nothing else makes one.
//! 2. **Decide** from data that can no longer move: the MWTable, the stopped laps' own markers
//!    (`repair_alloc` / `repair_free` in `mn/mod.rs`), and where the group is now
//!    ([`MemoryNode::whereabouts`]: in the queue, popped by another CN's lap in flight, owned).
//! 3. **Push** through [`MemoryNode::push_group`], which refuses — and counts — a push of a group
//!    that is already in the queue, that another lap has popped, or that has a bound window.
//!    A group is in the free queue at most once, and never while any of its windows is bound;
//!    the invariant checker verifies the same after every step in every test.
//!
//! Pushes that only *move* a group already in the queue structure (a ticket slot a push filled,
//! moved to the tail) go through the same checked push.
//!
//! **Whereabouts in O(1).** "Is it in the queue?" is answered from evidence the caller holds,
//! each piece checked against the bytes, never from an index a chain could invalidate:
//!
//! - the group's MWTable owner is the quiesced CN (read from the entry at the check, whatever
//!   the caller knows): an owner is written only by its own alloc lap after the pop, and
//!   every path back into the queue clears it before pushing (the free chain writes the entry
//!   back before it takes a tail slot; the MN writes owner 0 before its push) — and the only
//!   chain that could free it, the owner's, is stopped;
//! - the MN itself just took it out of the queue ([`Known::TakenOut`]: the slot it read it from
//!   no longer holds it): a group is in the queue at most once, which every push keeps;
//! - a stopped free lap that never took a tail slot wrote it back ([`Known::NeverPushed`]): the
//!   group was owned until then, and its window MW[0], the only ownership proof, is gone.
//!
//! Anything else — a stopped lap's popped group whose owner is 0 (its keys alone cannot tell
//! "never stamped" from 256 alloc/free cycles by other CNs since: an 8-bit key wraps), a free
//! whose push slot was taken — is decided by scanning the queue, counted in
//! [`crate::mn::MnStats::queue_scans`]: at most one scan per interrupted lap, never one per
//! group of a reclaim. "The queue" is more than its live window: the slots of the tickets the
//! MN holds, and the slot every alloc lap in flight took (its `SLOT_ADDR` marker) — a pop that
//! found its slot empty fails at its probe, and a push may fill that slot, below the head,
//! before the MN repairs the lap and learns of the ticket. A group there is queued.

use super::{rd, read_entry, wr, MemoryNode, MnError, MnPort};
use crate::chain::ChainKind;
use crate::device::{ExecutionMode, MwBinding};
use crate::ids::{CnId, GroupId, Qpn};
use crate::mn::{Action, CnStatus, ENTRY_RECLAIMING};
use crate::wire::memory_map::{alloc_scratch, ALLOC_SCRATCH_OFF};

/// Which of a CN's chains a quiesce stopped.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Chains {
    /// Alloc chains of the CN (a CN may have several: [`crate::mn::MnConfig::alloc_chains`]):
    /// those whose bit is set in `alloc_mask`.
    pub alloc: bool,
    pub free: bool,
    /// Which alloc chains `alloc` means (bit j: chain j); every one unless a single chain's
    /// failure stopped only that chain — its siblings keep the groups they popped ahead.
    pub alloc_mask: u8,
}

impl Chains {
    pub const BOTH: Chains = Chains { alloc: true, free: true, alloc_mask: ALL_ALLOC_CHAINS };
    pub const fn only(kind: ChainKind) -> Chains {
        match kind {
            ChainKind::Alloc => Chains { alloc: true, free: false, alloc_mask: ALL_ALLOC_CHAINS },
            ChainKind::Free => Chains { alloc: false, free: true, alloc_mask: 0 },
        }
    }
    /// The alloc chains in `mask` alone (no free chain).
    pub const fn alloc_chains(mask: u8) -> Chains {
        Chains { alloc: mask != 0, free: false, alloc_mask: mask }
    }
    /// These chains and the free chain.
    pub const fn and_free(self) -> Chains {
        Chains { free: true, ..self }
    }
    /// These chains and the alloc chains in `mask`.
    pub const fn and_alloc(self, mask: u8) -> Chains {
        let m = self.alloc_mask | mask;
        Chains { alloc: m != 0, free: self.free, alloc_mask: m }
    }
    pub const fn has(&self, kind: ChainKind) -> bool {
        match kind {
            ChainKind::Alloc => self.alloc,
            ChainKind::Free => self.free,
        }
    }
    /// Whether alloc chain `j` is among them.
    pub const fn has_alloc_chain(&self, j: u8) -> bool {
        self.alloc && self.alloc_mask & (1 << j) != 0
    }
}

/// [`Chains::alloc_mask`] naming every alloc chain.
pub const ALL_ALLOC_CHAINS: u8 = (1 << super::MAX_ALLOC_CHAINS) - 1;

/// Proof that some of one CN's chains are stopped. Only [`MemoryNode::quiesce`] builds one, and
/// every MN path that returns a group of that CN takes it.
#[derive(Debug)]
pub struct Quiesced {
    cn: CnId,
    chains: Chains,
}

impl Quiesced {
    pub fn cn(&self) -> CnId {
        self.cn
    }
    pub fn chains(&self) -> Chains {
        self.chains
    }
}

/// Where a group is, read from MN memory while the chains that could move it are stopped.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Whereabouts {
    /// Its entry address is in the queue's live window or in a ticket slot.
    pub in_queue: bool,
    /// An alloc lap still in flight (of a CN that is not stopped) has popped it.
    pub popped_by: Option<CnId>,
    /// The MWTable's owner field (0: none).
    pub owner: u32,
    /// One of its windows is bound, as far as the device can tell.
    pub bound_window: bool,
}

/// What the caller of the checked push knows about where a group is (see the module
/// documentation): the evidence that spares a scan of the queue, each checked against the
/// bytes when the push is decided.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Known {
    /// Nothing beyond what the entry shows: a group owned by the quiesced CN is not queued;
    /// otherwise the queue is scanned.
    Nothing,
    /// The MN took the group out of the queue at `slot` (cleared it) in this reaction.
    TakenOut { slot: u64 },
    /// A stopped free lap of the quiesced CN wrote the group back and never took a tail slot.
    NeverPushed,
}

/// Why the MN's checked push (`MemoryNode::push_group`) refused a push.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum PushRefused {
    /// The address is not an MWTable entry.
    NotAnEntry,
    /// The queue (or a ticket slot) already holds it.
    AlreadyQueued,
    /// Another CN's lap in flight popped it: it is about to be owned.
    PoppedInFlight,
    /// One of its windows is still bound: the group is quarantined (left `RECLAIMING`).
    WindowBound,
}

/// The free queue's live contents, counted by scanning: right even when the queue is corrupt.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct FreeCount {
    /// Distinct groups in the live window and in filled ticket slots.
    pub groups: u32,
    /// Slots of the live window that hold a group already counted.
    pub duplicates: u32,
    /// Slots of the live window that hold nothing (0) or no entry address.
    pub holes: u32,
}

impl FreeCount {
    pub fn corrupt(&self) -> bool {
        self.duplicates != 0 || self.holes != 0
    }
}

impl MemoryNode {
    /// Step 1 of "quiesce, decide, push": stop `chains` of `cn` so that nothing of theirs can
    /// still touch a group the MN is about to decide about. A CN that is not connected has
    /// nothing running.
    pub fn quiesce<P: MnPort>(
        &mut self,
        port: &mut P,
        cn: CnId,
        chains: Chains,
    ) -> Result<Quiesced, MnError<P::Error>> {
        let Some(r) = self.cn(cn).cloned() else {
            return Ok(Quiesced { cn, chains });
        };
        match self.cfg.mode {
            ExecutionMode::Offloaded => {
                // A loop ring ENABLEs its management ring and the management ring ENABLEs the
                // loop ring's second half; a reset queue is empty, so an ENABLE that reaches it
                // between the two resets releases nothing.
                // `alloc`: every alloc chain of the CN, so no sibling chain's lap can touch
                // a group the MN decides about
                let mut stop: heapless::Vec<(Qpn, Option<Qpn>), { super::MAX_ALLOC_CHAINS + 1 }> = heapless::Vec::new();
                if chains.alloc {
                    for (_, m, l) in r.alloc_chains().filter(|(j, _, _)| chains.has_alloc_chain(*j)) {
                        let pushed = stop.push((m, l));
                        debug_assert!(pushed.is_ok(), "at most MAX_ALLOC_CHAINS alloc chains and the free chain");
                    }
                }
                if chains.free {
                    let pushed = stop.push((r.qps.free, r.qps.free_loop));
                    debug_assert!(pushed.is_ok(), "at most MAX_ALLOC_CHAINS alloc chains and the free chain");
                }
                for (mgmt, lp) in stop {
                    if let Some(lp) = lp {
                        port.apply(Action::ResetQp(lp)).map_err(MnError::Port)?;
                    }
                    // a CN over its quota has no management QPs any more
                    if r.status == CnStatus::Active {
                        port.apply(Action::ResetQp(mgmt)).map_err(MnError::Port)?;
                    }
                }
            }
            ExecutionMode::HostEngine => {
                let alloc_mask = if chains.alloc { chains.alloc_mask } else { 0 };
                port.apply(Action::StopLaps { cn, alloc: alloc_mask, free: chains.free }).map_err(MnError::Port)?;
                // those chains' laps have ended (a failed one already had)
                if let Some(n) = self.alloc_in_flight.get_mut(r.slot as usize) {
                    *n &= !alloc_mask;
                }
                // a management QP a failed request left in ERR comes back before the MN
                // answers on it (a healthy one keeps its state and the CN its receives)
                if r.status == CnStatus::Active {
                    if chains.alloc {
                        for (_, mgmt, _) in r.alloc_chains().filter(|(j, _, _)| chains.has_alloc_chain(*j)) {
                            port.apply(Action::ResetQp(mgmt)).map_err(MnError::Port)?;
                        }
                    }
                    if chains.free {
                        port.apply(Action::ResetQp(r.qps.free)).map_err(MnError::Port)?;
                    }
                }
            }
        }
        self.stats.quiesces += 1;
        Ok(Quiesced { cn, chains })
    }

    /// Where the group with MWTable entry `entry` is now (step 2's facts), by scanning the
    /// queue: for tools and tests; the MN's own decisions use the evidence they hold
    /// (`Known`) and scan only without it.
    pub fn whereabouts<P: MnPort>(&mut self, port: &mut P, entry: u64) -> Result<Whereabouts, MnError<P::Error>> {
        let mut w = self.whereabouts_but_queue(port, entry)?;
        w.in_queue = self.queue_holds(port, entry)?;
        Ok(w)
    }

    /// Whether the group with entry `entry` is in the queue, from `known` where it settles
    /// that (O(1), checked against the bytes), else by a counted scan. `quiesced`: the CN whose
    /// chains are stopped, if any.
    pub(super) fn in_queue<P: MnPort>(
        &mut self,
        port: &mut P,
        entry: u64,
        owner: u32,
        quiesced: Option<CnId>,
        known: Known,
    ) -> Result<bool, MnError<P::Error>> {
        if quiesced.is_some_and(|cn| cn.get() == owner) {
            return Ok(false);
        }
        match known {
            Known::TakenOut { slot } if rd(port, slot)? != entry => return Ok(false),
            Known::NeverPushed if owner == 0 && quiesced.is_some() => return Ok(false),
            _ => {}
        }
        self.stats.queue_scans += 1;
        self.queue_holds(port, entry)
    }

    /// Everything of [`Whereabouts`] but `in_queue`: O(CNs + G), no scan.
    fn whereabouts_but_queue<P: MnPort>(&mut self, port: &mut P, entry: u64) -> Result<Whereabouts, MnError<P::Error>> {
        let mut w = Whereabouts::default();
        let e = read_entry(port, entry)?;
        let chunk = self.map.group_of_entry(entry).and_then(|g| self.cfg.geometry.chunk_base(g));
        let mut slots: heapless::Vec<(u32, CnId), { super::MAX_CNS * super::MAX_ALLOC_CHAINS }> = heapless::Vec::new();
        for r in self.cns() {
            for j in 0..r.alloc_chain_count() {
                let pushed = slots.push((self.chain_slot(r.slot, j), r.cn));
                debug_assert!(pushed.is_ok(), "MAX_ALLOC_CHAINS chains per CN record");
            }
        }
        for (slot, cn) in slots {
            let Some(s) = self.map.scratch(slot) else { continue };
            let a = s + ALLOC_SCRATCH_OFF;
            if rd(port, a + alloc_scratch::REPLY_ENTRY_ADDR)? != entry {
                continue;
            }
            // The marker stays set from the pop until the lap's commit, after its reply: a
            // group the CN got and already freed again (a free advances the keys) is no longer
            // that lap's. Its image of the entry (read at the pop) tells.
            let image = read_entry(port, a + alloc_scratch::REPLY_ENTRY)?;
            let freed_since = chunk == Some(image.base.get()) && image.rkeys != e.rkeys;
            if !freed_since {
                w.popped_by = Some(cn);
                break;
            }
        }
        w.owner = e.owner();
        w.bound_window = (0..self.cfg.geometry.group_size())
            .any(|k| matches!(port.mw_binding(e.rkey(k)), Some(MwBinding::Bound { .. })));
        Ok(w)
    }

    /// [`Self::whereabouts`] with the queue decided from `known` where it can be.
    pub(super) fn whereabouts_given<P: MnPort>(
        &mut self,
        port: &mut P,
        entry: u64,
        quiesced: Option<CnId>,
        known: Known,
    ) -> Result<Whereabouts, MnError<P::Error>> {
        let mut w = self.whereabouts_but_queue(port, entry)?;
        w.in_queue = self.in_queue(port, entry, w.owner, quiesced, known)?;
        Ok(w)
    }

    /// Step 3: the MN's own push, checked. Refuses (and counts in `pushes_refused`) a group
    /// that is already queued, popped by a lap in flight, or has a bound window; returns
    /// whether it pushed. `known`: what the caller knows of where the group is.
    pub(super) fn push_group<P: MnPort>(
        &mut self,
        port: &mut P,
        entry: u64,
        known: Known,
    ) -> Result<bool, MnError<P::Error>> {
        match self.check_push(port, entry, None, known)? {
            None => {
                self.push(port, entry)?;
                Ok(true)
            }
            Some(why) => {
                self.stats.pushes_refused += 1;
                self.last_push_refused = Some(why);
                Ok(false)
            }
        }
    }

    fn check_push<P: MnPort>(
        &mut self,
        port: &mut P,
        entry: u64,
        quiesced: Option<CnId>,
        known: Known,
    ) -> Result<Option<PushRefused>, MnError<P::Error>> {
        if self.map.group_of_entry(entry).is_none() {
            return Ok(Some(PushRefused::NotAnEntry));
        }
        // the O(1) facts first: a group popped by a lap in flight or with a bound window is
        // refused whatever the queue holds
        let w = self.whereabouts_but_queue(port, entry)?;
        Ok(if w.popped_by.is_some() {
            Some(PushRefused::PoppedInFlight)
        } else if self.in_queue(port, entry, w.owner, quiesced, known)? {
            Some(PushRefused::AlreadyQueued)
        } else if w.bound_window {
            Some(PushRefused::WindowBound)
        } else {
            None
        })
    }

    /// Return group `g` of the quiesced CN: owner 0, keys advanced (if its windows were used),
    /// pushed at the tail — unless the checked push refuses it. A group refused because a
    /// window is still bound stays `RECLAIMING` (quarantined, counted), never free.
    pub(super) fn return_group<P: MnPort>(
        &mut self,
        port: &mut P,
        q: &Quiesced,
        g: GroupId,
        bump: bool,
        known: Known,
    ) -> Result<bool, MnError<P::Error>> {
        debug_assert!(q.chains.free, "a group is returned only while its holder's free chain is stopped");
        let addr = self.map.entry_addr(g).ok_or(MnError::BadConfig)?;
        let mut e = read_entry(port, addr)?;
        match self.check_push(port, addr, Some(q.cn), known)? {
            None => {}
            Some(PushRefused::AlreadyQueued) => {
                // the chain's own push landed before it stopped: the group is free already
                self.stats.pushes_refused += 1;
                self.last_push_refused = Some(PushRefused::AlreadyQueued);
                return Ok(false);
            }
            Some(why) => {
                self.stats.pushes_refused += 1;
                self.last_push_refused = Some(why);
                if why == PushRefused::WindowBound {
                    e.owner = 0.into();
                    e.reserved = ENTRY_RECLAIMING.into();
                    self.put_entry(port, addr, &e)?;
                    self.stats.groups_quarantined += 1;
                }
                return Ok(false);
            }
        }
        if bump {
            e.bump_keys();
        }
        e.owner = 0.into();
        e.reserved = 0.into();
        self.put_entry(port, addr, &e)?;
        self.push(port, addr)?;
        Ok(true)
    }

    /// Fill a stopped free lap's tail slot with its entry if the push WRITE did not land —
    /// only where the group is nowhere else (its push may have landed and been popped since).
    pub(super) fn fill_push_slot<P: MnPort>(
        &mut self,
        port: &mut P,
        q: &Quiesced,
        slot: u64,
        entry: u64,
    ) -> Result<bool, MnError<P::Error>> {
        debug_assert!(q.chains.free);
        if rd(port, slot)? == entry {
            return Ok(true);
        }
        // the O(1) facts first; the queue is scanned only for a group nothing else places
        let w = self.whereabouts_but_queue(port, entry)?;
        let why = if w.owner != 0 {
            // the push landed and the group moved on (popped and owned since)
            Some(PushRefused::AlreadyQueued)
        } else if w.popped_by.is_some() {
            Some(PushRefused::PoppedInFlight)
        } else if w.bound_window {
            Some(PushRefused::WindowBound)
        } else if self.in_queue(port, entry, w.owner, Some(q.cn), Known::Nothing)? {
            // the push landed (and the group may have gone round since)
            Some(PushRefused::AlreadyQueued)
        } else {
            None
        };
        if let Some(why) = why {
            self.stats.pushes_refused += 1;
            self.last_push_refused = Some(why);
            return Ok(false);
        }
        wr(port, slot, entry)?;
        Ok(true)
    }

    /// The free queue's live contents by scanning (live window and filled ticket slots):
    /// distinct groups, duplicates and holes. Used for every free count the MN reports, so a
    /// corrupt queue is flagged instead of read as a number.
    pub fn free_count<P: MnPort>(&mut self, port: &mut P) -> Result<FreeCount, MnError<P::Error>> {
        let mut err = None;
        let count = scan_free(&self.map, &self.tickets, |a| {
            let mut b = [0u8; 8];
            match port.read(a, &mut b) {
                Ok(()) => Some(u64::from_le_bytes(b)),
                Err(e) => {
                    err.get_or_insert(e);
                    None
                }
            }
        });
        match (count, err) {
            (Some(c), None) => Ok(c),
            (_, Some(e)) => Err(MnError::Port(e)),
            (None, None) => Err(MnError::BadConfig),
        }
    }
}

/// [`MemoryNode::free_count`] over any reader of MN memory (a harness reads the model's memory
/// directly). `None` when a read fails.
pub fn scan_free(
    map: &crate::wire::memory_map::MnMemoryMap,
    tickets: &[u64],
    read: impl FnMut(u64) -> Option<u64>,
) -> Option<FreeCount> {
    scan_free_in::<{ crate::mn::group_window::WINDOW_WORDS }>(map, tickets, read)
}

/// [`scan_free`] with a window of `WORDS` × 64 groups: one pass over the queue per window
/// (`group_window.rs`). The counters are read once, so every pass walks the same slots.
pub(crate) fn scan_free_in<const WORDS: usize>(
    map: &crate::wire::memory_map::MnMemoryMap,
    tickets: &[u64],
    mut read: impl FnMut(u64) -> Option<u64>,
) -> Option<FreeCount> {
    use crate::mn::group_window::{GroupWindow, Mark};
    let q = map.queue;
    let head = read(q.head)?;
    let tail = read(q.tail)?;
    let live = q.len(head, tail);
    // a live length the chains' "ahead" rule reads as 0 is an empty queue whose head ran past
    // its tail by the tickets of pops that found it empty
    let ahead = q.live_len(head, tail, map.max_cns) == 0 && live != 0;
    let mut out = FreeCount::default();
    let mut set = GroupWindow::<WORDS>::new();
    for lo in GroupWindow::<WORDS>::starts(map.geometry.chunk_count()) {
        set.reset(lo);
        // a hole is a slot, not a group: the first pass counts them
        let first = lo == 0;
        let mut count = |v: u64, out: &mut FreeCount, hole_if_bad: bool| match map.group_of_entry(v) {
            Some(g) => match set.mark(g) {
                Mark::Outside => {}
                Mark::First => out.groups += 1,
                Mark::Again => out.duplicates += 1,
            },
            None if hole_if_bad && first => out.holes += 1,
            None => {}
        };
        if !ahead {
            for at in q.walk(head, live) {
                count(read(at)?, &mut out, true);
            }
        }
        for t in tickets {
            let v = read(*t)?;
            if v != 0 {
                count(v, &mut out, false);
            }
        }
    }
    Some(out)
}
