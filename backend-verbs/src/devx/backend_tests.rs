//! The DEVX backend driven by the core: an offloaded MN provisioned by `MnPlan::provision`, a
//! CN connected and its chains armed by `MnDriver::connect`, completions and recovery by
//! `MnDriver::poll` — against the recording mock, whose memory holds what the backend stored
//! and takes the CQEs a device would write. What this cannot show is a ConnectX executing any
//! of it (docs/MLX5.md).

use super::*;
use crate::devx::mock::{Call, RecordingDevx, PRIVATE_PDN_OFFSET};
use omw_core::chain::builder::chain_wr_id;
use omw_core::chain::ChainKind;
use omw_core::device::ExecutionMode;
use omw_core::mlx5::cqe::{OP_OWN_OFFSET, SOP_DROP_QPN_OFFSET, SYNDROME_OFFSET, WQE_COUNTER_OFFSET};
use omw_core::mlx5::decode::{self, Decoded};
use omw_core::mlx5::prm::hca_cap::{self, atomic};
use omw_core::mlx5::prm::{bits, qp as pq};
use omw_core::mn::driver::MnDriver;
use omw_core::mn::plan::{MnOptions, MnPlan};
use omw_core::mn::provision::PoolSpec;
use omw_core::mn::CnQps;

const PDN: u32 = 0x51;

fn caps() -> HcaCaps {
    HcaCaps {
        cd: true,
        imaicl: true,
        rc: true,
        atomic: true,
        atomic_operations: atomic::OPS_MASKED_FETCH_ADD as u16 | 0x3,
        atomic_size_qp: atomic::SIZE_8_BYTES as u16,
        atomic_8b_endianness_mode: atomic::REQ_MODE_HOST_ENDIANNESS,
        log_max_qp_sz: 15,
        log_max_cq_sz: 22,
        log_max_mkey: 24,
        log_max_msg: 30,
        umr_fence: 0,
        roce: true,
        sq_ts_format: 0,
        rq_ts_format: 0,
        roce_qp_ts_format: Some(hca_cap::TS_CAP_FREE_RUNNING_AND_REAL_TIME),
    }
}

fn backend() -> DevxBackend<RecordingDevx> {
    backend_with(|_| {})
}

fn backend_with(f: impl FnOnce(&mut DevxConfig)) -> DevxBackend<RecordingDevx> {
    let mut cfg = DevxConfig::new(Capabilities::OFFLOAD | Capabilities::MW_BOUNDS_ENFORCED);
    cfg.ring_arena_bytes = 16 << 20;
    cfg.log_cqes = 6;
    f(&mut cfg);
    DevxBackend::new(RecordingDevx::numbered(PDN), caps(), cfg).unwrap()
}

fn cm_attr(dest: u32) -> CmQpAttr {
    let mut gid = [0u8; 16];
    gid[10..].copy_from_slice(&[0xff, 0xff, 192, 0, 2, 9]);
    let path = crate::devx::cm::LocalPath { port: 1, gid_index: 3, gid, mac: [2, 0, 0, 0, 0, 9], mtu: 3 };
    // a CN's connection as rdma_cm describes it: its PSNs, no atomics, a finite RNR retry
    CmQpAttr { qp_access_flags: 0x6, rq_psn: 0x11, sq_psn: 0x22, rnr_retry: 3, ..CmQpAttr::to_self(&path, dest) }
}

struct Mn {
    driver: MnDriver<DevxBackend<RecordingDevx>>,
    qps: CnQps,
}

/// An offloaded MN on DEVX with one CN connected (G = 3) and both chains armed.
fn mn_with_cn() -> Mn {
    mn_on(backend())
}

fn mn_on(b: DevxBackend<RecordingDevx>) -> Mn {
    let plan = MnPlan::decide(b.capabilities(), MnOptions::default()).unwrap();
    assert_eq!(plan.mode, ExecutionMode::Offloaded);
    let spec =
        PoolSpec { chunk_size: 4096, chunks: 16, group_size: 3, max_cns: 4, quota: 0, lease_ns: 0, queue_depth: None };
    let mut driver = plan.provision(b, &spec).unwrap();
    let (alloc_loop, free_loop) = driver.create_loop_qps().unwrap().unwrap();
    let d = driver.mn.chain_ring_depths().unwrap();
    let b = &mut driver.backend;
    let alloc = b.create_cn_qp(Some(d[0][1] as u32)).unwrap();
    let free = b.create_cn_qp(Some(d[1][1] as u32)).unwrap();
    let mut access = heapless::Vec::new();
    for _ in 0..2 {
        access.push(b.create_cn_qp(None).unwrap()).unwrap();
    }
    for (k, q) in [alloc, free].iter().chain(access.iter()).enumerate() {
        b.connect_cn_qp(*q, &cm_attr(0x900 + k as u32), [2, 0, 0, 0, 0, 9]).unwrap();
    }
    let qps = CnQps { alloc, free, access, alloc_loop: Some(alloc_loop), free_loop: Some(free_loop) };
    driver.connect(qps.clone()).unwrap();
    Mn { driver, qps }
}

fn dev(m: &Mn) -> std::cell::Ref<'_, RecordingDevx> {
    m.driver.backend.device()
}

fn slot(m: &Mn, q: Qpn) -> &QpSlot {
    m.driver.backend.qps.get(&q.get()).unwrap()
}

fn decode_sq(m: &Mn, q: Qpn, index: u16) -> Decoded {
    let s = slot(m, q);
    let ring = s.devx.sq.len / WQEBB;
    let addr = s.devx.sq.addr + (index as usize % ring) * WQEBB;
    decode::decode(&dev(m).bytes(addr, WQEBB * 5.min(ring - index as usize % ring))).unwrap()
}

