//! The no_std scenario: an MN provisioned by its plan, two CNs on `CnDriver`, over the core's
//! test NIC, all in fixed-size memory lent from the caller's stack. Shared by the freestanding
//! binary (which exits with the result) and the footprint report (which measures its types).

use core::cell::RefCell;
use omw_core::access::AccessFlags;
use omw_core::device::{DataPath, Domain, Provision, WcStatus};
use omw_core::cn::driver::{CnDriver, CnEvent, CnMemory, CnQpSet};
use omw_core::mn::CnQps;
use omw_core::mn::driver::MnDriver;
use omw_core::mn::plan::{MnOptions, MnPlan};
use omw_core::mn::provision::PoolSpec;
use omw_core::device::mw_rules::Mode;
use omw_core::testing::deployment::{Deployment, Immediate};
use omw_core::testing::test_nic::{Node, NodeId, TestNic};

pub const CHUNK: u64 = 4096;
pub const CHUNKS: u32 = 4;
pub const GROUP: u8 = 2;
pub const CNS: u32 = 2;
/// Live allocations a CN tracks.
pub const CN_LIVE: usize = 16;
pub const MN_MEM: usize = 64 << 10;
pub const CN_MEM: usize = 48 << 10;

pub type Nic<'m> = TestNic<'m, 3, 16, 24>;
pub type View<'a, 'm> = Node<'a, 'm, 3, 16, 24>;
pub type Mn<'a, 'm> = MnDriver<View<'a, 'm>>;
pub type Cn<'a, 'm> = CnDriver<View<'a, 'm>, CN_LIVE>;

/// Which step failed (the process exit status).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Step {
    Fabric = 10,
    Provision = 11,
    CnSetup = 12,
    Connect = 13,
    Alloc = 14,
    Write = 15,
    Read = 16,
    Data = 17,
    CrossCn = 18,
    Free = 19,
    StaleKey = 20,
}

fn cn<'a, 'm>(nic: &'a RefCell<Nic<'m>>, at: NodeId, mn: NodeId) -> Result<(Cn<'a, 'm>, CnQps), Step> {
    let mut c = Node::new(nic, at);
    let pair = |c: &View<'a, 'm>| c.connect_to(Domain::CnFacing, mn, Domain::CnFacing).map_err(|_| Step::CnSetup);
    let (alloc, mn_alloc) = pair(&c)?;
    let (free, mn_free) = pair(&c)?;
    let (access, mn_access) = pair(&c)?;
    let reply = c.alloc_memory(CnMemory::REPLY_LEN, 64).map_err(|_| Step::CnSetup)?;
    let rights = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let rk = c.reg_mr(Domain::CnFacing, reply, CnMemory::REPLY_LEN, rights).map_err(|_| Step::CnSetup)?;
    let local_len = CnMemory::local_len_for(omw_core::cn::driver::IO_SLOTS, CHUNK);
    let local = c.alloc_memory(local_len, 64).map_err(|_| Step::CnSetup)?;
    let lk = c.reg_mr(Domain::CnFacing, local, local_len, AccessFlags::LOCAL_WRITE).map_err(|_| Step::CnSetup)?;
    let mem = CnMemory { local, local_len, lkey: lk.lkey, reply, reply_rkey: rk.rkey };
    let mut acc = heapless::Vec::new();
    acc.push(access).map_err(|_| Step::CnSetup)?;
    let mut mn_acc = heapless::Vec::new();
    mn_acc.push(mn_access).map_err(|_| Step::CnSetup)?;
    let d = CnDriver::new(c, CnQpSet { alloc, free, access: acc }, mem).map_err(|_| Step::CnSetup)?;
    Ok((d, CnQps { alloc: mn_alloc, free: mn_free, access: mn_acc, alloc_loop: None, free_loop: None }))
}

/// Run the MN and `cns` until nothing moves (the core's one pump; the test NIC runs work as
/// it is posted, so its fabric only keeps the clock).
fn pump(mn: &mut Mn<'_, '_>, cns: &mut [&mut Cn<'_, '_>], step: Step) -> Result<(), Step> {
    Deployment::new(&mut Immediate::default(), mn, cns).pump().map(|_| ()).map_err(|_| step)
}

