//! The free chain (DESIGN.md §2): return a group to the free queue — but only if the caller
//! owns it, which the NIC proves by invalidating MW\[0\] on the caller's own Free QP (a type-2
//! window bound elsewhere refuses). The step table, with the gated phases and the WQEs per lap,
//! is in docs/CHAINS.md.
//!
//! Five gated phases lie between the request and the push:
//!
//! 1. *WAIT for the RECV*, which has scattered the entry address straight into the entry READ
//!    (through the MWTable-only MR, so an address outside the table faults); then an ENABLE
//!    behind the WAIT releases that READ — a NIC may fetch past an unsatisfied WAIT, never past
//!    an enable limit, and the READ must not be fetched before the scatter landed. Loop READs copy
//!    the address out of that WQE into scratch (the `ENTRY_ADDR` marker) and into the
//!    write-back; FENCEd behind the entry READ, others patch the chunk base into the scrub
//!    WRITE and the rkeys into the Free QP's LOCAL_INV and UNBINDs.
//! 2. *FENCEd ENABLE of the Free QP's ring*: LOCAL_INV of MW\[0\] (the ownership check), the
//!    UNBINDs of the access windows, and an ENABLE of the Loop ring's second half — in one send
//!    queue, so the ENABLE runs only after the invalidations completed (the small fence mlx5
//!    puts after them) and never if the check failed: the Free QP enters the error state, the
//!    ENABLE is flushed, and nothing of the second half ever runs.
//! 3. *The second half*: record that the check passed (the `PASSED` marker, which the MN's
//!    repair trusts instead of the MWTable), scrub the chunk — a WRITE from a chunk of zeros
//!    through the MN-private domain, when the MN plan scrubs on the NIC — increment the key
//!    byte of every rkey with masked fetch-and-adds, clear the owner, write the entry back,
//!    and take a tail slot (the `PUSH_SLOT` marker), copied into the push.
//! 4. *FENCEd self-ENABLE*: the push — a READ of the entry address into the slot, so the
//!    commit's clears, FENCEd behind it, run only once it landed. The commit clears the
//!    markers, the request header and the entry address in the entry READ (a later request
//!    too short to supply one faults instead of freeing this entry again).
//!
//! Nothing is pushed before MW\[0\] is invalidated, so no group whose MW\[0\] is bound ever enters
//! the queue; nothing is pushed before its scrub and write-back completed (the FENCE of
//! phase 4), so the next owner finds the chunk clean and the keys advanced. Only the first
//! WAIT needs a per-lap bump: every other gate is an ENABLE, whose count is relative.

use crate::chain::builder::{fenced, Builder, ChainEnv};
use crate::chain::{ChainError, ChainKind, ChainLayout, Loc, Ring};
use crate::geometry::MAX_GROUP_SIZE;
use crate::wire::memory_map::{free_scratch as f, FREE_SCRATCH_OFF};
use crate::wire::message::free_request as req;
use crate::wire::mwtable::{
    entry_off_rkey, ENTRY_OFF_BASE, ENTRY_OFF_CUR_RKEYS, ENTRY_OFF_OWNER, ENTRY_OFF_PROOF, ENTRY_OFF_RKEYS, ENTRY_SIZE,
    RKEY_PAIR_KEY_BOUNDARY, RKEY_PAIR_KEY_INCREMENT,
};
use crate::wire::wqe::{QueueSel, Wqe, WqeField};

