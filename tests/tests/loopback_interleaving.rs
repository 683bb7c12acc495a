//! Races between laps (DESIGN.md §9: "no lost or duplicated group and no double ownership under
//! any interleaving of NIC steps and MN CPU actions"). On real hardware the MN CPU runs while
//! the NIC executes chains, and other CNs' laps run concurrently; the default schedule of the
//! loopback cluster lets the MN act only when the NIC is idle, which hides races. Here
//! [`Cluster::set_interleaving`] lets the MN act between any two NIC steps and lets NIC steps
//! pre-empt the MN's own accesses, and batches of requests from several CNs — honest
//! allocations and frees, frees forged for *any* entry (including ones another CN is popping
//! right now), garbage, a CN's host crashing mid-batch (the MN reclaiming what it held while
//! the other CNs' laps run) — are posted together and run to completion under a seeded
//! schedule.
//!
//! After every batch: the core's invariant checker, conservation (free + held = all groups,
//! no group held twice), every honest CN still owns and can use every chunk it was given, and
//! a crashed CN is no longer served and owns nothing.
//! Runs in offloaded (chains in canonical and in mlx5 form, with relayed gates, and popping
//! ahead with two alloc chains per CN), host-engine and rxe-compatible modes.

use omw_core::chain::ChainKind;
use omw_core::cn::Allocation;
use omw_core::device::behaviour::SelfEnable;
use omw_core::device::ExecutionMode;
use omw_core::device::WcStatus;
use omw_core::ids::GroupId;
use omw_core::mn::Event;
use omw_core::wire::wqe_format::WqeFormat;
use omw_loopback::cluster::{Cluster, ClusterConfig, CnOpError};
use omw_tests::Mode;
use proptest::prelude::*;
use proptest::test_runner::Config;
use std::collections::HashSet;

const CNS: usize = 3;
const CHUNKS: u32 = 5;

#[derive(Clone, Debug)]
enum Act {
    Alloc(usize),
    Free(usize, usize),
    /// forger, group: a free request naming any group's entry
    Forge(usize, u32),
    Garbage(usize, bool, Vec<u8>),
    /// The MN's periodic work (audit, quota, lease) right now, after this many NIC steps —
    /// while this batch's laps are under way (the MN CPU acting between NIC steps).
    Tick(u8),
    /// A hostile CN allocates naming the next CN's access QP for its first access window (the
    /// audit reclaims such a group), then frees that group in this batch — racing any `Tick`.
    MisbindFree(usize),
    /// The CN's host crashes after this many NIC steps, while this batch's laps are under way:
    /// the MN reclaims everything it held, racing the other CNs' laps (at most one crash per
    /// run; the CN stays down).
    Crash(usize, u8),
    /// The MN's RNIC resets after this many NIC steps, under every lap in flight: every
    /// allocation is revoked, the table rebuilt, the chains re-armed (at most once per run).
    RnicReset(u8),
}

/// How a run's MN is set up: a shared mode; offloaded with the chains in mlx5 form; offloaded
/// with relayed gates (a device that ignores a queue's ENABLE of itself,
/// `ChainVariant::relays_gates`); or offloaded popping ahead with two alloc chains per CN (more
/// chains than groups: chains park one by one); or offloaded in mlx5 form, popping ahead, on a
/// device that refuses a bind naming another QP, so the chains bind only to the poster
/// (`ChainVariant::binds_to_poster`: windows on the Alloc QP, ownership by the proof key).
#[derive(Clone, Copy, Debug)]
enum Setup {
    Mode(Mode),
    Mlx5,
    Relayed,
    PopAheadTwoChains,
    BindsToPoster,
}

/// Every set-up the pinned races run in; the offloaded ones first.
const EVERY_SETUP: [Setup; 7] = [
    Setup::Mode(Mode::Offloaded),
    Setup::Mlx5,
    Setup::Relayed,
    Setup::PopAheadTwoChains,
    Setup::BindsToPoster,
    Setup::Mode(Mode::HostEngine),
    Setup::Mode(Mode::Rxe),
];
/// The set-ups that run chains.
const OFFLOADED_SETUPS: [Setup; 5] = [EVERY_SETUP[0], EVERY_SETUP[1], EVERY_SETUP[2], EVERY_SETUP[3], EVERY_SETUP[4]];

