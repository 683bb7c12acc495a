//! OneSidedMW on the model: one MN and N CNs on a [`Fabric`], the MN driven by the core's
//! [`MnDriver`] and each CN by the core's [`Client`]. Nothing protocol-specific lives here:
//! this file creates hosts, memory, MRs, windows and QPs, moves bytes between the core's
//! state machines and the model, and pumps the fabric.
//!
//! In **offloaded** mode the MN arms each CN's alloc and free chains once; afterwards an
//! allocation is a SEND from the CN, the chain running inside the modelled NIC, and a
//! WRITE_WITH_IMM back — the MN CPU handles no event. In **host-engine** mode (the model with
//! its offload capabilities off) the MN CPU receives each request and runs the same chain
//! layout with the core's host engine; every request is an MN CPU event, and its modelled CPU
//! time is charged to the MN host.

use crate::config::NicConfig;
use crate::error::LoopbackError;
use crate::fabric::{Fabric, HostId, QpAddr};
use crate::protection::PdId;
use crate::qp::QpConfig;
use omw_core::access::AccessFlags;
use omw_core::backend::{
    Capabilities, Completion, Domain, ExecutionMode, MrKeys, MwBinding, QpState, RdmaBackend, WcOpcode, WcStatus,
};
use omw_core::chain::ChainKind;
use omw_core::cn::{Allocation, Client, ClientError, ClientEvent};
use omw_core::geometry::PoolGeometry;
use omw_core::host_engine::HostRegions;
use omw_core::ids::{CnId, GroupId, Qpn, Rkey};
use omw_core::mn::{CnQps, Event, MemoryNode, MnConfig};
use omw_core::mn_driver::{DriverError, MnDriver};
use omw_core::mn_memory::MnMemoryMap;
use omw_core::mn_plan::{MnOptions, MnPlan, MnRegions, Region};
use omw_core::wire::{ErrorCode, FreeRequest};
use omw_core::wqe::{QueueSel, RecvWqe, Sge, Wqe};
use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;

/// Most live allocations one modelled CN tracks.
pub const CN_MAX_LIVE: usize = 4096;
/// Receive WQEs each CN keeps posted on its Alloc QP (replies) and first access QP (messages).
const CN_RECVS: u64 = 8;
const MSG_BUF: u64 = 64;
/// Send buffers each CN rotates through (requests outstanding at once).
const CN_SEND_SLOTS: u64 = 16;

#[derive(Clone, Copy, Debug)]
pub struct ClusterConfig {
    pub cns: usize,
    pub chunk_size: u64,
    pub chunks: u32,
    pub group_size: u8,
    pub quota: u32,
    /// None: offload if the NIC can, host engine otherwise.
    pub mode: Option<ExecutionMode>,
    pub nic: NicConfig,
    /// Zero every chunk between two owners (`MnOptions::scrub`; on by default).
    pub scrub: bool,
}

impl ClusterConfig {
    /// The chains' rings in `f` (the NIC's [`NicConfig::wqe_format`]; their depths follow).
    pub fn with_wqe_format(mut self, f: omw_core::wqe_format::WqeFormat) -> Self {
        self.nic.wqe_format = f;
        self
    }
    /// 1 MN + 6 CNs, 64 chunks of 4 KiB, G = 3, strict NIC with prefetching.
    pub fn paper_like() -> Self {
        ClusterConfig {
            cns: 6,
            chunk_size: 4096,
            chunks: 64,
            group_size: 3,
            quota: 64,
            mode: None,
            nic: NicConfig::strict().with_prefetch(8),
            scrub: true,
        }
    }
}

#[derive(Debug)]
#[non_exhaustive]
pub enum ClusterError {
    Model(LoopbackError),
    Driver(String),
    Config(String),
}

impl fmt::Display for ClusterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterError::Model(e) => write!(f, "model: {e}"),
            ClusterError::Driver(e) => write!(f, "MN driver: {e}"),
            ClusterError::Config(e) => write!(f, "configuration: {e}"),
        }
    }
}
impl std::error::Error for ClusterError {}
impl From<LoopbackError> for ClusterError {
    fn from(e: LoopbackError) -> Self {
        ClusterError::Model(e)
    }
}
impl<E: fmt::Display> From<DriverError<E>> for ClusterError {
    fn from(e: DriverError<E>) -> Self {
        ClusterError::Driver(e.to_string())
    }
}

/// One of a CN's own QPs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CnQp {
    Alloc,
    Free,
    Access(usize),
}

/// Why a CN operation did not succeed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CnOpError {
    /// The MN refused (empty queue, not the owner, bad request, …).
    Mn(ErrorCode),
    Client(ClientError),
    /// The CN's own work request failed.
    Device(WcStatus),
    /// Nothing came back (the CN's management QP is gone, e.g. after a quota disconnect).
    NoReply,
    Crashed,
}

impl fmt::Display for CnOpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CnOpError::Mn(c) => write!(f, "MN refused: {c:?}"),
            CnOpError::Client(e) => write!(f, "{e}"),
            CnOpError::Device(s) => write!(f, "work request failed: {s}"),
            CnOpError::NoReply => f.write_str("no reply from the MN"),
            CnOpError::Crashed => f.write_str("this CN has crashed"),
        }
    }
}

/// A seeded schedule of who runs next (see [`Cluster::set_interleaving`]).
#[derive(Debug)]
pub struct Interleave {
    state: u64,
    per_mille: u16,
}

impl Interleave {
    fn next(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.state = x;
        x
    }
    fn mn_acts_now(&mut self) -> bool {
        self.next() % 1000 < self.per_mille as u64
    }
    /// How many NIC steps pre-empt the MN's next access (0 most of the time).
    fn nic_steps(&mut self) -> u32 {
        let r = self.next();
        if r % 1000 < self.per_mille as u64 {
            1 + ((r >> 20) % 4) as u32
        } else {
            0
        }
    }
}

