//! [`RdmaBackend`](omw_core::device::RdmaBackend) over the engine: a thin translation of the core's canonical WQEs.
//!
//! * **Stock engine** (no extension block): READ, WRITE and SEND become one engine command
//!   each (always with LAST), pushed through [`crate::mmio::post_command`]. The engine reports
//!   nothing but two in-order counters per thread, so the shim keeps the posted WRs in order
//!   per counter class (READs; WRITEs + SENDs) and turns counter movement back into
//!   completions with their WR ids — always `Success`: the stock engine has no error status.
//!   The remote rkey lives in the QP context (one per QP), a SEND is one packet that lands in
//!   the remote vFPGA's stream, and there are no receive queues, atomics or memory windows.
//!   Opening reads the shell configuration (`IOCTL_READ_SHELL_CONFIG`) and refuses AVX shells;
//!   ctids come from the driver (`IOCTL_REGISTER_CTID`); a connection is the QP context, the
//!   connection and an ARP lookup, each committed only when the shell's interface is ready.
//! * **With the omw extension block** (in the vFPGA's user CSR region): every WQE goes, byte
//!   for byte, into the QP's send ring in engine-visible memory and a doorbell register;
//!   completions are read back from the completion rings with WR id and `ibv_wc_status`.
//!   Memory keys, windows, protection domains and chains are the block's; register commands
//!   complete when their status word says DONE. The backend declares what the block's
//!   capability register says.

use crate::driver::{CoyoteDriver, DriverError, ShellConfig, N_CTID_MAX};
use crate::encoding::{
    self, Command, ConnContext, EncodeError, OpcodeEncoding, QpContext, RdmaOp, RdmaRequest, CMD_FIFO_LIMIT,
    DEFAULT_PMTU, MAX_LEN_FIELD, MAX_OUTSTANDING_READS, MAX_OUTSTANDING_WRITES, MAX_TRANSFER_SIZE, MAX_VADDR,
};
use crate::ext::{self as map, qp as q, Cqe, CQE_SIZE};
use crate::memory::{HostMemory, MemError};
use crate::mmio::{self, Mmio, MmioError};
use crate::regs;
use crate::secure::{secure_protocol_mode, SecureProtocolError};
use omw_core::access::AccessFlags;
use omw_core::device::{Capabilities, Completion, ExecutionMode, MrKeys, MwBinding, QpState, WcOpcode, WcStatus};
use omw_core::ids::{Qpn, Rkey};
use omw_core::mn::capacity::DeviceLimits;
use omw_core::wire::wqe::{Opcode, QueueSel, RecvWqe, Wqe, WqeError, WqeFlags, RECV_WQE_SIZE, WQE_SIZE};
use std::cell::Cell;
use std::collections::VecDeque;

/// Register polls a command may take before the shim gives up (the engine is stuck or gone).
pub const MAX_POLLS: u32 = 100_000;

use omw_core::chain::mlx5::Mlx5Arm;
use omw_core::chain::mlx5::Mlx5Chain;
use omw_core::device::DataPath;
/// Which protection domain an object of the extension block lives in (the two the MN needs,
/// DESIGN.md §9): the core's.
pub use omw_core::device::Domain;
use omw_core::device::OffloadRings;
use omw_core::device::Provision;
use omw_core::device::WindowState;
use std::fmt;

/// Which limit stopped a request before anything was written to the engine.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Backpressure {
    /// The command FIFO holds more than `CMD_FIFO_DEPTH - CMD_FIFO_THR` (22) commands.
    CommandFifoFull { in_flight: u64 },
    /// The QP has the maximum of 16 WRITE/SEND requests outstanding.
    OutstandingWrites { limit: u32 },
    /// The QP has the maximum of 8 READ requests outstanding.
    OutstandingReads { limit: u32 },
}

