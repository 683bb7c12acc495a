//! The mlx5 form against the canonical form: both run the same laps of the same requests on a
//! byte-level memory (copies, writes, atomics — the only operations that move bytes), and must
//! leave the same MN memory and CN reply bytes, and every WQE the chain does not rewrite into
//! a different shape must be, byte for byte, the mlx5 encoding of the patched canonical WQE.

use super::*;
use crate::chain::alloc::build_alloc_chain;
use crate::chain::arm;
use crate::chain::builder::{test_env, ChainEnv};
use crate::chain::free::build_free_chain;
use crate::chain::variant::ChainVariant;
use crate::mlx5::encode::is_umr;
use crate::wire::memory_map::{alloc_scratch, free_scratch, ALLOC_SCRATCH_OFF, FREE_SCRATCH_OFF};
use crate::wire::message::{alloc_request, free_request};
use crate::wire::mwtable::{MwTableEntry, ENTRY_SIZE};
use crate::wire::wqe::masked_add;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::vec::Vec;

fn queues() -> Mlx5Queues {
    Mlx5Queues { recv_doorbell: 0x5_0020_0000, ..Mlx5Queues::new([0x21, 0x22, 0x23], [0x5_0000_0000, 0x5_0010_0000]) }
}
const CANON_BASES: [u64; 2] = [0x6_0000_0000, 0x6_0010_0000];
/// The receive doorbell record in canonical form (a little-endian count).
const CANON_DOORBELL: u64 = 0x6_0020_0000;
const CN_BUF: u64 = 0x9_0000_0000;

#[derive(Clone, Default)]
struct Mem(BTreeMap<u64, u8>);

impl Mem {
    fn rd(&self, a: u64, n: u32) -> Vec<u8> {
        (0..n as u64).map(|k| self.0.get(&(a + k)).copied().unwrap_or(0)).collect()
    }
    fn wr(&mut self, a: u64, b: &[u8]) {
        for (k, x) in b.iter().enumerate() {
            self.0.insert(a + k as u64, *x);
        }
    }
    fn u64(&self, a: u64) -> u64 {
        u64::from_le_bytes(self.rd(a, 8).try_into().unwrap())
    }
    fn atomic(&mut self, remote: u64, local: u64, new: impl Fn(u64) -> u64) {
        let old = self.u64(remote);
        self.wr(local, &old.to_le_bytes());
        self.wr(remote, &new(old).to_le_bytes());
    }
}

fn exec_canonical(m: &mut Mem, w: &Wqe) {
    match w.opcode {
        Opcode::Read => {
            let b = m.rd(w.remote_addr, w.length);
            m.wr(w.local_addr, &b)
        }
        Opcode::Write | Opcode::WriteWithImm => {
            let b = m.rd(w.local_addr, w.length);
            m.wr(w.remote_addr, &b)
        }
        Opcode::FetchAdd => m.atomic(w.remote_addr, w.local_addr, |o| o.wrapping_add(w.operand0)),
        Opcode::MaskedFetchAdd => m.atomic(w.remote_addr, w.local_addr, |o| masked_add(o, w.operand0, w.operand1)),
        Opcode::CompareSwap => m.atomic(w.remote_addr, w.local_addr, |o| if o == w.operand0 { w.operand1 } else { o }),
        _ => {}
    }
}

fn exec_mlx5(m: &mut Mem, op: &Mlx5Op) {
    match op {
        Mlx5Op::Read { remote, local: Some(l), .. } => {
            let b = m.rd(*remote, l.length);
            m.wr(l.addr, &b)
        }
        Mlx5Op::ScatterRead { remote, sges, .. } => {
            let mut at = *remote;
            for l in sges.as_slice() {
                let b = m.rd(at, l.length);
                m.wr(l.addr, &b);
                at += l.length as u64;
            }
        }
        Mlx5Op::Write { remote, local: Some(l), .. } => {
            let b = m.rd(l.addr, l.length);
            m.wr(*remote, &b)
        }
        Mlx5Op::FetchAdd { remote, local, add, .. } => m.atomic(*remote, local.addr, |o| o.wrapping_add(*add)),
        Mlx5Op::MaskedFetchAdd { remote, local, add, boundary, .. } => {
            m.atomic(*remote, local.addr, |o| masked_add(o, *add, *boundary))
        }
        Mlx5Op::CompareSwap { remote, local, compare, swap, .. } => {
            m.atomic(*remote, local.addr, |o| if o == *compare { *swap } else { o })
        }
        _ => {}
    }
}

