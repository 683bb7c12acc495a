//! Issue 10 on the extension double: protection domains keep MN-private memory out of reach
//! of every CN-facing QP whatever key it guesses, key bytes come from the block's seeded
//! generator, and the rules are the core's shared `mw_rules` (PD, zero-based windows, atomic
//! alignment). Plus the block's register protocol: busy/done status with a tag.

mod support;

use omw_core::access::AccessFlags;
use omw_core::device::{DataPath, OffloadRings, Provision, WcStatus};
use omw_core::ids::Rkey;
use omw_core::wire::wqe::{QueueSel, Wqe};
use omw_fpga::double::{Fabric, NodeConfig};
use omw_fpga::encoding::OpcodeEncoding;
use omw_fpga::ext::{self, key_cmd};
use omw_fpga::mmio::Mmio;
use omw_fpga::{Domain, Error, FpgaBackend, FpgaConfig, QpSetup};
use support::*;

const CN: u64 = 0x1000_0000;
const MN: u64 = 0x4000_0000;
const META: u64 = MN + 0x1000;
const POOL: u64 = MN + 0x10_0000;
const WIN: u64 = POOL + 0x1000;

struct World {
    f: Fabric,
    cn: Host,
    mn: Host,
    cn_lkey: u32,
    meta_rkey: u32,
    pool_lkey: u32,
}

/// MN ctid 1 (CN-facing) ↔ CN ctid 1; MN ctids 3 ↔ 4 a loop pair in the MN-private domain.
fn world() -> World {
    let f = Fabric::new();
    let mut cn = host(&f, 0x0A00_0001, CN, true, OpcodeEncoding::CoyoteV2);
    let mut mn = host(&f, 0x0A00_0002, MN, true, OpcodeEncoding::CoyoteV2);
    setup(&mut cn, 1, QpSetup::plain(16, 0));
    setup(&mut mn, 1, QpSetup::plain(16, 0));
    connect(&mut cn, 1, &mut mn, 1, (0, 0), (0, 0));
    setup(&mut mn, 3, QpSetup::plain(16, 0).in_domain(Domain::MnPrivate));
    setup(&mut mn, 4, QpSetup::plain(0, 0).in_domain(Domain::MnPrivate));
    connect_loop(&mut mn, 3, 4);

    use omw_core::device::Provision;
    use AccessFlags as A;
    let rights = A::LOCAL_WRITE | A::REMOTE_READ | A::REMOTE_WRITE | A::REMOTE_ATOMIC;
    let meta = mn.be.reg_mr_in(Domain::MnPrivate, META, 0x1000, rights).unwrap();
    let pool = mn.be.reg_mr_in(Domain::CnFacing, POOL, 0x10000, rights | A::MW_BIND).unwrap();
    let cn_lkey = cn.be.reg_mr(omw_core::device::Domain::CnFacing, CN, 0x10000, A::LOCAL_WRITE).unwrap().lkey;
    assert_ne!(mn.be.pd(Domain::CnFacing).unwrap(), mn.be.pd(Domain::MnPrivate).unwrap());
    World { f, cn, mn, cn_lkey, meta_rkey: meta.rkey, pool_lkey: pool.lkey }
}

impl World {
    fn cn_op(&mut self, w: Wqe) -> WcStatus {
        let q = self.cn.be.qpn(1).unwrap();
        self.cn.be.post_send(q, &w.with_wr_id(0xC0)).unwrap();
        let st = wait1(&mut self.cn.be, q, QueueSel::Send).status;
        if st != WcStatus::Success {
            let m = self.mn.be.qpn(1).unwrap();
            self.cn.be.reset_qp(q).unwrap();
            self.mn.be.reset_qp(m).unwrap();
        }
        st
    }
    fn loop_op(&mut self, w: Wqe) -> WcStatus {
        let q = self.mn.be.qpn(3).unwrap();
        self.mn.be.post_send(q, &w.with_wr_id(0x10)).unwrap();
        let st = wait1(&mut self.mn.be, q, QueueSel::Send).status;
        if st != WcStatus::Success {
            self.mn.be.reset_qp(q).unwrap();
        }
        st
    }
    fn bind(&mut self, mw: Rkey, len: u32, access: AccessFlags) -> WcStatus {
        self.bind_at(mw, WIN, len, access)
    }
    fn bind_at(&mut self, mw: Rkey, at: u64, len: u32, access: AccessFlags) -> WcStatus {
        let target = self.mn.be.qpn(1).unwrap().get();
        self.loop_op(Wqe::bind_mw(mw.0, at, len, self.pool_lkey, target, access))
    }
}

