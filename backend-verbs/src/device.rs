//! Opening an RDMA device: the device list, attributes, the port and its GID (`DeviceChoice`:
//! `--device`, `--gid-index`), and the protection-domain objects every backend creates on it
//! (PD, MR, type-2 window). Both MN devices open here: the verbs backend's context, and the
//! DEVX one (`devx::ffi::RealDevx`), which only brings its own way of opening one device.
//!
//! The verbs context is opened through `rdma_get_devices` when librdmacm can, so that the PD
//! the backend allocates belongs to the very context rdma_cm hands out in `cm_id->verbs` (an
//! `rdma_create_qp` with a PD of another context is refused).

use crate::error::{Result, VerbsError};
use crate::memlock::{MemlockNeed, TooLow};
use crate::port::{choose_gid, pick_device, Candidate, GidEntry, GidType, LinkLayer, Mtu, PortAttr, PortState};
use omw_core::access::AccessFlags;
use omw_core::device::Capabilities;
use rdma_sys::*;
use std::ffi::CStr;
use std::ptr;

/// What the device says about itself (before any probing of real semantics).
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub name: String,
    pub mw_type2: bool,
    pub mem_mgt_extensions: bool,
    pub atomics: bool,
    pub max_mw: i32,
    pub max_mr: i32,
    pub max_qp: i32,
    pub max_qp_wr: i32,
    pub max_qp_rd_atom: i32,
    pub phys_port_cnt: u8,
    pub vendor_id: u32,
    /// `ibv_device_attr.fw_ver`: a device profile (`devx::profile`) holds for this firmware.
    pub fw_ver: String,
}

/// Mellanox / NVIDIA's IEEE vendor id (ConnectX).
pub const MELLANOX_VENDOR_ID: u32 = 0x02c9;

/// Vendor id soft-RoCE reports (`RXE_VENDOR_ID`).
pub const RXE_VENDOR_ID: u32 = 0x00FF_FFFF;

impl DeviceInfo {
    /// Linux soft-RoCE (rdma_rxe).
    pub fn is_rxe(&self) -> bool {
        self.vendor_id == RXE_VENDOR_ID
    }
    /// The limits a pool must fit (`omw plan`, and `omw mn` before it provisions). On
    /// Mellanox/NVIDIA devices windows and MRs are entries of one key table (mlx5 mkeys:
    /// `max_mw = max_mr = 1 << log_max_mkey`, Linux `drivers/infiniband/hw/mlx5/main.c`).
    pub fn limits(&self) -> omw_core::mn::capacity::DeviceLimits {
        omw_core::mn::capacity::DeviceLimits {
            max_mw: self.max_mw.max(0) as u64,
            max_mr: self.max_mr.max(0) as u64,
            max_qp: self.max_qp.max(0) as u64,
            shared_keys: self.vendor_id == MELLANOX_VENDOR_ID,
        }
    }
    /// Capabilities that follow from the attributes alone. The memory-window *semantics*
    /// (bounds, QP binding, invalidation check) are not declared here: only the probe may.
    pub fn declared_capabilities(&self) -> Capabilities {
        let mut c = Capabilities::empty();
        if self.mw_type2 {
            c |= Capabilities::MW_TYPE2;
        }
        if self.atomics {
            c |= Capabilities::ATOMICS;
        }
        if self.mem_mgt_extensions {
            c |= Capabilities::SEND_WITH_INV;
        }
        c
    }
}

/// An open device context (owned; closed on drop).
pub(crate) struct Context {
    pub ctx: *mut ibv_context,
    /// `rdma_get_devices` list the context came from (freed on drop), or null when the context
    /// was opened with `ibv_open_device` (closed on drop).
    cm_list: *mut *mut ibv_context,
    pub info: DeviceInfo,
    /// The port in use and its attributes (queried when the context is opened).
    pub port_attr: PortAttr,
    /// The source GID of raw QPs.
    pub gid: GidEntry,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.info.name)
            .field("port", &self.port_attr.port)
            .field("gid_index", &self.gid.index)
            .finish_non_exhaustive()
    }
}

