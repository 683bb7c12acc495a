//! Wire messages between CNs and the MN, as documented byte layouts (little-endian).
//!
//! Requests are scattered by the MN NIC's RECV straight into chain WQE fields, so their field
//! order is fixed by the chains, and every decoder here treats its input as hostile: a typed
//! error for every malformed input, never a panic.
//!
//! Every message starts with the same 8-byte header:
//! ```text
//! off len field
//!   0  2  magic   0x4D4F ("OM")
//!   2  1  version 1
//!   3  1  kind    see [`Kind`]
//!   4  4  token   chosen by the CN, echoed in replies (alloc: as the WRITE's immediate)
//! ```

use crate::ids::{CnId, Qpn, Rkey};
use crate::wire::mwtable::MwTableEntry;
use core::fmt;
use zerocopy::little_endian::{U16, U32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const MAGIC: u16 = 0x4D4F;
pub const VERSION: u8 = 1;
pub const HEADER_LEN: usize = header::LEN;
/// Access windows a request can name: G − 1 for the largest G.
pub const MAX_ACCESS_QPS: usize = crate::geometry::MAX_GROUP_SIZE - 1;
/// Bytes of the longest message: what a CN's receive slot and the MN's send buffer hold.
pub const MAX_MESSAGE_LEN: usize = 64;

/// Byte offsets of the header every message starts with.
pub mod header {
    pub const MAGIC: usize = 0;
    pub const VERSION: usize = 2;
    pub const KIND: usize = 3;
    pub const TOKEN: usize = 4;
    pub const LEN: usize = 8;
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[repr(u8)]
pub enum Kind {
    AllocRequest = 1,
    AllocReply = 2,
    FreeRequest = 3,
    Empty = 4,
    Available = 5,
    Error = 6,
    ConnectInfo = 7,
    /// The MN's lease probe (MN → CN, `hdr | sequence u64`): the transport's ACK proves the
    /// CN's host is alive and the CN keeps receives posted; a probe that fails (retry or RNR
    /// budget exhausted) gets the CN reclaimed.
    Probe = 8,
    /// One of the CN's windows was invalidated by someone else (soft-RoCE: a SEND_WITH_INV
    /// from any QP) and the MN bound it again under a new key ([`Rebound`]).
    Rebound = 9,
    /// One of the CN's alloc chains found the free queue empty while popping ahead and is
    /// parked until "available" (`Notice::ChainParked`); its other chains still serve.
    ChainParked = 10,
    /// The MN took one of the CN's allocations back while the CN stays connected
    /// ([`TakenBack`]).
    TakenBack = 11,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::AllocRequest,
            2 => Kind::AllocReply,
            3 => Kind::FreeRequest,
            4 => Kind::Empty,
            5 => Kind::Available,
            6 => Kind::Error,
            7 => Kind::ConnectInfo,
            8 => Kind::Probe,
            9 => Kind::Rebound,
            10 => Kind::ChainParked,
            11 => Kind::TakenBack,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct Header {
    pub magic: U16,
    pub version: u8,
    pub kind: u8,
    pub token: U32,
}

const _: () = assert!(core::mem::offset_of!(Header, magic) == header::MAGIC);
const _: () = assert!(core::mem::offset_of!(Header, version) == header::VERSION);
const _: () = assert!(core::mem::offset_of!(Header, kind) == header::KIND);
const _: () = assert!(core::mem::offset_of!(Header, token) == header::TOKEN);
const _: () = assert!(core::mem::size_of::<Header>() == header::LEN);

impl Header {
    pub fn new(kind: Kind, token: u32) -> Self {
        Header { magic: U16::new(MAGIC), version: VERSION, kind: kind as u8, token: U32::new(token) }
    }
    /// The header's bytes at the start of `out` (at least [`HEADER_LEN`] bytes: every caller
    /// passes a message's fixed-size image).
    fn put(self, out: &mut [u8]) {
        out[..header::LEN].copy_from_slice(self.as_bytes());
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum WireError {
    Truncated {
        need: usize,
        got: usize,
    },
    TrailingBytes {
        expected: usize,
        got: usize,
    },
    BadMagic(u16),
    BadVersion(u8),
    UnknownKind(u8),
    UnexpectedKind {
        expected: Kind,
        got: Kind,
    },
    BadQpn(u32),
    BadCnId,
    BadGroupSize(u8),
    /// A reply whose entry is inconsistent (zero length, an owner that is not us, …).
    InconsistentReply,
    UnknownErrorCode(u32),
    /// A rebound notice naming a window index past the largest group, no entry, or with
    /// its reserved bytes set.
    BadRebound,
    /// A chain-parked notice naming an alloc chain past [`MAX_ALLOC_CHAINS`].
    BadChain(u64),
    /// A taken-back notice naming no entry, or with its reserved bytes set.
    BadTakenBack,
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Truncated { need, got } => {
                write!(f, "message truncated: need {need} bytes, got {got}")
            }
            Self::TrailingBytes { expected, got } => {
                write!(f, "message has {got} bytes, expected {expected}")
            }
            Self::BadMagic(m) => write!(f, "bad magic {m:#06x}"),
            Self::BadVersion(v) => write!(f, "unsupported protocol version {v}"),
            Self::UnknownKind(k) => write!(f, "unknown message kind {k}"),
            Self::UnexpectedKind { expected, got } => {
                write!(f, "expected a {expected:?} message, got {got:?}")
            }
            Self::BadQpn(q) => write!(f, "QP number {q:#x} exceeds 24 bits"),
            Self::BadCnId => f.write_str("CN id 0 is reserved"),
            Self::BadGroupSize(g) => write!(f, "MW group size {g} is not supported"),
            Self::InconsistentReply => f.write_str("allocation reply is internally inconsistent"),
            Self::UnknownErrorCode(c) => write!(f, "unknown error code {c}"),
            Self::BadRebound => f.write_str("rebound notice names no window"),
            Self::BadChain(c) => write!(f, "chain-parked notice names alloc chain {c}, past the largest"),
            Self::BadTakenBack => f.write_str("taken-back notice names no allocation"),
        }
    }
}

/// Parse and check the header; returns its kind and token.
pub fn parse_header(bytes: &[u8]) -> Result<(Kind, u32), WireError> {
    let (h, _) =
        Header::read_from_prefix(bytes).map_err(|_| WireError::Truncated { need: HEADER_LEN, got: bytes.len() })?;
    if h.magic.get() != MAGIC {
        return Err(WireError::BadMagic(h.magic.get()));
    }
    if h.version != VERSION {
        return Err(WireError::BadVersion(h.version));
    }
    let kind = Kind::from_u8(h.kind).ok_or(WireError::UnknownKind(h.kind))?;
    Ok((kind, h.token.get()))
}

fn expect(bytes: &[u8], kind: Kind, len: usize) -> Result<u32, WireError> {
    let (k, token) = parse_header(bytes)?;
    if k != kind {
        return Err(WireError::UnexpectedKind { expected: kind, got: k });
    }
    if bytes.len() < len {
        return Err(WireError::Truncated { need: len, got: bytes.len() });
    }
    if bytes.len() > len {
        return Err(WireError::TrailingBytes { expected: len, got: bytes.len() });
    }
    Ok(token)
}

// Field access at a named offset; the decoders call them only after `expect` checked the length,
// the encoders only on their own fixed-size images.
fn le32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}
fn le64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}
fn put32(out: &mut [u8], off: usize, v: u32) {
    out[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put64(out: &mut [u8], off: usize, v: u64) {
    out[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// A request as it arrived, read field by field before anything judged it (smoltcp's
/// `Packet<T>` view): the MN quotes a request's token in a refusal, and names the entry a free
/// request gives back, while the lap checks the rest. [`AllocRequest::decode`] and
/// [`FreeRequest::decode`] are the decoders that judge.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Request<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Request<T> {
    /// A view of `buffer` if it is long enough to carry a header (nothing else is checked).
    pub fn new_checked(buffer: T) -> Result<Self, WireError> {
        let got = buffer.as_ref().len();
        if got < header::LEN {
            return Err(WireError::Truncated { need: header::LEN, got });
        }
        Ok(Request { buffer })
    }
    /// The token the CN chose (header offset [`header::TOKEN`]).
    pub fn token(&self) -> u32 {
        le32(self.buffer.as_ref(), header::TOKEN)
    }
    /// The MWTable entry address a free request names, if the bytes reach that far.
    pub fn free_entry_addr(&self) -> Option<u64> {
        let b = self.buffer.as_ref();
        (b.len() >= free_request::ENTRY_ADDR + 8).then(|| le64(b, free_request::ENTRY_ADDR))
    }
    pub fn into_inner(self) -> T {
        self.buffer
    }
}

impl<const N: usize> Request<[u8; N]> {
    /// A view of a request image of a fixed size; one shorter than a header does not compile.
    pub const fn from_array(buffer: [u8; N]) -> Self {
        const { assert!(N >= header::LEN) };
        Request { buffer }
    }
}

/// Byte offsets of the alloc request (the alloc chain's RECV scatter follows them).
pub mod alloc_request {
    pub const TOKEN: usize = super::header::TOKEN;
    pub const REPLY_ADDR: usize = 8;
    pub const REPLY_RKEY: usize = 16;
    pub const QPNS: usize = 20;
    /// Where the MN-side QP number of access window `i + 1` lies.
    pub const fn qpn(i: usize) -> usize {
        QPNS + 4 * i
    }
    pub const fn len(access_windows: usize) -> usize {
        qpn(access_windows)
    }
}

/// `hdr | reply_addr u64 | reply_rkey u32 | qpn u32 × (G−1)`: the MN-side QP numbers of the
/// CN's access QPs the windows MW[1..G) are to be bound to, and where to WRITE the reply.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct AllocRequest {
    pub token: u32,
    pub reply_addr: u64,
    pub reply_rkey: u32,
    pub access_qpns: heapless::Vec<Qpn, MAX_ACCESS_QPS>,
}

impl AllocRequest {
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, WireError> {
        let len = alloc_request::len(self.access_qpns.len());
        if out.len() < len {
            return Err(WireError::Truncated { need: len, got: out.len() });
        }
        Header::new(Kind::AllocRequest, self.token).put(out);
        put64(out, alloc_request::REPLY_ADDR, self.reply_addr);
        put32(out, alloc_request::REPLY_RKEY, self.reply_rkey);
        for (i, q) in self.access_qpns.iter().enumerate() {
            put32(out, alloc_request::qpn(i), q.get());
        }
        Ok(len)
    }
    /// Decode for a pool whose groups have `access_windows` access windows.
    pub fn decode(bytes: &[u8], access_windows: usize) -> Result<Self, WireError> {
        if access_windows == 0 || access_windows > MAX_ACCESS_QPS {
            return Err(WireError::BadGroupSize(access_windows as u8 + 1));
        }
        let token = expect(bytes, Kind::AllocRequest, alloc_request::len(access_windows))?;
        let mut access_qpns = heapless::Vec::new();
        for i in 0..access_windows {
            let v = le32(bytes, alloc_request::qpn(i));
            let q = Qpn::new(v).map_err(|_| WireError::BadQpn(v))?;
            let pushed = access_qpns.push(q);
            debug_assert!(pushed.is_ok(), "access_windows <= MAX_ACCESS_QPS, checked above");
        }
        Ok(AllocRequest {
            token,
            reply_addr: le64(bytes, alloc_request::REPLY_ADDR),
            reply_rkey: le32(bytes, alloc_request::REPLY_RKEY),
            access_qpns,
        })
    }
}

/// Byte offsets of the free request (the free chain's RECV scatter follows them).
pub mod free_request {
    pub const TOKEN: usize = super::header::TOKEN;
    pub const ENTRY_ADDR: usize = 8;
    pub const LEN: usize = 16;
}

/// `hdr | entry_addr u64`: the MWTable entry of the group to return.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct FreeRequest {
    pub token: u32,
    pub entry_addr: u64,
}

impl FreeRequest {
    pub fn encode(&self) -> [u8; free_request::LEN] {
        let mut out = [0u8; free_request::LEN];
        Header::new(Kind::FreeRequest, self.token).put(&mut out);
        put64(&mut out, free_request::ENTRY_ADDR, self.entry_addr);
        out
    }
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let token = expect(bytes, Kind::FreeRequest, free_request::LEN)?;
        Ok(FreeRequest { token, entry_addr: le64(bytes, free_request::ENTRY_ADDR) })
    }
}

/// Byte offsets of the alloc reply (the alloc chain builds it in scratch, `alloc_scratch::REPLY`).
pub mod alloc_reply {
    pub const ENTRY_ADDR: usize = 8;
    pub const ENTRY: usize = 16;
    pub const LEN: usize = ENTRY + crate::wire::mwtable::ENTRY_SIZE;
}

/// `hdr | entry_addr u64 | MWTable entry (56 B)`: written by the alloc chain's reply WRITE.
/// The token travels as the immediate; the header's token field carries the MN's pool
/// generation instead ([`AllocReply::generation`]).
pub const ALLOC_REPLY_LEN: usize = alloc_reply::LEN;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct AllocReply {
    pub entry_addr: u64,
    pub entry: MwTableEntry,
    /// The MN's pool generation the group was handed out in: an RNIC reset revokes every
    /// allocation and starts the next one, announced by a `Revoked` error reply whose
    /// `detail` is the new generation. The notice and the replies travel on different QPs
    /// (offloaded: the first access QP and the alloc chains' own), so a CN may see a reply of
    /// the new generation before the notice, or one of the old after it: the generation says
    /// which allocations the notice revokes. The MN writes it into the reply image's header
    /// when it arms a chain; the chain never touches it.
    pub generation: u32,
}

impl AllocReply {
    pub fn encode(&self) -> [u8; ALLOC_REPLY_LEN] {
        let mut out = [0u8; ALLOC_REPLY_LEN];
        Header::new(Kind::AllocReply, self.generation).put(&mut out);
        put64(&mut out, alloc_reply::ENTRY_ADDR, self.entry_addr);
        out[alloc_reply::ENTRY..].copy_from_slice(self.entry.as_bytes());
        out
    }
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        expect(bytes, Kind::AllocReply, ALLOC_REPLY_LEN)?;
        let entry = MwTableEntry::read(&bytes[alloc_reply::ENTRY..])
            .ok_or(WireError::Truncated { need: ALLOC_REPLY_LEN, got: bytes.len() })?;
        Ok(AllocReply {
            entry_addr: le64(bytes, alloc_reply::ENTRY_ADDR),
            entry,
            generation: le32(bytes, header::TOKEN),
        })
    }
    /// The reply header image the MN pre-writes into the alloc scratch area, for pool
    /// generation `generation`.
    pub fn header_image(generation: u32) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        Header::new(Kind::AllocReply, generation).put(&mut h);
        h
    }
}

