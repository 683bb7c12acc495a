//! The conformance suite (docs/CONFORMANCE.md) on the loopback model, in each of its modes:
//! chains offloaded into the modelled NIC, the host engine on a strict NIC, and the host engine
//! on an rxe-compatible NIC (soft-RoCE's deviations). `OMW_SCENARIO=name` runs only matching
//! scenarios; `-- --nocapture` shows each outcome and every skip.

use omw_tests::loopback::Loopback;
use omw_tests::runner::conform;
use omw_tests::Mode;

#[test]
fn offloaded() {
    conform(&Loopback(Mode::Offloaded));
}

#[test]
fn host_engine() {
    conform(&Loopback(Mode::HostEngine));
}

#[test]
fn rxe_compatible() {
    conform(&Loopback(Mode::Rxe));
}
