//! Property test: any sequence of control calls and WQEs (valid, invalid, or raw bytes) never
//! panics, keeps the model's invariants and counters consistent, keeps the clock monotonic,
//! terminates, and is deterministic. `OMW_PROPTEST_CASES` raises the case count (default 24).

mod common;
use common::*;
use omw_core::access::AccessFlags;
use omw_core::wire::wqe::{Opcode, QueueSel, RecvWqe, Sge, Wqe, WqeFlags, RECV_WQE_SIZE, WQE_SIZE};
use omw_loopback::{Conformance, MessageFilter, NicConfig, PdId, QpAddr, QpConfig};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Send { qp: u8, op: u8, flags: u8, local: u8, lkey: u8, len: u8, remote: u8, rkey: u8, imm: u8, n: u64 },
    Raw { qp: u8, bytes: Vec<u8> },
    Recv { qp: u8, sges: Vec<(u8, u8, u8)> },
    RawRecv { qp: u8, bytes: Vec<u8> },
    Enable { qp: u8, recv: bool, n: u8 },
    Step(u8),
    RunIdle,
    Settle,
    Poll { qp: u8, recv: bool },
    Reset { qp: u8 },
    Destroy { qp: u8 },
    Crash,
    ResetRnic,
    Cpu(u16),
    Drop,
    Delay(u16),
    Corrupt { qp: u8, n: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    let send = (any::<u8>(), 0u8..15, any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>())
        .prop_flat_map(|(qp, op, flags, local, lkey, len, remote, rkey)| {
            (any::<u8>(), 0u64..6).prop_map(move |(imm, n)| Op::Send {
                qp,
                op,
                flags,
                local,
                lkey,
                len,
                remote,
                rkey,
                imm,
                n,
            })
        });
    prop_oneof![
        8 => send,
        1 => (any::<u8>(), proptest::collection::vec(any::<u8>(), WQE_SIZE)).prop_map(|(qp, bytes)| Op::Raw { qp, bytes }),
        3 => (any::<u8>(), proptest::collection::vec((any::<u8>(), any::<u8>(), any::<u8>()), 0..4))
            .prop_map(|(qp, sges)| Op::Recv { qp, sges }),
        1 => (any::<u8>(), proptest::collection::vec(any::<u8>(), RECV_WQE_SIZE))
            .prop_map(|(qp, bytes)| Op::RawRecv { qp, bytes }),
        2 => (any::<u8>(), any::<bool>(), 0u8..5).prop_map(|(qp, recv, n)| Op::Enable { qp, recv, n }),
        3 => (1u8..20).prop_map(Op::Step),
        2 => Just(Op::RunIdle),
        1 => Just(Op::Settle),
        2 => (any::<u8>(), any::<bool>()).prop_map(|(qp, recv)| Op::Poll { qp, recv }),
        1 => any::<u8>().prop_map(|qp| Op::Reset { qp }),
        1 => any::<u8>().prop_map(|qp| Op::Destroy { qp }),
        1 => Just(Op::Crash),
        1 => Just(Op::ResetRnic),
        1 => any::<u16>().prop_map(Op::Cpu),
        1 => Just(Op::Drop),
        1 => any::<u16>().prop_map(Op::Delay),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(qp, n)| Op::Corrupt { qp, n }),
    ]
}

struct World {
    e: Env,
    qps: Vec<QpAddr>,
    addrs: Vec<u64>,
    keys: Vec<u32>,
}

fn world(cfg: NicConfig) -> World {
    let mut e = env(cfg);
    let managed = QpConfig::managed(8, 4);
    let (a, b) = e.f.create_connected_pair(e.mn, managed, e.mn, QpConfig::default().with_depths(8, 4)).unwrap();
    let (c2, m2) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
    let mw1 = e.f.alloc_mw(e.mn, PdId(0)).unwrap();
    let mw2 = e.f.alloc_mw(e.mn, PdId(0)).unwrap();
    // rings with remote rights in the PD every QP here is in: the property test explores
    // what a peer with such a key could do (the MN never grants it to a CN-facing PD)
    let ring = e.f.register_ring_arena(e.mn, PdId(0), ALL_REMOTE).unwrap();
    let ring_base = e.f.ring_base(a, QueueSel::Send).unwrap();
    let (ro, ro_k) = e.f.alloc_mr(e.mn, PdId(0), 256, 64, AccessFlags::REMOTE_READ).unwrap();
    let qps = vec![e.c, e.m, a, b, c2, m2];
    let addrs =
        vec![e.pool, e.pool + 8, e.pool + 4096, e.buf, e.buf + 64, ring_base, ring_base + 48, ro, 0, u64::MAX - 7];
    let keys =
        vec![e.pool_k.lkey, e.buf_k.lkey, ring.lkey, ro_k.lkey, mw1.0, mw1.next_key().0, mw2.next_key().0, 0, u32::MAX];
    World { e, qps, addrs, keys }
}

