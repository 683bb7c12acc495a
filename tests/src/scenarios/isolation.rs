//! Isolation against a hostile CN (DESIGN.md §9, issue 10): every attack class. The attacker
//! uses only what a CN has — its own QPs (any verb, any rkey, any address), its memory, the
//! connect info and its alloc replies — and, to be stronger than any real attacker, the *exact*
//! current key of every MR the MN registered. A scenario passes when the attack is denied.

use super::{denied, invariants, reread, soil};
use crate::runner::{Outcome, Scenario};
use crate::testbed::{Caps, CnQp, Factory, Heard, MnSpec, Refusal, Testbed};
use omw_core::chain::ChainKind;
use omw_core::cn::Allocation;
use omw_core::device::{ExecutionMode, MwBinding, WcStatus};
use omw_core::ids::{GroupId, Rkey};
use omw_core::wire::message::{AllocReply, ErrorCode, MnMessage, Notice};
use omw_core::wire::wqe::Wqe;

pub const LIST: &[Scenario] = &[
    Scenario { name: "isolation::other_cn_cannot_touch_a_chunk_with_its_rkey", needs: Caps::NONE, run: cross_cn },
    Scenario { name: "isolation::forged_free_fails_the_ownership_check", needs: Caps::NONE, run: forged_free },
    Scenario {
        name: "isolation::forged_frees_of_any_address_change_nothing",
        needs: Caps::MN_MEMORY.union(Caps::WINDOW_STATE),
        run: forged_free_any_address,
    },
    Scenario { name: "isolation::stale_rkey_after_free_is_denied", needs: Caps::NONE, run: stale_rkey },
    Scenario { name: "isolation::stale_rkeys_every_key_byte_every_qp", needs: Caps::HOSTILE_QPS, run: stale_rkey_walk },
    Scenario { name: "isolation::walking_all_256_keys_never_grants_access", needs: Caps::REVIVE, run: walk_256 },
    Scenario {
        name: "isolation::windows_bound_to_a_foreign_qp_are_reclaimed_by_the_audit",
        needs: Caps::NAMED_QPS,
        run: foreign_qp,
    },
    Scenario {
        name: "isolation::corrupted_and_arbitrary_requests_are_typed_errors",
        needs: Caps::RAW_REQUESTS,
        run: garbage_requests,
    },
    Scenario {
        name: "isolation::a_corrupted_request_in_flight_hurts_only_its_sender",
        needs: Caps::FAULTS,
        run: corrupted_in_flight,
    },
    Scenario { name: "isolation::rxe_compatible_device_uses_per_chunk_mrs", needs: Caps::RXE_MW, run: per_chunk_mrs },
    Scenario {
        name: "isolation::mn_private_memory_is_out_of_reach_with_every_mn_key",
        needs: Caps::MN_KEYS.union(Caps::HOSTILE_QPS).union(Caps::MN_MEMORY).union(Caps::WINDOW_STATE),
        run: mn_private_memory,
    },
    Scenario {
        name: "isolation::remote_rights_on_mn_memory_only_in_the_private_domain",
        needs: Caps::MN_KEYS,
        run: remote_rights,
    },
    Scenario {
        name: "isolation::no_mn_key_reaches_a_cn",
        needs: Caps::MN_KEYS.union(Caps::CN_MESSAGES).union(Caps::RAW_REQUESTS),
        run: no_key_in_messages,
    },
    Scenario { name: "isolation::window_keys_are_not_mr_keys", needs: Caps::MN_KEYS, run: window_keys_not_mr_keys },
    Scenario { name: "isolation::a_freed_chunk_reads_as_zeros", needs: Caps::NONE, run: scrub_free },
    Scenario { name: "isolation::a_crashed_holders_chunk_reads_as_zeros", needs: Caps::CRASH, run: scrub_crash },
    Scenario {
        name: "isolation::chunks_revoked_by_an_rnic_reset_read_as_zeros",
        needs: Caps::RNIC_RESET,
        run: scrub_reset,
    },
    Scenario { name: "isolation::chunks_revoked_for_quota_read_as_zeros", needs: Caps::OFFLOAD, run: scrub_quota },
    Scenario { name: "isolation::scrubbing_off_is_explicit_and_leaves_residue", needs: Caps::NONE, run: scrub_off },
    Scenario {
        name: "isolation::a_corrupted_entry_span_is_never_bound_by_the_host_engine",
        needs: Caps::MN_MEMORY.union(Caps::HOST_ENGINE),
        run: corrupted_span,
    },
    Scenario {
        name: "isolation::a_corrupted_entry_span_is_reclaimed_by_the_audit",
        needs: Caps::MN_MEMORY.union(Caps::OFFLOAD).union(Caps::WINDOW_SPANS),
        run: corrupted_span,
    },
    Scenario {
        name: "isolation::send_with_inv_of_another_cns_window_evicts_the_sender_and_restores_the_window",
        needs: Caps::SEND_WITH_INV,
        run: foreign_invalidation,
    },
    Scenario {
        name: "isolation::send_with_inv_of_a_cns_own_window_is_its_own_bad_request",
        needs: Caps::SEND_WITH_INV,
        run: own_invalidation,
    },
];

