//! Arming an mlx5-form chain on DEVX queues (`arm.rs`), against the recording mock: the exact
//! bytes stored into the umem rings, the receive WQEs, the doorbells and their order, the
//! wrap at a ring's end, and refusals before any device call.

use super::api::{DevxApi, MemRange};
use super::arm::{self, ChainQps, INVALID_LKEY};
use super::mock::{Call, RecordingDevx};
use super::queue::{self, CqSpec, DevxCq, DevxQp, QpSpec};
use super::sequence_tests::capable;
use super::{caps, DevxError};
use omw_core::chain::alloc::build_alloc_chain;
use omw_core::chain::builder::ChainEnv;
use omw_core::chain::free::build_free_chain;
use omw_core::chain::mlx5::{self as mchain, Mlx5Chain, Mlx5Queues};
use omw_core::chain::{ChainLayout, Ring};
use omw_core::mlx5::decode::{decode, Mlx5Op};
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::mlx5::wqebb::WqeIndex;

const LOOP_QPN: u32 = 0x1001;
const MGMT_QPN: u32 = 0x1002;
const CQNS: [u32; 3] = [0x31, 0x32, 0x33];
/// The protection domain the chain QPs are created in (the mock does not check it).
const PDN: u32 = 0x77;
/// Receive stride 16 << 5 = 512 bytes: 32 data segments (the chains' RECV has up to 25).
const LOG_RQ_STRIDE: u8 = 5;
const LOG_RQ: u8 = 2;

fn env(g: u8) -> ChainEnv {
    ChainEnv::example(4096, 16, g, [LOOP_QPN, MGMT_QPN, 0x1003]).expect("valid geometry")
}

fn cqn_out(n: u32) -> Vec<u8> {
    let mut o = vec![0u8; 16];
    o[8..12].copy_from_slice(&n.to_be_bytes());
    o
}

struct Setup {
    d: RecordingDevx,
    loop_qp: DevxQp,
    mgmt_qp: DevxQp,
    cqs: [DevxCq; 3],
    layout: ChainLayout,
    chain: Mlx5Chain,
}

impl Setup {
    fn qps(&self) -> ChainQps<'_> {
        ChainQps { loop_qp: &self.loop_qp, mgmt_qp: &self.mgmt_qp, cqs: [&self.cqs[0], &self.cqs[1], &self.cqs[2]] }
    }
}

/// Options for the queues a setup creates (the defaults fit the chain).
#[derive(Clone, Copy)]
struct Opts {
    loop_cd: CdRole,
    mgmt_cd: CdRole,
    /// Added to the chain's log2 ring sizes [loop, mgmt].
    log_delta: [i8; 2],
    log_rq_stride: u8,
    mgmt_cqn_rcv: u32,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            loop_cd: CdRole::MASTER | CdRole::SLAVE_SEND,
            // the management ring WAITs on its own send CQ and SEND_ENs the loop ring: a master too
            mgmt_cd: CdRole::MASTER | CdRole::SLAVE_SEND | CdRole::SLAVE_RECEIVE,
            log_delta: [0, 0],
            log_rq_stride: LOG_RQ_STRIDE,
            mgmt_cqn_rcv: CQNS[2],
        }
    }
}

