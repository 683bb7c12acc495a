//! A set of group ids as a bitmap over a window of the pool, for the two scans that must tell
//! a group seen twice: the free count ([`crate::mn::scan_free`]: duplicates in the queue) and
//! the invariant check (a group in the queue twice, or queued and owned).
//!
//! Why a window and not the whole pool: the core has no heap, so the bitmap lives on the
//! stack, and a bitmap of the whole pool would be 1 MiB at the core's bound of
//! [`MAX_CHUNKS`](crate::geometry::MAX_CHUNKS) = 2^23 groups — more than a firmware or a
//! test thread's stack. A window of 2^20 groups is 128 KiB (what these scans always took);
//! a pool of up to 2^20 chunks is one pass, as before, and a larger one
//! ⌈chunks / 2^20⌉ passes (at most 8), each re-reading the live queue's 8-byte slots and the
//! tickets. The free count runs when the queue stops being empty (it is short then) and in
//! harnesses; the invariant check reads the whole MWTable (56 bytes a group) once whatever the
//! window.

use crate::ids::GroupId;

/// 64-bit words of the scans' window: 2^20 groups, 128 KiB.
pub(crate) const WINDOW_WORDS: usize = 1 << 14;

/// What [`GroupWindow::mark`] found.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Mark {
    /// The group is outside this window: another pass counts it.
    Outside,
    /// The first time this window sees it.
    First,
    /// Seen before in this window.
    Again,
}

/// Groups `lo .. lo + 64 × WORDS`, each a bit.
pub(crate) struct GroupWindow<const WORDS: usize> {
    lo: u32,
    bits: [u64; WORDS],
}

impl<const WORDS: usize> GroupWindow<WORDS> {
    /// Groups one window covers.
    pub(crate) const GROUPS: u32 = (WORDS * 64) as u32;

    pub(crate) fn new() -> Self {
        Self { lo: 0, bits: [0; WORDS] }
    }

    /// Windows' first groups, in order, that together cover groups `0 .. n`.
    pub(crate) fn starts(n: u32) -> impl Iterator<Item = u32> {
        (0..n.div_ceil(Self::GROUPS)).map(|i| i * Self::GROUPS)
    }

    /// Empty the set and move it to cover `lo ..`.
    pub(crate) fn reset(&mut self, lo: u32) {
        self.lo = lo;
        self.bits.fill(0);
    }

    /// The window's groups: `lo .. min(lo + GROUPS, n)`.
    pub(crate) fn range(&self, n: u32) -> core::ops::Range<u32> {
        self.lo..self.lo.saturating_add(Self::GROUPS).min(n)
    }

    fn bit(&self, g: GroupId) -> Option<(usize, u64)> {
        let off = g.0.checked_sub(self.lo).filter(|o| *o < Self::GROUPS)?;
        Some((off as usize / 64, 1 << (off % 64)))
    }

    /// Add `g`; what it was before.
    pub(crate) fn mark(&mut self, g: GroupId) -> Mark {
        let Some((w, b)) = self.bit(g) else { return Mark::Outside };
        let seen = self.bits[w] & b != 0;
        self.bits[w] |= b;
        if seen {
            Mark::Again
        } else {
            Mark::First
        }
    }

    /// Whether `g` was marked (false outside the window).
    pub(crate) fn contains(&self, g: GroupId) -> bool {
        self.bit(g).is_some_and(|(w, b)| self.bits[w] & b != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_the_pool_once_and_mark_only_their_own_groups() {
        type W = GroupWindow<1>;
        assert_eq!(W::starts(0).count(), 0);
        assert_eq!(W::starts(64).collect::<heapless::Vec<u32, 4>>().as_slice(), &[0]);
        assert_eq!(W::starts(130).collect::<heapless::Vec<u32, 4>>().as_slice(), &[0, 64, 128]);
        let mut w = W::new();
        w.reset(64);
        assert_eq!(w.range(130), 64..128);
        assert_eq!(w.mark(GroupId(63)), Mark::Outside);
        assert_eq!(w.mark(GroupId(128)), Mark::Outside);
        assert_eq!(w.mark(GroupId(64)), Mark::First);
        assert_eq!(w.mark(GroupId(127)), Mark::First);
        assert_eq!(w.mark(GroupId(64)), Mark::Again);
        assert!(w.contains(GroupId(127)) && !w.contains(GroupId(100)) && !w.contains(GroupId(0)));
        w.reset(128);
        assert_eq!(w.range(130), 128..130);
        assert!(!w.contains(GroupId(128)));
        assert_eq!(w.mark(GroupId(u32::MAX)), Mark::Outside);
    }

    #[test]
    fn the_scans_window_is_the_old_whole_pool_bitmap() {
        assert_eq!(GroupWindow::<WINDOW_WORDS>::GROUPS, 1 << 20);
        assert_eq!(core::mem::size_of::<GroupWindow<WINDOW_WORDS>>(), (128 << 10) + 8);
    }
}
