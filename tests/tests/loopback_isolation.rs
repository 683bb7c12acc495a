//! Isolation against a hostile CN (DESIGN.md §9, issue 10), on the loopback cluster in every
//! mode: offloaded, host engine, and host engine on an rxe-compatible NIC. The attacker uses
//! only what a CN has — its own QPs (any verb, any rkey, any address), its memory, the connect
//! info and its alloc replies — and, to be stronger than any real attacker, the *exact* current
//! key of every MR the MN registered (as if it had guessed or counted them all). A test passes
//! when the attack is denied.
//!
//! Classes: MN-private memory reached with a key (metadata, MWTable, scratch, rings, the
//! pool's and the zero source's private registrations); MN keys leaked in messages; residue of
//! a previous owner on every path a chunk comes back by. Races between laps are in
//! `loopback_interleaving.rs`, stalled and vanished CNs in `loopback_stall.rs`.

use omw_core::backend::{ExecutionMode, WcStatus};
use omw_core::ids::{GroupId, Rkey};
use omw_core::wire::{AllocReply, MnMessage};
use omw_core::wqe::Wqe;
use omw_core::wqe_format::WqeFormat;
use omw_loopback::cluster::{Cluster, ClusterConfig, CnQp};
use omw_loopback::MrInfo;
use omw_tests::{Mode, MODES};

thread_local! {
    /// The form `cluster` lays offloaded chains out in (set per iteration of [`forms`]).
    static FORMAT: std::cell::Cell<WqeFormat> = const { std::cell::Cell::new(WqeFormat::Canonical) };
}

/// Every mode, and offloaded once more with the chains in mlx5 form.
fn forms() -> impl Iterator<Item = (Mode, WqeFormat)> {
    MODES.into_iter().map(|m| (m, WqeFormat::Canonical)).chain([(Mode::Offloaded, WqeFormat::Mlx5)])
}

fn cluster(mode: Mode, chunks: u32, scrub: bool) -> Cluster {
    if mode == Mode::Offloaded && FORMAT.with(|f| f.get()) == WqeFormat::Mlx5 {
        // `omw_tests::cluster`'s offloaded set-up, the chains in mlx5 form
        let mut cfg = ClusterConfig::paper_like().with_wqe_format(WqeFormat::Mlx5);
        (cfg.cns, cfg.chunks, cfg.chunk_size, cfg.quota, cfg.scrub) = (3, chunks, 512, chunks, scrub);
        cfg.mode = Some(ExecutionMode::Offloaded);
        return Cluster::new(cfg).expect("cluster");
    }
    omw_tests::cluster(mode, 3, chunks, scrub)
}

fn mn_mrs(c: &Cluster) -> Vec<MrInfo> {
    c.fabric.borrow().mrs_of(c.mn_host).unwrap()
}

fn mn_bytes(c: &Cluster, addr: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    c.fabric.borrow().read(c.mn_host, addr, &mut b).unwrap();
    b
}

/// Every verb a CN can aim at remote memory, at `addr` with `rkey`.
fn attacks(addr: u64, rkey: u32) -> [Wqe; 4] {
    [
        Wqe::read(0, 0, 8, addr, rkey),
        Wqe::write(0, 0, 8, addr, rkey),
        Wqe::fetch_add(0, 0, addr & !7, rkey, 0x0101_0101),
        Wqe::compare_swap(0, 0, addr & !7, rkey, 0, 0xDEAD_BEEF),
    ]
}

