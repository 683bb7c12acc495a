//! The memory-region and memory-window rules of DESIGN.md §3 as pure functions: what a
//! device must refuse, and why, given a snapshot of the objects a request names.
//!
//! Every backend that *decides* protection (the loopback model, the FPGA extension double)
//! calls these instead of writing its own checks, so the rules exist once. Each rule comes in
//! two variants, chosen by [`Mode`]: [`Mode::Strict`] follows the InfiniBand spec (IBTA Vol. 1,
//! ch. 10.6.7 and 9.9.6.3; rdma-core man pages), [`Mode::Rxe`] reproduces Linux soft-RoCE where
//! it deviates. The rxe behaviour is read from `drivers/infiniband/sw/rxe/rxe_mw.c` (torvalds/linux
//! 02ed253770fb27380c51af8e7e0903e6905469b6) and `rxe_resp.c` (034e285f8b99062a0cf29112e1232154a6a44aa5),
//! and, for the two deviations of §3 marked *measured*, observed in the soft-RoCE VM.
//!
//! The inputs are plain copies (no references into a store), so a caller looks the objects up
//! however it stores them and the rules stay testable in isolation. The functions never
//! mutate: the caller applies the effect an `Ok` describes.

use core::fmt;

use crate::access::AccessFlags;

/// Which device the rules imitate.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub enum Mode {
    /// The InfiniBand spec.
    #[default]
    Strict,
    /// Linux soft-RoCE (rxe) where it deviates from the spec.
    Rxe,
}

/// A registered memory region (only valid ones: a deregistered MR is [`KeyTarget::None`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Mr {
    pub pd: u32,
    /// lkey = rkey (index << 8 | key byte).
    pub key: u32,
    pub addr: u64,
    pub len: u64,
    pub access: AccessFlags,
}

/// Where a bound type-2 window points.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Binding {
    /// The QP the window is bound to (any stable QP identity the caller uses).
    pub qp: u32,
    pub addr: u64,
    pub len: u64,
    pub access: AccessFlags,
    /// The MR the window lies in.
    pub mr: Mr,
}

/// A type-2 memory window.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Window {
    pub pd: u32,
    /// Its current rkey: the last key bound, or the one it was allocated with.
    pub rkey: u32,
    /// `None`: allocated but not bound (the spec's "free" state).
    pub binding: Option<Binding>,
}

/// What the 24-bit index of a key names on the device.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum KeyTarget {
    None,
    Mr(Mr),
    Window(Window),
}

/// A QP as the bind and invalidation rules see it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct QpRef {
    pub qp: u32,
    pub pd: u32,
}

// ---- local SGE ----------------------------------------------------------------------------

/// A scatter/gather entry the NIC is about to read (or, with `write`, write).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct LocalSge {
    /// PD of the QP the WQE runs on.
    pub pd: u32,
    pub lkey: u32,
    pub addr: u64,
    pub len: u64,
    pub write: bool,
}

/// Why a local SGE is refused (the WQE completes with `LOC_PROT_ERR`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum LocalFail {
    NoSuchKey,
    /// A window's key used as an lkey: windows grant remote access only (IBTA 10.6.7.1).
    WindowAsLkey,
    StaleKey,
    PdMismatch,
    NoLocalWrite,
    OutOfBounds,
}

/// Local SGE check: an MR with the exact key, in the QP's PD, covering the range, with
/// LOCAL_WRITE if the NIC writes there. rxe checks the same (`lookup_mr` with
/// `RXE_LOOKUP_LOCAL`), so there is one variant.
pub fn check_local(target: KeyTarget, sge: LocalSge) -> Result<(), LocalFail> {
    let mr = match target {
        KeyTarget::None => return Err(LocalFail::NoSuchKey),
        KeyTarget::Window(_) => return Err(LocalFail::WindowAsLkey),
        KeyTarget::Mr(mr) => mr,
    };
    if mr.key != sge.lkey {
        return Err(LocalFail::StaleKey);
    }
    if mr.pd != sge.pd {
        return Err(LocalFail::PdMismatch);
    }
    if sge.write && !mr.access.contains(AccessFlags::LOCAL_WRITE) {
        return Err(LocalFail::NoLocalWrite);
    }
    if !within(sge.addr, sge.len, mr.addr, mr.len) {
        return Err(LocalFail::OutOfBounds);
    }
    Ok(())
}

// ---- remote access ------------------------------------------------------------------------

/// A READ / WRITE / atomic arriving at a responder.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct RemoteAccess {
    /// The QP the request arrived on.
    pub qp: QpRef,
    pub rkey: u32,
    pub addr: u64,
    pub len: u64,
    pub need: AccessFlags,
    pub atomic: bool,
}

