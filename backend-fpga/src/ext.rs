//! The **omw extension block**: the register map a modified bitstream adds to a vFPGA for
//! what OneSidedMW needs and stock Coyote lacks (docs/FPGA.md has the tables and the
//! hardware phases).
//!
//! * a responder-side **memory-key table** with **protection domains**: MRs and type-2
//!   memory windows, rkey = `index << 8 | key byte` (the byte drawn by the block's LFSR, never
//!   a function of the index), bounds, rights, PD and the bound QP checked on every incoming
//!   READ / WRITE / atomic;
//! * a **chain sequencer**: per-QP send and receive rings of the core's canonical WQEs
//!   ([`omw_core::wire::wqe`]) in engine-visible memory, managed queues (WAIT / ENABLE), completion
//!   rings with WR ids and `ibv_wc_status` codes, atomics incl. masked fetch-and-add,
//!   BIND_MW / UNBIND / LOCAL_INV, WRITE_WITH_IMM, SEND / RECV scatter.
//!
//! **Where**: the vFPGA's user CSR region (`MMAP_CTRL`, 64 KiB, [`crate::regs::MMAP_CTRL_OFFSET`]),
//! which the user logic decodes itself (`cThread::setCSR` / `getCSR`) — no change to the
//! shell's `cnfg_slave` decoder. All indexes are 64-bit words relative to the block base
//! (default [`DEFAULT_BASE`]). The block is detected by reading [`ID`]: user logic without it
//! reads 0 there (the double; a real user design may return anything, so [`MAGIC`] is checked).
//!
//! **Completion of a register command**: host writes are posted PCIe transactions, so "the
//! write returned" says nothing. Every command register (the key mailbox [`KEY_CMD`], a QP's
//! [`qp::CMD`]) has a status word with a BUSY bit that is set by the command write and a DONE
//! bit with the command's tag when its result is valid; the host polls the status word (a
//! non-posted read, which PCIe orders behind the earlier writes).
//!
//! **Concurrent host users**: the key mailbox is one per block. Its operands are ignored while
//! BUSY and a command written while BUSY is dropped (its tag never appears), and every result
//! carries the tag of the command it answers, so a user can tell its result from another's;
//! but two users interleaving operand writes would still mix operands. Host users of one
//! vFPGA therefore serialise mailbox use with Coyote's per-vFPGA lock (`cThread::lock()`, the
//! named `boost::interprocess` mutex `mutex_dev_<dev>_vfpa_<vfid>`); the omw MN is a single
//! process that owns the vFPGA, and one `FpgaBackend` (`!Sync`) issues every mailbox command.
//! A QP's registers belong to the one thread holding its ctid (the driver assigns ctids).

/// Default word index of the block in the user CSR region.
pub const DEFAULT_BASE: usize = 0;

/// RO `[63:32]` magic [`MAGIC`] ("OMWX"), `[31:16]` major, `[15:0]` minor version.
pub const ID: usize = 0;
/// RO feature bits ([`caps`]) `[31:0]`, key-table entries `[47:32]`, log2 of the largest ring
/// `[55:48]`.
pub const CAPS: usize = 1;
/// W: key-table operands (ignored while the mailbox is BUSY).
pub const KEY_ADDR: usize = 2;
pub const KEY_LEN: usize = 3;
pub const KEY_ACCESS: usize = 4;
/// W: key-table command: `[7:0]` [`key_cmd`], `[15:8]` tag echoed in [`KEY_RESULT`].
pub const KEY_CMD: usize = 5;
/// RO: the mailbox status and result: bit 63 error, bit 62 DONE, bit 61 BUSY, `[47:40]` tag of
/// the command answered, `[39:32]` error code ([`key_err`]), `[31:0]` the key (or PD).
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
/// W: PD operand of REG_MR and ALLOC_MW.
pub const KEY_PD: usize = 11;
/// RO: asynchronous error events (a QP entered the error state).
pub const EVENT_COUNT: usize = 16;
/// RO: last event: `[23:0]` QPN, `[31:24]` status, `[63:32]` low half of the WR id.
pub const LAST_EVENT: usize = 17;

