//! The memory-node daemon: probe the device, lay out the pool, listen on rdma_cm, and run the
//! core's [`MnDriver`] — one loop for every transport ([`Transport`]): the host engine on
//! libibverbs ([`verbs`]: `omw mn`) and the chains in a ConnectX on DEVX
//! (`crate::devx::mn`: `omw mn --offload mlx5`).
//!
//! All protocol decisions are the core's. The loop only turns the connection manager's events
//! into sessions (`crate::sessions`: admission, a CN's connections grouped), hands a complete
//! session to `MnDriver::connect_with_chains` (with a loop QP per extra alloc chain, offloaded), turns disconnects into `Event::CnGone`, drops the
//! connections of CNs the MN evicted, runs the MN's timers when `MnDriver::poll_timeout` says,
//! and counts, logs and exports what happened. How a CN connection gets its QP, and which
//! device the MN runs on, is the transport's.

pub mod class_ledger;
pub mod transport;
pub mod verbs;

pub use transport::{StartUp, Transport};
pub use verbs::{serve, MemoryNodeDaemon, VerbsTransport};

use crate::cm::{CmEvent, CmEventKind, CmId, Refusal, Role};
use crate::device::DeviceChoice;
use crate::error::{human, Result, VerbsError};
use crate::log::Level;
use crate::memlock::{ensure_memlock, memlock_limit, MemlockNeed};
use crate::metrics::{MetricsServer, MnCounters};
use crate::probe;
use crate::sessions::{Admission, Complete, Rejections, Sessions, SESSION_PATIENCE};
use omw_core::chain::ChainKind;
use omw_core::device::ExecutionMode;
use omw_core::device::{DataPath, QpState, WcStatus};
use omw_core::geometry::PoolGeometry;
use omw_core::ids::{CnId, Qpn};
use omw_core::mn::capacity::{DeviceLimits, Footprint};
use omw_core::mn::driver::MnDriver;
use omw_core::mn::host_engine::LapFailure;
use omw_core::mn::plan::MnPlan;
use omw_core::mn::provision::PoolSpec;
use omw_core::mn::{AllocChainQps, Event, MemoryNode, MnStats};
use omw_core::wire::memory_map::MnMemoryMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct MnOptions {
    pub device: Option<String>,
    /// Source GID of the MN's raw QPs (probe, admin pair); None: chosen by type.
    pub gid_index: Option<u8>,
    pub listen: SocketAddr,
    pub pool_size: u64,
    pub chunk_size: u64,
    pub group_size: u8,
    pub max_cns: u32,
    /// Alloc chains one CN may open (1..=`omw_core::mn::MAX_ALLOC_CHAINS`; `--alloc-chains`):
    /// each is a whole alloc chain of its own (an Alloc QP, a scratch area, offloaded a loop
    /// QP), so a CN's allocations overlap. A CN asking for more is refused with the reason.
    pub alloc_chains: u8,
    /// Groups one CN may hold (0: the whole pool).
    pub quota: u32,
    /// Start even if the device cannot isolate CNs.
    pub insecure: bool,
    /// How often to print statistics (zero: never).
    pub stats_every: Duration,
    /// Zero every chunk between owners (default on; `--no-scrub` turns it off).
    pub scrub: bool,
    /// Serve the counters in the Prometheus text format on this address (`GET /metrics`).
    pub metrics: Option<SocketAddr>,
    /// Print the counters as one JSON object per line on stdout at every statistics interval.
    pub stats_json: bool,
    /// The CN lease (zero: off): every CN is probed at half this period, and one that has not
    /// answered by the next probe — its host vanished, or it stopped posting receives — is
    /// evicted and everything it held reclaimed.
    pub lease: Duration,
    /// Run host-engine laps one at a time, busy-waiting each step (the engine before laps of
    /// different CNs ran side by side) — for measurements.
    pub serial_engine: bool,
    /// The tenants file (crate::admission): only its tenants are admitted, each within its
    /// quota and CN slots over all its sessions. None: the MN runs open (any hello admitted,
    /// quotas per CN) and says so at start-up.
    pub tenants: Option<std::path::PathBuf>,
    /// What the device does about the open ConnectX questions (`omw-mlx5-bringup questions`),
    /// read from `--profile`; the offloaded DEVX MN lays its chains out for it and refuses a
    /// device they are not correct on. None: every answer unknown. The host engine needs none.
    pub offload_profile: Option<crate::devx::profile::Profile>,
    /// Hellos seen within the replay window, shared by every daemon started from clones of
    /// these options (the size classes of one MN: `crate::admission::ReplayTable`).
    pub replays: crate::admission::ReplayTable,
}

