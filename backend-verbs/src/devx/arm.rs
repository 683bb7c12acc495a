//! Arming an mlx5-form chain on DEVX queues: the device-side half of
//! `RdmaBackend::arm_mlx5` for a DEVX backend (issue 13 part 4).
//!
//! The chain (`omw_core::chain::mlx5::Mlx5Chain::build`) runs on two DEVX QPs in the roles
//! docs/MLX5.md describes: the **loop QP** is `cd_master` (it posts the WAITs and SEND_EN /
//! RECV_EN), the **management QP**'s send queue is `cd_slave_send` and its receive queue
//! `cd_slave_receive` (the loop ring enables them). The chain's bytes add roles, and arming
//! reads them from there: a ring holding a WAIT, SEND_EN or RECV_EN must be `cd_master`, a
//! queue a SEND_EN / RECV_EN names must be `cd_slave_send` / `cd_slave_receive`. For the
//! alloc and free chains that makes the loop QP `cd_master | cd_slave_send` (its lap-closing
//! self-enable) and the management QP all three (its ring WAITs on its own send CQ and
//! SEND_ENs the loop ring). The three CQs [loop send, management send, management receive]
//! are the ones the QPs were created with ([`cq_numbers`]): the WAITs name them.
//!
//! [`arm_chain`] checks everything first — the chain validates, QP numbers, ring addresses
//! (the chain's patches aim at the umem send rings), ring sizes, roles, CQs, the receive WQE
//! width and count — and only then touches the device, in the order the hardware needs: all
//! umem stores (both send-ring images, the receive WQEs), then the doorbells — receive queue
//! first, then the management send queue, then the loop send queue, so nothing the master
//! can enable is missing when it starts; a ring whose first enable index is 0 (the
//! management ring: the loop ring enables it) gets no doorbell. Each send doorbell is the
//! doorbell-record write, the barrier, then the 8-byte UAR write of the first 8 bytes of the
//! last enabled WQE's control segment ([`super::doorbell::ring_sq`], rdma-core
//! providers/mlx5/qp.c v44.0 `mlx5_post_send`).
//!
//! Indices start at 0: the QPs are freshly created (as rdma-core starts a QP,
//! providers/mlx5/verbs.c v44.0 `create_qp`: `mlx5_init_qp_indices`, both doorbell-record
//! words 0), and a lap-0 chain names absolute indices from 0; a backend re-arming after a
//! reset must restart at 0 likewise. [`write_ring`] and [`write_recvs`] take a start index and
//! wrap at the ring's end, for re-posting later.
//!
//! Not here: the lap counters ("shadows") live in the CN's scratch in MN memory, not in a
//! umem; `omw_core::chain::arm` writes them (and the ring images, through `write_local`) before it
//! calls `arm_mlx5`. Writing the ring images again here keeps this sequence complete on its
//! own; the bytes are the same. Nothing here has run on a ConnectX (docs/MLX5.md).

use super::api::DevxApi;
use super::doorbell;
use super::queue::{DevxCq, DevxQp};
use super::DevxError;
use omw_core::chain::mlx5::Mlx5Chain;
use omw_core::chain::Ring;
use omw_core::mlx5::data::DATA_SEG_SIZE;
use omw_core::mlx5::decode::Mlx5Op;
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::mlx5::wqebb::{WqeIndex, WQEBB};

/// `MLX5_INVALID_LKEY` (rdma-core providers/mlx5/mlx5.h v44.0): the data segment that ends a
/// receive WQE's scatter list when it has fewer entries than the stride holds
/// (`mlx5_post_recv`, providers/mlx5/qp.c v44.0: `if (j < qp->rq.max_gs)` writes
/// `byte_count 0, lkey MLX5_INVALID_LKEY, addr 0`). The loopback model (backend-loopback/src/
/// mlx5_fetch.rs) stops at the same terminator.
pub const INVALID_LKEY: u32 = 0x100;

