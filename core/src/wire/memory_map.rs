//! Where the MN's protocol state lies in its memory: the free queue, the MWTable and each
//! CN's chain scratch areas. One computed map, so the chain builders, the host engine, the
//! invariant checker and every backend agree on every address.
//!
//! ```text
//! meta_base (aligned to the ring size)
//!   free-queue ring      capacity × 8 B
//!   head, tail           2 × 8 B
//!   MWTable              chunk_count × 56 B      ← its own MR: the free chain reads entries
//!                                                  through it, so a forged entry address
//!                                                  outside the table faults
//!   scratch              max_cns × 2 KiB         (alloc chain 256 B, free chain 256 B,
//!                                                  host-mode request buffers, the mlx5
//!                                                  form's lap counters, send buffers)
//! ```
//!
//! `max_cns` here counts scratch areas: an MN whose CNs have K alloc chains each is mapped with
//! `max_cns × K` of them (`MemoryNode::scratch_slots`), chain j of the CN in slot s using area
//! `s + j × max_cns` — which also gives the free queue's ring room for one ticket per chain.

use crate::geometry::PoolGeometry;
use crate::ids::GroupId;
use crate::wire::free_queue::{FreeQueueLayout, SLOT_SIZE};
use crate::wire::mwtable::ENTRY_SIZE;

pub const SCRATCH_PER_CN: u64 = 2048;
pub const ALLOC_SCRATCH_OFF: u64 = 0;
pub const FREE_SCRATCH_OFF: u64 = 256;
/// Host-engine mode: where the plain RECVs on the Alloc and Free QPs land (64 B each).
pub const ALLOC_REQUEST_BUF_OFF: u64 = 512;
pub const FREE_REQUEST_BUF_OFF: u64 = 576;
pub const REQUEST_BUF_LEN: u32 = 64;
/// Messages the MN sends the CN (notices, errors, connect info): a ring of 8 × 64 B, so a
/// buffer is reused only after seven later messages.
pub const SEND_BUF_OFF: u64 = 1024;
/// Per chain, the little-endian lap counters of the mlx5 form (`mlx5::chain`): one 8-byte word
/// per WAIT and ENABLE, advanced by a fetch-and-add each lap and copied, byte-reversed, into
/// the big-endian WQE field. Alloc chain first, then the free chain.
pub const MLX5_SHADOW_OFF: [u64; 2] = [640, 832];
pub const MLX5_SHADOW_LEN: u64 = 192;
pub const SEND_BUF_COUNT: u64 = 8;
pub const SEND_BUF_LEN: u64 = 64;
/// The MN CPU's own scratch (after every CN's): where the results of the atomics it issues
/// through the NIC land (its pushes onto the free queue must be NIC atomics: a CPU
/// read-modify-write of the tail is not atomic with respect to the chains' fetch-and-adds).
pub const MN_SCRATCH_LEN: u64 = 64;

/// Offsets inside the alloc chain's scratch area.
pub mod alloc_scratch {
    use crate::wire::message::alloc_reply;
    use crate::wire::mwtable::ENTRY_OFF_OWNER;
    /// Result of the FAA on the queue head: the popped slot's address. Cleared when a lap
    /// commits, so after a failure non-zero means "this lap took a ticket".
    pub const SLOT_ADDR: u64 = 0;
    /// Landing place for the request header (magic, version, kind, token). Next to
    /// `SLOT_ADDR`: the commit clears both with one WRITE.
    pub const REQ_HDR: u64 = 8;
    /// Sixteen zero bytes: what the commit's clears (markers, request header, the reply WQE's
    /// address and rkey) and the reply image's lkey are overwritten with.
    pub const ZEROS16: u64 = 16;
    /// The reply image, 72 B: header, entry address, entry.
    pub const REPLY: u64 = 32;
    /// The popped entry's address; cleared when a lap commits (the reply was delivered), so
    /// after a failure non-zero means "this lap popped a group the CN never got".
    pub const REPLY_ENTRY_ADDR: u64 = REPLY + alloc_reply::ENTRY_ADDR as u64;
    pub const REPLY_ENTRY: u64 = REPLY + alloc_reply::ENTRY as u64;
    /// The CN's id (u32): the reply image's owner field itself. The MN writes it when the CN
    /// connects; the chain's entry READ stops short of it, so the image — and the entry
    /// written back from it — always name the requester.
    pub const OWNER: u64 = REPLY_ENTRY + ENTRY_OFF_OWNER;
    /// Destination of fetch-and-add results nobody reads (lap re-arm bumps).
    pub const JUNK: u64 = 104;
    /// Binds to the poster (`ChainVariant::binds_to_poster`): the popped entry's address plus
    /// the owner's offset — where the serve phase's stamp lands (the chain computes it with a
    /// fetch-and-add; a WQE field cannot take an address plus an offset otherwise).
    pub const STAMP_ADDR: u64 = 112;
    /// The stamp: the CN's id and its proof key (u32 each, the entry's `owner` and `reserved`),
    /// written by the MN when the CN connects. The serve phase writes it over the entry once
    /// the request is here, so a group popped ahead is owned but not yet stamped: no free can
    /// prove ownership of a group whose windows are not being bound.
    pub const STAMP: u64 = 120;
    pub const END: u64 = 128;
}

