//! The free chain (DESIGN.md §2): return a group to the free queue — but only if the caller
//! owns it, which the NIC proves by invalidating MW[0] on the caller's own Free QP (a type-2
//! window bound elsewhere refuses). The step table is in docs/CHAINS.md.
//!
//! The Loop ring runs in two halves. The first copies the entry the request names (through the
//! MWTable-only MR, so an address outside the table faults) and patches its rkeys into the
//! Free QP's LOCAL_INV and UNBINDs, then enables the Free QP's ring. That ring invalidates
//! MW[0] (the ownership check), unbinds the access windows, and only then enables the Loop
//! ring's second half: if the check fails the Free QP enters the error state, its ENABLE is
//! flushed, and nothing of the second half ever runs. The second half first records that the
//! check passed (the `PASSED` marker, which the MN's repair trusts instead of the MWTable),
//! scrubs the chunk — a WRITE from a chunk of zeros through the MN-private domain, when the MN
//! plan scrubs on the NIC — increments the key byte of every rkey with masked fetch-and-adds,
//! clears the owner, writes the entry back, and pushes the entry address at the queue tail.
//! Nothing is pushed before MW[0] is invalidated, so no group whose MW[0] is bound ever enters
//! the queue.

use crate::chain::{ChainError, ChainKind, ChainLayout, Loc, Ring};
use crate::chain_builder::{Builder, ChainEnv};
use crate::mn_memory::{free_scratch as f, FREE_SCRATCH_OFF};
use crate::mwtable::{
    ENTRY_OFF_BASE, ENTRY_OFF_OWNER, ENTRY_OFF_RKEYS, ENTRY_SIZE, RKEY_PAIR_KEY_BOUNDARY, RKEY_PAIR_KEY_INCREMENT,
};
use crate::wire::free_request as req;
use crate::wqe::{QueueSel, Wqe, WqeField};

