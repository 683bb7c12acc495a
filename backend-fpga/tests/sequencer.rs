//! The sequencer fetches ahead like a real NIC: a WQE patched by an earlier READ must be
//! gated by a WAIT, or the engine runs the stale bytes (what the core's validator guards).

mod support;

use omw_core::access::AccessFlags;
use omw_core::device::DataPath;
use omw_core::device::OffloadRings;
use omw_core::device::Provision;
use omw_core::device::{Domain, WcStatus};
use omw_core::wire::wqe::{masked_add, QueueSel, Wqe, WqeField};
use omw_fpga::double::Fabric;
use omw_fpga::encoding::OpcodeEncoding;
use omw_fpga::QpSetup;
use support::*;

const MN: u64 = 0x4000_0000;
const M: u64 = MN + 0x1000;
const STALE: u64 = M + 0x200;
const FRESH: u64 = M + 0x300;
const OUT: u64 = M + 0x400;

fn run(gated: bool) -> Vec<u8> {
    let f = Fabric::new();
    let mut mn = host(&f, 9, MN, true, OpcodeEncoding::AppOpcodes);
    // a loop pair and its memory in the MN-private domain, where the ring registration is
    setup(&mut mn, 3, QpSetup::plain(16, 0).in_domain(Domain::MnPrivate));
    setup(&mut mn, 4, QpSetup::plain(0, 0).in_domain(Domain::MnPrivate));
    connect_loop(&mut mn, 3, 4);
    let use_ =
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    let meta = mn.be.reg_mr_in(Domain::MnPrivate, M, 0x1000, use_).unwrap();
    let ring = mn.be.ring_keys(Domain::MnPrivate).unwrap();
    put(&mut mn.be, M, &FRESH.to_le_bytes());
    put(&mut mn.be, STALE, b"stale!!!");
    put(&mut mn.be, FRESH, b"patched!");
    let q = mn.be.qpn(3).unwrap();
    let base = mn.be.ring_base(q, QueueSel::Send).unwrap();
    let target = base + 2 * 64 + WqeField::RemoteAddr.offset() as u64;
    f.set_paused(mn.id, true); // post the whole ring before the engine looks at it
    mn.be.post_send(q, &Wqe::read(target, ring.lkey, 8, M, meta.rkey).with_wr_id(1)).unwrap();
    let gate = if gated { Wqe::wait(q.get(), QueueSel::Send, 1) } else { Wqe::nop() };
    mn.be.post_send(q, &gate.with_wr_id(2)).unwrap();
    mn.be.post_send(q, &Wqe::read(OUT, meta.lkey, 8, STALE, meta.rkey).with_wr_id(3)).unwrap();
    f.set_paused(mn.id, false);
    let done = wait_n(&mut mn.be, q, QueueSel::Send, if gated { 2 } else { 3 });
    assert!(done.iter().all(|c| c.status == WcStatus::Success), "{done:?}");
    get(&mn.be, OUT, 8)
}

#[test]
fn ungated_patch_executes_stale_bytes_gated_patch_lands() {
    assert_eq!(run(false), b"stale!!!", "prefetched before the patch landed");
    assert_eq!(run(true), b"patched!", "WAIT stops the prefetch until the patch completed");
}

#[test]
fn masked_fetch_add_wraps_a_ring_counter_in_place() {
    let f = Fabric::new();
    let mut mn = host(&f, 9, MN, true, OpcodeEncoding::AppOpcodes);
    setup(&mut mn, 3, QpSetup::plain(16, 0));
    setup(&mut mn, 4, QpSetup::plain(0, 0));
    connect_loop(&mut mn, 3, 4);
    let meta =
        mn.be.reg_mr(Domain::CnFacing, M, 0x1000, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC).unwrap();
    let q = mn.be.qpn(3).unwrap();
    // a counter holding slot addresses of a 16-slot ring at 0x8000: it wraps at bit 7
    let ring = 0x8000u64;
    put(&mut mn.be, M, &(ring + 15 * 8).to_le_bytes());
    let w = Wqe::masked_fetch_add(M + 8, meta.lkey, M, meta.rkey, 8, 1 << 6);
    mn.be.post_send(q, &w).unwrap();
    assert_eq!(wait1(&mut mn.be, q, QueueSel::Send).status, WcStatus::Success);
    assert_eq!(get(&mn.be, M, 8), ring.to_le_bytes());
    assert_eq!(get(&mn.be, M + 8, 8), (ring + 15 * 8).to_le_bytes(), "the old value came back");
    assert_eq!(masked_add(ring + 15 * 8, 8, 1 << 6), ring);
    // compare-and-swap
    mn.be.post_send(q, &Wqe::compare_swap(M + 8, meta.lkey, M, meta.rkey, ring, 7)).unwrap();
    assert_eq!(wait1(&mut mn.be, q, QueueSel::Send).status, WcStatus::Success);
    assert_eq!(get(&mn.be, M, 8), 7u64.to_le_bytes());
    // an MR without REMOTE_ATOMIC refuses atomics
    let ro =
        mn.be.reg_mr(Domain::CnFacing, M + 0x800, 64, AccessFlags::REMOTE_READ | AccessFlags::LOCAL_WRITE).unwrap();
    mn.be.post_send(q, &Wqe::fetch_add(M + 8, meta.lkey, M + 0x800, ro.rkey, 1)).unwrap();
    assert_eq!(wait1(&mut mn.be, q, QueueSel::Send).status, WcStatus::RemAccessErr);
}
