//! RC queue pairs: send and receive rings in host memory, managed-queue enable limits, the
//! prefetch cache, per-QP timing state.
//!
//! Ring indices are absolute (never wrap); entry `i` lives in slot `i % depth`. An unmanaged
//! queue executes entries below its producer index (what was posted). A *managed* queue
//! executes entries below its enable limit — and only those — whatever was posted: like an
//! mlx5 managed QP, whose hardware producer index is moved only by SEND_EN/RECV_EN, a chain
//! whose ring is exactly as deep as the chain re-executes the same slots lap after lap.

use omw_core::device::QpState;
use omw_core::wire::wqe::{QueueSel, WQE_SIZE};

/// Data segments per receive WQE of a ring in mlx5 form (`crate::mlx5_fetch`).
pub const MLX5_RQ_SGES: usize = 32;
/// Bytes per receive WQE of a ring in mlx5 form: its data segments.
pub const MLX5_RQ_STRIDE: u32 = (MLX5_RQ_SGES * 16) as u32;

/// What the executor must know of an mlx5 WQE beyond its canonical translation.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct HeadForm {
    /// A SEND_EN whose index counts WQEs (`SendEnUnit::Wqe`): it moves the target's WQE limit.
    pub enable_in_wqes: bool,
    /// A UMR bind the device refuses from its bytes alone (rights the mkey cannot carry, a
    /// window start that is neither its MR address nor 0, a window longer than its KLM).
    pub bind_refused: Option<BindForm>,
    /// A WAIT: the CQ it names (fabric-wide index; `None`: no such CQ on the host) and the
    /// count it waits for.
    pub wait: Option<(Option<u32>, u64)>,
}

/// Why an mlx5 bind's bytes are refused before any window rule is asked.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BindForm {
    /// Bits of the mkey context's access byte outside LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE
    /// and ATOMIC (`MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_*`, the only rights a window UMR
    /// writes: rdma-core providers/mlx5/qp.c v44.0 `set_umr_mkey_seg`).
    Rights(u8),
    /// `start_addr` is neither the KLM's address (a VA-based window) nor 0 (ZERO_BASED).
    Start { start: u64, klm: u64 },
    /// The mkey context's `len` exceeds what the KLM maps (`byte_count`).
    Length { len: u64, klm: u32 },
}

/// How a QP is created.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct QpConfig {
    pub pd: crate::protection::PdId,
    /// Send-queue entries (64 B each in the ring arena), ≥ 1.
    pub send_depth: u32,
    /// Receive-queue entries (`RECV_WQE_SIZE` each), ≥ 1.
    pub recv_depth: u32,
    /// The send queue executes only entries enabled by ENABLE / [`crate::Fabric::enable`].
    pub managed_send: bool,
    /// The receive queue consumes only entries enabled by ENABLE / `enable`.
    pub managed_recv: bool,
}

impl Default for QpConfig {
    fn default() -> Self {
        QpConfig {
            pd: crate::protection::PdId(0),
            send_depth: 64,
            recv_depth: 16,
            managed_send: false,
            managed_recv: false,
        }
    }
}

impl QpConfig {
    /// A QP whose queues are both managed, with the given depths (chain rings).
    pub const fn managed(send_depth: u32, recv_depth: u32) -> Self {
        QpConfig { pd: crate::protection::PdId(0), send_depth, recv_depth, managed_send: true, managed_recv: true }
    }
    pub const fn with_depths(mut self, send: u32, recv: u32) -> Self {
        self.send_depth = send;
        self.recv_depth = recv;
        self
    }
    pub const fn with_pd(mut self, pd: crate::protection::PdId) -> Self {
        self.pd = pd;
        self
    }
}

/// One ring and its indices.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Queue {
    pub base: u64,
    pub depth: u32,
    pub stride: u32,
    pub producer: u64,
    pub consumer: u64,
    pub managed: bool,
    pub limit: u64,
    /// WQEs (not WQEBBs) consumed: an mlx5 send queue under `SendEnUnit::Wqe` counts its
    /// SEND_EN limit in these.
    pub wqes: u64,
    /// The SEND_EN limit in WQEs (`SendEnUnit::Wqe`; 0 otherwise): the queue may also run
    /// while fewer WQEs than this were consumed, whatever `limit` says.
    pub wqe_limit: u64,
}

