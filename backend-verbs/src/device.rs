//! Opening an RDMA device: the device list, attributes, the port's GID, the memlock limit.
//!
//! The context is opened through `rdma_get_devices` when librdmacm can, so that the PD the
//! backend allocates belongs to the very context rdma_cm hands out in `cm_id->verbs` (an
//! `rdma_create_qp` with a PD of another context is refused).

use crate::error::{human, Result, VerbsError};
use omw_core::backend::Capabilities;
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
}

/// Vendor id soft-RoCE reports (`RXE_VENDOR_ID`).
pub const RXE_VENDOR_ID: u32 = 0x00FF_FFFF;

impl DeviceInfo {
    /// Linux soft-RoCE (rdma_rxe).
    pub fn is_rxe(&self) -> bool {
        self.vendor_id == RXE_VENDOR_ID
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
    pub port: u8,
    pub gid_index: u8,
    pub gid: ibv_gid,
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

/// Names of all RDMA devices; a typed error when there are none.
pub fn device_names() -> Result<Vec<String>> {
    let mut n: i32 = 0;
    // SAFETY: ibv_get_device_list writes the count into `n` and returns a NULL-terminated
    // array (or null); the array is freed below and not used afterwards.
    unsafe {
        let list = ibv_get_device_list(&mut n);
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            return Err(VerbsError::NoDevice {
                detail: format!("ibv_get_device_list failed: {e} (the kernel has no RDMA support?)"),
            });
        }
        let names = (0..n.max(0) as usize).map(|i| dev_name(*list.add(i))).collect::<Vec<_>>();
        ibv_free_device_list(list);
        if names.is_empty() {
            return Err(VerbsError::NoDevice { detail: "libibverbs lists no device".into() });
        }
        Ok(names)
    }
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
    })
}

/// The GID index raw (non-rdma_cm) connections use: `OMW_GID_INDEX` if set, else the first
/// IPv4-mapped RoCE GID (soft-RoCE: index 1; index 0 is link-local and fails to reach RTR),
/// else 0.
fn pick_gid(ctx: *mut ibv_context, port: u8) -> Result<(u8, ibv_gid)> {
    let forced = std::env::var("OMW_GID_INDEX").ok().and_then(|v| v.parse::<u8>().ok());
    // SAFETY: ibv_gid is plain bytes; ibv_query_gid fills it for a valid index and returns
    // non-zero otherwise.
    unsafe {
        let mut gid: ibv_gid = std::mem::zeroed();
        if let Some(i) = forced {
            let rc = ibv_query_gid(ctx, port, i as i32, &mut gid);
            if rc != 0 {
                return Err(VerbsError::rc("ibv_query_gid", rc));
            }
            return Ok((i, gid));
        }
        let mut first: Option<(u8, ibv_gid)> = None;
        for i in 0..16u8 {
            if ibv_query_gid(ctx, port, i as i32, &mut gid) != 0 {
                break;
            }
            let raw = gid.raw;
            if raw.iter().all(|b| *b == 0) {
                continue;
            }
            if raw[..10].iter().all(|b| *b == 0) && raw[10] == 0xff && raw[11] == 0xff {
                return Ok((i, gid));
            }
            if first.is_none() {
                first = Some((i, gid));
            }
        }
        first.ok_or(VerbsError::Call { call: "ibv_query_gid (no usable GID)", errno: libc::ENODEV })
    }
}

impl Context {
    /// Open `name`, or the first device with type-2 windows when `name` is None.
    pub fn open(name: Option<&str>, require_mw: bool) -> Result<Context> {
        let names = device_names()?;
        let chosen = match name {
            Some(n) => {
                if !names.iter().any(|x| x == n) {
                    return Err(VerbsError::DeviceNotFound { name: n.into(), available: names });
                }
                n.to_string()
            }
            None => {
                // open each in turn and take the first with type-2 windows
                let mut found = None;
                for n in &names {
                    if let Ok(c) = Self::open_exact(n) {
                        if c.info.mw_type2 || !require_mw {
                            found = Some(c);
                            break;
                        }
                    }
                }
                return found.ok_or_else(|| VerbsError::NoMwType2 { device: names.join(", ") });
            }
        };
        let c = Self::open_exact(&chosen)?;
        if require_mw && !c.info.mw_type2 {
            return Err(VerbsError::NoMwType2 { device: chosen });
        }
        Ok(c)
    }

    fn open_exact(name: &str) -> Result<Context> {
        // SAFETY: every pointer below comes from librdmacm/libibverbs and is checked for null
        // before use; the lists are freed exactly once (here on failure, in Drop otherwise).
        unsafe {
            let mut n: i32 = 0;
            let list = rdma_get_devices(&mut n);
            let mut ctx: *mut ibv_context = ptr::null_mut();
            let mut cm_list = ptr::null_mut();
            if !list.is_null() {
                for i in 0..n.max(0) as usize {
                    let c = *list.add(i);
                    if !c.is_null() && dev_name((*c).device) == name {
                        ctx = c;
                    }
                }
                if ctx.is_null() {
                    rdma_free_devices(list);
                } else {
                    cm_list = list;
                }
            }
            if ctx.is_null() {
                // librdmacm unavailable (no rdma_ucm module): plain verbs still work (probe)
                let mut m = 0;
                let dl = ibv_get_device_list(&mut m);
                if dl.is_null() {
                    return Err(VerbsError::NoDevice {
                        detail: format!("ibv_get_device_list failed: {}", std::io::Error::last_os_error()),
                    });
                }
                for i in 0..m.max(0) as usize {
                    let d = *dl.add(i);
                    if dev_name(d) == name {
                        ctx = ibv_open_device(d);
                        break;
                    }
                }
                ibv_free_device_list(dl);
                if ctx.is_null() {
                    return Err(VerbsError::last("ibv_open_device"));
                }
            }
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
                },
                port: 1,
                gid_index: 0,
                gid: std::mem::zeroed(),
            };
            c.info = query_info(ctx, name.into())?;
            let (gi, gid) = pick_gid(ctx, c.port)?;
            c.gid_index = gi;
            c.gid = gid;
            Ok(c)
        }
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

/// Make sure `need` bytes can be pinned: raise the soft RLIMIT_MEMLOCK to the hard limit if
/// that suffices, else a [`VerbsError::MemlockTooLow`] that says how to raise it. Processes with
/// CAP_IPC_LOCK (root) are not limited.
pub fn ensure_memlock(need: u64) -> Result<()> {
    // SAFETY: getrlimit/setrlimit/geteuid only read and write the rlimit struct passed.
    unsafe {
        if libc::geteuid() == 0 {
            return Ok(());
        }
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) != 0 {
            return Ok(()); // cannot tell; registration will report what it hits
        }
        if r.rlim_cur == libc::RLIM_INFINITY || r.rlim_cur >= need {
            return Ok(());
        }
        if r.rlim_max == libc::RLIM_INFINITY || r.rlim_max >= need {
            let want = libc::rlimit { rlim_cur: r.rlim_max, rlim_max: r.rlim_max };
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &want) == 0 {
                return Ok(());
            }
        }
        Err(VerbsError::MemlockTooLow { limit: r.rlim_cur, need })
    }
}

/// The current soft memlock limit, for reports.
pub fn memlock_limit() -> String {
    // SAFETY: getrlimit writes only into `r`.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) != 0 {
            return "unknown".into();
        }
        human(r.rlim_cur)
    }
}
