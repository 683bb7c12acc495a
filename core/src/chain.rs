//! Chain layouts: a pre-posted WR chain as data, and its static validator.
//!
//! A chain spans three queues of the MN: the receive queue of a management QP (whose RECV
//! scatters the request bytes), the send queue of the MN end of that management QP (`Mgmt`),
//! and the send queue of the MN's loopback QP (`Loop`, which reaches the MN's own memory for
//! the queue atomics, the MWTable READs and the WQE patches). Steps are listed in a global
//! order that is a valid sequential execution (the host engine runs exactly that order); the
//! NIC instead runs each ring independently, gated only by WAIT and ENABLE. The validator
//! proves the two agree: every byte a step consumes that an earlier step produced — a patched
//! WQE field or a scratch word — is guaranteed complete before the consumer can be *fetched*.
//!
//! Re-arming: both send rings are managed (they execute only up to an ENABLE limit, and ENABLE
//! advances that limit by a count) and the chain closes each lap by bumping every WAIT's
//! absolute CQ count with a fetch-and-add on the WQE field, then — fenced behind those
//! atomics — enabling the next lap. The MN CPU arms a chain once per connection and
//! again only after a failure.

use crate::wqe::{Opcode, QueueSel, Wqe, WqeField, WQE_SIZE};
use core::fmt;

pub const MAX_STEPS: usize = 120;
pub const MAX_RECV_TARGETS: usize = crate::wqe::MAX_RECV_SGES;

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
    TooManySteps,
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
            Self::TooManySteps => write!(f, "chain exceeds {MAX_STEPS} steps"),
        }
    }
}

