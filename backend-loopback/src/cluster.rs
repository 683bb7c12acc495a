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
use omw_core::chain::mlx5::Mlx5Arm;
use omw_core::chain::ChainKind;
use omw_core::cn::driver::{
    prime_receives, AccessDone, CnDriver, CnError, CnEvent, CnMemory, CnQpSet, MessageQueue, OpId,
};
use omw_core::cn::{Allocation, Client, ClientError, ClientEvent};
use omw_core::device::DataPath;
use omw_core::device::OffloadRings;
use omw_core::device::Provision;
use omw_core::device::WindowState;
use omw_core::device::{
    Capabilities, Completion, Domain, ExecutionMode, ModeError, MrKeys, MwBinding, QpState, WcOpcode, WcStatus,
};
use omw_core::ids::{CnId, GroupId, Qpn, Rkey};
use omw_core::mn::driver::{DriverError, MnDriver};
use omw_core::mn::plan::{MnOptions, MnPlan, Region};
use omw_core::mn::provision::{PoolSpec, ProvisionError};
use omw_core::mn::{AllocChainQps, CnQps, Event};
pub use omw_core::testing::deployment::MnActivity;
use omw_core::testing::deployment::{self, CnSide, Deployment, Life, PumpError};
use omw_core::testing::hostile::HostileCn;
use omw_core::wire::message::ErrorCode;
use omw_core::wire::wqe::{QueueSel, RecvWqe, Wqe};
use std::cell::{Cell, RefCell};
use std::fmt;
use std::rc::Rc;

/// Most live allocations one modelled CN tracks.
pub const CN_MAX_LIVE: usize = 1024;

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
    /// The MN's CN lease (ns, 0: off; `PoolSpec::lease_ns`).
    pub lease_ns: u64,
    /// Whether the alloc chains pop ahead (`MnConfig::pop_ahead`); None: the MN's default.
    pub pop_ahead: Option<bool>,
    /// CN slots of the MN; None: `cns` (a pool's MN is provisioned with slots for CNs that
    /// connect later, [`Cluster::connect_cn`]).
    pub max_cns: Option<u32>,
    /// Lay the chains out for this variant instead of the one the NIC's answers choose
    /// (`ChainVariant::choose`) — to run one layout under a behaviour another would be chosen for.
    pub chain_variant: Option<omw_core::chain::variant::ChainVariant>,
    /// Alloc chains per CN (`MnConfig::alloc_chains`, 1..=`MAX_ALLOC_CHAINS`): the MN is
    /// provisioned for that many and every CN the cluster drives connects with them all, so it
    /// has that many allocations in flight at once.
    pub alloc_chains: u8,
}

impl ClusterConfig {
    /// The chains' rings in `f` (the NIC's [`NicConfig::wqe_format`]; their depths follow).
    pub fn with_wqe_format(mut self, f: omw_core::wire::wqe_format::WqeFormat) -> Self {
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
            lease_ns: omw_core::mn::DEFAULT_LEASE_NS,
            pop_ahead: None,
            max_cns: None,
            chain_variant: None,
            alloc_chains: 1,
        }
    }
}

#[derive(Debug)]
#[non_exhaustive]
pub enum ClusterError {
    Model(LoopbackError),
    /// The MN plan refused the configuration (e.g. offload demanded on a NIC without it).
    Mode(ModeError),
    Provision(ProvisionError<LoopbackError>),
    Driver(DriverError<LoopbackError>),
    /// A CN's driver failed (its own device calls).
    Cn {
        cn: usize,
        error: CnError<LoopbackError>,
    },
    /// A new CN never received its connect info.
    NoConnectInfo {
        cn: usize,
    },
    /// The cluster kept moving for the harness's whole round budget.
    NeverIdle,
}

impl fmt::Display for ClusterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterError::Model(e) => write!(f, "model: {e}"),
            ClusterError::Mode(e) => write!(f, "MN plan: {e}"),
            ClusterError::Provision(e) => write!(f, "provisioning the MN: {e}"),
            ClusterError::Driver(e) => write!(f, "MN driver: {e}"),
            ClusterError::Cn { cn, error } => write!(f, "cn{cn}: {error}"),
            ClusterError::NoConnectInfo { cn } => write!(f, "cn{cn} never received its connect info"),
            ClusterError::NeverIdle => {
                write!(f, "the cluster never went idle in {} pump rounds", deployment::MAX_ROUNDS)
            }
        }
    }
}
impl std::error::Error for ClusterError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ClusterError::Model(e) => Some(e),
            _ => None,
        }
    }
}
impl From<LoopbackError> for ClusterError {
    fn from(e: LoopbackError) -> Self {
        ClusterError::Model(e)
    }
}
impl From<DriverError<LoopbackError>> for ClusterError {
    fn from(e: DriverError<LoopbackError>) -> Self {
        ClusterError::Driver(e)
    }
}

pub use omw_core::cn::driver::CnQp;

/// Why a CN operation did not succeed.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum CnOpError {
    /// The MN refused (empty queue, not the owner, bad request, …).
    Mn(ErrorCode),
    Client(ClientError),
    /// The CN's own work request failed.
    Device(WcStatus),
    /// The CN's driver refused or its device call failed.
    Cn(CnError<LoopbackError>),
    /// Nothing came back (the CN's management QP is gone, e.g. after a quota disconnect).
    NoReply,
    Crashed,
    NoSuchCn(usize),
    /// Running the cluster failed while the operation waited.
    Cluster(Rc<ClusterError>),
}

impl PartialEq for CnOpError {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (CnOpError::Mn(a), CnOpError::Mn(b)) => a == b,
            (CnOpError::Client(a), CnOpError::Client(b)) => a == b,
            (CnOpError::Device(a), CnOpError::Device(b)) => a == b,
            (CnOpError::Cn(a), CnOpError::Cn(b)) => a == b,
            (CnOpError::NoReply, CnOpError::NoReply) | (CnOpError::Crashed, CnOpError::Crashed) => true,
            (CnOpError::NoSuchCn(a), CnOpError::NoSuchCn(b)) => a == b,
            (CnOpError::Cluster(a), CnOpError::Cluster(b)) => Rc::ptr_eq(a, b),
            _ => false,
        }
    }
}
impl Eq for CnOpError {}

impl From<CnError<LoopbackError>> for CnOpError {
    fn from(e: CnError<LoopbackError>) -> Self {
        match e {
            CnError::Client(c) => CnOpError::Client(c),
            e => CnOpError::Cn(e),
        }
    }
}

