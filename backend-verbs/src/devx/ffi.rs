//! The real DEVX calls (feature `devx`): libmlx5's `mlx5dv_*` functions, declared here because
//! rdma-sys binds only libibverbs and librdmacm. Signatures and struct layouts are those of
//! /usr/include/infiniband/mlx5dv.h (rdma-core 44.0); the test at the bottom compiles
//! core/tests/mlx5_golden.c and compares every struct size and offset declared here.
//!
//! Nothing here has run against a ConnectX (none was available): docs/MLX5.md.

use super::api::{DevxApi, MemRange, ObjHandle, UarHandle, UmemHandle};
use super::cm::{Accept, CmQpAttr, ExternalCm, LocalPath};
use super::device::DevxDevice;
use super::DevxError;
use crate::cm_event::{CmChannel, CmEvent, CmId};
use crate::device::{Context, DeviceChoice, ObjectError};
use crate::error::VerbsError;
use omw_core::access::AccessFlags;
use omw_core::device::{Domain, MrKeys};
use rdma_sys::*;
use std::ffi::{c_int, c_void};
use std::net::SocketAddr;
use std::ptr;
use std::sync::atomic::{fence, Ordering};
use std::time::Duration;

/// `MLX5DV_CONTEXT_FLAGS_DEVX` (mlx5dv.h:1682).
pub const MLX5DV_CONTEXT_FLAGS_DEVX: u32 = 1 << 0;
/// `MLX5DV_OBJ_AH`, `MLX5DV_OBJ_PD` (mlx5dv.h:966).
pub const MLX5DV_OBJ_AH: u64 = 1 << 5;
pub const MLX5DV_OBJ_PD: u64 = 1 << 6;
/// `MLX5DV_UAR_ALLOC_TYPE_NC` (mlx5_api.h → `MLX5_IB_UAPI_UAR_ALLOC_TYPE_NC = 0x1`):
/// a non-cached doorbell page, written with plain 8-byte stores.
pub const MLX5DV_UAR_ALLOC_TYPE_NC: u32 = 1;
/// `offsetof(struct mlx5_wqe_av, rmac)` (checked against the header in the test).
pub const AV_RMAC_OFFSET: usize = 20;

#[repr(C)]
#[derive(Debug)]
pub struct Mlx5dvContextAttr {
    pub flags: u32,
    pub comp_mask: u64,
}

#[repr(C)]
#[derive(Debug)]
pub struct Mlx5dvDevxUar {
    pub reg_addr: *mut c_void,
    pub base_addr: *mut c_void,
    pub page_id: u32,
    pub mmap_off: libc::off_t,
    pub comp_mask: u64,
}

#[repr(C)]
#[derive(Debug)]
pub struct Mlx5dvDevxUmem {
    pub umem_id: u32,
}

#[repr(C)]
#[derive(Debug)]
pub struct Mlx5dvPd {
    pub pdn: u32,
    pub comp_mask: u64,
}

#[repr(C)]
#[derive(Debug)]
pub struct Mlx5dvAh {
    pub av: *mut u8,
    pub comp_mask: u64,
}

#[repr(C)]
#[derive(Debug)]
pub struct InOut {
    pub input: *mut c_void,
    pub out: *mut c_void,
}

/// `struct mlx5dv_obj`: seven `{in, out}` pairs (qp, cq, srq, rwq, dm, ah, pd).
#[repr(C)]
#[derive(Debug)]
pub struct Mlx5dvObj {
    pub qp: InOut,
    pub cq: InOut,
    pub srq: InOut,
    pub rwq: InOut,
    pub dm: InOut,
    pub ah: InOut,
    pub pd: InOut,
}

/// Opaque `struct mlx5dv_devx_obj`.
#[repr(C)]
#[derive(Debug)]
pub struct Mlx5dvDevxObj {
    _p: [u8; 0],
}

