//! Verbs inside the soft-RoCE VM as a conformance [`Testbed`]: the MN daemon
//! (`MemoryNodeDaemon::start` + its `step` loop) on a thread of this process, CNs through
//! `CnClient` over rdma_cm. The MN's state is read on its own thread (a job sent to its loop),
//! never raced. Real time runs: no time control, no RNIC reset, no faults; the MN is the host
//! engine on rxe's semantics (per-chunk MRs, software ownership check). A refused access leaves
//! an rdma_cm QP dead (no `REVIVE`). Crashing a CN drops its client (the kernel disconnects it,
//! as for a killed process). [`RxeMw`] is the device itself for the memory-window scenarios.

use omw_core::access::AccessFlags;
use omw_core::cn::Allocation;
use omw_core::device::{
    Completion, DataPath, Domain, ExecutionMode, MwBinding, Provision, QpState, WcStatus, WindowState,
};
use omw_core::ids::{CnId, GroupId, Qpn, Rkey};
use omw_core::mn::{Event, MnStats};
use omw_core::wire::memory_map::MnMemoryMap;
use omw_core::wire::message::ErrorCode;
use omw_core::wire::mwtable::MwTableEntry;
use omw_core::wire::wqe::{RecvWqe, Wqe};
use omw_tests::mw::{MwDevice, MwFactory, Side, BUF_LEN, POOL_LEN};
use omw_tests::testbed::{Caps, CnQp, Factory, Heard, MnMr, MnSpec, Refusal, Testbed};
use omw_verbs::cn::{CnClient, CnOptions, Notice};
use omw_verbs::mn::{MemoryNodeDaemon, MnOptions};
use omw_verbs::{VerbsBackend, VerbsError};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce(&mut MemoryNodeDaemon, u64) + Send>;

/// The MN daemon on its own thread.
pub struct MnThread {
    jobs: Sender<Job>,
    stop: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
    pub addr: SocketAddr,
}

static PORT: AtomicU16 = AtomicU16::new(7600);
/// How long any one wait for the MN or a CN may take before the scenario fails (a safety net:
/// every wait ends on an event, not on a time).
const PATIENCE: Duration = Duration::from_secs(20);
/// An address no MWTable entry has (a free naming it is refused as a bad request).
const SYNC_ENTRY: u64 = 0x10;

impl MnThread {
    pub fn start(spec: MnSpec) -> MnThread {
        Self::start_with_chains(spec, 1)
    }

    /// [`MnThread::start`] for an MN whose CNs may open up to `alloc_chains` alloc chains.
    pub fn start_with_chains(spec: MnSpec, alloc_chains: u8) -> MnThread {
        let ip = std::env::var("OMW_SELF_IP").unwrap_or_else(|_| "192.0.2.1".into());
        let addr: SocketAddr = format!("{ip}:{}", PORT.fetch_add(1, Ordering::Relaxed)).parse().unwrap();
        let chunk = spec.chunk_size.unwrap_or(4096);
        let opts = MnOptions {
            device: std::env::var("OMW_RXE_DEVICE").ok(),
            gid_index: None,
            listen: addr,
            pool_size: chunk * spec.chunks as u64,
            chunk_size: chunk,
            group_size: spec.group_size,
            max_cns: spec.cns as u32 + 1,
            alloc_chains,
            quota: spec.quota,
            insecure: false,
            stats_every: Duration::ZERO,
            scrub: spec.scrub,
            metrics: None,
            stats_json: false,
            lease: Duration::from_secs(60),
            serial_engine: false,
            tenants: None,
            offload_profile: None,
            replays: Default::default(),
        };
        let (jobs, rx) = channel::<Job>();
        let (ready, up) = channel::<Result<(), String>>();
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let join = std::thread::spawn(move || {
            // the clock of the jobs' events: started before the daemon's, so never behind it
            let t0 = Instant::now();
            let mut d = match MemoryNodeDaemon::start(opts) {
                Ok(d) => d,
                Err(e) => {
                    let _ = ready.send(Err(e.to_string()));
                    return;
                }
            };
            let _ = ready.send(Ok(()));
            while !halt.load(Ordering::Relaxed) {
                let busy = d.step().unwrap_or(true);
                while let Ok(job) = rx.try_recv() {
                    job(&mut d, t0.elapsed().as_nanos() as u64);
                }
                if !busy {
                    std::thread::yield_now();
                }
            }
        });
        up.recv().expect("MN thread").unwrap_or_else(|e| panic!("MN daemon: {e}"));
        MnThread { jobs, stop, join: Some(join), addr }
    }

