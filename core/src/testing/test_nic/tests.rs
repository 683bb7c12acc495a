//! The test NIC's semantics, each against the rule it implements (DESIGN.md §3).

use super::*;
use crate::wire::wqe::Sge;
use proptest::prelude::*;
use std::vec::Vec as StdVec;

type Nic<'m> = TestNic<'m, 3, 16, 32>;
type View<'a, 'm> = Node<'a, 'm, 3, 16, 32>;

const DATA_ATOMIC: AccessFlags = AccessFlags::DATA_WINDOW.union(AccessFlags::REMOTE_ATOMIC);

/// Two nodes: A (the requester, a local buffer) and B (a pool with one window bound to the
/// B end of the pair `qa`–`qb`).
struct Fx<'a, 'm> {
    a: View<'a, 'm>,
    b: View<'a, 'm>,
    qa: Qpn,
    qb: Qpn,
    buf: u64,
    buf_key: u32,
    pool: u64,
    pool_key: u32,
    mw: Rkey,
}

fn comps(v: &mut View<'_, '_>, qp: Qpn, q: QueueSel) -> StdVec<Completion> {
    let mut out = [Completion::EMPTY; 32];
    let n = v.poll_cq(qp, q, &mut out).unwrap();
    out[..n].to_vec()
}

fn one(v: &mut View<'_, '_>, qp: Qpn, q: QueueSel) -> Completion {
    let c = comps(v, qp, q);
    assert_eq!(c.len(), 1, "{c:?}");
    c[0]
}

fn with_fx(mode: Mode, window_access: AccessFlags, f: impl FnOnce(&mut Fx<'_, '_>)) {
    let (mut ma, mut mb, mut mc) = (std::vec![0u8; 16384], std::vec![0u8; 16384], std::vec![0u8; 4096]);
    let mut nic: Nic<'_> = TestNic::new(mode);
    let na = nic.add_node(&mut ma).unwrap();
    let nb = nic.add_node(&mut mb).unwrap();
    nic.add_node(&mut mc).unwrap();
    let nic = RefCell::new(nic);
    let mut a = Node::new(&nic, na);
    let mut b = Node::new(&nic, nb);
    let (qa, qb) = a.connect_to(Domain::CnFacing, nb, Domain::CnFacing).unwrap();
    let buf = a.alloc_memory(4096, 64).unwrap();
    let buf_key =
        a.reg_mr(Domain::CnFacing, buf, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap().lkey;
    let pool = b.alloc_memory(8192, 4096).unwrap();
    let pool_key =
        b.reg_mr(Domain::CnFacing, pool, 8192, AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE).unwrap().lkey;
    let mw = b.alloc_mw().unwrap().next_key();
    b.post_send(qb, &Wqe::bind_mw(mw.0, pool, 256, pool_key, qb.get(), window_access).with_wr_id(1)).unwrap();
    assert_eq!(one(&mut b, qb, QueueSel::Send).status, WcStatus::Success);
    let mut fx = Fx { a, b, qa, qb, buf, buf_key, pool, pool_key, mw };
    f(&mut fx);
}

fn write(fx: &Fx<'_, '_>, off: u64, len: u32, rkey: u32) -> Wqe {
    Wqe::write(fx.buf, fx.buf_key, len, fx.pool + off, rkey).with_wr_id(7)
}

#[test]
fn capabilities_claim_what_each_mode_implements() {
    let strict: Nic<'_> = TestNic::new(Mode::Strict);
    let rxe: Nic<'_> = TestNic::new(Mode::Rxe);
    let c = strict.capabilities();
    assert!(c.contains(Capabilities::SECURE_MINIMUM | Capabilities::ATOMICS | Capabilities::MW_BOUNDS_ENFORCED));
    assert!(
        !c.intersects(Capabilities::WAIT_ENABLE | Capabilities::SELF_MODIFYING_WQE | Capabilities::BIND_TO_OTHER_QP)
    );
    assert!(!c.contains(Capabilities::SEND_WITH_INV));
    let r = rxe.capabilities();
    assert!(!r.intersects(Capabilities::MW_BOUNDS_ENFORCED | Capabilities::MW_QP_CHECK_ON_INVALIDATE));
    assert_eq!(crate::device::ExecutionMode::choose(c, None, false), Ok(crate::device::ExecutionMode::HostEngine));
}

#[test]
fn a_window_works_through_its_bound_qp_only() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        fx.a.write_local(fx.buf, b"hello window").unwrap();
        fx.a.post_send(fx.qa, &write(fx, 8, 12, fx.mw.0)).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::Success);
        let mut got = [0u8; 12];
        fx.b.read_local(fx.pool + 8, &mut got).unwrap();
        assert_eq!(&got, b"hello window");
        // READ it back into another part of the buffer
        fx.a.post_send(fx.qa, &Wqe::read(fx.buf + 100, fx.buf_key, 12, fx.pool + 8, fx.mw.0)).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).byte_len, 12);
        fx.a.read_local(fx.buf + 100, &mut got).unwrap();
        assert_eq!(&got, b"hello window");

        // the same rkey through another QP pair between the same nodes: refused, both ends ERR
        let (qa2, qb2) = fx.a.connect_to(Domain::CnFacing, fx.b.id(), Domain::CnFacing).unwrap();
        fx.a.post_send(qa2, &write(fx, 8, 12, fx.mw.0)).unwrap();
        assert_eq!(one(&mut fx.a, qa2, QueueSel::Send).status, WcStatus::RemAccessErr);
        assert_eq!(fx.a.qp_state(qa2), Ok(QpState::Err));
        assert_eq!(fx.b.qp_state(qb2), Ok(QpState::Err));
        // the bound pair is unaffected
        assert_eq!(fx.a.qp_state(fx.qa), Ok(QpState::Rts));
        fx.a.post_send(fx.qa, &write(fx, 0, 4, fx.mw.0)).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::Success);
    });
}

