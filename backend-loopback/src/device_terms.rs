//! The model on a device's terms: what a driver that speaks a NIC's own command language
//! (mlx5 PRM through DEVX: `omw-cx-double`) makes of it. CQs are objects with numbers of their
//! own, created before the QPs that report to them; a QP's rings lie at addresses the driver
//! chose (its umem) and hold mlx5 WQEs whether or not the queue is managed; a completion's
//! wr_id is the WQE index (the CQE's `wqe_counter`); the QP moves through its states one side
//! at a time (RESET → INIT → RTR naming its peer → RTS; any → RESET or ERR); producer indices
//! move by doorbells.
//!
//! The executor is the model's, unchanged: the same fetching (`crate::mlx5_fetch`), checks,
//! timing and device behaviour (`NicConfig::behaviour`) as for the QPs the model makes itself.

use crate::addr::{HostId, QpAddr};
use crate::cq::{Cq, TimedCompletion};
use crate::error::LoopbackError;
use crate::fabric::{qpn_of, Fabric, MAX_QPS_PER_HOST};
use crate::protection::PdId;
use crate::qp::{Prefetch, Qp, Queue};
use omw_core::device::QpState;
use omw_core::ids::Qpn;
use omw_core::mlx5::wqebb::{CqIndex, MAX_WQEBBS, WQEBB};
use omw_core::wire::wqe::QueueSel;

type Result<T> = core::result::Result<T, LoopbackError>;

/// A ring at an address the driver chose.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RingAt {
    pub base: u64,
    /// Entries: WQEBBs of a send queue, WQEs of a receive queue.
    pub entries: u32,
    /// Bytes per entry (64 for a send queue; a receive WQE's data segments for a receive one).
    pub stride: u32,
}

/// A QP as CREATE_QP describes it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DeviceQp {
    pub pd: PdId,
    pub sq: RingAt,
    /// `None`: no receive queue (a SEND to it finds no receive WQE, ever).
    pub rq: Option<RingAt>,
    /// CQ numbers ([`Fabric::create_cq`]) of the send and receive queues.
    pub cqn_snd: u32,
    pub cqn_rcv: u32,
    /// `cd_slave_send`: the send queue runs only what its enable limit allows (doorbell,
    /// SEND_EN).
    pub managed_send: bool,
    /// `cd_slave_receive`: receives are gated as `NicConfig::behaviour.recv_enable` says.
    pub managed_recv: bool,
    /// `cd_master`: it may post WAIT, SEND_EN and RECV_EN (without: they complete in error).
    pub cd_master: bool,
    /// The receive doorbell record (`dbrec[MLX5_RCV_DBR]`): any write of it — the driver's,
    /// or a DMA's — publishes receives, as the HCA reads it when it needs a receive WQE.
    pub recv_doorbell: Option<u64>,
}

/// A QP state transition (PRM `RST2INIT_QP`, `INIT2RTR_QP`, `RTR2RTS_QP`, `2RST_QP`,
/// `2ERR_QP`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Transition {
    Init,
    /// Ready to receive from `peer` (the remote QP number names it).
    Rtr {
        peer: QpAddr,
    },
    Rts,
    /// Back to RESET: indices, prefetch and peer forgotten, ring bytes and CQs untouched, no
    /// completion for what was queued.
    Reset,
    Err,
}

/// A CQ's device-visible state.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CqStatus {
    /// CQEs generated (the producer index).
    pub count: u64,
    /// CQEs taken out of it so far ([`Fabric::take_completions`]).
    pub taken: u64,
    /// It overran its limit and generates nothing more.
    pub overrun: bool,
}

impl Fabric {
    /// A CQ object on host `h` holding up to `capacity` completions until taken; its number
    /// (the lowest unused from 1).
    pub fn create_cq(&mut self, h: HostId, capacity: usize) -> Result<u32> {
        let index = self.cqs.len() as u32;
        let host = self.host_mut(h)?;
        let cqn = (1..=CqIndex::MASK)
            .find(|n| !host.cqns.contains_key(n))
            .ok_or(LoopbackError::BadArgument("CQ numbers exhausted"))?;
        host.cqns.insert(cqn, index);
        self.cqs.push(Cq::new(cqn, capacity, false));
        Ok(cqn)
    }

