//! [`VerbsBackend`]: the core's [`RdmaBackend`](omw_core::device::RdmaBackend) contract on libibverbs.
//!
//! A thin translation: a canonical [`Wqe`] becomes one `ibv_send_wr`, an `ibv_wc` becomes a
//! [`Completion`]. What the device does not keep for us, we keep here:
//! - each window's **current rkey** (rxe does not update `mw->rkey` after a BIND_MW work
//!   request, yet uses it as the handle of the next bind) and the QP it is bound to, updated
//!   optimistically when a bind/invalidate is posted and rolled back if it completes in error;
//! - which memory this process owns, so `read_local`/`write_local`/`reg_mr` can never touch
//!   anything else.
//!
//! Teardown ([`Drop`]) invalidates and deallocates every window before any QP is destroyed
//! (rxe stalls ~51 s in `rxe_destroy_qp` otherwise), then QPs, CQs, MRs, PD, memory, context.

use crate::device::{Context, DeviceChoice};
use crate::error::{Result, VerbsError};
use crate::port::{self, Addressing, GidEntry, Peer, PortAttr};
use omw_core::access::AccessFlags;
use omw_core::chain::mlx5::Mlx5Arm;
use omw_core::chain::mlx5::Mlx5Chain;
use omw_core::device::DataPath;
use omw_core::device::OffloadRings;
use omw_core::device::Provision;
use omw_core::device::WindowState;
use omw_core::device::{Capabilities, Completion, Domain, MrKeys, MwBinding, QpState, WcOpcode, WcStatus};
use omw_core::ids::{Qpn, Rkey};
use omw_core::wire::wqe::{Opcode, QueueSel, RecvWqe, Wqe, WqeFlags, MAX_RECV_SGES};
use rdma_sys::*;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ptr;
use std::time::{Duration, Instant};

/// wr_id of the backend's own teardown invalidations.
const TEARDOWN_WR_ID: u64 = u64::MAX;
/// wr_id of the marker [`VerbsBackend::revive_qp`] posts on a QP in ERR.
const FLUSH_MARKER_ID: u64 = u64::MAX - 1;

/// Send/receive queue depths of every QP this backend creates.
pub const SEND_DEPTH: u32 = 256;
pub const RECV_DEPTH: u32 = 64;
const RD_ATOMIC: u8 = 16;

/// Anonymous memory owned by the backend (mmap'd, zeroed, page-aligned).
struct Region {
    map: *mut libc::c_void,
    map_len: usize,
    /// The usable, aligned part.
    addr: u64,
    len: u64,
}

struct MrEntry {
    mr: *mut ibv_mr,
    addr: u64,
    len: u64,
    keys: MrKeys,
    access: AccessFlags,
}

/// A registration as the backend made it (for audits: which MN memory carries which rights).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MrRecord {
    pub addr: u64,
    pub len: u64,
    pub keys: MrKeys,
    pub access: AccessFlags,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Binding {
    pub qpn: u32,
    pub addr: u64,
    pub len: u64,
    pub lkey: u32,
}

struct MwEntry {
    mw: *mut ibv_mw,
    /// The key the window has (bound) or had last (unbound): the handle of the next bind.
    rkey: Rkey,
    bound: Option<Binding>,
}

#[derive(Clone, Copy, Debug)]
enum Effect {
    None,
    /// Undo: restore the window's rkey and binding.
    Mw {
        index: u32,
        old_rkey: Rkey,
        old_bound: Option<Binding>,
    },
}

struct Pending {
    /// The QP the caller posted to: its completion is reported there even when the WR ran
    /// on another QP (BIND_MW on the target QP, UNBIND on the bound QP).
    report_to: u32,
    internal: u64,
    user: u64,
    opcode: Opcode,
    effect: Effect,
    rolled_back: bool,
}

/// How a QP was connected, so `reset_qp` can bring it back.
#[derive(Clone, Copy)]
enum Link {
    /// Raw loopback pair on this device: the peer QP is ours too.
    Loopback { peer: u32 },
    /// Connected through rdma_cm to another process/host.
    Cm { id: *mut rdma_cm_id },
}

struct QpEntry {
    qp: *mut ibv_qp,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    link: Link,
    pending: VecDeque<Pending>,
    errored: bool,
    /// Send completions that belong to this QP's caller but were reaped from another CQ.
    stash: VecDeque<Completion>,
}

/// The libibverbs backend: one device context, one PD, and everything created on them.
pub struct VerbsBackend {
    // field order does not matter: Drop tears down explicitly
    ctx: Context,
    pd: *mut ibv_pd,
    caps: Capabilities,
    /// [`Self::set_probed`] ran: `caps` says whether LOCAL_INV must run on the bound QP.
    probed: bool,
    regions: Vec<Region>,
    mrs: BTreeMap<u32, MrEntry>,
    mws: HashMap<u32, MwEntry>,
    qps: HashMap<u32, QpEntry>,
    next_wr: u64,
    /// rdma_cm: the event channel, its ids and pending requests (closed in Drop after the QPs).
    pub(crate) cm: crate::cm_event::CmChannel,
    /// Windows given up at teardown (deallocated because they could not be invalidated).
    lost_windows: Vec<Rkey>,
    /// Tests only: act as if every teardown invalidation failed.
    fail_teardown_invalidation: bool,
    /// Event-driven completions (a CN's): the CQs made after it was enabled report on it.
    comp: Option<crate::notify::CompChannel>,
    /// The completion channel and the rdma_cm channel as one fd.
    events: Option<crate::notify::EventFd>,
    /// rdma_cm reported one of this backend's connections gone.
    disconnected: bool,
    /// A CN's: what a rejoin of one of its chain connections needs (`crate::rejoin`; None:
    /// no MN session, or one whose welcome named no rejoin ticket).
    rejoiner: Option<crate::rejoin::Rejoiner>,
}

// SAFETY: the backend's raw pointers are libibverbs and librdmacm objects it alone owns and
// uses through `&mut self` (or `&self` for queries); libibverbs objects may be used from any
// thread (rdma-core documents its verbs as thread-safe), so moving the whole backend to another
// thread is sound. It is not `Sync`: two threads never use it at once.
unsafe impl Send for VerbsBackend {}

impl std::fmt::Debug for VerbsBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsBackend")
            .field("device", &self.ctx.info.name)
            .field("caps", &self.caps)
            .field("qps", &self.qps.len())
            .field("mws", &self.mws.len())
            .field("mrs", &self.mrs.len())
            .finish()
    }
}

impl VerbsBackend {
    /// Open `device` (or the first with an ACTIVE port, preferring one that advertises type-2
    /// windows) and allocate a PD. Declares only the capabilities the device attributes prove;
    /// [`Self::set_probed`] adds the MW semantics. Nothing is refused on an attribute flag:
    /// the probe decides.
    pub fn open(device: Option<&str>) -> Result<Self> {
        Self::open_choice(&DeviceChoice::named(device))
    }

    /// For a CN (only the MN binds windows; the same rules apply).
    pub fn open_cn(device: Option<&str>) -> Result<Self> {
        Self::open(device)
    }

    /// Open with a device and GID choice (`--device`, `--gid-index`).
    pub fn open_choice(choice: &DeviceChoice) -> Result<Self> {
        let ctx = Context::open(choice)?;
        let pd = ctx.alloc_pd()?;
        let caps = ctx.info.declared_capabilities();
        Ok(VerbsBackend {
            ctx,
            pd,
            caps,
            probed: false,
            regions: Vec::new(),
            mrs: BTreeMap::new(),
            mws: HashMap::new(),
            qps: HashMap::new(),
            next_wr: 1,
            cm: crate::cm_event::CmChannel::default(),
            lost_windows: Vec::new(),
            fail_teardown_invalidation: false,
            comp: None,
            events: None,
            disconnected: false,
            rejoiner: None,
        })
    }

    // ---------------------------------------------------------------- event-driven completions

    /// Put the CQs made from now on on a completion channel, and make the event fd
    /// ([`Self::event_fd`]): readable when a completion event or an rdma_cm event waits. Call it
    /// before creating QPs (a CN: before it connects).
    pub fn enable_completion_events(&mut self) -> Result<()> {
        if self.comp.is_some() {
            return Ok(());
        }
        let comp = crate::notify::CompChannel::create(self.ctx.ctx)?;
        let cm = self.cm.channel_ptr()?;
        // SAFETY: the rdma_cm channel is live (created above if it was not).
        let cm_fd = unsafe { (*cm).fd };
        let events = crate::notify::EventFd::watching(&[comp.fd(), cm_fd])
            .map_err(|e| VerbsError::Config(format!("the CN's event fd (epoll): {e}")))?;
        self.comp = Some(comp);
        self.events = Some(events);
        Ok(())
    }

