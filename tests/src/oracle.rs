//! Oracles shared by the scenarios, lifted from the fuzz harness (fuzz/harness/src/sim.rs):
//! the shadow of the bytes each CN wrote into the chunks it holds (and the allocations that
//! died, whose rkeys must never work again), and a seeded generator for reproducible sequences.

use crate::testbed::Testbed;
use omw_core::cn::Allocation;
use omw_core::device::WcStatus;

/// Bytes of each chunk the shadow tracks.
pub const SHADOW: usize = 256;

/// One live allocation and the bytes its CN wrote (None: never written).
#[derive(Clone, Debug)]
pub struct Held {
    pub cn: usize,
    pub a: Allocation,
    pub bytes: Vec<Option<u8>>,
}

/// Every allocation a scenario saw succeed and not give back, and every one that died.
#[derive(Default, Debug)]
pub struct Shadow {
    pub held: Vec<Held>,
    pub dead: Vec<(usize, Allocation)>,
}

impl Shadow {
    pub fn adopt(&mut self, cn: usize, a: Allocation) {
        let len = (a.length as usize).min(SHADOW);
        self.held.push(Held { cn, a, bytes: vec![None; len] });
    }
    pub fn of(&self, cn: usize) -> Vec<usize> {
        (0..self.held.len()).filter(|i| self.held[*i].cn == cn).collect()
    }
    pub fn count(&self, cn: usize) -> usize {
        self.held.iter().filter(|h| h.cn == cn).count()
    }
    /// The `which`-th allocation CN `cn` holds (modulo), if any.
    pub fn pick(&self, cn: usize, which: usize) -> Option<usize> {
        let v = self.of(cn);
        (!v.is_empty()).then(|| v[which % v.len()])
    }
    /// The allocation at `k` was given back (freed by its CN).
    pub fn forget(&mut self, k: usize) -> Held {
        let h = self.held.remove(k);
        self.dead.push((h.cn, h.a.clone()));
        h
    }
    /// Every allocation of `cn` (or of everyone) is gone (crash, revocation).
    pub fn kill(&mut self, cn: Option<usize>) {
        let mut k = 0;
        while k < self.held.len() {
            if cn.is_none_or(|c| self.held[k].cn == c) {
                self.forget(k);
            } else {
                k += 1;
            }
        }
    }
    pub fn record_write(&mut self, k: usize, off: usize, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            if let Some(slot) = self.held[k].bytes.get_mut(off + i) {
                *slot = Some(*b);
            }
        }
    }
    /// Every live allocation reads back (through every access QP) exactly what its CN wrote.
    pub fn verify_all(&self, t: &mut dyn Testbed, what: &dyn std::fmt::Debug) {
        for h in &self.held {
            for q in 0..h.a.rkeys.len() {
                let (st, got) = t.read(h.cn, &h.a, q, 0, h.bytes.len());
                assert_eq!(st, WcStatus::Success, "cn{} lost access to {:#x} (qp {q}) after {what:?}", h.cn, h.a.base);
                for (i, want) in h.bytes.iter().enumerate() {
                    if let Some(w) = want {
                        assert_eq!(
                            got[i], *w,
                            "cn{}'s chunk {:#x} byte {i} changed behind its back after {what:?}",
                            h.cn, h.a.base
                        );
                    }
                }
            }
        }
    }
    /// No dead allocation's rkey opens its chunk any more (read through its CN's own QP).
    pub fn verify_dead(&self, t: &mut dyn Testbed, alive: &[bool], what: &dyn std::fmt::Debug) {
        for (cn, a) in &self.dead {
            if alive[*cn] {
                assert_eq!(
                    t.read_raw(*cn, 0, a.base, a.rkeys[0], 8).0,
                    WcStatus::RemAccessErr,
                    "stale rkey of cn{cn} works after {what:?}"
                );
            }
        }
    }
}

/// The oracle's choices: the core's seeded generator, plus byte strings.
#[derive(Clone, Debug)]
pub struct Rng(omw_core::rng::SeededRng);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(omw_core::rng::SeededRng::new(seed))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }
    pub fn bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max as u64) as usize;
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}
