//! The futures on tokio over the loopback model: many in flight with back-pressure, every
//! kind of future dropped mid-flight leaking nothing, a lost MN failing every pending future.

use omw_client::model::{Model, ModelConfig, ModelDevice};
use omw_client::{AsyncCn, Cn, Error, Options};
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

fn client(m: &Model, opts: Options) -> AsyncCn<ModelDevice> {
    AsyncCn::new(Cn::connect(m, opts).unwrap()).unwrap()
}

/// Poll a future once, as an executor would before it is cancelled.
fn poll_once<F: Future>(f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    f.poll(&mut Context::from_waker(Waker::noop()))
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..4000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{what} never happened");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_futures_in_flight_more_than_the_slots_all_complete() {
    let m = Model::start(ModelConfig { chunk_size: 64 << 10, chunks: 8, ..Default::default() }).unwrap();
    let cn = client(&m, Options::default());
    let c = cn.alloc().await.unwrap();
    let data: Vec<u8> = (0..64 << 10).map(|i: usize| (i % 251) as u8).collect();
    // 4 KiB pieces, all posted at once: 16 writes, then 300 reads — far past the 64 slots
    let mut set = tokio::task::JoinSet::new();
    for k in 0..16u64 {
        let (cn, c, piece) = (cn.clone(), c.clone(), data[k as usize * 4096..(k as usize + 1) * 4096].to_vec());
        set.spawn(async move { cn.write(&c, k * 4096, &piece).await });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap().unwrap();
    }
    let mut set = tokio::task::JoinSet::new();
    for k in 0..300u64 {
        let (cn, c) = (cn.clone(), c.clone());
        let off = (k % 16) * 4096;
        set.spawn(async move { cn.read(&c, off, 4096).await.map(|b| (off, b)) });
    }
    while let Some(r) = set.join_next().await {
        let (off, b) = r.unwrap().unwrap();
        assert_eq!(&b[..], &data[off as usize..off as usize + 4096]);
    }
    // atomics from many tasks: none lost
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let (cn, c) = (cn.clone(), c.clone());
        set.spawn(async move { cn.fetch_add(&c, 0, 1).await });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap().unwrap();
    }
    let w = cn.read(&c, 0, 8).await.unwrap();
    assert_eq!(u64::from_le_bytes(w.try_into().unwrap()), u64::from_le_bytes(data[..8].try_into().unwrap()) + 100);
    assert_eq!(cn.cn().in_flight(), 0);
}

