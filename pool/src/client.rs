//! The CN side of a pool: membership from the registry's watch, lazy connections, placement,
//! and routing every operation to the allocation's own MN.
//!
//! Failure semantics (docs/POOL.md):
//! - An MN **departs** when its record goes (its lease expired, or it left), when a newer
//!   incarnation replaces it, or when its connection is lost. The client drops its connections
//!   to it (the MN, if alive, reclaims what this CN held there), places nothing more on it,
//!   and every operation on an allocation it held fails at once with [`PoolError::MnLost`].
//! - An MN that comes back (a new record) is a new member: placed on again, connected afresh.
//! - **Draining**: no placement; allocations on it keep working.
//! - A record that does not parse, a class the client cannot connect to, a class whose real
//!   geometry is not the advertised one: skipped with a [`PoolNote`] saying why (a connection
//!   problem is retried after [`RETRY_AFTER`] further placements). Never a panic.
//! - The registry lost: the client keeps the members it knows, says so, and resynchronises
//!   when the registry is back.

use crate::entry::{EntryError, MnEntry};
use crate::placement::{self, Candidate};
use crate::registry::{Name, Registry, RegistryError, RegistryEvent, Watch};
use crate::session::{Connector, MnSession, SessionError};
use omw_core::cn::Allocation;
use omw_core::rng::SeededRng;
use std::collections::BTreeMap;
use std::fmt;

/// A class skipped for a connection problem is tried again after this many placements.
pub const RETRY_AFTER: u64 = 64;

/// An allocation of the pool: the chunk, and the MN (name and incarnation) and class it lives
/// in — every free, read and write goes there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolAlloc {
    mn: String,
    incarnation: u64,
    /// Which of this client's memberships of the MN it was placed in: an MN that departed and
    /// came back — even as the same incarnation, after its lease lapsed — is a new membership
    /// whose connections are new, so the old allocations are not found there.
    epoch: u64,
    chunk_size: u64,
    alloc: Allocation,
}

impl PoolAlloc {
    pub fn mn(&self) -> &str {
        &self.mn
    }
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }
    /// The class's chunk size (the usable length of the allocation).
    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }
    pub fn allocation(&self) -> &Allocation {
        &self.alloc
    }
}

/// Why an MN left the client's view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Departure {
    /// Its record went: its lease expired (or it left cleanly).
    RecordGone,
    /// A newer incarnation of it published a record: the old one's allocations are gone.
    Replaced,
    /// The connection to it failed.
    ConnectionLost,
}

/// Why an MN or one of its classes is not placed on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Its record does not parse or is inconsistent.
    Entry(EntryError),
    /// Connecting to the class failed (the message of the connector's error).
    Unreachable { chunk_size: u64, detail: String },
    /// The MN's connect info says another geometry than the record advertises.
    Geometry { advertised: (u64, u8), actual: (u64, u8) },
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Skip::Entry(e) => write!(f, "record refused: {e}"),
            Skip::Unreachable { chunk_size, detail } => write!(f, "class {chunk_size} B unreachable: {detail}"),
            Skip::Geometry { advertised, actual } => write!(
                f,
                "advertises chunks of {} B in groups of {}, but its connect info says {} B in groups of {}",
                advertised.0, advertised.1, actual.0, actual.1
            ),
        }
    }
}

/// What the client saw happen to the pool (for logs, the demo and tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolNote {
    Joined {
        mn: String,
        incarnation: u64,
    },
    /// An MN the client had seen depart is back (a new member).
    Rejoined {
        mn: String,
        incarnation: u64,
    },
    Departed {
        mn: String,
        why: Departure,
        lost_allocations: u64,
    },
    Skipped {
        mn: String,
        why: Skip,
    },
    Draining {
        mn: String,
    },
    DrainEnded {
        mn: String,
    },
    /// The registry cannot be reached: the client goes on with the MNs it knows.
    RegistryLost(RegistryError),
    RegistryBack,
}

