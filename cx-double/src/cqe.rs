//! The 64-byte CQEs the double writes into a CQ's umem, in the double's own reading of the
//! layouts: DPDK `drivers/common/mlx5/mlx5_prm.h` `struct mlx5_cqe` (`byte_cnt` at 44,
//! `timestamp` 48, `sop_drop_qpn` 56, `wqe_counter` 60, `op_own` 63) and `struct
//! mlx5_error_cqe` (`vendor_err_synd` 54, `syndrome` 55, `s_wqe_opcode_qpn` 56); the
//! responder's immediate / invalidated rkey at 36, which DPDK's Ethernet-side struct calls
//! `flow_table_metadata`, from rdma-core `mlx5dv.h` `struct mlx5_cqe64` (`imm_inval_pkey`).
//! CQE opcodes and syndromes: DPDK `drivers/common/mlx5/windows/mlx5_win_defs.h`
//! (`MLX5_CQE_REQ` …, `MLX5_CQE_SYNDROME_*`), the same values as rdma-core's `mlx5dv.h`.
//!
//! Ownership: the entry at producer index *pi* of a CQ of 2^*n* entries carries owner bit
//! (*pi* >> *n*) & 1, so software (which expects (ci >> n) & 1) sees a new pass's entry only
//! once the device wrote it (rdma-core `get_sw_cqe`).

use omw_core::device::{Completion, WcOpcode, WcStatus};
use omw_core::wire::wqe::Opcode;

pub const CQE_BYTES: usize = 64;

const IMM: usize = 36;
const BYTE_CNT: usize = 44;
const TIMESTAMP: usize = 48;
const SOP_DROP_QPN: usize = 56;
const WQE_COUNTER: usize = 60;
const OP_OWN: usize = 63;
const VENDOR_SYND: usize = 54;
const SYNDROME: usize = 55;

/// CQE opcodes (the high nibble of `op_own`).
pub mod op {
    pub const REQ: u8 = 0;
    pub const RESP_WR_IMM: u8 = 1;
    pub const RESP_SEND: u8 = 2;
    pub const RESP_SEND_IMM: u8 = 3;
    pub const RESP_SEND_INV: u8 = 4;
    pub const REQ_ERR: u8 = 13;
    pub const RESP_ERR: u8 = 14;
}

/// The syndrome an error completion reports (`MLX5_CQE_SYNDROME_*`).
pub fn syndrome(s: WcStatus) -> u8 {
    match s {
        WcStatus::LocLenErr => 0x01,
        WcStatus::LocQpOpErr => 0x02,
        WcStatus::LocProtErr => 0x04,
        WcStatus::WrFlushErr => 0x05,
        WcStatus::MwBindErr => 0x06,
        WcStatus::BadRespErr => 0x10,
        WcStatus::LocAccessErr => 0x11,
        WcStatus::RemInvReqErr => 0x12,
        WcStatus::RemAccessErr => 0x13,
        WcStatus::RemOpErr => 0x14,
        WcStatus::RetryExcErr => 0x15,
        WcStatus::RnrRetryExcErr => 0x16,
        // no closer syndrome: `MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR`
        _ => 0x22,
    }
}

/// The mlx5 WQE opcode of a send completion's operation (`MLX5_OPCODE_*`, for an error
/// CQE's `s_wqe_opcode`).
fn wqe_opcode(op: Opcode) -> u8 {
    match op {
        Opcode::Nop => 0x00,
        Opcode::SendWithInv => 0x01,
        Opcode::Write => 0x08,
        Opcode::WriteWithImm => 0x09,
        Opcode::Send => 0x0a,
        Opcode::SendWithImm => 0x0b,
        Opcode::Read => 0x10,
        Opcode::CompareSwap => 0x11,
        Opcode::FetchAdd => 0x12,
        Opcode::MaskedFetchAdd => 0x15,
        Opcode::BindMw | Opcode::LocalInv => 0x25,
        Opcode::Wait => 0x0f,
        Opcode::Enable => 0x17,
    }
}

