//! The `RdmaBackend` contract through `HostView`, driven by generic code as the core drives it.

mod common;
use common::*;
use omw_core::access::AccessFlags;
use omw_core::device::{Capabilities, DataPath, Domain, MwBinding, QpState, RdmaBackend, WcStatus};
use omw_core::ids::Qpn;
use omw_core::wire::wqe::{QueueSel, Wqe, WQE_SIZE};
use omw_loopback::{NicConfig, QpConfig};

/// Generic MN-side code: register memory, bind a window on a loop QP through the ring, poll.
fn mn_side<B: RdmaBackend>(b: &mut B, pool: u64, loop_qp: Qpn, target: Qpn) -> omw_core::ids::Rkey {
    assert!(b.capabilities().contains(Capabilities::SECURE_MINIMUM));
    let keys = b.reg_mr(Domain::CnFacing, pool, 4096, super_rights()).unwrap();
    b.write_local(pool, b"from the MN").unwrap();
    let mut got = [0u8; 11];
    b.read_local(pool, &mut got).unwrap();
    assert_eq!(&got, b"from the MN");
    let mw = b.alloc_mw().unwrap().next_key();
    assert_eq!(b.mw_binding(mw), Some(MwBinding::Unbound));
    b.post_send(loop_qp, &Wqe::bind_mw(mw.0, pool, 64, keys.lkey, target.get(), AccessFlags::DATA_WINDOW)).unwrap();
    let mut out = [blank(); 4];
    assert_eq!(b.poll_cq(loop_qp, QueueSel::Send, &mut out).unwrap(), 1);
    assert_eq!(out[0].status, WcStatus::Success);
    assert_eq!(b.mw_binding(mw), Some(MwBinding::Bound { rkey: mw, qpn: target }));
    // the rings are in the ring arena, whose keys are reported
    let rk = b.ring_keys(Domain::CnFacing).unwrap();
    let base = b.ring_base(loop_qp, QueueSel::Send).unwrap();
    let mut slot = [0u8; WQE_SIZE];
    b.read_local(base, &mut slot).unwrap();
    assert_eq!(Wqe::decode(&slot).unwrap().imm, mw.0, "entry 0 holds the bind's canonical bytes");
    assert_ne!(rk.lkey, keys.lkey);
    let rbase = b.ring_base(loop_qp, QueueSel::Recv).unwrap();
    assert!(rbase >= base + WQE_SIZE as u64);
    assert_eq!(b.qp_state(loop_qp).unwrap(), QpState::Rts);
    mw
}

fn super_rights() -> AccessFlags {
    ALL_REMOTE
}

#[test]
fn host_view_implements_the_backend_contract() {
    let mut e = env(NicConfig::strict());
    let (a, _) = e.f.create_connected_pair(e.mn, QpConfig::default(), e.mn, QpConfig::default()).unwrap();
    let pool = e.f.alloc(e.mn, 4096, 4096).unwrap();
    let (mn, m, c) = (e.mn, e.m, e.c);
    let mw = mn_side(&mut e.f.view(mn), pool, a.qpn, m.qpn);
    // a CN reads through the window it was given
    e.f.post_send(c, &Wqe::read(e.buf, e.buf_k.lkey, 11, pool, mw.0)).unwrap();
    {
        let mut cn = e.f.view(e.cn);
        let mut out = [blank(); 4];
        assert_eq!(cn.poll_cq(c.qpn, QueueSel::Send, &mut out).unwrap(), 1);
        assert_eq!(out[0].status, WcStatus::Success);
        let mut got = [0u8; 11];
        cn.read_local(e.buf, &mut got).unwrap();
        assert_eq!(&got, b"from the MN");
    }
    // errors, reset, destroy through the view
    let mut v = e.f.view(mn);
    v.post_send(m.qpn, &Wqe::local_inv(mw.next_key().0)).unwrap();
    let mut out = [blank(); 4];
    assert_eq!(v.poll_cq(m.qpn, QueueSel::Send, &mut out).unwrap(), 1);
    assert_eq!(out[0].status, WcStatus::MwBindErr);
    assert_eq!(v.qp_state(m.qpn).unwrap(), QpState::Err);
    v.reset_qp(m.qpn).unwrap();
    assert_eq!(v.qp_state(m.qpn).unwrap(), QpState::Rts);
    assert!(v.enable(m.qpn, QueueSel::Send, 1).is_err(), "not a managed queue");
    v.destroy_qp(m.qpn).unwrap();
    assert!(v.qp_state(m.qpn).is_err());
    assert!(v.post_recv(m.qpn, &recv(0, &[])).is_err());
}

#[test]
fn capabilities_are_what_the_config_enables() {
    let mut f = omw_loopback::Fabric::new(NicConfig::host_engine());
    let h = f.add_host("mn").unwrap();
    let caps = f.view(h).capabilities();
    assert_eq!(
        omw_core::device::ExecutionMode::choose(caps, None, false).unwrap(),
        omw_core::device::ExecutionMode::HostEngine
    );
    let mut f = omw_loopback::Fabric::new(NicConfig::strict());
    let h = f.add_host("mn").unwrap();
    let caps = f.view(h).capabilities();
    assert_eq!(
        omw_core::device::ExecutionMode::choose(caps, None, false).unwrap(),
        omw_core::device::ExecutionMode::Offloaded
    );
    let mut f = omw_loopback::Fabric::new(NicConfig::rxe_compatible());
    let h = f.add_host("mn").unwrap();
    let caps = f.view(h).capabilities();
    assert!(!caps.contains(Capabilities::OFFLOAD), "rxe lacks the invalidate QP check");
}
