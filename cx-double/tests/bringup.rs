//! `omw-mlx5-bringup questions` against the ConnectX double: the double executes each step's
//! WQEs under a chosen device behaviour, so every answer the bring-up gives must be the
//! behaviour the double was made with — the experiments checked against a device that runs
//! them, not only against the recording mock (which executes nothing).

use omw_core::device::behaviour::{DeviceAnswers, DeviceBehaviour, RecvPublish};
use omw_cx_double::{CxCaps, CxDouble};
use omw_verbs::devx::bringup::{questions, Patience, Rig};
use omw_verbs::devx::caps;
use std::cell::RefCell;
use std::rc::Rc;

fn answers_on(b: DeviceBehaviour) -> (DeviceAnswers, Option<RecvPublish>, String) {
    let mut f = CxDouble::fabric(b);
    let h = f.add_host("mn").unwrap();
    let mut d = CxDouble::new(Rc::new(RefCell::new(f)), h, CxCaps::CONNECTX).unwrap();
    let hca = caps::query(&mut d).unwrap();
    let mut out = Vec::new();
    let found = {
        let mut rig = Rig::new(&mut d, hca, Patience::NONE, &mut out).unwrap();
        questions(&mut rig)
    };
    (found.answers(), found.recv_publish.answer(), String::from_utf8(out).unwrap())
}

/// Under each of the 48 behaviours, `questions` answers every question, and rightly — and
/// sees that the double takes a receive doorbell record written by DMA, as it does (its
/// records are memory the HCA reads when it needs a receive WQE).
#[test]
fn every_answer_is_the_behaviour_the_double_runs() {
    for b in DeviceBehaviour::ALL {
        let (a, rp, log) = answers_on(b);
        assert_eq!(a, DeviceAnswers::exactly(b), "{b:?}: bring-up answered {a:?}\n{log}");
        assert_eq!(rp, Some(RecvPublish::Honoured), "{b:?}: recv_publish\n{log}");
    }
}
