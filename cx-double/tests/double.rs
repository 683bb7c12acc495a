//! The double on its own: what `DevxBackend` sends it runs, what is malformed it refuses as
//! firmware would, and the CQ, doorbell and ownership rules hold.

use omw_core::access::AccessFlags;
use omw_core::device::behaviour::DeviceBehaviour;
use omw_core::device::{Capabilities, Completion, DataPath, Domain, Provision, QpState, WcStatus};
use omw_core::mlx5::prm::cq as pcq;
use omw_core::mlx5::prm::qp as pqp;
use omw_core::wire::wqe::{QueueSel, Wqe, WqeFlags};
use omw_cx_double::prm::{self, status};
use omw_cx_double::{CxCaps, CxDouble};
use omw_verbs::devx::api::{DevxApi, MemRange};
use omw_verbs::devx::backend::{DevxBackend, DevxConfig};
use omw_verbs::devx::device::DevxDevice;
use omw_verbs::devx::queue::{self, CqSpec, QpSpec};
use omw_verbs::devx::{caps, DevxError};
use std::cell::RefCell;
use std::rc::Rc;

fn double_with(caps: CxCaps) -> CxDouble {
    let mut f = CxDouble::fabric(DeviceBehaviour::PAPER);
    let h = f.add_host("mn").unwrap();
    CxDouble::new(Rc::new(RefCell::new(f)), h, caps).unwrap()
}

fn double() -> CxDouble {
    double_with(CxCaps::CONNECTX)
}

fn backend() -> DevxBackend<CxDouble> {
    let mut d = double();
    let hca = caps::query(&mut d).unwrap();
    let mut cfg = DevxConfig::new(Capabilities::OFFLOAD | Capabilities::MW_BOUNDS_ENFORCED);
    cfg.ring_arena_bytes = 4 << 20;
    cfg.log_cqes = 4;
    DevxBackend::new(d, hca, cfg).unwrap()
}

fn poll_one(b: &mut DevxBackend<CxDouble>, q: omw_core::ids::Qpn, sel: QueueSel) -> Option<Completion> {
    let mut out = [Completion::EMPTY; 4];
    for _ in 0..8 {
        let n = b.poll_cq(q, sel, &mut out).unwrap();
        if n > 0 {
            return Some(out[0]);
        }
    }
    None
}

#[test]
fn the_capabilities_pass_the_offload_gate_and_say_what_the_double_was_made_with() {
    let mut d = double();
    let hca = caps::query(&mut d).unwrap();
    assert_eq!(hca.missing_for_offload(), None);
    assert_eq!((hca.log_max_qp_sz, hca.log_max_cq_sz, hca.log_max_msg), (15, 22, 30));
    let mut d = double_with(CxCaps { cd: false, ..CxCaps::CONNECTX });
    assert!(caps::query(&mut d).unwrap().missing_for_offload().is_some(), "no CORE-Direct: the gate refuses");
}

#[test]
fn a_write_and_a_read_on_a_devx_loopback_pair_run_and_complete_through_cqes() {
    let mut b = backend();
    let q = b.create_loopback_qp(Domain::MnPrivate, None).unwrap();
    let mem = b.alloc_memory(8192, 4096).unwrap();
    let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    let k = b.reg_mr(Domain::MnPrivate, mem, 8192, rw).unwrap();
    b.write_local(mem, b"devx, executed!!").unwrap();
    b.post_send(q, &Wqe::write(mem, k.lkey, 16, mem + 4096, k.rkey).with_wr_id(7)).unwrap();
    let c = poll_one(&mut b, q, QueueSel::Send).expect("a CQE");
    assert_eq!((c.wr_id, c.status), (7, WcStatus::Success));
    let mut got = [0u8; 16];
    b.read_local(mem + 4096, &mut got).unwrap();
    assert_eq!(&got, b"devx, executed!!");
    // an unsignaled WQE completes with the signaled one after it (one CQE, wqe_counter)
    b.post_send(q, &Wqe::read(mem + 100, k.lkey, 8, mem, k.rkey).with_flags(WqeFlags::empty()).with_wr_id(8)).unwrap();
    b.post_send(q, &Wqe::read(mem + 200, k.lkey, 8, mem, k.rkey).with_wr_id(9)).unwrap();
    assert_eq!(poll_one(&mut b, q, QueueSel::Send).map(|c| c.wr_id), Some(9));
    assert_eq!(b.outstanding(q, QueueSel::Send), Some(0));
    // an access error: an error CQE with its syndrome, the QP in ERR
    b.post_send(q, &Wqe::read(mem, k.lkey, 8, mem, k.rkey ^ 0x80).with_wr_id(10)).unwrap();
    let e = poll_one(&mut b, q, QueueSel::Send).unwrap();
    assert_eq!((e.wr_id, e.status), (10, WcStatus::RemAccessErr));
    assert_eq!(b.qp_state(q).unwrap(), QpState::Err);
    // reset (2RST, drain, reconnect) and it runs again
    b.reset_qp(q).unwrap();
    b.post_send(q, &Wqe::write(mem, k.lkey, 16, mem + 4096, k.rkey).with_wr_id(11)).unwrap();
    assert_eq!(poll_one(&mut b, q, QueueSel::Send).map(|c| (c.wr_id, c.status)), Some((11, WcStatus::Success)));
    assert_eq!(b.device().refusals(), &[], "nothing DevxBackend sent was refused");
}