impl MnOptions {
    /// The pool the options ask for, as the core's provisioning takes it.
    pub fn pool_spec(&self, chunks: u32, max_cns: u32, queue_depth: Option<u16>) -> PoolSpec {
        PoolSpec {
            chunk_size: self.chunk_size,
            chunks,
            group_size: self.group_size,
            max_cns,
            quota: self.quota,
            lease_ns: self.lease.as_nanos().min(u64::MAX as u128) as u64,
            queue_depth,
        }
    }
}

/// How chunks are kept apart on this device.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Protection {
    /// The device enforces window bounds: one pool MR, windows confine each CN to its chunk.
    WindowBounds,
    /// The device checks only MR bounds (soft-RoCE): one MR per chunk, registered at start-up,
    /// each chunk's windows bound in its own MR.
    MrPerChunk,
}

impl std::fmt::Display for Protection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Protection::WindowBounds => "window bounds enforced by the device (one pool MR)",
            Protection::MrPerChunk => {
                "one MR per chunk (the device does not enforce window bounds; MR bounds confine each window to its chunk)"
            }
        })
    }
}

/// The pool the options size, checked against the host (`checked_sizing`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Sizing {
    pub chunks: u32,
    /// CNs served.
    pub max_cns: u32,
}

/// What `MnDaemon::on_counters` calls with the counters at each stats interval (a pool member
/// publishes its free counts from it).
type CounterHook = Box<dyn FnMut(&MnCounters)>;

/// The running daemon on transport `T`.
pub struct MnDaemon<T: Transport> {
    /// Before the driver: the transport's rdma_cm ids go before the device does.
    transport: T,
    pub driver: MnDriver<T::Device>,
    pub protection: Protection,
    pub mode: ExecutionMode,
    pub software_ownership_check: bool,
    /// What the MN decided from the device (`MnPlan::decide`): what the capacity checks of
    /// several classes on one device count with (`classes_fit_device`).
    pub plan: MnPlan,
    opts: MnOptions,
    sessions: Sessions,
    t0: Instant,
    last_stats: Instant,
    last_heartbeat: Instant,
    last_counts: (u64, u64, MnStats),
    /// Allocations and frees of CNs that left (so the exported counters stay monotonic).
    departed: (u64, u64),
    /// CN connections rejoined (`MnDaemon::rejoin`).
    rejoins: u64,
    metrics: Option<MetricsServer>,
    last_publish: Instant,
    /// Called with the counters as often as `--metrics` gets them (the pool's announcer).
    counter_hook: Option<CounterHook>,
    /// What the MN's other classes hold per tenant, as last learned (`class_ledger`).
    learned: class_ledger::Learned,
}

impl<T: Transport> std::fmt::Debug for MnDaemon<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MnDaemon").field("protection", &self.protection).field("mode", &self.mode).finish()
    }
}

const TARGET: &str = "omw_verbs::mn";

pub(crate) fn log(msg: impl AsRef<str>) {
    crate::log::log(TARGET, "omw mn", Level::Info, msg.as_ref());
}

fn debug_enabled() -> bool {
    crate::log::enabled(TARGET, Level::Debug) || std::env::var_os("OMW_DEBUG").is_some()
}

/// An idle daemon (this many turns in a row without work) waits for the connection manager
/// between turns instead of spinning a core…
const IDLE_TURNS: u32 = 2000;
/// …for at most this long, so completions (which it polls) are still picked up promptly.
const IDLE_WAIT: Duration = Duration::from_micros(200);

