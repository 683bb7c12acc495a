use omw_core::chain::ChainKind;
use omw_core::device::ExecutionMode;
use omw_loopback::cluster::{Cluster, ClusterConfig};
use omw_loopback::NicConfig;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let garbage: usize = args[1].parse().unwrap();
    let mode = if args[2] == "off" { ExecutionMode::Offloaded } else { ExecutionMode::HostEngine };
    let mut cfg = ClusterConfig::paper_like();
    cfg.cns = 3;
    cfg.chunks = 3;
    cfg.quota = 6;
    cfg.mode = Some(mode);
    if mode == ExecutionMode::HostEngine {
        cfg.nic = NicConfig::strict().with_offload(false);
    }
    let mut c = Cluster::new(cfg).unwrap();
    let _e = c.alloc(0).unwrap();
    let a = c.alloc(2).unwrap();
    let b = c.alloc(2).unwrap();
    println!("third: {:?}", c.alloc(2));
    c.free(2, &a).unwrap();
    c.free(2, &b).unwrap();
    for _ in 0..garbage {
        c.send_raw(0, ChainKind::Alloc, &[0x4F, 0x4D, 1, 1, 0, 0, 0, 0, 1, 2, 3]).unwrap();
    }
    let inv = c.check_invariants();
    println!("before crash: free={} tickets={:?} inv={inv:?}", c.free_groups(), c.driver.mn.tickets());
    c.crash_cn(0).unwrap();
    let inv = c.check_invariants();
    println!("after crash: free={} tickets={:?} inv={inv:?}", c.free_groups(), c.driver.mn.tickets());
}
