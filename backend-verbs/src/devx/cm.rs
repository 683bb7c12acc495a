//! rdma_cm in external-QP mode: rdma_cm resolves addresses, routes and the peer's QP number
//! and PSNs as usual, but the QP is a DEVX object it never sees. The MN passes the DEVX QP's
//! number in `rdma_conn_param.qp_num`, asks `rdma_init_qp_attr` for the attributes of each
//! state (INIT, RTR, RTS) and applies them with DEVX modifies (`queue::connect`), then
//! accepts (librdmacm man rdma_accept / rdma_init_qp_attr: a user-owned QP is the caller's to
//! transition). This file is the translation from `ibv_qp_attr` to the PRM modifies, and
//! [`ExternalCm`], the passive side's calls as a trait: the real ones are `ffi::RealCm`
//! (feature `devx`), the DEVX daemon's tests script them.
//!
//! The RoCE next-hop MAC is not in `ibv_qp_attr`: the kernel resolves it for verbs QPs only.
//! `ffi.rs` obtains it as UCX does — create an address handle from `ah_attr` and read
//! `rmac` from its mlx5 address vector (`mlx5dv_init_obj(MLX5DV_OBJ_AH)`).

use super::DevxError;
use crate::cm_event::{CmEvent, CmId};
use omw_core::mlx5::prm::qp::{AddressPath, Init2Rtr, Rst2Init, Rtr2Rts};
use std::net::SocketAddr;
use std::time::Duration;

/// The port's RoCE path to itself: a loopback QP pair is two QPs on this port, each naming the
/// other's QP number at this port's GID and MAC.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct LocalPath {
    pub port: u8,
    pub gid_index: u8,
    pub gid: [u8; 16],
    /// The MAC the port answers to (an address handle to its own GID resolves it).
    pub mac: [u8; 6],
    /// `IBV_MTU_*` of the port's active MTU.
    pub mtu: u8,
}

/// The fields of `ibv_qp_attr` (and its `ah_attr`) the modifies need, copied out of the C
/// struct so the translation is plain data.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CmQpAttr {
    pub port_num: u8,
    pub pkey_index: u16,
    pub qp_access_flags: u32,
    pub dest_qp_num: u32,
    /// `IBV_MTU_*` (1 = 256 … 5 = 4096).
    pub path_mtu: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub ah_is_global: bool,
    pub ah_dlid: u16,
    pub ah_sl: u8,
    pub ah_port_num: u8,
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `IBV_ACCESS_REMOTE_WRITE` / `_READ` / `_ATOMIC` (verbs.h).
const REMOTE_WRITE: u32 = 1 << 1;
const REMOTE_READ: u32 = 1 << 2;
const REMOTE_ATOMIC: u32 = 1 << 3;

/// ceil(log2(n)) for the `log_sra_max` / `log_rra_max` fields (the kernel's
/// `fls(n - 1)` in drivers/infiniband/hw/mlx5/qp.c); 0 for n ≤ 1.
fn ceil_log2(n: u8) -> u8 {
    if n <= 1 {
        0
    } else {
        (8 - (n - 1).leading_zeros()) as u8
    }
}

/// RoCE v2 UDP source port for a flow label, as Linux include/rdma/ib_verbs.h
/// `rdma_flow_label_to_udp_sport`; a zero label is first replaced by
/// `rdma_calc_flow_label(lqpn, rqpn)`, as mlx5_ib does.
pub fn udp_sport(flow_label: u32, lqpn: u32, rqpn: u32) -> u16 {
    let fl = if flow_label == 0 {
        let mut v = lqpn as u64 * rqpn as u64;
        v ^= v >> 20;
        v ^= v >> 40;
        (v & 0xF_FFFF) as u32
    } else {
        flow_label
    };
    let mut low = fl & 0x03FFF;
    let high = fl & 0xFC000;
    low ^= high >> 14;
    (low as u16) | 0xC000
}

pub fn rst2init(qpn: u32, a: &CmQpAttr, atomic_mode: u8) -> Rst2Init {
    Rst2Init {
        qpn,
        port: a.port_num,
        pkey_index: a.pkey_index,
        remote_read: a.qp_access_flags & REMOTE_READ != 0,
        remote_write: a.qp_access_flags & REMOTE_WRITE != 0,
        remote_atomic: a.qp_access_flags & REMOTE_ATOMIC != 0,
        atomic_mode,
    }
}

