//! Allocate, access, free, reuse; where the work happens (MN CPU or NIC); what a bind binds.

use super::invariants;
use crate::runner::{Outcome, Scenario};
use crate::testbed::{Caps, Factory, MnSpec};
use omw_core::device::{ExecutionMode, MwBinding, WcStatus};

pub const LIST: &[Scenario] = &[
    Scenario { name: "alloc::six_cns_allocate_access_free_reuse", needs: Caps::NONE, run: six_cns },
    Scenario {
        name: "alloc::offloaded_allocations_cost_the_mn_cpu_nothing",
        needs: Caps::OFFLOAD.union(Caps::MN_ACTIVITY),
        run: offloaded_costs_nothing,
    },
    Scenario {
        name: "alloc::host_engine_allocations_are_mn_cpu_events",
        needs: Caps::HOST_ENGINE.union(Caps::MN_ACTIVITY),
        run: host_engine_events,
    },
    Scenario {
        name: "alloc::windows_are_bound_to_the_requesting_qps_and_are_the_chunk",
        needs: Caps::WINDOW_STATE,
        run: windows_bound_where_asked,
    },
];

/// From tests/tests/loopback_e2e.rs (1 MN + 6 CNs end to end) and rxe_cluster.rs (write and
/// read back through each access QP, free, reallocate).
fn six_cns(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(6, 64));
    invariants(&mut *t, "start");
    let mut held = Vec::new();
    for i in 0..6 {
        for _ in 0..3 {
            let a = t.alloc(i).unwrap_or_else(|e| panic!("cn{i} alloc: {e}"));
            invariants(&mut *t, "alloc");
            for q in 0..2 {
                let data = format!("cn{i} qp{q} {:#x}", a.base).into_bytes();
                assert_eq!(t.write(i, &a, q, 64 * q as u64, &data), WcStatus::Success);
                // read back through the other access QP
                let (st, got) = t.read(i, &a, 1 - q, 64 * q as u64, data.len());
                assert_eq!(st, WcStatus::Success);
                assert_eq!(got, data);
            }
            held.push((i, a));
        }
    }
    let free_before = t.unallocated();
    for (i, a) in held.drain(..) {
        t.free(i, &a)?;
        invariants(&mut *t, "free");
    }
    t.tick();
    assert_eq!(t.unallocated(), free_before + 18);
    // reuse
    for i in 0..6 {
        let a = t.alloc(i)?;
        assert_eq!(t.write(i, &a, 1, 0, b"again"), WcStatus::Success);
        t.free(i, &a)?;
    }
    invariants(&mut *t, "reuse");
    Ok(())
}

/// From loopback_e2e.rs and FPGA chains.rs: the chain ran in the NIC, the MN CPU did nothing.
fn offloaded_costs_nothing(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(2, 16));
    let before = t.activity();
    let a = t.alloc(0)?;
    assert_eq!(t.write(0, &a, 0, 0, b"x"), WcStatus::Success);
    let a2 = t.alloc(0)?;
    assert_ne!(a2.entry_addr, a.entry_addr, "the chain re-armed itself");
    t.free(0, &a)?;
    t.free(0, &a2)?;
    let after = t.activity();
    assert_eq!(after.cpu_events, before.cpu_events, "MN CPU events during offloaded allocs + frees");
    assert_eq!(after.cpu_accesses, before.cpu_accesses);
    assert!(
        after.nic_wqes > before.nic_wqes + 40,
        "the chains ran in the NIC ({} WQEs)",
        after.nic_wqes - before.nic_wqes
    );
    t.tick();
    assert_eq!(t.stats().chains_rearmed, 0, "no chain failed");
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_e2e.rs.
fn host_engine_events(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(2, 16));
    assert_eq!(t.mode(), ExecutionMode::HostEngine);
    let before = t.activity();
    let a = t.alloc(0)?;
    t.free(0, &a)?;
    assert_eq!(t.activity().cpu_events - before.cpu_events, 2, "one event per request");
    Ok(())
}

/// From FPGA chains.rs (`alloc_chain_runs_offloaded_and_binds_windows_to_the_requested_qps`):
/// MW[0] on the CN's Free QP, MW[1..] on the access QPs it named; the window is the chunk; MW[0]
/// is not for data; a window works only through its own QP; the next allocation is another group.
fn windows_bound_where_asked(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(1, 16));
    let a = t.alloc(0)?;
    assert_eq!(a.length, t.chunk_size());
    let g = t.group_of(&a).expect("the allocation is a group");
    let e = t.entry(g).expect("its entry");
    assert_eq!(e.owner(), t.cn_id(0).get(), "the entry records the owner");
    assert_eq!(e.base.get(), a.base);
    let [_, free_qp] = t.mgmt_qpns(0);
    let access = t.access_qpns(0);
    let bound = |t: &mut dyn crate::testbed::Testbed, rk| match t.mw_binding(rk) {
        Some(MwBinding::Bound { qpn, .. }) => Some(qpn),
        _ => None,
    };
    // where the chains bind only to the QP that posts the bind, every window lives on the CN's
    // Alloc QP (which its requests named), MW[0] with no rights
    let on_alloc = t.windows_on_alloc_qp(0);
    let (owner_home, homes) = match on_alloc {
        true => (t.mgmt_qpns(0)[0], vec![t.mgmt_qpns(0)[0]; access.len()]),
        false => (free_qp, access),
    };
    assert_eq!(bound(&mut *t, a.owner_rkey), Some(owner_home), "MW[0] on the CN's Free QP (or Alloc QP)");
    for (k, q) in homes.iter().enumerate() {
        assert_eq!(bound(&mut *t, a.rkeys[k]), Some(*q), "MW[{}] on access QP {k} (or the Alloc QP)", k + 1);
    }
    // the CN writes and reads its chunk through its windows
    assert_eq!(t.write(0, &a, 0, 64, b"hello, chunk"), WcStatus::Success);
    let (st, got) = t.read(0, &a, 1, 64, 12);
    assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"hello, chunk"[..]));
    // the next allocation is another group (before the refusals below: without `REVIVE` they
    // leave this CN's access QPs dead, and with them its message queue)
    let b = t.alloc(0)?;
    assert_ne!(b.entry_addr, a.entry_addr);
    // the window is the chunk: a read over its end is refused (by the window's bounds, or by
    // the chunk's own MR where the device does not enforce them)
    let st = t.read_raw(0, 0, a.base + a.length - 4, a.rkey(0).unwrap(), 8).0;
    assert_eq!(st, WcStatus::RemAccessErr, "past the window's end");
    // a window works only through the QP it is bound to (all of them through the Alloc QP
    // where they live there)
    if !on_alloc {
        let st = t.read_raw(0, 1, a.base, a.rkey(0).unwrap(), 8).0;
        assert_eq!(st, WcStatus::RemAccessErr, "window 0 through access QP 1");
    }
    if t.caps().contains(Caps::REVIVE) {
        // MW[0] is for the ownership proof: not reachable from an access QP
        assert_eq!(t.read_raw(0, 0, a.base, a.owner_rkey, 8).0, WcStatus::RemAccessErr);
        let (st, got) = t.read(0, &a, 0, 64, 12);
        assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"hello, chunk"[..]), "the owner keeps access");
    }
    invariants(&mut *t, "after");
    Ok(())
}
