//! One host's NIC as timed resources: its processing units (each with a send side and a
//! responder side, busy-until), the host's link, and the same-address atomic serialiser.
//! What occupies them, and for how long, is decided in `exec.rs` from the
//! [`crate::CostModel`]; this file only keeps the clocks.

use crate::config::MAX_NIC_UNITS;

/// Slots of the atomic serialiser (direct-mapped by 8-byte address). Two addresses that
/// share a slot evict each other: the later one does not wait (a real NIC's atomic unit
/// tracks a bounded set of addresses too).
const ATOMIC_SLOTS: usize = 64;

#[derive(Clone, Debug)]
pub(crate) struct Nic {
    units: u32,
    /// Send side of each unit (WQE issue, binds' occupancy): busy until.
    send_free: [u64; MAX_NIC_UNITS as usize],
    /// Responder side of each unit (incoming requests of the QPs pinned to it).
    rx_free: [u64; MAX_NIC_UNITS as usize],
    /// The host's link, egress (payload serialisation is shared by every QP of the host).
    link_free: u64,
    /// (8-byte address + 1, busy until); 0 = empty.
    atomics: [(u64, u64); ATOMIC_SLOTS],
    /// Total occupancy, for utilisation figures.
    pub send_busy_ns: u64,
    pub rx_busy_ns: u64,
    /// The host's PCIe lanes, device reads (from host memory) and device writes: busy until.
    pcie_rd_free: u64,
    pcie_wr_free: u64,
    /// Cached memory-key contexts, direct-mapped by key index (index + 1; 0: empty). Empty
    /// vector: no cache modelled.
    keys: Vec<u32>,
    pub key_misses: u64,
}

impl Nic {
    pub fn new(units: u32) -> Self {
        Nic {
            units: units.clamp(1, MAX_NIC_UNITS),
            send_free: [0; MAX_NIC_UNITS as usize],
            rx_free: [0; MAX_NIC_UNITS as usize],
            link_free: 0,
            atomics: [(0, 0); ATOMIC_SLOTS],
            send_busy_ns: 0,
            rx_busy_ns: 0,
            pcie_rd_free: 0,
            pcie_wr_free: 0,
            keys: Vec::new(),
            key_misses: 0,
        }
    }

    /// The same NIC with a key-context cache of `entries` (0: none).
    pub fn with_key_cache(mut self, entries: u32) -> Self {
        self.keys = vec![0; entries as usize];
        self
    }

    /// Look up the context of key `index` (a window's or MR's 24-bit index): whether it was
    /// cached. A context goes into its slot when first used while the slot is free (as the
    /// NIC installs it when the object is made, room allowing); once keys contend for a slot,
    /// a miss brings the context in and evicts the other.
    pub fn touch_key(&mut self, index: u32) -> bool {
        let n = self.keys.len();
        if n == 0 {
            return true;
        }
        let slot = &mut self.keys[index as usize % n];
        let tag = index.wrapping_add(1);
        if *slot == tag || *slot == 0 {
            *slot = tag;
            return true;
        }
        *slot = tag;
        self.key_misses += 1;
        false
    }

    /// A DMA of `ns` of PCIe time that could start at `ready`, reading host memory (`read`)
    /// or writing it: when its last byte crossed.
    #[inline]
    pub fn occupy_pcie(&mut self, read: bool, ready: u64, ns: u64) -> u64 {
        if ns == 0 {
            return ready;
        }
        let lane = if read { &mut self.pcie_rd_free } else { &mut self.pcie_wr_free };
        let begin = ready.max(*lane);
        *lane = begin.saturating_add(ns);
        *lane
    }

    /// The unit a QP with local index `local` is pinned to.
    #[inline]
    pub fn unit_of(&self, local: u32) -> usize {
        (local % self.units) as usize
    }

    /// When unit `u`'s send side is free.
    #[inline]
    pub fn send_free(&self, u: usize) -> u64 {
        self.send_free[u]
    }

    /// Occupy unit `u`'s send side from `start` for `ns`.
    #[inline]
    pub fn occupy_send(&mut self, u: usize, start: u64, ns: u64) {
        self.send_free[u] = start.saturating_add(ns);
        self.send_busy_ns = self.send_busy_ns.saturating_add(ns);
    }

