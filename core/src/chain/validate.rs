//! The chains' static validator: proves that the NIC, running each ring independently (gated
//! only by WAIT and ENABLE, ordered within a QP by FENCE and the fence after a bind), agrees
//! with the layout's global order — every patched WQE field is complete before its WQE can be
//! *fetched* (only enable limits bound a fetch: a WAIT does not stop prefetch, issue 22), every
//! scratch word before the step that reads or overwrites it *executes*
//! ([`ChainLayout::happens_before`]); nothing runs before the empty probe or ownership check
//! has completed, nor the reply or push before the window operations; each lap re-arms what
//! the next needs. [`ChainLayout::critical_path`] counts the gated phases to the reply or push.

use super::*;
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
        self.check_recv_publish()?;
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
                let (p, pl) = self.proof_sink;
                let in_sink =
                    !is_read && pl > 0 && addr >= p && addr.saturating_add(len as u64) <= p.saturating_add(pl);
                if !in_meta && !in_zero && !in_sink {
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
                Loc::RecvDoorbell => return Err(ChainError::MisplacedRecvDoorbell { step: 0 }),
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

    /// The receive doorbell ([`Loc::RecvDoorbell`]) is written only by the lap's one publish: an
    /// unsignaled fetch-and-add of 1 on the Loop ring right behind the lap's receive ENABLE —
    /// so it admits the next request exactly when the ENABLE would (whatever the RECV's targets
    /// need finished by then is checked against the ENABLE, `check_rearm`), it keeps the CQ
    /// counts the WAITs expect, and the mlx5 form can take the ENABLE's index as the count.
    fn check_recv_publish(&self) -> Result<(), ChainError> {
        let mut seen = false;
        for (i, s) in self.steps.iter().enumerate() {
            let bad = ChainError::MisplacedRecvDoorbell { step: i as u8 };
            if s.local == Some(Loc::RecvDoorbell) {
                return Err(bad);
            }
            if s.remote != Some(Loc::RecvDoorbell) {
                continue;
            }
            let prev = (0..i).rev().find(|&j| self.steps[j].ring == s.ring).map(|j| &self.steps[j]);
            let behind_recv_enable = prev.is_some_and(|p| {
                p.wqe.opcode == Opcode::Enable && p.wqe.queue_sel() == QueueSel::Recv && p.wqe.qpn == self.qpns[1]
            });
            let w = &s.wqe;
            if seen
                || s.ring != Ring::Loop
                || w.opcode != Opcode::FetchAdd
                || w.operand0 != 1
                || w.flags.contains(crate::wire::wqe::WqeFlags::SIGNALED)
                || !behind_recv_enable
            {
                return Err(bad);
            }
            seen = true;
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
        // The fenced ENABLE that starts the Loop ring's next lap — or, with relayed gates
        // (`ChainVariant::relays_gates`), releases the management ring's relay that does: every
        // bump must land before it executes (FENCE waits for this QP's outstanding atomics),
        // and nothing else of the next lap can run before the Loop ring's does.
        let closing = self
            .steps
            .iter()
            .enumerate()
            .rev()
            .find(|(_, e)| {
                e.ring == Ring::Loop
                    && (self.is_send_enable_of(e, Ring::Loop) || self.is_send_enable_of(e, Ring::Mgmt))
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
                    Loc::RecvDoorbell => false,
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

    /// Relayed gates (`ChainVariant::relays_gates`): no ENABLE of a queue sits on that queue,
    /// every variant validates for every G and geometry, and what relaying costs is exactly
    /// one more gate per relay on the path: alloc popping ahead 2 → 2 (its path has no Loop
    /// gate), not popping ahead 4 → 6, free 5 → 7; one more WQE per relay and lap (in mlx5
    /// form three: the relay's lap counter adds a fetch-and-add and a copy).
    #[test]
    fn relayed_gates_enable_no_queue_from_itself() {
        use crate::chain::variant::ChainVariant;
        for g in 2..=crate::geometry::MAX_GROUP_SIZE as u8 {
            for (cs, n) in [(512u64, 1u32), (4096, 100), (1 << 20, 7)] {
                for v in ChainVariant::ALL.into_iter().filter(|v| v.relays_gates) {
                    let plain = ChainVariant { relays_gates: false, ..v };
                    for pop_ahead in [true, false] {
                        let env = ChainEnv { variant: v, pop_ahead, ..test_env(cs, n, g) };
                        let base = ChainEnv { variant: plain, ..env };
                        for (c, b) in [
                            (build_alloc_chain(&env).unwrap(), build_alloc_chain(&base).unwrap()),
                            (build_free_chain(&env).unwrap(), build_free_chain(&base).unwrap()),
                        ] {
                            assert_eq!(c.validate(), Ok(()), "{:?} {v:?} G={g} cs={cs}", c.kind);
                            let selfish = c.steps.iter().any(|s| {
                                s.wqe.opcode == Opcode::Enable
                                    && s.wqe.queue_sel() == QueueSel::Send
                                    && s.wqe.qpn == c.qpns[s.ring as usize]
                            });
                            assert!(!selfish, "{:?} {v:?}: a queue enables itself", c.kind);
                            let relays = c
                                .steps
                                .iter()
                                .filter(|s| s.ring == Ring::Mgmt && s.wqe.opcode == Opcode::Enable)
                                .count()
                                - b.steps
                                    .iter()
                                    .filter(|s| s.ring == Ring::Mgmt && s.wqe.opcode == Opcode::Enable)
                                    .count();
                            let (pc, pb) = (c.critical_path().unwrap(), b.critical_path().unwrap());
                            // (binds to the poster: the free chain's proof gate is one more)
                            let on_path = match (c.kind, pop_ahead) {
                                (ChainKind::Alloc, true) => 0,
                                (ChainKind::Free, _) if v.binds_to_poster => 3,
                                _ => 2,
                            };
                            assert_eq!(pc.gates, pb.gates + on_path, "{:?} {v:?} pop_ahead={pop_ahead}", c.kind);
                            assert_eq!(pc.waits, pb.waits);
                            let real = |l: &ChainLayout| l.steps.iter().filter(|s| s.wqe.opcode != Opcode::Nop).count();
                            assert_eq!(real(&c), real(&b) + relays, "{:?} {v:?}: one WQE more per relay", c.kind);
                        }
                    }
                }
            }
        }
    }

    /// Chains that publish their own receives: every variant validates with one publish per
    /// lap right behind the receive ENABLE, nothing else touches the record, and the publish
    /// costs one WQE off the path; a publish anywhere else, or of another count, is refused.
    #[test]
    fn receive_publish_is_one_fetch_add_behind_the_receive_enable() {
        use crate::chain::variant::ChainVariant;
        for g in 2..=crate::geometry::MAX_GROUP_SIZE as u8 {
            for v in ChainVariant::ALL {
                let env = ChainEnv { variant: v, posts_receives: true, ..test_env(4096, 100, g) };
                let base = ChainEnv { posts_receives: false, ..env };
                for (c, b) in [
                    (build_alloc_chain(&env).unwrap(), build_alloc_chain(&base).unwrap()),
                    (build_free_chain(&env).unwrap(), build_free_chain(&base).unwrap()),
                ] {
                    assert_eq!(c.validate(), Ok(()), "{:?} {v:?} G={g}", c.kind);
                    let p = c.recv_publish().expect("a publish") as usize;
                    let en = (0..p).rev().find(|&j| c.steps[j].ring == Ring::Loop).unwrap();
                    assert_eq!(c.steps[en].wqe.queue_sel(), QueueSel::Recv);
                    assert_eq!(c.steps.iter().filter(|s| s.remote == Some(Loc::RecvDoorbell)).count(), 1);
                    assert_eq!(c.critical_path(), b.critical_path(), "{:?}: off the path", c.kind);
                    let real = |l: &ChainLayout| l.steps.iter().filter(|s| s.wqe.opcode != Opcode::Nop).count();
                    assert_eq!(real(&c), real(&b) + 1);
                    // of 2, signaled, as a local address, twice, or away from the ENABLE: refused
                    let refused = |d: ChainLayout| {
                        assert!(
                            matches!(d.validate(), Err(ChainError::MisplacedRecvDoorbell { .. })),
                            "{:?}",
                            d.validate()
                        )
                    };
                    let mut d = c.clone();
                    d.steps[p].wqe.operand0 = 2;
                    refused(d);
                    let mut d = c.clone();
                    d.steps[p].wqe.flags |= WqeFlags::SIGNALED;
                    refused(d);
                    let mut d = c.clone();
                    d.steps[p].local = Some(Loc::RecvDoorbell);
                    refused(d);
                    let mut d = c.clone();
                    let other = (0..d.steps.len())
                        .find(|&j| j != p && d.steps[j].ring == Ring::Loop && d.steps[j].wqe.opcode == Opcode::Read)
                        .unwrap();
                    d.steps[other].remote = Some(Loc::RecvDoorbell);
                    refused(d);
                    let mut d = c.clone();
                    d.recv[0].loc = Loc::RecvDoorbell;
                    assert!(d.validate().is_err());
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

    /// Binds to the poster (`ChainVariant::binds_to_poster`): every bind names the management
    /// QP that posts it; the free chain proves ownership by a Loop READ into the CN's proof word
    /// whose local key comes from the entry's proof field, released by a gate (it is patched)
    /// and FENCEd before the Free QP's ring, which unbinds all G windows without a LOCAL_INV.
    /// Without the proof word the free chain is refused; the proof READ's FENCE, its gate or
    /// its patch removed, the layout is refused.
    #[test]
    fn binds_to_the_poster_prove_ownership_by_the_owners_key() {
        use crate::chain::builder::OwnerProof;
        use crate::chain::variant::ChainVariant;
        use crate::wire::memory_map::{free_scratch, FREE_SCRATCH_OFF};
        use crate::wire::mwtable::ENTRY_OFF_PROOF;
        for g in 2..=crate::geometry::MAX_GROUP_SIZE as u8 {
            for v in ChainVariant::BINDING_TO_POSTER {
                for pop_ahead in [true, false] {
                    let env = ChainEnv { variant: v, pop_ahead, ..test_env(4096, 100, g) };
                    let proof: OwnerProof = env.owner_proof.unwrap();
                    let a = build_alloc_chain(&env).unwrap();
                    assert_eq!(a.validate(), Ok(()), "alloc {v:?} G={g}");
                    let binds: std::vec::Vec<_> = a.steps.iter().filter(|s| s.wqe.opcode == Opcode::BindMw).collect();
                    assert_eq!(binds.len(), g as usize);
                    assert_eq!(binds[0].wqe.qpn, env.mgmt_qpn, "MW[0] to the poster");
                    assert!(binds.iter().all(|b| b.ring == Ring::Mgmt));
                    let f = build_free_chain(&env).unwrap();
                    assert_eq!(f.validate(), Ok(()), "free {v:?} G={g}");
                    let check = f.ownership_check.unwrap() as usize;
                    let st = f.steps[check];
                    assert_eq!((st.ring, st.wqe.opcode, st.wqe.local_addr), (Ring::Loop, Opcode::Read, proof.addr));
                    // its key is the entry's proof field, copied by a Loop READ
                    let cp = f
                        .steps
                        .iter()
                        .find(|s| s.local == Some(Loc::Field { step: check as u8, field: WqeField::Lkey }))
                        .unwrap();
                    let s = env.scratch() + FREE_SCRATCH_OFF + free_scratch::ENTRY + ENTRY_OFF_PROOF;
                    assert_eq!((cp.ring, cp.wqe.remote_addr, cp.wqe.length), (Ring::Loop, s, 4));
                    assert!(f.steps.iter().all(|s| s.wqe.opcode != Opcode::LocalInv));
                    let unbinds = f.steps.iter().filter(|s| s.wqe.flags.contains(WqeFlags::UNBIND)).count();
                    assert_eq!(unbinds, g as usize, "every window, MW[0] too");
                    // one gated phase more than the paper's free chain (relayed: and its hop)
                    let paper = ChainVariant { binds_to_poster: false, ..v };
                    let pf = build_free_chain(&ChainEnv { variant: paper, ..env }).unwrap();
                    let more = if v.relays_gates { 2 } else { 1 };
                    assert_eq!(f.critical_path().unwrap().gates, pf.critical_path().unwrap().gates + more, "{v:?}");
                    let pa = build_alloc_chain(&ChainEnv { variant: paper, ..env }).unwrap();
                    assert_eq!(a.critical_path(), pa.critical_path(), "{v:?}: the alloc path unchanged");
                    // refusals
                    let none = ChainEnv { owner_proof: None, ..env };
                    assert_eq!(build_free_chain(&none), Err(ChainError::NoOwnerProof));
                    let mut unfenced = f.clone();
                    let rel = (check + 1..f.steps.len()).find(|&i| f.steps[i].ring == Ring::Loop).unwrap();
                    assert_eq!(f.steps[rel].wqe.opcode, Opcode::Enable);
                    unfenced.steps[rel].wqe.flags.remove(WqeFlags::FENCE);
                    assert!(unfenced.validate().is_err(), "{v:?}: the unbinds before the proof completed");
                    let mut outside = f.clone();
                    outside.proof_sink = (0, 0);
                    assert!(matches!(outside.validate(), Err(ChainError::OutOfRegion { .. })));
                }
            }
        }
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
