//! The mlx5 (ConnectX) form of the canonical WQEs and the PRM commands a DEVX backend sends.
//!
//! Everything here is bytes with a documented layout, checked in `core/tests/mlx5_golden.rs`
//! against the installed rdma-core headers (`mlx5dv.h`, compiled into a C program at test
//! time) and, where `mlx5dv.h` has no definition (WAIT / SEND_EN / RECV_EN segments, masked
//! fetch-and-add, PRM command layouts), against hand-written bytes derived from the sources
//! cited in each file. [`SOURCES`] names the versions. No byte here has been fetched by a
//! ConnectX: docs/MLX5.md lists what only hardware can settle.
//!
//! - segments: [`ctrl`], [`raddr`], [`data`], [`atomic`], [`umr`] (UMR control + mkey
//!   context: type-2 bind, local invalidate), [`wait`] (WAIT, SEND_EN, RECV_EN), [`nop`];
//! - units: [`wqebb`] (64-byte basic blocks, 16-bit WQE index, 24-bit CQ index);
//! - [`encode`]: one canonical [`crate::wire::wqe::Wqe`] as an mlx5 WQE;
//! - [`decode`]: mlx5 WQE bytes back to what they do (the static checks of
//!   [`crate::chain::mlx5`], which lays the alloc and free chains out in this form, read them);
//! - [`prm`]: the `DEVX_SET`/`DEVX_GET` bit-field writer and the PRM commands (QUERY_HCA_CAP,
//!   CREATE_CQ, CREATE_QP with the CORE-Direct bits, the QP state transitions, the memory windows as
//!   DEVX mkeys: CREATE_MKEY / QUERY_MKEY).

pub mod atomic;
pub mod cqe;
pub mod ctrl;
pub mod data;
pub mod decode;
pub mod encode;
pub mod error;
pub mod nop;
pub mod opcode;
pub mod prm;
pub mod raddr;
pub mod umr;
pub mod wait;
pub mod wqebb;

pub use error::Mlx5Error;

/// The sources every layout in this module was taken from (also printed in docs/MLX5.md).
pub const SOURCES: &[&str] = &[
    "rdma-core 44.0 (Debian libibverbs-dev 44.0-2): /usr/include/infiniband/mlx5dv.h, providers/mlx5/qp.c at tag v44.0 (e018d7f3876c315df29060d0a6c95b8abca2b09d)",
    "DPDK main 38f72e500b3b159eca3ba2f4ca0e46a26a7cb057: drivers/common/mlx5/mlx5_prm.h, drivers/net/mlx5/mlx5_txpp.c, drivers/crypto/mlx5/mlx5_crypto_gcm.c",
    "UCX master 9466d104a317c8ffddd9734e72055d8bbda021b3: src/uct/ib/mlx5/ib_mlx5.h, src/uct/ib/mlx5/rc/rc_mlx5.inl, src/uct/ib/mlx5/dv/ib_mlx5_ifc.h",
    "UCX master 9466d104a317c8ffddd9734e72055d8bbda021b3: src/uct/ib/mlx5/dv/ib_mlx5_dv.c (DEVX CQ/QP command sequences)",
    "Linux 00679b631eddaa0aa0ceba719fcb1f60c65da5a3: include/linux/mlx5/mlx5_ifc.h (mkc, create_mkey, query_mkey), drivers/infiniband/hw/mlx5/mr.c (mlx5_ib_alloc_mw), drivers/infiniband/hw/mlx5/devx.c (which objects DEVX may query)",
    "Linux: include/linux/mlx5/mlx5_ifc.h (atomic caps), include/linux/mlx5/driver.h (MLX5_ATOMIC_MODE_*), drivers/infiniband/hw/mlx5/main.c (imaicl gates type-2B windows)",
];
