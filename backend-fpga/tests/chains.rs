//! What only the double shows of the offloaded MN (the protocol scenarios are the conformance
//! suite's, `conformance.rs`): how `MnPlan::provision` laid the MN out in the block's two
//! protection domains, which QP a forged free stops and that the MN re-arms it, what the free
//! chain does to the keys, the rights a bind gives, and a refused request on the Alloc QP.
//! The cluster is `support::mn`.

mod support;

use omw_core::access::AccessFlags;
use omw_core::device::DataPath;
use omw_core::device::{QpState, WcStatus};
use omw_core::ids::{GroupId, Rkey};
use omw_core::mn::plan::ScrubPath;
use omw_core::wire::wqe::Wqe;
use omw_fpga::Domain;
use omw_tests::testbed::{CnQp, MnSpec, Refusal, Testbed};
use support::mn::Cluster;

const REMOTE: AccessFlags = AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE).union(AccessFlags::REMOTE_ATOMIC);

fn ctid(q: omw_core::ids::Qpn) -> u8 {
    (q.get() & 0x3F) as u8
}

#[test]
fn the_mn_is_provisioned_in_two_domains_through_the_plan() {
    let mut s = Cluster::new(MnSpec::new(1, 16));
    assert_eq!(s.plan.scrub, ScrubPath::Nic);
    let be = &s.d.backend;
    let (cn_pd, private) = (be.pd(Domain::CnFacing).unwrap(), be.pd(Domain::MnPrivate).unwrap());
    assert_ne!(cn_pd, private);
    // loop QPs (both ends: the responder is the next ctid down) private; CN-facing QPs CN-facing
    let (al, fl) = s.cns[0].loops.expect("offloaded: loop QPs");
    for q in [al, fl] {
        for c in [ctid(q), ctid(q) - 1] {
            assert_eq!(s.world.f.qp_pd(s.mn_id, c), Some(private), "loop ctid {c}");
        }
    }
    for q in s.cns[0].mq {
        assert_eq!(s.world.f.qp_pd(s.mn_id, ctid(q)), Some(cn_pd), "MN end {q}");
    }
    // remote rights exist only in the private domain; the pool's CN-facing MR grants none
    let map = *s.d.mn.map();
    let pool_base = map.geometry.base();
    let mrs = s.world.f.mrs(s.mn_id);
    for mr in &mrs {
        assert!(!mr.access.intersects(REMOTE) || mr.pd == private, "{mr:?}");
    }
    let pool: Vec<_> = mrs.iter().filter(|m| m.addr == pool_base).collect();
    assert_eq!(pool.len(), 2, "the pool: CN-facing for binds, private for the scrub");
    assert!(pool.iter().any(|m| m.pd == cn_pd && m.access == AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE));
    assert!(pool.iter().any(|m| m.pd == private && m.access.contains(AccessFlags::REMOTE_WRITE)));
    let keys = s.d.mn.keys();
    let zero = mrs.iter().find(|m| m.addr == keys.zero_addr).expect("the zero source is registered");
    assert_eq!((zero.pd, zero.len, zero.access, zero.key), (private, 4096, AccessFlags::empty(), keys.zero_lkey));
    // metadata: a local-only CN-facing registration beside the private one
    let at: Vec<_> = mrs.iter().filter(|m| m.addr == map.meta_base).collect();
    assert!(at.iter().any(|m| m.pd == cn_pd && m.access == AccessFlags::LOCAL_WRITE), "{at:?}");
    assert!(at.iter().any(|m| m.pd == private && m.access.contains(REMOTE)), "{at:?}");
    // the table's first keys are the keys of the windows' next binds, not the allocations'
    let e = s.entry(GroupId(0)).unwrap();
    for k in 0..3 {
        let w = s.world.f.mw(s.mn_id, e.rkey(k).0).expect("a window of the pool");
        assert_eq!((w.bound, Rkey(w.rkey).next_key()), (None, e.rkey(k)), "the table key is the next bind's");
    }
}

