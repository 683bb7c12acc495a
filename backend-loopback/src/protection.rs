//! Protection domains, memory regions, type-2 memory windows, and the access checks of
//! DESIGN.md §3, per host.
//!
//! MRs and MWs share one key-index space per host: a key is `index << 8 | key` with a 24-bit
//! index (never 0, so an rkey of 0 never validates) and an 8-bit consumer key. An MR's lkey
//! equals its rkey. A window's rkey changes only by a bind (the bind names the new key); a
//! stale key never validates.

use omw_core::access::AccessFlags;
use omw_core::device::mw_rules::{
    self, BindFail, BindRequest, DeallocFail, InvalidateFail, Invalidator, KeyTarget, LocalFail, LocalSge, Mode, QpRef,
    RemoteAccess, RemoteFail,
};
use omw_core::ids::{Qpn, Rkey};

/// A protection domain of one host. PD 0 exists on every host (the ring arena is in it).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord, Default)]
pub struct PdId(pub u32);

/// Where a bound type-2 window points.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct WindowBinding {
    /// The QP the window is bound to: remote accesses arriving on any other QP are refused.
    pub qpn: Qpn,
    /// lkey of the MR the window lies in.
    pub mr_lkey: u32,
    pub addr: u64,
    pub len: u64,
    pub access: AccessFlags,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum MwState {
    /// Allocated but not bound (initially, after LOCAL_INV / SEND_WITH_INV / UNBIND, after an
    /// RNIC reset): no rkey validates.
    Free,
    Bound(WindowBinding),
}

/// Public view of a window: its current rkey (the last key bound, or the initial one).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct MwInfo {
    pub rkey: Rkey,
    pub pd: PdId,
    pub state: MwState,
}

/// Public view of a memory region.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct MrInfo {
    pub key: u32,
    pub pd: PdId,
    pub addr: u64,
    pub len: u64,
    pub access: AccessFlags,
    pub bound_windows: u32,
}

#[derive(Clone, Copy, Debug)]
enum KeyObj {
    Vacant,
    Mr(u32),
    Mw(u32),
}

#[derive(Clone, Copy, Debug)]
struct Mr {
    pd: u32,
    addr: u64,
    len: u64,
    access: AccessFlags,
    key: u32,
    valid: bool,
    bound_windows: u32,
}

impl Mr {
    fn info(&self) -> MrInfo {
        MrInfo {
            key: self.key,
            pd: PdId(self.pd),
            addr: self.addr,
            len: self.len,
            access: self.access,
            bound_windows: self.bound_windows,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Mw {
    pd: u32,
    rkey: u32,
    state: MwState,
    /// Global index of the bound QP (valid when bound).
    bound_gq: u32,
    /// MR index of the binding (valid when bound).
    mr: u32,
}

/// Why a BIND_MW / UNBIND / LOCAL_INV / remote invalidation failed (all complete with
/// `MwBindErr`, `LocQpOpErr` (rxe LOCAL_INV) or fail the responder (SEND_WITH_INV); the
/// reason is for traces). The rules are [`omw_core::device::mw_rules`].
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum MwOpFail {
    /// The bind's key index names no window.
    NotAWindow,
    /// The device refuses the bind's form before any window rule: a QPN other than the
    /// poster's (`ForeignBind::Refused`), or mlx5 bytes a window cannot carry.
    Refused,
    Bind(BindFail),
    Invalidate(InvalidateFail),
}

impl std::fmt::Display for MwOpFail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotAWindow => f.write_str("key names no memory window"),
            Self::Refused => f.write_str("the device refuses this form of bind"),
            Self::Bind(e) => write!(f, "bind refused: {e}"),
            Self::Invalidate(e) => write!(f, "invalidation refused: {e}"),
        }
    }
}

impl std::error::Error for MwOpFail {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::NotAWindow | Self::Refused => None,
            Self::Bind(e) => Some(e),
            Self::Invalidate(e) => Some(e),
        }
    }
}

/// The target of a bind, resolved by the fabric.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BindTarget {
    pub gq: u32,
    pub qpn: u32,
    pub pd: u32,
}

/// How a device picks the 8-bit consumer key of a new MR or MW (the low byte of its key).
///
/// Drawn the way the modelled hardware draws it, from a seed, so no test can lean on a fixed
/// key and an attacker model faces what it would face on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyDraw {
    /// mlx5: one device-wide 8-bit counter, incremented for every mkey the driver creates
    /// (`assign_mkey_variant`: `key = atomic_inc_return(&dev->mkey_var)`, Linux
    /// drivers/infiniband/hw/mlx5/mr.c). Predictable to anyone who sees one key — which is
    /// why isolation may never rest on keys. The counter starts at a seeded value.
    DeviceCounter { next: u8 },
    /// rxe: a fresh random byte per object (`rxe_get_next_key` → `get_random_bytes`, Linux
    /// drivers/infiniband/sw/rxe/rxe_mr.c); here a seeded xorshift stream.
    Random { state: u64 },
}

