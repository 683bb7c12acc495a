//! CQs and QPs created by PRM command, with their rings in registered user memory.
//!
//! The sequences follow UCX (src/uct/ib/mlx5/dv/ib_mlx5_dv.c, `uct_ib_mlx5_devx_create_cq_common`
//! and `uct_ib_mlx5_devx_create_qp_common`): register the ring memory as a umem, CREATE_CQ /
//! CREATE_QP naming the umem for both the ring and the doorbell record, then
//! RST2INIT → INIT2RTR → RTR2RTS by `obj_modify`. Memory layout of a QP's umem, as mlx5
//! expects it (rdma-core providers/mlx5/verbs.c: the receive queue at offset 0, the send queue
//! after it): `[RQ | SQ | doorbell record (64 B: receive word at 0, send word at 4)]`.
//! A failure undoes what was created, newest first.

use super::api::{DevxApi, MemRange, ObjHandle, UarHandle, UmemHandle, UMEM_ACCESS_LOCAL_WRITE};
use super::caps::command_error;
use super::DevxError;
use omw_core::mlx5::prm::cq::{self, CreateCq};
use omw_core::mlx5::prm::hca_cap::HcaCaps;
use omw_core::mlx5::prm::qp::{self, CdRole, CreateQp, Init2Rtr, Rst2Init, Rtr2Rts};
use omw_core::mlx5::wqebb::WQEBB;

/// Bytes of a CQE (`cqe_sz` 0).
pub const CQE_SIZE: usize = 64;
/// Bytes reserved for a doorbell record (one cache line).
pub const DBR_SIZE: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CqSpec {
    /// log2 of the number of CQEs.
    pub log_cqes: u8,
    /// `cqc.oi` (`omw_core::mlx5::prm::cq::CreateCq::overrun_ignore`): every CQ a chain's
    /// WAITs watch.
    pub overrun_ignore: bool,
    /// `CQE_SIZE << log_cqes` bytes of ring, then [`DBR_SIZE`] bytes of doorbell record.
    pub mem: MemRange,
}

