//! The stock engine's model, register by register as `hw/hdl/shell/cnfg_slave.sv` (Coyote
//! f1ef0b0) decodes them, and the RoCE stack's PSN rule as `rx_ibh_fsm` in
//! `ib_transport_protocol.cpp` (Coyote bca3563) applies it.
//!
//! * A `CTRL_REG` write posts a command only if START (`CTRL_ACTV`) is set in the written word
//!   or in the `CTRL_REG_2` latch; the latch keeps its value, so a later `CTRL_REG` write
//!   without START re-posts the command `CTRL_REG_2` still describes. CLR_STAT in the written
//!   word clears that pid's READ counter, CLR_STAT in the latch the WRITE counter.
//! * Addresses are taken as `[47:0]`, lengths as `[27:0]`: wider values are truncated, not
//!   flagged. A push into a full FIFO is lost (AXI-Lite has no back-pressure to the host).
//! * `RDMA_CTX_REG_2` / `RDMA_CONN_REG_2` raise `valid` on an interface whose data is wired to
//!   the registers: the stack takes whatever they hold when it accepts, and a second commit
//!   before that replaces the first. Reading word 2 returns the interface's `ready` bit.
//! * `NET_ARP_REG` resolves an address (byte-swapped into network order by the shell); the
//!   modelled link delivers only to resolved peers.
//! * A request whose PSN is not the responder's expected PSN is dropped; the requester
//!   retransmits the same PSN, so a PSN mistake hangs the QP.
//! * Same-node peers: the stock stack does not loop back (Coyote's `invoke` copies in software
//!   when local and remote IP match); the request is dropped unless the node carries the
//!   extension block, whose sequencer has an internal loopback.
//! * An RC SEND is delivered to the vFPGA's stream (`RC_SEND_ONLY` →
//!   `memCmd(0, len, PKG_F, PKG_INT, qpn)`), not to host memory; a SEND over one PMTU goes as
//!   FIRST / MIDDLE / LAST packets (`rdma_req_parser.sv`, bca3563 and 05090aa), one PSN each.

use super::wire::{count_drop, packets, wire_ok, DropWhy};
use super::{Fifo, World};
use crate::encoding::{
    CtrlWord, OpcodeEncoding, QpContext, RdmaOp, RdmaRequest, Stream, CMD_FIFO_DEPTH, CTRL_CLR_STAT, CTRL_START,
    MAX_LEN_FIELD, MAX_OUTSTANDING_READS, MAX_OUTSTANDING_WRITES, MAX_VADDR,
};
use crate::regs;
use omw_core::access::AccessFlags;

/// Ticks the stack takes to accept a QP context, connection or ARP request after it raised
/// `ready` again (a model parameter: long enough that a driver which does not wait for
/// `ready` is caught).
pub(crate) const SINK_TICKS: u8 = 2;

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StockQp {
    pub ctx: Option<QpContext>,
    pub conn: Option<crate::encoding::ConnContext>,
    pub reads_done: u32,
    pub writes_done: u32,
    pub out_reads: u32,
    pub out_writes: u32,
    /// Next PSN this QP sends with.
    pub sq_psn: u32,
    /// PSN this QP expects from its peer.
    pub epsn: u32,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Queued {
    pub req: RdmaRequest,
    /// rkey the request carries to the responder: the QP context's (the stack puts it in the
    /// RETH of every READ / WRITE).
    pub rkey: u32,
    pub issued_at: u64,
    /// A drop was already counted for this request (retransmissions are not counted again).
    pub dropped: bool,
}

/// One valid/ready interface out of the config slave (QP context, connection, ARP).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Sink {
    pub valid: bool,
    pub busy: u8,
}

impl Sink {
    fn ready(&self) -> bool {
        self.busy == 0
    }
    /// Whether the interface has work in progress (a tick changes something).
    fn active(&self) -> bool {
        self.valid || self.busy > 0
    }
    /// One tick: take a pending request if ready; true if it was taken.
    fn tick(&mut self) -> bool {
        if self.busy > 0 {
            self.busy -= 1;
        }
        if self.valid && self.busy == 0 {
            self.valid = false;
            self.busy = SINK_TICKS;
            return true;
        }
        false
    }
}

