//! The loopback cluster as a [`Testbed`], in each of its modes.

use crate::mw::{MwDevice, MwFactory, Side, BUF_LEN, POOL_LEN};
use crate::testbed::{Activity, Caps, CnQp, Factory, Heard, MnMr, MnSpec, Refusal, Testbed};
use crate::Mode;
use omw_core::access::AccessFlags;
use omw_core::chain::ChainKind;
use omw_core::cn::{Allocation, ClientEvent};
use omw_core::device::behaviour::DeviceBehaviour;
use omw_core::device::WindowState;
use omw_core::device::{Completion, QpState};
use omw_core::device::{ExecutionMode, MwBinding, WcStatus};
use omw_core::ids::{CnId, GroupId, Qpn, Rkey};
use omw_core::mn::MnStats;
use omw_core::wire::memory_map::MnMemoryMap;
use omw_core::wire::mwtable::MwTableEntry;
use omw_core::wire::wqe::Wqe;
use omw_core::wire::wqe::{QueueSel, RecvWqe};
use omw_loopback::cluster::{Cluster, ClusterConfig, CnOpError};
use omw_loopback::fault::MessageFilter;
use omw_loopback::{Conformance, Fabric, HostId, NicConfig, PdId, QpAddr, QpConfig};

/// Starts loopback clusters in one [`Mode`], on a NIC that answers the open CORE-Direct
/// questions as the model does by default ([`NicConfig::DEFAULT_BEHAVIOUR`]: the paper's
/// device's answers, but WQE prefetch runs past an unsatisfied WAIT).
#[derive(Clone, Copy, Debug)]
pub struct Loopback(pub Mode);

/// Starts loopback clusters in one [`Mode`] on a NIC that answers the open CORE-Direct
/// questions as `behaviour` (`omw_loopback::NicConfig::behaviour`): what the chains do on a
/// device that behaves so.
#[derive(Clone, Copy, Debug)]
pub struct LoopbackUnder {
    pub mode: Mode,
    pub behaviour: DeviceBehaviour,
}

impl Loopback {
    /// The same clusters on a NIC that behaves as `b`.
    pub const fn with_behaviour(self, b: DeviceBehaviour) -> LoopbackUnder {
        LoopbackUnder { mode: self.0, behaviour: b }
    }
}

/// What every loopback mode can do.
const COMMON: Caps = Caps::TIME_CONTROL
    .union(Caps::RNIC_RESET)
    .union(Caps::CRASH)
    .union(Caps::VANISH)
    .union(Caps::STALL)
    .union(Caps::WINDOW_STATE)
    .union(Caps::MN_KEYS)
    .union(Caps::MN_MEMORY)
    .union(Caps::INTERLEAVING)
    .union(Caps::HOSTILE_QPS)
    .union(Caps::CN_MESSAGES)
    .union(Caps::FAULTS)
    .union(Caps::NIC_STEPS)
    .union(Caps::MN_ACTIVITY)
    .union(Caps::NAMED_QPS)
    .union(Caps::CONTENTION)
    .union(Caps::RAW_REQUESTS)
    .union(Caps::WINDOW_SPANS)
    .union(Caps::REVIVE)
    .union(Caps::SEND_WITH_INV);

impl Loopback {
    pub fn config(&self, spec: MnSpec) -> ClusterConfig {
        self.with_behaviour(NicConfig::DEFAULT_BEHAVIOUR).config(spec)
    }
}

impl Factory for Loopback {
    fn name(&self) -> String {
        format!("loopback {:?}", self.0)
    }
    fn caps(&self) -> Caps {
        self.with_behaviour(NicConfig::DEFAULT_BEHAVIOUR).caps()
    }
    fn start(&self, spec: MnSpec) -> Box<dyn Testbed> {
        self.with_behaviour(NicConfig::DEFAULT_BEHAVIOUR).start(spec)
    }
}

