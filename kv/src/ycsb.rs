//! A YCSB-style driver for [`AsyncKv`]: the core workloads A–D (Cooper et al., SoCC'10) with
//! YCSB's request distributions — scrambled Zipfian (θ = 0.99) for A–C, "latest" for D — as
//! FUSEE evaluates disaggregated KV stores (DESIGN.md §11: 100 k keys, 1 KiB values; the tests
//! scale the key count down and keep the distribution).
//!
//! | workload | mix | keys |
//! |---|---|---|
//! | A | 50 % read, 50 % update | scrambled Zipfian |
//! | B | 95 % read, 5 % update | scrambled Zipfian |
//! | C | 100 % read | scrambled Zipfian |
//! | D | 95 % read, 5 % insert | latest (reads favour the newest keys) |
//!
//! Every value names its key and version and is filled from them, so every read is checked:
//! a value that is not its key's, or torn, fails the run.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use omw_kv::ycsb::{Workload, YcsbConfig};
//! let model = omw_client::model::Model::start(omw_client::model::ModelConfig { chunks: 64, ..Default::default() }).unwrap();
//! let cn = omw_client::AsyncCn::new(omw_client::Cn::connect(&model, Default::default()).unwrap()).unwrap();
//! let kv = std::sync::Arc::new(omw_kv::async_store::AsyncKv::new(cn).unwrap());
//! let cfg = YcsbConfig { keys: 40, value_len: 256, ops: 200, concurrency: 4, seed: 1 };
//! omw_kv::ycsb::load(&kv, &cfg).await.unwrap();
//! let r = omw_kv::ycsb::run(&kv, Workload::A, &cfg).await.unwrap();
//! assert_eq!(r.reads + r.updates, 200);
//! # }
//! ```

use crate::async_store::{AsyncKv, AsyncKvError};
use omw_client::transport::Transport;
use omw_core::rng::SeededRng;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// YCSB's Zipfian constant.
pub const ZIPF_THETA: f64 = 0.99;

/// The core workloads.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Workload {
    A,
    B,
    C,
    D,
}

impl Workload {
    pub const ALL: [Workload; 4] = [Workload::A, Workload::B, Workload::C, Workload::D];
    /// Per mille of reads; the rest are updates (A–C) or inserts (D).
    fn read_per_mille(self) -> u64 {
        match self {
            Workload::A => 500,
            Workload::B | Workload::D => 950,
            Workload::C => 1000,
        }
    }
}

/// One run's size.
#[derive(Clone, Copy, Debug)]
pub struct YcsbConfig {
    /// Keys loaded before the run (FUSEE: 100 000).
    pub keys: u64,
    /// Bytes per value (FUSEE: 1024).
    pub value_len: usize,
    /// Operations in the run.
    pub ops: u64,
    /// Operations in flight at once (tasks).
    pub concurrency: usize,
    pub seed: u64,
}

/// YCSB's Zipfian generator (Gray et al., "Quickly generating billion-record synthetic
/// databases", SIGMOD'94, as YCSB's `ZipfianGenerator` implements it): rank 0 is the most
/// popular of `n`.
#[derive(Clone, Debug)]
pub struct Zipf {
    n: u64,
    theta: f64,
    alpha: f64,
    zetan: f64,
    eta: f64,
}

fn zeta(n: u64, theta: f64) -> f64 {
    (1..=n).map(|i| 1.0 / (i as f64).powf(theta)).sum()
}

