//! Quota: what a CN (or its tenant) may hold. Host engine: exact — per-CN held counts kept
//! by every change of an MWTable owner (the MN CPU's own writes and each lap's write-back, as
//! the lap reports it), so a request is judged in O(CNs), never by scanning the table; the
//! invariant checker compares them with the table after every step of every test. Offloaded:
//! lazy (the chains cannot count) — the incremental audit (`mn/audit.rs`) tallies owners as it
//! sweeps the table, and a CN its tally or its lap counters show over the quota is stopped and
//! counted exactly from the MWTable, the source of truth, before anything is taken back.

use super::*;
use crate::mn::host_engine::OwnerWrite;

impl MemoryNode {
    /// The groups `cn` alone holds by the MN's kept count: exact in host-engine mode at every
    /// point where no lap is in flight (offloaded, the chains change owners unseen: see
    /// [`MemoryNode::audit_tally`]). None for a CN that is not connected.
    pub fn held(&self, cn: CnId) -> Option<u32> {
        self.cn(cn).map(|r| self.held[r.slot as usize].max(0) as u32)
    }

    /// One lap's change of an MWTable owner (the host engine reports each one, committed or
    /// not: `LapOutcome::owners`). Counts are sums of such changes, so the order in which the
    /// lap's and the MN CPU's own changes are counted does not matter.
    pub fn account_owner_write(&mut self, w: OwnerWrite) {
        self.owner_changed(w.from, w.to);
    }

    /// An MWTable owner field went from `from` to `to` (CN ids, 0 = none).
    pub(super) fn owner_changed(&mut self, from: u32, to: u32) {
        if from == to {
            return;
        }
        for (owner, d) in [(from, -1), (to, 1)] {
            if owner == 0 {
                continue;
            }
            // a CN that left has no count (its slot's is reset when the slot is reused)
            let slot = self.cns().find(|r| r.cn.get() == owner).map(|r| r.slot as usize);
            if let Some(s) = slot {
                self.held[s] += d;
            }
        }
    }

    /// Write an MWTable entry, keeping the held counts: every owner change the MN CPU makes
    /// goes through here (one read of the old owner, O(1)).
    pub(super) fn put_entry<P: MnPort>(&mut self, port: &mut P, addr: u64, e: &MwTableEntry) -> R<P::Error> {
        let mut o = [0u8; 4];
        port.read(addr + crate::wire::mwtable::ENTRY_OFF_OWNER, &mut o).map_err(MnError::Port)?;
        write_entry(port, addr, e)?;
        self.owner_changed(u32::from_le_bytes(o), e.owner());
        Ok(())
    }

    /// Groups counted against `cn`'s quota by the kept counts: its own, or — a CN of a
    /// tenant — what all the tenant's CNs hold. O(CNs).
    pub(super) fn held_by(&self, cn: CnId) -> u32 {
        let charged = crate::mn::tenant::charged_with(self.cns().map(|r| (r.cn, r.tenant)), cn);
        self.cns().filter(|r| charged.contains(&r.cn.get())).map(|r| self.held[r.slot as usize].max(0) as u32).sum()
    }

