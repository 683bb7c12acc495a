//! The CN library's costs, measured — not asserted (DESIGN.md §7): operations per second and
//! latency of 1 KiB READs through the blocking API (staged and zero-copy) and the futures
//! (staged and zero-copy) with 1, 4 and 8 threads or tasks in flight, and the
//! application-visible latency of an allocation with and without the reserve. Every figure is
//! printed as a ratio against a baseline measured in the same run (blocking, staged, one
//! thread; allocation: a round trip to the MN), because only ratios mean anything across
//! machines, and on the model or soft-RoCE nothing else does.
//!
//! `cargo bench -p omw-client --bench cnlib` runs on the loopback model. Against a real MN:
//! `OMW_BENCH_MN=IP:PORT cargo bench -p omw-client --features verbs --bench cnlib` (in the
//! soft-RoCE VM: docs/CN-LIBRARY.md). `-- --test` (scripts/bench-smoke) runs a few operations
//! of each, for the harness's sake only.

use omw_client::transport::Transport;
use omw_client::{AsyncCn, Chunk, Cn, Options, ReservePolicy, WaitPolicy};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LEN: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    SyncStaged,
    SyncZeroCopy,
    AsyncStaged,
    AsyncZeroCopy,
}

struct Figure {
    ops_per_sec: f64,
    p50: Duration,
    p99: Duration,
}

fn figure(total: usize, elapsed: Duration, mut lat: Vec<Duration>) -> Figure {
    lat.sort_unstable();
    let pct = |p: f64| lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).copied();
    Figure {
        ops_per_sec: total as f64 / elapsed.as_secs_f64().max(1e-9),
        p50: pct(0.5).unwrap_or_default(),
        p99: pct(0.99).unwrap_or_default(),
    }
}

fn sync_run<T: Transport>(cn: &Cn<T>, chunk: &Chunk, threads: usize, ops: usize, zero_copy: bool) -> Figure {
    let t0 = Instant::now();
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (cn, chunk) = (cn.clone(), chunk.clone());
            std::thread::spawn(move || {
                let mut lat = Vec::with_capacity(ops);
                let mut mr = cn.register(vec![0u8; LEN]).expect("register");
                let mut buf = vec![0u8; LEN];
                let off = ((t * LEN) as u64) % (chunk.size() - LEN as u64);
                for _ in 0..ops {
                    let s = Instant::now();
                    if zero_copy {
                        cn.read_into(&chunk, off, &mut mr, 0..LEN).expect("read_into");
                    } else {
                        cn.read(&chunk, off, &mut buf).expect("read");
                    }
                    lat.push(s.elapsed());
                }
                lat
            })
        })
        .collect();
    let lat: Vec<Duration> = hs.into_iter().flat_map(|h| h.join().expect("thread")).collect();
    figure(threads * ops, t0.elapsed(), lat)
}

fn async_run<T: Transport>(
    rt: &tokio::runtime::Runtime,
    cn: &AsyncCn<T>,
    chunk: &Chunk,
    tasks: usize,
    ops: usize,
    zero_copy: bool,
) -> Figure {
    rt.block_on(async {
        let t0 = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for t in 0..tasks {
            let (cn, chunk) = (cn.clone(), chunk.clone());
            set.spawn(async move {
                let mut lat = Vec::with_capacity(ops);
                let mut mr = Some(cn.cn().register(vec![0u8; LEN]).expect("register"));
                let off = ((t * LEN) as u64) % (chunk.size() - LEN as u64);
                for _ in 0..ops {
                    let s = Instant::now();
                    if zero_copy {
                        let (r, m) = cn.read_into(&chunk, off, mr.take().expect("buffer"), 0..LEN).await;
                        r.expect("read_into");
                        mr = Some(m);
                    } else {
                        cn.read(&chunk, off, LEN).await.expect("read");
                    }
                    lat.push(s.elapsed());
                }
                lat
            });
        }
        let mut lat = Vec::new();
        while let Some(r) = set.join_next().await {
            lat.extend(r.expect("task"));
        }
        figure(tasks * ops, t0.elapsed(), lat)
    })
}

/// Allocation latency seen by the application: alloc, then free (not timed), `n` times.
fn alloc_latency<T: Transport>(cn: &Cn<T>, n: usize) -> Figure {
    let mut lat = Vec::with_capacity(n);
    let t0 = Instant::now();
    for _ in 0..n {
        let s = Instant::now();
        let c = cn.alloc().expect("alloc");
        lat.push(s.elapsed());
        cn.free(c).expect("free");
        // let a background refill catch up as an application's think time would
        std::thread::sleep(Duration::from_micros(200));
    }
    figure(n, t0.elapsed(), lat)
}

