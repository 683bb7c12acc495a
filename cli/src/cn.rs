//! What `omw cn` does over omw-verbs' `CnClient`: the subcommands (allocate, round trip, load,
//! bench) and a line-based script mode that the multi-process tests (backend-verbs/tests, kv's
//! rxe_kv) and operators drive interactively. Tooling, so it lives with the binary, not the backend.
//!
//! With K alloc chains (`--alloc-chains`), `alloc`, `load` and `bench` keep up to K allocation
//! requests in flight ([`Pipeline`]: a request on every idle chain before waiting for the oldest
//! answer); `roundtrip` stays one allocation at a time. The pipeline runs on any [`CnOps`], so
//! its tests drive it on the loopback model without a device.

use omw_core::ids::Rkey;
use omw_verbs::cn::{Allocation, CnClient, CnOptions};
use omw_verbs::error::{Result, VerbsError};
use std::collections::VecDeque;
use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// What `omw cn`'s allocating subcommands need of a CN: the blocking calls, and an allocation in
/// two halves (request, answer) so several requests can be in flight, one per alloc chain.
/// `CnClient` over verbs; the loopback model's CN in the tests.
pub trait CnOps {
    type Error;
    /// Alloc chains the CN opened: how many requests may be in flight at once.
    fn alloc_chains(&self) -> usize;
    /// Requests sent and not yet answered.
    fn allocs_in_flight(&self) -> usize;
    /// Access QPs (windows MW[1..G)).
    fn access_windows(&self) -> usize;
    /// Send a request on an idle chain; its token.
    fn alloc_begin(&mut self) -> std::result::Result<u32, Self::Error>;
    /// The first answer to any of the requests `tokens` (waiting up to the CN's timeout): its
    /// token and the allocation or why it failed — allocations before refusals.
    #[allow(clippy::type_complexity)]
    fn alloc_finish_any(
        &mut self,
        tokens: &[u32],
    ) -> std::result::Result<(u32, std::result::Result<Allocation, Self::Error>), Self::Error>;
    /// Allocate, waiting through "empty" for "available" and for a send slot (needs an idle
    /// chain).
    fn alloc(&mut self) -> std::result::Result<Allocation, Self::Error>;
    /// Whether `e` says the MN's pool is empty (answered "empty", or backing off after it).
    fn pool_empty(e: &Self::Error) -> bool;
    /// Whether `e` says every send slot holds a request the MN has not taken yet (frees sent
    /// faster than it serves them): a request can go out later.
    fn slots_busy(e: &Self::Error) -> bool;
    /// Whether `e` is an answer that allocated nothing and may be asked again: `AllocFailed`
    /// (the MN stopped the lap — e.g. it raced a push on an empty queue — and undid it), or
    /// `QuotaExceeded` while this CN's own requests in flight count against its quota (they
    /// do on a host-engine MN) — the chunk the caller frees next makes room.
    fn allocated_nothing(e: &Self::Error) -> bool;
    fn write(
        &mut self,
        a: &Allocation,
        window: usize,
        offset: u64,
        data: &[u8],
    ) -> std::result::Result<(), Self::Error>;
    fn read(
        &mut self,
        a: &Allocation,
        window: usize,
        offset: u64,
        len: usize,
    ) -> std::result::Result<Vec<u8>, Self::Error>;
    fn free(&mut self, a: &Allocation) -> std::result::Result<(), Self::Error>;
}

