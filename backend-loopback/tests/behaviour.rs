//! The open CORE-Direct questions (`omw_core::device::behaviour`, DESIGN.md §6.4) as model
//! switches: each test runs one hand-built ring under each answer and shows that the answer
//! changes what executes.

mod common;
use common::*;
use omw_core::access::AccessFlags;
use omw_core::device::behaviour::{DeviceBehaviour, ForeignBind, RecvEnable, SelfEnable, SendEnUnit, WaitPrefetch};
use omw_core::device::{QpState, WcStatus};
use omw_core::ids::Rkey;
use omw_core::mlx5::ctrl::{CeSe, FenceMode, FmCeSe, PrevWqe};
use omw_core::mlx5::data::DataSeg;
use omw_core::mlx5::encode::{encode, encode_scatter_read, Mlx5Wqe, QueueResolver, Unmanaged};
use omw_core::mlx5::wqebb::{WqeIndex, WQEBB};
use omw_core::wire::wqe::{QueueSel, Wqe, WqeField, WqeFlags, WQE_SIZE};
use omw_core::wire::wqe_format::WqeFormat;
use omw_loopback::{Fabric, NicConfig, PdId, QpAddr, QpConfig};

const QUIET: WqeFlags = WqeFlags::empty();

fn with(b: DeviceBehaviour) -> NicConfig {
    NicConfig::strict().with_behaviour(b)
}

fn managed_send(depth: u32) -> QpConfig {
    QpConfig { managed_send: true, ..QpConfig::default().with_depths(depth, 4) }
}

/// A QP of the MN connected to a responder QP of the MN (a chain's loop QP).
fn loop_pair(e: &mut Env, cfg: QpConfig) -> QpAddr {
    e.f.create_connected_pair(e.mn, cfg, e.mn, QpConfig::default()).unwrap().0
}

// ---- WaitPrefetch --------------------------------------------------------------------------

/// A READ patches the destination of a WRITE that a WAIT (on the READ's completion) guards.
/// Returns what landed at the patched destination and at the template's.
fn wait_guarded_patch(b: WaitPrefetch) -> (Vec<u8>, Vec<u8>) {
    let mut e = env(with(DeviceBehaviour { wait_prefetch: b, ..DeviceBehaviour::PAPER }).with_prefetch(8));
    let a = loop_pair(&mut e, QpConfig::default());
    let (pool, pk) = (e.pool, e.pool_k);
    let ring = e.f.ring_keys(e.mn).unwrap();
    let slot2 = e.f.ring_base(a, QueueSel::Send).unwrap() + 2 * WQE_SIZE as u64;
    e.f.write_u64(e.mn, pool, pool + 256).unwrap();
    e.f.write(e.mn, pool + 512, b"patched!").unwrap();
    e.f.post_send(a, &Wqe::read(slot2 + WqeField::RemoteAddr.offset() as u64, ring.lkey, 8, pool, pk.rkey)).unwrap();
    e.f.post_send(a, &Wqe::wait(a.qpn.get(), QueueSel::Send, 1)).unwrap();
    e.f.post_send(a, &Wqe::write(pool + 512, pk.lkey, 8, pool + 1024, pk.rkey)).unwrap();
    let v = drain(&mut e.f, a, QueueSel::Send);
    assert_eq!(statuses(&v), vec![WcStatus::Success; 2], "READ and WRITE (the WAIT is unsignaled)");
    (read_bytes(&e.f, e.mn, pool + 256, 8), read_bytes(&e.f, e.mn, pool + 1024, 8))
}

#[test]
fn a_wait_stops_prefetch_or_the_nic_fetches_the_stale_wqe_behind_it() {
    let patched = (b"patched!".to_vec(), vec![0u8; 8]);
    let stale = (vec![0u8; 8], b"patched!".to_vec());
    assert_eq!(wait_guarded_patch(WaitPrefetch::Stops), patched, "nothing fetched behind the unsatisfied WAIT");
    assert_eq!(wait_guarded_patch(WaitPrefetch::FetchesPast), stale, "fetched before the patch: stale bytes run");
}

