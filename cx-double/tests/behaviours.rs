//! The conformance scenarios on `DevxBackend` over the ConnectX double under the device
//! behaviours of `omw_core::device::behaviour` (the open CORE-Direct questions, executed by the
//! double's model either way), the MN's chains laid out for the variant its answers choose:
//! every behaviour a variant claims must pass; the others are a report — which scenarios fail
//! under which answers, as a matrix (`-- --nocapture`). PAPER itself runs in conformance.rs.

mod support;

use omw_core::chain::variant::ChainVariant;
use omw_core::device::behaviour::{DeviceAnswers, DeviceBehaviour};
use omw_tests::{matrix, scenarios};

/// Scenarios that fail on `DevxBackend` under every behaviour, for a reason of the backend,
/// not of the chains (conformance.rs's `KNOWN`; empty now that the MN queries its windows).
const KNOWN: &[&str] = &[];

/// Every behaviour a chain variant claims to be correct under (`ChainVariant::choose`) must
/// pass the list with the variant the MN chose, but for the backend's known failures.
fn claimed_rows_pass(rows: &[matrix::Row]) -> usize {
    let mut claimed = 0;
    for r in rows {
        if ChainVariant::choose(&DeviceAnswers::exactly(r.behaviour)).is_ok() {
            claimed += 1;
            let failed: Vec<_> = r.summary.failed.iter().filter(|(n, _)| !KNOWN.contains(n)).collect();
            assert!(failed.is_empty(), "under {}: {failed:?}", matrix::label(&r.behaviour));
        }
    }
    claimed
}

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
    // prefetch past WAITs, SEND_EN in WQEs, receives only by RECV_EN, self-enable ignored, a
    // foreign bind refused or bound to the poster: each has a variant
    assert_eq!(claimed_rows_pass(&rows), 6);
}

/// All 48 behaviours.
#[test]
#[ignore = "48 conformance runs on the double; run with `--ignored --nocapture` for the whole matrix"]
fn every_behaviour() {
    let list = scenarios::all();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rows = matrix::run(&DeviceBehaviour::ALL, &list, threads, on_double);
    println!("{}", matrix::render("DevxBackend on the ConnectX double, every behaviour", &list, &rows));
    assert!(claimed_rows_pass(&rows) > 0, "no behaviour is claimed by a variant");
}
