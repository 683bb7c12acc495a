//! Repair: a failed or stopped chain lap is finished or undone from the markers it left in its
//! scratch area (DESIGN.md §4), so a group is never lost and never held twice; an RNIC reset rebuilds the pool.

use super::*;
use crate::mn::quiesce::Known;

impl MemoryNode {
    pub(super) fn on_chain_failed<P: MnPort>(
        &mut self,
        port: &mut P,
        cn: CnId,
        kind: ChainKind,
        chain: u8,
        step: Option<u8>,
        failure: LapFailure,
    ) -> R<P::Error> {
        let r = self.cn(cn).ok_or(MnError::UnknownCn(cn))?.clone();
        if r.status != CnStatus::Active {
            return Ok(());
        }
        // The CN did not answer its own reply (no receive posted, RNR budget gone) or its host
        // is gone (transport retries exhausted): repairing and re-arming would only stall
        // again. Evict it; every other CN is untouched.
        if failure.unresponsive() {
            return self.evict(port, cn);
        }
        // Binds to the poster: the free chain's ownership proof is a Loop READ whose local
        // protection error says exactly "the requester does not own that entry" (`chain::free`)
        let failure = match (kind, step, failure) {
            (ChainKind::Free, Some(si), LapFailure::Status(crate::device::WcStatus::LocProtErr))
                if self.owner_proof_step(cn) == Some(si) =>
            {
                LapFailure::NotOwner
            }
            _ => failure,
        };
        // Quiesce the failed chain before reading what it left behind. A failed alloc lap that
        // popped a group may have bound MW[0] to this CN's Free QP: the CN (knowing the
        // layouts) can then free it through its own free chain while the repair reclaims it —
        // so its free chain stops too, before anything is decided.
        let s = self.map.scratch(r.slot).ok_or(MnError::BadConfig)?;
        // the failed chain's own scratch (an alloc chain's; the CN's first for the free chain)
        let sa = match kind {
            ChainKind::Alloc => self.chain_scratch(r.slot, chain).filter(|_| chain < r.alloc_chain_count()),
            ChainKind::Free => Some(s),
        }
        .ok_or(MnError::BadConfig)?;
        // Only the failed chain stops: the CN's other alloc chains go on with their own laps
        // and the groups they popped ahead (stopping them would hand those back, and an empty
        // queue would then take turns failing the CN's chains for ever).
        let mine = match kind {
            ChainKind::Alloc => Chains::alloc_chains(1 << chain),
            ChainKind::Free => Chains::only(ChainKind::Free),
        };
        let mut q = self.quiesce(port, cn, mine)?;
        if kind == ChainKind::Alloc && rd(port, sa + ALLOC_SCRATCH_OFF + alloc_scratch::REPLY_ENTRY_ADDR)? != 0 {
            q = self.quiesce(port, cn, mine.and_free())?;
            self.repair_interrupted(port, &q, ChainKind::Free)?;
        }
        // ... and a failed free of the very group one of this CN's own alloc laps is still
        // binding (a hostile CN that guessed the entry before its reply) stops that lap first
        if kind == ChainKind::Free {
            let freeing = rd(port, s + FREE_SCRATCH_OFF + free_scratch::ENTRY_ADDR)?;
            let mut binding = 0u8;
            for (j, a) in self.alloc_scratches(cn).into_iter().enumerate() {
                let popped = rd(port, a + ALLOC_SCRATCH_OFF + alloc_scratch::REPLY_ENTRY_ADDR)?;
                if popped != 0 && popped == freeing {
                    binding |= 1 << j;
                }
            }
            if binding != 0 {
                q = self.quiesce(port, cn, mine.and_alloc(binding))?;
                self.repair_interrupted(port, &q, ChainKind::Alloc)?;
            }
        }
        let other_stopped = q.chains().has(kind.other());
        match kind {
            ChainKind::Alloc => {
                let a = sa + ALLOC_SCRATCH_OFF;
                let token = self.token_at(port, a + alloc_scratch::REQ_HDR)?;
                let repair = self.repair_alloc(port, &q, a)?;
                if repair == AllocRepair::TookTicket {
                    // the queue was empty: park this chain until frees refill it
                    self.park(cn, chain);
                    if token != 0 || self.cfg.mode == ExecutionMode::HostEngine {
                        self.send(port, cn, &ErrorReply { token, code: ErrorCode::Empty, detail: 0 }.encode())?;
                    }
                    if self.cfg.mode == ExecutionMode::Offloaded && self.cfg.pop_ahead {
                        // The lap was popping ahead (chain::alloc): only this chain's next
                        // request has no group; every other armed chain still holds one it
                        // popped ahead, so this is this CN's news alone — and, with several
                        // alloc chains, this chain's: the CN hears which one is parked, and
                        // "empty" once all of its chains are. "available" goes to everyone.
                        self.empty = true;
                        if self.cn(cn).is_some_and(|r| r.alloc_parked) {
                            self.send(port, cn, &Notice::Empty.encode())?;
                            self.stats.empty_notices += 1;
                        } else {
                            self.send(port, cn, &Notice::ChainParked { chain }.encode())?;
                            self.stats.chain_parked_notices += 1;
                        }
                    } else if !self.empty {
                        self.empty = true;
                        self.broadcast(port, Notice::Empty)?;
                    }
                    if other_stopped {
                        self.arm(port, cn, ChainKind::Free)?;
                    }
                    return self.settle(port);
                }
                let code = if step.is_none() || failure.request_too_long() {
                    ErrorCode::BadRequest
                } else {
                    ErrorCode::AllocFailed
                };
                // a lap that raced a push on an empty queue did nothing wrong: it only retries;
                // nor did one that failed popping ahead, before any request of the CN's was in it
                let before_request = step.is_some_and(|s| self.alloc_prepares_before_request(s));
                if repair != AllocRepair::Requeued && !before_request {
                    if let Some(rec) = self.cns.iter_mut().flatten().find(|x| x.cn == cn) {
                        rec.bad_requests += 1;
                    }
                }
                self.send(port, cn, &ErrorReply { token, code, detail: failure.wire_detail() }.encode())?;
                // A CN parked on its ticket stays parked: re-arming it here (e.g. after a
                // flushed request buffer, or a bad request while parked) would let its next
                // request pop again and take a second ticket — more than the ring has room
                // for (capacity = groups + one ticket per CN + 1). Offloaded, a parked chain is
                // not armed; host engine, its request buffer is posted and requests are
                // answered "empty" until "available".
                if self.chain_parked(cn, chain) {
                    if self.cfg.mode == ExecutionMode::HostEngine {
                        self.arm_chains(port, cn, ChainKind::Alloc, 1 << chain)?;
                        self.park(cn, chain);
                    }
                } else {
                    self.stats.chains_rearmed += 1;
                    self.arm_chains(port, cn, ChainKind::Alloc, 1 << chain)?;
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
                    let code = if failure.not_owner() { ErrorCode::NotOwner } else { ErrorCode::BadRequest };
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
                    self.send(port, cn, &ErrorReply { token, code, detail: failure.wire_detail() }.encode())?;
                }
                self.stats.chains_rearmed += 1;
                self.arm(port, cn, ChainKind::Free)?;
                let stopped = if other_stopped { self.unparked(cn, q.chains().alloc_mask) } else { 0 };
                if stopped != 0 {
                    self.stats.chains_rearmed += 1;
                    self.arm_chains(port, cn, ChainKind::Alloc, stopped)?;
                }
                self.settle(port)
            }
        }
    }

