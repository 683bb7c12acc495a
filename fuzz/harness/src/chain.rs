//! The chain validator on arbitrary layouts, and what the layouts it accepts do.
//!
//! A layout starts as the real alloc or free chain of a CN of a small loopback cluster (or
//! empty) and goes through arbitrary structural edits: fields, flags, opcodes, rings, patch
//! targets, the RECV scatter, enables, steps removed, duplicated, inserted or swapped.
//! `validate()` must never panic. A layout it accepts is then *executed*: offloaded, armed with
//! `omw_core::chain::arm::arm` into the CN's (reset) chain QPs on the loopback NIC, a few requests
//! sent by the CN and the fabric run (bounded); or on the host engine with `run_lap`. Neither
//! may panic, and the model's own invariants (`Fabric::check_invariants`) must hold after.
//! The protocol invariants are *not* checked: an accepted layout is gated correctly, not
//! necessarily a correct allocator.

use arbitrary::{Arbitrary, Unstructured};
use omw_core::chain::arm::arm;
use omw_core::chain::{ChainKind, ChainLayout, Loc, Rearm, RecvTarget, Ring, Step};
use omw_core::device::ExecutionMode;
use omw_core::ids::Qpn;
use omw_core::mn::driver::build;
use omw_core::mn::host_engine::{run_lap, LapContext};
use omw_core::wire::message::{AllocRequest, FreeRequest};
use omw_core::wire::wqe::{Opcode, QueueSel, RecvWqe, Wqe, WqeField, WqeFlags};
use omw_loopback::cluster::{Cluster, ClusterConfig};
use omw_loopback::{NicConfig, PdId};

const MAX_EDITS: usize = 24;
const MAX_REQUESTS: usize = 3;
/// Fabric steps per request: a real lap is < 100 WQEs; a broken self-enabling chain may spin.
const STEP_BUDGET: u64 = 4_000;