impl CnOps for CnClient {
    type Error = VerbsError;
    fn alloc_chains(&self) -> usize {
        CnClient::alloc_chains(self)
    }
    fn allocs_in_flight(&self) -> usize {
        CnClient::allocs_in_flight(self)
    }
    fn access_windows(&self) -> usize {
        self.access_qps().len()
    }
    fn alloc_begin(&mut self) -> Result<u32> {
        CnClient::alloc_begin(self)
    }
    fn alloc_finish_any(&mut self, tokens: &[u32]) -> Result<(u32, Result<Allocation>)> {
        CnClient::alloc_finish_any(self, tokens)
    }
    fn alloc(&mut self) -> Result<Allocation> {
        CnClient::alloc(self)
    }
    fn pool_empty(e: &VerbsError) -> bool {
        matches!(e, VerbsError::PoolEmpty)
    }
    fn slots_busy(e: &VerbsError) -> bool {
        matches!(e, VerbsError::TooManyInFlight { .. })
    }
    fn allocated_nothing(e: &VerbsError) -> bool {
        matches!(e, VerbsError::QuotaExceeded | VerbsError::Refused(omw_core::wire::message::ErrorCode::AllocFailed))
    }
    fn write(&mut self, a: &Allocation, window: usize, offset: u64, data: &[u8]) -> Result<()> {
        CnClient::write(self, a, window, offset, data)
    }
    fn read(&mut self, a: &Allocation, window: usize, offset: u64, len: usize) -> Result<Vec<u8>> {
        CnClient::read(self, a, window, offset, len)
    }
    fn free(&mut self, a: &Allocation) -> Result<()> {
        CnClient::free(self, a).map(|_| ())
    }
}

/// `total` allocations with up to `window` requests in flight (at most the CN's alloc chains):
/// every idle chain gets a request before an answer is waited for, and again as soon as one
/// came, so the chains re-arm while the caller uses the chunk. Whichever request is answered
/// first is handed out (a chunk the CN was sent is never left unread while it waits on a
/// request the MN parked for want of one). A pool found empty or every send slot taken stops
/// the topping up; a request
/// refused "empty" is asked again once the pool refills, one answered `AllocFailed` or
/// `QuotaExceeded` ([`CnOps::allocated_nothing`]) at once — up to [`Pipeline::RETRIES`]
/// answers in a row; with nothing in flight the next allocation waits for "available".
#[derive(Debug)]
pub struct Pipeline {
    window: usize,
    total: u64,
    /// Allocations handed out.
    served: u64,
    /// Requests in flight, in the order sent, with when each was sent.
    pending: VecDeque<(u32, Instant)>,
    /// Most of the CN's requests seen in flight at once.
    pub peak: usize,
    /// Answers that allocated nothing and were asked again.
    pub asked_again: u64,
}

impl Pipeline {
    /// Answers in a row that allocated nothing before the run gives up with the last.
    pub const RETRIES: u32 = 64;

    pub fn new(c: &impl CnOps, window: usize, total: u64) -> Pipeline {
        Pipeline {
            window: window.clamp(1, c.alloc_chains().max(1)),
            total,
            served: 0,
            pending: VecDeque::new(),
            peak: 0,
            asked_again: 0,
        }
    }

    fn top_up<C: CnOps>(&mut self, c: &mut C) -> std::result::Result<(), C::Error> {
        while self.pending.len() < self.window && self.served + (self.pending.len() as u64) < self.total {
            match c.alloc_begin() {
                Ok(t) => self.pending.push_back((t, Instant::now())),
                // no chunk now, or no send slot now: what is in flight goes on, the next
                // allocation with nothing in flight waits (`CnOps::alloc`)
                Err(e) if C::pool_empty(&e) || C::slots_busy(&e) => break,
                Err(e) => return Err(e),
            }
            self.peak = self.peak.max(c.allocs_in_flight());
        }
        Ok(())
    }

