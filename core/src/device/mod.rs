//! The backend contract: what the core needs from an RNIC, and what the RNIC declares it can do.
//!
//! Backends translate; they do not decide. The MN picks offloaded or host-engine execution from
//! [`Capabilities`] alone ([`ExecutionMode::choose`]) and always reports which one it chose.

pub mod behaviour;
pub mod mw_rules;

use crate::access::AccessFlags;
use crate::ids::{Qpn, Rkey};
use crate::wire::wqe::{Opcode, QueueSel, RecvWqe, Wqe};
use core::fmt;

bitflags::bitflags! {
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
    pub struct Capabilities: u32 {
        /// CORE-Direct style WAIT (block a queue on a CQ count) and ENABLE (managed queues).
        const WAIT_ENABLE = 1 << 0;
        /// The NIC fetches WQEs from memory that READ/atomic responses may have rewritten.
        const SELF_MODIFYING_WQE = 1 << 1;
        /// Fetch-and-add and compare-and-swap.
        const ATOMICS = 1 << 2;
        /// mlx5 extended atomics: fetch-and-add with field boundaries.
        const MASKED_FETCH_ADD = 1 << 3;
        /// Type-2 memory windows bound by a BIND_MW work request.
        const MW_TYPE2 = 1 << 4;
        /// A BIND_MW posted on one QP may associate the window with another QP of the same PD
        /// (mlx5 UMR's qpn field); without it a bind must be posted on the target QP.
        const BIND_TO_OTHER_QP = 1 << 5;
        const SEND_WITH_INV = 1 << 6;
        /// LOCAL_INV of a type-2 window from a QP other than the bound one is refused
        /// (the spec; soft-RoCE does not). The offloaded free chain's ownership proof needs it.
        const MW_QP_CHECK_ON_INVALIDATE = 1 << 7;
        /// Accesses are checked against the window's bounds, not only the MR's
        /// (the spec; soft-RoCE does not).
        const MW_BOUNDS_ENFORCED = 1 << 8;
        /// Remote accesses through a type-2 window are refused on any QP but the bound one.
        const MW_QP_BINDING_ENFORCED = 1 << 9;
        /// The device fetches send WQEs in the mlx5 form (ConnectX, and the model of it);
        /// without it, the canonical 64-byte form. [`crate::chain::arm`] lays chains out in it.
        const WQE_FORM_MLX5 = 1 << 10;
        /// Fetch-and-add and compare-and-swap work through a type-2 window bound with
        /// REMOTE_ATOMIC (soft-RoCE: `rxe_resp.c` looks the rkey up as a window for atomics as
        /// for READ/WRITE). ConnectX does not support atomics through windows (DESIGN.md §6.4):
        /// there the MN binds data windows READ/WRITE only and tells its CNs so.
        const MW_ATOMICS = 1 << 11;
        /// Each managed receive queue's doorbell record lies in the ring MR
        /// ([`OffloadRings::recv_doorbell`]), where a chain's loop QP can write it: the chain
        /// publishes its next receive itself, one per lap, so a request can land only once the
        /// lap before it is done with the receive's targets — whether the doorbell or RECV_EN
        /// makes receives available. (mlx5 has no MMIO doorbell for receives: rdma-core's
        /// `mlx5_post_recv` only stores `htobe32(head & 0xffff)` into the record, which the
        /// HCA reads when it needs a receive WQE; a store by the HCA's own loopback DMA is the
        /// same store.)
        const RECV_DOORBELL_RECORD = 1 << 12;
    }
}

impl Capabilities {
    /// The form the device fetches WQEs in.
    pub const fn wqe_format(self) -> crate::wire::wqe_format::WqeFormat {
        if self.contains(Capabilities::WQE_FORM_MLX5) {
            crate::wire::wqe_format::WqeFormat::Mlx5
        } else {
            crate::wire::wqe_format::WqeFormat::Canonical
        }
    }
    /// What running the chains inside the NIC takes.
    pub const OFFLOAD: Capabilities = Capabilities::WAIT_ENABLE
        .union(Capabilities::SELF_MODIFYING_WQE)
        .union(Capabilities::ATOMICS)
        .union(Capabilities::MASKED_FETCH_ADD)
        .union(Capabilities::MW_TYPE2)
        .union(Capabilities::BIND_TO_OTHER_QP)
        .union(Capabilities::MW_QP_CHECK_ON_INVALIDATE)
        .union(Capabilities::MW_QP_BINDING_ENFORCED);
    /// What the secure protocol takes at all (host-engine mode compensates for the rest).
    pub const SECURE_MINIMUM: Capabilities = Capabilities::MW_TYPE2.union(Capabilities::MW_QP_BINDING_ENFORCED);
}

