//! Several alloc chains per CN through the library on the loopback model (issue 23 item 6), as
//! `rxe_lib.rs` checks them over rdma_cm: a client of K chains (`model::Target::alloc_chains`)
//! has K allocations in flight at once — each on its own chain, overlapping at the MN — many
//! threads and futures allocating, writing, reading and freeing lose nothing, a client asking
//! for more chains than the MN allows is refused with `Error::AllocChains`, and K = 1 is as
//! before. Offloaded and host engine. Nothing here is timed: in-flight requests are held by
//! pausing the model (`Model::pause`), overlap is read from the model's completion trace.

use omw_client::model::{Model, ModelConfig, ModelDevice, ModelError};
use omw_client::{AsyncCn, Chunk, Cn, Error, Options, WaitPolicy};
use omw_core::device::{ExecutionMode, WcOpcode};
use omw_core::ids::Qpn;
use omw_core::wire::wqe::QueueSel;
use omw_loopback::{NicConfig, QpAddr};
use std::time::{Duration, Instant};

const MODES: [ExecutionMode; 2] = [ExecutionMode::Offloaded, ExecutionMode::HostEngine];
const CHUNKS: u32 = 32;

/// A model whose MN allows `chains` alloc chains per CN, recording every completion.
fn model(mode: ExecutionMode, chains: u8) -> Model {
    Model::start(ModelConfig {
        chunks: CHUNKS,
        mode: Some(mode),
        nic: NicConfig::strict().with_trace(true),
        alloc_chains: chains,
        ..Default::default()
    })
    .unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// The MN's ends of every connected CN's alloc chains' management QPs (chain 0 first).
fn mgmt_qps(m: &Model) -> Vec<Vec<Qpn>> {
    m.with_cluster(|c| c.driver.mn.cns().map(|r| r.alloc_chains().map(|(_, q, _)| q).collect()).collect()).unwrap()
}

/// Requests the MN received on each of its management QPs `qps` (receive completions).
fn requests_on(m: &Model, qps: Vec<Qpn>) -> Vec<u64> {
    m.with_cluster(move |c| {
        let f = c.fabric.borrow();
        qps.iter().map(|q| f.cq_count(QpAddr::new(c.mn_host, *q), QueueSel::Recv).unwrap()).collect()
    })
    .unwrap()
}

/// Liveness only (a deadline for something that must happen), never a timing assertion.
fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(20), "{what} never happened");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The chunks are distinct memory: each takes its own bytes, and reads them back after all
/// were written.
fn assert_disjoint(cn: &Cn<ModelDevice>, chunks: &[Chunk]) {
    for (k, c) in chunks.iter().enumerate() {
        cn.write(c, 0, &[k as u8 + 1; 64]).unwrap();
    }
    for (k, c) in chunks.iter().enumerate() {
        let mut back = [0u8; 64];
        cn.read(c, 0, &mut back).unwrap();
        assert_eq!(back, [k as u8 + 1; 64], "chunk {k} shares memory with another");
    }
}

fn pool_whole(m: &Model) {
    wait_for("every chunk back at the MN", || m.free_groups().unwrap() == CHUNKS);
    m.with_cluster(|c| c.check_invariants()).unwrap().unwrap();
}

/// With the model paused, `n` allocation futures of `cn` are started: how many requests the
/// client has in flight then; after resuming, every future's chunk (distinct ones).
fn hold_and_release(m: &Model, cn: &Cn<ModelDevice>, n: usize) -> (usize, Vec<Chunk>) {
    runtime().block_on(async {
        let acn = AsyncCn::new(cn.clone()).unwrap();
        m.pause().unwrap();
        let tasks: Vec<_> = (0..n)
            .map(|_| {
                let acn = acn.clone();
                tokio::spawn(async move { acn.alloc().await })
            })
            .collect();
        // let every task start its allocation (the model runs nothing: no answer comes)
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        let held = cn.allocs_in_flight();
        m.resume().unwrap();
        let mut got = Vec::new();
        for t in tasks {
            got.push(t.await.unwrap().unwrap());
        }
        (held, got)
    })
}

