//! What an MN publishes about itself in the registry: one record per MN, JSON (what operators
//! read with `etcdctl get`), bound to the MN's lease.
//!
//! Every field comes from a process the CN does not trust to be well-formed (an old or broken
//! MN, a typo by an operator writing keys by hand), so [`MnEntry::parse`] checks everything a
//! placement decision uses and refuses with a typed reason; the pool client skips such an entry
//! and logs why, it never panics on one.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::SocketAddr;

/// The record's layout version; a client refuses others (a newer MN's fields it cannot judge).
pub const ENTRY_FORMAT: u32 = 1;
/// Longest record a client reads (etcd allows far more; nothing legitimate comes close).
pub const MAX_ENTRY_LEN: usize = 4096;
/// Most size classes one MN may advertise.
pub const MAX_CLASSES: usize = 8;
/// Smallest and largest chunk a class may have (the core's `PoolGeometry` bounds).
pub const MIN_CHUNK: u64 = 512;
pub const MAX_CHUNK: u64 = 1 << 30;

/// One size class of an MN: its own MWTable, free queue and chains, reached at `addr`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassEntry {
    /// Bytes per chunk (a power of two).
    pub chunk_size: u64,
    /// Chunks in the class.
    pub chunks: u32,
    /// Chunks in the free queue when the MN last published (refreshed at a bounded rate, so
    /// stale by up to that period: a hint for placement, never a promise).
    pub free: u32,
    /// Windows per chunk (G).
    pub group_size: u8,
    /// Where a CN connects for this class (rdma_cm address; on the model, a name).
    pub addr: String,
}

/// One MN of a pool, as it published itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MnEntry {
    pub format: u32,
    /// The MN's name in the pool (the last part of its key).
    pub name: String,
    /// Chosen anew at every start: an MN that comes back under the same name is a new MN — the
    /// allocations of its previous run are gone.
    pub incarnation: u64,
    pub classes: Vec<ClassEntry>,
    /// No new placements; live allocations keep working.
    pub draining: bool,
    /// Chunks held by CNs over all classes when the MN last published.
    pub held: u64,
}

/// Why a registry record was not taken.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EntryError {
    TooLong(usize),
    /// Not JSON of the record's shape (serde's message, cut to a line).
    Syntax(String),
    Format(u32),
    /// The record's name is not the key's.
    NameMismatch {
        key: String,
        record: String,
    },
    NoClasses,
    TooManyClasses(usize),
    ChunkSize(u64),
    /// Two classes with one chunk size.
    DuplicateClass(u64),
    GroupSize(u8),
    ZeroChunks(u64),
    /// More free than the class has.
    FreeExceedsChunks {
        chunk_size: u64,
        free: u32,
        chunks: u32,
    },
    Address(String),
}

impl fmt::Display for EntryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EntryError::TooLong(n) => write!(f, "record of {n} bytes (at most {MAX_ENTRY_LEN})"),
            EntryError::Syntax(m) => write!(f, "not an MN record: {m}"),
            EntryError::Format(v) => write!(f, "record format {v} (this client reads {ENTRY_FORMAT})"),
            EntryError::NameMismatch { key, record } => {
                write!(f, "the record names MN {record:?} under the key of {key:?}")
            }
            EntryError::NoClasses => f.write_str("no size class"),
            EntryError::TooManyClasses(n) => write!(f, "{n} size classes (at most {MAX_CLASSES})"),
            EntryError::ChunkSize(s) => {
                write!(f, "chunk size {s} is not a power of two in {MIN_CHUNK}..={MAX_CHUNK}")
            }
            EntryError::DuplicateClass(s) => write!(f, "two classes of chunk size {s}"),
            EntryError::GroupSize(g) => write!(f, "group size {g} outside 2..=4"),
            EntryError::ZeroChunks(s) => write!(f, "class of chunk size {s} has no chunk"),
            EntryError::FreeExceedsChunks { chunk_size, free, chunks } => {
                write!(f, "class of chunk size {chunk_size} claims {free} free of {chunks} chunks")
            }
            EntryError::Address(a) => write!(f, "class address {a:?} is empty or too long"),
        }
    }
}

impl std::error::Error for EntryError {}

