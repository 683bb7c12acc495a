//! Issue 10's attack classes on the FPGA extension double, through a whole offloaded MN (the
//! core's `MnDriver` and chains, provisioned through `MnPlan`: `support::mn`). The attacker
//! is a CN and uses only what a CN has — its own four QPs (any verb, any rkey, any address),
//! its memory, the connect info and its alloc replies — and, to be stronger than any real
//! attacker, the *exact* key of every MR the MN registered (read from the double's key table,
//! as if it had guessed them all) and every key byte of every MR index. A test passes when the
//! attack is denied.
//!
//! Races between laps and stalled CNs are exercised on the loopback model
//! (`tests/tests/loopback_interleaving.rs`, `loopback_stall.rs`); the double runs the same
//! chains and the same MN code.

mod support;

use omw_core::access::AccessFlags;
use omw_core::backend::{QpState, RdmaBackend, WcStatus};
use omw_core::ids::{GroupId, Rkey};
use omw_core::mn_plan::{MnOptions, ScrubPath};
use omw_core::wire::{AllocReply, ErrorCode, MnMessage, Notice};
use omw_core::wqe::Wqe;
use omw_fpga::double::ext::MrInfo;
use omw_fpga::Domain;
use support::mn::*;
use support::*;

const VICTIM: usize = 0;
const ATTACKER: usize = 1;
const REMOTE: AccessFlags = AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE).union(AccessFlags::REMOTE_ATOMIC);
/// What the attacker writes, swaps in and adds: recognisable wherever it lands.
const MARK: u64 = 0xDEAD_BEEF_0BAD_F00D;

fn mn_mrs(s: &Cluster) -> Vec<MrInfo> {
    s.f.mrs(s.mn_id)
}

/// Every verb a CN can aim at remote memory, at `addr` with `rkey`, from its buffer.
fn attacks(s: &Cluster, addr: u64, rkey: u32) -> [Wqe; 5] {
    let c = &s.cns[ATTACKER];
    let (buf, lkey) = (c.h.mem_base + DATA, c.lkey);
    let a = addr & !7;
    [
        Wqe::read(buf + 0x100, lkey, 8, addr, rkey),
        Wqe::write(buf, lkey, 8, addr, rkey),
        Wqe::fetch_add(buf + 0x108, lkey, a, rkey, MARK),
        Wqe::compare_swap(buf + 0x110, lkey, a, rkey, 0, MARK),
        Wqe::masked_fetch_add(buf + 0x118, lkey, a, rkey, MARK, 0),
    ]
}

/// What of the MN's an attack must not change: the victim's MWTable entry, scratch and
/// windows, the zero source and every byte of the pool. (Other groups' entries and the queue
/// order do change: a refused request on the attacker's Alloc QP runs a lap without a request
/// — the core defect `a_refused_request_on_the_alloc_qp_runs_no_lap` records — and the MN's
/// repair reclaims the group it popped, with new keys, to another place in the queue.
/// `check_invariants` and the owner check cover those.)
#[derive(PartialEq, Eq, Debug)]
struct Snapshot {
    victim_entry: Vec<u8>,
    victim_scratch: Vec<u8>,
    zero_source: Vec<u8>,
    pool: Vec<u8>,
    windows: Vec<Option<omw_fpga::double::ext::MwInfo>>,
}

impl Snapshot {
    /// The first difference, readably (a region name and the byte offset).
    fn diff(&self, o: &Snapshot) -> Option<String> {
        let regions = [
            ("victim entry", &self.victim_entry, &o.victim_entry),
            ("victim scratch", &self.victim_scratch, &o.victim_scratch),
            ("zero source", &self.zero_source, &o.zero_source),
            ("pool", &self.pool, &o.pool),
        ];
        for (name, a, b) in regions {
            if let Some(i) = a.iter().zip(b.iter()).position(|(x, y)| x != y) {
                return Some(format!(
                    "{name} at +{i:#x}: {:02x?} → {:02x?}",
                    &a[i..a.len().min(i + 16)],
                    &b[i..b.len().min(i + 16)]
                ));
            }
        }
        (self.windows != o.windows).then(|| format!("windows {:?} → {:?}", self.windows, o.windows))
    }
}

