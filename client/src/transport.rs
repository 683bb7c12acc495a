//! What the library needs of a transport: the core's device traits (the [`CnDriver`] runs on
//! them) plus event-driven completions and the registration of the caller's own memory.
//!
//! A transport is the CN's device after it connected: [`crate::verbs`] (libibverbs and
//! rdma_cm; its completion channel and connection events behind one fd) and
//! [`crate::model`] (the loopback model on a thread of its own, its completions signalled
//! through a socket). The protocol — requests, replies, notices, staging, tokens — stays in
//! the core's [`CnDriver`]; a transport only moves bytes and says when something happened.
//!
//! [`CnDriver`]: omw_core::cn::driver::CnDriver

use omw_core::cn::driver::{ChainConnection, CnMemory, CnQpSet};
use omw_core::device::{DataPath, RdmaBackend};
use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

/// A connected CN's device, as the library drives it.
///
/// The library calls everything here with its engine locked (one caller at a time), except
/// [`Signal::wait`], which a sleeping thread calls on its own [`Transport::signal`] handle.
///
/// ```
/// # use omw_client::transport::Transport;
/// fn describe<T: Transport>(t: &T) -> String {
///     format!("largest single access: {} bytes", t.max_message_len())
/// }
/// # let model = omw_client::model::Model::start(omw_client::model::ModelConfig::default()).unwrap();
/// # let c = model.connect().unwrap();
/// # assert!(describe(&c.device).starts_with("largest"));
/// ```
pub trait Transport: RdmaBackend + DataPath<Error = <Self as Transport>::Fault> + Send + 'static {
    /// The device's error (its `DataPath::Error`), a proper error that crosses threads.
    type Fault: std::error::Error + Send + Sync + 'static;
    /// What a sleeping thread waits on.
    type Signal: Signal;

    /// A handle on the event fd, usable while the device itself is locked by another thread.
    fn signal(&self) -> io::Result<Self::Signal>;

    /// Ask to be signalled at the next completion on any of the CN's queues
    /// (`ibv_req_notify_cq` on every CQ) or connection event. One signal per arming; the
    /// library polls once more after arming, so nothing that arrived in between is missed.
    fn arm(&mut self) -> Result<(), Self::Error>;

    /// Consume what made the signal fire without blocking (`ibv_get_cq_event` and
    /// `ibv_ack_cq_events`; connection events) and say whether the connection to the MN is
    /// still up.
    fn take_events(&mut self) -> Result<Link, Self::Error>;

    /// Register `len` bytes of the caller's memory at `addr` for local access (the device
    /// writes READ results and reads WRITE sources there). The library calls it only for the
    /// buffer a [`crate::LocalMr`] owns or borrows, and posts work naming it only while it
    /// holds that buffer.
    fn register(&mut self, addr: u64, len: u64) -> Result<Registered, Self::Error>;

    /// Undo [`Transport::register`] (the library calls it only with no access in flight).
    fn deregister(&mut self, reg: &Registered) -> Result<(), Self::Error>;

    /// Whether the device reaches registered buffers through a mirror in memory of its own
    /// (the model: its memory is not the process's). Then the library copies a buffer's bytes
    /// in before a zero-copy WRITE and out after a zero-copy READ, through
    /// `DataPath::write_local` / `read_local` at [`Registered::device_addr`].
    fn mirrors_buffers(&self) -> bool;

    /// The largest single message the connection's QPs carry (the port's `max_msg_sz`): a
    /// zero-copy access is one work request, so a longer one is refused before posting.
    fn max_message_len(&self) -> u64;

    /// Connect chain connection `c` (whose QP is `old`) anew to the same MN-side QP after its
    /// QP broke (an access the MN refused on it, the MN's repair of its chain): the CN's new
    /// QP, or None where the transport or its MN cannot rejoin (then the connection is lost). The library hands the
    /// new QP to its driver (`CnDriver::replace_chain_qp`) and destroys the old one. The
    /// windows the CN holds are bound to the MN's end, so they all keep working.
    fn rejoin(
        &mut self,
        c: ChainConnection,
        old: omw_core::ids::Qpn,
        mem: &CnMemory,
    ) -> Result<Option<Rejoined>, Self::Error>;
}

