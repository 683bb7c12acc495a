//! The model behind `omw bench`: every memory-management scheme × workload on the same modelled cluster (1 MN,
//! 6 CNs, the loopback model's `CostModel::CX6`), in one run, in **modelled** time.
//!
//! * OneSidedMW runs its real alloc/free chains on the loopback model; the allocation
//!   micro-benchmark's OneSidedMW rows come straight from the model's completion timestamps.
//! * RPC-MW type-2 is the core's host engine (the MN CPU runs the chain layout), measured on
//!   the model lap by lap; RPC-MW type-1 is analytical (one verbs bind per chunk); Static-MR
//!   has no control path; ODRP is an analytical translation chain. Concurrency (24 requesters,
//!   KV and swap threads on 6 CNs, N MN cores) is composed by a queueing simulator over those
//!   per-operation costs (`sim.rs`), with the model's structure: N NIC units, the MN's link.
//! * The paper's "up to" speed-ups are maxima over a sweep of KV configurations × MN cores ×
//!   NIC units (`sweep.rs`); the chains are re-measured on the model for every unit count.
//!
//! docs/COST-MODEL.md explains the inputs and where the model and the paper disagree.

//!
//! The API is [`run`] (options in, [`Results`] out, progress through a callback) and the
//! [`report`] renderings of the results (text, JSON, CSV/SVG files); the `omw` binary only parses
//! arguments and prints.

pub mod alloc;
pub mod inputs;
mod kv;
mod malloc;
pub mod report;
mod rng;
pub mod scale;
pub mod schemes;
mod sim;
mod swap;
pub mod sweep;

pub use rng::Rng;

use inputs::{Inputs, Measured};
use schemes::{compile, Op, Scheme, ALL};
use sim::Res;
use std::path::PathBuf;
use std::time::Instant;

/// What one run measures; `omw bench`'s flags, without the output format.
#[derive(Debug, Clone)]
pub struct Options {
    /// Small sizes (CI smoke run, a few seconds).
    pub quick: bool,
    /// Directory for the CSV files and the SVG plot.
    pub out: PathBuf,
    /// MN CPU cores serving RPC-MW requests (the paper used one).
    pub mn_cores: usize,
    /// NIC processing units of the main run, in the loopback model and the simulator alike
    /// (the sweep covers 1–16 whatever this is).
    pub mn_nic_units: usize,
    /// Application threads per CN in the KV and swap workloads.
    pub threads: usize,
    /// Compute nodes in the "at scale" runs.
    pub cns: usize,
    pub seed: u64,
    /// The pool-size sweep up to 2^22 chunks (minutes; otherwise up to 16 Ki chunks, or
    /// 4 Ki with `quick`).
    pub scale: bool,
}

impl Options {
    /// NIC processing units when none are asked for: `CostModel::CX6`'s.
    pub const DEFAULT_NIC_UNITS: usize = omw_loopback::CostModel::CX6.nic_units as usize;
}

/// Sizes of one run.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub alloc_rounds: usize,
    pub kv_keys: usize,
    pub kv_mixed: usize,
    pub swap_pages: usize,
    pub swap_accesses: usize,
}

impl Sizes {
    fn of(quick: bool) -> Sizes {
        if quick {
            Sizes { alloc_rounds: 3, kv_keys: 64, kv_mixed: 192, swap_pages: 512, swap_accesses: 1500 }
        } else {
            Sizes { alloc_rounds: 50, kv_keys: 1000, kv_mixed: 4000, swap_pages: 4096, swap_accesses: 40000 }
        }
    }
}

/// One scheme's results on one workload configuration.
#[derive(Clone, Debug)]
pub struct WorkloadRow {
    pub workload: String,
    pub config: String,
    pub scheme: Scheme,
    pub threads: usize,
    pub requests: usize,
    pub throughput: f64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    /// p50/p99 of the tagged request kind of interest (KV insert/update; swap faults).
    pub key_p50_ns: u64,
    pub key_p99_ns: u64,
    pub mn_cpu_util: f64,
    pub mn_nic_util: f64,
    /// The MN NIC's responder engine (one-sided data requests).
    pub mn_rx_util: f64,
    /// The MN's link, the busier direction.
    pub mn_link_util: f64,
    /// MN bytes held at the end, reserved on average, live data on average.
    pub end_bytes: u64,
    pub avg_bytes: f64,
    pub avg_live: f64,
    pub static_bytes: u64,
    pub allocs: u64,
    pub frees: u64,
}

