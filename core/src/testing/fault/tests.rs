//! Each fault produces exactly its specified visible effect, on the test NIC.

use super::*;
use crate::cn::driver::CnEvent;
use crate::device::mw_rules::Mode;
use crate::testing::test_nic::{Node, TestNic};
use crate::wire::wqe::Sge;
use core::cell::RefCell;
use std::vec::Vec as StdVec;

type Nic<'m> = TestNic<'m, 2, 8, 16>;
type View<'a, 'm> = Node<'a, 'm, 2, 8, 16>;

/// Node A (requester, wrapped) with a buffer, node B with a memory region A may write (an MR
/// with REMOTE_WRITE), one pair `qa`–`qb`.
struct Fx<'a, 'm> {
    a: FaultInjector<View<'a, 'm>>,
    b: View<'a, 'm>,
    qa: Qpn,
    qb: Qpn,
    buf: u64,
    lkey: u32,
    dst: u64,
    rkey: u32,
}

fn with_fx(seed: u64, f: impl FnOnce(&mut Fx<'_, '_>)) {
    let (mut ma, mut mb) = (std::vec![0u8; 8192], std::vec![0u8; 8192]);
    let mut nic: Nic<'_> = TestNic::new(Mode::Strict);
    let na = nic.add_node(&mut ma).unwrap();
    let nb = nic.add_node(&mut mb).unwrap();
    let nic = RefCell::new(nic);
    let mut a = Node::new(&nic, na);
    let mut b = Node::new(&nic, nb);
    let (qa, qb) = a.connect_to(Domain::CnFacing, nb, Domain::CnFacing).unwrap();
    let buf = a.alloc_memory(4096, 64).unwrap();
    let lkey = a.reg_mr(Domain::CnFacing, buf, 4096, AccessFlags::LOCAL_WRITE).unwrap().lkey;
    let dst = b.alloc_memory(4096, 64).unwrap();
    let rights = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let rkey = b.reg_mr(Domain::CnFacing, dst, 4096, rights).unwrap().rkey;
    let mut fx = Fx { a: FaultInjector::new(a, seed), b, qa, qb, buf, lkey, dst, rkey };
    f(&mut fx);
}

fn write(fx: &Fx<'_, '_>, id: u64, off: u64) -> Wqe {
    Wqe::write(fx.buf, fx.lkey, 8, fx.dst + off, fx.rkey).with_wr_id(id)
}

fn poll(a: &mut impl RdmaBackend, qp: Qpn, q: QueueSel) -> StdVec<(u64, WcStatus)> {
    let mut out = [Completion::EMPTY; 16];
    let n = a.poll_cq(qp, q, &mut out).map_err(|_| ()).unwrap();
    out[..n].iter().map(|c| (c.wr_id, c.status)).collect()
}

/// A receive into node A's buffer (`on_b`: into B's region instead).
fn recv(fx: &Fx<'_, '_>, id: u64, on_b: bool) -> RecvWqe {
    let mut r = RecvWqe { wr_id: id, sges: heapless::Vec::new() };
    let (addr, lkey) = if on_b { (fx.dst + 512, fx.rkey) } else { (fx.buf + 512, fx.lkey) };
    r.sges.push(Sge { addr, length: 64, lkey }).unwrap();
    r
}

#[test]
fn a_failed_post_completes_with_its_status_in_order_and_errors_the_qp() {
    with_fx(1, |fx| {
        fx.a.arm(Rule { fault: Fault::FailSend(WcStatus::RemAccessErr), qp: Some(fx.qa), trigger: Trigger::Nth(2) })
            .unwrap();
        fx.a.write_local(fx.buf, &[7; 8]).unwrap();
        // 1: a SEND the responder has no receive for yet (waits in the device)
        fx.a.post_send(fx.qa, &Wqe::send(fx.buf, fx.lkey, 8).with_wr_id(1)).unwrap();
        fx.a.post_send(fx.qa, &write(fx, 2, 0)).unwrap(); // injected failure
        fx.a.post_send(fx.qa, &write(fx, 3, 8)).unwrap(); // flushed
        assert_eq!(fx.a.qp_state(fx.qa).unwrap(), QpState::Err);
        // nothing may overtake the SEND still in the device
        assert!(poll(&mut fx.a, fx.qa, QueueSel::Send).is_empty());
        fx.b.post_recv(fx.qb, &recv(fx, 9, true)).unwrap();
        assert_eq!(
            poll(&mut fx.a, fx.qa, QueueSel::Send),
            [(1, WcStatus::Success), (2, WcStatus::RemAccessErr), (3, WcStatus::WrFlushErr)]
        );
        let mut got = [1u8; 16];
        fx.b.read_local(fx.dst, &mut got).unwrap();
        assert_eq!(got, [0; 16], "neither the failed nor the flushed WRITE reached the device");
        // receives posted in ERR are flushed as well
        fx.a.post_recv(fx.qa, &recv(fx, 4, false)).unwrap();
        assert_eq!(poll(&mut fx.a, fx.qa, QueueSel::Recv), [(4, WcStatus::WrFlushErr)]);
        assert_eq!(fx.a.stats, FaultStats { injected: 1, delayed: 0, flushed: 2 });
        // a reset ends it
        fx.a.reset_qp(fx.qa).unwrap();
        assert_eq!(fx.a.qp_state(fx.qa).unwrap(), QpState::Rts);
        fx.a.post_send(fx.qa, &write(fx, 5, 0)).unwrap();
        assert_eq!(poll(&mut fx.a, fx.qa, QueueSel::Send), [(5, WcStatus::Success)]);
        fx.b.read_local(fx.dst, &mut got[..8]).unwrap();
        assert_eq!(got[..8], [7; 8]);
    });
}