/// The same hazard in mlx5 form, on a managed ring whose enable limit covers the WRITE: the
/// enable limit, not the WAIT, is the fetch bound under `FetchesPast`.
fn wait_guarded_patch_mlx5(b: WaitPrefetch, enables: &[u64]) -> Vec<u8> {
    let cfg = with(DeviceBehaviour { wait_prefetch: b, ..DeviceBehaviour::PAPER })
        .with_wqe_format(WqeFormat::Mlx5)
        .with_prefetch(8);
    let mut e = env(cfg);
    let a = loop_pair(&mut e, managed_send(4));
    let (pool, pk) = (e.pool, e.pool_k);
    let ring = e.f.ring_keys(e.mn).unwrap();
    let base = e.f.ring_base(a, QueueSel::Send).unwrap();
    let q = a.qpn.get();
    // the WRITE's raddr is big-endian at byte 16 of its WQE (after the control segment)
    e.f.write(e.mn, pool, &(pool + 256).to_be_bytes()).unwrap();
    e.f.write(e.mn, pool + 512, b"patched!").unwrap();
    let cqn = e.f.cq_number(a, QueueSel::Send).unwrap();
    let mut r = Fixed { cqn, index: 0 };
    let wqes = [
        enc(&Wqe::read(base + 2 * 64 + 16, ring.lkey, 8, pool, pk.rkey), 0, q, &mut r),
        enc(&Wqe::wait(q, QueueSel::Send, 1).with_flags(QUIET), 1, q, &mut r),
        enc(&Wqe::write(pool + 512, pk.lkey, 8, pool + 1024, pk.rkey), 2, q, &mut r),
    ];
    put_all(&mut e.f, a, &wqes);
    for n in enables {
        e.f.enable(a, QueueSel::Send, *n).unwrap();
        e.f.settle(10_000);
    }
    assert_eq!(e.f.qp_state(a).unwrap(), QpState::Rts);
    if read_bytes(&e.f, e.mn, pool + 256, 8) == b"patched!" {
        b"patched".to_vec()
    } else if read_bytes(&e.f, e.mn, pool + 1024, 8) == b"patched!" {
        b"stale".to_vec()
    } else {
        b"nothing".to_vec()
    }
}

#[test]
fn mlx5_form_prefetches_past_a_wait_up_to_the_enable_limit() {
    assert_eq!(wait_guarded_patch_mlx5(WaitPrefetch::Stops, &[3]), b"patched");
    assert_eq!(wait_guarded_patch_mlx5(WaitPrefetch::FetchesPast, &[3]), b"stale");
    // the WRITE released only once the WAIT passed: beyond the enable limit while the patch
    // lands, so it runs patched under either answer
    for b in [WaitPrefetch::Stops, WaitPrefetch::FetchesPast] {
        assert_eq!(wait_guarded_patch_mlx5(b, &[2, 1]), b"patched", "{b:?}");
    }
}

// ---- RecvEnable ------------------------------------------------------------------------------

/// A managed (`cd_slave_receive`) receive queue with one posted receive; the CN SENDs. Returns
/// (RNR waits before any RECV_EN, receive completions, ENABLEs ignored, receive limit) after a
/// RECV_EN of one.
fn recv_en(b: RecvEnable) -> (u64, usize, u64, u64) {
    let mut e = env(with(DeviceBehaviour { recv_enable: b, ..DeviceBehaviour::PAPER }));
    let a = loop_pair(&mut e, QpConfig::default());
    let rq = QpConfig { managed_recv: true, ..QpConfig::default() };
    let (c, m) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, rq).unwrap();
    e.f.post_recv(m, &recv(8, &[(e.pool, 8, e.pool_k.lkey)])).unwrap();
    e.f.post_send(c, &Wqe::send(e.buf, e.buf_k.lkey, 8).with_flags(QUIET)).unwrap();
    e.f.run_until_idle(10);
    let rnr = e.f.counters().rnr_naks;
    e.f.post_send(a, &Wqe::enable(m.qpn.get(), QueueSel::Recv, 1).with_flags(WqeFlags::SIGNALED)).unwrap();
    assert_eq!(one(&mut e.f, a).status, WcStatus::Success, "RECV_EN completes under either answer");
    e.f.settle(10_000);
    let got = drain(&mut e.f, m, QueueSel::Recv).len();
    (rnr, got, e.f.counters().enables_ignored, e.f.qp_stats(m).unwrap().recv_limit)
}

