//! Scripted tests of the MN control plane, the host engine and the driver, on a minimal
//! test device (just enough of a NIC: windows, bind/invalidate checks, completions). The full
//! RNIC model with offloaded chains is omw-loopback; these pin the control plane's transitions.

use crate::access::AccessFlags;
use crate::backend::*;
use crate::cn::Client;
use crate::geometry::PoolGeometry;
use crate::host_engine::HostRegions;
use crate::ids::{CnId, GroupId, Qpn, Rkey};
use crate::mn::{CnQps, Event, MemoryNode, MnConfig, MnKeys};
use crate::mn_driver::MnDriver;
use crate::mn_memory::{MnMemoryMap, ALLOC_REQUEST_BUF_OFF, FREE_REQUEST_BUF_OFF};
use crate::wire::{ErrorCode, FreeRequest, MnMessage, Notice};
use crate::wqe::{Opcode, QueueSel, RecvWqe, Wqe, WqeFlags};
use std::collections::{HashMap, VecDeque};
use std::vec::Vec;

const META: u64 = 64 << 20;
const POOL: u64 = 1 << 32;

#[derive(Default)]
struct Qp {
    state: Option<QpState>,
    send_cq: VecDeque<Completion>,
    recv_cq: VecDeque<Completion>,
    recvs: VecDeque<RecvWqe>,
}

#[derive(Default)]
struct TestNic {
    meta: Vec<u8>,
    /// The pool's bytes (the MN scrubs chunks through its port).
    pool: Vec<u8>,
    qps: HashMap<u32, Qp>,
    mws: HashMap<u32, (Rkey, Option<Qpn>)>,
    next_mw: u32,
    strict_invalidate: bool,
    /// What the CNs received: (MN-side QP it came from, bytes, imm)
    inbox: Vec<(Qpn, Vec<u8>, Option<u32>)>,
}

#[derive(Debug)]
struct NicErr(&'static str);
impl core::fmt::Display for NicErr {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.0)
    }
}

impl TestNic {
    fn complete(&mut self, qp: Qpn, w: &Wqe, status: WcStatus) {
        let q = self.qps.entry(qp.get()).or_default();
        if !status.is_ok() {
            q.state = Some(QpState::Err);
        }
        q.send_cq.push_back(Completion {
            wr_id: w.wr_id,
            status,
            opcode: WcOpcode::Send(w.opcode),
            qpn: qp,
            byte_len: w.length,
            imm: None,
            invalidated: None,
        });
    }
    fn meta_slice(&self, addr: u64, len: usize) -> Result<core::ops::Range<usize>, NicErr> {
        let off = addr.checked_sub(META).ok_or(NicErr("address below metadata"))? as usize;
        if off + len > self.meta.len() {
            return Err(NicErr("address beyond metadata"));
        }
        Ok(off..off + len)
    }
    /// A CN's SEND arriving on MN QP `qp` (lands in its posted receive buffer).
    fn deliver(&mut self, qp: Qpn, bytes: &[u8]) {
        let r = self.qps.entry(qp.get()).or_default().recvs.pop_front().expect("no receive posted");
        let sge = r.sges[0];
        let n = bytes.len().min(sge.length as usize);
        let rng = self.meta_slice(sge.addr, n).unwrap();
        self.meta[rng].copy_from_slice(&bytes[..n]);
        let status = if bytes.len() > sge.length as usize { WcStatus::LocLenErr } else { WcStatus::Success };
        self.qps.get_mut(&qp.get()).unwrap().recv_cq.push_back(Completion {
            wr_id: r.wr_id,
            status,
            opcode: WcOpcode::Recv,
            qpn: qp,
            byte_len: bytes.len() as u32,
            imm: None,
            invalidated: None,
        });
    }
}

