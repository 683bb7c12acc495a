//! What a chain layout choice costs on the model: alloc latency (request to reply), the alloc
//! chain's re-arm after the reply (its commit and the next pop ahead), and a free to idle —
//! self-enabling gates against relayed ones (`ChainVariant::relays_gates`, chosen for a device
//! that ignores a queue's ENABLE of itself), and each lap publishing the next receive through
//! the receive doorbell record or not (`ChainEnv::posts_receives`,
//! `NicConfig::recv_doorbell_records`), in canonical and mlx5 form, G = 2 and 3.
//! Model time (ns), the cost model of `ClusterConfig::paper_like`; a benchmark, not a test.
//!
//! `cargo run --release -p omw-tests --example variant_costs`

use omw_core::chain::variant::ChainVariant;
use omw_core::device::behaviour::{DeviceAnswers, DeviceBehaviour, SelfEnable};
use omw_core::device::ExecutionMode;
use omw_core::wire::wqe_format::WqeFormat;
use omw_loopback::cluster::{Cluster, ClusterConfig};
use omw_loopback::NicConfig;

/// (alloc, re-arm, free) in model ns.
fn measure(form: WqeFormat, b: DeviceBehaviour, records: bool, g: u8) -> (u64, u64, u64) {
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = 1;
    cfg.group_size = g;
    cfg.chunk_size = 4096;
    cfg.chunks = 16;
    cfg.quota = 16;
    cfg.mode = Some(ExecutionMode::Offloaded);
    cfg.nic = NicConfig::strict().with_prefetch(8).with_wqe_format(form).with_behaviour(b);
    cfg.nic.ring_arena_bytes = 3 * (64 << 10);
    cfg.nic.recv_doorbell_records = records;
    cfg.pop_ahead = Some(true);
    let mut c = Cluster::new(cfg).expect("model cluster");
    let a = c.alloc(0).expect("warm-up alloc");
    c.free(0, &a).expect("warm-up free");
    let t0 = c.now();
    let a = c.alloc(0).expect("alloc");
    let alloc = c.cns[0].last_reply_at - t0;
    let rearm = c.now() - c.cns[0].last_reply_at;
    let t0 = c.now();
    c.free(0, &a).expect("free");
    (alloc, rearm, c.now() - t0)
}

fn main() {
    println!("form      self-enable  gates         receives        G  alloc ns  re-arm ns  free ns");
    for form in [WqeFormat::Canonical, WqeFormat::Mlx5] {
        for se in [SelfEnable::Honoured, SelfEnable::Ignored] {
            let b = DeviceBehaviour { self_enable: se, ..DeviceBehaviour::PAPER };
            let gates = match ChainVariant::choose(&DeviceAnswers::exactly(b)) {
                Ok(v) if v.relays_gates => "relayed",
                Ok(_) => "self-enabling",
                Err(_) => "none",
            };
            for records in [false, true] {
                let rx = if records { "chain publishes" } else { "CPU hands back" };
                for g in [2u8, 3] {
                    let (alloc, rearm, free) = measure(form, b, records, g);
                    println!(
                        "{:<9} {:<12} {gates:<13} {rx:<15} {g}  {alloc:>8}  {rearm:>9}  {free:>7}",
                        format!("{form:?}"),
                        format!("{se:?}")
                    );
                }
            }
        }
    }
}