impl Setup {
    fn alloc_chains(self) -> usize {
        match self {
            Setup::PopAheadTwoChains => 2,
            _ => 1,
        }
    }
}

fn cluster(setup: Setup) -> Cluster {
    match setup {
        Setup::Mode(mode) => omw_tests::cluster(mode, CNS, CHUNKS, true),
        // `omw_tests::cluster`'s offloaded set-up, the chains in mlx5 form
        Setup::Mlx5 | Setup::BindsToPoster => {
            let mut cfg = ClusterConfig::paper_like().with_wqe_format(WqeFormat::Mlx5);
            (cfg.cns, cfg.chunks, cfg.chunk_size, cfg.quota, cfg.scrub) = (CNS, CHUNKS, 512, CHUNKS, true);
            cfg.mode = Some(ExecutionMode::Offloaded);
            if let Setup::BindsToPoster = setup {
                let mut b = cfg.nic.behaviour;
                b.foreign_bind = omw_core::device::behaviour::ForeignBind::Refused;
                cfg.nic = cfg.nic.with_behaviour(b);
                cfg.pop_ahead = Some(true);
            }
            let c = Cluster::new(cfg).expect("cluster");
            if let Setup::BindsToPoster = setup {
                assert!(c.driver.mn.config().chain_variant.binds_to_poster, "the layout binding to the poster runs");
            }
            c
        }
        Setup::Relayed | Setup::PopAheadTwoChains => {
            let mut cfg = ClusterConfig::paper_like();
            (cfg.cns, cfg.chunks, cfg.chunk_size, cfg.quota, cfg.scrub) = (CNS, CHUNKS, 512, CHUNKS, true);
            cfg.mode = Some(ExecutionMode::Offloaded);
            if let Setup::Relayed = setup {
                let mut b = cfg.nic.behaviour;
                b.self_enable = SelfEnable::Ignored;
                cfg.nic = cfg.nic.with_behaviour(b);
            } else {
                cfg.alloc_chains = 2;
                cfg.pop_ahead = Some(true);
            }
            let c = Cluster::new(cfg).expect("cluster");
            if let Setup::Relayed = setup {
                assert!(c.driver.mn.config().chain_variant.relays_gates, "the relayed layout runs");
            }
            c
        }
    }
}

fn act() -> impl Strategy<Value = Act> {
    let cn = 0..CNS;
    prop_oneof![
        4 => cn.clone().prop_map(Act::Alloc),
        3 => (cn.clone(), 0..8usize).prop_map(|(c, k)| Act::Free(c, k)),
        2 => (cn.clone(), 0..CHUNKS).prop_map(|(c, g)| Act::Forge(c, g)),
        1 => (cn.clone(), any::<bool>(), proptest::collection::vec(any::<u8>(), 0..40)).prop_map(|(c, a, b)| Act::Garbage(c, a, b)),
        2 => (0u8..48).prop_map(Act::Tick),
        1 => cn.clone().prop_map(Act::MisbindFree),
        1 => (cn, 0u8..48).prop_map(|(c, steps)| Act::Crash(c, steps)),
        1 => (0u8..48).prop_map(Act::RnicReset),
    ]
}

/// CN `i`'s chunk is its own: it reads back the bytes it wrote last.
fn owner_keeps(c: &mut Cluster, i: usize, a: &Allocation, tag: &[u8]) {
    let (st, got) = c.read(i, a, 0, 0, tag.len());
    assert_eq!(st, WcStatus::Success, "cn{i} lost access to its chunk at {:#x}", a.base);
    assert_eq!(got, tag, "cn{i}'s bytes changed");
}

/// Let the NIC run `n` steps before the MN acts (the acts that race the laps under way).
fn nic_steps(c: &mut Cluster, n: u8) {
    for _ in 0..n {
        c.fabric.borrow_mut().step();
    }
}

