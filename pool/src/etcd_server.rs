//! A throw-away etcd server on 127.0.0.1 for tests, benchmarks and the demo: Debian's
//! `etcd-server` (installed by `scripts/setup`), a fresh data directory, free ports, killed and
//! removed on drop. (`scripts/etcd` does the same for shell use: the VM suite, by hand.)

use crate::etcd::EtcdRegistry;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd.
#[derive(Debug)]
pub struct EtcdServer {
    child: Child,
    dir: PathBuf,
    args: Vec<String>,
    pub url: String,
}

/// Why no etcd could be started.
#[derive(Debug)]
#[non_exhaustive]
pub enum EtcdServerError {
    /// The `etcd` binary is not installed.
    NotInstalled(std::io::Error),
    Io(std::io::Error),
    /// It did not answer within the start-up budget (its log's tail).
    NotReady {
        url: String,
        log: String,
    },
}

impl std::fmt::Display for EtcdServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EtcdServerError::NotInstalled(e) => {
                write!(f, "cannot run etcd ({e}): install Debian's etcd-server (scripts/setup does)")
            }
            EtcdServerError::Io(e) => write!(f, "starting etcd: {e}"),
            EtcdServerError::NotReady { url, log } => write!(f, "etcd at {url} never answered; its log ends:\n{log}"),
        }
    }
}

impl std::error::Error for EtcdServerError {}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EtcdServer {
    /// Start one and wait until it answers (at most 20 s).
    pub fn start() -> Result<EtcdServer, EtcdServerError> {
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("omw-etcd-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(EtcdServerError::Io)?;
        let (client, peer) = (free_port().map_err(EtcdServerError::Io)?, free_port().map_err(EtcdServerError::Io)?);
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let data = dir.join("data").to_string_lossy().into_owned();
        let args: Vec<String> = [
            "--name",
            "omw",
            "--data-dir",
            &data,
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--initial-cluster",
            &format!("omw={peer_url}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let child = spawn(&dir, &args)?;
        let mut s = EtcdServer { child, dir, args, url };
        s.wait_ready()?;
        Ok(s)
    }

    /// Start it again after [`EtcdServer::kill`] (same address, same data): the registry is
    /// back.
    pub fn restart(&mut self) -> Result<(), EtcdServerError> {
        self.kill();
        self.child = spawn(&self.dir, &self.args)?;
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), EtcdServerError> {
        let s = self;
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            if let Ok(Some(_)) = s.child.try_wait() {
                break;
            }
            if EtcdRegistry::connect_with(&s.url, Duration::from_millis(500)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let log = std::fs::read_to_string(s.dir.join("etcd.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(10).collect();
        let tail = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
        Err(EtcdServerError::NotReady { url: s.url.clone(), log: tail })
    }

    /// Stop it (SIGKILL: etcd keeps nothing this test needs) — the registry vanishes.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(dir: &std::path::Path, args: &[String]) -> Result<Child, EtcdServerError> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("etcd.log"))
        .map_err(EtcdServerError::Io)?;
    Command::new("etcd").args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(log).spawn().map_err(|e| match e
        .kind()
    {
        std::io::ErrorKind::NotFound => EtcdServerError::NotInstalled(e),
        _ => EtcdServerError::Io(e),
    })
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
