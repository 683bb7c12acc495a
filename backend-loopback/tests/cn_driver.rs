//! The core's `CnDriver` on the model, where the cluster harness does not reach: its timers,
//! its slot limits, a reset under it, bad arguments.

use omw_core::cn::driver::{CnError, CnEvent, CnQp, IO_SLOTS};
use omw_core::device::{ExecutionMode, WcStatus};
use omw_core::ids::Rkey;
use omw_core::wire::message::ErrorCode;
use omw_core::wire::wqe::Wqe;
use omw_loopback::cluster::{Cluster, ClusterConfig};

fn cluster(mode: ExecutionMode, chunks: u32) -> Cluster {
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = 2;
    cfg.chunks = chunks;
    cfg.quota = chunks;
    cfg.mode = Some(mode);
    if mode == ExecutionMode::HostEngine {
        cfg.nic = omw_loopback::NicConfig::strict().with_offload(false);
    }
    Cluster::new(cfg).unwrap()
}

fn events(c: &mut Cluster, i: usize) -> Vec<CnEvent> {
    let now = c.now();
    let d = &mut c.cns[i].driver;
    d.poll(now).unwrap();
    std::iter::from_fn(|| d.next_event()).collect()
}

#[test]
fn an_unanswered_allocation_expires_at_its_deadline() {
    let mut c = cluster(ExecutionMode::HostEngine, 4);
    let d = &mut c.cns[0].driver;
    assert_eq!(d.poll_timeout(), None, "nothing pending, no back-off: no timer");
    d.reply_timeout = 5_000;
    let token = d.alloc(100).unwrap();
    assert_eq!(d.poll_timeout(), Some(5_100));
    d.handle_timeout(5_099);
    assert_eq!(d.client().pending_token(), Some(token), "not before its deadline");
    d.handle_timeout(5_100);
    assert_eq!(d.client().pending_token(), None);
    assert_eq!(d.next_event(), Some(CnEvent::ReplyTimedOut { token }));
    assert_eq!(d.poll_timeout(), None);
}

#[test]
fn the_empty_back_off_is_a_timer() {
    let mut c = cluster(ExecutionMode::Offloaded, 2);
    let _a = c.alloc(0).unwrap();
    let _b = c.alloc(0).unwrap();
    assert_eq!(c.alloc(0), Err(omw_loopback::cluster::CnOpError::Mn(ErrorCode::Empty)));
    let d = &mut c.cns[0].driver;
    let until = d.poll_timeout().expect("backing off after 'empty'");
    assert!(d.client().is_backing_off(until - 1));
    assert!(matches!(d.alloc(until - 1), Err(CnError::Client(omw_core::cn::ClientError::Backoff { .. }))));
    d.handle_timeout(until);
    assert_eq!(d.poll_timeout(), None);
    assert!(!d.client().is_backing_off(until));
}

#[test]
fn accesses_beyond_the_slots_are_refused_and_every_slot_comes_back() {
    let mut c = cluster(ExecutionMode::Offloaded, 4);
    let a = c.alloc(0).unwrap();
    let rkey = a.rkey(0).unwrap();
    let d = &mut c.cns[0].driver;
    let max = d.io_slot_len();
    assert!(
        matches!(d.post_read(0, a.base, rkey, max + 1), Err(CnError::TooLong { len, max: m }) if len == max + 1 && m == max)
    );
    let ops: Vec<_> =
        (0..IO_SLOTS).map(|k| d.post_write(0, a.base + 8 * k as u64, rkey, &[k as u8; 8]).unwrap()).collect();
    assert_eq!(d.post_read(0, a.base, rkey, 8), Err(CnError::SlotsBusy));
    assert_eq!(d.in_flight(), IO_SLOTS);
    // let the model's clock pass the completions (a CN polls only what is visible)
    c.advance(1_000_000).unwrap();
    let now = c.now();
    let d = &mut c.cns[0].driver;
    d.poll(now).unwrap();
    for op in &ops {
        let done = d.access_done(*op, &mut []).unwrap().expect("completed");
        assert_eq!(done.status, WcStatus::Success);
        assert!(matches!(d.access_done(*op, &mut []), Err(CnError::UnknownOp(_))), "a result is taken once");
    }
    assert_eq!(d.in_flight(), 0);
    let (st, back) = c.read(0, &a, 0, 0, 8 * IO_SLOTS);
    assert_eq!(st, WcStatus::Success);
    for k in 0..IO_SLOTS {
        assert_eq!(&back[8 * k..8 * k + 8], &[k as u8; 8]);
    }
}

