//! A CN's quota in bytes across an MN's size classes, on the model: each class is a
//! `MemoryNode` of its own, and the MN tells each what the CN holds in the others
//! (`MemoryNode::set_held_elsewhere`).

use omw_core::device::ExecutionMode;
use omw_loopback::NicConfig;
use omw_pool::entry::ClassSpec;
use omw_pool::loopback::{LoopbackMnConfig, LoopbackPool};
use omw_pool::PoolError;

const CLASSES: [ClassSpec; 2] =
    [ClassSpec { chunk_size: 4096, chunks: 16 }, ClassSpec { chunk_size: 65536, chunks: 4 }];
const QUOTA: u64 = 65536 + 2 * 4096;

fn pool(mode: ExecutionMode, mns: usize) -> LoopbackPool {
    let mut cfg = LoopbackMnConfig { mode: Some(mode), byte_quota: Some(QUOTA), ..LoopbackMnConfig::default() };
    if mode == ExecutionMode::HostEngine {
        cfg.nic = NicConfig::strict().with_offload(false).with_prefetch(8);
    }
    let mut p = LoopbackPool::new("q", cfg).unwrap();
    for i in 0..mns {
        p.add_mn(&format!("mn{i}"), &CLASSES).unwrap();
    }
    p
}

#[test]
fn the_host_engine_refuses_what_would_exceed_the_bytes_over_all_classes() {
    let mut p = pool(ExecutionMode::HostEngine, 1);
    let mut c = p.client(1).unwrap();
    let big = c.alloc(65536).unwrap();
    let small: Vec<_> = (0..2).map(|_| c.alloc(4096).unwrap()).collect();
    // 64 KiB + 8 KiB held: one more 4 KiB chunk would exceed it, though the class has room
    assert!(matches!(c.alloc(4096), Err(PoolError::QuotaExceeded { chunk_size: 4096 })));
    // and so would a second large chunk
    assert!(matches!(c.alloc(65536), Err(PoolError::QuotaExceeded { chunk_size: 65536 })));
    // another CN has its own quota
    let mut d = p.client(2).unwrap();
    let theirs = d.alloc(4096).unwrap();
    // freeing the large chunk makes room in the small class
    c.free(big).unwrap();
    let more: Vec<_> = (0..12).map(|_| c.alloc(4096).unwrap()).collect();
    assert_eq!(more.len() + small.len(), 14);
    d.free(theirs).unwrap();
    for m in p.mns() {
        m.check_invariants().unwrap();
    }
}

#[test]
fn a_cn_at_its_quota_on_one_mn_is_placed_on_another() {
    let mut p = pool(ExecutionMode::HostEngine, 2);
    let mut c = p.client(3).unwrap();
    let mut held = Vec::new();
    // 2 MNs × (64 KiB + 8 KiB): four 4-KiB chunks and two large ones, spread by the quota
    for _ in 0..2 {
        held.push(c.alloc(65536).unwrap());
    }
    for _ in 0..4 {
        held.push(c.alloc(4096).unwrap());
    }
    let on = |n: &str| held.iter().filter(|a| a.mn() == n).count();
    assert_eq!((on("mn0"), on("mn1")), (3, 3));
    assert!(matches!(c.alloc(4096), Err(PoolError::QuotaExceeded { .. })));
}

#[test]
fn offloaded_classes_enforce_the_byte_quota_at_the_audit() {
    let mut p = pool(ExecutionMode::Offloaded, 1);
    let mut c = p.client(4).unwrap();
    let _big = c.alloc(65536).unwrap();
    // the chains cannot count: the allocations past the quota succeed…
    let small: Vec<_> = (0..3).map(|_| c.alloc(4096).unwrap()).collect();
    // …and the next audit takes the small class's groups back from the CN over its quota
    p.advance(2_000_000_000).unwrap();
    let m = p.mn("mn0").unwrap();
    let s = m.classes[0].borrow().driver.mn.stats();
    assert!(s.quota_disconnects >= 1, "{s:?}");
    assert_eq!(m.held_per_class()[0], 0);
    let _ = small;
    m.check_invariants().unwrap();
}
