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
fn claimed_rows_pass(rows: &[matrix::Row]) {
    let mut claimed = 0;
    for r in rows {
        if ChainVariant::choose(&DeviceAnswers::exactly(r.behaviour)).is_ok() {
            claimed += 1;
            assert!(r.summary.failed.is_empty(), "under {}: {:?}", matrix::label(&r.behaviour), r.failed());
        }
    }
    assert!(claimed > 0, "no behaviour is claimed by a variant");
}

/// PAPER and the six behaviours one answer away from it, two at a time: PAPER, prefetch past
/// WAITs and SEND_EN counted in WQEs are claimed (by the two variants) and must pass.
#[test]
fn paper_and_its_single_deviations_in_mlx5_form() {
    let list = scenarios::all();
    let rows = matrix::run(&matrix::paper_and_single_deviations(), &list, 2, mlx5);
    println!("{}", matrix::render("loopback, mlx5 form", &list, &rows));
    claimed_rows_pass(&rows);
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
    claimed_rows_pass(&rows);
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

/// The free chain of a layout that binds to the poster (`ChainVariant::BINDING_TO_POSTER`),
/// executed on the model: an entry a CN is handed carries its slot's proof key; another CN's
/// free of it fails at the proof READ (a local protection error on its own Loop QP) and
/// changes nothing — the owner still reads its chunk and still holds the group; the owner's
/// free passes the proof, unbinds every window (MW\[0\] from the Alloc QP it is bound to,
/// unchecked) and clears owner and proof key; the forger's chains serve it again. Foreign
/// binds honoured here: the CN side of the layout (accesses through the Alloc QP) is not built,
/// so the access windows still go to the access QPs the request names.
#[test]
fn binds_to_the_poster_free_chain_proves_ownership_by_the_owners_key() {
    use omw_core::chain::variant::ChainVariant;
    use omw_core::device::{ExecutionMode, MwBinding, WcStatus};
    use omw_core::wire::wqe_format::WqeFormat;
    use omw_loopback::cluster::{Cluster, ClusterConfig};
    for (form, v) in [
        (WqeFormat::Canonical, ChainVariant::WQEBB_ENABLES.binding_to_poster()),
        (WqeFormat::Mlx5, ChainVariant::WQEBB_ENABLES.binding_to_poster()),
        (WqeFormat::Mlx5, ChainVariant::WQEBB_ENABLES.relaying_gates().enabling_receives().binding_to_poster()),
    ] {
        let mut cfg = ClusterConfig::paper_like().with_wqe_format(form);
        (cfg.cns, cfg.max_cns, cfg.chunks, cfg.chunk_size, cfg.quota) = (0, Some(2), 16, 512, 16);
        cfg.mode = Some(ExecutionMode::Offloaded);
        cfg.chain_variant = Some(v);
        let mut c = Cluster::new(cfg).unwrap();
        assert!(c.driver.mn.owner_proof(0).is_some(), "the cluster registered the proof words");
        let (cn0, cn1) = (c.connect_cn().unwrap(), c.connect_cn().unwrap());
        let owner_and_proof = |c: &Cluster, entry: u64| {
            let w = c.fabric.borrow().read_u64(c.mn_host, entry + 48).unwrap();
            (w as u32, (w >> 32) as u32)
        };
        let a = c.alloc(cn0).unwrap();
        let proof0 = c.driver.mn.owner_proof(c.driver.mn.cns().next().unwrap().slot).unwrap();
        let owner = owner_and_proof(&c, a.entry_addr);
        assert_eq!(owner.1, proof0.lkey, "{form:?} {v:?}: the entry carries the owner's proof key");
        assert!(
            matches!(c.mw_binding(a.owner_rkey), Some(MwBinding::Bound { qpn, .. }) if qpn == c.cns[cn0].mn_qps.alloc),
            "MW[0] is bound to the poster, the CN's Alloc QP"
        );
        // the forger names the owner's entry
        let _ = c.free_raw(cn1, a.entry_addr);
        c.advance(5_000_000).unwrap();
        assert_eq!(owner_and_proof(&c, a.entry_addr), owner, "{form:?} {v:?}: the forged free changed nothing");
        assert_eq!(c.read(cn0, &a, 0, 0, 8).0, WcStatus::Success, "the owner still reaches its chunk");
        let failure = c.driver.mn.last_chain_failure();
        assert!(failure.is_some(), "the forger's lap failed");
        c.check_invariants().unwrap();
        // the owner's free passes the proof
        let free_before = c.free_groups();
        c.free(cn0, &a).unwrap();
        c.advance(5_000_000).unwrap();
        assert_eq!(owner_and_proof(&c, a.entry_addr), (0, 0), "{form:?} {v:?}: owner and proof key cleared");
        assert_eq!(c.free_groups(), free_before + 1);
        assert_eq!(c.read(cn0, &a, 0, 0, 8).0, WcStatus::RemAccessErr, "the freed chunk is out of reach");
        assert_eq!(c.mw_binding(a.owner_rkey), Some(MwBinding::Unbound));
        // the forger is served again, and frees its own
        let b = c.alloc(cn1).unwrap();
        c.free(cn1, &b).unwrap();
        c.advance(5_000_000).unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.driver.mn.stats().groups_quarantined, 0);
    }
}
