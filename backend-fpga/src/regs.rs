//! The stock Coyote v2 register map of a vFPGA's config region — the **legacy** (non-AVX)
//! 64-bit register file `cnfg_slave` (`CnfgLegRegs` in `cDefs.hpp`).
//!
//! Indexes are 64-bit word indexes into the config region (`MMAP_CNFG`, 64 KiB); the byte
//! offset of register `r` is `r * 8`. Read and write behaviour is `hw/hdl/shell/cnfg_slave.sv`
//! (Coyote f1ef0b0): the register file exists only on builds with `EN_AVX=0`; the default
//! hardware build instantiates `cnfg_slave_avx` (256-bit registers at `MMAP_CNFG_AVX`, the
//! [`avx`] map), which this shim refuses ([`crate::driver::ShellConfig`]). Documented in
//! docs/FPGA.md §2.

/// W: source control word; the write is what posts a command (see
/// [`crate::encoding::CtrlWord`] for when it does). R: `[31:0]` commands in the FIFO
/// (`local_queue_used`).
pub const CTRL_REG: usize = 0;
/// Source virtual address (read back `[47:0]`).
pub const VADDR_RD_REG: usize = 1;
/// Destination control word. A plain register: it keeps its value (START included) until
/// the next write — a `CTRL_REG` write without START re-posts a command whose `CTRL_REG_2`
/// still carries START.
pub const CTRL_REG_2: usize = 2;
/// Destination virtual address (read back `[47:0]`).
pub const VADDR_WR_REG: usize = 3;
/// Interrupt control. W: the [`isr`] bits, pulses (the register's low byte is cleared every
/// cycle). R: `[31:16]` interrupt type, bit 32 invalidation control ready, bit 33 page-fault
/// control ready, `[49:48]` stream and bit 56 write-side of the last page fault.
pub const ISR_REG: usize = 4;
/// R: `[5:0]` pid, `[63:32]` hpid of the last fault.
pub const ISR_PID_MISS_REG: usize = 5;
/// R: `[47:0]` virtual address of the last page fault.
pub const ISR_VADDR_MISS_REG: usize = 6;
/// R: `[27:0]` length of the last page fault, `[63:32]` notification value.
pub const ISR_LEN_MISS_REG: usize = 7;
/// Commands sent: local reads, local writes, remote reads, remote writes (8–11).
pub const STAT_REG_0: usize = 8;
/// W: IPv4 address to resolve (`doArpLookup`); the shell byte-swaps `[31:0]` into network
/// order (`m_arp_lookup_request.data[i*8+:8] = wdata[24-i*8+:8]`). R: bit 0 ready.
pub const NET_ARP_REG: usize = 36;
pub const RDMA_CTX_REG_0: usize = 40;
pub const RDMA_CTX_REG_1: usize = 41;
/// W: written last, raises `valid` on the QP-context interface; the interface's data is
/// wired to `CTX_0..2` themselves, so writing them again before the stack took the context
/// changes what it takes. R: bit 0 = the interface's `ready`, **not** the data.
pub const RDMA_CTX_REG_2: usize = 42;
pub const RDMA_CONN_REG_0: usize = 44;
pub const RDMA_CONN_REG_1: usize = 45;
/// W / R: as [`RDMA_CTX_REG_2`], for the connection interface.
pub const RDMA_CONN_REG_2: usize = 46;
/// Local DMA counters, one register per ctid.
pub const STAT_DMA_REG: usize = 64;
/// RDMA completion counters, one register per ctid: `[31:0]` READs, `[63:32]` WRITEs and
/// SENDs; each moves only for commands with LAST. CLR_STAT in `CTRL_REG` zeroes the READ
/// counter, CLR_STAT in `CTRL_REG_2` the WRITE counter.
pub const STAT_RDMA_REG: usize = 128;
/// Words of the config region (`CNFG_REGION_SIZE` = 64 KiB).
pub const CNFG_REGION_WORDS: usize = 64 * 1024 / 8;
/// `mmap` offset of the legacy config region on the vFPGA device file (`MMAP_CNFG`).
pub const MMAP_CNFG_OFFSET: u64 = 0x1 << 12;
/// `mmap` offset of the AVX config region (`MMAP_CNFG_AVX`, 256 KiB, `EN_AVX=1` builds).
pub const MMAP_CNFG_AVX_OFFSET: u64 = 0x2 << 12;
/// `mmap` offset of the vFPGA's user CSR region (`MMAP_CTRL`, 64 KiB; `cThread::setCSR` /
/// `getCSR`). Decoded by the user logic, not the shell: where the omw extension block lives.
pub const MMAP_CTRL_OFFSET: u64 = 0x3 << 12;
/// Words of the user CSR region (`CTRL_REGION_SIZE` = 64 KiB).
pub const CTRL_REGION_WORDS: usize = 64 * 1024 / 8;

/// `ISR_REG` write bits (`cnfg_slave.sv` localparams `ISR_*`).
pub mod isr {
    pub const CLR_IRQ_PENDING: u64 = 1 << 0;
    /// Restart the read (write) side after a page fault; with [`SUCCESS`] it was served.
    pub const RESTART_RD: u64 = 1 << 1;
    pub const RESTART_WR: u64 = 1 << 2;
    pub const SUCCESS: u64 = 1 << 3;
    /// Post a TLB invalidation (`ISR_INVLDT`), with `INVLDT_LAST` / `INVLDT_LOCK`.
    pub const INVLDT: u64 = 1 << 4;
    pub const INVLDT_LAST: u64 = 1 << 5;
    pub const INVLDT_LOCK: u64 = 1 << 6;
    /// Read side: invalidation control ready.
    pub const STAT_INVLDT_READY: u64 = 1 << 32;
    /// Read side: page-fault control ready.
    pub const STAT_PFAULT_READY: u64 = 1 << 33;
}

/// The AVX map (`CnfgAvxRegs`, 256-bit registers), for reference: its commands are one
/// 256-bit store (`_mm256_set_epi64x(vaddr_wr, ctrl_2, vaddr_rd, ctrl)`), which the 64-bit
/// [`crate::mmio::Mmio`] cannot express. The shim refuses `EN_AVX=1` shells.
pub mod avx {
    pub const CTRL_REG: usize = 0;
    pub const ISR_REG: usize = 1;
    pub const NET_ARP_REG: usize = 9;
    pub const RDMA_CTX_REG: usize = 10;
    pub const RDMA_CONN_REG: usize = 11;
    pub const STAT_DMA_REG: usize = 64;
    /// Bytes of the AVX config region (`CNFG_AVX_REGION_SIZE`).
    pub const REGION_BYTES: usize = 256 * 1024;
}

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
