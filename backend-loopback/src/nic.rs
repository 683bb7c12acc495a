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
        }
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
    fn same_address_atomics_serialise_others_do_not() {
        let mut n = Nic::new(1);
        assert_eq!(n.occupy_atomic(64, 0, 370), 0);
        assert_eq!(n.occupy_atomic(64, 10, 370), 370);
        assert_eq!(n.occupy_atomic(72, 10, 370), 10, "another address");
    }
}