#[derive(Arbitrary, Debug)]
pub struct Input {
    pub free_chain: bool,
    pub exec: Exec,
    pub group_size: u8,
    pub edits: Vec<Edit>,
    pub requests: Vec<Request>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Exec {
    Nic {
        prefetch: u8,
    },
    /// `rxe`: soft-RoCE semantics (any QP may invalidate: the software ownership check runs).
    HostEngine {
        rxe: bool,
    },
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Val {
    Add(i8),
    Set(u64),
    Zero,
    Max,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Addr {
    /// Offset into the MN metadata region (queue, head/tail, table, scratch).
    Meta(u16),
    /// Offset into the CN's scratch area.
    Scratch(u16),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Key {
    Meta,
    Table,
    Ring,
    Raw(u32),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum QpnSel {
    Loop,
    Mgmt,
    Free,
    Access(u8),
    Raw(u32),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct FieldRef {
    pub step: u8,
    pub field: u8,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Edit {
    Operand0 { step: u8, v: Val },
    Operand1 { step: u8, v: Val },
    Imm { step: u8, v: Val },
    Length { step: u8, v: Val },
    Qpn { step: u8, q: QpnSel },
    LocalAddr { step: u8, a: Addr },
    RemoteAddr { step: u8, a: Addr },
    Lkey { step: u8, k: Key },
    Rkey { step: u8, k: Key },
    Flags { step: u8, flags: u8 },
    Opcode { step: u8, op: u8 },
    Ring { step: u8, loop_ring: bool },
    Local { step: u8, to: Option<FieldRef> },
    Remote { step: u8, to: Option<FieldRef> },
    Remove { step: u8 },
    Duplicate { step: u8, at: u8 },
    Insert { at: u8, loop_ring: bool, op: u8 },
    Swap { a: u8, b: u8 },
    RecvField { idx: u8, to: FieldRef, len: u8 },
    RecvMem { idx: u8, a: Addr, len: u8 },
    RemoveRecv { idx: u8 },
    InitialEnable { loop_ring: bool, n: u8 },
    Rearm { host: bool },
    QueueDepth(u8),
    Meta { base: u64, len: u64 },
    Probe { empty: Option<u8>, owner: Option<u8> },
    Clear,
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Request {
    /// What the honest client would send for this kind.
    Valid,
    /// A free naming this MWTable entry (group index).
    FreeEntry(u8),
    /// An alloc request with these reply address / QP choices.
    Alloc {
        reply_off: u16,
        qpns: [QpnSel; 3],
    },
    Bytes(Vec<u8>),
}

const FIELDS: [WqeField; 10] = WqeField::ALL;

pub fn run(data: &[u8]) -> bool {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return false };
    check(&input);
    true
}

/// What the edits can name, taken from the cluster the chain runs in.
struct Ctx {
    meta: (u64, u64),
    scratch: u64,
    keys: omw_core::mn::MnKeys,
    loop_qpn: u32,
    mgmt_qpn: u32,
    free_qpn: u32,
    access: Vec<u32>,
}

impl Ctx {
    fn addr(&self, a: Addr) -> u64 {
        match a {
            Addr::Meta(o) => self.meta.0 + (o as u64 % self.meta.1.max(1)),
            Addr::Scratch(o) => self.scratch + (o as u64 % omw_core::wire::memory_map::SCRATCH_PER_CN),
            Addr::Raw(v) => v,
        }
    }
    fn key(&self, k: Key) -> u32 {
        match k {
            Key::Meta => self.keys.meta_lkey,
            Key::Table => self.keys.table_rkey,
            Key::Ring => self.keys.ring_lkey,
            Key::Raw(v) => v,
        }
    }
    fn qpn(&self, q: QpnSel) -> u32 {
        match q {
            QpnSel::Loop => self.loop_qpn,
            QpnSel::Mgmt => self.mgmt_qpn,
            QpnSel::Free => self.free_qpn,
            QpnSel::Access(i) => self.access.get(i as usize % self.access.len().max(1)).copied().unwrap_or(0),
            QpnSel::Raw(v) => v,
        }
    }
}

fn val(old: u64, v: Val) -> u64 {
    match v {
        Val::Add(d) => old.wrapping_add(d as i64 as u64),
        Val::Set(x) => x,
        Val::Zero => 0,
        Val::Max => u64::MAX,
    }
}

fn idx(n: usize, i: u8) -> Option<usize> {
    (n > 0).then(|| i as usize % n)
}

fn field_ref(r: FieldRef) -> Loc {
    Loc::Field { step: r.step, field: FIELDS[r.field as usize % FIELDS.len()] }
}

fn apply(l: &mut ChainLayout, e: Edit, ctx: &Ctx) {
    let n = l.steps.len();
    let step = |i: u8| idx(n, i);
    match e {
        Edit::Operand0 { step: s, v } => {
            if let Some(i) = step(s) {
                l.steps[i].wqe.operand0 = val(l.steps[i].wqe.operand0, v);
            }
        }
        Edit::Operand1 { step: s, v } => {
            if let Some(i) = step(s) {
                l.steps[i].wqe.operand1 = val(l.steps[i].wqe.operand1, v);
            }
        }
        Edit::Imm { step: s, v } => {
            if let Some(i) = step(s) {
                l.steps[i].wqe.imm = val(l.steps[i].wqe.imm as u64, v) as u32;
            }
        }
        Edit::Length { step: s, v } => {
            if let Some(i) = step(s) {
                l.steps[i].wqe.length = val(l.steps[i].wqe.length as u64, v) as u32;
            }
        }
        Edit::Qpn { step: s, q } => {
            if let Some(i) = step(s) {
                l.steps[i].wqe.qpn = ctx.qpn(q);
            }
        }
        Edit::LocalAddr { step: s, a } => {
            if let Some(i) = step(s) {
                l.steps[i].wqe.local_addr = ctx.addr(a);
            }
        }
        Edit::RemoteAddr { step: s, a } => {
            if let Some(i) = step(s) {
                l.steps[i].wqe.remote_addr = ctx.addr(a);
            }
        }
        Edit::Lkey { step: s, k } => {
            if let Some(i) = step(s) {
                l.steps[i].wqe.lkey = ctx.key(k);
            }
        }
        Edit::Rkey { step: s, k } => {
            if let Some(i) = step(s) {
                l.steps[i].wqe.rkey = ctx.key(k);
            }
        }
        Edit::Flags { step: s, flags } => {
            if let Some(i) = step(s) {
                l.steps[i].wqe.flags = WqeFlags::from_bits_truncate(flags);
            }
        }
        Edit::Opcode { step: s, op } => {
            if let Some(i) = step(s) {
                l.steps[i].wqe.opcode = Opcode::ALL[op as usize % Opcode::ALL.len()];
            }
        }
        Edit::Ring { step: s, loop_ring } => {
            if let Some(i) = step(s) {
                l.steps[i].ring = if loop_ring { Ring::Loop } else { Ring::Mgmt };
            }
        }
        Edit::Local { step: s, to } => {
            if let Some(i) = step(s) {
                l.steps[i].local = to.map(field_ref);
            }
        }
        Edit::Remote { step: s, to } => {
            if let Some(i) = step(s) {
                l.steps[i].remote = to.map(field_ref);
            }
        }
        Edit::Remove { step: s } => {
            if let Some(i) = step(s) {
                l.steps.remove(i);
            }
        }
        Edit::Duplicate { step: s, at } => {
            if let Some(i) = step(s) {
                let copy = l.steps[i];
                let _ = l.steps.insert(at as usize % (n + 1), copy);
            }
        }
        Edit::Insert { at, loop_ring, op } => {
            let ring = if loop_ring { Ring::Loop } else { Ring::Mgmt };
            let wqe = Wqe::blank(Opcode::ALL[op as usize % Opcode::ALL.len()]);
            let _ = l.steps.insert(at as usize % (n + 1), Step { ring, wqe, local: None, remote: None });
        }
        Edit::Swap { a, b } => {
            if let (Some(i), Some(j)) = (step(a), step(b)) {
                l.steps.swap(i, j);
            }
        }
        Edit::RecvField { idx: r, to, len } => {
            set_recv(l, r, RecvTarget { loc: field_ref(to), len: len as u32 });
        }
        Edit::RecvMem { idx: r, a, len } => {
            set_recv(l, r, RecvTarget { loc: Loc::Mem(ctx.addr(a)), len: len as u32 });
        }
        Edit::RemoveRecv { idx: r } => {
            if let Some(i) = idx(l.recv.len(), r) {
                l.recv.remove(i);
            }
        }
        Edit::InitialEnable { loop_ring, n } => l.initial_enable[usize::from(!loop_ring)] = n as u16,
        Edit::Rearm { host } => l.rearm = if host { Rearm::Host } else { Rearm::SelfEnabling },
        Edit::QueueDepth(d) => l.queue_depth = d as u16,
        Edit::Meta { base, len } => l.meta = (base, len),
        Edit::Probe { empty, owner } => {
            l.empty_probe = empty;
            l.ownership_check = owner;
        }
        Edit::Clear => {
            l.steps.clear();
            l.recv.clear();
        }
    }
}

fn set_recv(l: &mut ChainLayout, r: u8, t: RecvTarget) {
    match idx(l.recv.len() + 1, r) {
        Some(i) if i < l.recv.len() => l.recv[i] = t,
        _ => {
            let _ = l.recv.push(t);
        }
    }
}

fn cluster(exec: Exec, g: u8) -> Cluster {
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = 1;
    cfg.chunks = 4;
    cfg.quota = 4;
    cfg.group_size = g;
    match exec {
        Exec::Nic { prefetch } => {
            cfg.mode = Some(ExecutionMode::Offloaded);
            let nic = NicConfig::strict();
            cfg.nic = if prefetch % 9 == 0 { nic } else { nic.with_prefetch(prefetch as u32 % 9) };
        }
        Exec::HostEngine { rxe } => {
            cfg.mode = Some(ExecutionMode::HostEngine);
            let nic = if rxe { NicConfig::rxe_compatible() } else { NicConfig::strict() };
            cfg.nic = nic.with_offload(false).with_prefetch(8);
        }
    }
    Cluster::new(cfg).expect("a small cluster comes up")
}

pub fn check(input: &Input) {
    let g = 2 + input.group_size % 3;
    let kind = if input.free_chain { ChainKind::Free } else { ChainKind::Alloc };
    let mut c = cluster(input.exec, g);
    // a chunk the free chain can return
    let held = if kind == ChainKind::Free { c.alloc(0).ok() } else { None };
    let cn = c.cns[0].id;
    let env = c.driver.mn.chain_env(cn, kind).expect("connected CN");
    let rec = c.driver.mn.cn(cn).expect("connected CN").clone();
    let ctx = Ctx {
        meta: (env.map.meta_base, env.map.meta_len),
        scratch: c.driver.mn.scratch_of(cn).expect("slot"),
        keys: *c.driver.mn.keys(),
        loop_qpn: env.loop_qpn,
        mgmt_qpn: env.mgmt_qpn,
        free_qpn: env.free_qpn,
        access: rec.qps.access.iter().map(|q| q.get()).collect(),
    };
    let mut layout = build(kind, &env).expect("the builders build");
    for e in input.edits.iter().take(MAX_EDITS) {
        apply(&mut layout, *e, &ctx);
    }
    // the property the rest relies on: validation is total
    if layout.validate().is_err() {
        return;
    }
    let requests: Vec<Vec<u8>> = input
        .requests
        .iter()
        .take(MAX_REQUESTS)
        .map(|r| request_bytes(r, kind, &c, &ctx, held.as_ref().map(|a| a.entry_addr)))
        .collect();
    match input.exec {
        Exec::Nic { .. } => run_on_nic(&mut c, &layout, kind, &requests),
        Exec::HostEngine { .. } => run_on_host_engine(&mut c, &layout, &rec, &requests),
    }
    let model = c.fabric.borrow().check_invariants();
    if let Err(e) = model {
        panic!("loopback model invariant broken by an accepted layout: {e}\nlayout: {layout:#?}");
    }
}

fn request_bytes(r: &Request, kind: ChainKind, c: &Cluster, ctx: &Ctx, held: Option<u64>) -> Vec<u8> {
    let map = c.driver.mn.map();
    let access = |qs: &[QpnSel]| -> heapless::Vec<Qpn, 3> {
        qs.iter().take(ctx.access.len()).map(|q| Qpn::new(ctx.qpn(*q) & Qpn::MAX).unwrap_or_default()).collect()
    };
    let alloc = |reply_addr: u64, qpns: heapless::Vec<Qpn, 3>| {
        let req = AllocRequest { token: 0x5151, reply_addr, reply_rkey: 0, access_qpns: qpns };
        let mut b = [0u8; 64];
        let n = req.encode(&mut b).unwrap_or(0);
        b[..n].to_vec()
    };
    let honest: Vec<QpnSel> = (0..ctx.access.len()).map(|i| QpnSel::Access(i as u8)).collect();
    match r {
        Request::Valid if kind == ChainKind::Alloc => alloc(0, access(&honest)),
        Request::Valid => FreeRequest { token: 7, entry_addr: held.unwrap_or(map.table_base) }.encode().to_vec(),
        Request::FreeEntry(i) => {
            let gid = omw_core::ids::GroupId(*i as u32 % map.geometry.chunk_count());
            FreeRequest { token: 8, entry_addr: map.entry_addr(gid).unwrap_or(0) }.encode().to_vec()
        }
        Request::Alloc { reply_off, qpns } => alloc(*reply_off as u64, access(qpns)),
        Request::Bytes(b) => b.iter().copied().take(96).collect(),
    }
}

/// Arm the layout into the CN's chain QPs (reset first, as the MN does) and let the CN send.
fn run_on_nic(c: &mut Cluster, layout: &ChainLayout, kind: ChainKind, requests: &[Vec<u8>]) {
    let node = &c.cns[0];
    let (cn_host, cn_qp, cn_alloc_qp) =
        (node.host, if kind == ChainKind::Alloc { node.alloc_qp } else { node.free_qp }, node.alloc_qp);
    let mut backend = c.driver.backend.clone();
    {
        use omw_core::device::DataPath;
        for q in layout.qpns {
            if let Ok(q) = Qpn::new(q) {
                let _ = backend.reset_qp(q);
            }
        }
    }
    // a refused post (ring full, unknown QP) is an arm error, not a bug
    let _ = arm(&mut backend, layout, 1);
    let mut f = c.fabric.borrow_mut();
    let rw = omw_core::access::AccessFlags::LOCAL_WRITE | omw_core::access::AccessFlags::REMOTE_WRITE;
    let (buf, keys) = f.alloc_mr(cn_host, PdId(0), 4096, 64, rw).expect("CN memory");
    for (k, req) in requests.iter().enumerate() {
        // the alloc chain's reply (WRITE_WITH_IMM) needs a receive on the CN's Alloc QP; the
        // reply address in a request is relative to our buffer
        let mut req = req.clone();
        if kind == ChainKind::Alloc && req.len() >= 20 {
            let off = u64::from_le_bytes(req[8..16].try_into().expect("8 bytes")) % 2048;
            req[8..16].copy_from_slice(&(buf + 2048 + off).to_le_bytes());
            req[16..20].copy_from_slice(&keys.rkey.to_le_bytes());
        }
        let _ = f.post_recv(cn_alloc_qp, &RecvWqe { wr_id: k as u64, sges: heapless::Vec::new() });
        let len = req.len().min(2048);
        if f.write(cn_host, buf, &req[..len]).is_ok() {
            let _ = f.post_send(cn_qp, &Wqe::send(buf, keys.lkey, len as u32).with_wr_id(0xF0 + k as u64));
        }
        f.run_until_idle(STEP_BUDGET);
        if let Err(e) = f.check_invariants() {
            panic!("loopback model invariant broken after request {k}: {e}");
        }
    }
    // drain what the CN's queues saw, as a client would
    let mut out = [blank(); 16];
    for q in [cn_qp, cn_alloc_qp] {
        for sel in [QueueSel::Send, QueueSel::Recv] {
            while f.poll(q, sel, &mut out).map(|n| n > 0).unwrap_or(false) {}
        }
    }
}

fn run_on_host_engine(c: &mut Cluster, layout: &ChainLayout, rec: &omw_core::mn::CnRecord, requests: &[Vec<u8>]) {
    let mut backend = c.driver.backend.clone();
    let ctx = LapContext {
        requester: rec.cn,
        scratch: c.driver.mn.scratch_of(rec.cn).expect("slot"),
        access_qpns: &rec.qps.access,
        free_qpn: rec.qps.free,
        software_ownership_check: c.driver.mn.config().software_ownership_check,
        max_polls: 10_000,
        geometry: c.driver.mn.config().geometry,
        table_base: c.driver.mn.map().table_base,
    };
    let regions = c.driver.regions;
    for req in requests {
        // outcomes and backend errors are both fine; a panic is not
        let _ = run_lap(&mut backend, layout, &regions, req, &ctx);
        let model = c.fabric.borrow().check_invariants();
        if let Err(e) = model {
            panic!("loopback model invariant broken by a host-engine lap: {e}");
        }
    }
}

fn blank() -> omw_core::device::Completion {
    omw_core::device::Completion {
        wr_id: 0,
        status: omw_core::device::WcStatus::GeneralErr,
        opcode: omw_core::device::WcOpcode::Recv,
        qpn: Qpn::default(),
        byte_len: 0,
        imm: None,
        invalidated: None,
    }
}
