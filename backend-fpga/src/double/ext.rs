//! Reference model of the omw extension block (docs/FPGA.md): the responder-side key table
//! with protection domains and the chain sequencer. It executes the core's canonical WQEs
//! ([`omw_core::wire::wqe`]) from rings in the node's memory, with the semantics the core defines;
//! nothing here knows what a chain is for.
//!
//! Every protection decision — local SGEs, remote READ / WRITE / atomics, binds,
//! invalidations, registrations — is the core's shared rule set [`omw_core::device::mw_rules`] in its
//! strict (InfiniBand spec) variant: this model only looks the named objects up and applies
//! the effect a rule allows (the `rules` functions below are that adapter, nothing more).

use super::World;
use crate::encoding::{MAX_LEN_FIELD, MAX_VADDR};
use crate::ext as map;
use crate::ext::{qp as q, Cqe};
use omw_core::access::AccessFlags;
use omw_core::device::mw_rules::{self as rules, KeyTarget, Mode, QpRef};
use omw_core::device::WcStatus;
use omw_core::wire::wqe::{masked_add, Opcode, QueueSel, RecvWqe, Wqe, WqeFlags, RECV_WQE_SIZE, WQE_SIZE};
use std::collections::{BTreeMap, VecDeque};

/// The variant of the shared rules the proposed hardware implements.
const MODE: Mode = Mode::Strict;

/// A bound window: where, for whom, with which rights.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Binding {
    pub qpn: u32,
    pub addr: u64,
    pub len: u32,
    pub access: AccessFlags,
}

/// A memory window's state, for assertions.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct MwInfo {
    pub rkey: u32,
    pub pd: u32,
    pub bound: Option<Binding>,
}

/// A memory region in the key table, for assertions (what a test enumerates when it plays an
/// attacker who knows every key the node handed out).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct MrInfo {
    pub key: u32,
    pub pd: u32,
    pub addr: u64,
    pub len: u64,
    pub access: AccessFlags,
}

#[derive(Clone, Copy, Debug)]
enum Key {
    Mr(rules::Mr),
    Mw(rules::Window),
}

/// First MR index and first MW index (they share the 24-bit index space of the rkey).
const FIRST_MR: u32 = map::FIRST_MR_INDEX;
const FIRST_MW: u32 = map::FIRST_MW_INDEX;
const MAX_KEYS: u32 = 0xFFFF;
/// Ticks a key-mailbox command runs (a model parameter: the host must poll for DONE).
pub(crate) const MAILBOX_TICKS: u8 = 2;
/// log2 of the largest ring the block takes (`CAPS[55:48]`); a larger one is no ring.
const MAX_LOG_RING: u64 = 20;
/// Ticks a QP command runs.
pub(crate) const QP_CMD_TICKS: u8 = 1;

/// The block's key-byte generator: a 32-bit maximal-length Galois LFSR (taps 32, 22, 2, 1;
/// polynomial `0x8020_0003`) seeded at reset and clocked every engine tick and once more per
/// key it hands out; a new MR or window takes its low byte. So key bytes depend on the seed
/// and on when the command ran, never on the index alone (issue 10: mlx5 draws the byte from
/// a device-wide counter, which makes keys sequential). In hardware the seed would come from a
/// TRNG or a host-written seed register at reset; the double takes it from
/// [`super::NodeConfig::key_seed`].
#[derive(Clone, Copy, Debug)]
pub struct KeyLfsr(u32);

