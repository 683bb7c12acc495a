//! Pool geometry: how the MN's exported memory is cut into chunks and MW groups.
//!
//! Every later computation (chunk address of a group, MWTable entry of an address, queue size)
//! goes through here, so the checks live here once: power-of-two chunk sizes keep address →
//! chunk a shift, and the bounds keep every chunk inside the registered region.

use crate::ids::GroupId;
use core::fmt;

/// Largest MW group size G this build supports. The MWTable entry reserves room for this many
/// rkeys, so it is a compile-time constant, not a const generic, to keep the entry a fixed layout.
pub const MAX_GROUP_SIZE: usize = 4;
/// Smallest group: MW\[0\] for the Free QP plus at least one access window.
pub const MIN_GROUP_SIZE: usize = 2;
pub const MIN_CHUNK_SIZE: u64 = 512;
pub const MAX_CHUNK_SIZE: u64 = 1 << 30;
/// Most chunks a pool can have: the 24-bit key index of an rkey (IBTA; mlx5's mkey index, rxe's
/// pool index) bounds a device's windows to 2^24, and a group has at least
/// [`MIN_GROUP_SIZE`] = 2 of them, so no device can hold more than 2^23 groups — and none quite
/// that many, since the MN's registrations draw from the same keys on mlx5 (`mn::capacity`
/// says by how much a given device falls short). The free queue's counters wrap with a masked
/// fetch-and-add at the ring's size (2^24 slots of 8 bytes here), and the scans that tell a
/// group seen twice go in windows of 2^20 groups (`mn/group_window.rs`), so nothing in the
/// core grows with this bound on the stack.
pub const MAX_CHUNKS: u32 = 1 << 23;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PoolGeometry {
    base: u64,
    chunk_size: u64,
    chunk_count: u32,
    group_size: u8,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum GeometryError {
    ChunkSizeNotPowerOfTwo(u64),
    ChunkSizeOutOfRange(u64),
    NoChunks,
    TooManyChunks(u32),
    GroupSizeOutOfRange(u8),
    BaseNotAligned { base: u64, chunk_size: u64 },
    RegionOverflows,
}

impl fmt::Display for GeometryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ChunkSizeNotPowerOfTwo(s) => write!(f, "chunk size {s} is not a power of two"),
            Self::ChunkSizeOutOfRange(s) => {
                write!(f, "chunk size {s} outside {MIN_CHUNK_SIZE}..={MAX_CHUNK_SIZE} bytes")
            }
            Self::NoChunks => f.write_str("pool has no chunks"),
            Self::TooManyChunks(n) => write!(f, "{n} chunks exceeds the maximum of {MAX_CHUNKS}"),
            Self::GroupSizeOutOfRange(g) => write!(f, "MW group size {g} outside {MIN_GROUP_SIZE}..={MAX_GROUP_SIZE}"),
            Self::BaseNotAligned { base, chunk_size } => {
                write!(f, "pool base {base:#x} is not aligned to the chunk size {chunk_size}")
            }
            Self::RegionOverflows => f.write_str("pool region wraps past the end of the address space"),
        }
    }
}

impl PoolGeometry {
    pub const fn new(base: u64, chunk_size: u64, chunk_count: u32, group_size: u8) -> Result<Self, GeometryError> {
        if !chunk_size.is_power_of_two() {
            return Err(GeometryError::ChunkSizeNotPowerOfTwo(chunk_size));
        }
        if chunk_size < MIN_CHUNK_SIZE || chunk_size > MAX_CHUNK_SIZE {
            return Err(GeometryError::ChunkSizeOutOfRange(chunk_size));
        }
        if chunk_count == 0 {
            return Err(GeometryError::NoChunks);
        }
        if chunk_count > MAX_CHUNKS {
            return Err(GeometryError::TooManyChunks(chunk_count));
        }
        if (group_size as usize) < MIN_GROUP_SIZE || (group_size as usize) > MAX_GROUP_SIZE {
            return Err(GeometryError::GroupSizeOutOfRange(group_size));
        }
        if !base.is_multiple_of(chunk_size) {
            return Err(GeometryError::BaseNotAligned { base, chunk_size });
        }
        let len = chunk_size * chunk_count as u64; // ≤ 2^30 * 2^20, cannot overflow u64
        if base.checked_add(len).is_none() {
            return Err(GeometryError::RegionOverflows);
        }
        Ok(PoolGeometry { base, chunk_size, chunk_count, group_size })
    }