#[link(name = "mlx5")]
extern "C" {
    fn mlx5dv_is_supported(device: *mut ibv_device) -> bool;
    fn mlx5dv_open_device(device: *mut ibv_device, attr: *mut Mlx5dvContextAttr) -> *mut ibv_context;
    fn mlx5dv_init_obj(obj: *mut Mlx5dvObj, obj_type: u64) -> c_int;
    fn mlx5dv_devx_general_cmd(
        ctx: *mut ibv_context,
        input: *const c_void,
        inlen: usize,
        out: *mut c_void,
        outlen: usize,
    ) -> c_int;
    fn mlx5dv_devx_obj_create(
        ctx: *mut ibv_context,
        input: *const c_void,
        inlen: usize,
        out: *mut c_void,
        outlen: usize,
    ) -> *mut Mlx5dvDevxObj;
    fn mlx5dv_devx_obj_modify(
        obj: *mut Mlx5dvDevxObj,
        input: *const c_void,
        inlen: usize,
        out: *mut c_void,
        outlen: usize,
    ) -> c_int;
    fn mlx5dv_devx_obj_query(
        obj: *mut Mlx5dvDevxObj,
        input: *const c_void,
        inlen: usize,
        out: *mut c_void,
        outlen: usize,
    ) -> c_int;
    fn mlx5dv_devx_obj_destroy(obj: *mut Mlx5dvDevxObj) -> c_int;
    fn mlx5dv_devx_umem_reg(ctx: *mut ibv_context, addr: *mut c_void, size: usize, access: u32) -> *mut Mlx5dvDevxUmem;
    fn mlx5dv_devx_umem_dereg(umem: *mut Mlx5dvDevxUmem) -> c_int;
    fn mlx5dv_devx_alloc_uar(ctx: *mut ibv_context, flags: u32) -> *mut Mlx5dvDevxUar;
    fn mlx5dv_devx_free_uar(uar: *mut Mlx5dvDevxUar);
    fn mlx5dv_devx_query_eqn(ctx: *mut ibv_context, vector: u32, eqn: *mut u32) -> c_int;
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn rc_errno(rc: c_int) -> i32 {
    if rc > 0 {
        rc
    } else {
        errno()
    }
}

/// Page-aligned, zeroed memory for rings and doorbell records; freed on drop.
#[derive(Debug)]
pub struct RingMemory {
    ptr: *mut u8,
    len: usize,
}

impl RingMemory {
    pub fn new(len: usize) -> Result<Self, DevxError> {
        let mut p: *mut c_void = ptr::null_mut();
        // SAFETY: posix_memalign writes a pointer to `len` bytes aligned to 4096 into `p` or
        // returns an error code and leaves it untouched; 4096 is a power of two and a multiple
        // of the pointer size.
        let rc = unsafe { libc::posix_memalign(&mut p, 4096, len.max(1)) };
        if rc != 0 {
            return Err(DevxError::Call { call: "posix_memalign", errno: rc });
        }
        // SAFETY: `p` points to at least `len` writable bytes just allocated above.
        unsafe { ptr::write_bytes(p as *mut u8, 0, len) };
        Ok(RingMemory { ptr: p as *mut u8, len })
    }
    pub fn range(&self) -> MemRange {
        MemRange { addr: self.ptr as usize, len: self.len }
    }
    /// The memory as bytes, for writing WQEs and initialising CQ rings. The device writes CQEs
    /// and doorbell records here too: read those with [`RingMemory::read_volatile`].
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `len` bytes owned by this value; `&mut self` makes the
        // borrow unique on the CPU side.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    /// Copy `out.len()` bytes at `offset` with volatile reads (the device may have written
    /// them), then fence so later reads see at least as new data (rdma-core's
    /// udma_from_device_barrier after reading a CQE's owner byte).
    pub fn read_volatile(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.len, "read outside the ring memory");
        for (i, b) in out.iter_mut().enumerate() {
            // SAFETY: in bounds (asserted above) of memory this value owns.
            *b = unsafe { ptr::read_volatile(self.ptr.add(offset + i)) };
        }
        fence(Ordering::SeqCst);
    }
}

impl Drop for RingMemory {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from posix_memalign and is freed exactly once; umems over it must
        // be deregistered first (the owner of both drops the DEVX objects before the memory).
        unsafe { libc::free(self.ptr as *mut c_void) };
    }
}

/// An open DEVX context with its two PDs (CN-facing, MN-private). The device, its port and
/// GID are chosen, and the context's PDs, MRs and windows made, by `crate::device` as for the
/// verbs backend; only the opening itself is DEVX's (`mlx5dv_open_device` with
/// `MLX5DV_CONTEXT_FLAGS_DEVX`).
#[derive(Debug)]
pub struct RealDevx {
    /// Closed on drop, after everything below (fields drop after `Drop::drop` ran).
    ctx: Context,
    pd: *mut ibv_pd,
    pdn: u32,
    objs: Vec<*mut Mlx5dvDevxObj>,
    umems: Vec<*mut Mlx5dvDevxUmem>,
    /// The memory each umem slot covers (`len` 0 once deregistered): `write_mem` stores only
    /// inside these.
    umem_ranges: Vec<MemRange>,
    uars: Vec<*mut Mlx5dvDevxUar>,
    /// The MN-private PD (`DevxDevice`: the chains' loop QPs and remote rights on MN memory).
    private_pd: *mut ibv_pd,
    private_pdn: u32,
    mrs: Vec<*mut ibv_mr>,
    mws: Vec<*mut ibv_mw>,
    /// Memory from `alloc_mem`: reads and stores are checked against these.
    regions: Vec<MemRange>,
}

/// One device opened for DEVX: refused unless libmlx5 drives it, then `mlx5dv_open_device`.
fn open_devx(name: &str) -> crate::error::Result<Context> {
    let opened = crate::device::with_devices(|l| {
        let Some((_, d)) = l.iter().find(|(n, _)| n == name) else {
            return Err(DevxError::NotMlx5 { device: format!("{name} (not found)") });
        };
        // SAFETY: `d` is a live entry of the list.
        if !unsafe { mlx5dv_is_supported(*d) } {
            return Err(DevxError::NotMlx5 { device: name.into() });
        }
        let mut attr = Mlx5dvContextAttr { flags: MLX5DV_CONTEXT_FLAGS_DEVX, comp_mask: 0 };
        // SAFETY: `d` is live until the list is freed; `attr` is a valid attribute struct; the
        // returned context (or null) is ours and outlives the list.
        let ctx = unsafe { mlx5dv_open_device(*d, &mut attr) };
        if ctx.is_null() {
            return Err(DevxError::Open { device: name.into(), errno: errno() });
        }
        Ok(ctx)
    })?;
    let ctx = opened.map_err(VerbsError::Devx)?;
    // SAFETY: a context just opened on `name`, handed over (nothing else closes it).
    unsafe { Context::adopt(ctx, name) }
}

