//! Why the DEVX path cannot be used, in terms an operator can act on: which call or PRM
//! command failed (with the firmware's status and syndrome), or which capability is missing,
//! and what to do.

use omw_core::chain::mlx5::Mlx5ChainError;
use omw_core::device::behaviour::Question;
use omw_core::mlx5::prm::hca_cap::MissingCap;
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::mlx5::Mlx5Error;
use std::fmt;

#[derive(Debug)]
#[non_exhaustive]
pub enum DevxError {
    /// This binary was built without the `devx` feature.
    NotBuilt,
    /// A registration was refused for lack of lockable memory (RLIMIT_MEMLOCK).
    MemlockTooLow(crate::memlock::TooLow),
    /// The device is not an mlx5 device (DEVX exists only for mlx5_ib).
    NotMlx5 {
        device: String,
    },
    /// No device given and none of the listed devices is an mlx5 device.
    NoMlx5 {
        devices: Vec<String>,
    },
    /// `mlx5dv_open_device(MLX5DV_CONTEXT_FLAGS_DEVX)` failed.
    Open {
        device: String,
        errno: i32,
    },
    /// A DEVX call other than a PRM command failed (umem registration, UAR, EQN, PD).
    Call {
        call: &'static str,
        errno: i32,
    },
    /// A PRM command failed; `status` / `syndrome` are the firmware's answer (0 if the kernel
    /// refused the command before the firmware saw it).
    Command {
        command: &'static str,
        opcode: u16,
        status: u8,
        syndrome: u32,
        errno: i32,
    },
    /// The device lacks a capability offload needs.
    MissingCapability(MissingCap),
    /// A requested size exceeds what the device reports.
    TooLarge {
        what: &'static str,
        log2: u8,
        device_max_log2: u8,
    },
    /// The memory handed in for a queue is smaller than its rings and doorbell record.
    MemTooSmall {
        what: &'static str,
        need: usize,
        got: usize,
    },
    /// A command could not be built (a value does not fit its PRM field).
    Encode(Mlx5Error),
    /// A window's mkey as the device reports it is no type-2 window: CREATE_MKEY answered an
    /// index already taken, or QUERY_MKEY's context is not a window binding.
    WindowAnswer {
        index: u32,
        error: Mlx5Error,
    },
    /// The device was already borrowed when a window query came in (a re-entrant call: a bug
    /// of the caller, reported instead of a panic).
    DeviceBusy,
    /// [`super::DevxApi::write_mem`] outside every registered umem.
    OutsideUmem {
        addr: usize,
        len: usize,
    },
    /// Arming: the chain fails [`omw_core::chain::mlx5::Mlx5Chain::validate`].
    ChainInvalid(Mlx5ChainError),
    /// Arming: the chain needs more than the queue has (`what` names the queue and the unit).
    ChainDoesNotFit {
        what: &'static str,
        need: usize,
        got: usize,
    },
    /// Arming: the send ring is larger than the chain's lap. Lap *k* of a chain runs the same
    /// bytes at WQE indices *k* × (lap size), so the ring must be exactly one lap.
    RingNotOneLap {
        ring: &'static str,
        chain_wqebbs: usize,
        qp_wqebbs: usize,
    },
    /// Arming: a QP lacks a CORE-Direct role the chain needs (`cd_master` to post WAIT /
    /// SEND_EN / RECV_EN, `cd_slave_send` / `cd_slave_receive` to be enabled by one).
    WrongRole {
        qp: &'static str,
        qpn: u32,
        need: CdRole,
        has: CdRole,
    },
    /// Arming: a CQ number the chain names (or a CQ handed in for `queue`) is not the CQ the
    /// DEVX QP's queue reports to.
    WrongCq {
        queue: &'static str,
        expected: u32,
        got: u32,
    },
    /// Arming: two of the chain's queues report to one CQ; a WAIT's producer index must count
    /// one queue's completions only.
    SharedCq {
        cqn: u32,
    },
    /// Arming: the chain was built for other QP numbers (its control segments and SEND_ENs
    /// name them).
    WrongQp {
        ring: &'static str,
        chain_qpn: u32,
        devx_qpn: u32,
    },
    /// Arming: the chain's patches aim at ring addresses other than the QP's umem send ring.
    RingBaseMismatch {
        ring: &'static str,
        chain_base: u64,
        umem_addr: usize,
    },
    /// Arming: a first enable index is not the end of a WQE (no control segment to ring with).
    EnableNotAtWqeEnd {
        ring: &'static str,
        index: u16,
    },
    /// The ring arena has no room for another queue (`DevxConfig::ring_arena_bytes`).
    ArenaFull {
        need: usize,
        left: usize,
    },
    /// No QP / CQ with this number was created by this backend.
    UnknownQp(u32),
    UnknownCq(u32),
    /// [`super::backend::DevxBackend::connect_cn_qp`] on a loopback QP.
    NotCnFacing(u32),
    /// A CN-facing QP reset before it was ever connected.
    NotConnected(u32),
    /// A work request or host ENABLE for a queue a chain owns (its ring is the chain's lap).
    ManagedQueue(u32),
    /// The send ring has no room: the device has not completed enough of what was posted
    /// (post signaled work requests, and poll).
    SendQueueFull {
        qpn: u32,
        need: usize,
        free: usize,
    },
    ReceiveQueueFull {
        qpn: u32,
        entries: usize,
    },
    NoReceiveQueue(u32),
    /// Memory this backend did not allocate (`alloc_memory`).
    OutsideMemory {
        addr: usize,
        len: usize,
    },
    /// A ring size that must be a power of two.
    NotPowerOfTwo {
        what: &'static str,
        value: u32,
    },
    /// Arming a chain on a QP that is not freshly reset and in RTS (its indices are not 0).
    NotFresh {
        qpn: u32,
        state: omw_core::device::QpState,
    },
    /// `--profile`: the device profile could not be read or parsed.
    Profile(super::profile::ProfileError),
    /// The profile was measured on other firmware than the device runs.
    ProfileFirmware {
        profile: String,
        device: String,
    },
    /// The chains are not correct on a device that answers `question` as the profile says
    /// (`answer`; `None`: the profile does not say, so any answer is possible); they need one
    /// of `tolerated`.
    Unsuited {
        question: Question,
        answer: Option<&'static str>,
        tolerated: Vec<&'static str>,
    },
    /// The chains' and the MN's unbinds need an invalidate without the QPN check to revoke a
    /// window bound to another QP (`UncheckedUnbind`); the profile says it does not (`Some`)
    /// or does not say (`None`).
    UncheckedUnbind(Option<omw_core::device::behaviour::UncheckedUnbind>),
}

