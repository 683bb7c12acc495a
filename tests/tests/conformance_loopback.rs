//! The conformance suite (docs/CONFORMANCE.md) on the loopback model, in each of its modes:
//! chains offloaded into the modelled NIC (in the canonical and in the mlx5 WQE format), the host engine on a strict NIC, and the host engine
//! on an rxe-compatible NIC (soft-RoCE's deviations); and the memory-window scenarios on the
//! model's NIC, strict and rxe-compatible. `OMW_SCENARIO=name` runs only matching
//! scenarios; `-- --nocapture` shows each outcome and every skip.

use omw_loopback::Conformance;
use omw_tests::loopback::{Loopback, LoopbackChains, LoopbackMw};
use omw_tests::mw::conform_mw;
use omw_tests::runner::conform;
use omw_tests::Mode;

#[test]
fn offloaded() {
    conform(&Loopback(Mode::Offloaded));
}

#[test]
fn offloaded_mlx5_form() {
    conform(&Loopback(Mode::OffloadedMlx5));
}

#[test]
fn offloaded_popping_ahead() {
    conform(&Loopback(Mode::OffloadedPopAhead));
}

#[test]
fn host_engine() {
    conform(&Loopback(Mode::HostEngine));
}

#[test]
fn rxe_compatible() {
    conform(&Loopback(Mode::Rxe));
}

/// Every scenario with two alloc chains per CN (issue 23 item 6), in each mode.
#[test]
fn offloaded_two_alloc_chains() {
    conform(&LoopbackChains { mode: Mode::Offloaded, chains: 2 });
}

#[test]
fn offloaded_pop_ahead_two_alloc_chains() {
    conform(&LoopbackChains { mode: Mode::OffloadedPopAhead, chains: 2 });
}

#[test]
fn offloaded_mlx5_form_two_alloc_chains() {
    conform(&LoopbackChains { mode: Mode::OffloadedMlx5, chains: 2 });
}

#[test]
fn host_engine_two_alloc_chains() {
    conform(&LoopbackChains { mode: Mode::HostEngine, chains: 2 });
}

#[test]
fn rxe_compatible_two_alloc_chains() {
    conform(&LoopbackChains { mode: Mode::Rxe, chains: 2 });
}

#[test]
fn memory_windows_strict() {
    conform_mw(&LoopbackMw(Conformance::Strict));
}

#[test]
fn memory_windows_rxe_compatible() {
    conform_mw(&LoopbackMw(Conformance::RxeCompatible));
}
