//! Errors of the model's *control* operations (creating objects, posting, host memory access).
//! Errors of *work* (a bad rkey in a READ, a bind of a bound window) are not Rust errors: they
//! are completions with a [`omw_core::device::WcStatus`], exactly as on hardware.

use crate::addr::HostId;
use omw_core::device::mw_rules::{DeallocFail, RegMrFail};
use omw_core::device::QpState;
use omw_core::wire::wqe::QueueSel;
use std::fmt;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum LoopbackError {
    NoSuchHost(HostId),
    /// The host crashed (fault injection): its memory and QPs are gone.
    HostCrashed(HostId),
    NoSuchQp {
        host: HostId,
        qpn: u32,
    },
    NoSuchPd {
        host: HostId,
        pd: u32,
    },
    /// No MR or MW with this key (or the key's index is not of the expected kind).
    NoSuchKey {
        host: HostId,
        key: u32,
    },
    /// `reg_mr` refused by the registration rules (`omw_core::device::mw_rules::check_reg_mr`).
    RegMr {
        host: HostId,
        reason: RegMrFail,
    },
    /// `dealloc_mw` refused: no window with that index, or not its current key byte.
    DeallocMw {
        host: HostId,
        key: u32,
        reason: DeallocFail,
    },
    /// Host memory exhausted (`NicConfig::mem_limit`).
    OutOfMemory {
        host: HostId,
        requested: u64,
    },
    /// The ring arena of the host has no room for another ring.
    RingArenaFull {
        host: HostId,
        requested: u64,
    },
    /// Host access to memory that was never allocated.
    BadAddress {
        host: HostId,
        addr: u64,
        len: u64,
    },
    /// The queue already holds `depth` unexecuted entries.
    RingFull {
        host: HostId,
        qpn: u32,
        queue: QueueSel,
    },
    /// `enable` on a queue that was not created managed.
    NotManaged {
        host: HostId,
        qpn: u32,
        queue: QueueSel,
    },
    /// The operation needs another QP state (e.g. connecting a QP that is already connected).
    BadQpState {
        host: HostId,
        qpn: u32,
        state: QpState,
    },
    /// Deregistering an MR while windows are bound to it (rxe answers EINVAL, §3).
    MrHasBoundWindows {
        host: HostId,
        lkey: u32,
    },
    /// No CQ of that number on the host.
    NoSuchCq {
        host: HostId,
        cqn: u32,
    },
    /// Destroying a CQ a live QP still reports to.
    CqInUse {
        host: HostId,
        cqn: u32,
    },
    /// An argument out of range (zero depth, zero-length registration, bad alignment, …).
    BadArgument(&'static str),
}

impl fmt::Display for LoopbackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoSuchHost(h) => write!(f, "no host {h}"),
            Self::HostCrashed(h) => write!(f, "{h} has crashed"),
            Self::NoSuchQp { host, qpn } => write!(f, "no QP {qpn:#x} on {host}"),
            Self::NoSuchPd { host, pd } => write!(f, "no protection domain {pd} on {host}"),
            Self::NoSuchKey { host, key } => write!(f, "no memory key {key:#010x} on {host}"),
            Self::RegMr { host, reason } => write!(f, "reg_mr on {host}: {reason}"),
            Self::DeallocMw { host, key, reason } => write!(f, "dealloc_mw {key:#010x} on {host}: {reason}"),
            Self::OutOfMemory { host, requested } => {
                write!(f, "{host}: out of model memory allocating {requested} bytes")
            }
            Self::RingArenaFull { host, requested } => {
                write!(f, "{host}: ring arena cannot hold another {requested} bytes of rings")
            }
            Self::BadAddress { host, addr, len } => {
                write!(f, "{host}: [{addr:#x}, +{len}) is not allocated memory")
            }
            Self::RingFull { host, qpn, queue } => {
                write!(f, "{host}: {queue:?} queue of QP {qpn:#x} is full")
            }
            Self::NotManaged { host, qpn, queue } => {
                write!(f, "{host}: {queue:?} queue of QP {qpn:#x} is not a managed queue")
            }
            Self::BadQpState { host, qpn, state } => {
                write!(f, "{host}: QP {qpn:#x} is in state {state:?}")
            }
            Self::MrHasBoundWindows { host, lkey } => {
                write!(f, "{host}: MR {lkey:#010x} still has windows bound to it")
            }
            Self::NoSuchCq { host, cqn } => write!(f, "no CQ {cqn:#x} on {host}"),
            Self::CqInUse { host, cqn } => write!(f, "{host}: CQ {cqn:#x} still has QPs reporting to it"),
            Self::BadArgument(what) => write!(f, "bad argument: {what}"),
        }
    }
}

impl std::error::Error for LoopbackError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::RegMr { reason, .. } => Some(reason),
            Self::DeallocMw { reason, .. } => Some(reason),
            _ => None,
        }
    }
}
