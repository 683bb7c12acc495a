//! The DEVX calls the command sequences use, as a trait: the real implementation
//! (`ffi::RealDevx`, feature `devx`) calls libmlx5; the tests' mock records them.
//!
//! Handles are plain values so a recording can be compared. Memory a umem covers is named by
//! address and length; whoever implements the trait owns it.

use super::DevxError;

/// A DEVX object (CQ, QP) — the `mlx5dv_devx_obj *` of the real implementation.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct ObjHandle(pub usize);

/// A registered umem: the implementation's slot and the `umem_id` PRM commands name.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct UmemHandle {
    pub slot: usize,
    pub umem_id: u32,
}

/// A UAR page: the implementation's slot and the `page_id` PRM commands name.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct UarHandle {
    pub slot: usize,
    pub page_id: u32,
}

/// A range of process memory (page-aligned for umems).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct MemRange {
    pub addr: usize,
    pub len: usize,
}

/// `IBV_ACCESS_LOCAL_WRITE`: the NIC writes CQEs and doorbell records into the umem.
pub const UMEM_ACCESS_LOCAL_WRITE: u32 = 1;

pub trait DevxApi {
    /// The PD number of the protection domain objects are created in.
    fn pdn(&self) -> u32;
    /// `mlx5dv_devx_general_cmd` (QUERY_HCA_CAP). `command` names it in errors.
    fn general_cmd(&mut self, command: &'static str, input: &[u8], out: &mut [u8]) -> Result<(), DevxError>;
    /// `mlx5dv_devx_obj_create` (CREATE_CQ, CREATE_QP).
    fn obj_create(&mut self, command: &'static str, input: &[u8], out: &mut [u8]) -> Result<ObjHandle, DevxError>;
    /// `mlx5dv_devx_obj_modify` (the QP transitions).
    fn obj_modify(
        &mut self,
        command: &'static str,
        obj: ObjHandle,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(), DevxError>;
    /// `mlx5dv_devx_obj_query` (QUERY_QP: the state the device holds a QP in).
    fn obj_query(
        &mut self,
        command: &'static str,
        obj: ObjHandle,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(), DevxError>;
    /// `mlx5dv_devx_obj_destroy`.
    fn obj_destroy(&mut self, obj: ObjHandle) -> Result<(), DevxError>;
    /// `mlx5dv_devx_umem_reg`.
    fn umem_reg(&mut self, mem: MemRange, access: u32) -> Result<UmemHandle, DevxError>;
    /// `mlx5dv_devx_umem_dereg`.
    fn umem_dereg(&mut self, umem: UmemHandle) -> Result<(), DevxError>;
    /// `mlx5dv_devx_alloc_uar`.
    fn alloc_uar(&mut self) -> Result<UarHandle, DevxError>;
    /// `mlx5dv_devx_query_eqn`: the EQ a CQ reports to.
    fn query_eqn(&mut self, vector: u32) -> Result<u32, DevxError>;
    /// Store `bytes` at `addr`, inside a registered umem (send-ring WQEBBs, receive WQEs): plain
    /// stores, made visible to the device by the barrier [`DevxApi::write_dbr`] issues before
    /// the doorbell record (rdma-core's `udma_to_device_barrier`). A range outside every umem
    /// this context registered is refused ([`DevxError::OutsideUmem`]).
    fn write_mem(&mut self, addr: usize, bytes: &[u8]) -> Result<(), DevxError>;
    /// Store a big-endian 32-bit doorbell-record word at `addr` (inside a umem), ordered after
    /// every earlier store to WQE memory.
    fn write_dbr(&mut self, addr: usize, value_be: [u8; 4]);
    /// Write 8 bytes to the UAR's doorbell register, ordered after the doorbell record.
    fn write_uar(&mut self, uar: UarHandle, value: [u8; 8]);
}
