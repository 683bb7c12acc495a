//! `omw mn`, `omw cn`, `omw probe`: the verbs-backed programs (owned by the omw-verbs work).

use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct MnArgs {}
#[derive(clap::Args, Debug)]
pub struct CnArgs {}
#[derive(clap::Args, Debug)]
pub struct ProbeArgs {}

pub fn mn(_a: MnArgs) -> ExitCode {
    eprintln!("omw mn: not implemented yet");
    ExitCode::from(2)
}
pub fn cn(_a: CnArgs) -> ExitCode {
    eprintln!("omw cn: not implemented yet");
    ExitCode::from(2)
}
pub fn probe(_a: ProbeArgs) -> ExitCode {
    eprintln!("omw probe: not implemented yet");
    ExitCode::from(2)
}
