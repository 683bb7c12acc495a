//! `CnDriver`: the CN side of every backend, over the same [`RdmaBackend`] trait the MN uses.
//!
//! [`Client`] decides what bytes mean; this moves them. It keeps buffered receives posted on
//! the two queues MN messages can arrive on (the Alloc QP — host-engine MNs send there, and
//! alloc replies, WRITE_WITH_IMM, consume its receives — and access QP 0, where an offloading
//! MN sends because no bind is ever posted on it), stages outgoing requests in a ring of send
//! slots, matches replies, notices and refusals to tokens, and runs one-sided accesses through
//! a set of I/O staging slots. Nothing here allocates; every capacity is fixed.
//!
//! The driver never blocks and never reads a clock: `now` is an argument, and
//! [`CnDriver::poll_timeout`] says when it next needs [`CnDriver::handle_timeout`] (the
//! end of an "empty" back-off, or the deadline of an unanswered allocation), so a deployment
//! loop sleeps until then and decides no protocol timing itself.
//!
//! The CN's memory is two registrations, laid out by [`CnMemory`]: a local-only region
//! (receive slots, send slots, I/O slots) — nothing the MN or another CN can reach — and the
//! reply buffer, the only thing the CN exposes remotely (REMOTE_WRITE, for the MN's reply).

use crate::cn::{Allocation, Client, ClientError, ClientEvent};
use crate::device::{Completion, QpState, RdmaBackend, WcOpcode, WcStatus};
use crate::ids::{CnId, Qpn, Rkey};
use crate::mn::MAX_ALLOC_CHAINS;
use crate::wire::message::{ConnectFlags, ErrorCode, FreeRequest, Request, ALLOC_REPLY_LEN, MAX_ACCESS_QPS};
use crate::wire::wqe::{Opcode, QueueSel, RecvWqe, Sge, Wqe};
use core::fmt;

/// Bytes per message receive slot and per send slot (every MN message and CN request fits).
pub const MSG_SLOT: u64 = 64;
/// The longest byte string the MN delivers: an alloc reply (messages fit a [`MSG_SLOT`]).
pub const DELIVERED_MAX: usize = if ALLOC_REPLY_LEN > MSG_SLOT as usize { ALLOC_REPLY_LEN } else { MSG_SLOT as usize };
/// Receives kept posted on each of the two message queues.
pub const RECVS_PER_QP: usize = 8;
/// Requests that may be in flight at once.
pub const SEND_SLOTS: usize = 16;
/// Of those, how many requests on the Alloc QP may hold at once; the rest are always left to
/// the Free QP (and raw sends on any other QP), which may also use any slot the Alloc QP does
/// not hold. A request on the Alloc QP can wait there indefinitely — the
/// MN takes no request from a CN whose allocation is parked on an empty pool until the pool
/// refills — and must never leave the CN without a slot for the free that would refill it.
/// More than [`RECVS_PER_QP`], so a CN that stops reading its replies still overruns its own
/// receives (and the MN evicts it) instead of being throttled below them.
pub const ALLOC_SEND_SLOTS: usize = SEND_SLOTS - 4;
const _: () = assert!(ALLOC_SEND_SLOTS > RECVS_PER_QP && ALLOC_SEND_SLOTS < SEND_SLOTS);
/// One-sided accesses that may be in flight at once, unless the driver's `S` says otherwise.
pub const IO_SLOTS: usize = 8;
/// Events buffered between [`CnDriver::poll`] and [`CnDriver::next_event`].
pub const EVENT_CAPACITY: usize = 32;

const MSG_AREA: u64 = 2 * RECVS_PER_QP as u64 * MSG_SLOT;
/// Message queues: the Alloc QP, access QP 0, then each extra Alloc QP (several alloc chains:
/// their replies' immediates consume receives there; no message is ever sent on them).
const QUEUES: usize = 2 + MAX_ALLOC_CHAINS - 1;
/// Receives kept posted on each extra Alloc QP: its chain's one reply in flight, and one for a
/// late reply to a request the CN gave up on.
pub const EXTRA_ALLOC_RECVS: usize = 2;

/// An allocation in flight on one of the CN's alloc chains, and when it is given up.
#[derive(Clone, Copy, Debug)]
struct AllocInFlight {
    token: u32,
    deadline: Option<u64>,
}
const SEND_AREA: u64 = SEND_SLOTS as u64 * MSG_SLOT;

// wr_id tags: a CN's completions are told apart by these, never by position
const TAG_SHIFT: u32 = 48;
const TAG_RECV: u64 = 0x4352; // "CR"
const TAG_SEND: u64 = 0x4353; // "CS"
const TAG_IO: u64 = 0x4349; // "CI"

/// One of the CN's own QPs.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum CnQp {
    Alloc,
    Free,
    Access(usize),
}

/// One of the CN's chain connections: its Alloc QP of alloc chain `j` (0: the first), or its
/// Free QP — what a rejoin replaces ([`CnDriver::replace_chain_qp`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum ChainConnection {
    Alloc(u8),
    Free,
}

/// What [`CnDriver::replace_chain_qp`] left behind: the old QP, for the caller to destroy, and
/// the allocation that was in flight on it, given up.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Replaced {
    pub old: Qpn,
    pub abandoned: Option<u32>,
}

/// The CN ends of its QPs to the MN, in the order the MN's connect info names the MN's ends.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct CnQpSet {
    pub alloc: Qpn,
    pub free: Qpn,
    /// Access QP i carries window MW[i+1]; at least one.
    pub access: heapless::Vec<Qpn, MAX_ACCESS_QPS>,
}

impl CnQpSet {
    pub fn get(&self, q: CnQp) -> Option<Qpn> {
        match q {
            CnQp::Alloc => Some(self.alloc),
            CnQp::Free => Some(self.free),
            CnQp::Access(i) => self.access.get(i).copied(),
        }
    }
    /// The queues MN messages arrive on.
    fn message_qps(&self) -> [Option<Qpn>; 2] {
        [Some(self.alloc), self.access.first().copied()]
    }
}

/// The two queues MN messages arrive on.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum MessageQueue {
    /// The Alloc QP: host-engine MNs' messages, and every alloc reply's immediate.
    Alloc = 0,
    /// Access QP 0: an offloading MN's messages.
    Access0 = 1,
}

/// Post every receive slot of one message queue before the QP is connected — with rdma_cm
/// the MN may send as soon as the connection is up — for a driver built afterwards with
/// [`CnDriver::with_primed_receives`].
pub fn prime_receives<B: RdmaBackend>(b: &mut B, mem: &CnMemory, q: MessageQueue, qp: Qpn) -> Result<(), B::Error> {
    for i in 0..RECVS_PER_QP {
        b.post_recv(qp, &recv_wqe(mem, q as usize, i))?;
    }
    Ok(())
}