/// An MN with a full free queue: head at slot 0, every group's entry queued.
fn mn_memory(env: &ChainEnv) -> Mem {
    let mut m = Mem::default();
    let q = env.map.queue;
    let n = env.geometry().chunk_count();
    m.wr(q.head, &q.slot_addr(0).to_le_bytes());
    m.wr(q.tail, &q.slot_addr(n).to_le_bytes());
    for i in 0..n {
        let e = env.map.table_base + i as u64 * ENTRY_SIZE as u64;
        m.wr(q.slot_addr(i), &e.to_le_bytes());
        let rkeys: Vec<crate::ids::Rkey> =
            (0..env.geometry().group_size()).map(|k| crate::ids::Rkey(((i * 4 + k as u32 + 1) << 8) | 0xFE)).collect();
        let base = env.geometry().base() + i as u64 * env.geometry().chunk_size();
        let entry = MwTableEntry::new(base, env.geometry().chunk_size() as u32, 0x77, &rkeys);
        m.wr(e, zerocopy::IntoBytes::as_bytes(&entry));
    }
    // the reply image's owner field, written when the CN connected
    let s = env.scratch() + ALLOC_SCRATCH_OFF;
    m.wr(s + alloc_scratch::OWNER, &env.cn.get().to_le_bytes());
    m
}

/// The canonical closing ENABLE (the Loop ring's last FENCEd SEND_EN: of itself, or of the
/// management ring's relay).
fn closing(l: &ChainLayout) -> usize {
    super::closing_of(l).unwrap()
}

struct Pair {
    layout: ChainLayout,
    chain: Mlx5Chain,
    canon: Mem,
    mlx5: Mem,
}

impl Pair {
    fn new(layout: ChainLayout, env: &ChainEnv) -> Self {
        let chain = Mlx5Chain::build(&layout, queues()).unwrap();
        let mut canon = mn_memory(env);
        let mut mlx5 = canon.clone();
        let r = arm::resolve(&layout, CANON_BASES, CANON_DOORBELL);
        for (i, (s, w)) in layout.steps.iter().zip(r.wqes.iter()).enumerate() {
            canon.wr(CANON_BASES[s.ring as usize] + (layout.position(i) * WQE_SIZE) as u64, &w.encode());
        }
        for ring in [Ring::Loop, Ring::Mgmt] {
            mlx5.wr(queues().ring_bases[ring as usize], &chain.rings[ring as usize]);
        }
        for sh in chain.shadows.iter() {
            mlx5.wr(sh.addr, &sh.initial.to_le_bytes());
        }
        // what the arm publishes before the first lap
        let published = u64::from(layout.initial_recv_enable);
        canon.wr(CANON_DOORBELL, &published.to_le_bytes());
        mlx5.wr(queues().recv_doorbell, &(published as u32).to_be_bytes());
        Pair { layout, chain, canon, mlx5 }
    }

    /// One lap of `request`, sequentially in the canonical order on both forms.
    fn lap(&mut self, request: &[u8]) {
        let r = arm::resolve(&self.layout, CANON_BASES, CANON_DOORBELL);
        let mut at = 0usize;
        for s in r.recv.sges.iter() {
            let n = (s.length as usize).min(request.len().saturating_sub(at));
            self.canon.wr(s.addr, &request[at..at + n]);
            at += n;
        }
        for (i, s) in self.layout.steps.iter().enumerate() {
            let a = CANON_BASES[s.ring as usize] + (self.layout.position(i) * WQE_SIZE) as u64;
            let w = Wqe::decode(&self.canon.rd(a, 64)).unwrap();
            exec_canonical(&mut self.canon, &w);
        }
        let mut at = 0usize;
        for s in self.chain.recv.iter() {
            let n = (s.length as usize).min(request.len().saturating_sub(at));
            self.mlx5.wr(s.addr, &request[at..at + n]);
            at += n;
        }
        let c = closing(&self.layout);
        let closing_pi = self.chain.placed[0].iter().find(|p| p.role == Role::Step(c as u8)).unwrap().pi;
        let mut order: Vec<((usize, u8, u16), Ring, u16)> = Vec::new();
        for ring in [Ring::Loop, Ring::Mgmt] {
            for p in self.chain.placed[ring as usize].iter() {
                let key = match p.role {
                    Role::Step(i) => (i as usize, 1, p.pi),
                    Role::Bump(_) => (c, if p.pi < closing_pi { 0 } else { 2 }, p.pi),
                    Role::Pad => continue,
                };
                order.push((key, ring, p.pi));
            }
        }
        order.sort_by_key(|x| x.0);
        for (_, ring, pi) in order {
            let a = queues().ring_bases[ring as usize] + pi as u64 * WQEBB as u64;
            let d = decode(&self.mlx5.rd(a, (MAX_SCATTER_SGES as u32 + 2) * 16)).unwrap();
            exec_mlx5(&mut self.mlx5, &d.op);
        }
    }

    /// Receives published after `laps` laps, in both forms' record formats: the arm's plus one
    /// a lap where the chain publishes them (the canonical count little-endian, mlx5's
    /// rdma-core `htobe32(count & 0xffff)`); the records untouched otherwise.
    fn published(&self, laps: u64) {
        let arm = u64::from(self.layout.initial_recv_enable);
        let want = if self.layout.recv_publish().is_some() { arm + laps } else { arm };
        assert_eq!(self.canon.u64(CANON_DOORBELL), want, "{:?}: canonical record", self.layout.kind);
        let be = u32::from_be_bytes(self.mlx5.rd(queues().recv_doorbell, 4).try_into().unwrap());
        assert_eq!(u64::from(be), want & 0xFFFF, "{:?}: mlx5 record", self.layout.kind);
    }

