//! `omw demo`: OneSidedMW end to end on the loopback RNIC model.
//!
//! One MN and N CNs (default six). The honest CNs run a short key-value workload on chunks
//! they allocate from the MN (write objects through both access QPs, read them back, free
//! half, reallocate); one CN is malicious and tries what a tenant should never manage: use
//! another CN's rkey, reach outside its own window, free someone else's chunk, walk all 256
//! keys of a window, use a key after freeing, and send garbage to the MN's chains. Then a CN
//! crashes and the MN reclaims its chunks. After every phase the protocol's invariants are
//! checked; the command exits 0 only if every check passed.

use clap::{Args, ValueEnum};
use omw_bench::Rng;
use omw_core::chain::ChainKind;
use omw_core::cn::Allocation;
use omw_core::device::{ExecutionMode, WcStatus};
use omw_core::ids::Rkey;
use omw_core::wire::message::ErrorCode;
use omw_core::wire::wqe::Wqe;
use omw_loopback::cluster::{Cluster, ClusterConfig, CnOpError, CnQp};
use omw_loopback::NicConfig;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Chains run inside the (modelled) RNIC; the MN CPU is off the allocation path.
    Offloaded,
    /// The MN CPU runs the same chain layout (portable mode, RPC-MW type-2).
    HostEngine,
}

#[derive(Args, Debug, Clone)]
pub struct DemoArgs {
    /// Execution mode of the MN.
    #[arg(long, value_enum, default_value_t = ModeArg::Offloaded)]
    pub mode: ModeArg,
    /// Number of compute nodes (3..=32); the last one is malicious.
    #[arg(long, default_value_t = 6)]
    pub cns: usize,
    /// Seed of the workload (keys, values, which objects are freed).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print every check, not only the summary.
    #[arg(long, short)]
    pub verbose: bool,
    /// Run a pool of this many MNs (3..=8) instead of one MN: placement spread over them, one
    /// draining and one vanishing mid-run (the in-process registry; `--cns` CNs, 2..=16).
    #[arg(long, default_value_t = 1)]
    pub mns: usize,
}

/// What the demo saw; `failures` must stay empty.
#[derive(Debug, Default)]
pub struct DemoReport {
    pub mode: Option<ExecutionMode>,
    pub cns: usize,
    pub allocations: u64,
    pub frees: u64,
    pub bytes_written: u64,
    pub verified_reads: u64,
    pub reclaimed_bytes: u64,
    pub crash_reclaimed_bytes: u64,
    pub attacks: Vec<(String, bool)>,
    pub checks: u64,
    pub failures: Vec<String>,
    pub mn_cpu_events: u64,
    pub mn_wqes: u64,
    pub modelled_ns: u64,
    pub log: Vec<String>,
}

impl DemoReport {
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        self.checks += 1;
        if !ok {
            self.failures.push(what());
        }
    }
    fn attack(&mut self, what: &str, denied: bool) {
        self.checks += 1;
        self.attacks.push((what.to_string(), denied));
        if !denied {
            self.failures.push(format!("attack NOT denied: {what}"));
        }
    }
    fn invariants(&mut self, c: &mut Cluster, phase: &str) {
        self.checks += 1;
        match c.check_invariants() {
            Ok(()) => self.log.push(format!("invariants hold after {phase}")),
            Err(e) => self.failures.push(format!("invariants broken after {phase}: {e}")),
        }
    }
    pub fn passed(&self) -> bool {
        self.failures.is_empty() && self.checks > 0
    }
}

fn value_for(key: u64, version: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(key ^ (version << 40) ^ 0xD3E0);
    let mut v = format!("key {key:016x} v{version} ").into_bytes();
    while v.len() < len {
        v.push(b'a' + r.below(26) as u8);
    }
    v.truncate(len);
    v
}

struct Obj {
    cn: usize,
    alloc: usize,
    offset: u64,
    key: u64,
    version: u64,
    len: usize,
}

