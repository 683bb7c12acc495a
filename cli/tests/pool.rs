//! `omw mn --registry` and `omw mn drain` against a real etcd (started on 127.0.0.1 by the
//! test). The MN daemon itself needs an RDMA device: it runs in the soft-RoCE VMs
//! (scripts/verbs-ci); here, what needs none.

use omw_pool::entry::{ClassEntry, MnEntry, ENTRY_FORMAT};
use omw_pool::etcd::EtcdRegistry;
use omw_pool::etcd_server::EtcdServer;
use omw_pool::registry::{Name, Registry};
use std::process::Command;
use std::time::Duration;

fn omw(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_omw")).args(args).output().expect("run omw");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn an_mn_whose_registry_is_unreachable_says_which_before_anything_else() {
    let (ok, out) = omw(&[
        "mn",
        "--listen",
        "127.0.0.1:7471",
        "--registry",
        "http://127.0.0.1:9",
        "--pool",
        "p",
        "--stats-ms",
        "0",
    ]);
    assert!(!ok, "{out}");
    assert!(out.contains("registry http://127.0.0.1:9 unreachable"), "{out}");
    let (ok, out) = omw(&["mn", "--listen", "127.0.0.1:7471", "--registry", "http://127.0.0.1:9"]);
    assert!(!ok && out.contains("--pool"), "{out}");
}

#[test]
fn drain_requests_go_through_the_registry_and_wait_for_the_mn() {
    let etcd = EtcdServer::start().unwrap();
    let reg = EtcdRegistry::connect(&etcd.url).unwrap();
    let (pool, name) = (Name::new("p").unwrap(), Name::new("mn-a").unwrap());
    let (ok, out) = omw(&["mn", "drain", "--registry", &etcd.url, "--pool", "p", "--name", "mn-a"]);
    assert!(ok, "{out}");
    assert!(reg.drain_requested(&pool, &name).unwrap());
    // a record that says draining and holding nothing: --wait returns at once
    let e = MnEntry {
        format: ENTRY_FORMAT,
        name: "mn-a".into(),
        incarnation: 1,
        classes: vec![ClassEntry {
            chunk_size: 4096,
            chunks: 4,
            free: 4,
            group_size: 3,
            addr: "192.0.2.1:7490".into(),
        }],
        draining: true,
        held: 0,
    };
    let lease = reg.register(&pool, &name, &e.encode(), Duration::from_secs(30)).unwrap();
    let (ok, out) = omw(&["mn", "drain", "--registry", &etcd.url, "--pool", "p", "--name", "mn-a", "--wait-s", "20"]);
    assert!(ok && out.contains("is drained"), "{out}");
    // one still holding chunks: the wait runs out with an error
    reg.update(&pool, &name, &MnEntry { held: 2, ..e }.encode(), lease).unwrap();
    let (ok, out) = omw(&["mn", "drain", "--registry", &etcd.url, "--pool", "p", "--name", "mn-a", "--wait-s", "1"]);
    assert!(!ok && out.contains("mn-a to drain"), "{out}");
    let (ok, out) = omw(&["mn", "drain", "--registry", &etcd.url, "--pool", "p", "--name", "mn-a", "--off"]);
    assert!(ok, "{out}");
    assert!(!reg.drain_requested(&pool, &name).unwrap());
    let (ok, out) = omw(&["mn", "drain", "--registry", &etcd.url, "--pool", "p", "--name", "a/b"]);
    assert!(!ok && out.contains("--name"), "{out}");
}
