//! The conformance testbed on `DevxBackend` over the ConnectX double: the MN comes up through
//! the core's `MnPlan::provision` on `DevxBackend<CxDouble>` and is driven by `MnDriver`; its
//! CN-facing QPs are DEVX QPs connected with rdma_cm-style attributes (`connect_cn_qp`). The
//! CNs are the loopback model's own hosts on the same fabric, each with the core's `CnDriver`
//! over the model's `NodeBackend` (canonical WQEs: the device under test is the MN's; a CN's
//! NIC only needs to be an RC peer). The pump is the core's deployment harness.
#![allow(dead_code)]

use omw_core::access::AccessFlags;
use omw_core::chain::ChainKind;
use omw_core::cn::driver::{CnDriver, CnEvent, CnMemory, CnQp as DQp, CnQpSet, OpId, RECVS_PER_QP};
use omw_core::cn::Allocation;
use omw_core::device::behaviour::DeviceBehaviour;
use omw_core::device::{Capabilities, DataPath, Domain, ExecutionMode, MwBinding, Provision, QpState, WcStatus};
use omw_core::ids::{CnId, GroupId, Qpn, Rkey};
use omw_core::mn::driver::MnDriver;
use omw_core::mn::plan::{MnOptions, MnPlan};
use omw_core::mn::provision::PoolSpec;
use omw_core::mn::{CnQps, Event, MnStats};
use omw_core::testing::deployment::{self, CnSide, Deployment, Life};
use omw_core::testing::hostile::HostileCn;
use omw_core::wire::memory_map::MnMemoryMap;
use omw_core::wire::mwtable::MwTableEntry;
use omw_core::wire::wqe::{QueueSel, Wqe};
use omw_cx_double::{gid_of, mac_of, CxCaps, CxDouble};
use omw_loopback::cluster::{NodeBackend, CN_MAX_LIVE};
use omw_loopback::fault::MessageFilter;
use omw_loopback::{Fabric, HostId, LoopbackError, MwState, QpAddr, QpConfig, Transition};
use omw_tests::testbed::{Activity, Caps, CnQp, Factory, Heard, MnMr, MnSpec, Refusal, Testbed};
use omw_verbs::devx::backend::{DevxBackend, DevxConfig};
use omw_verbs::devx::cm::{CmQpAttr, LocalPath};
use std::cell::RefCell;
use std::rc::Rc;

type Mn = DevxBackend<CxDouble>;

/// The capabilities a DEVX MN on this device presents to its plan: what the verbs MW probe
/// finds on a strict device, and what the DEVX gate adds (`devx::mn::DEVX_OFFLOAD`).
fn mn_capabilities() -> Capabilities {
    Capabilities::MW_TYPE2
        | Capabilities::SEND_WITH_INV
        | Capabilities::MW_QP_BINDING_ENFORCED
        | Capabilities::MW_QP_CHECK_ON_INVALIDATE
        | Capabilities::MW_BOUNDS_ENFORCED
        | omw_verbs::devx::mn::DEVX_OFFLOAD
}

/// The fabric as the deployment harness drives it (the model's clock; the MN CPU's cost as the
/// loopback cluster charges it).
pub struct World {
    pub f: Rc<RefCell<Fabric>>,
    pub mn_host: HostId,
}

