//! Hardware bring-up steps for the DEVX path (docs/MLX5.md, checklist step 6). Needs a
//! ConnectX; written without one and never run — every step prints what it did and what the
//! device answered, so a failure says which assumption broke.
//!
//! ```text
//! omw-mlx5-bringup questions [--device mlx5_0] [--gid-index 3] [--profile FILE]
//! omw-mlx5-bringup wait-prefetch|recv-enable|send-en-unit|self-enable|foreign-bind|recv-publish|unchecked-unbind [--device …]
//! omw-mlx5-bringup caps      [--device mlx5_0]
//! omw-mlx5-bringup cd-roles  [--device mlx5_0]
//! omw-mlx5-bringup loopback  [--device mlx5_0] [--gid-index 3]
//! omw-mlx5-bringup bind      [--device mlx5_0] [--gid-index 3] [--imm-current]
//! omw-mlx5-bringup masked-fa [--device mlx5_0] [--gid-index 3]
//! omw-mlx5-bringup wait      [--device mlx5_0] [--gid-index 3]
//! omw-mlx5-bringup offload   [--device mlx5_0] [--gid-index 3]
//! ```
//! `questions`: one experiment per open question the chains depend on
//! (`omw_verbs::devx::bringup`: `wait_prefetch`, `recv_enable`, `send_en_unit`, `self_enable`,
//! `foreign_bind`; `recv_publish`: may the chains publish their own receives; and
//! `unchecked_unbind`: do the chains' and the MN's unbinds work at all), each
//! printing what it posted and what the device did, then the answers,
//! saved as the device profile (`omw_verbs::devx::profile`; default
//! `omw-mlx5-profile-<device>.txt`) that `omw mn --offload mlx5 --profile FILE` takes, and
//! whether that MN would start with it. Exit status 0 only if every question was answered (the
//! profile is written either way, unknown answers with their reasons). The five question
//! names run one experiment each.
//! `cd-roles`: CREATE_QP with each CORE-Direct role, and the combinations the chains use, as
//! the calling user (question 1).
//! `loopback`: two DEVX QPs connected to each other over RoCE, an encoded NOP then an encoded
//! READ posted on one, the doorbell rung, the CQ polled, the READ's bytes compared — the first
//! end-to-end check of `omw_core::mlx5::encode`, the PRM commands and the doorbell.
//! `bind`: a type-2 window bound by an encoded UMR on A to A, READ through it from B,
//! invalidated on A; then bound by a UMR posted on B naming A's QPN (question 5), READ again, and
//! a LOCAL_INV from B that must fail. `--imm-current` puts the window's current rkey in the
//! control `imm`, as rdma-core does, instead of the new one (question 7).
//! `masked-fa`: an encoded 8-byte masked fetch-and-add with two 32-bit fields (question 6).
//! `wait`: a WAIT on a CQ producer index holds the WQE behind it until the index is reached
//! (questions 3, 14).
//! `offload`: the whole thing on one port — an offloaded MN on `DevxBackend` (provisioned by
//! `MnPlan::provision`, chains armed by `MnDriver::connect`), a CN on a second DEVX context
//! (`CnDriver` over another `DevxBackend`), its QPs connected to the MN's over the port's own
//! GID; then alloc, write and read through the window, free. Run it only after every other
//! step passed (checklist step 7).

use omw_core::device::behaviour::Question;
use omw_core::mlx5::cqe;
use omw_core::mlx5::ctrl::PrevWqe;
use omw_core::mlx5::encode::{encode, QueueResolver, Unmanaged};
use omw_core::mlx5::prm::hca_cap::HcaCaps;
use omw_core::mlx5::prm::qp::CdRole;
use omw_core::mlx5::wqebb::WqeIndex;
use omw_core::wire::wqe::{QueueSel, Wqe};
use omw_verbs::device::DeviceChoice;
use omw_verbs::devx::api::{DevxApi, MemRange, UarHandle};
use omw_verbs::devx::bringup::{
    self, foreign_bind, recv_enable, self_enable, send_en_unit, wait_prefetch, Patience, Rig,
};
use omw_verbs::devx::cm::LocalPath;
use omw_verbs::devx::device::DevxDevice;
use omw_verbs::devx::ffi::{RealDevx, RingMemory};
use omw_verbs::devx::profile::{self, Timestamp};
use omw_verbs::devx::queue::{self, CqSpec, DevxCq, DevxQp, QpSpec};
use omw_verbs::devx::{caps, cm, doorbell, DevxError};
use omw_verbs::VerbsError;
use rdma_sys::*;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use std::time::{SystemTime, UNIX_EPOCH};

