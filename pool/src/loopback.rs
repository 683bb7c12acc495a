//! A pool on the loopback model, in one process: MNs with several size classes, the
//! in-process registry, each MN's announcer, and a connector through which pool clients reach
//! the MNs' classes as CNs of the model.
//!
//! Each class of an MN is one `MemoryNode` with its own MWTable, free queue and chains — a
//! loopback [`Cluster`] (one MN host and the CNs connected to that class). On the model each
//! class is its own fabric with its own modelled clock (a real MN's classes share one RNIC);
//! nothing of the pool's logic depends on that. The pool's clock — the registry's leases and
//! the announcers' refreshes — is [`LoopbackPool::now`], moved by [`LoopbackPool::advance`].
//!
//! Faults: [`LoopbackPool::vanish`] crashes an MN's hosts without a goodbye (its record stays
//! until its lease runs out; CNs that touch it meanwhile lose their connection),
//! [`LoopbackPool::stop`] leaves cleanly, [`LoopbackPool::restart`] brings an MN back as a new
//! incarnation, [`LoopbackPool::drain`] is the operator's drain request.

use crate::announcer::{AnnounceTimes, Announcer, Refresh};
use crate::client::PoolClient;
use crate::entry::{ClassEntry, ClassSpec};
use crate::memory::InProcessRegistry;
use crate::registry::{BadName, Name, Registry, RegistryError};
use crate::session::{Connector, MnSession, SessionError};
use omw_core::cn::{Allocation, ClientError};
use omw_core::device::{ExecutionMode, WcStatus};
use omw_core::wire::message::ErrorCode;
use omw_loopback::cluster::{Cluster, ClusterConfig, ClusterError, CnOpError};
use omw_loopback::NicConfig;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// How the model's MNs are set up (every class of every MN alike but for its geometry).
#[derive(Clone, Copy, Debug)]
pub struct LoopbackMnConfig {
    pub mode: Option<ExecutionMode>,
    pub nic: NicConfig,
    pub group_size: u8,
    /// Groups one CN may hold in one class (the core's per-class quota).
    pub quota: u32,
    /// CN slots per class.
    pub max_cns: u32,
    /// The registry lease of each MN.
    pub ttl: Duration,
    /// Each pool CN's quota in bytes across an MN's classes (None: the per-class group quota
    /// only): the MN tells each class what the CN holds in the others (`MemoryNode::
    /// set_held_elsewhere`) after every allocation and free.
    pub byte_quota: Option<u64>,
}

impl Default for LoopbackMnConfig {
    fn default() -> Self {
        let base = ClusterConfig::paper_like();
        LoopbackMnConfig {
            mode: base.mode,
            nic: base.nic,
            group_size: base.group_size,
            quota: u32::MAX,
            max_cns: 8,
            ttl: crate::announcer::DEFAULT_TTL,
            byte_quota: None,
        }
    }
}

/// What went wrong setting up or driving the model's pool.
#[derive(Debug)]
#[non_exhaustive]
pub enum LoopbackPoolError {
    Name(BadName),
    Cluster(ClusterError),
    Registry(RegistryError),
    NoSuchMn(String),
}

impl fmt::Display for LoopbackPoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoopbackPoolError::Name(e) => write!(f, "{e}"),
            LoopbackPoolError::Cluster(e) => write!(f, "model: {e}"),
            LoopbackPoolError::Registry(e) => write!(f, "{e}"),
            LoopbackPoolError::NoSuchMn(n) => write!(f, "no MN {n:?} in the pool"),
        }
    }
}

impl std::error::Error for LoopbackPoolError {}

impl From<ClusterError> for LoopbackPoolError {
    fn from(e: ClusterError) -> Self {
        LoopbackPoolError::Cluster(e)
    }
}
impl From<RegistryError> for LoopbackPoolError {
    fn from(e: RegistryError) -> Self {
        LoopbackPoolError::Registry(e)
    }
}

/// One MN of the model: a cluster per class.
pub struct LoopbackMn {
    pub name: Name,
    pub incarnation: u64,
    pub specs: Vec<ClassSpec>,
    pub classes: Vec<Rc<RefCell<Cluster>>>,
    pub vanished: bool,
}

