//! A whole offloaded MN on the extension double and its CNs, as a conformance [`Testbed`]. The
//! MN comes up through the core's `MnPlan::provision` (two protection domains, private loop QPs
//! and atomic pair, metadata / table / rings remotely reachable only in the private domain, the
//! pool registered CN-facing and privately with a chunk of zeros for the NIC scrub) and
//! `MnDriver::create_loop_qps`; each CN is a node whose CN side is the core's `CnDriver` over
//! this crate's `RdmaBackend`, with four QPs connected to the MN (Alloc, Free, two access QPs)
//! and, where the MN gives each CN K alloc chains (`MnConfig::alloc_chains`), one more Alloc QP
//! per chain beyond the first — the MN end of each with its own loop QP
//! (`MnDriver::create_alloc_loop_qp`), all connected with `MnDriver::connect_with_chains`.
//! Before anything is provisioned the MN's footprint (`Footprint::of_chains`) is checked
//! against what one vFPGA holds (`FpgaBackend::device_limits`): a configuration that needs
//! more QPs than the vFPGA's 64 Coyote threads is refused ([`BedError::DoesNotFit`]).

use super::*;
use omw_core::access::AccessFlags;
use omw_core::chain::ChainKind;
use omw_core::cn::driver::{CnDriver, CnEvent, CnMemory, CnQp as DQp, CnQpSet, OpId, RECVS_PER_QP};
use omw_core::cn::Allocation;
use omw_core::device::DataPath;
use omw_core::device::Provision;
use omw_core::device::WindowState;
use omw_core::device::{Domain, ExecutionMode, MwBinding, QpState, WcStatus};
use omw_core::ids::{CnId, GroupId, Qpn, Rkey};
use omw_core::mn::capacity::{Exceeded, Footprint};
use omw_core::mn::driver::MnDriver;
use omw_core::mn::plan::{MnOptions, MnPlan};
use omw_core::mn::provision::PoolSpec;
use omw_core::mn::{AllocChainQps, CnQps, Event, MnStats, MAX_ALLOC_CHAINS};
use omw_core::testing::deployment::{self, CnSide, Deployment, Life};
use omw_core::testing::hostile::HostileCn;
use omw_core::wire::memory_map::MnMemoryMap;
use omw_core::wire::mwtable::MwTableEntry;
use omw_core::wire::wqe::Wqe;
use omw_fpga::double::{Fabric, NodeId};
use omw_fpga::encoding::OpcodeEncoding;
use omw_fpga::QpSetup;
use omw_tests::testbed::{Activity, Caps, CnQp, Factory, Heard, MnMr, MnSpec, Refusal, Testbed};

pub const MN: u64 = 0x4000_0000;
const MN_IP: u32 = 0x0A00_00FF;

/// A CN: its node, its driver, the MN ends of its QPs and what it heard.
pub struct Cn {
    pub id: NodeId,
    pub driver: CnDriver<Be, 256>,
    /// MN ends: alloc, free, access 0, access 1.
    pub mq: [Qpn; 4],
    /// Alloc chains beyond the first: the CN ends of their Alloc QPs and, in the same order,
    /// the MN ends (management and loop QP).
    pub extra: Vec<Qpn>,
    pub mn_extra: Vec<AllocChainQps>,
    pub loops: Option<(Qpn, Qpn)>,
    pub mn_id: CnId,
    pub heard: Vec<Heard>,
    pub received: Vec<Vec<u8>>,
    /// Its node was paused and the MN told it is gone (`Testbed::crash`).
    pub crashed: bool,
    /// Answers to this CN's requests, by token.
    pub answers: Vec<(u32, Result<Allocation, Refusal>)>,
}

/// The double as the deployment harness's fabric: it has no clock of its own, so each run of
/// it stands for a microsecond of the MN's.
pub struct World {
    pub f: Fabric,
    pub now: u64,
}

impl deployment::Fabric for World {
    type Error = std::convert::Infallible;
    fn now(&self) -> u64 {
        self.now
    }
    fn run(&mut self) -> Result<u64, Self::Error> {
        self.now += 1_000;
        // `Fabric::run` counts the call that found it idle
        Ok(self.f.run(20_000).saturating_sub(1))
    }
    fn advance_to(&mut self, t: u64) -> Result<(), Self::Error> {
        self.now = self.now.max(t);
        Ok(())
    }
}

