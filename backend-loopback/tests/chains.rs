//! WAIT / ENABLE / managed queues / self-modifying WQEs / prefetching: the machinery chains
//! are made of.

mod common;
use common::*;
use omw_core::device::behaviour::{DeviceBehaviour, RecvEnable};
use omw_core::device::{QpState, WcStatus};
use omw_core::wire::wqe::{QueueSel, Wqe, WqeField, WqeFlags, WQE_SIZE};
use omw_loopback::{Fabric, NicConfig, PdId, QpAddr, QpConfig};

const QUIET: WqeFlags = WqeFlags::empty();

/// MN loopback pair (`a` is the chain's Loop QP) in an existing env.
fn loop_pair(e: &mut Env, cfg: QpConfig) -> QpAddr {
    e.f.create_connected_pair(e.mn, cfg, e.mn, QpConfig::default()).unwrap().0
}

fn managed_send(depth: u32) -> QpConfig {
    QpConfig { managed_send: true, ..QpConfig::default().with_depths(depth, 4) }
}

#[test]
fn enable_releases_a_managed_queue_after_a_wait() {
    let mut e = env(NicConfig::strict());
    // the MN end of the CN pair, but managed
    let (c, m) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, managed_send(4)).unwrap();
    let a = loop_pair(&mut e, QpConfig::default());
    let (pool, pk) = (e.pool, e.pool_k);
    e.f.write(e.mn, pool, b"payload!").unwrap();
    e.f.post_recv(c, &recv(1, &[])).unwrap();
    e.f.post_send(m, &Wqe::write_imm(pool, pk.lkey, 8, e.buf, e.buf_k.rkey, 7).with_wr_id(50)).unwrap();
    assert_eq!(e.f.run_until_idle(100), 0, "a managed queue runs nothing before an ENABLE");
    assert_eq!(e.f.qp_stats(m).unwrap().send_consumer, 0);

    e.f.post_send(a, &Wqe::write(pool, pk.lkey, 8, pool + 64, pk.rkey).with_wr_id(10)).unwrap();
    e.f.post_send(a, &Wqe::wait(a.qpn.get(), QueueSel::Send, 1)).unwrap();
    e.f.post_send(a, &Wqe::enable(m.qpn.get(), QueueSel::Send, 1)).unwrap();
    let loop_done = {
        e.f.run_until_idle(1000);
        e.f.poll_timed(a, QueueSel::Send).unwrap()
    };
    e.f.settle(1000);
    let r = e.f.poll_timed(c, QueueSel::Recv).unwrap();
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].completion.imm, r[0].completion.status), (Some(7), WcStatus::Success));
    assert_eq!(read_bytes(&e.f, e.cn, e.buf, 8), b"payload!");
    let w = loop_done.first().map_or_else(|| e.f.trace()[0].at, |c| c.at);
    assert!(r[0].at > w, "the reply ran after the WAIT saw the loop WRITE complete");
    assert_eq!(e.f.qp_stats(m).unwrap().send_limit, 1);
}

#[test]
fn wait_on_a_receive_cq_and_scatter_into_a_managed_wqe() {
    for cfg in [NicConfig::strict(), NicConfig::strict().with_prefetch(8)] {
        let mut e = env(cfg);
        let (c, m) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, managed_send(1)).unwrap();
        let a = loop_pair(&mut e, QpConfig::default());
        let (pool, pk) = (e.pool, e.pool_k);
        let ring = e.f.ring_keys(e.mn).unwrap();
        e.f.write(e.mn, pool, b"reply!").unwrap();
        // the reply WRITE: destination and rkey unknown until the request arrives
        e.f.post_send(m, &Wqe::write(pool, pk.lkey, 6, 0, 0)).unwrap();
        let slot = e.f.ring_base(m, QueueSel::Send).unwrap();
        let target = slot + WqeField::RemoteAddr.offset() as u64;
        e.f.post_recv(m, &recv(3, &[(target, 12, ring.lkey)])).unwrap();
        e.f.post_send(a, &Wqe::wait(m.qpn.get(), QueueSel::Recv, 1)).unwrap();
        e.f.post_send(a, &Wqe::enable(m.qpn.get(), QueueSel::Send, 1)).unwrap();
        assert_eq!(e.f.run_until_idle(100), 0, "the WAIT blocks the loop QP");
        // the CN's request: reply address and rkey, little-endian
        let mut req = e.buf.to_le_bytes().to_vec();
        req.extend_from_slice(&e.buf_k.rkey.to_le_bytes());
        e.f.write(e.cn, e.buf + 512, &req).unwrap();
        e.f.post_send(c, &Wqe::send(e.buf + 512, e.buf_k.lkey, 12)).unwrap();
        assert_eq!(one(&mut e.f, c).status, WcStatus::Success);
        e.f.settle(1000);
        assert_eq!(read_bytes(&e.f, e.cn, e.buf, 6), b"reply!", "prefetch={}", cfg.prefetch);
        assert_eq!(drain(&mut e.f, m, QueueSel::Send)[0].status, WcStatus::Success);
    }
}