impl KeyDraw {
    /// The draw of the modelled device: the strict model follows mlx5, the rxe-compatible
    /// model rxe. `seed` comes from the fabric's seed and the host index.
    pub fn for_device(rxe: bool, seed: u64) -> Self {
        let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
        let first = splitmix(&mut s);
        if rxe {
            KeyDraw::Random { state: first | 1 }
        } else {
            KeyDraw::DeviceCounter { next: first as u8 }
        }
    }

    fn draw(&mut self) -> u32 {
        match self {
            KeyDraw::DeviceCounter { next } => {
                *next = next.wrapping_add(1);
                *next as u32
            }
            KeyDraw::Random { state } => {
                let mut x = *state;
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *state = x;
                (x >> 24) as u32 & 0xFF
            }
        }
    }
}

fn splitmix(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[derive(Debug)]
pub(crate) struct Protection {
    pds: u32,
    keys: Vec<KeyObj>,
    mrs: Vec<Mr>,
    mws: Vec<Mw>,
    draw: KeyDraw,
}

impl Protection {
    pub fn new(draw: KeyDraw) -> Self {
        Protection { pds: 1, keys: vec![KeyObj::Vacant], mrs: Vec::new(), mws: Vec::new(), draw }
    }

    pub fn alloc_pd(&mut self) -> PdId {
        self.pds += 1;
        PdId(self.pds - 1)
    }

    pub fn pd_exists(&self, pd: PdId) -> bool {
        pd.0 < self.pds
    }

    fn new_index(&mut self, obj: KeyObj) -> Option<u32> {
        let index = self.keys.len() as u32;
        if index > Rkey::MAX_INDEX {
            return None;
        }
        self.keys.push(obj);
        Some(index)
    }

    /// Register `[addr, addr+len)` (the caller checked it is allocated, and its rights with
    /// [`mw_rules::check_reg_mr`]). Returns the key.
    pub fn reg_mr(&mut self, pd: PdId, addr: u64, len: u64, access: AccessFlags) -> Option<u32> {
        let mr = self.mrs.len() as u32;
        let index = self.new_index(KeyObj::Mr(mr))?;
        let key = (index << 8) | self.draw.draw();
        self.mrs.push(Mr { pd: pd.0, addr, len, access, key, valid: true, bound_windows: 0 });
        Some(key)
    }

    /// `Err(true)` if windows are still bound to it, `Err(false)` if no such MR.
    pub fn dereg_mr(&mut self, key: u32) -> Result<(), bool> {
        let m = self.mr_index(key).ok_or(false)?;
        let mr = &mut self.mrs[m as usize];
        if mr.bound_windows > 0 {
            return Err(true);
        }
        mr.valid = false;
        self.keys[(key >> 8) as usize] = KeyObj::Vacant;
        Ok(())
    }

    pub fn alloc_mw(&mut self, pd: PdId) -> Option<Rkey> {
        let key = self.draw.draw();
        self.alloc_mw_keyed(pd, key as u8)
    }

    /// A window whose first key byte the creator chose: an mlx5 mkey made by CREATE_MKEY
    /// carries the `mkey_7_0` its creator wrote (the ConnectX double's windows).
    pub fn alloc_mw_keyed(&mut self, pd: PdId, key: u8) -> Option<Rkey> {
        let mw = self.mws.len() as u32;
        let index = self.new_index(KeyObj::Mw(mw))?;
        let rkey = (index << 8) | key as u32;
        self.mws.push(Mw { pd: pd.0, rkey, state: MwState::Free, bound_gq: u32::MAX, mr: u32::MAX });
        Some(Rkey(rkey))
    }

    /// Deallocate a window, bound or not ([`mw_rules::check_dealloc`]): a binding is revoked,
    /// so later accesses through its rkey find no key. Returns the revoked binding.
    pub fn dealloc_mw(&mut self, rkey: u32) -> Result<Option<WindowBinding>, DeallocFail> {
        let w = self.mw_index_any_key(rkey >> 8);
        let d = mw_rules::check_dealloc(w.map(|w| self.window(w)), rkey)?;
        let w = w.ok_or(DeallocFail::NotAWindow)?;
        let revoked = match self.mws[w as usize].state {
            MwState::Bound(b) => Some(b),
            MwState::Free => None,
        };
        debug_assert_eq!(revoked.is_some(), d.revoked.is_some());
        self.unbind_index(w);
        self.keys[(rkey >> 8) as usize] = KeyObj::Vacant;
        Ok(revoked)
    }

    #[inline]
    fn mr_index(&self, key: u32) -> Option<u32> {
        match self.keys.get((key >> 8) as usize) {
            Some(KeyObj::Mr(m)) => {
                let mr = &self.mrs[*m as usize];
                (mr.valid && mr.key == key).then_some(*m)
            }
            _ => None,
        }
    }

    fn mw_index_any_key(&self, index: u32) -> Option<u32> {
        match self.keys.get(index as usize) {
            Some(KeyObj::Mw(w)) => Some(*w),
            _ => None,
        }
    }

    #[inline]
    fn mr_view(&self, m: u32) -> mw_rules::Mr {
        let mr = &self.mrs[m as usize];
        mw_rules::Mr { pd: mr.pd, key: mr.key, addr: mr.addr, len: mr.len, access: mr.access }
    }

    #[inline]
    fn window(&self, w: u32) -> mw_rules::Window {
        let mw = &self.mws[w as usize];
        let binding = match mw.state {
            MwState::Free => None,
            MwState::Bound(b) => Some(mw_rules::Binding {
                qp: mw.bound_gq,
                addr: b.addr,
                len: b.len,
                access: b.access,
                mr: self.mr_view(mw.mr),
            }),
        };
        mw_rules::Window { pd: mw.pd, rkey: mw.rkey, binding }
    }

    /// What the index of `key` names, as the rules see it (a deregistered MR is nothing).
    #[inline]
    fn target(&self, key: u32) -> KeyTarget {
        match self.keys.get((key >> 8) as usize) {
            None | Some(KeyObj::Vacant) => KeyTarget::None,
            Some(KeyObj::Mr(m)) if self.mrs[*m as usize].valid => KeyTarget::Mr(self.mr_view(*m)),
            Some(KeyObj::Mr(_)) => KeyTarget::None,
            Some(KeyObj::Mw(w)) => KeyTarget::Window(self.window(*w)),
        }
    }

    pub fn mr_info(&self, key: u32) -> Option<MrInfo> {
        Some(self.mrs[self.mr_index(key)? as usize].info())
    }

    /// Every registered (valid) MR.
    pub fn mrs(&self) -> impl Iterator<Item = MrInfo> + '_ {
        self.mrs.iter().filter(|m| m.valid).map(Mr::info)
    }

    /// The window whose rkey index is `index`, whatever its current key.
    pub fn mw_info(&self, index: u32) -> Option<MwInfo> {
        let w = &self.mws[self.mw_index_any_key(index)? as usize];
        Some(MwInfo { rkey: Rkey(w.rkey), pd: PdId(w.pd), state: w.state })
    }

    /// Every bound window's (rkey, bound global QP index).
    pub fn bound_windows(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.mws.iter().filter(|w| matches!(w.state, MwState::Bound(_))).map(|w| (w.rkey, w.bound_gq))
    }

    /// Local SGE check ([`mw_rules::check_local`]).
    #[inline]
    pub fn check_local(&self, pd: u32, lkey: u32, addr: u64, len: u64, write: bool) -> Result<(), LocalFail> {
        mw_rules::check_local(self.target(lkey), LocalSge { pd, lkey, addr, len, write })
    }

    /// Responder check ([`mw_rules::check_remote`]). `qp`: the QP the request arrived on
    /// (its global index and PD). Returns the address to access (windows may be zero-based).
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub fn check_remote(
        &self,
        mode: Mode,
        qp: QpRef,
        rkey: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
        atomic: bool,
    ) -> Result<u64, RemoteFail> {
        mw_rules::check_remote(mode, self.target(rkey), RemoteAccess { qp, rkey, addr, len, need, atomic })
    }

    /// Type-2 BIND_MW ([`mw_rules::check_bind`]). `posting`: the QP the WQE runs on;
    /// `target`: the QP it names, resolved by the fabric (`None`: no such QP); `access`: the
    /// rights as the WQE carries them.
    #[allow(clippy::too_many_arguments)]
    pub fn bind(
        &mut self,
        mode: Mode,
        posting: QpRef,
        new_rkey: u32,
        lkey: u32,
        addr: u64,
        len: u64,
        access: u32,
        target: Option<BindTarget>,
        other_qp_capable: bool,
    ) -> Result<(), MwOpFail> {
        let w = self.mw_index_any_key(new_rkey >> 8).ok_or(MwOpFail::NotAWindow)?;
        let m = self.mr_index(lkey);
        let req = BindRequest {
            posting,
            target: target.map(|t| QpRef { qp: t.gq, pd: t.pd }),
            other_qp_capable,
            addr,
            len,
            access,
        };
        mw_rules::check_bind(mode, self.window(w), m.map(|m| self.mr_view(m)), req).map_err(MwOpFail::Bind)?;
        let (Some(t), Some(m)) = (target, m) else {
            return Err(MwOpFail::Bind(BindFail::BadTargetQp));
        };
        let qpn = Qpn::new(t.qpn).map_err(|_| MwOpFail::Bind(BindFail::BadTargetQp))?;
        let access = AccessFlags::from_bits_truncate(access);
        let mw = &mut self.mws[w as usize];
        mw.rkey = new_rkey;
        mw.state = MwState::Bound(WindowBinding { qpn, mr_lkey: lkey, addr, len, access });
        mw.bound_gq = t.gq;
        mw.mr = m;
        self.mrs[m as usize].bound_windows += 1;
        Ok(())
    }

    /// Invalidate the window with exactly `rkey` ([`mw_rules::check_invalidate`]; `by` names
    /// the QP by its global index).
    pub fn invalidate(&mut self, mode: Mode, rkey: u32, by: Invalidator) -> Result<(), InvalidateFail> {
        let w = self.mw_index_any_key(rkey >> 8);
        mw_rules::check_invalidate(mode, w.map(|w| self.window(w)), rkey, by)?;
        if let Some(w) = w {
            self.unbind_index(w);
        }
        Ok(())
    }

    fn unbind_index(&mut self, w: u32) {
        let mw = &mut self.mws[w as usize];
        if matches!(mw.state, MwState::Bound(_)) {
            mw.state = MwState::Free;
            let m = mw.mr;
            mw.bound_gq = u32::MAX;
            mw.mr = u32::MAX;
            if let Some(mr) = self.mrs.get_mut(m as usize) {
                mr.bound_windows = mr.bound_windows.saturating_sub(1);
            }
        }
    }

    /// RNIC reset: every binding is lost.
    pub fn unbind_all(&mut self) {
        for w in 0..self.mws.len() as u32 {
            self.unbind_index(w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_unique_and_never_zero() {
        let mut p = Protection::new(KeyDraw::for_device(false, 1));
        let a = p.reg_mr(PdId(0), 0x1000, 0x100, AccessFlags::LOCAL_WRITE).unwrap();
        let w = p.alloc_mw(PdId(0)).unwrap();
        let b = p.reg_mr(PdId(0), 0x1000, 0x100, AccessFlags::LOCAL_WRITE).unwrap();
        assert!(a >> 8 != 0 && w.index() != 0);
        assert_ne!(a >> 8, b >> 8);
        assert_ne!(a >> 8, w.index());
        assert!(p.check_local(0, a, 0x1000, 0x100, true).is_ok());
        assert_eq!(p.check_local(0, a ^ 1, 0x1000, 1, false), Err(LocalFail::StaleKey));
        assert_eq!(p.check_local(1, a, 0x1000, 1, false), Err(LocalFail::PdMismatch));
        assert_eq!(p.check_local(0, a, 0x10ff, 2, false), Err(LocalFail::OutOfBounds));
        assert_eq!(p.check_local(0, w.0, 0x1000, 1, false), Err(LocalFail::WindowAsLkey));
        assert_eq!(p.check_local(0, 0, 0, 0, false), Err(LocalFail::NoSuchKey));
    }

    #[test]
    fn key_bytes_follow_the_modelled_device_and_the_seed() {
        // mlx5: consecutive objects get consecutive key bytes from a seeded start
        let mut a = Protection::new(KeyDraw::for_device(false, 7));
        let k1 = a.reg_mr(PdId(0), 0x1000, 0x100, AccessFlags::LOCAL_WRITE).unwrap();
        let k2 = a.alloc_mw(PdId(0)).unwrap().0;
        assert_eq!((k1 as u8).wrapping_add(1), k2 as u8);
        let mut b = Protection::new(KeyDraw::for_device(false, 8));
        let k1b = b.reg_mr(PdId(0), 0x1000, 0x100, AccessFlags::LOCAL_WRITE).unwrap();
        assert_eq!(k1 >> 8, k1b >> 8, "indexes are assigned in order");
        // over many seeds the first key byte takes many values: nothing can assume it
        let firsts: std::collections::HashSet<u8> = (0..64u64)
            .map(|s| {
                Protection::new(KeyDraw::for_device(true, s)).reg_mr(PdId(0), 0, 1, AccessFlags::empty()).unwrap() as u8
            })
            .collect();
        assert!(firsts.len() > 32, "rxe-like draw is spread out: {}", firsts.len());
        let firsts: std::collections::HashSet<u8> = (0..64u64)
            .map(|s| {
                Protection::new(KeyDraw::for_device(false, s)).reg_mr(PdId(0), 0, 1, AccessFlags::empty()).unwrap()
                    as u8
            })
            .collect();
        assert!(firsts.len() > 32, "mlx5-like counter start is seeded: {}", firsts.len());
    }
}