/// The queues a chain runs on.
#[derive(Clone, Copy, Debug)]
pub struct ChainQps<'a> {
    pub loop_qp: &'a DevxQp,
    pub mgmt_qp: &'a DevxQp,
    /// [loop send, management send, management receive]: the CQs the WAITs name.
    pub cqs: [&'a DevxCq; 3],
}

/// What arming left behind: the producer indices rung and the WQE-index → wr_id map a driver
/// keeps (mlx5 WQEs carry no wr_id; a CQE reports the WQE index).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Armed {
    /// Send producer indices rung [loop, management] (the chain's first enable indices).
    pub sq_pi: [WqeIndex; 2],
    /// Receive WQEs posted (the receive doorbell-record value).
    pub rq_head: u32,
    /// wr_id per WQEBB slot, [loop, management].
    pub wr_ids: [Vec<u64>; 2],
}

const RINGS: [(Ring, &str); 2] = [(Ring::Loop, "loop"), (Ring::Mgmt, "management")];

/// The CQ numbers a chain on these QPs must name (`RdmaBackend::cq_numbers` for DEVX):
/// [loop send, management send, management receive], as CREATE_QP set them.
pub fn cq_numbers(loop_qp: &DevxQp, mgmt_qp: &DevxQp) -> [u32; 3] {
    [loop_qp.cqn_snd, mgmt_qp.cqn_snd, mgmt_qp.cqn_rcv]
}

fn rq_stride(qp: &DevxQp) -> usize {
    16usize << qp.log_rq_stride
}

fn rq_entries(qp: &DevxQp) -> usize {
    qp.rq.len / rq_stride(qp)
}

/// Store `bytes` (whole WQEBBs) into the send ring `qp.sq` starting at WQE index `start`:
/// byte offset (`start` mod ring size) × 64, wrapping at the ring's end (two stores then).
pub fn write_ring<A: DevxApi>(api: &mut A, qp: &DevxQp, start: WqeIndex, bytes: &[u8]) -> Result<(), DevxError> {
    let ring = qp.sq.len;
    if bytes.len() > ring || ring == 0 {
        return Err(DevxError::ChainDoesNotFit { what: "send ring (bytes)", need: bytes.len(), got: ring });
    }
    let off = (start.get() as usize * WQEBB) % ring;
    let first = bytes.len().min(ring - off);
    api.write_mem(qp.sq.addr + off, &bytes[..first])?;
    if first < bytes.len() {
        api.write_mem(qp.sq.addr, &bytes[first..])?;
    }
    Ok(())
}

/// One mlx5 receive WQE: a data segment (`struct mlx5_wqe_data_seg`, mlx5dv.h v44.0: BE32
/// byte_count, BE32 lkey, BE64 addr) per scatter entry, then the invalid-lkey terminator if
/// the stride has room; the rest zero.
pub fn recv_wqe(stride: usize, sges: &[omw_core::chain::mlx5::RecvSge]) -> Vec<u8> {
    let mut b = vec![0u8; stride];
    let seg = |b: &mut [u8], len: u32, lkey: u32, addr: u64| {
        b[0..4].copy_from_slice(&len.to_be_bytes());
        b[4..8].copy_from_slice(&lkey.to_be_bytes());
        b[8..16].copy_from_slice(&addr.to_be_bytes());
    };
    for (k, s) in sges.iter().enumerate() {
        seg(&mut b[k * DATA_SEG_SIZE..(k + 1) * DATA_SEG_SIZE], s.length, s.lkey, s.addr);
    }
    let k = sges.len();
    if (k + 1) * DATA_SEG_SIZE <= stride {
        seg(&mut b[k * DATA_SEG_SIZE..(k + 1) * DATA_SEG_SIZE], 0, INVALID_LKEY, 0);
    }
    b
}