/// From loopback_security.rs, rxe_cluster.rs and the state machine's cross access.
fn cross_cn(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 16));
    let a = t.alloc(0)?;
    assert_eq!(t.write(0, &a, 0, 0, b"secret of A"), WcStatus::Success);
    // B uses A's rkey and address through each of B's own access QPs
    for q in 0..2 {
        let rk = a.rkey(q).unwrap();
        let st = t.write_raw(1, q, a.base, rk, b"overwrite!!");
        assert_eq!(st, WcStatus::RemAccessErr, "B writes with A's rkey {q}");
        let st = t.read_raw(1, q, a.base, rk, 11).0;
        denied(&*t, st, "B reads with A's rkey");
    }
    // C with its own rkey but an address outside its own chunk (A's, and past its own)
    let c = t.alloc(2)?;
    let st = t.write_raw(2, 0, a.base, c.rkey(0).unwrap(), b"overwrite!!");
    assert_eq!(st, WcStatus::RemAccessErr, "C's own rkey at A's chunk");
    let st = t.read_raw(2, 1, a.base, c.rkey(1).unwrap(), 8).0;
    assert_eq!(st, WcStatus::RemAccessErr, "C's own rkey 1 at A's chunk");
    let st = t.read_raw(2, 0, c.base + c.length, c.rkey(0).unwrap(), 8).0;
    denied(&*t, st, "C past its chunk");
    // A's bytes unchanged, A still has access through both QPs
    for q in 0..2 {
        let (st, got) = t.read(0, &a, q, 0, 11);
        assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"secret of A"[..]));
    }
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_security.rs and rxe_cluster.rs.
fn forged_free(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 16));
    let a = t.alloc(0)?;
    assert_eq!(t.write(0, &a, 0, 0, b"mine"), WcStatus::Success);
    // B names A's entry
    assert_eq!(t.free_entry(1, a.entry_addr), Err(Refusal::Mn(ErrorCode::NotOwner)));
    invariants(&mut *t, "forged");
    if t.caps().contains(Caps::WINDOW_STATE) {
        assert!(matches!(t.mw_binding(a.owner_rkey), Some(MwBinding::Bound { .. })));
    }
    let (st, got) = t.read(0, &a, 0, 0, 4);
    assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"mine"[..]));
    // B names an address that is no entry at all
    assert!(t.free_entry(1, a.entry_addr + 4).is_err());
    assert!(t.free_entry(1, 0x10).is_err());
    invariants(&mut *t, "not entries");
    // B's free chain was re-armed: B can still allocate and free its own
    let b = t.alloc(1)?;
    t.free(1, &b)?;
    assert!(t.stats().forged_frees >= 1);
    assert!(t.forged_frees_of(1) >= 1, "counted against the forger");
    invariants(&mut *t, "after");
    Ok(())
}

/// From FPGA isolation.rs (`a_forged_free_fails_and_the_owner_keeps_its_chunk`): the victim's
/// entry, a free group's, inside an entry, outside and past the table; the owner's entry, data
/// and windows never change, each refusal is typed, only real entries count as forged frees.
fn forged_free_any_address(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(2, 16));
    let victim = t.alloc(0)?;
    assert_eq!(t.write(0, &victim, 0, 0, b"owner's data"), WcStatus::Success);
    let own = t.alloc(1)?;
    let map = t.mn_map();
    let free_group = map.entry_addr(GroupId(t.spec().chunks - 1)).unwrap();
    assert!(free_group != victim.entry_addr && free_group != own.entry_addr);
    let forged = [
        ("the victim's entry", victim.entry_addr, ErrorCode::NotOwner),
        ("a free group's entry", free_group, ErrorCode::NotOwner),
        ("inside the victim's entry", victim.entry_addr + 8, ErrorCode::NotOwner),
        ("outside the table (the queue)", map.meta_base, ErrorCode::BadRequest),
        ("past the table", map.table_base + map.table_len(), ErrorCode::BadRequest),
    ];
    let g = t.group_of(&victim).unwrap();
    let entry_before = t.entry(g);
    let windows = |t: &mut dyn Testbed| [victim.owner_rkey, victim.rkeys[0], victim.rkeys[1]].map(|k| t.mw_binding(k));
    let windows_before = windows(&mut *t);
    let pool = (map.geometry.base(), map.geometry.chunk_size() as usize * t.spec().chunks as usize);
    let pool_before = t.mn_read(pool.0, pool.1);
    for (what, addr, code) in forged {
        let forged_before = t.stats().forged_frees;
        let r = t.free_entry(1, addr);
        // the MN may count a forged free of a non-entry differently, but it always refuses
        match (r, code) {
            (Err(Refusal::Mn(c)), ErrorCode::NotOwner) => assert_eq!(c, code, "{what}"),
            (Err(Refusal::Mn(c)), _) => {
                assert!(matches!(c, ErrorCode::BadRequest | ErrorCode::NotOwner), "{what}: {c:?}")
            }
            (r, _) => panic!("{what}: {r:?}"),
        }
        t.tick();
        assert_eq!(t.entry(g), entry_before, "{what}: the victim's entry changed");
        assert_eq!(windows(&mut *t), windows_before, "{what}: the victim's windows changed");
        assert!(t.mn_read(pool.0, pool.1) == pool_before, "{what}: the pool changed");
        let n = t.stats().forged_frees - forged_before;
        if code == ErrorCode::NotOwner {
            assert_eq!(n, 1, "{what}: counted as a forged free");
        }
        invariants(&mut *t, what);
        let (st, got) = t.read(0, &victim, 1, 0, 12);
        assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"owner's data"[..]), "{what}");
    }
    // both chains still serve their owners
    t.free(1, &own)?;
    t.free(0, &victim)?;
    t.tick();
    assert_eq!(t.entry(g).unwrap().owner(), 0);
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_security.rs, FPGA isolation.rs, rxe_cluster.rs and the state machine.
fn stale_rkey(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 4).quota(16));
    let a = t.alloc(0)?;
    t.free(0, &a)?;
    for q in 0..2 {
        let st = t.read_raw(0, q, a.base, a.rkey(q).unwrap(), 8).0;
        assert_eq!(st, WcStatus::RemAccessErr, "stale rkey {q}");
    }
    // the same chunk reallocated (to B) has a new key; A's old one still fails
    let mut again = None;
    for _ in 0..4 {
        let b = t.alloc(1)?;
        if b.base == a.base {
            again = Some(b);
            break;
        }
    }
    let b = again.expect("chunk reused");
    assert_ne!(b.rkey(0), a.rkey(0));
    let g = t.group_of(&b).unwrap();
    let e = t.entry(g).unwrap();
    assert_eq!(b.rkey(0), Some(a.rkey(0).unwrap().next_key()), "rebound with the next key");
    assert_eq!(e.rkey(1), b.rkey(0).unwrap());
    let st = t.write_raw(0, 0, a.base, a.rkey(0).unwrap(), b"stale");
    denied(&*t, st, "A's stale rkey on B's chunk");
    assert_eq!(t.write(1, &b, 0, 0, b"fresh"), WcStatus::Success);
    invariants(&mut *t, "after");
    Ok(())
}

