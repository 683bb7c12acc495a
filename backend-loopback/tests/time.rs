//! Modelled time: calibration, processing units (per-QP order, parallel QPs, responder
//! units), binds as per-QP fences, gated WQE fetches, loopback PCIe costs, same-address atomics,
//! the shared link, WAITs that only see arrived completions, CPU time, monotonicity, determinism.

mod common;
use common::*;
use omw_core::access::AccessFlags;
use omw_core::device::WcStatus;
use omw_core::wire::wqe::{Opcode, QueueSel, Wqe, WqeFlags};
use omw_loopback::{CostModel, Fabric, MessageFilter, NicConfig, PdId, QpAddr, QpConfig, TimedCompletion};

fn times(f: &mut Fabric, q: QpAddr) -> Vec<u64> {
    f.settle(10_000);
    f.poll_timed(q, QueueSel::Send).unwrap().iter().map(|c| c.at).collect()
}

fn loop_qp(e: &mut Env) -> QpAddr {
    e.f.create_connected_pair(e.mn, QpConfig::default(), e.mn, QpConfig::default()).unwrap().0
}

fn one_unit() -> NicConfig {
    NicConfig::strict().with_cost(CostModel::CX6.with_units(1))
}

#[test]
fn read_latency_is_calibrated() {
    let c = CostModel::CX6;
    let mut e = env(NicConfig::strict());
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(times(&mut e.f, e.c), vec![2900], "§2: a one-sided READ is 2.9 µs (wire_ns is set from it)");
    // a loopback READ never leaves the NIC: issue, responder, DMA read of the source, posted
    // write of the destination
    let a = loop_qp(&mut e);
    let t0 = e.f.now();
    e.f.post_send(a, &Wqe::read(e.pool + 64, e.pool_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    let loopback = c.wqe_ns + c.responder_ns + c.pcie_read_ns + c.pcie_write_ns;
    assert_eq!(times(&mut e.f, a), vec![t0 + loopback]);
    // a loopback WRITE completes when the responder took it: issue, DMA read of the payload
    let t0 = e.f.now();
    e.f.post_send(a, &Wqe::write(e.pool + 64, e.pool_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(times(&mut e.f, a), vec![t0 + c.wqe_ns + c.pcie_read_ns + c.responder_ns]);
    // payload bytes cost serialisation time on the link
    let t0 = e.f.now();
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 4096, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(times(&mut e.f, e.c), vec![t0 + 2900 + c.bytes_ns(4096)]);
}

#[test]
fn one_qp_runs_in_order_and_qps_on_different_units_in_parallel() {
    let w = CostModel::CX6.wqe_ns;
    for (cfg, serial) in [(one_unit(), true), (NicConfig::strict(), false)] {
        let mut e = env(cfg);
        let a = loop_qp(&mut e);
        let b = loop_qp(&mut e);
        e.f.post_send(a, &Wqe::nop()).unwrap();
        e.f.post_send(a, &Wqe::nop()).unwrap();
        e.f.post_send(b, &Wqe::nop()).unwrap();
        e.f.post_send(e.c, &Wqe::nop()).unwrap(); // another host: in parallel
        e.f.settle(100);
        let ta: Vec<u64> = e.f.poll_timed(a, QueueSel::Send).unwrap().iter().map(|c| c.at).collect();
        let tb = e.f.poll_timed(b, QueueSel::Send).unwrap()[0].at;
        let tc = e.f.poll_timed(e.c, QueueSel::Send).unwrap()[0].at;
        assert_eq!(tc, w);
        if serial {
            // one unit: three WQEs one after the other, whatever the interleaving
            let mut all = vec![ta[0], ta[1], tb];
            all.sort();
            assert_eq!(all, vec![w, 2 * w, 3 * w]);
            assert!(ta[0] < ta[1]);
        } else {
            assert_eq!((ta, tb), (vec![w, 2 * w], w), "a's second NOP waits for its first; b does not");
        }
    }
}

#[test]
fn binds_fence_their_qp_not_the_unit() {
    let c = CostModel::CX6;
    let mut e = env(one_unit());
    let mw = e.f.alloc_mw(e.mn, PdId(0)).unwrap().next_key();
    let m = e.m;
    let other = loop_qp(&mut e); // same (only) unit of the MN
    let w = Wqe::bind_mw(mw.0, e.pool, 64, e.pool_k.lkey, m.qpn.get(), AccessFlags::REMOTE_READ);
    e.f.post_send(m, &w).unwrap();
    e.f.post_send(m, &Wqe::nop()).unwrap();
    e.f.post_send(other, &Wqe::nop()).unwrap();
    assert_eq!(times(&mut e.f, m), vec![c.bind_ns, c.bind_ns + c.wqe_ns]);
    let t = e.f.poll_timed(other, QueueSel::Send).unwrap()[0].at;
    assert_eq!(t, c.bind_unit_ns + c.wqe_ns, "the unit was busy only for the bind's issue");
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
fn a_wait_sees_only_completions_whose_time_has_come_and_the_next_wqe_is_fetched() {
    let c = CostModel::CX6;
    for prefetch in [false, true] {
        // a NIC whose prefetch stops at an unsatisfied WAIT (the paper's answer; the model's
        // default fetches past it)
        let base = NicConfig::strict().with_behaviour(omw_core::device::behaviour::DeviceBehaviour::PAPER);
        let cfg = if prefetch { base.with_prefetch(4) } else { base };
        let mut e = env(cfg);
        // CN QP c: a READ whose CQE is generated at 2.9 µs; a second CN QP waits for it
        let (c2, _m2) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
        e.f.post_send(c2, &Wqe::wait(e.c.qpn.get(), QueueSel::Send, 1)).unwrap();
        e.f.post_send(c2, &Wqe::nop()).unwrap();
        e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
        // the WAIT is a WQE; the NOP behind it is fetched over PCIe once the gate opens
        // (prefetching stops after an unsatisfied WAIT, so it does not help)
        assert_eq!(times(&mut e.f, c2), vec![2900 + c.wqe_ns + c.pcie_read_ns + c.wqe_ns]);
        assert_eq!(e.f.counters().gated_fetches, 1);
    }
}

#[test]
fn enable_of_a_queue_that_ran_dry_pays_a_fetch() {
    let c = CostModel::CX6;
    let mut e = env(NicConfig::strict());
    let (t, _) = e.f.create_connected_pair(e.mn, QpConfig::managed(8, 8), e.mn, QpConfig::default()).unwrap();
    let a = loop_qp(&mut e);
    e.f.post_send(t, &Wqe::nop()).unwrap();
    e.f.post_send(a, &Wqe::enable(t.qpn.get(), QueueSel::Send, 1)).unwrap();
    // ENABLE issued at 0, done at wqe_ns; the released NOP is fetched, then runs
    assert_eq!(times(&mut e.f, t), vec![c.wqe_ns + c.pcie_read_ns + c.wqe_ns]);
    assert_eq!(e.f.counters().gated_fetches, 1);
}

#[test]
fn responder_work_runs_on_the_responder_qps_unit() {
    let r = CostModel::CX6.responder_ns;
    for (cfg, expect) in [(one_unit(), vec![2900, 2900 + r]), (NicConfig::strict(), vec![2900, 2900])] {
        let mut e = env(cfg);
        let (c2, _m2) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
        let cn2 = e.f.add_host("cn2").unwrap();
        let (buf2, k2) = e.f.alloc_mr(cn2, PdId(0), 64, 8, AccessFlags::LOCAL_WRITE).unwrap();
        let (c3, _m3) = e.f.create_connected_pair(cn2, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
        e.f.post_send(c2, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
        e.f.post_send(c3, &Wqe::read(buf2, k2.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
        e.f.settle(100);
        let mut t: Vec<u64> = [c2, c3].iter().map(|q| e.f.poll_timed(*q, QueueSel::Send).unwrap()[0].at).collect();
        t.sort();
        assert_eq!(t, expect, "one unit takes them in turn; two units in parallel");
    }
}

#[test]
fn same_address_atomics_serialise_in_the_responder() {
    let c = CostModel::CX6;
    for (other, gap) in [(0u64, c.atomic_same_addr_ns), (8, 0)] {
        let mut e = env(NicConfig::strict());
        let (c2, _m2) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
        e.f.post_send(e.c, &Wqe::fetch_add(e.buf, e.buf_k.lkey, e.pool, e.pool_k.rkey, 1)).unwrap();
        e.f.post_send(c2, &Wqe::fetch_add(e.buf + 8, e.buf_k.lkey, e.pool + other, e.pool_k.rkey, 1)).unwrap();
        e.f.settle(100);
        let mut t: Vec<u64> = [e.c, c2].iter().map(|q| e.f.poll_timed(*q, QueueSel::Send).unwrap()[0].at).collect();
        t.sort();
        assert_eq!(t[1] - t[0], gap, "address offset {other}");
    }
}

#[test]
fn a_hosts_link_is_shared_by_its_qps() {
    let c = CostModel::CX6;
    let mut e = env(NicConfig::strict());
    let (c2, _m2) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
    for q in [e.c, c2] {
        e.f.post_send(q, &Wqe::write(e.buf, e.buf_k.lkey, 4096, e.pool, e.pool_k.rkey)).unwrap();
    }
    e.f.settle(100);
    let mut t: Vec<u64> = [e.c, c2].iter().map(|q| e.f.poll_timed(*q, QueueSel::Send).unwrap()[0].at).collect();
    t.sort();
    assert_eq!(t[1] - t[0], c.bytes_ns(4096), "the second WRITE's payload leaves after the first's");
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
    let (b, _) = scenario(NicConfig::strict().with_cost(CostModel { wire_ns: 1000, ..CostModel::CX6 }));
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
        let key = (ev.host, ev.completion.qpn, matches!(ev.completion.opcode, omw_core::device::WcOpcode::Send(_)));
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

/// PCIe has a bandwidth (`CostModel::pcie_per_byte_ps`): a loopback transfer — a chain's copy,
/// the free chain's scrub — never touches the link, so its DMAs set its pace.
#[test]
fn a_loopback_transfer_pays_its_pcie_bandwidth() {
    let c = CostModel::CX6;
    let mut e = env(NicConfig::strict());
    let a = loop_qp(&mut e);
    let t0 = e.f.now();
    e.f.post_send(a, &Wqe::write(e.pool + 32768, e.pool_k.lkey, 16384, e.pool, e.pool_k.rkey)).unwrap();
    let expect = t0 + c.wqe_ns + c.pcie_read_ns + c.pcie_ns(16384) + c.responder_ns;
    assert_eq!(times(&mut e.f, a), vec![expect]);
    // ≈ 1.3 µs of PCIe for 16 KiB; a 1 MiB scrub would take ≈ 84 µs
    assert_eq!(c.pcie_ns(16384), 1310);
    assert_eq!(c.pcie_ns(1 << 20), 83_886);
}

/// Key contexts the NIC cannot keep on chip (`CostModel::key_cache_entries`) are fetched over
/// PCIe: two keys contending for one slot make every alternate access miss.
#[test]
fn key_contexts_missing_from_the_nics_cache_cost_a_pcie_read() {
    let c = CostModel { key_cache_entries: 1, ..CostModel::CX6 };
    let mut e = env(NicConfig::strict().with_cost(c));
    let (pool2, k2) =
        e.f.alloc_mr(e.mn, PdId(0), 4096, 4096, AccessFlags::REMOTE_READ | AccessFlags::LOCAL_WRITE).unwrap();
    let read = |e: &mut Env, addr: u64, rkey: u32| {
        let t0 = e.f.now();
        e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, addr, rkey)).unwrap();
        times(&mut e.f, e.c)[0] - t0
    };
    let (pool, k) = (e.pool, e.pool_k.rkey);
    assert_eq!(read(&mut e, pool, k), 2900, "installed in the free slot");
    assert_eq!(read(&mut e, pool, k), 2900);
    assert_eq!(read(&mut e, pool2, k2.rkey), 2900 + c.pcie_read_ns, "evicts the other");
    assert_eq!(read(&mut e, pool, k), 2900 + c.pcie_read_ns);
}
