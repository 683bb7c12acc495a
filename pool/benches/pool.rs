//! The pool's benchmarks on the loopback model (figures, not tests: nothing here asserts a
//! time). `cargo bench -p omw-pool --bench pool` (`-- --test`: one small round of each, what
//! scripts/bench-smoke runs).
//!
//! 1. **Placement balance**: CNs place chunks over N MNs (weighted two choices on the
//!    published free counts); max/min chunks per MN, against the ideal 1.00 and against a
//!    uniform random choice measured in the same run.
//! 2. **Alloc throughput against MN count** (1, 2, 4): CNs allocate and free through the pool;
//!    each MN's modelled time is what its classes' modelled NICs spent; with the MNs working
//!    side by side the pool serves `allocations / max(MN time)` — printed as a ratio to one MN
//!    measured in the same run. The simulator's own wall-clock rate is printed beside it.
//! 3. **From an MN's death to the last CN placing there**: CNs place steadily on 4 MNs, one
//!    vanishes (no goodbye); for each CN, the pool time until it stopped choosing that MN —
//!    at once if it touched it (the connection fails), else when the MN's lease ran out and
//!    the registry deleted its record.

use omw_core::rng::SeededRng;
use omw_pool::client::{Departure, PoolNote};
use omw_pool::entry::ClassSpec;
use omw_pool::loopback::{LoopbackMnConfig, LoopbackPool};
use omw_pool::PoolAlloc;
use std::collections::BTreeMap;
use std::time::Instant;

fn pool(mns: usize, chunks: u32, cns: u32) -> LoopbackPool {
    let cfg = LoopbackMnConfig { max_cns: cns, ..LoopbackMnConfig::default() };
    let mut p = LoopbackPool::new("bench", cfg).expect("pool");
    for i in 0..mns {
        p.add_mn(&format!("mn{i}"), &[ClassSpec { chunk_size: 4096, chunks }]).expect("MN");
    }
    p
}

fn max_min(counts: &BTreeMap<String, u64>, mns: usize) -> (u64, u64) {
    let max = counts.values().copied().max().unwrap_or(0);
    let min = if counts.len() < mns { 0 } else { counts.values().copied().min().unwrap_or(0) };
    (max, min)
}

fn balance(mns: usize, cns: usize, per_cn: usize) {
    let mut p = pool(mns, (cns * per_cn) as u32, cns as u32);
    let mut clients: Vec<_> = (0..cns).map(|i| p.client(100 + i as u64).expect("client")).collect();
    let mut held: Vec<Vec<PoolAlloc>> = vec![Vec::new(); cns];
    // rounds: every CN places one, the MNs publish their counts every 100 ms of pool time
    for _ in 0..per_cn {
        for (c, h) in clients.iter_mut().zip(held.iter_mut()) {
            h.push(c.alloc(4096).expect("alloc"));
        }
        p.advance(100_000_000).expect("advance");
    }
    let mut counts = BTreeMap::new();
    for a in held.iter().flatten() {
        *counts.entry(a.mn().to_string()).or_insert(0u64) += 1;
    }
    let (max, min) = max_min(&counts, mns);
    // the baseline: the same number of uniform random choices
    let mut rng = SeededRng::new(7);
    let mut uni = vec![0u64; mns];
    for _ in 0..cns * per_cn {
        uni[(rng.next_u64() % mns as u64) as usize] += 1;
    }
    let (umax, umin) = (*uni.iter().max().unwrap_or(&0), *uni.iter().min().unwrap_or(&0));
    println!(
        "  {mns} MNs, {cns} CNs × {per_cn}: max/min {max}/{min} = {:.2}   (uniform random: {umax}/{umin} = {:.2})",
        max as f64 / min.max(1) as f64,
        umax as f64 / umin.max(1) as f64
    );
}

/// Allocations per modelled second with `mns` MNs side by side; and the simulator's rate.
fn throughput(mns: usize, cns: usize, allocs: usize) -> (f64, f64) {
    let mut p = pool(mns, 64, cns as u32);
    let mut clients: Vec<_> = (0..cns).map(|i| p.client(200 + i as u64).expect("client")).collect();
    // connect every CN to every MN first (lazy connections are not what is measured)
    for c in clients.iter_mut() {
        let mut warm = Vec::new();
        while warm.len() < 4 * mns {
            warm.push(c.alloc(4096).expect("warm-up alloc"));
        }
        for a in warm {
            c.free(a).expect("warm-up free");
        }
    }
    let start: Vec<u64> = p.mns().map(|m| m.classes.iter().map(|c| c.borrow().now()).sum()).collect();
    let wall = Instant::now();
    let mut done = 0;
    while done < allocs {
        for c in clients.iter_mut() {
            let a = c.alloc(4096).expect("alloc");
            c.free(a).expect("free");
            done += 1;
        }
    }
    let wall = wall.elapsed().as_secs_f64();
    let busiest = p
        .mns()
        .zip(&start)
        .map(|(m, s)| m.classes.iter().map(|c| c.borrow().now()).sum::<u64>() - s)
        .max()
        .unwrap_or(1)
        .max(1);
    (done as f64 / (busiest as f64 * 1e-9), done as f64 / wall)
}

