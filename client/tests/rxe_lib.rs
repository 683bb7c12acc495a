//! The CN library on soft-RoCE against `omw mn` processes (scripts/verbs-ci runs it in the VM;
//! skipped unless OMW_RXE is set): event-driven waits on the completion channel, several
//! threads allocating, accessing (staged and zero-copy) and freeing concurrently, remote
//! atomics through the windows (the MN's probe finds rxe carries them), every misuse a typed
//! error with the QPs unharmed, futures past the slots and dropped futures leaking nothing,
//! the reserve, and an MN that goes away failing every pending future with `Disconnected`.

use omw_client::verbs::{CnOptions, Target};
use omw_client::{AsyncCn, Cn, Error, Options, ReservePolicy, WaitPolicy};
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::pin;
use std::process::{Child, Command};
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

const CHUNKS: usize = 16;

fn rxe() -> bool {
    if std::env::var_os("OMW_RXE").is_none() {
        eprintln!("skipped: set OMW_RXE=1 (scripts/verbs-ci does, inside the soft-RoCE VM)");
        return false;
    }
    true
}

fn node() -> PathBuf {
    if let Some(p) = std::env::var_os("OMW_NODE_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(|d| d.parent()).unwrap().join("omw")
}

struct Mn {
    child: Child,
    log: PathBuf,
}

impl Mn {
    /// 16 chunks of 4 KiB, G = 3, a quota above the pool (a full pool answers "empty").
    fn start(port: u16) -> (Mn, SocketAddr) {
        Self::start_with(port, &[])
    }

    /// [`Mn::start`] with more `omw mn` flags.
    fn start_with(port: u16, extra: &[&str]) -> (Mn, SocketAddr) {
        let dir = std::env::var("OMW_RXE_VM_OUT").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
        let log = PathBuf::from(dir).join(format!("lib-mn-{port}.log"));
        let ip = std::env::var("OMW_SELF_IP").unwrap_or_else(|_| "192.0.2.1".into());
        let addr: SocketAddr = format!("{ip}:{port}").parse().unwrap();
        let child = Command::new(node())
            .args(["mn", "--listen", &addr.to_string(), "--pool-size", "65536", "--chunk-size", "4096"])
            .args(["--group-size", "3", "--quota", "17"])
            .args(extra)
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mn = Mn { child, log };
        let t = Instant::now();
        while !mn.log().contains("listening on") {
            assert!(t.elapsed() < Duration::from_secs(60), "the MN did not start:\n{}", mn.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        (mn, addr)
    }
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    /// SIGINT: the MN invalidates its windows and disconnects every CN.
    fn stop(&mut self) {
        let _ = Command::new("kill").args(["-INT", &self.child.id().to_string()]).status();
        let t = Instant::now();
        while matches!(self.child.try_wait(), Ok(None)) && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Mn {
    fn drop(&mut self) {
        self.stop();
        println!("--- MN log ---\n{}", self.log());
    }
}

fn target(addr: SocketAddr) -> Target {
    Target { addr, opts: CnOptions { timeout: Duration::from_secs(20), ..CnOptions::default() } }
}

fn connect(addr: SocketAddr, opts: Options) -> Cn<omw_verbs::VerbsBackend> {
    Cn::connect(target(addr), opts).unwrap()
}

/// Allocate every chunk of the pool (waiting through the "empty" an earlier client's frees
/// may still answer), then free them all: proof that nothing is held anywhere.
fn whole_pool_allocatable(addr: SocketAddr) {
    let cn = connect(addr, Options::default());
    let mut held = Vec::new();
    let t = Instant::now();
    while held.len() < CHUNKS {
        match cn.alloc() {
            Ok(c) => held.push(c),
            Err(Error::PoolEmpty) if t.elapsed() < Duration::from_secs(20) => continue,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(cn.try_alloc(), Err(Error::PoolEmpty));
    for c in held {
        cn.free(c).unwrap();
    }
    cn.shutdown().unwrap();
}

#[test]
fn the_library_on_soft_roce() {
    if !rxe() {
        return;
    }
    let (_mn, addr) = Mn::start(7487);

    // ---- blocking calls sleeping on the completion channel; several threads on one client
    let cn = connect(addr, Options { wait: WaitPolicy::SLEEP, ..Options::default() });
    assert!(cn.atomics_available(), "rxe carries atomics through windows: the MN's probe says so");
    let counter = cn.alloc().unwrap();
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let (cn, counter) = (cn.clone(), counter.clone());
            std::thread::spawn(move || {
                let mut mr = cn.register(vec![0u8; 1024]).unwrap();
                for r in 0..8u8 {
                    let c = cn.alloc().unwrap();
                    let data = vec![t * 16 + r; 3000];
                    cn.write(&c, 8, &data).unwrap();
                    let mut back = vec![0u8; 3000];
                    cn.read(&c, 8, &mut back).unwrap();
                    assert_eq!(back, data);
                    mr.as_mut_slice().fill(r ^ t);
                    cn.write_from(&c, 3072, &mr, 0..1024).unwrap();
                    mr.as_mut_slice().fill(0xFF);
                    cn.read_into(&c, 3072, &mut mr, 0..1024).unwrap();
                    assert!(mr.as_slice().iter().all(|b| *b == r ^ t));
                    cn.fetch_add(&counter, 0, 1).unwrap();
                    cn.free(c).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let mut w = [0u8; 8];
    cn.read(&counter, 0, &mut w).unwrap();
    assert_eq!(u64::from_le_bytes(w), 32, "no atomic lost");
    assert_eq!(cn.compare_swap(&counter, 0, 32, 7).unwrap(), 32);
    assert_eq!(cn.compare_swap(&counter, 0, 32, 8).unwrap(), 7);

    // ---- misuse: typed errors, nothing reaches the wire, the QPs stay up
    assert_eq!(cn.fetch_add(&counter, 4, 1), Err(Error::Misaligned { offset: 4 }));
    assert!(matches!(cn.write(&counter, 4090, &[0u8; 16]), Err(Error::OutOfChunk(_))));
    let mut big = cn.register(vec![0u8; 8192]).unwrap();
    assert!(matches!(cn.read_into(&counter, 0, &mut big, 0..8192), Err(Error::OutOfChunk(_))));
    assert_eq!(
        cn.read_into(&counter, 0, &mut big, 8000..9000),
        Err(Error::OutOfBuffer { start: 8000, end: 9000, len: 8192 })
    );
    let stale = counter.clone();
    cn.free(counter).unwrap();
    assert_eq!(cn.fetch_add(&stale, 0, 1), Err(Error::Freed));
    let c = cn.alloc().unwrap();
    cn.write(&c, 0, b"the QPs survived").unwrap();
    cn.free(c).unwrap();
    cn.shutdown().unwrap();
    drop(cn);

    // ---- futures: more than the slots at once; dropped ones leak nothing
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let cn = AsyncCn::new(connect(addr, Options::default())).unwrap();
        let c = cn.alloc().await.unwrap();
        cn.write(&c, 0, &[0x42; 4096]).await.unwrap();
        let mut set = tokio::task::JoinSet::new();
        for i in 0..200u64 {
            let (cn, c) = (cn.clone(), c.clone());
            set.spawn(async move { cn.read(&c, (i % 64) * 64, 64).await });
        }
        while let Some(r) = set.join_next().await {
            assert_eq!(r.unwrap().unwrap(), vec![0x42; 64]);
        }
        let noop = &mut Context::from_waker(Waker::noop());
        for _ in 0..20 {
            let mut r = pin!(cn.read(&c, 0, 2048));
            let _ = r.as_mut().poll(noop);
            let mr = cn.cn().register(vec![0u8; 1024]).unwrap();
            let mut z = pin!(cn.read_into(&c, 0, mr, 0..1024));
            let _ = z.as_mut().poll(noop);
        }
        {
            let mut a = pin!(cn.alloc());
            assert!(a.as_mut().poll(noop).is_pending());
        }
        let t = Instant::now();
        while cn.cn().in_flight() > 0 || cn.cn().registered_buffers() > 0 || cn.cn().stats().orphaned_allocs == 0 {
            assert!(t.elapsed() < Duration::from_secs(20), "dropped futures left work behind");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(cn.cn().held_chunks(), 1, "the orphaned chunk went back to the MN");
        cn.free(c).await.unwrap();
        cn.cn().shutdown().unwrap();
    });

    // ---- the reserve: filled in the background, given back at shutdown
    let p = ReservePolicy::new(2, 4).unwrap();
    let cn = connect(addr, Options { reserve: Some(p), ..Options::default() });
    let t = Instant::now();
    while cn.reserved() < p.target() {
        assert!(t.elapsed() < Duration::from_secs(20), "the reserve never filled");
        std::thread::sleep(Duration::from_millis(5));
    }
    let c = cn.alloc().unwrap();
    assert_eq!(cn.stats().allocs_from_reserve, 1);
    cn.free(c).unwrap();
    cn.shutdown().unwrap();
    assert_eq!(cn.held_chunks(), 0);
    drop(cn);
    whole_pool_allocatable(addr);
}

#[test]
fn an_mn_that_goes_away_fails_every_pending_future_with_disconnected() {
    if !rxe() {
        return;
    }
    let (mut mn, addr) = Mn::start(7488);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let cn = AsyncCn::new(connect(addr, Options::default())).unwrap();
        let mut held = Vec::new();
        while let Ok(c) = cn.try_alloc().await {
            held.push(c);
        }
        assert_eq!(held.len(), CHUNKS);
        // allocations waiting for an "available" that will not come
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..4 {
            let cn = cn.clone();
            set.spawn(async move { cn.alloc().await.map(|_| ()) });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let t = Instant::now();
        mn.stop();
        let all = tokio::time::timeout(Duration::from_secs(30), async {
            let mut v = Vec::new();
            while let Some(r) = set.join_next().await {
                v.push(r.unwrap());
            }
            v
        })
        .await
        .expect("every pending future resolved");
        println!("the MN stopped; {} pending allocations failed {:?} later", all.len(), t.elapsed());
        assert!(all.iter().all(|r| *r == Err(Error::Disconnected)), "{all:?}");
        assert_eq!(cn.read(&held[0], 0, 8).await, Err(Error::Disconnected));
    });
}

/// A client of two alloc chains (`Target::alloc_chains`) against `omw mn --alloc-chains 2`:
/// threads and futures allocating at once keep both chains busy, every chunk is its own, the
/// pool comes back whole; a client asking for three is refused with the MN's reason.
#[test]
fn a_client_of_two_alloc_chains_overlaps_its_allocations() {
    if !rxe() {
        return;
    }
    let (_mn, addr) = Mn::start_with(7489, &["--alloc-chains", "2"]);
    let cn = Cn::connect(target(addr).alloc_chains(2), Options { wait: WaitPolicy::SLEEP, ..Options::default() })
        .expect("a client of two alloc chains connects");
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let cn = cn.clone();
            std::thread::spawn(move || {
                for i in 0..25u8 {
                    let c = cn.alloc().unwrap();
                    let data = [t.wrapping_mul(31) ^ i; 256];
                    cn.write(&c, 128, &data).unwrap();
                    let mut back = [0u8; 256];
                    cn.read(&c, 128, &mut back).unwrap();
                    assert_eq!(back, data, "thread {t} round {i}: another allocation's bytes");
                    cn.free(c).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(cn.stats().allocs_round_trip, 100);
    cn.shutdown().unwrap();
    drop(cn);
    // futures: eight allocations awaited together on one thread
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let cn = AsyncCn::new(Cn::connect(target(addr).alloc_chains(2), Options::default()).unwrap()).unwrap();
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let cn = cn.clone();
            set.spawn(async move { cn.alloc().await });
        }
        let mut held = Vec::new();
        while let Some(r) = set.join_next().await {
            held.push(r.unwrap().unwrap());
        }
        let distinct: std::collections::HashSet<_> = held.iter().cloned().collect();
        assert_eq!(distinct.len(), 8);
        for c in held {
            cn.free(c).await.unwrap();
        }
    });
    match Cn::connect(target(addr).alloc_chains(3), Options::default()) {
        Err(e) => {
            // the library's own error, as on the model (model_alloc_chains.rs)
            assert_eq!(e, Error::AllocChains { allowed: 2, asked: 3 });
            assert!(e.to_string().contains("allows at most 2"), "{e}");
        }
        Ok(_) => panic!("three alloc chains on an MN allowing two"),
    }
    whole_pool_allocatable(addr);
}
