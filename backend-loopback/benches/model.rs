//! Executed WQEs per second of the model: a self-re-enabling ring of NOP / WRITE / READ on an
//! MN loopback pair (the shape of a chain's Loop ring), run for a fixed number of steps.
//!
//! `cargo bench -p omw-loopback --bench model` (divan prints items/s = WQEs/s).

use divan::counter::ItemsCount;
use divan::Bencher;
use omw_core::access::AccessFlags;
use omw_core::wire::wqe::{QueueSel, Wqe, WqeFlags};
use omw_loopback::{Fabric, NicConfig, PdId, QpAddr, QpConfig};

const DEPTH: u32 = 64;
const STEPS: u64 = 200_000;

fn main() {
    divan::main();
}

/// A fabric with one MN whose loop QP runs `DEPTH` entries and re-enables itself forever.
fn looping(cfg: NicConfig) -> (Fabric, QpAddr) {
    let mut f = Fabric::new(cfg);
    let mn = f.add_host("mn").unwrap();
    let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    let (buf, k) = f.alloc_mr(mn, PdId(0), 4096, 64, rw).unwrap();
    let (a, _b) = f.create_connected_pair(mn, QpConfig::managed(DEPTH, 1), mn, QpConfig::default()).unwrap();
    let quiet = WqeFlags::empty();
    for i in 0..DEPTH - 1 {
        let w = match i % 3 {
            0 => Wqe::nop(),
            1 => Wqe::write(buf, k.lkey, 8, buf + 1024, k.rkey),
            _ => Wqe::read(buf + 2048, k.lkey, 8, buf + 8, k.rkey),
        };
        f.post_send(a, &w.with_flags(quiet)).unwrap();
    }
    f.post_send(a, &Wqe::enable(a.qpn.get(), QueueSel::Send, DEPTH as u64)).unwrap();
    f.enable(a, QueueSel::Send, DEPTH as u64).unwrap();
    (f, a)
}

fn run(bencher: Bencher, cfg: NicConfig) {
    bencher.counter(ItemsCount::new(STEPS)).with_inputs(|| looping(cfg).0).bench_local_values(|mut f| {
        let n = f.run_until_idle(STEPS);
        assert_eq!(n, STEPS);
        f
    });
}

#[divan::bench(sample_count = 10)]
fn loop_ring_strict(bencher: Bencher) {
    run(bencher, NicConfig::strict());
}

#[divan::bench(sample_count = 10)]
fn loop_ring_prefetch(bencher: Bencher) {
    run(bencher, NicConfig::strict().with_prefetch(8));
}

#[divan::bench(sample_count = 10)]
fn loop_ring_rxe(bencher: Bencher) {
    run(bencher, NicConfig::rxe_compatible());
}
