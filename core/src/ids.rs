//! Identifiers the protocol passes around: rkeys, QP numbers, CN ids, group ids.
//!
//! They are newtypes because mixing them up is the classic RDMA bug (an lkey where an rkey was
//! meant, a QP number with a stray high byte) and the wire carries them as bare integers.

use core::fmt;

/// A remote key as the InfiniBand spec defines it: a 24-bit index the device assigns and an
/// 8-bit consumer key the binder chooses. Rebinding a window must change the key, and only
/// 256 keys exist per index: the key space wraps inside the low byte (`ibv_inc_rkey`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Rkey(pub u32);

impl Rkey {
    /// Largest 24-bit index.
    pub const MAX_INDEX: u32 = 0x00FF_FFFF;

    pub const fn new(index: u32, key: u8) -> Result<Self, IdError> {
        if index > Self::MAX_INDEX {
            return Err(IdError::RkeyIndexOverflow(index));
        }
        Ok(Rkey((index << 8) | key as u32))
    }
    pub const fn index(self) -> u32 {
        self.0 >> 8
    }
    pub const fn key(self) -> u8 {
        (self.0 & 0xFF) as u8
    }
    /// `ibv_inc_rkey`: the next key of the same index, wrapping inside the byte (never carries
    /// into the index, unlike a plain `+ 1` on `0x…FF`).
    pub const fn next_key(self) -> Self {
        Rkey((self.0 & !0xFF) | (self.key().wrapping_add(1) as u32))
    }
    /// The key [`Rkey::next_key`] came from: the window's key before a bind that followed
    /// `ibv_inc_rkey` (what a bind names as the window's current key, rdma-core's `mw->rkey`).
    pub const fn prev_key(self) -> Self {
        Rkey((self.0 & !0xFF) | (self.key().wrapping_sub(1) as u32))
    }
}

impl fmt::Debug for Rkey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Rkey({:#x}:{:#04x})", self.index(), self.key())
    }
}
impl fmt::Display for Rkey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#010x}", self.0)
    }
}

/// A 24-bit queue pair number. Constructing one checks the range, so a value read from the
/// network can never smuggle bits into a neighbouring field of a WQE.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Qpn(u32);

impl Qpn {
    pub const MAX: u32 = 0x00FF_FFFF;
    pub const ZERO: Qpn = Qpn(0);
    pub const fn new(v: u32) -> Result<Self, IdError> {
        if v > Self::MAX {
            Err(IdError::QpnOverflow(v))
        } else {
            Ok(Qpn(v))
        }
    }
    pub const fn get(self) -> u32 {
        self.0
    }
}
impl fmt::Debug for Qpn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Qpn({:#x})", self.0)
    }
}
impl fmt::Display for Qpn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A compute node's id. 0 is reserved: it is the "no owner" value of an MWTable entry.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct CnId(u32);

impl CnId {
    /// No MN hands this id out (ids fit the MWTable's 24-bit owner field): a placeholder
    /// for a CN not yet told who it is.
    pub const UNASSIGNED: CnId = CnId(u32::MAX);
    pub const fn new(v: u32) -> Result<Self, IdError> {
        if v == 0 {
            Err(IdError::ZeroCnId)
        } else {
            Ok(CnId(v))
        }
    }
    pub const fn get(self) -> u32 {
        self.0
    }
}
impl fmt::Display for CnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cn{}", self.0)
    }
}

/// Index of an MW group (equivalently of a chunk and of its MWTable entry).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct GroupId(pub u32);

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "group{}", self.0)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum IdError {
    RkeyIndexOverflow(u32),
    QpnOverflow(u32),
    ZeroCnId,
}

impl fmt::Display for IdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdError::RkeyIndexOverflow(i) => write!(f, "rkey index {i:#x} does not fit in 24 bits"),
            IdError::QpnOverflow(q) => write!(f, "QP number {q:#x} does not fit in 24 bits"),
            IdError::ZeroCnId => f.write_str("CN id 0 is reserved for \"no owner\""),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rkey_parts_and_wrap() {
        let r = Rkey::new(0x12_3456, 0xFE).unwrap();
        assert_eq!(r.0, 0x1234_56FE);
        assert_eq!(r.index(), 0x12_3456);
        assert_eq!(r.next_key().key(), 0xFF);
        // wraps inside the byte, index unchanged
        let w = r.next_key().next_key();
        assert_eq!(w.key(), 0);
        assert_eq!(w.index(), 0x12_3456);
        assert_eq!(Rkey(0xFFFF_FFFF).next_key(), Rkey(0xFFFF_FF00));
        assert_eq!(Rkey::new(0x100_0000, 0), Err(IdError::RkeyIndexOverflow(0x100_0000)));
        // 256 increments return to the start and visit every key once
        let mut seen = [false; 256];
        let mut k = Rkey::new(7, 0).unwrap();
        for _ in 0..256 {
            assert!(!seen[k.key() as usize]);
            seen[k.key() as usize] = true;
            k = k.next_key();
        }
        assert_eq!(k, Rkey::new(7, 0).unwrap());
    }

    #[test]
    fn qpn_checked() {
        assert_eq!(Qpn::new(0xFF_FFFF).unwrap().get(), 0xFF_FFFF);
        assert_eq!(Qpn::new(0x100_0000), Err(IdError::QpnOverflow(0x100_0000)));
    }

    #[test]
    fn cn_zero_reserved() {
        assert_eq!(CnId::new(0), Err(IdError::ZeroCnId));
        assert_eq!(CnId::new(3).unwrap().get(), 3);
    }
}
