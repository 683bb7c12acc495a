//! omw-core: OneSidedMW — remote memory management by RNIC-offloaded memory-window binding —
//! as `no_std` data and sans-IO state machines.
//!
//! Start at [`mn::MemoryNode`] (the MN control plane) and [`cn::Client`] (the CN side); the
//! chains they arm are built in [`chain::alloc`] and [`chain::free`] from the canonical
//! [`wire::wqe::Wqe`] and validated by [`chain::ChainLayout::validate`]. docs/ARCHITECTURE.md maps
//! the crate; docs/CHAINS.md tabulates the chains step by step.
#![no_std]
#![forbid(unsafe_code)]
#![warn(missing_debug_implementations)]

#[cfg(test)]
extern crate std;

pub mod access;
pub mod geometry;
pub mod ids;
pub mod rng;

pub mod wire;

pub mod mlx5;

pub mod device;

pub mod chain;

pub mod mn;

pub mod cn;

pub mod testing;
