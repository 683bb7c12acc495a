//! What each WQE does: fetch and decode the head entry's bytes, the local checks, the
//! request message (through the fault middlewares), the responder's §3 checks, the memory
//! effects, completions and error states.
//!
//! Timing (`CostModel`, docs/COST-MODEL.md §1). A WQE starts when the processing unit its QP
//! is pinned to is free and its QP's order allows (previous bind's fence, FENCE flag, a gate's
//! WQE fetch):
//! * local operations (NOP, WAIT, ENABLE) occupy the unit `wqe_ns`; BIND_MW, UNBIND and
//!   LOCAL_INV occupy it `bind_unit_ns` and complete — and release their QP's next WQE — after
//!   `bind_ns`;
//! * the WQE after a WAIT, or the first one an ENABLE releases on a queue that ran dry, is
//!   fetched over PCIe (`pcie_read_ns`) unless the prefetch cache already holds it;
//! * a remote operation is issued in `wqe_ns` (+ a PCIe read of its payload), serialised on the
//!   host's link and sent over the wire (`wire_ns`) — or, between QPs of one host, looped inside
//!   the NIC — handled by the responder QP's unit (`responder_ns`), which DMA-reads READ data
//!   (`pcie_read_ns`), serialises same-address atomics (`atomic_same_addr_ns`) and places
//!   written data with a posted write (`pcie_write_ns`); the response or ACK travels back the
//!   same way and the requester places returned data with a posted write. The requester's CQE
//!   carries that time; a receive CQE carries the time the data was placed.
//!
//! Memory effects are applied when the requester executes the WQE (the model is sequential);
//! only completion timestamps carry the latency, and WAITs only see CQEs whose time has come,
//! so anything gated on a completion observes its effects.

use crate::counters::{digest, StepKind, TraceEvent};
use crate::fabric::{Fabric, HostId};
use crate::fault::{Message, Verdict};
use crate::mlx5_fetch::Recv;
use crate::protection::{BindTarget, MwOpFail};
use crate::sched::needs_recv;
use omw_core::access::AccessFlags;
use omw_core::device::behaviour::{ForeignBind, RecvEnable, SelfEnable, UncheckedUnbind};
use omw_core::device::mw_rules::{Invalidator, Mode, Nak, QpRef, RemoteFail};
use omw_core::device::{Completion, QpState, WcOpcode, WcStatus};
use omw_core::ids::{Qpn, Rkey};
use omw_core::wire::wqe::{masked_add, Opcode, QueueSel, RecvWqe, Wqe, WqeError, WqeFlags, RECV_WQE_SIZE};

/// The requester's status for a refused remote access: the NAK class the rule names.
#[inline]
fn nak_status(e: RemoteFail) -> WcStatus {
    match e.nak() {
        Nak::RemoteAccess => WcStatus::RemAccessErr,
        Nak::InvalidRequest => WcStatus::RemInvReqErr,
    }
}

/// Why a request did not reach a responder.
enum Delivery {
    /// Delivered, arriving `delay` ns later than the cost model says.
    Arrived {
        delay: u64,
    },
    Dropped,
}

impl Fabric {
    #[inline]
    fn strict(&self) -> bool {
        self.cfg.conformance == crate::config::Conformance::Strict
    }

    /// The rule variant of [`omw_core::device::mw_rules`] this NIC follows.
    #[inline]
    fn mode(&self) -> Mode {
        if self.strict() {
            Mode::Strict
        } else {
            Mode::Rxe
        }
    }