/// The MN's [`RdmaBackend`]: its host on the shared fabric. [`Domain::CnFacing`] is the
/// host's PD 0, [`Domain::MnPrivate`] a PD of its own that only the MN's loopback QPs are in.
#[derive(Clone, Debug)]
pub struct MnBackend {
    pub fabric: Rc<RefCell<Fabric>>,
    pub host: HostId,
    pub private_pd: PdId,
    /// When set, NIC steps may run between the MN's own accesses.
    pub interleave: Option<Rc<RefCell<Interleave>>>,
}

impl MnBackend {
    fn qa(&self, q: Qpn) -> QpAddr {
        QpAddr::new(self.host, q)
    }
    /// Let the NIC run a few steps before the MN CPU's next access, if the schedule says so.
    fn preempt(&self) {
        if let Some(il) = &self.interleave {
            let n = il.borrow_mut().nic_steps();
            if n > 0 {
                if let Ok(mut f) = self.fabric.try_borrow_mut() {
                    f.run_until_idle(u64::from(n));
                }
            }
        }
    }
    pub fn pd(&self, d: Domain) -> PdId {
        match d {
            Domain::CnFacing => PdId(0),
            Domain::MnPrivate => self.private_pd,
        }
    }
}

impl RdmaBackend for MnBackend {
    type Error = LoopbackError;
    fn capabilities(&self) -> Capabilities {
        self.fabric.borrow().capabilities()
    }
    fn post_send(&mut self, qp: Qpn, wqe: &Wqe) -> Result<(), LoopbackError> {
        self.preempt();
        self.fabric.borrow_mut().post_send(self.qa(qp), wqe)
    }
    fn post_recv(&mut self, qp: Qpn, wqe: &RecvWqe) -> Result<(), LoopbackError> {
        self.fabric.borrow_mut().post_recv(self.qa(qp), wqe)
    }
    fn poll_cq(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize, LoopbackError> {
        self.fabric.borrow_mut().poll_cq(self.qa(qp), queue, out)
    }
    fn enable(&mut self, qp: Qpn, queue: QueueSel, count: u64) -> Result<(), LoopbackError> {
        self.fabric.borrow_mut().enable(self.qa(qp), queue, count)
    }
    fn reset_qp(&mut self, qp: Qpn) -> Result<(), LoopbackError> {
        self.fabric.borrow_mut().reset_qp(self.qa(qp))
    }
    fn destroy_qp(&mut self, qp: Qpn) -> Result<(), LoopbackError> {
        self.fabric.borrow_mut().destroy_qp(self.qa(qp))
    }
    fn qp_state(&self, qp: Qpn) -> Result<QpState, LoopbackError> {
        self.fabric.borrow().qp_state(self.qa(qp))
    }
    fn reg_mr(&mut self, d: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys, LoopbackError> {
        let pd = self.pd(d);
        self.fabric.borrow_mut().reg_mr(self.host, pd, addr, len, access)
    }
    fn alloc_mw(&mut self) -> Result<Rkey, LoopbackError> {
        self.fabric.borrow_mut().alloc_mw(self.host, PdId(0))
    }
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> Result<(), LoopbackError> {
        self.preempt();
        self.fabric.borrow().read(self.host, addr, buf)
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<(), LoopbackError> {
        self.preempt();
        self.fabric.borrow_mut().write(self.host, addr, data)
    }
    fn ring_base(&self, qp: Qpn, queue: QueueSel) -> Result<u64, LoopbackError> {
        self.fabric.borrow().ring_base(self.qa(qp), queue)
    }
    fn ring_keys(&self, d: Domain) -> Result<MrKeys, LoopbackError> {
        self.fabric.borrow().ring_keys_in(self.host, self.pd(d))
    }
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        RdmaBackend::mw_binding(&self.fabric.borrow_mut().view(self.host), rkey)
    }
    fn mw_span(&self, rkey: Rkey) -> Option<(u64, u64)> {
        RdmaBackend::mw_span(&self.fabric.borrow_mut().view(self.host), rkey)
    }
    // ---- the mlx5 form (issue 13): forwarded to the MN host's view
    fn wqe_format(&self) -> omw_core::wqe_format::WqeFormat {
        self.fabric.borrow().config().wqe_format
    }
    fn cq_numbers(&self, loop_qp: Qpn, mgmt_qp: Qpn) -> Option<[u32; 3]> {
        RdmaBackend::cq_numbers(&self.fabric.borrow_mut().view(self.host), loop_qp, mgmt_qp)
    }
    fn arm_mlx5(
        &mut self,
        chain: &omw_core::mlx5::chain::Mlx5Chain,
        recv_copies: u32,
    ) -> Option<Result<(), LoopbackError>> {
        self.preempt();
        RdmaBackend::arm_mlx5(&mut self.fabric.borrow_mut().view(self.host), chain, recv_copies)
    }
}

/// One modelled compute node.
#[derive(Debug)]
pub struct CnNode {
    pub host: HostId,
    pub id: CnId,
    pub client: Client<CN_MAX_LIVE>,
    /// CN ends of the Alloc, Free and access QPs.
    pub alloc_qp: QpAddr,
    pub free_qp: QpAddr,
    pub access_qps: Vec<QpAddr>,
    /// MN ends (what the MN knows).
    pub mn_qps: CnQps,
    reply_buf: u64,
    reply_keys: MrKeys,
    io_buf: u64,
    io_keys: MrKeys,
    msg_bufs: u64,
    msg_lkey: u32,
    msg_seq: u64,
    send_bufs: u64,
    send_lkey: u32,
    send_seq: u64,
    pub crashed: bool,
    /// The CN stopped posting receives (and polling): it still sends what the test makes it
    /// send, but nothing the MN sends it can land once its posted receives are used up.
    pub stalled: bool,
    /// The host vanished without a disconnect: no connection manager tells the MN.
    pub silent: bool,
    /// Every notice/error the MN sent, in order.
    pub events: Vec<ClientEvent>,
    /// Every byte string the MN delivered to this CN (alloc replies, messages), for tests that
    /// check what a CN learns.
    pub received: Vec<Vec<u8>>,
    /// Modelled time (ns) the most recent alloc reply landed in this CN's reply buffer (the
    /// completion timestamp of its WRITE_WITH_IMM), for latency measurements.
    pub last_reply_at: u64,
    replies: Vec<(u32, Result<Allocation, CnOpError>)>,
    /// Tokens of free requests in flight (an error may come back for them).
    free_tokens: Vec<u32>,
}

/// What a pump round saw on the MN side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MnActivity {
    /// Events the MN CPU handled (the figure OneSidedMW drives to zero).
    pub cpu_events: u64,
}

pub struct Cluster {
    pub fabric: Rc<RefCell<Fabric>>,
    pub mn_host: HostId,
    pub driver: MnDriver<MnBackend>,
    pub cns: Vec<CnNode>,
    pub mode: ExecutionMode,
    pub cfg: ClusterConfig,
    /// MR per chunk instead of one pool MR (devices that do not enforce window bounds).
    pub per_chunk_mrs: bool,
    /// Send-queue depths [alloc, free] × [Loop, Mgmt]: each chain's QPs have exactly its
    /// rings' depths, so a lap wraps onto the same bytes.
    ring_depths: [[u32; 2]; 2],
    pub mn_cpu_events: u64,
    /// Management-QP counters at the last RNIC reset (the MN's counts restart there).
    counter_base: Vec<(u64, u64)>,
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster").field("mode", &self.mode).field("cns", &self.cns.len()).finish()
    }
}

