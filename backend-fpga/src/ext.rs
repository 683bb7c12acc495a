//! The **omw extension block**: the register map a modified bitstream adds next to the stock
//! engine, for what OneSidedMW needs and stock Coyote lacks (docs/FPGA.md has the tables).
//!
//! * a responder-side **memory-key table**: MRs and type-2 memory windows, with rkey =
//!   `index << 8 | key`, bounds, rights and the bound QP checked on every incoming
//!   READ / WRITE / atomic;
//! * a **chain sequencer**: per-QP send and receive rings of the core's canonical WQEs
//!   ([`omw_core::wqe`]) in engine-visible memory, managed queues (WAIT / ENABLE), completion
//!   rings with WR ids and `ibv_wc_status` codes, atomics incl. masked fetch-and-add,
//!   BIND_MW / UNBIND / LOCAL_INV, WRITE_WITH_IMM, SEND / RECV scatter.
//!
//! All indexes are 64-bit words relative to the block base (configurable; default
//! [`DEFAULT_BASE`], inside the vFPGA's config region). The block is detected by reading
//! [`ID`]: a stock bitstream reads 0 there.

/// Default word index of the block in the config region (byte offset 0x1000).
pub const DEFAULT_BASE: usize = 0x200;

/// RO `[63:32]` magic [`MAGIC`] ("OMWX"), `[31:16]` major, `[15:0]` minor version.
pub const ID: usize = 0;
/// RO feature bits ([`caps`]) `[31:0]`, MW table entries `[47:32]`, log2 of the largest ring
/// `[55:48]`.
pub const CAPS: usize = 1;
/// W: key-table operands.
pub const KEY_ADDR: usize = 2;
pub const KEY_LEN: usize = 3;
pub const KEY_ACCESS: usize = 4;
/// W: key-table command ([`key_cmd`]); the result is in [`KEY_RESULT`] when the write returns.
pub const KEY_CMD: usize = 5;
/// RO: `[31:0]` the key, bit 63 error, `[39:32]` error code ([`key_err`]).
pub const KEY_RESULT: usize = 6;
/// W: rkey operand of QUERY_MW.
pub const KEY_ARG: usize = 7;
/// RO after QUERY_MW: `[31:0]` current rkey, bit 32 bound, bit 33 allocated, `[63:40]` bound
/// QPN.
pub const MW_STATE: usize = 8;
/// RO after QUERY_MW: window start.
pub const MW_BASE: usize = 9;
/// RO after QUERY_MW: `[31:0]` window length, `[63:32]` access flags.
pub const MW_LEN_ACCESS: usize = 10;
/// W: the rkey a stock command (CTRL_REG path) carries to the responder; latched with the
/// next `CTRL_REG` write. Without a write the QP context's rkey is used.
pub const CMD_RKEY: usize = 12;
/// RO: asynchronous error events (a QP entered the error state).
pub const EVENT_COUNT: usize = 16;
/// RO: last event: `[23:0]` QPN, `[31:24]` status, `[63:32]` low half of the WR id.
pub const LAST_EVENT: usize = 17;

/// First per-QP window; QP `ctid` owns words `QP_BASE + ctid * QP_STRIDE ..`.
pub const QP_BASE: usize = 64;
pub const QP_STRIDE: usize = 32;
/// Words the block spans.
pub const BLOCK_WORDS: usize = QP_BASE + 64 * QP_STRIDE;

/// Per-QP registers (offsets inside a QP window).
pub mod qp {
    /// RW: send ring base (64-byte canonical WQEs).
    pub const SQ_BASE: usize = 0;
    /// RW: log2 of the send ring depth (the ring exists when its base is non-zero).
    pub const SQ_LOG_DEPTH: usize = 1;
    /// RW: receive ring base ([`omw_core::wqe::RECV_WQE_SIZE`]-byte entries).
    pub const RQ_BASE: usize = 2;
    pub const RQ_LOG_DEPTH: usize = 3;
    /// RW: completion ring of the send queue ([`super::CQE_SIZE`]-byte entries).
    pub const SCQ_BASE: usize = 4;
    /// RW: completion ring of the receive queue.
    pub const RCQ_BASE: usize = 5;
    /// RW: log2 of both completion rings' depth.
    pub const CQ_LOG_DEPTH: usize = 6;
    /// RW: [`super::QP_FLAG_MANAGED`].
    pub const FLAGS: usize = 7;
    /// W: [`super::qp_cmd`].
    pub const CMD: usize = 8;
    /// RO: `ibv_qp_state` numbering (0 RESET, 1 INIT, 2 RTR, 3 RTS, 6 ERR).
    pub const STATE: usize = 9;
    /// RW: send producer index (doorbell). On an unmanaged queue it is also the execution limit.
    pub const SQ_PI: usize = 10;
    /// W: add to the send execution limit (managed queues); R: the limit.
    pub const SQ_ENABLE: usize = 11;
    /// RO: index of the next send entry the sequencer fetches.
    pub const SQ_CI: usize = 12;
    /// RO: completions written to the send completion ring (the count WAIT compares).
    pub const SCQ_COUNT: usize = 13;
    pub const RQ_PI: usize = 14;
    pub const RQ_ENABLE: usize = 15;
    /// RO: index of the next receive entry an incoming SEND / WRITE_WITH_IMM consumes.
    pub const RQ_CI: usize = 16;
    pub const RCQ_COUNT: usize = 17;
}