impl LoopbackUnder {
    pub fn config(&self, spec: MnSpec) -> ClusterConfig {
        let mut cfg = ClusterConfig::paper_like();
        cfg.cns = spec.cns;
        cfg.chunks = spec.chunks;
        cfg.chunk_size = spec.chunk_size.unwrap_or(4096);
        cfg.group_size = spec.group_size;
        cfg.quota = spec.quota;
        cfg.scrub = spec.scrub;
        match self.mode {
            Mode::Offloaded => cfg.mode = Some(ExecutionMode::Offloaded),
            Mode::OffloadedPopAhead => {
                cfg.mode = Some(ExecutionMode::Offloaded);
                cfg.pop_ahead = Some(true);
            }
            Mode::OffloadedMlx5 => {
                cfg = cfg.with_wqe_format(omw_core::wire::wqe_format::WqeFormat::Mlx5);
                cfg.mode = Some(ExecutionMode::Offloaded);
            }
            Mode::HostEngine => {
                cfg.mode = Some(ExecutionMode::HostEngine);
                cfg.nic = NicConfig::strict().with_offload(false).with_prefetch(8);
            }
            Mode::Rxe => {
                cfg.mode = Some(ExecutionMode::HostEngine);
                cfg.nic = NicConfig::strict().with_offload(false).with_conformance(Conformance::RxeCompatible);
            }
        }
        cfg.nic = cfg.nic.with_behaviour(self.behaviour);
        cfg
    }
}

impl Factory for LoopbackUnder {
    fn name(&self) -> String {
        if self.behaviour == NicConfig::DEFAULT_BEHAVIOUR {
            return format!("loopback {:?}", self.mode);
        }
        format!("loopback {:?} under {:?}", self.mode, self.behaviour)
    }
    fn caps(&self) -> Caps {
        COMMON
            | match self.mode {
                Mode::Offloaded | Mode::OffloadedMlx5 | Mode::OffloadedPopAhead => Caps::OFFLOAD | Caps::STRICT_MW,
                Mode::HostEngine => Caps::HOST_ENGINE | Caps::STRICT_MW,
                Mode::Rxe => Caps::HOST_ENGINE | Caps::RXE_MW,
            }
    }
    fn start(&self, spec: MnSpec) -> Box<dyn Testbed> {
        let c = Cluster::new(self.config(spec)).expect("loopback cluster");
        Box::new(LoopbackBed { c, spec, caps: self.caps() })
    }
}

/// Starts loopback clusters in one [`Mode`] whose CNs each connect with `chains` alloc chains
/// (`ClusterConfig::alloc_chains`): every scenario must hold when a CN's allocations may
/// overlap across its chains.
#[derive(Clone, Copy, Debug)]
pub struct LoopbackChains {
    pub mode: Mode,
    pub chains: u8,
}

impl Factory for LoopbackChains {
    fn name(&self) -> String {
        format!("loopback {:?} with {} alloc chains per CN", self.mode, self.chains)
    }
    fn caps(&self) -> Caps {
        Loopback(self.mode).caps()
    }
    fn start(&self, spec: MnSpec) -> Box<dyn Testbed> {
        let mut cfg = Loopback(self.mode).config(spec);
        cfg.alloc_chains = self.chains;
        if self.mode == Mode::OffloadedPopAhead && spec.chunks as usize <= spec.cns * self.chains as usize {
            // Popping ahead, every chain withholds a group: with at least as many chains as
            // groups some CN is starved by design (its chains parked while others hold every
            // group ahead), which is why the MN pops ahead only where the pool has 8 groups per
            // chain (`MnConfig::pop_ahead_pays`). The one-chain run forces it on pools of one
            // group more than chains; here too, and the smaller pools run without it.
            cfg.pop_ahead = Some(false);
        }
        let c = Cluster::new(cfg).expect("loopback cluster");
        Box::new(LoopbackBed { c, spec, caps: self.caps() })
    }
}

/// A running loopback cluster.
pub struct LoopbackBed {
    pub c: Cluster,
    spec: MnSpec,
    caps: Caps,
}

fn refusal(e: CnOpError) -> Refusal {
    match e {
        CnOpError::Mn(c) => Refusal::Mn(c),
        CnOpError::Client(e) => Refusal::Client(e.to_string()),
        CnOpError::NoReply => Refusal::NoReply,
        e => Refusal::Transport(e.to_string()),
    }
}

