//! The DEVX command sequences, exactly: which calls, in which order, with which bytes.

use super::api::{DevxApi, MemRange, UMEM_ACCESS_LOCAL_WRITE};
use super::cm::{self, CmQpAttr};
use super::mock::{Call, RecordingDevx};
use super::queue::{self, CqSpec, QpSpec};
use super::{caps, doorbell, DevxError};
use omw_core::mlx5::ctrl::{CeSe, CtrlSeg, FmCeSe};
use omw_core::mlx5::prm::hca_cap::{self, HcaCaps, MissingCap, QUERY_HCA_CAP_OUT_LEN};
use omw_core::mlx5::prm::{cq, qp};
use omw_core::mlx5::wqebb::WqeIndex;
use zerocopy::IntoBytes;

fn caps_out(general: &[(usize, u8)], atomic: &[(usize, u8)]) -> (Vec<u8>, Vec<u8>) {
    let mut g = vec![0u8; QUERY_HCA_CAP_OUT_LEN];
    let mut a = vec![0u8; QUERY_HCA_CAP_OUT_LEN];
    for (i, v) in general {
        g[*i] |= v;
    }
    for (i, v) in atomic {
        a[*i] |= v;
    }
    (g, a)
}

/// Capability bits as hca_cap.rs places them in the QUERY_HCA_CAP output (golden-tested in
/// core/tests/mlx5_golden.rs): roce 83/0x04, atomic 83/0x02, cd 85/0x08, imaicl 86/0x40, rc
/// 87/0x01; log_max_qp_sz (0x88) byte 16+17, log_max_cq_sz (0xc8) byte 16+25; sq_ts_format
/// free running only (0 at byte 16+136); atomic caps: host-endian 8-byte atomics (mode 1)
/// 24/0x40, operations 35/0x0f, size_qp 39/0x08; RoCE caps: qp_ts_format free running and
/// real time (2 at byte 16+3), so QPs are created with `ts_format` DEFAULT (1).
pub(super) fn capable() -> RecordingDevx {
    let mut d = RecordingDevx::new(0x77);
    let (g, a) = caps_out(
        &[(83, 0x06), (85, 0x08), (86, 0x40), (87, 0x01), (33, 15), (41, 22)],
        &[(24, 0x40), (35, 0x0f), (39, 0x08)],
    );
    d.outputs.insert(caps::GENERAL, g);
    d.outputs.insert(caps::ATOMIC, a);
    d.outputs.insert(caps::ROCE, caps_out(&[(19, 0x02)], &[]).0);
    d
}

#[test]
fn capability_query_is_general_then_atomic_then_roce() {
    let mut d = capable();
    let c = caps::query(&mut d).unwrap();
    assert!(c.cd && c.imaicl && c.rc && c.roce && c.masked_fetch_add_8b());
    assert_eq!((c.log_max_qp_sz, c.log_max_cq_sz), (15, 22));
    assert_eq!((c.sq_ts_format, c.roce_qp_ts_format, c.qp_ts_format()), (0, Some(2), 1));
    assert_eq!(
        d.calls,
        [
            Call::GeneralCmd {
                command: caps::GENERAL,
                input: hca_cap::query_hca_cap_in(hca_cap::CAP_GENERAL).unwrap().to_vec()
            },
            Call::GeneralCmd {
                command: caps::ATOMIC,
                input: hca_cap::query_hca_cap_in(hca_cap::CAP_ATOMIC).unwrap().to_vec()
            },
            Call::GeneralCmd {
                command: caps::ROCE,
                input: hca_cap::query_hca_cap_in(hca_cap::CAP_ROCE).unwrap().to_vec()
            },
        ]
    );
    // a refused RoCE query names that command
    let mut d = capable();
    d.refuse.insert(caps::ROCE, (0x02, 0x1234));
    let e = caps::query(&mut d).unwrap_err();
    assert!(matches!(e, DevxError::Command { command: caps::ROCE, status: 2, .. }), "{e:?}");
    // no atomics, no RoCE: neither is queried, masked FA is missing, and the QPs take the
    // SQs' timestamp format (real time only here: DEFAULT)
    let mut d = RecordingDevx::new(1);
    d.outputs.insert(caps::GENERAL, caps_out(&[(85, 0x08), (86, 0x40), (87, 0x01), (16 + 136, 0x40)], &[]).0);
    let c = caps::query(&mut d).unwrap();
    assert_eq!(d.calls.len(), 1);
    assert_eq!(c.missing_for_offload(), Some(MissingCap::MaskedFetchAdd));
    assert_eq!((c.roce, c.sq_ts_format, c.qp_ts_format()), (false, 1, 1));
}

