//! The pool scenarios (omw_tests::pool) on the loopback model: MNs with offloaded chains, and
//! with the host engine.

use omw_core::device::ExecutionMode;
use omw_tests::pool::loopback::LoopbackBed;
use omw_tests::pool::{run, scenarios};

#[test]
fn pool_scenarios_offloaded() {
    let failed = run(&scenarios::list(), &mut |shape| LoopbackBed::new(shape, ExecutionMode::Offloaded));
    assert!(failed.is_empty(), "failed: {failed:?}");
}

#[test]
fn pool_scenarios_host_engine() {
    let failed = run(&scenarios::list(), &mut |shape| LoopbackBed::new(shape, ExecutionMode::HostEngine));
    assert!(failed.is_empty(), "failed: {failed:?}");
}
