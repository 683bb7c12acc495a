//! NOP: a one-WQEBB WQE that does nothing. The layout pads with NOPs where a multi-WQEBB WQE
//! would cross the ring's end, so that every WQE — and every field a chain patches — is
//! contiguous in memory.
//!
//! Opcode `MLX5_OPCODE_NOP = 0x00` (mlx5dv.h:1022, rdma-core 44.0); the control segment alone,
//! ds = 1.

use super::ctrl::{CtrlSeg, FmCeSe};
use super::opcode;

pub fn nop(pi: u16, qpn: u32, fm_ce_se: FmCeSe) -> CtrlSeg {
    CtrlSeg::new(pi, opcode::NOP, 0, qpn, fm_ce_se, 1, 0)
}