const LOG_CQES: u8 = 6;

fn new_cq(d: &mut RealDevx, c: &HcaCaps, uar: UarHandle) -> Result<(DevxCq, RingMemory), DevxError> {
    let mut mem = RingMemory::new(CqSpec::mem_needed(LOG_CQES))?;
    cqe::init_ring(&mut mem.bytes_mut()[..cqe::CQE_SIZE << LOG_CQES]);
    let cq = queue::create_cq(d, c, uar, &CqSpec { log_cqes: LOG_CQES, overrun_ignore: true, mem: mem.range() })?;
    Ok((cq, mem))
}

fn qp_spec(cd: CdRole, cqn: u32, pd: u32, mem: MemRange) -> QpSpec {
    QpSpec { log_sq_wqebbs: 6, log_rq: None, log_rq_stride: 0, cd, cqn_snd: cqn, cqn_rcv: cqn, pd, mem }
}

fn qp_mem_len(cd: CdRole) -> usize {
    qp_spec(cd, 0, 0, MemRange { addr: 0, len: 0 }).mem_needed()
}

fn cd_roles(d: &mut RealDevx, c: &HcaCaps) -> Result<bool, DevxError> {
    let uar = d.alloc_uar()?;
    let (cq, _cq_mem) = new_cq(d, c, uar)?;
    let mut all = true;
    for (name, role) in [
        ("none", CdRole::empty()),
        ("cd_master", CdRole::MASTER),
        ("cd_slave_send", CdRole::SLAVE_SEND),
        ("cd_slave_receive", CdRole::SLAVE_RECEIVE),
        ("cd_master + cd_slave_send", CdRole::MASTER | CdRole::SLAVE_SEND),
        ("all three", CdRole::MASTER | CdRole::SLAVE_SEND | CdRole::SLAVE_RECEIVE),
    ] {
        let mem = RingMemory::new(qp_mem_len(role))?;
        match queue::create_qp(d, c, uar, &qp_spec(role, cq.cqn, d.pdn(), mem.range())) {
            Ok(q) => {
                println!("  CREATE_QP with {name:<26} ok (qpn {:#x})", q.qpn);
                queue::destroy_qp(d, q)?;
            }
            Err(e) => {
                all = false;
                println!("  CREATE_QP with {name:<26} REFUSED: {e}");
            }
        }
    }
    queue::destroy_cq(d, cq)?;
    Ok(all)
}

fn connect_to(d: &mut RealDevx, c: &HcaCaps, q: &DevxQp, peer: u32, path: &LocalPath) -> Result<(), DevxError> {
    cm::connect(d, q, &cm::CmQpAttr::to_self(path, peer), c.log_max_msg, path.mac)
}

/// Two DEVX QPs A and B on one CQ, connected to each other over the port the device was opened
/// on (`--gid-index` or the GID `omw probe` would choose).
struct Pair {
    cq: DevxCq,
    cq_mem: RingMemory,
    ci: u32,
    a: DevxQp,
    mem_a: RingMemory,
    pi_a: WqeIndex,
    b: DevxQp,
    mem_b: RingMemory,
    pi_b: WqeIndex,
}

fn pair(d: &mut RealDevx, c: &HcaCaps) -> Result<Pair, DevxError> {
    pair_with(d, c, CdRole::empty(), CdRole::empty())
}

fn pair_with(d: &mut RealDevx, c: &HcaCaps, role_a: CdRole, role_b: CdRole) -> Result<Pair, DevxError> {
    let path = d.local_path()?;
    println!("  port {} GID[{}] = {:02x?}", path.port, path.gid_index, path.gid);
    println!("  next-hop MAC (own port, from the AH's mlx5 AV) = {:02x?}", path.mac);
    let uar = d.alloc_uar()?;
    let (cq, cq_mem) = new_cq(d, c, uar)?;
    let mem_a = RingMemory::new(qp_mem_len(role_a))?;
    let mem_b = RingMemory::new(qp_mem_len(role_b))?;
    let a = queue::create_qp(d, c, uar, &qp_spec(role_a, cq.cqn, d.pdn(), mem_a.range()))?;
    let b = queue::create_qp(d, c, uar, &qp_spec(role_b, cq.cqn, d.pdn(), mem_b.range()))?;
    println!("  CQ {:#x}, QPs A {:#x} ({role_a:?}) and B {:#x} ({role_b:?}) created", cq.cqn, a.qpn, b.qpn);
    connect_to(d, c, &a, b.qpn, &path)?;
    connect_to(d, c, &b, a.qpn, &path)?;
    println!("  A and B in RTS");
    Ok(Pair { cq, cq_mem, ci: 0, a, mem_a, pi_a: WqeIndex::new(0), b, mem_b, pi_b: WqeIndex::new(0) })
}

