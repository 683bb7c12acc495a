//! A CN that stops responding, or vanishes, delays only itself (DESIGN.md §9, issue 10): on
//! the loopback cluster in every mode. Every send the MN makes to a CN uses finite transport
//! budgets (the model's RNR and retry budgets), every host-engine step has a deadline, and MN
//! messages never sit on a queue a bind is posted on; a CN the transport cannot reach is
//! evicted and everything it held reclaimed, while the others keep allocating and freeing
//! without seeing an error. A host that vanishes without a disconnect is found by the lease.

use omw_core::backend::WcStatus;
use omw_loopback::cluster::Cluster;
use omw_tests::{Mode, MODES};

const CHUNKS: u32 = 16;

fn cluster(mode: Mode) -> Cluster {
    omw_tests::cluster(mode, 3, CHUNKS, true)
}

/// The honest CNs' round: allocate, use, free — every step must succeed.
fn honest_round(c: &mut Cluster, mode: Mode, round: usize) {
    for i in 0..2 {
        let a = c.alloc(i).unwrap_or_else(|e| panic!("{mode:?} round {round}: cn{i} saw {e}"));
        assert_eq!(c.write(i, &a, 0, 0, b"honest"), WcStatus::Success, "{mode:?} round {round}");
        let (st, got) = c.read(i, &a, 0, 0, 6);
        assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"honest"[..]), "{mode:?} round {round}");
        c.free(i, &a).unwrap_or_else(|e| panic!("{mode:?} round {round}: cn{i} free saw {e}"));
    }
}

#[test]
fn a_cn_that_never_posts_receives_is_evicted_and_delays_no_one() {
    for mode in MODES {
        let mut c = cluster(mode);
        let held = c.alloc(2).unwrap();
        c.stall_cn(2);
        for round in 0..24 {
            // the stalled CN keeps asking; its replies land only while receives it posted earlier last
            if c.alloc_begin(2).is_ok() {
                // it never reads the reply: let it ask again
                c.cns[2].client_mut().abandon_pending();
            }
            honest_round(&mut c, mode, round);
        }
        assert!(!c.is_served(2), "{mode:?}: the stalled CN was never evicted");
        assert!(c.driver.mn.stats().cns_evicted >= 1);
        // everything it held came back (and clean)
        assert_eq!(c.free_groups(), CHUNKS, "{mode:?}");
        let _ = held;
        c.check_invariants().unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        honest_round(&mut c, mode, 99);
    }
}

#[test]
fn a_cn_whose_notices_cannot_land_is_evicted() {
    for mode in MODES {
        let mut c = cluster(mode);
        c.stall_cn(2);
        // empty / available cycles broadcast notices to every CN, the stalled one included
        for round in 0..12 {
            let mut held = Vec::new();
            while let Ok(a) = c.alloc(0) {
                held.push(a);
            }
            assert!(c.alloc(1).is_err(), "{mode:?}: the pool is empty");
            for a in &held {
                c.free(0, a).unwrap_or_else(|e| panic!("{mode:?} round {round}: {e}"));
            }
            c.tick().unwrap();
            let a = c.alloc(1).unwrap_or_else(|e| panic!("{mode:?} round {round}: cn1 after available: {e}"));
            c.free(1, &a).unwrap();
        }
        assert!(!c.is_served(2), "{mode:?}: a CN whose notices pile up is evicted");
        assert_eq!(c.free_groups(), CHUNKS);
        c.check_invariants().unwrap_or_else(|e| panic!("{mode:?}: {e}"));
    }
}

#[test]
fn a_cn_that_vanishes_silently_is_reclaimed_by_the_lease() {
    for mode in MODES {
        let mut c = cluster(mode);
        let lease = c.driver.mn.config().lease_ns;
        assert!(lease > 0, "the lease is on by default");
        let a = c.alloc(2).unwrap();
        let b = c.alloc(2).unwrap();
        let _ = (a, b);
        let t0 = c.now();
        c.vanish_cn(2).unwrap();
        // no connection manager says anything: the MN must find out by itself
        let mut reclaimed_at = None;
        for step in 0..40 {
            c.advance(lease / 8).unwrap();
            honest_round(&mut c, mode, step);
            if !c.is_served(2) {
                reclaimed_at = Some(c.now() - t0);
                break;
            }
        }
        let t = reclaimed_at.unwrap_or_else(|| panic!("{mode:?}: a vanished CN was never reclaimed"));
        assert!(t <= lease + lease / 4, "{mode:?}: reclaimed only after {t} ns (lease {lease} ns)");
        assert_eq!(c.free_groups(), CHUNKS, "{mode:?}: its chunks came back");
        c.check_invariants().unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        eprintln!("{mode:?}: a vanished CN was reclaimed {:.3} s (modelled) after it vanished", t as f64 / 1e9);
    }
}

#[test]
fn the_lease_never_evicts_a_cn_that_answers() {
    for mode in MODES {
        let mut c = cluster(mode);
        let lease = c.driver.mn.config().lease_ns;
        for step in 0..20 {
            c.advance(lease / 2).unwrap();
            assert!(c.driver.mn.stats().probes_sent > 0 || step == 0);
        }
        for i in 0..3 {
            assert!(c.is_served(i), "{mode:?}: cn{i} was evicted although it answers");
        }
        assert_eq!(c.driver.mn.stats().cns_evicted, 0);
        honest_round(&mut c, mode, 0);
    }
}
