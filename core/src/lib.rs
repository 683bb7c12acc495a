//! omw-core: OneSidedMW — remote memory management by RNIC-offloaded memory-window binding —
//! as `no_std` data and sans-IO state machines.
//!
//! Start at [`mn::MemoryNode`] (the MN control plane) and [`cn::Client`] (the CN side); the
//! chains they arm are built in [`alloc_chain`] and [`free_chain`] from the canonical
//! [`wqe::Wqe`] and validated by [`chain::ChainLayout::validate`]. docs/ARCHITECTURE.md maps
//! the crate; docs/CHAINS.md tabulates the chains step by step.
#![no_std]
#![forbid(unsafe_code)]
#![warn(missing_debug_implementations)]

#[cfg(test)]
extern crate std;

pub mod access;
pub mod alloc_chain;
pub mod arm;
pub mod backend;
pub mod chain;
pub mod chain_builder;
pub mod cn;
pub mod cn_driver;
#[cfg(any(test, feature = "test-nic"))]
pub mod fault;
pub mod free_chain;
pub mod free_queue;
pub mod geometry;
pub mod host_engine;
pub mod ids;
pub mod invariants;
pub mod mlx5;
pub mod mn;
pub mod mn_driver;
pub mod mn_memory;
pub mod mn_plan;
pub mod mw_rules;
pub mod mwtable;
pub mod object_alloc;
pub mod rng;
pub mod tenant;
#[cfg(any(test, feature = "test-nic"))]
pub mod test_nic;
#[cfg(any(test, feature = "test-nic"))]
pub mod trace;
pub mod wire;
pub mod wqe;
pub mod wqe_format;

#[cfg(test)]
mod mn_tests;
