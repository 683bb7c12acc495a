//! The tracer sees every call, in order, with its result.

use super::*;
use crate::device::mw_rules::Mode;
use crate::device::ExecutionMode;
use crate::mn::plan::{MnOptions, MnPlan};
use crate::mn::provision::PoolSpec;
use crate::testing::test_nic::{Node, TestNic};
use core::cell::RefCell as Cell;
use std::string::{String, ToString};
use std::vec::Vec;

type Nic<'m> = TestNic<'m, 1, 8, 32>;

#[test]
fn every_call_is_seen_in_order_with_its_result() {
    let mut mem = std::vec![0u8; 8192];
    let mut nic: Nic<'_> = TestNic::new(Mode::Strict);
    let n = nic.add_node(&mut mem).unwrap();
    let nic = Cell::new(nic);
    let log: Cell<Vec<(String, bool)>> = Cell::new(Vec::new());
    let mut t =
        Tracer::new(Node::new(&nic, n), |e: &TraceEvent<'_>| log.borrow_mut().push((e.name().to_string(), e.failed())));
    let qp = t.create_loopback_qp(Domain::CnFacing, None).unwrap();
    let buf = t.alloc_memory(64, 8).unwrap();
    let k = t.reg_mr(Domain::CnFacing, buf, 64, AccessFlags::LOCAL_WRITE).unwrap();
    t.post_send(qp, &Wqe::nop().with_wr_id(5)).unwrap();
    let mut out = [Completion::EMPTY; 4];
    assert_eq!(t.poll_cq(qp, QueueSel::Send, &mut out).unwrap(), 1);
    assert!(t.enable(qp, QueueSel::Send, 1).is_err());
    let _ = t.qp_state(qp);
    let _ = t.read_local(buf + 100, &mut [0u8; 4]);
    let _ = t.capabilities();
    let _ = k;
    let _ = t.into_inner();
    let names: Vec<_> = log.borrow().iter().map(|(n, f)| (n.clone(), *f)).collect();
    let want = [
        ("create_loopback_qp", false),
        ("alloc_memory", false),
        ("reg_mr", false),
        ("post_send", false),
        ("poll_cq", false),
        ("enable", true),
        ("qp_state", false),
        ("read_local", true),
        ("capabilities", false),
    ];
    assert_eq!(names, want.iter().map(|(n, f)| (n.to_string(), *f)).collect::<Vec<_>>());
}

/// What a firmware reviewer asks of a trace: provisioning a host-engine MN registers nothing
/// with a remote right, and the pool is registered for binding only.
#[test]
fn a_traced_provisioning_shows_every_registration_and_its_rights() {
    let mut mem = std::vec![0u8; 64 << 10];
    let mut nic: Nic<'_> = TestNic::new(Mode::Strict);
    let n = nic.add_node(&mut mem).unwrap();
    let nic = Cell::new(nic);
    let regs: Cell<Vec<(Domain, u64, AccessFlags)>> = Cell::new(Vec::new());
    let calls = Cell::new(0u32);
    let hook = |e: &TraceEvent<'_>| {
        *calls.borrow_mut() += 1;
        if let TraceEvent::RegMr { domain, len, access, result: Ok(_), .. } = e {
            regs.borrow_mut().push((*domain, *len, *access));
        }
    };
    let t = Tracer::new(Node::new(&nic, n), hook);
    let plan = MnPlan::decide(t.capabilities(), MnOptions::default()).unwrap();
    assert_eq!(plan.mode, ExecutionMode::HostEngine);
    let spec =
        PoolSpec { chunk_size: 4096, chunks: 4, group_size: 2, max_cns: 2, quota: 0, lease_ns: 0, queue_depth: None };
    let d = plan.provision(t, &spec).unwrap();
    drop(d);
    let regs = regs.borrow();
    let remote = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    assert!(regs.len() >= 3, "{regs:?}");
    assert!(regs.iter().all(|(d, _, a)| *d == Domain::CnFacing && !a.intersects(remote)), "{regs:?}");
    assert!(regs.iter().any(|(_, len, a)| *len == 4 * 4096 && a.contains(AccessFlags::MW_BIND)));
    assert!(*calls.borrow() > regs.len() as u32 + 8, "windows, memory, the admin QP and the format were traced too");
}