impl RdmaBackend for TestNic {
    type Error = NicErr;
    fn capabilities(&self) -> Capabilities {
        Capabilities::SECURE_MINIMUM | Capabilities::ATOMICS
    }
    fn post_send(&mut self, qp: Qpn, w: &Wqe) -> Result<(), NicErr> {
        let status = match w.opcode {
            Opcode::BindMw if w.flags.contains(WqeFlags::UNBIND) => match self.mws.get_mut(&(w.imm >> 8)) {
                Some((r, b @ Some(_))) if r.0 == w.imm => {
                    *b = None;
                    WcStatus::Success
                }
                _ => WcStatus::MwBindErr,
            },
            Opcode::BindMw => match self.mws.get_mut(&(w.imm >> 8)) {
                Some((r, b @ None)) if w.length > 0 => {
                    *r = Rkey(w.imm);
                    *b = Some(Qpn::new(w.qpn).unwrap());
                    WcStatus::Success
                }
                _ => WcStatus::MwBindErr,
            },
            Opcode::LocalInv => {
                let strict = self.strict_invalidate;
                match self.mws.get_mut(&(w.imm >> 8)) {
                    Some((r, b @ Some(_))) if r.0 == w.imm && (!strict || *b == Some(qp)) => {
                        *b = None;
                        WcStatus::Success
                    }
                    _ => WcStatus::MwBindErr,
                }
            }
            Opcode::WriteWithImm | Opcode::Send => {
                let rng = self.meta_slice(w.local_addr, w.length as usize)?;
                let bytes = self.meta[rng].to_vec();
                let imm = (w.opcode == Opcode::WriteWithImm).then_some(w.imm);
                self.inbox.push((qp, bytes, imm));
                WcStatus::Success
            }
            _ => return Err(NicErr("unexpected opcode")),
        };
        self.complete(qp, w, status);
        Ok(())
    }
    fn post_recv(&mut self, qp: Qpn, w: &RecvWqe) -> Result<(), NicErr> {
        self.qps.entry(qp.get()).or_default().recvs.push_back(w.clone());
        Ok(())
    }
    fn poll_cq(&mut self, qp: Qpn, q: QueueSel, out: &mut [Completion]) -> Result<usize, NicErr> {
        let e = self.qps.entry(qp.get()).or_default();
        let cq = if q == QueueSel::Send { &mut e.send_cq } else { &mut e.recv_cq };
        let mut n = 0;
        while n < out.len() {
            match cq.pop_front() {
                Some(c) => {
                    out[n] = c;
                    n += 1;
                }
                None => break,
            }
        }
        Ok(n)
    }
    fn enable(&mut self, _: Qpn, _: QueueSel, _: u64) -> Result<(), NicErr> {
        Err(NicErr("no WAIT/ENABLE"))
    }
    fn reset_qp(&mut self, qp: Qpn) -> Result<(), NicErr> {
        let e = self.qps.entry(qp.get()).or_default();
        *e = Qp { state: Some(QpState::Rts), ..Default::default() };
        Ok(())
    }
    fn destroy_qp(&mut self, qp: Qpn) -> Result<(), NicErr> {
        self.qps.entry(qp.get()).or_default().state = Some(QpState::Err);
        Ok(())
    }
    fn qp_state(&self, qp: Qpn) -> Result<QpState, NicErr> {
        Ok(self.qps.get(&qp.get()).and_then(|q| q.state).unwrap_or(QpState::Rts))
    }
    fn reg_mr(&mut self, _: Domain, _: u64, _: u64, _: AccessFlags) -> Result<MrKeys, NicErr> {
        Err(NicErr("not needed"))
    }
    fn alloc_mw(&mut self) -> Result<Rkey, NicErr> {
        self.next_mw += 1;
        let r = Rkey::new(self.next_mw, 0).unwrap();
        self.mws.insert(self.next_mw, (r, None));
        Ok(r)
    }
    fn read_local(&self, addr: u64, buf: &mut [u8]) -> Result<(), NicErr> {
        if addr >= POOL {
            let o = (addr - POOL) as usize;
            let src = self.pool.get(o..o + buf.len()).ok_or(NicErr("beyond the pool"))?;
            buf.copy_from_slice(src);
            return Ok(());
        }
        let rng = self.meta_slice(addr, buf.len())?;
        buf.copy_from_slice(&self.meta[rng]);
        Ok(())
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<(), NicErr> {
        if addr >= POOL {
            let o = (addr - POOL) as usize;
            self.pool.get_mut(o..o + data.len()).ok_or(NicErr("beyond the pool"))?.copy_from_slice(data);
            return Ok(());
        }
        let rng = self.meta_slice(addr, data.len())?;
        self.meta[rng].copy_from_slice(data);
        Ok(())
    }
    fn ring_base(&self, _: Qpn, _: QueueSel) -> Result<u64, NicErr> {
        Err(NicErr("no offload"))
    }
    fn ring_keys(&self, _: Domain) -> Result<MrKeys, NicErr> {
        Err(NicErr("no offload"))
    }
    fn alloc_memory(&mut self, _: u64, _: u64) -> Result<u64, Self::Error> {
        Err(NicErr("set up by the test"))
    }
    fn create_loopback_qp(&mut self, _: Domain, _: Option<u32>) -> Result<Qpn, Self::Error> {
        Err(NicErr("set up by the test"))
    }
    fn mw_binding(&self, rkey: Rkey) -> Option<MwBinding> {
        self.mws.get(&rkey.index()).map(|(r, b)| match b {
            Some(q) => MwBinding::Bound { rkey: *r, qpn: *q },
            None => MwBinding::Unbound,
        })
    }
}

struct Rig {
    d: MnDriver<TestNic>,
    cns: Vec<(CnId, CnQps, Client<16>)>,
    now: u64,
}

fn qpn(v: u32) -> Qpn {
    Qpn::new(v).unwrap()
}

impl Rig {
    fn new(chunks: u32, g: u8, quota: u32) -> Rig {
        let geo = PoolGeometry::new(POOL, 4096, chunks, g).unwrap();
        let map = MnMemoryMap::new(geo, 8, META).unwrap();
        let keys = MnKeys {
            meta_lkey: 1,
            meta_rkey: 2,
            table_rkey: 3,
            ring_lkey: 4,
            ring_rkey: 5,
            cn_meta_lkey: 1,
            cn_ring_lkey: 4,
            ..MnKeys::default()
        };
        let cfg = MnConfig {
            geometry: geo,
            max_cns: 8,
            quota,
            mode: ExecutionMode::HostEngine,
            software_ownership_check: true,
            queue_depth: 128,
            window_access: AccessFlags::DATA_WINDOW,
            scrub: crate::mn_plan::ScrubPath::Cpu,
            lease_ns: 0,
        };
        let mut nic = TestNic {
            meta: std::vec![0; map.meta_len as usize],
            pool: std::vec![0xAB; geo.pool_len() as usize],
            ..Default::default()
        };
        let rkeys: Vec<Rkey> = (0..chunks * g as u32).map(|_| nic.alloc_mw().unwrap()).collect();
        let regions = HostRegions::new(&map, &keys);
        let mn = MemoryNode::new(cfg, map, keys).unwrap();
        let mut d = MnDriver::new(nic, mn, regions, qpn(1));
        d.format(|gid, i| rkeys[(gid.0 * g as u32) as usize + i], |_| 77).unwrap();
        Rig { d, cns: Vec::new(), now: 0 }
    }
    fn connect(&mut self) -> usize {
        let base = 100 + 10 * self.cns.len() as u32;
        let g = self.d.mn.config().geometry.group_size();
        let qps = CnQps {
            alloc: qpn(base),
            free: qpn(base + 1),
            access: (0..g - 1).map(|i| qpn(base + 2 + i as u32)).collect(),
            alloc_loop: None,
            free_loop: None,
        };
        let cn = self.d.connect(qps.clone()).unwrap();
        let mut c = Client::new();
        self.deliver_messages_to(&mut c, &qps);
        assert_eq!(c.id(), Some(cn));
        self.cns.push((cn, qps, c));
        self.cns.len() - 1
    }
    fn deliver_messages_to(&mut self, c: &mut Client<16>, qps: &CnQps) -> Vec<crate::cn::ClientEvent> {
        let mut evs = Vec::new();
        let inbox = std::mem::take(&mut self.d.backend.inbox);
        for (qp, bytes, imm) in inbox {
            // host-engine MN: messages travel on the Alloc QP (SENDs: no immediate)
            if qp == qps.alloc && imm.is_none() {
                evs.push(c.on_message(self.now, &bytes).unwrap());
            } else {
                self.d.backend.inbox.push((qp, bytes, imm));
            }
        }
        evs
    }
    /// CN i allocates; returns the allocation or the error code the MN answered.
    fn alloc(&mut self, i: usize) -> Result<crate::cn::Allocation, ErrorCode> {
        let mut buf = [0u8; 64];
        let (_, qps, c) = &mut self.cns[i];
        let (tok, n) = c.alloc_request(self.now, 0xC0DE_0000, 9, &mut buf).unwrap();
        let alloc_qp = qps.alloc;
        self.d.backend.deliver(alloc_qp, &buf[..n]);
        self.d.poll(self.now).unwrap();
        self.d.check_invariants().unwrap();
        // reply WRITE_IMM on the Alloc QP, or an error on the notice QP
        let inbox = std::mem::take(&mut self.d.backend.inbox);
        let mut result = None;
        for (qp, bytes, imm) in inbox {
            let (_, qps, c) = &mut self.cns[i];
            if qp == qps.alloc && imm == Some(tok) {
                result = Some(Ok(c.on_alloc_reply(tok, &bytes).unwrap()));
            } else if qp == qps.alloc && imm.is_none() {
                if let crate::cn::ClientEvent::Failed { token, code } = c.on_message(self.now, &bytes).unwrap() {
                    if token == tok {
                        result = Some(Err(code));
                    }
                }
            } else {
                self.d.backend.inbox.push((qp, bytes, imm));
            }
        }
        result.expect("no answer to an alloc request")
    }
    fn free_raw(&mut self, i: usize, entry_addr: u64) -> Option<ErrorCode> {
        let f = FreeRequest { token: 4242, entry_addr }.encode();
        let free_qp = self.cns[i].1.free;
        self.d.backend.deliver(free_qp, &f);
        self.d.poll(self.now).unwrap();
        self.d.check_invariants().unwrap();
        let inbox = std::mem::take(&mut self.d.backend.inbox);
        let mut code = None;
        for (qp, bytes, imm) in inbox {
            if qp == self.cns[i].1.alloc
                && imm.is_none()
                && matches!(MnMessage::decode(&bytes), Ok(MnMessage::Error(_)))
            {
                if let Ok(MnMessage::Error(e)) = MnMessage::decode(&bytes) {
                    code = Some(e.code);
                }
            } else {
                self.d.backend.inbox.push((qp, bytes, imm));
            }
        }
        code
    }
    fn free(&mut self, i: usize, a: &crate::cn::Allocation) -> Option<ErrorCode> {
        self.cns[i].2.free_request(a.entry_addr).unwrap();
        self.free_raw(i, a.entry_addr)
    }
}

#[test]
fn alloc_binds_windows_to_the_requesters_qps() {
    let mut r = Rig::new(4, 3, 8);
    let a = r.connect();
    let b = r.connect();
    let x = r.alloc(a).unwrap();
    let y = r.alloc(b).unwrap();
    assert_ne!(x.base, y.base);
    for (i, rk) in x.rkeys.iter().enumerate() {
        assert_eq!(r.d.backend.mw_binding(*rk), Some(MwBinding::Bound { rkey: *rk, qpn: r.cns[a].1.access[i] }));
    }
    assert_eq!(
        r.d.backend.mw_binding(x.owner_rkey),
        Some(MwBinding::Bound { rkey: x.owner_rkey, qpn: r.cns[a].1.free })
    );
    assert_eq!(r.d.stats.laps, 2);
}

#[test]
fn free_returns_group_with_new_keys() {
    let mut r = Rig::new(2, 2, 8);
    let a = r.connect();
    let x = r.alloc(a).unwrap();
    assert_eq!(r.free(a, &x), None);
    assert_eq!(r.d.backend.mw_binding(x.rkeys[0]), Some(MwBinding::Unbound));
    let g = r.d.mn.map().group_of_entry(x.entry_addr).unwrap();
    let e = r.d.entry(g).unwrap();
    assert_eq!(e.rkey(1), x.rkeys[0].next_key(), "key advanced: the old rkey is stale");
    assert_eq!(e.owner(), 0);
}

#[test]
fn empty_then_available() {
    let mut r = Rig::new(2, 2, 8);
    let a = r.connect();
    let b = r.connect();
    let x = r.alloc(a).unwrap();
    let _y = r.alloc(b).unwrap();
    assert_eq!(r.alloc(a), Err(ErrorCode::Empty));
    assert!(r.d.mn.is_empty_state());
    // every CN heard "empty"
    let qps = r.cns[b].1.clone();
    let mut cb = std::mem::take(&mut r.cns[b].2);
    let evs = r.deliver_messages_to(&mut cb, &qps);
    r.cns[b].2 = cb;
    assert!(evs.contains(&crate::cn::ClientEvent::Empty));
    // a free refills the queue; the ticket is settled and "available" goes out
    assert_eq!(r.free(a, &x), None);
    assert!(!r.d.mn.is_empty_state());
    assert_eq!(r.d.mn.stats().available_notices, 1);
    let qps = r.cns[a].1.clone();
    let mut ca = std::mem::take(&mut r.cns[a].2);
    let evs = r.deliver_messages_to(&mut ca, &qps);
    r.cns[a].2 = ca;
    assert!(evs.iter().any(|e| matches!(e, crate::cn::ClientEvent::Available)));
    let z = r.alloc(a).unwrap();
    assert_eq!(z.base, x.base);
}

/// A CN that retries while its alloc chain is parked (after its back-off) gets "empty" for
/// that very request, not silence; nothing runs, and the ticket it holds is still the only one.
#[test]
fn retry_while_parked_is_answered_empty() {
    let mut r = Rig::new(1, 2, 8);
    let a = r.connect();
    let x = r.alloc(a).unwrap();
    assert_eq!(r.alloc(a), Err(ErrorCode::Empty));
    let laps = r.d.stats.laps;
    r.now += 10 * r.cns[a].2.backoff;
    assert_eq!(r.alloc(a), Err(ErrorCode::Empty), "answered, matched by token");
    assert_eq!(r.d.stats.laps, laps, "the parked chain did not run");
    assert_eq!(r.free(a, &x), None);
    let qps = r.cns[a].1.clone();
    let mut ca = std::mem::take(&mut r.cns[a].2);
    let _ = r.deliver_messages_to(&mut ca, &qps);
    r.cns[a].2 = ca;
    assert_eq!(r.alloc(a).unwrap().base, x.base);
}

#[test]
fn forged_free_is_refused_and_owner_keeps_chunk() {
    let mut r = Rig::new(4, 3, 8);
    let a = r.connect();
    let b = r.connect();
    let x = r.alloc(a).unwrap();
    assert_eq!(r.free_raw(b, x.entry_addr), Some(ErrorCode::NotOwner));
    assert!(matches!(r.d.backend.mw_binding(x.rkeys[0]), Some(MwBinding::Bound { .. })));
    assert_eq!(r.d.mn.cn(r.cns[b].0).unwrap().forged_frees, 1);
    // a forged entry address outside the table faults on the table MR
    assert_eq!(r.free_raw(b, META + 8), Some(ErrorCode::BadRequest));
    // A can still free it
    assert_eq!(r.free(a, &x), None);
}

#[test]
fn crash_reclaims_everything() {
    let mut r = Rig::new(4, 2, 8);
    let a = r.connect();
    let _b = r.connect();
    let x = r.alloc(a).unwrap();
    let y = r.alloc(a).unwrap();
    let cn = r.cns[a].0;
    r.d.handle(1, Event::CnGone { cn }).unwrap();
    r.d.check_invariants().unwrap();
    for al in [&x, &y] {
        assert_eq!(r.d.backend.mw_binding(al.rkeys[0]), Some(MwBinding::Unbound));
        let g = r.d.mn.map().group_of_entry(al.entry_addr).unwrap();
        assert_eq!(r.d.entry(g).unwrap().owner(), 0);
    }
    assert_eq!(r.d.mn.stats().groups_reclaimed, 2);
    assert!(r.d.mn.cn(cn).is_none());
}

#[test]
fn quota_is_exact_in_host_engine_mode() {
    let mut r = Rig::new(8, 2, 2);
    let a = r.connect();
    let b = r.connect();
    let keep = r.alloc(b).unwrap();
    let x = r.alloc(a).unwrap();
    let _y = r.alloc(a).unwrap();
    // the third allocation would exceed the quota of 2: refused, nothing revoked
    assert_eq!(r.alloc(a), Err(ErrorCode::QuotaExceeded));
    r.d.check_invariants().unwrap();
    assert_eq!(r.d.mn.stats().quota_disconnects, 0);
    assert!(matches!(r.d.backend.mw_binding(x.rkeys[0]), Some(MwBinding::Bound { .. })));
    // after a free it may allocate again
    assert_eq!(r.free(a, &x), None);
    assert!(r.alloc(a).is_ok());
    // B unaffected
    assert!(matches!(r.d.backend.mw_binding(keep.rkeys[0]), Some(MwBinding::Bound { .. })));
    assert!(r.alloc(b).is_ok());
}

#[test]
fn rnic_reset_revokes_and_rebuilds() {
    let mut r = Rig::new(4, 2, 8);
    let a = r.connect();
    let x = r.alloc(a).unwrap();
    // the device lost every binding
    for v in r.d.backend.mws.values_mut() {
        v.1 = None;
    }
    r.d.handle(5, Event::RnicReset).unwrap();
    r.d.check_invariants().unwrap();
    let g = r.d.mn.map().group_of_entry(x.entry_addr).unwrap();
    assert_eq!(r.d.entry(g).unwrap().rkey(1), x.rkeys[0].next_key());
    let qps = r.cns[a].1.clone();
    let mut ca = std::mem::take(&mut r.cns[a].2);
    let evs = r.deliver_messages_to(&mut ca, &qps);
    assert!(evs.contains(&crate::cn::ClientEvent::Revoked));
    assert!(ca.live().is_empty());
    r.cns[a].2 = ca;
    assert!(r.alloc(a).is_ok());
}

#[test]
fn bad_requests_are_typed_errors() {
    let mut r = Rig::new(4, 3, 8);
    let a = r.connect();
    let b = r.connect();
    // too long for the receive buffer
    let q = r.cns[a].1.alloc;
    r.d.backend.deliver(q, &[0u8; 80]);
    r.d.poll(0).unwrap();
    r.d.check_invariants().unwrap();
    // asking for windows on someone else's QPs: refused, nothing leaks
    let mut buf = [0u8; 64];
    let other = r.cns[b].1.access.clone();
    let (tok, n) = r.cns[a].2.alloc_request(0, 0x1000, 1, &mut buf).unwrap();
    let mut req = crate::wire::AllocRequest::decode(&buf[..n], 2).unwrap();
    req.access_qpns = other;
    let n = req.encode(&mut buf).unwrap();
    r.d.backend.deliver(q, &buf[..n]);
    r.d.poll(0).unwrap();
    r.d.check_invariants().unwrap();
    let errs: Vec<_> =
        r.d.backend
            .inbox
            .iter()
            .filter_map(|(_, b, _)| match MnMessage::decode(b) {
                Ok(MnMessage::Error(e)) => Some((e.token, e.code)),
                _ => None,
            })
            .collect();
    assert!(errs.contains(&(tok, ErrorCode::AllocFailed)), "{errs:?}");
    assert!(errs.iter().any(|(_, c)| *c == ErrorCode::BadRequest));
    assert_eq!(r.d.mn.stats().groups_reclaimed, 1, "the popped group went back");
    let _ = (ALLOC_REQUEST_BUF_OFF, FREE_REQUEST_BUF_OFF, Notice::Empty, GroupId(0));
}

mod invariant_violations {
    use super::*;
    use crate::invariants::InvariantViolation as V;
    use crate::mwtable::{MwTableEntry, ENTRY_SIZE};
    use zerocopy::IntoBytes;

