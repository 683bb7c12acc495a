//! verbs-bench — what memory windows buy on a real RDMA device, measured in one run.
//!
//!   verbs-bench [--device D] [--iters N] [--alloc-iters N] [--sizes 4K,64K,1M,4M]
//!               [--part all|mw|alloc] [--listen IP:PORT] [--pool-size B] [--chunk-size B]
//!               [--group-size G]
//!
//! Part 1 (`mw`), one process, one loopback RC pair on the device: for each size, a type-2
//! window bind + LOCAL_INV (each signalled and waited for, as the MN does) against
//! `ibv_reg_mr` + `ibv_dereg_mr` of a region of that size (its pages already touched), plus
//! the bind + invalidate pair posted back to back with one completion. Also, on the same pair,
//! a plain 64 B SEND/RECV ping-pong: the transport floor of a round trip.
//!
//! Part 2 (`alloc`): an MN daemon (host engine: libibverbs has no WAIT/ENABLE) on a thread of
//! this process and a CN client on the main thread, over rdma_cm on `--listen`; then the
//! measurement of `omw cn bench` (`bench` in cli/src/cn.rs, repeated here to print every ratio):
//! host-engine allocation latency (request SEND, MN CPU runs the alloc chain, WRITE_WITH_IMM
//! reply) against a SEND/RECV round trip through the MN loop on the same Alloc QP (a request
//! the MN rejects at once), and against part 1's ping-pong. `--alloc-iters` (default 100) is
//! separate from `--iters` (default 200): the MN of this build dies after ~100–125 rejected
//! requests from one CN (`ibv_post_recv` ENOMEM on that CN's request queue), which `omw cn
//! bench` sends one per iteration.
//!
//! Prints medians and ratios. On soft-RoCE in an emulated VM the absolute figures are those of
//! software on emulation: only ratios measured in the same run mean anything (DESIGN.md §6.2).
//! Typical run: `cargo build --release -p omw-verbs --bins && scripts/rxe-vm -- target/release/verbs-bench`.

use omw_core::access::AccessFlags;
use omw_core::device::{DataPath, Domain, Provision, WcStatus};
use omw_core::ids::Qpn;
use omw_core::wire::wqe::{RecvWqe, Sge, Wqe, WqeFlags};
use omw_verbs::cn::{CnClient, CnOptions};
use omw_verbs::mn::{MemoryNodeDaemon, MnOptions};
use omw_verbs::{VerbsBackend, VerbsError};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

type Result<T> = std::result::Result<T, VerbsError>;

const T: Duration = Duration::from_secs(10);

struct Args {
    device: Option<String>,
    iters: usize,
    alloc_iters: usize,
    sizes: Vec<u64>,
    part_mw: bool,
    part_alloc: bool,
    listen: SocketAddr,
    pool_size: u64,
    chunk_size: u64,
    group_size: u8,
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: verbs-bench [--device D] [--iters N] [--alloc-iters N] [--sizes 4K,64K,1M,4M]\n\
         \x20                  [--part all|mw|alloc] [--listen IP:PORT] [--pool-size B] [--chunk-size B]\n\
         \x20                  [--group-size G]"
    );
    ExitCode::from(2)
}

fn size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (n, mul) = match s.char_indices().last()? {
        (i, 'K' | 'k') => (&s[..i], 1u64 << 10),
        (i, 'M' | 'm') => (&s[..i], 1 << 20),
        (i, 'G' | 'g') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    n.parse::<u64>().ok()?.checked_mul(mul).filter(|v| *v > 0)
}

