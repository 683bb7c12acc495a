//! The model is what makes chain-layout mistakes visible: a chain whose patched WQE is not
//! gated works by luck on a NIC that fetches WQEs late, and breaks on one that prefetches —
//! as it would on hardware. The validator rejects it statically.

use omw_core::chain::arm::arm_unchecked;
use omw_core::chain::{ChainError, ChainKind, ChainLayout};
use omw_core::device::DataPath;
use omw_core::device::ExecutionMode;
use omw_core::mn::driver::build;
use omw_core::wire::wqe::{Opcode, Wqe, WqeField, WqeFlags};
use omw_core::wire::wqe_format::WqeFormat;
use omw_loopback::cluster::{Cluster, ClusterConfig};
use omw_loopback::NicConfig;

/// The alloc chain with the gate before the pop READ (whose remote address a copy patches)
/// removed: the pop is enabled together with the phase that produces its address.
fn ungated(layout: &ChainLayout) -> ChainLayout {
    let mut c = layout.clone();
    // the READ of the popped slot: 8 bytes into scratch from an address a copy patches in
    let pop = (0..c.steps.len())
        .find(|&i| {
            let s = &c.steps[i];
            s.wqe.opcode == Opcode::Read
                && s.local.is_none()
                && s.wqe.length == 8
                && c.is_patched(i, WqeField::RemoteAddr)
        })
        .expect("pop READ");
    let loop_qpn = c.qpns[0];
    let gate = (0..pop)
        .rev()
        .find(|i| {
            let w = &c.steps[*i].wqe;
            w.opcode == Opcode::Wait || (w.opcode == Opcode::Enable && w.qpn == loop_qpn && w.operand1 == 0)
        })
        .unwrap();
    if c.steps[gate].wqe.opcode == Opcode::Wait {
        c.steps[gate].wqe = Wqe::nop().with_flags(WqeFlags::empty()).with_wr_id(c.steps[gate].wqe.wr_id);
    } else {
        // the phase this ENABLE released is enabled with the one before (first lap: the arm's
        // initial enable; later laps: the lap-closing ENABLE)
        let n = std::mem::take(&mut c.steps[gate].wqe.operand0);
        c.initial_enable[0] += n as u16;
        let closing = (0..c.steps.len())
            .rev()
            .find(|i| {
                let w = &c.steps[*i].wqe;
                w.opcode == Opcode::Enable && w.qpn == loop_qpn && w.operand1 == 0
            })
            .unwrap();
        c.steps[closing].wqe.operand0 += n;
    }
    c
}

fn run(prefetch: bool) -> (Result<(), ChainError>, bool, Cluster) {
    run_in(prefetch, WqeFormat::Canonical)
}

fn run_in(prefetch: bool, format: WqeFormat) -> (Result<(), ChainError>, bool, Cluster) {
    let mut cfg = ClusterConfig::paper_like();
    cfg.mode = Some(ExecutionMode::Offloaded);
    cfg.cns = 2;
    // the chain is re-armed by hand below, past the MN's repair: no group popped ahead to lose
    cfg.pop_ahead = Some(false);
    cfg.nic = if prefetch { NicConfig::strict().with_prefetch(8) } else { NicConfig::strict() };
    cfg = cfg.with_wqe_format(format);
    let mut c = Cluster::new(cfg).unwrap();
    let cn = c.cns[0].id;
    let env = c.driver.mn.chain_env(cn, ChainKind::Alloc).unwrap();
    let bad = ungated(&build(ChainKind::Alloc, &env).unwrap());
    let verdict = bad.validate();
    let qps = c.driver.mn.cn(cn).unwrap().qps.clone();
    c.driver.backend.reset_qp(qps.alloc_loop.unwrap()).unwrap();
    c.driver.backend.reset_qp(qps.alloc).unwrap();
    arm_unchecked(&mut c.driver.backend, &bad, 1).unwrap();
    c.pump().unwrap();
    let ok = c.alloc(0).is_ok();
    (verdict, ok, c)
}

#[test]
fn ungated_patch_rejected_by_validator_and_broken_under_prefetch() {
    let (verdict, ok_late_fetch, mut c1) = run(false);
    assert!(matches!(verdict, Err(ChainError::UngatedPatch { .. })), "{verdict:?}");
    assert!(ok_late_fetch, "fetching at execution time hides the missing gate");
    c1.check_invariants().unwrap();

    let (_, ok_prefetch, mut c2) = run(true);
    assert!(!ok_prefetch, "with prefetching the pop READ runs with its stale template address");
    // the MN repaired the failed lap: nothing lost, the chain re-armed (correctly) works
    c2.check_invariants().unwrap();
    assert_eq!(c2.free_groups(), 64);
    assert!(c2.alloc(0).is_ok());
}

/// The same in mlx5 form: the model prefetches mlx5 WQEBBs, and the missing gate breaks the
/// chain there too.
#[test]
fn ungated_patch_broken_under_prefetch_in_mlx5_form() {
    let (_, ok_late_fetch, mut c1) = run_in(false, WqeFormat::Mlx5);
    assert!(ok_late_fetch, "fetching at execution time hides the missing gate");
    c1.check_invariants().unwrap();
    let (_, ok_prefetch, mut c2) = run_in(true, WqeFormat::Mlx5);
    assert!(!ok_prefetch, "with prefetching the pop READ runs with its stale template address");
    c2.check_invariants().unwrap();
    assert_eq!(c2.free_groups(), 64);
    assert!(c2.alloc(0).is_ok());
}
