//! The security properties and fault handling of OneSidedMW on the loopback model. Each runs
//! in offloaded mode (chains in the modelled NIC) — with the chains in canonical form and in
//! mlx5 form (the model fetching ConnectX WQEBBs) — and in host-engine mode where it applies.

use omw_core::backend::{ExecutionMode, MwBinding, WcStatus};
use omw_core::chain::ChainKind;
use omw_core::cn::ClientEvent;
use omw_core::ids::Rkey;
use omw_core::wire::ErrorCode;
use omw_core::wqe_format::WqeFormat;
use omw_loopback::cluster::{Cluster, ClusterConfig, CnOpError};
use omw_loopback::NicConfig;
use std::cell::Cell;

thread_local! {
    /// The form `cluster_with` lays offloaded chains out in; [`both`] runs each offloaded
    /// scenario in both.
    static FORMAT: Cell<WqeFormat> = const { Cell::new(WqeFormat::Canonical) };
}

fn cluster_with(mode: ExecutionMode, chunks: u32, quota: u32) -> Cluster {
    let mut cfg = ClusterConfig::paper_like().with_wqe_format(FORMAT.with(Cell::get));
    cfg.mode = Some(mode);
    cfg.chunks = chunks;
    cfg.quota = quota;
    cfg.cns = 3;
    if mode == ExecutionMode::HostEngine {
        cfg.nic = NicConfig::strict().with_offload(false).with_prefetch(8);
    }
    Cluster::new(cfg).unwrap()
}

fn both(f: impl Fn(ExecutionMode)) {
    f(ExecutionMode::Offloaded);
    FORMAT.with(|c| c.set(WqeFormat::Mlx5));
    f(ExecutionMode::Offloaded);
    FORMAT.with(|c| c.set(WqeFormat::Canonical));
    f(ExecutionMode::HostEngine);
}

#[test]
fn other_cn_cannot_touch_a_chunk_with_its_rkey() {
    both(|mode| {
        let mut c = cluster_with(mode, 16, 16);
        let a = c.alloc(0).unwrap();
        assert_eq!(c.write(0, &a, 0, 0, b"secret of A"), WcStatus::Success);
        // B uses A's rkey and address through each of B's own access QPs
        for q in 0..2 {
            let rk = a.rkey(q).unwrap();
            assert_eq!(c.write_raw(1, q, a.base, rk, b"overwrite!!"), WcStatus::RemAccessErr, "{mode:?}");
            let (st, _) = c.read_raw(1, q, a.base, rk, 11);
            assert_eq!(st, WcStatus::RemAccessErr, "{mode:?}");
        }
        // B with its own rkey but an address outside its own chunk
        let b = c.alloc(1).unwrap();
        let rk = b.rkey(0).unwrap();
        assert_eq!(c.write_raw(1, 0, a.base, rk, b"overwrite!!"), WcStatus::RemAccessErr);
        assert_eq!(c.read_raw(1, 0, b.base + b.length, rk, 8).0, WcStatus::RemAccessErr);
        // A's bytes unchanged, A still has access
        let (st, got) = c.read(0, &a, 0, 0, 11);
        assert_eq!(st, WcStatus::Success);
        assert_eq!(got, b"secret of A");
        c.check_invariants().unwrap();
    });
}

#[test]
fn forged_free_fails_the_ownership_check() {
    both(|mode| {
        let mut c = cluster_with(mode, 16, 16);
        let a = c.alloc(0).unwrap();
        assert_eq!(c.write(0, &a, 0, 0, b"mine"), WcStatus::Success);
        // B names A's entry
        assert_eq!(c.free_raw(1, a.entry_addr), Err(CnOpError::Mn(ErrorCode::NotOwner)), "{mode:?}");
        c.check_invariants().unwrap();
        assert!(matches!(c.mw_binding(a.owner_rkey), Some(MwBinding::Bound { .. })));
        let (st, got) = c.read(0, &a, 0, 0, 4);
        assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"mine"[..]));
        // B names an address that is no entry at all
        assert!(c.free_raw(1, a.entry_addr + 4).is_err());
        assert!(c.free_raw(1, 0x10).is_err());
        c.check_invariants().unwrap();
        // B's free chain was re-armed: B can still allocate and free its own
        let b = c.alloc(1).unwrap();
        c.free(1, &b).unwrap();
        assert!(c.driver.mn.cn(c.cns[1].id).unwrap().forged_frees >= 1);
        c.check_invariants().unwrap();
    });
}