/// The CQE of `c` (its wr_id is the WQE index, as the model reports it for a QP on a device's
/// terms) at producer index `pi` of a CQ of 2^`log_size` entries, completed at `at` ns.
pub fn encode(c: &Completion, pi: u64, log_size: u8, at: u64) -> [u8; CQE_BYTES] {
    let mut b = [0u8; CQE_BYTES];
    let owner = ((pi >> log_size) & 1) as u8;
    let counter = (c.wr_id & 0xFFFF) as u16;
    let qpn = c.qpn.get() & 0x00FF_FFFF;
    b[WQE_COUNTER..WQE_COUNTER + 2].copy_from_slice(&counter.to_be_bytes());
    b[TIMESTAMP..TIMESTAMP + 8].copy_from_slice(&at.to_be_bytes());
    let recv = matches!(c.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm);
    let opcode = if !c.status.is_ok() {
        b[SYNDROME] = syndrome(c.status);
        b[VENDOR_SYND] = 0;
        let wqe_op = match c.opcode {
            WcOpcode::Send(o) => wqe_opcode(o),
            _ => 0,
        };
        b[SOP_DROP_QPN..SOP_DROP_QPN + 4].copy_from_slice(&((wqe_op as u32) << 24 | qpn).to_be_bytes());
        if recv {
            op::RESP_ERR
        } else {
            op::REQ_ERR
        }
    } else {
        b[SOP_DROP_QPN..SOP_DROP_QPN + 4].copy_from_slice(&qpn.to_be_bytes());
        b[BYTE_CNT..BYTE_CNT + 4].copy_from_slice(&c.byte_len.to_be_bytes());
        match (c.opcode, c.imm, c.invalidated) {
            (WcOpcode::RecvRdmaWithImm, imm, _) => {
                b[IMM..IMM + 4].copy_from_slice(&imm.unwrap_or(0).to_be_bytes());
                op::RESP_WR_IMM
            }
            (WcOpcode::Recv, _, Some(rkey)) => {
                b[IMM..IMM + 4].copy_from_slice(&rkey.0.to_be_bytes());
                op::RESP_SEND_INV
            }
            (WcOpcode::Recv, Some(imm), None) => {
                b[IMM..IMM + 4].copy_from_slice(&imm.to_be_bytes());
                op::RESP_SEND_IMM
            }
            (WcOpcode::Recv, None, None) => op::RESP_SEND,
            _ => op::REQ,
        }
    };
    b[OP_OWN] = opcode << 4 | owner;
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use omw_core::ids::{Qpn, Rkey};

    fn done(opcode: WcOpcode, status: WcStatus) -> Completion {
        Completion {
            wr_id: 0x1_0007,
            status,
            opcode,
            qpn: Qpn::new(0x12_3456).unwrap(),
            byte_len: 40,
            ..Completion::EMPTY
        }
    }

    #[test]
    fn entries_carry_counter_owner_opcode_and_syndrome() {
        let b = encode(&done(WcOpcode::Send(Opcode::Read), WcStatus::Success), 5, 2, 99);
        assert_eq!(&b[60..62], &[0, 7], "wqe_counter is the WQE index, 16 bits");
        assert_eq!(b[63], op::REQ << 4 | 1, "pass 1 of a 4-entry CQ: owner 1");
        assert_eq!(&b[56..60], &[0, 0x12, 0x34, 0x56]);
        assert_eq!(&b[44..48], &40u32.to_be_bytes());
        let e = encode(&done(WcOpcode::Send(Opcode::Write), WcStatus::RemAccessErr), 0, 2, 0);
        assert_eq!((e[63] >> 4, e[55], e[56]), (op::REQ_ERR, 0x13, 0x08));
        let r = encode(&done(WcOpcode::Recv, WcStatus::WrFlushErr), 0, 2, 0);
        assert_eq!((r[63] >> 4, r[55]), (op::RESP_ERR, 0x05));
        let inv = Completion { invalidated: Some(Rkey(0xAABB_CCDD)), ..done(WcOpcode::Recv, WcStatus::Success) };
        let i = encode(&inv, 0, 2, 0);
        assert_eq!((i[63] >> 4, &i[36..40]), (op::RESP_SEND_INV, &[0xAA, 0xBB, 0xCC, 0xDD][..]));
    }
}
