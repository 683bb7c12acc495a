//! The scenario list under many device behaviours (`omw_core::device::behaviour`): which
//! scenarios fail under which answers to the open CORE-Direct questions. A matrix is a
//! report, not a verdict — the chains are correct only under the behaviours their layout
//! claims; the rows say where they break and so which layout a device's answers need.

use crate::runner::{run_list_quietly, Scenario, Summary};
use crate::testbed::Factory;
use omw_core::device::behaviour::{DeviceBehaviour, ForeignBind, RecvEnable, SelfEnable, SendEnUnit, WaitPrefetch};
use std::fmt::Write;

/// One behaviour's run.
#[derive(Debug)]
pub struct Row {
    pub behaviour: DeviceBehaviour,
    pub summary: Summary,
}

impl Row {
    pub fn failed(&self) -> Vec<&'static str> {
        self.summary.failed.iter().map(|(n, _)| *n).collect()
    }
}

/// A behaviour in five letters, one per question in `Question::ALL` order: WAIT prefetch
/// **S**tops / fetches **P**ast; receives by **D**oorbell / **R**ECV_EN only; SEND_EN in
/// WQE**B**Bs / **W**QEs; self-enable **H**onoured / **I**gnored; foreign bind **H**onoured /
/// **R**efused / bound to the **P**oster.
pub fn label(b: &DeviceBehaviour) -> String {
    let mut s = String::new();
    s.push(match b.wait_prefetch {
        WaitPrefetch::Stops => 'S',
        WaitPrefetch::FetchesPast => 'P',
    });
    s.push(match b.recv_enable {
        RecvEnable::Doorbell => 'D',
        RecvEnable::RecvEnOnly => 'R',
    });
    s.push(match b.send_en_unit {
        SendEnUnit::Wqebb => 'B',
        SendEnUnit::Wqe => 'W',
    });
    s.push(match b.self_enable {
        SelfEnable::Honoured => 'H',
        SelfEnable::Ignored => 'I',
    });
    s.push(match b.foreign_bind {
        ForeignBind::Honoured => 'H',
        ForeignBind::Refused => 'R',
        ForeignBind::BoundToPoster => 'P',
    });
    s
}

/// The key to [`label`]'s letters.
pub const KEY: &str = "behaviour letters: WAIT prefetch S=stops P=fetches past | receives D=doorbell \
R=RECV_EN only | SEND_EN unit B=WQEBB W=WQE | self-enable H=honoured I=ignored | foreign bind \
H=honoured R=refused P=bound to poster";

/// PAPER, then each behaviour that differs from it in exactly one answer (six): the bounded
/// matrix of the normal test run.
pub fn paper_and_single_deviations() -> Vec<DeviceBehaviour> {
    let p = DeviceBehaviour::PAPER;
    vec![
        p,
        DeviceBehaviour { wait_prefetch: WaitPrefetch::FetchesPast, ..p },
        DeviceBehaviour { recv_enable: RecvEnable::RecvEnOnly, ..p },
        DeviceBehaviour { send_en_unit: SendEnUnit::Wqe, ..p },
        DeviceBehaviour { self_enable: SelfEnable::Ignored, ..p },
        DeviceBehaviour { foreign_bind: ForeignBind::Refused, ..p },
        DeviceBehaviour { foreign_bind: ForeignBind::BoundToPoster, ..p },
    ]
}

/// Run `list` under every behaviour of `behaviours` on `threads` threads, each behaviour's
/// testbeds from `factory(behaviour)`. Rows come back in `behaviours`' order. A failing
/// scenario's panic is caught and recorded in its row; the process's panic report of it is
/// silenced while the matrix runs (hundreds of expected failures would bury the matrix).
pub fn run<F>(behaviours: &[DeviceBehaviour], list: &[Scenario], threads: usize, factory: F) -> Vec<Row>
where
    F: Fn(DeviceBehaviour) -> Box<dyn Factory> + Sync,
{
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let rows = run_rows(behaviours, list, threads, factory);
    std::panic::set_hook(hook);
    rows
}

fn run_rows<F>(behaviours: &[DeviceBehaviour], list: &[Scenario], threads: usize, factory: F) -> Vec<Row>
where
    F: Fn(DeviceBehaviour) -> Box<dyn Factory> + Sync,
{
    let next = std::sync::atomic::AtomicUsize::new(0);
    let rows = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(b) = behaviours.get(i) else { break };
                let f = factory(*b);
                let summary = run_list_quietly(f.as_ref(), list);
                rows.lock().unwrap_or_else(|e| e.into_inner()).push((i, Row { behaviour: *b, summary }));
            });
        }
    });
    let mut rows = rows.into_inner().unwrap_or_else(|e| e.into_inner());
    rows.sort_by_key(|(i, _)| *i);
    rows.into_iter().map(|(_, r)| r).collect()
}

/// The matrix as text: the scenarios numbered, then a row per behaviour — `.` passed, `X`
/// failed, `-` skipped, blank not run (filtered) — with its pass count, and per scenario the
/// behaviours it fails under.
pub fn render(title: &str, list: &[Scenario], rows: &[Row]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{title}: {} behaviours × {} scenarios", rows.len(), list.len());
    let _ = writeln!(out, "{KEY}");
    let _ = writeln!(out, "cells: . passed, X failed, - skipped, blank not run (OMW_SCENARIO)");
    let tens: String = (1..=list.len()).map(|i| char::from(b'0' + (i / 10 % 10) as u8)).collect();
    let ones: String = (1..=list.len()).map(|i| char::from(b'0' + (i % 10) as u8)).collect();
    let _ = writeln!(out, "      {tens}");
    let _ = writeln!(out, "      {ones}");
    for r in rows {
        let cells: String = list
            .iter()
            .map(|sc| {
                let s = &r.summary;
                if s.passed.contains(&sc.name) {
                    '.'
                } else if s.failed.iter().any(|(n, _)| *n == sc.name) {
                    'X'
                } else if s.skipped.iter().any(|(n, _)| *n == sc.name) {
                    '-'
                } else {
                    ' '
                }
            })
            .collect();
        let ran = r.summary.passed.len() + r.summary.failed.len();
        let paper = if r.behaviour == DeviceBehaviour::PAPER { " PAPER" } else { "" };
        let _ = writeln!(out, "{} {cells} {}/{ran}{paper}", label(&r.behaviour), r.summary.passed.len());
    }
    let _ = writeln!(out, "scenarios (failing under):");
    for (i, sc) in list.iter().enumerate() {
        let fails = |r: &&Row| r.summary.failed.iter().any(|(n, _)| *n == sc.name);
        let passes = |r: &&Row| r.summary.passed.contains(&sc.name);
        let under: Vec<String> = rows.iter().filter(fails).map(|r| label(&r.behaviour)).collect();
        let over: Vec<String> = rows.iter().filter(passes).map(|r| label(&r.behaviour)).collect();
        // name the shorter side
        let shown = match (under.len(), over.len()) {
            (0, _) => String::new(),
            (f, p) if f <= p || p == 0 => format!(" — fails under {f}: {}", under.join(" ")),
            (f, _) => format!(" — fails under {f}, passes only under {}", over.join(" ")),
        };
        let _ = writeln!(out, "{:>3} {}{shown}", i + 1, sc.name);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_name_each_behaviour_once() {
        let all: std::collections::HashSet<String> = DeviceBehaviour::ALL.iter().map(label).collect();
        assert_eq!(all.len(), 48);
        assert_eq!(label(&DeviceBehaviour::PAPER), "SDBHH");
        assert_eq!(paper_and_single_deviations().len(), 7);
    }
}
