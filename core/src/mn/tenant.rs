//! Tenants: who a CN is, as far as limits go.
//!
//! A session is free to open, so limits that are per CN (quota, slots) are limits on nothing: a
//! host that opens four sessions holds four quotas (DESIGN.md §9, "Admission"). The deployment
//! authenticates each CN's connect request as one of its configured tenants and connects it with
//! [`crate::mn::MemoryNode::connect_as`]; the MN then counts what the tenant's CNs hold
//! **together** against the tenant's quota, and refuses a CN beyond the tenant's CN slots. A CN
//! connected without a tenant ([`crate::mn::MemoryNode::connect`], an MN running open) keeps the
//! per-CN quota of [`crate::mn::MnConfig::quota`].
//!
//! The table is fixed-capacity (no heap, like the rest of the control plane) and checked when a
//! tenant is added, so a bad table is refused at start-up, not found at the first connect.

use crate::ids::CnId;
use core::fmt;

/// Most tenants one MN knows: one per CN slot is enough (a tenant without a CN holds nothing);
/// `mn/mod.rs` checks it equals `MAX_CNS` (this module sits below the MN and does not import it).
pub const MAX_TENANTS: usize = 32;

/// A tenant as the MN's configuration and the connect hello name it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct TenantId(pub u32);

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tenant {:#010x}", self.0)
    }
}

/// What one tenant may have, over all its CNs at once.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct TenantLimits {
    /// Groups (chunks) its CNs may hold together.
    pub quota: u32,
    /// CNs it may have connected at once.
    pub max_cns: u32,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum TenantError {
    /// A connect named a tenant the MN was not given.
    Unknown(TenantId),
    /// The tenant was added already.
    Duplicate(TenantId),
    /// More than [`MAX_TENANTS`] tenants.
    TableFull,
    /// A tenant that may hold nothing, or connect no CN, is a configuration mistake.
    ZeroLimit(TenantId),
    /// The tenant has `max` CNs connected already.
    SlotsFull { tenant: TenantId, max: u32 },
}

impl fmt::Display for TenantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TenantError::Unknown(t) => write!(f, "{t} is not configured"),
            TenantError::Duplicate(t) => write!(f, "{t} is configured twice"),
            TenantError::TableFull => write!(f, "more than {MAX_TENANTS} tenants"),
            TenantError::ZeroLimit(t) => write!(f, "{t}: a quota and a CN limit of at least 1 are needed"),
            TenantError::SlotsFull { tenant, max } => write!(f, "{tenant} has its {max} CN(s) connected already"),
        }
    }
}

/// The tenants an MN serves and their limits.
#[derive(Clone, Debug, Default)]
pub struct TenantTable {
    entries: heapless::Vec<(TenantId, TenantLimits), MAX_TENANTS>,
}

impl TenantTable {
    pub const fn new() -> Self {
        TenantTable { entries: heapless::Vec::new() }
    }

    pub fn add(&mut self, id: TenantId, limits: TenantLimits) -> Result<(), TenantError> {
        if limits.quota == 0 || limits.max_cns == 0 {
            return Err(TenantError::ZeroLimit(id));
        }
        if self.get(id).is_some() {
            return Err(TenantError::Duplicate(id));
        }
        self.entries.push((id, limits)).map_err(|_| TenantError::TableFull)
    }

    pub fn get(&self, id: TenantId) -> Option<TenantLimits> {
        self.entries.iter().find(|(t, _)| *t == id).map(|(_, l)| *l)
    }

    /// The tenant's limits, or why a connect naming it is refused given that `connected` of
    /// its CNs are connected now.
    pub fn admit(&self, id: TenantId, connected: usize) -> Result<TenantLimits, TenantError> {
        let l = self.get(id).ok_or(TenantError::Unknown(id))?;
        if connected >= l.max_cns as usize {
            return Err(TenantError::SlotsFull { tenant: id, max: l.max_cns });
        }
        Ok(l)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    pub fn iter(&self) -> impl Iterator<Item = (TenantId, TenantLimits)> + '_ {
        self.entries.iter().copied()
    }
}

/// The CN ids whose holdings count against `cn`'s quota: the CNs of its tenant, or `cn` alone
/// (a CN without a tenant, or one not connected).
pub fn charged_with(cns: impl Iterator<Item = (CnId, Option<TenantId>)>, cn: CnId) -> heapless::Vec<u32, MAX_TENANTS> {
    let mut out = heapless::Vec::new();
    // at most one record per CN slot (MAX_CNS == MAX_TENANTS, asserted in mn/mod.rs)
    let recs: heapless::Vec<(CnId, Option<TenantId>), MAX_TENANTS> = cns.take(MAX_TENANTS).collect();
    match recs.iter().find(|r| r.0 == cn).and_then(|r| r.1) {
        Some(t) => {
            for r in recs.iter().filter(|r| r.1 == Some(t)) {
                let pushed = out.push(r.0.get());
                debug_assert!(pushed.is_ok(), "no more CNs than records");
            }
        }
        None => {
            let pushed = out.push(cn.get());
            debug_assert!(pushed.is_ok(), "an empty vector has room");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: TenantLimits = TenantLimits { quota: 4, max_cns: 2 };

    #[test]
    fn a_table_refuses_duplicates_zero_limits_and_overflow() {
        let mut t = TenantTable::new();
        t.add(TenantId(1), L).unwrap();
        assert_eq!(t.add(TenantId(1), L), Err(TenantError::Duplicate(TenantId(1))));
        assert_eq!(t.add(TenantId(2), TenantLimits { quota: 0, max_cns: 1 }), Err(TenantError::ZeroLimit(TenantId(2))));
        assert_eq!(t.add(TenantId(2), TenantLimits { quota: 1, max_cns: 0 }), Err(TenantError::ZeroLimit(TenantId(2))));
        for i in 2..=MAX_TENANTS as u32 {
            t.add(TenantId(i), L).unwrap();
        }
        assert_eq!(t.add(TenantId(999), L), Err(TenantError::TableFull));
        assert_eq!(t.len(), MAX_TENANTS);
    }

    #[test]
    fn admission_counts_the_tenants_connected_cns() {
        let mut t = TenantTable::new();
        t.add(TenantId(7), L).unwrap();
        assert_eq!(t.admit(TenantId(7), 0), Ok(L));
        assert_eq!(t.admit(TenantId(7), 1), Ok(L));
        assert_eq!(t.admit(TenantId(7), 2), Err(TenantError::SlotsFull { tenant: TenantId(7), max: 2 }));
        assert_eq!(t.admit(TenantId(8), 0), Err(TenantError::Unknown(TenantId(8))));
    }
}