impl Testbed for LoopbackBed {
    fn caps(&self) -> Caps {
        self.caps
    }
    fn mode(&self) -> ExecutionMode {
        self.c.mode
    }
    fn spec(&self) -> MnSpec {
        self.spec
    }
    fn chunk_size(&self) -> u64 {
        self.c.cfg.chunk_size
    }
    fn alloc(&mut self, cn: usize) -> Result<Allocation, Refusal> {
        self.c.alloc(cn).map_err(refusal)
    }
    fn free(&mut self, cn: usize, a: &Allocation) -> Result<(), Refusal> {
        self.c.free(cn, a).map_err(refusal)
    }
    fn free_entry(&mut self, cn: usize, entry_addr: u64) -> Result<(), Refusal> {
        self.c.free_raw(cn, entry_addr).map_err(refusal)
    }
    fn write_raw(&mut self, cn: usize, window: usize, addr: u64, rkey: Rkey, data: &[u8]) -> WcStatus {
        self.c.write_raw(cn, window, addr, rkey, data)
    }
    fn read_raw(&mut self, cn: usize, window: usize, addr: u64, rkey: Rkey, len: usize) -> (WcStatus, Vec<u8>) {
        self.c.read_raw(cn, window, addr, rkey, len)
    }
    fn cn_post(&mut self, cn: usize, qp: CnQp, w: Wqe) -> WcStatus {
        let qp = match qp {
            CnQp::Alloc => omw_loopback::cluster::CnQp::Alloc,
            CnQp::Free => omw_loopback::cluster::CnQp::Free,
            CnQp::Access(k) => omw_loopback::cluster::CnQp::Access(k),
        };
        self.c.cn_post(cn, qp, w)
    }
    fn live(&mut self, cn: usize) -> Vec<Allocation> {
        self.c.cns[cn].client().live().to_vec()
    }
    fn send_raw(&mut self, cn: usize, kind: ChainKind, bytes: &[u8]) {
        self.c.send_raw(cn, kind, bytes).expect("the cluster runs");
    }
    fn alloc_naming(&mut self, cn: usize, qpns: &[Qpn]) -> Result<Allocation, Refusal> {
        self.c.alloc_naming(cn, qpns).map_err(refusal)
    }
    fn access_qpns(&self, cn: usize) -> Vec<Qpn> {
        self.c.cns[cn].mn_qps.access.iter().copied().collect()
    }
    fn mgmt_qpns(&self, cn: usize) -> [Qpn; 2] {
        [self.c.cns[cn].mn_qps.alloc, self.c.cns[cn].mn_qps.free]
    }
    fn windows_on_alloc_qp(&self, cn: usize) -> bool {
        let info = self.c.cns[cn].driver.client().info();
        info.is_some_and(|i| i.flags.contains(omw_core::wire::message::ConnectFlags::WINDOWS_ON_ALLOC_QP))
    }
    fn alloc_begin(&mut self, cn: usize) -> Result<u32, Refusal> {
        self.c.alloc_begin(cn).map_err(refusal)
    }
    fn free_begin(&mut self, cn: usize, a: &Allocation) -> Result<(), Refusal> {
        self.c.free_begin(cn, a).map_err(refusal)
    }
    fn alloc_finish(&mut self, cn: usize, token: u32) -> Result<Allocation, Refusal> {
        self.c.alloc_finish(cn, token).map_err(refusal)
    }
    fn crash(&mut self, cn: usize) {
        self.c.crash_cn(cn).expect("crash");
    }
    fn vanish(&mut self, cn: usize) {
        self.c.vanish_cn(cn).expect("vanish");
    }
    fn stall(&mut self, cn: usize) {
        self.c.stall_cn(cn);
    }
    fn alloc_unread(&mut self, cn: usize) {
        if let Ok(token) = self.c.alloc_begin(cn) {
            // it never reads the reply: let it ask again
            self.c.cns[cn].driver.abandon_alloc(token);
        }
    }
    fn is_served(&mut self, cn: usize) -> bool {
        self.c.is_served(cn)
    }
    fn tick(&mut self) {
        self.c.tick().expect("tick");
    }
    fn audit(&mut self) {
        self.c.sample_counters().expect("counter sample");
        self.c.tick().expect("tick");
    }
    fn advance(&mut self, ns: u64) {
        self.c.advance(ns).expect("advance");
    }
    fn now(&self) -> u64 {
        self.c.now()
    }
    fn reset_mn_rnic(&mut self) {
        self.c.reset_mn_rnic().expect("RNIC reset");
    }
    fn nic_steps(&mut self, n: u64) {
        for _ in 0..n {
            self.c.fabric.borrow_mut().step();
        }
    }
    fn set_interleaving(&mut self, seed: u64, per_mille: u16) {
        self.c.set_interleaving(seed, per_mille);
    }
    fn drop_next(&mut self, cn: usize, n: u32) {
        let qp = self.c.cns[cn].alloc_qp;
        self.c.fabric.borrow_mut().faults_mut().drop_next(MessageFilter::from_qp(qp), n);
    }
    fn delay_next(&mut self, cn: usize, ns: u64) {
        let qp = self.c.cns[cn].alloc_qp;
        self.c.fabric.borrow_mut().faults_mut().delay_next(MessageFilter::from_qp(qp), ns, 1);
    }
    fn corrupt_next(&mut self, cn: usize, bytes: usize) {
        let qp = self.c.cns[cn].alloc_qp;
        self.c.fabric.borrow_mut().faults_mut().corrupt_sends(qp, bytes as u32);
    }
    fn check_invariants(&mut self) -> Result<(), String> {
        self.c.check_invariants()
    }
    fn free_groups(&mut self) -> u32 {
        self.c.free_groups()
    }
    fn ahead(&mut self) -> u32 {
        self.c.driver.groups_ahead()
    }
    fn ahead_of(&mut self, cn: usize) -> bool {
        self.c.driver.groups_ahead_of(self.c.cns[cn].id) > 0
    }
    fn ahead_count(&mut self, cn: usize) -> u32 {
        self.c.driver.groups_ahead_of(self.c.cns[cn].id)
    }
    fn alloc_chains(&self) -> u8 {
        self.c.cfg.alloc_chains
    }
    fn stats(&mut self) -> MnStats {
        self.c.driver.mn.stats()
    }
    fn lease_ns(&mut self) -> u64 {
        self.c.driver.mn.config().lease_ns
    }
    fn entry(&mut self, g: GroupId) -> Option<MwTableEntry> {
        self.c.driver.entry(g)
    }
    fn group_of(&mut self, a: &Allocation) -> Option<GroupId> {
        self.c.group_of(a)
    }
    fn forged_frees_of(&mut self, cn: usize) -> u64 {
        self.c.driver.mn.cn(self.c.cns[cn].id).map_or(0, |r| r.forged_frees as u64)
    }
    fn cn_id(&self, cn: usize) -> CnId {
        self.c.cns[cn].id
    }
    fn is_empty_state(&mut self) -> bool {
        self.c.driver.mn.is_empty_state()
    }
    fn heard(&mut self, cn: usize) -> Vec<Heard> {
        self.c.cns[cn]
            .events
            .iter()
            .filter_map(|e| match e {
                ClientEvent::Empty => Some(Heard::Empty),
                ClientEvent::Available => Some(Heard::Available),
                ClientEvent::Failed { code, .. } => Some(Heard::Failed(*code)),
                ClientEvent::Revoked => Some(Heard::Revoked),
                ClientEvent::Rekeyed { entry_addr, mw, rkey } => {
                    Some(Heard::Rekeyed { entry_addr: *entry_addr, mw: *mw, rkey: *rkey })
                }
                _ => None,
            })
            .collect()
    }
    fn received(&mut self, cn: usize) -> Vec<Vec<u8>> {
        self.c.cns[cn].received.clone()
    }
    fn mw_binding(&mut self, rkey: Rkey) -> Option<MwBinding> {
        self.c.mw_binding(rkey)
    }
    fn mn_mrs(&mut self) -> Vec<MnMr> {
        let private = self.c.driver.backend.private_pd;
        let mrs = self.c.fabric.borrow().mrs_of(self.c.mn_host).expect("MN MRs");
        mrs.iter().map(|m| MnMr::new(m.addr, m.len, m.key, m.access, Some(m.pd) == private)).collect()
    }
    fn mn_read(&mut self, addr: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.c.fabric.borrow().read(self.c.mn_host, addr, &mut b).expect("MN memory");
        b
    }
    fn mn_write(&mut self, addr: u64, data: &[u8]) {
        self.c.fabric.borrow_mut().write(self.c.mn_host, addr, data).expect("MN memory");
    }
    fn mn_map(&mut self) -> MnMemoryMap {
        *self.c.driver.mn.map()
    }
    fn activity(&mut self) -> Activity {
        let f = self.c.fabric.borrow();
        let cpu = f.host_stats(self.c.mn_host).map(|s| s.cpu_events).unwrap_or(0);
        // every WQE any MN QP executed: the loop QPs of every CN and the MN's own
        let mut nic = 0;
        for n in &self.c.cns {
            let extra = n.mn_extra.iter().filter_map(|x| x.lp);
            for q in [n.mn_qps.alloc_loop, n.mn_qps.free_loop].into_iter().flatten().chain(extra) {
                nic += f.qp_stats(QpAddr::new(self.c.mn_host, q)).map(|s| s.wqes_executed).unwrap_or(0);
            }
        }
        Activity { cpu_events: self.c.mn_cpu_events, cpu_accesses: cpu, nic_wqes: nic }
    }
}

