//! The example KV store on the loopback cluster (both execution modes): insert, get, update,
//! delete, shrink, with every value read back and checked, and the MN's free queue watched to
//! see chunks go back as keys die.

use omw_core::device::ExecutionMode;
use omw_core::wire::message::ErrorCode;
use omw_kv::loopback::{LoopbackCn, LoopbackError};
use omw_kv::{KvError, KvStore};
use omw_loopback::cluster::{Cluster, ClusterConfig, CnOpError};
use omw_loopback::NicConfig;
use proptest::prelude::*;
use std::collections::HashMap;

const CHUNKS: u32 = 32;

/// `CHUNKS` chunks of 4 KiB; the quota above the pool, so a full pool says "empty".
fn cluster(mode: ExecutionMode) -> Cluster {
    sized(mode, CHUNKS)
}

fn sized(mode: ExecutionMode, chunks: u32) -> Cluster {
    let mut cfg = ClusterConfig { cns: 1, chunks, quota: chunks + 1, ..ClusterConfig::paper_like() };
    cfg.mode = Some(mode);
    if mode == ExecutionMode::HostEngine {
        cfg.nic = NicConfig::strict().with_offload(false).with_prefetch(8);
    }
    Cluster::new(cfg).unwrap()
}

fn value(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed.wrapping_mul(131).wrapping_add(i as u64 * 17) % 251) as u8).collect()
}

/// MN free groups + the store's chunks = the pool: nothing leaks, nothing is held twice.
fn accounted(kv: &mut KvStore<LoopbackCn<'_>>) {
    let held = kv.held_chunks() as u32;
    assert_eq!(kv.memory().cluster.unallocated() + held, CHUNKS, "MN free + held = pool");
    kv.memory().cluster.check_invariants().unwrap();
}

fn scenario(mode: ExecutionMode) {
    let mut c = cluster(mode);
    let mut kv = KvStore::new(LoopbackCn::new(&mut c, 0, 0)).unwrap();
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    // insert: 48 keys of 10 B – 1 KiB values
    for i in 0..48u64 {
        let k = format!("key-{i:03}").into_bytes();
        let v = value(i, 10 + (i as usize * 37) % 1000);
        kv.insert(&k, &v).unwrap();
        model.insert(k, v);
    }
    assert!(matches!(kv.insert(b"key-000", b"x"), Err(KvError::Exists)));
    accounted(&mut kv);
    let peak = kv.held_chunks();
    for (k, v) in &model {
        assert_eq!(kv.get(k).unwrap().as_ref(), Some(v));
    }
    // update: every third key, to another size class
    for i in (0..48u64).step_by(3) {
        let k = format!("key-{i:03}").into_bytes();
        let v = value(i + 1000, 1100 + i as usize);
        kv.update(&k, &v).unwrap();
        model.insert(k, v);
    }
    assert!(matches!(kv.update(b"nope", b"x"), Err(KvError::NotFound)));
    for (k, v) in &model {
        assert_eq!(kv.get(k).unwrap().as_ref(), Some(v));
    }
    accounted(&mut kv);
    // delete three quarters, scattered: chunks go back as their last object dies
    let freed0 = kv.stats().chunks_freed;
    for i in 0..48u64 {
        if i % 4 != 0 {
            let k = format!("key-{i:03}").into_bytes();
            assert!(kv.delete(&k).unwrap());
            model.remove(&k);
        }
    }
    assert!(!kv.delete(b"key-001").unwrap());
    assert_eq!(kv.get(b"key-001").unwrap(), None);
    assert!(kv.stats().chunks_freed > freed0, "deletes returned chunks to the MN");
    accounted(&mut kv);
    // shrink: sparse chunks' objects move together, more chunks go back
    let before = kv.held_chunks();
    let back = kv.shrink().unwrap();
    assert!(back > 0 && kv.stats().objects_moved > 0, "shrink gave chunks back ({before} held)");
    assert_eq!(kv.held_chunks(), before - back);
    assert!(kv.held_chunks() < peak);
    for (k, v) in &model {
        assert_eq!(kv.get(k).unwrap().as_ref(), Some(v), "after shrink");
    }
    accounted(&mut kv);
    // the rest dies: every chunk is back at the MN
    let keys: Vec<Vec<u8>> = model.keys().cloned().collect();
    for k in keys {
        assert!(kv.delete(&k).unwrap());
    }
    assert_eq!(kv.held_chunks(), 0);
    accounted(&mut kv);
    assert_eq!(kv.memory().cluster.unallocated(), CHUNKS);
}

#[test]
fn insert_get_update_delete_shrink_host_engine() {
    scenario(ExecutionMode::HostEngine);
}

#[test]
fn insert_get_update_delete_shrink_offloaded() {
    scenario(ExecutionMode::Offloaded);
}

