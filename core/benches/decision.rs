//! Wall-clock cost of the core's decisions: the CN client building an alloc request and
//! decoding the reply, building a free request; the MN (driver + host engine + control plane)
//! serving one alloc and one free to a `CnDriver` on the core's test NIC (`test-nic` feature); WQE encode/decode; building
//! and statically validating the alloc chain.
//!
//! `cargo bench -p omw-core --bench decision`. Divan prints its table; then a summary measures
//! each operation again in a plain loop, counts heap allocations with a counting global
//! allocator (the core must do none) and prints ratios against a baseline measured in the same
//! run (copying 64 bytes, the size of one WQE).

use divan::Bencher;
use omw_core::access::AccessFlags;
use omw_core::chain::builder::ChainEnv;
use omw_core::chain::ChainLayout;
use omw_core::cn::driver::{CnDriver, CnEvent, CnMemory, CnQpSet};
use omw_core::cn::{Allocation, Client};
use omw_core::device::mw_rules::Mode;
use omw_core::device::{DataPath, Domain, Provision};
use omw_core::geometry::PoolGeometry;
use omw_core::ids::{CnId, Qpn, Rkey};
use omw_core::mn::driver::MnDriver;
use omw_core::mn::plan::{MnOptions, MnPlan};
use omw_core::mn::provision::PoolSpec;
use omw_core::mn::{CnQps, MnKeys};
use omw_core::testing::test_nic::{Node, TestNic};
use omw_core::wire::memory_map::MnMemoryMap;
use omw_core::wire::message::{AllocReply, ConnectInfo};
use omw_core::wire::wqe::Wqe;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