fn pd_of(input: &[u8]) -> u64 {
    bits::get(input, pq::qpc::PD.at(pq::QPC_BASE)).unwrap()
}

/// A CQE as the device writes it, at consumer index `ci` of `cq` (owner bit = pass parity).
fn plant_cqe(m: &mut Mn, cqn: u32, ci: u32, op: u8, qpn: u32, counter: u16, syndrome: Option<u8>) {
    let c = m.driver.backend.cqs.get(&cqn).unwrap().devx;
    let mut b = [0u8; CQE_SIZE];
    b[SOP_DROP_QPN_OFFSET..SOP_DROP_QPN_OFFSET + 4].copy_from_slice(&qpn.to_be_bytes());
    b[WQE_COUNTER_OFFSET..WQE_COUNTER_OFFSET + 2].copy_from_slice(&counter.to_be_bytes());
    if let Some(s) = syndrome {
        b[SYNDROME_OFFSET] = s;
    }
    b[OP_OWN_OFFSET] = op << 4 | ((ci >> c.log_cqes) & 1) as u8;
    let at = c.ring.addr + (ci as usize & ((1 << c.log_cqes) - 1)) * CQE_SIZE;
    m.driver.backend.device_mut().device_write(at, &b);
}

fn dbr_word(m: &Mn, addr: usize) -> u32 {
    u32::from_be_bytes(dev(m).bytes(addr, 4).try_into().unwrap())
}

#[test]
fn provisioning_puts_every_queue_in_its_domain() {
    let m = mn_with_cn();
    let d = dev(&m);
    // the ring arena is registered local-only CN-facing and with remote rights MN-private
    let regs: Vec<_> = d
        .calls
        .iter()
        .filter_map(|c| if let Call::RegMr { domain, access, .. } = c { Some((*domain, *access)) } else { None })
        .collect();
    assert_eq!(regs[0], (Domain::CnFacing, AccessFlags::LOCAL_WRITE));
    assert_eq!(regs[1].0, Domain::MnPrivate);
    assert!(regs[1].1.contains(AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC));
    // no registration in the CN-facing domain but the pool's carries remote rights
    for (dom, acc) in &regs[2..] {
        if *dom == Domain::CnFacing && acc.intersects(AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE) {
            assert!(acc.contains(AccessFlags::MW_BIND), "a CN-facing remote registration is the pool's: {acc:?}");
        }
    }
    // loop QPs and their peers in the MN-private PD with the chain roles; CN-facing QPs in the
    // CN-facing PD, management QPs with all three roles, access QPs with none
    let creates = d.inputs("CREATE_QP");
    let roles = |i: &[u8]| {
        let f = |fl: omw_core::mlx5::prm::Field| bits::get(i, fl.at(pq::QPC_BASE)).unwrap();
        (f(pq::qpc::CD_MASTER), f(pq::qpc::CD_SLAVE_SEND), f(pq::qpc::CD_SLAVE_RECEIVE))
    };
    let private = creates.iter().filter(|i| pd_of(i) == (PDN + PRIVATE_PDN_OFFSET) as u64).count();
    let facing = creates.iter().filter(|i| pd_of(i) == PDN as u64).count();
    // private: the atomic pair and two loop pairs; CN-facing: the admin pair (it unbinds the
    // pool's windows, which live there), 2 management and 2 access QPs
    assert_eq!((private, facing), (6, 6), "{:?}", creates.iter().map(|i| pd_of(i)).collect::<Vec<_>>());
    let chain_roles: Vec<_> = creates.iter().map(|i| roles(i)).filter(|r| *r != (0, 0, 0)).collect();
    assert_eq!(chain_roles.iter().filter(|r| **r == (1, 1, 0)).count(), 2, "two loop QPs: master + slave_send");
    assert_eq!(chain_roles.iter().filter(|r| **r == (1, 1, 1)).count(), 2, "two management QPs: all three roles");
    // every queue has its own CQ: as many CQs as send queues + receive queues
    assert_eq!(d.inputs("CREATE_CQ").len(), 12 + 4);
    // the CQs the chains' WAITs watch — those of the QPs with a CORE-Direct role: each loop
    // QP's send CQ, each management QP's two — are created with cqc.oi, no other CQ is
    let oi_of = |cqn: u32| {
        let obj = m.driver.backend.cqs[&cqn].devx.obj;
        let input = d
            .calls
            .iter()
            .find_map(|c| match c {
                Call::ObjCreate { command: "CREATE_CQ", input, obj: o } if *o == obj => Some(input),
                _ => None,
            })
            .expect("the CQ's CREATE_CQ was recorded");
        bits::get(input, omw_core::mlx5::prm::cq::cqc::OI.at(omw_core::mlx5::prm::cq::CQC_BASE)).unwrap()
    };
    let mut ignoring = std::collections::BTreeSet::new();
    for q in m.driver.backend.qps.values() {
        for cqn in [Some(q.cq_snd), q.cq_rcv].into_iter().flatten() {
            assert_eq!(oi_of(cqn), u64::from(!q.devx.cd.is_empty()), "CQ {cqn:#x} of QP {:#x}", q.devx.qpn);
            if oi_of(cqn) == 1 {
                ignoring.insert(cqn);
            }
        }
    }
    let mut watched = std::collections::BTreeSet::new();
    for (lp, mgmt) in [(m.qps.alloc_loop.unwrap(), m.qps.alloc), (m.qps.free_loop.unwrap(), m.qps.free)] {
        watched.extend(m.driver.backend.cq_numbers(lp, mgmt).unwrap());
    }
    assert_eq!(ignoring, watched, "exactly the chain CQs ignore overrun");
    for q in [m.qps.alloc_loop.unwrap(), m.qps.free_loop.unwrap(), m.qps.alloc, m.qps.free] {
        assert_eq!(m.driver.backend.qp_state(q).unwrap(), QpState::Rts);
    }
}