/// Offsets inside the free chain's scratch area.
pub mod free_scratch {
    pub const REQ_HDR: u64 = 0;
    /// Entry address from the request (copied out of the entry READ the RECV patched); cleared
    /// when a lap commits (the push landed).
    pub const ENTRY_ADDR: u64 = 8;
    /// Set (to the entry address) by the first step of the second half — which runs only once
    /// MW\[0\] was invalidated on the requester's own Free QP — and cleared at commit: after a
    /// failure, non-zero means "this lap proved ownership", whatever the MWTable says. The MN's
    /// repair decides from this lap's own markers alone, never from state another lap (e.g. a
    /// victim's alloc lap half-way through the same entry) may be changing.
    pub const PASSED: u64 = 16;
    /// Result of the FAA on the queue tail: the slot this lap pushes into.
    pub const PUSH_SLOT: u64 = 24;
    /// Request header and markers are adjacent: the commit clears them with one WRITE.
    pub const MARKERS_LEN: u32 = 32;
    pub const ENTRY: u64 = 32;
    /// [`MARKERS_LEN`] zero bytes.
    pub const ZERO: u64 = 88;
    pub const JUNK: u64 = 120;
    pub const END: u64 = 128;
}

const _: () = assert!(alloc_scratch::REPLY + crate::wire::message::ALLOC_REPLY_LEN as u64 <= alloc_scratch::JUNK);
const _: () = assert!(free_scratch::ENTRY + crate::wire::mwtable::ENTRY_SIZE as u64 <= free_scratch::ZERO);
const _: () = assert!(free_scratch::ZERO + free_scratch::MARKERS_LEN as u64 <= free_scratch::JUNK);
const _: () = assert!(SEND_BUF_LEN as usize >= crate::wire::message::MAX_MESSAGE_LEN);
const _: () = assert!(alloc_scratch::END <= FREE_SCRATCH_OFF);
const _: () = assert!(FREE_SCRATCH_OFF + free_scratch::END <= ALLOC_REQUEST_BUF_OFF);
const _: () = assert!(FREE_REQUEST_BUF_OFF + REQUEST_BUF_LEN as u64 <= SEND_BUF_OFF);
const _: () = assert!(FREE_REQUEST_BUF_OFF + REQUEST_BUF_LEN as u64 <= MLX5_SHADOW_OFF[0]);
const _: () = assert!(MLX5_SHADOW_OFF[0] + MLX5_SHADOW_LEN <= MLX5_SHADOW_OFF[1]);
const _: () = assert!(MLX5_SHADOW_OFF[1] + MLX5_SHADOW_LEN <= SEND_BUF_OFF);
const _: () = assert!(SEND_BUF_OFF + SEND_BUF_COUNT * SEND_BUF_LEN <= SCRATCH_PER_CN);

/// Keys of the MN's own registrations ([`crate::mn::plan::MnPlan::register_metadata`] makes
/// them). The first five are the loop QPs' (the MN-private domain when offloading; local-only
/// CN-facing registrations in host-engine mode, checked in software by the engine).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct MnKeys {
    pub meta_lkey: u32,
    pub meta_rkey: u32,
    pub table_rkey: u32,
    pub ring_lkey: u32,
    pub ring_rkey: u32,
    /// Local-only registrations in the CN-facing domain: what WQEs on CN-facing QPs (the
    /// reply WRITE, messages) and receives posted there (request scatter) use.
    pub cn_meta_lkey: u32,
    pub cn_ring_lkey: u32,
    /// Offloaded scrubbing: the pool's private-domain rkey (remote write for the loop QP) and
    /// a chunk of zeros (0: the free chain does not scrub).
    pub pool_scrub_rkey: u32,
    pub zero_addr: u64,
    pub zero_lkey: u32,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MnMemoryMap {
    pub geometry: PoolGeometry,
    pub max_cns: u32,
    pub meta_base: u64,
    pub queue: FreeQueueLayout,
    pub table_base: u64,
    pub scratch_base: u64,
    /// [`MN_SCRATCH_LEN`] bytes for the MN CPU's NIC atomics.
    pub mn_scratch: u64,
    pub meta_len: u64,
}

