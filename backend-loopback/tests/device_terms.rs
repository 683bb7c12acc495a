//! The model on a device's terms (`device_terms.rs`): CQ objects a WAIT names by number, QPs
//! whose mlx5 rings lie where the driver put them, doorbells, one-sided transitions, CQ limits.

mod common;
use common::*;
use omw_core::device::{QpState, WcStatus};
use omw_core::mlx5::ctrl::PrevWqe;
use omw_core::mlx5::encode::{encode, QueueResolver, Unmanaged};
use omw_core::mlx5::wqebb::{WqeIndex, WQEBB};
use omw_core::wire::wqe::{QueueSel, Wqe};
use omw_core::wire::wqe_format::WqeFormat;
use omw_loopback::{DeviceQp, Fabric, HostId, NicConfig, PdId, QpAddr, RingAt, Transition};

struct Cqn(u32);
impl QueueResolver for Cqn {
    fn cqn(&self, _: u32, _: QueueSel) -> Option<u32> {
        Some(self.0)
    }
    fn enable_index(&mut self, _: u32, _: QueueSel, _: u64) -> Option<WqeIndex> {
        None
    }
}

/// A device QP of `e.mn` with a 16-WQEBB send ring and no receive queue, reporting to `cqn`,
/// connected to itself.
fn device_qp(f: &mut Fabric, h: HostId, cqn: u32, master: bool) -> QpAddr {
    let ring = f.alloc(h, 16 * WQEBB as u64, 4096).unwrap();
    let spec = DeviceQp {
        pd: PdId(0),
        sq: RingAt { base: ring, entries: 16, stride: 64 },
        rq: None,
        cqn_snd: cqn,
        cqn_rcv: cqn,
        managed_send: false,
        managed_recv: false,
        cd_master: master,
        recv_doorbell: None,
    };
    let q = QpAddr::new(h, f.create_qp_with(h, &spec).unwrap());
    assert_eq!(f.qp_state(q).unwrap(), QpState::Reset);
    f.modify_qp(q, Transition::Init).unwrap();
    f.modify_qp(q, Transition::Rtr { peer: q }).unwrap();
    f.modify_qp(q, Transition::Rts).unwrap();
    q
}

fn put(f: &mut Fabric, q: QpAddr, at: u16, w: &Wqe, r: &mut impl QueueResolver) {
    let base = f.ring_base(q, QueueSel::Send).unwrap();
    let b = encode(w, WqeIndex::new(at), q.qpn.get(), PrevWqe::Other, r).unwrap();
    f.write(q.host, base + at as u64 * 64, b.bytes()).unwrap();
}

fn mlx5_env() -> Env {
    env(NicConfig::strict().with_wqe_format(WqeFormat::Mlx5).with_prefetch(8))
}

#[test]
fn a_qp_runs_its_ring_where_the_driver_put_it_up_to_the_doorbell_and_reports_wqe_indices() {
    let mut e = mlx5_env();
    let cqn = e.f.create_cq(e.mn, 64).unwrap();
    let q = device_qp(&mut e.f, e.mn, cqn, false);
    let (pool, k) = (e.pool, e.pool_k);
    e.f.write(e.mn, pool, b"umem!").unwrap();
    put(&mut e.f, q, 0, &Wqe::write(pool, k.lkey, 5, pool + 64, k.rkey), &mut Unmanaged);
    put(&mut e.f, q, 1, &Wqe::write(pool, k.lkey, 5, pool + 128, k.rkey), &mut Unmanaged);
    e.f.settle(1000);
    assert_eq!(read_bytes(&e.f, e.mn, pool + 64, 5), vec![0; 5], "nothing runs before the doorbell");
    e.f.ring_doorbell(q, QueueSel::Send, 1).unwrap();
    e.f.settle(1000);
    assert_eq!(read_bytes(&e.f, e.mn, pool + 64, 5), b"umem!");
    assert_eq!(read_bytes(&e.f, e.mn, pool + 128, 5), vec![0; 5], "only up to the producer index");
    e.f.ring_doorbell(q, QueueSel::Send, 2).unwrap();
    e.f.settle(1000);
    let c = e.f.take_completions(e.mn, cqn).unwrap();
    assert_eq!(c.iter().map(|c| c.completion.wr_id).collect::<Vec<_>>(), [0, 1], "wr_id = WQE index");
    assert_eq!(e.f.cq_status(e.mn, cqn).unwrap().taken, 2);
}

