//! A pool on real soft-RoCE, in the two VMs of scripts/verbs-ci: etcd and MN `mn-a` in VM A,
//! MN `mn-b` and this test (its CNs) in VM B, both MNs `omw mn --classes … --registry …`.
//! CNs place across both MNs, then `mn-a` is killed (SIGKILL: no goodbye): both CNs learn it
//! (from the registry when its lease runs out, or from their connections), its allocations fail
//! with `MnLost` at once from then on, and the CNs go on with `mn-b`.
//!
//! Then a CN of the tenant `capped` (the tenants file both MNs run with, `--tenants`) is held
//! to its 128 KiB over mn-b's two classes together: the MN's classes keep each other told
//! (`omw_verbs::mn::class_ledger`).
//!
//! Skipped (it says so) unless `OMW_POOL_REGISTRY` (the etcd URL) and `OMW_POOL_SHARE` (the
//! shared folder the two VMs coordinate through) are set — verbs-ci sets them.

use omw_pool::client::PoolNote;
use omw_pool::etcd::EtcdRegistry;
use omw_pool::registry::Name;
use omw_pool::verbs::VerbsConnector;
use omw_pool::{PoolAlloc, PoolClient, PoolError};
use omw_verbs::cn::CnOptions;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn env() -> Option<(String, PathBuf)> {
    Some((std::env::var("OMW_POOL_REGISTRY").ok()?, PathBuf::from(std::env::var("OMW_POOL_SHARE").ok()?)))
}

/// The credential of `tenant` from the tenants file the MNs run with.
fn credential(share: &std::path::Path, tenant: &str) -> omw_verbs::admission::Credential {
    let text = std::fs::read_to_string(share.join("tenants")).expect("the tenants file pool-vm wrote");
    let tenants = omw_verbs::admission::parse_tenants(&text, 65536).expect("tenants file");
    tenants.into_iter().find(|t| t.credential.name == tenant).expect("tenant in the file").credential
}

fn client(url: &str, seed: u64, share: &std::path::Path, tenant: &str) -> PoolClient<VerbsConnector> {
    let reg = EtcdRegistry::connect(url).expect("etcd");
    let opts = CnOptions {
        timeout: Duration::from_secs(5),
        credential: Some(credential(share, tenant)),
        ..CnOptions::default()
    };
    PoolClient::new(&reg, Name::new("vmpool").unwrap(), VerbsConnector { opts }, seed).expect("pool client")
}

fn pattern(i: usize) -> Vec<u8> {
    (0..48).map(|k| (i * 13 + k) as u8 ^ 0x3C).collect()
}

fn per_mn(v: &[(usize, PoolAlloc)]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for (_, a) in v {
        *m.entry(a.mn().to_string()).or_insert(0) += 1;
    }
    m
}