/// Most alloc chains one CN may have (`mn::MnConfig::alloc_chains`): a chain-parked notice
/// naming one at or past it is refused.
pub const MAX_ALLOC_CHAINS: usize = 4;

/// MN → CN notices about the free queue (`hdr | value u64`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Notice {
    /// The free queue is empty for this CN: every alloc chain of it is parked until
    /// [`Notice::Available`].
    Empty,
    /// Alloc chain `chain` of this CN (0: the one on its first Alloc QP) found the queue empty
    /// while popping ahead (`chain::alloc`) and is parked until [`Notice::Available`]; the
    /// CN's other chains may still hold a group popped ahead, so only a request on this chain
    /// would wait. With several alloc chains a CN cannot tell this from "empty" otherwise
    /// (`MemoryNode` sends [`Notice::Empty`] once every chain of the CN is parked).
    ChainParked {
        chain: u8,
    },
    Available {
        free_groups: u64,
    },
    /// Lease probe; the CN needs do nothing but keep receives posted.
    Probe {
        seq: u64,
    },
}
/// Byte offsets of a notice.
pub mod notice {
    /// The free groups (available), the sequence number (probe), the alloc chain (chain
    /// parked); zero for empty.
    pub const VALUE: usize = 8;
    pub const LEN: usize = 16;
}
pub const NOTICE_LEN: usize = notice::LEN;

