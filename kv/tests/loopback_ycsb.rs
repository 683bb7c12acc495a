//! The async KV store (omw-client futures, zero-copy records, the reserve) under the YCSB
//! core workloads A–D with Zipf θ = 0.99 on the loopback model: 1 KiB values as FUSEE's, the
//! key count scaled down from its 100 k. Every read is checked; afterwards every chunk is
//! accounted for (held by the store or back at the MN) and the MN's invariants hold.

use omw_client::model::{Model, ModelConfig};
use omw_client::{AsyncCn, Cn, Options, ReservePolicy};
use omw_kv::async_store::AsyncKv;
use omw_kv::ycsb::{self, Workload, YcsbConfig};
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ycsb_a_to_d_on_the_model() {
    // 16 KiB chunks (the paper's KV store), records of ~1 KiB in the 2 KiB class
    let m = Model::start(ModelConfig { chunk_size: 16 << 10, chunks: 128, ..Default::default() }).unwrap();
    let opts = Options { reserve: Some(ReservePolicy::new(2, 6).unwrap()), ..Options::default() };
    let cn = AsyncCn::new(Cn::connect(&m, opts).unwrap()).unwrap();
    let kv = Arc::new(AsyncKv::new(cn).unwrap());
    let cfg = YcsbConfig { keys: 300, value_len: 1024, ops: 600, concurrency: 8, seed: 42 };
    ycsb::load(&kv, &cfg).await.unwrap();
    assert_eq!(kv.len(), 300);
    for w in Workload::ALL {
        let cfg = YcsbConfig { seed: cfg.seed + w as u64, ..cfg };
        let r = ycsb::run(&kv, w, &cfg).await.unwrap();
        println!("YCSB-{w:?} on the model: {r}");
        assert_eq!(r.reads + r.updates + r.inserts, cfg.ops);
        match w {
            Workload::C => assert_eq!((r.updates, r.inserts), (0, 0)),
            Workload::D => assert_eq!(r.updates, 0),
            _ => assert_eq!(r.inserts, 0),
        }
    }
    let s = kv.client().cn().stats();
    println!("client: {s:?}, store: {:?}, {} chunks held", kv.stats(), kv.held_chunks());
    assert!(s.allocs_from_reserve > 0, "the store's chunks came from the reserve");
    // every chunk is the store's, in the reserve, or back at the MN
    let held = kv.client().cn().held_chunks();
    let free = m.free_groups().unwrap() as usize;
    assert_eq!(held + free, 128);
    m.with_cluster(|c| c.check_invariants()).unwrap().unwrap();
}
