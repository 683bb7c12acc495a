//! The sweep behind the paper's "up to" figures: OneSidedMW vs RPC-MW on the allocation-heavy
//! KV configurations (both readings of "2 KiB allocations"), on one CN and at scale, for every
//! MN core count and NIC processing-unit count swept. The paper reports maxima ("up to 2.71×
//! on one CN, 10.6× at scale"); a single configuration is not comparable with a maximum.
//!
//! The NIC unit count changes the loopback model itself, so the chains and host-engine laps are
//! re-measured on the model for every unit count; MN cores only change the simulator.

use super::inputs::{self, Inputs, Measured};
use super::kv;
use super::schemes::{compile, Scheme};
use super::sim;
use crate::Options;
use omw_loopback::CostModel;

/// One KV configuration of the sweep.
#[derive(Clone, Debug)]
pub struct SweepConfig {
    pub name: String,
    pub kv: kv::KvConfig,
    pub cns: usize,
}

/// OneSidedMW and both RPC-MW variants on one configuration, core count and unit count.
#[derive(Clone, Debug)]
pub struct SweepRow {
    pub config: String,
    pub cns: usize,
    pub threads: usize,
    /// MN allocations + frees per KV request (how allocation-heavy the configuration is).
    pub ctl_per_request: f64,
    pub mn_cores: usize,
    pub nic_units: usize,
    /// MN CPU time of one RPC-MW server event (`inputs::RPC_CPU_SWEEP`).
    pub rpc_cpu_ns: u64,
    /// The MN's RNR timer a CN's request waits on a re-arming chain (`inputs::RNR_SWEEP`).
    pub rnr_ns: u64,
    pub osmw: f64,
    pub type1: f64,
    pub type2: f64,
    /// omw's own host engine (the chains on the MN CPU): not an RPC-MW baseline, shown beside.
    pub host_engine: f64,
}

impl SweepRow {
    /// OneSidedMW throughput over the faster RPC-MW variant.
    pub fn speedup(&self) -> f64 {
        self.osmw / self.type1.max(self.type2).max(1e-9)
    }
    pub fn speedup_t1(&self) -> f64 {
        self.osmw / self.type1.max(1e-9)
    }
    pub fn speedup_t2(&self) -> f64 {
        self.osmw / self.type2.max(1e-9)
    }
}

/// The KV configurations the paper's "up to" figures range over, each on one CN and on `cns`.
pub fn configs(keys: usize, mixed: usize, seed: u64, cns: usize) -> Vec<SweepConfig> {
    let base =
        |chunk: u64, classes: Vec<u64>| kv::KvConfig { chunk, classes, keys_per_thread: keys, mixed_ops: mixed, seed };
    let shapes = [
        ("objects 2-8 KiB, 16 KiB chunks", base(16384, vec![2048, 4096, 8192])),
        ("2 KiB allocations = MN chunks (objects 256 B-1 KiB)", base(2048, vec![256, 512, 1024])),
        ("2 KiB allocations = objects (16 KiB chunks)", base(16384, vec![2048])),
        ("4 KiB allocations = MN chunks (objects 256 B-1 KiB)", base(4096, vec![256, 512, 1024])),
        // no second level: every object is its own MN allocation (each insert and update
        // allocates at the MN, each delete and update frees there)
        ("one MN allocation per object (2 KiB objects, 2 KiB chunks)", base(2048, vec![2048])),
    ];
    let mut v = Vec::new();
    for (name, kv) in shapes {
        for n in [1, cns] {
            v.push(SweepConfig {
                name: format!("{name}, {n} CN{}", if n == 1 { "" } else { "s" }),
                kv: kv.clone(),
                cns: n,
            });
        }
    }
    v
}

/// OneSidedMW and both RPC-MW variants on one configuration (traces generated), one MN core
/// count, with the chains measured on a model of `inp.nic_units` units.
fn point(inp: &Inputs, m: &Measured, c: &SweepConfig, tr: &[kv::KvTrace], cores: usize) -> SweepRow {
    let requests: usize = tr.iter().map(|t| t.requests).sum();
    let ctl: u64 = tr.iter().map(|t| t.chunk_allocs + t.chunk_frees).sum();
    let inp_k = Inputs { mn_cores: cores, ..inp.clone() };
    let per_cn = (tr.len() / c.cns.max(1)).max(1);
    let tput = |s: Scheme| {
        let progs: Vec<_> =
            tr.iter().enumerate().map(|(i, t)| compile(s, &inp_k, m, &t.ops, (i / per_cn) as u16)).collect();
        sim::run(&progs, cores, inp.nic_units).throughput()
    };
    SweepRow {
        config: c.name.clone(),
        cns: c.cns,
        threads: tr.len(),
        ctl_per_request: ctl as f64 / requests.max(1) as f64,
        mn_cores: cores,
        nic_units: inp.nic_units,
        rpc_cpu_ns: inp.rpc_cpu_ns,
        rnr_ns: inp.rnr_timer_ns,
        osmw: tput(Scheme::OneSidedMw),
        type1: tput(Scheme::RpcMwType1),
        type2: tput(Scheme::RpcMwType2),
        host_engine: tput(Scheme::HostEngine),
    }
}

