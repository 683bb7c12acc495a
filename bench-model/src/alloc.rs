//! Allocation micro-benchmark: alloc + free pairs with 1 and 24 concurrent requesters.
//!
//! OneSidedMW runs on the real loopback model: in each round every requester (one per CN)
//! posts an alloc at the same instant, the model runs the chains, and each latency is the
//! reply's completion timestamp minus the post time; then all free. The other schemes run in
//! the queueing simulator with their control-path costs (see `schemes.rs`).

use super::inputs::{Inputs, Measured};
use super::schemes::{compile, Op, Scheme, ALL};
use super::sim::{self, Res};
use omw_core::device::ExecutionMode;
use omw_loopback::cluster::{Cluster, ClusterConfig};
use omw_loopback::NicConfig;

#[derive(Clone, Debug)]
pub struct AllocRow {
    pub scheme: Scheme,
    pub requesters: usize,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub mean_ns: f64,
    /// alloc + free pairs per second of modelled time.
    pub pairs_per_s: f64,
    pub mn_cpu_util: f64,
    pub mn_nic_util: f64,
    /// "model" (real chains on the loopback model) or "sim" (queueing simulator).
    pub source: &'static str,
    pub samples: usize,
}

/// OneSidedMW on the real model: `rounds` rounds of `k` concurrent alloc then `k` frees.
pub fn osmw_on_model(inp: &Inputs, m: &Measured, k: usize, rounds: usize) -> Result<AllocRow, String> {
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = k;
    cfg.group_size = m.group_size;
    cfg.chunk_size = m.chunk_size;
    cfg.chunks = (2 * k as u32).max(8);
    cfg.quota = cfg.chunks;
    cfg.mode = Some(ExecutionMode::Offloaded);
    cfg.nic = NicConfig::strict().with_prefetch(8).with_cost(inp.cost);
    cfg.nic.ring_arena_bytes = (k as u64 + 2) * (64 << 10);
    let mut c = Cluster::new(cfg).map_err(|e| e.to_string())?;
    let mn = c.mn_host;
    let nic_wqes = |c: &Cluster| c.fabric.borrow().host_stats(mn).map(|s| s.wqes_executed).unwrap_or(0);
    let mut lat = Vec::new();
    let start = c.now();
    let w0 = nic_wqes(&c);
    for _ in 0..rounds {
        let t0 = c.now();
        let toks: Vec<u32> = (0..k).map(|i| c.alloc_begin(i)).collect::<Result<_, _>>().map_err(|e| e.to_string())?;
        c.pump().map_err(|e| e.to_string())?;
        let mut held = Vec::new();
        for (i, t) in toks.into_iter().enumerate() {
            held.push(c.alloc_finish(i, t).map_err(|e| format!("cn{i}: {e}"))?);
            lat.push(c.cns[i].last_reply_at - t0);
        }
        for (i, a) in held.iter().enumerate() {
            c.free_begin(i, a).map_err(|e| e.to_string())?;
        }
        c.pump().map_err(|e| e.to_string())?;
    }
    c.check_invariants()?;
    let span = c.now() - start;
    lat.sort_unstable();
    let cpu = c.fabric.borrow().host_stats(mn).map(|s| s.cpu_busy_ns).unwrap_or(0);
    // NIC utilisation: executed MN WQEs at their issue cost is a lower bound; report the
    // measured occupancy per pair instead
    let _ = nic_wqes(&c) - w0;
    Ok(AllocRow {
        scheme: Scheme::OneSidedMw,
        requesters: k,
        p50_ns: sim::quantile(&lat, 0.5),
        p99_ns: sim::quantile(&lat, 0.99),
        mean_ns: sim::mean(&lat),
        pairs_per_s: (k * rounds) as f64 * 1e9 / span.max(1) as f64,
        mn_cpu_util: cpu as f64 / span.max(1) as f64,
        // measured unit occupancy per pair, over every unit of the NIC
        mn_nic_util: ((m.osmw.alloc_nic_ns + m.osmw.free_nic_ns) * (k * rounds) as u64) as f64
            / (span.max(1) as f64 * inp.nic_units.max(1) as f64),
        source: "model",
        samples: lat.len(),
    })
}

/// Any scheme in the simulator, in the same rounds as on the model: `k` requesters post an
/// alloc at once, then all free, and the next round starts when the MN is idle.
pub fn in_sim(inp: &Inputs, m: &Measured, scheme: Scheme, k: usize, iters: usize) -> AllocRow {
    let mut ops = Vec::with_capacity(iters * 4);
    for _ in 0..iters {
        ops.extend([Op::Alloc, Op::End(0), Op::Barrier, Op::Free, Op::End(1), Op::Barrier]);
    }
    // one requester per CN
    let progs: Vec<_> = (0..k).map(|i| compile(scheme, inp, m, &ops, i as u16)).collect();
    let r = sim::run(&progs, inp.mn_cores, inp.nic_units);
    let lat = r.latencies.first().cloned().unwrap_or_default();
    AllocRow {
        scheme,
        requesters: k,
        p50_ns: sim::quantile(&lat, 0.5),
        p99_ns: sim::quantile(&lat, 0.99),
        mean_ns: sim::mean(&lat),
        pairs_per_s: if r.makespan_ns == 0 { f64::INFINITY } else { (k * iters) as f64 * 1e9 / r.makespan_ns as f64 },
        mn_cpu_util: r.utilisation(Res::Cpu),
        mn_nic_util: r.utilisation(Res::Nic),
        source: "sim",
        samples: lat.len(),
    }
}

