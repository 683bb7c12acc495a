//! The example KV store on a pool of three model MNs (omw-pool's loopback pool and client):
//! its chunks spread over the MNs, every value checked by the exercise, every chunk back at its
//! own MN at the end; then a KV store keeps working while one MN drains.

use omw_kv::exercise::exercise;
use omw_kv::pool::PoolCn;
use omw_kv::KvStore;
use omw_pool::entry::ClassSpec;
use omw_pool::loopback::{LoopbackMnConfig, LoopbackPool};
use std::collections::BTreeSet;

const CLASSES: [ClassSpec; 2] =
    [ClassSpec { chunk_size: 4096, chunks: 32 }, ClassSpec { chunk_size: 16384, chunks: 8 }];

fn pool() -> LoopbackPool {
    let mut p = LoopbackPool::new("kv", LoopbackMnConfig::default()).unwrap();
    for i in 0..3 {
        p.add_mn(&format!("mn{i}"), &CLASSES).unwrap();
    }
    p
}

#[test]
fn the_kv_exercise_runs_on_a_pool_and_spreads_its_chunks() {
    let mut p = pool();
    let mut client = p.client(11).unwrap();
    let mut kv = KvStore::new(PoolCn::new(&mut client, 4096)).unwrap();
    // a checked workload; it ends with every chunk freed
    let r = exercise(&mut kv, 150).unwrap();
    assert!(r.peak_chunks >= 6, "{r:?}");
    drop(kv);
    let placed: BTreeSet<String> = client.members().into_iter().filter(|m| m.placed > 0).map(|m| m.name).collect();
    assert_eq!(placed.len(), 3, "chunks went to {placed:?}");
    p.advance(300_000_000).unwrap();
    for m in p.mns() {
        assert_eq!(m.held(), 0, "{} still holds chunks", m.name);
    }
    // a store asking for 16 KiB chunks gets the larger class
    let mut kv = KvStore::new(PoolCn::new(&mut client, 16384)).unwrap();
    kv.insert(b"big", &vec![9u8; 9000]).unwrap();
    assert_eq!(kv.get(b"big").unwrap().map(|v| v.len()), Some(9000));
    assert!(kv.delete(b"big").unwrap());
}

#[test]
fn a_kv_store_keeps_its_values_while_an_mn_drains() {
    let mut p = pool();
    let mut client = p.client(12).unwrap();
    let mut kv = KvStore::new(PoolCn::new(&mut client, 4096)).unwrap();
    for i in 0..60u32 {
        kv.insert(format!("k{i}").as_bytes(), &vec![i as u8; 900]).unwrap();
    }
    drop(kv);
    let placed_on =
        |c: &omw_pool::PoolClient<_>, n: &str| c.members().into_iter().find(|m| m.name == n).map_or(0, |m| m.placed);
    let before = placed_on(&client, "mn0");
    assert!(before > 0);
    p.drain("mn0", true).unwrap();
    p.advance(2_000_000_000).unwrap();
    let mut kv2 = KvStore::new(PoolCn::new(&mut client, 4096)).unwrap();
    for i in 0..30u32 {
        kv2.insert(format!("n{i}").as_bytes(), &vec![i as u8; 900]).unwrap();
    }
    for i in 0..30u32 {
        assert_eq!(kv2.get(format!("n{i}").as_bytes()).unwrap(), Some(vec![i as u8; 900]));
    }
    drop(kv2);
    // the second store's chunks went elsewhere
    assert_eq!(placed_on(&client, "mn0"), before);
    assert!(client.members().iter().map(|m| m.placed).sum::<u64>() > before);
}
