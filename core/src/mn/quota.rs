//! Quota: what a CN (or its tenant) may hold, counted from the MWTable, the source of truth;
//! refused in the host engine, enforced lazily (disconnect and take back) when offloaded.

use super::*;

impl MemoryNode {
    /// Groups counted against `cn`'s quota according to the MWTable — the source of truth:
    /// management-QP counters can be inflated by laps that failed part-way, the table cannot.
    /// A CN of a tenant is charged what all the tenant's CNs hold.
    pub(super) fn held_by<P: MnPort>(&mut self, port: &mut P, cn: CnId) -> Result<u32, MnError<P::Error>> {
        let charged = crate::mn::tenant::charged_with(self.cns().map(|r| (r.cn, r.tenant)), cn);
        let mut n = 0;
        for i in 0..self.cfg.geometry.chunk_count() {
            let addr = self.map.entry_addr(GroupId(i)).ok_or(MnError::BadConfig)?;
            if charged.contains(&read_entry(port, addr)?.owner()) {
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
            let s = self.map.scratch(slot).ok_or(MnError::BadConfig)?;
            let entry = rd(port, s + ALLOC_SCRATCH_OFF + alloc_scratch::REPLY_ENTRY_ADDR)?;
            if self.map.group_of_entry(entry).is_some() && read_entry(port, entry)?.owner() == owner {
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

    /// Host-engine mode: a request arrived ([`Event::RequestArrived`]). An alloc is refused at
    /// once while the CN is parked on its ticket or when it would exceed the quota; anything
    /// else is served. A refused request's buffer is free again at once (no lap holds it): the
    /// driver posts it with its one rule.
    pub(super) fn on_request<P: MnPort>(&mut self, port: &mut P, cn: CnId, kind: ChainKind, len: u32) -> R<P::Error> {
        let Some(r) = self.cn(cn).cloned() else { return Ok(()) };
        // a request: the CN is alive (a lap may drop the completions of its probes while it
        // waits for its own steps)
        self.cn_answered(cn);
        if self.cfg.mode != ExecutionMode::HostEngine || r.status != CnStatus::Active {
            return Ok(());
        }
        if kind == ChainKind::Alloc {
            // the token, where the request is long enough to carry one (a refusal names it)
            let token = match (len as usize >= crate::wire::message::HEADER_LEN, self.map.scratch(r.slot)) {
                (true, Some(s)) => Some(self.token_at(port, s + ALLOC_REQUEST_BUF_OFF)?),
                _ => None,
            };
            // A parked alloc chain is not armed in offloaded mode, so a request then finds no
            // receive. Here it must not run either: the CN's empty pop already holds its one
            // ticket, and another pop would take a second one the queue ring has no room for.
            // Answer it "empty" (matched by its token) without running it.
            let refused = if r.alloc_parked {
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
        port.apply(Action::ServeLap { cn, kind, len }).map_err(MnError::Port)
    }

    /// Host-engine mode's exact quota: refuse an allocation that would exceed it (the CN is
    /// told `QuotaExceeded`; nothing is revoked). Returns whether the request was refused.
    fn refuse_over_quota<P: MnPort>(&mut self, port: &mut P, cn: CnId, token: u32) -> Result<bool, MnError<P::Error>> {
        let quota = self.quota_of(cn);
        let held = self.held_by(port, cn)?;
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

    /// Offloaded mode's lazy quota (the chains cannot count): a CN found holding more than its
    /// quota is told `QuotaExceeded`, loses its management QPs and **every** group it holds
    /// (windows invalidated, groups back in the queue); its access QPs stay connected but every
    /// rkey it had is dead. Other CNs are unaffected.
    pub(super) fn enforce_quota<P: MnPort>(&mut self, port: &mut P, cn: CnId) -> R<P::Error> {
        let Some(r) = self.cn(cn).cloned() else { return Ok(()) };
        let quota = self.quota_of(cn);
        let held = self.held_by(port, cn)?.saturating_sub(self.held_ahead(port, cn)?);
        if r.status != CnStatus::Active || (held <= quota && self.bytes_allow(cn, held)) {
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
}
