//! The MWTable: one entry per MW group, in MN memory, read and written by the chains.
//!
//! The entry is the unit a chain moves around: the alloc chain READs it whole into the reply
//! staging area and scatters its fields into the BIND WQEs, the free chain READs it, bumps the
//! key bytes with one masked fetch-and-add per pair of rkeys, and writes it back. Its field
//! order is chosen so that `base, length, lkey` is one 16-byte span matching the BIND WQE's
//! `local_addr, length, lkey` span — one READ patches all three.
//!
//! ```text
//! off len field   (little-endian)
//!   0  8  base    chunk start address
//!   8  4  length  chunk length (= the geometry's chunk size)
//!  12  4  lkey    the MR the group's windows are bound in (pool MR, or the chunk's own MR)
//!  16 16  rkeys   rkey of MW[0..4): the key each window has while bound, and will get on
//!                 the next bind while free (the free chain increments the key byte)
//!  32 16  cur_rkeys the key each window holds on the device while free — the key a bind
//!                 names as the window's current one (rdma-core's `ctrl->imm = mw->rkey`,
//!                 providers/mlx5/qp.c); `rkeys[i]`'s predecessor (`Rkey::prev_key`)
//!  48  4  owner   CnId of the owner, 0 = free
//!  52  4  reserved zero while free; while owned, the owner's proof key under binds to the
//!                 poster (`chain::variant`, `OwnerProof`), zero otherwise; ENTRY_RECLAIMING
//!                 while the MN takes the group back
//! ```
//! The current keys sit before the owner so that one READ short of the owner brings a chain
//! everything it binds with (the alloc chain's entry READ into the reply image, whose owner
//! field names the requester). They are dead keys once the windows are bound again, so the
//! reply may carry them. MN metadata per chunk: 56 B entry + 8 B free-queue slot = **64 B**
//! for every G ≤ 4; the stride keeps every entry — and so every pair of rkeys a masked
//! fetch-and-add bumps — 8-byte aligned.

use crate::geometry::MAX_GROUP_SIZE;
use crate::ids::Rkey;
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const ENTRY_SIZE: usize = 56;
pub const ENTRY_OFF_BASE: u64 = 0;
pub const ENTRY_OFF_LENGTH: u64 = 8;
pub const ENTRY_OFF_LKEY: u64 = 12;
pub const ENTRY_OFF_RKEYS: u64 = 16;
pub const ENTRY_OFF_CUR_RKEYS: u64 = 32;
pub const ENTRY_OFF_OWNER: u64 = 48;
/// The owner's proof key while owned under binds to the poster (`MwTableEntry::reserved`).
pub const ENTRY_OFF_PROOF: u64 = 52;
/// Bytes of one rkey in the entry.
pub const RKEY_SIZE: u64 = 4;

/// Where the rkey of window `i` of the group lies in the entry (rkey pairs, which one masked fetch-and-add
/// bumps, start at even `i`).
pub const fn entry_off_rkey(i: usize) -> u64 {
    ENTRY_OFF_RKEYS + RKEY_SIZE * i as u64
}
/// Where the current key of window `i` lies in the entry.
pub const fn entry_off_cur_rkey(i: usize) -> u64 {
    ENTRY_OFF_CUR_RKEYS + RKEY_SIZE * i as u64
}
/// Bytes of MN metadata per chunk (entry + queue slot).
pub const METADATA_BYTES_PER_CHUNK: usize = ENTRY_SIZE + crate::wire::free_queue::SLOT_SIZE;

/// Field-boundary mask for a masked fetch-and-add on a word holding two rkeys: the key bytes
/// (bits 0–7, 32–39) wrap in place and never carry into the 24-bit indexes.
pub const RKEY_PAIR_KEY_BOUNDARY: u64 = (1 << 7) | (1 << 31) | (1 << 39) | (1 << 63);
pub const RKEY_PAIR_KEY_INCREMENT: u64 = 1 | (1 << 32);

#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct MwTableEntry {
    pub base: U64,
    pub length: U32,
    pub lkey: U32,
    pub rkeys: [U32; MAX_GROUP_SIZE],
    pub cur_rkeys: [U32; MAX_GROUP_SIZE],
    pub owner: U32,
    pub reserved: U32,
}

const _: () = assert!(core::mem::size_of::<MwTableEntry>() == ENTRY_SIZE);
const _: () = assert!(core::mem::offset_of!(MwTableEntry, base) as u64 == ENTRY_OFF_BASE);
const _: () = assert!(core::mem::offset_of!(MwTableEntry, length) as u64 == ENTRY_OFF_LENGTH);
const _: () = assert!(core::mem::offset_of!(MwTableEntry, lkey) as u64 == ENTRY_OFF_LKEY);
const _: () = assert!(core::mem::offset_of!(MwTableEntry, rkeys) as u64 == ENTRY_OFF_RKEYS);
const _: () = assert!(core::mem::offset_of!(MwTableEntry, owner) as u64 == ENTRY_OFF_OWNER);
const _: () = assert!(core::mem::offset_of!(MwTableEntry, reserved) as u64 == ENTRY_OFF_PROOF);
const _: () = assert!(core::mem::offset_of!(MwTableEntry, cur_rkeys) as u64 == ENTRY_OFF_CUR_RKEYS);
const _: () = assert!(entry_off_rkey(MAX_GROUP_SIZE) == ENTRY_OFF_CUR_RKEYS);
const _: () = assert!(entry_off_cur_rkey(MAX_GROUP_SIZE) == ENTRY_OFF_OWNER);
const _: () = assert!(ENTRY_SIZE.is_multiple_of(8));
const _: () = assert!(METADATA_BYTES_PER_CHUNK == 64);