#[test]
fn a_failed_receive_is_flushed_and_errors_the_qp() {
    with_fx(1, |fx| {
        fx.a.arm(Rule { fault: Fault::FailRecv, qp: None, trigger: Trigger::Nth(1) }).unwrap();
        fx.a.post_recv(fx.qa, &recv(fx, 1, false)).unwrap();
        assert_eq!(fx.a.inner().outstanding(fx.qa, QueueSel::Recv), Some(0), "never reached the device");
        assert_eq!(poll(&mut fx.a, fx.qa, QueueSel::Recv), [(1, WcStatus::WrFlushErr)]);
        assert_eq!(fx.a.qp_state(fx.qa).unwrap(), QpState::Err);
        fx.a.post_send(fx.qa, &write(fx, 2, 0)).unwrap();
        assert_eq!(poll(&mut fx.a, fx.qa, QueueSel::Send), [(2, WcStatus::WrFlushErr)]);
    });
}

#[test]
fn an_errored_qp_reports_the_devices_late_completions_flushed() {
    with_fx(1, |fx| {
        fx.a.post_send(fx.qa, &Wqe::send(fx.buf, fx.lkey, 8).with_wr_id(1)).unwrap();
        fx.a.error_qp(fx.qa).unwrap();
        fx.b.post_recv(fx.qb, &recv(fx, 9, true)).unwrap();
        assert_eq!(poll(&mut fx.a, fx.qa, QueueSel::Send), [(1, WcStatus::WrFlushErr)]);
        // the rule form: ERR just before the matching post, which is flushed
        fx.a.reset_qp(fx.qa).unwrap();
        fx.a.arm(Rule { fault: Fault::ErrorQp, qp: Some(fx.qa), trigger: Trigger::Nth(1) }).unwrap();
        fx.a.post_send(fx.qa, &write(fx, 2, 0)).unwrap();
        assert_eq!(poll(&mut fx.a, fx.qa, QueueSel::Send), [(2, WcStatus::WrFlushErr)]);
        assert_eq!(fx.a.qp_state(fx.qa).unwrap(), QpState::Err);
    });
}

#[test]
fn delayed_completions_keep_their_order_and_other_qps_overtake() {
    with_fx(1, |fx| {
        let (qa2, _qb2) = fx.a.inner().connect_to(Domain::CnFacing, fx.b.id(), Domain::CnFacing).unwrap();
        fx.a.arm(Rule { fault: Fault::Delay(2), qp: Some(fx.qa), trigger: Trigger::Nth(1) }).unwrap();
        fx.a.post_send(fx.qa, &write(fx, 1, 0)).unwrap();
        fx.a.post_send(fx.qa, &write(fx, 2, 8)).unwrap();
        fx.a.post_send(qa2, &write(fx, 3, 16)).unwrap();
        assert_eq!(poll(&mut fx.a, qa2, QueueSel::Send), [(3, WcStatus::Success)], "not delayed");
        assert!(poll(&mut fx.a, fx.qa, QueueSel::Send).is_empty());
        assert!(poll(&mut fx.a, fx.qa, QueueSel::Send).is_empty());
        assert_eq!(poll(&mut fx.a, fx.qa, QueueSel::Send), [(1, WcStatus::Success), (2, WcStatus::Success)]);
        assert_eq!(fx.a.stats.delayed, 2);
    });
}

