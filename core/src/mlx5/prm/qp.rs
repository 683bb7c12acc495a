//! CREATE_QP (0x500) with the CORE-Direct roles, and the RST→INIT→RTR→RTS transitions
//! (0x502 / 0x503 / 0x504).
//!
//! Offsets: rdma-core v44.0 providers/mlx5/mlx5_ifc.h `struct mlx5_ifc_qpc_bits`,
//! `mlx5_ifc_ads_bits`, `mlx5_ifc_create_qp_in_bits` (qpc at bit 0xc0, `wq_umem_id` 0x840,
//! `wq_umem_valid` 0x860), `mlx5_ifc_rst2init_qp_in_bits` and its siblings (`qpn` at 0x48,
//! `opt_param_mask` 0x80, qpc at 0xc0, 272 bytes) and `create_qp_out` (`qpn` at 0x48), every
//! one the same in DPDK main 38f72e500b3b159eca3ba2f4ca0e46a26a7cb057
//! drivers/common/mlx5/mlx5_prm.h. Two fields only DPDK's `create_qp_in` names (rdma-core has
//! `reserved_at_40` and `reserved_at_800` there): `qpc_ext` at 0x40 and `wq_umem_offset` at
//! 0x800 (64 bits). The command sequence and the values (st RC = 0, pm_state MIGRATED = 3,
//! rq_type 3 = no RQ, `log_page_size` relative to 4 KiB) follow UCX
//! src/uct/ib/mlx5/dv/ib_mlx5_dv.c `uct_ib_mlx5_devx_create_qp_common` and DPDK
//! drivers/common/mlx5/mlx5_devx_cmds.c `mlx5_devx_cmd_create_qp`, which also sets
//! `qpc.ts_format` (0x58, 2 bits) from the capability. The cd bits: qpc `cd_slave_receive`
//! 0x49d, `cd_slave_send` 0x49e, `cd_master` 0x49f.

use super::{bits, op, Field, IN_OPCODE};
use crate::mlx5::Mlx5Error;

pub const CREATE_QP_IN_LEN: usize = 272;
pub const CREATE_QP_OUT_LEN: usize = 16;
pub const MODIFY_QP_IN_LEN: usize = 272;
pub const MODIFY_QP_OUT_LEN: usize = 16;
/// `2RST_QP` input: the header and `qpn` at 0x48 only, 0x80 bits (DPDK main
/// `38f72e500b3b`, drivers/common/mlx5/mlx5_prm.h `struct mlx5_ifc_2rst_qp_in_bits`; its
/// field named `reserved_at_80` lies at bit 0x40 by the struct's own widths). rdma-core's
/// mlx5_ifc.h defines the opcodes but not the struct.
pub const QP_2RST_IN_LEN: usize = 16;
/// Where the QP context lies in CREATE_QP and the modify commands.
pub const QPC_BASE: u32 = 0xc0;

