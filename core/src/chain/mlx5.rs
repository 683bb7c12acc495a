//! The alloc and free chains in mlx5 form: the same [`ChainLayout`] as WQEBBs a ConnectX
//! would fetch, with every self-modifying patch aimed at the big-endian bytes of the field it
//! feeds (issue 13 part 2). One chain description, two formats: the builders stay symbolic
//! (steps, [`Loc`]s); this file decides, for [`WqeFormat::Mlx5`], the byte offsets, widths,
//! byte orders and device units.
//!
//! **Byte order.** MN memory keeps its one layout — the MWTable, the free queue, scratch and
//! the wire are little-endian for the MN CPU, the CN and the host engine alike — and the MN's
//! 8-byte atomics are assumed to run in host endianness (little-endian on the x86 MNs we
//! target: Linux mlx5_core sets `atomic_req_8B_endianness_mode` to host endianness where the
//! device supports it, commit f91e6d8941bf "net/mlx5_core: Add setting ATOMIC endian mode",
//! and mlx5_ib advertises `IB_ATOMIC_HCA` only then). mlx5 WQE fields are big-endian. So every
//! copy between MN memory and a WQE field is a **byte-reversing scatter READ** — one one-byte
//! data segment per byte, in reverse order (ODRP's technique) — and a copy between two WQE
//! fields, or between two memory words, stays a plain READ. The RECV reverses the request's
//! fields the same way with one-byte scatter entries. A value kept in two places of one WQE (a
//! bind's address, length and key byte) is copied twice: a READ lands each source byte once.
//!
//! **Device units and re-arming.** WAIT names a CQ number and a 24-bit producer index, SEND_EN
//! an absolute 16-bit WQE index counted in WQEBBs, RECV_EN an absolute receive-WQE index
//! (issue 13; docs/MLX5.md lists these as assumptions). Canonical ENABLE counts are relative
//! and need no per-lap bump; here every WAIT *and* every ENABLE moves on each lap. A big-endian
//! field cannot be fetch-and-added with little-endian atomics, so each such field has a
//! little-endian **shadow counter** in the CN's scratch ([`crate::wire::memory_map::MLX5_SHADOW_OFF`]): per lap a masked
//! fetch-and-add advances the shadow (wrapping at the field's 24 or 16 bits) and a FENCEd
//! byte-reversing READ copies it into the field. The bumps run after the field's WQE executed
//! in this lap and before the lap-closing FENCEd ENABLE (the closing ENABLE's own bump right
//! after it), so, as in the canonical form, no next-lap WQE is fetched with a stale count.
//! Each lap is exactly one ring of a power-of-two WQEBB count (NOPs pad it), so every lap runs
//! on the same bytes at the next multiple of the ring size.
//!
//! **Completions.** Added WQEs are unsignaled, except the READ that replaces a canonical WAIT
//! bump (the fetch-and-add it replaces was signaled): every CQ sees the canonical count per lap,
//! so the canonical WAIT counts hold. [`Mlx5Chain::validate`] checks it from the bytes.

use crate::chain::{ChainError, ChainKind, ChainLayout, Loc, Rearm, Ring};
use crate::device::behaviour::SendEnUnit;
use crate::mlx5::ctrl::PrevWqe;
use crate::mlx5::data::DataSeg;
use crate::mlx5::decode::{decode, Local, Mlx5Op};
use crate::mlx5::encode::{
    self, encode, encode_scatter_read, field_mapping, scatter_read_ds, Encoding, FieldMapping, QueueResolver, Target,
};
use crate::mlx5::wqebb::{wqebbs, CqIndex, WqeIndex, MAX_SCATTER_SGES, WQEBB};
use crate::mlx5::Mlx5Error;
use crate::wire::memory_map::MLX5_SHADOW_LEN;
use crate::wire::wqe::{Opcode, QueueSel, Wqe, WqeField, WqeFlags, WQE_SIZE};
use crate::wire::wqe_format::WqeFormat;
use core::fmt;

/// mlx5 WQEs per ring (canonical steps, their expansions, bumps, padding).
pub const MAX_ITEMS: usize = MAX_RING_WQEBBS;
/// WQEBBs per ring.
pub const MAX_RING_WQEBBS: usize = 256;
/// Scatter entries of the mlx5 RECV (a byte-reversed request needs one per byte). ConnectX
/// reports `max_recv_sge` ≥ 32 — an assumption the DEVX backend must check.
pub const MAX_RECV_SGES: usize = 32;
/// Bytes of one shadow lap counter (a little-endian u64).
pub const SHADOW_SIZE: u64 = 8;
/// Shadow counters per chain.
pub const MAX_SHADOWS: usize = (MLX5_SHADOW_LEN / SHADOW_SIZE) as usize;

/// Device numbers the chain's QPs have on the device.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Mlx5Queues {
    /// CQ numbers: [Loop send, Mgmt send, Mgmt receive]. One CQ per queue: a WAIT's producer
    /// index counts only that queue's completions.
    pub cqns: [u32; 3],
    /// MN addresses of the send-ring images [Loop, Mgmt] (the WQE fields the chain patches).
    pub ring_bases: [u64; 2],
    /// Producer indices of the three CQs when the chain is armed (completions ever written to
    /// them). A WAIT compares a CQ's absolute producer index, and on mlx5 a CQ outlives the
    /// reset of its QP (only destroying it starts it over), so a chain re-armed after a reset
    /// waits for `base + canonical count`. Zero on freshly created CQs and on a model whose
    /// reset zeroes CQ counts.
    pub cq_base: [u32; 3],
    /// MN address of the management QP's receive doorbell record, where the chain publishes
    /// its receives (`crate::device::RecvDoorbell`); 0 where it does not.
    pub recv_doorbell: u64,
}

/// Which of [`Mlx5Queues::cqns`] counts the completions of the queue a WAIT names:
/// [Loop send, Mgmt send, Mgmt receive]; `None` for a queue outside the chain.
fn cq_slot(qpns: [u32; 2], w: &Wqe) -> Option<usize> {
    match (w.qpn == qpns[0], w.qpn == qpns[1], w.queue_sel()) {
        (true, _, QueueSel::Send) => Some(0),
        (_, true, QueueSel::Send) => Some(1),
        (_, true, QueueSel::Recv) => Some(2),
        _ => None,
    }
}

/// A WAIT's lap-0 producer index on the device: its canonical count past the CQ's base.
fn wait_target(qpns: [u32; 2], queues: &Mlx5Queues, w: &Wqe) -> u64 {
    let base = cq_slot(qpns, w).map_or(0, |i| queues.cq_base[i]);
    u64::from(base) + w.operand0
}