pub fn run(inp: &Inputs, m: &Measured, rounds: usize, tick: &mut dyn FnMut(&str)) -> Result<Vec<AllocRow>, String> {
    let mut rows = Vec::new();
    for k in [1usize, 24] {
        tick(&format!("alloc micro: OneSidedMW on the model, {k} requester(s)"));
        rows.push(osmw_on_model(inp, m, k, rounds)?);
        for s in ALL {
            tick(&format!("alloc micro: {} in the simulator, {k} requester(s)", s.name()));
            rows.push(in_sim(inp, m, s, k, rounds.max(20)));
        }
    }
    Ok(rows)
}

/// One CN allocating back to back with `chains` alloc chains (issue 23 item 6).
#[derive(Clone, Debug)]
pub struct ChainsRow {
    /// Alloc chains the CN connected with (`MnConfig::alloc_chains`).
    pub chains: u8,
    /// Allocations per second of modelled time, the CN keeping one request in flight per chain.
    pub allocs_per_s: f64,
    /// Against one chain, measured in the same run.
    pub ratio: f64,
    /// Mean request-to-reply latency.
    pub mean_ns: f64,
    pub samples: usize,
    /// "model" (real chains on the loopback model) or "sim" (queueing simulator).
    pub source: &'static str,
}

/// OneSidedMW on the model: one CN connected with `chains` alloc chains keeps one request in
/// flight on each — in every round it sends a request on each chain at the same instant, the
/// model runs until idle (every lap committed and its chain re-armed), and the next round
/// starts — `allocs` allocations in all, no frees (the pool holds them all). Offloaded: no MN
/// CPU on the path. What it shows is the overlap of a CN's laps across its chains; a request
/// meeting its chain still re-arming (the MN's RNR timer) is the simulator's
/// (`sim::Stage::Chain`). Returns allocations per second of modelled time, the mean latency
/// from a round's start to each reply, the samples.
pub fn osmw_chains_on_model(
    inp: &Inputs,
    m: &Measured,
    chains: u8,
    allocs: usize,
) -> Result<(f64, f64, usize), String> {
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = 1;
    cfg.group_size = m.group_size;
    cfg.chunk_size = 512;
    cfg.chunks = (allocs as u32 + 64).next_power_of_two();
    cfg.quota = cfg.chunks;
    cfg.mode = Some(ExecutionMode::Offloaded);
    cfg.alloc_chains = chains;
    cfg.nic = NicConfig::strict().with_prefetch(8).with_cost(inp.cost);
    cfg.nic.ring_arena_bytes = (chains as u64 + 3) * (64 << 10);
    let mut c = Cluster::new(cfg).map_err(|e| e.to_string())?;
    let mut lat = Vec::with_capacity(allocs);
    let start = c.now();
    let mut done = 0;
    while done < allocs {
        let t0 = c.now();
        let k = (chains as usize).min(allocs - done);
        let toks: Vec<u32> = (0..k).map(|_| c.alloc_begin(0)).collect::<Result<_, _>>().map_err(|e| e.to_string())?;
        c.pump().map_err(|e| e.to_string())?;
        for t in toks {
            c.alloc_take(0, t).map_err(|e| format!("alloc: {e}"))?;
        }
        // (the round's last reply: every reply of a round lands within it)
        lat.push(c.cns[0].last_reply_at.saturating_sub(t0));
        done += k;
    }
    c.check_invariants()?;
    let span = (c.now() - start).max(1);
    Ok((allocs as f64 * 1e9 / span as f64, sim::mean(&lat), done))
}

/// Per-CN alloc throughput against the CN's alloc chains (1, 2, 4): on the model, and in the
/// simulator with the same inputs; each ratio against one chain of the same source and run.
pub fn chains(inp: &Inputs, m: &Measured, allocs: usize, tick: &mut dyn FnMut(&str)) -> Result<Vec<ChainsRow>, String> {
    let mut rows = Vec::new();
    let mut base = 0.0;
    for k in [1u8, 2, 4] {
        tick(&format!("alloc chains: one CN with {k} alloc chain(s) on the model"));
        let (tput, mean, n) = osmw_chains_on_model(inp, m, k, allocs)?;
        if k == 1 {
            base = tput;
        }
        rows.push(ChainsRow {
            chains: k,
            allocs_per_s: tput,
            ratio: tput / base,
            mean_ns: mean,
            samples: n,
            source: "model",
        });
    }
    let mut base = 0.0;
    for k in [1u8, 2, 4] {
        tick(&format!("alloc chains: one CN with {k} alloc chain(s) in the simulator"));
        let inp_k = Inputs { alloc_chains: k as u16, ..inp.clone() };
        // one CN, k requesters (threads) allocating back to back
        let ops: Vec<Op> = (0..allocs / k as usize).flat_map(|_| [Op::Alloc, Op::End(0)]).collect();
        let progs: Vec<_> = (0..k).map(|_| compile(Scheme::OneSidedMw, &inp_k, m, &ops, 0)).collect();
        let r = sim::run(&progs, inp.mn_cores, inp.nic_units);
        let lat = r.latencies.first().cloned().unwrap_or_default();
        let tput = if r.makespan_ns == 0 { 0.0 } else { lat.len() as f64 * 1e9 / r.makespan_ns as f64 };
        if k == 1 {
            base = tput;
        }
        rows.push(ChainsRow {
            chains: k,
            allocs_per_s: tput,
            ratio: if base > 0.0 { tput / base } else { 0.0 },
            mean_ns: sim::mean(&lat),
            samples: lat.len(),
            source: "sim",
        });
    }
    Ok(rows)
}
