//! The stock engine's model: registers, command FIFO, outstanding limits, counters.

use super::{Fifo, World};
use crate::encoding::{
    Command, ConnContext, CtrlWord, QpContext, RdmaOp, RdmaRequest, CMD_FIFO_DEPTH, MAX_OUTSTANDING_READS,
    MAX_OUTSTANDING_WRITES,
};
use crate::regs;
use omw_core::access::AccessFlags;

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StockQp {
    pub ctx: Option<QpContext>,
    pub conn: Option<ConnContext>,
    pub reads_done: u32,
    pub writes_done: u32,
    pub out_reads: u32,
    pub out_writes: u32,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Queued {
    pub req: RdmaRequest,
    /// rkey the request carries to the responder (CMD_RKEY latch or the QP context's).
    pub rkey: u32,
    pub issued_at: u64,
}

pub(crate) struct StockEngine {
    pub vaddr_rd: u64,
    pub ctrl_2: u64,
    pub vaddr_wr: u64,
    pub ctx_latch: [u64; 3],
    pub conn_latch: [u64; 3],
    pub cmd_rkey: Option<u32>,
    pub fifo: Fifo<Queued>,
    pub in_flight: Fifo<Queued>,
    pub qps: Vec<StockQp>,
    pub isr: u64,
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
            ctx_latch: [0; 3],
            conn_latch: [0; 3],
            cmd_rkey: None,
            fifo: Fifo::new(),
            in_flight: Fifo::new(),
            qps: vec![StockQp::default(); 64],
            isr: 0,
            isr_vaddr_miss: 0,
            isr_pid_miss: 0,
            isr_len_miss: 0,
        }
    }

    pub fn read(&self, reg: usize) -> u64 {
        match reg {
            regs::CTRL_REG => self.fifo.len() as u64,
            regs::VADDR_RD_REG => self.vaddr_rd,
            regs::CTRL_REG_2 => self.ctrl_2,
            regs::VADDR_WR_REG => self.vaddr_wr,
            regs::ISR_REG => self.isr,
            regs::ISR_PID_MISS_REG => self.isr_pid_miss,
            regs::ISR_VADDR_MISS_REG => self.isr_vaddr_miss,
            regs::ISR_LEN_MISS_REG => self.isr_len_miss,
            r if (regs::RDMA_CTX_REG_0..=regs::RDMA_CTX_REG_2).contains(&r) => self.ctx_latch[r - regs::RDMA_CTX_REG_0],
            r if (regs::RDMA_CONN_REG_0..=regs::RDMA_CONN_REG_2).contains(&r) => {
                self.conn_latch[r - regs::RDMA_CONN_REG_0]
            }
            r if (regs::STAT_RDMA_REG..regs::STAT_RDMA_REG + 64).contains(&r) => {
                let q = &self.qps[r - regs::STAT_RDMA_REG];
                (q.writes_done as u64) << 32 | q.reads_done as u64
            }
            _ => 0,
        }
    }
}