impl Zipf {
    pub fn new(n: u64, theta: f64) -> Zipf {
        let n = n.max(1);
        let zetan = zeta(n, theta);
        let zeta2 = zeta(2, theta);
        let alpha = 1.0 / (1.0 - theta);
        let eta = (1.0 - (2.0 / n as f64).powf(1.0 - theta)) / (1.0 - zeta2 / zetan);
        Zipf { n, theta, alpha, zetan, eta }
    }
    /// A rank in `0..n`.
    pub fn sample(&self, rng: &mut SeededRng) -> u64 {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let uz = u * self.zetan;
        if uz < 1.0 {
            return 0;
        }
        if uz < 1.0 + 0.5f64.powf(self.theta) {
            return 1.min(self.n - 1);
        }
        let r = (self.n as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64;
        r.min(self.n - 1)
    }
}

/// FNV-1a over a u64 (YCSB scrambles Zipfian ranks with a 64-bit FNV hash so the popular keys
/// are spread over the key space).
fn fnv64(v: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in v.to_le_bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn key(i: u64) -> Vec<u8> {
    format!("user{i:010}").into_bytes()
}

/// A value that names its key and version, the rest filled from both.
fn value(k: u64, version: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len.max(16));
    v.extend_from_slice(&k.to_le_bytes());
    v.extend_from_slice(&version.to_le_bytes());
    let seed = fnv64(k ^ version.rotate_left(32));
    v.extend((16..len.max(16)).map(|i| (seed.wrapping_add(i as u64 * 0x9E37) >> 7) as u8));
    v
}

fn check(k: u64, v: &[u8], len: usize) -> bool {
    if v.len() != len.max(16) {
        return false;
    }
    let vk = u64::from_le_bytes(v[..8].try_into().unwrap_or_default());
    let ver = u64::from_le_bytes(v[8..16].try_into().unwrap_or_default());
    vk == k && v == value(k, ver, len).as_slice()
}

/// Why a run failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum YcsbError {
    Kv(AsyncKvError),
    /// A read returned bytes that are not a version of its key's value.
    BadValue {
        key: u64,
    },
    /// A loaded key was not found.
    Missing {
        key: u64,
    },
}

impl fmt::Display for YcsbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            YcsbError::Kv(e) => write!(f, "{e}"),
            YcsbError::BadValue { key } => write!(f, "key {key}: the value read is not one of its versions"),
            YcsbError::Missing { key } => write!(f, "key {key} is missing"),
        }
    }
}
impl std::error::Error for YcsbError {}
impl From<AsyncKvError> for YcsbError {
    fn from(e: AsyncKvError) -> Self {
        YcsbError::Kv(e)
    }
}

/// What a run did and how fast (wall clock of the machine it ran on).
#[derive(Clone, Debug, Default)]
pub struct YcsbReport {
    pub reads: u64,
    pub updates: u64,
    pub inserts: u64,
    pub elapsed: Duration,
    /// Latency percentiles of all operations (p50, p99).
    pub p50: Duration,
    pub p99: Duration,
}

impl YcsbReport {
    pub fn ops_per_sec(&self) -> f64 {
        (self.reads + self.updates + self.inserts) as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

impl fmt::Display for YcsbReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} reads, {} updates, {} inserts in {:.3} s: {:.0} ops/s, p50 {:?}, p99 {:?}",
            self.reads,
            self.updates,
            self.inserts,
            self.elapsed.as_secs_f64(),
            self.ops_per_sec(),
            self.p50,
            self.p99
        )
    }
}

