//! The conformance suite (docs/CONFORMANCE.md) on the FPGA extension double: an offloaded MN
//! provisioned through the core's `MnPlan` and CNs on the core's `CnDriver` (`support::mn`);
//! and the memory-window scenarios on the extension block (`support::mw`). The list runs with
//! one alloc chain per CN (the MN's own choice of popping ahead, and popping ahead forced on)
//! and with two (`MnConfig::alloc_chains`; with and without popping ahead), as the loopback
//! runs it (tests/tests/conformance_loopback.rs `*_two_alloc_chains`).
//! `OMW_SCENARIO=name` runs only matching scenarios; `-- --nocapture` shows every skip.

mod support;

use omw_core::device::DataPath;
use omw_core::mn::capacity::Footprint;
use omw_core::mn::plan::{MnOptions, MnPlan};
use omw_core::mn::provision::PoolSpec;
use omw_tests::runner::{run_list, Summary};
use omw_tests::testbed::{Factory, MnSpec};
use support::mn::Double;

#[test]
fn extension_double() {
    omw_tests::runner::conform(&Double::ONE_CHAIN);
}

#[test]
fn memory_windows_on_the_extension_block() {
    omw_tests::mw::conform_mw(&support::mw::DoubleMw);
}

#[test]
fn extension_double_popping_ahead() {
    omw_tests::runner::conform(&Double { chains: 1, pop_ahead: Some(true) });
}

#[test]
fn extension_double_two_alloc_chains() {
    conform_within_one_vfpga(&Double { chains: 2, pop_ahead: None });
}

#[test]
fn extension_double_pop_ahead_two_alloc_chains() {
    conform_within_one_vfpga(&Double { chains: 2, pop_ahead: Some(true) });
}

/// The scenario list on `f`, every scenario passing except those whose MN does not fit one
/// vFPGA: with two alloc chains per CN that is exactly `six_cns_allocate_access_free_reuse`
/// (6 CNs × 11 QPs + the MN's own 4 = 70 QPs, a vFPGA has 64 Coyote threads; docs/FPGA.md
/// §5 "Several alloc chains per CN"), which must fail with the testbed's refusal and nothing
/// else — so this fails if any other scenario fails, if that one fails otherwise, or if it
/// stops being refused.
fn conform_within_one_vfpga(f: &Double) -> Summary {
    let s = run_list(f, &omw_tests::scenarios::all());
    let filtered = std::env::var_os("OMW_SCENARIO").is_some();
    let refused = refusal_of(MnSpec::new(6, 64), f.chains);
    let expected: Vec<(&str, String)> = match filtered {
        // a filtered run checks only what it ran
        true => s.failed.iter().filter(|(n, _)| *n == SIX_CNS).map(|(n, _)| (*n, refused.clone())).collect(),
        false => vec![(SIX_CNS, refused)],
    };
    assert_eq!(s.failed, expected, "{}: only the MN that does not fit one vFPGA may fail", f.name());
    assert!(!s.passed.is_empty() || filtered, "no scenario ran");
    s
}

const SIX_CNS: &str = "alloc::six_cns_allocate_access_free_reuse";

/// The testbed's refusal of `spec` with `chains` alloc chains per CN, as it words it; panics if
/// the spec fits (the caller expects a refusal).
fn refusal_of(spec: MnSpec, chains: u8) -> String {
    match support::mn::Cluster::try_new(spec, chains, None) {
        Err(e @ support::mn::BedError::DoesNotFit { .. }) => e.to_string(),
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("an MN of {} CNs with {chains} alloc chains fits one vFPGA", spec.cns),
    }
}

/// The footprint the refusal rests on is the core's count for this pool: what
/// `MnPlan::provision_chains` and the connections create.
#[test]
fn two_alloc_chains_for_six_cns_need_more_qps_than_a_vfpga_has() {
    let f = omw_fpga::double::Fabric::new();
    let mn = support::host(&f, 0x0A00_00FF, support::mn::MN, true, omw_fpga::encoding::OpcodeEncoding::AppOpcodes);
    // the double's vFPGA: every Coyote thread of it (64), the key table's window entries
    let limits = mn.be.device_limits();
    assert_eq!((limits.max_qp, limits.max_mw, limits.max_mr), (64, 0xFFFF - 0x1000, 0x1000 - 1));
    let plan = MnPlan::decide(mn.be.capabilities(), MnOptions::default()).unwrap();
    assert_eq!(plan.mode, omw_core::device::ExecutionMode::Offloaded);
    let pool = |cns: u32| PoolSpec {
        chunk_size: 4096,
        chunks: 64,
        group_size: 3,
        max_cns: cns,
        quota: 64,
        lease_ns: omw_core::mn::DEFAULT_LEASE_NS,
        queue_depth: None,
    };
    // per CN: Alloc, Free, 2 access QPs, 2 loop QPs of 2 ends; per extra chain an Alloc QP and
    // a loop QP of 2 ends; the MN's admin and atomic pairs
    assert_eq!(Footprint::of_chains(&plan, &pool(6), 1).unwrap().qps, 6 * 8 + 4);
    assert_eq!(Footprint::of_chains(&plan, &pool(6), 2).unwrap().qps, 6 * 11 + 4);
    assert_eq!(Footprint::of_chains(&plan, &pool(5), 2).unwrap().qps, 5 * 11 + 4);
    let why = refusal_of(MnSpec::new(6, 64), 2);
    assert!(why.contains("needs 70 queue pairs, the device's max_qp is 64"), "{why}");
}
