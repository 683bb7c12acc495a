//! The periodic audit (offloaded): groups whose access windows are bound outside their owner's
//! access QPs or reach outside their chunk are taken back, after the owner's chains are stopped;
//! and each CN's holdings are tallied for the lazy quota.
//!
//! Incremental: each tick examines [`MnConfig::audit_batch`] entries from where the last tick
//! stopped, so a tick's work is bounded whatever the pool size, and the whole table is covered
//! once every `⌈chunks / audit_batch⌉` ticks ([`MemoryNode::audit_period_ns`]). A suspect is
//! stopped and decided about once per tick for the groups that tick found, never by scanning
//! the table again. At the end of a pass every CN's tally is compared with its quota.

use super::*;

/// Misbound or out-of-chunk groups one tick acts on; a tick that finds more stops its batch
/// there, and the next tick goes on from the first one it left.
const FLAGGED_PER_TICK: usize = 32;

impl MemoryNode {
    /// The MN's periodic audit (on every tick): offloaded chains bind access windows to
    /// whatever QPs a request names (DESIGN.md §2: "a bad qpn only hurts the caller"), so a
    /// group whose access window ended up bound outside its owner's access QPs is reclaimed —
    /// the owner loses it, nobody else gains it. At the end of each pass, every CN's holdings
    /// against its quota.
    pub(super) fn audit<P: MnPort>(&mut self, port: &mut P) -> R<P::Error> {
        let n = self.cfg.geometry.chunk_count();
        let batch = self.cfg.audit_batch.clamp(1, n);
        // First find whose groups look wrong, touching nothing: the owner's chains are still
        // running (its free may be pushing the very group).
        let mut flagged: heapless::Vec<(CnId, GroupId), FLAGGED_PER_TICK> = heapless::Vec::new();
        let mut pass_done = false;
        for _ in 0..batch {
            let gid = GroupId(self.audit_cursor.min(n - 1));
            if let Some(f) = self.audit_group(port, gid)? {
                if (f.misbound || f.outside) && flagged.push((f.cn, gid)).is_err() {
                    // full: this group is the next tick's first
                    break;
                }
                self.audit_pass[f.slot as usize] += 1;
            }
            self.audit_step(n, &mut pass_done);
            if pass_done {
                break;
            }
        }
        // Then, per suspect: quiesce, decide again from what can no longer move, push.
        let mut suspects: heapless::Vec<CnId, FLAGGED_PER_TICK> = heapless::Vec::new();
        for (cn, _) in flagged.iter() {
            if !suspects.contains(cn) {
                let pushed = suspects.push(*cn);
                debug_assert!(pushed.is_ok(), "no more suspects than flagged groups");
            }
        }
        for cn in suspects {
            let q = self.quiesce(port, cn, Chains::BOTH)?;
            self.repair_interrupted(port, &q, ChainKind::Alloc)?;
            self.repair_interrupted(port, &q, ChainKind::Free)?;
            for &(_, gid) in flagged.iter().filter(|(c, _)| *c == cn) {
                let Some(f) = self.audit_group(port, gid)? else { continue };
                if f.cn != cn || !(f.misbound || f.outside) {
                    continue;
                }
                if f.outside {
                    self.stats.spans_refused += 1;
                }
                self.reclaim_from_connected(port, &q, gid)?;
            }
            self.resume(port, &q)?;
            self.settle(port)?;
        }
        if pass_done {
            let active: heapless::Vec<CnId, MAX_CNS> =
                self.cns().filter(|r| r.status == CnStatus::Active).map(|r| r.cn).collect();
            for cn in active {
                self.enforce_quota(port, cn)?;
            }
        }
        Ok(())
    }

    /// The audit moved past one entry; at the end of the table its pass is complete: the
    /// tally becomes the pass's counts.
    fn audit_step(&mut self, n: u32, pass_done: &mut bool) {
        self.stats.audit_entries += 1;
        self.audit_cursor += 1;
        if self.audit_cursor >= n {
            self.audit_cursor = 0;
            self.audit_held = core::mem::replace(&mut self.audit_pass, [0; MAX_CNS]);
            self.recounted_this_pass = 0;
            self.stats.audit_passes += 1;
            *pass_done = true;
        }
    }

    /// What the last complete audit pass counted for `cn` alone (offloaded mode's view of its
    /// holdings: each group counted when the pass examined it). None for a CN not connected.
    pub fn audit_tally(&self, cn: CnId) -> Option<u32> {
        self.cn(cn).map(|r| self.audit_held[r.slot as usize])
    }

    /// Set how many MWTable entries the audit examines per tick ([`MnConfig::audit_batch`];
    /// 0 is taken as 1). The pass under way goes on from where it is.
    pub fn set_audit_batch(&mut self, n: u32) {
        self.cfg.audit_batch = n.max(1);
    }

    /// How long the audit takes to cover the whole table once: `⌈chunks / audit_batch⌉` ticks
    /// of `audit_ns` (0: the audit runs only on explicit ticks).
    pub fn audit_period_ns(&self) -> u64 {
        let n = self.cfg.geometry.chunk_count() as u64;
        let b = self.cfg.audit_batch.max(1) as u64;
        n.div_ceil(b) * self.cfg.audit_ns
    }

    /// One group as the audit sees it: its active owner, whether an access window is bound
    /// outside the owner's access QPs, whether a window reaches outside its own chunk.
    /// O(G + CNs).
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
        let rec = rec.clone();
        let (cn, slot) = (rec.cn, rec.slot);
        let misbound = (1..g).any(|k| {
            matches!(port.mw_binding(e.rkey(k)), Some(MwBinding::Bound { qpn, .. }) if !self.window_home(&rec, k, qpn))
        });
        // defence in depth: every bound window of the group must lie inside its own chunk
        let (base, size) =
            (self.cfg.geometry.chunk_base(gid).ok_or(MnError::BadConfig)?, self.cfg.geometry.chunk_size());
        let outside =
            (0..g).any(|k| port.mw_span(e.rkey(k)).is_some_and(|(a, l)| a < base || a.saturating_add(l) > base + size));
        Ok(Some(AuditFinding { cn, slot, misbound, outside }))
    }
}
