//! The CN driver's zero-copy and atomic accesses, its slot accounting and its refusals, end to
//! end on the test NIC: an MN provisioned by its plan, one `CnDriver` connected to it, the
//! core's one pump between them.

use crate::access::AccessFlags;
use crate::cn::driver::{AtomicOp, CnDriver, CnError, CnEvent, CnMemory, CnQpSet, LocalBuf, OpId};
use crate::cn::Allocation;
use crate::device::{Capabilities, DataPath, Domain, Provision, WcStatus};
use crate::mn::driver::MnDriver;
use crate::mn::plan::{MnOptions, MnPlan};
use crate::mn::provision::PoolSpec;
use crate::mn::CnQps;
use crate::testing::deployment::{Deployment, Immediate};
use crate::testing::test_nic::{Node, TestNic};
use core::cell::RefCell;
use std::boxed::Box;
use std::vec::Vec;

type Nic = TestNic<'static, 3, 16, 24>;
type View = Node<'static, 'static, 3, 16, 24>;
/// Four I/O slots, so the tests can fill them all.
type Cn = CnDriver<View, 8, 4>;

const CHUNK: u64 = 4096;

fn leak(len: usize) -> &'static mut [u8] {
    Box::leak(std::vec![0u8; len].into_boxed_slice())
}

struct Rig {
    mn: MnDriver<View>,
    cn: Cn,
    /// A buffer of the CN's own, registered LOCAL_WRITE: what a zero-copy access names.
    buf: LocalBuf,
}

impl Rig {
    /// `atomics`: whether the MN's device carries atomics through windows (its plan's
    /// capabilities, so its windows and its connect info follow).
    fn new(atomics: bool) -> Rig {
        let nic: &'static RefCell<Nic> =
            Box::leak(Box::new(RefCell::new(TestNic::new(crate::device::mw_rules::Mode::Strict))));
        let mn_at = nic.borrow_mut().add_node(leak(64 << 10)).unwrap();
        let cn_at = nic.borrow_mut().add_node(leak(64 << 10)).unwrap();
        let b = Node::new(nic, mn_at);
        let mut plan = MnPlan::decide(b.capabilities(), MnOptions::default()).unwrap();
        if !atomics {
            plan.caps.remove(Capabilities::MW_ATOMICS);
        }
        let spec = PoolSpec {
            chunk_size: CHUNK,
            chunks: 4,
            group_size: 2,
            max_cns: 2,
            quota: 0,
            lease_ns: 0,
            queue_depth: None,
        };
        let mut mn = plan.provision(b, &spec).unwrap();
        let mut c = Node::new(nic, cn_at);
        let pair = |c: &View| c.connect_to(Domain::CnFacing, mn_at, Domain::CnFacing).unwrap();
        let (alloc, mn_alloc) = pair(&c);
        let (free, mn_free) = pair(&c);
        let (access, mn_access) = pair(&c);
        let reply = c.alloc_memory(CnMemory::REPLY_LEN, 64).unwrap();
        let rights = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let rk = c.reg_mr(Domain::CnFacing, reply, CnMemory::REPLY_LEN, rights).unwrap();
        let local_len = CnMemory::local_len_for(4, 1024);
        let local = c.alloc_memory(local_len, 64).unwrap();
        let lk = c.reg_mr(Domain::CnFacing, local, local_len, AccessFlags::LOCAL_WRITE).unwrap();
        let own = c.alloc_memory(CHUNK, 64).unwrap();
        let ok = c.reg_mr(Domain::CnFacing, own, CHUNK, AccessFlags::LOCAL_WRITE).unwrap();
        let mem = CnMemory { local, local_len, lkey: lk.lkey, reply, reply_rkey: rk.rkey };
        let qps = CnQpSet { alloc, free, access: [access].into_iter().collect() };
        let mut cn = CnDriver::new(c, qps, mem).unwrap();
        let mn_qps = CnQps {
            alloc: mn_alloc,
            free: mn_free,
            access: [mn_access].into_iter().collect(),
            alloc_loop: None,
            free_loop: None,
        };
        Deployment::new(&mut Immediate::default(), &mut mn, &mut [&mut cn]).connect(0, mn_qps, None).unwrap();
        assert!(matches!(cn.next_event(), Some(CnEvent::Connected(_))));
        Rig { mn, cn, buf: LocalBuf { addr: own, lkey: ok.lkey, len: CHUNK as u32 } }
    }

