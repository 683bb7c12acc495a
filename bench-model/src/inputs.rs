//! The cost-model inputs of every scheme, and the primitives measured on the real loopback
//! model (OneSidedMW's chains, the host engine's laps, one-sided READ/WRITE).
//!
//! Everything here is either a `CostModel` parameter (backend-loopback/src/config.rs, each
//! with its source; two come from DESIGN.md §2), a structural fact of a scheme (how many binds,
//! how many CPU steps a request needs), or a measurement of the model running the real code.
//! Nothing is fitted to the outputs the bench compares with the paper.

use omw_core::device::ExecutionMode;
use omw_loopback::cluster::{Cluster, ClusterConfig};
use omw_loopback::{CostModel, NicConfig};

/// Request bytes on the wire (alloc request, free request) and the alloc reply.
pub const ALLOC_REQ_BYTES: u64 = 28;
pub const FREE_REQ_BYTES: u64 = 16;
pub const ALLOC_REPLY_BYTES: u64 = omw_core::wire::message::ALLOC_REPLY_LEN as u64;

/// ODRP's translation: gated NIC-internal phases before each data transfer (DESIGN §5: read
/// the translation-table entry, then turn its big-endian address into the little-endian WQE
/// field with a READ of reversed one-byte SGEs).
pub const ODRP_TRANSLATE_PHASES: u64 = 2;
/// ODRP page allocation / free in its chain: queue fetch-and-add, read the slot, write the
/// translation entry.
pub const ODRP_ALLOC_PHASES: u64 = 3;
/// ODRP's page size (its paging is fixed at 4 KiB, §1).
pub const ODRP_PAGE: u64 = 4096;

/// The RPC-MW servers are event-driven: the MN core handles a request's event (receive,
/// parse, free-list pop and owner record, posting the work requests) and goes on to the next;
/// device work (binds, the reply) runs without it.
///
/// - **Type-1** (one type-1 window per chunk, not bound to a QP, so one window serves every
///   access QP — and any QP of the PD): one event per alloc — `ibv_bind_mw` posts the bind on
///   the reply's QP, and a send posted after a bind on the same QP is ordered behind it
///   (`ibv_bind_mw(3)`), so the reply needs no second event. A free: one event, the
///   invalidation posted.
/// - **Type-2** (G type-2 windows per chunk, each bound by a BIND_MW work request on the QP it
///   becomes bound to): the G binds go on G different QPs, so the reply, on the request's QP,
///   can only be posted once their completions arrived: two events per alloc. A free: one
///   event, the invalidations posted on the windows' QPs.
///
/// The cost of one event, `Inputs::rpc_cpu_ns`, is swept over [`RPC_CPU_SWEEP`]: eRPC (Kalia
/// et al., NSDI'19; DESIGN.md §10) serves a small RPC in ≈ 100 ns of one core (10 M RPC/s) —
/// the low end; 1.6 µs is the 4 × 400 ns the earlier model charged a type-1 alloc
/// (`host_engine_step_ns`, calibrated, not sourced); 3.2 µs is about what the paper's 170 µs
/// for 24 simultaneous type-2 requests on one core implies (170 µs / 24 / 2 events), the high
/// end. The default, 200 ns, is eRPC's RPC and one more work request posted (the bind).
pub const RPC_CPU_NS: u64 = 200;
pub const RPC_CPU_SWEEP: [u64; 6] = [100, 200, 400, 800, 1600, 3200];

/// The RNR timer a CN's request waits when it finds its CN's chain re-arming (no receive
/// posted yet): the RC responder answers RNR NAK and the requester sends again after the
/// responder's `min_rnr_timer` (IBTA RNR timer encoding; `ibv_modify_qp(3)`). omw's verbs
/// transport sets encoding 12 (0.64 ms) on the MN's QPs today; encoding 1 (0.01 ms) is the
/// shortest — the default here, what an MN serving multi-threaded CNs should set; 0 = a CN
/// that paces itself (waits the measured re-arm before its next request). Swept over
/// [`RNR_SWEEP`].
pub const RNR_TIMER_NS: u64 = 10_000;
pub const RNR_SWEEP: [u64; 3] = [0, 10_000, 640_000];

