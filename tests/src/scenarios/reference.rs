//! A reference model of the pool — who holds how many chunks, how many are free, which rkeys are
//! dead — against the real MN and CNs, over seeded random sequences of allocations, frees,
//! reads, writes, forged frees, cross-CN and stale accesses, garbage requests, crashes and MN
//! RNIC resets (each where the testbed has it: garbage needs `RAW_REQUESTS`, crashes `CRASH`, resets
//! `RNIC_RESET`, cross and stale accesses `REVIVE`). After every step: the MN's invariants, the
//! model's, and the shadow of every CN's bytes.
//!
//! Moved from tests/tests/loopback_state_machine.rs (proptest-state-machine); the sequences are
//! now drawn from a fixed seed per case. `OMW_PROPTEST_CASES=N` raises the case count,
//! `OMW_PROPTEST_SEED=S` changes the seed.

use crate::oracle::{Rng, Shadow};
use crate::runner::{Outcome, Scenario};
use crate::testbed::{Caps, Factory, MnSpec, Refusal, Testbed};
use omw_core::chain::ChainKind;
use omw_core::device::WcStatus;

pub const LIST: &[Scenario] = &[Scenario {
    name: "reference::pool_against_reference_model",
    needs: Caps::NONE,
    run: pool_against_reference_model,
}];

const CNS: usize = 3;
const CHUNKS: u32 = 6;

#[derive(Clone, Debug)]
struct Pool {
    alive: [bool; CNS],
    held: [usize; CNS],
    free: u32,
    /// Some CN has seen "empty" and nothing has been freed since.
    empty: bool,
}

#[derive(Clone, Debug)]
enum Op {
    Alloc(usize),
    Free(usize, usize),
    Write(usize, usize, usize, Vec<u8>),
    Read(usize, usize, usize),
    /// attacker, victim, which of the victim's allocations, through which of the attacker's QPs
    CrossAccess(usize, usize, usize, usize),
    ForgedFree(usize, usize, usize),
    Stale(usize),
    Garbage(usize, bool, Vec<u8>),
    Crash(usize),
    RnicReset,
    Tick,
}

fn gen(r: &mut Rng, caps: Caps) -> Op {
    let cn = |r: &mut Rng| r.below(CNS as u64) as usize;
    loop {
        // the weights of the proptest strategy this replaces
        let op = match r.below(20) {
            0..=3 => Op::Alloc(cn(r)),
            4..=6 => Op::Free(cn(r), r.below(8) as usize),
            7..=9 => {
                let (c, k, q) = (cn(r), r.below(8) as usize, r.below(2) as usize);
                let mut d = r.bytes(24);
                if d.is_empty() {
                    d.push(0x11);
                }
                Op::Write(c, k, q, d)
            }
            10..=11 => Op::Read(cn(r), r.below(8) as usize, r.below(2) as usize),
            12..=13 => Op::CrossAccess(cn(r), cn(r), r.below(8) as usize, r.below(2) as usize),
            14 => Op::ForgedFree(cn(r), cn(r), r.below(8) as usize),
            15 => Op::Stale(cn(r)),
            16 => Op::Garbage(cn(r), r.below(2) == 0, r.bytes(40)),
            17 => Op::Crash(cn(r)),
            18 => Op::RnicReset,
            _ => Op::Tick,
        };
        let ok = match op {
            Op::Garbage(..) => caps.contains(Caps::RAW_REQUESTS),
            Op::Crash(_) => caps.contains(Caps::CRASH),
            Op::RnicReset => caps.contains(Caps::RNIC_RESET),
            // the attacker and the stale CN keep using their QPs afterwards
            Op::CrossAccess(..) | Op::Stale(_) => caps.contains(Caps::REVIVE),
            _ => true,
        };
        if ok {
            return op;
        }
    }
}

fn precondition(s: &Pool, op: &Op) -> bool {
    match *op {
        Op::Alloc(c) | Op::Stale(c) | Op::Garbage(c, ..) => s.alive[c],
        Op::Free(c, _) | Op::Write(c, ..) | Op::Read(c, ..) => s.alive[c] && s.held[c] > 0,
        Op::CrossAccess(a, v, ..) | Op::ForgedFree(a, v, _) => a != v && s.alive[a] && s.alive[v] && s.held[v] > 0,
        // keep two CNs alive so attacks stay possible
        Op::Crash(c) => s.alive[c] && s.alive.iter().filter(|x| **x).count() > 2,
        Op::RnicReset | Op::Tick => true,
    }
}

/// The model after `op`; `allocated`: whether an alloc succeeded (the MN's chains may pop a
/// group ahead for a CN, `omw_core::chain::alloc`, so which CN gets the last free groups is
/// the testbed's to say — `apply` checks it was allowed to).
fn model(mut s: Pool, op: &Op, allocated: bool) -> Pool {
    match *op {
        Op::Alloc(c) => {
            if allocated {
                s.free -= 1;
                s.held[c] += 1;
            } else {
                s.empty = true;
            }
        }
        Op::Free(c, _) => {
            s.held[c] -= 1;
            s.free += 1;
            s.empty = false;
        }
        Op::Crash(c) => {
            s.alive[c] = false;
            s.free += s.held[c] as u32;
            if s.held[c] > 0 {
                s.empty = false;
            }
            s.held[c] = 0;
        }
        Op::RnicReset => {
            s.held = [0; CNS];
            s.free = CHUNKS;
            s.empty = false;
        }
        _ => {}
    }
    s
}