impl Pair {
    /// Encode `w` on A (`on_a`) or B, optionally overwrite its control `imm`, and ring.
    fn post(
        &mut self,
        d: &mut RealDevx,
        on_a: bool,
        w: &Wqe,
        imm: Option<u32>,
        r: &mut impl QueueResolver,
    ) -> Result<(), DevxError> {
        let (qp, mem, pi) =
            if on_a { (&self.a, &mut self.mem_a, &mut self.pi_a) } else { (&self.b, &mut self.mem_b, &mut self.pi_b) };
        let e = encode(w, *pi, qp.qpn, PrevWqe::Other, r).map_err(DevxError::Encode)?;
        let n = e.wqebbs();
        let ring = 64usize;
        if pi.slot(ring) + n > ring {
            return Err(DevxError::MemTooSmall {
                what: "bring-up send queue (no wrap handling)",
                need: n,
                got: ring - pi.slot(ring),
            });
        }
        let off = qp.sq.addr - mem.range().addr + pi.slot(ring) * 64;
        mem.bytes_mut()[off..off + n * 64].copy_from_slice(e.bytes());
        if let Some(v) = imm {
            mem.bytes_mut()[off + 12..off + 16].copy_from_slice(&v.to_be_bytes());
        }
        let mut last = [0u8; 16];
        last.copy_from_slice(&mem.bytes_mut()[off..off + 16]);
        *pi = pi.add(n as u16);
        doorbell::ring_sq(d, qp, *pi, &last);
        Ok(())
    }

    /// The next CQE of either QP, if one arrives within `within`.
    fn next_cqe(&mut self, d: &mut RealDevx, within: Duration) -> Option<cqe::Cqe> {
        let cq_off = self.cq.ring.addr - self.cq_mem.range().addr;
        let deadline = Instant::now() + within;
        loop {
            let mut ring = vec![0u8; cqe::CQE_SIZE << LOG_CQES];
            self.cq_mem.read_volatile(cq_off, &mut ring);
            if let Some(c) = cqe::poll(&ring, LOG_CQES, self.ci) {
                self.ci += 1;
                doorbell::update_cq_ci(d, &self.cq, self.ci);
                return Some(c);
            }
            if Instant::now() > deadline {
                return None;
            }
        }
    }

    /// Post a signaled `w` and wait for the next CQE.
    fn run(&mut self, d: &mut RealDevx, on_a: bool, w: &Wqe, imm: Option<u32>) -> Result<cqe::Cqe, DevxError> {
        self.post(d, on_a, w, imm, &mut Unmanaged)?;
        self.next_cqe(d, Duration::from_secs(2))
            .ok_or(DevxError::Call { call: "CQ poll (no CQE within 2 s)", errno: libc::ETIMEDOUT })
    }

    fn destroy(self, d: &mut RealDevx) -> Result<(), DevxError> {
        queue::destroy_qp(d, self.a)?;
        queue::destroy_qp(d, self.b)?;
        queue::destroy_cq(d, self.cq)
    }
}

fn show(what: &str, c: &cqe::Cqe) -> bool {
    println!("  {what:<58} -> CQE opcode {} wqe_counter {} error {:?}", c.opcode, c.wqe_counter.get(), c.error);
    c.error.is_none()
}

