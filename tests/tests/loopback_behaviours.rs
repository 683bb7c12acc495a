//! The conformance scenarios on the loopback model in mlx5 form under the device behaviours of
//! `omw_core::device::behaviour` — the open CORE-Direct questions the model executes either
//! way. A report, not a verdict: the matrix says which scenarios fail under which answers
//! (run with `-- --nocapture` to see it). Every behaviour some chain variant claims
//! (`ChainVariant::choose`) must pass everything with the variant the MN chose for it; the
//! rest is the report of what breaks where no variant is correct. `OMW_SCENARIO=name` narrows
//! the list.

use omw_core::chain::variant::ChainVariant;
use omw_core::device::behaviour::{DeviceAnswers, DeviceBehaviour};
use omw_tests::loopback::Loopback;
use omw_tests::{matrix, scenarios, Mode};

fn mlx5(b: DeviceBehaviour) -> Box<dyn omw_tests::testbed::Factory> {
    Box::new(Loopback(Mode::OffloadedMlx5).with_behaviour(b))
}

/// Every row whose behaviour a variant claims passed every scenario it ran.
fn claimed_rows_pass(rows: &[matrix::Row]) -> usize {
    let mut claimed = 0;
    for r in rows {
        if ChainVariant::choose(&DeviceAnswers::exactly(r.behaviour)).is_ok() {
            claimed += 1;
            assert!(r.summary.failed.is_empty(), "under {}: {:?}", matrix::label(&r.behaviour), r.failed());
        }
    }
    assert!(claimed > 0, "no behaviour is claimed by a variant");
    claimed
}

/// PAPER and the six behaviours one answer away from it, two at a time: every one is claimed by
/// a variant and must pass.
#[test]
fn paper_and_its_single_deviations_in_mlx5_form() {
    let list = scenarios::all();
    let rows = matrix::run(&matrix::paper_and_single_deviations(), &list, 2, mlx5);
    println!("{}", matrix::render("loopback, mlx5 form", &list, &rows));
    // every one has a variant since the layouts that bind to the poster
    assert_eq!(claimed_rows_pass(&rows), rows.len());
    let paper = rows.iter().find(|r| r.behaviour == DeviceBehaviour::PAPER).expect("PAPER ran");
    assert!(!paper.summary.passed.is_empty() || std::env::var_os("OMW_SCENARIO").is_some(), "no scenario ran");
}

/// All 48 behaviours (about 48 conformance runs: ten minutes and more on two cores).
#[test]
#[ignore = "48 conformance runs; run with `--ignored --nocapture` for the whole matrix"]
fn every_behaviour_in_mlx5_form() {
    let list = scenarios::all();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rows = matrix::run(&DeviceBehaviour::ALL, &list, threads, mlx5);
    println!("{}", matrix::render("loopback, mlx5 form, every behaviour", &list, &rows));
    assert_eq!(claimed_rows_pass(&rows), 48);
}