/// Whether act `a` is one of CN `i`'s.
fn names(a: &Act, i: usize) -> bool {
    match a {
        Act::Alloc(j)
        | Act::Free(j, _)
        | Act::Forge(j, _)
        | Act::Garbage(j, ..)
        | Act::MisbindFree(j)
        | Act::Crash(j, _) => *j == i,
        Act::Tick(_) | Act::RnicReset(_) => false,
    }
}

fn run(mode: Mode, batches: Vec<(u64, u16, Vec<Act>)>) {
    run_in(Setup::Mode(mode), batches)
}

fn run_in(mode: Setup, batches: Vec<(u64, u16, Vec<Act>)>) {
    run_keeping(mode, batches);
}

/// [`run_in`], handing back the cluster for the caller's own checks.
fn run_keeping(mode: Setup, batches: Vec<(u64, u16, Vec<Act>)>) -> Cluster {
    let mut c = cluster(mode);
    // what each honest CN holds, with the tag it wrote
    let mut live: Vec<Vec<(Allocation, Vec<u8>)>> = vec![Vec::new(); CNS];
    // the CN that crashed (`Act::Crash`), from its crash on: nothing of it runs any more
    let mut crashed: Option<usize> = None;
    let mut reset_done = false;
    for (seed, per_mille, acts) in batches {
        let mut reset_now = false;
        // a crashed CN does nothing
        let acts: Vec<Act> = acts.into_iter().filter(|a| crashed.is_none_or(|d| !names(a, d))).collect();
        c.set_interleaving(seed, per_mille);
        let mut tokens = Vec::new();
        let mut freed = Vec::new();
        // CNs with a free of a misbound group in flight (`MisbindFree`): one free at a time
        // per CN, like the honest ones in `freed`
        let mut misbind_freeing: HashSet<usize> = HashSet::new();
        // a CN that allocates in this batch may receive the very group it names in a "forged"
        // free, which then is its own, legitimately freed: forgers here do not allocate
        let allocating: HashSet<usize> =
            acts.iter().filter_map(|a| if let Act::Alloc(i) = a { Some(*i) } else { None }).collect();
        for a in &acts {
            if crashed.is_some_and(|d| names(a, d)) {
                continue; // crashed earlier in this batch
            }
            match a {
                Act::Alloc(i) => {
                    // one outstanding allocation per alloc chain of the CN (the client's rule)
                    if tokens.iter().filter(|(j, _)| j == i).count() < mode.alloc_chains() {
                        if let Ok(t) = c.alloc_begin(*i) {
                            tokens.push((*i, t));
                        }
                    }
                }
                Act::Free(i, k) => {
                    if !live[*i].is_empty() && freed.iter().all(|(j, _, _)| j != i) && !misbind_freeing.contains(i) {
                        let n = live[*i].len();
                        let (a, tag) = live[*i].swap_remove(k % n);
                        c.free_begin(*i, &a).unwrap();
                        freed.push((*i, a, tag));
                    }
                }
                Act::Forge(i, g) => {
                    let entry = c.driver.mn.map().entry_addr(GroupId(*g)).unwrap();
                    // a forger never frees its own chunk this way
                    let own = live[*i].iter().any(|(a, _)| a.entry_addr == entry)
                        || freed.iter().any(|(_, a, _)| a.entry_addr == entry);
                    if !own && !allocating.contains(i) {
                        let _ = c.free_raw_begin(*i, entry);
                    }
                }
                Act::Garbage(i, alloc, bytes) => {
                    let kind = if *alloc { ChainKind::Alloc } else { ChainKind::Free };
                    let _ = c.send_raw_begin(*i, kind, bytes);
                }
                Act::Tick(steps) => {
                    nic_steps(&mut c, *steps);
                    let now = c.now();
                    c.driver.handle(now, Event::Tick).unwrap_or_else(|e| panic!("{mode:?}: tick: {e}"));
                }
                Act::Crash(i, steps) => {
                    if crashed.is_none() {
                        nic_steps(&mut c, *steps);
                        c.crash_cn_begin(*i).unwrap();
                        crashed = Some(*i);
                    }
                }
                Act::RnicReset(steps) => {
                    if !reset_done {
                        nic_steps(&mut c, *steps);
                        let mn = c.mn_host;
                        c.fabric.borrow_mut().reset_rnic(mn).unwrap();
                        let now = c.now();
                        c.driver.handle(now, Event::RnicReset).unwrap_or_else(|e| panic!("{mode:?}: reset: {e}"));
                        // every allocation is revoked; what is asked from here on is new
                        live.iter_mut().for_each(Vec::clear);
                        misbind_freeing.clear();
                        (reset_done, reset_now) = (true, true);
                    }
                }
                Act::MisbindFree(i) => {
                    // (not while this CN has a request of its own in flight: one at a time)
                    if tokens.iter().all(|(j, _)| j != i)
                        && freed.iter().all(|(j, _, _)| j != i)
                        && !misbind_freeing.contains(i)
                    {
                        let victim = c.cns[(i + 1) % CNS].mn_qps.access[0];
                        let mut qpns: Vec<_> = c.cns[*i].mn_qps.access.iter().copied().collect();
                        qpns[0] = victim;
                        // the host engine refuses the request outright
                        if let Ok(a) = c.alloc_naming(*i, &qpns) {
                            if c.free_begin(*i, &a).is_ok() {
                                misbind_freeing.insert(*i);
                            }
                        }
                    }
                }
            }
        }
        c.pump().unwrap();
        if let Some(d) = crashed {
            // what it held, asked for or was freeing is the MN's to reclaim: none of it is its
            // any more, and its requests of this batch are void
            live[d].clear();
            tokens.retain(|(i, _)| *i != d);
            freed.retain(|(i, _, _)| *i != d);
            assert!(!c.is_served(d), "{mode:?}: the MN still serves crashed cn{d}");
            let id = c.cns[d].id.get();
            for g in 0..CHUNKS {
                let e = c.driver.entry(GroupId(g)).unwrap();
                assert_ne!(e.owner(), id, "{mode:?}: group {g} still owned by crashed cn{d}");
            }
        }
        // A CN that broke its own management QP in this batch (a forged free or garbage on
        // it) may have had its honest free flushed with it: the chunk is then still its own
        // (it is told by its SEND's error) — never anyone else's. Other CNs' frees must land.
        let self_inflicted: HashSet<usize> = acts
            .iter()
            .filter_map(|a| match a {
                Act::Forge(i, _) | Act::Garbage(i, ..) | Act::MisbindFree(i) => Some(*i),
                // a tick may revoke a misbinding CN's groups mid-batch, stopping its chains
                Act::Tick(_) => None,
                _ => None,
            })
            .collect();
        for (i, a, tag) in freed {
            let g = c.group_of(&a).unwrap();
            // owned by it with the same keys: the free never landed (a landed free advances the
            // keys, even if the CN allocated the group again in the same batch)
            let still_own =
                c.driver.entry(g).map(|e| (e.owner(), e.rkey(0))) == Some((c.cns[i].id.get(), a.owner_rkey));
            if still_own {
                assert!(self_inflicted.contains(&i), "{mode:?}: cn{i}'s free did not land and it broke nothing");
                owner_keeps(&mut c, i, &a, &tag);
                c.free_raw(i, a.entry_addr).unwrap_or_else(|e| panic!("{mode:?}: cn{i} frees again: {e}"));
            }
        }
        let alloc_garbage: HashSet<usize> = acts
            .iter()
            .filter_map(|a| match a {
                Act::Garbage(i, true, _) => Some(*i),
                _ => None,
            })
            .collect();
        for (i, t) in tokens {
            match c.alloc_take(i, t) {
                Ok(a) => {
                    // The MN may have stopped and undone the lap after its reply went out (the
                    // commit clears the lap's markers only after the reply): the audit's
                    // quiesce of a misbinding CN, a repair after the CN's own garbage. It then
                    // tells the CN (a taken-back notice), whose client forgets the group — only
                    // a CN that misbehaved in this batch, and never silently.
                    // (the very allocation: the CN may hold the same group again under new keys)
                    let held = c.cns[i].driver.client().live().contains(&a);
                    if !held {
                        // (or a reset in this batch revoked it — handed out in the generation
                        // before: the CN was told and forgot it)
                        let revoked = reset_now && a.generation != c.driver.mn.generation();
                        assert!(self_inflicted.contains(&i) || revoked, "{mode:?}: cn{i}'s new chunk was taken back");
                        assert_ne!(
                            c.driver.entry(c.group_of(&a).unwrap()).map(|e| (e.owner(), e.rkey(0))),
                            Some((c.cns[i].id.get(), a.owner_rkey)),
                            "{mode:?}: cn{i} was told its new chunk is gone, but it is still its own"
                        );
                        continue;
                    }
                    let tag = format!("cn{i}@{:x}", a.base).into_bytes();
                    let st = c.write(i, &a, 0, 0, &tag);
                    // garbage a CN sent on its own Alloc QP may land in its running lap (the
                    // doorbell makes every posted receive available, docs/MLX5.md question 2)
                    // and rewrite the binds it asked for: a reply whose keys do not work, for it
                    // alone — the group stays its own and it frees it by its entry below
                    if st != WcStatus::Success && alloc_garbage.contains(&i) {
                        continue;
                    }

                    assert_eq!(st, WcStatus::Success, "{mode:?}: cn{i}'s new chunk usable");
                    live[i].push((a, tag));
                }
                // empty pool, a request lost to a garbage-induced repair, or no reply: never a
                // chunk that is not there
                Err(CnOpError::Mn(_) | CnOpError::NoReply | CnOpError::Client(_)) => {}
                Err(e) => panic!("{mode:?}: unexpected {e}"),
            }
        }
        c.set_interleaving(seed ^ 0xA5A5, 0);
        c.tick().unwrap();
        // A group the table gives a CN that the CN does not know it holds: only a CN that sent
        // garbage may be there (an error for its garbage naming its own alloc's token made it
        // give up on a lap that then succeeded — it hurt only itself); it frees the group by
        // its entry. Anyone else holding an unknown group is a leak.
        let mut unknown = Vec::new();
        for (i, held) in live.iter().enumerate() {
            let id = c.cns[i].id.get();
            // the groups its alloc chains popped ahead are the MN's, not a leak
            let ahead: Vec<GroupId> =
                (0..mode.alloc_chains() as u8).filter_map(|j| c.driver.group_ahead_on(c.cns[i].id, j)).collect();
            for g in (0..CHUNKS).filter(|g| !ahead.contains(&GroupId(*g))) {
                let owned = c.driver.entry(GroupId(g)).is_some_and(|e| e.owner() == id);
                let entry = c.driver.mn.map().entry_addr(GroupId(g)).unwrap();
                if owned && !held.iter().any(|(a, _)| a.entry_addr == entry) {
                    assert!(self_inflicted.contains(&i), "{mode:?}: cn{i} holds group {g} it was never given");
                    unknown.push((i, entry));
                }
            }
        }
        for (i, entry) in unknown {
            c.free_raw(i, entry).unwrap_or_else(|e| panic!("{mode:?}: cn{i} frees its unknown group: {e}"));
        }
        // invariants, conservation, no double ownership, owners keep their chunks
        c.check_invariants().unwrap_or_else(|e| {
            let windows: Vec<_> = (0..CHUNKS)
                .filter_map(|g| c.driver.entry(GroupId(g)))
                .map(|e| {
                    (
                        e.owner(),
                        e.reserved.get(),
                        (0..3).map(|k| (e.rkey(k), c.mw_binding(e.rkey(k)))).collect::<Vec<_>>(),
                    )
                })
                .collect();
            panic!(
                "{mode:?}: invariant broken: {e}; {:?} {:?}; {windows:?}; qps {:?}",
                c.driver.mn.stats(),
                c.driver.mn.last_push_refused(),
                c.cns.iter().map(|n| n.mn_qps.clone()).collect::<Vec<_>>()
            )
        });
        let held: usize = live.iter().map(Vec::len).sum();
        let groups: HashSet<u64> = live.iter().flatten().map(|(a, _)| a.entry_addr).collect();
        assert_eq!(groups.len(), held, "{mode:?}: a group is held twice");
        let ahead = c.driver.groups_ahead() as usize;
        assert_eq!(
            c.free_groups() as usize + ahead + held,
            CHUNKS as usize,
            "{mode:?}: a group was lost or duplicated"
        );
        for (i, held) in live.iter().enumerate() {
            for (a, tag) in held {
                owner_keeps(&mut c, i, a, tag);
            }
        }
    }
    c
}