impl RealDevx {
    /// Open the device `choice` names — without a name, the first mlx5 device with an ACTIVE
    /// port — with a DEVX context, on the port and GID `choice` leads to (chosen as for the
    /// verbs backend), and allocate its two PDs.
    pub fn open(choice: &DeviceChoice) -> crate::error::Result<Self> {
        if choice.device.is_none() {
            // DEVX exists only for mlx5_ib: say so rather than that no device could be opened
            let (names, mlx5) = crate::device::with_devices(|l| {
                // SAFETY: each entry is a live device of the list.
                let mlx5 = l.iter().filter(|(_, d)| unsafe { mlx5dv_is_supported(*d) }).count();
                (l.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(), mlx5)
            })?;
            if mlx5 == 0 && !names.is_empty() {
                return Err(VerbsError::Devx(DevxError::NoMlx5 { devices: names }));
            }
        }
        let ctx = Context::open_with(choice, open_devx)?;
        let pd = ctx.alloc_pd()?;
        let mut me = RealDevx {
            ctx,
            pd,
            pdn: 0,
            objs: Vec::new(),
            umems: Vec::new(),
            umem_ranges: Vec::new(),
            uars: Vec::new(),
            private_pd: ptr::null_mut(),
            private_pdn: 0,
            mrs: Vec::new(),
            mws: Vec::new(),
            regions: Vec::new(),
        };
        me.pdn = pdn_of(me.pd).map_err(VerbsError::Devx)?;
        me.private_pd = me.ctx.alloc_pd()?;
        me.private_pdn = pdn_of(me.private_pd).map_err(VerbsError::Devx)?;
        Ok(me)
    }

    fn pd_of(&self, domain: Domain) -> *mut ibv_pd {
        match domain {
            Domain::CnFacing => self.pd,
            Domain::MnPrivate => self.private_pd,
        }
    }

    fn inside(&self, addr: usize, len: usize) -> bool {
        self.regions.iter().any(|r| addr >= r.addr && addr.checked_add(len).is_some_and(|e| e <= r.addr + r.len))
    }

    pub fn device(&self) -> &str {
        &self.ctx.info.name
    }
    /// The device's firmware version (`ibv_device_attr.fw_ver`).
    pub fn firmware(&self) -> &str {
        &self.ctx.info.fw_ver
    }
    /// The DEVX-enabled verbs context (for address handles, `ibv_reg_mr`, …).
    pub fn context(&self) -> *mut ibv_context {
        self.ctx.ctx
    }
    /// The PD every DEVX QP of this context is created in.
    pub fn pd(&self) -> *mut ibv_pd {
        self.pd
    }

    /// The next hop's MAC for a RoCE path, from an address handle's mlx5 address vector (as
    /// UCX's `uct_ib_mlx5_get_av` does): the kernel resolves it when creating the AH.
    fn rmac(&mut self, ah_attr: &mut ibv_ah_attr) -> Result<[u8; 6], DevxError> {
        // SAFETY: `pd` is our live PD; `ah_attr` is a valid, fully initialised attribute struct.
        let ah = unsafe { ibv_create_ah(self.pd, ah_attr) };
        if ah.is_null() {
            return Err(DevxError::Call { call: "ibv_create_ah", errno: errno() });
        }
        let mut dv_ah = Mlx5dvAh { av: ptr::null_mut(), comp_mask: 0 };
        let mut obj = Mlx5dvObj::empty();
        obj.ah = InOut { input: ah as *mut c_void, out: &mut dv_ah as *mut Mlx5dvAh as *mut c_void };
        // SAFETY: `obj.ah` names the AH just created and a valid output struct.
        let rc = unsafe { mlx5dv_init_obj(&mut obj, MLX5DV_OBJ_AH) };
        let mut mac = [0u8; 6];
        if rc == 0 && !dv_ah.av.is_null() {
            // SAFETY: `av` points to the AH's `struct mlx5_wqe_av` (48 bytes, rmac at 20..26),
            // alive until the AH is destroyed below.
            unsafe { ptr::copy_nonoverlapping(dv_ah.av.add(AV_RMAC_OFFSET), mac.as_mut_ptr(), 6) };
        }
        // SAFETY: `ah` is ours and no longer used.
        unsafe { ibv_destroy_ah(ah) };
        if rc != 0 {
            return Err(DevxError::Call { call: "mlx5dv_init_obj(AH)", errno: rc_errno(rc) });
        }
        Ok(mac)
    }
}

impl Mlx5dvObj {
    fn empty() -> Self {
        let z = || InOut { input: ptr::null_mut(), out: ptr::null_mut() };
        Mlx5dvObj { qp: z(), cq: z(), srq: z(), rwq: z(), dm: z(), ah: z(), pd: z() }
    }
}