#[test]
fn stale_rkey_after_free_is_denied() {
    both(|mode| {
        let mut c = cluster_with(mode, 4, 16);
        let a = c.alloc(0).unwrap();
        c.free(0, &a).unwrap();
        assert_eq!(c.read_raw(0, 0, a.base, a.rkey(0).unwrap(), 8).0, WcStatus::RemAccessErr);
        // the same chunk reallocated (to B) has a new key; A's old one still fails
        let mut again = None;
        for _ in 0..4 {
            let b = c.alloc(1).unwrap();
            if b.base == a.base {
                again = Some(b);
                break;
            }
        }
        let b = again.expect("chunk reused");
        assert_ne!(b.rkey(0), a.rkey(0));
        assert_eq!(c.write_raw(0, 0, a.base, a.rkey(0).unwrap(), b"stale"), WcStatus::RemAccessErr);
        assert_eq!(c.write(1, &b, 0, 0, b"fresh"), WcStatus::Success);
        c.check_invariants().unwrap();
    });
}

#[test]
fn walking_all_256_keys_never_grants_access() {
    both(|mode| {
        let mut c = cluster_with(mode, 8, 16);
        let a = c.alloc(0).unwrap();
        assert_eq!(c.write(0, &a, 0, 0, b"A's data"), WcStatus::Success);
        let idx = a.rkey(0).unwrap().index();
        for key in 0..=255u8 {
            let rk = Rkey::new(idx, key).unwrap();
            assert_eq!(c.read_raw(1, 0, a.base, rk, 8).0, WcStatus::RemAccessErr, "key {key}");
            assert_eq!(c.write_raw(1, 1, a.base, rk, b"brute!!!"), WcStatus::RemAccessErr, "key {key}");
        }
        let (st, got) = c.read(0, &a, 0, 0, 8);
        assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"A's data"[..]));
        c.check_invariants().unwrap();
    });
}

/// Policy under test (docs/ARCHITECTURE.md, "Quota"). Offloaded: the chains cannot count, so
/// enforcement is lazy — at the next audit (counter sample or tick) a CN found over its quota is
/// told `QuotaExceeded`, loses its management QPs and every chunk it holds. Host engine: exact —
/// the allocation that would exceed the quota is refused with `QuotaExceeded`, nothing revoked.
/// Other CNs are unaffected either way.
#[test]
fn quota_enforcement() {
    both(|mode| {
        let mut c = cluster_with(mode, 16, 2);
        let keep = c.alloc(1).unwrap();
        let a1 = c.alloc(0).unwrap();
        let _a2 = c.alloc(0).unwrap();
        let third = c.alloc(0);
        match mode {
            ExecutionMode::Offloaded => {
                assert!(third.is_ok(), "the chain does not check quotas");
                c.sample_counters().unwrap();
                assert_eq!(c.driver.mn.stats().quota_disconnects, 1);
                assert!(c.cns[0]
                    .events
                    .iter()
                    .any(|e| matches!(e, ClientEvent::Failed { code: ErrorCode::QuotaExceeded, .. })));
                c.check_invariants().unwrap();
                // its chunks are revoked, its management QPs gone
                assert_eq!(c.read_raw(0, 0, a1.base, a1.rkey(0).unwrap(), 8).0, WcStatus::RemAccessErr);
                assert!(c.alloc(0).is_err());
            }
            _ => {
                assert_eq!(third, Err(CnOpError::Mn(ErrorCode::QuotaExceeded)));
                assert_eq!(c.driver.mn.stats().quota_disconnects, 0);
                assert_eq!(c.write(0, &a1, 0, 0, b"kept"), WcStatus::Success);
                c.free(0, &a1).unwrap();
                assert!(c.alloc(0).is_ok());
            }
        }
        // the other CN is unaffected
        assert_eq!(c.write(1, &keep, 0, 0, b"still mine"), WcStatus::Success);
        assert!(c.alloc(1).is_ok());
        c.check_invariants().unwrap();
    });
}

/// Offloaded chains bind access windows to whatever QPs the request names (DESIGN.md §2: a bad
/// QP number only hurts the caller). The MN's audit on its tick reclaims such a group: the
/// requester loses it, the CN whose QP it was bound to never gets access.
#[test]
fn windows_bound_to_a_foreign_qp_are_reclaimed_by_the_audit() {
    both(|mode| {
        let mut c = cluster_with(mode, 8, 16);
        let victim = c.driver.mn.cn(c.cns[1].id).unwrap().qps.access.clone();
        let own = c.driver.mn.cn(c.cns[0].id).unwrap().qps.access.clone();
        let r = c.alloc_naming(0, &[victim[0], own[1]]);
        match mode {
            // the host engine refuses the foreign QP outright
            ExecutionMode::HostEngine => {
                assert_eq!(r, Err(CnOpError::Mn(ErrorCode::AllocFailed)));
                c.check_invariants().unwrap();
            }
            // the chain binds where it was told; the victim still cannot use it without the
            // rkey, and the MN's next audit takes the group back from the requester
            _ => {
                let a = r.unwrap();
                assert_eq!(c.read_raw(1, 0, a.base, Rkey(a.rkey(0).unwrap().0 ^ 1), 8).0, WcStatus::RemAccessErr);
                assert!(c.check_invariants().is_err(), "window bound outside its owner's QPs");
                c.tick().unwrap();
                c.check_invariants().unwrap();
                assert_eq!(c.write(0, &a, 1, 0, b"gone"), WcStatus::RemAccessErr);
            }
        }
        assert_eq!(c.free_groups(), 8);
        assert!(c.alloc(1).is_ok());
    });
}

