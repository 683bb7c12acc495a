//! Completion queue entries: the 64-byte CQE, its ownership bit, and error CQEs.
//!
//! Layouts: `struct mlx5_cqe64` and `struct mlx5_err_cqe`, /usr/include/infiniband/mlx5dv.h:1109
//! and :1127 (rdma-core 44.0); opcodes `MLX5_CQE_*` (mlx5dv.h:1086) and syndromes
//! `MLX5_CQE_SYNDROME_*` (mlx5dv.h:1054). Ownership as rdma-core's `get_sw_cqe`
//! (providers/mlx5/cq.c:139, v44.0): the entry for consumer index `n` is software's when its
//! opcode is not INVALID and its owner bit equals bit `log_cqes` of `n`; a fresh ring is all
//! `op_own = MLX5_CQE_INVALID << 4` (cq.c:1966).
//!
//! ```text
//! off len field (success CQE)          off len field (error CQE)
//!  36  4  imm_inval_pkey BE32            54  1  vendor_err_synd
//!  44  4  byte_cnt       BE32            55  1  syndrome
//!  56  4  sop_drop_qpn   BE32 (qpn 24b)  56  4  s_wqe_opcode_qpn BE32 (opcode 8b | qpn 24b)
//!  60  2  wqe_counter    BE16            60  2  wqe_counter BE16
//!  63  1  op_own         opcode << 4 | … | owner
//! ```

use super::wqebb::WqeIndex;

pub const CQE_SIZE: usize = 64;
pub const IMM_OFFSET: usize = 36;
pub const BYTE_CNT_OFFSET: usize = 44;
pub const SOP_DROP_QPN_OFFSET: usize = 56;
pub const WQE_COUNTER_OFFSET: usize = 60;
pub const OP_OWN_OFFSET: usize = 63;
pub const VENDOR_ERR_SYND_OFFSET: usize = 54;
pub const SYNDROME_OFFSET: usize = 55;

/// `MLX5_CQE_*` opcodes (the top nibble of `op_own`).
pub mod opcode {
    pub const REQ: u8 = 0;
    pub const RESP_WR_IMM: u8 = 1;
    pub const RESP_SEND: u8 = 2;
    pub const RESP_SEND_IMM: u8 = 3;
    pub const RESP_SEND_INV: u8 = 4;
    pub const REQ_ERR: u8 = 13;
    pub const RESP_ERR: u8 = 14;
    pub const INVALID: u8 = 15;
}

/// `MLX5_CQE_SYNDROME_*`.
pub mod syndrome {
    pub const LOCAL_LENGTH_ERR: u8 = 0x01;
    pub const LOCAL_QP_OP_ERR: u8 = 0x02;
    pub const LOCAL_PROT_ERR: u8 = 0x04;
    pub const WR_FLUSH_ERR: u8 = 0x05;
    pub const MW_BIND_ERR: u8 = 0x06;
    pub const BAD_RESP_ERR: u8 = 0x10;
    pub const LOCAL_ACCESS_ERR: u8 = 0x11;
    pub const REMOTE_INVAL_REQ_ERR: u8 = 0x12;
    pub const REMOTE_ACCESS_ERR: u8 = 0x13;
    pub const REMOTE_OP_ERR: u8 = 0x14;
    pub const TRANSPORT_RETRY_EXC_ERR: u8 = 0x15;
    pub const RNR_RETRY_EXC_ERR: u8 = 0x16;
    pub const REMOTE_ABORTED_ERR: u8 = 0x22;
}

/// A completion read from a CQE.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Cqe {
    pub opcode: u8,
    pub qpn: u32,
    /// The WQE index (in WQEBBs) of the completed send WQE, or the receive counter.
    pub wqe_counter: WqeIndex,
    pub byte_cnt: u32,
    pub imm: u32,
    /// Error CQEs: `(syndrome, vendor_err_synd, opcode of the failed WQE)`.
    pub error: Option<(u8, u8, u8)>,
}

