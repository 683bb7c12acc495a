//! The stock Coyote v2 register map (legacy, non-AVX 64-bit registers: `CnfgLegRegs`).
//!
//! Indexes are 64-bit word indexes into the vFPGA's config region (`MMAP_CNFG`, 64 KiB);
//! the byte offset of register `r` is `r * 8`. Documented in docs/FPGA.md.

/// Write: source control word, pushes the command (written **last**). Read: commands in the
/// FIFO (depth [`crate::encoding::CMD_FIFO_DEPTH`]).
pub const CTRL_REG: usize = 0;
/// Source virtual address.
pub const VADDR_RD_REG: usize = 1;
/// Destination control word.
pub const CTRL_REG_2: usize = 2;
/// Destination virtual address.
pub const VADDR_WR_REG: usize = 3;
/// Interrupt status; the double sets [`ISR_DECODE_ERROR`], [`ISR_FIFO_OVERFLOW`],
/// [`ISR_PAGE_FAULT`] and [`ISR_REMOTE_ERROR`].
pub const ISR_REG: usize = 4;
pub const ISR_PID_MISS_REG: usize = 5;
pub const ISR_VADDR_MISS_REG: usize = 6;
pub const ISR_LEN_MISS_REG: usize = 7;
pub const STAT_REG_0: usize = 8;
pub const RDMA_CTX_REG_0: usize = 40;
pub const RDMA_CTX_REG_1: usize = 41;
/// Written last: commits the QP context of the QP named in `CTX[0]`.
pub const RDMA_CTX_REG_2: usize = 42;
pub const RDMA_CONN_REG_0: usize = 44;
pub const RDMA_CONN_REG_1: usize = 45;
/// Written last: commits the connection of the QP named in `CONN[0]`.
pub const RDMA_CONN_REG_2: usize = 46;
/// Local DMA counters, one register per ctid.
pub const STAT_DMA_REG: usize = 64;
/// RDMA completion counters, one register per ctid: `[31:0]` READs, `[63:32]` WRITEs and
/// SENDs; each moves only for commands with LAST; CLR_STAT zeroes both.
pub const STAT_RDMA_REG: usize = 128;
/// Words of the config region (`CNFG_REGION_SIZE` = 64 KiB).
pub const CNFG_REGION_WORDS: usize = 64 * 1024 / 8;
/// `mmap` offset of the config region on the vFPGA device file (`MMAP_CNFG`).
pub const MMAP_CNFG_OFFSET: u64 = 1 << 12;

/// ISR bits of the test double (the stock engine reports page faults through the driver).
pub const ISR_PAGE_FAULT: u64 = 1 << 0;
pub const ISR_DECODE_ERROR: u64 = 1 << 1;
pub const ISR_FIFO_OVERFLOW: u64 = 1 << 2;
pub const ISR_REMOTE_ERROR: u64 = 1 << 3;

pub const fn stat_rdma(ctid: u8) -> usize {
    STAT_RDMA_REG + ctid as usize
}
/// READ completions of a thread from its `STAT_RDMA_REG` word.
pub const fn reads_done(stat: u64) -> u32 {
    stat as u32
}
/// WRITE + SEND completions of a thread from its `STAT_RDMA_REG` word.
pub const fn writes_done(stat: u64) -> u32 {
    (stat >> 32) as u32
}