    /// The token of the request whose header lies at `hdr` in MN memory.
    pub(super) fn token_at<P: MnPort>(&self, port: &mut P, hdr: u64) -> Result<u32, MnError<P::Error>> {
        let mut h = [0u8; crate::wire::message::HEADER_LEN];
        port.read(hdr, &mut h).map_err(MnError::Port)?;
        Ok(crate::wire::message::Request::from_array(h).token())
    }

    /// Repair the lap of a chain that the MN stopped although it did not fail (another path
    /// quiesced the CN): finish or undo it from its markers, and tell the CN about a request
    /// that got no answer — an alloc is `AllocFailed` (nothing was allocated; retry), a free
    /// that the repair could not finish gets no reply (its group stays the CN's).
    pub(super) fn repair_interrupted<P: MnPort>(&mut self, port: &mut P, q: &Quiesced, kind: ChainKind) -> R<P::Error> {
        let cn = q.cn();
        let Some(r) = self.cn(cn).cloned() else { return Ok(()) };
        let s = self.map.scratch(r.slot).ok_or(MnError::BadConfig)?;
        match kind {
            ChainKind::Alloc => {
                // each alloc chain of the CN the quiesce stopped
                for (j, a) in self.alloc_scratches(cn).into_iter().enumerate() {
                    if q.chains().has_alloc_chain(j as u8) {
                        self.repair_interrupted_alloc(port, q, j as u8, a)?;
                    }
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

    /// [`MemoryNode::repair_interrupted`] for alloc chain `j`, whose scratch area is `s`.
    pub(super) fn repair_interrupted_alloc<P: MnPort>(
        &mut self,
        port: &mut P,
        q: &Quiesced,
        j: u8,
        s: u64,
    ) -> R<P::Error> {
        let cn = q.cn();
        let Some(r) = self.cn(cn).cloned() else { return Ok(()) };
        let a = s + ALLOC_SCRATCH_OFF;
        let hdr = rd(port, a + alloc_scratch::REQ_HDR)?;
        let token = self.token_at(port, a + alloc_scratch::REQ_HDR)?;
        let repair = self.repair_alloc(port, q, a)?;
        wr(port, a + alloc_scratch::REQ_HDR, 0)?;
        if repair == AllocRepair::TookTicket {
            self.park(cn, j);
            if r.status == CnStatus::Active && hdr != 0 {
                self.send(port, cn, &ErrorReply { token, code: ErrorCode::Empty, detail: 0 }.encode())?;
            }
        } else if hdr != 0 && r.status == CnStatus::Active {
            self.send(port, cn, &ErrorReply { token, code: ErrorCode::AllocFailed, detail: 0 }.encode())?;
        }
        Ok(())
    }

    /// Every alloc chain's lap of a CN that is leaving or losing everything (crash, eviction,
    /// quota) undone from its own markers, without telling the CN.
    pub(super) fn repair_alloc_chains<P: MnPort>(&mut self, port: &mut P, q: &Quiesced) -> R<P::Error> {
        for (j, a) in self.alloc_scratches(q.cn()).into_iter().enumerate() {
            if q.chains().has_alloc_chain(j as u8) {
                self.repair_alloc(port, q, a + ALLOC_SCRATCH_OFF)?;
            }
        }
        Ok(())
    }

    /// Undo an uncommitted alloc lap of `cn`: what the lap left behind.
    pub(super) fn repair_alloc<P: MnPort>(
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
            let mut known = Known::Nothing;
            if self.map.queue.contains_slot(slot) && rd(port, slot)? == entry {
                wr(port, slot, 0)?;
                known = Known::TakenOut { slot };
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
                let w = self.whereabouts_given(port, entry, Some(cn), known)?;
                let moved_on = w.in_queue
                    || w.popped_by.is_some()
                    || (w.owner != 0 && w.owner != cn.get())
                    || (w.owner == cn.get() && freed_since);
                if moved_on {
                    self.stats.stale_repairs += 1;
                } else {
                    // The lap may have got as far as its reply (the commit clears the markers
                    // only after the reply completed): if every window is bound under the
                    // image's keys — the binds precede the reply on one send queue, and a bind
                    // that failed flushed it — the CN may hold this group. Tell it it is gone
                    // (a CN that never got the reply ignores the notice). A device that cannot
                    // report a binding counts as "may have".
                    let may_have_replied = image_is_ours
                        && (0..self.cfg.geometry.group_size()).all(|i| match port.mw_binding(image.rkey(i)) {
                            Some(MwBinding::Bound { rkey, .. }) => rkey == image.rkey(i),
                            Some(MwBinding::Unbound) => false,
                            None => true,
                        });
                    self.reclaim_given(port, q, g, known)?;
                    if may_have_replied {
                        self.tell_taken_back(port, cn, entry, image.rkey(0))?;
                    }
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
            // Popping ahead, the chain pops again as soon as it is re-armed — while other
            // chains' empty pops, not yet repaired, still hold the head past the tail: a group
            // moved to the tail would land in one of their slots, be moved on by its repair,
            // and chase the head forever. So the slot stays a ticket, already filled: `settle`
            // walks the group past every outstanding ticket, and the chain waits (parked) for
            // "available" like any chain that found the queue empty.
            if v != 0 && self.cfg.pop_ahead && self.cfg.mode == ExecutionMode::Offloaded {
                if !self.tickets.contains(&slot) {
                    self.tickets.push(slot).map_err(|_| MnError::TicketsFull)?;
                }
                return Ok(AllocRepair::TookTicket);
            }
            if v != 0 {
                wr(port, slot, 0)?;
                self.push_group(port, v, Known::TakenOut { slot })?;
                // no entry recorded: the lap stopped at its slot — found empty, or its read of
                // the slot failed; neither is a bad request
                return Ok(AllocRepair::Requeued);
            }
            if !self.tickets.contains(&slot) {
                self.tickets.push(slot).map_err(|_| MnError::TicketsFull)?;
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
    pub(super) fn repair_free<P: MnPort>(
        &mut self,
        port: &mut P,
        q: &Quiesced,
        f: u64,
    ) -> Result<bool, MnError<P::Error>> {
        let cn = q.cn();
        let rec = self.cn(cn).cloned();
        let entry = rd(port, f + free_scratch::ENTRY_ADDR)?;
        let passed = rd(port, f + free_scratch::PASSED)?;
        let push_slot = rd(port, f + free_scratch::PUSH_SLOT)?;
        for m in [free_scratch::ENTRY_ADDR, free_scratch::PASSED, free_scratch::PUSH_SLOT] {
            wr(port, f + m, 0)?;
        }
        let Some(g) = self.map.group_of_entry(entry) else { return Ok(false) };
        if passed != entry {
            // No PASSED marker. The request named `entry`; the CN owns it if the MWTable says
            // so — its owner, and the word after it what the CN's own entries hold (0, or its
            // proof key where the chains bind to the poster; not a group being taken back) —
            // and MW[0] is either already invalidated (the lap failed after its proof) or still
            // bound where this CN's MW[0] lives (its Free QP, or its Alloc QP: the lap was
            // stopped before its proof, and the device's binding is the same proof the chain
            // would have made).
            let e = read_entry(port, entry)?;
            let Some(rec) = rec else { return Ok(false) };
            let stamped = e.reserved.get() == self.proof_key_of(&rec);
            let proof = match port.mw_binding(e.rkey(0)) {
                Some(MwBinding::Unbound) => stamped,
                Some(MwBinding::Bound { qpn, .. }) => self.window_home(&rec, 0, qpn) && stamped,
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
        // no tail slot taken: the lap never pushed it
        self.reclaim_given(port, q, g, Known::NeverPushed)?;
        Ok(true)
    }

    /// Policy: an RNIC reset **revokes** every allocation. All windows and QPs are gone, so
    /// the MWTable is rebuilt with every group free (keys advanced, so no old rkey ever
    /// validates again), the queue refilled, each CN told `Revoked`, and its chains re-armed.
    pub(super) fn on_rnic_reset<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
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
            let addr = self.map.entry_addr(GroupId(i)).ok_or(MnError::BadConfig)?;
            let mut e = read_entry(port, addr)?;
            if e.owner() != 0 || e.reserved.get() != 0 {
                e.bump_keys();
                // whatever its holder wrote stays in the chunk: clear it before it is reused
                self.scrub(port, GroupId(i))?;
            }
            e.owner = 0.into();
            e.reserved = 0.into();
            self.put_entry(port, addr, &e)?;
        }
        for slot in self.map.queue.slots() {
            wr(port, slot, 0)?;
        }
        // (every index below the chunk count has an entry address: the loop above wrote them all)
        for (addr, v) in self.map.queue.fill(g.chunk_count(), |i| self.map.entry_addr(GroupId(i)).unwrap_or(0)) {
            wr(port, addr, v)?;
        }
        self.tickets.clear();
        self.empty = false;
        // every reply from here on says so; the notice names the generation it starts
        self.generation = self.generation.wrapping_add(1);
        for r in cns.iter() {
            self.map.scratch(r.slot).ok_or(MnError::BadConfig)?;
            self.init_scratch(port, r.slot, r.cn, r.alloc_chain_count())?;
            if let Some(rec) = self.cns.iter_mut().flatten().find(|x| x.cn == r.cn) {
                rec.allocs = 0;
                rec.frees = 0;
                self.counted_at[rec.slot as usize] = (0, 0);
            }
            let revoked = ErrorReply { token: 0, code: ErrorCode::Revoked, detail: self.generation };
            self.send(port, r.cn, &revoked.encode())?;
            self.arm(port, r.cn, ChainKind::Free)?;
            self.arm(port, r.cn, ChainKind::Alloc)?;
        }
        Ok(())
    }
}