#[test]
fn a_refused_query_reports_status_and_syndrome() {
    let mut d = RecordingDevx::new(1);
    d.refuse.insert(caps::GENERAL, (0x03, 0x00C0_FFEE));
    let e = caps::query(&mut d).unwrap_err();
    assert!(matches!(e, DevxError::Command { opcode: 0x100, status: 3, syndrome: 0x00C0_FFEE, .. }), "{e:?}");
    assert!(e.to_string().contains("QUERY_HCA_CAP(general)") && e.to_string().contains("0x00c0ffee"), "{e}");
}

fn cq_spec() -> CqSpec {
    CqSpec { log_cqes: 6, overrun_ignore: true, mem: MemRange { addr: 0x10_0000, len: CqSpec::mem_needed(6) } }
}

fn qp_spec(cqn: u32) -> QpSpec {
    let mut s = QpSpec {
        log_sq_wqebbs: 7,
        log_rq: Some(4),
        log_rq_stride: 3,
        cd: qp::CdRole::MASTER | qp::CdRole::SLAVE_RECEIVE,
        cqn_snd: cqn,
        cqn_rcv: cqn,
        pd: 0x77,
        mem: MemRange { addr: 0x20_0000, len: 0 },
    };
    s.mem.len = s.mem_needed();
    s
}

#[test]
fn cq_and_qp_creation_commands() {
    let mut d = capable();
    let c = caps::query(&mut d).unwrap();
    d.calls.clear();
    d.outputs.insert("CREATE_CQ", vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0x00, 0x00, 0x2a, 0, 0, 0, 0]);
    d.outputs.insert("CREATE_QP", vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x23, 0x45, 0, 0, 0, 0]);
    let uar = d.alloc_uar().unwrap();
    let cq = queue::create_cq(&mut d, &c, uar, &cq_spec()).unwrap();
    assert_eq!(cq.cqn, 0x2a);
    let q = queue::create_qp(&mut d, &c, uar, &qp_spec(cq.cqn)).unwrap();
    assert_eq!(q.qpn, 0x01_2345);
    // layout of the QP umem: RQ (16 × 128 B) | SQ (128 × 64 B) | doorbell record
    assert_eq!((q.rq.addr, q.rq.len, q.sq.addr, q.sq.len, q.dbr_addr), (0x20_0000, 2048, 0x20_0800, 8192, 0x20_2800));
    let cq_umem = match d.calls[1] {
        Call::UmemReg { umem, mem, access } => {
            assert_eq!((mem, access), (cq_spec().mem, UMEM_ACCESS_LOCAL_WRITE));
            umem
        }
        ref c => panic!("{c:?}"),
    };
    let want_cq = cq::create_cq_in(&cq::CreateCq {
        log_cq_size: 6,
        uar_page: uar.page_id,
        eqn: 7,
        log_page_size: 0,
        umem_id: cq_umem.umem_id,
        umem_offset: 0,
        dbr_umem_id: cq_umem.umem_id,
        dbr_offset: 64 << 6,
        overrun_ignore: true,
    })
    .unwrap();
    assert_eq!(d.calls[2], Call::QueryEqn(0));
    assert!(matches!(&d.calls[3], Call::ObjCreate { command: "CREATE_CQ", input, .. } if input[..] == want_cq[..]));
    let qp_umem = match d.calls[4] {
        Call::UmemReg { umem, .. } => umem,
        ref c => panic!("{c:?}"),
    };
    let input = d.inputs("CREATE_QP")[0].to_vec();
    let want_qp = qp::create_qp_in(&qp::CreateQp {
        pd: 0x77,
        uar_page: uar.page_id,
        cqn_snd: 0x2a,
        cqn_rcv: 0x2a,
        log_sq_size: 7,
        log_rq_size: Some(4),
        log_rq_stride: 3,
        log_page_size: 0,
        cd: qp::CdRole::MASTER | qp::CdRole::SLAVE_RECEIVE,
        wq_umem_id: qp_umem.umem_id,
        wq_umem_offset: 0,
        dbr_umem_id: qp_umem.umem_id,
        dbr_offset: 0x2800,
        user_index: 0,
        ts_format: 1,
    })
    .unwrap();
    assert_eq!(input, want_qp.to_vec());
    // spot checks against the PRM layout: opcode, cd_master | cd_slave_receive, pd, ts_format
    // DEFAULT from the RoCE capability, cqc.oi
    assert_eq!((&input[0..2], input[171], &input[29..32]), (&[0x05, 0x00][..], 0x05, &[0, 0, 0x77][..]));
    assert_eq!(input[35] >> 6, 1);
    assert_eq!(want_cq[17] & 0x02, 0x02);
    assert_eq!(d.calls.len(), 6);
}