    fn cq_index(&self, h: HostId, cqn: u32) -> Result<u32> {
        self.host(h)?;
        self.cq_by_number(h.0, cqn).ok_or(LoopbackError::NoSuchCq { host: h, cqn })
    }

    /// Destroy a CQ no live QP reports to; its number is free again.
    pub fn destroy_cq(&mut self, h: HostId, cqn: u32) -> Result<()> {
        let c = self.cq_index(h, cqn)?;
        if self.qps.iter().any(|q| q.alive && (q.scq == c || q.rcq == c)) {
            return Err(LoopbackError::CqInUse { host: h, cqn });
        }
        self.hosts[h.0 as usize].cqns.remove(&cqn);
        self.cqs[c as usize].reset();
        Ok(())
    }

    /// The CQ may generate CQEs while its count is below `limit` (`None`: no bound): a device
    /// CQ without ignore-overrun is bounded by its consumer index plus its size.
    pub fn set_cq_limit(&mut self, h: HostId, cqn: u32, limit: Option<u64>) -> Result<()> {
        let c = self.cq_index(h, cqn)?;
        self.cqs[c as usize].limit = limit;
        Ok(())
    }

    pub fn cq_status(&self, h: HostId, cqn: u32) -> Result<CqStatus> {
        let c = &self.cqs[self.cq_index(h, cqn)? as usize];
        Ok(CqStatus { count: c.count, taken: c.polled, overrun: c.overrun })
    }

    /// Run the fabric until idle, then let the clock reach the CQ's first pending completion:
    /// what a CPU spinning on the CQ waits for ([`Fabric::spin_on`] for a CQ object).
    pub fn spin_on_cq(&mut self, h: HostId, cqn: u32) -> Result<()> {
        let c = self.cq_index(h, cqn)?;
        self.run_until_idle(self.cfg.poll_max_steps);
        if let Some(t) = self.cqs[c as usize].next_time() {
            self.now = self.now.max(t);
        }
        Ok(())
    }

    /// The CQ's completions whose time has come, oldest first, taken out of it (what the device
    /// writes into its ring; nothing is handed back to a receive queue).
    pub fn take_completions(&mut self, h: HostId, cqn: u32) -> Result<Vec<TimedCompletion>> {
        let c = self.cq_index(h, cqn)?;
        let now = self.now;
        let mut v = Vec::new();
        self.cqs[c as usize].poll(now, |e| {
            v.push(e);
            true
        });
        Ok(v)
    }

    /// A QP in RESET with rings of mlx5 WQEs at the given addresses (allocated memory of `h`),
    /// reporting to the CQs `q` names.
    pub fn create_qp_with(&mut self, h: HostId, q: &DeviceQp) -> Result<Qpn> {
        let (scq, rcq) = (self.cq_index(h, q.cqn_snd)?, self.cq_index(h, q.cqn_rcv)?);
        if q.sq.entries == 0 || q.sq.stride as usize != WQEBB {
            return Err(LoopbackError::BadArgument("a send queue is WQEBBs, at least one"));
        }
        let rings = [Some(q.sq), q.rq];
        let host = self.host(h)?;
        for r in rings.iter().flatten() {
            let len = r.entries as u64 * r.stride as u64;
            if r.entries == 0 || r.stride == 0 || host.mem.range(r.base, len).is_none() {
                return Err(LoopbackError::BadAddress { host: h, addr: r.base, len });
            }
        }
        if !host.prot.pd_exists(q.pd) {
            return Err(LoopbackError::NoSuchPd { host: h, pd: q.pd.0 });
        }
        let local = host.qps.len() as u32;
        if local >= MAX_QPS_PER_HOST {
            return Err(LoopbackError::BadArgument("too many QPs on this host"));
        }
        let qpn = qpn_of(h.0, local);
        let gq = self.qps.len() as u32;
        let pf_cap = if self.cfg.prefetch { self.cfg.prefetch_depth.max(MAX_WQEBBS as u32) as usize } else { 0 };
        // no receive queue: one entry nobody ever posts
        let rq = q.rq.unwrap_or(RingAt { base: q.sq.base, entries: 1, stride: 16 });
        self.hosts[h.0 as usize].qps.push(gq);
        if let Some(a) = q.recv_doorbell {
            self.hosts[h.0 as usize].doorbells.push((a, gq));
        }
        self.qps.push(Qp {
            host: h.0,
            qpn,
            pd: q.pd.0,
            peer: None,
            state: QpState::Reset,
            alive: true,
            sq: Queue::new(q.sq.base, q.sq.entries, q.sq.stride, q.managed_send),
            rq: Queue::new(rq.base, rq.entries, rq.stride, q.managed_recv),
            scq,
            rcq,
            pf: Prefetch::new(pf_cap),
            order_until: 0,
            rd_done: 0,
            rnr_since: None,
            executed: 0,
            flushed: 0,
            cqes_total: 0,
            in_active: false,
            parked_on: None,
            mlx5: true,
            rq_doorbell: q.recv_doorbell,
            rq_published: false,
            sq_wr_ids: Vec::new(),
            rq_wr_ids: Vec::new(),
            head_wqebbs: 1,
            scatter: Vec::new(),
            pf_wait: None,
            index_wr_ids: true,
            cd_master: q.cd_master,
            head_mlx5: Default::default(),
        });
        Ok(Qpn::new(qpn).unwrap_or_default())
    }