/// Which CN of each class a pool client is, so the MN can count what the same client holds
/// across its classes (the byte quota). In a real MN process that identity is an authenticated
/// tenant; on the model the pool knows its clients.
#[derive(Debug, Default)]
struct Ledger {
    classes: Vec<(Rc<RefCell<Cluster>>, u64)>,
    /// (pool client, class, CN index in that class's cluster)
    sessions: RefCell<Vec<(u64, usize, usize)>>,
}

impl Ledger {
    /// Tell every class of the MN what `owner` holds in the others.
    fn sync(&self, owner: u64) {
        let sessions: Vec<(usize, usize)> =
            self.sessions.borrow().iter().filter(|(o, _, _)| *o == owner).map(|(_, k, cn)| (*k, *cn)).collect();
        let mut held = vec![0u64; self.classes.len()];
        let mut ids = vec![None; self.classes.len()];
        for (k, cn) in &sessions {
            let Some((c, chunk)) = self.classes.get(*k) else { continue };
            let Ok(c) = c.try_borrow() else { continue };
            let Some(id) = c.cns.get(*cn).map(|n| n.id) else { continue };
            ids[*k] = Some(id);
            let owned = (0..c.cfg.chunks)
                .filter(|g| c.driver.entry(omw_core::ids::GroupId(*g)).is_some_and(|e| e.owner() == id.get()))
                .count() as u64;
            held[*k] = owned * chunk;
        }
        let total: u64 = held.iter().sum();
        for (k, id) in ids.iter().enumerate() {
            let Some(id) = id else { continue };
            if let Ok(mut c) = self.classes[k].0.try_borrow_mut() {
                let _ = c.driver.mn.set_held_elsewhere(*id, total - held[k]);
            }
        }
    }
}

impl fmt::Debug for LoopbackMn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackMn").field("name", &self.name).field("specs", &self.specs).finish()
    }
}

impl LoopbackMn {
    fn addr(name: &Name, incarnation: u64, chunk_size: u64) -> String {
        format!("loopback:{name}#{incarnation}/{chunk_size}")
    }

    /// Free chunks of each class now (scanned from the queue).
    pub fn free_counts(&self) -> Vec<u32> {
        self.classes.iter().map(|c| c.borrow().free_groups()).collect()
    }

    /// Chunks CNs were handed, per class (groups an alloc chain popped ahead for its CN's next
    /// request are not theirs yet).
    pub fn held_per_class(&self) -> Vec<u64> {
        self.classes.iter().map(|c| c.borrow()).map(|c| (c.cfg.chunks - c.unallocated()) as u64).collect()
    }

    /// Chunks held by CNs over all classes.
    pub fn held(&self) -> u64 {
        self.held_per_class().iter().sum()
    }

    fn entries(&self) -> Vec<ClassEntry> {
        self.specs
            .iter()
            .zip(self.free_counts())
            .map(|(s, free)| ClassEntry {
                chunk_size: s.chunk_size,
                chunks: s.chunks,
                free,
                group_size: self.classes[0].borrow().cfg.group_size,
                addr: Self::addr(&self.name, self.incarnation, s.chunk_size),
            })
            .collect()
    }

    /// The protocol's invariants on every class.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (s, c) in self.specs.iter().zip(&self.classes) {
            c.borrow_mut().check_invariants().map_err(|e| format!("{} class {} B: {e}", self.name, s.chunk_size))?;
        }
        Ok(())
    }
}

/// Class address → (its cluster, its index in the MN, the MN's ledger).
type Book = Rc<RefCell<HashMap<String, (Rc<RefCell<Cluster>>, usize, Rc<Ledger>)>>>;

/// The model's pool: MNs, the registry, the clock.
pub struct LoopbackPool {
    pub registry: InProcessRegistry,
    pub pool: Name,
    pub cfg: LoopbackMnConfig,
    mns: Vec<(LoopbackMn, Option<Announcer>)>,
    book: Book,
    now: u64,
    next_incarnation: u64,
    next_client: u64,
}

impl fmt::Debug for LoopbackPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackPool").field("pool", &self.pool).field("mns", &self.mns.len()).finish()
    }
}

impl LoopbackPool {
    pub fn new(pool: &str, cfg: LoopbackMnConfig) -> Result<Self, LoopbackPoolError> {
        Ok(LoopbackPool {
            registry: InProcessRegistry::new(),
            pool: Name::new(pool).map_err(LoopbackPoolError::Name)?,
            cfg,
            mns: Vec::new(),
            book: Rc::new(RefCell::new(HashMap::new())),
            now: 0,
            next_incarnation: 0x1000,
            next_client: 0,
        })
    }

