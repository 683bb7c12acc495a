//! omw-fpga: the omw backend for an open FPGA RoCE engine — Coyote v2 / BALBOA — and the
//! **omw extension block** a modified bitstream would add, with a register-level test double
//! that models both.
//!
//! * [`mmio`]: the register abstraction ([`mmio::Mmio`]) and the write-ordering rule
//!   (`CTRL_REG` last); [`device::DevMmio`] maps a region of a real device file,
//!   [`double::SimMmio`] is the test double.
//! * [`driver`]: the Coyote driver's `ioctl`s the shim needs (shell configuration, ctids, IP).
//! * [`encoding`] and [`regs`]: the stock engine's words and registers, as data.
//! * [`ext`]: the extension block's register map (in the vFPGA's user CSR region), completion
//!   format, capability bits and opcode encoding.
//! * [`backend::FpgaBackend`]: [`omw_core::device::RdmaBackend`] on top — a thin translation
//!   of the core's canonical WQEs into engine commands (stock) or ring entries (extension).
//! * [`secure`]: whether the memory node may run the secure protocol on a device.
//!
//! docs/FPGA.md documents both register maps.
#![warn(missing_debug_implementations)]

pub mod backend;
pub mod device;
pub mod double;
pub mod driver;
pub mod encoding;
pub mod ext;
pub mod memory;
pub mod mmio;
pub mod regs;
pub mod secure;

pub use backend::{Domain, Error, FpgaBackend, FpgaConfig, QpConnect, QpSetup};
pub use secure::{secure_protocol_mode, SecureProtocolError};
