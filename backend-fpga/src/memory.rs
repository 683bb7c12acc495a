//! Engine-visible host memory: where the backend's own tables, scratch areas, WQE rings and
//! completion rings live. The engine reaches it by DMA at engine virtual addresses; the
//! host reaches it through this trait.

use core::fmt;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum MemError {
    /// `[addr, addr + len)` is not inside memory the engine can reach.
    Unmapped { addr: u64, len: u64 },
}

impl fmt::Display for MemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemError::Unmapped { addr, len } => {
                write!(f, "{len} bytes at {addr:#x} are not in engine-visible memory")
            }
        }
    }
}

pub trait HostMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemError>;
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemError>;
}

/// Real host memory the process owns and has handed to the engine (pinned and entered in the
/// vFPGA's TLB by the Coyote driver, `IOCTL_MAP_USER_MEM`, which is outside this crate).
/// Addresses are the buffers' virtual addresses, as the engine sees them.
#[derive(Debug, Default)]
pub struct ProcessMemory {
    buffers: std::vec::Vec<std::boxed::Box<[u8]>>,
}

impl ProcessMemory {
    pub fn new() -> Self {
        Self::default()
    }
    /// Allocate a zeroed buffer and return its (engine virtual) address.
    pub fn alloc(&mut self, len: usize) -> u64 {
        let b = std::vec![0u8; len].into_boxed_slice();
        let addr = b.as_ptr() as u64;
        self.buffers.push(b);
        addr
    }
    fn find(&self, addr: u64, len: usize) -> Option<(usize, usize)> {
        self.buffers.iter().enumerate().find_map(|(i, b)| {
            let base = b.as_ptr() as u64;
            let off = addr.checked_sub(base)?;
            (off.checked_add(len as u64)? <= b.len() as u64).then_some((i, off as usize))
        })
    }
}

impl HostMemory for ProcessMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemError> {
        let (i, off) = self.find(addr, buf.len()).ok_or(MemError::Unmapped { addr, len: buf.len() as u64 })?;
        buf.copy_from_slice(&self.buffers[i][off..off + buf.len()]);
        Ok(())
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        let (i, off) = self.find(addr, data.len()).ok_or(MemError::Unmapped { addr, len: data.len() as u64 })?;
        self.buffers[i][off..off + data.len()].copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_memory_bounds() {
        let mut m = ProcessMemory::new();
        let a = m.alloc(64);
        m.write(a + 60, &[1, 2, 3, 4]).unwrap();
        let mut b = [0u8; 4];
        m.read(a + 60, &mut b).unwrap();
        assert_eq!(b, [1, 2, 3, 4]);
        assert!(m.write(a + 61, &[0; 4]).is_err());
        assert!(m.read(a.wrapping_sub(1), &mut b).is_err());
    }
}
