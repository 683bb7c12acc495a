//! The loopback model as a transport: no RDMA device needed (tests, CI, the examples here).
//!
//! The model (omw-loopback) is single-threaded and runs in virtual time. [`Model::start`]
//! gives it a thread of its own that owns the whole cluster — the MN on its driver, the
//! fabric — and runs one job at a time; a CN's device, [`ModelDevice`], sends each device
//! call there and waits for the answer, so any number of application threads drive it
//! safely, in the order the jobs arrive. After every post the model thread pumps the cluster
//! (the fabric runs, the MN reacts), then signals every armed CN whose completion queues grew:
//! a datagram on a connected pair of loopback UDP sockets — a real, non-blocking fd that tokio
//! (or the caller's event loop) watches as it would a verbs completion channel — and a bell
//! (a condvar) a blocking waiter sleeps on.
//!
//! The model's memory is not the process's, so a registered buffer is mirrored in the CN
//! host's memory: a zero-copy access is still one work request naming the buffer's key,
//! without an I/O slot's staging memory, and the library copies the bytes between the buffer
//! and its mirror where a real device would DMA them ([`Transport::mirrors_buffers`]).
//!
//! ```
//! use omw_client::model::{Model, ModelConfig};
//! let model = Model::start(ModelConfig { chunks: 8, ..Default::default() }).unwrap();
//! let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
//! let c = cn.alloc().unwrap();
//! assert_eq!(model.free_groups().unwrap(), 7);
//! cn.free(c).unwrap();
//! ```

use crate::client::Connect;
use crate::engine::IO_SLOTS;
use crate::error::Error;
use crate::transport::{Connection, Link, Registered, Rejoined, Signal, Transport};
use omw_core::access::AccessFlags;
use omw_core::chain::ChainKind;
use omw_core::chain::mlx5::Mlx5Arm;
use omw_core::cn::driver::{ChainConnection, CnMemory};
use omw_core::device::{
    Capabilities, Completion, DataPath, Domain, ExecutionMode, MrKeys, MwBinding, OffloadRings, Provision, QpState,
    WcStatus, WindowState,
};
use omw_core::ids::{Qpn, Rkey};
use omw_core::mn::Event;
use omw_core::mn::MnError;
use omw_core::mn::driver::DriverError;
use omw_core::mn::host_engine::LapFailure;
use omw_core::wire::wqe::{QueueSel, RecvWqe, Wqe};
use omw_loopback::cluster::{Cluster, ClusterConfig, ClusterError, DetachedCn};
use omw_loopback::{Fabric, HostId, LoopbackError, NicConfig, PdId, QpAddr};
use std::fmt;
use std::io;
use std::net::UdpSocket;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Bytes of one staging slot of a model CN (its local region holds [`IO_SLOTS`] of them).
///
/// ```
/// # let model = omw_client::model::Model::start(omw_client::model::ModelConfig { chunk_size: 64 << 10, chunks: 2, ..Default::default() }).unwrap();
/// # let cn = omw_client::Cn::connect(&model, Default::default()).unwrap();
/// // a staged access longer than a slot goes out in slot-sized pieces
/// let c = cn.alloc().unwrap();
/// cn.write(&c, 0, &vec![1u8; 2 * omw_client::model::MODEL_STAGING_SLOT as usize]).unwrap();
/// ```
pub const MODEL_STAGING_SLOT: u64 = 16 << 10;

/// The cluster a [`Model`] runs.
///
/// ```
/// let c = omw_client::model::ModelConfig::default();
/// assert_eq!((c.chunk_size, c.group_size), (4096, 2));
/// ```
#[derive(Clone, Copy, Debug)]
pub struct ModelConfig {
    pub chunk_size: u64,
    pub chunks: u32,
    /// G: windows per chunk (one on the Free QP, G − 1 access QPs).
    pub group_size: u8,
    /// Groups one CN may hold (0: the whole pool).
    pub quota: u32,
    /// CNs the MN has room for.
    pub max_cns: usize,
    pub nic: NicConfig,
    /// None: offload if the NIC can, host engine otherwise.
    pub mode: Option<ExecutionMode>,
    /// The largest single message the CNs' QPs carry (the model has no port limit of its own;
    /// this stands in for `max_msg_sz`).
    pub max_message: u64,
    /// Alloc chains one CN may open (1..=`MAX_ALLOC_CHAINS`, as `omw mn --alloc-chains`): the
    /// MN is provisioned for that many per CN; each CN opens as many as its [`Target`] asks
    /// (one by default), and one asking for more is refused ([`crate::Error::AllocChains`]).
    ///
    /// [`MAX_ALLOC_CHAINS`]: omw_core::mn::MAX_ALLOC_CHAINS
    pub alloc_chains: u8,
    /// Lay the MN's chains out for this layout instead of the one the NIC's answers choose
    /// (`ClusterConfig::chain_variant`): to run a layout on a device it does not fit, and see
    /// what the MN and the library do then.
    pub chain_variant: Option<omw_core::chain::variant::ChainVariant>,
}

