//! The data (scatter/gather) segment: one local buffer.
//!
//! `struct mlx5_wqe_data_seg`, /usr/include/infiniband/mlx5dv.h:1244 (rdma-core 44.0), filled
//! as `mlx5dv_set_data_seg` (mlx5dv.h:1537):
//!
//! ```text
//! off len field
//!   0  4  byte_count  BE32
//!   4  4  lkey        BE32
//!   8  8  addr        BE64
//! ```

use zerocopy::big_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const DATA_SEG_SIZE: usize = 16;
pub const BYTE_COUNT_OFFSET: usize = 0;
pub const LKEY_OFFSET: usize = 4;
pub const ADDR_OFFSET: usize = 8;

#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct DataSeg {
    pub byte_count: U32,
    pub lkey: U32,
    pub addr: U64,
}

const _: () = assert!(core::mem::size_of::<DataSeg>() == DATA_SEG_SIZE);

impl DataSeg {
    pub fn new(length: u32, lkey: u32, addr: u64) -> Self {
        DataSeg { byte_count: U32::new(length), lkey: U32::new(lkey), addr: U64::new(addr) }
    }
}
