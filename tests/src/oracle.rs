//! Oracles shared by the scenarios and the fuzz targets (fuzz/harness uses this one):
//! the shadow of the bytes each CN wrote into the chunks it holds (and the allocations that
//! died, whose rkeys must never work again), and a seeded generator for reproducible sequences.

use crate::testbed::Testbed;
use omw_core::cn::Allocation;
use omw_core::device::WcStatus;
use omw_loopback::cluster::Cluster;
use std::collections::BTreeMap;

/// Bytes of each chunk the shadow tracks (accesses may go further; they are checked by status).
pub const SHADOW: usize = 256;

/// An allocation as a CN got it, and the bytes it wrote since (None: never written).
#[derive(Clone, Debug)]
pub struct Held {
    pub cn: usize,
    pub a: Allocation,
    pub bytes: Vec<Option<u8>>,
}

/// What the shadow reads the chunks through: a conformance testbed, or the loopback cluster
/// the fuzz targets drive.
pub trait ShadowReader {
    /// READ `len` bytes at `offset` of `a` through CN `cn`'s access QP `window`.
    fn read_as(&mut self, cn: usize, a: &Allocation, window: usize, offset: u64, len: usize) -> (WcStatus, Vec<u8>);
    /// Whether CN `cn` can still read (a crashed CN's chunks are not checked through it).
    fn can_read(&self, cn: usize) -> bool;
}

impl<T: Testbed + ?Sized> ShadowReader for T {
    fn read_as(&mut self, cn: usize, a: &Allocation, window: usize, offset: u64, len: usize) -> (WcStatus, Vec<u8>) {
        self.read(cn, a, window, offset, len)
    }
    fn can_read(&self, _cn: usize) -> bool {
        true
    }
}

impl ShadowReader for Cluster {
    fn read_as(&mut self, cn: usize, a: &Allocation, window: usize, offset: u64, len: usize) -> (WcStatus, Vec<u8>) {
        self.read(cn, a, window, offset, len)
    }
    fn can_read(&self, cn: usize) -> bool {
        self.cns.get(cn).is_some_and(|c| !c.crashed)
    }
}

/// The shadow of every allocation a scenario or fuzz target saw succeed and not give back —
/// keyed by (cn, entry, owner rkey) — and of every one that died (freed, revoked, reclaimed),
/// whose rkeys must never work again. Ordered, not hashed: whatever iterates it runs in the same
/// order in every process, so a fuzz run with a fixed seed explores the same way everywhere.
#[derive(Default, Debug)]
pub struct Shadow {
    pub held: BTreeMap<(usize, u64, u32), Held>,
    pub dead: Vec<(usize, Allocation)>,
}

impl Shadow {
    pub fn adopt(&mut self, cn: usize, a: Allocation) {
        let len = (a.length as usize).min(SHADOW);
        self.held.insert((cn, a.entry_addr, a.owner_rkey.0), Held { cn, a, bytes: vec![None; len] });
    }
    /// What CN `cn` holds, by entry address.
    pub fn of(&self, cn: usize) -> Vec<Held> {
        let mut v: Vec<Held> = self.held.values().filter(|h| h.cn == cn).cloned().collect();
        v.sort_by_key(|h| h.a.entry_addr);
        v
    }
    pub fn count(&self, cn: usize) -> usize {
        self.held.values().filter(|h| h.cn == cn).count()
    }
    /// The `which`-th allocation CN `cn` holds (modulo), if any.
    pub fn pick(&self, cn: usize, which: usize) -> Option<Held> {
        let v = self.of(cn);
        (!v.is_empty()).then(|| v[which % v.len()].clone())
    }
    /// Drop what the MN no longer records as owned by its CN (freed, revoked, reclaimed).
    pub fn sync(&mut self, owned: impl Fn(usize, &Allocation) -> bool) {
        let gone: Vec<(usize, u64, u32)> =
            self.held.iter().filter(|(_, h)| !owned(h.cn, &h.a)).map(|(k, _)| *k).collect();
        for k in gone {
            if let Some(h) = self.held.remove(&k) {
                self.dead.push((h.cn, h.a));
            }
        }
    }
    /// The CN gave `h` back itself.
    pub fn forget(&mut self, h: &Held) {
        if let Some(h) = self.held.remove(&(h.cn, h.a.entry_addr, h.a.owner_rkey.0)) {
            self.dead.push((h.cn, h.a));
        }
    }
    /// Every allocation of `cn` (or of everyone) is gone (crash, revocation).
    pub fn kill(&mut self, cn: Option<usize>) {
        let all: Vec<Held> = self.held.values().filter(|h| cn.is_none_or(|c| h.cn == c)).cloned().collect();
        for h in all {
            self.forget(&h);
        }
    }
    pub fn record_write(&mut self, h: &Held, off: usize, data: &[u8]) {
        if let Some(x) = self.held.get_mut(&(h.cn, h.a.entry_addr, h.a.owner_rkey.0)) {
            for (i, b) in data.iter().enumerate() {
                if let Some(slot) = x.bytes.get_mut(off + i) {
                    *slot = Some(*b);
                }
            }
        }
    }
    /// Every live allocation reads back (through every access QP) exactly what its CN wrote.
    pub fn verify_all<R: ShadowReader + ?Sized>(&self, r: &mut R, what: &dyn std::fmt::Debug) {
        let mut all: Vec<&Held> = self.held.values().collect();
        all.sort_by_key(|h| (h.cn, h.a.entry_addr));
        for h in all {
            if !r.can_read(h.cn) {
                continue;
            }
            for q in 0..h.a.rkeys.len() {
                let (st, got) = r.read_as(h.cn, &h.a, q, 0, h.bytes.len());
                assert_eq!(
                    st,
                    WcStatus::Success,
                    "cn{} lost access to its chunk {:#x} (qp {q}) after {what:?}",
                    h.cn,
                    h.a.base
                );
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
