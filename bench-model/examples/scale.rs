//! The pool-size sweep of `omw bench --scale` alone, for working on the per-operation paths:
//! `cargo run --release -p omw-bench --example scale [CHUNKS...]` (powers of four from 1024 to
//! 4194304; default 1024 4096 16384).

fn main() {
    let sizes: Vec<u32> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let sizes = if sizes.is_empty() { vec![1024, 4096, 16384] } else { sizes };
    match omw_bench::scale::run(&sizes, &mut |m| eprintln!("{m}")) {
        Ok(r) => print!("{}", omw_bench::report::scale_report(&r)),
        Err(e) => {
            eprintln!("omw-bench scale: {e}");
            std::process::exit(1);
        }
    }
}