#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    Mmio(MmioError),
    Memory(MemError),
    Encode(EncodeError),
    /// The QP number is not one of this vFPGA's (`(vfid << 6) | ctid`).
    UnknownQp(u32),
    QpNotConnected(Qpn),
    /// Extension block: the QP has no rings ([`FpgaBackend::create_qp`] first).
    QpNotSetUp(Qpn),
    Driver(DriverError),
    /// The shell was built with `EN_AVX=1`: its config region is `cnfg_slave_avx` (256-bit
    /// registers at `MMAP_CNFG_AVX`), which this shim does not drive.
    AvxShell(ShellConfig),
    /// The shell was built without RDMA (`EN_RDMA=0`).
    NoRdma(ShellConfig),
    /// The ctid was not handed to this backend by the driver (`IOCTL_REGISTER_CTID`).
    CtidNotRegistered(u8),
    /// A register command or interface did not finish within [`MAX_POLLS`] polls.
    NotReady {
        what: &'static str,
    },
    /// An RC SEND of the stock engine is one packet: at most one PMTU.
    SendTooLong {
        len: u32,
        pmtu: u32,
    },
    /// The object would have to be registered in a domain this configuration does not have.
    NoSuchDomain(Domain),
    /// The engine cannot do this at all; `why` says what is missing.
    Unsupported {
        what: &'static str,
        why: &'static str,
    },
    /// A length over the engine's 28-bit length field.
    LengthOverflow {
        len: u64,
    },
    /// A length over Coyote's 128 MiB transfer limit.
    TransferTooLarge {
        len: u64,
    },
    /// An address over the engine's 48-bit virtual addresses.
    AddressOverflow {
        addr: u64,
    },
    /// The engine would have to queue more than it allows; nothing was sent.
    Backpressure {
        qp: Qpn,
        limit: Backpressure,
    },
    /// Stock engine: the QP context carries one remote rkey; a WQE naming another cannot be
    /// expressed.
    RkeyNotInContext {
        qp: Qpn,
        rkey: u32,
        context: u32,
    },
    /// The ring has no free entry.
    QueueFull {
        qp: Qpn,
        queue: QueueSel,
    },
    /// The WQE would not decode on the engine.
    Wqe(WqeError),
    /// The extension block's key table refused (`ext::key_err` code).
    KeyTable {
        code: u64,
    },
    /// Not enough ring memory left for the QP's rings.
    ArenaExhausted {
        need: u64,
    },
    /// The extension block reports a major version this shim does not speak.
    ExtensionVersion {
        major: u16,
        minor: u16,
    },
    Secure(SecureProtocolError),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Mmio(e) => write!(f, "register access failed: {e}"),
            Error::Memory(e) => write!(f, "engine memory access failed: {e}"),
            Error::Encode(e) => write!(f, "cannot encode for the engine: {e}"),
            Error::UnknownQp(q) => write!(f, "QP {q:#x} is not a QP of this vFPGA"),
            Error::QpNotConnected(q) => write!(f, "QP {q} has no connection (connect_qp first)"),
            Error::QpNotSetUp(q) => write!(f, "QP {q} has no rings (create_qp first)"),
            Error::Driver(e) => write!(f, "{e}"),
            Error::AvxShell(c) => write!(
                f,
                "the FPGA shell was built with AVX config registers (EN_AVX=1, cnfg_slave_avx; shell config {:#x}); \
                 this shim drives only the legacy 64-bit register file (EN_AVX=0): rebuild the shell without AVX",
                c.encode()
            ),
            Error::NoRdma(c) => write!(f, "the FPGA shell was built without RDMA (shell config {:#x})", c.encode()),
            Error::CtidNotRegistered(c) => {
                write!(f, "Coyote thread id {c} was not registered by this backend (the driver assigns ctids)")
            }
            Error::NotReady { what } => write!(f, "{what} did not complete within {MAX_POLLS} register polls"),
            Error::SendTooLong { len, pmtu } => {
                write!(f, "a SEND of {len} bytes exceeds one packet (PMTU {pmtu}) on the stock engine")
            }
            Error::NoSuchDomain(d) => write!(f, "this engine has no {d:?} protection domain"),
            Error::Unsupported { what, why } => write!(f, "{what} is not supported: {why}"),
            Error::LengthOverflow { len } => {
                write!(f, "length {len} exceeds the engine's {}-bit length field", encoding::LEN_BITS)
            }
            Error::TransferTooLarge { len } => {
                write!(f, "length {len} exceeds the engine's transfer limit of {MAX_TRANSFER_SIZE} bytes")
            }
            Error::AddressOverflow { addr } => {
                write!(f, "address {addr:#x} exceeds the engine's {}-bit virtual addresses", encoding::VADDR_BITS)
            }
            Error::Backpressure { qp, limit } => match limit {
                Backpressure::CommandFifoFull { in_flight } => {
                    write!(
                        f,
                        "engine command FIFO holds {in_flight} commands, more than Coyote's margin allows \
                         ({CMD_FIFO_LIMIT} of 32); nothing sent on QP {qp}"
                    )
                }
                Backpressure::OutstandingWrites { limit } => {
                    write!(f, "QP {qp} already has {limit} WRITE/SEND requests outstanding; nothing sent")
                }
                Backpressure::OutstandingReads { limit } => {
                    write!(f, "QP {qp} already has {limit} READ requests outstanding; nothing sent")
                }
            },
            Error::RkeyNotInContext { qp, rkey, context } => write!(
                f,
                "QP {qp}: rkey {rkey:#x} differs from the rkey {context:#x} in the QP context (the stock engine carries one rkey per QP)"
            ),
            Error::QueueFull { qp, queue } => write!(f, "{queue:?} queue of QP {qp} is full"),
            Error::Wqe(e) => write!(f, "malformed WQE: {e}"),
            Error::KeyTable { code } => write!(f, "extension block key table refused (code {code})"),
            Error::ArenaExhausted { need } => write!(f, "ring memory exhausted ({need} more bytes needed)"),
            Error::ExtensionVersion { major, minor } => {
                write!(f, "omw extension block version {major}.{minor} is not supported (need 1.x)")
            }
            Error::Secure(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<MmioError> for Error {
    fn from(e: MmioError) -> Self {
        Error::Mmio(e)
    }
}
impl From<MemError> for Error {
    fn from(e: MemError) -> Self {
        Error::Memory(e)
    }
}
impl From<DriverError> for Error {
    fn from(e: DriverError) -> Self {
        Error::Driver(e)
    }
}
impl From<EncodeError> for Error {
    fn from(e: EncodeError) -> Self {
        Error::Encode(e)
    }
}

/// How to reach the engine.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct FpgaConfig {
    pub vfid: u8,
    /// Firmware opcode numbering (two versions exist; see [`OpcodeEncoding`]).
    pub encoding: OpcodeEncoding,
    /// This engine's IPv4 address, host order (used to recognise same-node peers). Replaced
    /// at open by what the driver reports (`IOCTL_GET_IP_ADDRESS`).
    pub local_ip: u32,
    /// Word index of the extension block in the user CSR region.
    pub ext_base: usize,
    /// Engine-visible memory the backend carves rings from (extension block only).
    pub ring_arena: Option<(u64, u64)>,
    /// The stack's path MTU (`PMTU_BYTES` of the build).
    pub pmtu: u32,
    /// Coyote threads to register with the driver at open (each is a QP of this backend).
    pub threads: u8,
    /// Host process id passed to `IOCTL_REGISTER_CTID`.
    pub hpid: u32,
    /// Engine-visible memory `alloc_memory` hands out (pool, metadata, buffers), bump-allocated.
    pub node_memory: Option<(u64, u64)>,
}

impl FpgaConfig {
    pub fn new(vfid: u8, encoding: OpcodeEncoding, local_ip: u32) -> Self {
        FpgaConfig {
            vfid,
            encoding,
            local_ip,
            ext_base: map::DEFAULT_BASE,
            ring_arena: None,
            pmtu: DEFAULT_PMTU,
            threads: 0,
            hpid: std::process::id(),
            node_memory: None,
        }
    }
    pub fn with_node_memory(mut self, base: u64, len: u64) -> Self {
        self.node_memory = Some((base, len));
        self
    }
    pub fn with_ring_arena(mut self, base: u64, len: u64) -> Self {
        self.ring_arena = Some((base, len));
        self
    }
    pub fn with_threads(mut self, n: u8) -> Self {
        self.threads = n;
        self
    }
}

/// The other end of a QP, as the out-of-band exchange learned it (Coyote's `ibvQ`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct QpConnect {
    pub remote_qpn: u32,
    pub remote_ip: u32,
    pub local_psn: u32,
    pub remote_psn: u32,
    /// Stock engine: the one rkey every request of the QP carries.
    pub remote_rkey: u32,
    /// Stock engine: where SENDs land on the remote side.
    pub remote_vaddr: u64,
    pub port: u16,
}

/// Ring sizes of a QP on the extension block (powers of two; 0 = no such ring).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct QpSetup {
    /// Managed queues run only what ENABLE lets them (chain QPs).
    pub managed: bool,
    pub sq_depth: u32,
    pub rq_depth: u32,
    pub cq_depth: u32,
    /// The QP's protection domain.
    pub domain: Domain,
}

impl QpSetup {
    pub const fn plain(sq_depth: u32, rq_depth: u32) -> Self {
        QpSetup { managed: false, sq_depth, rq_depth, cq_depth: 64, domain: Domain::CnFacing }
    }
    pub const fn managed(sq_depth: u32, rq_depth: u32) -> Self {
        QpSetup { managed: true, sq_depth, rq_depth, cq_depth: 256, domain: Domain::CnFacing }
    }
    pub const fn in_domain(mut self, d: Domain) -> Self {
        self.domain = d;
        self
    }
}

#[derive(Clone, Copy, Debug)]
struct PendingWr {
    seq: u64,
    wr_id: u64,
    op: Opcode,
    len: u32,
    signaled: bool,
}

#[derive(Clone, Copy, Debug, Default)]
struct Rings {
    sq_base: u64,
    sq_depth: u64,
    rq_base: u64,
    rq_depth: u64,
    scq_base: u64,
    rcq_base: u64,
    cq_depth: u64,
}