impl Mlx5Queues {
    /// Queues on fresh CQs (producer indices 0).
    pub const fn new(cqns: [u32; 3], ring_bases: [u64; 2]) -> Self {
        Mlx5Queues { cqns, ring_bases, cq_base: [0; 3], recv_doorbell: 0 }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Mlx5ChainError {
    /// The canonical layout does not validate.
    Invalid(ChainError),
    /// A WQE could not be encoded.
    Encode(Mlx5Error),
    /// A patch names a field with no bytewise mlx5 form (wr_id, a resolved queue number, the
    /// access bits), or a step kind the mlx5 form does not translate.
    Unsupported { step: u8, field: WqeField },
    /// A field the request scatters into is kept in two places in the mlx5 WQE: a RECV lands
    /// each byte once.
    RecvNeedsTwoTargets { step: u8, field: WqeField },
    /// A WRITE into WQE fields whose mlx5 targets are not one contiguous range.
    ScatteredClear { step: u8 },
    /// A WAIT of a self-enabling chain without its canonical bump.
    MissingBump { step: u8 },
    /// More mlx5 WQEs, WQEBBs, scatter entries or shadow counters than the fixed capacities.
    Capacity,
    /// The mlx5 form contradicts itself (found by [`Mlx5Chain::validate`] from the bytes).
    Inconsistent(Inconsistency),
}

/// What [`Mlx5Chain::validate`] found wrong.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Inconsistency {
    /// A WQE does not decode, or its index is not its position in the lap.
    Undecodable { ring: Ring, pi: u16 },
    /// A WQE crosses the ring's end, or the lap is not exactly the ring.
    Wrap { ring: Ring },
    /// A write into a ring touches bytes outside every patch target of one WQE.
    StrayWrite { ring: Ring, offset: usize },
    /// The bytes a producer writes into a target are not exactly the target's value bytes.
    TargetWidth { step: u8, field: WqeField },
    /// An atomic targets a WQE (big-endian fields; the atomics are little-endian).
    AtomicOnRing { ring: Ring },
    /// A CQ sees a different number of completions per lap than in the canonical form.
    Completions { ring: Ring },
    /// A WAIT or ENABLE carries other device numbers than the layout implies, or has no bump.
    QueueField { step: u8 },
}

impl fmt::Display for Mlx5ChainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid(e) => write!(f, "canonical chain invalid: {e}"),
            Self::Encode(e) => write!(f, "mlx5 encoding failed: {e}"),
            Self::Unsupported { step, field } => write!(f, "{field:?} of step {step} has no bytewise mlx5 patch"),
            Self::RecvNeedsTwoTargets { step, field } => {
                write!(f, "the request scatters into {field:?} of step {step}, which mlx5 keeps twice")
            }
            Self::ScatteredClear { step } => write!(f, "step {step} clears WQE fields that are not contiguous in mlx5"),
            Self::MissingBump { step } => write!(f, "WAIT at step {step} has no per-lap bump"),
            Self::Capacity => f.write_str("the mlx5 form exceeds its fixed capacities"),
            Self::Inconsistent(i) => write!(f, "mlx5 form inconsistent: {i:?}"),
        }
    }
}

impl From<Mlx5Error> for Mlx5ChainError {
    fn from(e: Mlx5Error) -> Self {
        Mlx5ChainError::Encode(e)
    }
}

/// A destination or source of bytes before the ring addresses are applied.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Addr {
    Mem(u64),
    /// Byte `off` of the mlx5 WQE of canonical step `step`.
    Field {
        step: u8,
        off: u16,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Sg {
    dst: Addr,
    len: u32,
    lkey: u32,
}

// no heap in the core: the scatter list is inline
#[allow(clippy::large_enum_variant)]
#[derive(Clone, PartialEq, Eq, Debug)]
enum Kind {
    /// A canonical WQE encoded as is; `remote` replaces its remote address (a clear of fields).
    Wqe { wqe: Wqe, remote: Option<Addr> },
    /// A scatter READ.
    Read { src: Addr, rkey: u32, sges: heapless::Vec<Sg, MAX_SCATTER_SGES> },
    /// A shadow counter's fetch-and-add (operand known once the ring sizes are).
    Bump { shadow: u8 },
}

/// Why a WQE is in the mlx5 ring.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Role {
    /// (Part of) canonical step `n`.
    Step(u8),
    /// The per-lap advance of the WAIT / ENABLE at canonical step `n` (fetch-and-add or copy).
    Bump(u8),
    /// Padding to a power-of-two lap.
    Pad,
}

#[derive(Clone, PartialEq, Eq, Debug)]
struct Item {
    kind: Kind,
    flags: WqeFlags,
    role: Role,
}

impl Item {
    fn wqebbs(&self) -> usize {
        match &self.kind {
            Kind::Wqe { wqe, .. } => wqebbs(encode::ds_of(wqe)),
            Kind::Read { sges, .. } => wqebbs(scatter_read_ds(sges.len())),
            Kind::Bump { .. } => 1,
        }
    }
}

/// Where one mlx5 WQE of a lap lies.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Placed {
    pub role: Role,
    /// WQE index in lap 0 (= its WQEBB slot).
    pub pi: u16,
    pub wqebbs: u8,
}

/// One shadow counter: where, its lap-0 value, and what it advances.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Shadow {
    pub addr: u64,
    /// The lap-0 value of the field (written by the arm step).
    pub initial: u64,
    /// Per-lap increment and the field's width in bits (the counter wraps there).
    pub increment: u64,
    pub bits: u8,
    /// The canonical WAIT / ENABLE step whose field it feeds.
    pub step: u8,
}

/// One scatter entry of the mlx5 RECV.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RecvSge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The device-side half of arming a chain in mlx5 form. Every MN device implements it — a
/// device without the mlx5 form answers `None` explicitly — so a wrapper cannot drop it and
/// let an mlx5-form device be armed with canonical chains.
pub trait Mlx5Arm: crate::device::DataPath {
    /// The CQ numbers counting the chain QPs' completions, [`loop_qp` send, `mgmt_qp` send,
    /// `mgmt_qp` receive] — what the chain's WAITs name. `None`: no mlx5 form.
    fn cq_numbers(&self, loop_qp: crate::ids::Qpn, mgmt_qp: crate::ids::Qpn) -> Option<[u32; 3]>;
    /// The producer indices of those three CQs now — completions ever written to them. A WAIT
    /// compares a CQ's absolute producer index and an mlx5 CQ keeps counting across a reset of
    /// its QP, so a chain re-armed after a reset starts its WAITs from here. Zero for a device
    /// whose reset starts its CQ counts over.
    fn cq_producer_indices(&self, loop_qp: crate::ids::Qpn, mgmt_qp: crate::ids::Qpn) -> [u32; 3];
    /// After the core wrote the chain's ring images and lap counters into MN memory, take the
    /// rings as posted (their WQE-index → wr_id map, as a driver keeps one), post
    /// `recv_copies` RECVs with the chain's scatter list and ring the first enables. `None`:
    /// the device has no mlx5 form.
    fn arm_mlx5(&mut self, chain: &Mlx5Chain, recv_copies: u32) -> Option<Result<(), Self::Error>>;
}

/// A chain in mlx5 form: both rings' bytes for one lap, the RECV, the shadow counters and the
/// first lap's enable indices.
#[derive(Clone, Debug)]
pub struct Mlx5Chain {
    pub kind: ChainKind,
    /// QP numbers [Loop, Mgmt] (the control segments' `qpn`).
    pub qpns: [u32; 2],
    pub queues: Mlx5Queues,
    /// Ring images [Loop, Mgmt]: exactly one lap, `ring_wqebbs` × 64 bytes each.
    pub rings: [heapless::Vec<u8, { MAX_RING_WQEBBS * WQEBB }>; 2],
    pub placed: [heapless::Vec<Placed, MAX_ITEMS>; 2],
    pub recv: heapless::Vec<RecvSge, MAX_RECV_SGES>,
    pub shadows: heapless::Vec<Shadow, MAX_SHADOWS>,
    /// The absolute WQE index each send ring may run up to when armed (SEND_EN / doorbell).
    pub initial_index: [u16; 2],
    canonical: ChainLayout,
}

/// WQEs and WQEBBs one lap executes, per ring [Loop, Mgmt].
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct LapCost {
    pub wqes: [usize; 2],
    pub wqebbs: [usize; 2],
    /// Of the WQEs: wrap/lap padding NOPs (canonical padding included).
    pub padding: [usize; 2],
    /// Of the WQEs: the per-lap advances of WAITs and ENABLEs (fetch-and-add + copy).
    pub bumps: [usize; 2],
}

/// The value bytes of a target: how many low bytes of the value it holds.
const fn significant(t: &Target) -> usize {
    match t.encoding {
        Encoding::BigEndian { value_bits } => {
            let b = (value_bits as usize).div_ceil(8);
            if b < t.width as usize {
                b
            } else {
                t.width as usize
            }
        }
        Encoding::MkeyAccess => 0,
    }
}

fn targets_of(w: &Wqe, field: WqeField, step: u8) -> Result<heapless::Vec<Target, 2>, Mlx5ChainError> {
    match field_mapping(w, field) {
        FieldMapping::Targets(ts) if ts.iter().all(|t| significant(t) > 0) => Ok(ts),
        _ => Err(Mlx5ChainError::Unsupported { step, field }),
    }
}

