//! A whole offloaded MN on the extension double, provisioned through the core's `MnPlan`
//! exactly as the loopback cluster (`omw_loopback::cluster::Cluster::new` / `connect_cn`)
//! provisions one: two protection domains, the chains' loop QPs (both ends) in
//! `Domain::MnPrivate`, the admin QP CN-facing, a private loopback pair for the MN CPU's queue
//! atomics, metadata / table / rings remotely reachable only in the private domain, the pool
//! registered once CN-facing (windows bind there) and once privately with a chunk of zeros for
//! the free chain's NIC scrub, and the MWTable's first keys from `MnPlan::initial_table_key`.
//!
//! The CNs are plain nodes with what a CN has: four QPs connected to the MN (Alloc, Free, two
//! access QPs), one registered buffer, and what the MN sends them.

use super::*;
use omw_core::access::AccessFlags;
use omw_core::backend::{Domain, RdmaBackend, WcOpcode, WcStatus};
use omw_core::chain::Ring;
use omw_core::geometry::PoolGeometry;
use omw_core::host_engine::HostRegions;
use omw_core::ids::{CnId, Qpn, Rkey};
use omw_core::mn::{CnQps, MemoryNode, MnConfig, MnKeys};
use omw_core::mn_driver::MnDriver;
use omw_core::mn_memory::MnMemoryMap;
use omw_core::mn_plan::{MnOptions, MnPlan, MnRegions};
use omw_core::mwtable::MwTableEntry;
use omw_core::wire::{AllocReply, AllocRequest, FreeRequest, MnMessage, ALLOC_REPLY_LEN};
use omw_core::wqe::{QueueSel, RecvWqe, Sge, Wqe, WqeFlags};
use omw_fpga::double::{Fabric, NodeId};
use omw_fpga::encoding::OpcodeEncoding;
use omw_fpga::QpSetup;

pub const MN: u64 = 0x4000_0000;
pub const POOL: u64 = MN + 0x10_0000;
/// The chunk of zeros the free chain scrubs from (node memory starts zeroed).
pub const ZERO: u64 = MN + 0x18_0000;
pub const META: u64 = MN + 0x20_0000;
pub const CHUNK: u64 = 4096;
pub const CHUNKS: u32 = 16;
pub const G: u8 = 3;
/// MN ctids of the admin pair and of the MN CPU's atomic pair.
pub const ADMIN: u8 = 60;
pub const ATOMIC: u8 = 62;

/// Offsets in a CN's registered buffer.
pub const REQ: u64 = 0x1000;
pub const REPLY: u64 = 0x2000;
/// Receive buffers for MN messages: `MSG_SLOTS` slots of 64 bytes.
pub const NOTICE: u64 = 0x3000;
pub const MSG_SLOTS: u64 = 8;
pub const DATA: u64 = 0x4000;
/// Where a CN's READs land (`Cluster::access`): room for a whole chunk.
pub const READ_BACK: u64 = DATA + 0x4000;

/// A CN: its host, its QPs (CN ends and MN ends), its registered buffer.
pub struct Cn {
    pub h: Host,
    pub id: CnId,
    pub lkey: u32,
    pub rkey: u32,
    /// CN ends: alloc, free, access 0, access 1.
    pub q: [Qpn; 4],
    /// MN ends, same order.
    pub mq: [Qpn; 4],
    /// MN ctids of the alloc and free chains' loop QPs (their responders are the next ctid).
    pub loops: [u8; 2],
    /// Their QPNs.
    pub loop_qpns: [Qpn; 2],
    /// Message receives posted on access QP 0 and not yet completed.
    msg_posted: u64,
    msg_seq: u64,
    /// Every MN message delivered to this CN, in order.
    pub received: Vec<Vec<u8>>,
    /// Every alloc reply delivered to this CN, in order.
    pub replies: Vec<Vec<u8>>,
}

