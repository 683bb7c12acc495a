#![allow(dead_code)]
//! Shared by the device tests: the gate, the device name, and MN / CN processes driven over
//! their script interface.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// True when the device tests should run (OMW_RXE set, as inside the rxe VM).
pub fn rxe() -> bool {
    if std::env::var_os("OMW_RXE").is_none() {
        eprintln!("skipped: set OMW_RXE=1 (scripts/verbs-ci does, inside the soft-RoCE VM)");
        return false;
    }
    true
}

/// The device under test: OMW_RXE_DEVICE or rxe0.
pub fn device() -> String {
    std::env::var("OMW_RXE_DEVICE").unwrap_or_else(|_| "rxe0".into())
}

/// Wall-clock seconds (mod 10⁴) with milliseconds, as the MN's log lines carry.
pub fn stamp() -> String {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("{:04}.{:03}", t.as_secs() % 10_000, t.subsec_millis())
}

/// The program CNs (and a local MN) run: the `omw` binary — `OMW_NODE_BIN`, else the one cargo
/// built beside this test (another package's binary, so cargo does not build it for these tests:
/// scripts/rxe-test does, and sets `OMW_NODE_BIN`).
pub fn node() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("OMW_NODE_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    let omw = exe.parent().and_then(|d| d.parent()).unwrap().join("omw");
    assert!(omw.exists(), "no {} (cargo build -p omw, or set OMW_NODE_BIN)", omw.display());
    omw
}

pub struct Mn {
    /// None: a remote MN (OMW_MN_ADDR), not ours to stop.
    pub child: Option<Child>,
    pub log: std::path::PathBuf,
}

impl Mn {
    pub fn start(port: u16) -> (Mn, String) {
        Self::start_with(port, &[])
    }
    /// An MN of this test with extra `omw mn` arguments (always local, never OMW_MN_ADDR's).
    pub fn start_local(port: u16, extra: &[&str]) -> (Mn, String) {
        Self::spawn(port, extra)
    }
    fn start_with(port: u16, extra: &[&str]) -> (Mn, String) {
        if let Ok(addr) = std::env::var("OMW_MN_ADDR") {
            let log = std::env::var("OMW_MN_LOG").expect("OMW_MN_ADDR needs OMW_MN_LOG (the MN's log file)");
            let mn = Mn { child: None, log: log.into() };
            mn.wait_log("listening on");
            println!("using the MN at {addr} (log {})", mn.log.display());
            return (mn, addr);
        }
        Self::spawn(port, extra)
    }
    fn spawn(port: u16, extra: &[&str]) -> (Mn, String) {
        let dir = std::env::var("OMW_RXE_VM_OUT").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
        let log = std::path::Path::new(&dir).join(format!("mn-{port}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let addr = format!("{}:{port}", std::env::var("OMW_SELF_IP").unwrap_or_else(|_| "192.0.2.1".into()));
        let child = Command::new(node())
            .args(["mn", "--listen", &addr, "--pool-size", "65536", "--chunk-size", "4096", "--group-size", "3"])
            .args(["--stats-ms", "200"])
            .args(extra)
            .stderr(f)
            .spawn()
            .unwrap();
        let mn = Mn { child: Some(child), log };
        mn.wait_log("listening on");
        (mn, addr)
    }
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    pub fn wait_log(&self, needle: &str) {
        let t = Instant::now();
        while !self.log().contains(needle) {
            assert!(t.elapsed() < Duration::from_secs(60), "MN log never showed {needle:?}:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    pub fn stop(mut self) {
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

pub struct Cn {
    /// "cnN" as the MN logs it.
    pub id: String,
    pub child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
}

impl Cn {
    pub fn start(addr: &str) -> Cn {
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
    pub fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
        let mut s = String::new();
        self.out.read_line(&mut s).unwrap();
        let s = s.trim().to_string();
        println!("  [{}] {line:<50} -> {s}", stamp());
        s
    }
    pub fn quit(mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
    /// Send the CN process a signal (`STOP`, `CONT`, …).
    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill").args([&format!("-{sig}"), &self.child.id().to_string()]).status().unwrap();
        assert!(st.success(), "kill -{sig} failed");
        println!("  [{}] SIG{sig} -> {}", stamp(), self.id);
    }
    /// SIGKILL: the process dies with its QPs connected.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        let _ = self.child.wait();
        println!("  [{}] killed {}", stamp(), self.id);
    }
}

/// Fields of an "ok N entry=… base=… len=… rkeys=a,b owner_rkey=…" line.
pub struct A {
    pub n: String,
    pub entry: u64,
    pub base: u64,
    pub rkeys: Vec<u64>,
}

pub fn hex(s: &str) -> u64 {
    u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap()
}

pub fn parse_alloc(s: &str) -> A {
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