fn config() -> Config {
    let cases: Option<u32> = std::env::var("OMW_PROPTEST_CASES").ok().and_then(|v| v.parse().ok());
    Config { cases: cases.unwrap_or(48), max_shrink_iters: 2000, ..Config::default() }
}

fn batches() -> impl Strategy<Value = Vec<(u64, u16, Vec<Act>)>> {
    proptest::collection::vec((any::<u64>(), 20u16..600, proptest::collection::vec(act(), 1..7)), 1..10)
}

proptest! {
    #![proptest_config(config())]
    #[test]
    fn offloaded_laps_race_free(b in batches()) { run(Mode::Offloaded, b) }
    #[test]
    fn offloaded_popping_ahead_laps_race_free(b in batches()) { run(Mode::OffloadedPopAhead, b) }
    #[test]
    fn mlx5_form_laps_race_free(b in batches()) { run_in(Setup::Mlx5, b) }
    #[test]
    fn relayed_gates_laps_race_free(b in batches()) { run_in(Setup::Relayed, b) }
    #[test]
    fn popping_ahead_on_two_chains_laps_race_free(b in batches()) { run_in(Setup::PopAheadTwoChains, b) }
    #[test]
    fn binds_to_the_poster_laps_race_free(b in batches()) { run_in(Setup::BindsToPoster, b) }
    #[test]
    fn host_engine_laps_race_free(b in batches()) { run(Mode::HostEngine, b) }
    #[test]
    fn rxe_compatible_laps_race_free(b in batches()) { run(Mode::Rxe, b) }
}