#[test]
fn failures_undo_newest_first() {
    let mut d = capable();
    let c = caps::query(&mut d).unwrap();
    d.calls.clear();
    d.refuse.insert("CREATE_QP", (0x05, 0xBAD));
    let uar = d.alloc_uar().unwrap();
    let e = queue::create_qp(&mut d, &c, uar, &qp_spec(1)).unwrap_err();
    assert!(matches!(e, DevxError::Command { command: "CREATE_QP", status: 5, syndrome: 0xBAD, .. }));
    let umem = match d.calls[1] {
        Call::UmemReg { umem, .. } => umem,
        ref c => panic!("{c:?}"),
    };
    assert_eq!(d.calls.last(), Some(&Call::UmemDereg(umem)));
    // a queue bigger than the device allows is refused before any call
    d.calls.clear();
    let mut big = qp_spec(1);
    big.log_sq_wqebbs = 16;
    big.mem.len = big.mem_needed();
    assert!(matches!(
        queue::create_qp(&mut d, &c, uar, &big),
        Err(DevxError::TooLarge { log2: 16, device_max_log2: 15, .. })
    ));
    let small = CqSpec { log_cqes: 6, overrun_ignore: false, mem: MemRange { addr: 0, len: 100 } };
    assert!(matches!(
        queue::create_cq(&mut d, &c, uar, &small),
        Err(DevxError::MemTooSmall { need: 4160, got: 100, .. })
    ));
    assert!(d.calls.is_empty());
}

fn created_qp(d: &mut RecordingDevx) -> (HcaCaps, queue::DevxQp) {
    let c = caps::query(d).unwrap();
    d.outputs.insert("CREATE_QP", vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 0x00, 0x00, 0x99, 0, 0, 0, 0]);
    let uar = d.alloc_uar().unwrap();
    let q = queue::create_qp(d, &c, uar, &qp_spec(1)).unwrap();
    d.calls.clear();
    (c, q)
}

#[test]
fn external_qp_connection_is_three_modifies_in_order() {
    let mut d = capable();
    let (_, q) = created_qp(&mut d);
    let mut a =
        CmQpAttr { port_num: 1, qp_access_flags: 0b1110, dest_qp_num: 0x321, path_mtu: 5, ..Default::default() };
    a.rq_psn = 0x10;
    a.sq_psn = 0x20;
    a.max_dest_rd_atomic = 16;
    a.max_rd_atomic = 16;
    let init = cm::rst2init(0, &a, qp::ATOMIC_MODE_8B as u8);
    let rtr = cm::init2rtr(0, &a, 30, [2, 0, 0, 0, 0, 1]);
    let rts = cm::rtr2rts(0, &a);
    queue::connect(&mut d, &q, init, rtr, rts).unwrap();
    let names: Vec<_> = d
        .calls
        .iter()
        .map(|c| match c {
            Call::ObjModify { command, obj, .. } => {
                assert_eq!(*obj, q.obj);
                *command
            }
            c => panic!("{c:?}"),
        })
        .collect();
    assert_eq!(names, ["RST2INIT_QP", "INIT2RTR_QP", "RTR2RTS_QP"]);
    // the QP number in every command is the DEVX QP's, whatever the parameters said
    for c in ["RST2INIT_QP", "INIT2RTR_QP", "RTR2RTS_QP"] {
        assert_eq!(&d.inputs(c)[0][9..12], &[0, 0, 0x99], "{c}");
    }
    assert_eq!(d.inputs("RST2INIT_QP")[0], &qp::rst2init_in(&qp::Rst2Init { qpn: 0x99, ..init }).unwrap()[..]);
    assert_eq!(d.inputs("INIT2RTR_QP")[0], &qp::init2rtr_in(&qp::Init2Rtr { qpn: 0x99, ..rtr }).unwrap()[..]);
    assert_eq!(d.inputs("RTR2RTS_QP")[0], &qp::rtr2rts_in(&qp::Rtr2Rts { qpn: 0x99, ..rts }).unwrap()[..]);
    // a refused RTR stops the sequence: no RTS is attempted
    let mut d = capable();
    let (_, q) = created_qp(&mut d);
    d.refuse.insert("INIT2RTR_QP", (0x10, 0x1234));
    let e = queue::connect(&mut d, &q, init, rtr, rts).unwrap_err();
    assert!(matches!(e, DevxError::Command { command: "INIT2RTR_QP", status: 0x10, .. }));
    assert_eq!(d.calls.len(), 2);
}