    /// The next allocation and how long its request took to be answered; `None` once `total`
    /// were handed out.
    pub fn next<C: CnOps>(&mut self, c: &mut C) -> std::result::Result<Option<(Allocation, Duration)>, C::Error> {
        if self.served >= self.total {
            return Ok(None);
        }
        let mut retries = 0;
        let got = loop {
            self.top_up(c)?;
            if self.pending.is_empty() {
                // the pool is empty and nothing is in flight: wait through it for "available"
                let t = Instant::now();
                let a = c.alloc()?;
                self.peak = self.peak.max(1);
                break (a, t.elapsed());
            }
            let tokens: Vec<u32> = self.pending.iter().map(|(t, _)| *t).collect();
            let (t, r) = c.alloc_finish_any(&tokens)?;
            let at = match self.pending.iter().position(|(p, _)| *p == t) {
                Some(i) => self.pending.remove(i).map_or_else(Instant::now, |(_, at)| at),
                None => Instant::now(),
            };
            match r {
                Ok(a) => break (a, at.elapsed()),
                // refused "empty" (its chain is idle again: asked again once the pool refills) or
                // undone by the MN: ask again
                Err(e) if (C::pool_empty(&e) || C::allocated_nothing(&e)) && retries < Self::RETRIES => {
                    retries += 1;
                    self.asked_again += 1;
                }
                Err(e) => return Err(e),
            }
        };
        self.served += 1;
        // the answered chain is idle: its next request goes out before the caller uses this one
        self.top_up(c)?;
        Ok(Some(got))
    }
}

/// What a pipelined run can fail with: the CN's own error, or bytes read back that differ from
/// what was written.
#[derive(Debug)]
pub enum RunError<E> {
    Cn(E),
    ReadBack { cycle: u64, window: usize },
}

impl<E> From<E> for RunError<E> {
    fn from(e: E) -> Self {
        RunError::Cn(e)
    }
}

impl From<RunError<VerbsError>> for VerbsError {
    fn from(e: RunError<VerbsError>) -> Self {
        match e {
            RunError::Cn(e) => e,
            RunError::ReadBack { cycle, window } => {
                VerbsError::Protocol(format!("cycle {cycle}: read back differs through access QP {window}"))
            }
        }
    }
}

/// What `omw cn load` measured.
#[derive(Debug)]
pub struct LoadReport {
    pub elapsed: Duration,
    /// Request-to-answer time of each allocation, sorted.
    pub latencies: Vec<Duration>,
    /// Most allocation requests in flight at once.
    pub peak_in_flight: usize,
    /// Requests answered without a chunk and asked again ([`Pipeline::asked_again`]).
    pub asked_again: u64,
}

/// `ops` cycles of alloc → write → read → verify → free, up to one allocation request in flight
/// per alloc chain.
pub fn load<C: CnOps>(c: &mut C, ops: u32, bytes: usize) -> std::result::Result<LoadReport, RunError<C::Error>> {
    let t0 = Instant::now();
    let mut p = Pipeline::new(c, c.alloc_chains(), ops as u64);
    let mut lat = Vec::with_capacity(ops as usize);
    let mut i = 0u64;
    while let Some((a, l)) = p.next(c)? {
        lat.push(l);
        let n = bytes.min(a.length as usize);
        let data = pattern(i, n);
        let w = i as usize % c.access_windows().max(1);
        c.write(&a, w, 0, &data)?;
        if c.read(&a, w, 0, n)? != data {
            return Err(RunError::ReadBack { cycle: i, window: w });
        }
        c.free(&a)?;
        i += 1;
    }
    lat.sort();
    Ok(LoadReport { elapsed: t0.elapsed(), latencies: lat, peak_in_flight: p.peak, asked_again: p.asked_again })
}