#[test]
fn stale_keys_rights_and_bounds_are_checked() {
    for (mode, past_end) in [(Mode::Strict, WcStatus::RemAccessErr), (Mode::Rxe, WcStatus::Success)] {
        with_fx(mode, AccessFlags::REMOTE_READ, |fx| {
            let cases = [
                (write(fx, 0, 8, fx.mw.0), WcStatus::RemAccessErr), // no REMOTE_WRITE on the window
                (Wqe::read(fx.buf, fx.buf_key, 8, fx.pool, fx.mw.next_key().0), WcStatus::RemAccessErr),
                (Wqe::read(fx.buf, fx.buf_key, 8, fx.pool, fx.pool_key), WcStatus::RemAccessErr), // MR: no remote right
                (Wqe::read(fx.buf, fx.buf_key, 16, fx.pool + 250, fx.mw.0), past_end),            // §3 deviation (b)
                (Wqe::read(fx.buf, fx.buf_key, 8, fx.pool, 0), WcStatus::RemAccessErr),
            ];
            for (w, want) in cases {
                fx.a.post_send(fx.qa, &w).unwrap();
                assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, want, "{mode:?} {w:?}");
                if want != WcStatus::Success {
                    assert_eq!(fx.b.qp_state(fx.qb), Ok(QpState::Err));
                }
                fx.a.reset_qp(fx.qa).unwrap();
                assert_eq!(fx.b.qp_state(fx.qb), Ok(QpState::Rts), "reset brings the peer back");
            }
        });
    }
}

#[test]
fn local_sges_need_a_registration_with_the_right_key_and_rights() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        // a READ lands in memory: LOCAL_WRITE needed; a window key is no lkey; the pool key is B's
        let bad = [
            Wqe::read(fx.buf, fx.buf_key ^ 1, 8, fx.pool, fx.mw.0),
            Wqe::read(fx.buf, fx.mw.0, 8, fx.pool, fx.mw.0),
            Wqe::read(fx.buf, fx.pool_key, 8, fx.pool, fx.mw.0),
            Wqe::read(fx.buf + 4090, fx.buf_key, 8, fx.pool, fx.mw.0),
        ];
        for w in bad {
            fx.a.post_send(fx.qa, &w).unwrap();
            assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::LocProtErr, "{w:?}");
            assert_eq!(fx.a.qp_state(fx.qa), Ok(QpState::Err));
            assert_eq!(fx.b.qp_state(fx.qb), Ok(QpState::Rts), "a local error leaves the responder alone");
            fx.a.reset_qp(fx.qa).unwrap();
        }
    });
}

