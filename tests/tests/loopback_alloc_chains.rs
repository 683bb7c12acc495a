//! Issue 23 item 6: several alloc chains per CN (`MnConfig::alloc_chains`). Each is a whole
//! alloc chain — loop QP, management QP (an extra Alloc QP), scratch area — so a CN has up to K
//! allocations in flight; every MN path that stops, repairs, counts or reclaims a CN's chains
//! covers all of them. On the loopback model, offloaded and host engine.

use omw_core::cn::driver::CnError;
use omw_core::cn::ClientError;
use omw_core::device::{ExecutionMode, WcOpcode};
use omw_core::mn::driver::DriverError;
use omw_core::mn::{AllocChainQps, MnError};
use omw_core::testing::hostile::HostileCn;
use omw_core::wire::message::ErrorCode;
use omw_loopback::cluster::{Cluster, ClusterConfig, CnOpError};

fn cluster(mode: ExecutionMode, chains: u8, cns: usize, chunks: u32, quota: u32) -> Cluster {
    let mut cfg = ClusterConfig::paper_like();
    cfg.mode = Some(mode);
    cfg.cns = cns;
    cfg.chunks = chunks;
    cfg.quota = quota;
    cfg.alloc_chains = chains;
    cfg.nic = cfg.nic.with_trace(true);
    Cluster::new(cfg).unwrap()
}

const MODES: [ExecutionMode; 2] = [ExecutionMode::Offloaded, ExecutionMode::HostEngine];

/// The MN ends of CN `i`'s alloc chains' management QPs, chain 0 first.
fn mgmt_qps(c: &Cluster, i: usize) -> Vec<omw_core::ids::Qpn> {
    let r = c.driver.mn.cn(c.cns[i].id).unwrap();
    r.alloc_chains().map(|(_, m, _)| m).collect()
}

#[test]
fn a_cn_connects_with_every_chain_and_each_serves_allocations() {
    for mode in MODES {
        let mut c = cluster(mode, 3, 2, 64, 64);
        for i in 0..2 {
            let r = c.driver.mn.cn(c.cns[i].id).unwrap();
            assert_eq!(r.alloc_chain_count(), 3, "{mode:?}");
            assert_eq!(c.cns[i].driver.alloc_chains(), 3);
        }
        // three in flight at once on one CN, each answered, distinct groups
        let tokens: Vec<u32> = (0..3).map(|_| c.alloc_begin(0).unwrap()).collect();
        assert!(
            matches!(
                c.alloc_begin(0),
                Err(CnOpError::Client(ClientError::Busy)) | Err(CnOpError::Cn(CnError::Client(ClientError::Busy)))
            ),
            "{mode:?}: a fourth waits for a chain"
        );
        let got: Vec<_> = tokens.iter().map(|t| c.alloc_finish(0, *t).unwrap()).collect();
        let mut groups: Vec<_> = got.iter().map(|a| c.group_of(a).unwrap()).collect();
        groups.sort();
        groups.dedup();
        assert_eq!(groups.len(), 3, "{mode:?}");
        for a in &got {
            assert_eq!(c.write(0, a, 0, 0, b"mine"), omw_core::device::WcStatus::Success);
            assert_eq!(c.read(0, a, 0, 0, 4).1, b"mine");
        }
        c.check_invariants().unwrap();
        for a in &got {
            c.free(0, a).unwrap();
        }
        // and again, many times round the chains
        for _ in 0..20 {
            let a = c.alloc(1).unwrap();
            c.free(1, &a).unwrap();
        }
        c.check_invariants().unwrap();
        assert_eq!(c.unallocated(), 64, "{mode:?}");
    }
}