    /// Same MN memory (but the mlx5 form's own shadows and junk), same bytes at the CN.
    fn same_observable(&self, env: &ChainEnv, ignore: &[(u64, u64)]) {
        let (lo, len) = (env.map.meta_base, env.map.meta_len);
        for a in (lo..lo + len).chain(CN_BUF..CN_BUF + 256) {
            if ignore.iter().any(|(x, n)| a >= *x && a < x + n) {
                continue;
            }
            let (c, m) = (self.canon.rd(a, 1)[0], self.mlx5.rd(a, 1)[0]);
            assert_eq!(c, m, "{:?}: byte {a:#x} differs (canonical {c:#x}, mlx5 {m:#x})", self.layout.kind);
        }
    }

    /// Every WQE the mlx5 form keeps whole is the mlx5 encoding of the patched canonical one;
    /// WAITs and ENABLEs carry the lap's device values.
    fn same_wqes(&self, lap: u64) {
        let l = &self.layout;
        for ring in [Ring::Loop, Ring::Mgmt] {
            let placed = &self.chain.placed[ring as usize];
            for (k, p) in placed.iter().enumerate() {
                let Role::Step(t) = p.role else { continue };
                let s = &l.steps[t as usize];
                let reshaped = matches!(
                    (s.wqe.opcode, s.local, s.remote),
                    (Opcode::Read, Some(Loc::Field { .. }), _)
                        | (Opcode::Read, _, Some(Loc::Field { .. }))
                        | (Opcode::Write, _, Some(Loc::Field { .. }))
                        | (Opcode::FetchAdd, _, Some(Loc::RecvDoorbell))
                );
                if reshaped {
                    continue;
                }
                let a = CANON_BASES[ring as usize] + (l.position(t as usize) * WQE_SIZE) as u64;
                let mut w = Wqe::decode(&self.canon.rd(a, 64)).unwrap();
                let mut index = WqeIndex::new(0);
                if matches!(w.opcode, Opcode::Wait | Opcode::Enable) {
                    let sh = self.chain.shadows.iter().find(|x| x.step == t).unwrap();
                    // independent of the shadow: a lap advances an ENABLE by its target ring's
                    // size in the SEND_EN unit — WQEBBs, or WQEs placed (RECV_EN: one receive
                    // WQE), a WAIT by the canonical bump
                    let ring_size = |r: Ring| match l.mlx5.send_en_unit {
                        SendEnUnit::Wqebb => self.chain.ring_wqebbs(r) as u64,
                        SendEnUnit::Wqe => self.chain.placed[r as usize].len() as u64,
                    };
                    let per_lap = match (w.opcode, w.queue_sel(), w.qpn == l.qpns[0]) {
                        (Opcode::Enable, QueueSel::Recv, _) => 1,
                        (Opcode::Enable, _, true) => ring_size(Ring::Loop),
                        (Opcode::Enable, _, false) => ring_size(Ring::Mgmt),
                        _ => sh.increment,
                    };
                    let v = (sh.initial + lap * per_lap) & ((1 << sh.bits) - 1);
                    if w.opcode == Opcode::Wait {
                        assert_eq!(CqIndex::from_count(w.operand0).get() as u64, v, "WAIT {t} lap {lap}");
                    }
                    index = WqeIndex::new(v as u16);
                }
                let prev_umr = k > 0 && matches!(placed[k - 1].role, Role::Step(u) if is_umr(&l.steps[u as usize].wqe));
                let prev = if prev_umr { PrevWqe::Umr } else { PrevWqe::Other };
                let cqn = match (w.qpn == l.qpns[0], w.queue_sel()) {
                    (true, _) => 0x21,
                    (false, QueueSel::Send) => 0x22,
                    (false, QueueSel::Recv) => 0x23,
                };
                w.wr_id = 0;
                let want =
                    encode(&w, WqeIndex::new(p.pi), l.qpns[ring as usize], prev, &mut Const(Some(cqn), index)).unwrap();
                let got =
                    self.mlx5.rd(queues().ring_bases[ring as usize] + p.pi as u64 * 64, want.bytes().len() as u32);
                assert_eq!(got, want.bytes(), "{:?} step {t} ({}) lap {lap}", l.kind, w.opcode.name());
            }
        }
    }
}

fn alloc_request(token: u32, reply: u64, rkey: u32, qpns: &[u32]) -> Vec<u8> {
    let mut b = std::vec![0u8; alloc_request::len(qpns.len())];
    b[0..2].copy_from_slice(&crate::wire::message::MAGIC.to_le_bytes());
    b[alloc_request::TOKEN..alloc_request::TOKEN + 4].copy_from_slice(&token.to_le_bytes());
    b[alloc_request::REPLY_ADDR..alloc_request::REPLY_ADDR + 8].copy_from_slice(&reply.to_le_bytes());
    b[alloc_request::REPLY_RKEY..alloc_request::REPLY_RKEY + 4].copy_from_slice(&rkey.to_le_bytes());
    for (i, q) in qpns.iter().enumerate() {
        b[alloc_request::QPNS + 4 * i..alloc_request::QPNS + 4 * i + 4].copy_from_slice(&q.to_le_bytes());
    }
    b
}

