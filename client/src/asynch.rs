//! [`AsyncCn`]: the client's operations as futures on tokio (feature `tokio`).
//!
//! One driver task per client watches the transport's event fd (`AsyncFd` on verbs' epoll fd,
//! a tokio socket for the model's signal socket) — it arms
//! the CQs, sleeps until the fd is readable (or the client's next timer), harvests, and wakes
//! the futures whose operations finished. A future registers its waker with the engine and
//! never polls the device itself, so thousands can wait at once at the cost of one fd.
//!
//! **Cancellation.** Dropping a future at any point leaks nothing: an allocation it was
//! waiting for goes, when it arrives, to the reserve or back to the MN; an access in flight
//! keeps its I/O slot until the device is done with it and then releases it; a zero-copy
//! access's buffer ([`LocalMr`], which the future owns) stays alive and registered until the
//! device is done with it, then is deregistered and dropped. **Back-pressure.** An access
//! that finds every I/O slot busy waits for one; it does not fail.

use crate::chunk::Chunk;
use crate::client::{Cn, Shared};
use crate::engine::{AllocMode, AllocTicket, Engine, Output};
use crate::error::Error;
use crate::mr::{LocalMr, MrBuffer};
use crate::transport::{AsyncSignal, Registered, Signal, Transport};
use omw_core::cn::driver::AtomicOp;
use omw_core::device::WcStatus;
use std::any::Any;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::task::JoinHandle;

/// The client's operations as futures. Cheap to clone; the driver task ends with the last
/// clone.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use omw_client::{model::Model, AsyncCn, Cn};
/// let model = Model::start(Default::default()).unwrap();
/// let cn = AsyncCn::new(Cn::connect(&model, Default::default()).unwrap()).unwrap();
/// let chunk = cn.alloc().await.unwrap();
/// cn.write(&chunk, 0, b"async").await.unwrap();
/// assert_eq!(cn.read(&chunk, 0, 5).await.unwrap(), b"async");
/// cn.free(chunk).await.unwrap();
/// # }
/// ```
pub struct AsyncCn<T: Transport> {
    cn: Cn<T>,
    _driver: Arc<Driver>,
}

impl<T: Transport> Clone for AsyncCn<T> {
    fn clone(&self) -> Self {
        AsyncCn { cn: self.cn.clone(), _driver: self._driver.clone() }
    }
}

impl<T: Transport> std::fmt::Debug for AsyncCn<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCn").field("cn", &self.cn).finish()
    }
}

/// The driver task, aborted with the last handle; while it runs, blocking waiters of the
/// same client leave the fd to it.
struct Driver(JoinHandle<()>, Weak<dyn DriverCount>);
impl Drop for Driver {
    fn drop(&mut self) {
        self.0.abort();
        if let Some(s) = self.1.upgrade() {
            s.driver_gone();
        }
    }
}

trait DriverCount: Send + Sync {
    fn driver_gone(&self);
}
impl<T: Transport> DriverCount for Shared<T> {
    fn driver_gone(&self) {
        self.drivers.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        self.cv.notify_all();
    }
}

async fn drive<T: Transport>(shared: Weak<Shared<T>>, fd: <T::Signal as Signal>::Async) {
    loop {
        let Some(s) = shared.upgrade() else { return };
        let (moved, timer, lost) = {
            let mut e = s.lock();
            let n = e.progress().unwrap_or(0);
            (n, e.next_timer(), e.is_lost())
        };
        s.cv.notify_all();
        if lost {
            // nothing will ever arrive again; every waiter has been failed
            return;
        }
        if moved > 0 {
            drop(s);
            tokio::task::yield_now().await;
            continue;
        }
        let armed = {
            let mut e = s.lock();
            match e.d.backend.arm() {
                Ok(()) => e.progress().unwrap_or(0) == 0,
                Err(_) => false,
            }
        };
        let nap = s.opts.wait.max_sleep;
        drop(s);
        if !armed {
            tokio::task::yield_now().await;
            continue;
        }
        let now = Instant::now();
        let until = timer.map_or(now + nap, |t| t.min(now + nap));
        tokio::select! {
            r = fd.readable() => {
                if r.is_err() {
                    // the reactor cannot watch it: fall back to the timer alone
                    tokio::time::sleep_until(until.into()).await;
                }
            }
            _ = tokio::time::sleep_until(until.into()) => {}
        }
    }
}

