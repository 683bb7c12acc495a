//! The bring-up experiments that answer the open ConnectX questions
//! (`omw_core::device::behaviour::Question`, docs/MLX5.md "The question table"), one module
//! per question, each designed so that what the device does distinguishes the answers:
//!
//! | question | module | what it does |
//! |---|---|---|
//! | `wait_prefetch` | [`wait_prefetch`] | a WRITE behind an unsatisfied WAIT, rewritten by the host while gated: which version runs |
//! | `recv_enable` | [`recv_enable`] | a receive posted by doorbell on a `cd_slave_receive` QP, a SEND to it: lands, or waits for a RECV_EN |
//! | `send_en_unit` | [`send_en_unit`] | a 4-WQEBB READ and two WRITEs on a `cd_slave_send` QP, SEND_EN to index 2, then 5 |
//! | `self_enable` | [`self_enable`] | a QP whose first WQE SEND_ENs itself past two WRITEs |
//! | `foreign_bind` | [`foreign_bind`] | a bind posted on QP A naming QP B, READs through the window from B's peer and A's |
//!
//! Two more steps answer what no layout varies over but the MN needs: `recv_publish`
//! ([`recv_publish`]: may the chains publish their own receives) and `unchecked_unbind`
//! ([`unchecked_unbind`]: a window bound on B to B, invalidated from A without the QPN check,
//! READ from B's peer before and after — the chains' and the MN's unbinds).
//!
//! Every step prints what it posted and what the device did, and returns a [`Finding`]: an
//! answer, or unknown with the reason (the device did something neither answer predicts, or a
//! call failed). The steps are written against [`DevxDevice`], so they run on a ConnectX
//! (`ffi::RealDevx`, through `omw-mlx5-bringup`) and, for their command and WQE bytes,
//! against the recording mock (`tests.rs`); the mock executes nothing, so there every step
//! must come out unknown. Nothing here has run on a ConnectX.

pub mod foreign_bind;
pub mod recv_enable;
pub mod recv_publish;
pub mod self_enable;
pub mod send_en_unit;
#[cfg(test)]
mod tests;
pub mod unchecked_unbind;
pub mod wait_prefetch;

use super::api::{MemRange, UarHandle};
use super::arm;
use super::cm::{self, CmQpAttr, LocalPath};
use super::device::DevxDevice;
use super::doorbell;
use super::profile::{Profile, Timestamp};
use super::queue::{self, CqSpec, DevxCq, DevxQp, QpSpec};
use super::DevxError;
use omw_core::access::AccessFlags;
use omw_core::chain::mlx5::RecvSge;
use omw_core::device::behaviour::{
    DeviceAnswers, ForeignBind, Question, RecvEnable, SelfEnable, SendEnUnit, WaitPrefetch,
};
use omw_core::device::{Domain, MrKeys};
use omw_core::mlx5::cqe::{self, Cqe};
use omw_core::mlx5::ctrl::PrevWqe;
use omw_core::mlx5::data::DataSeg;
use omw_core::mlx5::encode::{self, encode, encode_scatter_read, Mlx5Wqe, QueueResolver, Unmanaged};
use omw_core::mlx5::prm::hca_cap::HcaCaps;
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::mlx5::wqebb::{WqeIndex, WQEBB};
use omw_core::wire::wqe::{QueueSel, Wqe, WqeFlags};
use std::io::Write;
use std::time::{Duration, Instant};

/// How long the steps wait: for a completion, and for the device to act on what was posted
/// before they look at memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Patience {
    pub completion: Duration,
    pub settle: Duration,
}

impl Patience {
    /// On a ConnectX: completions within 2 s, 200 ms to settle (RoCE round trips are µs; the
    /// margins absorb a loaded host).
    pub const HARDWARE: Patience = Patience { completion: Duration::from_secs(2), settle: Duration::from_millis(200) };
    /// Against the recording mock, which executes nothing: look once.
    pub const NONE: Patience = Patience { completion: Duration::ZERO, settle: Duration::ZERO };
}

/// What a step found out about its question.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Finding<T> {
    Answer(T),
    /// The device did something neither answer predicts, or the step could not run; why.
    Unknown(&'static str),
}

