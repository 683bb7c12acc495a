//! The control segment: the first 16 bytes of every send WQE.
//!
//! `struct mlx5_wqe_ctrl_seg`, /usr/include/infiniband/mlx5dv.h:1250 (rdma-core 44.0), filled
//! as `mlx5dv_set_ctrl_seg` (mlx5dv.h:1437) does:
//!
//! ```text
//! off len field
//!   0  4  opmod_idx_opcode  BE32: opmod << 24 | wqe_index (16 bit, in WQEBBs) << 8 | opcode
//!   4  4  qpn_ds            BE32: qpn << 8 | ds (WQE size in 16-byte units)
//!   8  1  signature
//!   9  2  dci_stream_channel_id BE16 (DC only; zero here)
//!  11  1  fm_ce_se          fence mode, completion request, solicited (see [`FmCeSe`])
//!  12  4  imm               BE32 immediate / invalidated rkey / UMR's mkey
//! ```

use zerocopy::big_endian::{U16, U32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const CTRL_SEG_SIZE: usize = 16;
/// Byte offset of `imm` in the control segment.
pub const IMM_OFFSET: usize = 12;

bitflags::bitflags! {
    /// `fm_ce_se`, mlx5dv.h:1217 (`MLX5_WQE_CTRL_*`).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
    pub struct FmCeSe: u8 {
        /// `MLX5_WQE_CTRL_SOLICITED = 1 << 1`.
        const SOLICITED = 1 << 1;
        /// `MLX5_WQE_CTRL_CQ_UPDATE = 2 << 2`: generate a CQE.
        const CQ_UPDATE = 2 << 2;
        /// `MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE = 1 << 5`: rdma-core sets it on the WQE after a
        /// BIND_MW / LOCAL_INV (providers/mlx5/qp.c `next_fence`).
        const INITIATOR_SMALL_FENCE = 1 << 5;
        /// `MLX5_WQE_CTRL_FENCE = 4 << 5`: wait for earlier RDMA READs / atomics.
        const FENCE = 4 << 5;
    }
}

#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct CtrlSeg {
    pub opmod_idx_opcode: U32,
    pub qpn_ds: U32,
    pub signature: u8,
    pub dci_stream_channel_id: U16,
    pub fm_ce_se: u8,
    pub imm: U32,
}

const _: () = assert!(core::mem::size_of::<CtrlSeg>() == CTRL_SEG_SIZE);

impl CtrlSeg {
    /// `mlx5dv_set_ctrl_seg(seg, pi, opcode, opmod, qp_num, fm_ce_se, ds, signature, imm)`
    /// with `imm` given as a host value (stored big-endian). The QP number is cut to 24 bits
    /// as the C shift does; callers validate it first.
    pub fn new(pi: u16, opcode: u8, opmod: u8, qpn: u32, fm_ce_se: FmCeSe, ds: u8, imm: u32) -> Self {
        CtrlSeg {
            opmod_idx_opcode: U32::new(((opmod as u32) << 24) | ((pi as u32) << 8) | opcode as u32),
            qpn_ds: U32::new(((qpn & 0x00FF_FFFF) << 8) | ds as u32),
            signature: 0,
            dci_stream_channel_id: U16::new(0),
            fm_ce_se: fm_ce_se.bits(),
            imm: U32::new(imm),
        }
    }
    pub fn opcode(&self) -> u8 {
        self.opmod_idx_opcode.get() as u8
    }
    pub fn opmod(&self) -> u8 {
        (self.opmod_idx_opcode.get() >> 24) as u8
    }
    pub fn wqe_index(&self) -> u16 {
        (self.opmod_idx_opcode.get() >> 8) as u16
    }
    pub fn qpn(&self) -> u32 {
        self.qpn_ds.get() >> 8
    }
    /// WQE size in 16-byte units.
    pub fn ds(&self) -> u8 {
        self.qpn_ds.get() as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip() {
        let c = CtrlSeg::new(0xBEEF, 0x10, 0x09, 0x12_3456, FmCeSe::CQ_UPDATE, 3, 0xA1B2_C3D4);
        assert_eq!(c.as_bytes(), &[0x09, 0xBE, 0xEF, 0x10, 0x12, 0x34, 0x56, 3, 0, 0, 0, 0x08, 0xA1, 0xB2, 0xC3, 0xD4]);
        assert_eq!((c.opcode(), c.opmod(), c.wqe_index(), c.qpn(), c.ds()), (0x10, 0x09, 0xBEEF, 0x12_3456, 3));
    }
}
