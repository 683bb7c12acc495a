//! Chain layouts: a pre-posted WR chain as data, and its static validator.
//!
//! A chain spans three queues of the MN: the receive queue of a management QP (whose RECV
//! scatters the request bytes), the send queue of the MN end of that management QP (`Mgmt`),
//! and the send queue of the MN's loopback QP (`Loop`, which reaches the MN's own memory for
//! the queue atomics, the MWTable READs and the WQE patches). Steps are listed in a global
//! order that is a valid sequential execution (the host engine runs exactly that order); the
//! NIC instead runs each ring independently, gated only by WAIT and ENABLE, and ordered within
//! a QP by FENCE and the fence after a bind. The validator proves the two agree: every patched
//! WQE field is complete before its WQE can be *fetched*, every scratch word before the step
//! that reads or overwrites it *executes* ([`ChainLayout::happens_before`]); nothing runs before
//! the empty probe or ownership check has completed, nor the reply or push before the window
//! operations. [`ChainLayout::critical_path`] counts the gated phases to the reply or push.
//!
//! Re-arming: both send rings are managed (they execute only up to an ENABLE limit, and ENABLE
//! advances that limit by a count) and the chain closes each lap by bumping every WAIT's
//! absolute CQ count with a fetch-and-add on the WQE field, then — fenced behind those
//! atomics — enabling the next lap. The MN CPU arms a chain once per connection and
//! again only after a failure.

pub mod alloc;
pub mod arm;
pub mod builder;
pub mod free;
pub mod mlx5;
pub mod variant;

use crate::wire::wqe::{Opcode, QueueSel, Wqe, WqeField, WQE_SIZE};
use core::fmt;

pub const MAX_STEPS: usize = 120;
pub const MAX_RECV_TARGETS: usize = crate::wire::wqe::MAX_RECV_SGES;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Ring {
    /// Send queue of the MN's loopback QP (MN → MN memory).
    Loop = 0,
    /// Send queue of the MN end of the CN's management QP.
    Mgmt = 1,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum ChainKind {
    Alloc,
    Free,
}

impl ChainKind {
    /// The CN's other chain.
    pub const fn other(self) -> ChainKind {
        match self {
            ChainKind::Alloc => ChainKind::Free,
            ChainKind::Free => ChainKind::Alloc,
        }
    }
}

/// Where bytes go or come from, resolved when the chain is armed.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Loc {
    /// A concrete MN-memory address (scratch, queue, table).
    Mem(u64),
    /// A field (or span of consecutive fields starting at `field`) of a chain WQE.
    Field { step: u8, field: WqeField },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Step {
    pub ring: Ring,
    /// The template, with lap-0 values; addresses given by `local`/`remote` are filled at arm.
    pub wqe: Wqe,
    /// If `Some(Loc::Field)`, the local address is that WQE field (a patch).
    pub local: Option<Loc>,
    /// If `Some(Loc::Field)`, the remote address is that WQE field (a lap bump).
    pub remote: Option<Loc>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RecvTarget {
    pub loc: Loc,
    pub len: u32,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Rearm {
    /// The chain bumps its own WAIT counts / ENABLE limits and enables its next lap.
    SelfEnabling,
    /// The MN CPU re-posts it after each run (portable host-engine mode).
    Host,
}

#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ChainLayout {
    pub kind: ChainKind,
    pub steps: heapless::Vec<Step, MAX_STEPS>,
    /// Scatter list of the trigger RECV on the management QP.
    pub recv: heapless::Vec<RecvTarget, MAX_RECV_TARGETS>,
    /// QP numbers of the MN ends: [Loop, Mgmt].
    pub qpns: [u32; 2],
    /// Entries of each ring enabled when the chain is armed (the first lap's prefix).
    pub initial_enable: [u16; 2],
    /// Receives the arm enables on the management QP: 1 where each lap's tail admits the next
    /// lap's request, 0 where each lap opens by admitting its own
    /// (`ChainVariant::lap_enables_its_receive`).
    pub initial_recv_enable: u16,
    pub rearm: Rearm,
    /// Largest send-queue depth the chain's QPs may have.
    pub queue_depth: u16,
    /// Send-queue depth each ring needs ([Loop, Mgmt]): its length, a power of two (the
    /// builders pad with NOPs). The chain's QPs must be created with exactly these depths.
    pub ring_depth: [u16; 2],
    /// Keys the arm step needs for the RECV scatter entries: metadata MR and ring MR lkeys.
    pub meta_lkey: u32,
    pub ring_lkey: u32,
    /// MN memory the chain's steps may name: `[meta_base, meta_base + meta_len)`.
    pub meta: (u64, u64),
    /// A read-only source the chain may read from besides the metadata: the MN-private chunk
    /// of zeros the free chain scrubs from (`(0, 0)`: none). Nothing may write it.
    pub zero_source: (u64, u64),
    /// Step index whose failure means "the free queue is empty" (alloc chain).
    pub empty_probe: Option<u8>,
    /// Step index whose failure means "the caller does not own that chunk" (free chain).
    pub ownership_check: Option<u8>,
    /// The step the chain exists for — the reply WRITE (alloc), the push onto the free queue
    /// (free): [`ChainLayout::critical_path`] counts the gates before it.
    pub critical_end: Option<u8>,
    /// The WAIT for the request's RECV, where a chain prepares before it (the alloc chain pops
    /// its group ahead): what comes before it runs before the request arrives, and
    /// [`ChainLayout::critical_path`] counts from it. `None`: the chain starts with it.
    pub request_wait: Option<u8>,
    /// What the mlx5 form adds in MN memory and with which keys (unused by the canonical form).
    pub mlx5: Mlx5Scratch,
}

/// The scratch and the loop-domain keys the mlx5 form of a chain uses besides the canonical
/// steps' own (`crate::chain::mlx5`): its little-endian lap counters and a junk word for bytes
/// a byte-reversing copy or a fetch-and-add must put somewhere.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Mlx5Scratch {
    pub shadows: u64,
    pub junk: u64,
    pub meta_lkey: u32,
    pub meta_rkey: u32,
    pub ring_lkey: u32,
    /// The unit the device counts SEND_EN indices in (the chain's variant,
    /// `chain::variant`): the mlx5 form's enable indices and their lap counters use it.
    pub send_en_unit: crate::device::behaviour::SendEnUnit,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ChainError {
    /// More steps on one ring than the QP's send queue holds.
    ChainTooLong {
        ring: Ring,
        steps: usize,
        depth: u16,
    },
    /// A step or scatter entry names a step that does not exist.
    BadStepRef {
        step: u8,
    },
    /// A patch writes a field the target opcode does not allow to be patched.
    NotPatchable {
        step: u8,
        field: WqeField,
    },
    /// A patch's length does not cover exactly whole patchable fields.
    PatchOutsideField {
        step: u8,
        field: WqeField,
        len: u32,
    },
    /// The producer of a patched field is not guaranteed complete when the consumer can be
    /// fetched: the NIC may execute the stale template.
    UngatedPatch {
        producer: Producer,
        consumer: u8,
    },
    /// A step reads MN memory an earlier step writes, without a gate between them.
    UngatedDependency {
        producer: Producer,
        consumer: u8,
    },
    /// A step beyond a ring's initial enable is never released by an ENABLE.
    NeverEnabled {
        step: u8,
    },
    /// A WAIT waits for more completions than the lap produces before it.
    WaitNeverSatisfied {
        step: u8,
    },
    /// A self-enabling chain lacks a bump for a WAIT/ENABLE or a lap-closing ENABLE.
    MissingRearm {
        step: u8,
    },
    /// An address outside the MN's metadata region.
    OutOfRegion {
        step: u8,
    },
    /// A patch target comes before its producer in the global order.
    PatchBackwards {
        producer: Producer,
        consumer: u8,
    },
    /// A step after the empty probe or the ownership check can execute before that check has
    /// completed: it could take effect although the check fails.
    UncheckedEffect {
        check: u8,
        step: u8,
    },
    /// Something the next lap's request overwrites (a RECV target) is still being read or
    /// written when the next RECV is enabled.
    RecvReuse {
        step: u8,
    },
    /// An address or key the request scatters into a WQE is not cleared for the next lap: a
    /// later request too short to supply its own would reuse this one's.
    Replayable {
        step: u8,
        field: WqeField,
    },
    TooManySteps,
    /// The chain has no mlx5 form within that form's fixed capacities (`crate::chain::mlx5`).
    NoMlx5Form,
}

/// Who wrote a byte: a step, or the trigger RECV.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Producer {
    Step(u8),
    Recv,
}

impl fmt::Display for Producer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Producer::Step(s) => write!(f, "step {s}"),
            Producer::Recv => f.write_str("the trigger RECV"),
        }
    }
}