/// Why a remote access is refused.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum RemoteFail {
    NoSuchKey,
    StaleKey,
    /// The window is allocated but not bound (never, or invalidated, or deallocated).
    NotBound,
    PdMismatch,
    /// A type-2 window used through a QP other than the one it is bound to.
    WrongQp,
    AccessDenied,
    OutOfBounds,
    /// An atomic whose effective address is not 8-byte aligned.
    MisalignedAtomic,
}

/// The NAK a refused remote access draws, which decides the requester's completion status.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Nak {
    /// `REM_ACCESS_ERR` (IBTA 9.9.6.3 class C "remote access error").
    RemoteAccess,
    /// `REM_INV_REQ_ERR` (class C "invalid request").
    InvalidRequest,
}

impl RemoteFail {
    /// rxe answers a misaligned atomic with an invalid-request NAK (`RESPST_ERR_MISALIGNED_ATOMIC`
    /// → `AETH_NAK_INVALID_REQ` in rxe_resp.c), every key/range violation with a remote-access
    /// NAK (`RESPST_ERR_RKEY_VIOLATION`); the spec classes them the same way.
    pub fn nak(self) -> Nak {
        match self {
            RemoteFail::MisalignedAtomic => Nak::InvalidRequest,
            _ => Nak::RemoteAccess,
        }
    }
}

/// Responder check: exact rkey, PD, (for a window) bound and bound to the arriving QP,
/// access rights, range, atomic alignment. Returns the address to access (a zero-based
/// window's offset added to its base).
///
/// [`Mode::Rxe`] checks the range against the underlying MR only, not the window
/// (§3 deviation (b), measured; rxe_resp.c `check_rkey` calls `mr_check_range(mw->mr, ..)`).
pub fn check_remote(mode: Mode, target: KeyTarget, req: RemoteAccess) -> Result<u64, RemoteFail> {
    let eff = match target {
        KeyTarget::None => return Err(RemoteFail::NoSuchKey),
        KeyTarget::Mr(mr) => {
            if mr.key != req.rkey {
                return Err(RemoteFail::StaleKey);
            }
            if mr.pd != req.qp.pd {
                return Err(RemoteFail::PdMismatch);
            }
            if !mr.access.contains(req.need) {
                return Err(RemoteFail::AccessDenied);
            }
            if !within(req.addr, req.len, mr.addr, mr.len) {
                return Err(RemoteFail::OutOfBounds);
            }
            req.addr
        }
        KeyTarget::Window(w) => {
            if w.rkey != req.rkey {
                return Err(RemoteFail::StaleKey);
            }
            let b = w.binding.ok_or(RemoteFail::NotBound)?;
            if w.pd != req.qp.pd {
                return Err(RemoteFail::PdMismatch);
            }
            if b.qp != req.qp.qp {
                return Err(RemoteFail::WrongQp);
            }
            if !b.access.contains(req.need) {
                return Err(RemoteFail::AccessDenied);
            }
            let eff = if b.access.contains(AccessFlags::ZERO_BASED) {
                b.addr.checked_add(req.addr).ok_or(RemoteFail::OutOfBounds)?
            } else {
                req.addr
            };
            let (base, size) = match mode {
                Mode::Strict => (b.addr, b.len),
                Mode::Rxe => (b.mr.addr, b.mr.len),
            };
            if !within(eff, req.len, base, size) {
                return Err(RemoteFail::OutOfBounds);
            }
            eff
        }
    };
    if req.atomic && eff % 8 != 0 {
        return Err(RemoteFail::MisalignedAtomic);
    }
    Ok(eff)
}

// ---- bind ---------------------------------------------------------------------------------

/// A type-2 BIND_MW work request.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct BindRequest {
    /// The QP the bind is posted on.
    pub posting: QpRef,
    /// The QP the window becomes bound to; `None` if the named QP does not exist. Equal to
    /// `posting` for an ordinary bind; another QP only with [`BindRequest::other_qp_capable`].
    pub target: Option<QpRef>,
    /// The device can bind a window to a QP other than the posting one (mlx5 UMR's `qpn`
    /// field; omw's `BIND_TO_OTHER_QP` capability).
    pub other_qp_capable: bool,
    pub addr: u64,
    pub len: u64,
    /// The window's access rights as the WQE carries them (raw, so unknown bits can be judged).
    pub access: u32,
}

