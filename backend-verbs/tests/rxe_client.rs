//! The CN library against an MN process on soft-RoCE: batched asynchronous one-sided
//! operations with completion polling, mixed with blocking ones on the same QP (no completion
//! lost), the in-flight limit, a failed asynchronous READ. Skipped unless OMW_RXE is set.

mod common;
use common::*;
use omw_core::device::WcStatus;
use omw_core::ids::Rkey;
use omw_verbs::cn::{CnClient, CnOptions, OpId, ASYNC_SLOT, ASYNC_SLOTS};
use omw_verbs::VerbsError;
use std::collections::BTreeSet;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

struct Mn(Child, std::path::PathBuf);

impl Mn {
    fn start(port: u16) -> (Mn, std::net::SocketAddr) {
        let dir = std::env::var("OMW_RXE_VM_OUT").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
        let log = std::path::Path::new(&dir).join(format!("client-mn-{port}.log"));
        let ip = std::env::var("OMW_SELF_IP").unwrap_or_else(|_| "192.0.2.1".into());
        let addr: std::net::SocketAddr = format!("{ip}:{port}").parse().unwrap();
        let child = Command::new(node())
            .args(["mn", "--listen", &addr.to_string(), "--pool-size", "65536", "--chunk-size", "4096"])
            .args(["--group-size", "3", "--stats-ms", "0"])
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !std::fs::read_to_string(&log).unwrap_or_default().contains("listening on") {
            assert!(t.elapsed() < Duration::from_secs(60), "MN did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        (Mn(child, log), addr)
    }
}

impl Drop for Mn {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-INT", &self.0.id().to_string()]).status();
        let _ = self.0.wait();
        println!("--- MN log ---\n{}", std::fs::read_to_string(&self.1).unwrap_or_default());
    }
}

#[test]
fn batched_one_sided_operations() {
    if !rxe() {
        return;
    }
    let (_mn, addr) = Mn::start(7483);
    let mut c = CnClient::connect(
        addr,
        &CnOptions { device: None, timeout: Duration::from_secs(20), credential: None, source: None, alloc_chains: 1 },
    )
    .unwrap();
    let a = c.alloc().unwrap();
    let t = Duration::from_secs(10);
    // 16 WRITEs through both access QPs, collected together
    let mut ids = BTreeSet::new();
    for i in 0..16u64 {
        ids.insert(c.post_write(&a, (i % 2) as usize, i * 128, &[i as u8 + 1; 128]).unwrap());
    }
    assert_eq!(c.in_flight(), 16);
    let done = c.wait_ops(t).unwrap();
    assert_eq!(done.iter().map(|d| d.id).collect::<BTreeSet<OpId>>(), ids);
    assert!(done.iter().all(|d| d.status == WcStatus::Success && d.data.is_empty()));
    assert_eq!(c.in_flight(), 0);
    // 8 READs in flight on QP 0, then a blocking WRITE on the same QP: the READs' completions
    // (reaped while the WRITE waited) are kept for poll_ops
    let reads: Vec<OpId> = (0..8u64).map(|i| c.post_read(&a, 0, i * 128, 128).unwrap()).collect();
    c.write(&a, 0, 3000, b"blocking").unwrap();
    let back = c.wait_ops(t).unwrap();
    assert_eq!(back.len(), 8);
    for d in back {
        let i = reads.iter().position(|r| *r == d.id).unwrap() as u64;
        assert_eq!(d.status, WcStatus::Success);
        assert_eq!(d.data, vec![i as u8 + 1; 128], "READ {i} returned what WRITE {i} wrote");
    }
    assert_eq!(c.read(&a, 1, 128, 128).unwrap(), vec![2u8; 128], "WRITE 1 went through QP 1");
    // the limit is typed; nothing is posted past it
    let many: Vec<OpId> = (0..ASYNC_SLOTS).map(|_| c.post_read(&a, 1, 0, 64).unwrap()).collect();
    assert!(matches!(c.post_read(&a, 1, 0, 64), Err(VerbsError::TooManyInFlight { max: ASYNC_SLOTS })));
    assert!(matches!(c.post_write(&a, 0, 0, &vec![0u8; ASYNC_SLOT as usize + 1]), Err(VerbsError::Config(_))));
    assert_eq!(c.wait_ops(t).unwrap().len(), many.len());
    // a failed asynchronous READ reports its status (and, as any failure, errors that QP pair)
    let mut bogus = a.clone();
    bogus.rkeys[1] = Rkey(a.rkeys[1].0 ^ 0x55);
    let id = c.post_read(&bogus, 1, 0, 64).unwrap();
    let d = c.wait_ops(t).unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].id, id);
    assert_eq!(d[0].status, WcStatus::RemAccessErr);
    assert!(d[0].data.is_empty());
    // QP 0 still works; free the chunk; no notice came unasked
    assert_eq!(c.read(&a, 0, 3000, 8).unwrap(), b"blocking");
    c.free(&a).unwrap();
    c.pump().unwrap();
    assert_eq!(c.take_notices(), vec![]);
}
