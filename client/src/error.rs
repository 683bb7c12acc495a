//! Every way an operation of the library fails, and what to do about each (docs/CN-LIBRARY.md
//! has the same list as a table).

use omw_core::cn::{ClientError, OutOfChunk};
use omw_core::device::WcStatus;
use omw_core::wire::message::ErrorCode;
use std::fmt;
use std::sync::Arc;

/// Why an operation failed.
///
/// ```
/// use omw_client::Error;
/// let e = Error::PoolEmpty;
/// assert!(e.is_retryable());
/// assert!(!Error::Disconnected.is_retryable());
/// assert_eq!(e.to_string(), "the MN has no free chunk");
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Error {
    /// The chunk handle names no live allocation: it was freed (maybe through another clone of
    /// the handle), or the MN revoked every allocation. Allocate a new chunk.
    Freed,
    /// The range does not lie inside the chunk. Fix the offset or length.
    OutOfChunk(OutOfChunk),
    /// The range does not lie inside the registered buffer.
    OutOfBuffer { start: usize, end: usize, len: usize },
    /// A remote atomic at an offset that is not a multiple of 8 (the responder would NAK it
    /// and break the QP).
    Misaligned { offset: u64 },
    /// Remote atomics are not available on this connection: the device has none, or the MN's
    /// windows do not carry them (ConnectX: atomics through type-2 windows are unsupported).
    /// Use a lock-free design on READ/WRITE, or a MN device that supports them.
    AtomicsUnsupported,
    /// A zero-copy access longer than one message of the QP may be. Split it.
    TooLarge { len: u64, max: u64 },
    /// The chunk handle or the buffer belongs to another client.
    Foreign,
    /// The buffer's registration was withdrawn: a zero-copy access could not be seen through
    /// to its completion (the transport failed), so the client deregistered the buffer before
    /// handing it back — the device can no longer touch it. Register it again.
    Deregistered,
    /// The MN has no free chunk (it answered "empty", or said so and has not said "available"
    /// since). Free something, wait, or use the blocking `alloc` that waits for "available".
    PoolEmpty,
    /// This CN (or its tenant) holds its whole quota. Free chunks first.
    QuotaExceeded,
    /// The MN refused the request for another reason.
    Refused(ErrorCode),
    /// The MN's RNIC was reset and every allocation of every CN revoked. Allocate again.
    Revoked,
    /// No answer in time (`what` waited). The connection may still be fine.
    Timeout { what: &'static str },
    /// The connection to the MN is lost: reconnect (a new client).
    Disconnected,
    /// The device completed the access with an error: on RC this also moved the QP pair to
    /// the error state, so later accesses on it fail — reconnect.
    Access(WcStatus),
    /// The core's client refused (a malformed message from the MN, a full table).
    Client(ClientError),
    /// The client was shut down.
    Shutdown,
    /// The MN's connect info names another QP for `connection` than the transport connected
    /// (the MN mixed up sessions). Reconnect.
    WrongSession { connection: usize },
    /// The MN refused the connection: this CN asked for `asked` alloc chains, the MN allows at
    /// most `allowed` (`omw mn --alloc-chains`, the model's `ModelConfig::alloc_chains`).
    /// Connect asking for at most `allowed` (`verbs::Target::alloc_chains`,
    /// `model::Target::alloc_chains`).
    AllocChains { allowed: u8, asked: u8 },
    /// The transport failed (the device or the model); the source says how.
    Transport(Arc<dyn std::error::Error + Send + Sync>),
}

impl Error {
    /// Whether retrying the same operation later may succeed on this connection.
    ///
    /// ```
    /// assert!(omw_client::Error::Timeout { what: "x" }.is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::PoolEmpty | Error::QuotaExceeded | Error::Timeout { .. })
    }

    pub(crate) fn transport<E: std::error::Error + Send + Sync + 'static>(e: E) -> Error {
        Error::Transport(Arc::new(e))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Freed => f.write_str("the chunk was freed (the handle is stale)"),
            Error::OutOfChunk(e) => write!(f, "{e}"),
            Error::OutOfBuffer { start, end, len } => {
                write!(f, "bytes {start}..{end} do not fit the registered buffer of {len} bytes")
            }
            Error::Misaligned { offset } => write!(f, "atomic at offset {offset}: must be a multiple of 8"),
            Error::AtomicsUnsupported => {
                f.write_str("remote atomics are not available: the device or the MN's windows do not carry them")
            }
            Error::TooLarge { len, max } => write!(f, "{len} bytes exceed one message of the QP ({max} bytes)"),
            Error::Foreign => f.write_str("the chunk or buffer belongs to another client"),
            Error::Deregistered => f.write_str("the buffer's registration was withdrawn after a failed access"),
            Error::PoolEmpty => f.write_str("the MN has no free chunk"),
            Error::QuotaExceeded => f.write_str("this CN holds its whole quota"),
            Error::Refused(c) => write!(f, "the MN refused: {c:?}"),
            Error::Revoked => f.write_str("the MN revoked every allocation (RNIC reset)"),
            Error::Timeout { what } => write!(f, "timed out waiting for {what}"),
            Error::Disconnected => f.write_str("the connection to the MN is lost"),
            Error::Access(s) => write!(f, "the access failed: {s}"),
            Error::Client(e) => write!(f, "{e}"),
            Error::Shutdown => f.write_str("the client was shut down"),
            Error::WrongSession { connection } => {
                write!(f, "the MN's connect info names another QP for connection {connection} than rdma_cm connected")
            }
            Error::AllocChains { allowed, asked } => {
                write!(f, "this CN asked for {asked} alloc chains, the MN allows at most {allowed}")
            }
            Error::Transport(e) => write!(f, "transport: {e}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Transport(e) => Some(&**e),
            _ => None,
        }
    }
}

impl From<OutOfChunk> for Error {
    fn from(e: OutOfChunk) -> Self {
        Error::OutOfChunk(e)
    }
}

impl PartialEq for Error {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Error::Transport(a), Error::Transport(b)) => Arc::ptr_eq(a, b),
            (Error::OutOfChunk(a), Error::OutOfChunk(b)) => a == b,
            (Error::OutOfBuffer { start: a, end: b, len: c }, Error::OutOfBuffer { start: x, end: y, len: z }) => {
                (a, b, c) == (x, y, z)
            }
            (Error::Misaligned { offset: a }, Error::Misaligned { offset: b }) => a == b,
            (Error::TooLarge { len: a, max: b }, Error::TooLarge { len: x, max: y }) => (a, b) == (x, y),
            (Error::Refused(a), Error::Refused(b)) => a == b,
            (Error::Timeout { what: a }, Error::Timeout { what: b }) => a == b,
            (Error::Access(a), Error::Access(b)) => a == b,
            (Error::Client(a), Error::Client(b)) => a == b,
            (Error::WrongSession { connection: a }, Error::WrongSession { connection: b }) => a == b,
            (Error::AllocChains { allowed: a, asked: b }, Error::AllocChains { allowed: x, asked: y }) => {
                (a, b) == (x, y)
            }
            _ => core::mem::discriminant(self) == core::mem::discriminant(other),
        }
    }
}
