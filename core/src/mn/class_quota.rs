//! A quota in bytes across an MN's size classes.
//!
//! An MN with several chunk sizes runs one `MemoryNode` per class (each its own MWTable, free
//! queue and chains), so each class counts only its own groups. A holder's quota in bytes over
//! every class needs what it holds in the *other* classes: the deployment, which runs all the
//! classes, tells each one ([`MemoryNode::set_held_elsewhere`]) and the class adds its own
//! groups × chunk size. Host-engine mode refuses the allocation that would exceed it
//! (`QuotaExceeded`); offloaded mode enforces it lazily at the next audit, as the per-class
//! quota. The holder is the CN (or, for a CN admitted as a tenant, every CN of the tenant: the
//! deployment charges them alike); who is the same holder in two classes is the deployment's
//! knowledge (an authenticated tenant, or the pool client it connected for). A tenant may have a
//! byte quota of its own ([`MemoryNode::set_tenant_byte_quota`]: the verbs MN's tenants file
//! gives each tenant its bytes), which its CNs are held to in place of the MN-wide one.

use super::*;
use crate::mn::tenant::MAX_TENANTS;

/// The byte quota and the holdings reported from the other classes.
#[derive(Clone, Debug, Default)]
pub(super) struct ClassQuota {
    bytes: Option<u64>,
    /// Tenants' own byte quotas (a tenant's CNs are held to it, not to `bytes`).
    tenant_bytes: heapless::Vec<(TenantId, u64), MAX_TENANTS>,
    elsewhere: heapless::Vec<(CnId, u64), MAX_CNS>,
}

impl ClassQuota {
    pub(super) const fn new() -> Self {
        ClassQuota { bytes: None, tenant_bytes: heapless::Vec::new(), elsewhere: heapless::Vec::new() }
    }
}

impl MemoryNode {
    /// Hold each CN to `bytes` across the MN's classes (None: this class's group quota only).
    pub fn set_byte_quota(&mut self, bytes: Option<u64>) {
        self.class_quota.bytes = bytes;
    }

    pub fn byte_quota(&self) -> Option<u64> {
        self.class_quota.bytes
    }

    /// Hold the CNs of `tenant` together to `bytes` across the MN's classes, in place of
    /// [`Self::set_byte_quota`]'s bound (a tenant's quota is its own). Refused for a tenant the
    /// MN was not given ([`MemoryNode::add_tenant`]).
    pub fn set_tenant_byte_quota(&mut self, tenant: TenantId, bytes: u64) -> Result<(), TenantError> {
        if self.tenants.get(tenant).is_none() {
            return Err(TenantError::Unknown(tenant));
        }
        let q = &mut self.class_quota.tenant_bytes;
        match q.iter_mut().find(|(t, _)| *t == tenant) {
            Some(e) => e.1 = bytes,
            // one entry per tenant added, and the tenant table holds at most MAX_TENANTS
            None => q.push((tenant, bytes)).map_err(|_| TenantError::TableFull)?,
        }
        Ok(())
    }

    /// The byte quota `cn` is held to across the classes: its tenant's own, or the MN-wide one.
    pub fn byte_quota_of(&self, cn: CnId) -> Option<u64> {
        let tenant = self.cn(cn).and_then(|r| r.tenant);
        let own = tenant.and_then(|t| self.class_quota.tenant_bytes.iter().find(|(x, _)| *x == t)).map(|(_, b)| *b);
        own.or(self.class_quota.bytes)
    }

    /// What `cn`'s holder holds in the MN's other classes, in bytes (the deployment's count,
    /// after every allocation and free there). Entries of CNs that left are dropped to make
    /// room; a CN this class does not know is refused.
    pub fn set_held_elsewhere(&mut self, cn: CnId, bytes: u64) -> Result<(), MnError<core::convert::Infallible>> {
        if self.cn(cn).is_none() {
            return Err(MnError::UnknownCn(cn));
        }
        let connected: heapless::Vec<CnId, MAX_CNS> = self.cns().map(|r| r.cn).collect();
        let q = &mut self.class_quota;
        q.elsewhere.retain(|(c, _)| connected.contains(c));
        match q.elsewhere.iter_mut().find(|(c, _)| *c == cn) {
            Some(e) => e.1 = bytes,
            // at most one entry per connected CN, and there are at most MAX_CNS of those
            None => q.elsewhere.push((cn, bytes)).map_err(|_| MnError::TooManyCns)?,
        }
        Ok(())
    }

    /// What `cn`'s holder holds in the other classes, as last reported.
    pub fn held_elsewhere(&self, cn: CnId) -> u64 {
        self.class_quota.elsewhere.iter().find(|(c, _)| *c == cn).map_or(0, |(_, b)| *b)
    }

    /// Whether holding `groups` of this class keeps `cn` within the byte quota.
    pub(super) fn bytes_allow(&self, cn: CnId, groups: u32) -> bool {
        let Some(limit) = self.byte_quota_of(cn) else { return true };
        let here = (groups as u64).saturating_mul(self.cfg.geometry.chunk_size());
        here.saturating_add(self.held_elsewhere(cn)) <= limit
    }
}
