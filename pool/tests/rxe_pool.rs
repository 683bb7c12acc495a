//! A pool on real soft-RoCE, in the two VMs of scripts/verbs-ci: etcd and MN `mn-a` in VM A,
//! MN `mn-b` and this test (its CNs) in VM B, both MNs `omw mn --classes … --registry …`.
//! CNs place across both MNs, then `mn-a` is killed (SIGKILL: no goodbye): both CNs learn it
//! (from the registry when its lease runs out, or from their connections), its allocations fail
//! with `MnLost` at once from then on, and the CNs go on with `mn-b`.
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

fn client(url: &str, seed: u64) -> PoolClient<VerbsConnector> {
    let reg = EtcdRegistry::connect(url).expect("etcd");
    let opts = CnOptions { timeout: Duration::from_secs(5), ..CnOptions::default() };
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

#[test]
fn cns_place_across_two_mns_and_survive_one_being_killed() {
    let Some((url, share)) = env() else {
        eprintln!("skipped: run by scripts/verbs-ci (OMW_POOL_REGISTRY, OMW_POOL_SHARE)");
        return;
    };
    let mut c1 = client(&url, 1);
    let mut c2 = client(&url, 2);
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
}
