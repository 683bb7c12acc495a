//! Issue 23: the MN's work that must not grow with the pool, counted on the loopback model
//! (offloaded: the audit and the lazy quota run only there). Counts, never time: entries the
//! audit examined per tick, passes, queue scans, table recounts — from `MnStats`.

use omw_core::device::ExecutionMode;
use omw_loopback::cluster::{Cluster, ClusterConfig};

fn offloaded(chunks: u32, cns: usize, quota: u32) -> Cluster {
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = cns;
    cfg.chunks = chunks;
    cfg.chunk_size = 512;
    cfg.group_size = 3;
    cfg.quota = quota;
    cfg.mode = Some(ExecutionMode::Offloaded);
    Cluster::new(cfg).unwrap()
}

/// Each tick examines at most `audit_batch` entries; the table is covered in ⌈chunks / batch⌉
/// ticks; a window bound outside its owner's access QPs is found within that one pass.
#[test]
fn the_audit_examines_a_bounded_batch_per_tick_and_covers_the_table_in_one_pass() {
    let mut c = offloaded(256, 2, 256);
    c.driver.mn.set_audit_batch(32);
    // most of the pool taken, so the misbound group lies deep in the table
    let mut held = Vec::new();
    for _ in 0..200 {
        held.push(c.alloc(1).unwrap());
    }
    let victim: Vec<_> = c.cns[0].mn_qps.access.iter().copied().collect();
    let own: Vec<_> = c.cns[1].mn_qps.access.iter().copied().collect();
    let bad = c.alloc_naming(1, &[victim[0], own[1]]).unwrap();
    let bad_group = c.group_of(&bad).unwrap();
    assert!(bad_group.0 >= 200, "the misbound group is past the first ticks' batches: {bad_group:?}");
    let start = c.driver.mn.stats();
    let mut ticks = 0;
    while c.driver.mn.stats().audit_passes == start.audit_passes {
        let before = c.driver.mn.stats().audit_entries;
        c.tick().unwrap();
        ticks += 1;
        let examined = c.driver.mn.stats().audit_entries - before;
        assert!(examined <= 32, "tick {ticks} examined {examined} entries");
        assert!(ticks <= 8, "a pass takes ceil(256 / 32) = 8 ticks");
    }
    assert_eq!(ticks, 8);
    assert_eq!(c.driver.mn.audit_period_ns(), 8 * c.driver.mn.config().audit_ns);
    // the misbound group, within the pass; popping ahead, the quiesced owner's chain also
    // gives back the group it popped for its next request (`chain::alloc`)
    let ahead = u64::from(c.driver.mn.config().pop_ahead);
    assert_eq!(
        c.driver.mn.stats().groups_reclaimed - start.groups_reclaimed,
        1 + ahead,
        "the misbound group, within the pass"
    );
    assert_ne!(c.write(1, &bad, 0, 0, b"gone"), omw_core::device::WcStatus::Success, "its windows are dead");
    // and the CN was told (a taken-back notice): its client no longer lists the group, and
    // still lists everything else it holds
    assert!(c.driver.mn.stats().taken_back_notices > start.taken_back_notices);
    let live = c.cns[1].driver.client().live();
    assert!(live.iter().all(|a| a.entry_addr != bad.entry_addr), "the taken-back group is forgotten");
    assert!(held.iter().all(|h| live.iter().any(|a| a.entry_addr == h.entry_addr)), "nothing else is");
    // the tally counts what the pass saw: 200 groups, the misbound one and the one popped
    // ahead, owned when examined
    assert_eq!(c.driver.mn.audit_tally(c.driver.mn.cns().nth(1).unwrap().cn), Some(201 + ahead as u32));
    c.check_invariants().unwrap();
    // the owner keeps what it holds properly
    assert_eq!(c.write(1, &held[0], 0, 0, b"kept"), omw_core::device::WcStatus::Success);
}

/// A CN's departure pushes every group it held back through the checked push without one
/// scan of the queue (its owner field, read while its chains are stopped, places each group).
#[test]
fn a_crashed_cns_groups_are_pushed_without_scanning_the_queue() {
    let mut c = offloaded(128, 2, 128);
    for _ in 0..40 {
        c.alloc(0).unwrap();
    }
    c.alloc(1).unwrap();
    let before = c.driver.mn.stats();
    let ahead_before = c.driver.groups_ahead();
    c.crash_cn(0).unwrap();
    let after = c.driver.mn.stats();
    // the 40 it was handed, and the one its alloc chain had popped ahead for its next request
    let ahead = u64::from(ahead_before - c.driver.groups_ahead());
    assert_eq!(ahead, u64::from(c.driver.mn.config().pop_ahead));
    assert_eq!(after.groups_reclaimed - before.groups_reclaimed, 40 + ahead);
    assert_eq!(after.queue_scans, before.queue_scans, "no queue scan for groups their quiesced owner held");
    assert_eq!(c.unallocated(), 127, "all but the survivor's one group");
    c.check_invariants().unwrap();
}

/// Lazy quota: a CN whose lap counters move is counted in the table at most once per audit
/// pass, however often its counters are sampled; within its quota nothing of it is stopped.
#[test]
fn lazy_quota_counts_a_cn_in_the_table_at_most_once_per_audit_pass() {
    let mut c = offloaded(256, 2, 64);
    c.driver.mn.set_audit_batch(32);
    let start = c.driver.mn.stats();
    for _ in 0..5 {
        let a = c.alloc(0).unwrap();
        c.sample_counters().unwrap();
        c.free(0, &a).unwrap();
        c.sample_counters().unwrap();
    }
    let s = c.driver.mn.stats();
    assert_eq!(s.quota_recounts - start.quota_recounts, 1, "once in the pass, not per sample");
    assert_eq!(s.quiesces, start.quiesces, "a CN within its quota is not stopped");
    assert_eq!(s.quota_disconnects, 0);
    c.check_invariants().unwrap();
}

/// A pool past one window of the MN's duplicate-telling scans (2^20 groups,
/// `omw_core::mn::group_window`): served, crashed into and checked clean on the model at a
/// size that takes two windows, so the windowed invariant check and free count run for real
/// (the unit test `the_scans_in_windows_of_the_pool_find_what_one_pass_finds` runs them with
/// windows of 64 groups against one pass). About 0.7 GiB and 4 s in a debug build.
#[test]
fn a_pool_past_one_scan_window_is_served_and_checks_clean() {
    let chunks = (1 << 20) + 4096;
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = 3;
    cfg.chunks = chunks;
    cfg.chunk_size = 512;
    cfg.group_size = 2;
    cfg.quota = chunks;
    cfg.mode = Some(ExecutionMode::Offloaded);
    cfg.nic.mem_limit = 4 << 30;
    let mut c = Cluster::new(cfg).unwrap();
    // every group free but those held and those the CNs' alloc chains popped ahead
    let whole = |c: &mut Cluster, held: u32| {
        c.check_invariants().unwrap();
        let f = c.free_count().unwrap();
        let ahead = c.cns.iter().filter(|n| c.driver.group_ahead_of(n.id).is_some()).count() as u32;
        assert_eq!((f.groups + held + ahead, f.corrupt()), (chunks, false), "{f:?}, {ahead} ahead");
    };
    whole(&mut c, 0);
    let mut held = Vec::new();
    for i in 0..40 {
        held.push((i % 2, c.alloc(i % 2).unwrap()));
    }
    for (cn, a) in held.drain(..10) {
        c.free(cn, &a).unwrap();
    }
    c.tick().unwrap();
    whole(&mut c, 30);
    c.crash_cn(1).unwrap();
    whole(&mut c, 15);
}