/// QP context fields, relative to the qpc.
pub mod qpc {
    use super::Field;
    pub const ST: Field = Field::new("qpc.st", 0x8, 0x8);
    pub const PM_STATE: Field = Field::new("qpc.pm_state", 0x13, 0x2);
    pub const PD: Field = Field::new("qpc.pd", 0x28, 0x18);
    pub const MTU: Field = Field::new("qpc.mtu", 0x40, 0x3);
    pub const LOG_MSG_MAX: Field = Field::new("qpc.log_msg_max", 0x43, 0x5);
    pub const LOG_RQ_SIZE: Field = Field::new("qpc.log_rq_size", 0x49, 0x4);
    pub const LOG_RQ_STRIDE: Field = Field::new("qpc.log_rq_stride", 0x4d, 0x3);
    pub const NO_SQ: Field = Field::new("qpc.no_sq", 0x50, 0x1);
    pub const LOG_SQ_SIZE: Field = Field::new("qpc.log_sq_size", 0x51, 0x4);
    /// `hca_cap::QPC_TS_FORMAT_*`, from `HcaCaps::qp_ts_format`.
    pub const TS_FORMAT: Field = Field::new("qpc.ts_format", 0x58, 0x2);
    pub const UAR_PAGE: Field = Field::new("qpc.uar_page", 0x68, 0x18);
    pub const USER_INDEX: Field = Field::new("qpc.user_index", 0x88, 0x18);
    pub const LOG_PAGE_SIZE: Field = Field::new("qpc.log_page_size", 0xa3, 0x5);
    pub const REMOTE_QPN: Field = Field::new("qpc.remote_qpn", 0xa8, 0x18);
    /// `primary_address_path` (ads) starts at qpc bit 0xc0.
    pub const ADS_BASE: u32 = 0xc0;
    pub const LOG_ACK_REQ_FREQ: Field = Field::new("qpc.log_ack_req_freq", 0x380, 0x4);
    pub const LOG_SRA_MAX: Field = Field::new("qpc.log_sra_max", 0x388, 0x3);
    pub const RETRY_COUNT: Field = Field::new("qpc.retry_count", 0x38d, 0x3);
    pub const RNR_RETRY: Field = Field::new("qpc.rnr_retry", 0x390, 0x3);
    pub const NEXT_SEND_PSN: Field = Field::new("qpc.next_send_psn", 0x3c8, 0x18);
    pub const CQN_SND: Field = Field::new("qpc.cqn_snd", 0x3e8, 0x18);
    pub const LOG_RRA_MAX: Field = Field::new("qpc.log_rra_max", 0x488, 0x3);
    pub const ATOMIC_MODE: Field = Field::new("qpc.atomic_mode", 0x48c, 0x4);
    pub const RRE: Field = Field::new("qpc.rre", 0x490, 0x1);
    pub const RWE: Field = Field::new("qpc.rwe", 0x491, 0x1);
    pub const RAE: Field = Field::new("qpc.rae", 0x492, 0x1);
    pub const CD_SLAVE_RECEIVE: Field = Field::new("qpc.cd_slave_receive", 0x49d, 0x1);
    pub const CD_SLAVE_SEND: Field = Field::new("qpc.cd_slave_send", 0x49e, 0x1);
    pub const CD_MASTER: Field = Field::new("qpc.cd_master", 0x49f, 0x1);
    pub const MIN_RNR_NAK: Field = Field::new("qpc.min_rnr_nak", 0x4a3, 0x5);
    pub const NEXT_RCV_PSN: Field = Field::new("qpc.next_rcv_psn", 0x4a8, 0x18);
    pub const CQN_RCV: Field = Field::new("qpc.cqn_rcv", 0x4e8, 0x18);
    pub const DBR_ADDR: Field = Field::new("qpc.dbr_addr", 0x500, 0x40);
    pub const RQ_TYPE: Field = Field::new("qpc.rq_type", 0x565, 0x3);
    pub const DBR_UMEM_VALID: Field = Field::new("qpc.dbr_umem_valid", 0x683, 0x1);
    pub const DBR_UMEM_ID: Field = Field::new("qpc.dbr_umem_id", 0x720, 0x20);
}

/// Address path (`ads`) fields, relative to the ads.
pub mod ads {
    use super::Field;
    pub const PKEY_INDEX: Field = Field::new("ads.pkey_index", 0x10, 0x10);
    pub const GRH: Field = Field::new("ads.grh", 0x28, 0x1);
    pub const RLID: Field = Field::new("ads.rlid", 0x30, 0x10);
    pub const ACK_TIMEOUT: Field = Field::new("ads.ack_timeout", 0x40, 0x5);
    pub const SRC_ADDR_INDEX: Field = Field::new("ads.src_addr_index", 0x48, 0x8);
    pub const HOP_LIMIT: Field = Field::new("ads.hop_limit", 0x58, 0x8);
    pub const TCLASS: Field = Field::new("ads.tclass", 0x64, 0x8);
    pub const FLOW_LABEL: Field = Field::new("ads.flow_label", 0x6c, 0x14);
    pub const RGID_RIP: Field = Field::new("ads.rgid_rip", 0x80, 0x80);
    pub const UDP_SPORT: Field = Field::new("ads.udp_sport", 0x110, 0x10);
    pub const SL: Field = Field::new("ads.sl", 0x124, 0x4);
    pub const VHCA_PORT_NUM: Field = Field::new("ads.vhca_port_num", 0x128, 0x8);
    pub const RMAC_47_32: Field = Field::new("ads.rmac_47_32", 0x130, 0x10);
    pub const RMAC_31_0: Field = Field::new("ads.rmac_31_0", 0x140, 0x20);
}