impl Cluster {
    pub fn new(cfg: ClusterConfig) -> Result<Cluster, ClusterError> {
        let plan = MnPlan::decide(
            cfg.nic.capabilities(),
            MnOptions { mode: cfg.mode, allow_insecure: false, scrub: cfg.scrub },
        )
        .map_err(|e| ClusterError::Config(e.to_string()))?;
        let mode = plan.mode;
        let geo = PoolGeometry::new(1 << 30, cfg.chunk_size, cfg.chunks, cfg.group_size)
            .map_err(|e| ClusterError::Config(e.to_string()))?;
        let max_cns = cfg.cns.clamp(1, omw_core::mn::MAX_CNS) as u32;
        let mut f = Fabric::new(cfg.nic);
        let mn = f.add_host("mn")?;
        let private_pd = f.alloc_pd(mn)?;
        // the rings are the model's own memory: grant them what the plan says, where it says
        for r in plan.registrations().iter().filter(|r| r.region == Region::Rings && r.domain == Domain::MnPrivate) {
            f.register_ring_arena(mn, private_pd, r.access)?;
        }
        let pool = f.alloc(mn, geo.pool_len(), geo.chunk_size())?;
        let geo = PoolGeometry::new(pool, cfg.chunk_size, cfg.chunks, cfg.group_size)
            .map_err(|e| ClusterError::Config(e.to_string()))?;
        // metadata: queue, MWTable, scratch
        let align = MnMemoryMap::required_alignment(&geo, max_cns);
        let len = MnMemoryMap::len_for(&geo, max_cns);
        let meta = f.alloc(mn, len, align.max(64))?;
        let map = MnMemoryMap::new(geo, max_cns, meta).ok_or(ClusterError::Config("metadata map".into()))?;
        let zero_source = if plan.needs_zero_source() { Some(f.alloc(mn, geo.chunk_size(), 64)?) } else { None };
        let fabric = Rc::new(RefCell::new(f));
        let mut backend = MnBackend { fabric: fabric.clone(), host: mn, private_pd, interleave: None };
        let keys = plan.register_metadata(&mut backend, &MnRegions { map, zero_source }).map_err(plan_err)?;
        let mut lkeys = Vec::new();
        plan.register_pool(&mut backend, &geo, |_, k| lkeys.push(k)).map_err(plan_err)?;
        let per_chunk_mrs = plan.per_chunk_mrs;
        let mut rkeys = Vec::new();
        for _ in 0..(geo.chunk_count() as usize * geo.group_size()) {
            rkeys.push(backend.alloc_mw()?);
        }
        let mut f = fabric.borrow_mut();
        let (admin, _) = f.create_connected_pair(mn, QpConfig::default(), mn, QpConfig::default())?;
        // the MN CPU's queue atomics go through the NIC, on a pair of the private domain
        let atomic = match plan.loop_domain() {
            Some(_) => {
                let c = QpConfig::default().with_pd(private_pd);
                Some(f.create_connected_pair(mn, c, mn, c)?.0.qpn)
            }
            None => None,
        };
        drop(f);
        let mcfg = MnConfig::from_plan(&plan, geo, max_cns, cfg.quota);
        let node = MemoryNode::new(mcfg, map, keys).map_err(|e| ClusterError::Config(format!("{e:?}")))?;
        let d = node.chain_ring_depths().map_err(|e| ClusterError::Config(e.to_string()))?;
        // the mlx5 form's rings are its laps in WQEBBs
        let d = if cfg.nic.wqe_format == omw_core::wqe_format::WqeFormat::Mlx5 {
            let [a, f] = node.chain_sizing_layouts().map_err(|e| ClusterError::Config(e.to_string()))?;
            let w = |l| omw_core::mlx5::chain::ring_wqebbs(l).map_err(|e| ClusterError::Config(e.to_string()));
            [w(&a)?, w(&f)?]
        } else {
            d
        };
        let ring_depths = [[d[0][0] as u32, d[0][1] as u32], [d[1][0] as u32, d[1][1] as u32]];
        let regions = HostRegions::new(&map, &keys);
        let mut driver = MnDriver::new(backend, node, regions, admin.qpn);
        if let Some(q) = atomic {
            driver = driver.with_atomic_qp(q);
        }
        let g = geo.group_size();
        let per_chunk = per_chunk_mrs;
        driver.format(
            |gid, i| rkeys[gid.0 as usize * g + i],
            |gid| if per_chunk { lkeys[gid.0 as usize] } else { lkeys[0] },
        )?;
        let mut c = Cluster {
            fabric,
            mn_host: mn,
            driver,
            cns: Vec::new(),
            mode,
            cfg,
            per_chunk_mrs,
            ring_depths,
            mn_cpu_events: 0,
            counter_base: Vec::new(),
        };
        for _ in 0..cfg.cns {
            c.connect_cn()?;
        }
        Ok(c)
    }

