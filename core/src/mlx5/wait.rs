//! The queue segment of WAIT, SEND_EN and RECV_EN: CORE-Direct's cross-channel operations.
//!
//! Not in mlx5dv.h. Layout from DPDK drivers/common/mlx5/mlx5_prm.h (main
//! 38f72e500b3b159eca3ba2f4ca0e46a26a7cb057) `struct mlx5_wqe_qseg { reserved0; reserved1;
//! max_index; qpn_cqn; }`, used big-endian by drivers/net/mlx5/mlx5_txpp.c
//! (`mlx5_txpp_fill_wqe_rearm_queue`: SEND_EN and WAIT, ds = 2) and
//! drivers/crypto/mlx5/mlx5_crypto_gcm.c (`mlx5_crypto_gcm_build_send_en`):
//!
//! ```text
//! off len field
//!   0  4  reserved0
//!   4  4  reserved1
//!   8  4  max_index   BE32. WAIT (opmod WAIT_CQ_PI): the CQ producer index to wait for,
//!                     24 bits (mlx5_txpp.c masks with MLX5_CQ_INDEX_WIDTH = 24).
//!                     SEND_EN: the slave SQ's WQE index it may execute up to, 16 bits
//!                     (MLX5_WQ_INDEX_WIDTH = 16).
//!  12  4  qpn_cqn     BE32: WAIT: the CQ number; SEND_EN / RECV_EN: the slave QP number
//! ```
//!
//! A WAIT/ENABLE WQE is the control segment plus this one: 32 bytes, ds = 2, one WQEBB.

use super::wqebb::{CqIndex, WqeIndex};
use zerocopy::big_endian::U32;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const QSEG_SIZE: usize = 16;
pub const MAX_INDEX_OFFSET: usize = 8;
pub const QPN_CQN_OFFSET: usize = 12;

#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct QueueSeg {
    pub reserved0: U32,
    pub reserved1: U32,
    pub max_index: U32,
    pub qpn_cqn: U32,
}

const _: () = assert!(core::mem::size_of::<QueueSeg>() == QSEG_SIZE);

impl QueueSeg {
    /// WAIT (opmod `WAIT_CQ_PI`) until CQ `cqn` has produced up to `pi`.
    pub fn wait_cq(cqn: u32, pi: CqIndex) -> Self {
        QueueSeg { max_index: U32::new(pi.get()), qpn_cqn: U32::new(cqn & 0x00FF_FFFF), ..Default::default() }
    }
    /// SEND_EN / RECV_EN: let QP `qpn`'s managed queue run up to WQE index `index`.
    pub fn enable(qpn: u32, index: WqeIndex) -> Self {
        QueueSeg { max_index: U32::new(index.get() as u32), qpn_cqn: U32::new(qpn & 0x00FF_FFFF), ..Default::default() }
    }
}