fn strerror(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

impl fmt::Display for DevxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DevxError::NotBuilt => f.write_str(
                "this omw was built without DEVX support: rebuild with `cargo build --release -p omw --features devx` (needs libmlx5 from libibverbs-dev)",
            ),
            DevxError::MemlockTooLow(t) => write!(f, "{t}"),
            DevxError::NoMlx5 { devices } => write!(
                f,
                "no mlx5 (ConnectX) device among [{}]: DEVX offload needs mlx5_ib; run `omw mn` without --offload (host engine)",
                devices.join(", ")
            ),
            DevxError::NotMlx5 { device } => write!(
                f,
                "device {device} is not an mlx5 (ConnectX) device: DEVX offload needs mlx5_ib; run `omw mn` without --offload (host engine)"
            ),
            DevxError::Open { device, errno } => write!(
                f,
                "mlx5dv_open_device({device}, MLX5DV_CONTEXT_FLAGS_DEVX) failed: {} (errno {errno}). DEVX needs the mlx5_ib driver with DEVX support (Linux ≥ 4.18, rdma-core ≥ 21) and read/write access to the device's /dev/infiniband/uverbsN; EOPNOTSUPP means the kernel or firmware offers no DEVX user context",
                strerror(*errno)
            ),
            DevxError::Call { call, errno } => write!(f, "{call} failed: {} (errno {errno})", strerror(*errno)),
            DevxError::Command { command, opcode, status, syndrome, errno } => {
                write!(f, "PRM command {command} ({opcode:#06x}) failed: ")?;
                if *status != 0 {
                    write!(f, "firmware status {status:#04x}, syndrome {syndrome:#010x}")?;
                } else {
                    write!(f, "{} (errno {errno}) before reaching the firmware", strerror(*errno))?;
                }
                f.write_str(
                    ". Look the syndrome up in the mlx5 PRM or with `dmesg` (mlx5_core logs it); EPERM means the kernel does not let an unprivileged DEVX context issue this command or set these fields",
                )
            }
            DevxError::MissingCapability(c) => write!(
                f,
                "the device does not report {}: offload needs {} — run `omw mn` without --offload (the host engine serves the same protocol), or try a ConnectX/firmware that reports it (`omw probe` shows the DEVX capabilities)",
                c.field(),
                match c {
                    MissingCap::Rc => "RC transport",
                    MissingCap::CoreDirect => "CORE-Direct (cross-channel WAIT / SEND_EN and the cd_* QP roles)",
                    MissingCap::Type2Windows => "type-2 memory windows",
                    MissingCap::MaskedFetchAdd => "8-byte masked fetch-and-add in host endianness (atomic_req_8B_endianness_mode 1)",
                }
            ),
            DevxError::TooLarge { what, log2, device_max_log2 } => write!(
                f,
                "{what} of 2^{log2} exceeds the device's maximum 2^{device_max_log2}"
            ),
            DevxError::MemTooSmall { what, need, got } => {
                write!(f, "{what} needs {need} bytes of ring memory, got {got}")
            }
            DevxError::Encode(e) => write!(f, "cannot build the PRM command: {e}"),
            DevxError::WindowAnswer { index, error } => {
                write!(f, "the device's answer for window mkey {index:#x} is no type-2 window: {error}")
            }
            DevxError::DeviceBusy => f.write_str("the DEVX device is in use by another call of this backend"),
            DevxError::OutsideUmem { addr, len } => {
                write!(f, "refused to store {len} bytes at {addr:#x}: not inside a registered umem")
            }
            DevxError::ChainInvalid(e) => write!(f, "the mlx5-form chain does not validate: {e}"),
            DevxError::ChainDoesNotFit { what, need, got } => {
                write!(f, "the chain does not fit: {what} needs {need}, the DEVX queue has {got}")
            }
            DevxError::RingNotOneLap { ring, chain_wqebbs, qp_wqebbs } => write!(
                f,
                "the {ring} send ring has {qp_wqebbs} WQEBBs but the chain's lap {chain_wqebbs}: a self-re-arming chain needs a ring of exactly one lap"
            ),
            DevxError::WrongRole { qp, qpn, need, has } => write!(
                f,
                "the {qp} QP {qpn:#x} was created with CORE-Direct roles {has:?} but the chain needs {need:?}"
            ),
            DevxError::WrongCq { queue, expected, got } => write!(
                f,
                "CQ number {got:#x} given for the {queue} queue, which reports to CQ {expected:#x}"
            ),
            DevxError::SharedCq { cqn } => {
                write!(f, "two of the chain's queues report to CQ {cqn:#x}: each WAIT needs a CQ of its own queue")
            }
            DevxError::WrongQp { ring, chain_qpn, devx_qpn } => write!(
                f,
                "the chain's {ring} ring names QP {chain_qpn:#x}, the DEVX QP is {devx_qpn:#x}"
            ),
            DevxError::RingBaseMismatch { ring, chain_base, umem_addr } => write!(
                f,
                "the chain's {ring} ring patches aim at {chain_base:#x}, the DEVX send ring is at {umem_addr:#x}"
            ),
            DevxError::EnableNotAtWqeEnd { ring, index } => {
                write!(f, "the {ring} ring's first enable index {index} is not the end of a WQE")
            }
            DevxError::ArenaFull { need, left } => write!(
                f,
                "the DEVX ring arena is full: a queue needs {need} bytes, {left} are left (raise DevxConfig::ring_arena_bytes, or serve fewer CNs)"
            ),
            DevxError::UnknownQp(q) => write!(f, "no DEVX QP {q:#x} on this MN"),
            DevxError::UnknownCq(c) => write!(f, "no DEVX CQ {c:#x} on this MN"),
            DevxError::NotCnFacing(q) => write!(f, "QP {q:#x} is one end of an MN loopback pair, not a CN-facing QP"),
            DevxError::NotConnected(q) => write!(f, "CN-facing QP {q:#x} was never connected: nothing to reconnect it with"),
            DevxError::ManagedQueue(q) => write!(
                f,
                "QP {q:#x}'s queue belongs to a chain (its ring is one lap, enabled by the chain): the host posts nothing there"
            ),
            DevxError::SendQueueFull { qpn, need, free } => write!(
                f,
                "send queue of QP {qpn:#x} is full: {need} WQEBBs needed, {free} free until the device completes more"
            ),
            DevxError::ReceiveQueueFull { qpn, entries } => {
                write!(f, "receive queue of QP {qpn:#x} is full ({entries} entries posted)")
            }
            DevxError::NoReceiveQueue(q) => write!(f, "QP {q:#x} has no receive queue"),
            DevxError::OutsideMemory { addr, len } => {
                write!(f, "{len} bytes at {addr:#x} are not memory this DEVX backend allocated")
            }
            DevxError::NotPowerOfTwo { what, value } => write!(f, "{what} of {value} is not a power of two"),
            DevxError::NotFresh { qpn, state } => write!(
                f,
                "QP {qpn:#x} is not freshly reset (state {state:?}, work already posted): a chain is armed from index 0"
            ),
            DevxError::Profile(e) => write!(f, "{e}"),
            DevxError::ProfileFirmware { profile, device } => write!(
                f,
                "the device profile was measured on firmware {profile}, the device runs {device}: the answers hold for the firmware they were measured on — run `omw-mlx5-bringup questions --profile FILE` on this device again"
            ),
            DevxError::UncheckedUnbind(None) => f.write_str(
                "the chains and the MN unbind windows bound to the CNs' QPs with an invalidate that asks no QPN check, and no device profile says this device honours it (unchecked_unbind): run `omw-mlx5-bringup unchecked-unbind` (or `questions --profile FILE`) on it (docs/MLX5.md question 21) — or run `omw mn` without --offload (the host engine serves the same protocol)",
            ),
            DevxError::UncheckedUnbind(Some(_)) => f.write_str(
                "the device profile says unchecked_unbind = refused: an invalidate without the QPN check does not revoke a window bound to another QP, so offloaded frees would leave windows bound (the MN would quarantine every freed group): run `omw mn` without --offload (the host engine serves the same protocol)",
            ),
            DevxError::Unsuited { question, answer, tolerated } => {
                let need = tolerated.join(" or ");
                match answer {
                    None => write!(
                        f,
                        "the chains run correctly only where \"{question}\" is answered {key} = {need}, and no device profile answers it for this device: run `omw-mlx5-bringup questions --device <mlx5_N> --profile FILE` on it (docs/MLX5.md), then `omw mn --offload mlx5 --profile FILE` — or run `omw mn` without --offload (the host engine serves the same protocol)",
                        key = question.key()
                    ),
                    Some(a) => write!(
                        f,
                        "the device profile says {key} = {a} (\"{question}\"), and the chains run correctly only where it is {need}: run `omw mn` without --offload (the host engine serves the same protocol)",
                        key = question.key()
                    ),
                }
            }
        }
    }
}

impl std::error::Error for DevxError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DevxError::Profile(e) => Some(e),
            _ => None,
        }
    }
}

impl From<Mlx5Error> for DevxError {
    fn from(e: Mlx5Error) -> Self {
        DevxError::Encode(e)
    }
}