fn snapshot(s: &Cluster, victim_entry: u64, victim_windows: &[Rkey]) -> Snapshot {
    let m = s.map;
    let victim_slot = s.d.mn.cn(s.cns[VICTIM].id).unwrap().slot;
    let scratch = m.scratch(victim_slot).unwrap();
    Snapshot {
        victim_entry: s.mn_bytes(victim_entry, omw_core::mwtable::ENTRY_SIZE),
        victim_scratch: s.mn_bytes(scratch, omw_core::mn_memory::SCRATCH_PER_CN as usize),
        zero_source: s.mn_bytes(ZERO, CHUNK as usize),
        pool: s.mn_bytes(POOL, (CHUNK * CHUNKS as u64) as usize),
        windows: victim_windows.iter().map(|k| s.f.mw(s.mn_id, k.0)).collect(),
    }
}

#[test]
fn the_mn_is_provisioned_in_two_domains_through_the_plan() {
    let s = cluster(1);
    assert_eq!(s.plan.scrub, ScrubPath::Nic);
    let be = &s.d.backend;
    let (cn_pd, private) = (be.pd(Domain::CnFacing).unwrap(), be.pd(Domain::MnPrivate).unwrap());
    assert_ne!(cn_pd, private);
    let c = &s.cns[0];
    // loop QPs (both ends) and the atomic pair private; CN-facing and admin QPs CN-facing
    for ctid in [c.loops[0], c.loops[0] + 1, c.loops[1], c.loops[1] + 1, ATOMIC, ATOMIC + 1] {
        assert_eq!(s.f.qp_pd(s.mn_id, ctid), Some(private), "ctid {ctid}");
    }
    for q in c.mq {
        let ctid = (q.get() & 0x3F) as u8;
        assert_eq!(s.f.qp_pd(s.mn_id, ctid), Some(cn_pd), "MN end {q}");
    }
    assert_eq!(s.f.qp_pd(s.mn_id, ADMIN), Some(cn_pd));
    // remote rights exist only in the private domain; the pool's CN-facing MR grants none
    let mrs = mn_mrs(&s);
    for mr in &mrs {
        assert!(!mr.access.intersects(REMOTE) || mr.pd == private, "{mr:?}");
    }
    let pool: Vec<_> = mrs.iter().filter(|m| m.addr == POOL).collect();
    assert_eq!(pool.len(), 2, "the pool: CN-facing for binds, private for the scrub");
    assert!(pool.iter().any(|m| m.pd == cn_pd && m.access == AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE));
    assert!(pool.iter().any(|m| m.pd == private && m.access.contains(AccessFlags::REMOTE_WRITE)));
    let zero = mrs.iter().find(|m| m.addr == ZERO).expect("the zero source is registered");
    assert_eq!((zero.pd, zero.len, zero.access), (private, CHUNK, AccessFlags::empty()));
    assert_eq!((s.keys.zero_addr, s.keys.zero_lkey), (ZERO, zero.key));
    // metadata and rings: local-only CN-facing registrations beside the private ones
    for base in [s.map.meta_base, MN + ARENA_OFF] {
        let at: Vec<_> = mrs.iter().filter(|m| m.addr == base).collect();
        assert!(at.iter().any(|m| m.pd == cn_pd && m.access == AccessFlags::LOCAL_WRITE), "{base:#x}: {at:?}");
        assert!(at.iter().any(|m| m.pd == private && m.access.contains(REMOTE)), "{base:#x}: {at:?}");
    }
    // the table's first keys are the keys of the windows' next binds, not the allocations'
    let e = s.entry(s.map.entry_addr(GroupId(0)).unwrap());
    for k in 0..G as usize {
        let w = s.f.mw(s.mn_id, e.rkey(k).0).expect("a window of the pool");
        assert_eq!((w.bound, Rkey(w.rkey).next_key()), (None, e.rkey(k)), "the table key is the next bind's");
    }
}