/// The canonical fields a span of `len` bytes from `field` covers (validated spans tile fields).
fn covered(field: WqeField, len: u32) -> impl Iterator<Item = WqeField> {
    let end = field.offset() + len as usize;
    WqeField::ALL.into_iter().filter(move |f| f.offset() >= field.offset() && f.offset() + f.width() <= end)
}

/// Destinations of each source byte of a copy (at most two: a bind keeps some values twice).
type Moves = heapless::Vec<Dests, 40>;
type Dests = heapless::Vec<Addr, 2>;

/// The destinations of value byte `v`: one per target of the field that holds that byte.
fn byte_dests(targets: &heapless::Vec<(usize, [Addr; 8]), 2>, v: usize) -> Dests {
    let mut d = Dests::new();
    for (m, a) in targets.iter().filter(|(m, _)| v < *m) {
        let pushed = d.push(a[v]);
        debug_assert!(pushed.is_ok(), "at most one destination per target, and at most 2 targets ({m} bytes)");
    }
    d
}

/// A byte with one destination.
fn one_dest(a: Addr) -> Dests {
    let mut d = Dests::new();
    let pushed = d.push(a);
    debug_assert!(pushed.is_ok(), "one destination in an empty list of 2");
    d
}

struct Build<'a> {
    layout: &'a ChainLayout,
    items: [heapless::Vec<Item, MAX_ITEMS>; 2],
    junk: u64,
    recv_doorbell: u64,
}

impl Build<'_> {
    fn push(&mut self, ring: Ring, item: Item) -> Result<(), Mlx5ChainError> {
        self.items[ring as usize].push(item).map_err(|_| Mlx5ChainError::Capacity)
    }

    fn step_wqe(&self, t: u8) -> Result<&Wqe, Mlx5ChainError> {
        self.layout
            .steps
            .get(t as usize)
            .map(|s| &s.wqe)
            .ok_or(Mlx5ChainError::Invalid(ChainError::BadStepRef { step: t }))
    }

    /// Destination bytes for the value bytes of `field` of step `t`, per target:
    /// `(value byte v → Addr)` for v below the target's value bytes.
    fn field_dests(&self, t: u8, field: WqeField) -> Result<heapless::Vec<(usize, [Addr; 8]), 2>, Mlx5ChainError> {
        let w = self.step_wqe(t)?;
        let mut out = heapless::Vec::new();
        for tg in targets_of(w, field, t)? {
            let n = significant(&tg);
            let mut a = [Addr::Mem(0); 8];
            for (v, slot) in a.iter_mut().enumerate().take(n) {
                *slot = Addr::Field { step: t, off: (tg.offset + tg.width as usize - 1 - v) as u16 };
            }
            let pushed = out.push((n, a));
            debug_assert!(pushed.is_ok(), "one entry per target: targets_of returns at most 2");
        }
        Ok(out)
    }

    /// Turn a copy — source bytes with their destinations — into scatter READs at `ring`.
    #[allow(clippy::too_many_arguments)]
    fn emit_copy(
        &mut self,
        ring: Ring,
        role: Role,
        flags: WqeFlags,
        src: Addr,
        rkey: u32,
        lkey: u32,
        moves: &Moves,
    ) -> Result<(), Mlx5ChainError> {
        let passes = moves.iter().map(|d| d.len()).max().unwrap_or(0);
        let mut reads: heapless::Vec<Item, 8> = heapless::Vec::new();
        for p in 0..passes {
            let dst = |i: usize| moves[i].get(p).copied();
            let (Some(lo), Some(hi)) =
                ((0..moves.len()).find(|&i| dst(i).is_some()), (0..moves.len()).rfind(|&i| dst(i).is_some()))
            else {
                continue;
            };
            let mut start = lo;
            let mut sges: heapless::Vec<Sg, MAX_SCATTER_SGES> = heapless::Vec::new();
            for i in lo..=hi {
                let (d, k) = match dst(i) {
                    Some(d) => (d, lkey),
                    None => (Addr::Mem(self.junk + (i % 8) as u64), self.layout.mlx5.meta_lkey),
                };
                let merged = match sges.last_mut() {
                    Some(s) if s.lkey == k && next_of(s.dst, s.len) == Some(d) => {
                        s.len += 1;
                        true
                    }
                    _ => false,
                };
                if merged {
                    continue;
                }
                if sges.is_full() {
                    let r =
                        Item { kind: Kind::Read { src: offset(src, start), rkey, sges: sges.clone() }, flags, role };
                    reads.push(r).map_err(|_| Mlx5ChainError::Capacity)?;
                    sges.clear();
                    start = i;
                }
                let pushed = sges.push(Sg { dst: d, len: 1, lkey: k });
                debug_assert!(pushed.is_ok(), "a full scatter list was emitted and cleared just above");
            }
            let r = Item { kind: Kind::Read { src: offset(src, start), rkey, sges }, flags, role };
            reads.push(r).map_err(|_| Mlx5ChainError::Capacity)?;
        }
        // FENCE on the first (the rest run after it in order), the completion on the last
        let n = reads.len();
        for (k, mut r) in reads.into_iter().enumerate() {
            r.flags = flags.difference(WqeFlags::SIGNALED | WqeFlags::FENCE);
            if k == 0 && flags.contains(WqeFlags::FENCE) {
                r.flags |= WqeFlags::FENCE;
            }
            if k + 1 == n && flags.contains(WqeFlags::SIGNALED) {
                r.flags |= WqeFlags::SIGNALED;
            }
            self.push(ring, r)?;
        }
        Ok(())
    }

    /// The mlx5 items of canonical step `i`.
    fn translate(&mut self, i: usize) -> Result<(), Mlx5ChainError> {
        let s = self.layout.steps[i];
        let w = s.wqe;
        let role = Role::Step(i as u8);
        let step = i as u8;
        match (w.opcode, s.local, s.remote) {
            // a copy into WQE fields, from memory (LE) or from another WQE field (BE)
            (Opcode::Read, Some(Loc::Field { step: t, field }), remote) => {
                let mut moves: Moves = heapless::Vec::new();
                let src = match remote {
                    Some(Loc::Field { step: t2, field: f2 }) => {
                        let (n, srcb) = self.ring_source(t2, f2, w.length)?;
                        let dests = self.field_dests(t, field)?;
                        for v in (0..n).rev() {
                            moves.push(byte_dests(&dests, v)).map_err(|_| Mlx5ChainError::Capacity)?;
                        }
                        srcb
                    }
                    _ => {
                        for f in covered(field, w.length) {
                            let dests = self.field_dests(t, f)?;
                            for v in 0..f.width() {
                                moves.push(byte_dests(&dests, v)).map_err(|_| Mlx5ChainError::Capacity)?;
                            }
                        }
                        Addr::Mem(w.remote_addr)
                    }
                };
                self.emit_copy(s.ring, role, w.flags, src, w.rkey, w.lkey, &moves)
            }
            // a copy out of a WQE field (BE) into memory (LE)
            (Opcode::Read, None, Some(Loc::Field { step: t2, field: f2 })) => {
                let (n, src) = self.ring_source(t2, f2, w.length)?;
                let mut moves: Moves = heapless::Vec::new();
                // source bytes in ring order are value bytes n-1 .. 0
                for v in (0..n).rev() {
                    moves.push(one_dest(Addr::Mem(w.local_addr + v as u64))).map_err(|_| Mlx5ChainError::Capacity)?;
                }
                self.emit_copy(s.ring, role, w.flags, src, w.rkey, w.lkey, &moves)
            }
            // a clear of WQE fields for the next lap (from zeros: byte order is moot)
            (Opcode::Write, None, Some(Loc::Field { step: t, field })) => {
                let tw = *self.step_wqe(t)?;
                let mut range: Option<(usize, usize)> = None;
                for f in covered(field, w.length) {
                    let ts = targets_of(&tw, f, t)?;
                    for tg in ts.iter() {
                        range = match range {
                            None => Some((tg.offset, tg.offset + tg.width as usize)),
                            Some((a, b)) if b == tg.offset => Some((a, tg.offset + tg.width as usize)),
                            Some(_) => return Err(Mlx5ChainError::ScatteredClear { step }),
                        };
                    }
                }
                let (a, b) = range.ok_or(Mlx5ChainError::ScatteredClear { step })?;
                let mut c = w;
                c.length = (b - a) as u32;
                let item = Item {
                    kind: Kind::Wqe { wqe: c, remote: Some(Addr::Field { step: t, off: a as u16 }) },
                    flags: w.flags,
                    role,
                };
                self.push(s.ring, item)
            }
            // the canonical bump of a WAIT count: replaced by a shadow counter (added later)
            (Opcode::FetchAdd, None, Some(Loc::Field { .. })) => Ok(()),
            // publish the next receive: the record takes rdma-core's `htobe32(count & 0xffff)`,
            // which is exactly the 4 bytes of the receive ENABLE just before it (its absolute
            // RECV_EN index, big-endian, 16 significant bits, this lap's value: the lap counter
            // moves it only in the bump block after) — a plain READ of them into the record
            (Opcode::FetchAdd, None, Some(Loc::RecvDoorbell)) => {
                let misplaced = Mlx5ChainError::Invalid(ChainError::MisplacedRecvDoorbell { step });
                let en = (0..i)
                    .rev()
                    .find(|&j| {
                        let e = &self.layout.steps[j];
                        e.ring == s.ring && e.wqe.opcode == Opcode::Enable && e.wqe.queue_sel() == QueueSel::Recv
                    })
                    .ok_or(misplaced)?;
                let ts = targets_of(self.step_wqe(en as u8)?, WqeField::Operand0, en as u8)?;
                let tg = ts.first().ok_or(misplaced)?;
                let mut sges: heapless::Vec<Sg, MAX_SCATTER_SGES> = heapless::Vec::new();
                let sg =
                    Sg { dst: Addr::Mem(self.recv_doorbell), len: tg.width as u32, lkey: self.layout.mlx5.ring_lkey };
                sges.push(sg).map_err(|_| Mlx5ChainError::Capacity)?;
                let src = Addr::Field { step: en as u8, off: tg.offset as u16 };
                let item = Item { kind: Kind::Read { src, rkey: w.rkey, sges }, flags: w.flags, role };
                self.push(s.ring, item)
            }
            (_, None, None) => {
                let item = Item { kind: Kind::Wqe { wqe: w, remote: None }, flags: w.flags, role };
                self.push(s.ring, item)
            }
            (_, Some(Loc::Field { field, .. }), _) | (_, _, Some(Loc::Field { field, .. })) => {
                Err(Mlx5ChainError::Unsupported { step, field })
            }
            (_, _, _) => Err(Mlx5ChainError::Unsupported { step, field: WqeField::LocalAddr }),
        }
    }

    /// A WQE field as a READ's source: its single target's value bytes (in ring order, most
    /// significant first) and where they start.
    fn ring_source(&self, t: u8, f: WqeField, len: u32) -> Result<(usize, Addr), Mlx5ChainError> {
        let ts = targets_of(self.step_wqe(t)?, f, t)?;
        let tg = ts.first().ok_or(Mlx5ChainError::Unsupported { step: t, field: f })?;
        let n = significant(tg).min(len as usize);
        let off = tg.offset + tg.width as usize - n;
        Ok((n, Addr::Field { step: t, off: off as u16 }))
    }
}

