//! The engine: the core's [`CnDriver`] and what the library keeps around it — the chunk table
//! behind [`Chunk`] handles, accesses in flight and their results, allocation waiters, the
//! reserve, frees waiting for their chunk's accesses, and the wakers of futures. Every method
//! is non-blocking and runs with the client's lock held; [`crate::Cn`] (blocking) and
//! [`crate::AsyncCn`] (futures) only decide how to wait between calls.
//!
//! The protocol stays in the core: requests, replies, tokens, staging and the slots' bounds
//! are the driver's. The engine decides only what a library user sees: which waiter gets an
//! allocation, when a free may go out (never while an access to its chunk is in flight: the
//! access would fail on a dead window and take the QP down), what a cancelled operation leaves
//! behind (nothing: its slot is released when the device is done with it, an allocation that
//! arrives for nobody goes to the reserve or back to the MN).

use crate::chunk::Chunk;
use crate::error::Error;
use crate::policy::{Options, ReservePolicy};
use crate::transport::{Link, Registered, Transport};
use omw_core::cn::driver::{AtomicOp, ChainConnection, CnDriver, CnError, CnEvent, LocalBuf, OpId};
use omw_core::cn::{Allocation, ClientError};
use omw_core::device::WcStatus;
use omw_core::ids::{Qpn, Rkey};
use omw_core::wire::message::ErrorCode;
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::task::Waker;
use std::time::{Duration, Instant};

/// Live allocations one client tracks (the reserve's included).
///
/// ```
/// assert!(omw_client::MAX_LIVE >= 1024);
/// ```
pub const MAX_LIVE: usize = 1024;
/// Accesses (staged, zero-copy, atomic) in flight at once: the driver's I/O slots, within
/// every transport's send-queue depth (model 64, verbs 256), so a full set of slots never
/// overruns a QP even when all use one. More wait for a slot.
///
/// ```
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
/// let c = cn.alloc().unwrap();
/// let hs: Vec<_> = (0..2 * omw_client::IO_SLOTS).map(|_| {
///     let (cn, c) = (cn.clone(), c.clone());
///     std::thread::spawn(move || { let mut b = [0u8; 8]; cn.read(&c, 0, &mut b).unwrap() })
/// }).collect();
/// for h in hs { h.join().unwrap(); } // back-pressure, not errors
/// ```
pub const IO_SLOTS: usize = 64;

pub(crate) type Driver<T> = CnDriver<T, MAX_LIVE, IO_SLOTS>;

/// What an access brought back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Output {
    None,
    Bytes(Vec<u8>),
    Word(u64),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ChunkState {
    /// A handle names it.
    User,
    /// In the reserve.
    Reserved,
    /// Its free waits for its accesses in flight (or a send slot).
    Freeing,
}

struct ChunkEntry {
    alloc: Allocation,
    in_flight: u32,
    state: ChunkState,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    /// Staged WRITE.
    Write,
    /// Staged READ of this many bytes.
    Read(usize),
    /// Zero-copy READ or WRITE into/from a registered buffer.
    ZeroCopy,
    Atomic,
}

struct OpEntry {
    core: OpId,
    chunk: u64,
    kind: Kind,
    result: Option<Result<Output, Error>>,
    waker: Option<Waker>,
    /// The waiter went away: release the slot when the device is done, report to nobody.
    abandoned: bool,
    /// What must live until the device is done (a dropped future's registered buffer).
    hold: Option<Box<dyn Any + Send>>,
    /// The device completed it (its slot is free).
    settled: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum AllocMode {
    /// Wait through "empty" until "available" (or the caller's deadline).
    Wait,
    /// [`Error::PoolEmpty`] as soon as the MN has no chunk.
    Try,
}

struct AllocWaiter {
    mode: AllocMode,
    result: Option<Result<Chunk, Error>>,
    waker: Option<Waker>,
}

/// What the client did, for the application's metrics and the benchmarks.
///
/// ```
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
/// let c = cn.alloc().unwrap();
/// cn.free(c).unwrap();
/// let s = cn.stats();
/// assert_eq!((s.allocs_round_trip, s.frees_to_mn), (1, 1));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Stats {
    /// Allocations answered from the reserve (no round trip).
    pub allocs_from_reserve: u64,
    /// Allocations that waited for the MN.
    pub allocs_round_trip: u64,
    /// Chunks the reserve requested in the background.
    pub reserve_refills: u64,
    /// Frees kept in the reserve (no request to the MN).
    pub frees_to_reserve: u64,
    /// Free requests sent to the MN (the reserve's returns included).
    pub frees_to_mn: u64,
    /// Reserved chunks returned because the MN said its pool is empty.
    pub reserve_returned_on_pressure: u64,
    /// Frees the MN refused (it sends no answer to a free that succeeds).
    pub free_refusals: u64,
    /// Allocations that arrived after their waiter had gone (kept in the reserve or freed).
    pub orphaned_allocs: u64,
    /// Chunks the MN took back while this CN stayed connected (`CnEvent::TakenBack`: a window
    /// the MN found bound elsewhere, one it could not bind again, an allocation it undid after
    /// its reply); their handles now fail with [`crate::Error::Freed`].
    pub taken_back: u64,
    /// Chain connections (Alloc, Free QPs) the library connected again after their QP broke
    /// ([`crate::transport::Transport::rejoin`]): the chunks it holds kept working.
    pub rejoins: u64,
}

