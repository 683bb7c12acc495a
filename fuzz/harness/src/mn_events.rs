//! The MN control plane driven by arbitrary event sequences on a small loopback cluster, in
//! both execution modes: allocations, frees, forged frees, raw request bytes, one-sided
//! accesses (own, cross-CN, stale, out of bounds), CN crashes (also mid-allocation), new CNs
//! taking freed slots, corrupted requests, MN RNIC resets, ticks and counter samples. After
//! every step: the core's and the model's invariants, and every chunk the MN records as owned
//! reads back, through every access QP of its owner, exactly what the owner wrote.
//!
//! Everything may run under a fuzzer-chosen interleaving (`Cluster::set_interleaving`): the
//! MN CPU acts between any two NIC steps and NIC steps pre-empt the MN's own accesses, so MN
//! events (repairs, the tail watch, departures, ticks) land in the middle of laps; batches post
//! several CNs' requests together (with NIC steps between them) so laps also overlap each other.

use crate::sim::{conservation, invariants, owned_by, rkey_is_current, touches_foreign, Held, Schedule, Setup, Shadow};
use arbitrary::{Arbitrary, Unstructured};
use omw_core::chain::ChainKind;
use omw_core::cn::ClientError;
use omw_core::device::WcStatus;
use omw_core::ids::{GroupId, Rkey};
use omw_core::wire::message::ErrorCode;
use omw_loopback::cluster::{Cluster, CnOpError};

const MAX_OPS: usize = 40;
const MAX_CONNECTS: usize = 3;
/// Requests one batch posts at most.
const MAX_BATCH: usize = 12;

#[derive(Arbitrary, Debug)]
pub struct Input {
    pub setup: Setup,
    pub cns: u8,
    /// The run's schedule (none: the MN acts only when the NIC is idle).
    pub schedule: Option<Schedule>,
    pub ops: Vec<Step>,
}