/// Why a bind is refused (the WQE completes with `MW_BIND_ERR`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum BindFail {
    /// The rights name a bit no window may carry: unknown, or MR-only (`MW_BIND`, `ON_DEMAND`).
    BadAccess(u32),
    AlreadyBound,
    /// The window's PD differs from the QP it would be bound to (C10-72).
    PdMismatch,
    /// The MR's PD differs from the window's.
    MrPdMismatch,
    ZeroLength,
    /// The lkey names no valid MR with that exact key.
    BadMr,
    /// rxe refuses to bind onto a zero-based MR (rxe_check_bind_mw).
    ZeroBasedMr,
    /// C10-73.
    MrLacksMwBind,
    /// C10-74: a writable window needs LOCAL_WRITE on the MR.
    MrLacksLocalWrite,
    /// C10-75.
    OutsideMr,
    /// The named target QP does not exist.
    BadTargetQp,
    /// A bind naming another QP on a device without the capability.
    OtherQpWithoutCapability,
}

/// Bits rxe accepts in a window's rights: `RXE_ACCESS_SUPPORTED_MW` (rxe_verbs.h) =
/// `RXE_ACCESS_SUPPORTED_MR | IB_ZERO_BASED`, and the MR set includes `MW_BIND` and
/// `ON_DEMAND` (and FLUSH/relaxed-ordering bits omw's [`AccessFlags`] does not model, so those
/// count as unknown here).
const RXE_SUPPORTED_MW: u32 = AccessFlags::all().bits();

/// The memory windows' bind rules. Effect on success: the window is bound to
/// `req.target` with `req.addr/len/access` and the caller's new key.
///
/// PD rule: window PD == MR PD == target QP PD. The posting QP's PD matters only when it is
/// the target: a device with the capability may post a bind from a private loop QP into
/// another PD (the MN does, DESIGN.md §6.4).
///
/// [`Mode::Rxe`] deviations, read from rxe_mw.c: rights are refused only if outside
/// `RXE_ACCESS_SUPPORTED_MW` (so `MW_BIND` / `ON_DEMAND` are accepted, and ignored); the MR's
/// PD is never compared with the window's (`rxe_bind_mw` looks the MR up by index alone); a
/// zero-based window is checked only for `len <= mr.len`, not for its address (C10-75 branch).
pub fn check_bind(mode: Mode, window: Window, mr: Option<Mr>, req: BindRequest) -> Result<(), BindFail> {
    let access = match mode {
        Mode::Strict => AccessFlags::from_bits(req.access)
            .filter(|a| !a.intersects(AccessFlags::MR_ONLY))
            .ok_or(BindFail::BadAccess(req.access))?,
        Mode::Rxe if req.access & !RXE_SUPPORTED_MW != 0 => return Err(BindFail::BadAccess(req.access)),
        Mode::Rxe => AccessFlags::from_bits_truncate(req.access),
    };
    if window.binding.is_some() {
        return Err(BindFail::AlreadyBound);
    }
    let target = req.target;
    let to_other = target.is_some_and(|t| t.qp != req.posting.qp);
    if to_other && !req.other_qp_capable {
        return Err(BindFail::OtherQpWithoutCapability);
    }
    if !to_other && window.pd != req.posting.pd {
        return Err(BindFail::PdMismatch);
    }
    if req.len == 0 {
        return Err(BindFail::ZeroLength);
    }
    let mr = mr.ok_or(BindFail::BadMr)?;
    if mode == Mode::Strict && mr.pd != window.pd {
        return Err(BindFail::MrPdMismatch);
    }
    if mr.access.contains(AccessFlags::ZERO_BASED) {
        return Err(BindFail::ZeroBasedMr);
    }
    if !mr.access.contains(AccessFlags::MW_BIND) {
        return Err(BindFail::MrLacksMwBind);
    }
    if access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
        && !mr.access.contains(AccessFlags::LOCAL_WRITE)
    {
        return Err(BindFail::MrLacksLocalWrite);
    }
    let inside = match mode {
        Mode::Rxe if access.contains(AccessFlags::ZERO_BASED) => req.len <= mr.len,
        _ => within(req.addr, req.len, mr.addr, mr.len),
    };
    if !inside {
        return Err(BindFail::OutsideMr);
    }
    let t = target.ok_or(BindFail::BadTargetQp)?;
    if t.pd != window.pd {
        return Err(BindFail::PdMismatch);
    }
    Ok(())
}

// ---- invalidation -------------------------------------------------------------------------

/// Who asks for an invalidation.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Invalidator {
    /// LOCAL_INV posted on this QP.
    LocalInv { qp: u32 },
    /// SEND_WITH_INV received on this QP.
    SendWithInv { qp: u32 },
    /// omw's UNBIND (a zero-length bind through the capability, mlx5 UMR): the owner of the
    /// PD revokes a window from any QP, so no QP check.
    Unbind,
}

/// Why an invalidation is refused. LOCAL_INV / UNBIND complete with `MW_BIND_ERR` (strict) or
/// `LOC_QP_OP_ERR` (rxe); a SEND_WITH_INV fails on the responder (class J, see
/// [`check_invalidate`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum InvalidateFail {
    /// The key's index names no window.
    NotAWindow,
    StaleKey,
    NotBound,
    /// The window is bound to a QP other than the one invalidating it.
    WrongQp,
}