impl deployment::Fabric for World {
    type Error = LoopbackError;
    fn now(&self) -> u64 {
        self.f.borrow().now()
    }
    fn run(&mut self) -> Result<u64, LoopbackError> {
        Ok(self.f.borrow_mut().run_until_idle(10_000_000))
    }
    fn interleaves(&self) -> bool {
        false
    }
    fn step(&mut self) -> Result<bool, LoopbackError> {
        Ok(self.f.borrow_mut().step().is_some())
    }
    fn mn_acts_now(&mut self) -> bool {
        false
    }
    fn advance_to(&mut self, t: u64) -> Result<(), LoopbackError> {
        let mut f = self.f.borrow_mut();
        f.run_until(t, 10_000_000);
        f.advance_to(t);
        Ok(())
    }
    fn charge_mn_cpu(&mut self, events: u64, steps: u64) -> Result<(), LoopbackError> {
        let mut f = self.f.borrow_mut();
        let step_ns = f.config().cost.host_engine_step_ns;
        for _ in 1..events {
            f.count_cpu_event(self.mn_host)?;
        }
        f.advance_cpu(self.mn_host, (events + steps) * step_ns)?;
        Ok(())
    }
    fn count_mn_events(&mut self, n: u64) -> Result<(), LoopbackError> {
        let mut f = self.f.borrow_mut();
        for _ in 0..n {
            f.count_cpu_event(self.mn_host)?;
        }
        Ok(())
    }
}

/// A CN: a host of the fabric, the core's driver on it, the MN ends of its QPs.
pub struct Cn {
    pub host: HostId,
    pub driver: CnDriver<NodeBackend, CN_MAX_LIVE>,
    /// CN ends: alloc, free, access…
    pub cq: Vec<QpAddr>,
    /// MN ends: alloc, free, access…
    pub mq: Vec<Qpn>,
    pub loops: Option<(Qpn, Qpn)>,
    pub mn_id: CnId,
    pub heard: Vec<Heard>,
    pub received: Vec<Vec<u8>>,
    pub crashed: bool,
    pub silent: bool,
    pub stalled: bool,
    pub answers: Vec<(u32, Result<Allocation, Refusal>)>,
}

impl CnSide for Cn {
    type Error = omw_core::cn::driver::CnError<LoopbackError>;
    fn life(&self) -> Life {
        match (self.crashed, self.silent, self.stalled) {
            (true, true, _) => Life::Vanished,
            (true, false, _) => Life::Crashed,
            (false, _, true) => Life::Stalled,
            _ => Life::Running,
        }
    }
    fn mn_id(&self) -> CnId {
        self.mn_id
    }
    fn set_mn_id(&mut self, id: CnId) {
        self.mn_id = id;
    }
    fn learnt_id(&self) -> Option<CnId> {
        self.driver.id()
    }
    fn service<M: DataPath>(&mut self, now: u64, mn: &mut M) -> Result<bool, Self::Error> {
        self.driver.poll(now)?;
        let mut moved = false;
        while let Some(ev) = self.driver.next_event() {
            moved = true;
            match ev {
                CnEvent::Delivered { bytes, .. } => self.received.push(bytes.to_vec()),
                CnEvent::Allocated { token, result } => {
                    self.answers.push((token, result.map_err(|e| Refusal::Client(e.to_string()))))
                }
                CnEvent::Refused { token, code, ours } => {
                    if ours {
                        self.answers.push((token, Err(Refusal::Mn(code))));
                    }
                    self.heard.push(Heard::Failed(code));
                }
                CnEvent::Empty => self.heard.push(Heard::Empty),
                CnEvent::Available => self.heard.push(Heard::Available),
                CnEvent::Revoked => self.heard.push(Heard::Revoked),
                CnEvent::Rekeyed { entry_addr, mw, rkey } => self.heard.push(Heard::Rekeyed { entry_addr, mw, rkey }),
                _ => {}
            }
        }
        Ok(reconnect(self, mn) | moved)
    }
    fn poll_timeout(&self) -> Option<u64> {
        self.driver.poll_timeout()
    }
    fn handle_timeout(&mut self, now: u64) {
        self.driver.handle_timeout(now)
    }
}

/// A CN whose QP a failed request or access broke reconnects it: its end is reset; the MN end
/// of an access QP is reset by the MN's connection manager (the DEVX transport would accept a
/// new connection), that of a chain QP is the MN's to repair (its poll sees the chain fail).
fn reconnect<M: DataPath>(c: &mut Cn, mn: &mut M) -> bool {
    let mut moved = false;
    for (k, q) in c.cq.clone().into_iter().enumerate() {
        if c.driver.backend.qp_state(q.qpn).ok() != Some(QpState::Rts) {
            let _ = c.driver.backend.reset_qp(q.qpn);
            moved = true;
            if k >= 2 {
                let _ = mn.reset_qp(c.mq[k]);
            }
        }
    }
    moved
}