fn recv_wqe(mem: &CnMemory, k: usize, i: usize) -> RecvWqe {
    let wr_id = (TAG_RECV << TAG_SHIFT) | ((k as u64) << 8) | i as u64;
    if k >= 2 {
        // an extra Alloc QP: only replies' immediates consume its receives (a WRITE_WITH_IMM
        // writes nothing there); a message sent there would not fit and errors that QP alone
        return RecvWqe::single(wr_id, Sge { addr: mem.msg_slot(0, i), length: 0, lkey: mem.lkey });
    }
    RecvWqe::single(wr_id, Sge { addr: mem.msg_slot(k, i), length: MSG_SLOT as u32, lkey: mem.lkey })
}

/// The CN's registered memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CnMemory {
    /// A LOCAL_WRITE-only registration of `local_len` bytes at `local`: receive slots, send
    /// slots, then the driver's `S` I/O slots of equal size.
    pub local: u64,
    pub local_len: u64,
    pub lkey: u32,
    /// The alloc reply buffer (at least [`CnMemory::REPLY_LEN`] bytes, REMOTE_WRITE): the only
    /// memory of the CN the MN can reach.
    pub reply: u64,
    pub reply_rkey: u32,
}

impl CnMemory {
    pub const REPLY_LEN: u64 = 128;
}
const _: () = assert!(ALLOC_REPLY_LEN as u64 <= CnMemory::REPLY_LEN);
impl CnMemory {
    /// The local region's size for `slots` I/O slots of `io_slot_len` bytes each (the
    /// largest single READ or WRITE the CN makes).
    pub const fn local_len_for(slots: usize, io_slot_len: u64) -> u64 {
        MSG_AREA + SEND_AREA + slots as u64 * io_slot_len
    }

    fn io_slot_len(&self, slots: usize) -> u64 {
        self.local_len.saturating_sub(MSG_AREA + SEND_AREA) / slots.max(1) as u64
    }
    fn msg_slot(&self, q: usize, i: usize) -> u64 {
        self.local + ((q * RECVS_PER_QP + i) as u64) * MSG_SLOT
    }
    fn send_slot(&self, i: usize) -> u64 {
        self.local + MSG_AREA + i as u64 * MSG_SLOT
    }
    fn io_slot(&self, slots: usize, i: usize) -> u64 {
        self.local + MSG_AREA + SEND_AREA + i as u64 * self.io_slot_len(slots)
    }
}

/// A local buffer the caller registered itself: a zero-copy access names it instead of an I/O
/// slot's staging memory, so the device moves the bytes straight between it and the chunk.
/// The caller keeps the memory registered, and leaves it alone, until the access completed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct LocalBuf {
    /// The address the device knows the buffer by.
    pub addr: u64,
    pub lkey: u32,
    pub len: u32,
}

/// An 8-byte remote atomic; the old value comes back through the access's I/O slot
/// ([`CnDriver::access_done`] copies its [`ATOMIC_LEN`] bytes, little-endian on every device
/// this crate runs on: the value in host byte order).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AtomicOp {
    /// Store `swap` iff the word equals `compare`; the old word comes back either way.
    CompareSwap { compare: u64, swap: u64 },
    /// Add `add` (wrapping); the old word comes back.
    FetchAdd { add: u64 },
}

/// Bytes an atomic reads and writes; also its alignment (IBTA 9.4.5: an atomic's remote
/// address must be 8-byte aligned, or the responder NAKs it and the QP breaks).
pub const ATOMIC_LEN: usize = 8;

/// Names a one-sided access (or raw work request) in flight.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct OpId(u32);

/// A finished access: its completion status and, for a READ or atomic, how many bytes of the
/// result were copied out.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct AccessDone {
    pub status: WcStatus,
    pub len: usize,
}

/// What happened on the CN's queues.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum CnEvent {
    Connected(CnId),
    /// An allocation reply landed (`result`: the client's verdict on it — a reply naming
    /// another owner or the wrong size is refused, never adopted).
    Allocated {
        token: u32,
        result: Result<Allocation, ClientError>,
    },
    /// The MN refused a request. `ours`: this driver sent that token and was waiting for it
    /// (the pending allocation, or a free in flight); an error about bytes the CN never
    /// meant to send is still reported, with `ours` false.
    Refused {
        token: u32,
        code: ErrorCode,
        ours: bool,
    },
    Empty,
    /// Alloc chain `chain` is parked on an empty queue while the CN's others still serve
    /// (`Notice::ChainParked`): allocations go on the others until "available".
    ChainParked {
        chain: u8,
    },
    Available,
    /// Every allocation was revoked (MN RNIC reset); the client forgot them.
    Revoked,
    /// The MN's lease probe (receiving it renewed the lease).
    Probed,
    /// The MN bound window MW\[`mw`\] of the allocation at `entry_addr` again under `rkey`
    /// (it was invalidated behind this CN's back); the client's live allocation was updated,
    /// so an access retried with [`Client::live`]'s keys succeeds.
    Rekeyed {
        entry_addr: u64,
        mw: u8,
        rkey: Rkey,
    },
    /// The MN took the allocation at `entry_addr` back while this CN stays connected
    /// (`wire::message::TakenBack`); `held`: the client held it and forgot it (its windows no
    /// longer work, its bytes are gone) — false when the notice was about nothing it holds.
    TakenBack {
        entry_addr: u64,
        held: bool,
    },
    /// A message that is not the protocol (dropped; its receive is posted again).
    Undecodable(ClientError),
    /// A request could not be sent (the QP's peer is gone, the transport gave up).
    SendFailed {
        qp: Qpn,
        token: Option<u32>,
        status: WcStatus,
    },
    /// A receive failed; a flush means the QP left RTS.
    ReceiveFailed {
        qp: Qpn,
        status: WcStatus,
    },
    /// No answer to an allocation before its deadline: the client gave up on it.
    ReplyTimedOut {
        token: u32,
    },
    /// With [`CnDriver::record_deliveries`]: every byte string the MN delivered (reply images
    /// and messages), for tests that check what a CN learns.
    Delivered {
        qp: Qpn,
        /// A message (at most [`MSG_SLOT`] bytes) or an alloc reply ([`ALLOC_REPLY_LEN`]).
        bytes: heapless::Vec<u8, DELIVERED_MAX>,
    },
}

/// Why a driver call failed. Device errors are kept as they came.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CnError<E> {
    Device(E),
    Client(ClientError),
    /// No such QP of this CN.
    NoSuchQp(CnQp),
    /// Every send (or I/O) slot is in flight: poll first.
    SlotsBusy,
    /// The access is larger than an I/O slot.
    TooLong {
        len: usize,
        max: usize,
    },
    UnknownOp(OpId),
    /// The driver's I/O slot count `S` must be 1..=256 (slot numbers travel in a wr_id byte).
    BadSlotCount(usize),
    /// The layout does not fit the registered region.
    MemoryTooSmall {
        need: u64,
        have: u64,
    },
    /// An atomic's remote address is not 8-byte aligned (posting it would break the QP).
    Misaligned {
        addr: u64,
    },
    /// Remote atomics cannot run here: the device has none, or the MN's windows do not grant
    /// them (its connect info says so; ConnectX carries no atomics through windows).
    AtomicsUnsupported,
}

