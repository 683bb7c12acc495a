//! Key-value workloads in the paper's style (RACE-like): a hash index in MN memory over objects
//! in MN memory, two-level allocation (chunks from the MN, objects carved by the CN into size
//! classes), out-of-place updates, inserts and deletes — and the request streams the field
//! drives such a store with:
//!
//! - [`trace`]: the home-made mix (load; 50 % get, 30 % update, 10 % insert, 10 % delete;
//!   shrink: three quarters of the keys deleted);
//! - [`ycsb`]: YCSB A–D (Cooper et al., SoCC'10) with Zipf θ = 0.99 key popularity and 1 KiB
//!   values, as FUSEE (FAST'23) runs them;
//! - [`cache`]: a cache shaped like the Twitter cache clusters Yang et al. measured (OSDI'20):
//!   small values (median object ≈ 230 B), a write-heavy cluster's 30 % sets, short TTLs
//!   (most < 20 min, a quarter beyond the run), Zipf popularity; expired objects are freed.
//!
//! Each client thread owns its keys and its chunks. The CN allocator fills the chunk it last
//! allocated from, then the fullest chunk with room, and frees a chunk to the MN as soon as its
//! last object dies. Memory is accounted at the scheme's granularity (chunks; 4 KiB pages for
//! ODRP; Static-MR holds its peak for the whole run).

use super::schemes::Op;
use crate::rng::Rng;
use omw_core::cn::object_alloc::{ObjectAllocator, ObjectRef};

pub const GET: u8 = 0;
pub const INSERT: u8 = 1;
pub const UPDATE: u8 = 2;
pub const DELETE: u8 = 3;
/// Bytes read from the index per lookup (one bucket) and written per index update (a slot).
pub const BUCKET_BYTES: u32 = 64;
pub const SLOT_BYTES: u32 = 16;

#[derive(Clone, Debug)]
pub struct KvConfig {
    pub chunk: u64,
    /// Object size classes (bytes), chosen uniformly.
    pub classes: Vec<u64>,
    pub keys_per_thread: usize,
    pub mixed_ops: usize,
    pub seed: u64,
}

#[derive(Clone, Debug, Default)]
pub struct KvTrace {
    pub ops: Vec<Op>,
    pub requests: usize,
    pub chunk_allocs: u64,
    pub chunk_frees: u64,
    /// MN bytes held: peak, at the end, and averaged over requests; for chunk granularity and
    /// for 4 KiB-page granularity.
    pub peak_bytes: u64,
    pub end_bytes: u64,
    pub avg_bytes: f64,
    pub end_page_bytes: u64,
    pub avg_page_bytes: f64,
    pub avg_live_bytes: f64,
    pub end_live_bytes: u64,
}

/// The CN's object allocator (omw-core's two-level allocation); chunk `i` of its table sits at
/// `i × chunk` of the CN's virtual space for page accounting. Capacity: every held chunk holds
/// a live object, and a thread never has more than `keys_per_thread + mixed_ops` of them; up
/// to 8 classes, 256 objects per chunk.
pub(crate) type Carver = ObjectAllocator<(), KV_MAX_CHUNKS, 8, 4>;
const KV_MAX_CHUNKS: usize = 8192;

/// Bytes held at 4 KiB-page granularity (ODRP): pages of the CN's virtual space that overlap a
/// live object.
fn page_bytes(cv: &Carver) -> u64 {
    let mut pages: Vec<u64> = Vec::new();
    for p in cv.objects() {
        let a = p.object.chunk.0 as u64 * cv.chunk_size() + p.offset;
        let b = a + p.len;
        pages.extend(a / 4096..b.div_ceil(4096));
    }
    pages.sort_unstable();
    pages.dedup();
    pages.len() as u64 * 4096
}

/// One thread's store: its allocator and the trace it emits, with the memory accounting.
pub(crate) struct Store {
    cv: Box<Carver>,
    classes: Vec<u64>,
    tr: KvTrace,
    sum_bytes: f64,
    sum_pages: f64,
    sum_live: f64,
    samples: usize,
}

/// Memory is sampled every this many requests (page accounting walks every object).
const SAMPLE_EVERY: usize = 16;

impl Store {
    pub(crate) fn new(chunk: u64, classes: &[u64]) -> Store {
        Store {
            cv: Box::new(Carver::new(chunk, classes).expect("bench size classes fit a chunk")),
            classes: classes.to_vec(),
            tr: KvTrace::default(),
            sum_bytes: 0.0,
            sum_pages: 0.0,
            sum_live: 0.0,
            samples: 0,
        }
    }

    /// The smallest class that holds `len` bytes.
    pub(crate) fn class_for(&self, len: u64) -> usize {
        self.cv.class_for(len).unwrap_or(self.classes.len() - 1)
    }