impl CnSide for Cn {
    type Error = std::convert::Infallible;
    fn life(&self) -> Life {
        if self.crashed {
            Life::Crashed
        } else {
            Life::Running
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
        let heard = service(self, now);
        Ok(reconnect(self, mn) | heard)
    }
    fn poll_timeout(&self) -> Option<u64> {
        self.driver.poll_timeout()
    }
    fn handle_timeout(&mut self, now: u64) {
        self.driver.handle_timeout(now)
    }
}

pub struct Cluster {
    pub world: World,
    pub mn_id: NodeId,
    pub d: MnDriver<Be>,
    pub cns: Vec<Cn>,
    pub plan: MnPlan,
    pub spec: MnSpec,
    /// Alloc chains every CN connects with.
    pub chains: u8,
    /// The next MN ctid a CN-facing QP takes (the loop QPs' pairs take theirs from the top:
    /// `FpgaBackend::create_loopback_qp`).
    next_ctid: u8,
}

/// Why the testbed could not bring an MN up on the double.
#[derive(Debug)]
pub enum BedError {
    /// Alloc chains per CN out of 1..=`MAX_ALLOC_CHAINS`.
    AllocChains(u8),
    /// The MN this spec asks for does not fit one vFPGA: every limit it breaks (on the double:
    /// the QPs, one per Coyote thread, at most 64 per vFPGA since QPN = `vfid << 6 | ctid`).
    DoesNotFit { cns: usize, chains: u8, exceeded: Vec<Exceeded> },
    /// The pool's geometry.
    Geometry(String),
    /// The block cannot isolate CNs (`MnPlan::decide`).
    Plan(String),
    /// `MnPlan::provision_chains` failed.
    Provision(String),
}

impl std::fmt::Display for BedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BedError::AllocChains(k) => write!(f, "{k} alloc chains per CN: the MN takes 1..={MAX_ALLOC_CHAINS}"),
            BedError::DoesNotFit { cns, chains, exceeded } => {
                let why: Vec<String> = exceeded.iter().map(|e| e.to_string()).collect();
                write!(
                    f,
                    "an MN of {cns} CNs with {chains} alloc chains each does not fit one vFPGA: {} (one QP per \
                     Coyote thread, QPN = vfid << 6 | ctid)",
                    why.join("; ")
                )
            }
            BedError::Geometry(e) => write!(f, "pool geometry: {e}"),
            BedError::Plan(e) => write!(f, "MnPlan::decide: {e}"),
            BedError::Provision(e) => write!(f, "MnPlan::provision_chains: {e}"),
        }
    }
}

impl std::error::Error for BedError {}