#[test]
fn receives_are_available_by_the_doorbell_or_only_by_recv_en() {
    assert_eq!(recv_en(RecvEnable::RecvEnOnly), (1, 1, 0, 1), "the SEND waits for the RECV_EN");
    assert_eq!(recv_en(RecvEnable::Doorbell), (0, 1, 1, 0), "posted is available; RECV_EN changes nothing");
}

#[test]
fn under_the_doorbell_a_polled_chain_receive_goes_back_to_the_device() {
    let mut e = env(with(DeviceBehaviour::PAPER));
    let rq = QpConfig { managed_recv: true, ..QpConfig::default().with_depths(4, 1) };
    let (c, m) = e.f.create_connected_pair(e.cn, QpConfig::default(), e.mn, rq).unwrap();
    e.f.post_recv(m, &recv(8, &[(e.pool, 8, e.pool_k.lkey)])).unwrap();
    for _ in 0..2 {
        e.f.post_send(c, &Wqe::send(e.buf, e.buf_k.lkey, 8).with_flags(QUIET)).unwrap();
    }
    e.f.run_until_idle(100);
    assert_eq!(e.f.cq_count(m, QueueSel::Recv).unwrap(), 1, "one receive posted: the second SEND waits");
    assert_eq!(e.f.counters().rnr_naks, 1);
    let mut out = [blank(); 4];
    // let the receive's completion land, well before the waiting SEND's RNR budget runs out
    let t = e.f.now() + 20_000;
    e.f.advance_to(t);
    assert_eq!(e.f.poll(m, QueueSel::Recv, &mut out).unwrap(), 1, "the CPU polls it ...");
    e.f.run_until_idle(100);
    assert_eq!(e.f.cq_count(m, QueueSel::Recv).unwrap(), 2, "... and the slot is the device's again");
}

// ---- SendEnUnit ------------------------------------------------------------------------------

/// Resolves a WAIT's CQ and gives every ENABLE the index `index` (absolute, in whatever unit
/// the test means).
struct Fixed {
    cqn: u32,
    index: u16,
}

impl QueueResolver for Fixed {
    fn cqn(&self, _qpn: u32, _q: QueueSel) -> Option<u32> {
        Some(self.cqn)
    }
    fn enable_index(&mut self, _qpn: u32, _q: QueueSel, _count: u64) -> Option<WqeIndex> {
        Some(WqeIndex::new(self.index))
    }
}

fn enc(w: &Wqe, at: u16, qpn: u32, r: &mut impl QueueResolver) -> (u16, Mlx5Wqe) {
    (at, encode(w, WqeIndex::new(at), qpn, PrevWqe::Other, r).unwrap())
}

fn put_all(f: &mut Fabric, qp: QpAddr, wqes: &[(u16, Mlx5Wqe)]) {
    let base = f.ring_base(qp, QueueSel::Send).unwrap();
    for (at, w) in wqes {
        f.write(qp.host, base + *at as u64 * WQEBB as u64, w.bytes()).unwrap();
    }
}