#[test]
fn every_mn_key_through_every_cn_facing_qp_is_refused_and_changes_nothing() {
    let mut s = cluster(2);
    let victim = s.alloc(VICTIM, 0x71C7);
    let e = victim.entry;
    let base = e.base.get();
    assert_eq!(s.access(VICTIM, 0, Some(b"victim's"), base, e.rkey(1), 0), WcStatus::Success);
    let windows = [e.rkey(0), e.rkey(1), e.rkey(2)];
    let mrs = mn_mrs(&s);
    assert!(mrs.len() >= 8, "metadata ×2, table, rings ×2, pool ×2, zero source: {mrs:?}");
    let a_buf = s.cns[ATTACKER].h.mem_base + DATA;
    put(&mut s.cns[ATTACKER].h.be, a_buf, &MARK.to_le_bytes());
    // control: the attacker's READ and WRITE work on what is its own (data windows grant no
    // atomics)
    let own = s.alloc(ATTACKER, 0xC0);
    for w in &attacks(&s, own.entry.base.get() + 8, own.entry.rkey(1).0)[..2] {
        assert_eq!(s.cn_post(ATTACKER, 2, *w), WcStatus::Success, "control: {:?}", w.opcode);
    }
    s.send_free(ATTACKER, own.entry_addr, 0xC1);
    let before = snapshot(&s, victim.entry_addr, &windows);
    let failures_before = s.d.stats.chain_failures;
    let mut refused = 0u64;
    for mr in &mrs {
        let targets = [mr.addr, mr.addr + ((mr.len / 2) & !7), (mr.addr + mr.len).saturating_sub(8)];
        for (n, t) in targets.into_iter().enumerate() {
            for qp in 0..4 {
                // the exact key at three places; every other key byte of the index at one
                let keys: Vec<u32> = match n {
                    0 => (0..=255u32).map(|b| mr.key & !0xFF | b).collect(),
                    _ => vec![mr.key],
                };
                for key in keys {
                    for w in attacks(&s, t, key) {
                        let st = s.cn_post(ATTACKER, qp, w);
                        assert_ne!(
                            st,
                            WcStatus::Success,
                            "{:?} through CN QP {qp} at {t:#x} with key {key:#x} of {mr:?}",
                            w.opcode
                        );
                        refused += 1;
                    }
                }
            }
        }
    }
    assert_eq!(refused, mrs.len() as u64 * 4 * 5 * 258);
    // the MN repaired the attacker's chains as they failed; nothing of anyone else's changed
    assert!(s.d.stats.chain_failures > failures_before);
    if let Some(d) = before.diff(&snapshot(&s, victim.entry_addr, &windows)) {
        panic!("an attack changed MN state: {d}");
    }
    for mr in &mrs {
        let bytes = s.mn_bytes(mr.addr, mr.len as usize);
        let m = MARK.to_le_bytes();
        assert!(!bytes.windows(4).any(|w| w == &m[..4] || w == &m[4..]), "the mark landed in {mr:?}");
    }
    for g in 0..CHUNKS {
        let at = s.map.entry_addr(GroupId(g)).unwrap();
        let owner = if at == victim.entry_addr { s.cns[VICTIM].id.get() } else { 0 };
        assert_eq!(s.entry(at).owner(), owner, "group {g}");
    }
    s.d.check_invariants().unwrap();
    // the victim's chunk is its own, and every chain still works
    assert_eq!(s.access(VICTIM, 1, None, base, e.rkey(2), 8), WcStatus::Success);
    assert_eq!(s.read_back(VICTIM, 8), b"victim's");
    let again = s.alloc(ATTACKER, 0xA1);
    s.send_free(ATTACKER, again.entry_addr, 0xA2);
    s.send_free(VICTIM, victim.entry_addr, 0xA3);
    assert_eq!(s.entry(victim.entry_addr).owner(), 0);
    s.mn_poll();
    s.d.check_invariants().unwrap();
}

