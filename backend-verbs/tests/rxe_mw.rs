//! Memory-window semantics of the verbs backend on a real device (soft-RoCE `rxe0` in the VM).
//! Skipped unless OMW_RXE is set (scripts/verbs-ci sets it inside the VM); when it is set, a
//! missing device is a failure, not a skip.

mod common;
use common::*;

#[test]
fn probe_reports_rxe_semantics() {
    if !rxe() {
        return;
    }
    let r = omw_verbs::probe::run(Some(&device())).expect("probe");
    println!("{r}");
    assert!(!r.basic_failed, "basic bind/access/invalidate failed");
    assert!(!r.stale_rkey_accepted);
    assert!(r.has(omw_core::backend::Capabilities::MW_QP_BINDING_ENFORCED));
}
