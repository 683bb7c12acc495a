//! DESIGN.md §3 on the model, beyond the suite's memory-window scenarios (`omw_tests::mw`, run
//! on this NIC by tests/tests/conformance_loopback.rs): binds from a management QP, every bind
//! error, invalidating twice and with stale keys, rights, zero-based windows, SEND_WITH_INV's
//! failure classes, deregistration, deallocation, what the model refuses to model.

mod common;
use common::*;
use omw_core::access::AccessFlags;
use omw_core::device::mw_rules::{DeallocFail, RegMrFail};
use omw_core::device::{MwBinding, QpState, WcStatus, WindowState};
use omw_core::ids::Rkey;
use omw_core::wire::wqe::{QueueSel, Wqe};
use omw_loopback::{LoopbackError, MwState, NicConfig, PdId, QpAddr, QpConfig};

const RW: AccessFlags = AccessFlags::DATA_WINDOW;

struct MwEnv {
    e: Env,
    /// A second CN↔MN pair (another CN's access QP, say).
    c2: QpAddr,
    m2: QpAddr,
    /// The MN's loopback pair (management: binds for other QPs).
    lp: QpAddr,
    mw: Rkey,
}

fn mw_env(cfg: NicConfig) -> MwEnv {
    let mut e = env(cfg);
    let (c2, m2) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
    let (lp, _lb) = e.f.create_connected_pair(e.mn, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
    let mw = e.f.alloc_mw(e.mn, PdId(0)).unwrap();
    MwEnv { e, c2, m2, lp, mw }
}

impl MwEnv {
    /// Post a BIND on `on`, binding window `rkey` to `target` over `[pool+off, +len)`.
    fn bind(&mut self, on: QpAddr, rkey: Rkey, off: u64, len: u32, target: QpAddr, acc: AccessFlags) -> WcStatus {
        let w = Wqe::bind_mw(rkey.0, self.e.pool + off, len, self.e.pool_k.lkey, target.qpn.get(), acc);
        self.e.f.post_send(on, &w).unwrap();
        one(&mut self.e.f, on).status
    }
    fn read(&mut self, via: QpAddr, rkey: Rkey, off: u64, len: u32) -> WcStatus {
        let w = Wqe::read(self.e.buf, self.e.buf_k.lkey, len, self.e.pool + off, rkey.0);
        self.e.f.post_send(via, &w).unwrap();
        one(&mut self.e.f, via).status
    }
    fn write(&mut self, via: QpAddr, rkey: Rkey, off: u64, len: u32) -> WcStatus {
        let w = Wqe::write(self.e.buf, self.e.buf_k.lkey, len, self.e.pool + off, rkey.0);
        self.e.f.post_send(via, &w).unwrap();
        one(&mut self.e.f, via).status
    }
    fn op(&mut self, on: QpAddr, w: Wqe) -> WcStatus {
        self.e.f.post_send(on, &w).unwrap();
        one(&mut self.e.f, on).status
    }
}

#[test]
fn bind_from_a_management_qp_needs_bind_to_other_qp() {
    let mut t = mw_env(NicConfig::strict());
    let (lp, m, c) = (t.lp, t.e.m, t.e.c);
    let k = t.mw.next_key();
    assert_eq!(t.bind(lp, k, 0, 64, m, RW), WcStatus::Success, "offload: UMR binds for another QP");
    assert_eq!(t.read(c, k, 0, 8), WcStatus::Success);

    let mut t = mw_env(NicConfig::host_engine());
    let (lp, m, c) = (t.lp, t.e.m, t.e.c);
    let k = t.mw.next_key();
    assert_eq!(t.bind(lp, k, 0, 64, m, RW), WcStatus::MwBindErr);
    assert_eq!(t.e.f.qp_state(lp).unwrap(), QpState::Err);
    assert_eq!(t.bind(m, k, 0, 64, m, RW), WcStatus::Success, "posted on the QP it binds to");
    assert_eq!(t.read(c, k, 0, 8), WcStatus::Success);
}

#[test]
fn local_invalidate_then_access_is_refused() {
    let mut t = mw_env(NicConfig::strict());
    let (m, c) = (t.e.m, t.e.c);
    let k = t.mw.next_key();
    assert_eq!(t.bind(m, k, 0, 64, m, RW), WcStatus::Success);
    assert_eq!(t.op(m, Wqe::local_inv(k.0)), WcStatus::Success);
    assert_eq!(t.e.f.mw_binding(t.e.mn, k.index()).unwrap().state, MwState::Free);
    assert_eq!(t.read(c, k, 0, 8), WcStatus::RemAccessErr);
    // invalidating again: not bound
    t.e.f.reset_qp(m).unwrap();
    assert_eq!(t.op(m, Wqe::local_inv(k.0)), WcStatus::MwBindErr);
}

#[test]
fn rebind_with_next_key_and_stale_key_rejected() {
    let mut t = mw_env(NicConfig::strict());
    let (m, c) = (t.e.m, t.e.c);
    let k1 = t.mw.next_key();
    assert_eq!(t.bind(m, k1, 0, 64, m, RW), WcStatus::Success);
    assert_eq!(t.op(m, Wqe::local_inv(k1.0)), WcStatus::Success);
    let k2 = k1.next_key();
    assert_eq!(t.bind(m, k2, 0, 64, m, RW), WcStatus::Success);
    assert_eq!(t.read(c, k2, 0, 8), WcStatus::Success);
    assert_eq!(t.read(c, k1, 0, 8), WcStatus::RemAccessErr);
    t.e.f.reset_qp(c).unwrap();
    // invalidation with the stale key fails, with the current one succeeds
    assert_eq!(t.op(m, Wqe::local_inv(k1.0)), WcStatus::MwBindErr);
    t.e.f.reset_qp(m).unwrap();
    assert_eq!(t.op(m, Wqe::local_inv(k2.0)), WcStatus::Success);
}

#[test]
fn bind_errors() {
    let mut t = mw_env(NicConfig::strict());
    let m = t.e.m;
    let k = t.mw.next_key();
    assert_eq!(t.bind(m, k, 0, 64, m, RW), WcStatus::Success);
    // bind while bound
    assert_eq!(t.bind(m, k.next_key(), 0, 64, m, RW), WcStatus::MwBindErr);
    assert_eq!(t.e.f.qp_state(m).unwrap(), QpState::Err, "a failed bind moves the QP to error");
    t.e.f.reset_qp(m).unwrap();
    let w2 = t.e.f.alloc_mw(t.e.mn, PdId(0)).unwrap();
    let try_bind = |t: &mut MwEnv, w: Wqe| {
        t.e.f.post_send(m, &w).unwrap();
        let s = one(&mut t.e.f, m).status;
        t.e.f.reset_qp(m).unwrap();
        s
    };
    let (pool, lk) = (t.e.pool, t.e.pool_k.lkey);
    let q = m.qpn.get();
    // zero length
    assert_eq!(try_bind(&mut t, Wqe::bind_mw(w2.0, pool, 0, lk, q, RW)), WcStatus::MwBindErr);
    // outside the MR
    assert_eq!(try_bind(&mut t, Wqe::bind_mw(w2.0, pool + (64 << 10) - 8, 16, lk, q, RW)), WcStatus::MwBindErr);
    // not a window
    assert_eq!(try_bind(&mut t, Wqe::bind_mw(lk, pool, 8, lk, q, RW)), WcStatus::MwBindErr);
    // MR without MW_BIND
    let (nb, nbk) = t.e.f.alloc_mr(t.e.mn, PdId(0), 64, 8, AccessFlags::LOCAL_WRITE).unwrap();
    assert_eq!(try_bind(&mut t, Wqe::bind_mw(w2.0, nb, 8, nbk.lkey, q, RW)), WcStatus::MwBindErr);
    // a writable window over an MR without LOCAL_WRITE
    let (nw, nwk) = t.e.f.alloc_mr(t.e.mn, PdId(0), 64, 8, AccessFlags::MW_BIND).unwrap();
    assert_eq!(try_bind(&mut t, Wqe::bind_mw(w2.0, nw, 8, nwk.lkey, q, RW)), WcStatus::MwBindErr);
    assert_eq!(
        try_bind(&mut t, Wqe::bind_mw(w2.0, nw, 8, nwk.lkey, q, AccessFlags::REMOTE_READ)),
        WcStatus::Success,
        "a read-only window is fine"
    );
    // a target QP that does not exist, or lives on another host
    let w3 = t.e.f.alloc_mw(t.e.mn, PdId(0)).unwrap();
    assert_eq!(try_bind(&mut t, Wqe::bind_mw(w3.0, pool, 8, lk, 0x00FF_0000, RW)), WcStatus::MwBindErr);
    let cq = t.e.c.qpn.get();
    assert_eq!(try_bind(&mut t, Wqe::bind_mw(w3.0, pool, 8, lk, cq, RW)), WcStatus::MwBindErr);
    // a window of another PD
    let pd1 = t.e.f.alloc_pd(t.e.mn).unwrap();
    let w4 = t.e.f.alloc_mw(t.e.mn, pd1).unwrap();
    assert_eq!(try_bind(&mut t, Wqe::bind_mw(w4.0, pool, 8, lk, q, RW)), WcStatus::MwBindErr);
    assert_eq!(t.e.f.counters().completions(WcStatus::MwBindErr), 9);
}

/// The rule itself (strict: LOCAL_INV only on the bound QP; rxe: anywhere) is the suite's
/// `mw::local_invalidate_from_another_qp_strict_versus_rxe`; here, that the model declares it.
#[test]
fn the_invalidation_qp_check_is_declared_as_a_capability() {
    for (cfg, checks) in [(NicConfig::strict(), true), (NicConfig::rxe_compatible(), false)] {
        let t = mw_env(cfg);
        assert_eq!(t.e.f.capabilities().contains(omw_core::device::Capabilities::MW_QP_CHECK_ON_INVALIDATE), checks);
    }
}

#[test]
fn unbind_has_no_qp_check_but_needs_the_exact_key() {
    let mut t = mw_env(NicConfig::strict());
    let (m, lp) = (t.e.m, t.lp);
    let k = t.mw.next_key();
    assert_eq!(t.bind(m, k, 0, 64, m, RW), WcStatus::Success);
    assert_eq!(t.op(lp, Wqe::unbind_mw(k.next_key().0)), WcStatus::MwBindErr, "stale/wrong key");
    t.e.f.reset_qp(lp).unwrap();
    assert_eq!(t.op(lp, Wqe::unbind_mw(k.0)), WcStatus::Success, "from another QP");
    assert!(!t.e.f.mw_is_bound(t.e.mn, k));
    assert_eq!(t.op(lp, Wqe::unbind_mw(k.0)), WcStatus::MwBindErr, "already unbound");
}

#[test]
fn insufficient_rights() {
    let mut t = mw_env(NicConfig::strict());
    let (m, c) = (t.e.m, t.e.c);
    let k = t.mw.next_key();
    assert_eq!(t.bind(m, k, 0, 64, m, AccessFlags::REMOTE_READ), WcStatus::Success);
    assert_eq!(t.write(c, k, 0, 8), WcStatus::RemAccessErr);
    t.e.f.reset_qp(c).unwrap();
    let (buf, lk, pool) = (t.e.buf, t.e.buf_k.lkey, t.e.pool);
    assert_eq!(t.op(c, Wqe::fetch_add(buf, lk, pool, k.0, 1)), WcStatus::RemAccessErr);
    t.e.f.reset_qp(c).unwrap();
    assert_eq!(t.read(c, k, 0, 8), WcStatus::Success);
    // an atomic window
    let w2 = t.e.f.alloc_mw(t.e.mn, PdId(0)).unwrap().next_key();
    assert_eq!(t.bind(m, w2, 64, 64, m, AccessFlags::REMOTE_ATOMIC), WcStatus::Success);
    assert_eq!(t.op(c, Wqe::fetch_add(buf, lk, pool + 64, w2.0, 1)), WcStatus::Success);
    assert_eq!(t.read(c, w2, 64, 8), WcStatus::RemAccessErr);
}

#[test]
fn zero_based_window_addresses_are_offsets() {
    let mut t = mw_env(NicConfig::strict());
    let (m, c) = (t.e.m, t.e.c);
    let k = t.mw.next_key();
    t.e.f.write(t.e.mn, t.e.pool + 512, b"zero-based").unwrap();
    assert_eq!(t.bind(m, k, 512, 64, m, RW | AccessFlags::ZERO_BASED), WcStatus::Success);
    let w = Wqe::read(t.e.buf, t.e.buf_k.lkey, 10, 0, k.0);
    assert_eq!(t.op(c, w), WcStatus::Success);
    assert_eq!(read_bytes(&t.e.f, t.e.cn, t.e.buf, 10), b"zero-based");
    assert_eq!(t.op(c, Wqe::read(t.e.buf, t.e.buf_k.lkey, 8, 60, k.0)), WcStatus::RemAccessErr);
}

#[test]
fn send_with_invalidate() {
    for cfg in [NicConfig::strict(), NicConfig::rxe_compatible()] {
        let mut t = mw_env(cfg);
        let (m, c, m2, c2) = (t.e.m, t.e.c, t.m2, t.c2);
        let (pool, plk) = (t.e.pool, t.e.pool_k.lkey);
        let k = t.mw.next_key();
        assert_eq!(t.bind(m, k, 0, 64, m, RW), WcStatus::Success);
        // from the bound pair: invalidated, reported in the receive completion
        t.e.f.post_recv(m, &recv(1, &[(pool + 4096, 64, plk)])).unwrap();
        let s = Wqe::send_with_inv(t.e.buf, t.e.buf_k.lkey, 8, k.0);
        assert_eq!(t.op(c, s), WcStatus::Success);
        let r = drain(&mut t.e.f, m, QueueSel::Recv);
        assert_eq!((r[0].status, r[0].invalidated), (WcStatus::Success, Some(k)));
        assert!(!t.e.f.mw_is_bound(t.e.mn, k));
        assert_eq!(t.read(c, k, 0, 8), WcStatus::RemAccessErr);
        t.e.f.reset_qp(c).unwrap();
        // a window bound to another QP: strict refuses, rxe invalidates anyway
        let k2 = k.next_key();
        assert_eq!(t.bind(m, k2, 0, 64, m, RW), WcStatus::Success);
        t.e.f.post_recv(m2, &recv(2, &[(pool + 4096, 64, plk)])).unwrap();
        let s = Wqe::send_with_inv(t.e.buf, t.e.buf_k.lkey, 8, k2.0);
        if cfg.conformance == omw_loopback::Conformance::Strict {
            // class J: no NAK, so no completion for the SEND (see strict_class_j_* below)
            t.e.f.post_send(c2, &s).unwrap();
            assert!(drain(&mut t.e.f, c2, QueueSel::Send).is_empty());
            assert_eq!(drain(&mut t.e.f, m2, QueueSel::Recv)[0].status, WcStatus::RemInvReqErr);
            assert_eq!(t.e.f.qp_state(m2).unwrap(), QpState::Err);
            assert!(t.e.f.mw_is_bound(t.e.mn, k2));
        } else {
            assert_eq!(t.op(c2, s), WcStatus::Success);
            assert!(!t.e.f.mw_is_bound(t.e.mn, k2));
        }
        // a stale key or an MR's key is refused in both modes: strict fails both sides; rxe
        // (measured) fails only the receiver, the SEND itself completes successfully
        t.e.f.reset_qp(c2).unwrap();
        // the MN end keeps what it had received before the CN reconnected: take it away
        drain(&mut t.e.f, m2, QueueSel::Recv);
        t.e.f.post_recv(m2, &recv(3, &[(pool + 4096, 64, plk)])).unwrap();
        let s = Wqe::send_with_inv(t.e.buf, t.e.buf_k.lkey, 8, t.e.pool_k.rkey);
        if cfg.conformance == omw_loopback::Conformance::Strict {
            t.e.f.post_send(c2, &s).unwrap();
            assert!(drain(&mut t.e.f, c2, QueueSel::Send).is_empty());
        } else {
            assert_eq!(t.op(c2, s), WcStatus::Success);
        }
        assert_eq!(t.e.f.qp_state(c2).unwrap(), QpState::Rts);
        assert_eq!(drain(&mut t.e.f, m2, QueueSel::Recv)[0].status, WcStatus::RemInvReqErr);
        assert_eq!(t.e.f.qp_state(m2).unwrap(), QpState::Err);
    }
}

#[test]
fn dereg_refused_while_windows_are_bound_and_inspection() {
    let mut t = mw_env(NicConfig::strict());
    let m = t.e.m;
    let k = t.mw.next_key();
    assert_eq!(t.bind(m, k, 16, 32, m, RW), WcStatus::Success);
    assert!(matches!(
        t.e.f.dereg_mr(t.e.mn, t.e.pool_k.lkey),
        Err(omw_loopback::LoopbackError::MrHasBoundWindows { .. })
    ));
    let info = t.e.f.mw_binding(t.e.mn, k.index()).unwrap();
    assert_eq!(info.rkey, k);
    match info.state {
        MwState::Bound(b) => {
            assert_eq!((b.qpn, b.addr, b.len, b.access), (m.qpn, t.e.pool + 16, 32, RW));
            assert_eq!(b.mr_lkey, t.e.pool_k.lkey);
        }
        MwState::Free => panic!("not bound"),
    }
    assert_eq!(t.e.f.mr_info(t.e.mn, t.e.pool_k.lkey).unwrap().bound_windows, 1);
    let mn = t.e.mn;
    let view = t.e.f.view(mn);
    assert_eq!(view.mw_binding(k), Some(MwBinding::Bound { rkey: k, qpn: m.qpn }));
    assert_eq!(t.op(m, Wqe::local_inv(k.0)), WcStatus::Success);
    assert_eq!(t.e.f.view(mn).mw_binding(k), Some(MwBinding::Unbound));
    t.e.f.dereg_mr(mn, t.e.pool_k.lkey).unwrap();
    assert_eq!(t.e.f.dealloc_mw(mn, k).unwrap(), None, "nothing to revoke");
    assert_eq!(t.e.f.mw_binding(mn, k.index()), None);
}

// ---- conformance classes (issue 11 part 4) ------------------------------------------------

/// Deallocating a bound type-2 window succeeds in both modes and revokes it: later accesses
/// through its rkey are REM_ACCESS_ERR, the MR no longer counts it, and a second dealloc
/// or a wrong key byte says exactly that.
#[test]
fn dealloc_of_a_bound_window_revokes_it() {
    for cfg in [NicConfig::strict(), NicConfig::rxe_compatible()] {
        let mut t = mw_env(cfg);
        let (m, c, mn) = (t.e.m, t.e.c, t.e.mn);
        let k = t.mw.next_key();
        assert_eq!(t.bind(m, k, 0, 64, m, RW), WcStatus::Success);
        assert_eq!(t.read(c, k, 0, 8), WcStatus::Success);
        let stale = Rkey(k.0 ^ 1);
        assert!(matches!(
            t.e.f.dealloc_mw(mn, stale),
            Err(LoopbackError::DeallocMw { reason: DeallocFail::StaleKey, .. })
        ));
        assert!(t.e.f.mw_is_bound(mn, k), "a refused dealloc changes nothing");
        let revoked = t.e.f.dealloc_mw(mn, k).unwrap().expect("it was bound");
        assert_eq!((revoked.qpn, revoked.addr, revoked.len), (m.qpn, t.e.pool, 64));
        assert_eq!(t.read(c, k, 0, 8), WcStatus::RemAccessErr);
        assert_eq!(t.e.f.mr_info(mn, t.e.pool_k.lkey).unwrap().bound_windows, 0);
        t.e.f.dereg_mr(mn, t.e.pool_k.lkey).unwrap();
        assert!(matches!(
            t.e.f.dealloc_mw(mn, k),
            Err(LoopbackError::DeallocMw { reason: DeallocFail::NotAWindow, .. })
        ));
        let e = t.e.f.dealloc_mw(mn, k).unwrap_err();
        assert!(std::error::Error::source(&e).is_some(), "the rule's reason is kept as the source");
    }
}

/// Strict mode, IBTA 9.9.6.3 class J: a SEND_WITH_INV whose invalidation fails makes the
/// responder complete its receive WQE in error and go to Err, and sends no NAK, so the
/// requester gets no completion for it and stays RTS; its next request finds the errored
/// responder and times out.
#[test]
fn strict_class_j_send_with_inv_is_silent_to_the_requester() {
    let mut t = mw_env(NicConfig::strict());
    let (c2, m2, m) = (t.c2, t.m2, t.e.m);
    let (pool, plk) = (t.e.pool, t.e.pool_k.lkey);
    let k = t.mw.next_key();
    assert_eq!(t.bind(m, k, 0, 64, m, RW), WcStatus::Success); // bound to m, not m2
    t.e.f.post_recv(m2, &recv(7, &[(pool + 4096, 64, plk)])).unwrap();
    let s = Wqe::send_with_inv(t.e.buf, t.e.buf_k.lkey, 8, k.0);
    t.e.f.post_send(c2, &s).unwrap();
    assert!(drain(&mut t.e.f, c2, QueueSel::Send).is_empty(), "no NAK, no completion");
    assert_eq!(t.e.f.qp_state(c2).unwrap(), QpState::Rts);
    let r = drain(&mut t.e.f, m2, QueueSel::Recv);
    assert_eq!((r.len(), r[0].wr_id, r[0].status, r[0].invalidated), (1, 7, WcStatus::RemInvReqErr, None));
    assert_eq!(t.e.f.qp_state(m2).unwrap(), QpState::Err);
    assert!(t.e.f.mw_is_bound(t.e.mn, k), "nothing was invalidated");
    assert_eq!(t.e.f.counters().silent_class_j, 1);
    // the next request meets the errored responder
    assert_eq!(t.op(c2, Wqe::send(t.e.buf, t.e.buf_k.lkey, 8)), WcStatus::RetryExcErr);
}

/// Window rights with a bit rxe does not support: rxe refuses them in the bind
/// (`rxe_bind_mw`: `access & ~RXE_ACCESS_SUPPORTED_MW` → MW_BIND_ERR); strict mode refuses
/// the WQE at decode (LOC_QP_OP_ERR), like any malformed canonical WQE. `MW_BIND` itself is
/// in `RXE_ACCESS_SUPPORTED_MW`, so rxe binds such a window (and ignores the bit).
#[test]
fn window_rights_outside_the_supported_set() {
    let unknown = AccessFlags::from_bits_retain(RW.bits() | 1 << 12);
    for (cfg, want) in [(NicConfig::strict(), WcStatus::LocQpOpErr), (NicConfig::rxe_compatible(), WcStatus::MwBindErr)]
    {
        let mut t = mw_env(cfg);
        let m = t.e.m;
        let k = t.mw.next_key();
        assert_eq!(t.bind(m, k, 0, 64, m, unknown), want);
        assert!(!t.e.f.mw_is_bound(t.e.mn, k));
        assert_eq!(t.e.f.qp_state(m).unwrap(), QpState::Err);
    }
    let mut t = mw_env(NicConfig::strict());
    let (m, k) = (t.e.m, t.mw.next_key());
    assert_eq!(t.bind(m, k, 0, 64, m, RW | AccessFlags::MW_BIND), WcStatus::LocQpOpErr);
    let mut t = mw_env(NicConfig::rxe_compatible());
    let (m, c, k) = (t.e.m, t.e.c, t.mw.next_key());
    assert_eq!(t.bind(m, k, 0, 64, m, RW | AccessFlags::MW_BIND), WcStatus::Success);
    assert_eq!(t.read(c, k, 0, 8), WcStatus::Success);
}

/// ZERO_BASED and ON_DEMAND registrations are refused with a typed reason (the model has
/// no IOVA-based registration and no page faults), as is REMOTE_WRITE without LOCAL_WRITE.
#[test]
fn reg_mr_refuses_what_the_model_does_not_model() {
    let mut t = mw_env(NicConfig::strict());
    let mn = t.e.mn;
    for (bits, reason) in [
        (AccessFlags::ZERO_BASED, RegMrFail::ZeroBased),
        (AccessFlags::ON_DEMAND, RegMrFail::OnDemand),
        (AccessFlags::REMOTE_WRITE, RegMrFail::RemoteWriteWithoutLocalWrite),
    ] {
        let acc = if reason == RegMrFail::RemoteWriteWithoutLocalWrite { bits } else { ALL_REMOTE | bits };
        match t.e.f.reg_mr(mn, PdId(0), t.e.pool, 4096, acc) {
            Err(LoopbackError::RegMr { reason: r, .. }) => assert_eq!(r, reason),
            other => panic!("{acc:?}: {other:?}"),
        }
    }
    // a window on the pool still binds: nothing was registered
    let (m, k) = (t.e.m, t.mw.next_key());
    assert_eq!(t.bind(m, k, 0, 64, m, RW), WcStatus::Success);
}

/// A refused remote access names its NAK: a misaligned atomic through a zero-based window
/// is an invalid request (rxe_resp.c RESPST_ERR_MISALIGNED_ATOMIC → REM_INV_REQ_ERR).
#[test]
fn misaligned_atomic_through_a_zero_based_window_is_an_invalid_request() {
    let mut t = mw_env(NicConfig::strict());
    let (m, c) = (t.e.m, t.e.c);
    let k = t.mw.next_key();
    let acc = AccessFlags::REMOTE_ATOMIC | AccessFlags::ZERO_BASED;
    assert_eq!(t.bind(m, k, 4, 64, m, acc), WcStatus::Success); // window base pool+4
    let fa = Wqe::fetch_add(t.e.buf, t.e.buf_k.lkey, 0, k.0, 1);
    assert_eq!(t.op(c, fa), WcStatus::RemInvReqErr);
}