/// The chains rest on one more device answer no layout varies over (`UncheckedUnbind`, docs/
/// MLX5.md question 21): the free chain unbinds the group's access windows from the CN's Free
/// QP — and the MN its own unbinds from its admin QP — with the UMR invalidate that asks no
/// QPN check. With the answer the MN relies on, a free lands and the freed chunk is out of
/// reach. On a device that checks the QPN anyway the chain's unbind fails, so does the MN's
/// own in its repair, and the window stays bound to the CN that freed it: the MN's checked push
/// refuses the group and quarantines it — nobody else is handed a chunk its last owner can
/// still reach, but every free then loses a group. That is why the MN does not offload without
/// the answer (`omw_verbs::devx::mn::chain_answers`, profile key `unchecked_unbind`).
#[test]
fn offloaded_frees_need_the_unchecked_unbind() {
    use omw_core::device::behaviour::UncheckedUnbind;
    use omw_core::device::{ExecutionMode, WcStatus};
    use omw_core::wire::wqe_format::WqeFormat;
    use omw_loopback::cluster::{Cluster, ClusterConfig};
    for answer in [UncheckedUnbind::Honoured, UncheckedUnbind::Refused] {
        let mut cfg = ClusterConfig::paper_like().with_wqe_format(WqeFormat::Mlx5);
        (cfg.cns, cfg.chunks, cfg.chunk_size, cfg.quota) = (1, 16, 512, 16);
        cfg.mode = Some(ExecutionMode::Offloaded);
        cfg.nic = cfg.nic.with_unchecked_unbind(answer);
        let mut c = Cluster::new(cfg).unwrap();
        let a = c.alloc(0).unwrap();
        let free_before = c.free_groups();
        let _ = c.free(0, &a);
        c.advance(5_000_000).unwrap();
        let stale = c.read(0, &a, 0, 0, 8).0;
        let s = c.driver.mn.stats();
        match answer {
            UncheckedUnbind::Honoured => {
                assert_eq!(stale, WcStatus::RemAccessErr, "the freed chunk is out of reach");
                assert_eq!(c.free_groups(), free_before + 1, "the group is back in the queue");
                assert_eq!((s.pushes_refused, s.groups_quarantined), (0, 0));
                assert_eq!(c.driver.stats.unbinds_refused, 0);
                c.check_invariants().unwrap();
            }
            UncheckedUnbind::Refused => {
                assert_eq!(stale, WcStatus::Success, "the window stayed bound to the CN that freed it");
                assert_eq!((s.pushes_refused, s.groups_quarantined), (1, 1), "{s:?}");
                // and the MN's own unbind in its repair was refused too: counted, so an operator
                // sees why groups go to quarantine
                assert!(c.driver.stats.unbinds_refused >= 1, "{:?}", c.driver.stats);
                assert_eq!(c.free_groups(), free_before, "never pushed: nobody else is handed it");
                // the one invariant broken is the quarantined group's bound window
                let e = c.check_invariants().unwrap_err();
                assert!(e.contains("FreeGroupBound"), "{e}");
            }
        }
    }
}

