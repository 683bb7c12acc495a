//! Typed errors. Each says what is missing and, where there is one, how to fix it: an operator
//! meets these on the command line, so "ENOSYS from ibv_get_device_list" is not enough.

pub(crate) use crate::memlock::human;
use omw_core::device::WcStatus;
use std::fmt;

#[derive(Debug)]
#[non_exhaustive]
pub enum VerbsError {
    /// libibverbs found no RDMA device at all (or the kernel has no RDMA support).
    NoDevice { detail: String },
    /// `--device NAME` does not exist; lists what does.
    DeviceNotFound { name: String, available: Vec<String> },
    /// The device cannot allocate type-2 memory windows.
    NoMwType2 { device: String },
    /// RLIMIT_MEMLOCK is below what the configuration pins, and CAP_IPC_LOCK is not in effect
    /// (None: /proc did not say).
    MemlockTooLow { limit: u64, need: crate::memlock::MemlockNeed, cap_ipc_lock: Option<bool> },
    /// The port or GID cannot serve (state, LID, GID table, `--gid-index`).
    Port(crate::port::PortError),
    /// The MN's free queue is empty (answered to this very request).
    PoolEmpty,
    /// This CN holds its quota of chunks (`omw mn --quota`; 0 there means the whole pool).
    QuotaExceeded,
    /// Every staging slot for asynchronous operations is in use: collect some first.
    TooManyInFlight { max: usize },
    /// The rdma_cm listen address is taken by another listener.
    AddressInUse { addr: String },
    /// The listen address does not belong to an RDMA device.
    AddressNotRdma { addr: String, detail: String },
    /// rdma_cm could not reach the peer (address/route resolution, rejection, timeout).
    PeerUnreachable { addr: String, detail: String },
    /// The MN refused the connection and said why (the reject's private data).
    Rejected(crate::refusal::Refusal),
    /// The peer closed the connection.
    Disconnected,
    /// A verbs or rdma_cm call failed.
    Call { call: &'static str, errno: i32 },
    /// A work completion did not arrive in time.
    Timeout { what: String },
    /// A work completion came back with an error status.
    Completion { what: String, status: WcStatus },
    /// The canonical operation has no libibverbs equivalent on this device.
    Unsupported(&'static str),
    /// A QP number that this backend did not create.
    UnknownQp(u32),
    /// An rkey whose index is none of this backend's windows.
    UnknownMw(u32),
    /// An lkey that is none of this backend's memory regions.
    UnknownMr(u32),
    /// An address range outside every region this backend owns.
    BadAddress { addr: u64, len: u64 },
    /// Invalidating a window that is not bound (rxe's invalidate path is not safe for it).
    NotBound(u32),
    /// The MN answered something that is not the protocol.
    Protocol(String),
    /// The MN refused the request, with the protocol's reason.
    Refused(omw_core::wire::message::ErrorCode),
    /// The device lacks a check isolation depends on, and `--insecure` was not given.
    Insecure(String),
    /// Invalid configuration (pool geometry, arguments).
    Config(String),
    /// The CN's protocol state machine refused a reply or message (not for us, malformed…).
    Client(omw_core::cn::ClientError),
    /// The CN driver refused (its slots, its memory layout).
    Cn(Box<omw_core::cn::driver::CnError<VerbsError>>),
    /// The MN could not be brought up on the device (which step, and the device's error).
    Provision(Box<omw_core::mn::provision::ProvisionError<VerbsError>>),
    /// `--offload mlx5` cannot run (DEVX, capability or command failure, with what to do).
    Devx(crate::devx::DevxError),
}

impl VerbsError {
    /// The `errno` of the last failed libc/libibverbs call.
    pub(crate) fn last(call: &'static str) -> Self {
        VerbsError::Call { call, errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0) }
    }
    pub(crate) fn rc(call: &'static str, rc: i32) -> Self {
        // verbs calls return either -1 with errno set or a positive errno
        if rc > 0 {
            VerbsError::Call { call, errno: rc }
        } else {
            Self::last(call)
        }
    }
}

fn strerror(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

impl fmt::Display for VerbsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VerbsError::NoDevice { detail } => write!(
                f,
                "no RDMA device: {detail}. Load a driver (e.g. soft-RoCE: `modprobe rdma_rxe; rdma link add rxe0 type rxe netdev eth0`) and check `ibv_devices`"
            ),
            VerbsError::DeviceNotFound { name, available } => write!(
                f,
                "RDMA device {name:?} not found (available: {})",
                if available.is_empty() { "none".to_string() } else { available.join(", ") }
            ),
            VerbsError::NoMwType2 { device } => write!(
                f,
                "device {device} does not support type-2 memory windows (IBV_DEVICE_MEM_WINDOW_TYPE_2A/2B), which omw needs"
            ),
            VerbsError::MemlockTooLow { limit, need, cap_ipc_lock } => {
                crate::memlock::TooLow { limit: *limit, need: *need, cap_ipc_lock: *cap_ipc_lock }.fmt(f)
            }
            VerbsError::Port(e) => write!(f, "{e}"),
            VerbsError::PoolEmpty => f.write_str("the memory node's free queue is empty (every chunk is allocated)"),
            VerbsError::TooManyInFlight { max } => write!(
                f,
                "{max} asynchronous operations are in flight already: collect completions (poll_ops/wait_ops) first"
            ),
            VerbsError::QuotaExceeded => {
                f.write_str("this CN holds its quota of chunks (the MN's --quota; by default the whole pool)")
            }
            VerbsError::AddressInUse { addr } => {
                write!(f, "address {addr} is already in use by another rdma_cm listener")
            }
            VerbsError::AddressNotRdma { addr, detail } => write!(
                f,
                "cannot listen on {addr}: {detail} (is the address assigned to the RDMA device's network interface?)"
            ),
            VerbsError::PeerUnreachable { addr, detail } => {
                write!(f, "memory node {addr} unreachable: {detail}")
            }
            VerbsError::Rejected(r) => write!(f, "the memory node refused the connection: {r}"),
            VerbsError::Disconnected => f.write_str("the peer disconnected"),
            VerbsError::Call { call, errno } => {
                write!(f, "{call} failed: {} (errno {errno})", strerror(*errno))
            }
            VerbsError::Timeout { what } => write!(f, "timed out waiting for {what}"),
            VerbsError::Completion { what, status } => {
                write!(f, "{what} completed with status {status} ({})", *status as u32)
            }
            VerbsError::Unsupported(what) => write!(f, "not supported by libibverbs: {what}"),
            VerbsError::UnknownQp(q) => write!(f, "QP {q:#x} was not created by this backend"),
            VerbsError::UnknownMw(r) => write!(f, "rkey {r:#010x} names no memory window of this backend"),
            VerbsError::UnknownMr(k) => write!(f, "lkey {k:#x} names no memory region of this backend"),
            VerbsError::BadAddress { addr, len } => write!(
                f,
                "address range {addr:#x}+{len} lies outside the backend's memory"
            ),
            VerbsError::NotBound(r) => write!(f, "memory window {r:#010x} is not bound"),
            VerbsError::Protocol(s) => write!(f, "protocol error: {s}"),
            VerbsError::Refused(c) => write!(f, "refused by the memory node: {c:?}"),
            VerbsError::Insecure(s) => f.write_str(s),
            VerbsError::Config(s) => f.write_str(s),
            VerbsError::Client(e) => write!(f, "from the MN: {e}"),
            VerbsError::Cn(e) => write!(f, "CN driver: {e}"),
            VerbsError::Provision(e) => write!(f, "bringing the MN up: {e}"),
            VerbsError::Devx(e) => write!(f, "--offload mlx5: {e}"),
        }
    }
}