    /// Execute the head of QP `g` at `self.now`.
    pub(crate) fn execute(&mut self, g: u32) -> StepKind {
        if self.qps[g as usize].state == QpState::Err {
            return self.flush_one(g);
        }
        let mut raw = self.head_slice(g);
        if self.qps[g as usize].mlx5 {
            let f = self.mlx5_head(g);
            let q = &mut self.qps[g as usize];
            q.head_wqebbs = f.wqebbs;
            q.scatter = f.scatter;
            q.head_mlx5 = f.form;
        }
        let now = self.now;
        let cost = self.cfg.cost;
        let wqe = match Wqe::decode(&raw) {
            Ok(w) => w,
            Err(WqeError::BadAccessFlags(bits)) if !self.strict() => {
                // rxe reads the rights only in rxe_bind_mw, which refuses unsupported bits
                // with MW_BIND_ERR (rxe_mw.c): decode the rest and let the bind rule judge
                raw[56..64].fill(0);
                if let Ok(w) = Wqe::decode(&raw) {
                    self.consume(g);
                    self.exec_bind(g, &w, u32::try_from(bits).unwrap_or(u32::MAX));
                    self.refill(g);
                    return StepKind::Executed(w.opcode);
                }
                return self.malformed(g, &raw);
            }
            Err(_) => return self.malformed(g, &raw),
        };
        if needs_recv(raw[0]) && self.peer_recv_ready(g) == Some(false) {
            // RNR: the responder has no receive WQE. Wait (the QP stays at its head) until one
            // is posted or enabled, or the RNR budget runs out.
            let q = &mut self.qps[g as usize];
            let since = match q.rnr_since {
                Some(s) => s,
                None => {
                    q.rnr_since = Some(now);
                    self.counters.rnr_naks += 1;
                    now
                }
            };
            if now < since.saturating_add(cost.rnr_timeout_ns) {
                let h = q.host as usize;
                let u = self.unit(g);
                self.hosts[h].nic.occupy_send(u, now, cost.wqe_ns);
                return StepKind::RnrWait;
            }
            self.consume(g);
            self.complete(g, &wqe, WcStatus::RnrRetryExcErr, now, 0);
            self.refill(g);
            return StepKind::Executed(wqe.opcode);
        }
        self.consume(g);
        match wqe.opcode {
            Opcode::Nop => {
                self.local_done(g, now, cost.wqe_ns);
                self.complete(g, &wqe, WcStatus::Success, now + cost.wqe_ns, 0);
            }
            Opcode::Write | Opcode::WriteWithImm | Opcode::Send | Opcode::SendWithImm | Opcode::SendWithInv => {
                self.exec_outbound(g, &wqe)
            }
            Opcode::Read => self.exec_read(g, &wqe),
            Opcode::FetchAdd | Opcode::MaskedFetchAdd | Opcode::CompareSwap => self.exec_atomic(g, &wqe),
            Opcode::BindMw => self.exec_bind(g, &wqe, wqe.access().bits()),
            Opcode::LocalInv => self.exec_local_inv(g, &wqe),
            Opcode::Wait => self.exec_wait(g, &wqe),
            Opcode::Enable => self.exec_enable(g, &wqe),
        }
        self.refill(g);
        StepKind::Executed(wqe.opcode)
    }

    /// The head entry's bytes do not decode: it completes with `LocQpOpErr`, the QP errs.
    fn malformed(&mut self, g: u32, raw: &[u8; 64]) -> StepKind {
        let (now, cost) = (self.now, self.cfg.cost);
        self.consume(g);
        self.local_done(g, now, cost.wqe_ns);
        let op = Opcode::from_u8(raw[0]).unwrap_or(Opcode::Nop);
        let wr_id = u64::from_le_bytes(raw[8..16].try_into().unwrap_or_default());
        self.push_cqe(
            g,
            QueueSel::Send,
            now + cost.wqe_ns,
            self.send_completion(g, wr_id, op, WcStatus::LocQpOpErr, 0),
        );
        self.set_err(g);
        StepKind::Malformed
    }

    /// Advance past the head entry (it has been fetched for execution).
    #[inline]
    fn consume(&mut self, g: u32) {
        let q = &mut self.qps[g as usize];
        let n = std::mem::replace(&mut q.head_wqebbs, 1);
        q.sq.consumer += n;
        q.sq.wqes += 1;
        q.pf.pop_wqe(n);
        q.rnr_since = None;
        q.executed += 1;
        let h = q.host as usize;
        self.hosts[h].wqes_executed += 1;
        self.counters.wqes_executed += 1;
    }

    #[inline]
    fn local_done(&mut self, g: u32, start: u64, ns: u64) {
        let u = self.unit(g);
        let h = self.qps[g as usize].host as usize;
        self.hosts[h].nic.occupy_send(u, start, ns);
    }

    #[inline]
    fn send_completion(&self, g: u32, wr_id: u64, op: Opcode, status: WcStatus, byte_len: u32) -> Completion {
        Completion {
            wr_id,
            status,
            opcode: WcOpcode::Send(op),
            qpn: Qpn::new(self.qps[g as usize].qpn).unwrap_or_default(),
            byte_len,
            imm: None,
            invalidated: None,
        }
    }

    /// Complete a send WQE: a CQE if signalled or failed; a failure moves the QP to Err.
    #[inline]
    fn complete(&mut self, g: u32, w: &Wqe, status: WcStatus, at: u64, byte_len: u32) {
        if status != WcStatus::Success || w.flags.contains(WqeFlags::SIGNALED) {
            let c = self.send_completion(g, w.wr_id, w.opcode, status, byte_len);
            self.push_cqe(g, QueueSel::Send, at, c);
        }
        if status != WcStatus::Success {
            self.set_err(g);
        }
    }

    pub(crate) fn push_cqe(&mut self, g: u32, sel: QueueSel, at: u64, c: Completion) {
        let q = &mut self.qps[g as usize];
        let (host, ci) = (q.host, q.cq_index(sel) as usize);
        // an overrun CQ generates no CQE (and counts none)
        let Some(at) = self.cqs[ci].push(at, c) else {
            self.counters.cqes_overrun += 1;
            return;
        };
        let wake = !self.cqs[ci].waiters.is_empty();
        self.qps[g as usize].cqes_total += 1;
        self.counters.count_completion(c.status);
        self.digest = digest(self.digest, at, host, &c);
        if self.cfg.trace {
            self.trace.push(TraceEvent { at, host: HostId(host), completion: c });
        }
        if wake {
            let mut w = std::mem::take(&mut self.cqs[ci].waiters);
            for x in w.drain(..) {
                self.activate(x);
            }
            // keep the allocation
            let slot = &mut self.cqs[ci].waiters;
            if slot.is_empty() {
                *slot = w;
            }
        }
    }

