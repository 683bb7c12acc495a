//! Doorbells: telling the device a queue has new entries (or that CQEs were consumed).
//!
//! As rdma-core does it (providers/mlx5/qp.c v44.0, `mlx5_post_send` lines 767–798): a
//! barrier, the doorbell record's send word (`MLX5_SND_DBR = 1`, mlx5dv.h:71) gets the new
//! producer index `& 0xffff` big-endian, then the first 8 bytes of the last WQE's control
//! segment are written to the UAR's doorbell register. Receive: `MLX5_RCV_DBR = 0` gets the
//! head `& 0xffff` (qp.c:3896). CQ: word `MLX5_CQ_SET_CI = 0` gets the consumer index
//! `& 0xffffff` (cq.c:161). DPDK writes the DEVX UAR's `reg_addr` directly (no BlueFlame
//! alternation), which is what [`super::DevxApi::write_uar`] does.

use super::api::DevxApi;
use super::queue::{DevxCq, DevxQp};
use omw_core::mlx5::wqebb::WqeIndex;

pub const RCV_DBR: usize = 0;
pub const SND_DBR: usize = 1;
pub const CQ_SET_CI: usize = 0;

/// Ring the send queue of `qp` after writing WQEs up to producer index `pi`; `last_ctrl` is
/// the control segment of the last WQE written.
pub fn ring_sq<A: DevxApi>(api: &mut A, qp: &DevxQp, pi: WqeIndex, last_ctrl: &[u8; 16]) {
    api.write_dbr(qp.dbr_addr + 4 * SND_DBR, (pi.get() as u32).to_be_bytes());
    let mut first8 = [0u8; 8];
    first8.copy_from_slice(&last_ctrl[..8]);
    api.write_uar(qp.uar, first8);
}

/// Publish receive entries up to `head` (16-bit wrapping count of posted receives).
pub fn ring_rq<A: DevxApi>(api: &mut A, qp: &DevxQp, head: u32) {
    api.write_dbr(qp.dbr_addr + 4 * RCV_DBR, (head & 0xffff).to_be_bytes());
}

/// Tell the device CQEs up to consumer index `ci` have been consumed.
pub fn update_cq_ci<A: DevxApi>(api: &mut A, cq: &DevxCq, ci: u32) {
    api.write_dbr(cq.dbr_addr + 4 * CQ_SET_CI, (ci & 0x00ff_ffff).to_be_bytes());
}