fn setup_with(layout: ChainLayout, o: Opts) -> Setup {
    let mut d = capable();
    let c = caps::query(&mut d).unwrap();
    let uar = d.alloc_uar().unwrap();
    let cqs = [0usize, 1, 2].map(|i| {
        d.outputs.insert("CREATE_CQ", cqn_out(CQNS[i]));
        let mem = MemRange { addr: 0x100_0000 + i * 0x1_0000, len: CqSpec::mem_needed(6) };
        queue::create_cq(&mut d, &c, uar, &CqSpec { log_cqes: 6, overrun_ignore: true, mem }).unwrap()
    });
    let wqebbs = mchain::ring_wqebbs(&layout).unwrap();
    let log = |r: usize| (wqebbs[r].trailing_zeros() as i8 + o.log_delta[r]) as u8;
    let mut qp = |qpn: u32, addr: usize, spec: QpSpec| {
        d.outputs.insert("CREATE_QP", cqn_out(qpn));
        let mut spec = spec;
        spec.mem = MemRange { addr, len: spec.mem_needed() };
        queue::create_qp(&mut d, &c, uar, &spec).unwrap()
    };
    let loop_qp = qp(
        LOOP_QPN,
        0x200_0000,
        QpSpec {
            log_sq_wqebbs: log(0),
            log_rq: None,
            log_rq_stride: 0,
            cd: o.loop_cd,
            cqn_snd: CQNS[0],
            cqn_rcv: CQNS[0],
            pd: PDN,
            mem: MemRange { addr: 0, len: 0 },
        },
    );
    let mgmt_qp = qp(
        MGMT_QPN,
        0x300_0000,
        QpSpec {
            log_sq_wqebbs: log(1),
            log_rq: Some(LOG_RQ),
            log_rq_stride: o.log_rq_stride,
            cd: o.mgmt_cd,
            cqn_snd: CQNS[1],
            cqn_rcv: o.mgmt_cqn_rcv,
            pd: PDN,
            mem: MemRange { addr: 0, len: 0 },
        },
    );
    let queues = Mlx5Queues::new(arm::cq_numbers(&loop_qp, &mgmt_qp), [loop_qp.sq.addr as u64, mgmt_qp.sq.addr as u64]);
    let chain = Mlx5Chain::build(&layout, queues).unwrap_or_else(|_| {
        // a chain for the default queues (when the options make the DEVX numbers unusable)
        let q = Mlx5Queues::new(CQNS, queues.ring_bases);
        Mlx5Chain::build(&layout, q).unwrap()
    });
    d.calls.clear();
    Setup { d, loop_qp, mgmt_qp, cqs, layout, chain }
}

fn chains() -> Vec<(&'static str, u8, ChainLayout)> {
    let mut v = Vec::new();
    for g in 2..=4 {
        let e = env(g);
        v.push(("alloc", g, build_alloc_chain(&e).unwrap()));
        v.push(("free", g, build_free_chain(&e).unwrap()));
    }
    v
}

fn alloc3() -> ChainLayout {
    build_alloc_chain(&env(3)).unwrap()
}

/// The calls arming must make, computed from the chain and the queues' layout: both ring
/// images whole at the rings' starts, `copies` receive WQEs at stride offsets, then the
/// receive doorbell record, then management and loop send doorbells (record, then UAR).
fn check_armed(s: &Setup, copies: u32) {
    let calls = &s.d.calls;
    let (l, m) = (&s.loop_qp, &s.mgmt_qp);
    assert_eq!(calls[0], Call::WriteMem { addr: l.sq.addr, bytes: s.chain.rings[0].to_vec() });
    assert_eq!(calls[1], Call::WriteMem { addr: m.sq.addr, bytes: s.chain.rings[1].to_vec() });
    // the written images are whole laps of the QPs' rings and decode, WQE by WQE, to the chain
    for (r, ring, qp) in [(0, Ring::Loop, l), (1, Ring::Mgmt, m)] {
        let Call::WriteMem { bytes, .. } = &calls[r] else { unreachable!() };
        assert_eq!(bytes.len(), qp.sq.len);
        for p in s.chain.placed[r].iter() {
            let d = decode(&bytes[p.pi as usize * 64..]).unwrap();
            assert_eq!(d, s.chain.decode_at(ring, p.pi).unwrap());
            assert_eq!(d.index, WqeIndex::new(p.pi));
            assert_eq!(d.qpn, qp.qpn);
        }
    }
    let stride = 16usize << LOG_RQ_STRIDE;
    for k in 0..copies as usize {
        match &calls[2 + k] {
            Call::WriteMem { addr, bytes } => {
                assert_eq!(*addr, m.rq.addr + k * stride);
                assert_eq!(bytes.len(), stride);
            }
            c => panic!("{c:?}"),
        }
    }
    let mut i = 2 + copies as usize;
    assert_eq!(calls[i], Call::WriteDbr { addr: m.dbr_addr, value: copies.to_be_bytes() });
    i += 1;
    for (r, qp) in [(1usize, m), (0, l)] {
        let pi = s.chain.initial_index[r];
        if pi == 0 {
            continue;
        }
        assert_eq!(calls[i], Call::WriteDbr { addr: qp.dbr_addr + 4, value: (pi as u32).to_be_bytes() });
        match calls[i + 1] {
            Call::WriteUar { uar, value } => {
                assert_eq!(uar, qp.uar);
                // the control segment's first 8 bytes: opmod | wqe_index | opcode, qpn | ds
                // of the WQE whose last WQEBB is just before the first enable index
                let idx = u16::from_be_bytes([value[1], value[2]]);
                let ds = value[7] & 0x3f;
                let wqebbs = (ds as u16 * 16).div_ceil(64);
                assert_eq!(idx + wqebbs, pi, "ring {r}");
                assert_eq!(u32::from_be_bytes([0, value[4], value[5], value[6]]), qp.qpn);
            }
            ref c => panic!("{c:?}"),
        }
        i += 2;
    }
    assert_eq!(calls.len(), i);
}