fn next_of(a: Addr, len: u32) -> Option<Addr> {
    match a {
        Addr::Mem(x) => Some(Addr::Mem(x + len as u64)),
        Addr::Field { step, off } => Some(Addr::Field { step, off: off + len as u16 }),
    }
}

fn offset(a: Addr, by: usize) -> Addr {
    match a {
        Addr::Mem(x) => Addr::Mem(x + by as u64),
        Addr::Field { step, off } => Addr::Field { step, off: off + by as u16 },
    }
}

/// The index past the canonical entries `[0, limit)` of a ring: laps of `per_lap` units.
fn index_of(starts: &[u16], depth: usize, per_lap: usize, limit: u64) -> u16 {
    if depth == 0 {
        return 0;
    }
    let lap = limit / depth as u64;
    let pos = (limit % depth as u64) as usize;
    let within = starts.get(pos).copied().unwrap_or(0) as u64;
    (lap.wrapping_mul(per_lap as u64).wrapping_add(within) & 0xFFFF) as u16
}

/// Where each of the `depth` canonical entries of a ring starts in `unit`s of its placed
/// `items`: bumps belong to the closing ENABLE's entry (the block before it starts it); an
/// entry with no WQE of its own (a canonical bump, replaced by a shadow) starts where the next
/// one does.
fn entry_starts(
    items: &[Item],
    layout: &ChainLayout,
    closing: Option<usize>,
    depth: usize,
    unit: SendEnUnit,
    out: &mut heapless::Vec<u16, { crate::chain::MAX_STEPS }>,
) -> Result<(), Mlx5ChainError> {
    let step = |it: &Item| match unit {
        SendEnUnit::Wqebb => it.wqebbs() as u16,
        SendEnUnit::Wqe => 1,
    };
    let mut first: [Option<u16>; crate::chain::MAX_STEPS] = [None; crate::chain::MAX_STEPS];
    let mut pi = 0u16;
    for it in items.iter() {
        let entry = match it.role {
            Role::Step(s) => Some(layout.position(s as usize)),
            Role::Bump(_) => closing.map(|c| layout.position(c)),
            Role::Pad => None,
        };
        if let Some(e) = entry.filter(|e| *e < depth) {
            first[e].get_or_insert(pi);
        }
        pi += step(it);
    }
    let mut next = pi;
    let mut filled = [0u16; crate::chain::MAX_STEPS];
    for e in (0..depth).rev() {
        next = first[e].unwrap_or(next);
        filled[e] = next;
    }
    for v in filled.iter().take(depth) {
        out.push(*v).map_err(|_| Mlx5ChainError::Capacity)?;
    }
    Ok(())
}

/// The lap-closing ENABLE: the Loop ring's last FENCEd SEND_EN — of the Loop ring itself, or,
/// with relayed gates (`ChainVariant::relays_gates`), of the management ring, whose relay
/// then enables the Loop ring's next lap. The bump block runs before it.
fn closing_of(layout: &ChainLayout) -> Option<usize> {
    (0..layout.steps.len()).rev().find(|&j| {
        let s = &layout.steps[j];
        s.ring == Ring::Loop
            && s.wqe.opcode == Opcode::Enable
            && s.wqe.queue_sel() == QueueSel::Send
            && layout.qpns.contains(&s.wqe.qpn)
            && s.wqe.flags.contains(WqeFlags::FENCE)
    })
}

/// Whether the bump of the WAIT / ENABLE at `step` runs *before* the step in each lap: a step
/// after the closing ENABLE (a relay the closing releases) executes only once the bump block
/// has run, so its lap counter starts one lap behind and the bump brings the field to this
/// lap's value just before the step can be fetched (it lies beyond its ring's enable limit
/// until the closing ENABLE runs).
fn pre_bumped(layout: &ChainLayout, step: u8) -> bool {
    closing_of(layout).is_some_and(|c| step as usize > c)
}

struct Const(Option<u32>, WqeIndex);
impl QueueResolver for Const {
    fn cqn(&self, _: u32, _: QueueSel) -> Option<u32> {
        self.0
    }
    fn enable_index(&mut self, _: u32, _: QueueSel, _: u64) -> Option<WqeIndex> {
        Some(self.1)
    }
}

impl Mlx5Chain {
    /// Lay a validated canonical chain out in mlx5 form on the device queues `queues`.
    pub fn build(layout: &ChainLayout, queues: Mlx5Queues) -> Result<Self, Mlx5ChainError> {
        layout.validate().map_err(Mlx5ChainError::Invalid)?;
        let chain = Self::build_unchecked(layout, queues)?;
        chain.validate()?;
        Ok(chain)
    }

