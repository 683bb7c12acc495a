//! The alloc chain (DESIGN.md §2): pop a group from the free queue and bind its windows to the
//! requesting CN, entirely in the NIC — with the pop taken off the request's path. The step
//! table, with the gated phases and the WQEs per lap, is in docs/CHAINS.md.
//!
//! A lap runs in this order, which is also the order the host engine executes it in:
//!
//! 1. **Prepare** (before the request): pop the group this lap will hand out. The queue head's
//!    fetch-and-add yields a slot address (the `SLOT_ADDR` marker, atomically with the pop's
//!    ticket); FENCEd loop READs copy it into the pop READ and the clearing compare-and-swap;
//!    a FENCEd self-ENABLE releases the pop READ, which lands the entry address (the
//!    `REPLY_ENTRY_ADDR` marker); FENCEd copies put it into the entry READ, the CAS's compare
//!    operand and the write-back; a FENCEd self-ENABLE releases the entry READ through the
//!    MWTable-only MR — the chain's `empty_probe`: an empty queue left 0 in the slot, and
//!    address 0 faults. The entry, short of its owner, lands in the reply image; FENCEd copies
//!    put, per bind, the span, the new key and the key the window holds now (rdma-core names
//!    the window by it, `ctrl->imm = mw->rkey`) into the BINDs; the CAS clears the slot; the
//!    image — its owner field the requester's, written when the CN connected — is written
//!    back as the entry; the image's lkey is zeroed (an MN key, not for the CN).
//! 2. **Serve** (the request): WAIT for the RECV, which scattered the reply target and the
//!    access QP numbers straight into the reply WRITE and the BINDs, and the header (with the
//!    CN's token) into scratch; copy the token into the reply's immediate; a FENCEd ENABLE of
//!    the management ring releases the G BINDs and the reply — in one send queue, so the reply
//!    goes out only after every bind completed (the small fence mlx5 puts after a bind) and not
//!    at all if one failed (the QP errors, the reply is flushed).
//! 3. **Commit** (after the reply completed): the management ring WAITs for the reply's
//!    completion and releases the commit — clear the markers, the request header, the reply
//!    target; re-enable the RECV; the lap tail (the WAITs' bumps, the closing ENABLE) — and the
//!    next lap's prepare starts at once.
//!
//! Offloaded with `ChainEnv::pop_ahead` (the MN's `MnConfig::pop_ahead`), the rings repeat
//! this lap: the chain is armed with the prepare phase enabled, so
//! each lap pops the group for the *next* request as soon as the previous reply went out, and
//! a request finds its group popped and its binds patched: from the RECV to the reply it
//! passes one WAIT and one ENABLE release — RECV → BINDs → reply. What that costs: every CN
//! whose alloc chain is armed holds one popped group it has not asked for yet (owned by it in
//! the MWTable, counted in its holdings; the quota allows for it, `mn::quota`), and a pool
//! with fewer free groups than armed CNs leaves the later CNs' chains parked on "empty" while
//! earlier ones hold a group each until they use it; so the MN pops ahead only where that is a
//! small share of the pool (`MnConfig::pop_ahead_pays`). Without popping ahead the lap starts
//! with the request's WAIT and the token copy, and the pop's three gated phases lie on the
//! request's path. Host engine, the MN CPU runs the lap in order when a request arrives: it
//! pops for that request.
//!
//! **Race-free pop.** The slot is cleared only *after* the empty probe succeeded (the CAS
//! follows a step FENCEd behind the probe; the validator proves nothing after the probe runs
//! before it completed), and only if it still holds what the pop read (CAS, compare patched
//! from the pop). A push that fills the slot between the pop's READ and the clear — possible
//! only when the pop found it empty, and real on hardware, where other CNs' free chains run
//! concurrently — is therefore never erased: the lap faults at the probe, the MN holds a
//! ticket for the slot and settles it when the push lands (`MemoryNode`).
//!
//! **No MN key in the reply.** The image carries the MR key the windows bind in; it is zeroed
//! (after the write-back read it) before the reply is enabled, so a CN learns nothing but its
//! own windows' rkeys (DESIGN.md §9).