/// Run `op`; for an alloc, whether it succeeded.
fn apply(t: &mut dyn Testbed, sh: &mut Shadow, s: &Pool, op: &Op) -> bool {
    match op.clone() {
        Op::Alloc(i) => {
            // the queue, and whether this CN's chain holds a group popped ahead, before it asks
            let (queued, mine) = (t.free_groups(), t.ahead_of(i));
            match t.alloc(i) {
                Ok(a) => {
                    assert!(s.free > 0, "alloc succeeded with no group left");
                    assert!(!s.empty || mine, "alloc succeeded where the model expected failure");
                    sh.adopt(i, a);
                    return true;
                }
                Err(e) => {
                    // every group left is popped ahead by another CN's chain, or none is left
                    // (with several alloc chains, the request may have gone to a chain of
                    // this CN that holds none while another of its chains holds one)
                    let others_hold_the_rest = queued == 0 && (!mine || t.alloc_chains() > 1);
                    assert!(s.free == 0 || s.empty || others_hold_the_rest, "alloc failed ({e}) with free groups left");
                    assert!(matches!(e, Refusal::Mn(_) | Refusal::Client(_)), "{e}");
                }
            }
        }
        Op::Free(i, k) => {
            let h = sh.pick(i, k).unwrap();
            sh.forget(&h);
            t.free(i, &h.a).unwrap();
            t.tick(); // the MN timer settles tickets and announces availability
        }
        Op::Write(i, k, q, data) => {
            let h = sh.pick(i, k).unwrap();
            assert_eq!(t.write(i, &h.a, q, 0, &data), WcStatus::Success);
            sh.record_write(&h, 0, &data);
        }
        Op::Read(i, k, q) => {
            let h = sh.pick(i, k).unwrap();
            let (st, got) = t.read(i, &h.a, q, 0, h.bytes.len());
            assert_eq!(st, WcStatus::Success);
            for (n, want) in h.bytes.iter().enumerate() {
                if let Some(w) = want {
                    assert_eq!(got[n], *w, "a CN reads back what it wrote");
                }
            }
        }
        Op::CrossAccess(att, v, k, q) => {
            let a = sh.pick(v, k).unwrap().a;
            let rk = a.rkey(q).unwrap();
            assert_eq!(t.write_raw(att, q, a.base, rk, b"attack"), WcStatus::RemAccessErr);
            assert_eq!(t.read_raw(att, q, a.base, rk, 8).0, WcStatus::RemAccessErr);
        }
        Op::ForgedFree(att, v, k) => {
            let h = sh.pick(v, k).unwrap();
            assert!(t.free_entry(att, h.a.entry_addr).is_err(), "forged free must fail");
            assert_eq!(t.write(v, &h.a, 0, 0, b"still"), WcStatus::Success, "owner keeps the chunk");
            sh.record_write(&h, 0, b"still");
        }
        Op::Stale(i) => {
            let mut alive = [false; CNS];
            alive[i] = true;
            sh.verify_dead(t, &alive, &op);
        }
        Op::Garbage(i, alloc, bytes) => {
            let kind = if alloc { ChainKind::Alloc } else { ChainKind::Free };
            t.send_raw(i, kind, &bytes);
        }
        Op::Crash(i) => {
            t.crash(i);
            t.tick();
            sh.kill(Some(i));
        }
        Op::RnicReset => {
            t.reset_mn_rnic();
            sh.kill(None);
        }
        Op::Tick => t.tick(),
    }
    false
}

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn pool_against_reference_model(f: &dyn Factory) -> Outcome {
    let cases = env("OMW_PROPTEST_CASES").unwrap_or(24);
    let seed = env("OMW_PROPTEST_SEED").unwrap_or(0x0_5EED_0FF1);
    let caps = f.caps();
    for case in 0..cases {
        let mut r = Rng::new(seed ^ case.wrapping_mul(0x1000_0001));
        let len = 1 + r.below(40) as usize;
        let mut t = f.start(MnSpec::new(CNS, CHUNKS).chunk_size(512));
        let mut s = Pool { alive: [true; CNS], held: [0; CNS], free: CHUNKS, empty: false };
        let mut sh = Shadow::default();
        let mut done = Vec::new();
        while done.len() < len {
            let op = gen(&mut r, caps);
            if !precondition(&s, &op) {
                continue;
            }
            let ctx = format!("case {case} (seed {seed:#x}), steps {done:?} then {op:?}");
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let allocated = apply(&mut *t, &mut sh, &s, &op);
                let next = model(s.clone(), &op, allocated);
                // the protocol's invariants and the model's, after every step
                t.check_invariants().unwrap_or_else(|e| panic!("invariant broken: {e}"));
                for i in 0..CNS {
                    if next.alive[i] {
                        assert_eq!(sh.count(i), next.held[i], "cn{i} holds what the model says");
                    }
                }
                assert_eq!(t.unallocated(), next.free, "free groups match the model");
                next
            }));
            match run {
                Ok(next) => s = next,
                Err(p) => {
                    let msg = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    panic!("{ctx}: {msg}");
                }
            }
            done.push(op);
        }
        sh.verify_all(&mut *t, &"the end of the case");
    }
    Ok(())
}
