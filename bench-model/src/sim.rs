//! A small discrete-event queueing simulator for concurrency on the modelled cluster.
//!
//! Clients run closed-loop programs of requests; each request is a list of stages: a pure
//! delay (wire, PCIe, NIC-internal latency), or the use of a shared MN resource — the MN NIC's
//! processing units, send side and responder side (N servers each, as in the loopback model),
//! the MN's 100 Gb/s link in each direction (one server each: payload serialisation), and the
//! MN CPU (N cores). Requests queue FCFS at a resource (the model pins a QP to one unit; the
//! simulator lets a request take any free unit — a bias towards parallelism, docs/COST-MODEL.md).
//! Background jobs (a free's chain, a prefetch) occupy resources without stalling a client.
//!
//! Stage durations come from the cost model and from single operations measured on the real
//! loopback model (see `inputs.rs`); nothing here is fitted to an output.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
/// A shared resource of the MN.
pub enum Res {
    /// The MN NIC units' send side (chains' WQEs, binds' issue, replies).
    Nic = 0,
    /// The MN NIC units' responder side (incoming one-sided requests and SENDs).
    Rx = 1,
    /// The MN CPU cores.
    Cpu = 2,
    /// The MN's link, leaving the MN (READ data, replies).
    LinkOut = 3,
    /// The MN's link, arriving at the MN (WRITE data, requests).
    LinkIn = 4,
}

/// Resources of the simulated MN.
pub const RESOURCES: usize = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Delay(u64),
    /// Queue at `res`; the server is busy `hold` ns; the job continues `leave` ns after its
    /// service started (`leave` < `hold` when the server keeps working after answering,
    /// `leave` > `hold` when the work outlasts its occupancy, like a chain's latency).
    Use {
        res: Res,
        hold: u64,
        leave: u64,
    },
    /// Start a background job running the next `n` stages; the client goes on at once.
    Detach(u8),
    /// One of a CN's chains (`chain` .. `chain + count`: its alloc chains, or its one free
    /// chain), each running one lap at a time: the request goes to the one that is free first
    /// (the CN sends on an idle chain) and is served once that chain's previous lap re-armed
    /// it, holding it `hold` ns and going on `leave` ns after its lap started. A request that
    /// arrives while its chain is busy finds no receive posted: the RC transport answers RNR
    /// and the sender tries again every `rnr` ns (the responder's RNR timer), so it starts at
    /// the first retry after the chain is free (`rnr` 0: the next instant, as if the CN knew).
    Chain {
        chain: u16,
        count: u16,
        hold: u64,
        leave: u64,
        rnr: u64,
    },
    /// End of a request: its latency is recorded under this tag.
    End(u8),
    /// Wait until every client reached a barrier and no background work is left (a round of
    /// the allocation micro-benchmark: the model's `pump` runs until idle).
    Barrier,
}

/// One client's program: stages with `End` markers between requests.
pub type Program = Vec<Stage>;

#[derive(Debug, Default, Clone)]
pub struct SimResult {
    pub makespan_ns: u64,
    /// Latencies (ns) per tag.
    pub latencies: Vec<Vec<u64>>,
    /// Busy time per resource, and server counts.
    pub busy_ns: [u64; RESOURCES],
    pub servers: [usize; RESOURCES],
    /// Requests that found their CN's chain busy and waited for RNR retries.
    pub rnr_naks: u64,
}

impl SimResult {
    pub fn total_requests(&self) -> usize {
        self.latencies.iter().map(|v| v.len()).sum()
    }
    pub fn utilisation(&self, r: Res) -> f64 {
        let i = r as usize;
        if self.makespan_ns == 0 || self.servers[i] == 0 {
            return 0.0;
        }
        self.busy_ns[i] as f64 / (self.servers[i] as f64 * self.makespan_ns as f64)
    }
    /// Requests per second of modelled time.
    pub fn throughput(&self) -> f64 {
        if self.makespan_ns == 0 {
            return 0.0;
        }
        self.total_requests() as f64 * 1e9 / self.makespan_ns as f64
    }
    pub fn all_latencies(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.latencies.iter().flatten().copied().collect();
        v.sort_unstable();
        v
    }
}

/// p-quantile (0..=1) of sorted values.
pub fn quantile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

pub fn mean(v: &[u64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<u64>() as f64 / v.len() as f64
    }
}

