//! The `omw` command. Each subcommand lives in its own module; this file only dispatches.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod bench;
mod cn;
mod demo;
mod plan;
mod pool_demo;
mod pool_mn;
mod verbs;

#[derive(Parser, Debug)]
#[command(name = "omw", version, about = "OneSidedMW: RNIC-offloaded remote memory management")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
// parsed once per process: the MN's many flags need no box
#[allow(clippy::large_enum_variant)]
enum Cmd {
    /// OneSidedMW end to end on the loopback RNIC model: 1 MN, N CNs, a KV workload, a malicious CN.
    Demo(demo::DemoArgs),
    /// Every memory-management scheme × workload on the modelled cluster; model vs the paper.
    Bench(bench::BenchArgs),
    /// Memory node daemon on a real RDMA device (libibverbs).
    Mn(verbs::MnArgs),
    /// Compute-node client on a real RDMA device.
    Cn(verbs::CnArgs),
    /// Check a device's real memory-window semantics.
    Probe(verbs::ProbeArgs),
    /// Does a pool fit a device (windows, registrations, QPs), and what will it cost?
    Plan(plan::PlanArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Demo(a) => demo::demo(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Mn(a) => verbs::mn(a),
        Cmd::Cn(a) => verbs::cn(a),
        Cmd::Probe(a) => verbs::probe(a),
        Cmd::Plan(a) => plan::plan(a),
    }
}