impl<T: Copy> Finding<T> {
    pub fn answer(&self) -> Option<T> {
        match self {
            Finding::Answer(a) => Some(*a),
            Finding::Unknown(_) => None,
        }
    }
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            Finding::Unknown(r) => Some(r),
            Finding::Answer(_) => None,
        }
    }
}

/// Why a step that failed a DEVX call says unknown (the call and its error are printed).
pub const CALL_FAILED: &str = "a DEVX call or PRM command failed (printed above)";

/// Every question's finding.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Findings {
    pub wait_prefetch: Finding<WaitPrefetch>,
    pub recv_enable: Finding<RecvEnable>,
    pub send_en_unit: Finding<SendEnUnit>,
    pub self_enable: Finding<SelfEnable>,
    pub foreign_bind: Finding<ForeignBind>,
    /// Not a layout question: whether the chains may publish their own receives
    /// (`recv_publish`, docs/MLX5.md question 20).
    pub recv_publish: Finding<omw_core::device::behaviour::RecvPublish>,
    /// Not a layout question either: whether the chains' and the MN's unbinds work at all
    /// (`unchecked_unbind`, docs/MLX5.md question 21); the MN offloads only where they do.
    pub unchecked_unbind: Finding<omw_core::device::behaviour::UncheckedUnbind>,
}

impl Findings {
    pub fn answers(&self) -> DeviceAnswers {
        DeviceAnswers {
            wait_prefetch: self.wait_prefetch.answer(),
            recv_enable: self.recv_enable.answer(),
            send_en_unit: self.send_en_unit.answer(),
            self_enable: self.self_enable.answer(),
            foreign_bind: self.foreign_bind.answer(),
        }
    }
    /// Why each unknown answer is unknown.
    pub fn notes(&self) -> Vec<(Question, &'static str)> {
        [
            (Question::WaitPrefetch, self.wait_prefetch.reason()),
            (Question::RecvEnable, self.recv_enable.reason()),
            (Question::SendEnUnit, self.send_en_unit.reason()),
            (Question::SelfEnable, self.self_enable.reason()),
            (Question::ForeignBind, self.foreign_bind.reason()),
        ]
        .into_iter()
        .filter_map(|(q, r)| r.map(|r| (q, r)))
        .collect()
    }
    /// The profile of device `device` with firmware `firmware`, measured at `date`.
    pub fn profile(&self, device: &str, firmware: &str, date: Timestamp) -> Profile {
        Profile {
            device: device.into(),
            firmware: firmware.into(),
            date,
            answers: self.answers(),
            recv_publish: self.recv_publish.answer(),
            unchecked_unbind: self.unchecked_unbind.answer(),
        }
    }
}

/// Run every question's step on `rig`'s device, in the table's order.
pub fn questions<D: DevxDevice>(rig: &mut Rig<'_, D>) -> Findings {
    rig.say(format_args!("== wait_prefetch: {}?", Question::WaitPrefetch));
    let wait_prefetch = rig.step(wait_prefetch::run);
    rig.say(format_args!("== recv_enable: {}?", Question::RecvEnable));
    let recv_enable = rig.step(recv_enable::run);
    rig.say(format_args!("== send_en_unit: {}?", Question::SendEnUnit));
    let send_en_unit = rig.step(send_en_unit::run);
    rig.say(format_args!("== self_enable: {}?", Question::SelfEnable));
    let self_enable = rig.step(self_enable::run);
    rig.say(format_args!("== foreign_bind: {}?", Question::ForeignBind));
    let foreign_bind = rig.step(foreign_bind::run);
    rig.say(format_args!(
        "== recv_publish: does a receive doorbell record written by the HCA's own DMA publish the receive?"
    ));
    let recv_publish = rig.step(recv_publish::run);
    rig.say(format_args!(
        "== unchecked_unbind: does an invalidate without the QPN check revoke a window bound to another QP?"
    ));
    let unchecked_unbind = rig.step(unchecked_unbind::run);
    Findings { wait_prefetch, recv_enable, send_en_unit, self_enable, foreign_bind, recv_publish, unchecked_unbind }
}

