//! Units the device counts in: 64-byte WQE basic blocks, 16-bit WQE indices and 24-bit CQ
//! indices.
//!
//! `MLX5_SEND_WQE_BB = 64`, `MLX5_SEND_WQE_SHIFT = 6` (mlx5dv.h:1224, rdma-core 44.0). The
//! control segment's `wqe_index` is 16 bits (`mlx5dv_set_ctrl_seg` shifts a `uint16_t pi`);
//! DPDK mlx5_prm.h defines `MLX5_WQ_INDEX_WIDTH 16` and `MLX5_CQ_INDEX_WIDTH 24`. `ds` counts
//! 16-byte units, so a WQE of `ds` units takes `ceil(ds / 4)` WQEBBs.

pub const WQEBB: usize = 64;
pub const WQEBB_SHIFT: u32 = 6;
/// 16-byte units per WQEBB.
pub const DS_PER_WQEBB: u8 = 4;
/// A WQE's `ds` is 6 bits in the hardware's view; the largest WQE this module builds is a
/// scatter READ of [`MAX_SCATTER_SGES`] data segments (ds 18, 5 WQEBBs); a bind takes 3.
pub const MAX_WQEBBS: usize = 5;
/// Data segments of one scatter READ: the chains' byte-order conversions (docs/MLX5.md) need
/// at most 16 (a 16-byte span, one byte each). ConnectX reports `max_send_sge` ≥ 16 (30 on
/// CX-5 with rdma-core's defaults) — an assumption the DEVX backend must check.
pub const MAX_SCATTER_SGES: usize = 16;

/// WQEBBs a WQE of `ds` 16-byte units occupies.
pub const fn wqebbs(ds: u8) -> usize {
    (ds as usize).div_ceil(DS_PER_WQEBB as usize)
}

/// A send-queue producer / WQE index: counts WQEBBs and wraps at 2^16.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub struct WqeIndex(u16);

impl WqeIndex {
    pub const fn new(v: u16) -> Self {
        WqeIndex(v)
    }
    pub const fn get(self) -> u16 {
        self.0
    }
    /// Advance by `n` WQEBBs, wrapping at 16 bits.
    pub const fn add(self, n: u16) -> Self {
        WqeIndex(self.0.wrapping_add(n))
    }
    /// The ring slot (in WQEBBs) of this index on a power-of-two ring.
    pub const fn slot(self, ring_wqebbs: usize) -> usize {
        self.0 as usize & (ring_wqebbs - 1)
    }
    /// WQEBBs from `earlier` to `self`, modulo 2^16.
    pub const fn since(self, earlier: WqeIndex) -> u16 {
        self.0.wrapping_sub(earlier.0)
    }
}

/// A CQ producer index as WAIT compares it: 24 bits, wrapping.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub struct CqIndex(u32);

impl CqIndex {
    pub const MASK: u32 = 0x00FF_FFFF;
    /// The index after `count` completions (any width; reduced modulo 2^24).
    pub const fn from_count(count: u64) -> Self {
        CqIndex((count & Self::MASK as u64) as u32)
    }
    pub const fn get(self) -> u32 {
        self.0
    }
    pub const fn add(self, n: u32) -> Self {
        CqIndex(self.0.wrapping_add(n) & Self::MASK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wqebb_accounting() {
        assert_eq!([wqebbs(1), wqebbs(2), wqebbs(4), wqebbs(5), wqebbs(8), wqebbs(12)], [1, 1, 1, 2, 2, 3]);
    }

    #[test]
    fn indices_wrap() {
        let i = WqeIndex::new(0xFFFE).add(3);
        assert_eq!(i.get(), 1);
        assert_eq!(i.since(WqeIndex::new(0xFFFE)), 3);
        assert_eq!(WqeIndex::new(0x1234).slot(256), 0x34);
        assert_eq!(CqIndex::from_count(0x1_0000_0005).get(), 5);
        assert_eq!(CqIndex::from_count(0xFF_FFFF).add(2).get(), 1);
    }
}
