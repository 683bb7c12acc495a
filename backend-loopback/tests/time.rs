//! Modelled time: calibration, NIC serialisation, binds and fences, WAITs that only see
//! arrived completions, CPU time, monotonicity, determinism.

mod common;
use common::*;
use omw_core::access::AccessFlags;
use omw_core::backend::WcStatus;
use omw_core::wqe::{Opcode, QueueSel, Wqe, WqeFlags};
use omw_loopback::{CostModel, Fabric, MessageFilter, NicConfig, PdId, QpAddr, QpConfig, TimedCompletion};

fn times(f: &mut Fabric, q: QpAddr) -> Vec<u64> {
    f.settle(10_000);
    f.poll_timed(q, QueueSel::Send).unwrap().iter().map(|c| c.at).collect()
}

fn loop_qp(e: &mut Env) -> QpAddr {
    e.f.create_connected_pair(e.mn, QpConfig::default(), e.mn, QpConfig::default()).unwrap().0
}

#[test]
fn read_latency_is_calibrated() {
    let c = CostModel::CX6;
    let mut e = env(NicConfig::strict());
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(times(&mut e.f, e.c), vec![2900], "§2: a one-sided READ is 2.9 µs");
    let a = loop_qp(&mut e);
    let t0 = e.f.now();
    e.f.post_send(a, &Wqe::read(e.pool + 64, e.pool_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    let loopback = c.wqe_ns + 2 * c.loopback_hop_ns + c.responder_ns;
    assert_eq!(times(&mut e.f, a), vec![t0 + loopback]);
    // payload bytes cost serialisation time
    let t0 = e.f.now();
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 4096, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(times(&mut e.f, e.c), vec![t0 + 2900 + c.bytes_ns(4096)]);
}

#[test]
fn one_nic_executes_one_wqe_at_a_time() {
    let mut e = env(NicConfig::strict());
    let a = loop_qp(&mut e);
    let b = loop_qp(&mut e);
    e.f.post_send(a, &Wqe::nop()).unwrap();
    e.f.post_send(b, &Wqe::nop()).unwrap();
    e.f.post_send(e.c, &Wqe::nop()).unwrap(); // another host: in parallel
    e.f.settle(100);
    let ta = e.f.poll_timed(a, QueueSel::Send).unwrap()[0].at;
    let tb = e.f.poll_timed(b, QueueSel::Send).unwrap()[0].at;
    let tc = e.f.poll_timed(e.c, QueueSel::Send).unwrap()[0].at;
    let w = CostModel::CX6.wqe_ns;
    assert_eq!((ta.min(tb), ta.max(tb), tc), (w, 2 * w, w));
}

#[test]
fn binds_cost_their_time_and_fence_the_next_wqe() {
    let mut e = env(NicConfig::strict());
    let mw = e.f.alloc_mw(e.mn, PdId(0)).unwrap().next_key();
    let m = e.m;
    let w = Wqe::bind_mw(mw.0, e.pool, 64, e.pool_k.lkey, m.qpn.get(), AccessFlags::REMOTE_READ);
    e.f.post_send(m, &w).unwrap();
    e.f.post_send(m, &Wqe::nop()).unwrap();
    let c = CostModel::CX6;
    assert_eq!(times(&mut e.f, m), vec![c.bind_ns, c.bind_ns + c.wqe_ns]);
}

#[test]
fn fence_waits_for_earlier_reads() {
    let w = CostModel::CX6.wqe_ns;
    for (flags, expect) in [(WqeFlags::SIGNALED, 2 * w), (WqeFlags::SIGNALED | WqeFlags::FENCE, 2900 + w)] {
        let mut e = env(NicConfig::strict());
        e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey).with_flags(WqeFlags::empty()))
            .unwrap();
        e.f.post_send(e.c, &Wqe::nop().with_flags(flags)).unwrap();
        assert_eq!(times(&mut e.f, e.c), vec![expect]);
    }
}

#[test]
fn a_wait_sees_only_completions_whose_time_has_come() {
    let mut e = env(NicConfig::strict());
    // CN QP c: a READ whose CQE is generated at 2.9 µs; a second CN QP waits for it
    let (c2, _m2) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
    e.f.post_send(c2, &Wqe::wait(e.c.qpn.get(), QueueSel::Send, 1)).unwrap();
    e.f.post_send(c2, &Wqe::nop()).unwrap();
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    let w = CostModel::CX6.wqe_ns;
    assert_eq!(times(&mut e.f, c2), vec![2900 + w + w], "the WAIT itself is a WQE");
}