impl Notice {
    pub fn encode(&self) -> [u8; NOTICE_LEN] {
        let (k, n) = match *self {
            Notice::Empty => (Kind::Empty, 0),
            Notice::ChainParked { chain } => (Kind::ChainParked, chain as u64),
            Notice::Available { free_groups } => (Kind::Available, free_groups),
            Notice::Probe { seq } => (Kind::Probe, seq),
        };
        let mut out = [0u8; NOTICE_LEN];
        Header::new(k, 0).put(&mut out);
        put64(&mut out, notice::VALUE, n);
        out
    }
}

/// MN → CN: window MW\[`mw`\] of the allocation whose MWTable entry is at `entry_addr` was
/// invalidated behind the CN's back (on soft-RoCE any QP's SEND_WITH_INV revokes a window) and
/// the MN bound it again, over the same chunk and to the same QP, under `rkey` (the same window
/// index, the next key byte). The CN's chunk and bytes are untouched; an access that failed
/// with the old key may be retried with this one.
///
/// ```text
///   0  8 hdr (token 0)
///   8  8 entry address
///  16  4 new rkey of the window
///  20  1 window index in the group (0: MW[0] on the Free QP; i ≥ 1: access QP i − 1)
///  21  3 reserved, zero
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Rebound {
    pub entry_addr: u64,
    pub mw: u8,
    pub rkey: Rkey,
}
/// Byte offsets of a rebound notice.
pub mod rebound {
    pub const ENTRY_ADDR: usize = 8;
    pub const RKEY: usize = 16;
    pub const MW: usize = 20;
    pub const RESERVED: usize = 21;
    pub const LEN: usize = 24;
}
pub const REBOUND_LEN: usize = rebound::LEN;