/// Costs of one scheme's allocation and free, as used by the queueing simulator.
#[derive(Clone, Copy, Debug, Default)]
pub struct CtlCosts {
    /// Uncontended CN-visible alloc latency (request posted → reply landed).
    pub alloc_ns: u64,
    /// MN CPU time per alloc (0 when offloaded).
    pub alloc_cpu_ns: u64,
    /// Device time the MN CPU waits for synchronously per alloc (host engine / RPC).
    pub alloc_dev_ns: u64,
    /// MN NIC send-engine occupancy per alloc (offloaded chains).
    pub alloc_nic_ns: u64,
    /// MN work per free after the request arrived (chain until done, or CPU + device).
    pub free_ns: u64,
    pub free_cpu_ns: u64,
    pub free_dev_ns: u64,
    pub free_nic_ns: u64,
    /// Host-engine steps per lap (measured) or stated steps (type-1).
    pub alloc_steps: u64,
    pub free_steps: u64,
    /// MN WQEs executed per alloc / free (offloaded).
    pub alloc_mn_wqes: u64,
    pub free_mn_wqes: u64,
    /// Offloaded: from the reply until the alloc chain is re-armed for the CN's next request
    /// (its commit: markers cleared, the RECV enabled again), measured on the model. A request
    /// arriving before then finds no receive posted.
    pub alloc_rearm_ns: u64,
}

/// What was measured on the loopback model for one pool geometry.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub group_size: u8,
    pub chunk_size: u64,
    pub osmw: CtlCosts,
    pub host_engine: CtlCosts,
    /// OneSidedMW alloc latencies of one batch of `batch` concurrent requesters (one per CN),
    /// straight from the fabric's completion timestamps, and the batch's duration.
    pub osmw_batch: Vec<u64>,
    pub osmw_batch_round_ns: u64,
    /// Gated phases on the alloc chain's path from the request to the reply
    /// (`ChainLayout::critical_path`, the MN's chain as built for this geometry).
    pub alloc_gates: u32,
    /// The alloc latency's floor from independent inputs ([`Inputs::alloc_floor`]).
    pub alloc_floor: AllocFloor,
    /// The chain layout the model's default device chose for the chains measured here.
    pub variant: omw_core::chain::variant::ChainVariant,
    /// The same chains laid out to bind every window to the poster (the layout a device that
    /// refuses or redirects a bind naming another QP runs; docs/MLX5.md "Binds to the
    /// poster"), measured the same way in the same run ([`measure_poster`]; only for the
    /// geometries `omw bench` reports, not for every point of a sweep).
    pub poster: Option<PosterLatency>,
}

/// One alloc and one free of the layout that binds to the poster, as [`measure_geometry`]
/// times the default layout's: request to reply, and the free's chain until idle.
#[derive(Clone, Copy, Debug, Default)]
pub struct PosterLatency {
    pub alloc_ns: u64,
    pub free_ns: u64,
    pub alloc_floor: AllocFloor,
    /// NIC unit time per alloc and per free with every CN asking at once (as
    /// [`CtlCosts::alloc_nic_ns`] for the default layout).
    pub alloc_nic_ns: u64,
    pub free_nic_ns: u64,
}

/// What no alloc chain can beat on the modelled device: the request's transit, one WQE fetch
/// per gated phase, the binds one after another, the reply's transit — nothing else (no
/// copy, no pop, no CAS on the path). Each term from the cost model's sourced inputs.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllocFloor {
    pub request_ns: u64,
    pub gated_fetch_ns: u64,
    pub gates: u32,
    pub bind_ns: u64,
    pub binds: u32,
    pub reply_ns: u64,
}

impl AllocFloor {
    pub fn total_ns(&self) -> u64 {
        self.request_ns + self.gates as u64 * self.gated_fetch_ns + self.binds as u64 * self.bind_ns + self.reply_ns
    }
}

#[derive(Clone, Debug)]
pub struct Inputs {
    pub cost: CostModel,
    pub mn_cores: usize,
    /// MN NIC processing units, in the loopback model (`cost.nic_units`) and the simulator.
    pub nic_units: usize,
    /// One-sided READ / WRITE round trips measured on the model: (bytes, ns).
    pub read_rtt: [(u64, u64); 2],
    pub write_rtt: [(u64, u64); 2],
    /// MN CPU time of one RPC-MW server event ([`RPC_CPU_NS`], swept).
    pub rpc_cpu_ns: u64,
    /// The MN's RNR timer as a CN's request meets it ([`RNR_TIMER_NS`], swept).
    pub rnr_timer_ns: u64,
    /// Alloc chains per CN (`MnConfig::alloc_chains`): the simulator serves a CN's requests on
    /// whichever of its chains is free first.
    pub alloc_chains: u16,
}

