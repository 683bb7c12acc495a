//! The MN side of membership: register under a lease, keep it alive, publish counts at a
//! bounded rate, follow an operator's drain request, leave cleanly.
//!
//! Sans-IO in time: every call takes the caller's clock (ns), so the same code runs in the MN
//! daemon (wall clock) and on the model (modelled time). The registry calls themselves block
//! (bounded by the registry's own timeout).

use crate::entry::{ClassEntry, MnEntry, ENTRY_FORMAT};
use crate::registry::{LeaseId, Name, RegistryError, SharedRegistry};
use std::time::Duration;

/// How an MN announces itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnnounceTimes {
    /// The lease's TTL: an MN that stops keeping it alive leaves the pool this long after.
    pub ttl: Duration,
    /// Keep-alive period (a third of the TTL: two may be lost before the lease runs out).
    pub keep_alive: Duration,
    /// Counts are published at most this often (and only when they changed); the drain flag
    /// at once.
    pub min_publish: Duration,
}

impl AnnounceTimes {
    pub fn for_ttl(ttl: Duration) -> Self {
        AnnounceTimes { ttl, keep_alive: ttl / 3, min_publish: Duration::from_millis(250).min(ttl / 4) }
    }
}

/// Default lease TTL (etcd's granularity is a second).
pub const DEFAULT_TTL: Duration = Duration::from_secs(3);

/// What one refresh did (for the daemon's log).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Refresh {
    pub published: bool,
    pub kept_alive: bool,
    /// The lease had expired (the MN was cut off from the registry too long): registered
    /// again under a new lease — CNs saw it depart and will see it join anew.
    pub reregistered: bool,
    /// The drain flag changed (operator request or the MN's own).
    pub draining_changed: Option<bool>,
    /// Draining and holding nothing: the MN may be stopped (reported once per drain).
    pub drained: bool,
}

/// An MN's membership.
pub struct Announcer {
    registry: SharedRegistry,
    pool: Name,
    name: Name,
    entry: MnEntry,
    lease: Option<LeaseId>,
    times: AnnounceTimes,
    last_keep_alive: u64,
    last_publish: u64,
    dirty: bool,
    /// Draining by the MN's own decision (a signal), besides the registry's request.
    self_drain: bool,
    requested_drain: bool,
    drained_reported: bool,
}

impl std::fmt::Debug for Announcer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcer")
            .field("pool", &self.pool)
            .field("name", &self.name)
            .field("lease", &self.lease)
            .finish()
    }
}

fn ns(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
}

impl Announcer {
    /// Register MN `name` of `pool` with `classes` (their `free` counts as they are now).
    /// `incarnation` must differ from every earlier run of this MN (a random or time-derived
    /// number), so CNs tell a restart from a refresh.
    pub fn register(
        registry: SharedRegistry,
        pool: Name,
        name: Name,
        incarnation: u64,
        classes: Vec<ClassEntry>,
        times: AnnounceTimes,
        now: u64,
    ) -> Result<Self, RegistryError> {
        let held = classes.iter().map(|c| (c.chunks - c.free) as u64).sum();
        let entry =
            MnEntry { format: ENTRY_FORMAT, name: name.to_string(), incarnation, classes, draining: false, held };
        let requested_drain = registry.drain_requested(&pool, &name)?;
        let mut a = Announcer {
            registry,
            pool,
            name,
            entry,
            lease: None,
            times,
            last_keep_alive: now,
            last_publish: now,
            dirty: false,
            self_drain: false,
            requested_drain,
            drained_reported: false,
        };
        a.entry.draining = requested_drain;
        a.lease = Some(a.registry.register(&a.pool, &a.name, &a.entry.encode(), times.ttl)?);
        Ok(a)
    }

    pub fn entry(&self) -> &MnEntry {
        &self.entry
    }
    pub fn draining(&self) -> bool {
        self.entry.draining
    }

    /// New free counts of the classes (in the registered order) and chunks held over all.
    pub fn set_counts(&mut self, free: &[u32]) {
        let mut held = 0u64;
        for (c, f) in self.entry.classes.iter_mut().zip(free) {
            let f = (*f).min(c.chunks);
            if c.free != f {
                c.free = f;
                self.dirty = true;
            }
            held += (c.chunks - f) as u64;
        }
        self.entry.held = held;
    }

