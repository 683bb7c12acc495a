//! The MMIO abstraction: 64-bit config registers, read and written by word index.
//!
//! In the style of open-rdma's `DeviceAdaptor`: the backend only ever talks to the engine
//! through [`Mmio`], so the same code drives the real device ([`crate::device::DevMmio`]) and
//! the register-level test double ([`crate::double::SimMmio`]).

use crate::encoding::Command;
use crate::regs;
use core::fmt;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[non_exhaustive]
pub enum MmioError {
    /// The register index lies outside the mapped region.
    OutOfRange { reg: usize, words: usize },
}

impl fmt::Display for MmioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MmioError::OutOfRange { reg, words } => {
                write!(f, "register {reg} is outside the mapped region of {words} 64-bit registers")
            }
        }
    }
}

/// A window of 64-bit device registers. Both accesses take `&self`: device registers are
/// shared, interior-mutable state (as in open-rdma's `DeviceAdaptor`), and a query that needs
/// a register write (the extension block's QUERY_MW) can then run from `&self` methods.
pub trait Mmio {
    fn read_csr(&self, reg: usize) -> Result<u64, MmioError>;
    fn write_csr(&self, reg: usize, value: u64) -> Result<(), MmioError>;
}

impl<M: Mmio + ?Sized> Mmio for &M {
    fn read_csr(&self, reg: usize) -> Result<u64, MmioError> {
        (**self).read_csr(reg)
    }
    fn write_csr(&self, reg: usize, value: u64) -> Result<(), MmioError> {
        (**self).write_csr(reg, value)
    }
}

/// Push one command, in the engine's order: `VADDR_WR`, `CTRL_REG_2`, `VADDR_RD`, then
/// `CTRL_REG` **last** — the `CTRL_REG` write is what the engine latches the other three on.
pub fn post_command<M: Mmio + ?Sized>(m: &M, c: &Command) -> Result<(), MmioError> {
    m.write_csr(regs::VADDR_WR_REG, c.vaddr_wr)?;
    m.write_csr(regs::CTRL_REG_2, c.ctrl_dst)?;
    m.write_csr(regs::VADDR_RD_REG, c.vaddr_rd)?;
    // the real mapping is uncached (O_SYNC); the fence keeps the compiler and CPU from
    // reordering the trigger ahead of the operands
    core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
    m.write_csr(regs::CTRL_REG, c.ctrl_src)
}

/// Write a 3-word context block (`RDMA_CTX_REG_0..2` or `RDMA_CONN_REG_0..2`) in order; the
/// last word commits it.
pub fn write_block<M: Mmio + ?Sized>(m: &M, first: usize, words: [u64; 3]) -> Result<(), MmioError> {
    for (i, w) in words.into_iter().enumerate() {
        if i == 2 {
            core::sync::atomic::fence(core::sync::atomic::Ordering::SeqCst);
        }
        m.write_csr(first + i, w)?;
    }
    Ok(())
}

/// Commands in the engine's FIFO (`CTRL_REG` read).
pub fn commands_in_flight<M: Mmio + ?Sized>(m: &M) -> Result<u64, MmioError> {
    m.read_csr(regs::CTRL_REG)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    struct Recorder(std::cell::RefCell<Vec<(usize, u64)>>);
    impl Mmio for Recorder {
        fn read_csr(&self, _reg: usize) -> Result<u64, MmioError> {
            Ok(0)
        }
        fn write_csr(&self, reg: usize, value: u64) -> Result<(), MmioError> {
            self.0.borrow_mut().push((reg, value));
            Ok(())
        }
    }

    #[test]
    fn ctrl_reg_is_written_last() {
        let r = Recorder(Default::default());
        let c = Command { vaddr_wr: 1, ctrl_dst: 2, vaddr_rd: 3, ctrl_src: 4 };
        post_command(&r, &c).unwrap();
        assert_eq!(
            *r.0.borrow(),
            [(regs::VADDR_WR_REG, 1), (regs::CTRL_REG_2, 2), (regs::VADDR_RD_REG, 3), (regs::CTRL_REG, 4)]
        );
    }
}