    fn pump(&mut self) {
        Deployment::new(&mut Immediate::default(), &mut self.mn, &mut [&mut self.cn]).pump().unwrap();
    }

    fn alloc(&mut self) -> Allocation {
        let tok = self.cn.alloc(0).unwrap();
        self.pump();
        match self.cn.next_event() {
            Some(CnEvent::Allocated { token, result: Ok(a) }) if token == tok => a,
            other => panic!("no allocation: {other:?}"),
        }
    }

    /// Pump until `op` completed; its status and the bytes it copied out.
    fn finish(&mut self, op: OpId, out: &mut [u8]) -> (WcStatus, usize) {
        for _ in 0..8 {
            self.pump();
            if let Some(d) = self.cn.access_done(op, out).unwrap() {
                return (d.status, d.len);
            }
        }
        panic!("access {op:?} never completed");
    }

    fn mn_bytes(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut b = std::vec![0u8; len];
        self.mn.backend.read_local(addr, &mut b).unwrap();
        b
    }
}

#[test]
fn zero_copy_accesses_move_bytes_between_the_callers_buffer_and_the_chunk() {
    let mut r = Rig::new(true);
    let a = r.alloc();
    let rkey = a.rkey(0).unwrap();
    let pattern: Vec<u8> = (0..256u32).map(|i| (i * 7) as u8).collect();
    r.cn.backend.write_local(r.buf.addr, &pattern).unwrap();
    let src = LocalBuf { len: 256, ..r.buf };
    let op = r.cn.post_write_from(0, a.base + 512, rkey, src).unwrap();
    assert_eq!(r.cn.op_status(op), Ok(None), "in flight until the pump runs");
    // a zero-copy access copies nothing out: the bytes are already where they belong
    let mut out = [0xEEu8; 16];
    assert_eq!(r.finish(op, &mut out), (WcStatus::Success, 0));
    assert_eq!(out, [0xEE; 16]);
    assert_eq!(r.mn_bytes(a.base + 512, 256), pattern);
    // and back into another part of the caller's buffer
    let dst = LocalBuf { addr: r.buf.addr + 1024, len: 256, ..r.buf };
    let op = r.cn.post_read_into(0, a.base + 512, rkey, dst).unwrap();
    assert_eq!(r.finish(op, &mut []), (WcStatus::Success, 0));
    let mut back = std::vec![0u8; 256];
    r.cn.backend.read_local(dst.addr, &mut back).unwrap();
    assert_eq!(back, pattern);
    // the staged path reads the same bytes
    let op = r.cn.post_read(0, a.base + 512, rkey, 256).unwrap();
    let mut staged = std::vec![0u8; 256];
    assert_eq!(r.finish(op, &mut staged), (WcStatus::Success, 256));
    assert_eq!(staged, pattern);
}