/// Tokens no MR key can equal (MR keys are below `0x1000 << 8`).
const TOKEN: u32 = 0x7A00_0000;

#[test]
fn no_mn_key_in_any_message_to_a_cn() {
    let mut s = cluster(3);
    let mr_keys: Vec<u32> = mn_mrs(&s).iter().map(|m| m.key).collect();
    let mr_indexes: Vec<u32> = mr_keys.iter().map(|k| k >> 8).collect();
    // every kind of message: connect info (at set-up), alloc replies, "empty" (error and
    // notice), "not the owner", "bad request", "available"
    let mut held = Vec::new();
    for t in 0..CHUNKS {
        let r = s.alloc(0, TOKEN + t);
        // the reply names the CN's own windows and nothing else: MW[0] on its Free QP, the
        // others on the access QPs it asked for, and the MR key the windows bind in is cleared
        assert_eq!(r.entry.lkey.get(), 0, "the reply carries the MN's MR key");
        let mine = [s.cns[0].mq[1].get(), s.cns[0].mq[2].get(), s.cns[0].mq[3].get()];
        for (k, qpn) in mine.into_iter().enumerate() {
            let rk = r.entry.rkey(k);
            assert!(!mr_indexes.contains(&rk.index()), "a reply rkey names an MR index: {rk:?}");
            let w = s.f.mw(s.mn_id, rk.0).expect("a reply rkey is a window");
            assert_eq!((w.rkey, w.bound.map(|b| b.qpn)), (rk.0, Some(qpn)), "rkey {k} is not this CN's window");
        }
        held.push(r);
    }
    s.send_alloc(1, TOKEN + 0x100); // the queue is empty: no reply
    s.f.run(2_000);
    s.mn_poll();
    s.send_free(2, held[0].entry_addr, TOKEN + 0x200); // not the owner
    s.mn_poll();
    assert_eq!(s.send_raw(2, 1, b"garbage bytes"), WcStatus::Success); // a malformed request
    s.mn_poll();
    for (t, a) in held.iter().enumerate() {
        s.send_free(0, a.entry_addr, TOKEN + 0x300 + t as u32);
    }
    s.now += 1;
    s.d.handle(s.now, omw_core::mn::Event::Tick).unwrap(); // "available"
    s.f.run(2_000);
    s.mn_poll();
    let r = s.alloc(1, TOKEN + 0x400);
    assert_eq!(r.entry.lkey.get(), 0);
    let mut kinds = std::collections::BTreeSet::new();
    for i in 0..3 {
        s.top_up(i);
        let c = &s.cns[i];
        assert!(!c.received.is_empty() || !c.replies.is_empty());
        for b in c.received.iter().chain(c.replies.iter()) {
            for (off, w) in b.windows(4).enumerate() {
                let v = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                assert!(!mr_keys.contains(&v), "cn{i} received an MN MR key {v:#x} at +{off} of {b:02x?}");
            }
        }
        for b in &c.received {
            let kind = match MnMessage::decode(b).unwrap_or_else(|e| panic!("cn{i}: undecodable {b:02x?}: {e:?}")) {
                MnMessage::ConnectInfo(_) => "connect info".to_string(),
                MnMessage::Error(e) => format!("error {:?}", e.code),
                MnMessage::Notice(Notice::Empty) => "empty".into(),
                MnMessage::Notice(Notice::Available { .. }) => "available".into(),
                m => format!("{m:?}"),
            };
            kinds.insert(kind);
        }
        for b in &c.replies {
            assert_eq!(AllocReply::decode(b).unwrap().entry.lkey.get(), 0);
        }
    }
    for k in ["connect info", "empty", "available", "error Empty", "error NotOwner", "error BadRequest"] {
        assert!(kinds.contains(k), "no {k} message was exercised: {kinds:?}");
    }
    s.d.check_invariants().unwrap();
}

