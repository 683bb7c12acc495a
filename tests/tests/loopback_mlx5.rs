//! The offloaded chains in mlx5 form, executed by the loopback model from their WQEBBs
//! (`omw_loopback::mlx5_fetch`): the same scenarios as the canonical form, and a differential
//! run of both forms.

use omw_core::device::{ExecutionMode, WcStatus};
use omw_core::wire::wqe_format::WqeFormat;
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

/// 1 MN + 6 CNs end to end with the chains in mlx5 form: allocate, access through both access
/// QPs, free, reuse; the MN CPU does nothing for any of it.
#[test]
fn six_cns_allocate_access_free_reuse_in_mlx5_form() {
    let mut cfg = ClusterConfig::paper_like().with_wqe_format(WqeFormat::Mlx5);
    cfg.mode = Some(ExecutionMode::Offloaded);
    let mut c = Cluster::new(cfg).unwrap();
    let events0 = c.mn_cpu_events;
    let mut held = Vec::new();
    for i in 0..6 {
        for _ in 0..3 {
            let a = c.alloc(i).unwrap_or_else(|e| panic!("cn{i} alloc: {e}"));
            c.check_invariants().unwrap();
            for q in 0..2 {
                let data = format!("cn{i} qp{q} {:#x}", a.base).into_bytes();
                assert_eq!(c.write(i, &a, q, 64 * q as u64, &data), WcStatus::Success);
                let (st, got) = c.read(i, &a, q, 64 * q as u64, data.len());
                assert_eq!((st, got), (WcStatus::Success, data));
            }
            held.push((i, a));
        }
    }
    let free_before = c.free_groups();
    for (i, a) in held.drain(..) {
        c.free(i, &a).unwrap();
        c.check_invariants().unwrap();
    }
    assert_eq!(c.free_groups(), free_before + 18);
    for i in 0..6 {
        let a = c.alloc(i).unwrap();
        let (st, got) = c.read(i, &a, 1, 0, 16);
        assert_eq!((st, got), (WcStatus::Success, vec![0u8; 16]), "a reused chunk reads as zeros");
        c.free(i, &a).unwrap();
    }
    c.check_invariants().unwrap();
    assert_eq!(c.mn_cpu_events, events0, "MN CPU events during offloaded allocs and frees");
}

mod differential {
    use super::*;
    use proptest::prelude::*;

    const CNS: usize = 3;
    const CHUNKS: u32 = 6;

    #[derive(Clone, Debug)]
    enum Op {
        Alloc(usize),
        Free(usize, usize),
        /// a free request naming the k-th chunk another CN holds
        Forge(usize, usize),
        Write(usize, usize, usize, Vec<u8>),
        Read(usize, usize, usize),
        /// a CN reading another CN's chunk with its rkey
        Trespass(usize, usize),
        Crash(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let cn = 0..CNS;
        prop_oneof![
            4 => cn.clone().prop_map(Op::Alloc),
            3 => (cn.clone(), 0..4usize).prop_map(|(c, k)| Op::Free(c, k)),
            1 => (cn.clone(), 0..8usize).prop_map(|(c, k)| Op::Forge(c, k)),
            2 => (cn.clone(), 0..4usize, 0..2usize, proptest::collection::vec(any::<u8>(), 1..24)).prop_map(|(c, k, q, d)| Op::Write(c, k, q, d)),
            2 => (cn.clone(), 0..4usize, 0..2usize).prop_map(|(c, k, q)| Op::Read(c, k, q)),
            1 => (cn.clone(), 0..8usize).prop_map(|(c, k)| Op::Trespass(c, k)),
            1 => cn.prop_map(Op::Crash),
        ]
    }

    /// Modelled times differ between the forms (an mlx5 lap runs more WQEs): a back-off's end
    /// is a time, not an outcome.
    fn untimed(s: &str) -> String {
        match s.find("until: ") {
            Some(at) => {
                let rest = &s[at + 7..];
                let end = rest.find(|ch: char| !ch.is_ascii_digit()).unwrap_or(rest.len());
                format!("{}until: _{}", &s[..at], &rest[end..])
            }
            None => s.to_string(),
        }
    }

