//! The MN's counters, machine-readable: the Prometheus text exposition format (version 0.0.4)
//! served at `GET /metrics` by a small std `TcpListener` thread (`omw mn --metrics ADDR`), and
//! one JSON object per line (`omw mn --stats-json`). The daemon publishes a [`MnCounters`]
//! snapshot; the server thread only formats the latest one, so it never touches the device.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One snapshot of the daemon's counters (monotonic unless said otherwise).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MnCounters {
    pub uptime_ms: u64,
    /// Gauge: CNs connected.
    pub cns: u64,
    /// Gauge: chunks in the free queue.
    pub free_chunks: u64,
    /// Gauge: chunks in the pool.
    pub chunks: u64,
    pub allocs: u64,
    pub frees: u64,
    pub empty_notices: u64,
    pub available_notices: u64,
    pub groups_reclaimed: u64,
    /// Single chunks taken back from CNs that stay connected, each CN told which
    /// (`wire::message::TakenBack`).
    pub taken_back_notices: u64,
    pub forged_frees: u64,
    pub quota_disconnects: u64,
    pub chunks_scrubbed: u64,
    pub laps: u64,
    pub laps_failed: u64,
    /// Gauge: windows deallocated because they could not be invalidated.
    pub lost_windows: u64,
    /// Window-state queries the device did not answer (each left the audit blind to that
    /// window for that look; DEVX's QUERY_MKEY).
    pub window_query_failures: u64,
    /// Connection requests refused for their credential (none, wrong, stale, replayed).
    pub rejected_credential: u64,
    /// … for a limit (CN slots, half-open sessions per address or tenant).
    pub rejected_limit: u64,
    /// … for anything else (no hello, a bad role, a join from another address).
    pub rejected_session: u64,
    /// CN connections rejoined (an MN-side QP reconnected to a CN's new QP, `crate::rejoin`).
    pub rejoins: u64,
}

const FIELDS: [(&str, &str, &str); 21] = [
    ("uptime_ms", "gauge", "milliseconds since the MN started"),
    ("cns", "gauge", "compute nodes connected"),
    ("free_chunks", "gauge", "chunks in the free queue"),
    ("chunks", "gauge", "chunks in the pool"),
    ("allocs", "counter", "allocations served"),
    ("frees", "counter", "frees served"),
    ("empty_notices", "counter", "times every CN was told the free queue is empty"),
    ("available_notices", "counter", "times every CN was told the free queue has chunks again"),
    ("groups_reclaimed", "counter", "chunks reclaimed from failed laps, departed CNs, quota and audits"),
    (
        "taken_back_notices",
        "counter",
        "single chunks taken back from CNs that stay connected (audit findings, undone laps), each CN told",
    ),
    ("forged_frees", "counter", "frees refused because the requester did not own the chunk"),
    ("quota_disconnects", "counter", "CNs disconnected for exceeding their quota"),
    ("chunks_scrubbed", "counter", "chunks zeroed by the MN CPU before reuse"),
    ("laps", "counter", "host-engine laps run"),
    ("laps_failed", "counter", "host-engine laps that failed"),
    ("lost_windows", "gauge", "memory windows deallocated because they could not be invalidated"),
    (
        "window_query_failures",
        "counter",
        "window-state queries the device did not answer (the audit was blind to that window for that look)",
    ),
    (
        "rejected_credential",
        "counter",
        "connection requests refused for their credential (none, wrong, stale, replayed)",
    ),
    ("rejected_limit", "counter", "connection requests refused for a CN-slot or half-open-session limit"),
    ("rejected_session", "counter", "connection requests refused otherwise (no hello, bad role, join from elsewhere)"),
    ("rejoins", "counter", "CN connections rejoined: an MN-side QP reconnected to the CN's new QP, its chain re-armed"),
];

impl MnCounters {
    fn values(&self) -> [u64; 21] {
        [
            self.uptime_ms,
            self.cns,
            self.free_chunks,
            self.chunks,
            self.allocs,
            self.frees,
            self.empty_notices,
            self.available_notices,
            self.groups_reclaimed,
            self.taken_back_notices,
            self.forged_frees,
            self.quota_disconnects,
            self.chunks_scrubbed,
            self.laps,
            self.laps_failed,
            self.lost_windows,
            self.window_query_failures,
            self.rejected_credential,
            self.rejected_limit,
            self.rejected_session,
            self.rejoins,
        ]
    }

