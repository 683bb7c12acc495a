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
//!  11  1  fm_ce_se          fence mode (bits 7..5, an enum: [`FenceMode`]), completion
//!                            request (bits 3..2), solicited (bit 1): [`FmCeSe`]
//!  12  4  imm               BE32 immediate / invalidated rkey / UMR's mkey
//! ```

use zerocopy::big_endian::{U16, U32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const CTRL_SEG_SIZE: usize = 16;
/// Byte offset of `imm` in the control segment.
pub const IMM_OFFSET: usize = 12;

/// The fence mode, bits 7..5 of `fm_ce_se`: a 3-bit **enum**, not flags (5..7 are undefined).
///
/// Values: Linux include/linux/mlx5/qp.h `MLX5_FENCE_MODE_*` (the only header naming all
/// five). mlx5dv.h (rdma-core 44.0, line 1219) names two of them: `MLX5_WQE_CTRL_FENCE = 4 << 5`
/// — which is [`FenceMode::SmallAndFence`], not [`FenceMode::Fence`] — and
/// `MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE = 1 << 5`. [`FenceMode::for_wqe`] says which one a WQE
/// carries.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
#[repr(u8)]
pub enum FenceMode {
    #[default]
    None = 0,
    /// What every provider sets on the WQE after a UMR (bind, local invalidate) of the queue.
    InitiatorSmall = 1 << 5,
    /// IBTA's fence indicator (the kernel's `IB_SEND_FENCE` with no UMR before): the WQE waits
    /// for the queue's earlier RDMA READs and atomics.
    Fence = 2 << 5,
    /// The kernel's fence for a UMR itself on devices whose `umr_fence` capability asks for
    /// it (`mlx5_get_umr_fence`); omw never writes it.
    StrongOrdering = 3 << 5,
    /// Both the initiator small fence and the fence.
    SmallAndFence = 4 << 5,
}

/// What the previous WQE on a send queue asks of the next one: after a UMR (a type-2 bind or a
/// local invalidate) the next WQE carries the initiator small fence (rdma-core's `next_fence`,
/// kept across posts in `qp->fm_cache`; the kernel's `qp->next_fence`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub enum PrevWqe {
    #[default]
    Other,
    Umr,
}

impl FenceMode {
    /// The bits of `fm_ce_se` the mode occupies.
    pub const MASK: u8 = 0b111 << 5;

    /// The mode a WQE carries, from its own FENCE flag and the WQE before it — the providers'
    /// `get_fence`:
    ///
    /// | own FENCE | previous WQE | mode |
    /// |---|---|---|
    /// | no  | not a UMR | [`FenceMode::None`] |
    /// | no  | a UMR     | [`FenceMode::InitiatorSmall`] |
    /// | yes | a UMR     | [`FenceMode::SmallAndFence`] (4 << 5) |
    /// | yes | not a UMR | [`FenceMode::SmallAndFence`] (4 << 5) |
    ///
    /// The first three rows are what every provider does: rdma-core v44.0
    /// providers/mlx5/qp.c `mlx5_post_send` (lines 857–861: `fence = IBV_SEND_FENCE ?
    /// MLX5_WQE_CTRL_FENCE : next_fence`, `next_fence = MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE`
    /// after `IBV_WR_BIND_MW` / `IBV_WR_LOCAL_INV`, lines 919–980), MLNX_OFED libmlx5's
    /// `get_fence` (`fm_cache` set and FENCE → `MLX5_FENCE_MODE_SMALL_AND_FENCE`, ORed with
    /// its `fm_ce_se_tbl` entry `MLX5_WQE_CTRL_FENCE`) and the kernel's `mlx5_ib_post_send`
    /// (drivers/infiniband/hw/mlx5/wr.c: `qp->next_fence` set and `IB_SEND_FENCE` →
    /// `MLX5_FENCE_MODE_SMALL_AND_FENCE`). The last row is our choice: the user-space providers
    /// give a plain FENCEd WQE `MLX5_WQE_CTRL_FENCE` = 4 << 5 too (rdma-core: always; libmlx5:
    /// its table), the kernel gives it `MLX5_FENCE_MODE_FENCE` = 2 << 5. We follow the
    /// user-space providers because the DEVX rings are user-space rings like theirs, rdma-core's
    /// bytes are what the golden vectors compare, and 4 << 5 includes the fence the chains need
    /// (what it adds, the wait for an earlier UMR, only orders the WQE later still). No provider
    /// emits 5 << 5, which OR-ing the two mlx5dv.h constants as bit flags gave (issue 22
    /// item 9).
    pub const fn for_wqe(fenced: bool, prev: PrevWqe) -> FenceMode {
        match (fenced, prev) {
            (true, _) => FenceMode::SmallAndFence,
            (false, PrevWqe::Umr) => FenceMode::InitiatorSmall,
            (false, PrevWqe::Other) => FenceMode::None,
        }
    }
    /// The mode in bits 7..5 of `fm_ce_se`; `None` for the undefined values 5, 6, 7.
    pub const fn from_fm_ce_se(b: u8) -> Option<FenceMode> {
        match b >> 5 {
            0 => Some(FenceMode::None),
            1 => Some(FenceMode::InitiatorSmall),
            2 => Some(FenceMode::Fence),
            3 => Some(FenceMode::StrongOrdering),
            4 => Some(FenceMode::SmallAndFence),
            _ => None,
        }
    }
    /// Whether the WQE waits for its queue's earlier RDMA READs and atomics (IBTA's fence).
    pub const fn fences_reads_and_atomics(self) -> bool {
        matches!(self, FenceMode::Fence | FenceMode::StrongOrdering | FenceMode::SmallAndFence)
    }
    /// Whether the WQE waits for its queue's previous UMR.
    pub const fn waits_for_umr(self) -> bool {
        matches!(self, FenceMode::InitiatorSmall | FenceMode::StrongOrdering | FenceMode::SmallAndFence)
    }
}

