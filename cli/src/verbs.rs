//! `omw mn`, `omw cn`, `omw probe`: the verbs-backed programs (libibverbs + rdma_cm).
//! Argument structs and thin handlers; the work is in the omw-verbs crate.

use crate::cn::CnCommand;
use omw_kv::exercise::{exercise, ExerciseError};
use omw_kv::verbs::VerbsCn;
use omw_kv::KvStore;
use omw_verbs::cn::CnOptions;
use omw_verbs::mn::MnOptions;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

fn size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let m = match s[i..].to_ascii_lowercase().as_str() {
                "k" | "kib" | "kb" => 1u64 << 10,
                "m" | "mib" | "mb" => 1 << 20,
                "g" | "gib" | "gb" => 1 << 30,
                "b" => 1,
                u => return Err(format!("unknown unit {u:?} (use K, M, G)")),
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    num.trim().parse::<u64>().map(|n| n * mul).map_err(|e| format!("{s:?}: {e}"))
}

/// `--classes`' value (one argument: clap would take a bare `Vec` for many).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClassList(pub Vec<omw_pool::entry::ClassSpec>);

pub fn parse_class_list(s: &str) -> Result<ClassList, String> {
    omw_pool::entry::parse_classes(s).map(ClassList).map_err(|e| e.to_string())
}

#[derive(clap::Args, Debug)]
#[command(subcommand_negates_reqs = true, args_conflicts_with_subcommands = true)]
pub struct MnArgs {
    #[command(subcommand)]
    pub action: Option<MnAction>,
    /// RDMA device (default: the first with an ACTIVE port, preferring type-2 windows).
    #[arg(long)]
    pub device: Option<String>,
    /// rdma_cm address to listen on (an address of the device's network interface).
    #[arg(long, required = true)]
    pub listen: Option<SocketAddr>,
    /// Bytes of pool memory exported (K/M/G suffixes).
    #[arg(long, value_parser = size, default_value = "64M")]
    pub pool_size: u64,
    /// Chunk size, a power of two ≥ 512.
    #[arg(long, value_parser = size, default_value = "4K")]
    pub chunk_size: u64,
    /// Memory windows per chunk (G): MW[0] for the Free QP, G−1 access QPs.
    #[arg(long, default_value_t = 3)]
    pub group_size: u8,
    /// Most CNs served at once.
    #[arg(long, default_value_t = 16)]
    pub max_cns: u32,
    /// Alloc chains one CN may open (1–4): each its own Alloc QP, scratch area and (offloaded)
    /// loop QP, so one CN's allocations overlap; a CN asking for more is refused and told why.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=omw_core::mn::MAX_ALLOC_CHAINS as i64))]
    pub alloc_chains: u8,
    /// Chunks one CN may hold (0: unlimited).
    #[arg(long, default_value_t = 0)]
    pub quota: u32,
    /// Start even if the probe shows the device cannot isolate CNs.
    #[arg(long)]
    pub insecure: bool,
    /// Statistics interval in milliseconds (0: off).
    #[arg(long, default_value_t = 1000)]
    pub stats_ms: u64,
    /// Do not zero chunks between owners: the next owner of a chunk can then read what the
    /// last one left in it. Only for CNs that trust each other (`omw bench` shows the cost).
    #[arg(long)]
    pub no_scrub: bool,
    /// CN lease in milliseconds (0: off): a CN whose host vanishes without a disconnect, or that
    /// stops posting receives, is evicted and reclaimed within about this long.
    #[arg(long, default_value_t = 2000)]
    pub lease_ms: u64,
    /// Host engine: run one lap at a time, busy-waiting each step (the engine before laps of
    /// different CNs ran side by side) — for measurements only.
    #[arg(long)]
    pub serial_engine: bool,
    /// Offload the chains to the NIC: `mlx5` = ConnectX through DEVX (needs a build with
    /// `--features devx`; refuses, saying why, where the device, kernel or build cannot; never
    /// run on a ConnectX — docs/MLX5.md). Default: the host engine.
    #[arg(long, value_enum)]
    pub offload: Option<Offload>,
    /// The device profile `omw-mlx5-bringup questions` wrote on this ConnectX: what it does
    /// about the open questions the chains depend on (docs/MLX5.md). Without it every answer
    /// is unknown and `--offload mlx5` refuses, naming the question.
    #[arg(long, requires = "offload")]
    pub profile: Option<std::path::PathBuf>,
    /// Source GID index of the MN's raw QPs (probe, admin pair), as perftest's -x (default: the
    /// RoCE v2 IPv4 GID, or the port GID on InfiniBand).
    #[arg(long)]
    pub gid_index: Option<u8>,
    /// Serve the counters in the Prometheus text format at http://ADDR/metrics.
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Print the counters as JSON lines on stdout at every statistics interval.
    #[arg(long)]
    pub stats_json: bool,
    /// Tenants file (one `NAME secret=HEX quota=SIZE [cns=N]` per line; docs/VERBS.md
    /// "Admission"): only its tenants connect, each within its quota and CN slots over all its
    /// sessions. Without it the MN runs open.
    #[arg(long)]
    pub tenants: Option<std::path::PathBuf>,
    /// Size classes, `SIZE:COUNT,…` (e.g. 4K:256,64K:32,2M:4): each its own MWTable, free queue
    /// and chains, listening on --listen's port + its index (smallest class first); replaces
    /// --pool-size and --chunk-size.
    #[arg(long, value_parser = parse_class_list)]
    pub classes: Option<ClassList>,
    /// Join a pool of MNs: the registry's etcd endpoint(s), e.g. http://127.0.0.1:2379
    /// (docs/POOL.md). The MN registers under a lease, publishes its free count and drain flag,
    /// and leaves on SIGINT/SIGTERM. SIGUSR1 starts draining, SIGUSR2 ends it.
    #[arg(long, requires = "pool")]
    pub registry: Option<String>,
    /// The pool's name in the registry.
    #[arg(long, requires = "registry")]
    pub pool: Option<String>,
    /// This MN's name in the pool (default: `mn-<listen address>`).
    #[arg(long, requires = "registry")]
    pub name: Option<String>,
    /// The address CNs connect to, as published (default: --listen).
    #[arg(long, requires = "registry")]
    pub advertise: Option<SocketAddr>,
    /// The registry lease in milliseconds: a vanished MN leaves the pool this long after its
    /// last keep-alive.
    #[arg(long, default_value_t = 3000, requires = "registry")]
    pub registry_ttl_ms: u64,
}

