//! Scheduling: which QP's head WQE runs next, and at what modelled time.
//!
//! A QP is *runnable* when it is in RTS with an entry available (below its producer index, or
//! below its enable limit if the queue is managed) that is not a WAIT whose CQ count is not
//! reached — or when it is in the error state with entries left to flush. Its *ready time* is
//! the earliest time its head can start: its host's send engine is free, the previous bind's
//! fence has passed, a FENCEd WQE's earlier READs/atomics have completed, a WAIT's n-th CQE
//! has been generated, an RNR-waiting SEND's timeout has expired. [`Fabric::step`] runs the
//! runnable QP with the earliest ready time, ties going round-robin by QP index from the one
//! after the last QP that ran; the clock moves to that time (never backwards).
//!
//! QPs blocked on a WAIT are *parked* on the CQ they wait for and woken by its next CQE, so
//! blocked chains cost nothing per step.

use crate::counters::StepInfo;
use crate::fabric::Fabric;
use omw_core::device::behaviour::{RecvEnable, WaitPrefetch};
use omw_core::device::QpState;
use omw_core::wire::wqe::{Opcode, QueueSel, WqeFlags, WQE_SIZE};

/// A QP (global index) and the time it can run.
pub(crate) type Pick = (u32, u64);

pub(crate) enum Readiness {
    Ready(u64),
    /// Only the clock can make this run: an RNR wait that expires at this time.
    Timer(u64),
    Idle,
    /// Blocked on a WAIT for a CQ (fabric-wide index).
    Blocked(u32),
}

/// The fields scheduling needs from a head WQE's bytes.
#[derive(Clone, Copy)]
pub(crate) struct Peek {
    pub opcode: u8,
    pub flags: u8,
    pub qpn: u32,
    pub op0: u64,
    pub op1: u64,
}

impl Peek {
    #[inline]
    pub fn of(b: &[u8]) -> Peek {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(x)
        };
        Peek { opcode: b[0], flags: b[1], qpn: u32_at(44), op0: u64_at(48), op1: u64_at(56) }
    }
}

#[inline]
pub(crate) fn needs_recv(op: u8) -> bool {
    op == Opcode::Send as u8
        || op == Opcode::SendWithImm as u8
        || op == Opcode::SendWithInv as u8
        || op == Opcode::WriteWithImm as u8
}

impl Fabric {
    /// Put a QP on the active list (idempotent); unparks it.
    #[inline]
    pub(crate) fn activate(&mut self, g: u32) {
        let q = &mut self.qps[g as usize];
        q.parked_on = None;
        if q.alive && !q.in_active {
            q.in_active = true;
            self.active.push(g);
        }
    }

    /// The processing unit QP `g` is pinned to on its host's NIC (its local index modulo the
    /// unit count: QP numbers are `(host + 1) << 16 | local`).
    #[inline]
    pub(crate) fn unit(&self, g: u32) -> usize {
        let q = &self.qps[g as usize];
        self.hosts[q.host as usize].nic.unit_of(q.qpn & 0xFFFF)
    }

    /// The connected QP, if it still exists.
    #[inline]
    pub(crate) fn peer_gq(&self, g: u32) -> Option<u32> {
        let (h, qpn) = self.qps[g as usize].peer?;
        self.resolve(h, qpn)
    }

    /// The head entry's bytes as the NIC sees them: the prefetch cache if it holds the head,
    /// otherwise the ring in memory.
    /// A ring in mlx5 form is fetched and translated (`crate::mlx5_fetch`); bytes that do not
    /// decode read as an unknown canonical opcode, so they fail the way malformed WQEs do.
    #[inline]
    pub(crate) fn head_slice(&self, g: u32) -> [u8; WQE_SIZE] {
        let q = &self.qps[g as usize];
        if q.mlx5 {
            return self.mlx5_head(g).wqe.map_or([0xFF; WQE_SIZE], |w| w.encode());
        }
        if let Some(b) = q.pf.front() {
            return *b;
        }
        let addr = q.sq.slot_addr(q.sq.consumer);
        let mut out = [0u8; WQE_SIZE];
        if let Some(s) = self.hosts[q.host as usize].mem.slice(addr, WQE_SIZE as u64) {
            out.copy_from_slice(s);
        }
        out
    }

    /// The canonical WAIT in `p` (posted on host `h`): the CQ (fabric-wide index) of the QP
    /// queue it names, if that QP exists.
    #[inline]
    pub(crate) fn wait_target(&self, h: u32, p: &Peek) -> Option<u32> {
        let sel = match p.op1 {
            0 => QueueSel::Send,
            1 => QueueSel::Recv,
            _ => return None,
        };
        Some(self.qps[self.resolve(h, p.qpn)? as usize].cq_index(sel))
    }

