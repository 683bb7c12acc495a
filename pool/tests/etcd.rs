//! The etcd registry against a real etcd server (Debian's etcd-server, started on 127.0.0.1 by
//! the test: `EtcdServer`). Waits are bounded; nothing here measures time.

use omw_pool::etcd::EtcdRegistry;
use omw_pool::etcd_server::EtcdServer;
use omw_pool::registry::{Name, Registry, RegistryError, RegistryEvent, Watch};
use std::time::{Duration, Instant};

fn n(s: &str) -> Name {
    Name::new(s).unwrap()
}

/// The next event satisfying `f`, waiting at most 20 s.
fn wait_for(w: &Watch, what: &str, f: impl Fn(&RegistryEvent) -> bool) -> RegistryEvent {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        if let Some(ev) = w.next_timeout(Duration::from_millis(200)) {
            if f(&ev) {
                return ev;
            }
        }
    }
    panic!("no {what} within 20 s");
}

#[test]
fn an_unreachable_etcd_is_an_error_naming_its_url() {
    let url = "http://127.0.0.1:9"; // discard port: nothing speaks gRPC there
    let e = EtcdRegistry::connect_with(url, Duration::from_secs(2)).unwrap_err();
    assert!(matches!(&e, RegistryError::Unreachable { url: u, .. } if u == url), "{e:?}");
    assert!(e.to_string().contains(url), "{e}");
}

#[test]
fn records_live_with_their_lease_and_watchers_see_them_come_and_go() {
    let etcd = EtcdServer::start().unwrap();
    let reg = EtcdRegistry::connect(&etcd.url).unwrap();
    let pool = n("p1");
    let w = reg.watch(&pool).unwrap();
    assert_eq!(w.next_timeout(Duration::from_secs(5)), Some(RegistryEvent::Resync(vec![])));

    let lease = reg.register(&pool, &n("a"), b"one", Duration::from_secs(2)).unwrap();
    assert_eq!(reg.register(&pool, &n("a"), b"two", Duration::from_secs(2)), Err(RegistryError::NameTaken("a".into())));
    wait_for(&w, "the put", |e| *e == RegistryEvent::Put { name: "a".into(), value: b"one".to_vec() });
    reg.keep_alive(lease).unwrap();
    reg.update(&pool, &n("a"), b"three", lease).unwrap();
    wait_for(&w, "the update", |e| *e == RegistryEvent::Put { name: "a".into(), value: b"three".to_vec() });
    assert_eq!(reg.members(&pool).unwrap(), vec![("a".to_string(), b"three".to_vec())]);
    assert_eq!(reg.members(&n("other")).unwrap(), vec![]);

    // no more keep-alives: etcd expires the lease and deletes the record
    wait_for(&w, "the expiry", |e| *e == RegistryEvent::Delete { name: "a".into() });
    assert_eq!(reg.keep_alive(lease), Err(RegistryError::LeaseExpired(lease)));
    assert!(matches!(reg.update(&pool, &n("a"), b"x", lease), Err(RegistryError::LeaseExpired(_))));

    // a clean leave deletes at once
    let l2 = reg.register(&pool, &n("b"), b"b", Duration::from_secs(30)).unwrap();
    wait_for(&w, "b's put", |e| matches!(e, RegistryEvent::Put { name, .. } if name == "b"));
    reg.deregister(&pool, &n("b"), l2).unwrap();
    wait_for(&w, "b's delete", |e| *e == RegistryEvent::Delete { name: "b".into() });

    // drain requests
    assert!(!reg.drain_requested(&pool, &n("a")).unwrap());
    reg.request_drain(&pool, &n("a"), true).unwrap();
    assert!(reg.drain_requested(&pool, &n("a")).unwrap());
    reg.request_drain(&pool, &n("a"), false).unwrap();
    assert!(!reg.drain_requested(&pool, &n("a")).unwrap());
}

#[test]
fn a_watch_reports_a_lost_etcd_and_resynchronises_when_it_is_back() {
    let mut etcd = EtcdServer::start().unwrap();
    let reg = EtcdRegistry::connect(&etcd.url).unwrap();
    let pool = n("p2");
    let lease = reg.register(&pool, &n("a"), b"one", Duration::from_secs(30)).unwrap();
    let w = reg.watch(&pool).unwrap();
    wait_for(&w, "the first resync", |e| matches!(e, RegistryEvent::Resync(v) if v.len() == 1));
    etcd.kill();
    let lost = wait_for(&w, "lost", |e| matches!(e, RegistryEvent::Lost(_)));
    let RegistryEvent::Lost(e) = lost else { unreachable!() };
    assert!(e.to_string().contains(&etcd.url), "{e}");
    assert!(matches!(reg.keep_alive(lease), Err(RegistryError::Unreachable { .. })));
    etcd.restart().unwrap();
    // the record survived (its lease's TTL is 30 s and etcd keeps leases across a restart)
    wait_for(
        &w,
        "the resync",
        |e| matches!(e, RegistryEvent::Resync(v) if v == &vec![("a".to_string(), b"one".to_vec())]),
    );
    reg.keep_alive(lease).unwrap();
}

#[test]
fn a_watch_outlives_the_registry_handle_it_came_from() {
    let etcd = EtcdServer::start().unwrap();
    let w = EtcdRegistry::connect(&etcd.url).unwrap().watch(&n("p3")).unwrap();
    wait_for(&w, "the first resync", |e| matches!(e, RegistryEvent::Resync(_)));
    let other = EtcdRegistry::connect(&etcd.url).unwrap();
    other.register(&n("p3"), &n("a"), b"one", Duration::from_secs(30)).unwrap();
    wait_for(&w, "the put", |e| matches!(e, RegistryEvent::Put { name, .. } if name == "a"));
}