pub(crate) struct StockEngine {
    pub vaddr_rd: u64,
    pub ctrl_2: u64,
    pub vaddr_wr: u64,
    /// `CTRL_REG_2` was written since the last `CTRL_REG` write (the double's bookkeeping,
    /// to count stale re-posts; the hardware has no such bit).
    pub ctrl_2_fresh: bool,
    pub ctx_regs: [u64; 3],
    pub conn_regs: [u64; 3],
    pub arp_reg: u64,
    pub ctx_sink: Sink,
    pub conn_sink: Sink,
    pub arp_sink: Sink,
    /// Addresses resolved by ARP, in network byte order (as the shell passes them on).
    pub arp: Vec<u32>,
    pub fifo: Fifo<Queued>,
    pub in_flight: Fifo<Queued>,
    pub qps: Vec<StockQp>,
    pub irq_pending: bool,
    pub isr_vaddr_miss: u64,
    pub isr_pid_miss: u64,
    pub isr_len_miss: u64,
}

impl StockEngine {
    pub fn new() -> Self {
        StockEngine {
            vaddr_rd: 0,
            ctrl_2: 0,
            vaddr_wr: 0,
            ctrl_2_fresh: false,
            ctx_regs: [0; 3],
            conn_regs: [0; 3],
            arp_reg: 0,
            ctx_sink: Sink::default(),
            conn_sink: Sink::default(),
            arp_sink: Sink::default(),
            arp: Vec::new(),
            fifo: Fifo::new(),
            in_flight: Fifo::new(),
            qps: vec![StockQp::default(); 64],
            irq_pending: false,
            isr_vaddr_miss: 0,
            isr_pid_miss: 0,
            isr_len_miss: 0,
        }
    }

    pub fn read(&self, reg: usize) -> u64 {
        match reg {
            regs::CTRL_REG => self.fifo.len() as u64,
            regs::VADDR_RD_REG => self.vaddr_rd & MAX_VADDR,
            regs::CTRL_REG_2 => self.ctrl_2,
            regs::VADDR_WR_REG => self.vaddr_wr & MAX_VADDR,
            regs::ISR_REG => regs::isr::STAT_INVLDT_READY | regs::isr::STAT_PFAULT_READY,
            regs::ISR_PID_MISS_REG => self.isr_pid_miss,
            regs::ISR_VADDR_MISS_REG => self.isr_vaddr_miss & MAX_VADDR,
            regs::ISR_LEN_MISS_REG => self.isr_len_miss & MAX_LEN_FIELD,
            regs::NET_ARP_REG => self.arp_sink.ready() as u64,
            regs::RDMA_CTX_REG_0 | regs::RDMA_CTX_REG_1 => self.ctx_regs[reg - regs::RDMA_CTX_REG_0],
            regs::RDMA_CTX_REG_2 => self.ctx_sink.ready() as u64,
            regs::RDMA_CONN_REG_0 | regs::RDMA_CONN_REG_1 => self.conn_regs[reg - regs::RDMA_CONN_REG_0],
            regs::RDMA_CONN_REG_2 => self.conn_sink.ready() as u64,
            r if (regs::STAT_RDMA_REG..regs::STAT_RDMA_REG + 64).contains(&r) => {
                let q = &self.qps[r - regs::STAT_RDMA_REG];
                (q.writes_done as u64) << 32 | q.reads_done as u64
            }
            _ => 0,
        }
    }
}

fn is_strm_local(s: Stream) -> bool {
    matches!(s, Stream::Host | Stream::Card)
}