    /// A request ended: its latency is recorded under `tag`.
    pub(crate) fn step(&mut self, tag: u8) {
        self.tr.ops.push(Op::End(tag));
        self.tr.requests += 1;
        let held = self.cv.held_chunks() as u64 * self.cv.chunk_size();
        self.tr.peak_bytes = self.tr.peak_bytes.max(held);
        if self.tr.requests.is_multiple_of(SAMPLE_EVERY) {
            self.sum_bytes += held as f64;
            self.sum_pages += page_bytes(&self.cv) as f64;
            self.sum_live += self.cv.live_bytes() as f64;
            self.samples += 1;
        }
    }

    pub(crate) fn op(&mut self, op: Op) {
        self.tr.ops.push(op);
    }

    /// Place an object of class `ci` (a chunk from the MN when none has room).
    pub(crate) fn carve(&mut self, ci: usize) -> ObjectRef {
        let (o, new) = self.cv.alloc_with(ci, || Ok::<(), ()>(())).expect("the workload fits the allocator");
        if new {
            self.tr.ops.push(Op::Alloc);
            self.tr.chunk_allocs += 1;
        }
        o
    }

    /// Free an object (its chunk to the MN when it was the last).
    pub(crate) fn release(&mut self, o: ObjectRef) {
        if matches!(self.cv.free(o), Ok(Some(()))) {
            self.tr.ops.push(Op::Free);
            self.tr.chunk_frees += 1;
        }
    }

    /// A new key: the value written, the index slot swung.
    pub(crate) fn insert(&mut self, ci: usize) -> ObjectRef {
        let o = self.carve(ci);
        self.op(Op::Read { len: BUCKET_BYTES, bg: false });
        self.op(Op::Write { len: self.classes[ci] as u32, bg: false });
        self.op(Op::Write { len: SLOT_BYTES, bg: false });
        o
    }

    pub(crate) fn get(&mut self, ci: usize) {
        self.op(Op::Read { len: BUCKET_BYTES, bg: false });
        self.op(Op::Read { len: self.classes[ci] as u32, bg: false });
    }

    /// Out of place: a new copy (of class `ci`), the slot swung, the old copy freed.
    pub(crate) fn update(&mut self, ci: usize, old: ObjectRef) -> ObjectRef {
        let o = self.insert(ci);
        self.release(old);
        o
    }

    pub(crate) fn delete(&mut self, o: ObjectRef) {
        self.op(Op::Read { len: BUCKET_BYTES, bg: false });
        self.op(Op::Write { len: SLOT_BYTES, bg: false });
        self.release(o);
    }

    pub(crate) fn finish(mut self) -> KvTrace {
        self.tr.end_bytes = self.cv.held_chunks() as u64 * self.cv.chunk_size();
        self.tr.end_page_bytes = page_bytes(&self.cv);
        self.tr.end_live_bytes = self.cv.live_bytes();
        let n = self.samples.max(1) as f64;
        self.tr.avg_bytes = self.sum_bytes / n;
        self.tr.avg_page_bytes = self.sum_pages / n;
        self.tr.avg_live_bytes = self.sum_live / n;
        self.tr
    }
}

fn thread_rng(seed: u64, thread: u64) -> Rng {
    Rng::new(seed ^ (thread + 1).wrapping_mul(0x1234_5678_9ABC))
}

/// Generate one client thread's program of the home-made mix.
pub fn trace(cfg: &KvConfig, thread: u64) -> KvTrace {
    let mut rng = thread_rng(cfg.seed, thread);
    let mut st = Store::new(cfg.chunk, &cfg.classes);
    // key → (class index, object)
    let mut live: Vec<(usize, ObjectRef)> = Vec::new();
    let insert = |st: &mut Store, rng: &mut Rng, live: &mut Vec<(usize, ObjectRef)>| {
        let ci = rng.below(cfg.classes.len() as u64) as usize;
        let o = st.insert(ci);
        live.push((ci, o));
        st.step(INSERT);
    };
    let delete = |st: &mut Store, rng: &mut Rng, live: &mut Vec<(usize, ObjectRef)>| {
        let k = rng.below(live.len() as u64) as usize;
        let (_, o) = live.swap_remove(k);
        st.delete(o);
        st.step(DELETE);
    };
    for _ in 0..cfg.keys_per_thread {
        insert(&mut st, &mut rng, &mut live);
    }
    for _ in 0..cfg.mixed_ops {
        let r = rng.below(100);
        if live.is_empty() {
            insert(&mut st, &mut rng, &mut live);
        } else if r < 50 {
            let k = rng.below(live.len() as u64) as usize;
            st.get(live[k].0);
            st.step(GET);
        } else if r < 80 {
            let k = rng.below(live.len() as u64) as usize;
            let (ci, old) = live[k];
            live[k] = (ci, st.update(ci, old));
            st.step(UPDATE);
        } else if r < 90 {
            insert(&mut st, &mut rng, &mut live);
        } else {
            delete(&mut st, &mut rng, &mut live);
        }
    }
    let target = live.len() / 4;
    while live.len() > target {
        delete(&mut st, &mut rng, &mut live);
        if !live.is_empty() {
            let k = rng.below(live.len() as u64) as usize;
            st.get(live[k].0);
            st.step(GET);
        }
    }
    st.finish()
}