/// Write a secret over the whole chunk through its data window.
fn soil(s: &mut Cluster, i: usize, r: &AllocReply) {
    let secret = vec![0x5Au8; CHUNK as usize];
    assert_eq!(s.access(i, 0, Some(&secret), r.entry.base.get(), r.entry.rkey(1), 0), WcStatus::Success);
}

/// CN `i` allocates until it holds the group at `entry_addr` again, and reads it whole.
fn reread(s: &mut Cluster, i: usize, entry_addr: u64) -> Vec<u8> {
    for t in 0..CHUNKS {
        let r = s.alloc(i, TOKEN + 0x800 + t);
        if r.entry_addr == entry_addr {
            let st = s.access(i, 0, None, r.entry.base.get(), r.entry.rkey(1), CHUNK as u32);
            assert_eq!(st, WcStatus::Success);
            return s.read_back(i, CHUNK as usize);
        }
    }
    panic!("the group never came back");
}

#[test]
fn after_an_offloaded_free_the_next_owner_reads_zeros() {
    let mut s = cluster(2);
    let a = s.alloc(VICTIM, TOKEN);
    soil(&mut s, VICTIM, &a);
    // the free chain scrubs on the NIC: the MN CPU does not run between the free and the
    // next owner's allocation (no poll, no tick), and it scrubbed nothing itself
    s.send_free(VICTIM, a.entry_addr, TOKEN + 1);
    assert_eq!(s.entry(a.entry_addr).owner(), 0, "the free committed");
    let got = reread(&mut s, ATTACKER, a.entry_addr);
    assert!(got.iter().all(|b| *b == 0), "the next owner reads the last one's bytes");
    assert_eq!(s.d.mn.stats().chunks_scrubbed, 0, "the MN CPU did not do it");
    assert!(s.mn_bytes(ZERO, CHUNK as usize).iter().all(|b| *b == 0), "the zero source stays zero");
    s.mn_poll();
    s.d.check_invariants().unwrap();
}

#[test]
fn with_scrubbing_off_the_residue_is_there() {
    // the control for the test above: the same path with the operator's explicit opt-out
    let mut s = cluster_with(2, MnOptions { scrub: false, ..MnOptions::default() });
    assert_eq!((s.plan.scrub, s.keys.zero_lkey), (ScrubPath::Off, 0));
    let a = s.alloc(VICTIM, TOKEN);
    soil(&mut s, VICTIM, &a);
    s.send_free(VICTIM, a.entry_addr, TOKEN + 1);
    let got = reread(&mut s, ATTACKER, a.entry_addr);
    assert!(got.iter().all(|b| *b == 0x5A), "scrubbing off leaves the residue (so the scrub test can fail)");
}

