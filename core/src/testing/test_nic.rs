//! The minimal test NIC: a deterministic, allocation-free multi-node RDMA fabric, just big
//! enough to run a host-engine MN and its CNs over the device traits
//! ([`RdmaBackend`](crate::device::RdmaBackend)) — in unit tests, benches and
//! the freestanding `nostd-check` binary. Behind the `test-nic` feature.
//!
//! Why a second device next to omw-loopback: the loopback model needs `std` and models what
//! offload needs (WQE rings in memory, WAIT/ENABLE, self-modifying chains, timing). This one
//! has fixed capacities (const generics, `heapless`), caller-provided memory arenas and no
//! clock, so it runs where the core runs. It implements only what the host engine and CNs use
//! and declares exactly that in [`TestNic::capabilities`]; managed queues, WAIT/ENABLE and
//! SEND_WITH_INV are refused with [`NicError::Unsupported`].
//!
//! Semantics, and where they come from:
//! - **Protection** is decided by [`crate::device::mw_rules`] (DESIGN.md §3, IBTA Vol. 1 ch. 10.6.7 and
//!   9.9.6.3): local SGEs by `check_local`, remote READ/WRITE/atomics by `check_remote`, binds
//!   by `check_bind`, LOCAL_INV and the MN's UNBIND by `check_invalidate`, registrations by
//!   `check_reg_mr`. [`Mode::Strict`] is the spec; [`Mode::Rxe`] is Linux soft-RoCE (window
//!   bounds not enforced, LOCAL_INV from any QP, no masked atomics), and the capabilities say so.
//! - **Keys**: MRs and windows share one 24-bit index space per fabric (as mkeys do on mlx5);
//!   a key resolves only on the node that owns the object, so a node's key names nothing on
//!   another node. lkey = rkey for MRs.
//! - **RC queue pairs** execute their send queue strictly in order. A SEND / WRITE_WITH_IMM
//!   whose responder has no receive posted waits at the head of the queue (RNR with an infinite
//!   retry count, `rnr_retry = 7`), and everything behind it waits too. Unsignaled WQEs that
//!   succeed leave no completion; errors always do (`ibv_post_send(3)`).
//! - **Errors** follow the IBTA completion rules as rxe reports them (`rxe_comp.c`,
//!   `rxe_resp.c`): a local protection / length / bind error moves the requester to ERR; a NAK
//!   (remote access, invalid request, remote operation error) moves both ends to ERR; a request
//!   towards a peer that is gone or in ERR ends with `RETRY_EXC_ERR`. Entering ERR flushes
//!   every outstanding send and receive with `WR_FLUSH_ERR`, and work posted in ERR is flushed
//!   at once (`ibv_post_send(3)`: "posted in the error state ... completed with flush").
//! - **Capacities** are fixed: a post that could overflow its completion queue is refused with
//!   [`NicError::QueueFull`] instead, so completions are never lost.
//!
//! Every input a WQE carries (address, key, QP number, length, opcode) ends in a completion
//! status or a typed [`NicError`]; nothing indexes unchecked.

use crate::chain::mlx5::Mlx5Arm;
use crate::chain::mlx5::Mlx5Chain;
use crate::device::DataPath;
use crate::device::OffloadRings;
use crate::device::Provision;
use crate::device::WindowState;
use core::cell::RefCell;
use core::fmt;
use core::ops::Range;

use heapless::{Deque, Vec};

use crate::access::AccessFlags;
use crate::device::mw_rules::{
    self, BindRequest, Binding, Invalidator, KeyTarget, LocalSge, Mode, Mr, Nak, QpRef, RemoteAccess, Window,
};
use crate::device::{Capabilities, Completion, Domain, MrKeys, MwBinding, QpState, WcOpcode, WcStatus};
use crate::ids::{Qpn, Rkey};
use crate::wire::wqe::{masked_add, Opcode, QueueSel, RecvWqe, Wqe, WqeFlags};

/// Send work requests a QP holds before it refuses more (posted and not yet executed).
pub const SQ_DEPTH: usize = 16;
/// Receives a QP holds posted.
pub const RQ_DEPTH: usize = 16;
/// Completions each of a QP's two completion queues holds; posts are refused before they could
/// overflow it.
pub const CQ_DEPTH: usize = 32;
/// QP numbers are `QPN_BASE + slot`, unique on the fabric.
pub const QPN_BASE: u32 = 0x100;
/// Node `i`'s memory starts at `(i + 1) * NODE_STRIDE`, so an address of one node is no
/// address of another.
pub const NODE_STRIDE: u64 = 1 << 36;

/// A node of the fabric (an index, in the order [`TestNic::add_node`] returned them).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u8);

/// Why the test NIC refused a call (a WQE's own faults are completion statuses instead).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum NicError {
    NoSuchNode(NodeId),
    /// Not a live QP of the calling node.
    NoSuchQp(Qpn),
    TooManyNodes,
    TooManyQps,
    /// The MR and window table is full.
    TooManyKeys,
    QueueFull {
        qp: Qpn,
        queue: QueueSel,
    },
    OutOfMemory {
        need: u64,
        free: u64,
    },
    /// An alignment that is zero or not a power of two.
    BadAlign(u64),
    /// Not inside memory this node allocated.
    OutOfRange {
        addr: u64,
        len: u64,
    },
    BadAccess(mw_rules::RegMrFail),
    /// Something this device does not implement (its capabilities do not claim it either).
    Unsupported(&'static str),
    /// The fabric is borrowed already (a re-entrant call; cannot happen through the views).
    Busy,
}

