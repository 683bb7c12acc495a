//! The double's own reading of the PRM command layouts: bit offsets and widths of every field
//! it decodes or answers, taken from DPDK's `drivers/common/mlx5/mlx5_prm.h` (DPDK main
//! `38f72e500b3b159eca3ba2f4ca0e46a26a7cb057`; the atomic capabilities, which DPDK does not
//! define, from Linux `include/linux/mlx5/mlx5_ifc.h` `struct mlx5_ifc_atomic_caps_bits`; the
//! mkey commands of the memory windows from the same Linux header: [`mkc`]) by a
//! struct-offset calculation over the `u8 name[width]` declarations — independently of omw's
//! encoder (`omw_core::mlx5::prm`), which took rdma-core's `mlx5_ifc.h`, so that encoder and
//! decoder cannot share a mistake. Every constant names its struct; the offsets are bits from
//! the start of the command (nested structs already added in).
//!
//! Bits are numbered as the `MLX5_SET` / `MLX5_GET` macros number them: big-endian 32-bit
//! words, bit 0 the most significant bit of the first word.

/// A field: its bit offset from the start of the command or answer, and its width in bits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Field {
    pub name: &'static str,
    pub off: u32,
    pub width: u32,
}

const fn f(name: &'static str, off: u32, width: u32) -> Field {
    Field { name, off, width }
}

impl Field {
    /// The last byte the field touches, + 1.
    pub const fn end_byte(&self) -> usize {
        ((self.off + self.width).div_ceil(8)) as usize
    }
}

/// The field's value, or `None` if `b` is too short to hold it.
pub fn get(b: &[u8], x: Field) -> Option<u64> {
    if b.len() < x.end_byte() {
        return None;
    }
    if x.width == 64 {
        let at = (x.off / 8) as usize;
        return Some(u64::from_be_bytes(b[at..at + 8].try_into().ok()?));
    }
    // within one big-endian dword (every PRM field narrower than 32 bits is)
    let dw = (x.off / 32) as usize * 4;
    let word = u32::from_be_bytes(b[dw..dw + 4].try_into().ok()?);
    let shift = 32 - x.off % 32 - x.width;
    let mask = if x.width == 32 { u32::MAX } else { (1u32 << x.width) - 1 };
    Some(((word >> shift) & mask) as u64)
}

/// Set the field (values wider than it are truncated: the double writes only its own answers).
pub fn set(b: &mut [u8], x: Field, v: u64) {
    if b.len() < x.end_byte() {
        return;
    }
    if x.width == 64 {
        let at = (x.off / 8) as usize;
        b[at..at + 8].copy_from_slice(&v.to_be_bytes());
        return;
    }
    let dw = (x.off / 32) as usize * 4;
    let mut word = u32::from_be_bytes([b[dw], b[dw + 1], b[dw + 2], b[dw + 3]]);
    let shift = 32 - x.off % 32 - x.width;
    let mask = if x.width == 32 { u32::MAX } else { (1u32 << x.width) - 1 };
    word = (word & !(mask << shift)) | (((v as u32) & mask) << shift);
    b[dw..dw + 4].copy_from_slice(&word.to_be_bytes());
}

/// Bytes `[off/8, off/8 + len)` of the command (a GID).
pub fn bytes<const N: usize>(b: &[u8], x: Field) -> Option<[u8; N]> {
    let at = (x.off / 8) as usize;
    b.get(at..at + N)?.try_into().ok()
}

/// Every command's header (`mlx5_ifc_*_in_bits`: opcode, uid, op_mod) and every answer's
/// (`*_out_bits`: status, syndrome).
pub mod header {
    use super::{f, Field};
    pub const OPCODE: Field = f("opcode", 0x0, 0x10);
    pub const UID: Field = f("uid", 0x10, 0x10);
    pub const OP_MOD: Field = f("op_mod", 0x30, 0x10);
    pub const STATUS: Field = f("status", 0x0, 0x8);
    pub const SYNDROME: Field = f("syndrome", 0x20, 0x20);
}