/// The options' pool, checked, and whether this host can pin it and `extra_pinned(CNs)` bytes
/// more (the DEVX ring arena). Before any probe pins anything; a missing device is the more
/// basic error.
pub(crate) fn checked_sizing(opts: &MnOptions, extra_pinned: impl Fn(u32) -> u64) -> Result<Sizing> {
    if opts.group_size < 2 || opts.group_size > 4 {
        return Err(VerbsError::Config(format!("--group-size {} outside 2..=4", opts.group_size)));
    }
    if opts.chunk_size == 0 || opts.pool_size < opts.chunk_size {
        return Err(VerbsError::Config("--pool-size must hold at least one chunk".into()));
    }
    let chunks = opts.pool_size / opts.chunk_size;
    let chunks = u32::try_from(chunks).map_err(|_| VerbsError::Config("too many chunks".into()))?;
    if opts.alloc_chains == 0 || opts.alloc_chains as usize > omw_core::mn::MAX_ALLOC_CHAINS {
        return Err(VerbsError::Config(format!(
            "--alloc-chains {} outside 1..={}",
            opts.alloc_chains,
            omw_core::mn::MAX_ALLOC_CHAINS
        )));
    }
    crate::device::device_names()?;
    let max_cns = opts.max_cns.clamp(1, omw_core::mn::MAX_CNS as u32);
    let sizing = PoolGeometry::new(opts.chunk_size, opts.chunk_size, chunks, opts.group_size)
        .map_err(|e| VerbsError::Config(format!("pool geometry: {e}")))?;
    // a scratch area per CN and alloc chain, and an Alloc QP per extra chain
    let meta_need = MnMemoryMap::len_for(&sizing, MemoryNode::scratch_slots(max_cns, opts.alloc_chains));
    let mut need = MemlockNeed::mn(opts.pool_size, meta_need, max_cns, opts.group_size);
    need.qps += max_cns as u64 * (opts.alloc_chains as u64 - 1);
    need.registered += extra_pinned(max_cns);
    ensure_memlock(need)?;
    Ok(Sizing { chunks, max_cns })
}

/// Refuse a pool the device's windows, registrations or QPs cannot hold with `alloc_chains`
/// alloc chains per CN (the check `omw plan` prints), naming every limit it breaks and the
/// largest pool of these chunks that fits.
pub fn fits_device(plan: &MnPlan, spec: &PoolSpec, alloc_chains: u8, limits: &DeviceLimits) -> Result<()> {
    let f = Footprint::of_chains(plan, spec, alloc_chains)
        .map_err(|e| VerbsError::Config(format!("pool geometry: {e}")))?;
    let broken = f.check(limits);
    if broken.is_empty() {
        return Ok(());
    }
    let why: Vec<String> = broken.iter().map(|e| e.to_string()).collect();
    let max = omw_core::mn::capacity::max_chunks(limits, plan, spec.group_size);
    Err(VerbsError::Config(format!(
        "the device cannot hold this pool: {} ({} chunks of {} at group size {}); at most {max} chunks of this size fit (`omw plan` shows the whole budget)",
        why.join("; "),
        spec.chunks,
        human(spec.chunk_size),
        spec.group_size
    )))
}

/// Refuse size classes that together break the device's window, registration or QP limits
/// (each may fit alone): the check `omw plan --classes` prints, `Footprint::combined` of every
/// class's footprint against the limits, naming every limit broken.
pub fn classes_fit_device(plan: &MnPlan, specs: &[PoolSpec], alloc_chains: u8, limits: &DeviceLimits) -> Result<()> {
    let mut each = Vec::new();
    for s in specs {
        let f = Footprint::of_chains(plan, s, alloc_chains)
            .map_err(|e| VerbsError::Config(format!("class of {}: pool geometry: {e}", human(s.chunk_size))))?;
        each.push(f);
    }
    let f = Footprint::combined(each);
    let broken = f.check(limits);
    if broken.is_empty() {
        return Ok(());
    }
    let why: Vec<String> = broken.iter().map(|e| e.to_string()).collect();
    Err(VerbsError::Config(format!(
        "the device cannot hold these {} classes together: {} (`omw plan --classes` shows each class's share)",
        specs.len(),
        why.join("; ")
    )))
}