#[test]
fn bind_rules_come_from_mw_rules() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        let qb = fx.qb;
        // already bound
        let w = Wqe::bind_mw(fx.mw.next_key().0, fx.pool, 256, fx.pool_key, qb.get(), AccessFlags::DATA_WINDOW);
        fx.b.post_send(qb, &w).unwrap();
        assert_eq!(one(&mut fx.b, qb, QueueSel::Send).status, WcStatus::MwBindErr);
        // work posted in ERR is flushed at once
        fx.b.post_send(qb, &Wqe::nop().with_wr_id(9)).unwrap();
        let c = one(&mut fx.b, qb, QueueSel::Send);
        assert_eq!((c.status, c.wr_id), (WcStatus::WrFlushErr, 9));
        fx.b.reset_qp(qb).unwrap();
        let fresh = fx.b.alloc_mw().unwrap().next_key();
        let no_bind_mr = {
            let m = fx.b.alloc_memory(4096, 4096).unwrap();
            (m, fx.b.reg_mr(Domain::CnFacing, m, 4096, AccessFlags::LOCAL_WRITE).unwrap().lkey)
        };
        let (qa2, qb2) = fx.a.connect_to(Domain::CnFacing, fx.b.id(), Domain::CnFacing).unwrap();
        let _ = qa2;
        let cases = [
            Wqe::bind_mw(fresh.0, no_bind_mr.0, 256, no_bind_mr.1, qb.get(), AccessFlags::DATA_WINDOW),
            Wqe::bind_mw(fresh.0, fx.pool, 0, fx.pool_key, qb.get(), AccessFlags::DATA_WINDOW),
            Wqe::bind_mw(fresh.0, fx.pool + 8000, 256, fx.pool_key, qb.get(), AccessFlags::DATA_WINDOW),
            // to another QP: the device has no BIND_TO_OTHER_QP
            Wqe::bind_mw(fresh.0, fx.pool, 256, fx.pool_key, qb2.get(), AccessFlags::DATA_WINDOW),
            // an MR key as the window
            Wqe::bind_mw(fx.pool_key, fx.pool, 256, fx.pool_key, qb.get(), AccessFlags::DATA_WINDOW),
        ];
        for w in cases {
            fx.b.post_send(qb, &w).unwrap();
            assert_eq!(one(&mut fx.b, qb, QueueSel::Send).status, WcStatus::MwBindErr, "{w:?}");
            fx.b.reset_qp(qb).unwrap();
        }
        assert_eq!(fx.b.mw_binding(fresh), Some(MwBinding::Unbound));
        let ok = Wqe::bind_mw(fresh.0, fx.pool + 4096, 4096, fx.pool_key, qb2.get(), AccessFlags::DATA_WINDOW);
        fx.b.post_send(qb2, &ok).unwrap();
        assert_eq!(one(&mut fx.b, qb2, QueueSel::Send).status, WcStatus::Success);
        assert_eq!(fx.b.mw_binding(fresh), Some(MwBinding::Bound { rkey: fresh, qpn: qb2 }));
        assert_eq!(fx.b.mw_span(fresh), Some((fx.pool + 4096, 4096)));
        assert_eq!(fx.b.mw_span(fresh.next_key()), None, "span only for the current key");
        // node A has no window with that index
        assert_eq!(fx.a.mw_binding(fresh), None);
    });
}

#[test]
fn local_inv_needs_the_bound_qp_in_strict_mode_only() {
    for mode in [Mode::Strict, Mode::Rxe] {
        with_fx(mode, AccessFlags::DATA_WINDOW, |fx| {
            let (_qa2, qb2) = fx.a.connect_to(Domain::CnFacing, fx.b.id(), Domain::CnFacing).unwrap();
            fx.b.post_send(qb2, &Wqe::local_inv(fx.mw.0)).unwrap();
            let st = one(&mut fx.b, qb2, QueueSel::Send).status;
            match mode {
                Mode::Strict => {
                    assert_eq!(st, WcStatus::MwBindErr);
                    assert!(matches!(fx.b.mw_binding(fx.mw), Some(MwBinding::Bound { .. })));
                    fx.b.post_send(fx.qb, &Wqe::local_inv(fx.mw.0)).unwrap();
                    assert_eq!(one(&mut fx.b, fx.qb, QueueSel::Send).status, WcStatus::Success);
                }
                Mode::Rxe => assert_eq!(st, WcStatus::Success, "§3 deviation (a)"),
            }
            assert_eq!(fx.b.mw_binding(fx.mw), Some(MwBinding::Unbound));
            // a second invalidation of the same key is refused
            fx.b.post_send(fx.qb, &Wqe::local_inv(fx.mw.0)).unwrap();
            assert!(!one(&mut fx.b, fx.qb, QueueSel::Send).status.is_ok());
            fx.b.reset_qp(fx.qb).unwrap();
            fx.a.post_send(fx.qa, &write(fx, 0, 8, fx.mw.0)).unwrap();
            assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::RemAccessErr);
        });
    }
}