    /// [`Mlx5Chain::build`] without the canonical layout's validation or this form's: only for
    /// showing what an invalid chain does on a device model (e.g. an ungated patch under
    /// prefetching). Never for a real chain.
    pub fn build_unchecked(layout: &ChainLayout, queues: Mlx5Queues) -> Result<Self, Mlx5ChainError> {
        let (junk, shadow_base) = (layout.mlx5.junk, layout.mlx5.shadows);
        let mut b = Build {
            layout,
            items: [heapless::Vec::new(), heapless::Vec::new()],
            junk,
            recv_doorbell: queues.recv_doorbell,
        };
        let n = layout.steps.len();

        // which steps need a shadow, and their per-lap increments (ENABLE: known after layout)
        let closing = closing_of(layout);
        let mut bumped: heapless::Vec<(u8, u64, bool), MAX_SHADOWS> = heapless::Vec::new();
        if layout.rearm == Rearm::SelfEnabling {
            for (j, s) in layout.steps.iter().enumerate() {
                match s.wqe.opcode {
                    Opcode::Wait => {
                        let bump = layout.steps.iter().find(|b| {
                            b.wqe.opcode == Opcode::FetchAdd
                                && b.remote == Some(Loc::Field { step: j as u8, field: WqeField::Operand0 })
                        });
                        let bump = bump.ok_or(Mlx5ChainError::MissingBump { step: j as u8 })?;
                        let sig = bump.wqe.flags.contains(WqeFlags::SIGNALED);
                        bumped.push((j as u8, bump.wqe.operand0, sig)).map_err(|_| Mlx5ChainError::Capacity)?;
                    }
                    Opcode::Enable => {
                        bumped.push((j as u8, 0, false)).map_err(|_| Mlx5ChainError::Capacity)?;
                    }
                    _ => {}
                }
            }
        }

        // translate in ring order; the bump block goes before the closing ENABLE, its own
        // bump after it
        for ring in [Ring::Loop, Ring::Mgmt] {
            for i in (0..n).filter(|&i| layout.steps[i].ring == ring) {
                if Some(i) == closing {
                    let others: heapless::Vec<(u8, bool), MAX_SHADOWS> = bumped
                        .iter()
                        .enumerate()
                        .filter(|(_, x)| Some(x.0 as usize) != closing)
                        .map(|(k, x)| (k as u8, x.2))
                        .collect();
                    b.bumps(&others, shadow_base)?;
                }
                b.translate(i)?;
                if Some(i) == closing {
                    if let Some(k) = bumped.iter().position(|x| Some(x.0 as usize) == closing) {
                        b.bumps(&[(k as u8, false)], shadow_base)?;
                    }
                }
            }
        }

        // sizes, lap padding, positions: where each canonical entry starts, in WQEBBs (the
        // doorbell's unit) and in the unit the device counts SEND_EN indices in
        let unit = layout.mlx5.send_en_unit;
        let mut ring_wqebbs = [0usize; 2];
        let mut per_lap = [0usize; 2];
        type Starts = heapless::Vec<u16, { crate::chain::MAX_STEPS }>;
        let mut starts: [Starts; 2] = [heapless::Vec::new(), heapless::Vec::new()];
        let mut doorbell_starts: [Starts; 2] = [heapless::Vec::new(), heapless::Vec::new()];
        for ring in [Ring::Loop, Ring::Mgmt] {
            let r = ring as usize;
            let total: usize = b.items[r].iter().map(Item::wqebbs).sum();
            let size = if total == 0 { 0 } else { total.next_power_of_two() };
            if size > MAX_RING_WQEBBS {
                return Err(Mlx5ChainError::Capacity);
            }
            for _ in total..size {
                let nop = Item {
                    kind: Kind::Wqe { wqe: Wqe::nop().with_flags(WqeFlags::empty()), remote: None },
                    flags: WqeFlags::empty(),
                    role: Role::Pad,
                };
                b.push(ring, nop)?;
            }
            ring_wqebbs[r] = size;
            per_lap[r] = match unit {
                SendEnUnit::Wqebb => size,
                SendEnUnit::Wqe => b.items[r].len(),
            };
            let d = layout.ring_depth[r] as usize;
            entry_starts(&b.items[r], layout, closing, d, SendEnUnit::Wqebb, &mut doorbell_starts[r])?;
            entry_starts(&b.items[r], layout, closing, d, unit, &mut starts[r])?;
        }

        // lap-0 device values of every WAIT and ENABLE
        let depth = layout.ring_depth.map(|d| d as usize);
        let mut limit = layout.initial_enable.map(u64::from);
        let mut recv_limit = layout.initial_recv_enable as u64;
        let mut values: heapless::Vec<(u8, u64), { crate::chain::MAX_STEPS }> = heapless::Vec::new();
        for (j, s) in layout.steps.iter().enumerate() {
            let w = &s.wqe;
            let v = match w.opcode {
                Opcode::Wait => CqIndex::from_count(wait_target(layout.qpns, &queues, w)).get() as u64,
                Opcode::Enable if w.queue_sel() == QueueSel::Recv => {
                    recv_limit += w.operand0;
                    recv_limit & 0xFFFF
                }
                Opcode::Enable => {
                    let t = if w.qpn == layout.qpns[0] { 0 } else { 1 };
                    limit[t] += w.operand0;
                    index_of(&starts[t], depth[t], per_lap[t], limit[t]) as u64
                }
                _ => continue,
            };
            values.push((j as u8, v)).map_err(|_| Mlx5ChainError::Capacity)?;
        }
        let value_of = |j: u8| values.iter().find(|x| x.0 == j).map(|x| x.1).unwrap_or(0);

        let mut shadows: heapless::Vec<Shadow, MAX_SHADOWS> = heapless::Vec::new();
        for (k, (j, inc, _)) in bumped.iter().enumerate() {
            let w = &layout.steps[*j as usize].wqe;
            let (increment, bits) = match w.opcode {
                Opcode::Wait => (*inc, 24),
                _ if w.queue_sel() == QueueSel::Recv => (1, 16),
                _ => {
                    let t = if w.qpn == layout.qpns[0] { 0 } else { 1 };
                    (per_lap[t] as u64, 16)
                }
            };
            let field_mask = (1u64 << bits) - 1;
            let initial =
                if pre_bumped(layout, *j) { value_of(*j).wrapping_sub(increment) & field_mask } else { value_of(*j) };
            let pushed =
                shadows.push(Shadow { addr: shadow_base + SHADOW_SIZE * k as u64, initial, increment, bits, step: *j });
            debug_assert!(pushed.is_ok(), "one shadow per bumped step: bumped holds at most MAX_SHADOWS");
        }

        // encode
        let mut rings = [heapless::Vec::new(), heapless::Vec::new()];
        let mut placed = [heapless::Vec::new(), heapless::Vec::new()];
        let mut main_off = [usize::MAX; crate::chain::MAX_STEPS];
        for ring in [Ring::Loop, Ring::Mgmt] {
            let r = ring as usize;
            let mut pi = 0u16;
            for it in b.items[r].iter() {
                if let (Role::Step(s), Kind::Wqe { .. }) = (it.role, &it.kind) {
                    if main_off[s as usize] == usize::MAX {
                        main_off[s as usize] = pi as usize * WQEBB;
                    }
                }
                placed[r]
                    .push(Placed { role: it.role, pi, wqebbs: it.wqebbs() as u8 })
                    .map_err(|_| Mlx5ChainError::Capacity)?;
                pi += it.wqebbs() as u16;
            }
            rings[r].resize(ring_wqebbs[r] * WQEBB, 0).map_err(|_| Mlx5ChainError::Capacity)?;
        }
        let resolve = |a: Addr| -> u64 {
            match a {
                Addr::Mem(x) => x,
                Addr::Field { step, off } => {
                    let ring = layout.steps.get(step as usize).map(|s| s.ring).unwrap_or(Ring::Loop);
                    queues.ring_bases[ring as usize] + main_off[step as usize] as u64 + off as u64
                }
            }
        };
        let cqn_of = |w: &Wqe| -> Option<u32> { cq_slot(layout.qpns, w).map(|i| queues.cqns[i]) };
        for ring in [Ring::Loop, Ring::Mgmt] {
            let r = ring as usize;
            let mut pi = WqeIndex::new(0);
            let mut fence_next = false;
            let qpn = layout.qpns[r];
            for it in b.items[r].iter() {
                let prev = if fence_next { PrevWqe::Umr } else { PrevWqe::Other };
                let e = match &it.kind {
                    Kind::Wqe { wqe, remote } => {
                        let mut w = *wqe;
                        if w.opcode == Opcode::Wait {
                            w.operand0 = wait_target(layout.qpns, &queues, &w);
                        }
                        if let Some(a) = remote {
                            w.remote_addr = resolve(*a);
                        }
                        let step = match it.role {
                            Role::Step(s) => s,
                            _ => 0,
                        };
                        let mut res = Const(cqn_of(&w), WqeIndex::new(value_of(step) as u16));
                        fence_next = encode::is_umr(&w);
                        encode(&w, pi, qpn, prev, &mut res)?
                    }
                    Kind::Read { src, rkey, sges } => {
                        let segs: heapless::Vec<DataSeg, MAX_SCATTER_SGES> =
                            sges.iter().map(|s| DataSeg::new(s.len, s.lkey, resolve(s.dst))).collect();
                        fence_next = false;
                        let f = encode::fm_ce_se(it.flags, prev);
                        encode_scatter_read(resolve(*src), *rkey, &segs, pi, qpn, f)?
                    }
                    Kind::Bump { shadow } => {
                        let sh = shadows.get(*shadow as usize).ok_or(Mlx5ChainError::Capacity)?;
                        let k = layout.mlx5;
                        let w = Wqe::masked_fetch_add(
                            junk,
                            k.meta_lkey,
                            sh.addr,
                            k.meta_rkey,
                            sh.increment,
                            1 << (sh.bits - 1),
                        )
                        .with_flags(it.flags);
                        fence_next = false;
                        encode(&w, pi, qpn, prev, &mut Const(None, WqeIndex::new(0)))?
                    }
                };
                let off = pi.slot(ring_wqebbs[r].max(1)) * WQEBB;
                let bytes = e.bytes();
                rings[r].get_mut(off..off + bytes.len()).ok_or(Mlx5ChainError::Capacity)?.copy_from_slice(bytes);
                pi = pi.add(e.wqebbs() as u16);
            }
        }

        // the RECV: the header into scratch, request fields byte-reversed into WQE fields
        let mut recv: heapless::Vec<RecvSge, MAX_RECV_SGES> = heapless::Vec::new();
        let mut add = |addr: u64, lkey: u32| -> Result<(), Mlx5ChainError> {
            if let Some(l) = recv.last_mut() {
                if l.lkey == lkey && l.addr + l.length as u64 == addr {
                    l.length += 1;
                    return Ok(());
                }
            }
            recv.push(RecvSge { addr, length: 1, lkey }).map_err(|_| Mlx5ChainError::Capacity)
        };
        for t in layout.recv.iter() {
            match t.loc {
                Loc::Mem(a) => {
                    for k in 0..t.len as u64 {
                        add(a + k, layout.meta_lkey)?;
                    }
                }
                Loc::RecvDoorbell => {
                    return Err(Mlx5ChainError::Invalid(ChainError::MisplacedRecvDoorbell { step: 0 }))
                }
                Loc::Field { step, field } => {
                    for f in covered(field, t.len) {
                        let d = b.field_dests(step, f)?;
                        if d.len() != 1 {
                            return Err(Mlx5ChainError::RecvNeedsTwoTargets { step, field: f });
                        }
                        let (m, a) = d[0];
                        for (v, dst) in a.iter().enumerate().take(f.width()) {
                            if v < m {
                                add(resolve(*dst), layout.ring_lkey)?;
                            } else {
                                add(junk + v as u64, layout.meta_lkey)?;
                            }
                        }
                    }
                }
            }
        }

        // the doorbell counts WQEBBs whatever unit SEND_EN counts in
        let initial_index =
            [0, 1].map(|r| index_of(&doorbell_starts[r], depth[r], ring_wqebbs[r], layout.initial_enable[r] as u64));
        let chain = Mlx5Chain {
            kind: layout.kind,
            qpns: layout.qpns,
            queues,
            rings,
            placed,
            recv,
            shadows,
            initial_index,
            canonical: layout.clone(),
        };
        Ok(chain)
    }

