//! Bytes with documented layouts — the only code that knows byte offsets (smoltcp's `wire`).
//!
//! What crosses the network or sits in MN memory for the NIC to read: the CN↔MN messages, the
//! canonical WQE, the MWTable entry and the free-queue ring, and the map of where each lies in
//! the MN's memory. The mlx5 form of a WQE is in [`crate::mlx5`].

pub mod free_queue;
pub mod memory_map;
pub mod message;
pub mod mwtable;
pub mod wqe;
pub mod wqe_format;