#[test]
fn the_management_unbind_needs_the_windows_pd_and_an_exact_key() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        let private = fx.b.create_loopback_qp(Domain::MnPrivate, None).unwrap();
        let admin = fx.b.create_loopback_qp(Domain::CnFacing, None).unwrap();
        for (qp, key, want) in [
            (private, fx.mw.0, WcStatus::MwBindErr),
            (admin, fx.mw.next_key().0, WcStatus::MwBindErr),
            (admin, fx.mw.0, WcStatus::Success),
        ] {
            fx.b.post_send(qp, &Wqe::unbind_mw(key)).unwrap();
            assert_eq!(one(&mut fx.b, qp, QueueSel::Send).status, want);
            fx.b.reset_qp(qp).unwrap();
        }
        assert_eq!(fx.b.mw_binding(fx.mw), Some(MwBinding::Unbound));
    });
}

#[test]
fn atomics_need_atomic_rights_and_alignment() {
    with_fx(Mode::Strict, DATA_ATOMIC, |fx| {
        fx.b.write_local(fx.pool + 16, &40u64.to_le_bytes()).unwrap();
        fx.a.post_send(fx.qa, &Wqe::fetch_add(fx.buf, fx.buf_key, fx.pool + 16, fx.mw.0, 2)).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::Success);
        let mut v = [0u8; 8];
        fx.a.read_local(fx.buf, &mut v).unwrap();
        assert_eq!(u64::from_le_bytes(v), 40);
        fx.a.post_send(fx.qa, &Wqe::compare_swap(fx.buf, fx.buf_key, fx.pool + 16, fx.mw.0, 42, 7)).unwrap();
        fx.a.post_send(fx.qa, &Wqe::compare_swap(fx.buf, fx.buf_key, fx.pool + 16, fx.mw.0, 42, 9)).unwrap();
        assert_eq!(comps(&mut fx.a, fx.qa, QueueSel::Send).len(), 2);
        fx.b.read_local(fx.pool + 16, &mut v).unwrap();
        assert_eq!(u64::from_le_bytes(v), 7, "second CAS compared 42 with 7 and did nothing");
        fx.a.post_send(fx.qa, &Wqe::masked_fetch_add(fx.buf, fx.buf_key, fx.pool + 16, fx.mw.0, 1, 1 << 2)).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::Success);
        fx.b.read_local(fx.pool + 16, &mut v).unwrap();
        assert_eq!(u64::from_le_bytes(v), 0, "7 + 1 wraps in the 3-bit field");
        // misaligned: an invalid-request NAK
        fx.a.post_send(fx.qa, &Wqe::fetch_add(fx.buf, fx.buf_key, fx.pool + 4, fx.mw.0, 1)).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::RemInvReqErr);
        fx.a.reset_qp(fx.qa).unwrap();
        let mut w = Wqe::fetch_add(fx.buf, fx.buf_key, fx.pool, fx.mw.0, 1);
        w.length = 4;
        fx.a.post_send(fx.qa, &w).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::LocLenErr);
    });
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        fx.a.post_send(fx.qa, &Wqe::fetch_add(fx.buf, fx.buf_key, fx.pool, fx.mw.0, 1)).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::RemAccessErr);
    });
    with_fx(Mode::Rxe, DATA_ATOMIC, |fx| {
        let w = Wqe::masked_fetch_add(fx.buf, fx.buf_key, fx.pool, fx.mw.0, 1, 0);
        assert!(matches!(fx.a.post_send(fx.qa, &w), Err(NicError::Unsupported(_))));
    });
}

