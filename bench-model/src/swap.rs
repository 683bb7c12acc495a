//! A swap-style workload (Fastswap-like): an application thread touches 4 KiB pages of a
//! working set larger than its local memory; misses are paged in with a synchronous READ on
//! the *sync* access QP, sequential misses trigger a readahead of the next pages on the
//! *prefetch* access QP (background), and evicted dirty pages are written back. Remote swap
//! space is allocated in 1 MiB chunks (group size 3: Free QP + sync QP + prefetch QP) when a
//! region is first written back, and freed when the application unmaps it.
//!
//! Phases: grow (first touch of every page), steady (70 % sequential runs, 30 % random
//! pages), shrink (the upper half is unmapped; remote copies are discarded), steady again on
//! the lower half. Local memory holds half the working set (CLOCK replacement).

use super::schemes::Op;
use crate::rng::Rng;

pub const HIT: u8 = 0;
pub const FAULT: u8 = 1;
pub const PAGE: u64 = 4096;

#[derive(Clone, Debug)]
pub struct SwapConfig {
    pub pages: usize,
    pub local_pages: usize,
    pub accesses: usize,
    /// Pages per remote allocation (256 = 1 MiB chunks; 1 for ODRP's 4 KiB pages).
    pub region_pages: usize,
    pub readahead: usize,
    /// Application compute per access (ns).
    pub compute_ns: u32,
    pub write_pct: u64,
    pub seed: u64,
}

#[derive(Clone, Debug, Default)]
pub struct SwapTrace {
    pub ops: Vec<Op>,
    pub accesses: usize,
    pub faults: u64,
    pub prefetched: u64,
    pub writebacks: u64,
    pub allocs: u64,
    pub frees: u64,
    /// Remote bytes: reserved by regions (average over accesses, and peak) and holding live
    /// page copies (average).
    pub avg_reserved: f64,
    pub peak_reserved: u64,
    pub end_reserved: u64,
    pub avg_remote_live: f64,
}

struct State {
    local: Vec<bool>,
    dirty: Vec<bool>,
    referenced: Vec<bool>,
    remote: Vec<bool>,
    mapped: Vec<bool>,
    frames: Vec<usize>,
    hand: usize,
    region_live: Vec<u32>,
    region_backed: Vec<bool>,
    backed: u64,
    remote_pages: u64,
}