impl KeyLfsr {
    pub fn new(seed: u64) -> Self {
        let s = (seed ^ (seed >> 32)) as u32;
        KeyLfsr(if s == 0 { 0xACE1_ACE1 } else { s })
    }
    pub fn clock(&mut self) {
        let lsb = self.0 & 1;
        self.0 >>= 1;
        if lsb != 0 {
            self.0 ^= 0x8020_0003;
        }
    }
    pub fn next_byte(&mut self) -> u8 {
        for _ in 0..8 {
            self.clock();
        }
        self.0 as u8
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum State {
    Reset,
    Init,
    Rts,
    Err,
}

impl State {
    fn code(self) -> u64 {
        match self {
            State::Reset => 0,
            State::Init => 1,
            State::Rts => 3,
            State::Err => 6,
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Queue {
    pi: u64,
    limit: u64,
    ci: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct ExtQp {
    cfg: [u64; 8],
    /// The PD register; INIT takes it into `pd`.
    pd_reg: u64,
    pd: u32,
    state: State,
    inited: bool,
    sq: Queue,
    rq: Queue,
    scq: u64,
    rcq: u64,
    prefetch: VecDeque<[u8; WQE_SIZE]>,
    /// A QP command running: (command, ticks left).
    cmd: Option<(u64, u8)>,
    last_cmd: u64,
    /// The head WQE's request was dropped on the wire and is being retransmitted (counted once).
    wire_dropped: bool,
}

impl ExtQp {
    fn new() -> Self {
        ExtQp {
            cfg: [0; 8],
            pd_reg: 0,
            pd: 0,
            state: State::Reset,
            inited: false,
            sq: Queue::default(),
            rq: Queue::default(),
            scq: 0,
            rcq: 0,
            prefetch: VecDeque::new(),
            cmd: None,
            last_cmd: 0,
            wire_dropped: false,
        }
    }
    /// Entries of a ring: `1 << log`, or 0 when its base register is 0 (no ring).
    fn depth(&self, log_reg: usize) -> u64 {
        let base = match log_reg {
            q::SQ_LOG_DEPTH => self.cfg[q::SQ_BASE],
            q::RQ_LOG_DEPTH => self.cfg[q::RQ_BASE],
            _ => 1, // completion rings: each base is checked where it is used
        };
        match self.cfg[log_reg] {
            _ if base == 0 => 0,
            l if l <= MAX_LOG_RING => 1 << l,
            _ => 0,
        }
    }
    fn managed(&self) -> bool {
        self.cfg[q::FLAGS] & map::QP_FLAG_MANAGED != 0
    }
    fn sq_limit(&self) -> u64 {
        if self.managed() {
            self.sq.limit
        } else {
            self.sq.pi
        }
    }
    fn rq_limit(&self) -> u64 {
        if self.managed() {
            self.rq.limit
        } else {
            self.rq.pi
        }
    }
}

/// A key-mailbox command in progress, with the operands it latched.
#[derive(Clone, Copy, Debug)]
struct MailboxCmd {
    cmd: u64,
    tag: u8,
    addr: u64,
    len: u64,
    access: u64,
    pd: u64,
    arg: u64,
    ticks: u8,
}

pub(crate) struct ExtBlock {
    keys: BTreeMap<u32, Key>,
    next_mr: u32,
    next_mw: u32,
    /// PDs allocated so far; PD 0 exists from reset.
    pds: u32,
    /// Whether this block has protection domains (CAPS bit 8, ALLOC_PD); without, PD 0 only.
    pd_support: bool,
    lfsr: KeyLfsr,
    key_addr: u64,
    key_len: u64,
    key_access: u64,
    key_pd: u64,
    key_arg: u64,
    key_result: u64,
    running: Option<MailboxCmd>,
    pub(crate) collisions: u64,
    mw_regs: [u64; 3],
    events: u64,
    last_event: u64,
    qps: Vec<ExtQp>,
}

impl ExtBlock {
    pub fn new(key_seed: u64, pd_support: bool) -> Self {
        ExtBlock {
            keys: BTreeMap::new(),
            next_mr: FIRST_MR,
            next_mw: FIRST_MW,
            pds: 1,
            pd_support,
            lfsr: KeyLfsr::new(key_seed),
            key_addr: 0,
            key_len: 0,
            key_access: 0,
            key_pd: 0,
            key_arg: 0,
            key_result: 0,
            running: None,
            collisions: 0,
            mw_regs: [0; 3],
            events: 0,
            last_event: 0,
            qps: vec![ExtQp::new(); 64],
        }
    }

    pub fn caps_word(&self) -> u64 {
        use map::caps::*;
        let pds = if self.pd_support { PROTECTION_DOMAINS } else { 0 };
        (KEY_TABLE
            | SEQUENCER
            | ATOMICS
            | MASKED_FETCH_ADD
            | SEND_WITH_INV
            | BIND_TO_OTHER_QP
            | INV_QP_CHECK
            | MW_BOUNDS
            | pds)
            | ((MAX_KEYS - FIRST_MW) as u64) << 32
            | MAX_LOG_RING << 48
    }

    /// What a key's index names, as the shared rules take it.
    fn target(&self, key: u32) -> KeyTarget {
        match self.keys.get(&(key >> 8)) {
            Some(Key::Mr(m)) => KeyTarget::Mr(*m),
            Some(Key::Mw(w)) => KeyTarget::Window(*w),
            None => KeyTarget::None,
        }
    }
    fn window(&self, key: u32) -> Option<rules::Window> {
        match self.keys.get(&(key >> 8)) {
            Some(Key::Mw(w)) => Some(*w),
            _ => None,
        }
    }
    fn set_window(&mut self, w: rules::Window) {
        self.keys.insert(w.rkey >> 8, Key::Mw(w));
    }

    /// The PD of one of this engine's QPs (the one its INIT took).
    pub fn qp_pd(&self, ctid: u8) -> u32 {
        self.qps[ctid as usize].pd
    }

    /// Responder check of an incoming READ / WRITE / atomic arriving on QP `resp` (QPN,
    /// ctid): the address to access, or why the request is refused.
    pub fn remote_check(
        &self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: AccessFlags,
        atomic: bool,
        (resp_qpn, resp_ctid): (u32, u8),
    ) -> Result<u64, rules::RemoteFail> {
        let req = rules::RemoteAccess {
            qp: QpRef { qp: resp_qpn, pd: self.qp_pd(resp_ctid) },
            rkey,
            addr,
            len,
            need,
            atomic,
        };
        rules::check_remote(MODE, self.target(rkey), req)
    }

    /// Requester-side check of a local SGE of QP `ctid`.
    fn local_ok(&self, ctid: u8, lkey: u32, addr: u64, len: u64, write: bool) -> bool {
        if len == 0 {
            return true;
        }
        let sge = rules::LocalSge { pd: self.qp_pd(ctid), lkey, addr, len, write };
        rules::check_local(self.target(lkey), sge).is_ok()
    }

    pub fn has_rq(&self, c: u8) -> bool {
        let x = &self.qps[c as usize];
        x.inited && x.depth(q::RQ_LOG_DEPTH) > 0
    }

    pub fn mw_info(&self, rkey: u32) -> Option<MwInfo> {
        self.window(rkey).map(|w| MwInfo {
            rkey: w.rkey,
            pd: w.pd,
            bound: w.binding.map(|b| Binding { qpn: b.qp, addr: b.addr, len: b.len as u32, access: b.access }),
        })
    }

    /// Every registered MR, in index order.
    pub fn mrs(&self) -> Vec<MrInfo> {
        self.keys
            .values()
            .filter_map(|k| match k {
                Key::Mr(m) => Some(MrInfo { key: m.key, pd: m.pd, addr: m.addr, len: m.len, access: m.access }),
                Key::Mw(_) => None,
            })
            .collect()
    }

    pub fn event(&mut self, qpn: u32, status: WcStatus, wr_id: u64) {
        self.events += 1;
        self.last_event = (qpn as u64 & 0xFF_FFFF) | (status as u64) << 24 | (wr_id & 0xFFFF_FFFF) << 32;
    }

    pub fn connected(&mut self, c: u8) {
        let x = &mut self.qps[c as usize];
        if x.state == State::Init {
            x.state = State::Rts;
        }
    }

    pub fn read(&self, _node: &super::Node, reg: usize) -> u64 {
        match reg {
            map::ID => map::id_word(),
            map::CAPS => self.caps_word(),
            map::KEY_ADDR => self.key_addr,
            map::KEY_LEN => self.key_len,
            map::KEY_ACCESS => self.key_access,
            map::KEY_PD => self.key_pd,
            map::KEY_ARG => self.key_arg,
            map::KEY_RESULT => match self.running {
                Some(c) => map::KEY_RESULT_BUSY | (c.tag as u64) << 40,
                None => self.key_result,
            },
            map::MW_STATE => self.mw_regs[0],
            map::MW_BASE => self.mw_regs[1],
            map::MW_LEN_ACCESS => self.mw_regs[2],
            map::EVENT_COUNT => self.events,
            map::LAST_EVENT => self.last_event,
            r if (map::QP_BASE..map::BLOCK_WORDS).contains(&r) => {
                let x = &self.qps[(r - map::QP_BASE) / map::QP_STRIDE];
                match (r - map::QP_BASE) % map::QP_STRIDE {
                    i if i <= q::FLAGS => x.cfg[i],
                    q::STATE => x.state.code(),
                    q::SQ_PI => x.sq.pi,
                    q::SQ_ENABLE => x.sq_limit(),
                    q::SQ_CI => x.sq.ci,
                    q::SCQ_COUNT => x.scq,
                    q::RQ_PI => x.rq.pi,
                    q::RQ_ENABLE => x.rq_limit(),
                    q::RQ_CI => x.rq.ci,
                    q::RCQ_COUNT => x.rcq,
                    q::PD => x.pd_reg,
                    q::CMD_STATUS => match x.cmd {
                        Some((c, _)) => map::QP_CMD_BUSY | (c & 0xFF) << 8,
                        None => map::QP_CMD_DONE | (x.last_cmd & 0xFF) << 8,
                    },
                    _ => 0,
                }
            }
            _ => 0,
        }
    }

    /// One engine tick of the block's own state: the key generator runs, a mailbox command
    /// advances. True if a command was running.
    pub fn tick(&mut self) -> bool {
        self.lfsr.clock();
        let Some(mut c) = self.running else {
            return false;
        };
        c.ticks = c.ticks.saturating_sub(1);
        if c.ticks > 0 {
            self.running = Some(c);
            return true;
        }
        self.running = None;
        self.key_cmd(c);
        true
    }

    fn key_cmd(&mut self, c: MailboxCmd) {
        let tag = (c.tag as u64) << 40;
        let err = |code: u64| map::KEY_RESULT_ERROR | map::KEY_RESULT_DONE | tag | code << 32;
        let ok = |v: u64| map::KEY_RESULT_DONE | tag | (v & 0xFFFF_FFFF);
        let pd_ok = |pd: u64| pd < self.pds as u64;
        self.key_result = match c.cmd {
            map::key_cmd::ALLOC_PD if !self.pd_support => err(map::key_err::UNKNOWN_CMD),
            map::key_cmd::ALLOC_PD => {
                self.pds += 1;
                ok(self.pds as u64 - 1)
            }
            map::key_cmd::REG_MR => {
                let mem_ok =
                    c.len > 0 && c.addr <= MAX_VADDR && c.addr.checked_add(c.len).is_some_and(|e| e <= MAX_VADDR + 1);
                if !mem_ok {
                    err(map::key_err::BAD_RANGE)
                } else if !pd_ok(c.pd) {
                    err(map::key_err::BAD_PD)
                } else if c.access > u32::MAX as u64 {
                    err(map::key_err::BAD_ACCESS)
                } else if let Err(_why) = rules::check_reg_mr(c.access as u32) {
                    err(map::key_err::BAD_ACCESS)
                } else if self.next_mr >= FIRST_MW {
                    err(map::key_err::TABLE_FULL)
                } else {
                    let key = self.next_mr << 8 | self.lfsr.next_byte() as u32;
                    let access = AccessFlags::from_bits_truncate(c.access as u32);
                    self.keys.insert(
                        self.next_mr,
                        Key::Mr(rules::Mr { pd: c.pd as u32, key, addr: c.addr, len: c.len, access }),
                    );
                    self.next_mr += 1;
                    ok(key as u64)
                }
            }
            map::key_cmd::ALLOC_MW => {
                if !pd_ok(c.pd) {
                    err(map::key_err::BAD_PD)
                } else if self.next_mw >= MAX_KEYS {
                    err(map::key_err::TABLE_FULL)
                } else {
                    let rkey = self.next_mw << 8 | self.lfsr.next_byte() as u32;
                    self.set_window(rules::Window { pd: c.pd as u32, rkey, binding: None });
                    self.next_mw += 1;
                    ok(rkey as u64)
                }
            }
            map::key_cmd::DEALLOC_MW => match rules::check_dealloc(self.window(c.arg as u32), c.arg as u32) {
                Ok(_revoked) => {
                    // the index is not reused, so the revoked binding's rkey never validates again
                    self.keys.remove(&((c.arg as u32) >> 8));
                    ok(c.arg)
                }
                Err(rules::DeallocFail::StaleKey) => err(map::key_err::STALE_KEY),
                Err(_) => err(map::key_err::NO_SUCH_KEY),
            },
            map::key_cmd::QUERY_MW => match self.mw_info(c.arg as u32) {
                Some(m) => {
                    let b = m.bound;
                    self.mw_regs = [
                        m.rkey as u64
                            | (b.is_some() as u64) << 32
                            | 1 << 33
                            | b.map(|b| (b.qpn as u64) << 40).unwrap_or(0),
                        b.map(|b| b.addr).unwrap_or(0),
                        b.map(|b| b.len as u64 | (b.access.bits() as u64) << 32).unwrap_or(0),
                    ];
                    ok(m.rkey as u64)
                }
                None => err(map::key_err::NO_SUCH_KEY),
            },
            _ => err(map::key_err::UNKNOWN_CMD),
        };
    }

    fn mailbox_write(&mut self, reg: usize, value: u64) {
        if self.running.is_some() {
            self.collisions += 1;
            return;
        }
        match reg {
            map::KEY_ADDR => self.key_addr = value,
            map::KEY_LEN => self.key_len = value,
            map::KEY_ACCESS => self.key_access = value,
            map::KEY_PD => self.key_pd = value,
            map::KEY_ARG => self.key_arg = value,
            _ => {
                self.running = Some(MailboxCmd {
                    cmd: value & 0xFF,
                    tag: (value >> 8) as u8,
                    addr: self.key_addr,
                    len: self.key_len,
                    access: self.key_access,
                    pd: self.key_pd,
                    arg: self.key_arg,
                    ticks: MAILBOX_TICKS,
                });
            }
        }
    }
}

fn xb(w: &mut World, n: usize) -> &mut ExtBlock {
    w.nodes[n].ext.as_mut().expect("extension block present")
}
fn xq(w: &mut World, n: usize, c: u8) -> &mut ExtQp {
    &mut xb(w, n).qps[c as usize]
}

pub(crate) fn write(w: &mut World, n: usize, reg: usize, value: u64) {
    match reg {
        map::KEY_ADDR | map::KEY_LEN | map::KEY_ACCESS | map::KEY_PD | map::KEY_ARG | map::KEY_CMD => {
            let e = xb(w, n);
            e.mailbox_write(reg, value);
            w.nodes[n].stats.mailbox_collisions = w.nodes[n].ext.as_ref().map(|e| e.collisions).unwrap_or(0);
        }
        r if (map::QP_BASE..map::BLOCK_WORDS).contains(&r) => {
            let c = ((r - map::QP_BASE) / map::QP_STRIDE) as u8;
            let i = (r - map::QP_BASE) % map::QP_STRIDE;
            match i {
                i if i <= q::FLAGS => xq(w, n, c).cfg[i] = value,
                q::PD => xq(w, n, c).pd_reg = value,
                q::CMD => {
                    let x = xq(w, n, c);
                    if x.cmd.is_none() {
                        x.cmd = Some((value, QP_CMD_TICKS));
                    }
                }
                q::SQ_PI => xq(w, n, c).sq.pi = value,
                q::SQ_ENABLE => {
                    let x = xq(w, n, c);
                    x.sq.limit = x.sq.limit.wrapping_add(value);
                }
                q::RQ_PI => xq(w, n, c).rq.pi = value,
                q::RQ_ENABLE => {
                    let x = xq(w, n, c);
                    x.rq.limit = x.rq.limit.wrapping_add(value);
                }
                _ => {}
            }
        }
        _ => {}
    }
}

/// Run the QP commands whose time has come (called once per engine tick).
pub(crate) fn run_qp_cmds(w: &mut World, n: usize) -> bool {
    let mut progress = false;
    for c in 0..64u8 {
        let Some((cmd, left)) = xq(w, n, c).cmd else {
            continue;
        };
        if left > 1 {
            xq(w, n, c).cmd = Some((cmd, left - 1));
            progress = true;
            continue;
        }
        progress = true;
        let x = xq(w, n, c);
        x.cmd = None;
        x.last_cmd = cmd;
        let connected = w.nodes[n].stock.qps[c as usize].conn.is_some();
        match cmd {
            map::qp_cmd::INIT => {
                let x = xq(w, n, c);
                x.inited = true;
                x.pd = x.pd_reg as u32;
                if x.state == State::Reset {
                    x.state = if connected { State::Rts } else { State::Init };
                }
            }
            map::qp_cmd::RESET => {
                reset(w, n, c);
                if let Some((pn, pc)) = w.peer(n, c) {
                    if pn == n {
                        reset(w, n, pc);
                    }
                }
            }
            map::qp_cmd::DESTROY => {
                let keep = xq(w, n, c).last_cmd;
                *xq(w, n, c) = ExtQp::new();
                xq(w, n, c).last_cmd = keep;
                w.nodes[n].stock.qps[c as usize].conn = None;
            }
            _ => {}
        }
    }
    progress
}

fn reset(w: &mut World, n: usize, c: u8) {
    let connected = w.nodes[n].stock.qps[c as usize].conn.is_some();
    let x = xq(w, n, c);
    if !x.inited {
        return;
    }
    x.state = if connected { State::Rts } else { State::Init };
    x.sq = Queue::default();
    x.rq = Queue::default();
    x.scq = 0;
    x.rcq = 0;
    x.prefetch.clear();
    x.wire_dropped = false;
    // the PSN state is kept: a request refused at the responder consumed no PSN on either
    // end, so one end's RESET leaves the pair in sequence (a fresh connect_qp re-seeds them)
}

fn push_cqe(w: &mut World, n: usize, c: u8, recv: bool, mut cqe: Cqe) {
    cqe.qpn = w.nodes[n].qpn(c);
    let x = xq(w, n, c);
    let depth = x.depth(q::CQ_LOG_DEPTH);
    let (base, count) = if recv { (x.cfg[q::RCQ_BASE], &mut x.rcq) } else { (x.cfg[q::SCQ_BASE], &mut x.scq) };
    let slot = *count;
    *count += 1;
    if depth > 0 && base != 0 {
        let addr = base + (slot % depth) * map::CQE_SIZE as u64;
        let _ = w.nodes[n].write(addr, &cqe.encode());
    }
}

fn wr_id_of(bytes: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&bytes[8..16]);
    u64::from_le_bytes(a)
}

/// Move a QP to the error state and flush what it had been given.
fn to_error(w: &mut World, n: usize, c: u8, status: WcStatus, wr_id: u64) {
    let qpn = w.nodes[n].qpn(c);
    if xq(w, n, c).state == State::Err {
        return;
    }
    xb(w, n).event(qpn, status, wr_id);
    let x = xq(w, n, c);
    x.state = State::Err;
    x.prefetch.clear();
    let (sq_depth, rq_depth) = (x.depth(q::SQ_LOG_DEPTH), x.depth(q::RQ_LOG_DEPTH));
    let (sq_base, rq_base) = (x.cfg[q::SQ_BASE], x.cfg[q::RQ_BASE]);
    let (sq_from, sq_to) = (x.sq.ci, x.sq_limit().min(x.sq.ci + sq_depth));
    let (rq_from, rq_to) = (x.rq.ci, x.rq_limit().min(x.rq.ci + rq_depth));
    x.sq.ci = sq_to;
    x.rq.ci = rq_to;
    for i in sq_from..sq_to {
        let wr = w.nodes[n].read(sq_base + (i % sq_depth) * WQE_SIZE as u64, 16).map(|b| wr_id_of(&b)).unwrap_or(0);
        let op = w.nodes[n].read(sq_base + (i % sq_depth) * WQE_SIZE as u64, 1).map(|b| b[0]).unwrap_or(0);
        push_cqe(w, n, c, false, Cqe { wr_id: wr, status: WcStatus::WrFlushErr as u8, opcode: op, ..Cqe::default() });
    }
    for i in rq_from..rq_to {
        let wr =
            w.nodes[n].read(rq_base + (i % rq_depth) * RECV_WQE_SIZE as u64, 16).map(|b| wr_id_of(&b)).unwrap_or(0);
        push_cqe(
            w,
            n,
            c,
            true,
            Cqe { wr_id: wr, status: WcStatus::WrFlushErr as u8, opcode: map::CQE_OP_RECV, ..Cqe::default() },
        );
    }
}

enum Out {
    Done(u32),
    Blocked,
    Fail(WcStatus, Option<(usize, u8)>),
}

fn refill(w: &mut World, n: usize, c: u8) {
    let pd = w.prefetch;
    loop {
        let x = xq(w, n, c);
        let depth = x.depth(q::SQ_LOG_DEPTH);
        if x.prefetch.len() >= pd || x.prefetch.back().is_some_and(|b| b[0] == Opcode::Wait as u8) {
            return;
        }
        let idx = x.sq.ci + x.prefetch.len() as u64;
        if idx >= x.sq_limit() || depth == 0 {
            return;
        }
        let addr = x.cfg[q::SQ_BASE] + (idx % depth) * WQE_SIZE as u64;
        let mut img = [0xFFu8; WQE_SIZE]; // unreadable ring memory decodes as garbage
        if let Some(b) = w.nodes[n].read(addr, WQE_SIZE as u64) {
            img.copy_from_slice(&b);
        }
        xq(w, n, c).prefetch.push_back(img);
    }
}

/// Execute the next WQE of QP `c`'s send ring; false if it could not make progress.
pub(crate) fn step(w: &mut World, n: usize, c: u8) -> bool {
    {
        let x = xq(w, n, c);
        if x.state != State::Rts || !x.inited || x.depth(q::SQ_LOG_DEPTH) == 0 {
            return false;
        }
    }
    refill(w, n, c);
    let Some(img) = xq(w, n, c).prefetch.front().copied() else {
        return false;
    };
    let wqe = match Wqe::decode(&img) {
        Ok(wqe) => wqe,
        Err(_) => {
            let x = xq(w, n, c);
            x.prefetch.pop_front();
            x.sq.ci += 1;
            let wr = wr_id_of(&img);
            push_cqe(
                w,
                n,
                c,
                false,
                Cqe { wr_id: wr, status: WcStatus::LocQpOpErr as u8, opcode: img[0], ..Cqe::default() },
            );
            to_error(w, n, c, WcStatus::LocQpOpErr, wr);
            return true;
        }
    };
    let out = exec(w, n, c, &wqe);
    match out {
        Out::Blocked => false,
        Out::Done(byte_len) => {
            let x = xq(w, n, c);
            x.prefetch.pop_front();
            x.sq.ci += 1;
            w.nodes[n].stats.wqes_executed += 1;
            if wqe.flags.contains(WqeFlags::SIGNALED) {
                push_cqe(
                    w,
                    n,
                    c,
                    false,
                    Cqe { wr_id: wqe.wr_id, status: 0, opcode: wqe.opcode as u8, byte_len, ..Cqe::default() },
                );
            }
            true
        }
        Out::Fail(status, peer) => {
            let x = xq(w, n, c);
            x.prefetch.pop_front();
            x.sq.ci += 1;
            w.nodes[n].stats.wqes_executed += 1;
            push_cqe(
                w,
                n,
                c,
                false,
                Cqe { wr_id: wqe.wr_id, status: status as u8, opcode: wqe.opcode as u8, ..Cqe::default() },
            );
            to_error(w, n, c, status, wqe.wr_id);
            if let Some((pn, pc)) = peer {
                if w.nodes[pn].ext.is_some() {
                    to_error(w, pn, pc, status, 0);
                }
            }
            true
        }
    }
}

fn exec(w: &mut World, n: usize, c: u8, wqe: &Wqe) -> Out {
    use Opcode::*;
    let my_qpn = w.nodes[n].qpn(c);
    match wqe.opcode {
        Nop => Out::Done(0),
        Wait | Enable => {
            let Some(tc) = w.nodes[n].ctid_of(wqe.qpn) else {
                return Out::Fail(WcStatus::LocQpOpErr, None);
            };
            let t = xq(w, n, tc);
            let recv = wqe.queue_sel() == QueueSel::Recv;
            if wqe.opcode == Wait {
                let count = if recv { t.rcq } else { t.scq };
                if count >= wqe.operand0 {
                    Out::Done(0)
                } else {
                    Out::Blocked
                }
            } else {
                let qu = if recv { &mut t.rq } else { &mut t.sq };
                qu.limit = qu.limit.wrapping_add(wqe.operand0);
                Out::Done(0)
            }
        }
        BindMw => bind(w, n, c, wqe),
        LocalInv => {
            let e = xb(w, n);
            let win = e.window(wqe.imm);
            match rules::check_invalidate(MODE, win, wqe.imm, rules::Invalidator::LocalInv { qp: my_qpn }) {
                Ok(()) => {
                    if let Some(mut wd) = win {
                        wd.binding = None;
                        e.set_window(wd);
                    }
                    Out::Done(0)
                }
                Err(_) => Out::Fail(WcStatus::MwBindErr, None),
            }
        }
        _ => remote_op(w, n, c, wqe),
    }
}

fn bind(w: &mut World, n: usize, c: u8, wqe: &Wqe) -> Out {
    let posting = QpRef { qp: w.nodes[n].qpn(c), pd: xb(w, n).qp_pd(c) };
    let target_ctid = w.nodes[n].ctid_of(wqe.qpn);
    let e = xb(w, n);
    let win = e.window(wqe.imm);
    if wqe.flags.contains(WqeFlags::UNBIND) {
        return match rules::check_invalidate(MODE, win, wqe.imm, rules::Invalidator::Unbind) {
            Ok(()) => {
                if let Some(mut wd) = win {
                    wd.binding = None;
                    e.set_window(wd);
                }
                Out::Done(0)
            }
            Err(_) => Out::Fail(WcStatus::MwBindErr, None),
        };
    }
    let Some(mut window) = win else {
        return Out::Fail(WcStatus::MwBindErr, None);
    };
    let mr = match e.target(wqe.lkey) {
        KeyTarget::Mr(m) if m.key == wqe.lkey => Some(m),
        _ => None,
    };
    let target = target_ctid.map(|tc| QpRef { qp: wqe.qpn, pd: e.qp_pd(tc) });
    let req = rules::BindRequest {
        posting,
        target,
        other_qp_capable: true,
        addr: wqe.local_addr,
        len: wqe.length as u64,
        access: wqe.operand1 as u32,
    };
    // the new key must name this window's index
    if wqe.imm >> 8 != window.rkey >> 8 {
        return Out::Fail(WcStatus::MwBindErr, None);
    }
    match (rules::check_bind(MODE, window, mr, req), mr) {
        (Ok(()), Some(mr)) => {
            window.rkey = wqe.imm;
            window.binding = Some(rules::Binding {
                qp: wqe.qpn,
                addr: wqe.local_addr,
                len: wqe.length as u64,
                access: AccessFlags::from_bits_truncate(wqe.operand1 as u32),
                mr,
            });
            e.set_window(window);
            Out::Done(0)
        }
        _ => Out::Fail(WcStatus::MwBindErr, None),
    }
}

/// The requester's completion status for a responder refusal.
fn nak_status(f: rules::RemoteFail) -> WcStatus {
    match f.nak() {
        rules::Nak::RemoteAccess => WcStatus::RemAccessErr,
        rules::Nak::InvalidRequest => WcStatus::RemInvReqErr,
    }
}

/// A request on the wire: the stack's PSN rule and the link apply to sequencer-posted requests
/// as to stock commands (a dropped request is retransmitted with the same PSN: the ring hangs).
fn remote_op(w: &mut World, n: usize, c: u8, wqe: &Wqe) -> Out {
    let peer = w.peer(n, c);
    if let Some((rn, rc)) = peer {
        if let Err(why) = super::wire::wire_check(w, n, c, rn, rc) {
            if !std::mem::replace(&mut xq(w, n, c).wire_dropped, true) {
                super::wire::count_drop(&mut w.nodes[n].stats, why);
            }
            return Out::Blocked;
        }
    }
    let out = remote_request(w, n, c, wqe);
    if let (Out::Done(_), Some((rn, rc))) = (&out, peer) {
        let npkts = match wqe.opcode {
            Opcode::FetchAdd | Opcode::MaskedFetchAdd | Opcode::CompareSwap => 1,
            _ => super::wire::packets(wqe.length, w.nodes[n].cfg.pmtu),
        };
        super::wire::wire_advance(w, n, c, rn, rc, npkts);
        xq(w, n, c).wire_dropped = false;
    }
    out
}

fn remote_request(w: &mut World, n: usize, c: u8, wqe: &Wqe) -> Out {
    use Opcode::*;
    let len = wqe.length as u64;
    if len > MAX_LEN_FIELD {
        return Out::Fail(WcStatus::LocLenErr, None);
    }
    if wqe.local_addr > MAX_VADDR || (wqe.opcode.is_remote() && wqe.remote_addr > MAX_VADDR) {
        return Out::Fail(WcStatus::LocProtErr, None);
    }
    let Some((rn, rc)) = w.peer(n, c) else {
        return Out::Fail(WcStatus::LocQpOpErr, None);
    };
    let peer = Some((rn, rc));
    let resp_qpn = w.nodes[rn].qpn(rc);
    if let Some(e) = w.nodes[rn].ext.as_ref() {
        if e.qps[rc as usize].state != State::Rts {
            // the responder does not answer: the requester's retries run out
            return Out::Fail(WcStatus::RetryExcErr, None);
        }
    }
    let local_ok = |w: &World, write: bool, l: u64| {
        w.nodes[n].ext.as_ref().is_some_and(|e| e.local_ok(c, wqe.lkey, wqe.local_addr, l, write))
    };
    // the address to access at the responder, or the requester's status
    let remote = |w: &World, need: AccessFlags, l: u64, atomic: bool| match w.nodes[rn].ext.as_ref() {
        Some(e) => e.remote_check(wqe.rkey, wqe.remote_addr, l, need, atomic, (resp_qpn, rc)).map_err(nak_status),
        None => Ok(wqe.remote_addr), // the stock responder checks nothing
    };
    match wqe.opcode {
        Read => {
            if !local_ok(w, true, len) {
                return Out::Fail(WcStatus::LocProtErr, None);
            }
            let at = match remote(w, AccessFlags::REMOTE_READ, len, false) {
                Ok(a) => a,
                Err(st) => return Out::Fail(st, peer),
            };
            let Some(data) = w.nodes[rn].read(at, len) else {
                return Out::Fail(WcStatus::RemAccessErr, peer);
            };
            if !w.nodes[n].write(wqe.local_addr, &data) {
                return Out::Fail(WcStatus::LocProtErr, None);
            }
            Out::Done(wqe.length)
        }
        Write | WriteWithImm => {
            if !local_ok(w, false, len) {
                return Out::Fail(WcStatus::LocProtErr, None);
            }
            let at = match remote(w, AccessFlags::REMOTE_WRITE, len, false) {
                Ok(a) => a,
                Err(st) => return Out::Fail(st, peer),
            };
            let Some(data) = w.nodes[n].read(wqe.local_addr, len) else {
                return Out::Fail(WcStatus::LocProtErr, None);
            };
            if wqe.opcode == WriteWithImm {
                let Some(e) = w.nodes[rn].ext.as_ref() else {
                    return Out::Fail(WcStatus::RemInvReqErr, None);
                };
                if !e.has_rq(rc) {
                    return Out::Fail(WcStatus::RemInvReqErr, peer);
                }
                let x = &e.qps[rc as usize];
                if x.rq.ci >= x.rq_limit() {
                    return Out::Blocked; // RNR: retried
                }
            }
            if !w.nodes[rn].write(at, &data) {
                return Out::Fail(WcStatus::RemAccessErr, peer);
            }
            if wqe.opcode == WriteWithImm {
                let x = xq(w, rn, rc);
                let (base, depth, idx) = (x.cfg[q::RQ_BASE], x.depth(q::RQ_LOG_DEPTH), x.rq.ci);
                x.rq.ci += 1;
                let wr = w.nodes[rn].read(base + (idx % depth) * RECV_WQE_SIZE as u64, 16).map(|b| wr_id_of(&b));
                push_cqe(
                    w,
                    rn,
                    rc,
                    true,
                    Cqe {
                        wr_id: wr.unwrap_or(0),
                        status: 0,
                        opcode: map::CQE_OP_RECV_RDMA_WITH_IMM,
                        flags: map::CQE_FLAG_IMM,
                        byte_len: wqe.length,
                        imm: wqe.imm,
                        ..Cqe::default()
                    },
                );
            }
            Out::Done(wqe.length)
        }
        Send | SendWithImm | SendWithInv => {
            if !local_ok(w, false, len) {
                return Out::Fail(WcStatus::LocProtErr, None);
            }
            let Some(data) = w.nodes[n].read(wqe.local_addr, len) else {
                return Out::Fail(WcStatus::LocProtErr, None);
            };
            let imm = (wqe.opcode == SendWithImm).then_some(wqe.imm);
            let inv = (wqe.opcode == SendWithInv).then_some(wqe.imm);
            match deliver_send(w, rn, rc, &data, imm, inv) {
                Ok(true) => Out::Done(wqe.length),
                Ok(false) => Out::Blocked,
                Err(s) => Out::Fail(s, peer),
            }
        }
        FetchAdd | MaskedFetchAdd | CompareSwap => {
            if w.nodes[rn].ext.is_none() {
                return Out::Fail(WcStatus::RemInvReqErr, peer); // the stock engine has no atomics
            }
            if !local_ok(w, true, 8) {
                return Out::Fail(WcStatus::LocProtErr, None);
            }
            let at = match remote(w, AccessFlags::REMOTE_ATOMIC, 8, true) {
                Ok(a) => a,
                Err(st) => return Out::Fail(st, peer),
            };
            let Some(old) = w.nodes[rn].read_u64(at) else {
                return Out::Fail(WcStatus::RemAccessErr, peer);
            };
            let new = match wqe.opcode {
                FetchAdd => old.wrapping_add(wqe.operand0),
                MaskedFetchAdd => masked_add(old, wqe.operand0, wqe.operand1),
                _ => {
                    if old == wqe.operand0 {
                        wqe.operand1
                    } else {
                        old
                    }
                }
            };
            let _ = w.nodes[rn].write(at, &new.to_le_bytes());
            if !w.nodes[n].write(wqe.local_addr, &old.to_le_bytes()) {
                return Out::Fail(WcStatus::LocProtErr, None);
            }
            Out::Done(8)
        }
        _ => Out::Fail(WcStatus::LocQpOpErr, None),
    }
}

/// Whether a SEND arriving at `rc` would find an enabled receive entry.
pub(crate) fn rq_ready(w: &World, rn: usize, rc: u8) -> bool {
    w.nodes[rn].ext.as_ref().is_some_and(|e| {
        let x = &e.qps[rc as usize];
        x.rq.ci < x.rq_limit()
    })
}

/// Deliver a SEND's payload into the responder's receive ring: `Ok(false)` when no receive
/// entry is enabled (RNR, the requester retries), `Err(status)` for the requester when the
/// responder refuses (the responder QP then enters the error state).
pub(crate) fn deliver_send(
    w: &mut World,
    rn: usize,
    rc: u8,
    data: &[u8],
    imm: Option<u32>,
    inv: Option<u32>,
) -> Result<bool, WcStatus> {
    let resp_qpn = w.nodes[rn].qpn(rc);
    let Some(e) = w.nodes[rn].ext.as_ref() else {
        return Err(WcStatus::RemInvReqErr);
    };
    if !e.has_rq(rc) {
        return Err(WcStatus::RemInvReqErr);
    }
    let x = &e.qps[rc as usize];
    if x.state != State::Rts {
        return Err(WcStatus::RetryExcErr);
    }
    if x.rq.ci >= x.rq_limit() {
        return Ok(false);
    }
    let (base, depth, idx) = (x.cfg[q::RQ_BASE], x.depth(q::RQ_LOG_DEPTH), x.rq.ci);
    let slot = base + (idx % depth) * RECV_WQE_SIZE as u64;
    let recv = w.nodes[rn].read(slot, RECV_WQE_SIZE as u64).and_then(|b| RecvWqe::decode(&b).ok());
    let fail = |w: &mut World, wr_id: u64, st: WcStatus, req: WcStatus| {
        xq(w, rn, rc).rq.ci += 1;
        push_cqe(w, rn, rc, true, Cqe { wr_id, status: st as u8, opcode: map::CQE_OP_RECV, ..Cqe::default() });
        to_error(w, rn, rc, st, wr_id);
        Err(req)
    };
    let Some(recv) = recv else {
        return fail(w, 0, WcStatus::LocQpOpErr, WcStatus::RemOpErr);
    };
    if recv.total_len() < data.len() as u64 {
        return fail(w, recv.wr_id, WcStatus::LocLenErr, WcStatus::RemInvReqErr);
    }
    // check every scatter entry before writing any
    let e = w.nodes[rn].ext.as_ref().expect("checked above");
    let mut left = data.len() as u64;
    for s in &recv.sges {
        let take = left.min(s.length as u64);
        if !e.local_ok(rc, s.lkey, s.addr, take, true) || w.nodes[rn].mem_range(s.addr, take).is_none() {
            return fail(w, recv.wr_id, WcStatus::LocProtErr, WcStatus::RemOpErr);
        }
        left -= take;
    }
    if let Some(rkey) = inv {
        let win = e.window(rkey);
        if rules::check_invalidate(MODE, win, rkey, rules::Invalidator::SendWithInv { qp: resp_qpn }).is_err() {
            return fail(w, recv.wr_id, WcStatus::RemInvReqErr, WcStatus::RemInvReqErr);
        }
        if let Some(mut wd) = win {
            wd.binding = None;
            xb(w, rn).set_window(wd);
        }
    }
    let mut off = 0usize;
    for s in &recv.sges {
        let take = (data.len() - off).min(s.length as usize);
        let _ = w.nodes[rn].write(s.addr, &data[off..off + take]);
        off += take;
    }
    xq(w, rn, rc).rq.ci += 1;
    let flags = if imm.is_some() { map::CQE_FLAG_IMM } else { 0 } | if inv.is_some() { map::CQE_FLAG_INV } else { 0 };
    push_cqe(
        w,
        rn,
        rc,
        true,
        Cqe {
            wr_id: recv.wr_id,
            status: 0,
            opcode: map::CQE_OP_RECV,
            flags,
            byte_len: data.len() as u32,
            imm: imm.unwrap_or(0),
            invalidated: inv.unwrap_or(0),
            ..Cqe::default()
        },
    );
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::KeyLfsr;

    #[test]
    fn key_generator_never_sticks() {
        for seed in [0, 1, u64::MAX, 0x1234_5678_9ABC_DEF0] {
            let mut l = KeyLfsr::new(seed);
            let bytes: Vec<u8> = (0..512).map(|_| l.next_byte()).collect();
            let distinct = bytes.iter().collect::<std::collections::BTreeSet<_>>().len();
            assert!(distinct > 200, "seed {seed:#x}: {distinct} distinct bytes");
        }
    }
}
