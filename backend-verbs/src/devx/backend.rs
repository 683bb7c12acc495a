//! The MN's [`RdmaBackend`](omw_core::device::RdmaBackend) on DEVX: every queue of the MN is a DEVX QP whose rings are umem in
//! one ring arena, so the mlx5-form chains can be armed on them (issue 13 part 4).
//!
//! What it translates, and nothing more (policy stays in the core):
//! - **queues**: CQs and QPs by PRM command (`queue.rs`), one CQ per queue, because a WAIT's
//!   producer index must count one queue's completions. Loopback pairs (the MN's admin and
//!   atomic queues, each chain's loop QP) are two DEVX QPs connected to each other over the
//!   port's own GID; a managed loop QP is `cd_master | cd_slave_send` with a send ring of
//!   exactly one lap. CN-facing QPs are created by [`DevxBackend::create_cn_qp`] and
//!   connected by [`DevxBackend::connect_cn_qp`] with the attributes rdma_cm's external-QP
//!   mode hands out (`cm.rs`): the management QPs all three roles, access QPs none.
//! - **work requests**: a canonical [`Wqe`] is encoded (`omw_core::mlx5::encode`) at the send
//!   queue's producer index, NOP-padded rather than wrapped, then the doorbell
//!   (`doorbell.rs`); a [`RecvWqe`] becomes an mlx5 receive WQE. mlx5 WQEs carry no wr_id, so
//!   the backend keeps what a driver keeps: posted WQEs in order, matched to a CQE by its
//!   `wqe_counter` (the first WQEBB of the completed WQE; the unsignaled WQEs before it
//!   completed with it — rdma-core providers/mlx5/cq.c v44.0), receives in order.
//! - **completions**: one 64-byte CQE at a time (`omw_core::mlx5::cqe::parse`), read twice
//!   around a barrier like rdma-core's `get_sw_cqe` + `udma_from_device_barrier`; error
//!   syndromes mapped to `ibv_wc_status` as `mlx5_handle_error_cqe` does; any error CQE puts
//!   the QP in ERR (the device moved it there). The CQ doorbell record gets the consumer index.
//! - **chains**: `arm_mlx5` is [`super::arm::arm_chain`] on the chain's QPs with every receive
//!   slot filled; afterwards each receive the chain consumed is handed back to the device
//!   (the bytes stay in place, the doorbell record moves) when its completion is polled —
//!   the offloaded MN drains the chain CQs every poll, which also keeps them from overrunning.
//! - **windows**: each a DEVX mkey made by CREATE_MKEY as the kernel makes a type-2 window, in
//!   the CN-facing PD (`omw_core::mlx5::prm::mkey`), so that [`WindowState`] can ask the device
//!   where it is bound (QUERY_MKEY) — DEVX cannot query a verbs MW; destroyed with the backend.
//! - **reset**: `2RST_QP`, drain what the QP's CQs still hold, software state to zero, then
//!   RST→INIT→RTR→RTS again with the attributes it was connected with. The CQs keep counting
//!   (they are separate objects), so [`Mlx5Arm::cq_producer_indices`] tells a re-armed
//!   chain where its WAITs start. A QP that was never used is already "freshly reset" and is
//!   left alone (a CN-facing QP must not lose the PSN state its CN already shares).
//!
//! Nothing here has run on a ConnectX; the tests drive it through the core's provisioning and
//! MN driver against the recording mock (docs/MLX5.md).

use super::api::{MemRange, ObjHandle, UarHandle};
use super::arm::{self, ChainQps};
use super::cm::LocalPath;
use super::cm::{self, CmQpAttr};
use super::device::DevxDevice;
use super::doorbell;
use super::queue::{self, CqSpec, DevxCq, DevxQp, QpSpec, CQE_SIZE};
use super::DevxError;
use omw_core::access::AccessFlags;
use omw_core::chain::mlx5::Mlx5Arm;
use omw_core::chain::mlx5::Mlx5Chain;
use omw_core::chain::Ring;
use omw_core::device::DataPath;
use omw_core::device::MwBinding;
use omw_core::device::OffloadRings;
use omw_core::device::Provision;
use omw_core::device::WindowState;
use omw_core::device::{Capabilities, Completion, Domain, MrKeys, QpState, WcOpcode, WcStatus};
use omw_core::ids::{Qpn, Rkey};
use omw_core::mlx5::cqe::{self, opcode as cqe_op, syndrome, Cqe};
use omw_core::mlx5::ctrl::PrevWqe;
use omw_core::mlx5::decode::Mlx5Op;
use omw_core::mlx5::encode::{self, Unmanaged};
use omw_core::mlx5::prm::hca_cap::HcaCaps;
use omw_core::mlx5::prm::mkey;
use omw_core::mlx5::prm::qp::{self as prm_qp, CdRole};
use omw_core::mlx5::wqebb::{WqeIndex, WQEBB};
use omw_core::mlx5::Mlx5Error;
use omw_core::wire::wqe::{Opcode, QueueSel, RecvWqe, Wqe, WqeFlags};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};

/// Sizes of the queues the backend creates. Defaults fit an MN serving tens of CNs; every
/// size is checked against the device's maxima when a queue is created.
#[derive(Clone, Copy, Debug)]
pub struct DevxConfig {
    /// What the device does, as the MN's plan must see it: the DEVX capability gate
    /// (`offload::verdict`) for WAIT/ENABLE and masked atomics, the verbs MW probe for the
    /// window semantics.
    pub capabilities: Capabilities,
    /// log2 CQEs of every CQ the MN polls. The offloaded MN drains the chain CQs on every
    /// poll; a CQ that fills between two polls overruns (docs/MLX5.md question 17).
    pub log_cqes: u8,
    /// log2 WQEBBs of an unmanaged send queue (admin, atomic, access QPs).
    pub log_sq_wqebbs: u8,
    /// log2 entries of a receive queue (management and access QPs).
    pub log_rq: u8,
    /// Receive stride 16 << this bytes: 5 (512 B) holds the chains' largest scatter list
    /// (25 entries at G = 4) and its terminator.
    pub log_rq_stride: u8,
    /// Bytes of the ring arena every CQ and QP ring is carved from (one MR per domain covers it).
    pub ring_arena_bytes: usize,
    /// Chains publish their own receives through their management QP's receive doorbell
    /// record (`Capabilities::RECV_DOORBELL_RECORD`, docs/MLX5.md question 20); off, the
    /// backend hands each polled chain receive back itself, and a device whose doorbell makes
    /// every posted receive available lets pipelined requests on one chain land in a running
    /// lap.
    pub chains_publish_receives: bool,
}