    /// Groups counted against `cn`'s quota according to the MWTable itself — a scan of the
    /// whole table, so only for a CN already suspected of being over its quota (offloaded),
    /// after its chains were stopped. Counted in [`MnStats::quota_recounts`].
    pub(super) fn count_in_table<P: MnPort>(&mut self, port: &mut P, cn: CnId) -> Result<u32, MnError<P::Error>> {
        self.stats.quota_recounts += 1;
        let charged = crate::mn::tenant::charged_with(self.cns().map(|r| (r.cn, r.tenant)), cn);
        let mut n = 0;
        for i in 0..self.cfg.geometry.chunk_count() {
            let addr = self.map.entry_addr(GroupId(i)).ok_or(MnError::BadConfig)?;
            let mut o = [0u8; 4];
            port.read(addr + crate::wire::mwtable::ENTRY_OFF_OWNER, &mut o).map_err(MnError::Port)?;
            if charged.contains(&u32::from_le_bytes(o)) {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Of [`Self::held_by`], the groups the charged CNs' alloc chains popped ahead for their next
    /// request (`chain::alloc`): owned in the table, not yet handed out, so not the CN's doing.
    /// Read while the chains may run: a marker seen between a reply and its commit counts the
    /// group just handed out as ahead — lenient for one lap, never a false excess.
    pub(super) fn held_ahead<P: MnPort>(&mut self, port: &mut P, cn: CnId) -> Result<u32, MnError<P::Error>> {
        if self.cfg.mode != ExecutionMode::Offloaded {
            return Ok(0);
        }
        let charged = crate::mn::tenant::charged_with(self.cns().map(|r| (r.cn, r.tenant)), cn);
        let slots: heapless::Vec<(u32, u32), MAX_CNS> =
            self.cns().filter(|r| charged.contains(&r.cn.get())).map(|r| (r.cn.get(), r.slot)).collect();
        let mut n = 0;
        for (owner, slot) in slots {
            // every alloc chain of the CN holds one group ahead at most
            let chains = CnId::new(owner).ok().and_then(|c| self.cn(c)).map_or(1, |r| r.alloc_chain_count());
            for j in 0..chains {
                let s = self.chain_scratch(slot, j).ok_or(MnError::BadConfig)?;
                let entry = rd(port, s + ALLOC_SCRATCH_OFF + alloc_scratch::REPLY_ENTRY_ADDR)?;
                if self.map.group_of_entry(entry).is_some() && read_entry(port, entry)?.owner() == owner {
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    /// Host-engine alloc laps of `cn` (and of the CNs its tenant's quota is shared with) that
    /// were served and have neither committed nor been stopped.
    fn alloc_laps_in_flight(&self, cn: CnId) -> u32 {
        let charged = crate::mn::tenant::charged_with(self.cns().map(|r| (r.cn, r.tenant)), cn);
        self.cns()
            .filter(|r| charged.contains(&r.cn.get()))
            .map(|r| self.alloc_in_flight.get(r.slot as usize).copied().unwrap_or(0).count_ones())
            .sum()
    }

    /// The quota `cn` is held to: its tenant's (shared), or the per-CN one.
    pub fn quota_of(&self, cn: CnId) -> u32 {
        let t = self.cn(cn).and_then(|r| r.tenant).and_then(|t| self.tenants.get(t));
        t.map_or(self.cfg.quota, |l| l.quota)
    }

    /// Host-engine mode: a request arrived ([`Event::RequestArrived`]). An alloc is refused at
    /// once while the CN is parked on its ticket or when it would exceed the quota; anything
    /// else is served. A refused request's buffer is free again at once (no lap holds it): the
    /// driver posts it with its one rule.
    pub(super) fn on_request<P: MnPort>(
        &mut self,
        port: &mut P,
        cn: CnId,
        kind: ChainKind,
        chain: u8,
        len: u32,
    ) -> R<P::Error> {
        let Some(r) = self.cn(cn).cloned() else { return Ok(()) };
        // a request: the CN is alive (a lap may drop the completions of its probes while it
        // waits for its own steps)
        self.cn_answered(cn);
        if self.cfg.mode != ExecutionMode::HostEngine || r.status != CnStatus::Active {
            return Ok(());
        }
        if kind == ChainKind::Alloc {
            // the token, where the request is long enough to carry one (a refusal names it)
            let buf = self.chain_scratch(r.slot, chain).filter(|_| chain < r.alloc_chain_count());
            let token = match (len as usize >= crate::wire::message::HEADER_LEN, buf) {
                (true, Some(s)) => Some(self.token_at(port, s + ALLOC_REQUEST_BUF_OFF)?),
                _ => None,
            };
            // A parked alloc chain is not armed in offloaded mode, so a request then finds no
            // receive. Here it must not run either: the CN's empty pop already holds its one
            // ticket, and another pop would take a second one the queue ring has no room for.
            // Answer it "empty" (matched by its token) without running it.
            let refused = if r.parked_chains & (1 << chain) != 0 {
                if let Some(token) = token {
                    self.refuse_parked(port, cn, token)?;
                }
                true
            } else {
                match token {
                    Some(token) => self.refuse_over_quota(port, cn, token)?,
                    None => false,
                }
            };
            if refused {
                // answered without a lap: the driver posts the request buffer again (its one
                // rule: a buffer no lap holds is posted)
                return Ok(());
            }
        }
        if kind == ChainKind::Alloc {
            // counted until it commits or is stopped: laps on the CN's other alloc chains are
            // checked against it
            if let Some(n) = self.alloc_in_flight.get_mut(r.slot as usize) {
                *n |= 1 << chain;
            }
        }
        port.apply(Action::ServeLap { cn, kind, chain, len }).map_err(MnError::Port)
    }

    /// Host-engine mode's exact quota: refuse an allocation that would exceed it (the CN is
    /// told `QuotaExceeded`; nothing is revoked). Returns whether the request was refused.
    /// O(CNs): the kept counts, no table read.
    fn refuse_over_quota<P: MnPort>(&mut self, port: &mut P, cn: CnId, token: u32) -> Result<bool, MnError<P::Error>> {
        let quota = self.quota_of(cn);
        // what it holds, and what its alloc laps in flight on its other chains will hold when
        // they commit: K chains never take it past its quota
        let held = self.held_by(cn) + self.alloc_laps_in_flight(cn);
        if held < quota && self.bytes_allow(cn, held + 1) {
            return Ok(false);
        }
        self.send(port, cn, &ErrorReply { token, code: ErrorCode::QuotaExceeded, detail: quota }.encode())?;
        Ok(true)
    }

    /// Host-engine mode: an alloc request arrived while the CN's alloc chain is parked (the
    /// queue is empty and the CN already holds its one ticket). It does not run — another pop
    /// would take a second ticket — but it is answered, so the CN learns "empty" for *this*
    /// request instead of waiting for a reply that never comes.
    fn refuse_parked<P: MnPort>(&mut self, port: &mut P, cn: CnId, token: u32) -> R<P::Error> {
        self.send(port, cn, &ErrorReply { token, code: ErrorCode::Empty, detail: 0 }.encode())
    }

    /// Whether `cn` may be over its quota: host engine, the exact kept count; offloaded, the
    /// audit's tally of the last complete pass, or lap counters that moved since the CN was
    /// last counted in the table (they cannot say by how much: a forged free that fails
    /// part-way still adds executed WQEs, so counters are a hint to look, never a count).
    /// O(CNs).
    fn suspect_over_quota(&self, cn: CnId) -> bool {
        let quota = self.quota_of(cn);
        match self.cfg.mode {
            ExecutionMode::HostEngine => self.held_by(cn) > quota || !self.bytes_allow(cn, self.held_by(cn)),
            ExecutionMode::Offloaded => {
                let charged = crate::mn::tenant::charged_with(self.cns().map(|r| (r.cn, r.tenant)), cn);
                let mine = |r: &&CnRecord| charged.contains(&r.cn.get());
                let tally: u32 = self.cns().filter(mine).map(|r| self.audit_held[r.slot as usize]).sum();
                let moved = self.cns().filter(mine).any(|r| self.counted_at[r.slot as usize] != (r.allocs, r.frees));
                // the byte quota across classes: what the other classes hold may have grown
                // since (the deployment tells the MN; no lap counter of this class moves)
                tally > quota || !self.bytes_allow(cn, tally) || moved
            }
        }
    }

    /// Lazy quota enforcement (offloaded; in host-engine mode the refusal above keeps every CN
    /// within its quota, so this finds nothing there): a CN found holding more than its quota
    /// is told `QuotaExceeded`, loses its management QPs and **every** group it holds (windows
    /// invalidated, groups back in the queue); its access QPs stay connected but every rkey it
    /// had is dead. Other CNs are unaffected.
    ///
    /// Suspicion is O(CNs) (kept counts, the audit's tally, the lap counters); a suspect's
    /// holdings are counted in the MWTable before anything is decided — a scan, at most once
    /// per CN per audit pass (offloaded), so lap counters a CN inflates cannot make the MN scan
    /// the table on every sample — and only a CN the table shows over its quota is stopped.
    pub(super) fn enforce_quota<P: MnPort>(&mut self, port: &mut P, cn: CnId) -> R<P::Error> {
        let Some(r) = self.cn(cn).cloned() else { return Ok(()) };
        if r.status != CnStatus::Active || !self.suspect_over_quota(cn) {
            return Ok(());
        }
        let bit = 1u32 << r.slot;
        if self.cfg.mode == ExecutionMode::Offloaded && self.recounted_this_pass & bit != 0 {
            return Ok(());
        }
        self.recounted_this_pass |= bit;
        let quota = self.quota_of(cn);
        // counted while its chains still run (a free under way may yet bring it back within
        // its quota: it held more than its quota all the same, as the table shows); a group
        // its alloc chain popped ahead for its next request is not its doing
        let count = self.count_in_table(port, cn)?.saturating_sub(self.held_ahead(port, cn)?);
        self.counted_at[r.slot as usize] = (r.allocs, r.frees);
        if count <= quota && self.bytes_allow(cn, count) {
            // within its quotas (a tally of a CN that churned through the sweep, laps that
            // came and went): nothing was stopped, it goes on
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
        if !r.extra_alloc.is_empty() {
            // every extra alloc chain's management QP goes too (its loop QP stays, as the first's)
            port.apply(Action::ReleaseQps { qps: r.extra_alloc.iter().map(|c| c.mgmt).collect() })
                .map_err(MnError::Port)?;
        }
        let s = self.map.scratch(r.slot).ok_or(MnError::BadConfig)?;
        self.repair_alloc_chains(port, &q)?;
        self.repair_free(port, &q, s + FREE_SCRATCH_OFF)?;
        self.reclaim_all_of(port, &q)?;
        self.settle(port)
    }
}