    pub fn now(&self) -> u64 {
        self.now
    }

    fn provision(&mut self, name: &Name, specs: &[ClassSpec]) -> Result<LoopbackMn, LoopbackPoolError> {
        self.next_incarnation += 1;
        let incarnation = self.next_incarnation;
        let mut classes = Vec::new();
        for s in specs {
            let mut cc = ClusterConfig::paper_like();
            cc.cns = 0;
            cc.max_cns = Some(self.cfg.max_cns);
            cc.chunk_size = s.chunk_size;
            cc.chunks = s.chunks;
            cc.group_size = self.cfg.group_size;
            cc.quota = self.cfg.quota.min(s.chunks);
            cc.mode = self.cfg.mode;
            cc.nic = self.cfg.nic;
            classes.push(Rc::new(RefCell::new(Cluster::new(cc)?)));
        }
        let ledger = Rc::new(Ledger {
            classes: classes.iter().zip(specs).map(|(c, s)| (c.clone(), s.chunk_size)).collect(),
            sessions: RefCell::new(Vec::new()),
        });
        for (k, c) in classes.iter().enumerate() {
            c.borrow_mut().driver.mn.set_byte_quota(self.cfg.byte_quota);
            self.book
                .borrow_mut()
                .insert(LoopbackMn::addr(name, incarnation, specs[k].chunk_size), (c.clone(), k, ledger.clone()));
        }
        Ok(LoopbackMn { name: name.clone(), incarnation, specs: specs.to_vec(), classes, vanished: false })
    }

    fn announce(&self, mn: &LoopbackMn) -> Result<Announcer, LoopbackPoolError> {
        let reg: crate::registry::SharedRegistry = Arc::new(self.registry.clone());
        Ok(Announcer::register(
            reg,
            self.pool.clone(),
            mn.name.clone(),
            mn.incarnation,
            mn.entries(),
            AnnounceTimes::for_ttl(self.cfg.ttl),
            self.now,
        )?)
    }

    /// Provision MN `name` with `classes` and register it.
    pub fn add_mn(&mut self, name: &str, classes: &[ClassSpec]) -> Result<(), LoopbackPoolError> {
        let name = Name::new(name).map_err(LoopbackPoolError::Name)?;
        let mn = self.provision(&name, classes)?;
        let a = self.announce(&mn)?;
        self.mns.push((mn, Some(a)));
        Ok(())
    }

    pub fn mns(&self) -> impl Iterator<Item = &LoopbackMn> {
        self.mns.iter().map(|(m, _)| m)
    }

    fn find(&mut self, name: &str) -> Result<usize, LoopbackPoolError> {
        self.mns
            .iter()
            .position(|(m, _)| m.name.as_str() == name)
            .ok_or_else(|| LoopbackPoolError::NoSuchMn(name.into()))
    }

    pub fn mn(&self, name: &str) -> Option<&LoopbackMn> {
        self.mns().find(|m| m.name.as_str() == name)
    }

    /// A connector for one CN of the pool (each CN its own: its connections are its own).
    pub fn connector(&mut self) -> LoopbackConnector {
        self.next_client += 1;
        LoopbackConnector { book: self.book.clone(), owner: self.next_client }
    }

    /// A pool client for a new CN.
    pub fn client(&mut self, seed: u64) -> Result<PoolClient<LoopbackConnector>, LoopbackPoolError> {
        let connector = self.connector();
        PoolClient::new(&self.registry, self.pool.clone(), connector, seed).map_err(|e| match e {
            crate::client::PoolError::Registry(r) => LoopbackPoolError::Registry(r),
            other => LoopbackPoolError::Registry(RegistryError::Failed {
                url: "in-process".into(),
                detail: other.to_string(),
            }),
        })
    }

    /// Let `ns` of pool time pass: every live MN's classes run their timers, the registry's
    /// leases expire where due, and each live MN refreshes its record (keep-alive, counts,
    /// drain requests). Returns what the refreshes did, by MN.
    pub fn advance(&mut self, ns: u64) -> Result<Vec<(String, Refresh)>, LoopbackPoolError> {
        // in steps no longer than 100 ms, so every keep-alive and refresh happens at its own
        // time (one long jump would expire every lease before its MN could renew it)
        let mut out = Vec::new();
        let mut left = ns;
        while left > 0 {
            let step = left.min(100_000_000);
            left -= step;
            self.now += step;
            for (m, _) in self.mns.iter().filter(|(m, _)| !m.vanished) {
                for c in &m.classes {
                    c.borrow_mut().advance(step)?;
                }
            }
            self.registry.set_now(self.now);
            out.extend(self.refresh()?);
        }
        Ok(out)
    }