/// The RDMA request a posted pair of control words describes, as the stack would take it:
/// `None` when the words do not form one (the request parser drops those).
fn latch_rdma(enc: OpcodeEncoding, src: CtrlWord, dst: CtrlWord, vaddr_rd: u64, vaddr_wr: u64) -> Option<RdmaRequest> {
    // the remote side carries START and the RDMA stream; a READ's remote side is the source
    let (remote, local, op) = if src.start && src.stream == Stream::Rdma {
        (src, dst, enc.decode(src.opcode)?)
    } else if dst.start && dst.stream == Stream::Rdma {
        (dst, src, enc.decode(dst.opcode)?)
    } else {
        return None;
    };
    let remote_is_src = remote == src;
    if (op == RdmaOp::Read) != remote_is_src {
        return None;
    }
    let (local_addr, remote_addr) = if remote_is_src { (vaddr_wr, vaddr_rd) } else { (vaddr_rd, vaddr_wr) };
    Some(RdmaRequest {
        op,
        ctid: remote.pid,
        local_addr: local_addr & MAX_VADDR,
        remote_addr: remote_addr & MAX_VADDR,
        len: (remote.len as u64 & MAX_LEN_FIELD) as u32,
        last: remote.last,
        local_dest: local.dest,
        remote_dest: remote.dest,
    })
}

pub(crate) fn write(w: &mut World, n: usize, reg: usize, value: u64) {
    let node = &mut w.nodes[n];
    let s = &mut node.stock;
    match reg {
        regs::VADDR_RD_REG => s.vaddr_rd = value,
        regs::CTRL_REG_2 => {
            s.ctrl_2 = value;
            s.ctrl_2_fresh = true;
        }
        regs::VADDR_WR_REG => s.vaddr_wr = value,
        regs::ISR_REG => {
            if value & regs::isr::CLR_IRQ_PENDING != 0 {
                s.irq_pending = false;
            }
            if value & regs::isr::INVLDT != 0 {
                node.stats.invalidations_posted += 1;
            }
        }
        regs::CTRL_REG => {
            node.stats.ctrl_writes += 1;
            let fresh = std::mem::replace(&mut s.ctrl_2_fresh, false);
            let src = CtrlWord::decode(value);
            let dst = CtrlWord::decode(s.ctrl_2);
            // every CTRL_REG write pulses `post`: the CLR_STAT bits of both words act on it
            if value & CTRL_CLR_STAT != 0 {
                s.qps[src.pid as usize].reads_done = 0;
            }
            if s.ctrl_2 & CTRL_CLR_STAT != 0 {
                s.qps[dst.pid as usize].writes_done = 0;
            }
            if value & CTRL_START == 0 && s.ctrl_2 & CTRL_START == 0 {
                return; // neither word is active: nothing is posted
            }
            if !fresh && s.ctrl_2 & CTRL_START != 0 && value & CTRL_START == 0 {
                node.stats.stale_reposts += 1;
            }
            // cnfg_slave's if / else-if chain on the two START bits
            let local = match (src.start, dst.start) {
                (true, true) => true,
                (true, false) => is_strm_local(src.stream),
                _ => is_strm_local(dst.stream),
            };
            if s.fifo.len() as u64 >= CMD_FIFO_DEPTH {
                node.stats.fifo_overflows += 1;
                return;
            }
            if local {
                // a local DMA command (host/card stream): queued, not modelled further
                node.stats.local_commands += 1;
                return;
            }
            let Some(req) = latch_rdma(node.cfg.encoding, src, dst, s.vaddr_rd, s.vaddr_wr) else {
                node.stats.decode_errors += 1;
                return;
            };
            let rkey = s.qps[req.ctid as usize].ctx.map(|c| c.remote_rkey).unwrap_or(0);
            s.fifo.push_back(Queued { req, rkey, issued_at: 0, dropped: false });
            node.stats.commands_accepted += 1;
        }
        regs::NET_ARP_REG => {
            if s.arp_sink.valid {
                node.stats.interface_overwrites += 1;
            }
            s.arp_reg = value;
            s.arp_sink.valid = true;
        }
        r if (regs::RDMA_CTX_REG_0..=regs::RDMA_CTX_REG_2).contains(&r) => {
            if s.ctx_sink.valid {
                node.stats.interface_overwrites += 1;
            }
            s.ctx_regs[r - regs::RDMA_CTX_REG_0] = value;
            s.ctx_sink.valid |= r == regs::RDMA_CTX_REG_2;
        }
        r if (regs::RDMA_CONN_REG_0..=regs::RDMA_CONN_REG_2).contains(&r) => {
            if s.conn_sink.valid {
                node.stats.interface_overwrites += 1;
            }
            s.conn_regs[r - regs::RDMA_CONN_REG_0] = value;
            s.conn_sink.valid |= r == regs::RDMA_CONN_REG_2;
        }
        _ => {}
    }
}

