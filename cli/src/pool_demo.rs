//! `omw demo --mns N`: a pool of N MNs on the loopback model (the in-process registry), each
//! with two size classes; CNs place mixed-size objects across them. Mid-run one MN drains (no
//! new placements, its live chunks keep working, it says when it holds none) and another
//! vanishes without a goodbye (its CNs see `MnLost` for what they held there — at once on
//! touching it, and from the registry when its lease runs out — and the rest go on). Every
//! byte read back is checked; the command exits 0 only if every check passed.

use omw_bench::Rng;
use omw_core::device::ExecutionMode;
use omw_loopback::NicConfig;
use omw_pool::entry::ClassSpec;
use omw_pool::loopback::{LoopbackConnector, LoopbackMnConfig, LoopbackPool};
use omw_pool::{PoolAlloc, PoolClient, PoolError, PoolNote};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The classes every demo MN has: 64 chunks of 4 KiB, 16 of 64 KiB.
pub const CLASSES: [ClassSpec; 2] =
    [ClassSpec { chunk_size: 4096, chunks: 64 }, ClassSpec { chunk_size: 65536, chunks: 16 }];

/// What the pool demo saw.
#[derive(Debug, Default)]
pub struct PoolReport {
    pub out: String,
    pub checks: u64,
    pub failures: Vec<String>,
    pub placements: u64,
    pub lost_seen: u64,
    /// Allocations that found their class full on every placeable MN (not a failure: the
    /// demand outgrew the pool).
    pub full: u64,
}

impl PoolReport {
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        self.checks += 1;
        if !ok {
            self.failures.push(what());
        }
    }
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

struct Obj {
    a: PoolAlloc,
    seed: u64,
    len: usize,
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(seed);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

struct Cn {
    client: PoolClient<LoopbackConnector>,
    objs: Vec<Obj>,
}

/// Place `n` objects of random sizes (100 B .. 48 KiB) for CN `cn`, write and verify each.
fn place(rep: &mut PoolReport, cns: &mut [Cn], rng: &mut Rng, n: usize, phase: &str) -> BTreeMap<String, u64> {
    let mut where_ = BTreeMap::new();
    for (i, cn) in cns.iter_mut().enumerate() {
        for _ in 0..n {
            let len = if rng.next_u64().is_multiple_of(8) {
                4097 + (rng.next_u64() % 45_000) as usize
            } else {
                100 + (rng.next_u64() % 3_900) as usize
            };
            match cn.client.alloc(len as u64) {
                Ok(a) => {
                    rep.placements += 1;
                    *where_.entry(a.mn().to_string()).or_insert(0) += 1;
                    let seed = rng.next_u64();
                    let data = bytes(seed, len);
                    let w = cn.client.write(&a, 0, &data);
                    rep.check(w.is_ok(), || format!("{phase}: CN {i} write on {}: {w:?}", a.mn()));
                    let mut back = vec![0u8; len];
                    let r = cn.client.read(&a, 0, &mut back);
                    rep.check(r.is_ok() && back == data, || format!("{phase}: CN {i} read-back on {}", a.mn()));
                    cn.objs.push(Obj { a, seed, len });
                }
                Err(PoolError::Empty { .. }) => rep.full += 1,
                Err(e) => rep.check(false, || format!("{phase}: CN {i} alloc of {len} B: {e}")),
            }
        }
    }
    where_
}

fn table(pool: &LoopbackPool) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "    {:<6} {:>12} {:>12}  state", "MN", "4 KiB held", "64 KiB held");
    for m in pool.mns() {
        let held: Vec<String> = if m.vanished {
            vec!["-".into(), "-".into()]
        } else {
            m.specs.iter().zip(m.held_per_class()).map(|(c, h)| format!("{h}/{}", c.chunks)).collect()
        };
        let state = if m.vanished { "vanished" } else { "live" };
        let _ = writeln!(s, "    {:<6} {:>12} {:>12}  {state}", m.name.as_str(), held[0], held[1]);
    }
    s
}

