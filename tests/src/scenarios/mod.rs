//! The scenario list, one file per area. Each scenario is moved from a backend's old test (its
//! doc comment names where from) and runs on every testbed that has what it `needs`.

use crate::runner::Scenario;
use crate::testbed::Testbed;
use omw_core::cn::Allocation;
use omw_core::device::WcStatus;
use omw_core::ids::GroupId;

pub mod alloc;
pub mod control_plane;
pub mod crash_reclaim;
pub mod empty_available;
pub mod faults;
pub mod isolation;
pub mod quota;
pub mod reference;
pub mod stall;

/// Every scenario, in a stable order.
pub fn all() -> Vec<Scenario> {
    [
        alloc::LIST,
        isolation::LIST,
        crash_reclaim::LIST,
        quota::LIST,
        empty_available::LIST,
        faults::LIST,
        stall::LIST,
        reference::LIST,
        control_plane::LIST,
    ]
    .concat()
}

/// Write a secret over the whole chunk.
pub fn soil(t: &mut dyn Testbed, cn: usize, a: &Allocation) {
    let secret = vec![0x5Au8; a.length as usize];
    assert_eq!(t.write(cn, a, 0, 0, &secret), WcStatus::Success);
}

/// CN `cn` allocates until it holds group `g` again (the others go back) and returns its bytes.
pub fn reread(t: &mut dyn Testbed, cn: usize, g: GroupId, why: &str) -> Vec<u8> {
    let mut others = Vec::new();
    for _ in 0..t.spec().chunks {
        let a = t.alloc(cn).unwrap_or_else(|e| panic!("{why}: {e}"));
        if t.group_of(&a) == Some(g) {
            let (st, got) = t.read(cn, &a, 0, 0, a.length as usize);
            assert_eq!(st, WcStatus::Success, "{why}");
            t.free(cn, &a).unwrap();
            for o in others {
                t.free(cn, &o).unwrap();
            }
            return got;
        }
        others.push(a);
    }
    panic!("{why}: group {g:?} never came back");
}

/// The honest CNs' round: allocate, use, free — every step must succeed.
pub fn honest_round(t: &mut dyn Testbed, cns: std::ops::Range<usize>, round: usize) {
    for i in cns {
        let a = t.alloc(i).unwrap_or_else(|e| panic!("round {round}: cn{i} saw {e}"));
        assert_eq!(t.write(i, &a, 0, 0, b"honest"), WcStatus::Success, "round {round}");
        let (st, got) = t.read(i, &a, 1 % a.rkeys.len(), 0, 6);
        assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"honest"[..]), "round {round}");
        t.free(i, &a).unwrap_or_else(|e| panic!("round {round}: cn{i} free saw {e}"));
    }
}

/// A hostile access was refused: `REM_ACCESS_ERR` — or, on a testbed without `REVIVE`, any
/// failure (a QP an earlier refusal killed refuses everything).
#[track_caller]
pub fn denied(t: &dyn Testbed, st: WcStatus, what: &str) {
    if t.caps().contains(crate::testbed::Caps::REVIVE) {
        assert_eq!(st, WcStatus::RemAccessErr, "{what}");
    } else {
        assert_ne!(st, WcStatus::Success, "{what}");
    }
}

/// Invariants, with the context in the panic.
#[track_caller]
pub fn invariants(t: &mut dyn Testbed, what: &str) {
    t.check_invariants().unwrap_or_else(|e| panic!("{what}: invariant broken: {e}"));
}
