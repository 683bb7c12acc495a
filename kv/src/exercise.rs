//! A self-checking workload for the store — what `omw cn kv` runs against a real MN, and a
//! quick way for a new deployment to see allocation, one-sided access and chunk return work
//! end to end: insert, read back, update out of place, delete three quarters, shrink, delete
//! the rest; every value is compared with what was written, and at the end the store must
//! hold no chunk.

use crate::{CnMemory, KvError, KvStats, KvStore};
use std::fmt;

/// What the workload did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExerciseReport {
    pub inserted: usize,
    pub updated: usize,
    pub deleted: usize,
    pub reads_checked: usize,
    /// Chunks held after the inserts and updates.
    pub peak_chunks: usize,
    /// Chunks held after deleting three quarters, before and after `shrink`.
    pub sparse_chunks: usize,
    pub shrunk_chunks: usize,
    pub stats: KvStats,
}

#[derive(Debug)]
#[non_exhaustive]
pub enum ExerciseError<E> {
    Kv(KvError<E>),
    /// A read returned something else than was written (or nothing).
    Mismatch {
        key: Vec<u8>,
    },
    /// The store still holds chunks after every key died.
    Leak {
        held: usize,
    },
}

impl<E: fmt::Display> fmt::Display for ExerciseError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExerciseError::Kv(e) => write!(f, "{e}"),
            ExerciseError::Mismatch { key } => {
                write!(f, "key {:?} read back differently than written", String::from_utf8_lossy(key))
            }
            ExerciseError::Leak { held } => write!(f, "{held} chunk(s) still held after every key died"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for ExerciseError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ExerciseError::Kv(e) => Some(e),
            _ => None,
        }
    }
}

impl<E> From<KvError<E>> for ExerciseError<E> {
    fn from(e: KvError<E>) -> Self {
        ExerciseError::Kv(e)
    }
}

/// Deterministic bytes for key `i` of generation `g`.
fn value(i: usize, g: u64, len: usize) -> Vec<u8> {
    let s = (i as u64).wrapping_mul(0x9E37_79B9).wrapping_add(g.wrapping_mul(131));
    (0..len).map(|j| (s.wrapping_add(j as u64 * 17) % 251) as u8).collect()
}

/// Run the workload with `keys` keys (values up to a quarter chunk; updates up to half).
pub fn exercise<M: CnMemory>(kv: &mut KvStore<M>, keys: usize) -> Result<ExerciseReport, ExerciseError<M::Error>> {
    let quarter = (kv.max_payload() / 4).max(1) as usize;
    let key = |i: usize| format!("exercise-{i:06}").into_bytes();
    let mut live: Vec<Option<Vec<u8>>> = Vec::with_capacity(keys);
    let mut r = ExerciseReport::default();
    let check = |kv: &mut KvStore<M>, live: &[Option<Vec<u8>>], r: &mut ExerciseReport| {
        for (i, v) in live.iter().enumerate() {
            let got = kv.get(&key(i))?;
            if got.as_ref() != v.as_ref() {
                return Err(ExerciseError::Mismatch { key: key(i) });
            }
            r.reads_checked += 1;
        }
        Ok(())
    };
    for i in 0..keys {
        let v = value(i, 0, 1 + (i * 37) % quarter);
        kv.insert(&key(i), &v)?;
        live.push(Some(v));
        r.inserted += 1;
    }
    check(kv, &live, &mut r)?;
    for i in (0..keys).step_by(3) {
        let v = value(i, 1, quarter + (i * 13) % quarter);
        kv.update(&key(i), &v)?;
        live[i] = Some(v);
        r.updated += 1;
    }
    check(kv, &live, &mut r)?;
    r.peak_chunks = kv.held_chunks();
    for (i, v) in live.iter_mut().enumerate() {
        if i % 4 != 0 {
            kv.delete(&key(i))?;
            *v = None;
            r.deleted += 1;
        }
    }
    check(kv, &live, &mut r)?;
    r.sparse_chunks = kv.held_chunks();
    kv.shrink()?;
    r.shrunk_chunks = kv.held_chunks();
    check(kv, &live, &mut r)?;
    for (i, v) in live.iter_mut().enumerate() {
        if v.take().is_some() {
            kv.delete(&key(i))?;
            r.deleted += 1;
        }
    }
    check(kv, &live, &mut r)?;
    if kv.held_chunks() != 0 {
        return Err(ExerciseError::Leak { held: kv.held_chunks() });
    }
    r.stats = kv.stats();
    Ok(r)
}
