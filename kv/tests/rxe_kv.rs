//! The example KV store against a real `omw mn` over soft-RoCE: insert, get, update, delete,
//! shrink, a full pool, everything back — with the MN's own counters (`--metrics`) showing the
//! chunks come back as keys die. Skipped unless OMW_RXE is set (scripts/verbs-ci runs it in
//! the VM).
//!
//! By default it starts its own MN (`OMW_NODE_BIN`, else the `omw` cargo built beside this
//! test; scripts/rxe-test builds it) with 16 chunks of 4 KiB. Two hosts: `OMW_MN_ADDR=IP:PORT` names an
//! MN elsewhere with that pool, every chunk free, and `OMW_MN_METRICS=IP:PORT` its
//! `--metrics` address.

use omw_kv::verbs::VerbsCn;
use omw_kv::{KvError, KvStore};
use omw_verbs::cn::{CnClient, CnOptions};
use omw_verbs::VerbsError;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

const CHUNKS: u64 = 16;

fn node() -> PathBuf {
    if let Ok(p) = std::env::var("OMW_NODE_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap().to_path_buf();
    let omw = dir.join("omw");
    assert!(omw.exists(), "no omw in {} (cargo build -p omw, or set OMW_NODE_BIN)", dir.display());
    omw
}

struct Mn {
    child: Option<Child>,
    log: PathBuf,
    stdout: PathBuf,
    metrics: Option<SocketAddr>,
}

impl Mn {
    fn start(port: u16) -> (Mn, SocketAddr) {
        if let Ok(a) = std::env::var("OMW_MN_ADDR") {
            let metrics = std::env::var("OMW_MN_METRICS").ok().and_then(|m| m.parse().ok());
            let mn = Mn { child: None, log: PathBuf::new(), stdout: PathBuf::new(), metrics };
            return (mn, a.parse().unwrap());
        }
        let dir = PathBuf::from(std::env::var("OMW_RXE_VM_OUT").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into()));
        let log = dir.join(format!("kv-mn-{port}.log"));
        let stdout = dir.join(format!("kv-mn-{port}.jsonl"));
        let ip = std::env::var("OMW_SELF_IP").unwrap_or_else(|_| "192.0.2.1".into());
        let addr: SocketAddr = format!("{ip}:{port}").parse().unwrap();
        let child = Command::new(node())
            .args(["mn", "--listen", &addr.to_string(), "--pool-size", "65536", "--chunk-size", "4096"])
            .args(["--group-size", "3", "--stats-ms", "200", "--metrics", "127.0.0.1:0", "--stats-json"])
            // a quota above the pool: a full pool answers "empty", not "quota"
            .args(["--quota", "17"])
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut mn = Mn { child: Some(child), log, stdout, metrics: None };
        let t = Instant::now();
        loop {
            let l = mn.log();
            if l.contains("listening on") {
                if let Some(m) = l.lines().find_map(|x| x.split("metrics: http://").nth(1)) {
                    mn.metrics = m.split('/').next().and_then(|a| a.parse().ok());
                    break;
                }
            }
            assert!(t.elapsed() < Duration::from_secs(60), "the MN did not start:\n{l}");
            std::thread::sleep(Duration::from_millis(50));
        }
        (mn, addr)
    }
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    /// One gauge or counter from `GET /metrics`.
    fn metric(&self, name: &str) -> Option<u64> {
        let a = self.metrics?;
        let mut s = TcpStream::connect(a).ok()?;
        write!(s, "GET /metrics HTTP/1.1\r\nHost: mn\r\n\r\n").ok()?;
        let mut body = String::new();
        s.read_to_string(&mut body).ok()?;
        body.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).and_then(|v| v.trim().parse().ok())
    }
    /// Wait (bounded) until a metric has a value; the MN publishes every 100 ms.
    fn wait_metric(&self, name: &str, want: u64) {
        if self.metrics.is_none() {
            println!("(no --metrics address: {name} not checked)");
            return;
        }
        let t = Instant::now();
        let mut last = None;
        while t.elapsed() < Duration::from_secs(10) {
            last = self.metric(name);
            if last == Some(want) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{name} is {last:?}, not {want}\n{}", self.log());
    }
}

impl Drop for Mn {
    fn drop(&mut self) {
        let Some(c) = self.child.as_mut() else { return };
        let _ = Command::new("kill").args(["-INT", &c.id().to_string()]).status();
        let t = Instant::now();
        while matches!(c.try_wait(), Ok(None)) && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        let st = c.wait();
        println!("--- MN log ({st:?}) ---\n{}", self.log());
    }
}

fn value(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed.wrapping_mul(131).wrapping_add(i as u64 * 17) % 251) as u8).collect()
}