/// YCSB's Zipfian generator (Gray et al., "Quickly generating billion-record synthetic
/// databases", SIGMOD'94 — the one YCSB's `ZipfianGenerator` implements): ranks 0..n, rank 0
/// the most popular, θ the skew; items can be added (YCSB-D's inserts) at O(1) each.
pub struct Zipf {
    n: u64,
    theta: f64,
    zetan: f64,
    zeta2: f64,
}

impl Zipf {
    pub fn new(n: u64, theta: f64) -> Zipf {
        let zetan = (1..=n.max(1)).map(|i| 1.0 / (i as f64).powf(theta)).sum();
        Zipf { n: n.max(1), theta, zetan, zeta2: 1.0 + 0.5f64.powf(theta) }
    }
    /// One more item (the newest).
    pub fn grow(&mut self) {
        self.n += 1;
        self.zetan += 1.0 / (self.n as f64).powf(self.theta);
    }
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let uz = u * self.zetan;
        if uz < 1.0 {
            return 0;
        }
        if uz < self.zeta2 {
            return 1;
        }
        let alpha = 1.0 / (1.0 - self.theta);
        let eta = (1.0 - (2.0 / self.n as f64).powf(1.0 - self.theta)) / (1.0 - self.zeta2 / self.zetan);
        ((self.n as f64 * (eta * u - eta + 1.0).powf(alpha)) as u64).min(self.n - 1)
    }
}

/// The YCSB core workloads A–D (Cooper et al., SoCC'10): the share of reads, and the rest
/// updates (A, B) or inserts (D, whose reads favour the newest keys: "latest").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ycsb {
    A,
    B,
    C,
    D,
}

impl Ycsb {
    pub const ALL: [Ycsb; 4] = [Ycsb::A, Ycsb::B, Ycsb::C, Ycsb::D];
    pub fn name(self) -> &'static str {
        match self {
            Ycsb::A => "YCSB-A (50 % read, 50 % update)",
            Ycsb::B => "YCSB-B (95 % read, 5 % update)",
            Ycsb::C => "YCSB-C (100 % read)",
            Ycsb::D => "YCSB-D (95 % read latest, 5 % insert)",
        }
    }
    fn read_pct(self) -> u64 {
        match self {
            Ycsb::A => 50,
            Ycsb::B | Ycsb::D => 95,
            Ycsb::C => 100,
        }
    }
}

#[allow(clippy::too_many_arguments)]
/// One thread of a YCSB workload over `keys` records of `value` bytes (one class) in chunks of
/// `chunk`: the load, then `ops` requests with Zipf θ = `theta` popularity.
pub fn ycsb(w: Ycsb, chunk: u64, value: u64, keys: usize, ops: usize, theta: f64, seed: u64, thread: u64) -> KvTrace {
    let mut rng = thread_rng(seed, thread);
    let mut st = Store::new(chunk, &[value]);
    let mut live: Vec<ObjectRef> = Vec::with_capacity(keys + ops);
    for _ in 0..keys {
        live.push(st.insert(0));
        st.step(INSERT);
    }
    let mut zipf = Zipf::new(live.len() as u64, theta);
    for _ in 0..ops {
        let read = rng.below(100) < w.read_pct();
        let rank = zipf.sample(&mut rng) as usize;
        // key i is the i-th inserted; D reads the latest, the others a scrambled rank
        let k = match w {
            Ycsb::D => live.len() - 1 - rank.min(live.len() - 1),
            _ => (rank.wrapping_mul(0x9E37_79B9) ^ (rank >> 7)) % live.len(),
        };
        if read {
            st.get(0);
            st.step(GET);
        } else if w == Ycsb::D {
            live.push(st.insert(0));
            zipf.grow();
            st.step(INSERT);
        } else {
            live[k] = st.update(0, live[k]);
            st.step(UPDATE);
        }
    }
    st.finish()
}

/// Value sizes of the cache workload: Yang et al. (OSDI'20) find objects small — the median
/// cluster's mean object is ≈ 230 B, a quarter of the clusters' below 100 B, few above a few
/// KiB. Classes and their shares (ours, matching those figures): 64 B 15 %, 128 B 20 %,
/// 256 B 35 %, 512 B 20 %, 1 KiB 10 %.
pub const CACHE_SIZES: [(u64, u64); 5] = [(64, 15), (128, 20), (256, 35), (512, 20), (1024, 10)];