impl WorkloadRow {
    pub fn reclaimed(&self) -> f64 {
        if self.static_bytes == 0 {
            0.0
        } else {
            1.0 - self.end_bytes as f64 / self.static_bytes as f64
        }
    }
    pub fn mem_util(&self) -> f64 {
        if self.avg_bytes <= 0.0 {
            0.0
        } else {
            self.avg_live / self.avg_bytes
        }
    }
}

pub struct Results {
    pub inputs: Inputs,
    pub geometries: Vec<Measured>,
    pub alloc: Vec<alloc::AllocRow>,
    pub alloc_curve: Vec<alloc::AllocRow>,
    /// One CN's alloc throughput against its alloc chains (1, 2, 4), on the model and in the
    /// simulator, each ratio against one chain in the same run.
    pub alloc_chains: Vec<alloc::ChainsRow>,
    pub workloads: Vec<WorkloadRow>,
    /// OneSidedMW vs RPC-MW over KV configurations × MN cores × NIC units.
    pub sweep: Vec<sweep::SweepRow>,
    /// The unmeasured inputs at ½×, 1×, 2×.
    pub sensitivity: Vec<sweep::Sensitivity>,
    pub validation: Vec<report::Validation>,
    /// Pool size against the cost per operation, and start-up and metadata at scale.
    pub scale: scale::ScaleResults,
    pub wall_s: f64,
    pub args: Options,
}

fn odrp_ops(ops: &[Op], pages_per_chunk: u64) -> Vec<Op> {
    let mut v = Vec::with_capacity(ops.len());
    for &op in ops {
        match op {
            Op::Alloc | Op::Free => v.extend(std::iter::repeat_n(op, pages_per_chunk as usize)),
            _ => v.push(op),
        }
    }
    v
}

#[allow(clippy::too_many_arguments)]
fn kv_rows(
    inp: &Inputs,
    m: &Measured,
    name: &str,
    cfg: &kv::KvConfig,
    cns: usize,
    threads: usize,
    schemes: &[Scheme],
    tick: &mut dyn FnMut(&str),
) -> Vec<WorkloadRow> {
    let n = cns * threads;
    tick(&format!("{name}: generating {n} client traces"));
    let traces: Vec<kv::KvTrace> = (0..n).map(|t| kv::trace(cfg, t as u64)).collect();
    let w = Traces { workload: "kv", name, chunk: cfg.chunk, key_tags: &[kv::INSERT, kv::UPDATE] };
    trace_rows(inp, m, &w, &traces, cns, threads, schemes, tick)
}

/// A workload's per-thread traces, and how to read them.
struct Traces<'a> {
    workload: &'a str,
    name: &'a str,
    /// MN chunk size (ODRP allocates its 4 KiB pages instead).
    chunk: u64,
    /// Request tags whose latencies are the "key" percentiles (KV inserts and updates, mallocs).
    key_tags: &'a [u8],
}

