//! Differential test: the loopback RNIC model in rxe-compatible mode against real soft-RoCE.
//!
//! The same seeded random sequences of memory-window operations — bind, READ/WRITE through the
//! bound pair and through others, with current, stale, MR and garbage keys, inside the window,
//! past its end, past the MR; LOCAL_INV from the bound QP and from others; SEND_WITH_INV;
//! rebind; QP resets — run in lockstep on both devices through the same interpreter, written
//! against `RdmaBackend` only. Per operation we record the completion status(es), the bytes a
//! successful READ returned and the state of every QP, and compare. A disagreement is a bug in
//! the model or a deviation DESIGN.md §3 does not list yet.
//!
//! Setup per sequence, identical on both devices: one host, a 16 KiB pool MR registered with
//! LOCAL_WRITE | MW_BIND only (no remote rights of its own) inside a 32 KiB region, a requester
//! buffer MR, [`WINDOWS`] type-2 windows and [`PAIRS`] RC QP pairs (rxe: raw loopback pairs on
//! rxe0; model: two QPs of one host). Side A / side B name the two QPs of a pair; a window bound
//! to one side is reached by READ/WRITE posted on the other side.
//!
//! The real device needs care (DESIGN.md §6.2), which the interpreter takes on both devices:
//! - a remote access error puts both QPs in ERR: after each operation every pair that is not
//!   RTS/RTS is reset (`reset_qp`), unless the operation is marked `linger`, so the next one
//!   also exercises posting on an errored QP;
//! - rxe dereferences NULL when a window that is not bound is invalidated (LOCAL_INV or a
//!   received SEND_WITH_INV): an invalidation is posted only when the window is bound according
//!   to both the interpreter's shadow (updated from completions) and the verbs backend's own
//!   tracking; otherwise the operation is recorded as skipped. The shadow is checked against
//!   the device's view of every window after every operation;
//! - a process exiting with a type-2 window bound stalls ~51 s: each sequence ends by
//!   invalidating every bound window through its bound QP (those operations are compared too).
//!
//! What this test found rxe doing that the model (rxe-compatible) does not: [`KNOWN`] lists
//! what is compared and tolerated (counted and printed, the sequence goes on), the `SKIP_*`
//! notes what is not posted at all because rxe never completes it.
//!
//! Skipped unless OMW_RXE is set (scripts/verbs-ci, or `OMW_RXE=1 scripts/rxe-test -p omw-verbs
//! --test rxe_differential -- --nocapture`). OMW_DIFF_SEQS, OMW_DIFF_OPS and OMW_DIFF_SEED change the defaults
//! (120 sequences × 60 operations, seed 0x0D1F_F5EE_D000_0001; ~11 s in the VM); see
//! [`mw_ops_on_errored_qps`] for OMW_DIFF_ERRORED_MW_OPS. The model-only test below runs
//! everywhere and checks the interpreter's shadow against the model.

mod common;
use common::*;
use omw_core::access::AccessFlags;
use omw_core::device::{Completion, Domain, MwBinding, QpState, RdmaBackend, WcStatus};
use omw_core::ids::{Qpn, Rkey};
use omw_core::wire::wqe::{QueueSel, RecvWqe, Sge, Wqe, WqeFlags};
use omw_loopback::{Fabric, HostId, HostView, NicConfig, QpConfig};
use omw_verbs::VerbsBackend;
use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

const PAIRS: usize = 3;
const WINDOWS: usize = 3;
/// The pool MR; the region behind it is twice as large, so "past the MR" is mapped memory.
const POOL: u64 = 16 << 10;
const BUF: u64 = 16 << 10;
const RECV_OFF: u64 = 8 << 10;
const SEND_OFF: u64 = 12 << 10;
const GARBAGE_RKEY: Rkey = Rkey(0xF000_005A);
const DEFAULT_SEED: u64 = 0x0D1F_F5EE_D000_0001;
const SEQS: u64 = 120;
const OPS: u64 = 60;

/// Whether BIND_MW / LOCAL_INV are also posted on a QP already in ERR (both devices flush
/// them, with the same status); OMW_DIFF_ERRORED_MW_OPS=0 turns it off. Before b10508e the
/// verbs backend did not roll its window tracking back when such a work request was flushed
/// (`settle` undid only the WRs pending at a QP's *first* error): a flushed bind left it
/// believing the window bound under the new key, its next bind passed that key as the handle
/// and rxe refused it (MW_BIND_ERR) — this test found it.
fn mw_ops_on_errored_qps() -> bool {
    std::env::var_os("OMW_DIFF_ERRORED_MW_OPS").is_none_or(|v| v != "0")
}

/// Measured rxe behaviour that the model in rxe-compatible mode does not reproduce. An outcome
/// pair matching one of these is counted (and printed), not failed; both devices' pairs are
/// then reset and the sequence goes on. Everything else that differs fails the test.
struct Known {
    name: &'static str,
    why: &'static str,
    matches: fn(&Outcome, &Outcome) -> bool,
}

/// Empty: the two deviations this test found — a refused LOCAL_INV completes LOC_QP_OP_ERR on rxe
/// (not MW_BIND_ERR), and a SEND_WITH_INV whose invalidation fails errors only the receiver
/// while the SEND completes SUCCESS — are now reproduced by the model's rxe-compatible mode
/// (backend-loopback/src/exec.rs). New ones go here, each with the measurement behind it.
const KNOWN: &[Known] = &[];

// ------------------------------------------------------------------------------------ RNG