fn be32(b: &[u8], o: usize) -> u32 {
    u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// Mark every CQE of a fresh ring invalid (hardware-owned for the first pass).
pub fn init_ring(ring: &mut [u8]) {
    for c in ring.chunks_exact_mut(CQE_SIZE) {
        c[OP_OWN_OFFSET] = opcode::INVALID << 4;
    }
}

/// The CQE for consumer index `ci` on a ring of `2^log_cqes` entries, if software owns it.
/// `None` also for a ring too short for the index (never a panic).
pub fn poll(ring: &[u8], log_cqes: u8, ci: u32) -> Option<Cqe> {
    if log_cqes >= 32 {
        return None;
    }
    let n = 1u64 << log_cqes;
    let slot = (ci as u64 & (n - 1)) as usize;
    let start = slot.checked_mul(CQE_SIZE)?;
    let c: &[u8; CQE_SIZE] = ring.get(start..start.checked_add(CQE_SIZE)?)?.try_into().ok()?;
    parse(c, log_cqes, ci)
}

/// The CQE `c`, read from the slot of consumer index `ci` on a ring of `2^log_cqes` entries,
/// if software owns it (a driver reading one slot at a time, as rdma-core's `get_sw_cqe`).
pub fn parse(c: &[u8; CQE_SIZE], log_cqes: u8, ci: u32) -> Option<Cqe> {
    if log_cqes >= 32 {
        return None;
    }
    let op_own = c[OP_OWN_OFFSET];
    let op = op_own >> 4;
    let owner = op_own & 1;
    let phase = ((ci as u64 >> log_cqes) & 1) as u8;
    if op == opcode::INVALID || owner != phase {
        return None;
    }
    let word = be32(c, SOP_DROP_QPN_OFFSET);
    let error = matches!(op, opcode::REQ_ERR | opcode::RESP_ERR)
        .then(|| (c[SYNDROME_OFFSET], c[VENDOR_ERR_SYND_OFFSET], (word >> 24) as u8));
    Some(Cqe {
        opcode: op,
        qpn: word & 0x00FF_FFFF,
        wqe_counter: WqeIndex::new(u16::from_be_bytes([c[WQE_COUNTER_OFFSET], c[WQE_COUNTER_OFFSET + 1]])),
        byte_cnt: be32(c, BYTE_CNT_OFFSET),
        imm: be32(c, IMM_OFFSET),
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cqe(op: u8, owner: u8, qpn: u32, wqe: u16) -> [u8; 64] {
        let mut c = [0u8; 64];
        c[SOP_DROP_QPN_OFFSET..SOP_DROP_QPN_OFFSET + 4].copy_from_slice(&qpn.to_be_bytes());
        c[WQE_COUNTER_OFFSET..WQE_COUNTER_OFFSET + 2].copy_from_slice(&wqe.to_be_bytes());
        c[OP_OWN_OFFSET] = op << 4 | owner;
        c
    }

    #[test]
    fn ownership_follows_the_phase() {
        let mut ring = [0u8; 4 * 64];
        init_ring(&mut ring);
        assert!(poll(&ring, 2, 0).is_none());
        ring[..64].copy_from_slice(&cqe(opcode::REQ, 0, 0x12_3456, 7));
        let c = poll(&ring, 2, 0).unwrap();
        assert_eq!((c.opcode, c.qpn, c.wqe_counter.get(), c.error), (opcode::REQ, 0x12_3456, 7, None));
        // second pass over slot 0 (ci = 4) needs owner 1
        assert!(poll(&ring, 2, 4).is_none());
        ring[..64].copy_from_slice(&cqe(opcode::REQ_ERR, 1, 0x1000_0042, 9));
        ring[SYNDROME_OFFSET] = syndrome::MW_BIND_ERR;
        let c = poll(&ring, 2, 4).unwrap();
        assert_eq!(c.error, Some((syndrome::MW_BIND_ERR, 0, 0x10)));
        assert_eq!(c.qpn, 0x42);
        // a ring shorter than the index claims is not read
        assert!(poll(&ring[..64], 2, 3).is_none());
        assert!(poll(&ring, 40, 0).is_none());
    }
}
