//! Running the scenario list on one backend: every scenario whose needs the backend meets runs
//! (a panic or an `Err` is its failure); every other one is reported `SKIP <name> (needs X)` —
//! printed, counted in the summary, never silent.

use crate::testbed::{Caps, Factory};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Why a scenario failed (any displayable error converts with `?`).
#[derive(Debug)]
pub struct Failure(pub String);

impl<E: fmt::Display> From<E> for Failure {
    fn from(e: E) -> Failure {
        Failure(e.to_string())
    }
}

pub type Outcome = Result<(), Failure>;

/// One scenario: what it is called, what it needs of a testbed, and its body (which starts
/// the testbeds it needs from the factory).
#[derive(Clone, Copy)]
pub struct Scenario {
    pub name: &'static str,
    pub needs: Caps,
    pub run: fn(&dyn Factory) -> Outcome,
}

/// What a run did.
#[derive(Debug, Default)]
pub struct Summary {
    pub passed: Vec<&'static str>,
    pub skipped: Vec<(&'static str, Caps)>,
    pub failed: Vec<(&'static str, String)>,
}

/// Run `list` on `factory` (scenarios whose name contains `OMW_SCENARIO`, if set); print each
/// outcome and the summary.
pub fn run_list(factory: &dyn Factory, list: &[Scenario]) -> Summary {
    run_items(&factory.name(), factory.caps(), list, |sc| (sc.name, sc.needs), |sc| (sc.run)(factory))
}

/// [`run_list`] printing nothing (many runs side by side: the caller prints a matrix).
pub fn run_list_quietly(factory: &dyn Factory, list: &[Scenario]) -> Summary {
    let meta = |sc: &Scenario| (sc.name, sc.needs);
    run_items_as(&factory.name(), factory.caps(), list, meta, |sc| (sc.run)(factory), false)
}

/// The runner for any list: `meta` names an item and what it needs, `run` runs it.
pub fn run_items<T>(
    name: &str,
    have: Caps,
    list: &[T],
    meta: impl Fn(&T) -> (&'static str, Caps),
    run: impl Fn(&T) -> Outcome,
) -> Summary {
    run_items_as(name, have, list, meta, run, true)
}

fn run_items_as<T>(
    name: &str,
    have: Caps,
    list: &[T],
    meta: impl Fn(&T) -> (&'static str, Caps),
    run: impl Fn(&T) -> Outcome,
    loud: bool,
) -> Summary {
    macro_rules! println {
        ($($t:tt)*) => { if loud { std::println!($($t)*) } };
    }
    let filter = std::env::var("OMW_SCENARIO").ok();
    let mut s = Summary::default();
    let mut filtered = 0;
    println!("conformance on {name} (capabilities: {have})");
    for item in list {
        let (sc, needs) = meta(item);
        if filter.as_deref().is_some_and(|f| !sc.contains(f)) {
            filtered += 1;
            continue;
        }
        let missing = needs.missing(have);
        if !missing.is_empty() {
            println!("SKIP {sc} (needs {missing})");
            s.skipped.push((sc, missing));
            continue;
        }
        match catch_unwind(AssertUnwindSafe(|| run(item))) {
            Ok(Ok(())) => {
                println!("ok   {sc}");
                s.passed.push(sc);
            }
            Ok(Err(f)) => {
                println!("FAIL {sc}: {}", f.0);
                s.failed.push((sc, f.0));
            }
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".into());
                println!("FAIL {sc}: {msg}");
                s.failed.push((sc, msg));
            }
        }
    }
    println!("{name}: {} passed, {} skipped, {} failed", s.passed.len(), s.skipped.len(), s.failed.len());
    if filtered > 0 {
        println!("  ({filtered} not run: their names do not contain OMW_SCENARIO)");
    }
    for (n, c) in &s.skipped {
        println!("  skipped {n}: needs {c}");
    }
    s
}

/// [`run_list`] over the whole suite; panics (fails the test) if any scenario failed.
pub fn conform(factory: &dyn Factory) -> Summary {
    let s = run_list(factory, &crate::scenarios::all());
    assert!(
        s.failed.is_empty(),
        "{}: {} scenario(s) failed: {:?}",
        factory.name(),
        s.failed.len(),
        s.failed.iter().map(|(n, _)| *n).collect::<Vec<_>>()
    );
    assert!(!s.passed.is_empty() || std::env::var_os("OMW_SCENARIO").is_some(), "no scenario ran");
    s
}