/// The two races of issue 10, pinned: a free's push landing between an empty pop's READ and
/// its clear, and a forged free of an entry a victim is popping right now.
#[test]
fn pinned_pop_push_and_forged_free_races() {
    for mode in EVERY_SETUP {
        for seed in 0..64u64 {
            let mut b = Vec::new();
            // fill the pool
            b.push((seed, 0, (0..CHUNKS as usize).map(|k| Act::Alloc(k % CNS)).collect::<Vec<_>>()));
            for _ in 0..CHUNKS {
                b.push((seed, 0, vec![Act::Alloc(0), Act::Alloc(1), Act::Alloc(2)]));
            }
            // empty pops racing frees, forged frees racing pops
            b.push((seed, 300, vec![Act::Alloc(2), Act::Free(0, 0), Act::Alloc(1), Act::Free(1, 0)]));
            b.push((seed * 7 + 1, 500, vec![Act::Free(0, 0), Act::Alloc(1), Act::Forge(2, 0), Act::Forge(2, 1)]));
            b.push((seed * 11 + 3, 500, vec![Act::Alloc(1), Act::Forge(2, 0), Act::Forge(2, 1), Act::Forge(2, 2)]));
            b.push((
                seed * 13 + 5,
                800,
                (0..CHUNKS).map(|g| Act::Forge(0, g)).chain([Act::Free(1, 0), Act::Alloc(1), Act::Alloc(2)]).collect(),
            ));
            run_in(mode, b);
        }
    }
}