#[test]
fn atomics_return_the_old_word_and_refuse_misaligned_addresses_before_posting() {
    let mut r = Rig::new(true);
    assert!(r.cn.atomics_available());
    let a = r.alloc();
    let k = a.rkey(0).unwrap();
    let mut old = [0u8; 8];
    let op = r.cn.post_atomic(0, a.base + 64, k, AtomicOp::FetchAdd { add: 5 }).unwrap();
    assert_eq!(r.finish(op, &mut old), (WcStatus::Success, 8));
    assert_eq!(u64::from_le_bytes(old), 0);
    let op = r.cn.post_atomic(0, a.base + 64, k, AtomicOp::FetchAdd { add: 3 }).unwrap();
    r.finish(op, &mut old);
    assert_eq!(u64::from_le_bytes(old), 5);
    // a compare that fails leaves the word and returns it
    let op = r.cn.post_atomic(0, a.base + 64, k, AtomicOp::CompareSwap { compare: 7, swap: 100 }).unwrap();
    r.finish(op, &mut old);
    assert_eq!(u64::from_le_bytes(old), 8);
    let op = r.cn.post_atomic(0, a.base + 64, k, AtomicOp::CompareSwap { compare: 8, swap: 100 }).unwrap();
    r.finish(op, &mut old);
    assert_eq!(u64::from_le_bytes(old), 8);
    assert_eq!(r.mn_bytes(a.base + 64, 8), 100u64.to_le_bytes());
    for bad in [1u64, 4, 65, 4095] {
        let before = r.cn.free_io_slots();
        let e = r.cn.post_atomic(0, a.base + bad, k, AtomicOp::FetchAdd { add: 1 }).unwrap_err();
        assert_eq!(e, CnError::Misaligned { addr: a.base + bad });
        assert_eq!((r.cn.free_io_slots(), r.cn.in_flight()), (before, 0), "nothing posted");
    }
    // the QP survived all of it
    let op = r.cn.post_read(0, a.base + 64, k, 8).unwrap();
    assert_eq!(r.finish(op, &mut old), (WcStatus::Success, 8));
}

#[test]
fn atomics_are_refused_when_the_mns_windows_do_not_grant_them() {
    let mut r = Rig::new(false);
    assert!(!r.cn.client().info().unwrap().flags.contains(crate::wire::message::ConnectFlags::WINDOW_ATOMICS));
    assert!(!r.cn.atomics_available());
    let a = r.alloc();
    let e = r.cn.post_atomic(0, a.base, a.rkey(0).unwrap(), AtomicOp::FetchAdd { add: 1 }).unwrap_err();
    assert_eq!(e, CnError::AtomicsUnsupported);
    assert_eq!(r.cn.in_flight(), 0);
    // reads and writes are unaffected
    let op = r.cn.post_write(0, a.base, a.rkey(0).unwrap(), b"still fine").unwrap();
    assert_eq!(r.finish(op, &mut []).0, WcStatus::Success);
}

#[test]
fn slots_are_counted_held_until_collected_and_busy_when_all_are_taken() {
    let mut r = Rig::new(true);
    let a = r.alloc();
    let k = a.rkey(0).unwrap();
    assert_eq!((r.cn.io_slots(), r.cn.free_io_slots()), (4, 4));
    let ops: Vec<OpId> = (0..4).map(|i| r.cn.post_read(0, a.base + i * 8, k, 8).unwrap()).collect();
    assert_eq!(r.cn.free_io_slots(), 0);
    assert_eq!(r.cn.post_read(0, a.base, k, 8), Err(CnError::SlotsBusy));
    assert_eq!(r.cn.post_read_into(0, a.base, k, LocalBuf { len: 8, ..r.buf }), Err(CnError::SlotsBusy));
    r.pump();
    // done, but a slot is free only once its access is collected
    for op in &ops {
        assert_eq!(r.cn.op_status(*op), Ok(Some(WcStatus::Success)));
    }
    assert_eq!(r.cn.free_io_slots(), 0);
    r.cn.access_done(ops[0], &mut []).unwrap();
    assert_eq!(r.cn.free_io_slots(), 1);
    assert_eq!(r.cn.op_status(ops[0]), Err(CnError::UnknownOp(ops[0])));
    assert_eq!(r.cn.access_done(ops[0], &mut []), Err(CnError::UnknownOp(ops[0])));
    // the staged path still refuses what does not fit its slot
    let max = r.cn.io_slot_len();
    assert_eq!(r.cn.post_read(0, a.base, k, max + 1), Err(CnError::TooLong { len: max + 1, max }));
    assert!(r.cn.free_send_slots() > 0);
}
