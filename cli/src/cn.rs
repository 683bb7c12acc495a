//! What `omw cn` does over omw-verbs' `CnClient`: the subcommands (allocate, round trip, load,
//! bench) and a line-based script mode that the multi-process tests (backend-verbs/tests, kv's
//! rxe_kv) and operators drive interactively. Tooling, so it lives with the binary, not the backend.

use omw_core::ids::Rkey;
use omw_verbs::cn::{Allocation, CnClient, CnOptions};
use omw_verbs::error::{Result, VerbsError};
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub enum CnCommand {
    /// Allocate `count` chunks, print them, free them.
    Alloc { count: u32 },
    /// Allocate, write a pattern through every access QP, read it back, free, reallocate.
    Roundtrip { bytes: usize },
    /// `ops` cycles of alloc → write → read → verify → free; prints rate and latency.
    Load { ops: u32, bytes: usize },
    /// Allocation latency against a round trip through the MN loop on the same QPs.
    Bench { iters: u32 },
    /// Read commands from stdin, one per line (see [`run_script`]).
    Script,
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    (0..n).map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8).collect()
}

fn describe(a: &Allocation) -> String {
    let rk: Vec<String> = a.rkeys.iter().map(|r| format!("{:#010x}", r.0)).collect();
    format!(
        "entry={:#x} base={:#x} len={} rkeys={} owner_rkey={:#010x}",
        a.entry_addr,
        a.base,
        a.length,
        rk.join(","),
        a.owner_rkey.0
    )
}

