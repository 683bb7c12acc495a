//! Membership: where the MNs of a pool publish themselves and where CNs watch them.
//!
//! Keys (the same in every implementation, docs/POOL.md):
//!
//! ```text
//! /omw/pool/<pool>/mn/<name>      the MN's record (entry.rs), bound to the MN's lease
//! /omw/pool/<pool>/drain/<name>   an operator's drain request ("1"), no lease
//! ```
//!
//! An MN's record lives exactly as long as its lease: an MN that stops keeping it alive (it
//! crashed, its host vanished, it lost the registry) disappears from the pool when the lease's
//! TTL runs out, and every watcher sees the record deleted. Two implementations:
//! [`crate::etcd::EtcdRegistry`] (a real etcd v3 server, for deployments of several processes)
//! and [`crate::memory::InProcessRegistry`] (one process: the loopback demo and tests, with the
//! deployment's own clock).

use std::fmt;
use std::sync::mpsc;
use std::time::Duration;

/// A name of a pool or an MN: one key segment (`[A-Za-z0-9._-]`, 1..=64 characters), so a
/// name can neither climb the key hierarchy nor collide with another pool's prefix.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Name(String);

/// Why a name was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadName(pub String);

impl fmt::Display for BadName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} is not a name: 1 to 64 characters of A-Z a-z 0-9 . _ -", self.0)
    }
}

impl std::error::Error for BadName {}

impl Name {
    pub fn new(s: &str) -> Result<Name, BadName> {
        let ok = !s.is_empty()
            && s.len() <= 64
            && s != "."
            && s != ".."
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if ok {
            Ok(Name(s.to_string()))
        } else {
            Err(BadName(crate::entry::cut(s)))
        }
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The key layout.
pub mod keys {
    use super::Name;
    pub fn mn_prefix(pool: &Name) -> String {
        format!("/omw/pool/{pool}/mn/")
    }
    pub fn mn(pool: &Name, mn: &Name) -> String {
        format!("{}{mn}", mn_prefix(pool))
    }
    pub fn drain(pool: &Name, mn: &Name) -> String {
        format!("/omw/pool/{pool}/drain/{mn}")
    }
}

/// A lease an MN keeps alive while it is a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LeaseId(pub i64);

/// What a watcher of a pool sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistryEvent {
    /// Every record under the pool's prefix now: the first event of a watch, and the first
    /// after the registry came back (anything the watcher knew that is not here has gone).
    Resync(Vec<(String, Vec<u8>)>),
    /// An MN's record was written (it joined, or it published new counts or its drain flag).
    Put { name: String, value: Vec<u8> },
    /// An MN's record went: its lease expired, or it left.
    Delete { name: String },
    /// The registry cannot be reached (the watcher keeps what it knows; a `Resync` follows
    /// when it is back).
    Lost(RegistryError),
}

/// A pool's membership as it changes. It keeps what delivers it alive (the etcd client's
/// runtime), so it outlives the registry handle it came from.
pub struct Watch {
    pub(crate) rx: mpsc::Receiver<RegistryEvent>,
    pub(crate) _keep: Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>,
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Watch")
    }
}

impl Watch {
    /// Everything that happened since the last call, without waiting.
    pub fn drain(&self) -> Vec<RegistryEvent> {
        self.rx.try_iter().collect()
    }
    /// The next event, waiting at most `d`.
    pub fn next_timeout(&self, d: Duration) -> Option<RegistryEvent> {
        self.rx.recv_timeout(d).ok()
    }
}

/// What went wrong talking to the registry.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegistryError {
    /// The registry at `url` cannot be reached (connect refused, timed out).
    Unreachable { url: String, detail: String },
    /// The lease is gone (its TTL ran out before a keep-alive): the MN must register again.
    LeaseExpired(LeaseId),
    /// Another live MN holds this name in the pool.
    NameTaken(String),
    /// The registry answered with an error.
    Failed { url: String, detail: String },
}

impl fmt::Display for RegistryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegistryError::Unreachable { url, detail } => write!(f, "registry {url} unreachable: {detail}"),
            RegistryError::LeaseExpired(l) => write!(f, "registry lease {:#x} expired", l.0),
            RegistryError::NameTaken(n) => write!(f, "MN name {n:?} is taken by a live MN of the pool"),
            RegistryError::Failed { url, detail } => write!(f, "registry {url}: {detail}"),
        }
    }
}

impl std::error::Error for RegistryError {}

/// A registry shared by the threads and owners that use it.
pub type SharedRegistry = std::sync::Arc<dyn Registry + Send + Sync>;

/// Where a pool's MNs are members. Blocking calls (each bounded by the implementation's
/// timeout); the watch delivers through a channel.
pub trait Registry {
    /// Where it is (an etcd URL, "in-process"): what messages name.
    fn url(&self) -> String;
    /// Write `value` under `/omw/pool/<pool>/mn/<mn>` bound to a new lease of `ttl`, unless a
    /// live MN holds the name. The caller keeps the lease alive ([`Registry::keep_alive`]).
    fn register(&self, pool: &Name, mn: &Name, value: &[u8], ttl: Duration) -> Result<LeaseId, RegistryError>;
    /// Renew the lease (before its TTL runs out).
    fn keep_alive(&self, lease: LeaseId) -> Result<(), RegistryError>;
    /// Write a new record under the lease (new counts, the drain flag).
    fn update(&self, pool: &Name, mn: &Name, value: &[u8], lease: LeaseId) -> Result<(), RegistryError>;
    /// Leave: delete the record and revoke the lease.
    fn deregister(&self, pool: &Name, mn: &Name, lease: LeaseId) -> Result<(), RegistryError>;
    /// Every MN record of the pool now, `(name, value)`.
    fn members(&self, pool: &Name) -> Result<Vec<(String, Vec<u8>)>, RegistryError>;
    /// Watch the pool's MN records: starts with a [`RegistryEvent::Resync`].
    fn watch(&self, pool: &Name) -> Result<Watch, RegistryError>;
    /// An operator asks MN `mn` to drain (or to stop draining).
    fn request_drain(&self, pool: &Name, mn: &Name, on: bool) -> Result<(), RegistryError>;
    /// Whether an operator asked MN `mn` to drain.
    fn drain_requested(&self, pool: &Name, mn: &Name) -> Result<bool, RegistryError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_one_key_segment() {
        for ok in ["a", "mn-1", "pool_A.2", &"x".repeat(64)] {
            assert!(Name::new(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "a b", "ü", &"x".repeat(65), "a\n"] {
            assert!(Name::new(bad).is_err(), "{bad:?}");
        }
        let p = Name::new("p").unwrap();
        let m = Name::new("m").unwrap();
        assert_eq!(keys::mn(&p, &m), "/omw/pool/p/mn/m");
        assert_eq!(keys::drain(&p, &m), "/omw/pool/p/drain/m");
        assert!(keys::mn(&p, &m).starts_with(&keys::mn_prefix(&p)));
    }
}