    /// Run `f` on the MN's thread between two turns of its loop.
    pub fn with<R: Send + 'static>(&self, f: impl FnOnce(&mut MemoryNodeDaemon, u64) -> R + Send + 'static) -> R {
        let (tx, rx) = channel();
        self.jobs
            .send(Box::new(move |d, now| {
                let _ = tx.send(f(d, now));
            }))
            .expect("MN thread alive");
        rx.recv().expect("MN thread answered")
    }
}

impl Drop for MnThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// Starts an MN daemon thread and its CNs per scenario.
pub struct Rxe;

const CAPS: Caps = Caps::HOST_ENGINE
    .union(Caps::RXE_MW)
    .union(Caps::CRASH)
    .union(Caps::WINDOW_STATE)
    .union(Caps::MN_MEMORY)
    .union(Caps::WINDOW_SPANS)
    .union(Caps::NAMED_QPS)
    .union(Caps::MN_KEYS)
    .union(Caps::CONTENTION)
    .union(Caps::SEND_WITH_INV);

impl Factory for Rxe {
    fn name(&self) -> String {
        "verbs on soft-RoCE (MN daemon thread, CnClient)".into()
    }
    fn caps(&self) -> Caps {
        CAPS
    }
    fn start(&self, spec: MnSpec) -> Box<dyn Testbed> {
        RxeChains(1).start(spec)
    }
}

/// [`Rxe`] with every CN connecting with this many alloc chains (`omw mn --alloc-chains`,
/// `CnOptions::alloc_chains`): every scenario must hold when a CN's allocations may overlap.
pub struct RxeChains(pub u8);

impl Factory for RxeChains {
    fn name(&self) -> String {
        format!("verbs on soft-RoCE (MN daemon thread, CnClient) with {} alloc chains per CN", self.0)
    }
    fn caps(&self) -> Caps {
        CAPS
    }
    fn start(&self, spec: MnSpec) -> Box<dyn Testbed> {
        let chains = self.0;
        let mn = MnThread::start_with_chains(spec, chains);
        let opts = CnOptions {
            device: std::env::var("OMW_RXE_DEVICE").ok(),
            timeout: PATIENCE,
            credential: None,
            source: None,
            alloc_chains: chains,
        };
        let mut cns = Vec::new();
        for _ in 0..spec.cns {
            cns.push(Some(CnClient::connect(mn.addr, &opts).expect("CN connects")));
        }
        let ids = cns.iter().map(|c| c.as_ref().unwrap().cn).collect();
        let mode = mn.with(|d, _| d.mode);
        // CNs drop before the MN (fields drop in order)
        Box::new(RxeBed { heard: vec![Vec::new(); spec.cns], cns, ids, mn, spec, mode, chains })
    }
}

pub struct RxeBed {
    cns: Vec<Option<CnClient>>,
    ids: Vec<CnId>,
    heard: Vec<Vec<Heard>>,
    mn: MnThread,
    spec: MnSpec,
    mode: ExecutionMode,
    chains: u8,
}

fn refusal(e: VerbsError) -> Refusal {
    match e {
        VerbsError::PoolEmpty => Refusal::Mn(ErrorCode::Empty),
        VerbsError::QuotaExceeded => Refusal::Mn(ErrorCode::QuotaExceeded),
        VerbsError::Refused(code) => Refusal::Mn(code),
        VerbsError::Timeout { .. } => Refusal::NoReply,
        VerbsError::Protocol(s) => Refusal::Client(s),
        VerbsError::Client(e) => Refusal::Client(e.to_string()),
        e => Refusal::Transport(e.to_string()),
    }
}

fn status(r: Result<WcStatus, VerbsError>) -> WcStatus {
    match r {
        Ok(s) => s,
        Err(VerbsError::Completion { status, .. }) => status,
        Err(_) => WcStatus::LocQpOpErr,
    }
}

impl RxeBed {
    fn cn(&mut self, i: usize) -> &mut CnClient {
        self.cns[i].as_mut().unwrap_or_else(|| panic!("cn{i} has crashed"))
    }

