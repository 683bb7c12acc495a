//! The MN's own control plane racing the chains (issue 20, DESIGN.md §9): every MN CPU path that
//! returns groups — the audit, lazy quota enforcement, crash reclaim — runs while chains of the
//! same CN may still execute. Each scenario starts the CN's chain, lets the NIC run a number of
//! steps (every point of the lap in turn), then lets the MN act, and checks after every run:
//! the invariants (no group in the queue twice, none free with a bound window, no hole), a free
//! count that matches the pool, and an honest CN that gets every remaining chunk and keeps its
//! bytes. Before "quiesce, decide, push" (mn/quiesce.rs) the first two broke on the loopback
//! model in both WQE forms: a duplicate slot or a hole in the live queue.

use super::invariants;
use crate::runner::{Outcome, Scenario};
use crate::testbed::{Caps, Factory, MnSpec, Refusal, Testbed};
use omw_core::cn::Allocation;
use omw_core::device::WcStatus;
use omw_core::wire::message::ErrorCode;

pub const LIST: &[Scenario] = &[
    Scenario {
        name: "control_plane::audit_reclaim_races_the_owners_free",
        needs: Caps::OFFLOAD
            .union(Caps::NAMED_QPS)
            .union(Caps::NIC_STEPS)
            .union(Caps::CONTENTION)
            .union(Caps::INTERLEAVING),
        run: audit_vs_free,
    },
    Scenario {
        name: "control_plane::quota_enforcement_races_the_over_quota_cns_free",
        needs: Caps::OFFLOAD.union(Caps::NIC_STEPS).union(Caps::CONTENTION).union(Caps::INTERLEAVING),
        run: quota_vs_free,
    },
    Scenario {
        name: "control_plane::crash_mid_alloc_while_the_mn_interleaves",
        needs: Caps::CRASH.union(Caps::NIC_STEPS).union(Caps::CONTENTION).union(Caps::INTERLEAVING),
        run: crash_mid_alloc_interleaved,
    },
];

/// NIC steps before the MN acts: every point of a lap (a free lap is ~40 WQEs on the model).
const STEPS: core::ops::RangeInclusive<u64> = 0..=48;

/// After the race: the pool adds up, and honest CN `cn` gets every chunk that is free — each one
/// writable and read back — then gives them back.
fn honest_takes_everything(t: &mut dyn Testbed, cn: usize, held_elsewhere: u32, why: &str) {
    invariants(t, why);
    let chunks = t.spec().chunks;
    assert_eq!(t.unallocated(), chunks - held_elsewhere, "{why}: free count");
    // what the other CNs' alloc chains popped ahead is theirs to hand out
    let others_ahead: u32 = (0..t.spec().cns).filter(|i| *i != cn).map(|i| t.ahead_count(i)).sum();
    let mut got: Vec<Allocation> = Vec::new();
    while let Ok(a) = t.alloc(cn) {
        let tag = format!("{why} #{}", got.len());
        assert_eq!(t.write(cn, &a, 0, 0, tag.as_bytes()), WcStatus::Success, "{why}");
        got.push(a);
        assert!(got.len() as u32 <= chunks, "{why}: more chunks than the pool has (a duplicate)");
    }
    assert_eq!(got.len() as u32, chunks - held_elsewhere - others_ahead, "{why}: every free chunk once");
    for (i, a) in got.iter().enumerate() {
        let tag = format!("{why} #{i}");
        let (st, bytes) = t.read(cn, a, 0, 0, tag.len());
        assert_eq!((st, bytes), (WcStatus::Success, tag.into_bytes()), "{why}: an honest chunk kept its bytes");
    }
    for a in &got {
        t.free(cn, a).unwrap_or_else(|e| panic!("{why}: honest free: {e}"));
    }
    invariants(t, why);
    assert_eq!(t.unallocated(), chunks - held_elsewhere, "{why}: after the honest round");
}

/// A CN names another CN's QP for one of its own access windows (the audit reclaims such a
/// group) and frees that group while the audit runs — the audit's reclaim and the free chain's
/// push must not both land.
fn audit_vs_free(f: &dyn Factory) -> Outcome {
    // schedule 0: the MN acts only where the test says; others: NIC steps also pre-empt the
    // MN's own accesses and waits during the audit (where the testbed can interleave)
    for seed in 0..=8u64 {
        for steps in STEPS {
            let mut t = f.start(MnSpec::new(2, 4).quota(8));
            let victim = t.access_qpns(1);
            let own = t.access_qpns(0);
            let a = match t.alloc_naming(0, &[victim[0], own[1]]) {
                // chains that bind only to the poster on a device that refuses a bind naming
                // another QP: nothing was handed out, so nothing to race
                Err(Refusal::Mn(ErrorCode::AllocFailed)) if t.windows_on_alloc_qp(0) => {
                    honest_takes_everything(&mut *t, 1, 0, "the foreign bind refused");
                    continue;
                }
                r => r?,
            };
            if seed != 0 {
                t.set_interleaving(seed, 500);
            }
            t.free_begin(0, &a)?;
            t.nic_steps(steps);
            // the MN's tick right now (its audit), not after the NIC ran idle
            t.tick();
            if seed != 0 {
                t.set_interleaving(seed, 0);
            }
            let why = format!("audit after {steps} NIC steps of the free, schedule {seed}");
            honest_takes_everything(&mut *t, 1, 0, &why);
        }
    }
    Ok(())
}

/// A CN over its quota (offloaded enforcement is lazy) frees one of its groups while the MN
/// enforces the quota — the second half of the free chain must not push after the MN took
/// everything back.
fn quota_vs_free(f: &dyn Factory) -> Outcome {
    let mut enforced_mid_free = 0u32;
    for steps in STEPS {
        let mut t = f.start(MnSpec::new(2, 6).quota(2));
        let a = t.alloc(0)?;
        let _b = t.alloc(0)?;
        // the third allocation exceeds the quota; the chains cannot count, so it succeeds
        let over = t.alloc(0);
        t.free_begin(0, &a)?;
        t.nic_steps(steps);
        t.audit();
        // a free that finished before the audit brought the CN back within its quota
        let enforced = t.stats().quota_disconnects > 0;
        enforced_mid_free += u32::from(enforced && steps > 0);
        let held = if enforced { 0 } else { 2 };
        let why =
            format!("quota audit after {steps} NIC steps of the free (enforced {enforced}, third alloc {over:?})");
        honest_takes_everything(&mut *t, 1, held, &why);
    }
    assert!(enforced_mid_free > 0, "no run enforced the quota while the free was under way");
    Ok(())
}

/// A CN crashes part-way through an alloc lap while the MN CPU acts between NIC steps (the
/// fuzz find `mn_events`: a crash reclaim racing the lap's binds left a free group bound).
fn crash_mid_alloc_interleaved(f: &dyn Factory) -> Outcome {
    for seed in 1..=12u64 {
        for steps in [3u64, 9, 14, 19, 24, 30] {
            let mut t = f.start(MnSpec::new(2, 4).quota(8));
            let _held = t.alloc(0)?;
            t.set_interleaving(seed, 400);
            let _tok = t.alloc_begin(0)?;
            t.nic_steps(steps);
            t.crash(0);
            t.tick();
            honest_takes_everything(&mut *t, 1, 0, &format!("crash after {steps} steps, schedule {seed}"));
        }
    }
    Ok(())
}