fn ignore(env: &ChainEnv) -> [(u64, u64); 3] {
    let s = env.scratch();
    [
        (s + crate::wire::memory_map::MLX5_SHADOW_OFF[0], 2 * crate::wire::memory_map::MLX5_SHADOW_LEN),
        (s + ALLOC_SCRATCH_OFF + alloc_scratch::JUNK, 8),
        (s + FREE_SCRATCH_OFF + free_scratch::JUNK, 8),
    ]
}

fn scrubbing_env(g: u8, scrub: bool) -> ChainEnv {
    let mut env = test_env(512, 16, g);
    if scrub {
        env.keys.zero_lkey = 0x31;
        env.keys.pool_scrub_rkey = 0x32;
        env.keys.zero_addr = 0x8_0000_0000;
    }
    env
}

fn run_alloc(g: u8, variant: ChainVariant, posts_receives: bool, laps: &[(u32, u64, u32, [u32; 3])]) {
    let env = ChainEnv { variant, posts_receives, ..scrubbing_env(g, false) };
    let mut p = Pair::new(build_alloc_chain(&env).unwrap(), &env);
    for (lap, (token, off, rkey, qpns)) in laps.iter().enumerate() {
        let req = alloc_request(*token, CN_BUF + off, *rkey, &qpns[..g as usize - 1]);
        p.lap(&req);
        p.same_observable(&env, &ignore(&env));
        p.same_wqes(lap as u64 + 1);
        p.published(lap as u64 + 1);
        // the reply reached the CN: entry address and the popped group's entry, owner set
        let reply = p.mlx5.rd(CN_BUF + off, crate::wire::message::ALLOC_REPLY_LEN as u32);
        let entry = env.map.table_base + lap as u64 * ENTRY_SIZE as u64;
        assert_eq!(u64::from_le_bytes(reply[8..16].try_into().unwrap()), entry);
        let e = MwTableEntry::read(&reply[16..]).unwrap();
        assert_eq!((e.owner(), e.lkey.get()), (env.cn.get(), 0), "owner recorded, MN key cleared");
        // the binds carry the entry and the request's QPs (decoded from the mlx5 bytes)
        let table = MwTableEntry::read(&p.mlx5.rd(entry, ENTRY_SIZE as u32)).unwrap();
        let binds: Vec<Mlx5Op> = p.chain.placed[1]
            .iter()
            .map(|x| p.mlx5.rd(queues().ring_bases[1] + x.pi as u64 * 64, 192))
            .filter_map(|b| decode(&b).ok().map(|d| d.op))
            .filter(|o| matches!(o, Mlx5Op::Bind { .. }))
            .collect();
        assert_eq!(binds.len(), g as usize);
        for (k, b) in binds.iter().enumerate() {
            let Mlx5Op::Bind { mkey, new_key, addr, length, lkey, qpn, .. } = *b else { unreachable!() };
            let want_qpn = match k {
                0 if variant.binds_to_poster => env.mgmt_qpn,
                0 => env.free_qpn,
                _ => qpns[k - 1],
            };
            // rdma-core's layout: the window named by the key it holds, the new key byte apart
            assert_eq!(
                (mkey, new_key, addr, length, lkey, qpn),
                (table.cur_rkey(k).0, table.rkey(k).key(), table.base.get(), table.length.get(), 0x77, want_qpn)
            );
            assert_eq!(crate::ids::Rkey(mkey), table.rkey(k).prev_key(), "the current key precedes the new one");
        }
    }
}

fn run_free(g: u8, scrub: bool, variant: ChainVariant, posts_receives: bool, entries: &[u32]) {
    let env = ChainEnv { variant, posts_receives, ..scrubbing_env(g, scrub) };
    let mut p = Pair::new(build_free_chain(&env).unwrap(), &env);
    for (lap, i) in entries.iter().enumerate() {
        let entry = env.map.table_base + (*i % 16) as u64 * ENTRY_SIZE as u64;
        let mut req = std::vec![0u8; free_request::LEN];
        req[0..2].copy_from_slice(&crate::wire::message::MAGIC.to_le_bytes());
        req[free_request::TOKEN..free_request::TOKEN + 4].copy_from_slice(&(lap as u32 + 7).to_le_bytes());
        req[free_request::ENTRY_ADDR..].copy_from_slice(&entry.to_le_bytes());
        p.lap(&req);
        p.same_observable(&env, &ignore(&env));
        p.same_wqes(lap as u64 + 1);
        p.published(lap as u64 + 1);
        // the entry was pushed at the tail and its keys advanced, in MN memory both forms share
        let q = env.map.queue;
        let pushed = q.slot_addr(16 + lap as u32);
        assert_eq!(p.mlx5.u64(pushed), entry);
    }
}

