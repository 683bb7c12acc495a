//! What an MN tells a CN whose connection request it refuses, in the reject's private data: only
//! a refusal the CN can act on (asking more alloc chains than the MN allows, a rejoin the MN does
//! not serve); what else refused a peer is the MN's log's to know. Its layout (the IB CM carries
//! 148 bytes of REJ private data, `IB_CM_REJ_PRIVATE_DATA_SIZE` in linux `include/rdma/ib_cm.h`,
//! and rdma_cm's REJECTED event hands the CN all 148, `drivers/infiniband/core/cma.c`; the rest
//! is zero): magic `"OWMC"` (4 bytes, the hello's, `crate::cm::HELLO_MAGIC`), version 3 (hellos
//! are 1, 2 and 4), reason (1: alloc chains, 2: no rejoin), then the reason's fields (alloc
//! chains: the MN's maximum, what the CN asked), zero-padded to [`REFUSAL_LEN`] bytes.

use std::fmt;

/// The magic opening every omw rdma_cm private data (hello, welcome, refusal).
pub const MAGIC: u32 = 0x434D_574F; // "OWMC"
/// A refusal's bytes ([`Refusal::encode`]).
pub const REFUSAL_LEN: usize = 8;
/// The version byte of a refusal (hellos are 1, 2 and 4).
const REFUSAL_VERSION: u8 = 3;

/// MN → CN private data of a reject, for a refusal the CN can act on (other rejects carry
/// none: what else refused a peer is the MN's log's, not the peer's, to know).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Refusal {
    /// The CN asked for more alloc chains than the MN allows (its `--alloc-chains`): the core's
    /// `MnError::AllocChains`, before any QP of the CN is set up.
    AllocChains { allowed: u8, asked: u8 },
    /// The CN asked to rejoin a connection of its session, and this MN rejoins none (its
    /// transport's QPs are rdma_cm's): start a new session.
    NoRejoin,
}

impl Refusal {
    pub fn encode(&self) -> [u8; REFUSAL_LEN] {
        let mut b = [0u8; REFUSAL_LEN];
        b[..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = REFUSAL_VERSION;
        match *self {
            Refusal::AllocChains { allowed, asked } => {
                b[5] = 1;
                b[6] = allowed;
                b[7] = asked;
            }
            Refusal::NoRejoin => b[5] = 2,
        }
        b
    }

    /// The refusal in a reject's private data; None for any other bytes (a reject without a
    /// reason, the IB CM's zero padding, or a peer that is no omw MN).
    pub fn decode(b: &[u8]) -> Option<Refusal> {
        if b.len() < REFUSAL_LEN || b[..4] != MAGIC.to_le_bytes() || b[4] != REFUSAL_VERSION {
            return None;
        }
        match b[5] {
            1 => Some(Refusal::AllocChains { allowed: b[6], asked: b[7] }),
            2 => Some(Refusal::NoRejoin),
            _ => None,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::AllocChains { allowed, asked } => write!(
                f,
                "this CN asked for {asked} alloc chains, the MN allows at most {allowed} (its --alloc-chains)"
            ),
            Refusal::NoRejoin => {
                f.write_str("the MN rejoins no connection (its QPs are rdma_cm's, not its own): connect as a new CN")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_round_trip_inside_the_reject_padding() {
        for r in [Refusal::AllocChains { allowed: 2, asked: 3 }, Refusal::NoRejoin] {
            // the IB CM delivers a REJ's 148 bytes of private data: ours, then zeros
            let mut rej = [0u8; 148];
            rej[..REFUSAL_LEN].copy_from_slice(&r.encode());
            assert_eq!(Refusal::decode(&rej), Some(r));
        }
        assert_eq!(Refusal::decode(&[0u8; 148]), None, "a reject without a reason");
        // a hello (version 1) is no refusal
        assert_eq!(Refusal::decode(&[0x4f, 0x57, 0x4d, 0x43, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1]), None);
        let r = Refusal::AllocChains { allowed: 2, asked: 3 };
        let mut odd = r.encode();
        odd[5] = 77;
        assert_eq!(Refusal::decode(&odd), None);
        assert_eq!(Refusal::decode(&r.encode()[..7]), None);
    }
}
