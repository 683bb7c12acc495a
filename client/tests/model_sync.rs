//! The blocking client on the loopback model: allocation, staged and zero-copy access,
//! atomics, and every misuse a type cannot prevent answered with a typed error — the QP
//! unharmed afterwards.

use omw_client::model::{Model, ModelConfig, ModelDevice};
use omw_client::{Cn, Error, Options, WaitPolicy};
use omw_core::cn::OutOfChunk;
use omw_core::device::ExecutionMode;
use omw_loopback::NicConfig;
use std::time::Duration;

fn model(cfg: ModelConfig) -> (Model, Cn<ModelDevice>) {
    let m = Model::start(cfg).unwrap();
    let cn = Cn::connect(&m, Options::default()).unwrap();
    (m, cn)
}

#[test]
fn alloc_write_read_free_round_trip() {
    let (m, cn) = model(ModelConfig::default());
    let c = cn.alloc().unwrap();
    assert_eq!(m.free_groups().unwrap(), 63);
    let data: Vec<u8> = (0..c.size() as usize).map(|i| (i * 13) as u8).collect();
    cn.write(&c, 0, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    cn.read(&c, 0, &mut back).unwrap();
    assert_eq!(back, data);
    cn.free(c).unwrap();
    cn.progress().unwrap();
    assert_eq!(m.free_groups().unwrap(), 64);
}

#[test]
fn staged_accesses_larger_than_a_slot_are_split() {
    let (_m, cn) = model(ModelConfig { chunk_size: 64 << 10, chunks: 4, ..Default::default() });
    let c = cn.alloc().unwrap();
    // 64 KiB through 16 KiB staging slots: four pieces in flight together
    let data: Vec<u8> = (0..64 << 10).map(|i: usize| (i >> 3) as u8).collect();
    cn.write(&c, 0, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    cn.read(&c, 0, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn zero_copy_moves_bytes_without_staging_and_refuses_bad_ranges() {
    let (_m, cn) = model(ModelConfig { max_message: 1024, ..Default::default() });
    let c = cn.alloc().unwrap();
    let mut mr = cn.register(vec![0u8; 2048]).unwrap();
    mr.as_mut_slice()[..512].copy_from_slice(&[0x5A; 512]);
    cn.write_from(&c, 100, &mr, 0..512).unwrap();
    let mut staged = [0u8; 512];
    cn.read(&c, 100, &mut staged).unwrap();
    assert_eq!(staged, [0x5A; 512]);
    cn.read_into(&c, 100, &mut mr, 1024..1536).unwrap();
    assert_eq!(&mr.as_slice()[1024..1536], &[0x5A; 512][..]);
    // a buffer range past its end, a message past the QP's limit, a chunk range past its end
    assert_eq!(cn.write_from(&c, 0, &mr, 2000..2100), Err(Error::OutOfBuffer { start: 2000, end: 2100, len: 2048 }));
    assert_eq!(cn.read_into(&c, 0, &mut mr, 0..1025), Err(Error::TooLarge { len: 1025, max: 1024 }));
    assert_eq!(
        cn.write_from(&c, c.size() - 8, &mr, 0..16),
        Err(Error::OutOfChunk(OutOfChunk { offset: c.size() - 8, len: 16, chunk: c.size() }))
    );
    // a borrowed buffer: the handle cannot outlive it
    let mut storage = [0u8; 64];
    {
        let mut b = cn.register(&mut storage[..]).unwrap();
        cn.read_into(&c, 100, &mut b, 0..64).unwrap();
    }
    assert_eq!(storage, [0x5A; 64]);
    // nothing refused above reached the QP: it still works
    cn.write(&c, 0, b"alive").unwrap();
    assert_eq!(cn.in_flight(), 0);
}

#[test]
fn atomics_work_and_misaligned_ones_are_refused_before_posting() {
    let (_m, cn) = model(ModelConfig::default());
    assert!(cn.atomics_available());
    let c = cn.alloc().unwrap();
    assert_eq!(cn.fetch_add(&c, 16, 10).unwrap(), 0);
    assert_eq!(cn.fetch_add(&c, 16, u64::MAX).unwrap(), 10); // wraps
    assert_eq!(cn.compare_swap(&c, 16, 9, 77).unwrap(), 9);
    assert_eq!(cn.compare_swap(&c, 16, 9, 78).unwrap(), 77);
    let mut w = [0u8; 8];
    cn.read(&c, 16, &mut w).unwrap();
    assert_eq!(u64::from_le_bytes(w), 77);
    for off in [1, 4, 12, 4095] {
        assert_eq!(cn.fetch_add(&c, off, 1), Err(Error::Misaligned { offset: off }));
        assert_eq!(cn.compare_swap(&c, off, 0, 1), Err(Error::Misaligned { offset: off }));
    }
    assert!(matches!(cn.fetch_add(&c, c.size(), 1), Err(Error::OutOfChunk(_))));
    assert_eq!(cn.fetch_add(&c, 16, 1).unwrap(), 77, "the QP survived the refusals");
}

#[test]
fn a_connectx_like_mn_answers_atomics_with_a_typed_not_supported() {
    // the model of ConnectX (mlx5 form) carries no atomics through windows: its MN binds
    // data windows READ/WRITE only and its connect info says so
    let nic = NicConfig::strict().with_wqe_format(omw_core::wire::wqe_format::WqeFormat::Mlx5);
    let (_m, cn) = model(ModelConfig { nic, ..Default::default() });
    assert!(!cn.atomics_available());
    let c = cn.alloc().unwrap();
    assert_eq!(cn.fetch_add(&c, 0, 1), Err(Error::AtomicsUnsupported));
    assert_eq!(cn.compare_swap(&c, 0, 0, 1), Err(Error::AtomicsUnsupported));
    cn.write(&c, 0, b"reads and writes still work").unwrap();
}

#[test]
fn a_freed_or_foreign_chunk_is_a_typed_error() {
    let m = Model::start(ModelConfig::default()).unwrap();
    let a = Cn::connect(&m, Options::default()).unwrap();
    let b = Cn::connect(&m, Options::default()).unwrap();
    let c = a.alloc().unwrap();
    let twin = c.clone();
    assert_eq!(b.write(&c, 0, b"x"), Err(Error::Foreign));
    assert_eq!(b.free(c.clone()), Err(Error::Foreign));
    a.free(c).unwrap();
    assert_eq!(a.write(&twin, 0, b"x"), Err(Error::Freed));
    let mut buf = [0u8; 4];
    assert_eq!(a.read(&twin, 0, &mut buf), Err(Error::Freed));
    assert_eq!(a.fetch_add(&twin, 0, 1), Err(Error::Freed));
    assert_eq!(a.free(twin), Err(Error::Freed));
    let mr = b.register(vec![0u8; 8]).unwrap();
    let c2 = a.alloc().unwrap();
    assert_eq!(a.write_from(&c2, 0, &mr, 0..8), Err(Error::Foreign));
}

#[test]
fn an_empty_pool_is_pool_empty_at_once_for_try_alloc_and_after_the_timeout_for_alloc() {
    let m = Model::start(ModelConfig { chunks: 2, ..Default::default() }).unwrap();
    let opts = Options { timeout: std::time::Duration::from_millis(300), ..Options::default() };
    let cn = Cn::connect(&m, opts).unwrap();
    let a = cn.alloc().unwrap();
    let _b = cn.alloc().unwrap();
    assert_eq!(cn.try_alloc(), Err(Error::PoolEmpty));
    assert_eq!(cn.alloc(), Err(Error::PoolEmpty));
    // a free refills the pool; "available" lets allocations through again
    cn.free(a).unwrap();
    let t0 = std::time::Instant::now();
    let again = loop {
        match cn.alloc() {
            Ok(c) => break c,
            Err(Error::PoolEmpty) if t0.elapsed() < std::time::Duration::from_secs(10) => continue,
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(again.size(), 4096);
}

#[test]
fn the_quota_is_a_typed_error() {
    let (_m, cn) = model(ModelConfig { quota: 2, mode: Some(ExecutionMode::HostEngine), ..Default::default() });
    let _a = cn.alloc().unwrap();
    let _b = cn.alloc().unwrap();
    assert_eq!(cn.alloc(), Err(Error::QuotaExceeded));
}

#[test]
fn every_wait_policy_completes() {
    for wait in [WaitPolicy::BUSY, WaitPolicy::SLEEP, WaitPolicy::default()] {
        let m = Model::start(ModelConfig::default()).unwrap();
        let cn = Cn::connect(&m, Options { wait, ..Options::default() }).unwrap();
        let c = cn.alloc().unwrap();
        cn.write(&c, 0, b"policy").unwrap();
        let mut b = [0u8; 6];
        cn.read(&c, 0, &mut b).unwrap();
        assert_eq!(&b, b"policy");
    }
}

#[test]
fn the_event_fd_drives_the_callers_own_loop() {
    use omw_client::transport::Signal;
    let m = Model::start(ModelConfig { chunks: 2, ..Default::default() }).unwrap();
    let a = Cn::connect(&m, Options::default()).unwrap();
    let b = Cn::connect(&m, Options::default()).unwrap();
    let sig = a.signal().unwrap();
    assert!(a.fd() >= 0);
    // A's loop: arm, then sleep on the fd
    assert!(!a.arm().unwrap(), "nothing pending");
    assert!(!sig.wait(Duration::from_millis(5)).unwrap(), "nothing happened");
    // B exhausts the pool: the MN tells every CN "empty" — a message lands on A's queues
    // while nobody of A polls
    let _x = b.alloc().unwrap();
    let _y = b.alloc().unwrap();
    assert_eq!(b.try_alloc(), Err(Error::PoolEmpty));
    assert!(sig.wait(Duration::from_secs(10)).unwrap(), "A's fd turned readable");
    assert!(a.progress().unwrap() > 0, "and progress took what arrived");
    assert_eq!(a.try_alloc(), Err(Error::PoolEmpty), "A heard the MN's 'empty'");
}