impl Queue {
    pub fn new(base: u64, depth: u32, stride: u32, managed: bool) -> Self {
        Queue { base, depth, stride, producer: 0, consumer: 0, managed, limit: 0, wqes: 0, wqe_limit: 0 }
    }
    /// Index one past the last entry the NIC may execute now.
    #[inline]
    pub fn end(&self) -> u64 {
        if self.managed {
            self.limit
        } else {
            self.producer
        }
    }
    #[inline]
    pub fn available(&self) -> bool {
        self.consumer < self.end() || (self.managed && self.wqes < self.wqe_limit)
    }
    /// Whether the NIC may fetch the WQE starting at `index`, `ahead` WQEs past the consumer:
    /// below the enable limit (WQEBBs) or, under `SendEnUnit::Wqe`, within the WQE limit.
    #[inline]
    pub fn may_fetch(&self, index: u64, width: u64, ahead: u64) -> bool {
        index + width <= self.end() || (self.managed && self.wqes + ahead < self.wqe_limit)
    }
    /// Entries an errored QP still has to flush end here: everything posted or enabled, at
    /// most one ring's worth.
    #[inline]
    pub fn flush_end(&self) -> u64 {
        let e = if self.managed { self.producer.max(self.limit) } else { self.producer };
        e.min(self.consumer + self.depth as u64)
    }
    #[inline]
    pub fn slot_addr(&self, index: u64) -> u64 {
        self.base + (index % self.depth as u64) * self.stride as u64
    }
    /// Room for one more posted entry (after catching the producer up with a consumer that ran
    /// past it on a wrapping managed ring).
    pub fn has_room(&self) -> bool {
        self.producer.max(self.consumer) - self.consumer < self.depth as u64
    }
    pub fn clear(&mut self) {
        self.producer = 0;
        self.consumer = 0;
        self.limit = 0;
        self.wqes = 0;
        self.wqe_limit = 0;
    }
    pub fn ring_bytes(&self) -> u64 {
        self.depth as u64 * self.stride as u64
    }
}

/// WQE bytes fetched ahead of execution (prefetch mode).
#[derive(Debug, Default)]
pub(crate) struct Prefetch {
    buf: Vec<[u8; WQE_SIZE]>,
    head: usize,
    pub len: usize,
    /// Whole WQEs cached (mlx5 form: a WQE is several entries; canonical: `len`).
    pub wqes: u64,
}

impl Prefetch {
    pub fn new(cap: usize) -> Self {
        Prefetch { buf: vec![[0u8; WQE_SIZE]; cap], head: 0, len: 0, wqes: 0 }
    }
    #[inline]
    pub fn cap(&self) -> usize {
        self.buf.len()
    }
    #[inline]
    pub fn front(&self) -> Option<&[u8; WQE_SIZE]> {
        (self.len > 0).then(|| &self.buf[self.head])
    }
    #[inline]
    pub fn back(&self) -> Option<&[u8; WQE_SIZE]> {
        (self.len > 0).then(|| &self.buf[(self.head + self.len - 1) % self.buf.len()])
    }
    #[inline]
    pub fn push_slot(&mut self) -> &mut [u8; WQE_SIZE] {
        let i = (self.head + self.len) % self.buf.len();
        self.len += 1;
        &mut self.buf[i]
    }
    /// The `i`-th entry from the front.
    #[inline]
    pub fn get(&self, i: usize) -> Option<&[u8; WQE_SIZE]> {
        (i < self.len).then(|| &self.buf[(self.head + i) % self.buf.len()])
    }
    #[inline]
    pub fn pop(&mut self) {
        if self.len > 0 {
            self.head = (self.head + 1) % self.buf.len();
            self.len -= 1;
        }
    }
    pub fn clear(&mut self) {
        self.head = 0;
        self.len = 0;
        self.wqes = 0;
    }
    /// The head WQE, `entries` wide, was executed: drop it from the cache if it is there.
    pub fn pop_wqe(&mut self, entries: u64) {
        if self.len > 0 {
            self.wqes = self.wqes.saturating_sub(1);
        }
        for _ in 0..entries {
            self.pop();
        }
    }
}

