//! Reference-model testing (proptest-state-machine): a model of the pool — who holds how
//! many chunks, how many are free, which rkeys are dead — against the real MN and CNs on the
//! loopback model, over random sequences of allocations, frees, reads, writes, forged frees,
//! cross-CN and stale accesses, garbage requests, crashes and MN RNIC resets, in both
//! execution modes. After every step: the core's `check_invariants()`, the model's own
//! invariants, and the security properties (a denied access changes nothing).
//!
//! CI runs a fixed, small number of cases; `OMW_PROPTEST_CASES=N` raises it for long runs.

use omw_core::backend::{ExecutionMode, WcStatus};
use omw_core::chain::ChainKind;
use omw_core::cn::Allocation;
use omw_core::ids::Rkey;
use omw_loopback::cluster::{Cluster, ClusterConfig, CnOpError};
use omw_loopback::NicConfig;
use proptest::prelude::*;
use proptest::test_runner::Config;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

const CNS: usize = 3;
const CHUNKS: u32 = 6;

#[derive(Clone, Debug)]
struct Pool {
    mode: ExecutionMode,
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

impl ReferenceStateMachine for Pool {
    type State = Pool;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Pool> {
        prop_oneof![Just(ExecutionMode::Offloaded), Just(ExecutionMode::HostEngine)]
            .prop_map(|mode| Pool { mode, alive: [true; CNS], held: [0; CNS], free: CHUNKS, empty: false })
            .boxed()
    }

    fn transitions(_s: &Pool) -> BoxedStrategy<Op> {
        let cn = 0..CNS;
        prop_oneof![
            4 => cn.clone().prop_map(Op::Alloc),
            3 => (cn.clone(), 0..8usize).prop_map(|(c, k)| Op::Free(c, k)),
            3 => (cn.clone(), 0..8usize, 0..2usize, proptest::collection::vec(any::<u8>(), 1..24)).prop_map(|(c, k, q, d)| Op::Write(c, k, q, d)),
            2 => (cn.clone(), 0..8usize, 0..2usize).prop_map(|(c, k, q)| Op::Read(c, k, q)),
            2 => (cn.clone(), cn.clone(), 0..8usize, 0..2usize).prop_map(|(a, v, k, q)| Op::CrossAccess(a, v, k, q)),
            1 => (cn.clone(), cn.clone(), 0..8usize).prop_map(|(a, v, k)| Op::ForgedFree(a, v, k)),
            1 => cn.clone().prop_map(Op::Stale),
            1 => (cn.clone(), any::<bool>(), proptest::collection::vec(any::<u8>(), 0..40)).prop_map(|(c, a, b)| Op::Garbage(c, a, b)),
            1 => cn.clone().prop_map(Op::Crash),
            1 => Just(Op::RnicReset),
            1 => Just(Op::Tick),
        ]
        .boxed()
    }

    fn preconditions(s: &Pool, op: &Op) -> bool {
        match *op {
            Op::Alloc(c) | Op::Stale(c) | Op::Garbage(c, ..) => s.alive[c],
            Op::Free(c, _) | Op::Write(c, ..) | Op::Read(c, ..) => s.alive[c] && s.held[c] > 0,
            Op::CrossAccess(a, v, ..) | Op::ForgedFree(a, v, _) => a != v && s.alive[a] && s.alive[v] && s.held[v] > 0,
            // keep two CNs alive so attacks stay possible
            Op::Crash(c) => s.alive[c] && s.alive.iter().filter(|x| **x).count() > 2,
            Op::RnicReset | Op::Tick => true,
        }
    }