impl DevxConfig {
    pub fn new(capabilities: Capabilities) -> Self {
        DevxConfig {
            capabilities,
            log_cqes: 10,
            log_sq_wqebbs: 8,
            log_rq: 4,
            log_rq_stride: 5,
            ring_arena_bytes: 64 << 20,
            chains_publish_receives: true,
        }
    }
}

impl DevxConfig {
    /// Ring-arena bytes for an MN serving `max_cns` CNs with groups of `group_size`: per CN two
    /// loop pairs (their send CQs, a one-lap loop ring of at most [`MAX_CHAIN_RING_WQEBBS`],
    /// a one-WQEBB responder ring), two management QPs (two CQs each, a one-lap ring, a
    /// receive queue) and `group_size − 1` access QPs (two CQs, an unmanaged ring, a receive
    /// queue); the MN's admin and atomic pairs once. Every piece rounded up to pages.
    pub fn arena_for(max_cns: u32, group_size: u8, cfg: &DevxConfig) -> usize {
        Self::arena_for_chains(max_cns, group_size, 1, cfg)
    }

    /// [`DevxConfig::arena_for`] for CNs of up to `alloc_chains` alloc chains: each chain beyond
    /// the first costs a CN one more loop pair and management QP (`MnDriver::create_alloc_loop_qp`,
    /// its extra Alloc QP).
    pub fn arena_for_chains(max_cns: u32, group_size: u8, alloc_chains: u8, cfg: &DevxConfig) -> usize {
        let pages = |b: usize| b.div_ceil(PAGE) * PAGE;
        let cq = pages(CqSpec::mem_needed(cfg.log_cqes));
        let rq = (16usize << cfg.log_rq_stride) << cfg.log_rq;
        let dbr = queue::DBR_SIZE;
        let unmanaged = pages((WQEBB << cfg.log_sq_wqebbs) + dbr);
        let responder = pages(WQEBB + dbr);
        let loop_qp = pages(MAX_CHAIN_RING_WQEBBS * WQEBB + dbr);
        let mgmt = pages(MAX_CHAIN_RING_WQEBBS * WQEBB + rq + dbr);
        let access = pages((WQEBB << cfg.log_sq_wqebbs) + rq + dbr);
        let chain = (loop_qp + responder + 2 * cq) + (mgmt + 2 * cq);
        let per_cn =
            2 * chain + (group_size as usize - 1) * (access + 2 * cq) + (alloc_chains.max(1) as usize - 1) * chain;
        let mn = 2 * (unmanaged + responder + 2 * cq);
        max_cns as usize * per_cn + mn
    }
}

/// The largest one-lap chain ring (the alloc chain's loop ring at G = 2..4 is 128 WQEBBs:
/// docs/MLX5.md's lap table).
pub const MAX_CHAIN_RING_WQEBBS: usize = 256;

const PAGE: usize = 4096;

/// One page-aligned region carved into queue memory; freed blocks are reused first-fit.
#[derive(Debug)]
struct Arena {
    mem: MemRange,
    next: usize,
    free: Vec<MemRange>,
}

impl Arena {
    fn take(&mut self, len: usize) -> Result<MemRange, DevxError> {
        let len = len.div_ceil(PAGE) * PAGE;
        if let Some(i) = self.free.iter().position(|f| f.len == len) {
            return Ok(self.free.swap_remove(i));
        }
        let left = self.mem.len - self.next;
        if len > left {
            return Err(DevxError::ArenaFull { need: len, left });
        }
        let r = MemRange { addr: self.mem.addr + self.next, len };
        self.next += len;
        Ok(r)
    }
    fn give_back(&mut self, r: MemRange) {
        self.free.push(r);
    }
}

/// How a QP is connected, kept so a reset can connect it again.
#[derive(Clone, Copy, Debug)]
enum Link {
    /// One end of a loopback pair; `peer` is the other end's number.
    Loopback { peer: u32 },
    /// CN-facing, through rdma_cm: the attributes it was connected with (`None` until then).
    Cn { attr: Option<(CmQpAttr, [u8; 6])> },
}

#[derive(Clone, Copy, Debug)]
struct Posted {
    index: u16,
    wqebbs: u16,
    wr_id: u64,
    opcode: Opcode,
}

/// A chain armed on this send ring: (wr_id, opcode) per WQEBB slot.
type ChainSlots = Vec<(u64, Opcode)>;

#[derive(Debug)]
struct QpSlot {
    devx: DevxQp,
    link: Link,
    state: QpState,
    /// Something was posted, armed or completed since creation or the last reset.
    used: bool,
    managed: bool,
    sq_pi: WqeIndex,
    /// Index up to which the device completed send WQEs (ring space is free behind it).
    sq_ci: WqeIndex,
    posted: VecDeque<Posted>,
    /// Whether the last WQE posted was a UMR: the next one carries the initiator small fence
    /// (rdma-core keeps the same in `qp->fm_cache`).
    prev: PrevWqe,
    chain: Option<ChainSlots>,
    rq_head: u32,
    rq_wr_ids: VecDeque<u64>,
    /// A chain's receive queue: every slot holds the chain's receive WQE; a consumed one is
    /// handed back when its completion is polled — unless the chain publishes its receives
    /// itself (`chain_publishes`). The wr_id its completions carry.
    chain_recv: Option<u64>,
    /// The chain writes this queue's receive doorbell record (`ChainEnv::posts_receives`):
    /// the CPU must not (its count would race the chain's).
    chain_publishes: bool,
    mem: MemRange,
    cq_snd: u32,
    cq_rcv: Option<u32>,
}

#[derive(Debug)]
struct CqSlot {
    devx: DevxCq,
    mem: MemRange,
    /// CQEs consumed: after a drain, the device's producer index.
    ci: u32,
}

/// The MN's backend on a DEVX device `D` (`ffi::RealDevx`, or the tests' mock).
#[derive(Debug)]
pub struct DevxBackend<D: DevxDevice> {
    /// In a cell because [`WindowState`] asks with `&self` and a window's state is a command
    /// to the device (QUERY_MKEY); every other use has `&mut self` and takes it directly.
    dev: RefCell<D>,
    caps: HcaCaps,
    cfg: DevxConfig,
    uar: UarHandle,
    path: LocalPath,
    arena: Arena,
    /// The arena's MR in [CN-facing, MN-private]: local-only in the CN-facing PD (receives
    /// scatter request bytes into WQE fields), remote rights only in the MN-private one.
    ring_mrs: [MrKeys; 2],
    qps: BTreeMap<u32, QpSlot>,
    cqs: BTreeMap<u32, CqSlot>,
    regions: Vec<MemRange>,
    /// The memory windows, DEVX mkeys by mkey index (the rkey's index).
    windows: BTreeMap<u32, ObjHandle>,
    /// The key byte the next window is created with (`mlx5_ib_create_mkey` draws it from a
    /// per-device counter the same way).
    next_window_key: u8,
    /// QUERY_MKEYs that got no answer ([`WindowState`]), and the last one's error.
    window_query_failures: Cell<u64>,
    last_window_query_error: RefCell<Option<DevxError>>,
}