/// A registered buffer: 4 KiB of pattern, 4 KiB of zeros.
fn buffer(d: &mut RealDevx, extra_access: ibv_access_flags) -> Result<(RingMemory, *mut ibv_mr), DevxError> {
    let mut buf = RingMemory::new(8192)?;
    buf.bytes_mut()[..4096].iter_mut().enumerate().for_each(|(i, x)| *x = i as u8 ^ 0x5a);
    let access =
        (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ibv_access_flags::IBV_ACCESS_REMOTE_READ | extra_access).0 as i32;
    // SAFETY: `buf` is owned memory that outlives the MR (the caller deregisters it first).
    let mr = unsafe { ibv_reg_mr(d.pd(), buf.range().addr as *mut libc::c_void, 8192, access) };
    if mr.is_null() {
        return Err(DevxError::Call {
            call: "ibv_reg_mr",
            errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        });
    }
    Ok((buf, mr))
}

fn data_ok(buf: &RingMemory) -> bool {
    let mut got = [0u8; 256];
    buf.read_volatile(4096, &mut got);
    got.iter().enumerate().all(|(i, x)| *x == i as u8 ^ 0x5a)
}

fn loopback(d: &mut RealDevx, c: &HcaCaps) -> Result<bool, DevxError> {
    let mut p = pair(d, c)?;
    let (buf, mr) = buffer(d, ibv_access_flags(0))?;
    // SAFETY: `mr` is the live MR just registered.
    let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
    let src = buf.range().addr as u64;
    let mut ok = show("NOP on A", &p.run(d, true, &Wqe::nop(), None)?);
    ok &= show("READ 256 B on A (MR rkey)", &p.run(d, true, &Wqe::read(src + 4096, lkey, 256, src, rkey), None)?);
    let same = data_ok(&buf);
    println!("  READ data {}", if same { "matches" } else { "DIFFERS" });
    // SAFETY: no WQE references the MR any more.
    unsafe { ibv_dereg_mr(mr) };
    p.destroy(d)?;
    Ok(ok && same)
}

/// Type-2 windows bound by UMR from DEVX QPs (questions 5 and 7). The last step errors QP B.
fn bind(d: &mut RealDevx, c: &HcaCaps, imm_current: bool) -> Result<bool, DevxError> {
    let mut p = pair(d, c)?;
    let (buf, mr) = buffer(d, ibv_access_flags::IBV_ACCESS_MW_BIND)?;
    // SAFETY: `mr` is the live MR just registered.
    let lkey = unsafe { (*mr).lkey };
    // SAFETY: the PD is live; None if the provider lacks the verb.
    let mw = unsafe { ibv_alloc_mw(d.pd(), ibv_mw_type::IBV_MW_TYPE_2) }.filter(|m| !m.is_null()).ok_or(
        DevxError::Call {
            call: "ibv_alloc_mw(TYPE_2)",
            errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        },
    )?;
    // SAFETY: `mw` is the live window just allocated.
    let mut cur = unsafe { (*mw).rkey };
    let next = |k: u32| (k & 0xFFFF_FF00) | (k.wrapping_add(1) & 0xFF);
    let src = buf.range().addr as u64;
    let a = p.a.qpn;
    let imm = |cur: u32| imm_current.then_some(cur);
    println!(
        "  window rkey {cur:#010x}; control imm carries the {} rkey",
        if imm_current { "current (rdma-core)" } else { "new (omw)" }
    );
    let mut ok = true;

    let k1 = next(cur);
    let w = Wqe::bind_mw(k1, src, 4096, lkey, a, omw_core::access::AccessFlags::DATA_WINDOW);
    ok &= show(&format!("BIND on A to A (key {k1:#010x})"), &p.run(d, true, &w, imm(cur))?);
    cur = k1;
    ok &= show(
        "READ on B through the window (responder A)",
        &p.run(d, false, &Wqe::read(src + 4096, lkey, 256, src, k1), None)?,
    );
    println!("  READ data {}", if data_ok(&buf) { "matches" } else { "DIFFERS" });
    ok &= show("LOCAL_INV on A (bound to A)", &p.run(d, true, &Wqe::local_inv(k1), None)?);

    let k2 = next(cur);
    let w = Wqe::bind_mw(k2, src, 4096, lkey, a, omw_core::access::AccessFlags::DATA_WINDOW);
    let bound_elsewhere =
        show(&format!("BIND posted on B naming A's QPN (key {k2:#010x})"), &p.run(d, false, &w, imm(cur))?);
    ok &= bound_elsewhere;
    if bound_elsewhere {
        ok &= show(
            "READ on B through that window (responder A)",
            &p.run(d, false, &Wqe::read(src + 4096, lkey, 256, src, k2), None)?,
        );
        // must be refused: the window is bound to A, the LOCAL_INV is posted on B
        let inv = p.run(d, false, &Wqe::local_inv(k2), None)?;
        show("LOCAL_INV on B of a window bound to A (must fail)", &inv);
        ok &= inv.error.is_some();
    }
    // SAFETY: the window and MR are no longer referenced by any posted WQE.
    unsafe {
        ibv_dealloc_mw(mw);
        ibv_dereg_mr(mr);
    }
    p.destroy(d)?;
    Ok(ok)
}

