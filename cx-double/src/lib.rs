//! omw-cx-double: an executing ConnectX double for omw's DEVX path (issue 22, item 3).
//!
//! [`CxDouble`] implements the DEVX traits omw's `DevxBackend` is written against
//! (`omw_verbs::devx::api::DevxApi`, `omw_verbs::devx::device::DevxDevice`) and executes what
//! it is given: the PRM commands are decoded from an offset table of the double's own, taken
//! from DPDK's `mlx5_prm.h` ([`prm`], [`commands`]) — not from omw's encoder, so the two cannot
//! share a mistake; umems, UAR pages, PDs, CQs and QPs are objects with numbers; doorbell
//! records and UAR writes become producer indices; the rings run on the loopback NIC model's
//! mlx5 executor (`omw_loopback::device_terms`), under whatever `DeviceBehaviour` the fabric
//! was made with; completions land in the CQs' umems as 64-byte CQEs ([`cqe`]), with the owner
//! bit, `wqe_counter`, error syndromes, flushes, and overrun unless `cqc.oi`.
//!
//! Map (one concept per file): [`caps`] what the double answers about itself; [`prm`] the
//! offset table; [`commands`] the command interpreter; [`cqe`] the CQE writer; [`double`] the
//! port, its objects, doorbells and memory.
//!
//! Its conformance testbed (tests/support) runs the whole suite on `DevxBackend` over the
//! double: the MN provisioned by the core's `MnPlan::provision`, driven by `MnDriver`; CNs on
//! the model's own hosts of the same fabric.
#![forbid(unsafe_code)]
#![warn(missing_debug_implementations)]

pub mod caps;
pub mod commands;
pub mod cqe;
pub mod double;
pub mod prm;

pub use caps::CxCaps;
pub use double::{gid_of, mac_of, CxDouble, CxStats, Refusal};