/// Store `copies` receive WQEs with `sges` into `qp`'s receive queue at slots `head`,
/// `head + 1`, … (modulo the queue's entries); returns the new head. No doorbell.
pub fn write_recvs<A: DevxApi>(
    api: &mut A,
    qp: &DevxQp,
    head: u32,
    copies: u32,
    sges: &[omw_core::chain::mlx5::RecvSge],
) -> Result<u32, DevxError> {
    let (stride, entries) = (rq_stride(qp), rq_entries(qp));
    if entries == 0 || copies as usize > entries {
        return Err(DevxError::ChainDoesNotFit { what: "receive queue (WQEs)", need: copies as usize, got: entries });
    }
    if sges.len() * DATA_SEG_SIZE > stride {
        return Err(DevxError::ChainDoesNotFit {
            what: "receive WQE (data segments)",
            need: sges.len(),
            got: stride / DATA_SEG_SIZE,
        });
    }
    let wqe = recv_wqe(stride, sges);
    for k in 0..copies {
        let slot = (head.wrapping_add(k) as usize) % entries;
        api.write_mem(qp.rq.addr + slot * stride, &wqe)?;
    }
    Ok(head.wrapping_add(copies))
}

/// Every check of [`arm_chain`], before any device call; returns, per ring, the control
/// segment to ring the first enable with (`None`: the ring starts disabled).
fn check(chain: &Mlx5Chain, q: &ChainQps, copies: u32) -> Result<[Option<[u8; 16]>; 2], DevxError> {
    chain.validate().map_err(DevxError::ChainInvalid)?;
    let qps = [q.loop_qp, q.mgmt_qp];
    let mut need = [CdRole::MASTER, CdRole::SLAVE_SEND | CdRole::SLAVE_RECEIVE];
    for (r, (ring, name)) in RINGS.iter().enumerate() {
        let qp = qps[r];
        if chain.qpns[r] != qp.qpn {
            return Err(DevxError::WrongQp { ring: name, chain_qpn: chain.qpns[r], devx_qpn: qp.qpn });
        }
        if chain.queues.ring_bases[r] != qp.sq.addr as u64 {
            return Err(DevxError::RingBaseMismatch {
                ring: name,
                chain_base: chain.queues.ring_bases[r],
                umem_addr: qp.sq.addr,
            });
        }
        let (have, want) = (qp.sq.len / WQEBB, chain.ring_wqebbs(*ring));
        if want > have {
            return Err(DevxError::ChainDoesNotFit { what: "send ring (WQEBBs)", need: want, got: have });
        }
        if want < have {
            return Err(DevxError::RingNotOneLap { ring: name, chain_wqebbs: want, qp_wqebbs: have });
        }
    }
    // CQs: the ones the QPs report to, one per queue, and the ones the chain names.
    let cqns = cq_numbers(q.loop_qp, q.mgmt_qp);
    const QUEUES: [&str; 3] = ["loop send", "management send", "management receive"];
    for i in 0..3 {
        if q.cqs[i].cqn != cqns[i] {
            return Err(DevxError::WrongCq { queue: QUEUES[i], expected: cqns[i], got: q.cqs[i].cqn });
        }
        if chain.queues.cqns[i] != cqns[i] {
            return Err(DevxError::WrongCq { queue: QUEUES[i], expected: cqns[i], got: chain.queues.cqns[i] });
        }
        if cqns[..i].contains(&cqns[i]) {
            return Err(DevxError::SharedCq { cqn: cqns[i] });
        }
    }
    // Roles and CQs from the bytes.
    let idx = |qpn: u32, ring: &'static str| {
        qps.iter().position(|qp| qp.qpn == qpn).ok_or(DevxError::WrongQp { ring, chain_qpn: qpn, devx_qpn: 0 })
    };
    for (r, (ring, name)) in RINGS.iter().enumerate() {
        for p in chain.placed[r].iter() {
            let d = chain
                .decode_at(*ring, p.pi)
                .map_err(|e| DevxError::ChainInvalid(omw_core::chain::mlx5::Mlx5ChainError::Encode(e)))?;
            match d.op {
                Mlx5Op::Wait { cqn, .. } => {
                    need[r] |= CdRole::MASTER;
                    if !cqns.contains(&cqn) {
                        return Err(DevxError::WrongCq { queue: "a WAIT's", expected: cqns[0], got: cqn });
                    }
                }
                Mlx5Op::SendEn { qpn, .. } => {
                    need[r] |= CdRole::MASTER;
                    need[idx(qpn, name)?] |= CdRole::SLAVE_SEND;
                }
                Mlx5Op::RecvEn { qpn, .. } => {
                    need[r] |= CdRole::MASTER;
                    need[idx(qpn, name)?] |= CdRole::SLAVE_RECEIVE;
                }
                _ => {}
            }
        }
    }
    for (r, (_, name)) in RINGS.iter().enumerate() {
        if !qps[r].cd.contains(need[r]) {
            return Err(DevxError::WrongRole { qp: name, qpn: qps[r].qpn, need: need[r], has: qps[r].cd });
        }
    }
    // Receive queue: width and count (write_recvs checks the same; refuse before any call).
    let m = q.mgmt_qp;
    let (stride, entries) = (rq_stride(m), rq_entries(m));
    if entries == 0 || copies as usize > entries {
        return Err(DevxError::ChainDoesNotFit { what: "receive queue (WQEs)", need: copies as usize, got: entries });
    }
    if chain.recv.len() * DATA_SEG_SIZE > stride {
        return Err(DevxError::ChainDoesNotFit {
            what: "receive WQE (data segments)",
            need: chain.recv.len(),
            got: stride / DATA_SEG_SIZE,
        });
    }
    // The control segment of the WQE ending at each first enable index.
    let mut ctrl = [None, None];
    for (r, (_, name)) in RINGS.iter().enumerate() {
        let index = chain.initial_index[r];
        if index == 0 {
            continue;
        }
        let p = chain.placed[r]
            .iter()
            .find(|p| p.pi as usize + p.wqebbs as usize == index as usize)
            .ok_or(DevxError::EnableNotAtWqeEnd { ring: name, index })?;
        let off = p.pi as usize * WQEBB;
        let mut c = [0u8; 16];
        c.copy_from_slice(&chain.rings[r][off..off + 16]);
        ctrl[r] = Some(c);
    }
    Ok(ctrl)
}

