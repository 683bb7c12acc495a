//! `omw mn --classes …` and `omw mn --registry URL --pool NAME`: an MN of several size classes
//! (one daemon — one `MemoryNode`, MWTable, free queue and chains — per class, on consecutive
//! ports of the same device, in one loop) and as a member of a pool (its membership on a thread
//! of its own: a slow or unreachable etcd never stalls the MN's loop); `omw mn drain`, the
//! operator's drain request through the registry.

use omw_pool::announcer::{AnnounceTimes, Announcer, AnnouncerThread, Counts};
use omw_pool::entry::{ClassEntry, ClassSpec, MnEntry};
use omw_pool::etcd::EtcdRegistry;
use omw_pool::registry::{Name, Registry, RegistryError, SharedRegistry};
use omw_verbs::log::Level;
use omw_verbs::mn::{MemoryNodeDaemon, MnOptions};
use omw_verbs::VerbsError;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TARGET: &str = "omw_verbs::mn";

fn log(msg: &str) {
    omw_verbs::log::log(TARGET, "omw mn", Level::Info, msg);
}

fn config(e: impl std::fmt::Display) -> VerbsError {
    VerbsError::Config(e.to_string())
}

/// Where and as what the MN joins.
#[derive(Debug, Clone)]
pub struct Membership {
    pub url: String,
    pub pool: String,
    pub name: String,
    pub advertise: SocketAddr,
    pub ttl: Duration,
}

