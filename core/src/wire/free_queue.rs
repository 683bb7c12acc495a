//! The free MW queue: a ring of MWTable-entry addresses in MN memory.
//!
//! Pop is a fetch-and-add on `head`, push a fetch-and-add on `tail`, both issued by the NIC.
//! The counters hold **slot addresses**, not indexes, so an atomic's result can be patched
//! directly into the next READ's remote address; the ring is aligned to its own size so a
//! masked fetch-and-add (carry boundary at the top index bit) wraps the address in place. A popped
//! slot is zeroed, so popping an empty queue yields 0 and the following READ of address 0 fails —
//! the hardware's way of noticing "empty".
//!
//! ```text
//! ring:  capacity × u64 slot (entry address, 0 = empty), aligned to capacity × 8
//! head:  u64  address of the next slot to pop
//! tail:  u64  address of the next slot to push
//! ```

use crate::wire::wqe::masked_add;

pub const SLOT_SIZE: usize = 8;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct FreeQueueLayout {
    /// Address of slot 0; aligned to `capacity * 8`.
    pub ring: u64,
    /// Number of slots, a power of two ≥ the number of groups.
    pub capacity: u32,
    pub head: u64,
    pub tail: u64,
}

impl FreeQueueLayout {
    pub const fn ring_bytes(&self) -> u64 {
        self.capacity as u64 * SLOT_SIZE as u64
    }
    /// Field-boundary mask for the counters' masked fetch-and-add: the slot offset bits wrap.
    pub const fn counter_boundary(&self) -> u64 {
        1u64 << (self.ring_bytes().trailing_zeros() - 1)
    }
    pub const fn slot_addr(&self, index: u32) -> u64 {
        self.ring + (index as u64 % self.capacity as u64) * SLOT_SIZE as u64
    }
    pub const fn contains_slot(&self, addr: u64) -> bool {
        addr >= self.ring && addr < self.ring + self.ring_bytes() && (addr - self.ring).is_multiple_of(8)
    }
    /// Slot index of a counter value.
    pub const fn index_of(&self, counter: u64) -> u32 {
        ((counter - self.ring) / SLOT_SIZE as u64) as u32
    }
    /// Occupancy given the counters, when pops of an empty queue may have carried the head up
    /// to `max_ahead` slots past the tail (each such pop holds a ticket the MN settles).
    pub const fn live_len(&self, head: u64, tail: u64, max_ahead: u32) -> u32 {
        let cap = self.capacity as u64;
        let h = (head.wrapping_sub(self.ring) / 8) % cap;
        let t = (tail.wrapping_sub(self.ring) / 8) % cap;
        let ahead = (h + cap - t) % cap;
        if ahead != 0 && ahead <= max_ahead as u64 {
            0
        } else {
            ((t + cap - h) % cap) as u32
        }
    }
    /// Occupancy given the counters (both wrap in place, so the distance is modulo the ring).
    pub const fn len(&self, head: u64, tail: u64) -> u32 {
        let cap = self.capacity as u64;
        let h = (head.wrapping_sub(self.ring) / 8) % cap;
        let t = (tail.wrapping_sub(self.ring) / 8) % cap;
        ((t + cap - h) % cap) as u32
    }
    /// The counter value one slot on from `counter`: the same masked add the NIC's fetch-and-adds
    /// make, so the CPU's walks wrap exactly where the chains' counters do.
    pub const fn next(&self, counter: u64) -> u64 {
        masked_add(counter, SLOT_SIZE as u64, self.counter_boundary())
    }
    /// `n` consecutive slot addresses from counter `from` on, wrapping (a live window is
    /// `walk(head, len)`, the rest of the ring `walk(tail, capacity - len)`).
    pub fn walk(&self, from: u64, n: u32) -> impl Iterator<Item = u64> {
        let q = *self;
        (0..n).scan(from, move |at, _| {
            let slot = *at;
            *at = q.next(slot);
            Some(slot)
        })
    }
    /// `(address, addend, boundary)` of the fetch-and-add that takes the tail slot for a push —
    /// the MN CPU's own pushes issue it as a NIC atomic, as the free chain's does.
    pub const fn push_fetch_add(&self) -> (u64, u64, u64) {
        (self.tail, SLOT_SIZE as u64, self.counter_boundary())
    }
    /// Every slot address, in ring order.
    pub fn slots(&self) -> impl Iterator<Item = u64> {
        let q = *self;
        (0..q.capacity).map(move |i| q.slot_addr(i))
    }
    /// The `(address, value)` stores that make a full queue of `count` groups over a ring whose
    /// other slots are already zero: slot `i` holds `entry(i)`, the head is slot 0 and the tail
    /// the slot after the last group.
    pub fn fill(&self, count: u32, entry: impl Fn(u32) -> u64) -> impl Iterator<Item = (u64, u64)> {
        let q = *self;
        (0..count).map(move |i| (q.slot_addr(i), entry(i))).chain([(q.head, q.ring), (q.tail, q.slot_addr(count))])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::wqe::masked_add;

    #[test]
    fn counters_wrap_in_place() {
        let q = FreeQueueLayout { ring: 0x1_0000, capacity: 16, head: 0x2_0000, tail: 0x2_0008 };
        assert_eq!(q.ring_bytes(), 128);
        assert_eq!(q.counter_boundary(), 1 << 6);
        let mut c = q.slot_addr(15);
        c = masked_add(c, 8, q.counter_boundary());
        assert_eq!(c, q.ring);
        // and a "minus one slot" (add 2^7 − 8) steps back, wrapping too
        let back = masked_add(q.ring, 128 - 8, q.counter_boundary());
        assert_eq!(back, q.slot_addr(15));
        assert!(q.contains_slot(q.slot_addr(3)));
        assert!(!q.contains_slot(q.slot_addr(3) + 1));
        assert!(!q.contains_slot(q.ring + 128));
        assert_eq!(q.len(q.slot_addr(14), q.slot_addr(2)), 4);
        assert_eq!(q.len(q.slot_addr(2), q.slot_addr(2)), 0);
        // head two past the tail (two tickets): empty, not "capacity − 2"
        assert_eq!(q.live_len(q.slot_addr(4), q.slot_addr(2), 3), 0);
        assert_eq!(q.live_len(q.slot_addr(2), q.slot_addr(4), 3), 2);
    }

    #[test]
    fn walks_pushes_and_fills_wrap_with_the_counters() {
        let q = FreeQueueLayout { ring: 0x1_0000, capacity: 4, head: 0x2_0000, tail: 0x2_0008 };
        assert_eq!(q.next(q.slot_addr(3)), q.ring);
        let w: heapless::Vec<u64, 4> = q.walk(q.slot_addr(2), 3).collect();
        assert_eq!(&w[..], &[q.slot_addr(2), q.slot_addr(3), q.slot_addr(0)]);
        assert_eq!(q.walk(q.ring, 0).count(), 0);
        assert_eq!(q.push_fetch_add(), (q.tail, 8, q.counter_boundary()));
        let s: heapless::Vec<u64, 4> = q.slots().collect();
        assert_eq!(&s[..], &[q.ring, q.ring + 8, q.ring + 16, q.ring + 24]);
        let f: heapless::Vec<(u64, u64), 8> = q.fill(3, |i| 0x100 * (i as u64 + 1)).collect();
        assert_eq!(
            &f[..],
            &[(q.ring, 0x100), (q.ring + 8, 0x200), (q.ring + 16, 0x300), (q.head, q.ring), (q.tail, q.slot_addr(3))]
        );
        // a full ring: the tail wraps onto the head
        let last = q.fill(4, |_| 1).last();
        assert_eq!(last, Some((q.tail, q.ring)));
        assert_eq!(q.len(q.ring, q.ring), 0);
    }
}