    /// Run `ops` on a fresh cluster in `format`; what every step observably did.
    fn observe(format: WqeFormat, ops: &[Op]) -> Vec<String> {
        let mut c = cluster(format, CNS, CHUNKS);
        let mut held: Vec<Vec<omw_core::cn::Allocation>> = vec![Vec::new(); CNS];
        let mut crashed = [false; CNS];
        let mut out = Vec::new();
        for op in ops {
            let seen = match op.clone() {
                Op::Alloc(i) if !crashed[i] => match c.alloc(i) {
                    Ok(a) => {
                        held[i].push(a.clone());
                        format!("alloc {a:?}")
                    }
                    Err(e) => format!("alloc failed: {e:?}"),
                },
                Op::Free(i, k) if !crashed[i] && k < held[i].len() => {
                    let a = held[i].remove(k);
                    format!("free {:?}", c.free(i, &a))
                }
                Op::Forge(i, k) if !crashed[i] => {
                    let others: Vec<u64> =
                        (0..CNS).filter(|j| *j != i).flat_map(|j| held[j].iter().map(|a| a.entry_addr)).collect();
                    match others.get(k) {
                        Some(e) => format!("forge {:?}", c.free_raw(i, *e)),
                        None => continue,
                    }
                }
                Op::Write(i, k, q, d) if !crashed[i] && k < held[i].len() => {
                    let a = held[i][k].clone();
                    format!("write {:?}", c.write(i, &a, q, 0, &d))
                }
                Op::Read(i, k, q) if !crashed[i] && k < held[i].len() => {
                    let a = held[i][k].clone();
                    format!("read {:?}", c.read(i, &a, q, 0, 24))
                }
                Op::Trespass(i, k) if !crashed[i] => {
                    let others: Vec<omw_core::cn::Allocation> =
                        (0..CNS).filter(|j| *j != i).flat_map(|j| held[j].clone()).collect();
                    match others.get(k) {
                        Some(a) => format!("trespass {:?}", c.read(i, a, 0, 0, 8).0),
                        None => continue,
                    }
                }
                Op::Crash(i) if !crashed[i] && i != 0 => {
                    crashed[i] = true;
                    held[i].clear();
                    format!("crash {:?}", c.crash_cn(i).map_err(|e| e.to_string()))
                }
                _ => continue,
            };
            c.check_invariants().unwrap_or_else(|e| panic!("{format:?}: invariant broken after {op:?}: {e}"));
            out.push(format!("{}; free groups {}", untimed(&seen), c.free_groups()));
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        /// The same request sequence gives the same observable results — allocations (bases,
        /// rkeys, entries), statuses, bytes read, failures, free groups — whichever form the
        /// chains take, and the invariants hold after every step in both.
        #[test]
        fn canonical_and_mlx5_forms_are_indistinguishable(ops in proptest::collection::vec(op(), 1..40)) {
            let canonical = observe(WqeFormat::Canonical, &ops);
            let mlx5 = observe(WqeFormat::Mlx5, &ops);
            prop_assert_eq!(canonical, mlx5);
        }
    }
}

/// Enough laps that the chains' 16-bit WQE indices wrap (an alloc lap is 128 WQEBBs here, so
/// 2^16 WQEBBs are 512 laps): SEND_EN's absolute indices and the shadow counters keep working
/// across the wrap.
#[test]
fn wqe_indices_wrap_at_16_bits() {
    let mut c = cluster(WqeFormat::Mlx5, 1, 4);
    for lap in 0..600 {
        let a = c.alloc(0).unwrap_or_else(|e| panic!("lap {lap}: {e}"));
        assert_eq!(c.write(0, &a, 0, 0, b"w"), WcStatus::Success, "lap {lap}");
        c.free(0, &a).unwrap_or_else(|e| panic!("lap {lap}: {e}"));
    }
    c.check_invariants().unwrap();
}