/// `omw mn` subcommands that act on a running pool through its registry.
#[derive(clap::Subcommand, Debug)]
pub enum MnAction {
    /// Ask a pool MN to drain (no new placements; its live allocations keep working) or, with
    /// --off, to stop draining. With --wait, wait until it reports holding no chunk.
    Drain(DrainArgs),
}

#[derive(clap::Args, Debug)]
pub struct DrainArgs {
    /// The registry's etcd endpoint(s).
    #[arg(long)]
    pub registry: String,
    #[arg(long)]
    pub pool: String,
    /// The MN's name in the pool.
    #[arg(long)]
    pub name: String,
    /// End draining instead.
    #[arg(long)]
    pub off: bool,
    /// Wait up to this many seconds for the MN to hold no chunk (0: do not wait).
    #[arg(long, default_value_t = 0)]
    pub wait_s: u64,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offload {
    Mlx5,
}

#[derive(clap::Args, Debug)]
pub struct CnArgs {
    /// The memory node's rdma_cm address.
    #[arg(long)]
    pub connect: SocketAddr,
    /// Local RDMA device (default: the one that routes to the MN).
    #[arg(long)]
    pub device: Option<String>,
    /// Seconds any one operation may take.
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// The tenant this CN connects as (an MN with a tenants file admits only its tenants).
    #[arg(long, requires = "secret_file")]
    pub tenant: Option<String>,
    /// File holding the tenant's secret in hex (keep it readable only by its owner).
    #[arg(long, requires = "tenant")]
    pub secret_file: Option<std::path::PathBuf>,
    /// Alloc chains to open (1–4, at most the MN's --alloc-chains): one Alloc QP each, and as
    /// many allocations in flight at once.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=omw_core::mn::MAX_ALLOC_CHAINS as i64))]
    pub alloc_chains: u8,
    #[command(subcommand)]
    pub cmd: CnCmd,
}

#[derive(clap::Subcommand, Debug)]
pub enum CnCmd {
    /// Allocate N chunks (up to one request in flight per alloc chain), print them, free them.
    Alloc {
        #[arg(default_value_t = 1)]
        count: u32,
    },
    /// Allocate, write through every access QP, read back, free, reallocate — one allocation at
    /// a time whatever --alloc-chains: it checks each chunk's windows, not throughput.
    Roundtrip {
        #[arg(long, default_value_t = 512)]
        bytes: usize,
    },
    /// A short load: alloc → write → read → verify → free, N times, with up to one allocation
    /// request in flight per alloc chain (each idle chain gets one before the oldest answer is
    /// waited for).
    Load {
        #[arg(default_value_t = 1000)]
        ops: u32,
        #[arg(long, default_value_t = 64)]
        bytes: usize,
    },
    /// Allocation latency vs a SEND/RECV round trip through the MN on the same QPs; then the
    /// CN's allocation throughput with 1..=K requests in flight on its K alloc chains, each as a
    /// ratio to a CN of one chain measured in the same run.
    Bench {
        #[arg(default_value_t = 200)]
        iters: u32,
    },
    /// Read commands from stdin (alloc, write, read, free, rawread, rawwrite, freeentry, quit).
    Script,
    /// The example KV store (omw-kv) as a self-checking workload: insert, read back, update,
    /// delete, shrink, delete the rest — every value compared, every chunk back at the MN.
    Kv {
        #[arg(long, default_value_t = 200)]
        keys: usize,
    },
}

#[derive(clap::Args, Debug)]
pub struct ProbeArgs {
    /// RDMA device (default: the first with an ACTIVE port, preferring type-2 windows).
    #[arg(long)]
    pub device: Option<String>,
    /// Source GID index of the probe's QPs, as perftest's -x.
    #[arg(long)]
    pub gid_index: Option<u8>,
}

fn finish(what: &str, r: Result<(), omw_verbs::VerbsError>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("omw {what}: error: {e}");
            ExitCode::FAILURE
        }
    }
}