/// A READ patches the remote address of a later WRITE in the same ring. Gated by a WAIT on
/// the READ's completion, it works in every mode; ungated, a prefetching NIC executes the
/// stale template — the model catches the missing gate.
fn self_modifying(prefetch: bool, gated: bool) -> (Vec<u8>, Vec<u8>) {
    self_modifying_under(DeviceBehaviour::PAPER, prefetch, gated)
}

fn self_modifying_under(b: DeviceBehaviour, prefetch: bool, gated: bool) -> (Vec<u8>, Vec<u8>) {
    let base = NicConfig::strict().with_behaviour(b);
    let cfg = if prefetch { base.with_prefetch(8) } else { base };
    let mut e = env(cfg);
    let a = loop_pair(&mut e, QpConfig::default());
    let (pool, pk) = (e.pool, e.pool_k);
    let ring = e.f.ring_keys(e.mn).unwrap();
    let slot2 = e.f.ring_base(a, QueueSel::Send).unwrap() + 2 * WQE_SIZE as u64;
    e.f.write_u64(e.mn, pool, pool + 256).unwrap(); // the patch value: the real destination
    e.f.write(e.mn, pool + 512, b"patched!").unwrap();
    let patch = Wqe::read(slot2 + WqeField::RemoteAddr.offset() as u64, ring.lkey, 8, pool, pk.rkey);
    e.f.post_send(a, &patch).unwrap();
    let gate = if gated { Wqe::wait(a.qpn.get(), QueueSel::Send, 1) } else { Wqe::nop().with_flags(QUIET) };
    e.f.post_send(a, &gate).unwrap();
    e.f.post_send(a, &Wqe::write(pool + 512, pk.lkey, 8, pool + 1024, pk.rkey)).unwrap();
    let v = drain(&mut e.f, a, QueueSel::Send);
    assert_eq!(statuses(&v), vec![WcStatus::Success; 2]);
    (read_bytes(&e.f, e.mn, pool + 256, 8), read_bytes(&e.f, e.mn, pool + 1024, 8))
}

#[test]
fn self_modifying_wqe_gated_works_ungated_fails_under_prefetch() {
    let patched = (b"patched!".to_vec(), vec![0u8; 8]);
    let stale = (vec![0u8; 8], b"patched!".to_vec());
    assert_eq!(self_modifying(false, false), patched, "fetch at execution: the patch landed");
    assert_eq!(self_modifying(false, true), patched);
    assert_eq!(self_modifying(true, true), patched, "the WAIT stops prefetching until the patch landed");
    assert_eq!(self_modifying(true, false), stale, "prefetched before the patch: stale bytes execute");
    // the model's default: a NIC that fetches past an unsatisfied WAIT has the stale WRITE
    // cached before the patch lands — a WAIT alone is no fetch bound (issue 22): the chains
    // keep every patched WQE beyond an enable limit instead
    let past = NicConfig::DEFAULT_BEHAVIOUR;
    assert_eq!(past.wait_prefetch, omw_core::device::behaviour::WaitPrefetch::FetchesPast);
    assert_eq!(self_modifying_under(past, true, true), stale, "fetched past the WAIT: stale bytes execute");
    assert_eq!(self_modifying_under(past, false, true), patched, "fetch at execution: the patch landed");
}