/// Wait for `f`, servicing both clients meanwhile (their MNs' lease probes need answers).
fn wait_for(
    what: &str,
    secs: u64,
    cs: &mut [&mut PoolClient<VerbsConnector>],
    mut f: impl FnMut(&mut [&mut PoolClient<VerbsConnector>]) -> bool,
) {
    let t0 = Instant::now();
    loop {
        for c in cs.iter_mut() {
            c.poll();
        }
        if f(cs) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(secs), "{what} within {secs} s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// An allocation that fits once the client's frees are done. The MN does not confirm a free
/// (`CnClient::free`), and frees and allocations travel on different QPs to possibly different
/// classes: until the MN has run the frees, the allocation is refused (`QuotaExceeded`, never
/// an excess), so it is retried for up to 10 s.
fn alloc_once_freed(c: &mut PoolClient<VerbsConnector>, size: u64, what: &str) -> PoolAlloc {
    let t0 = Instant::now();
    loop {
        match c.alloc(size) {
            Ok(a) => return a,
            Err(PoolError::QuotaExceeded { .. }) if t0.elapsed() < Duration::from_secs(10) => {
                c.poll();
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

#[test]
fn cns_place_across_two_mns_and_survive_one_being_killed() {
    let Some((url, share)) = env() else {
        eprintln!("skipped: run by scripts/verbs-ci (OMW_POOL_REGISTRY, OMW_POOL_SHARE)");
        return;
    };
    let mut c1 = client(&url, 1, &share, "pool");
    let mut c2 = client(&url, 2, &share, "pool");
    wait_for("both MNs in the registry", 60, &mut [&mut c1, &mut c2], |cs| cs.iter().all(|c| c.members().len() == 2));
    let t = Instant::now();
    let mut xs = Vec::new();
    for i in 0..12 {
        let a = c1.alloc(100).expect("alloc");
        c1.write(&a, 0, &pattern(i)).expect("write");
        xs.push((i, a));
    }
    let big = c1.alloc(20_000).expect("a 64 KiB chunk");
    assert_eq!(big.chunk_size(), 65536);
    c1.write(&big, 0, &vec![7u8; 20_000]).expect("write 20000 B");
    let mut back = vec![0u8; 20_000];
    c1.read(&big, 0, &mut back).expect("read 20000 B");
    assert!(back.iter().all(|b| *b == 7));
    let mut ys = Vec::new();
    for i in 0..6 {
        let a = c2.alloc(100).expect("alloc");
        c2.write(&a, 0, &pattern(100 + i)).expect("write");
        ys.push((100 + i, a));
    }
    eprintln!("placed: CN 1 {:?}, CN 2 {:?} ({:?})", per_mn(&xs), per_mn(&ys), t.elapsed());
    assert_eq!(per_mn(&xs).len(), 2, "CN 1 placed on {:?}", per_mn(&xs));
    for (c, v) in [(&mut c1, &xs), (&mut c2, &ys)] {
        for (i, a) in v {
            let mut b = vec![0u8; 48];
            c.read(a, 0, &mut b).expect("read");
            assert_eq!(b, pattern(*i));
        }
    }
    // make sure CN 2 has something on mn-a too
    while !ys.iter().any(|(_, a)| a.mn() == "mn-a") && ys.len() < 40 {
        let i = 100 + ys.len();
        let a = c2.alloc(100).expect("alloc");
        c2.write(&a, 0, &pattern(i)).expect("write");
        ys.push((i, a));
    }
    // mn-a is killed
    std::fs::write(share.join("kill-a"), b"now").unwrap();
    wait_for("mn-a killed", 30, &mut [&mut c1, &mut c2], |_| share.join("killed-a").exists());
    let t = Instant::now();
    // Both learn it: from the registry once mn-a's lease ran out (2 s), or from their connections.
    // (Until then a one-sided READ of mn-a's chunk may still succeed: rxe's kernel keeps a killed
    // process's QPs and pinned memory answering while it tears them down.)
    let mut notes = Vec::new();
    wait_for("both CNs to see mn-a depart", 30, &mut [&mut c1, &mut c2], |cs| {
        for (k, c) in cs.iter_mut().enumerate() {
            notes.extend(c.take_notes().into_iter().map(|n| (k + 1, n)));
        }
        (1..=2)
            .all(|k| notes.iter().any(|(c, n)| *c == k && matches!(n, PoolNote::Departed { mn, .. } if mn == "mn-a")))
    });
    eprintln!("mn-a departed for both CNs {:?} after the kill: {notes:?}", t.elapsed());
    // from then on every access to a chunk there fails at once with MnLost; the rest read back
    for (c, v) in [(&mut c1, &xs), (&mut c2, &ys)] {
        let mut lost = 0;
        for (i, a) in v.iter() {
            let mut b = vec![0u8; 48];
            let t = Instant::now();
            match c.read(a, 0, &mut b) {
                Err(PoolError::MnLost { mn }) => {
                    assert_eq!(mn, "mn-a");
                    assert!(t.elapsed() < Duration::from_secs(1), "MnLost took {:?}", t.elapsed());
                    lost += 1;
                }
                Ok(()) => {
                    assert_eq!(a.mn(), "mn-b");
                    assert_eq!(b, pattern(*i));
                }
                Err(e) => panic!("read on {}: {e}", a.mn()),
            }
        }
        assert_eq!(lost, per_mn(v)["mn-a"]);
    }
    // both go on with mn-b
    for c in [&mut c1, &mut c2] {
        for i in 0..4 {
            let a = c.alloc(100).expect("alloc after the kill");
            assert_eq!(a.mn(), "mn-b");
            c.write(&a, 0, &pattern(500 + i)).unwrap();
            let mut b = vec![0u8; 48];
            c.read(&a, 0, &mut b).unwrap();
            assert_eq!(b, pattern(500 + i));
            c.free(a).unwrap();
        }
    }
    for (c, v) in [(&mut c1, xs), (&mut c2, ys)] {
        for (_, a) in v.into_iter().filter(|(_, a)| a.mn() == "mn-b") {
            c.free(a).expect("free on mn-b");
        }
    }
    c1.free(big).or_else(|e| if matches!(e, PoolError::MnLost { .. }) { Ok(()) } else { Err(e) }).unwrap();

    // The byte quota over mn-b's classes (mn-a is gone: every allocation is mn-b's). The tenant
    // `capped` may hold 128 KiB over both classes together; each refusal below comes while the
    // class has free chunks and the tenant's group quota there has room (64 KiB class: 2; 4 KiB
    // class: 32), so only the bytes refuse it.
    let mut c3 = client(&url, 3, &share, "capped");
    let large = c3.alloc(20_000).expect("a 64 KiB chunk");
    assert_eq!((large.mn(), large.chunk_size()), ("mn-b", 65536));
    let mut small: Vec<PoolAlloc> = (0..8).map(|_| c3.alloc(100).expect("a 4 KiB chunk")).collect();
    // 96 KiB held: a second 64 KiB chunk would be 160
    assert!(matches!(c3.alloc(20_000), Err(PoolError::QuotaExceeded { chunk_size: 65536 })), "2nd large at 96 KiB");
    for a in small.drain(..4) {
        c3.free(a).expect("free");
    }
    assert!(matches!(c3.alloc(20_000), Err(PoolError::QuotaExceeded { chunk_size: 65536 })), "2nd large at 80 KiB");
    // frees in the small class make room in the large one
    for a in small.drain(..) {
        c3.free(a).expect("free");
    }
    let second = alloc_once_freed(&mut c3, 20_000, "a second 64 KiB chunk at 64 KiB held");
    // 128 KiB held in the large class: the small class, empty of the tenant's chunks, refuses
    assert!(matches!(c3.alloc(100), Err(PoolError::QuotaExceeded { chunk_size: 4096 })), "a small chunk at 128 KiB");
    // and a free in the large class makes room in the small one
    c3.free(large).expect("free a large chunk");
    let more = alloc_once_freed(&mut c3, 100, "a small chunk once a large one is freed");
    eprintln!("tenant `capped` held to 128 KiB over mn-b's two classes");
    c3.free(second).unwrap();
    c3.free(more).unwrap();
}