pub fn mn(a: MnArgs) -> ExitCode {
    finish("mn", run_mn(a))
}

fn run_mn(a: MnArgs) -> Result<(), omw_verbs::VerbsError> {
    if let Some(MnAction::Drain(d)) = a.action {
        return crate::pool_mn::drain(&d);
    }
    let Some(listen) = a.listen else {
        return Err(omw_verbs::VerbsError::Config("--listen is required".into()));
    };
    let membership = match a.registry.clone() {
        Some(url) => Some(crate::pool_mn::Membership {
            url,
            pool: a.pool.clone().unwrap_or_default(),
            name: a.name.clone().unwrap_or_else(|| format!("mn-{}", listen).replace([':', '[', ']'], "_")),
            advertise: a.advertise.unwrap_or(listen),
            ttl: Duration::from_millis(a.registry_ttl_ms),
        }),
        None => None,
    };
    let offload = a.offload;
    // a missing or malformed profile is the operator's to fix first, before any device call
    let offload_profile = match &a.profile {
        Some(p) => Some(
            omw_verbs::devx::profile::Profile::load(p)
                .map_err(|e| omw_verbs::VerbsError::Devx(omw_verbs::devx::DevxError::Profile(e)))?,
        ),
        None => None,
    };
    let opts = MnOptions {
        device: a.device,
        listen,
        pool_size: a.pool_size,
        chunk_size: a.chunk_size,
        group_size: a.group_size,
        max_cns: a.max_cns,
        alloc_chains: a.alloc_chains,
        quota: a.quota,
        insecure: a.insecure,
        stats_every: Duration::from_millis(a.stats_ms),
        scrub: !a.no_scrub,
        gid_index: a.gid_index,
        metrics: a.metrics,
        stats_json: a.stats_json,
        lease: Duration::from_millis(a.lease_ms),
        serial_engine: a.serial_engine,
        tenants: a.tenants,
        offload_profile,
        replays: Default::default(),
    };
    match offload {
        Some(Offload::Mlx5) if membership.is_some() || a.classes.is_some() => Err(omw_verbs::VerbsError::Config(
            "--registry or --classes with --offload mlx5 is not supported yet: a pool MN runs the host engine".into(),
        )),
        // the chains in a ConnectX: the DEVX gate first, so a device or build that cannot
        // says why before anything is probed or pinned
        Some(Offload::Mlx5) => {
            omw_verbs::devx::ready(opts.device.as_deref())?;
            serve_devx(opts)
        }
        None => match (membership, a.classes) {
            (None, None) => omw_verbs::mn::serve(opts),
            (m, classes) => {
                let classes = classes.map(|c| c.0).unwrap_or_else(|| {
                    vec![omw_pool::entry::ClassSpec {
                        chunk_size: opts.chunk_size,
                        chunks: (opts.pool_size / opts.chunk_size.max(1)) as u32,
                    }]
                });
                crate::pool_mn::serve(opts, &classes, m)
            }
        },
    }
}