/// From FPGA isolation.rs (`stale_rkeys_after_a_free_are_refused`): the former owner tries every
/// key byte of every window index of its old group through each of its QPs, reading and writing.
fn stale_rkey_walk(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(2, 16));
    let a = t.alloc(0)?;
    t.free(0, &a)?;
    assert_ne!(
        t.cn_post(0, CnQp::Free, Wqe::read(0, 0, 8, a.base, a.owner_rkey.0)),
        WcStatus::Success,
        "MW[0] through the Free QP"
    );
    let g = t.group_of(&a).unwrap();
    let b = loop {
        let r = t.alloc(1)?;
        if t.group_of(&r) == Some(g) {
            break r;
        }
    };
    assert_eq!(t.write(1, &b, 0, 0, b"next owner's"), WcStatus::Success);
    let mut tried = 0;
    let windows: Vec<Rkey> = [a.owner_rkey].into_iter().chain(a.rkeys.iter().copied()).collect();
    for k in &windows {
        for byte in 0..=255u8 {
            let rk = Rkey::new(k.index(), byte).unwrap().0;
            for qp in [CnQp::Alloc, CnQp::Free, CnQp::Access(0), CnQp::Access(1)] {
                for w in [Wqe::read(0, 0, 8, a.base, rk), Wqe::write(0, 0, 8, a.base, rk)] {
                    assert_ne!(t.cn_post(0, qp, w), WcStatus::Success, "key {rk:#x} through {qp:?}");
                    tried += 1;
                }
            }
        }
    }
    assert_eq!(tried, windows.len() * 256 * 4 * 2);
    let (st, got) = t.read(1, &b, 1, 0, 12);
    assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"next owner's"[..]));
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_security.rs.
fn walk_256(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 8).quota(16));
    let a = t.alloc(0)?;
    assert_eq!(t.write(0, &a, 0, 0, b"A's data"), WcStatus::Success);
    let idx = a.rkey(0).unwrap().index();
    for key in 0..=255u8 {
        let rk = Rkey::new(idx, key).unwrap();
        assert_eq!(t.read_raw(1, 0, a.base, rk, 8).0, WcStatus::RemAccessErr, "key {key}");
        assert_eq!(t.write_raw(1, 1, a.base, rk, b"brute!!!"), WcStatus::RemAccessErr, "key {key}");
    }
    let (st, got) = t.read(0, &a, 0, 0, 8);
    assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"A's data"[..]));
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_security.rs. Offloaded chains bind access windows to whatever QPs the request
/// names (DESIGN.md §2); the MN's audit reclaims such a group; the host engine refuses outright.
fn foreign_qp(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 8).quota(16));
    let victim = t.access_qpns(1);
    let own = t.access_qpns(0);
    let r = t.alloc_naming(0, &[victim[0], own[1]]);
    match t.mode() {
        ExecutionMode::HostEngine => {
            assert_eq!(r, Err(Refusal::Mn(ErrorCode::AllocFailed)));
            invariants(&mut *t, "refused");
        }
        // chains that bind only to the poster: the device refused the bind naming the
        // victim's QP (the lap failed, nothing was handed out) ...
        _ if t.windows_on_alloc_qp(0) && r == Err(Refusal::Mn(ErrorCode::AllocFailed)) => {
            invariants(&mut *t, "the foreign bind refused");
        }
        _ => {
            let a = r?;
            assert_eq!(t.read_raw(1, 0, a.base, Rkey(a.rkey(0).unwrap().0 ^ 1), 8).0, WcStatus::RemAccessErr);
            let home = t.mgmt_qpns(0)[0];
            let at_home = matches!(t.mw_binding(a.rkeys[0]), Some(MwBinding::Bound { qpn, .. }) if qpn == home);
            if t.windows_on_alloc_qp(0) && at_home {
                // ... or bound it to the poster, the CN's own Alloc QP: nothing misbound
                invariants(&mut *t, "bound to the poster");
                t.free(0, &a)?;
            } else {
                assert!(t.check_invariants().is_err(), "window bound outside its owner's QPs");
                t.tick();
                invariants(&mut *t, "audited");
                assert_eq!(t.write(0, &a, 1, 0, b"gone"), WcStatus::RemAccessErr);
            }
        }
    }
    assert_eq!(t.unallocated(), 8);
    t.alloc(1)?;
    Ok(())
}

