//! The fabric: hosts (MN, CNs) with memory, protection objects, QPs and one NIC each, the
//! global virtual clock, and the control-plane API (what a CPU does: allocate, register,
//! create and connect QPs, post, enable, poll, reset, inject host faults).
//!
//! Work itself runs in `sched` (which QP goes next, when; see [`Fabric::step`]) and `exec` (what
//! a WQE does).

pub use crate::addr::{HostId, QpAddr};
use crate::config::NicConfig;
use crate::counters::{Counters, HostStats, QpStats, TraceEvent};
use crate::cq::{Cq, TimedCompletion};
use crate::error::LoopbackError;
use crate::fault::{FaultPlan, Middleware};
use crate::memory::{host_base, Memory};
use crate::nic::Nic;
use crate::protection::{KeyDraw, MrInfo, MwInfo, MwState, PdId, Protection, WindowBinding};
use crate::qp::{Prefetch, Qp, QpConfig, Queue};
use omw_core::access::AccessFlags;
use omw_core::device::{Capabilities, Completion, MrKeys, QpState};
use omw_core::ids::{Qpn, Rkey};
use omw_core::mlx5::wqebb::CqIndex;
use omw_core::wire::wqe::{QueueSel, RecvWqe, Wqe, RECV_WQE_SIZE, WQE_SIZE};
use std::fmt;

type Result<T> = core::result::Result<T, LoopbackError>;

/// Most hosts a fabric holds (QP numbers carry `host + 1` in bits 16..24).
pub const MAX_HOSTS: u32 = 255;
/// Most QPs one host creates over its life.
pub const MAX_QPS_PER_HOST: u32 = 0x1_0000;
pub(crate) const NONE: u32 = u32::MAX;

/// QP number of the `local`-th QP of host `h`: `(h + 1) << 16 | local`, so QP numbers of
/// different hosts never coincide (a CN's qpn in an MN bind is caught as a bad target).
pub const fn qpn_of(host: u32, local: u32) -> u32 {
    ((host + 1) << 16) | local
}

#[derive(Debug)]
pub(crate) struct Host {
    pub name: String,
    pub mem: Memory,
    pub prot: Protection,
    /// Local QP index → global index (NONE once destroyed).
    pub qps: Vec<u32>,
    /// Receive doorbell records in this host's memory: (address, global QP index).
    pub doorbells: Vec<(u64, u32)>,
    pub crashed: bool,
    pub ring_base: u64,
    pub ring_len: u64,
    pub ring_brk: u64,
    /// Registrations of the ring arena, one per PD that asked for one: `(pd, key, access)`.
    /// PD 0's is local-only unless a caller grants more ([`Fabric::register_ring_arena`]).
    pub ring_keys: Vec<(u32, u32, AccessFlags)>,
    /// The NIC's processing units, link and atomic serialiser.
    pub nic: Nic,
    pub cpu_free: u64,
    pub cpu_events: u64,
    pub cpu_busy_ns: u64,
    pub wqes_executed: u64,
    /// CQ number → fabric-wide CQ index.
    pub cqns: std::collections::BTreeMap<u32, u32>,
}

/// The whole model. Everything is deterministic: the same calls in the same order give the
/// same memory, completions, timestamps and counters.
pub struct Fabric {
    pub(crate) cfg: NicConfig,
    pub(crate) now: u64,
    pub(crate) hosts: Vec<Host>,
    pub(crate) qps: Vec<Qp>,
    pub(crate) cqs: Vec<Cq>,
    /// QPs that may have work (global indices); idle and parked QPs are dropped lazily.
    pub(crate) active: Vec<u32>,
    /// Round-robin cursor: ties in ready time go to the first QP index at or after it.
    pub(crate) rr: u32,
    pub(crate) scratch: Vec<u8>,
    pub(crate) faults: FaultPlan,
    pub(crate) middlewares: Vec<Box<dyn Middleware>>,
    pub(crate) counters: Counters,
    pub(crate) trace: Vec<TraceEvent>,
    pub(crate) digest: u64,
}