/// A ring exactly as deep as the chain, re-enabling itself each lap and bumping its WAIT's
/// absolute count with a fetch-and-add on its own WQE (the chain builders' re-arm tail).
fn self_rearming(cfg: NicConfig, laps: u64) -> (Fabric, QpAddr, u64) {
    let mut e = env(cfg);
    let a = loop_pair(&mut e, managed_send(4));
    let (pool, pk) = (e.pool, e.pool_k);
    // the bump is a remote atomic on the ring: grant it (rings are local-only by default)
    let ring = e.f.register_ring_arena(e.mn, PdId(0), ALL_REMOTE).unwrap();
    let base = e.f.ring_base(a, QueueSel::Send).unwrap();
    let wait_op0 = base + WQE_SIZE as u64 + WqeField::Operand0.offset() as u64;
    let q = a.qpn.get();
    e.f.post_send(a, &Wqe::fetch_add(pool + 8, pk.lkey, pool, pk.rkey, 1)).unwrap(); // the work
    e.f.post_send(a, &Wqe::wait(q, QueueSel::Send, 1)).unwrap();
    e.f.post_send(a, &Wqe::fetch_add(pool + 16, pk.lkey, wait_op0, ring.rkey, 2)).unwrap(); // bump
    e.f.post_send(a, &Wqe::enable(q, QueueSel::Send, 4).with_flags(WqeFlags::FENCE)).unwrap();
    e.f.enable(a, QueueSel::Send, 4).unwrap();
    let steps = e.f.run_until_idle(4 * laps);
    assert_eq!(steps, 4 * laps, "never idle, and bounded by max_steps");
    e.f.check_invariants().unwrap();
    let counter = e.f.read_u64(e.mn, pool).unwrap();
    (e.f, a, counter)
}

#[test]
fn self_rearming_ring_runs_lap_after_lap() {
    for cfg in [NicConfig::strict(), NicConfig::strict().with_prefetch(4), NicConfig::rxe_compatible().with_prefetch(2)]
    {
        let (f, a, counter) = self_rearming(cfg, 25);
        assert_eq!(counter, 25);
        let s = f.qp_stats(a).unwrap();
        assert_eq!((s.send_consumer, s.send_limit, s.send_producer), (100, 104, 4));
        assert_eq!(s.send_cq_count, 50);
        assert_eq!(f.qp_state(a).unwrap(), QpState::Rts);
        let base = f.ring_base(a, QueueSel::Send).unwrap();
        let op0 = f.read_u64(a.host, base + 64 + 48).unwrap();
        assert_eq!(op0, 1 + 2 * 25, "the WAIT was bumped once per lap");
    }
}

#[test]
fn wait_and_enable_need_offload() {
    let mut e = env(NicConfig::host_engine());
    let a = loop_pair(&mut e, managed_send(4));
    let b = loop_pair(&mut e, QpConfig::default());
    e.f.post_send(b, &Wqe::wait(b.qpn.get(), QueueSel::Send, 0).with_wr_id(1)).unwrap();
    assert_eq!(one(&mut e.f, b).status, WcStatus::LocQpOpErr);
    e.f.reset_qp(b).unwrap();
    e.f.post_send(b, &Wqe::enable(a.qpn.get(), QueueSel::Send, 1)).unwrap();
    assert_eq!(one(&mut e.f, b).status, WcStatus::LocQpOpErr);
    // the CPU's doorbell still works
    e.f.post_send(a, &Wqe::nop()).unwrap();
    e.f.enable(a, QueueSel::Send, 1).unwrap();
    assert_eq!(one(&mut e.f, a).status, WcStatus::Success);
}