pub(crate) struct Engine<T: Transport> {
    // first: dropped first, so the device is down before any held buffer is freed
    pub(crate) d: Driver<T>,
    pub(crate) client: u64,
    chunks: HashMap<u64, ChunkEntry>,
    by_entry: HashMap<u64, u64>,
    next_chunk: u64,
    ops: HashMap<u64, OpEntry>,
    next_op: u64,
    alloc_queue: VecDeque<u64>,
    alloc_waiters: HashMap<u64, AllocWaiter>,
    next_waiter: u64,
    /// Tokens of our allocation requests in flight: at most one per alloc chain of the CN
    /// (`CnDriver::alloc_chains`), so with several chains a burst of waiters overlaps.
    pending: Vec<u32>,
    reserve: VecDeque<u64>,
    policy: Option<ReservePolicy>,
    /// The MN said "empty" and has not said "available" since: the reserve went back and
    /// stays empty.
    pressure: bool,
    /// The MN refused an allocation for quota: the reserve stops refilling until a free.
    quota_hit: bool,
    /// The reserve fell below its low-water mark and is being refilled to its target.
    refilling: bool,
    frees: VecDeque<u64>,
    slot_wakers: Vec<Waker>,
    lost: bool,
    shut: bool,
    /// A thread sleeps on the signal fd.
    pub(crate) sleeping: bool,
    t0: Instant,
    pub(crate) stats: Stats,
    /// Caller buffers registered now.
    registered: usize,
    /// Chain connections whose QP broke, to rejoin at the next progress.
    broken: Vec<ChainConnection>,
}

fn cn_err<E: std::error::Error + Send + Sync + 'static>(e: CnError<E>) -> Error {
    match e {
        CnError::Device(e) => Error::transport(e),
        CnError::Client(c) => Error::Client(c),
        CnError::Misaligned { addr } => Error::Misaligned { offset: addr },
        CnError::AtomicsUnsupported => Error::AtomicsUnsupported,
        CnError::TooLong { len, max } => Error::TooLarge { len: len as u64, max: max as u64 },
        other => Error::transport(DriverRefused(other.to_string())),
    }
}

/// A driver refusal the library has no variant of (its own bug, never the caller's input).
#[derive(Debug)]
struct DriverRefused(String);
impl std::fmt::Display for DriverRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the CN driver refused: {}", self.0)
    }
}
impl std::error::Error for DriverRefused {}

/// A post the slots had no room for: wait for one and try again (back-pressure).
pub(crate) const BUSY: Option<u64> = None;

impl<T: Transport> Engine<T> {
    pub(crate) fn new(d: Driver<T>, client: u64, opts: Options) -> Self {
        Engine {
            d,
            client,
            chunks: HashMap::new(),
            by_entry: HashMap::new(),
            next_chunk: 1,
            ops: HashMap::new(),
            next_op: 1,
            alloc_queue: VecDeque::new(),
            alloc_waiters: HashMap::new(),
            next_waiter: 1,
            pending: Vec::new(),
            reserve: VecDeque::new(),
            policy: opts.reserve,
            pressure: false,
            quota_hit: false,
            refilling: false,
            frees: VecDeque::new(),
            slot_wakers: Vec::new(),
            lost: false,
            shut: false,
            sleeping: false,
            t0: Instant::now(),
            stats: Stats::default(),
            registered: 0,
            broken: Vec::new(),
        }
    }

    fn now(&self) -> u64 {
        self.t0.elapsed().as_nanos().min(u64::MAX as u128) as u64
    }

    pub(crate) fn connected(&self) -> bool {
        self.d.id().is_some()
    }

    pub(crate) fn chunk_size(&self) -> u64 {
        self.d.client().info().map_or(0, |i| i.chunk_size)
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost
    }