impl Inputs {
    /// The floor of an alloc through a chain with `gates` gated phases binding `g` windows:
    /// the request's transit, a WQE fetch after each gate opens (PCIe read + issue), `g`
    /// binds (each fences the next, `CostModel::bind_ns`), the reply's transit. Pass only the
    /// gates whose next WQE cannot be fetched before the gate opens: an enable limit always;
    /// a WAIT only on a device that stops fetching at an unsatisfied WAIT (one that fetches
    /// past it has the next WQE in hand when the WAIT is satisfied: [`fetch_gates`]).
    pub fn alloc_floor(&self, g: u8, gates: u32) -> AllocFloor {
        let c = &self.cost;
        AllocFloor {
            request_ns: self.transit(ALLOC_REQ_BYTES),
            gated_fetch_ns: c.pcie_read_ns + c.wqe_ns,
            gates,
            bind_ns: c.bind_ns,
            binds: g as u32,
            reply_ns: self.transit(ALLOC_REPLY_BYTES),
        }
    }

    /// Request transit CN → MN until the MN's receive completes: issue, PCIe read of the
    /// payload, serialisation, wire, responder, posted write of the payload.
    pub fn transit(&self, bytes: u64) -> u64 {
        let c = &self.cost;
        c.wqe_ns + c.pcie_read_ns + c.bytes_ns(bytes) + c.wire_ns + c.responder_ns + c.pcie_write_ns
    }
    /// A WRITE of `bytes` between two hosts until its ACK: issue, PCIe read, serialisation,
    /// wire, responder, wire back.
    pub fn write_rtt(&self, bytes: u64) -> u64 {
        let c = &self.cost;
        c.wqe_ns + c.pcie_read_ns + c.bytes_ns(bytes) + 2 * c.wire_ns + c.responder_ns
    }
    fn interp(pts: &[(u64, u64); 2], len: u64) -> u64 {
        let (x0, y0) = pts[0];
        let (x1, y1) = pts[1];
        if x1 == x0 {
            return y0;
        }
        (y0 as i64 + (y1 as i64 - y0 as i64) * (len as i64 - x0 as i64) / (x1 as i64 - x0 as i64)).max(0) as u64
    }
    pub fn read_ns(&self, len: u64) -> u64 {
        Self::interp(&self.read_rtt, len)
    }
    pub fn write_ns(&self, len: u64) -> u64 {
        Self::interp(&self.write_rtt, len)
    }
    /// A phase of an offloaded chain, as the loopback model runs one: the gating WAIT, the
    /// PCIe fetch of the WQE behind it, and a loopback READ (issue, responder, DMA read of the
    /// source, posted write of the destination).
    pub fn loop_phase_ns(&self) -> u64 {
        let c = &self.cost;
        c.wqe_ns + c.pcie_read_ns + c.wqe_ns + c.responder_ns + c.pcie_read_ns + c.pcie_write_ns
    }
    /// ODRP access latency, analytical on the cost model: the request SEND, the translation
    /// phases in the MN NIC, then the data moved by the MN (WRITE to the CN for a load, READ
    /// from the CN for a store).
    pub fn odrp_access_ns(&self, len: u64, store: bool) -> u64 {
        let c = &self.cost;
        let data = if store {
            // the MN READs the CN's data: a READ round trip
            c.wqe_ns + 2 * c.wire_ns + c.responder_ns + c.pcie_read_ns + c.bytes_ns(len) + c.pcie_write_ns
        } else {
            // the MN WRITEs the data to the CN: it is there once placed
            self.transit(len)
        };
        self.transit(16) + ODRP_TRANSLATE_PHASES * self.loop_phase_ns() + data
    }
    /// RPC-MW type-1, event-driven (see [`RPC_CPU_NS`]): one event per request; the bind and
    /// the reply (ordered behind it on one QP) run on the device.
    pub fn type1(&self) -> CtlCosts {
        let c = &self.cost;
        let reply = self.write_rtt(ALLOC_REPLY_BYTES);
        let cpu = self.rpc_cpu_ns;
        let alloc_dev = c.bind_ns + reply;
        CtlCosts {
            alloc_ns: self.transit(ALLOC_REQ_BYTES) + cpu + alloc_dev,
            alloc_cpu_ns: cpu,
            alloc_dev_ns: alloc_dev,
            free_ns: cpu + c.bind_ns,
            free_cpu_ns: cpu,
            free_dev_ns: c.bind_ns,
            alloc_steps: 1,
            free_steps: 1,
            ..Default::default()
        }
    }
    /// RPC-MW type-2, event-driven: two events per alloc (the request; the binds' completions,
    /// after which the reply is posted), G binds on G QPs side by side; one event per free.
    pub fn type2_rpc(&self) -> CtlCosts {
        let c = &self.cost;
        let reply = self.write_rtt(ALLOC_REPLY_BYTES);
        let cpu = self.rpc_cpu_ns;
        CtlCosts {
            alloc_ns: self.transit(ALLOC_REQ_BYTES) + 2 * cpu + c.bind_ns + reply,
            alloc_cpu_ns: 2 * cpu,
            alloc_dev_ns: c.bind_ns + reply,
            free_ns: cpu + c.bind_ns,
            free_cpu_ns: cpu,
            free_dev_ns: c.bind_ns,
            alloc_steps: 2,
            free_steps: 1,
            ..Default::default()
        }
    }
    /// ODRP's in-chain page allocation.
    pub fn odrp_ctl(&self) -> CtlCosts {
        let c = &self.cost;
        let phases = ODRP_ALLOC_PHASES * self.loop_phase_ns();
        let nic = ODRP_ALLOC_PHASES * 2 * c.wqe_ns + c.wqe_ns;
        CtlCosts {
            alloc_ns: self.transit(16) + phases + self.transit(ALLOC_REPLY_BYTES),
            alloc_nic_ns: nic,
            free_ns: phases,
            free_nic_ns: nic,
            ..Default::default()
        }
    }
}