impl Rebound {
    pub fn encode(&self) -> [u8; REBOUND_LEN] {
        let mut out = [0u8; REBOUND_LEN];
        Header::new(Kind::Rebound, 0).put(&mut out);
        put64(&mut out, rebound::ENTRY_ADDR, self.entry_addr);
        put32(&mut out, rebound::RKEY, self.rkey.0);
        out[rebound::MW] = self.mw;
        out
    }
    /// Hostile input: exact length, a window index inside the largest group, an entry
    /// address, zero reserved bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        expect(bytes, Kind::Rebound, REBOUND_LEN)?;
        let r = Rebound {
            entry_addr: le64(bytes, rebound::ENTRY_ADDR),
            rkey: Rkey(le32(bytes, rebound::RKEY)),
            mw: bytes[rebound::MW],
        };
        let reserved = &bytes[rebound::RESERVED..rebound::LEN];
        if r.entry_addr == 0 || r.mw as usize >= crate::geometry::MAX_GROUP_SIZE || reserved.iter().any(|b| *b != 0) {
            return Err(WireError::BadRebound);
        }
        Ok(r)
    }
}

/// MN → CN: the MN took the allocation whose MWTable entry is at `entry_addr` back from this
/// CN while the CN stays connected — its windows are invalidated, its chunk scrubbed and
/// returned to the free queue. Sent wherever the MN reclaims a single group of a connected
/// CN: a window the audit found bound elsewhere or spanning outside its chunk, a window that
/// could not be bound again for its owner (host engine), and an alloc lap the MN stopped and
/// undid — which may already have delivered its reply (the commit clears the lap's markers
/// only after the reply completed), so without this notice the CN would hold a group it no
/// longer has. `owner_rkey` is MW\[0\]'s key as the CN was given it: a later allocation of
/// the same group has other keys, so a notice that arrives late (it travels on another QP than
/// the alloc reply) never takes a newer allocation away. A CN that does not hold it ignores it.
///
/// ```text
///   0  8 hdr (token 0)
///   8  8 entry address
///  16  4 MW[0]'s rkey as the CN was given it
///  20  4 reserved, zero
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct TakenBack {
    pub entry_addr: u64,
    pub owner_rkey: Rkey,
}
/// Byte offsets of a taken-back notice.
pub mod taken_back {
    pub const ENTRY_ADDR: usize = 8;
    pub const OWNER_RKEY: usize = 16;
    pub const RESERVED: usize = 20;
    pub const LEN: usize = 24;
}
pub const TAKEN_BACK_LEN: usize = taken_back::LEN;

impl TakenBack {
    pub fn encode(&self) -> [u8; TAKEN_BACK_LEN] {
        let mut out = [0u8; TAKEN_BACK_LEN];
        Header::new(Kind::TakenBack, 0).put(&mut out);
        put64(&mut out, taken_back::ENTRY_ADDR, self.entry_addr);
        put32(&mut out, taken_back::OWNER_RKEY, self.owner_rkey.0);
        out
    }
    /// Hostile input: exact length, an entry address, zero reserved bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        expect(bytes, Kind::TakenBack, TAKEN_BACK_LEN)?;
        let t = TakenBack {
            entry_addr: le64(bytes, taken_back::ENTRY_ADDR),
            owner_rkey: Rkey(le32(bytes, taken_back::OWNER_RKEY)),
        };
        if t.entry_addr == 0 || bytes[taken_back::RESERVED..taken_back::LEN].iter().any(|b| *b != 0) {
            return Err(WireError::BadTakenBack);
        }
        Ok(t)
    }
}

