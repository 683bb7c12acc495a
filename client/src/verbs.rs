//! libibverbs and rdma_cm as a transport (feature `verbs`): the CN's CQs on a completion
//! channel, the channel and the rdma_cm event channel behind one epoll fd (readable when a
//! completion or a connection event waits), the caller's buffers registered where they are
//! (`ibv_reg_mr` on the caller's memory: true zero-copy), a disconnect from the MN reported as
//! a lost link with every QP moved to the error state so pending work flushes at once.
//!
//! ```no_run
//! use omw_client::{verbs::Target, Cn, Options};
//! let cn = Cn::connect(Target::new("10.0.0.1:7471".parse().unwrap()), Options::default()).unwrap();
//! let chunk = cn.alloc().unwrap();
//! cn.write(&chunk, 0, b"over RDMA").unwrap();
//! ```

use crate::client::Connect;
use crate::engine::IO_SLOTS;
use crate::error::Error;
use crate::transport::{Connection, Link, Registered, Rejoined, Signal, Transport};
use omw_core::cn::driver::{ChainConnection, CnMemory};
use omw_core::ids::Qpn;
pub use omw_verbs::cn::CnOptions;
use omw_verbs::notify::EventFd;
use omw_verbs::{VerbsBackend, VerbsError};
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

/// Bytes of one staging slot of a verbs CN (its local region, pinned, holds [`IO_SLOTS`] of
/// them: 4 MiB).
///
/// ```
/// assert_eq!(omw_client::verbs::VERBS_STAGING_SLOT * omw_client::IO_SLOTS as u64, 4 << 20);
/// ```
pub const VERBS_STAGING_SLOT: u64 = 64 << 10;

/// An MN to connect to over rdma_cm.
///
/// ```
/// let t = omw_client::verbs::Target::new("192.0.2.1:7471".parse().unwrap());
/// assert_eq!(t.addr.port(), 7471);
/// ```
#[derive(Clone, Debug)]
pub struct Target {
    pub addr: SocketAddr,
    /// Device, connect timeout, tenant credential, source address.
    pub opts: CnOptions,
}

impl Target {
    /// The MN at `addr`, default options (the device that routes there).
    ///
    /// ```
    /// let t = omw_client::verbs::Target::new("192.0.2.1:7471".parse().unwrap());
    /// assert!(t.opts.device.is_none());
    /// ```
    pub fn new(addr: SocketAddr) -> Target {
        Target { addr, opts: CnOptions::default() }
    }

    /// Open `k` alloc chains (1..=4, at most the MN's `--alloc-chains`; the MN refuses more
    /// with [`Error::AllocChains`]): `k` allocations of the CN in flight at once.
    ///
    /// ```
    /// let t = omw_client::verbs::Target::new("192.0.2.1:7471".parse().unwrap()).alloc_chains(2);
    /// assert_eq!(t.opts.alloc_chains, 2);
    /// ```
    pub fn alloc_chains(mut self, k: u8) -> Target {
        self.opts.alloc_chains = k;
        self
    }
}

impl Connect for Target {
    type Transport = VerbsBackend;
    fn connect(self) -> Result<Connection<VerbsBackend>, Error> {
        let len = CnMemory::local_len_for(IO_SLOTS, VERBS_STAGING_SLOT);
        let q = omw_verbs::cn::connect_queues(self.addr, &self.opts, len, true).map_err(|e| match e {
            // a refusal the application can act on: the library's own error, as on the model
            VerbsError::Rejected(omw_verbs::cm::Refusal::AllocChains { allowed, asked }) => {
                Error::AllocChains { allowed, asked }
            }
            e => Error::transport(e),
        })?;
        Ok(Connection {
            device: q.backend,
            qps: q.qps,
            mem: q.mem,
            primed: true,
            mn_qpns: q.mn_qpns,
            extra_alloc: q.extra_alloc,
            reply_len: q.reply_len,
        })
    }
}

/// The waiting side of a verbs CN's event fd.
///
/// ```no_run
/// use omw_client::transport::{Signal, Transport};
/// # let c = omw_client::Connect::connect(omw_client::verbs::Target::new("192.0.2.1:7471".parse().unwrap())).unwrap();
/// let s: omw_client::verbs::VerbsSignal = c.device.signal().unwrap();
/// let _ = s.wait(std::time::Duration::from_millis(1));
/// ```
#[derive(Debug)]
pub struct VerbsSignal(EventFd);

impl AsRawFd for VerbsSignal {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// A verbs CN's event fd as tokio's `AsyncFd`.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use omw_client::transport::{AsyncSignal, Signal, Transport};
/// # let c = omw_client::Connect::connect(omw_client::verbs::Target::new("192.0.2.1:7471".parse().unwrap())).unwrap();
/// let a: omw_client::verbs::AsyncVerbsSignal = c.device.signal().unwrap().to_async().unwrap();
/// a.readable().await.unwrap();
/// # }
/// ```
#[cfg(feature = "tokio")]
#[derive(Debug)]
pub struct AsyncVerbsSignal(omw_verbs::notify::AsyncEventFd);

#[cfg(feature = "tokio")]
impl crate::transport::AsyncSignal for AsyncVerbsSignal {
    async fn readable(&self) -> io::Result<()> {
        self.0.readable().await
    }
}

impl Signal for VerbsSignal {
    #[cfg(feature = "tokio")]
    type Async = AsyncVerbsSignal;
    fn wait(&self, timeout: Duration) -> io::Result<bool> {
        self.0.wait(timeout)
    }
    #[cfg(feature = "tokio")]
    fn to_async(&self) -> io::Result<AsyncVerbsSignal> {
        Ok(AsyncVerbsSignal(omw_verbs::notify::AsyncEventFd::new(self.0.try_clone()?)?))
    }
}

impl Transport for VerbsBackend {
    type Fault = VerbsError;
    type Signal = VerbsSignal;
    fn signal(&self) -> io::Result<VerbsSignal> {
        self.event_fd().map(VerbsSignal).map_err(io::Error::other)
    }
    fn arm(&mut self) -> Result<(), VerbsError> {
        self.arm_completion_events()
    }
    fn take_events(&mut self) -> Result<Link, VerbsError> {
        Ok(if self.take_completion_events()? { Link::Lost } else { Link::Up })
    }
    fn register(&mut self, addr: u64, len: u64) -> Result<Registered, VerbsError> {
        let k = self.reg_user_mr(addr, len)?;
        Ok(Registered { device_addr: addr, lkey: k.lkey, len })
    }
    fn deregister(&mut self, reg: &Registered) -> Result<(), VerbsError> {
        self.dereg_mr(reg.lkey)
    }
    fn mirrors_buffers(&self) -> bool {
        false
    }
    /// `omw_verbs::rejoin`: a new rdma_cm connection with the session's rejoin ticket; an MN
    /// whose QPs are rdma_cm's refuses (`Refusal::NoRejoin`), and the connection is lost.
    fn rejoin(&mut self, c: ChainConnection, _: Qpn, mem: &CnMemory) -> Result<Option<Rejoined>, VerbsError> {
        Ok(self.rejoin_chain(c, mem)?.map(|r| Rejoined { qp: r.qp, primed: r.primed }))
    }
    fn max_message_len(&self) -> u64 {
        self.max_message_len()
    }
}