impl Cluster {
    /// One alloc chain per CN, the MN's own choice of popping ahead.
    pub fn new(spec: MnSpec) -> Cluster {
        Cluster::try_new(spec, 1, None).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `chains` alloc chains per CN; `pop_ahead` overrides the MN's choice
    /// (`MnConfig::pop_ahead_pays`) where given.
    pub fn try_new(spec: MnSpec, chains: u8, pop_ahead: Option<bool>) -> Result<Cluster, BedError> {
        if chains == 0 || chains as usize > MAX_ALLOC_CHAINS {
            return Err(BedError::AllocChains(chains));
        }
        let f = Fabric::new();
        let mn = host_with(&f, MN_IP, MN, true, OpcodeEncoding::AppOpcodes, |c| c.with_node_memory(MN, ARENA_OFF));
        let opts = MnOptions { scrub: spec.scrub, ..MnOptions::default() };
        let plan = MnPlan::decide(mn.be.capabilities(), opts).map_err(|e| BedError::Plan(e.to_string()))?;
        let pool = PoolSpec {
            chunk_size: spec.chunk_size.unwrap_or(4096),
            chunks: spec.chunks,
            group_size: spec.group_size,
            max_cns: spec.cns as u32,
            quota: spec.quota,
            lease_ns: omw_core::mn::DEFAULT_LEASE_NS,
            queue_depth: None,
        };
        // what one vFPGA holds, before anything of the MN is set up (as an MN over verbs checks
        // its device: `omw_verbs::mn::fits_device`)
        let need = Footprint::of_chains(&plan, &pool, chains).map_err(|e| BedError::Geometry(e.to_string()))?;
        let exceeded: Vec<Exceeded> = need.check(&mn.be.device_limits()).into_iter().collect();
        if !exceeded.is_empty() {
            return Err(BedError::DoesNotFit { cns: spec.cns, chains, exceeded });
        }
        let mn_id = mn.id;
        let mut d = plan.provision_chains(mn.be, &pool, chains).map_err(|e| BedError::Provision(e.to_string()))?;
        if let Some(on) = pop_ahead {
            d.mn.set_pop_ahead(on);
        }
        let mut c = Cluster { world: World { f, now: 0 }, mn_id, d, cns: Vec::new(), plan, spec, chains, next_ctid: 1 };
        for i in 0..spec.cns {
            c.connect_cn(i);
        }
        Ok(c)
    }

    fn connect_cn(&mut self, i: usize) {
        let base = 0x1000_0000 * (i as u64 + 1);
        let mut h = host(&self.world.f, 0x0A00_0001 + i as u32, base, true, OpcodeEncoding::AppOpcodes);
        let depths = self.d.mn.chain_ring_depths().unwrap();
        let loops = self.d.create_loop_qps().unwrap();
        let cn_domain = self.plan.cn_facing_domain();
        let cn_setup = QpSetup::plain(64, 2 * RECVS_PER_QP as u32);
        // the MN ends: managed rings for the chains' management QPs (offloaded)
        let alloc_mgmt = match loops.is_some() {
            true => QpSetup::managed(depths[0][1] as u32, 1),
            false => cn_setup,
        };
        let mut mq = [Qpn::default(); 4];
        let mut q = [Qpn::default(); 4];
        for k in 0..4u8 {
            let setup = match (k, loops.is_some()) {
                (0 | 1, true) => QpSetup::managed(depths[k as usize][1] as u32, 1),
                _ => cn_setup,
            };
            let c = self.take_ctid();
            self.d.backend.create_qp(c, setup.in_domain(cn_domain)).unwrap();
            setup_qp(&mut h, 1 + k, cn_setup);
            let (a, b) = connect_mn(&mut h, 1 + k, &mut self.d.backend, c);
            q[k as usize] = a;
            mq[k as usize] = b;
        }
        // each alloc chain beyond the first: its own Alloc QP pair (the MN end managed, as the
        // first chain's) and its own loop QP
        let mut extra = Vec::new();
        let mut mn_extra = Vec::new();
        for j in 1..self.chains {
            let lp = self.d.create_alloc_loop_qp().unwrap();
            let c = self.take_ctid();
            self.d.backend.create_qp(c, alloc_mgmt.in_domain(cn_domain)).unwrap();
            let cn_ctid = 4 + j;
            setup_qp(&mut h, cn_ctid, cn_setup);
            let (a, b) = connect_mn(&mut h, cn_ctid, &mut self.d.backend, c);
            extra.push(a);
            mn_extra.push(AllocChainQps { mgmt: b, lp });
        }
        let chunk = self.spec.chunk_size.unwrap_or(4096).max(4096);
        let reply = base + 0x1000;
        // a reply slot per chain
        let reply_len = self.chains as u64 * CnMemory::REPLY_LEN;
        let local = base + 0x10000;
        assert!(reply + reply_len <= local, "the CN's reply slots overlap its local memory");
        let local_len = CnMemory::local_len_for(omw_core::cn::driver::IO_SLOTS, chunk);
        assert!(local + local_len <= base + ARENA_OFF, "CN memory overlaps its ring arena");
        let rk =
            h.be.reg_mr(Domain::CnFacing, reply, reply_len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
                .unwrap();
        let lk = h.be.reg_mr(Domain::CnFacing, local, local_len, AccessFlags::LOCAL_WRITE).unwrap();
        let mem = CnMemory { local, local_len, lkey: lk.lkey, reply, reply_rkey: rk.rkey };
        let qps = CnQpSet { alloc: q[0], free: q[1], access: [q[2], q[3]].into_iter().collect() };
        let mut driver = CnDriver::new(h.be, qps, mem).unwrap();
        if !extra.is_empty() {
            driver = driver.with_alloc_chains(&extra, reply_len).unwrap();
        }
        driver.record_deliveries(true);
        self.cns.push(Cn {
            id: h.id,
            driver,
            mq,
            extra,
            mn_extra: mn_extra.clone(),
            loops,
            mn_id: CnId::UNASSIGNED,
            heard: Vec::new(),
            received: Vec::new(),
            crashed: false,
            answers: Vec::new(),
        });
        let qps = CnQps {
            alloc: mq[0],
            free: mq[1],
            access: [mq[2], mq[3]].into_iter().collect(),
            alloc_loop: loops.map(|l| l.0),
            free_loop: loops.map(|l| l.1),
        };
        if let Err(e) =
            Deployment::new(&mut self.world, &mut self.d, &mut self.cns).connect_with_chains(i, qps, &mn_extra, None)
        {
            panic!("connecting cn{i}: {e}");
        }
    }

    /// The MN's next ctid for a CN-facing QP (the footprint check made sure there is one; a
    /// ctid a loop pair already took from the top would be a bug of this testbed).
    fn take_ctid(&mut self) -> u8 {
        let c = self.next_ctid;
        self.next_ctid += 1;
        let q = self.d.backend.qpn(c).unwrap();
        assert_eq!(self.d.backend.qp_state(q).unwrap(), QpState::Reset, "MN ctid {c} is already a QP");
        c
    }

    /// Run the double, the MN CPU and every CN until nothing moves (the core's one pump,
    /// `omw_core::testing::deployment`).
    pub fn pump(&mut self) {
        if let Err(e) = Deployment::new(&mut self.world, &mut self.d, &mut self.cns).pump() {
            panic!("pumping the double: {e}");
        }
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

    /// Run until access `op` of CN `i` on its QP `qp` completes; a failed one brings the pair
    /// back (the CN reconnecting: its end reset; the MN end of an access QP reset by the MN's
    /// connection manager, that of a chain QP repaired by the MN when its poll sees the chain
    /// fail).
    fn wait_op(&mut self, i: usize, op: OpId, qp: DQp, len: usize) -> (WcStatus, Vec<u8>) {
        let mut out = vec![0u8; len.max(8)];
        let mut done = None;
        for _ in 0..64 {
            self.world.f.run(20_000);
            let now = self.world.now;
            self.cns[i].driver.poll(now).unwrap();
            if let Some(d) = self.cns[i].driver.access_done(op, &mut out).unwrap() {
                done = Some(d);
                break;
            }
        }
        let d = done.expect("the access completed");
        let _ = qp;
        self.pump();
        out.truncate(len);
        (d.status, if d.status == WcStatus::Success { out } else { Vec::new() })
    }
}

fn setup_qp(h: &mut Host, ctid: u8, s: QpSetup) {
    h.be.create_qp(ctid, s).unwrap();
}

fn connect_mn(h: &mut Host, ctid: u8, mn: &mut Be, mctid: u8) -> (Qpn, Qpn) {
    let (qa, qb) = (h.be.qpn(ctid).unwrap(), mn.qpn(mctid).unwrap());
    let c = |remote: Qpn, ip, l, r| omw_fpga::QpConnect {
        remote_qpn: remote.get(),
        remote_ip: ip,
        local_psn: l,
        remote_psn: r,
        port: 18488,
        ..omw_fpga::QpConnect::default()
    };
    h.be.connect_qp(ctid, &c(qb, MN_IP, 0x100, 0x200)).unwrap();
    mn.connect_qp(mctid, &c(qa, h.ip, 0x200, 0x100)).unwrap();
    (qa, qb)
}

/// A CN whose QP a failed request or access broke reconnects it: its end is reset; the MN end
/// of an access QP is reset by the MN's connection manager, that of a chain QP is the MN's to
/// repair (its poll sees the chain fail and re-arms it).
fn reconnect<M: DataPath>(c: &mut Cn, mn: &mut M) -> bool {
    let q = c.driver.qps().clone();
    let mut moved = false;
    // the extra Alloc QPs are chain management QPs, as the first: the MN repairs its ends
    let extra = c.extra.clone();
    for (k, cq) in [q.alloc, q.free, q.access[0], q.access[1]].into_iter().enumerate() {
        if c.driver.backend.qp_state(cq).unwrap() != QpState::Rts {
            c.driver.backend.reset_qp(cq).unwrap();
            moved = true;
        }
        if k >= 2 && mn.qp_state(c.mq[k]).ok() != Some(QpState::Rts) {
            let _ = mn.reset_qp(c.mq[k]);
            moved = true;
        }
    }
    for cq in extra {
        if c.driver.backend.qp_state(cq).unwrap() != QpState::Rts {
            c.driver.backend.reset_qp(cq).unwrap();
            moved = true;
        }
    }
    moved
}

fn service(c: &mut Cn, now: u64) -> bool {
    if c.driver.poll(now).is_err() {
        return false;
    }
    let mut moved = false;
    while let Some(ev) = c.driver.next_event() {
        moved = true;
        match ev {
            CnEvent::Delivered { bytes, .. } => c.received.push(bytes.to_vec()),
            CnEvent::Allocated { token, result } => {
                c.answers.push((token, result.map_err(|e| Refusal::Client(e.to_string()))))
            }
            CnEvent::Refused { token, code, ours } => {
                if ours {
                    c.answers.push((token, Err(Refusal::Mn(code))));
                }
                c.heard.push(Heard::Failed(code));
            }
            CnEvent::Empty => c.heard.push(Heard::Empty),
            CnEvent::Available => c.heard.push(Heard::Available),
            CnEvent::Revoked => c.heard.push(Heard::Revoked),
            CnEvent::Rekeyed { entry_addr, mw, rkey } => c.heard.push(Heard::Rekeyed { entry_addr, mw, rkey }),
            _ => {}
        }
    }
    moved
}

/// The double's capabilities as a testbed.
const CAPS: Caps = Caps::OFFLOAD
    .union(Caps::STRICT_MW)
    .union(Caps::WINDOW_STATE)
    .union(Caps::MN_KEYS)
    .union(Caps::MN_MEMORY)
    .union(Caps::HOSTILE_QPS)
    .union(Caps::CN_MESSAGES)
    .union(Caps::RAW_REQUESTS)
    .union(Caps::NAMED_QPS)
    .union(Caps::CONTENTION)
    .union(Caps::MN_ACTIVITY)
    .union(Caps::REVIVE)
    .union(Caps::CRASH)
    .union(Caps::NIC_STEPS)
    .union(Caps::TIME_CONTROL)
    .union(Caps::WINDOW_SPANS)
    .union(Caps::SEND_WITH_INV);

/// Starts MNs on the extension double whose CNs connect with `chains` alloc chains each;
/// `pop_ahead: Some(true)` has every alloc chain pop ahead (as the loopback's
/// `Mode::OffloadedPopAhead`) wherever the pool has more groups than the CNs have chains —
/// with as many chains as groups some CN is starved by design (`MnConfig::pop_ahead_pays`),
/// so those pools run without; `None` leaves it to the MN.
#[derive(Clone, Copy, Debug)]
pub struct Double {
    pub chains: u8,
    pub pop_ahead: Option<bool>,
}

impl Double {
    /// One alloc chain per CN, popping ahead the MN's choice: the double as it always ran.
    pub const ONE_CHAIN: Double = Double { chains: 1, pop_ahead: None };
}

impl Factory for Double {
    fn name(&self) -> String {
        let ahead = match self.pop_ahead {
            Some(true) => ", popping ahead",
            Some(false) => ", not popping ahead",
            None => "",
        };
        format!("FPGA double (extension block), {} alloc chain(s) per CN{ahead}", self.chains)
    }
    fn caps(&self) -> Caps {
        CAPS
    }
    /// A spec the double cannot hold fails the scenario with the refusal's reason
    /// ([`BedError`]).
    fn start(&self, spec: MnSpec) -> Box<dyn Testbed> {
        let ahead = match self.pop_ahead {
            Some(true) if spec.chunks as usize <= spec.cns * self.chains as usize => Some(false),
            a => a,
        };
        match Cluster::try_new(spec, self.chains, ahead) {
            Ok(c) => Box::new(c),
            Err(e) => panic!("{e}"),
        }
    }
}

fn refusal<E: std::fmt::Display>(e: E) -> Refusal {
    Refusal::Client(e.to_string())
}

impl Testbed for Cluster {
    fn caps(&self) -> Caps {
        CAPS
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
        match self.cns[cn].driver.post_write(window, addr, rkey, data) {
            Ok(op) => self.wait_op(cn, op, DQp::Access(window), 0).0,
            Err(_) => WcStatus::LocQpOpErr,
        }
    }
    fn read_raw(&mut self, cn: usize, window: usize, addr: u64, rkey: Rkey, len: usize) -> (WcStatus, Vec<u8>) {
        match self.cns[cn].driver.post_read(window, addr, rkey, len) {
            Ok(op) => self.wait_op(cn, op, DQp::Access(window), len),
            Err(_) => (WcStatus::LocQpOpErr, Vec::new()),
        }
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
        let now = self.world.now;
        let t = self.cns[cn].driver.alloc_naming(now, qpns).map_err(refusal)?;
        self.alloc_wait(cn, t)
    }
    fn access_qpns(&self, cn: usize) -> Vec<Qpn> {
        self.cns[cn].mq[2..].to_vec()
    }
    fn mgmt_qpns(&self, cn: usize) -> [Qpn; 2] {
        [self.cns[cn].mq[0], self.cns[cn].mq[1]]
    }
    fn alloc_begin(&mut self, cn: usize) -> Result<u32, Refusal> {
        let now = self.world.now;
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
    /// The CN's node stops (its link is down) and the MN is told it is gone, as a connection
    /// manager would tell it.
    fn crash(&mut self, cn: usize) {
        self.world.f.set_paused(self.cns[cn].id, true);
        self.cns[cn].crashed = true;
        self.world.now += 1_000;
        let id = self.cns[cn].mn_id;
        self.d.handle(self.world.now, Event::CnGone { cn: id }).unwrap();
        self.pump();
    }
    fn nic_steps(&mut self, n: u64) {
        for _ in 0..n {
            self.world.f.tick();
        }
    }
    fn advance(&mut self, ns: u64) {
        self.world.now += ns;
        self.tick();
    }
    fn now(&self) -> u64 {
        self.world.now
    }
    fn is_served(&mut self, cn: usize) -> bool {
        self.d.mn.cn(self.cns[cn].mn_id).is_some()
    }
    fn tick(&mut self) {
        self.world.now += 1_000;
        self.d.handle(self.world.now, Event::Tick).unwrap();
        self.pump();
    }
    fn check_invariants(&mut self) -> Result<(), String> {
        self.d.check_invariants().map_err(|e| e.to_string())
    }
    fn ahead(&mut self) -> u32 {
        self.d.groups_ahead()
    }
    fn ahead_of(&mut self, cn: usize) -> bool {
        self.d.groups_ahead_of(self.cns[cn].mn_id) > 0
    }
    fn ahead_count(&mut self, cn: usize) -> u32 {
        self.d.groups_ahead_of(self.cns[cn].mn_id)
    }
    fn alloc_chains(&self) -> u8 {
        self.chains
    }
    fn free_groups(&mut self) -> u32 {
        let map = *self.d.mn.map();
        let q = map.queue;
        let word = |a: u64| {
            let mut b = [0u8; 8];
            self.d.backend.read_local(a, &mut b).unwrap();
            u64::from_le_bytes(b)
        };
        q.live_len(word(q.head), word(q.tail), map.max_cns)
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
    fn mw_binding(&mut self, rkey: Rkey) -> Option<MwBinding> {
        self.d.backend.mw_binding(rkey)
    }
    fn mn_mrs(&mut self) -> Vec<MnMr> {
        let private = self.d.backend.pd(Domain::MnPrivate).ok();
        self.world
            .f
            .mrs(self.mn_id)
            .iter()
            .map(|m| MnMr::new(m.addr, m.len, m.key, m.access, Some(m.pd) == private))
            .collect()
    }
    fn mn_read(&mut self, addr: u64, len: usize) -> Vec<u8> {
        get(&self.d.backend, addr, len)
    }
    fn mn_write(&mut self, addr: u64, data: &[u8]) {
        put(&mut self.d.backend, addr, data)
    }
    fn mn_map(&mut self) -> MnMemoryMap {
        *self.d.mn.map()
    }
    fn activity(&mut self) -> Activity {
        Activity {
            cpu_events: self.d.mn.stats().events,
            cpu_accesses: 0,
            nic_wqes: self.world.f.stats(self.mn_id).wqes_executed,
        }
    }
}