struct Job {
    /// Index into programs (clients) or into `bg`.
    prog: usize,
    pc: usize,
    /// For background jobs: the stage index they stop at.
    end: usize,
    client: bool,
    req_start: u64,
}

/// Run `programs` (one per client, all starting at 0) on an MN with `cpu_cores` cores and
/// `nic_units` NIC processing units (send and responder side each).
pub fn run(programs: &[Program], cpu_cores: usize, nic_units: usize) -> SimResult {
    let servers = [nic_units.max(1), nic_units.max(1), cpu_cores.max(1), 1, 1];
    let mut busy_until: [Vec<u64>; RESOURCES] = servers.map(|n| vec![0; n]);
    let mut res = SimResult { servers, ..Default::default() };
    let mut jobs: Vec<Job> = Vec::new();
    let mut heap: BinaryHeap<Reverse<(u64, u64, usize)>> = BinaryHeap::new();
    let mut seq = 0u64;
    for (i, p) in programs.iter().enumerate() {
        jobs.push(Job { prog: i, pc: 0, end: p.len(), client: true, req_start: 0 });
        heap.push(Reverse((0, seq, i)));
        seq += 1;
    }
    let mut last = 0u64;
    let mut parked: Vec<usize> = Vec::new();
    // per chain: free from
    let mut chain_free: Vec<u64> = Vec::new();
    loop {
        let Some(Reverse((t, _, j))) = heap.pop() else {
            if parked.is_empty() {
                break;
            }
            // everyone is at the barrier and the MN is idle: release them together
            for j in parked.drain(..) {
                jobs[j].req_start = last;
                heap.push(Reverse((last, seq, j)));
                seq += 1;
            }
            continue;
        };
        last = last.max(t);
        let job = &mut jobs[j];
        if job.pc >= job.end {
            continue;
        }
        let stage = programs[job.prog][job.pc];
        job.pc += 1;
        let next_t = match stage {
            Stage::Delay(d) => t + d,
            Stage::Use { res: r, hold, leave } => {
                let k = r as usize;
                let (si, &b) = busy_until[k].iter().enumerate().min_by_key(|(_, b)| **b).unwrap_or((0, &0));
                let start = t.max(b);
                busy_until[k][si] = start + hold;
                res.busy_ns[k] += hold;
                last = last.max(start + hold);
                start + leave
            }
            Stage::Chain { chain, count, hold, leave, rnr } => {
                let last_chain = chain as usize + count.max(1) as usize - 1;
                if chain_free.len() <= last_chain {
                    chain_free.resize(last_chain + 1, 0);
                }
                // the CN's chain that is free first
                let k = (chain as usize..=last_chain).min_by_key(|k| chain_free[*k]).unwrap_or(chain as usize);
                let free = chain_free[k];
                let start = if free <= t {
                    t
                } else if rnr == 0 {
                    free
                } else {
                    res.rnr_naks += 1;
                    t + (free - t).div_ceil(rnr) * rnr
                };
                chain_free[k] = start + hold;
                last = last.max(start + hold);
                start + leave
            }
            Stage::Detach(n) => {
                let from = job.pc;
                let to = (from + n as usize).min(job.end);
                job.pc = to;
                let prog = job.prog;
                jobs.push(Job { prog, pc: from, end: to, client: false, req_start: t });
                heap.push(Reverse((t, seq, jobs.len() - 1)));
                seq += 1;
                t
            }
            Stage::End(tag) => {
                if job.client {
                    let l = &mut res.latencies;
                    if l.len() <= tag as usize {
                        l.resize(tag as usize + 1, Vec::new());
                    }
                    l[tag as usize].push(t - job.req_start);
                    job.req_start = t;
                }
                t
            }
            Stage::Barrier => {
                if job.pc < job.end {
                    parked.push(j);
                }
                continue;
            }
        };
        if jobs[j].pc < jobs[j].end {
            heap.push(Reverse((next_t, seq, j)));
            seq += 1;
        } else {
            last = last.max(next_t);
        }
    }
    res.makespan_ns = last;
    for v in res.latencies.iter_mut() {
        v.sort_unstable();
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_server_queues_and_n_servers_do_not() {
        let req = vec![Stage::Use { res: Res::Cpu, hold: 100, leave: 100 }, Stage::End(0)];
        let progs: Vec<Program> = (0..4).map(|_| req.clone()).collect();
        let r1 = run(&progs, 1, 1);
        assert_eq!(r1.makespan_ns, 400);
        assert_eq!(r1.latencies[0], vec![100, 200, 300, 400]);
        assert!((r1.utilisation(Res::Cpu) - 1.0).abs() < 1e-9);
        let r4 = run(&progs, 4, 1);
        assert_eq!(r4.makespan_ns, 100);
        assert_eq!(r4.latencies[0], vec![100; 4]);
    }

    #[test]
    fn responder_units_are_parallel_and_the_link_is_shared() {
        let rx = vec![Stage::Use { res: Res::Rx, hold: 100, leave: 100 }, Stage::End(0)];
        let progs: Vec<Program> = (0..4).map(|_| rx.clone()).collect();
        assert_eq!(run(&progs, 1, 1).makespan_ns, 400);
        assert_eq!(run(&progs, 1, 4).makespan_ns, 100, "four units");
        let link = vec![Stage::Use { res: Res::LinkOut, hold: 100, leave: 100 }, Stage::End(0)];
        let progs: Vec<Program> = (0..4).map(|_| link.clone()).collect();
        let r = run(&progs, 4, 16);
        assert_eq!(r.makespan_ns, 400, "one link, whatever the units");
        assert!((r.utilisation(Res::LinkOut) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn detached_work_does_not_stall_the_client() {
        let p = vec![
            Stage::Delay(10),
            Stage::Detach(1),
            Stage::Use { res: Res::Nic, hold: 1000, leave: 1000 },
            Stage::End(0),
            Stage::Use { res: Res::Nic, hold: 5, leave: 5 },
            Stage::End(1),
        ];
        let r = run(&[p], 1, 1);
        assert_eq!(r.latencies[0], vec![10]);
        // the second request waits for the background job on the NIC
        assert_eq!(r.latencies[1], vec![1005]);
        assert_eq!(r.makespan_ns, 1015);
    }

    #[test]
    fn a_cns_chain_runs_one_lap_at_a_time_and_a_busy_chain_costs_rnr_retries() {
        let req =
            |chain: u16, rnr: u64| vec![Stage::Chain { chain, count: 1, hold: 100, leave: 60, rnr }, Stage::End(0)];
        // two requests on one chain: the second waits for the first lap (and an RNR retry)
        let r = run(&[req(0, 0), req(0, 0)], 1, 1);
        assert_eq!(r.latencies[0], vec![60, 160]);
        assert_eq!(r.rnr_naks, 0);
        let r = run(&[req(0, 30), req(0, 30)], 1, 1);
        assert_eq!(r.latencies[0], vec![60, 180], "retries at 30, 60, 90, 120: served at 120");
        assert_eq!(r.rnr_naks, 1);
        // different CNs' chains run side by side
        let r = run(&[req(0, 30), req(2, 30)], 1, 1);
        assert_eq!(r.latencies[0], vec![60, 60]);
    }

    #[test]
    fn a_cn_with_several_alloc_chains_overlaps_its_requests() {
        let req = |count: u16| vec![Stage::Chain { chain: 0, count, hold: 100, leave: 60, rnr: 30 }, Stage::End(0)];
        // two chains: the second request takes the idle one, no RNR retry
        let r = run(&[req(2), req(2)], 1, 1);
        assert_eq!(r.latencies[0], vec![60, 60]);
        assert_eq!(r.rnr_naks, 0);
        // three requests on two chains: the third waits for the first lap to re-arm its chain
        let r = run(&[req(2), req(2), req(2)], 1, 1);
        assert_eq!(r.latencies[0], vec![60, 60, 180]);
        assert_eq!(r.rnr_naks, 1);
    }

    #[test]
    fn barrier_waits_for_everyone_and_the_background() {
        let a = vec![Stage::Delay(10), Stage::End(0), Stage::Barrier, Stage::Delay(1), Stage::End(1)];
        let b = vec![
            Stage::Detach(1),
            Stage::Use { res: Res::Nic, hold: 50, leave: 50 },
            Stage::Delay(20),
            Stage::End(0),
            Stage::Barrier,
            Stage::Delay(1),
            Stage::End(1),
        ];
        let r = run(&[a, b], 1, 1);
        assert_eq!(r.latencies[0], vec![10, 20]);
        // released at 50 (after the background job), then 1 ns: latency counts from release
        assert_eq!(r.latencies[1], vec![1, 1]);
        assert_eq!(r.makespan_ns, 51);
    }
}
