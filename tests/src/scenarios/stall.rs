//! A CN that stops responding, or vanishes, delays only itself (DESIGN.md §9, issue 10): a CN
//! the transport cannot reach is evicted and everything it held reclaimed, while the others keep
//! allocating and freeing without an error. A host that vanishes is found by the lease.

use super::{honest_round, invariants};
use crate::runner::{Outcome, Scenario};
use crate::testbed::{Caps, Factory, MnSpec};

const CHUNKS: u32 = 16;

pub const LIST: &[Scenario] = &[
    Scenario {
        name: "stall::a_cn_that_never_posts_receives_is_evicted_and_delays_no_one",
        needs: Caps::STALL,
        run: never_posts,
    },
    Scenario { name: "stall::a_cn_whose_notices_cannot_land_is_evicted", needs: Caps::STALL, run: notices_pile_up },
    Scenario {
        name: "stall::a_cn_that_vanishes_silently_is_reclaimed_by_the_lease",
        needs: Caps::VANISH.union(Caps::TIME_CONTROL),
        run: vanishes,
    },
    Scenario {
        name: "stall::the_lease_never_evicts_a_cn_that_answers",
        needs: Caps::TIME_CONTROL,
        run: lease_keeps_live_cns,
    },
];

/// From loopback_stall.rs and rxe_stall.rs (a CN that floods requests it never reads).
fn never_posts(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, CHUNKS));
    let _held = t.alloc(2)?;
    t.stall(2);
    for round in 0..24 {
        // the stalled CN keeps asking; its replies land only while receives it posted earlier last
        t.alloc_unread(2);
        honest_round(&mut *t, 0..2, round);
    }
    assert!(!t.is_served(2), "the stalled CN was never evicted");
    assert!(t.stats().cns_evicted >= 1);
    // everything it held came back
    assert_eq!(t.unallocated(), CHUNKS);
    invariants(&mut *t, "after");
    honest_round(&mut *t, 0..2, 99);
    Ok(())
}

/// From loopback_stall.rs: empty / available cycles broadcast notices to every CN, the stalled
/// one included.
fn notices_pile_up(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, CHUNKS));
    t.stall(2);
    for round in 0..12 {
        let held = super::drain(&mut *t, 0);
        // cn1 takes what its alloc chain popped ahead, if it did; then the pool is empty
        let of_cn1 = super::drain(&mut *t, 1);
        assert!(t.alloc(1).is_err(), "the pool is empty");
        for a in &held {
            t.free(0, a).unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        for a in &of_cn1 {
            t.free(1, a).unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        t.tick();
        let a = t.alloc(1).unwrap_or_else(|e| panic!("round {round}: cn1 after available: {e}"));
        t.free(1, &a)?;
    }
    assert!(!t.is_served(2), "a CN whose notices pile up is evicted");
    assert_eq!(t.unallocated(), CHUNKS);
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_stall.rs (verbs-ci's killed-VM step is the deployment's counterpart).
fn vanishes(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, CHUNKS));
    let lease = t.lease_ns();
    assert!(lease > 0, "the lease is on by default");
    t.alloc(2)?;
    t.alloc(2)?;
    let t0 = t.now();
    t.vanish(2);
    // no connection manager says anything: the MN must find out by itself
    let mut reclaimed_at = None;
    for step in 0..40 {
        t.advance(lease / 8);
        honest_round(&mut *t, 0..2, step);
        if !t.is_served(2) {
            reclaimed_at = Some(t.now() - t0);
            break;
        }
    }
    let at = reclaimed_at.expect("a vanished CN was never reclaimed");
    assert!(at <= lease + lease / 4, "reclaimed only after {at} ns (lease {lease} ns)");
    assert_eq!(t.unallocated(), CHUNKS, "its chunks came back");
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_stall.rs.
fn lease_keeps_live_cns(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, CHUNKS));
    let lease = t.lease_ns();
    for step in 0..20 {
        t.advance(lease / 2);
        assert!(t.stats().probes_sent > 0 || step == 0);
    }
    for i in 0..3 {
        assert!(t.is_served(i), "cn{i} was evicted although it answers");
    }
    assert_eq!(t.stats().cns_evicted, 0);
    honest_round(&mut *t, 0..3, 0);
    Ok(())
}