/// `MLX5_CMD_OP_*` (mlx5_prm.h enum).
pub mod opcode {
    pub const QUERY_HCA_CAP: u16 = 0x100;
    /// Linux include/linux/mlx5/mlx5_ifc.h `MLX5_CMD_OP_CREATE_MKEY` / `_QUERY_MKEY` /
    /// `_DESTROY_MKEY`.
    pub const CREATE_MKEY: u16 = 0x200;
    pub const QUERY_MKEY: u16 = 0x201;
    pub const DESTROY_MKEY: u16 = 0x202;
    pub const CREATE_CQ: u16 = 0x400;
    pub const CREATE_QP: u16 = 0x500;
    pub const RST2INIT_QP: u16 = 0x502;
    pub const INIT2RTR_QP: u16 = 0x503;
    pub const RTR2RTS_QP: u16 = 0x504;
    pub const QP_2ERR: u16 = 0x507;
    pub const QP_2RST: u16 = 0x50A;
    pub const QUERY_QP: u16 = 0x50B;
}

/// Command statuses (`MLX5_CMD_STAT_*`, Linux include/linux/mlx5/device.h).
pub mod status {
    pub const OK: u8 = 0x0;
    pub const BAD_OP: u8 = 0x2;
    pub const BAD_PARAM: u8 = 0x3;
    pub const BAD_RES: u8 = 0x5;
    pub const LIM: u8 = 0x8;
    pub const BAD_RES_STATE: u8 = 0x9;
    pub const BAD_QP_STATE: u8 = 0x10;
    pub const BAD_INP_LEN: u8 = 0x50;
    pub const BAD_OUTP_LEN: u8 = 0x51;
}

/// `mlx5_ifc_query_hca_cap_in_bits` (16 bytes) and `_out_bits` (capability at 0x80, a
/// `union mlx5_ifc_hca_cap_union_bits` of 0x8000 bits: 4112 bytes in all).
pub mod query_hca_cap {
    pub const IN_BYTES: usize = 0x80 / 8;
    pub const OUT_BYTES: usize = (0x80 + 0x8000) / 8;
    /// Where the capability structure starts in the answer.
    pub const CAPABILITY: u32 = 0x80;
    /// `op_mod` = capability type << 1 | `MLX5_HCA_CAP_OPMOD_GET_CUR` (1); the types
    /// (`MLX5_GET_HCA_CAP_OP_MOD_GENERAL_DEVICE` 0, Linux `MLX5_CAP_ATOMIC` 3,
    /// `MLX5_GET_HCA_CAP_OP_MOD_ROCE` 4).
    pub const GENERAL: u16 = 0;
    pub const ATOMIC: u16 = 3;
    pub const ROCE: u16 = 4;
}

/// `mlx5_ifc_cmd_hca_cap_bits`, at the answer's capability (offsets include 0x80).
pub mod hca_cap {
    use super::{f, Field};
    pub const LOG_MAX_QP_SZ: Field = f("log_max_qp_sz", 0x80 + 0x88, 0x8);
    pub const LOG_MAX_CQ_SZ: Field = f("log_max_cq_sz", 0x80 + 0xc8, 0x8);
    pub const LOG_MAX_MKEY: Field = f("log_max_mkey", 0x80 + 0xea, 0x6);
    pub const PORT_TYPE: Field = f("port_type", 0x80 + 0x1b6, 0x2);
    pub const LOG_MAX_MSG: Field = f("log_max_msg", 0x80 + 0x1c3, 0x5);
    pub const UMR_FENCE: Field = f("umr_fence", 0x80 + 0x20a, 0x2);
    pub const ATOMIC: Field = f("atomic", 0x80 + 0x21e, 0x1);
    pub const CD: Field = f("cd", 0x80 + 0x22c, 0x1);
    pub const IMAICL: Field = f("imaicl", 0x80 + 0x231, 0x1);
    pub const RC: Field = f("rc", 0x80 + 0x23f, 0x1);
    /// `MLX5_CAP_PORT_TYPE_ETH` (RoCE).
    pub const PORT_TYPE_ETH: u64 = 1;
}