/// Found at 1000 cases (and by the `mn_events` fuzz target): a garbage alloc request (its lap
/// runs with the previous request's QP numbers and its reply fails), the CN's honest free of a
/// group, and a forged free, in one batch. The failed alloc lap's repair must not push a group
/// the CN's free already pushed.
#[test]
fn pinned_garbage_alloc_free_and_forge_push_nothing_twice() {
    for mode in EVERY_SETUP {
        for (seed, pm) in [(0u64, 20u16), (1, 300), (7, 800)] {
            run_in(
                mode,
                vec![
                    (seed, pm, vec![Act::Alloc(2), Act::Alloc(1), Act::Alloc(0)]),
                    (seed, pm, vec![Act::Garbage(2, true, vec![]), Act::Free(2, 0), Act::Forge(2, 3)]),
                ],
            );
        }
    }
}

/// Found at 20 000 cases (issue 20's long run): a hostile CN's misbound group freed while its
/// garbage alloc request, its next alloc and a free of its own interleave with the MN.
#[test]
fn pinned_misbind_free_then_garbage_alloc_and_free() {
    for mode in OFFLOADED_SETUPS {
        run_in(
            mode,
            vec![
                (0, 20, vec![Act::Alloc(0)]),
                (0, 20, vec![Act::Garbage(1, true, vec![]), Act::Alloc(2), Act::Alloc(0)]),
                (0, 20, vec![Act::MisbindFree(0), Act::Alloc(1)]),
                (9548888396674948444, 304, vec![Act::Garbage(0, true, vec![0; 29]), Act::Alloc(0), Act::Free(0, 0)]),
            ],
        );
    }
}

