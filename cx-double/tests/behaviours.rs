//! The conformance scenarios on `DevxBackend` over the ConnectX double under the device
//! behaviours of `omw_core::device::behaviour` (the open CORE-Direct questions, executed by the
//! double's model either way): a report, not a verdict — which scenarios fail under which
//! answers, as a matrix (`-- --nocapture`). PAPER itself runs in conformance.rs.

mod support;

use omw_core::device::behaviour::DeviceBehaviour;
use omw_tests::{matrix, scenarios};

fn on_double(b: DeviceBehaviour) -> Box<dyn omw_tests::testbed::Factory> {
    Box::new(support::OnDouble { behaviour: b })
}

/// The six behaviours one answer away from PAPER, two at a time.
#[test]
fn single_deviations_from_paper() {
    let list = scenarios::all();
    let deviations: Vec<DeviceBehaviour> =
        matrix::paper_and_single_deviations().into_iter().filter(|b| *b != DeviceBehaviour::PAPER).collect();
    let rows = matrix::run(&deviations, &list, 2, on_double);
    println!("{}", matrix::render("DevxBackend on the ConnectX double", &list, &rows));
    // a report: each row ran (a testbed that cannot start would show as no scenario at all)
    for r in &rows {
        let ran = r.summary.passed.len() + r.summary.failed.len();
        assert!(ran > 0 || std::env::var_os("OMW_SCENARIO").is_some(), "{}: nothing ran", matrix::label(&r.behaviour));
    }
}

/// All 48 behaviours.
#[test]
#[ignore = "48 conformance runs on the double; run with `--ignored --nocapture` for the whole matrix"]
fn every_behaviour() {
    let list = scenarios::all();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rows = matrix::run(&DeviceBehaviour::ALL, &list, threads, on_double);
    println!("{}", matrix::render("DevxBackend on the ConnectX double, every behaviour", &list, &rows));
}