impl Default for ModelConfig {
    /// 64 chunks of 4 KiB, G = 2, 8 CNs, the strict NIC (offloaded chains), 1 GiB messages.
    fn default() -> Self {
        ModelConfig {
            chunk_size: 4096,
            chunks: 64,
            group_size: 2,
            quota: 0,
            max_cns: 8,
            nic: NicConfig::strict(),
            mode: None,
            max_message: 1 << 30,
            alloc_chains: 1,
            chain_variant: None,
        }
    }
}

/// Why the model failed.
///
/// ```
/// use omw_client::model::{Model, ModelConfig, ModelError};
/// let e = Model::start(ModelConfig { chunk_size: 3, ..Default::default() }).unwrap_err();
/// assert!(matches!(e, ModelError::Cluster(_)));
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum ModelError {
    /// A call the model refused.
    Model(LoopbackError),
    /// The cluster (its MN, its pump) failed.
    Cluster(Arc<ClusterError>),
    /// The model's thread is gone.
    Stopped,
    /// No such CN on this model (it disconnected).
    NoSuchCn,
    /// The signal sockets could not be set up.
    Signal(io::ErrorKind),
    /// A CN asked to open a number of alloc chains outside 1..=`MAX_ALLOC_CHAINS`.
    AllocChainsOutOfRange { asked: u8 },
    /// The MN refused a CN asking more alloc chains than it allows
    /// ([`ModelConfig::alloc_chains`]; the core's `MnError::AllocChains`, what an MN over
    /// rdma_cm sends as a `Refusal`), before anything of the CN was set up. The library
    /// reports it as [`crate::Error::AllocChains`].
    AllocChains { allowed: u8, asked: u8 },
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelError::Model(e) => write!(f, "model: {e}"),
            ModelError::Cluster(e) => write!(f, "cluster: {e}"),
            ModelError::Stopped => f.write_str("the model's thread has stopped"),
            ModelError::NoSuchCn => f.write_str("no such CN on the model"),
            ModelError::Signal(k) => write!(f, "the signal sockets: {k}"),
            ModelError::AllocChains { allowed, asked } => {
                write!(f, "this CN asked for {asked} alloc chains, the MN allows at most {allowed}")
            }
            ModelError::AllocChainsOutOfRange { asked } => {
                write!(f, "{asked} alloc chains: a CN opens 1..={}", omw_core::mn::MAX_ALLOC_CHAINS)
            }
        }
    }
}

impl std::error::Error for ModelError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ModelError::Model(e) => Some(e),
            ModelError::Cluster(e) => Some(&**e),
            _ => None,
        }
    }
}

impl From<LoopbackError> for ModelError {
    fn from(e: LoopbackError) -> Self {
        ModelError::Model(e)
    }
}
impl From<ClusterError> for ModelError {
    fn from(e: ClusterError) -> Self {
        ModelError::Cluster(Arc::new(e))
    }
}

type R<T> = Result<T, ModelError>;
type Job = Box<dyn FnOnce(&mut World) + Send>;

/// A CN of the model as its thread keeps it.
struct Cn {
    cn: DetachedCn,
    qps: Vec<QpAddr>,
    tx: UdpSocket,
    bell: Arc<Bell>,
    lost: Arc<AtomicBool>,
    /// Armed: the sum of the CN's CQ counts when it was.
    armed: Option<u64>,
}

/// Everything the model's thread owns.
struct World {
    cluster: Cluster,
    cns: Vec<Option<Cn>>,
    /// The MN host crashed ([`Model::kill_mn`]): only the fabric runs any more.
    mn_dead: bool,
    /// [`Model::pause`]: nothing runs — posts queue, virtual time stands still.
    paused: bool,
}