fn traces_of(cfgs: &[SweepConfig], threads: usize) -> Vec<Vec<kv::KvTrace>> {
    cfgs.iter().map(|c| (0..c.cns * threads).map(|t| kv::trace(&c.kv, t as u64)).collect()).collect()
}

/// Run the sweep. `threads` per CN; `units` and `cores` the values swept.
pub fn run(
    cfgs: &[SweepConfig],
    threads: usize,
    units: &[usize],
    cores: &[usize],
    tick: &mut dyn FnMut(&str),
) -> Result<Vec<SweepRow>, String> {
    // traces do not depend on the MN: generate each configuration's once
    let traces = traces_of(cfgs, threads);
    let mut rows = Vec::new();
    for &u in units {
        tick(&format!("sweep: measuring the chains on the model with {u} NIC unit(s)"));
        let inp = inputs::measure_inputs(CostModel::CX6, 1, u)?;
        let mut measured: Vec<(u64, Measured)> = Vec::new();
        for c in cfgs {
            if !measured.iter().any(|(chunk, _)| *chunk == c.kv.chunk) {
                measured.push((c.kv.chunk, inputs::measure_geometry(&inp, 2, c.kv.chunk, 24)?));
            }
        }
        for (c, tr) in cfgs.iter().zip(&traces) {
            let m = &measured.iter().find(|(chunk, _)| *chunk == c.kv.chunk).ok_or("geometry")?.1;
            for &k in cores {
                rows.push(point(&inp, m, c, tr, k));
                // the RPC servers' CPU cost and the MN's RNR timer are swept on the paper's one
                // MN core at the default unit count (units touch neither)
                if u != Options::DEFAULT_NIC_UNITS || k != 1 {
                    continue;
                }
                for &cpu in inputs::RPC_CPU_SWEEP.iter().filter(|c| **c != inputs::RPC_CPU_NS) {
                    rows.push(point(&Inputs { rpc_cpu_ns: cpu, ..inp.clone() }, m, c, tr, k));
                }
                for &rnr in inputs::RNR_SWEEP.iter().filter(|r| **r != inputs::RNR_TIMER_NS) {
                    rows.push(point(&Inputs { rnr_timer_ns: rnr, ..inp.clone() }, m, c, tr, k));
                }
            }
        }
    }
    Ok(rows)
}

/// How much the outputs move when one unmeasured input is halved or doubled.
#[derive(Clone, Debug)]
pub struct Sensitivity {
    pub input: &'static str,
    pub value: u64,
    /// OneSidedMW alloc latency, one requester, on the model.
    pub alloc_ns: u64,
    /// RPC-MW type-2 alloc latency with 24 requesters on one MN core (simulator).
    pub rpc2_24_ns: f64,
    /// KV speed-up over the faster RPC-MW on one CN and at scale (1 MN core).
    pub speedup_one: f64,
    pub speedup_scale: f64,
}

type Setter = fn(&mut CostModel, u64);

