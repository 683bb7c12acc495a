//! A stalled CN delays only itself (issue 10), with a real `omw mn` and CN processes over
//! rdma_cm on soft-RoCE: a CN that floods requests it never reads (its receives run out, the
//! MN's replies find none) and a CN that is SIGSTOPped mid-run (it answers nothing; the MN's
//! lease probes find its receives used up). Meanwhile an honest CN keeps allocating, writing,
//! reading and freeing — every operation must succeed — and the MN evicts the stalled CNs,
//! reclaims their chunks, keeps accepting connections and still stops promptly on SIGINT.
//! Skipped unless OMW_RXE is set.

mod common;
use common::*;
use std::time::{Duration, Instant};

/// One honest cycle; panics on any error. Returns how long it took.
fn honest_cycle(c: &mut Cn, i: u64) -> Duration {
    let t = Instant::now();
    let a = parse_alloc(&c.cmd("alloc"));
    let text = format!("honest-{i}");
    assert_eq!(c.cmd(&format!("write {} 0 0 {text}", a.n)), "ok");
    assert_eq!(c.cmd(&format!("read {} 1 0 {}", a.n, text.len())), format!("ok {text}"));
    assert_eq!(c.cmd(&format!("free {}", a.n)), "ok");
    t.elapsed()
}

/// Run honest cycles until the MN log says `cn` was evicted; returns (time to eviction,
/// slowest honest cycle).
fn until_evicted(mn: &Mn, honest: &mut Cn, cn: &str, limit: Duration) -> (Duration, Duration) {
    let t = Instant::now();
    let mut slowest = Duration::ZERO;
    let mut i = 0;
    while !mn.log().contains(&format!("{cn} evicted")) {
        assert!(t.elapsed() < limit, "{cn} was not evicted within {limit:?}:\n{}", mn.log());
        slowest = slowest.max(honest_cycle(honest, i));
        i += 1;
    }
    (t.elapsed(), slowest)
}

#[test]
fn stalled_and_stopped_cns_are_evicted_while_others_keep_working() {
    if !rxe() {
        return;
    }
    let (mn, addr) = Mn::start_local(7486, &["--lease-ms", "600"]);
    let mut honest = Cn::start(&addr);
    honest_cycle(&mut honest, 0);

    // 1. a CN that asks and never reads the answers
    let mut flood = Cn::start(&addr);
    let held = parse_alloc(&flood.cmd("alloc"));
    let _ = held;
    let sent = flood.cmd("flood 40");
    assert!(sent.starts_with("ok sent"), "{sent}");
    let (t1, slow1) = until_evicted(&mn, &mut honest, &flood.id, Duration::from_secs(30));
    println!("  [{}] flooding CN evicted {t1:?} after its flood; slowest honest cycle meanwhile {slow1:?}", stamp());

    // 2. a CN stopped mid-run, holding chunks
    let mut stopped = Cn::start(&addr);
    for _ in 0..2 {
        parse_alloc(&stopped.cmd("alloc"));
    }
    stopped.signal("STOP");
    let (t2, slow2) = until_evicted(&mn, &mut honest, &stopped.id, Duration::from_secs(30));
    println!("  [{}] SIGSTOPped CN evicted {t2:?} after the stop; slowest honest cycle meanwhile {slow2:?}", stamp());
    stopped.signal("CONT");
    stopped.kill();
    flood.kill();

    // 3. every chunk is back (the pool has 16), the MN still accepts and serves
    let mut late = Cn::start(&addr);
    for _ in 0..16 {
        assert!(late.cmd("alloc").starts_with("ok"), "a chunk was not reclaimed:\n{}", mn.log());
    }
    late.quit();
    honest.quit();
    mn.stop(); // asserts a clean, prompt shutdown
}
