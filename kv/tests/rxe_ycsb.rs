//! The async KV store on the CN library over soft-RoCE, under YCSB A–D (Zipf θ = 0.99,
//! 1 KiB values; FUSEE's 100 k keys scaled down to what the VM's pool holds), against an
//! `omw mn` process of its own; every read checked, every chunk back at the end. Skipped
//! unless OMW_RXE is set (scripts/verbs-ci runs it in the VM).

use omw_client::verbs::{CnOptions, Target};
use omw_client::{AsyncCn, Cn, Options, ReservePolicy};
use omw_kv::async_store::AsyncKv;
use omw_kv::ycsb::{self, Workload, YcsbConfig};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// 256 chunks of 16 KiB (the paper's KV chunk size).
const CHUNKS: u64 = 256;

fn node() -> PathBuf {
    if let Some(p) = std::env::var_os("OMW_NODE_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(|d| d.parent()).unwrap().join("omw")
}

struct Mn(Child, PathBuf);

impl Mn {
    fn start(port: u16) -> (Mn, SocketAddr) {
        let dir = std::env::var("OMW_RXE_VM_OUT").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
        let log = PathBuf::from(dir).join(format!("ycsb-mn-{port}.log"));
        let ip = std::env::var("OMW_SELF_IP").unwrap_or_else(|_| "192.0.2.1".into());
        let addr: SocketAddr = format!("{ip}:{port}").parse().unwrap();
        let pool = (CHUNKS * 16384).to_string();
        let child = Command::new(node())
            .args(["mn", "--listen", &addr.to_string(), "--pool-size", &pool, "--chunk-size", "16384"])
            .args(["--group-size", "2"])
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mn = Mn(child, log);
        let t = Instant::now();
        while !std::fs::read_to_string(&mn.1).unwrap_or_default().contains("listening on") {
            assert!(t.elapsed() < Duration::from_secs(120), "the MN did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        (mn, addr)
    }
}

impl Drop for Mn {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-INT", &self.0.id().to_string()]).status();
        let t = Instant::now();
        while matches!(self.0.try_wait(), Ok(None)) && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
        let log = std::fs::read_to_string(&self.1).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(8).collect();
        println!("--- MN log (tail) ---\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
    }
}

#[test]
fn ycsb_a_to_d_on_soft_roce() {
    if std::env::var_os("OMW_RXE").is_none() {
        eprintln!("skipped: set OMW_RXE=1 (scripts/verbs-ci does, inside the soft-RoCE VM)");
        return;
    }
    let (_mn, addr) = Mn::start(7489);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let target = Target { addr, opts: CnOptions { timeout: Duration::from_secs(30), ..CnOptions::default() } };
        let opts = Options { reserve: Some(ReservePolicy::new(2, 6).unwrap()), ..Options::default() };
        let cn = AsyncCn::new(Cn::connect(target, opts).unwrap()).unwrap();
        let kv = Arc::new(AsyncKv::new(cn).unwrap());
        let cfg = YcsbConfig { keys: 400, value_len: 1024, ops: 400, concurrency: 8, seed: 7 };
        let t = Instant::now();
        ycsb::load(&kv, &cfg).await.unwrap();
        println!("loaded {} keys of 1 KiB in {:?}", cfg.keys, t.elapsed());
        for w in Workload::ALL {
            let cfg = YcsbConfig { seed: cfg.seed + w as u64, ..cfg };
            let r = ycsb::run(&kv, w, &cfg).await.unwrap();
            println!("YCSB-{w:?} on soft-RoCE: {r}");
            assert_eq!(r.reads + r.updates + r.inserts, cfg.ops);
        }
        let s = kv.client().cn().stats();
        println!("client: {s:?}; store: {:?}", kv.stats());
        // between bursts the background keeps the reserve at its low-water mark at least
        let t = Instant::now();
        while kv.client().cn().reserved() < 2 {
            assert!(t.elapsed() < Duration::from_secs(30), "the reserve never refilled: {s:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        kv.client().cn().shutdown().unwrap();
        assert_eq!(kv.client().cn().reserved(), 0, "the reserve went back at shutdown");
    });
}