    /// The WAIT at the head of QP `g`, if its head is one: the CQ it names (`None`: none —
    /// it fails when executed) and the count it waits for.
    #[inline]
    fn head_wait(&self, g: u32, p: &Peek) -> Option<(Option<u32>, u64)> {
        if self.qps[g as usize].mlx5 {
            return self.mlx5_head(g).form.wait;
        }
        (p.opcode == Opcode::Wait as u8).then(|| (self.wait_target(self.qps[g as usize].host, p), p.op0))
    }

    /// Whether a peer QP can take a receive-consuming request right now.
    #[inline]
    pub(crate) fn peer_recv_ready(&self, g: u32) -> Option<bool> {
        let p = self.peer_gq(g)?;
        let pq = &self.qps[p as usize];
        if pq.state != QpState::Rts && pq.state != QpState::Rtr {
            return None;
        }
        Some(self.recv_available(p))
    }

    /// Whether QP `p` has a receive WQE the NIC may consume: an unmanaged queue's posted
    /// ones; a managed (`cd_slave_receive`) queue's up to its RECV_EN limit — or, where the
    /// doorbell alone makes receives available (`RecvEnable::Doorbell`), its posted ones.
    #[inline]
    pub(crate) fn recv_available(&self, p: u32) -> bool {
        let rq = &self.qps[p as usize].rq;
        if rq.managed && self.cfg.behaviour.recv_enable == RecvEnable::Doorbell {
            rq.consumer < rq.producer
        } else {
            rq.available()
        }
    }

    pub(crate) fn readiness(&self, g: u32) -> Readiness {
        let q = &self.qps[g as usize];
        let host = &self.hosts[q.host as usize];
        match q.state {
            QpState::Rts => {}
            QpState::Err => {
                return if q.sq.consumer < q.sq.flush_end() {
                    Readiness::Ready(host.nic.send_free(host.nic.unit_of(q.qpn & 0xFFFF)))
                } else {
                    Readiness::Idle
                };
            }
            _ => return Readiness::Idle,
        }
        if !q.sq.available() {
            return Readiness::Idle;
        }
        let mut t = host.nic.send_free(host.nic.unit_of(q.qpn & 0xFFFF)).max(q.order_until);
        let p = Peek::of(&self.head_slice(g));
        if p.flags & WqeFlags::FENCE.bits() != 0 {
            t = t.max(q.rd_done);
        }
        if let Some((cq, count)) = self.head_wait(g, &p) {
            if !self.cfg.offload || count == 0 {
                return Readiness::Ready(t);
            }
            let Some(c) = cq else {
                return Readiness::Ready(t); // fails when executed
            };
            let cq = &self.cqs[c as usize];
            if cq.count >= count {
                return Readiness::Ready(t.max(cq.time_of(count)));
            }
            return Readiness::Blocked(c);
        }
        if let Some(since) = q.rnr_since {
            if needs_recv(p.opcode) && self.peer_recv_ready(g) == Some(false) {
                return Readiness::Timer(t.max(since.saturating_add(self.cfg.cost.rnr_timeout_ns)));
            }
        }
        Readiness::Ready(t)
    }

    /// The runnable QP with the earliest ready time (ties round-robin), and the earliest
    /// timer (RNR wait). Drops idle QPs from the active list and parks blocked ones.
    pub(crate) fn pick(&mut self) -> (Option<Pick>, Option<Pick>) {
        let n = self.qps.len() as u32;
        let mut best: Option<(u64, u32, u32)> = None;
        let mut timer: Option<(u64, u32, u32)> = None;
        let mut i = 0;
        while i < self.active.len() {
            let g = self.active[i];
            match self.readiness(g) {
                Readiness::Ready(t) => {
                    let t = t.max(self.now);
                    let rank = (g + n - self.rr) % n;
                    if best.is_none_or_lt(t, rank) {
                        best = Some((t, rank, g));
                    }
                    i += 1;
                }
                Readiness::Timer(t) => {
                    let t = t.max(self.now);
                    let rank = (g + n - self.rr) % n;
                    if timer.is_none_or_lt(t, rank) {
                        timer = Some((t, rank, g));
                    }
                    i += 1;
                }
                Readiness::Idle => {
                    self.qps[g as usize].in_active = false;
                    self.active.swap_remove(i);
                }
                Readiness::Blocked(c) => {
                    let q = &mut self.qps[g as usize];
                    q.in_active = false;
                    let already = q.parked_on == Some(c);
                    q.parked_on = Some(c);
                    self.active.swap_remove(i);
                    if !already {
                        self.cqs[c as usize].waiters.push(g);
                    }
                }
            }
        }
        (best.map(|(t, _, g)| (g, t)), timer.map(|(t, _, g)| (g, t)))
    }