impl fmt::Debug for Fabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fabric")
            .field("now", &self.now)
            .field("hosts", &self.hosts.len())
            .field("qps", &self.qps.len())
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl Fabric {
    pub fn new(cfg: NicConfig) -> Self {
        Fabric {
            cfg,
            now: 0,
            hosts: Vec::new(),
            qps: Vec::new(),
            cqs: Vec::new(),
            active: Vec::new(),
            rr: 0,
            scratch: Vec::new(),
            faults: FaultPlan::new(cfg.seed),
            middlewares: Vec::new(),
            counters: Counters::default(),
            trace: Vec::new(),
            digest: 0xcbf2_9ce4_8422_2325,
        }
    }

    pub fn config(&self) -> &NicConfig {
        &self.cfg
    }

    /// What every NIC of this fabric can do (see [`NicConfig::capabilities`]).
    pub fn capabilities(&self) -> Capabilities {
        self.cfg.capabilities()
    }

    // ---- hosts -------------------------------------------------------------------------------

    /// Add a host (an MN or a CN: the model does not distinguish). It gets PD 0 and a ring
    /// arena (`NicConfig::ring_arena_bytes`) registered in PD 0 **local-only** (receives may
    /// scatter into ring bytes). Remote rights on the rings — which chains need to patch WQEs
    /// with READs and bump them with fetch-and-adds — exist only where a caller grants them
    /// with [`Fabric::register_ring_arena`], normally in a PD no other host's QP is in: a
    /// remotely writable ring reachable from a peer's QP lets that peer rewrite the host's
    /// work requests (DESIGN.md §9).
    pub fn add_host(&mut self, name: &str) -> Result<HostId> {
        let index = self.hosts.len() as u32;
        if index >= MAX_HOSTS {
            return Err(LoopbackError::BadArgument("too many hosts"));
        }
        let id = HostId(index);
        let mut mem = Memory::new(host_base(index), self.cfg.mem_limit);
        let ring_len = self.cfg.ring_arena_bytes.max(WQE_SIZE as u64);
        let ring_base =
            mem.alloc(ring_len, 4096).ok_or(LoopbackError::OutOfMemory { host: id, requested: ring_len })?;
        let rxe = self.cfg.conformance == crate::config::Conformance::RxeCompatible;
        let mut prot = Protection::new(KeyDraw::for_device(rxe, self.cfg.seed ^ ((index as u64 + 1) << 32)));
        let ring_key = prot
            .reg_mr(PdId(0), ring_base, ring_len, AccessFlags::LOCAL_WRITE)
            .ok_or(LoopbackError::BadArgument("key space exhausted"))?;
        self.hosts.push(Host {
            name: name.to_string(),
            mem,
            prot,
            qps: Vec::new(),
            doorbells: Vec::new(),
            crashed: false,
            ring_base,
            ring_len,
            ring_brk: 0,
            ring_keys: vec![(0, ring_key, AccessFlags::LOCAL_WRITE)],
            nic: Nic::new(self.cfg.cost.nic_units).with_key_cache(self.cfg.cost.key_cache_entries),
            cpu_free: 0,
            cpu_events: 0,
            cpu_busy_ns: 0,
            wqes_executed: 0,
            cqns: Default::default(),
        });
        Ok(id)
    }

    pub fn host_count(&self) -> usize {
        self.hosts.len()
    }

    pub fn host_name(&self, h: HostId) -> Result<&str> {
        Ok(&self.host_any(h)?.name)
    }

    pub fn is_crashed(&self, h: HostId) -> Result<bool> {
        Ok(self.host_any(h)?.crashed)
    }

    fn host_any(&self, h: HostId) -> Result<&Host> {
        self.hosts.get(h.0 as usize).ok_or(LoopbackError::NoSuchHost(h))
    }

    pub(crate) fn host(&self, h: HostId) -> Result<&Host> {
        let host = self.host_any(h)?;
        if host.crashed {
            return Err(LoopbackError::HostCrashed(h));
        }
        Ok(host)
    }

    pub(crate) fn host_mut(&mut self, h: HostId) -> Result<&mut Host> {
        let host = self.hosts.get_mut(h.0 as usize).ok_or(LoopbackError::NoSuchHost(h))?;
        if host.crashed {
            return Err(LoopbackError::HostCrashed(h));
        }
        Ok(host)
    }

    // ---- memory --------------------------------------------------------------------------------

    /// Allocate `len` zeroed bytes of host memory aligned to `align` (a power of two).
    pub fn alloc(&mut self, h: HostId, len: u64, align: u64) -> Result<u64> {
        if !align.is_power_of_two() {
            return Err(LoopbackError::BadArgument("alignment must be a power of two"));
        }
        self.host_mut(h)?.mem.alloc(len, align).ok_or(LoopbackError::OutOfMemory { host: h, requested: len })
    }

    /// Host (CPU) read of its own memory.
    pub fn read(&self, h: HostId, addr: u64, buf: &mut [u8]) -> Result<()> {
        if self.host(h)?.mem.read(addr, buf) {
            Ok(())
        } else {
            Err(LoopbackError::BadAddress { host: h, addr, len: buf.len() as u64 })
        }
    }

    /// Host (CPU) write of its own memory. Writing into a ring changes what the NIC fetches
    /// next (unless it already prefetched the entry); into a receive doorbell record, what
    /// receives are published.
    pub fn write(&mut self, h: HostId, addr: u64, data: &[u8]) -> Result<()> {
        if self.host_mut(h)?.mem.write(addr, data) {
            self.record_landed(h.0, addr, data.len() as u64);
            Ok(())
        } else {
            Err(LoopbackError::BadAddress { host: h, addr, len: data.len() as u64 })
        }
    }

    pub fn read_u64(&self, h: HostId, addr: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read(h, addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    pub fn write_u64(&mut self, h: HostId, addr: u64, v: u64) -> Result<()> {
        self.write(h, addr, &v.to_le_bytes())
    }

    // ---- protection ------------------------------------------------------------------------------

    pub fn alloc_pd(&mut self, h: HostId) -> Result<PdId> {
        Ok(self.host_mut(h)?.prot.alloc_pd())
    }

    /// Register allocated memory `[addr, addr+len)` in `pd`. lkey == rkey.
    pub fn reg_mr(&mut self, h: HostId, pd: PdId, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys> {
        let host = self.host_mut(h)?;
        if !host.prot.pd_exists(pd) {
            return Err(LoopbackError::NoSuchPd { host: h, pd: pd.0 });
        }
        if len == 0 {
            return Err(LoopbackError::BadArgument("zero-length MR"));
        }
        if host.mem.range(addr, len).is_none() {
            return Err(LoopbackError::BadAddress { host: h, addr, len });
        }
        omw_core::device::mw_rules::check_reg_mr(access.bits())
            .map_err(|reason| LoopbackError::RegMr { host: h, reason })?;
        let key = host.prot.reg_mr(pd, addr, len, access).ok_or(LoopbackError::BadArgument("key space exhausted"))?;
        Ok(MrKeys { lkey: key, rkey: key })
    }

    /// Allocate and register in one call.
    pub fn alloc_mr(
        &mut self,
        h: HostId,
        pd: PdId,
        len: u64,
        align: u64,
        access: AccessFlags,
    ) -> Result<(u64, MrKeys)> {
        let addr = self.alloc(h, len, align)?;
        Ok((addr, self.reg_mr(h, pd, addr, len, access)?))
    }

    /// Deregister; refused while windows are bound to the MR (rxe's EINVAL, §3).
    pub fn dereg_mr(&mut self, h: HostId, lkey: u32) -> Result<()> {
        self.host_mut(h)?.prot.dereg_mr(lkey).map_err(|bound| match bound {
            true => LoopbackError::MrHasBoundWindows { host: h, lkey },
            false => LoopbackError::NoSuchKey { host: h, key: lkey },
        })
    }

    /// Every MR registered on host `h` (tests and attacker models enumerate them).
    pub fn mrs_of(&self, h: HostId) -> Result<Vec<MrInfo>> {
        Ok(self.host(h)?.prot.mrs().collect())
    }

    pub fn mr_info(&self, h: HostId, key: u32) -> Result<MrInfo> {
        self.host(h)?.prot.mr_info(key).ok_or(LoopbackError::NoSuchKey { host: h, key })
    }

    /// Allocate a type-2 window in `pd`; returns its initial (unbound) rkey.
    pub fn alloc_mw(&mut self, h: HostId, pd: PdId) -> Result<Rkey> {
        let host = self.host_mut(h)?;
        if !host.prot.pd_exists(pd) {
            return Err(LoopbackError::NoSuchPd { host: h, pd: pd.0 });
        }
        host.prot.alloc_mw(pd).ok_or(LoopbackError::BadArgument("key space exhausted"))
    }

    /// [`Fabric::alloc_mw`] with the first key byte chosen by the creator (an mlx5 mkey's
    /// `mkey_7_0`, as the ConnectX double's CREATE_MKEY takes it).
    pub fn alloc_mw_keyed(&mut self, h: HostId, pd: PdId, key: u8) -> Result<Rkey> {
        let host = self.host_mut(h)?;
        if !host.prot.pd_exists(pd) {
            return Err(LoopbackError::NoSuchPd { host: h, pd: pd.0 });
        }
        host.prot.alloc_mw_keyed(pd, key).ok_or(LoopbackError::BadArgument("key space exhausted"))
    }

    /// Deallocate a window by its current rkey, bound or not (a binding is revoked: later
    /// accesses through it fail with `RemAccessErr`). Returns the revoked binding.
    pub fn dealloc_mw(&mut self, h: HostId, rkey: Rkey) -> Result<Option<WindowBinding>> {
        self.host_mut(h)?.prot.dealloc_mw(rkey.0).map_err(|reason| LoopbackError::DeallocMw {
            host: h,
            key: rkey.0,
            reason,
        })
    }

    /// State of the window with rkey index `rkey_index` (whatever its current key).
    pub fn mw_binding(&self, h: HostId, rkey_index: u32) -> Option<MwInfo> {
        self.host(h).ok()?.prot.mw_info(rkey_index)
    }

    /// The QP a window is bound to, if `rkey` is exactly its current key and it is bound.
    pub fn qp_of_mw(&self, h: HostId, rkey: Rkey) -> Option<Qpn> {
        let host = self.host(h).ok()?;
        let info = host.prot.mw_info(rkey.index())?;
        match info.state {
            MwState::Bound(b) if info.rkey == rkey => Some(b.qpn),
            _ => None,
        }
    }

    /// Whether `rkey` (exactly) would currently validate as a bound window.
    pub fn mw_is_bound(&self, h: HostId, rkey: Rkey) -> bool {
        self.qp_of_mw(h, rkey).is_some()
    }

    // ---- QPs ---------------------------------------------------------------------------------

    /// Resolve a QP number of host `h` to its global index (live QPs only).
    #[inline]
    pub(crate) fn resolve(&self, h: u32, qpn: u32) -> Option<u32> {
        if qpn >> 16 != h + 1 {
            return None;
        }
        let g = *self.hosts.get(h as usize)?.qps.get((qpn & 0xFFFF) as usize)?;
        (g != NONE).then_some(g)
    }

    pub(crate) fn gq(&self, qp: QpAddr) -> Result<u32> {
        self.host(qp.host)?;
        self.resolve(qp.host.0, qp.qpn.get()).ok_or(LoopbackError::NoSuchQp { host: qp.host, qpn: qp.qpn.get() })
    }

    /// The CQ queue `sel` of QP `g` reports to.
    #[inline]
    pub(crate) fn cq_of(&self, g: u32, sel: QueueSel) -> &Cq {
        &self.cqs[self.qps[g as usize].cq_index(sel) as usize]
    }
    #[inline]
    pub(crate) fn cq_of_mut(&mut self, g: u32, sel: QueueSel) -> &mut Cq {
        let c = self.qps[g as usize].cq_index(sel);
        &mut self.cqs[c as usize]
    }
    /// The CQ numbered `cqn` on host `h` (fabric-wide index).
    #[inline]
    pub(crate) fn cq_by_number(&self, h: u32, cqn: u32) -> Option<u32> {
        self.hosts.get(h as usize)?.cqns.get(&(cqn & CqIndex::MASK)).copied()
    }

    pub(crate) fn addr_of(&self, gq: u32) -> QpAddr {
        let q = &self.qps[gq as usize];
        QpAddr { host: HostId(q.host), qpn: Qpn::new(q.qpn).unwrap_or_default() }
    }

    /// Create an RC QP in state `Init` with rings in the host's ring arena.
    pub fn create_qp(&mut self, h: HostId, cfg: QpConfig) -> Result<Qpn> {
        if cfg.send_depth == 0 || cfg.recv_depth == 0 {
            return Err(LoopbackError::BadArgument("queue depth must be at least 1"));
        }
        let cq_cap = self.cfg.cq_capacity as usize;
        let mlx5 = self.cfg.wqe_format == omw_core::wire::wqe_format::WqeFormat::Mlx5
            && (cfg.managed_send || cfg.managed_recv);
        // mlx5 form: the cache holds WQEBBs, room for at least the largest WQE
        let pf_min = if mlx5 { omw_core::mlx5::wqebb::MAX_WQEBBS as u32 } else { 1 };
        let pf_cap = if self.cfg.prefetch { self.cfg.prefetch_depth.max(pf_min) as usize } else { 0 };
        let rstride = if mlx5 { crate::qp::MLX5_RQ_STRIDE } else { RECV_WQE_SIZE as u32 };
        let gq = self.qps.len() as u32;
        let first_cq = self.cqs.len() as u32;
        // a managed (chain) receive queue keeps a doorbell record a chain can write, in the
        // ring arena after the rings (`NicConfig::recv_doorbell_records`)
        let record = cfg.managed_recv && self.cfg.offload && self.cfg.recv_doorbell_records;
        let host = self.host_mut(h)?;
        if !host.prot.pd_exists(cfg.pd) {
            return Err(LoopbackError::NoSuchPd { host: h, pd: cfg.pd.0 });
        }
        let local = host.qps.len() as u32;
        if local >= MAX_QPS_PER_HOST {
            return Err(LoopbackError::BadArgument("too many QPs on this host"));
        }
        let sbytes = cfg.send_depth as u64 * WQE_SIZE as u64;
        let rbytes = cfg.recv_depth as u64 * rstride as u64;
        let s_off = host.ring_brk.next_multiple_of(64);
        let r_off = (s_off + sbytes).next_multiple_of(64);
        let d_off = (r_off + rbytes).next_multiple_of(64);
        let end = if record { d_off + 8 } else { r_off + rbytes };
        if end > host.ring_len {
            return Err(LoopbackError::RingArenaFull { host: h, requested: end - s_off });
        }
        host.ring_brk = end;
        let rq_doorbell = record.then_some(host.ring_base + d_off);
        if let Some(a) = rq_doorbell {
            host.doorbells.push((a, gq));
        }
        let qpn = qpn_of(h.0, local);
        let cq_nums = [QueueSel::Send, QueueSel::Recv].map(|q| ((qpn << 1) | q as u32) & CqIndex::MASK);
        if cq_nums.iter().any(|n| host.cqns.contains_key(n)) {
            return Err(LoopbackError::BadArgument("the QP's CQ numbers are in use on this host"));
        }
        let (scq, rcq) = (first_cq, first_cq + 1);
        host.cqns.insert(cq_nums[0], scq);
        host.cqns.insert(cq_nums[1], rcq);
        let sq = Queue::new(host.ring_base + s_off, cfg.send_depth, WQE_SIZE as u32, cfg.managed_send);
        let rq = Queue::new(host.ring_base + r_off, cfg.recv_depth, rstride, cfg.managed_recv);
        host.qps.push(gq);
        self.qps.push(Qp {
            host: h.0,
            qpn,
            pd: cfg.pd.0,
            peer: None,
            state: QpState::Init,
            alive: true,
            sq,
            rq,
            scq,
            rcq,
            pf: Prefetch::new(pf_cap),
            order_until: 0,
            rd_done: 0,
            rnr_since: None,
            executed: 0,
            flushed: 0,
            cqes_total: 0,
            in_active: false,
            parked_on: None,
            mlx5,
            rq_doorbell,
            rq_published: false,
            sq_wr_ids: if mlx5 { vec![0; cfg.send_depth as usize] } else { Vec::new() },
            rq_wr_ids: if mlx5 { vec![0; cfg.recv_depth as usize] } else { Vec::new() },
            head_wqebbs: 1,
            scatter: Vec::new(),
            pf_wait: None,
            index_wr_ids: false,
            cd_master: true,
            head_mlx5: Default::default(),
        });
        self.cqs.push(Cq::new(cq_nums[0], cq_cap, true));
        self.cqs.push(Cq::new(cq_nums[1], cq_cap, true));
        Ok(Qpn::new(qpn).unwrap_or_default())
    }

    /// Connect two QPs (RC) and move both to RTS. They may be on the same host (the MN's
    /// loopback pair); a QP may even be connected to itself.
    pub fn connect(&mut self, a: QpAddr, b: QpAddr) -> Result<()> {
        let ga = self.gq(a)?;
        let gb = self.gq(b)?;
        for g in [ga, gb] {
            let q = &self.qps[g as usize];
            if q.peer.is_some() || q.state != QpState::Init {
                return Err(LoopbackError::BadQpState { host: HostId(q.host), qpn: q.qpn, state: q.state });
            }
        }
        self.qps[ga as usize].peer = Some((b.host.0, b.qpn.get()));
        self.qps[gb as usize].peer = Some((a.host.0, a.qpn.get()));
        for g in [ga, gb] {
            self.qps[g as usize].state = QpState::Rts;
            self.activate(g);
            self.refill(g);
        }
        Ok(())
    }

    /// Create a QP on each host and connect them.
    pub fn create_connected_pair(
        &mut self,
        a: HostId,
        a_cfg: QpConfig,
        b: HostId,
        b_cfg: QpConfig,
    ) -> Result<(QpAddr, QpAddr)> {
        let qa = QpAddr::new(a, self.create_qp(a, a_cfg)?);
        let qb = QpAddr::new(b, self.create_qp(b, b_cfg)?);
        self.connect(qa, qb)?;
        Ok((qa, qb))
    }

    /// The QP a QP is connected to.
    pub fn peer_of(&self, qp: QpAddr) -> Result<Option<QpAddr>> {
        let g = self.gq(qp)?;
        Ok(self.qps[g as usize].peer.map(|(h, q)| QpAddr { host: HostId(h), qpn: Qpn::new(q).unwrap_or_default() }))
    }

    pub fn qp_state(&self, qp: QpAddr) -> Result<QpState> {
        Ok(self.qps[self.gq(qp)? as usize].state)
    }

    /// Destroy a QP: its number stops resolving; requests towards it fail with
    /// `RetryExcErr`. Windows bound to it stay bound (and unusable) until invalidated.
    pub fn destroy_qp(&mut self, qp: QpAddr) -> Result<()> {
        let g = self.gq(qp)?;
        self.destroy_gq(g);
        Ok(())
    }

    pub(crate) fn destroy_gq(&mut self, g: u32) {
        let q = &mut self.qps[g as usize];
        if !q.alive {
            return;
        }
        q.alive = false;
        q.state = QpState::Reset;
        q.pf.clear();
        let (h, local) = (q.host as usize, (q.qpn & 0xFFFF) as usize);
        if q.in_active {
            q.in_active = false;
            self.active.retain(|x| *x != g);
        }
        self.hosts[h].qps[local] = NONE;
    }

    /// Bring a QP **and its peer** back to RTS with empty rings (zeroed bytes), zero CQ
    /// counts, empty CQs and prefetch caches, enable limits 0 (the `RdmaBackend::reset_qp`
    /// contract). A QP whose peer is gone, or whose peer is a QP on a device's terms
    /// ([`Fabric::create_qp_with`]: its driver resets it), is reset alone.
    pub fn reset_qp(&mut self, qp: QpAddr) -> Result<()> {
        let g = self.gq(qp)?;
        self.reset_gq(g);
        if let Some(p) = self.peer_gq(g) {
            // a QP on a device's terms (`create_qp_with`) is its own driver's to reset
            if p != g && !self.qps[p as usize].index_wr_ids {
                // The peer's reset stands for that host reconnecting its end; completions it had
                // already received stay in its CQs until it polls them (another host's reset
                // cannot take them away).
                let remote = self.qps[p as usize].host != self.qps[g as usize].host;
                let (ps, pr) = (self.qps[p as usize].scq as usize, self.qps[p as usize].rcq as usize);
                let kept = remote.then(|| (self.cqs[ps].take_entries(), self.cqs[pr].take_entries()));
                self.reset_gq(p);
                if let Some((s, r)) = kept {
                    self.cqs[ps].restore_entries(s);
                    self.cqs[pr].restore_entries(r);
                }
            }
        }
        Ok(())
    }

    fn reset_gq(&mut self, g: u32) {
        let q = &mut self.qps[g as usize];
        q.state = if q.peer.is_some() { QpState::Rts } else { QpState::Init };
        q.rq_published = false;
        let (sbase, slen) = (q.sq.base, q.sq.ring_bytes());
        let (rbase, rlen) = (q.rq.base, q.rq.ring_bytes());
        q.sq.clear();
        q.rq.clear();
        let cqs = [q.scq as usize, q.rcq as usize];
        q.pf.clear();
        q.rnr_since = None;
        q.parked_on = None;
        let h = q.host as usize;
        if let Some(s) = self.hosts[h].mem.slice_mut(sbase, slen) {
            s.fill(0);
        }
        if let Some(s) = self.hosts[h].mem.slice_mut(rbase, rlen) {
            s.fill(0);
        }
        for c in cqs {
            if self.cqs[c].qp_owned {
                self.cqs[c].reset();
            }
        }
    }

    /// Post a WQE on the send queue (its canonical bytes go into the ring).
    pub fn post_send(&mut self, qp: QpAddr, wqe: &Wqe) -> Result<()> {
        self.post_send_raw(qp, &wqe.encode())
    }

    /// Post arbitrary bytes as a send-queue entry: the NIC decodes them when it fetches them
    /// (a malformed entry completes with `LocQpOpErr`). The hook for malicious-CN tests.
    pub fn post_send_raw(&mut self, qp: QpAddr, bytes: &[u8; WQE_SIZE]) -> Result<()> {
        let g = self.gq(qp)?;
        let q = &mut self.qps[g as usize];
        if q.mlx5 {
            return Err(LoopbackError::BadArgument(
                "an mlx5-form ring takes whole chains (arm_mlx5), not canonical WQEs",
            ));
        }
        if !q.sq.has_room() {
            return Err(LoopbackError::RingFull { host: qp.host, qpn: qp.qpn.get(), queue: QueueSel::Send });
        }
        q.sq.producer = q.sq.producer.max(q.sq.consumer);
        let addr = q.sq.slot_addr(q.sq.producer);
        q.sq.producer += 1;
        let h = q.host as usize;
        self.hosts[h].mem.write(addr, bytes);
        self.activate(g);
        self.refill(g);
        Ok(())
    }

    pub fn post_recv(&mut self, qp: QpAddr, wqe: &RecvWqe) -> Result<()> {
        if self.qps[self.gq(qp)? as usize].mlx5 {
            let sges: Vec<omw_core::chain::mlx5::RecvSge> = wqe
                .sges
                .iter()
                .map(|s| omw_core::chain::mlx5::RecvSge { addr: s.addr, length: s.length, lkey: s.lkey })
                .collect();
            return self.post_recv_mlx5(qp, wqe.wr_id, &sges);
        }
        self.post_recv_raw(qp, &wqe.encode())
    }

    /// Post arbitrary bytes as a receive entry (decoded when a SEND consumes it).
    pub fn post_recv_raw(&mut self, qp: QpAddr, bytes: &[u8; RECV_WQE_SIZE]) -> Result<()> {
        let g = self.gq(qp)?;
        let q = &mut self.qps[g as usize];
        if !q.rq.has_room() {
            return Err(LoopbackError::RingFull { host: qp.host, qpn: qp.qpn.get(), queue: QueueSel::Recv });
        }
        q.rq.producer = q.rq.producer.max(q.rq.consumer);
        let addr = q.rq.slot_addr(q.rq.producer);
        q.rq.producer += 1;
        let err = q.state == QpState::Err;
        let h = q.host as usize;
        self.hosts[h].mem.write(addr, bytes);
        if err {
            self.flush_recvs(g);
        }
        Ok(())
    }

    /// Doorbell from the CPU: a managed queue may execute `count` more entries.
    pub fn enable(&mut self, qp: QpAddr, queue: QueueSel, count: u64) -> Result<()> {
        let g = self.gq(qp)?;
        let q = self.qps[g as usize].queue_mut(queue);
        if !q.managed {
            return Err(LoopbackError::NotManaged { host: qp.host, qpn: qp.qpn.get(), queue });
        }
        q.limit = q.limit.saturating_add(count);
        if queue == QueueSel::Send {
            self.activate(g);
            self.refill(g);
        } else if self.qps[g as usize].state == QpState::Err {
            self.flush_recvs(g);
        }
        Ok(())
    }

    /// Address of entry 0 of a QP's ring (send entries 64 B, receive `RECV_WQE_SIZE`).
    pub fn ring_base(&self, qp: QpAddr, queue: QueueSel) -> Result<u64> {
        Ok(self.qps[self.gq(qp)? as usize].queue(queue).base)
    }

    /// Depth (entries) of a QP's ring.
    pub fn ring_depth(&self, qp: QpAddr, queue: QueueSel) -> Result<u32> {
        Ok(self.qps[self.gq(qp)? as usize].queue(queue).depth)
    }

    /// Keys of the host's ring arena MR in PD 0 (local-only unless granted more).
    pub fn ring_keys(&self, h: HostId) -> Result<MrKeys> {
        self.ring_keys_in(h, PdId(0))
    }

    /// Keys of the most recent ring-arena registration in `pd`.
    pub fn ring_keys_in(&self, h: HostId, pd: PdId) -> Result<MrKeys> {
        let host = self.host(h)?;
        let k = host
            .ring_keys
            .iter()
            .rev()
            .find(|(p, _, _)| *p == pd.0)
            .map(|(_, k, _)| *k)
            .ok_or(LoopbackError::NoSuchPd { host: h, pd: pd.0 })?;
        Ok(MrKeys { lkey: k, rkey: k })
    }

    /// Register the whole ring arena once more, in `pd` with `access` — e.g. the remote rights
    /// a chain needs to patch its own WQEs, in the PD of the MN's private loopback QPs only.
    pub fn register_ring_arena(&mut self, h: HostId, pd: PdId, access: AccessFlags) -> Result<MrKeys> {
        let host = self.host_mut(h)?;
        if !host.prot.pd_exists(pd) {
            return Err(LoopbackError::NoSuchPd { host: h, pd: pd.0 });
        }
        let (base, len) = (host.ring_base, host.ring_len);
        let key = host.prot.reg_mr(pd, base, len, access).ok_or(LoopbackError::BadArgument("key space exhausted"))?;
        host.ring_keys.push((pd.0, key, access));
        Ok(MrKeys { lkey: key, rkey: key })
    }

    // ---- completions -----------------------------------------------------------------------------

    /// Drain visible completions (time ≤ now) into `out` without running the fabric.
    pub fn poll(&mut self, qp: QpAddr, queue: QueueSel, out: &mut [Completion]) -> Result<usize> {
        self.poll_at(qp, queue, out, &mut [])
    }

    /// [`Fabric::poll`], with each completion's modelled time in `at` (as far as it reaches).
    pub fn poll_at(&mut self, qp: QpAddr, queue: QueueSel, out: &mut [Completion], at: &mut [u64]) -> Result<usize> {
        let g = self.gq(qp)?;
        let now = self.now;
        let mut i = 0;
        let n = self.cq_of_mut(g, queue).poll(now, |c| {
            if i < out.len() {
                out[i] = c.completion;
                if let Some(t) = at.get_mut(i) {
                    *t = c.at;
                }
                i += 1;
                true
            } else {
                false
            }
        });
        if queue == QueueSel::Recv {
            self.hand_back(g, out[..n].iter().filter(|c| c.status.is_ok()).count());
        }
        Ok(n)
    }

    /// Bytes landed in host `h`'s memory at `[addr, addr + len)` — a CPU store or a DMA (a
    /// READ response, a WRITE, an atomic): where they cover a receive doorbell record, the
    /// record now says how many receives are published, and the queue's producer index
    /// follows it — an mlx5 record's 16 bits counted on from the consumer, as the HCA reads
    /// `dbrec[MLX5_RCV_DBR]` when it needs a receive WQE; a canonical record's count as is.
    pub(crate) fn record_landed(&mut self, h: u32, addr: u64, len: u64) {
        let Some(host) = self.hosts.get(h as usize) else { return };
        if host.doorbells.is_empty() {
            return;
        }
        let hits: Vec<(u64, u32)> =
            host.doorbells.iter().copied().filter(|(a, _)| *a < addr.saturating_add(len) && addr < a + 8).collect();
        for (a, g) in hits {
            let Some(q) = self.qps.get(g as usize) else { continue };
            let mut b = [0u8; 8];
            if !self.hosts[h as usize].mem.read(a, &mut b) {
                continue;
            }
            let q_mlx5 = q.mlx5;
            let q = &mut self.qps[g as usize];
            q.rq.producer = if q_mlx5 {
                let v = (u32::from_be_bytes([b[0], b[1], b[2], b[3]]) & 0xFFFF) as u16;
                q.rq.consumer + u64::from(v.wrapping_sub(q.rq.consumer as u16))
            } else {
                u64::from_le_bytes(b).max(q.rq.consumer)
            };
            q.rq_published = true;
            if q.state == QpState::Err {
                self.flush_recvs(g);
            }
        }
    }

    /// `qp`'s receive doorbell record, if the model keeps one for it (a managed receive queue
    /// of an offloading NIC), and how many receive WQEs its ring holds.
    pub fn recv_doorbell(&self, qp: QpAddr) -> Result<Option<omw_core::device::RecvDoorbell>> {
        let q = &self.qps[self.gq(qp)? as usize];
        Ok(q.rq_doorbell.map(|addr| omw_core::device::RecvDoorbell { addr, slots: q.rq.depth }))
    }

    /// A chain's (managed) receive queue: each receive the CPU polled goes back to the device
    /// as posted again — its bytes are still in the slot — as the DEVX backend hands a
    /// consumed chain receive back with the doorbell record. Where the doorbell is what makes
    /// receives available (`RecvEnable::Doorbell`) this is what lets the next request land;
    /// under `RecvEnOnly` the RECV_EN limit still decides.
    fn hand_back(&mut self, g: u32, n: usize) {
        let q = &mut self.qps[g as usize];
        // a chain that publishes its own receives through the doorbell record gets none back
        // from the CPU: it admits each request once its lap is done with the last
        if !q.rq.managed || q.state == QpState::Err || q.rq_published {
            return;
        }
        for _ in 0..n {
            if q.rq.has_room() {
                q.rq.producer = q.rq.producer.max(q.rq.consumer) + 1;
            }
        }
    }

    /// Drain every visible completion with its timestamp.
    pub fn poll_timed(&mut self, qp: QpAddr, queue: QueueSel) -> Result<Vec<TimedCompletion>> {
        let g = self.gq(qp)?;
        let now = self.now;
        let mut v = Vec::new();
        self.cq_of_mut(g, queue).poll(now, |c| {
            v.push(c);
            true
        });
        if queue == QueueSel::Recv {
            self.hand_back(g, v.iter().filter(|c| c.completion.status.is_ok()).count());
        }
        Ok(v)
    }

    /// What a CPU spinning on the CQ sees: run the fabric until idle (at most
    /// `NicConfig::poll_max_steps` steps); if the CQ then has only completions in the future,
    /// advance the clock to the first one; drain visible completions into `out`.
    pub fn poll_cq(&mut self, qp: QpAddr, queue: QueueSel, out: &mut [Completion]) -> Result<usize> {
        self.spin_on(qp, queue)?;
        self.poll(qp, queue, out)
    }

    /// Wait as a CPU spinning on one CQ waits: run the fabric until idle (at most
    /// `NicConfig::poll_max_steps` steps), then let the clock reach the CQ's first completion.
    pub fn spin_on(&mut self, qp: QpAddr, queue: QueueSel) -> Result<()> {
        let g = self.gq(qp)?;
        self.run_until_idle(self.cfg.poll_max_steps);
        if let Some(t) = self.cq_of(g, queue).next_time() {
            if t > self.now {
                self.now = t;
            }
        }
        Ok(())
    }

    /// [`Fabric::poll_cq`] for a CPU that the schedule lets in after only `steps` NIC steps
    /// (instead of after the fabric ran idle): the MN's own waits — an unbind, a reset, a push's
    /// fetch-and-add — then interleave with every other chain the NIC runs meanwhile. The clock
    /// moves to the CQ's first completion only once it is there.
    pub fn poll_cq_after(&mut self, qp: QpAddr, queue: QueueSel, out: &mut [Completion], steps: u64) -> Result<usize> {
        let g = self.gq(qp)?;
        self.run_until_idle(steps.max(1));
        if let Some(t) = self.cq_of(g, queue).next_time() {
            if t > self.now {
                self.now = t;
            }
        }
        self.poll(qp, queue, out)
    }

    /// CQEs generated on a CQ since the QP's last reset (what a WAIT compares against).
    pub fn cq_count(&self, qp: QpAddr, queue: QueueSel) -> Result<u64> {
        Ok(self.cq_of(self.gq(qp)?, queue).count)
    }

    // ---- time ------------------------------------------------------------------------------------

    /// The global virtual clock, ns of **modelled** time.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// Run work that becomes ready before `t`, then move the clock to `t` (never backwards).
    pub fn advance_to(&mut self, t: u64) {
        self.run_until(t, self.cfg.poll_max_steps);
        self.now = self.now.max(t);
    }

    /// Charge `ns` of CPU work to host `h` (host-engine mode): the host's CPU is busy from
    /// max(now, its previous work) for `ns`; NIC work ready meanwhile runs; the clock ends at
    /// the end of the CPU work, which is returned. Counts one CPU event.
    pub fn advance_cpu(&mut self, h: HostId, ns: u64) -> Result<u64> {
        let now = self.now;
        let host = self.host_mut(h)?;
        host.cpu_events += 1;
        host.cpu_busy_ns += ns;
        let end = host.cpu_free.max(now).saturating_add(ns);
        host.cpu_free = end;
        self.advance_to(end);
        Ok(end)
    }

    /// Count one MN CPU event without charging time.
    pub fn count_cpu_event(&mut self, h: HostId) -> Result<()> {
        self.host_mut(h)?.cpu_events += 1;
        Ok(())
    }

    // ---- inspection ------------------------------------------------------------------------------

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// A connected pair on one host, both ends in `pd`; returns the requester end. With
    /// `managed_send_depth` its queues are managed (WAIT/ENABLE) and its send ring has exactly
    /// that many entries (an offloaded chain's loop QP).
    pub fn create_loopback_qp(&mut self, h: HostId, pd: PdId, managed_send_depth: Option<u32>) -> Result<QpAddr> {
        let resp = QpConfig::default().with_pd(pd);
        let req = match managed_send_depth {
            Some(d) => QpConfig::managed(d, 1).with_pd(pd),
            None => resp,
        };
        Ok(self.create_connected_pair(h, req, h, resp)?.0)
    }

    /// Signaled work requests posted on a queue whose completions were not yet polled (the
    /// `RdmaBackend::outstanding` of every view of the model).
    pub fn outstanding(&self, qp: QpAddr, queue: QueueSel) -> Option<u64> {
        let s = self.qp_stats(qp).ok()?;
        // posted and not yet polled: still queued, or executed with its completion waiting
        Some(match queue {
            QueueSel::Send => s.send_producer.saturating_sub(s.send_consumer) + s.send_cq_queued as u64,
            QueueSel::Recv => s.recv_producer.saturating_sub(s.recv_consumer) + s.recv_cq_queued as u64,
        })
    }

    pub fn qp_stats(&self, qp: QpAddr) -> Result<QpStats> {
        let q = &self.qps[self.gq(qp)? as usize];
        Ok(QpStats {
            wqes_executed: q.executed,
            wqes_flushed: q.flushed,
            cqes_total: q.cqes_total,
            send_cq_count: self.cqs[q.scq as usize].count,
            recv_cq_count: self.cqs[q.rcq as usize].count,
            send_cq_queued: self.cqs[q.scq as usize].queued(),
            recv_cq_queued: self.cqs[q.rcq as usize].queued(),
            send_producer: q.sq.producer,
            send_consumer: q.sq.consumer,
            send_limit: q.sq.limit,
            recv_producer: q.rq.producer,
            recv_consumer: q.rq.consumer,
            recv_limit: q.rq.limit,
            prefetched: q.pf.len,
        })
    }

    pub fn host_stats(&self, h: HostId) -> Result<HostStats> {
        let host = self.host_any(h)?;
        Ok(HostStats {
            cpu_events: host.cpu_events,
            cpu_busy_ns: host.cpu_busy_ns,
            wqes_executed: host.wqes_executed,
            nic_busy_until: host.nic.busy_until(),
            nic_send_busy_ns: host.nic.send_busy_ns,
            nic_rx_busy_ns: host.nic.rx_busy_ns,
            mem_used: host.mem.used(),
            crashed: host.crashed,
        })
    }

    /// Every live QP of a host.
    pub fn qps_of(&self, h: HostId) -> Vec<Qpn> {
        self.hosts.get(h.0 as usize).map_or(Vec::new(), |host| {
            host.qps
                .iter()
                .filter(|g| **g != NONE)
                .map(|g| Qpn::new(self.qps[*g as usize].qpn).unwrap_or_default())
                .collect()
        })
    }

    /// Completions recorded when `NicConfig::trace` is on.
    pub fn trace(&self) -> &[TraceEvent] {
        &self.trace
    }

    /// FNV-1a digest of every completion generated so far (time, host, qpn, wr_id, status,
    /// opcode, length, immediate): equal digests ⇒ (almost surely) identical runs.
    pub fn digest(&self) -> u64 {
        self.digest
    }

    // ---- faults ------------------------------------------------------------------------------------

    /// The built-in fault plan every request message passes through.
    pub fn faults_mut(&mut self) -> &mut FaultPlan {
        &mut self.faults
    }

    pub fn faults(&self) -> &FaultPlan {
        &self.faults
    }

    /// Install a middleware after the fault plan (applied in installation order).
    pub fn add_middleware(&mut self, m: Box<dyn Middleware>) {
        self.middlewares.push(m);
    }

    /// Crash a host: its QPs vanish (requests towards them fail with `RetryExcErr` and put
    /// the requester in the error state), its memory becomes inaccessible, and every control
    /// call on it returns [`LoopbackError::HostCrashed`].
    pub fn crash_host(&mut self, h: HostId) -> Result<()> {
        let gqs: Vec<u32> = self.host(h)?.qps.clone();
        for g in gqs.into_iter().filter(|g| *g != NONE) {
            self.destroy_gq(g);
        }
        let host = &mut self.hosts[h.0 as usize];
        host.crashed = true;
        host.mem.wipe();
        Ok(())
    }

    /// Reset a host's RNIC: every QP goes to the error state (its queues flush; each needs
    /// [`Fabric::reset_qp`]), every window binding is lost; memory and MRs are kept.
    pub fn reset_rnic(&mut self, h: HostId) -> Result<()> {
        let gqs: Vec<u32> = self.host(h)?.qps.clone();
        for g in gqs.into_iter().filter(|g| *g != NONE) {
            self.set_err(g);
        }
        self.hosts[h.0 as usize].prot.unbind_all();
        Ok(())
    }

    // ---- invariants ----------------------------------------------------------------------------

    /// Internal consistency of the model (tests call it after every step).
    pub fn check_invariants(&self) -> core::result::Result<(), String> {
        let c = &self.counters;
        let cqes: u64 = self.qps.iter().map(|q| q.cqes_total).sum();
        if cqes != c.total_completions() {
            return Err(format!("CQEs per QP sum to {cqes}, counters say {}", c.total_completions()));
        }
        let exec: u64 = self.qps.iter().map(|q| q.executed).sum();
        if exec != c.wqes_executed {
            return Err(format!("executed per QP {exec} != total {}", c.wqes_executed));
        }
        let host_exec: u64 = self.hosts.iter().map(|h| h.wqes_executed).sum();
        if host_exec != c.wqes_executed {
            return Err(format!("executed per host {host_exec} != total"));
        }
        let fl: u64 = self.qps.iter().map(|q| q.flushed).sum();
        if fl != c.wqes_flushed {
            return Err(format!("flushed per QP {fl} != total {}", c.wqes_flushed));
        }
        let mut seen = vec![false; self.qps.len()];
        for &g in &self.active {
            let q = &self.qps[g as usize];
            if seen[g as usize] || !q.in_active || !q.alive {
                return Err(format!("active list corrupt at QP {g}"));
            }
            seen[g as usize] = true;
        }
        for (g, q) in self.qps.iter().enumerate() {
            if q.in_active != seen[g] {
                return Err(format!("QP {g} in_active flag wrong"));
            }
            for (name, cq) in [("send", q.scq), ("recv", q.rcq)] {
                let cq = &self.cqs[cq as usize];
                if cq.count != cq.polled + cq.queued() as u64 + cq.overruns {
                    return Err(format!("QP {:#x} {name} CQ count inconsistent", q.qpn));
                }
            }
            if !q.alive {
                continue;
            }
            for (name, qu) in [("send", &q.sq), ("recv", &q.rq)] {
                if qu.producer.max(qu.consumer) - qu.consumer > qu.depth as u64 {
                    return Err(format!("QP {:#x} {name} queue over-full", q.qpn));
                }
                if !qu.managed && qu.consumer > qu.producer {
                    return Err(format!("QP {:#x} {name} consumer past producer", q.qpn));
                }
            }
            if q.pf.len > q.pf.cap() {
                return Err(format!("QP {:#x} prefetch overflow", q.qpn));
            }
            if q.state == QpState::Rts
                && q.pf.len > 0
                && q.sq.consumer + q.pf.len as u64 > q.sq.end()
                && !(q.sq.managed && q.sq.wqes + q.pf.wqes <= q.sq.wqe_limit)
            {
                return Err(format!("QP {:#x} prefetched past the enable limit", q.qpn));
            }
            if q.state == QpState::Err && q.rq.consumer < q.rq.flush_end() {
                return Err(format!("QP {:#x} in error with unflushed receives", q.qpn));
            }
            if q.state == QpState::Err && q.pf.len > 0 {
                return Err(format!("QP {:#x} in error with a prefetch cache", q.qpn));
            }
        }
        for (i, h) in self.hosts.iter().enumerate() {
            if h.crashed {
                if h.qps.iter().any(|g| *g != NONE) {
                    return Err(format!("crashed host {i} still has QPs"));
                }
                continue;
            }
            for (rkey, g) in h.prot.bound_windows() {
                if self.qps.get(g as usize).map(|q| q.host) != Some(i as u32) {
                    return Err(format!("window {rkey:#x} bound to a QP of another host"));
                }
            }
        }
        Ok(())
    }
}
