//! DEVX: the mlx5 "direct" path. With upstream rdma-core, CORE-Direct (WAIT, SEND_EN, the
//! `cd_*` QP roles) is reachable only by sending PRM commands through DEVX
//! (`mlx5dv_open_device(MLX5DV_CONTEXT_FLAGS_DEVX)`, `mlx5dv_devx_obj_create`, …). This
//! module holds the command sequences — device capabilities, CQs and QPs whose rings are
//! registered user memory (umem), the QP state machine, doorbells, rdma_cm in external-QP
//! mode — written against [`api::DevxApi`], a trait of the few DEVX calls, so that they are
//! tested against a recording mock (`mock.rs`) on machines without a ConnectX.
//!
//! The real implementation (`ffi.rs`) links libmlx5 and exists only with the cargo feature
//! `devx`; everything else here is plain Rust and always builds. The command bytes come from
//! `omw_core::mlx5::prm` (golden-tested there). Nothing in this module has run on a
//! ConnectX: docs/MLX5.md lists what only hardware can settle and the bring-up steps.

pub mod api;
pub mod arm;
#[cfg(test)]
mod arm_tests;
pub mod backend;
pub mod bringup;
pub mod caps;
pub mod cm;
pub mod device;
pub mod doorbell;
pub mod error;
#[cfg(feature = "devx")]
pub mod ffi;
pub mod mn;
#[cfg(test)]
mod mn_tests;
#[cfg(test)]
pub(crate) mod mock;
pub mod offload;
pub mod profile;
pub mod queue;
#[cfg(test)]
mod sequence_tests;

pub use api::DevxApi;
pub use error::DevxError;
pub use offload::{probe, ready, DevxProbe};
