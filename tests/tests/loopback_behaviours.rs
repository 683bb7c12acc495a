//! The conformance scenarios on the loopback model in mlx5 form under the device behaviours of
//! `omw_core::device::behaviour` — the open CORE-Direct questions the model executes either
//! way. A report, not a verdict: the matrix says which scenarios fail under which answers
//! (run with `-- --nocapture` to see it); only the paper's behaviour, the one the chains are
//! claimed for today, must pass. `OMW_SCENARIO=name` narrows the list.

use omw_core::device::behaviour::DeviceBehaviour;
use omw_tests::loopback::Loopback;
use omw_tests::{matrix, scenarios, Mode};

fn mlx5(b: DeviceBehaviour) -> Box<dyn omw_tests::testbed::Factory> {
    Box::new(Loopback(Mode::OffloadedMlx5).with_behaviour(b))
}

/// PAPER and the six behaviours one answer away from it, two at a time.
#[test]
fn paper_and_its_single_deviations_in_mlx5_form() {
    let list = scenarios::all();
    let rows = matrix::run(&matrix::paper_and_single_deviations(), &list, 2, mlx5);
    println!("{}", matrix::render("loopback, mlx5 form", &list, &rows));
    let paper = rows.iter().find(|r| r.behaviour == DeviceBehaviour::PAPER).expect("PAPER ran");
    assert!(paper.summary.failed.is_empty(), "under PAPER: {:?}", paper.failed());
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
    let paper = rows.iter().find(|r| r.behaviour == DeviceBehaviour::PAPER).expect("PAPER ran");
    assert!(paper.summary.failed.is_empty(), "under PAPER: {:?}", paper.failed());
}
