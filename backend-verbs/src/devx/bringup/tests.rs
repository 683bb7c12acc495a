//! The bring-up steps against the recording mock: the QPs each step creates (their
//! CORE-Direct roles), the WQEs it writes into which ring, decoded, and the doorbells, in
//! order. The mock executes nothing, so every step must end unknown — never an answer it did
//! not see — and leave nothing behind.

use super::*;
use crate::devx::caps;
use crate::devx::mock::{Call, RecordingDevx};
use crate::devx::sequence_tests::capable;
use omw_core::mlx5::decode::{decode, Decoded, Mlx5Op};
use omw_core::mlx5::prm::{bits, qp as pq};

fn mock() -> (RecordingDevx, HcaCaps) {
    let mut d = capable();
    d.number_objects = true;
    let c = caps::query(&mut d).unwrap();
    d.calls.clear();
    (d, c)
}

/// Run `f` on a rig over the mock; the mock and what was printed.
fn on_mock<T>(f: impl FnOnce(&mut Rig<'_, RecordingDevx>) -> T) -> (RecordingDevx, T, String) {
    let (mut d, c) = mock();
    let mut out = Vec::new();
    let t = {
        let mut rig = Rig::new(&mut d, c, Patience::NONE, &mut out).unwrap();
        f(&mut rig)
    };
    (d, t, String::from_utf8(out).unwrap())
}

/// A created QP: its number (as the numbering mock answered), roles (master, slave_send,
/// slave_receive) and whether it has a receive queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Created {
    qpn: u32,
    roles: (u64, u64, u64),
    rq: bool,
}

fn created(d: &RecordingDevx) -> (Vec<Created>, Vec<u32>) {
    let (mut qps, mut cqs, mut n) = (Vec::new(), Vec::new(), 0u32);
    for c in &d.calls {
        if let Call::ObjCreate { command, input, .. } = c {
            n += 1;
            match *command {
                "CREATE_CQ" => cqs.push(0x400 + n),
                "CREATE_QP" => {
                    let f = |fl: omw_core::mlx5::prm::Field| bits::get(input, fl.at(pq::QPC_BASE)).unwrap();
                    qps.push(Created {
                        qpn: 0x1100 + n,
                        roles: (f(pq::qpc::CD_MASTER), f(pq::qpc::CD_SLAVE_SEND), f(pq::qpc::CD_SLAVE_RECEIVE)),
                        rq: f(pq::qpc::RQ_TYPE) == pq::RQ_TYPE_REGULAR,
                    });
                }
                _ => {}
            }
        }
    }
    (qps, cqs)
}

/// Every send WQE the step stored (whole WQEBBs that decode), with its call position.
fn wqes(d: &RecordingDevx) -> Vec<(usize, Decoded)> {
    d.calls
        .iter()
        .enumerate()
        .filter_map(|(i, c)| match c {
            Call::WriteMem { bytes, .. } if bytes.len() >= WQEBB && bytes.len() % WQEBB == 0 => {
                decode(bytes).ok().map(|w| (i, w))
            }
            _ => None,
        })
        .collect()
}

fn ops_of(d: &RecordingDevx, qpn: u32) -> Vec<Mlx5Op> {
    wqes(d).into_iter().filter(|(_, w)| w.qpn == qpn).map(|(_, w)| w.op).collect()
}

/// The positions of UAR doorbell writes whose control segment names `qpn`.
fn rung(d: &RecordingDevx, qpn: u32) -> Vec<usize> {
    d.calls
        .iter()
        .enumerate()
        .filter_map(|(i, c)| match c {
            Call::WriteUar { value, .. }
                if u32::from_be_bytes([value[4], value[5], value[6], value[7]]) >> 8 == qpn =>
            {
                Some(i)
            }
            _ => None,
        })
        .collect()
}

/// Every object created was destroyed, every umem deregistered.
fn all_torn_down(d: &RecordingDevx) {
    let made = d.calls.iter().filter(|c| matches!(c, Call::ObjCreate { .. })).count();
    let gone = d.calls.iter().filter(|c| matches!(c, Call::ObjDestroy(_))).count();
    let reg = d.calls.iter().filter(|c| matches!(c, Call::UmemReg { .. })).count();
    let dereg = d.calls.iter().filter(|c| matches!(c, Call::UmemDereg(_))).count();
    assert_eq!((made, reg), (gone, dereg), "everything a step created is destroyed");
}