/// log2 WQEBBs of every step QP's send ring: no step posts more than this, so no WQE wraps.
pub const LOG_SQ: u8 = 6;
/// log2 entries of a step QP's receive queue, and its stride (16 << 2 = 64 bytes: up to four
/// data segments).
pub const LOG_RQ: u8 = 2;
pub const LOG_RQ_STRIDE: u8 = 2;
/// log2 CQEs of every step CQ.
pub const LOG_CQES: u8 = 6;

/// A CQ of a step, with the consumer index the step has reached.
#[derive(Clone, Copy, Debug)]
pub struct Cq {
    pub devx: DevxCq,
    ci: u32,
}

/// A QP of a step: its CQs and what has been written to its send ring.
#[derive(Clone, Debug)]
pub struct Qp {
    pub devx: DevxQp,
    pub send_cq: Cq,
    pub recv_cq: Option<Cq>,
    /// Producer index: the next WQE goes here.
    pub pi: WqeIndex,
    prev: PrevWqe,
    /// The control segment of each WQE written, by the index it ends at (what a doorbell up to
    /// that index writes to the UAR).
    ends: Vec<(u16, [u8; 16])>,
    rq_head: u32,
}

impl Qp {
    pub fn qpn(&self) -> u32 {
        self.devx.qpn
    }
}

/// Registered memory of a step.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Buf {
    pub addr: u64,
    pub len: usize,
    pub keys: MrKeys,
}

/// Every SEND_EN / RECV_EN names this absolute index.
#[derive(Clone, Copy, Debug)]
pub struct EnableAt(pub u16);

/// A remote address and the rkey that reaches it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Remote {
    pub addr: u64,
    pub rkey: u32,
}
impl QueueResolver for EnableAt {
    fn cqn(&self, _: u32, _: QueueSel) -> Option<u32> {
        None
    }
    fn enable_index(&mut self, _: u32, _: QueueSel, _: u64) -> Option<WqeIndex> {
        Some(WqeIndex::new(self.0))
    }
}

/// Every WAIT names this CQ (its count is the absolute producer index waited for).
#[derive(Clone, Copy, Debug)]
pub struct WaitOn(pub u32);
impl QueueResolver for WaitOn {
    fn cqn(&self, _: u32, _: QueueSel) -> Option<u32> {
        Some(self.0)
    }
    fn enable_index(&mut self, _: u32, _: QueueSel, _: u64) -> Option<WqeIndex> {
        None
    }
}

/// What one completion poll saw, for printing.
pub fn show(c: &Option<Cqe>) -> String {
    match c {
        None => "no completion".into(),
        Some(c) => match c.error {
            None => format!("completion (qpn {:#x}, wqe_counter {})", c.qpn, c.wqe_counter.get()),
            Some((syn, vendor, _)) => format!(
                "ERROR completion (qpn {:#x}, wqe_counter {}, syndrome {syn:#04x}, vendor {vendor:#04x})",
                c.qpn,
                c.wqe_counter.get()
            ),
        },
    }
}

/// A device to experiment on: its capabilities, one UAR, the port's path to itself, and
/// every queue the current step created (torn down after the step).
pub struct Rig<'a, D: DevxDevice> {
    pub dev: &'a mut D,
    pub caps: HcaCaps,
    pub patience: Patience,
    out: &'a mut dyn Write,
    uar: UarHandle,
    path: LocalPath,
    qps: Vec<DevxQp>,
    cqs: Vec<DevxCq>,
}

impl<D: DevxDevice> std::fmt::Debug for Rig<'_, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rig").field("patience", &self.patience).field("qps", &self.qps.len()).finish()
    }
}

impl<'a, D: DevxDevice> Rig<'a, D> {
    /// A rig on `dev` (capabilities `caps`, printing to `out`): allocates the UAR its QPs
    /// share and reads the port's path to itself.
    pub fn new(dev: &'a mut D, caps: HcaCaps, patience: Patience, out: &'a mut dyn Write) -> Result<Self, DevxError> {
        let uar = dev.alloc_uar()?;
        let path = dev.local_path()?;
        Ok(Rig { dev, caps, patience, out, uar, path, qps: Vec::new(), cqs: Vec::new() })
    }