    /// The MN's own drain decision (a signal, or a flag at start-up).
    pub fn set_self_drain(&mut self, on: bool) {
        self.self_drain = on;
    }

    /// Keep the lease alive, follow a drain request, publish what changed — each when due.
    /// `held_by_cns`: chunks CNs hold now (a drained MN holds none).
    pub fn refresh(&mut self, now: u64, held_by_cns: u64) -> Result<Refresh, RegistryError> {
        let mut r = Refresh::default();
        let keep_due = now.saturating_sub(self.last_keep_alive) >= ns(self.times.keep_alive);
        let publish_due = now.saturating_sub(self.last_publish) >= ns(self.times.min_publish);
        if keep_due {
            self.last_keep_alive = now;
            match self.lease.map(|l| self.registry.keep_alive(l)) {
                Some(Ok(())) => r.kept_alive = true,
                Some(Err(RegistryError::LeaseExpired(_))) | None => {
                    self.lease =
                        Some(self.registry.register(&self.pool, &self.name, &self.entry.encode(), self.times.ttl)?);
                    r.reregistered = true;
                }
                Some(Err(e)) => return Err(e),
            }
            // the operator's request is read at the keep-alive's pace
            self.requested_drain = self.registry.drain_requested(&self.pool, &self.name)?;
        }
        let draining = self.self_drain || self.requested_drain;
        if draining != self.entry.draining {
            self.entry.draining = draining;
            self.dirty = true;
            self.drained_reported = false;
            r.draining_changed = Some(draining);
        }
        if draining && held_by_cns == 0 && !self.drained_reported {
            self.drained_reported = true;
            r.drained = true;
        }
        if self.dirty && (publish_due || r.draining_changed.is_some()) {
            if let Some(l) = self.lease {
                match self.registry.update(&self.pool, &self.name, &self.entry.encode(), l) {
                    Ok(()) => {}
                    Err(RegistryError::LeaseExpired(_)) => {
                        self.lease = Some(self.registry.register(
                            &self.pool,
                            &self.name,
                            &self.entry.encode(),
                            self.times.ttl,
                        )?);
                        r.reregistered = true;
                    }
                    Err(e) => return Err(e),
                }
            }
            self.dirty = false;
            self.last_publish = now;
            r.published = true;
        }
        Ok(r)
    }

    /// Leave the pool: the record is deleted and the lease revoked (CNs see it depart at once,
    /// not a TTL later).
    pub fn leave(mut self) -> Result<(), RegistryError> {
        match self.lease.take() {
            Some(l) => self.registry.deregister(&self.pool, &self.name, l),
            None => Ok(()),
        }
    }
}

/// An MN's membership on a thread of its own, so a slow or unreachable registry never stalls
/// the MN's loop: every 100 ms it takes the MN's counts, keeps the lease alive, follows drain
/// requests and the MN's own drain flag, publishes, and says what changed through `log`.
#[derive(Debug)]
pub struct AnnouncerThread {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: std::thread::JoinHandle<Result<(), RegistryError>>,
}

/// The MN's counts as its loop publishes them for the announcer: each class's free chunks,
/// and the chunks CNs hold.
pub type Counts = std::sync::Arc<std::sync::Mutex<(Vec<u32>, u64)>>;