/// Invalidation with an exact rkey match. [`Mode::Strict`]: only the bound QP may invalidate
/// (LOCAL_INV posted on it, SEND_WITH_INV received on it). [`Mode::Rxe`]: no QP check
/// (§3 deviation (a), measured for LOCAL_INV; `rxe_check_invalidate_mw` ignores its `qp`
/// argument for both).
///
/// rxe refuses only an *invalid* (deallocated) window and lets a free (unbound) one through to
/// `rxe_do_invalidate_mw`, which then drops a NULL QP reference — a suspected kernel fault the
/// model does not reproduce: an unbound window is [`InvalidateFail::NotBound`] in both modes.
pub fn check_invalidate(mode: Mode, window: Option<Window>, rkey: u32, by: Invalidator) -> Result<(), InvalidateFail> {
    let w = window.ok_or(InvalidateFail::NotAWindow)?;
    if w.rkey != rkey {
        return Err(InvalidateFail::StaleKey);
    }
    let b = w.binding.ok_or(InvalidateFail::NotBound)?;
    let by_qp = match by {
        Invalidator::LocalInv { qp } | Invalidator::SendWithInv { qp } => Some(qp),
        Invalidator::Unbind => None,
    };
    if let (Mode::Strict, Some(q)) = (mode, by_qp) {
        if q != b.qp {
            return Err(InvalidateFail::WrongQp);
        }
    }
    Ok(())
}

// ---- deallocation -------------------------------------------------------------------------

/// Why `dealloc_mw` is refused.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum DeallocFail {
    NotAWindow,
    /// The key byte is not the window's current one.
    StaleKey,
}

/// What a successful deallocation does besides freeing the window.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Dealloc {
    /// The binding the deallocation revokes: later accesses through its rkey fail.
    pub revoked: Option<Binding>,
}

/// `dealloc_mw` of a type-2 window, bound or not, succeeds and revokes any binding (IBTA
/// 10.6.7.2.2 "Deallocate Memory Window"; rxe_mw_cleanup drops the MR and QP references and
/// marks the window invalid). The key named must be the current one.
pub fn check_dealloc(window: Option<Window>, rkey: u32) -> Result<Dealloc, DeallocFail> {
    let w = window.ok_or(DeallocFail::NotAWindow)?;
    if w.rkey != rkey {
        return Err(DeallocFail::StaleKey);
    }
    Ok(Dealloc { revoked: w.binding })
}

// ---- registration -------------------------------------------------------------------------

/// Why a registration is refused.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum RegMrFail {
    UnknownAccess(u32),
    /// A zero-based MR: libibverbs registers those through `ibv_reg_mr_iova` with an IOVA, not
    /// an access bit, and rxe refuses the bit (`RXE_ACCESS_SUPPORTED_MR` lacks `IB_ZERO_BASED`).
    ZeroBased,
    /// On-demand paging: the model has no page-fault path, so it refuses rather than ignore.
    OnDemand,
    /// `ibv_reg_mr(3)`: REMOTE_WRITE or REMOTE_ATOMIC requires LOCAL_WRITE.
    RemoteWriteWithoutLocalWrite,
}

/// The rights an MR may be registered with, in both modes.
pub fn check_reg_mr(access: u32) -> Result<AccessFlags, RegMrFail> {
    let a = AccessFlags::from_bits(access).ok_or(RegMrFail::UnknownAccess(access))?;
    if a.contains(AccessFlags::ZERO_BASED) {
        return Err(RegMrFail::ZeroBased);
    }
    if a.contains(AccessFlags::ON_DEMAND) {
        return Err(RegMrFail::OnDemand);
    }
    if a.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC) && !a.contains(AccessFlags::LOCAL_WRITE) {
        return Err(RegMrFail::RemoteWriteWithoutLocalWrite);
    }
    Ok(a)
}

/// `[addr, addr+len)` inside `[base, base+size)`, overflow-safe.
#[inline]
pub fn within(addr: u64, len: u64, base: u64, size: u64) -> bool {
    match (addr.checked_add(len), base.checked_add(size)) {
        (Some(end), Some(lim)) => addr >= base && end <= lim,
        _ => false,
    }
}

// ---- Display ------------------------------------------------------------------------------

impl fmt::Display for LocalFail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NoSuchKey => "lkey names no memory region",
            Self::WindowAsLkey => "a memory window's key used as an lkey",
            Self::StaleKey => "lkey's key byte is stale",
            Self::PdMismatch => "memory region is in another protection domain",
            Self::NoLocalWrite => "memory region lacks LOCAL_WRITE",
            Self::OutOfBounds => "range outside the memory region",
        })
    }
}