pub(crate) fn write(w: &mut World, n: usize, reg: usize, value: u64) {
    let node = &mut w.nodes[n];
    let vfid = node.cfg.vfid;
    let s = &mut node.stock;
    match reg {
        regs::VADDR_RD_REG => s.vaddr_rd = value,
        regs::CTRL_REG_2 => s.ctrl_2 = value,
        regs::VADDR_WR_REG => s.vaddr_wr = value,
        regs::ISR_REG => s.isr &= !value, // write-one-to-clear
        regs::CTRL_REG => {
            node.stats.ctrl_writes += 1;
            let word = CtrlWord::decode(value);
            if word.clr_stat {
                let q = &mut s.qps[word.pid as usize];
                q.reads_done = 0;
                q.writes_done = 0;
                return;
            }
            let cmd = Command { vaddr_wr: s.vaddr_wr, ctrl_dst: s.ctrl_2, vaddr_rd: s.vaddr_rd, ctrl_src: value };
            let rkey_latch = s.cmd_rkey.take();
            let req = match cmd.decode_rdma(node.cfg.encoding) {
                Ok(r) => r,
                Err(e) => {
                    node.stats.decode_errors += 1;
                    s.isr |= regs::ISR_DECODE_ERROR;
                    if let crate::encoding::DecodeError::LengthOverflow(l) = e {
                        s.isr_len_miss = l as u64;
                    }
                    return;
                }
            };
            if s.fifo.len() as u64 >= CMD_FIFO_DEPTH {
                node.stats.fifo_overflows += 1;
                s.isr |= regs::ISR_FIFO_OVERFLOW;
                return;
            }
            let rkey = rkey_latch.unwrap_or_else(|| s.qps[req.ctid as usize].ctx.map(|c| c.remote_rkey).unwrap_or(0));
            s.fifo.push_back(Queued { req, rkey, issued_at: 0 });
            node.stats.commands_accepted += 1;
        }
        r if (regs::RDMA_CTX_REG_0..=regs::RDMA_CTX_REG_2).contains(&r) => {
            s.ctx_latch[r - regs::RDMA_CTX_REG_0] = value;
            if r == regs::RDMA_CTX_REG_2 {
                let ctx = QpContext::decode(s.ctx_latch);
                match node.ctid_of(ctx.local_qpn) {
                    Some(c) => node.stock.qps[c as usize].ctx = Some(ctx),
                    None => {
                        node.stock.isr_pid_miss = ctx.local_qpn as u64;
                    }
                }
            }
        }
        r if (regs::RDMA_CONN_REG_0..=regs::RDMA_CONN_REG_2).contains(&r) => {
            s.conn_latch[r - regs::RDMA_CONN_REG_0] = value;
            if r == regs::RDMA_CONN_REG_2 {
                let conn = ConnContext::decode(s.conn_latch);
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
        }
        _ => {
            let _ = vfid;
        }
    }
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
    /// The responder's receive queue has no entry: retried next tick (RNR).
    Retry,
    Lost(u64),
    Refused,
}

/// Complete the requests issued in earlier ticks: move the data, move the counters.
pub(crate) fn complete_in_flight(w: &mut World, n: usize) -> bool {
    let now = w.now;
    let mut progress = false;
    let mut keep = Fifo::new();
    while let Some(q) = w.nodes[n].stock.in_flight.pop_front() {
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
                node.stock.isr |= regs::ISR_PAGE_FAULT;
                node.stock.isr_vaddr_miss = addr;
            }
            Delivery::Refused => {
                node.stats.remote_errors += 1;
                node.stock.isr |= regs::ISR_REMOTE_ERROR;
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
    let Some((rn, rc)) = w.peer(n, r.ctid) else {
        return Delivery::Refused;
    };
    let len = r.len as u64;
    let resp_qpn = w.nodes[rn].qpn(rc);
    // the extension block checks every incoming READ/WRITE against its key table
    if let Some(e) = w.nodes[rn].ext.as_ref() {
        let need = match r.op {
            RdmaOp::Read => Some(AccessFlags::REMOTE_READ),
            RdmaOp::Write => Some(AccessFlags::REMOTE_WRITE),
            RdmaOp::Send => None,
        };
        if let Some(need) = need {
            if !e.remote_ok(q.rkey, r.remote_addr, len, need, resp_qpn) {
                if let Some(e) = w.nodes[rn].ext.as_mut() {
                    e.event(resp_qpn, omw_core::backend::WcStatus::RemAccessErr, 0);
                }
                return Delivery::Refused;
            }
        }
    }
    match r.op {
        RdmaOp::Read => {
            let Some(data) = w.nodes[rn].read(r.remote_addr, len) else {
                return Delivery::Lost(r.remote_addr);
            };
            if !w.nodes[n].write(r.local_addr, &data) {
                return Delivery::Lost(r.local_addr);
            }
        }
        RdmaOp::Write | RdmaOp::Send => {
            let Some(data) = w.nodes[n].read(r.local_addr, len) else {
                return Delivery::Lost(r.local_addr);
            };
            if r.op == RdmaOp::Send && w.nodes[rn].ext.as_ref().is_some_and(|e| e.has_rq(rc)) {
                return match super::ext::deliver_send(w, rn, rc, &data, None, None) {
                    Ok(true) => Delivery::Done,
                    Ok(false) => Delivery::Retry,
                    Err(_) => Delivery::Refused,
                };
            }
            if !w.nodes[rn].write(r.remote_addr, &data) {
                return Delivery::Lost(r.remote_addr);
            }
        }
    }
    Delivery::Done
}