fn domain_slot(d: Domain) -> usize {
    match d {
        Domain::CnFacing => 0,
        Domain::MnPrivate => 1,
    }
}

/// `mlx5_handle_error_cqe` (rdma-core providers/mlx5/cq.c v44.0): syndrome → `ibv_wc_status`.
pub fn wc_status_of(syndrome_byte: u8) -> WcStatus {
    match syndrome_byte {
        syndrome::LOCAL_LENGTH_ERR => WcStatus::LocLenErr,
        syndrome::LOCAL_QP_OP_ERR => WcStatus::LocQpOpErr,
        syndrome::LOCAL_PROT_ERR => WcStatus::LocProtErr,
        syndrome::WR_FLUSH_ERR => WcStatus::WrFlushErr,
        syndrome::MW_BIND_ERR => WcStatus::MwBindErr,
        syndrome::BAD_RESP_ERR => WcStatus::BadRespErr,
        syndrome::LOCAL_ACCESS_ERR => WcStatus::LocAccessErr,
        syndrome::REMOTE_INVAL_REQ_ERR => WcStatus::RemInvReqErr,
        syndrome::REMOTE_ACCESS_ERR => WcStatus::RemAccessErr,
        syndrome::REMOTE_OP_ERR => WcStatus::RemOpErr,
        syndrome::TRANSPORT_RETRY_EXC_ERR => WcStatus::RetryExcErr,
        syndrome::RNR_RETRY_EXC_ERR => WcStatus::RnrRetryExcErr,
        _ => WcStatus::GeneralErr,
    }
}

/// The canonical opcode of a decoded mlx5 WQE (what a chain completion reports).
fn opcode_of(op: &Mlx5Op) -> Opcode {
    match op {
        Mlx5Op::Nop => Opcode::Nop,
        Mlx5Op::Send { imm: None, .. } => Opcode::Send,
        Mlx5Op::Send { imm: Some(_), .. } => Opcode::SendWithImm,
        Mlx5Op::SendInv { .. } => Opcode::SendWithInv,
        Mlx5Op::Write { imm: None, .. } => Opcode::Write,
        Mlx5Op::Write { imm: Some(_), .. } => Opcode::WriteWithImm,
        Mlx5Op::Read { .. } | Mlx5Op::ScatterRead { .. } => Opcode::Read,
        Mlx5Op::FetchAdd { .. } => Opcode::FetchAdd,
        Mlx5Op::MaskedFetchAdd { .. } => Opcode::MaskedFetchAdd,
        Mlx5Op::CompareSwap { .. } => Opcode::CompareSwap,
        Mlx5Op::Bind { .. } => Opcode::BindMw,
        Mlx5Op::Invalidate { .. } => Opcode::LocalInv,
        Mlx5Op::Wait { .. } => Opcode::Wait,
        Mlx5Op::SendEn { .. } | Mlx5Op::RecvEn { .. } => Opcode::Enable,
    }
}

impl<D: DevxDevice> DevxBackend<D> {
    /// Read the capabilities, allocate the UAR and the ring arena, and register the arena in
    /// both domains. `caps` must have passed the offload gate (`HcaCaps::missing_for_offload`).
    pub fn new(mut dev: D, caps: HcaCaps, cfg: DevxConfig) -> Result<Self, DevxError> {
        if let Some(m) = caps.missing_for_offload() {
            return Err(DevxError::MissingCapability(m));
        }
        let uar = dev.alloc_uar()?;
        let path = dev.local_path()?;
        let mem = dev.alloc_mem(cfg.ring_arena_bytes.div_ceil(PAGE) * PAGE, PAGE)?;
        let ring_mrs = [
            dev.reg_mr(Domain::CnFacing, mem, AccessFlags::LOCAL_WRITE)?,
            dev.reg_mr(
                Domain::MnPrivate,
                mem,
                AccessFlags::LOCAL_WRITE
                    | AccessFlags::REMOTE_READ
                    | AccessFlags::REMOTE_WRITE
                    | AccessFlags::REMOTE_ATOMIC,
            )?,
        ];
        Ok(DevxBackend {
            dev: RefCell::new(dev),
            caps,
            cfg,
            uar,
            path,
            arena: Arena { mem, next: 0, free: Vec::new() },
            ring_mrs,
            qps: BTreeMap::new(),
            cqs: BTreeMap::new(),
            regions: Vec::new(),
            windows: BTreeMap::new(),
            next_window_key: 0,
            window_query_failures: Cell::new(0),
            last_window_query_error: RefCell::new(None),
        })
    }