#[test]
fn connect_arms_both_chains_from_the_bytes_the_core_built() {
    let m = mn_with_cn();
    for (kind, mgmt, lp) in [
        (ChainKind::Alloc, m.qps.alloc, m.qps.alloc_loop.unwrap()),
        (ChainKind::Free, m.qps.free, m.qps.free_loop.unwrap()),
    ] {
        let (ls, ms) = (slot(&m, lp), slot(&m, mgmt));
        // the loop ring holds the chain: its first WQE decodes with the loop QP's number,
        // its WAITs name this chain's CQs, and the loop ring was rung
        let first = decode_sq(&m, lp, 0);
        assert_eq!(first.qpn, lp.get());
        let cqns = m.driver.backend.cq_numbers(lp, mgmt).unwrap();
        assert_eq!(cqns, [ls.cq_snd, ms.cq_snd, ms.cq_rcv.unwrap()]);
        let ring = ls.devx.sq.len / WQEBB;
        let mut waits = 0;
        let mut i = 0;
        while i < ring {
            let d = decode_sq(&m, lp, i as u16);
            if let Mlx5Op::Wait { cqn, pi } = d.op {
                assert!(cqns.contains(&cqn));
                assert!(pi.get() < 64, "lap-0 WAITs on fresh CQs count from 0");
                waits += 1;
            }
            i += omw_core::mlx5::wqebb::wqebbs(d.ds);
        }
        assert!(waits > 0);
        assert_ne!(dbr_word(&m, ls.devx.dbr_addr + 4), 0, "{kind:?}: loop send doorbell record");
        // every receive slot of the management QP holds the chain's receive; the record
        // publishes only the first lap's (the chain publishes each next one itself)
        let entries = ms.devx.rq.len / (16 << ms.devx.log_rq_stride);
        let stride = 16usize << ms.devx.log_rq_stride;
        let first = dev(&m).bytes(ms.devx.rq.addr, stride);
        for k in 1..entries {
            assert_eq!(dev(&m).bytes(ms.devx.rq.addr + k * stride, stride), first, "{kind:?}: receive slot {k}");
        }
        assert_eq!(dbr_word(&m, ms.devx.dbr_addr), 1);
        assert_eq!(ms.chain_recv, Some(chain_wr_id(kind, 0, 0xFF)));
        assert!(ms.chain_publishes);
    }
    // the host posts nothing on a chain's rings
    let mut m = m;
    let w = Wqe::nop();
    assert!(matches!(m.driver.backend.post_send(m.qps.alloc, &w), Err(DevxError::ManagedQueue(_))));
    assert!(matches!(m.driver.backend.post_send(m.qps.alloc_loop.unwrap(), &w), Err(DevxError::ManagedQueue(_))));
}