impl fmt::Display for PoolNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolNote::Joined { mn, incarnation } => write!(f, "MN {mn} joined (incarnation {incarnation:#x})"),
            PoolNote::Rejoined { mn, incarnation } => write!(f, "MN {mn} rejoined (incarnation {incarnation:#x})"),
            PoolNote::Departed { mn, why, lost_allocations } => {
                let why = match why {
                    Departure::RecordGone => "its registry record went (lease expired or it left)",
                    Departure::Replaced => "a new incarnation replaced it",
                    Departure::ConnectionLost => "the connection to it was lost",
                };
                write!(f, "MN {mn} departed: {why}; {lost_allocations} allocation(s) of this CN lost")
            }
            PoolNote::Skipped { mn, why } => write!(f, "MN {mn} skipped: {why}"),
            PoolNote::Draining { mn } => write!(f, "MN {mn} is draining: no new placements"),
            PoolNote::DrainEnded { mn } => write!(f, "MN {mn} no longer drains"),
            PoolNote::RegistryLost(e) => write!(f, "{e}; going on with the MNs known"),
            PoolNote::RegistryBack => f.write_str("registry reachable again; membership resynchronised"),
        }
    }
}

/// A pool operation's failure.
#[derive(Debug)]
#[non_exhaustive]
pub enum PoolError<E> {
    /// Watching the registry failed at start (it names the URL).
    Registry(RegistryError),
    /// No live MN has a class of at least `size` bytes.
    NoClass { size: u64, largest: Option<u64> },
    /// Every MN offering the class answered "empty" (or none is placeable).
    Empty { chunk_size: u64 },
    /// Every MN that had room refused for this CN's quota.
    QuotaExceeded { chunk_size: u64 },
    /// The allocation's MN departed: its chunk is gone (the MN reclaimed it).
    MnLost { mn: String },
    /// An offset and length outside the allocation.
    OutOfBounds { offset: u64, len: u64, chunk_size: u64 },
    /// The MN's own failure for this operation.
    Session { mn: String, error: SessionError<E> },
}

impl<E: fmt::Display> fmt::Display for PoolError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::Registry(e) => write!(f, "{e}"),
            PoolError::NoClass { size, largest: Some(l) } => {
                write!(f, "no size class holds {size} B (the largest the pool offers is {l} B)")
            }
            PoolError::NoClass { size, largest: None } => write!(f, "no live MN to place {size} B on"),
            PoolError::Empty { chunk_size } => write!(f, "every MN with {chunk_size}-B chunks is empty"),
            PoolError::QuotaExceeded { chunk_size } => {
                write!(f, "every MN with free {chunk_size}-B chunks refused: quota exceeded")
            }
            PoolError::MnLost { mn } => write!(f, "MN {mn} is gone: the allocation was lost with it"),
            PoolError::OutOfBounds { offset, len, chunk_size } => {
                write!(f, "{len} B at offset {offset} is outside a {chunk_size}-B chunk")
            }
            PoolError::Session { mn, error } => write!(f, "MN {mn}: {error}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for PoolError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PoolError::Registry(e) => Some(e),
            PoolError::Session { error, .. } => Some(error),
            _ => None,
        }
    }
}

struct Class<S> {
    free_hint: u64,
    session: Option<S>,
    /// Skipped until this many placements have been made (0: not skipped).
    skipped_until: u64,
    /// Skipped for good (its geometry is not what the record says) until a new incarnation.
    wrong_geometry: bool,
}

struct Member<S> {
    entry: MnEntry,
    /// The record's latest version did not parse: not placed on (allocations keep working).
    refused: bool,
    classes: Vec<Class<S>>,
    /// Allocations of this client on it.
    held: u64,
    placed: u64,
    /// This client's count of joins when it joined (see [`PoolAlloc`]).
    epoch: u64,
}