// ------------------------------------------------------------------ counting allocator

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(l.size() as u64, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(n as u64, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

// ------------------------------------------------------------------ the test NIC

const META: u64 = 64 << 20;
const POOL: u64 = 1 << 32;
const CHUNKS: u32 = 1024;
const G: u8 = 2;

/// Nodes, QPs, keys (every window of the pool, its MRs and the CN's).
type Nic = TestNic<'static, 2, 16, { (CHUNKS * G as u32) as usize + 16 }>;
type View = Node<'static, 'static, 2, 16, { (CHUNKS * G as u32) as usize + 16 }>;

fn qpn(v: u32) -> Qpn {
    Qpn::new(v).expect("qpn")
}

fn leak_mem(len: usize) -> &'static mut [u8] {
    Box::leak(vec![0u8; len].into_boxed_slice())
}

/// An MN in host-engine mode on the test NIC, provisioned by its plan, with one CN driven by
/// `CnDriver` over real QP pairs (set-up allocates; serving does not).
struct Rig {
    d: MnDriver<View>,
    cn: CnDriver<View, 1024>,
}

impl Rig {
    fn new() -> Rig {
        let nic: &'static RefCell<Nic> = Box::leak(Box::new(RefCell::new(TestNic::new(Mode::Strict))));
        let (mn, cn) = {
            let mut n = nic.borrow_mut();
            (n.add_node(leak_mem(5 << 20)).expect("mn"), n.add_node(leak_mem(64 << 10)).expect("cn"))
        };
        let b = Node::new(nic, mn);
        let plan = MnPlan::decide(b.capabilities(), MnOptions::default()).expect("plan");
        let spec = PoolSpec {
            chunk_size: 4096,
            chunks: CHUNKS,
            group_size: G,
            max_cns: 8,
            quota: 0,
            lease_ns: 0,
            queue_depth: None,
        };
        let mut d = plan.provision(b, &spec).expect("provision");
        let mut c = Node::new(nic, cn);
        let pair = || c.connect_to(Domain::CnFacing, mn, Domain::CnFacing).expect("qp");
        let (alloc, mn_alloc) = pair();
        let (free, mn_free) = pair();
        let (access, mn_access) = pair();
        let reply = c.alloc_memory(CnMemory::REPLY_LEN, 64).expect("reply");
        let rights = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let rk = c.reg_mr(Domain::CnFacing, reply, CnMemory::REPLY_LEN, rights).expect("reply mr");
        let local_len = CnMemory::local_len_for(omw_core::cn::driver::IO_SLOTS, 4096);
        let local = c.alloc_memory(local_len, 64).expect("local");
        let lk = c.reg_mr(Domain::CnFacing, local, local_len, AccessFlags::LOCAL_WRITE).expect("local mr");
        let mem = CnMemory { local, local_len, lkey: lk.lkey, reply, reply_rkey: rk.rkey };
        let qps = CnQpSet { alloc, free, access: [access].into_iter().collect() };
        let mut cn = CnDriver::new(c, qps, mem).expect("cn driver");
        let mn_qps = CnQps {
            alloc: mn_alloc,
            free: mn_free,
            access: [mn_access].into_iter().collect(),
            alloc_loop: None,
            free_loop: None,
        };
        d.connect(mn_qps).expect("connect");
        cn.poll(0).expect("cn poll");
        assert!(matches!(cn.next_event(), Some(CnEvent::Connected(_))));
        Rig { d, cn }
    }

    /// One allocation: the CN's request, the MN's host-engine lap, the reply adopted by the CN.
    fn alloc(&mut self) -> Allocation {
        let tok = self.cn.alloc(0).expect("request");
        self.d.poll(0).expect("poll");
        self.cn.poll(0).expect("cn poll");
        match self.cn.next_event() {
            Some(CnEvent::Allocated { token, result: Ok(a) }) if token == tok => a,
            e => panic!("no allocation: {e:?}"),
        }
    }

    fn free(&mut self, a: &Allocation) {
        self.cn.free(a).expect("free request");
        self.d.poll(0).expect("poll");
        self.cn.poll(0).expect("cn poll");
    }
}

// ------------------------------------------------------------------ fixtures

fn connect_info() -> [u8; omw_core::wire::message::CONNECT_INFO_LEN] {
    ConnectInfo {
        cn: CnId::new(3).expect("cn"),
        group_size: 3,
        chunk_size: 4096,
        alloc_qpn: qpn(10),
        free_qpn: qpn(11),
        access_qpns: [qpn(12), qpn(13)].into_iter().collect(),
        quota: 1 << 20,
        flags: Default::default(),
    }
    .encode()
}

fn reply_bytes() -> [u8; omw_core::wire::message::ALLOC_REPLY_LEN] {
    let mut e = omw_core::wire::mwtable::MwTableEntry::new(0x10000, 4096, 1, &[Rkey(0x100), Rkey(0x200), Rkey(0x300)]);
    e.owner = 3.into();
    AllocReply { entry_addr: 0x5000, entry: e, generation: 0 }.encode()
}

fn connected_client() -> Client<64> {
    let mut c = Client::new();
    c.on_message(0, &connect_info()).expect("info");
    c
}

fn bind_wqe() -> Wqe {
    Wqe::bind_mw(0x1234_5601, 0x1_0000_0000, 4096, 77, 0x0102, AccessFlags::DATA_WINDOW).with_wr_id(42)
}

/// The MN's keys in both set-ups (the CN-facing names equal the MN-private ones: one PD).
fn keys() -> MnKeys {
    MnKeys {
        meta_lkey: 1,
        meta_rkey: 2,
        table_rkey: 3,
        ring_lkey: 4,
        ring_rkey: 5,
        cn_meta_lkey: 1,
        cn_ring_lkey: 4,
        ..MnKeys::default()
    }
}

fn chain_env() -> ChainEnv {
    let geo = PoolGeometry::new(POOL, 4096, 64, 3).expect("geometry");
    let map = MnMemoryMap::new(geo, 8, META).expect("map");
    ChainEnv {
        map,
        slot: 0,
        cn: CnId::new(1).expect("cn"),
        loop_qpn: 1,
        mgmt_qpn: 2,
        free_qpn: 3,
        keys: keys(),
        queue_depth: 128,
        window_access: AccessFlags::DATA_WINDOW,
        owner_window_access: AccessFlags::REMOTE_READ,
        pop_ahead: true,
        variant: omw_core::chain::variant::ChainVariant::default(),
        posts_receives: false,
        owner_proof: None,
    }
}

// ------------------------------------------------------------------ divan benchmarks

#[divan::bench]
fn baseline_copy_64_bytes(b: Bencher) {
    let src = [7u8; 64];
    b.bench_local(|| {
        let mut dst = [0u8; 64];
        dst.copy_from_slice(black_box(&src));
        black_box(dst)
    });
}

#[divan::bench]
fn cn_alloc_request_and_reply_decode(b: Bencher) {
    let reply = reply_bytes();
    b.with_inputs(connected_client).bench_local_refs(|c| {
        let mut buf = [0u8; 64];
        let (tok, n) = c.alloc_request(0, 0xC0DE_0000, 9, &mut buf).expect("request");
        black_box(n);
        black_box(c.on_alloc_reply(tok, black_box(&reply)).expect("reply"))
    });
}

#[divan::bench]
fn cn_free_request(b: Bencher) {
    let reply = reply_bytes();
    b.with_inputs(|| {
        let mut c = connected_client();
        let mut buf = [0u8; 64];
        let (tok, _) = c.alloc_request(0, 0xC0DE_0000, 9, &mut buf).expect("request");
        c.on_alloc_reply(tok, &reply).expect("reply");
        c
    })
    .bench_local_refs(|c| black_box(c.free_request(black_box(0x5000)).expect("free")));
}

#[divan::bench]
fn mn_host_engine_alloc_then_free(b: Bencher) {
    let mut rig = Rig::new();
    b.bench_local(|| {
        let a = rig.alloc();
        rig.free(&a);
    });
}

#[divan::bench]
fn wqe_encode(b: Bencher) {
    let w = bind_wqe();
    b.bench_local(|| black_box(black_box(&w).encode()));
}

#[divan::bench]
fn wqe_decode(b: Bencher) {
    let bytes = bind_wqe().encode();
    b.bench_local(|| black_box(Wqe::decode(black_box(&bytes)).expect("decode")));
}

#[divan::bench]
fn alloc_chain_build(b: Bencher) {
    let env = chain_env();
    b.bench_local(|| black_box(omw_core::chain::alloc::build_alloc_chain(black_box(&env)).expect("build")));
}

#[divan::bench]
fn alloc_chain_validate(b: Bencher) {
    let layout: ChainLayout = omw_core::chain::alloc::build_alloc_chain(&chain_env()).expect("build");
    b.bench_local(|| black_box(black_box(&layout).validate()));
}

// ------------------------------------------------------------------ summary with ratios

/// ns per call and heap allocations per call of `f`, best of `reps` runs of `n` calls.
fn measure(n: u64, reps: u32, mut f: impl FnMut()) -> (f64, f64) {
    for _ in 0..n.min(1000) {
        f();
    }
    let mut best = f64::MAX;
    let mut allocs = 0u64;
    for _ in 0..reps {
        let a0 = ALLOCS.load(Ordering::Relaxed);
        let t = Instant::now();
        for _ in 0..n {
            f();
        }
        let ns = t.elapsed().as_nanos() as f64 / n as f64;
        allocs = allocs.max(ALLOCS.load(Ordering::Relaxed) - a0);
        best = best.min(ns);
    }
    (best, allocs as f64 / n as f64)
}

/// `quick` (the `--test` smoke run of scripts/bench-smoke): every operation, a thousandth of
/// the iterations — it proves the paths run, its figures mean nothing.
fn summary(quick: bool) {
    let q = if quick { 1000 } else { 1 };
    let src = [7u8; 64];
    let (base, _) = measure(2_000_000 / q, 5, || {
        let mut dst = [0u8; 64];
        dst.copy_from_slice(black_box(&src));
        black_box(dst);
    });
    let mut rows: Vec<(&str, (f64, f64))> = Vec::new();
    let reply = reply_bytes();
    let mut c = connected_client();
    rows.push((
        "CN: alloc request + reply decode + free request",
        measure(200_000 / q, 5, || {
            let mut buf = [0u8; 64];
            let (tok, _) = c.alloc_request(0, 0xC0DE_0000, 9, &mut buf).expect("request");
            let a = c.on_alloc_reply(tok, black_box(&reply)).expect("reply");
            black_box(c.free_request(a.entry_addr).expect("free"));
        }),
    ));
    // the MN side: allocs and frees timed separately (a pool of CHUNKS groups)
    let mut rig = Rig::new();
    let batch = (CHUNKS / 2) as usize;
    let mut entries = Vec::with_capacity(batch);
    let (mut aa, mut af, mut k) = (0u64, 0u64, 0u64);
    let mut best_a = f64::MAX;
    let mut best_f = f64::MAX;
    for round in 0..(if quick { 6 } else { 40 }) {
        let a0 = ALLOCS.load(Ordering::Relaxed);
        let t = Instant::now();
        for _ in 0..batch {
            let a = rig.alloc();
            entries.push(a); // capacity reserved: no allocation
        }
        let da = t.elapsed().as_nanos() as f64 / batch as f64;
        let a1 = ALLOCS.load(Ordering::Relaxed);
        let t = Instant::now();
        for a in entries.drain(..) {
            rig.free(&a);
        }
        let df = t.elapsed().as_nanos() as f64 / batch as f64;
        let a2 = ALLOCS.load(Ordering::Relaxed);
        if round >= 5 {
            best_a = best_a.min(da);
            best_f = best_f.min(df);
            aa += a1 - a0;
            af += a2 - a1;
            k += 1;
        }
    }
    rows.push((
        "MN host engine + CnDriver: one alloc on the test NIC",
        (best_a, aa as f64 / (k * batch as u64) as f64),
    ));
    rows.push(("MN host engine + CnDriver: one free on the test NIC", (best_f, af as f64 / (k * batch as u64) as f64)));
    let w = bind_wqe();
    rows.push((
        "WQE encode (BIND_MW)",
        measure(2_000_000 / q, 5, || {
            black_box(black_box(&w).encode());
        }),
    ));
    let bytes = w.encode();
    rows.push((
        "WQE decode (BIND_MW)",
        measure(2_000_000 / q, 5, || {
            black_box(Wqe::decode(black_box(&bytes)).expect("decode"));
        }),
    ));
    let env = chain_env();
    rows.push((
        "alloc chain: build (G=3)",
        measure(20_000 / q, 5, || {
            black_box(omw_core::chain::alloc::build_alloc_chain(black_box(&env)).expect("build"));
        }),
    ));
    let layout = omw_core::chain::alloc::build_alloc_chain(&env).expect("build");
    rows.push((
        "alloc chain: static validation",
        measure(20_000 / q, 5, || {
            black_box(black_box(&layout).validate()).ok();
        }),
    ));
    println!();
    println!(
        "Summary (best of 5+ runs, {} logical CPUs):",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("  baseline: copy 64 bytes = {base:.2} ns");
    println!("  {:<56} {:>10} {:>12} {:>12}", "operation", "ns/op", "× baseline", "allocs/op");
    for (name, (ns, allocs)) in rows {
        println!("  {name:<56} {ns:>10.1} {:>12.1} {allocs:>12.3}", ns / base.max(1e-3));
    }
    println!(
        "  MN metadata per chunk: {} bytes (omw_core::wire::mwtable::METADATA_BYTES_PER_CHUNK)",
        omw_core::wire::mwtable::METADATA_BYTES_PER_CHUNK
    );
}

fn main() {
    divan::main();
    // `cargo test --benches` runs this binary too (without `--bench`): keep that quick
    if std::env::args().any(|a| a == "--bench") {
        summary(std::env::args().any(|a| a == "--test"));
    }
}