impl fmt::Display for ChainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ChainTooLong { ring, steps, depth } => {
                write!(f, "{steps} steps on the {ring:?} ring exceed the queue depth {depth}")
            }
            Self::BadStepRef { step } => write!(f, "reference to missing step {step}"),
            Self::NotPatchable { step, field } => write!(f, "field {field:?} of step {step} is not patchable"),
            Self::PatchOutsideField { step, field, len } => {
                write!(f, "patch of {len} bytes at {field:?} of step {step} does not cover whole patchable fields")
            }
            Self::UngatedPatch { producer, consumer } => write!(
                f,
                "step {consumer} is patched by {producer} but not gated on its completion (the NIC may fetch it first)"
            ),
            Self::UngatedDependency { producer, consumer } => {
                write!(f, "step {consumer} reads memory written by {producer} without a gate")
            }
            Self::NeverEnabled { step } => write!(f, "step {step} is never enabled"),
            Self::WaitNeverSatisfied { step } => write!(f, "WAIT at step {step} can never be satisfied"),
            Self::MissingRearm { step } => write!(f, "step {step} is not re-armed for the next lap"),
            Self::OutOfRegion { step } => write!(f, "step {step} addresses memory outside the MN metadata region"),
            Self::PatchBackwards { producer, consumer } => {
                write!(f, "step {consumer} is patched by the later {producer}")
            }
            Self::UncheckedEffect { check, step } => {
                write!(f, "step {step} can execute before the check at step {check} has completed")
            }
            Self::RecvReuse { step } => {
                write!(f, "step {step} may still use a RECV target when the next RECV is enabled")
            }
            Self::Replayable { step, field } => {
                write!(f, "{field:?} of step {step} comes from the request but is not cleared for the next lap")
            }
            Self::TooManySteps => write!(f, "chain exceeds {MAX_STEPS} steps"),
            Self::NoMlx5Form => f.write_str("chain has no mlx5 form within its fixed capacities"),
        }
    }
}

type Set = u128;
const RECV_BIT: u32 = 127;

/// The validator's happens-before sets, per step (bit *j*: step *j* is complete; bit 127: the
/// trigger RECV is), and the gates passed on the longest path to each step.
#[derive(Clone, Debug)]
pub struct HappensBefore {
    /// Complete whenever the step's WQE can be fetched.
    pub fetch: heapless::Vec<Set, MAX_STEPS>,
    /// Complete whenever the step executes.
    pub exec: heapless::Vec<Set, MAX_STEPS>,
    /// Complete when the step has completed.
    pub done: heapless::Vec<Set, MAX_STEPS>,
    pub gates: heapless::Vec<Gates, MAX_STEPS>,
}

/// Gated phases on a path: each is a point where a queue stops fetching until something else
/// happened — a WAIT (until a CQ count), or the limit of a managed queue (until an ENABLE
/// raises it). On the NIC each costs a WQE fetch after the gate opens.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Gates {
    /// All gates on the path.
    pub gates: u32,
    /// Of them, WAITs (the rest are ENABLE releases).
    pub waits: u32,
}

impl Gates {
    pub const ZERO: Gates = Gates { gates: 0, waits: 0 };
    fn add(self, wait: bool) -> Gates {
        Gates { gates: self.gates + 1, waits: self.waits + u32::from(wait) }
    }
    fn max(self, o: Gates) -> Gates {
        if (o.gates, o.waits) > (self.gates, self.waits) {
            o
        } else {
            self
        }
    }
}

fn bit(s: usize) -> Set {
    1u128 << s
}

impl ChainLayout {
    pub fn ring_len(&self, ring: Ring) -> usize {
        self.steps.iter().filter(|s| s.ring == ring).count()
    }
    /// Position of step `i` within its ring.
    pub fn position(&self, i: usize) -> usize {
        let r = self.steps[i].ring;
        self.steps[..i].iter().filter(|s| s.ring == r).count()
    }
    fn ring_of_qpn(&self, qpn: u32) -> Option<Ring> {
        if qpn == self.qpns[0] {
            Some(Ring::Loop)
        } else if qpn == self.qpns[1] {
            Some(Ring::Mgmt)
        } else {
            None
        }
    }
    /// Completions each CQ sees per lap: [Loop send, Mgmt send, Mgmt recv].
    pub fn completions_per_lap(&self) -> [u64; 3] {
        let mut c = [0u64, 0, 1];
        for s in &self.steps {
            if s.wqe.flags.contains(crate::wire::wqe::WqeFlags::SIGNALED) {
                c[s.ring as usize] += 1;
            }
        }
        c
    }
    /// The n-th signaled step (1-based count) of a ring.
    fn nth_signaled(&self, ring: Ring, n: u64) -> Option<usize> {
        let mut k = 0;
        for (i, s) in self.steps.iter().enumerate() {
            if s.ring == ring && s.wqe.flags.contains(crate::wire::wqe::WqeFlags::SIGNALED) {
                k += 1;
                if k == n {
                    return Some(i);
                }
            }
        }
        None
    }

    /// The patch and dependency edges, plus all structural checks.
    pub fn validate(&self) -> Result<(), ChainError> {
        let n = self.steps.len();
        if n > MAX_STEPS || n >= RECV_BIT as usize {
            return Err(ChainError::TooManySteps);
        }
        for ring in [Ring::Loop, Ring::Mgmt] {
            let len = self.ring_len(ring);
            if len > self.queue_depth as usize {
                return Err(ChainError::ChainTooLong { ring, steps: len, depth: self.queue_depth });
            }
        }
        // --- happens-before ------------------------------------------------------------------
        let hb = self.happens_before()?;
        let (fetch, exec) = (&hb.fetch, &hb.exec);
        let recv_done: Set = bit(RECV_BIT as usize);
        // --- patches and memory dependencies ----------------------------------------------------
        for (i, s) in self.steps.iter().enumerate() {
            for loc in [s.local, s.remote].into_iter().flatten() {
                if let Loc::Field { step, field } = loc {
                    let t = step as usize;
                    if t >= n {
                        return Err(ChainError::BadStepRef { step });
                    }
                    // A READ whose remote side is a WQE field copies that field out (a ring read):
                    // it consumes what the RECV or a patch put there, like a memory read.
                    if s.remote == Some(loc) && s.wqe.opcode == Opcode::Read {
                        let start = field.offset();
                        if start + s.wqe.length as usize > WQE_SIZE || s.wqe.length == 0 {
                            return Err(ChainError::PatchOutsideField { step, field, len: s.wqe.length });
                        }
                        self.check_field_read(i, step, field, s.wqe.length, exec, recv_done)?;
                        continue;
                    }
                    self.check_patch_span(step, field, s.wqe.length)?;
                    // Any other remote-side field target rewrites a WQE for the *next* lap: a
                    // bump of a WAIT's count (FETCH_ADD) or a clear of request-supplied fields
                    // (WRITE). The target must already have run in this lap, and the write must
                    // land before the lap-closing fenced ENABLE (checked in `check_rearm`).
                    let next_lap = s.remote == Some(loc);
                    if next_lap {
                        let ok_op = match s.wqe.opcode {
                            Opcode::FetchAdd => self.steps[t].wqe.opcode == Opcode::Wait,
                            Opcode::Write => true,
                            _ => false,
                        };
                        if t >= i || !ok_op {
                            return Err(ChainError::PatchBackwards {
                                producer: Producer::Step(i as u8),
                                consumer: step,
                            });
                        }
                    } else {
                        if t <= i {
                            return Err(ChainError::PatchBackwards {
                                producer: Producer::Step(i as u8),
                                consumer: step,
                            });
                        }
                        if fetch[t] & bit(i) == 0 {
                            return Err(ChainError::UngatedPatch { producer: Producer::Step(i as u8), consumer: step });
                        }
                    }
                }
            }
            // region check and memory dependencies
            for (addr, len, is_read) in self.mem_accesses(i) {
                let in_meta = addr >= self.meta.0 && addr.saturating_add(len as u64) <= self.meta_end();
                let (z, zl) = self.zero_source;
                let in_zero = is_read && zl > 0 && addr >= z && addr.saturating_add(len as u64) <= z.saturating_add(zl);
                if !in_meta && !in_zero {
                    return Err(ChainError::OutOfRegion { step: i as u8 });
                }
                if !is_read {
                    // Write after write: the later bytes must land last. (Not for an atomic's
                    // returned value: chains send the ones they do not need to a junk word.)
                    let junk = s.wqe.opcode.is_atomic() && s.local.is_none() && addr == s.wqe.local_addr;
                    for p in (0..i).filter(|_| !junk) {
                        for (pa, pl, pr) in self.mem_accesses(p) {
                            if !pr && overlaps(pa, pl, addr, len) && exec[i] & bit(p) == 0 {
                                return Err(ChainError::UngatedDependency {
                                    producer: Producer::Step(p as u8),
                                    consumer: i as u8,
                                });
                            }
                        }
                    }
                    continue;
                }
                for p in 0..i {
                    for (pa, pl, pr) in self.mem_accesses(p) {
                        // memory is read when the step executes (a FENCE may have waited for it)
                        if !pr && overlaps(pa, pl, addr, len) && exec[i] & bit(p) == 0 {
                            return Err(ChainError::UngatedDependency {
                                producer: Producer::Step(p as u8),
                                consumer: i as u8,
                            });
                        }
                    }
                }
                for r in &self.recv {
                    if let Loc::Mem(a) = r.loc {
                        if overlaps(a, r.len, addr, len) && exec[i] & recv_done == 0 {
                            return Err(ChainError::UngatedDependency { producer: Producer::Recv, consumer: i as u8 });
                        }
                    }
                }
            }
        }
        for r in &self.recv {
            match r.loc {
                Loc::Field { step, field } => {
                    if step as usize >= n {
                        return Err(ChainError::BadStepRef { step });
                    }
                    self.check_patch_span(step, field, r.len)?;
                    if fetch[step as usize] & recv_done == 0 {
                        return Err(ChainError::UngatedPatch { producer: Producer::Recv, consumer: step });
                    }
                }
                Loc::Mem(a) => {
                    if a < self.meta.0 || a.saturating_add(r.len as u64) > self.meta_end() {
                        return Err(ChainError::OutOfRegion { step: 0 });
                    }
                }
            }
        }
        // Nothing after the empty probe / ownership check may run before it completed: the
        // check's failure must stop every effect behind it (its QP errors, later WQEs flush).
        for c in [self.empty_probe, self.ownership_check].into_iter().flatten() {
            if c as usize >= n {
                return Err(ChainError::BadStepRef { step: c });
            }
            for (i, e) in exec.iter().enumerate().skip(c as usize + 1) {
                if e & bit(c as usize) == 0 {
                    return Err(ChainError::UncheckedEffect { check: c, step: i as u8 });
                }
            }
        }
        if let Some(c) = self.critical_end {
            if c as usize >= n {
                return Err(ChainError::BadStepRef { step: c });
            }
            // The reply goes out (the push happens) only once every window operation before it
            // completed: a CN is never told of a window that is not bound, no group is queued
            // with a window still bound — and a failed bind or invalidation stops it.
            for (j, w) in self.steps.iter().enumerate().take(c as usize) {
                let window_op = matches!(w.wqe.opcode, Opcode::BindMw | Opcode::LocalInv);
                if window_op && exec[c as usize] & bit(j) == 0 {
                    return Err(ChainError::UncheckedEffect { check: j as u8, step: c });
                }
            }
        }
        if self.rearm == Rearm::SelfEnabling {
            self.check_rearm(&hb)?;
        }
        Ok(())
    }