/// An MN on `DevxBackend` over the double and its CNs.
pub struct Bed {
    pub world: World,
    pub d: MnDriver<Mn>,
    pub cns: Vec<Cn>,
    pub spec: MnSpec,
    pub mn_cpu_events: u64,
}

const G_CAPS: Caps = Caps::OFFLOAD
    .union(Caps::TIME_CONTROL)
    .union(Caps::RNIC_RESET)
    .union(Caps::CRASH)
    .union(Caps::VANISH)
    .union(Caps::STALL)
    .union(Caps::WINDOW_STATE)
    .union(Caps::MN_KEYS)
    .union(Caps::MN_MEMORY)
    .union(Caps::STRICT_MW)
    .union(Caps::HOSTILE_QPS)
    .union(Caps::CN_MESSAGES)
    .union(Caps::FAULTS)
    .union(Caps::NIC_STEPS)
    .union(Caps::MN_ACTIVITY)
    .union(Caps::NAMED_QPS)
    .union(Caps::CONTENTION)
    .union(Caps::RAW_REQUESTS)
    .union(Caps::REVIVE)
    .union(Caps::WINDOW_SPANS)
    .union(Caps::SEND_WITH_INV);

/// Starts MNs on `DevxBackend` over a double answering the open questions as `behaviour`.
#[derive(Clone, Copy, Debug)]
pub struct OnDouble {
    pub behaviour: DeviceBehaviour,
}

impl Factory for OnDouble {
    fn name(&self) -> String {
        format!("DevxBackend on the ConnectX double ({})", omw_tests::matrix::label(&self.behaviour))
    }
    fn caps(&self) -> Caps {
        G_CAPS
    }
    fn start(&self, spec: MnSpec) -> Box<dyn Testbed> {
        Box::new(Bed::new(spec, self.behaviour))
    }
}

impl Bed {
    pub fn new(spec: MnSpec, behaviour: DeviceBehaviour) -> Bed {
        let mut fabric = CxDouble::fabric(behaviour);
        let mn_host = fabric.add_host("mn").expect("host");
        let f = Rc::new(RefCell::new(fabric));
        let mut dev = CxDouble::new(f.clone(), mn_host, CxCaps::CONNECTX).expect("the double");
        let hca = omw_verbs::devx::caps::query(&mut dev).expect("QUERY_HCA_CAP");
        let mut cfg = DevxConfig::new(mn_capabilities());
        cfg.log_cqes = 10;
        cfg.ring_arena_bytes = DevxConfig::arena_for(spec.cns as u32, spec.group_size, &cfg);
        let backend = DevxBackend::new(dev, hca, cfg).expect("DevxBackend on the double");
        let opts = MnOptions { scrub: spec.scrub, ..MnOptions::default() };
        let plan = MnPlan::decide(backend.capabilities(), opts).expect("the plan");
        assert_eq!(plan.mode, ExecutionMode::Offloaded);
        let pool = PoolSpec {
            chunk_size: spec.chunk_size.unwrap_or(4096),
            chunks: spec.chunks,
            group_size: spec.group_size,
            max_cns: spec.cns.max(1) as u32,
            quota: spec.quota,
            lease_ns: omw_core::mn::DEFAULT_LEASE_NS,
            queue_depth: None,
        };
        let mut d = plan.provision(backend, &pool).expect("MnPlan::provision on DevxBackend");
        // the chains laid out for the double's answers, as `omw mn --offload mlx5 --profile`
        // does from a bring-up profile (`DevxTransport::provisioned`); where no layout is
        // correct the preferred one runs, and the matrix shows what breaks
        let answers = omw_core::device::behaviour::DeviceAnswers::exactly(behaviour);
        let variant = omw_core::chain::variant::ChainVariant::choose(&answers).unwrap_or_default();
        assert!(d.set_chain_variant(variant).expect("proof words registered"), "no CN yet");
        let mut b = Bed { world: World { f, mn_host }, d, cns: Vec::new(), spec, mn_cpu_events: 0 };
        for i in 0..spec.cns {
            b.connect_cn(i);
        }
        b
    }

