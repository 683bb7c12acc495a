//! A CN that crashes, mid-lap or holding chunks, and an MN RNIC reset: everything comes back.

use super::invariants;
use crate::runner::{Outcome, Scenario};
use crate::testbed::{Caps, Factory, Heard, MnSpec};
use omw_core::device::{MwBinding, WcStatus};

pub const LIST: &[Scenario] = &[
    Scenario { name: "crash::crash_after_allocations_reclaims_everything", needs: Caps::CRASH, run: crash_holding },
    Scenario {
        name: "crash::crash_mid_allocation_loses_nothing",
        needs: Caps::CRASH.union(Caps::NIC_STEPS).union(Caps::CONTENTION),
        run: crash_mid_alloc,
    },
    Scenario { name: "crash::mn_rnic_reset_revokes_and_rebuilds", needs: Caps::RNIC_RESET, run: rnic_reset },
];

/// From loopback_security.rs and rxe_cluster.rs (a killed CN's chunks are reclaimed while the MN
/// keeps serving; every chunk is back afterwards).
fn crash_holding(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 8).quota(16));
    let a = t.alloc(0)?;
    let _b = t.alloc(0)?;
    let other = t.alloc(1)?;
    let before = t.unallocated();
    t.crash(0);
    invariants(&mut *t, "crash");
    assert_eq!(t.unallocated(), before + 2);
    assert!(!t.is_served(0));
    if t.caps().contains(Caps::WINDOW_STATE) {
        assert_eq!(t.mw_binding(a.rkey(0).unwrap()), Some(MwBinding::Unbound));
    }
    assert_eq!(t.write(1, &other, 0, 0, b"fine"), WcStatus::Success);
    // the MN keeps serving: the others get every chunk that is left (but one cn1's alloc chain
    // may hold popped ahead)
    let left = 7 - t.ahead_count(1);
    let mut n = 0;
    while t.alloc(2).is_ok() {
        n += 1;
    }
    assert_eq!(n, left, "every chunk but cn1's is back");
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_security.rs: the CN crashes at many points of its allocation's lap.
fn crash_mid_alloc(f: &dyn Factory) -> Outcome {
    for steps in [1u64, 5, 12, 20, 30, 45, 60] {
        let mut t = f.start(MnSpec::new(3, 4).quota(16));
        let _held = t.alloc(0)?;
        let _tok = t.alloc_begin(0)?;
        t.nic_steps(steps);
        t.crash(0);
        t.tick();
        invariants(&mut *t, &format!("crash after {steps} steps"));
        assert_eq!(t.unallocated(), 4, "crash after {steps} steps");
        t.alloc(1)?;
    }
    Ok(())
}

/// From loopback_security.rs. Policy: an MN RNIC reset revokes every allocation; the pool is
/// rebuilt with every group free and advanced keys, CNs are told `Revoked`, they allocate again.
fn rnic_reset(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 8).quota(16));
    let a = t.alloc(0)?;
    let b = t.alloc(1)?;
    t.reset_mn_rnic();
    invariants(&mut *t, "reset");
    assert_eq!(t.unallocated(), 8);
    for i in 0..3 {
        assert!(t.heard(i).contains(&Heard::Revoked), "cn{i} was told");
    }
    assert_eq!(t.read_raw(0, 0, a.base, a.rkey(0).unwrap(), 8).0, WcStatus::RemAccessErr);
    assert_eq!(t.read_raw(1, 0, b.base, b.rkey(0).unwrap(), 8).0, WcStatus::RemAccessErr);
    let a2 = t.alloc(0)?;
    assert_eq!(t.write(0, &a2, 0, 0, b"after reset"), WcStatus::Success);
    invariants(&mut *t, "after");
    Ok(())
}