impl fmt::Display for RemoteFail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NoSuchKey => "rkey names no memory region or window",
            Self::StaleKey => "rkey's key byte is stale",
            Self::NotBound => "memory window is not bound",
            Self::PdMismatch => "rkey is in another protection domain",
            Self::WrongQp => "memory window is bound to another QP",
            Self::AccessDenied => "rkey lacks the access right",
            Self::OutOfBounds => "range outside the region or window",
            Self::MisalignedAtomic => "atomic address not 8-byte aligned",
        })
    }
}

impl fmt::Display for BindFail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadAccess(a) => write!(f, "window access rights {a:#x} are not allowed on a window"),
            Self::AlreadyBound => f.write_str("memory window is already bound"),
            Self::PdMismatch => f.write_str("window and target QP are in different protection domains"),
            Self::MrPdMismatch => f.write_str("window and memory region are in different protection domains"),
            Self::ZeroLength => f.write_str("zero-length bind"),
            Self::BadMr => f.write_str("lkey names no valid memory region"),
            Self::ZeroBasedMr => f.write_str("memory region is zero-based"),
            Self::MrLacksMwBind => f.write_str("memory region lacks MW_BIND"),
            Self::MrLacksLocalWrite => f.write_str("writable window on a memory region without LOCAL_WRITE"),
            Self::OutsideMr => f.write_str("window outside the memory region"),
            Self::BadTargetQp => f.write_str("bind names no such QP"),
            Self::OtherQpWithoutCapability => f.write_str("bind to another QP without the capability"),
        }
    }
}

impl fmt::Display for InvalidateFail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotAWindow => "key names no memory window",
            Self::StaleKey => "rkey's key byte is stale",
            Self::NotBound => "memory window is not bound",
            Self::WrongQp => "memory window is bound to another QP",
        })
    }
}

impl fmt::Display for DeallocFail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotAWindow => "key names no memory window",
            Self::StaleKey => "rkey's key byte is not the window's current one",
        })
    }
}

impl fmt::Display for RegMrFail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownAccess(a) => write!(f, "unknown access bits {a:#x}"),
            Self::ZeroBased => f.write_str("zero-based memory regions are not supported"),
            Self::OnDemand => f.write_str("on-demand paging is not supported"),
            Self::RemoteWriteWithoutLocalWrite => f.write_str("REMOTE_WRITE or REMOTE_ATOMIC without LOCAL_WRITE"),
        }
    }
}

impl core::error::Error for LocalFail {}
impl core::error::Error for RemoteFail {}
impl core::error::Error for BindFail {}
impl core::error::Error for InvalidateFail {}
impl core::error::Error for DeallocFail {}
impl core::error::Error for RegMrFail {}

#[cfg(test)]
mod tests {
    use super::*;