fn death_to_stop(cns: usize, quick: bool) {
    let mut p = pool(4, 64, cns as u32);
    let mut clients: Vec<_> = (0..cns).map(|i| p.client(300 + i as u64).expect("client")).collect();
    let mut held: Vec<Vec<PoolAlloc>> = vec![Vec::new(); cns];
    let step = 50_000_000u64;
    // steady placing before the death
    for _ in 0..if quick { 4 } else { 20 } {
        for (c, h) in clients.iter_mut().zip(held.iter_mut()) {
            let a = c.alloc(4096).expect("alloc");
            h.push(a);
            if h.len() > 8 {
                let old = h.remove(0);
                c.free(old).expect("free");
            }
        }
        p.advance(step).expect("advance");
    }
    for c in clients.iter_mut() {
        c.take_notes();
    }
    let t0 = p.now();
    p.vanish("mn3").expect("vanish");
    let mut stopped: Vec<Option<(u64, Departure)>> = vec![None; cns];
    let mut last_placement_there = 0u64;
    while stopped.iter().any(|s| s.is_none()) && p.now() - t0 < 20_000_000_000 {
        for (i, (c, h)) in clients.iter_mut().zip(held.iter_mut()).enumerate() {
            if let Ok(a) = c.alloc(4096) {
                if a.mn() == "mn3" {
                    last_placement_there = last_placement_there.max(p.now() - t0);
                }
                h.push(a);
            }
            if h.len() > 8 {
                let old = h.remove(0);
                let _ = c.free(old);
            }
            for n in c.take_notes() {
                if let PoolNote::Departed { mn, why, .. } = n {
                    if mn == "mn3" && stopped[i].is_none() {
                        stopped[i] = Some((p.now() - t0, why));
                    }
                }
            }
        }
        p.advance(step).expect("advance");
    }
    let ttl = p.cfg.ttl.as_secs_f64();
    for (i, s) in stopped.iter().enumerate() {
        match s {
            Some((t, why)) => {
                println!("  CN {i}: stopped placing on the dead MN after {:.2} s ({why:?})", *t as f64 * 1e-9)
            }
            None => println!("  CN {i}: never noticed within 20 s"),
        }
    }
    let last = stopped.iter().flatten().map(|(t, _)| *t).max().unwrap_or(0);
    println!(
        "  last CN stopped {:.2} s after the death (lease TTL {ttl:.1} s, keep-alive every {:.1} s, CNs placing every {:.0} ms of pool time); last successful placement there: {}",
        last as f64 * 1e-9,
        ttl / 3.0,
        step as f64 * 1e-6,
        if last_placement_there == 0 { "none".to_string() } else { format!("{:.2} s", last_placement_there as f64 * 1e-9) }
    );
}

fn main() {
    let quick = std::env::args().any(|a| a == "--test");
    println!("omw-pool benchmarks on the loopback model{}", if quick { " (--test: one small round each)" } else { "" });
    println!("\n1. placement balance (max/min chunks per MN; 1.00 is perfect)");
    let (cns, per) = if quick { (4, 4) } else { (8, 32) };
    for mns in [2, 4, 8] {
        balance(mns, cns, per);
    }
    println!("\n2. alloc+free throughput against MN count (modelled; ratio to 1 MN in this run)");
    let n = if quick { 16 } else { 400 };
    let (base, base_wall) = throughput(1, 4, n);
    for mns in [1, 2, 4] {
        let (t, w) = if mns == 1 { (base, base_wall) } else { throughput(mns, 4, n) };
        println!(
            "  {mns} MN(s): {:>9.0} allocs/s modelled = {:.2} × one MN   (simulator: {:.0} allocs/s of wall time)",
            t,
            t / base,
            w
        );
    }
    println!("\n3. from an MN's death to the last CN placing there (4 MNs, one vanishes)");
    death_to_stop(if quick { 3 } else { 6 }, quick);
}
