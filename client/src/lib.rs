//! omw-client: the CN library for applications on omw.
//!
//! A compute node allocates chunks of a memory node's pool and reads, writes and updates them
//! with one-sided RDMA. This crate is what an application links: one [`Cn`] per connection to
//! an MN, `Send + Sync` and cheap to clone, over any [`transport::Transport`] — libibverbs
//! ([`verbs`], feature `verbs`) or the loopback model ([`model`], feature `model`, no device
//! needed).
//!
//! - **Event-driven completions**: a blocking call polls for [`WaitPolicy::spin`], then sleeps
//!   on the transport's event fd (a completion channel on verbs); [`Cn::fd`], [`Cn::arm`] and
//!   [`Cn::progress`] put the client into the caller's own event loop.
//! - **Async** (feature `tokio`): [`AsyncCn`] — allocation, free, reads, writes and atomics as
//!   futures woken through `AsyncFd`. Dropping a future leaks nothing; many run at once,
//!   bounded by the client's I/O slots with back-pressure.
//! - **Zero-copy**: [`Cn::register`] a buffer ([`LocalMr`], which owns or borrows it) and
//!   access chunks straight from and into it; unregistered slices go through staging slots.
//! - **Remote atomics**: [`Cn::compare_swap`], [`Cn::fetch_add`] (8 bytes, aligned) where the
//!   device and the MN's windows carry them; [`Error::AtomicsUnsupported`] where not.
//! - **Allocation without a round trip**: an optional [`ReservePolicy`].
//!
//! The protocol lives in omw-core's sans-IO [`omw_core::cn::driver::CnDriver`]; this crate
//! adds what an application needs around it. docs/CN-LIBRARY.md is the guide.
//!
//! ```
//! use omw_client::{model::Model, Cn, Options, ReservePolicy};
//! let model = Model::start(Default::default()).unwrap();
//! let opts = Options { reserve: Some(ReservePolicy::new(2, 8).unwrap()), ..Options::default() };
//! let cn = Cn::connect(&model, opts).unwrap();
//! let chunk = cn.alloc().unwrap();
//! cn.write(&chunk, 0, b"counter:").unwrap();
//! cn.fetch_add(&chunk, 8, 1).unwrap();
//! let mut mr = cn.register(vec![0u8; 16]).unwrap();
//! cn.read_into(&chunk, 0, &mut mr, 0..16).unwrap();
//! assert_eq!(&mr.as_slice()[..8], b"counter:");
//! assert_eq!(u64::from_le_bytes(mr.as_slice()[8..].try_into().unwrap()), 1);
//! cn.free(chunk).unwrap();
//! cn.shutdown().unwrap();
//! ```
#![forbid(unsafe_code)]

#[cfg(feature = "tokio")]
pub mod asynch;
mod chunk;
mod client;
mod engine;
mod error;
#[cfg(feature = "model")]
pub mod model;
mod mr;
mod policy;
pub mod transport;
#[cfg(feature = "verbs")]
pub mod verbs;

#[cfg(feature = "tokio")]
pub use asynch::AsyncCn;
pub use chunk::Chunk;
pub use client::{Cn, Connect, IO_SLOTS, MAX_LIVE};
pub use engine::Stats;
pub use error::Error;
pub use mr::{LocalMr, MrBuffer};
pub use policy::{BadReserve, Options, ReservePolicy, WaitPolicy};