#[test]
fn a_forged_free_fails_and_the_owner_keeps_its_chunk() {
    let mut s = cluster(2);
    let victim = s.alloc(VICTIM, TOKEN);
    let e = victim.entry;
    let base = e.base.get();
    assert_eq!(s.access(VICTIM, 0, Some(b"owner's data"), base, e.rkey(1), 0), WcStatus::Success);
    let own = s.alloc(ATTACKER, TOKEN + 1);
    let free_group = s.map.entry_addr(GroupId(CHUNKS - 1)).unwrap();
    assert!(free_group != victim.entry_addr && free_group != own.entry_addr);
    let forged = [
        ("the victim's entry", victim.entry_addr, ErrorCode::NotOwner),
        ("a free group's entry", free_group, ErrorCode::NotOwner),
        ("inside the victim's entry", victim.entry_addr + 8, ErrorCode::NotOwner),
        ("outside the table (the queue)", s.map.meta_base, ErrorCode::BadRequest),
        ("past the table", s.map.table_base + s.map.table_len(), ErrorCode::BadRequest),
    ];
    let victim_windows = [e.rkey(0), e.rkey(1), e.rkey(2)];
    let before = snapshot(&s, victim.entry_addr, &victim_windows);
    for (n, (what, addr, code)) in forged.into_iter().enumerate() {
        let forged_before = s.d.mn.stats().forged_frees;
        s.send_free(ATTACKER, addr, TOKEN + 0x10 + n as u32);
        // the ownership check (the Free QP's LOCAL_INV) or the table-only MR (the loop QP's
        // READ of the entry) stopped the chain
        let fl = s.cns[ATTACKER].loop_qpns[1];
        let states = [s.d.backend.qp_state(s.cns[ATTACKER].mq[1]).unwrap(), s.d.backend.qp_state(fl).unwrap()];
        assert!(states.contains(&QpState::Err), "{what}: the chain did not stop: {states:?}");
        // nothing of the owner's changed, before and after the MN CPU repaired
        for _ in 0..2 {
            if let Some(d) = before.diff(&snapshot(&s, victim.entry_addr, &victim_windows)) {
                panic!("{what}: {d}");
            }
            assert_eq!(s.bound_to(e.rkey(0)), Some(s.cns[VICTIM].mq[1].get()), "{what}");
            s.mn_poll();
        }
        let m = s.next_message(ATTACKER);
        match MnMessage::decode(&m).unwrap() {
            MnMessage::Error(err) => assert_eq!((err.token, err.code), (TOKEN + 0x10 + n as u32, code), "{what}"),
            m => panic!("{what}: expected an error, got {m:?}"),
        }
        let forged_now = s.d.mn.stats().forged_frees;
        assert_eq!(forged_now - forged_before, (code == ErrorCode::NotOwner) as u64, "{what}");
        for q in [s.cns[ATTACKER].mq[1], fl] {
            assert_eq!(s.d.backend.qp_state(q).unwrap(), QpState::Rts, "{what}: re-armed");
        }
        s.d.check_invariants().unwrap_or_else(|v| panic!("{what}: {v}"));
        assert_eq!(s.access(VICTIM, 1, None, base, e.rkey(2), 12), WcStatus::Success);
        assert_eq!(s.read_back(VICTIM, 12), b"owner's data", "{what}");
    }
    // both chains still serve their owners
    s.send_free(ATTACKER, own.entry_addr, TOKEN + 0x20);
    assert_eq!(s.entry(own.entry_addr).owner(), 0);
    s.send_free(VICTIM, victim.entry_addr, TOKEN + 0x21);
    assert_eq!(s.entry(victim.entry_addr).owner(), 0);
    s.mn_poll();
    s.d.check_invariants().unwrap();
}

