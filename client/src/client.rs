//! [`Cn`]: the client, a `Send + Sync` handle (cheap to clone) over one CN connection.
//!
//! **Why one shared handle, not per-thread handles.** A CN connection is one set of QPs to
//! the MN (the Alloc and Free QPs and G − 1 access QPs): more QPs would mean more sessions,
//! each taking an MN slot and its own quota. Over shared QPs the completion queues are shared
//! too — a thread polling a CQ reaps other threads' completions — so one engine must route
//! them whichever handle asked. Every clone of a `Cn` is that engine behind one lock, held
//! only to post work and to harvest completions (never while waiting): a thread posts, then
//! waits outside the lock — polling for [`WaitPolicy::spin`], then asleep on the event fd
//! (one sleeper per client; the others are woken when it has harvested). Many threads
//! therefore keep many accesses in flight on the same QPs, bounded by the driver's I/O slots
//! ([`IO_SLOTS`]); a thread that finds them all busy waits for one (back-pressure), it does
//! not fail.

use crate::chunk::Chunk;
use crate::engine::{AllocMode, AllocTicket, Driver, Engine, Output, Stats};
pub use crate::engine::{IO_SLOTS, MAX_LIVE};
use crate::error::Error;
use crate::mr::{LocalMr, MrBuffer, Registrar};
use crate::policy::{Options, WaitPolicy};
use crate::transport::{Connection, Registered, Signal, Transport};
use omw_core::cn::driver::{AtomicOp, CnDriver};
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

static NEXT_CLIENT: AtomicU64 = AtomicU64::new(1);

/// Something a [`Cn`] can connect through: a transport's connect step.
///
/// ```
/// use omw_client::Connect;
/// let model = omw_client::model::Model::start(Default::default()).unwrap();
/// let c = (&model).connect().unwrap();
/// assert!(!c.qps.access.is_empty());
/// ```
pub trait Connect {
    type Transport: Transport;
    /// Connect a CN and hand over its device, QPs and memory.
    fn connect(self) -> Result<Connection<Self::Transport>, Error>;
}

pub(crate) struct Shared<T: Transport> {
    pub(crate) engine: Mutex<Engine<T>>,
    pub(crate) cv: Condvar,
    pub(crate) signal: T::Signal,
    /// Registrations of dropped [`LocalMr`]s, deregistered at the next lock (a handle may be
    /// dropped while the engine is locked).
    released: Mutex<Vec<Registered>>,
    pub(crate) id: u64,
    pub(crate) opts: Options,
    stop: AtomicBool,
    /// Async driver tasks watching the fd ([`crate::AsyncCn`]): while one runs, blocking
    /// waiters sleep on the condvar it notifies after every harvest, never on the fd itself
    /// (the task takes the fd's events; a thread asleep on the fd would not hear of them).
    pub(crate) drivers: std::sync::atomic::AtomicUsize,
}

impl<T: Transport> Registrar for Shared<T> {
    fn release(&self, reg: Registered) {
        if let Ok(mut r) = self.released.lock() {
            r.push(reg);
        }
    }
}

impl<T: Transport> Shared<T> {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Engine<T>> {
        let mut e = self.engine.lock().unwrap_or_else(|p| p.into_inner());
        let released: Vec<Registered> = match self.released.lock() {
            Ok(mut r) => std::mem::take(&mut *r),
            Err(_) => Vec::new(),
        };
        for reg in released {
            e.deregister(&reg);
        }
        e
    }
}

impl<T: Transport> Drop for Shared<T> {
    /// The last handle went: return the reserve and let the frees reach the MN (bounded),
    /// then the device goes down with the engine.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let e = self.engine.get_mut().unwrap_or_else(|p| p.into_inner());
        e.shut_down();
        let deadline = Instant::now() + Duration::from_secs(1);
        while e.requests_outstanding() > 0 && !e.is_lost() && Instant::now() < deadline {
            if e.progress().is_err() {
                break;
            }
            std::thread::yield_now();
        }
    }
}