#[test]
fn alloc_laps_agree_with_the_canonical_form() {
    for (g, v, posts) in
        (2..=4).flat_map(|g| ChainVariant::ALL.map(|v| (g, v))).flat_map(|(g, v)| [(g, v, false), (g, v, true)])
    {
        run_alloc(
            g,
            v,
            posts,
            &[
                (0x1111, 0, 0xAB_CD01, [0x300, 0x301, 0x302]),
                (0x2222, 64, 0x12_3402, [0x400, 0x401, 0x402]),
                (3, 128, 7, [1, 2, 3]),
            ],
        );
    }
}

#[test]
fn free_laps_agree_with_the_canonical_form() {
    for g in 2..=4 {
        for scrub in [false, true] {
            for v in ChainVariant::ALL {
                for posts in [false, true] {
                    run_free(g, scrub, v, posts, &[3, 0, 15, 3]);
                }
            }
        }
    }
}

/// Lap counters in device units: after k laps a WAIT's PI and an ENABLE's index are the lap-0
/// value plus k increments, wrapping at 24 and 16 bits.
#[test]
fn shadow_counters_wrap_in_device_units() {
    let env = test_env(4096, 16, 3);
    for l in [build_alloc_chain(&env).unwrap(), build_free_chain(&env).unwrap()] {
        let c = Mlx5Chain::build(&l, queues()).unwrap();
        for sh in c.shadows.iter() {
            let b = 1u64 << (sh.bits - 1);
            let mut v = sh.initial;
            let laps = (1u64 << sh.bits) / sh.increment.max(1) + 3;
            for _ in 0..laps.min(70_000) {
                v = masked_add(v, sh.increment, b);
                assert!(v < 1 << sh.bits);
            }
            let k = laps.min(70_000);
            assert_eq!(v, (sh.initial + k * sh.increment) % (1 << sh.bits), "step {}", sh.step);
        }
        // a WAIT near the 24-bit wrap
        let mut v = 0xFF_FFFEu64;
        v = masked_add(v, 4, 1 << 23);
        assert_eq!(CqIndex::from_count(v).get(), 2);
    }
}

/// The two SEND_EN units lay out the same bytes but for the indices: each SEND_EN names the
/// same canonical position — counted in WQEBBs by one variant, in WQEs by the other — and its
/// lap counter advances by the target ring's WQEBBs or WQEs; the doorbell (always WQEBBs) is
/// the same.
#[test]
fn send_en_indices_count_in_the_variants_unit() {
    for g in 2..=4 {
        let env = test_env(4096, 16, g);
        let wqe_env = ChainEnv { variant: ChainVariant::WQE_ENABLES, ..env };
        for (bb, wq) in [
            (build_alloc_chain(&env).unwrap(), build_alloc_chain(&wqe_env).unwrap()),
            (build_free_chain(&env).unwrap(), build_free_chain(&wqe_env).unwrap()),
        ] {
            let (cb, cw) = (Mlx5Chain::build(&bb, queues()).unwrap(), Mlx5Chain::build(&wq, queues()).unwrap());
            cw.validate().unwrap();
            assert_eq!(cb.initial_index, cw.initial_index, "the doorbell counts WQEBBs");
            let mut wider = false;
            for ring in [Ring::Loop, Ring::Mgmt] {
                let r = ring as usize;
                assert_eq!(cb.placed[r], cw.placed[r]);
                assert_eq!(cw.enable_per_lap(ring), cb.placed[r].len());
                wider |= cb.enable_per_lap(ring) > cw.enable_per_lap(ring);
                for (k, (pb, pw)) in cb.placed[r].iter().zip(cw.placed[r].iter()).enumerate() {
                    let (db, dw) = (cb.decode_at(ring, pb.pi).unwrap(), cw.decode_at(ring, pw.pi).unwrap());
                    match (db.op, dw.op) {
                        (Mlx5Op::SendEn { qpn: qb, max_index: ib }, Mlx5Op::SendEn { qpn: qw, max_index: iw }) => {
                            assert_eq!(qb, qw);
                            let t = if qb == bb.qpns[0] { Ring::Loop } else { Ring::Mgmt };
                            let tb = cb.ring_wqebbs(t) as u64;
                            // lap 0 indices lie within the first two laps of the target ring
                            let (lap, within) = (ib.get() as u64 / tb, ib.get() % tb as u16);
                            let want = lap * cb.placed[t as usize].len() as u64 + {
                                let before = cb.placed[t as usize].iter().take_while(|p| p.pi < within).count();
                                before as u64
                            };
                            assert_eq!(iw.get() as u64, want, "{:?} {ring:?} WQE {k}", bb.kind);
                        }
                        // a lap-counter bump adds its shadow's increment (checked below)
                        (
                            Mlx5Op::MaskedFetchAdd { remote: rb, add: ab, .. },
                            Mlx5Op::MaskedFetchAdd { remote: rw, add: aw, .. },
                        ) if cb.shadows.iter().any(|x| x.addr == rb) => {
                            assert_eq!(rb, rw);
                            let (sb, sw) = (
                                cb.shadows.iter().find(|x| x.addr == rb).unwrap(),
                                cw.shadows.iter().find(|x| x.addr == rw).unwrap(),
                            );
                            assert_eq!((ab, aw), (sb.increment, sw.increment));
                        }
                        (a, b) => assert_eq!(a, b, "{:?} {ring:?} WQE {k}: only SEND_EN indices differ", bb.kind),
                    }
                }
            }
            assert!(wider, "{:?} G={g}: some ring holds a multi-WQEBB WQE", bb.kind);
            for (sb, sw) in cb.shadows.iter().zip(cw.shadows.iter()) {
                let w = &bb.steps[sb.step as usize].wqe;
                if w.opcode == Opcode::Enable && w.queue_sel() == QueueSel::Send {
                    let t = if w.qpn == bb.qpns[0] { Ring::Loop } else { Ring::Mgmt };
                    assert_eq!((sb.increment, sw.increment), (cb.ring_wqebbs(t) as u64, cw.enable_per_lap(t) as u64));
                } else {
                    assert_eq!(sb, sw);
                }
            }
        }
    }
}