    /// Bring up a new CN: its host, buffers and QPs, then the MN's connect.
    pub fn connect_cn(&mut self) -> Result<usize, ClusterError> {
        let idx = self.cns.len();
        let g = self.cfg.group_size as usize;
        let offload = self.mode == ExecutionMode::Offloaded;
        let d = self.ring_depths;
        let chain_cfg = |kind: usize, ring: usize| {
            if offload {
                QpConfig::managed(d[kind][ring], 1)
            } else {
                QpConfig::default()
            }
        };
        let mut f = self.fabric.borrow_mut();
        let host = f.add_host(&format!("cn{idx}"))?;
        let mn = self.mn_host;
        let cn_cfg = QpConfig::default().with_depths(64, CN_RECVS as u32 * 2);
        let (alloc_qp, mn_alloc) = f.create_connected_pair(host, cn_cfg, mn, chain_cfg(0, 1))?;
        let (free_qp, mn_free) = f.create_connected_pair(host, cn_cfg, mn, chain_cfg(1, 1))?;
        let mut access_qps = Vec::new();
        let mut mn_access = heapless::Vec::new();
        for _ in 1..g {
            let (c, m) = f.create_connected_pair(host, cn_cfg, mn, QpConfig::default())?;
            access_qps.push(c);
            let _ = mn_access.push(m.qpn);
        }
        let (alloc_loop, free_loop) = if offload {
            // both ends in the MN's private PD: the only QPs through which MN memory is
            // remotely reachable, and no CN has one
            let pd = self.driver.backend.private_pd;
            let resp = QpConfig::default().with_pd(pd);
            let (a, _) = f.create_connected_pair(mn, chain_cfg(0, 0).with_pd(pd), mn, resp)?;
            let (b, _) = f.create_connected_pair(mn, chain_cfg(1, 0).with_pd(pd), mn, resp)?;
            (Some(a.qpn), Some(b.qpn))
        } else {
            (None, None)
        };
        let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let (reply_buf, reply_keys) = f.alloc_mr(host, PdId(0), 64, 64, rw)?;
        let io_len = self.cfg.chunk_size.max(4096);
        let (io_buf, io_keys) = f.alloc_mr(host, PdId(0), io_len, 64, AccessFlags::LOCAL_WRITE)?;
        let (msg_bufs, msg_keys) = f.alloc_mr(host, PdId(0), MSG_BUF * CN_RECVS * 4, 64, AccessFlags::LOCAL_WRITE)?;
        let (send_bufs, send_keys) =
            f.alloc_mr(host, PdId(0), MSG_BUF * CN_SEND_SLOTS, 64, AccessFlags::LOCAL_WRITE)?;
        drop(f);
        let mn_qps = CnQps { alloc: mn_alloc.qpn, free: mn_free.qpn, access: mn_access, alloc_loop, free_loop };
        let mut node = CnNode {
            host,
            id: CnId::new(u32::MAX).map_err(|e| ClusterError::Config(e.to_string()))?,
            client: Client::new(),
            alloc_qp,
            free_qp,
            access_qps,
            mn_qps: mn_qps.clone(),
            reply_buf,
            reply_keys,
            io_buf,
            io_keys,
            msg_bufs,
            msg_lkey: msg_keys.lkey,
            msg_seq: 0,
            send_bufs,
            send_lkey: send_keys.lkey,
            send_seq: 0,
            crashed: false,
            stalled: false,
            silent: false,
            events: Vec::new(),
            received: Vec::new(),
            last_reply_at: 0,
            replies: Vec::new(),
            free_tokens: Vec::new(),
        };
        Self::top_up(&mut self.fabric.borrow_mut(), &mut node)?;
        self.cns.push(node);
        self.counter_base.push((0, 0));
        let id = self.driver.connect(mn_qps)?;
        self.cns[idx].id = id;
        self.pump()?;
        if self.cns[idx].client.id() != Some(id) {
            return Err(ClusterError::Driver(format!("cn{idx} never received its connect info")));
        }
        Ok(idx)
    }

    pub fn now(&self) -> u64 {
        self.fabric.borrow().now()
    }

    /// Keep receives posted on the CN's Alloc QP (reply immediates) and first access QP
    /// (MN messages), e.g. after the MN reset the pair.
    fn top_up(f: &mut Fabric, n: &mut CnNode) -> Result<(), ClusterError> {
        if n.crashed || n.stalled {
            return Ok(());
        }
        // both carry buffers: MN messages arrive on the Alloc QP (host engine) or on the first
        // access QP (offloaded); replies (WRITE_WITH_IMM) need no buffer
        for (qp, with_buf) in [(n.alloc_qp, true), (n.access_qps[0], true)] {
            if f.qp_state(qp)? != QpState::Rts {
                continue;
            }
            let st = f.qp_stats(qp)?;
            let mut outstanding = st.recv_producer.saturating_sub(st.recv_consumer);
            while outstanding < CN_RECVS {
                let mut w = RecvWqe { wr_id: n.msg_seq, sges: heapless::Vec::new() };
                if with_buf {
                    let slot = n.msg_seq % (CN_RECVS * 4);
                    let _ = w.sges.push(Sge {
                        addr: n.msg_bufs + slot * MSG_BUF,
                        length: MSG_BUF as u32,
                        lkey: n.msg_lkey,
                    });
                }
                n.msg_seq += 1;
                f.post_recv(qp, &w)?;
                outstanding += 1;
            }
        }
        Ok(())
    }