/// The admission the options ask for: the tenants file's tenants registered with the core (their
/// quotas and CN slots), and the sessions' bookkeeping that checks their credentials — or, without
/// a file, an open MN, logged as such.
fn admission(opts: &MnOptions, max_cns: u32, mn: &mut omw_core::mn::MemoryNode) -> Result<Sessions> {
    let sessions = Sessions::new(opts.group_size, max_cns as usize).with_alloc_chains(mn.config().alloc_chains);
    let Some(path) = &opts.tenants else {
        log("admission: OPEN — no --tenants file: any peer that reaches the port may connect, quotas are per CN (and per size class: no identity holds across classes without tenants)");
        return Ok(sessions);
    };
    let (tenants, warn) = crate::admission::load_tenants(path, opts.chunk_size)
        .map_err(|e| VerbsError::Config(format!("--tenants {}: {e}", path.display())))?;
    if let Some(w) = warn {
        log(format!("warning: {w}"));
    }
    for t in &tenants {
        // its quota in bytes holds over every size class of the MN (`class_ledger`)
        t.register(mn, opts.chunk_size)
            .map_err(|e| VerbsError::Config(format!("--tenants {}: {}: {e}", path.display(), t.credential.name)))?;
    }
    log(format!(
        "admission: {} tenant(s) from {} ({}); credentials checked within ±{} s, half-open sessions at most {} per address and {} per tenant, {:?} to complete",
        tenants.len(),
        path.display(),
        tenants.iter().map(|t| format!("{} {} in {} CN(s)", t.credential.name, human(t.quota_bytes), t.max_cns)).collect::<Vec<_>>().join(", "),
        crate::admission::REPLAY_WINDOW_S,
        crate::sessions::HALF_OPEN_PER_SOURCE,
        crate::sessions::HALF_OPEN_PER_TENANT,
        SESSION_PATIENCE,
    ));
    Ok(sessions.with_tenants(crate::admission::Authenticator::with_replays(tenants, opts.replays.clone())))
}

impl<T: StartUp> MnDaemon<T> {
    /// Probe, lay out, register, listen. Prints what protection is in force; the last line it
    /// prints is "listening on".
    pub fn start(opts: MnOptions) -> Result<Self> {
        let sizing = checked_sizing(&opts, |cns| T::extra_pinned(&opts, cns))?;
        // ---- what does the device really do?
        let choice = DeviceChoice { device: opts.device.clone(), gid_index: opts.gid_index };
        let report = probe::run_choice(&choice)?;
        log(format!("{report}"));
        let (transport, device, plan) = T::open(&opts, &report, sizing)?;
        // the check `omw plan` makes: a pool the device cannot hold is refused before one
        // window is allocated, naming the limit it breaks
        let spec = opts.pool_spec(sizing.chunks, sizing.max_cns, T::QUEUE_DEPTH);
        fits_device(&plan, &spec, opts.alloc_chains, &report.limits)?;
        Self::up(opts, transport, device, plan, sizing, &report.device)
    }
}

impl<T: Transport> MnDaemon<T> {
    /// Bring the MN up on `device` (named `device_name`) as `plan` says, on `transport`:
    /// memory, registrations, windows and the pool's table (the core's provisioning), then
    /// listen, admission, metrics. The last start-up line is "listening on": whoever waits for
    /// it (scripts, tests) sees the whole set-up.
    pub fn up(
        opts: MnOptions,
        mut transport: T,
        device: T::Device,
        plan: MnPlan,
        sizing: Sizing,
        device_name: &str,
    ) -> Result<Self> {
        let Sizing { chunks, max_cns } = sizing;
        let spec = opts.pool_spec(chunks, max_cns, T::QUEUE_DEPTH);
        let t = Instant::now();
        let mut driver = plan.provision_chains(device, &spec, opts.alloc_chains).map_err(T::provision_error)?;
        let reg_time = t.elapsed();
        driver.concurrent_laps = !opts.serial_engine;
        transport.provisioned(&mut driver)?;
        transport.listen(&mut driver.backend, opts.listen)?;
        let g = opts.group_size as usize;
        let protection = if plan.per_chunk_mrs { Protection::MrPerChunk } else { Protection::WindowBounds };
        let mrs = if plan.per_chunk_mrs { chunks } else { 1 };
        log(format!(
            "device {device_name} | pool {} in {} chunks of {} | group size {} | {} windows | memlock {}{}",
            human(opts.pool_size),
            chunks,
            human(opts.chunk_size),
            g,
            chunks as usize * g,
            memlock_limit(),
            transport.describe(&driver.backend),
        ));
        log(format!("protection: {protection} ({mrs} pool MR(s); MN set up in {reg_time:?})"));
        let chains = driver.mn.config().alloc_chains;
        if chains > 1 {
            log(format!("alloc chains: a CN may open up to {chains} (each its own Alloc QP: its allocations overlap)"));
        }
        log(format!(
            "execution: {}; free ownership check: {}",
            plan.mode,
            if plan.software_ownership_check {
                "in software (the device lets any QP invalidate a window)"
            } else {
                "by the device (LOCAL_INV on the owner's Free QP)"
            }
        ));
        let sessions = admission(&opts, max_cns, &mut driver.mn)?;
        let metrics = match opts.metrics {
            Some(a) => {
                let m = MetricsServer::start(a).map_err(|e| VerbsError::Config(format!("--metrics {a}: {e}")))?;
                log(format!("metrics: http://{}/metrics (Prometheus text format)", m.addr));
                Some(m)
            }
            None => None,
        };
        log(format!("listening on {} ({})", opts.listen, T::LISTENING));
        let now = Instant::now();
        Ok(MnDaemon {
            transport,
            driver,
            protection,
            mode: plan.mode,
            software_ownership_check: plan.software_ownership_check,
            plan,
            sessions,
            opts,
            t0: now,
            last_stats: now,
            last_heartbeat: now,
            last_counts: (0, 0, MnStats::default()),
            departed: (0, 0),
            rejoins: 0,
            metrics,
            last_publish: now,
            counter_hook: None,
            learned: class_ledger::Learned::default(),
        })
    }

