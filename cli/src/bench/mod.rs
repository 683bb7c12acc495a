//! `omw bench` (placeholder while it is built).
use clap::Args;
use std::process::ExitCode;

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[arg(long)]
    pub quick: bool,
}

pub fn bench(_a: BenchArgs) -> ExitCode {
    ExitCode::SUCCESS
}