/// From loopback_security.rs and the state machine's garbage.
fn garbage_requests(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 8).quota(16));
    let a = t.alloc(0)?;
    let patterns: Vec<Vec<u8>> =
        vec![vec![], vec![0xFF; 3], vec![0; 28], (0..28u32).map(|i| (i * 37) as u8).collect(), vec![0xAB; 200], {
            // a well-formed header with a garbage reply address and QPNs
            let mut v = vec![0x4F, 0x4D, 1, 1, 7, 0, 0, 0];
            v.extend_from_slice(&[0xEE; 20]);
            v
        }];
    for p in &patterns {
        t.send_raw(2, ChainKind::Alloc, p);
        invariants(&mut *t, &format!("alloc bytes {p:?}"));
        t.send_raw(2, ChainKind::Free, p);
        invariants(&mut *t, &format!("free bytes {p:?}"));
    }
    // honest CNs keep working
    assert_eq!(t.write(0, &a, 0, 0, b"ok"), WcStatus::Success);
    let b = t.alloc(1)?;
    t.free(1, &b)?;
    let c = t.alloc(2)?;
    t.free(2, &c)?;
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_security.rs: corrupt the next request of an honest CN in flight.
fn corrupted_in_flight(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 8).quota(16));
    let a = t.alloc(0)?;
    t.corrupt_next(1, 12);
    let r = t.alloc(1);
    invariants(&mut *t, "corrupted");
    if let Ok(x) = r {
        t.free(1, &x)?;
    }
    assert_eq!(t.write(0, &a, 0, 0, b"ok"), WcStatus::Success);
    let b = t.alloc(1)?;
    t.free(1, &b)?;
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_security.rs and rxe_cluster.rs ("its own rkey but an address outside its chunk").
fn per_chunk_mrs(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(2, 16));
    assert_eq!(t.mode(), ExecutionMode::HostEngine, "no offload on an rxe-like device");
    let a = t.alloc(0)?;
    // out of the window but inside the pool: the chunk's own MR stops it
    assert_eq!(t.read_raw(0, 0, a.base + a.length, a.rkey(0).unwrap(), 8).0, WcStatus::RemAccessErr);
    assert_eq!(t.free_entry(1, a.entry_addr), Err(Refusal::Mn(ErrorCode::NotOwner)), "software ownership check");
    invariants(&mut *t, "after");
    Ok(())
}

/// Every verb a CN can aim at remote memory, at `addr` with `rkey`, from its own buffer.
fn attacks(addr: u64, rkey: u32) -> [Wqe; 5] {
    const MARK: u64 = 0xDEAD_BEEF_0BAD_F00D;
    let a = addr & !7;
    [
        Wqe::read(0, 0, 8, addr, rkey),
        Wqe::write(0, 0, 8, addr, rkey),
        Wqe::fetch_add(0, 0, a, rkey, MARK),
        Wqe::compare_swap(0, 0, a, rkey, 0, MARK),
        Wqe::masked_fetch_add(0, 0, a, rkey, MARK, 0),
    ]
}

