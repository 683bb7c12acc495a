//! QUERY_HCA_CAP (0x100) and the capabilities offload needs: CORE-Direct (`cd`), type-2
//! windows (`imaicl`), RC, atomics and the extended (masked) atomics, and the timestamp format
//! a QP must be created with.
//!
//! Offsets: DPDK main 38f72e500b3b159eca3ba2f4ca0e46a26a7cb057 drivers/common/mlx5/mlx5_prm.h
//! `struct mlx5_ifc_query_hca_cap_in_bits`, `…_out_bits` (capability union at bit 0x80),
//! `struct mlx5_ifc_cmd_hca_cap_bits`, `struct mlx5_ifc_atomic_caps_bits` and
//! `struct mlx5_ifc_roce_caps_bits`, each offset computed from the struct's field widths.
//! rdma-core v44.0 providers/mlx5/mlx5_ifc.h gives the same offsets for every field it has
//! (`cmd_hca_cap` line 1018: `cd`, line 1023: `imaicl`; `atomic_caps`; `roce_cap.qp_ts_format`)
//! but lacks `sq_ts_format` / `rq_ts_format` (its `reserved_at_440[0x4]`); Linux
//! include/linux/mlx5/mlx5_ifc.h has those two at 0x440 too (right after the 64-bit
//! `general_obj_types` at 0x400). Meanings: the kernel's mlx5_ib
//! (drivers/infiniband/hw/mlx5/main.c, `mlx5_ib_query_device`) advertises
//! `IB_DEVICE_MEM_WINDOW_TYPE_2B` exactly when `imaicl` is set; the atomic operation bits are
//! UCX src/uct/ib/mlx5/dv/ib_mlx5_ifc.h `UCT_IB_MLX5_ATOMIC_OPS_*`. The 8-byte atomic
//! endianness mode is 0 (big-endian) or 1 (host endianness), Linux
//! drivers/net/ethernet/mellanox/mlx5/core/main.c `MLX5_ATOMIC_REQ_MODE_BE = 0x0`,
//! `MLX5_ATOMIC_REQ_MODE_HOST_ENDIANNESS = 0x1`; `handle_hca_cap_atomic` there switches a device
//! that supports mode 1 to it at start-up (commit f91e6d8941bf, "net/mlx5_core: Add setting
//! ATOMIC endian mode") and mlx5_ib advertises `IB_ATOMIC_HCA` only then (da7525d2a9ae).
//! The mlx5-form chains keep MN memory little-endian and need mode 1 (`crate::chain::mlx5`).

use super::{bits, check_status, op, Field, IN_OPCODE, IN_OP_MOD};
use crate::mlx5::Mlx5Error;

pub const QUERY_HCA_CAP_IN_LEN: usize = 16;
/// 0x8080 bits: the 16-byte header plus the 4096-byte capability union.
pub const QUERY_HCA_CAP_OUT_LEN: usize = 4112;
/// The capability union starts at bit 0x80 of the output.
pub const CAPABILITY_BASE: u32 = 0x80;

/// `op_mod` = capability type << 1 | current (1) — rdma-core `HCA_CAP_OPMOD_GET_CUR = 1`.
pub const OPMOD_GET_CUR: u16 = 1;
/// Capability types (Linux `enum mlx5_cap_type`: MLX5_CAP_GENERAL = 0, MLX5_CAP_ATOMIC = 3,
/// MLX5_CAP_ROCE = 4; UCX `UCT_IB_MLX5_CAP_ATOMIC = 0x3`; DPDK mlx5_prm.h
/// `MLX5_GET_HCA_CAP_OP_MOD_ROCE = 0x4 << 1`).
pub const CAP_GENERAL: u16 = 0;
pub const CAP_ATOMIC: u16 = 3;
pub const CAP_ROCE: u16 = 4;

/// General device capabilities (`cmd_hca_cap`), offsets relative to the capability.
pub mod general {
    use super::Field;
    pub const LOG_MAX_QP_SZ: Field = Field::new("log_max_qp_sz", 0x88, 0x8);
    pub const LOG_MAX_CQ_SZ: Field = Field::new("log_max_cq_sz", 0xc8, 0x8);
    pub const LOG_MAX_MKEY: Field = Field::new("log_max_mkey", 0xea, 0x6);
    pub const LOG_MAX_MSG: Field = Field::new("log_max_msg", 0x1c3, 0x5);
    pub const PORT_TYPE: Field = Field::new("port_type", 0x1b6, 0x2);
    pub const UMR_FENCE: Field = Field::new("umr_fence", 0x20a, 0x2);
    pub const ROCE: Field = Field::new("roce", 0x21d, 0x1);
    pub const ATOMIC: Field = Field::new("atomic", 0x21e, 0x1);
    pub const CD: Field = Field::new("cd", 0x22c, 0x1);
    pub const IMAICL: Field = Field::new("imaicl", 0x231, 0x1);
    pub const RC: Field = Field::new("rc", 0x23f, 0x1);
    /// The timestamp formats the device's SQs and RQs support (DPDK mlx5_prm.h
    /// `MLX5_HCA_CAP_TIMESTAMP_FORMAT_*`: [`super::TS_CAP_FREE_RUNNING`] …).
    pub const SQ_TS_FORMAT: Field = Field::new("sq_ts_format", 0x440, 0x2);
    pub const RQ_TS_FORMAT: Field = Field::new("rq_ts_format", 0x442, 0x2);
}