impl World {
    fn fabric(&self) -> std::cell::RefMut<'_, Fabric> {
        self.cluster.fabric.borrow_mut()
    }

    fn cn(&self, i: usize) -> R<&Cn> {
        self.cns.get(i).and_then(Option::as_ref).ok_or(ModelError::NoSuchCn)
    }

    /// Run what was posted: the whole cluster while the MN lives, else the fabric alone.
    fn pump(&mut self) -> R<()> {
        if self.paused {
            // what is already visible still signals; nothing new happens
        } else if self.mn_dead {
            self.fabric().run_until_idle(10_000_000);
        } else {
            self.cluster.pump()?;
        }
        self.notify();
        Ok(())
    }

    fn cq_sum(f: &Fabric, qps: &[QpAddr]) -> u64 {
        let mut s = 0u64;
        for q in qps {
            for sel in [QueueSel::Send, QueueSel::Recv] {
                s = s.wrapping_add(f.cq_count(*q, sel).unwrap_or(0));
            }
        }
        s
    }

    /// Signal every armed CN whose queues grew since it armed.
    fn notify(&mut self) {
        let f = self.cluster.fabric.borrow();
        for c in self.cns.iter_mut().flatten() {
            if let Some(at) = c.armed {
                if Self::cq_sum(&f, &c.qps) != at {
                    c.armed = None;
                    signal(c);
                }
            }
        }
    }

    /// The CN is about to sleep: arm it, then let virtual time pass as real time does while
    /// it sleeps — one RNR period, running the MN's timers and expiring RNR waits that fall
    /// in it (without that, a SEND waiting for a receive nobody will post never fails, as it
    /// would on a wire).
    fn arm(&mut self, i: usize) -> R<()> {
        let sum = {
            let c = self.cn(i)?;
            Self::cq_sum(&self.cluster.fabric.borrow(), &c.qps)
        };
        if let Some(Some(c)) = self.cns.get_mut(i) {
            c.armed = Some(sum);
        }
        if self.paused {
            // no time passes while the model is paused: [`Model::resume`] signals
            return Ok(());
        }
        let step = self.fabric().config().cost.rnr_timeout_ns;
        if self.mn_dead {
            let t = self.fabric().now() + step;
            self.fabric().run_until(t, 10_000_000);
            self.fabric().advance_to(t);
        } else {
            self.cluster.advance(step)?;
        }
        self.notify();
        Ok(())
    }

    fn qa(&self, i: usize, q: Qpn) -> R<QpAddr> {
        Ok(QpAddr::new(self.cn(i)?.cn.host, q))
    }

    /// CN `i` rejoins chain connection `c`, whose QP `qp` broke: the model reconnects the pair
    /// in place (the same QP numbers; a pair the MN's own repair reset already is up again),
    /// and the MN hears of it as the DEVX MN does (`omw_verbs::mn`'s rejoin): a failure of
    /// that chain, repaired and re-armed on the new connection. False: no MN to rejoin.
    fn rejoin(&mut self, i: usize, c: ChainConnection, qp: Qpn) -> R<bool> {
        if self.mn_dead {
            return Ok(false);
        }
        let q = self.qa(i, qp)?;
        if self.fabric().qp_state(q)? != QpState::Rts {
            self.fabric().reset_qp(q)?;
        }
        let cn = self.cn(i)?.cn.id;
        let (kind, chain) = match c {
            ChainConnection::Alloc(j) => (ChainKind::Alloc, j),
            ChainConnection::Free => (ChainKind::Free, 0),
        };
        let now = self.cluster.now();
        let failure = LapFailure::Status(WcStatus::WrFlushErr);
        let replaced = Event::ChainFailed { cn, kind, chain, step: None, failure };
        self.cluster.driver.handle(now, replaced).map_err(ClusterError::Driver)?;
        self.pump()?;
        Ok(true)
    }
}

/// A CN's signal: a datagram for whoever watches the fd (tokio, the caller's event loop), and
/// a bell for a thread sleeping in [`Signal::wait`] (a blocking wait with a timeout on a
/// socket tokio also watches would need the socket blocking, which tokio refuses).
#[derive(Debug, Default)]
struct Bell {
    rung: AtomicU64,
    heard: AtomicU64,
    m: Mutex<()>,
    cv: Condvar,
}

fn signal(c: &Cn) {
    // never blocks the model: a full socket is readable already
    let _ = c.tx.send(&[1]);
    c.bell.rung.fetch_add(1, Ordering::AcqRel);
    drop(c.bell.m.lock());
    c.bell.cv.notify_all();
}

struct Inner {
    tx: Sender<Job>,
    thread: Mutex<Option<JoinHandle<()>>>,
    cfg: ModelConfig,
    caps: Capabilities,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // the sender goes with us; the thread sees its channel close and ends
        let (dead, _) = std::sync::mpsc::channel();
        self.tx = dead;
        if let Some(t) = self.thread.get_mut().ok().and_then(Option::take) {
            let _ = t.join();
        }
    }
}

impl Inner {
    fn call<T: Send + 'static>(&self, f: impl FnOnce(&mut World) -> T + Send + 'static) -> R<T> {
        let (rtx, rrx): (SyncSender<T>, Receiver<T>) = std::sync::mpsc::sync_channel(1);
        self.tx
            .send(Box::new(move |w: &mut World| {
                let _ = rtx.send(f(w));
            }))
            .map_err(|_| ModelError::Stopped)?;
        rrx.recv().map_err(|_| ModelError::Stopped)
    }
}

/// The loopback model on a thread of its own (cheap to clone; the thread ends with the last
/// clone and the last CN).
///
/// ```
/// let model = omw_client::model::Model::start(Default::default()).unwrap();
/// assert_eq!(model.free_groups().unwrap(), 64);
/// ```
#[derive(Clone)]
pub struct Model {
    inner: Arc<Inner>,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Model").field("cfg", &self.inner.cfg).finish()
    }
}

