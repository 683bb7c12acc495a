//! Bodies of omw's fuzz targets, as plain functions over bytes.
//!
//! Each module has `pub fn run(data: &[u8]) -> bool`: the cargo-fuzz target in `fuzz/` calls it
//! on nightly with coverage feedback, and `tests/tests/fuzz_replay.rs` calls it on stable for
//! every file of `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/`. A property that does
//! not hold panics (libFuzzer records a crash; the replay test fails). `false` means the input
//! did not parse into the target's structured input (libFuzzer drops it from the corpus).
//!
//! Structured inputs are decoded with `arbitrary` from the raw bytes here, not by
//! `fuzz_target!`, so both callers see exactly the same input for the same file.
#![forbid(unsafe_code)]

pub mod chain;
pub mod malicious_cn;
pub mod mn_events;
pub mod wire;
pub mod wqe;

/// A target's body: runs one input, panics when a property fails, `false` for unusable input.
pub type Target = fn(&[u8]) -> bool;

/// The targets, by name (the names of `fuzz/fuzz_targets/*.rs` and of the corpus folders).
pub const TARGETS: [(&str, Target); 5] = [
    ("wire", wire::run),
    ("wqe", wqe::run),
    ("chain", chain::run),
    ("mn_events", mn_events::run),
    ("malicious_cn", malicious_cn::run),
];