#[test]
fn no_cn_facing_qp_reaches_mn_private_memory_with_any_key() {
    let mut w = world();
    w.mn.be.write_local(META, b"MN-private table!").unwrap();
    let meta_rkey = w.meta_rkey;
    // the exact key, from the CN-facing QP: refused (PD), as a READ, a WRITE and an atomic
    assert_eq!(w.cn_op(Wqe::read(CN, w.cn_lkey, 8, META, meta_rkey)), WcStatus::RemAccessErr);
    assert_eq!(w.cn_op(Wqe::write(CN, w.cn_lkey, 8, META, meta_rkey)), WcStatus::RemAccessErr);
    assert_eq!(w.cn_op(Wqe::fetch_add(CN, w.cn_lkey, META, meta_rkey, 1)), WcStatus::RemAccessErr);
    // nor with any other key byte of that index
    for b in 0..=255u32 {
        let guess = meta_rkey & !0xFF | b;
        assert_eq!(w.cn_op(Wqe::read(CN, w.cn_lkey, 8, META, guess)), WcStatus::RemAccessErr, "key {guess:#x}");
    }
    assert_eq!(w.mn.be.read_local_vec(META, 17), b"MN-private table!");
    // the rings: registered in the MN-private domain only
    let ring = w.mn.be.ring_keys(omw_core::device::Domain::MnPrivate).unwrap();
    let ring_base = w.mn.be.ring_base(w.mn.be.qpn(3).unwrap(), QueueSel::Send).unwrap();
    assert_eq!(w.cn_op(Wqe::write(CN, w.cn_lkey, 8, ring_base, ring.rkey)), WcStatus::RemAccessErr);
    // the CN-facing registration of the rings is local-only: its key reaches nothing remotely
    let local = w.mn.be.ring_keys_in(Domain::CnFacing).unwrap();
    assert_ne!(local.rkey, ring.rkey);
    assert_eq!(w.cn_op(Wqe::write(CN, w.cn_lkey, 8, ring_base, local.rkey)), WcStatus::RemAccessErr);
    // the private loop QPs do reach it
    assert_eq!(w.loop_op(Wqe::read(META + 0x800, meta_rkey, 8, META, meta_rkey)), WcStatus::Success);
    assert_eq!(w.mn.be.read_local_vec(META + 0x800, 8), b"MN-priva");
}