/// The gates on a chain's path that cost a WQE fetch once they open: every ENABLE (its limit is
/// the fetch bound), and a WAIT only where the device stops fetching behind an unsatisfied one
/// (`WaitPrefetch::Stops`); a device that fetches past it has the next WQE already (the model's
/// default, `NicConfig::DEFAULT_BEHAVIOUR`).
pub fn fetch_gates(path: omw_core::chain::Gates, prefetch: omw_core::device::behaviour::WaitPrefetch) -> u32 {
    match prefetch {
        omw_core::device::behaviour::WaitPrefetch::Stops => path.gates,
        omw_core::device::behaviour::WaitPrefetch::FetchesPast => path.gates.saturating_sub(path.waits),
    }
}

fn cluster(
    mode: ExecutionMode,
    cns: usize,
    g: u8,
    chunk: u64,
    chunks: u32,
    cost: CostModel,
) -> Result<Cluster, String> {
    cluster_laid_out(mode, cns, g, chunk, chunks, cost, None)
}

/// [`cluster`] with the chains laid out as `variant` (None: the one the device's answers
/// choose).
fn cluster_laid_out(
    mode: ExecutionMode,
    cns: usize,
    g: u8,
    chunk: u64,
    chunks: u32,
    cost: CostModel,
    variant: Option<omw_core::chain::variant::ChainVariant>,
) -> Result<Cluster, String> {
    let mut cfg = ClusterConfig::paper_like();
    cfg.chain_variant = variant;
    cfg.cns = cns;
    cfg.group_size = g;
    cfg.chunk_size = chunk;
    cfg.chunks = chunks;
    cfg.quota = chunks;
    cfg.mode = Some(mode);
    let nic =
        if mode == ExecutionMode::HostEngine { NicConfig::strict().with_offload(false) } else { NicConfig::strict() };
    cfg.nic = nic.with_prefetch(8).with_cost(cost);
    cfg.nic.ring_arena_bytes = (cns as u64 + 2) * (64 << 10);
    // the alloc chains pop ahead as they do on a deployment's pool (millions of chunks, so the
    // MN's default turns it on); the measuring pools here are small only to save model memory
    cfg.pop_ahead = Some(mode == ExecutionMode::Offloaded);
    Cluster::new(cfg).map_err(|e| format!("model cluster: {e}"))
}

/// [`PosterLatency`] for the geometry `m` measured: its layout binding to the poster, on a
/// cluster of its own with as many CNs, measured as [`measure_geometry`] measures the default.
pub fn measure_poster(inp: &Inputs, m: &Measured) -> Result<PosterLatency, String> {
    let variant = Some(m.variant.binding_to_poster());
    let r = measure_chains(inp, m.group_size, m.chunk_size, m.osmw_batch.len().max(1), variant)?;
    if !r.variant.binds_to_poster {
        return Err("the model did not lay the chains out to bind to the poster".into());
    }
    Ok(PosterLatency {
        alloc_ns: r.osmw.alloc_ns,
        free_ns: r.osmw.free_ns,
        alloc_floor: r.alloc_floor,
        alloc_nic_ns: r.osmw.alloc_nic_ns,
        free_nic_ns: r.osmw.free_nic_ns,
    })
}