#[test]
fn mn_private_memory_is_out_of_reach_with_every_mn_key() {
    for (mode, form) in forms() {
        FORMAT.with(|f| f.set(form));
        let mut c = cluster(mode, 4, true);
        let victim = c.alloc(0).unwrap();
        assert_eq!(c.write(0, &victim, 0, 0, b"victim's"), WcStatus::Success);
        let g = c.group_of(&victim).unwrap();
        let entry_before = c.driver.entry(g).unwrap();
        let map = *c.driver.mn.map();
        let mrs = mn_mrs(&c);
        assert!(mrs.len() >= 4, "{mode:?}: the MN registers metadata, table, rings, pool");
        // control: the attacker's verbs work on what is its own
        let own = c.alloc(1).unwrap();
        let w = Wqe::write(0, 0, 8, own.base, own.rkey(0).unwrap().0);
        assert_eq!(c.cn_post(1, CnQp::Access(0), w), WcStatus::Success, "{mode:?}: control");
        assert_eq!(
            c.cn_post(1, CnQp::Access(0), Wqe::read(0, 0, 8, own.base, own.rkey(0).unwrap().0)),
            WcStatus::Success
        );
        c.free(1, &own).unwrap();
        // the attacker writes a recognisable pattern wherever it can
        for mr in &mrs {
            let targets = [mr.addr, mr.addr + ((mr.len / 2) & !7), (mr.addr + mr.len).saturating_sub(8)];
            for t in targets {
                for qp in [CnQp::Alloc, CnQp::Free, CnQp::Access(0), CnQp::Access(1)] {
                    for w in attacks(t, mr.key) {
                        let st = c.cn_post(1, qp, w);
                        assert_ne!(
                            st,
                            WcStatus::Success,
                            "{mode:?}: {:?} through {qp:?} at {t:#x} with the MN's key {:#x} ({:?}, pd {:?}) succeeded",
                            w.opcode,
                            mr.key,
                            mr.access,
                            mr.pd
                        );
                    }
                }
            }
        }
        // a guessing attacker: every key byte of every MN MR index, from an access QP
        for mr in &mrs {
            let idx = mr.key >> 8;
            for key in 0..=255u32 {
                let rk = (idx << 8) | key;
                assert_ne!(c.cn_post(1, CnQp::Access(0), Wqe::read(0, 0, 8, mr.addr, rk)), WcStatus::Success);
            }
        }
        // nothing of the MN's changed: the victim's entry, its data, the queue; everyone works
        assert_eq!(c.driver.entry(g).unwrap(), entry_before, "{mode:?}: the victim's MWTable entry changed");
        let (st, got) = c.read(0, &victim, 0, 0, 8);
        assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"victim's"[..]), "{mode:?}");
        assert!(!mn_bytes(&c, map.meta_base, map.meta_len as usize)
            .windows(4)
            .any(|w| w == 0xDEAD_BEEFu32.to_le_bytes()));
        c.check_invariants().unwrap_or_else(|e| panic!("{mode:?}: {e}"));
        let b = c.alloc(1).unwrap_or_else(|e| panic!("{mode:?}: the attacker's own service broke: {e}"));
        c.free(1, &b).unwrap();
        c.free(0, &victim).unwrap();
        c.check_invariants().unwrap_or_else(|e| panic!("{mode:?}: {e}"));
    }
}

#[test]
fn host_engine_registers_no_remote_rights_on_mn_memory() {
    for mode in [Mode::HostEngine, Mode::Rxe] {
        let c = cluster(mode, 4, true);
        for mr in mn_mrs(&c) {
            assert!(
                !mr.access.intersects(
                    omw_core::access::AccessFlags::REMOTE_READ
                        | omw_core::access::AccessFlags::REMOTE_WRITE
                        | omw_core::access::AccessFlags::REMOTE_ATOMIC
                ),
                "{mode:?}: MR {:#x} at {:#x} has {:?}",
                mr.key,
                mr.addr,
                mr.access
            );
        }
    }
    // offloaded: remote rights exist only in the private PD, which no CN-facing QP is in
    let c = cluster(Mode::Offloaded, 4, true);
    let private = c.driver.backend.private_pd.expect("offloaded: the MN has a private PD");
    for mr in mn_mrs(&c) {
        let remote = mr.access.intersects(
            omw_core::access::AccessFlags::REMOTE_READ
                | omw_core::access::AccessFlags::REMOTE_WRITE
                | omw_core::access::AccessFlags::REMOTE_ATOMIC,
        );
        assert!(!remote || mr.pd == private, "MR {:#x} with {:?} in {:?}", mr.key, mr.access, mr.pd);
    }
}