#[test]
fn on_a_device_that_executes_nothing_every_question_stays_unknown() {
    let (d, f, out) = on_mock(questions);
    assert_eq!(f.answers(), DeviceAnswers::UNKNOWN, "{out}");
    assert_eq!(f.notes().len(), 5);
    for q in Question::ALL {
        assert!(out.contains(&format!("== {}", q.key())), "{out}");
    }
    assert!(out.contains("== recv_publish"), "{out}");
    assert_eq!(f.recv_publish.answer(), None, "{out}");
    assert!(out.contains("== unchecked_unbind"), "{out}");
    assert_eq!(f.unchecked_unbind.answer(), None, "{out}");
    assert_eq!(out.matches("=> unknown").count(), 7, "{out}");
    all_torn_down(&d);
    // the profile says so, with the reasons as comments, and parses back
    let p = f.profile("mlx5_0", "16.35.2000", Timestamp::from_unix(0));
    let notes = f.notes();
    let text = p.to_text(&notes);
    assert_eq!(Profile::parse(text.as_bytes()), Ok(p));
    assert!(text.contains(&format!("#   {}", f.foreign_bind.reason().unwrap())), "{text}");
}

/// `recv_publish`: R's receive written but not published (its record stays 0 until the loop
/// WRITE), the loop WRITE aimed at R's record with an MR's rkey, and the CPU's store of the
/// record only as the control after it.
#[test]
fn recv_publish_writes_the_record_by_dma_before_the_cpu_does() {
    let (d, f, out) = on_mock(|rig| rig.step(recv_publish::run));
    assert!(matches!(f, Finding::Unknown(_)), "{out}");
    let (qps, _) = created(&d);
    let (r, l) = (qps[0], qps[2]);
    assert!(r.rq && r.roles == (0, 0, 0));
    let writes: Vec<Mlx5Op> = ops_of(&d, l.qpn);
    let record = match writes[..] {
        [Mlx5Op::Write { remote, local: Some(l), .. }] if l.length == 4 => remote as usize,
        _ => panic!("{writes:?}"),
    };
    // R's record: no store before the loop WRITE was rung, the CPU's control (1) after it
    let loop_rung = rung(&d, l.qpn)[0];
    let record_stores: Vec<(usize, [u8; 4])> = d
        .calls
        .iter()
        .enumerate()
        .filter_map(|(i, c)| match c {
            Call::WriteDbr { addr, value } if *addr == record => Some((i, *value)),
            _ => None,
        })
        .collect();
    assert_eq!(record_stores.len(), 1, "{out}");
    assert!(record_stores[0].0 > loop_rung && record_stores[0].1 == 1u32.to_be_bytes(), "{out}");
    all_torn_down(&d);
}