/// From loopback_isolation.rs and FPGA isolation.rs: every MN MR, at its start, middle and end,
/// through every CN QP, with every verb and the MR's exact key; every key byte of every MR index
/// from an access QP. Nothing of the MN's changes; everyone keeps working.
fn mn_private_memory(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 4));
    let victim = t.alloc(0)?;
    assert_eq!(t.write(0, &victim, 0, 0, b"victim's"), WcStatus::Success);
    let g = t.group_of(&victim).unwrap();
    let mrs = t.mn_mrs();
    assert!(mrs.len() >= 4, "the MN registers metadata, table, rings, pool");
    // control: the attacker's verbs work on what is its own (before the owners are noted: the
    // group it frees goes to whichever parked alloc chain pops it first — with more chains
    // than groups, maybe another CN's)
    let own = t.alloc(1)?;
    let rk = own.rkey(0).unwrap().0;
    assert_eq!(t.cn_post(1, CnQp::Access(0), Wqe::write(0, 0, 8, own.base, rk)), WcStatus::Success, "control");
    assert_eq!(t.cn_post(1, CnQp::Access(0), Wqe::read(0, 0, 8, own.base, rk)), WcStatus::Success, "control");
    t.free(1, &own)?;
    t.tick();
    let entry_before = t.entry(g).unwrap();
    let owners_before: Vec<u32> = (0..t.spec().chunks).map(|k| t.entry(GroupId(k)).unwrap().owner()).collect();
    let map = t.mn_map();
    let windows = |t: &mut dyn Testbed| [victim.owner_rkey, victim.rkeys[0], victim.rkeys[1]].map(|k| t.mw_binding(k));
    let windows_before = windows(&mut *t);
    let pool = (map.geometry.base(), map.geometry.chunk_size() as usize * t.spec().chunks as usize);
    let pool_before = t.mn_read(pool.0, pool.1);
    for mr in &mrs {
        let targets = [mr.addr, mr.addr + ((mr.len / 2) & !7), (mr.addr + mr.len).saturating_sub(8)];
        for at in targets {
            for qp in [CnQp::Alloc, CnQp::Free, CnQp::Access(0), CnQp::Access(1)] {
                for w in attacks(at, mr.key) {
                    let st = t.cn_post(1, qp, w);
                    assert_ne!(
                        st,
                        WcStatus::Success,
                        "{:?} through {qp:?} at {at:#x} with the MN's key of {mr:?}",
                        w.opcode
                    );
                }
            }
        }
    }
    // a guessing attacker: every key byte of every MN MR index, with every verb, through every
    // CN QP (FPGA isolation.rs's walk)
    let mut tried = 0;
    for mr in &mrs {
        let idx = mr.key >> 8;
        for key in 0..=255u32 {
            let rk = (idx << 8) | key;
            for qp in [CnQp::Alloc, CnQp::Free, CnQp::Access(0), CnQp::Access(1)] {
                for w in attacks(mr.addr, rk) {
                    assert_ne!(
                        t.cn_post(1, qp, w),
                        WcStatus::Success,
                        "{:?} through {qp:?} with key {rk:#x} of {mr:?}",
                        w.opcode
                    );
                    tried += 1;
                }
            }
        }
    }
    assert_eq!(tried, mrs.len() * 256 * 4 * 5);
    // nothing of the MN's changed: the victim's entry, its data, the metadata; everyone works
    assert_eq!(t.entry(g).unwrap(), entry_before, "the victim's MWTable entry changed");
    for (k, owner) in owners_before.iter().enumerate() {
        assert_eq!(t.entry(GroupId(k as u32)).unwrap().owner(), *owner, "group {k}'s owner");
    }
    let (st, got) = t.read(0, &victim, 0, 0, 8);
    assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"victim's"[..]));
    let mark = 0xDEAD_BEEF_0BAD_F00Du64.to_le_bytes();
    for mr in &mrs {
        let bytes = t.mn_read(mr.addr, mr.len as usize);
        assert!(!bytes.windows(4).any(|w| w == &mark[..4] || w == &mark[4..]), "the mark landed in {mr:?}");
    }
    assert_eq!(windows(&mut *t), windows_before, "the victim's windows changed");
    assert!(t.mn_read(pool.0, pool.1) == pool_before, "the pool changed");
    invariants(&mut *t, "after the attacks");
    let b = t.alloc(1).unwrap_or_else(|e| panic!("the attacker's own service broke: {e}"));
    t.free(1, &b)?;
    t.free(0, &victim)?;
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_isolation.rs (`host_engine_registers_no_remote_rights_on_mn_memory`) and FPGA
/// isolation.rs (`the_mn_is_provisioned_in_two_domains_through_the_plan`): host engine, no
/// remote right on MN memory at all; offloaded, remote rights only in the private domain.
fn remote_rights(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(1, 4));
    let host_engine = t.mode() == ExecutionMode::HostEngine;
    for mr in t.mn_mrs() {
        if host_engine {
            assert!(!mr.remote, "host engine: {mr:?} has remote rights");
        } else {
            assert!(!mr.remote || mr.private, "offloaded: {mr:?} remote outside the private domain");
        }
    }
    Ok(())
}

/// From loopback_isolation.rs and FPGA isolation.rs (`no_mn_key_in_any_message_to_a_cn`): every
/// kind of message, no MN MR key in any of them.
fn no_key_in_messages(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 3));
    let keys: Vec<u32> = t.mn_mrs().iter().map(|m| m.key).collect();
    let mut held = super::drain(&mut *t, 0);
    // cn1 drains what is left (a group its alloc chain popped ahead), then hears "empty"
    let of_cn1 = super::drain(&mut *t, 1);
    let _ = t.alloc(1); // empty
    let _ = t.free_entry(2, held[0].entry_addr); // not the owner
    t.send_raw(2, ChainKind::Free, b"garbage bytes"); // bad request
    for a in &held {
        t.free(0, a)?;
    }
    for a in &of_cn1 {
        t.free(1, a)?;
    }
    t.tick(); // available
    held.push(t.alloc(1)?);
    let mut kinds = std::collections::BTreeSet::new();
    for i in 0..3 {
        let got = t.received(i);
        assert!(!got.is_empty());
        for b in &got {
            if let Ok(r) = AllocReply::decode(b) {
                assert_eq!(r.entry.lkey.get(), 0, "cn{i} got the MN's MR key {:#x}", r.entry.lkey.get());
                for k in 0..3 {
                    assert!(!keys.contains(&r.entry.rkey(k).0), "an MR key in a reply's rkeys");
                }
                kinds.insert("reply".to_string());
                continue;
            }
            for (off, w) in b.windows(4).enumerate() {
                let v = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                assert!(!keys.contains(&v) || v < 0x100, "cn{i} received an MN MR key {v:#x} at +{off} of {b:02x?}");
            }
            let kind = match MnMessage::decode(b).unwrap_or_else(|e| panic!("cn{i}: undecodable {b:02x?}: {e:?}")) {
                MnMessage::ConnectInfo(_) => "connect info".to_string(),
                MnMessage::Error(e) => format!("error {:?}", e.code),
                MnMessage::Notice(Notice::Empty) => "empty".into(),
                MnMessage::Notice(Notice::Available { .. }) => "available".into(),
                m => format!("{m:?}"),
            };
            kinds.insert(kind);
        }
    }
    for k in ["connect info", "reply", "empty", "available", "error NotOwner"] {
        assert!(kinds.contains(k), "no {k} message was exercised: {kinds:?}");
    }
    assert!(kinds.contains("error Empty") || t.mode() == ExecutionMode::HostEngine || kinds.contains("empty"));
    Ok(())
}