    /// The next work to run: the earliest runnable WQE, or a timer that expires before it.
    /// With `horizon`, timers up to that time count as work even when nothing else runs.
    fn next(&mut self, horizon: Option<u64>) -> Option<(u32, u64)> {
        let (work, timer) = self.pick();
        match (work, timer) {
            (Some(w), Some(tm)) if tm.1 < w.1 => Some(tm),
            (Some(w), _) => Some(w),
            (None, Some(tm)) if horizon.is_some_and(|h| tm.1 <= h) => Some(tm),
            _ => None,
        }
    }

    /// Execute one unit of work (a WQE, a flush, or an RNR wait) at the earliest ready time.
    /// `None` when nothing is runnable. RNR waits are timers: they expire only when other work
    /// or the caller ([`Fabric::advance_to`], [`Fabric::settle`]) moves the clock past them,
    /// so a SEND waiting for a receive the test will post later is not failed by a poll.
    pub fn step(&mut self) -> Option<StepInfo> {
        let (g, t) = self.next(None)?;
        Some(self.run_picked(g, t))
    }

    #[inline]
    fn run_picked(&mut self, g: u32, t: u64) -> StepInfo {
        self.now = self.now.max(t);
        self.rr = (g + 1) % self.qps.len() as u32;
        let at = self.now;
        let kind = self.execute(g);
        self.counters.steps += 1;
        StepInfo { at, qp: self.addr_of(g), kind }
    }

    /// Step until nothing is runnable or `max_steps` ran; returns the steps run. The clock
    /// jumps to work whose only trigger is time (a WAIT on a CQE generated for a later time);
    /// pending RNR timers do not keep the fabric busy (see [`Fabric::step`]).
    pub fn run_until_idle(&mut self, max_steps: u64) -> u64 {
        let mut n = 0;
        while n < max_steps {
            let Some((g, t)) = self.next(None) else { break };
            self.run_picked(g, t);
            n += 1;
        }
        n
    }

    /// Step while the next work or timer is due at or before `t` (at most `max_steps`).
    pub fn run_until(&mut self, t: u64, max_steps: u64) -> u64 {
        let mut n = 0;
        while n < max_steps {
            let Some((g, rt)) = self.next(Some(t)) else { break };
            if rt > t {
                break;
            }
            self.run_picked(g, rt);
            n += 1;
        }
        n
    }

    /// Run until idle, expiring RNR timers too, then move the clock past every generated
    /// completion, so everything reported has landed. Returns the steps run.
    pub fn settle(&mut self, max_steps: u64) -> u64 {
        let n = self.run_until(u64::MAX, max_steps);
        let last = self.cqs.iter().map(|c| c.last_time).max().unwrap_or(0);
        self.now = self.now.max(last);
        n
    }

    /// Prefetch mode: copy upcoming entries' bytes into the QP's cache, up to the prefetch
    /// depth, the producer index / enable limit, and — under `WaitPrefetch::Stops` — stopping
    /// just after a WAIT that is not satisfied now. Under `WaitPrefetch::FetchesPast` the NIC
    /// reads on behind the WAIT: a WQE patched after that executes its stale bytes.
    pub(crate) fn refill(&mut self, g: u32) {
        if !self.cfg.prefetch {
            return;
        }
        let q = &self.qps[g as usize];
        if q.state != QpState::Rts || !q.alive {
            return;
        }
        if q.mlx5 {
            return self.mlx5_refill(g);
        }
        let end = q.sq.end().min(q.sq.consumer + q.sq.depth as u64);
        let mut next = q.sq.consumer + q.pf.len as u64;
        let cap = q.pf.cap();
        let h = q.host;
        let mut len = q.pf.len;
        let stops = self.cfg.behaviour.wait_prefetch == WaitPrefetch::Stops;
        while len < cap && next < end {
            let q = &self.qps[g as usize];
            if let Some(last) = q.pf.back() {
                if stops && self.unsatisfied_wait(h, &Peek::of(last)) {
                    break;
                }
            }
            let addr = q.sq.slot_addr(next);
            let mut bytes = [0u8; WQE_SIZE];
            if let Some(s) = self.hosts[h as usize].mem.slice(addr, WQE_SIZE as u64) {
                bytes.copy_from_slice(s);
            }
            let pf = &mut self.qps[g as usize].pf;
            *pf.push_slot() = bytes;
            pf.wqes += 1;
            next += 1;
            len += 1;
        }
    }

    fn unsatisfied_wait(&self, h: u32, p: &Peek) -> bool {
        if p.opcode != Opcode::Wait as u8 || !self.cfg.offload {
            return false;
        }
        match self.wait_target(h, p) {
            Some(c) => !self.cqs[c as usize].reached(p.op0, self.now),
            None => false,
        }
    }
}

trait BestExt {
    fn is_none_or_lt(&self, t: u64, rank: u32) -> bool;
}

impl BestExt for Option<(u64, u32, u32)> {
    #[inline]
    fn is_none_or_lt(&self, t: u64, rank: u32) -> bool {
        match self {
            None => true,
            Some((bt, br, _)) => (t, rank) < (*bt, *br),
        }
    }
}