/// Insert keys `0..cfg.keys` (version 0), `cfg.concurrency` at a time.
pub async fn load<T: Transport>(kv: &Arc<AsyncKv<T>>, cfg: &YcsbConfig) -> Result<(), YcsbError> {
    let next = Arc::new(AtomicU64::new(0));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..cfg.concurrency.max(1) {
        let (kv, next, cfg) = (kv.clone(), next.clone(), *cfg);
        set.spawn(async move {
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= cfg.keys {
                    return Ok::<(), YcsbError>(());
                }
                kv.insert(&key(k), &value(k, 0, cfg.value_len)).await?;
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.map_err(|_| YcsbError::Missing { key: u64::MAX })??;
    }
    Ok(())
}

/// Run `w` for `cfg.ops` operations with `cfg.concurrency` in flight; every read checked.
pub async fn run<T: Transport>(kv: &Arc<AsyncKv<T>>, w: Workload, cfg: &YcsbConfig) -> Result<YcsbReport, YcsbError> {
    let zipf = Arc::new(Zipf::new(cfg.keys, ZIPF_THETA));
    // D: keys grow as it inserts; reads favour the newest
    let inserted = Arc::new(AtomicU64::new(cfg.keys));
    let issued = Arc::new(AtomicU64::new(0));
    let lat = Arc::new(Mutex::new(Vec::with_capacity(cfg.ops as usize)));
    let counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let t0 = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for task in 0..cfg.concurrency.max(1) {
        let (kv, zipf, inserted, issued, lat, counts, cfg) =
            (kv.clone(), zipf.clone(), inserted.clone(), issued.clone(), lat.clone(), counts.clone(), *cfg);
        set.spawn(async move {
            let mut rng = SeededRng::new(cfg.seed ^ (task as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut version = 1u64 + ((task as u64) << 40);
            let mut mine = Vec::new();
            while issued.fetch_add(1, Ordering::Relaxed) < cfg.ops {
                let read = rng.below(1000) < w.read_per_mille();
                let n = inserted.load(Ordering::Relaxed);
                let k = match w {
                    Workload::D => n - 1 - zipf.sample(&mut rng).min(n - 1),
                    _ => fnv64(zipf.sample(&mut rng)) % cfg.keys,
                };
                let t = Instant::now();
                if read {
                    match kv.get(&key(k)).await? {
                        Some(v) if check(k, &v, cfg.value_len) => {}
                        Some(_) => return Err(YcsbError::BadValue { key: k }),
                        // D: an insert another task counted but has not finished
                        None if w == Workload::D && k >= cfg.keys => {}
                        None => return Err(YcsbError::Missing { key: k }),
                    }
                    counts[0].fetch_add(1, Ordering::Relaxed);
                } else if w == Workload::D {
                    let k = inserted.fetch_add(1, Ordering::Relaxed);
                    kv.insert(&key(k), &value(k, 0, cfg.value_len)).await?;
                    counts[2].fetch_add(1, Ordering::Relaxed);
                } else {
                    kv.update(&key(k), &value(k, version, cfg.value_len)).await?;
                    version += 1;
                    counts[1].fetch_add(1, Ordering::Relaxed);
                }
                mine.push(t.elapsed());
            }
            lat.lock().unwrap_or_else(|p| p.into_inner()).extend(mine);
            Ok::<(), YcsbError>(())
        });
    }
    while let Some(r) = set.join_next().await {
        r.map_err(|_| YcsbError::Missing { key: u64::MAX })??;
    }
    let elapsed = t0.elapsed();
    let mut l = std::mem::take(&mut *lat.lock().unwrap_or_else(|p| p.into_inner()));
    l.sort_unstable();
    let pct =
        |p: f64| l.get(((l.len() as f64 * p) as usize).min(l.len().saturating_sub(1))).copied().unwrap_or_default();
    Ok(YcsbReport {
        reads: counts[0].load(Ordering::Relaxed),
        updates: counts[1].load(Ordering::Relaxed),
        inserts: counts[2].load(Ordering::Relaxed),
        elapsed,
        p50: pct(0.50),
        p99: pct(0.99),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_is_skewed_like_ycsb_and_stays_in_range() {
        let z = Zipf::new(1000, ZIPF_THETA);
        let mut rng = SeededRng::new(7);
        let mut hist = vec![0u32; 1000];
        for _ in 0..100_000 {
            hist[z.sample(&mut rng) as usize] += 1;
        }
        // θ = 0.99 over 1000 keys: rank 0 takes about 1/ζ(1000) ≈ 13 % of requests, the top
        // 10 % of keys well over half, and rank i about 1/i^θ of rank 0
        let top: u32 = hist[..100].iter().sum();
        assert!((11_000..15_500).contains(&hist[0]), "rank 0: {}", hist[0]);
        assert!(top > 55_000, "top 10 %: {top}");
        assert!(hist[1] * 10 < hist[0] * 7 && hist[1] * 10 > hist[0] * 3, "{} vs {}", hist[1], hist[0]);
        assert!(hist.iter().skip(500).any(|h| *h > 0), "the tail is reached");
    }

    #[test]
    fn values_check_their_key_and_version() {
        let v = value(42, 7, 1024);
        assert!(check(42, &v, 1024));
        assert!(!check(41, &v, 1024));
        let mut torn = v.clone();
        torn[900] ^= 1;
        assert!(!check(42, &torn, 1024));
        assert!(!check(42, &v[..1000], 1024));
    }

    #[test]
    fn scrambling_spreads_the_hot_ranks() {
        let hot: Vec<u64> = (0..10).map(|r| fnv64(r) % 1000).collect();
        let mut d = hot.clone();
        d.sort_unstable();
        d.dedup();
        assert!(d.len() >= 9, "{hot:?}");
        assert!(hot.iter().any(|k| *k > 500));
    }
}
