//! Reclaim: taking a group back from its owner — invalidate its windows, scrub its chunk,
//! push it — and the checked free-queue push every group-returning path goes through.
//!
//! Complexity: one group is O(G) device actions plus O(1) table and queue accesses (the checked
//! push decides from evidence, `mn/quiesce.rs`); everything of a CN is one pass over the table
//! (O(chunks) owner reads once, O(held) reclaims), where it used to restart from the first
//! entry for every batch of 64 groups and scan the queue for every push.

use super::*;
use crate::mn::quiesce::Known;

impl MemoryNode {
    /// Take a group back from wherever it is: invalidate its windows, then return it.
    pub(super) fn reclaim<P: MnPort>(&mut self, port: &mut P, q: &Quiesced, g: GroupId) -> R<P::Error> {
        self.reclaim_given(port, q, g, Known::Nothing)
    }

    /// [`Self::reclaim`], with what the caller knows of where the group is.
    pub(super) fn reclaim_given<P: MnPort>(
        &mut self,
        port: &mut P,
        q: &Quiesced,
        g: GroupId,
        known: Known,
    ) -> R<P::Error> {
        let addr = self.map.entry_addr(g).ok_or(MnError::BadConfig)?;
        let mut e = read_entry(port, addr)?;
        e.reserved = ENTRY_RECLAIMING.into();
        self.put_entry(port, addr, &e)?;
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
        self.put_entry(port, addr, &e)?;
        // no window reaches the chunk any more: clear what its holder left before it moves on
        self.scrub(port, g)?;
        if self.return_group(port, q, g, true, known)? {
            self.stats.groups_reclaimed += 1;
        }
        Ok(())
    }

    /// Reclaim one group of `cn`, a CN that stays connected, and tell it (a [`TakenBack`]
    /// naming MW\[0\]'s key as the CN holds it, read before the reclaim moves the keys on):
    /// without the notice it would keep the allocation in its books, its accesses failing.
    pub(super) fn reclaim_from_connected<P: MnPort>(&mut self, port: &mut P, q: &Quiesced, g: GroupId) -> R<P::Error> {
        let addr = self.map.entry_addr(g).ok_or(MnError::BadConfig)?;
        let owner_rkey = read_entry(port, addr)?.rkey(0);
        self.reclaim(port, q, g)?;
        self.tell_taken_back(port, q.cn(), addr, owner_rkey)
    }

    /// Send `cn` a [`TakenBack`] for the allocation at `entry_addr` it was given with
    /// `owner_rkey`, if it is still an active CN (one leaving, evicted or over its quota
    /// loses everything and is told so otherwise).
    pub(super) fn tell_taken_back<P: MnPort>(
        &mut self,
        port: &mut P,
        cn: CnId,
        entry_addr: u64,
        owner_rkey: Rkey,
    ) -> R<P::Error> {
        if self.cn(cn).is_some_and(|r| r.status == CnStatus::Active) {
            self.stats.taken_back_notices += 1;
            self.send(port, cn, &TakenBack { entry_addr, owner_rkey }.encode())?;
        }
        Ok(())
    }