/// The core's seeded generator, with the draws the schedule needs.
struct Rng(omw_core::rng::SeededRng);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(omw_core::rng::SeededRng::new(seed))
    }
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }
    fn u8(&mut self) -> u8 {
        self.next() as u8
    }
    /// True with probability `pct` %.
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
    fn side(&mut self) -> Side {
        if self.next() & 1 == 0 {
            Side::A
        } else {
            Side::B
        }
    }
    fn qp(&mut self) -> Via {
        Via::Qp(self.below(PAIRS as u64) as u8, self.side())
    }
}

// ------------------------------------------------------------------------------------ operations

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    A,
    B,
}

impl Side {
    fn other(self) -> Side {
        match self {
            Side::A => Side::B,
            Side::B => Side::A,
        }
    }
}

/// Which window, resolved against the device's current state (identical on both devices as
/// long as they agreed so far).
#[derive(Clone, Copy, Debug)]
enum Win {
    Any(u8),
    /// The k-th bound window (any window if none is bound).
    Bound(u8),
    /// The k-th unbound window (any window if all are bound).
    Unbound(u8),
}

#[derive(Clone, Copy, Debug)]
enum Key {
    Current(Win),
    /// A key the window had before (or, never rebound, the key just below its current one).
    Stale(Win, u8),
    /// The pool MR's own rkey (it has no remote rights).
    PoolMr,
    Garbage,
}

/// Which QP, relative to the window's binding where it has one.
#[derive(Clone, Copy, Debug)]
enum Via {
    /// The QP the window is bound to (unbound: pair `window % PAIRS`, side A).
    BoundQp,
    /// Its peer (unbound: pair `window % PAIRS`, side B).
    BoundPeer,
    Qp(u8, Side),
}

#[derive(Clone, Copy, Debug)]
enum Off {
    /// Inside the window's range (its current or last binding).
    InWindow(u16),
    /// Starting right at the window's end (still inside the MR when there is room).
    PastWindow,
    /// Straddling the pool MR's end.
    PastMr,
    Raw(u16),
}

#[derive(Clone, Copy, Debug)]
enum BindLen {
    Units(u8),
    Zero,
    BeyondMr,
}

#[derive(Clone, Copy, Debug)]
enum Op {
    /// BIND_MW posted on `on`, new key = `ibv_inc_rkey(current)`, range in 256 B units.
    Bind {
        win: Win,
        on: Via,
        off: u8,
        len: BindLen,
        read_only: bool,
    },
    Access {
        write: bool,
        key: Key,
        via: Via,
        off: Off,
        len: u32,
    },
    /// LOCAL_INV posted on `via` (skipped when the window is not bound).
    Invalidate {
        win: Win,
        via: Via,
        stale: bool,
    },
    /// SEND_WITH_INV received by `recv` from its peer (skipped when the window is not bound).
    SendInv {
        win: Win,
        recv: Via,
        stale: bool,
    },
    Reset {
        pair: u8,
    },
}

impl Op {
    fn kind(&self) -> &'static str {
        match self {
            Op::Bind { len: BindLen::Zero, .. } => "bind-zero-length",
            Op::Bind { len: BindLen::BeyondMr, .. } => "bind-beyond-mr",
            Op::Bind { .. } => "bind",
            Op::Access { write: false, .. } => "read",
            Op::Access { write: true, .. } => "write",
            Op::Invalidate { stale: true, .. } => "local-inv-stale",
            Op::Invalidate { .. } => "local-inv",
            Op::SendInv { stale: true, .. } => "send-with-inv-stale",
            Op::SendInv { .. } => "send-with-inv",
            Op::Reset { .. } => "reset",
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Step {
    op: Op,
    /// Do not reset errored pairs after this operation.
    linger: bool,
}

fn gen_step(r: &mut Rng) -> Step {
    let linger = r.chance(10);
    let op = match r.below(100) {
        0..=21 => Op::Bind {
            win: if r.chance(75) { Win::Unbound(r.u8()) } else { Win::Any(r.u8()) },
            on: r.qp(),
            off: r.below(48) as u8,
            len: match r.below(25) {
                0 => BindLen::Zero,
                1 => BindLen::BeyondMr,
                _ => BindLen::Units(1 + r.below(16) as u8),
            },
            read_only: r.chance(20),
        },
        22..=66 => Op::Access {
            write: r.chance(50),
            key: match r.below(20) {
                0..=12 => Key::Current(Win::Bound(r.u8())),
                13..=14 => Key::Current(Win::Any(r.u8())),
                15..=17 => Key::Stale(Win::Any(r.u8()), r.u8()),
                18 => Key::PoolMr,
                _ => Key::Garbage,
            },
            via: match r.below(10) {
                0..=6 => Via::BoundPeer,
                7 => Via::BoundQp,
                _ => r.qp(),
            },
            off: match r.below(10) {
                0..=6 => Off::InWindow(r.next() as u16),
                7 => Off::PastWindow,
                8 => Off::PastMr,
                _ => Off::Raw(r.next() as u16),
            },
            len: [0, 8, 8, 64, 64, 256, 1024][r.below(7) as usize],
        },
        67..=82 => Op::Invalidate {
            win: if r.chance(85) { Win::Bound(r.u8()) } else { Win::Any(r.u8()) },
            via: match r.below(10) {
                0..=6 => Via::BoundQp,
                7 => Via::BoundPeer,
                _ => r.qp(),
            },
            stale: r.chance(15),
        },
        83..=92 => Op::SendInv {
            win: Win::Bound(r.u8()),
            recv: match r.below(10) {
                0..=5 => Via::BoundQp,
                6..=7 => Via::BoundPeer,
                _ => r.qp(),
            },
            stale: r.chance(15),
        },
        _ => Op::Reset { pair: r.below(PAIRS as u64) as u8 },
    };
    Step { op, linger }
}

fn gen_sequence(seed: u64, n: usize) -> Vec<Step> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| gen_step(&mut r)).collect()
}

