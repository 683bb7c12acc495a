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

#[test]
fn bench_quick_runs_every_scheme_and_workload() {
    let dir = std::env::temp_dir().join(format!("omw-bench-test-{}", std::process::id()));
    let d = dir.to_string_lossy().into_owned();
    let (ok, out) = omw(&["bench", "--quick", "--out", &d]);
    assert!(ok, "{out}");
    for s in ["OneSidedMW", "RPC-MW type-1", "RPC-MW type-2", "host engine", "Static-MR", "ODRP"] {
        assert!(out.contains(s), "{s} missing:\n{out}");
    }
    for w in [
        "Allocation micro-benchmark",
        "kv: objects 2-8 KiB",
        "kv: 2 KiB allocations",
        "kv: one MN allocation per object",
        "ycsb: YCSB-A",
        "ycsb: YCSB-D",
        "malloc: larson",
        "malloc: sh8bench",
        "cache: Twitter-shaped cache",
        "swap: 1 MiB chunks",
        "Pool size vs cost per operation",
        "speed-up over the faster RPC-MW, at scale:",
    ] {
        assert!(out.contains(w), "{w} missing:\n{out}");
    }
    assert!(out.contains("Model vs paper"), "{out}");
    for f in [
        "inputs.csv",
        "alloc.csv",
        "alloc_curve.csv",
        "workloads.csv",
        "validation.csv",
        "scale.csv",
        "startup.csv",
        "alloc_latency.svg",
        "scale.svg",
    ] {
        let p = dir.join(f);
        let len = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
        assert!(len > 100, "{} missing or empty", p.display());
    }
    // every scheme × workload row made it into the CSV
    let csv = std::fs::read_to_string(dir.join("workloads.csv")).unwrap();
    // 6 KV configurations, YCSB A-D, 2 allocation traces, the cache, swap: 14 × 6 schemes
    assert_eq!(csv.lines().count(), 1 + 14 * 6, "{csv}");
    let (ok, json) = omw(&["bench", "--quick", "--json", "--out", &d]);
    assert!(ok, "{json}");
    let v: serde_json::Value = serde_json::from_str(json.trim()).expect("--json prints one JSON document");
    assert!(v["validation"].as_array().is_some_and(|a| a.len() >= 10));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pool_demo_passes_with_a_draining_and_a_vanishing_mn() {
    let (ok, out) = omw(&["demo", "--mns", "3"]);
    assert!(ok, "{out}");
    assert!(out.contains("none on mn0"), "{out}");
    assert!(out.contains("failed with MnLost at once"), "{out}");
    assert!(out.contains("reports: drained"), "{out}");
    let (ok, out) = omw(&["demo", "--mns", "4", "--mode", "host-engine", "--seed", "9"]);
    assert!(ok, "{out}");
}