/// A slave ring [WRITE x, scatter READ (4 WQEBBs), WRITE y, WRITE z, NOP] and a SEND_EN of it
/// to index 6 from a master ring. Which of x, y, z landed.
fn send_en_to_six(u: SendEnUnit) -> [bool; 3] {
    let cfg = with(DeviceBehaviour { send_en_unit: u, ..DeviceBehaviour::PAPER }).with_wqe_format(WqeFormat::Mlx5);
    let mut e = env(cfg);
    let (pool, pk) = (e.pool, e.pool_k);
    let s = loop_pair(&mut e, managed_send(8));
    let a = loop_pair(&mut e, managed_send(4));
    let sq = s.qpn.get();
    e.f.write(e.mn, pool, b"xyz").unwrap();
    let write = |i: u64| Wqe::write(pool + i, pk.lkey, 1, pool + 0x100 + i, pk.rkey).with_flags(QUIET);
    let sges: Vec<DataSeg> = (0..14u64).map(|i| DataSeg::new(1, pk.lkey, pool + 0x200 + i)).collect();
    let scatter =
        encode_scatter_read(pool, pk.rkey, &sges, WqeIndex::new(1), sq, FmCeSe::new(FenceMode::None, CeSe::empty()))
            .unwrap();
    assert_eq!(scatter.wqebbs(), 4);
    let nop = Wqe::nop().with_flags(QUIET);
    put_all(
        &mut e.f,
        s,
        &[
            enc(&write(0), 0, sq, &mut Unmanaged),
            (1, scatter),
            enc(&write(1), 5, sq, &mut Unmanaged),
            enc(&write(2), 6, sq, &mut Unmanaged),
            enc(&nop, 7, sq, &mut Unmanaged),
        ],
    );
    let mut r = Fixed { cqn: 0, index: 6 };
    put_all(&mut e.f, a, &[enc(&Wqe::enable(sq, QueueSel::Send, 0), 0, a.qpn.get(), &mut r)]);
    e.f.enable(a, QueueSel::Send, 1).unwrap();
    e.f.settle(10_000);
    e.f.check_invariants().unwrap();
    let got = read_bytes(&e.f, e.mn, pool + 0x100, 3);
    [got[0] == b'x', got[1] == b'y', got[2] == b'z']
}

#[test]
fn send_en_counts_wqebbs_or_wqes() {
    assert_eq!(send_en_to_six(SendEnUnit::Wqebb), [true, true, false], "index 6 = the WRITE of z, not released");
    assert_eq!(send_en_to_six(SendEnUnit::Wqe), [true, true, true], "6 WQEs: z released early");
}

// ---- SelfEnable ------------------------------------------------------------------------------

/// A managed ring [NOP 1, ENABLE itself by 2, NOP 2, NOP 3], the first two enabled by the
/// host. The wr_ids that completed.
fn self_enable(s: SelfEnable) -> (Vec<u64>, u64) {
    let mut e = env(with(DeviceBehaviour { self_enable: s, ..DeviceBehaviour::PAPER }));
    let a = loop_pair(&mut e, managed_send(4));
    let q = a.qpn.get();
    e.f.post_send(a, &Wqe::nop().with_wr_id(1)).unwrap();
    e.f.post_send(a, &Wqe::enable(q, QueueSel::Send, 2).with_flags(QUIET)).unwrap();
    e.f.post_send(a, &Wqe::nop().with_wr_id(2)).unwrap();
    e.f.post_send(a, &Wqe::nop().with_wr_id(3)).unwrap();
    e.f.enable(a, QueueSel::Send, 2).unwrap();
    let v = drain(&mut e.f, a, QueueSel::Send);
    (v.iter().map(|c| c.wr_id).collect(), e.f.counters().enables_ignored)
}

#[test]
fn a_self_enable_is_honoured_or_has_no_effect() {
    assert_eq!(self_enable(SelfEnable::Honoured), (vec![1, 2, 3], 0));
    assert_eq!(self_enable(SelfEnable::Ignored), (vec![1], 1), "the ring stalls at its limit");
}

// ---- ForeignBind -----------------------------------------------------------------------------