    const RW: AccessFlags = AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE);
    const MR_RIGHTS: AccessFlags = AccessFlags::LOCAL_WRITE.union(AccessFlags::MW_BIND).union(RW);

    fn mr() -> Mr {
        Mr { pd: 1, key: 0x0100 | 0x35, addr: 0x1000, len: 0x1000, access: MR_RIGHTS }
    }
    fn bound(qp: u32, access: AccessFlags) -> Window {
        Window { pd: 1, rkey: 0x0200 | 7, binding: Some(Binding { qp, addr: 0x1100, len: 0x100, access, mr: mr() }) }
    }
    fn free_window() -> Window {
        Window { pd: 1, rkey: 0x0200 | 6, binding: None }
    }
    fn read(qp: u32, rkey: u32, addr: u64, len: u64) -> RemoteAccess {
        RemoteAccess { qp: QpRef { qp, pd: 1 }, rkey, addr, len, need: AccessFlags::REMOTE_READ, atomic: false }
    }
    fn bind_req(posting: QpRef, target: Option<QpRef>) -> BindRequest {
        BindRequest { posting, target, other_qp_capable: false, addr: 0x1000, len: 0x100, access: RW.bits() }
    }
    const Q5: QpRef = QpRef { qp: 5, pd: 1 };

    #[test]
    fn local_sge_rules() {
        let sge = LocalSge { pd: 1, lkey: mr().key, addr: 0x1000, len: 0x1000, write: true };
        assert_eq!(check_local(KeyTarget::Mr(mr()), sge), Ok(()));
        assert_eq!(check_local(KeyTarget::None, sge), Err(LocalFail::NoSuchKey));
        assert_eq!(check_local(KeyTarget::Window(free_window()), sge), Err(LocalFail::WindowAsLkey));
        assert_eq!(check_local(KeyTarget::Mr(mr()), LocalSge { lkey: sge.lkey ^ 1, ..sge }), Err(LocalFail::StaleKey));
        assert_eq!(check_local(KeyTarget::Mr(mr()), LocalSge { pd: 2, ..sge }), Err(LocalFail::PdMismatch));
        let ro = Mr { access: AccessFlags::REMOTE_READ, ..mr() };
        assert_eq!(check_local(KeyTarget::Mr(ro), sge), Err(LocalFail::NoLocalWrite));
        assert_eq!(check_local(KeyTarget::Mr(ro), LocalSge { write: false, ..sge }), Ok(()));
        assert_eq!(check_local(KeyTarget::Mr(mr()), LocalSge { addr: 0x1001, ..sge }), Err(LocalFail::OutOfBounds));
    }

    #[test]
    fn remote_mr_rules() {
        let t = KeyTarget::Mr(mr());
        let k = mr().key;
        for mode in [Mode::Strict, Mode::Rxe] {
            assert_eq!(check_remote(mode, t, read(9, k, 0x1000, 8)), Ok(0x1000));
            assert_eq!(check_remote(mode, KeyTarget::None, read(9, k, 0x1000, 8)), Err(RemoteFail::NoSuchKey));
            assert_eq!(check_remote(mode, t, read(9, k ^ 1, 0x1000, 8)), Err(RemoteFail::StaleKey));
            let other_pd = RemoteAccess { qp: QpRef { qp: 9, pd: 2 }, ..read(9, k, 0x1000, 8) };
            assert_eq!(check_remote(mode, t, other_pd), Err(RemoteFail::PdMismatch));
            let atomic = RemoteAccess { need: AccessFlags::REMOTE_ATOMIC, atomic: true, ..read(9, k, 0x1000, 8) };
            assert_eq!(check_remote(mode, t, atomic), Err(RemoteFail::AccessDenied));
            assert_eq!(check_remote(mode, t, read(9, k, 0x1ff9, 8)), Err(RemoteFail::OutOfBounds));
            let atomic_mr = KeyTarget::Mr(Mr { access: MR_RIGHTS | AccessFlags::REMOTE_ATOMIC, ..mr() });
            assert_eq!(check_remote(mode, atomic_mr, atomic), Ok(0x1000));
            let mis = RemoteAccess { addr: 0x1004, ..atomic };
            assert_eq!(check_remote(mode, atomic_mr, mis), Err(RemoteFail::MisalignedAtomic));
            assert_eq!(RemoteFail::MisalignedAtomic.nak(), Nak::InvalidRequest);
            assert_eq!(RemoteFail::OutOfBounds.nak(), Nak::RemoteAccess);
        }
    }

    #[test]
    fn remote_window_rules() {
        let w = bound(5, RW);
        let t = KeyTarget::Window(w);
        for mode in [Mode::Strict, Mode::Rxe] {
            assert_eq!(check_remote(mode, t, read(5, w.rkey, 0x1100, 0x100)), Ok(0x1100));
            assert_eq!(check_remote(mode, t, read(5, w.rkey ^ 1, 0x1100, 8)), Err(RemoteFail::StaleKey));
            assert_eq!(check_remote(mode, t, read(6, w.rkey, 0x1100, 8)), Err(RemoteFail::WrongQp));
            let other_pd = RemoteAccess { qp: QpRef { qp: 5, pd: 2 }, ..read(5, w.rkey, 0x1100, 8) };
            assert_eq!(check_remote(mode, t, other_pd), Err(RemoteFail::PdMismatch));
            let ro = KeyTarget::Window(bound(5, AccessFlags::REMOTE_READ));
            let write = RemoteAccess { need: AccessFlags::REMOTE_WRITE, ..read(5, w.rkey, 0x1100, 8) };
            assert_eq!(check_remote(mode, ro, write), Err(RemoteFail::AccessDenied));
            let unbound = KeyTarget::Window(Window { binding: None, ..w });
            assert_eq!(check_remote(mode, unbound, read(5, w.rkey, 0x1100, 8)), Err(RemoteFail::NotBound));
            // beyond the MR: refused in both modes
            assert_eq!(check_remote(mode, t, read(5, w.rkey, 0x1ff9, 8)), Err(RemoteFail::OutOfBounds));
        }
        // past the window but inside the MR: the spec refuses, rxe does not (§3 deviation b)
        assert_eq!(check_remote(Mode::Strict, t, read(5, w.rkey, 0x11f9, 8)), Err(RemoteFail::OutOfBounds));
        assert_eq!(check_remote(Mode::Rxe, t, read(5, w.rkey, 0x11f9, 8)), Ok(0x11f9));
    }

    #[test]
    fn zero_based_window_adds_its_base() {
        let w = bound(5, RW | AccessFlags::ZERO_BASED);
        let t = KeyTarget::Window(w);
        assert_eq!(check_remote(Mode::Strict, t, read(5, w.rkey, 0x10, 8)), Ok(0x1110));
        assert_eq!(check_remote(Mode::Strict, t, read(5, w.rkey, 0xf9, 8)), Err(RemoteFail::OutOfBounds));
        assert_eq!(check_remote(Mode::Strict, t, read(5, w.rkey, u64::MAX, 1)), Err(RemoteFail::OutOfBounds));
        let atomic = RemoteAccess { need: AccessFlags::REMOTE_READ, atomic: true, ..read(5, w.rkey, 0x4, 8) };
        assert_eq!(check_remote(Mode::Strict, t, atomic), Err(RemoteFail::MisalignedAtomic));
    }

    #[test]
    fn bind_accepts_a_correct_bind_in_both_modes() {
        for mode in [Mode::Strict, Mode::Rxe] {
            assert_eq!(check_bind(mode, free_window(), Some(mr()), bind_req(Q5, Some(Q5))), Ok(()));
        }
    }

    #[test]
    fn bind_refusals() {
        let w = free_window();
        let ok = bind_req(Q5, Some(Q5));
        let s = Mode::Strict;
        assert_eq!(check_bind(s, bound(5, RW), Some(mr()), ok), Err(BindFail::AlreadyBound));
        assert_eq!(check_bind(s, w, Some(mr()), BindRequest { len: 0, ..ok }), Err(BindFail::ZeroLength));
        assert_eq!(check_bind(s, w, None, ok), Err(BindFail::BadMr));
        let no_bind = Mr { access: AccessFlags::LOCAL_WRITE | RW, ..mr() };
        assert_eq!(check_bind(s, w, Some(no_bind), ok), Err(BindFail::MrLacksMwBind));
        let no_lw = Mr { access: AccessFlags::MW_BIND | AccessFlags::REMOTE_READ, ..mr() };
        assert_eq!(check_bind(s, w, Some(no_lw), ok), Err(BindFail::MrLacksLocalWrite));
        let ro_req = BindRequest { access: AccessFlags::REMOTE_READ.bits(), ..ok };
        assert_eq!(check_bind(s, w, Some(no_lw), ro_req), Ok(()));
        assert_eq!(check_bind(s, w, Some(mr()), BindRequest { addr: 0x1f01, ..ok }), Err(BindFail::OutsideMr));
        let zb_mr = Mr { access: MR_RIGHTS | AccessFlags::ZERO_BASED, ..mr() };
        assert_eq!(check_bind(s, w, Some(zb_mr), ok), Err(BindFail::ZeroBasedMr));
        assert_eq!(check_bind(s, w, Some(mr()), bind_req(Q5, None)), Err(BindFail::BadTargetQp));
        for bad in [AccessFlags::MW_BIND.bits() | RW.bits(), AccessFlags::ON_DEMAND.bits(), 1 << 12] {
            let r = BindRequest { access: bad, ..ok };
            assert_eq!(check_bind(s, w, Some(mr()), r), Err(BindFail::BadAccess(bad)));
        }
    }

    #[test]
    fn bind_rxe_deviations() {
        let w = free_window();
        let ok = bind_req(Q5, Some(Q5));
        let r = Mode::Rxe;
        // unknown bits: MW_BIND_ERR in rxe too; MW_BIND / ON_DEMAND are in RXE_ACCESS_SUPPORTED_MW
        assert_eq!(
            check_bind(r, w, Some(mr()), BindRequest { access: 1 << 12, ..ok }),
            Err(BindFail::BadAccess(1 << 12))
        );
        let mwb = BindRequest { access: RW.bits() | AccessFlags::MW_BIND.bits(), ..ok };
        assert_eq!(check_bind(r, w, Some(mr()), mwb), Ok(()));
        // the MR's PD is not compared
        let other_pd_mr = Mr { pd: 2, ..mr() };
        assert_eq!(check_bind(r, w, Some(other_pd_mr), ok), Ok(()));
        assert_eq!(check_bind(Mode::Strict, w, Some(other_pd_mr), ok), Err(BindFail::MrPdMismatch));
        // a zero-based window is checked by length only
        let zb = BindRequest { addr: 0x9000, access: (RW | AccessFlags::ZERO_BASED).bits(), ..ok };
        assert_eq!(check_bind(r, w, Some(mr()), zb), Ok(()));
        assert_eq!(check_bind(Mode::Strict, w, Some(mr()), zb), Err(BindFail::OutsideMr));
        assert_eq!(check_bind(r, w, Some(mr()), BindRequest { len: 0x1001, ..zb }), Err(BindFail::OutsideMr));
    }

    #[test]
    fn bind_pd_rule_with_and_without_another_qp() {
        let w = free_window(); // PD 1
        let loop_qp = QpRef { qp: 1, pd: 7 }; // an MN-private loop QP in another PD
        let cn_qp = QpRef { qp: 2, pd: 1 };
        let mut req = bind_req(loop_qp, Some(cn_qp));
        for mode in [Mode::Strict, Mode::Rxe] {
            assert_eq!(check_bind(mode, w, Some(mr()), req), Err(BindFail::OtherQpWithoutCapability));
        }
        req.other_qp_capable = true;
        for mode in [Mode::Strict, Mode::Rxe] {
            assert_eq!(check_bind(mode, w, Some(mr()), req), Ok(()), "posting QP's PD need not match");
            let wrong_target = BindRequest { target: Some(QpRef { qp: 3, pd: 2 }), ..req };
            assert_eq!(check_bind(mode, w, Some(mr()), wrong_target), Err(BindFail::PdMismatch));
            // targeting itself, the posting QP's PD must match
            let own = BindRequest { target: Some(loop_qp), ..req };
            assert_eq!(check_bind(mode, w, Some(mr()), own), Err(BindFail::PdMismatch));
        }
    }

    #[test]
    fn invalidation_rules() {
        let w = bound(5, RW);
        for mode in [Mode::Strict, Mode::Rxe] {
            for by in [Invalidator::LocalInv { qp: 5 }, Invalidator::SendWithInv { qp: 5 }, Invalidator::Unbind] {
                assert_eq!(check_invalidate(mode, Some(w), w.rkey, by), Ok(()));
                assert_eq!(check_invalidate(mode, Some(w), w.rkey ^ 1, by), Err(InvalidateFail::StaleKey));
                assert_eq!(check_invalidate(mode, None, w.rkey, by), Err(InvalidateFail::NotAWindow));
                let f = free_window();
                assert_eq!(check_invalidate(mode, Some(f), f.rkey, by), Err(InvalidateFail::NotBound));
            }
            assert_eq!(check_invalidate(mode, Some(w), w.rkey, Invalidator::Unbind), Ok(()));
        }
        for by in [Invalidator::LocalInv { qp: 6 }, Invalidator::SendWithInv { qp: 6 }] {
            assert_eq!(check_invalidate(Mode::Strict, Some(w), w.rkey, by), Err(InvalidateFail::WrongQp));
            assert_eq!(check_invalidate(Mode::Rxe, Some(w), w.rkey, by), Ok(()), "§3 deviation (a)");
        }
    }

    #[test]
    fn dealloc_rules() {
        let w = bound(5, RW);
        assert_eq!(check_dealloc(Some(w), w.rkey), Ok(Dealloc { revoked: w.binding }));
        let f = free_window();
        assert_eq!(check_dealloc(Some(f), f.rkey), Ok(Dealloc { revoked: None }));
        assert_eq!(check_dealloc(Some(w), w.rkey ^ 1), Err(DeallocFail::StaleKey));
        assert_eq!(check_dealloc(None, w.rkey), Err(DeallocFail::NotAWindow));
    }

    #[test]
    fn reg_mr_rules() {
        assert_eq!(check_reg_mr(MR_RIGHTS.bits()), Ok(MR_RIGHTS));
        assert_eq!(check_reg_mr(0), Ok(AccessFlags::empty()));
        assert_eq!(check_reg_mr(1 << 12), Err(RegMrFail::UnknownAccess(1 << 12)));
        assert_eq!(check_reg_mr((MR_RIGHTS | AccessFlags::ZERO_BASED).bits()), Err(RegMrFail::ZeroBased));
        assert_eq!(check_reg_mr((MR_RIGHTS | AccessFlags::ON_DEMAND).bits()), Err(RegMrFail::OnDemand));
        assert_eq!(check_reg_mr(AccessFlags::REMOTE_WRITE.bits()), Err(RegMrFail::RemoteWriteWithoutLocalWrite));
        assert_eq!(check_reg_mr(AccessFlags::REMOTE_ATOMIC.bits()), Err(RegMrFail::RemoteWriteWithoutLocalWrite));
    }

    #[test]
    fn within_is_overflow_safe() {
        assert!(within(5, 0, 5, 0));
        assert!(!within(u64::MAX, 2, 0, u64::MAX));
        assert!(!within(4, 2, 5, 10));
    }

    #[test]
    fn every_reason_displays() {
        extern crate std;
        use std::string::ToString;
        assert!(!RemoteFail::WrongQp.to_string().is_empty());
        assert!(BindFail::BadAccess(0x10).to_string().contains("0x10"));
        assert!(!InvalidateFail::NotBound.to_string().is_empty());
        assert!(!DeallocFail::StaleKey.to_string().is_empty());
        assert!(!LocalFail::WindowAsLkey.to_string().is_empty());
        assert!(RegMrFail::UnknownAccess(0x1000).to_string().contains("0x1000"));
    }
}