#[test]
fn sends_wait_for_a_receive_and_scatter_in_order() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        let (qa, qb) = (fx.qa, fx.qb);
        fx.a.write_local(fx.buf, b"0123456789").unwrap();
        fx.a.post_send(qa, &Wqe::send(fx.buf, fx.buf_key, 10).with_wr_id(1)).unwrap();
        // RC keeps order: the READ behind the blocked SEND waits too
        fx.a.post_send(qa, &Wqe::read(fx.buf + 64, fx.buf_key, 4, fx.pool, fx.mw.0).with_wr_id(2)).unwrap();
        assert_eq!(fx.a.outstanding(qa, QueueSel::Send), Some(2));
        assert!(comps(&mut fx.a, qa, QueueSel::Send).is_empty());
        // B receives into two scatter entries of its pool (registered LOCAL_WRITE)
        let mut r = RecvWqe { wr_id: 5, sges: heapless::Vec::new() };
        r.sges.push(Sge { addr: fx.pool + 1000, length: 4, lkey: fx.pool_key }).unwrap();
        r.sges.push(Sge { addr: fx.pool + 2000, length: 16, lkey: fx.pool_key }).unwrap();
        fx.b.post_recv(qb, &r).unwrap();
        let c = comps(&mut fx.a, qa, QueueSel::Send);
        assert_eq!(c.iter().map(|c| c.wr_id).collect::<StdVec<_>>(), [1, 2]);
        assert_eq!(fx.a.outstanding(qa, QueueSel::Send), Some(0));
        let rc = one(&mut fx.b, qb, QueueSel::Recv);
        assert_eq!((rc.wr_id, rc.byte_len, rc.opcode, rc.imm), (5, 10, WcOpcode::Recv, None));
        let mut got = [0u8; 6];
        fx.b.read_local(fx.pool + 2000, &mut got).unwrap();
        assert_eq!(&got, b"456789");
        fx.b.read_local(fx.pool + 1000, &mut got[..4]).unwrap();
        assert_eq!(&got[..4], b"0123");

        // WRITE_WITH_IMM consumes a receive and carries the immediate
        let mut r = RecvWqe { wr_id: 6, sges: heapless::Vec::new() };
        r.sges.push(Sge { addr: fx.pool + 3000, length: 4, lkey: fx.pool_key }).unwrap();
        fx.b.post_recv(qb, &r).unwrap();
        assert_eq!(fx.b.outstanding(qb, QueueSel::Recv), Some(1));
        fx.a.post_send(qa, &Wqe::write_imm(fx.buf, fx.buf_key, 8, fx.pool + 32, fx.mw.0, 0xBEEF)).unwrap();
        let rc = one(&mut fx.b, qb, QueueSel::Recv);
        assert_eq!((rc.wr_id, rc.opcode, rc.imm, rc.byte_len), (6, WcOpcode::RecvRdmaWithImm, Some(0xBEEF), 8));
        fx.b.read_local(fx.pool + 32, &mut got).unwrap();
        assert_eq!(&got, b"012345");
        assert_eq!(one(&mut fx.a, qa, QueueSel::Send).status, WcStatus::Success);

        // longer than the receive: receiver LOC_LEN_ERR, requester REM_INV_REQ_ERR, both ERR
        fx.b.post_recv(qb, &r).unwrap();
        fx.b.post_recv(qb, &RecvWqe { wr_id: 8, sges: heapless::Vec::new() }).unwrap();
        fx.a.post_send(qa, &Wqe::send(fx.buf, fx.buf_key, 10)).unwrap();
        assert_eq!(one(&mut fx.a, qa, QueueSel::Send).status, WcStatus::RemInvReqErr);
        let rc = comps(&mut fx.b, qb, QueueSel::Recv);
        assert_eq!(
            rc.iter().map(|c| (c.wr_id, c.status)).collect::<StdVec<_>>(),
            [(6, WcStatus::LocLenErr), (8, WcStatus::WrFlushErr)]
        );
        assert_eq!(fx.b.qp_state(qb), Ok(QpState::Err));
        // a receive posted in ERR is flushed at once
        fx.b.post_recv(qb, &r).unwrap();
        assert_eq!(one(&mut fx.b, qb, QueueSel::Recv).status, WcStatus::WrFlushErr);
    });
}

#[test]
fn a_receive_into_memory_it_may_not_write_is_a_remote_operation_error() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        let mut r = RecvWqe { wr_id: 1, sges: heapless::Vec::new() };
        r.sges.push(Sge { addr: fx.pool, length: 64, lkey: fx.mw.0 }).unwrap();
        fx.b.post_recv(fx.qb, &r).unwrap();
        fx.a.post_send(fx.qa, &Wqe::send(fx.buf, fx.buf_key, 8)).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::RemOpErr);
        assert_eq!(one(&mut fx.b, fx.qb, QueueSel::Recv).status, WcStatus::LocProtErr);
        let mut z = [1u8; 8];
        fx.b.read_local(fx.pool, &mut z).unwrap();
        assert_eq!(z, [0; 8], "nothing was written");
    });
}

