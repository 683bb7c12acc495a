//! Atomic segments: plain (fetch-and-add, compare-and-swap) and the 8-byte masked
//! fetch-and-add whose field boundaries let a ring index or an rkey's key byte wrap in place.
//!
//! Plain: `struct mlx5_wqe_atomic_seg`, /usr/include/infiniband/mlx5dv.h:1294 (rdma-core 44.0),
//! filled as `_set_atomic_seg` in providers/mlx5/qp.c (v44.0): FA puts the addend in
//! `swap_add` and leaves `compare` alone (zero here); CS puts swap in `swap_add` and compare in
//! `compare`.
//!
//! ```text
//! off len field
//!   0  8  swap_add  BE64
//!   8  8  compare   BE64
//! ```
//!
//! Masked FA (opcode 0x15, opmod `OPMOD_EXT_ATOMIC_8B` = 0x09) is not in mlx5dv.h. Layout from
//! UCX src/uct/ib/mlx5/ib_mlx5.h `struct uct_ib_mlx5_atomic_masked_fadd64_seg { add;
//! filed_boundary; }` and rc_mlx5.inl (both fields stored big-endian by the caller):
//!
//! ```text
//! off len field
//!   0  8  add             BE64
//!   8  8  field_boundary  BE64 (a set bit marks the most significant bit of a field)
//! ```
//!
//! The operands in the segment are big-endian on the wire; how the responder reads the 8-byte
//! word in memory is the device's atomic endianness mode (atomic caps
//! `atomic_req_8B_endianness_mode`, see [`crate::mlx5::prm::hca_cap`]): the chains keep MN
//! memory little-endian and need mode 1, host endianness, on a little-endian MN.

use zerocopy::big_endian::U64;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const ATOMIC_SEG_SIZE: usize = 16;
pub const SWAP_ADD_OFFSET: usize = 0;
pub const COMPARE_OFFSET: usize = 8;

#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct AtomicSeg {
    pub swap_add: U64,
    pub compare: U64,
}

const _: () = assert!(core::mem::size_of::<AtomicSeg>() == ATOMIC_SEG_SIZE);

impl AtomicSeg {
    pub fn fetch_add(add: u64) -> Self {
        AtomicSeg { swap_add: U64::new(add), compare: U64::new(0) }
    }
    pub fn compare_swap(compare: u64, swap: u64) -> Self {
        AtomicSeg { swap_add: U64::new(swap), compare: U64::new(compare) }
    }
}

pub const MASKED_FA_SEG_SIZE: usize = 16;
pub const ADD_OFFSET: usize = 0;
pub const FIELD_BOUNDARY_OFFSET: usize = 8;

#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct MaskedFetchAdd64Seg {
    pub add: U64,
    pub field_boundary: U64,
}

const _: () = assert!(core::mem::size_of::<MaskedFetchAdd64Seg>() == MASKED_FA_SEG_SIZE);

impl MaskedFetchAdd64Seg {
    pub fn new(add: u64, field_boundary: u64) -> Self {
        MaskedFetchAdd64Seg { add: U64::new(add), field_boundary: U64::new(field_boundary) }
    }
}