    /// Move a QP to the error state: posted receives flush now, send entries flush one per
    /// step, the prefetch cache is dropped.
    pub(crate) fn set_err(&mut self, g: u32) {
        let q = &mut self.qps[g as usize];
        if !q.alive || q.state == QpState::Err {
            return;
        }
        q.state = QpState::Err;
        q.rnr_since = None;
        q.pf.clear();
        self.flush_recvs(g);
        self.activate(g);
    }

    /// Flush every receive entry of an errored QP.
    pub(crate) fn flush_recvs(&mut self, g: u32) {
        loop {
            let q = &self.qps[g as usize];
            if q.rq.consumer >= q.rq.flush_end() {
                break;
            }
            let addr = q.rq.slot_addr(q.rq.consumer);
            let wr_id = if q.mlx5 {
                self.mlx5_recv_wr_id(g)
            } else {
                self.hosts[q.host as usize]
                    .mem
                    .slice(addr + 8, 8)
                    .map_or(0, |s| u64::from_le_bytes(s.try_into().unwrap_or_default()))
            };
            let q = &self.qps[g as usize];
            let c = Completion {
                wr_id,
                status: WcStatus::WrFlushErr,
                opcode: WcOpcode::Recv,
                qpn: Qpn::new(q.qpn).unwrap_or_default(),
                byte_len: 0,
                imm: None,
                invalidated: None,
            };
            self.qps[g as usize].rq.consumer += 1;
            self.counters.recvs_flushed += 1;
            let now = self.now;
            self.push_cqe(g, QueueSel::Recv, now, c);
        }
    }

    fn flush_one(&mut self, g: u32) -> StepKind {
        let q = &self.qps[g as usize];
        let addr = q.sq.slot_addr(q.sq.consumer);
        let h = q.host as usize;
        let (op, wr_id, width) = if q.mlx5 {
            let f = self.mlx5_head(g);
            (f.wqe.map_or(Opcode::Nop, |w| w.opcode), self.mlx5_send_wr_id(g), f.wqebbs)
        } else {
            let (op, wr_id) = self.hosts[h].mem.slice(addr, 16).map_or((Opcode::Nop, 0), |s| {
                (
                    Opcode::from_u8(s[0]).unwrap_or(Opcode::Nop),
                    u64::from_le_bytes(s[8..16].try_into().unwrap_or_default()),
                )
            });
            (op, wr_id, 1)
        };
        let q = &mut self.qps[g as usize];
        q.sq.consumer += width;
        q.sq.wqes += 1;
        q.flushed += 1;
        self.counters.wqes_flushed += 1;
        let now = self.now;
        let u = self.unit(g);
        self.hosts[h].nic.occupy_send(u, now, self.cfg.cost.flush_ns);
        let c = self.send_completion(g, wr_id, op, WcStatus::WrFlushErr, 0);
        self.push_cqe(g, QueueSel::Send, now, c);
        StepKind::Flushed
    }

    // ---- requests ---------------------------------------------------------------------------

    /// The responder QP of `g`, or a transport failure (`RetryExcErr` after the retry
    /// timeout; only the requester goes to Err: there is no live responder to tell).
    fn responder(&mut self, g: u32, w: &Wqe, start: u64) -> Option<u32> {
        if let Some(p) = self.peer_gq(g) {
            let st = self.qps[p as usize].state;
            if st == QpState::Rts || st == QpState::Rtr {
                return Some(p);
            }
        }
        let t = start.saturating_add(self.cfg.cost.retry_timeout_ns);
        self.complete(g, w, WcStatus::RetryExcErr, t, 0);
        None
    }

    /// Pass a request through the fault plan and middlewares. `plen` payload bytes are in
    /// the scratch buffer and may be rewritten.
    fn deliver(&mut self, g: u32, p: u32, w: &Wqe, plen: usize, start: u64) -> Delivery {
        self.counters.messages += 1;
        if self.faults.is_empty() && self.middlewares.is_empty() {
            return Delivery::Arrived { delay: 0 };
        }
        let msg = Message { at: start, src: self.addr_of(g), dst: self.addr_of(p), opcode: w.opcode, len: w.length };
        let mut delay = 0u64;
        let mut dropped = false;
        let payload = &mut self.scratch[..plen];
        let verdicts = std::iter::once(&mut self.faults as &mut dyn crate::fault::Middleware)
            .chain(self.middlewares.iter_mut().map(|m| m.as_mut()));
        for m in verdicts {
            if dropped {
                break;
            }
            match m.on_message(&msg, payload) {
                Verdict::Deliver => {}
                Verdict::Drop => dropped = true,
                Verdict::Delay(d) => delay = delay.saturating_add(d),
            }
        }
        if dropped {
            self.counters.messages_dropped += 1;
            Delivery::Dropped
        } else {
            if delay > 0 {
                self.counters.messages_delayed += 1;
            }
            Delivery::Arrived { delay }
        }
    }