    /// Prometheus text format; counters end in `_total`.
    pub fn prometheus(&self) -> String {
        let mut s = String::new();
        for ((name, kind, help), v) in FIELDS.iter().zip(self.values()) {
            let full = if *kind == "counter" { format!("omw_mn_{name}_total") } else { format!("omw_mn_{name}") };
            s.push_str(&format!("# HELP {full} {help}\n# TYPE {full} {kind}\n{full} {v}\n"));
        }
        s
    }

    /// One JSON object on one line (field names as in [`MnCounters`]).
    pub fn json(&self) -> String {
        let body: Vec<String> = FIELDS.iter().zip(self.values()).map(|((n, _, _), v)| format!("\"{n}\":{v}")).collect();
        format!("{{{}}}", body.join(","))
    }
}

/// The `--metrics` endpoint: a thread answering `GET /metrics` with the latest snapshot.
#[derive(Debug)]
pub struct MetricsServer {
    pub addr: SocketAddr,
    latest: Arc<Mutex<MnCounters>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MetricsServer {
    /// Bind `addr` (port 0: any) and serve until dropped.
    pub fn start(addr: SocketAddr) -> std::io::Result<MetricsServer> {
        let l = TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        let addr = l.local_addr()?;
        let latest = Arc::new(Mutex::new(MnCounters::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (lt, st) = (latest.clone(), stop.clone());
        let thread = std::thread::Builder::new().name("omw-metrics".into()).spawn(move || {
            while !st.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((s, _)) => {
                        let c = lt.lock().map(|c| *c).unwrap_or_default();
                        let _ = answer(s, &c);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        })?;
        Ok(MetricsServer { addr, latest, stop, thread: Some(thread) })
    }

    pub fn publish(&self, c: MnCounters) {
        if let Ok(mut l) = self.latest.lock() {
            *l = c;
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One request on one connection: `GET /metrics` → 200 with the text format, else 404.
fn answer(mut s: TcpStream, c: &MnCounters) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = if method == "GET" && (path == "/metrics" || path.starts_with("/metrics?")) {
        ("200 OK", "text/plain; version=0.0.4", c.prometheus())
    } else {
        ("404 Not Found", "text/plain", "omw mn serves GET /metrics\n".to_string())
    };
    write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    s.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn sample() -> MnCounters {
        MnCounters { cns: 2, free_chunks: 14, chunks: 16, allocs: 5, frees: 3, ..Default::default() }
    }

    #[test]
    fn text_format_and_json() {
        let p = sample().prometheus();
        assert!(p.contains("# TYPE omw_mn_allocs_total counter\nomw_mn_allocs_total 5\n"), "{p}");
        assert!(p.contains("# TYPE omw_mn_free_chunks gauge\nomw_mn_free_chunks 14\n"), "{p}");
        assert_eq!(p.lines().filter(|l| !l.starts_with('#')).count(), FIELDS.len());
        let w = MnCounters { window_query_failures: 4, rejoins: 2, ..sample() }.prometheus();
        assert!(w.contains("# TYPE omw_mn_window_query_failures_total counter\nomw_mn_window_query_failures_total 4\n"));
        assert!(w.contains("# TYPE omw_mn_rejoins_total counter\nomw_mn_rejoins_total 2\n"));
        let j = sample().json();
        assert!(j.starts_with("{\"uptime_ms\":0,\"cns\":2,\"free_chunks\":14,\"chunks\":16,\"allocs\":5,"), "{j}");
        assert!(!j.contains('\n'));
    }

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_the_latest_snapshot() {
        let m = MetricsServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
        m.publish(sample());
        let r = get(m.addr, "/metrics");
        assert!(r.starts_with("HTTP/1.1 200 OK"), "{r}");
        assert!(r.contains("omw_mn_cns 2\n"), "{r}");
        m.publish(MnCounters { cns: 3, ..sample() });
        assert!(get(m.addr, "/metrics").contains("omw_mn_cns 3\n"));
        assert!(get(m.addr, "/").starts_with("HTTP/1.1 404"));
    }
}
