//! Opening an RDMA device: the device list, attributes, the port's GID, the memlock limit.
//!
//! The context is opened through `rdma_get_devices` when librdmacm can, so that the PD the
//! backend allocates belongs to the very context rdma_cm hands out in `cm_id->verbs` (an
//! `rdma_create_qp` with a PD of another context is refused).

use crate::error::{Result, VerbsError};
use crate::port::{choose_gid, pick_device, Candidate, GidEntry, GidType, LinkLayer, Mtu, PortAttr, PortState};
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
    /// The port in use and its attributes (queried when the context is opened).
    pub port_attr: PortAttr,
    /// The source GID of raw QPs.
    pub gid: GidEntry,
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
        let names = device_names()?;
        if let Some(n) = &choice.device {
            if !names.iter().any(|x| x == n) {
                return Err(VerbsError::DeviceNotFound { name: n.clone(), available: names });
            }
        }
        let mut opened = Vec::new();
        let mut cands = Vec::new();
        for n in names.iter().filter(|n| choice.device.as_ref().is_none_or(|d| d == *n)) {
            let c = match Self::open_exact(n) {
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
                port_attr: PortAttr {
                    port: 1,
                    state: PortState::Other(u32::MAX),
                    link_layer: LinkLayer::Unspecified,
                    lid: 0,
                    active_mtu: None,
                    gid_table_len: 0,
                },
                gid: GidEntry { index: 0, gid: [0; 16], gid_type: GidType::Unknown },
            };
            c.info = query_info(ctx, name.into())?;
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