    /// A ring read of `len` bytes at `field` of step `t` by step `i`: every producer of those
    /// bytes (the RECV scatter, a patch) must be complete when `i` executes.
    fn check_field_read(
        &self,
        i: usize,
        t: u8,
        field: WqeField,
        len: u32,
        exec: &[Set],
        recv_done: Set,
    ) -> Result<(), ChainError> {
        let (a, al) = (field.offset() as u64, len);
        let hit = |loc: Option<Loc>, plen: u32| match loc {
            Some(Loc::Field { step, field: f }) if step == t => overlaps(f.offset() as u64, plen, a, al),
            _ => false,
        };
        for (p, ps) in self.steps.iter().enumerate().take(i) {
            if hit(ps.local, ps.wqe.length) && exec[i] & bit(p) == 0 {
                return Err(ChainError::UngatedDependency { producer: Producer::Step(p as u8), consumer: i as u8 });
            }
        }
        for r in &self.recv {
            if hit(Some(r.loc), r.len) && exec[i] & recv_done == 0 {
                return Err(ChainError::UngatedDependency { producer: Producer::Recv, consumer: i as u8 });
            }
        }
        Ok(())
    }

    /// What is guaranteed complete when each step can be fetched and when it executes.
    ///
    /// * fetch: past a managed queue's limit only once the ENABLE that raises it has executed —
    ///   and nothing else: a WAIT holds back execution, not fetching ([`DeviceBehaviour`]'s
    ///   `WaitPrefetch::FetchesPast`; a layout valid here is valid where WAITs stop prefetch too).
    ///
    /// [`DeviceBehaviour`]: crate::device::behaviour::DeviceBehaviour
    /// * execute: after the previous step of the ring executed (in order); a FENCEd step also
    ///   after every earlier READ and atomic of its ring completed (IBTA's fence indicator;
    ///   completions are in order, so also everything before them); the step after a BIND_MW
    ///   or LOCAL_INV after that operation completed (mlx5 puts a small fence on it,
    ///   rdma-core providers/mlx5/qp.c; a failure errors the QP and flushes it).
    /// * complete: the step, what was guaranteed at its execution, and earlier steps of its ring.
    ///
    /// A patched WQE field must be complete at *fetch* (a NIC may prefetch a WQE as soon as
    /// it is released); memory a step reads through its SGEs only at *execute*.
    pub fn happens_before(&self) -> Result<HappensBefore, ChainError> {
        let n = self.steps.len();
        if n > MAX_STEPS || n >= RECV_BIT as usize {
            return Err(ChainError::TooManySteps);
        }
        let mut hb = HappensBefore {
            fetch: heapless::Vec::new(),
            exec: heapless::Vec::new(),
            done: heapless::Vec::new(),
            gates: heapless::Vec::new(),
        };
        let recv_done: Set = bit(RECV_BIT as usize);
        for i in 0..n {
            let s = &self.steps[i];
            let pos = self.position(i);
            let prev = (0..i).rev().find(|&j| self.steps[j].ring == s.ring);
            let mut g: Set = 0;
            let mut gates = prev.map(|p| hb.gates[p]).unwrap_or(Gates::ZERO);
            // WAITs earlier on the same ring hold its *execution* back, not its fetching: a NIC
            // may fetch past an unsatisfied WAIT up to the queue's enable limit (no source says
            // it stops; mlx4's `stamp_send_wqe` shows these NICs fetch ahead), so what a WAIT
            // guarantees counts only once the step executes.
            let mut waited: Set = 0;
            for j in 0..i {
                let w = &self.steps[j];
                if w.ring == s.ring && w.wqe.opcode == Opcode::Wait {
                    waited |= hb.exec[j] | self.wait_guarantee(j, &hb.done, recv_done)?;
                }
            }
            // Steps past the initial enable are released by an earlier ENABLE: the enable limit
            // is the one documented fetch bound.
            if pos >= self.initial_enable[s.ring as usize] as usize {
                match self.releasing_enable(s.ring, pos, i) {
                    Some(j) => {
                        g |= hb.exec[j];
                        gates = gates.max(hb.gates[j].add(false));
                    }
                    None => return Err(ChainError::NeverEnabled { step: i as u8 }),
                }
            }
            if s.wqe.opcode == Opcode::Wait {
                // A WAIT must be satisfiable even when nothing follows it on its ring; and the
                // step it awaits must come earlier in the order, or its gates are not known yet.
                self.wait_guarantee(i, &hb.done, recv_done)?;
                let awaited = match self.awaited(i) {
                    Some(p) => *hb.gates.get(p).ok_or(ChainError::WaitNeverSatisfied { step: i as u8 })?,
                    None => Gates::ZERO,
                };
                gates = gates.max(awaited).add(true);
            }
            let mut e = g | waited;
            if let Some(p) = prev {
                e |= hb.exec[p];
            }
            let earlier = |f: &dyn Fn(Opcode) -> bool| {
                (0..i).rev().find(|&j| self.steps[j].ring == s.ring && f(self.steps[j].wqe.opcode))
            };
            if s.wqe.flags.contains(crate::wire::wqe::WqeFlags::FENCE) {
                if let Some(j) = earlier(&|o| o == Opcode::Read || o.is_atomic()) {
                    e |= hb.done[j];
                }
            }
            if let Some(j) = earlier(&|o| matches!(o, Opcode::BindMw | Opcode::LocalInv)) {
                e |= hb.done[j];
            }
            let mut d = e | bit(i);
            if let Some(p) = prev {
                d |= hb.done[p];
            }
            let pushed = (hb.fetch.push(g), hb.exec.push(e), hb.done.push(d), hb.gates.push(gates));
            debug_assert!(
                matches!(pushed, (Ok(()), Ok(()), Ok(()), Ok(()))),
                "one entry per step: n <= MAX_STEPS, checked above"
            );
        }
        Ok(hb)
    }

    /// The step whose completion a WAIT at `j` waits for (None: the RECV, or nothing).
    fn awaited(&self, j: usize) -> Option<usize> {
        let w = &self.steps[j].wqe;
        if w.queue_sel() == QueueSel::Recv || w.operand0 == 0 {
            return None;
        }
        self.nth_signaled(self.ring_of_qpn(w.qpn)?, w.operand0)
    }

    /// Gates on the longest path from the request to [`Self::critical_end`]: every WAIT, and
    /// every ENABLE that releases a queue (the released WQE is fetched only then) — counted
    /// from the request's WAIT, so what a chain prepares before the request arrives is not on
    /// it. None when the layout names no end step or does not validate.
    pub fn critical_path(&self) -> Option<Gates> {
        let end = self.critical_end? as usize;
        let hb = self.happens_before().ok()?;
        let at_end = *hb.gates.get(end)?;
        let Some(w) = self.request_wait else { return Some(at_end) };
        // the WAIT's own gates include everything before it; it is the request's first gate
        let before = hb.gates.get(w as usize)?;
        Some(Gates { gates: at_end.gates - before.gates + 1, waits: at_end.waits - before.waits + 1 })
    }
    /// Steps that run before the request arrives (the alloc chain's prepare phase).
    pub fn prepares_before_request(&self, step: u8) -> bool {
        self.request_wait.is_some_and(|w| step < w)
    }

