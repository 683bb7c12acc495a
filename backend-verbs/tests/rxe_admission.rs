//! Admission control against a real `omw mn --tenants` on soft-RoCE (issue 20, item 6): a peer
//! that keeps reopening half-open sessions, a tenant that opens many complete sessions, and
//! peers with a wrong or replayed credential — while an honest tenant connects and is served
//! throughout. The hostile peers play other hosts from extra addresses on the VM's netdev.
//! Skipped unless OMW_RXE is set.

mod common;
use common::*;
use omw_verbs::admission::{unix_now, Credential};
use omw_verbs::cm::{Hello, Role};
use omw_verbs::cn::{CnClient, CnOptions};
use omw_verbs::VerbsBackend;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ALICE: &str = "00112233445566778899aabbccddeeff";
const MALLORY: &str = "ffeeddccbbaa99887766554433221100";
/// A liveness deadline, not a measurement: the honest tenant must connect within this while
/// the attackers run.
const CONNECT_DEADLINE: Duration = Duration::from_secs(10);

fn cred(name: &str, hex: &str) -> Credential {
    let b = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    Credential::new(name, b).unwrap()
}

fn opts(c: Option<Credential>, source: Option<Ipv4Addr>) -> CnOptions {
    CnOptions { device: Some(device()), timeout: Duration::from_secs(5), credential: c, source, alloc_chains: 1 }
}

/// One half-open session: only the Alloc connection, signed by `c` (None: no credential).
fn half_open(addr: SocketAddr, src: Ipv4Addr, c: Option<&Credential>, n: u64) -> Option<VerbsBackend> {
    let mut b = VerbsBackend::open_cn(Some(&device())).ok()?;
    let h = match c {
        Some(c) => Hello::signed(Role::Alloc, n, c, unix_now()),
        None => Hello::new(Role::Alloc, n),
    };
    b.connect_from(Some(src), addr, &h, Duration::from_secs(2), |_, _| Ok(())).ok().map(|_| b)
}

#[test]
fn hostile_peers_do_not_lock_out_an_honest_tenant() {
    if !rxe() {
        return;
    }
    // the attackers' "hosts"
    let evil: Vec<Ipv4Addr> = (10..15).map(|k| Ipv4Addr::new(192, 0, 2, k)).collect();
    for a in &evil {
        let st =
            std::process::Command::new("ip").args(["addr", "add", &format!("{a}/24"), "dev", "rxedummy0"]).status();
        assert!(st.is_ok_and(|s| s.success()), "ip addr add {a}");
    }
    let dir = std::env::var("OMW_RXE_VM_OUT").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
    let tenants = std::path::Path::new(&dir).join("tenants");
    std::fs::write(
        &tenants,
        format!("alice secret={ALICE} quota=16K cns=1\nmallory secret={MALLORY} quota=16K cns=3\n"),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tenants, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let (mn, addr) = Mn::start_local(7481, &["--tenants", tenants.to_str().unwrap(), "--max-cns", "8"]);
    let addr: SocketAddr = addr.parse().unwrap();
    assert!(mn.log().contains("admission: 2 tenant(s)"), "{}", mn.log());
    let stop = Arc::new(AtomicBool::new(false));

    // 1. half-open flooders: one unauthenticated, one as mallory, each from its own address,
    //    reopening as fast as they can
    let mut threads = Vec::new();
    for (k, src) in evil[..2].iter().copied().enumerate() {
        let stop = stop.clone();
        threads.push(std::thread::spawn(move || {
            let m = cred("mallory", MALLORY);
            let mut held = Vec::new();
            let (mut opened, mut n) = (0u64, (k as u64) << 32);
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                match half_open(addr, src, (k == 1).then_some(&m), n) {
                    Some(b) => {
                        opened += 1;
                        held.push(b);
                    }
                    None => std::thread::sleep(Duration::from_millis(20)),
                }
                held.truncate(8); // keep some, so the MN's patience is what drops them
            }
            opened
        }));
    }
    // 2. Sybil: mallory opens complete sessions from two more addresses and allocates all it can
    let sybil = {
        let stop = stop.clone();
        let srcs = [evil[2], evil[3]];
        std::thread::spawn(move || {
            let mut clients = Vec::new();
            let (mut chunks, mut tries) = (Vec::new(), 0u32);
            while !stop.load(Ordering::Relaxed) && tries < 12 {
                tries += 1;
                let src = srcs[tries as usize % 2];
                if let Ok(c) = CnClient::connect(addr, &opts(Some(cred("mallory", MALLORY)), Some(src))) {
                    clients.push(c);
                }
                for c in clients.iter_mut() {
                    while let Ok(a) = c.alloc() {
                        chunks.push(a);
                        if chunks.len() > 16 {
                            break;
                        }
                    }
                }
            }
            (clients.len(), chunks.len())
        })
    };
    std::thread::sleep(Duration::from_millis(500));

    // 3. a wrong credential, and a replayed hello
    let wrong = CnClient::connect(addr, &opts(Some(cred("alice", MALLORY)), Some(evil[0])));
    assert!(wrong.is_err(), "a wrong secret connected");
    let alice = cred("alice", ALICE);
    let captured = Hello::signed(Role::Alloc, 0x5eed, &alice, unix_now());
    let mut b1 = VerbsBackend::open_cn(Some(&device())).unwrap();
    b1.connect_from(Some(evil[4]), addr, &captured, Duration::from_secs(5), |_, _| Ok(())).expect("first use");
    drop(b1);
    let mut b2 = VerbsBackend::open_cn(Some(&device())).unwrap();
    let replay = b2.connect_from(Some(evil[4]), addr, &captured, Duration::from_secs(5), |_, _| Ok(()));
    assert!(replay.is_err(), "a replayed hello was accepted");

    // 4. the honest tenant connects within the deadline and is served throughout
    let t = Instant::now();
    let mut c = loop {
        match CnClient::connect(addr, &opts(Some(cred("alice", ALICE)), None)) {
            Ok(c) => break c,
            Err(e) => {
                assert!(t.elapsed() < CONNECT_DEADLINE, "the honest tenant could not connect: {e}\n{}", mn.log());
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    println!("honest tenant connected in {:?} while the attackers ran", t.elapsed());
    let until = Instant::now() + Duration::from_secs(8); // past the 5 s patience: drops and retakes
    let mut i = 0u64;
    while Instant::now() < until {
        let a = c.alloc().unwrap_or_else(|e| panic!("honest alloc {i}: {e}\n{}", mn.log()));
        let text = format!("alice-{i}");
        c.write(&a, 0, 0, text.as_bytes()).unwrap();
        assert_eq!(c.read(&a, 1, 0, text.len()).unwrap(), text.as_bytes());
        c.free(&a).unwrap();
        i += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let opened: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let (sessions, chunks) = sybil.join().unwrap();
    println!("honest cycles {i}; half-open sessions opened {opened:?}; sybil sessions {sessions}, chunks {chunks}");
    assert_eq!(opened[0], 0, "an unauthenticated peer opened a session");
    assert!(sessions <= 3, "mallory had {sessions} sessions with 3 CN slots");
    assert!(chunks <= 4, "mallory held {chunks} chunks with a 16K quota");
    drop(c);
    let log = mn.log();
    for needle in ["credential: no credential", "wrong credential", "replayed", "half-open session(s) already"] {
        assert!(log.contains(needle), "the MN log has no {needle:?}:\n{log}");
    }
    mn.stop();
}
