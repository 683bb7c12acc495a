//! The core's alloc and free chains, offloaded into the modelled engine's extension block.
//!
//! The MN side is the core's own control plane (`omw_core::mn_driver::MnDriver` over this
//! crate's `RdmaBackend`): it formats the pool (free queue, MWTable), initialises each CN's
//! scratch and arms the chains with `omw_core::arm::arm`. From then on the MN CPU is off the
//! path: a CN's SEND of an `AllocRequest` triggers the chain inside the engine, and the reply
//! arrives by WRITE_WITH_IMM.

mod support;

use omw_core::access::AccessFlags;
use omw_core::backend::{Domain, ExecutionMode, QpState, RdmaBackend, WcOpcode, WcStatus};
use omw_core::chain::{ChainKind, Ring};
use omw_core::chain_builder::ChainEnv;
use omw_core::geometry::PoolGeometry;
use omw_core::host_engine::HostRegions;
use omw_core::ids::{CnId, Qpn, Rkey};
use omw_core::mn::{CnQps, MemoryNode, MnConfig, MnKeys};
use omw_core::mn_driver::{build, MnDriver};
use omw_core::mn_memory::MnMemoryMap;
use omw_core::mwtable::MwTableEntry;
use omw_core::wire::{AllocReply, AllocRequest, FreeRequest, MnMessage, ALLOC_REPLY_LEN};
use omw_core::wqe::{QueueSel, RecvWqe, Sge, Wqe};
use omw_fpga::double::Fabric;
use omw_fpga::encoding::OpcodeEncoding;
use omw_fpga::QpSetup;
use support::*;

const MN: u64 = 0x4000_0000;
const POOL: u64 = MN + 0x10_0000;
const META: u64 = MN + 0x20_0000;
const CHUNK: u64 = 4096;
const CHUNKS: u32 = 16;
const G: u8 = 3;
const ADMIN: u8 = 60;

/// A CN: its host, its QPs (CN ends and MN ends), its registered buffer.
struct Cn {
    h: Host,
    id: CnId,
    lkey: u32,
    rkey: u32,
    /// CN ends: alloc, free, access 0, access 1.
    q: [Qpn; 4],
    /// MN ends, same order.
    mq: [Qpn; 4],
}

struct Setup {
    f: Fabric,
    mn_id: omw_fpga::double::NodeId,
    d: MnDriver<Be>,
    cns: Vec<Cn>,
    now: u64,
}

const REQ: u64 = 0x1000;
const REPLY: u64 = 0x2000;
const NOTICE: u64 = 0x3000;
const DATA: u64 = 0x4000;

fn ring_depths(map: MnMemoryMap, keys: MnKeys) -> [[u32; 2]; 2] {
    let env = ChainEnv {
        map,
        slot: 0,
        cn: CnId::new(1).unwrap(),
        loop_qpn: 1,
        mgmt_qpn: 2,
        free_qpn: 3,
        keys: MnKeys {
            meta_lkey: keys.meta_lkey,
            meta_rkey: keys.meta_rkey,
            table_rkey: keys.table_rkey,
            ring_lkey: keys.ring_lkey,
            ring_rkey: keys.ring_rkey,
            cn_meta_lkey: keys.meta_lkey,
            cn_ring_lkey: keys.ring_lkey,
            ..MnKeys::default()
        },
        queue_depth: 128,
        window_access: AccessFlags::DATA_WINDOW,
        owner_window_access: AccessFlags::REMOTE_READ,
    };
    let a = build(ChainKind::Alloc, &env).unwrap().ring_depth;
    let f = build(ChainKind::Free, &env).unwrap().ring_depth;
    [[a[0] as u32, a[1] as u32], [f[0] as u32, f[1] as u32]]
}

/// The table entry as the CN sees it: the reply clears the MN's MR key (DESIGN.md §9).
fn without_lkey(mut e: MwTableEntry) -> MwTableEntry {
    e.lkey = 0.into();
    e
}

