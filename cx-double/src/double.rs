//! The double: one ConnectX port on a host of the loopback fabric, as a DEVX context sees it.
//!
//! It keeps what firmware and the kernel keep — registered umems, UAR pages, protection
//! domains, CQs and QPs by number — and maps each onto the model: a CQ is a CQ object of the
//! fabric with the CQE ring in its umem, a QP is a fabric QP whose rings are the umem the
//! CREATE_QP named (mlx5 WQEs, managed where the QP is a `cd_slave`). What the driver writes
//! reaches the device the way it does on hardware: WQEs are plain stores into the umem; the
//! UAR doorbell write names a QP, whose doorbell record then gives the producer index; the
//! receive doorbell record is read as receives are needed; the CQ doorbell record is the
//! consumer index, which bounds the CQ (overrun unless `cqc.oi`). Completions the executor
//! generates are written as 64-byte CQEs ([`crate::cqe`]) into the CQ's ring when the driver
//! looks at it (a read of the ring spins the NIC as a CPU polling it waits for it).
//!
//! The PRM commands themselves are interpreted in [`crate::commands`].

use crate::caps::CxCaps;
use crate::cqe;
use omw_core::access::AccessFlags;
use omw_core::device::behaviour::DeviceBehaviour;
use omw_core::device::{Domain, MrKeys};
use omw_loopback::{Fabric, HostId, LoopbackError, NicConfig, PdId, QpAddr};
use omw_verbs::devx::api::{DevxApi, MemRange, ObjHandle, UarHandle, UmemHandle};
use omw_verbs::devx::cm::{CmQpAttr, LocalPath};
use omw_verbs::devx::device::DevxDevice;
use omw_verbs::devx::DevxError;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;

/// `EREMOTEIO`: what DEVX returns when the firmware's answer carries a bad status (the status
/// and syndrome are in the output).
pub(crate) const EREMOTEIO: i32 = 121;
const EINVAL: i32 = 22;
const EBUSY: i32 = 16;
const EHOSTUNREACH: i32 = 113;

/// PRM protection-domain numbers: this plus the model's PD index.
pub(crate) const PDN_BASE: u32 = 0x10;

/// A command the double refused, as firmware would: the status and syndrome DEVX returns, and
/// the check that refused (the syndromes are the double's own: firmware's are not public).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Refusal {
    pub command: &'static str,
    pub status: u8,
    pub syndrome: u32,
    pub why: &'static str,
}

/// The GID of host `h`'s port: the IPv4-mapped 10.0.h.1 (RoCE v2 GIDs are IP addresses).
pub fn gid_of(h: HostId) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12] = 10;
    g[13] = (h.0 >> 8) as u8;
    g[14] = h.0 as u8;
    g[15] = 1;
    g
}

/// The MAC of host `h`'s port.
pub fn mac_of(h: HostId) -> [u8; 6] {
    [0x02, 0xcd, 0, (h.0 >> 8) as u8, h.0 as u8, 1]
}