impl World {
    fn qp(&self, i: u8) -> QpAddr {
        self.qps[i as usize % self.qps.len()]
    }
    fn addr(&self, i: u8) -> u64 {
        self.addrs[i as usize % self.addrs.len()]
    }
    fn key(&self, i: u8) -> u32 {
        self.keys[i as usize % self.keys.len()]
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Send { qp, op, flags, local, lkey, len, remote, rkey, imm, n } => {
                let opcode = Opcode::from_u8(*op).unwrap_or(Opcode::Nop);
                let mut w = Wqe::blank(opcode);
                w.flags = WqeFlags::from_bits_truncate(*flags & 0b0111);
                w.local_addr = self.addr(*local);
                w.lkey = self.key(*lkey);
                w.length = [0u32, 1, 8, 12, 64, 4096, 1 << 20][*len as usize % 7];
                w.remote_addr = self.addr(*remote);
                w.rkey = self.key(*rkey);
                w.imm = self.key(*imm);
                w.qpn = self.qp(*imm).qpn.get();
                w.operand0 = *n;
                w.operand1 = match opcode {
                    Opcode::Wait | Opcode::Enable => *n % 2,
                    Opcode::BindMw => AccessFlags::DATA_WINDOW.bits() as u64,
                    _ => *n,
                };
                if opcode.is_atomic() {
                    w.length = 8;
                }
                if opcode == Opcode::BindMw && *flags & 0x80 != 0 {
                    w.flags |= WqeFlags::UNBIND;
                }
                let q = self.qp(*qp);
                let _ = self.e.f.post_send(q, &w);
            }
            Op::Raw { qp, bytes } => {
                let q = self.qp(*qp);
                let _ = self.e.f.post_send_raw(q, bytes.as_slice().try_into().unwrap());
            }
            Op::Recv { qp, sges } => {
                let mut r = RecvWqe { wr_id: sges.len() as u64, sges: heapless::Vec::new() };
                for (a, l, k) in sges {
                    let _ = r.sges.push(Sge { addr: self.addr(*a), length: *l as u32 % 70, lkey: self.key(*k) });
                }
                let q = self.qp(*qp);
                let _ = self.e.f.post_recv(q, &r);
            }
            Op::RawRecv { qp, bytes } => {
                let q = self.qp(*qp);
                let _ = self.e.f.post_recv_raw(q, bytes.as_slice().try_into().unwrap());
            }
            Op::Enable { qp, recv, n } => {
                let q = self.qp(*qp);
                let sel = if *recv { QueueSel::Recv } else { QueueSel::Send };
                let _ = self.e.f.enable(q, sel, *n as u64);
            }
            Op::Step(n) => {
                self.e.f.run_until_idle(u64::from(*n));
            }
            Op::RunIdle => {
                self.e.f.run_until_idle(2000);
            }
            Op::Settle => {
                self.e.f.settle(2000);
            }
            Op::Poll { qp, recv } => {
                let q = self.qp(*qp);
                let sel = if *recv { QueueSel::Recv } else { QueueSel::Send };
                let mut out = [blank(); 8];
                let _ = self.e.f.poll(q, sel, &mut out);
            }
            Op::Reset { qp } => {
                let q = self.qp(*qp);
                let _ = self.e.f.reset_qp(q);
            }
            Op::Destroy { qp } => {
                let q = self.qp(*qp);
                let _ = self.e.f.destroy_qp(q);
            }
            Op::Crash => {
                let _ = self.e.f.crash_host(self.e.cn);
            }
            Op::ResetRnic => {
                let _ = self.e.f.reset_rnic(self.e.mn);
            }
            Op::Cpu(ns) => {
                let _ = self.e.f.advance_cpu(self.e.mn, *ns as u64);
            }
            Op::Drop => self.e.f.faults_mut().drop_next(MessageFilter::ANY, 1),
            Op::Delay(ns) => self.e.f.faults_mut().delay_next(MessageFilter::ANY, *ns as u64, 1),
            Op::Corrupt { qp, n } => {
                let q = self.qp(*qp);
                self.e.f.faults_mut().corrupt_sends(q, *n as u32);
            }
        }
    }
}

fn run(cfg: NicConfig, ops: &[Op]) -> Result<(u64, u64, omw_loopback::Counters), TestCaseError> {
    let mut w = world(cfg);
    let mut last = w.e.f.now();
    for op in ops {
        w.apply(op);
        w.e.f.check_invariants().map_err(|e| TestCaseError::fail(format!("after {op:?}: {e}")))?;
        prop_assert!(w.e.f.now() >= last, "clock went backwards after {op:?}");
        last = w.e.f.now();
    }
    // everything terminates: a bounded settle returns (a managed ring that ENABLEs itself may
    // legitimately run forever, so the bound, not idleness, is what is checked)
    w.e.f.settle(100_000);
    w.e.f.check_invariants().map_err(TestCaseError::fail)?;
    let c = *w.e.f.counters();
    let other = c.steps.checked_sub(c.wqes_executed + c.wqes_flushed);
    prop_assert!(other.is_some_and(|o| o >= c.rnr_naks), "steps = executions + flushes + RNR waits");
    prop_assert_eq!(c.total_completions(), c.completions_by_status().map(|(_, n)| n).sum::<u64>());
    Ok((w.e.f.digest(), w.e.f.now(), c))
}

fn cases() -> u32 {
    std::env::var("OMW_PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(24)
}

fn config(bits: u8) -> NicConfig {
    let mut c = NicConfig::strict();
    if bits & 1 != 0 {
        c = c.with_conformance(Conformance::RxeCompatible);
    }
    if bits & 2 != 0 {
        c = c.with_prefetch(1 + (bits >> 4) as u32 % 4);
    }
    if bits & 4 != 0 {
        c = c.with_offload(false);
    }
    c.cq_capacity = 1 + (bits >> 3) as u32 % 8 * 4;
    c
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn random_operations_never_panic_and_stay_consistent(
        bits in any::<u8>(),
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let cfg = config(bits);
        let a = run(cfg, &ops)?;
        let b = run(cfg, &ops)?;
        prop_assert_eq!(a, b, "same operations, same run");
    }
}