/// `log_msg_max` comes from the device (`cmd_hca_cap.log_max_msg`); `rmac` from the AH.
pub fn init2rtr(qpn: u32, a: &CmQpAttr, log_msg_max: u8, rmac: [u8; 6]) -> Init2Rtr {
    let remote_qpn = a.dest_qp_num & 0x00FF_FFFF;
    Init2Rtr {
        qpn,
        remote_qpn,
        mtu: a.path_mtu as u8,
        log_msg_max,
        next_rcv_psn: a.rq_psn & 0x00FF_FFFF,
        log_rra_max: ceil_log2(a.max_dest_rd_atomic),
        min_rnr_nak: a.min_rnr_timer,
        path: AddressPath {
            port: if a.ah_port_num != 0 { a.ah_port_num } else { a.port_num },
            pkey_index: a.pkey_index,
            grh: a.ah_is_global,
            rlid: a.ah_dlid,
            sgid_index: a.sgid_index,
            hop_limit: a.hop_limit,
            tclass: a.traffic_class,
            flow_label: a.flow_label & 0xF_FFFF,
            rgid: a.dgid,
            sl: a.ah_sl & 0xF,
            rmac,
            udp_sport: udp_sport(a.flow_label, qpn, remote_qpn),
        },
    }
}

pub fn rtr2rts(qpn: u32, a: &CmQpAttr) -> Rtr2Rts {
    Rtr2Rts {
        qpn,
        next_send_psn: a.sq_psn & 0x00FF_FFFF,
        ack_timeout: a.timeout & 0x1F,
        retry_count: a.retry_cnt & 0x7,
        rnr_retry: a.rnr_retry & 0x7,
        log_sra_max: ceil_log2(a.max_rd_atomic),
    }
}

impl CmQpAttr {
    /// The attributes of a QP connected to QP `dest` on the same port (an MN loopback pair,
    /// the bring-up tool's pairs): this port's GID and MTU, PSNs 0, remote read / write /
    /// atomic, 16 outstanding reads and atomics each way, RNR and transport retries 7 and ack
    /// timeout 14 (4.096 µs × 2^14 ≈ 67 ms), as `ibv_rc_pingpong` sets them.
    pub fn to_self(path: &LocalPath, dest: u32) -> CmQpAttr {
        CmQpAttr {
            port_num: path.port,
            qp_access_flags: REMOTE_READ | REMOTE_WRITE | REMOTE_ATOMIC,
            dest_qp_num: dest,
            path_mtu: path.mtu as u32,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            ah_is_global: true,
            ah_port_num: path.port,
            dgid: path.gid,
            sgid_index: path.gid_index,
            hop_limit: 64,
            ..Default::default()
        }
    }
}

/// RST → INIT → RTR → RTS of `qp` with the attributes `a` (8-byte atomics in the responder's
/// `atomic_mode`), the device's `log_msg_max` and the next hop's MAC.
pub fn connect<A: super::DevxApi>(
    api: &mut A,
    qp: &super::queue::DevxQp,
    a: &CmQpAttr,
    log_msg_max: u8,
    rmac: [u8; 6],
) -> Result<(), super::DevxError> {
    let atomic = omw_core::mlx5::prm::qp::ATOMIC_MODE_8B as u8;
    let q = qp.qpn;
    super::queue::connect(api, qp, rst2init(q, a, atomic), init2rtr(q, a, log_msg_max, rmac), rtr2rts(q, a))
}

/// One attribute set from `rdma_init_qp_attr`'s three answers: each state's answer is
/// authoritative for the fields its transition sets (INIT: port, P_Key index, access flags;
/// RTR: the remote QP, path, MTU, receive PSN, responder resources, RNR timer; RTS: the send
/// PSN, timeouts, retries, initiator depth), which is what `rst2init` / `init2rtr` / `rtr2rts`
/// read.
pub fn merge_states(init: &CmQpAttr, rtr: &CmQpAttr, rts: &CmQpAttr) -> CmQpAttr {
    CmQpAttr {
        port_num: init.port_num,
        pkey_index: init.pkey_index,
        qp_access_flags: init.qp_access_flags,
        sq_psn: rts.sq_psn,
        max_rd_atomic: rts.max_rd_atomic,
        timeout: rts.timeout,
        retry_cnt: rts.retry_cnt,
        rnr_retry: rts.rnr_retry,
        ..*rtr
    }
}

/// What `rdma_accept` tells the peer besides the QP number: the reply's private data and what
/// rdma_cm negotiated for the connection (`rdma_init_qp_attr`'s RTR and RTS answers).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Accept<'a> {
    /// The DEVX QP rdma_cm announces as ours (`conn_param.qp_num`).
    pub qp_num: u32,
    pub private: &'a [u8],
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
}

impl<'a> Accept<'a> {
    /// The accept of QP `qp_num` connected with the RTR and RTS attributes `rtr` and `rts`.
    pub fn of(qp_num: u32, rtr: &CmQpAttr, rts: &CmQpAttr, private: &'a [u8]) -> Self {
        Accept {
            qp_num,
            private,
            responder_resources: rtr.max_dest_rd_atomic,
            initiator_depth: rts.max_rd_atomic,
            retry_count: rts.retry_cnt,
            rnr_retry_count: rts.rnr_retry,
        }
    }
}