#[test]
fn enable_errors_and_receive_enables() {
    // a device whose receives on a cd_slave_receive queue need RECV_EN (under the default,
    // `RecvEnable::Doorbell`, the posted receive is available at once: tests/behaviour.rs)
    let gated = DeviceBehaviour { recv_enable: RecvEnable::RecvEnOnly, ..DeviceBehaviour::PAPER };
    let mut e = env(NicConfig::strict().with_behaviour(gated));
    let a = loop_pair(&mut e, QpConfig::default());
    // ENABLE of a queue that is not managed, or of a QP that does not exist
    e.f.post_send(a, &Wqe::enable(a.qpn.get(), QueueSel::Send, 1)).unwrap();
    assert_eq!(one(&mut e.f, a).status, WcStatus::LocQpOpErr);
    e.f.reset_qp(a).unwrap();
    e.f.post_send(a, &Wqe::wait(0x00FF_FFFF, QueueSel::Send, 1)).unwrap();
    assert_eq!(one(&mut e.f, a).status, WcStatus::LocQpOpErr);
    e.f.reset_qp(a).unwrap();
    // a managed receive queue: a SEND waits (RNR) until the chain enables the receive
    let rq = QpConfig { managed_recv: true, ..QpConfig::default() };
    let (c, m) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, rq).unwrap();
    e.f.post_recv(m, &recv(8, &[(e.pool, 8, e.pool_k.lkey)])).unwrap();
    e.f.post_send(c, &Wqe::send(e.buf, e.buf_k.lkey, 8)).unwrap();
    e.f.run_until_idle(10);
    assert_eq!(e.f.counters().rnr_naks, 1);
    e.f.post_send(a, &Wqe::enable(m.qpn.get(), QueueSel::Recv, 1)).unwrap();
    assert_eq!(one(&mut e.f, c).status, WcStatus::Success);
    assert_eq!(drain(&mut e.f, m, QueueSel::Recv)[0].wr_id, 8);
    assert!(drain(&mut e.f, a, QueueSel::Send).is_empty(), "unsignalled ENABLE");
}

#[test]
fn a_wait_blocks_only_its_own_queue() {
    let mut e = env(NicConfig::strict());
    let a = loop_pair(&mut e, QpConfig::default());
    let b = loop_pair(&mut e, QpConfig::default());
    e.f.post_send(a, &Wqe::wait(b.qpn.get(), QueueSel::Send, 2)).unwrap();
    e.f.post_send(a, &Wqe::nop().with_wr_id(99)).unwrap();
    e.f.post_send(b, &Wqe::nop().with_wr_id(1)).unwrap();
    e.f.run_until_idle(100);
    assert!(drain(&mut e.f, a, QueueSel::Send).is_empty());
    e.f.post_send(b, &Wqe::nop().with_flags(QUIET)).unwrap();
    e.f.run_until_idle(100);
    assert!(drain(&mut e.f, a, QueueSel::Send).is_empty(), "unsignalled WQEs do not count");
    e.f.post_send(b, &Wqe::nop().with_wr_id(2)).unwrap();
    assert_eq!(one(&mut e.f, a).wr_id, 99);
    // the CQ count is not decreased by polling
    assert_eq!(e.f.cq_count(b, QueueSel::Send).unwrap(), 2);
    drain(&mut e.f, b, QueueSel::Send);
    assert_eq!(e.f.cq_count(b, QueueSel::Send).unwrap(), 2);
    // errors count too: a WAIT for 3 is released by a failing WQE
    e.f.post_send(a, &Wqe::wait(b.qpn.get(), QueueSel::Send, 3)).unwrap();
    e.f.post_send(a, &Wqe::nop().with_wr_id(100)).unwrap();
    e.f.post_send(b, &Wqe::read(e.pool, e.pool_k.lkey, 8, e.pool, 1)).unwrap();
    assert_eq!(one(&mut e.f, a).wr_id, 100);
    assert_eq!(e.f.cq_count(b, QueueSel::Send).unwrap(), 3);
}

#[test]
fn prefetch_respects_limits_and_never_runs_ahead_of_enable() {
    let mut e = env(NicConfig::strict().with_prefetch(3));
    let a = loop_pair(&mut e, managed_send(8));
    for i in 0..6 {
        e.f.post_send(a, &Wqe::nop().with_wr_id(i)).unwrap();
    }
    assert_eq!(e.f.qp_stats(a).unwrap().prefetched, 0, "nothing enabled, nothing fetched");
    e.f.enable(a, QueueSel::Send, 2).unwrap();
    assert_eq!(e.f.qp_stats(a).unwrap().prefetched, 2);
    e.f.enable(a, QueueSel::Send, 4).unwrap();
    assert_eq!(e.f.qp_stats(a).unwrap().prefetched, 3, "capped at the prefetch depth");
    e.f.check_invariants().unwrap();
    let v = drain(&mut e.f, a, QueueSel::Send);
    assert_eq!(v.iter().map(|c| c.wr_id).collect::<Vec<_>>(), (0..6).collect::<Vec<_>>());
}