#[test]
fn a_denied_access_is_reported_and_the_cn_recovers() {
    let mut c = cluster(ExecutionMode::Offloaded, 4);
    let a = c.alloc(0).unwrap();
    // a wrong key: the responder refuses, the pair goes to ERR, the harness reconnects it
    let bad = Rkey(a.rkey(0).unwrap().0 ^ 0x01);
    let (st, _) = c.read_raw(0, 0, a.base, bad, 8);
    assert_eq!(st, WcStatus::RemAccessErr);
    assert_eq!(c.write(0, &a, 0, 0, b"again"), WcStatus::Success);
    assert_eq!(c.read(0, &a, 0, 0, 5), (WcStatus::Success, b"again".to_vec()));
}

#[test]
fn receives_are_posted_again_after_a_reset_under_the_cn() {
    // the MN's RNIC reset resets every pair, the CN ends with them: the driver must see its
    // posted receives are gone and post them again, or the next message never lands
    let mut c = cluster(ExecutionMode::Offloaded, 4);
    let _ = c.alloc(1).unwrap();
    c.reset_mn_rnic().unwrap();
    assert!(c.cns[1].events.contains(&omw_core::cn::ClientEvent::Revoked));
    let a = c.alloc(1).expect("served after the reset");
    assert_eq!(c.write(1, &a, 0, 0, b"after"), WcStatus::Success);
    assert!(events(&mut c, 1).is_empty());
}

#[test]
fn raw_work_requests_on_any_queue_report_their_status() {
    let mut c = cluster(ExecutionMode::HostEngine, 4);
    // an atomic with a guessed key on the Free QP: refused, never a panic or a hang
    let w = Wqe::fetch_add(0, 0, 0x1000, 0x0102_0304, 1);
    let st = c.cn_post(0, CnQp::Free, w);
    assert!(!st.is_ok());
    assert_eq!(c.cn_post(0, CnQp::Access(7), Wqe::nop()), WcStatus::LocQpOpErr, "no such QP: a typed refusal");
    let a = c.alloc(0).unwrap();
    assert_eq!(c.write(0, &a, 0, 0, b"still fine"), WcStatus::Success);
}