fn bench<T: Transport>(name: &str, connect: impl Fn(Options) -> Cn<T>, quick: bool) {
    let ops = if quick { 4 } else { 2000 };
    let wait = WaitPolicy::default();
    let cn = connect(Options { wait, ..Options::default() });
    let chunk = cn.alloc().expect("alloc");
    cn.write(&chunk, 0, &vec![7u8; chunk.size() as usize]).expect("fill");
    println!("omw-client bench on {name}: {LEN} B READs; ratios against blocking+staged, 1 thread, this run");
    println!("{:<22} {:>7} {:>12} {:>7} {:>10} {:>10}", "mode", "threads", "ops/s", "ratio", "p50 µs", "p99 µs");
    let mut base = None;
    // the async handle's driver task only for the futures: blocking waiters leave the fd to it
    let mut acn = None;
    for mode in [Mode::SyncStaged, Mode::SyncZeroCopy, Mode::AsyncStaged, Mode::AsyncZeroCopy] {
        if mode == Mode::AsyncStaged {
            acn = Some(rt_wrap(&cn));
        }
        for threads in [1usize, 4, 8] {
            let f = match mode {
                Mode::SyncStaged => sync_run(&cn, &chunk, threads, ops, false),
                Mode::SyncZeroCopy => sync_run(&cn, &chunk, threads, ops, true),
                Mode::AsyncStaged | Mode::AsyncZeroCopy => {
                    let (rt, a) = acn.as_ref().expect("made before the first async mode");
                    async_run(rt, a, &chunk, threads, ops, mode == Mode::AsyncZeroCopy)
                }
            };
            let b = *base.get_or_insert(f.ops_per_sec);
            println!(
                "{:<22} {:>7} {:>12.0} {:>7.2} {:>10.1} {:>10.1}",
                format!("{mode:?}"),
                threads,
                f.ops_per_sec,
                f.ops_per_sec / b,
                f.p50.as_secs_f64() * 1e6,
                f.p99.as_secs_f64() * 1e6
            );
        }
    }
    cn.free(chunk).expect("free");
    drop(acn);
    cn.shutdown().expect("shutdown");
    drop(cn);
    let n = if quick { 4 } else { 300 };
    let plain = connect(Options::default());
    let rt = alloc_latency(&plain, n);
    plain.shutdown().expect("shutdown");
    drop(plain);
    let reserved = connect(Options { reserve: Some(ReservePolicy::new(2, 8).expect("policy")), ..Options::default() });
    while reserved.reserved() < 2 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let rs = alloc_latency(&reserved, n);
    let from = reserved.stats().allocs_from_reserve;
    reserved.shutdown().expect("shutdown");
    println!("allocation latency as the application sees it ({n} allocations each):");
    println!(
        "  round trip to the MN: p50 {:.1} µs, p99 {:.1} µs (baseline 1.00)",
        rt.p50.as_secs_f64() * 1e6,
        rt.p99.as_secs_f64() * 1e6
    );
    println!(
        "  from the reserve:     p50 {:.1} µs, p99 {:.1} µs ({from} of {n} from the reserve); p50 ratio {:.3}, p99 ratio {:.3}",
        rs.p50.as_secs_f64() * 1e6,
        rs.p99.as_secs_f64() * 1e6,
        rs.p50.as_secs_f64() / rt.p50.as_secs_f64().max(1e-12),
        rs.p99.as_secs_f64() / rt.p99.as_secs_f64().max(1e-12)
    );
}

/// One runtime for the async handle's driver task and the tasks it serves.
fn rt_wrap<T: Transport>(cn: &Cn<T>) -> (tokio::runtime::Runtime, AsyncCn<T>) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let a = rt.block_on(async { AsyncCn::new(cn.clone()) }).expect("async client");
    (rt, a)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--test");
    #[cfg(feature = "verbs")]
    if let Ok(addr) = std::env::var("OMW_BENCH_MN") {
        let addr = addr.parse().expect("OMW_BENCH_MN=IP:PORT");
        let t = omw_client::verbs::Target::new(addr);
        bench(&format!("verbs, MN {addr}"), |o| Cn::connect(t.clone(), o).expect("connect"), quick);
        return;
    }
    let cfg = omw_client::model::ModelConfig { chunk_size: 16 << 10, chunks: 64, ..Default::default() };
    let model = Arc::new(omw_client::model::Model::start(cfg).expect("model"));
    bench("the loopback model", |o| Cn::connect(&*model, o).expect("connect"), quick);
}