impl fmt::Display for NicError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NicError::NoSuchNode(n) => write!(f, "no node {}", n.0),
            NicError::NoSuchQp(q) => write!(f, "QP {q} is not a live QP of this node"),
            NicError::TooManyNodes => f.write_str("node table full"),
            NicError::TooManyQps => f.write_str("QP table full"),
            NicError::TooManyKeys => f.write_str("MR/MW table full"),
            NicError::QueueFull { qp, queue } => write!(f, "{queue:?} queue of QP {qp} full"),
            NicError::OutOfMemory { need, free } => write!(f, "node memory exhausted: need {need} B, {free} B free"),
            NicError::BadAlign(a) => write!(f, "alignment {a} is not a power of two"),
            NicError::OutOfRange { addr, len } => write!(f, "[{addr:#x}, +{len}) is not memory of this node"),
            NicError::BadAccess(e) => write!(f, "registration refused: {e:?}"),
            NicError::Unsupported(what) => write!(f, "the test NIC does not implement {what}"),
            NicError::Busy => f.write_str("test NIC already borrowed (re-entrant call)"),
        }
    }
}

type Result<T> = core::result::Result<T, NicError>;

struct NodeMem<'m> {
    mem: &'m mut [u8],
    base: u64,
    /// Bytes handed out by `alloc_memory` (a bump allocator: the address space only grows).
    used: usize,
}

/// An entry of the key table (index `i + 1`; index 0 names nothing).
#[derive(Clone, Copy, Debug)]
enum KeyObj {
    Mr { node: u8, mr: Mr },
    Mw { node: u8, w: Window },
}

struct Qp {
    qpn: Qpn,
    node: u8,
    pd: u32,
    state: QpState,
    alive: bool,
    /// Slot of the other end (itself never: a loopback pair is two QPs).
    peer: usize,
    sq: Deque<Wqe, SQ_DEPTH>,
    rq: Deque<RecvWqe, RQ_DEPTH>,
    scq: Deque<Completion, CQ_DEPTH>,
    rcq: Deque<Completion, CQ_DEPTH>,
}

impl Qp {
    // Room is never in doubt: a post is refused ([`NicError::QueueFull`]) while a queue and
    // its completion queue together hold CQ_DEPTH entries, a work request leaves its queue as
    // its completion enters, and a reset empties the queues.
    fn complete_send(&mut self, c: Completion) {
        let pushed = self.scq.push_back(c);
        debug_assert!(pushed.is_ok(), "sq + scq <= CQ_DEPTH: post_send refuses beyond");
    }
    fn complete_recv(&mut self, c: Completion) {
        let pushed = self.rcq.push_back(c);
        debug_assert!(pushed.is_ok(), "rq + rcq <= CQ_DEPTH: post_recv refuses beyond");
    }
}

/// What executing the head of a send queue did.
enum Exec {
    /// The responder has no receive posted: try again when it posts one.
    Blocked,
    /// The requester's completion status and byte count.
    Done(WcStatus, u32),
}

/// The fabric: `N` nodes, `Q` queue pairs, `K` MRs and windows, memory lent by the caller.
/// Share it as a `RefCell` and speak for one node through a [`Node`] view.
pub struct TestNic<'m, const N: usize, const Q: usize, const K: usize> {
    mode: Mode,
    nodes: Vec<NodeMem<'m>, N>,
    qps: Vec<Qp, Q>,
    keys: Vec<KeyObj, K>,
    /// A range of one node's memory whose CPU reads are counted ([`TestNic::watch_reads`]):
    /// how tests show a path's table reads do not grow with the pool.
    watch: Option<(u8, u64, u64)>,
    watched_reads: core::cell::Cell<u64>,
}

impl<const N: usize, const Q: usize, const K: usize> fmt::Debug for TestNic<'_, N, Q, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestNic")
            .field("mode", &self.mode)
            .field("nodes", &self.nodes.len())
            .field("qps", &self.qps.len())
            .field("keys", &self.keys.len())
            .finish()
    }
}

const fn pd_of(node: u8, d: Domain) -> u32 {
    (node as u32) * 2 + matches!(d, Domain::MnPrivate) as u32
}

/// The key byte of a fresh object: a fixed function of its index (deterministic, not zero for
/// most indices, so a key built from the index alone is usually stale).
const fn fresh_key(index: u32) -> u32 {
    (index << 8) | ((index.wrapping_mul(37).wrapping_add(11)) & 0xFF)
}

impl<'m, const N: usize, const Q: usize, const K: usize> TestNic<'m, N, Q, K> {
    pub const fn new(mode: Mode) -> Self {
        TestNic {
            mode,
            nodes: Vec::new(),
            qps: Vec::new(),
            keys: Vec::new(),
            watch: None,
            watched_reads: core::cell::Cell::new(0),
        }
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Exactly what this device implements (never more): type-2 windows whose QP binding is
    /// enforced, FAA and CAS (through windows too), and in strict mode the bound-QP check on LOCAL_INV, window bounds
    /// and masked FAA. No WAIT/ENABLE, no self-modifying WQEs (the host engine runs the chains),
    /// no bind to another QP, no SEND_WITH_INV.
    pub fn capabilities(&self) -> Capabilities {
        let base = Capabilities::SECURE_MINIMUM | Capabilities::ATOMICS | Capabilities::MW_ATOMICS;
        match self.mode {
            Mode::Strict => {
                base | Capabilities::MASKED_FETCH_ADD
                    | Capabilities::MW_QP_CHECK_ON_INVALIDATE
                    | Capabilities::MW_BOUNDS_ENFORCED
            }
            Mode::Rxe => base,
        }
    }

    /// Add a node whose memory is `mem` (zeroed as it is handed out by `alloc_memory`).
    pub fn add_node(&mut self, mem: &'m mut [u8]) -> Result<NodeId> {
        let i = self.nodes.len();
        let id = u8::try_from(i).map_err(|_| NicError::TooManyNodes)?;
        let base = (i as u64 + 1) * NODE_STRIDE;
        self.nodes.push(NodeMem { mem, base, used: 0 }).map_err(|_| NicError::TooManyNodes)?;
        Ok(NodeId(id))
    }

    fn node(&self, n: NodeId) -> Result<&NodeMem<'m>> {
        self.nodes.get(n.0 as usize).ok_or(NicError::NoSuchNode(n))
    }

