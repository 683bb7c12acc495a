//! omw-pool: a pool of many memory nodes.
//!
//! OneSidedMW, like the paper, stops at one MN with one chunk size. A pool spreads a CN's
//! allocations over many MNs, each with several size classes:
//!
//! - **Membership** ([`registry`]): each MN registers under a key bound to a lease in a
//!   registry — etcd ([`etcd::EtcdRegistry`]) for deployments of several processes, or
//!   [`memory::InProcessRegistry`] for one process — and keeps it alive, publishing its
//!   classes, free counts and drain flag ([`entry::MnEntry`], [`announcer::Announcer`]).
//! - **Placement on the CN** ([`client::PoolClient`]): the client watches the registry,
//!   connects to MNs lazily, places each allocation on the MN of the right class chosen by two
//!   random choices weighted by free counts ([`placement`]), and routes every free, read and
//!   write to the allocation's own MN. A departed MN's allocations fail with
//!   [`client::PoolError::MnLost`] at once; a draining MN gets no new placements.
//! - **Size classes**: an MN has several, each its own MWTable, free queue and chains (one
//!   `MemoryNode` per class); the client picks the smallest class that fits.
//!
//! The client reaches an MN through [`session::Connector`] / [`session::MnSession`], a small
//! trait of its own: the loopback model's CNs ([`loopback`]) and omw-verbs' `CnClient`
//! ([`verbs`]) implement it. docs/POOL.md is the operator's page.

pub mod announcer;
pub mod client;
pub mod entry;
pub mod etcd;
pub mod etcd_server;
pub mod loopback;
pub mod memory;
pub mod placement;
pub mod registry;
pub mod session;
pub mod verbs;

pub use client::{PoolAlloc, PoolClient, PoolError, PoolNote};
pub use entry::{ClassEntry, MnEntry};
pub use registry::{Name, Registry, RegistryError};