/// Every scheme on `traces` (thread `i` on CN `i / threads`): throughput, latencies, the MN's
/// utilisation and the memory each scheme holds.
#[allow(clippy::too_many_arguments)]
fn trace_rows(
    inp: &Inputs,
    m: &Measured,
    w: &Traces<'_>,
    traces: &[kv::KvTrace],
    cns: usize,
    threads: usize,
    schemes: &[Scheme],
    tick: &mut dyn FnMut(&str),
) -> Vec<WorkloadRow> {
    let name = w.name;
    let peak: u64 = traces.iter().map(|t| t.peak_bytes).sum();
    let mut rows = Vec::new();
    for &s in schemes {
        tick(&format!("{name}: {} with {cns} CN(s) × {threads} threads", s.name()));
        let ppc = w.chunk.div_ceil(inputs::ODRP_PAGE);
        let progs: Vec<_> = traces
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let cn = (i / threads) as u16;
                if s == Scheme::Odrp {
                    compile(s, inp, m, &odrp_ops(&t.ops, ppc), cn)
                } else {
                    compile(s, inp, m, &t.ops, cn)
                }
            })
            .collect();
        let r = sim::run(&progs, inp.mn_cores, inp.nic_units);
        let all = r.all_latencies();
        let mut key: Vec<u64> =
            w.key_tags.iter().flat_map(|&t| r.latencies.get(t as usize).cloned().unwrap_or_default()).collect();
        key.sort_unstable();
        let (end, avg) = match s {
            Scheme::StaticMr => (peak, peak as f64),
            Scheme::Odrp => {
                (traces.iter().map(|t| t.end_page_bytes).sum(), traces.iter().map(|t| t.avg_page_bytes).sum())
            }
            _ => (traces.iter().map(|t| t.end_bytes).sum(), traces.iter().map(|t| t.avg_bytes).sum()),
        };
        let (allocs, frees) = if s == Scheme::StaticMr {
            (0, 0)
        } else {
            let k = if s == Scheme::Odrp { ppc } else { 1 };
            (
                traces.iter().map(|t| t.chunk_allocs).sum::<u64>() * k,
                traces.iter().map(|t| t.chunk_frees).sum::<u64>() * k,
            )
        };
        rows.push(WorkloadRow {
            workload: w.workload.into(),
            config: name.into(),
            scheme: s,
            threads: traces.len(),
            requests: r.total_requests(),
            throughput: r.throughput(),
            p50_ns: sim::quantile(&all, 0.5),
            p99_ns: sim::quantile(&all, 0.99),
            key_p50_ns: sim::quantile(&key, 0.5),
            key_p99_ns: sim::quantile(&key, 0.99),
            mn_cpu_util: r.utilisation(Res::Cpu),
            mn_nic_util: r.utilisation(Res::Nic),
            mn_rx_util: r.utilisation(Res::Rx),
            mn_link_util: r.utilisation(Res::LinkOut).max(r.utilisation(Res::LinkIn)),
            end_bytes: end,
            avg_bytes: avg,
            avg_live: traces.iter().map(|t| t.avg_live_bytes).sum(),
            static_bytes: peak,
            allocs,
            frees,
        });
    }
    rows
}

fn swap_rows(
    inp: &Inputs,
    m: &Measured,
    cfg: &swap::SwapConfig,
    cns: usize,
    threads: usize,
    tick: &mut dyn FnMut(&str),
) -> Vec<WorkloadRow> {
    let n = cns * threads;
    tick(&format!("swap: generating {n} application traces"));
    let chunked: Vec<swap::SwapTrace> = (0..n).map(|t| swap::trace(cfg, t as u64)).collect();
    let paged_cfg = swap::SwapConfig { region_pages: 1, ..cfg.clone() };
    let paged: Vec<swap::SwapTrace> = (0..n).map(|t| swap::trace(&paged_cfg, t as u64)).collect();
    let static_bytes = (n * cfg.pages) as u64 * swap::PAGE;
    let mut rows = Vec::new();
    for s in ALL {
        tick(&format!("swap: {} with {cns} CN(s) × {threads} threads", s.name()));
        let tr = if s == Scheme::Odrp { &paged } else { &chunked };
        let progs: Vec<_> =
            tr.iter().enumerate().map(|(i, t)| compile(s, inp, m, &t.ops, (i / threads) as u16)).collect();
        let r = sim::run(&progs, inp.mn_cores, inp.nic_units);
        let all = r.all_latencies();
        let faults = r.latencies.get(swap::FAULT as usize).cloned().unwrap_or_default();
        let (end, avg) = if s == Scheme::StaticMr {
            (static_bytes, static_bytes as f64)
        } else {
            (tr.iter().map(|t| t.end_reserved).sum(), tr.iter().map(|t| t.avg_reserved).sum())
        };
        rows.push(WorkloadRow {
            workload: "swap".into(),
            config: format!("{} MiB chunks, G=3", (cfg.region_pages as u64 * swap::PAGE) >> 20),
            scheme: s,
            threads: n,
            requests: r.total_requests(),
            throughput: r.throughput(),
            p50_ns: sim::quantile(&all, 0.5),
            p99_ns: sim::quantile(&all, 0.99),
            key_p50_ns: sim::quantile(&faults, 0.5),
            key_p99_ns: sim::quantile(&faults, 0.99),
            mn_cpu_util: r.utilisation(Res::Cpu),
            mn_nic_util: r.utilisation(Res::Nic),
            mn_rx_util: r.utilisation(Res::Rx),
            mn_link_util: r.utilisation(Res::LinkOut).max(r.utilisation(Res::LinkIn)),
            end_bytes: end,
            avg_bytes: avg,
            avg_live: tr.iter().map(|t| t.avg_remote_live).sum(),
            static_bytes,
            allocs: if s == Scheme::StaticMr { 0 } else { tr.iter().map(|t| t.allocs).sum() },
            frees: if s == Scheme::StaticMr { 0 } else { tr.iter().map(|t| t.frees).sum() },
        });
    }
    rows
}