/// The passive side of rdma_cm in external-QP mode, as the DEVX MN uses it.
pub trait ExternalCm {
    /// Bind `addr` and listen on it; an address of another device than `device` is refused.
    fn listen(&mut self, addr: SocketAddr, device: &str) -> crate::error::Result<()>;
    /// The next event, waiting at most `timeout` (zero: do not wait).
    fn poll(&mut self, timeout: Duration) -> crate::error::Result<Option<CmEvent>>;
    /// `rdma_init_qp_attr` of the pending connection request `id` for INIT, RTR and RTS.
    fn qp_attrs(&mut self, id: CmId) -> Result<[CmQpAttr; 3], DevxError>;
    /// `rdma_accept` of the pending request `id` announcing a QP of ours; on failure the
    /// request is rejected (nothing of it is left).
    fn accept(&mut self, id: CmId, accept: &Accept<'_>) -> Result<(), DevxError>;
    /// Refuse the pending request `id` (ignored if it is not one).
    fn reject(&mut self, id: CmId) {
        self.reject_with(id, &[])
    }
    /// [`Self::reject`] with `private` as the reject's private data (a `crate::refusal::Refusal`).
    fn reject_with(&mut self, id: CmId, private: &[u8]);
    /// `rdma_disconnect` and destroy an accepted id (its QP is gone or going).
    fn disconnect(&mut self, id: CmId);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr() -> CmQpAttr {
        let mut gid = [0u8; 16];
        gid[10..].copy_from_slice(&[0xff, 0xff, 192, 0, 2, 2]);
        let path = LocalPath { port: 1, gid_index: 3, gid, mac: [0; 6], mtu: 3 };
        CmQpAttr {
            qp_access_flags: REMOTE_READ | REMOTE_WRITE,
            rq_psn: 0xaaaa,
            sq_psn: 0xbbbb,
            ..CmQpAttr::to_self(&path, 0x321)
        }
    }

    #[test]
    fn translation() {
        let a = attr();
        let i = rst2init(0x55, &a, 3);
        assert!(i.remote_read && i.remote_write && !i.remote_atomic);
        let r = init2rtr(0x55, &a, 30, [2, 0, 0, 0, 0, 2]);
        assert_eq!((r.remote_qpn, r.mtu, r.next_rcv_psn, r.log_rra_max, r.min_rnr_nak), (0x321, 3, 0xaaaa, 4, 12));
        assert!(r.path.grh);
        assert_eq!((r.path.sgid_index, r.path.hop_limit, r.path.rgid, r.path.port), (3, 64, a.dgid, 1));
        let t = rtr2rts(0x55, &a);
        assert_eq!((t.next_send_psn, t.ack_timeout, t.retry_count, t.rnr_retry, t.log_sra_max), (0xbbbb, 14, 7, 7, 4));
        assert_eq!(
            [ceil_log2(0), ceil_log2(1), ceil_log2(2), ceil_log2(3), ceil_log2(16), ceil_log2(255)],
            [0, 0, 1, 2, 4, 8]
        );
    }

    #[test]
    fn each_state_answers_for_its_own_fields() {
        let init =
            CmQpAttr { port_num: 2, pkey_index: 5, qp_access_flags: REMOTE_WRITE, sq_psn: 99, ..Default::default() };
        let rtr = CmQpAttr { dest_qp_num: 0x77, path_mtu: 5, rq_psn: 0x10, min_rnr_timer: 12, port_num: 9, ..attr() };
        let rts = CmQpAttr {
            sq_psn: 0x20,
            timeout: 18,
            retry_cnt: 6,
            rnr_retry: 5,
            max_rd_atomic: 8,
            dest_qp_num: 1,
            ..Default::default()
        };
        let m = merge_states(&init, &rtr, &rts);
        assert_eq!((m.port_num, m.pkey_index, m.qp_access_flags), (2, 5, REMOTE_WRITE));
        assert_eq!((m.dest_qp_num, m.path_mtu, m.rq_psn, m.min_rnr_timer, m.dgid), (0x77, 5, 0x10, 12, rtr.dgid));
        assert_eq!((m.sq_psn, m.timeout, m.retry_cnt, m.rnr_retry, m.max_rd_atomic), (0x20, 18, 6, 5, 8));
        // the modifies read exactly those
        let t = rtr2rts(1, &m);
        assert_eq!((t.next_send_psn, t.ack_timeout), (0x20, 18));
        assert_eq!(init2rtr(1, &m, 30, [0; 6]).remote_qpn, 0x77);
    }

    #[test]
    fn udp_source_port_follows_the_kernel() {
        // non-zero label: low 14 bits XOR the next 6, with the RoCE v2 range bits set
        assert_eq!(udp_sport(0x1_2345, 0, 0), 0xC000 | ((0x2345 ^ (0x1_0000 >> 14)) as u16));
        // every port is in 0xC000..=0xFFFF
        for (l, r) in [(1, 2), (0x12_3456, 0xAB_CDEF), (0, 0)] {
            assert!(udp_sport(0, l, r) >= 0xC000);
        }
    }
}
