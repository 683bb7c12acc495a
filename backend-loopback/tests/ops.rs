//! Every data operation with real semantics: READ/WRITE, atomics, SEND/RECV scatter, RNR,
//! local protection errors, error states and flushes, QP reset.

mod common;
use common::*;
use omw_core::access::AccessFlags;
use omw_core::device::{QpState, WcOpcode, WcStatus};
use omw_core::wire::wqe::{masked_add, Opcode, QueueSel, Wqe, WqeFlags, RECV_WQE_SIZE, WQE_SIZE};
use omw_loopback::{NicConfig, PdId, QpConfig, StepKind};

#[test]
fn write_then_read_back() {
    let mut e = env(NicConfig::strict());
    e.f.write(e.cn, e.buf, b"0123456789abcdef").unwrap();
    e.f.post_send(e.c, &Wqe::write(e.buf, e.buf_k.lkey, 16, e.pool + 100, e.pool_k.rkey).with_wr_id(1)).unwrap();
    e.f.post_send(e.c, &Wqe::read(e.buf + 64, e.buf_k.lkey, 16, e.pool + 100, e.pool_k.rkey).with_wr_id(2)).unwrap();
    let v = drain(&mut e.f, e.c, QueueSel::Send);
    assert_eq!(statuses(&v), vec![WcStatus::Success; 2]);
    assert_eq!((v[0].wr_id, v[0].opcode, v[0].byte_len), (1, WcOpcode::Send(Opcode::Write), 16));
    assert_eq!((v[1].wr_id, v[1].opcode), (2, WcOpcode::Send(Opcode::Read)));
    assert_eq!(v[0].qpn, e.c.qpn);
    assert_eq!(read_bytes(&e.f, e.mn, e.pool + 100, 16), b"0123456789abcdef");
    assert_eq!(read_bytes(&e.f, e.cn, e.buf + 64, 16), b"0123456789abcdef");
    assert_eq!(e.f.counters().wqes_executed, 2);
    assert_eq!(e.f.qp_state(e.m).unwrap(), QpState::Rts);
}

#[test]
fn atomics_on_little_endian_words() {
    let mut e = env(NicConfig::strict());
    let word = e.pool + 8;
    e.f.write_u64(e.mn, word, 40).unwrap();
    let (l, lk, r, rk) = (e.buf, e.buf_k.lkey, word, e.pool_k.rkey);
    e.f.post_send(e.c, &Wqe::fetch_add(l, lk, r, rk, 2)).unwrap();
    drain(&mut e.f, e.c, QueueSel::Send);
    assert_eq!(e.f.read_u64(e.mn, word).unwrap(), 42);
    assert_eq!(e.f.read_u64(e.cn, l).unwrap(), 40, "old value, little-endian, in the local SGE");

    // masked: a 6-bit ring index wraps without carrying into the base above it
    let base = 0x4000u64;
    e.f.write_u64(e.mn, word, base + 56).unwrap();
    e.f.post_send(e.c, &Wqe::masked_fetch_add(l, lk, r, rk, 8, 1 << 5)).unwrap();
    drain(&mut e.f, e.c, QueueSel::Send);
    assert_eq!(e.f.read_u64(e.mn, word).unwrap(), masked_add(base + 56, 8, 1 << 5));
    assert_eq!(e.f.read_u64(e.mn, word).unwrap(), base);
    assert_eq!(e.f.read_u64(e.cn, l).unwrap(), base + 56);

    // compare-and-swap: hit, then miss
    e.f.post_send(e.c, &Wqe::compare_swap(l, lk, r, rk, base, 7)).unwrap();
    e.f.post_send(e.c, &Wqe::compare_swap(l + 8, lk, r, rk, base, 9)).unwrap();
    let v = drain(&mut e.f, e.c, QueueSel::Send);
    assert_eq!(statuses(&v), vec![WcStatus::Success; 2]);
    assert_eq!(e.f.read_u64(e.mn, word).unwrap(), 7);
    assert_eq!(e.f.read_u64(e.cn, l).unwrap(), base);
    assert_eq!(e.f.read_u64(e.cn, l + 8).unwrap(), 7, "a failed CAS returns the current value");
}