impl Model {
    /// Build the cluster (its MN provisioned by the plan) on a new thread.
    ///
    /// ```
    /// use omw_client::model::{Model, ModelConfig};
    /// use omw_core::device::ExecutionMode;
    /// let m = Model::start(ModelConfig { mode: Some(ExecutionMode::HostEngine), ..Default::default() }).unwrap();
    /// assert_eq!(m.mode().unwrap(), ExecutionMode::HostEngine);
    /// ```
    pub fn start(cfg: ModelConfig) -> Result<Model, ModelError> {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<R<Capabilities>>(1);
        let thread = std::thread::Builder::new()
            .name("omw-model".into())
            // the mlx5 arming path keeps large temporaries on unoptimised builds
            .stack_size(16 << 20)
            .spawn(move || {
                let cc = ClusterConfig {
                    cns: 0,
                    chunk_size: cfg.chunk_size,
                    chunks: cfg.chunks,
                    group_size: cfg.group_size,
                    quota: cfg.quota,
                    mode: cfg.mode,
                    nic: cfg.nic,
                    scrub: true,
                    lease_ns: 0,
                    pop_ahead: None,
                    // the CNs this handle connects later, each a detached CN
                    max_cns: Some(cfg.max_cns as u32),
                    alloc_chains: cfg.alloc_chains,
                    chain_variant: cfg.chain_variant,
                };
                let cluster = match Cluster::new(cc) {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.into()));
                        return;
                    }
                };
                let caps = cluster.fabric.borrow().capabilities();
                let _ = ready_tx.send(Ok(caps));
                let mut w = World { cluster, cns: Vec::new(), mn_dead: false, paused: false };
                while let Ok(job) = rx.recv() {
                    job(&mut w);
                }
            })
            .map_err(|_| ModelError::Stopped)?;
        let caps = match ready_rx.recv() {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => return Err(ModelError::Stopped),
        };
        Ok(Model { inner: Arc::new(Inner { tx, thread: Mutex::new(Some(thread)), cfg, caps }) })
    }

    /// The configuration it runs.
    ///
    /// ```
    /// let m = omw_client::model::Model::start(Default::default()).unwrap();
    /// assert_eq!(m.config().chunks, 64);
    /// ```
    pub fn config(&self) -> &ModelConfig {
        &self.inner.cfg
    }

    /// Which mode the MN runs its chains in.
    ///
    /// ```
    /// let m = omw_client::model::Model::start(Default::default()).unwrap();
    /// assert_eq!(m.mode().unwrap(), omw_core::device::ExecutionMode::Offloaded);
    /// ```
    pub fn mode(&self) -> Result<ExecutionMode, ModelError> {
        self.inner.call(|w| w.cluster.mode)
    }

    /// Groups no CN holds right now: the MN's free queue (scanned) plus any group an
    /// offloaded alloc chain has already popped for a CN's next request (pop-ahead,
    /// docs/ARCHITECTURE.md) — those are still the pool's, not the CN's.
    ///
    /// ```
    /// let m = omw_client::model::Model::start(Default::default()).unwrap();
    /// assert_eq!(m.free_groups().unwrap(), m.config().chunks);
    /// ```
    pub fn free_groups(&self) -> Result<u32, ModelError> {
        self.inner.call(|w| w.cluster.unallocated())
    }

    /// Run `f` on the cluster, on the model's thread (its MN statistics, invariants, faults).
    ///
    /// ```
    /// let m = omw_client::model::Model::start(Default::default()).unwrap();
    /// let reclaimed = m.with_cluster(|c| c.driver.mn.stats().groups_reclaimed).unwrap();
    /// assert_eq!(reclaimed, 0);
    /// m.with_cluster(|c| c.check_invariants()).unwrap().unwrap();
    /// ```
    pub fn with_cluster<T: Send + 'static>(&self, f: impl FnOnce(&mut Cluster) -> T + Send + 'static) -> R<T> {
        self.inner.call(move |w| f(&mut w.cluster))
    }

    /// The MN's host crashes: its QPs vanish, and every CN hears that its connection is lost
    /// (the way rdma_cm reports a disconnect).
    ///
    /// ```
    /// let m = omw_client::model::Model::start(Default::default()).unwrap();
    /// let cn = omw_client::Cn::connect(&m, Default::default()).unwrap();
    /// m.kill_mn().unwrap();
    /// assert_eq!(cn.alloc(), Err(omw_client::Error::Disconnected));
    /// ```
    pub fn kill_mn(&self) -> R<()> {
        self.inner.call(|w| {
            w.mn_dead = true;
            let mn = w.cluster.mn_host;
            w.fabric().crash_host(mn)?;
            for c in w.cns.iter().flatten() {
                c.lost.store(true, Ordering::Release);
                signal(c);
            }
            w.fabric().run_until_idle(10_000_000);
            Ok(())
        })?
    }

    /// Stop the model: from now on nothing runs — a CN's posts queue on its QPs, nothing is
    /// delivered or executed, virtual time stands still, a polling CN sees only what completed
    /// before — until [`Model::resume`]. What tests use to hold a CN's requests in flight
    /// (an MN whose loop is held), as the verbs tests hold the MN's thread.
    ///
    /// ```
    /// use omw_client::{model::Model, AsyncCn, Cn};
    /// let m = Model::start(Default::default()).unwrap();
    /// let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    /// rt.block_on(async {
    ///     let cn = AsyncCn::new(Cn::connect(&m, Default::default()).unwrap()).unwrap();
    ///     m.pause().unwrap();
    ///     let a = tokio::spawn({ let cn = cn.clone(); async move { cn.alloc().await } });
    ///     tokio::task::yield_now().await;
    ///     assert_eq!(cn.cn().allocs_in_flight(), 1); // sent, unanswered
    ///     m.resume().unwrap();
    ///     let c = a.await.unwrap().unwrap();
    ///     cn.free(c).await.unwrap();
    /// });
    /// ```
    pub fn pause(&self) -> R<()> {
        self.inner.call(|w| w.paused = true)
    }

    /// Let the model run again after [`Model::pause`]: what was posted meanwhile runs, and every
    /// CN whose queues grew is signalled.
    pub fn resume(&self) -> R<()> {
        self.inner.call(|w| {
            w.paused = false;
            w.pump()
        })?
    }

    /// A CN to connect to this model, opening one alloc chain unless told otherwise
    /// ([`Target::alloc_chains`]).
    ///
    /// ```
    /// use omw_client::model::{Model, ModelConfig};
    /// let m = Model::start(ModelConfig { alloc_chains: 2, ..Default::default() }).unwrap();
    /// let cn = omw_client::Cn::connect(m.target().alloc_chains(2), Default::default()).unwrap();
    /// assert_eq!(cn.alloc_chains(), 2);
    /// ```
    pub fn target(&self) -> Target {
        Target { model: self.clone(), alloc_chains: 1 }
    }

    /// Connect a CN of one alloc chain (what [`crate::Cn::connect`] calls with `&Model`).
    ///
    /// ```
    /// let m = omw_client::model::Model::start(Default::default()).unwrap();
    /// let c = m.connect().unwrap();
    /// assert!(c.primed);
    /// assert!(c.extra_alloc.is_empty());
    /// ```
    pub fn connect(&self) -> Result<Connection<ModelDevice>, ModelError> {
        self.connect_with_chains(1)
    }

    /// Connect a CN that opens `chains` alloc chains (1..=`MAX_ALLOC_CHAINS`, at most
    /// [`ModelConfig::alloc_chains`]): an Alloc QP and a reply slot per chain, so up to `chains`
    /// of its allocations are in flight at once. More than the MN allows is refused
    /// ([`ModelError::AllocChains`]) before anything of the CN is set up.
    ///
    /// [`MAX_ALLOC_CHAINS`]: omw_core::mn::MAX_ALLOC_CHAINS
    ///
    /// ```
    /// use omw_client::model::{Model, ModelConfig, ModelError};
    /// let m = Model::start(ModelConfig { alloc_chains: 2, ..Default::default() }).unwrap();
    /// assert_eq!(m.connect_with_chains(2).unwrap().extra_alloc.len(), 1);
    /// let e = m.connect_with_chains(3).unwrap_err();
    /// assert!(matches!(e, ModelError::AllocChains { allowed: 2, asked: 3 }));
    /// ```
    pub fn connect_with_chains(&self, chains: u8) -> Result<Connection<ModelDevice>, ModelError> {
        if chains == 0 || chains as usize > omw_core::mn::MAX_ALLOC_CHAINS {
            return Err(ModelError::AllocChainsOutOfRange { asked: chains });
        }
        let pair = || -> io::Result<(UdpSocket, UdpSocket)> {
            let rx = UdpSocket::bind("127.0.0.1:0")?;
            let tx = UdpSocket::bind("127.0.0.1:0")?;
            rx.connect(tx.local_addr()?)?;
            tx.connect(rx.local_addr()?)?;
            tx.set_nonblocking(true)?;
            Ok((rx, tx))
        };
        let (rx, tx) = pair().map_err(|e| ModelError::Signal(e.kind()))?;
        rx.set_nonblocking(true).map_err(|e| ModelError::Signal(e.kind()))?;
        let bell = Arc::new(Bell::default());
        let lost = Arc::new(AtomicBool::new(false));
        let (b2, l2) = (bell.clone(), lost.clone());
        let local_len = CnMemory::local_len_for(IO_SLOTS, MODEL_STAGING_SLOT);
        let (idx, cn) = self.inner.call(move |w| -> R<(usize, DetachedCn)> {
            if w.mn_dead {
                return Err(ModelError::Stopped);
            }
            let cn = match w.cluster.connect_detached_cn_with_chains(local_len, chains) {
                Err(ClusterError::Driver(DriverError::Node(MnError::AllocChains { allowed, asked }))) => {
                    return Err(ModelError::AllocChains { allowed, asked });
                }
                r => r?,
            };
            // every queue a completion may arrive on signals the CN: its extra Alloc QPs' too
            let qps: Vec<QpAddr> = [cn.qps.alloc, cn.qps.free]
                .into_iter()
                .chain(cn.qps.access.iter().copied())
                .chain(cn.extra_alloc.iter().copied())
                .map(|q| QpAddr::new(cn.host, q))
                .collect();
            w.cns.push(Some(Cn { cn: cn.clone(), qps, tx, bell: b2, lost: l2, armed: None }));
            Ok((w.cns.len() - 1, cn))
        })??;
        let device = ModelDevice {
            model: self.inner.clone(),
            idx,
            host: cn.host,
            caps: self.inner.caps,
            max_message: self.inner.cfg.max_message,
            rx,
            bell,
            lost,
        };
        let mn_qpns =
            [cn.mn_qps.alloc, cn.mn_qps.free].into_iter().chain(cn.mn_qps.access.iter().copied()).map(Some).collect();
        Ok(Connection {
            device,
            qps: cn.qps,
            mem: cn.mem,
            primed: true,
            mn_qpns,
            extra_alloc: cn.extra_alloc,
            reply_len: cn.reply_len,
        })
    }
}