    /// Where the chain publishes its own receives (`ChainEnv::posts_receives`): the count the
    /// arm writes into the receive doorbell record (rdma-core's `htobe32(count & 0xffff)`)
    /// after filling every receive slot — the first lap's receive where the lap's tail admits
    /// the next request, none where each lap admits its own. `None`: the device's receives are
    /// posted as usual.
    pub fn published_at_arm(&self) -> Option<u16> {
        self.canonical.recv_publish().map(|_| self.canonical.initial_recv_enable)
    }

    /// The wr_id a completion of the WQE at `placed[ring][k]` reports: its canonical step's
    /// (mlx5 keeps no wr_id in the WQE; a driver maps the WQE index back), the fed step's for
    /// a lap-counter bump, the last step's for padding.
    pub fn wr_id_of(&self, ring: Ring, k: usize) -> u64 {
        let step = match self.placed[ring as usize].get(k).map(|p| p.role) {
            Some(Role::Step(s)) | Some(Role::Bump(s)) => s as usize,
            _ => self.canonical.steps.len().saturating_sub(1),
        };
        self.canonical.steps.get(step).map_or(0, |s| s.wqe.wr_id)
    }

    /// The canonical layout this form was built from.
    pub fn canonical(&self) -> &ChainLayout {
        &self.canonical
    }

    pub fn ring_wqebbs(&self, ring: Ring) -> usize {
        self.rings[ring as usize].len() / WQEBB
    }

    /// How far one lap moves `ring`'s SEND_EN index: its WQEBBs or its WQEs, in the unit the
    /// chain was laid out for (`Mlx5Scratch::send_en_unit`).
    pub fn enable_per_lap(&self, ring: Ring) -> usize {
        match self.canonical.mlx5.send_en_unit {
            SendEnUnit::Wqebb => self.ring_wqebbs(ring),
            SendEnUnit::Wqe => self.placed[ring as usize].len(),
        }
    }

    /// What one lap executes in this form.
    pub fn lap_cost(&self) -> LapCost {
        let mut c = LapCost::default();
        for r in 0..2 {
            c.wqes[r] = self.placed[r].len();
            c.wqebbs[r] = self.rings[r].len() / WQEBB;
            c.bumps[r] = self.placed[r].iter().filter(|p| matches!(p.role, Role::Bump(_))).count();
            c.padding[r] = self.placed[r]
                .iter()
                .filter(|p| match p.role {
                    Role::Pad => true,
                    Role::Step(s) => self.canonical.steps.get(s as usize).is_some_and(|x| x.wqe.opcode == Opcode::Nop),
                    Role::Bump(_) => false,
                })
                .count();
        }
        c
    }

    /// Decode the WQE at `pi` of `ring` (lap 0).
    pub fn decode_at(&self, ring: Ring, pi: u16) -> Result<crate::mlx5::decode::Decoded, Mlx5Error> {
        let off = pi as usize * WQEBB;
        decode(self.rings[ring as usize].get(off..).unwrap_or(&[]))
    }

    /// The ring (and byte offset in its image) an MN address falls in.
    fn ring_at(&self, addr: u64) -> Option<(Ring, usize)> {
        for ring in [Ring::Loop, Ring::Mgmt] {
            let base = self.queues.ring_bases[ring as usize];
            let len = self.rings[ring as usize].len() as u64;
            if addr >= base && addr < base + len {
                return Some((ring, (addr - base) as usize));
            }
        }
        None
    }

    fn main_placed(&self, step: u8) -> Option<&Placed> {
        let ring = self.canonical.steps.get(step as usize)?.ring;
        self.placed[ring as usize].iter().find(|p| p.role == Role::Step(step))
    }

