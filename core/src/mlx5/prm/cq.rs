//! CREATE_CQ (0x400) for a CQ whose ring and doorbell record live in registered user memory.
//!
//! Offsets: rdma-core v44.0 providers/mlx5/mlx5_ifc.h `struct mlx5_ifc_cqc_bits` and
//! `mlx5_ifc_create_cq_in_bits` (cq_context at bit 0x80, `cq_umem_offset` 0x280, `cq_umem_id`
//! 0x2c0, `cq_umem_valid` 0x2e0; 272 bytes), `create_cq_out` (`cqn` at 0x48); identical in
//! DPDK mlx5_prm.h. The fields set follow UCX ib_mlx5_dv.c `uct_ib_mlx5_devx_create_cq_common`.

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
}

pub fn create_cq_in(p: &CreateCq) -> Result<[u8; CREATE_CQ_IN_LEN], Mlx5Error> {
    let mut b = [0u8; CREATE_CQ_IN_LEN];
    let c = |f: Field| f.at(CQC_BASE);
    bits::set(&mut b, IN_OPCODE, op::CREATE_CQ as u64)?;
    bits::set(&mut b, c(cqc::CQE_SZ), 0)?;
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
