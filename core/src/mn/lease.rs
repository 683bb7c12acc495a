//! Leases: a CN that stops answering is probed, then evicted; one that leaves or crashes has
//! everything taken back.

use super::*;

impl MemoryNode {
    /// CNs evicted since the last call (the deployment drops their connections). A deployment
    /// that takes them after every poll and timer is told of every one (a reaction evicts only
    /// CNs it started with: at most [`MAX_CNS`]); beyond that they are counted in
    /// [`MnStats::evictions_unreported`].
    pub fn take_evicted(&mut self) -> heapless::Vec<CnId, MAX_CNS> {
        core::mem::take(&mut self.evicted)
    }

    /// Evict an unresponsive CN: what a departure does, plus the record for the deployment.
    pub(super) fn evict<P: MnPort>(&mut self, port: &mut P, cn: CnId) -> R<P::Error> {
        if self.cn(cn).is_none() {
            return Ok(());
        }
        self.stats.cns_evicted += 1;
        if self.evicted.push(cn).is_err() {
            self.stats.evictions_unreported += 1;
        }
        self.on_cn_gone(port, cn)
    }

    /// Evidence that `cn` is alive and receiving: a send to it completed, or a request from it
    /// arrived. Renews its lease.
    pub(super) fn cn_answered(&mut self, cn: CnId) {
        if let Some(r) = self.cns.iter_mut().flatten().find(|r| r.cn == cn) {
            r.probe_outstanding = false;
        }
    }

    /// Lease probes for every CN whose half-period is up; a CN that has not answered the
    /// previous probe by then is evicted. The MN's own clock bounds it: a CN cannot stretch
    /// it with the RNR timer or retry counts it negotiated.
    pub(super) fn probe_due<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
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

    pub(super) fn on_cn_gone<P: MnPort>(&mut self, port: &mut P, cn: CnId) -> R<P::Error> {
        let r = self.cn(cn).ok_or(MnError::UnknownCn(cn))?.clone();
        // every chain of it stops (its management QPs too: a crash mid-alloc must not leave
        // binds running after the reclaim unbound the group)
        let q = self.quiesce(port, cn, Chains::BOTH)?;
        let s = self.map.scratch(r.slot).ok_or(MnError::BadConfig)?;
        // in-flight laps first (a pop the CN never saw, a half-done free), then what it owns;
        // a ticket its lap took stays with the MN (settle() places the group when it arrives)
        self.repair_alloc_chains(port, &q)?;
        self.repair_free(port, &q, s + FREE_SCRATCH_OFF)?;
        self.reclaim_all_of(port, &q)?;
        port.apply(Action::ReleaseCn { qps: r.qps.clone() }).map_err(MnError::Port)?;
        if !r.extra_alloc.is_empty() {
            port.apply(Action::ReleaseQps { qps: r.extra_qps().collect() }).map_err(MnError::Port)?;
        }
        self.cns[r.slot as usize] = None;
        self.settle(port)
    }
}