/// Linux `mlx5_ifc_atomic_caps_bits`, at the answer's capability.
pub mod atomic_caps {
    use super::{f, Field};
    pub const REQ_8B_ENDIANNESS_MODE: Field = f("atomic_req_8B_endianness_mode", 0x80 + 0x40, 0x2);
    pub const OPERATIONS: Field = f("atomic_operations", 0x80 + 0x90, 0x10);
    pub const SIZE_QP: Field = f("atomic_size_qp", 0x80 + 0xb0, 0x10);
    /// `MLX5_ATOMIC_OPS_*` (Linux include/linux/mlx5/driver.h): compare-swap, fetch-add,
    /// masked compare-swap, masked fetch-add.
    pub const OPS_ALL: u64 = 0xF;
    /// `MLX5_ATOMIC_CAPS_ATOMIC_SIZE_QP_8_BYTES`.
    pub const SIZE_8: u64 = 0x8;
}

/// `mlx5_ifc_roce_caps_bits`, at the answer's capability.
pub mod roce_caps {
    use super::{f, Field};
    pub const QP_TS_FORMAT: Field = f("qp_ts_format", 0x80 + 0x1e, 0x2);
    /// `MLX5_HCA_CAP_TIMESTAMP_FORMAT_FR` / `_RT` / `_FR_RT`.
    pub const TS_FR: u8 = 0;
    pub const TS_RT: u8 = 1;
    pub const TS_FR_RT: u8 = 2;
}

/// `mlx5_ifc_create_cq_in_bits` (`cq_context`, a `mlx5_ifc_cqc_bits`, at 0x80).
pub mod create_cq {
    use super::{f, Field};
    /// Up to `cq_umem_valid`'s reserved tail (the `pas` list is empty with a umem).
    pub const IN_BYTES: usize = 0x880 / 8;
    pub const DBR_UMEM_VALID: Field = f("cqc.dbr_umem_valid", 0x86, 0x1);
    pub const CQE_SZ: Field = f("cqc.cqe_sz", 0x88, 0x3);
    pub const CC: Field = f("cqc.cc", 0x8b, 0x1);
    pub const OI: Field = f("cqc.oi", 0x8e, 0x1);
    pub const CQE_COMP_EN: Field = f("cqc.cqe_comp_en", 0x91, 0x1);
    pub const DBR_UMEM_ID: Field = f("cqc.dbr_umem_id", 0xa0, 0x20);
    pub const LOG_CQ_SIZE: Field = f("cqc.log_cq_size", 0xe3, 0x5);
    pub const UAR_PAGE: Field = f("cqc.uar_page", 0xe8, 0x18);
    pub const C_EQN: Field = f("cqc.c_eqn", 0x138, 0x8);
    pub const LOG_PAGE_SIZE: Field = f("cqc.log_page_size", 0x143, 0x5);
    /// With `dbr_umem_valid`: the doorbell record's offset in that umem.
    pub const DBR_ADDR: Field = f("cqc.dbr_addr", 0x240, 0x40);
    pub const CQ_UMEM_OFFSET: Field = f("cq_umem_offset", 0x280, 0x40);
    pub const CQ_UMEM_ID: Field = f("cq_umem_id", 0x2c0, 0x20);
    pub const CQ_UMEM_VALID: Field = f("cq_umem_valid", 0x2e0, 0x1);
    /// `mlx5_ifc_create_cq_out_bits`.
    pub const OUT_BYTES: usize = 0x80 / 8;
    pub const OUT_CQN: Field = f("cqn", 0x48, 0x18);
    /// `MLX5_CQE_SIZE_64B`.
    pub const CQE_SIZE_64B: u64 = 0;
}