    /// Zero a chunk on the MN CPU, so its next owner cannot read what the last one left. Done
    /// for every group the MN handles itself (host-engine frees, reclaims); the offloaded free
    /// chain cannot (the loopback QP has no write rights on the pool), see ARCHITECTURE.md.
    pub(super) fn scrub<P: MnPort>(&mut self, port: &mut P, g: GroupId) -> R<P::Error> {
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
    pub(super) fn scrub_entry<P: MnPort>(&mut self, port: &mut P, entry_addr: u64) -> R<P::Error> {
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
    pub(super) fn push<P: MnPort>(&mut self, port: &mut P, entry_addr: u64) -> R<P::Error> {
        let (tail, add, boundary) = self.map.queue.push_fetch_add();
        let slot = port.fetch_add(tail, add, boundary).map_err(MnError::Port)?;
        wr(port, slot, entry_addr)
    }

    /// Whether the free queue's live window (or a settled-later ticket slot) holds `entry`.
    /// A scan of at most the ring: used only on repair paths.
    pub(super) fn queue_holds<P: MnPort>(&mut self, port: &mut P, entry: u64) -> Result<bool, MnError<P::Error>> {
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
        // Slots alloc laps took whose outcome the MN has not seen yet: a pop that found its
        // slot empty failed at its probe and holds a ticket the MN learns of only when it
        // repairs that lap — and a push (a free chain's, the MN's own) may fill the slot
        // first, below the head, outside the live window. Until that repair moves the group
        // on, it is queued there: a second push would queue it twice.
        let mut taken: heapless::Vec<u32, { super::MAX_CNS * super::MAX_ALLOC_CHAINS }> = heapless::Vec::new();
        for r in self.cns() {
            for j in 0..r.alloc_chain_count() {
                let pushed = taken.push(self.chain_slot(r.slot, j));
                debug_assert!(pushed.is_ok(), "MAX_ALLOC_CHAINS chains per CN record");
            }
        }
        for chain in taken {
            let Some(s) = self.map.scratch(chain) else { continue };
            let slot = rd(port, s + ALLOC_SCRATCH_OFF + alloc_scratch::SLOT_ADDR)?;
            if q.contains_slot(slot) && rd(port, slot)? == entry {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Everything the quiesced CN holds, in one pass over the table: each entry's owner is
    /// read once, and a group of the CN is reclaimed as the pass reaches it (nothing it holds
    /// can move while its chains are stopped, and nobody else can make it an owner).
    pub(super) fn reclaim_all_of<P: MnPort>(&mut self, port: &mut P, q: &Quiesced) -> R<P::Error> {
        debug_assert!(q.chains() == Chains::BOTH);
        let cn = q.cn().get();
        for i in 0..self.cfg.geometry.chunk_count() {
            let g = GroupId(i);
            let mut o = [0u8; 4];
            let at = self.map.entry_addr(g).ok_or(MnError::BadConfig)? + crate::wire::mwtable::ENTRY_OFF_OWNER;
            port.read(at, &mut o).map_err(MnError::Port)?;
            if u32::from_le_bytes(o) == cn {
                self.reclaim(port, q, g)?;
            }
        }
        Ok(())
    }

    /// Take one group back from a CN that stays connected: quiesce its chains, repair what
    /// their laps were doing, reclaim the group if it is still the CN's, re-arm the chains.
    pub(super) fn take_back<P: MnPort>(&mut self, port: &mut P, cn: CnId, g: GroupId) -> R<P::Error> {
        let q = self.quiesce(port, cn, Chains::BOTH)?;
        self.repair_interrupted(port, &q, ChainKind::Alloc)?;
        self.repair_interrupted(port, &q, ChainKind::Free)?;
        let addr = self.map.entry_addr(g).ok_or(MnError::BadConfig)?;
        if read_entry(port, addr)?.owner() == cn.get() {
            self.reclaim_from_connected(port, &q, g)?;
        }
        self.resume(port, &q)?;
        self.settle(port)
    }

    /// Re-arm the chains a quiesce stopped, for a CN that is still active (a parked alloc
    /// chain stays parked).
    pub(super) fn resume<P: MnPort>(&mut self, port: &mut P, q: &Quiesced) -> R<P::Error> {
        let cn = q.cn();
        if q.chains().free {
            self.stats.chains_rearmed += 1;
            self.arm(port, cn, ChainKind::Free)?;
        }
        // the stopped alloc chains that are not parked
        let mask = if q.chains().alloc { self.unparked(cn, q.chains().alloc_mask) } else { 0 };
        if mask != 0 {
            self.stats.chains_rearmed += 1;
            self.arm_chains(port, cn, ChainKind::Alloc, mask)?;
        }
        Ok(())
    }
}