#[test]
fn unsignaled_success_is_silent_errors_are_not() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        let quiet = |w: Wqe| w.with_flags(WqeFlags::empty());
        fx.a.post_send(fx.qa, &quiet(write(fx, 0, 8, fx.mw.0))).unwrap();
        assert!(comps(&mut fx.a, fx.qa, QueueSel::Send).is_empty());
        fx.a.post_send(fx.qa, &quiet(write(fx, 0, 8, fx.mw.next_key().0))).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::RemAccessErr);
    });
}

#[test]
fn destroy_and_reset() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        let r = RecvWqe { wr_id: 3, sges: heapless::Vec::new() };
        fx.b.post_recv(fx.qb, &r).unwrap();
        fx.a.post_send(fx.qa, &Wqe::send(fx.buf, fx.buf_key, 0)).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::Success);
        // the remote peer keeps its completion across the other end's reset
        fx.a.reset_qp(fx.qa).unwrap();
        assert_eq!(one(&mut fx.b, fx.qb, QueueSel::Recv).wr_id, 3);
        fx.b.post_recv(fx.qb, &r).unwrap();
        fx.b.destroy_qp(fx.qb).unwrap();
        assert_eq!(fx.b.qp_state(fx.qb), Err(NicError::NoSuchQp(fx.qb)));
        assert_eq!(fx.a.qp_state(fx.qa), Ok(QpState::Err), "the peer saw the connection fail");
        fx.a.reset_qp(fx.qa).unwrap();
        fx.a.post_send(fx.qa, &Wqe::send(fx.buf, fx.buf_key, 4)).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::RetryExcErr);
        // the window bound to the destroyed QP is still bound (and unusable)
        assert!(matches!(fx.b.mw_binding(fx.mw), Some(MwBinding::Bound { .. })));
    });
}

#[test]
fn a_send_waiting_for_a_receive_fails_when_the_peer_does() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        fx.a.post_send(fx.qa, &Wqe::send(fx.buf, fx.buf_key, 4).with_wr_id(1)).unwrap();
        fx.a.post_send(fx.qa, &Wqe::nop().with_wr_id(2)).unwrap();
        assert!(comps(&mut fx.a, fx.qa, QueueSel::Send).is_empty());
        // the responder's QP fails on its own (a bad bind)
        fx.b.post_send(fx.qb, &Wqe::bind_mw(fx.mw.0, fx.pool, 8, fx.pool_key, fx.qb.get(), AccessFlags::DATA_WINDOW))
            .unwrap();
        assert_eq!(one(&mut fx.b, fx.qb, QueueSel::Send).status, WcStatus::MwBindErr);
        let c = comps(&mut fx.a, fx.qa, QueueSel::Send);
        assert_eq!(
            c.iter().map(|c| (c.wr_id, c.status)).collect::<StdVec<_>>(),
            [(1, WcStatus::RetryExcErr), (2, WcStatus::WrFlushErr)]
        );
    });
}

#[test]
fn private_loopback_memory_is_out_of_reach_of_cn_facing_qps() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        let lq = fx.b.create_loopback_qp(Domain::MnPrivate, None).unwrap();
        let meta = fx.b.alloc_memory(64, 8).unwrap();
        let priv_rights = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC | AccessFlags::REMOTE_READ;
        let k = fx.b.reg_mr(Domain::MnPrivate, meta, 64, priv_rights).unwrap();
        fx.b.post_send(lq, &Wqe::fetch_add(meta + 8, k.lkey, meta, k.rkey, 5)).unwrap();
        assert_eq!(one(&mut fx.b, lq, QueueSel::Send).status, WcStatus::Success);
        let mut v = [0u8; 8];
        fx.b.read_local(meta, &mut v).unwrap();
        assert_eq!(u64::from_le_bytes(v), 5);
        // the same key from a CN: the arriving QP's PD differs
        fx.a.post_send(fx.qa, &Wqe::read(fx.buf, fx.buf_key, 8, meta, k.rkey)).unwrap();
        assert_eq!(one(&mut fx.a, fx.qa, QueueSel::Send).status, WcStatus::RemAccessErr);
        assert_eq!(
            fx.b.create_loopback_qp(Domain::MnPrivate, Some(16)),
            Err(NicError::Unsupported("managed send queues (WAIT/ENABLE)"))
        );
    });
}