impl<E: fmt::Display> fmt::Display for CnError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CnError::Device(e) => write!(f, "device: {e}"),
            CnError::Client(e) => write!(f, "{e}"),
            CnError::NoSuchQp(q) => write!(f, "this CN has no QP {q:?}"),
            CnError::SlotsBusy => f.write_str("every staging slot is in flight; poll for completions first"),
            CnError::TooLong { len, max } => write!(f, "access of {len} bytes exceeds the I/O slot ({max} bytes)"),
            CnError::UnknownOp(o) => write!(f, "no access {o:?} in flight"),
            CnError::BadSlotCount(s) => write!(f, "{s} I/O slots: a CN driver takes 1 to 256"),
            CnError::MemoryTooSmall { need, have } => {
                write!(f, "the CN's local region needs {need} bytes, {have} registered")
            }
            CnError::Misaligned { addr } => {
                write!(f, "atomic at {addr:#x}: the address must be a multiple of {ATOMIC_LEN}")
            }
            CnError::AtomicsUnsupported => {
                f.write_str("remote atomics are not available: the device or the MN's windows do not carry them")
            }
        }
    }
}

impl<E> From<ClientError> for CnError<E> {
    fn from(e: ClientError) -> Self {
        CnError::Client(e)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct SendSlot {
    qp: Qpn,
    token: Option<u32>,
    /// An honest free's entry: sent again on a rejoined Free QP if this send is lost with the
    /// old one ([`CnDriver::replace_chain_qp`]).
    free_entry: Option<u64>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct IoSlot {
    qp: Qpn,
    seq: u32,
    /// Bytes the device writes into the slot (READ, atomic), to copy out when done.
    result_len: usize,
    done: Option<WcStatus>,
}

/// The CN. `N`: live allocations tracked by its [`Client`]; `S`: accesses in flight.
pub struct CnDriver<B: RdmaBackend, const N: usize, const S: usize = IO_SLOTS> {
    pub backend: B,
    client: Client<N>,
    qps: CnQpSet,
    mem: CnMemory,
    /// Posted receive slots per message queue (bit i: slot i posted).
    posted: [u16; QUEUES],
    /// The CN ends of its Alloc QPs beyond the first, one per extra alloc chain
    /// ([`CnDriver::with_alloc_chains`]).
    extra_alloc: heapless::Vec<Qpn, { MAX_ALLOC_CHAINS - 1 }>,
    /// Per alloc chain, the allocation in flight on it (each chain serves one lap at a time).
    chains: [Option<AllocInFlight>; MAX_ALLOC_CHAINS],
    /// The chain after the one last used: requests go round the idle chains, so a chain gets
    /// the longest time to re-arm before its next request.
    next_chain: usize,
    sends: [Option<SendSlot>; SEND_SLOTS],
    next_send: usize,
    io: [Option<IoSlot>; S],
    io_seq: u32,
    /// Frees in flight whose refusal this CN would want to hear about (no success reply
    /// exists: the oldest is forgotten when the ring wraps).
    free_tokens: [u32; SEND_SLOTS],
    free_next: usize,
    events: heapless::Deque<CnEvent, EVENT_CAPACITY>,
    record: bool,
    /// How long an allocation may go unanswered (ns of the caller's clock; 0: forever).
    pub reply_timeout: u64,
    /// Token of a raw request's free slot: a forged free still expects a refusal.
    forged_token: u32,
    /// Honest frees whose requests failed with their Free QP (token, entry): sent again when
    /// a rejoin replaces it ([`CnDriver::replace_chain_qp`]).
    lost_frees: heapless::Vec<(u32, u64), { 2 * SEND_SLOTS }>,
}

impl<B: RdmaBackend, const N: usize, const S: usize> fmt::Debug for CnDriver<B, N, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CnDriver").field("cn", &self.client.id()).field("qps", &self.qps).finish()
    }
}

impl<B: RdmaBackend, const N: usize, const S: usize> CnDriver<B, N, S> {
    /// Take over a CN whose QPs are connected and whose memory is registered, and post its
    /// receives (the MN's connect info arrives on them).
    pub fn new(backend: B, qps: CnQpSet, mem: CnMemory) -> Result<Self, CnError<B::Error>> {
        let mut d = Self::build(backend, qps, mem)?;
        d.refill()?;
        Ok(d)
    }

    /// A driver whose message queues were primed with [`prime_receives`] while connecting.
    pub fn with_primed_receives(backend: B, qps: CnQpSet, mem: CnMemory) -> Result<Self, CnError<B::Error>> {
        let mut d = Self::build(backend, qps, mem)?;
        d.posted = [0; QUEUES];
        d.posted[0] = (1 << RECVS_PER_QP) - 1;
        d.posted[1] = (1 << RECVS_PER_QP) - 1;
        Ok(d)
    }

    fn build(backend: B, qps: CnQpSet, mem: CnMemory) -> Result<Self, CnError<B::Error>> {
        if S == 0 || S > 256 {
            return Err(CnError::BadSlotCount(S));
        }
        if qps.access.is_empty() {
            return Err(CnError::NoSuchQp(CnQp::Access(0)));
        }
        let need = CnMemory::local_len_for(S, 1);
        if mem.local_len < need {
            return Err(CnError::MemoryTooSmall { need, have: mem.local_len });
        }
        Ok(CnDriver {
            backend,
            client: Client::new(),
            qps,
            mem,
            posted: [0; QUEUES],
            extra_alloc: heapless::Vec::new(),
            chains: [None; MAX_ALLOC_CHAINS],
            next_chain: 0,
            sends: [None; SEND_SLOTS],
            next_send: 0,
            io: [None; S],
            io_seq: 0,
            free_tokens: [0; SEND_SLOTS],
            free_next: 0,
            events: heapless::Deque::new(),
            record: false,
            reply_timeout: 0,
            forged_token: 0xF0F0_0000,
            lost_frees: heapless::Vec::new(),
        })
    }

    /// Use several alloc chains ([`crate::mn::MnConfig::alloc_chains`]): `extra` are the CN
    /// ends of the Alloc QPs beyond the first, in the order the MN was given their MN ends
    /// (`MnDriver::connect_with_chains`). Up to `1 + extra.len()` allocations are then in flight
    /// at once, one per chain, each with its own reply buffer: the [`CnMemory`] reply region
    /// must hold `(1 + extra.len()) × REPLY_LEN` bytes, `reply_len` says how many it holds.
    pub fn with_alloc_chains(mut self, extra: &[Qpn], reply_len: u64) -> Result<Self, CnError<B::Error>> {
        let chains = 1 + extra.len();
        if chains > MAX_ALLOC_CHAINS {
            return Err(CnError::BadSlotCount(chains));
        }
        let need = chains as u64 * CnMemory::REPLY_LEN;
        if reply_len < need {
            return Err(CnError::MemoryTooSmall { need, have: reply_len });
        }
        self.extra_alloc = extra.iter().copied().collect();
        self.client.set_alloc_chains(chains as u8);
        self.refill()?;
        Ok(self)
    }

    /// Give up every allocation in flight (the caller reset the QPs under them): the client
    /// forgets them and every alloc chain is idle again.
    pub fn abandon_allocs(&mut self) {
        self.client.abandon_pending();
        self.chains = [None; MAX_ALLOC_CHAINS];
    }