/// CREATE_QP fields outside the qpc.
pub const QPC_EXT: Field = Field::new("qpc_ext", 0x40, 0x1);
pub const WQ_UMEM_OFFSET: Field = Field::new("wq_umem_offset", 0x800, 0x40);
pub const WQ_UMEM_ID: Field = Field::new("wq_umem_id", 0x840, 0x20);
pub const WQ_UMEM_VALID: Field = Field::new("wq_umem_valid", 0x860, 0x1);
/// Modify-command fields outside the qpc.
pub const MODIFY_QPN: Field = Field::new("qpn", 0x48, 0x18);
pub const OPT_PARAM_MASK: Field = Field::new("opt_param_mask", 0x80, 0x20);
/// `create_qp_out.qpn`.
pub const OUT_QPN: Field = Field::new("qpn", 0x48, 0x18);

/// `qpc.st` for RC (Linux `MLX5_QP_ST_RC = 0x0`).
pub const ST_RC: u64 = 0;
/// `qpc.pm_state` MIGRATED (`MLX5_QP_PM_MIGRATED = 0x3`).
pub const PM_MIGRATED: u64 = 3;
/// `qpc.rq_type`: regular RQ (0) or none (3, UCX `3 /* no RQ */`).
pub const RQ_TYPE_REGULAR: u64 = 0;
pub const RQ_TYPE_NONE: u64 = 3;
/// `qpc.atomic_mode` values (Linux include/linux/mlx5/driver.h `MLX5_ATOMIC_MODE_*`,
/// shifted out of their dword position): IB-compatible 1, "CX" 2, up to 8 bytes 3.
pub const ATOMIC_MODE_IB_COMP: u64 = 1;
pub const ATOMIC_MODE_8B: u64 = 3;

bitflags::bitflags! {
    /// The CORE-Direct role of a QP (qpc `cd_master`, `cd_slave_send`, `cd_slave_receive`).
    /// A master may post WAIT / SEND_EN / RECV_EN; a slave's send (receive) queue runs only as
    /// far as a master's SEND_EN (RECV_EN) has enabled it.
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
    pub struct CdRole: u8 {
        const MASTER = 1 << 0;
        const SLAVE_SEND = 1 << 1;
        const SLAVE_RECEIVE = 1 << 2;
    }
}

/// Everything CREATE_QP needs for an RC QP whose rings live in registered user memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CreateQp {
    pub pd: u32,
    pub uar_page: u32,
    pub cqn_snd: u32,
    pub cqn_rcv: u32,
    /// log2 of the send queue size in WQEBBs.
    pub log_sq_size: u8,
    /// log2 of the receive queue size in entries; `None`: no receive queue.
    pub log_rq_size: Option<u8>,
    /// Receive stride = 16 << `log_rq_stride` bytes.
    pub log_rq_stride: u8,
    /// log2(page size of the WQ umem) − 12.
    pub log_page_size: u8,
    pub cd: CdRole,
    pub wq_umem_id: u32,
    pub wq_umem_offset: u64,
    pub dbr_umem_id: u32,
    /// Offset of the doorbell record inside its umem.
    pub dbr_offset: u64,
    pub user_index: u32,
    /// `qpc.ts_format`: what the device supports (`HcaCaps::qp_ts_format`).
    pub ts_format: u8,
}

