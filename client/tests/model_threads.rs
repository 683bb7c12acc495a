//! Many threads on one client (a `Send + Sync` handle over shared QPs) on the loopback model:
//! allocating, reading, writing (staged and zero-copy), updating a shared counter with
//! atomics and freeing concurrently; the reserve; a lost MN connection.

use omw_client::model::{Model, ModelConfig, ModelDevice};
use omw_client::{Cn, Error, Options, ReservePolicy, WaitPolicy};
use std::time::{Duration, Instant};

const THREADS: usize = 4;
const ROUNDS: usize = 25;

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(20), "{what} never happened");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn hammer(cn: &Cn<ModelDevice>, counter: &omw_client::Chunk, t: usize) {
    let mut mr = cn.register(vec![0u8; 256]).unwrap();
    for r in 0..ROUNDS {
        let c = cn.alloc().unwrap();
        let tag = (t * 1000 + r) as u32;
        let data: Vec<u8> = (0..512).map(|i| (tag as usize + i) as u8).collect();
        cn.write(&c, 64, &data).unwrap();
        let mut back = vec![0u8; 512];
        cn.read(&c, 64, &mut back).unwrap();
        assert_eq!(back, data, "thread {t} round {r}: staged bytes");
        mr.as_mut_slice().fill(t as u8 + 1);
        cn.write_from(&c, 1024, &mr, 0..256).unwrap();
        mr.as_mut_slice().fill(0);
        cn.read_into(&c, 1024, &mut mr, 0..256).unwrap();
        assert!(mr.as_slice().iter().all(|b| *b == t as u8 + 1), "thread {t} round {r}: zero-copy bytes");
        cn.fetch_add(counter, 0, 1).unwrap();
        cn.free(c).unwrap();
    }
}

fn run_threads(cfg: ModelConfig, wait: WaitPolicy) {
    let m = Model::start(cfg).unwrap();
    let cn = Cn::connect(&m, Options { wait, ..Options::default() }).unwrap();
    let counter = cn.alloc().unwrap();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (cn, counter) = (cn.clone(), counter.clone());
            std::thread::spawn(move || hammer(&cn, &counter, t))
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let mut w = [0u8; 8];
    cn.read(&counter, 0, &mut w).unwrap();
    assert_eq!(u64::from_le_bytes(w), (THREADS * ROUNDS) as u64, "no atomic lost");
    assert_eq!(cn.held_chunks(), 1);
    assert_eq!(cn.in_flight(), 0);
    cn.free(counter).unwrap();
    cn.progress().unwrap();
    wait_for("every chunk back at the MN", || m.free_groups().unwrap() == cfg.chunks);
    m.with_cluster(|c| c.check_invariants()).unwrap().unwrap();
}

#[test]
fn threads_allocate_access_and_free_concurrently_offloaded() {
    run_threads(ModelConfig::default(), WaitPolicy::default());
}

#[test]
fn threads_allocate_access_and_free_concurrently_host_engine_sleeping() {
    let cfg = ModelConfig { mode: Some(omw_core::device::ExecutionMode::HostEngine), ..Default::default() };
    run_threads(cfg, WaitPolicy::SLEEP);
}