    /// Print one line.
    pub fn say(&mut self, line: std::fmt::Arguments<'_>) {
        let _ = writeln!(self.out, "  {line}");
    }

    /// Run one step: its finding, or unknown if a call failed; every queue it created is
    /// destroyed afterwards, newest first.
    pub fn step<T: Copy + std::fmt::Debug>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<Finding<T>, DevxError>,
    ) -> Finding<T> {
        let found = match f(self) {
            Ok(x) => x,
            Err(e) => {
                self.say(format_args!("FAILED: {e}"));
                Finding::Unknown(CALL_FAILED)
            }
        };
        self.teardown();
        match found {
            Finding::Answer(a) => self.say(format_args!("=> {a:?}")),
            Finding::Unknown(r) => self.say(format_args!("=> unknown: {r}")),
        }
        found
    }

    fn teardown(&mut self) {
        while let Some(q) = self.qps.pop() {
            if let Err(e) = queue::destroy_qp(self.dev, q) {
                self.say(format_args!("destroying QP {:#x}: {e}", q.qpn));
            }
        }
        while let Some(c) = self.cqs.pop() {
            if let Err(e) = queue::destroy_cq(self.dev, c) {
                self.say(format_args!("destroying CQ {:#x}: {e}", c.cqn));
            }
        }
    }

    fn cq(&mut self) -> Result<Cq, DevxError> {
        let mem = self.dev.alloc_mem(CqSpec::mem_needed(LOG_CQES), 4096)?;
        let mut ring = vec![0u8; mem.len];
        cqe::init_ring(&mut ring[..cqe::CQE_SIZE << LOG_CQES]);
        self.dev.store(mem.addr, &ring)?;
        // the steps' CQs are polled, but a WAIT watches some: ignore overrun as chain CQs do
        let devx = queue::create_cq(
            self.dev,
            &self.caps,
            self.uar,
            &CqSpec { log_cqes: LOG_CQES, overrun_ignore: true, mem },
        )?;
        self.cqs.push(devx);
        Ok(Cq { devx, ci: 0 })
    }

    /// A QP with CORE-Direct roles `cd`, its own send CQ and, with `recv`, a receive queue
    /// with its own CQ.
    pub fn qp(&mut self, cd: CdRole, recv: bool) -> Result<Qp, DevxError> {
        let send_cq = self.cq()?;
        let recv_cq = if recv { Some(self.cq()?) } else { None };
        let mut spec = QpSpec {
            log_sq_wqebbs: LOG_SQ,
            log_rq: recv.then_some(LOG_RQ),
            log_rq_stride: LOG_RQ_STRIDE,
            cd,
            cqn_snd: send_cq.devx.cqn,
            cqn_rcv: recv_cq.map_or(send_cq.devx.cqn, |c| c.devx.cqn),
            pd: self.dev.pdn(),
            mem: MemRange { addr: 0, len: 0 },
        };
        spec.mem = self.dev.alloc_mem(spec.mem_needed(), 4096)?;
        let devx = queue::create_qp(self.dev, &self.caps, self.uar, &spec)?;
        self.qps.push(devx);
        Ok(Qp { devx, send_cq, recv_cq, pi: WqeIndex::new(0), prev: PrevWqe::Other, ends: Vec::new(), rq_head: 0 })
    }

    /// Connect `a` and `b` to each other over the port's own GID (RST → INIT → RTR → RTS):
    /// PSNs 0, retries 7 (RNR retry 7: for ever), as the MN's loopback pairs.
    pub fn connect(&mut self, a: &Qp, b: &Qp) -> Result<(), DevxError> {
        let (path, max) = (self.path, self.caps.log_max_msg);
        cm::connect(self.dev, &a.devx, &CmQpAttr::to_self(&path, b.qpn()), max, path.mac)?;
        cm::connect(self.dev, &b.devx, &CmQpAttr::to_self(&path, a.qpn()), max, path.mac)
    }

    /// Two QPs with roles `a` and `b`, connected to each other.
    pub fn pair(&mut self, a: CdRole, b: CdRole) -> Result<(Qp, Qp), DevxError> {
        let qa = self.qp(a, false)?;
        let qb = self.qp(b, false)?;
        self.connect(&qa, &qb)?;
        Ok((qa, qb))
    }

    fn store_wqe(&mut self, qp: &mut Qp, e: &Mlx5Wqe, prev: PrevWqe) -> Result<WqeIndex, DevxError> {
        let ring = qp.devx.sq.len / WQEBB;
        let (at, n) = (qp.pi, e.wqebbs());
        if at.slot(ring) + n > ring {
            return Err(DevxError::ChainDoesNotFit {
                what: "bring-up send ring (WQEBBs, no wrap)",
                need: n,
                got: ring - at.slot(ring),
            });
        }
        self.dev.write_mem(qp.devx.sq.addr + at.slot(ring) * WQEBB, e.bytes())?;
        qp.pi = at.add(n as u16);
        let mut ctrl = [0u8; 16];
        ctrl.copy_from_slice(&e.bytes()[..16]);
        qp.ends.push((qp.pi.get(), ctrl));
        qp.prev = prev;
        Ok(at)
    }

    /// Write `w` at `qp`'s producer index (no doorbell); its index.
    pub fn write(&mut self, qp: &mut Qp, w: &Wqe, r: &mut impl QueueResolver) -> Result<WqeIndex, DevxError> {
        let e = encode(w, qp.pi, qp.qpn(), qp.prev, r)?;
        self.store_wqe(qp, &e, encode::prev_of(w))
    }

    /// Write a READ of `remote` scattered over `sges` (no doorbell); its index.
    pub fn write_scatter_read(
        &mut self,
        qp: &mut Qp,
        remote: u64,
        rkey: u32,
        sges: &[DataSeg],
        flags: WqeFlags,
    ) -> Result<WqeIndex, DevxError> {
        let e = encode_scatter_read(remote, rkey, sges, qp.pi, qp.qpn(), encode::fm_ce_se(flags, qp.prev))?;
        self.store_wqe(qp, &e, PrevWqe::Other)
    }

    /// Ring `qp`'s send doorbell up to `upto` (which must end a written WQE): the doorbell
    /// record, then that WQE's control segment to the UAR.
    pub fn ring(&mut self, qp: &Qp, upto: WqeIndex) -> Result<(), DevxError> {
        let ctrl = qp
            .ends
            .iter()
            .rev()
            .find(|(end, _)| *end == upto.get())
            .map(|(_, c)| *c)
            .ok_or(DevxError::EnableNotAtWqeEnd { ring: "bring-up", index: upto.get() })?;
        doorbell::ring_sq(self.dev, &qp.devx, upto, &ctrl);
        Ok(())
    }

    /// Write `w` and ring the doorbell up to it.
    pub fn post(&mut self, qp: &mut Qp, w: &Wqe, r: &mut impl QueueResolver) -> Result<WqeIndex, DevxError> {
        let at = self.write(qp, w, r)?;
        self.ring(qp, qp.pi)?;
        Ok(at)
    }

    /// Post a plain `w` (no WAIT or ENABLE) and ring.
    pub fn post_plain(&mut self, qp: &mut Qp, w: &Wqe) -> Result<WqeIndex, DevxError> {
        self.post(qp, w, &mut Unmanaged)
    }

    /// Post one receive WQE scattering into `sges` and publish it (doorbell record).
    pub fn post_recv(&mut self, qp: &mut Qp, sges: &[RecvSge]) -> Result<(), DevxError> {
        self.stage_recv(qp, sges)?;
        doorbell::ring_rq(self.dev, &qp.devx, qp.rq_head);
        Ok(())
    }

    /// Write one receive WQE scattering into `sges` without publishing it (the record keeps
    /// its count).
    pub fn stage_recv(&mut self, qp: &mut Qp, sges: &[RecvSge]) -> Result<(), DevxError> {
        qp.rq_head = arm::write_recvs(self.dev, &qp.devx, qp.rq_head, 1, sges)?;
        Ok(())
    }

    /// The CPU stores `count` into `qp`'s receive doorbell record.
    pub fn publish_recvs(&mut self, qp: &mut Qp, count: u32) -> Result<(), DevxError> {
        doorbell::ring_rq(self.dev, &qp.devx, count);
        Ok(())
    }

    /// `qp`'s receive doorbell record (`dbrec[MLX5_RCV_DBR]`) as a remote target: its address
    /// and the rkey of an MR (CN-facing domain, where the step QPs are) over the queue's memory
    /// — the receive ring, the send ring, the record.
    pub fn record_mr(&mut self, qp: &Qp) -> Result<Remote, DevxError> {
        let d = &qp.devx;
        let end = d.dbr_addr + 8;
        let mem = MemRange { addr: d.rq.addr.min(d.sq.addr), len: end - d.rq.addr.min(d.sq.addr) };
        let keys = self.dev.reg_mr(Domain::CnFacing, mem, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
        Ok(Remote { addr: d.dbr_addr as u64, rkey: keys.rkey })
    }

    /// The next CQE of `cq`, waiting at most `patience.completion` (looks at least once).
    pub fn poll(&mut self, cq: &mut Cq) -> Result<Option<Cqe>, DevxError> {
        let deadline = Instant::now() + self.patience.completion;
        let slot = cq.devx.ring.addr + (cq.ci as usize & ((1usize << LOG_CQES) - 1)) * cqe::CQE_SIZE;
        loop {
            let mut b = [0u8; cqe::CQE_SIZE];
            self.dev.read_mem(slot, &mut b)?;
            if cqe::parse(&b, LOG_CQES, cq.ci).is_some() {
                // owned by software: read it whole again after the barrier (op_own is last)
                self.dev.read_mem(slot, &mut b)?;
                let c = cqe::parse(&b, LOG_CQES, cq.ci);
                cq.ci = cq.ci.wrapping_add(1);
                doorbell::update_cq_ci(self.dev, &cq.devx, cq.ci);
                return Ok(c);
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::hint::spin_loop();
        }
    }

    /// Let the device act on what was posted.
    pub fn settle(&mut self) {
        self.dev.settle(self.patience.settle);
    }

    /// `len` bytes of registered memory (CN-facing PD, where the step QPs are) with `access`.
    pub fn buffer(&mut self, len: usize, access: AccessFlags) -> Result<Buf, DevxError> {
        let mem = self.dev.alloc_mem(len, 4096)?;
        let keys = self.dev.reg_mr(Domain::CnFacing, mem, access)?;
        Ok(Buf { addr: mem.addr as u64, len, keys })
    }

    pub fn fill(&mut self, addr: u64, bytes: &[u8]) -> Result<(), DevxError> {
        self.dev.store(addr as usize, bytes)
    }

    /// `reader` READs `expect.len()` bytes through the window `rkey` over `buf`'s start into
    /// `buf` at `at`, and says what happened as `from`: `None` no completion, `Some(true)`
    /// success with `expect` arrived, `Some(false)` an error completion or other bytes.
    pub fn read_through_window(
        &mut self,
        reader: &mut Qp,
        buf: &Buf,
        at: u64,
        rkey: u32,
        expect: &[u8],
        from: &str,
    ) -> Result<Option<bool>, DevxError> {
        let dst = buf.addr + at;
        self.post_plain(reader, &Wqe::read(dst, buf.keys.lkey, expect.len() as u32, buf.addr, rkey))?;
        let c = self.poll(&mut reader.send_cq)?;
        self.settle();
        let mut got = vec![0u8; expect.len()];
        self.dev.read_mem(dst as usize, &mut got)?;
        let matches = got == expect;
        self.say(format_args!(
            "READ through the window from {from}: {}; data {}",
            show(&c),
            if matches { "matches" } else { "absent" }
        ));
        Ok(c.map(|c| c.error.is_none() && matches))
    }

    /// Whether any of the `len` bytes at `addr` is non-zero (the steps zero what they watch
    /// and copy non-zero patterns).
    pub fn landed(&mut self, addr: u64, len: usize) -> Result<bool, DevxError> {
        let mut b = vec![0u8; len];
        self.dev.read_mem(addr as usize, &mut b)?;
        Ok(b.iter().any(|x| *x != 0))
    }
}

/// A non-zero pattern for sources.
pub fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i as u8) ^ 0x5a) | 1).collect()
}