// ------------------------------------------------------------------------------------ devices

/// What the interpreter needs beyond the backend contract: how to let time pass.
trait Dut: RdmaBackend {
    fn idle(&mut self);
    /// How long to wait for a completion before recording "none".
    fn patience(&self) -> Duration;
}

impl Dut for VerbsBackend {
    fn idle(&mut self) {
        std::hint::spin_loop();
    }
    fn patience(&self) -> Duration {
        Duration::from_secs(5)
    }
}

impl Dut for HostView<'_> {
    fn idle(&mut self) {
        // a pending timer (retry, RNR) fires only when modelled time passes
        let f = self.fabric();
        let t = f.now() + 1_000_000;
        f.advance_to(t);
    }
    fn patience(&self) -> Duration {
        Duration::from_millis(200)
    }
}

/// Addresses and keys of one device's setup.
#[derive(Clone, Debug)]
struct Rig {
    pool: u64,
    pool_lkey: u32,
    pool_rkey: u32,
    buf: u64,
    buf_lkey: u32,
    pairs: Vec<(Qpn, Qpn)>,
}

impl Rig {
    fn qp(&self, pair: usize, side: Side) -> Qpn {
        let p = self.pairs[pair % PAIRS];
        match side {
            Side::A => p.0,
            Side::B => p.1,
        }
    }
    fn locate(&self, q: Qpn) -> Option<(usize, Side)> {
        self.pairs.iter().enumerate().find_map(|(i, p)| {
            if p.0 == q {
                Some((i, Side::A))
            } else if p.1 == q {
                Some((i, Side::B))
            } else {
                None
            }
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Binding {
    pair: usize,
    side: Side,
    off: u64,
    len: u64,
}

/// What the interpreter believes about the windows, updated from completions only.
#[derive(Clone, Debug)]
struct Shadow {
    keys: Vec<Rkey>,
    history: Vec<Vec<Rkey>>,
    bound: Vec<Option<Binding>>,
    /// The current or last binding's range (for "inside the window" offsets).
    range: Vec<(u64, u64)>,
}

impl Shadow {
    fn new(keys: Vec<Rkey>) -> Self {
        let n = keys.len();
        Shadow { keys, history: vec![Vec::new(); n], bound: vec![None; n], range: vec![(0, 256); n] }
    }
    fn pick(&self, w: Win) -> usize {
        let n = self.keys.len();
        let of = |want: bool, k: u8| {
            let v: Vec<usize> = (0..n).filter(|i| self.bound[*i].is_some() == want).collect();
            if v.is_empty() {
                k as usize % n
            } else {
                v[k as usize % v.len()]
            }
        };
        match w {
            Win::Any(k) => k as usize % n,
            Win::Bound(k) => of(true, k),
            Win::Unbound(k) => of(false, k),
        }
    }
    fn stale(&self, w: usize, k: u8) -> Rkey {
        let h = &self.history[w];
        if h.is_empty() {
            let c = self.keys[w];
            Rkey((c.0 & !0xFF) | c.key().wrapping_sub(1) as u32)
        } else {
            h[k as usize % h.len()]
        }
    }
    fn via(&self, w: usize, v: Via) -> (usize, Side) {
        match (v, self.bound[w]) {
            (Via::BoundQp, Some(b)) => (b.pair, b.side),
            (Via::BoundPeer, Some(b)) => (b.pair, b.side.other()),
            (Via::BoundQp, None) => (w % PAIRS, Side::A),
            (Via::BoundPeer, None) => (w % PAIRS, Side::B),
            (Via::Qp(p, s), _) => (p as usize % PAIRS, s),
        }
    }
}

/// The real device: the backend, its setup and the shadow.
struct Rxe {
    dev: VerbsBackend,
    rig: Rig,
    sh: Shadow,
}

/// The model: a fabric with one host, its setup and the shadow.
struct Model {
    fabric: Fabric,
    host: HostId,
    rig: Rig,
    sh: Shadow,
}

impl Model {
    fn new() -> Self {
        let mut fabric = Fabric::new(NicConfig::rxe_compatible());
        let (host, rig, sh) = model_device(&mut fabric);
        Model { fabric, host, rig, sh }
    }
    fn apply(&mut self, op: &Op, wr: u64) -> (Outcome, Option<usize>) {
        apply(&mut self.fabric.view(self.host), &self.rig, &mut self.sh, op, wr)
    }
    fn recover(&mut self) {
        recover(&mut self.fabric.view(self.host), &self.rig);
    }
    fn settle_doubt(&mut self, w: usize, wr: u64) {
        settle_doubt(&mut self.fabric.view(self.host), &self.rig, &mut self.sh, w, wr);
    }
    fn shadow_matches(&mut self) -> Result<(), String> {
        shadow_matches(&self.fabric.view(self.host), &self.rig, &self.sh)
    }
    fn pool_digest(&mut self) -> u64 {
        pool_digest(&self.fabric.view(self.host), &self.rig)
    }
}

/// Everything recorded about one operation on one device.
#[derive(Clone, PartialEq, Eq, Debug)]
struct Outcome {
    /// What the operation resolved to, without device-specific numbers.
    what: String,
    /// Send completion: `None` if nothing was posted or no completion came.
    send: Option<WcStatus>,
    /// `post_send` refused the work request (the message is not compared).
    refused: bool,
    /// SEND_WITH_INV only: the receive completion and whether it reported the invalidated key.
    recv: Option<(WcStatus, bool)>,
    /// A successful READ: a digest of the bytes that arrived.
    data: Option<u64>,
    /// Every pair, (A, B), after the operation.
    states: Vec<(QpState, QpState)>,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.what)?;
        match (self.send, self.refused) {
            (_, true) => write!(f, "refused by post_send")?,
            (Some(s), _) => write!(f, "{s:?}")?,
            (None, _) => write!(f, "-")?,
        }
        if let Some((s, inv)) = self.recv {
            write!(f, ", recv {s:?}{}", if inv { " (invalidated)" } else { "" })?;
        }
        if let Some(d) = self.data {
            write!(f, ", data {d:016x}")?;
        }
        let st: Vec<String> = self.states.iter().map(|(a, b)| format!("{a:?}/{b:?}")).collect();
        write!(f, ", QPs [{}]", st.join(" "))
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x0100_0000_01b3))
}

fn pattern(seed: u64, n: usize) -> Vec<u8> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.u8()).collect()
}