/// How the MN runs the chains.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum ExecutionMode {
    /// The chains are pre-posted and run inside the NIC; the MN CPU is off the allocation path.
    Offloaded,
    /// The core's host engine executes the same chain layouts on the MN CPU (RPC-MW type-2).
    HostEngine,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ModeError {
    /// The device lacks what isolation needs; the set lists the missing capabilities.
    Insecure(Capabilities),
    /// Offload was demanded but the device lacks these capabilities.
    OffloadUnavailable(Capabilities),
}

impl fmt::Display for ModeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModeError::Insecure(m) => {
                write!(f, "device cannot isolate CNs (missing {m:?}): type-2 memory windows bound to a QP are required")
            }
            ModeError::OffloadUnavailable(m) => write!(f, "chain offload needs {m:?}, which the device lacks"),
        }
    }
}

impl ExecutionMode {
    /// Offload when the device can; the host engine otherwise; refuse when isolation is
    /// impossible (unless the operator explicitly accepts an insecure pool).
    pub fn choose(caps: Capabilities, force: Option<ExecutionMode>, allow_insecure: bool) -> Result<Self, ModeError> {
        let missing = Capabilities::SECURE_MINIMUM.difference(caps);
        if !missing.is_empty() && !allow_insecure {
            return Err(ModeError::Insecure(missing));
        }
        let offload_missing = Capabilities::OFFLOAD.difference(caps);
        match force {
            Some(ExecutionMode::Offloaded) if !offload_missing.is_empty() => {
                Err(ModeError::OffloadUnavailable(offload_missing))
            }
            Some(m) => Ok(m),
            None if offload_missing.is_empty() => Ok(ExecutionMode::Offloaded),
            None => Ok(ExecutionMode::HostEngine),
        }
    }
}

impl fmt::Display for ExecutionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExecutionMode::Offloaded => "offloaded (chains run in the NIC)",
            ExecutionMode::HostEngine => "host engine (chains run on the MN CPU)",
        })
    }
}

/// Work completion status, named and numbered as `enum ibv_wc_status`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, PartialOrd, Ord)]
#[repr(u8)]
#[non_exhaustive]
pub enum WcStatus {
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocEecOpErr = 3,
    LocProtErr = 4,
    WrFlushErr = 5,
    MwBindErr = 6,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    GeneralErr = 21,
}

