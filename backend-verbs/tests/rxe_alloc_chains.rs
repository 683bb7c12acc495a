//! Several alloc chains per CN over rdma_cm on soft-RoCE (issue 23 item 6): a CN that opens two
//! Alloc QPs has two allocations in flight at once, each answered on its own chain, and the MN's
//! invariants hold throughout; a CN asking for more chains than the MN's `--alloc-chains` is
//! refused on its first connection with the typed reason, and nothing of it is left at the MN.
//! The MN daemon runs on a thread of this process (`common::testbed::MnThread`: the host engine
//! on rxe), the CNs are `CnClient`s. Also here: a rejoin of one of those chain connections
//! (`omw_verbs::rejoin`), which this MN — its QPs rdma_cm's — refuses with the reason. Skipped
//! unless OMW_RXE is set (scripts/verbs-ci runs it in its single-VM part).

mod common;
use common::testbed::MnThread;
use omw_core::cn::driver::{ChainConnection, CnError};
use omw_core::cn::ClientError;
use omw_tests::testbed::MnSpec;
use omw_verbs::cm::Refusal;
use omw_verbs::cn::{CnClient, CnOptions};
use omw_verbs::VerbsError;
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

const CHUNKS: u32 = 16;

fn opts(chains: u8) -> CnOptions {
    CnOptions {
        device: std::env::var("OMW_RXE_DEVICE").ok(),
        timeout: Duration::from_secs(20),
        alloc_chains: chains,
        ..CnOptions::default()
    }
}

/// The MN's invariants (MWTable, free queue, holdings against the device's windows), checked on
/// its own thread between two turns of its loop.
fn invariants(mn: &MnThread) {
    let r = mn.with(|d, _| d.driver.check_invariants().map_err(|e| e.to_string()));
    r.unwrap_or_else(|e| panic!("MN invariants: {e}"));
}