/// One layout's chains measured on the model ([`measure_chains`]).
struct ChainsRun {
    osmw: CtlCosts,
    alloc_gates: u32,
    alloc_floor: AllocFloor,
    batch: Vec<u64>,
    batch_round_ns: u64,
    variant: omw_core::chain::variant::ChainVariant,
}

/// The offloaded chains laid out as `variant` (None: as the device's answers choose) with
/// `batch` CNs: a warmed-up alloc and free of one CN, then every CN asking at once.
fn measure_chains(
    inp: &Inputs,
    g: u8,
    chunk: u64,
    batch: usize,
    variant: Option<omw_core::chain::variant::ChainVariant>,
) -> Result<ChainsRun, String> {
    let chunks = (batch as u32 * 2).max(8);
    let mut c = cluster_laid_out(ExecutionMode::Offloaded, batch, g, chunk, chunks, inp.cost, variant)?;
    let mut r = ChainsRun {
        osmw: CtlCosts::default(),
        alloc_gates: 0,
        alloc_floor: AllocFloor::default(),
        batch: Vec::new(),
        batch_round_ns: 0,
        variant: c.driver.mn.config().chain_variant,
    };
    let mn = c.mn_host;
    let wq = |c: &Cluster| c.fabric.borrow().host_stats(mn).map(|s| s.wqes_executed).unwrap_or(0);
    let busy = |c: &Cluster| c.fabric.borrow().host_stats(mn).map(|s| s.nic_send_busy_ns).unwrap_or(0);
    // warm-up lap (first laps of each CN are armed at connect)
    let a = c.alloc(0).map_err(|e| format!("alloc: {e}"))?;
    c.free(0, &a).map_err(|e| format!("free: {e}"))?;
    let (t0, w0) = (c.now(), wq(&c));
    let a = c.alloc(0).map_err(|e| format!("alloc: {e}"))?;
    r.osmw.alloc_ns = c.cns[0].last_reply_at - t0;
    r.osmw.alloc_mn_wqes = wq(&c) - w0;
    // the model ran until idle: the chain's commit (its re-arm) is the last of it
    r.osmw.alloc_rearm_ns = c.now().saturating_sub(c.cns[0].last_reply_at);
    let [layout, _] = c.driver.mn.chain_sizing_layouts().map_err(|e| format!("alloc chain: {e}"))?;
    let path = layout.critical_path().unwrap_or(omw_core::chain::Gates::ZERO);
    r.alloc_gates = path.gates;
    r.alloc_floor = inp.alloc_floor(g, fetch_gates(path, NicConfig::DEFAULT_BEHAVIOUR.wait_prefetch));
    let (t0, w0) = (c.now(), wq(&c));
    c.free(0, &a).map_err(|e| format!("free: {e}"))?;
    r.osmw.free_ns = (c.now() - t0).saturating_sub(inp.transit(FREE_REQ_BYTES));
    r.osmw.free_mn_wqes = wq(&c) - w0;
    // a batch: every CN posts one alloc at the same instant; they contend in the MN NIC
    let t0 = c.now();
    let b0 = busy(&c);
    let toks: Vec<u32> = (0..batch).map(|i| c.alloc_begin(i)).collect::<Result<_, _>>().map_err(|e| e.to_string())?;
    c.pump().map_err(|e| e.to_string())?;
    r.batch_round_ns = c.now() - t0;
    let mut held = Vec::new();
    for (i, t) in toks.into_iter().enumerate() {
        held.push(c.alloc_finish(i, t).map_err(|e| format!("batch alloc cn{i}: {e}"))?);
        r.batch.push(c.cns[i].last_reply_at - t0);
    }
    r.batch.sort_unstable();
    // the NIC occupancy of one alloc: unit time summed over the units, per alloc
    r.osmw.alloc_nic_ns = (busy(&c) - b0) / batch as u64;
    let b0 = busy(&c);
    for (i, a) in held.iter().enumerate() {
        c.free_begin(i, a).map_err(|e| format!("batch free cn{i}: {e}"))?;
    }
    c.pump().map_err(|e| e.to_string())?;
    r.osmw.free_nic_ns = (busy(&c) - b0) / batch as u64;
    c.check_invariants()?;
    Ok(r)
}