/// Why the MN refused a request (`hdr | code u32 | detail u32`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[repr(u32)]
#[non_exhaustive]
pub enum ErrorCode {
    /// The free queue was empty; wait for "available".
    Empty = 1,
    /// A free named a group the caller does not own.
    NotOwner = 2,
    /// A request could not be parsed or named an invalid entry / QP.
    BadRequest = 3,
    /// The CN exceeded its quota; its management QPs are disconnected.
    QuotaExceeded = 4,
    /// The allocation failed part-way (bad reply buffer, bind refused); nothing was allocated.
    AllocFailed = 5,
    /// The MN revoked every allocation (its RNIC was reset); reconnect and allocate again.
    Revoked = 6,
}

impl ErrorCode {
    fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => ErrorCode::Empty,
            2 => ErrorCode::NotOwner,
            3 => ErrorCode::BadRequest,
            4 => ErrorCode::QuotaExceeded,
            5 => ErrorCode::AllocFailed,
            6 => ErrorCode::Revoked,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ErrorReply {
    pub token: u32,
    pub code: ErrorCode,
    pub detail: u32,
}
/// Byte offsets of an error reply.
pub mod error_reply {
    pub const CODE: usize = 8;
    pub const DETAIL: usize = 12;
    pub const LEN: usize = 16;
}
pub const ERROR_REPLY_LEN: usize = error_reply::LEN;

impl ErrorReply {
    pub fn encode(&self) -> [u8; ERROR_REPLY_LEN] {
        let mut out = [0u8; ERROR_REPLY_LEN];
        Header::new(Kind::Error, self.token).put(&mut out);
        put32(&mut out, error_reply::CODE, self.code as u32);
        put32(&mut out, error_reply::DETAIL, self.detail);
        out
    }
}

/// MN → CN at connection: who the CN is and which MN-side QPs serve it.
///
/// ```text
///   0  8 hdr
///   8  4 cn id
///  12  1 group size G
///  13  1 flags (see [`ConnectFlags`]; unknown bits ignored)
///  14  2 reserved
///  16  8 chunk size
///  24  4 MN end of the Alloc QP
///  28  4 MN end of the Free QP
///  32 12 MN ends of the access QPs (G−1 used)
///  44  4 quota (groups)
/// ```
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ConnectInfo {
    pub cn: CnId,
    pub group_size: u8,
    pub chunk_size: u64,
    pub alloc_qpn: Qpn,
    pub free_qpn: Qpn,
    pub access_qpns: heapless::Vec<Qpn, MAX_ACCESS_QPS>,
    pub quota: u32,
    /// What the CN's data windows grant beyond READ and WRITE.
    pub flags: ConnectFlags,
}

bitflags::bitflags! {
    /// The connect info's flags byte: what the MN's data windows let the CN do beyond READ and
    /// WRITE. An MN that predates a flag sends it clear, so a CN never assumes a right the MN
    /// did not grant.
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
    pub struct ConnectFlags: u8 {
        /// The access windows are bound with REMOTE_ATOMIC: 8-byte compare-and-swap and
        /// fetch-and-add on the chunk work. Clear where the device cannot carry atomics through
        /// a type-2 window (ConnectX: DESIGN.md §6.4) — an atomic there would fail with
        /// REM_ACCESS_ERR and break the CN's access QP, so the CN refuses it before posting.
        const WINDOW_ATOMICS = 1 << 0;
        /// Every window is bound to the MN end of the CN's Alloc QP (the MN's chains bind only
        /// to the QP that posts the bind, `ChainVariant::binds_to_poster`): the CN reaches its
        /// windows through its Alloc QP, and `access_qpns` all name that QP's MN end. An MN
        /// that predates the flag never sets it, and binds where the request names.
        const WINDOWS_ON_ALLOC_QP = 1 << 1;
    }
}

/// Byte offsets of the connect info.
pub mod connect_info {
    pub const CN: usize = 8;
    pub const GROUP_SIZE: usize = 12;
    pub const FLAGS: usize = 13;
    pub const CHUNK_SIZE: usize = 16;
    pub const ALLOC_QPN: usize = 24;
    pub const FREE_QPN: usize = 28;
    pub const ACCESS_QPNS: usize = 32;
    pub const QUOTA: usize = 44;
    pub const LEN: usize = 48;
    /// Where the MN end of access QP `i` lies.
    pub const fn access_qpn(i: usize) -> usize {
        ACCESS_QPNS + 4 * i
    }
    const _: () = assert!(access_qpn(super::MAX_ACCESS_QPS) == QUOTA);
}
pub const CONNECT_INFO_LEN: usize = connect_info::LEN;

// (an alloc reply is not a message: it is WRITTEN into the CN's reply buffer, whose size is
// the CN's `CnMemory::REPLY_LEN`)
const _: () = assert!(
    alloc_request::len(MAX_ACCESS_QPS) <= MAX_MESSAGE_LEN
        && free_request::LEN <= MAX_MESSAGE_LEN
        && NOTICE_LEN <= MAX_MESSAGE_LEN
        && REBOUND_LEN <= MAX_MESSAGE_LEN
        && ERROR_REPLY_LEN <= MAX_MESSAGE_LEN
        && CONNECT_INFO_LEN <= MAX_MESSAGE_LEN
);

impl ConnectInfo {
    pub fn encode(&self) -> [u8; CONNECT_INFO_LEN] {
        use connect_info as o;
        let mut out = [0u8; CONNECT_INFO_LEN];
        Header::new(Kind::ConnectInfo, 0).put(&mut out);
        put32(&mut out, o::CN, self.cn.get());
        out[o::GROUP_SIZE] = self.group_size;
        out[o::FLAGS] = self.flags.bits();
        put64(&mut out, o::CHUNK_SIZE, self.chunk_size);
        put32(&mut out, o::ALLOC_QPN, self.alloc_qpn.get());
        put32(&mut out, o::FREE_QPN, self.free_qpn.get());
        for (i, q) in self.access_qpns.iter().enumerate() {
            put32(&mut out, o::access_qpn(i), q.get());
        }
        put32(&mut out, o::QUOTA, self.quota);
        out
    }
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        use connect_info as o;
        expect(bytes, Kind::ConnectInfo, CONNECT_INFO_LEN)?;
        let cn = CnId::new(le32(bytes, o::CN)).map_err(|_| WireError::BadCnId)?;
        let g = bytes[o::GROUP_SIZE];
        if (g as usize) < crate::geometry::MIN_GROUP_SIZE || g as usize > crate::geometry::MAX_GROUP_SIZE {
            return Err(WireError::BadGroupSize(g));
        }
        let qpn = |off| {
            let v = le32(bytes, off);
            Qpn::new(v).map_err(|_| WireError::BadQpn(v))
        };
        let mut access_qpns = heapless::Vec::new();
        for i in 0..(g as usize - 1) {
            let pushed = access_qpns.push(qpn(o::access_qpn(i))?);
            debug_assert!(pushed.is_ok(), "G - 1 <= MAX_GROUP_SIZE - 1 = MAX_ACCESS_QPS, checked above");
        }
        Ok(ConnectInfo {
            cn,
            group_size: g,
            chunk_size: le64(bytes, o::CHUNK_SIZE),
            alloc_qpn: qpn(o::ALLOC_QPN)?,
            free_qpn: qpn(o::FREE_QPN)?,
            access_qpns,
            quota: le32(bytes, o::QUOTA),
            flags: ConnectFlags::from_bits_truncate(bytes[o::FLAGS]),
        })
    }
}