#[test]
fn bad_calls_are_typed_errors() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        assert_eq!(fx.a.post_send(fx.qb, &Wqe::nop()), Err(NicError::NoSuchQp(fx.qb)), "B's QP, not A's");
        assert_eq!(fx.a.post_send(Qpn::new(5).unwrap(), &Wqe::nop()), Err(NicError::NoSuchQp(Qpn::new(5).unwrap())));
        assert!(matches!(fx.a.alloc_memory(1, 3), Err(NicError::BadAlign(3))));
        assert!(matches!(fx.a.alloc_memory(1 << 40, 8), Err(NicError::OutOfMemory { .. })));
        assert!(matches!(fx.a.read_local(fx.pool, &mut [0u8; 4]), Err(NicError::OutOfRange { .. })), "B's address");
        assert!(matches!(fx.a.write_local(u64::MAX - 2, &[0u8; 4]), Err(NicError::OutOfRange { .. })));
        assert!(matches!(
            fx.a.reg_mr(Domain::CnFacing, fx.buf, 16, AccessFlags::REMOTE_WRITE),
            Err(NicError::BadAccess(_))
        ));
        assert!(matches!(
            fx.a.reg_mr(Domain::CnFacing, fx.buf, 1 << 20, AccessFlags::LOCAL_WRITE),
            Err(NicError::OutOfRange { .. })
        ));
        assert!(matches!(fx.a.post_send(fx.qa, &Wqe::wait(1, QueueSel::Send, 1)), Err(NicError::Unsupported(_))));
        assert!(matches!(
            fx.a.post_send(fx.qa, &Wqe::send_with_inv(fx.buf, fx.buf_key, 4, 1)),
            Err(NicError::Unsupported(_))
        ));
        assert!(matches!(fx.a.enable(fx.qa, QueueSel::Send, 1), Err(NicError::Unsupported(_))));
        assert!(fx.a.ring_base(fx.qa, QueueSel::Send).is_err() && fx.a.ring_keys(Domain::MnPrivate).is_err());
        // the send queue fills (the peer posts no receive), then refuses
        let mut posted = 0;
        while fx.a.post_send(fx.qa, &Wqe::send(fx.buf, fx.buf_key, 1)).is_ok() {
            posted += 1;
        }
        assert_eq!(posted, SQ_DEPTH);
        assert_eq!(fx.a.post_send(fx.qa, &Wqe::nop()), Err(NicError::QueueFull { qp: fx.qa, queue: QueueSel::Send }));
        // the key table fills
        let mut n = 0;
        while fx.b.alloc_mw().is_ok() {
            n += 1;
        }
        assert!(n > 0);
        assert_eq!(fx.b.alloc_mw(), Err(NicError::TooManyKeys));
        // every error displays
        let e = std::format!("{}", NicError::QueueFull { qp: fx.qa, queue: QueueSel::Send });
        assert!(e.contains("full"));
    });
}

#[derive(Debug, Clone)]
struct RawPost {
    from_b: bool,
    qp: u8,
    op: u8,
    flags: u8,
    imm_sel: u8,
    addr_off: u16,
    len: u16,
    key_sel: u8,
    recv: bool,
    operand: u64,
}