pub fn run(addr: SocketAddr, opts: &CnOptions, cmd: CnCommand) -> Result<()> {
    let mut c = CnClient::connect(addr, opts)?;
    eprintln!(
        "omw cn: connected as {} (chunk {} B, group size {}, {} access QPs, quota {})",
        c.cn,
        c.info.chunk_size,
        c.info.group_size,
        c.access_qps().len(),
        c.info.quota
    );
    match cmd {
        CnCommand::Alloc { count } => {
            let mut v = Vec::new();
            for _ in 0..count {
                let a = c.alloc()?;
                println!("allocated {}", describe(&a));
                v.push(a);
            }
            for a in &v {
                c.free(a)?;
            }
            println!("freed {}", v.len());
        }
        CnCommand::Roundtrip { bytes } => {
            for round in 0..2u64 {
                let a = c.alloc()?;
                println!("allocated {}", describe(&a));
                let n = bytes.min(a.length as usize / c.access_qps().len().max(1));
                for w in 0..c.access_qps().len() {
                    let data = pattern(round * 10 + w as u64, n);
                    let off = (w * n) as u64;
                    c.write(&a, w, off, &data)?;
                    let back = c.read(&a, w, off, n)?;
                    if back != data {
                        return Err(VerbsError::Protocol(format!("read back differs through access QP {w}")));
                    }
                    println!("access QP {w}: wrote and read back {n} B at offset {off}");
                }
                c.free(&a)?;
                println!("freed entry {:#x}", a.entry_addr);
            }
        }
        CnCommand::Load { ops, bytes } => {
            let t0 = Instant::now();
            let mut lat = Vec::with_capacity(ops as usize);
            for i in 0..ops {
                let t = Instant::now();
                let a = c.alloc()?;
                lat.push(t.elapsed());
                let n = bytes.min(a.length as usize);
                let data = pattern(i as u64, n);
                let w = i as usize % c.access_qps().len().max(1);
                c.write(&a, w, 0, &data)?;
                if c.read(&a, w, 0, n)? != data {
                    return Err(VerbsError::Protocol("read back differs".into()));
                }
                c.free(&a)?;
            }
            let dt = t0.elapsed();
            lat.sort();
            let p = |q: f64| lat.get(((lat.len() as f64 - 1.0) * q) as usize).copied().unwrap_or_default();
            println!(
                "load: {ops} alloc/write/read/free cycles in {:.3} s ({:.0} cycles/s); alloc latency p50 {:?} p99 {:?}",
                dt.as_secs_f64(),
                ops as f64 / dt.as_secs_f64(),
                p(0.5),
                p(0.99)
            );
        }
        CnCommand::Bench { iters } => bench(&mut c, iters)?,
        CnCommand::Script => {
            // stdin is read on a thread of its own, so that the CN keeps serving its queues
            // (reposting the receives the MN's lease probes use) while no command comes
            let (tx, rx) = std::sync::mpsc::channel::<String>();
            std::thread::spawn(move || {
                for line in std::io::stdin().lock().lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            run_script(&mut c, rx, std::io::stdout())?
        }
    }
    Ok(())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Host-engine allocation latency vs a round trip through the MN loop on the same Alloc QP
/// (a request the MN rejects at once: SEND, MN CPU, SEND back) — both measured here, in one run.
pub fn bench(c: &mut CnClient, iters: u32) -> Result<()> {
    let iters = iters.max(1);
    for _ in 0..3 {
        let a = c.alloc()?;
        c.free(&a)?;
        c.bad_request_round_trip()?;
    }
    let mut alloc = Vec::new();
    let mut free = Vec::new();
    let mut rtt = Vec::new();
    for _ in 0..iters {
        let t = Instant::now();
        let a = c.alloc()?;
        alloc.push(t.elapsed());
        let t = Instant::now();
        c.free(&a)?;
        free.push(t.elapsed());
        let t = Instant::now();
        if c.bad_request_round_trip()?.is_none() {
            return Err(VerbsError::Timeout { what: "the MN's error reply".into() });
        }
        rtt.push(t.elapsed());
    }
    let (a, f, r) = (median(alloc), median(free), median(rtt));
    println!("bench ({iters} iterations, medians):");
    println!("  host-engine allocation (SEND request, MN runs the alloc chain, WRITE_WITH_IMM reply): {a:?}");
    println!("  free request (SEND, completion at the CN; the MN runs the free chain after)         : {f:?}");
    println!("  SEND/RECV round trip through the MN loop on the same Alloc QP (request rejected)   : {r:?}");
    println!("  ratio allocation / round trip: {:.2}", a.as_secs_f64() / r.as_secs_f64().max(1e-12));
    Ok(())
}

fn parse_u64(s: &str) -> Result<u64> {
    let r = if let Some(h) = s.strip_prefix("0x") { u64::from_str_radix(h, 16) } else { s.parse() };
    r.map_err(|_| VerbsError::Config(format!("not a number: {s}")))
}

/// Script mode: one command per line, one answer line per command (flushed), so a test or an
/// operator can drive a CN step by step while it stays connected.
///
/// ```text
/// info                               -> ok cn=<id> chunk=<bytes> g=<G>
/// alloc                              -> ok <n> entry=… base=… len=… rkeys=…,… owner_rkey=…
/// write <n> <qp> <off> <text>        -> ok | err <status>
/// read <n> <qp> <off> <len>          -> ok <text> | err <status>
/// free <n>                           -> ok
/// rawwrite <qp> <addr> <rkey> <text> -> status <status>
/// rawread <qp> <addr> <rkey> <len>   -> status <status> [<text>]
/// freeentry <entry> <wait-ms>        -> refused <code> | none
/// flood <n>                          -> ok sent <k>   (n alloc requests whose answers are never read)
/// quit
/// ```
///
/// While no command arrives the CN keeps pumping its queues every 50 ms: an idle CN must keep
/// answering the MN's lease probes (each uses up one posted receive) or it is evicted.
pub fn run_script(c: &mut CnClient, input: std::sync::mpsc::Receiver<String>, mut out: impl Write) -> Result<()> {
    let mut allocs: Vec<Allocation> = Vec::new();
    let get = |allocs: &Vec<Allocation>, s: &str| -> Result<Allocation> {
        let i = parse_u64(s)? as usize;
        allocs.get(i).cloned().ok_or_else(|| VerbsError::Config(format!("no allocation {i}")))
    };
    loop {
        let line = match input.recv_timeout(Duration::from_millis(50)) {
            Ok(l) => l,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                // idle: serve the queues (a failure here shows in the next command's answer)
                let _ = c.pump();
                continue;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = (|| -> Result<String> {
            Ok(match w.as_slice() {
                [] => return Ok(String::new()),
                ["quit"] => return Ok("quit".into()),
                ["info"] => format!("ok cn={} chunk={} g={}", c.cn.get(), c.info.chunk_size, c.info.group_size),
                ["alloc"] => {
                    let a = c.alloc()?;
                    allocs.push(a.clone());
                    format!("ok {} {}", allocs.len() - 1, describe(&a))
                }
                ["write", n, qp, off, text] => {
                    let a = get(&allocs, n)?;
                    match c.write(&a, parse_u64(qp)? as usize, parse_u64(off)?, text.as_bytes()) {
                        Ok(()) => "ok".into(),
                        Err(VerbsError::Completion { status, .. }) => format!("err {status:?}"),
                        Err(e) => return Err(e),
                    }
                }
                ["read", n, qp, off, len] => {
                    let a = get(&allocs, n)?;
                    match c.read(&a, parse_u64(qp)? as usize, parse_u64(off)?, parse_u64(len)? as usize) {
                        Ok(v) => format!("ok {}", String::from_utf8_lossy(&v)),
                        Err(VerbsError::Completion { status, .. }) => format!("err {status:?}"),
                        Err(e) => return Err(e),
                    }
                }
                ["free", n] => {
                    let a = get(&allocs, n)?;
                    c.free(&a)?;
                    "ok".into()
                }
                ["rawwrite", qp, addr, rkey, text] => {
                    let st = c.write_raw(
                        parse_u64(qp)? as usize,
                        parse_u64(addr)?,
                        Rkey(parse_u64(rkey)? as u32),
                        text.as_bytes(),
                    )?;
                    format!("status {st:?}")
                }
                ["rawread", qp, addr, rkey, len] => {
                    let (st, v) = c.read_raw(
                        parse_u64(qp)? as usize,
                        parse_u64(addr)?,
                        Rkey(parse_u64(rkey)? as u32),
                        parse_u64(len)? as usize,
                    )?;
                    format!("status {st:?} {}", String::from_utf8_lossy(&v))
                }
                ["flood", n] => {
                    // hostile: requests whose answers this CN never reads (see
                    // CnClient::send_alloc_unread); it then stops serving its queues
                    let n = parse_u64(n)?;
                    let mut sent = 0;
                    for _ in 0..n {
                        if c.send_alloc_unread().is_err() {
                            break;
                        }
                        sent += 1;
                    }
                    format!("ok sent {sent}")
                }
                ["freeentry", entry, ms] => {
                    match c.free_entry(parse_u64(entry)?, Duration::from_millis(parse_u64(ms)?))? {
                        Some(code) => format!("refused {code:?}"),
                        None => "none".into(),
                    }
                }
                _ => format!("error unknown command: {line}"),
            })
        })();
        let text = match reply {
            Ok(s) if s == "quit" => break,
            Ok(s) if s.is_empty() => continue,
            Ok(s) => s,
            Err(e) => format!("error {e}"),
        };
        writeln!(out, "{text}").map_err(|e| VerbsError::Config(format!("stdout: {e}")))?;
        out.flush().map_err(|e| VerbsError::Config(format!("stdout: {e}")))?;
    }
    Ok(())
}
