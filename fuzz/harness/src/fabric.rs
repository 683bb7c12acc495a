//! The loopback NIC executing arbitrary work-queue bytes: send entries (structured from
//! meaningful pieces, or raw 64-byte images) and receive entries (structured scatter lists or
//! raw images) posted on the QPs of a small MN + CN fabric — plain, managed and loopback QPs,
//! type-2 windows, rings reachable by the WQEs themselves — interleaved with ENABLE doorbells,
//! QP resets, bounded runs, polls, a CN crash and an RNIC reset. The model decodes untrusted
//! bytes when it fetches them; whatever they say, it must not panic and its own invariants
//! (`Fabric::check_invariants`) must hold after every operation.

use arbitrary::{Arbitrary, Unstructured};
use omw_core::access::AccessFlags;
use omw_core::device::Completion;
use omw_core::ids::Rkey;
use omw_core::wire::wqe::{Opcode, QueueSel, RecvWqe, Sge, Wqe, WqeFlags, RECV_WQE_SIZE, WQE_SIZE};
use omw_loopback::{Fabric, HostId, NicConfig, PdId, QpAddr, QpConfig};

const MAX_OPS: usize = 48;
const RUN_BUDGET: u64 = 2_000;

#[derive(Arbitrary, Debug)]
pub struct Input {
    pub prefetch: u8,
    pub rxe: bool,
    pub no_offload: bool,
    pub ops: Vec<Op>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Addr {
    Mn(u16),
    Cn(u16),
    /// Into a QP's send ring (self-modifying WQEs).
    Ring(u8, u16),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Key {
    MnMr,
    CnMr,
    MnRing,
    CnRing,
    Mw(u8),
    Raw(u32),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum QpSel {
    Qp(u8),
    Raw(u32),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct WqeSpec {
    pub op: u8,
    pub flags: u8,
    pub imm: Key,
    pub local: Addr,
    pub len: u16,
    pub lkey: Key,
    pub remote: Addr,
    pub rkey: Key,
    pub qpn: QpSel,
    pub operand0: u16,
    pub operand1: u8,
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Op {
    Send { qp: u8, wqe: WqeSpec },
    SendRaw { qp: u8, bytes: [u8; WQE_SIZE] },
    Recv { qp: u8, sges: Vec<(Addr, u16, Key)> },
    RecvRaw { qp: u8, bytes: Vec<u8> },
    Enable { qp: u8, recv: bool, n: u8 },
    Reset { qp: u8 },
    Run { steps: u16 },
    Poll { qp: u8, recv: bool },
    CrashCn,
    ResetRnic,
}

pub fn run(data: &[u8]) -> bool {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return false };
    check(&input);
    true
}

struct Rig {
    f: Fabric,
    mn: HostId,
    cn: HostId,
    mn_mem: (u64, u32),
    cn_mem: (u64, u32),
    mws: Vec<Rkey>,
    qps: Vec<QpAddr>,
}

impl Rig {
    fn new(input: &Input) -> Rig {
        let mut nic = if input.rxe { NicConfig::rxe_compatible() } else { NicConfig::strict() };
        nic = nic.with_offload(!input.no_offload);
        if !input.prefetch.is_multiple_of(5) {
            nic = nic.with_prefetch(input.prefetch as u32 % 5);
        }
        nic.ring_arena_bytes = 64 << 10;
        let mut f = Fabric::new(nic);
        let mn = f.add_host("mn").expect("host");
        let cn = f.add_host("cn").expect("host");
        let all = AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_ATOMIC
            | AccessFlags::MW_BIND;
        let (ma, mk) = f.alloc_mr(mn, PdId(0), 8192, 64, all).expect("MN memory");
        let (ca, ck) = f.alloc_mr(cn, PdId(0), 8192, 64, all).expect("CN memory");
        let mws = (0..3).map(|_| f.alloc_mw(mn, PdId(0)).expect("window")).collect();
        let managed = QpConfig::managed(8, 4);
        let small = QpConfig::default().with_depths(8, 4);
        let mut qps = Vec::new();
        let (a, b) = f.create_connected_pair(cn, small, mn, small).expect("pair");
        qps.extend([a, b]);
        let (a, b) = f.create_connected_pair(cn, small, mn, managed).expect("pair");
        qps.extend([a, b]);
        let (a, b) = f.create_connected_pair(mn, managed, mn, small).expect("loop pair");
        qps.extend([a, b]);
        Rig { f, mn, cn, mn_mem: (ma, mk.lkey), cn_mem: (ca, ck.lkey), mws, qps }
    }
    fn qp(&self, i: u8) -> QpAddr {
        self.qps[i as usize % self.qps.len()]
    }
    fn addr(&self, a: Addr) -> u64 {
        match a {
            Addr::Mn(o) => self.mn_mem.0 + o as u64 % 8192,
            Addr::Cn(o) => self.cn_mem.0 + o as u64 % 8192,
            Addr::Ring(q, o) => {
                self.f.ring_base(self.qp(q), QueueSel::Send).unwrap_or(0) + o as u64 % (8 * WQE_SIZE as u64)
            }
            Addr::Raw(v) => v,
        }
    }
    fn key(&self, k: Key) -> u32 {
        match k {
            Key::MnMr => self.mn_mem.1,
            Key::CnMr => self.cn_mem.1,
            Key::MnRing => self.f.ring_keys(self.mn).map(|k| k.rkey).unwrap_or(0),
            Key::CnRing => self.f.ring_keys(self.cn).map(|k| k.rkey).unwrap_or(0),
            Key::Mw(i) => {
                let r = self.mws[i as usize % self.mws.len()];
                // the window's current key, or the next one (what a bind must use)
                let cur = self.f.mw_binding(self.mn, r.index()).map(|m| m.rkey).unwrap_or(r);
                if i >= 128 {
                    cur.next_key().0
                } else {
                    cur.0
                }
            }
            Key::Raw(v) => v,
        }
    }
    fn wqe(&self, s: &WqeSpec) -> Wqe {
        let op = Opcode::ALL[s.op as usize % Opcode::ALL.len()];
        let mut w = Wqe::blank(op);
        w.flags = WqeFlags::from_bits_truncate(s.flags);
        w.imm = self.key(s.imm);
        w.local_addr = self.addr(s.local);
        w.length = s.len as u32 % 4096;
        w.lkey = self.key(s.lkey);
        w.remote_addr = self.addr(s.remote);
        w.rkey = self.key(s.rkey);
        w.qpn = match s.qpn {
            QpSel::Qp(i) => self.qp(i).qpn.get(),
            QpSel::Raw(v) => v,
        };
        w.operand0 = s.operand0 as u64;
        w.operand1 = match op {
            Opcode::BindMw => (s.operand1 as u64) & 0x1F,
            _ => s.operand1 as u64 % 4,
        };
        if op.is_atomic() {
            w.length = 8;
            w.remote_addr &= !7;
        }
        w
    }
}

pub fn check(input: &Input) {
    let mut r = Rig::new(input);
    let mut out = [blank(); 8];
    for op in input.ops.iter().take(MAX_OPS) {
        let qa = |q: u8| r.qp(q);
        // refusals (ring full, QP gone, host crashed, not managed) are answers, not bugs
        match op {
            Op::Send { qp, wqe } => {
                let w = r.wqe(wqe);
                let _ = r.f.post_send(qa(*qp), &w);
            }
            Op::SendRaw { qp, bytes } => {
                let _ = r.f.post_send_raw(qa(*qp), bytes);
            }
            Op::Recv { qp, sges } => {
                let mut w = RecvWqe { wr_id: 7, sges: heapless::Vec::new() };
                for (a, len, k) in sges.iter().take(8) {
                    let _ = w.sges.push(Sge { addr: r.addr(*a), length: *len as u32 % 4096, lkey: r.key(*k) });
                }
                let _ = r.f.post_recv(qa(*qp), &w);
            }
            Op::RecvRaw { qp, bytes } => {
                let mut b = [0u8; RECV_WQE_SIZE];
                for (d, s) in b.iter_mut().zip(bytes.iter()) {
                    *d = *s;
                }
                let _ = r.f.post_recv_raw(qa(*qp), &b);
            }
            Op::Enable { qp, recv, n } => {
                let sel = if *recv { QueueSel::Recv } else { QueueSel::Send };
                let _ = r.f.enable(qa(*qp), sel, *n as u64 % 16);
            }
            Op::Reset { qp } => {
                let _ = r.f.reset_qp(qa(*qp));
            }
            Op::Run { steps } => {
                r.f.run_until_idle(*steps as u64 % RUN_BUDGET);
            }
            Op::Poll { qp, recv } => {
                let sel = if *recv { QueueSel::Recv } else { QueueSel::Send };
                let _ = r.f.poll(qa(*qp), sel, &mut out);
            }
            Op::CrashCn => {
                let _ = r.f.crash_host(r.cn);
            }
            Op::ResetRnic => {
                let _ = r.f.reset_rnic(r.mn);
            }
        }
        if let Err(e) = r.f.check_invariants() {
            panic!("loopback model invariant broken after {op:?}: {e}");
        }
    }
    r.f.run_until_idle(RUN_BUDGET);
    if let Err(e) = r.f.check_invariants() {
        panic!("loopback model invariant broken after the final run: {e}");
    }
}

fn blank() -> Completion {
    Completion {
        wr_id: 0,
        status: omw_core::device::WcStatus::GeneralErr,
        opcode: omw_core::device::WcOpcode::Recv,
        qpn: Default::default(),
        byte_len: 0,
        imm: None,
        invalidated: None,
    }
}