/// Found at 20 000 cases (issue 20's long run), rxe-compatible mode: a garbage free request and
/// an honest alloc of the same CN in one batch.
#[test]
fn pinned_garbage_free_and_alloc_of_one_cn() {
    run_in(Setup::Mode(Mode::Rxe), vec![(0, 20, vec![Act::Garbage(0, false, vec![0, 0, 0, 0, 1]), Act::Alloc(0)])]);
}

/// Found by the proptest with `MisbindFree`: a forged free of group 1, a garbage alloc and a
/// misbound group freed, in one interleaved batch.
#[test]
fn pinned_forge_garbage_and_misbind_free() {
    for mode in OFFLOADED_SETUPS {
        run_in(
            mode,
            vec![(
                18279821445486084542,
                323,
                vec![Act::Forge(0, 1), Act::Garbage(1, true, vec![]), Act::MisbindFree(0)],
            )],
        );
    }
}

/// Found by the proptest with two alloc chains per CN popping ahead (CI of 296d36b): after
/// garbage on CN 0's own Alloc QP, its misbound alloc went on chain 1 but named chain 0's reply
/// buffer (the hostile-CN API's `alloc_naming` always did), so CN 0 read chain 1's *previous*
/// reply — group 1, which it already held — freed it as the misbound group, and its record
/// still listed group 1 while the MN (correctly) had taken the free and handed group 1 on. The
/// MN and the chains were right; the test API now keeps the client's reply target for the
/// chain the request goes on. The random run of this set-up is back on.
#[test]
fn popping_ahead_two_chains_garbage_then_misbound_frees() {
    run_in(
        Setup::PopAheadTwoChains,
        vec![
            (0, 20, vec![Act::Alloc(0), Act::MisbindFree(1)]),
            (4308931926393152, 22, vec![Act::Alloc(0), Act::Free(0, 0)]),
            (0, 20, vec![Act::Garbage(0, true, vec![]), Act::MisbindFree(0), Act::MisbindFree(0)]),
        ],
    );
}

/// Found by the proptest with two alloc chains per CN popping ahead (5 000 cases): a CN's
/// misbound group freed while its next alloc (on its other chain) and an MN tick interleave.
/// The tick's audit quiesced the CN between that alloc's reply and its commit and undid the
/// lap: the CN held a group the MN had taken back, its accesses failing, and nobody told it.
/// The MN now sends a taken-back notice (`wire::message::TakenBack`) and the client forgets
/// the group.
#[test]
fn popping_ahead_two_chains_misbind_free_alloc_and_tick() {
    let c = run_keeping(
        Setup::PopAheadTwoChains,
        vec![
            (0, 20, vec![Act::Alloc(1), Act::MisbindFree(0), Act::Alloc(2), Act::Alloc(1)]),
            (7412396445525553406, 285, vec![Act::MisbindFree(0), Act::Alloc(0), Act::Tick(14)]),
        ],
    );
    assert!(c.driver.mn.stats().taken_back_notices >= 1, "the undone lap's CN was told");
}

