//! omw-verbs: the OneSidedMW protocol of `omw-core` on real RDMA hardware through libibverbs
//! (`rdma-sys`) and rdma_cm.
//!
//! - [`backend::VerbsBackend`] implements the core's `RdmaBackend` contract: a canonical WQE
//!   becomes an `ibv_send_wr`, a work completion becomes a `Completion`. No protocol logic.
//! - [`probe`] measures a device's real memory-window semantics on fresh QP pairs and maps
//!   them onto `Capabilities`.
//! - [`cm`] sets up RC connections through rdma_cm (the MN listens, CNs connect).
//! - [`mn`] is the memory-node daemon, one loop on a verbs or a DEVX transport ([`sessions`]:
//!   grouping a CN's connections), [`cn`] the compute-node client.
//! - [`devx`] is the mlx5 direct path (DEVX PRM commands; the libmlx5 calls with feature `devx`).
//!
//! `unsafe` lives only in this crate, and every block says why it is sound.
#![warn(missing_debug_implementations)]

pub mod admission;
pub mod backend;
pub mod cm;
mod cm_event;
pub mod cn;
pub mod device;
pub mod devx;
pub mod error;
pub mod log;
pub mod memlock;
pub mod metrics;
pub mod mn;
pub mod notify;
pub mod port;
pub mod probe;
pub mod refusal;
pub mod rejoin;
pub mod sessions;
pub mod signals;

pub use backend::VerbsBackend;
pub use error::VerbsError;