    /// WQEs a lap executes: both rings' depths (every slot runs once per lap, padding too).
    pub fn wqes_per_lap(&self) -> usize {
        self.ring_depth.iter().map(|d| *d as usize).sum()
    }

    /// The lap re-arm's fetch-and-adds (one per WAIT: its absolute CQ count moves on).
    pub fn rearm_bumps(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| s.wqe.opcode == Opcode::FetchAdd && matches!(s.remote, Some(Loc::Field { .. })))
            .count()
    }

    /// The set a WAIT at step `j` guarantees complete.
    fn wait_guarantee(&self, j: usize, done: &[Set], recv_done: Set) -> Result<Set, ChainError> {
        let w = &self.steps[j].wqe;
        let count = w.operand0;
        if count == 0 {
            return Ok(0);
        }
        let ring = self.ring_of_qpn(w.qpn).ok_or(ChainError::WaitNeverSatisfied { step: j as u8 })?;
        if w.queue_sel() == QueueSel::Recv {
            return if ring == Ring::Mgmt && count == 1 {
                Ok(recv_done)
            } else {
                Err(ChainError::WaitNeverSatisfied { step: j as u8 })
            };
        }
        match self.nth_signaled(ring, count) {
            // Only completions of steps earlier in the global order can be guaranteed; a WAIT
            // on a later step would deadlock the sequential order.
            Some(p) if p < j || self.steps[p].ring != self.steps[j].ring => {
                done.get(p).copied().ok_or(ChainError::WaitNeverSatisfied { step: j as u8 })
            }
            _ => Err(ChainError::WaitNeverSatisfied { step: j as u8 }),
        }
    }

    /// The ENABLE (global index < `before`) whose increment first lets `ring` run entry `pos`
    /// in lap 0. ENABLE increments the queue's limit by `operand0` (like mlx5 SEND_EN advancing
    /// the producer index a managed QP may consume), so a re-armed chain needs no bumps of it.
    fn releasing_enable(&self, ring: Ring, pos: usize, before: usize) -> Option<usize> {
        let mut limit = self.initial_enable[ring as usize] as u64;
        for (j, e) in self.steps.iter().enumerate().take(before) {
            if self.is_send_enable_of(e, ring) {
                limit = limit.saturating_add(e.wqe.operand0);
                if limit > pos as u64 {
                    return Some(j);
                }
            }
        }
        None
    }

    /// End of the metadata region (saturating: the layout is data, its numbers may be anything).
    fn meta_end(&self) -> u64 {
        self.meta.0.saturating_add(self.meta.1)
    }

    fn is_send_enable_of(&self, e: &Step, ring: Ring) -> bool {
        e.wqe.opcode == Opcode::Enable
            && e.wqe.queue_sel() == QueueSel::Send
            && self.ring_of_qpn(e.wqe.qpn) == Some(ring)
    }

    fn check_patch_span(&self, step: u8, field: WqeField, len: u32) -> Result<(), ChainError> {
        let target = &self.steps[step as usize].wqe;
        let start = field.offset();
        let end = start + len as usize;
        if end > WQE_SIZE || len == 0 {
            return Err(ChainError::PatchOutsideField { step, field, len });
        }
        // walk the covered fields: each must be patchable and fully covered
        let mut off = start;
        while off < end {
            let f = field_at(off).ok_or(ChainError::PatchOutsideField { step, field, len })?;
            if !f.patchable_for(target.opcode) {
                return Err(ChainError::NotPatchable { step, field: f });
            }
            off += f.width();
        }
        if off != end {
            return Err(ChainError::PatchOutsideField { step, field, len });
        }
        Ok(())
    }

    /// MN-memory ranges a step touches: (addr, len, is_read_of_mn_memory).
    fn mem_accesses(&self, i: usize) -> heapless::Vec<(u64, u32, bool), 3> {
        let s = &self.steps[i];
        let w = &s.wqe;
        let mut v = heapless::Vec::new();
        // at most three ranges per step (an atomic: its read, its write, its local result)
        let mut add = |r| {
            let pushed = v.push(r);
            debug_assert!(pushed.is_ok(), "a step touches at most 3 ranges of MN memory");
        };
        // Addresses patched at run time are dynamic: the MR they go through checks them, not
        // this validator.
        let local_is_mem = s.local.is_none() && !self.is_patched(i, WqeField::LocalAddr);
        let remote_is_mem = s.remote.is_none() && s.ring == Ring::Loop && !self.is_patched(i, WqeField::RemoteAddr);
        match w.opcode {
            Opcode::Read => {
                if remote_is_mem {
                    add((w.remote_addr, w.length, true));
                }
                if local_is_mem {
                    add((w.local_addr, w.length, false));
                }
            }
            Opcode::FetchAdd | Opcode::MaskedFetchAdd | Opcode::CompareSwap => {
                if remote_is_mem {
                    // read-modify-write of MN memory
                    add((w.remote_addr, 8, true));
                    add((w.remote_addr, 8, false));
                }
                if local_is_mem {
                    add((w.local_addr, 8, false));
                }
            }
            Opcode::Write | Opcode::WriteWithImm | Opcode::Send | Opcode::SendWithImm => {
                if local_is_mem {
                    add((w.local_addr, w.length, true));
                }
                // A WRITE over the loop QP lands in MN memory: a producer for later readers
                // (modelled as a completion-time write, like a READ response).
                if remote_is_mem && matches!(w.opcode, Opcode::Write | Opcode::WriteWithImm) {
                    add((w.remote_addr, w.length, false));
                }
            }
            _ => {}
        }
        v
    }

    /// Whether some step or the RECV writes `field` of step `i`.
    pub fn is_patched(&self, i: usize, field: WqeField) -> bool {
        let hit =
            |l: &Option<Loc>| matches!(l, Some(Loc::Field { step, field: f }) if *step as usize == i && *f == field);
        self.steps.iter().any(|s| hit(&s.local) || hit(&s.remote)) || self.recv.iter().any(|r| hit(&Some(r.loc)))
    }

    fn check_rearm(&self, hb: &HappensBefore) -> Result<(), ChainError> {
        let end = self.steps.len() as u8;
        // The fenced ENABLE that starts the Loop ring's next lap: every bump must land before it
        // executes (FENCE waits for this QP's outstanding atomics), and nothing else of the next
        // lap can run before the Loop ring's does.
        let closing = self
            .steps
            .iter()
            .enumerate()
            .rev()
            .find(|(_, e)| {
                e.ring == Ring::Loop
                    && self.is_send_enable_of(e, Ring::Loop)
                    && e.wqe.flags.contains(crate::wire::wqe::WqeFlags::FENCE)
            })
            .map(|(j, _)| j)
            .ok_or(ChainError::MissingRearm { step: end })?;
        for (j, w) in self.steps.iter().enumerate() {
            if matches!(w.remote, Some(Loc::Field { .. })) && (j > closing || w.ring != Ring::Loop) {
                return Err(ChainError::MissingRearm { step: j as u8 });
            }
            // a next-lap rewrite (bump, clear) must have landed when the next lap is enabled
            let rewrites = matches!(w.remote, Some(Loc::Field { .. })) && w.wqe.opcode != Opcode::Read;
            if rewrites && hb.exec[closing] & bit(j) == 0 {
                return Err(ChainError::MissingRearm { step: j as u8 });
            }
        }
        // The next RECV overwrites its targets: whatever this lap still does with them — the
        // steps the request patched, readers and writers of the scratch it lands in, the
        // rewrites of its fields — must be complete when the receive queue is re-enabled.
        let recv_en = self.steps.iter().position(|e| {
            e.wqe.opcode == Opcode::Enable && e.wqe.queue_sel() == QueueSel::Recv && e.wqe.qpn == self.qpns[1]
        });
        // Where the receive ENABLE comes before the lap's WAIT for the request, it admits this
        // lap's request (and the arm enables none): everything the previous lap did with the
        // RECV's targets must be complete when the next lap is enabled — the closing ENABLE —
        // since only then can the next lap's opening ENABLE run. Otherwise it admits the next
        // lap's request (the arm enabling the first): complete before it.
        let recv_wait = self.steps.iter().position(|e| {
            e.wqe.opcode == Opcode::Wait && e.wqe.queue_sel() == QueueSel::Recv && e.wqe.qpn == self.qpns[1]
        });
        let opens_lap = matches!((recv_en, recv_wait), (Some(r), Some(w)) if r < w && self.steps[r].ring == Ring::Loop);
        let want_initial = if opens_lap { 0 } else { 1 };
        if recv_en.is_some() && self.initial_recv_enable != want_initial {
            return Err(ChainError::RecvReuse { step: recv_en.unwrap_or(0) as u8 });
        }
        let reuse_bound = if opens_lap { Some(closing) } else { recv_en };
        // Addresses and keys from the request are cleared every lap.
        for t in &self.recv {
            if let Loc::Field { step, field } = t.loc {
                if !matches!(field, WqeField::RemoteAddr | WqeField::LocalAddr | WqeField::Rkey) {
                    continue;
                }
                let (a, al) = (field.offset() as u64, t.len);
                let cleared = self.steps.iter().any(|w| match w.remote {
                    Some(Loc::Field { step: s, field: f }) if s == step && w.wqe.opcode == Opcode::Write => {
                        let (b, bl) = (f.offset() as u64, w.wqe.length);
                        b <= a && a + al as u64 <= b + bl as u64
                    }
                    _ => false,
                });
                if !cleared {
                    return Err(ChainError::Replayable { step, field });
                }
            }
        }
        if let Some(r) = reuse_bound {
            for (j, w) in self.steps.iter().enumerate() {
                let uses = self.recv.iter().any(|t| match t.loc {
                    Loc::Field { step, .. } => {
                        step as usize == j || matches!(w.remote, Some(Loc::Field { step: s, .. }) if s == step)
                    }
                    Loc::Mem(a) => self.mem_accesses(j).iter().any(|(pa, pl, _)| overlaps(*pa, *pl, a, t.len)),
                });
                if uses && j != r && hb.exec[r] & bit(j) == 0 {
                    return Err(ChainError::RecvReuse { step: j as u8 });
                }
            }
        }
        for (i, s) in self.steps.iter().enumerate() {
            if s.wqe.opcode == Opcode::Wait {
                let bump = self.steps.iter().enumerate().find(|(_, b)| {
                    b.remote == Some(Loc::Field { step: i as u8, field: WqeField::Operand0 })
                        && b.wqe.opcode == Opcode::FetchAdd
                });
                match bump {
                    Some((b, bs)) if b < closing && bs.ring == Ring::Loop => {
                        let per_lap = self.completions_per_lap();
                        let q = match (self.ring_of_qpn(s.wqe.qpn), s.wqe.queue_sel()) {
                            (Some(_), QueueSel::Recv) => 2,
                            (Some(r), QueueSel::Send) => r as usize,
                            (None, _) => return Err(ChainError::WaitNeverSatisfied { step: i as u8 }),
                        };
                        if bs.wqe.operand0 != per_lap[q] {
                            return Err(ChainError::MissingRearm { step: i as u8 });
                        }
                    }
                    _ => return Err(ChainError::MissingRearm { step: i as u8 }),
                }
            }
        }
        // each lap must enable exactly one more lap of every ring, and one more RECV
        for ring in [Ring::Loop, Ring::Mgmt] {
            let len = self.ring_len(ring) as u64;
            let inc = self
                .steps
                .iter()
                .filter(|e| self.is_send_enable_of(e, ring))
                .fold(0u64, |a, e| a.saturating_add(e.wqe.operand0));
            if inc != len {
                return Err(ChainError::MissingRearm { step: end });
            }
        }
        let rq = self
            .steps
            .iter()
            .filter(|e| {
                e.wqe.opcode == Opcode::Enable && e.wqe.queue_sel() == QueueSel::Recv && e.wqe.qpn == self.qpns[1]
            })
            .fold(0u64, |a, e| a.saturating_add(e.wqe.operand0));
        if rq != 1 {
            return Err(ChainError::MissingRearm { step: end });
        }
        Ok(())
    }
}