/// Run the pool demo; `Err` only for a setup failure of the model.
pub fn run(mns: usize, cns: usize, mode: ExecutionMode, seed: u64) -> Result<PoolReport, String> {
    let mns = mns.clamp(3, 8);
    let cns = cns.clamp(2, 16);
    let mut cfg = LoopbackMnConfig { mode: Some(mode), max_cns: cns as u32, ..LoopbackMnConfig::default() };
    if mode == ExecutionMode::HostEngine {
        cfg.nic = NicConfig::strict().with_offload(false).with_prefetch(8);
    }
    let mut pool = LoopbackPool::new("demo", cfg).map_err(|e| e.to_string())?;
    for i in 0..mns {
        pool.add_mn(&format!("mn{i}"), &CLASSES).map_err(|e| e.to_string())?;
    }
    let mut rep = PoolReport::default();
    let _ = writeln!(
        rep.out,
        "pool of {mns} MNs on the loopback model ({mode}), each with 64 × 4 KiB and 16 × 64 KiB; {cns} CNs; in-process registry, lease {:?}",
        pool.cfg.ttl
    );
    let mut rng = Rng::new(seed);
    let mut cs: Vec<Cn> = (0..cns)
        .map(|i| {
            pool.client(seed.wrapping_mul(31).wrapping_add(i as u64)).map(|client| Cn { client, objs: Vec::new() })
        })
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;

    // 1. spread
    let spread = place(&mut rep, &mut cs, &mut rng, 10, "placement");
    pool.advance(300_000_000).map_err(|e| e.to_string())?;
    let (min, max) = (spread.values().min().copied().unwrap_or(0), spread.values().max().copied().unwrap_or(0));
    let _ = writeln!(
        rep.out,
        "\n1. placement: {} objects, per MN {spread:?} (max/min {:.2})",
        cns * 10,
        max as f64 / min.max(1) as f64
    );
    rep.check(spread.len() == mns && min > 0, || format!("placement reached {} of {mns} MNs", spread.len()));
    rep.out.push_str(&table(&pool));

    // 2. mn0 drains
    pool.drain("mn0", true).map_err(|e| e.to_string())?;
    let mut drained_at = None;
    for step in 0..20 {
        for (mn, r) in pool.advance(100_000_000).map_err(|e| e.to_string())? {
            if r.draining_changed == Some(true) {
                let _ = writeln!(
                    rep.out,
                    "\n2. mn0 draining: the operator's request reached {mn} after {} ms",
                    (step + 1) * 100
                );
            }
        }
    }
    let during = place(&mut rep, &mut cs, &mut rng, 4, "while mn0 drains");
    rep.check(!during.contains_key("mn0"), || format!("placed on the draining mn0: {during:?}"));
    let _ = writeln!(rep.out, "   {} more objects, none on mn0: {during:?}", cns * 4);
    let mut moved = 0;
    for (i, cn) in cs.iter_mut().enumerate() {
        let (on0, rest): (Vec<Obj>, Vec<Obj>) = cn.objs.drain(..).partition(|o| o.a.mn() == "mn0");
        cn.objs = rest;
        for o in on0 {
            let mut back = vec![0u8; o.len];
            let r = cn.client.read(&o.a, 0, &mut back);
            rep.check(r.is_ok() && back == bytes(o.seed, o.len), || {
                format!("CN {i}: object on the draining mn0 unreadable")
            });
            let f = cn.client.free(o.a);
            rep.check(f.is_ok(), || format!("CN {i}: free on the draining mn0: {f:?}"));
            moved += 1;
        }
    }
    for step in 0..20 {
        for (mn, r) in pool.advance(100_000_000).map_err(|e| e.to_string())? {
            if r.drained && drained_at.is_none() {
                drained_at = Some(step);
                let _ = writeln!(
                    rep.out,
                    "   its {moved} live objects kept working and were freed; {mn} reports: drained, holds no chunk"
                );
            }
        }
    }
    rep.check(drained_at.is_some(), || "mn0 never reported drained".into());

    // 3. the last MN vanishes mid-run
    let victim = format!("mn{}", mns - 1);
    pool.vanish(&victim).map_err(|e| e.to_string())?;
    let _ = writeln!(rep.out, "\n3. {victim} vanishes (no goodbye, no more keep-alives)");
    let mut lost_at_once = 0;
    let mut ok_reads = 0;
    for (i, cn) in cs.iter_mut().enumerate() {
        let mut keep = Vec::new();
        for o in cn.objs.drain(..) {
            let mut back = vec![0u8; o.len];
            match cn.client.read(&o.a, 0, &mut back) {
                Err(PoolError::MnLost { mn }) => {
                    rep.check(mn == victim, || format!("CN {i}: MnLost for {mn}"));
                    lost_at_once += 1;
                }
                Ok(()) => {
                    rep.check(back == bytes(o.seed, o.len), || format!("CN {i}: object on {} changed", o.a.mn()));
                    ok_reads += 1;
                    keep.push(o);
                }
                Err(e) => rep.check(false, || format!("CN {i}: read on {}: {e}", o.a.mn())),
            }
        }
        cn.objs = keep;
    }
    rep.lost_seen = lost_at_once;
    let _ = writeln!(rep.out, "   CNs touching it: {lost_at_once} object(s) failed with MnLost at once; {ok_reads} on the others read back intact");
    rep.check(lost_at_once > 0, || format!("no CN held anything on {victim}"));
    pool.advance(pool.cfg.ttl.as_nanos() as u64 + 500_000_000).map_err(|e| e.to_string())?;
    let mut saw = 0;
    for cn in cs.iter_mut() {
        let notes = cn.client.take_notes();
        if notes.iter().any(|n| matches!(n, PoolNote::Departed { mn, .. } if *mn == victim)) {
            saw += 1;
        }
    }
    let _ = writeln!(rep.out, "   its lease ran out: {saw} of {cns} CNs saw it depart");
    rep.check(saw == cns, || format!("only {saw} CNs saw {victim} depart"));
    let after = place(&mut rep, &mut cs, &mut rng, 6, "after the vanish");
    rep.check(!after.contains_key(&victim) && !after.contains_key("mn0"), || {
        format!("placed on {victim} or mn0: {after:?}")
    });
    let _ = writeln!(rep.out, "   the rest go on: {} more objects on {after:?}", cns * 6);
    for (i, cn) in cs.iter_mut().enumerate() {
        for o in cn.objs.drain(..) {
            let mut back = vec![0u8; o.len];
            let r = cn.client.read(&o.a, 0, &mut back);
            rep.check(r.is_ok() && back == bytes(o.seed, o.len), || format!("CN {i}: final read on {}", o.a.mn()));
            let f = cn.client.free(o.a);
            rep.check(f.is_ok(), || format!("CN {i}: final free: {f:?}"));
        }
    }
    pool.advance(300_000_000).map_err(|e| e.to_string())?;
    for m in pool.mns().filter(|m| !m.vanished) {
        let held = m.held();
        rep.check(held == 0, || format!("{} holds {held} chunk(s) after every free", m.name));
        let inv = m.check_invariants();
        rep.check(inv.is_ok(), || format!("invariants: {inv:?}"));
    }
    let _ = writeln!(rep.out, "\nafter every free:");
    rep.out.push_str(&table(&pool));
    Ok(rep)
}
