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

pub mod attacker;
pub mod chain;
pub mod fabric;
pub mod malicious_cn;
pub mod mn_events;
pub mod sim;
pub mod wire;
pub mod wqe;

/// A target's body: runs one input, panics when a property fails, `false` for unusable input.
pub type Target = fn(&[u8]) -> bool;

/// The targets, by name (the names of `fuzz/fuzz_targets/*.rs` and of the corpus folders).
pub const TARGETS: [(&str, Target); 6] = [
    ("wire", wire::run),
    ("wqe", wqe::run),
    ("chain", chain::run),
    ("fabric", fabric::run),
    ("mn_events", mn_events::run),
    ("malicious_cn", malicious_cn::run),
];

/// Targets whose input format changed, with the body that runs the first format: the
/// regressions saved before the change live in `fuzz/regressions/<target>/v1/` and keep
/// meaning exactly what they meant (with the new properties checked on them too).
pub const TARGETS_V1: [(&str, Target); 2] = [("mn_events", mn_events::run_v1), ("malicious_cn", malicious_cn::run_v1)];

/// The second input format of the same targets (before `Step::Lap`): `regressions/<target>/v2/`.
pub const TARGETS_V2: [(&str, Target); 2] = [("mn_events", mn_events::run_v2), ("malicious_cn", malicious_cn::run_v2)];

/// The structured input `data` decodes to for `target` (`None` for byte-level targets).
pub fn describe(target: &str, data: &[u8]) -> Option<String> {
    use arbitrary::{Arbitrary, Unstructured};
    fn show<T: for<'a> Arbitrary<'a> + std::fmt::Debug>(data: &[u8]) -> String {
        match T::arbitrary_take_rest(Unstructured::new(data)) {
            Ok(v) => format!("{v:#?}"),
            Err(e) => format!("(does not decode: {e})"),
        }
    }
    Some(match target {
        "chain" => show::<chain::Input>(data),
        "fabric" => show::<fabric::Input>(data),
        "mn_events" => show::<mn_events::Input>(data),
        "malicious_cn" => show::<malicious_cn::Input>(data),
        "mn_events/v1" => show::<mn_events::InputV1>(data),
        "malicious_cn/v1" => show::<malicious_cn::InputV1>(data),
        "mn_events/v2" => show::<mn_events::InputV2>(data),
        "malicious_cn/v2" => show::<malicious_cn::InputV2>(data),
        _ => return None,
    })
}