#[test]
fn a_bind_gives_the_data_window_rights_over_exactly_the_chunk() {
    let mut s = Cluster::new(MnSpec::new(1, 16));
    let a = s.alloc(0).unwrap();
    let w = s.world.f.mw(s.mn_id, a.rkeys[0].0).unwrap().bound.unwrap();
    assert_eq!((w.addr, w.len as u64, w.access), (a.base, a.length, AccessFlags::DATA_WINDOW));
    assert_eq!(s.d.stats.chain_failures, 0);
}

#[test]
fn a_forged_free_stops_the_forgers_free_chain_and_the_mn_rearms_it() {
    let mut s = Cluster::new(MnSpec::new(2, 16));
    let mine = s.alloc(0).unwrap();
    let theirs = s.alloc(1).unwrap();
    let free_mn_1 = s.cns[1].mq[1];
    assert_eq!(s.free_entry(1, mine.entry_addr), Err(Refusal::Mn(omw_core::wire::message::ErrorCode::NotOwner)));
    // the LOCAL_INV of MW[0] on the forger's own Free QP failed; the MN re-armed that chain
    assert_eq!(s.d.stats.chain_failures, 1, "only the forged free failed");
    assert_eq!(s.d.backend.qp_state(free_mn_1).unwrap(), QpState::Rts, "re-armed");
    // the owner frees: windows unbound, every key advanced, owner cleared
    let g = s.group_of(&mine).unwrap();
    let before = s.entry(g).unwrap();
    s.free(0, &mine).unwrap();
    let after = s.entry(g).unwrap();
    assert_eq!(after.owner(), 0);
    for k in 0..3 {
        assert_eq!(after.rkey(k), before.rkey(k).next_key());
        assert!(s.world.f.mw(s.mn_id, before.rkey(k).0).unwrap().bound.is_none());
    }
    s.free(1, &theirs).unwrap();
    assert_eq!(s.d.stats.chain_failures, 1);
    let zero = s.d.mn.keys().zero_addr;
    assert!(s.mn_read(zero, 4096).iter().all(|b| *b == 0), "the NIC scrub's zero source stays zero");
    s.check_invariants().unwrap();
}

/// Found while writing the isolation tests. A refused request on a CN's Alloc QP puts the MN
/// end in error, which flushes the receive the alloc chain posted there; the Loop ring's first
/// WAIT counts that receive queue's completions, so the flush starts a lap with no request. That
/// lap must give the CN nothing: its binds and its reply are posted on the errored Alloc QP and
/// are flushed, so no window of the popped group is ever bound — the table may name the CN as
/// owner until the MN's repair, which reclaims it; and the CN's free of that group cannot pass
/// the ownership check (MW[0] is not bound to it), so nothing is pushed twice.
#[test]
fn a_refused_request_on_the_alloc_qp_runs_no_lap() {
    let mut s = Cluster::new(MnSpec::new(2, 16));
    let own = s.alloc(1).unwrap();
    s.free(1, &own).unwrap();
    let mr = s.world.f.mrs(s.mn_id)[0];
    assert_eq!(s.cn_post(1, CnQp::Alloc, Wqe::read(0, 0, 8, mr.addr, mr.key)), WcStatus::RemAccessErr);
    let attacker = s.cns[1].mn_id.get();
    let map = *s.d.mn.map();
    let named: Vec<u64> = (0..16)
        .map(|g| map.entry_addr(GroupId(g)).unwrap())
        .filter(|at| s.entry(map.group_of_entry(*at).unwrap()).unwrap().owner() == attacker)
        .collect();
    for at in &named {
        let e = s.entry(map.group_of_entry(*at).unwrap()).unwrap();
        for k in 0..3 {
            assert!(s.world.f.mw(s.mn_id, e.rkey(k).0).and_then(|w| w.bound).is_none(), "window {k} of {at:#x} bound");
        }
    }
    for at in &named {
        assert!(s.free_entry(1, *at).is_err(), "its free of {at:#x} cannot pass the ownership check");
    }
    s.tick();
    s.check_invariants().unwrap();
    for at in &named {
        assert_eq!(
            s.entry(map.group_of_entry(*at).unwrap()).unwrap().owner(),
            0,
            "the repair did not take {at:#x} back"
        );
    }
}