impl std::error::Error for VerbsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            VerbsError::Port(e) => Some(e),
            _ => None,
        }
    }
}

impl From<crate::devx::DevxError> for VerbsError {
    fn from(e: crate::devx::DevxError) -> Self {
        VerbsError::Devx(e)
    }
}

impl From<crate::memlock::TooLow> for VerbsError {
    fn from(t: crate::memlock::TooLow) -> Self {
        VerbsError::MemlockTooLow { limit: t.limit, need: t.need, cap_ipc_lock: t.cap_ipc_lock }
    }
}

pub type Result<T, E = VerbsError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memlock::MemlockNeed;

    #[test]
    fn memlock_message_says_what_and_how() {
        let need = MemlockNeed::mn(64 << 20, 933_904, 16, 3);
        let e = VerbsError::MemlockTooLow { limit: 1 << 20, need, cap_ipc_lock: Some(false) };
        let m = e.to_string();
        assert!(m.contains("RLIMIT_MEMLOCK is 1 MiB"), "{m}");
        assert!(m.contains("about 74.1 MiB (pool 64 MiB, metadata 912.0 KiB, 66 QPs"), "{m}");
        assert!(m.contains("lacks CAP_IPC_LOCK") && m.contains("LimitMEMLOCK=infinity"), "{m}");
        let e = VerbsError::MemlockTooLow { limit: 0, need: MemlockNeed::bytes(4096), cap_ipc_lock: Some(true) };
        assert!(!e.to_string().contains("lacks"), "{e}");
        assert_eq!(crate::memlock::approx(512), "512 B");
        assert_eq!(crate::memlock::approx(3 << 30), "3.0 GiB");
    }
}