    /// Run the model, the MN and the CNs until nothing moves.
    pub fn pump(&mut self) -> Result<MnActivity, ClusterError> {
        let mut act = MnActivity::default();
        // (host-engine laps advance one device step per round)
        for _round in 0..1024 {
            let steps = match self.driver.backend.interleave.clone() {
                None => self.fabric.borrow_mut().run_until_idle(10_000_000),
                Some(il) => {
                    // The MN CPU runs *while* the NIC executes chains: step the NIC one WQE at a
                    // time and let the MN act between any two steps (and, through the
                    // backend, between any two of its own memory accesses).
                    let mut n = 0u64;
                    while n < 10_000_000 && self.fabric.borrow_mut().step().is_some() {
                        n += 1;
                        if il.borrow_mut().mn_acts_now() {
                            let events = self.mn_round(&mut act)?;
                            let _ = events;
                        }
                    }
                    n
                }
            };
            let events = self.mn_round(&mut act)?;
            let cn_moved = self.service_cns()?;
            if steps == 0 && events == 0 && !cn_moved {
                break;
            }
        }
        Ok(act)
    }

    /// One round of the MN CPU: departures, chain failures (and host-engine requests), the
    /// tail watch. Returns the events handled.
    fn mn_round(&mut self, act: &mut MnActivity) -> Result<u32, ClusterError> {
        // CNs harvest what reached them first: a repair resets the MN's end of a pair, and the
        // model resets the CN's end with it (a shortcut for the CN reconnecting), which would
        // take completions the CN already had out of its CQ
        self.service_cns()?;
        let now = self.now();
        let mut events = 0u32;
        // a crashed CN is noticed the way a connection manager notices it
        let crashed: Vec<CnId> = self
            .cns
            .iter()
            .filter(|n| n.crashed && !n.silent && self.driver.mn.cn(n.id).is_some())
            .map(|n| n.id)
            .collect();
        for id in crashed {
            self.driver.handle(now, Event::CnGone { cn: id })?;
            self.count_event(1);
            act.cpu_events += 1;
            events += 1;
        }
        let before = self.driver.stats;
        let report = self.driver.poll(now)?;
        let steps_done = self.driver.stats.cpu_steps - before.cpu_steps;
        if report.events > 0 {
            self.charge_cpu(report.events as u64, steps_done)?;
            act.cpu_events += report.events as u64;
            events += report.events;
        } else if steps_done > 0 {
            // a lap resumed: CPU work without a new event
            let ns = self.fabric.borrow().config().cost.host_engine_step_ns * steps_done;
            self.fabric.borrow_mut().advance_cpu(self.mn_host, ns)?;
        }
        // resumed laps count as movement (they posted their next device step)
        events += report.laps_advanced.min(1);
        // the empty state: the MN watches the tail until every ticket is settled
        if !self.driver.mn.tickets().is_empty() {
            self.driver.handle(now, Event::WatchTail)?;
            self.count_event(1);
            act.cpu_events += 1;
        }
        Ok(events)
    }

    /// Explore interleavings: from now on the MN CPU may act between any two NIC steps, and
    /// NIC steps may run between any two of the MN CPU's memory accesses and device calls
    /// (what real hardware does; the default schedule lets the MN act only when the NIC is
    /// idle, which hides races). `seed` drives the choices; `per_mille` is how often the MN
    /// is let in after a NIC step, and how often the NIC pre-empts an MN access.
    pub fn set_interleaving(&mut self, seed: u64, per_mille: u16) {
        self.driver.backend.interleave =
            Some(Rc::new(RefCell::new(Interleave { state: seed | 1, per_mille: per_mille.min(1000) })));
    }

    fn count_event(&mut self, n: u64) {
        self.mn_cpu_events += n;
        let mut f = self.fabric.borrow_mut();
        for _ in 0..n {
            let _ = f.count_cpu_event(self.mn_host);
        }
    }

    /// Charge MN CPU time: each event costs one step plus the host engine's steps.
    fn charge_cpu(&mut self, events: u64, steps: u64) -> Result<(), ClusterError> {
        self.mn_cpu_events += events;
        let mut f = self.fabric.borrow_mut();
        let step_ns = f.config().cost.host_engine_step_ns;
        for _ in 1..events {
            f.count_cpu_event(self.mn_host)?;
        }
        f.advance_cpu(self.mn_host, (events + steps) * step_ns)?;
        Ok(())
    }

    /// Feed arrived completions to the CN clients; returns whether anything arrived.
    fn service_cns(&mut self) -> Result<bool, ClusterError> {
        let mut moved = false;
        let mut buf = [Completion::EMPTY; 16];
        let mut f = self.fabric.borrow_mut();
        let now = f.now();
        for n in self.cns.iter_mut().filter(|n| !n.crashed && !n.stalled) {
            // alloc replies (WRITE_WITH_IMM on the Alloc QP) and messages (SENDs on the Alloc QP
            // or the first access QP, depending on where the MN sends them)
            for qp in [n.alloc_qp, n.access_qps[0]] {
                for tc in f.poll_timed(qp, QueueSel::Recv)? {
                    moved = true;
                    let c = tc.completion;
                    if !c.status.is_ok() {
                        continue;
                    }
                    if c.opcode == WcOpcode::RecvRdmaWithImm {
                        let imm = c.imm.unwrap_or(0);
                        let mut b = [0u8; omw_core::wire::ALLOC_REPLY_LEN];
                        f.read(n.host, n.reply_buf, &mut b)?;
                        n.received.push(b.to_vec());
                        let r = n.client.on_alloc_reply(imm, &b).map_err(CnOpError::Client);
                        n.replies.push((imm, r));
                        n.last_reply_at = tc.at;
                        continue;
                    }
                    let slot = c.wr_id % (CN_RECVS * 4);
                    let mut b = vec![0u8; (c.byte_len as usize).min(MSG_BUF as usize)];
                    f.read(n.host, n.msg_bufs + slot * MSG_BUF, &mut b)?;
                    n.received.push(b.clone());
                    let pending = n.client.pending_token();
                    match n.client.on_message(now, &b) {
                        Ok(ClientEvent::Failed { token, code }) => {
                            // only answers to requests this CN is waiting for count; an error
                            // about bytes it never meant to send is just recorded
                            if Some(token) == pending || n.free_tokens.contains(&token) {
                                n.replies.push((token, Err(CnOpError::Mn(code))));
                            }
                            n.events.push(ClientEvent::Failed { token, code });
                        }
                        Ok(ClientEvent::Probed) => {}
                        Ok(ev) => n.events.push(ev),
                        Err(_) => {}
                    }
                }
            }
            // drain send completions of SENDs (their errors surface in the op that posted them)
            for qp in [n.alloc_qp, n.free_qp] {
                while f.poll(qp, QueueSel::Send, &mut buf)? > 0 {}
            }
            Self::top_up(&mut f, n)?;
        }
        Ok(moved)
    }