/// Up to 120 characters of untrusted text, escaped, for a message.
pub(crate) fn cut(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars().take(120) {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    if s.chars().count() > 120 {
        out.push('…');
    }
    out
}

impl MnEntry {
    /// The record of `key_name` (the last part of its key), checked.
    pub fn parse(key_name: &str, bytes: &[u8]) -> Result<MnEntry, EntryError> {
        if bytes.len() > MAX_ENTRY_LEN {
            return Err(EntryError::TooLong(bytes.len()));
        }
        let e: MnEntry = serde_json::from_slice(bytes).map_err(|e| EntryError::Syntax(cut(&e.to_string())))?;
        if e.name != key_name {
            return Err(EntryError::NameMismatch { key: cut(key_name), record: cut(&e.name) });
        }
        e.check()?;
        Ok(e)
    }

    /// Everything a placement decision relies on.
    pub fn check(&self) -> Result<(), EntryError> {
        if self.format != ENTRY_FORMAT {
            return Err(EntryError::Format(self.format));
        }
        if self.classes.is_empty() {
            return Err(EntryError::NoClasses);
        }
        if self.classes.len() > MAX_CLASSES {
            return Err(EntryError::TooManyClasses(self.classes.len()));
        }
        for (i, c) in self.classes.iter().enumerate() {
            if !c.chunk_size.is_power_of_two() || !(MIN_CHUNK..=MAX_CHUNK).contains(&c.chunk_size) {
                return Err(EntryError::ChunkSize(c.chunk_size));
            }
            if self.classes[..i].iter().any(|d| d.chunk_size == c.chunk_size) {
                return Err(EntryError::DuplicateClass(c.chunk_size));
            }
            if !(2..=4).contains(&c.group_size) {
                return Err(EntryError::GroupSize(c.group_size));
            }
            if c.chunks == 0 {
                return Err(EntryError::ZeroChunks(c.chunk_size));
            }
            if c.free > c.chunks {
                return Err(EntryError::FreeExceedsChunks { chunk_size: c.chunk_size, free: c.free, chunks: c.chunks });
            }
            if c.addr.is_empty() || c.addr.len() > 256 {
                return Err(EntryError::Address(cut(&c.addr)));
            }
        }
        Ok(())
    }

    pub fn encode(&self) -> Vec<u8> {
        // a struct of strings and integers always serialises
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The class of exactly `chunk_size`, if the MN has one.
    pub fn class(&self, chunk_size: u64) -> Option<&ClassEntry> {
        self.classes.iter().find(|c| c.chunk_size == chunk_size)
    }

    /// Free chunks over all classes.
    pub fn free_total(&self) -> u64 {
        self.classes.iter().map(|c| c.free as u64).sum()
    }
}

impl ClassEntry {
    /// The class address as an rdma_cm socket address (the verbs connector's reading of it).
    pub fn socket_addr(&self) -> Result<SocketAddr, EntryError> {
        self.addr.parse().map_err(|_| EntryError::Address(cut(&self.addr)))
    }
}

/// A size class as an operator writes it: `4K:64` (64 chunks of 4 KiB), `2M:8`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassSpec {
    pub chunk_size: u64,
    pub chunks: u32,
}

/// Why a class list did not parse.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClassSpecError {
    /// Not `SIZE:COUNT`.
    Shape(String),
    Size(String),
    Count(String),
    Entry(EntryError),
}

impl fmt::Display for ClassSpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClassSpecError::Shape(s) => write!(f, "{s:?}: a class is SIZE:COUNT, e.g. 4K:64"),
            ClassSpecError::Size(s) => write!(f, "{s:?}: a size is bytes with an optional K, M or G"),
            ClassSpecError::Count(s) => write!(f, "{s:?}: a chunk count is a number of at least 1"),
            ClassSpecError::Entry(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ClassSpecError {}

/// `4096`, `4K`, `2M`, `1G` (powers of 1024).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1u64 << 10),
        'm' | 'M' => (&s[..s.len() - 1], 1 << 20),
        'g' | 'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mul)
}