/// Register, fill, allocate windows on a device whose regions and pairs already exist.
fn prepare<D: Dut>(d: &mut D, pool: u64, buf: u64, pairs: Vec<(Qpn, Qpn)>) -> (Rig, Shadow) {
    let p = d
        .reg_mr(Domain::CnFacing, pool, POOL, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)
        .expect("register the pool MR");
    let b = d.reg_mr(Domain::CnFacing, buf, BUF, AccessFlags::LOCAL_WRITE).expect("register the requester buffer");
    d.write_local(pool, &pattern(0x9001, 2 * POOL as usize)).expect("fill the pool");
    let keys = (0..WINDOWS).map(|_| d.alloc_mw().expect("alloc_mw")).collect();
    let rig = Rig { pool, pool_lkey: p.lkey, pool_rkey: p.rkey, buf, buf_lkey: b.lkey, pairs };
    (rig, Shadow::new(keys))
}

fn model_device(f: &mut Fabric) -> (HostId, Rig, Shadow) {
    let h = f.add_host("mn").expect("model host");
    let pool = f.alloc(h, 2 * POOL, 4096).expect("model pool");
    let buf = f.alloc(h, BUF, 4096).expect("model buffer");
    let pairs = (0..PAIRS)
        .map(|_| {
            let (a, b) = f.create_connected_pair(h, QpConfig::default(), h, QpConfig::default()).expect("model pair");
            (a.qpn, b.qpn)
        })
        .collect();
    let (rig, sh) = prepare(&mut f.view(h), pool, buf, pairs);
    (h, rig, sh)
}

fn rxe_device() -> Rxe {
    let mut b = VerbsBackend::open(Some(&device())).expect("open the RDMA device");
    let pool = b.alloc_region(2 * POOL, 4096).expect("pool region");
    let buf = b.alloc_region(BUF, 4096).expect("buffer region");
    let pairs = (0..PAIRS).map(|_| b.create_loopback_pair().expect("loopback pair")).collect();
    let (rig, sh) = prepare(&mut b, pool, buf, pairs);
    Rxe { dev: b, rig, sh }
}

// ------------------------------------------------------------------------------------ interpreter

fn wait<D: Dut>(d: &mut D, qp: Qpn, sel: QueueSel, wr_id: Option<u64>) -> Option<Completion> {
    let t0 = Instant::now();
    let mut buf = [Completion::EMPTY; 8];
    loop {
        let n = d.poll_cq(qp, sel, &mut buf).expect("poll_cq");
        if let Some(c) = buf[..n].iter().find(|c| wr_id.is_none_or(|w| c.wr_id == w)) {
            return Some(*c);
        }
        if t0.elapsed() > d.patience() {
            return None;
        }
        if n == 0 {
            d.idle();
        }
    }
}

fn states<D: Dut>(d: &D, rig: &Rig) -> Vec<(QpState, QpState)> {
    rig.pairs.iter().map(|p| (d.qp_state(p.0).expect("qp_state"), d.qp_state(p.1).expect("qp_state"))).collect()
}

const SKIP_UNBOUND: &str = " — skipped: not bound";
/// See [`mw_ops_on_errored_qps`].
const SKIP_ERRORED: &str = " — skipped: QP in ERR";
/// rxe never completes a request towards a peer in ERR (measured: nothing in 90 s; the model
/// completes it RETRY_EXC_ERR after its retry timeout), so such requests are not posted. A
/// peer is alone in ERR only after a failed local operation (bind, LOCAL_INV) left it there.
const SKIP_PEER_ERRORED: &str = " — skipped: peer in ERR";
/// SEND_WITH_INV needs a RECV on the receiver: a RECV posted on a QP already in ERR is flushed
/// at once by the model (as the spec says) but never completes on rxe (measured: nothing in
/// 10 s, nor after a SEND posted on that QP was flushed); and a flushed SEND leaves the RECV on
/// an RTS receiver pending. So SEND_WITH_INV is posted only on a pair that is RTS/RTS.
const SKIP_PAIR_ERRORED: &str = " — skipped: pair not RTS/RTS";

fn rts<D: Dut>(d: &D, q: Qpn) -> bool {
    d.qp_state(q).expect("qp_state") == QpState::Rts
}