/// RoCE capabilities (`roce_caps`), offsets relative to the capability.
pub mod roce {
    use super::Field;
    /// The timestamp formats the device's RoCE QPs support.
    pub const QP_TS_FORMAT: Field = Field::new("qp_ts_format", 0x1e, 0x2);
}

/// Capability values of `sq_ts_format`, `rq_ts_format` and `roce_caps.qp_ts_format` (DPDK
/// mlx5_prm.h `MLX5_HCA_CAP_TIMESTAMP_FORMAT_FR` / `_RT` / `_FR_RT`; Linux
/// `MLX5_TIMESTAMP_FORMAT_CAP_*`): free running only, real time only, both.
pub const TS_CAP_FREE_RUNNING: u8 = 0;
pub const TS_CAP_REAL_TIME: u8 = 1;
pub const TS_CAP_FREE_RUNNING_AND_REAL_TIME: u8 = 2;
/// Values of `qpc.ts_format` (DPDK `MLX5_QPC_TIMESTAMP_FORMAT_*`, Linux
/// `MLX5_TIMESTAMP_FORMAT_*`).
pub const QPC_TS_FORMAT_FREE_RUNNING: u8 = 0;
pub const QPC_TS_FORMAT_DEFAULT: u8 = 1;

/// Atomic capabilities (`atomic_caps`), offsets relative to the capability.
pub mod atomic {
    use super::Field;
    pub const REQ_8B_ENDIANNESS_MODE: Field = Field::new("atomic_req_8B_endianness_mode", 0x40, 0x2);
    /// Linux include/linux/mlx5/device.h `MLX5_ATOMIC_REQ_MODE_HOST_ENDIANNESS`.
    pub const REQ_MODE_HOST_ENDIANNESS: u8 = 1;
    pub const OPERATIONS: Field = Field::new("atomic_operations", 0x90, 0x10);
    pub const SIZE_QP: Field = Field::new("atomic_size_qp", 0xb0, 0x10);
    /// `atomic_operations` bits.
    pub const OPS_CMP_SWAP: u64 = 1 << 0;
    pub const OPS_FETCH_ADD: u64 = 1 << 1;
    pub const OPS_MASKED_CMP_SWAP: u64 = 1 << 2;
    pub const OPS_MASKED_FETCH_ADD: u64 = 1 << 3;
    /// `atomic_size_qp` bit for 8-byte arguments (`MLX5_ATOMIC_CAPS_ATOMIC_SIZE_QP_8_BYTES`).
    pub const SIZE_8_BYTES: u64 = 0x8;
}

/// The QUERY_HCA_CAP input for capability type `cap` (current values).
pub fn query_hca_cap_in(cap: u16) -> Result<[u8; QUERY_HCA_CAP_IN_LEN], Mlx5Error> {
    let mut b = [0u8; QUERY_HCA_CAP_IN_LEN];
    bits::set(&mut b, IN_OPCODE, op::QUERY_HCA_CAP as u64)?;
    bits::set(&mut b, IN_OP_MOD, ((cap << 1) | OPMOD_GET_CUR) as u64)?;
    Ok(b)
}

/// Read a capability field from a QUERY_HCA_CAP output.
pub fn cap_field(out: &[u8], f: Field) -> Result<u64, Mlx5Error> {
    bits::get(out, f.at(CAPABILITY_BASE))
}

/// What offload needs to know about a device, from its general and atomic capabilities.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct HcaCaps {
    /// CORE-Direct: cross-channel WAIT / SEND_EN and the `cd_*` QP attributes.
    pub cd: bool,
    /// Type-2 memory windows (`IB_DEVICE_MEM_WINDOW_TYPE_2B` in mlx5_ib).
    pub imaicl: bool,
    pub rc: bool,
    pub atomic: bool,
    pub atomic_operations: u16,
    pub atomic_size_qp: u16,
    /// 0: 8-byte atomic arguments are big-endian; 1: host endianness — what the mlx5-form chains
    /// need (their counters are little-endian MN memory), and what Linux mlx5_core sets.
    pub atomic_8b_endianness_mode: u8,
    pub log_max_qp_sz: u8,
    pub log_max_cq_sz: u8,
    pub log_max_mkey: u8,
    /// log2 of the largest message (what INIT2RTR's `log_msg_max` may say).
    pub log_max_msg: u8,
    pub umr_fence: u8,
    /// The device speaks RoCE (its RoCE capabilities were queried).
    pub roce: bool,
    /// The timestamp formats its SQs / RQs support (`TS_CAP_*`).
    pub sq_ts_format: u8,
    pub rq_ts_format: u8,
    /// The timestamp formats its RoCE QPs support, when the device speaks RoCE.
    pub roce_qp_ts_format: Option<u8>,
}