/// CREATE_QP input bytes.
pub fn create_qp_in(p: &CreateQp) -> Result<[u8; CREATE_QP_IN_LEN], Mlx5Error> {
    let mut b = [0u8; CREATE_QP_IN_LEN];
    let q = |f: Field| f.at(QPC_BASE);
    bits::set(&mut b, IN_OPCODE, op::CREATE_QP as u64)?;
    bits::set(&mut b, q(qpc::ST), ST_RC)?;
    bits::set(&mut b, q(qpc::PM_STATE), PM_MIGRATED)?;
    bits::set(&mut b, q(qpc::PD), p.pd as u64)?;
    bits::set(&mut b, q(qpc::UAR_PAGE), p.uar_page as u64)?;
    bits::set(&mut b, q(qpc::USER_INDEX), p.user_index as u64)?;
    bits::set(&mut b, q(qpc::TS_FORMAT), p.ts_format as u64)?;
    bits::set(&mut b, q(qpc::LOG_PAGE_SIZE), p.log_page_size as u64)?;
    bits::set(&mut b, q(qpc::LOG_SQ_SIZE), p.log_sq_size as u64)?;
    match p.log_rq_size {
        Some(l) => {
            bits::set(&mut b, q(qpc::RQ_TYPE), RQ_TYPE_REGULAR)?;
            bits::set(&mut b, q(qpc::LOG_RQ_SIZE), l as u64)?;
            bits::set(&mut b, q(qpc::LOG_RQ_STRIDE), p.log_rq_stride as u64)?;
        }
        None => bits::set(&mut b, q(qpc::RQ_TYPE), RQ_TYPE_NONE)?,
    }
    bits::set(&mut b, q(qpc::CQN_SND), p.cqn_snd as u64)?;
    bits::set(&mut b, q(qpc::CQN_RCV), p.cqn_rcv as u64)?;
    bits::set(&mut b, q(qpc::CD_MASTER), p.cd.contains(CdRole::MASTER) as u64)?;
    bits::set(&mut b, q(qpc::CD_SLAVE_SEND), p.cd.contains(CdRole::SLAVE_SEND) as u64)?;
    bits::set(&mut b, q(qpc::CD_SLAVE_RECEIVE), p.cd.contains(CdRole::SLAVE_RECEIVE) as u64)?;
    bits::set(&mut b, q(qpc::DBR_UMEM_VALID), 1)?;
    bits::set(&mut b, q(qpc::DBR_UMEM_ID), p.dbr_umem_id as u64)?;
    bits::set(&mut b, q(qpc::DBR_ADDR), p.dbr_offset)?;
    bits::set(&mut b, WQ_UMEM_ID, p.wq_umem_id as u64)?;
    bits::set(&mut b, WQ_UMEM_OFFSET, p.wq_umem_offset)?;
    bits::set(&mut b, WQ_UMEM_VALID, 1)?;
    Ok(b)
}

/// The QP number from a CREATE_QP output (after its status was checked).
pub fn created_qpn(out: &[u8]) -> Result<u32, Mlx5Error> {
    super::check_status(op::CREATE_QP, out)?;
    Ok(bits::get(out, OUT_QPN)? as u32)
}

/// RST2INIT: port, pkey and the responder rights (and atomic mode) of the QP.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Rst2Init {
    pub qpn: u32,
    pub port: u8,
    pub pkey_index: u16,
    pub remote_read: bool,
    pub remote_write: bool,
    pub remote_atomic: bool,
    pub atomic_mode: u8,
}

/// INIT2RTR: the remote side, as rdma_cm's `rdma_init_qp_attr(IBV_QPS_RTR)` describes it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Init2Rtr {
    pub qpn: u32,
    pub remote_qpn: u32,
    /// `IBV_MTU_*` value (1 = 256 … 5 = 4096), the same numbering as `qpc.mtu`.
    pub mtu: u8,
    pub log_msg_max: u8,
    pub next_rcv_psn: u32,
    pub log_rra_max: u8,
    pub min_rnr_nak: u8,
    pub path: AddressPath,
}

/// A RoCE/IB address path (`ads`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct AddressPath {
    pub port: u8,
    pub pkey_index: u16,
    pub grh: bool,
    pub rlid: u16,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub tclass: u8,
    pub flow_label: u32,
    pub rgid: [u8; 16],
    pub sl: u8,
    /// The next hop's MAC (RoCE): DEVX QPs must be told it; the kernel resolves it only for
    /// verbs QPs.
    pub rmac: [u8; 6],
    pub udp_sport: u16,
}

/// RTR2RTS: the requester side.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Rtr2Rts {
    pub qpn: u32,
    pub next_send_psn: u32,
    pub ack_timeout: u8,
    pub retry_count: u8,
    pub rnr_retry: u8,
    pub log_sra_max: u8,
}

fn modify_header(b: &mut [u8], opcode: u16, qpn: u32) -> Result<(), Mlx5Error> {
    bits::set(b, IN_OPCODE, opcode as u64)?;
    bits::set(b, MODIFY_QPN, qpn as u64)
}

/// Any state → RESET: the QP's queues are emptied and its WQE counters start over at 0; its CQs
/// keep their producer indices (they are separate objects).
pub fn qp_2rst_in(qpn: u32) -> Result<[u8; QP_2RST_IN_LEN], Mlx5Error> {
    let mut b = [0u8; QP_2RST_IN_LEN];
    modify_header(&mut b, op::TO_RST_QP, qpn)?;
    Ok(b)
}