    /// A handle on the event fd ([`Self::enable_completion_events`] first).
    pub fn event_fd(&self) -> Result<crate::notify::EventFd> {
        let e = self.events.as_ref().ok_or(VerbsError::Unsupported("completion events were not enabled"))?;
        e.try_clone().map_err(|e| VerbsError::Config(format!("duplicating the event fd: {e}")))
    }

    /// Ask for an event at the next completion of every CQ (`ibv_req_notify_cq`).
    pub fn arm_completion_events(&mut self) -> Result<()> {
        if self.comp.is_none() {
            return Err(VerbsError::Unsupported("completion events were not enabled"));
        }
        for e in self.qps.values() {
            crate::notify::CompChannel::arm(e.send_cq)?;
            crate::notify::CompChannel::arm(e.recv_cq)?;
        }
        Ok(())
    }

    /// Take (and acknowledge) every completion event and rdma_cm event waiting, without
    /// blocking. Returns whether the connection is lost: rdma_cm reported one of this
    /// backend's connections disconnected (the MN went away). Its QPs are then moved to the
    /// error state (`rdma_disconnect`), so every work request still posted completes
    /// (flushed) promptly instead of waiting for the transport's retries.
    pub fn take_completion_events(&mut self) -> Result<bool> {
        if let Some(c) = &self.comp {
            c.drain();
        }
        while let Some(ev) = self.cm.poll(Duration::ZERO)? {
            use crate::cm_event::CmEventKind;
            // only a connection this backend still has: one a rejoin replaced (its QP destroyed,
            // its id with it) ends without the MN going away
            let ours = self.qps.values().any(|e| matches!(e.link, Link::Cm { id } if id == ev.id.0));
            if matches!(ev.kind, CmEventKind::Disconnected | CmEventKind::Error(_)) && ours && !self.disconnected {
                self.disconnected = true;
                for e in self.qps.values() {
                    if let Link::Cm { id } = e.link {
                        // SAFETY: id is a live rdma_cm id of this backend; disconnecting moves
                        // its QP to the error state (librdmacm) and frees nothing.
                        unsafe { rdma_disconnect(id) };
                    }
                }
            }
        }
        Ok(self.disconnected)
    }

    /// Keep what a rejoin of this CN's chain connections needs (`crate::cn::connect_queues`).
    pub fn set_rejoiner(&mut self, r: Option<crate::rejoin::Rejoiner>) {
        self.rejoiner = r;
    }

    /// What a rejoin of this CN's chain connections needs (`crate::cn`'s `rejoin_chain`).
    pub fn rejoiner(&self) -> Option<&crate::rejoin::Rejoiner> {
        self.rejoiner.as_ref()
    }

    /// The largest message one work request may carry on this port (`max_msg_sz`).
    pub fn max_message_len(&self) -> u64 {
        self.ctx.port_attr.max_msg_sz as u64
    }

