//! The rejoin ticket: what lets a CN reconnect one QP of its session without starting over.
//!
//! Under a chain layout that binds to the poster (docs/MLX5.md "Binds to the poster") a CN's
//! windows live on the MN's end of its Alloc QP. That QP breaks whenever the MN refuses an
//! access on it (a stale key after a free, a revoked chunk) and whenever the MN repairs the
//! CN's alloc chain (the repair resets the MN end, whose PSNs then no longer match the CN's).
//! Without a rejoin the CN's only way on is a new session, and a departed session's chunks are
//! reclaimed: every refused access would cost a CN everything it holds.
//!
//! A rejoin connects the *same* MN-side QP — windows and all — to a new CN QP. Whoever rejoins
//! therefore reaches every window of the session: the MN must not let a rejoin through on
//! anything another CN could know or guess. The session nonce is the CN's choice and travels in
//! every hello; the tenant credential is shared by a tenant's CNs. The ticket is neither: the
//! MN derives it from the nonce under a key of its own (HMAC-SHA256, RustCrypto `hmac`, the
//! first 8 bytes), drawn from the OS at start-up and never sent, and hands it to exactly one
//! peer — in the welcome, the private data of the accept of the session's Alloc connection,
//! which the IB CM delivers to the requesting port only. The MN checks it in constant time; a
//! wrong one is refused without a reason, like any other bad join (`Rejection::RejoinTicket`).
//! Guessing costs a connection request per try against 2^64 tickets.
//!
//! The CN's side is [`Rejoiner`], what a rejoin needs to know; `VerbsBackend::rejoin_chain`
//! (`crate::cn`) makes the new QP, sends the rejoin hello and checks that the MN put it on the
//! same MN-side QP.

use hmac::{Hmac, Mac};
use omw_core::ids::Qpn;
use sha2::Sha256;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

/// The MN's key for rejoin tickets: one per daemon, from the OS's random source.
#[derive(Clone)]
pub struct RejoinKey([u8; 32]);

impl std::fmt::Debug for RejoinKey {
    /// Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RejoinKey(..)")
    }
}

/// The bytes a ticket covers: a domain tag and the session nonce.
fn covered(nonce: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(b"omw-rjn1");
    b[8..].copy_from_slice(&nonce.to_le_bytes());
    b
}

impl RejoinKey {
    /// A key from the OS's random source.
    pub fn random() -> Result<Self, getrandom::Error> {
        let mut k = [0u8; 32];
        getrandom::fill(&mut k)?;
        Ok(RejoinKey(k))
    }

    /// A fixed key (tests).
    pub fn from_bytes(k: [u8; 32]) -> Self {
        RejoinKey(k)
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes a key of any length
        <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC accepts every key length")
    }

    /// The rejoin ticket of session `nonce`.
    pub fn ticket(&self, nonce: u64) -> u64 {
        let full = self.mac().chain_update(covered(nonce)).finalize().into_bytes();
        let mut t = [0u8; 8];
        t.copy_from_slice(&full[..8]);
        u64::from_le_bytes(t)
    }

    /// Whether `ticket` is session `nonce`'s (constant-time comparison).
    pub fn verify(&self, nonce: u64, ticket: u64) -> bool {
        self.mac().chain_update(covered(nonce)).verify_truncated_left(&ticket.to_le_bytes()).is_ok()
    }
}

/// The CN's side: what it needs to rejoin one of its chain connections — where its MN is,
/// its session, the ticket the welcome gave it, and the MN's QP of each connection (a rejoin
/// must land on the same one, or the MN mixed up sessions).
#[derive(Clone, Debug)]
pub struct Rejoiner {
    pub addr: SocketAddr,
    pub source: Option<Ipv4Addr>,
    pub timeout: Duration,
    pub alloc_chains: u8,
    pub nonce: u64,
    pub ticket: u64,
    /// The MN ends: of each alloc chain's Alloc QP (chain order), and of the Free QP.
    pub mn_alloc: Vec<Option<Qpn>>,
    pub mn_free: Option<Qpn>,
}

/// A chain connection connected anew: the CN's new QP, and whether its receives were posted
/// before it connected (`CnDriver::replace_chain_qp`'s `primed`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Rejoined {
    pub qp: Qpn,
    pub primed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_is_its_sessions_under_its_key_only() {
        let (k, other) = (RejoinKey::from_bytes([7; 32]), RejoinKey::from_bytes([8; 32]));
        let t = k.ticket(0x55);
        assert!(k.verify(0x55, t));
        assert!(!k.verify(0x56, t), "another session's ticket");
        assert!(!other.verify(0x55, t), "another MN's ticket");
        assert!(!k.verify(0x55, t ^ 1));
        assert_ne!(k.ticket(0x55), k.ticket(0x56));
        let (a, b) = (RejoinKey::random().unwrap(), RejoinKey::random().unwrap());
        assert_ne!(a.ticket(1), b.ticket(1), "each MN draws its own key");
        assert_eq!(format!("{a:?}"), "RejoinKey(..)");
    }
}