fn overlaps(a: u64, al: u32, b: u64, bl: u32) -> bool {
    a < b.saturating_add(bl as u64) && b < a.saturating_add(al as u64)
}

fn field_at(off: usize) -> Option<WqeField> {
    WqeField::ALL.into_iter().find(|f| f.offset() == off)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::alloc::build_alloc_chain;
    use crate::chain::builder::{test_env, ChainEnv};
    use crate::chain::free::build_free_chain;
    use crate::wire::wqe::WqeFlags;

    #[test]
    fn chains_valid_for_many_geometries() {
        for g in 2..=crate::geometry::MAX_GROUP_SIZE as u8 {
            for (cs, n) in [(512u64, 1u32), (4096, 100), (1 << 20, 7), (1 << 30, 3)] {
                let env = test_env(cs, n, g);
                let behind = build_alloc_chain(&ChainEnv { pop_ahead: false, ..env }).unwrap();
                assert_eq!(behind.validate(), Ok(()), "alloc, not popping ahead, G={g} cs={cs}");
                let a = build_alloc_chain(&env).unwrap();
                assert_eq!(a.validate(), Ok(()), "alloc G={g} cs={cs}");
                assert!(a.empty_probe.is_some());
                let f = build_free_chain(&env).unwrap();
                assert_eq!(f.validate(), Ok(()), "free G={g} cs={cs}");
                assert!(f.ownership_check.is_some());
                for r in [Ring::Loop, Ring::Mgmt] {
                    assert_eq!(a.ring_len(r), a.ring_depth[r as usize] as usize);
                    assert!(a.ring_depth[r as usize].is_power_of_two());
                }
                // the binds: G of them, MW[0] to the Free QP
                let binds: std::vec::Vec<_> = a.steps.iter().filter(|s| s.wqe.opcode == Opcode::BindMw).collect();
                assert_eq!(binds.len(), g as usize);
                assert_eq!(binds[0].wqe.qpn, env.free_qpn);
                // the free chain: one LOCAL_INV on the Free QP ring, G-1 unbinds
                let inv = f.ownership_check.unwrap() as usize;
                assert_eq!(f.steps[inv].wqe.opcode, Opcode::LocalInv);
                assert_eq!(f.steps[inv].ring, Ring::Mgmt);
                let unbinds = f.steps.iter().filter(|s| s.wqe.flags.contains(WqeFlags::UNBIND)).count();
                assert_eq!(unbinds, g as usize - 1);
            }
        }
    }

    fn alloc() -> ChainLayout {
        build_alloc_chain(&test_env(4096, 16, 3)).unwrap()
    }

    /// Gated phases from the request to the reply (alloc) or the push (free), and WQEs per lap
    /// (padding and re-arm bumps included), for every G and geometry. The alloc chain popping
    /// ahead (issue 22): two — the request's WAIT and the ENABLE of the binds and reply; without
    /// it four (issue 11). The free chain five (issue 22: its entry READ, patched by the RECV,
    /// is released by an ENABLE behind the WAIT, since a NIC may fetch past an unsatisfied
    /// WAIT). Before issue 11: alloc 10 gates (9 WAITs), 68 WQEs, 11 bumps; free 10 gates
    /// (8 WAITs), 72 WQEs, 10 bumps (G = 3). A chain that grows fails here.
    #[test]
    fn chain_cost_bounds() {
        const ALLOC_AHEAD_MAX_GATES: u32 = 2;
        const ALLOC_MAX_GATES: u32 = 4;
        const FREE_MAX_GATES: u32 = 5;
        const MAX_WAITS: u32 = 1;
        // G = 4: the fourth bind's three copies (span, new key, current key — rdma-core names
        // the window by its current key, issue 22) take the Loop ring past 32 entries
        let alloc_max_wqes_per_lap = |g: u8| if g < 4 { 40usize } else { 72 };
        const ALLOC_MAX_BUMPS: usize = 2;
        const FREE_MAX_WQES_PER_LAP: usize = 40;
        const FREE_MAX_BUMPS: usize = 1;
        for g in 2..=crate::geometry::MAX_GROUP_SIZE as u8 {
            for (cs, n) in [(512u64, 1u32), (4096, 100), (1 << 20, 7)] {
                let mut env = test_env(cs, n, g);
                for scrub in [false, true] {
                    if scrub {
                        env.keys.zero_lkey = 0x18;
                        env.keys.pool_scrub_rkey = 0x19;
                        env.keys.zero_addr = 1 << 40;
                    }
                    let behind = ChainEnv { pop_ahead: false, ..env };
                    for (c, gates, wqes, bumps) in [
                        (
                            build_alloc_chain(&env).unwrap(),
                            ALLOC_AHEAD_MAX_GATES,
                            alloc_max_wqes_per_lap(g),
                            ALLOC_MAX_BUMPS,
                        ),
                        (
                            build_alloc_chain(&behind).unwrap(),
                            ALLOC_MAX_GATES,
                            alloc_max_wqes_per_lap(g),
                            ALLOC_MAX_BUMPS,
                        ),
                        (build_free_chain(&env).unwrap(), FREE_MAX_GATES, FREE_MAX_WQES_PER_LAP, FREE_MAX_BUMPS),
                    ] {
                        assert_eq!(c.validate(), Ok(()), "{:?} G={g} cs={cs} scrub={scrub}", c.kind);
                        let p = c.critical_path().expect("critical path");
                        assert!(p.gates <= gates && p.waits <= MAX_WAITS, "{:?} G={g}: {p:?}", c.kind);
                        assert!(c.wqes_per_lap() <= wqes, "{:?} G={g}: {} WQEs per lap", c.kind, c.wqes_per_lap());
                        assert!(c.rearm_bumps() <= bumps, "{:?} G={g}: {} bumps", c.kind, c.rearm_bumps());
                    }
                }
            }
        }
    }

    /// The counting itself: a WAIT inserted on the path to the reply adds a gate.
    #[test]
    fn critical_path_counts_an_extra_wait() {
        let c = alloc();
        let before = c.critical_path().unwrap();
        let end = c.critical_end.unwrap() as usize;
        // the reply's ring, once more gated: turn the last bind into a WAIT for the bind before it
        let mut d = c.clone();
        let last_bind = (0..end).rev().find(|i| d.steps[*i].wqe.opcode == Opcode::BindMw).unwrap();
        d.steps[last_bind].wqe = Wqe::wait(d.qpns[1], QueueSel::Send, 1);
        // one signaled step fewer on that ring: the WAIT after the reply counts one less
        for s in d.steps.iter_mut().skip(end) {
            if s.wqe.opcode == Opcode::Wait && s.wqe.qpn == c.qpns[1] && s.wqe.queue_sel() == QueueSel::Send {
                s.wqe.operand0 -= 1;
            }
        }
        let after = d.critical_path().unwrap();
        assert_eq!(after.gates, before.gates + 1);
        assert_eq!(after.waits, before.waits + 1);
    }

    /// The probe's CAS must not run before the probe completed (race-free pop): without the
    /// FENCE that orders phase 3 behind the probe, the validator refuses the chain.
    #[test]
    fn effect_before_probe_completed_rejected() {
        let mut c = alloc();
        let probe = c.empty_probe.unwrap() as usize;
        let fenced = (probe + 1..c.steps.len()).find(|i| c.steps[*i].wqe.flags.contains(WqeFlags::FENCE)).unwrap();
        c.steps[fenced].wqe.flags.remove(WqeFlags::FENCE);
        assert!(
            matches!(c.validate(), Err(ChainError::UncheckedEffect { .. }) | Err(ChainError::UngatedDependency { .. })),
            "{:?}",
            c.validate()
        );
    }

    /// A copy in the same phase as the atomic whose result it reads is sound only FENCEd.
    #[test]
    fn unfenced_copy_of_a_fresh_result_rejected() {
        let mut c = alloc();
        let faa = c.steps.iter().position(|s| s.wqe.opcode == Opcode::MaskedFetchAdd).unwrap();
        let cp = (faa + 1..c.steps.len()).find(|i| c.steps[*i].wqe.flags.contains(WqeFlags::FENCE)).unwrap();
        assert_eq!(c.steps[cp].wqe.opcode, Opcode::Read);
        c.steps[cp].wqe.flags.remove(WqeFlags::FENCE);
        assert!(
            matches!(c.validate(), Err(ChainError::UngatedDependency { producer: Producer::Step(p), .. }) if p as usize == faa),
            "{:?}",
            c.validate()
        );
        // and a phase gate without its FENCE releases WQEs whose patches may not have landed
        let mut c = alloc();
        let gate = c
            .steps
            .iter()
            .position(|s| {
                s.wqe.opcode == Opcode::Enable && s.wqe.qpn == c.qpns[0] && s.wqe.queue_sel() == QueueSel::Send
            })
            .unwrap();
        c.steps[gate].wqe.flags.remove(WqeFlags::FENCE);
        assert!(matches!(c.validate(), Err(ChainError::UngatedPatch { .. })), "{:?}", c.validate());
    }

    /// The free chain's second half may run only after the ownership check: released by an
    /// ENABLE on another QP than the check's, it would not be.
    #[test]
    fn free_second_half_before_ownership_check_rejected() {
        let env = test_env(4096, 16, 3);
        let mut f = build_free_chain(&env).unwrap();
        let inv = f.ownership_check.unwrap() as usize;
        // the Loop-releasing ENABLE on the Free QP ring moves in front of the LOCAL_INV
        let rel = (inv..f.steps.len())
            .find(|i| f.steps[*i].ring == Ring::Mgmt && f.steps[*i].wqe.opcode == Opcode::Enable)
            .unwrap();
        let (a, b) = (f.steps[inv], f.steps[rel]);
        f.steps[inv] = Step { wqe: b.wqe, ..b };
        f.steps[rel] = a;
        f.ownership_check = Some(rel as u8);
        for s in f.steps.iter_mut() {
            for l in [&mut s.local, &mut s.remote] {
                if let Some(Loc::Field { step, .. }) = l {
                    if *step as usize == inv {
                        *step = rel as u8;
                    } else if *step as usize == rel {
                        *step = inv as u8;
                    }
                }
            }
        }
        assert!(matches!(f.validate(), Err(ChainError::UncheckedEffect { .. })), "{:?}", f.validate());
    }

    /// A request-supplied address that is not cleared for the next lap is refused (a short
    /// request would free the previous request's entry again).
    #[test]
    fn replayable_request_field_rejected() {
        let env = test_env(4096, 16, 3);
        let mut f = build_free_chain(&env).unwrap();
        let rd = f.recv.iter().find_map(|r| match r.loc {
            Loc::Field { step, .. } => Some(step),
            _ => None,
        });
        let clear = f
            .steps
            .iter()
            .position(|s| {
                s.wqe.opcode == Opcode::Write && matches!(s.remote, Some(Loc::Field { step, .. }) if Some(step) == rd)
            })
            .unwrap();
        f.steps[clear].wqe = Wqe::nop().with_flags(WqeFlags::SIGNALED);
        f.steps[clear].remote = None;
        assert!(matches!(f.validate(), Err(ChainError::Replayable { .. })), "{:?}", f.validate());
    }

    /// A next-lap rewrite or a clear of a RECV target that is still in flight when the next
    /// RECV is enabled is refused.
    /// A lap that admits its own request (the receive ENABLE before the request's WAIT) must
    /// not be armed with a receive already enabled — two requests could land in one lap — and
    /// one that admits the next lap's must be.
    #[test]
    fn the_arm_enables_a_receive_only_where_the_tail_admits_the_next() {
        use crate::chain::variant::ChainVariant;
        let plain = test_env(4096, 16, 3);
        let head =
            crate::chain::builder::ChainEnv { variant: ChainVariant::WQEBB_ENABLES.enabling_receives(), ..plain };
        for env in [plain, head] {
            for mut l in [build_alloc_chain(&env).unwrap(), build_free_chain(&env).unwrap()] {
                l.validate().unwrap();
                l.initial_recv_enable = 1 - l.initial_recv_enable;
                assert!(matches!(l.validate(), Err(ChainError::RecvReuse { .. })), "{:?}", l.kind);
            }
        }
    }

    #[test]
    fn recv_reuse_rejected() {
        let mut c = alloc();
        let r =
            c.steps.iter().position(|e| e.wqe.opcode == Opcode::Enable && e.wqe.queue_sel() == QueueSel::Recv).unwrap();
        c.steps[r].wqe.flags.remove(WqeFlags::FENCE);
        assert!(matches!(c.validate(), Err(ChainError::RecvReuse { .. })), "{:?}", c.validate());
    }

    /// A patched step whose release does not wait for the patch must be caught: the FENCE of
    /// the ENABLE that releases the pop READ (patched by the copy of the slot address before
    /// it) removed.
    #[test]
    fn ungated_patch_rejected() {
        let mut c = alloc();
        let pop = c
            .steps
            .iter()
            .position(|s| s.wqe.opcode == Opcode::Read && s.wqe.remote_addr == 0 && s.local.is_none())
            .unwrap();
        let gate = (0..pop).rev().find(|i| c.steps[*i].wqe.opcode == Opcode::Enable).unwrap();
        c.steps[gate].wqe.flags.remove(WqeFlags::FENCE);
        assert!(
            matches!(c.validate(), Err(ChainError::UngatedPatch { .. }) | Err(ChainError::UngatedDependency { .. })),
            "{:?}",
            c.validate()
        );
    }

    /// A WAIT does not keep the NIC from fetching what follows it: a patched step behind a
    /// WAIT but inside the enabled range is refused (the free chain's entry READ without the
    /// ENABLE that releases it behind its WAIT).
    #[test]
    fn a_wait_is_not_a_fetch_bound() {
        let mut c = build_free_chain(&test_env(4096, 16, 3)).unwrap();
        assert_eq!(c.validate(), Ok(()));
        // release the whole first phase at arm (and from the closing ENABLE): the ENABLE
        // behind the WAIT then releases nothing new
        let open = c.steps.iter().position(|s| s.wqe.opcode == Opcode::Enable).unwrap();
        let n = c.steps[open].wqe.operand0;
        c.initial_enable[0] += n as u16;
        c.steps[open].wqe.operand0 = 0;
        let closing = c.steps.iter().rposition(|s| s.wqe.opcode == Opcode::Enable && s.ring == Ring::Loop).unwrap();
        c.steps[closing].wqe.operand0 += n;
        assert!(
            matches!(c.validate(), Err(ChainError::UngatedPatch { producer: Producer::Recv, .. })),
            "{:?}",
            c.validate()
        );
    }

    #[test]
    fn ungated_recv_patch_rejected() {
        let mut c = alloc();
        let w = c.request_wait.unwrap() as usize;
        c.steps[w].wqe.operand0 = 0; // WAIT for zero RECVs: gates nothing
        assert!(matches!(
            c.validate(),
            Err(ChainError::UngatedPatch { producer: Producer::Recv, .. })
                | Err(ChainError::UngatedDependency { producer: Producer::Recv, .. })
        ));
    }

    #[test]
    fn patch_outside_field_rejected() {
        let mut c = alloc();
        let i = c
            .steps
            .iter()
            .position(|s| matches!(s.local, Some(Loc::Field { field: WqeField::RemoteAddr, .. })))
            .unwrap();
        c.steps[i].wqe.length = 6; // 6 bytes into an 8-byte field
        assert!(matches!(c.validate(), Err(ChainError::PatchOutsideField { .. })));
    }

    #[test]
    fn patch_of_fixed_field_rejected() {
        let mut c = alloc();
        let i = c.steps.iter().position(|s| matches!(s.local, Some(Loc::Field { .. }))).unwrap();
        if let Some(Loc::Field { step, .. }) = c.steps[i].local {
            c.steps[i].local = Some(Loc::Field { step, field: WqeField::WrId });
        }
        assert!(matches!(c.validate(), Err(ChainError::NotPatchable { field: WqeField::WrId, .. })));
    }

    #[test]
    fn chain_longer_than_queue_rejected() {
        let mut c = alloc();
        c.queue_depth = 8;
        assert!(matches!(c.validate(), Err(ChainError::ChainTooLong { ring: Ring::Loop, .. })));
    }

    #[test]
    fn missing_rearm_rejected() {
        let mut c = alloc();
        let last = c.steps.iter().rposition(|s| s.wqe.flags.contains(WqeFlags::FENCE)).unwrap();
        c.steps[last].wqe.flags = WqeFlags::empty(); // closing ENABLE without its fence
        assert!(matches!(c.validate(), Err(ChainError::MissingRearm { .. })));
        let mut c = alloc();
        let bump = c
            .steps
            .iter()
            .position(|s| s.wqe.opcode == Opcode::FetchAdd && matches!(s.remote, Some(Loc::Field { .. })))
            .unwrap();
        c.steps[bump].wqe.operand0 += 1; // wrong per-lap count
        assert!(matches!(c.validate(), Err(ChainError::MissingRearm { .. })));
    }

    #[test]
    fn never_enabled_and_out_of_region_rejected() {
        let mut c = alloc();
        let en = c
            .steps
            .iter()
            .position(|s| {
                s.wqe.opcode == Opcode::Enable && s.wqe.qpn == c.qpns[1] && s.wqe.queue_sel() == QueueSel::Send
            })
            .unwrap();
        c.steps[en].wqe.operand0 = 0;
        assert!(matches!(c.validate(), Err(ChainError::NeverEnabled { .. })));
        let mut c = alloc();
        let i = c.steps.iter().position(|s| s.wqe.opcode == Opcode::MaskedFetchAdd).unwrap();
        c.steps[i].wqe.remote_addr = 0x10;
        assert!(matches!(c.validate(), Err(ChainError::OutOfRegion { .. })));
    }

    /// Layouts are data: huge enable counts or a region at the top of the address space are
    /// validation errors, never arithmetic overflows (found by the `chain` fuzz target).
    #[test]
    fn huge_numbers_are_errors_not_overflows() {
        let mut c = alloc();
        for s in c.steps.iter_mut().filter(|s| s.wqe.opcode == Opcode::Enable) {
            s.wqe.operand0 = u64::MAX;
        }
        assert!(c.validate().is_err());
        let mut c = alloc();
        c.meta = (u64::MAX - 8, u64::MAX);
        c.recv.push(RecvTarget { loc: Loc::Mem(u64::MAX - 4), len: 8 }).ok();
        assert!(c.validate().is_err());
    }

    /// A WAIT for a completion later in the order (on the other ring) is an error, not an
    /// index past the gates computed so far (found by the `chain` fuzz target:
    /// `fuzz/regressions/chain/wait-awaits-later-step`).
    #[test]
    fn wait_for_a_later_step_is_an_error() {
        for c in [alloc(), build_free_chain(&test_env(4096, 16, 3)).unwrap()] {
            let mut tried = 0;
            for i in (0..c.steps.len()).filter(|&i| c.steps[i].wqe.opcode == Opcode::Wait) {
                let other = if c.steps[i].ring == Ring::Loop { Ring::Mgmt } else { Ring::Loop };
                // 1-based count of the first signaled step of the other ring after the WAIT
                let signaled: std::vec::Vec<usize> = (0..c.steps.len())
                    .filter(|&j| c.steps[j].ring == other && c.steps[j].wqe.flags.contains(WqeFlags::SIGNALED))
                    .collect();
                let Some(k) = signaled.iter().position(|&j| j > i) else { continue };
                let mut d = c.clone();
                d.steps[i].wqe.qpn = d.qpns[other as usize];
                d.steps[i].wqe.operand0 = k as u64 + 1;
                d.steps[i].wqe.operand1 = 0; // the send queue's completions
                assert!(
                    matches!(d.happens_before(), Err(ChainError::WaitNeverSatisfied { .. })),
                    "{:?} step {i}",
                    c.kind
                );
                assert!(d.validate().is_err());
                tried += 1;
            }
            assert!(tried > 0, "{:?}: no WAIT to redirect", c.kind);
        }
    }

    #[test]
    fn wait_never_satisfied_rejected() {
        let mut c = alloc();
        let i =
            c.steps.iter().position(|s| s.wqe.opcode == Opcode::Wait && s.wqe.queue_sel() == QueueSel::Send).unwrap();
        c.steps[i].wqe.operand0 = 1000;
        assert!(matches!(c.validate(), Err(ChainError::WaitNeverSatisfied { .. })));
    }
}