pub const KEY_RESULT_ERROR: u64 = 1 << 63;
pub const KEY_RESULT_DONE: u64 = 1 << 62;
pub const KEY_RESULT_BUSY: u64 = 1 << 61;
pub const fn key_result_tag(r: u64) -> u8 {
    (r >> 40) as u8
}
pub const fn key_cmd_word(cmd: u64, tag: u8) -> u64 {
    (cmd & 0xFF) | (tag as u64) << 8
}

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
    /// RW: receive ring base ([`omw_core::wire::wqe::RECV_WQE_SIZE`]-byte entries).
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
    /// RW: the QP's protection domain (a PD from ALLOC_PD), taken by INIT.
    pub const PD: usize = 18;
    /// RO: status of the last [`CMD`]: bit 0 BUSY, bit 1 DONE, `[15:8]` the command.
    pub const CMD_STATUS: usize = 19;
}

pub const QP_CMD_BUSY: u64 = 1;
pub const QP_CMD_DONE: u64 = 2;

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
    /// Operands KEY_ADDR, KEY_LEN, KEY_ACCESS, KEY_PD; result lkey = rkey.
    pub const REG_MR: u64 = 1;
    /// Operand KEY_PD; result the window's rkey.
    pub const ALLOC_MW: u64 = 2;
    /// Operand KEY_ARG; result in MW_STATE / MW_BASE / MW_LEN_ACCESS.
    pub const QUERY_MW: u64 = 3;
    /// Result a new PD.
    pub const ALLOC_PD: u64 = 4;
    /// Operand KEY_ARG (the window's current rkey): frees the window, revoking any binding.
    pub const DEALLOC_MW: u64 = 5;
}

pub mod key_err {
    pub const NONE: u64 = 0;
    pub const TABLE_FULL: u64 = 1;
    pub const BAD_RANGE: u64 = 2;
    pub const BAD_ACCESS: u64 = 3;
    pub const NO_SUCH_KEY: u64 = 4;
    pub const UNKNOWN_CMD: u64 = 5;
    // 6 reserved (a command written while BUSY is dropped, it gets no result)
    /// The PD operand names no allocated PD.
    pub const BAD_PD: u64 = 7;
    /// The rkey names the window, but not with its current key byte.
    pub const STALE_KEY: u64 = 8;
}

pub const MAGIC: u32 = 0x4F4D_5758;
/// 2: the block moved to the user CSR region, status/tag completion, protection domains.
pub const VERSION_MAJOR: u16 = 2;
pub const VERSION_MINOR: u16 = 0;

pub const fn id_word() -> u64 {
    (MAGIC as u64) << 32 | (VERSION_MAJOR as u64) << 16 | VERSION_MINOR as u64
}

/// The key table's index space (rkey = `index << 8 | key byte`): MRs take indexes from
/// [`FIRST_MR_INDEX`] up to, not including, [`FIRST_MW_INDEX`]; windows from
/// [`FIRST_MW_INDEX`] (their count is [`CAPS`] `[47:32]`).
pub const FIRST_MR_INDEX: u32 = 1;
pub const FIRST_MW_INDEX: u32 = 0x1000;

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
    /// QPs, MRs and windows live in protection domains (ALLOC_PD, KEY_PD, `qp::PD`).
    pub const PROTECTION_DOMAINS: u64 = 1 << 8;
}