    /// Give up the allocation with `token` (its reply will not be read): its chain is idle again.
    pub fn abandon_alloc(&mut self, token: u32) {
        self.client.abandon(token);
        self.chain_done(token);
    }

    /// The CN's alloc chains (its Alloc QPs).
    pub fn alloc_chains(&self) -> usize {
        1 + self.extra_alloc.len()
    }

    /// The CN end of alloc chain `j`'s Alloc QP.
    pub fn alloc_qp(&self, j: usize) -> Option<Qpn> {
        match j {
            0 => Some(self.qps.alloc),
            _ => self.extra_alloc.get(j - 1).copied(),
        }
    }

    /// Alloc chains with no allocation in flight.
    pub fn idle_alloc_chains(&self) -> usize {
        self.chains[..self.alloc_chains()].iter().filter(|c| c.is_none()).count()
    }

    /// The queues MN messages (and alloc replies' immediates) arrive on, by queue index.
    fn message_qps(&self) -> [Option<Qpn>; QUEUES] {
        let mut q = [None; QUEUES];
        let [a, b] = self.qps.message_qps();
        q[0] = a;
        q[1] = b;
        for (i, x) in self.extra_alloc.iter().enumerate() {
            q[2 + i] = Some(*x);
        }
        q
    }

    /// Receives kept posted on message queue `k`: an extra Alloc QP carries only its chain's
    /// replies, one request in flight at a time — a CN that stops reading them is found after
    /// as many more replies as it has receives there, so few keep its chains from holding
    /// many more groups than one chain would before the MN evicts it.
    const fn recvs_on(k: usize) -> usize {
        if k >= 2 {
            EXTRA_ALLOC_RECVS
        } else {
            RECVS_PER_QP
        }
    }

    /// The alloc chain whose replies' immediates arrive on message queue `k`.
    fn chain_of_queue(k: usize) -> usize {
        if k >= 2 {
            k - 1
        } else {
            0
        }
    }

    /// The allocation with `token` is over (answered, refused, given up): its chain is idle.
    fn chain_done(&mut self, token: u32) {
        for c in self.chains.iter_mut() {
            if c.is_some_and(|c| c.token == token) {
                *c = None;
            }
        }
    }

    /// The CN end of chain connection `c`.
    pub fn chain_qp(&self, c: ChainConnection) -> Option<Qpn> {
        match c {
            ChainConnection::Alloc(j) => self.alloc_qp(j as usize),
            ChainConnection::Free => Some(self.qps.free),
        }
    }

    /// The chain connection whose CN end is `qp` (None: an access QP or no QP of this CN).
    pub fn chain_connection_of(&self, qp: Qpn) -> Option<ChainConnection> {
        if qp == self.qps.free {
            return Some(ChainConnection::Free);
        }
        (0..self.alloc_chains()).find(|j| self.alloc_qp(*j) == Some(qp)).map(|j| ChainConnection::Alloc(j as u8))
    }

    /// Chain connection `c`'s CN end is `new` now: a rejoin connected it to the same MN end,
    /// which keeps everything bound to it. The old QP broke (it is in error, or its peer reset
    /// under it), so what was in flight on it is over: its request sends are forgotten — an
    /// allocation waiting on one is given up (the MN's repair of that chain takes back what
    /// its lap got, and tells the CN) —, its accesses report `WrFlushErr`, and the receives of
    /// its message queue are posted on `new` unless `primed` says they were posted before
    /// `new` connected ([`prime_receives`]). Frees lost with an old Free QP are sent again on
    /// the new one. The old QP is the caller's to destroy.
    ///
    /// What the old QP completed before it broke still counts: a request it sent is not sent
    /// again, a reply or message it received is taken (`now`: the caller's clock). Its flushed
    /// receives are not reported: the break is what this call handles.
    pub fn replace_chain_qp(
        &mut self,
        now: u64,
        c: ChainConnection,
        new: Qpn,
        primed: bool,
    ) -> Result<Replaced, CnError<B::Error>> {
        let old = self.chain_qp(c).ok_or(CnError::NoSuchQp(match c {
            ChainConnection::Alloc(_) => CnQp::Alloc,
            ChainConnection::Free => CnQp::Free,
        }))?;
        // what the old QP completed counts (a free that was sent is not sent again); what it
        // flushed is lost
        let _ = self.poll_sends(old);
        // the message queue the old QP was, if any
        let queue = self.message_qps().iter().position(|q| *q == Some(old));
        if let Some(k) = queue {
            self.take_old_receives(now, k, old);
        }
        match c {
            ChainConnection::Alloc(0) => self.qps.alloc = new,
            ChainConnection::Alloc(j) => self.extra_alloc[j as usize - 1] = new,
            ChainConnection::Free => self.qps.free = new,
        }
        let mut abandoned = None;
        for s in self.sends.iter_mut().filter(|s| s.is_some_and(|s| s.qp == old)) {
            if let Some(t) = s.and_then(|s| s.token).filter(|t| self.client.is_pending(*t)) {
                abandoned = Some(t);
            }
            if let Some(SendSlot { token: Some(t), free_entry: Some(e), .. }) = *s {
                let _ = self.lost_frees.push((t, e));
            }
            *s = None;
        }
        // the chain's allocation in flight, whether or not its request's send completed
        if let ChainConnection::Alloc(j) = c {
            if let Some(a) = self.chains[j as usize].take() {
                abandoned = Some(a.token);
            }
        }
        if let Some(t) = abandoned {
            self.client.abandon(t);
            self.chain_done(t);
        }
        for s in self.io.iter_mut().flatten().filter(|s| s.qp == old && s.done.is_none()) {
            s.done = Some(WcStatus::WrFlushErr);
        }
        if let Some(k) = queue {
            self.posted[k] = if primed { (1 << Self::recvs_on(k)) - 1 } else { 0 };
        }
        self.refill()?;
        if c == ChainConnection::Free {
            self.resend_lost_frees()?;
        }
        Ok(Replaced { old, abandoned })
    }

    /// Take what a broken message queue's QP still reports (as far as the event queue has
    /// room): replies and messages that arrived before it broke, not its flushes.
    fn take_old_receives(&mut self, now: u64, k: usize, qp: Qpn) {
        for _ in 0..RECVS_PER_QP {
            let room = (EVENT_CAPACITY - self.events.len()) / 3;
            if room == 0 {
                return;
            }
            let mut c = [Completion::EMPTY; 1];
            match self.backend.poll_cq(qp, QueueSel::Recv, &mut c) {
                Ok(1) if c[0].status.is_ok() => {
                    let _ = self.on_receive(now, k, qp, &c[0]);
                }
                Ok(1) => {}
                _ => return,
            }
        }
    }