/// Found by the relayed-gate proptest at 10 000 cases (2026-12-06), and failing in every
/// offloaded set-up: a group queued twice. CN 0's garbage alloc request ran a lap that popped
/// the last free group, g2, and bound its windows (MW[0] to CN 0's own Free QP) before its
/// reply failed; CN 0's "forged" free of g2 then passed the ownership check — the group was,
/// for the moment, its own — and pushed g2 into the tail slot. CN 1's pop had already taken
/// that slot, found it empty and failed at its probe: g2 now lay below the head, in a ticket
/// the MN learns of only when it repairs CN 1's lap. The repair of CN 0's lap scanned the live
/// window and the known tickets, found g2 nowhere and pushed it; CN 1's repair then moved it
/// from its slot to the tail as well. The queue check now also reads the slot every alloc lap
/// in flight took (its `SLOT_ADDR` marker).
#[test]
fn garbage_alloc_lap_forged_free_and_a_pending_ticket() {
    for mode in OFFLOADED_SETUPS {
        run_in(
            mode,
            vec![
                (0, 20, vec![Act::Alloc(0)]),
                (0, 20, vec![Act::Alloc(2)]),
                (0, 20, vec![Act::Alloc(1), Act::Free(2, 0), Act::Tick(1), Act::Alloc(0)]),
                (0, 20, vec![Act::Alloc(1), Act::Alloc(0), Act::Free(1, 0)]),
                (10, 20, vec![Act::Alloc(1), Act::Garbage(0, true, vec![]), Act::Tick(18), Act::Forge(0, 2)]),
            ],
        );
    }
}

/// A CN's host crashes while its own laps and other CNs' run, and the MN reclaims what it held
/// between any two NIC steps: its alloc in flight, its free in flight, the groups it holds —
/// racing another CN's alloc and free and a forged free of the crashed CN's group. Nothing is
/// lost or queued twice, nothing stays the crashed CN's, the others keep what they hold.
#[test]
fn pinned_crash_mid_batch_races_other_laps() {
    for mode in EVERY_SETUP {
        for (seed, steps) in [(0u64, 0u8), (1, 5), (2, 12), (3, 20), (4, 33), (5, 47)] {
            let c = run_keeping(
                mode,
                vec![
                    (seed, 0, vec![Act::Alloc(0), Act::Alloc(1), Act::Alloc(2)]),
                    (seed, 0, vec![Act::Alloc(2), Act::Alloc(0)]),
                    (
                        seed,
                        300,
                        vec![
                            Act::Alloc(2),
                            Act::Free(2, 0),
                            Act::Alloc(1),
                            Act::Free(0, 0),
                            Act::Crash(2, steps),
                            Act::Forge(1, 2),
                        ],
                    ),
                    (seed, 300, vec![Act::Alloc(0), Act::Alloc(1), Act::Free(1, 0), Act::Tick(3)]),
                ],
            );
            assert!(!c.is_served(2), "{mode:?}: cn2 crashed");
        }
    }
}

/// Found by the proptest once it could reset the MN's RNIC mid-batch (every set-up, at once):
/// a CN allocating right after the reset held its new chunk only until the `Revoked` notice
/// arrived — on another QP than the reply, so after it — and the notice made its client forget
/// everything; in host-engine mode (notice and replies on one QP) the notice dropped the
/// requests in flight, whose replies then went unclaimed. Either way the group stayed the
/// CN's in the table and nobody used or freed it. Replies now carry the pool generation
/// (`AllocReply::generation`), the notice names the new one, and the client forgets only
/// older allocations and keeps its requests in flight.
#[test]
fn pinned_rnic_reset_under_laps_in_flight() {
    for mode in EVERY_SETUP {
        for steps in [0u8, 3, 8, 17, 30] {
            run_in(
                mode,
                vec![
                    (0, 20, vec![Act::Alloc(0), Act::Alloc(1)]),
                    (steps as u64, 200, vec![Act::Alloc(1), Act::Free(0, 0), Act::RnicReset(steps), Act::Alloc(0)]),
                    (0, 20, vec![Act::Alloc(1), Act::Alloc(0), Act::Alloc(2)]),
                ],
            );
        }
    }
}