/// Found by malicious_cn (`fuzz/regressions/malicious_cn/v2/offloaded-parked-alloc-requests-take-every-send-slot-honest-free-refused`),
/// but no attacker is needed: another CN holds the pool's last group, this CN's allocation is
/// told "empty" (its chain parks on a ticket), and once its back-off ends it asks again and
/// again. The MN takes no request from a parked CN until the pool refills, so each request's
/// SEND waits on the Alloc QP and holds a send slot. They used to take every slot, and the
/// CN's own free — the one that would refill the pool — was refused `SlotsBusy`.
#[test]
fn alloc_requests_waiting_on_an_empty_pool_leave_send_slots_for_frees() {
    use omw_core::cn::driver::{ALLOC_SEND_SLOTS, SEND_SLOTS};
    use omw_loopback::cluster::CnOpError;
    for mode in [ExecutionMode::Offloaded, ExecutionMode::HostEngine] {
        let mut c = cluster(mode, 2);
        let _other = c.alloc(0).unwrap();
        let mine = c.alloc(1).unwrap();
        assert_eq!(c.alloc(1), Err(CnOpError::Mn(ErrorCode::Empty)), "{mode:?}");
        let until = c.cns[1].driver.poll_timeout().expect("backing off");
        c.advance(until - c.now()).unwrap();
        let (mut busy, mut most) = (0, 0);
        for _ in 0..SEND_SLOTS + 4 {
            match c.alloc(1) {
                Err(CnOpError::NoReply | CnOpError::Mn(ErrorCode::Empty)) => {}
                Err(CnOpError::Client(omw_core::cn::ClientError::Backoff { .. })) => {
                    let until = c.cns[1].driver.poll_timeout().expect("backing off");
                    c.advance(until - c.now()).unwrap();
                }
                Err(CnOpError::Cn(CnError::SlotsBusy)) => busy += 1,
                other => panic!("{mode:?}: allocation from an empty pool: {other:?}"),
            }
            most = most.max(c.cns[1].driver.sends_in_flight());
        }
        assert_eq!(c.free(1, &mine), Ok(()), "{mode:?}: the free that refills the pool");
        assert!(most <= ALLOC_SEND_SLOTS, "{mode:?}: {most} requests in flight on the Alloc QP");
        if mode == ExecutionMode::Offloaded {
            assert!(busy > 0 && most == ALLOC_SEND_SLOTS, "the parked chain held the requests (every Alloc-QP slot)");
        }
        assert_eq!(c.free_groups(), 1, "{mode:?}");
        c.check_invariants().unwrap();
        let again = c.alloc(1).expect("served once the pool refilled");
        assert_eq!(c.write(1, &again, 0, 0, b"again"), WcStatus::Success);
        assert_eq!(c.cns[1].driver.sends_in_flight(), 0, "{mode:?}: every waiting request was taken or flushed");
    }
}

/// The offloaded audit is a timer of its own (issue 21): with the lease off the MN used to
/// have no timer at all, so it never audited — a CN that bound its access window to another
/// CN's QP kept it. Now `poll_timeout` names the audit, and the misbound group is taken back.
#[test]
fn the_offloaded_audit_runs_with_the_lease_off() {
    use omw_core::ids::Qpn;
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = 2;
    cfg.chunks = 8;
    cfg.quota = 8;
    cfg.mode = Some(ExecutionMode::Offloaded);
    cfg.lease_ns = 0;
    let mut c = Cluster::new(cfg).unwrap();
    assert!(c.driver.poll_timeout().is_some(), "no MN timer with the lease off");
    let mut q: Vec<Qpn> = c.cns[0].mn_qps.access.iter().copied().collect();
    q[0] = c.cns[1].mn_qps.access[0];
    let a = c.alloc_naming(0, &q).expect("the offloaded chain binds what the request names");
    let g = c.group_of(&a).unwrap();
    assert_eq!(c.driver.entry(g).map(|e| e.owner()), Some(c.cns[0].id.get()));
    let reclaimed = c.driver.mn.stats().groups_reclaimed;
    c.advance(2 * omw_core::mn::DEFAULT_AUDIT_NS).unwrap();
    assert!(c.driver.mn.stats().groups_reclaimed > reclaimed, "the audit did not run");
    assert_eq!(c.driver.entry(g).map(|e| e.owner()), Some(0), "the misbound group is still held");
    c.check_invariants().unwrap();
}

/// The lap counters are one of the MN's timers: every tick the driver samples each CN's
/// management-QP counters itself, on every deployment whose device can count (here the model)
/// — no test or harness has to call for a sample.
#[test]
fn the_mn_driver_samples_lap_counters_on_its_own_timer() {
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = 1;
    cfg.chunks = 8;
    cfg.mode = Some(ExecutionMode::Offloaded);
    let mut c = Cluster::new(cfg).unwrap();
    let a = c.alloc(0).unwrap();
    let _b = c.alloc(0).unwrap();
    c.free(0, &a).unwrap();
    let id = c.cns[0].id;
    assert_eq!(c.driver.mn.cn(id).map(|r| (r.allocs, r.frees)), Some((0, 0)), "sampled before any tick");
    c.advance(2 * omw_core::mn::DEFAULT_AUDIT_NS).unwrap();
    assert_eq!(c.driver.mn.cn(id).map(|r| (r.allocs, r.frees)), Some((2, 1)), "the tick sampled no counters");
    c.check_invariants().unwrap();
}