    /// Report every byte string the MN delivers as [`CnEvent::Delivered`].
    pub fn record_deliveries(&mut self, on: bool) {
        self.record = on;
    }
    pub fn client(&self) -> &Client<N> {
        &self.client
    }
    pub fn client_mut(&mut self) -> &mut Client<N> {
        &mut self.client
    }
    pub fn qps(&self) -> &CnQpSet {
        &self.qps
    }
    pub fn memory(&self) -> &CnMemory {
        &self.mem
    }
    pub fn id(&self) -> Option<CnId> {
        self.client.id()
    }
    /// Events waiting for [`CnDriver::next_event`].
    pub fn pending_events(&self) -> usize {
        self.events.len()
    }
    pub fn next_event(&mut self) -> Option<CnEvent> {
        self.events.pop_front()
    }
    /// Largest single access.
    pub fn io_slot_len(&self) -> usize {
        self.mem.io_slot_len(S) as usize
    }

    // ------------------------------------------------------------------ receiving

    /// Harvest what arrived: messages and replies into events (as much as the event queue
    /// has room for — nothing is dropped, the rest waits in the CQ), send and access
    /// completions into their slots; then keep the receives posted.
    pub fn poll(&mut self, now: u64) -> Result<(), CnError<B::Error>> {
        let mut drained = true;
        for (k, q) in self.message_qps().into_iter().enumerate() {
            let Some(qp) = q else { continue };
            drained &= self.poll_messages(now, k, qp)?;
        }
        drained &= self.poll_every_send_queue()?;
        if drained {
            self.resync();
        }
        self.refill()?;
        if !self.lost_frees.is_empty() && self.backend.qp_state(self.qps.free).map_err(CnError::Device)? == QpState::Rts
        {
            self.resend_lost_frees()?;
        }
        Ok(())
    }

    /// Only the send side: completions of requests and accesses, no receive taken or posted
    /// again — what a CN that stopped serving its receive queues still does.
    pub fn poll_sends_only(&mut self) -> Result<(), CnError<B::Error>> {
        self.poll_every_send_queue().map(|_| ())
    }

    /// Every distinct QP's send CQ; true when all were drained.
    fn poll_every_send_queue(&mut self) -> Result<bool, CnError<B::Error>> {
        let mut all: heapless::Vec<Qpn, { 2 + MAX_ACCESS_QPS + MAX_ALLOC_CHAINS - 1 }> = heapless::Vec::new();
        let extra = self.extra_alloc.clone();
        for qp in [self.qps.alloc, self.qps.free].into_iter().chain(self.qps.access.iter().copied()).chain(extra) {
            if !all.contains(&qp) {
                let pushed = all.push(qp);
                debug_assert!(pushed.is_ok(), "the CN's QPs: Alloc, Free and at most MAX_ACCESS_QPS access QPs");
            }
        }
        let mut drained = true;
        for qp in all {
            drained &= self.poll_sends(qp)?;
        }
        Ok(drained)
    }

    /// Requests whose SEND has not completed yet.
    pub fn sends_in_flight(&self) -> usize {
        self.sends.iter().flatten().count()
    }

    /// True when the CQ was drained.
    fn poll_messages(&mut self, now: u64, k: usize, qp: Qpn) -> Result<bool, CnError<B::Error>> {
        loop {
            // each completion may yield three events (the delivery record, a revocation a
            // newer generation's reply reveals, and its meaning)
            let room = (EVENT_CAPACITY - self.events.len()) / 3;
            if room == 0 {
                return Ok(false);
            }
            let mut buf = [Completion::EMPTY; 8];
            let want = room.min(buf.len());
            let n = self.backend.poll_cq(qp, QueueSel::Recv, &mut buf[..want]).map_err(CnError::Device)?;
            for c in &buf[..n] {
                self.on_receive(now, k, qp, c)?;
            }
            if n < want {
                return Ok(true);
            }
        }
    }

    fn on_receive(&mut self, now: u64, k: usize, qp: Qpn, c: &Completion) -> Result<(), CnError<B::Error>> {
        let (tag, q, slot) = (c.wr_id >> TAG_SHIFT, ((c.wr_id >> 8) & 0xFF) as usize, (c.wr_id & 0xFF) as usize);
        if tag != TAG_RECV || q != k || slot >= RECVS_PER_QP {
            return Ok(()); // not one of ours
        }
        self.posted[k] &= !(1 << slot);
        if !c.status.is_ok() {
            self.push(CnEvent::ReceiveFailed { qp, status: c.status });
            return Ok(());
        }
        if c.opcode == WcOpcode::RecvRdmaWithImm {
            let imm = c.imm.unwrap_or(0);
            let mut b = [0u8; ALLOC_REPLY_LEN];
            // each alloc chain's reply lands in its own buffer
            let reply = self.mem.reply + Self::chain_of_queue(k) as u64 * CnMemory::REPLY_LEN;
            self.backend.read_local(reply, &mut b).map_err(CnError::Device)?;
            self.deliver(qp, &b);
            self.chain_done(imm);
            let result = self.client.on_alloc_reply(imm, &b);
            if self.client.take_revocation() {
                // the reply says the MN's RNIC was reset before its `Revoked` reached us
                self.push(CnEvent::Revoked);
            }
            self.push(CnEvent::Allocated { token: imm, result });
            return Ok(());
        }
        let mut b = [0u8; MSG_SLOT as usize];
        let len = (c.byte_len as usize).min(b.len());
        self.backend.read_local(self.mem.msg_slot(k, slot), &mut b[..len]).map_err(CnError::Device)?;
        self.deliver(qp, &b[..len]);
        let pending: heapless::Vec<u32, MAX_ALLOC_CHAINS> = self.chains.iter().flatten().map(|c| c.token).collect();
        let ev = match self.client.on_message(now, &b[..len]) {
            Ok(ClientEvent::Connected(id)) => CnEvent::Connected(id),
            Ok(ClientEvent::Empty) => CnEvent::Empty,
            Ok(ClientEvent::ChainParked { chain }) => CnEvent::ChainParked { chain },
            Ok(ClientEvent::Available) => CnEvent::Available,
            // requests in flight stay in flight (`Client::on_message`): a re-armed chain may
            // still answer one, and one that nobody answers times out
            Ok(ClientEvent::Revoked) => CnEvent::Revoked,
            Ok(ClientEvent::Probed) => CnEvent::Probed,
            Ok(ClientEvent::Rekeyed { entry_addr, mw, rkey }) => CnEvent::Rekeyed { entry_addr, mw, rkey },
            Ok(ClientEvent::TakenBack { entry_addr, held }) => CnEvent::TakenBack { entry_addr, held },
            Ok(ClientEvent::Failed { token, code }) => {
                let ours = pending.contains(&token) || self.free_tokens.contains(&token);
                self.chain_done(token);
                CnEvent::Refused { token, code, ours }
            }
            Err(e) => CnEvent::Undecodable(e),
        };
        self.push(ev);
        Ok(())
    }

    fn deliver(&mut self, qp: Qpn, bytes: &[u8]) {
        if self.record {
            let bytes = bytes.iter().copied().take(DELIVERED_MAX).collect();
            self.push(CnEvent::Delivered { qp, bytes });
        }
    }

    fn push(&mut self, e: CnEvent) {
        let pushed = self.events.push_back(e);
        debug_assert!(
            pushed.is_ok(),
            "room is reserved before a completion leaves the CQ (three events each) or a deadline expires"
        );
    }