/// Whether the device itself (model: its state; verbs: the backend's tracking) says the window
/// is bound under `key`. Consulted before every invalidation, with the shadow.
fn device_says_bound<D: Dut>(d: &D, key: Rkey) -> bool {
    matches!(d.mw_binding(key), Some(MwBinding::Bound { rkey, .. }) if rkey == key)
}

/// Run one operation; returns its outcome and, when the device left a window's state in doubt
/// (a SEND_WITH_INV whose receive completion never came), that window.
fn apply<D: Dut>(d: &mut D, rig: &Rig, sh: &mut Shadow, op: &Op, wr: u64) -> (Outcome, Option<usize>) {
    let mut o = Outcome { what: String::new(), send: None, refused: false, recv: None, data: None, states: Vec::new() };
    let mut doubt = None;
    let post = |d: &mut D, o: &mut Outcome, on: Qpn, w: Wqe| -> Option<WcStatus> {
        let w = w.with_wr_id(wr).with_flags(w.flags | WqeFlags::SIGNALED);
        if d.post_send(on, &w).is_err() {
            o.refused = true;
            return None;
        }
        let s = wait(d, on, QueueSel::Send, Some(wr)).map(|c| c.status);
        o.send = s;
        s
    };
    match *op {
        Op::Bind { win, on, off, len, read_only } => {
            let w = sh.pick(win);
            let (pair, side) = sh.via(w, on);
            let q = rig.qp(pair, side);
            let (off, len) = match len {
                BindLen::Units(u) => (off as u64 * 256, u as u64 * 256),
                BindLen::Zero => (off as u64 * 256, 0),
                BindLen::BeyondMr => (POOL - 256, 512),
            };
            let acc = if read_only { AccessFlags::REMOTE_READ } else { AccessFlags::DATA_WINDOW };
            o.what = format!(
                "BIND mw{w} ({}) on pair{pair}.{side:?} [{off:#x}+{len:#x}] {}",
                if sh.bound[w].is_some() { "bound" } else { "unbound" },
                if read_only { "R" } else { "RW" }
            );
            let new = sh.keys[w].next_key();
            let bind = Wqe::bind_mw(new.0, rig.pool + off, len as u32, rig.pool_lkey, q.get(), acc);
            if !mw_ops_on_errored_qps() && !rts(d, q) {
                o.what.push_str(SKIP_ERRORED);
            } else if post(d, &mut o, q, bind) == Some(WcStatus::Success) {
                sh.history[w].push(sh.keys[w]);
                sh.keys[w] = new;
                sh.bound[w] = Some(Binding { pair, side, off, len });
                sh.range[w] = (off, len);
            }
        }
        Op::Access { write, key, via, off, len } => {
            let (rkey, w, kdesc) = match key {
                Key::Current(win) => {
                    let w = sh.pick(win);
                    (sh.keys[w], Some(w), format!("current key of mw{w}"))
                }
                Key::Stale(win, k) => {
                    let w = sh.pick(win);
                    (sh.stale(w, k), Some(w), format!("stale key of mw{w}"))
                }
                Key::PoolMr => (Rkey(rig.pool_rkey), None, "the pool MR's rkey".to_string()),
                Key::Garbage => (GARBAGE_RKEY, None, "a garbage rkey".to_string()),
            };
            let (pair, side) = match (w, via) {
                (Some(w), v) => sh.via(w, v),
                (None, Via::Qp(p, s)) => (p as usize % PAIRS, s),
                (None, Via::BoundQp) => (0, Side::A),
                (None, Via::BoundPeer) => (0, Side::B),
            };
            let (wo, wl) = w.map_or((0, 256), |w| sh.range[w]);
            let l = len as u64;
            let (addr_off, odesc) = match off {
                Off::InWindow(r) => {
                    let span = wl.saturating_sub(l).max(1);
                    (wo + (r as u64 % span) / 8 * 8, "in the window")
                }
                Off::PastWindow => (wo + wl, "past the window end"),
                Off::PastMr => (POOL - l / 2, "across the MR end"),
                Off::Raw(r) => ((r as u64 * 8) % (POOL - l.max(8)), "anywhere in the MR"),
            };
            let bound = w.map(|w| match sh.bound[w] {
                Some(b) => format!(" (mw{w} bound to pair{}.{:?})", b.pair, b.side),
                None => format!(" (mw{w} unbound)"),
            });
            o.what = format!(
                "{} {len} B via pair{pair}.{side:?} with {kdesc}{} at +{addr_off:#x} ({odesc})",
                if write { "WRITE" } else { "READ" },
                bound.unwrap_or_default()
            );
            let q = rig.qp(pair, side);
            let remote = rig.pool + addr_off;
            if rts(d, q) && !rts(d, rig.qp(pair, side.other())) {
                o.what.push_str(SKIP_PEER_ERRORED);
                o.states = states(d, rig);
                return (o, None);
            }
            let wqe = if write {
                d.write_local(rig.buf, &pattern(wr, len as usize)).expect("stage the write");
                Wqe::write(rig.buf, rig.buf_lkey, len, remote, rkey.0)
            } else {
                d.write_local(rig.buf, &vec![0xEE; len as usize]).expect("clear the read buffer");
                Wqe::read(rig.buf, rig.buf_lkey, len, remote, rkey.0)
            };
            if post(d, &mut o, q, wqe) == Some(WcStatus::Success) && !write {
                let mut v = vec![0u8; len as usize];
                d.read_local(rig.buf, &mut v).expect("read the buffer");
                o.data = Some(fnv(&v));
            }
        }
        Op::Invalidate { win, via, stale } => {
            let w = sh.pick(win);
            let (pair, side) = sh.via(w, via);
            let key = if stale { sh.stale(w, 0) } else { sh.keys[w] };
            let bound = sh.bound[w];
            o.what = format!(
                "LOCAL_INV mw{w} ({}) with its {} key on pair{pair}.{side:?}",
                bound.map_or("unbound".to_string(), |b| format!("bound to pair{}.{:?}", b.pair, b.side)),
                if stale { "stale" } else { "current" }
            );
            // never invalidate a window that is not bound (rxe NULL dereference)
            if bound.is_none() || !device_says_bound(d, sh.keys[w]) {
                o.what.push_str(SKIP_UNBOUND);
            } else if !mw_ops_on_errored_qps() && !rts(d, rig.qp(pair, side)) {
                o.what.push_str(SKIP_ERRORED);
            } else if post(d, &mut o, rig.qp(pair, side), Wqe::local_inv(key.0)) == Some(WcStatus::Success) {
                sh.bound[w] = None;
            }
        }
        Op::SendInv { win, recv, stale } => {
            let w = sh.pick(win);
            let (pair, side) = sh.via(w, recv);
            let key = if stale { sh.stale(w, 0) } else { sh.keys[w] };
            let bound = sh.bound[w];
            o.what = format!(
                "SEND_WITH_INV mw{w} ({}) with its {} key, received by pair{pair}.{side:?}",
                bound.map_or("unbound".to_string(), |b| format!("bound to pair{}.{:?}", b.pair, b.side)),
                if stale { "stale" } else { "current" }
            );
            let (rq, sq) = (rig.qp(pair, side), rig.qp(pair, side.other()));
            if bound.is_none() || !device_says_bound(d, sh.keys[w]) {
                o.what.push_str(SKIP_UNBOUND);
            } else if !rts(d, rq) || !rts(d, sq) {
                o.what.push_str(SKIP_PAIR_ERRORED);
            } else {
                let mut r = RecvWqe { wr_id: wr, sges: heapless::Vec::new() };
                r.sges.push(Sge { addr: rig.buf + RECV_OFF, length: 64, lkey: rig.buf_lkey }).expect("one SGE");
                d.post_recv(rq, &r).expect("post_recv");
                d.write_local(rig.buf + SEND_OFF, b"invalid!").expect("stage the send");
                post(d, &mut o, sq, Wqe::send_with_inv(rig.buf + SEND_OFF, rig.buf_lkey, 8, key.0));
                match wait(d, rq, QueueSel::Recv, Some(wr)) {
                    Some(c) => {
                        let inv = c.invalidated == Some(key);
                        o.recv = Some((c.status, inv));
                        if c.status.is_ok() {
                            if key == sh.keys[w] && inv {
                                sh.bound[w] = None;
                            } else {
                                // delivered, but which window state did it leave?
                                doubt = Some(w);
                            }
                        }
                    }
                    None => doubt = Some(w),
                }
            }
        }
        Op::Reset { pair } => {
            let p = pair as usize % PAIRS;
            o.what = format!("reset pair{p}");
            d.reset_qp(rig.pairs[p].0).expect("reset_qp");
        }
    }
    o.states = states(d, rig);
    (o, doubt)
}