#[test]
fn kv_store_against_a_real_mn() {
    if std::env::var_os("OMW_RXE").is_none() {
        eprintln!("skipped: set OMW_RXE=1 (scripts/verbs-ci does, inside the soft-RoCE VM)");
        return;
    }
    let (mn, addr) = Mn::start(7482);
    let mut client = CnClient::connect(
        addr,
        &CnOptions { device: None, timeout: Duration::from_secs(20), credential: None, source: None, alloc_chains: 1 },
    )
    .unwrap();
    assert_eq!(client.info.chunk_size, 4096);
    assert!(client.mn_qpns().iter().all(|q| q.is_some()), "rdma_cm told us every MN QP: {:?}", client.mn_qpns());
    mn.wait_metric("omw_mn_free_chunks", CHUNKS);
    let mut kv = KvStore::new(VerbsCn::new(&mut client, 0)).unwrap();
    let mut model = std::collections::HashMap::new();
    // insert 24 keys of 10 B – 900 B
    for i in 0..24u64 {
        let k = format!("key-{i:02}").into_bytes();
        let v = value(i, 10 + (i as usize * 37) % 900);
        kv.insert(&k, &v).unwrap();
        model.insert(k, v);
    }
    for (k, v) in &model {
        assert_eq!(kv.get(k).unwrap().as_ref(), Some(v), "read back over RDMA");
    }
    mn.wait_metric("omw_mn_free_chunks", CHUNKS - kv.held_chunks() as u64);
    // update every third key to a bigger class (out of place)
    for i in (0..24u64).step_by(3) {
        let k = format!("key-{i:02}").into_bytes();
        let v = value(i + 500, 1100 + i as usize * 10);
        kv.update(&k, &v).unwrap();
        model.insert(k, v);
    }
    for (k, v) in &model {
        assert_eq!(kv.get(k).unwrap().as_ref(), Some(v), "after update");
    }
    // delete three quarters; chunks go back as their last object dies
    for i in 0..24u64 {
        if i % 4 != 0 {
            let k = format!("key-{i:02}").into_bytes();
            assert!(kv.delete(&k).unwrap());
            model.remove(&k);
        }
    }
    assert!(kv.stats().chunks_freed > 0);
    let back = kv.shrink().unwrap();
    println!("shrink gave back {back} chunk(s); {} held, stats {:?}", kv.held_chunks(), kv.stats());
    for (k, v) in &model {
        assert_eq!(kv.get(k).unwrap().as_ref(), Some(v), "after shrink");
    }
    mn.wait_metric("omw_mn_free_chunks", CHUNKS - kv.held_chunks() as u64);
    // fill the pool with one-chunk records: the MN's "empty" comes back as a typed error
    let big = value(9, 3000);
    let mut n = 0;
    let t = Instant::now();
    let err = loop {
        match kv.insert(format!("big-{n}").as_bytes(), &big) {
            Ok(()) => n += 1,
            Err(e) => break e,
        }
        assert!(n < 64, "the pool never ran out");
    };
    println!("pool full after {n} big records ({err}); the inserts took {:?} in all", t.elapsed());
    if mn.child.is_some() {
        assert!(matches!(err, KvError::Memory(VerbsError::PoolEmpty)), "{err}");
    } else {
        // an MN run elsewhere with the default quota (the whole pool) says "quota" first
        assert!(matches!(err, KvError::Memory(VerbsError::PoolEmpty | VerbsError::QuotaExceeded)), "{err}");
    }
    assert_eq!(kv.held_chunks() as u64, CHUNKS, "every chunk is ours");
    mn.wait_metric("omw_mn_free_chunks", 0);
    for (k, v) in &model {
        assert_eq!(kv.get(k).unwrap().as_ref(), Some(v), "still intact when full");
    }
    // everything dies: every chunk is back at the MN
    for i in 0..n {
        assert!(kv.delete(format!("big-{i}").as_bytes()).unwrap());
    }
    let keys: Vec<Vec<u8>> = model.keys().cloned().collect();
    for k in keys {
        assert!(kv.delete(&k).unwrap());
    }
    assert_eq!(kv.held_chunks(), 0);
    let stats = kv.stats();
    assert_eq!(stats.chunks_allocated, stats.chunks_freed);
    drop(kv);
    mn.wait_metric("omw_mn_free_chunks", CHUNKS);
    // and the MN agrees: the whole pool can be allocated again, then "empty" at once
    client.pump().unwrap();
    let mut held = Vec::new();
    let t = Instant::now();
    while held.len() < CHUNKS as usize && t.elapsed() < Duration::from_secs(20) {
        match client.try_alloc() {
            Ok(a) => held.push(a),
            Err(VerbsError::PoolEmpty) => {
                client.pump().unwrap(); // an "available" may still be on its way
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(held.len() as u64, CHUNKS);
    assert!(matches!(client.try_alloc(), Err(VerbsError::PoolEmpty | VerbsError::QuotaExceeded)));
    for a in &held {
        client.free(a).unwrap();
    }
    mn.wait_metric("omw_mn_free_chunks", CHUNKS);
    drop(client);
    if mn.child.is_some() {
        let out = std::fs::read_to_string(&mn.stdout).unwrap_or_default();
        let last = out.lines().rev().find(|l| l.starts_with('{')).unwrap_or_default().to_string();
        assert!(last.contains("\"chunks\":16") && last.contains("\"allocs\":"), "--stats-json: {last:?}");
    }
}