/// From loopback_isolation.rs (`stale_window_keys_are_not_mr_keys`): every index a CN sees is
/// a window's, never an MR's.
fn window_keys_not_mr_keys(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(1, 2));
    let a = t.alloc(0)?;
    let mrs: Vec<u32> = t.mn_mrs().iter().map(|m| m.key >> 8).collect();
    for k in [a.owner_rkey].into_iter().chain(a.rkeys.iter().copied()) {
        assert!(!mrs.contains(&k.index()), "window key {k:?} has an MR's index");
    }
    Ok(())
}

/// From loopback_isolation.rs and FPGA isolation.rs (`after_an_offloaded_free_the_next_owner_reads_zeros`).
fn scrub_free(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(2, 2));
    let a = t.alloc(0)?;
    let g = t.group_of(&a).unwrap();
    soil(&mut *t, 0, &a);
    let scrubbed = t.stats().chunks_scrubbed;
    t.free(0, &a)?;
    let got = reread(&mut *t, 1, g, "free");
    assert!(got.iter().all(|b| *b == 0), "the next owner reads the last one's bytes");
    if t.mode() == ExecutionMode::Offloaded {
        assert_eq!(t.stats().chunks_scrubbed, scrubbed, "offloaded: the NIC scrubbed, not the MN CPU");
    }
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_isolation.rs.
fn scrub_crash(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(2, 2));
    let a = t.alloc(0)?;
    let g = t.group_of(&a).unwrap();
    soil(&mut *t, 0, &a);
    t.crash(0);
    let got = reread(&mut *t, 1, g, "crash");
    assert!(got.iter().all(|b| *b == 0), "the next owner reads the crashed one's bytes");
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_isolation.rs.
fn scrub_reset(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(2, 2));
    let a = t.alloc(0)?;
    let g = t.group_of(&a).unwrap();
    soil(&mut *t, 0, &a);
    t.reset_mn_rnic();
    let got = reread(&mut *t, 1, g, "RNIC reset");
    assert!(got.iter().all(|b| *b == 0), "the next owner reads the revoked one's bytes");
    invariants(&mut *t, "after");
    Ok(())
}

/// From loopback_isolation.rs: offloaded lazy quota, the over-quota CN loses everything, the
/// chunks come back clean.
fn scrub_quota(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(2, 3).quota(1));
    let a = t.alloc(0)?;
    soil(&mut *t, 0, &a);
    let b = t.alloc(0)?;
    soil(&mut *t, 0, &b);
    let (ga, gb) = (t.group_of(&a).unwrap(), t.group_of(&b).unwrap());
    t.audit(); // finds cn0 over its quota and reclaims both
    assert!(reread(&mut *t, 1, ga, "quota").iter().all(|b| *b == 0));
    assert!(reread(&mut *t, 1, gb, "quota").iter().all(|b| *b == 0));
    Ok(())
}

/// From loopback_isolation.rs and FPGA isolation.rs (`with_scrubbing_off_the_residue_is_there`):
/// the control for the scrub scenarios.
fn scrub_off(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(2, 1).scrub(false));
    let a = t.alloc(0)?;
    soil(&mut *t, 0, &a);
    t.free(0, &a)?;
    // its next owner: cn1 — or cn0 again, where its alloc chain popped the freed group ahead
    let g = t.group_of(&a).unwrap();
    let got = super::reread(&mut *t, 1, g, "scrub off");
    assert_eq!(got[..8], [0x5A; 8], "with scrubbing off the residue is there (so the scrub scenarios can fail)");
    Ok(())
}