/// After an operation: reset every pair that is not RTS/RTS.
fn recover<D: Dut>(d: &mut D, rig: &Rig) {
    for p in &rig.pairs {
        if d.qp_state(p.0).expect("qp_state") != QpState::Rts || d.qp_state(p.1).expect("qp_state") != QpState::Rts {
            d.reset_qp(p.0).expect("reset_qp");
        }
    }
}

/// Settle a window whose state is in doubt, so nothing (teardown included) ever invalidates
/// an unbound window: bind it afresh on pair 0. If that fails it was bound all along (and the
/// backend's tracking, which says so, is right); if it succeeds it is bound now, tracked.
fn settle_doubt<D: Dut>(d: &mut D, rig: &Rig, sh: &mut Shadow, w: usize, wr: u64) {
    d.reset_qp(rig.pairs[0].0).expect("reset_qp");
    let op =
        Op::Bind { win: Win::Any(w as u8), on: Via::Qp(0, Side::A), off: 0, len: BindLen::Units(1), read_only: true };
    let (o, _) = apply(d, rig, sh, &op, wr);
    eprintln!("    settled mw{w}: {o}");
}

/// The shadow against the device's own view of every window.
fn shadow_matches<D: Dut>(d: &D, rig: &Rig, sh: &Shadow) -> Result<(), String> {
    for w in 0..sh.keys.len() {
        let dev = d.mw_binding(sh.keys[w]);
        let want = sh.bound[w].map(|b| rig.qp(b.pair, b.side));
        let got = match dev {
            Some(MwBinding::Bound { rkey, qpn }) if rkey == sh.keys[w] => Some(qpn),
            Some(_) => None,
            None => return Err(format!("mw{w}: the device does not know the window")),
        };
        if got != want {
            return Err(format!(
                "mw{w}: shadow says {:?}, device says {:?} ({:?})",
                want.and_then(|q| rig.locate(q)),
                got.and_then(|q| rig.locate(q)),
                dev
            ));
        }
    }
    Ok(())
}

/// The end of a sequence: recover every pair, then invalidate every bound window on its QP.
fn cleanup_ops(sh: &Shadow) -> Vec<Op> {
    (0..sh.keys.len())
        .filter(|w| sh.bound[*w].is_some())
        .map(|w| Op::Invalidate { win: Win::Any(w as u8), via: Via::BoundQp, stale: false })
        .collect()
}