/// `mlx5_ifc_create_qp_in_bits` (`qpc`, a `mlx5_ifc_qpc_bits`, at 0xc0; its
/// `primary_address_path`, a `mlx5_ifc_ads_bits`, at 0x180).
pub mod create_qp {
    use super::{f, Field};
    /// Up to `wq_umem_valid`'s reserved tail (no extension, no `pas` list with a umem).
    pub const IN_BYTES: usize = 0x880 / 8;
    pub const QPC_EXT: Field = f("qpc_ext", 0x40, 0x1);
    pub const ST: Field = f("qpc.st", 0xc8, 0x8);
    pub const PM_STATE: Field = f("qpc.pm_state", 0xd3, 0x2);
    pub const PD: Field = f("qpc.pd", 0xe8, 0x18);
    pub const LOG_RQ_SIZE: Field = f("qpc.log_rq_size", 0x109, 0x4);
    pub const LOG_RQ_STRIDE: Field = f("qpc.log_rq_stride", 0x10d, 0x3);
    pub const NO_SQ: Field = f("qpc.no_sq", 0x110, 0x1);
    pub const LOG_SQ_SIZE: Field = f("qpc.log_sq_size", 0x111, 0x4);
    pub const TS_FORMAT: Field = f("qpc.ts_format", 0x118, 0x2);
    pub const UAR_PAGE: Field = f("qpc.uar_page", 0x128, 0x18);
    pub const LOG_PAGE_SIZE: Field = f("qpc.log_page_size", 0x163, 0x5);
    pub const CQN_SND: Field = f("qpc.cqn_snd", 0x4a8, 0x18);
    pub const CD_SLAVE_RECEIVE: Field = f("qpc.cd_slave_receive", 0x55d, 0x1);
    pub const CD_SLAVE_SEND: Field = f("qpc.cd_slave_send", 0x55e, 0x1);
    pub const CD_MASTER: Field = f("qpc.cd_master", 0x55f, 0x1);
    pub const CQN_RCV: Field = f("qpc.cqn_rcv", 0x5a8, 0x18);
    pub const DBR_ADDR: Field = f("qpc.dbr_addr", 0x5c0, 0x40);
    pub const RQ_TYPE: Field = f("qpc.rq_type", 0x625, 0x3);
    pub const DBR_UMEM_VALID: Field = f("qpc.dbr_umem_valid", 0x743, 0x1);
    pub const DBR_UMEM_ID: Field = f("qpc.dbr_umem_id", 0x7e0, 0x20);
    pub const WQ_UMEM_OFFSET: Field = f("wq_umem_offset", 0x800, 0x40);
    pub const WQ_UMEM_ID: Field = f("wq_umem_id", 0x840, 0x20);
    pub const WQ_UMEM_VALID: Field = f("wq_umem_valid", 0x860, 0x1);
    /// `mlx5_ifc_create_qp_out_bits`.
    pub const OUT_BYTES: usize = 0x80 / 8;
    pub const OUT_QPN: Field = f("qpn", 0x48, 0x18);
    /// `MLX5_QP_ST_RC`, `MLX5_QP_PM_MIGRATED`, `MLX5_NON_ZERO_RQ`, `MLX5_ZERO_LEN_RQ`.
    pub const ST_RC: u64 = 0;
    pub const PM_MIGRATED: u64 = 3;
    pub const RQ_REGULAR: u64 = 0;
    pub const RQ_ZERO_LEN: u64 = 3;
    /// `MLX5_QPC_TIMESTAMP_FORMAT_FREE_RUNNING` / `_DEFAULT` / `_REAL_TIME`.
    pub const TS_FREE_RUNNING: u64 = 0;
    pub const TS_DEFAULT: u64 = 1;
    pub const TS_REAL_TIME: u64 = 2;
}

/// `mlx5_ifc_rst2init_qp_in_bits`, `_init2rtr_`, `_rtr2rts_` (one layout: qpn, opt_param_mask,
/// `qpc` at 0xc0; 272 bytes) and `mlx5_ifc_2rst_qp_in_bits` / 2ERR (16 bytes).
pub mod modify_qp {
    use super::{f, Field};
    pub const IN_BYTES: usize = 0x880 / 8;
    pub const TO_RST_IN_BYTES: usize = 0x80 / 8;
    pub const OUT_BYTES: usize = 0x80 / 8;
    pub const QPN: Field = f("qpn", 0x48, 0x18);
    pub const MTU: Field = f("qpc.mtu", 0x100, 0x3);
    pub const REMOTE_QPN: Field = f("qpc.remote_qpn", 0x168, 0x18);
    /// `qpc.primary_address_path` (0x180) fields.
    pub const GRH: Field = f("ads.grh", 0x180 + 0x28, 0x1);
    pub const RGID: Field = f("ads.rgid_rip", 0x180 + 0x80, 0x80);
    pub const VHCA_PORT_NUM: Field = f("ads.vhca_port_num", 0x180 + 0x128, 0x8);
    pub const RMAC_47_32: Field = f("ads.rmac_47_32", 0x180 + 0x130, 0x10);
    pub const RMAC_31_0: Field = f("ads.rmac_31_0", 0x180 + 0x140, 0x20);
    pub const RRE: Field = f("qpc.rre", 0x550, 0x1);
    pub const RWE: Field = f("qpc.rwe", 0x551, 0x1);
    pub const RAE: Field = f("qpc.rae", 0x552, 0x1);
}

