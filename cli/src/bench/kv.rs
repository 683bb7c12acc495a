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
use crate::demo::Rng;

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

struct Chunk {
    class: u64,
    slots: Vec<bool>,
    live: usize,
}

struct Carver {
    chunk: u64,
    chunks: Vec<Option<Chunk>>,
    open: Vec<Option<usize>>,
    held: u64,
    live_bytes: u64,
}

impl Carver {
    /// (chunk index, slot, needed a new chunk)
    fn alloc(&mut self, class_idx: usize, class: u64) -> (usize, usize, bool) {
        let cands = |s: &Self| -> Option<usize> {
            if let Some(o) = s.open[class_idx] {
                if let Some(c) = &s.chunks[o] {
                    if c.live < c.slots.len() {
                        return Some(o);
                    }
                }
            }
            s.chunks
                .iter()
                .enumerate()
                .filter_map(|(i, c)| c.as_ref().map(|c| (i, c)))
                .filter(|(_, c)| c.class == class && c.live < c.slots.len())
                .max_by_key(|(_, c)| c.live)
                .map(|(i, _)| i)
        };
        let (ci, new) = match cands(self) {
            Some(i) => (i, false),
            None => {
                let n = (self.chunk / class).max(1) as usize;
                let c = Chunk { class, slots: vec![false; n], live: 0 };
                self.held += 1;
                match self.chunks.iter().position(|c| c.is_none()) {
                    Some(i) => {
                        self.chunks[i] = Some(c);
                        (i, true)
                    }
                    None => {
                        self.chunks.push(Some(c));
                        (self.chunks.len() - 1, true)
                    }
                }
            }
        };
        self.open[class_idx] = Some(ci);
        let c = self.chunks[ci].as_mut().expect("chunk");
        let s = c.slots.iter().position(|x| !x).expect("room");
        c.slots[s] = true;
        c.live += 1;
        self.live_bytes += class;
        (ci, s, new)
    }
    /// Returns whether the chunk became empty (and was freed).
    fn free(&mut self, ci: usize, s: usize) -> bool {
        let c = self.chunks[ci].as_mut().expect("chunk");
        c.slots[s] = false;
        c.live -= 1;
        self.live_bytes -= c.class;
        if c.live == 0 {
            self.chunks[ci] = None;
            self.held -= 1;
            for o in self.open.iter_mut() {
                if *o == Some(ci) {
                    *o = None;
                }
            }
            return true;
        }
        false
    }
    /// Bytes held at 4 KiB-page granularity (ODRP): pages of the CN's virtual space (chunk
    /// `i` at `i × chunk`) that overlap a live object.
    fn page_bytes(&self) -> u64 {
        let mut pages: Vec<u64> = Vec::new();
        for (ci, c) in self.chunks.iter().enumerate() {
            let Some(c) = c else { continue };
            for (i, _) in c.slots.iter().enumerate().filter(|(_, l)| **l) {
                let a = ci as u64 * self.chunk + i as u64 * c.class;
                let b = a + c.class;
                pages.extend(a / 4096..b.div_ceil(4096));
            }
        }
        pages.sort_unstable();
        pages.dedup();
        pages.len() as u64 * 4096
    }
}

/// Generate one client thread's KV program.
pub fn trace(cfg: &KvConfig, thread: u64) -> KvTrace {
    let mut rng = Rng::new(cfg.seed ^ (thread + 1).wrapping_mul(0x1234_5678_9ABC));
    let mut cv =
        Carver { chunk: cfg.chunk, chunks: Vec::new(), open: vec![None; cfg.classes.len()], held: 0, live_bytes: 0 };
    let mut tr = KvTrace::default();
    // key → (class index, chunk, slot)
    let mut live: Vec<(usize, usize, usize)> = Vec::new();
    let mut sum_bytes = 0f64;
    let mut sum_pages = 0f64;
    let mut sum_live = 0f64;
    let sample_every = 16usize;
    let mut samples = 0usize;
    let mut step = |tr: &mut KvTrace, cv: &Carver, tag: u8| {
        tr.ops.push(Op::End(tag));
        tr.requests += 1;
        tr.peak_bytes = tr.peak_bytes.max(cv.held * cv.chunk);
        if tr.requests.is_multiple_of(sample_every) {
            sum_bytes += (cv.held * cv.chunk) as f64;
            sum_pages += cv.page_bytes() as f64;
            sum_live += cv.live_bytes as f64;
            samples += 1;
        }
    };
    let insert = |tr: &mut KvTrace, cv: &mut Carver, rng: &mut Rng, live: &mut Vec<(usize, usize, usize)>| {
        let ci = rng.below(cfg.classes.len() as u64) as usize;
        let class = cfg.classes[ci];
        let (ch, s, new) = cv.alloc(ci, class);
        if new {
            tr.ops.push(Op::Alloc);
            tr.chunk_allocs += 1;
        }
        tr.ops.push(Op::Read { len: BUCKET_BYTES, bg: false });
        tr.ops.push(Op::Write { len: class as u32, bg: false });
        tr.ops.push(Op::Write { len: SLOT_BYTES, bg: false });
        live.push((ci, ch, s));
    };
    for _ in 0..cfg.keys_per_thread {
        insert(&mut tr, &mut cv, &mut rng, &mut live);
        step(&mut tr, &cv, INSERT);
    }
    let delete = |tr: &mut KvTrace, cv: &mut Carver, rng: &mut Rng, live: &mut Vec<(usize, usize, usize)>| {
        let k = rng.below(live.len() as u64) as usize;
        let (_, ch, s) = live.swap_remove(k);
        tr.ops.push(Op::Read { len: BUCKET_BYTES, bg: false });
        tr.ops.push(Op::Write { len: SLOT_BYTES, bg: false });
        if cv.free(ch, s) {
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
            let (ci, ch, s) = live[k];
            let class = cfg.classes[ci];
            let (nch, ns, new) = cv.alloc(ci, class);
            if new {
                tr.ops.push(Op::Alloc);
                tr.chunk_allocs += 1;
            }
            tr.ops.push(Op::Read { len: BUCKET_BYTES, bg: false });
            tr.ops.push(Op::Write { len: class as u32, bg: false });
            tr.ops.push(Op::Write { len: SLOT_BYTES, bg: false });
            live[k] = (ci, nch, ns);
            if cv.free(ch, s) {
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
    tr.end_bytes = cv.held * cv.chunk;
    tr.end_page_bytes = cv.page_bytes();
    tr.end_live_bytes = cv.live_bytes;
    let n = samples.max(1) as f64;
    tr.avg_bytes = sum_bytes / n;
    tr.avg_page_bytes = sum_pages / n;
    tr.avg_live_bytes = sum_live / n;
    tr
}
