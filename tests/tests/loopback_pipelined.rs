//! Requests pipelined on one free chain (several free requests posted before the first lap
//! ended): a hostile CN's forged frees among them take nothing from any other CN, and an honest
//! CN's own frees all land — the chain publishes each next receive only once its lap is done
//! with the receive's targets (`ChainEnv::posts_receives`).

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

/// An honest CN frees several of its allocations at once, on its one free chain (the client
/// allows frees in flight: they have no reply). Each lap publishes the next receive itself
/// (`ChainEnv::posts_receives`), so the second request waits (RNR) until the first lap is done
/// with the receive's targets, instead of scattering into it: every free lands, under any
/// interleaving of NIC steps and MN actions, with the model's receives enabled by the doorbell
/// (its default) or only by RECV_EN.
#[test]
fn pipelined_frees_all_land() {
    use omw_core::device::behaviour::{DeviceBehaviour, RecvEnable};
    for mode in [Mode::Offloaded, Mode::OffloadedPopAhead, Mode::OffloadedMlx5] {
        for recv in [RecvEnable::Doorbell, RecvEnable::RecvEnOnly] {
            for seed in 0..24u64 {
                let per_mille = [0, 50, 200, 600][seed as usize % 4];
                let b = DeviceBehaviour { recv_enable: recv, ..omw_loopback::NicConfig::DEFAULT_BEHAVIOUR };
                let spec = omw_tests::testbed::MnSpec::new(2, 8).chunk_size(512).scrub(true);
                let cfg = omw_tests::loopback::Loopback(mode).with_behaviour(b).config(spec);
                let mut c = omw_loopback::cluster::Cluster::new(cfg).expect("cluster");
                let before = c.free_groups();
                let held: Vec<_> = (0..4).map(|_| c.alloc(0).unwrap()).collect();
                c.set_interleaving(seed, per_mille);
                for a in &held {
                    c.free_begin(0, a).unwrap();
                }
                let _ = c.pump();
                c.set_interleaving(seed ^ 0x5A, 0);
                c.tick().unwrap();
                assert_eq!(c.free_groups(), before, "{mode:?} {recv:?} seed {seed}: a pipelined free did not land");
                c.check_invariants().unwrap_or_else(|e| panic!("{mode:?} {recv:?} seed {seed}: {e}"));
                // and the groups come back out, clean
                for _ in 0..4 {
                    let a = c.alloc(0).unwrap();
                    let (st, got) = c.read(0, &a, 0, 0, 8);
                    assert_eq!(st, WcStatus::Success);
                    assert_eq!(got, vec![0u8; 8], "{mode:?} seed {seed}: a freed chunk came back unscrubbed");
                }
            }
        }
    }
}