/// `mlx5_ifc_query_qp_in_bits` (16 bytes) and `_out_bits` (`qpc` at 0xc0; 272 bytes without
/// the `pas` list).
pub mod query_qp {
    use super::{f, Field};
    pub const IN_BYTES: usize = 0x80 / 8;
    pub const OUT_BYTES: usize = 0x880 / 8;
    pub const QPN: Field = f("qpn", 0x48, 0x18);
    pub const STATE: Field = f("qpc.state", 0xc0, 0x4);
    /// `MLX5_QP_STATE_*` (Linux include/linux/mlx5/qp.h).
    pub const RST: u64 = 0;
    pub const INIT: u64 = 1;
    pub const RTR: u64 = 2;
    pub const RTS: u64 = 3;
    pub const SQER: u64 = 4;
    pub const SQD: u64 = 5;
    pub const ERR: u64 = 6;
}

/// Linux include/linux/mlx5/mlx5_ifc.h `struct mlx5_ifc_mkc_bits` (0x200 bits), as it sits at
/// bit 0x80 of both `mlx5_ifc_create_mkey_in_bits` (`memory_key_mkey_entry`, after opcode, uid,
/// op_mod, 0x20 reserved bits, `pg_access`, `mkey_umem_valid` and 0x1e reserved bits) and
/// `mlx5_ifc_query_mkey_out_bits` (after status, syndrome and 0x40 reserved bits): the
/// offsets below include the 0x80. Computed here by hand from the declarations (free at
/// 0x1 after one reserved bit; access_mode_4_2 3 bits at 0x3; 7 reserved, relaxed_ordering_write,
/// a reserved bit, small_fence_on_rdma_read_response, then umr_en at 0x10, a, rw, rr, lw, lr,
/// access_mode_1_0 2 bits at 0x16; qpn 24 bits at 0x20, mkey_7_0 at 0x38; 0x20 reserved; at
/// 0x60 length64, bsf_en, sync_umr, 2 reserved, expected_sigerr_count, a reserved bit,
/// en_rinval at 0x67, pd 24 bits at 0x68; start_addr 64 bits at 0x80, len at 0xc0;
/// bsf_octword_size at 0x100, 0x80 reserved, translations_octword_size at 0x1a0).
pub mod mkc {
    use super::{f, Field};
    const B: u32 = 0x80;
    pub const FREE: Field = f("mkc.free", B + 0x1, 0x1);
    pub const ACCESS_MODE_4_2: Field = f("mkc.access_mode_4_2", B + 0x3, 0x3);
    pub const UMR_EN: Field = f("mkc.umr_en", B + 0x10, 0x1);
    pub const A: Field = f("mkc.a", B + 0x11, 0x1);
    pub const RW: Field = f("mkc.rw", B + 0x12, 0x1);
    pub const RR: Field = f("mkc.rr", B + 0x13, 0x1);
    pub const LW: Field = f("mkc.lw", B + 0x14, 0x1);
    pub const LR: Field = f("mkc.lr", B + 0x15, 0x1);
    pub const ACCESS_MODE_1_0: Field = f("mkc.access_mode_1_0", B + 0x16, 0x2);
    pub const QPN: Field = f("mkc.qpn", B + 0x20, 0x18);
    pub const MKEY_7_0: Field = f("mkc.mkey_7_0", B + 0x38, 0x8);
    pub const EN_RINVAL: Field = f("mkc.en_rinval", B + 0x67, 0x1);
    pub const PD: Field = f("mkc.pd", B + 0x68, 0x18);
    pub const START_ADDR: Field = f("mkc.start_addr", B + 0x80, 0x40);
    pub const LEN: Field = f("mkc.len", B + 0xc0, 0x40);
    pub const TRANSLATIONS_OCTWORD_SIZE: Field = f("mkc.translations_octword_size", B + 0x1a0, 0x20);
    /// `MLX5_MKC_ACCESS_MODE_KLMS`.
    pub const ACCESS_MODE_KLMS: u64 = 0x2;
    /// `qpn` of an mkey bound to no QP.
    pub const QPN_NONE: u64 = 0xFF_FFFF;
}

