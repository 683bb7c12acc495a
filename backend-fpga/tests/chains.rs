//! The core's alloc and free chains, offloaded into the modelled engine's extension block.
//!
//! The MN side is the core's own control plane (`omw_core::mn_driver::MnDriver` over this
//! crate's `RdmaBackend`), provisioned through the core's `MnPlan` as the loopback cluster is
//! (`support::mn`: two protection domains, private loop QPs, NIC scrubbing). It formats the
//! pool (free queue, MWTable), initialises each CN's scratch and arms the chains with
//! `omw_core::arm::arm`. From then on the MN CPU is off the path: a CN's SEND of an
//! `AllocRequest` triggers the chain inside the engine, and the reply arrives by
//! WRITE_WITH_IMM.

mod support;

use omw_core::access::AccessFlags;
use omw_core::backend::{QpState, RdmaBackend, WcStatus};
use omw_core::mwtable::MwTableEntry;
use omw_core::wire::{AllocRequest, MnMessage};
use omw_core::wqe::{QueueSel, RecvWqe, Wqe};
use support::mn::*;
use support::*;

/// The table entry as the CN sees it: the reply clears the MN's MR key (DESIGN.md §9).
fn without_lkey(mut e: MwTableEntry) -> MwTableEntry {
    e.lkey = 0.into();
    e
}

#[test]
fn alloc_chain_runs_offloaded_and_binds_windows_to_the_requested_qps() {
    let mut s = cluster(1);
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
    let mut s = cluster(2);
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
    let mut s = cluster(1);
    let mut got = Vec::new();
    for t in 0..CHUNKS {
        got.push(s.alloc(0, 0x100 + t));
    }
    // the 17th request: the popped slot is 0, the READ of entry 0 faults, no reply comes
    let c = &mut s.cns[0];
    let base = c.h.mem_base;
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
    match MnMessage::decode(&s.next_message(0)).unwrap() {
        MnMessage::Error(e) => assert_eq!((e.token, e.code), (0xE, omw_core::wire::ErrorCode::Empty)),
        MnMessage::Notice(n) => assert_eq!(n, omw_core::wire::Notice::Empty),
        m => panic!("expected an empty-pool message, got {m:?}"),
    }
    s.d.check_invariants().unwrap();

    // a free makes a group available again; the MN re-arms the alloc chain and the CN retries
    s.send_free(0, got[3].entry_addr, 0xF3);
    // the MN CPU watches the tail on its timer
    s.now += 1;
    s.d.handle(s.now, omw_core::mn::Event::Tick).unwrap();
    assert!(!s.d.mn.is_empty_state());
    let mut seen = Vec::new();
    loop {
        let m = MnMessage::decode(&s.next_message(0)).unwrap();
        seen.push(m.clone());
        if matches!(m, MnMessage::Notice(omw_core::wire::Notice::Available { .. })) {
            break;
        }
        assert!(seen.len() < 4, "{seen:?}");
    }
    let again = s.alloc(0, 0x0A0A);
    assert_eq!(again.entry_addr, got[3].entry_addr, "the only free group");
    assert_eq!(again.entry.rkey(1), got[3].entry.rkey(1).next_key(), "rebound with a new key");
    s.d.check_invariants().unwrap();
}