/// Arm `chain` on the DEVX queues `q` with `recv_copies` (at least one) receive WQEs: every
/// check, then the umem stores, then the doorbells (see the module doc for the order and why).
pub fn arm_chain<A: DevxApi>(
    api: &mut A,
    chain: &Mlx5Chain,
    q: &ChainQps,
    recv_copies: u32,
) -> Result<Armed, DevxError> {
    let copies = recv_copies.max(1);
    let ctrl = check(chain, q, copies)?;
    let qps = [q.loop_qp, q.mgmt_qp];
    for (r, _) in RINGS.iter().enumerate() {
        write_ring(api, qps[r], WqeIndex::new(0), &chain.rings[r])?;
    }
    let written = write_recvs(api, q.mgmt_qp, 0, copies, &chain.recv)?;
    // every slot holds the chain's receive; the record publishes them all — or, where the
    // chain publishes its own (one per lap, `Mlx5Chain::published_at_arm`), the first lap's
    let rq_head = chain.published_at_arm().map_or(written, u32::from);
    doorbell::ring_rq(api, q.mgmt_qp, rq_head);
    for r in [Ring::Mgmt as usize, Ring::Loop as usize] {
        if let Some(c) = &ctrl[r] {
            doorbell::ring_sq(api, qps[r], WqeIndex::new(chain.initial_index[r]), c);
        }
    }
    let wr_ids = RINGS.map(|(ring, _)| {
        let r = ring as usize;
        let mut m = vec![0u64; chain.ring_wqebbs(ring)];
        for (k, p) in chain.placed[r].iter().enumerate() {
            for j in 0..p.wqebbs as usize {
                if let Some(w) = m.get_mut(p.pi as usize + j) {
                    *w = chain.wr_id_of(ring, k);
                }
            }
        }
        m
    });
    Ok(Armed { sq_pi: [0, 1].map(|r| WqeIndex::new(chain.initial_index[r])), rq_head, wr_ids })
}