#[test]
fn no_mn_key_reaches_a_cn() {
    for (mode, form) in forms() {
        FORMAT.with(|f| f.set(form));
        let mut c = cluster(mode, 3, true);
        let keys: Vec<u32> = mn_mrs(&c).iter().map(|m| m.key).collect();
        // every kind of message: connect info, replies, empty and available notices, errors
        let mut held = Vec::new();
        while let Ok(a) = c.alloc(0) {
            held.push(a);
        }
        let _ = c.alloc(1); // empty
        let _ = c.free_raw(1, held[0].entry_addr); // not the owner
        let _ = c.send_raw(2, omw_core::chain::ChainKind::Alloc, b"garbage bytes");
        for a in &held {
            c.free(0, a).unwrap();
        }
        c.tick().unwrap();
        let a = c.alloc(1).unwrap();
        held.push(a);
        for (i, n) in c.cns.iter().enumerate() {
            assert!(!n.received.is_empty());
            for b in &n.received {
                if let Ok(r) = AllocReply::decode(b) {
                    assert_eq!(r.entry.lkey.get(), 0, "{mode:?}: cn{i} got the MN's MR key {:#x}", r.entry.lkey.get());
                    for k in 0..3 {
                        let rk = r.entry.rkey(k);
                        assert!(!keys.contains(&rk.0), "{mode:?}: an MR key in a reply's rkeys");
                    }
                    continue;
                }
                match MnMessage::decode(b) {
                    Ok(MnMessage::Error(e)) => {
                        assert!(!keys.contains(&e.detail) || e.detail < 0x100, "{mode:?}: error detail {:#x}", e.detail)
                    }
                    Ok(_) => {}
                    Err(e) => panic!("{mode:?}: cn{i} received undecodable bytes: {e:?}"),
                }
            }
        }
    }
}

/// Write a secret over the whole chunk.
fn soil(c: &mut Cluster, i: usize, a: &omw_core::cn::Allocation) {
    let secret = vec![0x5Au8; a.length as usize];
    assert_eq!(c.write(i, a, 0, 0, &secret), WcStatus::Success);
}

/// CN `i` allocates until it holds group `g` again (the others go back), and reads it whole.
fn reread(c: &mut Cluster, i: usize, g: GroupId, why: &str) {
    let mut others = Vec::new();
    for _ in 0..8 {
        let a = c.alloc(i).unwrap_or_else(|e| panic!("{why}: {e}"));
        if c.group_of(&a) == Some(g) {
            let (st, got) = c.read(i, &a, 0, 0, a.length as usize);
            assert_eq!(st, WcStatus::Success);
            assert!(got.iter().all(|b| *b == 0), "{why}: the next owner reads the last one's bytes");
            c.free(i, &a).unwrap();
            for o in others {
                c.free(i, &o).unwrap();
            }
            return;
        }
        others.push(a);
    }
    panic!("{why}: group {g:?} never came back");
}

#[test]
fn every_chunk_reads_as_zeros_whatever_path_returned_it() {
    for (mode, form) in forms() {
        FORMAT.with(|f| f.set(form));
        // free (offloaded: by the NIC; host engine: by the MN CPU)
        let mut c = cluster(mode, 2, true);
        let a = c.alloc(0).unwrap();
        let g = c.group_of(&a).unwrap();
        soil(&mut c, 0, &a);
        c.free(0, &a).unwrap();
        reread(&mut c, 1, g, &format!("{mode:?} free"));
        // crash of the holder
        let a = c.alloc(0).unwrap();
        let g = c.group_of(&a).unwrap();
        soil(&mut c, 0, &a);
        c.crash_cn(0).unwrap();
        reread(&mut c, 1, g, &format!("{mode:?} crash"));
        // MN RNIC reset (every allocation revoked)
        let a = c.alloc(1).unwrap();
        let g = c.group_of(&a).unwrap();
        soil(&mut c, 1, &a);
        c.reset_mn_rnic().unwrap();
        reread(&mut c, 2, g, &format!("{mode:?} RNIC reset"));
        c.check_invariants().unwrap();
    }
    // offloaded lazy quota: the over-quota CN loses everything, the chunks come back clean
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = 2;
    cfg.chunks = 3;
    cfg.chunk_size = 512;
    cfg.quota = 1;
    cfg.mode = Some(ExecutionMode::Offloaded);
    let mut c = Cluster::new(cfg).unwrap();
    let a = c.alloc(0).unwrap();
    soil(&mut c, 0, &a);
    let b = c.alloc(0).unwrap();
    soil(&mut c, 0, &b);
    let (ga, gb) = (c.group_of(&a).unwrap(), c.group_of(&b).unwrap());
    c.tick().unwrap(); // the audit finds cn0 over its quota and reclaims both
    reread(&mut c, 1, ga, "quota");
    reread(&mut c, 1, gb, "quota");
}