/// How many times [`run`] calls `tick` on a full-size run, for a progress bar: inputs, 4
/// geometries, 2 × 7 micro rows, 7 curve points, 2 × 3 alloc-chain counts, 6 KV configurations, 4 YCSB workloads, 2
/// allocation traces and the cache (each traces + 6 schemes),
/// swap (traces + 6 schemes), the sweep's unit counts, the sensitivity, the pool sizes of the
/// scale sweep, the comparison.
pub const STEPS: u64 = 1 + 4 + 14 + 7 + 6 + 13 * 7 + 7 + 6 + 4 + 3 + 1;

pub fn run(args: &Options, tick: &mut dyn FnMut(&str)) -> Result<Results, String> {
    let t0 = Instant::now();
    let sizes = Sizes::of(args.quick);
    let threads = if args.quick { args.threads.min(4) } else { args.threads }.max(1);
    let cns = args.cns.clamp(1, 24);
    tick("measuring one-sided READ/WRITE on the model");
    let inp = inputs::measure_inputs(omw_loopback::CostModel::CX6, args.mn_cores.max(1), args.mn_nic_units.max(1))?;
    let mut geos = Vec::new();
    for (g, chunk) in [(2u8, 4096u64), (2, 16384), (2, 2048), (3, 1 << 20)] {
        tick(&format!("measuring chains and host-engine laps: G={g}, {} KiB chunks", chunk >> 10));
        let mut m = inputs::measure_geometry(&inp, g, chunk, 24)?;
        m.poster = Some(inputs::measure_poster(&inp, &m)?);
        geos.push(m);
    }
    let (micro_g, kv_g, kv2_g, swap_g) = (&geos[0], &geos[1], &geos[2], &geos[3]);
    // the 4 KiB KV granularity run uses the micro-benchmark geometry (G = 2, 4 KiB)
    let kv4_g = micro_g;

    let alloc_rows = alloc::run(&inp, micro_g, sizes.alloc_rounds, tick)?;
    let mut curve = Vec::new();
    for k in [1usize, 2, 4, 8, 12, 16, 24] {
        tick(&format!("allocation latency curve: {k} requesters"));
        for s in ALL {
            curve.push(alloc::in_sim(&inp, micro_g, s, k, sizes.alloc_rounds.max(20)));
        }
        if k == 1 || k == 24 || !args.quick {
            curve.push(alloc::osmw_on_model(&inp, micro_g, k, sizes.alloc_rounds)?);
        }
    }

    let chains_rows = alloc::chains(&inp, micro_g, if args.quick { 48 } else { 400 }, tick)?;

    let mut wl = Vec::new();
    let kv_main = kv::KvConfig {
        chunk: 16384,
        classes: vec![2048, 4096, 8192],
        keys_per_thread: sizes.kv_keys,
        mixed_ops: sizes.kv_mixed,
        seed: args.seed,
    };
    wl.extend(kv_rows(&inp, kv_g, "objects 2-8 KiB, 16 KiB chunks, 1 CN", &kv_main, 1, threads, &ALL, tick));
    wl.extend(kv_rows(
        &inp,
        kv_g,
        &format!("objects 2-8 KiB, 16 KiB chunks, {cns} CNs"),
        &kv_main,
        cns,
        threads,
        &ALL,
        tick,
    ));
    let small = vec![256u64, 512, 1024];
    for (chunk, g) in [(2048u64, kv2_g), (4096, kv4_g)] {
        let cfg = kv::KvConfig { chunk, classes: small.clone(), ..kv_main.clone() };
        let name = format!("{} KiB allocations (objects 256 B-1 KiB), 1 CN", chunk >> 10);
        wl.extend(kv_rows(&inp, g, &name, &cfg, 1, threads, &ALL, tick));
    }
    // no second level: every object its own MN allocation; and the paper's 24 threads on a CN
    let direct = kv::KvConfig { chunk: 2048, classes: vec![2048], ..kv_main.clone() };
    wl.extend(kv_rows(&inp, kv2_g, "one MN allocation per object (2 KiB), 1 CN", &direct, 1, threads, &ALL, tick));
    let t24 = if args.quick { 8 } else { 24 };
    let cfg24 = kv::KvConfig { chunk: 2048, classes: small.clone(), ..kv_main.clone() };
    wl.extend(kv_rows(
        &inp,
        kv2_g,
        &format!("2 KiB allocations (objects 256 B-1 KiB), 1 CN × {t24} threads"),
        &cfg24,
        1,
        t24,
        &ALL,
        tick,
    ));
    // the field's workloads: YCSB A-D (Zipf 0.99, 1 KiB values, as FUSEE), allocation traces
    // shaped like mimalloc-bench's, a Twitter-shaped cache — on `cns` CNs × `threads`
    let n = cns * threads;
    for w in kv::Ycsb::ALL {
        let name = format!("{}, {cns} CNs", w.name());
        tick(&format!("{name}: generating {n} client traces"));
        let traces: Vec<kv::KvTrace> = (0..n)
            .map(|t| kv::ycsb(w, 16384, 1024, sizes.kv_keys, sizes.kv_mixed, 0.99, args.seed, t as u64))
            .collect();
        let tw = Traces { workload: "ycsb", name: &name, chunk: 16384, key_tags: &[kv::INSERT, kv::UPDATE] };
        wl.extend(trace_rows(&inp, kv_g, &tw, &traces, cns, threads, &ALL, tick));
    }
    for shape in malloc::Shape::ALL {
        let name = format!("{}, 4 KiB chunks, {cns} CNs", shape.name());
        tick(&format!("{name}: generating {n} client traces"));
        let traces: Vec<kv::KvTrace> =
            (0..n).map(|t| malloc::trace(shape, 4096, sizes.kv_keys, sizes.kv_mixed, args.seed, t as u64)).collect();
        let tw = Traces { workload: "malloc", name: &name, chunk: 4096, key_tags: &[malloc::MALLOC] };
        wl.extend(trace_rows(&inp, micro_g, &tw, &traces, cns, threads, &ALL, tick));
    }
    {
        let name = format!("Twitter-shaped cache (30 % sets, TTLs, values 64 B-1 KiB), {cns} CNs");
        tick(&format!("{name}: generating {n} client traces"));
        let ops = 4 * sizes.kv_mixed;
        let traces: Vec<kv::KvTrace> =
            (0..n).map(|t| kv::cache(16384, sizes.kv_keys, ops, 30, 0.99, args.seed, t as u64)).collect();
        let tw = Traces { workload: "cache", name: &name, chunk: 16384, key_tags: &[kv::INSERT, kv::UPDATE] };
        wl.extend(trace_rows(&inp, kv_g, &tw, &traces, cns, threads, &ALL, tick));
    }
    let swap_cfg = swap::SwapConfig {
        pages: sizes.swap_pages,
        local_pages: sizes.swap_pages / 2,
        accesses: sizes.swap_accesses,
        region_pages: 256,
        readahead: 8,
        // 20 µs of compute per access: the MN's link stays well below saturation, so the
        // schemes' control paths show (at 2 µs the link was the bottleneck of every scheme)
        compute_ns: 20_000,
        write_pct: 50,
        seed: args.seed,
    };
    wl.extend(swap_rows(&inp, swap_g, &swap_cfg, cns, (threads / 2).max(1), tick));

    let (units, cores): (&[usize], &[usize]) =
        if args.quick { (&[1, 10], &[1, 4]) } else { (&[1, 2, 4, 8, 10, 16], &[1, 2, 4]) };
    let sweep_cfgs = sweep::configs(sizes.kv_keys, sizes.kv_mixed, args.seed, cns);
    let sweep_rows = sweep::run(&sweep_cfgs, threads, units, cores, tick)?;
    // sensitivity to the unmeasured inputs, on the most allocation-heavy configuration
    let heavy: Vec<sweep::SweepConfig> = sweep_cfgs.iter().filter(|c| c.kv.chunk == 2048).cloned().collect();
    let sensitivity = sweep::sensitivity(&heavy, threads, tick)?;

    let scale_sizes: &[u32] = if args.scale {
        &[1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]
    } else if args.quick {
        &[1 << 10, 1 << 12]
    } else {
        &[1 << 10, 1 << 12, 1 << 14]
    };
    let scale = scale::run(scale_sizes, tick)?;

    tick("comparing with the paper");
    let validation = report::validate(&inp, &alloc_rows, &wl, &sweep_rows);
    Ok(Results {
        inputs: inp,
        geometries: geos,
        alloc: alloc_rows,
        alloc_curve: curve,
        alloc_chains: chains_rows,
        workloads: wl,
        sweep: sweep_rows,
        sensitivity,
        validation,
        scale,
        wall_s: t0.elapsed().as_secs_f64(),
        args: args.clone(),
    })
}
