//! What each tenant holds in each of an MN's size classes, for the byte quota across classes
//! (`omw_core::mn::class_quota`).
//!
//! Each class is a `MemoryNode` of its own on its own port, and a pool client opens one session
//! per class, so no class can tell by itself that two of its peers' sessions are one holder.
//! The only identity that holds across the classes is the authenticated tenant (`--tenants`,
//! `crate::admission`: a hello tagged with the tenant's secret, which a CN cannot forge); a
//! tenant's `quota_bytes` is its quota over every class, and each class is told what the
//! tenant's CNs hold in the others. Without a tenant there is no such identity — a peer's
//! address, QP numbers and session nonce are its own to choose, and a CN that connects twice is
//! two CNs — so an open MN holds each connection to its class's group quota alone.
//!
//! The ledger is the MN loop's bookkeeping: after every step of a class (alloc, free, reclaim,
//! connect, disconnect) the class publishes its tenants' holdings — O(CNs), from the core's
//! kept counts, never a scan of the MWTable — and, when anything changed, every class learns
//! what each of its tenants holds elsewhere: O(CNs × classes) per change.
//!
//! The kept counts are exact in host-engine mode only (offloaded, the chains change owners
//! unseen); `omw mn --classes` runs the host engine (`--offload mlx5` with classes is refused).
//! They leave out an alloc lap still in flight, so a tenant racing several classes at once may
//! end at most one group per CN per class with a lap in flight above its bytes — the slack the
//! core's tenant count has between one tenant's CNs in one class — and is refused until back
//! under.

use super::{log, MnDaemon, Transport};
use omw_core::ids::CnId;
use omw_core::mn::tenant::TenantId;
use omw_core::mn::MemoryNode;
use std::collections::HashMap;

/// Bytes each tenant holds in each class (groups held × the class's chunk size).
#[derive(Clone, Debug, Default)]
pub struct ClassLedger {
    classes: usize,
    held: HashMap<TenantId, Vec<u64>>,
    /// Bumped by every change, so a class knows whether it has learned the latest.
    version: u64,
}

impl ClassLedger {
    pub fn new(classes: usize) -> Self {
        ClassLedger { classes, held: HashMap::new(), version: 0 }
    }

    /// Class `class` (of `chunk_size`-byte chunks) holds now what `cns` say: each CN's tenant
    /// (None: a CN of its own, not in the ledger) and the groups it holds. Replaces whatever the
    /// class published before — a CN that left is simply absent. Returns whether anything
    /// changed; a class out of range changes nothing.
    pub fn publish(
        &mut self,
        class: usize,
        chunk_size: u64,
        cns: impl IntoIterator<Item = (Option<TenantId>, u32)>,
    ) -> bool {
        if class >= self.classes {
            return false;
        }
        let mut now: HashMap<TenantId, u64> = HashMap::new();
        for (t, groups) in cns {
            if let Some(t) = t {
                *now.entry(t).or_default() += (groups as u64).saturating_mul(chunk_size);
            }
        }
        let mut changed = false;
        for (t, row) in self.held.iter_mut() {
            let b = now.remove(t).unwrap_or(0);
            if row[class] != b {
                row[class] = b;
                changed = true;
            }
        }
        // tenants this class alone knows so far
        for (t, b) in now {
            if b == 0 {
                continue;
            }
            let mut row = vec![0; self.classes];
            row[class] = b;
            self.held.insert(t, row);
            changed = true;
        }
        // a tenant that holds nothing anywhere leaves the ledger (it stays as small as the
        // tenants that hold something)
        self.held.retain(|_, row| row.iter().any(|b| *b > 0));
        if changed {
            self.version += 1;
        }
        changed
    }

    /// What `tenant` holds in every class but `class`, in bytes.
    pub fn elsewhere(&self, class: usize, tenant: TenantId) -> u64 {
        self.held.get(&tenant).map_or(0, |row| {
            row.iter().enumerate().filter(|(k, _)| *k != class).fold(0u64, |s, (_, b)| s.saturating_add(*b))
        })
    }

    /// What `tenant` holds over every class, in bytes.
    pub fn total(&self, tenant: TenantId) -> u64 {
        self.held.get(&tenant).map_or(0, |row| row.iter().fold(0u64, |s, b| s.saturating_add(*b)))
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// Every tenant the ledger knows, with what it holds in every class but `class`.
    pub fn elsewhere_all(&self, class: usize) -> impl Iterator<Item = (TenantId, u64)> + '_ {
        self.held.keys().map(move |t| (*t, self.elsewhere(class, *t)))
    }
}

/// A class's side of the ledger: what it learned last.
#[derive(Clone, Debug, Default)]
pub struct Learned {
    /// The ledger's version it was learned at.
    version: u64,
    /// Each tenant's bytes in the other classes (absent: none).
    elsewhere: HashMap<TenantId, u64>,
}

impl Learned {
    /// `mn` is class `class` of `ledger`'s MN: when the ledger changed since this class last
    /// looked, tell `mn`, for each CN of a tenant, what the tenant holds in the other classes.
    /// O(tenants + CNs).
    pub fn learn(&mut self, ledger: &ClassLedger, class: usize, mn: &mut MemoryNode) {
        if ledger.version() == self.version {
            return;
        }
        self.version = ledger.version();
        self.elsewhere = ledger.elsewhere_all(class).collect();
        let cns: Vec<(CnId, TenantId)> = mn.cns().filter_map(|r| Some((r.cn, r.tenant?))).collect();
        for (cn, t) in cns {
            self.tell(mn, cn, t);
        }
    }