#[test]
fn scrubbing_off_is_explicit_and_leaves_residue() {
    for mode in [Mode::Offloaded, Mode::HostEngine] {
        let mut c = cluster(mode, 1, false);
        let a = c.alloc(0).unwrap();
        soil(&mut c, 0, &a);
        c.free(0, &a).unwrap();
        let b = c.alloc(1).unwrap();
        let (st, got) = c.read(1, &b, 0, 0, 8);
        assert_eq!(st, WcStatus::Success);
        assert_eq!(
            got,
            vec![0x5A; 8],
            "{mode:?}: with scrubbing off the residue is there (so the scrub tests can fail)"
        );
        assert_eq!(c.driver.mn.config().scrub, omw_core::mn_plan::ScrubPath::Off);
    }
}

#[test]
fn stale_window_keys_are_not_mr_keys() {
    // a CN that learns its window rkeys cannot turn them into MN MR keys: every index it sees
    // is a window's, never an MR's
    for (mode, form) in forms() {
        FORMAT.with(|f| f.set(form));
        let mut c = cluster(mode, 2, true);
        let a = c.alloc(0).unwrap();
        let mrs: Vec<u32> = mn_mrs(&c).iter().map(|m| m.key >> 8).collect();
        for k in [a.owner_rkey].into_iter().chain(a.rkeys.iter().copied()) {
            assert!(!mrs.contains(&Rkey(k.0).index()), "{mode:?}");
        }
    }
}

/// Defence in depth (issue 10 §7): MN memory corrupted so an MWTable entry spans more than its
/// chunk. The host engine refuses to bind such a span; offloaded (the NIC binds what the entry
/// says), the audit finds the bound window outside its chunk and reclaims the group.
#[test]
fn a_corrupted_entry_span_is_never_served() {
    use omw_core::mwtable::MwTableEntry;
    use zerocopy::IntoBytes;
    for (mode, form) in forms() {
        FORMAT.with(|f| f.set(form));
        let mut c = cluster(mode, 4, true);
        // corrupt every entry: twice the chunk, reaching into the next one
        let map = *c.driver.mn.map();
        for g in 0..4 {
            let addr = map.entry_addr(GroupId(g)).unwrap();
            let mut e: MwTableEntry = c.driver.entry(GroupId(g)).unwrap();
            e.length = (2 * e.length.get()).into();
            c.fabric.borrow_mut().write(c.mn_host, addr, e.as_bytes()).unwrap();
        }
        match (mode, c.alloc(0)) {
            (Mode::Offloaded, r) => {
                // the NIC bound the corrupted span (the CN's client refuses a reply whose length
                // is not the chunk size, if it got one); the next audit takes the windows away
                c.tick().unwrap();
                assert!(c.driver.mn.stats().spans_refused >= 1, "{mode:?}: the audit saw nothing");
                if let Ok(a) = r {
                    assert_eq!(c.read(0, &a, 0, 0, 8).0, WcStatus::RemAccessErr, "{mode:?}: the window survived");
                }
                let bound_outside = (0..4).any(|g| {
                    let e = c.driver.entry(GroupId(g)).unwrap();
                    e.owner() != 0
                });
                assert!(!bound_outside, "{mode:?}: a group with a corrupted span stayed allocated");
            }
            (_, r) => {
                assert!(r.is_err(), "{mode:?}: the host engine bound a span that is not one chunk");
            }
        }
    }
}