    // ------------------------------------------------------------------ CN operations

    fn cn_send(&mut self, i: usize, qp: QpAddr, bytes: &[u8]) -> Result<(), CnOpError> {
        let n = &mut self.cns[i];
        if n.crashed {
            return Err(CnOpError::Crashed);
        }
        // a ring of send buffers: several requests may be outstanding at once (one pump runs
        // them all), and a SEND reads its buffer only when the NIC executes it
        let slot = n.send_seq % CN_SEND_SLOTS;
        n.send_seq += 1;
        let mut f = self.fabric.borrow_mut();
        let (buf, lkey) = (n.send_bufs + slot * MSG_BUF, n.send_lkey);
        f.write(n.host, buf, bytes).map_err(|_| CnOpError::Device(WcStatus::LocProtErr))?;
        f.post_send(qp, &Wqe::send(buf, lkey, bytes.len() as u32)).map_err(|_| CnOpError::Device(WcStatus::LocQpOpErr))
    }

    /// Allocate a chunk for CN `i`.
    pub fn alloc(&mut self, i: usize) -> Result<Allocation, CnOpError> {
        let token = self.alloc_begin(i)?;
        self.alloc_finish(i, token)
    }

    /// Post CN `i`'s alloc request and return its token, without running anything (so a
    /// test can interleave faults with the chain).
    pub fn alloc_begin(&mut self, i: usize) -> Result<u32, CnOpError> {
        let now = self.now();
        let n = &mut self.cns[i];
        if n.crashed {
            return Err(CnOpError::Crashed);
        }
        let mut req = [0u8; 64];
        let (token, len) =
            n.client.alloc_request(now, n.reply_buf, n.reply_keys.rkey, &mut req).map_err(CnOpError::Client)?;
        let qp = n.alloc_qp;
        self.cn_send(i, qp, &req[..len])?;
        Ok(token)
    }

    /// CN `i` allocates but names `access_qpns` (MN ends) for its access windows instead of its
    /// own — a malicious or confused CN.
    pub fn alloc_naming(&mut self, i: usize, access_qpns: &[Qpn]) -> Result<Allocation, CnOpError> {
        let now = self.now();
        let n = &mut self.cns[i];
        if n.crashed {
            return Err(CnOpError::Crashed);
        }
        let mut req = [0u8; 64];
        let (token, len) =
            n.client.alloc_request(now, n.reply_buf, n.reply_keys.rkey, &mut req).map_err(CnOpError::Client)?;
        let g = self.cfg.group_size as usize - 1;
        let mut r = omw_core::wire::AllocRequest::decode(&req[..len], g).map_err(|e| CnOpError::Client(e.into()))?;
        r.access_qpns = access_qpns.iter().copied().take(g).collect();
        let len = r.encode(&mut req).map_err(|e| CnOpError::Client(e.into()))?;
        let qp = self.cns[i].alloc_qp;
        self.cn_send(i, qp, &req[..len])?;
        self.alloc_finish(i, token)
    }

    /// Run everything and collect the answer to the alloc request `token`.
    pub fn alloc_finish(&mut self, i: usize, token: u32) -> Result<Allocation, CnOpError> {
        self.pump().map_err(|e| CnOpError::Client(ClientError::Wire(wire_err(e))))?;
        if self.cns[i].crashed {
            return Err(CnOpError::Crashed);
        }
        self.take_reply(i, token)
    }

    fn take_reply(&mut self, i: usize, token: u32) -> Result<Allocation, CnOpError> {
        let n = &mut self.cns[i];
        if let Some(pos) = n.replies.iter().position(|(t, _)| *t == token) {
            return n.replies.remove(pos).1;
        }
        n.client.abandon_pending();
        Err(CnOpError::NoReply)
    }

    /// Send arbitrary bytes on CN `i`'s Alloc or Free QP (a malicious or broken CN).
    pub fn send_raw(&mut self, i: usize, kind: ChainKind, bytes: &[u8]) -> Result<(), ClusterError> {
        let qp = if kind == ChainKind::Alloc { self.cns[i].alloc_qp } else { self.cns[i].free_qp };
        let _ = self.cn_send(i, qp, bytes);
        self.pump()?;
        Ok(())
    }

    /// Free one of CN `i`'s allocations. Frees are not acknowledged on success; an error
    /// notice with the request's token comes back on failure.
    pub fn free(&mut self, i: usize, a: &Allocation) -> Result<(), CnOpError> {
        let bytes = self.cns[i].client.free_request(a.entry_addr).map_err(CnOpError::Client)?;
        self.free_bytes(i, &bytes)
    }

    /// Post CN `i`'s free request without running anything (the free counterpart of
    /// [`Cluster::alloc_begin`]: several CNs' frees can then contend in one [`Cluster::pump`]).
    pub fn free_begin(&mut self, i: usize, a: &Allocation) -> Result<(), CnOpError> {
        let bytes = self.cns[i].client.free_request(a.entry_addr).map_err(CnOpError::Client)?;
        let qp = self.cns[i].free_qp;
        self.cn_send(i, qp, &bytes)
    }

    /// Post a free request for any entry address without running anything (a forger timing
    /// its request against other CNs' laps).
    pub fn free_raw_begin(&mut self, i: usize, entry_addr: u64) -> Result<(), CnOpError> {
        let bytes = FreeRequest { token: 0xF0F0_0000 | i as u32, entry_addr }.encode();
        let qp = self.cns[i].free_qp;
        self.cn_send(i, qp, &bytes)
    }