    /// Register `len` bytes of the caller's memory at `addr` for local access (LOCAL_WRITE:
    /// READ results land there, WRITE sources are read there), not memory of this backend's.
    /// Registering itself touches nothing; the device writes there only for work requests
    /// naming the returned key, which the caller posts only while it holds the memory
    /// (omw-client's `LocalMr` owns or borrows it). Deregistered by [`Self::dereg_mr`] or at
    /// teardown.
    pub fn reg_user_mr(&mut self, addr: u64, len: u64) -> Result<MrKeys> {
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(VerbsError::BadAddress { addr, len });
        }
        // SAFETY: pd is live; the kernel validates and pins the range (EFAULT if it is not
        // mapped); nothing is written to it by this call.
        let mr = unsafe { crate::device::reg_mr(self.pd, addr, len, AccessFlags::LOCAL_WRITE) }?;
        // SAFETY: mr is a live MR just returned.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        self.mrs.insert(lkey, MrEntry { mr, addr, len, keys: MrKeys { lkey, rkey }, access: AccessFlags::LOCAL_WRITE });
        Ok(MrKeys { lkey, rkey })
    }

    pub fn device_name(&self) -> &str {
        &self.ctx.info.name
    }
    pub fn device_info(&self) -> &crate::device::DeviceInfo {
        &self.ctx.info
    }
    /// The source GID raw QPs use.
    pub fn gid_index(&self) -> u8 {
        self.ctx.gid.index
    }
    pub fn gid(&self) -> GidEntry {
        self.ctx.gid
    }
    /// The port in use, as queried at open.
    pub fn port_attr(&self) -> PortAttr {
        self.ctx.port_attr
    }
    pub(crate) fn raw_context(&self) -> *mut ibv_context {
        self.ctx.ctx
    }

    /// Add the capabilities a probe established (and drop those it refuted).
    pub fn set_probed(&mut self, probed: Capabilities) {
        let semantic = Capabilities::MW_QP_BINDING_ENFORCED
            | Capabilities::MW_ATOMICS
            | Capabilities::MW_BOUNDS_ENFORCED
            | Capabilities::MW_QP_CHECK_ON_INVALIDATE;
        self.caps = (self.caps - semantic) | (probed & semantic);
        self.probed = true;
    }

    // ---------------------------------------------------------------- memory

    /// Allocate `len` bytes of zeroed memory aligned to `align` (a power of two), owned by the
    /// backend until it drops. Returns its address.
    pub fn alloc_region(&mut self, len: u64, align: u64) -> Result<u64> {
        let page = 4096u64;
        let align = align.max(page);
        if !align.is_power_of_two() || len == 0 {
            return Err(VerbsError::Config(format!("bad region request: {len} bytes aligned to {align}")));
        }
        let map_len = len
            .checked_add(align - page)
            .and_then(|v| v.checked_next_multiple_of(page))
            .ok_or(VerbsError::BadAddress { addr: 0, len })? as usize;
        // SAFETY: an anonymous private mapping with no address hint; checked for MAP_FAILED.
        let map = unsafe {
            libc::mmap(
                ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(VerbsError::last("mmap"));
        }
        let addr = (map as u64).next_multiple_of(align);
        self.regions.push(Region { map, map_len, addr, len });
        Ok(addr)
    }

    fn owned(&self, addr: u64, len: u64) -> Result<()> {
        let ok = self.regions.iter().any(|r| addr >= r.addr && len <= r.len && addr - r.addr <= r.len - len);
        if ok {
            Ok(())
        } else {
            Err(VerbsError::BadAddress { addr, len })
        }
    }

    /// A slice view of owned memory (for the CN's buffers and tests).
    /// Every memory region registered through this backend, with the rights it was given.
    pub fn mrs(&self) -> Vec<MrRecord> {
        self.mrs.values().map(|m| MrRecord { addr: m.addr, len: m.len, keys: m.keys, access: m.access }).collect()
    }

    pub fn slice(&self, addr: u64, len: usize) -> Result<&[u8]> {
        self.owned(addr, len as u64)?;
        // SAFETY: the range lies inside a live mapping owned by self (checked above); the NIC
        // may write it concurrently, which for plain bytes is a data race only in the sense
        // that values may be stale — the same contract as any RDMA buffer.
        Ok(unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
    }

    /// Deregister an MR (refused while a window is bound in it).
    pub fn dereg_mr(&mut self, lkey: u32) -> Result<()> {
        if self.mws.values().any(|m| m.bound.map(|b| b.lkey) == Some(lkey)) {
            return Err(VerbsError::Config(format!("MR {lkey:#x} still has bound windows")));
        }
        let e = self.mrs.remove(&lkey).ok_or(VerbsError::UnknownMr(lkey))?;
        // SAFETY: e.mr is a live MR of this backend, removed from the table so never reused.
        let rc = unsafe { ibv_dereg_mr(e.mr) };
        if rc != 0 {
            return Err(VerbsError::rc("ibv_dereg_mr", rc));
        }
        Ok(())
    }

    // ---------------------------------------------------------------- QPs

    fn create_cq(&self, depth: u32) -> Result<*mut ibv_cq> {
        let ch = self.comp.as_ref().map_or(ptr::null_mut(), |c| c.ptr());
        // SAFETY: ctx is open; the completion channel, if any, is live and outlives the CQ
        // (Drop destroys CQs before it); no context pointer.
        let cq = unsafe { ibv_create_cq(self.ctx.ctx, depth as i32, ptr::null_mut(), ch, 0) };
        if cq.is_null() {
            return Err(VerbsError::last("ibv_create_cq"));
        }
        Ok(cq)
    }

    fn qp_init_attr(send_cq: *mut ibv_cq, recv_cq: *mut ibv_cq) -> ibv_qp_init_attr {
        // SAFETY: ibv_qp_init_attr is plain data; all-zero is a valid starting value.
        let mut ia: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        ia.send_cq = send_cq;
        ia.recv_cq = recv_cq;
        ia.qp_type = ibv_qp_type::IBV_QPT_RC;
        ia.sq_sig_all = 0;
        ia.cap.max_send_wr = SEND_DEPTH;
        ia.cap.max_recv_wr = RECV_DEPTH;
        ia.cap.max_send_sge = 1;
        ia.cap.max_recv_sge = MAX_RECV_SGES as u32;
        ia
    }

    fn destroy_cqs(send_cq: *mut ibv_cq, recv_cq: *mut ibv_cq) {
        // SAFETY: the CQs are ours and no QP uses them any more.
        unsafe {
            if !send_cq.is_null() {
                ibv_destroy_cq(send_cq);
            }
            if !recv_cq.is_null() {
                ibv_destroy_cq(recv_cq);
            }
        }
    }

    fn modify_to_init(qp: *mut ibv_qp, port: u8) -> Result<()> {
        // SAFETY: qp is live; attr is plain data with the fields the mask names set.
        unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_INIT;
            a.port_num = port;
            a.pkey_index = 0;
            a.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ibv_access_flags::IBV_ACCESS_REMOTE_READ
                | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
                | ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC)
                .0;
            let m = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
            let rc = ibv_modify_qp(qp, &mut a, m.0 as i32);
            if rc != 0 {
                return Err(VerbsError::rc("ibv_modify_qp(INIT)", rc));
            }
        }
        Ok(())
    }

    /// INIT → RTR → RTS towards `dest`, a QP on this very port (loopback pairs): addressed by
    /// LID on InfiniBand, by GID on RoCE ([`port::address`]), at the port's active MTU.
    fn modify_to_rts(&self, qp: *mut ibv_qp, dest: u32) -> Result<()> {
        let pa = self.ctx.port_attr;
        let peer = Peer { lid: pa.lid, gid: self.ctx.gid.gid };
        let av = port::address(&pa, &self.ctx.gid, &peer).map_err(VerbsError::Port)?;
        let mtu = port::path_mtu(&pa, None).map_err(VerbsError::Port)?;
        // SAFETY: qp is live and in INIT; attrs are plain data with the masked fields set.
        unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_RTR;
            a.path_mtu = mtu.raw();
            a.dest_qp_num = dest;
            a.rq_psn = 0;
            a.max_dest_rd_atomic = RD_ATOMIC;
            a.min_rnr_timer = 12;
            a.ah_attr.port_num = pa.port;
            match av {
                Addressing::Lid { dlid } => {
                    a.ah_attr.is_global = 0;
                    a.ah_attr.dlid = dlid;
                }
                Addressing::Global { dlid, dgid, sgid_index, hop_limit } => {
                    a.ah_attr.is_global = 1;
                    a.ah_attr.dlid = dlid;
                    a.ah_attr.grh.dgid = ibv_gid { raw: dgid };
                    a.ah_attr.grh.sgid_index = sgid_index;
                    a.ah_attr.grh.hop_limit = hop_limit;
                }
            }
            let m = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
            let rc = ibv_modify_qp(qp, &mut a, m.0 as i32);
            if rc != 0 {
                return Err(VerbsError::rc("ibv_modify_qp(RTR)", rc));
            }
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.qp_state = ibv_qp_state::IBV_QPS_RTS;
            a.timeout = 14;
            a.retry_cnt = 7;
            a.rnr_retry = 7;
            a.sq_psn = 0;
            a.max_rd_atomic = RD_ATOMIC;
            let m = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
            let rc = ibv_modify_qp(qp, &mut a, m.0 as i32);
            if rc != 0 {
                return Err(VerbsError::rc("ibv_modify_qp(RTS)", rc));
            }
        }
        Ok(())
    }

    fn raw_qp(&self) -> Result<(*mut ibv_qp, *mut ibv_cq, *mut ibv_cq)> {
        let scq = self.create_cq(SEND_DEPTH)?;
        let rcq = match self.create_cq(RECV_DEPTH) {
            Ok(c) => c,
            Err(e) => {
                Self::destroy_cqs(scq, ptr::null_mut());
                return Err(e);
            }
        };
        let mut ia = Self::qp_init_attr(scq, rcq);
        // SAFETY: pd is live; ia is fully initialised.
        let qp = unsafe { ibv_create_qp(self.pd, &mut ia) };
        if qp.is_null() {
            let e = VerbsError::last("ibv_create_qp");
            Self::destroy_cqs(scq, rcq);
            return Err(e);
        }
        if let Err(e) = Self::modify_to_init(qp, self.ctx.port_attr.port) {
            // SAFETY: qp was just created and is unused.
            unsafe { ibv_destroy_qp(qp) };
            Self::destroy_cqs(scq, rcq);
            return Err(e);
        }
        Ok((qp, scq, rcq))
    }

    fn qp_num(qp: *mut ibv_qp) -> u32 {
        // SAFETY: qp is a live QP; qp_num is set at creation.
        unsafe { (*qp).qp_num }
    }

    /// Two RC QPs on this device connected to each other (raw verbs, the device's own GID):
    /// what the probe, the tests and the benchmark use for fresh QP pairs.
    pub fn create_loopback_pair(&mut self) -> Result<(Qpn, Qpn)> {
        let (a, asc, arc) = self.raw_qp()?;
        let (b, bsc, brc) = match self.raw_qp() {
            Ok(x) => x,
            Err(e) => {
                // SAFETY: a is ours and unused.
                unsafe { ibv_destroy_qp(a) };
                Self::destroy_cqs(asc, arc);
                return Err(e);
            }
        };
        let (an, bn) = (Self::qp_num(a), Self::qp_num(b));
        let r = self.modify_to_rts(a, bn).and_then(|_| self.modify_to_rts(b, an));
        for (qp, sc, rc, peer) in [(a, asc, arc, bn), (b, bsc, brc, an)] {
            self.qps.insert(
                Self::qp_num(qp),
                QpEntry {
                    qp,
                    send_cq: sc,
                    recv_cq: rc,
                    link: Link::Loopback { peer },
                    pending: VecDeque::new(),
                    errored: false,
                    stash: VecDeque::new(),
                },
            );
        }
        if let Err(e) = r {
            let _ = self.teardown_qp(Qpn::new(an).unwrap_or_default());
            let _ = self.teardown_qp(Qpn::new(bn).unwrap_or_default());
            return Err(e);
        }
        Ok((qpn(an)?, qpn(bn)?))
    }

    /// Create the QP of an rdma_cm id (on this backend's PD, with its own CQs) and track it.
    pub(crate) fn create_cm_qp(&mut self, id: *mut rdma_cm_id) -> Result<Qpn> {
        // SAFETY: id is a live cm id whose verbs context is checked to be ours.
        unsafe {
            if (*id).verbs != self.ctx.ctx {
                return Err(VerbsError::Config(format!(
                    "the rdma_cm connection runs over another RDMA device than {} (pass --device to pick the one that owns the address)",
                    self.ctx.info.name
                )));
            }
        }
        let scq = self.create_cq(SEND_DEPTH)?;
        let rcq = match self.create_cq(RECV_DEPTH) {
            Ok(c) => c,
            Err(e) => {
                Self::destroy_cqs(scq, ptr::null_mut());
                return Err(e);
            }
        };
        let mut ia = Self::qp_init_attr(scq, rcq);
        // SAFETY: id and pd are live and on the same context (checked above).
        let rc = unsafe { rdma_create_qp(id, self.pd, &mut ia) };
        if rc != 0 {
            let e = VerbsError::rc("rdma_create_qp", rc);
            Self::destroy_cqs(scq, rcq);
            return Err(e);
        }
        // SAFETY: rdma_create_qp succeeded, so id->qp is the new QP.
        let qp = unsafe { (*id).qp };
        let n = Self::qp_num(qp);
        self.qps.insert(
            n,
            QpEntry {
                qp,
                send_cq: scq,
                recv_cq: rcq,
                link: Link::Cm { id },
                pending: VecDeque::new(),
                errored: false,
                stash: VecDeque::new(),
            },
        );
        qpn(n)
    }

    /// Set the RNR NAK timer a connected QP advertises as a responder (RTS → RTS). The
    /// kernel's IB CM leaves it 0 on rdma_cm QPs — encoded 0 is the *longest* delay, 655 ms —
    /// so a SEND that finds no receive posted yet waits that long before its retry. 12 is
    /// 0.64 ms (IBA table 45), what this backend's raw QPs use.
    pub(crate) fn set_min_rnr_timer(&mut self, q: Qpn, timer: u8) -> Result<()> {
        let e = self.qps.get(&q.get()).ok_or(VerbsError::UnknownQp(q.get()))?;
        // SAFETY: e.qp is live and in RTS; attr is plain data with the masked field set.
        let rc = unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            a.min_rnr_timer = timer;
            ibv_modify_qp(e.qp, &mut a, ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0 as i32)
        };
        if rc != 0 {
            return Err(VerbsError::rc("ibv_modify_qp(MIN_RNR_TIMER)", rc));
        }
        Ok(())
    }

    /// The remote QP number a connected QP of this backend sends to (`ibv_query_qp`).
    pub fn dest_qpn(&self, q: Qpn) -> Option<Qpn> {
        let e = self.qps.get(&q.get())?;
        // SAFETY: e.qp is live; attr/init_attr are plain data ibv_query_qp fills.
        let n = unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            let mut ia: ibv_qp_init_attr = std::mem::zeroed();
            if ibv_query_qp(e.qp, &mut a, ibv_qp_attr_mask::IBV_QP_DEST_QPN.0 as i32, &mut ia) != 0 {
                return None;
            }
            a.dest_qp_num
        };
        Qpn::new(n).ok().filter(|q| q.get() != 0)
    }

    /// The rdma_cm id of a QP created by [`Self::create_cm_qp`].
    pub(crate) fn cm_id_of(&self, q: Qpn) -> Option<*mut rdma_cm_id> {
        match self.qps.get(&q.get())?.link {
            Link::Cm { id } => Some(id),
            Link::Loopback { .. } => None,
        }
    }

    pub fn qpns(&self) -> Vec<Qpn> {
        let mut v: Vec<Qpn> = self.qps.keys().filter_map(|q| Qpn::new(*q).ok()).collect();
        v.sort();
        v
    }

    /// Destroy a QP (and its CQs; and its rdma_cm id). Windows still bound to it are
    /// invalidated and deallocated-safe first, so rxe never sees a QP die under a bound window.
    fn teardown_qp(&mut self, q: Qpn) -> Result<()> {
        if !self.qps.contains_key(&q.get()) {
            return Err(VerbsError::UnknownQp(q.get()));
        }
        let t0 = Instant::now();
        let slow = |what: &str, t: Instant| {
            let dt = t.elapsed();
            if dt > Duration::from_millis(200) {
                crate::log::log(
                    "omw_verbs::teardown",
                    "omw-verbs",
                    crate::log::Level::Warn,
                    &format!("QP {q}: {what} took {dt:?}"),
                );
            }
        };
        self.drain(q);
        let bound: Vec<u32> =
            self.mws.iter().filter(|(_, m)| m.bound.map(|b| b.qpn) == Some(q.get())).map(|(i, _)| *i).collect();
        for index in bound {
            self.invalidate_for_teardown(index);
        }
        slow("invalidating its windows", t0);
        let e = self.qps.remove(&q.get()).ok_or(VerbsError::UnknownQp(q.get()))?;
        // SAFETY: the QP is removed from the table; nothing posts to it any more.
        unsafe {
            match e.link {
                Link::Cm { id } => {
                    let t = Instant::now();
                    rdma_destroy_qp(id);
                    slow("rdma_destroy_qp", t);
                    let t = Instant::now();
                    rdma_destroy_id(id);
                    slow("rdma_destroy_id", t);
                }
                Link::Loopback { .. } => {
                    ibv_destroy_qp(e.qp);
                }
            }
        }
        Self::destroy_cqs(e.send_cq, e.recv_cq);
        Ok(())
    }

    // ---------------------------------------------------------------- windows

    /// The tracked state of a window: its current rkey and where it is bound.
    pub fn mw_state(&self, rkey: Rkey) -> Option<(Rkey, Option<Binding>)> {
        self.mws.get(&rkey.index()).map(|m| (m.rkey, m.bound))
    }

    /// Which QP a window is bound to (tracked).
    pub fn bound_qp(&self, rkey: Rkey) -> Option<Qpn> {
        self.mws.get(&rkey.index()).and_then(|m| m.bound).and_then(|b| Qpn::new(b.qpn).ok())
    }

    /// Invalidate a window before its QP is destroyed (teardown): an UNBIND, which
    /// [`Self::invalidate_target`] routes to a QP that can execute it, waited for (bounded:
    /// three attempts of at most 500 ms). True when the window is known unbound afterwards. If
    /// the device refused every attempt, the window is deallocated instead; only if that fails
    /// too is it marked unbound (so nothing posts a second invalidate) with a warning that the
    /// QP's destruction may stall.
    fn invalidate_for_teardown(&mut self, index: u32) -> bool {
        let attempts = if self.fail_teardown_invalidation { 0 } else { 3 };
        for _attempt in 0..attempts {
            let Some(m) = self.mws.get(&index) else { return true };
            let Some(b) = m.bound else { return true };
            let rkey = m.rkey;
            let Ok(on) = self.invalidate_target(b.qpn, b.qpn, true) else { break };
            let Ok(qn) = Qpn::new(on) else { break };
            let w = Wqe::unbind_mw(rkey.0).with_wr_id(TEARDOWN_WR_ID); // signaled
            if self.post_send(qn, &w).is_err() {
                break;
            }
            // a timeout leaves the optimistic "unbound": a late success needs nothing more
            if let Ok(c) = self.wait_send(qn, TEARDOWN_WR_ID, Duration::from_millis(500)) {
                if c.status.is_ok() {
                    return true;
                }
            }
        }
        let Some(m) = self.mws.get(&index) else { return true };
        let Some(b) = m.bound else { return true };
        let (mw, rkey) = (m.mw, m.rkey);
        // Fall back to deallocating the window: that revokes a bound window (mlx5 destroys its
        // mkey; rxe's rxe_mw_cleanup drops the QP and MR references and invalidates it), so no
        // bound window outlives its QP. The window is gone for good: a later bind of it fails
        // (UnknownMw), which fails that lap, not the MN.
        // SAFETY: mw is a live window of this backend; it leaves the table below, so it is
        // deallocated exactly once and never posted again.
        let rc = unsafe { ibv_dealloc_mw(mw) };
        if rc == 0 {
            self.mws.remove(&index);
            self.lost_windows.push(rkey);
            crate::log::log("omw_verbs::backend", "omw-verbs", crate::log::Level::Warn, &format!(
                "window {:#010x} could not be invalidated on QP {}; deallocated it instead (its group cannot be bound again until restart)",
                rkey.0, b.qpn
            ));
            return true;
        }
        if let Some(m) = self.mws.get_mut(&index) {
            m.bound = None;
        }
        crate::log::log("omw_verbs::backend", "omw-verbs", crate::log::Level::Warn, &format!(
            "window {:#010x} could neither be invalidated nor deallocated (errno {rc}); destroying QP {} may stall (rxe: ~51 s)",
            rkey.0, b.qpn
        ));
        false
    }

    /// For the device tests: make every teardown invalidation count as failed, so the
    /// deallocation fallback runs (a device that refuses LOCAL_INV cannot be had on demand).
    #[doc(hidden)]
    pub fn fail_teardown_invalidation_for_tests(&mut self) {
        self.fail_teardown_invalidation = true;
    }

    /// Windows deallocated because they could not be invalidated at teardown (a QP's
    /// destruction or the backend's drop), with their last keys.
    pub fn lost_windows(&self) -> &[Rkey] {
        &self.lost_windows
    }

    /// Post a signaled zero-length SEND on `q` (in ERR: it is flushed, never transmitted).
    fn post_flush_marker(&mut self, q: u32) -> Result<()> {
        let internal = self.next_wr;
        self.next_wr += 1;
        let e = self.entry(q)?;
        // SAFETY: ibv_send_wr is plain data; all-zero is "no SGE, no next"; e.qp is live.
        let rc = unsafe {
            let mut wr: ibv_send_wr = std::mem::zeroed();
            wr.wr_id = internal;
            wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            let mut bad: *mut ibv_send_wr = ptr::null_mut();
            ibv_post_send(e.qp, &mut wr, &mut bad)
        };
        if rc != 0 {
            return Err(VerbsError::rc("ibv_post_send", rc));
        }
        e.pending.push_back(Pending {
            report_to: q,
            internal,
            user: FLUSH_MARKER_ID,
            opcode: Opcode::Send,
            effect: Effect::None,
            rolled_back: false,
        });
        Ok(())
    }

    /// Bring QP `q` back to RTS in place (see `invalidate_target`): for executing a
    /// LOCAL_INV of a window bound to a QP in ERR on a device that accepts it only there.
    pub fn revive_qp(&mut self, q: Qpn) -> Result<()> {
        self.revive_raw(q.get())
    }

    /// Where a LOCAL_INV of a window bound to QP `bound` can run. A QP in ERR only flushes its
    /// work requests, so:
    /// 1. `bound` itself while it is in RTS;
    /// 2. on a device probed to let any QP invalidate a window (no `MW_QP_CHECK_ON_INVALIDATE`:
    ///    soft-RoCE, where `rxe_invalidate_mw` checks the rkey and the window's state but not
    ///    the QP), `caller` or else any other QP in RTS, loopback QPs (the MN's own) first;
    /// 3. otherwise, when `revive` (teardown: the QP is about to be destroyed), `bound` brought
    ///    back to RTS in place ([`Self::revive_qp`]);
    /// 4. otherwise `bound` as it is (the invalidate is flushed and rolled back; the window
    ///    stays bound until the QP's teardown revives it).
    fn invalidate_target(&mut self, bound: u32, caller: u32, revive: bool) -> Result<u32> {
        let rts = |b: &Self, q: u32| matches!(b.raw_state(q), Some(QpState::Rts));
        if !self.qps.contains_key(&bound) {
            return Err(VerbsError::UnknownQp(bound));
        }
        if rts(self, bound) {
            return Ok(bound);
        }
        if self.probed && !self.caps.contains(Capabilities::MW_QP_CHECK_ON_INVALIDATE) {
            if caller != bound && self.qps.contains_key(&caller) && rts(self, caller) {
                return Ok(caller);
            }
            let mut others: Vec<(bool, u32)> = self
                .qps
                .iter()
                .filter(|(q, _)| **q != bound && **q != caller)
                .map(|(q, e)| (!matches!(e.link, Link::Loopback { .. }), *q))
                .collect();
            others.sort_unstable();
            if let Some((_, q)) = others.into_iter().find(|(_, q)| rts(self, *q)) {
                return Ok(q);
            }
        }
        if revive {
            self.revive_raw(bound)?;
        }
        Ok(bound)
    }

    /// Bring one QP back to RTS **in place**, with the attributes it had (queried: path,
    /// remote QPN, PSNs, limits): ERR → RESET → INIT → RTR → RTS. Only for executing local work
    /// (LOCAL_INV) on a QP whose connection is dead anyway; the remote end is not touched.
    /// Completions still due (flushes) are settled first, and what never completed is rolled
    /// back: RESET discards the queues without completions.
    pub(crate) fn revive_raw(&mut self, q: u32) -> Result<()> {
        let e = self.qps.get(&q).ok_or(VerbsError::UnknownQp(q))?;
        let raw = e.qp;
        let qn = qpn(q)?;
        // Settle what is still due. In ERR every outstanding WR completes (flushed, signaled or
        // not), so a signaled marker posted now completes after all of them: once it is in,
        // the shadow queue holds nothing older. Bounded: 500 ms.
        if matches!(self.raw_state(q), Some(QpState::Err)) && self.post_flush_marker(q).is_ok() {
            let t0 = Instant::now();
            while self.qps.get(&q).is_some_and(|e| e.pending.iter().any(|p| p.user == FLUSH_MARKER_ID))
                && t0.elapsed() < Duration::from_millis(500)
            {
                self.drain(qn);
            }
        }
        self.drain(qn);
        // SAFETY: raw is a live QP of this backend; attr/init_attr are plain data the call fills.
        let a = unsafe {
            let mut a: ibv_qp_attr = std::mem::zeroed();
            let mut ia: ibv_qp_init_attr = std::mem::zeroed();
            let mask = ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY;
            let rc = ibv_query_qp(raw, &mut a, mask.0 as i32, &mut ia);
            if rc != 0 {
                return Err(VerbsError::rc("ibv_query_qp", rc));
            }
            a
        };
        let steps: [(ibv_qp_state::Type, ibv_qp_attr_mask, &'static str); 4] = [
            (ibv_qp_state::IBV_QPS_RESET, ibv_qp_attr_mask::IBV_QP_STATE, "ibv_modify_qp(RESET)"),
            (
                ibv_qp_state::IBV_QPS_INIT,
                ibv_qp_attr_mask::IBV_QP_STATE
                    | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                    | ibv_qp_attr_mask::IBV_QP_PORT
                    | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
                "ibv_modify_qp(INIT)",
            ),
            (
                ibv_qp_state::IBV_QPS_RTR,
                ibv_qp_attr_mask::IBV_QP_STATE
                    | ibv_qp_attr_mask::IBV_QP_AV
                    | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                    | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                    | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                    | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                    | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
                "ibv_modify_qp(RTR)",
            ),
            (
                ibv_qp_state::IBV_QPS_RTS,
                ibv_qp_attr_mask::IBV_QP_STATE
                    | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                    | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                    | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                    | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                    | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
                "ibv_modify_qp(RTS)",
            ),
        ];
        for (state, mask, call) in steps {
            // SAFETY: ibv_qp_attr is plain C data (no Drop, no ownership): a bitwise copy is a
            // valid, independent value.
            let mut attr: ibv_qp_attr = unsafe { ptr::read(&a) };
            attr.qp_state = state;
            // SAFETY: raw is live; attr carries the queried values of every field `mask` names.
            let rc = unsafe { ibv_modify_qp(raw, &mut attr, mask.0 as i32) };
            if rc != 0 {
                return Err(VerbsError::rc(call, rc));
            }
            if state == ibv_qp_state::IBV_QPS_RESET {
                // the queues are gone without completions: nothing pending will complete
                let undo: Vec<Effect> = match self.qps.get_mut(&q) {
                    Some(e) => {
                        let v = e.pending.iter_mut().rev().filter(|p| !p.rolled_back).map(|p| p.effect).collect();
                        e.pending.clear();
                        v
                    }
                    None => Vec::new(),
                };
                for u in undo {
                    self.rollback(u);
                }
            }
        }
        if let Some(e) = self.qps.get_mut(&q) {
            e.errored = false;
        }
        Ok(())
    }

    // ---------------------------------------------------------------- helpers

    /// Poll every CQ empty (completions are settled against the shadow queues and dropped).
    fn drain_all(&mut self) {
        let qs: Vec<Qpn> = self.qps.keys().filter_map(|q| Qpn::new(*q).ok()).collect();
        for q in qs {
            self.drain(q);
        }
    }

    fn drain(&mut self, q: Qpn) {
        let mut buf = [Completion::EMPTY; 16];
        for sel in [QueueSel::Recv, QueueSel::Send] {
            while matches!(self.poll_cq(q, sel, &mut buf), Ok(n) if n > 0) {}
        }
    }

    fn raw_state(&self, q: u32) -> Option<QpState> {
        let e = self.qps.get(&q)?;
        query_state(e.qp).ok()
    }

    /// Post `wqe` on `qp` and wait (busy-polling) for its completion. The WQE is forced
    /// signaled. Other completions of the same queue that arrive first are discarded.
    pub fn post_wait(&mut self, qp: Qpn, wqe: &Wqe, timeout: Duration) -> Result<Completion> {
        let w = wqe.with_flags(wqe.flags | WqeFlags::SIGNALED);
        self.post_send(qp, &w)?;
        self.wait_send(qp, w.wr_id, timeout)
    }

    /// Wait for the send completion with user wr_id `wr_id` on `qp`.
    pub fn wait_send(&mut self, qp: Qpn, wr_id: u64, timeout: Duration) -> Result<Completion> {
        let t0 = Instant::now();
        let mut buf = [Completion::EMPTY; 16];
        loop {
            let n = self.poll_cq(qp, QueueSel::Send, &mut buf)?;
            if let Some(c) = buf[..n].iter().find(|c| c.wr_id == wr_id) {
                return Ok(*c);
            }
            if t0.elapsed() > timeout {
                return Err(VerbsError::Timeout { what: format!("a send completion on QP {qp}") });
            }
            if n == 0 {
                std::hint::spin_loop();
            }
        }
    }

    /// Wait for the next receive completion on `qp`.
    pub fn wait_recv(&mut self, qp: Qpn, timeout: Duration) -> Result<Completion> {
        let t0 = Instant::now();
        let mut buf = [Completion::EMPTY; 1];
        loop {
            if self.poll_cq(qp, QueueSel::Recv, &mut buf)? == 1 {
                return Ok(buf[0]);
            }
            if t0.elapsed() > timeout {
                return Err(VerbsError::Timeout { what: format!("a receive completion on QP {qp}") });
            }
            std::hint::spin_loop();
        }
    }

    fn mr_ptr(&self, lkey: u32) -> Result<*mut ibv_mr> {
        self.mrs.get(&lkey).map(|m| m.mr).ok_or(VerbsError::UnknownMr(lkey))
    }

    fn entry(&mut self, q: u32) -> Result<&mut QpEntry> {
        self.qps.get_mut(&q).ok_or(VerbsError::UnknownQp(q))
    }

    fn translate_send(&mut self, qp: Qpn, w: &Wqe) -> Result<(u32, ibv_send_wr, ibv_sge, Effect)> {
        // SAFETY: ibv_send_wr / ibv_sge are plain data (pointers, integers and unions of them);
        // all-zero is the documented "unused" value of every field.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        let mut sge = ibv_sge { addr: w.local_addr, length: w.length, lkey: w.lkey };
        let mut flags = 0u32;
        if w.flags.contains(WqeFlags::SIGNALED) {
            flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
        }
        if w.flags.contains(WqeFlags::FENCE) {
            flags |= ibv_send_flags::IBV_SEND_FENCE.0;
        }
        if w.flags.contains(WqeFlags::SOLICITED) {
            flags |= ibv_send_flags::IBV_SEND_SOLICITED.0;
        }
        wr.send_flags = flags;
        let mut post_on = qp.get();
        let mut effect = Effect::None;
        let use_sge = |wr: &mut ibv_send_wr, len: u32| {
            wr.num_sge = if len == 0 { 0 } else { 1 };
        };
        match w.opcode {
            Opcode::Send => {
                wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
                use_sge(&mut wr, w.length);
            }
            Opcode::SendWithImm => {
                wr.opcode = ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
                wr.imm_data_invalidated_rkey_union.imm_data = w.imm.to_be();
                use_sge(&mut wr, w.length);
            }
            Opcode::SendWithInv => {
                wr.opcode = ibv_wr_opcode::IBV_WR_SEND_WITH_INV;
                wr.imm_data_invalidated_rkey_union.invalidated_rkey = w.imm;
                use_sge(&mut wr, w.length);
            }
            Opcode::Write | Opcode::WriteWithImm | Opcode::Read => {
                wr.opcode = match w.opcode {
                    Opcode::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                    Opcode::WriteWithImm => {
                        wr.imm_data_invalidated_rkey_union.imm_data = w.imm.to_be();
                        ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
                    }
                    _ => ibv_wr_opcode::IBV_WR_RDMA_READ,
                };
                wr.wr.rdma = rdma_t { remote_addr: w.remote_addr, rkey: w.rkey };
                use_sge(&mut wr, w.length);
            }
            Opcode::FetchAdd | Opcode::CompareSwap => {
                wr.opcode = if w.opcode == Opcode::FetchAdd {
                    ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD
                } else {
                    ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP
                };
                wr.wr.atomic =
                    atomic_t { remote_addr: w.remote_addr, compare_add: w.operand0, swap: w.operand1, rkey: w.rkey };
                sge.length = 8;
                wr.num_sge = 1;
            }
            Opcode::BindMw if w.flags.contains(WqeFlags::UNBIND) => {
                // no UMR "free" form in libibverbs: LOCAL_INV, on the QP the window is bound to
                // while that QP can execute it, else where the device allows (invalidate_target)
                let index = Rkey(w.imm).index();
                let m = self.mws.get(&index).ok_or(VerbsError::UnknownMw(w.imm))?;
                let b = m.bound.ok_or(VerbsError::NotBound(w.imm))?;
                if m.rkey.0 != w.imm {
                    // bound under another key: this rkey names nothing the device would accept
                    return Err(VerbsError::NotBound(w.imm));
                }
                post_on = self.invalidate_target(b.qpn, qp.get(), false)?;
                let m = self.mws.get_mut(&index).ok_or(VerbsError::UnknownMw(w.imm))?;
                effect = Effect::Mw { index, old_rkey: m.rkey, old_bound: m.bound };
                m.bound = None;
                wr.opcode = ibv_wr_opcode::IBV_WR_LOCAL_INV;
                wr.imm_data_invalidated_rkey_union.invalidated_rkey = w.imm;
                wr.send_flags &= !ibv_send_flags::IBV_SEND_SOLICITED.0;
            }
            Opcode::LocalInv => {
                let index = Rkey(w.imm).index();
                let m = self.mws.get_mut(&index).ok_or(VerbsError::UnknownMw(w.imm))?;
                if m.bound.is_none() {
                    return Err(VerbsError::NotBound(w.imm));
                }
                effect = Effect::Mw { index, old_rkey: m.rkey, old_bound: m.bound };
                m.bound = None;
                wr.opcode = ibv_wr_opcode::IBV_WR_LOCAL_INV;
                wr.imm_data_invalidated_rkey_union.invalidated_rkey = w.imm;
            }
            Opcode::BindMw => {
                // posted on the QP the window will be bound to (no BIND_TO_OTHER_QP here)
                let new = Rkey(w.imm);
                let mr = self.mr_ptr(w.lkey)?;
                if !self.qps.contains_key(&w.qpn) {
                    return Err(VerbsError::UnknownQp(w.qpn));
                }
                post_on = w.qpn;
                let m = self.mws.get_mut(&new.index()).ok_or(VerbsError::UnknownMw(w.imm))?;
                effect = Effect::Mw { index: new.index(), old_rkey: m.rkey, old_bound: m.bound };
                // the provider sends mw->rkey as the handle: it must be the current key
                // SAFETY: m.mw is a live window of this backend; rkey is a plain field the
                // provider reads when the WR is posted (nobody else writes it).
                unsafe { (*m.mw).rkey = m.rkey.0 };
                wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
                wr.bind_mw_tso_union.bind_mw = bind_mw_t {
                    mw: m.mw,
                    rkey: new.0,
                    bind_info: ibv_mw_bind_info {
                        mr,
                        addr: w.local_addr,
                        length: w.length as u64,
                        mw_access_flags: w.access().bits(),
                    },
                };
                m.rkey = new;
                m.bound = Some(Binding { qpn: w.qpn, addr: w.local_addr, len: w.length as u64, lkey: w.lkey });
            }
            Opcode::MaskedFetchAdd => {
                return Err(VerbsError::Unsupported("masked fetch-and-add (mlx5 extended atomics)"))
            }
            Opcode::Wait | Opcode::Enable => {
                return Err(VerbsError::Unsupported("WAIT/ENABLE (CORE-Direct is not in upstream libibverbs)"))
            }
            Opcode::Nop => return Err(VerbsError::Unsupported("NOP work request")),
        }
        Ok((post_on, wr, sge, effect))
    }

    fn rollback(&mut self, effect: Effect) {
        if let Effect::Mw { index, old_rkey, old_bound } = effect {
            if let Some(m) = self.mws.get_mut(&index) {
                m.rkey = old_rkey;
                m.bound = old_bound;
            }
        }
    }

    /// Account a send completion against the QP's shadow queue; returns the user wr_id and
    /// the canonical opcode.
    fn settle(&mut self, q: u32, internal: u64, status: WcStatus) -> (u64, Opcode, u32) {
        let Some(e) = self.qps.get_mut(&q) else {
            return (internal, Opcode::Nop, q);
        };
        let Some(pos) = e.pending.iter().position(|p| p.internal == internal) else {
            return (internal, Opcode::Nop, q);
        };
        let mut undo = Vec::new();
        if !status.is_ok() {
            // The failing WR and every later one will not take effect: undo newest first.
            // This holds for *every* error completion, not only the first: a WR posted after
            // the QP went to ERR (a retried LOCAL_INV, say) completes flushed, and its
            // optimistic effect must go too — otherwise the tracking calls a window unbound
            // that the device still has bound to this QP (and destroying the QP then stalls
            // ~51 s in rxe).
            e.errored = true;
            for p in e.pending.iter_mut().skip(pos).rev() {
                if !p.rolled_back {
                    p.rolled_back = true;
                    undo.push(p.effect);
                }
            }
        }
        let mut out = (internal, Opcode::Nop, q);
        for _ in 0..=pos {
            if let Some(p) = e.pending.pop_front() {
                out = (p.user, p.opcode, p.report_to);
            }
        }
        for u in undo {
            self.rollback(u);
        }
        out
    }
}

