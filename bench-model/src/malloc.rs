//! Allocation traces shaped like mimalloc-bench's (github.com/daanx/mimalloc-bench, the suite
//! FineMem's micro-benchmarks draw from), generated here — nothing is downloaded. Each thread
//! mallocs and frees objects of remote memory through the CN's object allocator (size classes
//! carved from MN chunks), writing each object once it has it:
//!
//! - **larson** (Larson & Krishnan, ISMM'98, "Memory allocation for long-running server
//!   applications"; mimalloc-bench runs `larson 5 8 1000 5000 100 4141 N`): every thread keeps
//!   an array of blocks of 8-1000 bytes and replaces a random one again and again — free it,
//!   malloc a new one of a random size;
//! - **sh8bench** (MicroQuill's SmartHeap stress test, as mimalloc-bench describes it): batches
//!   of objects allocated and then freed, some batches in last-allocated-first-freed order,
//!   others in allocation order (sizes ours: 8-1000 bytes, as larson's).
//!
//! A request is one malloc or one free (its latency recorded under `MALLOC` / `FREE`).

use super::kv::{KvTrace, Store};
use super::schemes::Op;
use crate::rng::Rng;
use omw_core::cn::object_alloc::ObjectRef;

pub const MALLOC: u8 = 1;
pub const FREE: u8 = 3;

/// Size classes the CN carves (power-of-two, 16 B-1 KiB): larson's 8-1000 B rounded up.
pub const CLASSES: [u64; 7] = [16, 32, 64, 128, 256, 512, 1024];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    Larson,
    Sh8bench,
}

impl Shape {
    pub const ALL: [Shape; 2] = [Shape::Larson, Shape::Sh8bench];
    pub fn name(self) -> &'static str {
        match self {
            Shape::Larson => "larson (random replacement, 8-1000 B)",
            Shape::Sh8bench => "sh8bench (batches freed LIFO or FIFO, 8-1000 B)",
        }
    }
}

fn malloc(st: &mut Store, rng: &mut Rng) -> ObjectRef {
    let size = 8 + rng.below(993);
    let ci = st.class_for(size);
    let o = st.carve(ci);
    // the program writes what it allocated
    st.op(Op::Write { len: size as u32, bg: false });
    st.step(MALLOC);
    o
}

fn free(st: &mut Store, o: ObjectRef) {
    st.release(o);
    st.step(FREE);
}

/// One thread's trace: `blocks` objects live at a time, `ops` mallocs after the warm-up.
pub fn trace(shape: Shape, chunk: u64, blocks: usize, ops: usize, seed: u64, thread: u64) -> KvTrace {
    let mut rng = Rng::new(seed ^ (thread + 7).wrapping_mul(0x0BAD_5EED_1234));
    let mut st = Store::new(chunk, &CLASSES);
    match shape {
        Shape::Larson => {
            let mut live: Vec<ObjectRef> = (0..blocks).map(|_| malloc(&mut st, &mut rng)).collect();
            for _ in 0..ops {
                let i = rng.below(live.len() as u64) as usize;
                free(&mut st, live[i]);
                live[i] = malloc(&mut st, &mut rng);
            }
        }
        Shape::Sh8bench => {
            let batch = blocks.max(2);
            let mut done = 0;
            let mut round = 0u64;
            while done < ops {
                let mut live: Vec<ObjectRef> = (0..batch).map(|_| malloc(&mut st, &mut rng)).collect();
                done += batch;
                if round.is_multiple_of(2) {
                    while let Some(o) = live.pop() {
                        free(&mut st, o);
                    }
                } else {
                    for o in live {
                        free(&mut st, o);
                    }
                }
                round += 1;
            }
        }
    }
    st.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_allocate_and_give_chunks_back() {
        let l = trace(Shape::Larson, 4096, 500, 5000, 1, 0);
        assert_eq!(l.requests, 500 + 2 * 5000);
        assert!(l.chunk_allocs > 0);
        let s = trace(Shape::Sh8bench, 4096, 500, 5000, 1, 0);
        assert!(s.chunk_frees > 0 && s.chunk_frees == s.chunk_allocs, "every batch freed: every chunk back");
        assert_eq!(s.end_live_bytes, 0);
    }
}
