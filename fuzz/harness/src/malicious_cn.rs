//! A malicious CN sends arbitrary bytes and forged requests on its Alloc and Free QPs, guesses
//! keys with feedback (a guess state per key index, over its own windows' neighbours, the MN's
//! MR indexes and honest windows; any verb on any of its QPs), times its requests against the
//! honest CNs' (batches posted together, NIC steps between them, run under a fuzzer-chosen
//! interleaving of NIC steps and MN CPU actions), and goes silent (stops posting receives, or
//! its host vanishes) while time passes — and two honest CNs keep working.
//!
//! After every step, in all execution modes: the core's and the model's invariants;
//! conservation (free + held = all, no group counted twice); every chunk an honest CN holds is
//! still its own, exactly the groups it was given, and reads back, through each of its access
//! QPs, exactly what it wrote; every new chunk reads as zeros; an access of the attacker
//! succeeds only inside a chunk it owns (never MN-private memory, never another CN's chunk);
//! no message carries an MN key other than the receiver's own window rkeys; honest CNs are
//! never disconnected and their allocations and frees succeed whenever pool and quota allow;
//! a silent attacker is no longer served once the lease has run out a few times.

use crate::attacker::{Guesser, Predict};
use crate::sim::{
    conservation, describe_mn_addr, held_by, inside_own_chunk, invariants, no_key_in_messages, owned_by, reads_zero,
    Held, Schedule, Setup, Shadow,
};
use arbitrary::{Arbitrary, Unstructured};
use omw_core::chain::ChainKind;
use omw_core::cn::driver::CnError;
use omw_core::cn::{ClientError, ClientEvent};
use omw_core::device::WcStatus;
use omw_core::ids::{GroupId, Qpn, Rkey};
use omw_core::mn::CnStatus;
use omw_core::testing::hostile::HostileCn;
use omw_core::wire::message::{AllocRequest, ErrorCode, FreeRequest, Header, Kind};
use omw_core::wire::wqe::Wqe;
use omw_loopback::cluster::{Cluster, CnOpError, CnQp};
use omw_loopback::{host_base, MwState};

const MAX_OPS: usize = 40;
/// Key bytes one guess step tries at most.
const MAX_TRIES: usize = 16;
/// Requests one batch posts at most.
const MAX_BATCH: usize = 12;
/// CN 0 is the attacker; 1 and 2 are honest.
const EVIL: usize = 0;
const CNS: usize = 3;

#[derive(Arbitrary, Debug)]
pub struct Input {
    pub setup: Setup,
    pub knobs: Knobs,
    pub ops: Vec<Step>,
}