fn qpn(v: u32) -> Result<Qpn> {
    Qpn::new(v).map_err(|_| VerbsError::UnknownQp(v))
}

fn query_state(qp: *mut ibv_qp) -> Result<QpState> {
    // SAFETY: qp is live; attr/init_attr are plain data ibv_query_qp fills.
    unsafe {
        let mut a: ibv_qp_attr = std::mem::zeroed();
        let mut ia: ibv_qp_init_attr = std::mem::zeroed();
        let rc = ibv_query_qp(qp, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32, &mut ia);
        if rc != 0 {
            return Err(VerbsError::rc("ibv_query_qp", rc));
        }
        Ok(match a.qp_state {
            ibv_qp_state::IBV_QPS_RESET => QpState::Reset,
            ibv_qp_state::IBV_QPS_INIT => QpState::Init,
            ibv_qp_state::IBV_QPS_RTR => QpState::Rtr,
            ibv_qp_state::IBV_QPS_RTS => QpState::Rts,
            ibv_qp_state::IBV_QPS_SQD => QpState::Sqd,
            ibv_qp_state::IBV_QPS_SQE => QpState::Sqe,
            _ => QpState::Err,
        })
    }
}

impl DataPath for VerbsBackend {
    type Error = VerbsError;
    fn capabilities(&self) -> Capabilities {
        self.caps
    }
    /// BIND_MW is posted on the QP named by `wqe.qpn` (its completion appears there); an
    /// UNBIND becomes LOCAL_INV on the QP the window is bound to; everything else on `qp`.
    fn post_send(&mut self, qp: Qpn, wqe: &Wqe) -> Result<()> {
        if !self.qps.contains_key(&qp.get()) {
            return Err(VerbsError::UnknownQp(qp.get()));
        }
        let (post_on, mut wr, mut sge, effect) = self.translate_send(qp, wqe)?;
        let internal = self.next_wr;
        self.next_wr += 1;
        wr.wr_id = internal;
        if wr.num_sge > 0 {
            wr.sg_list = &mut sge;
        }
        let e = match self.qps.get_mut(&post_on) {
            Some(e) => e,
            None => {
                self.rollback(effect);
                return Err(VerbsError::UnknownQp(post_on));
            }
        };
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: e.qp is live; wr (and sge, which outlives the call) is fully initialised;
        // the provider copies the WR before returning.
        let rc = unsafe { ibv_post_send(e.qp, &mut wr, &mut bad) };
        if rc != 0 {
            self.rollback(effect);
            return Err(VerbsError::rc("ibv_post_send", rc));
        }
        e.pending.push_back(Pending {
            report_to: qp.get(),
            internal,
            user: wqe.wr_id,
            opcode: wqe.opcode,
            effect,
            rolled_back: false,
        });
        // unsignaled WRs never produce a completion on success: keep the shadow bounded
        while e.pending.len() > 4 * SEND_DEPTH as usize {
            e.pending.pop_front();
        }
        Ok(())
    }
    fn post_recv(&mut self, qp: Qpn, wqe: &RecvWqe) -> Result<()> {
        let e = self.entry(qp.get())?;
        let mut sges: Vec<ibv_sge> =
            wqe.sges.iter().map(|s| ibv_sge { addr: s.addr, length: s.length, lkey: s.lkey }).collect();
        let mut wr = ibv_recv_wr {
            wr_id: wqe.wr_id,
            next: ptr::null_mut(),
            sg_list: if sges.is_empty() { ptr::null_mut() } else { sges.as_mut_ptr() },
            num_sge: sges.len() as i32,
        };
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        // SAFETY: e.qp is live; wr and the sge array outlive the call.
        let rc = unsafe { ibv_post_recv(e.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::rc("ibv_post_recv", rc));
        }
        Ok(())
    }
    fn poll_cq(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize> {
        if queue == QueueSel::Recv {
            return self.poll_raw(qp, queue, out);
        }
        self.entry(qp.get())?;
        // completions of WRs posted to `qp` may sit in another QP's CQ (redirected posts)
        let mut sources = vec![qp.get()];
        for (n, e) in &self.qps {
            if *n != qp.get() && e.pending.iter().any(|p| p.report_to == qp.get()) {
                sources.push(*n);
            }
        }
        let mut buf = [Completion::EMPTY; 16];
        for src in sources {
            let Ok(sq) = Qpn::new(src) else { continue };
            let n = self.poll_raw(sq, QueueSel::Send, &mut buf)?;
            for c in &buf[..n] {
                let to = c.qpn.get();
                if let Some(e) = self.qps.get_mut(&to) {
                    e.stash.push_back(*c);
                }
            }
        }
        let e = self.entry(qp.get())?;
        let mut k = 0;
        while k < out.len() {
            let Some(c) = e.stash.pop_front() else { break };
            out[k] = c;
            k += 1;
        }
        if crate::log::enabled("omw_verbs::cq", crate::log::Level::Trace) {
            for c in &out[..k] {
                crate::log::log(
                    "omw_verbs::cq",
                    "omw-verbs",
                    crate::log::Level::Trace,
                    &format!("QP {qp} send: {c:?}"),
                );
            }
        }
        Ok(k)
    }
    fn enable(&mut self, _qp: Qpn, _queue: QueueSel, _count: u64) -> Result<()> {
        Err(VerbsError::Unsupported("ENABLE (managed queues are a vendor extension)"))
    }
    /// Loopback pairs only: both ends go RESET → INIT → RTR → RTS with empty queues. An
    /// rdma_cm connection cannot be revived from one side: the peer reconnects instead.
    fn reset_qp(&mut self, qp: Qpn) -> Result<()> {
        let e = self.qps.get(&qp.get()).ok_or(VerbsError::UnknownQp(qp.get()))?;
        let peer = match e.link {
            Link::Loopback { peer } => peer,
            Link::Cm { .. } => {
                return Err(VerbsError::Unsupported("resetting an rdma_cm-connected QP (the CN reconnects instead)"))
            }
        };
        for (q, dest) in [(qp.get(), peer), (peer, qp.get())] {
            let Some(e) = self.qps.get(&q) else { continue };
            let raw = e.qp;
            // SAFETY: raw is live; moving to RESET only needs the state field.
            unsafe {
                let mut a: ibv_qp_attr = std::mem::zeroed();
                a.qp_state = ibv_qp_state::IBV_QPS_RESET;
                let rc = ibv_modify_qp(raw, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32);
                if rc != 0 {
                    return Err(VerbsError::rc("ibv_modify_qp(RESET)", rc));
                }
            }
            // drain anything left in the CQs
            let (scq, rcq) = (e.send_cq, e.recv_cq);
            for cq in [scq, rcq] {
                // SAFETY: ibv_wc is plain data; the CQ is live.
                unsafe {
                    let mut wc: ibv_wc = std::mem::zeroed();
                    while ibv_poll_cq(cq, 1, &mut wc) > 0 {}
                }
            }
            Self::modify_to_init(raw, self.ctx.port_attr.port)?;
            self.modify_to_rts(raw, dest)?;
            if let Some(e) = self.qps.get_mut(&q) {
                e.pending.clear();
                e.stash.clear();
                e.errored = false;
            }
        }
        Ok(())
    }
    fn qp_state(&self, qp: Qpn) -> Result<QpState> {
        let e = self.qps.get(&qp.get()).ok_or(VerbsError::UnknownQp(qp.get()))?;
        query_state(e.qp)
    }
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        buf.copy_from_slice(self.slice(addr, buf.len())?);
        Ok(())
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<()> {
        self.owned(addr, data.len() as u64)?;
        // SAFETY: the destination lies in a live, writable mapping owned by self (checked);
        // the source is a distinct Rust slice.
        unsafe {
            ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len());
        }
        Ok(())
    }
    /// Windows bound to the QP are invalidated first (so rxe never sees a QP die under a
    /// bound window), then the QP, its CQs and its rdma_cm id go.
    fn destroy_qp(&mut self, qp: Qpn) -> Result<()> {
        self.teardown_qp(qp)
    }
    fn outstanding(&self, _qp: Qpn, _queue: QueueSel) -> Option<u64> {
        None
    }
}