use crate::chain::builder::{fenced, Builder, ChainEnv};
use crate::chain::{ChainError, ChainKind, ChainLayout, Loc, Ring};
use crate::geometry::MAX_GROUP_SIZE;
use crate::wire::memory_map::{alloc_scratch as a, ALLOC_SCRATCH_OFF};
use crate::wire::message::{alloc_request as req, ALLOC_REPLY_LEN};
use crate::wire::mwtable::{
    entry_off_cur_rkey, entry_off_rkey, ENTRY_OFF_BASE, ENTRY_OFF_LKEY, ENTRY_OFF_OWNER, ENTRY_SIZE,
};
use crate::wire::wqe::{QueueSel, Wqe, WqeField};

pub fn build_alloc_chain(env: &ChainEnv) -> Result<ChainLayout, ChainError> {
    let g = env.geometry().group_size();
    let s = env.scratch() + ALLOC_SCRATCH_OFF;
    let q = env.map.queue;
    let k = env.keys;
    let mut b = Builder::new(ChainKind::Alloc, env);
    let field = |step, field| Loc::Field { step, field };
    b.lap_head(env)?;

    // Without popping ahead the request comes first and the pop is on its path.
    let mut request_first = None;
    if !env.pop_ahead {
        let w = b.push(Ring::Loop, Wqe::wait(env.mgmt_qpn, QueueSel::Recv, 1))?;
        let t = b.push(Ring::Loop, Wqe::read(0, k.ring_lkey, 4, s + a::REQ_HDR + req::TOKEN as u64, k.meta_rkey))?;
        request_first = Some((w, t));
    }

    // ==== prepare, phase 1: take a slot
    b.push(
        Ring::Loop,
        Wqe::masked_fetch_add(s + a::SLOT_ADDR, k.meta_lkey, q.head, k.meta_rkey, 8, q.counter_boundary()),
    )?;
    // the slot address into the pop READ and the clearing CAS (FENCE: after the FAA landed)
    let cp_pop = b.push(Ring::Loop, fenced(Wqe::read(0, k.ring_lkey, 8, s + a::SLOT_ADDR, k.meta_rkey)))?;
    let cp_clear = b.push(Ring::Loop, Wqe::read(0, k.ring_lkey, 8, s + a::SLOT_ADDR, k.meta_rkey))?;
    let gate2 = b.gate_loop(env)?;
    let len1 = b.layout.ring_len(Ring::Loop) as u64;

    // ==== prepare, phase 2: pop the slot
    let pop = b.push(Ring::Loop, Wqe::read(s + a::REPLY_ENTRY_ADDR, k.meta_lkey, 8, 0, k.meta_rkey))?;
    b.set_local(cp_pop, field(pop, WqeField::RemoteAddr));
    // the entry address into the entry READ, the CAS's compare operand and the write-back
    let entry_addr = |w: fn(crate::wire::wqe::Wqe) -> crate::wire::wqe::Wqe| {
        w(Wqe::read(0, k.ring_lkey, 8, s + a::REPLY_ENTRY_ADDR, k.meta_rkey))
    };
    let cp_entry = b.push(Ring::Loop, entry_addr(fenced))?;
    let cp_cmp = b.push(Ring::Loop, entry_addr(|w| w))?;
    let cp_wb = b.push(Ring::Loop, entry_addr(|w| w))?;
    // Binds to the poster: the entry's owner-and-proof-key address, into the serve phase's
    // stamp (the copy behind the FENCEd one above, so after the pop landed; the add FENCEd
    // behind the copy, the copy of its sum behind the add)
    let cp_stamp = if env.variant.binds_to_poster {
        b.push(Ring::Loop, Wqe::read(s + a::STAMP_ADDR, k.meta_lkey, 8, s + a::REPLY_ENTRY_ADDR, k.meta_rkey))?;
        b.push(
            Ring::Loop,
            fenced(Wqe::masked_fetch_add(
                s + a::JUNK,
                k.meta_lkey,
                s + a::STAMP_ADDR,
                k.meta_rkey,
                ENTRY_OFF_OWNER,
                1 << 63,
            )),
        )?;
        Some(b.push(Ring::Loop, fenced(Wqe::read(0, k.ring_lkey, 8, s + a::STAMP_ADDR, k.meta_rkey)))?)
    } else {
        None
    };
    let gate3 = b.gate_loop(env)?;
    b.set_count(gate2, b.layout.ring_len(Ring::Loop) as u64 - len1);
    let len2 = b.layout.ring_len(Ring::Loop) as u64;

    // ==== prepare, phase 3: read the entry (the empty probe), scatter it, write it back
    // the entry short of its owner lands in the reply image, whose owner field names the
    // requester (so the entry written back from it does too)
    let probe =
        b.push(Ring::Loop, Wqe::read(s + a::REPLY_ENTRY, k.meta_lkey, ENTRY_OFF_OWNER as u32, 0, k.table_rkey))?;
    b.set_local(cp_entry, field(probe, WqeField::RemoteAddr));
    b.layout.empty_probe = Some(probe);
    // per bind: the base/length/lkey span, the window's new key, the key it holds now (FENCE:
    // after the probe landed — and so after it succeeded: everything from here on runs only if
    // the queue was not empty)
    let mut copies: heapless::Vec<(u8, u8, u8), MAX_GROUP_SIZE> = heapless::Vec::new();
    for i in 0..g {
        let span = Wqe::read(0, k.ring_lkey, 16, s + a::REPLY_ENTRY + ENTRY_OFF_BASE, k.meta_rkey);
        let span = b.push(Ring::Loop, if i == 0 { fenced(span) } else { span })?;
        let rk = s + a::REPLY_ENTRY + entry_off_rkey(i);
        let rk = b.push(Ring::Loop, Wqe::read(0, k.ring_lkey, 4, rk, k.meta_rkey))?;
        let cur = s + a::REPLY_ENTRY + entry_off_cur_rkey(i);
        let cur = b.push(Ring::Loop, Wqe::read(0, k.ring_lkey, 4, cur, k.meta_rkey))?;
        let pushed = copies.push((span, rk, cur));
        debug_assert!(pushed.is_ok(), "one per window: G <= MAX_GROUP_SIZE (PoolGeometry::new)");
    }
    // the probe passed: clear the slot iff it still holds the popped entry
    let clear = b.push(Ring::Loop, Wqe::compare_swap(s + a::JUNK, k.meta_lkey, 0, k.meta_rkey, 0, 0))?;
    b.set_local(cp_clear, field(clear, WqeField::RemoteAddr));
    b.set_local(cp_cmp, field(clear, WqeField::Operand0));
    // the owner is recorded before any window is bound
    let wb = b.push(Ring::Loop, Wqe::write(s + a::REPLY_ENTRY, k.meta_lkey, ENTRY_SIZE as u32, 0, k.table_rkey))?;
    b.set_local(cp_wb, field(wb, WqeField::RemoteAddr));
    // the MR key the windows bind in is the MN's: not for the CN (after the write-back read
    // it; a READ, so the serve phase's FENCE covers it)
    b.push(Ring::Loop, Wqe::read(s + a::REPLY_ENTRY + ENTRY_OFF_LKEY, k.meta_lkey, 4, s + a::ZEROS16, k.meta_rkey))?;

    // ==== serve: the request is here (popping ahead: now; otherwise it came first)
    let (request, token_copy) = match request_first {
        Some(rt) => rt,
        None => {
            let w = b.push(Ring::Loop, Wqe::wait(env.mgmt_qpn, QueueSel::Recv, 1))?;
            // the token stays in scratch (the MN quotes it in error replies) and goes into the
            // reply's immediate
            let t =
                b.push(Ring::Loop, Wqe::read(0, k.ring_lkey, 4, s + a::REQ_HDR + req::TOKEN as u64, k.meta_rkey))?;
            (w, t)
        }
    };
    b.layout.request_wait = Some(request);
    // Binds to the poster: the request is here, so the group is being handed out — stamp the
    // entry with the requester's proof key (and its id again), which the free chain's proof
    // needs. A group popped ahead stays unstamped: its owner's free cannot pass before a
    // request is binding its windows (the paper layout's MW[0], bound in the serve phase too).
    if let Some(cp) = cp_stamp {
        let stamp = b.push(Ring::Loop, Wqe::write(s + a::STAMP, k.meta_lkey, 8, 0, k.table_rkey))?;
        b.set_local(cp, field(stamp, WqeField::RemoteAddr));
    }
    let release_mgmt = b.push(Ring::Loop, fenced(Wqe::enable(env.mgmt_qpn, QueueSel::Send, 0)))?;
    b.set_count(gate3, b.layout.ring_len(Ring::Loop) as u64 - len2);
    let first_half = b.layout.ring_len(Ring::Loop) as u64;

    // ---- the management ring: bind, then reply. A bind or a reply that fails (a bad QP number
    // or reply address from the CN) puts the QP in error and flushes what follows: no reply
    // without windows, no commit without a reply — the markers stay set for the MN.
    let mut binds: heapless::Vec<u8, MAX_GROUP_SIZE> = heapless::Vec::new();
    for (i, (span, rk, cur)) in copies.iter().copied().enumerate() {
        let (qpn, access) = if i == 0 && env.variant.binds_to_poster {
            // the poster: whatever the device does with a bind naming another QP
            (env.mgmt_qpn, env.owner_window_access)
        } else if i == 0 {
            (env.free_qpn, env.owner_window_access)
        } else {
            (0, env.window_access) // patched from the request
        };
        let bind = b.push(Ring::Mgmt, Wqe::bind_mw(0, 0, 0, 0, qpn, access).with_current_rkey(0))?;
        b.set_local(span, field(bind, WqeField::LocalAddr));
        b.set_local(rk, field(bind, WqeField::Imm));
        b.set_local(cur, field(bind, WqeField::Rkey));
        let pushed = binds.push(bind);
        debug_assert!(pushed.is_ok(), "one per copy, copies holds at most MAX_GROUP_SIZE");
    }
    let reply = b.push(Ring::Mgmt, Wqe::write_imm(s + a::REPLY, k.cn_meta_lkey, ALLOC_REPLY_LEN as u32, 0, 0, 0))?;
    b.layout.critical_end = Some(reply);
    b.set_local(token_copy, field(reply, WqeField::Imm));
    let mgmt_signaled = b.signaled_on(Ring::Mgmt);
    b.push(Ring::Mgmt, Wqe::wait(env.mgmt_qpn, QueueSel::Send, mgmt_signaled))?;
    let release_commit = b.push(Ring::Mgmt, Wqe::enable(env.loop_qpn, QueueSel::Send, 0))?;

    // ==== commit (Loop): clear the markers, and the request header: a later request too short
    // to bring its own must not make the MN quote this request's token in an error (the CN
    // would take it for the answer to a request that succeeded)
    const _: () = assert!(a::REQ_HDR == a::SLOT_ADDR + 8);
    b.push(Ring::Loop, Wqe::write(s + a::ZEROS16, k.meta_lkey, 16, s + a::SLOT_ADDR, k.meta_rkey))?;
    b.push(Ring::Loop, Wqe::write(s + a::ZEROS16, k.meta_lkey, 8, s + a::REPLY_ENTRY_ADDR, k.meta_rkey))?;
    // clear the reply's address and rkey for the next lap (a request must always supply them)
    let clear_reply = b.push(Ring::Loop, Wqe::write(s + a::ZEROS16, k.meta_lkey, 12, 0, k.ring_rkey))?;
    b.layout.steps[clear_reply as usize].remote = Some(field(reply, WqeField::RemoteAddr));

    // RECV scatter: the header (with the CN's token) → scratch, the rest into WQE fields.
    b.recv(Loc::Mem(s + a::REQ_HDR), req::REPLY_ADDR as u32)?;
    const _: () = assert!(req::REPLY_RKEY == req::REPLY_ADDR + 8);
    b.recv(field(reply, WqeField::RemoteAddr), 12)?; // address and rkey: adjacent in both
    for bind in binds.iter().skip(1) {
        b.recv(field(*bind, WqeField::Qpn), 4)?;
    }

    b.lap_tail(env)?;
    let [loop_depth, mgmt_depth] = b.layout.ring_depth.map(u64::from);
    // per lap: the management ring runs once round (its padding too), the commit and the Loop
    // ring's padding come from the management ring, the next lap's first phase from the closing
    // ENABLE
    b.set_count(release_mgmt, mgmt_depth);
    b.set_count(release_commit, loop_depth - first_half);
    let closing = b.closing;
    b.set_count(closing, len1);
    b.layout.initial_enable = [len1 as u16, 0];
    b.settle_relays();
    Ok(b.layout)
}