#[test]
fn unaligned_atomic_is_a_local_error() {
    let mut e = env(NicConfig::strict());
    let mut w = Wqe::fetch_add(e.buf, e.buf_k.lkey, e.pool + 4, e.pool_k.rkey, 1);
    w.remote_addr = e.pool + 4;
    e.f.post_send(e.c, &w).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::LocQpOpErr, "the canonical decoder refuses it");
    assert_eq!(e.f.qp_state(e.c).unwrap(), QpState::Err);
    assert_eq!(e.f.qp_state(e.m).unwrap(), QpState::Rts, "a local error does not touch the peer");
}

#[test]
fn send_scatters_across_sges_in_order() {
    let mut e = env(NicConfig::strict());
    let p = e.pool;
    let k = e.pool_k.lkey;
    e.f.post_recv(e.m, &recv(77, &[(p, 4, k), (p + 100, 8, k), (p + 200, 16, k)])).unwrap();
    e.f.write(e.cn, e.buf, b"AAAABBBBBBBBCC").unwrap();
    e.f.post_send(e.c, &Wqe::send(e.buf, e.buf_k.lkey, 14)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::Success);
    let r = drain(&mut e.f, e.m, QueueSel::Recv);
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].wr_id, r[0].status, r[0].opcode, r[0].byte_len), (77, WcStatus::Success, WcOpcode::Recv, 14));
    assert_eq!(r[0].imm, None);
    assert_eq!(read_bytes(&e.f, e.mn, p, 4), b"AAAA");
    assert_eq!(read_bytes(&e.f, e.mn, p + 100, 8), b"BBBBBBBB");
    assert_eq!(read_bytes(&e.f, e.mn, p + 200, 3), b"CC\0");
}

#[test]
fn send_with_imm_and_write_with_imm_carry_the_immediate() {
    let mut e = env(NicConfig::strict());
    let (p, k) = (e.pool, e.pool_k.lkey);
    e.f.post_recv(e.m, &recv(1, &[(p, 64, k)])).unwrap();
    e.f.post_recv(e.m, &recv(2, &[])).unwrap();
    let mut s = Wqe::send(e.buf, e.buf_k.lkey, 4);
    s.opcode = Opcode::SendWithImm;
    s.imm = 0xABCD;
    e.f.post_send(e.c, &s).unwrap();
    e.f.post_send(e.c, &Wqe::write_imm(e.buf, e.buf_k.lkey, 8, p + 512, e.pool_k.rkey, 0x1234)).unwrap();
    let r = drain(&mut e.f, e.m, QueueSel::Recv);
    assert_eq!(r.len(), 2);
    assert_eq!((r[0].wr_id, r[0].imm, r[0].opcode), (1, Some(0xABCD), WcOpcode::Recv));
    assert_eq!((r[1].wr_id, r[1].imm, r[1].opcode, r[1].byte_len), (2, Some(0x1234), WcOpcode::RecvRdmaWithImm, 8));
}

#[test]
fn send_longer_than_the_receive_is_a_length_error_on_both_sides() {
    let mut e = env(NicConfig::strict());
    e.f.post_recv(e.m, &recv(5, &[(e.pool, 4, e.pool_k.lkey)])).unwrap();
    e.f.post_recv(e.m, &recv(6, &[(e.pool, 4, e.pool_k.lkey)])).unwrap();
    e.f.post_send(e.c, &Wqe::send(e.buf, e.buf_k.lkey, 5)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::RemInvReqErr);
    let r = drain(&mut e.f, e.m, QueueSel::Recv);
    assert_eq!(statuses(&r), vec![WcStatus::LocLenErr, WcStatus::WrFlushErr]);
    assert_eq!(r[1].wr_id, 6, "the other posted receive flushes");
    assert_eq!(e.f.qp_state(e.c).unwrap(), QpState::Err);
    assert_eq!(e.f.qp_state(e.m).unwrap(), QpState::Err);
}