pub fn rst2init_in(p: &Rst2Init) -> Result<[u8; MODIFY_QP_IN_LEN], Mlx5Error> {
    let mut b = [0u8; MODIFY_QP_IN_LEN];
    let q = |f: Field| f.at(QPC_BASE);
    let a = |f: Field| f.at(QPC_BASE + qpc::ADS_BASE);
    modify_header(&mut b, op::RST2INIT_QP, p.qpn)?;
    bits::set(&mut b, q(qpc::PM_STATE), PM_MIGRATED)?;
    bits::set(&mut b, a(ads::VHCA_PORT_NUM), p.port as u64)?;
    bits::set(&mut b, a(ads::PKEY_INDEX), p.pkey_index as u64)?;
    bits::set(&mut b, q(qpc::RRE), p.remote_read as u64)?;
    bits::set(&mut b, q(qpc::RWE), p.remote_write as u64)?;
    bits::set(&mut b, q(qpc::RAE), p.remote_atomic as u64)?;
    if p.remote_atomic {
        bits::set(&mut b, q(qpc::ATOMIC_MODE), p.atomic_mode as u64)?;
    }
    Ok(b)
}

fn set_path(b: &mut [u8], p: &AddressPath) -> Result<(), Mlx5Error> {
    let a = |f: Field| f.at(QPC_BASE + qpc::ADS_BASE);
    bits::set(b, a(ads::VHCA_PORT_NUM), p.port as u64)?;
    bits::set(b, a(ads::PKEY_INDEX), p.pkey_index as u64)?;
    bits::set(b, a(ads::RLID), p.rlid as u64)?;
    bits::set(b, a(ads::SL), p.sl as u64)?;
    if p.grh {
        bits::set(b, a(ads::GRH), 1)?;
        bits::set(b, a(ads::SRC_ADDR_INDEX), p.sgid_index as u64)?;
        bits::set(b, a(ads::HOP_LIMIT), p.hop_limit as u64)?;
        bits::set(b, a(ads::TCLASS), p.tclass as u64)?;
        bits::set(b, a(ads::FLOW_LABEL), p.flow_label as u64)?;
        bits::set_bytes(b, a(ads::RGID_RIP), &p.rgid)?;
    }
    let m = p.rmac;
    bits::set(b, a(ads::RMAC_47_32), u16::from_be_bytes([m[0], m[1]]) as u64)?;
    bits::set(b, a(ads::RMAC_31_0), u32::from_be_bytes([m[2], m[3], m[4], m[5]]) as u64)?;
    bits::set(b, a(ads::UDP_SPORT), p.udp_sport as u64)
}

pub fn init2rtr_in(p: &Init2Rtr) -> Result<[u8; MODIFY_QP_IN_LEN], Mlx5Error> {
    let mut b = [0u8; MODIFY_QP_IN_LEN];
    let q = |f: Field| f.at(QPC_BASE);
    modify_header(&mut b, op::INIT2RTR_QP, p.qpn)?;
    bits::set(&mut b, q(qpc::MTU), p.mtu as u64)?;
    bits::set(&mut b, q(qpc::LOG_MSG_MAX), p.log_msg_max as u64)?;
    bits::set(&mut b, q(qpc::REMOTE_QPN), p.remote_qpn as u64)?;
    bits::set(&mut b, q(qpc::NEXT_RCV_PSN), p.next_rcv_psn as u64)?;
    bits::set(&mut b, q(qpc::LOG_RRA_MAX), p.log_rra_max as u64)?;
    bits::set(&mut b, q(qpc::MIN_RNR_NAK), p.min_rnr_nak as u64)?;
    set_path(&mut b, &p.path)?;
    Ok(b)
}

pub fn rtr2rts_in(p: &Rtr2Rts) -> Result<[u8; MODIFY_QP_IN_LEN], Mlx5Error> {
    let mut b = [0u8; MODIFY_QP_IN_LEN];
    let q = |f: Field| f.at(QPC_BASE);
    let a = |f: Field| f.at(QPC_BASE + qpc::ADS_BASE);
    modify_header(&mut b, op::RTR2RTS_QP, p.qpn)?;
    bits::set(&mut b, q(qpc::NEXT_SEND_PSN), p.next_send_psn as u64)?;
    bits::set(&mut b, a(ads::ACK_TIMEOUT), p.ack_timeout as u64)?;
    bits::set(&mut b, q(qpc::RETRY_COUNT), p.retry_count as u64)?;
    bits::set(&mut b, q(qpc::RNR_RETRY), p.rnr_retry as u64)?;
    bits::set(&mut b, q(qpc::LOG_SRA_MAX), p.log_sra_max as u64)?;
    Ok(b)
}