impl AnnouncerThread {
    pub fn spawn(
        mut a: Announcer,
        counts: Counts,
        self_drain: &'static std::sync::atomic::AtomicBool,
        log: impl Fn(String) + Send + 'static,
    ) -> std::io::Result<Self> {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::Builder::new()
            .name("omw-announce".into())
            .spawn(move || {
                let t0 = std::time::Instant::now();
                let mut cut_off = false;
                while !s.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    let (free, held) = counts.lock().map(|c| c.clone()).unwrap_or_default();
                    a.set_counts(&free);
                    a.set_self_drain(self_drain.load(Ordering::Relaxed));
                    match a.refresh(ns(t0.elapsed()), held) {
                        Ok(r) => {
                            if cut_off {
                                cut_off = false;
                                log(format!("registry {} reachable again", a.registry.url()));
                            }
                            if r.reregistered {
                                log("the registry lease had expired: registered again (CNs saw this MN leave and come back; what they held here was reclaimed as they disconnected)".into());
                            }
                            match r.draining_changed {
                                Some(true) => log("draining: no new placements; live allocations keep working".into()),
                                Some(false) => log("draining ended: placements welcome again".into()),
                                None => {}
                            }
                            if r.drained {
                                log("drained: no CN holds a chunk here any more; this MN can be stopped".into());
                            }
                        }
                        Err(e) => {
                            if !cut_off {
                                cut_off = true;
                                log(format!("{e}; serving on (the lease runs out unless the registry comes back)"));
                            }
                        }
                    }
                }
                a.leave()
            })?;
        Ok(AnnouncerThread { stop, handle })
    }

    /// Stop refreshing and leave the pool (the record deleted, the lease revoked).
    pub fn leave(self) -> Result<(), RegistryError> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle.join().unwrap_or(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::InProcessRegistry;
    use crate::registry::{Registry, RegistryEvent};

    fn class(free: u32) -> ClassEntry {
        ClassEntry { chunk_size: 4096, chunks: 8, free, group_size: 3, addr: "x".into() }
    }

    #[test]
    fn counts_are_published_at_a_bounded_rate_and_the_drain_flag_at_once() {
        let reg = InProcessRegistry::new();
        let pool = Name::new("p").unwrap();
        let w = reg.watch(&pool).unwrap();
        let times = AnnounceTimes::for_ttl(Duration::from_secs(3));
        let mut a = Announcer::register(
            std::sync::Arc::new(reg.clone()),
            pool.clone(),
            Name::new("a").unwrap(),
            1,
            vec![class(8)],
            times,
            0,
        )
        .unwrap();
        let ms = 1_000_000u64;
        let mut puts = 0;
        for t in 1..=1000u64 {
            a.set_counts(&[(8 - t % 8) as u32]);
            reg.set_now(t * ms);
            a.refresh(t * ms, 0).unwrap();
        }
        for ev in w.drain() {
            if matches!(ev, RegistryEvent::Put { .. }) {
                puts += 1;
            }
        }
        // 1000 changes in 1 s at one publish per 250 ms (+ the registration)
        assert!((4..=6).contains(&puts), "{puts}");
        // the lease was kept alive all along
        assert_eq!(reg.members(&pool).unwrap().len(), 1);
        // an operator's drain request reaches the record at the next keep-alive
        reg.request_drain(&pool, &Name::new("a").unwrap(), true).unwrap();
        let r = a.refresh(2000 * ms, 3).unwrap();
        assert_eq!(r.draining_changed, Some(true));
        assert!(r.published && !r.drained);
        let e = MnEntry::parse("a", &reg.members(&pool).unwrap()[0].1).unwrap();
        assert!(e.draining);
        // and once it holds nothing it says so, once
        assert!(a.refresh(2001 * ms, 0).unwrap().drained);
        assert!(!a.refresh(2002 * ms, 0).unwrap().drained);
        a.leave().unwrap();
        assert_eq!(reg.members(&pool).unwrap(), vec![]);
    }

    #[test]
    fn an_expired_lease_is_registered_again() {
        let reg = InProcessRegistry::new();
        let pool = Name::new("p").unwrap();
        let times = AnnounceTimes::for_ttl(Duration::from_secs(3));
        let mut a = Announcer::register(
            std::sync::Arc::new(reg.clone()),
            pool.clone(),
            Name::new("a").unwrap(),
            1,
            vec![class(8)],
            times,
            0,
        )
        .unwrap();
        // cut off for longer than the TTL: the record went
        reg.set_now(10_000_000_000);
        assert_eq!(reg.members(&pool).unwrap(), vec![]);
        let r = a.refresh(10_000_000_000, 0).unwrap();
        assert!(r.reregistered);
        assert_eq!(reg.members(&pool).unwrap().len(), 1);
    }
}
