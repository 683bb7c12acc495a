//! The remote-address segment of RDMA READ / WRITE and atomics.
//!
//! `struct mlx5_wqe_raddr_seg`, /usr/include/infiniband/mlx5dv.h:1288 (rdma-core 44.0):
//!
//! ```text
//! off len field
//!   0  8  raddr     BE64
//!   8  4  rkey      BE32
//!  12  4  reserved
//! ```

use zerocopy::big_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const RADDR_SEG_SIZE: usize = 16;
pub const RADDR_OFFSET: usize = 0;
pub const RKEY_OFFSET: usize = 8;

#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct RaddrSeg {
    pub raddr: U64,
    pub rkey: U32,
    pub reserved: U32,
}

const _: () = assert!(core::mem::size_of::<RaddrSeg>() == RADDR_SEG_SIZE);

impl RaddrSeg {
    /// As rdma-core's `set_raddr_seg` (providers/mlx5/qp.c): reserved cleared.
    pub fn new(raddr: u64, rkey: u32) -> Self {
        RaddrSeg { raddr: U64::new(raddr), rkey: U32::new(rkey), reserved: U32::new(0) }
    }
}