    /// Post arbitrary bytes on CN `i`'s Alloc or Free QP without running anything.
    pub fn send_raw_begin(&mut self, i: usize, kind: ChainKind, bytes: &[u8]) -> Result<(), CnOpError> {
        let qp = if kind == ChainKind::Alloc { self.cns[i].alloc_qp } else { self.cns[i].free_qp };
        self.cn_send(i, qp, bytes)
    }

    /// The answer to alloc request `token` if it has arrived (after a [`Cluster::pump`]).
    pub fn alloc_take(&mut self, i: usize, token: u32) -> Result<Allocation, CnOpError> {
        self.take_reply(i, token)
    }

    /// Send a free request for any entry address (forged frees).
    pub fn free_raw(&mut self, i: usize, entry_addr: u64) -> Result<(), CnOpError> {
        let bytes = FreeRequest { token: 0xF0F0_0000 | i as u32, entry_addr }.encode();
        self.free_bytes(i, &bytes)
    }

    fn free_bytes(&mut self, i: usize, bytes: &[u8]) -> Result<(), CnOpError> {
        let token = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        let qp = self.cns[i].free_qp;
        self.cns[i].free_tokens.push(token);
        self.cn_send(i, qp, bytes)?;
        self.pump().map_err(|e| CnOpError::Client(ClientError::Wire(wire_err(e))))?;
        let n = &mut self.cns[i];
        n.free_tokens.retain(|t| *t != token);
        if let Some(pos) = n.replies.iter().position(|(t, _)| *t == token) {
            n.replies.remove(pos).1?;
        }
        Ok(())
    }

