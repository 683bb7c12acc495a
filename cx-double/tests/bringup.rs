//! `omw-mlx5-bringup questions` against the ConnectX double: the double executes each step's
//! WQEs under a chosen device behaviour, so every answer the bring-up gives must be the
//! behaviour the double was made with — the experiments checked against a device that runs
//! them, not only against the recording mock (which executes nothing).

use omw_core::device::behaviour::{DeviceAnswers, DeviceBehaviour, RecvPublish, UncheckedUnbind};
use omw_cx_double::{CxCaps, CxDouble};
use omw_verbs::devx::bringup::{questions, Patience, Rig};
use omw_verbs::devx::caps;
use std::cell::RefCell;
use std::rc::Rc;

fn answers_with(nic: omw_loopback::NicConfig) -> (DeviceAnswers, Option<RecvPublish>, Option<UncheckedUnbind>, String) {
    let mut f = omw_loopback::Fabric::new(nic);
    let h = f.add_host("mn").unwrap();
    let mut d = CxDouble::new(Rc::new(RefCell::new(f)), h, CxCaps::CONNECTX).unwrap();
    let hca = caps::query(&mut d).unwrap();
    let mut out = Vec::new();
    let found = {
        let mut rig = Rig::new(&mut d, hca, Patience::NONE, &mut out).unwrap();
        questions(&mut rig)
    };
    (found.answers(), found.recv_publish.answer(), found.unchecked_unbind.answer(), String::from_utf8(out).unwrap())
}

/// `unchecked_unbind` reads what the double does: honoured as the model executes it by
/// default, refused on a double made to check the QPN anyway — and the rest of the answers
/// are unchanged either way.
#[test]
fn the_unchecked_unbind_answer_is_what_the_double_does() {
    for u in [UncheckedUnbind::Honoured, UncheckedUnbind::Refused] {
        let (a, _, got, log) = answers_with(CxDouble::nic(DeviceBehaviour::PAPER).with_unchecked_unbind(u));
        assert_eq!(got, Some(u), "{u:?}\n{log}");
        assert_eq!(a, DeviceAnswers::exactly(DeviceBehaviour::PAPER), "{u:?}\n{log}");
    }
}

/// Under each of the 48 behaviours, `questions` answers every question, and rightly — and
/// sees that the double takes a receive doorbell record written by DMA, as it does (its
/// records are memory the HCA reads when it needs a receive WQE).
#[test]
fn every_answer_is_the_behaviour_the_double_runs() {
    for b in DeviceBehaviour::ALL {
        let (a, rp, uu, log) = answers_with(CxDouble::nic(b));
        assert_eq!(a, DeviceAnswers::exactly(b), "{b:?}: bring-up answered {a:?}\n{log}");
        assert_eq!(rp, Some(RecvPublish::Honoured), "{b:?}: recv_publish\n{log}");
        assert_eq!(uu, Some(UncheckedUnbind::Honoured), "{b:?}: unchecked_unbind\n{log}");
    }
}