#[test]
fn wait_prefetch_gates_a_write_and_rewrites_it_while_gated() {
    let (d, f, out) = on_mock(|rig| rig.step(wait_prefetch::run));
    assert!(matches!(f, Finding::Unknown(_)), "{out}");
    let (qps, cqs) = created(&d);
    let [a, b] = [qps[0], qps[1]];
    assert_eq!((a.roles, b.roles), ((1, 0, 0), (0, 0, 0)));
    // B's send CQ: the second CQ made (A's first)
    let b_cq = cqs[1];
    let ops = ops_of(&d, a.qpn);
    let mut i = 0;
    for (t, gap) in wait_prefetch::GAPS.into_iter().enumerate() {
        assert!(matches!(ops[i], Mlx5Op::Wait { cqn, pi } if cqn == b_cq && pi.get() == t as u32 + 1), "{:?}", ops[i]);
        assert!(ops[i + 1..=i + gap].iter().all(|o| matches!(o, Mlx5Op::Nop)));
        assert!(matches!(ops[i + gap + 1], Mlx5Op::Write { .. }), "{:?}", ops[i + gap + 1]);
        i += gap + 2;
    }
    assert_eq!(i, ops.len());
    // each WRITE's raddr is rewritten by one byte, after A was rung and before B's NOP
    let writes: Vec<(usize, u64)> = wqes(&d)
        .into_iter()
        .filter_map(|(k, w)| match w.op {
            Mlx5Op::Write { remote, .. } if w.qpn == a.qpn => Some((k, remote)),
            _ => None,
        })
        .collect();
    let stores: Vec<(usize, u8)> = d
        .calls
        .iter()
        .enumerate()
        .filter_map(|(k, c)| match c {
            Call::WriteMem { bytes, .. } if bytes.len() == 1 => Some((k, bytes[0])),
            _ => None,
        })
        .collect();
    let (a_rung, b_rung) = (rung(&d, a.qpn), rung(&d, b.qpn));
    assert_eq!((stores.len(), writes.len(), b_rung.len()), (4, 4, 4));
    for ((wk, x), (sk, byte)) in writes.iter().zip(&stores) {
        let y = x + 0x100;
        assert_eq!(*byte, (y >> 8) as u8, "the byte that turns X into Y");
        assert_eq!((x >> 8) as u8 ^ byte, 1, "X and Y differ in one bit of that byte");
        assert!(a_rung.iter().any(|r| r > wk && r < sk), "rung before the rewrite");
        assert!(b_rung.iter().any(|r| r > sk), "the gate opens after it");
    }
    assert!(ops_of(&d, b.qpn).iter().all(|o| matches!(o, Mlx5Op::Nop)));
    all_torn_down(&d);
}

#[test]
fn recv_enable_posts_a_receive_by_doorbell_then_a_recv_en() {
    let (d, f, out) = on_mock(|rig| rig.step(recv_enable::run));
    assert!(matches!(f, Finding::Unknown(_)), "{out}");
    let (qps, _) = created(&d);
    let [r, s, m, mp] = [qps[0], qps[1], qps[2], qps[3]];
    assert_eq!((r.roles, r.rq), ((0, 0, 1), true));
    assert_eq!((s.roles, m.roles, mp.roles), ((0, 0, 0), (1, 0, 0), (0, 0, 0)));
    // the receive: one data segment of 64 bytes, published by the receive doorbell word (1)
    let recv = d
        .calls
        .iter()
        .position(|c| matches!(c, Call::WriteMem { bytes, .. } if bytes.len() == 16 << LOG_RQ_STRIDE && bytes[..4] == 64u32.to_be_bytes()))
        .expect("a receive WQE");
    let published =
        d.calls.iter().position(|c| matches!(c, Call::WriteDbr { value, .. } if *value == 1u32.to_be_bytes())).unwrap();
    let send = rung(&d, s.qpn)[0];
    assert!(recv < published && published < send, "receive published before the SEND is rung");
    assert!(matches!(ops_of(&d, s.qpn)[..], [Mlx5Op::Send { local: Some(l), .. }] if l.length == 64));
    // no data landed on the mock: M enables R's first receive
    assert!(
        matches!(ops_of(&d, m.qpn)[..], [Mlx5Op::RecvEn { qpn, max_index }] if qpn == r.qpn && max_index.get() == 1)
    );
    assert!(rung(&d, m.qpn)[0] > send);
    all_torn_down(&d);
}

#[test]
fn send_en_unit_lays_a_four_wqebb_read_before_two_writes() {
    let (d, f, out) = on_mock(|rig| rig.step(send_en_unit::run));
    assert!(matches!(f, Finding::Unknown(_)), "{out}");
    let (qps, _) = created(&d);
    let [m, b] = [qps[0], qps[1]];
    assert_eq!((m.roles, b.roles), ((1, 0, 0), (0, 1, 0)));
    let on_b: Vec<Decoded> = wqes(&d).into_iter().map(|(_, w)| w).filter(|w| w.qpn == b.qpn).collect();
    let at: Vec<(u16, u8)> = on_b.iter().map(|w| (w.index.get(), w.ds)).collect();
    assert_eq!(at, [(0, 16), (4, 3), (5, 3)], "W0 is four WQEBBs, W1 at 4, W2 at 5");
    assert!(matches!(on_b[0].op, Mlx5Op::ScatterRead { sges, .. } if sges.as_slice().len() == send_en_unit::W0_SGES));
    // B never rung (a doorbell may release a slave queue too): only M's SEND_ENs, to 4 then 5
    assert!(rung(&d, b.qpn).is_empty(), "no doorbell on the slave");
    let ens: Vec<u16> = ops_of(&d, m.qpn)
        .into_iter()
        .map(|o| match o {
            Mlx5Op::SendEn { qpn, max_index } if qpn == b.qpn => max_index.get(),
            o => panic!("{o:?}"),
        })
        .collect();
    assert_eq!(ens, send_en_unit::ENABLES);
    assert_eq!(rung(&d, m.qpn).len(), 2);
    all_torn_down(&d);
}

