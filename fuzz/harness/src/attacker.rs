//! What a hostile CN knows about keys, and how it guesses: a guess state per key index (the
//! key bytes refused there), and the (index, key) pairs it has seen work or been given — its
//! own windows' rkeys from its alloc replies, and every guess that succeeded. From those it
//! predicts the key byte of any other index the way the modelled devices draw them: mlx5 takes
//! consecutive bytes from one device-wide counter (so key − index is the same for objects
//! created in a row, and a window's byte moves on by one per bind), rxe draws a random byte
//! (so the prediction is worthless and the attacker walks the 256 bytes of the index).

use arbitrary::Arbitrary;
use omw_core::ids::Rkey;
use omw_core::wire::message::AllocReply;
use std::collections::BTreeMap;

/// Where the attacker starts for an index it has not broken yet.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Predict {
    /// From byte 0 (or where the last refusal left off).
    Walk,
    /// The nearest known key's byte plus the index distance (mlx5's counter).
    Counter,
    /// The counter prediction plus a number of binds since.
    Bumped(u8),
    Fixed(u8),
}

/// One index: which key bytes were refused, and the byte that last worked.
#[derive(Clone, Debug, Default)]
struct IndexGuess {
    refused: [u64; 4],
    hit: Option<u8>,
}

impl IndexGuess {
    fn is_refused(&self, k: u8) -> bool {
        self.refused[k as usize / 64] & (1 << (k % 64)) != 0
    }
    fn refuse(&mut self, k: u8) {
        self.refused[k as usize / 64] |= 1 << (k % 64);
        if self.hit == Some(k) {
            self.hit = None;
        }
    }
}

#[derive(Debug, Default)]
pub struct Guesser {
    by_index: BTreeMap<u32, IndexGuess>,
    /// Keys seen to work or given, by index (the latest byte of each).
    known: BTreeMap<u32, u8>,
    /// How many of the attacker's received messages it has read.
    read: usize,
    pub tries: u64,
    pub refused: u64,
    pub hits: u64,
}

impl Guesser {
    /// Learn from what arrived since last time: the rkeys of its own windows in alloc replies.
    pub fn learn(&mut self, received: &[Vec<u8>]) {
        for b in received.iter().skip(self.read) {
            if let Ok(r) = AllocReply::decode(b) {
                for k in 0..omw_core::geometry::MAX_GROUP_SIZE {
                    let rk = r.entry.rkey(k);
                    if rk.0 != 0 {
                        self.known.insert(rk.index(), rk.key());
                    }
                }
            }
        }
        self.read = received.len();
    }

    /// Indexes the attacker knows a key of, in order.
    pub fn known_indexes(&self) -> Vec<u32> {
        self.known.keys().copied().collect()
    }

    fn predicted(&self, index: u32, p: Predict) -> u8 {
        let counter = || {
            // the known index nearest to `index`
            let near = self.known.iter().min_by_key(|(i, _)| i.abs_diff(index));
            near.map(|(i, k)| k.wrapping_add(index.wrapping_sub(*i) as u8)).unwrap_or(0)
        };
        match p {
            Predict::Walk => 0,
            Predict::Counter => counter(),
            Predict::Bumped(n) => counter().wrapping_add(n),
            Predict::Fixed(k) => k,
        }
    }

    /// The next key to try at `index`: the byte that last worked, else the first byte not yet
    /// refused from the prediction on. All 256 refused: the index starts over (window keys
    /// move on with every bind).
    pub fn next(&mut self, index: u32, p: Predict) -> Rkey {
        let start = self.predicted(index, p);
        let g = self.by_index.entry(index).or_default();
        let key = match g.hit {
            Some(k) => k,
            None => match (0..=255u8).map(|d| start.wrapping_add(d)).find(|k| !g.is_refused(*k)) {
                Some(k) => k,
                None => {
                    *g = IndexGuess::default();
                    start
                }
            },
        };
        self.tries += 1;
        Rkey::new(index & Rkey::MAX_INDEX, key).unwrap_or_default()
    }

    /// The device's answer to a guess.
    pub fn feedback(&mut self, rkey: Rkey, worked: bool) {
        let g = self.by_index.entry(rkey.index()).or_default();
        if worked {
            g.hit = Some(rkey.key());
            self.known.insert(rkey.index(), rkey.key());
            self.hits += 1;
        } else {
            g.refuse(rkey.key());
            self.refused += 1;
        }
    }
}