impl ChainLayout {
    /// Render the chain as a Markdown table (docs/CHAINS.md is generated from this).
    pub fn write_table(&self, out: &mut impl fmt::Write) -> fmt::Result {
        writeln!(out, "| # | ring | pos | op | flags | what | patched by |")?;
        writeln!(out, "|---|---|---|---|---|---|---|")?;
        for (i, s) in self.steps.iter().enumerate() {
            let w = &s.wqe;
            if w.opcode == Opcode::Nop {
                continue;
            }
            let ring = match s.ring {
                Ring::Loop => "Loop",
                Ring::Mgmt => "Mgmt",
            };
            write!(out, "| {i} | {ring} | {} | {} | ", self.position(i), w.opcode.name())?;
            let mut first = true;
            for (flag, name) in [
                (crate::wire::wqe::WqeFlags::SIGNALED, "sig"),
                (crate::wire::wqe::WqeFlags::FENCE, "fence"),
                (crate::wire::wqe::WqeFlags::UNBIND, "unbind"),
            ] {
                if w.flags.contains(flag) {
                    write!(out, "{}{name}", if first { "" } else { "," })?;
                    first = false;
                }
            }
            write!(out, " | ")?;
            self.describe(i, out)?;
            write!(out, " | ")?;
            let mut any = false;
            for (p, ps) in self.steps.iter().enumerate() {
                for loc in [ps.local, ps.remote].into_iter().flatten() {
                    if let Loc::Field { step, field } = loc {
                        if step as usize == i {
                            let kind = match (ps.remote == Some(loc), ps.wqe.opcode) {
                                (true, Opcode::Read) => "→",
                                (true, Opcode::FetchAdd) => "bump ",
                                (true, _) => "cleared ",
                                _ => "",
                            };
                            let sep = if any { ", " } else { "" };
                            if kind == "→" {
                                write!(out, "{sep}{field:?}→#{p}")?;
                            } else {
                                write!(out, "{sep}{kind}{field:?}←#{p}")?;
                            }
                            any = true;
                        }
                    }
                }
            }
            for r in self.recv.iter() {
                if let Loc::Field { step, field } = r.loc {
                    if step as usize == i {
                        write!(out, "{}{field:?}←RECV", if any { ", " } else { "" })?;
                        any = true;
                    }
                }
            }
            writeln!(out, " |")?;
        }
        let nops = self.steps.iter().filter(|s| s.wqe.opcode == Opcode::Nop).count();
        writeln!(out)?;
        writeln!(
            out,
            "Ring depths: Loop {}, Mgmt {} ({nops} NOP padding entries not shown). First lap enables Loop 0..{}, Mgmt 0..{}.",
            self.ring_depth[0], self.ring_depth[1], self.initial_enable[0], self.initial_enable[1]
        )?;
        write!(out, "RECV scatter: ")?;
        for (k, r) in self.recv.iter().enumerate() {
            let sep = if k == 0 { "" } else { ", " };
            match r.loc {
                Loc::Mem(a) => write!(out, "{sep}{} B → MN {a:#x}", r.len)?,
                Loc::Field { step, field } => write!(out, "{sep}{} B → #{step}.{field:?}", r.len)?,
            }
        }
        writeln!(out)
    }