    /// When the driver's own timers next need running, as an instant.
    pub(crate) fn next_timer(&self) -> Option<Instant> {
        self.d.poll_timeout().and_then(|t| self.t0.checked_add(Duration::from_nanos(t)))
    }

    fn gone(&self) -> Option<Error> {
        if self.shut {
            Some(Error::Shutdown)
        } else if self.lost {
            Some(Error::Disconnected)
        } else {
            None
        }
    }

    // ------------------------------------------------------------------ progress

    /// Take what happened: the transport's events, the driver's completions and messages,
    /// then settle accesses, hand out allocations, send waiting frees and requests. Returns
    /// how much happened (0: nothing).
    pub(crate) fn progress(&mut self) -> Result<usize, Error> {
        let mut n = 0;
        if !self.lost {
            match self.d.backend.take_events().map_err(Error::transport)? {
                Link::Up => {}
                Link::Lost => {
                    self.on_lost();
                    n += 1;
                }
            }
        }
        let now = self.now();
        for _ in 0..4 {
            self.d.poll(now).map_err(cn_err)?;
            let mut got = 0;
            while let Some(ev) = self.d.next_event() {
                got += 1;
                self.on_event(ev);
            }
            n += got;
            if got < omw_core::cn::driver::EVENT_CAPACITY / 2 {
                break;
            }
        }
        self.d.handle_timeout(now);
        while let Some(ev) = self.d.next_event() {
            n += 1;
            self.on_event(ev);
        }
        n += self.settle()?;
        n += self.rejoin_broken()?;
        self.send_frees()?;
        self.dispatch_allocs()?;
        if self.d.free_io_slots() > 0 {
            for w in self.slot_wakers.drain(..) {
                w.wake();
            }
        }
        Ok(n)
    }

    /// A chain connection's QP broke (an access or request on it failed, its receives were
    /// flushed): rejoin it at the next progress; an access QP's loss is the connection's.
    fn broke(&mut self, qp: Qpn) {
        match self.d.chain_connection_of(qp) {
            Some(c) if !self.broken.contains(&c) => self.broken.push(c),
            Some(_) => {}
            None => self.on_lost(),
        }
    }

    /// Rejoin every broken chain connection (`Transport::rejoin`): its new QP goes to the
    /// driver, the old one is destroyed, the allocation that was in flight on it goes out again
    /// (its waiter still waits), and frees lost with it are sent again (the driver's). Where
    /// no rejoin is possible, the connection is lost.
    fn rejoin_broken(&mut self) -> Result<usize, Error> {
        let mut n = 0;
        while let Some(c) = self.broken.pop() {
            if self.lost {
                self.broken.clear();
                break;
            }
            let Some(old) = self.d.chain_qp(c) else { continue };
            let mem = *self.d.memory();
            match self.d.backend.rejoin(c, old, &mem) {
                Ok(Some(r)) => {
                    let now = self.now();
                    let replaced = self.d.replace_chain_qp(now, c, r.qp, r.primed).map_err(cn_err)?;
                    if let Some(t) = replaced.abandoned {
                        self.take_pending(t);
                    }
                    if replaced.old != r.qp {
                        let _ = self.d.backend.destroy_qp(replaced.old);
                    }
                    self.stats.rejoins += 1;
                    n += 1;
                }
                Ok(None) | Err(_) => self.on_lost(),
            }
        }
        Ok(n)
    }

    fn on_lost(&mut self) {
        self.lost = true;
        self.fail_waiters(Error::Disconnected);
        // accesses fail at once; a zero-copy access keeps its slot (and its buffer) until the
        // device flushes it
        for op in self.ops.values_mut() {
            if op.result.is_none() && !op.abandoned {
                op.result = Some(Err(Error::Disconnected));
                if let Some(w) = op.waker.take() {
                    w.wake();
                }
            }
        }
        for w in self.slot_wakers.drain(..) {
            w.wake();
        }
    }

    fn fail_waiters(&mut self, e: Error) {
        for id in self.alloc_queue.drain(..) {
            if let Some(w) = self.alloc_waiters.get_mut(&id) {
                w.result = Some(Err(e.clone()));
                if let Some(k) = w.waker.take() {
                    k.wake();
                }
            }
        }
    }

    fn fail_head(&mut self, e: Error) {
        if let Some(id) = self.alloc_queue.pop_front() {
            self.resolve(id, Err(e));
        }
    }

    fn fail_try_waiters(&mut self) {
        let tries: Vec<u64> = self
            .alloc_queue
            .iter()
            .copied()
            .filter(|id| self.alloc_waiters.get(id).is_some_and(|w| w.mode == AllocMode::Try))
            .collect();
        self.alloc_queue.retain(|id| !tries.contains(id));
        for id in tries {
            self.resolve(id, Err(Error::PoolEmpty));
        }
    }