/// From loopback_isolation.rs (issue 10 §7), one scenario per mode: MN memory corrupted so an MWTable entry spans more
/// than its chunk. The host engine refuses to bind it; offloaded, the audit reclaims the group.
fn corrupted_span(f: &dyn Factory) -> Outcome {
    use zerocopy::IntoBytes;
    let mut t = f.start(MnSpec::new(3, 4));
    let map = t.mn_map();
    for g in 0..4 {
        let addr = map.entry_addr(GroupId(g)).unwrap();
        let mut e = t.entry(GroupId(g)).unwrap();
        e.length = (2 * e.length.get()).into();
        t.mn_write(addr, e.as_bytes());
    }
    // (a group an alloc chain popped before the corruption is bound as it was read: allocate
    // until one popped after it comes, or the CN refuses the reply)
    let mut clean = Vec::new();
    let mut r = t.alloc(0);
    while t.mode() == ExecutionMode::Offloaded && r.is_ok() {
        clean.extend(r.ok());
        r = t.alloc(0);
    }
    if t.mode() == ExecutionMode::Offloaded && t.stats().groups_reclaimed == 0 {
        t.tick();
        if t.stats().spans_refused == 0 && !clean.is_empty() {
            // every group had been popped before the corruption (more alloc chains than
            // groups: several per CN, popping ahead) and nothing corrupted was bound: give the
            // clean ones back — they are popped again, now from the corrupted entries — and
            // allocate again
            for a in clean.drain(..) {
                t.free(0, &a)?;
            }
            t.tick();
            r = t.alloc(0);
            while r.is_ok() {
                clean.extend(r.ok());
                r = t.alloc(0);
            }
        }
    }
    if t.mode() == ExecutionMode::Offloaded {
        // the NIC bound the corrupted span (the CN's client refuses a reply whose length is
        // not the chunk size, if it got one) and the next audit takes the windows away — or,
        // where the doubled span leaves the pool (the last chunk), the bind itself failed and
        // the lap was repaired
        let failed_before = t.stats().groups_reclaimed;
        t.tick();
        let audited = t.stats().spans_refused >= 1;
        assert!(audited || failed_before >= 1, "the audit saw nothing and no lap failed");
        if let Ok(a) = r {
            assert_eq!(t.read(0, &a, 0, 0, 8).0, WcStatus::RemAccessErr, "the window survived");
        }
        // no group of the corrupted table is left allocated with its windows bound: owned only
        // where an alloc chain popped it ahead (its windows not bound yet)
        let clean: Vec<GroupId> = clean.iter().filter_map(|a| t.group_of(a)).collect();
        for g in 0..4u32 {
            let e = t.entry(GroupId(g)).unwrap();
            if clean.contains(&GroupId(g)) {
                continue; // bound from the entry as it was before the corruption: its own chunk
            }
            if e.owner() != 0 && t.caps().contains(Caps::WINDOW_STATE) {
                for k in 0..3 {
                    assert_eq!(
                        t.mw_binding(e.rkey(k)),
                        Some(omw_core::device::MwBinding::Unbound),
                        "group {g} with a corrupted span stayed allocated"
                    );
                }
            } else {
                assert_eq!(e.owner(), 0, "a group with a corrupted span stayed allocated");
            }
        }
    } else {
        assert!(r.is_err(), "the host engine bound a span that is not one chunk");
    }
    Ok(())
}

/// The new key CN `cn` was told for window `mw` of `a` (the last one, if several).
fn rekeyed(t: &mut dyn Testbed, cn: usize, a: &Allocation, mw: u8) -> Option<Rkey> {
    t.heard(cn).iter().rev().find_map(|h| match h {
        Heard::Rekeyed { entry_addr, mw: m, rkey } if *entry_addr == a.entry_addr && *m == mw => Some(*rkey),
        _ => None,
    })
}

/// CN `cn`'s client's current copy of `a` (its keys as the client would use them now).
fn current(t: &mut dyn Testbed, cn: usize, a: &Allocation) -> Allocation {
    t.live(cn).into_iter().find(|l| l.entry_addr == a.entry_addr).expect("the CN still holds the allocation")
}

/// Issue 20 item 5, soft-RoCE's `rxe_invalidate_mw` checks no QP: an attacker's SEND_WITH_INV
/// naming a victim's window on the attacker's own Alloc QP revokes it. The attacker is given
/// the exact rkeys (the defence must not rest on key secrecy; a real one guesses the key byte
/// in ~128 tries) and only bound windows are named (a free window's key panics rxe's kernel).
/// rxe: the receive completion reports the invalidation; the MN evicts the attacker and binds
/// the window again for the victim under the next key, telling it; the victim's retried access
/// returns its bytes, its other window never changed, its free still proves ownership (MW[0]
/// restored too). Strict devices refuse the invalidation (not the window's QP): nothing changes.
fn foreign_invalidation(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(3, 8));
    let victim = t.alloc(0)?;
    let pattern: Vec<u8> = (0..64u8).map(|i| i ^ 0xA5).collect();
    assert_eq!(t.write(0, &victim, 0, 0, &pattern), WcStatus::Success);
    assert_eq!(t.write(0, &victim, 1, 256, &pattern), WcStatus::Success);
    let before = t.stats();
    let rk = victim.rkey(0).unwrap();
    let st = t.send_with_inv(1, CnQp::Alloc, rk);
    if !t.caps().contains(Caps::RXE_MW) {
        // the spec: only the bound QP invalidates; the responder's receive fails (class J)
        assert_ne!(st, WcStatus::GeneralErr, "the SEND was posted");
        if t.caps().contains(Caps::WINDOW_STATE) {
            assert!(matches!(t.mw_binding(rk), Some(MwBinding::Bound { rkey, .. }) if rkey == rk), "still bound");
        }
        assert_eq!(t.stats().remote_invalidations, before.remote_invalidations, "nothing was invalidated");
        let (st, got) = t.read(0, &victim, 0, 0, 64);
        assert_eq!((st, got), (WcStatus::Success, pattern.clone()), "the victim's window is untouched");
        invariants(&mut *t, "strict: refused");
        t.free(0, &victim)?;
        invariants(&mut *t, "strict: after");
        return Ok(());
    }
    // rxe: the requester's SEND succeeds, the window was revoked, and the MN saw it
    assert_eq!(st, WcStatus::Success, "rxe accepts a SEND_WITH_INV naming any window");
    let s = t.stats();
    assert_eq!(s.remote_invalidations, before.remote_invalidations + 1, "the MN saw the invalidation");
    assert_eq!(s.foreign_invalidations, before.foreign_invalidations + 1, "and found it foreign");
    assert_eq!(s.windows_restored, before.windows_restored + 1, "the victim's window was bound again");
    assert_eq!(s.cns_evicted, before.cns_evicted + 1, "the attacker was evicted");
    assert!(!t.is_served(1), "the attacker is no longer served");
    assert!(t.is_served(0), "the victim is still served");
    let new = rekeyed(&mut *t, 0, &victim, 1).expect("the victim was told its window's new key");
    assert_eq!(new, rk.next_key(), "the next key of the same window (ibv_inc_rkey)");
    let now = current(&mut *t, 0, &victim);
    assert_eq!(
        (now.base, now.length, now.rkey(0), now.rkey(1)),
        (victim.base, victim.length, Some(new), victim.rkey(1))
    );
    if t.caps().contains(Caps::WINDOW_STATE) {
        let qpn = t.access_qpns(0)[0];
        assert_eq!(t.mw_binding(new), Some(MwBinding::Bound { rkey: new, qpn }), "bound to the victim's QP again");
    }
    // the victim's retried accesses: its bytes, through the restored window and the other one
    let (st, got) = t.read(0, &now, 0, 0, 64);
    assert_eq!((st, got), (WcStatus::Success, pattern.clone()), "the retried READ returns the victim's bytes");
    let (st, got) = t.read(0, &now, 1, 256, 64);
    assert_eq!((st, got), (WcStatus::Success, pattern.clone()), "the other window never changed");
    assert_eq!(t.write(0, &now, 0, 128, b"after"), WcStatus::Success);
    invariants(&mut *t, "rxe: access window restored");
    // a second attacker revokes the victim's MW[0] (its ownership proof, on the Free QP)
    let before = t.stats();
    assert_eq!(t.send_with_inv(2, CnQp::Alloc, victim.owner_rkey), WcStatus::Success);
    assert_eq!(t.stats().windows_restored, before.windows_restored + 1);
    assert!(!t.is_served(2), "the second attacker is evicted too");
    let new0 = rekeyed(&mut *t, 0, &victim, 0).expect("told MW[0]'s new key");
    assert_eq!(new0, victim.owner_rkey.next_key());
    let now = current(&mut *t, 0, &victim);
    assert_eq!(now.owner_rkey, new0);
    invariants(&mut *t, "rxe: MW[0] restored");
    // the attackers held nothing; the victim still owns its chunk and frees it normally
    let free_before = t.unallocated();
    t.free(0, &now)?;
    assert_eq!(t.unallocated(), free_before + 1, "the victim's free proved ownership");
    invariants(&mut *t, "rxe: after the victim's free");
    let again = t.alloc(0)?;
    assert_eq!(t.read(0, &again, 0, 0, 8).0, WcStatus::Success);
    Ok(())
}