/// A variant whose laps enable their own receive opens each lap with a RECV_EN of the
/// management QP to `lap + 1` (lap 0: 1 — the first request's receive), before the request's
/// WAIT, and has no other: the arm enables none, the tail admits nothing.
#[test]
fn a_lap_that_enables_its_receive_opens_with_its_recv_en() {
    for g in 2..=4 {
        let env = ChainEnv { variant: ChainVariant::WQEBB_ENABLES.enabling_receives(), ..test_env(4096, 16, g) };
        for l in [build_alloc_chain(&env).unwrap(), build_free_chain(&env).unwrap()] {
            let c = Mlx5Chain::build(&l, queues()).unwrap();
            let recv_ens: Vec<(usize, u16)> = c.placed[0]
                .iter()
                .enumerate()
                .filter_map(|(k, p)| match c.decode_at(Ring::Loop, p.pi).unwrap().op {
                    Mlx5Op::RecvEn { qpn, max_index } if qpn == l.qpns[1] => Some((k, max_index.get())),
                    _ => None,
                })
                .collect();
            assert_eq!(recv_ens, [(0, 1)], "{:?}: the lap's own receive, first", l.kind);
            assert_eq!(l.initial_recv_enable, 0);
            let first_wait = c.placed[0]
                .iter()
                .position(|p| matches!(c.decode_at(Ring::Loop, p.pi).unwrap().op, Mlx5Op::Wait { .. }))
                .unwrap();
            assert!(first_wait > 0);
            // its lap counter advances by one receive per lap
            let head_step = match c.placed[0][0].role {
                Role::Step(s) => s,
                r => panic!("{r:?}"),
            };
            let sh = c.shadows.iter().find(|x| x.step == head_step).unwrap();
            assert_eq!((sh.initial, sh.increment), (1, 1));
        }
        // without it, the tail's RECV_EN admits the next lap's request (lap 0: index 2) and the
        // ring length is the same
        let plain = ChainEnv { variant: ChainVariant::WQEBB_ENABLES, ..env };
        for (l, h) in [
            (build_free_chain(&plain).unwrap(), build_free_chain(&env).unwrap()),
            (build_alloc_chain(&plain).unwrap(), build_alloc_chain(&env).unwrap()),
        ] {
            assert_eq!((l.initial_recv_enable, l.ring_depth), (1, h.ring_depth));
            let c = Mlx5Chain::build(&l, queues()).unwrap();
            let first = c.placed[0]
                .iter()
                .find_map(|p| match c.decode_at(Ring::Loop, p.pi).unwrap().op {
                    Mlx5Op::RecvEn { max_index, .. } => Some(max_index.get()),
                    _ => None,
                })
                .unwrap();
            assert_eq!(first, 2);
            assert!(!matches!(c.decode_at(Ring::Loop, 0).unwrap().op, Mlx5Op::RecvEn { .. }));
        }
    }
}

#[test]
fn every_form_validates_and_reports_its_lap() {
    for (g, variant) in (2..=4).flat_map(|g| ChainVariant::ALL.map(|v| (g, v))) {
        for scrub in [false, true] {
            let env = ChainEnv { variant, ..scrubbing_env(g, scrub) };
            for l in [build_alloc_chain(&env).unwrap(), build_free_chain(&env).unwrap()] {
                let c = Mlx5Chain::build(&l, queues()).unwrap();
                c.validate().unwrap();
                let cost = c.lap_cost();
                for r in 0..2 {
                    assert!(cost.wqebbs[r].is_power_of_two());
                    assert!(cost.wqes[r] <= cost.wqebbs[r]);
                }
                assert_eq!(lap_cost(&l, WqeFormat::Mlx5).unwrap(), cost);
            }
        }
    }
}