/// A full pool is a typed error; the store stays consistent and recovers when keys die.
#[test]
fn full_pool_is_an_error_and_recovers() {
    let mut c = cluster(ExecutionMode::HostEngine);
    let mut kv = KvStore::new(LoopbackCn::new(&mut c, 0, 0)).unwrap();
    let big = value(7, 3000); // one 4 KiB object per chunk
    for i in 0..CHUNKS {
        kv.insert(format!("big-{i}").as_bytes(), &big).unwrap();
    }
    let e = kv.insert(b"one-more", &big).unwrap_err();
    assert!(matches!(e, KvError::Memory(LoopbackError(CnOpError::Mn(ErrorCode::Empty)))), "{e}");
    assert_eq!(kv.len(), CHUNKS as usize);
    let too_big = vec![0u8; 5000];
    assert!(matches!(kv.insert(b"huge", &too_big), Err(KvError::TooLarge { .. })));
    assert!(kv.delete(b"big-3").unwrap());
    // the MN said "available" when the chunk came back: the next insert gets it
    kv.memory().cluster.pump().unwrap();
    kv.insert(b"one-more", &big).unwrap();
    assert_eq!(kv.get(b"one-more").unwrap().as_deref(), Some(&big[..]));
    accounted(&mut kv);
    kv.clear().unwrap();
    assert_eq!(kv.memory().cluster.unallocated(), CHUNKS);
}

#[derive(Clone, Debug)]
enum Op {
    Insert(u8, u16),
    Update(u8, u16),
    Delete(u8),
    Get(u8),
    Shrink,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        4 => (0u8..24, 0u16..2500).prop_map(|(k, n)| Op::Insert(k, n)),
        2 => (0u8..24, 0u16..2500).prop_map(|(k, n)| Op::Update(k, n)),
        3 => (0u8..24).prop_map(Op::Delete),
        2 => (0u8..24).prop_map(Op::Get),
        1 => Just(Op::Shrink),
    ];
    proptest::collection::vec(op, 1..60)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    /// Against a HashMap: every answer matches, and MN free + held = pool after every step.
    #[test]
    fn matches_a_hashmap(ops in ops(), small in any::<bool>()) {
        // a pool of 6 chunks runs out often: "empty" must leave the store consistent
        let chunks = if small { 6 } else { CHUNKS };
        let mut c = sized(ExecutionMode::HostEngine, chunks);
        let mut kv = KvStore::new(LoopbackCn::new(&mut c, 0, 0)).unwrap();
        let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
        for (n, op) in ops.into_iter().enumerate() {
            match op {
                Op::Insert(k, len) => {
                    let key = vec![b'k', k];
                    let v = value(n as u64, len as usize);
                    match kv.insert(&key, &v) {
                        Ok(()) => { prop_assert!(model.insert(key, v).is_none()); }
                        Err(KvError::Exists) => prop_assert!(model.contains_key(&key)),
                        Err(KvError::Memory(e)) if e.is_pool_empty() => {
                            kv.memory().cluster.pump().unwrap();
                        }
                        Err(e) => prop_assert!(false, "{}", e),
                    }
                }
                Op::Update(k, len) => {
                    let key = vec![b'k', k];
                    let v = value(n as u64 + 7, len as usize);
                    match kv.update(&key, &v) {
                        Ok(()) => { prop_assert!(model.insert(key, v).is_some()); }
                        Err(KvError::NotFound) => prop_assert!(!model.contains_key(&key)),
                        Err(KvError::Memory(e)) if e.is_pool_empty() => {
                            kv.memory().cluster.pump().unwrap();
                        }
                        Err(e) => prop_assert!(false, "{}", e),
                    }
                }
                Op::Delete(k) => {
                    let key = vec![b'k', k];
                    prop_assert_eq!(kv.delete(&key).unwrap(), model.remove(&key).is_some());
                }
                Op::Get(k) => {
                    let key = vec![b'k', k];
                    prop_assert_eq!(kv.get(&key).unwrap(), model.get(&key).cloned());
                }
                Op::Shrink => { kv.shrink().unwrap(); }
            }
            let held = kv.held_chunks() as u32;
            prop_assert_eq!(kv.memory().cluster.unallocated() + held, chunks);
        }
        for (k, v) in &model {
            prop_assert_eq!(kv.get(k).unwrap(), Some(v.clone()));
        }
    }
}

/// The self-checking workload `omw cn kv` runs: clean on both modes, every chunk back.
#[test]
fn exercise_workload_on_both_modes() {
    for mode in [ExecutionMode::HostEngine, ExecutionMode::Offloaded] {
        let mut c = cluster(mode);
        let mut kv = KvStore::new(LoopbackCn::new(&mut c, 0, 1)).unwrap();
        let r = omw_kv::exercise::exercise(&mut kv, 60).unwrap();
        assert_eq!((r.inserted, r.updated, r.deleted), (60, 20, 60));
        assert!(r.shrunk_chunks <= r.sparse_chunks && r.sparse_chunks <= r.peak_chunks, "{r:?}");
        assert_eq!(r.stats.chunks_allocated, r.stats.chunks_freed);
        assert_eq!(kv.memory().cluster.unallocated(), CHUNKS);
    }
}
