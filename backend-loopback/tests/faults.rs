//! Fault injection: dropped, delayed and corrupted messages, crashed hosts, RNIC resets,
//! arbitrary bytes from a CN, middlewares.

mod common;
use common::*;
use omw_core::device::{QpState, WcStatus};
use omw_core::wire::wqe::{Opcode, QueueSel, Wqe};
use omw_loopback::{LoopbackError, MessageFilter, Middleware, NicConfig, PdId, Recorder, Verdict};

#[test]
fn dropped_message_is_a_retry_error_and_breaks_the_pair() {
    let mut e = env(NicConfig::strict());
    e.f.faults_mut().drop_next(MessageFilter::between(e.cn, e.mn).with_opcode(Opcode::Read), 1);
    e.f.post_send(e.c, &Wqe::write(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    e.f.post_send(e.c, &Wqe::nop()).unwrap();
    let v = drain(&mut e.f, e.c, QueueSel::Send);
    assert_eq!(statuses(&v), vec![WcStatus::Success, WcStatus::RetryExcErr, WcStatus::WrFlushErr]);
    assert_eq!(e.f.qp_state(e.c).unwrap(), QpState::Err);
    assert_eq!(e.f.qp_state(e.m).unwrap(), QpState::Err);
    assert!(e.f.faults().is_empty(), "the rule was used up");
    assert_eq!(e.f.counters().messages_dropped, 1);
    assert!(e.f.now() >= e.f.config().cost.retry_timeout_ns);
    e.f.reset_qp(e.c).unwrap();
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::Success, "only the next message was dropped");
}

#[test]
fn delayed_message_completes_later() {
    let run = |delay: Option<u64>| {
        let mut e = env(NicConfig::strict());
        if let Some(d) = delay {
            e.f.faults_mut().delay_next(MessageFilter::from_qp(e.c), d, 1);
        }
        e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
        e.f.settle(100);
        let v = e.f.poll_timed(e.c, QueueSel::Send).unwrap();
        assert_eq!(v[0].completion.status, WcStatus::Success);
        v[0].at
    };
    assert_eq!(run(Some(10_000)), run(None) + 10_000);
}

#[test]
fn corrupted_send_payload() {
    let mut e = env(NicConfig::strict().with_seed(7));
    e.f.faults_mut().corrupt_sends(e.c, 6);
    for i in 0..3u64 {
        e.f.post_recv(e.m, &recv(i, &[(e.pool + 64 * i, 64, e.pool_k.lkey)])).unwrap();
    }
    e.f.write(e.cn, e.buf, b"ABCDEFGH").unwrap();
    e.f.post_send(e.c, &Wqe::send(e.buf, e.buf_k.lkey, 4)).unwrap();
    e.f.post_send(e.c, &Wqe::send(e.buf, e.buf_k.lkey, 8)).unwrap();
    e.f.post_send(e.c, &Wqe::send(e.buf, e.buf_k.lkey, 8)).unwrap();
    assert_eq!(statuses(&drain(&mut e.f, e.c, QueueSel::Send)), vec![WcStatus::Success; 3]);
    let first = read_bytes(&e.f, e.mn, e.pool, 4);
    let second = read_bytes(&e.f, e.mn, e.pool + 64, 8);
    assert!(first.iter().zip(b"ABCD").all(|(a, b)| a != b), "all 4 bytes corrupted: {first:?}");
    assert!(second[..2].iter().zip(b"AB").all(|(a, b)| a != b), "the remaining 2 bytes budget");
    assert_eq!(&second[2..], b"CDEFGH");
    assert_eq!(read_bytes(&e.f, e.mn, e.pool + 128, 8), b"ABCDEFGH", "budget used up");
    assert_eq!(e.f.faults().corrupted_bytes, 6);
    assert_eq!(read_bytes(&e.f, e.cn, e.buf, 8), b"ABCDEFGH", "the sender's memory is untouched");
}

#[test]
fn crashed_cn() {
    let mut e = env(NicConfig::strict());
    e.f.crash_host(e.cn).unwrap();
    assert!(e.f.is_crashed(e.cn).unwrap());
    assert!(matches!(e.f.read(e.cn, e.buf, &mut [0u8; 1]), Err(LoopbackError::HostCrashed(_))));
    assert!(e.f.post_send(e.c, &Wqe::nop()).is_err());
    assert!(e.f.qps_of(e.cn).is_empty());
    // the MN's end sees its traffic fail
    e.f.post_recv(e.m, &recv(1, &[])).unwrap();
    e.f.post_send(e.m, &Wqe::send(e.pool, e.pool_k.lkey, 8)).unwrap();
    assert_eq!(one(&mut e.f, e.m).status, WcStatus::RetryExcErr);
    assert_eq!(e.f.qp_state(e.m).unwrap(), QpState::Err);
    assert_eq!(statuses(&drain(&mut e.f, e.m, QueueSel::Recv)), vec![WcStatus::WrFlushErr]);
    e.f.check_invariants().unwrap();
}

#[test]
fn crashed_mn() {
    let mut e = env(NicConfig::strict());
    e.f.crash_host(e.mn).unwrap();
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::RetryExcErr);
    assert!(e.f.alloc(e.mn, 8, 8).is_err());
    assert!(e.f.host_stats(e.mn).unwrap().crashed);
}