    fn now(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    /// Run until `stop` is set (SIGINT/SIGTERM); dropping the daemon then tears everything
    /// down. A busy MN never waits; an idle one waits for the connection manager between turns
    /// (`MnDaemon::wait`) rather than spinning a core.
    pub fn run(&mut self, stop: &AtomicBool) -> Result<()> {
        let mut idle = 0u32;
        while !stop.load(Ordering::Relaxed) {
            if self.step()? {
                idle = 0;
            } else {
                idle = idle.saturating_add(1);
                if idle > IDLE_TURNS && self.wait()? {
                    idle = 0;
                }
            }
        }
        log("shutting down: invalidating and deallocating every window before the QPs");
        Ok(())
    }

    /// Run several daemons in one loop until `stop` is set — an MN's size classes, each its own
    /// `MemoryNode` (MWTable, free queue, chains) on its own port of the same device. Each turn
    /// steps every one; when all are idle they take turns waiting for the connection manager
    /// (each at most `IDLE_WAIT` / n, so none waits long for another's quiet).
    ///
    /// A tenant's byte quota holds over all the classes: around every step (and every wait,
    /// which may connect or disconnect a CN) a class learns what each tenant holds in the others
    /// and publishes its own holdings ([`class_ledger::ClassLedger`]).
    pub fn run_all(daemons: &mut [Self], stop: &AtomicBool) -> Result<()> {
        let mut idle = 0u32;
        let share = IDLE_WAIT / daemons.len().max(1) as u32;
        let mut ledger = class_ledger::ClassLedger::new(daemons.len());
        while !stop.load(Ordering::Relaxed) {
            let mut busy = false;
            for (k, d) in daemons.iter_mut().enumerate() {
                d.learn_elsewhere(&ledger, k);
                busy |= d.step()?;
                d.publish_holdings(&mut ledger, k);
            }
            if busy {
                idle = 0;
                continue;
            }
            idle = idle.saturating_add(1);
            if idle > IDLE_TURNS {
                for (k, d) in daemons.iter_mut().enumerate() {
                    d.learn_elsewhere(&ledger, k);
                    if d.wait_at_most(share)? {
                        idle = 0;
                    }
                    d.publish_holdings(&mut ledger, k);
                }
            }
        }
        log("shutting down: invalidating and deallocating every window before the QPs");
        Ok(())
    }

    /// Wait for one connection event, at most [`IDLE_WAIT`] and never past the MN's next timer,
    /// and handle it; true if one came.
    fn wait(&mut self) -> Result<bool> {
        self.wait_at_most(IDLE_WAIT)
    }

    fn wait_at_most(&mut self, most: Duration) -> Result<bool> {
        let now = self.now();
        let until_timer = self.driver.poll_timeout().map_or(most, |t| Duration::from_nanos(t.saturating_sub(now)));
        match self.transport.poll_cm(&mut self.driver.backend, most.min(until_timer))? {
            Some(ev) => {
                self.on_cm(ev);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// One turn of the event loop; true when anything happened. A failure the driver reports
    /// is logged, not returned: the MN keeps serving every other CN (an error here comes from
    /// one CN's connection, and the CN it concerns is evicted or noticed by its departure).
    pub fn step(&mut self) -> Result<bool> {
        let mut busy = false;
        while let Some(ev) = self.transport.poll_cm(&mut self.driver.backend, Duration::ZERO)? {
            busy = true;
            self.on_cm(ev);
        }
        let now = self.now();
        match self.driver.poll(now) {
            Ok(r) => busy |= r.events > 0,
            Err(e) => {
                busy = true;
                log(format!("MN driver: {e} (serving on)"));
            }
        }
        // the MN's own timers and the statistics interval both tick it
        let stats_due = !self.opts.stats_every.is_zero() && self.last_stats.elapsed() >= self.opts.stats_every;
        let timer_due = self.driver.poll_timeout().is_some_and(|t| now >= t);
        if stats_due || timer_due {
            let t = Instant::now();
            let r = match timer_due {
                true => self.driver.handle_timeout(now).map(|_| ()),
                // statistics are sampled on a tick of their own
                false => self.driver.handle(now, Event::Tick),
            };
            if let Err(e) = r {
                log(format!("MN driver (tick): {e} (serving on)"));
            }
            if t.elapsed() > Duration::from_millis(200) {
                log(format!("the MN's timer round took {:?}", t.elapsed()));
            }
        }
        self.drop_evicted();
        for nonce in self.sessions.incomplete_since(Instant::now(), SESSION_PATIENCE) {
            log(format!("session {nonce:#x} dropped: not all its connections arrived within {SESSION_PATIENCE:?}"));
            self.drop_session(nonce);
        }
        if debug_enabled() && self.last_heartbeat.elapsed() >= Duration::from_secs(1) {
            self.last_heartbeat = Instant::now();
            let st = self.driver.mn.stats();
            let outstanding: Vec<String> =
                self.driver.mn.cns().filter(|r| r.probe_outstanding).map(|r| r.cn.to_string()).collect();
            crate::log::log(
                TARGET,
                "omw mn",
                Level::Debug,
                &format!(
                    "loop alive: {} CNs, probes sent {}, evicted {}, unanswered probes {:?}",
                    self.driver.mn.cns().count(),
                    st.probes_sent,
                    st.cns_evicted,
                    outstanding
                ),
            );
        }
        if stats_due {
            self.print_stats();
            if self.opts.stats_json {
                println!("{}", self.counters().json());
            }
        }
        if (self.metrics.is_some() || self.counter_hook.is_some())
            && self.last_publish.elapsed() >= Duration::from_millis(100)
        {
            self.last_publish = Instant::now();
            let c = self.counters();
            if let Some(h) = self.counter_hook.as_mut() {
                h(&c);
            }
            if let Some(m) = &self.metrics {
                m.publish(c);
            }
        }
        Ok(busy)
    }

    /// Hand the counters to `hook` every 100 ms (as `--metrics` gets them): how the `omw`
    /// binary's pool membership learns the MN's free count without touching its loop.
    pub fn on_counters(&mut self, hook: impl FnMut(&MnCounters) + 'static) {
        self.counter_hook = Some(Box::new(hook));
    }

    /// CNs the MN evicted (the transport could not reach them, or they stopped answering the
    /// lease): their connections go; what they held was reclaimed by the MN already.
    fn drop_evicted(&mut self) {
        for cn in self.driver.mn.take_evicted() {
            let nonce = self.sessions.nonce_of_cn(cn);
            log(format!("{cn} evicted: it stopped answering (no receive posted, or its host is gone); its chunks were reclaimed"));
            if let Some(nonce) = nonce {
                self.drop_session(nonce);
            }
        }
    }

    /// The counters `--metrics` and `--stats-json` export.
    pub fn counters(&self) -> MnCounters {
        let (a, f) = self.driver.mn.cns().fold(self.departed, |(a, f), r| (a + r.allocs, f + r.frees));
        let map = self.driver.mn.map();
        let q = map.queue;
        let word = |addr: u64| {
            let mut b = [0u8; 8];
            self.driver.backend.read_local(addr, &mut b).map(|_| u64::from_le_bytes(b)).unwrap_or(0)
        };
        let s = self.driver.mn.stats();
        let Rejections { credential, limit, session } = self.sessions.rejections();
        MnCounters {
            rejected_credential: credential,
            rejected_limit: limit,
            rejected_session: session,
            rejoins: self.rejoins,
            uptime_ms: self.t0.elapsed().as_millis() as u64,
            cns: self.driver.mn.cns().count() as u64,
            free_chunks: q.live_len(word(q.head), word(q.tail), map.max_cns) as u64,
            chunks: map.geometry.chunk_count() as u64,
            allocs: a,
            frees: f,
            empty_notices: s.empty_notices,
            available_notices: s.available_notices,
            groups_reclaimed: s.groups_reclaimed,
            taken_back_notices: s.taken_back_notices,
            forged_frees: s.forged_frees,
            quota_disconnects: s.quota_disconnects,
            chunks_scrubbed: s.chunks_scrubbed,
            laps: self.driver.stats.laps,
            laps_failed: self.driver.stats.laps_failed,
            lost_windows: self.transport.lost_windows(&self.driver.backend),
            window_query_failures: self.transport.window_query_failures(&self.driver.backend),
        }
    }

    fn print_stats(&mut self) {
        let dt = self.last_stats.elapsed().as_secs_f64().max(1e-9);
        self.last_stats = Instant::now();
        let (allocs, frees): (u64, u64) = self.driver.mn.cns().fold((0, 0), |(a, f), r| (a + r.allocs, f + r.frees));
        let s = self.driver.mn.stats();
        let (pa, pf, ps) = self.last_counts;
        // CNs that left take their counters with them: clamp at zero
        let da = allocs.saturating_sub(pa);
        let df = frees.saturating_sub(pf);
        let key = |m: &MnStats| (m.empty_notices, m.available_notices, m.groups_reclaimed, m.forged_frees);
        if da > 0 || df > 0 || key(&s) != key(&ps) {
            log(format!(
                "{:.0} allocs/s, {:.0} frees/s | CNs {} | empty notices {} available {} | reclaimed {} | forged frees {}",
                da as f64 / dt,
                df as f64 / dt,
                self.driver.mn.cns().count(),
                s.empty_notices,
                s.available_notices,
                s.groups_reclaimed,
                s.forged_frees
            ));
        }
        if s.empty_notices > ps.empty_notices {
            log("free queue EMPTY: told every CN");
        }
        if s.available_notices > ps.available_notices {
            log("free queue available again: told every CN");
        }
        self.last_counts = (allocs, frees, s);
    }

    /// One connection event. Nothing here ends the daemon: whatever one CN's connection does
    /// or fails with is logged, and the MN serves on.
    fn on_cm(&mut self, ev: CmEvent) {
        match ev.kind {
            CmEventKind::ConnectRequest => match self.sessions.admit(&ev) {
                Admission::Reject(why) => {
                    log(format!("rejected {why}"));
                    // a reason the CN can act on travels in the reject; the rest stays here
                    let private = why.refusal().map(|r| r.encode().to_vec()).unwrap_or_default();
                    self.transport.reject(&mut self.driver.backend, ev.id, &private);
                }
                Admission::Accept { hello, private, source } => {
                    match self.transport.accept(&mut self.driver.backend, ev.id, hello.role, &private) {
                        Ok(q) => self.sessions.accepted(ev.id, hello, source, q),
                        Err(e) => log(format!("accept of {:?} failed: {e}", hello.role)),
                    }
                }
                Admission::Rejoin { role, cn, qp, old, private } => self.rejoin(ev.id, role, cn, qp, old, &private),
            },
            CmEventKind::Established => {
                let Some(q) = self.transport.qp_of(&self.driver.backend, ev.id) else { return };
                let Some(Complete { nonce, mut qps, extra_alloc, tenant }) = self.sessions.established(ev.id, q) else {
                    return;
                };
                // offloaded, the CN's chains run on loop QPs of their own (host engine: none),
                // one more per extra alloc chain
                let mut extra: Vec<AllocChainQps> = Vec::new();
                let r = self.driver.create_loop_qps().and_then(|l| {
                    if let Some((a, f)) = l {
                        qps.alloc_loop = Some(a);
                        qps.free_loop = Some(f);
                    }
                    for mgmt in &extra_alloc {
                        let lp = self.driver.create_alloc_loop_qp()?;
                        extra.push(AllocChainQps { mgmt: *mgmt, lp });
                    }
                    self.driver.connect_with_chains(qps.clone(), &extra, tenant)
                });
                match r {
                    Ok(cn) => {
                        self.sessions.set_cn(nonce, cn);
                        // what its tenant holds in the other classes counts from its first request
                        if let Some(t) = tenant {
                            self.tell_elsewhere(cn, t);
                        }
                        log(format!(
                            "{cn} connected (session {nonce:#x}, {} QPs, {} alloc chain(s)){}",
                            2 + self.opts.group_size as usize - 1 + extra.len(),
                            1 + extra.len(),
                            if qps.alloc_loop.is_some() { "; its chains are armed in the NIC" } else { "" }
                        ));
                    }
                    Err(e) => {
                        log(format!("could not admit session {nonce:#x}: {e}"));
                        let extra_loops = extra.iter().filter_map(|c| c.lp);
                        for q in [qps.alloc_loop, qps.free_loop].into_iter().flatten().chain(extra_loops) {
                            let _ = self.driver.backend.destroy_qp(q);
                        }
                        self.drop_session(nonce);
                    }
                }
            }
            CmEventKind::Disconnected | CmEventKind::Error(_) | CmEventKind::Rejected => {
                let Some(nonce) = self.sessions.nonce_of(ev.id) else { return };
                let cn = self.sessions.get(nonce).and_then(|s| s.cn);
                if let Some(cn) = cn {
                    if let Some(r) = self.driver.mn.cn(cn) {
                        self.departed.0 += r.allocs;
                        self.departed.1 += r.frees;
                    }
                    let before = self.driver.mn.stats().groups_reclaimed;
                    let now = self.now();
                    match self.driver.handle(now, Event::CnGone { cn }) {
                        Ok(()) => {
                            let n = self.driver.mn.stats().groups_reclaimed - before;
                            log(format!("{cn} disconnected: reclaimed {n} chunk(s)"));
                        }
                        Err(e) => log(format!("{cn} disconnected; reclaiming what it held: {e} (serving on)")),
                    }
                }
                self.drop_session(nonce);
            }
            _ => {}
        }
    }

    /// A rejoin the sessions admitted (`crate::rejoin`): connection request `id` replaces `old`,
    /// `cn`'s `role` connection, whose MN end is `qp`. The CN's end broke (a refused access on
    /// it, the MN's own repair of the chain), so the chain on `qp` is repaired like any failed
    /// one — quiesced, what it left taken stock of, reset — and connected on the new request's
    /// path before it is re-armed; then the request is accepted naming the same QP. Everything
    /// the CN holds stays: its windows are bound to `qp`, not to the CN's QP.
    fn rejoin(&mut self, id: CmId, role: Role, cn: CnId, qp: Qpn, old: CmId, private: &[u8]) {
        if !T::REJOINS {
            log(format!("refused {cn}'s rejoin of its {role:?} connection: this transport's QPs are rdma_cm's"));
            self.transport.reject(&mut self.driver.backend, id, &Refusal::NoRejoin.encode());
            return;
        }
        let (kind, chain) = match role {
            Role::Alloc => (ChainKind::Alloc, 0),
            Role::AllocChain(j) => (ChainKind::Alloc, j),
            Role::Free => (ChainKind::Free, 0),
            // the sessions admit chain connections only
            Role::Access(_) => {
                self.transport.reject(&mut self.driver.backend, id, &[]);
                return;
            }
        };
        if let Err(e) = self.transport.rejoin_path(&mut self.driver.backend, id, qp) {
            log(format!("{cn}'s rejoin of its {role:?} connection: {e}"));
            self.transport.reject(&mut self.driver.backend, id, &[]);
            return;
        }
        let now = self.now();
        let replaced =
            Event::ChainFailed { cn, kind, chain, step: None, failure: LapFailure::Status(WcStatus::WrFlushErr) };
        let repaired = self.driver.handle(now, replaced).map_err(|e| e.to_string()).and_then(|()| {
            match self.driver.backend.qp_state(qp) {
                Ok(QpState::Rts) => Ok(()),
                Ok(s) => Err(format!("its QP is {s:?} after the repair")),
                Err(e) => Err(e.to_string()),
            }
        });
        if let Err(e) = repaired {
            log(format!("{cn}'s rejoin of its {role:?} connection: repairing the chain: {e}"));
            self.transport.reject(&mut self.driver.backend, id, &[]);
            return;
        }
        match self.transport.rejoin_accept(&mut self.driver.backend, id, old, qp, private) {
            Ok(()) => {
                self.sessions.rejoined(old, id);
                self.rejoins += 1;
                log(format!("{cn} rejoined its {role:?} connection: QP {qp} repaired, reconnected and re-armed"));
            }
            Err(e) => log(format!("{cn}'s rejoin of its {role:?} connection: accept failed: {e}")),
        }
    }

    fn drop_session(&mut self, nonce: u64) {
        let Some(s) = self.sessions.remove(nonce) else { return };
        self.transport.release(&mut self.driver.backend, &s);
    }

    /// The sessions' bookkeeping (for tests of a transport's accept path).
    #[cfg(test)]
    pub(crate) fn sessions(&self) -> &Sessions {
        &self.sessions
    }
}