#[test]
fn receive_sge_needs_local_write_in_the_receivers_pd() {
    let mut e = env(NicConfig::strict());
    let (ro, ro_k) = e.f.alloc_mr(e.mn, PdId(0), 64, 8, AccessFlags::REMOTE_READ).unwrap();
    e.f.post_recv(e.m, &recv(5, &[(ro, 64, ro_k.lkey)])).unwrap();
    e.f.post_send(e.c, &Wqe::send(e.buf, e.buf_k.lkey, 8)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::RemOpErr);
    assert_eq!(statuses(&drain(&mut e.f, e.m, QueueSel::Recv)), vec![WcStatus::LocProtErr]);
}

#[test]
fn send_without_receive_waits_then_succeeds() {
    let mut e = env(NicConfig::strict());
    e.f.post_send(e.c, &Wqe::send(e.buf, e.buf_k.lkey, 8)).unwrap();
    let s = e.f.step().unwrap();
    assert_eq!(s.kind, StepKind::RnrWait);
    assert_eq!(e.f.run_until_idle(100), 0, "an RNR wait is a timer, not busy work");
    assert!(drain(&mut e.f, e.c, QueueSel::Send).is_empty());
    assert_eq!(e.f.counters().rnr_naks, 1);
    e.f.post_recv(e.m, &recv(9, &[(e.pool, 8, e.pool_k.lkey)])).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::Success);
    assert_eq!(drain(&mut e.f, e.m, QueueSel::Recv)[0].wr_id, 9);
}

#[test]
fn send_without_receive_fails_after_the_rnr_budget() {
    let mut e = env(NicConfig::strict());
    e.f.post_send(e.c, &Wqe::send(e.buf, e.buf_k.lkey, 8)).unwrap();
    e.f.post_send(e.c, &Wqe::nop()).unwrap();
    e.f.run_until_idle(100);
    let t0 = e.f.now();
    e.f.settle(100);
    let v = drain(&mut e.f, e.c, QueueSel::Send);
    assert_eq!(statuses(&v), vec![WcStatus::RnrRetryExcErr, WcStatus::WrFlushErr]);
    assert!(e.f.now() >= t0 + e.f.config().cost.rnr_timeout_ns);
    assert_eq!(e.f.qp_state(e.c).unwrap(), QpState::Err);
    assert_eq!(e.f.qp_state(e.m).unwrap(), QpState::Rts, "the responder never saw it");
}