    // ---- memory --------------------------------------------------------------------------

    /// Zeroed memory of node `n`, `align`-aligned (a power of two).
    pub fn alloc_memory(&mut self, n: NodeId, len: u64, align: u64) -> Result<u64> {
        if align == 0 || !align.is_power_of_two() {
            return Err(NicError::BadAlign(align));
        }
        let m = self.nodes.get_mut(n.0 as usize).ok_or(NicError::NoSuchNode(n))?;
        let cap = m.mem.len() as u64;
        let free = cap - m.used as u64;
        let oom = NicError::OutOfMemory { need: len, free };
        let at = (m.base + m.used as u64).checked_next_multiple_of(align).ok_or(oom)?;
        let start = at - m.base;
        let end = start.checked_add(len).filter(|e| *e <= cap).ok_or(oom)?;
        let (s, e) = (start as usize, end as usize);
        m.mem[s..e].fill(0);
        m.used = e;
        Ok(at)
    }

    fn range(&self, n: u8, addr: u64, len: u64) -> Result<Range<usize>> {
        let m = self.nodes.get(n as usize).ok_or(NicError::NoSuchNode(NodeId(n)))?;
        let bad = NicError::OutOfRange { addr, len };
        let off = addr.checked_sub(m.base).ok_or(bad)?;
        let end = off.checked_add(len).ok_or(bad)?;
        if end > m.used as u64 {
            return Err(bad);
        }
        Ok(off as usize..end as usize)
    }

    /// Read node memory (the node's CPU; no protection check).
    pub fn read(&self, n: NodeId, addr: u64, buf: &mut [u8]) -> Result<()> {
        let r = self.range(n.0, addr, buf.len() as u64)?;
        buf.copy_from_slice(&self.node(n)?.mem[r]);
        if let Some((w, lo, hi)) = self.watch {
            if w == n.0 && addr < hi && addr + buf.len() as u64 > lo {
                self.watched_reads.set(self.watched_reads.get() + 1);
            }
        }
        Ok(())
    }

    /// Count node `n`'s CPU reads ([`TestNic::read`], what `read_local` does) that touch
    /// `[lo, hi)` from now on; the count starts again at 0.
    pub fn watch_reads(&mut self, n: NodeId, lo: u64, hi: u64) {
        self.watch = Some((n.0, lo, hi));
        self.watched_reads.set(0);
    }

    /// Reads counted since [`TestNic::watch_reads`] (or the last call): taken, so the count
    /// starts again at 0.
    pub fn take_watched_reads(&self) -> u64 {
        self.watched_reads.replace(0)
    }

    /// Write node memory (the node's CPU; no protection check).
    pub fn write(&mut self, n: NodeId, addr: u64, data: &[u8]) -> Result<()> {
        let r = self.range(n.0, addr, data.len() as u64)?;
        self.nodes[n.0 as usize].mem[r].copy_from_slice(data);
        Ok(())
    }