#[test]
fn a_wait_names_a_cq_object_and_only_a_master_may_post_it() {
    let mut e = mlx5_env();
    let (watched, own) = (e.f.create_cq(e.mn, 64).unwrap(), e.f.create_cq(e.mn, 64).unwrap());
    let q = device_qp(&mut e.f, e.mn, own, true);
    let (pool, k) = (e.pool, e.pool_k);
    e.f.write(e.mn, pool, b"after").unwrap();
    let other = device_qp(&mut e.f, e.mn, watched, false);
    put(&mut e.f, q, 0, &Wqe::wait(0, QueueSel::Send, 1), &mut Cqn(watched));
    put(&mut e.f, q, 1, &Wqe::write(pool, k.lkey, 5, pool + 64, k.rkey), &mut Unmanaged);
    e.f.ring_doorbell(q, QueueSel::Send, 2).unwrap();
    e.f.settle(1000);
    assert_eq!(read_bytes(&e.f, e.mn, pool + 64, 5), vec![0; 5], "blocked on the watched CQ");
    put(&mut e.f, other, 0, &Wqe::nop(), &mut Unmanaged);
    e.f.ring_doorbell(other, QueueSel::Send, 1).unwrap();
    e.f.settle(1000);
    assert_eq!(read_bytes(&e.f, e.mn, pool + 64, 5), b"after", "one CQE on it released the WAIT");
    // the same WAIT on a QP without cd_master fails
    let plain = device_qp(&mut e.f, e.mn, own, false);
    put(&mut e.f, plain, 0, &Wqe::wait(0, QueueSel::Send, 1), &mut Cqn(watched));
    e.f.ring_doorbell(plain, QueueSel::Send, 1).unwrap();
    e.f.settle(1000);
    let c = e.f.take_completions(e.mn, own).unwrap();
    assert!(c.iter().any(|c| c.completion.status == WcStatus::LocQpOpErr));
    assert_eq!(e.f.qp_state(plain).unwrap(), QpState::Err);
}

#[test]
fn a_cq_at_its_limit_overruns_and_generates_nothing_more() {
    let mut e = mlx5_env();
    let cqn = e.f.create_cq(e.mn, 64).unwrap();
    e.f.set_cq_limit(e.mn, cqn, Some(2)).unwrap();
    let q = device_qp(&mut e.f, e.mn, cqn, false);
    for i in 0..4 {
        put(&mut e.f, q, i, &Wqe::nop(), &mut Unmanaged);
    }
    e.f.ring_doorbell(q, QueueSel::Send, 4).unwrap();
    e.f.settle(1000);
    let s = e.f.cq_status(e.mn, cqn).unwrap();
    assert_eq!((s.count, s.overrun), (2, true));
    assert_eq!(e.f.counters().cqes_overrun, 2);
    // raising the limit does not revive an overrun CQ
    e.f.set_cq_limit(e.mn, cqn, None).unwrap();
    put(&mut e.f, q, 4, &Wqe::nop(), &mut Unmanaged);
    e.f.ring_doorbell(q, QueueSel::Send, 5).unwrap();
    e.f.settle(1000);
    assert_eq!(e.f.cq_status(e.mn, cqn).unwrap().count, 2);
    e.f.check_invariants().unwrap();
}

#[test]
fn transitions_go_one_side_at_a_time_in_order_and_reset_keeps_the_cqs() {
    let mut e = mlx5_env();
    let cqn = e.f.create_cq(e.mn, 64).unwrap();
    let q = device_qp(&mut e.f, e.mn, cqn, false);
    put(&mut e.f, q, 0, &Wqe::nop(), &mut Unmanaged);
    e.f.ring_doorbell(q, QueueSel::Send, 1).unwrap();
    e.f.settle(1000);
    e.f.modify_qp(q, Transition::Reset).unwrap();
    assert_eq!(e.f.cq_status(e.mn, cqn).unwrap().count, 1, "a CQ object counts on across its QP's reset");
    assert!(e.f.modify_qp(q, Transition::Rts).is_err(), "RTS only from RTR");
    assert!(e.f.modify_qp(q, Transition::Rtr { peer: q }).is_err(), "RTR only from INIT");
    assert!(e.f.destroy_cq(e.mn, cqn).is_err(), "a live QP reports to it");
    e.f.destroy_qp(q).unwrap();
    e.f.destroy_cq(e.mn, cqn).unwrap();
    assert!(e.f.cq_status(e.mn, cqn).is_err());
}

#[test]
fn a_cns_reset_leaves_a_device_qp_peer_to_its_driver() {
    let mut f = Fabric::new(NicConfig::strict().with_wqe_format(WqeFormat::Mlx5));
    let (mn, cn) = (f.add_host("mn").unwrap(), f.add_host("cn").unwrap());
    let cqn = f.create_cq(mn, 64).unwrap();
    let m = device_qp(&mut f, mn, cqn, false);
    let c = QpAddr::new(cn, f.create_qp(cn, omw_loopback::QpConfig::default()).unwrap());
    f.modify_qp(c, Transition::Rtr { peer: m }).unwrap();
    f.modify_qp(c, Transition::Rts).unwrap();
    f.modify_qp(m, Transition::Err).unwrap();
    f.reset_qp(c).unwrap();
    assert_eq!(f.qp_state(c).unwrap(), QpState::Rts);
    assert_eq!(f.qp_state(m).unwrap(), QpState::Err, "the device QP's driver resets it (2RST)");
}