/// What the client knows of one MN (for printing and benchmarks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberView {
    pub name: String,
    pub incarnation: u64,
    pub draining: bool,
    /// (chunk size, free as last published minus this client's own placements since).
    pub classes: Vec<(u64, u64)>,
    /// This client's live allocations on it, and how many it placed there in all.
    pub held: u64,
    pub placed: u64,
    pub connected_classes: usize,
}

/// The pool as one CN uses it.
pub struct PoolClient<C: Connector> {
    pool: Name,
    url: String,
    connector: C,
    watch: Watch,
    members: BTreeMap<String, Member<C::Session>>,
    /// Names that departed (so a return is a rejoin).
    departed: BTreeMap<String, u64>,
    rng: SeededRng,
    notes: Vec<PoolNote>,
    placements: u64,
    registry_lost: bool,
    joins: u64,
}

type PResult<T, C> = Result<T, PoolError<<<C as Connector>::Session as MnSession>::Error>>;

impl<C: Connector> PoolClient<C> {
    /// Watch `pool` in `registry` and place through `connector`. Fails with the registry's
    /// error (naming its URL) if it cannot be reached now.
    pub fn new(registry: &dyn Registry, pool: Name, connector: C, seed: u64) -> PResult<Self, C> {
        let watch = registry.watch(&pool).map_err(PoolError::Registry)?;
        let mut c = PoolClient {
            pool,
            url: registry.url(),
            connector,
            watch,
            members: BTreeMap::new(),
            departed: BTreeMap::new(),
            rng: SeededRng::new(seed),
            notes: Vec::new(),
            placements: 0,
            registry_lost: false,
            joins: 0,
        };
        c.poll();
        Ok(c)
    }

    pub fn pool(&self) -> &Name {
        &self.pool
    }
    pub fn registry_url(&self) -> &str {
        &self.url
    }
    pub fn connector(&mut self) -> &mut C {
        &mut self.connector
    }
    /// Whether the registry is cut off right now (the client goes on with what it knew).
    pub fn registry_lost(&self) -> bool {
        self.registry_lost
    }

    /// What happened since the last call (the registry's news taken first).
    pub fn take_notes(&mut self) -> Vec<PoolNote> {
        self.poll();
        std::mem::take(&mut self.notes)
    }

    /// The members as the client sees them now.
    pub fn members(&self) -> Vec<MemberView> {
        self.members
            .iter()
            .map(|(name, m)| MemberView {
                name: name.clone(),
                incarnation: m.entry.incarnation,
                draining: m.entry.draining,
                classes: m.entry.classes.iter().zip(&m.classes).map(|(e, c)| (e.chunk_size, c.free_hint)).collect(),
                held: m.held,
                placed: m.placed,
                connected_classes: m.classes.iter().filter(|c| c.session.is_some()).count(),
            })
            .collect()
    }

    /// Take what the registry reported since the last call, and service every connection
    /// (an MN's lease probes need answers even on connections this CN is not using now).
    /// Operations call it; a CN idle for long calls it itself, about once a lease period.
    pub fn poll(&mut self) {
        for ev in self.watch.drain() {
            self.apply(ev);
        }
        let mut lost = Vec::new();
        for (name, m) in self.members.iter_mut() {
            for s in m.classes.iter_mut().filter_map(|c| c.session.as_mut()) {
                if let Err(SessionError::Lost(_)) = s.service() {
                    lost.push(name.clone());
                    break;
                }
            }
        }
        for name in lost {
            self.depart(&name, Departure::ConnectionLost);
        }
    }