    /// DMA between two nodes' memories (or within one), in small steps so no buffer the size
    /// of a transfer is needed.
    fn copy(&mut self, src: u8, src_addr: u64, dst: u8, dst_addr: u64, len: u64) -> Result<()> {
        self.range(src, src_addr, len)?;
        self.range(dst, dst_addr, len)?;
        let mut buf = [0u8; 64];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(64) as usize;
            let s = self.range(src, src_addr + done, n as u64)?;
            buf[..n].copy_from_slice(&self.nodes[src as usize].mem[s]);
            let d = self.range(dst, dst_addr + done, n as u64)?;
            self.nodes[dst as usize].mem[d].copy_from_slice(&buf[..n]);
            done += n as u64;
        }
        Ok(())
    }

    fn read_u64(&self, n: u8, addr: u64) -> Result<u64> {
        let r = self.range(n, addr, 8)?;
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.nodes[n as usize].mem[r]);
        Ok(u64::from_le_bytes(b))
    }

    fn write_u64(&mut self, n: u8, addr: u64, v: u64) -> Result<()> {
        let r = self.range(n, addr, 8)?;
        self.nodes[n as usize].mem[r].copy_from_slice(&v.to_le_bytes());
        Ok(())
    }

    // ---- keys ----------------------------------------------------------------------------

    /// What `key`'s index names *on node `n`* (another node's object is no object here).
    fn lookup(&self, n: u8, key: u32) -> KeyTarget {
        let idx = (key >> 8) as usize;
        match idx.checked_sub(1).and_then(|i| self.keys.get(i)) {
            Some(KeyObj::Mr { node, mr }) if *node == n => KeyTarget::Mr(*mr),
            Some(KeyObj::Mw { node, w }) if *node == n => KeyTarget::Window(*w),
            _ => KeyTarget::None,
        }
    }

    fn window_mut(&mut self, n: u8, key: u32) -> Option<&mut Window> {
        let idx = ((key >> 8) as usize).checked_sub(1)?;
        match self.keys.get_mut(idx)? {
            KeyObj::Mw { node, w } if *node == n => Some(w),
            _ => None,
        }
    }

    fn window(&self, n: u8, key: u32) -> Option<Window> {
        match self.lookup(n, key) {
            KeyTarget::Window(w) => Some(w),
            _ => None,
        }
    }

    fn next_key(&self) -> Result<u32> {
        if self.keys.is_full() {
            return Err(NicError::TooManyKeys);
        }
        Ok(fresh_key(self.keys.len() as u32 + 1))
    }

    /// Register `[addr, addr+len)` of node `n`'s allocated memory in `domain`.
    pub fn reg_mr(&mut self, n: NodeId, domain: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys> {
        let access = mw_rules::check_reg_mr(access.bits()).map_err(NicError::BadAccess)?;
        self.range(n.0, addr, len)?;
        let key = self.next_key()?;
        let mr = Mr { pd: pd_of(n.0, domain), key, addr, len, access };
        self.keys.push(KeyObj::Mr { node: n.0, mr }).map_err(|_| NicError::TooManyKeys)?;
        Ok(MrKeys { lkey: key, rkey: key })
    }

    /// A type-2 window of node `n` in its CN-facing domain (where windows live, `device/mod.rs`
    /// `Domain`), unbound; returns its key.
    pub fn alloc_mw(&mut self, n: NodeId) -> Result<Rkey> {
        self.node(n)?;
        let key = self.next_key()?;
        let w = Window { pd: pd_of(n.0, Domain::CnFacing), rkey: key, binding: None };
        self.keys.push(KeyObj::Mw { node: n.0, w }).map_err(|_| NicError::TooManyKeys)?;
        Ok(Rkey(key))
    }

    pub fn mw_binding(&self, n: NodeId, rkey: Rkey) -> Option<MwBinding> {
        let idx = rkey.index();
        let w = self.window(n.0, idx << 8)?;
        Some(match w.binding {
            Some(b) => MwBinding::Bound { rkey: Rkey(w.rkey), qpn: Qpn::new(b.qp).ok()? },
            None => MwBinding::Unbound,
        })
    }

    pub fn mw_span(&self, n: NodeId, rkey: Rkey) -> Option<(u64, u64)> {
        let w = self.window(n.0, rkey.index() << 8)?;
        let b = w.binding.filter(|_| w.rkey == rkey.0)?;
        Some((b.addr, b.len))
    }

    /// Device-state corruption for tests of the MN's audit and invariants: every window of node
    /// `n` forgets its binding (what an RNIC reset does to windows).
    pub fn lose_bindings(&mut self, n: NodeId) {
        for k in self.keys.iter_mut() {
            if let KeyObj::Mw { node, w } = k {
                if *node == n.0 {
                    w.binding = None;
                }
            }
        }
    }

    /// Device-state corruption for tests: re-point the window with `rkey`'s index at QP number
    /// `qpn` (which need not exist), keeping its span and key, or — for an unbound window — bind
    /// it as `rkey` over `span = (addr, len, lkey of the MR)`. Returns whether it took effect.
    pub fn force_binding(&mut self, n: NodeId, rkey: Rkey, qpn: u32, span: Option<(u64, u64, u32)>) -> bool {
        let mr = span.and_then(|(_, _, k)| match self.lookup(n.0, k) {
            KeyTarget::Mr(m) => Some(m),
            _ => None,
        });
        let Some(w) = self.window_mut(n.0, rkey.index() << 8) else { return false };
        match (&mut w.binding, span, mr) {
            (Some(b), _, _) => b.qp = qpn,
            (None, Some((addr, len, _)), Some(mr)) => {
                w.rkey = rkey.0;
                w.binding = Some(Binding { qp: qpn, addr, len, access: AccessFlags::DATA_WINDOW, mr })
            }
            _ => return false,
        }
        true
    }

    // ---- queue pairs ---------------------------------------------------------------------

    fn new_qp(&mut self, n: u8, d: Domain, peer: usize) -> Result<usize> {
        let slot = self.qps.len();
        let qpn = Qpn::new(QPN_BASE + slot as u32).map_err(|_| NicError::TooManyQps)?;
        let qp = Qp {
            qpn,
            node: n,
            pd: pd_of(n, d),
            state: QpState::Rts,
            alive: true,
            peer,
            sq: Deque::new(),
            rq: Deque::new(),
            scq: Deque::new(),
            rcq: Deque::new(),
        };
        self.qps.push(qp).map_err(|_| NicError::TooManyQps)?;
        Ok(slot)
    }

    /// A connected RC pair: one end on node `a` in `da`, the other on `b` in `db` (`a == b`
    /// is a loopback pair). Both start in RTS.
    pub fn connect(&mut self, a: NodeId, da: Domain, b: NodeId, db: Domain) -> Result<(Qpn, Qpn)> {
        self.node(a)?;
        self.node(b)?;
        if self.qps.capacity() - self.qps.len() < 2 {
            return Err(NicError::TooManyQps);
        }
        let s = self.qps.len();
        self.new_qp(a.0, da, s + 1)?;
        self.new_qp(b.0, db, s)?;
        Ok((self.qps[s].qpn, self.qps[s + 1].qpn))
    }

    /// `RdmaBackend::create_loopback_qp`: a pair on node `n`, both ends in `domain`; returns
    /// the end the node posts on. Managed queues (offloaded chains) are the loopback model's.
    pub fn create_loopback_qp(&mut self, n: NodeId, domain: Domain, managed_send_depth: Option<u32>) -> Result<Qpn> {
        if managed_send_depth.is_some() {
            return Err(NicError::Unsupported("managed send queues (WAIT/ENABLE)"));
        }
        Ok(self.connect(n, domain, n, domain)?.0)
    }

    /// The slot of a live QP of node `n`.
    fn slot(&self, n: NodeId, qp: Qpn) -> Result<usize> {
        let s = qp.get().checked_sub(QPN_BASE).ok_or(NicError::NoSuchQp(qp))? as usize;
        match self.qps.get(s) {
            Some(q) if q.alive && q.node == n.0 => Ok(s),
            _ => Err(NicError::NoSuchQp(qp)),
        }
    }

    pub fn qp_state(&self, n: NodeId, qp: Qpn) -> Result<QpState> {
        Ok(self.qps[self.slot(n, qp)?].state)
    }

    /// Work requests posted on `qp`'s `queue` and not yet executed.
    pub fn outstanding(&self, n: NodeId, qp: Qpn, queue: QueueSel) -> Result<u64> {
        let q = &self.qps[self.slot(n, qp)?];
        Ok(match queue {
            QueueSel::Send => q.sq.len(),
            QueueSel::Recv => q.rq.len(),
        } as u64)
    }

    pub fn post_send(&mut self, n: NodeId, qp: Qpn, w: &Wqe) -> Result<()> {
        let s = self.slot(n, qp)?;
        match w.opcode {
            Opcode::Wait | Opcode::Enable => return Err(NicError::Unsupported("WAIT/ENABLE")),
            Opcode::SendWithInv => return Err(NicError::Unsupported("SEND_WITH_INV")),
            Opcode::MaskedFetchAdd if self.mode == Mode::Rxe => {
                return Err(NicError::Unsupported("masked fetch-and-add (rxe has none)"))
            }
            _ => {}
        }
        let q = &mut self.qps[s];
        if q.sq.is_full() || q.sq.len() + q.scq.len() >= CQ_DEPTH {
            return Err(NicError::QueueFull { qp, queue: QueueSel::Send });
        }
        if q.state == QpState::Err {
            q.complete_send(flushed(q.qpn, w.wr_id, WcOpcode::Send(w.opcode)));
            return Ok(());
        }
        let pushed = q.sq.push_back(*w);
        debug_assert!(pushed.is_ok(), "not full: checked above");
        self.progress(s);
        Ok(())
    }

    pub fn post_recv(&mut self, n: NodeId, qp: Qpn, w: &RecvWqe) -> Result<()> {
        let s = self.slot(n, qp)?;
        let q = &mut self.qps[s];
        if q.rq.is_full() || q.rq.len() + q.rcq.len() >= CQ_DEPTH {
            return Err(NicError::QueueFull { qp, queue: QueueSel::Recv });
        }
        if q.state == QpState::Err {
            q.complete_recv(flushed(q.qpn, w.wr_id, WcOpcode::Recv));
            return Ok(());
        }
        let pushed = q.rq.push_back(w.clone());
        debug_assert!(pushed.is_ok(), "not full: checked above");
        // a sender waiting for this receive (RNR) may go on
        let p = q.peer;
        self.progress(p);
        Ok(())
    }

    pub fn poll_cq(&mut self, n: NodeId, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize> {
        let s = self.slot(n, qp)?;
        // the RNR retry: a head waiting on a peer that has since failed ends now
        self.progress(s);
        let q = &mut self.qps[s];
        let cq = match queue {
            QueueSel::Send => &mut q.scq,
            QueueSel::Recv => &mut q.rcq,
        };
        let mut k = 0;
        while k < out.len() {
            match cq.pop_front() {
                Some(c) => {
                    out[k] = c;
                    k += 1;
                }
                None => break,
            }
        }
        Ok(k)
    }

    /// `RdmaBackend::reset_qp`: both ends back to RTS with empty queues. A peer on another
    /// node keeps the completions it already had (another host cannot take them away), as in
    /// omw-loopback's `Fabric::reset_qp`.
    pub fn reset_qp(&mut self, n: NodeId, qp: Qpn) -> Result<()> {
        let s = self.slot(n, qp)?;
        let p = self.qps[s].peer;
        reset(&mut self.qps[s], true);
        let remote = self.qps.get(p).is_some_and(|pq| pq.alive && pq.node != n.0);
        if let Some(pq) = self.qps.get_mut(p).filter(|pq| pq.alive) {
            reset(pq, !remote);
        }
        Ok(())
    }

    /// The QP stops resolving; its peer sees the connection fail (ERR, flushed). Windows bound
    /// to it stay bound, and unusable, until invalidated.
    pub fn destroy_qp(&mut self, n: NodeId, qp: Qpn) -> Result<()> {
        let s = self.slot(n, qp)?;
        reset(&mut self.qps[s], true);
        self.qps[s].alive = false;
        self.qps[s].state = QpState::Reset;
        let p = self.qps[s].peer;
        if self.qps.get(p).is_some_and(|q| q.alive) {
            self.set_error(p);
        }
        Ok(())
    }

    fn set_error(&mut self, s: usize) {
        let Some(q) = self.qps.get_mut(s) else { return };
        q.state = QpState::Err;
        while let Some(w) = q.sq.pop_front() {
            q.complete_send(flushed(q.qpn, w.wr_id, WcOpcode::Send(w.opcode)));
        }
        while let Some(r) = q.rq.pop_front() {
            q.complete_recv(flushed(q.qpn, r.wr_id, WcOpcode::Recv));
        }
    }

    /// Run QP `s`'s send queue as far as it goes (a head waiting for a receive stays). A post on
    /// `s` or a receive posted at its peer lets it move; so does its peer failing, which the
    /// next poll of `s` notices (the RNR retry). Deterministic.
    fn progress(&mut self, s: usize) {
        while self.step(s) {}
    }

    fn step(&mut self, s: usize) -> bool {
        let q = &self.qps[s];
        if !q.alive || q.state != QpState::Rts {
            return false;
        }
        let Some(w) = q.sq.front().copied() else { return false };
        match self.execute(s, &w) {
            Exec::Blocked => false,
            Exec::Done(status, len) => {
                let q = &mut self.qps[s];
                // the head was executed: it leaves (its copy is `w`)
                q.sq.pop_front();
                if !status.is_ok() || w.flags.contains(WqeFlags::SIGNALED) {
                    let qpn = q.qpn;
                    q.complete_send(Completion {
                        wr_id: w.wr_id,
                        status,
                        opcode: WcOpcode::Send(w.opcode),
                        qpn,
                        byte_len: len,
                        imm: None,
                        invalidated: None,
                    });
                }
                if !status.is_ok() {
                    self.set_error(s);
                }
                true
            }
        }
    }

    fn check_local_sge(&self, s: usize, addr: u64, lkey: u32, len: u64, write: bool) -> bool {
        let q = &self.qps[s];
        let sge = LocalSge { pd: q.pd, lkey, addr, len, write };
        len == 0 || mw_rules::check_local(self.lookup(q.node, lkey), sge).is_ok()
    }

    /// The responder's check of a remote access arriving on the peer of `s`: the effective
    /// address, or the requester's status (and the responder goes to ERR, RC class C NAK).
    fn check_remote_at(
        &mut self,
        peer: usize,
        w: &Wqe,
        need: AccessFlags,
        atomic: bool,
    ) -> core::result::Result<u64, WcStatus> {
        let p = &self.qps[peer];
        let req = RemoteAccess {
            qp: QpRef { qp: p.qpn.get(), pd: p.pd },
            rkey: w.rkey,
            addr: w.remote_addr,
            len: w.length as u64,
            need,
            atomic,
        };
        mw_rules::check_remote(self.mode, self.lookup(p.node, w.rkey), req).map_err(|f| {
            self.set_error(peer);
            match f.nak() {
                Nak::RemoteAccess => WcStatus::RemAccessErr,
                Nak::InvalidRequest => WcStatus::RemInvReqErr,
            }
        })
    }

    fn execute(&mut self, s: usize, w: &Wqe) -> Exec {
        let (node, qpn, pd, peer) = {
            let q = &self.qps[s];
            (q.node, q.qpn, q.pd, q.peer)
        };
        let len = w.length as u64;
        let done = |st: WcStatus| Exec::Done(st, 0);
        if w.opcode.is_remote() || matches!(w.opcode, Opcode::Send | Opcode::SendWithImm) {
            match self.qps.get(peer) {
                Some(p) if p.alive && p.state == QpState::Rts => {}
                _ => return done(WcStatus::RetryExcErr),
            }
        }
        let pnode = self.qps.get(peer).map_or(node, |p| p.node);
        match w.opcode {
            Opcode::Nop => Exec::Done(WcStatus::Success, 0),
            Opcode::Send | Opcode::SendWithImm => {
                if !self.check_local_sge(s, w.local_addr, w.lkey, len, false) {
                    return done(WcStatus::LocProtErr);
                }
                let Some(r) = self.qps[peer].rq.pop_front() else { return Exec::Blocked };
                let fail = |nic: &mut Self, recv: WcStatus, req: WcStatus| {
                    let p = &mut nic.qps[peer];
                    let c = Completion { status: recv, ..flushed(p.qpn, r.wr_id, WcOpcode::Recv) };
                    p.complete_recv(c);
                    nic.set_error(peer);
                    done(req)
                };
                if len > r.total_len() {
                    return fail(self, WcStatus::LocLenErr, WcStatus::RemInvReqErr);
                }
                let mut left = len;
                for sge in r.sges.iter() {
                    let n = left.min(sge.length as u64);
                    if !self.check_local_sge(peer, sge.addr, sge.lkey, n, true) {
                        return fail(self, WcStatus::LocProtErr, WcStatus::RemOpErr);
                    }
                    left -= n;
                }
                let (mut off, mut left) = (0u64, len);
                for sge in r.sges.iter() {
                    let n = left.min(sge.length as u64);
                    if self.copy(node, w.local_addr + off, pnode, sge.addr, n).is_err() {
                        return fail(self, WcStatus::LocProtErr, WcStatus::RemOpErr);
                    }
                    off += n;
                    left -= n;
                }
                let p = &mut self.qps[peer];
                let qpn = p.qpn;
                p.complete_recv(Completion {
                    wr_id: r.wr_id,
                    status: WcStatus::Success,
                    opcode: WcOpcode::Recv,
                    qpn,
                    byte_len: w.length,
                    imm: (w.opcode == Opcode::SendWithImm).then_some(w.imm),
                    invalidated: None,
                });
                Exec::Done(WcStatus::Success, w.length)
            }
            Opcode::Write | Opcode::WriteWithImm => {
                if !self.check_local_sge(s, w.local_addr, w.lkey, len, false) {
                    return done(WcStatus::LocProtErr);
                }
                // rxe_resp.c checks resources (a receive for the immediate) before the rkey
                let imm = w.opcode == Opcode::WriteWithImm;
                if imm && self.qps[peer].rq.is_empty() {
                    return Exec::Blocked;
                }
                let eff = match self.check_remote_at(peer, w, AccessFlags::REMOTE_WRITE, false) {
                    Ok(a) => a,
                    Err(st) => return done(st),
                };
                if self.copy(node, w.local_addr, pnode, eff, len).is_err() {
                    self.set_error(peer);
                    return done(WcStatus::RemAccessErr);
                }
                if imm {
                    let p = &mut self.qps[peer];
                    if let Some(r) = p.rq.pop_front() {
                        let qpn = p.qpn;
                        p.complete_recv(Completion {
                            wr_id: r.wr_id,
                            status: WcStatus::Success,
                            opcode: WcOpcode::RecvRdmaWithImm,
                            qpn,
                            byte_len: w.length,
                            imm: Some(w.imm),
                            invalidated: None,
                        });
                    }
                }
                Exec::Done(WcStatus::Success, w.length)
            }
            Opcode::Read => {
                if !self.check_local_sge(s, w.local_addr, w.lkey, len, true) {
                    return done(WcStatus::LocProtErr);
                }
                let eff = match self.check_remote_at(peer, w, AccessFlags::REMOTE_READ, false) {
                    Ok(a) => a,
                    Err(st) => return done(st),
                };
                if self.copy(pnode, eff, node, w.local_addr, len).is_err() {
                    self.set_error(peer);
                    return done(WcStatus::RemAccessErr);
                }
                Exec::Done(WcStatus::Success, w.length)
            }
            Opcode::FetchAdd | Opcode::MaskedFetchAdd | Opcode::CompareSwap => {
                if w.length != 8 {
                    return done(WcStatus::LocLenErr);
                }
                if !self.check_local_sge(s, w.local_addr, w.lkey, 8, true) {
                    return done(WcStatus::LocProtErr);
                }
                let eff = match self.check_remote_at(peer, w, AccessFlags::REMOTE_ATOMIC, true) {
                    Ok(a) => a,
                    Err(st) => return done(st),
                };
                let Ok(old) = self.read_u64(pnode, eff) else {
                    self.set_error(peer);
                    return done(WcStatus::RemAccessErr);
                };
                let new = match w.opcode {
                    Opcode::FetchAdd => old.wrapping_add(w.operand0),
                    Opcode::MaskedFetchAdd => masked_add(old, w.operand0, w.operand1),
                    _ if old == w.operand0 => w.operand1,
                    _ => old,
                };
                if self.write_u64(pnode, eff, new).is_err() || self.write_u64(node, w.local_addr, old).is_err() {
                    return done(WcStatus::LocProtErr);
                }
                Exec::Done(WcStatus::Success, 8)
            }
            Opcode::BindMw if w.flags.contains(WqeFlags::UNBIND) => {
                // omw's management unbind (mlx5 UMR free form): the PD's owner revokes a window
                // of its own node from a QP of the window's PD, without the bound-QP check.
                let ok = self.window(node, w.imm).filter(|win| win.pd == pd).is_some_and(|win| {
                    mw_rules::check_invalidate(self.mode, Some(win), w.imm, Invalidator::Unbind).is_ok()
                });
                match self.window_mut(node, w.imm).filter(|_| ok) {
                    Some(win) => {
                        win.binding = None;
                        done(WcStatus::Success)
                    }
                    None => done(WcStatus::MwBindErr),
                }
            }
            Opcode::BindMw => {
                let Some(win) = self.window(node, w.imm) else { return done(WcStatus::MwBindErr) };
                let mr = match self.lookup(node, w.lkey) {
                    KeyTarget::Mr(m) if m.key == w.lkey => Some(m),
                    _ => None,
                };
                let target = Qpn::new(w.qpn)
                    .ok()
                    .and_then(|q| self.slot(NodeId(node), q).ok())
                    .map(|t| QpRef { qp: self.qps[t].qpn.get(), pd: self.qps[t].pd });
                let Ok(access) = u32::try_from(w.operand1) else { return done(WcStatus::MwBindErr) };
                let req = BindRequest {
                    posting: QpRef { qp: qpn.get(), pd },
                    target,
                    other_qp_capable: false,
                    addr: w.local_addr,
                    len,
                    access,
                };
                let (Ok(()), Some(mr), Some(t)) = (mw_rules::check_bind(self.mode, win, mr, req), mr, target) else {
                    return done(WcStatus::MwBindErr);
                };
                let access = AccessFlags::from_bits_truncate(access);
                if let Some(win) = self.window_mut(node, w.imm) {
                    win.rkey = w.imm;
                    win.binding = Some(Binding { qp: t.qp, addr: w.local_addr, len, access, mr });
                }
                done(WcStatus::Success)
            }
            Opcode::LocalInv => {
                let win = self.window(node, w.imm);
                match mw_rules::check_invalidate(self.mode, win, w.imm, Invalidator::LocalInv { qp: qpn.get() }) {
                    Ok(()) => {
                        if let Some(win) = self.window_mut(node, w.imm) {
                            win.binding = None;
                        }
                        done(WcStatus::Success)
                    }
                    // rxe reports a refused invalidation as a QP operation error (mw_rules)
                    Err(_) if self.mode == Mode::Rxe => done(WcStatus::LocQpOpErr),
                    Err(_) => done(WcStatus::MwBindErr),
                }
            }
            // refused at post time
            Opcode::SendWithInv | Opcode::Wait | Opcode::Enable => done(WcStatus::LocQpOpErr),
        }
    }
}

fn flushed(qpn: Qpn, wr_id: u64, opcode: WcOpcode) -> Completion {
    Completion { wr_id, status: WcStatus::WrFlushErr, opcode, qpn, byte_len: 0, imm: None, invalidated: None }
}

fn reset(q: &mut Qp, clear_cqs: bool) {
    q.state = QpState::Rts;
    q.sq.clear();
    q.rq.clear();
    if clear_cqs {
        q.scq.clear();
        q.rcq.clear();
    }
}

/// One node of a shared [`TestNic`], as the core's backend contract sees it. Views borrow the
/// fabric only for the duration of each call, so an MN driver and CN drivers can each own one.
pub struct Node<'a, 'm, const N: usize, const Q: usize, const K: usize> {
    nic: &'a RefCell<TestNic<'m, N, Q, K>>,
    id: NodeId,
}

impl<const N: usize, const Q: usize, const K: usize> fmt::Debug for Node<'_, '_, N, Q, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node").field("id", &self.id).finish()
    }
}