    /// The device, for a look at it (tests: the mock's recording, the double's counters).
    /// Borrowed from the cell [`WindowState`]'s queries use; nothing else holds it across calls.
    pub fn device(&self) -> std::cell::Ref<'_, D> {
        self.dev.borrow()
    }
    pub fn device_mut(&mut self) -> &mut D {
        self.dev.get_mut()
    }
    pub fn caps(&self) -> &HcaCaps {
        &self.caps
    }
    pub fn config(&self) -> &DevxConfig {
        &self.cfg
    }

    fn qp(&self, qp: Qpn) -> Result<&QpSlot, DevxError> {
        self.qps.get(&qp.get()).ok_or(DevxError::UnknownQp(qp.get()))
    }
    fn qp_mut(&mut self, qp: Qpn) -> Result<&mut QpSlot, DevxError> {
        self.qps.get_mut(&qp.get()).ok_or(DevxError::UnknownQp(qp.get()))
    }

    /// A CQ of `log_cqes` entries; `overrun_ignore` for a CQ a chain's WAITs watch.
    fn create_cq(&mut self, log_cqes: u8, overrun_ignore: bool) -> Result<u32, DevxError> {
        let mem = self.arena.take(CqSpec::mem_needed(log_cqes))?;
        // a fresh ring is hardware-owned: every op_own INVALID; the doorbell record zero
        let mut ring = vec![0u8; mem.len];
        cqe::init_ring(&mut ring[..CQE_SIZE << log_cqes]);
        let made = self.dev.get_mut().store(mem.addr, &ring).and_then(|()| {
            queue::create_cq(self.dev.get_mut(), &self.caps, self.uar, &CqSpec { log_cqes, overrun_ignore, mem })
        });
        match made {
            Ok(cq) => {
                self.cqs.insert(cq.cqn, CqSlot { devx: cq, mem, ci: 0 });
                Ok(cq.cqn)
            }
            Err(e) => {
                self.arena.give_back(mem);
                Err(e)
            }
        }
    }

    fn destroy_cq(&mut self, cqn: u32) -> Result<(), DevxError> {
        if let Some(c) = self.cqs.remove(&cqn) {
            queue::destroy_cq(self.dev.get_mut(), c.devx)?;
            self.arena.give_back(c.mem);
        }
        Ok(())
    }

    /// A QP with its own send CQ (and receive CQ when it has a receive queue). The CQs of a QP
    /// with a CORE-Direct role are exactly the CQs a chain's WAITs watch (`arm::cq_numbers`:
    /// the loop QP's send CQ, the management QP's send and receive CQs); they ignore overrun.
    fn create_qp(
        &mut self,
        domain: Domain,
        log_sq_wqebbs: u8,
        log_rq: Option<u8>,
        cd: CdRole,
        link: Link,
    ) -> Result<u32, DevxError> {
        let chain_cq = !cd.is_empty();
        let cq_snd = self.create_cq(self.cfg.log_cqes, chain_cq)?;
        let cq_rcv = match log_rq.map(|_| self.create_cq(self.cfg.log_cqes, chain_cq)).transpose() {
            Ok(c) => c,
            Err(e) => {
                let _ = self.destroy_cq(cq_snd);
                return Err(e);
            }
        };
        let undo = |me: &mut Self| {
            let _ = me.destroy_cq(cq_snd);
            if let Some(c) = cq_rcv {
                let _ = me.destroy_cq(c);
            }
        };
        let mut spec = QpSpec {
            log_sq_wqebbs,
            log_rq,
            log_rq_stride: self.cfg.log_rq_stride,
            cd,
            cqn_snd: cq_snd,
            cqn_rcv: cq_rcv.unwrap_or(cq_snd),
            pd: self.dev.get_mut().domain_pdn(domain),
            mem: MemRange { addr: 0, len: 0 },
        };
        let mem = match self.arena.take(spec.mem_needed()) {
            Ok(m) => m,
            Err(e) => {
                undo(self);
                return Err(e);
            }
        };
        spec.mem = mem;
        let made = self
            .dev
            .get_mut()
            .store(mem.addr, &vec![0u8; mem.len])
            .and_then(|()| queue::create_qp(self.dev.get_mut(), &self.caps, self.uar, &spec));
        let devx = match made {
            Ok(q) => q,
            Err(e) => {
                self.arena.give_back(mem);
                undo(self);
                return Err(e);
            }
        };
        self.qps.insert(
            devx.qpn,
            QpSlot {
                devx,
                link,
                state: QpState::Reset,
                used: false,
                managed: cd.contains(CdRole::SLAVE_SEND),
                sq_pi: WqeIndex::new(0),
                sq_ci: WqeIndex::new(0),
                posted: VecDeque::new(),
                prev: PrevWqe::Other,
                chain: None,
                rq_head: 0,
                rq_wr_ids: VecDeque::new(),
                chain_recv: None,
                chain_publishes: false,
                mem,
                cq_snd,
                cq_rcv,
            },
        );
        Ok(devx.qpn)
    }

    fn destroy_one(&mut self, qpn: u32) -> Result<(), DevxError> {
        let Some(q) = self.qps.remove(&qpn) else { return Ok(()) };
        queue::destroy_qp(self.dev.get_mut(), q.devx)?;
        self.arena.give_back(q.mem);
        self.destroy_cq(q.cq_snd)?;
        if let Some(c) = q.cq_rcv {
            self.destroy_cq(c)?;
        }
        Ok(())
    }

    /// RST → INIT → RTR → RTS with the attributes `a` and the next hop's MAC.
    fn connect_with(&mut self, qpn: u32, a: &CmQpAttr, rmac: [u8; 6]) -> Result<(), DevxError> {
        let devx = self.qps.get(&qpn).ok_or(DevxError::UnknownQp(qpn))?.devx;
        cm::connect(self.dev.get_mut(), &devx, a, self.caps.log_max_msg, rmac)?;
        if let Some(q) = self.qps.get_mut(&qpn) {
            q.state = QpState::Rts;
        }
        Ok(())
    }

    /// To the other end of a loopback pair on this port.
    fn connect_loopback(&mut self, qpn: u32, peer: u32) -> Result<(), DevxError> {
        let (a, mac) = (CmQpAttr::to_self(&self.path, peer), self.path.mac);
        self.connect_with(qpn, &a, mac)
    }

    /// A CN-facing QP in the CN-facing domain, to be connected by [`Self::connect_cn_qp`]:
    /// with `managed_send_depth` a chain's management QP (all three CORE-Direct roles, a
    /// send ring of exactly that many WQEBBs — `MemoryNode::chain_ring_depths` in mlx5 form),
    /// otherwise an access QP. Both have a receive queue.
    pub fn create_cn_qp(&mut self, managed_send_depth: Option<u32>) -> Result<Qpn, DevxError> {
        let (log_sq, cd) = match managed_send_depth {
            Some(d) => {
                (log2_exact("management send ring", d)?, CdRole::MASTER | CdRole::SLAVE_SEND | CdRole::SLAVE_RECEIVE)
            }
            None => (self.cfg.log_sq_wqebbs, CdRole::empty()),
        };
        let q = self.create_qp(Domain::CnFacing, log_sq, Some(self.cfg.log_rq), cd, Link::Cn { attr: None })?;
        Qpn::new(q).map_err(|_| DevxError::UnknownQp(q))
    }

    /// Connect a CN-facing QP with rdma_cm's attributes (`rdma_init_qp_attr` for INIT / RTR /
    /// RTS folded into one [`CmQpAttr`]) and the next hop's MAC; then `rdma_accept` with
    /// `conn_param.qp_num` = this QP's number (`ffi::accept_external`).
    pub fn connect_cn_qp(&mut self, qp: Qpn, attr: &CmQpAttr, rmac: [u8; 6]) -> Result<(), DevxError> {
        let s = self.qp_mut(qp)?;
        if !matches!(s.link, Link::Cn { .. }) {
            return Err(DevxError::NotCnFacing(qp.get()));
        }
        s.link = Link::Cn { attr: Some((*attr, rmac)) };
        self.connect_cn(qp.get())
    }

    /// Take a new path for a connected CN-facing QP (a rejoin: rdma_cm's attributes of the CN's
    /// new connection) without touching the device: the next [`DataPath::reset_qp`] — the
    /// repair of the QP's chain — resets the QP and connects it on this path.
    pub fn set_cn_path(&mut self, qp: Qpn, attr: &CmQpAttr, rmac: [u8; 6]) -> Result<(), DevxError> {
        let s = self.qp_mut(qp)?;
        if !matches!(s.link, Link::Cn { attr: Some(_) }) {
            return Err(if matches!(s.link, Link::Cn { .. }) {
                DevxError::NotConnected(qp.get())
            } else {
                DevxError::NotCnFacing(qp.get())
            });
        }
        s.link = Link::Cn { attr: Some((*attr, rmac)) };
        // connected to another peer now: the next reset must not leave it as it is
        s.used = true;
        Ok(())
    }

    fn connect_cn(&mut self, qpn: u32) -> Result<(), DevxError> {
        let s = self.qps.get(&qpn).ok_or(DevxError::UnknownQp(qpn))?;
        let Link::Cn { attr: Some((a, rmac)) } = s.link else { return Err(DevxError::NotConnected(qpn)) };
        self.connect_with(qpn, &a, rmac)
    }

    /// Poll the CQ `cqn` once; `None` when empty.
    fn next_cqe(&mut self, cqn: u32) -> Result<Option<Cqe>, DevxError> {
        let c = self.cqs.get(&cqn).ok_or(DevxError::UnknownCq(cqn))?;
        let (log, ci, ring) = (c.devx.log_cqes, c.ci, c.devx.ring);
        let slot = ring.addr + (ci as usize & ((1usize << log) - 1)) * CQE_SIZE;
        let mut b = [0u8; CQE_SIZE];
        self.dev.get_mut().read_mem(slot, &mut b)?;
        if cqe::parse(&b, log, ci).is_none() {
            return Ok(None);
        }
        // owned by software: read the whole entry again after the barrier read_mem ends with
        // (the device writes op_own last)
        self.dev.get_mut().read_mem(slot, &mut b)?;
        let e = cqe::parse(&b, log, ci);
        if let Some(c) = self.cqs.get_mut(&cqn) {
            c.ci = c.ci.wrapping_add(1);
        }
        Ok(e)
    }

    fn update_ci(&mut self, cqn: u32) {
        if let Some(c) = self.cqs.get(&cqn) {
            doorbell::update_cq_ci(self.dev.get_mut(), &c.devx, c.ci);
        }
    }

    /// Consume every CQE the QP's CQs hold (after it left RTS: nothing more is coming).
    fn drain(&mut self, qpn: u32) -> Result<(), DevxError> {
        let Some(q) = self.qps.get(&qpn) else { return Ok(()) };
        for cqn in [Some(q.cq_snd), q.cq_rcv].into_iter().flatten() {
            while self.next_cqe(cqn)?.is_some() {}
            self.update_ci(cqn);
        }
        Ok(())
    }

    /// 2RST one QP, drain it, zero its software state.
    fn reset_one(&mut self, qpn: u32) -> Result<(), DevxError> {
        let q = self.qps.get(&qpn).ok_or(DevxError::UnknownQp(qpn))?;
        let (obj, devx) = (q.devx.obj, q.devx);
        let input = prm_qp::qp_2rst_in(qpn)?;
        let mut out = [0u8; prm_qp::MODIFY_QP_OUT_LEN];
        self.dev.get_mut().obj_modify("2RST_QP", obj, &input, &mut out)?;
        omw_core::mlx5::prm::check_status(omw_core::mlx5::prm::op::TO_RST_QP, &out)
            .map_err(|e| super::caps::command_error("2RST_QP", e))?;
        self.drain(qpn)?;
        // the doorbell record restarts with the queue (rdma-core zeroes it in mlx5_modify_qp
        // on a transition to RESET: providers/mlx5/verbs.c v44.0)
        self.dev.get_mut().store(devx.dbr_addr, &[0u8; 8])?;
        if let Some(q) = self.qps.get_mut(&qpn) {
            q.state = QpState::Reset;
            q.used = false;
            q.sq_pi = WqeIndex::new(0);
            q.sq_ci = WqeIndex::new(0);
            q.posted.clear();
            q.prev = PrevWqe::Other;
            q.chain = None;
            q.rq_head = 0;
            q.rq_wr_ids.clear();
            q.chain_recv = None;
            q.chain_publishes = false;
        }
        Ok(())
    }

    fn post_encoded(&mut self, qpn: u32, w: &Wqe) -> Result<(), DevxError> {
        let q = self.qps.get(&qpn).ok_or(DevxError::UnknownQp(qpn))?;
        if q.managed || q.chain.is_some() {
            return Err(DevxError::ManagedQueue(qpn));
        }
        let ring = q.devx.sq.len / WQEBB;
        let pi = q.sq_pi;
        let n = omw_core::mlx5::wqebb::wqebbs(encode::ds_of(w));
        let slot = pi.slot(ring);
        let pad = if slot + n > ring { ring - slot } else { 0 };
        let used = q.sq_pi.since(q.sq_ci) as usize;
        if used + pad + n > ring {
            return Err(DevxError::SendQueueFull { qpn, need: pad + n, free: ring - used });
        }
        let (sq, devx, prev) = (q.devx.sq, q.devx, q.prev);
        let e = encode::encode(w, pi.add(pad as u16), qpn, prev, &mut Unmanaged)?;
        // NOPs to the ring's end: a WQE's segments stay contiguous (docs/MLX5.md). After a UMR
        // they carry its small fence as well as the WQE they precede, so that nothing of the
        // queue runs before the UMR completed.
        let mut at = pi;
        for _ in 0..pad {
            let mut nop = Wqe::nop();
            nop.flags = WqeFlags::empty();
            let b = encode::encode(&nop, at, qpn, prev, &mut Unmanaged)?;
            self.dev.get_mut().write_mem(sq.addr + at.slot(ring) * WQEBB, b.bytes())?;
            at = at.add(1);
        }
        self.dev.get_mut().write_mem(sq.addr + at.slot(ring) * WQEBB, e.bytes())?;
        let next = at.add(n as u16);
        let mut ctrl = [0u8; 16];
        ctrl.copy_from_slice(&e.bytes()[..16]);
        doorbell::ring_sq(self.dev.get_mut(), &devx, next, &ctrl);
        if let Some(q) = self.qps.get_mut(&qpn) {
            q.posted.push_back(Posted { index: at.get(), wqebbs: n as u16, wr_id: w.wr_id, opcode: w.opcode });
            q.sq_pi = next;
            q.prev = encode::prev_of(w);
            q.used = true;
        }
        Ok(())
    }

    /// The send completion a CQE with `counter` stands for on `qpn`.
    fn send_completion(&mut self, qpn: u32, counter: u16) -> Option<(u64, Opcode)> {
        let q = self.qps.get_mut(&qpn)?;
        if let Some(slots) = &q.chain {
            let n = slots.len().max(1);
            return slots.get(counter as usize % n).copied();
        }
        // unsignaled WQEs before the one completed finished with it
        let pos = q.posted.iter().position(|p| p.index == counter)?;
        let p = q.posted.drain(..=pos).next_back()?;
        q.sq_ci = WqeIndex::new(p.index).add(p.wqebbs);
        Some((p.wr_id, p.opcode))
    }
}