// one thread: nothing harvests the reply between the first poll and the drop
#[tokio::test(flavor = "current_thread")]
async fn a_dropped_allocation_future_leaks_no_chunk() {
    let m = Model::start(ModelConfig { chunks: 4, ..Default::default() }).unwrap();
    let cn = client(&m, Options::default());
    {
        let mut f = pin!(cn.alloc());
        assert!(poll_once(f.as_mut()).is_pending(), "the request is on its way");
    } // dropped before the reply
    // the reply arrives for nobody: with no reserve, the chunk goes straight back
    eventually("the orphaned chunk returned", || cn.cn().stats().orphaned_allocs == 1).await;
    eventually("every chunk back at the MN", || m.free_groups().unwrap() == 4).await;
    assert_eq!(cn.cn().held_chunks(), 0);
    // and allocation still works
    let c = cn.alloc().await.unwrap();
    cn.free(c).await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn a_dropped_allocation_future_feeds_the_reserve() {
    let m = Model::start(ModelConfig { chunks: 8, ..Default::default() }).unwrap();
    let p = omw_client::ReservePolicy::new(0, 2).unwrap();
    let cn = client(&m, Options { reserve: Some(p), ..Options::default() });
    {
        let mut f = pin!(cn.alloc());
        assert!(poll_once(f.as_mut()).is_pending());
    }
    eventually("the orphaned chunk kept", || cn.cn().reserved() == 1).await;
    let _c = cn.alloc().await.unwrap();
    assert_eq!(cn.cn().stats().allocs_from_reserve, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_access_futures_release_their_slots_and_buffers() {
    let m = Model::start(ModelConfig::default()).unwrap();
    let cn = client(&m, Options::default());
    let c = cn.alloc().await.unwrap();
    let before = cn.cn().registered_buffers();
    for _ in 0..100 {
        // staged read, atomic and zero-copy read, each polled once (posted) and dropped
        let mut r = pin!(cn.read(&c, 0, 1024));
        let _ = poll_once(r.as_mut());
        let mut a = pin!(cn.fetch_add(&c, 8, 1));
        let _ = poll_once(a.as_mut());
        let mr = cn.cn().register(vec![0u8; 512]).unwrap();
        let mut z = pin!(cn.read_into(&c, 0, mr, 0..512));
        let _ = poll_once(z.as_mut());
    }
    eventually("every slot released", || cn.cn().in_flight() == 0 && cn.cn().progress().is_ok()).await;
    eventually("every buffer deregistered", || {
        let _ = cn.cn().progress();
        cn.cn().registered_buffers() == before
    })
    .await;
    // the QP and the slots are all usable: a full set of accesses at once
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..omw_client::IO_SLOTS {
        let (cn, c) = (cn.clone(), c.clone());
        set.spawn(async move { cn.read(&c, 0, 64).await });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap().unwrap();
    }
    // the atomics that were posted before their futures went all ran (the device did them)
    let w = cn.read(&c, 8, 8).await.unwrap();
    assert!(u64::from_le_bytes(w.try_into().unwrap()) <= 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_copy_futures_hand_the_buffer_back() {
    let m = Model::start(ModelConfig::default()).unwrap();
    let cn = client(&m, Options::default());
    let c = cn.alloc().await.unwrap();
    let mut mr = cn.cn().register(vec![0u8; 1024]).unwrap();
    mr.as_mut_slice()[..4].copy_from_slice(b"omw!");
    let (r, mr) = cn.write_from(&c, 10, mr, 0..4).await;
    r.unwrap();
    let (r, mr) = cn.read_into(&c, 10, mr, 100..104).await;
    r.unwrap();
    assert_eq!(&mr.as_slice()[100..104], b"omw!");
    let (r, mr) = cn.read_into(&c, 0, mr, 1000..1100).await;
    assert_eq!(r, Err(Error::OutOfBuffer { start: 1000, end: 1100, len: 1024 }));
    assert_eq!(mr.len(), 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_mn_fails_every_pending_future_with_disconnected() {
    let m = Model::start(ModelConfig { chunks: 2, ..Default::default() }).unwrap();
    let cn = client(&m, Options::default());
    let a = cn.alloc().await.unwrap();
    let _b = cn.alloc().await.unwrap();
    let mut set = tokio::task::JoinSet::new();
    // allocations waiting for "available" that will never come, and accesses
    for _ in 0..5 {
        let cn = cn.clone();
        set.spawn(async move { cn.alloc().await.map(|_| ()) });
    }
    for _ in 0..5 {
        let (cn, a) = (cn.clone(), a.clone());
        set.spawn(async move { cn.read(&a, 0, 8).await.map(|_| ()) });
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    m.kill_mn().unwrap();
    // a hang guard, not a timing assertion: every future must resolve
    let all = tokio::time::timeout(Duration::from_secs(30), async {
        let mut errs = Vec::new();
        while let Some(r) = set.join_next().await {
            errs.push(r.unwrap());
        }
        errs
    })
    .await
    .expect("every pending future resolved");
    let allocs = all.iter().filter(|r| **r == Err(Error::Disconnected)).count();
    assert!(allocs >= 5, "{all:?}");
    assert!(all.iter().all(|r| r.is_ok() || *r == Err(Error::Disconnected)), "{all:?}");
    assert_eq!(cn.alloc().await, Err(Error::Disconnected));
}

#[tokio::test(flavor = "current_thread")]
async fn the_event_fd_wakes_a_tokio_loop() {
    use omw_client::transport::{AsyncSignal, Signal};
    let m = Model::start(ModelConfig { chunks: 1, ..Default::default() }).unwrap();
    let a = Cn::connect(&m, Options::default()).unwrap();
    let b = Cn::connect(&m, Options::default()).unwrap();
    let fd = a.signal().unwrap().to_async().unwrap();
    assert!(!a.arm().unwrap());
    let _x = b.alloc().unwrap();
    assert_eq!(b.try_alloc(), Err(Error::PoolEmpty));
    tokio::time::timeout(Duration::from_secs(10), fd.readable()).await.expect("readable").unwrap();
    assert!(a.progress().unwrap() > 0);
}