impl HcaCaps {
    /// Parse the outputs of QUERY_HCA_CAP for [`CAP_GENERAL`], (if the device has atomics)
    /// [`CAP_ATOMIC`] and (if it speaks RoCE) [`CAP_ROCE`]; a failed command's status and
    /// syndrome are the error.
    pub fn parse(general: &[u8], atomic_out: Option<&[u8]>, roce_out: Option<&[u8]>) -> Result<Self, Mlx5Error> {
        check_status(op::QUERY_HCA_CAP, general)?;
        let g = |f| cap_field(general, f);
        let mut c = HcaCaps {
            cd: g(general::CD)? == 1,
            imaicl: g(general::IMAICL)? == 1,
            rc: g(general::RC)? == 1,
            atomic: g(general::ATOMIC)? == 1,
            log_max_qp_sz: g(general::LOG_MAX_QP_SZ)? as u8,
            log_max_cq_sz: g(general::LOG_MAX_CQ_SZ)? as u8,
            log_max_mkey: g(general::LOG_MAX_MKEY)? as u8,
            log_max_msg: g(general::LOG_MAX_MSG)? as u8,
            umr_fence: g(general::UMR_FENCE)? as u8,
            roce: g(general::ROCE)? == 1,
            sq_ts_format: g(general::SQ_TS_FORMAT)? as u8,
            rq_ts_format: g(general::RQ_TS_FORMAT)? as u8,
            ..Default::default()
        };
        if let Some(r) = roce_out {
            check_status(op::QUERY_HCA_CAP, r)?;
            c.roce_qp_ts_format = Some(cap_field(r, roce::QP_TS_FORMAT)? as u8);
        }
        if let Some(a) = atomic_out {
            check_status(op::QUERY_HCA_CAP, a)?;
            c.atomic_operations = cap_field(a, atomic::OPERATIONS)? as u16;
            c.atomic_size_qp = cap_field(a, atomic::SIZE_QP)? as u16;
            c.atomic_8b_endianness_mode = cap_field(a, atomic::REQ_8B_ENDIANNESS_MODE)? as u8;
        }
        Ok(c)
    }
    /// The `qpc.ts_format` a QP of this device is created with: DEFAULT when the device supports
    /// real-time stamps (alone or with free running), FREE_RUNNING when only that — the RoCE
    /// QPs' capability when the device speaks RoCE, the SQs' otherwise. This is Linux
    /// include/linux/mlx5/qp.h `mlx5_get_qp_default_ts` (`mlx5_get_roce_state(dev) ?
    /// MLX5_CAP_ROCE(dev, qp_ts_format) : MLX5_CAP_GEN(dev, sq_ts_format)`, non-zero →
    /// DEFAULT) and DPDK's `mlx5_ts_format_conv` applied to `qp_ts_format` for its RC QPs
    /// (drivers/crypto/mlx5/mlx5_crypto_gcm.c, the CORE-Direct user). Firmware refuses a
    /// CREATE_QP whose format the device does not support, which a hard-coded 0 (free running)
    /// risks on a real-time-only device.
    pub fn qp_ts_format(&self) -> u8 {
        let cap = self.roce_qp_ts_format.unwrap_or(self.sq_ts_format);
        if cap == TS_CAP_FREE_RUNNING {
            QPC_TS_FORMAT_FREE_RUNNING
        } else {
            QPC_TS_FORMAT_DEFAULT
        }
    }
    /// 8-byte masked fetch-and-add in host endianness: what the chains' queue-counter,
    /// key-byte and lap-counter updates on little-endian MN memory use. (That the extended,
    /// masked atomics follow the mode like the standard ones is for hardware to confirm.)
    pub fn masked_fetch_add_8b(&self) -> bool {
        self.atomic
            && self.atomic_operations as u64 & atomic::OPS_MASKED_FETCH_ADD != 0
            && self.atomic_size_qp as u64 & atomic::SIZE_8_BYTES != 0
            && self.atomic_8b_endianness_mode == atomic::REQ_MODE_HOST_ENDIANNESS
    }
    /// The first capability offload lacks, if any.
    pub fn missing_for_offload(&self) -> Option<MissingCap> {
        if !self.rc {
            Some(MissingCap::Rc)
        } else if !self.cd {
            Some(MissingCap::CoreDirect)
        } else if !self.imaicl {
            Some(MissingCap::Type2Windows)
        } else if !self.masked_fetch_add_8b() {
            Some(MissingCap::MaskedFetchAdd)
        } else {
            None
        }
    }
}