    /// Move what CN `i` was told into `heard`. With `sync`, after a round trip on the queue the
    /// MN sends messages on (host engine: the Alloc QP), so everything the MN sent before has
    /// arrived: a free naming no entry, which the MN refuses without touching anything. (A bad
    /// alloc request would run a lap: the group it pops is repaired with advanced keys.)
    fn collect(&mut self, i: usize, sync: bool) {
        let Some(c) = self.cns[i].as_mut() else { return };
        if sync {
            let r = c.free_entry(SYNC_ENTRY, PATIENCE);
            assert!(matches!(r, Ok(Some(_))), "cn{i}: the sync round trip was not answered: {r:?}");
        }
        let _ = c.pump();
        for n in c.take_notices() {
            self.heard[i].push(match n {
                Notice::Empty => Heard::Empty,
                Notice::Available => Heard::Available,
                Notice::Failed { code, .. } => Heard::Failed(code),
                Notice::Revoked => Heard::Revoked,
                Notice::Rekeyed { entry_addr, mw, rkey } => Heard::Rekeyed { entry_addr, mw, rkey },
            });
        }
    }

    fn frees_of(&self, id: CnId) -> Option<u64> {
        self.mn.with(move |d, _| d.driver.mn.cn(id).map(|r| r.frees))
    }
}