/// The same attack on the sender's own window (rxe: it is revoked; strict: it is the bound
/// QP only for MW[0] on the Free QP, so the access window is refused). A CN revoking its own
/// window is not evicted — the request is a bad one, counted against it, and not served — and
/// the MN binds the window again (the table and the device agree again, its free still works),
/// telling the CN the new key.
fn own_invalidation(f: &dyn Factory) -> Outcome {
    let mut t = f.start(MnSpec::new(2, 8));
    let a = t.alloc(0)?;
    assert_eq!(t.write(0, &a, 0, 0, b"own bytes"), WcStatus::Success);
    let before = t.stats();
    let rk = a.rkey(1).unwrap();
    let st = t.send_with_inv(0, CnQp::Alloc, rk);
    let s = t.stats();
    assert!(t.is_served(0), "a CN revoking its own window is not evicted");
    assert_eq!(s.foreign_invalidations, before.foreign_invalidations);
    assert_eq!(s.cns_evicted, before.cns_evicted);
    let now = if t.windows_on_alloc_qp(0) {
        // its windows live on its Alloc QP: the SEND_WITH_INV there revoked its own window,
        // which the MN cannot bind again from its own QP on such a device — the group is taken
        // back (the CN told), the CN stays served and nobody else is touched
        assert_eq!(st, WcStatus::Success);
        assert_eq!(s.remote_invalidations, before.remote_invalidations + 1);
        assert_eq!(t.read(0, &a, 1, 0, 9).0, WcStatus::RemAccessErr, "taken back");
        invariants(&mut *t, "after its own invalidation");
        let b = t.alloc(0)?;
        assert_eq!(t.write(0, &b, 0, 0, b"own bytes"), WcStatus::Success);
        t.free(0, &b)?;
        invariants(&mut *t, "after");
        return Ok(());
    } else if t.caps().contains(Caps::RXE_MW) {
        assert_eq!(st, WcStatus::Success);
        assert_eq!(s.remote_invalidations, before.remote_invalidations + 1);
        assert_eq!(s.windows_restored, before.windows_restored + 1);
        let new = rekeyed(&mut *t, 0, &a, 2).expect("told its window's new key");
        assert_eq!(new, rk.next_key());
        let now = current(&mut *t, 0, &a);
        assert_eq!((now.rkey(0), now.rkey(1)), (a.rkey(0), Some(new)));
        now
    } else {
        assert_eq!(s.remote_invalidations, before.remote_invalidations, "refused: not the window's QP");
        a.clone()
    };
    let (st, got) = t.read(0, &now, 1, 0, 9);
    assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"own bytes"[..]), "its chunk and bytes kept");
    invariants(&mut *t, "after its own invalidation");
    // its management QPs serve it as before
    let b = t.alloc(0)?;
    t.free(0, &b)?;
    t.free(0, &now)?;
    invariants(&mut *t, "after");
    Ok(())
}