#[cfg(feature = "devx")]
fn serve_devx(opts: MnOptions) -> Result<(), omw_verbs::VerbsError> {
    omw_verbs::devx::mn::serve(opts)
}

#[cfg(not(feature = "devx"))]
fn serve_devx(_opts: MnOptions) -> Result<(), omw_verbs::VerbsError> {
    Err(omw_verbs::VerbsError::Devx(omw_verbs::devx::DevxError::NotBuilt))
}

pub fn cn(a: CnArgs) -> ExitCode {
    match run_cn(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("omw cn: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What `omw cn` can fail with: the verbs layer, or the KV workload's checks.
#[derive(Debug)]
pub enum CnError {
    Verbs(omw_verbs::VerbsError),
    Kv(ExerciseError<omw_verbs::VerbsError>),
}

impl std::fmt::Display for CnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CnError::Verbs(e) => write!(f, "{e}"),
            CnError::Kv(e) => write!(f, "kv: {e}"),
        }
    }
}

impl std::error::Error for CnError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CnError::Verbs(e) => Some(e),
            CnError::Kv(e) => Some(e),
        }
    }
}

impl From<omw_verbs::VerbsError> for CnError {
    fn from(e: omw_verbs::VerbsError) -> Self {
        CnError::Verbs(e)
    }
}

fn run_cn(a: CnArgs) -> Result<(), CnError> {
    let credential = match (&a.tenant, &a.secret_file) {
        (Some(t), Some(f)) => Some(
            omw_verbs::admission::Credential::load(t, f)
                .map_err(|e| omw_verbs::VerbsError::Config(format!("--secret-file {}: {e}", f.display())))?,
        ),
        _ => None,
    };
    let o = CnOptions {
        device: a.device,
        timeout: Duration::from_secs(a.timeout),
        credential,
        source: None,
        alloc_chains: a.alloc_chains,
    };
    let cmd = match a.cmd {
        CnCmd::Alloc { count } => CnCommand::Alloc { count },
        CnCmd::Roundtrip { bytes } => CnCommand::Roundtrip { bytes },
        CnCmd::Load { ops, bytes } => CnCommand::Load { ops, bytes },
        CnCmd::Bench { iters } => CnCommand::Bench { iters },
        CnCmd::Script => CnCommand::Script,
        CnCmd::Kv { keys } => return run_kv(a.connect, &o, keys),
    };
    Ok(crate::cn::run(a.connect, &o, cmd)?)
}

/// `omw cn kv`: the omw-kv store against the MN, checked (omw_kv::exercise).
fn run_kv(addr: SocketAddr, o: &CnOptions, keys: usize) -> Result<(), CnError> {
    let mut c = omw_verbs::cn::CnClient::connect(addr, o)?;
    eprintln!("omw cn: connected as {} (chunk {} B)", c.cn, c.info.chunk_size);
    let t = std::time::Instant::now();
    let mut kv = KvStore::new(VerbsCn::new(&mut c, 0)).map_err(|e| CnError::Kv(e.into()))?;
    let r = exercise(&mut kv, keys).map_err(CnError::Kv)?;
    println!(
        "kv: {} inserts, {} updates, {} deletes, {} reads checked in {:.3} s; chunks held: {} at peak, {} after deleting 3/4, {} after shrink, 0 at the end ({} taken from the MN, {} returned, {} objects moved)",
        r.inserted,
        r.updated,
        r.deleted,
        r.reads_checked,
        t.elapsed().as_secs_f64(),
        r.peak_chunks,
        r.sparse_chunks,
        r.shrunk_chunks,
        r.stats.chunks_allocated,
        r.stats.chunks_freed,
        r.stats.objects_moved
    );
    Ok(())
}