/// The loopback model as an [`MwDevice`]: an MN host with the pool, a CN host with the
/// requester's buffer, a fresh connected pair per [`MwDevice::pair`].
pub struct LoopbackMw(pub Conformance);

impl MwFactory for LoopbackMw {
    fn name(&self) -> String {
        format!("loopback NIC {:?}", self.0)
    }
    fn caps(&self) -> Caps {
        match self.0 {
            Conformance::Strict => Caps::STRICT_MW,
            Conformance::RxeCompatible => Caps::RXE_MW,
        }
    }
    fn start(&self) -> Box<dyn MwDevice> {
        let mut f = Fabric::new(NicConfig::strict().with_conformance(self.0));
        let mn = f.add_host("mn").expect("host");
        let cn = f.add_host("cn").expect("host");
        let (pool, pk) =
            f.alloc_mr(mn, PdId(0), POOL_LEN, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).expect("pool");
        let (buf, bk) = f.alloc_mr(cn, PdId(0), BUF_LEN, 64, AccessFlags::LOCAL_WRITE).expect("buffer");
        f.write(mn, pool, &vec![b'o'; POOL_LEN as usize]).expect("fill");
        Box::new(LoopMw { f, mn, cn, pool: (pool, pk.lkey, pk.rkey), buf: (buf, bk.lkey), caps: self.caps() })
    }
}

