//! What a chain layout variant costs on the model: alloc latency (request to reply), the alloc
//! chain's re-arm after the reply (its commit and the next pop ahead), and a free to idle —
//! the self-enabling gates against relayed ones (`ChainVariant::relays_gates`, chosen for a
//! device that ignores a queue's ENABLE of itself), in canonical and mlx5 form, G = 2 and 3.
//! Model time (ns), the cost model of `ClusterConfig::paper_like`; a benchmark, not a test.
//!
//! `cargo run --release -p omw-tests --example variant_costs`

use omw_core::device::behaviour::{DeviceBehaviour, SelfEnable};
use omw_core::device::ExecutionMode;
use omw_core::wire::wqe_format::WqeFormat;
use omw_loopback::cluster::{Cluster, ClusterConfig};
use omw_loopback::NicConfig;

fn main() {
    for form in [WqeFormat::Canonical, WqeFormat::Mlx5] {
        for b in
            [DeviceBehaviour::PAPER, DeviceBehaviour { self_enable: SelfEnable::Ignored, ..DeviceBehaviour::PAPER }]
        {
            for g in [2u8, 3] {
                let mut cfg = ClusterConfig::paper_like();
                cfg.cns = 1;
                cfg.group_size = g;
                cfg.chunk_size = 4096;
                cfg.chunks = 16;
                cfg.quota = 16;
                cfg.mode = Some(ExecutionMode::Offloaded);
                cfg.nic = NicConfig::strict().with_prefetch(8).with_wqe_format(form).with_behaviour(b);
                cfg.nic.ring_arena_bytes = 3 * (64 << 10);
                cfg.pop_ahead = Some(true);
                let mut c = Cluster::new(cfg).expect("model cluster");
                let a = c.alloc(0).expect("model cluster");
                c.free(0, &a).expect("model cluster");
                let t0 = c.now();
                let a = c.alloc(0).expect("model cluster");
                let alloc = c.cns[0].last_reply_at - t0;
                let rearm = c.now() - c.cns[0].last_reply_at;
                let t0 = c.now();
                c.free(0, &a).expect("model cluster");
                let free = c.now() - t0;
                println!("{form:?} form, self-enable {:?} (variant {:?}), G={g}: alloc {alloc} ns, re-arm {rearm} ns, free to idle {free} ns", b.self_enable, omw_core::chain::variant::ChainVariant::choose(&omw_core::device::behaviour::DeviceAnswers::exactly(b)).map(|v| if v.relays_gates { "relayed gates" } else { "self-enabling gates" }).unwrap_or("none"));
            }
        }
    }
}