#[test]
fn empty_queue_then_available() {
    both(|mode| {
        let mut c = cluster_with(mode, 4, 16);
        let mut held = Vec::new();
        for i in 0..4 {
            held.push((i % 3, c.alloc(i % 3).unwrap()));
        }
        assert_eq!(c.alloc(0), Err(CnOpError::Mn(ErrorCode::Empty)));
        c.check_invariants().unwrap();
        assert!(c.driver.mn.is_empty_state());
        for n in &c.cns {
            assert!(n.events.contains(&ClientEvent::Empty), "every CN heard 'empty'");
        }
        // while backing off the client refuses to send
        assert!(c.alloc(1).is_err());
        let (i, a) = held.pop().unwrap();
        c.free(i, &a).unwrap();
        c.tick().unwrap(); // the MN's timer settles the ticket and announces availability
        assert!(!c.driver.mn.is_empty_state());
        for n in &c.cns {
            assert!(n.events.iter().any(|e| matches!(e, ClientEvent::Available)), "every CN heard 'available'");
        }
        let again = c.alloc(0).unwrap();
        assert_eq!(again.base, a.base);
        c.check_invariants().unwrap();
        // nothing lost: free everything, the queue holds all four
        c.free(0, &again).unwrap();
        for (i, a) in held {
            c.free(i, &a).unwrap();
        }
        c.tick().unwrap();
        assert_eq!(c.free_groups(), 4);
        c.check_invariants().unwrap();
    });
}

#[test]
fn crash_after_allocations_reclaims_everything() {
    both(|mode| {
        let mut c = cluster_with(mode, 8, 16);
        let a = c.alloc(0).unwrap();
        let _b = c.alloc(0).unwrap();
        let other = c.alloc(1).unwrap();
        let before = c.free_groups();
        c.crash_cn(0).unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.free_groups(), before + 2);
        assert_eq!(c.mw_binding(a.rkey(0).unwrap()), Some(MwBinding::Unbound));
        assert_eq!(c.write(1, &other, 0, 0, b"fine"), WcStatus::Success);
    });
}

#[test]
fn crash_mid_allocation_loses_nothing() {
    both(|mode| {
        for steps in [1u64, 5, 12, 20, 30, 45, 60] {
            let mut c = cluster_with(mode, 4, 16);
            let _held = c.alloc(0).unwrap();
            let _tok = c.alloc_begin(0).unwrap();
            for _ in 0..steps {
                c.fabric.borrow_mut().step();
            }
            c.crash_cn(0).unwrap();
            c.tick().unwrap();
            c.check_invariants().unwrap_or_else(|e| panic!("{mode:?} crash after {steps} steps: {e}"));
            assert_eq!(c.free_groups(), 4, "{mode:?} crash after {steps} steps");
            assert!(c.alloc(1).is_ok());
        }
    });
}

/// Policy under test: an MN RNIC reset revokes every allocation (all windows are gone); the
/// pool is rebuilt from the MWTable with every group free and advanced keys, CNs are told
/// `Revoked`, and they can allocate again.
#[test]
fn mn_rnic_reset_revokes_and_rebuilds() {
    both(|mode| {
        let mut c = cluster_with(mode, 8, 16);
        let a = c.alloc(0).unwrap();
        let b = c.alloc(1).unwrap();
        c.reset_mn_rnic().unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.free_groups(), 8);
        for n in &c.cns {
            assert!(n.events.contains(&ClientEvent::Revoked));
        }
        assert_eq!(c.read_raw(0, 0, a.base, a.rkey(0).unwrap(), 8).0, WcStatus::RemAccessErr);
        assert_eq!(c.read_raw(1, 0, b.base, b.rkey(0).unwrap(), 8).0, WcStatus::RemAccessErr);
        let a2 = c.alloc(0).unwrap();
        assert_eq!(c.write(0, &a2, 0, 0, b"after reset"), WcStatus::Success);
        c.check_invariants().unwrap();
    });
}