impl fmt::Display for CnOpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CnOpError::Mn(c) => write!(f, "MN refused: {c:?}"),
            CnOpError::Client(e) => write!(f, "{e}"),
            CnOpError::Device(s) => write!(f, "work request failed: {s}"),
            CnOpError::Cn(e) => write!(f, "CN driver: {e}"),
            CnOpError::NoReply => f.write_str("no reply from the MN"),
            CnOpError::Crashed => f.write_str("this CN has crashed"),
            CnOpError::NoSuchCn(i) => write!(f, "no CN {i}"),
            CnOpError::Cluster(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for CnOpError {}

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
    /// How many NIC steps run while the MN spins once on a CQ (1 to 8).
    fn spin_steps(&mut self) -> u64 {
        1 + self.next() % 8
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

/// A node's [`RdmaBackend`](omw_core::device::RdmaBackend): its host on the shared fabric. [`Domain::CnFacing`] is the
/// host's PD 0; [`Domain::MnPrivate`] a PD of its own that only the MN's loopback QPs are in
/// (a CN has none and is refused it).
#[derive(Clone, Debug)]
pub struct NodeBackend {
    pub fabric: Rc<RefCell<Fabric>>,
    pub host: HostId,
    pub private_pd: Option<PdId>,
    /// When set, NIC steps may run between the node's own accesses.
    pub interleave: Option<Rc<RefCell<Interleave>>>,
    /// The MN's polls, like a CPU spinning on its CQ, run the NIC first; a CN's only take what
    /// is there (the harness decides when the fabric runs).
    spin_on_poll: bool,
    /// Modelled time of the last alloc reply (WRITE_WITH_IMM) a poll returned.
    pub last_reply_at: Cell<u64>,
}

/// The MN's backend.
pub type MnBackend = NodeBackend;

impl NodeBackend {
    fn new(fabric: Rc<RefCell<Fabric>>, host: HostId, private_pd: Option<PdId>) -> Self {
        let spin_on_poll = private_pd.is_some();
        NodeBackend { fabric, host, private_pd, interleave: None, spin_on_poll, last_reply_at: Cell::new(0) }
    }
    /// A CN's device: host `host` of `fabric`, no private domain, polls that take what is there
    /// (whoever drives the fabric decides when it runs) — for harnesses whose MN is another
    /// device on the same fabric (`omw-cx-double`).
    pub fn cn(fabric: Rc<RefCell<Fabric>>, host: HostId) -> Self {
        Self::new(fabric, host, None)
    }
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
    pub fn pd(&self, d: Domain) -> Result<PdId, LoopbackError> {
        match d {
            Domain::CnFacing => Ok(PdId(0)),
            Domain::MnPrivate => self.private_pd.ok_or(LoopbackError::NoSuchPd { host: self.host, pd: u32::MAX }),
        }
    }
}

impl DataPath for NodeBackend {
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
        if self.spin_on_poll {
            // exploring interleavings: the MN's spin lets only a few NIC steps run per poll, so
            // its waits are sequences of NIC steps other laps interleave with (not a run to idle)
            if let Some(il) = &self.interleave {
                let steps = il.borrow_mut().spin_steps();
                return self.fabric.borrow_mut().poll_cq_after(self.qa(qp), queue, out, steps);
            }
            return self.fabric.borrow_mut().poll_cq(self.qa(qp), queue, out);
        }
        let mut f = self.fabric.borrow_mut();
        let mut at = vec![0u64; out.len()];
        let n = f.poll_at(self.qa(qp), queue, out, &mut at)?;
        for (c, t) in out[..n].iter().zip(&at) {
            if c.opcode == WcOpcode::RecvRdmaWithImm {
                self.last_reply_at.set(*t);
            }
        }
        Ok(n)
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
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> Result<(), LoopbackError> {
        self.preempt();
        self.fabric.borrow().read(self.host, addr, buf)
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<(), LoopbackError> {
        self.preempt();
        self.fabric.borrow_mut().write(self.host, addr, data)
    }
    fn outstanding(&self, qp: Qpn, queue: QueueSel) -> Option<u64> {
        self.fabric.borrow().outstanding(self.qa(qp), queue)
    }
}

impl Provision for NodeBackend {
    fn reg_mr(&mut self, d: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys, LoopbackError> {
        let pd = self.pd(d)?;
        self.fabric.borrow_mut().reg_mr(self.host, pd, addr, len, access)
    }
    fn alloc_mw(&mut self) -> Result<Rkey, LoopbackError> {
        self.fabric.borrow_mut().alloc_mw(self.host, PdId(0))
    }
    fn alloc_memory(&mut self, len: u64, align: u64) -> Result<u64, LoopbackError> {
        self.fabric.borrow_mut().alloc(self.host, len, align)
    }
    fn create_loopback_qp(&mut self, d: Domain, managed: Option<u32>) -> Result<Qpn, LoopbackError> {
        let pd = self.pd(d)?;
        Ok(self.fabric.borrow_mut().create_loopback_qp(self.host, pd, managed)?.qpn)
    }
}

impl OffloadRings for NodeBackend {
    fn ring_base(&self, qp: Qpn, queue: QueueSel) -> Result<u64, LoopbackError> {
        self.fabric.borrow().ring_base(self.qa(qp), queue)
    }
    fn ring_keys(&self, d: Domain) -> Result<MrKeys, LoopbackError> {
        self.fabric.borrow().ring_keys_in(self.host, self.pd(d)?)
    }
    fn send_wqes_executed(&self, qp: Qpn) -> Option<u64> {
        self.fabric.borrow().qp_stats(self.qa(qp)).ok().map(|s| s.wqes_executed)
    }
    fn recv_doorbell(&self, qp: Qpn) -> Result<Option<omw_core::device::RecvDoorbell>, LoopbackError> {
        self.fabric.borrow().recv_doorbell(self.qa(qp))
    }
}

impl WindowState for NodeBackend {
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        WindowState::mw_binding(&self.fabric.borrow_mut().view(self.host), rkey)
    }
    fn mw_span(&self, rkey: Rkey) -> Option<(u64, u64)> {
        WindowState::mw_span(&self.fabric.borrow_mut().view(self.host), rkey)
    }
}

impl Mlx5Arm for NodeBackend {
    fn cq_numbers(&self, loop_qp: Qpn, mgmt_qp: Qpn) -> Option<[u32; 3]> {
        Mlx5Arm::cq_numbers(&self.fabric.borrow_mut().view(self.host), loop_qp, mgmt_qp)
    }
    fn arm_mlx5(
        &mut self,
        chain: &omw_core::chain::mlx5::Mlx5Chain,
        recv_copies: u32,
    ) -> Option<Result<(), LoopbackError>> {
        self.preempt();
        Mlx5Arm::arm_mlx5(&mut self.fabric.borrow_mut().view(self.host), chain, recv_copies)
    }
    fn cq_producer_indices(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> [u32; 3] {
        [0; 3]
    }
}

/// Send-queue depth of a detached CN's QPs (what bounds its accesses in flight per QP).
pub const DETACHED_SEND_DEPTH: u32 = 64;

/// A CN connected to the cluster's MN but driven elsewhere ([`Cluster::connect_detached_cn`]).
#[derive(Clone, Debug)]
pub struct DetachedCn {
    pub host: HostId,
    /// The id the MN admitted it as.
    pub id: CnId,
    /// Its ends of the Alloc, Free and access QPs.
    pub qps: CnQpSet,
    /// Its registered memory; the receives of both message queues are posted in it. The reply
    /// buffer holds a reply slot per alloc chain (`reply_len` bytes).
    pub mem: CnMemory,
    /// The MN's ends.
    pub mn_qps: CnQps,
    /// Its ends of the Alloc QPs of its alloc chains beyond the first (empty: one chain), in
    /// the order `mn_extra` names their MN ends — what `CnDriver::with_alloc_chains` takes.
    pub extra_alloc: Vec<Qpn>,
    /// The MN's ends of those chains (management and loop QP).
    pub mn_extra: Vec<AllocChainQps>,
    /// Bytes of its reply buffer (`CnMemory::REPLY_LEN` per alloc chain).
    pub reply_len: u64,
}

impl DetachedCn {
    /// Its alloc chains (its Alloc QPs).
    pub fn alloc_chains(&self) -> usize {
        1 + self.extra_alloc.len()
    }
}

/// One modelled compute node: its host and QPs, driven by the core's [`CnDriver`].
#[derive(Debug)]
pub struct CnNode {
    pub host: HostId,
    pub id: CnId,
    pub driver: CnDriver<NodeBackend, CN_MAX_LIVE>,
    /// CN ends of the Alloc, Free and access QPs.
    pub alloc_qp: QpAddr,
    pub free_qp: QpAddr,
    pub access_qps: Vec<QpAddr>,
    /// CN ends of the Alloc QPs of its alloc chains beyond the first.
    pub extra_alloc_qps: Vec<QpAddr>,
    /// MN ends of those chains' QPs (management and loop).
    pub mn_extra: Vec<AllocChainQps>,
    /// MN ends (what the MN knows).
    pub mn_qps: CnQps,
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
    /// What the last raw work request brought back into its I/O slot.
    last_io: Vec<u8>,
}

impl CnNode {
    pub fn client(&self) -> &Client<CN_MAX_LIVE> {
        self.driver.client()
    }
    pub fn client_mut(&mut self) -> &mut Client<CN_MAX_LIVE> {
        self.driver.client_mut()
    }
}

/// The model as the deployment harness's fabric: run to idle or step by step under an
/// interleaving schedule, the model's clock, the MN host's modelled CPU.
#[derive(Clone, Debug)]
pub struct ModelFabric {
    pub fabric: Rc<RefCell<Fabric>>,
    pub mn_host: HostId,
    /// The schedule shared with the MN's backend (which lets the NIC pre-empt its accesses).
    interleave: Option<Rc<RefCell<Interleave>>>,
}

impl deployment::Fabric for ModelFabric {
    type Error = LoopbackError;
    fn now(&self) -> u64 {
        self.fabric.borrow().now()
    }
    fn run(&mut self) -> Result<u64, LoopbackError> {
        Ok(self.fabric.borrow_mut().run_until_idle(10_000_000))
    }
    fn interleaves(&self) -> bool {
        self.interleave.is_some()
    }
    fn step(&mut self) -> Result<bool, LoopbackError> {
        Ok(self.fabric.borrow_mut().step().is_some())
    }
    fn mn_acts_now(&mut self) -> bool {
        self.interleave.as_ref().is_some_and(|il| il.borrow_mut().mn_acts_now())
    }
    fn advance_to(&mut self, t: u64) -> Result<(), LoopbackError> {
        let mut f = self.fabric.borrow_mut();
        f.run_until(t, 10_000_000);
        f.advance_to(t);
        Ok(())
    }
    /// Each event costs one host-engine step of CPU time, plus the steps its laps ran; laps
    /// resumed without a new event cost their steps.
    fn charge_mn_cpu(&mut self, events: u64, steps: u64) -> Result<(), LoopbackError> {
        let mut f = self.fabric.borrow_mut();
        let step_ns = f.config().cost.host_engine_step_ns;
        for _ in 1..events {
            f.count_cpu_event(self.mn_host)?;
        }
        f.advance_cpu(self.mn_host, (events + steps) * step_ns)?;
        Ok(())
    }
    fn count_mn_events(&mut self, n: u64) -> Result<(), LoopbackError> {
        let mut f = self.fabric.borrow_mut();
        for _ in 0..n {
            f.count_cpu_event(self.mn_host)?;
        }
        Ok(())
    }
}

impl CnSide for CnNode {
    type Error = CnError<LoopbackError>;
    fn life(&self) -> Life {
        match (self.crashed, self.silent, self.stalled) {
            (true, true, _) => Life::Vanished,
            (true, false, _) => Life::Crashed,
            (false, _, true) => Life::Stalled,
            _ => Life::Running,
        }
    }
    fn mn_id(&self) -> CnId {
        self.id
    }
    fn set_mn_id(&mut self, id: CnId) {
        self.id = id;
    }
    fn learnt_id(&self) -> Option<CnId> {
        self.client().id()
    }
    /// (The model brings both ends of a broken pair back at once: `mn` is not needed.)
    fn service<M: DataPath>(&mut self, now: u64, _mn: &mut M) -> Result<bool, Self::Error> {
        self.driver.poll(now)?;
        let mut moved = false;
        while let Some(ev) = self.driver.next_event() {
            moved = true;
            match ev {
                CnEvent::Delivered { bytes, .. } => self.received.push(bytes.to_vec()),
                CnEvent::Allocated { token, result } => {
                    self.last_reply_at = self.driver.backend.last_reply_at.get();
                    self.replies.push((token, result.map_err(CnOpError::Client)));
                }
                CnEvent::Refused { token, code, ours } => {
                    // only answers to requests this CN is waiting for count; an error
                    // about bytes it never meant to send is just recorded
                    if ours {
                        self.replies.push((token, Err(CnOpError::Mn(code))));
                    }
                    self.events.push(ClientEvent::Failed { token, code });
                }
                CnEvent::Connected(id) => self.events.push(ClientEvent::Connected(id)),
                CnEvent::Empty => self.events.push(ClientEvent::Empty),
                CnEvent::ChainParked { chain } => self.events.push(ClientEvent::ChainParked { chain }),
                CnEvent::Available => self.events.push(ClientEvent::Available),
                CnEvent::Revoked => self.events.push(ClientEvent::Revoked),
                // the client already holds the window's new key
                CnEvent::Rekeyed { entry_addr, mw, rkey } => {
                    self.events.push(ClientEvent::Rekeyed { entry_addr, mw, rkey })
                }
                // a send or receive the model failed surfaces in the op that waits for it
                _ => {}
            }
        }
        Ok(moved)
    }
    fn poll_timeout(&self) -> Option<u64> {
        self.driver.poll_timeout()
    }
    fn handle_timeout(&mut self, now: u64) {
        self.driver.handle_timeout(now)
    }
}

impl From<PumpError<LoopbackError, LoopbackError, CnError<LoopbackError>>> for ClusterError {
    fn from(e: PumpError<LoopbackError, LoopbackError, CnError<LoopbackError>>) -> Self {
        match e {
            PumpError::Fabric(e) => ClusterError::Model(e),
            PumpError::Mn(e) => ClusterError::Driver(e),
            PumpError::Cn { cn, error } => ClusterError::Cn { cn, error },
            PumpError::NoConnectInfo { cn } => ClusterError::NoConnectInfo { cn },
            _ => ClusterError::NeverIdle,
        }
    }
}

pub struct Cluster {
    pub fabric: Rc<RefCell<Fabric>>,
    /// The same fabric as the deployment harness drives it.
    world: ModelFabric,
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
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster").field("mode", &self.mode).field("cns", &self.cns.len()).finish()
    }
}

impl Cluster {
    /// The MN has room for `cfg.max_cns` CNs (default `cfg.cns`): the rest connect later,
    /// pool clients or CNs driven outside the cluster ([`Cluster::connect_detached_cn`]).
    pub fn new(cfg: ClusterConfig) -> Result<Cluster, ClusterError> {
        let plan = MnPlan::decide(
            cfg.nic.capabilities(),
            MnOptions { mode: cfg.mode, allow_insecure: false, scrub: cfg.scrub },
        )
        .map_err(ClusterError::Mode)?;
        let mode = plan.mode;
        let mut f = Fabric::new(cfg.nic);
        let mn = f.add_host("mn")?;
        let private_pd = f.alloc_pd(mn)?;
        // the rings are the model's own memory: grant them what the plan says, where it says
        for r in plan.registrations().iter().filter(|r| r.region == Region::Rings && r.domain == Domain::MnPrivate) {
            f.register_ring_arena(mn, private_pd, r.access)?;
        }
        let fabric = Rc::new(RefCell::new(f));
        let backend = NodeBackend::new(fabric.clone(), mn, Some(private_pd));
        let spec = PoolSpec {
            chunk_size: cfg.chunk_size,
            chunks: cfg.chunks,
            group_size: cfg.group_size,
            max_cns: cfg.max_cns.unwrap_or(cfg.cns as u32).clamp(1, omw_core::mn::MAX_CNS as u32),
            quota: cfg.quota,
            lease_ns: cfg.lease_ns,
            queue_depth: None,
        };
        let mut driver = plan.provision_chains(backend, &spec, cfg.alloc_chains).map_err(ClusterError::Provision)?;
        if let Some(on) = cfg.pop_ahead {
            driver.mn.set_pop_ahead(on);
        }
        // the chains' variant from the NIC's answers to the open questions, as a bring-up
        // profile of this model would give them; where no variant is correct the preferred one
        // still runs — to show what breaks (tests/src/matrix.rs) — where a real MN would refuse
        // to offload (`omw_verbs::devx::mn::chain_answers`)
        let answers = omw_core::device::behaviour::DeviceAnswers::exactly(cfg.nic.behaviour);
        let variant = cfg
            .chain_variant
            .unwrap_or_else(|| omw_core::chain::variant::ChainVariant::choose(&answers).unwrap_or_default());
        // (a layout that binds to the poster registers the CN slots' proof words first; one the
        // MN refuses — several alloc chains per CN — leaves the default)
        driver.set_chain_variant(variant).map_err(|e| ClusterError::Provision(ProvisionError::Backend(e)))?;
        let d = driver
            .mn
            .chain_ring_depths()
            .map_err(|e| ClusterError::Provision(ProvisionError::Driver(DriverError::Chain(e))))?;
        let ring_depths = [[d[0][0] as u32, d[0][1] as u32], [d[1][0] as u32, d[1][1] as u32]];
        let per_chunk_mrs = plan.per_chunk_mrs;
        let world = ModelFabric { fabric: fabric.clone(), mn_host: mn, interleave: None };
        let mut c = Cluster {
            world,
            fabric,
            mn_host: mn,
            driver,
            cns: Vec::new(),
            mode,
            cfg,
            per_chunk_mrs,
            ring_depths,
            mn_cpu_events: 0,
        };
        for _ in 0..cfg.cns {
            c.connect_cn()?;
        }
        Ok(c)
    }

    /// Bring up a new CN: its host, buffers and QPs, then the MN's connect.
    pub fn connect_cn(&mut self) -> Result<usize, ClusterError> {
        self.connect_cn_as(None)
    }

    /// [`Cluster::connect_cn`] for a CN the deployment admitted as `tenant` (the MN must know
    /// it: `MemoryNode::add_tenant`).
    pub fn connect_cn_as(&mut self, tenant: Option<omw_core::mn::tenant::TenantId>) -> Result<usize, ClusterError> {
        let idx = self.cns.len();
        let g = self.cfg.group_size as usize;
        let offload = self.mode == ExecutionMode::Offloaded;
        let d = self.ring_depths;
        let mgmt_cfg = |kind: usize| if offload { QpConfig::managed(d[kind][1], 1) } else { QpConfig::default() };
        let (alloc_loop, free_loop) = match self.driver.create_loop_qps()? {
            Some((a, f)) => (Some(a), Some(f)),
            None => (None, None),
        };
        let mut f = self.fabric.borrow_mut();
        let host = f.add_host(&format!("cn{idx}"))?;
        let mn = self.mn_host;
        let cn_cfg = QpConfig::default().with_depths(64, 2 * omw_core::cn::driver::RECVS_PER_QP as u32);
        let (alloc_qp, mn_alloc) = f.create_connected_pair(host, cn_cfg, mn, mgmt_cfg(0))?;
        let (free_qp, mn_free) = f.create_connected_pair(host, cn_cfg, mn, mgmt_cfg(1))?;
        let mut access_qps = Vec::new();
        let mut mn_access = heapless::Vec::new();
        for _ in 1..g {
            let (c, m) = f.create_connected_pair(host, cn_cfg, mn, QpConfig::default())?;
            access_qps.push(c);
            let _ = mn_access.push(m.qpn);
        }
        drop(f);
        // each alloc chain beyond the first: its own Alloc QP pair and loop QP
        let chains = self.driver.mn.config().alloc_chains.max(1);
        let mut extra_alloc_qps = Vec::new();
        let mut mn_extra = Vec::new();
        for _ in 1..chains {
            let lp = self.driver.create_alloc_loop_qp()?;
            let (c, m) = self.fabric.borrow_mut().create_connected_pair(host, cn_cfg, mn, mgmt_cfg(0))?;
            extra_alloc_qps.push(c);
            mn_extra.push(AllocChainQps { mgmt: m.qpn, lp });
        }
        let mut backend = NodeBackend::new(self.fabric.clone(), host, None);
        let reply_len = chains as u64 * CnMemory::REPLY_LEN;
        let reply = backend.alloc_memory(reply_len, 64)?;
        let rk =
            backend.reg_mr(Domain::CnFacing, reply, reply_len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
        let local_len = CnMemory::local_len_for(omw_core::cn::driver::IO_SLOTS, self.cfg.chunk_size.max(4096));
        let local = backend.alloc_memory(local_len, 64)?;
        let lk = backend.reg_mr(Domain::CnFacing, local, local_len, AccessFlags::LOCAL_WRITE)?;
        let mem = CnMemory { local, local_len, lkey: lk.lkey, reply, reply_rkey: rk.rkey };
        let qps =
            CnQpSet { alloc: alloc_qp.qpn, free: free_qp.qpn, access: access_qps.iter().map(|q| q.qpn).collect() };
        let mut driver = CnDriver::new(backend, qps, mem).map_err(|error| ClusterError::Cn { cn: idx, error })?;
        if !extra_alloc_qps.is_empty() {
            let extra: Vec<Qpn> = extra_alloc_qps.iter().map(|q: &QpAddr| q.qpn).collect();
            driver =
                driver.with_alloc_chains(&extra, reply_len).map_err(|error| ClusterError::Cn { cn: idx, error })?;
        }
        driver.record_deliveries(true);
        let mn_qps = CnQps { alloc: mn_alloc.qpn, free: mn_free.qpn, access: mn_access, alloc_loop, free_loop };
        let node = CnNode {
            host,
            id: CnId::UNASSIGNED,
            driver,
            alloc_qp,
            free_qp,
            access_qps,
            extra_alloc_qps,
            mn_extra: mn_extra.clone(),
            mn_qps: mn_qps.clone(),
            crashed: false,
            stalled: false,
            silent: false,
            events: Vec::new(),
            received: Vec::new(),
            last_reply_at: 0,
            replies: Vec::new(),
            last_io: Vec::new(),
        };
        self.cns.push(node);
        let (_, act) = Deployment::new(&mut self.world, &mut self.driver, &mut self.cns)
            .connect_with_chains(idx, mn_qps, &mn_extra, tenant)?;
        self.mn_cpu_events += act.cpu_events;
        Ok(idx)
    }

    /// Bring up a CN the cluster does not drive (a CN library on another thread, say): its host,
    /// QPs (the same depths as the cluster's own CNs), a reply buffer and a local region of
    /// `local_len` bytes, receives primed on both message queues, then the MN's connect and a
    /// pump — its connect info waits in its receive queue. Whoever drives it builds a
    /// `CnDriver::with_primed_receives` over any device that reaches its host and polls it;
    /// the cluster's pumps never service it. [`Cluster::disconnect_detached_cn`] takes it down.
    pub fn connect_detached_cn(&mut self, local_len: u64) -> Result<DetachedCn, ClusterError> {
        self.connect_detached_cn_with_chains(local_len, 1)
    }

    /// [`Cluster::connect_detached_cn`] for a CN that opens `chains` alloc chains: an extra
    /// Alloc QP (and, offloaded, an MN loop QP) per chain beyond the first and a reply slot per
    /// chain, connected with `MnDriver::connect_with_chains`. More than the MN allows
    /// (`MnConfig::alloc_chains`), or none, is refused with `MnError::AllocChains` — the
    /// refusal an MN over rdma_cm sends — before anything of the CN is set up.
    pub fn connect_detached_cn_with_chains(&mut self, local_len: u64, chains: u8) -> Result<DetachedCn, ClusterError> {
        let allowed = self.driver.mn.config().alloc_chains;
        if chains == 0 || chains > allowed {
            return Err(ClusterError::Driver(DriverError::Node(omw_core::mn::MnError::AllocChains {
                allowed,
                asked: chains,
            })));
        }
        let g = self.cfg.group_size as usize;
        let offload = self.mode == ExecutionMode::Offloaded;
        let d = self.ring_depths;
        let mgmt_cfg = |kind: usize| if offload { QpConfig::managed(d[kind][1], 1) } else { QpConfig::default() };
        let (alloc_loop, free_loop) = match self.driver.create_loop_qps()? {
            Some((a, f)) => (Some(a), Some(f)),
            None => (None, None),
        };
        let mut f = self.fabric.borrow_mut();
        let name = format!("detached{}", f.host_count());
        let host = f.add_host(&name)?;
        let cn_cfg =
            QpConfig::default().with_depths(DETACHED_SEND_DEPTH, 2 * omw_core::cn::driver::RECVS_PER_QP as u32);
        let (alloc_qp, mn_alloc) = f.create_connected_pair(host, cn_cfg, self.mn_host, mgmt_cfg(0))?;
        let (free_qp, mn_free) = f.create_connected_pair(host, cn_cfg, self.mn_host, mgmt_cfg(1))?;
        let mut access = heapless::Vec::new();
        let mut mn_access = heapless::Vec::new();
        for _ in 1..g {
            let (c, m) = f.create_connected_pair(host, cn_cfg, self.mn_host, QpConfig::default())?;
            let _ = access.push(c.qpn);
            let _ = mn_access.push(m.qpn);
        }
        drop(f);
        // each alloc chain beyond the first: its own Alloc QP pair and loop QP (its receives are
        // posted when the CN's driver takes it over: `CnDriver::with_alloc_chains`)
        let mut extra_alloc = Vec::new();
        let mut mn_extra = Vec::new();
        for _ in 1..chains {
            let lp = self.driver.create_alloc_loop_qp()?;
            let (c, m) = self.fabric.borrow_mut().create_connected_pair(host, cn_cfg, self.mn_host, mgmt_cfg(0))?;
            extra_alloc.push(c.qpn);
            mn_extra.push(AllocChainQps { mgmt: m.qpn, lp });
        }
        let mut b = NodeBackend::new(self.fabric.clone(), host, None);
        let reply_len = chains as u64 * CnMemory::REPLY_LEN;
        let reply = b.alloc_memory(reply_len, 64)?;
        let rights = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let rk = b.reg_mr(Domain::CnFacing, reply, reply_len, rights)?;
        let local = b.alloc_memory(local_len, 64)?;
        let lk = b.reg_mr(Domain::CnFacing, local, local_len, AccessFlags::LOCAL_WRITE)?;
        let mem = CnMemory { local, local_len, lkey: lk.lkey, reply, reply_rkey: rk.rkey };
        let qps = CnQpSet { alloc: alloc_qp.qpn, free: free_qp.qpn, access };
        // the MN sends its connect info as soon as it admits the CN
        prime_receives(&mut b, &mem, MessageQueue::Alloc, qps.alloc)?;
        prime_receives(&mut b, &mem, MessageQueue::Access0, qps.access[0])?;
        let mn_qps = CnQps { alloc: mn_alloc.qpn, free: mn_free.qpn, access: mn_access, alloc_loop, free_loop };
        let id = self.driver.connect_with_chains(mn_qps.clone(), &mn_extra, None)?;
        self.pump()?;
        Ok(DetachedCn { host, id, qps, mem, mn_qps, extra_alloc, mn_extra, reply_len })
    }

    /// A detached CN leaves: its host goes down and the MN hears of it the way a connection
    /// manager tells it, then reclaims what the CN still held.
    pub fn disconnect_detached_cn(&mut self, cn: &DetachedCn) -> Result<(), ClusterError> {
        self.fabric.borrow_mut().crash_host(cn.host)?;
        let now = self.now();
        self.driver.handle(now, Event::CnGone { cn: cn.id })?;
        self.count_event(1);
        self.pump()?;
        Ok(())
    }

    pub fn now(&self) -> u64 {
        self.fabric.borrow().now()
    }

    /// Run the model, the MN and the CNs until nothing moves (the core's one pump:
    /// `omw_core::testing::deployment`).
    pub fn pump(&mut self) -> Result<MnActivity, ClusterError> {
        let act =
            Deployment::new(&mut self.world, &mut self.driver, &mut self.cns).pump().map_err(ClusterError::from)?;
        self.mn_cpu_events += act.cpu_events;
        Ok(act)
    }

    /// Explore interleavings: from now on the MN CPU may act between any two NIC steps, and
    /// NIC steps may run between any two of the MN CPU's memory accesses and device calls
    /// (what real hardware does; the default schedule lets the MN act only when the NIC is
    /// idle, which hides races). `seed` drives the choices; `per_mille` is how often the MN
    /// is let in after a NIC step, and how often the NIC pre-empts an MN access.
    pub fn set_interleaving(&mut self, seed: u64, per_mille: u16) {
        let il = Rc::new(RefCell::new(Interleave { state: seed | 1, per_mille: per_mille.min(1000) }));
        self.driver.backend.interleave = Some(il.clone());
        self.world.interleave = Some(il);
    }

    fn count_event(&mut self, n: u64) {
        self.mn_cpu_events += n;
        let mut f = self.fabric.borrow_mut();
        for _ in 0..n {
            let _ = f.count_cpu_event(self.mn_host);
        }
    }

    /// Let every CN that is still running take what reached it; returns whether anything
    /// arrived.
    fn service_cns(&mut self) -> Result<bool, ClusterError> {
        let now = self.now();
        let mut moved = false;
        for (idx, n) in self.cns.iter_mut().enumerate().filter(|(_, n)| n.life() == Life::Running) {
            moved |= n.service(now, &mut self.driver.backend).map_err(|error| ClusterError::Cn { cn: idx, error })?;
        }
        Ok(moved)
    }

    // ------------------------------------------------------------------ CN operations

    fn live_cn(&mut self, i: usize) -> Result<&mut CnNode, CnOpError> {
        match self.cns.get_mut(i) {
            Some(n) if !n.crashed => Ok(n),
            Some(_) => Err(CnOpError::Crashed),
            None => Err(CnOpError::NoSuchCn(i)),
        }
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
        self.live_cn(i)?.driver.alloc(now).map_err(CnOpError::from)
    }

    /// CN `i` allocates but names `access_qpns` (MN ends) for its access windows instead of its
    /// own — a malicious or confused CN.
    pub fn alloc_naming(&mut self, i: usize, access_qpns: &[Qpn]) -> Result<Allocation, CnOpError> {
        let now = self.now();
        let token = self.live_cn(i)?.driver.alloc_naming(now, access_qpns)?;
        self.alloc_finish(i, token)
    }

    /// Run everything and collect the answer to the alloc request `token`.
    pub fn alloc_finish(&mut self, i: usize, token: u32) -> Result<Allocation, CnOpError> {
        self.pump().map_err(|e| CnOpError::Cluster(Rc::new(e)))?;
        self.live_cn(i)?;
        self.take_reply(i, token)
    }

    fn take_reply(&mut self, i: usize, token: u32) -> Result<Allocation, CnOpError> {
        let n = self.live_cn(i)?;
        if let Some(pos) = n.replies.iter().position(|(t, _)| *t == token) {
            return n.replies.remove(pos).1;
        }
        n.driver.abandon_alloc(token);
        Err(CnOpError::NoReply)
    }

    /// Send arbitrary bytes on CN `i`'s Alloc or Free QP (a malicious or broken CN).
    pub fn send_raw(&mut self, i: usize, kind: ChainKind, bytes: &[u8]) -> Result<(), ClusterError> {
        let _ = self.send_raw_begin(i, kind, bytes);
        self.pump()?;
        Ok(())
    }

    /// Free one of CN `i`'s allocations. Frees are not acknowledged on success; an error
    /// notice with the request's token comes back on failure.
    pub fn free(&mut self, i: usize, a: &Allocation) -> Result<(), CnOpError> {
        let token = self.live_cn(i)?.driver.free(a)?;
        self.free_finish(i, token)
    }

    /// Post CN `i`'s free request without running anything (the free counterpart of
    /// [`Cluster::alloc_begin`]: several CNs' frees can then contend in one [`Cluster::pump`]).
    pub fn free_begin(&mut self, i: usize, a: &Allocation) -> Result<(), CnOpError> {
        self.live_cn(i)?.driver.free(a)?;
        Ok(())
    }

    /// Post a free request for any entry address without running anything (a forger timing
    /// its request against other CNs' laps).
    pub fn free_raw_begin(&mut self, i: usize, entry_addr: u64) -> Result<(), CnOpError> {
        self.live_cn(i)?.driver.free_entry(entry_addr)?;
        Ok(())
    }

    /// Post arbitrary bytes on CN `i`'s Alloc or Free QP without running anything.
    pub fn send_raw_begin(&mut self, i: usize, kind: ChainKind, bytes: &[u8]) -> Result<(), CnOpError> {
        let qp = if kind == ChainKind::Alloc { CnQp::Alloc } else { CnQp::Free };
        self.live_cn(i)?.driver.send_raw(qp, bytes)?;
        Ok(())
    }

    /// The answer to CN `i`'s alloc request `token` if it has arrived (after a
    /// [`Cluster::pump`]); `None` while it has not — the request stays in flight (unlike
    /// [`Cluster::alloc_take`], which gives it up), as a CN waiting on several chains polls each.
    pub fn alloc_poll(&mut self, i: usize, token: u32) -> Option<Result<Allocation, CnOpError>> {
        let n = self.cns.get_mut(i)?;
        let pos = n.replies.iter().position(|(t, _)| *t == token)?;
        Some(n.replies.remove(pos).1)
    }

    /// The answer to alloc request `token` if it has arrived (after a [`Cluster::pump`]).
    pub fn alloc_take(&mut self, i: usize, token: u32) -> Result<Allocation, CnOpError> {
        self.take_reply(i, token)
    }

    /// Send a free request for any entry address (forged frees).
    pub fn free_raw(&mut self, i: usize, entry_addr: u64) -> Result<(), CnOpError> {
        let token = self.live_cn(i)?.driver.free_entry(entry_addr)?;
        self.free_finish(i, token)
    }

    fn free_finish(&mut self, i: usize, token: u32) -> Result<(), CnOpError> {
        self.pump().map_err(|e| CnOpError::Cluster(Rc::new(e)))?;
        let n = self.live_cn(i)?;
        if let Some(pos) = n.replies.iter().position(|(t, _)| *t == token) {
            n.replies.remove(pos).1?;
        }
        Ok(())
    }

    /// Run the fabric until the access `op` of CN `i` completed; its status and result bytes.
    fn finish_access(&mut self, i: usize, op: OpId, out: &mut [u8]) -> Result<AccessDone, CnOpError> {
        let qp = self.cns.get(i).and_then(|n| Some(QpAddr::new(n.host, n.driver.op_qpn(op)?)));
        for _ in 0..4 {
            if let Some(q) = qp {
                self.fabric
                    .borrow_mut()
                    .spin_on(q, QueueSel::Send)
                    .map_err(|e| CnOpError::Cluster(Rc::new(e.into())))?;
            }
            let n = self.live_cn(i)?;
            let now = n.driver.backend.fabric.borrow().now();
            // a stalled CN still sees its own sends complete, but takes and posts no receive
            if n.stalled {
                n.driver.poll_sends_only()?;
            } else {
                n.driver.poll(now)?;
            }
            if let Some(done) = n.driver.access_done(op, out)? {
                return Ok(done);
            }
        }
        Err(CnOpError::NoReply)
    }

    /// Bring a CN's QP back after one of its own requests failed (the pair went to ERR): the
    /// CN reconnecting, in the model a reset of the pair.
    fn reconnect(&mut self, i: usize, qp: CnQp) {
        if let Some(q) = self.cns.get(i).and_then(|n| n.driver.qps().get(qp)) {
            let h = self.cns[i].host;
            let _ = self.fabric.borrow_mut().reset_qp(QpAddr::new(h, q));
        }
    }

    /// CN `i` posts any work request on one of its own QPs — what a hostile CN can do. The
    /// WQE's local buffer, if it names none, is one of the CN's I/O slots. Runs the fabric,
    /// returns the completion status, and brings the pair back after an error (the CN
    /// reconnecting). What the device wrote into the slot is then in [`Cluster::cn_io`].
    pub fn cn_post(&mut self, i: usize, qp: CnQp, w: Wqe) -> WcStatus {
        let op = match self.live_cn(i).map(|n| n.driver.post_wqe(qp, w)) {
            Ok(Ok(op)) => op,
            _ => return WcStatus::LocQpOpErr,
        };
        let mut out = vec![0u8; self.cns[i].driver.io_slot_len()];
        let status = match self.finish_access(i, op, &mut out) {
            Ok(d) => {
                out.truncate(d.len);
                d.status
            }
            Err(_) => WcStatus::GeneralErr,
        };
        self.cns[i].last_io = out;
        if !status.is_ok() {
            self.reconnect(i, qp);
        }
        let _ = self.pump();
        status
    }

    /// What CN `i`'s last [`Cluster::cn_post`] brought back (a READ's data, an atomic's old
    /// value), up to `len` bytes.
    pub fn cn_io(&self, i: usize, len: usize) -> Vec<u8> {
        let mut b = self.cns[i].last_io.clone();
        b.resize(len, 0);
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

    /// One access — once more where it failed for the transport on the Alloc QP its windows
    /// live on (`ConnectFlags::WINDOWS_ON_ALLOC_QP`): every MN repair or take-back of the CN's
    /// alloc chain resets the MN end of that QP, and a CN whose access then finds no responder
    /// reconnects the QP and asks again, as a CN library must. An access the MN's windows
    /// refused is not repeated.
    fn one_sided(
        &mut self,
        i: usize,
        q: usize,
        addr: u64,
        rkey: Rkey,
        data: Option<&[u8]>,
        len: usize,
    ) -> (WcStatus, Vec<u8>) {
        let mut asked_again = false;
        loop {
            let (status, got, alloc_qp_broke) = self.one_sided_once(i, q, addr, rkey, data, len);
            let refused = matches!(
                status,
                WcStatus::Success
                    | WcStatus::RemAccessErr
                    | WcStatus::RemInvReqErr
                    | WcStatus::RemOpErr
                    | WcStatus::LocProtErr
                    | WcStatus::LocLenErr
                    | WcStatus::LocQpOpErr
            );
            if !alloc_qp_broke || refused || asked_again {
                return (status, got);
            }
            asked_again = true;
        }
    }

    /// One attempt of [`Cluster::one_sided`]; also whether it broke the CN's Alloc QP.
    fn one_sided_once(
        &mut self,
        i: usize,
        q: usize,
        addr: u64,
        rkey: Rkey,
        data: Option<&[u8]>,
        len: usize,
    ) -> (WcStatus, Vec<u8>, bool) {
        let Ok(n) = self.live_cn(i) else { return (WcStatus::LocQpOpErr, Vec::new(), false) };
        let len = len.min(n.driver.io_slot_len());
        let posted = match data {
            Some(d) => n.driver.post_write(q, addr, rkey, &d[..len]),
            None => n.driver.post_read(q, addr, rkey, len),
        };
        let Ok(op) = posted else { return (WcStatus::LocQpOpErr, Vec::new(), false) };
        // the QP the access went on: access QP `q`, or the Alloc QP where the windows live there
        // (`ConnectFlags::WINDOWS_ON_ALLOC_QP`)
        let qpn = n.driver.op_qpn(op);
        let mut got = vec![0u8; len];
        let status = self.finish_access(i, op, &mut got).map(|d| d.status).unwrap_or(WcStatus::GeneralErr);
        // the MN sees nothing of one-sided traffic; a failed access left the pair in ERR:
        // bring it back the way a CN would reconnect
        let mut alloc_qp_broke = false;
        if !status.is_ok() {
            match qpn {
                Some(qpn) => {
                    let h = self.cns[i].host;
                    let _ = self.fabric.borrow_mut().reset_qp(QpAddr::new(h, qpn));
                    alloc_qp_broke = self.cns[i].driver.qps().get(CnQp::Alloc) == Some(qpn);
                }
                None => self.reconnect(i, CnQp::Access(q)),
            }
        }
        if alloc_qp_broke {
            // windows on the Alloc QP (`ConnectFlags::WINDOWS_ON_ALLOC_QP`): the refused access
            // broke the pair and with it the alloc chain; a CN reconnects its Alloc QP through
            // the MN, which repairs and re-arms the chain on that occasion
            let _ = self.pump();
        } else {
            let _ = self.service_cns();
        }
        (status, if data.is_none() && status.is_ok() { got } else { Vec::new() }, alloc_qp_broke)
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
        self.crash_cn_begin(i)?;
        self.pump()?;
        Ok(())
    }

    /// [`Cluster::crash_cn`] without the pump: CN `i`'s host goes down now, and the MN hears of
    /// it in the next pump — under [`Cluster::set_interleaving`], between whichever NIC steps
    /// the schedule picks, while other CNs' laps run.
    pub fn crash_cn_begin(&mut self, i: usize) -> Result<(), ClusterError> {
        let h = self.cns[i].host;
        self.fabric.borrow_mut().crash_host(h)?;
        self.cns[i].crashed = true;
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

    /// Let `ns` of modelled time pass the way a deployment lives through it: every timer of
    /// the MN and of the CNs that falls due runs at its own time (lease probes and their
    /// answers, audits, back-offs), each followed by a pump — never a jump past a due timer.
    pub fn advance(&mut self, ns: u64) -> Result<(), ClusterError> {
        let t = self.now() + ns;
        let act = Deployment::new(&mut self.world, &mut self.driver, &mut self.cns).run_until(t)?;
        self.mn_cpu_events += act.cpu_events;
        Ok(())
    }

    /// Whether the MN still serves CN `i`.
    pub fn is_served(&self, i: usize) -> bool {
        self.driver.mn.cn(self.cns[i].id).is_some()
    }

    /// The MN's RNIC resets: every QP errors and every window binding is lost.
    pub fn reset_mn_rnic(&mut self) -> Result<(), ClusterError> {
        self.fabric.borrow_mut().reset_rnic(self.mn_host)?;
        let now = self.now();
        self.driver.handle(now, Event::RnicReset)?;
        self.count_event(1);
        self.pump()?;
        Ok(())
    }

    /// The MN's periodic timer, now (`MnDriver::tick`: the lap counters sampled, then the tick).
    pub fn tick(&mut self) -> Result<(), ClusterError> {
        let now = self.now();
        self.driver.tick(now)?;
        self.pump()?;
        Ok(())
    }

    /// Offloaded mode's lazy quota enforcement, now: the MN driver samples each CN's
    /// management-QP counters (the model's executed WQEs ÷ ring depth) and hands them to the
    /// MN, which disconnects a CN over budget (`MnDriver::sample_counters`; its timer does
    /// the same at every tick).
    pub fn sample_counters(&mut self) -> Result<(), ClusterError> {
        let now = self.now();
        let n = self.driver.sample_counters(now)?;
        self.count_event(n as u64);
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

    /// Free groups in the queue right now: distinct groups counted by scanning the queue, so a
    /// corrupt queue (duplicates, holes) does not read as a plausible number — see
    /// [`Cluster::free_count`].
    pub fn free_groups(&self) -> u32 {
        self.free_count().map_or(0, |c| c.groups)
    }

    /// Groups no CN has been handed: in the queue, or popped ahead by a CN's alloc chain for
    /// its next request (`MnConfig::pop_ahead`) — what the pool's conservation counts.
    pub fn unallocated(&self) -> u32 {
        self.free_groups() + self.driver.groups_ahead()
    }

    /// The free queue scanned: distinct groups, duplicate slots, holes.
    pub fn free_count(&self) -> Option<omw_core::mn::FreeCount> {
        let f = self.fabric.borrow();
        omw_core::mn::scan_free(self.driver.mn.map(), self.driver.mn.tickets(), |a| f.read_u64(self.mn_host, a).ok())
    }
}