    /// Each live MN publishes its counts now (at most at its announcer's rate).
    pub fn refresh(&mut self) -> Result<Vec<(String, Refresh)>, LoopbackPoolError> {
        let now = self.now;
        let mut out = Vec::new();
        for (m, a) in self.mns.iter_mut() {
            let Some(a) = a.as_mut() else { continue };
            a.set_counts(&m.free_counts());
            let r = a.refresh(now, m.held())?;
            out.push((m.name.to_string(), r));
        }
        Ok(out)
    }

    /// MN `name`'s hosts crash: no goodbye, no more keep-alives — it leaves the registry when
    /// its lease runs out.
    pub fn vanish(&mut self, name: &str) -> Result<(), LoopbackPoolError> {
        let i = self.find(name)?;
        let (m, a) = &mut self.mns[i];
        m.vanished = true;
        a.take();
        for c in &m.classes {
            let c = c.borrow_mut();
            let h = c.mn_host;
            c.fabric.borrow_mut().crash_host(h).map_err(|e| LoopbackPoolError::Cluster(e.into()))?;
        }
        Ok(())
    }

    /// MN `name` leaves cleanly (its record deleted at once) and stops.
    pub fn stop(&mut self, name: &str) -> Result<(), LoopbackPoolError> {
        let i = self.find(name)?;
        if let Some(a) = self.mns[i].1.take() {
            a.leave()?;
        }
        self.vanish(name)
    }

    /// MN `name` starts again: fresh classes (nothing of its previous run), a new incarnation.
    pub fn restart(&mut self, name: &str) -> Result<(), LoopbackPoolError> {
        let i = self.find(name)?;
        let specs = self.mns[i].0.specs.clone();
        let n = self.mns[i].0.name.clone();
        let mn = self.provision(&n, &specs)?;
        let a = self.announce(&mn)?;
        self.mns[i] = (mn, Some(a));
        Ok(())
    }

    /// The operator asks MN `name` to drain (or to stop draining); the MN follows at its next
    /// keep-alive.
    pub fn drain(&mut self, name: &str, on: bool) -> Result<(), LoopbackPoolError> {
        let n = Name::new(name).map_err(LoopbackPoolError::Name)?;
        self.registry.request_drain(&self.pool, &n, on)?;
        Ok(())
    }
}

/// How a CN of the model reaches MN classes.
#[derive(Clone)]
pub struct LoopbackConnector {
    book: Book,
    /// Which pool client this is (the MNs' ledgers count its holdings across classes).
    owner: u64,
}

impl fmt::Debug for LoopbackConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LoopbackConnector")
    }
}

/// A model CN's failure on one MN class.
#[derive(Debug)]
#[non_exhaustive]
pub enum LoopbackSessionError {
    /// No MN class of the model has this address.
    UnknownAddress(String),
    /// Connecting failed.
    Connect(ClusterError),
    /// An operation failed.
    Op(CnOpError),
}

impl fmt::Display for LoopbackSessionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoopbackSessionError::UnknownAddress(a) => write!(f, "no MN class at {a:?}"),
            LoopbackSessionError::Connect(e) => write!(f, "connect: {e}"),
            LoopbackSessionError::Op(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for LoopbackSessionError {}

impl Connector for LoopbackConnector {
    type Session = LoopbackSession;
    fn connect(
        &mut self,
        _mn: &crate::entry::MnEntry,
        class: &ClassEntry,
    ) -> Result<LoopbackSession, SessionError<LoopbackSessionError>> {
        let (cluster, k, ledger) = self
            .book
            .borrow()
            .get(&class.addr)
            .cloned()
            .ok_or_else(|| SessionError::Failed(LoopbackSessionError::UnknownAddress(class.addr.clone())))?;
        let mut c = cluster.borrow_mut();
        let cn = c.connect_cn().map_err(|e| SessionError::Failed(LoopbackSessionError::Connect(e)))?;
        ledger.sessions.borrow_mut().push((self.owner, k, cn));
        let geometry = c.cns[cn]
            .client()
            .info()
            .map(|i| (i.chunk_size, i.group_size))
            .ok_or(SessionError::Failed(LoopbackSessionError::Op(CnOpError::NoReply)))?;
        drop(c);
        ledger.sync(self.owner);
        Ok(LoopbackSession { cluster, cn, geometry, owner: self.owner, ledger })
    }
}

/// One model CN connected to one MN class: CN `cn` of that class's cluster, its data through
/// access QP 0. Dropping it disconnects the CN (the MN reclaims what it held).
pub struct LoopbackSession {
    cluster: Rc<RefCell<Cluster>>,
    cn: usize,
    geometry: (u64, u8),
    owner: u64,
    ledger: Rc<Ledger>,
}

impl fmt::Debug for LoopbackSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopbackSession").field("cn", &self.cn).field("geometry", &self.geometry).finish()
    }
}

