//! The conformance library (docs/CONFORMANCE.md): the [`testbed::Testbed`] trait a backend
//! implements, the scenario list ([`scenarios::all`]), the oracles ([`oracle`]) and the runner
//! ([`runner::conform`]) that runs every scenario a testbed can run and skips the others
//! visibly. Each backend runs the list from a small file of its own; the loopback testbed is
//! here ([`loopback`]), the FPGA double's and verbs' beside their crates' tests.

pub mod loopback;
pub mod matrix;
pub mod mw;
pub mod oracle;
pub mod pool;
pub mod runner;
pub mod scenarios;
pub mod testbed;

use omw_loopback::cluster::Cluster;

/// The three ways the loopback cluster runs the MN: chains in the modelled NIC, the host engine
/// on a strict NIC, and the host engine on an rxe-compatible NIC (soft-RoCE's deviations).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    Offloaded,
    /// Offloaded, with the chains in the ConnectX (mlx5) WQE format the model executes from
    /// its bytes (docs/MLX5.md).
    OffloadedMlx5,
    /// Offloaded, every CN's alloc chain popping its next group ahead whatever the pool's size
    /// (the MN's default does so only where the held-ahead groups are a small share of it).
    OffloadedPopAhead,
    HostEngine,
    Rxe,
}

pub const MODES: [Mode; 3] = [Mode::Offloaded, Mode::HostEngine, Mode::Rxe];

/// A cluster of `cns` CNs on `chunks` chunks of 512 B (group size 3, quota = the pool) in `mode`
/// — the loopback testbed's configuration ([`loopback::Loopback::config`]), for tests that need
/// the cluster itself (the interleaving schedule).
pub fn cluster(mode: Mode, cns: usize, chunks: u32, scrub: bool) -> Cluster {
    let spec = testbed::MnSpec::new(cns, chunks).chunk_size(512).scrub(scrub);
    Cluster::new(loopback::Loopback(mode).config(spec)).expect("cluster")
}