/// Wait until the MN's free queue holds every chunk again (frees are not confirmed: the MN runs
/// them when their requests arrive).
fn pool_whole(mn: &MnThread) {
    let t = Instant::now();
    loop {
        let free = mn.with(|d, _| d.counters().free_chunks);
        if free == CHUNKS as u64 {
            return;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "the pool never came back whole: {free} of {CHUNKS} free");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn pattern(round: usize, k: usize) -> Vec<u8> {
    (0..256).map(|i| (i as u8).wrapping_mul(7) ^ (round as u8) ^ ((k as u8) << 4)).collect()
}

#[test]
fn a_cn_with_two_alloc_chains_has_two_allocations_in_flight() {
    if !common::rxe() {
        return;
    }
    let mn = MnThread::start_with_chains(MnSpec::new(2, CHUNKS), 2);
    let mut c = CnClient::connect(mn.addr, &opts(2)).expect("a CN with 2 alloc chains connects");
    assert_eq!(c.alloc_chains(), 2);
    let cn = c.cn;
    // the MN connected it with one chain beyond its first
    let extra = mn.with(move |d, _| d.driver.mn.cn(cn).map(|r| r.extra_alloc.len()));
    assert_eq!(extra, Some(1));
    // and a CN of one chain beside it is served as before
    let mut one = CnClient::connect(mn.addr, &opts(1)).expect("a CN with 1 alloc chain connects");
    assert_eq!(one.alloc_chains(), 1);
    // with the MN's loop held (a job on its thread waits for the gate) nothing is answered:
    // the CN of two chains has both its requests in flight, the CN of one is refused a second
    let (gate, gate_rx) = channel::<()>();
    let (held, held_rx) = channel::<()>();
    std::thread::scope(|s| {
        let mn = &mn;
        s.spawn(move || {
            mn.with(move |_, _| {
                let _ = held.send(());
                let _ = gate_rx.recv_timeout(Duration::from_secs(20));
            })
        });
        held_rx.recv_timeout(Duration::from_secs(20)).expect("the MN's loop is held");
        let t0 = c.alloc_begin().expect("first request");
        let t1 = c.alloc_begin().expect("second request, on the second chain");
        assert_eq!(c.allocs_in_flight(), 2, "both requests unanswered at once");
        let solo = one.alloc_begin().expect("the one-chain CN's request");
        match one.alloc_begin() {
            Err(VerbsError::Cn(e)) if matches!(*e, CnError::Client(ClientError::Busy)) => {}
            other => panic!("a second request on one alloc chain: {other:?}"),
        }
        gate.send(()).unwrap();
        let (a, b) = (c.alloc_finish(t0).expect("first answer"), c.alloc_finish(t1).expect("second answer"));
        assert_ne!(a.entry_addr, b.entry_addr);
        let s = one.alloc_finish(solo).expect("the one-chain CN's answer");
        for x in [&a, &b] {
            c.free(x).unwrap();
        }
        one.free(&s).unwrap();
    });
    let rounds = 24;
    for round in 0..rounds {
        // two requests sent before either answer is read: one per chain
        let t0 = c.alloc_begin().expect("first request");
        let t1 = c.alloc_begin().expect("second request, on the second chain, while the first is in flight");
        let (b, a) = (c.alloc_finish(t1).expect("second answer"), c.alloc_finish(t0).expect("first answer"));
        assert_ne!(a.entry_addr, b.entry_addr, "round {round}: one chunk handed out twice");
        assert!(a.base + a.length <= b.base || b.base + b.length <= a.base, "round {round}: chunks overlap");
        let solo = one.alloc().expect("the one-chain CN allocates");
        // each chunk is its owner's, through every access QP
        for (k, x) in [&a, &b].into_iter().enumerate() {
            for w in 0..c.access_qps().len() {
                let data = pattern(round, 2 * k + w);
                c.write(x, w, 64 * w as u64, &data).unwrap();
                assert_eq!(c.read(x, w, 64 * w as u64, data.len()).unwrap(), data);
            }
        }
        one.write(&solo, 0, 0, b"solo").unwrap();
        assert_eq!(one.read(&solo, 0, 0, 4).unwrap(), b"solo");
        for x in [&a, &b] {
            c.free(x).unwrap();
        }
        one.free(&solo).unwrap();
        c.pump().unwrap();
        one.pump().unwrap();
        if round % 8 == 7 {
            pool_whole(&mn);
            invariants(&mn);
        }
    }
    // the blocking call still works on a CN of two chains
    let a = c.alloc().unwrap();
    c.free(&a).unwrap();
    c.pump().unwrap();
    pool_whole(&mn);
    invariants(&mn);
    let allocs = mn.with(move |d, _| d.driver.mn.cn(cn).map(|r| r.allocs));
    // two while the loop was held, two per round, one blocking
    assert_eq!(allocs, Some(2 + 2 * rounds as u64 + 1));
    // both CNs leave: the MN reclaims nothing (they freed everything) and stays whole
    drop(c);
    drop(one);
    let t = Instant::now();
    while mn.with(|d, _| d.driver.mn.cns().count()) > 0 {
        assert!(t.elapsed() < Duration::from_secs(20), "the CNs' departures were never seen");
        std::thread::sleep(Duration::from_millis(10));
    }
    pool_whole(&mn);
    invariants(&mn);
}

#[test]
fn more_alloc_chains_than_the_mn_allows_are_refused_with_the_reason() {
    if !common::rxe() {
        return;
    }
    let mn = MnThread::start_with_chains(MnSpec::new(2, CHUNKS), 2);
    match CnClient::connect(mn.addr, &opts(3)) {
        Err(VerbsError::Rejected(Refusal::AllocChains { allowed: 2, asked: 3 })) => {}
        other => panic!("3 alloc chains on an MN allowing 2: {other:?}"),
    }
    // refused at its first connection: no CN, no half-open session, counted as a limit
    let (cns, rejected) = mn.with(|d, _| (d.driver.mn.cns().count(), d.counters().rejected_limit));
    assert_eq!((cns, rejected), (0, 1));
    // the same host connects with what the MN allows, repeatedly (no half-open place leaked)
    for _ in 0..3 {
        let mut c = CnClient::connect(mn.addr, &opts(2)).expect("2 alloc chains are allowed");
        let a = c.alloc().unwrap();
        c.free(&a).unwrap();
        c.pump().unwrap();
    }
    // an MN left at its default of one chain per CN refuses a second
    let single = MnThread::start(MnSpec::new(1, CHUNKS));
    match CnClient::connect(single.addr, &opts(2)) {
        Err(VerbsError::Rejected(r)) => {
            assert_eq!(r, Refusal::AllocChains { allowed: 1, asked: 2 });
            assert!(r.to_string().contains("at most 1"), "{r}");
        }
        other => panic!("2 alloc chains on an MN allowing 1: {other:?}"),
    }
    invariants(&mn);
    invariants(&single);
}

/// A rejoin over real rdma_cm: the welcome carried the session's ticket (16 bytes of accept
/// private data), the rejoin hello passes admission (ticket, address, complete session), and
/// this MN — whose QPs are rdma_cm's, not its own — refuses it with `Refusal::NoRejoin`, which
/// the CN reads as "connect anew" (`VerbsError::Unsupported`; a wrong ticket would be refused
/// without a reason). Its session goes on untouched: the chunk it holds still works, the MN
/// counts no rejoin and reclaimed nothing, and the next chain works.
#[test]
fn the_verbs_mn_refuses_a_rejoin_with_the_reason_and_the_session_goes_on() {
    if !common::rxe() {
        return;
    }
    let mn = MnThread::start_with_chains(MnSpec::new(2, CHUNKS), 2);
    let mut c = CnClient::connect(mn.addr, &opts(2)).unwrap();
    let a = c.alloc().unwrap();
    c.write(&a, 0, 0, b"kept").unwrap();
    let reclaimed = mn.with(|d, _| d.counters().groups_reclaimed);
    for conn in [ChainConnection::Alloc(0), ChainConnection::Alloc(1), ChainConnection::Free] {
        match c.rejoin(conn) {
            Err(VerbsError::Unsupported(why)) => assert!(why.contains("connect anew"), "{why}"),
            other => panic!("a rejoin of {conn:?} on the verbs MN: {other:?}"),
        }
    }
    assert_eq!(c.read(&a, 0, 0, 4).unwrap(), b"kept");
    let b = c.alloc().unwrap();
    c.free(&a).unwrap();
    c.free(&b).unwrap();
    c.pump().unwrap();
    let (cns, rejoins, now_reclaimed) =
        mn.with(|d, _| (d.driver.mn.cns().count(), d.counters().rejoins, d.counters().groups_reclaimed));
    assert_eq!((cns, rejoins, now_reclaimed), (1, 0, reclaimed));
    pool_whole(&mn);
    invariants(&mn);
}