/// The first input format (`regressions/mn_events/v1/`): no schedule, no batches.
#[derive(Arbitrary, Debug)]
pub struct InputV1 {
    pub setup: Setup,
    pub cns: u8,
    pub ops: Vec<Op>,
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Step {
    Op(Op),
    /// Requests of several CNs posted together, then run under `schedule` (else the run's).
    Batch {
        schedule: Option<Schedule>,
        items: Vec<Timed>,
    },
    /// From now on run under this schedule (none: the idle-NIC schedule).
    Reschedule(Option<Schedule>),
    /// MN events landing in the middle of a lap: what reaches the MN's group-returning paths
    /// (reclaim, repair, the tick's audit, quota enforcement, crash reclaim).
    Lap(Lap),
}

/// The second input format (`regressions/mn_events/v2/`): the steps before `Step::Lap`.
#[derive(Arbitrary, Debug)]
pub struct InputV2 {
    pub setup: Setup,
    pub cns: u8,
    pub schedule: Option<Schedule>,
    pub ops: Vec<StepV2>,
}

#[derive(Arbitrary, Debug, Clone)]
pub enum StepV2 {
    Op(Op),
    Batch { schedule: Option<Schedule>, items: Vec<Timed> },
    Reschedule(Option<Schedule>),
}

impl From<StepV2> for Step {
    fn from(s: StepV2) -> Self {
        match s {
            StepV2::Op(o) => Step::Op(o),
            StepV2::Batch { schedule, items } => Step::Batch { schedule, items },
            StepV2::Reschedule(s) => Step::Reschedule(s),
        }
    }
}

/// An MN event in the middle of a CN's lap (`steps`: the NIC steps run after the request went
/// out, with the MN not acting, before the event).
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Lap {
    /// `cn` allocates naming `victim`'s access QP (MN end) for its own access window `slot`.
    Misbind { cn: u8, victim: u8, slot: u8 },
    /// `cn` asks for `1 + extra % 4` groups beyond its quota, then the counters are sampled.
    OverQuota { cn: u8, extra: u8 },
    /// `cn`'s alloc request goes out and the MN's tick (audit, probes, settling) runs mid-lap.
    AuditMidLap { cn: u8, steps: u8 },
    /// `cn` frees while the MN CPU acts between NIC steps (`schedule`) and its tick runs.
    FreeDuringAudit { cn: u8, which: u8, steps: u8, schedule: Schedule },
    /// `cn`'s host vanishes mid-alloc-lap; time passes until the lease evicts it.
    VanishMidLap { cn: u8, steps: u8 },
    /// The MN's RNIC resets in the middle of `cn`'s alloc (or free) lap.
    ResetMidLap { cn: u8, steps: u8, free: bool },
}

/// One request of a batch.
#[derive(Arbitrary, Debug, Clone)]
pub enum Timed {
    Alloc(u8),
    Free(u8, u8),
    ForgedFree {
        cn: u8,
        entry: Entry,
    },
    Raw {
        cn: u8,
        free_qp: bool,
        bytes: Vec<u8>,
    },
    /// Let the NIC run this many steps (the MN does not act) before the next request.
    NicSteps(u8),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Entry {
    /// An allocation the harness knows (any CN's), by index.
    Held(u8),
    /// The entry of a group.
    Group(u8),
    /// A group's entry plus a byte offset (misaligned, or into the next entry).
    GroupPlus(u8, u8),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Op {
    Alloc(u8),
    Free(u8, u8),
    ForgedFree {
        cn: u8,
        entry: Entry,
    },
    Raw {
        cn: u8,
        free_qp: bool,
        bytes: Vec<u8>,
    },
    Write {
        cn: u8,
        which: u8,
        q: u8,
        off: u16,
        data: Vec<u8>,
    },
    Read {
        cn: u8,
        which: u8,
        q: u8,
        off: u16,
        len: u8,
    },
    /// `attacker` uses `victim`'s address with the victim's rkey (or its own).
    Cross {
        attacker: u8,
        victim: u8,
        which: u8,
        q: u8,
        own_key: bool,
        write: bool,
    },
    /// A freed / revoked allocation's rkey.
    Stale {
        which: u8,
        write: bool,
    },
    Crash(u8),
    /// Crash after the alloc request went out and the fabric ran `steps` steps.
    CrashMidAlloc {
        cn: u8,
        steps: u8,
    },
    /// The first `bytes` bytes this CN sends next are corrupted in flight, then it allocates.
    CorruptThenAlloc {
        cn: u8,
        bytes: u8,
    },
    Connect,
    ResetRnic,
    Tick,
    SampleCounters,
}

pub fn run(data: &[u8]) -> bool {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return false };
    check(&input);
    true
}

pub fn run_v2(data: &[u8]) -> bool {
    let Ok(v) = InputV2::arbitrary_take_rest(Unstructured::new(data)) else { return false };
    check(&Input {
        setup: v.setup,
        cns: v.cns,
        schedule: v.schedule,
        ops: v.ops.into_iter().map(Step::from).collect(),
    });
    true
}

pub fn run_v1(data: &[u8]) -> bool {
    let Ok(v) = InputV1::arbitrary_take_rest(Unstructured::new(data)) else { return false };
    check(&Input { setup: v.setup, cns: v.cns, schedule: None, ops: v.ops.into_iter().map(Step::Op).collect() });
    true
}

struct World {
    c: Cluster,
    shadow: Shadow,
    connects: usize,
    /// CNs that sent raw or corrupted requests (see `sim::invariants`).
    forgers: Vec<usize>,
    schedule: Option<Schedule>,
}

impl World {
    fn cn(&self, i: u8) -> usize {
        i as usize % self.c.cns.len()
    }
    fn alive(&self, i: usize) -> bool {
        !self.c.cns[i].crashed
    }
    fn entry_addr(&self, e: Entry) -> u64 {
        let map = *self.c.driver.mn.map();
        let group = |g: u8| map.entry_addr(GroupId(g as u32 % map.geometry.chunk_count())).unwrap_or(0);
        match e {
            Entry::Held(k) => {
                let mut all: Vec<_> = self.shadow.held.values().map(|h| h.a.entry_addr).collect();
                all.sort_unstable();
                if all.is_empty() {
                    group(k)
                } else {
                    all[k as usize % all.len()]
                }
            }
            Entry::Group(g) => group(g),
            Entry::GroupPlus(g, d) => group(g) + d as u64,
            Entry::Raw(v) => v,
        }
    }
}

fn cluster_err(what: &dyn std::fmt::Debug, e: impl std::fmt::Display) -> ! {
    panic!("cluster operation failed on {what:?}: {e}")
}

pub fn check(input: &Input) {
    let cns = 1 + input.cns as usize % 3;
    let mut w = World {
        c: input.setup.cluster(cns),
        shadow: Shadow::default(),
        connects: 0,
        forgers: Vec::new(),
        schedule: input.schedule,
    };
    if let Some(s) = w.schedule {
        s.apply(&mut w.c);
    }
    invariants(&mut w.c, &"setup", &[]);
    for s in input.ops.iter().take(MAX_OPS) {
        match s {
            Step::Op(op) => step(&mut w, op),
            Step::Batch { schedule, items } => batch(&mut w, *schedule, items, s),
            Step::Reschedule(sch) => {
                w.schedule = *sch;
                Schedule::restore(w.schedule, &mut w.c);
            }
            Step::Lap(l) => lap(&mut w, *l, s),
        }
        invariants(&mut w.c, s, &w.forgers);
        conservation(&w.c, s);
        w.shadow.sync(|cn, a| owned_by(&w.c, cn, a));
        w.shadow.verify_all(&mut w.c, s);
    }
}

/// Several CNs' requests posted together, run to completion under the batch's schedule. A CN
/// that broke its own management QP in the batch (raw bytes or a forged free on it) may have
/// had its honest free flushed with it: the chunk is then still its own — never anyone
/// else's. Every other free lands; every allocation that succeeds is the CN's own.
fn batch(w: &mut World, schedule: Option<Schedule>, items: &[Timed], what: &Step) {
    if let Some(s) = schedule {
        s.apply(&mut w.c);
    }
    let mut tokens: Vec<(usize, u32)> = Vec::new();
    let mut freed: Vec<Held> = Vec::new();
    let mut broke_own: Vec<usize> = Vec::new();
    let items = &items[..items.len().min(MAX_BATCH)];
    // a CN that allocates in this batch may be given the very group it names in a "forged"
    // free, which is then its own, legitimately freed: such CNs forge nothing here
    let allocating: Vec<usize> =
        items.iter().filter_map(|t| if let Timed::Alloc(i) = t { Some(w.cn(*i)) } else { None }).collect();
    for it in items {
        match it.clone() {
            Timed::Alloc(i) => {
                let i = w.cn(i);
                if w.alive(i) && tokens.iter().all(|(j, _)| *j != i) {
                    if let Ok(t) = w.c.alloc_begin(i) {
                        tokens.push((i, t));
                    }
                }
            }
            Timed::Free(i, which) => {
                let i = w.cn(i);
                // several frees in flight per CN: the chain admits each only once the lap
                // before it is done (`ChainEnv::posts_receives`)
                let mine: Vec<Held> = w
                    .shadow
                    .of(i)
                    .into_iter()
                    .filter(|h| owned_by(&w.c, i, &h.a) && !freed.iter().any(|f| f.a.entry_addr == h.a.entry_addr))
                    .collect();
                if !w.alive(i) || mine.is_empty() {
                    continue;
                }
                let h = mine[which as usize % mine.len()].clone();
                if w.c.free_begin(i, &h.a).is_ok() {
                    freed.push(h);
                }
            }
            Timed::ForgedFree { cn, entry } => {
                let i = w.cn(cn);
                let addr = w.entry_addr(entry);
                // a forged free never names the forger's own chunk (that would be a free)
                let own = w.c.cns[i].client().live().iter().any(|a| a.entry_addr == addr) || allocating.contains(&i);
                if w.alive(i) && !own {
                    w.forgers.push(i);
                    broke_own.push(i);
                    let _ = w.c.free_raw_begin(i, addr);
                }
            }
            Timed::Raw { cn, free_qp, bytes } => {
                let i = w.cn(cn);
                if w.alive(i) {
                    let kind = if free_qp { ChainKind::Free } else { ChainKind::Alloc };
                    let b: Vec<u8> = bytes.into_iter().take(96).collect();
                    w.forgers.push(i);
                    broke_own.push(i);
                    let _ = w.c.send_raw_begin(i, kind, &b);
                }
            }
            Timed::NicSteps(n) => {
                w.c.fabric.borrow_mut().run_until_idle(u64::from(n % 48));
            }
        }
    }
    if let Err(e) = w.c.pump() {
        cluster_err(&Op::Tick, format!("{e} (in {what:?})"));
    }
    Schedule::restore(w.schedule, &mut w.c);
    let active =
        |w: &World, i: usize| w.c.driver.mn.cn(w.c.cns[i].id).map(|r| r.status) == Some(omw_core::mn::CnStatus::Active);
    for h in freed {
        let g = w.c.group_of(&h.a);
        let still = g.and_then(|g| w.c.driver.entry(g)).map(|e| (e.owner(), e.rkey(0)))
            == Some((w.c.cns[h.cn].id.get(), h.a.owner_rkey));
        if still && active(w, h.cn) && w.alive(h.cn) {
            assert!(
                broke_own.contains(&h.cn),
                "cn{}'s free of {:#x} did not land and it broke nothing, in {what:?}",
                h.cn,
                h.a.base
            );
            // its client forgot the chunk when it sent the free: it frees again by address
            let r = w.c.free_raw(h.cn, h.a.entry_addr);
            assert!(
                !owned_by(&w.c, h.cn, &h.a) || !active(w, h.cn),
                "cn{} could not free {:#x} again ({r:?}), after {what:?}",
                h.cn,
                h.a.base
            );
        }
    }
    for (i, t) in tokens {
        if let Ok(a) = w.c.alloc_take(i, t) {
            let host_engine = w.c.mode == omw_core::device::ExecutionMode::HostEngine;
            assert!(
                owned_by(&w.c, i, &a) || (host_engine && !active(w, i)),
                "cn{i} got a chunk the MN does not record as its own, in {what:?}"
            );
            w.shadow.adopt(i, a);
        }
    }
}

fn step(w: &mut World, op: &Op) {
    match op.clone() {
        Op::Alloc(i) => {
            let i = w.cn(i);
            alloc(w, i, op);
        }
        Op::Free(i, which) => {
            let i = w.cn(i);
            let Some(h) = w.shadow.pick(i, which as usize) else { return };
            let live = owned_by(&w.c, i, &h.a) && w.alive(i);
            let r = w.c.free(i, &h.a);
            if live && w.c.driver.mn.cn(w.c.cns[i].id).map(|r| r.status) == Some(omw_core::mn::CnStatus::Active) {
                assert_eq!(r, Ok(()), "cn{i} could not free its own chunk");
                assert!(!owned_by(&w.c, i, &h.a), "freed chunk still owned");
            }
        }
        Op::ForgedFree { cn, entry } => {
            let i = w.cn(cn);
            let addr = w.entry_addr(entry);
            let mine: Vec<_> = w.c.cns[i].client().live().iter().map(|a| a.entry_addr).collect();
            let victims: Vec<_> =
                w.shadow.held.values().filter(|h| h.cn != i && h.a.entry_addr == addr).cloned().collect();
            w.forgers.push(i);
            let r = w.c.free_raw(i, addr);
            if !mine.contains(&addr) {
                // not its own: must not take anything from its owner
                for v in victims {
                    assert!(
                        owned_by(&w.c, v.cn, &v.a) || w.c.cns[v.cn].crashed,
                        "forged free by cn{i} took cn{}'s chunk {:#x} ({r:?})",
                        v.cn,
                        v.a.base
                    );
                }
            }
        }
        Op::Raw { cn, free_qp, bytes } => {
            let i = w.cn(cn);
            if !w.alive(i) {
                return;
            }
            let kind = if free_qp { ChainKind::Free } else { ChainKind::Alloc };
            let bytes: Vec<u8> = bytes.into_iter().take(96).collect();
            w.forgers.push(i);
            if let Err(e) = w.c.send_raw(i, kind, &bytes) {
                cluster_err(op, e);
            }
        }
        Op::Write { cn, which, q, off, data } => {
            let i = w.cn(cn);
            let Some(h) = w.shadow.pick(i, which as usize) else { return };
            let q = q as usize % h.a.rkeys.len();
            let off = off as u64 % (2 * h.a.length);
            let data: Vec<u8> = data.into_iter().take(64).collect();
            if data.is_empty() {
                return;
            }
            let st = w.c.write(i, &h.a, q, off, &data);
            let inside = off + data.len() as u64 <= h.a.length;
            if st == WcStatus::Success {
                assert!(inside, "cn{i} wrote past the end of its chunk ({off}+{})", data.len());
                assert!(owned_by(&w.c, i, &h.a), "cn{i} wrote a chunk it does not own");
                w.shadow.record_write(&h, off as usize, &data);
            } else if inside && owned_by(&w.c, i, &h.a) && w.alive(i) {
                panic!("cn{i} could not write its own chunk: {st:?}");
            }
        }
        Op::Read { cn, which, q, off, len } => {
            let i = w.cn(cn);
            let Some(h) = w.shadow.pick(i, which as usize) else { return };
            let q = q as usize % h.a.rkeys.len();
            let off = off as u64 % (2 * h.a.length);
            let len = 1 + len as usize % 64;
            let (st, _) = w.c.read(i, &h.a, q, off, len);
            let inside = off + len as u64 <= h.a.length;
            if st == WcStatus::Success {
                assert!(inside, "cn{i} read past the end of its chunk ({off}+{len})");
            } else if inside && owned_by(&w.c, i, &h.a) && w.alive(i) {
                panic!("cn{i} could not read its own chunk: {st:?}");
            }
        }
        Op::Cross { attacker, victim, which, q, own_key, write } => {
            let (a, v) = (w.cn(attacker), w.cn(victim));
            if a == v || !w.alive(a) {
                return;
            }
            let Some(h) = w.shadow.pick(v, which as usize) else { return };
            let q = q as usize % h.a.rkeys.len();
            let rkey = if own_key {
                match w.shadow.pick(a, which as usize) {
                    Some(mine) => mine.a.rkey(q).unwrap_or_default(),
                    None => return,
                }
            } else {
                h.a.rkey(q).unwrap_or_default()
            };
            let st = if write {
                w.c.write_raw(a, q, h.a.base, rkey, b"intruder")
            } else {
                w.c.read_raw(a, q, h.a.base, rkey, 8).0
            };
            if owned_by(&w.c, v, &h.a) {
                assert_ne!(st, WcStatus::Success, "cn{a} reached cn{v}'s chunk {:#x}", h.a.base);
            }
        }
        Op::Stale { which, write } => {
            if w.shadow.dead.is_empty() {
                return;
            }
            let (i, a) = w.shadow.dead[which as usize % w.shadow.dead.len()].clone();
            if !w.alive(i) {
                return;
            }
            for q in 0..a.rkeys.len() {
                let rkey: Rkey = a.rkey(q).unwrap_or_default();
                let st = if write {
                    w.c.write_raw(i, q, a.base, rkey, b"stale")
                } else {
                    w.c.read_raw(i, q, a.base, rkey, 8).0
                };
                if st == WcStatus::Success {
                    assert!(rkey_is_current(&w.c, rkey), "stale rkey {rkey:?} of cn{i} still works");
                    assert!(touches_foreign(&w.c, i, a.base, 8).is_none(), "stale rkey reached another CN's chunk");
                }
            }
        }
        Op::Crash(i) => {
            let i = w.cn(i);
            if w.alive(i) {
                if let Err(e) = w.c.crash_cn(i) {
                    cluster_err(op, e);
                }
                // the MN reclaimed everything it held
                assert_eq!(crate::sim::held_by(&w.c, i), 0, "crashed cn{i} still holds chunks");
            }
        }
        Op::CrashMidAlloc { cn, steps } => {
            let i = w.cn(cn);
            if !w.alive(i) || w.c.alloc_begin(i).is_err() {
                return;
            }
            for _ in 0..steps {
                w.c.fabric.borrow_mut().step();
            }
            if let Err(e) = w.c.crash_cn(i) {
                cluster_err(op, e);
            }
            if let Err(e) = w.c.tick() {
                cluster_err(op, e);
            }
            assert_eq!(crate::sim::held_by(&w.c, i), 0, "cn{i} crashed mid-allocation still holds chunks");
        }
        Op::CorruptThenAlloc { cn, bytes } => {
            let i = w.cn(cn);
            if !w.alive(i) {
                return;
            }
            let qp = w.c.cns[i].alloc_qp;
            w.forgers.push(i);
            w.c.fabric.borrow_mut().faults_mut().corrupt_sends(qp, 1 + bytes as u32 % 24);
            if let Ok(a) = w.c.alloc(i) {
                w.shadow.adopt(i, a);
            }
        }
        Op::Connect => {
            let live = w.c.cns.iter().filter(|n| !n.crashed).count();
            if w.connects >= MAX_CONNECTS || live >= w.c.cfg.cns {
                return;
            }
            w.connects += 1;
            match w.c.connect_cn() {
                Ok(_) => {}
                // every slot still taken: a CN that vanished keeps its slot until the MN has
                // seen it go (its lease, its connection's error) — a typed refusal, not a fault
                Err(omw_loopback::cluster::ClusterError::Driver(omw_core::mn::driver::DriverError::Node(
                    omw_core::mn::MnError::TooManyCns,
                ))) => {
                    // the refused CN never joined: gone, like a crashed one
                    if let Some(n) = w.c.cns.last_mut() {
                        n.crashed = true;
                    }
                }
                Err(e) => cluster_err(op, e),
            }
        }
        Op::ResetRnic => {
            if let Err(e) = w.c.reset_mn_rnic() {
                cluster_err(op, e);
            }
            for i in 0..w.c.cns.len() {
                assert_eq!(crate::sim::held_by(&w.c, i), 0, "an RNIC reset left cn{i} holding chunks");
            }
        }
        Op::Tick => {
            if let Err(e) = w.c.tick() {
                cluster_err(op, e);
            }
        }
        Op::SampleCounters => {
            if let Err(e) = w.c.sample_counters() {
                cluster_err(op, e);
            }
        }
    }
}

fn alloc(w: &mut World, i: usize, op: &Op) {
    let c = &w.c;
    let rec = c.driver.mn.cn(c.cns[i].id).cloned();
    let free = c.free_groups();
    let held = crate::sim::held_by(c, i);
    let host_engine = c.mode == omw_core::device::ExecutionMode::HostEngine;
    let quota = c.cfg.quota;
    let backing_off = c.cns[i].client().is_backing_off(c.now());
    let empty_state = c.driver.mn.is_empty_state();
    // a corruption rule still waiting for this CN's next SEND makes the request garbage
    let faults_pending = !c.fabric.borrow().faults().is_empty();
    let forger = w.forgers.contains(&i);
    let r = w.c.alloc(i);
    match r {
        Ok(a) => {
            assert!(w.alive(i));
            // host-engine mode enforces the quota when the lap commits: the reply of the
            // allocation that went over it is delivered, then everything the CN holds revoked
            let active = w.c.driver.mn.cn(w.c.cns[i].id).map(|r| r.status) == Some(omw_core::mn::CnStatus::Active);
            assert!(
                owned_by(&w.c, i, &a) || (!active && host_engine && held >= quota),
                "cn{i} got a chunk the MN does not record as its own"
            );
            assert!(a.length == w.c.cfg.chunk_size);
            w.shadow.adopt(i, a);
        }
        Err(CnOpError::Crashed) => assert!(!w.alive(i)),
        Err(e) => {
            // when must an allocation succeed: a live, connected CN under its quota, the pool
            // not empty, nobody told to back off
            let expected = rec.map(|r| r.status == omw_core::mn::CnStatus::Active && !r.alloc_parked).unwrap_or(false)
                && free > 0
                && !empty_state
                && !backing_off
                && !faults_pending
                // a CN that sent garbage may have replies to it in flight (a corrupted token can
                // be the token of a later request)
                && !forger
                && (!host_engine || held < quota);
            let benign = matches!(e, CnOpError::Mn(ErrorCode::Empty) | CnOpError::Client(ClientError::Backoff { .. }));
            if expected && !benign {
                panic!("cn{i} could not allocate ({e}) with {free} free groups, {held}/{quota} held, after {op:?}");
            }
        }
    }
}

fn nic_steps(w: &mut World, steps: u8) {
    for _ in 0..steps % 64 {
        if w.c.fabric.borrow_mut().step().is_none() {
            break;
        }
    }
}

fn active(w: &World, i: usize) -> bool {
    w.c.driver.mn.cn(w.c.cns[i].id).map(|r| r.status) == Some(omw_core::mn::CnStatus::Active)
}

/// Take the answer to `token` after a mid-lap event: a chunk is adopted only if the MN records
/// it as the CN's own.
fn take(w: &mut World, i: usize, token: u32) {
    if let Ok(a) = w.c.alloc_take(i, token) {
        if w.alive(i) && owned_by(&w.c, i, &a) {
            w.shadow.adopt(i, a);
        }
    }
}

fn lap(w: &mut World, l: Lap, what: &Step) {
    match l {
        Lap::Misbind { cn, victim, slot } => {
            let (i, v) = (w.cn(cn), w.cn(victim));
            if i == v || !w.alive(i) || !w.alive(v) {
                return;
            }
            let mut qpns = w.c.cns[i].mn_qps.access.clone();
            let k = slot as usize % qpns.len();
            qpns[k] = w.c.cns[v].mn_qps.access[slot as usize % w.c.cns[v].mn_qps.access.len()];
            w.forgers.push(i);
            // offloaded: bound to the victim's QP (the audit reclaims it; `sim::invariants` has
            // the forger free it); host engine: refused. Never adopted: its window is not the
            // CN's to use. The victim's chunks stay its own (checked after every step).
            let _ = w.c.alloc_naming(i, &qpns);
        }
        Lap::OverQuota { cn, extra } => {
            let i = w.cn(cn);
            if !w.alive(i) || !active(w, i) {
                return;
            }
            let quota = w.c.cfg.quota;
            let want = quota.saturating_sub(crate::sim::held_by(&w.c, i)) + 1 + extra as u32 % 4;
            for _ in 0..want {
                match w.c.alloc(i) {
                    Ok(a) if owned_by(&w.c, i, &a) => w.shadow.adopt(i, a),
                    _ => {}
                }
            }
            if let Err(e) = w.c.sample_counters() {
                cluster_err(what, e);
            }
            // counted in the table at most once per audit pass (issue 23): if it was counted
            // earlier in this pass, the pass's end catches it
            if crate::sim::held_by(&w.c, i) > quota && active(w, i) {
                if let Err(e) = crate::sim::through_audit_passes(&mut w.c, 2) {
                    cluster_err(what, e);
                }
            }
            let held = crate::sim::held_by(&w.c, i);
            assert!(
                held <= quota || !active(w, i),
                "cn{i} holds {held} groups over its quota {quota} and is still served, after {what:?}"
            );
        }
        Lap::AuditMidLap { cn, steps } => {
            let i = w.cn(cn);
            if !w.alive(i) {
                return;
            }
            let Ok(t) = w.c.alloc_begin(i) else { return };
            nic_steps(w, steps);
            if let Err(e) = w.c.tick() {
                cluster_err(what, e);
            }
            take(w, i, t);
        }
        Lap::FreeDuringAudit { cn, which, steps, schedule } => {
            let i = w.cn(cn);
            let Some(h) = w.shadow.pick(i, which as usize) else { return };
            if !w.alive(i) || !owned_by(&w.c, i, &h.a) {
                return;
            }
            let must_land = active(w, i) && !w.forgers.contains(&i);
            schedule.apply(&mut w.c);
            let r = w.c.free_begin(i, &h.a);
            nic_steps(w, steps);
            let t = w.c.tick();
            Schedule::restore(w.schedule, &mut w.c);
            if let Err(e) = t.and_then(|_| w.c.pump().map(|_| ())) {
                cluster_err(what, e);
            }
            if must_land && r.is_ok() && w.alive(i) && active(w, i) {
                assert!(!owned_by(&w.c, i, &h.a), "cn{i}'s free of {:#x} during the audit did not land", h.a.base);
            }
        }
        Lap::VanishMidLap { cn, steps } => {
            let i = w.cn(cn);
            if !w.alive(i) || w.c.alloc_begin(i).is_err() {
                return;
            }
            nic_steps(w, steps);
            if let Err(e) = w.c.vanish_cn(i) {
                cluster_err(what, e);
            }
            let lease = w.c.driver.mn.config().lease_ns.max(1);
            for _ in 0..20 {
                if !active(w, i) {
                    break;
                }
                if let Err(e) = w.c.advance(lease) {
                    cluster_err(what, e);
                }
                invariants(&mut w.c, what, &w.forgers);
            }
            assert!(!active(w, i), "cn{i} vanished mid-lap and is still served after 20 leases");
            assert_eq!(crate::sim::held_by(&w.c, i), 0, "cn{i} vanished mid-lap and still holds chunks");
        }
        Lap::ResetMidLap { cn, steps, free } => {
            let i = w.cn(cn);
            if !w.alive(i) {
                return;
            }
            let token = if free {
                match w.shadow.pick(i, steps as usize) {
                    Some(h) if owned_by(&w.c, i, &h.a) => {
                        let _ = w.c.free_begin(i, &h.a);
                    }
                    _ => return,
                }
                None
            } else {
                w.c.alloc_begin(i).ok()
            };
            nic_steps(w, steps);
            if let Err(e) = w.c.reset_mn_rnic() {
                cluster_err(what, e);
            }
            if let Some(t) = token {
                let _ = w.c.alloc_take(i, t);
            }
            for j in 0..w.c.cns.len() {
                assert_eq!(crate::sim::held_by(&w.c, j), 0, "an RNIC reset mid-lap left cn{j} holding chunks");
            }
        }
    }
}