#[test]
fn corrupted_and_arbitrary_requests_are_typed_errors() {
    both(|mode| {
        let mut c = cluster_with(mode, 8, 16);
        let a = c.alloc(0).unwrap();
        let patterns: Vec<Vec<u8>> =
            vec![vec![], vec![0xFF; 3], vec![0; 28], (0..28u32).map(|i| (i * 37) as u8).collect(), vec![0xAB; 200], {
                // a well-formed header with a garbage reply address and QPNs
                let mut v = vec![0x4F, 0x4D, 1, 1, 7, 0, 0, 0];
                v.extend_from_slice(&[0xEE; 20]);
                v
            }];
        for p in &patterns {
            c.send_raw(2, ChainKind::Alloc, p).unwrap();
            c.check_invariants().unwrap_or_else(|e| panic!("{mode:?} after alloc bytes {p:?}: {e}"));
            c.send_raw(2, ChainKind::Free, p).unwrap();
            c.check_invariants().unwrap_or_else(|e| panic!("{mode:?} after free bytes {p:?}: {e}"));
        }
        // corrupt the next request of an honest CN in flight
        let qp = c.cns[1].alloc_qp;
        c.fabric.borrow_mut().faults_mut().corrupt_sends(qp, 12);
        let r = c.alloc(1);
        c.check_invariants().unwrap();
        if let Ok(x) = r {
            c.free(1, &x).unwrap();
        }
        // honest CNs keep working
        assert_eq!(c.write(0, &a, 0, 0, b"ok"), WcStatus::Success);
        let b = c.alloc(1).unwrap();
        c.free(1, &b).unwrap();
        c.check_invariants().unwrap();
    });
}

#[test]
fn rxe_compatible_device_uses_per_chunk_mrs() {
    let mut cfg = ClusterConfig::paper_like();
    cfg.nic = NicConfig::rxe_compatible().with_offload(false);
    cfg.cns = 2;
    let mut c = Cluster::new(cfg).unwrap();
    assert_eq!(c.mode, ExecutionMode::HostEngine, "no offload on an rxe-like device");
    assert!(c.per_chunk_mrs);
    let a = c.alloc(0).unwrap();
    // out of the window but inside the pool: the chunk's own MR stops it
    assert_eq!(c.read_raw(0, 0, a.base + a.length, a.rkey(0).unwrap(), 8).0, WcStatus::RemAccessErr);
    assert_eq!(c.free_raw(1, a.entry_addr), Err(CnOpError::Mn(ErrorCode::NotOwner)), "software ownership check");
    c.check_invariants().unwrap();
}

#[test]
fn lost_and_delayed_messages() {
    use omw_loopback::fault::MessageFilter;
    both(|mode| {
        let mut c = cluster_with(mode, 8, 16);
        // a lost request: the CN's send fails, both ends of the Alloc QP pair error; the MN sees
        // its chain QP flushed, repairs and re-arms; the CN allocates again afterwards
        let qp = c.cns[1].alloc_qp;
        c.fabric.borrow_mut().faults_mut().drop_next(MessageFilter::from_qp(qp), 1);
        assert!(c.alloc(1).is_err(), "{mode:?}: a dropped request yields no allocation");
        c.tick().unwrap();
        c.check_invariants().unwrap();
        let a = c.alloc(1).unwrap_or_else(|e| panic!("{mode:?}: after a lost message: {e}"));
        assert_eq!(c.write(1, &a, 0, 0, b"after loss"), WcStatus::Success);
        // a delayed request only costs time
        let t0 = c.now();
        c.fabric.borrow_mut().faults_mut().delay_next(MessageFilter::from_qp(qp), 50_000, 1);
        let b = c.alloc(1).unwrap();
        assert!(c.now() - t0 >= 50_000, "the delay shows in modelled time");
        c.free(1, &b).unwrap();
        c.free(1, &a).unwrap();
        c.tick().unwrap();
        assert_eq!(c.free_groups(), 8);
        c.check_invariants().unwrap();
    });
}

/// Host-engine mode zeroes a chunk on free: the next owner cannot read the last one's bytes.
/// (Offloaded frees are not scrubbed — see docs/ARCHITECTURE.md, "Known gaps".)
#[test]
fn host_engine_scrubs_freed_chunks() {
    let mut c = cluster_with(ExecutionMode::HostEngine, 1, 16);
    let a = c.alloc(0).unwrap();
    assert_eq!(c.write(0, &a, 0, 0, b"secret of cn0"), WcStatus::Success);
    c.free(0, &a).unwrap();
    let b = c.alloc(1).unwrap();
    assert_eq!(b.base, a.base);
    let (st, got) = c.read(1, &b, 0, 0, 13);
    assert_eq!(st, WcStatus::Success);
    assert_eq!(got, vec![0u8; 13]);
}