/// Register, waiting out a stale record of this name (a previous run of this MN that died
/// without leaving holds it until its lease runs out); another live MN of that name is an
/// error after the same wait.
fn register(
    reg: SharedRegistry,
    pool: &Name,
    name: &Name,
    classes: Vec<ClassEntry>,
    ttl: Duration,
) -> Result<Announcer, VerbsError> {
    let incarnation =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
            ^ ((std::process::id() as u64) << 48);
    let t0 = Instant::now();
    let mut said = false;
    loop {
        let r = Announcer::register(
            reg.clone(),
            pool.clone(),
            name.clone(),
            incarnation,
            classes.clone(),
            AnnounceTimes::for_ttl(ttl),
            0,
        );
        match r {
            Err(RegistryError::NameTaken(_)) if t0.elapsed() < ttl + Duration::from_secs(2) => {
                if !said {
                    said = true;
                    log(&format!(
                        "MN name {name} is registered already: waiting up to {:?} for a stale record to expire",
                        ttl + Duration::from_secs(2)
                    ));
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            r => return r.map_err(config),
        }
    }
}

/// The MN's classes' daemons in one loop and, with a membership, as a pool member: start
/// every class, register once all listen, run until SIGINT/SIGTERM, leave the pool first (CNs
/// stop placing at once), then tear down.
pub fn serve(opts: MnOptions, classes: &[ClassSpec], m: Option<Membership>) -> Result<(), VerbsError> {
    let names = match &m {
        Some(m) => Some((
            Name::new(&m.pool).map_err(|e| config(format!("--pool: {e}")))?,
            Name::new(&m.name).map_err(|e| config(format!("--name: {e}")))?,
        )),
        None => None,
    };
    // the registry first: unreachable is the operator's to fix before anything is pinned
    let reg: Option<SharedRegistry> = match &m {
        Some(m) => Some(Arc::new(EtcdRegistry::connect(&m.url).map_err(config)?)),
        None => None,
    };
    let stop = omw_verbs::signals::install()?;
    let drain = omw_verbs::signals::install_drain()?;
    let counts: Counts = Arc::new(Mutex::new((classes.iter().map(|c| c.chunks).collect(), 0)));
    let mut daemons = Vec::new();
    let mut entries = Vec::new();
    for (i, c) in classes.iter().enumerate() {
        let mut o = opts.clone();
        o.chunk_size = c.chunk_size;
        o.pool_size = c.chunk_size * c.chunks as u64;
        let port = opts.listen.port().checked_add(i as u16).ok_or_else(|| config("--listen port + classes > 65535"))?;
        o.listen.set_port(port);
        // one metrics endpoint: the first class's
        if i > 0 {
            o.metrics = None;
        }
        log(&format!("class {i}: {} chunks of {} B on port {port}", c.chunks, c.chunk_size));
        let mut d = MemoryNodeDaemon::start(o)?;
        if i == 0 {
            // the classes together against the device's windows, registrations and QPs, before
            // any other class pins anything — `omw plan --classes`' check (`Footprint::combined`)
            let max_cns = d.driver.mn.config().max_cns;
            let specs: Vec<omw_core::mn::provision::PoolSpec> = classes
                .iter()
                .map(|c| omw_core::mn::provision::PoolSpec {
                    chunk_size: c.chunk_size,
                    chunks: c.chunks,
                    group_size: opts.group_size,
                    max_cns,
                    quota: 0,
                    lease_ns: 0,
                    queue_depth: None,
                })
                .collect();
            let limits = d.driver.backend.device_info().limits();
            omw_verbs::mn::classes_fit_device(&d.plan, &specs, opts.alloc_chains, &limits)?;
            log(&format!(
                "classes: {} of them fit the device together (max_mw {}, max_mr {}, max_qp {})",
                classes.len(),
                limits.max_mw,
                limits.max_mr,
                limits.max_qp
            ));
        }
        let sink = counts.clone();
        let all: Vec<u32> = classes.iter().map(|c| c.chunks).collect();
        d.on_counters(move |k| {
            if let Ok(mut s) = sink.lock() {
                if let Some(f) = s.0.get_mut(i) {
                    *f = k.free_chunks.min(all[i] as u64) as u32;
                }
                // chunks held over every class: what a drain waits for
                s.1 = all.iter().zip(&s.0).map(|(c, f)| c.saturating_sub(*f) as u64).sum();
            }
        });
        let mut advertise = m.as_ref().map_or(opts.listen, |m| m.advertise);
        advertise.set_port(port);
        entries.push(ClassEntry {
            chunk_size: c.chunk_size,
            chunks: c.chunks,
            free: c.chunks,
            group_size: opts.group_size,
            addr: advertise.to_string(),
        });
        daemons.push(d);
    }
    let th = match (reg, names, &m) {
        (Some(reg), Some((pool, name)), Some(m)) => {
            let a = register(reg, &pool, &name, entries, m.ttl)?;
            log(&format!(
                "member {name} of pool {pool} at {} with {} class(es) (lease {:?}; SIGUSR1 drains, SIGUSR2 ends draining)",
                m.url,
                classes.len(),
                m.ttl
            ));
            let th = AnnouncerThread::spawn(a, counts.clone(), drain, |msg| log(&msg))
                .map_err(|e| config(format!("announcer thread: {e}")))?;
            Some((th, pool))
        }
        _ => None,
    };
    let r = MemoryNodeDaemon::run_all(&mut daemons, stop);
    if let Some((th, pool)) = th {
        match th.leave() {
            Ok(()) => log(&format!("left pool {pool}")),
            Err(e) => log(&format!("leaving pool {pool}: {e} (the record goes when its lease runs out)")),
        }
    }
    r?;
    drop(daemons);
    log("stopped");
    Ok(())
}

/// `omw mn drain`: the operator's request; with a wait, until the MN's record says it holds
/// no chunk (or it left).
pub fn drain(a: &super::verbs::DrainArgs) -> Result<(), VerbsError> {
    let pool = Name::new(&a.pool).map_err(|e| config(format!("--pool: {e}")))?;
    let name = Name::new(&a.name).map_err(|e| config(format!("--name: {e}")))?;
    let reg = EtcdRegistry::connect(&a.registry).map_err(config)?;
    reg.request_drain(&pool, &name, !a.off).map_err(config)?;
    println!("{} {name} of pool {pool}", if a.off { "asked to stop draining:" } else { "asked to drain:" });
    if a.wait_s == 0 || a.off {
        return Ok(());
    }
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(a.wait_s) {
        let members = reg.members(&pool).map_err(config)?;
        match members.iter().find(|(n, _)| n == name.as_str()) {
            None => {
                println!("{name} is not a member (any more)");
                return Ok(());
            }
            Some((_, v)) => match MnEntry::parse(name.as_str(), v) {
                Ok(e) if e.draining && e.held == 0 => {
                    println!("{name} is drained: it holds no chunk");
                    return Ok(());
                }
                Ok(_) => {}
                Err(e) => return Err(config(format!("{name}'s record: {e}"))),
            },
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(VerbsError::Timeout { what: format!("{name} to drain within {} s", a.wait_s) })
}
