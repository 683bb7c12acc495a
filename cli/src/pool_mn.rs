//! `omw mn --registry URL --pool NAME`: the MN daemon as a member of a pool (its membership on a
//! thread of its own: a slow or unreachable etcd never stalls the MN's loop), and
//! `omw mn drain`, the operator's drain request through the registry.

use omw_pool::announcer::{AnnounceTimes, Announcer, AnnouncerThread, Counts};
use omw_pool::entry::{ClassEntry, MnEntry};
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
    class: ClassEntry,
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
            vec![class.clone()],
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

/// The daemon as a pool member: start, register once listening, run until SIGINT/SIGTERM,
/// leave the pool first (CNs stop placing at once), then tear down.
pub fn serve(opts: MnOptions, m: Membership) -> Result<(), VerbsError> {
    let pool = Name::new(&m.pool).map_err(|e| config(format!("--pool: {e}")))?;
    let name = Name::new(&m.name).map_err(|e| config(format!("--name: {e}")))?;
    // the registry first: unreachable is the operator's to fix before anything is pinned
    let reg: SharedRegistry = Arc::new(EtcdRegistry::connect(&m.url).map_err(config)?);
    let stop = omw_verbs::signals::install()?;
    let drain = omw_verbs::signals::install_drain()?;
    let mut d = MemoryNodeDaemon::start(opts.clone())?;
    let chunks = (opts.pool_size / opts.chunk_size) as u32;
    let counts: Counts = Arc::new(Mutex::new((vec![chunks], 0)));
    let sink = counts.clone();
    d.on_counters(move |c| {
        if let Ok(mut s) = sink.lock() {
            *s = (vec![c.free_chunks.min(u32::MAX as u64) as u32], c.chunks.saturating_sub(c.free_chunks));
        }
    });
    let class = ClassEntry {
        chunk_size: opts.chunk_size,
        chunks,
        free: chunks,
        group_size: opts.group_size,
        addr: m.advertise.to_string(),
    };
    let a = register(reg, &pool, &name, class, m.ttl)?;
    log(&format!(
        "member {name} of pool {pool} at {} (lease {:?}; SIGUSR1 drains, SIGUSR2 ends draining)",
        m.url, m.ttl
    ));
    let th = AnnouncerThread::spawn(a, counts, drain, |msg| log(&msg))
        .map_err(|e| config(format!("announcer thread: {e}")))?;
    let r = d.run(stop);
    match th.leave() {
        Ok(()) => log(&format!("left pool {pool}")),
        Err(e) => log(&format!("leaving pool {pool}: {e} (the record goes when its lease runs out)")),
    }
    r?;
    drop(d);
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