    /// A dropped request: the requester retries until its timeout (`RetryExcErr`); the pair
    /// goes to Err.
    fn dropped(&mut self, g: u32, p: u32, w: &Wqe, start: u64) {
        let t = start.saturating_add(self.cfg.cost.retry_timeout_ns);
        self.complete(g, w, WcStatus::RetryExcErr, t, 0);
        self.set_err(p);
    }

    /// A message from QP `from` to QP `to`, ready to leave at `ready` with `payload` bytes:
    /// its arrival. Between hosts it is serialised on the sender's link (shared by all its
    /// QPs) and crosses the wire; between two QPs of one host it never leaves the NIC (the
    /// loopback costs are the PCIe DMAs its endpoints do, charged by the callers).
    #[inline]
    fn transmit(&mut self, from: u32, to: u32, ready: u64, payload: u64) -> u64 {
        let c = self.cfg.cost;
        let (h, th) = (self.qps[from as usize].host, self.qps[to as usize].host);
        let pcie = c.pcie_ns(payload);
        if h == th {
            // the source is DMA-read and the destination DMA-written, pipelined
            let n = &mut self.hosts[h as usize].nic;
            return n.occupy_pcie(true, ready, pcie).max(n.occupy_pcie(false, ready, pcie));
        }
        // the payload's DMA read is pipelined with its link serialisation: the slower sets
        // the pace; its placement at the receiver likewise with its arrival
        let n = &mut self.hosts[h as usize].nic;
        let read = n.occupy_pcie(true, ready, pcie);
        let left = n.occupy_link(ready, c.bytes_ns(payload)).max(read);
        let arrive = left.saturating_add(c.wire_ns);
        let placed = self.hosts[th as usize].nic.occupy_pcie(false, arrive.saturating_sub(pcie), pcie);
        arrive.max(placed)
    }

    /// The responder host `h` looks up the context of the key `rkey` names: a miss in the
    /// NIC's key cache costs a PCIe read first (`CostModel::key_cache_entries`).
    #[inline]
    fn key_lookup(&mut self, h: u32, rkey: u32) -> u64 {
        if self.hosts[h as usize].nic.touch_key(rkey >> 8) {
            0
        } else {
            self.cfg.cost.pcie_read_ns
        }
    }

    /// A request arriving at `arrive` at responder QP `p`: handled by the unit `p` is pinned
    /// to; returns when the responder finished with it.
    #[inline]
    fn respond(&mut self, p: u32, arrive: u64) -> u64 {
        let c = self.cfg.cost;
        let u = self.unit(p);
        let ph = self.qps[p as usize].host as usize;
        self.hosts[ph].nic.occupy_rx(u, arrive, c.responder_ns).saturating_add(c.responder_ns)
    }

    /// Copy `len` bytes of host `h` memory at `addr` into the scratch buffer.
    #[inline]
    fn gather(&mut self, h: u32, addr: u64, len: usize) -> bool {
        if self.scratch.len() < len {
            self.scratch.resize(len, 0);
        }
        match self.hosts[h as usize].mem.slice(addr, len as u64) {
            Some(s) => {
                self.scratch[..len].copy_from_slice(s);
                true
            }
            None => len == 0,
        }
    }

    #[inline]
    fn scatter(&mut self, h: u32, addr: u64, from: usize, len: usize) -> bool {
        match self.hosts[h as usize].mem.slice_mut(addr, len as u64) {
            Some(s) => {
                s.copy_from_slice(&self.scratch[from..from + len]);
                self.record_landed(h, addr, len as u64);
                true
            }
            None => len == 0,
        }
    }

    /// WRITE, WRITE_WITH_IMM, SEND, SEND_WITH_IMM, SEND_WITH_INV: data flows to the peer.
    /// What every remote operation does first: issue the WQE on the requester's NIC, check its
    /// local SGE (`local_write` for READ and atomic results), find the responder. `None` when
    /// the WQE already completed (local protection error, no usable peer).
    fn begin_remote(&mut self, g: u32, w: &Wqe, len: u64, local_write: bool) -> Option<(u64, u32, u32)> {
        let start = self.now;
        let wqe_ns = self.cfg.cost.wqe_ns;
        let (h, pd) = (self.qps[g as usize].host, self.qps[g as usize].pd);
        self.local_done(g, start, wqe_ns);
        if len > 0 && self.hosts[h as usize].prot.check_local(pd, w.lkey, w.local_addr, len, local_write).is_err() {
            self.complete(g, w, WcStatus::LocProtErr, start + wqe_ns, 0);
            return None;
        }
        let p = self.responder(g, w, start)?;
        Some((start, h, p))
    }