fn raw_post() -> impl Strategy<Value = RawPost> {
    (
        any::<bool>(),
        0u8..6,
        0u8..14,
        any::<u8>(),
        any::<u8>(),
        any::<u16>(),
        any::<u16>(),
        any::<u8>(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(from_b, qp, op, flags, imm_sel, addr_off, len, key_sel, recv, operand)| RawPost {
            from_b,
            qp,
            op,
            flags,
            imm_sel,
            addr_off,
            len,
            key_sel,
            recv,
            operand,
        })
}

proptest! {
    /// Hostile WQEs — any opcode, address, key, length, QP — never panic and never make the
    /// fabric lose a completion: every post is accepted (and completes or waits) or refused
    /// with a typed error, and the window's memory outside what a legal access names is intact.
    #[test]
    fn any_wqe_ends_in_a_status_or_a_typed_error(posts in proptest::collection::vec(raw_post(), 1..40)) {
        with_fx(Mode::Strict, DATA_ATOMIC, |fx| {
            let (qa2, qb2) = fx.a.connect_to(Domain::CnFacing, fx.b.id(), Domain::CnFacing).unwrap();
            let qps = [fx.qa, fx.qb, qa2, qb2, Qpn::new(0x1FF).unwrap(), Qpn::ZERO];
            let keys = [fx.buf_key, fx.pool_key, fx.mw.0, fx.mw.next_key().0, 0, u32::MAX];
            let addrs = [fx.buf, fx.pool, 0, u64::MAX - 8];
            for p in posts {
                let v = if p.from_b { &mut fx.b } else { &mut fx.a };
                let qp = qps[p.qp as usize];
                let key = keys[p.key_sel as usize % keys.len()];
                let addr = addrs[(p.key_sel >> 4) as usize % addrs.len()].wrapping_add(p.addr_off as u64);
                let r = if p.recv {
                    let mut r = RecvWqe { wr_id: 1, sges: heapless::Vec::new() };
                    let _ = r.sges.push(Sge { addr, length: p.len as u32, lkey: key });
                    v.post_recv(qp, &r)
                } else {
                    let mut w = Wqe::blank(Opcode::from_u8(p.op).unwrap());
                    w.flags = WqeFlags::from_bits_truncate(p.flags);
                    w.imm = keys[p.imm_sel as usize % keys.len()];
                    w.local_addr = addr;
                    w.length = p.len as u32;
                    w.lkey = key;
                    w.remote_addr = addrs[p.imm_sel as usize % addrs.len()].wrapping_add(p.addr_off as u64);
                    w.rkey = keys[(p.imm_sel >> 3) as usize % keys.len()];
                    w.qpn = qps[(p.imm_sel >> 5) as usize % qps.len()].get();
                    w.operand0 = p.operand;
                    w.operand1 = p.operand.rotate_left(7);
                    v.post_send(qp, &w)
                };
                if let Err(e) = r {
                    let _ = std::format!("{e}");
                }
                for q in qps {
                    for sel in [QueueSel::Send, QueueSel::Recv] {
                        let mut out = [Completion::EMPTY; 4];
                        let _ = v.poll_cq(q, sel, &mut out);
                        let _ = v.outstanding(q, sel);
                    }
                    let _ = v.qp_state(q);
                    if p.operand % 7 == 0 {
                        let _ = v.reset_qp(q);
                    }
                }
            }
        });
    }
}

/// A completion queue nobody polls is never overrun: posts are refused with a typed error
/// once the queue and its completions would exceed it, and every completion is still there.
#[test]
fn an_unpolled_completion_queue_refuses_posts_instead_of_losing_completions() {
    with_fx(Mode::Strict, AccessFlags::DATA_WINDOW, |fx| {
        // signaled NOPs complete at once: only the send CQ fills
        let bound = 2 * CQ_DEPTH as u64;
        let posted =
            (0..bound).take_while(|i| fx.a.post_send(fx.qa, &Wqe::nop().with_wr_id(*i)).is_ok()).count() as u64;
        assert_eq!(posted, CQ_DEPTH as u64);
        assert_eq!(fx.a.post_send(fx.qa, &Wqe::nop()), Err(NicError::QueueFull { qp: fx.qa, queue: QueueSel::Send }));
        let done = comps(&mut fx.a, fx.qa, QueueSel::Send);
        assert_eq!(done.iter().map(|c| c.wr_id).collect::<StdVec<_>>(), (0..posted).collect::<StdVec<_>>());
        // the receive side: B's receives consumed by A's sends fill B's receive CQ
        let slot = fx.b.alloc_memory(64, 64).unwrap();
        let key = fx.b.reg_mr(Domain::CnFacing, slot, 64, AccessFlags::LOCAL_WRITE).unwrap().lkey;
        let recv = |i: u64| RecvWqe::single(i, Sge { addr: slot, length: 64, lkey: key });
        let mut received = 0u64;
        while received < bound && fx.b.post_recv(fx.qb, &recv(received)).is_ok() {
            fx.a.post_send(fx.qa, &Wqe::send(fx.buf, fx.buf_key, 8).with_wr_id(received)).unwrap();
            received += 1;
            comps(&mut fx.a, fx.qa, QueueSel::Send);
        }
        assert_eq!(received, CQ_DEPTH as u64);
        assert_eq!(
            fx.b.post_recv(fx.qb, &recv(received)),
            Err(NicError::QueueFull { qp: fx.qb, queue: QueueSel::Recv })
        );
        let done = comps(&mut fx.b, fx.qb, QueueSel::Recv);
        assert_eq!(done.len(), CQ_DEPTH);
        assert!(done.iter().all(|c| c.status == WcStatus::Success));
    });
}