#[test]
fn arming_stores_the_chain_images_then_rings_receive_management_loop() {
    for (kind, g, layout) in chains() {
        let mut s = setup_with(layout, Opts::default());
        let q = s.qps();
        let (l, m, cqs) = (*q.loop_qp, *q.mgmt_qp, [*q.cqs[0], *q.cqs[1], *q.cqs[2]]);
        let qps = ChainQps { loop_qp: &l, mgmt_qp: &m, cqs: [&cqs[0], &cqs[1], &cqs[2]] };
        let chain = s.chain.clone();
        let armed = arm::arm_chain(&mut s.d, &chain, &qps, 4).unwrap_or_else(|e| panic!("{kind} G={g}: {e}"));
        check_armed(&s, 4);
        assert_eq!(armed.rq_head, 4);
        assert_eq!(armed.sq_pi, [0, 1].map(|r| WqeIndex::new(chain.initial_index[r])));
        // the loop ring starts enabled (it drives the chain); a receive is posted before any send
        assert!(chain.initial_index[0] > 0, "{kind} G={g}");
        // wr_id per WQEBB slot, as a driver maps CQEs back
        for (r, ring) in [(0, Ring::Loop), (1, Ring::Mgmt)] {
            assert_eq!(armed.wr_ids[r].len(), chain.ring_wqebbs(ring));
            for (k, p) in chain.placed[r].iter().enumerate() {
                assert_eq!(armed.wr_ids[r][p.pi as usize], chain.wr_id_of(ring, k));
            }
        }
        let _ = &s.layout;
    }
}

/// A receive WQE read back like the device (and the loopback model): data segments up to the
/// invalid-lkey terminator or the stride's end.
fn parse_recv(b: &[u8]) -> Vec<(u64, u32, u32)> {
    let mut v = Vec::new();
    for seg in b.chunks(16) {
        let be32 = |o: usize| u32::from_be_bytes(seg[o..o + 4].try_into().unwrap());
        if be32(4) == INVALID_LKEY {
            assert_eq!((be32(0), &seg[8..16]), (0, &[0u8; 8][..]), "terminator: byte_count 0, addr 0");
            break;
        }
        v.push((u64::from_be_bytes(seg[8..16].try_into().unwrap()), be32(0), be32(4)));
    }
    v
}

#[test]
fn receive_wqes_decode_to_the_chain_scatter_list() {
    for (kind, g, layout) in chains() {
        let mut s = setup_with(layout, Opts::default());
        let (l, m, cqs) = (s.loop_qp, s.mgmt_qp, s.cqs);
        let chain = s.chain.clone();
        let qps = ChainQps { loop_qp: &l, mgmt_qp: &m, cqs: [&cqs[0], &cqs[1], &cqs[2]] };
        arm::arm_chain(&mut s.d, &chain, &qps, 3).unwrap();
        let want: Vec<_> = chain.recv.iter().map(|r| (r.addr, r.length, r.lkey)).collect();
        assert!(!want.is_empty());
        let recvs: Vec<_> =
            s.d.calls
                .iter()
                .filter_map(|c| match c {
                    Call::WriteMem { addr, bytes } if *addr >= m.rq.addr && *addr < m.rq.addr + m.rq.len => Some(bytes),
                    _ => None,
                })
                .collect();
        assert_eq!(recvs.len(), 3, "{kind} G={g}");
        for b in recvs {
            assert_eq!(parse_recv(b), want, "{kind} G={g}");
            // the terminator is there (fewer entries than the stride holds), the rest zero
            let end = (want.len() + 1) * 16;
            assert_eq!(
                u32::from_be_bytes(b[want.len() * 16 + 4..want.len() * 16 + 8].try_into().unwrap()),
                INVALID_LKEY
            );
            assert!(b[end..].iter().all(|x| *x == 0));
        }
    }
}

