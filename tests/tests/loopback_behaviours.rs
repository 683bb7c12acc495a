//! The conformance scenarios on the loopback model in mlx5 form under the device behaviours of
//! `omw_core::device::behaviour` — the open CORE-Direct questions the model executes either
//! way. A report, not a verdict: the matrix says which scenarios fail under which answers
//! (run with `-- --nocapture` to see it). Every behaviour some chain variant claims
//! (`ChainVariant::choose`) must pass everything with the variant the MN chose for it; the
//! rest is the report of what breaks where no variant is correct. `OMW_SCENARIO=name` narrows
//! the list.

use omw_core::chain::variant::ChainVariant;
use omw_core::device::behaviour::{DeviceAnswers, DeviceBehaviour};
use omw_tests::loopback::Loopback;
use omw_tests::{matrix, scenarios, Mode};

fn mlx5(b: DeviceBehaviour) -> Box<dyn omw_tests::testbed::Factory> {
    Box::new(Loopback(Mode::OffloadedMlx5).with_behaviour(b))
}

/// Every row whose behaviour a variant claims passed every scenario it ran.
fn claimed_rows_pass(rows: &[matrix::Row]) {
    let mut claimed = 0;
    for r in rows {
        if ChainVariant::choose(&DeviceAnswers::exactly(r.behaviour)).is_ok() {
            claimed += 1;
            assert!(r.summary.failed.is_empty(), "under {}: {:?}", matrix::label(&r.behaviour), r.failed());
        }
    }
    assert!(claimed > 0, "no behaviour is claimed by a variant");
}

/// PAPER and the six behaviours one answer away from it, two at a time: PAPER, prefetch past
/// WAITs and SEND_EN counted in WQEs are claimed (by the two variants) and must pass.
#[test]
fn paper_and_its_single_deviations_in_mlx5_form() {
    let list = scenarios::all();
    let rows = matrix::run(&matrix::paper_and_single_deviations(), &list, 2, mlx5);
    println!("{}", matrix::render("loopback, mlx5 form", &list, &rows));
    claimed_rows_pass(&rows);
    let paper = rows.iter().find(|r| r.behaviour == DeviceBehaviour::PAPER).expect("PAPER ran");
    assert!(!paper.summary.passed.is_empty() || std::env::var_os("OMW_SCENARIO").is_some(), "no scenario ran");
}

/// All 48 behaviours (about 48 conformance runs: ten minutes and more on two cores).
#[test]
#[ignore = "48 conformance runs; run with `--ignored --nocapture` for the whole matrix"]
fn every_behaviour_in_mlx5_form() {
    let list = scenarios::all();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rows = matrix::run(&DeviceBehaviour::ALL, &list, threads, mlx5);
    println!("{}", matrix::render("loopback, mlx5 form, every behaviour", &list, &rows));
    claimed_rows_pass(&rows);
}