/// `mlx5_ifc_create_mkey_in_bits` (0x880 bits up to `klm_pas_mtt`, which a free window
/// leaves empty) and `_out_bits` (`mkey_index` 24 bits at 0x48; 0x80 bits).
pub mod create_mkey {
    use super::{f, Field};
    pub const IN_BYTES: usize = 0x880 / 8;
    pub const OUT_BYTES: usize = 0x80 / 8;
    pub const OUT_MKEY_INDEX: Field = f("mkey_index", 0x48, 0x18);
}

/// `mlx5_ifc_query_mkey_in_bits` (`mkey_index` at 0x48; 0x80 bits) and `_out_bits` (the
/// context at 0x80, 0x600 reserved bits, two 16-byte descriptor arrays: 0x980 bits).
pub mod query_mkey {
    use super::{f, Field};
    pub const IN_BYTES: usize = 0x80 / 8;
    pub const OUT_BYTES: usize = 0x980 / 8;
    pub const MKEY_INDEX: Field = f("mkey_index", 0x48, 0x18);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_and_set_follow_the_mlx5_set_arithmetic() {
        let mut b = [0u8; 16];
        // a 24-bit field at bit 0x48: the low three bytes of the third dword
        set(&mut b, create_qp::OUT_QPN, 0xAB_CDEF);
        assert_eq!(&b[8..12], &[0, 0xAB, 0xCD, 0xEF]);
        assert_eq!(get(&b, create_qp::OUT_QPN), Some(0xAB_CDEF));
        // a 1-bit field in the middle of a dword, its neighbours untouched
        let mut c = [0xFFu8; 272];
        set(&mut c, create_qp::CD_SLAVE_SEND, 0);
        assert_eq!(c[0x55e / 8], 0b1111_1101, "bit 0x55e is bit 1 of byte 171");
        assert_eq!(get(&c, create_qp::CD_MASTER), Some(1));
        // a 64-bit field
        set(&mut c, create_qp::WQ_UMEM_OFFSET, 0x0102_0304_0506_0708);
        assert_eq!(&c[256..264], &[1, 2, 3, 4, 5, 6, 7, 8]);
        // too short a buffer: no value
        assert_eq!(get(&b, create_qp::WQ_UMEM_ID), None);
    }

    /// The mkey context lands where the kernel's `MLX5_SET(mkc, …)` puts it: byte 16 on.
    #[test]
    fn mkey_context_fields_sit_at_byte_16_on() {
        let mut b = [0u8; create_mkey::IN_BYTES];
        set(&mut b, mkc::FREE, 1);
        assert_eq!(b[16], 0x40);
        set(&mut b, mkc::UMR_EN, 1);
        set(&mut b, mkc::ACCESS_MODE_1_0, mkc::ACCESS_MODE_KLMS);
        assert_eq!(b[18], 0x82);
        set(&mut b, mkc::QPN, mkc::QPN_NONE);
        set(&mut b, mkc::MKEY_7_0, 0x5A);
        assert_eq!(&b[20..24], &[0xFF, 0xFF, 0xFF, 0x5A]);
        set(&mut b, mkc::EN_RINVAL, 1);
        set(&mut b, mkc::PD, 0x10);
        assert_eq!(&b[28..32], &[0x01, 0, 0, 0x10]);
        set(&mut b, mkc::TRANSLATIONS_OCTWORD_SIZE, 4);
        assert_eq!(&b[68..72], &[0, 0, 0, 4]);
        set(&mut b, mkc::LEN, 0x1000);
        assert_eq!(&b[40..48], &0x1000u64.to_be_bytes());
    }
}