/// The stack takes what the config interfaces offer.
pub(crate) fn accept_config(w: &mut World, n: usize) -> bool {
    let node = &mut w.nodes[n];
    let st = &node.stock;
    let mut progress = st.ctx_sink.active() || st.conn_sink.active() || st.arp_sink.active();
    if node.stock.ctx_sink.tick() {
        progress = true;
        let ctx = QpContext::decode(node.stock.ctx_regs);
        match node.ctid_of(ctx.local_qpn) {
            Some(c) => {
                let q = &mut node.stock.qps[c as usize];
                q.ctx = Some(ctx);
                q.sq_psn = ctx.local_psn;
                q.epsn = ctx.remote_psn;
            }
            None => node.stock.isr_pid_miss = ctx.local_qpn as u64,
        }
    }
    if node.stock.conn_sink.tick() {
        progress = true;
        let conn = crate::encoding::ConnContext::decode(node.stock.conn_regs);
        // CONN[0] carries only 16 bits of the local QPN; the engine's QPNs fit in 10
        match node.ctid_of(conn.local_qpn) {
            Some(c) => {
                node.stock.qps[c as usize].conn = Some(conn);
                if let Some(e) = node.ext.as_mut() {
                    e.connected(c);
                }
            }
            None => node.stock.isr_pid_miss = conn.local_qpn as u64,
        }
    }
    if node.stock.arp_sink.tick() {
        progress = true;
        let ip_net = (node.stock.arp_reg as u32).swap_bytes();
        if !node.stock.arp.contains(&ip_net) {
            node.stock.arp.push(ip_net);
        }
    }
    progress
}

/// Issue FIFO heads while their QP is under its outstanding limit (head-of-line blocking).
pub(crate) fn issue(w: &mut World, n: usize) -> bool {
    let now = w.now;
    let node = &mut w.nodes[n];
    let mut progress = false;
    while let Some(head) = node.stock.fifo.front().copied() {
        let q = &mut node.stock.qps[head.req.ctid as usize];
        let (out, limit) = if head.req.op == RdmaOp::Read {
            (&mut q.out_reads, MAX_OUTSTANDING_READS)
        } else {
            (&mut q.out_writes, MAX_OUTSTANDING_WRITES)
        };
        if *out >= limit {
            break;
        }
        *out += 1;
        let (ow, or) = (q.out_writes, q.out_reads);
        node.stats.max_outstanding_writes = node.stats.max_outstanding_writes.max(ow);
        node.stats.max_outstanding_reads = node.stats.max_outstanding_reads.max(or);
        node.stock.fifo.pop_front();
        node.stock.in_flight.push_back(Queued { issued_at: now, ..head });
        progress = true;
    }
    progress
}

enum Delivery {
    Done,
    /// Not delivered this tick (RNR at an extension responder): retried.
    Retry,
    /// Dropped on the way: the requester retransmits, the same way.
    Dropped(DropWhy),
    Lost(u64),
    Refused,
}

/// Complete the requests issued in earlier ticks: move the data, move the counters.
pub(crate) fn complete_in_flight(w: &mut World, n: usize) -> bool {
    let now = w.now;
    let mut progress = false;
    let mut keep = Fifo::new();
    while let Some(mut q) = w.nodes[n].stock.in_flight.pop_front() {
        if q.issued_at >= now {
            keep.push_back(q);
            continue;
        }
        let d = deliver(w, n, &q);
        let node = &mut w.nodes[n];
        match d {
            Delivery::Retry => {
                keep.push_back(q);
                continue;
            }
            Delivery::Dropped(why) => {
                if !std::mem::replace(&mut q.dropped, true) {
                    count_drop(&mut node.stats, why);
                }
                keep.push_back(q);
                continue;
            }
            Delivery::Done => {
                node.stats.commands_completed += 1;
                let sq = &mut node.stock.qps[q.req.ctid as usize];
                if q.req.last {
                    if q.req.op == RdmaOp::Read {
                        sq.reads_done = sq.reads_done.wrapping_add(1);
                    } else {
                        sq.writes_done = sq.writes_done.wrapping_add(1);
                    }
                }
            }
            Delivery::Lost(addr) => {
                node.stats.page_faults += 1;
                node.stock.irq_pending = true;
                node.stock.isr_vaddr_miss = addr;
                node.stock.isr_len_miss = q.req.len as u64;
                node.stock.isr_pid_miss = q.req.ctid as u64;
            }
            Delivery::Refused => {
                node.stats.remote_errors += 1;
            }
        }
        let sq = &mut w.nodes[n].stock.qps[q.req.ctid as usize];
        if q.req.op == RdmaOp::Read {
            sq.out_reads -= 1;
        } else {
            sq.out_writes -= 1;
        }
        progress = true;
    }
    w.nodes[n].stock.in_flight = keep;
    progress
}

