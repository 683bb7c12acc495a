//! Fabric-wide addresses: a host, and a QP on a host. Their own module because the error,
//! counter, fault and view modules name them and the fabric uses those modules: with the types in
//! fabric.rs the module graph had cycles (scripts/import-cycles).

use omw_core::ids::Qpn;
use std::fmt;

/// A host of the fabric (index into [`Fabric`](crate::fabric::Fabric)'s hosts).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord, Default)]
pub struct HostId(pub u32);

impl fmt::Display for HostId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host{}", self.0)
    }
}

/// A QP, fabric-wide: its host and its QP number there.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct QpAddr {
    pub host: HostId,
    pub qpn: Qpn,
}

impl QpAddr {
    pub const fn new(host: HostId, qpn: Qpn) -> Self {
        QpAddr { host, qpn }
    }
}

impl fmt::Display for QpAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/qp{}", self.host, self.qpn)
    }
}
