//! mlx5 send-WQE opcodes and opcode modifiers (the low byte and the top byte of the control
//! segment's first dword).
//!
//! From `/usr/include/infiniband/mlx5dv.h` (rdma-core 44.0) `enum { MLX5_OPCODE_NOP = 0x00, …}`
//! except WAIT, SEND_EN and RECV_EN, which mlx5dv.h does not define: WAIT 0x0f and SEND_EN 0x17
//! with the WAIT opmods from DPDK drivers/common/mlx5/mlx5_prm.h (`MLX5_OPCODE_WAIT`,
//! `MLX5_OPCODE_SEND_EN`, `MLX5_OPC_MOD_WAIT_*`); RECV_EN 0x16 from MLNX_OFED libmlx5
//! (`MLX5_OPCODE_RECV_ENABLE`), not in any upstream header — only hardware can confirm it.
//! The golden test compares every value mlx5dv.h has.

pub const NOP: u8 = 0x00;
pub const SEND_INVAL: u8 = 0x01;
pub const RDMA_WRITE: u8 = 0x08;
pub const RDMA_WRITE_IMM: u8 = 0x09;
pub const SEND: u8 = 0x0a;
pub const SEND_IMM: u8 = 0x0b;
/// DPDK mlx5_prm.h `MLX5_OPCODE_WAIT 0x0fu`.
pub const WAIT: u8 = 0x0f;
pub const RDMA_READ: u8 = 0x10;
pub const ATOMIC_CS: u8 = 0x11;
pub const ATOMIC_FA: u8 = 0x12;
pub const ATOMIC_MASKED_CS: u8 = 0x14;
pub const ATOMIC_MASKED_FA: u8 = 0x15;
/// MLNX_OFED libmlx5 `MLX5_OPCODE_RECV_ENABLE` (no upstream definition).
pub const RECV_EN: u8 = 0x16;
/// DPDK mlx5_prm.h `MLX5_OPCODE_SEND_EN 0x17u`.
pub const SEND_EN: u8 = 0x17;
pub const UMR: u8 = 0x25;

/// WAIT opmods, DPDK mlx5_prm.h `MLX5_OPC_MOD_WAIT_CQ_PI 0u`, `_DATA 1u`, `_TIME 2u`.
pub const OPMOD_WAIT_CQ_PI: u8 = 0;
pub const OPMOD_WAIT_DATA: u8 = 1;
pub const OPMOD_WAIT_TIME: u8 = 2;

/// Extended (masked) atomic opmod for an argument of `2^log_arg_size` bytes: UCX
/// src/uct/ib/mlx5/ib_mlx5.h `UCT_IB_MLX5_OPMOD_EXT_ATOMIC(_log_arg_size) ((8) | ((_log_arg_size) - 2))`.
pub const fn opmod_ext_atomic(log_arg_size: u8) -> u8 {
    8 | (log_arg_size - 2)
}
/// The opmod of an 8-byte masked atomic (`opmod_ext_atomic(3)`).
pub const OPMOD_EXT_ATOMIC_8B: u8 = opmod_ext_atomic(3);
