//! CREATE_CQ (0x400) for a CQ whose ring and doorbell record live in registered user memory.
//!
//! Offsets: DPDK main 38f72e500b3b159eca3ba2f4ca0e46a26a7cb057 drivers/common/mlx5/mlx5_prm.h
//! `struct mlx5_ifc_cqc_bits` (0x200 bits) and `struct mlx5_ifc_create_cq_in_bits`
//! (`cq_context` at bit 0x80, `cq_umem_offset` 0x280, `cq_umem_id` 0x2c0, `cq_umem_valid`
//! 0x2e0; 0x880 bits = 272 bytes), each computed from the structs' field widths. rdma-core
//! v44.0 providers/mlx5/mlx5_ifc.h defines neither struct; it has `create_cq_out` (`cqn` at
//! 0x48), as DPDK does. The fields set follow UCX ib_mlx5_dv.c
//! `uct_ib_mlx5_devx_create_cq_common`; `oi` (overrun ignore) DPDK's
//! drivers/common/mlx5/mlx5_devx_cmds.c `mlx5_devx_cmd_create_cq`
//! (`MLX5_SET(cqc, cqctx, oi, attr->overrun_ignore)`).

use super::{bits, op, Field, IN_OPCODE};
use crate::mlx5::Mlx5Error;

pub const CREATE_CQ_IN_LEN: usize = 272;
pub const CREATE_CQ_OUT_LEN: usize = 16;
pub const CQC_BASE: u32 = 0x80;

pub mod cqc {
    use super::Field;
    pub const DBR_UMEM_VALID: Field = Field::new("cqc.dbr_umem_valid", 0x6, 0x1);
    /// CQE size: 0 = 64 bytes, 1 = 128 bytes.
    pub const CQE_SZ: Field = Field::new("cqc.cqe_sz", 0x8, 0x3);
    pub const CC: Field = Field::new("cqc.cc", 0xb, 0x1);
    /// Overrun ignore: a CQE written over one not yet consumed does not move the CQ to error
    /// (DPDK mlx5_prm.h `mlx5_ifc_cqc_bits`: status 4 bits, as_notify, initiator_src_dct,
    /// dbr_umem_valid, ext_element, cqe_sz 3, cc, reserved_at_c, scqe_break_moderation_en,
    /// then `oi` at bit 0xe).
    pub const OI: Field = Field::new("cqc.oi", 0xe, 0x1);
    pub const DBR_UMEM_ID: Field = Field::new("cqc.dbr_umem_id", 0x20, 0x20);
    pub const LOG_CQ_SIZE: Field = Field::new("cqc.log_cq_size", 0x63, 0x5);
    pub const UAR_PAGE: Field = Field::new("cqc.uar_page", 0x68, 0x18);
    pub const C_EQN: Field = Field::new("cqc.c_eqn", 0xb8, 0x8);
    pub const LOG_PAGE_SIZE: Field = Field::new("cqc.log_page_size", 0xc3, 0x5);
    pub const DBR_ADDR: Field = Field::new("cqc.dbr_addr", 0x1c0, 0x40);
}

pub const CQ_UMEM_OFFSET: Field = Field::new("cq_umem_offset", 0x280, 0x40);
pub const CQ_UMEM_ID: Field = Field::new("cq_umem_id", 0x2c0, 0x20);
pub const CQ_UMEM_VALID: Field = Field::new("cq_umem_valid", 0x2e0, 0x1);
pub const OUT_CQN: Field = Field::new("cqn", 0x48, 0x18);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CreateCq {
    /// log2 of the number of 64-byte CQEs.
    pub log_cq_size: u8,
    pub uar_page: u32,
    pub eqn: u8,
    pub log_page_size: u8,
    pub umem_id: u32,
    pub umem_offset: u64,
    pub dbr_umem_id: u32,
    pub dbr_offset: u64,
    /// `cqc.oi`: the CQ never errors on overrun. A chain CQ needs it: nothing guarantees its
    /// CQEs are consumed in time — its WAITs compare only the producer index — and an
    /// overrun CQ stops every WAIT on it (issue 22 item 6). Linux gives cross-channel CQs
    /// ignore-overrun (commit 051f263098a9); DPDK's Tx pacing creates the CQ its WAITs watch
    /// with `overrun_ignore = 1` (drivers/net/mlx5/mlx5_txpp.c
    /// `mlx5_txpp_create_clock_queue`).
    pub overrun_ignore: bool,
}

pub fn create_cq_in(p: &CreateCq) -> Result<[u8; CREATE_CQ_IN_LEN], Mlx5Error> {
    let mut b = [0u8; CREATE_CQ_IN_LEN];
    let c = |f: Field| f.at(CQC_BASE);
    bits::set(&mut b, IN_OPCODE, op::CREATE_CQ as u64)?;
    bits::set(&mut b, c(cqc::CQE_SZ), 0)?;
    bits::set(&mut b, c(cqc::OI), p.overrun_ignore as u64)?;
    bits::set(&mut b, c(cqc::LOG_CQ_SIZE), p.log_cq_size as u64)?;
    bits::set(&mut b, c(cqc::UAR_PAGE), p.uar_page as u64)?;
    bits::set(&mut b, c(cqc::C_EQN), p.eqn as u64)?;
    bits::set(&mut b, c(cqc::LOG_PAGE_SIZE), p.log_page_size as u64)?;
    bits::set(&mut b, c(cqc::DBR_UMEM_VALID), 1)?;
    bits::set(&mut b, c(cqc::DBR_UMEM_ID), p.dbr_umem_id as u64)?;
    bits::set(&mut b, c(cqc::DBR_ADDR), p.dbr_offset)?;
    bits::set(&mut b, CQ_UMEM_ID, p.umem_id as u64)?;
    bits::set(&mut b, CQ_UMEM_OFFSET, p.umem_offset)?;
    bits::set(&mut b, CQ_UMEM_VALID, 1)?;
    Ok(b)
}

pub fn created_cqn(out: &[u8]) -> Result<u32, Mlx5Error> {
    super::check_status(op::CREATE_CQ, out)?;
    Ok(bits::get(out, OUT_CQN)? as u32)
}