/// One access through the CN's first window; its completion status and bytes.
fn access(
    mn: &mut Mn<'_, '_>,
    c: &mut Cn<'_, '_>,
    write: Option<&[u8]>,
    addr: u64,
    rkey: omw_core::ids::Rkey,
    out: &mut [u8],
    step: Step,
) -> Result<WcStatus, Step> {
    let op = match write {
        Some(d) => c.post_write(0, addr, rkey, d),
        None => c.post_read(0, addr, rkey, out.len()),
    }
    .map_err(|_| step)?;
    for _ in 0..8 {
        pump(mn, &mut [&mut *c], step)?;
        if let Some(done) = c.access_done(op, out).map_err(|_| step)? {
            return Ok(done.status);
        }
    }
    Err(step)
}

/// The whole scenario; `Ok` if every promise held.
pub fn run(mn_mem: &mut [u8], cn0_mem: &mut [u8], cn1_mem: &mut [u8]) -> Result<(), Step> {
    let mut nic: Nic<'_> = TestNic::new(Mode::Strict);
    let mn_at = nic.add_node(mn_mem).map_err(|_| Step::Fabric)?;
    let at0 = nic.add_node(cn0_mem).map_err(|_| Step::Fabric)?;
    let at1 = nic.add_node(cn1_mem).map_err(|_| Step::Fabric)?;
    let nic = RefCell::new(nic);
    let b = Node::new(&nic, mn_at);
    let plan = MnPlan::decide(b.capabilities(), MnOptions::default()).map_err(|_| Step::Provision)?;
    let spec = PoolSpec {
        chunk_size: CHUNK,
        chunks: CHUNKS,
        group_size: GROUP,
        max_cns: CNS,
        quota: 0,
        lease_ns: 0,
        queue_depth: None,
    };
    let mut mn = plan.provision(b, &spec).map_err(|_| Step::Provision)?;
    let (mut c0, q0) = cn(&nic, at0, mn_at)?;
    let (mut c1, q1) = cn(&nic, at1, mn_at)?;
    for (c, q) in [(&mut c0, q0), (&mut c1, q1)] {
        Deployment::new(&mut Immediate::default(), &mut mn, &mut [&mut *c])
            .connect(0, q, None)
            .map_err(|_| Step::Connect)?;
        if !matches!(c.next_event(), Some(CnEvent::Connected(_))) {
            return Err(Step::Connect);
        }
    }
    // CN 0 allocates a chunk
    let tok = c0.alloc(0).map_err(|_| Step::Alloc)?;
    pump(&mut mn, &mut [&mut c0], Step::Alloc)?;
    let a = match c0.next_event() {
        Some(CnEvent::Allocated { token, result: Ok(a) }) if token == tok => a,
        _ => return Err(Step::Alloc),
    };
    let key = *a.rkeys.first().ok_or(Step::Alloc)?;
    // write and read back through its window
    let msg = *b"omw: no_std, no alloc, one NIC";
    let mut back = [0u8; 30];
    if access(&mut mn, &mut c0, Some(&msg), a.base + 64, key, &mut [], Step::Write)? != WcStatus::Success {
        return Err(Step::Write);
    }
    if access(&mut mn, &mut c0, None, a.base + 64, key, &mut back, Step::Read)? != WcStatus::Success {
        return Err(Step::Read);
    }
    if back != msg {
        return Err(Step::Data);
    }
    // CN 1 names CN 0's window: its QP is not the bound one
    let mut stolen = [0u8; 30];
    if access(&mut mn, &mut c1, None, a.base + 64, key, &mut stolen, Step::CrossCn)? != WcStatus::RemAccessErr
        || stolen == msg
    {
        return Err(Step::CrossCn);
    }
    // free; the old key is stale
    c0.free(&a).map_err(|_| Step::Free)?;
    pump(&mut mn, &mut [&mut c0], Step::Free)?;
    if mn.stats.laps != 2 || mn.stats.laps_failed != 0 || mn.mn.stats().chunks_scrubbed == 0 {
        return Err(Step::Free);
    }
    if access(&mut mn, &mut c0, None, a.base + 64, key, &mut back, Step::StaleKey)? != WcStatus::RemAccessErr {
        return Err(Step::StaleKey);
    }
    Ok(())
}
