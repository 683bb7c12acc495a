//! QUERY_HCA_CAP (0x100) and the capabilities offload needs: CORE-Direct (`cd`), type-2
//! windows (`imaicl`), RC, atomics and the extended (masked) atomics.
//!
//! Offsets: rdma-core v44.0 providers/mlx5/mlx5_ifc.h `struct mlx5_ifc_query_hca_cap_in_bits`,
//! `…_out_bits` (capability union at bit 0x80), `struct mlx5_ifc_cmd_hca_cap_bits` (line 1018:
//! `cd`, line 1023: `imaicl`) and `struct mlx5_ifc_atomic_caps_bits`; the same in DPDK
//! mlx5_prm.h and in Linux include/linux/mlx5/mlx5_ifc.h. Meanings: the kernel's mlx5_ib
//! (drivers/infiniband/hw/mlx5/main.c, `mlx5_ib_query_device`) advertises
//! `IB_DEVICE_MEM_WINDOW_TYPE_2B` exactly when `imaicl` is set; the atomic operation bits are
//! UCX src/uct/ib/mlx5/dv/ib_mlx5_ifc.h `UCT_IB_MLX5_ATOMIC_OPS_*`. The 8-byte atomic
//! endianness mode is 0 (big-endian) or 1 (host endianness); Linux mlx5_core switches a device
//! that supports it to host endianness at start-up (commit f91e6d8941bf, "net/mlx5_core: Add
//! setting ATOMIC endian mode") and mlx5_ib advertises `IB_ATOMIC_HCA` only then (da7525d2a9ae).
//! The mlx5-form chains keep MN memory little-endian and need host-endian atomics
//! (`crate::chain::mlx5`).

use super::{bits, check_status, op, Field, IN_OPCODE, IN_OP_MOD};
use crate::mlx5::Mlx5Error;

pub const QUERY_HCA_CAP_IN_LEN: usize = 16;
/// 0x8080 bits: the 16-byte header plus the 4096-byte capability union.
pub const QUERY_HCA_CAP_OUT_LEN: usize = 4112;
/// The capability union starts at bit 0x80 of the output.
pub const CAPABILITY_BASE: u32 = 0x80;

/// `op_mod` = capability type << 1 | current (1) — rdma-core `HCA_CAP_OPMOD_GET_CUR = 1`.
pub const OPMOD_GET_CUR: u16 = 1;
/// Capability types (Linux `enum mlx5_cap_type`: MLX5_CAP_GENERAL = 0, MLX5_CAP_ATOMIC = 3;
/// UCX `UCT_IB_MLX5_CAP_ATOMIC = 0x3`).
pub const CAP_GENERAL: u16 = 0;
pub const CAP_ATOMIC: u16 = 3;

/// General device capabilities (`cmd_hca_cap`), offsets relative to the capability.
pub mod general {
    use super::Field;
    pub const LOG_MAX_QP_SZ: Field = Field::new("log_max_qp_sz", 0x88, 0x8);
    pub const LOG_MAX_CQ_SZ: Field = Field::new("log_max_cq_sz", 0xc8, 0x8);
    pub const LOG_MAX_MKEY: Field = Field::new("log_max_mkey", 0xea, 0x6);
    pub const LOG_MAX_MSG: Field = Field::new("log_max_msg", 0x1c3, 0x5);
    pub const PORT_TYPE: Field = Field::new("port_type", 0x1b6, 0x2);
    pub const UMR_FENCE: Field = Field::new("umr_fence", 0x20a, 0x2);
    pub const ATOMIC: Field = Field::new("atomic", 0x21e, 0x1);
    pub const CD: Field = Field::new("cd", 0x22c, 0x1);
    pub const IMAICL: Field = Field::new("imaicl", 0x231, 0x1);
    pub const RC: Field = Field::new("rc", 0x23f, 0x1);
}

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
    /// 0: 8-byte atomic arguments are big-endian (what the mlx5-form chains assume).
    pub atomic_8b_endianness_mode: u8,
    pub log_max_qp_sz: u8,
    pub log_max_cq_sz: u8,
    pub log_max_mkey: u8,
    /// log2 of the largest message (what INIT2RTR's `log_msg_max` may say).
    pub log_max_msg: u8,
    pub umr_fence: u8,
}

impl HcaCaps {
    /// Parse the outputs of QUERY_HCA_CAP for [`CAP_GENERAL`] and (if the device has atomics)
    /// [`CAP_ATOMIC`]; a failed command's status and syndrome are the error.
    pub fn parse(general: &[u8], atomic_out: Option<&[u8]>) -> Result<Self, Mlx5Error> {
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
            ..Default::default()
        };
        if let Some(a) = atomic_out {
            check_status(op::QUERY_HCA_CAP, a)?;
            c.atomic_operations = cap_field(a, atomic::OPERATIONS)? as u16;
            c.atomic_size_qp = cap_field(a, atomic::SIZE_QP)? as u16;
            c.atomic_8b_endianness_mode = cap_field(a, atomic::REQ_8B_ENDIANNESS_MODE)? as u8;
        }
        Ok(c)
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
    /// The capability's name in mlx5_ifc.h, for messages.
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
            HcaCaps::parse(&out, None),
            Err(Mlx5Error::CommandFailed { opcode: 0x100, status: 3, syndrome: 0x1234_5678 })
        );
        assert!(matches!(HcaCaps::parse(&out[..8], None), Err(Mlx5Error::CommandFailed { .. })));
        assert_eq!(HcaCaps::parse(&[0u8; 8], None), Err(Mlx5Error::FieldOutOfRange { field: "cd" }));
    }
}