/// The host whose port has GID `g`, if `g` is one of the fabric's.
fn host_of_gid(f: &Fabric, g: &[u8; 16]) -> Option<HostId> {
    let h = HostId(((g[13] as u32) << 8) | g[14] as u32);
    (gid_of(h) == *g && (h.0 as usize) < f.host_count()).then_some(h)
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Umem {
    pub mem: MemRange,
    /// CQs and QPs naming it (a umem in use cannot be deregistered).
    pub users: u32,
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Obj {
    Cq(u32),
    Qp(u32),
    /// A memory window made by CREATE_MKEY: its mkey index (the model window's rkey index)
    /// and the KLM octowords it was created with.
    Mkey {
        index: u32,
        octwords: u32,
    },
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct CqObj {
    pub ring: u64,
    pub log_size: u8,
    pub dbr: u64,
    pub oi: bool,
    pub umems: [u32; 2],
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct QpObj {
    pub uar_page: u32,
    pub dbr: u64,
    pub umems: [u32; 2],
}

/// What the double counts of how it was driven.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct CxStats {
    pub commands: u64,
    pub refused: u64,
    /// UAR doorbell writes that rang a QP.
    pub doorbells: u64,
    /// UAR writes naming no QP of that UAR page (ignored, as the device ignores them).
    pub stray_doorbells: u64,
    pub cqes_written: u64,
}

/// A ConnectX port on host `host` of a shared loopback fabric, behind DEVX.
#[derive(Debug)]
pub struct CxDouble {
    pub(crate) fabric: Rc<RefCell<Fabric>>,
    pub(crate) host: HostId,
    /// [CN-facing, MN-private].
    pub(crate) pds: [PdId; 2],
    pub(crate) caps: CxCaps,
    pub(crate) umems: BTreeMap<u32, Umem>,
    next_umem: u32,
    pub(crate) uars: BTreeSet<u32>,
    next_uar: u32,
    pub(crate) objs: Vec<Option<Obj>>,
    pub(crate) cqs: BTreeMap<u32, CqObj>,
    pub(crate) qps: BTreeMap<u32, QpObj>,
    regions: Vec<MemRange>,
    pub(crate) refusals: Vec<Refusal>,
    pub(crate) stats: CxStats,
    cqes_written: std::cell::Cell<u64>,
}

impl CxDouble {
    /// A new port on host `host` of `fabric` (the host exists; its PD 0 is the CN-facing
    /// domain, a new PD the MN-private one).
    pub fn new(fabric: Rc<RefCell<Fabric>>, host: HostId, caps: CxCaps) -> Result<Self, LoopbackError> {
        let private = fabric.borrow_mut().alloc_pd(host)?;
        Ok(CxDouble {
            fabric,
            host,
            pds: [PdId(0), private],
            caps,
            umems: BTreeMap::new(),
            next_umem: 0x20,
            uars: BTreeSet::new(),
            next_uar: 0x40,
            objs: Vec::new(),
            cqs: BTreeMap::new(),
            qps: BTreeMap::new(),
            regions: Vec::new(),
            refusals: Vec::new(),
            stats: CxStats::default(),
            cqes_written: std::cell::Cell::new(0),
        })
    }

    /// A fabric for a double (and the CNs beside it): the model's strict NIC with prefetching,
    /// mlx5 WQEs on every device QP, answering the open questions as `behaviour`.
    pub fn fabric(behaviour: DeviceBehaviour) -> Fabric {
        Fabric::new(CxDouble::nic(behaviour))
    }

    /// The model NIC the double executes with under `behaviour` (mlx5 form, prefetching).
    pub fn nic(behaviour: DeviceBehaviour) -> NicConfig {
        NicConfig::strict()
            .with_prefetch(8)
            .with_wqe_format(omw_core::wire::wqe_format::WqeFormat::Mlx5)
            .with_behaviour(behaviour)
    }

    pub fn host(&self) -> HostId {
        self.host
    }
    pub fn shared_fabric(&self) -> Rc<RefCell<Fabric>> {
        self.fabric.clone()
    }
    pub fn caps(&self) -> &CxCaps {
        &self.caps
    }
    pub fn stats(&self) -> CxStats {
        CxStats { cqes_written: self.cqes_written.get(), ..self.stats }
    }
    /// Every command refused so far, oldest first.
    pub fn refusals(&self) -> &[Refusal] {
        &self.refusals
    }
    /// The model PD of `domain`.
    pub fn pd(&self, domain: Domain) -> PdId {
        match domain {
            Domain::CnFacing => self.pds[0],
            Domain::MnPrivate => self.pds[1],
        }
    }
    /// The PD a PRM `pd` number names.
    pub(crate) fn pd_of_pdn(&self, pdn: u32) -> Option<PdId> {
        self.pds.iter().copied().find(|p| p.0 + PDN_BASE == pdn)
    }
    /// The fabric address of a QP of this port.
    pub fn qp_addr(&self, qpn: u32) -> Option<QpAddr> {
        Some(QpAddr::new(self.host, omw_core::ids::Qpn::new(qpn).ok()?))
    }
    /// The port a remote GID and MAC name, if it is one of the fabric's (a path to any other
    /// leads nowhere).
    pub(crate) fn route(&self, gid: &[u8; 16], mac: [u8; 6]) -> Option<HostId> {
        let h = host_of_gid(&self.fabric.borrow(), gid)?;
        (mac_of(h) == mac).then_some(h)
    }

    pub(crate) fn new_obj(&mut self, o: Obj) -> ObjHandle {
        self.objs.push(Some(o));
        ObjHandle(self.objs.len() - 1)
    }

    /// The umem `id`, if `[off, off + len)` lies in it: the address of `off`.
    pub(crate) fn in_umem(&self, id: u32, off: u64, len: u64) -> Option<u64> {
        let u = self.umems.get(&id)?;
        (off.checked_add(len)? <= u.mem.len as u64).then_some(u.mem.addr as u64 + off)
    }

    fn inside_umems(&self, addr: usize, len: usize) -> bool {
        self.umems.values().any(|u| addr >= u.mem.addr && addr + len <= u.mem.addr + u.mem.len)
    }

    /// Write every completion the executor generated whose time has come into its CQ's ring.
    pub fn sync_cqes(&self) {
        let mut f = self.fabric.borrow_mut();
        let mut written = 0;
        for (cqn, c) in &self.cqs {
            let Ok(st) = f.cq_status(self.host, *cqn) else { continue };
            let Ok(done) = f.take_completions(self.host, *cqn) else { continue };
            let size = 1u64 << c.log_size;
            for (i, tc) in done.iter().enumerate() {
                let pi = st.taken + i as u64;
                let bytes = cqe::encode(&tc.completion, pi, c.log_size, tc.at);
                let at = c.ring + (pi % size) * cqe::CQE_BYTES as u64;
                // the ring is the CQ's umem: inside allocated memory by construction
                let _ = f.write(self.host, at, &bytes);
                written += 1;
            }
        }
        self.cqes_written.set(self.cqes_written.get() + written);
    }

    /// The CQ whose ring holds `[addr, addr + len)`, if any.
    fn cq_of_ring(&self, addr: u64, len: u64) -> Option<u32> {
        self.cqs.iter().find_map(|(n, c)| {
            let end = c.ring + ((cqe::CQE_BYTES as u64) << c.log_size);
            (addr >= c.ring && addr + len <= end).then_some(*n)
        })
    }

    /// The CQ doorbell record's consumer index moved to `ci` (24 bits): the CQ may hold a ring
    /// more than that, unless it ignores overrun.
    fn cq_consumed(&self, cqn: u32, ci: u32) {
        let Some(c) = self.cqs.get(&cqn) else { return };
        if c.oi {
            return;
        }
        let mut f = self.fabric.borrow_mut();
        let Ok(st) = f.cq_status(self.host, cqn) else { return };
        let behind = (st.taken as u32).wrapping_sub(ci) & 0x00FF_FFFF;
        let ci = st.taken.saturating_sub(behind as u64);
        let _ = f.set_cq_limit(self.host, cqn, Some(ci + (1u64 << c.log_size)));
    }

    fn refuse_call(call: &'static str, errno: i32) -> DevxError {
        DevxError::Call { call, errno }
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

impl DevxApi for CxDouble {
    fn pdn(&self) -> u32 {
        self.pds[0].0 + PDN_BASE
    }
    fn general_cmd(&mut self, command: &'static str, input: &[u8], out: &mut [u8]) -> Result<(), DevxError> {
        let r = crate::commands::general(self, input, out);
        self.answer(command, input, out, r)
    }
    fn obj_create(&mut self, command: &'static str, input: &[u8], out: &mut [u8]) -> Result<ObjHandle, DevxError> {
        let r = crate::commands::create(self, input, out);
        match r {
            Ok(h) => {
                self.answer(command, input, out, Ok(()))?;
                Ok(h)
            }
            Err(e) => Err(self.answer(command, input, out, Err(e)).err().unwrap_or(DevxError::NotBuilt)),
        }
    }
    fn obj_modify(
        &mut self,
        command: &'static str,
        obj: ObjHandle,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(), DevxError> {
        let r = crate::commands::modify(self, obj, input, out);
        self.answer(command, input, out, r)
    }
    fn obj_query(
        &mut self,
        command: &'static str,
        obj: ObjHandle,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(), DevxError> {
        let r = crate::commands::query(self, obj, input, out);
        self.answer(command, input, out, r)
    }
    fn obj_destroy(&mut self, obj: ObjHandle) -> Result<(), DevxError> {
        let o = self.objs.get_mut(obj.0).and_then(|o| o.take());
        let unknown = || Self::refuse_call("mlx5dv_devx_obj_destroy (unknown object)", EINVAL);
        match o.ok_or_else(unknown)? {
            Obj::Qp(qpn) => {
                let q = self.qps.remove(&qpn).ok_or_else(unknown)?;
                if let Some(a) = self.qp_addr(qpn) {
                    let _ = self.fabric.borrow_mut().destroy_qp(a);
                }
                for u in q.umems {
                    if let Some(u) = self.umems.get_mut(&u) {
                        u.users = u.users.saturating_sub(1);
                    }
                }
            }
            // DESTROY_MKEY, as the kernel builds it for a DEVX mkey: the model window goes,
            // its binding revoked
            Obj::Mkey { index, .. } => {
                let mut f = self.fabric.borrow_mut();
                let rkey = f.mw_binding(self.host, index).ok_or_else(unknown)?.rkey;
                let _ = f.dealloc_mw(self.host, rkey);
            }
            Obj::Cq(cqn) => {
                if let Err(e) = self.fabric.borrow_mut().destroy_cq(self.host, cqn) {
                    // a CQ a live QP reports to: the kernel's EBUSY
                    self.objs[obj.0] = Some(Obj::Cq(cqn));
                    let _ = e;
                    return Err(Self::refuse_call("mlx5dv_devx_obj_destroy (CQ in use)", EBUSY));
                }
                let c = self.cqs.remove(&cqn).ok_or_else(unknown)?;
                for u in c.umems {
                    if let Some(u) = self.umems.get_mut(&u) {
                        u.users = u.users.saturating_sub(1);
                    }
                }
            }
        }
        Ok(())
    }
    fn umem_reg(&mut self, mem: MemRange, _access: u32) -> Result<UmemHandle, DevxError> {
        let inside = self.regions.iter().any(|r| mem.addr >= r.addr && mem.addr + mem.len <= r.addr + r.len);
        if !inside || mem.len == 0 {
            return Err(Self::refuse_call("mlx5dv_devx_umem_reg (not this process's memory)", 14));
        }
        if !mem.addr.is_multiple_of(4096) {
            return Err(Self::refuse_call("mlx5dv_devx_umem_reg (not page-aligned)", EINVAL));
        }
        let id = self.next_umem;
        self.next_umem += 1;
        self.umems.insert(id, Umem { mem, users: 0 });
        Ok(UmemHandle { slot: id as usize, umem_id: id })
    }
    fn umem_dereg(&mut self, umem: UmemHandle) -> Result<(), DevxError> {
        match self.umems.get(&umem.umem_id) {
            Some(u) if u.users > 0 => Err(Self::refuse_call("mlx5dv_devx_umem_dereg (in use)", EBUSY)),
            Some(_) => {
                self.umems.remove(&umem.umem_id);
                Ok(())
            }
            None => Err(Self::refuse_call("mlx5dv_devx_umem_dereg (unknown umem)", EINVAL)),
        }
    }
    fn alloc_uar(&mut self) -> Result<UarHandle, DevxError> {
        let page_id = self.next_uar;
        self.next_uar += 1;
        self.uars.insert(page_id);
        Ok(UarHandle { slot: page_id as usize, page_id })
    }
    fn query_eqn(&mut self, vector: u32) -> Result<u32, DevxError> {
        if vector != 0 {
            return Err(Self::refuse_call("mlx5dv_devx_query_eqn (one completion vector)", EINVAL));
        }
        Ok(self.caps.eqn)
    }
    fn write_mem(&mut self, addr: usize, bytes: &[u8]) -> Result<(), DevxError> {
        if !self.inside_umems(addr, bytes.len()) {
            return Err(DevxError::OutsideUmem { addr, len: bytes.len() });
        }
        self.fabric
            .borrow_mut()
            .write(self.host, addr as u64, bytes)
            .map_err(|_| DevxError::OutsideUmem { addr, len: bytes.len() })
    }
    /// The record is stored; a receive queue's record is the device's posted-receive count
    /// from then on, a CQ's its consumer index (a send queue's is read when its UAR rings).
    fn write_dbr(&mut self, addr: usize, value_be: [u8; 4]) {
        let a = addr as u64;
        let _ = self.fabric.borrow_mut().write(self.host, a, &value_be);
        let v = u32::from_be_bytes(value_be);
        if let Some((qpn, _)) = self.qps.iter().find(|(_, q)| q.dbr == a) {
            if let Some(qa) = self.qp_addr(*qpn) {
                let _ = self.fabric.borrow_mut().ring_doorbell(qa, omw_core::wire::wqe::QueueSel::Recv, v as u16);
            }
        } else if let Some((cqn, _)) = self.cqs.iter().find(|(_, c)| c.dbr == a) {
            self.cq_consumed(*cqn, v & 0x00FF_FFFF);
        }
    }
    /// The first 8 bytes of a control segment: `qpn_ds` names the QP, whose send doorbell
    /// record then gives the producer index. A QP of another UAR page is not rung.
    fn write_uar(&mut self, uar: UarHandle, value: [u8; 8]) {
        let qpn = be32(&value[4..8]) >> 8;
        let q = match self.qps.get(&qpn) {
            Some(q) if q.uar_page == uar.page_id && self.uars.contains(&uar.page_id) => *q,
            _ => {
                self.stats.stray_doorbells += 1;
                return;
            }
        };
        let mut rec = [0u8; 4];
        let _ = self.fabric.borrow().read(self.host, q.dbr + 4, &mut rec);
        if let Some(qa) = self.qp_addr(qpn) {
            let pi = u32::from_be_bytes(rec) as u16;
            let _ = self.fabric.borrow_mut().ring_doorbell(qa, omw_core::wire::wqe::QueueSel::Send, pi);
            self.stats.doorbells += 1;
        }
    }
}

impl CxDouble {
    /// DEVX's report of a command: a refusal's status and syndrome in `out` and the error.
    fn answer(
        &mut self,
        command: &'static str,
        input: &[u8],
        out: &mut [u8],
        r: Result<(), crate::commands::Refused>,
    ) -> Result<(), DevxError> {
        self.stats.commands += 1;
        let Err(e) = r else { return Ok(()) };
        self.stats.refused += 1;
        out.fill(0);
        crate::prm::set(out, crate::prm::header::STATUS, e.status as u64);
        crate::prm::set(out, crate::prm::header::SYNDROME, e.syndrome as u64);
        self.refusals.push(Refusal { command, status: e.status, syndrome: e.syndrome, why: e.why });
        let opcode = crate::prm::get(input, crate::prm::header::OPCODE).unwrap_or(0) as u16;
        Err(DevxError::Command { command, opcode, status: e.status, syndrome: e.syndrome, errno: EREMOTEIO })
    }
}

impl DevxDevice for CxDouble {
    fn domain_pdn(&self, domain: Domain) -> u32 {
        self.pd(domain).0 + PDN_BASE
    }
    fn reg_mr(&mut self, domain: Domain, mem: MemRange, access: AccessFlags) -> Result<MrKeys, DevxError> {
        if !self.regions.iter().any(|r| mem.addr >= r.addr && mem.addr + mem.len <= r.addr + r.len) {
            return Err(DevxError::OutsideMemory { addr: mem.addr, len: mem.len });
        }
        let pd = self.pd(domain);
        self.fabric
            .borrow_mut()
            .reg_mr(self.host, pd, mem.addr as u64, mem.len as u64, access)
            .map_err(|_| Self::refuse_call("ibv_reg_mr", EINVAL))
    }
    fn alloc_mw(&mut self) -> Result<u32, DevxError> {
        let pd = self.pds[0];
        self.fabric.borrow_mut().alloc_mw(self.host, pd).map(|r| r.0).map_err(|_| Self::refuse_call("ibv_alloc_mw", 12))
    }
    fn alloc_mem(&mut self, len: usize, align: usize) -> Result<MemRange, DevxError> {
        let align = align.max(4096).next_power_of_two();
        let addr = self
            .fabric
            .borrow_mut()
            .alloc(self.host, len.max(1) as u64, align as u64)
            .map_err(|_| Self::refuse_call("posix_memalign", 12))?;
        let r = MemRange { addr: addr as usize, len };
        self.regions.push(r);
        Ok(r)
    }
    /// A read of a CQ's ring is a CPU polling it: the NIC runs until idle, the clock reaches the
    /// CQ's next completion, and what completed is written into the rings first.
    fn read_mem(&self, addr: usize, out: &mut [u8]) -> Result<(), DevxError> {
        if let Some(cqn) = self.cq_of_ring(addr as u64, out.len() as u64) {
            let _ = self.fabric.borrow_mut().spin_on_cq(self.host, cqn);
            self.sync_cqes();
        }
        self.fabric
            .borrow()
            .read(self.host, addr as u64, out)
            .map_err(|_| DevxError::OutsideMemory { addr, len: out.len() })
    }
    fn store(&mut self, addr: usize, bytes: &[u8]) -> Result<(), DevxError> {
        self.fabric
            .borrow_mut()
            .write(self.host, addr as u64, bytes)
            .map_err(|_| DevxError::OutsideMemory { addr, len: bytes.len() })
    }
    fn local_path(&mut self) -> Result<LocalPath, DevxError> {
        Ok(LocalPath { port: 1, gid_index: 3, gid: gid_of(self.host), mac: mac_of(self.host), mtu: 3 })
    }
    fn next_hop_mac(&mut self, attr: &CmQpAttr) -> Result<[u8; 6], DevxError> {
        let h = host_of_gid(&self.fabric.borrow(), &attr.dgid)
            .ok_or(Self::refuse_call("next hop (no port has that GID)", EHOSTUNREACH))?;
        Ok(mac_of(h))
    }
    /// The device runs everything runnable (as time passing on hardware would let it), and the
    /// completions that made are written into the CQ rings.
    fn settle(&mut self, _: std::time::Duration) {
        let steps = self.fabric.borrow().config().poll_max_steps;
        self.fabric.borrow_mut().run_until_idle(steps);
        self.sync_cqes();
    }
}