    fn entry(r: &Rig, g: u32) -> (u64, MwTableEntry) {
        let addr = r.d.mn.map().entry_addr(GroupId(g)).unwrap();
        (addr, r.d.entry(GroupId(g)).unwrap())
    }
    fn put(r: &mut Rig, addr: u64, e: &MwTableEntry) {
        r.d.backend.write_local(addr, e.as_bytes()).unwrap();
    }
    fn slot(r: &Rig, i: u32) -> u64 {
        r.d.mn.map().queue.slot_addr(i)
    }

    #[test]
    fn each_violation_is_detected() {
        // a group owned while still in the queue
        let mut r = Rig::new(4, 2, 8);
        let a = r.connect();
        let (addr, mut e) = entry(&r, 3);
        e.owner = r.cns[a].0.get().into();
        put(&mut r, addr, &e);
        assert_eq!(r.d.check_invariants(), Err(V::OwnedGroupInQueue(GroupId(3))));

        // a group neither queued, owned nor being reclaimed
        let mut r = Rig::new(4, 2, 8);
        let s = slot(&r, 3);
        r.d.backend.write_local(s, &0u64.to_le_bytes()).unwrap();
        assert!(matches!(r.d.check_invariants(), Err(V::BadQueueSlot { .. })));
        let q = r.d.mn.map().queue;
        r.d.backend.write_local(q.tail, &slot(&r, 3).to_le_bytes()).unwrap();
        assert_eq!(r.d.check_invariants(), Err(V::LostGroup(GroupId(3))));

        // the same group twice in the queue
        let mut r = Rig::new(4, 2, 8);
        let e0 = r.d.mn.map().entry_addr(GroupId(0)).unwrap();
        r.d.backend.write_local(slot(&r, 1), &e0.to_le_bytes()).unwrap();
        assert_eq!(r.d.check_invariants(), Err(V::DuplicateInQueue(GroupId(0))));

        // a stale slot outside the live window
        let mut r = Rig::new(4, 2, 8);
        r.d.backend.write_local(slot(&r, 6), &e0.to_le_bytes()).unwrap();
        assert!(matches!(r.d.check_invariants(), Err(V::StaleSlot { .. })));

        // a free group with a bound window
        let mut r = Rig::new(4, 2, 8);
        let (_, e) = entry(&r, 2);
        r.d.backend.mws.get_mut(&e.rkey(1).index()).unwrap().1 = Some(qpn(999));
        assert_eq!(r.d.check_invariants(), Err(V::FreeGroupBound { group: GroupId(2), mw: 1 }));

        // an allocated group whose window is bound to a QP that is not its owner's
        let mut r = Rig::new(4, 3, 8);
        let a = r.connect();
        let x = r.alloc(a).unwrap();
        let g = r.d.mn.map().group_of_entry(x.entry_addr).unwrap();
        r.d.backend.mws.get_mut(&x.rkeys[1].index()).unwrap().1 = Some(qpn(999));
        assert_eq!(r.d.check_invariants(), Err(V::WindowMisbound { group: g, mw: 2 }));

        // two groups sharing a window index
        let mut r = Rig::new(4, 2, 8);
        let (_, e1) = entry(&r, 1);
        let (addr2, mut e2) = entry(&r, 2);
        e2.rkeys[0] = e1.rkeys[1];
        put(&mut r, addr2, &e2);
        assert!(matches!(r.d.check_invariants(), Err(V::RkeyReused(_))));

        // an entry whose chunk is not the geometry's
        let mut r = Rig::new(4, 2, 8);
        let (addr, mut e) = entry(&r, 1);
        e.base = (e.base.get() + 4096).into();
        put(&mut r, addr, &e);
        assert_eq!(r.d.check_invariants(), Err(V::ChunkMismatch(GroupId(1))));

        // an owner the MN does not know
        let mut r = Rig::new(4, 2, 8);
        let a = r.connect();
        let x = r.alloc(a).unwrap();
        let g = r.d.mn.map().group_of_entry(x.entry_addr).unwrap();
        let (addr, mut e) = entry(&r, g.0);
        e.owner = 77.into();
        put(&mut r, addr, &e);
        assert_eq!(r.d.check_invariants(), Err(V::UnknownOwner { group: g, owner: 77 }));
        let _ = ENTRY_SIZE;
    }