fn log2_exact(what: &'static str, n: u32) -> Result<u8, DevxError> {
    if n == 0 || !n.is_power_of_two() {
        return Err(DevxError::NotPowerOfTwo { what, value: n });
    }
    Ok(n.trailing_zeros() as u8)
}

impl<D: DevxDevice> DataPath for DevxBackend<D> {
    type Error = DevxError;
    fn capabilities(&self) -> Capabilities {
        // a DEVX device fetches the mlx5 form: the chains are laid out for it; a chain QP's
        // receive doorbell record lies in the ring arena the MN-private ring MR covers
        // (`OffloadRings::recv_doorbell`)
        let publish =
            if self.cfg.chains_publish_receives { Capabilities::RECV_DOORBELL_RECORD } else { Capabilities::empty() };
        self.cfg.capabilities | Capabilities::WQE_FORM_MLX5 | publish
    }
    fn post_send(&mut self, qp: Qpn, wqe: &Wqe) -> Result<(), DevxError> {
        self.post_encoded(qp.get(), wqe)
    }
    fn post_recv(&mut self, qp: Qpn, wqe: &RecvWqe) -> Result<(), DevxError> {
        let q = self.qp(qp)?;
        if q.chain_recv.is_some() {
            return Err(DevxError::ManagedQueue(qp.get()));
        }
        let stride = 16usize << q.devx.log_rq_stride;
        let entries = q.devx.rq.len / stride;
        if entries == 0 {
            return Err(DevxError::NoReceiveQueue(qp.get()));
        }
        if q.rq_wr_ids.len() >= entries {
            return Err(DevxError::ReceiveQueueFull { qpn: qp.get(), entries });
        }
        // write_recvs refuses a scatter list wider than the stride
        let sges: Vec<omw_core::chain::mlx5::RecvSge> = wqe
            .sges
            .iter()
            .map(|s| omw_core::chain::mlx5::RecvSge { addr: s.addr, length: s.length, lkey: s.lkey })
            .collect();
        let (devx, head) = (q.devx, q.rq_head);
        let head = arm::write_recvs(self.dev.get_mut(), &devx, head, 1, &sges)?;
        doorbell::ring_rq(self.dev.get_mut(), &devx, head);
        let q = self.qp_mut(qp)?;
        q.rq_head = head;
        q.rq_wr_ids.push_back(wqe.wr_id);
        q.used = true;
        Ok(())
    }
    fn poll_cq(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize, DevxError> {
        let q = self.qp(qp)?;
        let cqn = match queue {
            QueueSel::Send => q.cq_snd,
            QueueSel::Recv => match q.cq_rcv {
                Some(c) => c,
                None => return Ok(0),
            },
        };
        let mut n = 0;
        let mut handed_back = false;
        while n < out.len() {
            let Some(c) = self.next_cqe(cqn)? else { break };
            let status = c.error.map_or(WcStatus::Success, |(s, _, _)| wc_status_of(s));
            let q = self.qp_mut(qp)?;
            q.used = true;
            if !status.is_ok() {
                q.state = QpState::Err;
            }
            let mut done = Completion { status, qpn: qp, byte_len: c.byte_cnt, ..Completion::EMPTY };
            match queue {
                QueueSel::Send => {
                    let Some((wr_id, op)) = self.send_completion(qp.get(), c.wqe_counter.get()) else { continue };
                    done.wr_id = wr_id;
                    done.opcode = WcOpcode::Send(op);
                }
                QueueSel::Recv => {
                    let q = self.qp_mut(qp)?;
                    done.wr_id = match q.chain_recv {
                        // the slot's bytes are still the chain's receive: hand it back — unless
                        // it completed in error: the QP is in ERR, where a posted receive is
                        // flushed at once, so handing flushes back would feed the MN's poll
                        // a new flush for every one it takes (found by the ConnectX double)
                        Some(w) if status.is_ok() && !q.chain_publishes => {
                            q.rq_head = q.rq_head.wrapping_add(1);
                            handed_back = true;
                            w
                        }
                        Some(w) => w,
                        None => q.rq_wr_ids.pop_front().unwrap_or(0),
                    };
                    match c.opcode {
                        cqe_op::RESP_WR_IMM => {
                            done.opcode = WcOpcode::RecvRdmaWithImm;
                            done.imm = Some(c.imm);
                        }
                        cqe_op::RESP_SEND_IMM => done.imm = Some(c.imm),
                        // a SEND_WITH_INV's responder CQE carries the invalidated rkey in
                        // imm_inval_pkey, big-endian (rdma-core providers/mlx5/cq.c
                        // handle_responder: `wc->invalidated_rkey = be32toh(cqe->imm_inval_pkey)`,
                        // as also in SPDK's mlx5 copy of it); `c.imm` is already in host order.
                        // The MN checks it against the sender's windows (Event::RemoteInvalidation).
                        cqe_op::RESP_SEND_INV => done.invalidated = Some(Rkey(c.imm)),
                        _ => {}
                    }
                }
            }
            out[n] = done;
            n += 1;
        }
        self.update_ci(cqn);
        if handed_back {
            let q = self.qp(qp)?;
            let (devx, head) = (q.devx, q.rq_head);
            doorbell::ring_rq(self.dev.get_mut(), &devx, head);
        }
        Ok(n)
    }
    fn enable(&mut self, qp: Qpn, _queue: QueueSel, _count: u64) -> Result<(), DevxError> {
        // unmanaged queues run what is posted (post_send rang the doorbell); a chain's queues
        // are enabled by the chain itself and by arm_mlx5 — a host-side ENABLE has no DEVX form
        let q = self.qp(qp)?;
        if q.managed {
            return Err(DevxError::ManagedQueue(qp.get()));
        }
        Ok(())
    }
    fn reset_qp(&mut self, qp: Qpn) -> Result<(), DevxError> {
        let q = self.qp(qp)?;
        let (used, state, devx, link) = (q.used, q.state, q.devx, q.link);
        // a QP the MN never used is left alone if the device still has it in RTS — not on
        // the driver's word alone: a CN's request the QP refused as responder moves it to ERR
        // without the MN polling anything of it (found by the ConnectX double: such a QP
        // stayed dead through every reset)
        if !used && state == QpState::Rts && queue::query_state(self.dev.get_mut(), &devx)? == QpState::Rts {
            return Ok(());
        }
        match link {
            Link::Loopback { peer, .. } => {
                self.reset_one(qp.get())?;
                self.reset_one(peer)?;
                self.connect_loopback(qp.get(), peer)?;
                self.connect_loopback(peer, qp.get())
            }
            Link::Cn { .. } => {
                self.reset_one(qp.get())?;
                self.connect_cn(qp.get())
            }
        }
    }
    fn destroy_qp(&mut self, qp: Qpn) -> Result<(), DevxError> {
        let q = self.qp(qp)?;
        if let Link::Loopback { peer, .. } = q.link {
            self.destroy_one(peer)?;
        }
        self.destroy_one(qp.get())
    }
    fn qp_state(&self, qp: Qpn) -> Result<QpState, DevxError> {
        Ok(self.qp(qp)?.state)
    }
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> Result<(), DevxError> {
        self.dev.borrow().read_mem(addr as usize, buf)
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<(), DevxError> {
        self.dev.get_mut().store(addr as usize, data)
    }
    fn outstanding(&self, qp: Qpn, queue: QueueSel) -> Option<u64> {
        let q = self.qp(qp).ok()?;
        Some(match queue {
            QueueSel::Send => q.posted.len() as u64,
            QueueSel::Recv => q.rq_wr_ids.len() as u64,
        })
    }
}

impl<D: DevxDevice> Provision for DevxBackend<D> {
    fn reg_mr(&mut self, domain: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys, DevxError> {
        let mem = MemRange { addr: addr as usize, len: len as usize };
        if !self.regions.iter().any(|r| mem.addr >= r.addr && mem.addr + mem.len <= r.addr + r.len) {
            return Err(DevxError::OutsideMemory { addr: mem.addr, len: mem.len });
        }
        self.dev.get_mut().reg_mr(domain, mem, access)
    }
    /// A type-2 window as a DEVX mkey in the CN-facing PD (`omw_core::mlx5::prm::mkey`): the
    /// only kind of window DEVX lets the MN query afterwards ([`WindowState`]).
    fn alloc_mw(&mut self) -> Result<Rkey, DevxError> {
        let key = self.next_window_key;
        let input = mkey::create_window_in(&mkey::CreateWindow { pdn: self.dev.get_mut().pdn(), key })?;
        let mut out = [0u8; mkey::CREATE_MKEY_OUT_LEN];
        let obj = self.dev.get_mut().obj_create("CREATE_MKEY", &input, &mut out)?;
        let made = mkey::created_mkey_index(&out).map_err(DevxError::from).and_then(|index| {
            Rkey::new(index, key)
                .map_err(|_| DevxError::WindowAnswer { index, error: Mlx5Error::MkeyNotAWindow { index } })
        });
        match made {
            Ok(rkey) if !self.windows.contains_key(&rkey.index()) => {
                self.windows.insert(rkey.index(), obj);
                self.next_window_key = key.wrapping_add(1);
                Ok(rkey)
            }
            Ok(rkey) => {
                let _ = self.dev.get_mut().obj_destroy(obj);
                let index = rkey.index();
                Err(DevxError::WindowAnswer { index, error: Mlx5Error::MkeyNotAWindow { index } })
            }
            Err(e) => {
                let _ = self.dev.get_mut().obj_destroy(obj);
                Err(e)
            }
        }
    }
    fn alloc_memory(&mut self, len: u64, align: u64) -> Result<u64, DevxError> {
        let len = usize::try_from(len).map_err(|_| DevxError::OutsideMemory { addr: 0, len: usize::MAX })?;
        let align = usize::try_from(align).unwrap_or(PAGE).max(PAGE);
        let r = self.dev.get_mut().alloc_mem(len, align)?;
        self.regions.push(r);
        Ok(r.addr as u64)
    }
    fn create_loopback_qp(&mut self, domain: Domain, managed_send_depth: Option<u32>) -> Result<Qpn, DevxError> {
        let (log_sq, cd) = match managed_send_depth {
            Some(d) => (log2_exact("loop send ring", d)?, CdRole::MASTER | CdRole::SLAVE_SEND),
            None => (self.cfg.log_sq_wqebbs, CdRole::empty()),
        };
        let a = self.create_qp(domain, log_sq, None, cd, Link::Loopback { peer: 0 })?;
        // the responder end only answers READs, WRITEs and atomics: a one-WQEBB send ring
        let b = match self.create_qp(domain, 0, None, CdRole::empty(), Link::Loopback { peer: a }) {
            Ok(b) => b,
            Err(e) => {
                let _ = self.destroy_one(a);
                return Err(e);
            }
        };
        if let Some(q) = self.qps.get_mut(&a) {
            q.link = Link::Loopback { peer: b };
        }
        let connected = self.connect_loopback(a, b).and_then(|()| self.connect_loopback(b, a));
        if let Err(e) = connected {
            let _ = self.destroy_one(b);
            let _ = self.destroy_one(a);
            return Err(e);
        }
        Qpn::new(a).map_err(|_| DevxError::UnknownQp(a))
    }
}

impl<D: DevxDevice> OffloadRings for DevxBackend<D> {
    fn ring_base(&self, qp: Qpn, queue: QueueSel) -> Result<u64, DevxError> {
        let q = self.qp(qp)?;
        Ok(match queue {
            QueueSel::Send => q.devx.sq.addr as u64,
            QueueSel::Recv => q.devx.rq.addr as u64,
        })
    }
    fn ring_keys(&self, domain: Domain) -> Result<MrKeys, DevxError> {
        Ok(self.ring_mrs[domain_slot(domain)])
    }
    /// Not read from the device yet: QUERY_QP's `hw_sq_wqebb_counter` (16 bits, wrapping) is
    /// the candidate, unverified on hardware. Until then the offloaded MN checks quotas by its
    /// audit of the MWTable alone.
    fn send_wqes_executed(&self, _: Qpn) -> Option<u64> {
        None
    }
    /// A chain QP's receive doorbell record (`dbrec[MLX5_RCV_DBR]`), in the QP's umem inside
    /// the ring arena, which the MN-private ring MR covers: the chain's loop QP writes it to
    /// publish the next receive. Only queues a chain gates (`cd_slave_receive`).
    fn recv_doorbell(&self, qp: Qpn) -> Result<Option<omw_core::device::RecvDoorbell>, DevxError> {
        let q = self.qp(qp)?;
        if !q.devx.cd.contains(omw_core::mlx5::prm::qp::CdRole::SLAVE_RECEIVE) {
            return Ok(None);
        }
        let slots = (q.devx.rq.len / (16usize << q.devx.log_rq_stride)) as u32;
        Ok(Some(omw_core::device::RecvDoorbell { addr: q.devx.dbr_addr as u64, slots }))
    }
}

/// A window's state is read from the device, one QUERY_MKEY per question: its mkey context says
/// whether it is free, which QP it is bound to under which key, and what it covers.
///
/// `None` means "unknown" — an rkey whose index is no window of this backend, or a query the
/// device did not answer (the command failed, or its answer is no window binding). The core's
/// audit reads "unknown" as "nothing proven wrong" and does not reclaim. That is deliberate:
/// nothing a CN sends can make QUERY_MKEY on the MN's own DEVX object fail, so a failure is a
/// broken device or driver, which taking memory away from an innocent CN would not fix; but it
/// must not pass silently either, because while it lasts a misbinding stays unseen. Every
/// failure is counted and the last error kept ([`DevxBackend::window_query_failures`],
/// [`DevxBackend::take_window_query_error`]) for the operator to see.
impl<D: DevxDevice> WindowState for DevxBackend<D> {
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        let (index, c) = self.query_window(rkey)?;
        match c.binding(index) {
            Ok(b) => Some(b),
            Err(error) => self.window_query_failed(DevxError::WindowAnswer { index, error }),
        }
    }
    /// Only for the window's current key, as the model answers (a stale rkey covers nothing).
    fn mw_span(&self, rkey: Rkey) -> Option<(u64, u64)> {
        let (_, c) = self.query_window(rkey)?;
        if c.key != rkey.key() {
            return None;
        }
        c.span()
    }
}

impl<D: DevxDevice> DevxBackend<D> {
    /// QUERY_MKEY of the window `rkey` names (any key of its index).
    fn query_window(&self, rkey: Rkey) -> Option<(u32, mkey::MkeyContext)> {
        let index = rkey.index();
        let obj = *self.windows.get(&index)?;
        let asked = mkey::query_mkey_in(index).map_err(DevxError::from).and_then(|input| {
            let mut out = [0u8; mkey::QUERY_MKEY_OUT_LEN];
            let mut dev = self.dev.try_borrow_mut().map_err(|_| DevxError::DeviceBusy)?;
            dev.obj_query("QUERY_MKEY", obj, &input, &mut out)?;
            mkey::parse_query_mkey_out(&out).map_err(|error| DevxError::WindowAnswer { index, error })
        });
        match asked {
            Ok(c) => Some((index, c)),
            Err(e) => self.window_query_failed(e),
        }
    }
    fn window_query_failed<T>(&self, e: DevxError) -> Option<T> {
        self.window_query_failures.set(self.window_query_failures.get() + 1);
        *self.last_window_query_error.borrow_mut() = Some(e);
        None
    }
    /// How many window queries the device has not answered so far (each left the audit blind
    /// to that window for that look).
    pub fn window_query_failures(&self) -> u64 {
        self.window_query_failures.get()
    }
    /// The last unanswered window query's error, taken.
    pub fn take_window_query_error(&self) -> Option<DevxError> {
        self.last_window_query_error.borrow_mut().take()
    }
    /// Destroy every window's mkey (DEVX builds DESTROY_MKEY for it). The first failure is
    /// returned after trying them all.
    pub fn destroy_windows(&mut self) -> Result<(), DevxError> {
        let mut first = Ok(());
        for (_, obj) in std::mem::take(&mut self.windows) {
            if let Err(e) = self.dev.get_mut().obj_destroy(obj) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }
}

/// The windows go before the device's PD does (the device is dropped after this).
impl<D: DevxDevice> Drop for DevxBackend<D> {
    fn drop(&mut self) {
        let _ = self.destroy_windows();
    }
}

impl<D: DevxDevice> Mlx5Arm for DevxBackend<D> {
    fn cq_numbers(&self, loop_qp: Qpn, mgmt_qp: Qpn) -> Option<[u32; 3]> {
        Some(arm::cq_numbers(&self.qp(loop_qp).ok()?.devx, &self.qp(mgmt_qp).ok()?.devx))
    }
    fn cq_producer_indices(&self, loop_qp: Qpn, mgmt_qp: Qpn) -> [u32; 3] {
        let ci = |cqn: Option<u32>| cqn.and_then(|c| self.cqs.get(&c)).map_or(0, |c| c.ci);
        self.cq_numbers(loop_qp, mgmt_qp).map_or([0; 3], |n| n.map(|c| ci(Some(c))))
    }
    fn arm_mlx5(&mut self, chain: &Mlx5Chain, _recv_copies: u32) -> Option<Result<(), DevxError>> {
        Some(self.arm_chain(chain))
    }
}

impl<D: DevxDevice> DevxBackend<D> {
    fn arm_chain(&mut self, chain: &Mlx5Chain) -> Result<(), DevxError> {
        let [lq, mq] = chain.qpns;
        let (l, m) =
            (self.qps.get(&lq).ok_or(DevxError::UnknownQp(lq))?, self.qps.get(&mq).ok_or(DevxError::UnknownQp(mq))?);
        for q in [l, m] {
            if q.used || q.state != QpState::Rts {
                return Err(DevxError::NotFresh { qpn: q.devx.qpn, state: q.state });
            }
        }
        let (ldx, mdx) = (l.devx, m.devx);
        let cq = |c: u32| self.cqs.get(&c).map(|s| s.devx).ok_or(DevxError::UnknownCq(c));
        let cqs = [cq(ldx.cqn_snd)?, cq(mdx.cqn_snd)?, cq(mdx.cqn_rcv)?];
        // every receive slot holds the chain's receive WQE; RECV_EN gates which may be used
        let entries = (mdx.rq.len / (16usize << mdx.log_rq_stride)) as u32;
        let qps = ChainQps { loop_qp: &ldx, mgmt_qp: &mdx, cqs: [&cqs[0], &cqs[1], &cqs[2]] };
        let armed = arm::arm_chain(self.dev.get_mut(), chain, &qps, entries)?;
        for (r, ring) in [Ring::Loop, Ring::Mgmt].into_iter().enumerate() {
            let mut ops = vec![Opcode::Nop; chain.ring_wqebbs(ring)];
            for p in chain.placed[r].iter() {
                let op = chain.decode_at(ring, p.pi).map(|d| opcode_of(&d.op)).unwrap_or(Opcode::Nop);
                for j in 0..p.wqebbs as usize {
                    if let Some(o) = ops.get_mut(p.pi as usize + j) {
                        *o = op;
                    }
                }
            }
            let slots: ChainSlots = armed.wr_ids[r].iter().copied().zip(ops).collect();
            let qpn = chain.qpns[r];
            if let Some(q) = self.qps.get_mut(&qpn) {
                q.chain = Some(slots);
                q.sq_pi = armed.sq_pi[r];
                q.used = true;
            }
        }
        if let Some(q) = self.qps.get_mut(&mq) {
            q.rq_head = armed.rq_head;
            q.chain_recv = Some(omw_core::chain::builder::chain_wr_id(chain.kind, 0, 0xFF));
            q.chain_publishes = chain.published_at_arm().is_some();
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "backend_tests.rs"]
mod tests;