pub const QP_FLAG_MANAGED: u64 = 1;

pub mod qp_cmd {
    /// Apply the ring configuration; the QP becomes RTS once its connection is committed.
    pub const INIT: u64 = 1;
    /// Error → RTS with empty queues, zeroed indexes and counts (the local QP, and its peer
    /// when the peer is on the same engine).
    pub const RESET: u64 = 2;
    /// Tear the QP down: rings unconfigured, connection forgotten, state RESET; requests
    /// arriving for it are not answered.
    pub const DESTROY: u64 = 3;
}

pub mod key_cmd {
    pub const REG_MR: u64 = 1;
    pub const ALLOC_MW: u64 = 2;
    pub const QUERY_MW: u64 = 3;
}

pub mod key_err {
    pub const NONE: u64 = 0;
    pub const TABLE_FULL: u64 = 1;
    pub const BAD_RANGE: u64 = 2;
    pub const BAD_ACCESS: u64 = 3;
    pub const NO_SUCH_KEY: u64 = 4;
    pub const UNKNOWN_CMD: u64 = 5;
}

pub const KEY_RESULT_ERROR: u64 = 1 << 63;

pub const MAGIC: u32 = 0x4F4D_5758;
pub const VERSION_MAJOR: u16 = 1;
pub const VERSION_MINOR: u16 = 0;

pub const fn id_word() -> u64 {
    (MAGIC as u64) << 32 | (VERSION_MAJOR as u64) << 16 | VERSION_MINOR as u64
}

/// Feature bits of [`CAPS`].
pub mod caps {
    /// Responder-side MR / type-2 MW table; every incoming READ/WRITE/atomic is checked.
    pub const KEY_TABLE: u64 = 1 << 0;
    /// The chain sequencer (canonical WQE rings, managed queues, WAIT/ENABLE).
    pub const SEQUENCER: u64 = 1 << 1;
    pub const ATOMICS: u64 = 1 << 2;
    pub const MASKED_FETCH_ADD: u64 = 1 << 3;
    pub const SEND_WITH_INV: u64 = 1 << 4;
    /// BIND_MW's qpn field may name another QP of the engine.
    pub const BIND_TO_OTHER_QP: u64 = 1 << 5;
    /// LOCAL_INV is refused unless posted on the bound QP.
    pub const INV_QP_CHECK: u64 = 1 << 6;
    /// Accesses are checked against the window's bounds.
    pub const MW_BOUNDS: u64 = 1 << 7;
}

/// Completion ring entry.
///
/// ```text
/// off len field
///   0  8  wr_id
///   8  1  status      enum ibv_wc_status
///   9  1  opcode      canonical WQE opcode of a send completion; 0x80 RECV,
///                     0x81 RECV_RDMA_WITH_IMM
///  10  1  flags       bit 0 imm valid, bit 1 invalidated rkey valid
///  11  1  reserved
///  12  4  byte_len
///  16  4  imm
///  20  4  qpn         the local QP
///  24  4  invalidated rkey (SEND_WITH_INV received)
///  28  4  reserved
/// ```
pub const CQE_SIZE: usize = 32;
pub const CQE_OP_RECV: u8 = 0x80;
pub const CQE_OP_RECV_RDMA_WITH_IMM: u8 = 0x81;
pub const CQE_FLAG_IMM: u8 = 1;
pub const CQE_FLAG_INV: u8 = 2;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub struct Cqe {
    pub wr_id: u64,
    pub status: u8,
    pub opcode: u8,
    pub flags: u8,
    pub byte_len: u32,
    pub imm: u32,
    pub qpn: u32,
    pub invalidated: u32,
}

impl Cqe {
    pub fn encode(&self) -> [u8; CQE_SIZE] {
        let mut b = [0u8; CQE_SIZE];
        b[0..8].copy_from_slice(&self.wr_id.to_le_bytes());
        b[8] = self.status;
        b[9] = self.opcode;
        b[10] = self.flags;
        b[12..16].copy_from_slice(&self.byte_len.to_le_bytes());
        b[16..20].copy_from_slice(&self.imm.to_le_bytes());
        b[20..24].copy_from_slice(&self.qpn.to_le_bytes());
        b[24..28].copy_from_slice(&self.invalidated.to_le_bytes());
        b
    }
    pub fn decode(b: &[u8; CQE_SIZE]) -> Cqe {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[0..8]);
        Cqe {
            wr_id: u64::from_le_bytes(w),
            status: b[8],
            opcode: b[9],
            flags: b[10],
            byte_len: u32_at(12),
            imm: u32_at(16),
            qpn: u32_at(20),
            invalidated: u32_at(24),
        }
    }
}

/// Word index of per-QP register `reg` of `ctid`, relative to the block base.
pub const fn qp_reg(ctid: u8, reg: usize) -> usize {
    QP_BASE + ctid as usize * QP_STRIDE + reg
}