/// CREATE_CQ / CREATE_QP inputs as omw's encoder builds them, on the double's objects.
struct Objects {
    d: CxDouble,
    uar: omw_verbs::devx::api::UarHandle,
    mem: MemRange,
}

fn objects() -> Objects {
    let mut d = double();
    let uar = d.alloc_uar().unwrap();
    let mem = d.alloc_mem(1 << 20, 4096).unwrap();
    Objects { d, uar, mem }
}

fn cq_input(o: &mut Objects, log: u8) -> (Vec<u8>, MemRange) {
    let mem = MemRange { addr: o.mem.addr, len: CqSpec::mem_needed(log).div_ceil(4096) * 4096 };
    let umem = o.d.umem_reg(mem, 1).unwrap();
    let input = pcq::create_cq_in(&pcq::CreateCq {
        log_cq_size: log,
        uar_page: o.uar.page_id,
        eqn: 7,
        log_page_size: 0,
        umem_id: umem.umem_id,
        umem_offset: 0,
        dbr_umem_id: umem.umem_id,
        dbr_offset: 64 << log,
        overrun_ignore: false,
    })
    .unwrap();
    (input.to_vec(), mem)
}

fn refused(r: Result<impl std::fmt::Debug, DevxError>) -> u8 {
    match r {
        Err(DevxError::Command { status, .. }) => status,
        other => panic!("not a firmware refusal: {other:?}"),
    }
}

#[test]
fn malformed_commands_are_refused_with_the_status_firmware_gives() {
    let mut o = objects();
    let (good, _) = cq_input(&mut o, 4);
    let mut out = [0u8; 16];
    // short input, short output, unknown opcode
    assert_eq!(refused(o.d.obj_create("CREATE_CQ", &good[..100], &mut out)), status::BAD_INP_LEN);
    assert_eq!(refused(o.d.obj_create("CREATE_CQ", &good, &mut out[..8])), status::BAD_OUTP_LEN);
    let mut bad = good.clone();
    bad[0..2].copy_from_slice(&0x0999u16.to_be_bytes());
    assert_eq!(refused(o.d.obj_create("CREATE_CQ", &bad, &mut out)), status::BAD_OP);
    assert_eq!(out[0], status::BAD_OP, "the status is in the output, as DEVX returns it");
    // each field the double checks
    let mutate = |f: prm::Field, v: u64| {
        let mut b = good.clone();
        prm::set(&mut b, f, v);
        b
    };
    use prm::create_cq as c;
    for (f, v, want) in [
        (c::CQE_SZ, 1, status::BAD_PARAM),
        (c::CC, 1, status::BAD_PARAM),
        (c::LOG_CQ_SIZE, 23, status::BAD_PARAM),
        (c::UAR_PAGE, 0x99, status::BAD_RES),
        (c::C_EQN, 3, status::BAD_RES),
        (c::CQ_UMEM_VALID, 0, status::BAD_PARAM),
        (c::CQ_UMEM_ID, 0x7777, status::BAD_RES),
        (c::CQ_UMEM_OFFSET, 4096, status::BAD_PARAM),
        (c::DBR_ADDR, 4, status::BAD_PARAM),
    ] {
        assert_eq!(refused(o.d.obj_create("CREATE_CQ", &mutate(f, v), &mut out)), want, "{}", f.name);
    }
    let cq = o.d.obj_create("CREATE_CQ", &good, &mut out).expect("the encoder's CQ is accepted");
    let _ = cq;
    assert_eq!(o.d.refusals().len(), 12);
}