/// 8-byte masked fetch-and-add with two 32-bit fields (question 6): the low field wraps without
/// carrying into the high one, big-endian in memory.
fn masked_fa(d: &mut RealDevx, c: &HcaCaps) -> Result<bool, DevxError> {
    let mut p = pair(d, c)?;
    let (mut buf, mr) = buffer(d, ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC)?;
    // SAFETY: `mr` is the live MR just registered.
    let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
    let src = buf.range().addr as u64;
    let (old, add, boundary) = (0x0000_0001_FFFF_FFFFu64, 0x0000_0001_0000_0001u64, (1u64 << 63) | (1 << 31));
    buf.bytes_mut()[..8].copy_from_slice(&old.to_be_bytes());
    let w = Wqe::masked_fetch_add(src + 4096, lkey, src, rkey, add, boundary);
    let ok = show("masked FA on B (responder A), fields at bits 31 and 63", &p.run(d, false, &w, None)?);
    let (mut now, mut ret) = ([0u8; 8], [0u8; 8]);
    buf.read_volatile(0, &mut now);
    buf.read_volatile(4096, &mut ret);
    let (now, ret) = (u64::from_be_bytes(now), u64::from_be_bytes(ret));
    let want = omw_core::wire::wqe::masked_add(old, add, boundary);
    println!(
        "  memory {now:#018x} (masked: {want:#018x}, plain add: {:#018x}); returned {ret:#018x} (old {old:#018x})",
        old.wrapping_add(add)
    );
    // SAFETY: no WQE references the MR any more.
    unsafe { ibv_dereg_mr(mr) };
    p.destroy(d)?;
    Ok(ok && now == want && ret == old)
}

/// Every WAIT names this CQ.
struct WaitOn(u32);
impl QueueResolver for WaitOn {
    fn cqn(&self, _: u32, _: QueueSel) -> Option<u32> {
        Some(self.0)
    }
    fn enable_index(&mut self, _: u32, _: QueueSel, _: u64) -> Option<WqeIndex> {
        None
    }
}

/// Whether the 8 bytes at `off` of `buf` are no longer zero.
fn landed(buf: &RingMemory, off: usize) -> bool {
    let mut b = [0u8; 8];
    buf.read_volatile(off, &mut b);
    b != [0; 8]
}

/// WAIT semantics (questions 3 and 14): A (`cd_master`) posts a WAIT for the shared CQ's
/// producer index to reach (what it holds now) + 2, then a signaled 8-byte WRITE. B completes
/// one signaled NOP, then another; the WRITE must land after the second only. Prints what the
/// CQ shows at each step.
fn wait(d: &mut RealDevx, c: &HcaCaps) -> Result<bool, DevxError> {
    let mut p = pair_with(d, c, CdRole::MASTER, CdRole::empty())?;
    let (mut buf, mr) = buffer(d, ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)?;
    // SAFETY: `mr` is the live MR just registered.
    let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
    let src = buf.range().addr as u64;
    buf.bytes_mut()[4096..4104].fill(0);
    let base = p.ci; // every CQE so far was consumed: the producer index
    let cqn = p.cq.cqn;
    p.post(d, true, &Wqe::wait(p.b.qpn, QueueSel::Send, u64::from(base) + 2), None, &mut WaitOn(cqn))?;
    p.post(d, true, &Wqe::write(src, lkey, 8, src + 4096, rkey), None, &mut Unmanaged)?;
    std::thread::sleep(Duration::from_millis(200));
    let mut seen = vec![landed(&buf, 4096)];
    println!("  WAIT(PI {}) and a WRITE posted on A; CQ PI {base}: WRITE landed {}", base + 2, seen[0]);
    for k in 1..=2 {
        let e = p.run(d, false, &Wqe::nop(), None)?;
        std::thread::sleep(Duration::from_millis(200));
        seen.push(landed(&buf, 4096));
        println!(
            "  NOP {k} on B completed (CQE qpn {:#x}); CQ PI {}: WRITE landed {}",
            e.qpn,
            base + k,
            seen[k as usize]
        );
    }
    while let Some(e) = p.next_cqe(d, Duration::from_millis(500)) {
        println!("  CQE qpn {:#x} wqe_counter {} error {:?}", e.qpn, e.wqe_counter.get(), e.error);
    }
    // SAFETY: no WQE references the MR any more.
    unsafe { ibv_dereg_mr(mr) };
    p.destroy(d)?;
    let ok = seen == [false, false, true];
    println!("  WAIT held until PI >= its index: {}", if ok { "yes" } else { "NO (see above)" });
    Ok(ok)
}