#[test]
fn the_waits_name_the_devx_cqs() {
    let mut s = setup_with(alloc3(), Opts::default());
    assert_eq!(arm::cq_numbers(&s.loop_qp, &s.mgmt_qp), CQNS);
    let (l, m, cqs) = (s.loop_qp, s.mgmt_qp, s.cqs);
    let chain = s.chain.clone();
    arm::arm_chain(&mut s.d, &chain, &ChainQps { loop_qp: &l, mgmt_qp: &m, cqs: [&cqs[0], &cqs[1], &cqs[2]] }, 1)
        .unwrap();
    let mut waits = 0;
    for (r, qp) in [(0usize, &l), (1, &m)] {
        let Call::WriteMem { bytes, .. } = &s.d.calls[r] else { panic!() };
        assert_eq!(bytes.len(), qp.sq.len);
        for p in chain.placed[r].iter() {
            if let Mlx5Op::Wait { cqn, .. } = decode(&bytes[p.pi as usize * 64..]).unwrap().op {
                assert!(CQNS.contains(&cqn), "{cqn:#x}");
                waits += 1;
            }
        }
    }
    assert!(waits > 0);
}

#[test]
fn ring_and_receive_stores_wrap_at_the_end() {
    let mut s = setup_with(alloc3(), Opts::default());
    let m = s.mgmt_qp;
    let n = m.sq.len / 64;
    let img: Vec<u8> = (0..4 * 64).map(|i| i as u8).collect();
    // 4 WQEBBs from index n − 2: two at the end, two at the start
    arm::write_ring(&mut s.d, &m, WqeIndex::new(n as u16 - 2), &img).unwrap();
    // lap 1 maps onto lap 0's bytes; the 16-bit index wraps too
    arm::write_ring(&mut s.d, &m, WqeIndex::new(n as u16 + 1), &img[..64]).unwrap();
    arm::write_ring(&mut s.d, &m, WqeIndex::new(0xffff), &img[..64]).unwrap();
    assert_eq!(
        s.d.calls,
        [
            Call::WriteMem { addr: m.sq.addr + (n - 2) * 64, bytes: img[..128].to_vec() },
            Call::WriteMem { addr: m.sq.addr, bytes: img[128..].to_vec() },
            Call::WriteMem { addr: m.sq.addr + 64, bytes: img[..64].to_vec() },
            Call::WriteMem { addr: m.sq.addr + (n - 1) * 64, bytes: img[..64].to_vec() },
        ]
    );
    // receive WQEs from slot 3 of 4: slots 3, 0
    s.d.calls.clear();
    let chain = s.chain.clone();
    let head = arm::write_recvs(&mut s.d, &m, 3, 2, &chain.recv).unwrap();
    assert_eq!(head, 5);
    let stride = 16 << LOG_RQ_STRIDE;
    let w = arm::recv_wqe(stride, &chain.recv);
    assert_eq!(
        s.d.calls,
        [
            Call::WriteMem { addr: m.rq.addr + 3 * stride, bytes: w.clone() },
            Call::WriteMem { addr: m.rq.addr, bytes: w }
        ]
    );
}

/// Arm with queues built from `o` (and the chain possibly tampered with by `f`); the refusal
/// must come before any device call.
fn refused(layout: ChainLayout, o: Opts, f: impl FnOnce(&mut Setup), copies: u32) -> DevxError {
    let mut s = setup_with(layout, o);
    f(&mut s);
    let (l, m, cqs) = (s.loop_qp, s.mgmt_qp, s.cqs);
    let chain = s.chain.clone();
    let e = arm::arm_chain(
        &mut s.d,
        &chain,
        &ChainQps { loop_qp: &l, mgmt_qp: &m, cqs: [&cqs[0], &cqs[1], &cqs[2]] },
        copies,
    )
    .unwrap_err();
    assert!(s.d.calls.is_empty(), "{e:?}: {:?}", s.d.calls);
    e
}