#[test]
fn stale_rkeys_after_a_free_are_refused() {
    let mut s = cluster(2);
    let a = s.alloc(VICTIM, TOKEN);
    let base = a.entry.base.get();
    s.send_free(VICTIM, a.entry_addr, TOKEN + 1);
    // the former owner's keys, through the very QPs they were bound to
    assert_eq!(s.access(VICTIM, 0, None, base, a.entry.rkey(1), 8), WcStatus::RemAccessErr);
    s.reset_access(VICTIM, 0);
    assert_eq!(s.access(VICTIM, 1, Some(b"stale"), base, a.entry.rkey(2), 0), WcStatus::RemAccessErr);
    s.reset_access(VICTIM, 1);
    let w0 = Wqe::read(s.cns[VICTIM].h.mem_base + READ_BACK, s.cns[VICTIM].lkey, 8, base, a.entry.rkey(0).0);
    assert_ne!(s.cn_post(VICTIM, 1, w0), WcStatus::Success, "MW[0] through the Free QP");
    // the chunk's next owner writes a secret; the former owner tries every key byte of every
    // window index of the group, through each of its QPs, reading and writing
    let b = {
        let mut got = None;
        for t in 0..CHUNKS {
            let r = s.alloc(ATTACKER, TOKEN + 0x10 + t);
            if r.entry_addr == a.entry_addr {
                got = Some(r);
                break;
            }
        }
        got.expect("the group came back")
    };
    assert_eq!(s.access(ATTACKER, 0, Some(b"next owner's"), base, b.entry.rkey(1), 0), WcStatus::Success);
    let mut tried = 0;
    for k in 0..G as usize {
        let idx = a.entry.rkey(k).index();
        for byte in 0..=255u32 {
            let rk = idx << 8 | byte;
            let c = &s.cns[VICTIM];
            let (buf, lkey) = (c.h.mem_base + DATA, c.lkey);
            for qp in 0..4 {
                for w in [Wqe::read(buf + 0x100, lkey, 8, base, rk), Wqe::write(buf, lkey, 8, base, rk)] {
                    assert_ne!(s.cn_post(VICTIM, qp, w), WcStatus::Success, "key {rk:#x} through CN QP {qp}");
                    tried += 1;
                }
            }
        }
    }
    assert_eq!(tried, G as usize * 256 * 4 * 2);
    assert_eq!(s.access(ATTACKER, 1, None, base, b.entry.rkey(2), 12), WcStatus::Success);
    assert_eq!(s.read_back(ATTACKER, 12), b"next owner's");
    s.d.check_invariants().unwrap();
}

/// Found while writing the tests above. A refused request on a CN's Alloc QP puts the MN end
/// in error, which flushes the receive the alloc chain posted there; the Loop ring's first WAIT
/// counts that receive queue's completions, so the flush starts a lap with no request. That lap
/// must give the CN nothing: its binds and its reply are posted on the errored Alloc QP (the
/// chains since the four-phase redesign) and are flushed, so no window of the popped group is
/// ever bound — the table may name the CN as owner until the MN's repair (the owner is written
/// before the binds), which reclaims it; and the CN's free of that group cannot pass the
/// ownership check (MW[0] is not bound to it), so nothing is pushed twice.
#[test]
fn a_refused_request_on_the_alloc_qp_runs_no_lap() {
    let mut s = cluster(2);
    let own = s.alloc(ATTACKER, TOKEN);
    s.send_free(ATTACKER, own.entry_addr, TOKEN + 1);
    let mr = mn_mrs(&s)[0];
    let w = attacks(&s, mr.addr, mr.key)[0].with_wr_id(0xBAD).with_flags(omw_core::wqe::WqeFlags::SIGNALED);
    let c = &mut s.cns[ATTACKER];
    let q = c.q[0];
    c.h.be.post_send(q, &w).unwrap();
    assert_eq!(wait1(&mut c.h.be, q, omw_core::wqe::QueueSel::Send).status, WcStatus::RemAccessErr);
    c.h.be.reset_qp(q).unwrap();
    s.f.run(5_000);
    let attacker = s.cns[ATTACKER].id.get();
    let named: Vec<u64> = (0..CHUNKS)
        .map(|g| s.map.entry_addr(GroupId(g)).unwrap())
        .filter(|at| s.entry(*at).owner() == attacker)
        .collect();
    // no window of any group it did not ask for is bound anywhere
    for at in &named {
        let e = s.entry(*at);
        for k in 0..G as usize {
            assert_eq!(s.bound_to(e.rkey(k)), None, "window {k} of {at:#x} bound for a CN that sent no request");
        }
    }
    // its frees of them fail the ownership check; the MN's repair takes them back, once
    for (t, at) in named.iter().enumerate() {
        s.send_free(ATTACKER, *at, TOKEN + 0x10 + t as u32);
    }
    s.mn_poll();
    s.d.check_invariants().unwrap();
    for at in &named {
        assert_eq!(s.entry(*at).owner(), 0, "the repair did not take {at:#x} back");
    }
}