#[test]
fn sends_complete_by_wqe_counter_and_errors_move_the_qp_to_err() {
    let mut m = mn_with_cn();
    // access[0] carries the MN's messages in offloaded mode (the welcome is on it already)
    let q = m.qps.access[1];
    let b = &mut m.driver.backend;
    let mem = b.alloc_memory(4096, 4096).unwrap();
    let keys = b.reg_mr(Domain::CnFacing, mem, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    // unsignaled, then signaled: one completion, the signaled one's wr_id
    let mut w1 = Wqe::send(mem, keys.lkey, 16).with_wr_id(7);
    w1.flags = WqeFlags::empty();
    let w2 = Wqe::send(mem + 16, keys.lkey, 16).with_wr_id(8);
    b.post_send(q, &w1).unwrap();
    b.post_send(q, &w2).unwrap();
    let s = slot(&m, q);
    let (cqn, sq, dbr) = (s.cq_snd, s.devx.sq, s.devx.dbr_addr);
    assert_eq!(dbr_word(&m, dbr + 4), 2, "send doorbell record = producer index");
    let d1 = decode::decode(&dev(&m).bytes(sq.addr, 64)).unwrap();
    assert!(matches!(d1.op, Mlx5Op::Send { .. }) && d1.qpn == q.get() && d1.index.get() == 0);
    assert_eq!(m.driver.backend.outstanding(q, QueueSel::Send), Some(2));
    let mut out = [Completion::EMPTY; 4];
    assert_eq!(m.driver.backend.poll_cq(q, QueueSel::Send, &mut out).unwrap(), 0);
    plant_cqe(&mut m, cqn, 0, cqe_op::REQ, q.get(), 1, None);
    assert_eq!(m.driver.backend.poll_cq(q, QueueSel::Send, &mut out).unwrap(), 1);
    assert_eq!((out[0].wr_id, out[0].status, out[0].opcode), (8, WcStatus::Success, WcOpcode::Send(Opcode::Send)));
    assert_eq!(m.driver.backend.outstanding(q, QueueSel::Send), Some(0));
    let cq_dbr = m.driver.backend.cqs[&cqn].devx.dbr_addr;
    assert_eq!(dbr_word(&m, cq_dbr), 1, "CQ doorbell record = consumer index");
    // an error CQE: the status by syndrome, the QP in ERR
    let w3 = Wqe::send(mem, keys.lkey, 16).with_wr_id(9);
    m.driver.backend.post_send(q, &w3).unwrap();
    plant_cqe(&mut m, cqn, 1, cqe_op::REQ_ERR, q.get(), 2, Some(syndrome::REMOTE_ACCESS_ERR));
    assert_eq!(m.driver.backend.poll_cq(q, QueueSel::Send, &mut out).unwrap(), 1);
    assert_eq!((out[0].wr_id, out[0].status), (9, WcStatus::RemAccessErr));
    assert_eq!(m.driver.backend.qp_state(q).unwrap(), QpState::Err);
    // a stale entry of the previous pass (wrong owner bit) is not a completion
    plant_cqe(&mut m, cqn, 2 + 64, cqe_op::REQ, q.get(), 3, None);
    assert_eq!(m.driver.backend.poll_cq(q, QueueSel::Send, &mut out).unwrap(), 0);
}

#[test]
fn a_full_ring_refuses_and_a_wrap_pads_with_nops() {
    let mut m = mn_with_cn();
    let q = m.qps.access[1];
    let ring = slot(&m, q).devx.sq.len / WQEBB;
    let cqn = slot(&m, q).cq_snd;
    let b = &mut m.driver.backend;
    let mem = b.alloc_memory(4096, 4096).unwrap();
    let keys = b.reg_mr(Domain::CnFacing, mem, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let w = Wqe::send(mem, keys.lkey, 8).with_wr_id(1);
    for _ in 0..ring {
        b.post_send(q, &w).unwrap();
    }
    assert!(matches!(b.post_send(q, &w), Err(DevxError::SendQueueFull { .. })));
    let mut out = [Completion::EMPTY; 2];
    plant_cqe(&mut m, cqn, 0, cqe_op::REQ, q.get(), (ring - 1) as u16, None);
    assert_eq!(m.driver.backend.poll_cq(q, QueueSel::Send, &mut out).unwrap(), 1);
    // up to the ring's last slot, completed again
    for _ in 0..ring - 1 {
        m.driver.backend.post_send(q, &w).unwrap();
    }
    plant_cqe(&mut m, cqn, 1, cqe_op::REQ, q.get(), (2 * ring - 2) as u16, None);
    assert_eq!(m.driver.backend.poll_cq(q, QueueSel::Send, &mut out).unwrap(), 1);
    // a 3-WQEBB bind at the last slot: one NOP to the ring's end, the bind at index 2 × ring
    let bind = Wqe::bind_mw(0x12ab, mem, 4096, keys.lkey, q.get(), AccessFlags::DATA_WINDOW);
    m.driver.backend.post_send(q, &bind).unwrap();
    let sq = slot(&m, q).devx.sq;
    let pad = decode::decode(&dev(&m).bytes(sq.addr + (ring - 1) * WQEBB, 64)).unwrap();
    assert!(matches!(pad.op, Mlx5Op::Nop) && !pad.fm_ce_se.signaled(), "{:?}", pad.op);
    let d = decode_sq(&m, q, (2 * ring) as u16);
    assert!(matches!(d.op, Mlx5Op::Bind { .. }) && d.index.get() as usize == 2 * ring, "{:?}", d.op);
    assert_eq!(dbr_word(&m, slot(&m, q).devx.dbr_addr + 4) as usize, 2 * ring + 3);
    // the WQE after a UMR carries the initiator small fence (rdma-core's next_fence), a
    // FENCEd one SMALL_AND_FENCE; the one after that none
    use omw_core::mlx5::ctrl::FenceMode;
    m.driver.backend.post_send(q, &w).unwrap();
    m.driver.backend.post_send(q, &w).unwrap();
    let after = (2 * ring + 3) as u16;
    assert_eq!(decode_sq(&m, q, after).fm_ce_se.fence, FenceMode::InitiatorSmall);
    assert_eq!(decode_sq(&m, q, after + 1).fm_ce_se.fence, FenceMode::None);
    let inv = Wqe::local_inv(0x12ab);
    m.driver.backend.post_send(q, &inv).unwrap();
    m.driver.backend.post_send(q, &w.with_flags(w.flags | omw_core::wire::wqe::WqeFlags::FENCE)).unwrap();
    assert_eq!(decode_sq(&m, q, after + 4).fm_ce_se.fence, FenceMode::SmallAndFence);
}

/// A chain that publishes its own receives (the default): the backend hands none back when the
/// MN polls the chain's receive CQ — the record moves only by the chain's own write.
#[test]
fn a_publishing_chain_gets_no_receive_handed_back() {
    let mut m = mn_with_cn();
    let mgmt = m.qps.alloc;
    let s = slot(&m, mgmt);
    let (rcq, dbr) = (s.cq_rcv.unwrap(), s.devx.dbr_addr);
    assert_eq!(dbr_word(&m, dbr), 1);
    plant_cqe(&mut m, rcq, 0, cqe_op::RESP_SEND, mgmt.get(), 0, None);
    let mut out = [Completion::EMPTY; 2];
    assert_eq!(m.driver.backend.poll_cq(mgmt, QueueSel::Recv, &mut out).unwrap(), 1);
    assert_eq!(out[0].wr_id, chain_wr_id(ChainKind::Alloc, 0, 0xFF));
    assert_eq!(dbr_word(&m, dbr), 1, "the CPU publishes nothing: the chain does");
}

/// With `chains_publish_receives` off, every slot is published at arming and each consumed one
/// handed back when polled.
#[test]
fn chain_receives_are_handed_back_when_polled() {
    let mut m = mn_on(backend_with(|c| c.chains_publish_receives = false));
    let mgmt = m.qps.alloc;
    let s = slot(&m, mgmt);
    let (rcq, dbr) = (s.cq_rcv.unwrap(), s.devx.dbr_addr);
    let entries = dbr_word(&m, dbr);
    plant_cqe(&mut m, rcq, 0, cqe_op::RESP_SEND, mgmt.get(), 0, None);
    let mut out = [Completion::EMPTY; 2];
    assert_eq!(m.driver.backend.poll_cq(mgmt, QueueSel::Recv, &mut out).unwrap(), 1);
    assert_eq!(out[0].wr_id, chain_wr_id(ChainKind::Alloc, 0, 0xFF));
    assert_eq!(dbr_word(&m, dbr), entries + 1, "the consumed receive slot goes back to the device");
    assert!(matches!(
        m.driver.backend.post_recv(mgmt, &RecvWqe { wr_id: 1, sges: heapless::Vec::new() }),
        Err(DevxError::ManagedQueue(_))
    ));
    // a flushed one is not: the QP is in ERR, where a receive posted again is flushed at once
    // (handing flushes back kept an errored management QP's poll going forever on the double)
    plant_cqe(&mut m, rcq, 1, cqe_op::RESP_ERR, mgmt.get(), 0, Some(syndrome::WR_FLUSH_ERR));
    assert_eq!(m.driver.backend.poll_cq(mgmt, QueueSel::Recv, &mut out).unwrap(), 1);
    assert_eq!(out[0].status, WcStatus::WrFlushErr);
    assert_eq!(dbr_word(&m, dbr), entries + 1, "a flushed receive stays consumed");
}

/// A chain failure on DEVX: the MN's driver quiesces the chain (2RST on the loop pair and the
/// management QP), reconnects them, and re-arms — and the re-armed WAITs start at what the
/// loop CQ already counted (an mlx5 CQ keeps counting across its QP's reset).
#[test]
fn a_failed_chain_is_reset_and_rearmed_past_its_cq_count() {
    let mut m = mn_with_cn();
    let (lp, mgmt) = (m.qps.alloc_loop.unwrap(), m.qps.alloc);
    let waits = |m: &Mn| -> Vec<(Ring, u16, u32, u32)> {
        let mut v = Vec::new();
        for (ring, q) in [(Ring::Loop, lp), (Ring::Mgmt, mgmt)] {
            let n = slot(m, q).devx.sq.len / WQEBB;
            let mut i = 0;
            while i < n {
                let d = decode_sq(m, q, i as u16);
                if let Mlx5Op::Wait { cqn, pi } = d.op {
                    v.push((ring, i as u16, cqn, pi.get()));
                }
                i += omw_core::mlx5::wqebb::wqebbs(d.ds);
            }
        }
        v
    };
    let first_signaled = |m: &Mn, q: Qpn| {
        let n = slot(m, q).devx.sq.len / WQEBB;
        let mut i = 0;
        loop {
            let d = decode_sq(m, q, i as u16);
            if d.fm_ce_se.signaled() {
                break i as u16;
            }
            i += omw_core::mlx5::wqebb::wqebbs(d.ds);
            assert!(i < n);
        }
    };
    let before_waits = waits(&m);
    let cqns = m.driver.backend.cq_numbers(lp, mgmt).unwrap();
    // the management ring completed one signaled WQE, then the loop ring's first one failed
    let (ms, ls) = (first_signaled(&m, mgmt), first_signaled(&m, lp));
    plant_cqe(&mut m, cqns[1], 0, cqe_op::REQ, mgmt.get(), ms, None);
    plant_cqe(&mut m, cqns[0], 0, cqe_op::REQ_ERR, lp.get(), ls, Some(syndrome::REMOTE_ACCESS_ERR));
    let before = dev(&m).calls.len();
    m.driver.poll(1).unwrap();
    assert_eq!(m.driver.stats.chain_failures, 1);
    let calls = &dev(&m).calls[before..];
    let resets: Vec<u32> = calls
        .iter()
        .filter_map(|c| match c {
            Call::ObjModify { command: "2RST_QP", input, .. } => Some(bits::get(input, pq::MODIFY_QPN).unwrap() as u32),
            _ => None,
        })
        .collect();
    let peer = match slot(&m, lp).link {
        Link::Loopback { peer } => peer,
        _ => unreachable!(),
    };
    for q in [lp.get(), peer, mgmt.get()] {
        assert!(resets.contains(&q), "2RST of {q:#x}: {resets:x?}");
    }
    // reconnected: the management QP with the attributes rdma_cm gave (remote QPN 0x900)
    assert!(calls.iter().any(|c| matches!(c, Call::ObjModify { command: "INIT2RTR_QP", input, .. }
        if bits::get(input, pq::qpc::REMOTE_QPN.at(pq::QPC_BASE)).unwrap() == 0x900)));
    assert_eq!(m.driver.backend.qp_state(lp).unwrap(), QpState::Rts);
    assert_eq!(m.driver.backend.qp_state(mgmt).unwrap(), QpState::Rts);
    // re-armed: each WAIT waits past what its CQ already counted
    let base = m.driver.backend.cq_producer_indices(lp, mgmt);
    assert_eq!(base, [1, 1, 0]);
    assert!(slot(&m, lp).chain.is_some() && slot(&m, mgmt).chain.is_some());
    let after_waits = waits(&m);
    assert_eq!(before_waits.len(), after_waits.len());
    let mut moved = 0;
    for (b, a) in before_waits.iter().zip(after_waits.iter()) {
        assert_eq!((b.0, b.1, b.2), (a.0, a.1, a.2));
        let k = cqns.iter().position(|c| *c == a.2).unwrap();
        assert_eq!(a.3, (b.3 + base[k]) & 0x00FF_FFFF, "WAIT at {:?} {}", a.0, a.1);
        moved += usize::from(base[k] != 0);
    }
    assert!(moved > 0, "some WAIT is on a CQ that counted: {before_waits:x?}");
}

#[test]
fn reset_of_a_fresh_qp_leaves_it_alone_and_unknown_qps_are_refused() {
    let mut m = mn_with_cn();
    let q = m.qps.access[1];
    let before = dev(&m).calls.len();
    m.driver.backend.reset_qp(q).unwrap();
    let after: Vec<Call> = dev(&m).calls[before..].to_vec();
    assert!(
        matches!(after[..], [Call::ObjQuery { command: "QUERY_QP", .. }]),
        "a never-used CN-facing QP the device has in RTS keeps its connection state: {after:?}"
    );
    // one the device moved to ERR (a CN's request it refused as responder) is reset
    let mut err = vec![0u8; 272];
    err[24] = 6 << 4;
    m.driver.backend.device_mut().outputs.insert("QUERY_QP", err);
    let before = dev(&m).calls.len();
    m.driver.backend.reset_qp(q).unwrap();
    let cmds: Vec<&str> = dev(&m).calls[before..]
        .iter()
        .filter_map(|c| match c {
            Call::ObjModify { command, .. } | Call::ObjQuery { command, .. } => Some(*command),
            _ => None,
        })
        .collect();
    assert_eq!(cmds, ["QUERY_QP", "2RST_QP", "RST2INIT_QP", "INIT2RTR_QP", "RTR2RTS_QP"]);
    let bogus = Qpn::new(0x77_7777).unwrap();
    assert!(matches!(m.driver.backend.reset_qp(bogus), Err(DevxError::UnknownQp(0x77_7777))));
    assert!(matches!(m.driver.backend.read_local(1, &mut [0u8; 4]), Err(DevxError::OutsideMemory { .. })));
    assert!(matches!(
        m.driver.backend.reg_mr(Domain::CnFacing, 8, 8, AccessFlags::LOCAL_WRITE),
        Err(DevxError::OutsideMemory { .. })
    ));
    assert!(matches!(m.driver.backend.create_cn_qp(Some(12)), Err(DevxError::NotPowerOfTwo { .. })));
}

#[test]
fn missing_capabilities_refuse_before_any_device_call() {
    let mut c = caps();
    c.cd = false;
    let e = DevxBackend::new(RecordingDevx::numbered(PDN), c, DevxConfig::new(Capabilities::OFFLOAD)).unwrap_err();
    assert!(matches!(e, DevxError::MissingCapability(_)), "{e}");
}

/// A device for one unmanaged send queue, over the mock's memory: it fetches the WQEs the
/// doorbell record released from the ring bytes (decoding each at its own index, as a NIC
/// would), executes up to `budget` of them, and writes a CQE for each signaled one — only while
/// the CQ has room by the consumer index the backend wrote to the CQ doorbell record (a full
/// CQ would overrun). It returns the opcodes it fetched.
struct SqDevice {
    /// Next WQE index to fetch, and the CQ producer index.
    fetch: u16,
    cq_pi: u32,
    /// Fetched but not yet completed (their CQEs waiting for CQ room).
    pending_cqes: std::collections::VecDeque<u16>,
}

impl SqDevice {
    fn run(&mut self, m: &mut Mn, q: Qpn, budget: usize) -> Vec<Mlx5Op> {
        let s = slot(m, q);
        let (sq, dbr, cqn) = (s.devx.sq, s.devx.dbr_addr, s.cq_snd);
        let ring = sq.len / WQEBB;
        let pi = dbr_word(m, dbr + 4) as u16;
        let mut ops = Vec::new();
        while ops.len() < budget && self.fetch != pi {
            let at = sq.addr + (self.fetch as usize % ring) * WQEBB;
            let n = (ring - self.fetch as usize % ring).min(5) * WQEBB;
            let d = decode::decode(&dev(m).bytes(at, n)).expect("every WQE the backend rang decodes");
            assert_eq!((d.index.get(), d.qpn), (self.fetch, q.get()), "a WQE names its own index and QP");
            if d.fm_ce_se.signaled() {
                self.pending_cqes.push_back(self.fetch);
            }
            self.fetch = self.fetch.wrapping_add(omw_core::mlx5::wqebb::wqebbs(d.ds) as u16);
            ops.push(d.op);
        }
        let c = m.driver.backend.cqs[&cqn].devx;
        let ci = dbr_word(m, c.dbr_addr);
        while let Some(&counter) = self.pending_cqes.front() {
            if self.cq_pi.wrapping_sub(ci) >= 1 << c.log_cqes {
                break; // no room: the CQE waits
            }
            plant_cqe(m, cqn, self.cq_pi, cqe_op::REQ, q.get(), counter, None);
            self.cq_pi += 1;
            self.pending_cqes.pop_front();
        }
        ops
    }
}

#[derive(Clone, Debug)]
enum SqStep {
    /// A SEND (1 WQEBB) or a type-2 bind (3 WQEBBs), signaled or not.
    Post { bind: bool, signaled: bool },
    /// The device executes up to this many WQEs.
    Device(usize),
    /// The MN polls up to this many completions.
    Poll(usize),
}

fn sq_step() -> impl proptest::strategy::Strategy<Value = SqStep> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (any::<bool>(), proptest::bool::weighted(0.6)).prop_map(|(bind, signaled)| SqStep::Post { bind, signaled }),
        2 => (0usize..6).prop_map(SqStep::Device),
        2 => (1usize..4).prop_map(SqStep::Poll),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
    /// Against a device that executes what was rung from the ring's bytes: every signaled
    /// work request completes once, in order, with its wr_id and opcode; the unsignaled ones
    /// before it complete with it (`outstanding` drops by both); a post is refused exactly when
    /// the ring has no room for it and its padding; across many wraps of a 16-WQEBB ring, of the
    /// 16-bit index and of a 4-entry CQ (owner phase), with CQEs held back while the CQ is full.
    #[test]
    fn sends_against_an_executing_device(steps in proptest::collection::vec(sq_step(), 1..400)) {
        let mut cfg = DevxConfig::new(Capabilities::OFFLOAD | Capabilities::MW_BOUNDS_ENFORCED);
        cfg.ring_arena_bytes = 16 << 20;
        cfg.log_cqes = 2;
        cfg.log_sq_wqebbs = 4;
        let b = DevxBackend::new(RecordingDevx::numbered(PDN), caps(), cfg).unwrap();
        let mut m = mn_on(b);
        let q = m.qps.access[1];
        let ring = slot(&m, q).devx.sq.len / WQEBB;
        let mem = m.driver.backend.alloc_memory(4096, 4096).unwrap();
        let keys = m.driver.backend.reg_mr(Domain::CnFacing, mem, 4096, AccessFlags::LOCAL_WRITE).unwrap();
        let mut device = SqDevice { fetch: 0, cq_pi: 0, pending_cqes: Default::default() };
        // the model: posted (wr_id, opcode, signaled, first index, WQEBBs incl. padding before it)
        let mut posted: std::collections::VecDeque<(u64, Opcode, bool)> = Default::default();
        let (mut pi, mut done_to) = (0usize, 0usize); // WQEBBs rung / completed (unwrapped)
        let mut index_of: std::collections::VecDeque<(usize, usize)> = Default::default(); // (start, end) per post
        let mut next_id = 1u64;
        let mut out = [Completion::EMPTY; 4];
        for st in steps {
            match st {
                SqStep::Post { bind, signaled } => {
                    let mut w = if bind {
                        Wqe::bind_mw(0x12ab, mem, 4096, keys.lkey, q.get(), AccessFlags::DATA_WINDOW)
                    } else {
                        Wqe::send(mem, keys.lkey, 8)
                    }
                    .with_wr_id(next_id);
                    if !signaled {
                        w.flags = WqeFlags::empty();
                    }
                    let n = if bind { 3 } else { 1 };
                    let pad = if pi % ring + n > ring { ring - pi % ring } else { 0 };
                    let fits = pi - done_to + pad + n <= ring;
                    match m.driver.backend.post_send(q, &w) {
                        Ok(()) => {
                            proptest::prop_assert!(fits, "accepted without room");
                            posted.push_back((next_id, w.opcode, signaled));
                            index_of.push_back((pi + pad, pi + pad + n));
                            pi += pad + n;
                            next_id += 1;
                        }
                        Err(DevxError::SendQueueFull { .. }) => proptest::prop_assert!(!fits, "refused with room"),
                        Err(e) => proptest::prop_assert!(false, "{e}"),
                    }
                }
                SqStep::Device(k) => {
                    for op in device.run(&mut m, q, k) {
                        proptest::prop_assert!(matches!(op, Mlx5Op::Send { .. } | Mlx5Op::Bind { .. } | Mlx5Op::Nop), "{op:?}");
                    }
                }
                SqStep::Poll(k) => {
                    let n = m.driver.backend.poll_cq(q, QueueSel::Send, &mut out[..k]).unwrap();
                    for c in &out[..n] {
                        // the oldest signaled post, the unsignaled before it completed with it
                        while let Some((_, _, false)) = posted.front() {
                            posted.pop_front();
                            index_of.pop_front();
                        }
                        let (id, op, _) = posted.pop_front().expect("a completion for something posted");
                        let (_, end) = index_of.pop_front().unwrap();
                        done_to = end;
                        proptest::prop_assert_eq!((c.wr_id, c.status, c.opcode), (id, WcStatus::Success, WcOpcode::Send(op)));
                    }
                    proptest::prop_assert_eq!(m.driver.backend.outstanding(q, QueueSel::Send), Some(posted.len() as u64));
                }
            }
        }
    }
}

/// Windows are DEVX mkeys made as the kernel makes a type-2 window, in the CN-facing PD, with
/// the key byte counting up; the rkey is the mkey index the device answered with and that key.
#[test]
fn windows_are_devx_mkeys_shaped_as_the_kernel_s_type_2_windows() {
    use omw_core::mlx5::prm::mkey;
    let m = mn_with_cn();
    let d = dev(&m);
    let creates = d.inputs("CREATE_MKEY");
    // the provisioned pool: 16 chunks of G = 3 windows, the MN's own windows besides
    assert!(creates.len() >= 48, "one mkey per window: {}", creates.len());
    for (k, input) in creates.iter().enumerate() {
        let want = mkey::create_window_in(&mkey::CreateWindow { pdn: PDN, key: k as u8 }).unwrap();
        assert_eq!(*input, &want[..], "window {k}");
    }
    assert!(!d.calls.iter().any(|c| matches!(c, Call::AllocMw(_))), "no verbs MW on the DEVX path");
    assert_eq!(d.mkeys.len(), creates.len());
}

/// What QUERY_MKEY reports is what `WindowState` says: free is unbound; a context in use is a
/// binding to its QP under its key, covering its span (the span only for the current key);
/// an rkey of no window, unknown.
#[test]
fn window_state_is_read_from_query_mkey() {
    use omw_core::mlx5::prm::mkey;
    let mut m = mn_with_cn();
    let rkey = m.driver.backend.alloc_mw().unwrap();
    let index = rkey.index();
    assert_eq!(m.driver.backend.mw_binding(rkey), Some(MwBinding::Unbound));
    assert_eq!(m.driver.backend.mw_span(rkey), None);
    let q = dev(&m).inputs("QUERY_MKEY").last().unwrap().to_vec();
    assert_eq!(q, mkey::query_mkey_in(index).unwrap());
    // the device bound it (the mock executes no UMR: the context is planted as a bind leaves it)
    let key = rkey.next_key();
    {
        let c = m.driver.backend.device_mut().mkeys.get_mut(&index).unwrap();
        c[0] &= !0x40; // free
        c[4..8].copy_from_slice(&((0x1103u32 << 8) | key.key() as u32).to_be_bytes());
        c[16..24].copy_from_slice(&0x7000_0000_4000u64.to_be_bytes());
        c[24..32].copy_from_slice(&0x1000u64.to_be_bytes());
    }
    let qpn = Qpn::new(0x1103).unwrap();
    assert_eq!(m.driver.backend.mw_binding(rkey), Some(MwBinding::Bound { rkey: key, qpn }));
    assert_eq!(m.driver.backend.mw_span(key), Some((0x7000_0000_4000, 0x1000)));
    assert_eq!(m.driver.backend.mw_span(rkey), None, "a stale key covers nothing");
    assert_eq!(m.driver.backend.mw_binding(Rkey::new(0x7F_0000, 1).unwrap()), None, "no window of ours");
    assert_eq!(m.driver.backend.window_query_failures(), 0);
}

/// A query the device does not answer is "unknown", counted, and its error kept.
#[test]
fn an_unanswered_window_query_is_unknown_and_counted() {
    let mut m = mn_with_cn();
    let rkey = m.driver.backend.alloc_mw().unwrap();
    m.driver.backend.device_mut().refuse.insert("QUERY_MKEY", (0x5, 0xBAD));
    assert_eq!(m.driver.backend.mw_binding(rkey), None);
    assert_eq!(m.driver.backend.mw_span(rkey), None);
    assert_eq!(m.driver.backend.window_query_failures(), 2);
    assert!(matches!(
        m.driver.backend.take_window_query_error(),
        Some(DevxError::Command { command: "QUERY_MKEY", status: 0x5, syndrome: 0xBAD, .. })
    ));
    // in use without a QP: no type-2 binding, reported as such
    m.driver.backend.device_mut().refuse.clear();
    m.driver.backend.device_mut().mkeys.get_mut(&rkey.index()).unwrap()[0] &= !0x40;
    assert_eq!(m.driver.backend.mw_binding(rkey), None);
    assert!(matches!(m.driver.backend.take_window_query_error(), Some(DevxError::WindowAnswer { .. })));
}

/// Teardown destroys every window's DEVX object (the kernel sends DESTROY_MKEY for it).
#[test]
fn windows_are_destroyed_with_the_backend() {
    let mut m = mn_with_cn();
    let objs: Vec<_> = dev(&m)
        .calls
        .iter()
        .filter_map(|c| match c {
            Call::ObjCreate { command: "CREATE_MKEY", obj, .. } => Some(*obj),
            _ => None,
        })
        .collect();
    m.driver.backend.destroy_windows().unwrap();
    let d = dev(&m);
    for o in &objs {
        assert!(d.calls.contains(&Call::ObjDestroy(*o)), "window object {o:?} destroyed");
    }
    drop(d);
    // nothing left to destroy twice
    let n = dev(&m).calls.len();
    m.driver.backend.destroy_windows().unwrap();
    assert_eq!(dev(&m).calls.len(), n);
}

/// The exact DEVX calls of a window's life: CREATE_MKEY through `obj_create`, QUERY_MKEY
/// through `obj_query` on that object, `obj_destroy` of it.
#[test]
fn a_window_s_command_sequence() {
    use omw_core::mlx5::prm::mkey;
    let mut m = mn_with_cn();
    let before = dev(&m).calls.len();
    let key = dev(&m).inputs("CREATE_MKEY").len() as u8;
    let rkey = m.driver.backend.alloc_mw().unwrap();
    let _ = m.driver.backend.mw_binding(rkey);
    m.driver.backend.destroy_windows().unwrap();
    let d = dev(&m);
    let Call::ObjCreate { obj, .. } = d.calls[before] else { panic!("{:?}", d.calls[before]) };
    let windows = d.calls[before..].iter().filter(|c| matches!(c, Call::ObjDestroy(_))).count();
    assert_eq!(
        d.calls[before..before + 2],
        [
            Call::ObjCreate {
                command: "CREATE_MKEY",
                input: mkey::create_window_in(&mkey::CreateWindow { pdn: PDN, key }).unwrap().to_vec(),
                obj
            },
            Call::ObjQuery { command: "QUERY_MKEY", obj, input: mkey::query_mkey_in(rkey.index()).unwrap().to_vec() },
        ]
    );
    assert_eq!(rkey, Rkey::new(crate::devx::mock::FIRST_MKEY_INDEX + key as u32, key).unwrap());
    assert_eq!(windows, key as usize + 1, "every window destroyed");
    assert!(d.calls[before + 2..].contains(&Call::ObjDestroy(obj)));
}
