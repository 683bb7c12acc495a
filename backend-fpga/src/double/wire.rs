//! The link between two nodes' engines: packets per request, the responder's PSN check, ARP
//! and loopback reachability, drops and their counters. Shared by the stock engine and the
//! extension block, which hands its requests to the same wire — its own module, so that neither
//! engine imports the other for it (scripts/import-cycles).

use super::{NodeStats, World};

/// PSNs are 24 bits wide.
const PSN_MASK: u32 = 0xFF_FFFF;

/// Packets a request of `len` bytes takes on the wire, i.e. the PSNs it consumes.
pub(crate) fn packets(len: u32, pmtu: u32) -> u32 {
    len.div_ceil(pmtu.max(1)).max(1)
}

/// The link and the responder's PSN check, without consuming anything: the requester's next
/// PSN must be the responder's expected one, the peer's address resolved, and a same-node
/// peer needs the extension block's internal loopback.
pub(crate) fn wire_check(w: &World, n: usize, c: u8, rn: usize, rc: u8) -> Result<(), DropWhy> {
    if rn == n && w.nodes[n].ext.is_none() {
        return Err(DropWhy::Loopback);
    }
    if rn != n {
        let peer_ip = w.nodes[rn].cfg.ip;
        if !w.nodes[n].stock.arp.contains(&peer_ip.swap_bytes()) {
            return Err(DropWhy::Arp);
        }
    }
    if w.nodes[rn].stock.qps[rc as usize].epsn != w.nodes[n].stock.qps[c as usize].sq_psn {
        return Err(DropWhy::Psn);
    }
    Ok(())
}

/// A request of `npkts` packets was taken by the responder: both ends move on.
pub(crate) fn wire_advance(w: &mut World, n: usize, c: u8, rn: usize, rc: u8, npkts: u32) {
    let s = &mut w.nodes[n].stock.qps[c as usize].sq_psn;
    *s = s.wrapping_add(npkts) & PSN_MASK;
    let e = &mut w.nodes[rn].stock.qps[rc as usize].epsn;
    *e = e.wrapping_add(npkts) & PSN_MASK;
}

/// [`wire_check`], then [`wire_advance`].
pub(crate) fn wire_ok(w: &mut World, n: usize, c: u8, rn: usize, rc: u8, npkts: u32) -> Result<(), DropWhy> {
    wire_check(w, n, c, rn, rc)?;
    wire_advance(w, n, c, rn, rc, npkts);
    Ok(())
}

/// Count a dropped request in the node's statistics.
pub(crate) fn count_drop(stats: &mut NodeStats, why: DropWhy) {
    match why {
        DropWhy::Psn => stats.psn_drops += 1,
        DropWhy::Arp => stats.arp_misses += 1,
        DropWhy::Loopback => stats.loopback_drops += 1,
        DropWhy::NoRoute => stats.unroutable += 1,
    }
}

/// Why a packet never reached the responder.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum DropWhy {
    Psn,
    Arp,
    /// A same-node peer on a stock engine.
    Loopback,
    /// No node has the connection's address or QPN.
    NoRoute,
}