struct LoopMw {
    f: Fabric,
    mn: HostId,
    cn: HostId,
    pool: (u64, u32, u32),
    buf: (u64, u32),
    caps: Caps,
}

impl LoopMw {
    fn at(&self, side: Side, qp: Qpn) -> QpAddr {
        QpAddr::new(if side == Side::Mn { self.mn } else { self.cn }, qp)
    }
    fn host(&self, side: Side) -> HostId {
        if side == Side::Mn {
            self.mn
        } else {
            self.cn
        }
    }
    fn wait(&mut self, q: QpAddr, sel: QueueSel, wr_id: Option<u64>) -> Option<Completion> {
        let mut out = [Completion::EMPTY; 8];
        for _ in 0..64 {
            let n = self.f.poll_cq(q, sel, &mut out).ok()?;
            if let Some(c) = out[..n].iter().find(|c| wr_id.is_none_or(|w| c.wr_id == w)) {
                return Some(*c);
            }
            if n == 0 {
                // a pending timer (retry, RNR) fires only when modelled time passes
                let t = self.f.now() + 1_000_000;
                self.f.advance_to(t);
            }
        }
        None
    }
}

impl MwDevice for LoopMw {
    fn caps(&self) -> Caps {
        self.caps
    }
    fn pair(&mut self) -> (Qpn, Qpn) {
        let (c, m) =
            self.f.create_connected_pair(self.cn, QpConfig::default(), self.mn, QpConfig::default()).expect("pair");
        (m.qpn, c.qpn)
    }
    fn alloc_mw(&mut self) -> Rkey {
        self.f.alloc_mw(self.mn, PdId(0)).expect("alloc_mw")
    }
    fn pool(&self) -> (u64, u32, u32) {
        self.pool
    }
    fn buf(&self) -> (u64, u32) {
        self.buf
    }
    fn post(&mut self, side: Side, qp: Qpn, w: &Wqe) -> Option<Completion> {
        let q = self.at(side, qp);
        let w = w.with_flags(w.flags | omw_core::wire::wqe::WqeFlags::SIGNALED);
        self.f.post_send(q, &w).ok()?;
        self.wait(q, QueueSel::Send, Some(w.wr_id))
    }
    fn post_recv(&mut self, side: Side, qp: Qpn, r: &RecvWqe) {
        let q = self.at(side, qp);
        self.f.post_recv(q, r).expect("post_recv");
    }
    fn wait_recv(&mut self, side: Side, qp: Qpn) -> Option<Completion> {
        let q = self.at(side, qp);
        self.wait(q, QueueSel::Recv, None)
    }
    fn state(&mut self, side: Side, qp: Qpn) -> QpState {
        let q = self.at(side, qp);
        self.f.qp_state(q).expect("qp_state")
    }
    fn read_local(&mut self, side: Side, addr: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.f.read(self.host(side), addr, &mut b).expect("read");
        b
    }
    fn write_local(&mut self, side: Side, addr: u64, data: &[u8]) {
        let h = self.host(side);
        self.f.write(h, addr, data).expect("write");
    }
    fn binding(&mut self, rkey: Rkey) -> Option<MwBinding> {
        let mn = self.mn;
        self.f.view(mn).mw_binding(rkey)
    }
}