/// Both chains' laps are in flight at once: the second request's RECV completes on chain 1's
/// management QP before chain 0's reply lands at the CN (an order of modelled events, from the
/// model's completion trace).
#[test]
fn allocations_on_two_chains_overlap() {
    for mode in MODES {
        let mut c = cluster(mode, 2, 1, 64, 64);
        let qps = mgmt_qps(&c, 0);
        let cn_alloc0 = c.cns[0].alloc_qp.qpn;
        let start = c.fabric.borrow().trace().len();
        let t0 = c.alloc_begin(0).unwrap();
        let t1 = c.alloc_begin(0).unwrap();
        c.alloc_finish(0, t0).unwrap();
        c.alloc_finish(0, t1).unwrap();
        let f = c.fabric.borrow();
        let trace = &f.trace()[start..];
        let second_request = trace
            .iter()
            .position(|e| {
                e.host != c.cns[0].host && e.completion.qpn == qps[1] && e.completion.opcode == WcOpcode::Recv
            })
            .expect("chain 1 received the second request");
        let first_reply = trace
            .iter()
            .position(|e| e.completion.qpn == cn_alloc0 && e.completion.opcode == WcOpcode::RecvRdmaWithImm)
            .expect("chain 0's reply landed");
        assert!(
            second_request < first_reply,
            "{mode:?}: chain 1 took its request ({second_request}) while chain 0's lap was still in flight ({first_reply})"
        );
    }
}

/// A crash reclaims everything of a CN with K chains: what it held and every chain's lap in
/// flight.
#[test]
fn a_crash_with_k_chains_reclaims_everything_of_every_chain() {
    for mode in MODES {
        let mut c = cluster(mode, 3, 2, 64, 64);
        let id = c.cns[0].id;
        let held: Vec<_> = (0..5).map(|_| c.alloc(0).unwrap()).collect();
        // offloaded, every chain holds a group popped ahead (64 chunks ≥ 8 × 2 CNs × 3 chains:
        // `MnConfig::pop_ahead_pays`) — the crash must give those back too
        let ahead = if mode == ExecutionMode::Offloaded { 3 } else { 0 };
        assert_eq!(c.driver.mn.config().pop_ahead, mode == ExecutionMode::Offloaded);
        assert_eq!(c.driver.groups_ahead_of(id), ahead, "{mode:?}");
        // two requests in flight when it dies
        c.alloc_begin(0).unwrap();
        c.alloc_begin(0).unwrap();
        c.crash_cn(0).unwrap();
        assert!(!c.is_served(0));
        for a in &held {
            let g = c.group_of(a).unwrap();
            assert_eq!(c.driver.entry(g).unwrap().owner(), 0, "{mode:?}: {g:?} reclaimed");
        }
        // the survivor's chains hold theirs ahead; everything else is in the queue
        assert_eq!(c.free_groups() + c.driver.groups_ahead_of(c.cns[1].id), 64, "{mode:?}");
        c.check_invariants().unwrap();
        // the MN released every QP of the departed CN, its extra chains' too
        let mn_host = c.mn_host;
        let alive = c.fabric.borrow().qps_of(mn_host);
        for q in c.cns[0].mn_extra.iter().flat_map(|x| [Some(x.mgmt), x.lp]).flatten() {
            assert!(!alive.contains(&q), "{mode:?}: {q:?} destroyed");
        }
        let a = c.alloc(1).unwrap();
        c.free(1, &a).unwrap();
    }
}