bitflags::bitflags! {
    /// The completion and solicited-event bits of `fm_ce_se`, mlx5dv.h:1217 (`MLX5_WQE_CTRL_*`).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
    pub struct CeSe: u8 {
        /// `MLX5_WQE_CTRL_SOLICITED = 1 << 1`.
        const SOLICITED = 1 << 1;
        /// `MLX5_WQE_CTRL_CQ_UPDATE = 2 << 2`: generate a CQE.
        const CQ_UPDATE = 2 << 2;
    }
}

/// The `fm_ce_se` byte: a fence mode and the completion / solicited bits. Only the forms
/// [`super::encode`] produces decode: a defined fence mode, `ce` 0 or 2, bits 0 and 4 clear.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct FmCeSe {
    pub fence: FenceMode,
    pub flags: CeSe,
}

impl FmCeSe {
    pub const fn new(fence: FenceMode, flags: CeSe) -> Self {
        FmCeSe { fence, flags }
    }
    pub const fn bits(self) -> u8 {
        self.fence as u8 | self.flags.bits()
    }
    /// `None` for a byte `encode` never writes (an undefined fence mode, `ce` 1 or 3, bit 0 or
    /// 4 set).
    pub const fn from_bits(b: u8) -> Option<Self> {
        let Some(fence) = FenceMode::from_fm_ce_se(b) else { return None };
        match CeSe::from_bits(b & !FenceMode::MASK) {
            Some(flags) => Some(FmCeSe { fence, flags }),
            None => None,
        }
    }
    pub const fn signaled(self) -> bool {
        self.flags.contains(CeSe::CQ_UPDATE)
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
        let c =
            CtrlSeg::new(0xBEEF, 0x10, 0x09, 0x12_3456, FmCeSe::new(FenceMode::None, CeSe::CQ_UPDATE), 3, 0xA1B2_C3D4);
        assert_eq!(c.as_bytes(), &[0x09, 0xBE, 0xEF, 0x10, 0x12, 0x34, 0x56, 3, 0, 0, 0, 0x08, 0xA1, 0xB2, 0xC3, 0xD4]);
        assert_eq!((c.opcode(), c.opmod(), c.wqe_index(), c.qpn(), c.ds()), (0x10, 0x09, 0xBEEF, 0x12_3456, 3));
    }

    #[test]
    fn fence_modes_are_an_enum() {
        // every defined mode round-trips; 5..7 are refused, not read as flags
        for m in [
            FenceMode::None,
            FenceMode::InitiatorSmall,
            FenceMode::Fence,
            FenceMode::StrongOrdering,
            FenceMode::SmallAndFence,
        ] {
            assert_eq!(FenceMode::from_fm_ce_se(m as u8 | 0x0a), Some(m));
        }
        for v in 5u8..8 {
            assert_eq!(FenceMode::from_fm_ce_se(v << 5), None);
            assert_eq!(FmCeSe::from_bits(v << 5), None);
        }
        // the byte an OR of INITIATOR_SMALL_FENCE and MLX5_WQE_CTRL_FENCE made (issue 22)
        assert_eq!(FmCeSe::from_bits(0xa8), None);
        // get_fence: a FENCEd WQE after a bind is 0x88 with its completion, as rdma-core
        let f = FmCeSe::new(FenceMode::for_wqe(true, PrevWqe::Umr), CeSe::CQ_UPDATE);
        assert_eq!(f.bits(), 0x88);
        assert_eq!(FenceMode::for_wqe(false, PrevWqe::Umr), FenceMode::InitiatorSmall);
        assert_eq!(FenceMode::for_wqe(false, PrevWqe::Other), FenceMode::None);
        assert_eq!(FenceMode::for_wqe(true, PrevWqe::Other), FenceMode::SmallAndFence);
        // ce 1 / 3 and the reserved bits are not forms encode writes
        for b in [0x04u8, 0x0c, 0x01, 0x10] {
            assert_eq!(FmCeSe::from_bits(b), None, "{b:#04x}");
        }
        assert!(FenceMode::SmallAndFence.fences_reads_and_atomics() && FenceMode::SmallAndFence.waits_for_umr());
        assert!(FenceMode::Fence.fences_reads_and_atomics() && !FenceMode::Fence.waits_for_umr());
        assert!(!FenceMode::InitiatorSmall.fences_reads_and_atomics());
    }
}