#[test]
fn windows_live_with_the_pool_and_are_bound_from_the_private_loop_qp() {
    let mut w = world();
    w.mn.be.write_local(WIN, &(0u8..64).collect::<Vec<_>>()).unwrap();
    let mw = w.mn.be.alloc_mw_in(Domain::CnFacing).unwrap();
    // bound from the MN-private loop QP to the CN-facing QP (window PD = MR PD = target PD)
    let rk = mw.next_key();
    assert_eq!(w.bind(rk, 64, AccessFlags::DATA_WINDOW | AccessFlags::REMOTE_ATOMIC), WcStatus::Success);
    assert_eq!(w.cn_op(Wqe::read(CN, w.cn_lkey, 8, WIN + 8, rk.0)), WcStatus::Success);
    assert_eq!(w.cn.be.read_local_vec(CN, 8), [8, 9, 10, 11, 12, 13, 14, 15]);
    // atomics must be 8-byte aligned: the shim refuses a misaligned WQE before the ring ...
    let q = w.cn.be.qpn(1).unwrap();
    assert!(matches!(w.cn.be.post_send(q, &Wqe::fetch_add(CN, w.cn_lkey, WIN + 4, rk.0, 1)), Err(Error::Wqe(_))));
    assert_eq!(w.cn_op(Wqe::fetch_add(CN, w.cn_lkey, WIN + 16, rk.0, 1)), WcStatus::Success);
    // ... and the responder checks the effective address: an aligned offset into a zero-based
    // window at an odd base is an invalid request, not an access error
    let odd = w.mn.be.alloc_mw().unwrap().next_key();
    let zb = AccessFlags::REMOTE_ATOMIC | AccessFlags::ZERO_BASED;
    assert_eq!(w.bind_at(odd, WIN + 4, 16, zb), WcStatus::Success);
    assert_eq!(w.cn_op(Wqe::fetch_add(CN, w.cn_lkey, 0, odd.0, 1)), WcStatus::RemInvReqErr);
    // a window in the private domain cannot be bound to a CN-facing QP
    let private = w.mn.be.alloc_mw_in(Domain::MnPrivate).unwrap();
    assert_eq!(w.bind(private.next_key(), 64, AccessFlags::REMOTE_READ), WcStatus::MwBindErr);
    assert_eq!(w.f.mw(w.mn.id, private.0).unwrap().bound, None);
    // a zero-based window: the CN addresses it from 0
    let z = w.mn.be.alloc_mw().unwrap().next_key();
    assert_eq!(w.bind(z, 32, AccessFlags::REMOTE_READ | AccessFlags::ZERO_BASED), WcStatus::Success);
    assert_eq!(w.cn_op(Wqe::read(CN + 0x100, w.cn_lkey, 4, 4, z.0)), WcStatus::Success);
    assert_eq!(w.cn.be.read_local_vec(CN + 0x100, 4), [4, 5, 6, 7]);
    assert_eq!(w.cn_op(Wqe::read(CN + 0x100, w.cn_lkey, 4, 30, z.0)), WcStatus::RemAccessErr, "past its 32 bytes");
    // deallocation revokes the binding; only the current key frees the window
    assert!(matches!(w.mn.be.dealloc_mw(Rkey(rk.0 ^ 1)), Err(Error::KeyTable { code: ext::key_err::STALE_KEY })));
    w.mn.be.dealloc_mw(rk).unwrap();
    assert_eq!(w.f.mw(w.mn.id, rk.0), None);
    assert_eq!(w.cn_op(Wqe::read(CN, w.cn_lkey, 8, WIN + 8, rk.0)), WcStatus::RemAccessErr);
    assert!(matches!(w.mn.be.dealloc_mw(rk), Err(Error::KeyTable { code: ext::key_err::NO_SUCH_KEY })));
}

fn keys(seed: u64) -> Vec<u32> {
    let f = Fabric::new();
    let id = f.add_node(NodeConfig::stock(9, MN, 1 << 20).with_extension().with_key_seed(seed));
    let mut be: Be =
        FpgaBackend::open(f.mmio(id), f.user_csr(id), f.memory(id), FpgaConfig::new(0, OpcodeEncoding::CoyoteV2, 9))
            .unwrap();
    let mut k = Vec::new();
    for i in 0..8 {
        k.push(
            be.reg_mr(omw_core::device::Domain::CnFacing, MN + i * 0x100, 0x100, AccessFlags::LOCAL_WRITE)
                .unwrap()
                .rkey,
        );
        k.push(be.alloc_mw().unwrap().0);
    }
    k
}

#[test]
fn key_bytes_come_from_the_seeded_generator() {
    let (a, b) = (keys(1), keys(2));
    assert_eq!(a, keys(1), "the model is deterministic for a seed");
    assert_ne!(a, b, "another seed, other keys");
    // same indexes, different bytes: no key is a function of its index
    assert_eq!(a.iter().map(|k| k >> 8).collect::<Vec<_>>(), b.iter().map(|k| k >> 8).collect::<Vec<_>>());
    let bytes: Vec<u8> = a.iter().map(|k| *k as u8).collect();
    assert!(bytes.windows(2).any(|p| p[1] != p[0].wrapping_add(1)), "not a counter: {bytes:?}");
}