    pub const fn base(&self) -> u64 {
        self.base
    }
    pub const fn chunk_size(&self) -> u64 {
        self.chunk_size
    }
    pub const fn chunk_count(&self) -> u32 {
        self.chunk_count
    }
    pub const fn group_size(&self) -> usize {
        self.group_size as usize
    }
    /// Access windows per group (G − 1: MW\[0\] belongs to the Free QP).
    pub const fn access_windows(&self) -> usize {
        self.group_size as usize - 1
    }
    pub const fn pool_len(&self) -> u64 {
        self.chunk_size * self.chunk_count as u64
    }
    pub const fn end(&self) -> u64 {
        self.base + self.pool_len()
    }
    pub const fn chunk_shift(&self) -> u32 {
        self.chunk_size.trailing_zeros()
    }

    pub fn chunk_base(&self, g: GroupId) -> Option<u64> {
        (g.0 < self.chunk_count).then(|| self.base + ((g.0 as u64) << self.chunk_shift()))
    }
    /// The group whose chunk contains `addr`, if any.
    pub fn group_of(&self, addr: u64) -> Option<GroupId> {
        if addr < self.base || addr >= self.end() {
            return None;
        }
        Some(GroupId(((addr - self.base) >> self.chunk_shift()) as u32))
    }
    /// Whether `[addr, addr+len)` lies inside one chunk (what a window can cover).
    pub fn range_in_chunk(&self, g: GroupId, addr: u64, len: u64) -> bool {
        match self.chunk_base(g) {
            Some(b) => addr >= b && len <= self.chunk_size && addr - b <= self.chunk_size - len,
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_geometry_math() {
        let g = PoolGeometry::new(0x10_0000, 4096, 16, 3).unwrap();
        assert_eq!(g.pool_len(), 65536);
        assert_eq!(g.chunk_base(GroupId(2)), Some(0x10_2000));
        assert_eq!(g.chunk_base(GroupId(16)), None);
        assert_eq!(g.group_of(0x10_2fff), Some(GroupId(2)));
        assert_eq!(g.group_of(0x10_0000 + 65536), None);
        assert_eq!(g.group_of(0xf_ffff), None);
        assert!(g.range_in_chunk(GroupId(1), 0x10_1000, 4096));
        assert!(!g.range_in_chunk(GroupId(1), 0x10_1001, 4096));
        assert!(!g.range_in_chunk(GroupId(1), 0x10_0fff, 2));
        assert_eq!(g.access_windows(), 2);
    }

    #[test]
    fn every_invalid_combination_rejected() {
        use GeometryError::*;
        assert_eq!(PoolGeometry::new(0, 3000, 1, 2), Err(ChunkSizeNotPowerOfTwo(3000)));
        assert_eq!(PoolGeometry::new(0, 256, 1, 2), Err(ChunkSizeOutOfRange(256)));
        assert_eq!(PoolGeometry::new(0, 1 << 31, 1, 2), Err(ChunkSizeOutOfRange(1 << 31)));
        assert_eq!(PoolGeometry::new(0, 0, 1, 2), Err(ChunkSizeNotPowerOfTwo(0)));
        assert_eq!(PoolGeometry::new(0, 512, 0, 2), Err(NoChunks));
        assert_eq!(PoolGeometry::new(0, 512, MAX_CHUNKS + 1, 2), Err(TooManyChunks(MAX_CHUNKS + 1)));
        assert_eq!(PoolGeometry::new(0, 512, 1, 1), Err(GroupSizeOutOfRange(1)));
        assert_eq!(PoolGeometry::new(0, 512, 1, 5), Err(GroupSizeOutOfRange(5)));
        assert_eq!(PoolGeometry::new(100, 512, 1, 2), Err(BaseNotAligned { base: 100, chunk_size: 512 }));
        assert_eq!(PoolGeometry::new(u64::MAX - 511, 512, 2, 2), Err(RegionOverflows));
        assert!(PoolGeometry::new(1 << 30, 1 << 30, 4, 4).is_ok());
    }
}