    /// Move one QP (not its peer) to another state. Refused (`BadQpState`) unless the
    /// transition starts where the QP is: INIT from RESET, RTR from INIT, RTS from RTR; RESET
    /// and ERR from any state.
    pub fn modify_qp(&mut self, qp: QpAddr, to: Transition) -> Result<()> {
        let g = self.gq(qp)?;
        let state = self.qps[g as usize].state;
        let bad = || LoopbackError::BadQpState { host: qp.host, qpn: qp.qpn.get(), state };
        match to {
            Transition::Init if state == QpState::Reset => self.qps[g as usize].state = QpState::Init,
            Transition::Rtr { peer } if state == QpState::Init => {
                let q = &mut self.qps[g as usize];
                q.peer = Some((peer.host.0, peer.qpn.get()));
                q.state = QpState::Rtr;
            }
            Transition::Rts if state == QpState::Rtr => {
                self.qps[g as usize].state = QpState::Rts;
                self.activate(g);
                self.refill(g);
            }
            Transition::Reset => {
                let q = &mut self.qps[g as usize];
                q.state = QpState::Reset;
                q.peer = None;
                q.sq.clear();
                q.rq.clear();
                q.pf.clear();
                q.pf_wait = None;
                q.rnr_since = None;
                q.parked_on = None;
                q.order_until = 0;
                q.rd_done = 0;
                q.head_wqebbs = 1;
            }
            Transition::Err => self.set_err(g),
            _ => return Err(bad()),
        }
        Ok(())
    }

    /// A doorbell: `queue`'s 16-bit producer index is now `index` (send: WQEBBs; receive:
    /// WQEs). An unmanaged queue may run up to it; a managed send queue's enable limit moves
    /// up to it (the host starting a `cd_slave_send` ring); a receive queue's posted count
    /// moves. Indices move forward only (modulo 2^16).
    pub fn ring_doorbell(&mut self, qp: QpAddr, queue: QueueSel, index: u16) -> Result<()> {
        let g = self.gq(qp)?;
        let q = &mut self.qps[g as usize];
        let forward = |cur: u64| cur + index.wrapping_sub(cur as u16) as u64;
        match queue {
            QueueSel::Send if q.sq.managed => q.sq.limit = forward(q.sq.limit),
            QueueSel::Send => q.sq.producer = forward(q.sq.producer),
            QueueSel::Recv => q.rq.producer = forward(q.rq.producer),
        }
        match (queue, self.qps[g as usize].state) {
            (QueueSel::Send, _) => {
                self.activate(g);
                self.refill(g);
            }
            (QueueSel::Recv, QpState::Err) => self.flush_recvs(g),
            _ => {}
        }
        Ok(())
    }
}