#[test]
fn registration_faults_fail_the_call_and_stop_provisioning() {
    with_fx(1, |fx| {
        fx.a.arm(Rule { fault: Fault::FailRegMr, qp: None, trigger: Trigger::Nth(2) }).unwrap();
        fx.a.arm(Rule { fault: Fault::FailAllocMw, qp: None, trigger: Trigger::Nth(1) }).unwrap();
        assert!(fx.a.reg_mr(Domain::CnFacing, fx.buf, 64, AccessFlags::LOCAL_WRITE).is_ok());
        assert_eq!(
            fx.a.reg_mr(Domain::CnFacing, fx.buf, 64, AccessFlags::LOCAL_WRITE),
            Err(FaultError::Injected(FaultOp::RegMr))
        );
        assert!(fx.a.reg_mr(Domain::CnFacing, fx.buf, 64, AccessFlags::LOCAL_WRITE).is_ok(), "Nth fires once");
        assert_eq!(fx.a.alloc_mw(), Err(FaultError::Injected(FaultOp::AllocMw)));
        assert!(fx.a.alloc_mw().is_ok());
    });
    // an MN whose 3rd window allocation fails is not provisioned, with a typed error
    let mut mem = std::vec![0u8; 64 << 10];
    let mut nic: Nic<'_> = TestNic::new(Mode::Strict);
    let n = nic.add_node(&mut mem).unwrap();
    let nic = RefCell::new(nic);
    let mut dev = FaultInjector::new(Node::new(&nic, n), 3);
    dev.arm(Rule { fault: Fault::FailAllocMw, qp: None, trigger: Trigger::Nth(3) }).unwrap();
    let plan = crate::mn::plan::MnPlan::decide(dev.capabilities(), crate::mn::plan::MnOptions::default()).unwrap();
    let spec = crate::mn::provision::PoolSpec {
        chunk_size: 4096,
        chunks: 2,
        group_size: 2,
        max_cns: 1,
        quota: 0,
        lease_ns: 0,
        queue_depth: None,
    };
    let r = plan.provision(dev, &spec);
    assert!(
        matches!(r, Err(crate::mn::provision::ProvisionError::Backend(FaultError::Injected(FaultOp::AllocMw)))),
        "{r:?}"
    );
}

#[test]
fn chance_is_deterministic_for_a_seed() {
    let outcome = |seed: u64| {
        let mut v = StdVec::new();
        with_fx(seed, |fx| {
            let rule = Rule { fault: Fault::FailRegMr, qp: None, trigger: Trigger::Chance { per_65536: 32768 } };
            fx.a.arm(rule).unwrap();
            for _ in 0..64 {
                let r = fx.a.reg_mr(Domain::CnFacing, fx.buf, 64, AccessFlags::LOCAL_WRITE);
                v.push(!matches!(r, Err(FaultError::Injected(FaultOp::RegMr))));
            }
        });
        v
    };
    let (x, y, z) = (outcome(42), outcome(42), outcome(43));
    assert_eq!(x, y);
    assert_ne!(x, z);
    let fails = x.iter().filter(|ok| !**ok).count();
    assert!((16..=48).contains(&fails), "about half fail: {fails}");
}

/// An MN provisioned on a `FaultInjector` (its first bind on the CN's Free QP fails, as a device
/// refusing it would) and a `CnDriver`, after one refused request: `then` gets both.
fn after_a_failed_bind(
    then: impl FnOnce(
        &mut crate::mn::driver::MnDriver<FaultInjector<Node<'_, '_, 2, 12, 24>>>,
        &mut crate::cn::driver::CnDriver<Node<'_, '_, 2, 12, 24>, 4>,
    ),
) {
    after_a_failed_bind_with(false, then)
}