    fn exec_outbound(&mut self, g: u32, w: &Wqe) {
        let cost = self.cfg.cost;
        let len = w.length as usize;
        let Some((start, h, p)) = self.begin_remote(g, w, len as u64, false) else { return };
        if !self.gather(h, w.local_addr, len) {
            self.complete(g, w, WcStatus::LocProtErr, start + cost.wqe_ns, 0);
            return;
        }
        let delay = match self.deliver(g, p, w, len, start) {
            Delivery::Arrived { delay } => delay,
            Delivery::Dropped => return self.dropped(g, p, w, start),
        };
        // the payload is DMA-read from host memory, sent, placed by a posted write; the ACK
        // leaves when the responder is done with the request
        let issued = start + cost.wqe_ns + if len > 0 { cost.pcie_read_ns } else { 0 };
        let arrive = self.transmit(g, p, issued, len as u64).saturating_add(delay);
        let mut handled = self.respond(p, arrive);
        if matches!(w.opcode, Opcode::Write | Opcode::WriteWithImm) {
            handled += self.key_lookup(self.qps[p as usize].host, w.rkey);
        }
        let resp_done = handled + if len > 0 { cost.pcie_write_ns } else { 0 };
        let ack = self.transmit(p, g, handled, 0);
        let (ph, ppd) = (self.qps[p as usize].host, self.qps[p as usize].pd);
        let mode = self.mode();
        match w.opcode {
            Opcode::Write | Opcode::WriteWithImm => {
                let mut eff = w.remote_addr;
                if len > 0 {
                    let qp = QpRef { qp: p, pd: ppd };
                    match self.hosts[ph as usize].prot.check_remote(
                        mode,
                        qp,
                        w.rkey,
                        w.remote_addr,
                        len as u64,
                        AccessFlags::REMOTE_WRITE,
                        false,
                    ) {
                        Ok(a) => eff = a,
                        Err(e) => return self.remote_fail(g, p, w, nak_status(e), ack),
                    }
                }
                let mut recv_wr = 0;
                if w.opcode == Opcode::WriteWithImm {
                    match self.take_recv(p) {
                        Ok(r) => recv_wr = r.wr_id,
                        Err(wr_id) => {
                            self.recv_error(p, wr_id, WcStatus::LocQpOpErr, resp_done);
                            return self.remote_fail(g, p, w, WcStatus::RemOpErr, ack);
                        }
                    }
                }
                self.scatter(ph, eff, 0, len);
                if w.opcode == Opcode::WriteWithImm {
                    let c = Completion {
                        wr_id: recv_wr,
                        status: WcStatus::Success,
                        opcode: WcOpcode::RecvRdmaWithImm,
                        qpn: Qpn::new(self.qps[p as usize].qpn).unwrap_or_default(),
                        byte_len: w.length,
                        imm: Some(w.imm),
                        invalidated: None,
                    };
                    self.push_cqe(p, QueueSel::Recv, resp_done, c);
                }
                self.complete(g, w, WcStatus::Success, ack, w.length);
            }
            _ => {
                // SEND family: consume the next receive WQE, scatter across its SGEs.
                let recv = match self.take_recv(p) {
                    Ok(r) => r,
                    Err(wr_id) => {
                        self.recv_error(p, wr_id, WcStatus::LocQpOpErr, resp_done);
                        return self.remote_fail(g, p, w, WcStatus::RemOpErr, ack);
                    }
                };
                if len as u64 > recv.total_len() {
                    self.recv_error(p, recv.wr_id, WcStatus::LocLenErr, resp_done);
                    return self.remote_fail(g, p, w, WcStatus::RemInvReqErr, ack);
                }
                let mut left = len as u64;
                for s in recv.sges.iter() {
                    let take = left.min(s.length as u64);
                    if take > 0 && self.hosts[ph as usize].prot.check_local(ppd, s.lkey, s.addr, take, true).is_err() {
                        self.recv_error(p, recv.wr_id, WcStatus::LocProtErr, resp_done);
                        return self.remote_fail(g, p, w, WcStatus::RemOpErr, ack);
                    }
                    left -= take;
                }
                let mut invalidated = None;
                if w.opcode == Opcode::SendWithInv {
                    let by = Invalidator::SendWithInv { qp: p };
                    if self.hosts[ph as usize].prot.invalidate(mode, w.imm, by).is_err() {
                        // IBTA 9.9.6.3 class J (rxe_resp.c RESPST_ERR_INVALIDATE_RKEY): the
                        // receive WQE completes in error and the responder QP goes to Err;
                        // no NAK is sent.
                        self.recv_error(p, recv.wr_id, WcStatus::RemInvReqErr, resp_done);
                        self.set_err(p);
                        if mode == Mode::Strict {
                            // the spec: without a NAK the requester gets no completion for
                            // this SEND and its QP stays RTS (on a wire its retry timer would
                            // later expire against the errored responder; the model's
                            // requester stays silent, see README "Conformance")
                            self.counters.silent_class_j += 1;
                            return;
                        }
                        // rxe (found by the verbs differential test): the requester's SEND
                        // completes successfully and its QP stays RTS
                        return self.complete(g, w, WcStatus::Success, ack, w.length);
                    }
                    invalidated = Some(Rkey(w.imm));
                }
                let mut off = 0usize;
                for s in recv.sges.iter() {
                    let take = (len - off).min(s.length as usize);
                    if take > 0 {
                        self.scatter(ph, s.addr, off, take);
                        off += take;
                    }
                }
                let c = Completion {
                    wr_id: recv.wr_id,
                    status: WcStatus::Success,
                    opcode: WcOpcode::Recv,
                    qpn: Qpn::new(self.qps[p as usize].qpn).unwrap_or_default(),
                    byte_len: w.length,
                    imm: (w.opcode == Opcode::SendWithImm).then_some(w.imm),
                    invalidated,
                };
                self.push_cqe(p, QueueSel::Recv, resp_done, c);
                self.complete(g, w, WcStatus::Success, ack, w.length);
            }
        }
    }