impl LoopbackSession {
    pub fn cluster(&self) -> &Rc<RefCell<Cluster>> {
        &self.cluster
    }
    pub fn cn(&self) -> usize {
        self.cn
    }
}

impl Drop for LoopbackSession {
    fn drop(&mut self) {
        if let Ok(mut c) = self.cluster.try_borrow_mut() {
            let _ = c.crash_cn(self.cn);
        }
    }
}

/// The model's failures sorted for placement: the MN said "empty" (or the CN backs off after
/// it did), the MN refused for quota, the connection is gone (a transport failure, no answer,
/// the model could not run the MN), or something else.
fn classify(e: CnOpError) -> SessionError<LoopbackSessionError> {
    match e {
        CnOpError::Mn(ErrorCode::Empty) | CnOpError::Client(ClientError::Backoff { .. }) => SessionError::Empty,
        CnOpError::Mn(ErrorCode::QuotaExceeded) => SessionError::QuotaExceeded,
        CnOpError::NoReply
        | CnOpError::Crashed
        | CnOpError::Cluster(_)
        | CnOpError::Cn(_)
        | CnOpError::Device(WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr | WcStatus::WrFlushErr) => {
            SessionError::Lost(LoopbackSessionError::Op(e))
        }
        other => SessionError::Failed(LoopbackSessionError::Op(other)),
    }
}

fn status(st: WcStatus) -> Result<(), SessionError<LoopbackSessionError>> {
    if st.is_ok() {
        Ok(())
    } else {
        Err(classify(CnOpError::Device(st)))
    }
}

impl MnSession for LoopbackSession {
    type Error = LoopbackSessionError;
    fn geometry(&self) -> (u64, u8) {
        self.geometry
    }
    fn alloc(&mut self) -> Result<Allocation, SessionError<LoopbackSessionError>> {
        let r = self.cluster.borrow_mut().alloc(self.cn).map_err(classify);
        self.ledger.sync(self.owner);
        r
    }
    /// The model's cluster serves every CN of it whenever it runs (`LoopbackPool::advance`).
    fn service(&mut self) -> Result<(), SessionError<LoopbackSessionError>> {
        Ok(())
    }
    fn free(&mut self, a: &Allocation) -> Result<(), SessionError<LoopbackSessionError>> {
        let r = self.cluster.borrow_mut().free(self.cn, a).map_err(classify);
        self.ledger.sync(self.owner);
        r
    }
    fn write(&mut self, a: &Allocation, offset: u64, data: &[u8]) -> Result<(), SessionError<LoopbackSessionError>> {
        let mut c = self.cluster.borrow_mut();
        let slot = c.cns[self.cn].driver.io_slot_len();
        for (i, piece) in data.chunks(slot.max(1)).enumerate() {
            status(c.write(self.cn, a, 0, offset + (i * slot) as u64, piece))?;
        }
        Ok(())
    }
    fn read(&mut self, a: &Allocation, offset: u64, buf: &mut [u8]) -> Result<(), SessionError<LoopbackSessionError>> {
        let mut c = self.cluster.borrow_mut();
        let slot = c.cns[self.cn].driver.io_slot_len().max(1);
        for (i, piece) in buf.chunks_mut(slot).enumerate() {
            let (st, v) = c.read(self.cn, a, 0, offset + (i * slot) as u64, piece.len());
            status(st)?;
            piece.copy_from_slice(&v[..piece.len()]);
        }
        Ok(())
    }
}