    fn poll_sends(&mut self, qp: Qpn) -> Result<bool, CnError<B::Error>> {
        loop {
            let room = EVENT_CAPACITY - self.events.len();
            if room == 0 {
                return Ok(false);
            }
            let mut buf = [Completion::EMPTY; 8];
            let want = room.min(buf.len());
            let n = self.backend.poll_cq(qp, QueueSel::Send, &mut buf[..want]).map_err(CnError::Device)?;
            for c in &buf[..n] {
                let (tag, idx) = (c.wr_id >> TAG_SHIFT, (c.wr_id & 0xFF) as usize);
                match tag {
                    TAG_SEND => {
                        if let Some(s) = self.sends.get_mut(idx).and_then(Option::take) {
                            if !c.status.is_ok() {
                                if let Some(t) = s.token.filter(|t| self.client.is_pending(*t)) {
                                    self.client.abandon(t);
                                    self.chain_done(t);
                                }
                                if let (Some(e), Some(t)) = (s.free_entry, s.token) {
                                    // room for every send slot's: only a rejoin clears them
                                    let _ = self.lost_frees.push((t, e));
                                }
                                self.push(CnEvent::SendFailed { qp, token: s.token, status: c.status });
                            }
                        }
                    }
                    TAG_IO => {
                        let seq = ((c.wr_id >> 8) & 0xFFFF_FFFF) as u32;
                        if let Some(Some(s)) = self.io.get_mut(idx) {
                            if s.seq == seq {
                                s.done = Some(c.status);
                            }
                        }
                    }
                    _ => {}
                }
            }
            if n < want {
                return Ok(true);
            }
        }
    }

    /// A QP reset under the CN (its peer reconnected the pair) discards posted work without
    /// completions. With every CQ drained, anything the device no longer holds is gone:
    /// receive slots are posted again, send slots freed, accesses reported flushed.
    fn resync(&mut self) {
        for (k, q) in self.message_qps().into_iter().enumerate() {
            let Some(qp) = q else { continue };
            if let Some(n) = self.backend.outstanding(qp, QueueSel::Recv) {
                if n < self.posted[k].count_ones() as u64 {
                    self.posted[k] = 0;
                }
            }
        }
        // sends and accesses go only on the CN's own QPs (`CnQpSet::get`): distinct, at most
        // Alloc, Free and MAX_ACCESS_QPS access QPs
        let mut qps: heapless::Vec<Qpn, { 2 + MAX_ACCESS_QPS + MAX_ALLOC_CHAINS - 1 }> = heapless::Vec::new();
        let busy = self.sends.iter().flatten().map(|s| s.qp);
        for qp in busy.chain(self.io.iter().flatten().filter(|s| s.done.is_none()).map(|s| s.qp)) {
            if !qps.contains(&qp) {
                let pushed = qps.push(qp);
                debug_assert!(
                    pushed.is_ok(),
                    "distinct QPs of this CN: at most its Alloc QPs, Free and MAX_ACCESS_QPS"
                );
            }
        }
        for qp in qps {
            let Some(n) = self.backend.outstanding(qp, QueueSel::Send) else { continue };
            let held = self.sends.iter().flatten().filter(|s| s.qp == qp).count()
                + self.io.iter().flatten().filter(|s| s.qp == qp && s.done.is_none()).count();
            if n < held as u64 {
                for s in self.sends.iter_mut().filter(|s| s.is_some_and(|s| s.qp == qp)) {
                    *s = None;
                }
                for s in self.io.iter_mut().flatten().filter(|s| s.qp == qp && s.done.is_none()) {
                    s.done = Some(WcStatus::WrFlushErr);
                }
            }
        }
    }