/// A client of two chains has both requests unanswered at once, one per chain, and the MN
/// works on both laps together: chain 1 takes its request before chain 0's reply has landed at
/// the CN (the order of modelled events in the completion trace).
#[test]
fn a_client_of_two_chains_has_two_allocations_in_flight_at_once() {
    for mode in MODES {
        let m = model(mode, 2);
        let cn = Cn::connect(m.target().alloc_chains(2), Options::default()).unwrap();
        assert_eq!(cn.alloc_chains(), 2, "{mode:?}");
        let qps = mgmt_qps(&m);
        assert_eq!(qps.len(), 1);
        assert_eq!(qps[0].len(), 2, "{mode:?}: the MN connected the CN with two alloc chains");
        let (mn_host, start) = m.with_cluster(|c| (c.mn_host, c.fabric.borrow().trace().len())).unwrap();
        let (held, got) = hold_and_release(&m, &cn, 3);
        assert_eq!(held, 2, "{mode:?}: two requests in flight at once, the third waits for a chain");
        assert_disjoint(&cn, &got);
        let (q0, q1) = (qps[0][0], qps[0][1]);
        let order = m
            .with_cluster(move |c| {
                let f = c.fabric.borrow();
                let t = &f.trace()[start..];
                let request_on = |q: Qpn| {
                    t.iter().position(|e| {
                        e.host == mn_host && e.completion.qpn == q && e.completion.opcode == WcOpcode::Recv
                    })
                };
                let first_reply =
                    t.iter().position(|e| e.host != mn_host && e.completion.opcode == WcOpcode::RecvRdmaWithImm);
                (request_on(q0), request_on(q1), first_reply)
            })
            .unwrap();
        match order {
            (Some(r0), Some(r1), Some(reply)) => assert!(
                r0 < reply && r1 < reply,
                "{mode:?}: both chains took their requests ({r0}, {r1}) before the first reply landed ({reply})"
            ),
            other => panic!("{mode:?}: a request per chain and a reply expected in the trace: {other:?}"),
        }
        for c in got {
            cn.free(c).unwrap();
        }
        cn.progress().unwrap();
        pool_whole(&m);
    }
}

