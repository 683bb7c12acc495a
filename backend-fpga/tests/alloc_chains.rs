//! Several alloc chains per CN on the extension double (`MnConfig::alloc_chains`;
//! docs/ARCHITECTURE.md "Several alloc chains per CN", docs/FPGA.md §5): what the conformance
//! list (`conformance.rs` `*_two_alloc_chains`) cannot show — that a CN's requests are in
//! flight on two chains at once and each chain's lap runs on the block, that every chain pops
//! ahead, and what the testbed refuses (typed, before anything is set up).

mod support;

use omw_core::mn::capacity::Limit;
use omw_fpga::ext as map;
use omw_fpga::mmio::Mmio;
use omw_tests::testbed::{MnSpec, Refusal, Testbed};
use std::collections::HashSet;
use support::mn::{BedError, Cluster};

/// Receives the MN end of QP `q` completed, read from the block's `RCQ_COUNT` register.
fn receives_completed(c: &Cluster, q: omw_core::ids::Qpn) -> u64 {
    let ctid = (q.get() & 0x3F) as u8;
    c.world.f.user_csr(c.mn_id).read_csr(map::DEFAULT_BASE + map::qp_reg(ctid, map::qp::RCQ_COUNT)).unwrap()
}

#[test]
fn a_cn_has_a_request_in_flight_on_each_of_its_two_chains() {
    let mut c = Cluster::try_new(MnSpec::new(1, 16), 2, Some(false)).unwrap();
    assert_eq!(c.alloc_chains(), 2);
    let mn_chain1 = c.cns[0].mn_extra[0];
    assert!(mn_chain1.lp.is_some(), "offloaded: chain 1 has its own loop QP");
    assert_ne!(mn_chain1.mgmt, c.cns[0].mq[0]);
    let before = receives_completed(&c, mn_chain1.mgmt);
    let t0 = c.alloc_begin(0).unwrap();
    let t1 = c.alloc_begin(0).unwrap();
    assert_ne!(t0, t1);
    // both chains are busy: a third request has no chain (with one chain the second had none)
    assert_eq!(c.cns[0].driver.idle_alloc_chains(), 0);
    assert!(matches!(c.alloc_begin(0), Err(Refusal::Client(_))));
    let a0 = c.alloc_finish(0, t0).unwrap();
    let a1 = c.alloc_finish(0, t1).unwrap();
    assert_ne!(a0.entry_addr, a1.entry_addr, "two laps, two groups");
    // the second request went on chain 1's Alloc QP: its MN end took it
    assert_eq!(receives_completed(&c, mn_chain1.mgmt), before + 1);
    assert_eq!(c.live(0).len(), 2);
    for a in [&a0, &a1] {
        assert_eq!(c.write_raw(0, 0, a.base, a.rkeys[0], b"chain"), omw_core::device::WcStatus::Success);
    }
    c.free(0, &a0).unwrap();
    c.free(0, &a1).unwrap();
    c.check_invariants().unwrap();
    assert_eq!(c.free_groups(), 16);
}

#[test]
fn popping_ahead_every_chain_of_every_cn_holds_a_group() {
    let mut c = Cluster::try_new(MnSpec::new(2, 32), 2, Some(true)).unwrap();
    for cn in 0..2 {
        assert_eq!(c.ahead_count(cn), 2, "cn{cn}: a group ahead on each chain");
    }
    assert_eq!(c.ahead(), 4);
    assert_eq!(c.free_groups(), 32 - 4);
    c.check_invariants().unwrap();
    // two allocations at once take both groups held ahead; the chains pop the next ones
    let t0 = c.alloc_begin(0).unwrap();
    let t1 = c.alloc_begin(0).unwrap();
    let a0 = c.alloc_finish(0, t0).unwrap();
    let a1 = c.alloc_finish(0, t1).unwrap();
    assert_ne!(a0.entry_addr, a1.entry_addr);
    assert_eq!(c.ahead_count(0), 2);
    assert_eq!(c.free_groups(), 32 - 4 - 2);
    c.check_invariants().unwrap();
}