pub fn build_free_chain(env: &ChainEnv) -> Result<ChainLayout, ChainError> {
    let g = env.geometry().group_size();
    let s = env.scratch() + FREE_SCRATCH_OFF;
    let q = env.map.queue;
    let k = env.keys;
    let mut b = Builder::new(ChainKind::Free, env);
    let field = |step, field| Loc::Field { step, field };
    b.lap_head(env)?;

    // ---- phase 1: the request is here; read the entry it names
    b.push(Ring::Loop, Wqe::wait(env.mgmt_qpn, QueueSel::Recv, 1))?;
    // The entry READ is patched by the RECV, and a NIC may fetch past an unsatisfied WAIT: it
    // lies beyond the ring's enable limit until this ENABLE, which executes only behind the
    // WAIT — once the RECV, and so its scatter, completed.
    let open = b.enable_loop(env, false)?;
    let opened = b.layout.ring_len(Ring::Loop) as u64;
    let rd = b.push(Ring::Loop, Wqe::read(s + f::ENTRY, k.meta_lkey, ENTRY_SIZE as u32, 0, k.table_rkey))?;
    // the entry address, out of the READ the request patched: the marker, the write-back
    let marker = b.push(Ring::Loop, Wqe::read(s + f::ENTRY_ADDR, k.meta_lkey, 8, 0, k.ring_rkey))?;
    b.layout.steps[marker as usize].remote = Some(field(rd, WqeField::RemoteAddr));
    let cp_wb = b.push(Ring::Loop, Wqe::read(0, k.ring_lkey, 8, 0, k.ring_rkey))?;
    b.layout.steps[cp_wb as usize].remote = Some(field(rd, WqeField::RemoteAddr));
    let scrub = k.zero_lkey != 0 && k.pool_scrub_rkey != 0;
    // FENCE: after the entry landed. The chunk's base, for the scrub WRITE of the second half.
    let cp_base = if scrub {
        Some(b.push(Ring::Loop, fenced(Wqe::read(0, k.ring_lkey, 8, s + f::ENTRY + ENTRY_OFF_BASE, k.meta_rkey)))?)
    } else {
        None
    };
    let mut copies: heapless::Vec<u8, MAX_GROUP_SIZE> = heapless::Vec::new();
    for i in 0..g {
        let c = Wqe::read(0, k.ring_lkey, 4, s + f::ENTRY + entry_off_rkey(i), k.meta_rkey);
        let c = b.push(Ring::Loop, if i == 0 && !scrub { fenced(c) } else { c })?;
        let pushed = copies.push(c);
        debug_assert!(pushed.is_ok(), "one per window: G <= MAX_GROUP_SIZE (PoolGeometry::new)");
    }
    // the keys the windows hold now become the entry's current keys (the write-back's), before
    // the second half bumps the next ones (after the entry landed: behind the FENCEd copy)
    b.push(
        Ring::Loop,
        Wqe::read(s + f::ENTRY + ENTRY_OFF_CUR_RKEYS, k.meta_lkey, 16, s + f::ENTRY + ENTRY_OFF_RKEYS, k.meta_rkey),
    )?;
    // Binds to the poster: MW[0] is bound to the owner's Alloc QP, where this chain cannot
    // invalidate it with the QPN check. The proof is the owner's key instead: the entry's
    // proof key into the lkey of a READ into this CN's own proof word (after the entry landed:
    // behind the FENCEd copy above), released by a gate (the READ is patched); only the
    // requester's key covers its word — any other owner's, a free entry's 0, a group the MN
    // is taking back — fails the READ with a local protection error, the Loop QP errors and
    // nothing behind it runs. FENCEd behind it, the Free QP's ring unbinds every window.
    let proof = match env.owner_proof {
        Some(p) if env.variant.binds_to_poster => Some(p),
        Some(_) => None,
        None if env.variant.binds_to_poster => return Err(ChainError::NoOwnerProof),
        None => None,
    };
    let mut proof_gate = None;
    if let Some(p) = proof {
        let cp = b.push(Ring::Loop, Wqe::read(0, k.ring_lkey, 4, s + f::ENTRY + ENTRY_OFF_PROOF, k.meta_rkey))?;
        let gate = b.gate_loop(env)?;
        let gated_from = b.layout.ring_len(Ring::Loop) as u64;
        let read = b.push(Ring::Loop, Wqe::read(p.addr, 0, 8, s + f::ZERO, k.meta_rkey))?;
        b.set_local(cp, field(read, WqeField::Lkey));
        b.layout.ownership_check = Some(read);
        proof_gate = Some((gate, gated_from));
    }
    let release_mgmt = b.push(Ring::Loop, fenced(Wqe::enable(env.mgmt_qpn, QueueSel::Send, 0)))?;
    let first_half = b.layout.ring_len(Ring::Loop) as u64;

    // ---- phase 2, the Free QP's ring: the ownership check (paper binds), the unbinds, release
    // the second half
    let unchecked = if proof.is_some() {
        &copies[..]
    } else {
        let inv = b.push(Ring::Mgmt, Wqe::local_inv(0))?;
        b.set_local(copies[0], field(inv, WqeField::Imm));
        b.layout.ownership_check = Some(inv);
        &copies[1..]
    };
    for c in unchecked.iter().copied() {
        let u = b.push(Ring::Mgmt, Wqe::unbind_mw(0))?;
        b.set_local(c, field(u, WqeField::Imm));
    }
    let release = b.push(Ring::Mgmt, Wqe::enable(env.loop_qpn, QueueSel::Send, 0))?;

    // ---- phase 3, Loop: the ownership check passed
    b.push(Ring::Loop, Wqe::read(s + f::PASSED, k.meta_lkey, 8, s + f::ENTRY_ADDR, k.meta_rkey))?;
    if let Some(cp) = cp_base {
        // no window reaches the chunk any more: clear what its owner left, before anyone
        // can pop it again
        let chunk = env.geometry().chunk_size() as u32;
        let w = b.push(Ring::Loop, Wqe::write(k.zero_addr, k.zero_lkey, chunk, 0, k.pool_scrub_rkey))?;
        b.set_local(cp, field(w, WqeField::RemoteAddr));
    }
    for pair in 0..g.div_ceil(2) {
        b.push(
            Ring::Loop,
            Wqe::masked_fetch_add(
                s + f::JUNK,
                k.meta_lkey,
                s + f::ENTRY + entry_off_rkey(2 * pair),
                k.meta_rkey,
                RKEY_PAIR_KEY_INCREMENT,
                RKEY_PAIR_KEY_BOUNDARY,
            ),
        )?;
    }
    // owner 0 — and its proof key 0, where the entry holds one (a READ of zeros, so the
    // write-back's FENCE covers it)
    let owner_len = if proof.is_some() { 8 } else { 4 };
    const _: () = assert!(ENTRY_OFF_PROOF == ENTRY_OFF_OWNER + 4);
    b.push(Ring::Loop, Wqe::read(s + f::ENTRY + ENTRY_OFF_OWNER, k.meta_lkey, owner_len, s + f::ZERO, k.meta_rkey))?;
    // FENCE: after the key bumps and the owner clear landed
    let wb = b.push(Ring::Loop, fenced(Wqe::write(s + f::ENTRY, k.meta_lkey, ENTRY_SIZE as u32, 0, k.table_rkey)))?;
    b.set_local(cp_wb, field(wb, WqeField::RemoteAddr));
    // the tail's slot: after the write-back in order (the MN's repair relies on it)
    b.push(
        Ring::Loop,
        Wqe::masked_fetch_add(s + f::PUSH_SLOT, k.meta_lkey, q.tail, k.meta_rkey, 8, q.counter_boundary()),
    )?;
    let cp_push = b.push(Ring::Loop, fenced(Wqe::read(0, k.ring_lkey, 8, s + f::PUSH_SLOT, k.meta_rkey)))?;
    // FENCE: the copy completed, and with it (in order) the scrub and the write-back
    let gate = b.gate_loop(env)?;
    let second_end = b.layout.ring_len(Ring::Loop) as u64;

    // ---- phase 4: push the entry address into the slot
    let push = b.push(Ring::Loop, Wqe::read(0, k.meta_lkey, 8, s + f::ENTRY_ADDR, k.meta_rkey))?;
    b.set_local(cp_push, field(push, WqeField::LocalAddr));
    b.layout.critical_end = Some(push);
    // commit: clear the markers (a failure with them set means "this lap may be half done")
    // and the request header (a later short request must not be answered with this token) —
    // FENCEd, so only once the push landed
    const _: () = assert!(f::REQ_HDR + 8 == f::ENTRY_ADDR && f::ENTRY_ADDR + 8 == f::PASSED);
    const _: () = assert!(f::PASSED + 8 == f::PUSH_SLOT && f::PUSH_SLOT + 8 == f::REQ_HDR + f::MARKERS_LEN as u64);
    b.push(Ring::Loop, fenced(Wqe::write(s + f::ZERO, k.meta_lkey, f::MARKERS_LEN, s + f::REQ_HDR, k.meta_rkey)))?;
    // and the entry address the request put into the entry READ: a later request too short to
    // bring its own must fault there, not free this entry again
    let clear_rd = b.push(Ring::Loop, Wqe::write(s + f::ZERO, k.meta_lkey, 8, 0, k.ring_rkey))?;
    b.layout.steps[clear_rd as usize].remote = Some(field(rd, WqeField::RemoteAddr));

    // RECV scatter: header → scratch, entry address → the entry READ
    b.recv(Loc::Mem(s + f::REQ_HDR), req::ENTRY_ADDR as u32)?;
    b.recv(field(rd, WqeField::RemoteAddr), 8)?;

    b.lap_tail(env)?;
    let [loop_depth, mgmt_depth] = b.layout.ring_depth.map(u64::from);
    // Per lap: the Free QP ring runs once round (padding too); it releases the second half,
    // the gate the push phase; the push phase's length covers the commit, the tail and the
    // Loop ring's padding; the closing ENABLE re-enables only the next lap's first phase.
    b.set_count(release_mgmt, mgmt_depth);
    b.set_count(release, second_end - first_half);
    b.set_count(gate, loop_depth - second_end);
    match proof_gate {
        Some((gate, from)) => {
            b.set_count(open, from - opened);
            b.set_count(gate, first_half - from);
        }
        None => b.set_count(open, first_half - opened),
    }
    let closing = b.closing;
    b.set_count(closing, opened);
    b.layout.initial_enable = [opened as u16, 0];
    b.settle_relays();
    Ok(b.layout)
}