/// The PD number DEVX commands name (`mlx5dv_init_obj(MLX5DV_OBJ_PD)`).
fn pdn_of(pd: *mut ibv_pd) -> Result<u32, DevxError> {
    let mut dv_pd = Mlx5dvPd { pdn: 0, comp_mask: 0 };
    let mut obj = Mlx5dvObj::empty();
    obj.pd = InOut { input: pd as *mut c_void, out: &mut dv_pd as *mut Mlx5dvPd as *mut c_void };
    // SAFETY: `obj.pd` names a live PD of ours and a valid output struct; the other pairs are
    // null and not selected by the type mask.
    let rc = unsafe { mlx5dv_init_obj(&mut obj, MLX5DV_OBJ_PD) };
    if rc != 0 {
        return Err(DevxError::Call { call: "mlx5dv_init_obj(PD)", errno: rc_errno(rc) });
    }
    Ok(dv_pd.pdn)
}

impl DevxDevice for RealDevx {
    fn domain_pdn(&self, domain: Domain) -> u32 {
        match domain {
            Domain::CnFacing => self.pdn,
            // allocated in `open`
            Domain::MnPrivate => self.private_pdn,
        }
    }
    fn reg_mr(&mut self, domain: Domain, mem: MemRange, access: AccessFlags) -> Result<MrKeys, DevxError> {
        if !self.inside(mem.addr, mem.len) {
            return Err(DevxError::OutsideMemory { addr: mem.addr, len: mem.len });
        }
        // SAFETY: the domain's PD is live; the range lies in memory this value allocated and
        // keeps until drop, after every MR is deregistered.
        let mr = unsafe { crate::device::reg_mr(self.pd_of(domain), mem.addr as u64, mem.len as u64, access) }?;
        self.mrs.push(mr);
        // SAFETY: `mr` was just registered.
        Ok(unsafe { MrKeys { lkey: (*mr).lkey, rkey: (*mr).rkey } })
    }
    fn alloc_mw(&mut self) -> Result<u32, DevxError> {
        // SAFETY: `pd` is live.
        let mw = unsafe { crate::device::alloc_mw_type2(self.pd, &self.ctx.info.name) }?;
        self.mws.push(mw);
        // SAFETY: `mw` was just allocated.
        Ok(unsafe { (*mw).rkey })
    }
    fn alloc_mem(&mut self, len: usize, align: usize) -> Result<MemRange, DevxError> {
        let mut p: *mut c_void = ptr::null_mut();
        let align = align.max(4096).next_power_of_two();
        // SAFETY: posix_memalign writes a pointer to `len` bytes aligned to `align` (a power
        // of two and a multiple of the pointer size) into `p`, or returns an error code.
        let rc = unsafe { libc::posix_memalign(&mut p, align, len.max(1)) };
        if rc != 0 {
            return Err(DevxError::Call { call: "posix_memalign", errno: rc });
        }
        // SAFETY: `p` points to at least `len` writable bytes just allocated.
        unsafe { ptr::write_bytes(p as *mut u8, 0, len) };
        let r = MemRange { addr: p as usize, len };
        self.regions.push(r);
        Ok(r)
    }
    fn read_mem(&self, addr: usize, out: &mut [u8]) -> Result<(), DevxError> {
        if !self.inside(addr, out.len()) {
            return Err(DevxError::OutsideMemory { addr, len: out.len() });
        }
        for (i, b) in out.iter_mut().enumerate() {
            // SAFETY: in bounds (checked above) of memory this value owns; the device may be
            // writing it, hence volatile.
            *b = unsafe { ptr::read_volatile((addr + i) as *const u8) };
        }
        fence(Ordering::SeqCst);
        Ok(())
    }
    fn store(&mut self, addr: usize, bytes: &[u8]) -> Result<(), DevxError> {
        if !self.inside(addr, bytes.len()) {
            return Err(DevxError::OutsideMemory { addr, len: bytes.len() });
        }
        // SAFETY: in bounds of memory this value owns; `bytes` is a distinct Rust slice.
        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
        Ok(())
    }
    fn local_path(&mut self) -> Result<LocalPath, DevxError> {
        let (port, gid) = (self.ctx.port_attr, self.ctx.gid);
        let mtu = crate::port::path_mtu(&port, None).map_err(|_| DevxError::Call {
            call: "ibv_query_port (active MTU outside ibv_mtu)",
            errno: libc::EINVAL,
        })?;
        let to_self = CmQpAttr {
            ah_is_global: true,
            ah_port_num: port.port,
            dgid: gid.gid,
            sgid_index: gid.index,
            hop_limit: 64,
            ..CmQpAttr::default()
        };
        let mac = self.next_hop_mac(&to_self)?;
        Ok(LocalPath { port: port.port, gid_index: gid.index, gid: gid.gid, mac, mtu: mtu.raw() as u8 })
    }
    fn next_hop_mac(&mut self, a: &CmQpAttr) -> Result<[u8; 6], DevxError> {
        // SAFETY: ibv_ah_attr is plain C data; all-zero is valid.
        let mut ah: ibv_ah_attr = unsafe { std::mem::zeroed() };
        ah.is_global = u8::from(a.ah_is_global);
        ah.dlid = a.ah_dlid;
        ah.sl = a.ah_sl;
        ah.port_num = if a.ah_port_num != 0 { a.ah_port_num } else { a.port_num };
        ah.grh.dgid = ibv_gid { raw: a.dgid };
        ah.grh.flow_label = a.flow_label;
        ah.grh.sgid_index = a.sgid_index;
        ah.grh.hop_limit = a.hop_limit;
        ah.grh.traffic_class = a.traffic_class;
        self.rmac(&mut ah)
    }
    fn settle(&mut self, d: std::time::Duration) {
        std::thread::sleep(d);
    }
}