/// Any MN → CN message (notices, errors, connect info). They arrive on the CN's **first access
/// QP**: the MN ends of the Alloc and Free QPs carry the chains on their send queues, while an
/// access QP's MN-side send queue is otherwise idle (the MN is only the responder there). The
/// alloc reply itself is a WRITE_WITH_IMM on the Alloc QP.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum MnMessage {
    Notice(Notice),
    Error(ErrorReply),
    ConnectInfo(ConnectInfo),
    Rebound(Rebound),
    TakenBack(TakenBack),
}

impl MnMessage {
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let (kind, token) = parse_header(bytes)?;
        match kind {
            Kind::Empty | Kind::Available | Kind::Probe | Kind::ChainParked => {
                expect(bytes, kind, NOTICE_LEN)?;
                Ok(MnMessage::Notice(match kind {
                    Kind::Empty => Notice::Empty,
                    Kind::ChainParked => {
                        let v = le64(bytes, notice::VALUE);
                        match u8::try_from(v) {
                            Ok(chain) if (chain as usize) < MAX_ALLOC_CHAINS => Notice::ChainParked { chain },
                            _ => return Err(WireError::BadChain(v)),
                        }
                    }
                    Kind::Available => Notice::Available { free_groups: le64(bytes, notice::VALUE) },
                    _ => Notice::Probe { seq: le64(bytes, notice::VALUE) },
                }))
            }
            Kind::Error => {
                expect(bytes, kind, ERROR_REPLY_LEN)?;
                let c = le32(bytes, error_reply::CODE);
                let code = ErrorCode::from_u32(c).ok_or(WireError::UnknownErrorCode(c))?;
                Ok(MnMessage::Error(ErrorReply { token, code, detail: le32(bytes, error_reply::DETAIL) }))
            }
            Kind::ConnectInfo => Ok(MnMessage::ConnectInfo(ConnectInfo::decode(bytes)?)),
            Kind::Rebound => Ok(MnMessage::Rebound(Rebound::decode(bytes)?)),
            Kind::TakenBack => Ok(MnMessage::TakenBack(TakenBack::decode(bytes)?)),
            other => Err(WireError::UnexpectedKind { expected: Kind::Empty, got: other }),
        }
    }
}