/// The offloaded MN and one CN on this port (see the module doc).
fn offload(choice: &DeviceChoice, c: HcaCaps) -> Result<bool, VerbsError> {
    use omw_core::access::AccessFlags;
    use omw_core::cn::driver::{CnDriver, CnEvent, CnMemory, CnQpSet, IO_SLOTS};
    use omw_core::device::{Capabilities, DataPath, Domain, Provision, WcStatus};
    use omw_core::mn::plan::{MnOptions, MnPlan};
    use omw_core::mn::provision::PoolSpec;
    use omw_core::mn::CnQps;
    use omw_verbs::devx::backend::{DevxBackend, DevxConfig};
    use omw_verbs::devx::device::DevxDevice;
    const CHUNK: u64 = 4096;
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        println!("  {what}: {e}");
        DevxError::Call { call: "offload step", errno: 0 }
    };
    // what the MN's plan sees: the offload set; the MW semantics are the spec's (the MW probe
    // of `omw probe` checks them on this device first)
    let cfg = DevxConfig::new(Capabilities::OFFLOAD | Capabilities::MW_BOUNDS_ENFORCED);
    let mn_dev = RealDevx::open(choice)?;
    let cn_dev = RealDevx::open(choice)?;
    let mb = DevxBackend::new(mn_dev, c, cfg)?;
    let mut cb = DevxBackend::new(cn_dev, c, cfg)?;
    let plan = MnPlan::decide(mb.capabilities(), MnOptions::default()).map_err(|e| fail("plan", &e))?;
    let spec =
        PoolSpec { chunk_size: CHUNK, chunks: 16, group_size: 2, max_cns: 2, quota: 0, lease_ns: 0, queue_depth: None };
    let mut mn = plan.provision(mb, &spec).map_err(|e| fail("provision", &e))?;
    println!("  MN provisioned on DEVX ({:?})", plan.mode);
    let (alloc_loop, free_loop) =
        mn.create_loop_qps().map_err(|e| fail("loop QPs", &e))?.ok_or_else(|| fail("loop QPs", &"host engine"))?;
    let depth = mn.mn.chain_ring_depths().map_err(|e| fail("ring depths", &e))?;
    let path = cb.device_mut().local_path()?;
    let attr = |dest: u32| cm::CmQpAttr::to_self(&path, dest);
    let mut pair = |mn: &mut omw_core::mn::driver::MnDriver<DevxBackend<RealDevx>>, managed: Option<u16>| {
        let m = mn.backend.create_cn_qp(managed.map(u32::from))?;
        let q = cb.create_cn_qp(None)?;
        mn.backend.connect_cn_qp(m, &attr(q.get()), path.mac)?;
        cb.connect_cn_qp(q, &attr(m.get()), path.mac)?;
        Ok::<_, DevxError>((q, m))
    };
    let (alloc, mn_alloc) = pair(&mut mn, Some(depth[0][1]))?;
    let (free, mn_free) = pair(&mut mn, Some(depth[1][1]))?;
    let (access, mn_access) = pair(&mut mn, None)?;
    let reply = cb.alloc_memory(CnMemory::REPLY_LEN, 64)?;
    let rk =
        cb.reg_mr(Domain::CnFacing, reply, CnMemory::REPLY_LEN, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let local_len = CnMemory::local_len_for(IO_SLOTS, CHUNK);
    let local = cb.alloc_memory(local_len, 64)?;
    let lk = cb.reg_mr(Domain::CnFacing, local, local_len, AccessFlags::LOCAL_WRITE)?;
    let mem = CnMemory { local, local_len, lkey: lk.lkey, reply, reply_rkey: rk.rkey };
    let mut acc = heapless::Vec::new();
    let _ = acc.push(access);
    let mut cn: CnDriver<_, 16> =
        CnDriver::new(cb, CnQpSet { alloc, free, access: acc }, mem).map_err(|e| fail("CN driver", &e))?;
    let mut mn_acc = heapless::Vec::new();
    let _ = mn_acc.push(mn_access);
    let qps = CnQps {
        alloc: mn_alloc,
        free: mn_free,
        access: mn_acc,
        alloc_loop: Some(alloc_loop),
        free_loop: Some(free_loop),
    };
    mn.connect(qps).map_err(|e| fail("connect (arms both chains)", &e))?;
    println!("  CN connected, chains armed");
    let t0 = Instant::now();
    let pump =
        |mn: &mut omw_core::mn::driver::MnDriver<_>, cn: &mut CnDriver<_, 16>| -> Result<Option<CnEvent>, DevxError> {
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline {
                let now = t0.elapsed().as_nanos() as u64;
                mn.poll(now).map_err(|e| fail("MN poll", &e))?;
                cn.poll(now).map_err(|e| fail("CN poll", &e))?;
                if let Some(e) = cn.next_event() {
                    return Ok(Some(e));
                }
            }
            Ok(None)
        };
    println!("  first event: {:?}", pump(&mut mn, &mut cn)?);
    let token = cn.alloc(0).map_err(|e| fail("alloc request", &e))?;
    let a = match pump(&mut mn, &mut cn)? {
        Some(CnEvent::Allocated { token: t, result: Ok(a) }) if t == token => a,
        other => {
            println!("  alloc: no allocation from the NIC's chain: {other:?} (MN stats {:?})", mn.stats);
            return Ok(false);
        }
    };
    println!("  allocated {:#x} with {} window(s), MN CPU laps {}", a.base, a.rkeys.len(), mn.stats.laps);
    let key = a.rkeys[0];
    let msg = *b"omw offload on a ConnectX";
    let mut back = [0u8; 25];
    let wait = |mn: &mut omw_core::mn::driver::MnDriver<_>, cn: &mut CnDriver<_, 16>, op, back: &mut [u8]| {
        for _ in 0..100_000 {
            let _ = mn.poll(t0.elapsed().as_nanos() as u64);
            let _ = cn.poll(t0.elapsed().as_nanos() as u64);
            if let Some(d) = cn.access_done(op, back).map_err(|e| fail("access", &e))? {
                return Ok::<_, DevxError>(Some(d.status));
            }
        }
        Ok(None)
    };
    let op = cn.post_write(0, a.base, key, &msg).map_err(|e| fail("write", &e))?;
    let done = wait(&mut mn, &mut cn, op, &mut back)?;
    println!("  WRITE through the window: {done:?}");
    let op = cn.post_read(0, a.base, key, msg.len()).map_err(|e| fail("read", &e))?;
    let read = wait(&mut mn, &mut cn, op, &mut back)?;
    println!("  READ back: {read:?}, bytes match: {}", back == msg);
    cn.free(&a).map_err(|e| fail("free", &e))?;
    println!("  free: {:?}", pump(&mut mn, &mut cn)?);
    Ok(done == Some(WcStatus::Success) && read == Some(WcStatus::Success) && back == msg)
}

