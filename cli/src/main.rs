//! The `omw` command. Each subcommand lives in its own module; this file only dispatches.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod verbs;

#[derive(Parser, Debug)]
#[command(name = "omw", version, about = "OneSidedMW: RNIC-offloaded remote memory management")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Memory node daemon on a real RDMA device (libibverbs).
    Mn(verbs::MnArgs),
    /// Compute-node client on a real RDMA device.
    Cn(verbs::CnArgs),
    /// Check a device's real memory-window semantics.
    Probe(verbs::ProbeArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Mn(a) => verbs::mn(a),
        Cmd::Cn(a) => verbs::cn(a),
        Cmd::Probe(a) => verbs::probe(a),
    }
}