    /// Consume the responder's next receive WQE. `Err(wr_id)` if its bytes do not decode
    /// (the entry is consumed all the same).
    fn take_recv(&mut self, p: u32) -> Result<Recv, u64> {
        if self.qps[p as usize].mlx5 {
            return self.mlx5_take_recv(p);
        }
        let q = &mut self.qps[p as usize];
        let addr = q.rq.slot_addr(q.rq.consumer);
        q.rq.consumer += 1;
        let mem = &self.hosts[q.host as usize].mem;
        let Some(b) = mem.slice(addr, RECV_WQE_SIZE as u64) else {
            return Err(0);
        };
        RecvWqe::decode(b)
            .map(|r| Recv { wr_id: r.wr_id, sges: r.sges.to_vec() })
            .map_err(|_| u64::from_le_bytes(b[8..16].try_into().unwrap_or_default()))
    }

    /// A receive completes in error (the responder QP then goes to Err).
    fn recv_error(&mut self, p: u32, wr_id: u64, status: WcStatus, at: u64) {
        let c = Completion {
            wr_id,
            status,
            opcode: WcOpcode::Recv,
            qpn: Qpn::new(self.qps[p as usize].qpn).unwrap_or_default(),
            byte_len: 0,
            imm: None,
            invalidated: None,
        };
        self.push_cqe(p, QueueSel::Recv, at, c);
    }

    /// A responder-side failure: the requester's WQE completes with `status` and both QPs of
    /// the pair go to Err.
    fn remote_fail(&mut self, g: u32, p: u32, w: &Wqe, status: WcStatus, at: u64) {
        self.complete(g, w, status, at, 0);
        self.set_err(p);
    }

    fn exec_read(&mut self, g: u32, w: &Wqe) {
        let cost = self.cfg.cost;
        let len = w.length as usize;
        // an mlx5 scatter READ: every data segment is a local SGE the result lands in
        let sg = std::mem::take(&mut self.qps[g as usize].scatter);
        if !sg.is_empty() {
            let (h, pd) = (self.qps[g as usize].host, self.qps[g as usize].pd);
            if sg
                .iter()
                .any(|s| self.hosts[h as usize].prot.check_local(pd, s.lkey, s.addr, s.length as u64, true).is_err())
            {
                let start = self.now;
                self.local_done(g, start, cost.wqe_ns);
                return self.complete(g, w, WcStatus::LocProtErr, start + cost.wqe_ns, 0);
            }
        }
        let checked = if sg.is_empty() { len as u64 } else { 0 };
        let Some((start, h, p)) = self.begin_remote(g, w, checked, true) else { return };
        let delay = match self.deliver(g, p, w, 0, start) {
            Delivery::Arrived { delay } => delay,
            Delivery::Dropped => return self.dropped(g, p, w, start),
        };
        // the responder DMA-reads the data, sends it back, the requester places it
        let arrive = self.transmit(g, p, start + cost.wqe_ns, 0).saturating_add(delay);
        let handled = self.respond(p, arrive) + self.key_lookup(self.qps[p as usize].host, w.rkey);
        let read = handled + if len > 0 { cost.pcie_read_ns } else { 0 };
        let ack = self.transmit(p, g, read, len as u64) + if len > 0 { cost.pcie_write_ns } else { 0 };
        let q = &mut self.qps[g as usize];
        q.rd_done = q.rd_done.max(ack);
        if len > 0 {
            let (ph, ppd) = (self.qps[p as usize].host, self.qps[p as usize].pd);
            let mode = self.mode();
            let eff = match self.hosts[ph as usize].prot.check_remote(
                mode,
                QpRef { qp: p, pd: ppd },
                w.rkey,
                w.remote_addr,
                len as u64,
                AccessFlags::REMOTE_READ,
                false,
            ) {
                Ok(a) => a,
                Err(e) => return self.remote_fail(g, p, w, nak_status(e), ack),
            };
            self.gather(ph, eff, len);
            if sg.is_empty() {
                self.scatter(h, w.local_addr, 0, len);
            } else {
                let mut at = 0usize;
                for s in sg.iter() {
                    self.scatter(h, s.addr, at, s.length as usize);
                    at += s.length as usize;
                }
            }
        }
        self.complete(g, w, WcStatus::Success, ack, w.length);
    }