    /// The static checks of the mlx5 form, from its bytes: the canonical layout validates
    /// (happens-before is the canonical one: every canonical step keeps its position, FENCE and
    /// completion); every WQE decodes at its own index and no WQE crosses the ring's end; each
    /// lap is exactly one ring; every byte written into a ring lies in a patch target of
    /// exactly one WQE, and each patch writes exactly its target's value bytes; no atomic
    /// targets a WQE; every CQ sees the canonical completions per lap; every WAIT and ENABLE
    /// names the device numbers of lap 0 and has its shadow counter.
    pub fn validate(&self) -> Result<(), Mlx5ChainError> {
        self.canonical.validate().map_err(Mlx5ChainError::Invalid)?;
        let bad = Mlx5ChainError::Inconsistent;
        // writes into ring bytes: (producer role, ring, offset, len)
        let mut writes: heapless::Vec<(Role, Ring, usize, usize), 512> = heapless::Vec::new();
        for ring in [Ring::Loop, Ring::Mgmt] {
            let r = ring as usize;
            let size = self.ring_wqebbs(ring);
            let mut pi = 0usize;
            let mut signaled = 0u64;
            for p in self.placed[r].iter() {
                if p.pi as usize != pi || pi + p.wqebbs as usize > size {
                    return Err(bad(Inconsistency::Wrap { ring }));
                }
                let d = self.decode_at(ring, p.pi).map_err(|_| bad(Inconsistency::Undecodable { ring, pi: p.pi }))?;
                if d.index.get() != p.pi
                    || d.qpn != self.qpns[r]
                    || crate::mlx5::wqebb::wqebbs(d.ds) != p.wqebbs as usize
                {
                    return Err(bad(Inconsistency::Undecodable { ring, pi: p.pi }));
                }
                if d.fm_ce_se.signaled() {
                    signaled += 1;
                }
                let mut note = |a: u64, len: usize| -> Result<(), Mlx5ChainError> {
                    if let Some((rr, off)) = self.ring_at(a) {
                        writes.push((p.role, rr, off, len)).map_err(|_| Mlx5ChainError::Capacity)?;
                    }
                    Ok(())
                };
                match &d.op {
                    Mlx5Op::Read { local: Some(Local { addr, length, .. }), .. } => note(*addr, *length as usize)?,
                    Mlx5Op::ScatterRead { sges, .. } => {
                        for l in sges.as_slice() {
                            note(l.addr, l.length as usize)?;
                        }
                    }
                    Mlx5Op::Write { remote, local, .. } => note(*remote, local.map_or(0, |l| l.length as usize))?,
                    Mlx5Op::FetchAdd { remote, .. }
                    | Mlx5Op::MaskedFetchAdd { remote, .. }
                    | Mlx5Op::CompareSwap { remote, .. }
                        if self.ring_at(*remote).is_some() =>
                    {
                        return Err(bad(Inconsistency::AtomicOnRing { ring }))
                    }
                    Mlx5Op::Wait { cqn, pi: c } => {
                        let Role::Step(s) = p.role else { return Err(bad(Inconsistency::QueueField { step: 0 })) };
                        let w = &self.canonical.steps[s as usize].wqe;
                        let want = cq_slot(self.qpns, w).map(|i| self.queues.cqns[i]);
                        let target = CqIndex::from_count(wait_target(self.qpns, &self.queues, w));
                        if Some(*cqn) != want || *c != target || !self.has_shadow(s) {
                            return Err(bad(Inconsistency::QueueField { step: s }));
                        }
                    }
                    Mlx5Op::SendEn { max_index, .. } | Mlx5Op::RecvEn { max_index, .. } => {
                        let Role::Step(s) = p.role else { return Err(bad(Inconsistency::QueueField { step: 0 })) };
                        let sh = self.shadows.iter().find(|x| x.step == s);
                        let rearm = self.canonical.rearm == Rearm::SelfEnabling;
                        // a pre-bumped counter starts one lap behind its field
                        let lap0 = |x: &Shadow| {
                            let ahead = if pre_bumped(&self.canonical, s) { x.increment } else { 0 };
                            x.initial.wrapping_add(ahead) & ((1u64 << x.bits) - 1)
                        };
                        if rearm && sh.map(lap0) != Some(max_index.get() as u64) {
                            return Err(bad(Inconsistency::QueueField { step: s }));
                        }
                    }
                    _ => {}
                }
                pi += p.wqebbs as usize;
            }
            if pi != size || !size.is_power_of_two() && size != 0 {
                return Err(bad(Inconsistency::Wrap { ring }));
            }
            if signaled != self.canonical.completions_per_lap()[r] {
                return Err(bad(Inconsistency::Completions { ring }));
            }
        }
        self.check_bumps()?;
        for s in self.recv.iter() {
            if let Some((rr, off)) = self.ring_at(s.addr) {
                writes.push((Role::Step(u8::MAX), rr, off, s.length as usize)).map_err(|_| Mlx5ChainError::Capacity)?;
            }
        }
        // every written byte inside one WQE's patch targets
        for &(_, ring, off, len) in writes.iter() {
            let stray = bad(Inconsistency::StrayWrite { ring, offset: off });
            let p = self.placed[ring as usize]
                .iter()
                .find(|p| {
                    let a = p.pi as usize * WQEBB;
                    off >= a && off < a + p.wqebbs as usize * WQEBB
                })
                .ok_or(stray)?;
            let Role::Step(t) = p.role else { return Err(stray) };
            let w = &self.canonical.steps[t as usize].wqe;
            let base = p.pi as usize * WQEBB;
            for byte in off..off + len {
                let inside = WqeField::ALL.iter().any(|f| {
                    let patched = self.covers(t, *f);
                    patched
                        && matches!(field_mapping(w, *f), FieldMapping::Targets(ts) if ts.iter().any(|tg| {
                            let a = base + tg.offset;
                            byte >= a && byte < a + tg.width as usize
                        }))
                });
                if !inside {
                    return Err(stray);
                }
            }
        }
        // each patched target: exactly its value bytes, by its producers
        for (t, s) in self.canonical.steps.iter().enumerate() {
            let Some(p) = self.main_placed(t as u8) else { continue };
            let base = p.pi as usize * WQEBB;
            for f in WqeField::ALL {
                let patched = self.covers(t as u8, f);
                if !patched {
                    continue;
                }
                let FieldMapping::Targets(ts) = field_mapping(&s.wqe, f) else {
                    return Err(Mlx5ChainError::Unsupported { step: t as u8, field: f });
                };
                for tg in ts.iter() {
                    let (a, b) = (base + tg.offset, base + tg.offset + tg.width as usize);
                    let lo = b - significant(tg);
                    // per producer (a step, the RECV, the bumps), the bytes it writes here
                    let mut producers: heapless::Vec<(Role, u64), 16> = heapless::Vec::new();
                    for &(role, ring, off, len) in writes.iter() {
                        if ring != s.ring {
                            continue;
                        }
                        let mut mask = 0u64;
                        for byte in off.max(a)..(off + len).min(b) {
                            mask |= 1 << (byte - a);
                        }
                        if mask == 0 {
                            continue;
                        }
                        let role = match role {
                            Role::Bump(_) => Role::Bump(0),
                            r => r,
                        };
                        match producers.iter_mut().find(|x| x.0 == role) {
                            Some(x) => x.1 |= mask,
                            None => producers.push((role, mask)).map_err(|_| Mlx5ChainError::Capacity)?,
                        }
                    }
                    let want: u64 = (lo - a..b - a).fold(0, |m, k| m | 1 << k);
                    let zero_clear = |r: &Role| match r {
                        Role::Step(x) => {
                            self.canonical.steps.get(*x as usize).is_some_and(|st| st.wqe.opcode == Opcode::Write)
                        }
                        _ => false,
                    };
                    // a clear may zero the whole target; every other producer writes exactly
                    // the value bytes
                    let ok = !producers.is_empty()
                        && producers.iter().all(|(r, m)| *m == want || (zero_clear(r) && *m & want == want));
                    if !ok {
                        return Err(bad(Inconsistency::TargetWidth { step: t as u8, field: f }));
                    }
                }
            }
        }
        Ok(())
    }