fn qp_setup(o: &mut Objects, cd: pqp::CdRole, _ts: Option<u8>) -> (Result<queue::DevxQp, DevxError>, u32) {
    let caps = caps::query(&mut o.d).unwrap();
    let cmem = o.d.alloc_mem(CqSpec::mem_needed(4).div_ceil(4096) * 4096, 4096).unwrap();
    let c =
        queue::create_cq(&mut o.d, &caps, o.uar, &CqSpec { log_cqes: 4, overrun_ignore: false, mem: cmem }).unwrap();
    let spec = QpSpec {
        log_sq_wqebbs: 4,
        log_rq: Some(2),
        log_rq_stride: 5,
        cd,
        cqn_snd: c.cqn,
        cqn_rcv: c.cqn,
        pd: o.d.pdn(),
        mem: o.d.alloc_mem(16384, 4096).unwrap(),
    };
    (queue::create_qp(&mut o.d, &caps, o.uar, &spec), c.cqn)
}

#[test]
fn qps_are_made_with_their_roles_and_move_through_their_states_in_order() {
    let mut o = objects();
    let (q, _) = qp_setup(&mut o, pqp::CdRole::MASTER | pqp::CdRole::SLAVE_SEND, None);
    let q = q.expect("the encoder's QP is accepted");
    let mut out = [0u8; 16];
    // RTR before INIT: the QP's state refuses it
    let rtr = pqp::init2rtr_in(&pqp::Init2Rtr {
        qpn: q.qpn,
        remote_qpn: q.qpn,
        mtu: 3,
        log_msg_max: 30,
        next_rcv_psn: 0,
        log_rra_max: 4,
        min_rnr_nak: 12,
        path: pqp::AddressPath {
            port: 1,
            pkey_index: 0,
            grh: true,
            rlid: 0,
            sgid_index: 3,
            hop_limit: 64,
            tclass: 0,
            flow_label: 0,
            rgid: omw_cx_double::gid_of(o.d.host()),
            sl: 0,
            rmac: omw_cx_double::mac_of(o.d.host()),
            udp_sport: 0xC000,
        },
    })
    .unwrap();
    assert_eq!(refused(o.d.obj_modify("INIT2RTR_QP", q.obj, &rtr, &mut out)), status::BAD_QP_STATE);
    // a modify naming another QP number than the object's
    let init = pqp::rst2init_in(&pqp::Rst2Init {
        qpn: q.qpn + 1,
        port: 1,
        pkey_index: 0,
        remote_read: true,
        remote_write: true,
        remote_atomic: true,
        atomic_mode: 3,
    })
    .unwrap();
    assert_eq!(refused(o.d.obj_modify("RST2INIT_QP", q.obj, &init, &mut out)), status::BAD_PARAM);
    // in order: INIT, RTR (to itself, over this port's GID and MAC), RTS
    let init = pqp::rst2init_in(&pqp::Rst2Init {
        qpn: q.qpn,
        port: 1,
        pkey_index: 0,
        remote_read: true,
        remote_write: true,
        remote_atomic: true,
        atomic_mode: 3,
    })
    .unwrap();
    o.d.obj_modify("RST2INIT_QP", q.obj, &init, &mut out).unwrap();
    o.d.obj_modify("INIT2RTR_QP", q.obj, &rtr, &mut out).unwrap();
    let rts = pqp::rtr2rts_in(&pqp::Rtr2Rts {
        qpn: q.qpn,
        next_send_psn: 0,
        ack_timeout: 14,
        retry_count: 7,
        rnr_retry: 7,
        log_sra_max: 4,
    })
    .unwrap();
    o.d.obj_modify("RTR2RTS_QP", q.obj, &rts, &mut out).unwrap();
    let f = o.d.shared_fabric();
    let qa = o.d.qp_addr(q.qpn).unwrap();
    assert_eq!(f.borrow().qp_state(qa).unwrap(), QpState::Rts);
    // 2RST, then RTS is refused until INIT and RTR again
    let rst = pqp::qp_2rst_in(q.qpn).unwrap();
    o.d.obj_modify("2RST_QP", q.obj, &rst, &mut out).unwrap();
    assert_eq!(f.borrow().qp_state(qa).unwrap(), QpState::Reset);
    assert_eq!(refused(o.d.obj_modify("RTR2RTS_QP", q.obj, &rts, &mut out)), status::BAD_QP_STATE);
}