    /// Keep every receive slot of both message queues posted (while the QP is in RTS).
    fn refill(&mut self) -> Result<(), CnError<B::Error>> {
        for (k, q) in self.message_qps().into_iter().enumerate() {
            let Some(qp) = q else { continue };
            let n = Self::recvs_on(k);
            if self.posted[k] == (1 << n) - 1 {
                continue;
            }
            if self.backend.qp_state(qp).map_err(CnError::Device)? != QpState::Rts {
                continue;
            }
            for i in 0..n {
                if self.posted[k] & (1 << i) != 0 {
                    continue;
                }
                self.backend.post_recv(qp, &recv_wqe(&self.mem, k, i)).map_err(CnError::Device)?;
                self.posted[k] |= 1 << i;
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------------ requests

    /// Send an allocation request; its answer comes as [`CnEvent::Allocated`] or
    /// [`CnEvent::Refused`] with the returned token.
    pub fn alloc(&mut self, now: u64) -> Result<u32, CnError<B::Error>> {
        self.send_alloc_request(now, |_, _, len| Ok(len))
    }

    /// Send an allocation request whose bytes `shape` may rewrite from the client's own (the
    /// hostile-CN API, `testing::hostile`, names other QPs with it); the client waits for the
    /// answer to its token either way.
    pub(crate) fn send_alloc_request(
        &mut self,
        now: u64,
        shape: impl FnOnce(u32, &mut [u8; MSG_SLOT as usize], usize) -> Result<usize, ClientError>,
    ) -> Result<u32, CnError<B::Error>> {
        // an idle alloc chain, going round them, one the MN did not say is parked if any is
        // left (the client's choice; none idle: it says Busy below)
        let n = self.alloc_chains();
        let j = self.client.idle_chain_from(self.next_chain as u8).map_or(0, usize::from);
        let qp = self.alloc_qp(j).unwrap_or(self.qps.alloc);
        let slot = self.free_send_slot(qp)?;
        let mut req = [0u8; MSG_SLOT as usize];
        let reply = self.mem.reply + j as u64 * CnMemory::REPLY_LEN;
        let (token, len) = self.client.alloc_request_on(now, j as u8, reply, self.mem.reply_rkey, &mut req)?;
        let len = match shape(token, &mut req, len) {
            Ok(l) => l,
            Err(e) => {
                self.client.abandon(token);
                return Err(e.into());
            }
        };
        if let Err(e) = self.send_in(slot, qp, Some(token), &req[..len]) {
            self.client.abandon(token);
            return Err(e);
        }
        let deadline = (self.reply_timeout > 0).then(|| now.saturating_add(self.reply_timeout));
        self.chains[j] = Some(AllocInFlight { token, deadline });
        self.next_chain = (j + 1) % n;
        Ok(token)
    }

    /// Free one of the CN's allocations (the MN answers only a refusal).
    pub fn free(&mut self, a: &Allocation) -> Result<u32, CnError<B::Error>> {
        let slot = self.free_send_slot(self.qps.free)?;
        let bytes = self.client.free_request(a.entry_addr)?;
        let token = Request::from_array(bytes).token();
        self.send_free(slot, token, a.entry_addr, &bytes)?;
        Ok(token)
    }

    /// Send the free request `bytes` (`token`, of `entry`) from send slot `slot` on the Free QP.
    fn send_free(&mut self, slot: usize, token: u32, entry: u64, bytes: &[u8]) -> Result<(), CnError<B::Error>> {
        self.remember_free(token);
        self.send_in(slot, self.qps.free, Some(token), bytes)?;
        if let Some(s) = self.sends[slot].as_mut() {
            s.free_entry = Some(entry);
        }
        Ok(())
    }

    /// Send again the frees whose requests were lost with a broken Free QP, once a new one is in
    /// place ([`CnDriver::replace_chain_qp`]; then each [`CnDriver::poll`] until all went). A
    /// free that reached the MN after all (its ack was what got lost) is refused as not the
    /// owner's ([`CnEvent::Refused`]); one that did not gives the chunk back now.
    ///
    /// A lost free may have landed and its group come back to this very CN: sent again, it
    /// would free the CN's new allocation. So nothing is sent while an allocation is in flight
    /// (its reply could be that group), and an entry the CN holds again is dropped — it can
    /// only hold it again if the first free landed.
    fn resend_lost_frees(&mut self) -> Result<(), CnError<B::Error>> {
        if self.chains.iter().any(Option::is_some) {
            return Ok(());
        }
        let client = &mut self.client;
        self.lost_frees.retain(|(_, e)| client.live_at(*e).is_none());
        while let Some(&(token, entry)) = self.lost_frees.last() {
            let slot = match self.free_send_slot(self.qps.free) {
                Ok(s) => s,
                Err(CnError::SlotsBusy) => return Ok(()),
                Err(e) => return Err(e),
            };
            self.lost_frees.pop();
            self.send_free(slot, token, entry, &FreeRequest { token, entry_addr: entry }.encode())?;
        }
        Ok(())
    }

    /// A request of `bytes` on `qp` from a free send slot (the hostile-CN API's raw sends);
    /// `free_token`: a free's token, remembered so the MN's refusal of it is matched.
    pub(crate) fn send_request(
        &mut self,
        qp: Qpn,
        token: Option<u32>,
        free_token: bool,
        bytes: &[u8],
    ) -> Result<(), CnError<B::Error>> {
        let slot = self.free_send_slot(qp)?;
        if let (true, Some(t)) = (free_token, token) {
            self.remember_free(t);
        }
        let len = bytes.len().min(MSG_SLOT as usize);
        self.send_in(slot, qp, token, &bytes[..len])
    }

    /// A fresh token for a request the client did not make (a forged free).
    pub(crate) fn forged_token(&mut self) -> u32 {
        self.forged_token = self.forged_token.wrapping_add(1) | 0xF0F0_0000;
        self.forged_token
    }

    fn remember_free(&mut self, token: u32) {
        self.free_tokens[self.free_next] = token;
        self.free_next = (self.free_next + 1) % SEND_SLOTS;
    }

    /// A free send slot for a request on `qp`. Requests on the Alloc QP may hold at most
    /// [`ALLOC_SEND_SLOTS`] of the slots (they can wait there indefinitely while the pool is
    /// empty), so a free — the request that refills the pool — always finds one; every other
    /// request may take any free slot.
    fn free_send_slot(&mut self, qp: Qpn) -> Result<usize, CnError<B::Error>> {
        if qp == self.qps.alloc || self.extra_alloc.contains(&qp) {
            let held = self.sends.iter().flatten().filter(|s| s.qp == qp).count();
            if held >= ALLOC_SEND_SLOTS {
                return Err(CnError::SlotsBusy);
            }
        }
        for k in 0..SEND_SLOTS {
            let i = (self.next_send + k) % SEND_SLOTS;
            if self.sends[i].is_none() {
                return Ok(i);
            }
        }
        Err(CnError::SlotsBusy)
    }

    /// A SEND reads its slot only when the NIC executes it: the slot stays taken until the
    /// send completed.
    fn send_in(&mut self, slot: usize, qp: Qpn, token: Option<u32>, bytes: &[u8]) -> Result<(), CnError<B::Error>> {
        let at = self.mem.send_slot(slot);
        self.backend.write_local(at, bytes).map_err(CnError::Device)?;
        let w = Wqe::send(at, self.mem.lkey, bytes.len() as u32).with_wr_id((TAG_SEND << TAG_SHIFT) | slot as u64);
        self.backend.post_send(qp, &w).map_err(CnError::Device)?;
        self.sends[slot] = Some(SendSlot { qp, token, free_entry: None });
        self.next_send = (slot + 1) % SEND_SLOTS;
        Ok(())
    }

    // ------------------------------------------------------------------ one-sided access

    /// WRITE `data` at `addr` of the MN through access QP `window` with `rkey`.
    pub fn post_write(&mut self, window: usize, addr: u64, rkey: Rkey, data: &[u8]) -> Result<OpId, CnError<B::Error>> {
        let qp = CnQp::Access(window);
        let (slot, local) = self.io_slot(data.len())?;
        self.backend.write_local(local, data).map_err(CnError::Device)?;
        self.post_io(slot, qp, Wqe::write(local, self.mem.lkey, data.len() as u32, addr, rkey.0), 0)
    }

    /// READ `len` bytes at `addr` through access QP `window` with `rkey`.
    pub fn post_read(&mut self, window: usize, addr: u64, rkey: Rkey, len: usize) -> Result<OpId, CnError<B::Error>> {
        let (slot, local) = self.io_slot(len)?;
        self.post_io(slot, CnQp::Access(window), Wqe::read(local, self.mem.lkey, len as u32, addr, rkey.0), len)
    }

    /// Zero-copy READ of `local.len` bytes at `addr` through access QP `window` with `rkey`,
    /// straight into the caller's registered buffer: an I/O slot tracks the access, its
    /// staging memory stays unused, and [`CnDriver::access_done`] copies nothing.
    pub fn post_read_into(
        &mut self,
        window: usize,
        addr: u64,
        rkey: Rkey,
        local: LocalBuf,
    ) -> Result<OpId, CnError<B::Error>> {
        let (slot, _) = self.io_slot(0)?;
        let w = Wqe::read(local.addr, local.lkey, local.len, addr, rkey.0);
        self.post_io(slot, CnQp::Access(window), w, 0)
    }

    /// Zero-copy WRITE of the caller's registered buffer at `addr` through access QP `window`.
    pub fn post_write_from(
        &mut self,
        window: usize,
        addr: u64,
        rkey: Rkey,
        local: LocalBuf,
    ) -> Result<OpId, CnError<B::Error>> {
        let (slot, _) = self.io_slot(0)?;
        let w = Wqe::write(local.addr, local.lkey, local.len, addr, rkey.0);
        self.post_io(slot, CnQp::Access(window), w, 0)
    }

    /// An 8-byte remote atomic at `addr` through access QP `window`; the old value comes back
    /// through [`CnDriver::access_done`]. Refused before anything is posted when `addr` is not
    /// 8-byte aligned ([`CnError::Misaligned`]) or when atomics cannot run here — the device
    /// lacks them, or the MN's connect info says its windows do not grant them
    /// ([`CnError::AtomicsUnsupported`]): either would fail on the wire and take the access QP
    /// down with it.
    pub fn post_atomic(
        &mut self,
        window: usize,
        addr: u64,
        rkey: Rkey,
        op: AtomicOp,
    ) -> Result<OpId, CnError<B::Error>> {
        if !self.atomics_available() {
            return Err(CnError::AtomicsUnsupported);
        }
        if !addr.is_multiple_of(ATOMIC_LEN as u64) {
            return Err(CnError::Misaligned { addr });
        }
        let (slot, local) = self.io_slot(ATOMIC_LEN)?;
        let w = match op {
            AtomicOp::CompareSwap { compare, swap } => {
                Wqe::compare_swap(local, self.mem.lkey, addr, rkey.0, compare, swap)
            }
            AtomicOp::FetchAdd { add } => Wqe::fetch_add(local, self.mem.lkey, addr, rkey.0, add),
        };
        self.post_io(slot, CnQp::Access(window), w, ATOMIC_LEN)
    }

    /// Whether [`CnDriver::post_atomic`] can run: the device has atomics and the MN's windows
    /// grant them (false before the connect info arrived).
    pub fn atomics_available(&self) -> bool {
        let granted = self.client.info().is_some_and(|i| i.flags.contains(ConnectFlags::WINDOW_ATOMICS));
        granted && self.backend.capabilities().contains(crate::device::Capabilities::ATOMICS)
    }

    /// Any work request on any of the CN's QPs (the hostile CN: any verb, key, address). A
    /// WQE that names no local buffer (lkey 0) gets an I/O slot; what the device writes there
    /// (a READ's data, an atomic's old value) is what [`CnDriver::access_done`] copies out.
    pub fn post_wqe(&mut self, qp: CnQp, mut w: Wqe) -> Result<OpId, CnError<B::Error>> {
        let (slot, local) = self.io_slot(0)?;
        let result_len = match w.opcode {
            Opcode::Read => w.length as usize,
            Opcode::FetchAdd | Opcode::CompareSwap | Opcode::MaskedFetchAdd => 8,
            _ => 0,
        }
        .min(self.io_slot_len());
        if w.lkey == 0 {
            w.local_addr = local;
            w.lkey = self.mem.lkey;
        }
        self.post_io(slot, qp, w, result_len)
    }

    fn io_slot(&self, len: usize) -> Result<(usize, u64), CnError<B::Error>> {
        let max = self.io_slot_len();
        if len > max {
            return Err(CnError::TooLong { len, max });
        }
        let i = self.io.iter().position(Option::is_none).ok_or(CnError::SlotsBusy)?;
        Ok((i, self.mem.io_slot(S, i)))
    }

    fn post_io(&mut self, slot: usize, qp: CnQp, w: Wqe, result_len: usize) -> Result<OpId, CnError<B::Error>> {
        // windows bound to the poster live on the Alloc QP (`ConnectFlags::WINDOWS_ON_ALLOC_QP`)
        let on_alloc = self.client.info().is_some_and(|i| i.flags.contains(ConnectFlags::WINDOWS_ON_ALLOC_QP));
        let q = match qp {
            CnQp::Access(i) if on_alloc && self.qps.access.get(i).is_some() => self.qps.alloc,
            _ => self.qps.get(qp).ok_or(CnError::NoSuchQp(qp))?,
        };
        self.io_seq = self.io_seq.wrapping_add(1);
        let seq = self.io_seq;
        let w = w
            .with_wr_id((TAG_IO << TAG_SHIFT) | ((seq as u64) << 8) | slot as u64)
            .with_flags(w.flags | crate::wire::wqe::WqeFlags::SIGNALED);
        self.backend.post_send(q, &w).map_err(CnError::Device)?;
        self.io[slot] = Some(IoSlot { qp: q, seq, result_len, done: None });
        Ok(OpId(((seq as u64) << 8 | slot as u64) as u32))
    }

    /// The access's result once it completed (`None`: still in flight; poll first). Copies
    /// what the device wrote into `out` (up to its length) and frees the slot.
    pub fn access_done(&mut self, op: OpId, out: &mut [u8]) -> Result<Option<AccessDone>, CnError<B::Error>> {
        let slot = (op.0 & 0xFF) as usize;
        let s = match self.io.get(slot).copied().flatten() {
            Some(s) if s.seq & 0x00FF_FFFF == op.0 >> 8 => s,
            _ => return Err(CnError::UnknownOp(op)),
        };
        let Some(status) = s.done else { return Ok(None) };
        let mut len = 0;
        if status.is_ok() {
            len = s.result_len.min(out.len());
            self.backend.read_local(self.mem.io_slot(S, slot), &mut out[..len]).map_err(CnError::Device)?;
        }
        self.io[slot] = None;
        Ok(Some(AccessDone { status, len }))
    }

    /// An access's state without taking it: `None` while in flight, its status once done
    /// (the slot stays taken until [`CnDriver::access_done`]).
    pub fn op_status(&self, op: OpId) -> Result<Option<WcStatus>, CnError<B::Error>> {
        match self.io.get((op.0 & 0xFF) as usize).copied().flatten() {
            Some(s) if s.seq & 0x00FF_FFFF == op.0 >> 8 => Ok(s.done),
            _ => Err(CnError::UnknownOp(op)),
        }
    }

    /// I/O slots in all: the most accesses (staged, zero-copy or atomic) in flight at once.
    pub const fn io_slots(&self) -> usize {
        S
    }

    /// I/O slots free for a new access right now (completed accesses not yet collected with
    /// [`CnDriver::access_done`] still hold theirs).
    pub fn free_io_slots(&self) -> usize {
        self.io.iter().filter(|s| s.is_none()).count()
    }

    /// Send slots a request could take now (an allocation may take at most
    /// [`ALLOC_SEND_SLOTS`] of them).
    pub fn free_send_slots(&self) -> usize {
        self.sends.iter().filter(|s| s.is_none()).count()
    }

    /// The QP an access in flight was posted on.
    pub fn op_qpn(&self, op: OpId) -> Option<Qpn> {
        self.io
            .get((op.0 & 0xFF) as usize)
            .copied()
            .flatten()
            .filter(|s| s.seq & 0x00FF_FFFF == op.0 >> 8)
            .map(|s| s.qp)
    }

    /// Accesses in flight.
    pub fn in_flight(&self) -> usize {
        self.io.iter().flatten().filter(|s| s.done.is_none()).count()
    }

    // ------------------------------------------------------------------ timers

    /// When [`CnDriver::handle_timeout`] must next run (the caller's clock), if ever.
    pub fn poll_timeout(&self) -> Option<u64> {
        let backoff = self.client.backoff_until();
        let deadline = self.chains.iter().flatten().filter_map(|c| c.deadline).min();
        match (backoff, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Expire what is due: an allocation unanswered past its deadline is given up
    /// ([`CnEvent::ReplyTimedOut`]); an "empty" back-off that ran out lets allocations go
    /// out again.
    pub fn handle_timeout(&mut self, now: u64) {
        for j in 0..MAX_ALLOC_CHAINS {
            let Some(c) = self.chains[j] else { continue };
            if c.deadline.is_some_and(|at| now >= at) && self.events.len() < EVENT_CAPACITY {
                self.chains[j] = None;
                if self.client.is_pending(c.token) {
                    self.client.abandon(c.token);
                    self.push(CnEvent::ReplyTimedOut { token: c.token });
                }
            }
        }
        self.client.expire_backoff(now);
    }
}