    /// The chain's cost in one paragraph (docs/CHAINS.md): gated phases before its
    /// [`Self::critical_end`], WQEs per lap, re-arm bumps.
    pub fn write_summary(&self, out: &mut impl fmt::Write) -> fmt::Result {
        let nops = self.steps.iter().filter(|s| s.wqe.opcode == Opcode::Nop).count();
        let what = match self.kind {
            ChainKind::Alloc => "the reply",
            ChainKind::Free => "the push",
        };
        match (self.critical_end, self.critical_path()) {
            (Some(end), Some(g)) => writeln!(
                out,
                "**Critical path:** {} gated phases from the request to {what} (#{end}): {} WAIT, {} ENABLE releases.",
                g.gates,
                g.waits,
                g.gates - g.waits
            )?,
            _ => writeln!(out, "**Critical path:** not computed (no end step, or the layout does not validate).")?,
        }
        writeln!(
            out,
            "**Per lap:** {} WQEs (Loop {}, Mgmt {}; {} of them NOP padding), of which {} lap re-arm fetch-and-add{}.",
            self.wqes_per_lap(),
            self.ring_depth[0],
            self.ring_depth[1],
            nops,
            self.rearm_bumps(),
            if self.rearm_bumps() == 1 { "" } else { "s" }
        )
    }

