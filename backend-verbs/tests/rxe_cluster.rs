//! The MN and several CN **processes** over rdma_cm on soft-RoCE: allocate, write and read back
//! through each access QP, free, reallocate; isolation between CNs; stale rkeys; reclaim when a
//! CN process is killed (also with its QPs in ERR) while the MN keeps serving. Skipped unless
//! OMW_RXE is set.
//!
//! By default the test starts its own MN in the same VM. Two hosts (scripts/verbs-ci): with
//! `OMW_MN_ADDR=IP:PORT` it uses an MN already running elsewhere instead (64 KiB pool of 4 KiB
//! chunks, group size 3, every chunk free) whose log it reads from `OMW_MN_LOG` (a shared file);
//! whoever started that MN stops it. `OMW_NODE_BIN` names the program run as `… cn --connect
//! ADDR --timeout S script` (default: this crate's omw-verbs-node; `omw` takes the same
//! arguments).

mod common;
use common::*;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// Wall-clock seconds (mod 10⁴) with milliseconds, as the MN's log lines carry.
fn stamp() -> String {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("{:04}.{:03}", t.as_secs() % 10_000, t.subsec_millis())
}

/// The program CNs (and a local MN) run.
fn node() -> String {
    std::env::var("OMW_NODE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_omw-verbs-node").into())
}

struct Mn {
    /// None: a remote MN (OMW_MN_ADDR), not ours to stop.
    child: Option<Child>,
    log: std::path::PathBuf,
}

impl Mn {
    fn start(port: u16) -> (Mn, String) {
        if let Ok(addr) = std::env::var("OMW_MN_ADDR") {
            let log = std::env::var("OMW_MN_LOG").expect("OMW_MN_ADDR needs OMW_MN_LOG (the MN's log file)");
            let mn = Mn { child: None, log: log.into() };
            mn.wait_log("listening on");
            println!("using the MN at {addr} (log {})", mn.log.display());
            return (mn, addr);
        }
        let dir = std::env::var("OMW_RXE_VM_OUT").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
        let log = std::path::Path::new(&dir).join(format!("mn-{port}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let addr = format!("{}:{port}", std::env::var("OMW_SELF_IP").unwrap_or_else(|_| "192.0.2.1".into()));
        let child = Command::new(node())
            .args(["mn", "--listen", &addr, "--pool-size", "65536", "--chunk-size", "4096", "--group-size", "3"])
            .args(["--stats-ms", "200"])
            .stderr(f)
            .spawn()
            .unwrap();
        let mn = Mn { child: Some(child), log };
        mn.wait_log("listening on");
        (mn, addr)
    }
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    fn wait_log(&self, needle: &str) {
        let t = Instant::now();
        while !self.log().contains(needle) {
            assert!(t.elapsed() < Duration::from_secs(60), "MN log never showed {needle:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    fn stop(mut self) {
        let Some(child) = self.child.as_mut() else {
            println!("(remote MN: left running for whoever started it)");
            return;
        };
        let t = Instant::now();
        let _ = Command::new("kill").args(["-INT", &child.id().to_string()]).status();
        let st = child.wait().unwrap();
        println!("--- MN log ---\n{}", self.log());
        println!("MN stopped in {:?}", t.elapsed());
        assert!(st.success(), "MN exited with {st}");
        assert!(t.elapsed() < Duration::from_secs(20), "MN shutdown stalled: {:?}", t.elapsed());
    }
}

impl Drop for Mn {
    /// A failed test still stops its MN (SIGINT: it tears down cleanly), and shows the log.
    fn drop(&mut self) {
        let Some(child) = self.child.as_mut() else {
            if std::thread::panicking() {
                println!("--- MN log ---\n{}", self.log());
            }
            return;
        };
        if let Ok(None) = child.try_wait() {
            let _ = Command::new("kill").args(["-INT", &child.id().to_string()]).status();
            let t = Instant::now();
            while matches!(child.try_wait(), Ok(None)) && t.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
            println!("--- MN log ---\n{}", self.log());
        }
    }
}

struct Cn {
    /// "cnN" as the MN logs it.
    id: String,
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

impl Cn {
    fn start(addr: &str) -> Cn {
        let mut child = Command::new(node())
            .args(["cn", "--connect", addr, "--timeout", "30", "script"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let mut c = Cn { id: String::new(), child, stdin, out };
        let info = c.cmd("info");
        let n = info.strip_prefix("ok cn=").and_then(|r| r.split_whitespace().next());
        c.id = format!("cn{}", n.unwrap_or_else(|| panic!("CN did not connect: {info}")));
        c
    }
    fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
        let mut s = String::new();
        self.out.read_line(&mut s).unwrap();
        let s = s.trim().to_string();
        println!("  [{}] {line:<50} -> {s}", stamp());
        s
    }
    fn quit(mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
    /// SIGKILL: the process dies with its QPs connected.
    fn kill(mut self) {
        self.child.kill().unwrap();
        let _ = self.child.wait();
        println!("  [{}] killed {}", stamp(), self.id);
    }
}

/// Fields of an "ok N entry=… base=… len=… rkeys=a,b owner_rkey=…" line.
struct A {
    n: String,
    entry: u64,
    base: u64,
    rkeys: Vec<u64>,
}

fn hex(s: &str) -> u64 {
    u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap()
}

fn parse_alloc(s: &str) -> A {
    assert!(s.starts_with("ok "), "alloc failed: {s}");
    let w: Vec<&str> = s.split_whitespace().collect();
    let field = |k: &str| w.iter().find_map(|x| x.strip_prefix(k)).unwrap().to_string();
    A {
        n: w[1].to_string(),
        entry: hex(&field("entry=")),
        base: hex(&field("base=")),
        rkeys: field("rkeys=").split(',').map(hex).collect(),
    }
}

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