impl Testbed for RxeBed {
    fn caps(&self) -> Caps {
        CAPS
    }
    fn alloc_chains(&self) -> u8 {
        self.chains
    }
    fn mode(&self) -> ExecutionMode {
        self.mode
    }
    fn spec(&self) -> MnSpec {
        self.spec
    }
    fn chunk_size(&self) -> u64 {
        self.spec.chunk_size.unwrap_or(4096)
    }
    fn alloc(&mut self, cn: usize) -> Result<Allocation, Refusal> {
        let r = self.cn(cn).try_alloc().map_err(refusal);
        self.collect(cn, false);
        r
    }
    /// Returns once the MN committed the free (its count of the CN's frees moved) or refused it.
    fn free(&mut self, cn: usize, a: &Allocation) -> Result<(), Refusal> {
        let id = self.ids[cn];
        let before = self.frees_of(id);
        let token = self.cn(cn).free(a).map_err(refusal)?;
        let t = Instant::now();
        loop {
            let c = self.cn(cn);
            let _ = c.pump();
            let refused = c.notices.iter().find_map(|n| match n {
                Notice::Failed { token: t, code } if *t == token => Some(*code),
                _ => None,
            });
            if let Some(code) = refused {
                c.notices.retain(|n| !matches!(n, Notice::Failed { token: t, .. } if *t == token));
                return Err(Refusal::Mn(code));
            }
            if self.frees_of(id) != before {
                self.collect(cn, false);
                return Ok(());
            }
            assert!(t.elapsed() < PATIENCE, "cn{cn}'s free was neither committed nor refused");
        }
    }
    fn free_entry(&mut self, cn: usize, entry_addr: u64) -> Result<(), Refusal> {
        let r = self.cn(cn).free_entry(entry_addr, PATIENCE).map_err(refusal)?;
        self.collect(cn, false);
        match r {
            Some(code) => Err(Refusal::Mn(code)),
            None => Ok(()),
        }
    }
    fn write_raw(&mut self, cn: usize, window: usize, addr: u64, rkey: Rkey, data: &[u8]) -> WcStatus {
        status(self.cn(cn).write_raw(window, addr, rkey, data))
    }
    fn read_raw(&mut self, cn: usize, window: usize, addr: u64, rkey: Rkey, len: usize) -> (WcStatus, Vec<u8>) {
        match self.cn(cn).read_raw(window, addr, rkey, len) {
            Ok(r) => r,
            Err(e) => (status(Err(e)), Vec::new()),
        }
    }
    /// The SEND's status, returned once the MN handled the invalidation its receive reported.
    fn send_with_inv(&mut self, cn: usize, qp: CnQp, rkey: Rkey) -> WcStatus {
        let qp = match qp {
            CnQp::Alloc => omw_core::cn::driver::CnQp::Alloc,
            CnQp::Free => omw_core::cn::driver::CnQp::Free,
            CnQp::Access(k) => omw_core::cn::driver::CnQp::Access(k),
        };
        let seen = |bed: &Self| bed.mn.with(|d, _| d.driver.mn.stats().remote_invalidations);
        let before = seen(self);
        let st = status(self.cn(cn).send_with_inv(qp, rkey));
        // the MN reacts once it polled the receive (rxe reports the invalidation there): wait
        // for that, bounded (a device that refused the invalidation reports nothing)
        let t = Instant::now();
        while seen(self) == before && t.elapsed() < Duration::from_secs(2) {
            std::thread::yield_now();
        }
        st
    }
    fn live(&mut self, cn: usize) -> Vec<Allocation> {
        let c = self.cn(cn);
        let _ = c.pump();
        c.live().to_vec()
    }
    fn alloc_naming(&mut self, cn: usize, qpns: &[Qpn]) -> Result<Allocation, Refusal> {
        let r = self.cn(cn).alloc_naming(qpns).map_err(refusal);
        self.collect(cn, false);
        r
    }
    fn alloc_begin(&mut self, cn: usize) -> Result<u32, Refusal> {
        self.cn(cn).alloc_begin().map_err(refusal)
    }
    fn alloc_finish(&mut self, cn: usize, token: u32) -> Result<Allocation, Refusal> {
        let r = self.cn(cn).alloc_finish(token).map_err(refusal);
        self.collect(cn, false);
        r
    }
    fn access_qpns(&self, cn: usize) -> Vec<Qpn> {
        let c = self.cns[cn].as_ref().unwrap();
        c.mn_qpns()[2..].iter().map(|q| q.expect("negotiated")).collect()
    }
    fn mgmt_qpns(&self, cn: usize) -> [Qpn; 2] {
        let c = self.cns[cn].as_ref().unwrap();
        [c.mn_qpns()[0].expect("alloc"), c.mn_qpns()[1].expect("free")]
    }
    fn crash(&mut self, cn: usize) {
        drop(self.cns[cn].take());
        let id = self.ids[cn];
        let t = Instant::now();
        while self.is_served(cn) {
            assert!(t.elapsed() < PATIENCE, "the MN never noticed cn{cn} was gone");
            std::thread::yield_now();
        }
        let _ = id;
    }
    fn is_served(&mut self, cn: usize) -> bool {
        let id = self.ids[cn];
        self.mn.with(move |d, _| d.driver.mn.cn(id).is_some())
    }
    fn tick(&mut self) {
        self.mn.with(|d, now| d.driver.handle(now, Event::Tick).map_err(|e| e.to_string())).expect("tick");
        for i in 0..self.cns.len() {
            self.collect(i, true);
        }
    }
    fn check_invariants(&mut self) -> Result<(), String> {
        self.mn.with(|d, _| d.driver.check_invariants().map_err(|e| e.to_string()))
    }
    fn ahead(&mut self) -> u32 {
        self.mn.with(|d, _| d.driver.groups_ahead())
    }
    fn ahead_of(&mut self, cn: usize) -> bool {
        let id = self.cn_id(cn);
        self.mn.with(move |d, _| d.driver.group_ahead_of(id).is_some())
    }
    fn free_groups(&mut self) -> u32 {
        self.mn.with(|d, _| {
            let map = *d.driver.mn.map();
            let q = map.queue;
            let word = |a: u64| {
                let mut b = [0u8; 8];
                d.driver.backend.read_local(a, &mut b).expect("MN memory");
                u64::from_le_bytes(b)
            };
            q.live_len(word(q.head), word(q.tail), map.max_cns)
        })
    }
    fn stats(&mut self) -> MnStats {
        self.mn.with(|d, _| d.driver.mn.stats())
    }
    fn lease_ns(&mut self) -> u64 {
        self.mn.with(|d, _| d.driver.mn.config().lease_ns)
    }
    fn entry(&mut self, g: GroupId) -> Option<MwTableEntry> {
        self.mn.with(move |d, _| d.driver.entry(g))
    }
    fn group_of(&mut self, a: &Allocation) -> Option<GroupId> {
        let e = a.entry_addr;
        self.mn.with(move |d, _| d.driver.mn.map().group_of_entry(e))
    }
    fn forged_frees_of(&mut self, cn: usize) -> u64 {
        let id = self.ids[cn];
        self.mn.with(move |d, _| d.driver.mn.cn(id).map_or(0, |r| r.forged_frees as u64))
    }
    fn cn_id(&self, cn: usize) -> CnId {
        self.ids[cn]
    }
    fn is_empty_state(&mut self) -> bool {
        self.mn.with(|d, _| d.driver.mn.is_empty_state())
    }
    fn heard(&mut self, cn: usize) -> Vec<Heard> {
        self.collect(cn, true);
        self.heard[cn].clone()
    }
    fn mw_binding(&mut self, rkey: Rkey) -> Option<MwBinding> {
        self.mn.with(move |d, _| d.driver.backend.mw_binding(rkey))
    }
    fn mn_read(&mut self, addr: u64, len: usize) -> Vec<u8> {
        self.mn.with(move |d, _| {
            let mut b = vec![0u8; len];
            d.driver.backend.read_local(addr, &mut b).expect("MN memory");
            b
        })
    }
    fn mn_write(&mut self, addr: u64, data: &[u8]) {
        let data = data.to_vec();
        self.mn.with(move |d, _| d.driver.backend.write_local(addr, &data).expect("MN memory"))
    }
    /// The daemon's registrations as libibverbs made them (one PD: nothing is MN-private).
    fn mn_mrs(&mut self) -> Vec<MnMr> {
        self.mn.with(move |d, _| {
            d.driver.backend.mrs().into_iter().map(|m| MnMr::new(m.addr, m.len, m.keys.lkey, m.access, false)).collect()
        })
    }
    fn mn_map(&mut self) -> MnMemoryMap {
        self.mn.with(|d, _| *d.driver.mn.map())
    }
}