impl WcStatus {
    pub const ALL: [WcStatus; 15] = [
        WcStatus::Success,
        WcStatus::LocLenErr,
        WcStatus::LocQpOpErr,
        WcStatus::LocEecOpErr,
        WcStatus::LocProtErr,
        WcStatus::WrFlushErr,
        WcStatus::MwBindErr,
        WcStatus::BadRespErr,
        WcStatus::LocAccessErr,
        WcStatus::RemInvReqErr,
        WcStatus::RemAccessErr,
        WcStatus::RemOpErr,
        WcStatus::RetryExcErr,
        WcStatus::RnrRetryExcErr,
        WcStatus::GeneralErr,
    ];
    pub fn from_u32(v: u32) -> WcStatus {
        Self::ALL.iter().copied().find(|s| *s as u32 == v).unwrap_or(WcStatus::GeneralErr)
    }
    pub const fn is_ok(self) -> bool {
        matches!(self, WcStatus::Success)
    }
    /// `ibv_wc_status_str` wording.
    pub const fn as_str(self) -> &'static str {
        match self {
            WcStatus::Success => "success",
            WcStatus::LocLenErr => "local length error",
            WcStatus::LocQpOpErr => "local QP operation error",
            WcStatus::LocEecOpErr => "local EE context operation error",
            WcStatus::LocProtErr => "local protection error",
            WcStatus::WrFlushErr => "Work Request Flushed Error",
            WcStatus::MwBindErr => "memory management operation error",
            WcStatus::BadRespErr => "bad response error",
            WcStatus::LocAccessErr => "local access error",
            WcStatus::RemInvReqErr => "remote invalid request error",
            WcStatus::RemAccessErr => "remote access error",
            WcStatus::RemOpErr => "remote operation error",
            WcStatus::RetryExcErr => "transport retry counter exceeded",
            WcStatus::RnrRetryExcErr => "RNR retry counter exceeded",
            WcStatus::GeneralErr => "general error",
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a completion was for.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum WcOpcode {
    Send(Opcode),
    Recv,
    /// A RECV consumed by a WRITE_WITH_IMM.
    RecvRdmaWithImm,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Completion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub qpn: Qpn,
    pub byte_len: u32,
    pub imm: Option<u32>,
    /// SEND_WITH_INV received: the rkey the sender invalidated.
    pub invalidated: Option<Rkey>,
}

impl Completion {
    /// A placeholder for completion buffers handed to `poll_cq`.
    pub const EMPTY: Completion = Completion {
        wr_id: 0,
        status: WcStatus::GeneralErr,
        opcode: WcOpcode::Recv,
        qpn: Qpn::ZERO,
        byte_len: 0,
        imm: None,
        invalidated: None,
    };
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct MrKeys {
    pub lkey: u32,
    pub rkey: u32,
}

/// QP states as `enum ibv_qp_state`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Err,
}

/// The protection domain a registration belongs to (DESIGN.md §9: isolation comes from PDs
/// and QP binding, never from a key being secret).
///
/// CN-facing QPs (Alloc, Free, access), the pool and every memory window live in
/// [`Domain::CnFacing`]; there MN-private memory (metadata, rings) is registered local-only.
/// The MN's loopback QPs — both ends — live in [`Domain::MnPrivate`], the only domain where
/// MN-private memory carries remote rights, so no key a CN can name through its QPs opens it.
/// Host-engine mode needs no private domain at all: it registers no remote rights on
/// MN-private memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Domain {
    CnFacing,
    MnPrivate,
}

/// The data path every device and every wrapper implements in full: queues, completions, QP
/// state and the node's own memory. Nothing here is defaulted, so a wrapper
/// (`testing::fault::FaultInjector`, `testing::trace::Tracer`) that forgets a
/// method does not compile — it cannot silently answer for the device it wraps.
///
/// The contract is split by who needs what (smoltcp's `phy::Device` is the model):
/// [`DataPath`] for everyone, [`Provision`] to set a node up, [`OffloadRings`] and
/// [`WindowState`] for the MN, and `chain::mlx5::Mlx5Arm` for devices that fetch the mlx5 form.
/// [`RdmaBackend`] names the first four together. What a device can do is data
/// ([`Capabilities`], the WQE form among them), never a method with a default.
///
/// Addresses are the backend's own: virtual addresses in the MN process for verbs, model
/// addresses for the loopback NIC, engine addresses for the FPGA shim.
pub trait DataPath {
    type Error: fmt::Debug + fmt::Display;

    fn capabilities(&self) -> Capabilities;

