//! A host's byte-addressable memory: one contiguous arena with a bump allocator.
//!
//! Addresses are *model* addresses: non-zero, starting at the host's base (host *n* starts at
//! `0x1000_0000 + n × 0x10_0000_0000`, so an address of one host is never valid on another,
//! which catches mixed-up addresses in tests). Everything between the base and the break is
//! allocated (alignment padding included); anything else is not, and a host access to it is an
//! error. NIC accesses never reach this check: they go through MRs, and MRs can only be
//! registered over allocated memory.

/// Base address of host `index`'s memory.
pub const fn host_base(index: u32) -> u64 {
    0x1000_0000 + index as u64 * 0x10_0000_0000
}

#[derive(Debug)]
pub(crate) struct Memory {
    base: u64,
    bytes: Vec<u8>,
    limit: u64,
}

impl Memory {
    pub fn new(base: u64, limit: u64) -> Self {
        Memory { base, bytes: Vec::new(), limit }
    }

    /// Bytes allocated so far.
    pub fn used(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// Bump-allocate `len` zeroed bytes aligned to `align` (a power of two). `None` when the
    /// host's limit would be exceeded.
    pub fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        let brk = self.base + self.bytes.len() as u64;
        let start = brk.checked_add(align - 1)? & !(align - 1);
        let end = start.checked_add(len)?;
        if end - self.base > self.limit {
            return None;
        }
        self.bytes.resize((end - self.base) as usize, 0);
        Some(start)
    }

    /// Offset range of `[addr, addr + len)` if it is entirely allocated.
    #[inline]
    pub fn range(&self, addr: u64, len: u64) -> Option<core::ops::Range<usize>> {
        let off = addr.checked_sub(self.base)?;
        let end = off.checked_add(len)?;
        if end > self.bytes.len() as u64 {
            return None;
        }
        Some(off as usize..end as usize)
    }

    #[inline]
    pub fn slice(&self, addr: u64, len: u64) -> Option<&[u8]> {
        let r = self.range(addr, len)?;
        Some(&self.bytes[r])
    }

    #[inline]
    pub fn slice_mut(&mut self, addr: u64, len: u64) -> Option<&mut [u8]> {
        let r = self.range(addr, len)?;
        Some(&mut self.bytes[r])
    }

    pub fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        match self.slice(addr, buf.len() as u64) {
            Some(s) => {
                buf.copy_from_slice(s);
                true
            }
            None => false,
        }
    }

    pub fn write(&mut self, addr: u64, data: &[u8]) -> bool {
        match self.slice_mut(addr, data.len() as u64) {
            Some(s) => {
                s.copy_from_slice(data);
                true
            }
            None => false,
        }
    }

    #[inline]
    pub fn read_u64(&self, addr: u64) -> Option<u64> {
        let s = self.slice(addr, 8)?;
        let mut b = [0u8; 8];
        b.copy_from_slice(s);
        Some(u64::from_le_bytes(b))
    }

    #[inline]
    pub fn write_u64(&mut self, addr: u64, v: u64) -> bool {
        self.write(addr, &v.to_le_bytes())
    }

    /// Drop every byte (host crash): all later accesses fail.
    pub fn wipe(&mut self) {
        self.bytes = Vec::new();
        self.limit = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bump_allocation_and_bounds() {
        let mut m = Memory::new(host_base(0), 1 << 20);
        let a = m.alloc(10, 8).unwrap();
        assert_eq!(a, 0x1000_0000);
        let b = m.alloc(16, 64).unwrap();
        assert_eq!(b % 64, 0);
        assert!(b >= a + 10);
        assert!(m.write(b, &[1; 16]));
        assert!(!m.write(b + 1, &[1; 16]), "past the break");
        assert!(!m.write(0, &[1]), "address 0 is never allocated");
        assert!(m.alloc(1 << 21, 1).is_none());
        assert_eq!(m.read_u64(b), Some(0x0101_0101_0101_0101));
        m.wipe();
        assert!(m.read_u64(b).is_none());
    }
}