impl MnMemoryMap {
    /// Alignment the metadata region needs (the ring is aligned to its own size).
    pub fn required_alignment(geometry: &PoolGeometry, max_cns: u32) -> u64 {
        Self::ring_capacity(geometry, max_cns) as u64 * SLOT_SIZE as u64
    }
    /// Room for every group, plus one outstanding "ticket" per CN (a pop that found the queue
    /// empty advances the head past the tail until the MN settles it), plus one so a full
    /// queue is distinguishable from an empty one; rounded up to a power of two.
    pub fn ring_capacity(geometry: &PoolGeometry, max_cns: u32) -> u32 {
        (geometry.chunk_count() + max_cns + 1).next_power_of_two()
    }
    pub fn len_for(geometry: &PoolGeometry, max_cns: u32) -> u64 {
        let ring = Self::required_alignment(geometry, max_cns);
        ring + 16 + geometry.chunk_count() as u64 * ENTRY_SIZE as u64 + max_cns as u64 * SCRATCH_PER_CN + MN_SCRATCH_LEN
    }

    /// `meta_base` must be aligned to [`Self::required_alignment`]; returns None otherwise.
    pub fn new(geometry: PoolGeometry, max_cns: u32, meta_base: u64) -> Option<Self> {
        let ring_bytes = Self::required_alignment(&geometry, max_cns);
        if meta_base == 0 || !meta_base.is_multiple_of(ring_bytes) {
            return None;
        }
        let head = meta_base + ring_bytes;
        let tail = head + 8;
        let table_base = tail + 8;
        let scratch_base = table_base + geometry.chunk_count() as u64 * ENTRY_SIZE as u64;
        let meta_len = Self::len_for(&geometry, max_cns);
        meta_base.checked_add(meta_len)?;
        Some(MnMemoryMap {
            geometry,
            max_cns,
            meta_base,
            queue: FreeQueueLayout { ring: meta_base, capacity: Self::ring_capacity(&geometry, max_cns), head, tail },
            table_base,
            scratch_base,
            mn_scratch: scratch_base + max_cns as u64 * SCRATCH_PER_CN,
            meta_len,
        })
    }
    pub fn table_len(&self) -> u64 {
        self.geometry.chunk_count() as u64 * ENTRY_SIZE as u64
    }
    pub fn entry_addr(&self, g: GroupId) -> Option<u64> {
        (g.0 < self.geometry.chunk_count()).then(|| self.table_base + g.0 as u64 * ENTRY_SIZE as u64)
    }
    /// The group whose entry starts exactly at `addr` (an entry address from the network).
    pub fn group_of_entry(&self, addr: u64) -> Option<GroupId> {
        if addr < self.table_base || addr >= self.table_base + self.table_len() {
            return None;
        }
        let off = addr - self.table_base;
        off.is_multiple_of(ENTRY_SIZE as u64).then(|| GroupId((off / ENTRY_SIZE as u64) as u32))
    }
    /// Scratch area of the CN in connection slot `slot` (0-based).
    pub fn scratch(&self, slot: u32) -> Option<u64> {
        (slot < self.max_cns).then(|| self.scratch_base + slot as u64 * SCRATCH_PER_CN)
    }
    pub fn offset(&self, addr: u64) -> Option<usize> {
        (addr >= self.meta_base && addr < self.meta_base + self.meta_len).then(|| (addr - self.meta_base) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn map_is_disjoint_and_aligned() {
        let g = PoolGeometry::new(1 << 20, 4096, 100, 3).unwrap();
        assert_eq!(MnMemoryMap::ring_capacity(&g, 4), 128);
        assert_eq!(MnMemoryMap::ring_capacity(&g, 40), 256);
        assert!(MnMemoryMap::new(g, 4, 0x1200).is_none()); // not aligned to 1 KiB ring
        let m = MnMemoryMap::new(g, 4, 0x10_0000).unwrap();
        assert_eq!(m.queue.head, 0x10_0000 + 1024);
        assert_eq!(m.table_base, m.queue.tail + 8);
        assert_eq!(m.entry_addr(GroupId(1)), Some(m.table_base + 56));
        assert_eq!(m.group_of_entry(m.table_base + 112), Some(GroupId(2)));
        assert_eq!(m.group_of_entry(m.table_base + 113), None);
        assert_eq!(m.group_of_entry(m.scratch_base), None);
        assert_eq!(m.scratch(3), Some(m.scratch_base + 3 * SCRATCH_PER_CN));
        assert_eq!(m.scratch(4), None);
        assert_eq!(m.meta_len, 1024 + 16 + 5600 + 4 * SCRATCH_PER_CN + MN_SCRATCH_LEN);
        assert_eq!(m.mn_scratch + MN_SCRATCH_LEN, m.meta_base + m.meta_len);
    }
}
