//! OneSidedMW end to end on the loopback model, in both execution modes.

use omw_core::backend::{ExecutionMode, WcStatus};
use omw_loopback::cluster::{Cluster, ClusterConfig};
use omw_loopback::NicConfig;

fn cluster(mode: ExecutionMode) -> Cluster {
    let mut cfg = ClusterConfig::paper_like();
    cfg.mode = Some(mode);
    if mode == ExecutionMode::HostEngine {
        cfg.nic = NicConfig::strict().with_offload(false).with_prefetch(8);
    }
    Cluster::new(cfg).unwrap()
}

#[test]
fn six_cns_allocate_access_free_reuse_offloaded() {
    end_to_end(ExecutionMode::Offloaded);
}

#[test]
fn six_cns_allocate_access_free_reuse_host_engine() {
    end_to_end(ExecutionMode::HostEngine);
}

fn end_to_end(mode: ExecutionMode) {
    let mut c = cluster(mode);
    assert_eq!(c.mode, mode);
    c.check_invariants().unwrap();
    let mut held = Vec::new();
    for i in 0..6 {
        for _ in 0..3 {
            let a = c.alloc(i).unwrap_or_else(|e| panic!("cn{i} alloc: {e}"));
            c.check_invariants().unwrap();
            for q in 0..2 {
                let data = format!("cn{i} qp{q} {:#x}", a.base).into_bytes();
                assert_eq!(c.write(i, &a, q, 64 * q as u64, &data), WcStatus::Success);
                let (st, got) = c.read(i, &a, q, 64 * q as u64, data.len());
                assert_eq!(st, WcStatus::Success);
                assert_eq!(got, data);
            }
            held.push((i, a));
        }
    }
    let free_before = c.free_groups();
    for (i, a) in held.drain(..) {
        c.free(i, &a).unwrap();
        c.check_invariants().unwrap();
    }
    assert_eq!(c.free_groups(), free_before + 18);
    // reuse
    for i in 0..6 {
        let a = c.alloc(i).unwrap();
        assert_eq!(c.write(i, &a, 1, 0, b"again"), WcStatus::Success);
        c.free(i, &a).unwrap();
    }
    c.check_invariants().unwrap();
}

#[test]
fn offloaded_allocations_cost_the_mn_cpu_nothing() {
    let mut c = cluster(ExecutionMode::Offloaded);
    let events0 = c.mn_cpu_events;
    let cpu0 = c.fabric.borrow().host_stats(c.mn_host).unwrap();
    let loop_qp = c.driver.mn.cn(c.cns[0].id).unwrap().qps.alloc_loop.unwrap();
    let exec0 = c.fabric.borrow().qp_stats(omw_loopback::QpAddr::new(c.mn_host, loop_qp)).unwrap().wqes_executed;
    let a = c.alloc(0).unwrap();
    assert_eq!(c.write(0, &a, 0, 0, b"x"), WcStatus::Success);
    c.free(0, &a).unwrap();
    assert_eq!(c.mn_cpu_events, events0, "MN CPU events during an offloaded alloc + free");
    let cpu1 = c.fabric.borrow().host_stats(c.mn_host).unwrap();
    assert_eq!(cpu1.cpu_events, cpu0.cpu_events);
    let exec1 = c.fabric.borrow().qp_stats(omw_loopback::QpAddr::new(c.mn_host, loop_qp)).unwrap().wqes_executed;
    assert!(exec1 > exec0 + 20, "the alloc chain ran in the modelled NIC ({} WQEs)", exec1 - exec0);
}

#[test]
fn host_engine_allocations_are_mn_cpu_events() {
    let mut c = cluster(ExecutionMode::HostEngine);
    let events0 = c.mn_cpu_events;
    let a = c.alloc(0).unwrap();
    c.free(0, &a).unwrap();
    assert_eq!(c.mn_cpu_events - events0, 2, "one event per request");
}
