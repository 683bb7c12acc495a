//! What the shim needs from the Coyote kernel driver: the shell's configuration, Coyote
//! thread ids (ctids) and the engine's IP address — the `ioctl`s `cThread`'s constructor
//! issues (`sw/src/cThread.cpp`, Coyote 4459deb), with the numbers and argument layouts of
//! `sw/include/coyote/cDefs.hpp` (same commit).
//!
//! The driver, not the application, assigns ctids: a thread registers with
//! `IOCTL_REGISTER_CTID` and gets its ctid back, and a vFPGA's QP number is
//! `(vfid << 6) | ctid`. [`crate::device::DevMmio`] issues the real `ioctl`s; the test double
//! ([`crate::double::SimMmio`]) answers them from its model.

use core::fmt;

/// `_IOC` encoding of the asm-generic `ioctl` numbers (`dir << 30 | size << 16 | type << 8 | nr`).
const fn ioc(dir: u64, nr: u64) -> u64 {
    dir << 30 | (core::mem::size_of::<u64>() as u64) << 16 | (b'F' as u64) << 8 | nr
}
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

/// `_IOW('F', 1, unsigned long)`: `args[0]` = hpid in, `args[1]` = ctid out.
pub const IOCTL_REGISTER_CTID: u64 = ioc(IOC_WRITE, 1);
/// `_IOW('F', 2, unsigned long)`: `args[0]` = ctid.
pub const IOCTL_UNREGISTER_CTID: u64 = ioc(IOC_WRITE, 2);
/// `_IOR('F', 13, unsigned long)`: `args[0]` = the engine's IPv4 address (host order).
pub const IOCTL_GET_IP_ADDRESS: u64 = ioc(IOC_READ, 13);
/// `_IOR('F', 15, unsigned long)`: `args[0]` = shell configuration word ([`ShellConfig`]),
/// `args[1]` = the `CTRL_CNFG_REG` word (TLB geometry).
pub const IOCTL_READ_SHELL_CONFIG: u64 = ioc(IOC_READ, 15);
/// The argument block every Coyote `ioctl` takes: `uint64_t tmp[MAX_USER_ARGS]`.
pub const MAX_USER_ARGS: usize = 32;
/// Coyote threads per vFPGA (`N_CTID_MAX`).
pub const N_CTID_MAX: usize = 64;

/// The shell's synthesis configuration, as `fpgaCnfg::parseCnfg` decodes it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub struct ShellConfig {
    /// `EN_AVX`: the config region is `cnfg_slave_avx` (256-bit registers), not the legacy map.
    pub en_avx: bool,
    /// `EN_WB`: completion counters are also written back to host memory.
    pub en_wb: bool,
    pub en_strm: bool,
    pub en_mem: bool,
    pub en_pr: bool,
    pub en_rdma: bool,
    pub en_tcp: bool,
    pub n_xdma_chan: u8,
    pub n_fpga_reg: u8,
}

impl ShellConfig {
    /// `parseCnfg`: bits 0 avx, 1 wb, 2 strm, 3 mem, 4 pr, 16 rdma, 17 tcp, `[39:32]` XDMA
    /// channels, `[55:48]` vFPGAs.
    pub const fn parse(w: u64) -> ShellConfig {
        ShellConfig {
            en_avx: w & 1 != 0,
            en_wb: (w >> 1) & 1 != 0,
            en_strm: (w >> 2) & 1 != 0,
            en_mem: (w >> 3) & 1 != 0,
            en_pr: (w >> 4) & 1 != 0,
            en_rdma: (w >> 16) & 1 != 0,
            en_tcp: (w >> 17) & 1 != 0,
            n_xdma_chan: (w >> 32) as u8,
            n_fpga_reg: (w >> 48) as u8,
        }
    }
    pub const fn encode(&self) -> u64 {
        self.en_avx as u64
            | (self.en_wb as u64) << 1
            | (self.en_strm as u64) << 2
            | (self.en_mem as u64) << 3
            | (self.en_pr as u64) << 4
            | (self.en_rdma as u64) << 16
            | (self.en_tcp as u64) << 17
            | (self.n_xdma_chan as u64) << 32
            | (self.n_fpga_reg as u64) << 48
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum DriverError {
    /// An `ioctl` failed; `errno` as the kernel returned it.
    Ioctl { name: &'static str, errno: i32 },
    /// Every ctid of the vFPGA is taken.
    NoFreeCtid,
    /// The driver returned a ctid outside `0..64`.
    BadCtid(u64),
}

impl fmt::Display for DriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DriverError::Ioctl { name, errno } => write!(f, "Coyote driver ioctl {name} failed (errno {errno})"),
            DriverError::NoFreeCtid => write!(f, "all {N_CTID_MAX} Coyote thread ids of the vFPGA are taken"),
            DriverError::BadCtid(c) => write!(f, "the Coyote driver returned ctid {c}, outside 0..{N_CTID_MAX}"),
        }
    }
}

impl std::error::Error for DriverError {}

/// The driver calls of one vFPGA device file.
pub trait CoyoteDriver {
    fn shell_config(&self) -> Result<ShellConfig, DriverError>;
    /// `IOCTL_REGISTER_CTID` for host process `hpid`: the driver picks the ctid.
    fn register_ctid(&self, hpid: u32) -> Result<u8, DriverError>;
    fn unregister_ctid(&self, ctid: u8) -> Result<(), DriverError>;
    /// The engine's IPv4 address, host order (`IOCTL_GET_IP_ADDRESS`).
    fn ip_address(&self) -> Result<u32, DriverError>;
}

impl<D: CoyoteDriver + ?Sized> CoyoteDriver for &D {
    fn shell_config(&self) -> Result<ShellConfig, DriverError> {
        (**self).shell_config()
    }
    fn register_ctid(&self, hpid: u32) -> Result<u8, DriverError> {
        (**self).register_ctid(hpid)
    }
    fn unregister_ctid(&self, ctid: u8) -> Result<(), DriverError> {
        (**self).unregister_ctid(ctid)
    }
    fn ip_address(&self) -> Result<u32, DriverError> {
        (**self).ip_address()
    }
}