    fn apply(&mut self, ev: RegistryEvent) {
        match ev {
            RegistryEvent::Resync(all) => {
                if self.registry_lost {
                    self.registry_lost = false;
                    self.notes.push(PoolNote::RegistryBack);
                }
                let gone: Vec<String> =
                    self.members.keys().filter(|k| !all.iter().any(|(n, _)| n == *k)).cloned().collect();
                for name in gone {
                    self.depart(&name, Departure::RecordGone);
                }
                for (name, value) in all {
                    self.put(name, &value);
                }
            }
            RegistryEvent::Put { name, value } => self.put(name, &value),
            RegistryEvent::Delete { name } => self.depart(&name, Departure::RecordGone),
            RegistryEvent::Lost(e) => {
                if !self.registry_lost {
                    self.registry_lost = true;
                    self.notes.push(PoolNote::RegistryLost(e));
                }
            }
        }
    }

    fn put(&mut self, name: String, value: &[u8]) {
        let entry = match MnEntry::parse(&name, value) {
            Ok(e) => e,
            Err(e) => {
                let why = Skip::Entry(e);
                match self.members.get_mut(&name) {
                    // keep routing its live allocations; place nothing more there
                    Some(m) if !m.refused => {
                        m.refused = true;
                        self.notes.push(PoolNote::Skipped { mn: name, why });
                    }
                    Some(_) => {}
                    None => self.notes.push(PoolNote::Skipped { mn: name, why }),
                }
                return;
            }
        };
        if let Some(m) = self.members.get(&name) {
            if m.entry.incarnation != entry.incarnation {
                self.depart(&name, Departure::Replaced);
            }
        }
        match self.members.get_mut(&name) {
            Some(m) => {
                if m.entry.draining != entry.draining {
                    self.notes.push(match entry.draining {
                        true => PoolNote::Draining { mn: name.clone() },
                        false => PoolNote::DrainEnded { mn: name.clone() },
                    });
                }
                // same incarnation: new counts; a class layout that changed under a running
                // MN is not something an MN does — take the record's and keep sessions whose
                // chunk size is still there
                let mut old: Vec<(u64, Class<C::Session>)> =
                    m.entry.classes.iter().map(|c| c.chunk_size).zip(m.classes.drain(..)).collect();
                for c in &entry.classes {
                    let pos = old.iter().position(|(s, _)| *s == c.chunk_size);
                    let mut cls = match pos {
                        Some(p) => old.swap_remove(p).1,
                        None => Class { free_hint: 0, session: None, skipped_until: 0, wrong_geometry: false },
                    };
                    cls.free_hint = c.free as u64;
                    m.classes.push(cls);
                }
                m.entry = entry;
                m.refused = false;
            }
            None => {
                let rejoin = self.departed.remove(&name).is_some();
                let incarnation = entry.incarnation;
                self.notes.push(match rejoin {
                    true => PoolNote::Rejoined { mn: name.clone(), incarnation },
                    false => PoolNote::Joined { mn: name.clone(), incarnation },
                });
                if entry.draining {
                    self.notes.push(PoolNote::Draining { mn: name.clone() });
                }
                let classes = entry
                    .classes
                    .iter()
                    .map(|c| Class { free_hint: c.free as u64, session: None, skipped_until: 0, wrong_geometry: false })
                    .collect();
                self.joins += 1;
                let epoch = self.joins;
                self.members.insert(name, Member { entry, refused: false, classes, held: 0, placed: 0, epoch });
            }
        }
    }

    /// The MN leaves the view: its connections are dropped (so it reclaims this CN's chunks
    /// if it is alive), its allocations are lost.
    fn depart(&mut self, name: &str, why: Departure) {
        if let Some(m) = self.members.remove(name) {
            self.departed.insert(name.to_string(), m.entry.incarnation);
            self.notes.push(PoolNote::Departed { mn: name.to_string(), why, lost_allocations: m.held });
        }
    }