/// The client: one CN connection, shared by every clone of the handle (see the module
/// documentation for why).
///
/// ```
/// use omw_client::{model::Model, Cn};
/// let model = Model::start(Default::default()).unwrap();
/// let cn = Cn::connect(&model, Default::default()).unwrap();
/// let chunk = cn.alloc().unwrap();
/// cn.write(&chunk, 0, b"hello").unwrap();
/// let mut back = [0u8; 5];
/// cn.read(&chunk, 0, &mut back).unwrap();
/// assert_eq!(&back, b"hello");
/// // another thread, the same connection
/// let cn2 = cn.clone();
/// let chunk2 = chunk.clone();
/// std::thread::spawn(move || cn2.write(&chunk2, 8, b"there").unwrap()).join().unwrap();
/// cn.free(chunk).unwrap();
/// ```
pub struct Cn<T: Transport> {
    pub(crate) shared: Arc<Shared<T>>,
}

impl<T: Transport> Clone for Cn<T> {
    fn clone(&self) -> Self {
        Cn { shared: self.shared.clone() }
    }
}

impl<T: Transport> std::fmt::Debug for Cn<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cn").field("client", &self.shared.id).finish()
    }
}

/// A staged access is split into pieces of at most one staging slot.
fn pieces(offset: u64, len: usize, piece: usize) -> impl Iterator<Item = (u64, Range<usize>)> {
    let piece = piece.max(1);
    (0..len.div_ceil(piece)).map(move |k| {
        let start = k * piece;
        let end = (start + piece).min(len);
        (offset + start as u64, start..end)
    })
}

impl<T: Transport> Cn<T> {
    /// Connect through `to` (a [`crate::model::Model`], a [`crate::verbs::Target`]) and wait
    /// for the MN's connect info.
    ///
    /// ```
    /// # use omw_client::{model::Model, Cn, Options};
    /// let model = Model::start(Default::default()).unwrap();
    /// let cn = Cn::connect(&model, Options::default()).unwrap();
    /// assert!(cn.chunk_size() > 0);
    /// ```
    pub fn connect<C: Connect<Transport = T>>(to: C, opts: Options) -> Result<Self, Error> {
        Self::new(to.connect()?, opts)
    }