/// A comma-separated class list, `4K:64,64K:16,2M:4`, checked as an entry would be.
pub fn parse_classes(s: &str) -> Result<Vec<ClassSpec>, ClassSpecError> {
    let mut out: Vec<ClassSpec> = Vec::new();
    for part in s.split(',') {
        let (size, count) = part.split_once(':').ok_or_else(|| ClassSpecError::Shape(cut(part)))?;
        let chunk_size = parse_size(size).ok_or_else(|| ClassSpecError::Size(cut(size)))?;
        let chunks =
            count.trim().parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(|| ClassSpecError::Count(cut(count)))?;
        if !chunk_size.is_power_of_two() || !(MIN_CHUNK..=MAX_CHUNK).contains(&chunk_size) {
            return Err(ClassSpecError::Entry(EntryError::ChunkSize(chunk_size)));
        }
        if out.iter().any(|c| c.chunk_size == chunk_size) {
            return Err(ClassSpecError::Entry(EntryError::DuplicateClass(chunk_size)));
        }
        out.push(ClassSpec { chunk_size, chunks });
    }
    if out.len() > MAX_CLASSES {
        return Err(ClassSpecError::Entry(EntryError::TooManyClasses(out.len())));
    }
    out.sort_by_key(|c| c.chunk_size);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> MnEntry {
        MnEntry {
            format: ENTRY_FORMAT,
            name: "mn-a".into(),
            incarnation: 7,
            classes: vec![
                ClassEntry { chunk_size: 4096, chunks: 16, free: 10, group_size: 3, addr: "192.0.2.1:7490".into() },
                ClassEntry { chunk_size: 65536, chunks: 4, free: 4, group_size: 3, addr: "192.0.2.1:7491".into() },
            ],
            draining: false,
            held: 6,
        }
    }

    #[test]
    fn a_record_round_trips() {
        let e = entry();
        assert_eq!(MnEntry::parse("mn-a", &e.encode()), Ok(e.clone()));
        assert_eq!(e.free_total(), 14);
        assert_eq!(e.class(65536).map(|c| c.chunks), Some(4));
        assert_eq!(e.classes[0].socket_addr().unwrap().port(), 7490);
    }

    #[test]
    fn every_malformed_record_is_a_typed_refusal() {
        let bad = |f: &dyn Fn(&mut MnEntry)| {
            let mut e = entry();
            f(&mut e);
            MnEntry::parse("mn-a", &e.encode()).unwrap_err()
        };
        assert_eq!(bad(&|e| e.format = 2), EntryError::Format(2));
        assert!(matches!(bad(&|e| e.name = "mn-b".into()), EntryError::NameMismatch { .. }));
        assert_eq!(bad(&|e| e.classes.clear()), EntryError::NoClasses);
        assert_eq!(bad(&|e| e.classes[1].chunk_size = 3000), EntryError::ChunkSize(3000));
        assert_eq!(bad(&|e| e.classes[1].chunk_size = 256), EntryError::ChunkSize(256));
        assert_eq!(bad(&|e| e.classes[1].chunk_size = 4096), EntryError::DuplicateClass(4096));
        assert_eq!(bad(&|e| e.classes[0].group_size = 9), EntryError::GroupSize(9));
        assert_eq!(bad(&|e| e.classes[0].chunks = 0), EntryError::ZeroChunks(4096));
        assert!(matches!(bad(&|e| e.classes[0].free = 17), EntryError::FreeExceedsChunks { free: 17, .. }));
        assert!(matches!(bad(&|e| e.classes[0].addr.clear()), EntryError::Address(_)));
        assert!(matches!(
            bad(&|e| e.classes = vec![e.classes[0].clone(); 9]),
            EntryError::TooManyClasses(9) | EntryError::DuplicateClass(_)
        ));
        assert!(matches!(MnEntry::parse("mn-a", b"{\"format\":1"), Err(EntryError::Syntax(_))));
        assert!(matches!(MnEntry::parse("mn-a", b"\xff\xfe"), Err(EntryError::Syntax(_))));
        assert!(matches!(MnEntry::parse("mn-a", &[b' '; MAX_ENTRY_LEN + 1]), Err(EntryError::TooLong(_))));
        // negative or overflowing numbers are not the record's shape
        let s = String::from_utf8(entry().encode()).unwrap().replace("\"chunks\":16", "\"chunks\":-1");
        assert!(matches!(MnEntry::parse("mn-a", s.as_bytes()), Err(EntryError::Syntax(_))));
        let bad_addr = ClassEntry { addr: "not an address".into(), ..entry().classes[0].clone() };
        assert!(bad_addr.socket_addr().is_err());
    }

    #[test]
    fn class_lists_parse_sorted_and_checked() {
        assert_eq!(
            parse_classes("64K:16,4K:64").unwrap(),
            vec![ClassSpec { chunk_size: 4096, chunks: 64 }, ClassSpec { chunk_size: 65536, chunks: 16 }]
        );
        assert_eq!(parse_classes("2M:1").unwrap()[0].chunk_size, 2 << 20);
        assert!(matches!(parse_classes("4K"), Err(ClassSpecError::Shape(_))));
        assert!(matches!(parse_classes("4Q:1"), Err(ClassSpecError::Size(_))));
        assert!(matches!(parse_classes("4K:0"), Err(ClassSpecError::Count(_))));
        assert!(matches!(parse_classes("3K:1"), Err(ClassSpecError::Entry(EntryError::ChunkSize(_)))));
        assert!(matches!(parse_classes("4K:1,4096:2"), Err(ClassSpecError::Entry(EntryError::DuplicateClass(4096)))));
        assert_eq!(parse_size("18446744073709551615G"), None);
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_parser(b in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600)) {
            let _ = MnEntry::parse("mn-a", &b);
        }
    }
}