    fn exec_atomic(&mut self, g: u32, w: &Wqe) {
        let cost = self.cfg.cost;
        let Some((start, h, p)) = self.begin_remote(g, w, 8, true) else { return };
        let delay = match self.deliver(g, p, w, 0, start) {
            Delivery::Arrived { delay } => delay,
            Delivery::Dropped => return self.dropped(g, p, w, start),
        };
        let arrive = self.transmit(g, p, start + cost.wqe_ns, 0).saturating_add(delay);
        let handled = self.respond(p, arrive) + self.key_lookup(self.qps[p as usize].host, w.rkey);
        let nak = self.transmit(p, g, handled, 0);
        let q = &mut self.qps[g as usize];
        q.rd_done = q.rd_done.max(nak);
        let (ph, ppd) = (self.qps[p as usize].host, self.qps[p as usize].pd);
        let mode = self.mode();
        let eff = match self.hosts[ph as usize].prot.check_remote(
            mode,
            QpRef { qp: p, pd: ppd },
            w.rkey,
            w.remote_addr,
            8,
            AccessFlags::REMOTE_ATOMIC,
            true,
        ) {
            Ok(a) => a,
            Err(e) => return self.remote_fail(g, p, w, nak_status(e), nak),
        };
        // same-address atomics serialise in the responder NIC; each reads its word over PCIe
        let rmw = self.hosts[ph as usize].nic.occupy_atomic(eff, handled, cost.atomic_same_addr_ns);
        let ack = self.transmit(p, g, rmw + cost.pcie_read_ns, 8) + cost.pcie_write_ns;
        let q = &mut self.qps[g as usize];
        q.rd_done = q.rd_done.max(ack);
        let mem = &mut self.hosts[ph as usize].mem;
        let old = mem.read_u64(eff).unwrap_or(0);
        let new = match w.opcode {
            Opcode::FetchAdd => old.wrapping_add(w.operand0),
            Opcode::MaskedFetchAdd => masked_add(old, w.operand0, w.operand1),
            _ => {
                if old == w.operand0 {
                    w.operand1
                } else {
                    old
                }
            }
        };
        mem.write_u64(eff, new);
        self.hosts[h as usize].mem.write_u64(w.local_addr, old);
        self.record_landed(ph, eff, 8);
        self.record_landed(h, w.local_addr, 8);
        self.complete(g, w, WcStatus::Success, ack, 8);
    }

    // ---- local operations ------------------------------------------------------------------

    /// BIND_MW. `access`: the rights exactly as the WQE carries them (in rxe mode the decoder
    /// lets unknown bits through so the bind rule, not the decoder, refuses them).
    pub(crate) fn exec_bind(&mut self, g: u32, w: &Wqe, access: u32) {
        let start = self.now;
        let done = start + self.cfg.cost.bind_ns;
        // the unit is busy only briefly; the QP's next WQE waits for the bind (mlx5 fences
        // the WQE after a UMR): the ordering is per QP, not NIC-wide
        self.local_done(g, start, self.cfg.cost.bind_unit_ns);
        let q = &mut self.qps[g as usize];
        q.order_until = q.order_until.max(done);
        let (h, pd, poster) = (q.host, q.pd, q.qpn);
        let refused = std::mem::take(&mut q.head_mlx5.bind_refused);
        let mode = self.mode();
        // a bind naming another QP on a device that can bind to other QPs: how it answers
        // (`ForeignBind`; without offload the rules refuse it anyway)
        let foreign = w.qpn != poster && self.cfg.offload && !w.flags.contains(WqeFlags::UNBIND);
        let named = match self.cfg.behaviour.foreign_bind {
            ForeignBind::BoundToPoster if foreign => poster,
            _ => w.qpn,
        };
        let res = if refused.is_some() || (foreign && self.cfg.behaviour.foreign_bind == ForeignBind::Refused) {
            self.counters.binds_refused += 1;
            Err(MwOpFail::Refused)
        } else if w.flags.contains(WqeFlags::UNBIND) {
            // a device that checks the QPN anyway treats it as the posting QP's LOCAL_INV
            let by = if self.cfg.offload && self.cfg.unchecked_unbind == UncheckedUnbind::Refused {
                Invalidator::LocalInv { qp: g }
            } else {
                Invalidator::Unbind
            };
            self.hosts[h as usize].prot.invalidate(mode, w.imm, by).map_err(MwOpFail::Invalidate)
        } else {
            let target = self.resolve(h, named).map(|t| BindTarget { gq: t, qpn: named, pd: self.qps[t as usize].pd });
            let posting = QpRef { qp: g, pd };
            let capable = self.cfg.offload;
            self.hosts[h as usize].prot.bind(
                mode,
                posting,
                w.imm,
                w.lkey,
                w.local_addr,
                w.length as u64,
                access,
                target,
                capable,
            )
        };
        let status = match res {
            Ok(()) => WcStatus::Success,
            Err(_) => WcStatus::MwBindErr,
        };
        self.complete(g, w, status, done, 0);
    }