#[test]
fn self_enable_rings_only_the_enable_of_itself() {
    let (d, f, out) = on_mock(|rig| rig.step(self_enable::run));
    assert!(matches!(f, Finding::Unknown(r) if r.contains("did not start")), "{out}");
    let (qps, _) = created(&d);
    let q = qps[0];
    assert_eq!(q.roles, (1, 1, 0));
    let on_q: Vec<Decoded> = wqes(&d).into_iter().map(|(_, w)| w).filter(|w| w.qpn == q.qpn).collect();
    assert!(matches!(on_q[0].op, Mlx5Op::SendEn { qpn, max_index } if qpn == q.qpn && max_index.get() == 3));
    assert!(on_q[1..].iter().all(|w| matches!(w.op, Mlx5Op::Write { .. })) && on_q.len() == 4);
    // the doorbell: record 1, the SEND_EN's control segment to the UAR
    let uar = rung(&d, q.qpn);
    assert_eq!(uar.len(), 1);
    assert!(matches!(d.calls[uar[0] - 1], Call::WriteDbr { value, .. } if value == 1u32.to_be_bytes()));
    match &d.calls[uar[0]] {
        Call::WriteUar { value, .. } => assert_eq!(value[3], omw_core::mlx5::opcode::SEND_EN),
        c => panic!("{c:?}"),
    }
    all_torn_down(&d);
}

#[test]
fn foreign_bind_posts_a_bind_on_a_naming_b() {
    let (d, f, out) = on_mock(|rig| rig.step(foreign_bind::run));
    assert_eq!(f, Finding::Unknown("the bind never completed"), "{out}");
    let (qps, _) = created(&d);
    assert!(qps.iter().all(|q| q.roles == (0, 0, 0)) && qps.len() == 4);
    let (a, b) = (qps[0], qps[2]);
    let mw = d.calls.iter().find_map(|c| if let Call::AllocMw(k) = c { Some(*k) } else { None }).unwrap();
    let binds: Vec<Decoded> = wqes(&d).into_iter().map(|(_, w)| w).collect();
    assert_eq!(binds.len(), 1, "no READ without a completed bind");
    assert_eq!(binds[0].qpn, a.qpn, "posted on A");
    match binds[0].op {
        Mlx5Op::Bind { qpn, mkey, new_key, length, access, .. } => {
            assert_eq!((qpn, length, access), (b.qpn, 4096, AccessFlags::REMOTE_READ), "naming B");
            // rdma-core's layout: the window named by the key it holds, the new key byte apart
            assert_eq!(mkey, mw, "the window by its current rkey");
            assert_ne!(new_key, mw as u8, "a new key byte");
        }
        o => panic!("{o:?}"),
    }
    // the window lives where the QPs and the MR are: the CN-facing PD, the one CREATE_QP names
    assert!(d.calls.iter().any(
        |c| matches!(c, Call::RegMr { domain: Domain::CnFacing, access, .. } if access.contains(AccessFlags::MW_BIND))
    ));
    all_torn_down(&d);
}

#[test]
fn a_refused_command_is_unknown_with_the_error_printed() {
    let (mut d, c) = mock();
    d.refuse.insert("CREATE_QP", (0x05, 0x1234));
    let mut out = Vec::new();
    let f = {
        let mut rig = Rig::new(&mut d, c, Patience::NONE, &mut out).unwrap();
        rig.step(self_enable::run)
    };
    let out = String::from_utf8(out).unwrap();
    assert_eq!(f, Finding::Unknown(CALL_FAILED));
    assert!(out.contains("FAILED: PRM command CREATE_QP") && out.contains("0x00001234"), "{out}");
    all_torn_down(&d);
}