/// The layouts that bind to the poster (`ChainVariant::BINDING_TO_POSTER`), executed on the
/// model under each foreign-bind answer: every window is bound to the CN's Alloc QP (the CN
/// told so at connect, `ConnectFlags::WINDOWS_ON_ALLOC_QP`, and reaching its chunk through it);
/// an entry handed out carries its owner's proof key; another CN's free of it fails at the
/// proof READ (a local protection error on its own Loop QP) and changes nothing — the owner
/// still reads its chunk; the owner's free of the group its chain popped *ahead* (not handed
/// out, not stamped) fails the same way; the owner's free of its own passes the proof, unbinds
/// every window (MW\[0\] from the Alloc QP, unchecked) and clears owner and proof key; the
/// forger is served again.
#[test]
fn binds_to_the_poster_free_chain_proves_ownership_by_the_owners_key() {
    use omw_core::chain::variant::ChainVariant;
    use omw_core::device::behaviour::{DeviceBehaviour, ForeignBind};
    use omw_core::device::{ExecutionMode, MwBinding, WcStatus};
    use omw_core::wire::wqe_format::WqeFormat;
    use omw_loopback::cluster::{Cluster, ClusterConfig};
    for fb in [ForeignBind::Honoured, ForeignBind::Refused, ForeignBind::BoundToPoster] {
        for (form, v) in [
            (WqeFormat::Canonical, ChainVariant::WQEBB_ENABLES.binding_to_poster()),
            (WqeFormat::Mlx5, ChainVariant::WQEBB_ENABLES.binding_to_poster()),
            (WqeFormat::Mlx5, ChainVariant::WQEBB_ENABLES.relaying_gates().enabling_receives().binding_to_poster()),
        ] {
            let mut cfg = ClusterConfig::paper_like().with_wqe_format(form);
            (cfg.cns, cfg.max_cns, cfg.chunks, cfg.chunk_size, cfg.quota) = (0, Some(2), 16, 512, 16);
            cfg.mode = Some(ExecutionMode::Offloaded);
            cfg.pop_ahead = Some(true);
            cfg.nic = cfg.nic.with_behaviour(DeviceBehaviour { foreign_bind: fb, ..DeviceBehaviour::PAPER });
            cfg.chain_variant = Some(v);
            let mut c = Cluster::new(cfg).unwrap();
            assert!(c.driver.mn.owner_proof(0).is_some(), "the cluster registered the proof words");
            let (cn0, cn1) = (c.connect_cn().unwrap(), c.connect_cn().unwrap());
            let at = |c: &Cluster, entry: u64| {
                let w = c.fabric.borrow().read_u64(c.mn_host, entry + 48).unwrap();
                (w as u32, (w >> 32) as u32)
            };
            let ctx = format!("{fb:?} {form:?} {v:?}");
            let a = c.alloc(cn0).unwrap_or_else(|e| panic!("{ctx}: {e:?} {:?}", c.driver.mn.last_chain_failure()));
            let r0 = c.driver.mn.cns().next().unwrap().clone();
            let proof0 = c.driver.mn.owner_proof(r0.slot).unwrap();
            let owner = at(&c, a.entry_addr);
            assert_eq!(owner, (r0.cn.get(), proof0.lkey), "{ctx}: the entry carries its owner and proof key");
            for rk in core::iter::once(a.owner_rkey).chain(a.rkeys.iter().copied()) {
                assert!(
                    matches!(c.mw_binding(rk), Some(MwBinding::Bound { qpn, .. }) if qpn == c.cns[cn0].mn_qps.alloc),
                    "{ctx}: every window is bound to the poster, the CN's Alloc QP"
                );
            }
            assert_eq!(c.write(cn0, &a, 0, 0, &[7; 8]), WcStatus::Success, "{ctx}: through the Alloc QP");
            // the forger names the owner's entry
            let _ = c.free_raw(cn1, a.entry_addr);
            c.advance(5_000_000).unwrap();
            assert_eq!(at(&c, a.entry_addr), owner, "{ctx}: the forged free changed nothing");
            let (st, bytes) = c.read(cn0, &a, 0, 0, 8);
            assert_eq!(
                (st, &bytes[..]),
                (WcStatus::Success, &[7u8; 8][..]),
                "{ctx}: the owner still reaches its chunk"
            );
            assert!(c.driver.mn.last_chain_failure().is_some(), "{ctx}: the forger's lap failed");
            c.check_invariants().unwrap();
            // the owner's free of the group its chain popped ahead: not handed out, not stamped
            let ahead = c.driver.group_ahead_of(r0.cn).expect("a group popped ahead");
            let ahead_entry = c.driver.mn.map().entry_addr(ahead).unwrap();
            assert_eq!(at(&c, ahead_entry), (r0.cn.get(), 0), "{ctx}: owned ahead, not stamped");
            let _ = c.free_raw(cn0, ahead_entry);
            c.advance(5_000_000).unwrap();
            assert_eq!(c.driver.mn.stats().groups_quarantined, 0, "{ctx}");
            if c.driver.group_ahead_of(r0.cn) == Some(ahead) {
                assert_eq!(at(&c, ahead_entry), (r0.cn.get(), 0), "{ctx}: still popped ahead, untouched");
            }
            c.check_invariants().unwrap();
            // the owner's free passes the proof
            let free_before = c.free_groups();
            c.free(cn0, &a).unwrap();
            c.advance(5_000_000).unwrap();
            assert_eq!(at(&c, a.entry_addr), (0, 0), "{ctx}: owner and proof key cleared");
            assert_eq!(c.free_groups(), free_before + 1, "{ctx}");
            assert_eq!(c.read(cn0, &a, 0, 0, 8).0, WcStatus::RemAccessErr, "{ctx}: the freed chunk is out of reach");
            assert_eq!(c.mw_binding(a.owner_rkey), Some(MwBinding::Unbound));
            // that refused access broke the Alloc QP pair, and with it the alloc chain (a
            // responder's access error is fatal to its QP): the CN reconnected its end; the
            // MN notices its chain failed, repairs and re-arms it
            c.advance(5_000_000).unwrap();
            // both CNs are served again and free their own
            for cn in [cn0, cn1] {
                let b = c.alloc(cn).unwrap_or_else(|e| {
                    panic!("{ctx}: CN {cn}: {e:?} {:?} {:?}", c.driver.mn.last_chain_failure(), c.cns[cn].events)
                });
                assert_eq!(c.write(cn, &b, 0, 0, &[1; 8]), WcStatus::Success, "{ctx}");
                c.free(cn, &b).unwrap();
            }
            c.advance(5_000_000).unwrap();
            c.check_invariants().unwrap();
            assert_eq!(c.driver.mn.stats().groups_quarantined, 0, "{ctx}");
        }
    }
}
