//! The periodic audit (offloaded): groups whose access windows are bound outside their owner's
//! access QPs or reach outside their chunk are taken back, after the owner's chains are stopped.

use super::*;

impl MemoryNode {
    /// The MN's periodic audit (on every tick): offloaded chains bind access windows to
    /// whatever QPs a request names (DESIGN.md §2: "a bad qpn only hurts the caller"), so a
    /// group whose access window ended up bound outside its owner's access QPs is reclaimed —
    /// the owner loses it, nobody else gains it. Then every CN's holdings against its quota.
    pub(super) fn audit<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
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
    pub(super) fn audit_group<P: MnPort>(
        &mut self,
        port: &mut P,
        gid: GroupId,
    ) -> Result<Option<AuditFinding>, MnError<P::Error>> {
        let g = self.cfg.geometry.group_size();
        let e = read_entry(port, self.map.entry_addr(gid).ok_or(MnError::BadConfig)?)?;
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
        let (base, size) =
            (self.cfg.geometry.chunk_base(gid).ok_or(MnError::BadConfig)?, self.cfg.geometry.chunk_size());
        let outside =
            (0..g).any(|k| port.mw_span(e.rkey(k)).is_some_and(|(a, l)| a < base || a.saturating_add(l) > base + size));
        Ok(Some((cn, misbound, outside)))
    }
}