    /// Append a WQE to the send queue of `qp`. On a managed queue it runs once enabled.
    fn post_send(&mut self, qp: Qpn, wqe: &Wqe) -> Result<(), Self::Error>;
    fn post_recv(&mut self, qp: Qpn, wqe: &RecvWqe) -> Result<(), Self::Error>;
    /// Non-blocking: fills `out` with completions of `qp`'s queue, returns how many.
    fn poll_cq(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize, Self::Error>;
    /// Let a managed queue execute `count` more entries (a doorbell from the CPU).
    fn enable(&mut self, qp: Qpn, queue: QueueSel, count: u64) -> Result<(), Self::Error>;
    /// Bring an errored QP (and its peer) back to RTS with empty queues and zeroed CQ counts.
    fn reset_qp(&mut self, qp: Qpn) -> Result<(), Self::Error>;
    /// Tear a QP down (its peer sees the connection fail). Windows bound to it must have been
    /// invalidated first.
    fn destroy_qp(&mut self, qp: Qpn) -> Result<(), Self::Error>;
    fn qp_state(&self, qp: Qpn) -> Result<QpState, Self::Error>;

    /// The node's own memory (the MN's tables, scratch areas and, when offloading, WQE rings).
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> Result<(), Self::Error>;
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<(), Self::Error>;

    /// Work requests posted on `qp`'s `queue` and not yet completed, if the device can tell.
    /// A CN re-posts its receives from this after its QP was reset under it (the peer
    /// reconnected); `None`: the caller counts for itself.
    fn outstanding(&self, qp: Qpn, queue: QueueSel) -> Option<u64>;
}

/// Setting a node up: memory, registrations, windows, loopback QPs. Provisioning asks for
/// everything through this trait so that one set-up ([`crate::mn::plan::MnPlan::provision`])
/// serves every backend.
pub trait Provision: DataPath {
    /// Register `[addr, addr+len)` in `domain`. A backend without a private domain refuses
    /// [`Domain::MnPrivate`] (only offloaded mode asks for it).
    fn reg_mr(&mut self, domain: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys, Self::Error>;
    /// Allocate a type-2 memory window; returns its initial (unbound) rkey.
    fn alloc_mw(&mut self) -> Result<Rkey, Self::Error>;
    /// `len` zeroed bytes of this node's memory, aligned to `align` (a power of two), for the
    /// node to register: the MN's pool, metadata and zero source, a CN's buffers.
    fn alloc_memory(&mut self, len: u64, align: u64) -> Result<u64, Self::Error>;
    /// A connected pair of RC QPs on this node, both ends in `domain`; returns the end the node
    /// posts on (its peer only responds). The MN's admin and atomic queues are such pairs, and
    /// in offloaded mode each chain's loop QP, whose send queue is managed (WAIT/ENABLE) with
    /// exactly `managed_send_depth` entries so a lap wraps onto the same bytes.
    fn create_loopback_qp(&mut self, domain: Domain, managed_send_depth: Option<u32>) -> Result<Qpn, Self::Error>;
}

/// Offload only: where the chains' rings are, so the core can lay WQE bytes into them.
/// Where a managed receive queue's doorbell record is, for a chain that publishes its own
/// receives ([`Capabilities::RECV_DOORBELL_RECORD`]). Its bytes: in canonical form the count of
/// receives published, a little-endian u64; in mlx5 form rdma-core's `htobe32(count & 0xffff)`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RecvDoorbell {
    /// MN address of the record, inside the ring MR.
    pub addr: u64,
    /// Receive WQEs the queue holds: the arm writes the chain's receive into every one, so
    /// whatever slot a published count reaches holds it.
    pub slots: u32,
}

pub trait OffloadRings: DataPath {
    /// Address of entry 0 of `qp`'s ring (send entries are 64 B, receive entries
    /// [`crate::wire::wqe::RECV_WQE_SIZE`]). A device that cannot offload says so here.
    fn ring_base(&self, qp: Qpn, queue: QueueSel) -> Result<u64, Self::Error>;
    /// The MR keys that cover every ring in `domain` (remote rights in [`Domain::MnPrivate`]
    /// only; local-only in the CN-facing one, where receives scatter request bytes into WQE
    /// fields).
    fn ring_keys(&self, domain: Domain) -> Result<MrKeys, Self::Error>;
    /// How many send WQEs the device has executed on `qp` (the MN's own management QP of a
    /// chain): one lap is a ring's worth, so the MN counts a CN's laps from it for its lazy
    /// quota check ([`crate::mn::Event::CounterSample`]), which the chains cannot do themselves.
    /// `None`: the device cannot tell (the MN then relies on its audit of the MWTable alone).
    fn send_wqes_executed(&self, qp: Qpn) -> Option<u64>;
    /// The doorbell record of `qp`'s managed receive queue, where the device keeps one a chain
    /// can write ([`Capabilities::RECV_DOORBELL_RECORD`]); `None` otherwise.
    fn recv_doorbell(&self, qp: Qpn) -> Result<Option<RecvDoorbell>, Self::Error>;
}

/// What the device can tell about its windows, for the MN's audit and the invariant checker.
/// `None` is an honest "unknown" (verbs has no query for a window's binding; DEVX can query only
/// a window it created as an mkey, and a query can fail). The MN's audit and invariant checker
/// treat unknown as "nothing proven wrong": they act on what the device reports, never on a guess.
pub trait WindowState: DataPath {
    /// Where the window with this rkey is bound (the model and the FPGA extension block can
    /// tell; verbs tracks the binds it posted).
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding>;
    /// The address range `(addr, len)` a bound window covers (the audit checks it against the
    /// window's chunk — defence in depth against a corrupted table entry). `None`: unbound or
    /// unknown.
    fn mw_span(&self, rkey: Rkey) -> Option<(u64, u64)>;
}

/// Everything the MN and the CN driver need of a device but the mlx5 arming
/// (`chain::mlx5::Mlx5Arm`, which the MN driver asks for too).
pub trait RdmaBackend: DataPath + Provision + OffloadRings + WindowState {}
impl<T: DataPath + Provision + OffloadRings + WindowState> RdmaBackend for T {}

/// A window's state as the device sees it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum MwBinding {
    Unbound,
    Bound { rkey: Rkey, qpn: Qpn },
}