#[test]
fn a_role_or_timestamp_format_the_device_lacks_is_refused() {
    // a device with real-time timestamps only refuses the free-running format omw asks for
    let mut o =
        Objects { d: double_with(CxCaps { qp_ts_format: prm::roce_caps::TS_RT, ..CxCaps::CONNECTX }), ..objects() };
    o.uar = o.d.alloc_uar().unwrap();
    let (q, _) = qp_setup(&mut o, pqp::CdRole::empty(), None);
    assert_eq!(refused(q), status::BAD_PARAM);
    assert_eq!(o.d.refusals().last().map(|r| r.why), Some("ts_format the device does not support"));
    // CORE-Direct roles on a device without `cd`
    let mut o = Objects { d: double_with(CxCaps { cd: false, ..CxCaps::CONNECTX }), ..objects() };
    o.uar = o.d.alloc_uar().unwrap();
    let (q, _) = qp_setup(&mut o, pqp::CdRole::MASTER, None);
    assert_eq!(refused(q), status::BAD_PARAM);
    let (q, _) = qp_setup(&mut o, pqp::CdRole::empty(), None);
    assert!(q.is_ok(), "without a role it is an ordinary QP");
}

/// A CQ of 4 entries made by CREATE_CQ (omw's encoder, `oi` as given), a device QP of the
/// fabric reporting to it, `n` signaled NOPs run: the CQ's status and its ring as the double
/// wrote it.
fn cq_run(oi: bool, n: u16, consumed: Option<u32>) -> (omw_loopback::CqStatus, Vec<u8>, CxDouble) {
    let mut o = objects();
    let (mut input, mem) = cq_input(&mut o, 2);
    prm::set(&mut input, prm::create_cq::OI, oi as u64);
    let mut out = [0u8; 16];
    o.d.obj_create("CREATE_CQ", &input, &mut out).unwrap();
    let cqn = prm::get(&out, prm::create_cq::OUT_CQN).unwrap() as u32;
    let f = o.d.shared_fabric();
    let h = o.d.host();
    let ring = f.borrow_mut().alloc(h, 64 * 16, 4096).unwrap();
    let spec = omw_loopback::DeviceQp {
        pd: omw_loopback::PdId(0),
        sq: omw_loopback::RingAt { base: ring, entries: 16, stride: 64 },
        rq: None,
        cqn_snd: cqn,
        cqn_rcv: cqn,
        managed_send: false,
        managed_recv: false,
        cd_master: false,
        recv_doorbell: None,
    };
    let mut fb = f.borrow_mut();
    let q = omw_loopback::QpAddr::new(h, fb.create_qp_with(h, &spec).unwrap());
    for t in [omw_loopback::Transition::Init, omw_loopback::Transition::Rtr { peer: q }, omw_loopback::Transition::Rts]
    {
        fb.modify_qp(q, t).unwrap();
    }
    for i in 0..n {
        let w = omw_core::mlx5::encode::encode(
            &Wqe::nop(),
            omw_core::mlx5::wqebb::WqeIndex::new(i),
            q.qpn.get(),
            omw_core::mlx5::ctrl::PrevWqe::Other,
            &mut omw_core::mlx5::encode::Unmanaged,
        )
        .unwrap();
        fb.write(h, ring + i as u64 * 64, w.bytes()).unwrap();
    }
    // the first four, then (after the driver says it consumed some) the rest
    fb.ring_doorbell(q, QueueSel::Send, n.min(4)).unwrap();
    fb.settle(10_000);
    drop(fb);
    o.d.sync_cqes();
    if let Some(ci) = consumed {
        o.d.write_dbr(mem.addr + (64 << 2), ci.to_be_bytes());
    }
    let mut fb = f.borrow_mut();
    fb.ring_doorbell(q, QueueSel::Send, n).unwrap();
    fb.settle(10_000);
    drop(fb);
    o.d.sync_cqes();
    let st = f.borrow().cq_status(h, cqn).unwrap();
    let mut ring_bytes = vec![0u8; 64 * 4];
    f.borrow().read(h, mem.addr as u64, &mut ring_bytes).unwrap();
    (st, ring_bytes, o.d)
}