    fn fabric(&self) -> std::cell::RefMut<'_, Fabric> {
        self.world.f.borrow_mut()
    }

    fn connect_cn(&mut self, i: usize) {
        let (alloc_loop, free_loop) = self.d.create_loop_qps().expect("loop QPs").expect("offloaded");
        let depths = self.d.mn.chain_ring_depths().expect("ring depths");
        let host = self.fabric().add_host(&format!("cn{i}")).expect("CN host");
        let g = self.spec.group_size as usize;
        let mut mq = Vec::new();
        let mut cq = Vec::new();
        // the Alloc and Free QPs hold the chains' management rings, then G - 1 access QPs
        let managed = [Some(depths[0][1] as u32), Some(depths[1][1] as u32)];
        for k in 0..g + 1 {
            let managed = managed.get(k).copied().flatten();
            let m = self.d.backend.create_cn_qp(managed).expect("a CN-facing DEVX QP");
            let cfg = QpConfig::default().with_depths(64, 2 * RECVS_PER_QP as u32);
            let c = self.fabric().create_qp(host, cfg).expect("the CN's QP");
            // the MN end as rdma_cm's external-QP mode connects it; the CN end likewise
            let path = LocalPath { port: 1, gid_index: 3, gid: gid_of(host), mac: mac_of(host), mtu: 3 };
            let attr = CmQpAttr { qp_access_flags: 0x6, rnr_retry: 7, ..CmQpAttr::to_self(&path, c.get()) };
            self.d.backend.connect_cn_qp(m, &attr, mac_of(host)).expect("connecting the MN end");
            let ca = QpAddr::new(host, c);
            let mn_end = QpAddr::new(self.world.mn_host, m);
            let mut f = self.fabric();
            f.modify_qp(ca, Transition::Rtr { peer: mn_end }).expect("CN end to RTR");
            f.modify_qp(ca, Transition::Rts).expect("CN end to RTS");
            drop(f);
            mq.push(m);
            cq.push(ca);
        }
        let mut backend = NodeBackend::cn(self.world.f.clone(), host);
        let reply = backend.alloc_memory(CnMemory::REPLY_LEN, 64).expect("reply buffer");
        let rk = backend
            .reg_mr(Domain::CnFacing, reply, CnMemory::REPLY_LEN, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .expect("reply MR");
        let chunk = self.spec.chunk_size.unwrap_or(4096).max(4096);
        let local_len = CnMemory::local_len_for(omw_core::cn::driver::IO_SLOTS, chunk);
        let local = backend.alloc_memory(local_len, 64).expect("local buffer");
        let lk = backend.reg_mr(Domain::CnFacing, local, local_len, AccessFlags::LOCAL_WRITE).expect("local MR");
        let mem = CnMemory { local, local_len, lkey: lk.lkey, reply, reply_rkey: rk.rkey };
        let qps = CnQpSet { alloc: cq[0].qpn, free: cq[1].qpn, access: cq[2..].iter().map(|q| q.qpn).collect() };
        let mut driver = CnDriver::new(backend, qps, mem).expect("the CN driver");
        driver.record_deliveries(true);
        self.cns.push(Cn {
            host,
            driver,
            cq,
            mq: mq.clone(),
            loops: Some((alloc_loop, free_loop)),
            mn_id: CnId::UNASSIGNED,
            heard: Vec::new(),
            received: Vec::new(),
            crashed: false,
            silent: false,
            stalled: false,
            answers: Vec::new(),
        });
        let qps = CnQps {
            alloc: mq[0],
            free: mq[1],
            access: mq[2..].iter().copied().collect(),
            alloc_loop: Some(alloc_loop),
            free_loop: Some(free_loop),
        };
        match Deployment::new(&mut self.world, &mut self.d, &mut self.cns).connect(i, qps, None) {
            Ok((_, act)) => self.mn_cpu_events += act.cpu_events,
            Err(e) => panic!("connecting cn{i}: {e}"),
        }
    }

    pub fn pump(&mut self) {
        match Deployment::new(&mut self.world, &mut self.d, &mut self.cns).pump() {
            Ok(act) => self.mn_cpu_events += act.cpu_events,
            Err(e) => panic!("pumping the MN on the double: {e}"),
        }
    }

    fn now_ns(&self) -> u64 {
        self.world.f.borrow().now()
    }

    fn answer(&mut self, i: usize, token: u32) -> Option<Result<Allocation, Refusal>> {
        let c = &mut self.cns[i];
        let pos = c.answers.iter().position(|(t, _)| *t == token)?;
        Some(c.answers.remove(pos).1)
    }

    fn alloc_wait(&mut self, i: usize, token: u32) -> Result<Allocation, Refusal> {
        self.pump();
        self.answer(i, token).unwrap_or_else(|| {
            self.cns[i].driver.client_mut().abandon_pending();
            Err(Refusal::NoReply)
        })
    }

    fn free_wait(&mut self, i: usize, token: u32) -> Result<(), Refusal> {
        self.pump();
        match self.answer(i, token) {
            Some(Err(e)) => Err(e),
            _ => Ok(()),
        }
    }

    /// An access through CN `i`'s windows, once more if it failed for the transport where the
    /// windows live on its Alloc QP (`ConnectFlags::WINDOWS_ON_ALLOC_QP`): the MN resets its
    /// end of that QP whenever it stops the CN's alloc chain (a repair, a take-back), and a
    /// DEVX reset starts the MN end's PSNs again, so the CN's next access on it finds no
    /// responder and its end breaks — then it reconnects (`wait_op`) and asks again, as a CN
    /// library must. An access refused by the MN's windows (`RemAccessErr`) is not repeated.
    fn with_alloc_qp_retry(
        &mut self,
        i: usize,
        mut access: impl FnMut(&mut Self) -> (WcStatus, Vec<u8>),
    ) -> (WcStatus, Vec<u8>) {
        let r = access(self);
        let transport = matches!(r.0, WcStatus::RetryExcErr | WcStatus::WrFlushErr);
        if transport && self.windows_on_alloc_qp(i) {
            return access(self);
        }
        r
    }

    /// Run until access `op` of CN `i` completed (the CN spinning on its send CQ); a failed one
    /// brings the pair back (the CN reconnecting), then everything runs.
    fn wait_op(&mut self, i: usize, op: OpId, qp: DQp, len: usize) -> (WcStatus, Vec<u8>) {
        let mut out = vec![0u8; len.max(8).max(self.cns[i].driver.io_slot_len())];
        let mut done = None;
        let on = self.cns[i].driver.op_qpn(op).map(|q| QpAddr::new(self.cns[i].host, q));
        for _ in 0..8 {
            if let Some(q) = on {
                let _ = self.fabric().spin_on(q, QueueSel::Send);
            }
            let now = self.now_ns();
            let c = &mut self.cns[i];
            let polled = if c.stalled { c.driver.poll_sends_only() } else { c.driver.poll(now) };
            if polled.is_err() {
                break;
            }
            if let Ok(Some(d)) = c.driver.access_done(op, &mut out) {
                done = Some(d);
                break;
            }
        }
        let _ = qp;
        let Some(d) = done else { return (WcStatus::GeneralErr, Vec::new()) };
        if !d.status.is_ok() {
            let mn = &mut self.d.backend;
            reconnect(&mut self.cns[i], mn);
            // Windows on the Alloc QP (`ConnectFlags::WINDOWS_ON_ALLOC_QP`): the failed access
            // broke the MN end too (a responder's access error is fatal to its QP), and a
            // managed send queue with nothing enabled may flush nothing the MN would poll. The
            // CN reconnecting its Alloc QP is how the MN learns: its chain failed.
            let alloc_qp = self.cns[i].driver.qps().get(DQp::Alloc);
            if self.windows_on_alloc_qp(i) && on.map(|q| q.qpn) == alloc_qp {
                let (cn, now) = (self.cns[i].mn_id, self.now_ns());
                let failure = omw_core::mn::host_engine::LapFailure::Status(WcStatus::WrFlushErr);
                let event = omw_core::mn::Event::ChainFailed {
                    cn,
                    kind: omw_core::chain::ChainKind::Alloc,
                    chain: 0,
                    step: None,
                    failure,
                };
                self.d.handle(now, event).unwrap_or_else(|e| panic!("the MN on a CN's reconnect: {e}"));
            }
        }
        self.pump();
        out.truncate(len.min(d.len));
        (d.status, if d.status == WcStatus::Success { out } else { Vec::new() })
    }
}