    fn resolve(&mut self, id: u64, r: Result<Chunk, Error>) {
        if let Some(w) = self.alloc_waiters.get_mut(&id) {
            w.result = Some(r);
            if let Some(k) = w.waker.take() {
                k.wake();
            }
        }
    }

    fn on_event(&mut self, ev: CnEvent) {
        match ev {
            CnEvent::Allocated { token, result } => {
                self.take_pending(token);
                match result {
                    Ok(a) => self.adopt(a),
                    // the MN took the group back before this reply landed (an RNIC reset, a
                    // taken-back notice that overtook it): the waiter keeps waiting, and the
                    // next dispatch asks again for it
                    Err(ClientError::RevokedReply { .. } | ClientError::TakenBackReply { .. }) => {}
                    Err(e) => self.fail_head(Error::Client(e)),
                }
            }
            CnEvent::Refused { token, code, ours } => {
                if self.take_pending(token) {
                    match code {
                        ErrorCode::Empty => self.fail_try_waiters(),
                        ErrorCode::QuotaExceeded => {
                            self.quota_hit = true;
                            self.fail_head(Error::QuotaExceeded)
                        }
                        c => self.fail_head(Error::Refused(c)),
                    }
                } else if ours {
                    self.stats.free_refusals += 1;
                }
            }
            CnEvent::Empty => {
                self.pressure = true;
                self.fail_try_waiters();
                let n = self.reserve.len() as u64;
                self.stats.reserve_returned_on_pressure += n;
                while let Some(id) = self.reserve.pop_front() {
                    self.free_to_mn(id);
                }
            }
            CnEvent::Available => self.pressure = false,
            CnEvent::Revoked => {
                // the chunks of older pool generations are gone (their handles answer Freed);
                // one of the new generation that arrived before the notice stays, and so do
                // requests in flight (the driver's client decided both)
                let live = self.d.client().live();
                let gone: Vec<u64> =
                    self.chunks.iter().filter(|(_, c)| !live.contains(&c.alloc)).map(|(id, _)| *id).collect();
                for id in gone {
                    if let Some(c) = self.chunks.remove(&id) {
                        self.by_entry.remove(&c.alloc.entry_addr);
                    }
                    self.reserve.retain(|r| *r != id);
                    self.frees.retain(|f| *f != id);
                }
            }
            CnEvent::TakenBack { entry_addr, held: true } => {
                // the MN took this chunk back (the driver's client forgot it): its handle
                // answers Freed, and it is neither kept in the reserve nor freed again
                if let Some(id) = self.by_entry.remove(&entry_addr) {
                    self.chunks.remove(&id);
                    self.reserve.retain(|r| *r != id);
                    self.frees.retain(|f| *f != id);
                    self.stats.taken_back += 1;
                }
            }
            CnEvent::Rekeyed { entry_addr, .. } => {
                let fresh = self.d.client().live().iter().find(|a| a.entry_addr == entry_addr).cloned();
                if let (Some(a), Some(id)) = (fresh, self.by_entry.get(&entry_addr)) {
                    if let Some(c) = self.chunks.get_mut(id) {
                        c.alloc = a;
                    }
                }
            }
            CnEvent::ReplyTimedOut { token } if self.take_pending(token) => {
                self.fail_head(Error::Timeout { what: "the allocation reply" });
            }
            // a request's SEND failed: its QP broke. The allocation goes out again once the
            // connection is rejoined (its waiter keeps waiting); a free lost with it is the
            // driver's to send again
            CnEvent::SendFailed { qp, token, status } if !self.lost => {
                if self.d.chain_connection_of(qp).is_some() {
                    if let Some(t) = token {
                        self.take_pending(t);
                    }
                    self.broke(qp);
                } else if token.is_some_and(|t| self.take_pending(t)) {
                    self.fail_head(Error::Access(status));
                }
            }
            // a message queue left RTS: the MN's end is gone or broke the pair — a chain
            // connection is rejoined, access QP 0's loss is the connection's
            CnEvent::ReceiveFailed { qp, .. } if !self.lost => self.broke(qp),
            _ => {}
        }
    }