fn parse(argv: &[String]) -> Option<Args> {
    let mut a = Args {
        device: None,
        iters: 200,
        alloc_iters: 100,
        sizes: vec![4 << 10, 64 << 10, 1 << 20, 4 << 20],
        part_mw: true,
        part_alloc: true,
        listen: "192.0.2.1:7499".parse().ok()?,
        pool_size: 4 << 20,
        chunk_size: 4 << 10,
        group_size: 3,
    };
    let mut it = argv.iter();
    while let Some(k) = it.next() {
        let mut v = || it.next().cloned();
        match k.as_str() {
            "--device" => a.device = Some(v()?),
            "--iters" => a.iters = v()?.parse().ok().filter(|n| *n > 0)?,
            "--alloc-iters" => a.alloc_iters = v()?.parse().ok().filter(|n| *n > 0)?,
            "--sizes" => a.sizes = v()?.split(',').map(size).collect::<Option<Vec<_>>>()?,
            "--part" => {
                let p = v()?;
                a.part_mw = matches!(p.as_str(), "all" | "mw");
                a.part_alloc = matches!(p.as_str(), "all" | "alloc");
                if !a.part_mw && !a.part_alloc {
                    return None;
                }
            }
            "--listen" => a.listen = v()?.parse().ok()?,
            "--pool-size" => a.pool_size = size(&v()?)?,
            "--chunk-size" => a.chunk_size = size(&v()?)?,
            "--group-size" => a.group_size = v()?.parse().ok()?,
            _ => return None,
        }
    }
    if a.sizes.iter().any(|s| *s > u32::MAX as u64) {
        return None;
    }
    Some(a)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn ok(c: omw_core::device::Completion, what: &str) -> Result<()> {
    if c.status == WcStatus::Success {
        Ok(())
    } else {
        Err(VerbsError::Completion { what: what.into(), status: c.status })
    }
}

/// One row of part 1.
struct MwRow {
    size: u64,
    reg_dereg: Duration,
    bind_inv: Duration,
    bind: Duration,
    inv: Duration,
    chained: Duration,
}

/// Part 1: window bind + invalidate vs MR registration + deregistration, per size.
fn part_mw(a: &Args) -> Result<(String, Vec<MwRow>, Duration)> {
    let mut b = VerbsBackend::open(a.device.as_deref())?;
    let dev = b.device_name().to_string();
    let max = a.sizes.iter().copied().max().unwrap_or(4096);
    let region = b.alloc_region(max, 4096)?;
    // touch every page once, so registration measures pinning, not first-touch faults
    b.write_local(region, &vec![0x5A; max as usize])?;
    let (qa, qb) = b.create_loopback_pair()?;
    let mw = b.alloc_mw()?;
    let mut rows = Vec::new();
    let mut wr = 0u64;
    let next = |n: &mut u64| {
        *n += 1;
        *n
    };
    for &size in &a.sizes {
        let warm = (a.iters / 10).max(2);
        // ibv_reg_mr + ibv_dereg_mr (the access rights an MR handed to a CN would carry)
        let rights = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
        let mut rd = Vec::with_capacity(a.iters);
        for i in 0..warm + a.iters {
            let t = Instant::now();
            let k = b.reg_mr(Domain::CnFacing, region, size, rights)?;
            b.dereg_mr(k.lkey)?;
            if i >= warm {
                rd.push(t.elapsed());
            }
        }
        // bind + LOCAL_INV of a type-2 window over an MR of that size (registered once)
        let mr = b.reg_mr(Domain::CnFacing, region, size, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
        let (mut both, mut bind, mut inv, mut chained) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..warm + a.iters {
            let key = b.mw_state(mw).map(|(k, _)| k.next_key()).unwrap_or(mw);
            let bw = Wqe::bind_mw(key.0, region, size as u32, mr.lkey, qa.get(), AccessFlags::DATA_WINDOW);
            let t = Instant::now();
            ok(b.post_wait(qa, &bw.with_wr_id(next(&mut wr)), T)?, "BIND_MW")?;
            let t1 = t.elapsed();
            ok(b.post_wait(qa, &Wqe::local_inv(key.0).with_wr_id(next(&mut wr)), T)?, "LOCAL_INV")?;
            let t2 = t.elapsed();
            // the same pair posted back to back, one completion (the bind unsignalled)
            let key2 = key.next_key();
            let bw = Wqe::bind_mw(key2.0, region, size as u32, mr.lkey, qa.get(), AccessFlags::DATA_WINDOW)
                .with_flags(WqeFlags::empty())
                .with_wr_id(next(&mut wr));
            let t = Instant::now();
            b.post_send(qa, &bw)?;
            ok(b.post_wait(qa, &Wqe::local_inv(key2.0).with_wr_id(next(&mut wr)), T)?, "chained LOCAL_INV")?;
            let t3 = t.elapsed();
            if i >= warm {
                bind.push(t1);
                inv.push(t2 - t1);
                both.push(t2);
                chained.push(t3);
            }
        }
        b.dereg_mr(mr.lkey)?;
        rows.push(MwRow {
            size,
            reg_dereg: median(rd),
            bind_inv: median(both),
            bind: median(bind),
            inv: median(inv),
            chained: median(chained),
        });
    }
    let floor = ping_pong(&mut b, (qa, qb), a.iters)?;
    Ok((dev, rows, floor))
}

/// Median round trip of a 64 B SEND answered by a 64 B SEND on a loopback pair (receives
/// posted beforehand, send completions reaped outside the timing).
fn ping_pong(b: &mut VerbsBackend, (qa, qb): (Qpn, Qpn), iters: usize) -> Result<Duration> {
    const LEN: u32 = 64;
    let buf = b.alloc_region(4096, 4096)?;
    let k = b.reg_mr(Domain::CnFacing, buf, 4096, AccessFlags::LOCAL_WRITE)?;
    let recv = |b: &mut VerbsBackend, q: Qpn, off: u64| -> Result<()> {
        let mut r = RecvWqe { wr_id: off, sges: heapless::Vec::new() };
        let _ = r.sges.push(Sge { addr: buf + off, length: LEN, lkey: k.lkey });
        b.post_recv(q, &r)
    };
    let warm = (iters / 10).max(2);
    let mut rtt = Vec::with_capacity(iters);
    for i in 0..warm + iters {
        recv(b, qb, 1024)?;
        recv(b, qa, 2048)?;
        let (ping, pong) = (2 * i as u64 + 1, 2 * i as u64 + 2);
        let send = |id: u64, off: u64| Wqe::send(buf + off, k.lkey, LEN).with_wr_id(id).with_flags(WqeFlags::SIGNALED);
        let t = Instant::now();
        b.post_send(qa, &send(ping, 0))?;
        ok(b.wait_recv(qb, T)?, "ping RECV")?;
        b.post_send(qb, &send(pong, 512))?;
        ok(b.wait_recv(qa, T)?, "pong RECV")?;
        let d = t.elapsed();
        ok(b.wait_send(qa, ping, T)?, "ping SEND")?;
        ok(b.wait_send(qb, pong, T)?, "pong SEND")?;
        if i >= warm {
            rtt.push(d);
        }
    }
    Ok(median(rtt))
}

fn print_mw(dev: &str, iters: usize, rows: &[MwRow]) {
    println!(
        "part 1 — type-2 window bind + LOCAL_INV vs ibv_reg_mr + ibv_dereg_mr on {dev} ({iters} iterations, medians)"
    );
    println!(
        "  {:>7}  {:>13}  {:>12}  {:>10}  {:>10}  {:>12}  {:>16}  {:>16}",
        "size", "reg+dereg", "bind+inv", "bind", "inv", "chained", "reg+dereg/b+i", "reg+dereg/chain"
    );
    for r in rows {
        let ratio = |d: Duration| r.reg_dereg.as_secs_f64() / d.as_secs_f64().max(1e-12);
        println!(
            "  {:>7}  {:>13}  {:>12}  {:>10}  {:>10}  {:>12}  {:>15.2}×  {:>15.2}×",
            human(r.size),
            us(r.reg_dereg),
            us(r.bind_inv),
            us(r.bind),
            us(r.inv),
            us(r.chained),
            ratio(r.bind_inv),
            ratio(r.chained)
        );
    }
    println!("  (bind+inv: each work request signalled and waited for; chained: bind unsignalled, one completion)");
}

static STOP: AtomicBool = AtomicBool::new(false);

/// Part 2: an MN daemon on a thread, a CN here, then the measurement of `omw cn bench`.
fn part_alloc(a: &Args, floor: Option<Duration>) -> Result<()> {
    let opts = MnOptions {
        device: a.device.clone(),
        listen: a.listen,
        pool_size: a.pool_size,
        chunk_size: a.chunk_size,
        group_size: a.group_size,
        max_cns: 4,
        alloc_chains: 1,
        quota: 0,
        insecure: false,
        stats_every: Duration::ZERO,
        scrub: true,
        gid_index: None,
        metrics: None,
        stats_json: false,
        lease: Duration::from_secs(2),
        serial_engine: false,
        tenants: None,
        offload_profile: None,
        replays: Default::default(),
    };
    let (tx, rx) = mpsc::channel::<std::result::Result<String, String>>();
    let mn = std::thread::spawn(move || {
        let mut d = match MemoryNodeDaemon::start(opts) {
            Ok(d) => d,
            Err(e) => {
                let _ = tx.send(Err(e.to_string()));
                return Err(e);
            }
        };
        let _ = tx.send(Ok(format!("{}; {}", d.mode, d.protection)));
        let r = d.run(&STOP);
        drop(d);
        r
    });
    let started = rx
        .recv_timeout(Duration::from_secs(120))
        .map_err(|_| VerbsError::Timeout { what: "the MN daemon to start".into() })?;
    let mode = started.map_err(|e| VerbsError::Config(format!("MN did not start: {e}")))?;
    println!("part 2 — host-engine allocation vs SEND/RECV round trip (MN on {}: {mode})", a.listen);
    let r = (|| -> Result<()> {
        let mut c = CnClient::connect(
            a.listen,
            &CnOptions { device: a.device.clone(), timeout: T, credential: None, source: None, alloc_chains: 1 },
        )?;
        alloc_bench(&mut c, a.alloc_iters, floor)
    })();
    // the CN has disconnected (dropped); let the MN see it, then stop it
    std::thread::sleep(Duration::from_millis(200));
    STOP.store(true, Ordering::Relaxed);
    let joined = mn.join().map_err(|_| VerbsError::Config("the MN thread panicked".into()))?;
    r.and(joined)
}

/// `omw cn bench`'s loop (cli/src/cn.rs) (alloc, free, rejected request; same warm-up), with the
/// ratios printed.
fn alloc_bench(c: &mut CnClient, iters: usize, floor: Option<Duration>) -> Result<()> {
    let rejected = |c: &mut CnClient| -> Result<()> {
        match c.bad_request_round_trip()? {
            Some(_) => Ok(()),
            None => Err(VerbsError::Timeout { what: "the MN's error reply".into() }),
        }
    };
    for _ in 0..3 {
        let x = c.alloc()?;
        c.free(&x)?;
        rejected(c)?;
    }
    let (mut alloc, mut free, mut rtt) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..iters {
        let t = Instant::now();
        let x = c.alloc()?;
        alloc.push(t.elapsed());
        let t = Instant::now();
        c.free(&x)?;
        free.push(t.elapsed());
        let t = Instant::now();
        rejected(c)?;
        rtt.push(t.elapsed());
    }
    let spread = |v: &[Duration]| {
        let mut v = v.to_vec();
        v.sort();
        let q = |x: f64| us(v[((v.len() - 1) as f64 * x) as usize]);
        format!("(p10 {}, p90 {})", q(0.1), q(0.9))
    };
    let spreads = [spread(&alloc), spread(&free), spread(&rtt)];
    let (al, fr, rt) = (median(alloc), median(free), median(rtt));
    let ratio = |x: Duration, y: Duration| x.as_secs_f64() / y.as_secs_f64().max(1e-12);
    println!("  ({iters} iterations, medians)");
    println!(
        "  host-engine allocation (SEND request, MN CPU runs the alloc chain, WRITE_WITH_IMM reply): {} {}",
        us(al),
        spreads[0]
    );
    println!(
        "  free request (SEND; completion at the CN, the MN runs the free chain after)            : {} {}",
        us(fr),
        spreads[1]
    );
    println!(
        "  SEND/RECV round trip through the MN loop on the same Alloc QP (request rejected)     : {} {}",
        us(rt),
        spreads[2]
    );
    println!(
        "  (the CN waits for that error reply sleeping 200 µs between polls — CnClient::wait_failure — \
         so the MN-loop round trip is an upper bound; the allocation path busy-polls)"
    );
    println!("  ratio allocation / MN-loop round trip: {:.2}", ratio(al, rt));
    if let Some(f) = floor {
        println!("  ratio allocation / plain SEND/RECV ping-pong (part 1): {:.2}", ratio(al, f));
        println!("  ratio MN-loop round trip / plain ping-pong: {:.2}", ratio(rt, f));
    }
    Ok(())
}

fn run(a: &Args) -> Result<()> {
    println!(
        "verbs-bench: medians of {} (part 1) / {} (part 2) iterations; soft-RoCE in an emulated VM measures \
         software on emulation — compare ratios from one run, not absolute times",
        a.iters, a.alloc_iters
    );
    let mut floor = None;
    if a.part_mw {
        let (dev, rows, f) = part_mw(a)?;
        print_mw(&dev, a.iters, &rows);
        println!("  plain SEND/RECV ping-pong on the same loopback pair (64 B each way): {}", us(f));
        floor = Some(f);
    }
    if a.part_alloc {
        part_alloc(a, floor)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "-h" || a == "--help") {
        return usage();
    }
    let Some(a) = parse(&argv) else {
        return usage();
    };
    match run(&a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("verbs-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
