//! The MN and several CN **processes** over rdma_cm on soft-RoCE: allocate, write and read back
//! through each access QP, free, reallocate; isolation between CNs; stale rkeys; reclaim when a
//! CN process is killed (also with its QPs in ERR) while the MN keeps serving. Skipped unless
//! OMW_RXE is set.
//!
//! By default the test starts its own MN in the same VM. Two hosts (scripts/verbs-ci): with
//! `OMW_MN_ADDR=IP:PORT` it uses an MN already running elsewhere instead (64 KiB pool of 4 KiB
//! chunks, group size 3, every chunk free) whose log it reads from `OMW_MN_LOG` (a shared file);
//! whoever started that MN stops it. The MN and CN processes are the `omw` binary
//! (`common::node`: `OMW_NODE_BIN`, else the one cargo built beside this test).

mod common;
use common::*;
use std::time::{Duration, Instant};

#[test]
fn two_cns_isolation_stale_keys_and_reclaim() {
    if !rxe() {
        return;
    }
    let (mn, addr) = Mn::start(7480);
    let mut a = Cn::start(&addr);
    // allocate, write and read back through each access QP, free, reallocate
    let x = parse_alloc(&a.cmd("alloc"));
    assert_eq!(a.cmd(&format!("write {} 0 0 alpha-through-qp0", x.n)), "ok");
    assert_eq!(a.cmd(&format!("write {} 1 64 alpha-through-qp1", x.n)), "ok");
    assert_eq!(a.cmd(&format!("read {} 1 0 17", x.n)), "ok alpha-through-qp0");
    assert_eq!(a.cmd(&format!("read {} 0 64 17", x.n)), "ok alpha-through-qp1");
    assert_eq!(a.cmd(&format!("free {}", x.n)), "ok");
    let y = parse_alloc(&a.cmd("alloc"));
    assert_eq!(a.cmd(&format!("write {} 0 0 secret-of-A", y.n)), "ok");
    // stale rkey after free (this kills A's access QP 1: A uses QP 0 from here on)
    let s = Cn::start(&addr); // another CN connected meanwhile must not disturb A

    // B: A's rkey through B's own access QP → refused, A's bytes unchanged
    let mut b = Cn::start(&addr);
    let bz = parse_alloc(&b.cmd("alloc"));
    assert_eq!(b.cmd(&format!("rawwrite 0 {:#x} {:#x} EVIL", y.base, y.rkeys[0])), "status RemAccessErr");
    assert_eq!(b.cmd(&format!("rawread 1 {:#x} {:#x} 8", y.base, y.rkeys[1])), "status RemAccessErr");
    assert_eq!(a.cmd(&format!("read {} 0 0 11", y.n)), "ok secret-of-A");
    // (B stays connected: see the note at the end)
    // B': its own rkey but an address outside its chunk (A's chunk) → refused (MR per chunk)
    let mut b2 = Cn::start(&addr);
    let bz2 = parse_alloc(&b2.cmd("alloc"));
    assert_ne!(bz2.base, y.base);
    assert_eq!(b2.cmd(&format!("rawwrite 0 {:#x} {:#x} EVIL", y.base, bz2.rkeys[0])), "status RemAccessErr");
    assert_eq!(b2.cmd(&format!("rawread 1 {:#x} {:#x} 8", y.base, bz2.rkeys[1])), "status RemAccessErr");
    assert_eq!(a.cmd(&format!("read {} 0 0 11", y.n)), "ok secret-of-A");
    // B'': cannot free A's chunk (refused NotOwner); A keeps access
    let mut b3 = Cn::start(&addr);
    assert_eq!(b3.cmd(&format!("freeentry {:#x} 3000", y.entry)), "refused NotOwner");
    assert_eq!(a.cmd(&format!("read {} 0 0 11", y.n)), "ok secret-of-A");
    let _ = bz;
    let z = parse_alloc(&a.cmd("alloc"));
    let _ = z;
    // stale rkey after free (x's windows were invalidated and rebound with new keys)
    let mut s = s;
    assert_eq!(s.cmd(&format!("rawread 1 {:#x} {:#x} 8", x.base, x.rkeys[1])), "status RemAccessErr");

    // ---- reclaim: killing a CN process returns all its chunks to the pool, promptly, and the
    // MN keeps serving. A (2 chunks, healthy QPs) first, then B (1 chunk, both access QPs in
    // ERR from its refused accesses: its windows are bound to MN QPs in ERR), then B' quits
    // normally (1 chunk, QPs in ERR), B'' and S (no chunks) quit.
    let reclaim = |mn: &Mn, cn: &str, n: u32| {
        let t = Instant::now();
        mn.wait_log(&format!("{cn} disconnected: reclaimed {n} chunk(s)"));
        let dt = t.elapsed();
        println!("  [{}] {cn}: {n} chunk(s) reclaimed {dt:?} after it went", stamp());
        assert!(dt < Duration::from_secs(20), "reclaim of {cn} took {dt:?}");
    };
    let a_id = a.id.clone();
    a.kill();
    reclaim(&mn, &a_id, 2);
    let b_id = b.id.clone();
    b.kill();
    reclaim(&mn, &b_id, 1);
    // the MN still accepts and serves while others come and go
    let mut c = Cn::start(&addr);
    let cz = parse_alloc(&c.cmd("alloc"));
    assert_eq!(c.cmd(&format!("write {} 1 0 after-reclaim", cz.n)), "ok");
    assert_eq!(c.cmd(&format!("read {} 0 0 13", cz.n)), "ok after-reclaim");
    let b2_id = b2.id.clone();
    b2.quit();
    reclaim(&mn, &b2_id, 1);
    for (x, n) in [(b3, 0), (s, 0)] {
        let id = x.id.clone();
        x.quit();
        reclaim(&mn, &id, n);
    }
    // every chunk is back: C holds one and gets the other 15 (the pool has 16)
    for _ in 0..15 {
        assert!(c.cmd("alloc").starts_with("ok"));
    }
    c.quit();
    let log = mn.log();
    assert!(!log.contains("could not be invalidated"), "a window stayed bound:\n{log}");
    mn.stop();
}