impl<T: Transport> AsyncCn<T> {
    /// Wrap a client and start its driver task (call it inside a tokio runtime).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
    /// assert_eq!(cn.cn().held_chunks(), 0);
    /// # }
    /// ```
    pub fn new(cn: Cn<T>) -> Result<Self, Error> {
        let sig = cn.lock().d.backend.signal().map_err(Error::transport)?;
        let fd = sig.to_async().map_err(Error::transport)?;
        cn.shared.drivers.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let task = tokio::spawn(drive(Arc::downgrade(&cn.shared), fd));
        let shared: Arc<dyn DriverCount> = cn.shared.clone();
        Ok(AsyncCn { cn, _driver: Arc::new(Driver(task, Arc::downgrade(&shared))) })
    }

    /// The blocking handle of the same client (statistics, registration, shutdown).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
    /// let mr = cn.cn().register(vec![0u8; 64]).unwrap();
    /// assert_eq!(mr.len(), 64);
    /// # }
    /// ```
    pub fn cn(&self) -> &Cn<T> {
        &self.cn
    }

    /// One chunk (from the reserve at once, else from the MN, waiting through "empty" until
    /// "available" — wrap it in `tokio::time::timeout` to bound the wait; dropping the
    /// future leaks nothing).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
    /// let c = cn.alloc().await.unwrap();
    /// assert_eq!(c.size(), 4096);
    /// # }
    /// ```
    pub fn alloc(&self) -> AllocFuture<'_, T> {
        AllocFuture { cn: &self.cn, mode: AllocMode::Wait, waiter: None }
    }

    /// One chunk, or [`Error::PoolEmpty`] as soon as the MN has none.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let model = omw_client::model::Model::start(omw_client::model::ModelConfig { chunks: 1, ..Default::default() }).unwrap();
    /// # let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
    /// let _c = cn.try_alloc().await.unwrap();
    /// assert_eq!(cn.try_alloc().await, Err(omw_client::Error::PoolEmpty));
    /// # }
    /// ```
    pub fn try_alloc(&self) -> AllocFuture<'_, T> {
        AllocFuture { cn: &self.cn, mode: AllocMode::Try, waiter: None }
    }

    /// Give a chunk back (see [`Cn::free`]; it never waits for the MN).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
    /// let c = cn.alloc().await.unwrap();
    /// cn.free(c).await.unwrap();
    /// # }
    /// ```
    pub async fn free(&self, chunk: Chunk) -> Result<(), Error> {
        self.cn.free(chunk)
    }

    fn op<P>(&self, post: P, hold: Option<Box<dyn Any + Send>>) -> OpFuture<'_, T, P>
    where
        P: FnMut(&mut Engine<T>) -> Result<Option<u64>, Error> + Unpin,
    {
        OpFuture { cn: &self.cn, post, id: None, hold }
    }

    /// WRITE `data` at `offset` of the chunk through a staging slot (`data` is copied when
    /// the access is posted; longer than a slot: [`Error::TooLarge`] — use zero-copy or split).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
    /// let c = cn.alloc().await.unwrap();
    /// cn.write(&c, 0, &[1, 2, 3]).await.unwrap();
    /// # }
    /// ```
    pub async fn write(&self, chunk: &Chunk, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.op(|e: &mut Engine<T>| e.post_write(chunk, offset, data), None).await.map(|_| ())
    }

    /// READ `len` bytes at `offset` of the chunk through a staging slot.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
    /// let c = cn.alloc().await.unwrap();
    /// assert_eq!(cn.read(&c, 0, 4).await.unwrap(), vec![0u8; 4]);
    /// # }
    /// ```
    pub async fn read(&self, chunk: &Chunk, offset: u64, len: usize) -> Result<Vec<u8>, Error> {
        match self.op(|e: &mut Engine<T>| e.post_read(chunk, offset, len), None).await? {
            Output::Bytes(b) if b.len() == len => Ok(b),
            _ => Err(Error::Access(WcStatus::LocLenErr)),
        }
    }

    /// 8-byte compare-and-swap (see [`Cn::compare_swap`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
    /// let c = cn.alloc().await.unwrap();
    /// assert_eq!(cn.compare_swap(&c, 0, 0, 9).await.unwrap(), 0);
    /// # }
    /// ```
    pub async fn compare_swap(&self, chunk: &Chunk, offset: u64, compare: u64, swap: u64) -> Result<u64, Error> {
        self.atomic(chunk, offset, AtomicOp::CompareSwap { compare, swap }).await
    }

    /// 8-byte fetch-and-add (see [`Cn::fetch_add`]).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
    /// let c = cn.alloc().await.unwrap();
    /// assert_eq!(cn.fetch_add(&c, 8, 2).await.unwrap(), 0);
    /// assert_eq!(cn.fetch_add(&c, 8, 2).await.unwrap(), 2);
    /// # }
    /// ```
    pub async fn fetch_add(&self, chunk: &Chunk, offset: u64, add: u64) -> Result<u64, Error> {
        self.atomic(chunk, offset, AtomicOp::FetchAdd { add }).await
    }

    async fn atomic(&self, chunk: &Chunk, offset: u64, op: AtomicOp) -> Result<u64, Error> {
        match self.op(|e: &mut Engine<T>| e.post_atomic(chunk, offset, op), None).await? {
            Output::Word(w) => Ok(w),
            _ => Err(Error::Access(WcStatus::LocLenErr)),
        }
    }

    /// Zero-copy WRITE of `mr[range]` at `offset` of the chunk. The future owns the buffer and
    /// hands it back with the result; dropped early, it keeps the buffer until the device is
    /// done with it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
    /// let c = cn.alloc().await.unwrap();
    /// let mr = cn.cn().register(vec![7u8; 32]).unwrap();
    /// let (r, mr) = cn.write_from(&c, 0, mr, 0..32).await;
    /// r.unwrap();
    /// assert_eq!(mr.len(), 32);
    /// # }
    /// ```
    pub async fn write_from<B: MrBuffer + 'static>(
        &self,
        chunk: &Chunk,
        offset: u64,
        mr: LocalMr<B>,
        range: Range<usize>,
    ) -> (Result<(), Error>, LocalMr<B>) {
        self.zero_copy(chunk, offset, mr, range, true).await
    }

    /// Zero-copy READ into `mr[range]` from `offset` of the chunk (see
    /// [`AsyncCn::write_from`] for the buffer's ownership).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let model = omw_client::model::Model::start(Default::default()).unwrap();
    /// # let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
    /// let c = cn.alloc().await.unwrap();
    /// cn.write(&c, 0, b"zc").await.unwrap();
    /// let mr = cn.cn().register(vec![0u8; 2]).unwrap();
    /// let (r, mr) = cn.read_into(&c, 0, mr, 0..2).await;
    /// r.unwrap();
    /// assert_eq!(mr.as_slice(), b"zc");
    /// # }
    /// ```
    pub async fn read_into<B: MrBuffer + 'static>(
        &self,
        chunk: &Chunk,
        offset: u64,
        mr: LocalMr<B>,
        range: Range<usize>,
    ) -> (Result<(), Error>, LocalMr<B>) {
        self.zero_copy(chunk, offset, mr, range, false).await
    }

    async fn zero_copy<B: MrBuffer + 'static>(
        &self,
        chunk: &Chunk,
        offset: u64,
        mr: LocalMr<B>,
        range: Range<usize>,
        write: bool,
    ) -> (Result<(), Error>, LocalMr<B>) {
        if let Err(e) = mr.check(self.cn.shared.id, &range) {
            return (Err(e), mr);
        }
        let reg: Registered = mr.reg;
        let (start, len) = (range.start, range.len());
        let mut fut = ZeroCopy { cn: &self.cn, chunk, offset, reg, start, len, write, mr: Some(mr), id: None };
        let r = (&mut fut).await;
        let mut mr = fut.mr.take().expect("a finished zero-copy future hands its buffer back");
        let r = match r {
            Ok(()) if !write => self.cn.lock().copy_out(&reg, start, &mut mr.as_mut_slice()[start..start + len]),
            r => r,
        };
        (r, mr)
    }
}