fn pool_digest<D: Dut>(d: &D, rig: &Rig) -> u64 {
    let mut v = vec![0u8; 2 * POOL as usize];
    d.read_local(rig.pool, &mut v).expect("read the pool");
    fnv(&v)
}

// ------------------------------------------------------------------------------------ driver

#[derive(Default)]
struct Tally {
    sequences: usize,
    ops: usize,
    by_kind: BTreeMap<&'static str, BTreeMap<String, usize>>,
    late_states: usize,
    disagreements: Vec<String>,
    /// Known deviation name → (how often, the first example).
    known: BTreeMap<&'static str, (usize, String)>,
}

enum Verdict {
    Same,
    Known,
    Differ,
}

fn env_or(name: &str, d: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| {
            let v = v.trim();
            v.strip_prefix("0x").map_or_else(|| v.parse().ok(), |h| u64::from_str_radix(h, 16).ok())
        })
        .unwrap_or(d)
}

fn status_label(o: &Outcome) -> String {
    match (o.send, o.refused, o.recv) {
        (_, true, _) => "refused".into(),
        (None, _, _) if o.what.contains(" — skipped: ") => o.what.rsplit(" — ").next().unwrap_or("skipped").into(),
        (None, _, _) if o.what.starts_with("reset") => "ok".into(),
        (None, _, _) => "no completion".into(),
        (Some(s), _, Some((r, _))) => format!("{s:?}/recv {r:?}"),
        (Some(s), _, None) => format!("{s:?}"),
    }
}

/// Compare one operation's outcomes; a disagreement is recorded with the sequence's history.
#[allow(clippy::too_many_arguments)]
fn compare(
    seq: usize,
    seed: u64,
    i: usize,
    kind: &str,
    mo: &Outcome,
    ro: &mut Outcome,
    r: &Rxe,
    log: &mut Vec<String>,
    t: &mut Tally,
) -> Verdict {
    let known = |mo: &Outcome, ro: &Outcome| KNOWN.iter().find(|k| (k.matches)(mo, ro));
    if mo != ro && known(mo, ro).is_none() && mo.states != ro.states {
        // a QP of the real device may reach ERR a little after its completion was polled
        let t0 = Instant::now();
        while ro.states != mo.states && t0.elapsed() < Duration::from_millis(300) {
            std::thread::sleep(Duration::from_millis(1));
            ro.states = states(&r.dev, &r.rig);
        }
        if ro.states == mo.states {
            t.late_states += 1;
        }
    }
    log.push(format!("  {i:>3} {kind:<20} {ro}"));
    if mo == ro {
        return Verdict::Same;
    }
    let text = format!("sequence {seq} (seed {seed:#x}), op {i} [{kind}]:\n    model: {mo}\n    rxe  : {ro}");
    if let Some(k) = known(mo, ro) {
        t.known.entry(k.name).or_insert((0, text)).0 += 1;
        return Verdict::Known;
    }
    t.disagreements.push(format!("{text}\n  history (rxe):\n{}", log.join("\n")));
    Verdict::Differ
}

/// The verbs backend's tracked current key of every window against the shadow's (the handle
/// of the next bind: a wrong one makes rxe refuse every later bind of that window).
fn verbs_keys_match(r: &Rxe) -> Result<(), String> {
    for (w, k) in r.sh.keys.iter().enumerate() {
        match r.dev.mw_state(*k) {
            Some((cur, _)) if cur == *k => {}
            other => return Err(format!("mw{w}: shadow key {k:?}, backend tracks {other:?}")),
        }
    }
    Ok(())
}

/// One sequence on both devices in lockstep; the first disagreement ends the comparison.
fn run_sequence(seq: usize, seed: u64, steps: &[Step], t: &mut Tally) {
    let mut m = Model::new();
    let mut r = rxe_device();
    let mut agreed = true;
    let mut log: Vec<String> = Vec::new();
    let mut wr = (seq as u64 + 1) << 32;
    for (i, s) in steps.iter().enumerate() {
        wr += 1;
        let (mo, mdoubt) = m.apply(&s.op, wr);
        let (mut ro, rdoubt) = apply(&mut r.dev, &r.rig, &mut r.sh, &s.op, wr);
        t.ops += 1;
        *t.by_kind.entry(s.op.kind()).or_default().entry(status_label(&ro)).or_default() += 1;
        let verdict = compare(seq, seed, i, s.op.kind(), &mo, &mut ro, &r, &mut log, t);
        if let Some(w) = rdoubt {
            wr += 1;
            settle_doubt(&mut r.dev, &r.rig, &mut r.sh, w, wr);
        }
        if let Some(w) = mdoubt {
            m.settle_doubt(w, wr);
        }
        if let Err(e) = m.shadow_matches() {
            panic!("sequence {seq} op {i}: the interpreter's shadow disagrees with the model: {e}");
        }
        if let Err(e) = shadow_matches(&r.dev, &r.rig, &r.sh).and_then(|_| verbs_keys_match(&r)) {
            t.disagreements.push(format!(
                "sequence {seq} (seed {seed:#x}), op {i}: the interpreter's shadow disagrees with the verbs backend's tracking: {e}\n  history (rxe):\n{}",
                log.join("\n")
            ));
            agreed = false;
            break;
        }
        if matches!(verdict, Verdict::Differ) {
            agreed = false;
            break;
        }
        // after a known deviation the devices' QP states may differ: always reset
        if !s.linger || matches!(verdict, Verdict::Known) {
            m.recover();
            recover(&mut r.dev, &r.rig);
        }
    }
    // cleanup, on each device from its own shadow (compared while the devices still agree)
    m.recover();
    recover(&mut r.dev, &r.rig);
    let (mops, rops) = (cleanup_ops(&m.sh), cleanup_ops(&r.sh));
    agreed &= mops.len() == rops.len();
    for (i, op) in rops.iter().enumerate() {
        wr += 1;
        let (mut ro, _) = apply(&mut r.dev, &r.rig, &mut r.sh, op, wr);
        if agreed {
            let (mo, _) = m.apply(&mops[i], wr);
            let v = compare(seq, seed, steps.len() + i, "cleanup-local-inv", &mo, &mut ro, &r, &mut log, t);
            agreed = !matches!(v, Verdict::Differ);
        }
        recover(&mut r.dev, &r.rig);
    }
    if agreed {
        let (md, rd) = (m.pool_digest(), pool_digest(&r.dev, &r.rig));
        if md != rd {
            t.disagreements.push(format!(
                "sequence {seq} (seed {seed:#x}): pool contents differ at the end (model {md:016x}, rxe {rd:016x})\n{}",
                log.join("\n")
            ));
        }
    }
    t.sequences += 1;
}