/// The device itself as a memory-window device for the suite's MW scenarios
/// (`omw_tests::mw`): one `VerbsBackend`, its pool and buffer, a fresh loopback pair per
/// `pair()` (both sides are this device).
pub struct RxeMw;

impl MwFactory for RxeMw {
    fn name(&self) -> String {
        format!("verbs device {}", super::device())
    }
    fn caps(&self) -> Caps {
        Caps::RXE_MW
    }
    fn start(&self) -> Box<dyn MwDevice> {
        let mut b = VerbsBackend::open(Some(&super::device())).expect("open the RDMA device");
        let pool = b.alloc_region(POOL_LEN, 4096).expect("pool region");
        let buf = b.alloc_region(BUF_LEN, 4096).expect("buffer region");
        let pk = b.reg_mr(Domain::CnFacing, pool, POOL_LEN, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap();
        let bk = b.reg_mr(Domain::CnFacing, buf, BUF_LEN, AccessFlags::LOCAL_WRITE).unwrap();
        b.write_local(pool, &vec![b'o'; POOL_LEN as usize]).unwrap();
        Box::new(VerbsMw { b, pool: (pool, pk.lkey, pk.rkey), buf: (buf, bk.lkey) })
    }
}

struct VerbsMw {
    b: VerbsBackend,
    pool: (u64, u32, u32),
    buf: (u64, u32),
}

/// How long a completion may take before the scenario records "none".
const MW_PATIENCE: Duration = Duration::from_secs(5);

impl MwDevice for VerbsMw {
    fn caps(&self) -> Caps {
        Caps::RXE_MW
    }
    fn pair(&mut self) -> (Qpn, Qpn) {
        self.b.create_loopback_pair().expect("loopback pair")
    }
    fn alloc_mw(&mut self) -> Rkey {
        self.b.alloc_mw().expect("alloc_mw")
    }
    fn pool(&self) -> (u64, u32, u32) {
        self.pool
    }
    fn buf(&self) -> (u64, u32) {
        self.buf
    }
    fn post(&mut self, _side: Side, qp: Qpn, w: &Wqe) -> Option<Completion> {
        self.b.post_wait(qp, w, MW_PATIENCE).ok()
    }
    fn post_recv(&mut self, _side: Side, qp: Qpn, r: &RecvWqe) {
        self.b.post_recv(qp, r).expect("post_recv");
    }
    fn wait_recv(&mut self, _side: Side, qp: Qpn) -> Option<Completion> {
        self.b.wait_recv(qp, MW_PATIENCE).ok()
    }
    fn state(&mut self, _side: Side, qp: Qpn) -> QpState {
        self.b.qp_state(qp).expect("qp_state")
    }
    fn read_local(&mut self, _side: Side, addr: u64, len: usize) -> Vec<u8> {
        self.b.slice(addr, len).expect("local bytes").to_vec()
    }
    fn write_local(&mut self, _side: Side, addr: u64, data: &[u8]) {
        self.b.write_local(addr, data).expect("write_local");
    }
    fn binding(&mut self, rkey: Rkey) -> Option<MwBinding> {
        self.b.mw_binding(rkey)
    }
}
