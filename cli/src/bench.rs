//! `omw bench`: the flags and the printing; the model itself is the `omw-bench` crate
//! (docs/COST-MODEL.md).

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use omw_bench::{report, Options};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Small sizes (CI smoke run, a few seconds).
    #[arg(long)]
    pub quick: bool,
    /// Directory for the CSV files and the SVG plot.
    #[arg(long, default_value = "target/omw-bench")]
    pub out: PathBuf,
    /// Print one JSON document on stdout instead of the tables.
    #[arg(long)]
    pub json: bool,
    /// MN CPU cores serving RPC-MW requests (the paper used one).
    #[arg(long, default_value_t = 1)]
    pub mn_cores: usize,
    /// NIC processing units of the main run, in the loopback model and the simulator alike
    /// (default: `CostModel::CX6`'s; the sweep covers 1–16 whatever this is).
    #[arg(long, default_value_t = Options::DEFAULT_NIC_UNITS)]
    pub mn_nic_units: usize,
    /// Application threads per CN in the KV and swap workloads.
    #[arg(long, default_value_t = 8)]
    pub threads: usize,
    /// Compute nodes in the "at scale" runs.
    #[arg(long, default_value_t = 6)]
    pub cns: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Sweep pool sizes from 1 Ki to 4 Mi chunks (several minutes and about 2 GiB; without it
    /// the sweep stops at 16 Ki chunks, 4 Ki with --quick).
    #[arg(long)]
    pub scale: bool,
}

impl BenchArgs {
    fn options(&self) -> Options {
        Options {
            quick: self.quick,
            out: self.out.clone(),
            mn_cores: self.mn_cores,
            mn_nic_units: self.mn_nic_units,
            threads: self.threads,
            cns: self.cns,
            seed: self.seed,
            scale: self.scale,
        }
    }
}

pub fn bench(args: BenchArgs) -> ExitCode {
    let pb = if args.quick || args.json { ProgressBar::hidden() } else { ProgressBar::new(omw_bench::STEPS) };
    pb.set_style(
        ProgressStyle::with_template("[{elapsed_precise}] {bar:30} {pos}/{len} {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut tick = |msg: &str| {
        pb.inc(1);
        pb.set_message(msg.to_string());
    };
    let res = omw_bench::run(&args.options(), &mut tick);
    pb.finish_and_clear();
    let res = match res {
        Ok(r) => r,
        Err(e) => {
            eprintln!("omw bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = report::write_files(&res) {
        eprintln!("omw bench: writing {}: {e}", args.out.display());
        return ExitCode::FAILURE;
    }
    let out = if args.json { report::json(&res) + "\n" } else { report::text(&res) };
    // a closed pipe (`omw bench | head`) is not an error worth a panic
    let _ = std::io::Write::write_all(&mut std::io::stdout(), out.as_bytes());
    ExitCode::SUCCESS
}