/// Opcode numberings the block must keep apart.
///
/// Coyote's vFPGA request interface carries, in one 5-bit opcode field, either `APP_*` opcodes
/// (`RDMA_MODE_PARSE`; `rdma_req_parser.sv` dispatches on `APP_READ` / `APP_WRITE` /
/// `APP_SEND`) or IB opcodes (`RDMA_MODE_RAW`), and the HLS stack's `ibOpCode` stops at
/// `RC_ACK` = 0x11 (`ib_transport_protocol.hpp`, Coyote bca3563). The `lynx_pkg` templates read
/// here (bca3563, 05090aa) define `APP_READ` .. `APP_IMMED` = 0..3 — the same numbers as the IB
/// RC SEND opcodes 0x00–0x03; DESIGN.md §6.3 reads another version as 0x12–0x15 — exactly the
/// IB atomic opcodes (Linux `include/rdma/ib_pack.h`: ATOMIC_ACKNOWLEDGE 0x12, COMPARE_SWAP
/// 0x13, FETCH_ADD 0x14). Either way an IB atomic opcode in that field is ambiguous, so the
/// block never puts one there: its atomics travel inside the stack as [`wire::EXT_FETCH_ADD`]
/// .. (0x18–0x1B: free in both `APP_*` numberings, in `ibOpCode` and among the IB RC opcodes
/// `ib_pack.h` defines) and become IB wire opcodes only in the packet generator
/// (`generate_ibh`), and back in `rx_process_ibh`.
pub mod wire {
    /// IB BTH opcodes of RC atomics (`ib_pack.h`, `IB_OPCODE_*`; the RC prefix is 0x00).
    pub const IB_ATOMIC_ACKNOWLEDGE: u8 = 0x12;
    pub const IB_COMPARE_SWAP: u8 = 0x13;
    pub const IB_FETCH_ADD: u8 = 0x14;
    /// Highest `ibOpCode` the stock HLS stack knows (`RC_ACK`).
    pub const COYOTE_RC_ACK: u8 = 0x11;
    /// `APP_READ`, `APP_WRITE`, `APP_SEND`, `APP_IMMED` as the `lynx_pkg` templates read here
    /// define them (Coyote bca3563 / 05090aa).
    pub const COYOTE_APP_LYNX_PKG: [u8; 4] = [0, 1, 2, 3];
    /// The same as DESIGN.md §6.3 reads another Coyote version (not found in the index).
    pub const COYOTE_APP_DESIGN: [u8; 4] = [0x12, 0x13, 0x14, 0x15];
    /// The block's stack-internal atomic opcodes (5-bit).
    pub const EXT_FETCH_ADD: u8 = 0x18;
    pub const EXT_COMPARE_SWAP: u8 = 0x19;
    /// Masked fetch-and-add: an omw-internal operation; it never leaves the engine (the
    /// chains run it on their loop QPs), so it has no wire opcode.
    pub const EXT_MASKED_FETCH_ADD: u8 = 0x1A;
    pub const EXT_ATOMIC_ACK: u8 = 0x1B;
    pub const EXT_ATOMICS: [u8; 4] = [EXT_FETCH_ADD, EXT_COMPARE_SWAP, EXT_MASKED_FETCH_ADD, EXT_ATOMIC_ACK];

    /// The IB wire opcode an internal atomic becomes in `generate_ibh` (`None`: never sent).
    pub const fn to_wire(internal: u8) -> Option<u8> {
        match internal {
            EXT_FETCH_ADD => Some(IB_FETCH_ADD),
            EXT_COMPARE_SWAP => Some(IB_COMPARE_SWAP),
            EXT_ATOMIC_ACK => Some(IB_ATOMIC_ACKNOWLEDGE),
            _ => None,
        }
    }
    /// The internal opcode `rx_process_ibh` turns a received IB atomic opcode into.
    pub const fn from_wire(ib: u8) -> Option<u8> {
        match ib {
            IB_FETCH_ADD => Some(EXT_FETCH_ADD),
            IB_COMPARE_SWAP => Some(EXT_COMPARE_SWAP),
            IB_ATOMIC_ACKNOWLEDGE => Some(EXT_ATOMIC_ACK),
            _ => None,
        }
    }
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