/// A chain connection a transport connected anew ([`Transport::rejoin`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Rejoined {
    /// The CN's QP now (the model reconnects the old one in place: the same number).
    pub qp: omw_core::ids::Qpn,
    /// Its receives were posted before it connected (`prime_receives`).
    pub primed: bool,
}

/// The event fd's waiting side.
///
/// ```
/// use omw_client::transport::{Signal, Transport};
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// let c = model.connect().unwrap();
/// let s = c.device.signal().unwrap();
/// // nothing was armed, nothing arrives
/// assert!(!s.wait(std::time::Duration::from_millis(1)).unwrap());
/// ```
pub trait Signal: AsRawFd + Send + Sync + 'static {
    /// The fd as tokio watches it ([`AsyncSignal`]).
    #[cfg(feature = "tokio")]
    type Async: AsyncSignal;

    /// Sleep until the fd is readable or `timeout` passed; whether it is readable. Nothing is
    /// consumed: [`Transport::take_events`] does that.
    fn wait(&self, timeout: Duration) -> io::Result<bool>;

    /// Register the fd with the current tokio runtime.
    #[cfg(feature = "tokio")]
    fn to_async(&self) -> io::Result<Self::Async>;
}

/// The event fd registered with tokio's reactor (`AsyncFd`, or a tokio socket for a socket).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use omw_client::transport::{AsyncSignal, Signal, Transport};
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// let c = model.connect().unwrap();
/// let a = c.device.signal().unwrap().to_async().unwrap();
/// let r = tokio::time::timeout(std::time::Duration::from_millis(5), a.readable()).await;
/// assert!(r.is_err()); // nothing armed: it never turns readable
/// # }
/// ```
#[cfg(feature = "tokio")]
pub trait AsyncSignal: Send + Sync + 'static {
    /// Wait until the fd turns readable, then clear tokio's readiness (the caller drains the
    /// events with [`Transport::take_events`] next; anything newer makes it readable again).
    fn readable(&self) -> impl std::future::Future<Output = io::Result<()>> + Send + '_;
}

/// The state of the CN's connection to its MN.
///
/// ```
/// use omw_client::transport::{Link, Transport};
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// let mut c = model.connect().unwrap();
/// assert_eq!(c.device.take_events().unwrap(), Link::Up);
/// model.kill_mn().unwrap();
/// assert_eq!(c.device.take_events().unwrap(), Link::Lost);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Link {
    Up,
    /// The MN is gone (a disconnect event, the peer's host vanished): every pending operation
    /// fails with [`crate::Error::Disconnected`].
    Lost,
}

/// A registration of caller memory.
///
/// ```
/// use omw_client::transport::Transport;
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// let mut c = model.connect().unwrap();
/// let buf = vec![0u8; 256];
/// let r = c.device.register(buf.as_ptr() as u64, 256).unwrap();
/// assert_eq!(r.len, 256);
/// c.device.deregister(&r).unwrap();
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Registered {
    /// Where the device reads and writes it (the buffer's own address, or its mirror's).
    pub device_addr: u64,
    pub lkey: u32,
    pub len: u64,
}

/// A transport right after its connect: the device, the CN's QPs, its registered memory (the
/// core's layout) and whether both message queues' receives are already posted.
///
/// ```
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// let c = model.connect().unwrap();
/// assert_eq!(c.qps.access.len(), 1); // G = 2: one access QP
/// let cn = omw_client::Cn::new(c, Default::default()).unwrap();
/// # drop(cn);
/// ```
#[derive(Debug)]
pub struct Connection<T> {
    pub device: T,
    pub qps: CnQpSet,
    pub mem: CnMemory,
    /// The receives were posted before the QPs connected (`prime_receives`).
    pub primed: bool,
    /// The MN's QP numbers the transport connected to (Alloc, Free, access 0..; `None` where
    /// it could not tell), checked against the MN's connect info: a mismatch means the MN
    /// mixed up sessions. Empty: nothing to check.
    pub mn_qpns: Vec<Option<omw_core::ids::Qpn>>,
    /// The CN ends of the Alloc QPs of its alloc chains beyond the first (empty: one chain),
    /// and the bytes of its reply buffer (`CnMemory::reply`), which holds a reply slot per
    /// chain (`CnDriver::with_alloc_chains`).
    pub extra_alloc: Vec<omw_core::ids::Qpn>,
    pub reply_len: u64,
}
