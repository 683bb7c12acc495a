//! The conformance suite (docs/CONFORMANCE.md) on the FPGA extension double: an offloaded MN
//! provisioned through the core's `MnPlan` and CNs on the core's `CnDriver` (`support::mn`);
//! and the memory-window scenarios on the extension block (`support::mw`).
//! `OMW_SCENARIO=name` runs only matching scenarios; `-- --nocapture` shows every skip.

mod support;

#[test]
fn extension_double() {
    omw_tests::runner::conform(&support::mn::Double);
}

#[test]
fn memory_windows_on_the_extension_block() {
    omw_tests::mw::conform_mw(&support::mw::DoubleMw);
}