/// At group size 3 a CN costs the vFPGA 8 QPs and 3 more per extra chain, the MN 4 of its
/// own: the most CNs one vFPGA (64 QPs) holds is 7, 5, 4, 3 with 1, 2, 3, 4 chains. Each of
/// those MNs comes up (rings, scratch and all), every CN has a request on every chain at once
/// and each is answered; one CN more is refused.
#[test]
fn the_most_cns_a_vfpga_holds_each_allocate_on_every_chain_at_once() {
    for (k, most) in [(1u8, 7usize), (2, 5), (3, 4), (4, 3)] {
        let chunks = 64;
        let mut c = Cluster::try_new(MnSpec::new(most, chunks), k, None)
            .unwrap_or_else(|e| panic!("{most} CNs of {k} chains: {e}"));
        let mut entries = HashSet::new();
        for cn in 0..most {
            let tokens: Vec<u32> = (0..k).map(|_| c.alloc_begin(cn).unwrap()).collect();
            assert_eq!(c.cns[cn].driver.idle_alloc_chains(), 0, "{k} chains: cn{cn} has one in flight on each");
            for t in tokens {
                assert!(entries.insert(c.alloc_finish(cn, t).unwrap().entry_addr), "{k} chains: a group twice");
            }
        }
        assert_eq!(entries.len(), most * k as usize);
        c.check_invariants().unwrap();
        assert!(
            matches!(Cluster::try_new(MnSpec::new(most + 1, chunks), k, None), Err(BedError::DoesNotFit { .. })),
            "{} CNs of {k} chains fit",
            most + 1
        );
    }
}

#[test]
fn what_the_double_cannot_hold_is_refused_with_the_reason() {
    for k in [0, 5] {
        match Cluster::try_new(MnSpec::new(1, 16), k, None) {
            Err(BedError::AllocChains(got)) => assert_eq!(got, k),
            Err(e) => panic!("{k} chains: refused for another reason: {e}"),
            Ok(_) => panic!("{k} chains accepted"),
        }
    }
    match Cluster::try_new(MnSpec::new(6, 64), 2, None) {
        Err(BedError::DoesNotFit { cns, chains, exceeded }) => {
            assert_eq!((cns, chains), (6, 2));
            assert_eq!(exceeded.len(), 1, "{exceeded:?}");
            assert_eq!((exceeded[0].limit, exceeded[0].need, exceeded[0].have), (Limit::QueuePairs, 70, 64));
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("6 CNs of 2 chains fit 64 QPs"),
    }
    // one chain per CN, the same 6 CNs fit: 6 × 8 + 4 = 52
    assert!(Cluster::try_new(MnSpec::new(6, 64), 1, None).is_ok());
}

/// The limits the refusals rest on, as the backend reads them off the vFPGA: a QP per Coyote
/// thread it holds, the block's window entries (`CAPS[47:32]`) and MR indexes; the stock engine
/// has no key table.
#[test]
fn device_limits_are_the_vfpgas() {
    use omw_fpga::encoding::OpcodeEncoding;
    let f = omw_fpga::double::Fabric::new();
    let ext = support::host(&f, 0x0A00_0010, 0x1000_0000, true, OpcodeEncoding::AppOpcodes);
    let l = ext.be.device_limits();
    assert_eq!(l.max_qp, ext.be.threads().count() as u64);
    assert_eq!((l.max_qp, l.max_mw, l.max_mr, l.shared_keys), (64, 0xFFFF - 0x1000, 0x0FFF, false));
    let stock = support::host(&f, 0x0A00_0011, 0x2000_0000, false, OpcodeEncoding::CoyoteV2);
    let l = stock.be.device_limits();
    assert_eq!((l.max_qp, l.max_mw, l.max_mr), (64, 0, 0));
}