impl Provision for VerbsBackend {
    /// Register `[addr, addr+len)`, which must lie in memory from [`Self::alloc_region`].
    /// libibverbs has one PD here: the CN-facing one. [`Domain::MnPrivate`] exists only for
    /// chain offload, which upstream verbs lacks, so it is refused.
    fn reg_mr(&mut self, domain: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys> {
        if domain == Domain::MnPrivate {
            return Err(VerbsError::Unsupported("an MN-private protection domain (only chain offload needs one)"));
        }
        self.owned(addr, len)?;
        // SAFETY: pd is live; the range lies in a live mapping owned by self (checked), which
        // outlives the MR (Drop deregisters MRs before unmapping).
        let mr = unsafe { crate::device::reg_mr(self.pd, addr, len, access) }?;
        // SAFETY: mr is a live MR just returned.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        self.mrs.insert(lkey, MrEntry { mr, addr, len, keys: MrKeys { lkey, rkey }, access });
        Ok(MrKeys { lkey, rkey })
    }
    fn alloc_mw(&mut self) -> Result<Rkey> {
        // SAFETY: pd is live.
        let mw = unsafe { crate::device::alloc_mw_type2(self.pd, &self.ctx.info.name) }?;
        // SAFETY: mw is live.
        let rkey = Rkey(unsafe { (*mw).rkey });
        self.mws.insert(rkey.index(), MwEntry { mw, rkey, bound: None });
        Ok(rkey)
    }
    fn alloc_memory(&mut self, len: u64, align: u64) -> Result<u64> {
        self.alloc_region(len, align)
    }
    /// libibverbs has neither a private domain nor managed queues here (no chain offload).
    fn create_loopback_qp(&mut self, domain: Domain, managed_send_depth: Option<u32>) -> Result<Qpn> {
        if domain == Domain::MnPrivate {
            return Err(VerbsError::Unsupported("an MN-private protection domain (only chain offload needs one)"));
        }
        if managed_send_depth.is_some() {
            return Err(VerbsError::Unsupported("managed (WAIT/ENABLE) send queues: upstream libibverbs has none"));
        }
        Ok(self.create_loopback_pair()?.0)
    }
}

impl OffloadRings for VerbsBackend {
    fn ring_base(&self, _qp: Qpn, _queue: QueueSel) -> Result<u64> {
        Err(VerbsError::Unsupported("WQE rings in registered memory (no chain offload on libibverbs)"))
    }
    fn ring_keys(&self, domain: Domain) -> Result<MrKeys> {
        match domain {
            Domain::CnFacing => Ok(MrKeys { lkey: 0, rkey: 0 }),
            Domain::MnPrivate => {
                Err(VerbsError::Unsupported("WQE rings in registered memory (no chain offload on libibverbs)"))
            }
        }
    }
    /// No chains run on libibverbs (the host engine counts its own laps).
    fn send_wqes_executed(&self, _: Qpn) -> Option<u64> {
        None
    }
    /// No chains, no record for them (the provider keeps its doorbell records to itself).
    fn recv_doorbell(&self, _: Qpn) -> Result<Option<omw_core::device::RecvDoorbell>> {
        Ok(None)
    }
}

impl WindowState for VerbsBackend {
    /// Tracked, not queried: libibverbs has no query for a window's binding.
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        let m = self.mws.get(&rkey.index())?;
        Some(match m.bound {
            Some(b) if m.rkey == rkey => MwBinding::Bound { rkey, qpn: Qpn::new(b.qpn).ok()? },
            _ => MwBinding::Unbound,
        })
    }
    /// Send and receive rings live in provider memory: nothing to register. The CN-facing
    /// "ring key" is never used by host-engine WQEs (the engine patches its own copies).
    /// Tracked, like the binding: the range the bind that is in force named.
    fn mw_span(&self, rkey: Rkey) -> Option<(u64, u64)> {
        let m = self.mws.get(&rkey.index())?;
        m.bound.filter(|_| m.rkey == rkey).map(|b| (b.addr, b.len))
    }
}