/// The DEVX device's verbs objects (PDs, MRs, windows) are made by `crate::device`.
impl From<ObjectError> for DevxError {
    fn from(e: ObjectError) -> Self {
        match e {
            ObjectError::Call { call, errno } => DevxError::Call { call, errno },
            ObjectError::MemlockTooLow(t) => DevxError::MemlockTooLow(t),
            ObjectError::NoMwType2 { .. } => {
                DevxError::Call { call: "ibv_alloc_mw (not provided)", errno: libc::EOPNOTSUPP }
            }
        }
    }
}

fn status_of(command: &'static str, input: &[u8], out: &[u8], errno: i32) -> DevxError {
    let opcode = u16::from_be_bytes([input[0], input[1]]);
    let status = out.first().copied().unwrap_or(0);
    let syndrome = out.get(4..8).map_or(0, |s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]));
    DevxError::Command { command, opcode, status, syndrome, errno }
}

impl DevxApi for RealDevx {
    fn pdn(&self) -> u32 {
        self.pdn
    }
    fn general_cmd(&mut self, command: &'static str, input: &[u8], out: &mut [u8]) -> Result<(), DevxError> {
        // SAFETY: `ctx` is open; `input`/`out` are valid for their lengths during the call.
        let rc = unsafe {
            mlx5dv_devx_general_cmd(
                self.ctx.ctx,
                input.as_ptr() as *const c_void,
                input.len(),
                out.as_mut_ptr() as *mut c_void,
                out.len(),
            )
        };
        if rc != 0 {
            return Err(status_of(command, input, out, rc_errno(rc)));
        }
        Ok(())
    }
    fn obj_create(&mut self, command: &'static str, input: &[u8], out: &mut [u8]) -> Result<ObjHandle, DevxError> {
        // SAFETY: as for general_cmd; the returned object (or null) is ours.
        let o = unsafe {
            mlx5dv_devx_obj_create(
                self.ctx.ctx,
                input.as_ptr() as *const c_void,
                input.len(),
                out.as_mut_ptr() as *mut c_void,
                out.len(),
            )
        };
        if o.is_null() {
            return Err(status_of(command, input, out, errno()));
        }
        self.objs.push(o);
        Ok(ObjHandle(self.objs.len() - 1))
    }
    fn obj_modify(
        &mut self,
        command: &'static str,
        obj: ObjHandle,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(), DevxError> {
        let o = self
            .objs
            .get(obj.0)
            .copied()
            .filter(|p| !p.is_null())
            .ok_or(DevxError::Call { call: "mlx5dv_devx_obj_modify (unknown object)", errno: libc::EINVAL })?;
        // SAFETY: `o` is a live object of this context; buffers valid for the call.
        let rc = unsafe {
            mlx5dv_devx_obj_modify(
                o,
                input.as_ptr() as *const c_void,
                input.len(),
                out.as_mut_ptr() as *mut c_void,
                out.len(),
            )
        };
        if rc != 0 {
            return Err(status_of(command, input, out, rc_errno(rc)));
        }
        Ok(())
    }
    fn obj_query(
        &mut self,
        command: &'static str,
        obj: ObjHandle,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(), DevxError> {
        let o = self
            .objs
            .get(obj.0)
            .copied()
            .filter(|p| !p.is_null())
            .ok_or(DevxError::Call { call: "mlx5dv_devx_obj_query (unknown object)", errno: libc::EINVAL })?;
        // SAFETY: `o` is a live object of this context; buffers valid for the call.
        let rc = unsafe {
            mlx5dv_devx_obj_query(
                o,
                input.as_ptr() as *const c_void,
                input.len(),
                out.as_mut_ptr() as *mut c_void,
                out.len(),
            )
        };
        if rc != 0 {
            return Err(status_of(command, input, out, rc_errno(rc)));
        }
        Ok(())
    }
    fn obj_destroy(&mut self, obj: ObjHandle) -> Result<(), DevxError> {
        let Some(slot) = self.objs.get_mut(obj.0) else { return Ok(()) };
        let o = std::mem::replace(slot, ptr::null_mut());
        if o.is_null() {
            return Ok(());
        }
        // SAFETY: `o` is live and destroyed exactly once (its slot is now null).
        let rc = unsafe { mlx5dv_devx_obj_destroy(o) };
        if rc != 0 {
            return Err(DevxError::Call { call: "mlx5dv_devx_obj_destroy", errno: rc_errno(rc) });
        }
        Ok(())
    }
    fn umem_reg(&mut self, mem: MemRange, access: u32) -> Result<UmemHandle, DevxError> {
        // SAFETY: `mem` is memory this process owns (a RingMemory) for as long as the umem is
        // registered; the kernel pins it.
        let u = unsafe { mlx5dv_devx_umem_reg(self.ctx.ctx, mem.addr as *mut c_void, mem.len, access) };
        if u.is_null() {
            return Err(DevxError::Call { call: "mlx5dv_devx_umem_reg", errno: errno() });
        }
        self.umems.push(u);
        self.umem_ranges.push(mem);
        // SAFETY: `u` points to the umem just registered.
        let umem_id = unsafe { (*u).umem_id };
        Ok(UmemHandle { slot: self.umems.len() - 1, umem_id })
    }
    fn umem_dereg(&mut self, umem: UmemHandle) -> Result<(), DevxError> {
        let Some(slot) = self.umems.get_mut(umem.slot) else { return Ok(()) };
        let u = std::mem::replace(slot, ptr::null_mut());
        if u.is_null() {
            return Ok(());
        }
        if let Some(r) = self.umem_ranges.get_mut(umem.slot) {
            r.len = 0;
        }
        // SAFETY: `u` is live and deregistered exactly once.
        let rc = unsafe { mlx5dv_devx_umem_dereg(u) };
        if rc != 0 {
            return Err(DevxError::Call { call: "mlx5dv_devx_umem_dereg", errno: rc_errno(rc) });
        }
        Ok(())
    }
    fn alloc_uar(&mut self) -> Result<UarHandle, DevxError> {
        // SAFETY: `ctx` is open; the UAR (or null) is ours.
        let u = unsafe { mlx5dv_devx_alloc_uar(self.ctx.ctx, MLX5DV_UAR_ALLOC_TYPE_NC) };
        if u.is_null() {
            return Err(DevxError::Call { call: "mlx5dv_devx_alloc_uar", errno: errno() });
        }
        self.uars.push(u);
        // SAFETY: `u` points to the UAR just allocated.
        let page_id = unsafe { (*u).page_id };
        Ok(UarHandle { slot: self.uars.len() - 1, page_id })
    }
    fn query_eqn(&mut self, vector: u32) -> Result<u32, DevxError> {
        let mut eqn = 0u32;
        // SAFETY: `ctx` is open; `eqn` is a valid output.
        let rc = unsafe { mlx5dv_devx_query_eqn(self.ctx.ctx, vector, &mut eqn) };
        if rc != 0 {
            return Err(DevxError::Call { call: "mlx5dv_devx_query_eqn", errno: rc_errno(rc) });
        }
        Ok(eqn)
    }
    fn write_mem(&mut self, addr: usize, bytes: &[u8]) -> Result<(), DevxError> {
        let inside = self
            .umem_ranges
            .iter()
            .any(|r| addr >= r.addr && addr.checked_add(bytes.len()).is_some_and(|end| end <= r.addr + r.len));
        if !inside {
            return Err(DevxError::OutsideUmem { addr, len: bytes.len() });
        }
        // SAFETY: `[addr, addr + len)` lies inside a umem this context registered and has not
        // deregistered: memory this process owns and keeps alive while it is registered
        // (umem_reg's contract); `bytes` is a distinct Rust slice, so they do not overlap.
        unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
        Ok(())
    }
    fn write_dbr(&mut self, addr: usize, value_be: [u8; 4]) {
        // WQE stores must be visible to the device before the doorbell record (rdma-core's
        // udma_to_device_barrier); a SeqCst fence is at least that strong.
        fence(Ordering::SeqCst);
        // SAFETY: `addr` is a 4-byte-aligned doorbell-record word inside a registered umem
        // this process owns (queue.rs places records at 64-byte-aligned offsets).
        unsafe { ptr::write_volatile(addr as *mut [u8; 4], value_be) };
    }
    fn write_uar(&mut self, uar: UarHandle, value: [u8; 8]) {
        let Some(u) = self.uars.get(uar.slot).copied().filter(|p| !p.is_null()) else { return };
        fence(Ordering::SeqCst);
        // SAFETY: `reg_addr` is the UAR's mapped, 8-byte-aligned doorbell register; a single
        // 8-byte volatile store is the MMIO write rdma-core's mmio_write64_be performs.
        unsafe { ptr::write_volatile((*u).reg_addr as *mut u64, u64::from_ne_bytes(value)) };
        fence(Ordering::SeqCst);
    }
}

impl Drop for RealDevx {
    fn drop(&mut self) {
        for o in self.objs.drain(..).rev().filter(|p| !p.is_null()) {
            // SAFETY: live object, destroyed once, newest first (QPs before their CQs).
            unsafe { mlx5dv_devx_obj_destroy(o) };
        }
        for u in self.umems.drain(..).rev().filter(|p| !p.is_null()) {
            // SAFETY: live umem, deregistered once after every object using it.
            unsafe { mlx5dv_devx_umem_dereg(u) };
        }
        for w in self.mws.drain(..) {
            // SAFETY: live window, deallocated once; the QPs it could be bound to are gone.
            unsafe { ibv_dealloc_mw(w) };
        }
        for m in self.mrs.drain(..) {
            // SAFETY: live MR, deregistered once, after the windows bound through it.
            unsafe { ibv_dereg_mr(m) };
        }
        if !self.private_pd.is_null() {
            // SAFETY: our PD, no longer used by any object.
            unsafe { ibv_dealloc_pd(self.private_pd) };
        }
        for u in self.uars.drain(..).rev() {
            // SAFETY: live UAR, freed once.
            unsafe { mlx5dv_devx_free_uar(u) };
        }
        if !self.pd.is_null() {
            // SAFETY: our PD, no longer used by any object.
            unsafe { ibv_dealloc_pd(self.pd) };
        }
        for r in self.regions.drain(..) {
            // SAFETY: from posix_memalign in alloc_mem, freed once, after every umem and MR
            // over it is gone.
            unsafe { libc::free(r.addr as *mut c_void) };
        }
        // the context (`ctx`) closes when the fields drop, after all of the above
    }
}

/// Ask rdma_cm for the attributes of `state` on `id` (which has no QP of its own).
///
/// # Safety
/// `id` must be a live `rdma_cm_id` with a pending connection request (passive side) or a
/// resolved route (active side).
pub unsafe fn init_qp_attr(id: *mut rdma_cm_id, state: ibv_qp_state::Type) -> Result<CmQpAttr, DevxError> {
    // SAFETY: ibv_qp_attr is plain C data; all-zero is a valid value.
    let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
    attr.qp_state = state;
    let mut mask: c_int = 0;
    // SAFETY: `id` is live per the contract; attr/mask are valid outputs.
    let rc = unsafe { rdma_init_qp_attr(id, &mut attr, &mut mask) };
    if rc != 0 {
        return Err(DevxError::Call { call: "rdma_init_qp_attr", errno: rc_errno(rc) });
    }
    let g = &attr.ah_attr.grh;
    // SAFETY: both members of `ibv_gid` are 16 plain bytes; reading `raw` is always valid.
    let dgid = unsafe { g.dgid.raw };
    let a = CmQpAttr {
        port_num: attr.port_num,
        pkey_index: attr.pkey_index,
        qp_access_flags: attr.qp_access_flags,
        dest_qp_num: attr.dest_qp_num,
        path_mtu: attr.path_mtu,
        rq_psn: attr.rq_psn,
        sq_psn: attr.sq_psn,
        max_rd_atomic: attr.max_rd_atomic,
        max_dest_rd_atomic: attr.max_dest_rd_atomic,
        min_rnr_timer: attr.min_rnr_timer,
        timeout: attr.timeout,
        retry_cnt: attr.retry_cnt,
        rnr_retry: attr.rnr_retry,
        ah_is_global: attr.ah_attr.is_global != 0,
        ah_dlid: attr.ah_attr.dlid,
        ah_sl: attr.ah_attr.sl,
        ah_port_num: attr.ah_attr.port_num,
        dgid,
        flow_label: g.flow_label,
        sgid_index: g.sgid_index,
        hop_limit: g.hop_limit,
        traffic_class: g.traffic_class,
    };
    Ok(a)
}

/// rdma_cm's passive side in external-QP mode on a channel of the DEVX MN's own (its QPs are
/// not rdma_cm's): [`ExternalCm`] over `rdma_init_qp_attr` and `rdma_accept` with
/// `conn_param.qp_num` (librdmacm rdma_accept(3): a QP the caller owns).
#[derive(Debug, Default)]
pub struct RealCm {
    channel: CmChannel,
}

impl ExternalCm for RealCm {
    fn listen(&mut self, addr: SocketAddr, device: &str) -> crate::error::Result<()> {
        let id = self.channel.bind(addr)?;
        match crate::cm_event::id_device(id) {
            Some(d) if d == device => {}
            other => {
                return Err(VerbsError::Config(format!(
                    "{addr} belongs to {}, not {device}: pass --device with the device that owns it",
                    other.as_deref().unwrap_or("no RDMA device"),
                )))
            }
        }
        self.channel.listen(id, addr, 64)
    }
    fn poll(&mut self, timeout: Duration) -> crate::error::Result<Option<CmEvent>> {
        self.channel.poll(timeout)
    }
    fn qp_attrs(&mut self, id: CmId) -> Result<[CmQpAttr; 3], DevxError> {
        if !self.channel.is_request(id) {
            return Err(DevxError::Call {
                call: "rdma_init_qp_attr (not a pending connection request)",
                errno: libc::EINVAL,
            });
        }
        let mut out = [CmQpAttr::default(); 3];
        for (o, state) in
            out.iter_mut().zip([ibv_qp_state::IBV_QPS_INIT, ibv_qp_state::IBV_QPS_RTR, ibv_qp_state::IBV_QPS_RTS])
        {
            // SAFETY: `id` is a pending connection request of this channel (checked above):
            // live until accepted or rejected.
            *o = unsafe { init_qp_attr(id.0, state) }?;
        }
        Ok(out)
    }
    fn accept(&mut self, id: CmId, a: &Accept<'_>) -> Result<(), DevxError> {
        let raw = self
            .channel
            .take_request(id)
            .ok_or(DevxError::Call { call: "rdma_accept (not a pending connection request)", errno: libc::EINVAL })?;
        let Ok(len) = u8::try_from(a.private.len()) else {
            crate::cm_event::reject_raw(raw);
            return Err(DevxError::Call { call: "rdma_accept (private data > 255 B)", errno: libc::EINVAL });
        };
        // SAFETY: rdma_conn_param is plain C data; all-zero is valid.
        let mut p: rdma_conn_param = unsafe { std::mem::zeroed() };
        p.qp_num = a.qp_num;
        p.private_data = a.private.as_ptr() as *const c_void;
        p.private_data_len = len;
        p.responder_resources = a.responder_resources;
        p.initiator_depth = a.initiator_depth;
        p.retry_count = a.retry_count;
        p.rnr_retry_count = a.rnr_retry_count;
        // SAFETY: `raw` is a live connection request taken out of the pending table (ours to
        // accept or reject); `p` and the private data are valid for the call.
        let rc = unsafe { rdma_accept(raw, &mut p) };
        if rc != 0 {
            let errno = rc_errno(rc);
            crate::cm_event::reject_raw(raw);
            return Err(DevxError::Call { call: "rdma_accept", errno });
        }
        Ok(())
    }
    fn reject_with(&mut self, id: CmId, private: &[u8]) {
        self.channel.reject_with(id, private)
    }
    fn disconnect(&mut self, id: CmId) {
        // SAFETY: an id this side accepted and owns (the DEVX transport forgets it now, so it
        // is destroyed once); its QP is ours, not rdma_cm's.
        unsafe {
            rdma_disconnect(id.0);
            rdma_destroy_id(id.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::mem::{offset_of, size_of};
    use std::path::Path;
    use std::process::Command;

    /// The C program of core's golden test prints the header's sizes and offsets.
    fn header_layouts() -> HashMap<String, u64> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../core/tests/mlx5_golden.c");
        let exe = std::env::temp_dir().join(format!("omw_devx_layouts_{}", std::process::id()));
        let st = Command::new("cc").args(["-std=gnu11", "-O0", "-o"]).arg(&exe).arg(&src).status().expect("cc");
        assert!(st.success(), "compiling {} against mlx5dv.h failed (is libibverbs-dev installed?)", src.display());
        let out = Command::new(&exe).output().expect("run");
        let _ = std::fs::remove_file(&exe);
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter_map(|l| l.split_once(" = ").map(|(k, v)| (k.to_string(), v.parse().unwrap())))
            .collect()
    }

    #[test]
    fn declared_structs_match_mlx5dv_h() {
        let h = header_layouts();
        let v = |k: &str| *h.get(k).unwrap_or_else(|| panic!("missing {k}")) as usize;
        assert_eq!(v("MLX5DV_CONTEXT_FLAGS_DEVX"), MLX5DV_CONTEXT_FLAGS_DEVX as usize);
        assert_eq!(v("MLX5DV_OBJ_PD"), MLX5DV_OBJ_PD as usize);
        assert_eq!(v("MLX5DV_OBJ_AH"), MLX5DV_OBJ_AH as usize);
        assert_eq!(v("sizeof(mlx5dv_context_attr)"), size_of::<Mlx5dvContextAttr>());
        assert_eq!(v("offsetof(mlx5dv_context_attr.comp_mask)"), offset_of!(Mlx5dvContextAttr, comp_mask));
        assert_eq!(v("sizeof(mlx5dv_devx_uar)"), size_of::<Mlx5dvDevxUar>());
        assert_eq!(v("offsetof(mlx5dv_devx_uar.reg_addr)"), offset_of!(Mlx5dvDevxUar, reg_addr));
        assert_eq!(v("offsetof(mlx5dv_devx_uar.base_addr)"), offset_of!(Mlx5dvDevxUar, base_addr));
        assert_eq!(v("offsetof(mlx5dv_devx_uar.page_id)"), offset_of!(Mlx5dvDevxUar, page_id));
        assert_eq!(v("offsetof(mlx5dv_devx_uar.mmap_off)"), offset_of!(Mlx5dvDevxUar, mmap_off));
        assert_eq!(v("offsetof(mlx5dv_devx_uar.comp_mask)"), offset_of!(Mlx5dvDevxUar, comp_mask));
        assert_eq!(v("sizeof(mlx5dv_devx_umem)"), size_of::<Mlx5dvDevxUmem>());
        assert_eq!(v("sizeof(mlx5dv_pd)"), size_of::<Mlx5dvPd>());
        assert_eq!(v("offsetof(mlx5dv_pd.comp_mask)"), offset_of!(Mlx5dvPd, comp_mask));
        assert_eq!(v("sizeof(mlx5dv_obj)"), size_of::<Mlx5dvObj>());
        assert_eq!(v("offsetof(mlx5dv_obj.ah)"), offset_of!(Mlx5dvObj, ah));
        assert_eq!(v("offsetof(mlx5dv_obj.pd)"), offset_of!(Mlx5dvObj, pd));
        assert_eq!(v("sizeof(mlx5dv_ah)"), size_of::<Mlx5dvAh>());
        assert_eq!(v("offsetof(mlx5_wqe_av.rmac)"), AV_RMAC_OFFSET);
    }

    /// On a machine without an mlx5 device, opening fails with a typed error, not a panic.
    #[test]
    fn open_without_a_device_is_a_clear_error() {
        match RealDevx::open(&DeviceChoice::default()) {
            Ok(d) => eprintln!("skipped: this machine has DEVX device {}", d.device()),
            Err(e) => {
                let s = e.to_string();
                assert!(
                    matches!(
                        e,
                        VerbsError::NoDevice { .. }
                            | VerbsError::Port(_)
                            | VerbsError::Devx(
                                DevxError::NotMlx5 { .. } | DevxError::NoMlx5 { .. } | DevxError::Open { .. }
                            )
                    ),
                    "{s}"
                );
            }
        }
    }
}