#[test]
fn model_agrees_with_rxe_on_random_mw_sequences() {
    if !rxe() {
        return;
    }
    let seqs = env_or("OMW_DIFF_SEQS", SEQS) as usize;
    let ops = env_or("OMW_DIFF_OPS", OPS) as usize;
    let seed = env_or("OMW_DIFF_SEED", DEFAULT_SEED);
    let t0 = Instant::now();
    let mut t = Tally::default();
    for s in 0..seqs {
        let sseed = seed ^ (s as u64).wrapping_mul(0xA076_1D64_78BD_642F);
        run_sequence(s, sseed, &gen_sequence(sseed, ops), &mut t);
    }
    println!(
        "differential: {} sequences × {ops} operations ({} compared) on {} vs the model (rxe-compatible), seed {seed:#x}, {:.1} s",
        t.sequences,
        t.ops,
        device(),
        t0.elapsed().as_secs_f64()
    );
    for (k, m) in &t.by_kind {
        let v: Vec<String> = m.iter().map(|(s, n)| format!("{s} ×{n}")).collect();
        println!("  {k:<20} {}", v.join(", "));
    }
    println!("  QP states that reached the model's value only after the completion was polled: {}", t.late_states);
    for k in KNOWN {
        if let Some((n, example)) = t.known.get(k.name) {
            println!("KNOWN DEVIATION ({n}×, not a failure) — {}: {}\n  first: {example}", k.name, k.why);
        }
    }
    for d in &t.disagreements {
        println!("DISAGREEMENT:\n{d}");
    }
    assert!(t.disagreements.is_empty(), "{} sequence(s) disagreed (see above)", t.disagreements.len());
}

/// Runs everywhere: the same sequences on the model alone, checking after every operation that
/// the interpreter's shadow (which guards rxe against invalidating unbound windows) matches
/// the model's own window table, and that each sequence ends with every window unbound.
#[test]
fn interpreter_shadow_tracks_the_model() {
    let seqs = env_or("OMW_DIFF_SEQS", SEQS) as usize;
    let ops = env_or("OMW_DIFF_OPS", OPS) as usize;
    let seed = env_or("OMW_DIFF_SEED", DEFAULT_SEED);
    let mut kinds: BTreeMap<&'static str, BTreeMap<String, usize>> = BTreeMap::new();
    for s in 0..seqs {
        let sseed = seed ^ (s as u64).wrapping_mul(0xA076_1D64_78BD_642F);
        let mut m = Model::new();
        for (i, st) in gen_sequence(sseed, ops).iter().enumerate() {
            let (o, doubt) = m.apply(&st.op, i as u64 + 1);
            *kinds.entry(st.op.kind()).or_default().entry(status_label(&o)).or_default() += 1;
            assert_eq!(doubt, None, "sequence {s} op {i}: {o}");
            m.shadow_matches().unwrap_or_else(|e| panic!("sequence {s} op {i}: {o}: {e}"));
            if !st.linger {
                m.recover();
            }
        }
        m.recover();
        for op in cleanup_ops(&m.sh) {
            let (o, _) = m.apply(&op, 1 << 40);
            assert_eq!(o.send, Some(WcStatus::Success), "sequence {s} cleanup: {o}");
        }
        assert!(m.sh.bound.iter().all(Option::is_none));
        m.fabric.check_invariants().unwrap_or_else(|e| panic!("sequence {s}: model invariants: {e}"));
    }
    for (k, m) in &kinds {
        let v: Vec<String> = m.iter().map(|(s, n)| format!("{s} ×{n}")).collect();
        println!("  {k:<20} {}", v.join(", "));
    }
    // the generator reaches every kind of operation and both outcomes of the main ones
    for k in ["bind", "read", "write", "local-inv", "send-with-inv", "reset"] {
        assert!(kinds.contains_key(k), "no {k} generated: {kinds:?}");
    }
    for k in ["read", "write", "bind", "local-inv"] {
        let m = &kinds[k];
        assert!(m.contains_key("Success"), "{k} never succeeded: {m:?}");
        assert!(m.keys().any(|s| s != "Success"), "{k} never failed: {m:?}");
    }
}
