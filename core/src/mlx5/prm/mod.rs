//! PRM commands as a DEVX user sends them: byte buffers whose fields are big-endian bit ranges.
//!
//! Field offsets are from DPDK drivers/common/mlx5/mlx5_prm.h (main
//! 38f72e500b3b159eca3ba2f4ca0e46a26a7cb057), computed from each struct's field widths, and
//! checked against rdma-core 44.0 `providers/mlx5/mlx5_ifc.h` (tag v44.0,
//! e018d7f3876c315df29060d0a6c95b8abca2b09d — the version Debian's libibverbs-dev 44.0-2 is
//! built from) for every field that header has: the two agree on all of them. rdma-core's
//! header lacks some of what DEVX users need — the whole `cqc` and `create_cq_in`,
//! `create_qp_in.wq_umem_offset` and `qpc_ext`, `2rst_qp_in`, `cmd_hca_cap.sq_ts_format` /
//! `rq_ts_format` — those are DPDK's alone (each file says which). Neither header is installed
//! by a Debian package, so the golden tests carry hand-written bytes derived from those offsets.

pub mod bits;
pub mod cq;
pub mod hca_cap;
pub mod mkey;
pub mod qp;

pub use bits::Field;

/// Command opcodes, rdma-core v44.0 providers/mlx5/mlx5_ifc.h `enum { MLX5_CMD_OP_* }` and
/// DPDK mlx5_prm.h (same values).
pub mod op {
    pub const QUERY_HCA_CAP: u16 = 0x100;
    /// `MLX5_CMD_OP_CREATE_MKEY` / `QUERY_MKEY` / `DESTROY_MKEY` (Linux include/linux/mlx5/mlx5_ifc.h).
    pub const CREATE_MKEY: u16 = 0x200;
    pub const QUERY_MKEY: u16 = 0x201;
    pub const DESTROY_MKEY: u16 = 0x202;
    pub const CREATE_CQ: u16 = 0x400;
    pub const CREATE_QP: u16 = 0x500;
    pub const RST2INIT_QP: u16 = 0x502;
    pub const INIT2RTR_QP: u16 = 0x503;
    pub const RTR2RTS_QP: u16 = 0x504;
    /// `MLX5_CMD_OP_2RST_QP` (rdma-core v44.0 providers/mlx5/mlx5_ifc.h).
    pub const TO_RST_QP: u16 = 0x50a;
}

/// The header every command input starts with (`opcode` 16 bits at 0x0, `uid` at 0x10,
/// `op_mod` at 0x30).
pub const IN_OPCODE: Field = Field::new("opcode", 0x0, 0x10);
pub const IN_UID: Field = Field::new("uid", 0x10, 0x10);
pub const IN_OP_MOD: Field = Field::new("op_mod", 0x30, 0x10);
/// And every output (`status` 8 bits at 0x0, `syndrome` 32 bits at 0x20).
pub const OUT_STATUS: Field = Field::new("status", 0x0, 0x8);
pub const OUT_SYNDROME: Field = Field::new("syndrome", 0x20, 0x20);

/// Fail with the command's status and syndrome if its output says so (DEVX returns the
/// firmware's output even when the ioctl fails; the syndrome is what a bug report needs).
pub fn check_status(opcode: u16, out: &[u8]) -> Result<(), super::Mlx5Error> {
    let status = bits::get(out, OUT_STATUS)? as u8;
    if status != 0 {
        let syndrome = bits::get(out, OUT_SYNDROME)? as u32;
        return Err(super::Mlx5Error::CommandFailed { opcode, status, syndrome });
    }
    Ok(())
}