/// What a model CN opens: the model's counterpart of `verbs::Target` (feature `verbs`).
///
/// ```
/// use omw_client::model::{Model, ModelConfig};
/// let m = Model::start(ModelConfig { alloc_chains: 4, ..Default::default() }).unwrap();
/// let t = m.target().alloc_chains(3);
/// assert_eq!(t.chains(), 3);
/// ```
#[derive(Clone, Debug)]
pub struct Target {
    model: Model,
    alloc_chains: u8,
}

impl Target {
    /// Open `k` alloc chains (1..=4, at most the model's [`ModelConfig::alloc_chains`]; the MN
    /// refuses more with [`Error::AllocChains`]): `k` allocations of the CN in flight at once.
    pub fn alloc_chains(mut self, k: u8) -> Target {
        self.alloc_chains = k;
        self
    }

    /// The alloc chains it will open.
    pub fn chains(&self) -> u8 {
        self.alloc_chains
    }
}

/// A refusal the application can act on becomes the library's own error, as over verbs.
fn connect_err(e: ModelError) -> Error {
    match e {
        ModelError::AllocChains { allowed, asked } => Error::AllocChains { allowed, asked },
        e => Error::transport(e),
    }
}

impl Connect for Target {
    type Transport = ModelDevice;
    fn connect(self) -> Result<Connection<ModelDevice>, Error> {
        self.model.connect_with_chains(self.alloc_chains).map_err(connect_err)
    }
}