/// Threads and futures of one client of two chains, allocating, writing, reading and freeing
/// at once: every chunk is its owner's, both chains serve, the pool comes back whole.
#[test]
fn threads_and_futures_on_two_chains_lose_nothing() {
    for mode in MODES {
        let m = model(mode, 2);
        let cn =
            Cn::connect(m.target().alloc_chains(2), Options { wait: WaitPolicy::SLEEP, ..Options::default() }).unwrap();
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let cn = cn.clone();
                std::thread::spawn(move || {
                    for i in 0..25u8 {
                        let c = cn.alloc().unwrap();
                        let data = [t.wrapping_mul(31) ^ i; 256];
                        cn.write(&c, 128, &data).unwrap();
                        let mut back = [0u8; 256];
                        cn.read(&c, 128, &mut back).unwrap();
                        assert_eq!(back, data, "thread {t} round {i}: another allocation's bytes");
                        cn.free(c).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(cn.stats().allocs_round_trip, 100, "{mode:?}");
        // futures: sixteen allocations awaited together on one thread, each written and read
        runtime().block_on(async {
            let acn = AsyncCn::new(cn.clone()).unwrap();
            let mut set = tokio::task::JoinSet::new();
            for k in 0..16u8 {
                let acn = acn.clone();
                set.spawn(async move {
                    let c = acn.alloc().await?;
                    acn.write(&c, 0, &[k; 64]).await?;
                    let back = acn.read(&c, 0, 64).await?;
                    assert_eq!(back, vec![k; 64], "future {k}: another allocation's bytes");
                    Ok::<_, Error>((k, c))
                });
            }
            let mut held = Vec::new();
            while let Some(r) = set.join_next().await {
                held.push(r.unwrap().unwrap());
            }
            assert_eq!(held.len(), 16, "{mode:?}");
            // all sixteen held at once: each still holds its own bytes
            for (k, c) in &held {
                assert_eq!(acn.read(c, 0, 64).await.unwrap(), vec![*k; 64], "{mode:?}: chunk {k} was overwritten");
            }
            for (_, c) in held {
                acn.free(c).await.unwrap();
            }
        });
        cn.progress().unwrap();
        assert_eq!(cn.held_chunks(), 0);
        pool_whole(&m);
        // both chains took requests
        let per_chain = requests_on(&m, mgmt_qps(&m).remove(0));
        assert!(per_chain.iter().all(|n| *n > 0), "{mode:?}: requests per chain {per_chain:?}");
    }
}

/// Asking for more chains than the MN allows is refused with the library's own error (as over
/// rdma_cm) and leaves nothing at the MN; a count outside 1..=4 is refused before any MN sees it.
#[test]
fn a_client_asking_more_chains_than_the_mn_allows_is_refused() {
    for mode in MODES {
        let m = model(mode, 2);
        let hosts = m.with_cluster(|c| c.fabric.borrow().host_count()).unwrap();
        match Cn::connect(m.target().alloc_chains(3), Options::default()) {
            Err(e) => {
                assert_eq!(e, Error::AllocChains { allowed: 2, asked: 3 }, "{mode:?}");
                assert!(e.to_string().contains("allows at most 2"), "{e}");
            }
            Ok(_) => panic!("{mode:?}: three alloc chains on an MN allowing two"),
        }
        // refused before anything of the CN was set up
        let (cns, hosts_after) =
            m.with_cluster(|c| (c.driver.mn.cns().count(), c.fabric.borrow().host_count())).unwrap();
        assert_eq!((cns, hosts_after), (0, hosts), "{mode:?}");
        for k in [0u8, 5] {
            let e = Cn::connect(m.target().alloc_chains(k), Options::default()).unwrap_err();
            let inner = match &e {
                Error::Transport(t) => t.downcast_ref::<ModelError>(),
                _ => None,
            };
            assert!(matches!(inner, Some(ModelError::AllocChainsOutOfRange { asked }) if *asked == k), "{k}: {e}");
        }
        // what the MN allows still connects, again and again (nothing half set up was left)
        for _ in 0..3 {
            let cn = Cn::connect(m.target().alloc_chains(2), Options::default()).unwrap();
            let c = cn.alloc().unwrap();
            cn.free(c).unwrap();
        }
        pool_whole(&m);
        // an MN left at one chain per CN refuses a second
        let single = model(mode, 1);
        let e = Cn::connect(single.target().alloc_chains(2), Options::default()).unwrap_err();
        assert_eq!(e, Error::AllocChains { allowed: 1, asked: 2 });
    }
}

/// K = 1 is as before: the default connection opens one chain, even where the MN allows more,
/// and has one request in flight however many wait.
#[test]
fn one_chain_is_unchanged() {
    for mode in MODES {
        for allowed in [1, 2] {
            let m = model(mode, allowed);
            let cn = Cn::connect(&m, Options::default()).unwrap();
            assert_eq!(cn.alloc_chains(), 1);
            assert_eq!(mgmt_qps(&m)[0].len(), 1, "{mode:?}: one alloc chain at the MN");
            let (held, got) = hold_and_release(&m, &cn, 3);
            assert_eq!(held, 1, "{mode:?}: one request in flight on one chain");
            assert_disjoint(&cn, &got);
            for c in got {
                cn.free(c).unwrap();
            }
            cn.progress().unwrap();
            pool_whole(&m);
        }
    }
}
