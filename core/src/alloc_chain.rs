//! The alloc chain (DESIGN.md §2): pop a group from the free queue and bind its windows to the
//! requesting CN, entirely in the NIC. The step table is in docs/CHAINS.md.
//!
//! Request bytes are scattered by the RECV straight into the reply WRITE (address, rkey,
//! immediate = the CN's token) and into the QP-number fields of the access BINDs. The queue
//! head's fetch-and-add yields the slot address; two loop READs copy it into the READ that
//! pops the slot and the compare-and-swap that clears it; the slot's content (an entry
//! address) is copied into the READ of the entry, the CAS's compare operand and the entry
//! write-back; the entry lands in the reply image and its fields are copied into every BIND.
//! If the queue was empty the slot held 0 and the READ of the entry at address 0 faults: that
//! step is the chain's `empty_probe`.
//!
//! **Race-free pop.** The slot is cleared only *after* the empty probe succeeded, and only if
//! it still holds what the pop read (CAS, compare patched from the pop). A push that fills the
//! slot between the pop's READ and the clear — possible only when the pop found it empty, and
//! real on hardware, where other CNs' free chains run concurrently — is therefore never erased:
//! the lap faults at the probe, the MN holds a ticket for the slot and settles it when the push
//! lands (`MemoryNode`).
//!
//! **No MN key in the reply.** The entry image carries the MR key the windows bind in; it is
//! cleared in the image (after the binds and the write-back used it) before the reply is
//! enabled, so a CN learns nothing but its own windows' rkeys (DESIGN.md §9).

use crate::chain::{ChainError, ChainKind, ChainLayout, Loc, Ring};
use crate::chain_builder::{Builder, ChainEnv};
use crate::mn_memory::{alloc_scratch as a, ALLOC_SCRATCH_OFF};
use crate::mwtable::{ENTRY_OFF_BASE, ENTRY_OFF_LKEY, ENTRY_OFF_OWNER, ENTRY_OFF_RKEYS, ENTRY_SIZE};
use crate::wire::{alloc_request as req, ALLOC_REPLY_LEN};
use crate::wqe::{QueueSel, Wqe, WqeField};

