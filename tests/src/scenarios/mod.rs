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

/// Some CN allocates until it holds group `g` again — CN `cn` first; where the MN's alloc chains
/// pop ahead (`omw_core::chain::alloc`) the group may be held ahead for another CN, which then
/// takes it — and returns its bytes (everything else allocated goes back).
pub fn reread(t: &mut dyn Testbed, cn: usize, g: GroupId, why: &str) -> Vec<u8> {
    let cns = t.spec().cns;
    let mut others = Vec::new();
    for c in (0..cns).map(|k| (cn + k) % cns) {
        for _ in 0..t.spec().chunks {
            let Ok(a) = t.alloc(c) else { break };
            if t.group_of(&a) == Some(g) {
                let (st, got) = t.read(c, &a, 0, 0, a.length as usize);
                assert_eq!(st, WcStatus::Success, "{why}");
                t.free(c, &a).unwrap();
                for (o, a) in others {
                    t.free(o, &a).unwrap();
                }
                return got;
            }
            others.push((c, a));
        }
    }
    panic!("{why}: group {g:?} never came back");
}

/// Everything CN `cn` can still allocate (until the MN refuses it).
pub fn drain(t: &mut dyn Testbed, cn: usize) -> Vec<Allocation> {
    let mut held = Vec::new();
    while let Ok(a) = t.alloc(cn) {
        held.push(a);
        assert!(held.len() as u32 <= t.spec().chunks, "more chunks than the pool has");
    }
    held
}

/// A refusal that means "the pool is empty": the MN's answer, or — where the CN heard "empty"
/// before it asked (an alloc chain that pops ahead found the queue empty) — its client's
/// back-off.
pub fn is_empty_refusal(r: &crate::testbed::Refusal) -> bool {
    match r {
        crate::testbed::Refusal::Mn(omw_core::wire::message::ErrorCode::Empty) => true,
        crate::testbed::Refusal::Client(m) => m.contains("MN free queue empty"),
        _ => false,
    }
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