    /// The shadow counters advance by the device's per-lap amounts, and their bumps run where
    /// they cannot race: after the WQE they rewrite executed this lap, before the closing
    /// FENCEd ENABLE releases the next lap (the closing ENABLE's own bump right after it), each
    /// block's fetch-and-adds before its first copy, which is FENCEd.
    fn check_bumps(&self) -> Result<(), Mlx5ChainError> {
        let c = &self.canonical;
        if c.rearm != Rearm::SelfEnabling {
            return Ok(());
        }
        let bad = |step| Mlx5ChainError::Inconsistent(Inconsistency::QueueField { step });
        for sh in self.shadows.iter() {
            let w = &c.steps[sh.step as usize].wqe;
            let want = match (w.opcode, w.queue_sel()) {
                (Opcode::Wait, _) => c
                    .steps
                    .iter()
                    .find(|b| b.remote == Some(Loc::Field { step: sh.step, field: WqeField::Operand0 }))
                    .map(|b| b.wqe.operand0),
                (_, QueueSel::Recv) => Some(1),
                _ if w.qpn == self.qpns[0] => Some(self.enable_per_lap(Ring::Loop) as u64),
                _ => Some(self.enable_per_lap(Ring::Mgmt) as u64),
            };
            if want != Some(sh.increment) {
                return Err(bad(sh.step));
            }
        }
        let closing = closing_of(c);
        let closing = closing.ok_or(bad(0))? as u8;
        let close_pi = self.main_placed(closing).ok_or(bad(closing))?.pi;
        let mut blocks: [(bool, bool); 2] = [(false, false); 2]; // (a copy seen, fetch-and-add after it)
        for p in self.placed[0].iter() {
            let Role::Bump(j) = p.role else { continue };
            let after = p.pi > close_pi;
            if (j == closing) != after {
                return Err(bad(j));
            }
            if c.steps[j as usize].ring == Ring::Loop && j != closing {
                let own = self.main_placed(j).ok_or(bad(j))?.pi;
                if p.pi < own {
                    return Err(bad(j));
                }
            }
            let d = self.decode_at(Ring::Loop, p.pi).map_err(|_| bad(j))?;
            let b = &mut blocks[after as usize];
            match d.op {
                Mlx5Op::MaskedFetchAdd { .. } if b.0 => b.1 = true,
                Mlx5Op::MaskedFetchAdd { .. } => {}
                _ if !b.0 => {
                    if !d.fm_ce_se.fence.fences_reads_and_atomics() {
                        return Err(bad(j));
                    }
                    b.0 = true;
                }
                _ => {}
            }
            if b.1 {
                return Err(bad(j));
            }
        }
        Ok(())
    }

    fn has_shadow(&self, step: u8) -> bool {
        self.canonical.rearm != Rearm::SelfEnabling || self.shadows.iter().any(|s| s.step == step)
    }

    /// Whether some producer writes `f` of step `step`: a patch (spans included), the RECV, a
    /// clear, or a shadow copy.
    fn covers(&self, step: u8, f: WqeField) -> bool {
        let hit = |loc: Option<Loc>, len: u32| match loc {
            Some(Loc::Field { step: t, field }) if t == step => covered(field, len).any(|c| c == f),
            _ => false,
        };
        let c = &self.canonical;
        let by_step = c.steps.iter().any(|s| {
            let ring_read = s.wqe.opcode == Opcode::Read && s.remote.is_some();
            hit(s.local, s.wqe.length)
                || (!ring_read && s.wqe.opcode != Opcode::FetchAdd && hit(s.remote, s.wqe.length))
        });
        by_step || c.recv.iter().any(|r| hit(Some(r.loc), r.len)) || self.is_bumped(step, f)
    }

    fn is_bumped(&self, step: u8, f: WqeField) -> bool {
        f == WqeField::Operand0 && self.shadows.iter().any(|s| s.step == step)
    }
}

impl Build<'_> {
    /// The bumps of shadows `ks`: every fetch-and-add, then the FENCEd copies (one FENCE
    /// covers them all), each byte-reversed into its field.
    fn bumps(&mut self, ks: &[(u8, bool)], shadow_base: u64) -> Result<(), Mlx5ChainError> {
        let mut steps: heapless::Vec<u8, MAX_SHADOWS> = heapless::Vec::new();
        let mut k_of = 0usize;
        // which canonical step each shadow k feeds: the k-th WAIT/ENABLE in step order
        let layout = self.layout;
        let feeds = |k: u8| {
            layout
                .steps
                .iter()
                .enumerate()
                .filter(|(_, s)| matches!(s.wqe.opcode, Opcode::Wait | Opcode::Enable))
                .nth(k as usize)
                .map(|(j, _)| j as u8)
        };
        for (k, _) in ks {
            let j = feeds(*k).ok_or(Mlx5ChainError::Capacity)?;
            steps.push(j).map_err(|_| Mlx5ChainError::Capacity)?;
            self.push(
                Ring::Loop,
                Item { kind: Kind::Bump { shadow: *k }, flags: WqeFlags::empty(), role: Role::Bump(j) },
            )?;
        }
        for ((k, signaled), j) in ks.iter().zip(steps.iter()) {
            let w = *self.step_wqe(*j)?;
            let tg = targets_of(&w, WqeField::Operand0, *j)?;
            let tg = tg.first().ok_or(Mlx5ChainError::Unsupported { step: *j, field: WqeField::Operand0 })?;
            let n = significant(tg);
            let mut moves: Moves = heapless::Vec::new();
            for v in 0..n {
                let d = one_dest(Addr::Field { step: *j, off: (tg.offset + tg.width as usize - 1 - v) as u16 });
                moves.push(d).map_err(|_| Mlx5ChainError::Capacity)?;
            }
            let mut flags = if k_of == 0 { WqeFlags::FENCE } else { WqeFlags::empty() };
            if *signaled {
                flags |= WqeFlags::SIGNALED;
            }
            k_of += 1;
            let src = Addr::Mem(shadow_base + SHADOW_SIZE * *k as u64);
            let (rkey, lkey) = (self.layout.mlx5.meta_rkey, self.layout.mlx5.ring_lkey);
            self.emit_copy(Ring::Loop, Role::Bump(*j), flags, src, rkey, lkey, &moves)?;
        }
        Ok(())
    }
}

/// Send-queue depths (WQEBBs) the mlx5 form of `layout` needs, [Loop, Mgmt]: a chain's QPs are
/// created with exactly these (each ring is one lap). Independent of the device numbers.
pub fn ring_wqebbs(layout: &ChainLayout) -> Result<[u16; 2], Mlx5ChainError> {
    let c = lap_cost(layout, WqeFormat::Mlx5)?;
    Ok([c.wqebbs[0] as u16, c.wqebbs[1] as u16])
}

/// WQEs and WQEBBs per lap of a chain in `format` (the canonical form: one 64-byte WQE per
/// entry, as docs/CHAINS.md counts them).
pub fn lap_cost(layout: &ChainLayout, format: WqeFormat) -> Result<LapCost, Mlx5ChainError> {
    match format {
        WqeFormat::Canonical => {
            let mut c = LapCost::default();
            for r in [Ring::Loop, Ring::Mgmt] {
                let i = r as usize;
                c.wqes[i] = layout.ring_depth[i] as usize;
                c.wqebbs[i] = layout.ring_depth[i] as usize * WQE_SIZE / WQEBB;
                c.padding[i] = layout.steps.iter().filter(|s| s.ring == r && s.wqe.opcode == Opcode::Nop).count();
                c.bumps[i] = layout
                    .steps
                    .iter()
                    .filter(|s| {
                        s.ring == r && s.wqe.opcode == Opcode::FetchAdd && matches!(s.remote, Some(Loc::Field { .. }))
                    })
                    .count();
            }
            Ok(c)
        }
        WqeFormat::Mlx5 => {
            let q = Mlx5Queues::new([0x11, 0x12, 0x13], [1 << 40, (1 << 40) + (1 << 20)]);
            Ok(Mlx5Chain::build(layout, q)?.lap_cost())
        }
    }
}

#[cfg(test)]
mod tests;