    /// A request arriving at `arrive` for unit `u`'s responder: when its processing starts.
    #[inline]
    pub fn occupy_rx(&mut self, u: usize, arrive: u64, ns: u64) -> u64 {
        let begin = arrive.max(self.rx_free[u]);
        self.rx_free[u] = begin.saturating_add(ns);
        self.rx_busy_ns = self.rx_busy_ns.saturating_add(ns);
        begin
    }

    /// Serialise `ns` of payload on the egress link from `ready`: when the last byte left.
    #[inline]
    pub fn occupy_link(&mut self, ready: u64, ns: u64) -> u64 {
        if ns == 0 {
            return ready;
        }
        let begin = ready.max(self.link_free);
        self.link_free = begin.saturating_add(ns);
        self.link_free
    }

    /// An atomic on `addr` that could start at `ready` and holds the address for `ns`: when
    /// it starts.
    #[inline]
    pub fn occupy_atomic(&mut self, addr: u64, ready: u64, ns: u64) -> u64 {
        let tag = (addr >> 3).wrapping_add(1);
        let slot = &mut self.atomics[((addr >> 3) as usize) % ATOMIC_SLOTS];
        let begin = if slot.0 == tag { ready.max(slot.1) } else { ready };
        *slot = (tag, begin.saturating_add(ns));
        begin
    }

    /// The latest time any unit's send side is busy until.
    pub fn busy_until(&self) -> u64 {
        self.send_free[..self.units as usize].iter().copied().max().unwrap_or(0)
    }

    #[cfg(test)]
    pub fn units(&self) -> u32 {
        self.units
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_independent_and_clamped() {
        let mut n = Nic::new(2);
        assert_eq!((n.unit_of(0), n.unit_of(1), n.unit_of(2)), (0, 1, 0));
        n.occupy_send(0, 10, 5);
        assert_eq!((n.send_free(0), n.send_free(1)), (15, 0));
        assert_eq!(n.busy_until(), 15);
        assert_eq!(Nic::new(0).units(), 1);
        assert_eq!(Nic::new(1000).units(), MAX_NIC_UNITS);
    }

    #[test]
    fn responder_and_link_queue() {
        let mut n = Nic::new(1);
        assert_eq!(n.occupy_rx(0, 100, 50), 100);
        assert_eq!(n.occupy_rx(0, 100, 50), 150);
        assert_eq!(n.rx_busy_ns, 100);
        assert_eq!(n.occupy_link(0, 10), 10);
        assert_eq!(n.occupy_link(0, 10), 20);
        assert_eq!(n.occupy_link(5, 0), 5, "no payload, no link time");
    }

    #[test]
    fn pcie_lanes_queue_per_direction() {
        let mut n = Nic::new(1);
        assert_eq!(n.occupy_pcie(true, 0, 100), 100);
        assert_eq!(n.occupy_pcie(true, 50, 100), 200, "reads queue behind reads");
        assert_eq!(n.occupy_pcie(false, 50, 100), 150, "writes have their own lanes");
        assert_eq!(n.occupy_pcie(true, 10, 0), 10, "no payload, no PCIe time");
    }

    #[test]
    fn key_cache_hits_misses_and_evicts() {
        let mut n = Nic::new(1);
        assert!(n.touch_key(7), "no cache: every key hits");
        let mut n = Nic::new(1).with_key_cache(4);
        assert!(n.touch_key(1), "installed in a free slot");
        assert!(n.touch_key(1));
        assert!(!n.touch_key(5), "slot 1 again: evicts key 1");
        assert!(!n.touch_key(1));
        assert!(n.touch_key(2), "another free slot");
        assert_eq!(n.key_misses, 2);
    }

    #[test]
    fn same_address_atomics_serialise_others_do_not() {
        let mut n = Nic::new(1);
        assert_eq!(n.occupy_atomic(64, 0, 370), 0);
        assert_eq!(n.occupy_atomic(64, 10, 370), 370);
        assert_eq!(n.occupy_atomic(72, 10, 370), 10, "another address");
    }
}