#[derive(Clone, Debug, Default)]
struct QpShim {
    conn: Option<QpConnect>,
    // stock: WRs posted and not yet counted, per counter class
    reads: VecDeque<PendingWr>,
    writes: VecDeque<PendingWr>,
    reads_seen: u32,
    writes_seen: u32,
    done: VecDeque<Completion>,
    // extension block
    rings: Option<Rings>,
    sq_pi: u64,
    rq_pi: u64,
    scq_seen: u64,
    rcq_seen: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct ExtInfo {
    caps: u64,
    major: u16,
    minor: u16,
}

/// The PDs of the two domains on the extension block. A block without protection domains
/// has PD 0 only: it has no private domain (asking for one is `NoSuchDomain`, never PD 0,
/// which the CN-facing QPs are in).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Pds {
    cn_facing: u32,
    mn_private: Option<u32>,
}

/// The omw backend for one vFPGA of a Coyote v2 / BALBOA engine.
#[derive(Debug)]
pub struct FpgaBackend<M: Mmio + CoyoteDriver, H: HostMemory> {
    /// The legacy config region (`MMAP_CNFG`); also the driver's file.
    mmio: M,
    /// The user CSR region (`MMAP_CTRL`): the extension block.
    csr: M,
    mem: H,
    cfg: FpgaConfig,
    shell: ShellConfig,
    ext: Option<ExtInfo>,
    pds: Option<Pds>,
    qps: Vec<QpShim>,
    ctids: [bool; N_CTID_MAX],
    arena_next: u64,
    /// Next free byte of `FpgaConfig::node_memory`.
    memory_next: u64,
    /// The ring arena in the MN-private domain, with remote rights.
    ring_keys: Option<MrKeys>,
    /// The ring arena in the CN-facing domain, local access only.
    ring_keys_local: Option<MrKeys>,
    seq: u64,
    lost_completions: u64,
    /// Tag of the last key-mailbox command (results carry it back).
    tag: Cell<u8>,
}

fn check_addr(addr: u64) -> Result<(), Error> {
    if addr > MAX_VADDR {
        Err(Error::AddressOverflow { addr })
    } else {
        Ok(())
    }
}

fn check_len(len: u64) -> Result<(), Error> {
    if len > MAX_LEN_FIELD {
        Err(Error::LengthOverflow { len })
    } else if len > MAX_TRANSFER_SIZE {
        Err(Error::TransferTooLarge { len })
    } else {
        Ok(())
    }
}

impl<M: Mmio + CoyoteDriver, H: HostMemory> FpgaBackend<M, H> {
    /// Probe the engine: the shell configuration and IP address from the driver, the
    /// extension block's ID in the user CSR region; then register `cfg.threads` ctids, and
    /// with the block allocate the two PDs and register the ring arena.
    pub fn open(mmio: M, csr: M, mem: H, mut cfg: FpgaConfig) -> Result<Self, Error> {
        if cfg.vfid > encoding::MAX_VFID {
            return Err(EncodeError::VfidOverflow(cfg.vfid).into());
        }
        let shell = mmio.shell_config()?;
        if shell.en_avx {
            return Err(Error::AvxShell(shell));
        }
        if !shell.en_rdma {
            return Err(Error::NoRdma(shell));
        }
        cfg.local_ip = mmio.ip_address()?;
        let id = csr.read_csr(cfg.ext_base + map::ID)?;
        let ext = if (id >> 32) as u32 == map::MAGIC {
            let (major, minor) = ((id >> 16) as u16, id as u16);
            if major != map::VERSION_MAJOR {
                return Err(Error::ExtensionVersion { major, minor });
            }
            Some(ExtInfo { caps: csr.read_csr(cfg.ext_base + map::CAPS)?, major, minor })
        } else {
            None
        };
        let mut b = FpgaBackend {
            mmio,
            csr,
            mem,
            cfg,
            shell,
            ext,
            pds: None,
            qps: vec![QpShim::default(); N_CTID_MAX],
            ctids: [false; N_CTID_MAX],
            arena_next: cfg.ring_arena.map(|a| a.0).unwrap_or(0),
            memory_next: cfg.node_memory.map(|a| a.0).unwrap_or(0),
            ring_keys: None,
            ring_keys_local: None,
            seq: 0,
            lost_completions: 0,
            tag: Cell::new(0),
        };
        for _ in 0..cfg.threads {
            b.register_thread()?;
        }
        if let Some(e) = b.ext {
            b.pds = Some(if e.caps & map::caps::PROTECTION_DOMAINS == 0 {
                Pds { cn_facing: 0, mn_private: None }
            } else {
                let cn_facing = b.key_command(map::key_cmd::ALLOC_PD, &[])?;
                let mn_private = b.key_command(map::key_cmd::ALLOC_PD, &[])?;
                Pds { cn_facing, mn_private: Some(mn_private) }
            });
            if let Some((base, len)) = cfg.ring_arena {
                // chains patch and bump their own WQEs through the loop QPs: the rings need
                // remote rights, in the MN-private domain only
                let access = AccessFlags::LOCAL_WRITE
                    | AccessFlags::REMOTE_READ
                    | AccessFlags::REMOTE_WRITE
                    | AccessFlags::REMOTE_ATOMIC;
                if b.pd(Domain::MnPrivate).is_ok() {
                    b.ring_keys = Some(b.reg_mr_in(Domain::MnPrivate, base, len, access)?);
                }
                // CN-facing chain QPs scatter requests into ring WQEs: a local-only registration
                b.ring_keys_local = Some(b.reg_mr_in(Domain::CnFacing, base, len, AccessFlags::LOCAL_WRITE)?);
            }
        }
        Ok(b)
    }

    /// Register one more Coyote thread with the driver; its ctid (chosen by the driver)
    /// names a QP of this backend.
    pub fn register_thread(&mut self) -> Result<u8, Error> {
        let c = self.mmio.register_ctid(self.cfg.hpid)?;
        if c as usize >= N_CTID_MAX {
            return Err(DriverError::BadCtid(c as u64).into());
        }
        self.ctids[c as usize] = true;
        // cThread's constructor: clearCompleted() for the new thread
        mmio::post_command(&self.mmio, &Command::clear_stat(c))?;
        self.qps[c as usize] = QpShim::default();
        Ok(c)
    }