/// Allocation throughput of one CN: `cycles` allocations, each freed as soon as it came, with up
/// to `window` requests in flight. Returns the wall-clock time and the most in flight seen.
pub fn throughput<C: CnOps>(c: &mut C, cycles: u32, window: usize) -> std::result::Result<(Duration, usize), C::Error> {
    let t0 = Instant::now();
    let mut p = Pipeline::new(c, window, cycles as u64);
    while let Some((a, _)) = p.next(c)? {
        c.free(&a)?;
    }
    Ok((t0.elapsed(), p.peak))
}

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
        "omw cn: connected as {} (chunk {} B, group size {}, {} access QPs, quota {}, {} alloc chain{})",
        c.cn,
        c.info.chunk_size,
        c.info.group_size,
        c.access_qps().len(),
        c.info.quota,
        c.alloc_chains(),
        if c.alloc_chains() == 1 { "" } else { "s" }
    );
    match cmd {
        CnCommand::Alloc { count } => {
            let mut v = Vec::new();
            let mut p = Pipeline::new(&c, c.alloc_chains(), count as u64);
            while let Some((a, _)) = p.next(&mut c)? {
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
            let r = load(&mut c, ops, bytes)?;
            let dt = r.elapsed;
            let lat = &r.latencies;
            let p = |q: f64| lat.get(((lat.len() as f64 - 1.0) * q) as usize).copied().unwrap_or_default();
            println!(
                "load: {ops} alloc/write/read/free cycles in {:.3} s ({:.0} cycles/s); alloc latency p50 {:?} p99 {:?}; up to {} allocations in flight ({} alloc chains)",
                dt.as_secs_f64(),
                ops as f64 / dt.as_secs_f64(),
                p(0.5),
                p(0.99),
                r.peak_in_flight,
                c.alloc_chains()
            );
            if r.asked_again > 0 {
                println!("load: {} requests answered without a chunk were asked again", r.asked_again);
            }
        }
        CnCommand::Bench { iters } => {
            bench(&mut c, iters)?;
            let k = c.alloc_chains();
            let cycles = iters.max(1);
            // the CN's throughput with 1..=K requests in flight on its K chains
            let mut rows = Vec::new();
            for w in 1..=k {
                rows.push(throughput(&mut c, cycles, w)?);
            }
            // the baseline: a CN of one alloc chain, in this same run (this CN leaves first, so
            // an MN with room for one CN admits it)
            let base = if k == 1 {
                Ok(rows[0])
            } else {
                drop(c);
                let one = CnClient::connect(addr, &CnOptions { alloc_chains: 1, ..opts.clone() });
                one.and_then(|mut one| {
                    // warmed up as the measured CN was by the latency runs
                    throughput(&mut one, 3, 1)?;
                    throughput(&mut one, cycles, 1)
                })
            };
            print_throughput(cycles, k, base.as_ref().map(|b| b.0), &rows);
        }
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

/// `omw cn bench`'s throughput table: allocations per second (each freed at once) against the
/// number in flight, each as a ratio to a CN of one alloc chain measured in the same run (with
/// K = 1 that CN is this one). Without the baseline (it could not connect), the ratios are to
/// this CN with one request in flight, and the table says so.
fn print_throughput(
    cycles: u32,
    k: usize,
    base: std::result::Result<Duration, &VerbsError>,
    rows: &[(Duration, usize)],
) {
    let rate = |d: Duration| cycles as f64 / d.as_secs_f64().max(1e-12);
    println!(
        "throughput per CN ({cycles} alloc + free cycles per row, allocations/s, ratio to a CN of one alloc chain):"
    );
    let b = match base {
        Ok(d) => {
            println!("  1 alloc chain (baseline, this run)             : {:10.0}   1.00x", rate(d));
            rate(d)
        }
        Err(e) => {
            println!("  1 alloc chain: the baseline CN could not connect ({e}); ratios are to 1 in flight below");
            rate(rows[0].0)
        }
    };
    if k == 1 {
        return;
    }
    for (w, (d, peak)) in rows.iter().enumerate() {
        let r = rate(*d);
        println!("  {k} alloc chains, up to {} in flight (seen {peak})  : {r:10.0}   {:.2}x", w + 1, r / b);
    }
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

#[cfg(test)]
mod tests {
    //! The pipeline of `omw cn alloc|load|bench` on the loopback model (no device): with K alloc
    //! chains K requests are in flight at once, nothing is lost, a small pool is waited through.
    //! Nothing is timed.
    use super::*;
    use omw_core::cn::driver::CnError;
    use omw_core::cn::ClientError;
    use omw_core::device::{ExecutionMode, WcStatus};
    use omw_core::wire::message::ErrorCode;
    use omw_core::wire::wqe::QueueSel;
    use omw_loopback::cluster::{Cluster, ClusterConfig, CnOpError};
    use omw_loopback::QpAddr;
    use std::result::Result;

    /// CN 0 of a loopback cluster, driven as `omw cn` drives a `CnClient`.
    struct ModelCn {
        c: Cluster,
        /// Answers taken from the cluster and not yet handed out.
        answers: Vec<(u32, Result<Allocation, CnOpError>)>,
    }

    impl CnOps for ModelCn {
        type Error = CnOpError;
        fn alloc_chains(&self) -> usize {
            self.c.cns[0].driver.alloc_chains()
        }
        fn allocs_in_flight(&self) -> usize {
            self.c.cns[0].driver.client().pending_count()
        }
        fn access_windows(&self) -> usize {
            self.c.cns[0].access_qps.len()
        }
        fn alloc_begin(&mut self) -> Result<u32, CnOpError> {
            self.c.alloc_begin(0)
        }
        /// As `CnClient::alloc_finish_any`: the cluster runs, modelled time passing while a
        /// request stays unanswered (a chain the MN parked for want of a group), a bounded
        /// number of back-off periods.
        fn alloc_finish_any(&mut self, tokens: &[u32]) -> Result<(u32, Result<Allocation, CnOpError>), CnOpError> {
            let cluster = |e| CnOpError::Cluster(std::rc::Rc::new(e));
            for _ in 0..1000 {
                self.c.pump().map_err(cluster)?;
                for &t in tokens {
                    if let Some(r) = self.c.alloc_poll(0, t) {
                        self.answers.push((t, r));
                    }
                }
                // an allocation before a refusal
                let mine = |t: &u32| tokens.contains(t);
                let at = self.answers.iter().position(|(t, r)| mine(t) && r.is_ok());
                if let Some(i) = at.or_else(|| self.answers.iter().position(|(t, _)| mine(t))) {
                    return Ok(self.answers.remove(i));
                }
                if !tokens.iter().any(|t| self.c.cns[0].driver.client().is_pending(*t)) {
                    return Err(CnOpError::NoReply);
                }
                self.c.advance(100_000).map_err(cluster)?;
            }
            Err(CnOpError::NoReply)
        }
        /// As `CnClient::alloc`: through "empty" until "available" (here: modelled time passes
        /// while the pool is empty, a bounded number of back-off periods).
        fn alloc(&mut self) -> Result<Allocation, CnOpError> {
            for _ in 0..1000 {
                match self.c.alloc(0) {
                    Err(e) if Self::pool_empty(&e) => {
                        self.c.advance(100_000).map_err(|e| CnOpError::Cluster(std::rc::Rc::new(e)))?
                    }
                    r => return r,
                }
            }
            Err(CnOpError::Mn(ErrorCode::Empty))
        }
        fn pool_empty(e: &CnOpError) -> bool {
            matches!(
                e,
                CnOpError::Mn(ErrorCode::Empty)
                    | CnOpError::Client(ClientError::Backoff { .. })
                    | CnOpError::Cn(CnError::Client(ClientError::Backoff { .. }))
            )
        }
        fn slots_busy(e: &CnOpError) -> bool {
            matches!(e, CnOpError::Cn(CnError::SlotsBusy))
        }
        fn allocated_nothing(e: &CnOpError) -> bool {
            matches!(e, CnOpError::Mn(ErrorCode::AllocFailed | ErrorCode::QuotaExceeded))
        }
        fn write(&mut self, a: &Allocation, window: usize, offset: u64, data: &[u8]) -> Result<(), CnOpError> {
            match self.c.write(0, a, window, offset, data) {
                WcStatus::Success => Ok(()),
                s => Err(CnOpError::Device(s)),
            }
        }
        fn read(&mut self, a: &Allocation, window: usize, offset: u64, len: usize) -> Result<Vec<u8>, CnOpError> {
            match self.c.read(0, a, window, offset, len) {
                (WcStatus::Success, v) => Ok(v),
                (s, _) => Err(CnOpError::Device(s)),
            }
        }
        fn free(&mut self, a: &Allocation) -> Result<(), CnOpError> {
            self.c.free(0, a)
        }
    }

    const MODES: [ExecutionMode; 2] = [ExecutionMode::Offloaded, ExecutionMode::HostEngine];

    fn cn(mode: ExecutionMode, chains: u8, chunks: u32) -> ModelCn {
        let mut cfg = ClusterConfig::paper_like();
        cfg.mode = Some(mode);
        cfg.cns = 1;
        cfg.chunks = chunks;
        cfg.quota = 0;
        cfg.alloc_chains = chains;
        ModelCn { c: Cluster::new(cfg).unwrap(), answers: Vec::new() }
    }

    /// Requests the MN took on each of CN 0's alloc chains.
    fn requests_per_chain(c: &Cluster) -> Vec<u64> {
        let r = c.driver.mn.cn(c.cns[0].id).unwrap();
        let f = c.fabric.borrow();
        r.alloc_chains().map(|(_, q, _)| f.cq_count(QpAddr::new(c.mn_host, q), QueueSel::Recv).unwrap()).collect()
    }

    fn whole(m: &mut ModelCn, chunks: u32) {
        m.c.pump().unwrap();
        assert_eq!(m.c.unallocated(), chunks, "every chunk back at the MN");
        m.c.check_invariants().unwrap();
    }

    #[test]
    fn load_keeps_a_request_in_flight_on_every_chain() {
        for mode in MODES {
            for k in 1..=3u8 {
                let mut m = cn(mode, k, 32);
                let r = load(&mut m, 40, 256).unwrap();
                assert_eq!(r.peak_in_flight, k as usize, "{mode:?}, {k} chains");
                assert_eq!(r.latencies.len(), 40);
                assert_eq!(r.asked_again, 0, "{mode:?}: a pool larger than the chains refuses nothing");
                whole(&mut m, 32);
                let per_chain = requests_per_chain(&m.c);
                assert_eq!(per_chain.len(), k as usize);
                assert!(per_chain.iter().all(|n| *n > 0), "{mode:?}: every chain served: {per_chain:?}");
                assert_eq!(per_chain.iter().sum::<u64>(), 40, "{mode:?}: a request per allocation, no more");
            }
        }
    }

    #[test]
    fn throughput_keeps_up_to_its_window_in_flight() {
        for mode in MODES {
            let mut m = cn(mode, 2, 32);
            for (window, seen) in [(1, 1), (2, 2), (4, 2)] {
                let (_, peak) = throughput(&mut m, 30, window).unwrap();
                assert_eq!(peak, seen, "{mode:?}: window {window}");
                whole(&mut m, 32);
            }
        }
    }

    /// A pool smaller than the chains (and the CN's quota, the whole pool, smaller than what it
    /// asks at once): requests answered "empty", `AllocFailed` or `QuotaExceeded` are asked
    /// again, every allocation of the run is served and checked, nothing is lost.
    #[test]
    fn a_pool_smaller_than_the_chains_is_waited_through() {
        for mode in MODES {
            let mut m = cn(mode, 3, 2);
            let r = load(&mut m, 25, 64).unwrap_or_else(|e| panic!("{mode:?}: {e:?}"));
            assert_eq!(r.latencies.len(), 25, "{mode:?}");
            assert!(r.asked_again > 0, "{mode:?}: the run met refusals and asked again");
            whole(&mut m, 2);
        }
    }

    /// `omw cn alloc N`'s pipeline hands out N distinct chunks, holding them all.
    #[test]
    fn alloc_n_hands_out_distinct_chunks() {
        for mode in MODES {
            let mut m = cn(mode, 2, 16);
            let mut p = Pipeline::new(&m, m.alloc_chains(), 10);
            let mut held = Vec::new();
            while let Some((a, _)) = p.next(&mut m).unwrap() {
                held.push(a);
            }
            assert_eq!(p.peak, 2, "{mode:?}");
            let mut entries: Vec<u64> = held.iter().map(|a| a.entry_addr).collect();
            entries.sort();
            entries.dedup();
            assert_eq!(entries.len(), 10, "{mode:?}");
            for a in &held {
                m.free(a).unwrap();
            }
            whole(&mut m, 16);
        }
    }
}