    /// The smallest class of at least `size` bytes any placeable MN offers.
    fn class_for(&self, size: u64) -> Result<u64, (u64, Option<u64>)> {
        let offered = self.members.values().filter(|m| !m.refused).flat_map(|m| {
            let draining = m.entry.draining;
            m.entry.classes.iter().map(move |c| (c.chunk_size, draining))
        });
        let mut best: Option<u64> = None;
        let mut largest: Option<u64> = None;
        for (s, draining) in offered {
            largest = largest.max(Some(s));
            if !draining && s >= size && best.is_none_or(|b| s < b) {
                best = Some(s);
            }
        }
        best.ok_or((size, largest))
    }

    /// Place one chunk of the smallest class that holds `size` bytes.
    pub fn alloc(&mut self, size: u64) -> PResult<PoolAlloc, C> {
        self.poll();
        let chunk_size = self.class_for(size).map_err(|(size, largest)| PoolError::NoClass { size, largest })?;
        self.alloc_class(chunk_size)
    }

    /// Place one chunk of exactly the class `chunk_size`.
    pub fn alloc_class(&mut self, chunk_size: u64) -> PResult<PoolAlloc, C> {
        self.poll();
        self.placements += 1;
        let names: Vec<String> = self.members.keys().cloned().collect();
        let mut cands = Vec::new();
        for (idx, name) in names.iter().enumerate() {
            let m = &self.members[name];
            if m.refused || m.entry.draining {
                continue;
            }
            let Some(ci) = m.entry.classes.iter().position(|c| c.chunk_size == chunk_size) else { continue };
            let cls = &m.classes[ci];
            if cls.wrong_geometry || cls.skipped_until > self.placements {
                continue;
            }
            cands.push(Candidate { idx, free: cls.free_hint });
        }
        let order = placement::order(&cands, &mut self.rng);
        let mut quota = false;
        let mut failure = None;
        for idx in order {
            let name = &names[idx];
            match self.try_place(name, chunk_size) {
                Ok(a) => return Ok(a),
                Err(SessionError::Empty) => {}
                Err(SessionError::QuotaExceeded) => quota = true,
                Err(SessionError::Lost(e)) => {
                    failure = Some((name.clone(), SessionError::Lost(e)));
                    self.depart(&name.clone(), Departure::ConnectionLost);
                }
                Err(SessionError::Failed(e)) => failure = Some((name.clone(), SessionError::Failed(e))),
            }
        }
        match (quota, failure) {
            (true, _) => Err(PoolError::QuotaExceeded { chunk_size }),
            // a lost MN was left behind; the others had nothing: the pool is empty for this CN
            (false, Some((mn, error @ SessionError::Failed(_)))) => Err(PoolError::Session { mn, error }),
            _ => Err(PoolError::Empty { chunk_size }),
        }
    }

    /// One placement attempt on `name`'s class `chunk_size`: connect if needed, check the
    /// geometry, allocate.
    fn try_place(
        &mut self,
        name: &str,
        chunk_size: u64,
    ) -> Result<PoolAlloc, SessionError<<C::Session as MnSession>::Error>> {
        let placements = self.placements;
        let Some(m) = self.members.get_mut(name) else { return Err(SessionError::Empty) };
        let Some(ci) = m.entry.classes.iter().position(|c| c.chunk_size == chunk_size) else {
            return Err(SessionError::Empty);
        };
        if m.classes[ci].session.is_none() {
            let ce = m.entry.classes[ci].clone();
            match self.connector.connect(&m.entry, &ce) {
                Ok(s) => {
                    let actual = s.geometry();
                    let advertised = (ce.chunk_size, ce.group_size);
                    if actual != advertised {
                        m.classes[ci].wrong_geometry = true;
                        self.notes.push(PoolNote::Skipped {
                            mn: name.to_string(),
                            why: Skip::Geometry { advertised, actual },
                        });
                        return Err(SessionError::Empty);
                    }
                    m.classes[ci].session = Some(s);
                }
                Err(e) => {
                    m.classes[ci].skipped_until = placements + RETRY_AFTER;
                    let detail = e.to_string();
                    self.notes.push(PoolNote::Skipped {
                        mn: name.to_string(),
                        why: Skip::Unreachable { chunk_size, detail },
                    });
                    return Err(SessionError::Empty);
                }
            }
        }
        let cls = &mut m.classes[ci];
        let Some(s) = cls.session.as_mut() else { return Err(SessionError::Empty) };
        match s.alloc() {
            Ok(alloc) => {
                cls.free_hint = cls.free_hint.saturating_sub(1);
                m.held += 1;
                m.placed += 1;
                Ok(PoolAlloc {
                    mn: name.to_string(),
                    incarnation: m.entry.incarnation,
                    epoch: m.epoch,
                    chunk_size,
                    alloc,
                })
            }
            Err(SessionError::Empty) => {
                cls.free_hint = 0;
                Err(SessionError::Empty)
            }
            Err(e) => Err(e),
        }
    }