/// Run the demo; `Err` only for a setup failure of the model itself.
pub fn run_demo(args: &DemoArgs) -> Result<DemoReport, String> {
    let cns = args.cns.clamp(3, omw_core::mn::MAX_CNS);
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = cns;
    cfg.chunks = (cns as u32 * 8).max(32);
    cfg.quota = 16;
    cfg.mode = Some(match args.mode {
        ModeArg::Offloaded => ExecutionMode::Offloaded,
        ModeArg::HostEngine => ExecutionMode::HostEngine,
    });
    if args.mode == ModeArg::HostEngine {
        cfg.nic = NicConfig::strict().with_offload(false).with_prefetch(8);
    }
    // rings of every CN's chains live in the MN's ring arena
    cfg.nic.ring_arena_bytes = cfg.nic.ring_arena_bytes.max((cns as u64 + 2) * (64 << 10));
    let chunk = cfg.chunk_size;
    let mut c = Cluster::new(cfg).map_err(|e| format!("building the modelled cluster: {e}"))?;
    let mut rep = DemoReport { mode: Some(c.mode), cns, ..Default::default() };
    let mut rng = Rng::new(args.seed);
    let honest = cns - 1;
    let evil = cns - 1;
    let total_groups = c.unallocated();
    rep.invariants(&mut c, "start-up");

    // ---- phase 1: every honest CN allocates a few chunks
    let mut held: Vec<Vec<Option<Allocation>>> = vec![Vec::new(); cns];
    for (i, h) in held.iter_mut().enumerate().take(honest) {
        for _ in 0..3 {
            match c.alloc(i) {
                Ok(a) => {
                    rep.allocations += 1;
                    rep.check(a.length == chunk, || format!("cn{i}: chunk of {} bytes", a.length));
                    h.push(Some(a));
                }
                Err(e) => rep.failures.push(format!("cn{i} alloc: {e}")),
            }
        }
    }
    rep.invariants(&mut c, "allocation");
    rep.log.push(format!("{} chunks allocated by {honest} honest CNs", rep.allocations));

    // ---- phase 2: a small KV store: objects carved from the chunks, written, read back
    let mut objs: Vec<Obj> = Vec::new();
    for (i, h) in held.iter().enumerate().take(honest) {
        for (ai, a) in h.iter().enumerate() {
            let Some(_) = a else { continue };
            let mut off = 0u64;
            while off + 256 <= chunk {
                let len = 64 + rng.below(160) as usize; // the last 32 B of each chunk stay free
                objs.push(Obj { cn: i, alloc: ai, offset: off, key: rng.next_u64(), version: 0, len });
                off += 256;
            }
        }
    }
    for o in &objs {
        let a = held[o.cn][o.alloc].as_ref().expect("live");
        let v = value_for(o.key, o.version, o.len);
        let q = (o.key % 2) as usize; // latency-critical or background access QP
        let st = c.write(o.cn, a, q, o.offset, &v);
        rep.bytes_written += v.len() as u64;
        rep.check(st == WcStatus::Success, || format!("cn{} write key {:x}: {st:?}", o.cn, o.key));
    }
    // updates of a third of the objects (in place, new version)
    for o in objs.iter_mut() {
        if rng.below(3) == 0 {
            o.version += 1;
            let a = held[o.cn][o.alloc].as_ref().expect("live");
            let v = value_for(o.key, o.version, o.len);
            let st = c.write(o.cn, a, 1, o.offset, &v);
            rep.bytes_written += v.len() as u64;
            rep.check(st == WcStatus::Success, || format!("cn{} update key {:x}: {st:?}", o.cn, o.key));
        }
    }
    for o in &objs {
        let a = held[o.cn][o.alloc].as_ref().expect("live");
        let (st, got) = c.read(o.cn, a, (o.key as usize + 1) % 2, o.offset, o.len);
        let ok = st == WcStatus::Success && got == value_for(o.key, o.version, o.len);
        rep.verified_reads += ok as u64;
        rep.check(ok, || format!("cn{} read key {:x}: {st:?}, data matches: {}", o.cn, o.key, ok));
    }
    rep.invariants(&mut c, "KV writes, updates and verified reads");
    rep.log.push(format!(
        "{} objects written ({} B), {} reads verified",
        objs.len(),
        rep.bytes_written,
        rep.verified_reads
    ));

    // ---- phase 3: the malicious CN
    let victim = 0usize;
    let va = held[victim][0].clone().expect("victim chunk");
    let secret = value_for(0x5EC, 0, 32);
    rep.check(c.write(victim, &va, 0, chunk - 32, &secret) == WcStatus::Success, || "victim write".into());
    let own = match c.alloc(evil) {
        Ok(a) => {
            rep.allocations += 1;
            a
        }
        Err(e) => return Err(format!("malicious CN could not even allocate: {e}")),
    };
    for q in 0..2 {
        let rk = va.rkey(q).unwrap_or_default();
        let st = c.read_raw(evil, q, va.base, rk, 64).0;
        rep.attack(
            &format!("read cn{victim}'s chunk with cn{victim}'s rkey via own access QP {q}"),
            st != WcStatus::Success,
        );
        let st = c.write_raw(evil, q, va.base, rk, b"pwned");
        rep.attack(
            &format!("write cn{victim}'s chunk with cn{victim}'s rkey via own access QP {q}"),
            st != WcStatus::Success,
        );
    }
    let st = c.write_raw(evil, 0, va.base, own.rkey(0).unwrap_or_default(), b"pwned");
    rep.attack("write cn0's chunk with its own rkey (address outside its window)", st != WcStatus::Success);
    let st = c.read_raw(evil, 0, own.base + own.length, own.rkey(0).unwrap_or_default(), 8).0;
    rep.attack("read just past the end of its own window", st != WcStatus::Success);
    let r = c.free_raw(evil, va.entry_addr);
    rep.attack(
        "free cn0's chunk (forged free request naming cn0's MWTable entry)",
        r == Err(CnOpError::Mn(ErrorCode::NotOwner)) || r.is_err(),
    );
    let r = c.free_raw(evil, va.entry_addr + 4);
    rep.attack("free with a misaligned MWTable address", r.is_err());
    let idx = va.rkey(0).unwrap_or_default().index();
    let mut granted = 0;
    for key in 0..=255u8 {
        let rk = Rkey::new(idx, key).unwrap_or_default();
        if c.read_raw(evil, 0, va.base, rk, 8).0 == WcStatus::Success {
            granted += 1;
        }
    }
    rep.attack("walk all 256 keys of cn0's window index", granted == 0);
    // use-after-free: its own chunk, freed, then accessed with the old key
    let old = own.clone();
    match c.free(evil, &own) {
        Ok(()) => rep.frees += 1,
        Err(e) => rep.failures.push(format!("malicious CN's own free: {e}")),
    }
    let st = c.read_raw(evil, 0, old.base, old.rkey(0).unwrap_or_default(), 8).0;
    rep.attack("read its own chunk with the stale rkey after freeing it", st != WcStatus::Success);
    for (kind, bytes) in [
        (ChainKind::Alloc, vec![0xFFu8; 28]),
        (ChainKind::Alloc, (0..40u32).map(|i| (i * 37 + args.seed as u32) as u8).collect::<Vec<u8>>()),
        (ChainKind::Free, vec![0xAB; 16]),
    ] {
        let before = c.unallocated();
        let _ = c.send_raw(evil, kind, &bytes);
        let same = c.unallocated() == before;
        rep.attack(&format!("garbage {kind:?} request ({} bytes): no chunk gained or lost", bytes.len()), same);
        rep.invariants(&mut c, &format!("garbage {kind:?} request"));
    }
    // MN-private memory: every MR the MN registered, with its exact key (stronger than any
    // guess), through the CN's own access and Alloc QPs
    let mn_mrs = c.fabric.borrow().mrs_of(c.mn_host).map_err(|e| format!("MN MRs: {e}"))?;
    let mut reached = 0;
    for mr in &mn_mrs {
        for qp in [CnQp::Access(0), CnQp::Alloc] {
            for w in [Wqe::read(0, 0, 8, mr.addr, mr.key), Wqe::write(0, 0, 8, mr.addr, mr.key)] {
                if c.cn_post(evil, qp, w) == WcStatus::Success {
                    reached += 1;
                }
            }
        }
    }
    rep.attack(
        &format!("read/write the MN's tables, scratch and rings with each of its {} MR keys", mn_mrs.len()),
        reached == 0,
    );
    let keys: Vec<u32> = mn_mrs.iter().map(|m| m.key).collect();
    let leaked = c.cns[evil]
        .received
        .iter()
        .filter_map(|b| omw_core::wire::message::AllocReply::decode(b).ok())
        .any(|r| r.entry.lkey.get() != 0 || keys.contains(&r.entry.lkey.get()));
    rep.attack("learn an MN key from its alloc replies", !leaked);
    // residue: what it wrote before freeing is gone from the chunk
    let residue = {
        let mut b = vec![0u8; old.length as usize];
        c.fabric.borrow().read(c.mn_host, old.base, &mut b).map_err(|e| format!("MN read: {e}"))?;
        b.iter().any(|x| *x != 0)
    };
    rep.attack("leave bytes for the next owner of its freed chunk", !residue);
    let (st, got) = c.read(victim, &va, 0, chunk - 32, 32);
    rep.check(st == WcStatus::Success && got == secret, || "cn0's data changed by the attacks".into());
    rep.invariants(&mut c, "the attacks");
    // it stops answering (posts no receives) and keeps asking: evicted; the others notice nothing
    c.stall_cn(evil);
    let mut others_ok = true;
    for round in 0..400 {
        if round >= 24 && !c.is_served(evil) {
            break;
        }
        if c.alloc_begin(evil).is_ok() {
            c.cns[evil].client_mut().abandon_pending();
        }
        let i = round % honest;
        match c.alloc(i) {
            Ok(a) => {
                others_ok &= c.free(i, &a).is_ok();
                rep.allocations += 1;
                rep.frees += 1;
            }
            Err(_) => others_ok = false,
        }
    }
    rep.attack(
        "stall the MN by never posting receives (evicted; every other CN's request succeeded)",
        !c.is_served(evil) && others_ok,
    );
    rep.invariants(&mut c, "the stalled CN's eviction");
    let denied = rep.attacks.iter().filter(|a| a.1).count();
    rep.log.push(format!("malicious cn{evil}: {denied}/{} attacks denied; cn0's data intact", rep.attacks.len()));

    // ---- phase 4: honest CNs free half their chunks; memory goes back to the MN
    let before = c.unallocated();
    for (i, h) in held.iter_mut().enumerate().take(honest) {
        for slot in h.iter_mut() {
            if rng.below(2) == 0 || i == 1 {
                if let Some(a) = slot.take() {
                    let st_before = c.read(i, &a, 0, 0, 8).0;
                    match c.free(i, &a) {
                        Ok(()) => rep.frees += 1,
                        Err(e) => rep.failures.push(format!("cn{i} free: {e}")),
                    }
                    let st = c.read(i, &a, 0, 0, 8).0;
                    rep.check(st_before == WcStatus::Success && st != WcStatus::Success, || {
                        format!("cn{i}: freed chunk still readable ({st:?})")
                    });
                }
            }
        }
    }
    let freed = c.unallocated().saturating_sub(before) as u64;
    rep.reclaimed_bytes = freed * chunk;
    rep.invariants(&mut c, "frees");
    // survivors still read their data
    for o in &objs {
        if let Some(a) = held[o.cn][o.alloc].as_ref() {
            let (st, got) = c.read(o.cn, a, 0, o.offset, o.len);
            rep.check(st == WcStatus::Success && got == value_for(o.key, o.version, o.len), || {
                format!("cn{} key {:x} lost after other frees", o.cn, o.key)
            });
        }
    }
    // reuse: freed chunks are allocatable again
    for (i, h) in held.iter_mut().enumerate().take(honest.min(3)) {
        match c.alloc(i) {
            Ok(a) => {
                rep.allocations += 1;
                let st = c.write(i, &a, 0, 0, b"reused");
                rep.check(st == WcStatus::Success, || format!("cn{i} write to a reused chunk: {st:?}"));
                h.push(Some(a));
            }
            Err(e) => rep.failures.push(format!("cn{i} re-alloc: {e}")),
        }
    }
    rep.invariants(&mut c, "reallocation");
    rep.log.push(format!("{freed} chunks freed back to the MN ({} KiB), then reused", rep.reclaimed_bytes / 1024));

    // ---- phase 5: a CN crashes holding chunks; the MN reclaims them (owner ids)
    let crasher = 2usize.min(honest - 1);
    let holding = held[crasher].iter().filter(|a| a.is_some()).count() as u64;
    let before = c.unallocated();
    c.crash_cn(crasher).map_err(|e| format!("crash: {e}"))?;
    c.tick().map_err(|e| format!("tick: {e}"))?;
    let back = c.unallocated().saturating_sub(before) as u64;
    rep.crash_reclaimed_bytes = back * chunk;
    rep.check(back == holding, || format!("crash of cn{crasher}: {back} of its {holding} chunks reclaimed"));
    held[crasher].clear();
    rep.invariants(&mut c, "the crash and reclaim");
    rep.log.push(format!("cn{crasher} crashed holding {holding} chunks; the MN reclaimed {back}"));

    // ---- phase 6: everyone frees everything; the pool is whole again
    for (i, h) in held.iter_mut().enumerate().take(honest) {
        for a in h.drain(..).flatten() {
            match c.free(i, &a) {
                Ok(()) => rep.frees += 1,
                Err(e) => rep.failures.push(format!("cn{i} final free: {e}")),
            }
        }
    }
    c.tick().map_err(|e| format!("tick: {e}"))?;
    let fg = c.unallocated();
    rep.check(fg == total_groups, || format!("pool not whole at the end: {fg} of {total_groups} groups free"));
    rep.invariants(&mut c, "the final frees");

    rep.mn_cpu_events = c.mn_cpu_events;
    let f = c.fabric.borrow();
    rep.mn_wqes = f.host_stats(c.mn_host).map(|s| s.wqes_executed).unwrap_or(0);
    rep.modelled_ns = f.now();
    Ok(rep)
}