pub fn build_alloc_chain(env: &ChainEnv) -> Result<ChainLayout, ChainError> {
    let g = env.geometry().group_size();
    let s = env.scratch() + ALLOC_SCRATCH_OFF;
    let q = env.map.queue;
    let mut b = Builder::new(ChainKind::Alloc, env);

    // Reply on the management QP: patched entirely from the request (RECV scatter).
    // It is the only Mgmt step; the Loop ring enables it once the reply image is complete.
    b.push(Ring::Loop, Wqe::wait(env.mgmt_qpn, QueueSel::Recv, 1))?;
    // the token stays in scratch (the MN quotes it in error replies) and is copied into the
    // reply's immediate
    let token_copy = b.push(
        Ring::Loop,
        Wqe::read(0, env.keys.ring_lkey, 4, s + a::REQ_HDR + req::TOKEN as u64, env.keys.meta_rkey),
    )?;
    let faa = b.push(
        Ring::Loop,
        Wqe::masked_fetch_add(
            s + a::SLOT_ADDR,
            env.keys.meta_lkey,
            q.head,
            env.keys.meta_rkey,
            8,
            q.counter_boundary(),
        ),
    )?;
    let _ = faa;
    b.fence_loop(env)?;
    // copy the slot address into the pop READ and the clearing CAS (indices fixed below)
    let cp_pop = b.push(Ring::Loop, Wqe::read(0, env.keys.ring_lkey, 8, s + a::SLOT_ADDR, env.keys.meta_rkey))?;
    let cp_clear = b.push(Ring::Loop, Wqe::read(0, env.keys.ring_lkey, 8, s + a::SLOT_ADDR, env.keys.meta_rkey))?;
    b.fence_loop(env)?;
    let pop = b.push(Ring::Loop, Wqe::read(s + a::REPLY_ENTRY_ADDR, env.keys.meta_lkey, 8, 0, env.keys.meta_rkey))?;
    b.set_local(cp_pop, Loc::Field { step: pop, field: WqeField::RemoteAddr });
    b.fence_loop(env)?;
    // copy the entry address into the entry READ, the CAS's compare operand and the write-back
    let cp_entry =
        b.push(Ring::Loop, Wqe::read(0, env.keys.ring_lkey, 8, s + a::REPLY_ENTRY_ADDR, env.keys.meta_rkey))?;
    let cp_cmp =
        b.push(Ring::Loop, Wqe::read(0, env.keys.ring_lkey, 8, s + a::REPLY_ENTRY_ADDR, env.keys.meta_rkey))?;
    let cp_wb = b.push(Ring::Loop, Wqe::read(0, env.keys.ring_lkey, 8, s + a::REPLY_ENTRY_ADDR, env.keys.meta_rkey))?;
    b.fence_loop(env)?;
    let entry = b.push(
        Ring::Loop,
        Wqe::read(s + a::REPLY_ENTRY, env.keys.meta_lkey, ENTRY_SIZE as u32, 0, env.keys.table_rkey),
    )?;
    b.set_local(cp_entry, Loc::Field { step: entry, field: WqeField::RemoteAddr });
    b.layout.empty_probe = Some(entry);
    // the probe passed (in-order: a fault stops the ring before this): clear the slot iff it
    // still holds the popped entry
    let clear = b.push(Ring::Loop, Wqe::compare_swap(s + a::JUNK, env.keys.meta_lkey, 0, env.keys.meta_rkey, 0, 0))?;
    b.set_local(cp_clear, Loc::Field { step: clear, field: WqeField::RemoteAddr });
    b.set_local(cp_cmp, Loc::Field { step: clear, field: WqeField::Operand0 });
    b.fence_loop(env)?;
    b.push(
        Ring::Loop,
        Wqe::write(s + a::OWNER, env.keys.meta_lkey, 4, s + a::REPLY_ENTRY + ENTRY_OFF_OWNER, env.keys.meta_rkey),
    )?;
    // scatter the entry into the BINDs: base/length/lkey span, then the window's rkey
    let mut copies: heapless::Vec<(u8, u8), 8> = heapless::Vec::new();
    for i in 0..g {
        let span = b.push(
            Ring::Loop,
            Wqe::read(0, env.keys.ring_lkey, 16, s + a::REPLY_ENTRY + ENTRY_OFF_BASE, env.keys.meta_rkey),
        )?;
        let rk = b.push(
            Ring::Loop,
            Wqe::read(
                0,
                env.keys.ring_lkey,
                4,
                s + a::REPLY_ENTRY + ENTRY_OFF_RKEYS + 4 * i as u64,
                env.keys.meta_rkey,
            ),
        )?;
        let _ = copies.push((span, rk));
    }
    b.fence_loop(env)?;
    let mut binds: heapless::Vec<u8, 4> = heapless::Vec::new();
    for (i, (span, rk)) in copies.iter().copied().enumerate() {
        let (qpn, access) = if i == 0 {
            (env.free_qpn, env.owner_window_access)
        } else {
            (0, env.window_access) // patched from the request
        };
        let bind = b.push(Ring::Loop, Wqe::bind_mw(0, 0, 0, 0, qpn, access))?;
        b.set_local(span, Loc::Field { step: bind, field: WqeField::LocalAddr });
        b.set_local(rk, Loc::Field { step: bind, field: WqeField::Imm });
        let _ = binds.push(bind);
    }
    b.fence_loop(env)?;
    let wb = b.push(
        Ring::Loop,
        Wqe::write(s + a::REPLY_ENTRY, env.keys.meta_lkey, ENTRY_SIZE as u32, 0, env.keys.table_rkey),
    )?;
    b.set_local(cp_wb, Loc::Field { step: wb, field: WqeField::RemoteAddr });
    // the MR key the windows bind in is the MN's: not for the CN (after the write-back read it)
    b.push(
        Ring::Loop,
        Wqe::write(s + a::ZERO, env.keys.meta_lkey, 4, s + a::REPLY_ENTRY + ENTRY_OFF_LKEY, env.keys.meta_rkey),
    )?;
    b.fence_loop(env)?;
    // The reply, on the management QP. The Mgmt ring releases the Loop ring's commit half
    // only after the reply completed successfully: a reply that fails (bad reply address from
    // the CN) puts the QP in error, flushes that ENABLE, and leaves the markers set for the MN.
    let release_mgmt = b.push(Ring::Loop, Wqe::enable(env.mgmt_qpn, QueueSel::Send, 3))?;
    let first_len = b.layout.ring_len(Ring::Loop) as u64;
    let reply =
        b.push(Ring::Mgmt, Wqe::write_imm(s + a::REPLY, env.keys.cn_meta_lkey, ALLOC_REPLY_LEN as u32, 0, 0, 0))?;
    b.push(Ring::Mgmt, Wqe::wait(env.mgmt_qpn, QueueSel::Send, 1))?;
    let release = b.push(Ring::Mgmt, Wqe::enable(env.loop_qpn, QueueSel::Send, 0))?;
    let _ = release_mgmt;
    // commit: clear the markers, and the request header: a later request too short to bring
    // its own must not make the MN quote this request's token in an error (the CN would take
    // it for the answer to a request that succeeded)
    b.push(Ring::Loop, Wqe::write(s + a::ZERO, env.keys.meta_lkey, 8, s + a::REQ_HDR, env.keys.meta_rkey))?;
    b.push(Ring::Loop, Wqe::write(s + a::ZERO, env.keys.meta_lkey, 8, s + a::SLOT_ADDR, env.keys.meta_rkey))?;
    b.push(Ring::Loop, Wqe::write(s + a::ZERO, env.keys.meta_lkey, 8, s + a::REPLY_ENTRY_ADDR, env.keys.meta_rkey))?;
    // clear the reply's address and rkey for the next lap (a request must always supply them)
    let clear_reply = b.push(Ring::Loop, Wqe::write(s + a::ZEROS16, env.keys.meta_lkey, 12, 0, env.keys.ring_rkey))?;
    b.fence_loop(env)?;

    // RECV scatter: the header (with the CN's token) → scratch, the rest into WQE fields.
    b.recv(Loc::Mem(s + a::REQ_HDR), req::REPLY_ADDR as u32)?;
    b.recv(Loc::Field { step: reply, field: WqeField::RemoteAddr }, 8)?;
    b.recv(Loc::Field { step: reply, field: WqeField::Rkey }, 4)?;
    for bind in binds.iter().skip(1) {
        b.recv(Loc::Field { step: *bind, field: WqeField::Qpn }, 4)?;
    }
    b.set_local(token_copy, Loc::Field { step: reply, field: WqeField::Imm });
    b.layout.steps[clear_reply as usize].remote = Some(Loc::Field { step: reply, field: WqeField::RemoteAddr });

    b.rearm_tail(env, s + a::JUNK)?;
    let loop_depth = b.layout.ring_depth[Ring::Loop as usize] as u64;
    b.layout.steps[release as usize].wqe.operand0 = loop_depth - first_len;
    b.layout.steps[b.closing as usize].wqe.operand0 = first_len;
    b.layout.initial_enable = [first_len as u16, 0];
    Ok(b.layout)
}