/// Generate one application thread's program.
pub fn trace(cfg: &SwapConfig, thread: u64) -> SwapTrace {
    let n = cfg.pages;
    let rp = cfg.region_pages.max(1);
    let regions = n.div_ceil(rp);
    let mut st = State {
        local: vec![false; n],
        dirty: vec![false; n],
        referenced: vec![false; n],
        remote: vec![false; n],
        mapped: vec![true; n],
        frames: Vec::new(),
        hand: 0,
        region_live: vec![0; regions],
        region_backed: vec![false; regions],
        backed: 0,
        remote_pages: 0,
    };
    let mut tr = SwapTrace::default();
    let mut rng = Rng::new(cfg.seed ^ (thread + 7).wrapping_mul(0x51A9_0000_0001));
    let mut sum_res = 0f64;
    let mut sum_live = 0f64;
    let mut last_miss = usize::MAX;

    // evict one frame (CLOCK), writing it back if needed
    fn evict(st: &mut State, tr: &mut SwapTrace, rp: usize) {
        loop {
            if st.frames.is_empty() {
                return;
            }
            st.hand %= st.frames.len();
            let p = st.frames[st.hand];
            if st.referenced[p] {
                st.referenced[p] = false;
                st.hand += 1;
                continue;
            }
            st.frames.swap_remove(st.hand);
            st.local[p] = false;
            if st.dirty[p] || !st.remote[p] {
                let r = p / rp;
                if !st.region_backed[r] {
                    st.region_backed[r] = true;
                    st.backed += 1;
                    tr.ops.push(Op::Alloc);
                    tr.allocs += 1;
                }
                tr.ops.push(Op::Write { len: PAGE as u32, bg: false });
                tr.writebacks += 1;
                if !st.remote[p] {
                    st.remote[p] = true;
                    st.region_live[r] += 1;
                    st.remote_pages += 1;
                }
                st.dirty[p] = false;
            }
            return;
        }
    }
    let bring_in = |st: &mut State, tr: &mut SwapTrace, p: usize| {
        while st.frames.len() >= cfg.local_pages {
            evict(st, tr, rp);
        }
        st.frames.push(p);
        st.local[p] = true;
        st.referenced[p] = true;
    };

    let mut access = |st: &mut State, tr: &mut SwapTrace, rng: &mut Rng, p: usize| {
        let write = rng.below(100) < cfg.write_pct;
        tr.ops.push(Op::Compute(cfg.compute_ns));
        let tag = if st.local[p] {
            st.referenced[p] = true;
            HIT
        } else {
            tr.faults += 1;
            if st.remote[p] {
                tr.ops.push(Op::Read { len: PAGE as u32, bg: false });
            }
            bring_in(st, tr, p);
            // sequential miss: read ahead on the prefetch QP
            if last_miss != usize::MAX && p == last_miss + 1 {
                for q in p + 1..(p + 1 + cfg.readahead).min(n) {
                    if st.mapped[q] && !st.local[q] && st.remote[q] {
                        tr.ops.push(Op::Read { len: PAGE as u32, bg: true });
                        tr.prefetched += 1;
                        bring_in(st, tr, q);
                        st.referenced[q] = false;
                    }
                }
            }
            last_miss = p;
            FAULT
        };
        if write {
            st.dirty[p] = true;
        }
        tr.ops.push(Op::End(tag));
        tr.accesses += 1;
        sum_res += (st.backed * rp as u64 * PAGE) as f64;
        sum_live += (st.remote_pages * PAGE) as f64;
        tr.peak_reserved = tr.peak_reserved.max(st.backed * rp as u64 * PAGE);
    };

    let steady = |st: &mut State,
                  tr: &mut SwapTrace,
                  rng: &mut Rng,
                  upto: usize,
                  count: usize,
                  access: &mut dyn FnMut(&mut State, &mut SwapTrace, &mut Rng, usize)| {
        let mut done = 0;
        while done < count {
            if rng.below(100) < 70 {
                let start = rng.below(upto as u64) as usize;
                let len = 16 + rng.below(48) as usize;
                for p in start..(start + len).min(upto) {
                    access(st, tr, rng, p);
                    done += 1;
                }
            } else {
                let p = rng.below(upto as u64) as usize;
                access(st, tr, rng, p);
                done += 1;
            }
        }
    };
    // grow
    for p in 0..n {
        access(&mut st, &mut tr, &mut rng, p);
    }
    let half = cfg.accesses / 2;
    steady(&mut st, &mut tr, &mut rng, n, half, &mut access);
    // shrink: unmap the upper half
    let keep = n / 2;
    for p in keep..n {
        st.mapped[p] = false;
        if st.local[p] {
            st.local[p] = false;
            if let Some(i) = st.frames.iter().position(|&f| f == p) {
                st.frames.swap_remove(i);
            }
        }
        if st.remote[p] {
            st.remote[p] = false;
            st.remote_pages -= 1;
            let r = p / rp;
            st.region_live[r] -= 1;
            if st.region_live[r] == 0 && st.region_backed[r] && r * rp >= keep {
                st.region_backed[r] = false;
                st.backed -= 1;
                tr.ops.push(Op::Free);
                tr.frees += 1;
            }
        }
    }
    steady(&mut st, &mut tr, &mut rng, keep, cfg.accesses - half, &mut access);
    tr.end_reserved = st.backed * rp as u64 * PAGE;
    let k = tr.accesses.max(1) as f64;
    tr.avg_reserved = sum_res / k;
    tr.avg_remote_live = sum_live / k;
    tr
}
