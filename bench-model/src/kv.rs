//! A key-value workload in the paper's style (RACE-like): a hash index in MN memory over
//! objects in MN memory, two-level allocation (chunks from the MN, objects carved by the CN
//! into size classes), out-of-place updates, inserts and deletes.
//!
//! Each client thread owns its keys and its chunks. Phases: load (insert), mixed (50 % get,
//! 30 % update, 10 % insert, 10 % delete), shrink (delete three quarters of the live keys,
//! one get between deletes). The CN allocator fills the chunk it last allocated from, then the
//! fullest chunk with room, and frees a chunk to the MN as soon as its last object dies.
//! Memory is accounted at the scheme's granularity (chunks; 4 KiB pages for ODRP; Static-MR
//! holds its peak for the whole run).

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
/// a live key, and a thread never has more than `keys_per_thread + mixed_ops` keys.
type Carver = ObjectAllocator<(), KV_MAX_CHUNKS, 4, 1>;
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

/// Place an object of class `ci`; true when that took a new chunk from the MN.
fn carve(cv: &mut Carver, ci: usize) -> (ObjectRef, bool) {
    cv.alloc_with(ci, || Ok::<(), ()>(())).expect("the workload fits the allocator (sizes in lib.rs)")
}

/// Free an object; true when its chunk went back to the MN.
fn release(cv: &mut Carver, o: ObjectRef) -> bool {
    matches!(cv.free(o), Ok(Some(())))
}

/// Generate one client thread's KV program.
pub fn trace(cfg: &KvConfig, thread: u64) -> KvTrace {
    let mut rng = Rng::new(cfg.seed ^ (thread + 1).wrapping_mul(0x1234_5678_9ABC));
    let mut cv = Box::new(Carver::new(cfg.chunk, &cfg.classes).expect("bench size classes fit a chunk"));
    let mut tr = KvTrace::default();
    // key → (class index, chunk, slot)
    let mut live: Vec<(usize, ObjectRef)> = Vec::new();
    let mut sum_bytes = 0f64;
    let mut sum_pages = 0f64;
    let mut sum_live = 0f64;
    let sample_every = 16usize;
    let mut samples = 0usize;
    let mut step = |tr: &mut KvTrace, cv: &Carver, tag: u8| {
        tr.ops.push(Op::End(tag));
        tr.requests += 1;
        tr.peak_bytes = tr.peak_bytes.max(cv.held_chunks() as u64 * cv.chunk_size());
        if tr.requests.is_multiple_of(sample_every) {
            sum_bytes += (cv.held_chunks() as u64 * cv.chunk_size()) as f64;
            sum_pages += page_bytes(cv) as f64;
            sum_live += cv.live_bytes() as f64;
            samples += 1;
        }
    };
    let insert = |tr: &mut KvTrace, cv: &mut Carver, rng: &mut Rng, live: &mut Vec<(usize, ObjectRef)>| {
        let ci = rng.below(cfg.classes.len() as u64) as usize;
        let class = cfg.classes[ci];
        let (o, new) = carve(cv, ci);
        if new {
            tr.ops.push(Op::Alloc);
            tr.chunk_allocs += 1;
        }
        tr.ops.push(Op::Read { len: BUCKET_BYTES, bg: false });
        tr.ops.push(Op::Write { len: class as u32, bg: false });
        tr.ops.push(Op::Write { len: SLOT_BYTES, bg: false });
        live.push((ci, o));
    };
    for _ in 0..cfg.keys_per_thread {
        insert(&mut tr, &mut cv, &mut rng, &mut live);
        step(&mut tr, &cv, INSERT);
    }
    let delete = |tr: &mut KvTrace, cv: &mut Carver, rng: &mut Rng, live: &mut Vec<(usize, ObjectRef)>| {
        let k = rng.below(live.len() as u64) as usize;
        let (_, o) = live.swap_remove(k);
        tr.ops.push(Op::Read { len: BUCKET_BYTES, bg: false });
        tr.ops.push(Op::Write { len: SLOT_BYTES, bg: false });
        if release(cv, o) {
            tr.ops.push(Op::Free);
            tr.chunk_frees += 1;
        }
    };
    for _ in 0..cfg.mixed_ops {
        let r = rng.below(100);
        if live.is_empty() {
            insert(&mut tr, &mut cv, &mut rng, &mut live);
            step(&mut tr, &cv, INSERT);
        } else if r < 50 {
            let k = rng.below(live.len() as u64) as usize;
            let len = cfg.classes[live[k].0] as u32;
            tr.ops.push(Op::Read { len: BUCKET_BYTES, bg: false });
            tr.ops.push(Op::Read { len, bg: false });
            step(&mut tr, &cv, GET);
        } else if r < 80 {
            // out-of-place update: new copy, swing the index slot, free the old copy
            let k = rng.below(live.len() as u64) as usize;
            let (ci, old) = live[k];
            let class = cfg.classes[ci];
            let (o, new) = carve(&mut cv, ci);
            if new {
                tr.ops.push(Op::Alloc);
                tr.chunk_allocs += 1;
            }
            tr.ops.push(Op::Read { len: BUCKET_BYTES, bg: false });
            tr.ops.push(Op::Write { len: class as u32, bg: false });
            tr.ops.push(Op::Write { len: SLOT_BYTES, bg: false });
            live[k] = (ci, o);
            if release(&mut cv, old) {
                tr.ops.push(Op::Free);
                tr.chunk_frees += 1;
            }
            step(&mut tr, &cv, UPDATE);
        } else if r < 90 {
            insert(&mut tr, &mut cv, &mut rng, &mut live);
            step(&mut tr, &cv, INSERT);
        } else {
            delete(&mut tr, &mut cv, &mut rng, &mut live);
            step(&mut tr, &cv, DELETE);
        }
    }
    let target = live.len() / 4;
    while live.len() > target {
        delete(&mut tr, &mut cv, &mut rng, &mut live);
        step(&mut tr, &cv, DELETE);
        if !live.is_empty() {
            let k = rng.below(live.len() as u64) as usize;
            tr.ops.push(Op::Read { len: BUCKET_BYTES, bg: false });
            tr.ops.push(Op::Read { len: cfg.classes[live[k].0] as u32, bg: false });
            step(&mut tr, &cv, GET);
        }
    }
    tr.end_bytes = cv.held_chunks() as u64 * cv.chunk_size();
    tr.end_page_bytes = page_bytes(&cv);
    tr.end_live_bytes = cv.live_bytes();
    let n = samples.max(1) as f64;
    tr.avg_bytes = sum_bytes / n;
    tr.avg_page_bytes = sum_pages / n;
    tr.avg_live_bytes = sum_live / n;
    tr
}