    /// Tell `mn` what `cn`'s tenant holds in the other classes, as last learned — also for a
    /// CN just connected, before its first request is served.
    pub fn tell(&self, mn: &mut MemoryNode, cn: CnId, tenant: TenantId) {
        let bytes = self.elsewhere.get(&tenant).copied().unwrap_or(0);
        if let Err(e) = mn.set_held_elsewhere(cn, bytes) {
            // a CN of the MN's own list, at most one entry per CN: not expected
            log(format!("{cn}: could not record what its tenant holds in the other classes: {e}"));
        }
    }
}

/// Publish what `mn` — class `class`, of `chunk_size`-byte chunks — holds per tenant now (the
/// core's kept counts: exact in host-engine mode where no lap is in flight). O(CNs). True when
/// it changed.
pub fn publish_class(ledger: &mut ClassLedger, class: usize, chunk_size: u64, mn: &MemoryNode) -> bool {
    ledger.publish(class, chunk_size, mn.cns().map(|r| (r.tenant, mn.held(r.cn).unwrap_or(0))))
}

impl<T: Transport> MnDaemon<T> {
    pub(super) fn learn_elsewhere(&mut self, ledger: &ClassLedger, class: usize) {
        self.learned.learn(ledger, class, &mut self.driver.mn);
    }

    pub(super) fn tell_elsewhere(&mut self, cn: CnId, tenant: TenantId) {
        self.learned.tell(&mut self.driver.mn, cn, tenant);
    }

    pub(super) fn publish_holdings(&self, ledger: &mut ClassLedger, class: usize) -> bool {
        publish_class(ledger, class, self.opts.chunk_size, &self.driver.mn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: u64 = 4096;
    const LARGE: u64 = 65536;
    const T: TenantId = TenantId(1);
    const U: TenantId = TenantId(2);

    #[test]
    fn a_tenants_holdings_in_one_class_are_elsewhere_for_the_others() {
        let mut l = ClassLedger::new(2);
        assert!(l.publish(1, LARGE, [(Some(T), 1)]));
        assert_eq!(l.elsewhere(0, T), LARGE);
        // a class does not count itself
        assert_eq!(l.elsewhere(1, T), 0);
        assert!(l.publish(0, SMALL, [(Some(T), 2)]));
        assert_eq!(l.elsewhere(1, T), 2 * SMALL);
        assert_eq!(l.elsewhere(0, T), LARGE);
        assert_eq!(l.total(T), LARGE + 2 * SMALL);
    }

    #[test]
    fn a_tenants_cns_in_one_class_are_summed() {
        let mut l = ClassLedger::new(2);
        l.publish(0, SMALL, [(Some(T), 2), (Some(T), 3), (Some(U), 1)]);
        assert_eq!(l.elsewhere(1, T), 5 * SMALL);
        assert_eq!(l.elsewhere(1, U), SMALL);
    }

    #[test]
    fn freeing_in_one_class_lowers_what_the_others_see() {
        let mut l = ClassLedger::new(2);
        l.publish(1, LARGE, [(Some(T), 1)]);
        let v = l.version();
        assert!(l.publish(1, LARGE, [(Some(T), 0)]));
        assert!(l.version() > v);
        assert_eq!(l.elsewhere(0, T), 0);
        assert_eq!(l.total(T), 0);
    }

    #[test]
    fn a_disconnect_drops_the_cns_share() {
        let mut l = ClassLedger::new(3);
        l.publish(0, SMALL, [(Some(T), 4), (Some(T), 1)]);
        l.publish(2, LARGE, [(Some(T), 1)]);
        assert_eq!(l.elsewhere(1, T), 5 * SMALL + LARGE);
        // the 4-chunk CN left class 0 (its chunks reclaimed): absent from the class's list
        assert!(l.publish(0, SMALL, [(Some(T), 1)]));
        assert_eq!(l.elsewhere(1, T), SMALL + LARGE);
        // every CN of the tenant left class 2
        assert!(l.publish(2, LARGE, []));
        assert_eq!(l.elsewhere(1, T), SMALL);
    }

    #[test]
    fn tenants_are_independent() {
        let mut l = ClassLedger::new(2);
        l.publish(0, SMALL, [(Some(T), 3), (Some(U), 1)]);
        l.publish(1, LARGE, [(Some(U), 2)]);
        assert_eq!(l.elsewhere(1, T), 3 * SMALL);
        assert_eq!(l.elsewhere(0, T), 0);
        assert_eq!(l.elsewhere(0, U), 2 * LARGE);
        assert_eq!(l.elsewhere(1, U), SMALL);
        // U frees everything in class 0: T is untouched
        l.publish(0, SMALL, [(Some(T), 3), (Some(U), 0)]);
        assert_eq!(l.elsewhere(1, T), 3 * SMALL);
        assert_eq!(l.elsewhere(1, U), 0);
    }

    #[test]
    fn a_cn_without_a_tenant_is_no_ones_holder() {
        let mut l = ClassLedger::new(2);
        // an open CN holds chunks: nothing to tell the other class, no version change
        assert!(!l.publish(0, SMALL, [(None, 7)]));
        assert_eq!(l.version(), 0);
        assert_eq!(l.elsewhere(1, T), 0);
        l.publish(0, SMALL, [(None, 7), (Some(T), 1)]);
        assert_eq!(l.elsewhere(1, T), SMALL);
    }

    #[test]
    fn publishing_the_same_holdings_again_changes_nothing() {
        let mut l = ClassLedger::new(2);
        assert!(l.publish(0, SMALL, [(Some(T), 2)]));
        let v = l.version();
        assert!(!l.publish(0, SMALL, [(Some(T), 2)]));
        assert_eq!(l.version(), v);
        // a class out of range is no change either
        assert!(!l.publish(5, SMALL, [(Some(T), 9)]));
        assert_eq!(l.total(T), 2 * SMALL);
    }
}