/// One-sided READ/WRITE round trips on the model, through a bound window. `nic_units`
/// processing units per NIC, in the model and in the simulator alike.
pub fn measure_inputs(cost: CostModel, mn_cores: usize, nic_units: usize) -> Result<Inputs, String> {
    let cost = cost.with_units(nic_units as u32);
    let mut c = cluster(ExecutionMode::Offloaded, 1, 2, 16384, 4, cost)?;
    let a = c.alloc(0).map_err(|e| format!("alloc: {e}"))?;
    let mut read = [(0, 0); 2];
    let mut write = [(0, 0); 2];
    for (k, len) in [8u64, 4096].into_iter().enumerate() {
        let t0 = c.now();
        let _ = c.write(0, &a, 0, 0, &vec![7u8; len as usize]);
        write[k] = (len, c.now() - t0);
        let t0 = c.now();
        let _ = c.read(0, &a, 0, 0, len as usize);
        read[k] = (len, c.now() - t0);
    }
    Ok(Inputs {
        cost,
        mn_cores,
        nic_units,
        read_rtt: read,
        write_rtt: write,
        rpc_cpu_ns: RPC_CPU_NS,
        rnr_timer_ns: RNR_TIMER_NS,
        alloc_chains: 1,
    })
}

/// Measure OneSidedMW's chains and the host engine's laps for one geometry.
pub fn measure_geometry(inp: &Inputs, g: u8, chunk: u64, batch: usize) -> Result<Measured, String> {
    let chunks = (batch as u32 * 2).max(8);
    let mut m = Measured { group_size: g, chunk_size: chunk, ..Default::default() };
    // ---- offloaded: the real chains in the modelled NIC
    let r = measure_chains(inp, g, chunk, batch, None)?;
    m.osmw = r.osmw;
    m.alloc_gates = r.alloc_gates;
    m.alloc_floor = r.alloc_floor;
    m.osmw_batch = r.batch;
    m.osmw_batch_round_ns = r.batch_round_ns;
    m.variant = r.variant;

    // ---- host engine: the same layout run by the MN CPU (RPC-MW type-2)
    let mut c = cluster(ExecutionMode::HostEngine, 1, g, chunk, chunks, inp.cost)?;
    let mn = c.mn_host;
    let cpu = |c: &Cluster| c.fabric.borrow().host_stats(mn).map(|s| s.cpu_busy_ns).unwrap_or(0);
    let a = c.alloc(0).map_err(|e| format!("alloc: {e}"))?;
    c.free(0, &a).map_err(|e| format!("free: {e}"))?;
    let (t0, c0, s0) = (c.now(), cpu(&c), c.driver.stats.cpu_steps);
    let a = c.alloc(0).map_err(|e| format!("alloc: {e}"))?;
    let he = &mut m.host_engine;
    he.alloc_cpu_ns = cpu(&c) - c0;
    he.alloc_steps = c.driver.stats.cpu_steps - s0 + 1;
    // the reply lands before the cluster charges the lap's CPU time; the CPU works first
    let reply = c.cns[0].last_reply_at - t0;
    he.alloc_dev_ns = reply.saturating_sub(inp.transit(ALLOC_REQ_BYTES)) + inp.cost.wire_ns;
    he.alloc_ns = reply + he.alloc_cpu_ns;
    let (t0, c0, s0) = (c.now(), cpu(&c), c.driver.stats.cpu_steps);
    c.free(0, &a).map_err(|e| format!("free: {e}"))?;
    he.free_cpu_ns = cpu(&c) - c0;
    he.free_steps = c.driver.stats.cpu_steps - s0 + 1;
    he.free_dev_ns = (c.now() - t0).saturating_sub(inp.transit(FREE_REQ_BYTES) + he.free_cpu_ns);
    he.free_ns = he.free_cpu_ns + he.free_dev_ns;
    c.check_invariants()?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use omw_core::chain::Gates;
    use omw_core::device::behaviour::WaitPrefetch;

    /// A WAIT on the path costs a fetch only where the device stops fetching at it; an ENABLE
    /// always (its limit is the fetch bound).
    #[test]
    fn a_wait_costs_a_fetch_only_where_fetching_stops_at_it() {
        let path = Gates { gates: 2, waits: 1 };
        assert_eq!(fetch_gates(path, WaitPrefetch::Stops), 2);
        assert_eq!(fetch_gates(path, WaitPrefetch::FetchesPast), 1);
        assert_eq!(fetch_gates(Gates { gates: 5, waits: 0 }, WaitPrefetch::FetchesPast), 5);
    }
}