/// Rkeys of an entry for the given group size (MW\[0\] first).
pub fn entry_rkeys(e: &MwTableEntry, g: usize) -> heapless::Vec<Rkey, { crate::geometry::MAX_GROUP_SIZE }> {
    (0..g.min(crate::geometry::MAX_GROUP_SIZE)).map(|i| e.rkey(i)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn req(n: usize) -> AllocRequest {
        AllocRequest {
            token: 0xABCD,
            reply_addr: 0x7000,
            reply_rkey: 0x1234,
            access_qpns: (0..n).map(|i| Qpn::new(0x40 + i as u32).unwrap()).collect(),
        }
    }

    #[test]
    fn alloc_request_round_trip_and_offsets() {
        let r = req(2);
        let mut b = [0u8; 64];
        let n = r.encode(&mut b).unwrap();
        assert_eq!(n, 28);
        assert_eq!(&b[0..2], &MAGIC.to_le_bytes());
        assert_eq!(&b[alloc_request::TOKEN..alloc_request::TOKEN + 4], &0xABCDu32.to_le_bytes());
        assert_eq!(&b[alloc_request::REPLY_ADDR..alloc_request::REPLY_ADDR + 8], &0x7000u64.to_le_bytes());
        assert_eq!(AllocRequest::decode(&b[..n], 2), Ok(r));
        assert_eq!(AllocRequest::decode(&b[..n - 1], 2), Err(WireError::Truncated { need: 28, got: 27 }));
        assert_eq!(AllocRequest::decode(&b[..n + 1], 2), Err(WireError::TrailingBytes { expected: 28, got: 29 }));
        let mut bad = b;
        bad[20..24].copy_from_slice(&0x0100_0000u32.to_le_bytes());
        assert_eq!(AllocRequest::decode(&bad[..n], 2), Err(WireError::BadQpn(0x0100_0000)));
    }

    #[test]
    fn request_view_reads_unjudged_fields() {
        let f = FreeRequest { token: 0x0102_0304, entry_addr: 0x2028 }.encode();
        let v = Request::from_array(f);
        assert_eq!((v.token(), v.free_entry_addr()), (0x0102_0304, Some(0x2028)));
        // the view judges nothing but its length: a garbled header still has a token
        let mut bad = f;
        bad[0] = 0;
        assert_eq!(Request::new_checked(&bad[..]).map(|r| r.token()), Ok(0x0102_0304));
        // an alloc request's bytes are too short for an entry address only below 16 bytes
        assert_eq!(Request::new_checked(&f[..12]).map(|r| r.free_entry_addr()), Ok(None));
        assert_eq!(Request::new_checked(&f[..7]), Err(WireError::Truncated { need: 8, got: 7 }));
        assert_eq!(Request::new_checked(&f[..]).map(|r| r.into_inner().len()), Ok(16));
    }

    #[test]
    fn header_errors() {
        let f = FreeRequest { token: 9, entry_addr: 0x1000 }.encode();
        assert_eq!(FreeRequest::decode(&f), Ok(FreeRequest { token: 9, entry_addr: 0x1000 }));
        let mut b = f;
        b[0] = 0;
        assert!(matches!(FreeRequest::decode(&b), Err(WireError::BadMagic(_))));
        let mut b = f;
        b[2] = 9;
        assert_eq!(FreeRequest::decode(&b), Err(WireError::BadVersion(9)));
        let mut b = f;
        b[3] = 99;
        assert_eq!(FreeRequest::decode(&b), Err(WireError::UnknownKind(99)));
        assert_eq!(FreeRequest::decode(&f[..3]), Err(WireError::Truncated { need: 8, got: 3 }));
        assert_eq!(
            AllocRequest::decode(&f, 1),
            Err(WireError::UnexpectedKind { expected: Kind::AllocRequest, got: Kind::FreeRequest })
        );
    }

    /// A chain-parked notice naming a chain no CN can have is refused, whatever its other bytes.
    #[test]
    fn a_chain_parked_notice_names_a_chain_that_can_exist() {
        let mut b = Notice::ChainParked { chain: 0 }.encode();
        for v in [MAX_ALLOC_CHAINS as u64, 255, 256, u64::MAX] {
            b[notice::VALUE..notice::VALUE + 8].copy_from_slice(&v.to_le_bytes());
            assert_eq!(MnMessage::decode(&b), Err(WireError::BadChain(v)));
        }
        assert!(matches!(MnMessage::decode(&b[..NOTICE_LEN - 1]), Err(WireError::Truncated { .. })));
    }

    #[test]
    fn replies_notices_errors_connect() {
        let e = MwTableEntry::new(0x1000, 512, 3, &[Rkey(0x100), Rkey(0x200)]);
        let r = AllocReply { entry_addr: 0x2000, entry: e, generation: 7 };
        assert_eq!(AllocReply::decode(&r.encode()), Ok(r));
        assert_eq!(&r.encode()[..8], &AllocReply::header_image(7));
        for n in [
            Notice::Empty,
            Notice::Available { free_groups: 7 },
            Notice::Probe { seq: 9 },
            Notice::ChainParked { chain: 0 },
            Notice::ChainParked { chain: MAX_ALLOC_CHAINS as u8 - 1 },
        ] {
            assert_eq!(MnMessage::decode(&n.encode()), Ok(MnMessage::Notice(n)));
        }
        let er = ErrorReply { token: 5, code: ErrorCode::NotOwner, detail: 1 };
        assert_eq!(MnMessage::decode(&er.encode()), Ok(MnMessage::Error(er)));
        let mut bad = er.encode();
        bad[8] = 77;
        assert_eq!(MnMessage::decode(&bad), Err(WireError::UnknownErrorCode(77)));
        let ci = ConnectInfo {
            cn: CnId::new(4).unwrap(),
            group_size: 3,
            chunk_size: 4096,
            alloc_qpn: Qpn::new(0x11).unwrap(),
            free_qpn: Qpn::new(0x12).unwrap(),
            access_qpns: [Qpn::new(0x13).unwrap(), Qpn::new(0x14).unwrap()].into_iter().collect(),
            quota: 10,
            flags: ConnectFlags::WINDOW_ATOMICS,
        };
        assert_eq!(MnMessage::decode(&ci.encode()), Ok(MnMessage::ConnectInfo(ci.clone())));
        assert_eq!(ci.encode()[connect_info::FLAGS], 1);
        // unknown flag bits (a newer MN) are ignored, never a refusal; a clear byte grants nothing
        let mut b = ci.encode();
        b[connect_info::FLAGS] = 0xFF;
        assert_eq!(ConnectInfo::decode(&b).map(|c| c.flags), Ok(ConnectFlags::all()));
        assert_eq!(ConnectFlags::all().bits(), 0b11);
        b[connect_info::FLAGS] = 0;
        assert_eq!(ConnectInfo::decode(&b).map(|c| c.flags), Ok(ConnectFlags::empty()));
        let mut b = ci.encode();
        b[12] = 9;
        assert_eq!(ConnectInfo::decode(&b), Err(WireError::BadGroupSize(9)));
        let mut b = ci.encode();
        b[8..12].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(ConnectInfo::decode(&b), Err(WireError::BadCnId));
    }

    #[test]
    fn rebound_round_trip_offsets_and_hostile_input() {
        let r = Rebound { entry_addr: 0x2028, mw: 2, rkey: Rkey(0x0000_0305) };
        let b = r.encode();
        assert_eq!(b.len(), REBOUND_LEN);
        assert_eq!(b[3], Kind::Rebound as u8);
        assert_eq!(&b[8..16], &0x2028u64.to_le_bytes());
        assert_eq!(&b[16..20], &0x0305u32.to_le_bytes());
        assert_eq!(b[20], 2);
        assert_eq!(MnMessage::decode(&b), Ok(MnMessage::Rebound(r)));
        assert_eq!(Rebound::decode(&b[..23]), Err(WireError::Truncated { need: 24, got: 23 }));
        let mut long = [0u8; 25];
        long[..24].copy_from_slice(&b);
        assert_eq!(Rebound::decode(&long), Err(WireError::TrailingBytes { expected: 24, got: 25 }));
        let mut bad = b;
        bad[20] = crate::geometry::MAX_GROUP_SIZE as u8;
        assert_eq!(Rebound::decode(&bad), Err(WireError::BadRebound));
        let mut bad = b;
        bad[22] = 1;
        assert_eq!(Rebound::decode(&bad), Err(WireError::BadRebound));
        let mut bad = b;
        bad[8..16].copy_from_slice(&0u64.to_le_bytes());
        assert_eq!(MnMessage::decode(&bad), Err(WireError::BadRebound));
        assert_eq!(
            Rebound::decode(&Notice::Empty.encode()),
            Err(WireError::UnexpectedKind { expected: Kind::Rebound, got: Kind::Empty })
        );
    }

    #[test]
    fn taken_back_round_trip_offsets_and_hostile_input() {
        let t = TakenBack { entry_addr: 0x2028, owner_rkey: Rkey(0x0000_0305) };
        let b = t.encode();
        assert_eq!(b.len(), TAKEN_BACK_LEN);
        assert_eq!(b[3], Kind::TakenBack as u8);
        assert_eq!(b[3], 11);
        assert_eq!(&b[8..16], &0x2028u64.to_le_bytes());
        assert_eq!(&b[16..20], &0x0305u32.to_le_bytes());
        assert_eq!(&b[20..24], &[0; 4]);
        assert_eq!(MnMessage::decode(&b), Ok(MnMessage::TakenBack(t)));
        assert_eq!(TakenBack::decode(&b[..23]), Err(WireError::Truncated { need: 24, got: 23 }));
        let mut long = [0u8; 25];
        long[..24].copy_from_slice(&b);
        assert_eq!(TakenBack::decode(&long), Err(WireError::TrailingBytes { expected: 24, got: 25 }));
        let mut bad = b;
        bad[23] = 1;
        assert_eq!(TakenBack::decode(&bad), Err(WireError::BadTakenBack));
        let mut bad = b;
        bad[8..16].copy_from_slice(&0u64.to_le_bytes());
        assert_eq!(MnMessage::decode(&bad), Err(WireError::BadTakenBack));
        assert_eq!(
            TakenBack::decode(&Notice::Empty.encode()),
            Err(WireError::UnexpectedKind { expected: Kind::TakenBack, got: Kind::Empty })
        );
    }

    proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..80), g in 0usize..6) {
            let _ = AllocRequest::decode(&bytes, g);
            let _ = FreeRequest::decode(&bytes);
            let _ = AllocReply::decode(&bytes);
            let _ = MnMessage::decode(&bytes);
            let _ = Rebound::decode(&bytes);
            let _ = TakenBack::decode(&bytes);
            let _ = parse_header(&bytes);
        }

        #[test]
        fn alloc_request_round_trips(token in any::<u32>(), addr in any::<u64>(), rkey in any::<u32>(), q in proptest::collection::vec(0u32..=0xFF_FFFF, 1..=3)) {
            let r = AllocRequest { token, reply_addr: addr, reply_rkey: rkey, access_qpns: q.iter().map(|v| Qpn::new(*v).unwrap()).collect() };
            let mut b = [0u8; 64];
            let n = r.encode(&mut b).unwrap();
            prop_assert_eq!(AllocRequest::decode(&b[..n], q.len()), Ok(r));
        }

        #[test]
        fn free_request_round_trips(token in any::<u32>(), addr in any::<u64>()) {
            let f = FreeRequest { token, entry_addr: addr };
            prop_assert_eq!(FreeRequest::decode(&f.encode()), Ok(f));
        }
    }
}
