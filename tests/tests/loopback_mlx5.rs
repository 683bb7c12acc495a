//! The offloaded chains in mlx5 form, executed by the loopback model from their WQEBBs
//! (`omw_loopback::mlx5_fetch`): the same scenarios as the canonical form, and a differential
//! run of both forms.

use omw_core::backend::{ExecutionMode, WcStatus};
use omw_core::wqe_format::WqeFormat;
use omw_loopback::cluster::{Cluster, ClusterConfig};

fn cluster(format: WqeFormat, cns: usize, chunks: u32) -> Cluster {
    let mut cfg = ClusterConfig::paper_like().with_wqe_format(format);
    cfg.cns = cns;
    cfg.chunks = chunks;
    cfg.chunk_size = 512;
    cfg.quota = chunks;
    cfg.mode = Some(ExecutionMode::Offloaded);
    Cluster::new(cfg).expect("cluster")
}

#[test]
fn smoke_alloc_free_in_mlx5_form() {
    let mut c = cluster(WqeFormat::Mlx5, 2, 16);
    assert_eq!(c.mode, ExecutionMode::Offloaded);
    c.check_invariants().unwrap();
    let a = c.alloc(0).unwrap_or_else(|e| panic!("alloc: {e}"));
    c.check_invariants().unwrap();
    assert_eq!(c.write(0, &a, 0, 0, b"mlx5"), WcStatus::Success);
    let (st, got) = c.read(0, &a, 1, 0, 4);
    assert_eq!((st, got.as_slice()), (WcStatus::Success, &b"mlx5"[..]));
    c.free(0, &a).unwrap();
    c.check_invariants().unwrap();
}

/// WQEs the MN's Loop QP of CN 0's alloc chain executed for one alloc.
fn loop_wqes_per_alloc(format: WqeFormat) -> u64 {
    let mut c = cluster(format, 1, 16);
    let loop_qp = c.driver.mn.cn(c.cns[0].id).unwrap().qps.alloc_loop.unwrap();
    let at =
        |c: &Cluster| c.fabric.borrow().qp_stats(omw_loopback::QpAddr::new(c.mn_host, loop_qp)).unwrap().wqes_executed;
    let e0 = at(&c);
    c.alloc(0).unwrap();
    at(&c) - e0
}

#[test]
fn the_model_runs_the_mlx5_bytes() {
    let (canon, mlx5) = (loop_wqes_per_alloc(WqeFormat::Canonical), loop_wqes_per_alloc(WqeFormat::Mlx5));
    eprintln!("loop WQEs per alloc: canonical {canon}, mlx5 {mlx5}");
    assert!(mlx5 > canon, "canonical {canon}, mlx5 {mlx5}");
}