impl Mlx5Arm for VerbsBackend {
    fn cq_numbers(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> Option<[u32; 3]> {
        None
    }
    fn cq_producer_indices(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> [u32; 3] {
        [0; 3]
    }
    fn arm_mlx5(&mut self, _chain: &Mlx5Chain, _recv_copies: u32) -> Option<Result<(), Self::Error>> {
        None
    }
}

impl Drop for VerbsBackend {
    fn drop(&mut self) {
        // 0. settle every outstanding completion, so the tracked bindings are exact: rxe
        //    dereferences NULL when asked to invalidate a window that is not bound
        self.drain_all();
        // 1. every bound window: invalidate (best effort), then deallocate — before any QP dies
        let bound: Vec<u32> = self.mws.iter().filter(|(_, m)| m.bound.is_some()).map(|(i, _)| *i).collect();
        for i in bound {
            self.invalidate_for_teardown(i);
        }
        for (_, m) in self.mws.drain() {
            // SAFETY: m.mw is a live window of this backend, deallocated exactly once.
            unsafe { ibv_dealloc_mw(m.mw) };
        }
        // 2. QPs (disconnecting rdma_cm ones), then their CQs
        let qps: Vec<u32> = self.qps.keys().copied().collect();
        for q in qps {
            if let Some(e) = self.qps.remove(&q) {
                // SAFETY: the QP is removed from the table and no longer used.
                unsafe {
                    match e.link {
                        Link::Cm { id } => {
                            rdma_disconnect(id);
                            rdma_destroy_qp(id);
                            rdma_destroy_id(id);
                        }
                        Link::Loopback { .. } => {
                            ibv_destroy_qp(e.qp);
                        }
                    }
                }
                Self::destroy_cqs(e.send_cq, e.recv_cq);
            }
        }
        // every CQ is gone: the completion channel may go
        self.comp = None;
        self.cm.close();
        // 3. MRs, PD, memory (the context closes when `ctx` drops after this)
        for (_, m) in std::mem::take(&mut self.mrs) {
            let _ = (m.addr, m.len);
            // SAFETY: live MR, deregistered once; no window is bound to it any more.
            unsafe { ibv_dereg_mr(m.mr) };
        }
        // SAFETY: pd is live and now empty.
        unsafe { ibv_dealloc_pd(self.pd) };
        for r in self.regions.drain(..) {
            let _ = (r.addr, r.len);
            // SAFETY: the mapping is ours and nothing (MR, NIC) references it any more.
            unsafe { libc::munmap(r.map, r.map_len) };
        }
    }
}

impl VerbsBackend {
    /// Poll one CQ and translate; send completions carry the QP they are reported to.
    fn poll_raw(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize> {
        let e = self.entry(qp.get())?;

        let cq = match queue {
            QueueSel::Send => e.send_cq,
            QueueSel::Recv => e.recv_cq,
        };
        let max = out.len().min(32);
        if max == 0 {
            return Ok(0);
        }
        // SAFETY: ibv_wc is plain data; ibv_poll_cq fills at most `max` entries of the array.
        let mut wcs: Vec<ibv_wc> = (0..max).map(|_| unsafe { std::mem::zeroed() }).collect();
        // SAFETY: cq is a live CQ of this backend; wcs holds `max` entries.
        let n = unsafe { ibv_poll_cq(cq, max as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(VerbsError::rc("ibv_poll_cq", n));
        }
        // rxe copies the kernel's IB_WC_WITH_INVALIDATE (bit 2) into the user-space flags,
        // where bit 2 is IBV_WC_IP_CSUM_OK and WITH_INV is bit 3
        let rxe_inv_quirk = self.ctx.info.is_rxe();
        let mut k = 0;
        for wc in wcs.iter().take(n as usize) {
            let status = WcStatus::from_u32(wc.status);
            let flags = ibv_wc_flags(wc.wc_flags);
            // SAFETY: both members of the union are u32s over the same four bytes, so reading
            // either is defined; wc_flags says which one the device filled.
            let raw = unsafe { wc.imm_data_invalidated_rkey_union.invalidated_rkey };
            let imm = ((flags & ibv_wc_flags::IBV_WC_WITH_IMM).0 != 0).then_some(u32::from_be(raw));
            let inv = (((flags & ibv_wc_flags::IBV_WC_WITH_INV).0 != 0)
                || (rxe_inv_quirk && queue == QueueSel::Recv && (flags & ibv_wc_flags::IBV_WC_IP_CSUM_OK).0 != 0))
                .then_some(raw);
            let mut report_to = qp.get();
            let (wr_id, opcode) = match queue {
                QueueSel::Send => {
                    let (u, op, to) = self.settle(qp.get(), wc.wr_id, status);
                    report_to = to;
                    (u, WcOpcode::Send(op))
                }
                QueueSel::Recv => {
                    if let Some(r) = inv.filter(|_| status.is_ok()) {
                        // remote invalidation of one of our windows (SEND_WITH_INV)
                        if let Some(m) = self.mws.get_mut(&Rkey(r).index()) {
                            if m.rkey.0 == r {
                                m.bound = None;
                            }
                        }
                    }
                    let op = if wc.opcode == ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                        WcOpcode::RecvRdmaWithImm
                    } else {
                        WcOpcode::Recv
                    };
                    (wc.wr_id, op)
                }
            };
            out[k] = Completion {
                wr_id,
                status,
                opcode,
                qpn: Qpn::new(report_to).unwrap_or(qp),
                byte_len: wc.byte_len,
                imm,
                invalidated: inv.map(Rkey),
            };
            k += 1;
        }
        Ok(k)
    }
}