#[derive(Arbitrary, Debug, Clone, Copy, Default)]
pub struct Knobs {
    /// Seeds the model's key draws (the mlx5-like counter's start, the rxe-like stream).
    pub key_seed: Option<u64>,
    /// The whole run under an interleaved schedule.
    pub schedule: Option<Schedule>,
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Step {
    Op(Op),
    Guess(Guess),
    /// Requests posted together, then run under `schedule` (else the run's).
    Batch {
        schedule: Option<Schedule>,
        items: Vec<Timed>,
    },
    /// The attacker stops posting receives (and polling); it still sends.
    Stall,
    /// The attacker's host vanishes without a disconnect.
    Vanish,
    /// Modelled time passes (1 µs … 3 leases, 1–4 times), the MN's timer runs.
    Advance(u8),
    /// MN events in the middle of laps: what reaches the MN's group-returning paths (the
    /// tick's audit, quota enforcement, reclaim, the lease's eviction).
    Lap(Lap),
}

/// The attacker's moves against the MN's group-returning paths (`steps`: NIC steps run, the MN
/// not acting, between the requests going out and the MN event).
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Lap {
    /// The attacker allocates through its driver naming `qpn` (an honest CN's QP, a loop QP…)
    /// for its own access window `slot`.
    Misbind { slot: u8, qpn: QpnSel },
    /// The attacker asks for `1 + extra % 4` groups beyond its quota; the counters are sampled.
    OverQuota(u8),
    /// The attacker's alloc request (and an honest CN's free, if any) go out and the MN's
    /// tick — the audit — runs mid-lap.
    AuditMidLap { steps: u8, honest_free: Option<(bool, u8)> },
    /// An honest CN frees while the MN CPU acts between NIC steps (`schedule`) and its tick
    /// (the audit) runs, right after the attacker's request (misbinding if `misbind`).
    FreeDuringAudit { second: bool, which: u8, steps: u8, schedule: Schedule, misbind: Option<(u8, QpnSel)> },
    /// The attacker's host vanishes in the middle of its alloc lap.
    VanishMidLap { steps: u8 },
}

/// The second input format (`regressions/malicious_cn/v2/`): the steps before `Step::Lap`.
#[derive(Arbitrary, Debug)]
pub struct InputV2 {
    pub setup: Setup,
    pub knobs: Knobs,
    pub ops: Vec<StepV2>,
}

#[derive(Arbitrary, Debug, Clone)]
pub enum StepV2 {
    Op(Op),
    Guess(Guess),
    Batch { schedule: Option<Schedule>, items: Vec<Timed> },
    Stall,
    Vanish,
    Advance(u8),
}

impl From<StepV2> for Step {
    fn from(s: StepV2) -> Self {
        match s {
            StepV2::Op(o) => Step::Op(o),
            StepV2::Guess(g) => Step::Guess(g),
            StepV2::Batch { schedule, items } => Step::Batch { schedule, items },
            StepV2::Stall => Step::Stall,
            StepV2::Vanish => Step::Vanish,
            StepV2::Advance(v) => Step::Advance(v),
        }
    }
}

pub fn run_v2(data: &[u8]) -> bool {
    let Ok(v) = InputV2::arbitrary_take_rest(Unstructured::new(data)) else { return false };
    check(&Input { setup: v.setup, knobs: v.knobs, ops: v.ops.into_iter().map(Step::from).collect() });
    true
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct Guess {
    pub index: IndexSel,
    pub addr: AddrSel,
    pub predict: Predict,
    pub verb: Verb,
    pub via: Via,
    pub len: u8,
    /// Key bytes tried (1..=16), moving on after each refusal.
    pub tries: u8,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum IndexSel {
    /// Within ±4 of an index the attacker knows a key of (its own windows, earlier hits).
    NearOwn {
        which: u8,
        delta: i8,
    },
    /// An MN memory region's index (a real attacker scans the small indexes).
    MnMr(u8),
    /// An honest CN's window (its index leaked).
    HonestWindow {
        which: u8,
        q: u8,
    },
    Abs(u16),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum AddrSel {
    /// Inside what the index names: the MR, or the window's binding.
    OfIndex(u32),
    Pool {
        chunk: u8,
        off: u16,
    },
    HonestChunk {
        which: u8,
        off: u16,
    },
    OwnChunk {
        which: u8,
        off: u16,
    },
    Meta(u32),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Verb {
    Read,
    Write,
    FetchAdd,
    CmpSwap,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Via {
    /// The QP its own window of that index is bound to, if it is one (else access QP 0).
    Matching,
    Access(u8),
    Alloc,
    Free,
}

/// One request of a batch.
#[derive(Arbitrary, Debug, Clone)]
pub enum Timed {
    HonestAlloc(bool),
    HonestFree(bool, u8),
    EvilAlloc,
    EvilFree(u8),
    ForgedFree(EntrySel),
    Raw {
        free_qp: bool,
        bytes: Vec<u8>,
    },
    ForgedAlloc {
        token: u32,
        reply_off: u32,
        qpns: [QpnSel; 3],
    },
    /// Let the NIC run this many steps (the MN does not act) before the next request.
    NicSteps(u8),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum QpnSel {
    /// The attacker's own access QPs (MN ends) — what an honest request names.
    Own(u8),
    /// An honest CN's access / Alloc / Free QP (MN end).
    HonestAccess(u8, u8),
    HonestMgmt(u8, bool),
    /// The MN's chain loop QPs of some CN.
    Loop(u8, bool),
    Raw(u32),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum EntrySel {
    /// An honest CN's allocation (its MWTable entry), plus an offset.
    Honest(u8, u8),
    /// Any group's entry, plus an offset.
    Group(u8, u8),
    /// An address in the MN metadata region (queue, table, scratch).
    Meta(u16),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum RkeySel {
    /// An honest CN's rkey for access QP `q` of allocation `which`, with its key byte kept
    /// or replaced (the attacker walks the 256 keys of a known index).
    Honest {
        which: u8,
        q: u8,
        key: Option<u8>,
    },
    Own {
        which: u8,
        q: u8,
    },
    Guess(u32),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Target {
    HonestChunk {
        which: u8,
        off: u16,
    },
    OwnChunk {
        which: u8,
        off: u16,
    },
    /// Somewhere in the pool: chunk index and offset.
    Pool {
        chunk: u8,
        off: u16,
    },
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Op {
    // ---- honest CNs (1 and 2)
    Alloc(bool),
    Free(bool, u8),
    Write {
        second: bool,
        which: u8,
        q: u8,
        off: u8,
        data: Vec<u8>,
    },
    // ---- the attacker
    Bytes {
        free_qp: bool,
        bytes: Vec<u8>,
    },
    AllocReq {
        token: u32,
        reply_off: u32,
        reply_rkey: Option<u32>,
        qpns: [QpnSel; 3],
        cut: Option<u8>,
        extra: u8,
    },
    FreeReq {
        token: u32,
        entry: EntrySel,
        cut: Option<u8>,
        extra: u8,
        on_alloc_qp: bool,
    },
    /// A header of any kind/version on either QP, followed by arbitrary bytes.
    Header {
        kind: u8,
        version: u8,
        free_qp: bool,
        tail: Vec<u8>,
    },
    EvilAlloc,
    EvilFree(u8),
    OneSided {
        write: bool,
        q: u8,
        target: Target,
        rkey: RkeySel,
        len: u8,
    },
    EvilCrash,
    Tick,
    SampleCounters,
}

pub fn run(data: &[u8]) -> bool {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return false };
    check(&input);
    true
}

/// The first input format (a setup and plain ops, no knobs): the regressions saved before the
/// attacker learnt to guess keys, time its requests and go silent (`regressions/malicious_cn/v1/`).
#[derive(Arbitrary, Debug)]
pub struct InputV1 {
    pub setup: Setup,
    pub ops: Vec<Op>,
}

impl From<InputV1> for Input {
    fn from(v: InputV1) -> Self {
        Input { setup: v.setup, knobs: Knobs::default(), ops: v.ops.into_iter().map(Step::Op).collect() }
    }
}

pub fn run_v1(data: &[u8]) -> bool {
    let Ok(input) = InputV1::arbitrary_take_rest(Unstructured::new(data)) else { return false };
    check(&input.into());
    true
}

struct World {
    c: Cluster,
    /// The honest CNs' allocations and the bytes they wrote.
    shadow: Shadow,
    /// The attacker's own allocations (it may scribble on them: no shadow).
    evil: Vec<omw_core::cn::Allocation>,
    guess: Guesser,
    knobs: Knobs,
    /// Modelled time the attacker went silent (stalled or vanished), and the lease-long
    /// advances since.
    silent: Option<(u64, u32)>,
    /// Messages each CN received that the key check has seen.
    seen: [usize; CNS],
    /// Offloaded MN ticks (each runs the audit).
    audits: u64,
}

fn honest(second: bool) -> usize {
    if second {
        2
    } else {
        1
    }
}

fn cluster_err(what: &dyn std::fmt::Debug, e: impl std::fmt::Display) -> ! {
    panic!("cluster operation failed on {what:?}: {e}")
}

/// After this many lease-long advances a silent CN must no longer be served.
const EVICTION_PROBES: u32 = 14;

/// What a run did (for tests that script an attack and check it got somewhere).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Key guesses tried, and how many worked (only ever inside the attacker's own chunks).
    pub guesses: u64,
    pub hits: u64,
    /// The attacker went silent, and the MN evicted it.
    pub silent: bool,
    pub evicted: bool,
    /// MN timer runs in offloaded mode, each of which runs the MN's audit.
    pub audits: u64,
    /// The MN's counters at the end (quota disconnects, groups reclaimed, evictions…).
    pub mn: omw_core::mn::MnStats,
}

pub fn check(input: &Input) -> Report {
    let mut cfg = input.setup.config(CNS);
    if let Some(seed) = input.knobs.key_seed {
        cfg.nic = cfg.nic.with_seed(seed);
    }
    let c = Cluster::new(cfg).unwrap_or_else(|e| panic!("cluster {cfg:?}: {e}"));
    let mut w = World {
        c,
        shadow: Shadow::default(),
        evil: Vec::new(),
        guess: Guesser::default(),
        knobs: input.knobs,
        silent: None,
        seen: [0; CNS],
        audits: 0,
    };
    Schedule::restore(w.knobs.schedule, &mut w.c);
    invariants(&mut w.c, &"setup", &[]);
    for op in input.ops.iter().take(MAX_OPS) {
        step(&mut w, op);
        after_step(&mut w, op);
    }
    // a silent attacker: time passes until the lease evicts it; the others never notice
    if w.silent.is_some() {
        let lease = w.c.driver.mn.config().lease_ns.max(1);
        for _ in 0..EVICTION_PROBES + 2 {
            if !served(&w.c, EVIL) {
                break;
            }
            advance(&mut w, lease / 2, &"final advance");
            after_step(&mut w, &"final advance");
        }
        after_step(&mut w, &"final advance");
        assert!(!served(&w.c, EVIL), "the silent attacker is still served after the lease ran out repeatedly");
        assert_eq!(held_by(&w.c, EVIL), 0, "the evicted attacker still holds groups");
        // and the honest CNs still work: one more allocation each if pool and quota allow
        for i in 1..CNS {
            honest_alloc(&mut w, i, &"after eviction");
        }
        after_step(&mut w, &"after eviction");
    }
    Report {
        guesses: w.guess.tries,
        hits: w.guess.hits,
        silent: w.silent.is_some(),
        evicted: w.c.driver.mn.stats().cns_evicted > 0,
        audits: w.audits,
        mn: w.c.driver.mn.stats(),
    }
}

/// Whether the MN serves CN `i` (it knows it and it is connected).
fn served(c: &Cluster, i: usize) -> bool {
    c.driver.mn.cn(c.cns[i].id).map(|r| r.status) == Some(CnStatus::Active)
}

fn after_step(w: &mut World, op: &dyn std::fmt::Debug) {
    invariants(&mut w.c, op, &[EVIL]);
    conservation(&w.c, op);
    // the attacker's own chunks may come and go (quota, crash); honest ones must not
    let before: Vec<_> = (1..CNS).flat_map(|i| w.shadow.of(i)).collect();
    w.shadow.sync(|cn, a| owned_by(&w.c, cn, a));
    for h in before {
        assert!(
            owned_by(&w.c, h.cn, &h.a),
            "honest cn{} lost its chunk {:#x} after the attacker's {op:?}",
            h.cn,
            h.a.base
        );
    }
    for i in 1..CNS {
        let n = &w.c.cns[i];
        let rec = w.c.driver.mn.cn(n.id).map(|r| r.status);
        assert_eq!(rec, Some(CnStatus::Active), "honest cn{i} lost its connection after {op:?}");
        assert!(!n.events.contains(&ClientEvent::Revoked), "honest cn{i} was told Revoked after {op:?}");
        // what the MN records for it is what it was given (no group held behind its back)
        let (held, known) = (held_by(&w.c, i), w.shadow.of(i).len() as u32);
        assert_eq!(
            held, known,
            "honest cn{i} holds {held} groups by the MN's table, {known} by its own count, after {op:?}"
        );
    }
    let me = w.c.cns[EVIL].id.get();
    let c = &w.c;
    w.evil.retain(|a| {
        c.group_of(a)
            .and_then(|g| c.driver.entry(g))
            .map(|e| e.owner() == me && e.rkey(0) == a.owner_rkey)
            .unwrap_or(false)
    });
    for i in 0..CNS {
        no_key_in_messages(&w.c, i, &mut w.seen[i], op);
    }
    w.guess.learn(&w.c.cns[EVIL].received);
    w.shadow.verify_all(&mut w.c, op);
    if let Some((_, probes)) = w.silent {
        if probes >= EVICTION_PROBES {
            assert!(
                !served(&w.c, EVIL),
                "the silent attacker is still served after {probes} lease periods, after {op:?}"
            );
        }
    }
}

/// An offloaded MN tick runs the audit.
fn count_audit(w: &mut World) {
    w.audits += u64::from(w.c.mode == omw_core::device::ExecutionMode::Offloaded);
}

fn advance(w: &mut World, ns: u64, what: &dyn std::fmt::Debug) {
    if let Err(e) = w.c.advance(ns) {
        cluster_err(what, e);
    }
    count_audit(w);
    let lease = w.c.driver.mn.config().lease_ns.max(1);
    if let Some((_, probes)) = &mut w.silent {
        if ns >= lease / 2 {
            *probes += 1;
        }
    }
}

fn step(w: &mut World, s: &Step) {
    match s {
        Step::Lap(l) => lap(w, *l, s),
        Step::Op(op) => classic(w, op),
        Step::Guess(g) => guess(w, *g),
        Step::Batch { schedule, items } => batch(w, *schedule, items, s),
        Step::Stall => {
            if w.silent.is_none() && !w.c.cns[EVIL].crashed {
                w.c.stall_cn(EVIL);
                w.silent = Some((w.c.now(), 0));
            }
        }
        Step::Vanish => {
            if !w.c.cns[EVIL].crashed {
                if let Err(e) = w.c.vanish_cn(EVIL) {
                    cluster_err(s, e);
                }
                if w.silent.is_none() {
                    w.silent = Some((w.c.now(), 0));
                }
            }
        }
        Step::Advance(v) => {
            let lease = w.c.driver.mn.config().lease_ns.max(2);
            let ns = match v & 7 {
                0 => 1_000,
                1 => 1_000_000,
                2 => 100_000_000,
                3 | 4 => lease / 2,
                5 | 6 => lease,
                _ => 3 * lease,
            };
            for _ in 0..1 + (v >> 4) % 4 {
                advance(w, ns, s);
            }
        }
    }
}

/// One-sided guessing with feedback: the attacker picks a key index (near its own windows'
/// indexes, an MN MR's, an honest window's, or any), an address, and tries key bytes there —
/// the one that last worked, else its prediction, moving on after every refusal.
fn guess(w: &mut World, g: Guess) {
    if w.c.cns[EVIL].crashed {
        return;
    }
    let mrs = w.c.fabric.borrow().mrs_of(w.c.mn_host).unwrap_or_default();
    let honest_all: Vec<_> = (1..CNS).flat_map(|i| w.shadow.of(i)).collect();
    let known = w.guess.known_indexes();
    let geo = w.c.driver.mn.map().geometry;
    let index = match g.index {
        // with nothing known yet, the small indexes (where a device starts counting)
        IndexSel::NearOwn { which, delta } => match known.get(which as usize % known.len().max(1)) {
            // its own windows and their neighbours (the group's other windows, the next groups')
            Some(i) => i.wrapping_add((delta as i32 % 5) as u32) & Rkey::MAX_INDEX,
            None => delta.unsigned_abs() as u32,
        },
        IndexSel::MnMr(k) => match mrs.get(k as usize % mrs.len().max(1)) {
            Some(m) => m.key >> 8,
            None => return,
        },
        IndexSel::HonestWindow { which, q } => match honest_all.get(which as usize % honest_all.len().max(1)) {
            Some(h) => h.a.rkeys[q as usize % h.a.rkeys.len()].index(),
            None => {
                w.c.driver
                    .entry(GroupId(which as u32 % geo.chunk_count()))
                    .map(|e| e.rkey(q as usize % geo.group_size()).index())
                    .unwrap_or(0)
            }
        },
        IndexSel::Abs(i) => i as u32,
    };
    let map = *w.c.driver.mn.map();
    let pool_addr = |chunk: u8, off: u16| {
        geo.chunk_base(GroupId(chunk as u32 % geo.chunk_count())).unwrap_or(0) + off as u64 % geo.chunk_size()
    };
    let atomic = matches!(g.verb, Verb::FetchAdd | Verb::CmpSwap);
    let len = if atomic { 8 } else { 1 + g.len as u64 % 64 };
    let addr = match g.addr {
        AddrSel::OfIndex(off) => {
            if let Some(m) = mrs.iter().find(|m| m.key >> 8 == index) {
                m.addr + off as u64 % m.len.max(1)
            } else {
                let bound = w.c.fabric.borrow().mw_binding(w.c.mn_host, index).map(|i| i.state);
                match bound {
                    Some(MwState::Bound(b)) => b.addr + off as u64 % b.len.max(1),
                    _ => pool_addr(0, off as u16),
                }
            }
        }
        AddrSel::Pool { chunk, off } => pool_addr(chunk, off),
        AddrSel::HonestChunk { which, off } => match honest_all.get(which as usize % honest_all.len().max(1)) {
            Some(h) => h.a.base + off as u64 % h.a.length,
            None => pool_addr(which, off),
        },
        AddrSel::OwnChunk { which, off } => match w.evil.get(which as usize % w.evil.len().max(1)) {
            Some(a) => a.base + off as u64 % (2 * a.length),
            None => pool_addr(which, off),
        },
        AddrSel::Meta(o) => map.meta_base + o as u64 % map.meta_len.max(1),
        AddrSel::Raw(a) => a,
    };
    let addr = if atomic { addr & !7 } else { addr };
    let via = match g.via {
        // the QP the attacker's own window of that index is for (MW[0]: the Free QP)
        Via::Matching => w
            .evil
            .iter()
            .find_map(|a| {
                if a.owner_rkey.index() == index {
                    Some(CnQp::Free)
                } else {
                    a.rkeys.iter().position(|r| r.index() == index).map(CnQp::Access)
                }
            })
            .unwrap_or(CnQp::Access(0)),
        Via::Access(k) => CnQp::Access(k as usize % w.c.cns[EVIL].access_qps.len()),
        Via::Alloc => CnQp::Alloc,
        Via::Free => CnQp::Free,
    };
    for _ in 0..1 + g.tries as usize % MAX_TRIES {
        if w.c.cns[EVIL].crashed {
            return;
        }
        let rk = w.guess.next(index, g.predict);
        let wqe = match g.verb {
            Verb::Read => Wqe::read(0, 0, len as u32, addr, rk.0),
            Verb::Write => Wqe::write(0, 0, len as u32, addr, rk.0),
            Verb::FetchAdd => Wqe::fetch_add(0, 0, addr, rk.0, 1),
            Verb::CmpSwap => Wqe::compare_swap(0, 0, addr, rk.0, 0, 0xEE),
        };
        let allowed = inside_own_chunk(&w.c, EVIL, addr, len);
        let st = w.c.cn_post(EVIL, via, wqe);
        let worked = st == WcStatus::Success;
        w.guess.feedback(rk, worked);
        if worked && !allowed {
            panic!(
                "the attacker's guessed {rk:?} worked: {:?} of {len} bytes at {addr:#x} through its {via:?} QP reached {}",
                g.verb,
                describe_mn_addr(&w.c, addr, len)
            );
        }
        // refused: the QP was reset (the attacker reconnected); the next try moves on
    }
}

/// The attacker times its requests: several CNs' requests are posted together (with NIC steps
/// run between them where the input says), then run to completion under the input's
/// interleaving of NIC steps and MN CPU actions.
fn batch(w: &mut World, schedule: Option<Schedule>, items: &[Timed], what: &Step) {
    if let Some(s) = schedule {
        s.apply(&mut w.c);
    }
    let quota = w.c.cfg.quota;
    let free0 = w.c.free_groups();
    let empty0 = w.c.driver.mn.is_empty_state();
    let mut tokens: Vec<(usize, u32, bool)> = Vec::new();
    let mut freed: Vec<Held> = Vec::new();
    let mut evil_token: Option<u32> = None;
    // requests in this batch that may take a group from the queue
    let mut pops = 0u32;
    let evil_live = |w: &World| !w.c.cns[EVIL].crashed;
    for it in items.iter().take(MAX_BATCH) {
        match it.clone() {
            Timed::HonestAlloc(second) => {
                let i = honest(second);
                if tokens.iter().any(|(j, ..)| *j == i) || held_by(&w.c, i) >= quota {
                    continue;
                }
                let backing_off = w.c.cns[i].client().is_backing_off(w.c.now());
                if let Ok(t) = w.c.alloc_begin(i) {
                    tokens.push((i, t, backing_off));
                    pops += 1;
                }
            }
            Timed::HonestFree(second, which) => {
                let i = honest(second);
                // several frees in flight per honest CN, on its one free chain: each lap
                // publishes the next receive only once it is done with the last
                // (`ChainEnv::posts_receives`), so every one of them lands
                let mine: Vec<Held> = w
                    .shadow
                    .of(i)
                    .into_iter()
                    .filter(|h| !freed.iter().any(|f| f.a.entry_addr == h.a.entry_addr))
                    .collect();
                if mine.is_empty() {
                    continue;
                }
                let h = mine[which as usize % mine.len()].clone();
                assert_eq!(w.c.free_begin(i, &h.a), Ok(()), "honest cn{i} could not post its free");
                freed.push(h);
            }
            Timed::EvilAlloc => {
                if evil_live(w) && evil_token.is_none() {
                    if let Ok(t) = w.c.alloc_begin(EVIL) {
                        evil_token = Some(t);
                        pops += 1;
                    }
                }
            }
            Timed::EvilFree(which) => {
                if evil_live(w) && !w.evil.is_empty() {
                    let a = w.evil[which as usize % w.evil.len()].clone();
                    let _ = w.c.free_begin(EVIL, &a);
                }
            }
            Timed::ForgedFree(e) => {
                if evil_live(w) {
                    let addr = entry(w, e);
                    let _ = w.c.free_raw_begin(EVIL, addr);
                }
            }
            Timed::Raw { free_qp, bytes } => {
                if evil_live(w) {
                    let kind = if free_qp { ChainKind::Free } else { ChainKind::Alloc };
                    let b: Vec<u8> = bytes.into_iter().take(96).collect();
                    let _ = w.c.send_raw_begin(EVIL, kind, &b);
                    pops += u32::from(!free_qp);
                }
            }
            Timed::ForgedAlloc { token, reply_off, qpns } => {
                if evil_live(w) {
                    let b = forged_alloc(w, token, reply_off, None, qpns);
                    let _ = w.c.send_raw_begin(EVIL, ChainKind::Alloc, &b);
                    pops += 1;
                }
            }
            Timed::NicSteps(n) => {
                w.c.fabric.borrow_mut().run_until_idle(u64::from(n % 48));
            }
        }
    }
    if let Err(e) = w.c.pump() {
        cluster_err(what, e);
    }
    Schedule::restore(w.knobs.schedule, &mut w.c);
    // honest frees land, whatever the attacker sent around them
    for h in freed {
        assert!(!owned_by(&w.c, h.cn, &h.a), "honest cn{}'s free of {:#x} did not land, in {what:?}", h.cn, h.a.base);
        w.shadow.forget(&h);
    }
    for (i, t, backing_off) in tokens {
        match w.c.alloc_take(i, t) {
            Ok(a) => {
                assert!(
                    owned_by(&w.c, i, &a),
                    "honest cn{i} got a chunk the MN does not record as its own, in {what:?}"
                );
                reads_zero(&mut w.c, i, &a, what);
                w.shadow.adopt(i, a);
            }
            // a contended pool: refused for now. (Offloaded: when the pool ran dry only because
            // another CN's failing lap held a group, the honest request is told `AllocFailed`,
            // not `Empty` — retryable, and nothing is lost; see fuzz/README.md.)
            Err(CnOpError::Mn(ErrorCode::Empty | ErrorCode::AllocFailed))
            | Err(CnOpError::Client(ClientError::Backoff { .. }))
            | Err(CnOpError::NoReply)
            | Err(CnOpError::Cn(CnError::SlotsBusy))
                if free0 <= pops || empty0 || backing_off => {}
            Err(e) => panic!(
                "honest cn{i} could not allocate ({e}) with {free0} free groups for {pops} requests, in {what:?}"
            ),
        }
    }
    if let Some(t) = evil_token {
        if let Ok(a) = w.c.alloc_take(EVIL, t) {
            adopt_evil(w, a, what);
        }
    }
}

fn adopt_evil(w: &mut World, a: omw_core::cn::Allocation, what: &dyn std::fmt::Debug) {
    if owned_by(&w.c, EVIL, &a) {
        reads_zero(&mut w.c, EVIL, &a, what);
        w.evil.push(a);
    }
}

fn forged_alloc(w: &World, token: u32, reply_off: u32, reply_rkey: Option<u32>, qpns: [QpnSel; 3]) -> Vec<u8> {
    let c = &w.c;
    let n = c.cns[EVIL].mn_qps.access.len();
    let access = qpns.iter().take(n).map(|s| Qpn::new(qpn(w, *s) & Qpn::MAX).unwrap_or_default()).collect();
    let host = c.cns[EVIL].host;
    let reply_addr = host_base(host.0) + reply_off as u64 % (2 << 20);
    let rkey = reply_rkey.unwrap_or_else(|| c.fabric.borrow().ring_keys(host).map(|k| k.rkey).unwrap_or(0));
    let req = AllocRequest { token, reply_addr, reply_rkey: rkey, access_qpns: access };
    let mut b = [0u8; 64];
    let len = req.encode(&mut b).unwrap_or(0);
    b[..len].to_vec()
}

fn qpn(w: &World, s: QpnSel) -> u32 {
    let c = &w.c;
    let pick = |v: &[Qpn], k: u8| v.get(k as usize % v.len().max(1)).map(|q| q.get()).unwrap_or(0);
    match s {
        QpnSel::Own(k) => pick(&c.cns[EVIL].mn_qps.access, k),
        QpnSel::HonestAccess(h, k) => pick(&c.cns[1 + h as usize % 2].mn_qps.access, k),
        QpnSel::HonestMgmt(h, free) => {
            let q = &c.cns[1 + h as usize % 2].mn_qps;
            if free {
                q.free.get()
            } else {
                q.alloc.get()
            }
        }
        QpnSel::Loop(h, free) => {
            let q = &c.cns[h as usize % CNS].mn_qps;
            (if free { q.free_loop } else { q.alloc_loop }).map(|q| q.get()).unwrap_or(0)
        }
        QpnSel::Raw(v) => v,
    }
}

fn entry(w: &World, e: EntrySel) -> u64 {
    let map = *w.c.driver.mn.map();
    let group = |g: u8| map.entry_addr(GroupId(g as u32 % map.geometry.chunk_count())).unwrap_or(0);
    match e {
        EntrySel::Honest(k, d) => {
            let all: Vec<_> = (1..CNS).flat_map(|i| w.shadow.of(i)).collect();
            if all.is_empty() {
                group(k) + d as u64
            } else {
                all[k as usize % all.len()].a.entry_addr + d as u64
            }
        }
        EntrySel::Group(g, d) => group(g) + d as u64,
        EntrySel::Meta(o) => map.meta_base + o as u64 % map.meta_len,
        EntrySel::Raw(v) => v,
    }
}

fn shape(mut b: Vec<u8>, cut: Option<u8>, extra: u8) -> Vec<u8> {
    if let Some(n) = cut {
        b.truncate(n as usize % (b.len() + 1));
    }
    b.extend(std::iter::repeat_n(0xA5, extra as usize % 9));
    b
}

fn send(w: &mut World, free_qp: bool, bytes: &[u8], op: &Op) {
    if w.c.cns[EVIL].crashed {
        return;
    }
    let kind = if free_qp { ChainKind::Free } else { ChainKind::Alloc };
    if let Err(e) = w.c.send_raw(EVIL, kind, bytes) {
        cluster_err(op, e);
    }
}

fn classic(w: &mut World, op: &Op) {
    match op.clone() {
        Op::Alloc(second) => honest_alloc(w, honest(second), op),
        Op::Free(second, which) => {
            let i = honest(second);
            let Some(h) = w.shadow.pick(i, which as usize) else { return };
            assert_eq!(w.c.free(i, &h.a), Ok(()), "honest cn{i} could not free its chunk {:#x}", h.a.base);
            assert!(!owned_by(&w.c, i, &h.a), "freed chunk still owned");
            w.shadow.forget(&h);
        }
        Op::Write { second, which, q, off, data } => {
            let i = honest(second);
            let Some(h) = w.shadow.pick(i, which as usize) else { return };
            let q = q as usize % h.a.rkeys.len();
            let data: Vec<u8> = data.into_iter().take(64).collect();
            if data.is_empty() {
                return;
            }
            let off = off as u64 % (h.bytes.len() as u64);
            let st = w.c.write(i, &h.a, q, off, &data);
            assert_eq!(st, WcStatus::Success, "honest cn{i} could not write its chunk");
            w.shadow.record_write(&h, off as usize, &data);
        }
        Op::Bytes { free_qp, bytes } => {
            let b: Vec<u8> = bytes.into_iter().take(96).collect();
            send(w, free_qp, &b, op);
        }
        Op::AllocReq { token, reply_off, reply_rkey, qpns, cut, extra } => {
            let bytes = shape(forged_alloc(w, token, reply_off, reply_rkey, qpns), cut, extra);
            send(w, false, &bytes, op);
        }
        Op::FreeReq { token, entry: e, cut, extra, on_alloc_qp } => {
            let bytes = FreeRequest { token, entry_addr: entry(w, e) }.encode();
            let bytes = shape(bytes.to_vec(), cut, extra);
            send(w, !on_alloc_qp, &bytes, op);
        }
        Op::Header { kind, version, free_qp, tail } => {
            let mut h = Header::new(Kind::AllocRequest, 1);
            h.kind = kind % 9;
            h.version = version % 3;
            let mut b = zerocopy::IntoBytes::as_bytes(&h).to_vec();
            b.extend(tail.into_iter().take(64));
            send(w, free_qp, &b, op);
        }
        Op::EvilAlloc => {
            if !w.c.cns[EVIL].crashed {
                if let Ok(a) = w.c.alloc(EVIL) {
                    adopt_evil(w, a, op);
                }
            }
        }
        Op::EvilFree(which) => {
            if !w.evil.is_empty() {
                let a = w.evil.remove(which as usize % w.evil.len());
                let _ = w.c.free(EVIL, &a);
            }
        }
        Op::OneSided { write, q, target, rkey, len } => one_sided(w, write, q, target, rkey, len),
        Op::EvilCrash => {
            if !w.c.cns[EVIL].crashed {
                if let Err(e) = w.c.crash_cn(EVIL) {
                    cluster_err(op, e);
                }
            }
        }
        Op::Tick => {
            if let Err(e) = w.c.tick() {
                cluster_err(op, e);
            }
            count_audit(w);
        }
        Op::SampleCounters => {
            if let Err(e) = w.c.sample_counters() {
                cluster_err(op, e);
            }
        }
    }
}

fn one_sided(w: &mut World, write: bool, q: u8, target: Target, rkey: RkeySel, len: u8) {
    if w.c.cns[EVIL].crashed {
        return;
    }
    let honest_all: Vec<_> = (1..CNS).flat_map(|i| w.shadow.of(i)).collect();
    let own = w.evil.clone();
    let pick = |v: &[crate::sim::Held], k: u8| (!v.is_empty()).then(|| v[k as usize % v.len()].clone());
    let pick_own = |k: u8| (!own.is_empty()).then(|| own[k as usize % own.len()].clone());
    let geo = w.c.driver.mn.map().geometry;
    let addr = match target {
        Target::HonestChunk { which, off } => match pick(&honest_all, which) {
            Some(h) => h.a.base + off as u64 % h.a.length,
            None => return,
        },
        Target::OwnChunk { which, off } => match pick_own(which) {
            Some(a) => a.base + off as u64 % (2 * a.length),
            None => return,
        },
        Target::Pool { chunk, off } => {
            geo.chunk_base(GroupId(chunk as u32 % geo.chunk_count())).unwrap_or(0) + off as u64 % geo.chunk_size()
        }
        Target::Raw(a) => a,
    };
    let rk = match rkey {
        RkeySel::Honest { which, q, key } => match pick(&honest_all, which) {
            Some(h) => {
                let r = h.a.rkey(q as usize % h.a.rkeys.len()).unwrap_or_default();
                match key {
                    Some(k) => Rkey::new(r.index(), k).unwrap_or(r),
                    None => r,
                }
            }
            None => return,
        },
        RkeySel::Own { which, q } => match pick_own(which) {
            Some(a) => a.rkey(q as usize % a.rkeys.len()).unwrap_or_default(),
            None => return,
        },
        RkeySel::Guess(v) => Rkey(v),
    };
    let q = q as usize % w.c.cns[EVIL].access_qps.len();
    let len = 1 + len as u64 % 64;
    let allowed = inside_own_chunk(&w.c, EVIL, addr, len);
    let st = if write {
        w.c.write_raw(EVIL, q, addr, rk, &[0xEE; 64][..len as usize])
    } else {
        w.c.read_raw(EVIL, q, addr, rk, len as usize).0
    };
    if st == WcStatus::Success && !allowed {
        panic!(
            "the attacker's {rk:?} worked (write: {write}) on {len} bytes at {addr:#x}: {}",
            describe_mn_addr(&w.c, addr, len)
        );
    }
}

fn honest_alloc(w: &mut World, i: usize, op: &dyn std::fmt::Debug) {
    let c = &w.c;
    let quota = c.cfg.quota;
    let held = crate::sim::held_by(c, i);
    if held >= quota {
        return; // an honest client keeps to the quota its connect info told it
    }
    let free = c.free_groups();
    let backing_off = c.cns[i].client().is_backing_off(c.now());
    let empty_state = c.driver.mn.is_empty_state();
    let bad = |c: &omw_loopback::cluster::Cluster| c.driver.mn.cn(c.cns[i].id).map_or(0, |r| r.bad_requests);
    let bad_before = bad(c);
    match w.c.alloc(i) {
        Ok(a) => {
            assert!(owned_by(&w.c, i, &a), "honest cn{i} got a chunk the MN does not record as its own");
            reads_zero(&mut w.c, i, &a, op);
            w.shadow.adopt(i, a);
        }
        // an empty pool parks the alloc chain (offloaded: the request finds no receive)
        // …and the requests it sends meanwhile queue behind the parked one, until the CN
        // driver's send slots are all in flight
        Err(CnOpError::Mn(ErrorCode::Empty))
        | Err(CnOpError::Client(ClientError::Backoff { .. }))
        | Err(CnOpError::NoReply)
        | Err(CnOpError::Cn(CnError::SlotsBusy))
            if free == 0 || empty_state || backing_off => {}
        // on an empty queue the lap's empty probe fails as designed; a push (the MN reclaiming
        // a vanished CN's group, a free) that fills the lap's ticket slot before the MN repairs
        // it makes the repair move that group to the tail and answer "failed, retry" — the
        // group must then be in the queue
        Err(CnOpError::Mn(ErrorCode::AllocFailed)) if free == 0 && w.c.free_groups() > 0 => {
            assert_eq!(bad(&w.c), bad_before, "honest cn{i}'s raced empty probe counted as a bad request");
        }
        Err(e) => panic!(
            "honest cn{i} could not allocate ({e}) with {free} free groups, {held}/{quota} held, empty={empty_state}, after {op:?}"
        ),
    }
}

fn nic_steps(w: &mut World, steps: u8) {
    for _ in 0..steps % 64 {
        if w.c.fabric.borrow_mut().step().is_none() {
            break;
        }
    }
}

/// The attacker's own access QPNs (MN ends) with window `slot`'s replaced by `sel`'s.
fn misbound_qpns(w: &World, slot: u8, sel: QpnSel) -> Vec<Qpn> {
    let mut q: Vec<Qpn> = w.c.cns[EVIL].mn_qps.access.iter().copied().collect();
    let k = slot as usize % q.len();
    q[k] = Qpn::new(qpn(w, sel) & Qpn::MAX).unwrap_or_default();
    q
}

/// An honest CN frees one of its chunks; the free must land, whatever ran around it.
fn honest_free_lands(w: &mut World, h: &Held, what: &dyn std::fmt::Debug) {
    assert!(!owned_by(&w.c, h.cn, &h.a), "honest cn{}'s free of {:#x} did not land, in {what:?}", h.cn, h.a.base);
    w.shadow.forget(h);
}

fn lap(w: &mut World, l: Lap, what: &Step) {
    let evil_live = !w.c.cns[EVIL].crashed;
    match l {
        Lap::Misbind { slot, qpn: sel } => {
            if evil_live {
                let q = misbound_qpns(w, slot, sel);
                // offloaded: bound to whatever it named (the audit reclaims it, or the
                // attacker frees it: `sim::invariants`); host engine: refused (`ForeignQpn`)
                let _ = w.c.alloc_naming(EVIL, &q);
            }
        }
        Lap::OverQuota(extra) => {
            if !evil_live || !served(&w.c, EVIL) {
                return;
            }
            let quota = w.c.cfg.quota;
            for _ in 0..quota.saturating_sub(held_by(&w.c, EVIL)) + 1 + extra as u32 % 4 {
                if let Ok(a) = w.c.alloc(EVIL) {
                    adopt_evil(w, a, what);
                }
            }
            if let Err(e) = w.c.sample_counters() {
                cluster_err(what, e);
            }
            // counted in the table at most once per audit pass (issue 23): if it was counted
            // earlier in this pass, the pass's end catches it
            if held_by(&w.c, EVIL) > quota && served(&w.c, EVIL) {
                if let Err(e) = crate::sim::through_audit_passes(&mut w.c, 2) {
                    cluster_err(what, e);
                }
            }
            let held = held_by(&w.c, EVIL);
            assert!(held <= quota || !served(&w.c, EVIL), "the attacker holds {held} > {quota} groups and is served");
        }
        Lap::AuditMidLap { steps, honest_free } => {
            let token = if evil_live { w.c.alloc_begin(EVIL).ok() } else { None };
            let freed = honest_free.and_then(|(second, which)| {
                let i = honest(second);
                let h = w.shadow.pick(i, which as usize)?;
                assert_eq!(w.c.free_begin(i, &h.a), Ok(()), "honest cn{i} could not post its free");
                Some(h)
            });
            nic_steps(w, steps);
            if let Err(e) = w.c.tick() {
                cluster_err(what, e);
            }
            count_audit(w);
            if let Some(h) = freed {
                honest_free_lands(w, &h, what);
            }
            if let Some(t) = token {
                if let Ok(a) = w.c.alloc_take(EVIL, t) {
                    adopt_evil(w, a, what);
                }
            }
        }
        Lap::FreeDuringAudit { second, which, steps, schedule, misbind } => {
            let i = honest(second);
            let Some(h) = w.shadow.pick(i, which as usize) else { return };
            schedule.apply(&mut w.c);
            if let (true, Some((slot, sel))) = (evil_live, misbind) {
                let q = misbound_qpns(w, slot, sel);
                let now = w.c.now();
                let _ = HostileCn::alloc_naming(&mut w.c.cns[EVIL].driver, now, &q);
            }
            assert_eq!(w.c.free_begin(i, &h.a), Ok(()), "honest cn{i} could not post its free");
            nic_steps(w, steps);
            let t = w.c.tick();
            count_audit(w);
            Schedule::restore(w.knobs.schedule, &mut w.c);
            if let Err(e) = t.and_then(|_| w.c.pump().map(|_| ())) {
                cluster_err(what, e);
            }
            honest_free_lands(w, &h, what);
        }
        Lap::VanishMidLap { steps } => {
            if !evil_live || w.c.alloc_begin(EVIL).is_err() {
                return;
            }
            nic_steps(w, steps);
            if let Err(e) = w.c.vanish_cn(EVIL) {
                cluster_err(what, e);
            }
            // the rest of the lap runs against a host that is gone
            if let Err(e) = w.c.pump() {
                cluster_err(what, e);
            }
            if w.silent.is_none() {
                w.silent = Some((w.c.now(), 0));
            }
        }
    }
}