/// With `no_reset`, the device also refuses to reset the QP the bind failed on.
fn after_a_failed_bind_with(
    no_reset: bool,
    then: impl FnOnce(
        &mut crate::mn::driver::MnDriver<FaultInjector<Node<'_, '_, 2, 12, 24>>>,
        &mut crate::cn::driver::CnDriver<Node<'_, '_, 2, 12, 24>, 4>,
    ),
) {
    use crate::cn::driver::{CnDriver, CnEvent, CnMemory, CnQpSet, IO_SLOTS};
    use crate::mn::plan::{MnOptions, MnPlan};
    use crate::mn::provision::PoolSpec;
    use crate::mn::CnQps;
    use crate::wire::message::ErrorCode;

    let (mut mm, mut mc) = (std::vec![0u8; 64 << 10], std::vec![0u8; 64 << 10]);
    let mut nic: TestNic<'_, 2, 12, 24> = TestNic::new(Mode::Strict);
    let mn_at = nic.add_node(&mut mm).unwrap();
    let cn_at = nic.add_node(&mut mc).unwrap();
    let nic = RefCell::new(nic);
    let dev = FaultInjector::new(Node::new(&nic, mn_at), 7);
    let plan = MnPlan::decide(dev.capabilities(), MnOptions::default()).unwrap();
    let spec =
        PoolSpec { chunk_size: 4096, chunks: 2, group_size: 2, max_cns: 1, quota: 0, lease_ns: 0, queue_depth: None };
    let mut mn = plan.provision(dev, &spec).unwrap();

    let mut c = Node::new(&nic, cn_at);
    let pair = |c: &Node<'_, '_, 2, 12, 24>| c.connect_to(Domain::CnFacing, mn_at, Domain::CnFacing).unwrap();
    let ((alloc, mn_alloc), (free, mn_free), (access, mn_access)) = (pair(&c), pair(&c), pair(&c));
    let reply = c.alloc_memory(CnMemory::REPLY_LEN, 64).unwrap();
    let rk = c
        .reg_mr(Domain::CnFacing, reply, CnMemory::REPLY_LEN, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    let local_len = CnMemory::local_len_for(IO_SLOTS, 4096);
    let local = c.alloc_memory(local_len, 64).unwrap();
    let lk = c.reg_mr(Domain::CnFacing, local, local_len, AccessFlags::LOCAL_WRITE).unwrap();
    let mem = CnMemory { local, local_len, lkey: lk.lkey, reply, reply_rkey: rk.rkey };
    let qps = CnQpSet { alloc, free, access: [access].into_iter().collect() };
    let mut cn: CnDriver<_, 4> = CnDriver::new(c, qps, mem).unwrap();
    let mn_qps = CnQps {
        alloc: mn_alloc,
        free: mn_free,
        access: [mn_access].into_iter().collect(),
        alloc_loop: None,
        free_loop: None,
    };
    mn.connect(mn_qps).unwrap();
    cn.poll(0).unwrap();
    assert!(matches!(cn.next_event(), Some(CnEvent::Connected(_))));

    // MW[0] is bound by a bind posted on the MN's end of the Free QP: fail the first one
    let rule = Rule { fault: Fault::FailSend(WcStatus::MwBindErr), qp: Some(mn_free), trigger: Trigger::Nth(1) };
    mn.backend.arm(rule).unwrap();
    if no_reset {
        let refuse = Rule { fault: Fault::FailReset, qp: Some(mn_free), trigger: Trigger::Chance { per_65536: 65536 } };
        mn.backend.arm(refuse).unwrap();
    }
    let pump = |mn: &mut crate::mn::driver::MnDriver<_>, cn: &mut CnDriver<_, 4>| {
        for _ in 0..4 {
            mn.poll(0).unwrap();
            cn.poll(0).unwrap();
        }
    };
    let tok = cn.alloc(0).unwrap();
    pump(&mut mn, &mut cn);
    let ev = cn.next_event();
    assert!(
        matches!(ev, Some(CnEvent::Refused { token, code: ErrorCode::AllocFailed, ours: true }) if token == tok),
        "{ev:?}"
    );
    // the failed bind, and — where the device refuses resets — every reset attempt of the
    // errored Free QP (the repair's recovery and the quiesced free chain's re-arm)
    if no_reset {
        assert!(mn.backend.stats.injected >= 2, "{}", mn.backend.stats.injected);
    } else {
        assert_eq!(mn.backend.stats.injected, 1);
    }
    assert_eq!(mn.stats.laps_failed, 1);
    mn.check_invariants().unwrap();
    then(&mut mn, &mut cn);
}

/// The wrapper composes with the drivers: the failed bind is a failed lap, repaired — the CN is
/// refused, the popped group goes back, the invariants hold.
#[test]
fn an_mn_on_the_injector_repairs_a_lap_whose_bind_failed() {
    after_a_failed_bind(|mn, _| assert_eq!(mn.mn.stats().groups_reclaimed, 1));
}

/// Found with the injector: in host-engine mode the alloc lap's binds are posted on the CN's Free
/// and access QPs, but the repair reset only the chain's management QP (the Alloc QP): the Free
/// QP stayed in ERR and every later request of that CN failed. The driver now brings back every
/// QP of the CN a failed lap left in ERR (`MnDriver::recover_errored_qps`).
#[test]
fn after_a_failed_bind_the_next_request_is_served() {
    after_a_failed_bind(|mn, cn| {
        let tok = cn.alloc(0).unwrap();
        for _ in 0..4 {
            mn.poll(0).unwrap();
            cn.poll(0).unwrap();
        }
        let ev = cn.next_event();
        assert!(matches!(ev, Some(CnEvent::Allocated { token, result: Ok(_) }) if token == tok), "{ev:?}");
        mn.check_invariants().unwrap();
    });
}

/// A device that cannot reset the QP a failed lap left in ERR (libibverbs refuses to reset an
/// rdma_cm-connected QP): the recovery is best effort — counted, the poll goes on, the lap's
/// refusal still reaches the CN and the invariants hold.
#[test]
fn a_qp_the_device_cannot_reset_is_left_to_the_cn() {
    after_a_failed_bind_with(true, |mn, _| {
        assert_eq!(mn.stats.qps_left_in_error, 1, "{:?}", mn.stats);
        mn.check_invariants().unwrap();
    });
}
