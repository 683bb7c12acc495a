//! A hostile CN pipelines requests on its own free chain (several free requests posted before
//! the first lap ended — the client never does): under any interleaving of NIC steps and MN
//! actions, no other CN loses anything. What the pipelining CN does to itself is its own affair.

use omw_core::device::WcStatus;
use omw_tests::Mode;

fn other_cns_keep_their_chunks(mode: Mode, seed: u64, per_mille: u16, own_first: bool) {
    let mut c = omw_tests::cluster(mode, 3, 6, true);
    // the victims' chunks, tagged
    let mut held = Vec::new();
    for i in [0usize, 2] {
        let a = c.alloc(i).unwrap();
        let tag = format!("cn{i}@{:x}", a.base).into_bytes();
        assert_eq!(c.write(i, &a, 0, 0, &tag), WcStatus::Success);
        held.push((i, a, tag));
    }
    let own = c.alloc(1).unwrap();
    c.set_interleaving(seed, per_mille);
    // cn1: its own free and forged frees of every victim's entry, all at once, in either order
    if own_first {
        let _ = c.free_begin(1, &own);
    }
    for (_, a, _) in &held {
        let _ = c.free_raw_begin(1, a.entry_addr);
    }
    if !own_first {
        let _ = c.free_begin(1, &own);
    }
    let _ = c.pump();
    c.set_interleaving(seed ^ 0x5A, 0);
    c.tick().unwrap();
    for (i, a, tag) in &held {
        let (st, got) = c.read(*i, a, 0, 0, tag.len());
        assert_eq!(st, WcStatus::Success, "{mode:?} seed {seed}: cn{i} lost its chunk to cn1's pipelined frees");
        assert_eq!(&got, tag);
    }
    c.check_invariants().unwrap_or_else(|e| panic!("{mode:?} seed {seed}: {e}"));
}

#[test]
fn pipelined_frees_hurt_only_their_sender() {
    for mode in [Mode::Offloaded, Mode::OffloadedPopAhead, Mode::OffloadedMlx5, Mode::HostEngine] {
        for seed in 0..48u64 {
            let per_mille = [0, 50, 200, 600][seed as usize % 4];
            other_cns_keep_their_chunks(mode, seed, per_mille, true);
            other_cns_keep_their_chunks(mode, seed, per_mille, false);
        }
    }
}
