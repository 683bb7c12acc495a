//! Test driver for the verbs programs (the same library code `omw mn` / `omw cn` run), so the
//! crate's own multi-process tests can start an MN and CNs without the `omw` binary.
//!
//!   omw-verbs-node mn --listen IP:PORT [--device D] [--pool-size B] [--chunk-size B] [--group-size G] [--insecure]
//!   omw-verbs-node cn --connect IP:PORT [--device D] (alloc|roundtrip|load|bench|script) [N]

use omw_verbs::cn::CnOptions;
use omw_verbs::mn::MnOptions;
use omw_verbs::tool::CnCommand;
use std::process::ExitCode;
use std::time::Duration;

fn opt(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |name: &str, d: u64| opt(&args, name).and_then(|v| v.parse().ok()).unwrap_or(d);
    let r = match args.first().map(String::as_str) {
        Some("mn") => {
            let Some(listen) = opt(&args, "--listen").and_then(|v| v.parse().ok()) else {
                eprintln!("usage: mn --listen IP:PORT");
                return ExitCode::from(2);
            };
            omw_verbs::mn::serve(MnOptions {
                device: opt(&args, "--device"),
                listen,
                pool_size: num("--pool-size", 1 << 20),
                chunk_size: num("--chunk-size", 4096),
                group_size: num("--group-size", 3) as u8,
                max_cns: num("--max-cns", 16) as u32,
                quota: num("--quota", 0) as u32,
                insecure: args.iter().any(|a| a == "--insecure"),
                stats_every: Duration::from_millis(num("--stats-ms", 1000)),
                scrub: !args.iter().any(|a| a == "--no-scrub"),
                gid_index: opt(&args, "--gid-index").and_then(|v| v.parse().ok()),
                metrics: opt(&args, "--metrics").and_then(|v| v.parse().ok()),
                stats_json: args.iter().any(|a| a == "--stats-json"),
                lease: Duration::from_millis(num("--lease-ms", 2000)),
                serial_engine: args.iter().any(|a| a == "--serial-engine"),
            })
        }
        Some("cn") => {
            let Some(addr) = opt(&args, "--connect").and_then(|v| v.parse().ok()) else {
                eprintln!("usage: cn --connect IP:PORT CMD");
                return ExitCode::from(2);
            };
            let o = CnOptions { device: opt(&args, "--device"), timeout: Duration::from_secs(num("--timeout", 30)) };
            let pos: Vec<&String> = args
                .iter()
                .skip(1)
                .filter(|a| ["alloc", "roundtrip", "load", "bench", "script"].contains(&a.as_str()))
                .collect();
            let n = args.last().and_then(|v| v.parse::<u32>().ok()).unwrap_or(10);
            let cmd = match pos.first().map(|s| s.as_str()) {
                Some("alloc") => CnCommand::Alloc { count: n },
                Some("roundtrip") => CnCommand::Roundtrip { bytes: 512 },
                Some("load") => CnCommand::Load { ops: n, bytes: 64 },
                Some("bench") => CnCommand::Bench { iters: n },
                _ => CnCommand::Script,
            };
            omw_verbs::tool::run(addr, &o, cmd)
        }
        _ => {
            eprintln!("usage: omw-verbs-node (mn|cn) ...");
            return ExitCode::from(2);
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