/// A chain re-armed on CQs that already counted completions (an mlx5 CQ outlives its QP's
/// reset) waits for base + canonical count on each CQ, modulo 2^24, and its lap counters start
/// there; the bytes of every other WQE are those of the chain on fresh CQs.
#[test]
fn wait_indices_start_at_the_cq_bases() {
    let env = test_env(4096, 16, 3);
    for l in [build_alloc_chain(&env).unwrap(), build_free_chain(&env).unwrap()] {
        let fresh = Mlx5Chain::build(&l, queues()).unwrap();
        let base = [0x00FF_FFF0, 7, 0x1234];
        let q = Mlx5Queues { cq_base: base, ..queues() };
        let c = Mlx5Chain::build(&l, q).unwrap();
        c.validate().unwrap();
        let mut waits = 0;
        for r in [Ring::Loop, Ring::Mgmt] {
            for (pf, pc) in fresh.placed[r as usize].iter().zip(c.placed[r as usize].iter()) {
                let (f, d) = (fresh.decode_at(r, pf.pi).unwrap(), c.decode_at(r, pc.pi).unwrap());
                match (&f.op, &d.op) {
                    (Mlx5Op::Wait { cqn: fc, pi: fp }, Mlx5Op::Wait { cqn, pi }) => {
                        waits += 1;
                        let k = queues().cqns.iter().position(|x| x == cqn).unwrap();
                        assert_eq!(fc, cqn);
                        assert_eq!(pi.get(), (fp.get() + base[k]) & 0x00FF_FFFF, "WAIT on CQ {cqn:#x}");
                    }
                    _ => assert_eq!(f.op, d.op),
                }
            }
        }
        assert!(waits > 0);
        for (sf, sc) in fresh.shadows.iter().zip(c.shadows.iter()) {
            if sc.bits == 24 {
                assert_ne!(sf.initial, sc.initial);
            } else {
                assert_eq!(sf.initial, sc.initial);
            }
        }
        // the validator holds the chain to its bases: the same bytes claimed for fresh CQs fail
        let mut t = c.clone();
        t.queues.cq_base = [0; 3];
        assert!(matches!(t.validate(), Err(Mlx5ChainError::Inconsistent(Inconsistency::QueueField { .. }))));
    }
}

/// The validator reads the bytes: a corrupted form is refused.
#[test]
fn validator_refuses_tampered_bytes() {
    let env = test_env(4096, 16, 3);
    let l = build_alloc_chain(&env).unwrap();
    let c = Mlx5Chain::build(&l, queues()).unwrap();
    // a scatter entry aimed one byte off: outside its target, or the target short a byte
    let (k, p) = c.placed[0]
        .iter()
        .enumerate()
        .find(|(_, p)| matches!(c.decode_at(Ring::Loop, p.pi).unwrap().op, Mlx5Op::ScatterRead { .. }))
        .unwrap();
    let mut t = c.clone();
    let off = p.pi as usize * 64 + 32 + 8; // first data segment's address
    let a = u64::from_be_bytes(t.rings[0][off..off + 8].try_into().unwrap()) + 1;
    t.rings[0][off..off + 8].copy_from_slice(&a.to_be_bytes());
    assert!(matches!(t.validate(), Err(Mlx5ChainError::Inconsistent(_))), "placement {k}");
    // a signaled NOP more: the CQ count per lap changes
    let mut t = c.clone();
    let pad = t.placed[0].iter().rfind(|p| p.role == Role::Pad).unwrap().pi as usize * 64;
    t.rings[0][pad + 11] |= crate::mlx5::ctrl::CeSe::CQ_UPDATE.bits();
    assert_eq!(t.validate(), Err(Mlx5ChainError::Inconsistent(Inconsistency::Completions { ring: Ring::Loop })));
    // a WQE index that is not its position
    let mut t = c.clone();
    t.rings[1][2] ^= 1;
    assert!(matches!(t.validate(), Err(Mlx5ChainError::Inconsistent(Inconsistency::Undecodable { .. }))));
    // the lap counters' first copy without its FENCE (it could read a shadow before its
    // fetch-and-add landed)
    let mut t = c.clone();
    let first_copy = t.placed[0]
        .iter()
        .find(|p| {
            matches!(p.role, Role::Bump(_))
                && !matches!(t.decode_at(Ring::Loop, p.pi).unwrap().op, Mlx5Op::MaskedFetchAdd { .. })
        })
        .unwrap()
        .pi as usize;
    t.rings[0][first_copy * 64 + 11] &= !crate::mlx5::ctrl::FenceMode::MASK;
    assert!(matches!(t.validate(), Err(Mlx5ChainError::Inconsistent(Inconsistency::QueueField { .. }))));
    // an ENABLE index other than lap 0's
    let mut t = c.clone();
    let e = t.placed[0]
        .iter()
        .find(|p| matches!(t.decode_at(Ring::Loop, p.pi).unwrap().op, Mlx5Op::SendEn { .. }))
        .unwrap();
    let off = e.pi as usize * 64 + 16 + 11;
    t.rings[0][off] ^= 1;
    assert!(matches!(t.validate(), Err(Mlx5ChainError::Inconsistent(Inconsistency::QueueField { .. }))));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Random requests, laps and group sizes: the two forms stay indistinguishable.
    #[test]
    fn random_laps_agree(
        g in 2u8..=4,
        laps in proptest::collection::vec((any::<u32>(), 0u64..8, any::<u32>(), proptest::array::uniform3(1u32..(1 << 24))), 1..5),
        frees in proptest::collection::vec(0u32..16, 1..5),
        scrub in any::<bool>(),
        variant in proptest::sample::select(ChainVariant::ALL.to_vec()),
        posts_receives in any::<bool>(),
    ) {
        let laps: Vec<_> = laps.into_iter().map(|(t, o, r, q)| (t, o * 32, r, q)).collect();
        run_alloc(g, variant, posts_receives, &laps);
        run_free(g, scrub, variant, posts_receives, &frees);
    }
}