pub struct Cluster {
    pub f: Fabric,
    pub mn_id: NodeId,
    pub d: MnDriver<Be>,
    pub cns: Vec<Cn>,
    pub now: u64,
    pub plan: MnPlan,
    pub keys: MnKeys,
    pub map: MnMemoryMap,
    /// The pool's CN-facing MR lkey(s) the windows bind in.
    pub pool_lkeys: Vec<u32>,
}

/// An offloaded MN with `n_cns` connected CNs, NIC scrubbing on.
pub fn cluster(n_cns: usize) -> Cluster {
    cluster_with(n_cns, MnOptions::default())
}

pub fn cluster_with(n_cns: usize, opts: MnOptions) -> Cluster {
    let f = Fabric::new();
    let mut mn = host(&f, 0x0A00_00FF, MN, true, OpcodeEncoding::AppOpcodes);
    let plan = MnPlan::decide(mn.be.capabilities(), opts).expect("the extension block can isolate CNs");
    let geo = PoolGeometry::new(POOL, CHUNK, CHUNKS, G).unwrap();
    let max_cns = 4;
    assert!(META.is_multiple_of(MnMemoryMap::required_alignment(&geo, max_cns)));
    let map = MnMemoryMap::new(geo, max_cns, META).unwrap();
    assert!(map.meta_base + map.meta_len <= MN + ARENA_OFF, "metadata overlaps the ring arena");
    let zero_source = plan.needs_zero_source().then_some(ZERO);
    let keys = plan.register_metadata(&mut mn.be, &MnRegions { map, zero_source }).unwrap();
    let mut pool_lkeys = Vec::new();
    plan.register_pool(&mut mn.be, &geo, |_, k| pool_lkeys.push(k)).unwrap();
    let mut rkeys: Vec<Rkey> = Vec::new();
    for _ in 0..CHUNKS * G as u32 {
        rkeys.push(plan.initial_table_key(mn.be.alloc_mw().unwrap()));
    }
    let node = MemoryNode::new(MnConfig::from_plan(&plan, geo, max_cns, CHUNKS), map, keys).unwrap();
    let depths = node.chain_ring_depths().unwrap();
    let depth = |kind: usize, ring: Ring| depths[kind][ring as usize] as u32;
    let loop_domain = plan.loop_domain().expect("offloaded: the chains run on private loop QPs");
    let cn_domain = plan.cn_facing_domain();
    // the admin QP (management unbinds of CN-facing windows) is CN-facing, as in the cluster
    super::setup(&mut mn, ADMIN, QpSetup::plain(16, 0).in_domain(cn_domain));
    super::setup(&mut mn, ADMIN + 1, QpSetup::plain(0, 0).in_domain(cn_domain));
    connect_loop(&mut mn, ADMIN, ADMIN + 1);
    // the MN CPU's queue atomics go through the NIC, on a pair of the private domain
    super::setup(&mut mn, ATOMIC, QpSetup::plain(16, 0).in_domain(loop_domain));
    super::setup(&mut mn, ATOMIC + 1, QpSetup::plain(0, 0).in_domain(loop_domain));
    connect_loop(&mut mn, ATOMIC, ATOMIC + 1);
    let mut cns = Vec::new();
    for i in 0..n_cns {
        let base = 0x1000_0000 * (i as u64 + 1);
        let mut h = host(&f, 0x0A00_0001 + i as u32, base, true, OpcodeEncoding::AppOpcodes);
        let mr =
            h.be.reg_mr(Domain::CnFacing, base, 0x10000, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
        // MN ctids of this CN: alloc, free, access0, access1, alloc loop (+1), free loop (+1)
        let c0 = 1 + 8 * i as u8;
        let m = [c0, c0 + 1, c0 + 2, c0 + 3];
        let (al, fl) = (c0 + 4, c0 + 6);
        super::setup(&mut mn, m[0], QpSetup::managed(depth(0, Ring::Mgmt), 1).in_domain(cn_domain));
        super::setup(&mut mn, m[1], QpSetup::managed(depth(1, Ring::Mgmt), 1).in_domain(cn_domain));
        super::setup(&mut mn, m[2], QpSetup::plain(16, 0).in_domain(cn_domain));
        super::setup(&mut mn, m[3], QpSetup::plain(16, 0).in_domain(cn_domain));
        // both ends of every loop QP in the private domain: the only QPs through which MN
        // memory is remotely reachable, and no CN has one
        super::setup(&mut mn, al, QpSetup::managed(depth(0, Ring::Loop), 0).in_domain(loop_domain));
        super::setup(&mut mn, fl, QpSetup::managed(depth(1, Ring::Loop), 0).in_domain(loop_domain));
        for p in [al + 1, fl + 1] {
            super::setup(&mut mn, p, QpSetup::plain(0, 0).in_domain(loop_domain));
        }
        connect_loop(&mut mn, al, al + 1);
        connect_loop(&mut mn, fl, fl + 1);
        let mut q = [Qpn::default(); 4];
        let mut mq = [Qpn::default(); 4];
        for k in 0..4u8 {
            super::setup(&mut h, 1 + k, QpSetup::plain(16, 16));
            let (a, b) = connect(&mut h, 1 + k, &mut mn, m[k as usize], (0, 0), (0, 0));
            q[k as usize] = a;
            mq[k as usize] = b;
        }
        cns.push(Cn {
            h,
            id: CnId::new(u32::MAX).unwrap(),
            lkey: mr.lkey,
            rkey: mr.rkey,
            q,
            mq,
            loops: [al, fl],
            loop_qpns: [mn.be.qpn(al).unwrap(), mn.be.qpn(fl).unwrap()],
            msg_posted: 0,
            msg_seq: 0,
            received: Vec::new(),
            replies: Vec::new(),
        });
    }
    let regions = HostRegions::new(&map, &keys);
    let admin = mn.be.qpn(ADMIN).unwrap();
    let atomic = mn.be.qpn(ATOMIC).unwrap();
    let mn_id = mn.id;
    let mut d = MnDriver::new(mn.be, node, regions, admin).with_atomic_qp(atomic);
    let per_chunk = plan.per_chunk_mrs;
    d.format(
        |g, k| rkeys[g.0 as usize * G as usize + k],
        |g| if per_chunk { pool_lkeys[g.0 as usize] } else { pool_lkeys[0] },
    )
    .unwrap();
    let mut s = Cluster { f, mn_id, d, cns, now: 0, plan, keys, map, pool_lkeys };
    for i in 0..n_cns {
        // receives for MN messages (the ConnectInfo first) on access QP 0
        s.top_up(i);
        let c = &s.cns[i];
        let qps = CnQps {
            alloc: c.mq[0],
            free: c.mq[1],
            access: [c.mq[2], c.mq[3]].into_iter().collect(),
            alloc_loop: Some(c.loop_qpns[0]),
            free_loop: Some(c.loop_qpns[1]),
        };
        let id = s.d.connect(qps).unwrap();
        s.cns[i].id = id;
        let m = s.next_message(i);
        match MnMessage::decode(&m).unwrap() {
            MnMessage::ConnectInfo(ci) => {
                assert_eq!(ci.cn, id);
                assert_eq!(ci.access_qpns.as_slice(), &[s.cns[i].mq[2], s.cns[i].mq[3]]);
            }
            m => panic!("expected ConnectInfo, got {m:?}"),
        }
    }
    s
}

impl Cluster {
    /// Let the MN CPU look for exceptions (it is not on the allocation path).
    pub fn mn_poll(&mut self) {
        self.now += 1;
        self.d.poll(self.now).unwrap();
    }

    /// Keep `MSG_SLOTS` receives posted on CN `i`'s access QP 0 (where MN messages arrive),
    /// first collecting what completed.
    pub fn top_up(&mut self, i: usize) {
        self.collect(i);
        let c = &mut self.cns[i];
        if c.h.be.qp_state(c.q[2]).unwrap() != omw_core::backend::QpState::Rts {
            return;
        }
        while c.msg_posted < MSG_SLOTS {
            let slot = c.msg_seq % MSG_SLOTS;
            let mut r = RecvWqe { wr_id: 0xC0_0000 | c.msg_seq, sges: heapless::Vec::new() };
            r.sges.push(Sge { addr: c.h.mem_base + NOTICE + 64 * slot, length: 64, lkey: c.lkey }).unwrap();
            c.h.be.post_recv(c.q[2], &r).unwrap();
            c.msg_seq += 1;
            c.msg_posted += 1;
        }
    }

    /// Collect the MN messages that arrived on CN `i`'s access QP 0.
    pub fn collect(&mut self, i: usize) -> usize {
        let c = &mut self.cns[i];
        let got = drain(&mut c.h.be, c.q[2], QueueSel::Recv, 1);
        let mut n = 0;
        for r in got {
            c.msg_posted = c.msg_posted.saturating_sub(1);
            if r.status == WcStatus::Success {
                let slot = (r.wr_id & 0xFFFF) % MSG_SLOTS;
                let bytes = get(&c.h.be, c.h.mem_base + NOTICE + 64 * slot, r.byte_len as usize);
                c.received.push(bytes);
                n += 1;
            }
        }
        n
    }

    /// Wait for the next MN message to CN `i` and return its bytes.
    pub fn next_message(&mut self, i: usize) -> Vec<u8> {
        let before = self.cns[i].received.len();
        for _ in 0..2_000 {
            self.collect(i);
            if self.cns[i].received.len() > before {
                let m = self.cns[i].received[before].clone();
                self.top_up(i);
                return m;
            }
            self.f.run(10);
        }
        panic!("no MN message reached cn{i}");
    }

    /// Send an alloc request on CN `i`'s Alloc QP (with a receive posted for the reply's
    /// immediate) and wait until it was delivered.
    pub fn send_alloc(&mut self, i: usize, token: u32) {
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
    }

    pub fn alloc(&mut self, i: usize, token: u32) -> AllocReply {
        self.send_alloc(i, token);
        let c = &mut self.cns[i];
        let base = c.h.mem_base;
        let done = wait1(&mut c.h.be, c.q[0], QueueSel::Recv);
        assert_eq!(done.status, WcStatus::Success);
        assert_eq!(done.opcode, WcOpcode::RecvRdmaWithImm);
        assert_eq!(done.imm, Some(token), "the reply's immediate is the CN's token");
        assert_eq!(done.byte_len as usize, ALLOC_REPLY_LEN);
        let bytes = get(&c.h.be, base + REPLY, ALLOC_REPLY_LEN);
        c.replies.push(bytes.clone());
        AllocReply::decode(&bytes).unwrap()
    }

    /// Send a free request on CN `i`'s Free QP (for `entry_addr`, which may be someone else's).
    pub fn send_free(&mut self, i: usize, entry_addr: u64, token: u32) {
        let c = &mut self.cns[i];
        let base = c.h.mem_base;
        put(&mut c.h.be, base + REQ, &FreeRequest { token, entry_addr }.encode());
        c.h.be.post_send(c.q[1], &Wqe::send(base + REQ, c.lkey, 16).with_wr_id(token as u64)).unwrap();
        let sent = wait1(&mut c.h.be, c.q[1], QueueSel::Send);
        assert_eq!(sent.status, WcStatus::Success, "the request itself is delivered");
        // let the chain run
        self.f.run(2_000);
    }

    /// SEND arbitrary bytes on one of CN `i`'s QPs (0 alloc, 1 free), e.g. a malformed request,
    /// and let the chain run.
    pub fn send_raw(&mut self, i: usize, qp: usize, bytes: &[u8]) -> WcStatus {
        let c = &mut self.cns[i];
        let base = c.h.mem_base;
        put(&mut c.h.be, base + REQ, bytes);
        c.h.be.post_send(c.q[qp], &Wqe::send(base + REQ, c.lkey, bytes.len() as u32).with_wr_id(0x5E4D)).unwrap();
        let st = wait1(&mut c.h.be, c.q[qp], QueueSel::Send).status;
        self.f.run(2_000);
        st
    }

    /// One-sided access through access QP `k` of CN `i`.
    pub fn access(&mut self, i: usize, k: usize, write: Option<&[u8]>, addr: u64, rkey: Rkey, len: u32) -> WcStatus {
        let c = &mut self.cns[i];
        let base = c.h.mem_base;
        let q = c.q[2 + k];
        let w = match write {
            Some(data) => {
                put(&mut c.h.be, base + DATA, data);
                Wqe::write(base + DATA, c.lkey, data.len() as u32, addr, rkey.0)
            }
            None => Wqe::read(base + READ_BACK, c.lkey, len, addr, rkey.0),
        };
        c.h.be.post_send(q, &w.with_wr_id(0xDA7A)).unwrap();
        let r = wait1(&mut c.h.be, q, QueueSel::Send);
        assert_eq!(r.wr_id, 0xDA7A);
        r.status
    }

    pub fn read_back(&self, i: usize, len: usize) -> Vec<u8> {
        let c = &self.cns[i];
        get(&c.h.be, c.h.mem_base + READ_BACK, len)
    }

    /// Reconnect access QP `k` of CN `i` after an error: both ends back to RTS (the MN's
    /// connection manager accepting the CN's reconnect), message receives posted again.
    pub fn reset_access(&mut self, i: usize, k: usize) {
        let (q, mq) = (self.cns[i].q[2 + k], self.cns[i].mq[2 + k]);
        self.cns[i].h.be.reset_qp(q).unwrap();
        self.d.backend.reset_qp(mq).unwrap();
        if k == 0 {
            self.collect(i);
            self.cns[i].msg_posted = 0;
            self.top_up(i);
        }
    }

    /// Post any work request on one of CN `i`'s QPs (0 alloc, 1 free, 2–3 access) — all an
    /// attacker can do — and return its status. A failed request costs the CN a reconnect:
    /// its end is reset; the MN end of a chain QP is the MN's to repair (its poll sees the
    /// chain fail and re-arms it), the MN end of an access QP is reset by the reconnect.
    pub fn cn_post(&mut self, i: usize, qp: usize, w: Wqe) -> WcStatus {
        let c = &mut self.cns[i];
        let q = c.q[qp];
        let w = w.with_wr_id(0xA77A_0000 + qp as u64).with_flags(w.flags | WqeFlags::SIGNALED);
        c.h.be.post_send(q, &w).unwrap();
        let r = wait1(&mut c.h.be, q, QueueSel::Send);
        assert_eq!(r.wr_id, w.wr_id);
        if r.status != WcStatus::Success {
            if qp >= 2 {
                self.reset_access(i, qp - 2);
            } else {
                self.cns[i].h.be.reset_qp(q).unwrap();
            }
        }
        self.f.run(200);
        self.mn_poll();
        for j in 0..self.cns.len() {
            self.top_up(j);
        }
        r.status
    }

    pub fn entry(&self, addr: u64) -> MwTableEntry {
        let mut b = [0u8; 40];
        self.d.backend.read_local(addr, &mut b).unwrap();
        MwTableEntry::read(&b).unwrap()
    }

    pub fn bound_to(&self, rkey: Rkey) -> Option<u32> {
        self.f.mw(self.mn_id, rkey.0).and_then(|m| m.bound).map(|b| b.qpn)
    }

    pub fn mn_bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        get(&self.d.backend, addr, len)
    }
}