fn refusal<E: std::fmt::Display>(e: E) -> Refusal {
    Refusal::Client(e.to_string())
}

impl Testbed for Bed {
    fn caps(&self) -> Caps {
        G_CAPS
    }
    fn mode(&self) -> ExecutionMode {
        self.d.mn.mode()
    }
    fn spec(&self) -> MnSpec {
        self.spec
    }
    fn chunk_size(&self) -> u64 {
        self.d.mn.map().geometry.chunk_size()
    }
    fn alloc(&mut self, cn: usize) -> Result<Allocation, Refusal> {
        let t = self.alloc_begin(cn)?;
        self.alloc_finish(cn, t)
    }
    fn free(&mut self, cn: usize, a: &Allocation) -> Result<(), Refusal> {
        let t = self.cns[cn].driver.free(a).map_err(refusal)?;
        self.free_wait(cn, t)
    }
    fn free_entry(&mut self, cn: usize, entry_addr: u64) -> Result<(), Refusal> {
        let t = self.cns[cn].driver.free_entry(entry_addr).map_err(refusal)?;
        self.free_wait(cn, t)
    }
    fn write_raw(&mut self, cn: usize, window: usize, addr: u64, rkey: Rkey, data: &[u8]) -> WcStatus {
        self.with_alloc_qp_retry(cn, |b| match b.cns[cn].driver.post_write(window, addr, rkey, data) {
            Ok(op) => b.wait_op(cn, op, DQp::Access(window), 0),
            Err(_) => (WcStatus::LocQpOpErr, Vec::new()),
        })
        .0
    }
    fn read_raw(&mut self, cn: usize, window: usize, addr: u64, rkey: Rkey, len: usize) -> (WcStatus, Vec<u8>) {
        self.with_alloc_qp_retry(cn, |b| match b.cns[cn].driver.post_read(window, addr, rkey, len) {
            Ok(op) => b.wait_op(cn, op, DQp::Access(window), len),
            Err(_) => (WcStatus::LocQpOpErr, Vec::new()),
        })
    }
    fn cn_post(&mut self, cn: usize, qp: CnQp, w: Wqe) -> WcStatus {
        let qp = match qp {
            CnQp::Alloc => DQp::Alloc,
            CnQp::Free => DQp::Free,
            CnQp::Access(k) => DQp::Access(k),
        };
        match self.cns[cn].driver.post_wqe(qp, w) {
            Ok(op) => self.wait_op(cn, op, qp, 8).0,
            Err(_) => WcStatus::LocQpOpErr,
        }
    }
    fn live(&mut self, cn: usize) -> Vec<Allocation> {
        self.cns[cn].driver.client().live().to_vec()
    }
    fn send_raw(&mut self, cn: usize, kind: ChainKind, bytes: &[u8]) {
        let qp = if kind == ChainKind::Alloc { DQp::Alloc } else { DQp::Free };
        let _ = self.cns[cn].driver.send_raw(qp, bytes);
        self.pump();
    }
    fn alloc_naming(&mut self, cn: usize, qpns: &[Qpn]) -> Result<Allocation, Refusal> {
        let now = self.now_ns();
        let t = self.cns[cn].driver.alloc_naming(now, qpns).map_err(refusal)?;
        self.alloc_wait(cn, t)
    }
    fn access_qpns(&self, cn: usize) -> Vec<Qpn> {
        self.cns[cn].mq[2..].to_vec()
    }
    fn windows_on_alloc_qp(&self, cn: usize) -> bool {
        let info = self.cns[cn].driver.client().info();
        info.is_some_and(|i| i.flags.contains(omw_core::wire::message::ConnectFlags::WINDOWS_ON_ALLOC_QP))
    }
    fn mgmt_qpns(&self, cn: usize) -> [Qpn; 2] {
        [self.cns[cn].mq[0], self.cns[cn].mq[1]]
    }
    fn alloc_begin(&mut self, cn: usize) -> Result<u32, Refusal> {
        if self.cns[cn].crashed {
            return Err(Refusal::Transport("this CN has crashed".into()));
        }
        let now = self.now_ns();
        self.cns[cn].driver.alloc(now).map_err(|e| match e {
            omw_core::cn::driver::CnError::Client(c) => Refusal::Client(c.to_string()),
            e => refusal(e),
        })
    }
    fn alloc_finish(&mut self, cn: usize, token: u32) -> Result<Allocation, Refusal> {
        self.alloc_wait(cn, token)
    }
    fn free_begin(&mut self, cn: usize, a: &Allocation) -> Result<(), Refusal> {
        self.cns[cn].driver.free(a).map(|_| ()).map_err(refusal)
    }
    fn crash(&mut self, cn: usize) {
        let h = self.cns[cn].host;
        self.fabric().crash_host(h).expect("crash");
        self.cns[cn].crashed = true;
        self.pump();
    }
    fn vanish(&mut self, cn: usize) {
        let h = self.cns[cn].host;
        self.fabric().crash_host(h).expect("vanish");
        self.cns[cn].crashed = true;
        self.cns[cn].silent = true;
    }
    fn stall(&mut self, cn: usize) {
        self.cns[cn].stalled = true;
    }
    fn alloc_unread(&mut self, cn: usize) {
        if self.alloc_begin(cn).is_ok() {
            self.cns[cn].driver.client_mut().abandon_pending();
        }
    }
    fn is_served(&mut self, cn: usize) -> bool {
        self.d.mn.cn(self.cns[cn].mn_id).is_some()
    }
    fn tick(&mut self) {
        let now = self.now_ns();
        self.d.tick(now).expect("tick");
        self.pump();
    }
    fn audit(&mut self) {
        let now = self.now_ns();
        let n = self.d.sample_counters(now).expect("counter sample");
        self.mn_cpu_events += n as u64;
        self.pump();
        self.tick();
    }
    fn advance(&mut self, ns: u64) {
        let t = self.now_ns() + ns;
        match Deployment::new(&mut self.world, &mut self.d, &mut self.cns).run_until(t) {
            Ok(act) => self.mn_cpu_events += act.cpu_events,
            Err(e) => panic!("advancing: {e}"),
        }
    }
    fn now(&self) -> u64 {
        self.now_ns()
    }
    fn reset_mn_rnic(&mut self) {
        let h = self.world.mn_host;
        self.fabric().reset_rnic(h).expect("RNIC reset");
        let now = self.now_ns();
        self.d.handle(now, Event::RnicReset).expect("the MN's RNIC reset");
        self.mn_cpu_events += 1;
        self.pump();
    }
    fn nic_steps(&mut self, n: u64) {
        for _ in 0..n {
            self.fabric().step();
        }
    }
    fn drop_next(&mut self, cn: usize, n: u32) {
        let q = self.cns[cn].cq[0];
        self.fabric().faults_mut().drop_next(MessageFilter::from_qp(q), n);
    }
    fn delay_next(&mut self, cn: usize, ns: u64) {
        let q = self.cns[cn].cq[0];
        self.fabric().faults_mut().delay_next(MessageFilter::from_qp(q), ns, 1);
    }
    fn corrupt_next(&mut self, cn: usize, bytes: usize) {
        let q = self.cns[cn].cq[0];
        self.fabric().faults_mut().corrupt_sends(q, bytes as u32);
    }
    fn check_invariants(&mut self) -> Result<(), String> {
        self.d.check_invariants().map_err(|e| e.to_string())?;
        self.world.f.borrow().check_invariants()
    }
    fn ahead(&mut self) -> u32 {
        self.d.groups_ahead()
    }
    fn ahead_of(&mut self, cn: usize) -> bool {
        self.d.group_ahead_of(self.cns[cn].mn_id).is_some()
    }
    fn free_groups(&mut self) -> u32 {
        let f = self.world.f.borrow();
        let h = self.world.mn_host;
        omw_core::mn::scan_free(self.d.mn.map(), self.d.mn.tickets(), |a| f.read_u64(h, a).ok()).map_or(0, |c| c.groups)
    }
    fn stats(&mut self) -> MnStats {
        self.d.mn.stats()
    }
    fn lease_ns(&mut self) -> u64 {
        self.d.mn.config().lease_ns
    }
    fn entry(&mut self, g: GroupId) -> Option<MwTableEntry> {
        self.d.entry(g)
    }
    fn group_of(&mut self, a: &Allocation) -> Option<GroupId> {
        self.d.mn.map().group_of_entry(a.entry_addr)
    }
    fn forged_frees_of(&mut self, cn: usize) -> u64 {
        self.d.mn.cn(self.cns[cn].mn_id).map_or(0, |r| r.forged_frees as u64)
    }
    fn cn_id(&self, cn: usize) -> CnId {
        self.cns[cn].mn_id
    }
    fn is_empty_state(&mut self) -> bool {
        self.d.mn.is_empty_state()
    }
    fn heard(&mut self, cn: usize) -> Vec<Heard> {
        self.cns[cn].heard.clone()
    }
    fn received(&mut self, cn: usize) -> Vec<Vec<u8>> {
        self.cns[cn].received.clone()
    }
    /// The device's own state of the window (the DEVX backend cannot tell; the double can).
    fn mw_binding(&mut self, rkey: Rkey) -> Option<MwBinding> {
        let info = self.world.f.borrow().mw_binding(self.world.mn_host, rkey.index())?;
        Some(match info.state {
            MwState::Free => MwBinding::Unbound,
            MwState::Bound(b) => MwBinding::Bound { rkey: info.rkey, qpn: b.qpn },
        })
    }
    fn mn_mrs(&mut self) -> Vec<MnMr> {
        let private = self.d.backend.device().pd(Domain::MnPrivate);
        let mrs = self.world.f.borrow().mrs_of(self.world.mn_host).expect("MN MRs");
        mrs.iter().map(|m| MnMr::new(m.addr, m.len, m.key, m.access, m.pd == private)).collect()
    }
    fn mn_read(&mut self, addr: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.world.f.borrow().read(self.world.mn_host, addr, &mut b).expect("MN memory");
        b
    }
    fn mn_write(&mut self, addr: u64, data: &[u8]) {
        let h = self.world.mn_host;
        self.fabric().write(h, addr, data).expect("MN memory");
    }
    fn mn_map(&mut self) -> MnMemoryMap {
        *self.d.mn.map()
    }
    fn activity(&mut self) -> Activity {
        let f = self.world.f.borrow();
        let h = self.world.mn_host;
        let cpu = f.host_stats(h).map(|s| s.cpu_events).unwrap_or(0);
        let mut nic = 0;
        for c in &self.cns {
            if let Some((a, b)) = c.loops {
                for q in [a, b] {
                    nic += f.qp_stats(QpAddr::new(h, q)).map(|s| s.wqes_executed).unwrap_or(0);
                }
            }
        }
        Activity { cpu_events: self.mn_cpu_events, cpu_accesses: cpu, nic_wqes: nic }
    }
}