pub fn summary(rep: &DemoReport, args: &DemoArgs, wall: std::time::Duration) -> String {
    let mut s = String::new();
    let mode = match rep.mode {
        Some(ExecutionMode::Offloaded) => "offloaded (alloc/free chains run inside the modelled RNIC)",
        Some(ExecutionMode::HostEngine) => "host engine (the MN CPU runs the chain layout: RPC-MW type-2)",
        _ => "unknown",
    };
    let _ = writeln!(s, "omw demo — OneSidedMW on the loopback RNIC model (modelled time, not wall clock)");
    let _ =
        writeln!(s, "  cluster         1 MN + {} CNs (cn{} is malicious), seed {}", rep.cns, rep.cns - 1, args.seed);
    let _ = writeln!(s, "  execution mode  {mode}");
    for l in rep.log.iter().filter(|l| args.verbose || !l.starts_with("invariants")) {
        let _ = writeln!(s, "  - {l}");
    }
    let _ = writeln!(s, "  allocations     {}   frees {}", rep.allocations, rep.frees);
    let _ = writeln!(
        s,
        "  reclaimed       {} KiB by frees, {} KiB from the crashed CN",
        rep.reclaimed_bytes / 1024,
        rep.crash_reclaimed_bytes / 1024
    );
    let _ = writeln!(s, "  attacks by the malicious CN:");
    for (a, denied) in &rep.attacks {
        let _ = writeln!(s, "    [{}] {a}", if *denied { "denied" } else { "ALLOWED" });
    }
    let _ = writeln!(
        s,
        "  MN CPU events   {} ({}); MN NIC executed {} WQEs",
        rep.mn_cpu_events,
        if rep.mode == Some(ExecutionMode::Offloaded) {
            "exceptions only: forged frees, garbage requests, the crash"
        } else {
            "one per request"
        },
        rep.mn_wqes
    );
    let _ = writeln!(
        s,
        "  modelled time   {:.1} µs   wall clock {:.2} s",
        rep.modelled_ns as f64 / 1000.0,
        wall.as_secs_f64()
    );
    if rep.failures.is_empty() {
        let _ = writeln!(
            s,
            "PASS: {} checks passed (verified reads, invariants after every phase, every attack denied)",
            rep.checks
        );
    } else {
        let _ = writeln!(s, "FAIL: {} of {} checks failed:", rep.failures.len(), rep.checks);
        for f in &rep.failures {
            let _ = writeln!(s, "  ✗ {f}");
        }
    }
    s
}

pub fn demo(args: DemoArgs) -> ExitCode {
    let t = Instant::now();
    if args.mns > 1 {
        let mode = match args.mode {
            ModeArg::Offloaded => ExecutionMode::Offloaded,
            ModeArg::HostEngine => ExecutionMode::HostEngine,
        };
        return match crate::pool_demo::run(args.mns, args.cns, mode, args.seed) {
            Ok(rep) => {
                print!("{}", rep.out);
                for f in &rep.failures {
                    println!("FAILED: {f}");
                }
                println!(
                    "\n{}: {} checks, {} failed; {} placements ({} found their class full); {:.1} s",
                    if rep.passed() { "PASS" } else { "FAIL" },
                    rep.checks,
                    rep.failures.len(),
                    rep.placements,
                    rep.full,
                    t.elapsed().as_secs_f64()
                );
                if rep.passed() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                }
            }
            Err(e) => {
                eprintln!("omw demo --mns: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match run_demo(&args) {
        Ok(rep) => {
            let _ = std::io::Write::write_all(&mut std::io::stdout(), summary(&rep, &args, t.elapsed()).as_bytes());
            if rep.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("omw demo: {e}");
            ExitCode::FAILURE
        }
    }
}