/// An allocation in progress ([`AsyncCn::alloc`], [`AsyncCn::try_alloc`]). Dropping it
/// leaks nothing: a chunk that arrives for it afterwards goes to the reserve or back to the MN.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// # let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
/// let f: omw_client::asynch::AllocFuture<'_, _> = cn.alloc();
/// let bounded = tokio::time::timeout(std::time::Duration::from_secs(5), f).await;
/// assert!(bounded.unwrap().is_ok());
/// # }
/// ```
pub struct AllocFuture<'a, T: Transport> {
    cn: &'a Cn<T>,
    mode: AllocMode,
    waiter: Option<u64>,
}

impl<T: Transport> Future for AllocFuture<'_, T> {
    type Output = Result<Chunk, Error>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let cn = this.cn;
        let mut e = cn.lock();
        let id = match this.waiter {
            Some(id) => id,
            None => match e.start_alloc(this.mode) {
                Ok(AllocTicket::Ready(c)) => return Poll::Ready(Ok(c)),
                Ok(AllocTicket::Waiting(id)) => {
                    this.waiter = Some(id);
                    id
                }
                Err(err) => return Poll::Ready(Err(err)),
            },
        };
        match e.take_alloc(id, Some(cx.waker())) {
            Some(r) => {
                this.waiter = None;
                Poll::Ready(r)
            }
            None => Poll::Pending,
        }
    }
}