#[test]
fn more_accesses_than_slots_wait_for_a_slot_instead_of_failing() {
    let m = Model::start(ModelConfig::default()).unwrap();
    let cn = Cn::connect(&m, Options::default()).unwrap();
    let c = cn.alloc().unwrap();
    // 8 threads × 40 reads of 16 KiB staged = far more than the 64 slots at once
    let hs: Vec<_> = (0..8)
        .map(|_| {
            let (cn, c) = (cn.clone(), c.clone());
            std::thread::spawn(move || {
                for _ in 0..40 {
                    let mut b = vec![0u8; 4096];
                    cn.read(&c, 0, &mut b).unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(cn.in_flight(), 0);
}

#[test]
fn the_reserve_fills_in_the_background_and_serves_allocations_without_a_round_trip() {
    let m = Model::start(ModelConfig { chunks: 16, ..Default::default() }).unwrap();
    let p = ReservePolicy::new(2, 6).unwrap();
    let cn = Cn::connect(&m, Options { reserve: Some(p), ..Options::default() }).unwrap();
    // nobody calls in: the background fills it to its target
    wait_for("the reserve filled", || cn.reserved() == p.target());
    assert_eq!(m.free_groups().unwrap(), 16 - p.target() as u32, "reserved chunks are held at the MN");
    let a = cn.alloc().unwrap();
    let b = cn.alloc().unwrap();
    assert_eq!(cn.stats().allocs_from_reserve, 2);
    assert_eq!(cn.stats().allocs_round_trip, 0);
    assert_eq!(cn.reserved(), p.target() - 2, "at the low-water mark: no refill yet");
    let c = cn.alloc().unwrap();
    assert_eq!(cn.stats().allocs_from_reserve, 3);
    // below the low-water mark it refills
    wait_for("the reserve refilled", || cn.reserved() == p.target());
    cn.free(a).unwrap();
    cn.free(b).unwrap();
    assert_eq!(cn.stats().frees_to_reserve, 2);
    assert_eq!(cn.reserved(), p.target() + 2);
    cn.free(c).unwrap();
    assert_eq!(cn.stats().frees_to_mn, 1, "above the high-water mark: back to the MN");
    assert_eq!(cn.reserved(), p.high());
    // shutdown returns everything
    cn.shutdown().unwrap();
    assert_eq!(cn.held_chunks(), 0);
    wait_for("every chunk back at the MN", || m.free_groups().unwrap() == 16);
    let reclaimed = m.with_cluster(|c| c.driver.mn.stats().groups_reclaimed).unwrap();
    assert_eq!(reclaimed, 0, "freed by the client, not reclaimed by the MN");
}

#[test]
fn dropping_the_last_handle_returns_the_reserve() {
    let m = Model::start(ModelConfig { chunks: 16, ..Default::default() }).unwrap();
    let p = ReservePolicy::new(3, 4).unwrap();
    let cn = Cn::connect(&m, Options { reserve: Some(p), ..Options::default() }).unwrap();
    wait_for("the reserve filled", || cn.reserved() == p.target());
    drop(cn);
    wait_for("every chunk back at the MN", || m.free_groups().unwrap() == 16);
    let reclaimed = m.with_cluster(|c| c.driver.mn.stats().groups_reclaimed).unwrap();
    assert_eq!(reclaimed, 0, "freed by the client, not reclaimed by the MN");
}

#[test]
fn the_reserve_goes_back_when_the_mn_runs_empty_and_refills_after_available() {
    let m = Model::start(ModelConfig { chunks: 8, ..Default::default() }).unwrap();
    let p = ReservePolicy::new(3, 6).unwrap();
    let holder = Cn::connect(&m, Options { reserve: Some(p), ..Options::default() }).unwrap();
    wait_for("the reserve filled", || holder.reserved() == p.target());
    let other = Cn::connect(&m, Options::default()).unwrap();
    let mut got = Vec::new();
    while let Ok(c) = other.try_alloc() {
        got.push(c);
    }
    assert_eq!(got.len(), 8 - p.target());
    // the MN said "empty" to everyone: the holder gives its reserve back...
    wait_for("the reserve returned", || holder.stats().reserve_returned_on_pressure == p.target() as u64);
    // ...so the other CN's waiting allocation gets a chunk once the MN says "available"
    let c = other.alloc().unwrap();
    got.push(c);
    assert!(got.len() > 8 - p.target());
    for c in got {
        other.free(c).unwrap();
    }
    other.progress().unwrap();
    wait_for("the holder refilled", || holder.reserved() == p.target());
}

#[test]
fn the_reserve_counts_against_the_quota() {
    let cfg = ModelConfig { quota: 3, mode: Some(omw_core::device::ExecutionMode::HostEngine), ..Default::default() };
    let m = Model::start(cfg).unwrap();
    let p = ReservePolicy::new(4, 8).unwrap();
    let cn = Cn::connect(&m, Options { reserve: Some(p), ..Options::default() }).unwrap();
    // the refill stops at the quota (the MN refuses the fourth)
    wait_for("the reserve stopped at the quota", || cn.reserved() == 3 && cn.stats().reserve_refills == 3);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(cn.reserved(), 3);
    let a = cn.alloc().unwrap();
    let _b = cn.alloc().unwrap();
    let _c = cn.alloc().unwrap();
    assert_eq!(cn.alloc(), Err(Error::QuotaExceeded));
    cn.free(a).unwrap();
}

#[test]
fn a_lost_mn_fails_every_waiting_call_promptly_with_disconnected() {
    let m = Model::start(ModelConfig { chunks: 2, ..Default::default() }).unwrap();
    let cn = Cn::connect(&m, Options { timeout: Duration::from_secs(60), ..Options::default() }).unwrap();
    let a = cn.alloc().unwrap();
    let _b = cn.alloc().unwrap();
    // three threads wait for a chunk the MN does not have (they would wait up to 60 s)
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let cn = cn.clone();
            std::thread::spawn(move || cn.alloc())
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    m.kill_mn().unwrap();
    for w in waiters {
        assert_eq!(w.join().unwrap(), Err(Error::Disconnected));
    }
    assert_eq!(cn.write(&a, 0, b"x"), Err(Error::Disconnected));
    let mut mr = cn.register(vec![0u8; 8]).unwrap();
    assert_eq!(cn.read_into(&a, 0, &mut mr, 0..8), Err(Error::Disconnected));
    assert_eq!(cn.alloc(), Err(Error::Disconnected));
}