    fn apply(mut s: Pool, op: &Op) -> Pool {
        match *op {
            Op::Alloc(c) => {
                if s.free > 0 && !s.empty {
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
}

struct Sut {
    c: Cluster,
    live: Vec<Vec<(Allocation, Vec<u8>)>>,
    stale: Vec<Vec<(u64, Rkey)>>,
}

struct PoolTest;

impl StateMachineTest for PoolTest {
    type SystemUnderTest = Sut;
    type Reference = Pool;

    fn init_test(s: &Pool) -> Sut {
        let mut cfg = ClusterConfig::paper_like();
        cfg.mode = Some(s.mode);
        cfg.cns = CNS;
        cfg.chunks = CHUNKS;
        cfg.chunk_size = 512;
        cfg.quota = CHUNKS;
        if s.mode == ExecutionMode::HostEngine {
            cfg.nic = NicConfig::strict().with_offload(false).with_prefetch(8);
        }
        Sut { c: Cluster::new(cfg).unwrap(), live: vec![Vec::new(); CNS], stale: vec![Vec::new(); CNS] }
    }

    fn apply(mut t: Sut, s: &Pool, op: Op) -> Sut {
        let c = &mut t.c;
        match op {
            Op::Alloc(i) => match c.alloc(i) {
                Ok(a) => {
                    assert!(t.live[i].len() < s.held[i] + 1, "alloc succeeded where the model expected failure");
                    t.live[i].push((a, Vec::new()));
                }
                Err(e) => {
                    assert!(s.empty, "alloc failed ({e}) with free groups left");
                    assert!(matches!(e, CnOpError::Mn(_) | CnOpError::Client(_)), "{e}");
                }
            },
            Op::Free(i, k) => {
                let k = k % t.live[i].len();
                let (a, _) = t.live[i].swap_remove(k);
                c.free(i, &a).unwrap();
                c.tick().unwrap(); // the MN timer settles tickets and announces availability
                t.stale[i].push((a.base, a.rkey(0).unwrap()));
            }
            Op::Write(i, k, q, data) => {
                let k = k % t.live[i].len();
                let a = t.live[i][k].0.clone();
                assert_eq!(c.write(i, &a, q, 0, &data), WcStatus::Success);
                t.live[i][k].1 = data;
            }
            Op::Read(i, k, q) => {
                let k = k % t.live[i].len();
                let (a, want) = t.live[i][k].clone();
                let (st, got) = c.read(i, &a, q, 0, want.len().max(1));
                assert_eq!(st, WcStatus::Success);
                if !want.is_empty() {
                    assert_eq!(got, want, "a CN reads back what it wrote");
                }
            }
            Op::CrossAccess(att, v, k, q) => {
                let k = k % t.live[v].len();
                let (a, want) = t.live[v][k].clone();
                let rk = a.rkey(q).unwrap();
                assert_eq!(c.write_raw(att, q, a.base, rk, b"attack"), WcStatus::RemAccessErr);
                assert_eq!(c.read_raw(att, q, a.base, rk, 8).0, WcStatus::RemAccessErr);
                let (st, got) = c.read(v, &a, q, 0, want.len().max(1));
                assert_eq!(st, WcStatus::Success);
                if !want.is_empty() {
                    assert_eq!(got, want, "victim's bytes unchanged");
                }
            }
            Op::ForgedFree(att, v, k) => {
                let k = k % t.live[v].len();
                let a = t.live[v][k].0.clone();
                assert!(c.free_raw(att, a.entry_addr).is_err(), "forged free must fail");
                assert_eq!(c.write(v, &a, 0, 0, b"still"), WcStatus::Success, "owner keeps the chunk");
                t.live[v][k].1 = b"still".to_vec();
            }
            Op::Stale(i) => {
                for (base, rk) in t.stale[i].clone() {
                    assert_eq!(c.read_raw(i, 0, base, rk, 8).0, WcStatus::RemAccessErr, "stale rkey denied");
                }
            }
            Op::Garbage(i, alloc, bytes) => {
                let kind = if alloc { ChainKind::Alloc } else { ChainKind::Free };
                c.send_raw(i, kind, &bytes).unwrap();
            }
            Op::Crash(i) => {
                c.crash_cn(i).unwrap();
                c.tick().unwrap();
                t.live[i].clear();
            }
            Op::RnicReset => {
                c.reset_mn_rnic().unwrap();
                for i in 0..CNS {
                    for (a, _) in t.live[i].drain(..) {
                        t.stale[i].push((a.base, a.rkey(0).unwrap()));
                    }
                }
            }
            Op::Tick => c.tick().unwrap(),
        }
        // the protocol's invariants (core checker over MN memory + window state, and the
        // model's own) after every step
        t.c.check_invariants().unwrap_or_else(|e| panic!("invariant broken: {e}"));
        t
    }

    fn check_invariants(t: &Sut, s: &Pool) {
        for i in 0..CNS {
            if s.alive[i] {
                assert_eq!(t.live[i].len(), s.held[i], "cn{i} holds what the model says");
            }
        }
        assert_eq!(t.c.free_groups(), s.free, "free groups match the model");
    }
}

/// CI: a fixed seed and a small case count (deterministic and fast). `OMW_PROPTEST_CASES=N`
/// raises the count and draws random seeds; `OMW_PROPTEST_SEED=S` pins one. Failures found by
/// long runs are saved under tests/proptest-regressions/ and replayed first on every run.
fn config() -> Config {
    use proptest::test_runner::{FileFailurePersistence, RngSeed};
    let cases: Option<u32> = std::env::var("OMW_PROPTEST_CASES").ok().and_then(|v| v.parse().ok());
    let seed = match std::env::var("OMW_PROPTEST_SEED").ok().and_then(|v| v.parse().ok()) {
        Some(s) => RngSeed::Fixed(s),
        None if cases.is_some() => RngSeed::Random,
        None => RngSeed::Fixed(0x0_5EED_0FF1),
    };
    Config {
        cases: cases.unwrap_or(64),
        max_shrink_iters: 4000,
        rng_seed: seed,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
        ..Config::default()
    }
}

prop_state_machine! {
    #![proptest_config(config())]
    #[test]
    fn pool_against_reference_model(sequential 1..40 => PoolTest);
}