type Set = u128;
const RECV_BIT: u32 = 127;

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
            if s.wqe.flags.contains(crate::wqe::WqeFlags::SIGNALED) {
                c[s.ring as usize] += 1;
            }
        }
        c
    }
    /// The n-th signaled step (1-based count) of a ring.
    fn nth_signaled(&self, ring: Ring, n: u64) -> Option<usize> {
        let mut k = 0;
        for (i, s) in self.steps.iter().enumerate() {
            if s.ring == ring && s.wqe.flags.contains(crate::wqe::WqeFlags::SIGNALED) {
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
        // --- happens-before: what is complete when each step can be fetched -------------------
        let mut fetch: heapless::Vec<Set, MAX_STEPS> = heapless::Vec::new();
        // Completed(p) = p, everything fetched-before p, and earlier steps of p's ring.
        let mut done: heapless::Vec<Set, MAX_STEPS> = heapless::Vec::new();
        let recv_done: Set = bit(RECV_BIT as usize);
        for i in 0..n {
            let s = &self.steps[i];
            let pos = self.position(i);
            let mut g: Set = 0;
            // WAITs earlier on the same ring block fetching past them.
            for j in 0..i {
                let w = &self.steps[j];
                if w.ring == s.ring && w.wqe.opcode == Opcode::Wait {
                    g |= fetch[j] | self.wait_guarantee(j, &done, recv_done)?;
                }
            }
            // Steps past the initial enable are released by an earlier ENABLE.
            if pos >= self.initial_enable[s.ring as usize] as usize {
                match self.releasing_enable(s.ring, pos, i) {
                    Some(j) => g |= fetch[j],
                    None => return Err(ChainError::NeverEnabled { step: i as u8 }),
                }
            }
            let _ = fetch.push(g);
            let mut d = g | bit(i);
            for j in 0..i {
                if self.steps[j].ring == s.ring {
                    d |= done[j];
                }
            }
            let _ = done.push(d);
        }
        // --- patches and memory dependencies ----------------------------------------------------
        for (i, s) in self.steps.iter().enumerate() {
            for loc in [s.local, s.remote].into_iter().flatten() {
                if let Loc::Field { step, field } = loc {
                    let t = step as usize;
                    if t >= n {
                        return Err(ChainError::BadStepRef { step });
                    }
                    self.check_patch_span(step, field, s.wqe.length)?;
                    // A remote-side field target rewrites a WQE for the *next* lap: a bump of a
                    // WAIT's count (FETCH_ADD) or a clear of request-supplied fields (WRITE).
                    // The target must already have run in this lap, and the write must land
                    // before the lap-closing fenced ENABLE (checked in `check_rearm`).
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
                    continue;
                }
                for p in 0..i {
                    for (pa, pl, pr) in self.mem_accesses(p) {
                        if !pr && overlaps(pa, pl, addr, len) && fetch[i] & bit(p) == 0 {
                            return Err(ChainError::UngatedDependency {
                                producer: Producer::Step(p as u8),
                                consumer: i as u8,
                            });
                        }
                    }
                }
                for r in &self.recv {
                    if let Loc::Mem(a) = r.loc {
                        if overlaps(a, r.len, addr, len) && fetch[i] & recv_done == 0 {
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
        if self.rearm == Rearm::SelfEnabling {
            self.check_rearm()?;
        }
        Ok(())
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
        // Addresses patched at run time are dynamic: the MR they go through checks them, not
        // this validator.
        let local_is_mem = s.local.is_none() && !self.is_patched(i, WqeField::LocalAddr);
        let remote_is_mem = s.remote.is_none() && s.ring == Ring::Loop && !self.is_patched(i, WqeField::RemoteAddr);
        match w.opcode {
            Opcode::Read => {
                if remote_is_mem {
                    let _ = v.push((w.remote_addr, w.length, true));
                }
                if local_is_mem {
                    let _ = v.push((w.local_addr, w.length, false));
                }
            }
            Opcode::FetchAdd | Opcode::MaskedFetchAdd | Opcode::CompareSwap => {
                if remote_is_mem {
                    // read-modify-write of MN memory
                    let _ = v.push((w.remote_addr, 8, true));
                    let _ = v.push((w.remote_addr, 8, false));
                }
                if local_is_mem {
                    let _ = v.push((w.local_addr, 8, false));
                }
            }
            Opcode::Write | Opcode::WriteWithImm | Opcode::Send | Opcode::SendWithImm => {
                if local_is_mem {
                    let _ = v.push((w.local_addr, w.length, true));
                }
                // A WRITE over the loop QP lands in MN memory: a producer for later readers
                // (modelled as a completion-time write, like a READ response).
                if remote_is_mem && matches!(w.opcode, Opcode::Write | Opcode::WriteWithImm) {
                    let _ = v.push((w.remote_addr, w.length, false));
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

    fn check_rearm(&self) -> Result<(), ChainError> {
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
                    && e.wqe.flags.contains(crate::wqe::WqeFlags::FENCE)
            })
            .map(|(j, _)| j)
            .ok_or(ChainError::MissingRearm { step: end })?;
        for (j, w) in self.steps.iter().enumerate() {
            if matches!(w.remote, Some(Loc::Field { .. })) && (j > closing || w.ring != Ring::Loop) {
                return Err(ChainError::MissingRearm { step: j as u8 });
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
    use crate::alloc_chain::build_alloc_chain;
    use crate::chain_builder::test_env;
    use crate::free_chain::build_free_chain;
    use crate::wqe::WqeFlags;

    #[test]
    fn chains_valid_for_many_geometries() {
        for g in 2..=crate::geometry::MAX_GROUP_SIZE as u8 {
            for (cs, n) in [(512u64, 1u32), (4096, 100), (1 << 20, 7), (1 << 30, 3)] {
                let env = test_env(cs, n, g);
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

    /// Removing the WAIT that gates a patched step must be caught.
    #[test]
    fn ungated_patch_rejected() {
        let mut c = alloc();
        // the WAIT right before the pop READ (step "pop" is patched by the copy before it)
        let pop = c
            .steps
            .iter()
            .position(|s| s.wqe.opcode == Opcode::Read && s.wqe.remote_addr == 0 && s.local.is_none())
            .unwrap();
        let wait = (0..pop).rev().find(|i| c.steps[*i].wqe.opcode == Opcode::Wait).unwrap();
        c.steps[wait].wqe = Wqe::nop().with_flags(WqeFlags::empty());
        // the bump of that WAIT now points at a NOP: drop it to isolate the gating error
        for s in c.steps.iter_mut() {
            if s.remote == Some(Loc::Field { step: wait as u8, field: WqeField::Operand0 }) {
                s.wqe = Wqe::nop().with_flags(WqeFlags::SIGNALED);
                s.remote = None;
            }
        }
        c.rearm = Rearm::Host;
        assert!(
            matches!(c.validate(), Err(ChainError::UngatedPatch { .. }) | Err(ChainError::UngatedDependency { .. })),
            "{:?}",
            c.validate()
        );
    }

    #[test]
    fn ungated_recv_patch_rejected() {
        let mut c = alloc();
        c.steps[0].wqe.operand0 = 0; // WAIT for zero RECVs: gates nothing
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
                (crate::wqe::WqeFlags::SIGNALED, "sig"),
                (crate::wqe::WqeFlags::FENCE, "fence"),
                (crate::wqe::WqeFlags::UNBIND, "unbind"),
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
                            let kind = if ps.remote == Some(loc) { "bump " } else { "" };
                            write!(out, "{}{kind}{field:?}←#{p}", if any { ", " } else { "" })?;
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
            Opcode::BindMw if w.flags.contains(crate::wqe::WqeFlags::UNBIND) => {
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
    use crate::alloc_chain::build_alloc_chain;
    use crate::chain_builder::test_env;
    use crate::free_chain::build_free_chain;
    use std::string::String;

    /// docs/CHAINS.md is generated from the builders; this fails when it is stale.
    /// Regenerate with `OMW_BLESS=1 cargo test -p omw-core chains_doc`.
    #[test]
    fn chains_doc_is_current() {
        let env = test_env(4096, 16, 3);
        let mut doc = String::new();
        doc.push_str("# The alloc and free chains, step by step\n\n");
        doc.push_str("Generated from `omw_core::alloc_chain` / `free_chain` for G = 3, 4 KiB chunks, 16 chunks\n");
        doc.push_str(
            "(`OMW_BLESS=1 cargo test -p omw-core chains_doc` regenerates it; a test fails when it is stale).\n",
        );
        doc.push_str("`#n.Field` is a field of step n's WQE, `[addr]` an MN address (scratch, queue, table),\n");
        doc.push_str("`Loop` the MN loopback QP's send queue, `Mgmt` the MN end of the CN's Alloc/Free QP.\n");
        doc.push_str("Every WAIT is bumped by a FETCH_ADD at the end of each lap (`bump Operand0←#n`).\n\n");
        doc.push_str("## Alloc chain\n\n");
        build_alloc_chain(&env).unwrap().write_table(&mut doc).unwrap();
        doc.push_str("\n## Free chain\n\n");
        build_free_chain(&env).unwrap().write_table(&mut doc).unwrap();
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/CHAINS.md");
        if std::env::var("OMW_BLESS").is_ok() {
            std::fs::write(path, &doc).unwrap();
        }
        let on_disk = std::fs::read_to_string(path).unwrap_or_default();
        assert!(on_disk == doc, "docs/CHAINS.md is stale: run OMW_BLESS=1 cargo test -p omw-core chains_doc");
    }
}