impl Connect for &Model {
    type Transport = ModelDevice;
    fn connect(self) -> Result<Connection<ModelDevice>, Error> {
        Model::connect(self).map_err(connect_err)
    }
}

/// One CN's device on the model: every call runs on the model's thread.
///
/// ```
/// use omw_core::device::DataPath;
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// let c = model.connect().unwrap();
/// let d: &omw_client::model::ModelDevice = &c.device;
/// assert!(d.capabilities().contains(omw_core::device::Capabilities::MW_ATOMICS));
/// ```
pub struct ModelDevice {
    model: Arc<Inner>,
    idx: usize,
    host: HostId,
    caps: Capabilities,
    max_message: u64,
    rx: UdpSocket,
    bell: Arc<Bell>,
    lost: Arc<AtomicBool>,
}

impl fmt::Debug for ModelDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelDevice").field("cn", &self.idx).field("host", &self.host).finish()
    }
}

impl Drop for ModelDevice {
    /// The CN leaves: its host goes down and the MN reclaims what it still held.
    fn drop(&mut self) {
        let i = self.idx;
        let _ = self.model.tx.send(Box::new(move |w: &mut World| {
            if let Some(Some(c)) = w.cns.get_mut(i).map(Option::take) {
                if !w.mn_dead {
                    let _ = w.cluster.disconnect_detached_cn(&c.cn);
                    w.notify();
                }
            }
        }));
    }
}

impl ModelDevice {
    /// The model host this CN runs on (for a test's faults: `omw_loopback::MessageFilter`).
    pub fn host(&self) -> HostId {
        self.host
    }

    fn call<T: Send + 'static>(&self, f: impl FnOnce(&mut World, usize) -> R<T> + Send + 'static) -> R<T> {
        let i = self.idx;
        self.model.call(move |w| f(w, i))?
    }
}