impl CqSpec {
    pub fn mem_needed(log_cqes: u8) -> usize {
        (CQE_SIZE << log_cqes) + DBR_SIZE
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DevxCq {
    pub obj: ObjHandle,
    pub cqn: u32,
    pub umem: UmemHandle,
    pub log_cqes: u8,
    pub ring: MemRange,
    pub dbr_addr: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct QpSpec {
    /// log2 of the send queue in WQEBBs.
    pub log_sq_wqebbs: u8,
    /// log2 of the receive queue in entries; `None`: no receive queue.
    pub log_rq: Option<u8>,
    /// Receive stride = 16 << `log_rq_stride` bytes.
    pub log_rq_stride: u8,
    pub cd: CdRole,
    pub cqn_snd: u32,
    pub cqn_rcv: u32,
    /// The protection domain's number (`qpc.pd`): the CN-facing PD or the MN-private one.
    pub pd: u32,
    pub mem: MemRange,
}

impl QpSpec {
    fn rq_bytes(&self) -> usize {
        self.log_rq.map_or(0, |l| (16usize << self.log_rq_stride) << l)
    }
    fn sq_bytes(&self) -> usize {
        WQEBB << self.log_sq_wqebbs
    }
    pub fn mem_needed(&self) -> usize {
        self.rq_bytes() + self.sq_bytes() + DBR_SIZE
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DevxQp {
    pub obj: ObjHandle,
    pub qpn: u32,
    pub umem: UmemHandle,
    pub uar: UarHandle,
    pub cd: CdRole,
    /// The CQs the send and receive queues report to (CREATE_QP's `cqn_snd` / `cqn_rcv`):
    /// arming checks that a chain's WAITs name exactly these.
    pub cqn_snd: u32,
    pub cqn_rcv: u32,
    /// Receive stride = 16 << `log_rq_stride` bytes (data segments per receive WQE = stride / 16).
    pub log_rq_stride: u8,
    pub rq: MemRange,
    pub sq: MemRange,
    pub dbr_addr: usize,
}

fn check_mem(what: &'static str, need: usize, mem: MemRange) -> Result<(), DevxError> {
    if mem.len < need {
        return Err(DevxError::MemTooSmall { what, need, got: mem.len });
    }
    Ok(())
}

fn check_log(what: &'static str, log2: u8, max: u8) -> Result<(), DevxError> {
    if log2 > max {
        return Err(DevxError::TooLarge { what, log2, device_max_log2: max });
    }
    Ok(())
}

/// log2(page size) − 12 for `qpc.log_page_size` / `cqc.log_page_size`: the rings are in one
/// umem the kernel maps page by page; 4 KiB pages give 0.
const LOG_PAGE_SIZE_4K: u8 = 0;

pub fn create_cq<A: DevxApi>(api: &mut A, caps: &HcaCaps, uar: UarHandle, spec: &CqSpec) -> Result<DevxCq, DevxError> {
    check_log("CQ size", spec.log_cqes, caps.log_max_cq_sz)?;
    let ring_len = CQE_SIZE << spec.log_cqes;
    check_mem("CQ", CqSpec::mem_needed(spec.log_cqes), spec.mem)?;
    let umem = api.umem_reg(spec.mem, UMEM_ACCESS_LOCAL_WRITE)?;
    let r = (|| {
        let eqn = api.query_eqn(0)?;
        let input = cq::create_cq_in(&CreateCq {
            log_cq_size: spec.log_cqes,
            uar_page: uar.page_id,
            eqn: u8::try_from(eqn)
                .map_err(|_| DevxError::Call { call: "mlx5dv_devx_query_eqn (EQN > 255)", errno: 0 })?,
            log_page_size: LOG_PAGE_SIZE_4K,
            umem_id: umem.umem_id,
            umem_offset: 0,
            dbr_umem_id: umem.umem_id,
            dbr_offset: ring_len as u64,
            overrun_ignore: spec.overrun_ignore,
        })?;
        let mut out = [0u8; cq::CREATE_CQ_OUT_LEN];
        let obj = api.obj_create("CREATE_CQ", &input, &mut out)?;
        match cq::created_cqn(&out) {
            Ok(cqn) => Ok((obj, cqn)),
            Err(e) => {
                let _ = api.obj_destroy(obj);
                Err(command_error("CREATE_CQ", e))
            }
        }
    })();
    match r {
        Ok((obj, cqn)) => Ok(DevxCq {
            obj,
            cqn,
            umem,
            log_cqes: spec.log_cqes,
            ring: MemRange { addr: spec.mem.addr, len: ring_len },
            dbr_addr: spec.mem.addr + ring_len,
        }),
        Err(e) => {
            let _ = api.umem_dereg(umem);
            Err(e)
        }
    }
}

pub fn create_qp<A: DevxApi>(api: &mut A, caps: &HcaCaps, uar: UarHandle, spec: &QpSpec) -> Result<DevxQp, DevxError> {
    check_log("send queue (WQEBBs)", spec.log_sq_wqebbs, caps.log_max_qp_sz)?;
    if let Some(l) = spec.log_rq {
        check_log("receive queue", l, caps.log_max_qp_sz)?;
    }
    check_mem("QP", spec.mem_needed(), spec.mem)?;
    let (rq_len, sq_len) = (spec.rq_bytes(), spec.sq_bytes());
    let dbr_off = rq_len + sq_len;
    let umem = api.umem_reg(spec.mem, UMEM_ACCESS_LOCAL_WRITE)?;
    let input = qp::create_qp_in(&CreateQp {
        pd: spec.pd,
        uar_page: uar.page_id,
        cqn_snd: spec.cqn_snd,
        cqn_rcv: spec.cqn_rcv,
        log_sq_size: spec.log_sq_wqebbs,
        log_rq_size: spec.log_rq,
        log_rq_stride: spec.log_rq_stride,
        log_page_size: LOG_PAGE_SIZE_4K,
        cd: spec.cd,
        wq_umem_id: umem.umem_id,
        wq_umem_offset: 0,
        dbr_umem_id: umem.umem_id,
        dbr_offset: dbr_off as u64,
        user_index: 0,
        ts_format: caps.qp_ts_format(),
    });
    let r = input.map_err(DevxError::from).and_then(|input| {
        let mut out = [0u8; qp::CREATE_QP_OUT_LEN];
        let obj = api.obj_create("CREATE_QP", &input, &mut out)?;
        match qp::created_qpn(&out) {
            Ok(qpn) => Ok((obj, qpn)),
            Err(e) => {
                let _ = api.obj_destroy(obj);
                Err(command_error("CREATE_QP", e))
            }
        }
    });
    match r {
        Ok((obj, qpn)) => Ok(DevxQp {
            obj,
            qpn,
            umem,
            uar,
            cd: spec.cd,
            cqn_snd: spec.cqn_snd,
            cqn_rcv: spec.cqn_rcv,
            log_rq_stride: spec.log_rq_stride,
            rq: MemRange { addr: spec.mem.addr, len: rq_len },
            sq: MemRange { addr: spec.mem.addr + rq_len, len: sq_len },
            dbr_addr: spec.mem.addr + dbr_off,
        }),
        Err(e) => {
            let _ = api.umem_dereg(umem);
            Err(e)
        }
    }
}

fn modify<A: DevxApi>(api: &mut A, command: &'static str, qp: &DevxQp, input: &[u8]) -> Result<(), DevxError> {
    let mut out = [0u8; qp::MODIFY_QP_OUT_LEN];
    api.obj_modify(command, qp.obj, input, &mut out)?;
    omw_core::mlx5::prm::check_status(u16::from_be_bytes([input[0], input[1]]), &out)
        .map_err(|e| command_error(command, e))
}

/// RST → INIT → RTR → RTS, in that order; stops at the first refusal. The QP numbers in the
/// parameters are replaced by `qp.qpn`.
pub fn connect<A: DevxApi>(
    api: &mut A,
    qp: &DevxQp,
    init: Rst2Init,
    rtr: Init2Rtr,
    rts: Rtr2Rts,
) -> Result<(), DevxError> {
    modify(api, "RST2INIT_QP", qp, &qp::rst2init_in(&Rst2Init { qpn: qp.qpn, ..init })?)?;
    modify(api, "INIT2RTR_QP", qp, &qp::init2rtr_in(&Init2Rtr { qpn: qp.qpn, ..rtr })?)?;
    modify(api, "RTR2RTS_QP", qp, &qp::rtr2rts_in(&Rtr2Rts { qpn: qp.qpn, ..rts })?)
}

/// QUERY_QP (`MLX5_CMD_OP_QUERY_QP` 0x50B): `mlx5_ifc_query_qp_in_bits` is 16 bytes with the
/// QP number at bit 0x48; `mlx5_ifc_query_qp_out_bits` holds the `qpc` at bit 0xc0, whose
/// `state` is its first 4 bits (DPDK drivers/common/mlx5/mlx5_prm.h, main 38f72e5; states
/// `MLX5_QP_STATE_*`, Linux include/linux/mlx5/qp.h: RST 0, INIT 1, RTR 2, RTS 3, SQER 4,
/// SQD 5, ERR 6).
pub const QUERY_QP: u16 = 0x50b;
const QUERY_QP_IN_LEN: usize = 16;
const QUERY_QP_OUT_LEN: usize = 272;

/// The state the device holds `qp` in — which can differ from the last one the driver set: a
/// responder error moves a QP to ERR without the driver polling anything of it.
pub fn query_state<A: DevxApi>(api: &mut A, qp: &DevxQp) -> Result<omw_core::device::QpState, DevxError> {
    use omw_core::device::QpState;
    use omw_core::mlx5::prm::{bits, Field, IN_OPCODE};
    let mut input = [0u8; QUERY_QP_IN_LEN];
    bits::set(&mut input, IN_OPCODE, QUERY_QP as u64)?;
    bits::set(&mut input, Field::new("qpn", 0x48, 0x18), qp.qpn as u64)?;
    let mut out = [0u8; QUERY_QP_OUT_LEN];
    api.obj_query("QUERY_QP", qp.obj, &input, &mut out)?;
    omw_core::mlx5::prm::check_status(QUERY_QP, &out).map_err(|e| command_error("QUERY_QP", e))?;
    Ok(match bits::get(&out, Field::new("qpc.state", 0xc0, 0x4))? {
        0 => QpState::Reset,
        1 => QpState::Init,
        2 => QpState::Rtr,
        3 => QpState::Rts,
        4 => QpState::Sqe,
        5 => QpState::Sqd,
        _ => QpState::Err,
    })
}

/// Destroy a QP, then its umem.
pub fn destroy_qp<A: DevxApi>(api: &mut A, qp: DevxQp) -> Result<(), DevxError> {
    api.obj_destroy(qp.obj)?;
    api.umem_dereg(qp.umem)
}

/// Destroy a CQ (after every QP using it), then its umem.
pub fn destroy_cq<A: DevxApi>(api: &mut A, cq: DevxCq) -> Result<(), DevxError> {
    api.obj_destroy(cq.obj)?;
    api.umem_dereg(cq.umem)
}