    fn exec_local_inv(&mut self, g: u32, w: &Wqe) {
        let start = self.now;
        let done = start + self.cfg.cost.bind_ns;
        self.local_done(g, start, self.cfg.cost.bind_unit_ns);
        let q = &mut self.qps[g as usize];
        q.order_until = q.order_until.max(done);
        let h = q.host;
        let mode = self.mode();
        let status = match self.hosts[h as usize].prot.invalidate(mode, w.imm, Invalidator::LocalInv { qp: g }) {
            Ok(()) => WcStatus::Success,
            // the spec's "memory management operation error"; rxe reports a refused local
            // invalidation as a local QP operation error (verbs differential test)
            Err(_) if self.strict() => WcStatus::MwBindErr,
            Err(_) => WcStatus::LocQpOpErr,
        };
        self.complete(g, w, status, done, 0);
    }

    fn exec_wait(&mut self, g: u32, w: &Wqe) {
        let cost = self.cfg.cost;
        let done = self.now + cost.wqe_ns;
        self.local_done(g, self.now, cost.wqe_ns);
        // the WQE behind a gate is fetched over PCIe once the gate opens, unless it was
        // already in the prefetch cache (the cache stops after an unsatisfied WAIT)
        let q = &mut self.qps[g as usize];
        if q.pf.len == 0 {
            q.order_until = q.order_until.max(done + cost.pcie_read_ns);
            self.counters.gated_fetches += 1;
        }
        let q = &mut self.qps[g as usize];
        let h = q.host;
        let named = match std::mem::take(&mut q.head_mlx5.wait) {
            Some((cq, _)) => cq.is_some(),
            None => self.resolve(h, w.qpn).is_some(),
        };
        let ok = self.cfg.offload && named && self.qps[g as usize].cd_master;
        let status = if ok { WcStatus::Success } else { WcStatus::LocQpOpErr };
        self.complete(g, w, status, done, 0);
    }

    fn exec_enable(&mut self, g: u32, w: &Wqe) {
        let cost = self.cfg.cost;
        let done = self.now + cost.wqe_ns;
        self.local_done(g, self.now, cost.wqe_ns);
        let h = self.qps[g as usize].host;
        let sel = w.queue_sel();
        let target = if self.cfg.offload && self.qps[g as usize].cd_master {
            self.resolve(h, w.qpn).filter(|t| self.qps[*t as usize].queue(sel).managed)
        } else {
            None
        };
        let Some(t) = target else {
            return self.complete(g, w, WcStatus::LocQpOpErr, done, 0);
        };
        let in_wqes = std::mem::take(&mut self.qps[g as usize].head_mlx5.enable_in_wqes);
        let b = self.cfg.behaviour;
        // a queue releasing itself under `SelfEnable::Ignored`, a RECV_EN where the doorbell
        // alone makes receives available (`RecvEnable::Doorbell`): the ENABLE completes and
        // changes nothing
        let ignored = (t == g && sel == QueueSel::Send && b.self_enable == SelfEnable::Ignored)
            || (sel == QueueSel::Recv && b.recv_enable == RecvEnable::Doorbell);
        if ignored {
            self.counters.enables_ignored += 1;
            return self.complete(g, w, WcStatus::Success, done, 0);
        }
        let tq = &mut self.qps[t as usize];
        let qu = tq.queue_mut(sel);
        let stalled = !qu.available();
        if in_wqes {
            qu.wqe_limit = qu.wqe_limit.saturating_add(w.operand0);
        } else {
            qu.limit = qu.limit.saturating_add(w.operand0);
        }
        if sel == QueueSel::Send && stalled {
            // the released entries exist for the NIC only from `done` on, and a queue that
            // ran dry at its limit has nothing prefetched: its next WQE is fetched over PCIe
            tq.order_until = tq.order_until.max(done + cost.pcie_read_ns);
            self.counters.gated_fetches += 1;
        }
        if sel == QueueSel::Send {
            self.activate(t);
            if t != g {
                self.refill(t);
            }
        } else if tq.state == QpState::Err {
            self.flush_recvs(t);
        }
        self.complete(g, w, WcStatus::Success, done, 0);
    }
}