    /// Take over a connected CN.
    ///
    /// ```
    /// # use omw_client::{model::Model, Cn, Connect};
    /// let model = Model::start(Default::default()).unwrap();
    /// let cn = Cn::new((&model).connect().unwrap(), Default::default()).unwrap();
    /// assert_eq!(cn.held_chunks(), 0);
    /// ```
    pub fn new(conn: Connection<T>, opts: Options) -> Result<Self, Error> {
        let Connection { device, qps, mem, primed, mn_qpns, extra_alloc, reply_len } = conn;
        let signal = device.signal().map_err(Error::transport)?;
        let d: Result<Driver<T>, _> =
            if primed { CnDriver::with_primed_receives(device, qps, mem) } else { CnDriver::new(device, qps, mem) };
        // no reply deadline in the driver: a request given up on would leave its chunk, when
        // the answer comes after all, held at the MN and forgotten here. The MN answers every
        // request (a reply, a refusal, or after "available" for a parked one), or the
        // connection breaks; waiters give up on their own deadlines, and whatever arrives for
        // nobody goes to the reserve or back to the MN.
        let mut d = d.map_err(|e| Error::transport(DriverSetup(e.to_string())))?;
        if !extra_alloc.is_empty() {
            // several alloc chains: as many allocations in flight at once
            d = d
                .with_alloc_chains(&extra_alloc, reply_len)
                .map_err(|e| Error::transport(DriverSetup(e.to_string())))?;
        }
        d.reply_timeout = 0;
        // after "empty", wait for "available" (the MN broadcasts it once the pool refilled):
        // a request sent while the MN has this CN parked finds no receive (offloaded: the
        // chain is not armed) and fails the Alloc QP once the transport's RNR retries run out
        d.client_mut().backoff = u64::MAX;
        let id = NEXT_CLIENT.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(Shared {
            engine: Mutex::new(Engine::new(d, id, opts)),
            cv: Condvar::new(),
            signal,
            released: Mutex::new(Vec::new()),
            id,
            opts,
            stop: AtomicBool::new(false),
            drivers: std::sync::atomic::AtomicUsize::new(0),
        });
        let cn = Cn { shared };
        let deadline = Instant::now() + opts.timeout;
        cn.wait_until(Some(deadline), |e| e.connected().then_some(())).map_err(|e| {
            if matches!(e, Error::Timeout { .. }) { Error::Timeout { what: "the MN's connect info" } } else { e }
        })?;
        // the connect info names the MN's ends of our QPs: they must be the ones the transport
        // connected us to
        // (where the MN binds every window to our Alloc QP's MN end,
        // `ConnectFlags::WINDOWS_ON_ALLOC_QP`, the access entries name that QP)
        let told = cn.lock().d.client().info().map(|i| {
            let on_alloc = i.flags.contains(omw_core::wire::message::ConnectFlags::WINDOWS_ON_ALLOC_QP);
            let ends = [i.alloc_qpn, i.free_qpn].into_iter().chain(i.access_qpns.iter().copied());
            (on_alloc, ends.collect::<Vec<_>>())
        });
        let (on_alloc, told) = told.unwrap_or_default();
        for (i, (t, n)) in told.iter().zip(&mn_qpns).enumerate() {
            let want = if on_alloc && i >= 2 { mn_qpns.first().copied().flatten() } else { *n };
            if want.is_some_and(|n| n != *t) {
                return Err(Error::WrongSession { connection: i });
            }
        }
        if opts.reserve.is_some() {
            cn.spawn_background();
        }
        Ok(cn)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Engine<T>> {
        self.shared.lock()
    }

    /// The MN's chunk size.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// assert_eq!(cn.chunk_size(), model.config().chunk_size);
    /// ```
    pub fn chunk_size(&self) -> u64 {
        self.lock().chunk_size()
    }

    /// What the client did so far.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// assert_eq!(cn.stats(), omw_client::Stats::default());
    /// ```
    pub fn stats(&self) -> Stats {
        self.lock().stats
    }

    /// Chunks this client holds from the MN (handed out, reserved, or being freed).
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let c = cn.alloc().unwrap();
    /// assert_eq!(cn.held_chunks(), 1);
    /// # cn.free(c).unwrap();
    /// ```
    pub fn held_chunks(&self) -> usize {
        self.lock().held_chunks()
    }

    /// Chunks in the reserve right now.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// assert_eq!(cn.reserved(), 0); // no reserve configured
    /// ```
    pub fn reserved(&self) -> usize {
        self.lock().reserve_len()
    }

    /// Caller buffers registered with this client right now ([`LocalMr`]s alive, and those a
    /// dropped future keeps until the device is done with them).
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let mr = cn.register(vec![0u8; 8]).unwrap();
    /// assert_eq!(cn.registered_buffers(), 1);
    /// drop(mr);
    /// assert_eq!(cn.registered_buffers(), 0);
    /// ```
    pub fn registered_buffers(&self) -> usize {
        self.lock().registered()
    }

    /// Accesses the device still holds.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// assert_eq!(cn.in_flight(), 0);
    /// ```
    pub fn in_flight(&self) -> usize {
        self.lock().in_flight()
    }

    /// The alloc chains this client opened (its Alloc QPs): how many of its allocation
    /// requests may be in flight at once.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// assert_eq!(cn.alloc_chains(), 1);
    /// ```
    pub fn alloc_chains(&self) -> usize {
        self.lock().d.alloc_chains()
    }

    /// Allocation requests sent to the MN and not yet answered (at most
    /// [`Cn::alloc_chains`]): waiters beyond that wait for a chain.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// assert_eq!(cn.allocs_in_flight(), 0);
    /// ```
    pub fn allocs_in_flight(&self) -> usize {
        self.lock().allocs_in_flight()
    }

    /// Whether remote atomics work on this connection (the device has them and the MN's
    /// windows grant them).
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// assert!(cn.atomics_available()); // the canonical model carries them
    /// ```
    pub fn atomics_available(&self) -> bool {
        self.lock().d.atomics_available()
    }

    // ------------------------------------------------------------------ the event fd

    /// The event fd (a completion channel on verbs): it turns readable when something may
    /// have completed. For the caller's own event loop: [`Cn::arm`], sleep until readable,
    /// [`Cn::progress`].
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// assert!(cn.fd() >= 0);
    /// ```
    pub fn fd(&self) -> RawFd {
        self.shared.signal.as_raw_fd()
    }

    /// Another handle on the event fd, for an event loop that wants more than the raw fd: it
    /// can sleep on it ([`Signal::wait`]) or register it with tokio ([`Signal::to_async`] with
    /// feature `tokio`).
    ///
    /// ```
    /// use omw_client::transport::Signal;
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let s = cn.signal().unwrap();
    /// assert!(!cn.arm().unwrap());
    /// assert!(!s.wait(std::time::Duration::from_millis(1)).unwrap()); // nothing happened
    /// ```
    pub fn signal(&self) -> Result<T::Signal, Error> {
        self.lock().d.backend.signal().map_err(Error::transport)
    }

    /// Ask for a signal on the fd at the next completion. Returns `true` if something had
    /// already arrived (then do not sleep: call [`Cn::progress`]).
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// loop {
    ///     cn.progress().unwrap();
    ///     if !cn.arm().unwrap() {
    ///         break; // now sleep on cn.fd() (poll/epoll/AsyncFd), then progress again
    ///     }
    /// }
    /// ```
    pub fn arm(&self) -> Result<bool, Error> {
        let mut e = self.lock();
        e.d.backend.arm().map_err(Error::transport)?;
        let n = e.progress()?;
        drop(e);
        if n > 0 {
            self.shared.cv.notify_all();
        }
        Ok(n > 0)
    }

    /// Harvest what happened (completions, messages, timers) without waiting; how much did.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let n = cn.progress().unwrap();
    /// assert_eq!(n, 0); // nothing in flight
    /// ```
    pub fn progress(&self) -> Result<usize, Error> {
        let n = self.lock().progress()?;
        if n > 0 {
            self.shared.cv.notify_all();
        }
        Ok(n)
    }

    /// Wait until `f` says done (its value) or `deadline` passed, progressing meanwhile by the
    /// client's [`WaitPolicy`].
    pub(crate) fn wait_until<R>(
        &self,
        deadline: Option<Instant>,
        mut f: impl FnMut(&mut Engine<T>) -> Option<R>,
    ) -> Result<R, Error> {
        let policy: WaitPolicy = self.shared.opts.wait;
        let start = Instant::now();
        loop {
            let mut e = self.lock();
            let moved = e.progress()?;
            if let Some(r) = f(&mut e) {
                drop(e);
                if moved > 0 {
                    self.shared.cv.notify_all();
                }
                return Ok(r);
            }
            if moved > 0 {
                self.shared.cv.notify_all();
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Err(Error::Timeout { what: "the operation" });
            }
            if now.duration_since(start) < policy.spin {
                drop(e);
                std::hint::spin_loop();
                continue;
            }
            let mut nap = policy.max_sleep;
            if let Some(d) = deadline {
                nap = nap.min(d.saturating_duration_since(now));
            }
            if let Some(t) = e.next_timer() {
                nap = nap.min(t.saturating_duration_since(now));
            }
            let driven = self.shared.drivers.load(Ordering::Acquire) > 0;
            if !e.sleeping && !driven {
                // this thread watches the fd for everyone
                e.sleeping = true;
                e.d.backend.arm().map_err(Error::transport)?;
                // whatever arrived before the arming signals nothing: look once more
                if e.progress()? > 0 {
                    e.sleeping = false;
                    drop(e);
                    self.shared.cv.notify_all();
                    continue;
                }
                drop(e);
                let _ = self.shared.signal.wait(nap);
                self.lock().sleeping = false;
                self.shared.cv.notify_all();
            } else {
                let _ = self.shared.cv.wait_timeout(e, nap);
            }
        }
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.shared.opts.timeout
    }

    // ------------------------------------------------------------------ allocation

    /// One chunk: from the reserve at once, else from the MN — waiting through "empty" until
    /// "available" (or [`Options::timeout`]: then [`Error::PoolEmpty`]).
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let c = cn.alloc().unwrap();
    /// assert_eq!(c.size(), cn.chunk_size());
    /// ```
    pub fn alloc(&self) -> Result<Chunk, Error> {
        self.alloc_mode(AllocMode::Wait)
    }

    /// One chunk, or [`Error::PoolEmpty`] as soon as the MN has none.
    ///
    /// ```
    /// use omw_client::{model::{Model, ModelConfig}, Cn, Error};
    /// let model = Model::start(ModelConfig { chunks: 2, ..Default::default() }).unwrap();
    /// let cn = Cn::connect(&model, Default::default()).unwrap();
    /// let _a = cn.try_alloc().unwrap();
    /// let _b = cn.try_alloc().unwrap();
    /// assert_eq!(cn.try_alloc(), Err(Error::PoolEmpty));
    /// ```
    pub fn try_alloc(&self) -> Result<Chunk, Error> {
        self.alloc_mode(AllocMode::Try)
    }

    fn alloc_mode(&self, mode: AllocMode) -> Result<Chunk, Error> {
        let ticket = self.lock().start_alloc(mode)?;
        let id = match ticket {
            AllocTicket::Ready(c) => return Ok(c),
            AllocTicket::Waiting(id) => id,
        };
        let r = self.wait_until(Some(self.deadline()), |e| e.take_alloc(id, None));
        match r {
            Ok(r) => r,
            Err(e) => {
                self.lock().cancel_alloc(id);
                Err(match e {
                    Error::Timeout { .. } if mode == AllocMode::Wait => Error::PoolEmpty,
                    e => e,
                })
            }
        }
    }

    /// Give a chunk back (to the reserve while it is below its high-water mark, else to the
    /// MN). The MN does not confirm a free; the request goes out once no access to the chunk
    /// is in flight. Every other handle of the chunk gets [`Error::Freed`] from now on.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let c = cn.alloc().unwrap();
    /// let twin = c.clone();
    /// cn.free(c).unwrap();
    /// assert_eq!(cn.free(twin), Err(omw_client::Error::Freed));
    /// ```
    pub fn free(&self, chunk: Chunk) -> Result<(), Error> {
        self.lock().free(chunk)
    }

    /// Return the reserve, wait (bounded by [`Options::timeout`]) until every free reached
    /// the MN, and refuse new work. Dropping the last handle does the same, bounded by 1 s.
    ///
    /// ```
    /// use omw_client::{model::Model, Cn, Options, ReservePolicy};
    /// let model = Model::start(Default::default()).unwrap();
    /// let opts = Options { reserve: Some(ReservePolicy::new(2, 4).unwrap()), ..Options::default() };
    /// let cn = Cn::connect(&model, opts).unwrap();
    /// let c = cn.alloc().unwrap();
    /// cn.free(c).unwrap(); // kept in the reserve
    /// cn.shutdown().unwrap();
    /// assert_eq!(cn.held_chunks(), 0);
    /// assert_eq!(cn.alloc(), Err(omw_client::Error::Shutdown));
    /// ```
    pub fn shutdown(&self) -> Result<(), Error> {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.lock().shut_down();
        let r =
            self.wait_until(Some(self.deadline()), |e| (e.requests_outstanding() == 0 || e.is_lost()).then_some(()));
        self.shared.cv.notify_all();
        r
    }

    /// Keep the reserve filled from a thread of its own (started by [`Cn::new`] when
    /// [`Options::reserve`] is set): it sleeps on the fd and progresses, so refills and
    /// returns happen while the application does not call in.
    fn spawn_background(&self) {
        let weak: Weak<Shared<T>> = Arc::downgrade(&self.shared);
        let _ = std::thread::Builder::new().name("omw-cn-reserve".into()).spawn(move || {
            loop {
                let Some(s) = weak.upgrade() else { return };
                if s.stop.load(Ordering::Relaxed) {
                    return;
                }
                let cn = Cn { shared: s };
                let nap = cn.shared.opts.wait.max_sleep;
                // one sleep on the fd (or the condvar) and one harvest; never an error out
                let _ = cn.wait_until(Some(Instant::now() + nap), |e| e.is_lost().then_some(()));
                let lost = cn.lock().is_lost();
                drop(cn);
                if lost {
                    return;
                }
            }
        });
    }

    // ------------------------------------------------------------------ staged accesses

    /// Post one access, waiting for a free slot (back-pressure) up to the client's timeout.
    fn post(&self, mut post: impl FnMut(&mut Engine<T>) -> Result<Option<u64>, Error>) -> Result<u64, Error> {
        self.wait_until(Some(self.deadline()), |e| match post(e) {
            Ok(Some(id)) => Some(Ok(id)),
            Ok(None) => None,
            Err(err) => Some(Err(err)),
        })?
    }

    /// Wait for a staged access or atomic (nothing of the caller's is in the device's hands:
    /// a timeout abandons it, its slot is released when the device is done).
    fn finish(&self, id: u64) -> Result<Output, Error> {
        match self.wait_until(Some(self.deadline()), |e| e.take_op(id, None)) {
            Ok(r) => r,
            Err(e) => {
                self.lock().abandon_op(id, None);
                Err(e)
            }
        }
    }

    /// WRITE `data` at `offset` of the chunk, copied through the client's staging slots (any
    /// slice; split into slot-sized pieces in flight together).
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let c = cn.alloc().unwrap();
    /// cn.write(&c, 16, b"abc").unwrap();
    /// assert!(matches!(cn.write(&c, c.size() - 1, b"ab"), Err(omw_client::Error::OutOfChunk(_))));
    /// ```
    pub fn write(&self, chunk: &Chunk, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.lock().check_range(chunk, offset, data.len() as u64)?;
        let piece = self.staging_piece();
        let mut ids = Vec::new();
        let mut first_err = None;
        for (off, r) in pieces(offset, data.len(), piece) {
            match self.post(|e| e.post_write(chunk, off, &data[r.clone()])) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        for id in ids {
            if let Err(e) = self.finish(id) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// READ `buf.len()` bytes at `offset` of the chunk into `buf`, through the staging slots.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let c = cn.alloc().unwrap();
    /// let mut b = [1u8; 4];
    /// cn.read(&c, 0, &mut b).unwrap();
    /// assert_eq!(b, [0u8; 4]); // a fresh chunk reads as zeros
    /// ```
    pub fn read(&self, chunk: &Chunk, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
        self.lock().check_range(chunk, offset, buf.len() as u64)?;
        let piece = self.staging_piece();
        let mut posted = Vec::new();
        let mut first_err = None;
        for (off, r) in pieces(offset, buf.len(), piece) {
            let len = r.len();
            match self.post(|e| e.post_read(chunk, off, len)) {
                Ok(id) => posted.push((id, r)),
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        for (id, r) in posted {
            match self.finish(id) {
                Ok(Output::Bytes(b)) if b.len() == r.len() => buf[r].copy_from_slice(&b),
                Ok(_) => {
                    first_err.get_or_insert(Error::Access(omw_core::device::WcStatus::LocLenErr));
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn staging_piece(&self) -> usize {
        self.lock().d.io_slot_len()
    }

    // ------------------------------------------------------------------ atomics

    /// 8-byte compare-and-swap at `offset` (a multiple of 8): stores `swap` iff the word is
    /// `compare`; returns the word it found.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let c = cn.alloc().unwrap();
    /// assert_eq!(cn.compare_swap(&c, 8, 0, 42).unwrap(), 0); // swapped
    /// assert_eq!(cn.compare_swap(&c, 8, 0, 7).unwrap(), 42); // not swapped
    /// assert_eq!(cn.compare_swap(&c, 3, 0, 1), Err(omw_client::Error::Misaligned { offset: 3 }));
    /// ```
    pub fn compare_swap(&self, chunk: &Chunk, offset: u64, compare: u64, swap: u64) -> Result<u64, Error> {
        self.atomic(chunk, offset, AtomicOp::CompareSwap { compare, swap })
    }

    /// 8-byte fetch-and-add at `offset` (a multiple of 8), wrapping; returns the old word.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let c = cn.alloc().unwrap();
    /// assert_eq!(cn.fetch_add(&c, 0, 5).unwrap(), 0);
    /// assert_eq!(cn.fetch_add(&c, 0, 1).unwrap(), 5);
    /// ```
    pub fn fetch_add(&self, chunk: &Chunk, offset: u64, add: u64) -> Result<u64, Error> {
        self.atomic(chunk, offset, AtomicOp::FetchAdd { add })
    }

    fn atomic(&self, chunk: &Chunk, offset: u64, op: AtomicOp) -> Result<u64, Error> {
        let id = self.post(|e| e.post_atomic(chunk, offset, op))?;
        match self.finish(id)? {
            Output::Word(w) => Ok(w),
            _ => Err(Error::Access(omw_core::device::WcStatus::LocLenErr)),
        }
    }

    // ------------------------------------------------------------------ zero-copy

    /// Register a buffer of the caller's for zero-copy access ([`Cn::read_into`],
    /// [`Cn::write_from`], and the futures). The handle owns or borrows the buffer: it cannot
    /// outlive it; dropping it deregisters.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let mr = cn.register(vec![0u8; 1 << 16]).unwrap();
    /// assert_eq!(mr.len(), 1 << 16);
    /// assert!(cn.register(Vec::new()).is_err()); // nothing to register
    /// ```
    pub fn register<B: MrBuffer>(&self, buf: B) -> Result<LocalMr<B>, Error> {
        let bytes = buf.bytes();
        if bytes.is_empty() {
            return Err(Error::OutOfBuffer { start: 0, end: 0, len: 0 });
        }
        let (addr, len) = (bytes.as_ptr() as u64, bytes.len() as u64);
        let reg = self.lock().register(addr, len)?;
        let shared: Arc<dyn Registrar> = self.shared.clone();
        let owner: Weak<dyn Registrar> = Arc::downgrade(&shared);
        Ok(LocalMr::new(buf, reg, owner, self.shared.id))
    }

    /// Zero-copy WRITE of `mr[range]` at `offset` of the chunk: one work request straight
    /// from the registered buffer (no staging copy). Longer than one message of the QP:
    /// [`Error::TooLarge`].
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let c = cn.alloc().unwrap();
    /// let mr = cn.register(vec![9u8; 64]).unwrap();
    /// cn.write_from(&c, 0, &mr, 0..64).unwrap();
    /// assert_eq!(cn.write_from(&c, 0, &mr, 60..70), Err(omw_client::Error::OutOfBuffer { start: 60, end: 70, len: 64 }));
    /// ```
    pub fn write_from<B: MrBuffer>(
        &self,
        chunk: &Chunk,
        offset: u64,
        mr: &LocalMr<B>,
        range: Range<usize>,
    ) -> Result<(), Error> {
        mr.check(self.shared.id, &range)?;
        let src = &mr.as_slice()[range.clone()];
        let reg = mr.reg;
        let id = self.post(|e| e.post_zero_copy(chunk, offset, &reg, range.start, range.len(), Some(src)))?;
        self.finish_zero_copy(id, None)
    }

    /// Zero-copy READ of `range.len()` bytes at `offset` of the chunk into `mr[range]`.
    ///
    /// ```
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
    /// let c = cn.alloc().unwrap();
    /// cn.write(&c, 0, b"zero-copy").unwrap();
    /// let mut mr = cn.register(vec![0u8; 9]).unwrap();
    /// cn.read_into(&c, 0, &mut mr, 0..9).unwrap();
    /// assert_eq!(mr.as_slice(), b"zero-copy");
    /// ```
    pub fn read_into<B: MrBuffer>(
        &self,
        chunk: &Chunk,
        offset: u64,
        mr: &mut LocalMr<B>,
        range: Range<usize>,
    ) -> Result<(), Error> {
        mr.check(self.shared.id, &range)?;
        let reg = mr.reg;
        let id = self.post(|e| e.post_zero_copy(chunk, offset, &reg, range.start, range.len(), None))?;
        match self.finish_zero_copy(id, Some(reg)) {
            Ok(()) => self.lock().copy_out(&reg, range.start, &mut mr.as_mut_slice()[range]),
            Err(Error::Deregistered) => {
                mr.dead = true;
                Err(Error::Deregistered)
            }
            Err(e) => Err(e),
        }
    }

    /// Wait until the device is done with a zero-copy access: its buffer is borrowed only for
    /// this call, so the call never returns while the device may still touch it. Should the
    /// wait itself fail (the transport broke), the buffer is deregistered first — after that
    /// the device cannot reach it — and the caller learns [`Error::Deregistered`].
    fn finish_zero_copy(&self, id: u64, withdraw: Option<Registered>) -> Result<(), Error> {
        match self.wait_until(None, |e| e.take_op(id, None)) {
            Ok(r) => r.map(|_| ()),
            Err(err) => {
                let mut e = self.lock();
                if let Some(r) = e.take_op(id, None) {
                    return r.map(|_| ());
                }
                e.abandon_op(id, None);
                // a READ's buffer must be out of the device's reach before the caller has it
                // back; a WRITE's is only read by the device
                match withdraw {
                    Some(reg) => {
                        e.deregister(&reg);
                        Err(Error::Deregistered)
                    }
                    None => Err(err),
                }
            }
        }
    }
}

/// A driver that could not be built over the connection (its memory or QPs do not fit).
#[derive(Debug)]
struct DriverSetup(String);
impl std::fmt::Display for DriverSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "setting up the CN driver: {}", self.0)
    }
}
impl std::error::Error for DriverSetup {}

#[cfg(test)]
mod tests {
    use super::pieces;

    #[test]
    fn pieces_cover_the_range_in_slot_sized_parts() {
        let v: Vec<_> = pieces(100, 10, 4).collect();
        assert_eq!(v, vec![(100, 0..4), (104, 4..8), (108, 8..10)]);
        assert_eq!(pieces(0, 0, 4).count(), 0);
        assert_eq!(pieces(0, 4, 4).collect::<Vec<_>>(), vec![(0, 0..4)]);
    }
}