    #[test]
    fn over_quota_is_detected() {
        let mut r = Rig::new(4, 2, 1);
        let a = r.connect();
        let _x = r.alloc(a).unwrap();
        // hand a second group to the CN behind the MN's back
        let q = r.d.mn.map().queue;
        let mut h = [0u8; 8];
        r.d.backend.read_local(q.head, &mut h).unwrap();
        let head = u64::from_le_bytes(h);
        let mut v = [0u8; 8];
        r.d.backend.read_local(head, &mut v).unwrap();
        let g = r.d.mn.map().group_of_entry(u64::from_le_bytes(v)).unwrap();
        r.d.backend.write_local(head, &0u64.to_le_bytes()).unwrap();
        r.d.backend.write_local(q.head, &(head + 8).to_le_bytes()).unwrap();
        let (addr, mut e) = entry(&r, g.0);
        e.owner = r.cns[a].0.get().into();
        put(&mut r, addr, &e);
        // its windows are unbound, so the first complaint may be the binding; make them bound
        for k in 0..2 {
            let target = if k == 0 { r.cns[a].1.free } else { r.cns[a].1.access[0] };
            r.d.backend.mws.get_mut(&e.rkey(k).index()).unwrap().1 = Some(target);
        }
        assert!(matches!(r.d.check_invariants(), Err(V::OverQuota { held: 2, .. })));
    }
}

/// Host-engine mode keeps exactly one request buffer posted per management QP: failed
/// requests must not leak receive slots (found on rxe: ENOMEM after ~100 rejected requests).
#[test]
fn failed_requests_do_not_leak_receive_slots() {
    let mut r = Rig::new(4, 2, 8);
    let a = r.connect();
    let b = r.connect();
    let x = r.alloc(a).unwrap();
    let free_qp = r.cns[b].1.free;
    for _ in 0..50 {
        assert_eq!(r.free_raw(b, x.entry_addr), Some(ErrorCode::NotOwner));
    }
    let alloc_qp = r.cns[b].1.alloc;
    for _ in 0..50 {
        r.d.backend.deliver(alloc_qp, &[0u8; 3]);
        r.d.poll(0).unwrap();
    }
    assert_eq!(r.d.backend.qps[&free_qp.get()].recvs.len(), 1);
    assert_eq!(r.d.backend.qps[&alloc_qp.get()].recvs.len(), 1);
    r.d.check_invariants().unwrap();
}

/// A freed or reclaimed chunk is zeroed before anyone else can get it (host-engine frees and
/// every reclaim).
#[test]
fn freed_and_reclaimed_chunks_are_scrubbed() {
    let mut r = Rig::new(2, 2, 8);
    let a = r.connect();
    let x = r.alloc(a).unwrap();
    let off = (x.base - POOL) as usize;
    assert!(r.d.backend.pool[off..off + 4096].iter().all(|b| *b == 0xAB), "a previous tenant's bytes");
    assert_eq!(r.free(a, &x), None);
    assert!(r.d.backend.pool[off..off + 4096].iter().all(|b| *b == 0), "scrubbed on free");
    let y = r.alloc(a).unwrap();
    let off = (y.base - POOL) as usize;
    r.d.backend.pool[off..off + 16].copy_from_slice(b"secret of cn one");
    let cn = r.cns[a].0;
    r.d.handle(1, Event::CnGone { cn }).unwrap();
    assert!(r.d.backend.pool[off..off + 4096].iter().all(|b| *b == 0), "scrubbed on reclaim");
    assert!(r.d.mn.stats().chunks_scrubbed >= 2);
}