#[test]
fn rnic_reset_errors_every_qp_and_drops_bindings_but_keeps_memory() {
    let mut e = env(NicConfig::strict());
    let mw = e.f.alloc_mw(e.mn, PdId(0)).unwrap().next_key();
    let m = e.m;
    let bind = Wqe::bind_mw(mw.0, e.pool, 64, e.pool_k.lkey, m.qpn.get(), omw_core::access::AccessFlags::DATA_WINDOW);
    e.f.post_send(m, &bind).unwrap();
    assert_eq!(one(&mut e.f, m).status, WcStatus::Success);
    e.f.write(e.mn, e.pool, b"survives").unwrap();
    e.f.post_recv(m, &recv(3, &[])).unwrap();
    e.f.post_send(m, &Wqe::nop().with_wr_id(4)).unwrap(); // not yet run when the reset hits
    e.f.reset_rnic(e.mn).unwrap();
    assert_eq!(e.f.qp_state(m).unwrap(), QpState::Err);
    assert_eq!(e.f.qp_state(e.c).unwrap(), QpState::Rts, "the CN finds out when it talks");
    assert_eq!(drain(&mut e.f, m, QueueSel::Send)[0].status, WcStatus::WrFlushErr);
    assert_eq!(drain(&mut e.f, m, QueueSel::Recv)[0].wr_id, 3);
    assert!(!e.f.mw_is_bound(e.mn, mw));
    // the CN's next request to the errored MN QP: no answer
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::RetryExcErr);
    // after a reset of the pair, MRs and memory still work; the window does not
    e.f.reset_qp(m).unwrap();
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::Success);
    assert_eq!(read_bytes(&e.f, e.cn, e.buf, 8), b"survives");
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, e.pool, mw.0)).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::RemAccessErr);
}

#[test]
fn a_cn_may_post_any_bytes() {
    let mut e = env(NicConfig::strict());
    // a well-formed WQE built by hand, then every opcode byte the decoder does not know
    let mut b = Wqe::nop().with_wr_id(5).encode();
    e.f.post_send_raw(e.c, &b).unwrap();
    assert_eq!(one(&mut e.f, e.c).wr_id, 5);
    for op in [0x0Eu8, 0x80, 0xFF] {
        b[0] = op;
        e.f.post_send_raw(e.c, &b).unwrap();
        assert_eq!(one(&mut e.f, e.c).status, WcStatus::LocQpOpErr);
        e.f.reset_qp(e.c).unwrap();
    }
    // a BIND posted by a CN on its own QP cannot touch MN windows: windows are per host
    let mn_mw = e.f.alloc_mw(e.mn, PdId(0)).unwrap();
    let w = Wqe::bind_mw(
        mn_mw.next_key().0,
        e.buf,
        8,
        e.buf_k.lkey,
        e.c.qpn.get(),
        omw_core::access::AccessFlags::REMOTE_READ,
    );
    e.f.post_send_raw(e.c, &w.encode()).unwrap();
    assert_eq!(one(&mut e.f, e.c).status, WcStatus::MwBindErr);
    assert!(!e.f.mw_is_bound(e.mn, mn_mw.next_key()));
}

#[derive(Debug)]
struct DropEvery2nd(u32);
impl Middleware for DropEvery2nd {
    fn on_message(&mut self, _m: &omw_loopback::Message, _p: &mut [u8]) -> Verdict {
        self.0 += 1;
        if self.0.is_multiple_of(2) {
            Verdict::Drop
        } else {
            Verdict::Deliver
        }
    }
}

#[test]
fn middlewares_see_every_message_and_compose() {
    let mut e = env(NicConfig::strict());
    let rec = Recorder::default();
    let log = rec.log.clone();
    e.f.add_middleware(Box::new(rec));
    e.f.add_middleware(Box::new(DropEvery2nd(0)));
    e.f.post_send(e.c, &Wqe::write(e.buf, e.buf_k.lkey, 8, e.pool, e.pool_k.rkey)).unwrap();
    e.f.post_send(e.c, &Wqe::nop()).unwrap(); // local: no message
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 4, e.pool, e.pool_k.rkey)).unwrap();
    let v = drain(&mut e.f, e.c, QueueSel::Send);
    assert_eq!(statuses(&v), vec![WcStatus::Success, WcStatus::Success, WcStatus::RetryExcErr]);
    let log = log.borrow();
    assert_eq!(log.len(), 2);
    assert_eq!((log[0].opcode, log[0].len, log[0].src, log[0].dst), (Opcode::Write, 8, e.c, e.m));
    assert_eq!((log[1].opcode, log[1].len), (Opcode::Read, 4));
    assert_eq!(e.f.counters().messages, 2);
}
