//! Every fence mode the chains in mlx5 form carry (issue 22 item 9): both chains, G = 2..4,
//! built by `omw_core::chain::mlx5::Mlx5Chain` and read back from their bytes. Each WQE's
//! `fm_ce_se` must hold one of the five defined fence modes and be exactly what the providers'
//! `get_fence` gives for its own FENCE and the WQE before it (`FenceMode::for_wqe`); the first
//! mlx5 WQE of every canonical step must be FENCEd exactly when the canonical step is.
//!
//! The bytes this changed: before, the fence was two OR-ed "flags", so a FENCEd WQE right
//! after a UMR carried 5 << 5 (`fm_ce_se` 0xa0 | ce), a mode no provider defines; it now
//! carries SMALL_AND_FENCE 4 << 5 (0x80 | ce, rdma-core's 0x88 when signaled). Every other
//! WQE's byte is unchanged: a plain FENCEd one was and is 4 << 5, an unfenced one after a UMR
//! 1 << 5. The test prints how many WQEs of each chain had the changed byte.

use omw_core::chain::alloc::build_alloc_chain;
use omw_core::chain::builder::ChainEnv;
use omw_core::chain::free::build_free_chain;
use omw_core::chain::mlx5::{Mlx5Chain, Mlx5Queues, Role};
use omw_core::chain::{ChainLayout, Ring};
use omw_core::mlx5::ctrl::{FenceMode, PrevWqe};
use omw_core::mlx5::decode::Mlx5Op;
use omw_core::wire::wqe::WqeFlags;
use std::collections::BTreeMap;

fn chains() -> Vec<(String, ChainLayout)> {
    let mut out = Vec::new();
    for g in 2..=4u8 {
        let env = ChainEnv::example(4096, 16, g, [0x100, 0x101, 0x102]).unwrap();
        out.push((format!("alloc G={g}"), build_alloc_chain(&env).unwrap()));
        out.push((format!("free G={g}"), build_free_chain(&env).unwrap()));
    }
    out
}

#[test]
fn every_chain_wqe_carries_a_defined_fence_mode_as_get_fence_gives_it() {
    let queues = Mlx5Queues::new([0x21, 0x22, 0x23], [0x5_0000_0000, 0x5_0010_0000]);
    for (name, layout) in chains() {
        let chain = Mlx5Chain::build(&layout, queues).unwrap();
        let mut modes: BTreeMap<&str, usize> = BTreeMap::new();
        let mut changed = 0;
        for ring in [Ring::Loop, Ring::Mgmt] {
            let mut prev = PrevWqe::Other;
            let mut seen_steps = std::collections::BTreeSet::new();
            for p in chain.placed[ring as usize].iter() {
                // decode refuses an undefined fence mode (5..7 << 5)
                let d = chain.decode_at(ring, p.pi).unwrap_or_else(|e| panic!("{name} {ring:?} WQE {}: {e}", p.pi));
                let fence = d.fm_ce_se.fence;
                let fenced = fence.fences_reads_and_atomics();
                assert_eq!(fence, FenceMode::for_wqe(fenced, prev), "{name} {ring:?} WQE {} ({:?})", p.pi, d.op);
                assert!(
                    matches!(fence, FenceMode::None | FenceMode::InitiatorSmall | FenceMode::SmallAndFence),
                    "{name}: the chains use no other mode ({fence:?})"
                );
                if let Role::Step(s) = p.role {
                    if seen_steps.insert(s) {
                        let want = layout.steps[s as usize].wqe.flags.contains(WqeFlags::FENCE);
                        assert_eq!(fenced, want, "{name} step {s} ({:?}): FENCE as the canonical step", d.op);
                    }
                }
                if fenced && prev == PrevWqe::Umr {
                    changed += 1;
                }
                *modes.entry(mode_name(fence)).or_default() += 1;
                prev = match d.op {
                    Mlx5Op::Bind { .. } | Mlx5Op::Invalidate { .. } => PrevWqe::Umr,
                    _ => PrevWqe::Other,
                };
            }
        }
        eprintln!("{name}: fence modes {modes:?}; FENCEd right after a UMR (0xa0 → 0x80): {changed}");
    }
}

fn mode_name(m: FenceMode) -> &'static str {
    match m {
        FenceMode::None => "NONE",
        FenceMode::InitiatorSmall => "INITIATOR_SMALL",
        FenceMode::Fence => "FENCE",
        FenceMode::StrongOrdering => "STRONG_ORDERING",
        FenceMode::SmallAndFence => "SMALL_AND_FENCE",
    }
}