pub fn probe(a: ProbeArgs) -> ExitCode {
    let choice = omw_verbs::device::DeviceChoice { device: a.device.clone(), gid_index: a.gid_index };
    match omw_verbs::probe::run_choice(&choice) {
        Ok(r) => {
            println!("{r}");
            let mn = if r.basic_failed || !r.has(omw_core::device::Capabilities::MW_QP_BINDING_ENFORCED) {
                "an MN on this device refuses to start (unless --insecure)"
            } else if r.has(omw_core::device::Capabilities::MW_BOUNDS_ENFORCED) {
                "an MN on this device protects chunks by window bounds (one pool MR)"
            } else {
                "an MN on this device registers one MR per chunk (window bounds are not enforced)"
            };
            println!("{mn}");
            println!("{}", omw_verbs::devx::probe(a.device.as_deref()));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("omw probe: error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(size("4K"), Ok(4096));
        assert_eq!(size("64M"), Ok(64 << 20));
        assert_eq!(size("512"), Ok(512));
        assert!(size("3X").is_err());
    }

    /// `omw mn` arguments as the command line gives them (a small pool, no statistics).
    fn mn_args(extra: &[&str]) -> MnArgs {
        use clap::Parser;
        #[derive(clap::Parser, Debug)]
        struct Mn {
            #[command(flatten)]
            a: MnArgs,
        }
        let mut v = vec!["mn", "--listen", "127.0.0.1:7471", "--pool-size", "1M", "--max-cns", "4", "--stats-ms", "0"];
        v.extend_from_slice(extra);
        Mn::try_parse_from(v).unwrap().a
    }

    #[test]
    fn operations_flags_parse() {
        use clap::Parser;
        #[derive(clap::Parser, Debug)]
        struct Mn {
            #[command(flatten)]
            a: MnArgs,
        }
        #[derive(clap::Parser, Debug)]
        struct Probe {
            #[command(flatten)]
            a: ProbeArgs,
        }
        let m = Mn::try_parse_from([
            "mn",
            "--listen",
            "10.0.0.1:7471",
            "--metrics",
            "10.0.0.1:9464",
            "--stats-json",
            "--gid-index",
            "3",
        ])
        .unwrap();
        assert_eq!(m.a.metrics, Some("10.0.0.1:9464".parse().unwrap()));
        assert!(m.a.stats_json);
        assert_eq!(m.a.gid_index, Some(3));
        let d = Mn::try_parse_from(["mn", "--listen", "10.0.0.1:7471"]).unwrap();
        assert_eq!((d.a.metrics, d.a.stats_json, d.a.gid_index), (None, false, None));
        assert!(Mn::try_parse_from(["mn", "--listen", "10.0.0.1:7471", "--gid-index", "300"]).is_err());
        assert!(Mn::try_parse_from(["mn", "--listen", "10.0.0.1:7471", "--metrics", "nope"]).is_err());
        assert_eq!(Probe::try_parse_from(["probe", "--gid-index", "1"]).unwrap().a.gid_index, Some(1));
        // a pool MN's flags
        let p = Mn::try_parse_from([
            "mn",
            "--listen",
            "10.0.0.1:7471",
            "--classes",
            "64K:16,4K:256",
            "--registry",
            "http://10.0.0.9:2379",
            "--pool",
            "p",
        ])
        .unwrap();
        let c = p.a.classes.unwrap().0;
        assert_eq!((c.len(), c[0].chunk_size, c[1].chunks), (2, 4096, 16));
        assert_eq!(p.a.registry.as_deref(), Some("http://10.0.0.9:2379"));
        assert!(Mn::try_parse_from(["mn", "--listen", "10.0.0.1:7471", "--classes", "4K"]).is_err());
        assert!(Mn::try_parse_from(["mn", "--listen", "10.0.0.1:7471", "--pool", "p"]).is_err());
        let d = Mn::try_parse_from(["mn", "drain", "--registry", "http://x:1", "--pool", "p", "--name", "a"]).unwrap();
        assert!(matches!(d.a.action, Some(MnAction::Drain(_))));
    }

    /// On a host without RDMA (CI, the build machines) the programs fail with a clear,
    /// typed message instead of panicking. Inside the soft-RoCE VM this test is skipped.
    #[test]
    fn without_a_device_mn_and_cn_fail_clearly() {
        if omw_verbs::device::device_names().is_ok() {
            eprintln!("skipped: this machine has an RDMA device");
            return;
        }
        let e = run_mn(mn_args(&[])).unwrap_err();
        assert!(matches!(e, omw_verbs::VerbsError::NoDevice { .. }), "{e}");
        assert!(e.to_string().contains("no RDMA device"), "{e}");
        let e = run_cn(CnArgs {
            connect: "127.0.0.1:7471".parse().unwrap(),
            device: None,
            timeout: 1,
            tenant: None,
            secret_file: None,
            alloc_chains: 1,
            cmd: CnCmd::Alloc { count: 1 },
        })
        .unwrap_err();
        assert!(matches!(e, CnError::Verbs(omw_verbs::VerbsError::NoDevice { .. })), "{e}");
        assert!(e.to_string().contains("no RDMA device"), "{e}");
        let e = run_cn(CnArgs {
            connect: "127.0.0.1:7471".parse().unwrap(),
            device: None,
            timeout: 1,
            tenant: None,
            secret_file: None,
            alloc_chains: 1,
            cmd: CnCmd::Kv { keys: 4 },
        })
        .unwrap_err();
        assert!(matches!(e, CnError::Verbs(omw_verbs::VerbsError::NoDevice { .. })), "{e}");
        // and the handlers `omw mn` / `omw cn` / `omw probe` run turn that into a failure exit
        let mn_args = mn_args(&[]);
        assert_eq!(mn(mn_args), ExitCode::FAILURE);
        let cn_args = CnArgs {
            connect: "127.0.0.1:7471".parse().unwrap(),
            device: None,
            timeout: 1,
            tenant: None,
            secret_file: None,
            alloc_chains: 1,
            cmd: CnCmd::Script,
        };
        assert_eq!(cn(cn_args), ExitCode::FAILURE);
        assert_eq!(probe(ProbeArgs { device: None, gid_index: None }), ExitCode::FAILURE);
    }

    /// `--offload mlx5` never falls back silently: it refuses with the DEVX reason (here: no
    /// mlx5 device, or a build without the `devx` feature).
    #[test]
    fn offload_mlx5_refuses_with_a_reason() {
        let e = run_mn(mn_args(&["--offload", "mlx5"])).unwrap_err();
        let s = e.to_string();
        match &e {
            // a build without DEVX, or a device that cannot: the DEVX reason
            omw_verbs::VerbsError::Devx(d) => {
                assert!(s.starts_with("--offload mlx5: "), "{s}");
                if matches!(d, omw_verbs::devx::DevxError::NotBuilt) {
                    assert!(s.contains("--features devx"), "{s}");
                }
            }
            // DEVX built in (the workspace's cx-double turns omw-verbs' feature on) on a machine
            // without RDMA: the device open says what is missing and how to get it
            omw_verbs::VerbsError::NoDevice { .. } => assert!(s.contains("Load a driver"), "{s}"),
            other => panic!("--offload mlx5 without a ConnectX: {other}"),
        }
    }

    /// `--profile` is read before anything else: a missing or malformed file is refused with
    /// its name, line and key; it needs `--offload`.
    #[test]
    fn a_bad_profile_is_refused_naming_file_line_and_key() {
        let dir = std::env::temp_dir().join(format!("omw-cli-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.profile");
        let e = run_mn(mn_args(&["--offload", "mlx5", "--profile", missing.to_str().unwrap()])).unwrap_err();
        let s = e.to_string();
        assert!(
            matches!(e, omw_verbs::VerbsError::Devx(omw_verbs::devx::DevxError::Profile(_)))
                && s.contains("missing.profile")
                && s.contains("omw-mlx5-bringup"),
            "{s}"
        );
        let bad = dir.join("bad.profile");
        std::fs::write(
            &bad,
            "format = 1\ndevice = mlx5_0\nfirmware = 1.2.3\ndate = 2026-01-01T00:00:00Z\nwait_prefetch = sometimes\n",
        )
        .unwrap();
        let s = run_mn(mn_args(&["--offload", "mlx5", "--profile", bad.to_str().unwrap()])).unwrap_err().to_string();
        assert!(s.contains("bad.profile") && s.contains("line 5") && s.contains("wait_prefetch"), "{s}");
        std::fs::remove_dir_all(&dir).unwrap();
        // without --offload there is nothing to read it for
        use clap::Parser;
        #[derive(clap::Parser, Debug)]
        struct Mn {
            #[command(flatten)]
            a: MnArgs,
        }
        assert!(Mn::try_parse_from(["mn", "--listen", "127.0.0.1:7471", "--profile", "x"]).is_err());
        assert!(Mn::try_parse_from(["mn", "--listen", "127.0.0.1:7471", "--offload", "mlx5", "--profile", "x"]).is_ok());
    }
}