/// Run the question steps (`which`: one of them, `None`: all), print the answers and — for
/// all — write the device profile and say whether `omw mn --offload mlx5` would start with it.
fn questions(d: &mut RealDevx, c: HcaCaps, which: Option<Question>, path: Option<PathBuf>) -> Result<bool, VerbsError> {
    let (device, firmware) = (d.device().to_string(), d.firmware().to_string());
    println!("firmware {firmware}");
    let mut stdout = std::io::stdout();
    let mut rig = Rig::new(d, c, Patience::HARDWARE, &mut stdout)?;
    let Some(q) = which else {
        let found = bringup::questions(&mut rig);
        drop(rig);
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let profile = found.profile(&device, &firmware, Timestamp::from_unix(secs));
        println!("answers:");
        for (q, why) in Question::ALL.map(|q| (q, found.notes().into_iter().find(|n| n.0 == q).map(|n| n.1))) {
            let a = profile::answer_name(&profile.answers, q).unwrap_or(profile::UNKNOWN);
            println!("  {:<14} {a}{}", q.key(), why.map(|w| format!(" ({w})")).unwrap_or_default());
        }
        let rp = match found.recv_publish {
            bringup::Finding::Answer(a) => format!("{a:?}"),
            bringup::Finding::Unknown(why) => format!("unknown ({why})"),
        };
        println!("  {:<14} {rp}", profile::RECV_PUBLISH);
        let uu = match found.unchecked_unbind {
            bringup::Finding::Answer(a) => format!("{a:?}"),
            bringup::Finding::Unknown(why) => format!("unknown ({why})"),
        };
        println!("  {:<14} {uu}", profile::UNCHECKED_UNBIND);
        let path = path.unwrap_or_else(|| PathBuf::from(format!("omw-mlx5-profile-{device}.txt")));
        std::fs::write(&path, profile.to_text(&found.notes()))
            .map_err(|e| VerbsError::Config(format!("writing the device profile {}: {e}", path.display())))?;
        println!("device profile written to {}", path.display());
        match omw_verbs::devx::mn::chain_answers(Some(&profile)) {
            Ok(_) => println!(
                "omw mn --offload mlx5 --profile {} would lay its chains out for these answers",
                path.display()
            ),
            Err(e) => println!("omw mn --offload mlx5 --profile {} would refuse: {e}", path.display()),
        }
        return Ok(found.notes().is_empty());
    };
    let known = match q {
        Question::WaitPrefetch => rig.step(wait_prefetch::run).answer().is_some(),
        Question::RecvEnable => rig.step(recv_enable::run).answer().is_some(),
        Question::SendEnUnit => rig.step(send_en_unit::run).answer().is_some(),
        Question::SelfEnable => rig.step(self_enable::run).answer().is_some(),
        Question::ForeignBind => rig.step(foreign_bind::run).answer().is_some(),
    };
    Ok(known)
}