fn setup(n_cns: usize) -> Setup {
    let f = Fabric::new();
    // one PD for the whole MN: the core's MnKeys has one meta lkey and one ring lkey for both
    // the CN-facing chain QPs and the loop QPs (the chains receive CN requests straight into
    // ring WQEs), so the two-domain split needs the MN plan of issue 10/12 first
    let mut mn = host_with(&f, 0x0A00_00FF, MN, true, OpcodeEncoding::AppOpcodes, |c| c.with_single_pd());
    assert_eq!(mn.be.secure_mode(), Ok(ExecutionMode::Offloaded));
    let geo = PoolGeometry::new(POOL, CHUNK, CHUNKS, G).unwrap();
    let map = MnMemoryMap::new(geo, 4, META).unwrap();
    use AccessFlags as A;
    let meta = mn.be.reg_mr(
        Domain::CnFacing,
        map.meta_base,
        map.meta_len,
        A::LOCAL_WRITE | A::REMOTE_READ | A::REMOTE_WRITE | A::REMOTE_ATOMIC,
    );
    let meta = meta.unwrap();
    let table = mn
        .be
        .reg_mr(Domain::CnFacing, map.table_base, map.table_len(), A::LOCAL_WRITE | A::REMOTE_READ | A::REMOTE_WRITE)
        .unwrap();
    let pool = mn
        .be
        .reg_mr(Domain::CnFacing, POOL, geo.pool_len(), A::MW_BIND | A::LOCAL_WRITE | A::REMOTE_READ | A::REMOTE_WRITE)
        .unwrap();
    let ring = mn.be.ring_keys(Domain::CnFacing).unwrap();
    let keys = MnKeys {
        meta_lkey: meta.lkey,
        meta_rkey: meta.rkey,
        table_rkey: table.rkey,
        ring_lkey: ring.lkey,
        ring_rkey: ring.rkey,
        cn_meta_lkey: meta.lkey,
        cn_ring_lkey: ring.lkey,
        ..MnKeys::default()
    };
    let depths = ring_depths(map, keys);
    // the admin QP (management unbinds), a loopback pair
    support::setup(&mut mn, ADMIN, QpSetup::plain(16, 0));
    support::setup(&mut mn, ADMIN + 1, QpSetup::plain(0, 0));
    connect_loop(&mut mn, ADMIN, ADMIN + 1);
    let mut rkeys: Vec<Rkey> = Vec::new();
    for _ in 0..CHUNKS * G as u32 {
        rkeys.push(mn.be.alloc_mw().unwrap());
    }
    let mut cns = Vec::new();
    for i in 0..n_cns {
        let base = 0x1000_0000 * (i as u64 + 1);
        let mut h = host(&f, 0x0A00_0001 + i as u32, base, true, OpcodeEncoding::AppOpcodes);
        let mr = h.be.reg_mr(Domain::CnFacing, base, 0x10000, A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
        // MN ctids of this CN: alloc, free, access0, access1, alloc loop (+1), free loop (+1)
        let c0 = 1 + 8 * i as u8;
        let m = [c0, c0 + 1, c0 + 2, c0 + 3];
        let (al, fl) = (c0 + 4, c0 + 6);
        support::setup(&mut mn, m[0], QpSetup::managed(depths[0][Ring::Mgmt as usize], 1));
        support::setup(&mut mn, m[1], QpSetup::managed(depths[1][Ring::Mgmt as usize], 1));
        support::setup(&mut mn, m[2], QpSetup::plain(16, 0));
        support::setup(&mut mn, m[3], QpSetup::plain(16, 0));
        support::setup(&mut mn, al, QpSetup::managed(depths[0][Ring::Loop as usize], 0));
        support::setup(&mut mn, fl, QpSetup::managed(depths[1][Ring::Loop as usize], 0));
        for p in [al + 1, fl + 1] {
            support::setup(&mut mn, p, QpSetup::plain(0, 0));
        }
        connect_loop(&mut mn, al, al + 1);
        connect_loop(&mut mn, fl, fl + 1);
        let mut q = [Qpn::default(); 4];
        let mut mq = [Qpn::default(); 4];
        for k in 0..4u8 {
            support::setup(&mut h, 1 + k, QpSetup::plain(16, 16));
            let (a, b) = connect(&mut h, 1 + k, &mut mn, m[k as usize], (0, 0), (0, 0));
            q[k as usize] = a;
            mq[k as usize] = b;
        }
        cns.push((h, mr, q, mq, mn.be.qpn(al).unwrap(), mn.be.qpn(fl).unwrap()));
    }
    let cfg = MnConfig {
        geometry: geo,
        max_cns: 4,
        quota: CHUNKS,
        mode: ExecutionMode::Offloaded,
        software_ownership_check: false,
        queue_depth: 128,
        window_access: AccessFlags::DATA_WINDOW,
        scrub: omw_core::mn_plan::ScrubPath::Cpu,
        lease_ns: 0,
    };
    let regions = HostRegions::new(&map, &keys);
    let admin = mn.be.qpn(ADMIN).unwrap();
    let mn_id = mn.id;
    let node = MemoryNode::new(cfg, map, keys).unwrap();
    let mut d = MnDriver::new(mn.be, node, regions, admin);
    let pool_lkey = pool.lkey;
    d.format(|g, k| rkeys[g.0 as usize * G as usize + k], |_| pool_lkey).unwrap();
    let mut out = Vec::new();
    for (mut h, mr, q, mq, al, fl) in cns {
        // a receive for the MN's ConnectInfo on access QP 0
        let mut r = RecvWqe { wr_id: 0xC0, sges: heapless::Vec::new() };
        r.sges.push(Sge { addr: h.mem_base + NOTICE, length: 64, lkey: mr.lkey }).unwrap();
        h.be.post_recv(q[2], &r).unwrap();
        let qps = CnQps {
            alloc: mq[0],
            free: mq[1],
            access: [mq[2], mq[3]].into_iter().collect(),
            alloc_loop: Some(al),
            free_loop: Some(fl),
        };
        let id = d.connect(qps).unwrap();
        let c = wait1(&mut h.be, q[2], QueueSel::Recv);
        assert_eq!(c.status, WcStatus::Success);
        let bytes = get(&h.be, h.mem_base + NOTICE, c.byte_len as usize);
        match MnMessage::decode(&bytes).unwrap() {
            MnMessage::ConnectInfo(ci) => {
                assert_eq!(ci.cn, id);
                assert_eq!(ci.access_qpns.as_slice(), &[mq[2], mq[3]]);
            }
            m => panic!("expected ConnectInfo, got {m:?}"),
        }
        out.push(Cn { h, id, lkey: mr.lkey, rkey: mr.rkey, q, mq });
    }
    Setup { f, mn_id, d, cns: out, now: 0 }
}

impl Setup {
    /// Let the MN CPU look for exceptions (it is not on the allocation path).
    fn mn_poll(&mut self) {
        self.now += 1;
        self.d.poll(self.now).unwrap();
    }

    fn alloc(&mut self, i: usize, token: u32) -> AllocReply {
        let c = &mut self.cns[i];
        let base = c.h.mem_base;
        c.h.be.post_recv(c.q[0], &RecvWqe { wr_id: 0xA110C, sges: heapless::Vec::new() }).unwrap();
        let req = AllocRequest {
            token,
            reply_addr: base + REPLY,
            reply_rkey: c.rkey,
            access_qpns: [c.mq[2], c.mq[3]].into_iter().collect(),
        };
        let mut b = [0u8; 64];
        let n = req.encode(&mut b).unwrap();
        put(&mut c.h.be, base + REQ, &b[..n]);
        c.h.be.post_send(c.q[0], &Wqe::send(base + REQ, c.lkey, n as u32).with_wr_id(token as u64)).unwrap();
        let sent = wait1(&mut c.h.be, c.q[0], QueueSel::Send);
        assert_eq!((sent.wr_id, sent.status), (token as u64, WcStatus::Success));
        let done = wait1(&mut c.h.be, c.q[0], QueueSel::Recv);
        assert_eq!(done.status, WcStatus::Success);
        assert_eq!(done.opcode, WcOpcode::RecvRdmaWithImm);
        assert_eq!(done.imm, Some(token), "the reply's immediate is the CN's token");
        assert_eq!(done.byte_len as usize, ALLOC_REPLY_LEN);
        AllocReply::decode(&get(&c.h.be, base + REPLY, ALLOC_REPLY_LEN)).unwrap()
    }

    /// Send a free request on CN `i`'s Free QP (for `entry_addr`, which may be someone else's).
    fn send_free(&mut self, i: usize, entry_addr: u64, token: u32) {
        let c = &mut self.cns[i];
        let base = c.h.mem_base;
        put(&mut c.h.be, base + REQ, &FreeRequest { token, entry_addr }.encode());
        c.h.be.post_send(c.q[1], &Wqe::send(base + REQ, c.lkey, 16).with_wr_id(token as u64)).unwrap();
        let sent = wait1(&mut c.h.be, c.q[1], QueueSel::Send);
        assert_eq!(sent.status, WcStatus::Success, "the request itself is delivered");
        // let the chain run
        self.f.run(2_000);
    }

    /// One-sided access through access QP `k` of CN `i`.
    fn access(&mut self, i: usize, k: usize, write: Option<&[u8]>, addr: u64, rkey: Rkey, len: u32) -> WcStatus {
        let c = &mut self.cns[i];
        let base = c.h.mem_base;
        let q = c.q[2 + k];
        let w = match write {
            Some(data) => {
                put(&mut c.h.be, base + DATA, data);
                Wqe::write(base + DATA, c.lkey, data.len() as u32, addr, rkey.0)
            }
            None => Wqe::read(base + DATA + 0x800, c.lkey, len, addr, rkey.0),
        };
        c.h.be.post_send(q, &w.with_wr_id(0xDA7A)).unwrap();
        let r = wait1(&mut c.h.be, q, QueueSel::Send);
        assert_eq!(r.wr_id, 0xDA7A);
        r.status
    }

    fn read_back(&self, i: usize, len: usize) -> Vec<u8> {
        let c = &self.cns[i];
        get(&c.h.be, c.h.mem_base + DATA + 0x800, len)
    }

    fn reset_access(&mut self, i: usize, k: usize) {
        let (q, mq) = (self.cns[i].q[2 + k], self.cns[i].mq[2 + k]);
        self.cns[i].h.be.reset_qp(q).unwrap();
        self.d.backend.reset_qp(mq).unwrap();
    }

    fn entry(&self, addr: u64) -> MwTableEntry {
        let mut b = [0u8; 40];
        self.d.backend.read_local(addr, &mut b).unwrap();
        MwTableEntry::read(&b).unwrap()
    }

    fn bound_to(&self, rkey: Rkey) -> Option<u32> {
        self.f.mw(self.mn_id, rkey.0).and_then(|m| m.bound).filter(|_| true).map(|b| b.qpn)
    }
}

#[test]
fn alloc_chain_runs_offloaded_and_binds_windows_to_the_requested_qps() {
    let mut s = setup(1);
    let executed_before = s.f.stats(s.mn_id).wqes_executed;
    let r = s.alloc(0, 0x1111);
    let e = r.entry;
    let cn = &s.cns[0];
    assert_eq!(e.owner(), cn.id.get());
    assert_eq!(e.length.get() as u64, CHUNK);
    assert!(e.base.get() >= POOL && e.base.get() < POOL + CHUNK * CHUNKS as u64);
    assert_eq!(e.lkey.get(), 0, "the reply carries no MN key");
    assert_eq!(without_lkey(s.entry(r.entry_addr)), e, "the MWTable entry was written back");
    // MW[0] on the CN's Free QP, MW[1..] on the access QPs the request named
    let (free_mn, a0, a1) = (cn.mq[1].get(), cn.mq[2].get(), cn.mq[3].get());
    assert_eq!(s.bound_to(e.rkey(0)), Some(free_mn));
    assert_eq!(s.bound_to(e.rkey(1)), Some(a0));
    assert_eq!(s.bound_to(e.rkey(2)), Some(a1));
    let w = s.f.mw(s.mn_id, e.rkey(1).0).unwrap().bound.unwrap();
    assert_eq!((w.addr, w.len as u64, w.access), (e.base.get(), CHUNK, AccessFlags::DATA_WINDOW));
    // the engine ran the chain; the MN CPU did not (it has not even polled yet)
    assert!(s.f.stats(s.mn_id).wqes_executed > executed_before + 20);
    assert_eq!(s.d.stats.laps, 0);

    // the CN writes and reads its chunk through its windows
    let base = e.base.get();
    assert_eq!(s.access(0, 0, Some(b"hello, chunk"), base + 64, e.rkey(1), 0), WcStatus::Success);
    assert_eq!(s.access(0, 1, None, base + 64, e.rkey(2), 12), WcStatus::Success);
    assert_eq!(s.read_back(0, 12), b"hello, chunk");
    // the window is the chunk: one byte past it is refused
    assert_eq!(s.access(0, 0, None, base + CHUNK - 4, e.rkey(1), 8), WcStatus::RemAccessErr);
    s.reset_access(0, 0);
    // MW[0] is for the ownership proof, not for data: not reachable from an access QP
    assert_eq!(s.access(0, 0, None, base, e.rkey(0), 8), WcStatus::RemAccessErr);
    s.reset_access(0, 0);
    // a window is usable only through the QP it is bound to
    assert_eq!(s.access(0, 1, None, base, e.rkey(1), 8), WcStatus::RemAccessErr);
    s.reset_access(0, 1);

    // the chain re-armed itself: a second allocation, no MN CPU involvement
    let r2 = s.alloc(0, 0x2222);
    assert_ne!(r2.entry_addr, r.entry_addr);
    assert_eq!(r2.entry.owner(), s.cns[0].id.get());
    s.mn_poll();
    assert_eq!(s.d.stats.chain_failures, 0);
    s.d.check_invariants().unwrap();
}

#[test]
fn free_chain_checks_ownership_and_stale_rkeys_die() {
    let mut s = setup(2);
    let mine = s.alloc(0, 0xA);
    let theirs = s.alloc(1, 0xB);
    assert_ne!(mine.entry_addr, theirs.entry_addr);
    let (e, base) = (mine.entry, mine.entry.base.get());
    assert_eq!(s.access(0, 0, Some(b"owner's data"), base, e.rkey(1), 0), WcStatus::Success);

    // CN 1 forges a free of CN 0's chunk: the invalidate of MW[0] on CN 1's own Free QP fails
    s.send_free(1, mine.entry_addr, 0xF0F0);
    let free_mn_1 = s.cns[1].mq[1];
    assert_eq!(s.d.backend.qp_state(free_mn_1).unwrap(), QpState::Err, "the ownership check stopped the chain");
    // nothing of the owner's changed: windows bound, entry owned, data intact
    assert_eq!(s.bound_to(e.rkey(0)), Some(s.cns[0].mq[1].get()));
    assert_eq!(s.bound_to(e.rkey(1)), Some(s.cns[0].mq[2].get()));
    assert_eq!(without_lkey(s.entry(mine.entry_addr)), e);
    assert_eq!(s.access(0, 1, None, base, e.rkey(2), 12), WcStatus::Success);
    assert_eq!(s.read_back(0, 12), b"owner's data");
    // the MN CPU sees the failed step, counts a forged free and re-arms the free chain
    s.mn_poll();
    assert_eq!(s.d.mn.stats().forged_frees, 1);
    assert_eq!(s.d.backend.qp_state(free_mn_1).unwrap(), QpState::Rts);
    s.d.check_invariants().unwrap();

    // the owner frees: windows unbound, keys bumped, owner cleared, group back in the queue
    s.send_free(0, mine.entry_addr, 0xF1);
    assert_eq!(s.bound_to(e.rkey(0)), None);
    assert_eq!(s.bound_to(e.rkey(1)), None);
    let after = s.entry(mine.entry_addr);
    assert_eq!(after.owner(), 0);
    for k in 0..G as usize {
        assert_eq!(after.rkey(k), e.rkey(k).next_key());
    }
    // the stale rkey is dead
    assert_eq!(s.access(0, 0, None, base, e.rkey(1), 8), WcStatus::RemAccessErr);
    s.reset_access(0, 0);
    s.mn_poll();
    assert_eq!(s.d.stats.chain_failures, 1, "only the forged free failed");
    s.d.check_invariants().unwrap();

    // the legitimate free chain re-armed itself and CN 1's was re-armed by the MN: both work
    s.send_free(1, theirs.entry_addr, 0xF2);
    assert_eq!(s.entry(theirs.entry_addr).owner(), 0);
    assert_eq!(s.bound_to(theirs.entry.rkey(1)), None);
    s.mn_poll();
    s.d.check_invariants().unwrap();
}

#[test]
fn empty_queue_stops_the_chain_and_the_mn_recovers() {
    let mut s = setup(1);
    let mut got = Vec::new();
    for t in 0..CHUNKS {
        got.push(s.alloc(0, 0x100 + t));
    }
    // the 17th request: the popped slot is 0, the READ of entry 0 faults, no reply comes
    let c = &mut s.cns[0];
    let base = c.h.mem_base;
    let mut r = RecvWqe { wr_id: 0xE0, sges: heapless::Vec::new() };
    r.sges.push(Sge { addr: base + NOTICE, length: 64, lkey: c.lkey }).unwrap();
    c.h.be.post_recv(c.q[2], &r).unwrap();
    c.h.be.post_recv(c.q[0], &RecvWqe { wr_id: 0xA110C, sges: heapless::Vec::new() }).unwrap();
    let req = AllocRequest {
        token: 0xE,
        reply_addr: base + REPLY,
        reply_rkey: c.rkey,
        access_qpns: [c.mq[2], c.mq[3]].into_iter().collect(),
    };
    let mut b = [0u8; 64];
    let n = req.encode(&mut b).unwrap();
    put(&mut c.h.be, base + REQ, &b[..n]);
    c.h.be.post_send(c.q[0], &Wqe::send(base + REQ, c.lkey, n as u32).with_wr_id(0xE)).unwrap();
    assert_eq!(wait1(&mut c.h.be, c.q[0], QueueSel::Send).status, WcStatus::Success);
    s.f.run(2_000);
    let c = &mut s.cns[0];
    assert!(drain(&mut c.h.be, c.q[0], QueueSel::Recv, 50).is_empty(), "no reply from an empty pool");
    // the MN CPU learns it from the failed step and tells the CN
    s.mn_poll();
    assert!(s.d.mn.is_empty_state());
    let c = &mut s.cns[0];
    let note = wait1(&mut c.h.be, c.q[2], QueueSel::Recv);
    let bytes = get(&c.h.be, base + NOTICE, note.byte_len as usize);
    match MnMessage::decode(&bytes).unwrap() {
        MnMessage::Error(e) => assert_eq!((e.token, e.code), (0xE, omw_core::wire::ErrorCode::Empty)),
        MnMessage::Notice(n) => assert_eq!(n, omw_core::wire::Notice::Empty),
        m => panic!("expected an empty-pool message, got {m:?}"),
    }
    s.d.check_invariants().unwrap();

    // a free makes a group available again; the MN re-arms the alloc chain and the CN retries
    let c = &mut s.cns[0];
    let mut r = RecvWqe { wr_id: 0xE1, sges: heapless::Vec::new() };
    r.sges.push(Sge { addr: base + NOTICE, length: 64, lkey: c.lkey }).unwrap();
    c.h.be.post_recv(c.q[2], &r).unwrap();
    s.send_free(0, got[3].entry_addr, 0xF3);
    // the MN CPU watches the tail on its timer
    s.now += 1;
    s.d.handle(s.now, omw_core::mn::Event::Tick).unwrap();
    assert!(!s.d.mn.is_empty_state());
    let c = &mut s.cns[0];
    let mut seen = Vec::new();
    loop {
        let note = wait1(&mut c.h.be, c.q[2], QueueSel::Recv);
        let bytes = get(&c.h.be, base + NOTICE, note.byte_len as usize);
        let m = MnMessage::decode(&bytes).unwrap();
        seen.push(m.clone());
        if matches!(m, MnMessage::Notice(omw_core::wire::Notice::Available { .. })) {
            break;
        }
        assert!(seen.len() < 4, "{seen:?}");
        c.h.be.post_recv(c.q[2], &r).unwrap();
    }
    let again = s.alloc(0, 0x0A0A);
    assert_eq!(again.entry_addr, got[3].entry_addr, "the only free group");
    assert_eq!(again.entry.rkey(1), got[3].entry.rkey(1).next_key(), "rebound with a new key");
    s.d.check_invariants().unwrap();
}