fn deliver(w: &mut World, n: usize, q: &Queued) -> Delivery {
    let r = &q.req;
    if w.nodes[n].stock.qps[r.ctid as usize].conn.is_none() {
        return Delivery::Refused;
    }
    let Some((rn, rc)) = w.peer(n, r.ctid) else {
        // no node has the connection's address (or QPN): nobody answers, the requester
        // retransmits until its retries run out
        return Delivery::Dropped(DropWhy::NoRoute);
    };
    let len = r.len as u64;
    let pmtu = w.nodes[n].cfg.pmtu;
    let resp_qpn = w.nodes[rn].qpn(rc);
    let mut remote_addr = r.remote_addr;
    // the extension block checks every incoming READ/WRITE against its key table
    if let Some(e) = w.nodes[rn].ext.as_ref() {
        let need = match r.op {
            RdmaOp::Read => Some(AccessFlags::REMOTE_READ),
            RdmaOp::Write => Some(AccessFlags::REMOTE_WRITE),
            RdmaOp::Send => None,
        };
        if let Some(need) = need {
            match e.remote_check(q.rkey, r.remote_addr, len, need, false, (resp_qpn, rc)) {
                Ok(at) => remote_addr = at,
                Err(_) => {
                    if let Some(e) = w.nodes[rn].ext.as_mut() {
                        e.event(resp_qpn, omw_core::device::WcStatus::RemAccessErr, 0);
                    }
                    return Delivery::Refused;
                }
            }
        }
    }
    let ext_rq = r.op == RdmaOp::Send && w.nodes[rn].ext.as_ref().is_some_and(|e| e.has_rq(rc));
    if ext_rq {
        // an extension responder with a receive ring: RNR (no receive enabled) is checked
        // before the packet's PSN is consumed
        if !super::ext::rq_ready(w, rn, rc) {
            return Delivery::Retry;
        }
    }
    if let Err(why) = wire_ok(w, n, r.ctid, rn, rc, packets(r.len, pmtu)) {
        return Delivery::Dropped(why);
    }
    match r.op {
        RdmaOp::Read => {
            let Some(data) = w.nodes[rn].read(remote_addr, len) else {
                return Delivery::Lost(remote_addr);
            };
            if !w.nodes[n].write(r.local_addr, &data) {
                return Delivery::Lost(r.local_addr);
            }
        }
        RdmaOp::Write | RdmaOp::Send => {
            let Some(data) = w.nodes[n].read(r.local_addr, len) else {
                return Delivery::Lost(r.local_addr);
            };
            if ext_rq {
                return match super::ext::deliver_send(w, rn, rc, &data, None, None) {
                    Ok(true) => Delivery::Done,
                    Ok(false) => Delivery::Retry,
                    Err(_) => Delivery::Refused,
                };
            }
            if r.op == RdmaOp::Send {
                // RC_SEND_ONLY → memCmd(0, len, PKG_F, PKG_INT, qpn): into the vFPGA stream
                w.nodes[rn].stream_rx.push((rc, data));
                return Delivery::Done;
            }
            if !w.nodes[rn].write(remote_addr, &data) {
                return Delivery::Lost(remote_addr);
            }
        }
    }
    Delivery::Done
}