#[test]
fn responder_engine_serialises_incoming_requests() {
    let mut e = env(NicConfig::strict());
    let (c2, _m2) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
    let cn2 = e.f.add_host("cn2").unwrap();
    let (buf2, k2) = e.f.alloc_mr(cn2, PdId(0), 64, 8, AccessFlags::LOCAL_WRITE).unwrap();
    let (c3, _m3) = e.f.create_connected_pair(cn2, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
    e.f.post_send(c2, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    e.f.post_send(c3, &Wqe::read(buf2, k2.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    e.f.settle(100);
    let mut t: Vec<u64> = [c2, c3].iter().map(|q| e.f.poll_timed(*q, QueueSel::Send).unwrap()[0].at).collect();
    t.sort();
    let r = CostModel::CX6.responder_ns;
    assert_eq!(t, vec![2900, 2900 + r], "both arrive together; the MN's responder takes them in turn");
}

#[test]
fn cpu_time_runs_the_nic_meanwhile_and_counts_events() {
    let mut e = env(NicConfig::host_engine());
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    let step = e.f.config().cost.host_engine_step_ns;
    let end = e.f.advance_cpu(e.mn, 10 * step).unwrap();
    assert_eq!(end, 4000);
    assert_eq!(e.f.now(), 4000);
    let v = e.f.poll_timed(e.c, QueueSel::Send).unwrap();
    assert_eq!(v.len(), 1, "the READ completed during the CPU work");
    // a second burst queues behind the first on the same CPU
    e.f.advance_cpu(e.mn, 100).unwrap();
    e.f.count_cpu_event(e.mn).unwrap();
    let s = e.f.host_stats(e.mn).unwrap();
    assert_eq!((s.cpu_events, s.cpu_busy_ns), (3, 4100));
    assert_eq!(e.f.now(), 4100);
    assert_eq!(e.f.host_stats(e.cn).unwrap().cpu_events, 0);
}

/// A workload touching most of the model: binds, windows, SEND/RECV, atomics, a fault, a
/// WAIT chain, an error and its flushes, a reset.
fn scenario(cfg: NicConfig) -> (Fabric, Vec<TimedCompletion>) {
    let mut e = env(cfg);
    let a = loop_qp(&mut e);
    let (c, m, pool, pk, buf, bk) = (e.c, e.m, e.pool, e.pool_k, e.buf, e.buf_k);
    e.f.faults_mut().delay_next(MessageFilter::from_qp(c), 777, 2);
    let mw = e.f.alloc_mw(e.mn, PdId(0)).unwrap().next_key();
    e.f.post_send(a, &Wqe::bind_mw(mw.0, pool, 512, pk.lkey, m.qpn.get(), AccessFlags::DATA_WINDOW)).unwrap();
    e.f.post_send(a, &Wqe::wait(a.qpn.get(), QueueSel::Send, 1)).unwrap();
    e.f.post_send(a, &Wqe::fetch_add(pool + 8, pk.lkey, pool + 1024, pk.rkey, 5)).unwrap();
    for i in 0..4u64 {
        e.f.post_recv(m, &recv(i, &[(pool + 2048 + 16 * i, 16, pk.lkey)])).unwrap();
        e.f.post_send(c, &Wqe::send(buf, bk.lkey, 12).with_wr_id(i)).unwrap();
        e.f.post_send(c, &Wqe::write(buf, bk.lkey, 32, pool + 64 * i, mw.0).with_wr_id(10 + i)).unwrap();
    }
    e.f.run_until_idle(10_000);
    e.f.post_send(c, &Wqe::read(buf, bk.lkey, 8, pool + (64 << 10), mw.0).with_wr_id(99)).unwrap(); // out of the MR
    e.f.post_send(c, &Wqe::nop().with_wr_id(100)).unwrap();
    e.f.settle(10_000);
    e.f.reset_qp(c).unwrap();
    e.f.post_send(c, &Wqe::read(buf, bk.lkey, 8, pool, pk.rkey)).unwrap();
    e.f.settle(10_000);
    let mut all = Vec::new();
    for q in [a, c, m] {
        for s in [QueueSel::Send, QueueSel::Recv] {
            all.extend(e.f.poll_timed(q, s).unwrap());
        }
    }
    e.f.check_invariants().unwrap();
    (e.f, all)
}

#[test]
fn same_calls_same_everything() {
    for cfg in [NicConfig::strict(), NicConfig::rxe_compatible().with_prefetch(4)] {
        let (f1, c1) = scenario(cfg);
        let (f2, c2) = scenario(cfg);
        assert_eq!(c1, c2);
        assert_eq!(f1.digest(), f2.digest());
        assert_eq!(f1.trace(), f2.trace());
        assert_eq!(f1.counters(), f2.counters());
        assert_eq!(f1.now(), f2.now());
        assert!(f1.counters().completions(WcStatus::RemAccessErr) == 1, "{:?} {c1:#?}", f1.counters());
        assert!(f1.counters().completions(WcStatus::WrFlushErr) >= 1);
    }
    // and a different configuration is visibly different
    let (a, _) = scenario(NicConfig::strict());
    let (b, _) = scenario(NicConfig::strict().with_cost(CostModel { wire_hop_ns: 1000, ..CostModel::CX6 }));
    assert_ne!(a.digest(), b.digest());
}

#[test]
fn clock_is_monotonic_and_cq_times_non_decreasing() {
    let (f, all) = scenario(NicConfig::strict().with_prefetch(2));
    let trace = f.trace();
    assert!(!trace.is_empty());
    // per CQ (host, qpn, send/recv), completion times never go backwards
    let mut last = std::collections::HashMap::new();
    for ev in trace {
        let key = (ev.host, ev.completion.qpn, matches!(ev.completion.opcode, omw_core::backend::WcOpcode::Send(_)));
        let prev = last.insert(key, ev.at).unwrap_or(0);
        assert!(ev.at >= prev, "{ev:?}");
    }
    assert!(all.iter().all(|c| c.at <= f.now()), "settled: everything landed");
    // stepping never moves the clock backwards
    let mut e = env(NicConfig::strict());
    let a = loop_qp(&mut e);
    for i in 0..50u64 {
        let w = if i % 3 == 0 { Wqe::read(e.pool + 64, e.pool_k.lkey, 8, e.pool, e.pool_k.rkey) } else { Wqe::nop() };
        let w = if i % 2 == 0 { w } else { Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey) };
        e.f.post_send(if i % 2 == 0 { a } else { e.c }, &w).unwrap();
    }
    let mut prev = 0;
    while let Some(s) = e.f.step() {
        assert!(s.at >= prev);
        assert!(e.f.now() >= s.at);
        prev = s.at;
        assert!(matches!(s.kind, omw_loopback::StepKind::Executed(Opcode::Nop | Opcode::Read)), "{s:?}");
    }
}