    /// The session an allocation lives on, or `MnLost`.
    fn route(&mut self, a: &PoolAlloc) -> PResult<&mut Member<C::Session>, C> {
        self.poll();
        match self.members.get_mut(&a.mn) {
            Some(m) if m.epoch == a.epoch => Ok(m),
            _ => Err(PoolError::MnLost { mn: a.mn.clone() }),
        }
    }

    fn session_op<T>(
        &mut self,
        a: &PoolAlloc,
        op: impl FnOnce(&mut C::Session) -> Result<T, SessionError<<C::Session as MnSession>::Error>>,
    ) -> PResult<T, C> {
        let m = self.route(a)?;
        let session = m
            .entry
            .classes
            .iter()
            .position(|c| c.chunk_size == a.chunk_size)
            .and_then(|ci| m.classes[ci].session.as_mut());
        let Some(s) = session else { return Err(PoolError::MnLost { mn: a.mn.clone() }) };
        match op(s) {
            Ok(v) => Ok(v),
            Err(SessionError::Lost(_)) => {
                self.depart(&a.mn.clone(), Departure::ConnectionLost);
                Err(PoolError::MnLost { mn: a.mn.clone() })
            }
            Err(error) => Err(PoolError::Session { mn: a.mn.clone(), error }),
        }
    }

    /// Give the chunk back to its MN.
    pub fn free(&mut self, a: PoolAlloc) -> PResult<(), C> {
        let r = self.session_op(&a, |s| s.free(&a.alloc));
        if let Some(m) = self.members.get_mut(&a.mn) {
            if r.is_ok() {
                m.held = m.held.saturating_sub(1);
            }
        }
        r
    }

    fn check_bounds(a: &PoolAlloc, offset: u64, len: usize) -> PResult<(), C> {
        let len = len as u64;
        if offset.checked_add(len).is_none_or(|end| end > a.chunk_size) {
            return Err(PoolError::OutOfBounds { offset, len, chunk_size: a.chunk_size });
        }
        Ok(())
    }

    /// One-sided WRITE into the allocation, on its own MN.
    pub fn write(&mut self, a: &PoolAlloc, offset: u64, data: &[u8]) -> PResult<(), C> {
        Self::check_bounds(a, offset, data.len())?;
        self.session_op(a, |s| s.write(&a.alloc, offset, data))
    }

    /// One-sided READ from the allocation, on its own MN.
    pub fn read(&mut self, a: &PoolAlloc, offset: u64, buf: &mut [u8]) -> PResult<(), C> {
        Self::check_bounds(a, offset, buf.len())?;
        self.session_op(a, |s| s.read(&a.alloc, offset, buf))
    }

    /// Whether `a`'s MN is still a member (its allocation usable).
    pub fn is_live(&mut self, a: &PoolAlloc) -> bool {
        self.route(a).is_ok()
    }
}

impl<C: Connector> fmt::Debug for PoolClient<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolClient")
            .field("pool", &self.pool)
            .field("registry", &self.url)
            .field("members", &self.members.keys().collect::<Vec<_>>())
            .finish()
    }
}