impl<T: Transport> Drop for AllocFuture<'_, T> {
    fn drop(&mut self) {
        if let Some(id) = self.waiter.take() {
            self.cn.lock().cancel_alloc(id);
        }
    }
}

/// A staged access or atomic in progress.
struct OpFuture<'a, T: Transport, P> {
    cn: &'a Cn<T>,
    post: P,
    id: Option<u64>,
    hold: Option<Box<dyn Any + Send>>,
}

impl<T, P> Future for OpFuture<'_, T, P>
where
    T: Transport,
    P: FnMut(&mut Engine<T>) -> Result<Option<u64>, Error> + Unpin,
{
    type Output = Result<Output, Error>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let mut e = this.cn.lock();
        let id = match this.id {
            Some(id) => id,
            None => match (this.post)(&mut e) {
                Ok(Some(id)) => {
                    this.id = Some(id);
                    id
                }
                Ok(None) => {
                    // every slot busy: wait for one (back-pressure)
                    e.wait_for_slot(cx.waker());
                    return Poll::Pending;
                }
                Err(err) => return Poll::Ready(Err(err)),
            },
        };
        match e.take_op(id, Some(cx.waker())) {
            Some(r) => {
                this.id = None;
                Poll::Ready(r)
            }
            None => Poll::Pending,
        }
    }
}

impl<T: Transport, P> Drop for OpFuture<'_, T, P> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.cn.lock().abandon_op(id, self.hold.take());
        }
    }
}

/// A zero-copy access in progress: owns the buffer until the device is done with it.
struct ZeroCopy<'a, T: Transport, B: MrBuffer + 'static> {
    cn: &'a Cn<T>,
    chunk: &'a Chunk,
    offset: u64,
    reg: Registered,
    start: usize,
    len: usize,
    write: bool,
    mr: Option<LocalMr<B>>,
    id: Option<u64>,
}

impl<T: Transport, B: MrBuffer + 'static> Future for ZeroCopy<'_, T, B> {
    type Output = Result<(), Error>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut e = this.cn.lock();
        let id = match this.id {
            Some(id) => id,
            None => {
                let src = this.mr.as_ref().map(|m| &m.as_slice()[this.start..this.start + this.len]);
                let write = if this.write { src } else { None };
                match e.post_zero_copy(this.chunk, this.offset, &this.reg, this.start, this.len, write) {
                    Ok(Some(id)) => {
                        this.id = Some(id);
                        id
                    }
                    Ok(None) => {
                        e.wait_for_slot(cx.waker());
                        return Poll::Pending;
                    }
                    Err(err) => return Poll::Ready(Err(err)),
                }
            }
        };
        match e.take_op(id, Some(cx.waker())) {
            Some(r) => {
                this.id = None;
                Poll::Ready(r.map(|_| ()))
            }
            None => Poll::Pending,
        }
    }
}

impl<T: Transport, B: MrBuffer + 'static> Drop for ZeroCopy<'_, T, B> {
    /// Dropped while the device may still use the buffer: hand the buffer to the engine, which
    /// drops (and deregisters) it once the device is done.
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let hold: Option<Box<dyn Any + Send>> = self.mr.take().map(|m| Box::new(m) as Box<dyn Any + Send>);
            self.cn.lock().abandon_op(id, hold);
        }
    }
}