/// Host engine, the exact quota: laps in flight on the CN's other chains count, so K chains
/// never take it past its quota.
#[test]
fn host_engine_quota_counts_laps_in_flight_on_every_chain() {
    let mut c = cluster(ExecutionMode::HostEngine, 3, 1, 64, 4);
    let mut held: Vec<_> = (0..2).map(|_| c.alloc(0).unwrap()).collect();
    let tokens: Vec<u32> = (0..3).map(|_| c.alloc_begin(0).unwrap()).collect();
    let mut refused = 0;
    for t in tokens {
        match c.alloc_finish(0, t) {
            Ok(a) => held.push(a),
            Err(CnOpError::Mn(ErrorCode::QuotaExceeded)) => refused += 1,
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!(held.len(), 4, "up to its quota");
    assert_eq!(refused, 1);
    c.check_invariants().unwrap();
}

/// Offloaded, the lazy quota: the audit counts what every chain handed out, and a CN over its
/// quota loses everything — every chain's holdings — and its management QPs, extra Alloc QPs
/// included.
#[test]
fn offloaded_quota_counts_every_chains_holdings() {
    let mut c = cluster(ExecutionMode::Offloaded, 2, 2, 64, 3);
    let id = c.cns[0].id;
    // within its quota through both chains: nothing happens
    let held: Vec<_> = (0..3).map(|_| c.alloc(0).unwrap()).collect();
    c.tick().unwrap();
    assert!(c.driver.mn.cn(id).unwrap().status == omw_core::mn::CnStatus::Active, "at its quota, not over");
    // one more (the chains cannot count: it is served) — the audit takes everything back
    let over = c.alloc(0).unwrap();
    c.tick().unwrap();
    assert_eq!(c.driver.mn.cn(id).unwrap().status, omw_core::mn::CnStatus::MgmtDisconnected);
    for a in held.iter().chain([&over]) {
        assert_eq!(c.driver.entry(c.group_of(a).unwrap()).unwrap().owner(), 0);
    }
    assert_eq!(c.free_groups() + c.driver.groups_ahead_of(c.cns[1].id), 64);
    c.check_invariants().unwrap();
    // its extra Alloc QP went with the first
    let mn_host = c.mn_host;
    let alive = c.fabric.borrow().qps_of(mn_host);
    assert!(!alive.contains(&c.cns[0].mn_extra[0].mgmt));
    // the other CN is unaffected
    let a = c.alloc(1).unwrap();
    c.free(1, &a).unwrap();
}

/// A chain failing (a bad request on chain 1) is repaired from chain 1's own markers; the
/// CN's other chain is stopped and re-armed with it and keeps serving; nothing is lost.
#[test]
fn a_failed_lap_on_one_chain_is_repaired_from_its_own_markers() {
    for mode in MODES {
        let mut c = cluster(mode, 2, 1, 64, 64);
        let a = c.alloc(0).unwrap();
        // a request too short to name a reply target, on chain 1's Alloc QP
        c.cns[0].driver.send_raw_on_chain(1, &[0u8; 8]).unwrap();
        c.pump().unwrap();
        c.check_invariants().unwrap();
        let b = c.alloc(0).unwrap();
        let d = c.alloc(0).unwrap();
        assert_ne!(c.group_of(&b), c.group_of(&d));
        for x in [a, b, d] {
            c.free(0, &x).unwrap();
        }
        c.check_invariants().unwrap();
        assert_eq!(c.unallocated(), 64, "{mode:?}");
    }
}

/// An empty pool with K chains: every chain that pops takes at most one ticket, the CN is told
/// "empty", and a free brings every chain back.
#[test]
fn an_empty_pool_parks_every_chain_and_a_free_rearms_them() {
    for mode in MODES {
        let mut c = cluster(mode, 3, 2, 16, 32);
        let mut held = Vec::new();
        loop {
            match c.alloc(0) {
                Ok(a) => held.push(a),
                Err(CnOpError::Mn(ErrorCode::Empty))
                | Err(CnOpError::Client(ClientError::Backoff { .. }))
                | Err(CnOpError::Cn(CnError::Client(ClientError::Backoff { .. }))) => break,
                Err(e) => panic!("{mode:?}: {e:?}"),
            }
            assert!(held.len() <= 16, "{mode:?}");
        }
        c.check_invariants().unwrap();
        assert!(c.driver.mn.tickets().len() <= 2 * 3, "{mode:?}: one ticket per chain at most");
        let x = held.pop().unwrap();
        c.free(1 - 1, &x).unwrap();
        c.advance(5_000_000).unwrap();
        let y = c.alloc(1).unwrap();
        c.free(1, &y).unwrap();
        for a in held {
            c.free(0, &a).unwrap();
        }
        c.advance(5_000_000).unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.unallocated(), 16, "{mode:?}");
    }
}

/// A CN asking for more alloc chains than the MN allows is refused before anything is set up.
#[test]
fn more_chains_than_the_mn_allows_are_refused() {
    let mut c = cluster(ExecutionMode::Offloaded, 2, 1, 64, 64);
    let qps = c.cns[0].mn_qps.clone();
    let extra = [AllocChainQps { mgmt: qps.alloc, lp: qps.alloc_loop }; 2];
    let before = c.driver.mn.cns().count();
    match c.driver.connect_with_chains(qps.clone(), &extra, None) {
        Err(DriverError::Node(MnError::AllocChains { allowed: 2, asked: 3 })) => {}
        other => panic!("{other:?}"),
    }
    // offloaded, a chain without its loop QP is refused too
    match c.driver.connect_with_chains(qps, &[AllocChainQps { mgmt: extra[0].mgmt, lp: None }], None) {
        Err(DriverError::Node(MnError::AllocChains { .. })) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(c.driver.mn.cns().count(), before);
}

/// Popping ahead with K chains (issue 23 item 6): every chain holds a group ahead; a chain whose
/// pop finds the queue empty is parked alone and its CN told which, so the CN's next allocation
/// goes on a chain that still holds one. Every group of the pool is handed out — none stays
/// stranded ahead on a chain the CN stopped using — and the CN hears "empty" only once every
/// chain is parked. (Were a parked chain reported as "empty", as before, the CN would back off
/// holding fewer than the pool's groups.) A free re-arms them all and nothing is lost.
#[test]
fn popping_ahead_with_k_chains_parks_each_chain_alone() {
    use omw_core::cn::ClientEvent;
    for chains in [2u8, 3] {
        let chunks = 8 * u32::from(chains);
        let mut c = cluster(ExecutionMode::Offloaded, chains, 1, chunks, chunks);
        assert!(c.driver.mn.set_pop_ahead(true) || c.driver.mn.config().pop_ahead);
        assert!(c.driver.mn.config().pop_ahead, "{chains} chains pop ahead");
        let id = c.cns[0].id;
        assert_eq!(c.driver.groups_ahead_of(id), u32::from(chains));
        let mut held = Vec::new();
        let mut refused = 0;
        loop {
            match c.alloc(0) {
                Ok(a) => held.push(a),
                // a request that met its chain parked (its lap popped before it came)
                Err(CnOpError::Mn(ErrorCode::Empty)) => refused += 1,
                Err(CnOpError::Client(ClientError::Backoff { .. }))
                | Err(CnOpError::Cn(CnError::Client(ClientError::Backoff { .. }))) => break,
                Err(e) => panic!("{chains} chains: {e:?}"),
            }
            assert!(held.len() <= chunks as usize && refused <= usize::from(chains), "{chains} chains");
        }
        assert_eq!(held.len(), chunks as usize, "{chains} chains: every group handed out, none left ahead");
        let ev = &c.cns[0].events;
        let parked: Vec<u8> = ev
            .iter()
            .filter_map(|e| if let ClientEvent::ChainParked { chain } = e { Some(*chain) } else { None })
            .collect();
        assert!(!parked.is_empty(), "{chains} chains: some chain was parked alone first");
        let first_empty = ev.iter().position(|e| *e == ClientEvent::Empty).expect("then every chain: empty");
        let last_parked = ev.iter().rposition(|e| matches!(e, ClientEvent::ChainParked { .. })).unwrap();
        assert!(last_parked < first_empty, "{chains} chains: \"empty\" only after the chains parked one by one");
        assert!(c.driver.mn.stats().chain_parked_notices >= 1);
        assert!(c.driver.mn.tickets().len() <= usize::from(chains), "one ticket per chain at most");
        c.check_invariants().unwrap();
        // a free: "available", every chain re-armed and popping ahead again
        let x = held.pop().unwrap();
        c.free(0, &x).unwrap();
        c.advance(5_000_000).unwrap();
        let y = c.alloc(0).unwrap();
        held.push(y);
        for a in held {
            c.free(0, &a).unwrap();
        }
        c.advance(5_000_000).unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.free_groups() + c.driver.groups_ahead_of(id), chunks, "{chains} chains: nothing lost");
        assert_eq!(c.driver.groups_ahead_of(id), u32::from(chains), "{chains} chains: each holds one ahead again");
    }
}