    /// Our allocation requests in flight (at most one per alloc chain).
    pub(crate) fn allocs_in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Whether `token` was one of our requests in flight (it is not any more).
    fn take_pending(&mut self, token: u32) -> bool {
        match self.pending.iter().position(|t| *t == token) {
            Some(i) => {
                self.pending.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// A chunk arrived: the oldest waiter's, else the reserve's, else back to the MN.
    fn adopt(&mut self, a: Allocation) {
        let id = self.next_chunk;
        self.next_chunk += 1;
        self.by_entry.insert(a.entry_addr, id);
        let size = a.length;
        self.chunks.insert(id, ChunkEntry { alloc: a, in_flight: 0, state: ChunkState::Reserved });
        if let Some(w) = self.alloc_queue.pop_front() {
            self.stats.allocs_round_trip += 1;
            if let Some(c) = self.chunks.get_mut(&id) {
                c.state = ChunkState::User;
            }
            self.resolve(w, Ok(Chunk { id, size, client: self.client }));
        } else if self.policy.is_some_and(|p| self.reserve.len() < p.high()) && !self.pressure && !self.shut {
            self.stats.reserve_refills += 1;
            self.reserve.push_back(id);
        } else {
            self.stats.orphaned_allocs += 1;
            self.free_to_mn(id);
        }
    }

    /// Waiting allocations take reserved chunks first, oldest first (a burst may queue
    /// waiters while a background refill lands in the reserve).
    fn serve_from_reserve(&mut self) {
        while !self.alloc_queue.is_empty() {
            let Some(id) = self.reserve.pop_front() else { return };
            let Some(c) = self.chunks.get_mut(&id) else { continue };
            c.state = ChunkState::User;
            let size = c.alloc.length;
            self.stats.allocs_from_reserve += 1;
            if let Some(w) = self.alloc_queue.pop_front() {
                self.resolve(w, Ok(Chunk { id, size, client: self.client }));
            }
        }
    }

    fn dispatch_allocs(&mut self) -> Result<(), Error> {
        self.serve_from_reserve();
        if self.pending.len() >= self.d.alloc_chains() || self.lost || !self.connected() {
            return Ok(());
        }
        let waiting = self.alloc_queue.len();
        let refill = match self.policy {
            Some(p) if !self.pressure && !self.quota_hit && !self.shut => {
                if self.reserve.len() < p.low() {
                    self.refilling = true;
                }
                if self.reserve.len() >= p.target() {
                    self.refilling = false;
                }
                self.refilling
            }
            _ => {
                self.refilling = false;
                false
            }
        };
        // a request per waiter and, refilling, per chunk the reserve lacks — at most one in
        // flight per alloc chain
        let lacking = match (refill, self.policy) {
            (true, Some(p)) => p.target().saturating_sub(self.reserve.len()),
            _ => 0,
        };
        let wanted = waiting.max(lacking).min(self.d.alloc_chains());
        while self.pending.len() < wanted {
            let now = self.now();
            match self.d.alloc(now) {
                Ok(t) => self.pending.push(t),
                Err(CnError::Client(ClientError::Backoff { .. })) => {
                    self.fail_try_waiters();
                    break;
                }
                Err(CnError::SlotsBusy) | Err(CnError::Client(ClientError::Busy)) => break,
                Err(CnError::Client(ClientError::TooManyAllocations)) => {
                    self.fail_head(Error::Client(ClientError::TooManyAllocations));
                    break;
                }
                Err(e) => return Err(cn_err(e)),
            }
        }
        Ok(())
    }

    // ------------------------------------------------------------------ allocation

    /// Ask for a chunk: from the reserve at once, or a waiter whose result comes later.
    pub(crate) fn start_alloc(&mut self, mode: AllocMode) -> Result<AllocTicket, Error> {
        if let Some(e) = self.gone() {
            return Err(e);
        }
        if self.alloc_queue.is_empty() {
            if let Some(id) = self.reserve.pop_front() {
                if let Some(c) = self.chunks.get_mut(&id) {
                    c.state = ChunkState::User;
                    self.stats.allocs_from_reserve += 1;
                    let size = c.alloc.length;
                    return Ok(AllocTicket::Ready(Chunk { id, size, client: self.client }));
                }
            }
        }
        if mode == AllocMode::Try && self.d.client().is_backing_off(self.now()) {
            return Err(Error::PoolEmpty);
        }
        let id = self.next_waiter;
        self.next_waiter += 1;
        self.alloc_waiters.insert(id, AllocWaiter { mode, result: None, waker: None });
        self.alloc_queue.push_back(id);
        self.dispatch_allocs()?;
        Ok(AllocTicket::Waiting(id))
    }

    pub(crate) fn take_alloc(&mut self, id: u64, waker: Option<&Waker>) -> Option<Result<Chunk, Error>> {
        let w = self.alloc_waiters.get_mut(&id)?;
        if let Some(r) = w.result.take() {
            self.alloc_waiters.remove(&id);
            return Some(r);
        }
        if let Some(k) = waker {
            w.waker = Some(k.clone());
        }
        None
    }

    /// The waiter went away: out of the queue; a chunk it was already handed goes to the
    /// reserve or back to the MN.
    pub(crate) fn cancel_alloc(&mut self, id: u64) {
        self.alloc_queue.retain(|w| *w != id);
        if let Some(AllocWaiter { result: Some(Ok(c)), .. }) = self.alloc_waiters.remove(&id) {
            self.stats.orphaned_allocs += 1;
            self.release_chunk(c.id);
        }
    }

    // ------------------------------------------------------------------ free

    /// Give a chunk back: into the reserve while it is below its high-water mark, else to the
    /// MN once no access to it is in flight.
    pub(crate) fn free(&mut self, chunk: Chunk) -> Result<(), Error> {
        self.check_owner(&chunk)?;
        match self.chunks.get(&chunk.id) {
            Some(c) if c.state == ChunkState::User => {}
            _ => return Err(Error::Freed),
        }
        if let Some(e) = self.gone() {
            return Err(e);
        }
        self.quota_hit = false;
        self.release_chunk(chunk.id);
        self.send_frees()
    }

    fn release_chunk(&mut self, id: u64) {
        let keep = self.policy.is_some_and(|p| self.reserve.len() < p.high()) && !self.pressure && !self.shut;
        match self.chunks.get_mut(&id) {
            Some(c) if keep && c.in_flight == 0 => {
                c.state = ChunkState::Reserved;
                self.reserve.push_back(id);
                self.stats.frees_to_reserve += 1;
            }
            Some(_) => self.free_to_mn(id),
            None => {}
        }
    }

    fn free_to_mn(&mut self, id: u64) {
        if let Some(c) = self.chunks.get_mut(&id) {
            c.state = ChunkState::Freeing;
            self.frees.push_back(id);
        }
    }

    fn send_frees(&mut self) -> Result<(), Error> {
        if self.lost {
            return Ok(());
        }
        let mut i = 0;
        while i < self.frees.len() {
            let id = self.frees[i];
            let Some(c) = self.chunks.get(&id) else {
                self.frees.remove(i);
                continue;
            };
            if c.in_flight > 0 {
                i += 1;
                continue;
            }
            match self.d.free(&c.alloc) {
                Ok(_) => {
                    self.stats.frees_to_mn += 1;
                    let entry = c.alloc.entry_addr;
                    self.chunks.remove(&id);
                    self.by_entry.remove(&entry);
                    self.frees.remove(i);
                }
                Err(CnError::SlotsBusy) => return Ok(()),
                // the client no longer holds it (revoked meanwhile): nothing to send
                Err(CnError::Client(ClientError::NotMine { .. })) => {
                    let entry = c.alloc.entry_addr;
                    self.chunks.remove(&id);
                    self.by_entry.remove(&entry);
                    self.frees.remove(i);
                }
                Err(e) => return Err(cn_err(e)),
            }
        }
        Ok(())
    }

    /// Frees and allocation requests not yet on the wire, and requests whose SEND has not
    /// completed: what a shutdown must wait for.
    pub(crate) fn requests_outstanding(&self) -> usize {
        self.frees.len() + self.d.sends_in_flight()
    }

    /// Return the reserve and refuse new work (the shutdown's first half).
    pub(crate) fn shut_down(&mut self) {
        if self.shut {
            return;
        }
        self.shut = true;
        self.fail_waiters(Error::Shutdown);
        while let Some(id) = self.reserve.pop_front() {
            self.free_to_mn(id);
        }
        let _ = self.send_frees();
    }

    // ------------------------------------------------------------------ accesses

    fn check_owner(&self, chunk: &Chunk) -> Result<(), Error> {
        if chunk.client != self.client {
            return Err(Error::Foreign);
        }
        Ok(())
    }

    /// The live allocation behind a handle, the MN address of the range and the window's key.
    fn target(&self, chunk: &Chunk, offset: u64, len: u64) -> Result<(u64, Rkey), Error> {
        self.check_owner(chunk)?;
        if let Some(e) = self.gone() {
            return Err(e);
        }
        let c = match self.chunks.get(&chunk.id) {
            Some(c) if c.state == ChunkState::User => c,
            _ => return Err(Error::Freed),
        };
        let addr = c.alloc.span(offset, len)?;
        let rkey = c.alloc.rkey(0).ok_or(Error::Freed)?;
        Ok((addr, rkey))
    }

    /// The range lies inside a live chunk of this client.
    pub(crate) fn check_range(&self, chunk: &Chunk, offset: u64, len: u64) -> Result<(), Error> {
        self.target(chunk, offset, len).map(|_| ())
    }

    fn track(&mut self, core: OpId, chunk: u64, kind: Kind) -> u64 {
        let id = self.next_op;
        self.next_op += 1;
        if let Some(c) = self.chunks.get_mut(&chunk) {
            c.in_flight += 1;
        }
        self.ops.insert(
            id,
            OpEntry { core, chunk, kind, result: None, waker: None, abandoned: false, hold: None, settled: false },
        );
        id
    }

    fn post_result(
        &mut self,
        r: Result<OpId, CnError<T::Error>>,
        chunk: u64,
        kind: Kind,
    ) -> Result<Option<u64>, Error> {
        match r {
            Ok(op) => Ok(Some(self.track(op, chunk, kind))),
            Err(CnError::SlotsBusy) => Ok(BUSY),
            Err(e) => Err(cn_err(e)),
        }
    }

    /// A staged WRITE of `data` (at most one staging slot); `None`: every slot is busy.
    pub(crate) fn post_write(&mut self, chunk: &Chunk, offset: u64, data: &[u8]) -> Result<Option<u64>, Error> {
        let (addr, rkey) = self.target(chunk, offset, data.len() as u64)?;
        let r = self.d.post_write(0, addr, rkey, data);
        self.post_result(r, chunk.id, Kind::Write)
    }

    /// A staged READ of `len` bytes (at most one staging slot).
    pub(crate) fn post_read(&mut self, chunk: &Chunk, offset: u64, len: usize) -> Result<Option<u64>, Error> {
        let (addr, rkey) = self.target(chunk, offset, len as u64)?;
        let r = self.d.post_read(0, addr, rkey, len);
        self.post_result(r, chunk.id, Kind::Read(len))
    }

    /// A zero-copy access between the chunk and `len` bytes of a registered buffer at
    /// `buf_off`; `bytes`: a WRITE's source, copied into the device's mirror first where the
    /// transport keeps one.
    pub(crate) fn post_zero_copy(
        &mut self,
        chunk: &Chunk,
        offset: u64,
        reg: &Registered,
        buf_off: usize,
        len: usize,
        write: Option<&[u8]>,
    ) -> Result<Option<u64>, Error> {
        let (addr, rkey) = self.target(chunk, offset, len as u64)?;
        let max = self.d.backend.max_message_len().min(u32::MAX as u64);
        if len as u64 > max {
            return Err(Error::TooLarge { len: len as u64, max });
        }
        if self.d.free_io_slots() == 0 {
            return Ok(BUSY);
        }
        let local = LocalBuf { addr: reg.device_addr + buf_off as u64, lkey: reg.lkey, len: len as u32 };
        if let (Some(src), true) = (write, self.d.backend.mirrors_buffers()) {
            omw_core::device::DataPath::write_local(&mut self.d.backend, local.addr, src).map_err(Error::transport)?;
        }
        let r = match write {
            Some(_) => self.d.post_write_from(0, addr, rkey, local),
            None => self.d.post_read_into(0, addr, rkey, local),
        };
        self.post_result(r, chunk.id, Kind::ZeroCopy)
    }

    /// After a zero-copy READ completed: where the transport mirrors buffers, copy the bytes
    /// out of the mirror into the caller's buffer.
    pub(crate) fn copy_out(&self, reg: &Registered, buf_off: usize, out: &mut [u8]) -> Result<(), Error> {
        if self.d.backend.mirrors_buffers() {
            omw_core::device::DataPath::read_local(&self.d.backend, reg.device_addr + buf_off as u64, out)
                .map_err(Error::transport)?;
        }
        Ok(())
    }

    /// An 8-byte atomic at `offset`.
    pub(crate) fn post_atomic(&mut self, chunk: &Chunk, offset: u64, op: AtomicOp) -> Result<Option<u64>, Error> {
        if !offset.is_multiple_of(8) {
            self.check_owner(chunk)?;
            return Err(Error::Misaligned { offset });
        }
        let (addr, rkey) = self.target(chunk, offset, 8)?;
        let r = self.d.post_atomic(0, addr, rkey, op);
        self.post_result(r, chunk.id, Kind::Atomic)
    }

    /// Settle every access the device completed: copy out its result, free its slot, count
    /// its chunk's access done, wake its waiter (or drop what a cancelled one left).
    fn settle(&mut self) -> Result<usize, Error> {
        let mut n = 0;
        let mut gone = Vec::new();
        let ids: Vec<u64> = self.ops.iter().filter(|(_, o)| !o.settled).map(|(i, _)| *i).collect();
        for id in ids {
            let Some(op) = self.ops.get(&id) else { continue };
            let Some(status) = self.d.op_status(op.core).map_err(cn_err)? else { continue };
            let (core, kind, chunk) = (op.core, op.kind, op.chunk);
            // a failed access broke its QP: one of a chain connection (windows on the Alloc
            // QP) is rejoined
            if status != WcStatus::Success && !self.lost {
                if let Some(q) = self.d.op_qpn(core).filter(|q| self.d.chain_connection_of(*q).is_some()) {
                    self.broke(q);
                }
            }
            let want = match kind {
                Kind::Read(len) => len,
                Kind::Atomic => 8,
                _ => 0,
            };
            let mut buf = vec![0u8; want];
            let done = self.d.access_done(core, &mut buf).map_err(cn_err)?;
            n += 1;
            if let Some(c) = self.chunks.get_mut(&chunk) {
                c.in_flight = c.in_flight.saturating_sub(1);
            }
            let out = match (kind, done.map(|d| d.len)) {
                (Kind::Read(_), Some(l)) => {
                    buf.truncate(l);
                    Output::Bytes(buf)
                }
                (Kind::Atomic, Some(8)) => {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&buf);
                    Output::Word(u64::from_le_bytes(w))
                }
                _ => Output::None,
            };
            let r = match status {
                WcStatus::Success => Ok(out),
                s if self.lost => {
                    let _ = s;
                    Err(Error::Disconnected)
                }
                s => Err(Error::Access(s)),
            };
            let Some(op) = self.ops.get_mut(&id) else { continue };
            op.settled = true;
            if op.abandoned {
                gone.push(id);
                continue;
            }
            if op.result.is_none() {
                op.result = Some(r);
            }
            if let Some(w) = op.waker.take() {
                w.wake();
            }
        }
        for id in gone {
            // a held buffer is released here (its deregistration is queued, never locked)
            self.ops.remove(&id);
        }
        Ok(n)
    }

    /// Whether the device is done with an access (its slot free); its result if the waiter
    /// may have it. A zero-copy access is finished only once the device is done with the
    /// buffer, even when its result (a lost connection) was known earlier.
    pub(crate) fn take_op(&mut self, id: u64, waker: Option<&Waker>) -> Option<Result<Output, Error>> {
        let op = self.ops.get_mut(&id)?;
        let ready = op.result.is_some() && (op.settled || op.kind != Kind::ZeroCopy);
        if ready {
            let r = op.result.take();
            if op.settled {
                self.ops.remove(&id);
            } else {
                // staged or atomic: nothing of the caller's is in the device's hands
                op.abandoned = true;
            }
            return r;
        }
        if let Some(w) = waker {
            op.waker = Some(w.clone());
        }
        None
    }

    /// The waiter of an access went away (a dropped future): keep `hold` alive until the
    /// device is done, then release the slot.
    pub(crate) fn abandon_op(&mut self, id: u64, hold: Option<Box<dyn Any + Send>>) {
        if let Some(op) = self.ops.get_mut(&id) {
            if op.settled {
                self.ops.remove(&id);
            } else {
                op.abandoned = true;
                op.waker = None;
                op.hold = hold;
            }
        }
    }

    /// Wake `w` when an I/O slot frees up.
    #[cfg(feature = "tokio")]
    pub(crate) fn wait_for_slot(&mut self, w: &Waker) {
        if !self.slot_wakers.iter().any(|k| k.will_wake(w)) {
            self.slot_wakers.push(w.clone());
        }
    }

    /// Accesses the device still holds.
    pub(crate) fn in_flight(&self) -> usize {
        self.ops.values().filter(|o| !o.settled).count()
    }

    pub(crate) fn reserve_len(&self) -> usize {
        self.reserve.len()
    }

    pub(crate) fn held_chunks(&self) -> usize {
        self.chunks.len()
    }

    pub(crate) fn deregister(&mut self, reg: &Registered) {
        if self.d.backend.deregister(reg).is_ok() {
            self.registered = self.registered.saturating_sub(1);
        }
    }

    pub(crate) fn register(&mut self, addr: u64, len: u64) -> Result<Registered, Error> {
        let r = self.d.backend.register(addr, len).map_err(Error::transport)?;
        self.registered += 1;
        Ok(r)
    }

    pub(crate) fn registered(&self) -> usize {
        self.registered
    }
}

/// What [`Engine::start_alloc`] gave.
pub(crate) enum AllocTicket {
    Ready(Chunk),
    Waiting(u64),
}