#[test]
fn local_sge_errors_are_local_protection_errors() {
    let mut e = env(NicConfig::strict());
    // bad lkey
    e.f.post_send(e.c, &Wqe::write(e.buf, e.buf_k.lkey ^ 1, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::LocProtErr);
    assert_eq!(e.f.qp_state(e.m).unwrap(), QpState::Rts);
    e.f.reset_qp(e.c).unwrap();
    // out of the MR
    e.f.post_send(e.c, &Wqe::write(e.buf + 4090, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::LocProtErr);
    e.f.reset_qp(e.c).unwrap();
    // READ into an MR without LOCAL_WRITE
    let (ro, ro_k) = e.f.alloc_mr(e.cn, PdId(0), 64, 8, AccessFlags::REMOTE_READ).unwrap();
    e.f.post_send(e.c, &Wqe::read(ro, ro_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::LocProtErr);
    e.f.reset_qp(e.c).unwrap();
    // an MR of another PD
    let pd1 = e.f.alloc_pd(e.cn).unwrap();
    let (o, o_k) = e.f.alloc_mr(e.cn, pd1, 64, 8, AccessFlags::LOCAL_WRITE).unwrap();
    e.f.post_send(e.c, &Wqe::write(o, o_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::LocProtErr);
}

#[test]
fn remote_mr_checks() {
    let mut e = env(NicConfig::strict());
    let (ro, ro_k) = e.f.alloc_mr(e.mn, PdId(0), 64, 8, AccessFlags::REMOTE_READ).unwrap();
    for w in [
        Wqe::write(e.buf, e.buf_k.lkey, 8, ro, ro_k.rkey), // no REMOTE_WRITE
        Wqe::read(e.buf, e.buf_k.lkey, 8, ro + 60, ro_k.rkey), // past the end
        Wqe::read(e.buf, e.buf_k.lkey, 8, ro, ro_k.rkey.wrapping_add(1)), // stale key
        Wqe::fetch_add(e.buf, e.buf_k.lkey, ro, ro_k.rkey, 1), // no REMOTE_ATOMIC
        Wqe::read(e.buf, e.buf_k.lkey, 8, 0, 0),           // address 0, key 0
    ] {
        e.f.post_send(e.c, &w).unwrap();
        assert_eq!(one(&mut e.f, e.c).status, WcStatus::RemAccessErr, "{w:?}");
        assert_eq!(e.f.qp_state(e.c).unwrap(), QpState::Err);
        assert_eq!(e.f.qp_state(e.m).unwrap(), QpState::Err, "both ends of the pair");
        e.f.reset_qp(e.c).unwrap();
        assert_eq!(e.f.qp_state(e.m).unwrap(), QpState::Rts, "reset brings the peer back too");
    }
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, ro, ro_k.rkey)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::Success);
}

#[test]
fn zero_length_rdma_skips_the_rkey_check() {
    let mut e = env(NicConfig::strict());
    e.f.post_send(e.c, &Wqe::write(0, 0, 0, 0, 0xdead_beef)).unwrap();
    e.f.post_send(e.c, &Wqe::read(0, 0, 0, 0, 0xdead_beef)).unwrap();
    assert_eq!(statuses(&drain(&mut e.f, e.c, QueueSel::Send)), vec![WcStatus::Success; 2]);
}

#[test]
fn unsignalled_success_is_silent_but_errors_and_flushes_always_complete() {
    let mut e = env(NicConfig::strict());
    let q = WqeFlags::empty();
    e.f.post_send(e.c, &Wqe::nop().with_flags(q)).unwrap();
    e.f.post_send(e.c, &Wqe::write(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey).with_flags(q)).unwrap();
    e.f.run_until_idle(100);
    assert_eq!(e.f.cq_count(e.c, QueueSel::Send).unwrap(), 0);
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, 0x100).with_flags(q).with_wr_id(1)).unwrap();
    e.f.post_send(e.c, &Wqe::nop().with_flags(q).with_wr_id(2)).unwrap();
    e.f.post_send(e.c, &Wqe::nop().with_wr_id(3)).unwrap();
    e.f.post_recv(e.c, &recv(4, &[])).unwrap();
    let v = drain(&mut e.f, e.c, QueueSel::Send);
    assert_eq!(statuses(&v), vec![WcStatus::RemAccessErr, WcStatus::WrFlushErr, WcStatus::WrFlushErr]);
    assert_eq!(v.iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert_eq!(v[1].opcode, WcOpcode::Send(Opcode::Nop));
    assert_eq!(statuses(&drain(&mut e.f, e.c, QueueSel::Recv)), vec![WcStatus::WrFlushErr]);
    // posting to an errored QP flushes as well
    e.f.post_send(e.c, &Wqe::nop().with_wr_id(5)).unwrap();
    e.f.post_recv(e.c, &recv(6, &[])).unwrap();
    assert_eq!(drain(&mut e.f, e.c, QueueSel::Send)[0].wr_id, 5);
    assert_eq!(drain(&mut e.f, e.c, QueueSel::Recv)[0].status, WcStatus::WrFlushErr);
    assert_eq!(e.f.counters().wqes_flushed, 3);
    assert_eq!(e.f.counters().completions(WcStatus::WrFlushErr), 5);
    assert_eq!(e.f.counters().completions(WcStatus::RemAccessErr), 1);
}

#[test]
fn malformed_bytes_complete_with_local_qp_op_error() {
    let mut e = env(NicConfig::strict());
    let mut b = [0u8; WQE_SIZE];
    b[0] = 0x7F;
    b[8] = 42; // wr_id
    e.f.post_send_raw(e.c, &b).unwrap();
    e.f.post_send(e.c, &Wqe::nop().with_wr_id(43)).unwrap();
    let v = drain(&mut e.f, e.c, QueueSel::Send);
    assert_eq!(statuses(&v), vec![WcStatus::LocQpOpErr, WcStatus::WrFlushErr]);
    assert_eq!((v[0].wr_id, v[1].wr_id), (42, 43));
    // a malformed receive: the receiver fails, the sender gets a remote operational error
    e.f.reset_qp(e.c).unwrap();
    e.f.post_recv_raw(e.m, &[0xFFu8; RECV_WQE_SIZE]).unwrap();
    e.f.post_send(e.c, &Wqe::send(e.buf, e.buf_k.lkey, 1)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::RemOpErr);
    assert_eq!(drain(&mut e.f, e.m, QueueSel::Recv)[0].status, WcStatus::LocQpOpErr);
}

#[test]
fn reset_gives_empty_rings_zero_counts_and_a_working_pair() {
    let mut e = env(NicConfig::strict());
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, 1)).unwrap();
    e.f.post_send(e.c, &Wqe::nop()).unwrap();
    e.f.run_until_idle(100);
    let had = e.f.qp_stats(e.c).unwrap().send_cq_queued;
    assert!(had > 0);
    e.f.reset_qp(e.m).unwrap();
    for q in [e.c, e.m] {
        assert_eq!(e.f.qp_state(q).unwrap(), QpState::Rts);
        let s = e.f.qp_stats(q).unwrap();
        assert_eq!((s.send_producer, s.send_consumer), (0, 0));
    }
    let s = e.f.qp_stats(e.m).unwrap();
    assert_eq!((s.send_cq_count, s.recv_cq_count, s.send_cq_queued, s.recv_cq_queued), (0, 0, 0, 0));
    // the peer on the other host reconnected; what its CQ had received stays until it polls
    let s = e.f.qp_stats(e.c).unwrap();
    assert_eq!((s.send_cq_queued, s.recv_cq_queued), (had, 0));
    drain(&mut e.f, e.c, QueueSel::Send);
    let base = e.f.ring_base(e.c, QueueSel::Send).unwrap();
    assert_eq!(read_bytes(&e.f, e.cn, base, 128), vec![0u8; 128], "ring bytes zeroed");
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::Success);
}