    /// The ctids this backend holds.
    pub fn threads(&self) -> impl Iterator<Item = u8> + '_ {
        (0..N_CTID_MAX as u8).filter(|c| self.ctids[*c as usize])
    }

    fn registered(&self, ctid: u8) -> Result<(), Error> {
        if (ctid as usize) < N_CTID_MAX && self.ctids[ctid as usize] {
            Ok(())
        } else {
            Err(Error::CtidNotRegistered(ctid))
        }
    }

    /// The shell configuration the driver reported.
    pub fn shell(&self) -> ShellConfig {
        self.shell
    }

    /// The PD number of a domain (extension block only).
    pub fn pd(&self, d: Domain) -> Result<u32, Error> {
        let p = self.pds.ok_or(Error::NoSuchDomain(d))?;
        Ok(match d {
            Domain::CnFacing => p.cn_facing,
            Domain::MnPrivate => p.mn_private.ok_or(Error::NoSuchDomain(d))?,
        })
    }

    /// `reg_mr` into a domain: what the core's `reg_mr(domain, ..)` will call.
    pub fn reg_mr_in(&mut self, d: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys, Error> {
        check_addr(addr)?;
        check_addr(addr.saturating_add(len).saturating_sub(1))?;
        if self.ext.is_none() {
            // the stock engine translates through the vFPGA TLB the driver fills; it has no
            // keys (Coyote hard-codes the local rkey to 0)
            return Ok(MrKeys { lkey: 0, rkey: 0 });
        }
        let pd = self.pd(d)?;
        let r = self.key_command(
            map::key_cmd::REG_MR,
            &[
                (map::KEY_ADDR, addr),
                (map::KEY_LEN, len),
                (map::KEY_ACCESS, access.bits() as u64),
                (map::KEY_PD, pd as u64),
            ],
        )?;
        Ok(MrKeys { lkey: r, rkey: r })
    }

    /// `alloc_mw` in a domain (windows belong with the pool: [`Domain::CnFacing`]).
    pub fn alloc_mw_in(&mut self, d: Domain) -> Result<Rkey, Error> {
        if self.ext.is_none() {
            return Err(Error::Unsupported {
                what: "memory windows",
                why: "the stock engine has no memory windows and no responder-side rkey check",
            });
        }
        let pd = self.pd(d)?;
        Ok(Rkey(self.key_command(map::key_cmd::ALLOC_MW, &[(map::KEY_PD, pd as u64)])?))
    }

    /// Free a window (its current rkey), revoking any binding (`mw_rules::check_dealloc`).
    pub fn dealloc_mw(&mut self, rkey: Rkey) -> Result<(), Error> {
        if self.ext.is_none() {
            return Self::unsupported_stock("memory windows");
        }
        self.key_command(map::key_cmd::DEALLOC_MW, &[(map::KEY_ARG, rkey.0 as u64)]).map(|_| ())
    }

    /// The ring arena's keys in a domain: MN-private with remote rights (the loop QPs patch
    /// rings), CN-facing local-only (CN-facing chain QPs may scatter into rings, but no
    /// CN-facing QP can reach a ring remotely with any key).
    pub fn ring_keys_in(&self, d: Domain) -> Result<MrKeys, Error> {
        if self.ext.is_none() {
            return Self::unsupported_stock("WQE rings");
        }
        let k = match d {
            Domain::MnPrivate => {
                self.pd(d)?;
                self.ring_keys
            }
            Domain::CnFacing => self.ring_keys_local,
        };
        k.ok_or(Error::ArenaExhausted { need: 1 })
    }

    /// One key-mailbox command: operands, the command with a fresh tag, then poll the status
    /// word until it is DONE with that tag.
    fn key_command(&self, cmd: u64, operands: &[(usize, u64)]) -> Result<u32, Error> {
        let tag = self.tag.get().wrapping_add(1);
        self.tag.set(tag);
        for (reg, v) in operands {
            self.csr.write_csr(self.ext_reg(*reg), *v)?;
        }
        self.csr.write_csr(self.ext_reg(map::KEY_CMD), map::key_cmd_word(cmd, tag))?;
        for _ in 0..MAX_POLLS {
            let r = self.csr.read_csr(self.ext_reg(map::KEY_RESULT))?;
            if r & map::KEY_RESULT_DONE == 0 || map::key_result_tag(r) != tag {
                continue;
            }
            if r & map::KEY_RESULT_ERROR != 0 {
                return Err(Error::KeyTable { code: (r >> 32) & 0xFF });
            }
            return Ok(r as u32);
        }
        Err(Error::NotReady { what: "extension key-table command" })
    }

    /// A QP command, polled to completion.
    fn qp_command(&self, ctid: u8, cmd: u64) -> Result<(), Error> {
        self.csr.write_csr(self.qp_reg(ctid, q::CMD), cmd)?;
        for _ in 0..MAX_POLLS {
            let st = self.csr.read_csr(self.qp_reg(ctid, q::CMD_STATUS))?;
            if st & map::QP_CMD_DONE != 0 && st & map::QP_CMD_BUSY == 0 && (st >> 8) & 0xFF == cmd {
                return Ok(());
            }
        }
        Err(Error::NotReady { what: "extension QP command" })
    }

    /// Poll a shell interface's ready bit (`RDMA_CTX_REG_2`, `RDMA_CONN_REG_2`, `NET_ARP_REG`
    /// read back `ready`): a commit written while the previous one waits would change it.
    fn wait_ready(&self, reg: usize, what: &'static str) -> Result<(), Error> {
        for _ in 0..MAX_POLLS {
            if self.mmio.read_csr(reg)? & 1 != 0 {
                return Ok(());
            }
        }
        Err(Error::NotReady { what })
    }

    /// What this vFPGA can hold, as the core's capacity check takes it
    /// (`omw_core::mn::capacity::Footprint::check`, the check `omw plan` prints for verbs
    /// devices): one QP per Coyote thread this backend holds (a vFPGA has at most
    /// [`N_CTID_MAX`]: QPN = `vfid << 6 | ctid`, and the extension block has a register block
    /// for each of those 64 QPs); windows as many as the key table's window entries
    /// (`CAPS[47:32]`); MRs the indexes below the first window's ([`map::FIRST_MW_INDEX`]).
    /// Windows and MRs are separate index ranges of one table, so not `shared_keys`. The stock
    /// engine has no key table: no windows, no registrations.
    pub fn device_limits(&self) -> DeviceLimits {
        let max_qp = self.threads().count() as u64;
        match self.ext {
            Some(e) if e.caps & map::caps::KEY_TABLE != 0 => DeviceLimits {
                max_mw: (e.caps >> 32) & 0xFFFF,
                max_mr: (map::FIRST_MW_INDEX - map::FIRST_MR_INDEX) as u64,
                max_qp,
                shared_keys: false,
            },
            _ => DeviceLimits { max_mw: 0, max_mr: 0, max_qp, shared_keys: false },
        }
    }

    /// Whether the omw extension block is present, and its version.
    pub fn extension(&self) -> Option<(u16, u16)> {
        self.ext.map(|e| (e.major, e.minor))
    }
    pub fn config(&self) -> &FpgaConfig {
        &self.cfg
    }
    pub fn mmio(&self) -> &M {
        &self.mmio
    }
    /// The user CSR region (the extension block's registers).
    pub fn user_csr(&self) -> &M {
        &self.csr
    }
    pub fn memory(&self) -> &H {
        &self.mem
    }
    /// Completions that were overwritten in a completion ring before they were polled.
    pub fn lost_completions(&self) -> u64 {
        self.lost_completions
    }

    /// The execution mode the MN would run on this device, or a refusal that explains why.
    pub fn secure_mode(&self) -> Result<ExecutionMode, SecureProtocolError> {
        secure_protocol_mode(self.capabilities())
    }

    /// This vFPGA's QP number of a Coyote thread.
    pub fn qpn(&self, ctid: u8) -> Result<Qpn, Error> {
        let v = encoding::qpn(self.cfg.vfid, ctid)?;
        Qpn::new(v).map_err(|_| Error::UnknownQp(v))
    }

    fn ctid(&self, qp: Qpn) -> Result<u8, Error> {
        match encoding::split_qpn(qp.get()) {
            Some((v, c)) if v == self.cfg.vfid => Ok(c),
            _ => Err(Error::UnknownQp(qp.get())),
        }
    }

    fn ext_reg(&self, reg: usize) -> usize {
        self.cfg.ext_base + reg
    }
    fn qp_reg(&self, ctid: u8, reg: usize) -> usize {
        self.cfg.ext_base + map::qp_reg(ctid, reg)
    }

    /// Connect a QP as `cThread::initRDMA` does: the QP context and the connection
    /// (`writeQpContext`), then an ARP lookup of the peer (`doArpLookup`); the thread's counters
    /// were cleared when it was registered, as `cThread`'s constructor does. Unlike Coyote,
    /// which sleeps `SLEEP_TIME` after the writes, each commit waits for its interface's `ready`.
    pub fn connect_qp(&mut self, ctid: u8, c: &QpConnect) -> Result<Qpn, Error> {
        self.registered(ctid)?;
        let qpn = self.qpn(ctid)?;
        let same_node = c.remote_ip == self.cfg.local_ip;
        if same_node && self.ext.is_none() {
            return Err(Error::Unsupported {
                what: "a same-node connection on the stock engine",
                why: "the stock RoCE stack does not loop back (Coyote's cThread::invoke copies in software when \
                      local and remote IP match); the chains' loop QPs need the extension block's internal loopback",
            });
        }
        let ctx = QpContext {
            local_qpn: qpn.get(),
            remote_rkey: c.remote_rkey,
            local_psn: c.local_psn,
            remote_psn: c.remote_psn,
            remote_vaddr: c.remote_vaddr,
        }
        .encode()?;
        let conn =
            ConnContext { local_qpn: qpn.get(), remote_qpn: c.remote_qpn, port: c.port as u32, remote_ip: c.remote_ip }
                .encode()?;
        self.wait_ready(regs::RDMA_CTX_REG_2, "QP context interface")?;
        mmio::write_block(&self.mmio, regs::RDMA_CTX_REG_0, ctx)?;
        self.wait_ready(regs::RDMA_CTX_REG_2, "QP context interface")?;
        mmio::write_block(&self.mmio, regs::RDMA_CONN_REG_0, conn)?;
        self.wait_ready(regs::RDMA_CONN_REG_2, "connection interface")?;
        if !same_node {
            self.wait_ready(regs::NET_ARP_REG, "ARP lookup")?;
            self.mmio.write_csr(regs::NET_ARP_REG, c.remote_ip as u64)?;
            self.wait_ready(regs::NET_ARP_REG, "ARP lookup")?;
        }
        // requests of an earlier connection will not be reported: count from where the
        // counters stand now (the thread's counters were cleared when it was registered)
        let stat = self.mmio.read_csr(regs::stat_rdma(ctid))?;
        let s = &mut self.qps[ctid as usize];
        s.conn = Some(*c);
        s.reads.clear();
        s.writes.clear();
        s.reads_seen = regs::reads_done(stat);
        s.writes_seen = regs::writes_done(stat);
        Ok(qpn)
    }

    /// Extension block: give a QP its rings (carved from the ring arena) and initialise it.
    pub fn create_qp(&mut self, ctid: u8, setup: QpSetup) -> Result<Qpn, Error> {
        self.registered(ctid)?;
        let qpn = self.qpn(ctid)?;
        if self.ext.is_none() {
            return Err(Error::Unsupported {
                what: "QP rings",
                why: "the stock engine has no work-queue rings; it takes commands through CTRL_REG",
            });
        }
        let max_log = self.ext.map(|e| (e.caps >> 48) & 0xFF).unwrap_or(0) as u32;
        for d in [setup.sq_depth, setup.rq_depth, setup.cq_depth] {
            if d != 0 && !d.is_power_of_two() {
                return Err(Error::Unsupported {
                    what: "a ring depth that is not a power of two",
                    why: "rings wrap by masking",
                });
            }
            if d != 0 && d.trailing_zeros() > max_log {
                return Err(Error::Unsupported {
                    what: "a ring deeper than the extension block's CAPS allows",
                    why: "CAPS[55:48] is the log2 of the largest ring the block takes",
                });
            }
        }
        let (arena_base, arena_len) = self.cfg.ring_arena.ok_or(Error::ArenaExhausted { need: 1 })?;
        let sizes = [
            setup.sq_depth as u64 * WQE_SIZE as u64,
            setup.rq_depth as u64 * RECV_WQE_SIZE as u64,
            setup.cq_depth as u64 * CQE_SIZE as u64,
            setup.cq_depth as u64 * CQE_SIZE as u64,
        ];
        let mut bases = [0u64; 4];
        let mut next = self.arena_next;
        for (i, s) in sizes.iter().enumerate() {
            if *s == 0 {
                continue;
            }
            next = next.div_ceil(64) * 64;
            bases[i] = next;
            next += s;
        }
        if next > arena_base + arena_len {
            return Err(Error::ArenaExhausted { need: next - (arena_base + arena_len) });
        }
        // fresh rings read as zeros (NOPs never run: limits are 0)
        for (b, s) in bases.iter().zip(sizes) {
            if s > 0 {
                self.mem.write(*b, &vec![0u8; s as usize])?;
            }
        }
        self.arena_next = next;
        let log = |d: u32| if d == 0 { 0 } else { d.trailing_zeros() as u64 };
        let cfg = [
            (q::SQ_BASE, bases[0]),
            (q::SQ_LOG_DEPTH, log(setup.sq_depth)),
            (q::RQ_BASE, bases[1]),
            (q::RQ_LOG_DEPTH, log(setup.rq_depth)),
            (q::SCQ_BASE, bases[2]),
            (q::RCQ_BASE, bases[3]),
            (q::CQ_LOG_DEPTH, log(setup.cq_depth)),
            (q::FLAGS, if setup.managed { map::QP_FLAG_MANAGED } else { 0 }),
            (q::PD, self.pd(setup.domain)? as u64),
        ];
        for (r, v) in cfg {
            let reg = self.qp_reg(ctid, r);
            self.csr.write_csr(reg, v)?;
        }
        self.qp_command(ctid, map::qp_cmd::INIT)?;
        let s = &mut self.qps[ctid as usize];
        s.rings = Some(Rings {
            sq_base: bases[0],
            sq_depth: setup.sq_depth as u64,
            rq_base: bases[1],
            rq_depth: setup.rq_depth as u64,
            scq_base: bases[2],
            rcq_base: bases[3],
            cq_depth: setup.cq_depth as u64,
        });
        s.sq_pi = 0;
        s.rq_pi = 0;
        s.scq_seen = 0;
        s.rcq_seen = 0;
        Ok(qpn)
    }

    // ---- stock engine path ------------------------------------------------------------------

    /// Post one WQE as a stock engine command (the path [`RdmaBackend::post_send`](omw_core::device::DataPath::post_send) takes
    /// without the extension block). The rkey a stock command carries is the QP context's;
    /// an extension block at the responder checks it.
    pub fn post_stock(&mut self, qp: Qpn, wqe: &Wqe) -> Result<(), Error> {
        let ctid = self.ctid(qp)?;
        let conn = self.qps[ctid as usize].conn.ok_or(Error::QpNotConnected(qp))?;
        let op = match wqe.opcode {
            Opcode::Read => RdmaOp::Read,
            Opcode::Write => RdmaOp::Write,
            Opcode::Send => RdmaOp::Send,
            _ => {
                return Err(Error::Unsupported {
                    what: wqe.opcode.name(),
                    why: "the stock engine executes only RDMA READ, WRITE and SEND",
                })
            }
        };
        check_len(wqe.length as u64)?;
        if op == RdmaOp::Send && wqe.length > self.cfg.pmtu {
            return Err(Error::SendTooLong { len: wqe.length, pmtu: self.cfg.pmtu });
        }
        check_addr(wqe.local_addr)?;
        let remote = if op == RdmaOp::Send { conn.remote_vaddr } else { wqe.remote_addr };
        check_addr(remote)?;
        if op != RdmaOp::Send && wqe.rkey != conn.remote_rkey {
            return Err(Error::RkeyNotInContext { qp, rkey: wqe.rkey, context: conn.remote_rkey });
        }
        self.refresh_counters(ctid)?;
        let s = &self.qps[ctid as usize];
        if op == RdmaOp::Read && s.reads.len() as u32 >= MAX_OUTSTANDING_READS {
            return Err(Error::Backpressure {
                qp,
                limit: Backpressure::OutstandingReads { limit: MAX_OUTSTANDING_READS },
            });
        }
        if op.is_write_class() && s.writes.len() as u32 >= MAX_OUTSTANDING_WRITES {
            return Err(Error::Backpressure {
                qp,
                limit: Backpressure::OutstandingWrites { limit: MAX_OUTSTANDING_WRITES },
            });
        }
        // Coyote's margin: post only while at most CMD_FIFO_DEPTH - CMD_FIFO_THR are queued
        let in_flight = mmio::commands_in_flight(&self.mmio)? & 0xFFFF_FFFF;
        if in_flight > CMD_FIFO_LIMIT {
            return Err(Error::Backpressure { qp, limit: Backpressure::CommandFifoFull { in_flight } });
        }
        let cmd = Command::rdma(self.cfg.encoding, &RdmaRequest::new(op, ctid, wqe.local_addr, remote, wqe.length))?;
        mmio::post_command(&self.mmio, &cmd)?;
        self.seq += 1;
        let p = PendingWr {
            seq: self.seq,
            wr_id: wqe.wr_id,
            op: wqe.opcode,
            len: wqe.length,
            signaled: wqe.flags.contains(WqeFlags::SIGNALED),
        };
        let s = &mut self.qps[ctid as usize];
        if op == RdmaOp::Read {
            s.reads.push_back(p);
        } else {
            s.writes.push_back(p);
        }
        Ok(())
    }

    /// Turn counter movement into completions, in posting order.
    fn refresh_counters(&mut self, ctid: u8) -> Result<(), Error> {
        let stat = self.mmio.read_csr(regs::stat_rdma(ctid))?;
        let qpn = self.qpn(ctid)?;
        let s = &mut self.qps[ctid as usize];
        let (rd, wr) = (regs::reads_done(stat), regs::writes_done(stat));
        let mut newly: Vec<PendingWr> = Vec::new();
        let n = (rd.wrapping_sub(s.reads_seen) as usize).min(s.reads.len());
        newly.extend(s.reads.drain(..n));
        s.reads_seen = s.reads_seen.wrapping_add(n as u32);
        let n = (wr.wrapping_sub(s.writes_seen) as usize).min(s.writes.len());
        newly.extend(s.writes.drain(..n));
        s.writes_seen = s.writes_seen.wrapping_add(n as u32);
        newly.sort_by_key(|p| p.seq);
        for p in newly.into_iter().filter(|p| p.signaled) {
            s.done.push_back(Completion {
                wr_id: p.wr_id,
                status: WcStatus::Success,
                opcode: WcOpcode::Send(p.op),
                qpn,
                byte_len: p.len,
                imm: None,
                invalidated: None,
            });
        }
        Ok(())
    }

    // ---- extension block path -----------------------------------------------------------------

    fn rings(&self, qp: Qpn) -> Result<(u8, Rings), Error> {
        let ctid = self.ctid(qp)?;
        self.qps[ctid as usize].rings.map(|r| (ctid, r)).ok_or(Error::QpNotSetUp(qp))
    }

    fn ext_post_send(&mut self, qp: Qpn, wqe: &Wqe) -> Result<(), Error> {
        let (ctid, r) = self.rings(qp)?;
        if r.sq_depth == 0 {
            return Err(Error::QpNotSetUp(qp));
        }
        let bytes = wqe.encode();
        Wqe::decode(&bytes).map_err(Error::Wqe)?;
        let data_op =
            !matches!(wqe.opcode, Opcode::Nop | Opcode::Wait | Opcode::Enable | Opcode::BindMw | Opcode::LocalInv);
        if data_op {
            if wqe.length as u64 > MAX_LEN_FIELD {
                return Err(Error::LengthOverflow { len: wqe.length as u64 });
            }
            check_addr(wqe.local_addr)?;
            if wqe.opcode.is_remote() {
                check_addr(wqe.remote_addr)?;
            }
        }
        let ci = self.csr.read_csr(self.qp_reg(ctid, q::SQ_CI))?;
        let s = &self.qps[ctid as usize];
        if s.sq_pi.saturating_sub(ci) >= r.sq_depth {
            return Err(Error::QueueFull { qp, queue: QueueSel::Send });
        }
        let pi = s.sq_pi;
        self.mem.write(r.sq_base + (pi % r.sq_depth) * WQE_SIZE as u64, &bytes)?;
        core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
        let reg = self.qp_reg(ctid, q::SQ_PI);
        self.csr.write_csr(reg, pi + 1)?;
        self.qps[ctid as usize].sq_pi = pi + 1;
        Ok(())
    }

    fn ext_poll(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize, Error> {
        let (ctid, r) = self.rings(qp)?;
        let recv = queue == QueueSel::Recv;
        let count = self.csr.read_csr(self.qp_reg(ctid, if recv { q::RCQ_COUNT } else { q::SCQ_COUNT }))?;
        let base = if recv { r.rcq_base } else { r.scq_base };
        if r.cq_depth == 0 || base == 0 {
            return Ok(0);
        }
        let mut seen = if recv { self.qps[ctid as usize].rcq_seen } else { self.qps[ctid as usize].scq_seen };
        if count.saturating_sub(seen) > r.cq_depth {
            self.lost_completions += count - seen - r.cq_depth;
            seen = count - r.cq_depth;
        }
        let mut n = 0;
        while seen < count && n < out.len() {
            let mut b = [0u8; CQE_SIZE];
            self.mem.read(base + (seen % r.cq_depth) * CQE_SIZE as u64, &mut b)?;
            let c = Cqe::decode(&b);
            out[n] = Completion {
                wr_id: c.wr_id,
                status: WcStatus::from_u32(c.status as u32),
                opcode: match c.opcode {
                    map::CQE_OP_RECV => WcOpcode::Recv,
                    map::CQE_OP_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
                    o => WcOpcode::Send(Opcode::from_u8(o).unwrap_or(Opcode::Nop)),
                },
                qpn: Qpn::new(c.qpn).unwrap_or(qp),
                byte_len: c.byte_len,
                imm: (c.flags & map::CQE_FLAG_IMM != 0).then_some(c.imm),
                invalidated: (c.flags & map::CQE_FLAG_INV != 0).then_some(Rkey(c.invalidated)),
            };
            n += 1;
            seen += 1;
        }
        let s = &mut self.qps[ctid as usize];
        if recv {
            s.rcq_seen = seen;
        } else {
            s.scq_seen = seen;
        }
        Ok(n)
    }

    fn unsupported_stock<T>(what: &'static str) -> Result<T, Error> {
        Err(Error::Unsupported { what, why: "the stock engine has no such feature (needs the omw extension block)" })
    }
}

impl<M: Mmio + CoyoteDriver, H: HostMemory> DataPath for FpgaBackend<M, H> {
    type Error = Error;
    fn capabilities(&self) -> Capabilities {
        let Some(e) = self.ext else {
            // the stock engine: plain READ/WRITE/SEND, nothing the protocol's flags describe
            return Capabilities::empty();
        };
        let mut c = Capabilities::empty();
        let has = |bit: u64| e.caps & bit != 0;
        if has(map::caps::KEY_TABLE) {
            c |= Capabilities::MW_TYPE2 | Capabilities::MW_QP_BINDING_ENFORCED;
        }
        if has(map::caps::SEQUENCER) {
            c |= Capabilities::WAIT_ENABLE | Capabilities::SELF_MODIFYING_WQE;
        }
        if has(map::caps::ATOMICS) {
            c |= Capabilities::ATOMICS;
        }
        if has(map::caps::MASKED_FETCH_ADD) {
            c |= Capabilities::MASKED_FETCH_ADD;
        }
        if has(map::caps::SEND_WITH_INV) {
            c |= Capabilities::SEND_WITH_INV;
        }
        if has(map::caps::BIND_TO_OTHER_QP) {
            c |= Capabilities::BIND_TO_OTHER_QP;
        }
        if has(map::caps::INV_QP_CHECK) {
            c |= Capabilities::MW_QP_CHECK_ON_INVALIDATE;
        }
        if has(map::caps::MW_BOUNDS) {
            c |= Capabilities::MW_BOUNDS_ENFORCED;
        }
        c
    }
    fn post_send(&mut self, qp: Qpn, wqe: &Wqe) -> Result<(), Error> {
        if self.ext.is_some() {
            self.ext_post_send(qp, wqe)
        } else {
            self.post_stock(qp, wqe)
        }
    }
    fn post_recv(&mut self, qp: Qpn, wqe: &RecvWqe) -> Result<(), Error> {
        if self.ext.is_none() {
            return Err(Error::Unsupported {
                what: "receive queues",
                why: "the stock engine has no RECV WQEs: a SEND lands at the buffer named in the sender's QP context",
            });
        }
        let (ctid, r) = self.rings(qp)?;
        if r.rq_depth == 0 {
            return Err(Error::QpNotSetUp(qp));
        }
        for s in &wqe.sges {
            check_addr(s.addr)?;
        }
        let ci = self.csr.read_csr(self.qp_reg(ctid, q::RQ_CI))?;
        let pi = self.qps[ctid as usize].rq_pi;
        if pi.saturating_sub(ci) >= r.rq_depth {
            return Err(Error::QueueFull { qp, queue: QueueSel::Recv });
        }
        self.mem.write(r.rq_base + (pi % r.rq_depth) * RECV_WQE_SIZE as u64, &wqe.encode())?;
        core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
        let reg = self.qp_reg(ctid, q::RQ_PI);
        self.csr.write_csr(reg, pi + 1)?;
        self.qps[ctid as usize].rq_pi = pi + 1;
        Ok(())
    }
    fn poll_cq(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize, Error> {
        if self.ext.is_some() {
            return self.ext_poll(qp, queue, out);
        }
        let ctid = self.ctid(qp)?;
        if queue == QueueSel::Recv {
            return Self::unsupported_stock("receive completions");
        }
        self.refresh_counters(ctid)?;
        let s = &mut self.qps[ctid as usize];
        let n = out.len().min(s.done.len());
        for (o, c) in out.iter_mut().zip(s.done.drain(..n)) {
            *o = c;
        }
        Ok(n)
    }
    fn enable(&mut self, qp: Qpn, queue: QueueSel, count: u64) -> Result<(), Error> {
        if self.ext.is_none() {
            return Self::unsupported_stock("ENABLE of managed queues");
        }
        let (ctid, _) = self.rings(qp)?;
        let reg = self.qp_reg(ctid, if queue == QueueSel::Recv { q::RQ_ENABLE } else { q::SQ_ENABLE });
        self.csr.write_csr(reg, count)?;
        Ok(())
    }
    fn reset_qp(&mut self, qp: Qpn) -> Result<(), Error> {
        let ctid = self.ctid(qp)?;
        let mut targets = vec![ctid];
        if let Some(c) = self.qps[ctid as usize].conn {
            if c.remote_ip == self.cfg.local_ip {
                if let Some((v, pc)) = encoding::split_qpn(c.remote_qpn) {
                    if v == self.cfg.vfid && pc != ctid {
                        targets.push(pc);
                    }
                }
            }
        }
        if self.ext.is_some() {
            self.rings(qp)?;
            self.qp_command(ctid, map::qp_cmd::RESET)?;
        } else {
            for t in &targets {
                mmio::post_command(&self.mmio, &Command::clear_stat(*t))?;
            }
        }
        for t in targets {
            let s = &mut self.qps[t as usize];
            s.reads.clear();
            s.writes.clear();
            s.done.clear();
            s.reads_seen = 0;
            s.writes_seen = 0;
            s.sq_pi = 0;
            s.rq_pi = 0;
            s.scq_seen = 0;
            s.rcq_seen = 0;
        }
        Ok(())
    }
    fn destroy_qp(&mut self, qp: Qpn) -> Result<(), Error> {
        let ctid = self.ctid(qp)?;
        if self.ext.is_some() && self.qps[ctid as usize].rings.is_some() {
            self.qp_command(ctid, map::qp_cmd::DESTROY)?;
        }
        self.qps[ctid as usize] = QpShim::default();
        Ok(())
    }
    fn qp_state(&self, qp: Qpn) -> Result<QpState, Error> {
        let ctid = self.ctid(qp)?;
        if self.ext.is_some() && self.qps[ctid as usize].rings.is_some() {
            return Ok(match self.csr.read_csr(self.qp_reg(ctid, q::STATE))? {
                0 => QpState::Reset,
                1 => QpState::Init,
                2 => QpState::Rtr,
                3 => QpState::Rts,
                4 => QpState::Sqd,
                5 => QpState::Sqe,
                _ => QpState::Err,
            });
        }
        Ok(if self.qps[ctid as usize].conn.is_some() { QpState::Rts } else { QpState::Reset })
    }
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> Result<(), Error> {
        Ok(self.mem.read(addr, buf)?)
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<(), Error> {
        Ok(self.mem.write(addr, data)?)
    }
    fn outstanding(&self, _qp: Qpn, _queue: QueueSel) -> Option<u64> {
        None
    }
}

impl<M: Mmio + CoyoteDriver, H: HostMemory> Provision for FpgaBackend<M, H> {
    fn reg_mr(&mut self, d: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys, Error> {
        self.reg_mr_in(d, addr, len, access)
    }
    fn alloc_mw(&mut self) -> Result<Rkey, Error> {
        self.alloc_mw_in(Domain::CnFacing)
    }
    fn alloc_memory(&mut self, len: u64, align: u64) -> Result<u64, Error> {
        let (base, size) = self.cfg.node_memory.ok_or(Error::Unsupported {
            what: "allocating node memory",
            why: "no engine-visible memory was configured (FpgaConfig::with_node_memory)",
        })?;
        if !align.is_power_of_two() {
            return Err(Error::Unsupported {
                what: "an alignment that is not a power of two",
                why: "addresses are masked",
            });
        }
        let start = self.memory_next.checked_next_multiple_of(align).ok_or(Error::ArenaExhausted { need: len })?;
        let end = start.checked_add(len).ok_or(Error::ArenaExhausted { need: len })?;
        if end > base + size {
            return Err(Error::ArenaExhausted { need: end - (base + size) });
        }
        self.mem.write(start, &vec![0u8; len as usize])?;
        self.memory_next = end;
        Ok(start)
    }
    /// Two registered Coyote threads that have no rings yet become a connected pair through
    /// the extension block's internal loopback.
    fn create_loopback_qp(&mut self, d: Domain, managed: Option<u32>) -> Result<Qpn, Error> {
        let mut free = (0..N_CTID_MAX as u8).rev().filter(|c| {
            self.ctids[*c as usize] && self.qps[*c as usize].rings.is_none() && self.qps[*c as usize].conn.is_none()
        });
        let (Some(a), Some(b)) = (free.next(), free.next()) else {
            return Err(Error::Unsupported {
                what: "another loopback QP pair",
                why: "every registered Coyote thread already has a QP (FpgaConfig::with_threads)",
            });
        };
        let req = match managed {
            Some(depth) => QpSetup::managed(depth, 0),
            None => QpSetup::plain(16, 0),
        };
        let qa = self.create_qp(a, req.in_domain(d))?;
        let qb = self.create_qp(b, QpSetup::plain(0, 0).in_domain(d))?;
        let ip = self.cfg.local_ip;
        self.connect_qp(a, &QpConnect { remote_qpn: qb.get(), remote_ip: ip, ..QpConnect::default() })?;
        self.connect_qp(b, &QpConnect { remote_qpn: qa.get(), remote_ip: ip, ..QpConnect::default() })?;
        Ok(qa)
    }
}

impl<M: Mmio + CoyoteDriver, H: HostMemory> OffloadRings for FpgaBackend<M, H> {
    fn ring_base(&self, qp: Qpn, queue: QueueSel) -> Result<u64, Error> {
        if self.ext.is_none() {
            return Self::unsupported_stock("WQE rings");
        }
        let (_, r) = self.rings(qp)?;
        Ok(if queue == QueueSel::Recv { r.rq_base } else { r.sq_base })
    }
    fn ring_keys(&self, d: Domain) -> Result<MrKeys, Error> {
        self.ring_keys_in(d)
    }
    /// The extension block has no per-QP execution counter (docs/FPGA.md register map): the
    /// MN's audit of the MWTable checks quotas alone.
    fn send_wqes_executed(&self, _: Qpn) -> Option<u64> {
        None
    }
    /// The extension block's receive rings have no doorbell record a chain could write
    /// (docs/FPGA.md register map): receives are posted by the host.
    fn recv_doorbell(&self, _: Qpn) -> Result<Option<omw_core::device::RecvDoorbell>, Error> {
        Ok(None)
    }
}

impl<M: Mmio + CoyoteDriver, H: HostMemory> WindowState for FpgaBackend<M, H> {
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        self.ext?;
        self.key_command(map::key_cmd::QUERY_MW, &[(map::KEY_ARG, rkey.0 as u64)]).ok()?;
        let state = self.csr.read_csr(self.ext_reg(map::MW_STATE)).ok()?;
        if state & (1 << 33) == 0 || (state as u32) >> 8 != rkey.index() {
            return None;
        }
        if state & (1 << 32) == 0 {
            return Some(MwBinding::Unbound);
        }
        Some(MwBinding::Bound { rkey: Rkey(state as u32), qpn: Qpn::new((state >> 40) as u32).ok()? })
    }
    /// The span the extension block reports for a bound window (`MW_BASE`, `MW_LEN_ACCESS`
    /// after QUERY_MW), so the MN's audit can check it against the window's chunk.
    fn mw_span(&self, rkey: Rkey) -> Option<(u64, u64)> {
        self.ext?;
        self.key_command(map::key_cmd::QUERY_MW, &[(map::KEY_ARG, rkey.0 as u64)]).ok()?;
        let state = self.csr.read_csr(self.ext_reg(map::MW_STATE)).ok()?;
        let bound = state & (1 << 32) != 0 && state & (1 << 33) != 0;
        if !bound || state as u32 != rkey.0 {
            return None;
        }
        let base = self.csr.read_csr(self.ext_reg(map::MW_BASE)).ok()?;
        let len = self.csr.read_csr(self.ext_reg(map::MW_LEN_ACCESS)).ok()? & 0xFFFF_FFFF;
        Some((base, len))
    }
}

impl<M: Mmio + CoyoteDriver, H: HostMemory> Mlx5Arm for FpgaBackend<M, H> {
    fn cq_numbers(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> Option<[u32; 3]> {
        None
    }
    fn cq_producer_indices(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> [u32; 3] {
        [0; 3]
    }
    fn arm_mlx5(&mut self, _chain: &Mlx5Chain, _recv_copies: u32) -> Option<Result<(), Self::Error>> {
        None
    }
}