/// (opcode, owner) of each CQE slot and its wqe_counter.
fn slots(ring: &[u8]) -> Vec<(u8, u8, u16)> {
    ring.chunks(64).map(|c| (c[63] >> 4, c[63] & 1, u16::from_be_bytes([c[60], c[61]]))).collect()
}

#[test]
fn a_cq_overruns_a_ring_ahead_of_its_consumer_unless_it_ignores_overrun() {
    // no oi, nothing consumed: four CQEs, then the CQ stops (no fifth, no sixth)
    let (st, ring, _) = cq_run(false, 6, None);
    assert_eq!((st.count, st.overrun), (4, true));
    assert_eq!(slots(&ring), [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)], "first pass: owner bit 0");
    // the doorbell record said two were consumed: room for six
    let (st, ring, _) = cq_run(false, 6, Some(2));
    assert_eq!((st.count, st.overrun), (6, false));
    assert_eq!(slots(&ring)[..2], [(0, 1, 4), (0, 1, 5)], "second pass: owner bit 1, wqe_counter 4 and 5");
    // oi: no bound at all
    let (st, _, _) = cq_run(true, 6, None);
    assert_eq!((st.count, st.overrun), (6, false));
}

#[test]
fn a_doorbell_on_another_uar_page_rings_nothing() {
    let mut b = backend();
    let q = b.create_loopback_qp(Domain::MnPrivate, None).unwrap();
    let mem = b.alloc_memory(4096, 4096).unwrap();
    let k = b.reg_mr(Domain::MnPrivate, mem, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    b.write_local(mem, b"rung").unwrap();
    b.post_send(q, &Wqe::write(mem, k.lkey, 4, mem + 64, k.rkey)).unwrap();
    assert_eq!(b.device().stats().doorbells, 1);
    let d = b.device_mut();
    let other = d.alloc_uar().unwrap();
    let mut ctrl = [0u8; 8];
    ctrl[4..8].copy_from_slice(&(q.get() << 8 | 2).to_be_bytes());
    d.write_uar(other, ctrl);
    assert_eq!((d.stats().doorbells, d.stats().stray_doorbells), (1, 1), "the QP is on the backend's UAR page");
}

/// A window's life on the double as DevxBackend drives it: CREATE_MKEY makes a free window,
/// a type-2 bind posted with the mkey's index binds the model's window, QUERY_MKEY reports that
/// binding (QP, key, span) and, after LOCAL_INV, the window free again; destroying the backend
/// destroys the model window.
#[test]
fn query_mkey_reports_what_the_binds_did() {
    use omw_core::device::{MwBinding, WindowState};
    let mut b = backend();
    let q = b.create_loopback_qp(Domain::CnFacing, None).unwrap();
    let mem = b.alloc_memory(8192, 4096).unwrap();
    let rights = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::MW_BIND;
    let k = b.reg_mr(Domain::CnFacing, mem, 8192, rights).unwrap();
    let w = b.alloc_mw().unwrap();
    assert_eq!(b.mw_binding(w), Some(MwBinding::Unbound));
    assert_eq!(b.mw_span(w), None);
    let new = w.next_key();
    let access = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    b.post_send(q, &Wqe::bind_mw(new.0, mem + 4096, 4096, k.lkey, q.get(), access).with_wr_id(1)).unwrap();
    assert_eq!(poll_one(&mut b, q, QueueSel::Send).map(|c| (c.wr_id, c.status)), Some((1, WcStatus::Success)));
    assert_eq!(b.mw_binding(w), Some(MwBinding::Bound { rkey: new, qpn: q }));
    assert_eq!(b.mw_span(new), Some((mem + 4096, 4096)));
    assert_eq!(b.mw_span(w), None, "the old key covers nothing");
    b.post_send(q, &Wqe::local_inv(new.0).with_wr_id(2)).unwrap();
    assert_eq!(poll_one(&mut b, q, QueueSel::Send).map(|c| (c.wr_id, c.status)), Some((2, WcStatus::Success)));
    assert_eq!(b.mw_binding(new), Some(MwBinding::Unbound));
    assert_eq!((b.window_query_failures(), b.device().refusals()), (0, &[][..]));
    let (fabric, host) = (b.device().shared_fabric(), b.device().host());
    assert!(fabric.borrow().mw_binding(host, w.index()).is_some());
    drop(b);
    assert_eq!(fabric.borrow().mw_binding(host, w.index()), None, "DESTROY_MKEY took the window");
}

/// A CREATE_MKEY that is not a free type-2 window in a PD of this context is refused with
/// the status firmware gives, and nothing is made.
#[test]
fn malformed_window_mkeys_are_refused() {
    use omw_core::mlx5::prm::mkey as omw_mkey;
    let mut d = double();
    let pdn = d.pdn();
    let good = omw_mkey::create_window_in(&omw_mkey::CreateWindow { pdn, key: 3 }).unwrap();
    let mut out = [0u8; prm::create_mkey::OUT_BYTES];
    let ok = d.obj_create("CREATE_MKEY", &good, &mut out);
    assert!(ok.is_ok(), "{ok:?}");
    let index = prm::get(&out, prm::create_mkey::OUT_MKEY_INDEX).unwrap();
    assert!(index > 0);
    let cases: &[(prm::Field, u64, u8)] = &[
        (prm::mkc::FREE, 0, status::BAD_PARAM),
        (prm::mkc::ACCESS_MODE_1_0, 1, status::BAD_PARAM),
        (prm::mkc::UMR_EN, 0, status::BAD_PARAM),
        (prm::mkc::EN_RINVAL, 0, status::BAD_PARAM),
        (prm::mkc::QPN, 0x1100, status::BAD_PARAM),
        (prm::mkc::TRANSLATIONS_OCTWORD_SIZE, 0, status::BAD_PARAM),
        (prm::mkc::PD, 0x7777, status::BAD_RES),
    ];
    for (f, v, want) in cases {
        let mut bad = good;
        prm::set(&mut bad, *f, *v);
        match d.obj_create("CREATE_MKEY", &bad, &mut out) {
            Err(DevxError::Command { status: s, .. }) => assert_eq!(s, *want, "{}", f.name),
            other => panic!("{} = {v:#x}: {other:?}", f.name),
        }
    }
    // too short an input, too short an output
    assert!(matches!(
        d.obj_create("CREATE_MKEY", &good[..100], &mut out),
        Err(DevxError::Command { status: status::BAD_INP_LEN, .. })
    ));
    assert!(matches!(
        d.obj_create("CREATE_MKEY", &good, &mut out[..8]),
        Err(DevxError::Command { status: status::BAD_OUTP_LEN, .. })
    ));
    assert_eq!(d.refusals().len(), cases.len() + 2);
    // QUERY_MKEY naming another index than its object's is refused too
    let obj = d.obj_create("CREATE_MKEY", &good, &mut out).unwrap();
    let mine = prm::get(&out, prm::create_mkey::OUT_MKEY_INDEX).unwrap() as u32;
    let mut ans = [0u8; prm::query_mkey::OUT_BYTES];
    assert!(d.obj_query("QUERY_MKEY", obj, &omw_mkey::query_mkey_in(mine).unwrap(), &mut ans).is_ok());
    assert_eq!(prm::get(&ans, prm::mkc::FREE), Some(1));
    assert!(matches!(
        d.obj_query("QUERY_MKEY", obj, &omw_mkey::query_mkey_in(mine + 1).unwrap(), &mut ans),
        Err(DevxError::Command { status: status::BAD_PARAM, .. })
    ));
}