fn dev_name(d: *mut ibv_device) -> String {
    // SAFETY: `d` is an entry of a live device list; ibv_get_device_name returns a
    // NUL-terminated string owned by the device (or null).
    unsafe {
        let p = ibv_get_device_name(d);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// Run `f` over the device list, each device with its name; the list is freed when `f`
/// returns, so the pointers must not outlive the call. A typed error when libibverbs has no
/// list.
pub(crate) fn with_devices<R>(f: impl FnOnce(&[(String, *mut ibv_device)]) -> R) -> Result<R> {
    let mut n: i32 = 0;
    // SAFETY: ibv_get_device_list writes the count into `n` and returns a NULL-terminated
    // array (or null); the array is freed below, after `f`, and not used afterwards.
    unsafe {
        let list = ibv_get_device_list(&mut n);
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            return Err(VerbsError::NoDevice {
                detail: format!("ibv_get_device_list failed: {e} (the kernel has no RDMA support?)"),
            });
        }
        let devices = (0..n.max(0) as usize).map(|i| *list.add(i)).map(|d| (dev_name(d), d)).collect::<Vec<_>>();
        let r = f(&devices);
        ibv_free_device_list(list);
        Ok(r)
    }
}

/// Names of all RDMA devices; a typed error when there are none.
pub fn device_names() -> Result<Vec<String>> {
    let names = with_devices(|l| l.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>())?;
    if names.is_empty() {
        return Err(VerbsError::NoDevice { detail: "libibverbs lists no device".into() });
    }
    Ok(names)
}

/// A C string in a fixed array, up to its NUL (the whole array if there is none), lossily.
fn fw_ver(raw: &[libc::c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn query_info(ctx: *mut ibv_context, name: String) -> Result<DeviceInfo> {
    // SAFETY: ctx is an open context; ibv_device_attr is plain data that
    // ibv_query_device fills completely.
    let a = unsafe {
        let mut a: ibv_device_attr = std::mem::zeroed();
        let rc = ibv_query_device(ctx, &mut a);
        if rc != 0 {
            return Err(VerbsError::rc("ibv_query_device", rc));
        }
        a
    };
    let flags = ibv_device_cap_flags(a.device_cap_flags);
    let has = |f: ibv_device_cap_flags| (flags & f) == f;
    Ok(DeviceInfo {
        name,
        mw_type2: has(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW)
            && (has(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A)
                || has(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B)),
        mem_mgt_extensions: has(ibv_device_cap_flags::IBV_DEVICE_MEM_MGT_EXTENSIONS),
        atomics: a.atomic_cap != ibv_atomic_cap::IBV_ATOMIC_NONE,
        max_mw: a.max_mw,
        max_mr: a.max_mr,
        max_qp: a.max_qp,
        max_qp_wr: a.max_qp_wr,
        max_qp_rd_atom: a.max_qp_rd_atom,
        phys_port_cnt: a.phys_port_cnt,
        vendor_id: a.vendor_id,
        fw_ver: fw_ver(&a.fw_ver),
    })
}

extern "C" {
    /// `ibv_query_gid_ex` is a static inline in `verbs.h` that passes `sizeof(*entry)` to this
    /// exported symbol (libibverbs `IBVERBS_1.11`, rdma-core ≥ v32; not in the bindings).
    fn _ibv_query_gid_ex(
        context: *mut ibv_context,
        port_num: u32,
        gid_index: u32,
        entry: *mut ibv_gid_entry,
        flags: u32,
        entry_size: usize,
    ) -> libc::c_int;
}

fn query_port(ctx: *mut ibv_context, port: u8) -> Result<PortAttr> {
    // SAFETY: ctx is an open context; ibv_port_attr is plain data the call fills (the
    // provider's query_port is given its size).
    let a = unsafe {
        let mut a: ibv_port_attr = std::mem::zeroed();
        let rc = ___ibv_query_port(ctx, port, &mut a);
        if rc != 0 {
            return Err(VerbsError::rc("ibv_query_port", rc));
        }
        a
    };
    Ok(PortAttr {
        port,
        state: PortState::from_raw(a.state),
        link_layer: LinkLayer::from_raw(a.link_layer),
        lid: a.lid,
        active_mtu: Mtu::from_raw(a.active_mtu),
        gid_table_len: a.gid_tbl_len.max(0) as u32,
        max_msg_sz: a.max_msg_sz,
    })
}

/// The port's GID table with each entry's type: `ibv_query_gid_ex`, or where the provider
/// refuses it, `ibv_query_gid` and the sysfs type file. Empty entries are left out.
fn gid_table(ctx: *mut ibv_context, dev: &str, port: &PortAttr) -> Vec<GidEntry> {
    let mut out = Vec::new();
    for i in 0..port.gid_table_len.min(256) {
        // SAFETY: ibv_gid_entry is plain data; the call writes at most `entry_size` bytes.
        let (rc, e) = unsafe {
            let mut e: ibv_gid_entry = std::mem::zeroed();
            let rc = _ibv_query_gid_ex(ctx, port.port as u32, i, &mut e, 0, std::mem::size_of::<ibv_gid_entry>());
            (rc, e)
        };
        let entry = if rc == 0 {
            // SAFETY: ibv_gid is a union of plain bytes; raw covers all 16.
            Some(GidEntry { index: i as u8, gid: unsafe { e.gid.raw }, gid_type: GidType::from_raw(e.gid_type) })
        } else if rc == libc::ENODATA || rc == -libc::ENODATA {
            None // an empty slot
        } else {
            // SAFETY: ibv_gid is plain bytes; ibv_query_gid fills it for a valid index.
            let raw = unsafe {
                let mut g: ibv_gid = std::mem::zeroed();
                let ok = ibv_query_gid(ctx, port.port, i as i32, &mut g) == 0;
                ok.then_some(g.raw)
            };
            raw.map(|gid| {
                let p = format!("/sys/class/infiniband/{dev}/ports/{}/gid_attrs/types/{i}", port.port);
                let t =
                    std::fs::read_to_string(p).map_or(GidType::Unknown, |s| GidType::from_sysfs(&s, port.link_layer));
                GidEntry { index: i as u8, gid, gid_type: t }
            })
        };
        if let Some(e) = entry.filter(|e| !e.is_zero()) {
            out.push(e);
        }
    }
    out
}

/// Which device, port and GID to open (`--device`, `--gid-index`).
#[derive(Clone, Debug, Default)]
pub struct DeviceChoice {
    pub device: Option<String>,
    /// Source GID of raw QPs (perftest's `-x`); default: [`choose_gid`]. The `OMW_GID_INDEX`
    /// environment variable is read when this is None.
    pub gid_index: Option<u8>,
}

impl DeviceChoice {
    pub fn named(device: Option<&str>) -> Self {
        DeviceChoice { device: device.map(str::to_string), gid_index: None }
    }
    fn forced_gid(&self) -> Option<u8> {
        self.gid_index.or_else(|| std::env::var("OMW_GID_INDEX").ok().and_then(|v| v.parse::<u8>().ok()))
    }
}

impl Context {
    /// Open the device `choice` names, or the first with an ACTIVE port (preferring one whose
    /// attributes advertise type-2 windows; whether they work is the probe's to say), on its
    /// first ACTIVE port, with the GID [`choose_gid`] picks.
    pub fn open(choice: &DeviceChoice) -> Result<Context> {
        Self::open_with(choice, Self::open_exact)
    }

    /// [`Context::open`] with `open_exact` opening one device by name (the verbs context here,
    /// a DEVX context in `devx::ffi`). Without a name, a device it cannot open is skipped; with
    /// one, its error is the answer.
    pub(crate) fn open_with(
        choice: &DeviceChoice,
        mut open_exact: impl FnMut(&str) -> Result<Context>,
    ) -> Result<Context> {
        let names = device_names()?;
        if let Some(n) = &choice.device {
            if !names.iter().any(|x| x == n) {
                return Err(VerbsError::DeviceNotFound { name: n.clone(), available: names });
            }
        }
        let mut opened = Vec::new();
        let mut cands = Vec::new();
        for n in names.iter().filter(|n| choice.device.as_ref().is_none_or(|d| d == *n)) {
            let c = match open_exact(n) {
                Ok(c) => c,
                Err(e) if choice.device.is_some() => return Err(e),
                Err(_) => continue,
            };
            let ports = (1..=c.info.phys_port_cnt.max(1))
                .map(|p| (p, query_port(c.ctx, p).map_or(PortState::Other(u32::MAX), |a| a.state)))
                .collect();
            cands.push(Candidate { name: n.clone(), mw_type2_flag: c.info.mw_type2, ports });
            opened.push(c);
        }
        let (i, port) = pick_device(&cands, choice.device.as_deref()).map_err(VerbsError::Port)?;
        let mut c = opened.swap_remove(i);
        drop(opened);
        c.port_attr = query_port(c.ctx, port)?;
        let table = gid_table(c.ctx, &c.info.name, &c.port_attr);
        c.gid = choose_gid(&c.port_attr, &table, choice.forced_gid()).map_err(VerbsError::Port)?;
        Ok(c)
    }

    fn open_exact(name: &str) -> Result<Context> {
        // SAFETY: every pointer below comes from librdmacm and is checked for null before use;
        // the list is freed exactly once (here when no entry is ours, in Drop otherwise).
        let (ctx, cm_list) = unsafe {
            let mut n: i32 = 0;
            let list = rdma_get_devices(&mut n);
            let mut ctx: *mut ibv_context = ptr::null_mut();
            if !list.is_null() {
                for i in 0..n.max(0) as usize {
                    let c = *list.add(i);
                    if !c.is_null() && dev_name((*c).device) == name {
                        ctx = c;
                    }
                }
                if ctx.is_null() {
                    rdma_free_devices(list);
                }
            }
            (ctx, if ctx.is_null() { ptr::null_mut() } else { list })
        };
        if !ctx.is_null() {
            return Self::with_context(ctx, cm_list, name);
        }
        // librdmacm unavailable (no rdma_ucm module): plain verbs still work (probe)
        let ctx = with_devices(|l| {
            l.iter().find(|(n, _)| n == name).map_or(ptr::null_mut(), |(_, d)| {
                // SAFETY: `d` is a live entry of the list; the context (or null) is ours.
                unsafe { ibv_open_device(*d) }
            })
        })?;
        if ctx.is_null() {
            return Err(VerbsError::last("ibv_open_device"));
        }
        Self::with_context(ctx, ptr::null_mut(), name)
    }

    /// A context `name` was opened with elsewhere (`mlx5dv_open_device` for DEVX), owned from
    /// now on: closed with `ibv_close_device` on drop.
    ///
    /// # Safety
    /// `ctx` must be an open context on device `name` that nothing else closes.
    #[cfg(feature = "devx")]
    pub(crate) unsafe fn adopt(ctx: *mut ibv_context, name: &str) -> Result<Context> {
        Self::with_context(ctx, ptr::null_mut(), name)
    }

    /// The context `ctx` (from `cm_list` when that is not null), its attributes queried; the
    /// port and GID are [`Context::open_with`]'s to choose.
    fn with_context(ctx: *mut ibv_context, cm_list: *mut *mut ibv_context, name: &str) -> Result<Context> {
        let mut c = Context {
            ctx,
            cm_list,
            info: DeviceInfo {
                name: name.into(),
                mw_type2: false,
                mem_mgt_extensions: false,
                atomics: false,
                max_mw: 0,
                max_mr: 0,
                max_qp: 0,
                max_qp_wr: 0,
                max_qp_rd_atom: 0,
                phys_port_cnt: 1,
                vendor_id: 0,
                fw_ver: String::new(),
            },
            port_attr: PortAttr {
                port: 1,
                state: PortState::Other(u32::MAX),
                link_layer: LinkLayer::Unspecified,
                lid: 0,
                active_mtu: None,
                gid_table_len: 0,
                max_msg_sz: 0,
            },
            gid: GidEntry { index: 0, gid: [0; 16], gid_type: GidType::Unknown },
        };
        // on failure `c` drops and closes (or frees the list of) the context
        c.info = query_info(ctx, name.into())?;
        Ok(c)
    }

    /// A protection domain on this context (`ibv_dealloc_pd` is the owner's, after everything
    /// in it is gone).
    pub(crate) fn alloc_pd(&self) -> Result<*mut ibv_pd, ObjectError> {
        // SAFETY: the context is open.
        let pd = unsafe { ibv_alloc_pd(self.ctx) };
        if pd.is_null() {
            return Err(ObjectError::last("ibv_alloc_pd"));
        }
        Ok(pd)
    }
}

/// Why a PD, MR or window could not be made on a context. The verbs backend and the DEVX
/// device each turn it into their own error (`From`).
#[derive(Clone, PartialEq, Eq, Debug)]
pub(crate) enum ObjectError {
    /// The verb failed with `errno`.
    Call { call: &'static str, errno: i32 },
    /// `ibv_reg_mr` was refused for lack of lockable memory.
    MemlockTooLow(TooLow),
    /// The provider has no `ibv_alloc_mw`.
    NoMwType2 { device: String },
}

impl ObjectError {
    fn last(call: &'static str) -> Self {
        ObjectError::Call { call, errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0) }
    }
}

impl From<ObjectError> for VerbsError {
    fn from(e: ObjectError) -> Self {
        match e {
            ObjectError::Call { call, errno } => VerbsError::Call { call, errno },
            ObjectError::MemlockTooLow(t) => t.into(),
            ObjectError::NoMwType2 { device } => VerbsError::NoMwType2 { device },
        }
    }
}

/// `ibv_reg_mr` of `[addr, addr + len)` in `pd`; a refusal for lack of lockable memory says so
/// (with the limit and how to raise it) instead of an errno.
///
/// # Safety
/// `pd` must be a live protection domain and the range memory the caller owns and keeps
/// mapped until the MR is deregistered.
pub(crate) unsafe fn reg_mr(
    pd: *mut ibv_pd,
    addr: u64,
    len: u64,
    access: AccessFlags,
) -> Result<*mut ibv_mr, ObjectError> {
    // SAFETY: forwarded contract; AccessFlags' bits are IBV_ACCESS_* values.
    let mr = unsafe { ibv_reg_mr(pd, addr as *mut libc::c_void, len as usize, access.bits() as i32) };
    if !mr.is_null() {
        return Ok(mr);
    }
    let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    if e == libc::ENOMEM || e == libc::EPERM || e == libc::EAGAIN {
        // SAFETY: getrlimit writes only into r.
        let limit = unsafe {
            let mut r: libc::rlimit = std::mem::zeroed();
            libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r);
            r.rlim_cur
        };
        if limit != libc::RLIM_INFINITY {
            return Err(ObjectError::MemlockTooLow(TooLow {
                limit,
                need: MemlockNeed::bytes(len),
                cap_ipc_lock: crate::memlock::cap_ipc_lock(),
            }));
        }
    }
    Err(ObjectError::Call { call: "ibv_reg_mr", errno: e })
}

/// `ibv_alloc_mw(IBV_MW_TYPE_2)` in `pd` of device `device` (named in the error when the
/// provider has no memory windows).
///
/// # Safety
/// `pd` must be a live protection domain.
pub(crate) unsafe fn alloc_mw_type2(pd: *mut ibv_pd, device: &str) -> Result<*mut ibv_mw, ObjectError> {
    // SAFETY: forwarded contract; ibv_alloc_mw returns None if the provider lacks the verb.
    match unsafe { ibv_alloc_mw(pd, ibv_mw_type::IBV_MW_TYPE_2) } {
        Some(m) if !m.is_null() => Ok(m),
        Some(_) => Err(ObjectError::last("ibv_alloc_mw(TYPE_2)")),
        None => Err(ObjectError::NoMwType2 { device: device.into() }),
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the context is owned; every object created on it was destroyed by the
        // backend before this runs (the backend drops its Context last).
        unsafe {
            if !self.cm_list.is_null() {
                rdma_free_devices(self.cm_list);
            } else if !self.ctx.is_null() {
                ibv_close_device(self.ctx);
            }
        }
    }
}