impl<'a, 'm, const N: usize, const Q: usize, const K: usize> Node<'a, 'm, N, Q, K> {
    pub fn new(nic: &'a RefCell<TestNic<'m, N, Q, K>>, id: NodeId) -> Self {
        Node { nic, id }
    }
    pub fn id(&self) -> NodeId {
        self.id
    }
    /// The whole fabric (to wire QPs between nodes, or to corrupt device state in a test).
    pub fn nic(&self) -> &'a RefCell<TestNic<'m, N, Q, K>> {
        self.nic
    }
    fn with<R>(&self, f: impl FnOnce(&mut TestNic<'m, N, Q, K>, NodeId) -> Result<R>) -> Result<R> {
        let mut nic = self.nic.try_borrow_mut().map_err(|_| NicError::Busy)?;
        f(&mut nic, self.id)
    }
    fn peek<R>(&self, f: impl FnOnce(&TestNic<'m, N, Q, K>, NodeId) -> Result<R>) -> Result<R> {
        let nic = self.nic.try_borrow().map_err(|_| NicError::Busy)?;
        f(&nic, self.id)
    }
    /// A connected RC pair from this node (`mine` domain) to node `to` (`theirs`): (this end,
    /// the other end).
    pub fn connect_to(&self, mine: Domain, to: NodeId, theirs: Domain) -> Result<(Qpn, Qpn)> {
        self.with(|n, id| n.connect(id, mine, to, theirs))
    }
}

impl<const N: usize, const Q: usize, const K: usize> DataPath for Node<'_, '_, N, Q, K> {
    type Error = NicError;
    fn capabilities(&self) -> Capabilities {
        // only a re-entrant borrow fails (Busy): a device that cannot answer claims nothing
        self.peek(|n, _| Ok(n.capabilities())).unwrap_or(Capabilities::empty())
    }
    fn post_send(&mut self, qp: Qpn, wqe: &Wqe) -> Result<()> {
        self.with(|n, id| n.post_send(id, qp, wqe))
    }
    fn post_recv(&mut self, qp: Qpn, wqe: &RecvWqe) -> Result<()> {
        self.with(|n, id| n.post_recv(id, qp, wqe))
    }
    fn poll_cq(&mut self, qp: Qpn, queue: QueueSel, out: &mut [Completion]) -> Result<usize> {
        self.with(|n, id| n.poll_cq(id, qp, queue, out))
    }
    fn enable(&mut self, _: Qpn, _: QueueSel, _: u64) -> Result<()> {
        Err(NicError::Unsupported("WAIT/ENABLE"))
    }
    fn reset_qp(&mut self, qp: Qpn) -> Result<()> {
        self.with(|n, id| n.reset_qp(id, qp))
    }
    fn destroy_qp(&mut self, qp: Qpn) -> Result<()> {
        self.with(|n, id| n.destroy_qp(id, qp))
    }
    fn qp_state(&self, qp: Qpn) -> Result<QpState> {
        self.peek(|n, id| n.qp_state(id, qp))
    }
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        self.peek(|n, id| n.read(id, addr, buf))
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<()> {
        self.with(|n, id| n.write(id, addr, data))
    }
    fn outstanding(&self, qp: Qpn, queue: QueueSel) -> Option<u64> {
        // `None` is the trait's "cannot tell": for a QP that is not this node's, or a
        // re-entrant borrow
        self.peek(|n, id| n.outstanding(id, qp, queue)).ok()
    }
}

impl<const N: usize, const Q: usize, const K: usize> Provision for Node<'_, '_, N, Q, K> {
    fn reg_mr(&mut self, domain: Domain, addr: u64, len: u64, access: AccessFlags) -> Result<MrKeys> {
        self.with(|n, id| n.reg_mr(id, domain, addr, len, access))
    }
    fn alloc_mw(&mut self) -> Result<Rkey> {
        self.with(|n, id| n.alloc_mw(id))
    }
    fn alloc_memory(&mut self, len: u64, align: u64) -> Result<u64> {
        self.with(|n, id| n.alloc_memory(id, len, align))
    }
    fn create_loopback_qp(&mut self, domain: Domain, managed_send_depth: Option<u32>) -> Result<Qpn> {
        self.with(|n, id| n.create_loopback_qp(id, domain, managed_send_depth))
    }
}

impl<const N: usize, const Q: usize, const K: usize> OffloadRings for Node<'_, '_, N, Q, K> {
    fn ring_base(&self, _: Qpn, _: QueueSel) -> Result<u64> {
        Err(NicError::Unsupported("WQE rings in memory (no chain offload)"))
    }
    /// No rings: the CN-facing "ring registration" is key 0, which names nothing (as verbs
    /// reports it); the private domain, which only offload uses, has none.
    fn ring_keys(&self, domain: Domain) -> Result<MrKeys> {
        match domain {
            Domain::CnFacing => Ok(MrKeys { lkey: 0, rkey: 0 }),
            Domain::MnPrivate => Err(NicError::Unsupported("WQE rings in memory (no chain offload)")),
        }
    }
    /// No chains run here: nothing to count laps from.
    fn send_wqes_executed(&self, _: Qpn) -> Option<u64> {
        None
    }
    /// No chains, no doorbell record for them.
    fn recv_doorbell(&self, _: Qpn) -> Result<Option<crate::device::RecvDoorbell>> {
        Ok(None)
    }
}

impl<const N: usize, const Q: usize, const K: usize> WindowState for Node<'_, '_, N, Q, K> {
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        // `None` (cannot tell) also for a re-entrant borrow, the only error `peek` has here
        self.peek(|n, id| Ok(n.mw_binding(id, rkey))).ok().flatten()
    }
    fn mw_span(&self, rkey: Rkey) -> Option<(u64, u64)> {
        self.peek(|n, id| Ok(n.mw_span(id, rkey))).ok().flatten()
    }
}

impl<const N: usize, const Q: usize, const K: usize> Mlx5Arm for Node<'_, '_, N, Q, K> {
    fn cq_numbers(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> Option<[u32; 3]> {
        None
    }
    fn cq_producer_indices(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> [u32; 3] {
        [0; 3]
    }
    fn arm_mlx5(&mut self, _chain: &Mlx5Chain, _recv_copies: u32) -> Option<core::result::Result<(), Self::Error>> {
        None
    }
}

#[cfg(test)]
mod tests;