/// The per-lap costs in docs/MLX5.md, between its `lap-cost` markers, are generated here; this
/// fails when they are stale. Regenerate with `OMW_BLESS=1 cargo test -p omw-core mlx5_lap_doc`.
#[test]
fn mlx5_lap_doc_is_current() {
    use core::fmt::Write;
    let mut t = std::string::String::new();
    t.push_str(
        "| chain | G | form | Loop WQEs | Loop WQEBBs | Mgmt WQEs | Mgmt WQEBBs | padding NOPs | lap re-arm WQEs |\n",
    );
    t.push_str("|---|---|---|---|---|---|---|---|---|\n");
    for g in 2..=4u8 {
        // docs/CHAINS.md's pool (4 KiB chunks, 16 of them, NIC scrubbing), G from 2 to 4
        let mut env = test_env(4096, 16, g);
        env.keys.zero_lkey = 0x18;
        env.keys.pool_scrub_rkey = 0x19;
        env.keys.zero_addr = 1 << 40;
        for l in [build_alloc_chain(&env).unwrap(), build_free_chain(&env).unwrap()] {
            for f in [WqeFormat::Canonical, WqeFormat::Mlx5] {
                let c = lap_cost(&l, f).unwrap();
                writeln!(
                    t,
                    "| {:?} | {g} | {} | {} | {} | {} | {} | {} | {} |",
                    l.kind,
                    f.name(),
                    c.wqes[0],
                    c.wqebbs[0],
                    c.wqes[1],
                    c.wqebbs[1],
                    c.padding[0] + c.padding[1],
                    c.bumps[0] + c.bumps[1]
                )
                .unwrap();
            }
        }
    }
    let (begin, end) = ("<!-- lap-cost:begin -->\n", "<!-- lap-cost:end -->");
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/MLX5.md");
    let doc = std::fs::read_to_string(path).unwrap_or_default();
    let (Some(a), Some(b)) = (doc.find(begin), doc.find(end)) else {
        panic!("docs/MLX5.md lacks the lap-cost markers")
    };
    let fresh = std::format!("{}{begin}{t}{}", &doc[..a], &doc[b..]);
    if std::env::var("OMW_BLESS").is_ok() {
        std::fs::write(path, &fresh).unwrap();
    }
    assert!(fresh == doc, "docs/MLX5.md lap costs are stale: run OMW_BLESS=1 cargo test -p omw-core mlx5_lap_doc");
}

/// The mlx5 form pads its own lap (`Role::Pad`): the canonical lap's padding NOPs are not
/// translated, so they lengthen no lap — the relayed G = 4 alloc chain's Loop ring fits 128
/// WQEBBs (with them it took 256, 152 of its 211 WQEs NOPs).
#[test]
fn canonical_padding_is_not_translated() {
    for (g, v) in (2..=4).flat_map(|g| ChainVariant::ALL.map(|v| (g, v))) {
        let env = ChainEnv { variant: v, posts_receives: true, ..test_env(4096, 16, g) };
        for l in [build_alloc_chain(&env).unwrap(), build_free_chain(&env).unwrap()] {
            let c = Mlx5Chain::build(&l, queues()).unwrap();
            for r in [Ring::Loop, Ring::Mgmt] {
                let last_real =
                    (0..l.steps.len()).rfind(|&i| l.steps[i].ring == r && l.steps[i].wqe.opcode != Opcode::Nop);
                for p in c.placed[r as usize].iter() {
                    if let Role::Step(s) = p.role {
                        assert!(Some(s as usize) <= last_real, "{:?} {v:?} G={g}: padding step {s} translated", l.kind);
                    }
                }
            }
            assert!(c.ring_wqebbs(Ring::Loop) <= 128, "{:?} {v:?} G={g}: {} WQEBBs", l.kind, c.ring_wqebbs(Ring::Loop));
        }
    }
}
