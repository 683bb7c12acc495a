//! What the pool client needs of one CN's connection to one size class of one MN.
//!
//! Deliberately small — alloc, free, read, write — so it sits on whatever CN handle a backend
//! has: the loopback cluster's CN ([`crate::loopback`]), omw-verbs' blocking `CnClient`
//! ([`crate::verbs`]), and later the threaded/async CN handle (issue 25), each implementing it
//! in a few lines. The implementation sorts its backend's errors into the few kinds placement
//! acts on ([`SessionError`]); everything else is kept as the backend's own error.

use crate::entry::{ClassEntry, MnEntry};
use omw_core::cn::Allocation;
use std::fmt;

/// One CN's connection to one class of one MN.
pub trait MnSession {
    type Error: std::error::Error + 'static;
    /// The chunk size and group size the MN told this CN when it connected (its connect info):
    /// what the MN really has, whatever its registry record says.
    fn geometry(&self) -> (u64, u8);
    /// One chunk of the class.
    fn alloc(&mut self) -> Result<Allocation, SessionError<Self::Error>>;
    fn free(&mut self, a: &Allocation) -> Result<(), SessionError<Self::Error>>;
    /// One-sided WRITE at `offset` of the chunk.
    fn write(&mut self, a: &Allocation, offset: u64, data: &[u8]) -> Result<(), SessionError<Self::Error>>;
    /// One-sided READ of `buf.len()` bytes at `offset`.
    fn read(&mut self, a: &Allocation, offset: u64, buf: &mut [u8]) -> Result<(), SessionError<Self::Error>>;
    /// Take what the MN sent without waiting (lease probes, notices) and post receives again:
    /// an MN evicts a CN whose posted receives its probes used up, so a pool client services
    /// every connection it keeps, not only the one it is using.
    fn service(&mut self) -> Result<(), SessionError<Self::Error>>;
}

/// How a CN reaches the classes of the MNs the registry names.
pub trait Connector {
    type Session: MnSession;
    /// Connect to `class` of `mn` (a new connection: the pool client connects lazily, once per
    /// MN and class it places on, and again after the MN rejoined).
    fn connect(
        &mut self,
        mn: &MnEntry,
        class: &ClassEntry,
    ) -> Result<Self::Session, SessionError<<Self::Session as MnSession>::Error>>;
}

/// What placement and routing need to know of a session's failure.
#[derive(Debug)]
pub enum SessionError<E> {
    /// The MN has no chunk of the class (it answered "empty", or said so and the CN is backing
    /// off until "available"): try the next MN.
    Empty,
    /// The MN refused for this CN's quota.
    QuotaExceeded,
    /// The connection is gone (the MN died, its host vanished, the transport gave up): every
    /// allocation on this MN is lost to this CN.
    Lost(E),
    /// Anything else; the connection may still be good.
    Failed(E),
}

impl<E: fmt::Display> fmt::Display for SessionError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SessionError::Empty => f.write_str("the MN has no free chunk of this class"),
            SessionError::QuotaExceeded => f.write_str("the MN refused: quota exceeded"),
            SessionError::Lost(e) => write!(f, "connection lost: {e}"),
            SessionError::Failed(e) => write!(f, "{e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for SessionError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SessionError::Lost(e) | SessionError::Failed(e) => Some(e),
            _ => None,
        }
    }
}