impl MwTableEntry {
    /// A free group's entry: each window will be bound under `rkeys[i]` and holds its
    /// predecessor now (omw advances every window's key by one per rebind, `ibv_inc_rkey`).
    pub fn new(base: u64, length: u32, lkey: u32, rkeys: &[Rkey]) -> Self {
        let mut e =
            MwTableEntry { base: U64::new(base), length: U32::new(length), lkey: U32::new(lkey), ..Default::default() };
        for ((slot, cur), r) in e.rkeys.iter_mut().zip(e.cur_rkeys.iter_mut()).zip(rkeys) {
            *slot = U32::new(r.0);
            *cur = U32::new(r.prev_key().0);
        }
        e
    }
    /// The key window `i` holds on the device while the group is free.
    pub fn cur_rkey(&self, i: usize) -> Rkey {
        Rkey(self.cur_rkeys.get(i).map(|r| r.get()).unwrap_or(0))
    }
    /// Window `i` was bound again under `rkey` (its current key `prev`): the table follows.
    pub fn set_rkey(&mut self, i: usize, rkey: Rkey) {
        if let (Some(r), Some(c)) = (self.rkeys.get_mut(i), self.cur_rkeys.get_mut(i)) {
            *r = U32::new(rkey.0);
            *c = U32::new(rkey.prev_key().0);
        }
    }
    pub fn rkey(&self, i: usize) -> Rkey {
        Rkey(self.rkeys.get(i).map(|r| r.get()).unwrap_or(0))
    }
    pub fn owner(&self) -> u32 {
        self.owner.get()
    }
    /// What the free chain does to the keys once the windows are invalidated: the key each
    /// had becomes its current one, the next bind's is its successor.
    pub fn bump_keys(&mut self) {
        for (r, c) in self.rkeys.iter_mut().zip(self.cur_rkeys.iter_mut()) {
            *c = *r;
            *r = U32::new(Rkey(r.get()).next_key().0);
        }
    }
    /// Decode untrusted bytes: `None` when fewer than [`ENTRY_SIZE`].
    pub fn read(bytes: &[u8]) -> Option<Self> {
        Self::read_from_prefix(bytes).ok().map(|(e, _)| e)
    }
    /// An entry from exactly its bytes (every bit pattern is an entry: nothing can fail).
    pub fn from_bytes(bytes: [u8; ENTRY_SIZE]) -> Self {
        zerocopy::transmute!(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::wqe::masked_add;

    #[test]
    fn layout_offsets() {
        let e = MwTableEntry::new(0x1000, 4096, 7, &[Rkey(0x100), Rkey(0x2FF)]);
        let b = e.as_bytes();
        assert_eq!(&b[0..8], &0x1000u64.to_le_bytes());
        assert_eq!(&b[8..12], &4096u32.to_le_bytes());
        assert_eq!(&b[12..16], &7u32.to_le_bytes());
        assert_eq!(&b[16..20], &0x100u32.to_le_bytes());
        assert_eq!(&b[20..24], &0x2FFu32.to_le_bytes());
        assert_eq!(&b[32..36], &0x1FFu32.to_le_bytes(), "window 0 holds the key before its next");
        assert_eq!(ENTRY_OFF_OWNER, 48);
        assert_eq!(MwTableEntry::read(b), Some(e));
        assert_eq!(MwTableEntry::read(&b[..ENTRY_SIZE - 1]), None);
        let mut a = [0u8; ENTRY_SIZE];
        a.copy_from_slice(b);
        assert_eq!(MwTableEntry::from_bytes(a), e);
        assert_eq!(entry_off_rkey(1), 20);
    }

    #[test]
    fn masked_faa_on_entry_equals_bump_keys() {
        let mut e = MwTableEntry::new(0, 512, 1, &[Rkey(0x1_00FF), Rkey(0x2_0010), Rkey(0x3_00FE), Rkey(0x4_0000)]);
        let mut bytes = [0u8; ENTRY_SIZE];
        bytes.copy_from_slice(e.as_bytes());
        // the free chain copies the keys to the current ones, then bumps them
        bytes.copy_within(16..32, ENTRY_OFF_CUR_RKEYS as usize);
        for off in [16usize, 24] {
            let w = u64::from_le_bytes(bytes[off..off + 8].try_into().unwrap());
            let n = masked_add(w, RKEY_PAIR_KEY_INCREMENT, RKEY_PAIR_KEY_BOUNDARY);
            bytes[off..off + 8].copy_from_slice(&n.to_le_bytes());
        }
        e.bump_keys();
        assert_eq!(MwTableEntry::read(&bytes), Some(e));
        assert_eq!(e.rkey(0), Rkey(0x1_0000));
        assert_eq!(e.rkey(1), Rkey(0x2_0011));
        assert_eq!((e.cur_rkey(0), e.cur_rkey(1)), (Rkey(0x1_00FF), Rkey(0x2_0010)));
    }
}