/// One thread of a Twitter-shaped cache: `keys` distinct keys with Zipf `theta` popularity,
/// `ops` requests of which `set_pct` % are sets; a get of a missing or expired key is a miss
/// the client fills (a set). TTLs (in requests, the run standing for an hour): three quarters
/// short, uniform over 1-20 minutes; a quarter longer than the run (Yang et al.: "usually
/// < 20 min, only 25 % > 2 days"). Expired objects are freed as they expire.
#[allow(clippy::too_many_arguments)]
pub fn cache(chunk: u64, keys: usize, ops: usize, set_pct: u64, theta: f64, seed: u64, thread: u64) -> KvTrace {
    let mut rng = thread_rng(seed, thread);
    let classes: Vec<u64> = CACHE_SIZES.iter().map(|(s, _)| *s).collect();
    let mut st = Store::new(chunk, &classes);
    let zipf = Zipf::new(keys as u64, theta);
    let minute = (ops as u64 / 60).max(1);
    // key → (class, object, expires at request #)
    let mut slot: Vec<Option<(usize, ObjectRef, u64)>> = vec![None; keys];
    let mut expiry: std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize)>> = Default::default();
    let pick_class = |rng: &mut Rng| {
        let mut r = rng.below(100);
        for (i, (_, share)) in CACHE_SIZES.iter().enumerate() {
            if r < *share {
                return i;
            }
            r -= share;
        }
        CACHE_SIZES.len() - 1
    };
    for now in 0..ops as u64 {
        // objects whose TTL ran out are freed (an expiration, not an eviction)
        while let Some(std::cmp::Reverse((t, k))) = expiry.peek().copied() {
            if t > now {
                break;
            }
            expiry.pop();
            if let Some((_, o, at)) = slot[k] {
                if at == t {
                    st.release(o);
                    slot[k] = None;
                }
            }
        }
        let k = ((zipf.sample(&mut rng) as usize).wrapping_mul(0x9E37_79B9) ^ 0x5bd1) % keys;
        let set = rng.below(100) < set_pct;
        match (set, slot[k]) {
            (false, Some((ci, _, _))) => {
                st.get(ci);
                st.step(GET);
                continue;
            }
            (false, None) => {
                // a miss: the index lookup finds nothing, the client fills it
                st.op(Op::Read { len: BUCKET_BYTES, bg: false });
            }
            _ => {}
        }
        let ci = pick_class(&mut rng);
        let ttl = if rng.below(4) == 0 { u64::MAX / 2 } else { minute * (1 + rng.below(20)) };
        let o = match slot[k] {
            Some((_, old, _)) => st.update(ci, old),
            None => st.insert(ci),
        };
        let at = now.saturating_add(ttl);
        slot[k] = Some((ci, o, at));
        if at < ops as u64 {
            expiry.push(std::cmp::Reverse((at, k)));
        }
        st.step(if set { UPDATE } else { INSERT });
    }
    st.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_099_is_skewed_and_in_range() {
        let z = Zipf::new(1000, 0.99);
        let mut rng = Rng::new(3);
        let mut hits = [0u32; 1000];
        for _ in 0..100_000 {
            hits[z.sample(&mut rng) as usize] += 1;
        }
        // rank 0 takes ≈ 1 / zeta(1000, 0.99) ≈ 13 %, the top 10 % of ranks most of the mass
        assert!((10_000..17_000).contains(&hits[0]), "{}", hits[0]);
        let top: u32 = hits[..100].iter().sum();
        assert!(top > 60_000, "{top}");
    }

    #[test]
    fn ycsb_mixes_and_cache_expiry_free_memory() {
        let a = ycsb(Ycsb::A, 16384, 1024, 200, 1000, 0.99, 1, 0);
        let c = ycsb(Ycsb::C, 16384, 1024, 200, 1000, 0.99, 1, 0);
        assert_eq!(c.chunk_frees, 0, "read-only: nothing freed");
        let writes = |t: &KvTrace| t.ops.iter().filter(|o| matches!(o, Op::Write { len: 1024, .. })).count();
        assert_eq!(writes(&c), 200, "C writes only its load");
        assert!(writes(&a) > 600, "A updates half its requests out of place: {}", writes(&a));
        let d = ycsb(Ycsb::D, 16384, 1024, 200, 1000, 0.99, 1, 0);
        assert!(d.end_live_bytes > c.end_live_bytes, "inserts add keys");
        let t = cache(16384, 500, 20_000, 30, 0.99, 1, 0);
        assert!(t.chunk_frees > 0, "expired objects give chunks back");
        assert!(t.end_live_bytes < t.peak_bytes);
        assert_eq!(t.requests, 20_000);
    }
}