    /// CN `i` posts any work request on one of its own QPs — what a hostile CN can do. The
    /// WQE's local buffer, if it names none, is the CN's I/O buffer. Runs the fabric, returns
    /// the completion status, and brings the pair back after an error (the CN reconnecting).
    pub fn cn_post(&mut self, i: usize, qp: CnQp, mut w: Wqe) -> WcStatus {
        let n = &self.cns[i];
        if n.crashed {
            return WcStatus::LocQpOpErr;
        }
        let qp = match qp {
            CnQp::Alloc => n.alloc_qp,
            CnQp::Free => n.free_qp,
            CnQp::Access(k) => match n.access_qps.get(k) {
                Some(q) => *q,
                None => return WcStatus::LocQpOpErr,
            },
        };
        if w.lkey == 0 {
            w.local_addr = n.io_buf;
            w.lkey = n.io_keys.lkey;
        }
        let w = w.with_wr_id(0xA77A_0000 + i as u64).with_flags(w.flags | omw_core::wqe::WqeFlags::SIGNALED);
        let mut f = self.fabric.borrow_mut();
        if f.post_send(qp, &w).is_err() {
            return WcStatus::LocQpOpErr;
        }
        let mut out = [Completion::EMPTY; 8];
        let mut status = WcStatus::GeneralErr;
        'poll: for _ in 0..4 {
            if let Ok(k) = f.poll_cq(qp, QueueSel::Send, &mut out) {
                for c in &out[..k] {
                    if c.wr_id == w.wr_id {
                        status = c.status;
                        break 'poll;
                    }
                }
            }
        }
        if !status.is_ok() {
            let _ = f.reset_qp(qp);
        }
        drop(f);
        let _ = self.pump();
        status
    }

    /// The bytes of CN `i`'s I/O buffer (what its last READ or atomic brought back).
    pub fn cn_io(&self, i: usize, len: usize) -> Vec<u8> {
        let n = &self.cns[i];
        let mut b = vec![0u8; len];
        let _ = self.fabric.borrow().read(n.host, n.io_buf, &mut b);
        b
    }

    /// One-sided WRITE by CN `i` through its access QP `q` with `rkey` at `addr`.
    pub fn write_raw(&mut self, i: usize, q: usize, addr: u64, rkey: Rkey, data: &[u8]) -> WcStatus {
        self.one_sided(i, q, addr, rkey, Some(data), data.len()).0
    }

    /// One-sided READ of `len` bytes.
    pub fn read_raw(&mut self, i: usize, q: usize, addr: u64, rkey: Rkey, len: usize) -> (WcStatus, Vec<u8>) {
        self.one_sided(i, q, addr, rkey, None, len)
    }

    fn one_sided(
        &mut self,
        i: usize,
        q: usize,
        addr: u64,
        rkey: Rkey,
        data: Option<&[u8]>,
        len: usize,
    ) -> (WcStatus, Vec<u8>) {
        let n = &self.cns[i];
        if n.crashed || q >= n.access_qps.len() {
            return (WcStatus::LocQpOpErr, Vec::new());
        }
        let qp = n.access_qps[q];
        let (buf, lkey, host) = (n.io_buf, n.io_keys.lkey, n.host);
        let mut f = self.fabric.borrow_mut();
        let len = len.min(self.cfg.chunk_size.max(4096) as usize);
        let w = match data {
            Some(d) => {
                if f.write(host, buf, d).is_err() {
                    return (WcStatus::LocProtErr, Vec::new());
                }
                Wqe::write(buf, lkey, len as u32, addr, rkey.0)
            }
            None => Wqe::read(buf, lkey, len as u32, addr, rkey.0),
        };
        let w = w.with_wr_id(0xACC0_0000 + i as u64);
        if f.post_send(qp, &w).is_err() {
            return (WcStatus::LocQpOpErr, Vec::new());
        }
        let mut out = [Completion::EMPTY; 4];
        let mut status = WcStatus::GeneralErr;
        for _ in 0..4 {
            match f.poll_cq(qp, QueueSel::Send, &mut out) {
                Ok(k) if k > 0 => {
                    if let Some(c) = out[..k].iter().find(|c| c.wr_id == w.wr_id) {
                        status = c.status;
                        break;
                    }
                }
                _ => {}
            }
        }
        let mut got = vec![0u8; len];
        if data.is_none() && status.is_ok() && f.read(host, buf, &mut got).is_err() {
            status = WcStatus::LocProtErr;
        }
        drop(f);
        // the MN sees nothing of one-sided traffic; a failed access left the pair in ERR:
        // bring it back the way a CN would reconnect
        if !status.is_ok() {
            let mut f = self.fabric.borrow_mut();
            let _ = f.reset_qp(qp);
        }
        let _ = self.service_cns();
        (status, if data.is_none() { got } else { Vec::new() })
    }

    /// Write `data` at `offset` of an allocation through access QP `q` with its own rkey.
    pub fn write(&mut self, i: usize, a: &Allocation, q: usize, offset: u64, data: &[u8]) -> WcStatus {
        let rkey = a.rkey(q).unwrap_or_default();
        self.write_raw(i, q, a.base + offset, rkey, data)
    }

    pub fn read(&mut self, i: usize, a: &Allocation, q: usize, offset: u64, len: usize) -> (WcStatus, Vec<u8>) {
        let rkey = a.rkey(q).unwrap_or_default();
        self.read_raw(i, q, a.base + offset, rkey, len)
    }

    // ------------------------------------------------------------------ faults and time

    /// The CN host crashes: its QPs and memory are gone; the MN notices and reclaims.
    pub fn crash_cn(&mut self, i: usize) -> Result<(), ClusterError> {
        let h = self.cns[i].host;
        self.fabric.borrow_mut().crash_host(h)?;
        self.cns[i].crashed = true;
        self.pump()?;
        Ok(())
    }

    /// CN `i` stops posting receives and polling (a hostile or hung CN): what it had posted is
    /// used up by the next messages, after which the MN's sends to it hit the RNR budget.
    pub fn stall_cn(&mut self, i: usize) {
        self.cns[i].stalled = true;
    }

    /// CN `i`'s host vanishes without a disconnect (power loss, a killed VM): its QPs stop
    /// answering and no connection manager tells the MN — only the MN's lease notices.
    pub fn vanish_cn(&mut self, i: usize) -> Result<(), ClusterError> {
        let h = self.cns[i].host;
        self.fabric.borrow_mut().crash_host(h)?;
        self.cns[i].crashed = true;
        self.cns[i].silent = true;
        Ok(())
    }

    /// Let `ns` of modelled time pass (running what is due), then give the MN its timer.
    pub fn advance(&mut self, ns: u64) -> Result<(), ClusterError> {
        let t = self.now() + ns;
        self.fabric.borrow_mut().run_until(t, 10_000_000);
        self.fabric.borrow_mut().advance_to(t);
        self.tick()
    }

    /// Whether the MN still serves CN `i`.
    pub fn is_served(&self, i: usize) -> bool {
        self.driver.mn.cn(self.cns[i].id).is_some()
    }

    /// The MN's RNIC resets: every QP errors and every window binding is lost.
    pub fn reset_mn_rnic(&mut self) -> Result<(), ClusterError> {
        self.fabric.borrow_mut().reset_rnic(self.mn_host)?;
        for i in 0..self.cns.len() {
            self.counter_base[i] = self.mgmt_counters(i);
        }
        let now = self.now();
        self.driver.handle(now, Event::RnicReset)?;
        self.count_event(1);
        self.pump()?;
        Ok(())
    }

    /// The MN's periodic timer.
    pub fn tick(&mut self) -> Result<(), ClusterError> {
        let now = self.now();
        self.driver.handle(now, Event::Tick)?;
        self.pump()?;
        Ok(())
    }

    /// The "hardware counters" of CN `i`'s management QPs: completed alloc and free laps,
    /// from the WQEs the MN ends of its Alloc and Free QPs executed (one ring's worth per lap).
    pub fn mgmt_counters(&self, i: usize) -> (u64, u64) {
        let f = self.fabric.borrow();
        let n = &self.cns[i];
        let exec = |q: Qpn| f.qp_stats(QpAddr::new(self.mn_host, q)).map(|s| s.wqes_executed).unwrap_or(0);
        let a = exec(n.mn_qps.alloc) / self.ring_depths[0][1].max(1) as u64;
        let fr = exec(n.mn_qps.free) / self.ring_depths[1][1].max(1) as u64;
        (a, fr)
    }

    /// Offloaded mode's lazy quota enforcement: sample each CN's management-QP counters and
    /// hand them to the MN (which disconnects a CN over budget).
    pub fn sample_counters(&mut self) -> Result<(), ClusterError> {
        if self.mode != ExecutionMode::Offloaded {
            return Ok(());
        }
        let now = self.now();
        let mut samples = Vec::new();
        for (i, n) in self.cns.iter().enumerate() {
            if n.crashed || self.driver.mn.cn(n.id).is_none() {
                continue;
            }
            let (a, fr) = self.mgmt_counters(i);
            let (ba, bf) = self.counter_base[i];
            samples.push((n.id, a.saturating_sub(ba), fr.saturating_sub(bf)));
        }
        for (cn, allocs, frees) in samples {
            self.driver.handle(now, Event::CounterSample { cn, allocs, frees })?;
            self.count_event(1);
        }
        self.pump()?;
        Ok(())
    }

    /// Invariants of the protocol (the core's checker over MN memory and window state) and of
    /// the model itself.
    pub fn check_invariants(&mut self) -> Result<(), String> {
        self.driver.check_invariants().map_err(|e| e.to_string())?;
        self.fabric.borrow().check_invariants()
    }

    /// Which group an allocation is.
    pub fn group_of(&self, a: &Allocation) -> Option<GroupId> {
        self.driver.mn.map().group_of_entry(a.entry_addr)
    }

    pub fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        self.driver.backend.mw_binding(rkey)
    }

    /// Free groups in the queue right now.
    pub fn free_groups(&self) -> u32 {
        let q = self.driver.mn.map().queue;
        let f = self.fabric.borrow();
        let h = f.read_u64(self.mn_host, q.head).unwrap_or(0);
        let t = f.read_u64(self.mn_host, q.tail).unwrap_or(0);
        q.live_len(h, t, self.driver.mn.map().max_cns)
    }
}

fn plan_err<E: fmt::Display>(e: omw_core::mn_plan::PlanError<E>) -> ClusterError {
    ClusterError::Config(e.to_string())
}

fn wire_err(_: ClusterError) -> omw_core::wire::WireError {
    omw_core::wire::WireError::InconsistentReply
}