#[test]
fn destroyed_or_unconnected_peers() {
    let mut e = env(NicConfig::strict());
    e.f.destroy_qp(e.m).unwrap();
    assert!(e.f.qp_state(e.m).is_err());
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    let t0 = e.f.now();
    let c = one(&mut e.f, e.c);
    assert_eq!(c.status, WcStatus::RetryExcErr);
    assert!(e.f.now() >= t0 + e.f.config().cost.retry_timeout_ns);
    // a QP that was never connected does not run
    let lone = e.f.create_qp(e.cn, QpConfig::default()).unwrap();
    let lone = omw_loopback::QpAddr::new(e.cn, lone);
    e.f.post_send(lone, &Wqe::nop()).unwrap();
    assert_eq!(e.f.run_until_idle(10), 0);
    assert_eq!(e.f.qp_state(lone).unwrap(), QpState::Init);
}

#[test]
fn ring_full_and_control_errors() {
    let mut e = env(NicConfig::strict());
    let q = e.f.create_qp(e.cn, QpConfig::default().with_depths(2, 1)).unwrap();
    let q = omw_loopback::QpAddr::new(e.cn, q);
    e.f.post_send(q, &Wqe::nop()).unwrap();
    e.f.post_send(q, &Wqe::nop()).unwrap();
    assert!(matches!(e.f.post_send(q, &Wqe::nop()), Err(omw_loopback::LoopbackError::RingFull { .. })));
    e.f.post_recv(q, &recv(0, &[])).unwrap();
    assert!(e.f.post_recv(q, &recv(0, &[])).is_err());
    assert!(matches!(e.f.enable(q, QueueSel::Send, 1), Err(omw_loopback::LoopbackError::NotManaged { .. })));
    assert!(e.f.read(e.mn, 0, &mut [0u8; 1]).is_err());
    assert!(e.f.reg_mr(e.mn, PdId(0), 0x10, 8, AccessFlags::LOCAL_WRITE).is_err());
    assert!(e.f.reg_mr(e.mn, PdId(9), e.pool, 8, AccessFlags::LOCAL_WRITE).is_err());
    assert!(e.f.create_qp(e.mn, QpConfig::default().with_depths(0, 1)).is_err());
    let err = e.f.connect(e.c, e.m).unwrap_err();
    assert!(err.to_string().contains("state"), "{err}");
}