#[test]
fn doorbells_write_the_record_then_the_uar() {
    let mut d = capable();
    let (_, q) = created_qp(&mut d);
    let ctrl = CtrlSeg::new(0x1234, 0x08, 0, q.qpn, FmCeSe::new(Default::default(), CeSe::CQ_UPDATE), 3, 0);
    let mut c16 = [0u8; 16];
    c16.copy_from_slice(ctrl.as_bytes());
    doorbell::ring_sq(&mut d, &q, WqeIndex::new(0x1235), &c16);
    doorbell::ring_rq(&mut d, &q, 0x1_0007);
    assert_eq!(
        d.calls,
        [
            Call::WriteDbr { addr: q.dbr_addr + 4, value: [0, 0, 0x12, 0x35] },
            Call::WriteUar { uar: q.uar, value: [0x00, 0x12, 0x34, 0x08, 0x00, 0x00, 0x99, 0x03] },
            Call::WriteDbr { addr: q.dbr_addr, value: [0, 0, 0, 0x07] },
        ]
    );
}

#[test]
fn destroy_order() {
    let mut d = capable();
    let (_, q) = created_qp(&mut d);
    queue::destroy_qp(&mut d, q).unwrap();
    assert_eq!(d.calls, [Call::ObjDestroy(q.obj), Call::UmemDereg(q.umem)]);
}

/// A window's commands, exactly: CREATE_MKEY (the kernel's type-2 window context, key bytes
/// counting from 0), QUERY_MKEY naming the index the device answered, on that object; the
/// window objects destroyed, newest last, when the backend goes.
#[test]
fn window_mkeys_are_created_queried_and_destroyed() {
    use super::backend::{DevxBackend, DevxConfig};
    use omw_core::device::{Capabilities, MwBinding, Provision, WindowState};
    use omw_core::mlx5::prm::mkey;
    let mut d = capable();
    let hca = caps::query(&mut d).unwrap();
    let mut cfg = DevxConfig::new(Capabilities::OFFLOAD);
    cfg.ring_arena_bytes = 1 << 20;
    let mut b = DevxBackend::new(d, hca, cfg).unwrap();
    let before = b.device().calls.len();
    let w0 = b.alloc_mw().unwrap();
    let w1 = b.alloc_mw().unwrap();
    assert_eq!(b.mw_binding(w1), Some(MwBinding::Unbound));
    let calls = b.device().calls[before..].to_vec();
    let create = |key| mkey::create_window_in(&mkey::CreateWindow { pdn: 0x77, key }).unwrap().to_vec();
    let [Call::ObjCreate { obj: o0, .. }, Call::ObjCreate { obj: o1, .. }, ..] = calls[..] else { panic!("{calls:?}") };
    assert_eq!(
        calls,
        [
            Call::ObjCreate { command: "CREATE_MKEY", input: create(0), obj: o0 },
            Call::ObjCreate { command: "CREATE_MKEY", input: create(1), obj: o1 },
            Call::ObjQuery { command: "QUERY_MKEY", obj: o1, input: mkey::query_mkey_in(w1.index()).unwrap().to_vec() },
        ]
    );
    assert_eq!((w0.key(), w1.key()), (0, 1));
    assert_ne!(w0.index(), w1.index());
    let before = b.device().calls.len();
    b.destroy_windows().unwrap();
    assert_eq!(b.device().calls[before..], [Call::ObjDestroy(o0), Call::ObjDestroy(o1)]);
}