    fn describe(&self, i: usize, out: &mut impl fmt::Write) -> fmt::Result {
        let s = &self.steps[i];
        let w = &s.wqe;
        let loc = |l: Option<Loc>, addr: u64| match l {
            Some(Loc::Field { step, field }) => FieldOrAddr::Field(step, field),
            _ => FieldOrAddr::Addr(addr),
        };
        match w.opcode {
            Opcode::Wait => {
                let q = if w.queue_sel() == QueueSel::Recv { "recv" } else { "send" };
                let r = if w.qpn == self.qpns[0] { "Loop" } else { "Mgmt" };
                write!(out, "until {r} {q} CQ ≥ {} (lap 0)", w.operand0)
            }
            Opcode::Enable => {
                let q = if w.queue_sel() == QueueSel::Recv { "recv" } else { "send" };
                let r = if w.qpn == self.qpns[0] { "Loop" } else { "Mgmt" };
                write!(out, "{r} {q} queue += {}", w.operand0)
            }
            Opcode::Read => {
                write!(out, "{} B {} → {}", w.length, loc(s.remote, w.remote_addr), loc(s.local, w.local_addr))
            }
            Opcode::Write | Opcode::WriteWithImm => {
                write!(out, "{} B {} → {}", w.length, loc(s.local, w.local_addr), loc(s.remote, w.remote_addr))
            }
            Opcode::FetchAdd | Opcode::MaskedFetchAdd => write!(
                out,
                "{} += {:#x} (mask {:#x}), old → {}",
                loc(s.remote, w.remote_addr),
                w.operand0,
                w.operand1,
                loc(s.local, w.local_addr)
            ),
            Opcode::BindMw if w.flags.contains(crate::wire::wqe::WqeFlags::UNBIND) => {
                f_write(out, "invalidate window (no QP check)")
            }
            Opcode::BindMw => write!(out, "bind window to QP {:#x}, access {:?}", w.qpn, w.access()),
            Opcode::LocalInv => f_write(out, "invalidate window (bound-QP check)"),
            _ => Ok(()),
        }
    }
}

fn f_write(out: &mut impl fmt::Write, s: &str) -> fmt::Result {
    out.write_str(s)
}

enum FieldOrAddr {
    Field(u8, WqeField),
    Addr(u64),
}

impl fmt::Display for FieldOrAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FieldOrAddr::Field(s, fl) => write!(f, "#{s}.{fl:?}"),
            FieldOrAddr::Addr(a) => write!(f, "[{a:#x}]"),
        }
    }
}

#[cfg(test)]
mod doc_tests {
    use crate::chain::alloc::build_alloc_chain;
    use crate::chain::builder::test_env;
    use crate::chain::free::build_free_chain;
    use std::string::String;

    const HEAD: &str = r#"
How the chains keep short (the mechanisms are checked by `ChainLayout::validate`):

- **Gates.** A *gated phase* begins where a send queue stops fetching until something else
  happened: a WAIT (until a CQ count), or the end of a managed queue's enabled range (until an
  ENABLE raises it). On the NIC each costs a WQE fetch after the gate opens. A patched WQE
  field must be complete before its WQE can be fetched, so each value the chain learns and then
  uses as a WQE field — the slot address, the entry address, the entry — costs one gate.
- **FENCE instead of WAIT.** A FENCEd WQE executes only after every earlier READ and atomic of
  its QP completed (IBTA's fence indicator; rdma-core maps `IBV_SEND_FENCE` to mlx5's fence
  mode). A copy that *reads* a value an earlier READ or atomic produced therefore sits in the
  same phase as its producer, FENCEd; and a FENCEd ENABLE of the chain's own Loop ring is a gate
  that needs no WAIT. WAIT counts are absolute (mlx5 WAIT compares a CQ producer index), so each
  WAIT needs a fetch-and-add per lap; ENABLE counts are relative and need none. Only the WAIT
  for the RECV (and, in the alloc chain, the management ring's WAIT for the reply, off the
  critical path) remain.
- **Order on the management QP.** The binds and the reply (alloc), the invalidations and the
  release of the second half (free) share one send queue: mlx5 fences the WQE after a bind or
  invalidation until it completed, and a failure errors the QP and flushes the rest — no WAIT.
- **Scatter, not copy.** The RECV puts request bytes straight into the WQEs that use them (the
  reply target, the access QP numbers, the free's entry address); loop READs copy a field out of
  a WQE (`#n.Field → [addr]`) where scratch needs it too.
- **Checks first.** Nothing after the empty probe (alloc) or the ownership check (free) can
  execute before that check completed; the reply (push) only after every bind (invalidation).
- **No replay.** Addresses and keys the RECV puts into WQEs are cleared every lap, and nothing
  the next request overwrites is still in use when its RECV is enabled.
- **What only hardware can settle.** That an mlx5 SEND_EN WQE with the fence bit waits like
  any fenced WQE (the lap-closing ENABLE relied on it before); that the small fence after a UMR
  holds the next WQE until the UMR completed.
- **The same chains in mlx5 form** (`omw_core::chain::mlx5`, docs/MLX5.md): every step keeps
  its place, FENCE and completion; a copy between little-endian MN memory and a big-endian
  WQE field becomes a byte-reversing scatter READ, the RECV reverses the request's fields, and
  every WAIT and ENABLE (absolute on mlx5) advances per lap through a little-endian shadow
  counter. docs/MLX5.md gives the WQEs and WQEBBs per lap of that form.

"#;

    /// docs/CHAINS.md is generated from the builders; this fails when it is stale.
    /// Regenerate with `OMW_BLESS=1 cargo test -p omw-core chains_doc`.
    #[test]
    fn chains_doc_is_current() {
        let mut env = test_env(4096, 16, 3);
        // the free chain scrubs on the NIC (from a private chunk of zeros)
        env.keys.zero_lkey = 0x18;
        env.keys.pool_scrub_rkey = 0x19;
        env.keys.zero_addr = 1 << 40;
        let mut doc = String::new();
        doc.push_str("# The alloc and free chains, step by step\n\n");
        doc.push_str("Generated from `omw_core::chain::alloc` / `free_chain` for G = 3, 4 KiB chunks, 16 chunks,\n");
        doc.push_str(
            "NIC scrubbing (`OMW_BLESS=1 cargo test -p omw-core chains_doc` regenerates it; a test fails when it is stale).\n",
        );
        doc.push_str("`#n.Field` is a field of step n's WQE, `[addr]` an MN address (scratch, queue, table),\n");
        doc.push_str("`Loop` the MN loopback QP's send queue, `Mgmt` the MN end of the CN's Alloc/Free QP.\n");
        doc.push_str("WAITs are bumped by a FETCH_ADD at the end of each lap (`bump Operand0←#n`), request-supplied\n");
        doc.push_str("fields are `cleared` for the next lap, `Field→#n` marks a loop READ copying that field out.\n");
        doc.push_str(HEAD);
        doc.push_str("## Alloc chain\n\n");
        let a = build_alloc_chain(&env).unwrap();
        a.write_summary(&mut doc).unwrap();
        doc.push('\n');
        a.write_table(&mut doc).unwrap();
        doc.push_str("\n## Free chain\n\n");
        let f = build_free_chain(&env).unwrap();
        f.write_summary(&mut doc).unwrap();
        doc.push('\n');
        f.write_table(&mut doc).unwrap();
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/CHAINS.md");
        if std::env::var("OMW_BLESS").is_ok() {
            std::fs::write(path, &doc).unwrap();
        }
        let on_disk = std::fs::read_to_string(path).unwrap_or_default();
        assert!(on_disk == doc, "docs/CHAINS.md is stale: run OMW_BLESS=1 cargo test -p omw-core chains_doc");
    }
}