#[derive(Debug)]
pub(crate) struct Qp {
    pub host: u32,
    pub qpn: u32,
    pub pd: u32,
    /// (host index, qpn) of the connected QP.
    pub peer: Option<(u32, u32)>,
    pub state: QpState,
    pub alive: bool,
    pub sq: Queue,
    pub rq: Queue,
    /// The CQs (fabric-wide indices) the send and receive queues report to.
    pub scq: u32,
    pub rcq: u32,
    pub pf: Prefetch,
    /// The next WQE may not start before this (set by binds: mlx5 fences the WQE after a bind).
    pub order_until: u64,
    /// Latest completion time of a READ or atomic (a FENCEd WQE waits for it).
    pub rd_done: u64,
    /// A SEND at the head found no receive WQE at this time and waits for one.
    pub rnr_since: Option<u64>,
    pub executed: u64,
    pub flushed: u64,
    /// CQEs generated over the QP's whole life (not zeroed by resets).
    pub cqes_total: u64,
    pub in_active: bool,
    /// The CQ (fabric-wide index) this QP is parked on (a blocked WAIT).
    pub parked_on: Option<u32>,
    /// The rings hold mlx5 WQEs (`crate::mlx5_fetch`): send indices count WQEBBs.
    pub mlx5: bool,
    /// The receive queue's doorbell record in host memory: whatever writes it — the CPU, or a
    /// chain's loopback DMA — publishes receives (`Fabric::record_landed`). Its bytes: mlx5's
    /// `htobe32(count & 0xffff)` on an mlx5-form queue, a little-endian u64 count otherwise.
    pub rq_doorbell: Option<u64>,
    /// The record was written since the last reset: the chain publishes this queue's
    /// receives, so the CPU hands none back when it polls (`Fabric::hand_back`).
    pub rq_published: bool,
    /// mlx5 keeps no wr_id in a WQE: per send WQEBB / receive slot, the one its completion
    /// reports (a driver's wrid array).
    pub sq_wr_ids: Vec<u64>,
    pub rq_wr_ids: Vec<u64>,
    /// WQEBBs of the WQE being executed (1 in canonical form).
    pub head_wqebbs: u64,
    /// The local buffers of the scatter READ being executed (mlx5 form).
    pub scatter: Vec<omw_core::wire::wqe::Sge>,
    /// mlx5 form: the last prefetched WQE, if it is a WAIT — (CQ index, count).
    pub pf_wait: Option<(u32, u64)>,
    /// mlx5 form on a device's terms ([`crate::Fabric::create_qp_with`]): a completion's
    /// wr_id is the WQE index (the CQE's `wqe_counter`), not an armed wr_id.
    pub index_wr_ids: bool,
    /// It may post WAIT and ENABLE (`cd_master`): every QP the model makes itself; a QP on a
    /// device's terms only with the role.
    pub cd_master: bool,
    /// mlx5 form: how the WQE being executed differs from its canonical translation.
    pub head_mlx5: HeadForm,
}

impl Qp {
    /// The CQ (fabric-wide index) queue `q` reports to.
    #[inline]
    pub fn cq_index(&self, q: QueueSel) -> u32 {
        match q {
            QueueSel::Send => self.scq,
            QueueSel::Recv => self.rcq,
        }
    }
    #[inline]
    pub fn queue(&self, q: QueueSel) -> &Queue {
        match q {
            QueueSel::Send => &self.sq,
            QueueSel::Recv => &self.rq,
        }
    }
    #[inline]
    pub fn queue_mut(&mut self, q: QueueSel) -> &mut Queue {
        match q {
            QueueSel::Send => &mut self.sq,
            QueueSel::Recv => &mut self.rq,
        }
    }
}
