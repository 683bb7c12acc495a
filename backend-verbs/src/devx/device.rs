//! What a DEVX MN backend needs from its device besides the DEVX calls of [`DevxApi`]: two
//! protection domains, memory registrations in them (the windows are DEVX objects:
//! `DevxBackend::alloc_mw`), memory the NIC can
//! reach, and the port's path to itself (for the MN's loopback QP pairs).
//!
//! The real implementation is `ffi::RealDevx` (feature `devx`): the device opened, and its PDs,
//! MRs and windows made, by `crate::device` on the DEVX-enabled context; page-aligned process
//! memory. The recording
//! mock (`mock.rs`) keeps memory as bytes so the backend's tests can read the rings it wrote
//! and plant the CQEs a device would write.

use super::api::{DevxApi, MemRange};
use super::cm::{CmQpAttr, LocalPath};
use super::DevxError;
use omw_core::access::AccessFlags;
use omw_core::device::{Domain, MrKeys};

pub trait DevxDevice: DevxApi {
    /// The PD number of `domain`'s protection domain ([`DevxApi::pdn`] is the CN-facing one).
    fn domain_pdn(&self, domain: Domain) -> u32;
    /// `ibv_reg_mr` in `domain`'s PD; `access` bits are `IBV_ACCESS_*`.
    fn reg_mr(&mut self, domain: Domain, mem: MemRange, access: AccessFlags) -> Result<MrKeys, DevxError>;
    /// `ibv_alloc_mw(IBV_MW_TYPE_2)` in the CN-facing PD; its initial rkey. Only the
    /// bring-up's `foreign_bind` step uses it: `DevxBackend`'s windows are DEVX mkeys
    /// (`omw_core::mlx5::prm::mkey`), since DEVX cannot query a verbs MW.
    fn alloc_mw(&mut self) -> Result<u32, DevxError>;
    /// `len` zeroed bytes aligned to `align` (a power of two, at least 4096 for umems), owned
    /// by the device object until it is dropped.
    fn alloc_mem(&mut self, len: usize, align: usize) -> Result<MemRange, DevxError>;
    /// Copy bytes out of memory from [`DevxDevice::alloc_mem`] (the NIC may be writing it:
    /// volatile reads, then a barrier). Outside that memory: [`DevxError::OutsideMemory`].
    fn read_mem(&self, addr: usize, out: &mut [u8]) -> Result<(), DevxError>;
    /// Store bytes into memory from [`DevxDevice::alloc_mem`].
    fn store(&mut self, addr: usize, bytes: &[u8]) -> Result<(), DevxError>;
    /// The path a loopback pair's QPs connect over: the port and GID the device was opened
    /// on (`crate::device::DeviceChoice`).
    fn local_path(&mut self) -> Result<LocalPath, DevxError>;
    /// The MAC of the next hop towards the peer `attr` addresses (RoCE: the kernel resolves it
    /// for an address handle; `ibv_qp_attr` does not carry it).
    fn next_hop_mac(&mut self, attr: &CmQpAttr) -> Result<[u8; 6], DevxError>;
    /// Let the device act on what was posted for `d` (the bring-up steps wait between posting
    /// and looking): a real device is given the time, a device model runs what is runnable.
    fn settle(&mut self, d: std::time::Duration);
}