pub fn build_free_chain(env: &ChainEnv) -> Result<ChainLayout, ChainError> {
    let g = env.geometry().group_size();
    let s = env.scratch() + FREE_SCRATCH_OFF;
    let q = env.map.queue;
    let mut b = Builder::new(ChainKind::Free, env);

    // ---- Loop, first half
    b.push(Ring::Loop, Wqe::wait(env.mgmt_qpn, QueueSel::Recv, 1))?;
    let cp_read = b.push(Ring::Loop, Wqe::read(0, env.keys.ring_lkey, 8, s + f::ENTRY_ADDR, env.keys.meta_rkey))?;
    let cp_wb = b.push(Ring::Loop, Wqe::read(0, env.keys.ring_lkey, 8, s + f::ENTRY_ADDR, env.keys.meta_rkey))?;
    b.fence_loop(env)?;
    let rd =
        b.push(Ring::Loop, Wqe::read(s + f::ENTRY, env.keys.meta_lkey, ENTRY_SIZE as u32, 0, env.keys.table_rkey))?;
    b.set_local(cp_read, Loc::Field { step: rd, field: WqeField::RemoteAddr });
    b.fence_loop(env)?;
    let scrub = env.keys.zero_lkey != 0 && env.keys.pool_scrub_rkey != 0;
    // the chunk's base, for the scrub WRITE of the second half
    let cp_base = if scrub {
        Some(
            b.push(Ring::Loop, Wqe::read(0, env.keys.ring_lkey, 8, s + f::ENTRY + ENTRY_OFF_BASE, env.keys.meta_rkey))?,
        )
    } else {
        None
    };
    let mut copies: heapless::Vec<u8, 4> = heapless::Vec::new();
    for i in 0..g {
        let c = b.push(
            Ring::Loop,
            Wqe::read(0, env.keys.ring_lkey, 4, s + f::ENTRY + ENTRY_OFF_RKEYS + 4 * i as u64, env.keys.meta_rkey),
        )?;
        let _ = copies.push(c);
    }
    b.fence_loop(env)?;
    let first_half_enable = b.push(Ring::Loop, Wqe::enable(env.mgmt_qpn, QueueSel::Send, 0))?;
    let first_len = b.layout.ring_len(Ring::Loop) as u16;

    // ---- Free QP ring: the ownership check, then the unbinds, then release the second half
    let inv = b.push(Ring::Mgmt, Wqe::local_inv(0))?;
    b.set_local(copies[0], Loc::Field { step: inv, field: WqeField::Imm });
    b.layout.ownership_check = Some(inv);
    for c in copies.iter().skip(1).copied() {
        let u = b.push(Ring::Mgmt, Wqe::unbind_mw(0))?;
        b.set_local(c, Loc::Field { step: u, field: WqeField::Imm });
    }
    let mgmt_signaled = b.signaled_on(Ring::Mgmt);
    b.push(Ring::Mgmt, Wqe::wait(env.mgmt_qpn, QueueSel::Send, mgmt_signaled))?;
    let release = b.push(Ring::Mgmt, Wqe::enable(env.loop_qpn, QueueSel::Send, 0))?;
    let mgmt_len = b.layout.ring_len(Ring::Mgmt) as u64;
    b.layout.steps[first_half_enable as usize].wqe.operand0 = mgmt_len;

    // ---- Loop, second half: the ownership check passed
    b.push(Ring::Loop, Wqe::write(s + f::ENTRY_ADDR, env.keys.meta_lkey, 8, s + f::PASSED, env.keys.meta_rkey))?;
    if let Some(cp) = cp_base {
        // no window reaches the chunk any more: clear what its owner left, before anyone
        // can pop it again
        let chunk = env.geometry().chunk_size() as u32;
        let w =
            b.push(Ring::Loop, Wqe::write(env.keys.zero_addr, env.keys.zero_lkey, chunk, 0, env.keys.pool_scrub_rkey))?;
        b.set_local(cp, Loc::Field { step: w, field: WqeField::RemoteAddr });
    }
    for pair in 0..g.div_ceil(2) {
        b.push(
            Ring::Loop,
            Wqe::masked_fetch_add(
                s + f::JUNK,
                env.keys.meta_lkey,
                s + f::ENTRY + ENTRY_OFF_RKEYS + 8 * pair as u64,
                env.keys.meta_rkey,
                RKEY_PAIR_KEY_INCREMENT,
                RKEY_PAIR_KEY_BOUNDARY,
            ),
        )?;
    }
    b.push(
        Ring::Loop,
        Wqe::write(s + f::ZERO, env.keys.meta_lkey, 4, s + f::ENTRY + ENTRY_OFF_OWNER, env.keys.meta_rkey),
    )?;
    b.fence_loop(env)?;
    let wb =
        b.push(Ring::Loop, Wqe::write(s + f::ENTRY, env.keys.meta_lkey, ENTRY_SIZE as u32, 0, env.keys.table_rkey))?;
    b.set_local(cp_wb, Loc::Field { step: wb, field: WqeField::RemoteAddr });
    b.push(
        Ring::Loop,
        Wqe::masked_fetch_add(
            s + f::PUSH_SLOT,
            env.keys.meta_lkey,
            q.tail,
            env.keys.meta_rkey,
            8,
            q.counter_boundary(),
        ),
    )?;
    b.fence_loop(env)?;
    let cp_push = b.push(Ring::Loop, Wqe::read(0, env.keys.ring_lkey, 8, s + f::PUSH_SLOT, env.keys.meta_rkey))?;
    b.fence_loop(env)?;
    let push = b.push(Ring::Loop, Wqe::write(s + f::ENTRY_ADDR, env.keys.meta_lkey, 8, 0, env.keys.meta_rkey))?;
    b.set_local(cp_push, Loc::Field { step: push, field: WqeField::RemoteAddr });
    b.fence_loop(env)?;
    // commit: clear the markers (a failure with them set means "this lap may be half done")
    // and the request header (a later short request must not be answered with this token)
    b.push(Ring::Loop, Wqe::write(s + f::ZERO, env.keys.meta_lkey, 8, s + f::REQ_HDR, env.keys.meta_rkey))?;
    b.push(Ring::Loop, Wqe::write(s + f::ZERO, env.keys.meta_lkey, 8, s + f::ENTRY_ADDR, env.keys.meta_rkey))?;
    b.push(Ring::Loop, Wqe::write(s + f::ZERO, env.keys.meta_lkey, 8, s + f::PASSED, env.keys.meta_rkey))?;
    b.push(Ring::Loop, Wqe::write(s + f::ZERO, env.keys.meta_lkey, 8, s + f::PUSH_SLOT, env.keys.meta_rkey))?;
    b.fence_loop(env)?;

    // RECV scatter: header → scratch, entry address → scratch (read by the copies above)
    b.recv(Loc::Mem(s + f::REQ_HDR), req::ENTRY_ADDR as u32)?;
    b.recv(Loc::Mem(s + f::ENTRY_ADDR), 8)?;

    b.rearm_tail(env, s + f::JUNK)?;
    let loop_depth = b.layout.ring_depth[Ring::Loop as usize] as u64;
    // Per lap: the Free QP releases everything after the first half (padding included), the
    // closing ENABLE re-enables only the next lap's first half.
    b.layout.steps[release as usize].wqe.operand0 = loop_depth - first_len as u64;
    b.layout.steps[b.closing as usize].wqe.operand0 = first_len as u64;
    b.layout.initial_enable = [first_len, 0];
    Ok(b.layout)
}