fn run() -> Result<bool, VerbsError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let device = opt("--device");
    let gid_index = opt("--gid-index")
        .map(|s| s.parse::<u8>())
        .transpose()
        .map_err(|e| VerbsError::Config(format!("--gid-index: {e}")))?;
    let choice = DeviceChoice { device, gid_index };
    let mut d = RealDevx::open(&choice)?;
    let c = caps::query(&mut d)?;
    println!("device {}: {}", d.device(), omw_verbs::devx::DevxProbe { device: Some(d.device().into()), caps: Ok(c) });
    match args.first().map(String::as_str) {
        Some("caps") => Ok(true),
        Some("cd-roles") => Ok(cd_roles(&mut d, &c)?),
        Some("loopback") => Ok(loopback(&mut d, &c)?),
        Some("masked-fa") => Ok(masked_fa(&mut d, &c)?),
        Some("wait") => Ok(wait(&mut d, &c)?),
        Some("questions") => questions(&mut d, c, None, opt("--profile").map(PathBuf::from)),
        Some("recv-publish") => {
            let mut stdout = std::io::stdout();
            let mut rig = Rig::new(&mut d, c, Patience::HARDWARE, &mut stdout)?;
            Ok(rig.step(bringup::recv_publish::run).answer().is_some())
        }
        Some("unchecked-unbind") => {
            let mut stdout = std::io::stdout();
            let mut rig = Rig::new(&mut d, c, Patience::HARDWARE, &mut stdout)?;
            Ok(rig.step(bringup::unchecked_unbind::run).answer().is_some())
        }
        Some(s) if Question::ALL.iter().any(|q| q.key().replace('_', "-") == s) => {
            let q = Question::ALL.into_iter().find(|q| q.key().replace('_', "-") == s);
            questions(&mut d, c, q, None)
        }
        Some("bind") => Ok(bind(&mut d, &c, args.iter().any(|a| a == "--imm-current"))?),
        Some("offload") => {
            drop(d);
            offload(&choice, c)
        }
        _ => {
            eprintln!(
                "usage: omw-mlx5-bringup questions|wait-prefetch|recv-enable|send-en-unit|self-enable|foreign-bind|recv-publish|unchecked-unbind|caps|cd-roles|loopback|bind|masked-fa|wait|offload [--device NAME] [--gid-index N] [--profile FILE] [--imm-current]"
            );
            Ok(false)
        }
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("omw-mlx5-bringup: {e}");
            ExitCode::FAILURE
        }
    }
}