/// The unmeasured inputs of `CostModel` (estimates, no measurement behind them), each at ½×,
/// 1× and 2× its default, on one configuration on one CN and at scale.
pub fn sensitivity(
    cfgs: &[SweepConfig],
    threads: usize,
    tick: &mut dyn FnMut(&str),
) -> Result<Vec<Sensitivity>, String> {
    let knobs: [(&'static str, u64, Setter); 4] = [
        ("wqe_ns", CostModel::CX6.wqe_ns, |c, v| c.wqe_ns = v),
        ("responder_ns", CostModel::CX6.responder_ns, |c, v| c.responder_ns = v),
        ("bind_unit_ns", CostModel::CX6.bind_unit_ns, |c, v| c.bind_unit_ns = v),
        ("host_engine_step_ns", CostModel::CX6.host_engine_step_ns, |c, v| c.host_engine_step_ns = v),
    ];
    let traces = traces_of(cfgs, threads);
    let mut out = Vec::new();
    let mut baseline: Option<Sensitivity> = None;
    for (name, base, set) in knobs {
        tick(&format!("sensitivity: {name} at ½×, 1×, 2×"));
        for v in [base / 2, base, base * 2] {
            if let Some(b) = baseline.as_ref().filter(|_| v == base) {
                // the 1× point is the same for every knob: measured once
                out.push(Sensitivity { input: name, value: v, ..b.clone() });
                continue;
            }
            let mut cost = CostModel::CX6;
            set(&mut cost, v);
            let inp = inputs::measure_inputs(cost, 1, cost.nic_units as usize)?;
            let chunk = cfgs.first().map_or(2048, |c| c.kv.chunk);
            let m = inputs::measure_geometry(&inp, 2, chunk, 24)?;
            let rpc2 = super::alloc::in_sim(&inp, &m, Scheme::RpcMwType2, 24, 20).mean_ns;
            let sp = |one: bool| {
                cfgs.iter()
                    .zip(&traces)
                    .filter(|(c, _)| (c.cns == 1) == one)
                    .map(|(c, tr)| point(&inp, &m, c, tr, 1).speedup())
                    .fold(0.0, f64::max)
            };
            let point = Sensitivity {
                input: name,
                value: v,
                alloc_ns: m.osmw.alloc_ns,
                rpc2_24_ns: rpc2,
                speedup_one: sp(true),
                speedup_scale: sp(false),
            };
            if v == base {
                baseline = Some(point.clone());
            }
            out.push(point);
        }
    }
    Ok(out)
}

/// The largest speed-up over the faster RPC-MW among rows matching `pick`.
pub fn up_to(rows: &[SweepRow], pick: impl Fn(&SweepRow) -> bool) -> Option<&SweepRow> {
    rows.iter().filter(|r| pick(r)).max_by(|a, b| a.speedup().total_cmp(&b.speedup()))
}

/// The smallest speed-up over the faster RPC-MW among rows matching `pick`.
pub fn down_to(rows: &[SweepRow], pick: impl Fn(&SweepRow) -> bool) -> Option<&SweepRow> {
    rows.iter().filter(|r| pick(r)).min_by(|a, b| a.speedup().total_cmp(&b.speedup()))
}

/// A sweep point in words: the conditions that give its speed-up.
pub fn conditions(r: &SweepRow) -> String {
    format!(
        "{}, {} MN core{}, {} NIC unit{}, RPC event {} ns, RNR timer {}",
        r.config,
        r.mn_cores,
        if r.mn_cores == 1 { "" } else { "s" },
        r.nic_units,
        if r.nic_units == 1 { "" } else { "s" },
        r.rpc_cpu_ns,
        match r.rnr_ns {
            0 => "none (CN paced)".to_string(),
            n => format!("{} µs", n / 1000),
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(cns: usize, units: usize, osmw: f64, t1: f64, t2: f64) -> SweepRow {
        SweepRow {
            config: "c".into(),
            cns,
            threads: 8 * cns,
            ctl_per_request: 0.1,
            mn_cores: 1,
            nic_units: units,
            rpc_cpu_ns: 200,
            rnr_ns: 10_000,
            osmw,
            type1: t1,
            type2: t2,
            host_engine: 0.0,
        }
    }

    #[test]
    fn speedup_is_against_the_faster_rpc_variant_and_up_to_takes_the_max() {
        let r = row(1, 1, 300.0, 100.0, 150.0);
        assert_eq!(r.speedup(), 2.0);
        assert_eq!(r.speedup_t1(), 3.0);
        let rows = vec![row(1, 1, 100.0, 100.0, 50.0), row(1, 8, 250.0, 100.0, 50.0), row(6, 8, 900.0, 100.0, 50.0)];
        assert_eq!(up_to(&rows, |r| r.cns == 1).map(|r| r.nic_units), Some(8));
        assert_eq!(up_to(&rows, |r| r.cns == 6).map(|r| r.speedup()), Some(9.0));
        assert!(up_to(&rows, |r| r.cns == 2).is_none());
        assert_eq!(down_to(&rows, |_| true).map(|r| r.speedup()), Some(1.0));
    }

    #[test]
    fn configs_cover_both_readings_on_one_cn_and_at_scale() {
        let c = configs(10, 10, 1, 6);
        assert_eq!(c.len(), 10);
        assert!(c.iter().any(|c| c.name.contains("one MN allocation per object") && c.kv.classes == vec![c.kv.chunk]));
        assert!(c.iter().any(|c| c.name.contains("= MN chunks") && c.kv.chunk == 2048));
        assert!(c.iter().any(|c| c.name.contains("= objects") && c.kv.classes == vec![2048]));
        assert_eq!(c.iter().filter(|c| c.cns == 6).count(), 5);
    }
}