struct BindOutcome {
    bind: WcStatus,
    poster: QpState,
    bound_to_poster: bool,
    cn_read: WcStatus,
}

/// A window of the MN bound by a WQE posted on one QP (`a`) naming another (the MN end of the
/// CN's pair); then the CN reads through it.
fn foreign_bind(fb: ForeignBind, format: WqeFormat) -> BindOutcome {
    let cfg = with(DeviceBehaviour { foreign_bind: fb, ..DeviceBehaviour::PAPER }).with_wqe_format(format);
    let mut e = env(cfg);
    let a = loop_pair(&mut e, managed_send(4));
    let (pool, pk) = (e.pool, e.pool_k);
    let mw = e.f.alloc_mw(e.mn, PdId(0)).unwrap();
    let key = Rkey((mw.0 & !0xFF) | ((mw.0 + 1) & 0xFF));
    let bind = Wqe::bind_mw(key.0, pool, 4096, pk.lkey, e.m.qpn.get(), AccessFlags::DATA_WINDOW);
    if format == WqeFormat::Mlx5 {
        put_all(&mut e.f, a, &[enc(&bind, 0, a.qpn.get(), &mut Unmanaged)]);
        e.f.enable(a, QueueSel::Send, 3).unwrap();
        e.f.settle(10_000);
    } else {
        e.f.post_send(a, &bind).unwrap();
        e.f.enable(a, QueueSel::Send, 1).unwrap();
    }
    let v = drain(&mut e.f, a, QueueSel::Send);
    let bound = e.f.qp_of_mw(e.mn, key);
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, pool, key.0)).unwrap();
    BindOutcome {
        bind: v[0].status,
        poster: e.f.qp_state(a).unwrap(),
        bound_to_poster: bound == Some(a.qpn),
        cn_read: one(&mut e.f, e.c).status,
    }
}

#[test]
fn a_bind_naming_another_qp_is_honoured_refused_or_bound_to_the_poster() {
    for format in [WqeFormat::Canonical, WqeFormat::Mlx5] {
        let h = foreign_bind(ForeignBind::Honoured, format);
        assert_eq!((h.bind, h.cn_read, h.bound_to_poster), (WcStatus::Success, WcStatus::Success, false), "{format:?}");
        let r = foreign_bind(ForeignBind::Refused, format);
        assert_eq!((r.bind, r.poster, r.cn_read), (WcStatus::MwBindErr, QpState::Err, WcStatus::RemAccessErr));
        let p = foreign_bind(ForeignBind::BoundToPoster, format);
        assert_eq!((p.bind, p.poster, p.bound_to_poster), (WcStatus::Success, QpState::Rts, true), "{format:?}");
        assert_eq!(p.cn_read, WcStatus::RemAccessErr, "the CN's QP is not the one the window is bound to");
    }
}

// ---- mlx5 bind: ZERO_BASED and rights ----------------------------------------------------------

/// A type-2 bind in mlx5 form (`access`), its bytes optionally tampered with; then the CN
/// READs 8 bytes at `at` through the window. (bind status, read status, read bytes)
fn mlx5_bind(
    access: AccessFlags,
    tamper: impl Fn(&mut [u8]),
    at: impl Fn(u64) -> u64,
) -> (WcStatus, WcStatus, Vec<u8>) {
    let mut e = env(with(DeviceBehaviour::PAPER).with_wqe_format(WqeFormat::Mlx5));
    let a = loop_pair(&mut e, managed_send(4));
    let (pool, pk) = (e.pool, e.pool_k);
    e.f.write(e.mn, pool + 0x1000, b"window!!").unwrap();
    let mw = e.f.alloc_mw(e.mn, PdId(0)).unwrap();
    let key = Rkey((mw.0 & !0xFF) | ((mw.0 + 1) & 0xFF));
    let bind = Wqe::bind_mw(key.0, pool + 0x1000, 4096, pk.lkey, e.m.qpn.get(), access);
    let w = encode(&bind, WqeIndex::new(0), a.qpn.get(), PrevWqe::Other, &mut Unmanaged).unwrap();
    let mut bytes = w.bytes().to_vec();
    tamper(&mut bytes);
    let base = e.f.ring_base(a, QueueSel::Send).unwrap();
    e.f.write(e.mn, base, &bytes).unwrap();
    e.f.enable(a, QueueSel::Send, 3).unwrap();
    e.f.settle(10_000);
    let bind = drain(&mut e.f, a, QueueSel::Send)[0].status;
    e.f.post_send(e.c, &Wqe::read(e.buf, e.buf_k.lkey, 8, at(pool + 0x1000), key.0)).unwrap();
    let read = one(&mut e.f, e.c).status;
    (bind, read, read_bytes(&e.f, e.cn, e.buf, 8))
}