/// A capability offload needs and the device does not report.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum MissingCap {
    Rc,
    CoreDirect,
    Type2Windows,
    MaskedFetchAdd,
}

impl MissingCap {
    /// The capability's name in the PRM structs (mlx5_ifc.h, mlx5_prm.h), for messages.
    pub const fn field(self) -> &'static str {
        match self {
            MissingCap::Rc => "cmd_hca_cap.rc",
            MissingCap::CoreDirect => "cmd_hca_cap.cd",
            MissingCap::Type2Windows => "cmd_hca_cap.imaicl",
            MissingCap::MaskedFetchAdd => {
                "atomic_caps.atomic_operations bit 3 (masked fetch-add), atomic_size_qp 8 B, atomic_req_8B_endianness_mode 1 (host endianness)"
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_in_bytes() {
        // opcode 0x0100 in bytes 0..2, op_mod (3 << 1 | 1) = 7 in bytes 6..8
        assert_eq!(query_hca_cap_in(CAP_ATOMIC).unwrap(), [1, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(query_hca_cap_in(CAP_GENERAL).unwrap()[6..8], [0, 1]);
    }

    #[test]
    fn failed_query_is_reported_with_syndrome() {
        let mut out = [0u8; QUERY_HCA_CAP_OUT_LEN];
        out[0] = 0x03;
        out[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        assert_eq!(
            HcaCaps::parse(&out, None, None),
            Err(Mlx5Error::CommandFailed { opcode: 0x100, status: 3, syndrome: 0x1234_5678 })
        );
        assert!(matches!(HcaCaps::parse(&out[..8], None, None), Err(Mlx5Error::CommandFailed { .. })));
        assert_eq!(HcaCaps::parse(&[0u8; 8], None, None), Err(Mlx5Error::FieldOutOfRange { field: "cd" }));
        // a failed RoCE query is reported too
        let ok = [0u8; QUERY_HCA_CAP_OUT_LEN];
        assert!(matches!(HcaCaps::parse(&ok, None, Some(&out)), Err(Mlx5Error::CommandFailed { .. })));
    }

    /// Capability bytes for each timestamp format: `sq_ts_format` (cap bit 0x440, 2 bits →
    /// dword 34 of the capability, shift 30 → output byte 16 + 136, bits 7..6), `rq_ts_format`
    /// (0x442 → the same byte, bits 5..4), `roce_caps.qp_ts_format` (0x1e, 2 bits → dword 0,
    /// shift 0 → output byte 16 + 3, bits 1..0).
    #[test]
    fn ts_format_follows_the_capability() {
        let general = |sq: u8, rq: u8, roce: bool| {
            let mut g = [0u8; QUERY_HCA_CAP_OUT_LEN];
            g[16 + 136] = sq << 6 | rq << 4;
            if roce {
                // roce (0x21d → output byte 16 + 67, bit 2)
                g[16 + 67] |= 0x04;
            }
            g
        };
        let roce_caps = |qp: u8| {
            let mut r = [0u8; QUERY_HCA_CAP_OUT_LEN];
            r[16 + 3] = qp;
            r
        };
        for (cap, want) in [
            (TS_CAP_FREE_RUNNING, QPC_TS_FORMAT_FREE_RUNNING),
            (TS_CAP_REAL_TIME, QPC_TS_FORMAT_DEFAULT),
            (TS_CAP_FREE_RUNNING_AND_REAL_TIME, QPC_TS_FORMAT_DEFAULT),
        ] {
            // not RoCE: the SQs' capability
            let c = HcaCaps::parse(&general(cap, 3 - cap, false), None, None).unwrap();
            assert_eq!((c.roce, c.sq_ts_format, c.rq_ts_format), (false, cap, 3 - cap));
            assert_eq!(c.qp_ts_format(), want, "sq_ts_format {cap}");
            // RoCE: the RoCE QPs' capability, whatever the SQs say
            let other = if cap == TS_CAP_FREE_RUNNING { TS_CAP_REAL_TIME } else { TS_CAP_FREE_RUNNING };
            let c = HcaCaps::parse(&general(other, 0, true), None, Some(&roce_caps(cap))).unwrap();
            assert!(c.roce);
            assert_eq!((c.roce_qp_ts_format, c.qp_ts_format()), (Some(cap), want), "qp_ts_format {cap}");
        }
        assert_eq!(query_hca_cap_in(CAP_ROCE).unwrap()[6..8], [0, 9]);
    }
}