#[test]
fn key_mailbox_completes_by_status_and_tag() {
    let f = Fabric::new();
    let id = f.add_node(NodeConfig::stock(9, MN, 1 << 20).with_extension());
    let csr = f.user_csr(id);
    let at = |r: usize| ext::DEFAULT_BASE + r;
    csr.write_csr(at(ext::KEY_CMD), ext::key_cmd_word(key_cmd::ALLOC_PD, 0x5A)).unwrap();
    let r = csr.read_csr(at(ext::KEY_RESULT)).unwrap();
    assert!(r & ext::KEY_RESULT_BUSY != 0 && r & ext::KEY_RESULT_DONE == 0, "{r:#x}");
    assert_eq!(ext::key_result_tag(r), 0x5A);
    // a second user's command and operands while BUSY are dropped (and counted)
    csr.write_csr(at(ext::KEY_PD), 77).unwrap();
    csr.write_csr(at(ext::KEY_CMD), ext::key_cmd_word(key_cmd::ALLOC_PD, 0x5B)).unwrap();
    assert_eq!(f.stats(id).mailbox_collisions, 2);
    let mut r = 0;
    for _ in 0..10 {
        r = csr.read_csr(at(ext::KEY_RESULT)).unwrap();
        if r & ext::KEY_RESULT_DONE != 0 {
            break;
        }
    }
    assert_eq!((r & ext::KEY_RESULT_DONE != 0, ext::key_result_tag(r), r as u32), (true, 0x5A, 1));
    assert_eq!(csr.read_csr(at(ext::KEY_PD)).unwrap(), 0, "operand write while BUSY ignored");
    for _ in 0..10 {
        assert_eq!(ext::key_result_tag(csr.read_csr(at(ext::KEY_RESULT)).unwrap()), 0x5A, "0x5B never ran");
    }
    // a QP command reports BUSY, then DONE with the command
    let st = ext::qp_reg(5, ext::qp::CMD_STATUS);
    csr.write_csr(ext::qp_reg(5, ext::qp::CMD), ext::qp_cmd::INIT).unwrap();
    let s0 = csr.read_csr(st).unwrap();
    let s1 = csr.read_csr(st).unwrap();
    assert!(s0 & ext::QP_CMD_BUSY != 0 || s1 & ext::QP_CMD_DONE != 0, "{s0:#x} {s1:#x}");
    assert_eq!((s1 & ext::QP_CMD_DONE, (s1 >> 8) & 0xFF), (ext::QP_CMD_DONE, ext::qp_cmd::INIT));
}

trait ReadVec {
    fn read_local_vec(&self, addr: u64, len: usize) -> Vec<u8>;
}
impl ReadVec for Be {
    fn read_local_vec(&self, addr: u64, len: usize) -> Vec<u8> {
        get(self, addr, len)
    }
}

#[test]
fn a_block_without_protection_domains_has_no_private_domain() {
    let f = Fabric::new();
    let id = f.add_node(NodeConfig::stock(9, MN, 4 << 20).with_extension().without_protection_domains());
    let cfg = FpgaConfig::new(0, OpcodeEncoding::CoyoteV2, 9).with_threads(4).with_ring_arena(MN + (3 << 20), 1 << 20);
    let mut be: Be = FpgaBackend::open(f.mmio(id), f.user_csr(id), f.memory(id), cfg).unwrap();
    // MN-private memory never lands in PD 0 with the CN-facing QPs: every private request is refused
    assert_eq!(be.pd(Domain::CnFacing).unwrap(), 0);
    assert!(matches!(be.pd(Domain::MnPrivate), Err(Error::NoSuchDomain(Domain::MnPrivate))));
    let rights = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    assert!(matches!(be.reg_mr_in(Domain::MnPrivate, META, 64, rights), Err(Error::NoSuchDomain(_))));
    assert!(matches!(be.ring_keys_in(Domain::MnPrivate), Err(Error::NoSuchDomain(_))));
    assert!(matches!(be.create_qp(1, QpSetup::plain(4, 0).in_domain(Domain::MnPrivate)), Err(Error::NoSuchDomain(_))));
    assert!(be.ring_keys_in(Domain::CnFacing).is_ok());
    assert!(f.mrs(id).iter().all(|m| !m.access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)));
    // so offloaded provisioning through the MN plan fails instead of running unseparated
    use omw_core::mn::plan::{MnOptions, MnPlan, MnRegions, PlanError};
    let plan = MnPlan::decide(be.capabilities(), MnOptions::default()).unwrap();
    assert_eq!(plan.mode, omw_core::device::ExecutionMode::Offloaded);
    let geo = omw_core::geometry::PoolGeometry::new(MN + (1 << 20), 4096, 4, 3).unwrap();
    let map = omw_core::wire::memory_map::MnMemoryMap::new(geo, 1, MN + (2 << 20)).unwrap();
    let r = plan.register_metadata(&mut be, &MnRegions { map, zero_source: Some(MN + 0x8000) });
    assert!(matches!(r, Err(PlanError::Backend(Error::NoSuchDomain(Domain::MnPrivate)))), "{r:?}");
}
