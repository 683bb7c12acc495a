//! The conformance suite (docs/CONFORMANCE.md) on verbs inside the soft-RoCE VM: the MN daemon
//! on a thread, CNs through `CnClient` over rdma_cm (`common::testbed`); and the memory-window
//! scenarios on the device itself. Skipped unless
//! OMW_RXE is set; run it with `OMW_RXE=1 scripts/rxe-test -p omw-verbs -- --nocapture
//! conformance`. `OMW_SCENARIO=name` runs only matching scenarios.

mod common;

#[test]
fn conformance_on_rxe() {
    if !common::rxe() {
        return;
    }
    omw_tests::runner::conform(&common::testbed::Rxe);
}

/// Every scenario with two alloc chains per CN (issue 23 item 6) over rdma_cm.
#[test]
fn conformance_on_rxe_two_alloc_chains() {
    if !common::rxe() {
        return;
    }
    omw_tests::runner::conform(&common::testbed::RxeChains(2));
}

#[test]
fn memory_windows_on_rxe() {
    if !common::rxe() {
        return;
    }
    omw_tests::mw::conform_mw(&common::testbed::RxeMw);
}
