//! A malicious CN sends arbitrary bytes and forged requests on its Alloc and Free QPs (and
//! tries one-sided accesses with guessed or stolen rkeys) while two honest CNs keep working.
//! After every step, in both execution modes: the invariants hold; every chunk an honest CN
//! holds is still its own (the MN's table says so) and reads back, through each of its access
//! QPs, exactly what it wrote; no access by the attacker succeeds on an honest CN's chunk;
//! honest allocations and frees succeed whenever the pool and the quota allow.

use crate::sim::{invariants, owned_by, touches_foreign, Setup, Shadow};
use arbitrary::{Arbitrary, Unstructured};
use omw_core::backend::WcStatus;
use omw_core::chain::ChainKind;
use omw_core::cn::{ClientError, ClientEvent};
use omw_core::ids::{GroupId, Qpn, Rkey};
use omw_core::mn::CnStatus;
use omw_core::wire::{AllocRequest, ErrorCode, FreeRequest, Header, Kind};
use omw_loopback::cluster::{Cluster, CnOpError};
use omw_loopback::host_base;

const MAX_OPS: usize = 40;
/// CN 0 is the attacker; 1 and 2 are honest.
const EVIL: usize = 0;
const CNS: usize = 3;

#[derive(Arbitrary, Debug)]
pub struct Input {
    pub setup: Setup,
    pub ops: Vec<Op>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum QpnSel {
    /// The attacker's own access QPs (MN ends) — what an honest request names.
    Own(u8),
    /// An honest CN's access / Alloc / Free QP (MN end).
    HonestAccess(u8, u8),
    HonestMgmt(u8, bool),
    /// The MN's chain loop QPs of some CN.
    Loop(u8, bool),
    Raw(u32),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum EntrySel {
    /// An honest CN's allocation (its MWTable entry), plus an offset.
    Honest(u8, u8),
    /// Any group's entry, plus an offset.
    Group(u8, u8),
    /// An address in the MN metadata region (queue, table, scratch).
    Meta(u16),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum RkeySel {
    /// An honest CN's rkey for access QP `q` of allocation `which`, with its key byte kept
    /// or replaced (the attacker walks the 256 keys of a known index).
    Honest {
        which: u8,
        q: u8,
        key: Option<u8>,
    },
    Own {
        which: u8,
        q: u8,
    },
    Guess(u32),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Target {
    HonestChunk {
        which: u8,
        off: u16,
    },
    OwnChunk {
        which: u8,
        off: u16,
    },
    /// Somewhere in the pool: chunk index and offset.
    Pool {
        chunk: u8,
        off: u16,
    },
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone)]
pub enum Op {
    // ---- honest CNs (1 and 2)
    Alloc(bool),
    Free(bool, u8),
    Write {
        second: bool,
        which: u8,
        q: u8,
        off: u8,
        data: Vec<u8>,
    },
    // ---- the attacker
    Bytes {
        free_qp: bool,
        bytes: Vec<u8>,
    },
    AllocReq {
        token: u32,
        reply_off: u32,
        reply_rkey: Option<u32>,
        qpns: [QpnSel; 3],
        cut: Option<u8>,
        extra: u8,
    },
    FreeReq {
        token: u32,
        entry: EntrySel,
        cut: Option<u8>,
        extra: u8,
        on_alloc_qp: bool,
    },
    /// A header of any kind/version on either QP, followed by arbitrary bytes.
    Header {
        kind: u8,
        version: u8,
        free_qp: bool,
        tail: Vec<u8>,
    },
    EvilAlloc,
    EvilFree(u8),
    OneSided {
        write: bool,
        q: u8,
        target: Target,
        rkey: RkeySel,
        len: u8,
    },
    EvilCrash,
    Tick,
    SampleCounters,
}

pub fn run(data: &[u8]) -> bool {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return false };
    check(&input);
    true
}

struct World {
    c: Cluster,
    /// The honest CNs' allocations and the bytes they wrote.
    shadow: Shadow,
    /// The attacker's own allocations (it may scribble on them: no shadow).
    evil: Vec<omw_core::cn::Allocation>,
}

fn honest(second: bool) -> usize {
    if second {
        2
    } else {
        1
    }
}

fn cluster_err(what: &Op, e: impl std::fmt::Display) -> ! {
    panic!("cluster operation failed on {what:?}: {e}")
}

pub fn check(input: &Input) {
    let mut w = World { c: input.setup.cluster(CNS), shadow: Shadow::default(), evil: Vec::new() };
    invariants(&mut w.c, &"setup", &[]);
    for op in input.ops.iter().take(MAX_OPS) {
        step(&mut w, op);
        invariants(&mut w.c, op, &[EVIL]);
        // the attacker's own chunks may come and go (quota, crash); honest ones must not
        let before: Vec<_> = (1..CNS).flat_map(|i| w.shadow.of(i)).collect();
        w.shadow.sync(&w.c);
        for h in before {
            assert!(
                owned_by(&w.c, h.cn, &h.a),
                "honest cn{} lost its chunk {:#x} after the attacker's {op:?}",
                h.cn,
                h.a.base
            );
        }
        for i in 1..CNS {
            let n = &w.c.cns[i];
            let rec = w.c.driver.mn.cn(n.id).map(|r| r.status);
            assert_eq!(rec, Some(CnStatus::Active), "honest cn{i} lost its connection after {op:?}");
            assert!(!n.events.contains(&ClientEvent::Revoked), "honest cn{i} was told Revoked after {op:?}");
        }
        w.shadow.verify_all(&mut w.c, op);
    }
}

fn qpn(w: &World, s: QpnSel) -> u32 {
    let c = &w.c;
    let pick = |v: &[Qpn], k: u8| v.get(k as usize % v.len().max(1)).map(|q| q.get()).unwrap_or(0);
    match s {
        QpnSel::Own(k) => pick(&c.cns[EVIL].mn_qps.access, k),
        QpnSel::HonestAccess(h, k) => pick(&c.cns[1 + h as usize % 2].mn_qps.access, k),
        QpnSel::HonestMgmt(h, free) => {
            let q = &c.cns[1 + h as usize % 2].mn_qps;
            if free {
                q.free.get()
            } else {
                q.alloc.get()
            }
        }
        QpnSel::Loop(h, free) => {
            let q = &c.cns[h as usize % CNS].mn_qps;
            (if free { q.free_loop } else { q.alloc_loop }).map(|q| q.get()).unwrap_or(0)
        }
        QpnSel::Raw(v) => v,
    }
}

fn entry(w: &World, e: EntrySel) -> u64 {
    let map = *w.c.driver.mn.map();
    let group = |g: u8| map.entry_addr(GroupId(g as u32 % map.geometry.chunk_count())).unwrap_or(0);
    match e {
        EntrySel::Honest(k, d) => {
            let all: Vec<_> = (1..CNS).flat_map(|i| w.shadow.of(i)).collect();
            if all.is_empty() {
                group(k) + d as u64
            } else {
                all[k as usize % all.len()].a.entry_addr + d as u64
            }
        }
        EntrySel::Group(g, d) => group(g) + d as u64,
        EntrySel::Meta(o) => map.meta_base + o as u64 % map.meta_len,
        EntrySel::Raw(v) => v,
    }
}

fn shape(mut b: Vec<u8>, cut: Option<u8>, extra: u8) -> Vec<u8> {
    if let Some(n) = cut {
        b.truncate(n as usize % (b.len() + 1));
    }
    b.extend(std::iter::repeat_n(0xA5, extra as usize % 9));
    b
}

fn send(w: &mut World, free_qp: bool, bytes: &[u8], op: &Op) {
    if w.c.cns[EVIL].crashed {
        return;
    }
    let kind = if free_qp { ChainKind::Free } else { ChainKind::Alloc };
    if let Err(e) = w.c.send_raw(EVIL, kind, bytes) {
        cluster_err(op, e);
    }
}

fn step(w: &mut World, op: &Op) {
    match op.clone() {
        Op::Alloc(second) => honest_alloc(w, honest(second), op),
        Op::Free(second, which) => {
            let i = honest(second);
            let Some(h) = w.shadow.pick(i, which) else { return };
            assert_eq!(w.c.free(i, &h.a), Ok(()), "honest cn{i} could not free its chunk {:#x}", h.a.base);
            assert!(!owned_by(&w.c, i, &h.a), "freed chunk still owned");
            w.shadow.forget(&h);
        }
        Op::Write { second, which, q, off, data } => {
            let i = honest(second);
            let Some(h) = w.shadow.pick(i, which) else { return };
            let q = q as usize % h.a.rkeys.len();
            let data: Vec<u8> = data.into_iter().take(64).collect();
            if data.is_empty() {
                return;
            }
            let off = off as u64 % (h.bytes.len() as u64);
            let st = w.c.write(i, &h.a, q, off, &data);
            assert_eq!(st, WcStatus::Success, "honest cn{i} could not write its chunk");
            w.shadow.record_write(&h, off as usize, &data);
        }
        Op::Bytes { free_qp, bytes } => {
            let b: Vec<u8> = bytes.into_iter().take(96).collect();
            send(w, free_qp, &b, op);
        }
        Op::AllocReq { token, reply_off, reply_rkey, qpns, cut, extra } => {
            let c = &w.c;
            let n = c.cns[EVIL].mn_qps.access.len();
            let access = qpns.iter().take(n).map(|s| Qpn::new(qpn(w, *s) & Qpn::MAX).unwrap_or_default()).collect();
            let host = c.cns[EVIL].host;
            let reply_addr = host_base(host.0) + reply_off as u64 % (2 << 20);
            let rkey = reply_rkey.unwrap_or_else(|| c.fabric.borrow().ring_keys(host).map(|k| k.rkey).unwrap_or(0));
            let req = AllocRequest { token, reply_addr, reply_rkey: rkey, access_qpns: access };
            let mut b = [0u8; 64];
            let len = req.encode(&mut b).unwrap_or(0);
            let bytes = shape(b[..len].to_vec(), cut, extra);
            send(w, false, &bytes, op);
        }
        Op::FreeReq { token, entry: e, cut, extra, on_alloc_qp } => {
            let bytes = FreeRequest { token, entry_addr: entry(w, e) }.encode();
            let bytes = shape(bytes.to_vec(), cut, extra);
            send(w, !on_alloc_qp, &bytes, op);
        }
        Op::Header { kind, version, free_qp, tail } => {
            let mut h = Header::new(Kind::AllocRequest, 1);
            h.kind = kind % 9;
            h.version = version % 3;
            let mut b = zerocopy::IntoBytes::as_bytes(&h).to_vec();
            b.extend(tail.into_iter().take(64));
            send(w, free_qp, &b, op);
        }
        Op::EvilAlloc => {
            if !w.c.cns[EVIL].crashed {
                if let Ok(a) = w.c.alloc(EVIL) {
                    w.evil.push(a);
                }
            }
        }
        Op::EvilFree(which) => {
            if !w.evil.is_empty() {
                let a = w.evil.remove(which as usize % w.evil.len());
                let _ = w.c.free(EVIL, &a);
            }
        }
        Op::OneSided { write, q, target, rkey, len } => one_sided(w, write, q, target, rkey, len),
        Op::EvilCrash => {
            if !w.c.cns[EVIL].crashed {
                if let Err(e) = w.c.crash_cn(EVIL) {
                    cluster_err(op, e);
                }
            }
        }
        Op::Tick => {
            if let Err(e) = w.c.tick() {
                cluster_err(op, e);
            }
        }
        Op::SampleCounters => {
            if let Err(e) = w.c.sample_counters() {
                cluster_err(op, e);
            }
        }
    }
}

fn one_sided(w: &mut World, write: bool, q: u8, target: Target, rkey: RkeySel, len: u8) {
    if w.c.cns[EVIL].crashed {
        return;
    }
    let honest_all: Vec<_> = (1..CNS).flat_map(|i| w.shadow.of(i)).collect();
    let own = w.evil.clone();
    let pick = |v: &[crate::sim::Held], k: u8| (!v.is_empty()).then(|| v[k as usize % v.len()].clone());
    let pick_own = |k: u8| (!own.is_empty()).then(|| own[k as usize % own.len()].clone());
    let geo = w.c.driver.mn.map().geometry;
    let addr = match target {
        Target::HonestChunk { which, off } => match pick(&honest_all, which) {
            Some(h) => h.a.base + off as u64 % h.a.length,
            None => return,
        },
        Target::OwnChunk { which, off } => match pick_own(which) {
            Some(a) => a.base + off as u64 % (2 * a.length),
            None => return,
        },
        Target::Pool { chunk, off } => {
            geo.chunk_base(GroupId(chunk as u32 % geo.chunk_count())).unwrap_or(0) + off as u64 % geo.chunk_size()
        }
        Target::Raw(a) => a,
    };
    let rk = match rkey {
        RkeySel::Honest { which, q, key } => match pick(&honest_all, which) {
            Some(h) => {
                let r = h.a.rkey(q as usize % h.a.rkeys.len()).unwrap_or_default();
                match key {
                    Some(k) => Rkey::new(r.index(), k).unwrap_or(r),
                    None => r,
                }
            }
            None => return,
        },
        RkeySel::Own { which, q } => match pick_own(which) {
            Some(a) => a.rkey(q as usize % a.rkeys.len()).unwrap_or_default(),
            None => return,
        },
        RkeySel::Guess(v) => Rkey(v),
    };
    let q = q as usize % w.c.cns[EVIL].access_qps.len();
    let len = 1 + len as u64 % 64;
    let st = if write {
        w.c.write_raw(EVIL, q, addr, rk, &[0xEE; 64][..len as usize])
    } else {
        w.c.read_raw(EVIL, q, addr, rk, len as usize).0
    };
    if st == WcStatus::Success {
        if let Some(owner) = touches_foreign(&w.c, EVIL, addr, len) {
            panic!("the attacker reached cn id {owner}'s chunk at {addr:#x} with {rk:?} (write: {write})");
        }
    }
}

fn honest_alloc(w: &mut World, i: usize, op: &Op) {
    let c = &w.c;
    let quota = c.cfg.quota;
    let held = crate::sim::held_by(c, i);
    if held >= quota {
        return; // an honest client keeps to the quota its connect info told it
    }
    let free = c.free_groups();
    let backing_off = c.cns[i].client.is_backing_off(c.now());
    let empty_state = c.driver.mn.is_empty_state();
    match w.c.alloc(i) {
        Ok(a) => {
            assert!(owned_by(&w.c, i, &a), "honest cn{i} got a chunk the MN does not record as its own");
            w.shadow.adopt(i, a);
        }
        // an empty pool parks the alloc chain (offloaded: the request finds no receive)
        Err(CnOpError::Mn(ErrorCode::Empty))
        | Err(CnOpError::Client(ClientError::Backoff { .. }))
        | Err(CnOpError::NoReply)
            if free == 0 || empty_state || backing_off => {}
        Err(e) => panic!(
            "honest cn{i} could not allocate ({e}) with {free} free groups, {held}/{quota} held, empty={empty_state}, after {op:?}"
        ),
    }
}