#[test]
fn refusals_come_before_any_device_call() {
    let d = Opts::default();
    // a ring too small for the chain, and one larger than a lap
    let e = refused(alloc3(), Opts { log_delta: [0, -1], ..d }, |_| {}, 1);
    assert!(matches!(e, DevxError::ChainDoesNotFit { what: "send ring (WQEBBs)", need: 16, got: 8 }), "{e:?}");
    let e = refused(alloc3(), Opts { log_delta: [1, 0], ..d }, |_| {}, 1);
    assert!(matches!(e, DevxError::RingNotOneLap { ring: "loop", chain_wqebbs: 128, qp_wqebbs: 256 }), "{e:?}");
    // more receive WQEs than the queue holds; a receive stride too narrow for the scatter list
    let e = refused(alloc3(), d, |_| {}, 5);
    assert!(matches!(e, DevxError::ChainDoesNotFit { what: "receive queue (WQEs)", need: 5, got: 4 }), "{e:?}");
    let e = refused(alloc3(), Opts { log_rq_stride: 2, ..d }, |_| {}, 1);
    assert!(matches!(e, DevxError::ChainDoesNotFit { what: "receive WQE (data segments)", got: 4, .. }), "{e:?}");
    // roles: a loop QP that is not cd_master; a management QP whose RQ is not a slave
    let e = refused(alloc3(), Opts { loop_cd: CdRole::SLAVE_SEND, ..d }, |_| {}, 1);
    assert!(matches!(e, DevxError::WrongRole { qp: "loop", qpn: LOOP_QPN, .. }), "{e:?}");
    let e = refused(alloc3(), Opts { mgmt_cd: CdRole::MASTER | CdRole::SLAVE_SEND, ..d }, |_| {}, 1);
    assert!(
        matches!(e, DevxError::WrongRole { qp: "management", need, .. } if need.contains(CdRole::SLAVE_RECEIVE)),
        "{e:?}"
    );
    // the management ring posts a WAIT and a SEND_EN: a management QP that is no master is refused
    let e = refused(alloc3(), Opts { mgmt_cd: CdRole::SLAVE_SEND | CdRole::SLAVE_RECEIVE, ..d }, |_| {}, 1);
    assert!(matches!(e, DevxError::WrongRole { qp: "management", need, .. } if need.contains(CdRole::MASTER)), "{e:?}");
    // the loop ring enables itself: a loop QP that is not also cd_slave_send is refused
    let e = refused(alloc3(), Opts { loop_cd: CdRole::MASTER, ..d }, |_| {}, 1);
    assert!(matches!(e, DevxError::WrongRole { qp: "loop", need, .. } if need.contains(CdRole::SLAVE_SEND)), "{e:?}");
    // CQs: handed in for the wrong queue; named by the chain for another queue; shared
    let e = refused(alloc3(), d, |s| s.cqs.swap(1, 2), 1);
    assert!(matches!(e, DevxError::WrongCq { queue: "management send", expected: 0x32, got: 0x33 }), "{e:?}");
    let e = refused(
        alloc3(),
        d,
        |s| {
            let q = Mlx5Queues::new([0x31, 0x33, 0x32], s.chain.queues.ring_bases);
            s.chain = Mlx5Chain::build(&s.layout, q).unwrap();
        },
        1,
    );
    assert!(matches!(e, DevxError::WrongCq { queue: "management send", expected: 0x32, got: 0x33 }), "{e:?}");
    let e = refused(
        alloc3(),
        Opts { mgmt_cqn_rcv: CQNS[1], ..d },
        |s| {
            s.cqs[2] = s.cqs[1];
            let q = Mlx5Queues::new([0x31, 0x32, 0x32], s.chain.queues.ring_bases);
            if let Ok(c) = Mlx5Chain::build(&s.layout, q) {
                s.chain = c;
            }
        },
        1,
    );
    assert!(matches!(e, DevxError::SharedCq { cqn: 0x32 }), "{e:?}");
    // a chain built for other ring addresses or other QPs
    let e = refused(
        alloc3(),
        d,
        |s| {
            let q = Mlx5Queues::new(CQNS, [0x999_0000, s.chain.queues.ring_bases[1]]);
            s.chain = Mlx5Chain::build(&s.layout, q).unwrap();
        },
        1,
    );
    assert!(matches!(e, DevxError::RingBaseMismatch { ring: "loop", chain_base: 0x999_0000, .. }), "{e:?}");
    let e = refused(alloc3(), d, |s| s.mgmt_qp.qpn = 0x777, 1);
    assert!(matches!(e, DevxError::WrongQp { ring: "management", chain_qpn: MGMT_QPN, devx_qpn: 0x777 }), "{e:?}");
    // a chain failing validation: a SEND_EN's index one off
    let e = refused(
        alloc3(),
        d,
        |s| {
            let p = s.chain.placed[0]
                .iter()
                .find(|p| matches!(s.chain.decode_at(Ring::Loop, p.pi).unwrap().op, Mlx5Op::SendEn { .. }))
                .copied()
                .unwrap();
            // queue segment after the 16-byte control segment: BE32 max_index at +8
            let off = p.pi as usize * 64 + 16 + 8;
            let v = u32::from_be_bytes(s.chain.rings[0][off..off + 4].try_into().unwrap()) + 1;
            s.chain.rings[0][off..off + 4].copy_from_slice(&v.to_be_bytes());
        },
        1,
    );
    assert!(matches!(e, DevxError::ChainInvalid(_)), "{e:?}");
    assert!(e.to_string().contains("does not validate"));
}