impl DataPath for ModelDevice {
    type Error = ModelError;
    fn capabilities(&self) -> Capabilities {
        self.caps
    }
    fn post_send(&mut self, qp: Qpn, wqe: &Wqe) -> R<()> {
        let wqe = *wqe;
        self.call(move |w, i| {
            let q = w.qa(i, qp)?;
            w.fabric().post_send(q, &wqe)?;
            w.pump()
        })
    }
    fn post_recv(&mut self, qp: Qpn, wqe: &RecvWqe) -> R<()> {
        let wqe = wqe.clone();
        self.call(move |w, i| {
            let q = w.qa(i, qp)?;
            w.fabric().post_recv(q, &wqe)?;
            w.pump()
        })
    }
    fn poll_cq(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> R<usize> {
        let n = out.len();
        let got = self.call(move |w, i| {
            let q = w.qa(i, qp)?;
            let mut v = vec![Completion::EMPTY; n];
            let before = w.fabric().now();
            // a CPU spinning on its CQ: the NIC runs, the clock reaches the first completion
            // (paused: only what completed before)
            let k = if w.paused { w.fabric().poll(q, queue, &mut v)? } else { w.fabric().poll_cq(q, queue, &mut v)? };
            v.truncate(k);
            if w.fabric().now() != before {
                // time passed: the MN's timers may be due
                w.pump()?;
            }
            Ok(v)
        })?;
        out[..got.len()].copy_from_slice(&got);
        Ok(got.len())
    }
    fn enable(&mut self, qp: Qpn, queue: QueueSel, count: u64) -> R<()> {
        self.call(move |w, i| Ok(w.fabric().enable(w.qa(i, qp)?, queue, count)?))
    }
    fn reset_qp(&mut self, qp: Qpn) -> R<()> {
        self.call(move |w, i| Ok(w.fabric().reset_qp(w.qa(i, qp)?)?))
    }
    fn destroy_qp(&mut self, qp: Qpn) -> R<()> {
        self.call(move |w, i| Ok(w.fabric().destroy_qp(w.qa(i, qp)?)?))
    }
    fn qp_state(&self, qp: Qpn) -> R<QpState> {
        self.call(move |w, i| Ok(w.fabric().qp_state(w.qa(i, qp)?)?))
    }
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> R<()> {
        let n = buf.len();
        let host = self.host;
        let v = self.call(move |w, _| {
            let mut v = vec![0u8; n];
            w.fabric().read(host, addr, &mut v)?;
            Ok(v)
        })?;
        buf.copy_from_slice(&v);
        Ok(())
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> R<()> {
        let v = data.to_vec();
        let host = self.host;
        self.call(move |w, _| Ok(w.fabric().write(host, addr, &v)?))
    }
    fn outstanding(&self, qp: Qpn, queue: QueueSel) -> Option<u64> {
        self.call(move |w, i| Ok(w.fabric().outstanding(w.qa(i, qp)?, queue))).ok().flatten()
    }
}

impl Provision for ModelDevice {
    fn reg_mr(&mut self, domain: Domain, addr: u64, len: u64, access: AccessFlags) -> R<MrKeys> {
        if domain == Domain::MnPrivate {
            return Err(ModelError::Model(LoopbackError::NoSuchPd { host: self.host, pd: u32::MAX }));
        }
        let host = self.host;
        self.call(move |w, _| Ok(w.fabric().reg_mr(host, PdId(0), addr, len, access)?))
    }
    fn alloc_mw(&mut self) -> R<Rkey> {
        let host = self.host;
        self.call(move |w, _| Ok(w.fabric().alloc_mw(host, PdId(0))?))
    }
    fn alloc_memory(&mut self, len: u64, align: u64) -> R<u64> {
        let host = self.host;
        self.call(move |w, _| Ok(w.fabric().alloc(host, len, align)?))
    }
    fn create_loopback_qp(&mut self, domain: Domain, managed: Option<u32>) -> R<Qpn> {
        if domain == Domain::MnPrivate {
            return Err(ModelError::Model(LoopbackError::NoSuchPd { host: self.host, pd: u32::MAX }));
        }
        let host = self.host;
        self.call(move |w, _| Ok(w.fabric().create_loopback_qp(host, PdId(0), managed)?.qpn))
    }
}

impl OffloadRings for ModelDevice {
    fn ring_base(&self, qp: Qpn, queue: QueueSel) -> R<u64> {
        self.call(move |w, i| Ok(w.fabric().ring_base(w.qa(i, qp)?, queue)?))
    }
    fn ring_keys(&self, domain: Domain) -> R<MrKeys> {
        if domain == Domain::MnPrivate {
            return Err(ModelError::Model(LoopbackError::NoSuchPd { host: self.host, pd: u32::MAX }));
        }
        let host = self.host;
        self.call(move |w, _| Ok(w.fabric().ring_keys_in(host, PdId(0))?))
    }
    fn send_wqes_executed(&self, qp: Qpn) -> Option<u64> {
        self.call(move |w, i| Ok(w.fabric().qp_stats(w.qa(i, qp)?).ok().map(|s| s.wqes_executed))).ok().flatten()
    }
    fn recv_doorbell(&self, qp: Qpn) -> R<Option<omw_core::device::RecvDoorbell>> {
        self.call(move |w, i| Ok(w.fabric().recv_doorbell(w.qa(i, qp)?)?))
    }
}

impl WindowState for ModelDevice {
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        let host = self.host;
        self.call(move |w, _| Ok(WindowState::mw_binding(&w.fabric().view(host), rkey))).ok().flatten()
    }
    fn mw_span(&self, rkey: Rkey) -> Option<(u64, u64)> {
        let host = self.host;
        self.call(move |w, _| Ok(WindowState::mw_span(&w.fabric().view(host), rkey))).ok().flatten()
    }
}

impl Mlx5Arm for ModelDevice {
    fn cq_numbers(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> Option<[u32; 3]> {
        None
    }
    fn cq_producer_indices(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> [u32; 3] {
        [0; 3]
    }
    fn arm_mlx5(&mut self, _chain: &omw_core::chain::mlx5::Mlx5Chain, _recv_copies: u32) -> Option<R<()>> {
        None
    }
}

/// The waiting side of a model CN's signal socket.
///
/// ```
/// use omw_client::transport::Transport;
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// let c = model.connect().unwrap();
/// let s: omw_client::model::ModelSignal = c.device.signal().unwrap();
/// # let _ = s;
/// ```
#[derive(Debug)]
pub struct ModelSignal {
    sock: UdpSocket,
    bell: Arc<Bell>,
}

impl AsRawFd for ModelSignal {
    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }
}

/// A model CN's signal socket as tokio watches it.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use omw_client::transport::{Signal, Transport};
/// # let model = omw_client::model::Model::start(Default::default()).unwrap();
/// let c = model.connect().unwrap();
/// let _a: omw_client::model::AsyncModelSignal = c.device.signal().unwrap().to_async().unwrap();
/// # }
/// ```
#[cfg(feature = "tokio")]
#[derive(Debug)]
pub struct AsyncModelSignal(tokio::net::UdpSocket);

#[cfg(feature = "tokio")]
impl crate::transport::AsyncSignal for AsyncModelSignal {
    async fn readable(&self) -> io::Result<()> {
        self.0.readable().await?;
        // the datagrams are the library's to drain (take_events); only tokio's flag is cleared
        let _ = self.0.try_io(tokio::io::Interest::READABLE, || Err::<(), _>(io::ErrorKind::WouldBlock.into()));
        Ok(())
    }
}

impl Signal for ModelSignal {
    #[cfg(feature = "tokio")]
    type Async = AsyncModelSignal;
    #[cfg(feature = "tokio")]
    fn to_async(&self) -> io::Result<AsyncModelSignal> {
        Ok(AsyncModelSignal(tokio::net::UdpSocket::from_std(self.sock.try_clone()?)?))
    }
    fn wait(&self, timeout: Duration) -> io::Result<bool> {
        let b = &*self.bell;
        let g = b.m.lock().unwrap_or_else(|p| p.into_inner());
        // pending: rung and not yet heard, or rung since this wait began (whoever heard it)
        let start = b.rung.load(Ordering::Acquire);
        let quiet = || {
            let rung = b.rung.load(Ordering::Acquire);
            rung == b.heard.load(Ordering::Acquire) && rung == start
        };
        let _ = b.cv.wait_timeout_while(g, timeout, |_| quiet()).unwrap_or_else(|p| p.into_inner());
        Ok(!quiet())
    }
}

impl Transport for ModelDevice {
    type Fault = ModelError;
    type Signal = ModelSignal;
    fn signal(&self) -> io::Result<ModelSignal> {
        Ok(ModelSignal { sock: self.rx.try_clone()?, bell: self.bell.clone() })
    }
    fn arm(&mut self) -> R<()> {
        self.call(|w, i| {
            w.arm(i)?;
            // what arrived while it was unarmed is the caller's to poll; anything newer signals
            Ok(())
        })
    }
    fn take_events(&mut self) -> R<Link> {
        // what rang so far has been heard; then the datagrams (non-blocking: until none left).
        // A ring after this is heard by the next call; its completion, made before it rang,
        // is seen by the poll that follows this call.
        let rung = self.bell.rung.load(Ordering::Acquire);
        let mut buf = [0u8; 8];
        while self.rx.recv(&mut buf).is_ok() {}
        self.bell.heard.store(rung, Ordering::Release);
        Ok(if self.lost.load(Ordering::Acquire) { Link::Lost } else { Link::Up })
    }

    fn register(&mut self, _addr: u64, len: u64) -> R<Registered> {
        let host = self.host;
        self.call(move |w, _| {
            let mut f = w.fabric();
            let a = f.alloc(host, len, 64)?;
            let k = f.reg_mr(host, PdId(0), a, len, AccessFlags::LOCAL_WRITE)?;
            Ok(Registered { device_addr: a, lkey: k.lkey, len })
        })
    }
    fn deregister(&mut self, reg: &Registered) -> R<()> {
        let (host, lkey) = (self.host, reg.lkey);
        self.call(move |w, _| Ok(w.fabric().dereg_mr(host, lkey)?))
    }
    fn mirrors_buffers(&self) -> bool {
        true
    }
    /// The pair reconnected in place: the same QP, its receives to post again.
    fn rejoin(&mut self, c: ChainConnection, old: Qpn, _: &CnMemory) -> R<Option<Rejoined>> {
        let up = self.call(move |w, i| w.rejoin(i, c, old))?;
        Ok(up.then_some(Rejoined { qp: old, primed: false }))
    }
    fn max_message_len(&self) -> u64 {
        self.max_message
    }
}