/// Offsets in a bind WQE: the mkey context follows the control and UMR control segments.
const MKEY: usize = 16 + 48;

#[test]
fn an_mlx5_bind_honours_zero_based_windows() {
    let rw = AccessFlags::DATA_WINDOW;
    let (b, r, got) = mlx5_bind(rw | AccessFlags::ZERO_BASED, |_| {}, |_| 0);
    assert_eq!((b, r, &got[..]), (WcStatus::Success, WcStatus::Success, &b"window!!"[..]), "offset 0 is the base");
    let (_, r, _) = mlx5_bind(rw | AccessFlags::ZERO_BASED, |_| {}, |base| base);
    assert_eq!(r, WcStatus::RemAccessErr, "the VA is beyond a zero-based window");
    let (b, r, got) = mlx5_bind(rw, |_| {}, |base| base);
    assert_eq!((b, r, &got[..]), (WcStatus::Success, WcStatus::Success, &b"window!!"[..]), "a VA-based window");
    // the window's own length (mkey context) is what bounds it, not the KLM's
    let short = |b: &mut [u8]| b[MKEY + 24..MKEY + 32].copy_from_slice(&8u64.to_be_bytes());
    let (b, r, _) = mlx5_bind(rw, short, |base| base + 8);
    assert_eq!((b, r), (WcStatus::Success, WcStatus::RemAccessErr));
}

#[test]
fn an_mlx5_bind_refuses_what_a_window_mkey_cannot_carry() {
    let rw = AccessFlags::DATA_WINDOW;
    // a reserved bit in the mkey context's access byte, and LOCAL_READ (set by the kernel on
    // an MR, never written by a window UMR)
    for bit in [0x80u8, 0x04, 0x01] {
        let (b, r, _) = mlx5_bind(rw, |w| w[MKEY + 2] |= bit, |base| base);
        assert_eq!((b, r), (WcStatus::MwBindErr, WcStatus::RemAccessErr), "access bit {bit:#x}");
    }
    // a window start neither its MR address nor 0, and a window longer than its KLM
    let start = |w: &mut [u8]| w[MKEY + 16..MKEY + 24].copy_from_slice(&0x40u64.to_be_bytes());
    assert_eq!(mlx5_bind(rw, start, |b| b).0, WcStatus::MwBindErr);
    let long = |w: &mut [u8]| w[MKEY + 24..MKEY + 32].copy_from_slice(&8192u64.to_be_bytes());
    assert_eq!(mlx5_bind(rw, long, |b| b).0, WcStatus::MwBindErr);
}

#[test]
fn the_model_prefetches_past_waits_unless_told_otherwise() {
    let past = DeviceBehaviour { wait_prefetch: WaitPrefetch::FetchesPast, ..DeviceBehaviour::PAPER };
    assert_eq!(NicConfig::DEFAULT_BEHAVIOUR, past);
    assert_eq!(NicConfig::strict().behaviour, past);
    assert_eq!(NicConfig::host_engine().with_prefetch(4).behaviour, past);
    assert_eq!(NicConfig::strict().with_behaviour(DeviceBehaviour::PAPER).behaviour, DeviceBehaviour::PAPER);
}
