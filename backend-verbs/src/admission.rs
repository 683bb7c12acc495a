//! Who may connect: tenants, their credentials and the replay window (DESIGN.md §9,
//! "Admission"; docs/VERBS.md "Admission").
//!
//! Anyone who reaches the rdma_cm port can open connections, and a session costs nothing, so
//! limits per session limit nothing. With a tenants file (`omw mn --tenants FILE`) every connect
//! request's hello carries a credential: the tenant's id, a timestamp and an HMAC-SHA256 tag
//! (RustCrypto `hmac` + `sha2`; compared in constant time) keyed with the tenant's secret over
//! the tenant, the session nonce, the role and the timestamp. The MN accepts a timestamp within
//! [`REPLAY_WINDOW`] of its clock and each (tenant, nonce, role) once within that window, so a
//! captured hello cannot be replayed. Quotas and CN slots are then the tenant's, over all its
//! sessions (`omw_core::mn::tenant`).
//!
//! The tenants file has one tenant per line, `#` comments and blank lines ignored:
//!
//! ```text
//! # name   secret (hex, ≥ 16 bytes)              quota (bytes, K/M/G)  CN slots
//! alice    secret=00112233445566778899aabbccddeeff quota=64K cns=2
//! ```
//!
//! `cns` is optional ([`DEFAULT_TENANT_CNS`]).

use hmac::{Hmac, Mac};
use omw_core::mn::tenant::{TenantError, TenantId, TenantLimits};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Bytes of the HMAC-SHA256 tag in a hello (truncated: the hello must fit rdma_cm's 56 bytes
/// of RC private data; 160 bits leave forgery at 2⁻¹⁶⁰ per try).
pub const TAG_LEN: usize = 20;
/// Shortest secret accepted (128 bits).
pub const MIN_SECRET: usize = 16;
/// How far a hello's timestamp may be from the MN's clock, either way. Hosts are assumed
/// NTP-synchronised to well within this; a CN opens all its connections within a few seconds.
pub const REPLAY_WINDOW_S: u64 = 30;
pub const REPLAY_WINDOW: std::time::Duration = std::time::Duration::from_secs(REPLAY_WINDOW_S);
/// Hellos one tenant may have in the replay window at once (G + 1 per session; far above an
/// honest tenant's reconnects). Bounded memory: past it the tenant's hellos are refused until
/// old ones age out — only that tenant is affected.
pub const SEEN_PER_TENANT: usize = 1024;
/// CN slots of a tenant whose line does not say.
pub const DEFAULT_TENANT_CNS: u32 = 2;

/// A tenant's wire id: the first 4 bytes of SHA-256("omw-tenant" ‖ name). The CN needs only
/// the name and the secret; two names with the same id are refused when the file is read.
pub fn tenant_id(name: &str) -> TenantId {
    let h = Sha256::new().chain_update(b"omw-tenant").chain_update(name.as_bytes()).finalize();
    TenantId(u32::from_le_bytes([h[0], h[1], h[2], h[3]]))
}

/// What a tenant proves itself with.
#[derive(Clone, PartialEq, Eq)]
pub struct Credential {
    pub name: String,
    pub id: TenantId,
    secret: Vec<u8>,
}

impl fmt::Debug for Credential {
    /// Never the secret.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credential").field("name", &self.name).field("id", &self.id).finish_non_exhaustive()
    }
}

/// The bytes a tag covers: `fields` are the hello's role kind, role index and alloc chains
/// (`crate::cm::Hello::signed_fields`).
fn tagged(tenant: TenantId, nonce: u64, fields: [u8; 3], timestamp: u64) -> [u8; 31] {
    let mut b = [0u8; 31];
    b[..8].copy_from_slice(b"omw-helo");
    b[8..12].copy_from_slice(&tenant.0.to_le_bytes());
    b[12..20].copy_from_slice(&nonce.to_le_bytes());
    b[20..23].copy_from_slice(&fields);
    b[23..31].copy_from_slice(&timestamp.to_le_bytes());
    b
}

impl Credential {
    pub fn new(name: &str, secret: Vec<u8>) -> Result<Self, ConfigError> {
        if secret.len() < MIN_SECRET {
            return Err(ConfigError::SecretTooShort { line: 0, len: secret.len() });
        }
        Ok(Credential { name: name.to_string(), id: tenant_id(name), secret })
    }

    /// A CN's credential: its tenant name and a file holding the secret in hex.
    pub fn load(name: &str, secret_file: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(secret_file)
            .map_err(|e| ConfigError::Io { path: secret_file.display().to_string(), detail: e.to_string() })?;
        let secret = parse_hex(text.trim()).ok_or(ConfigError::BadSecret { line: 1 })?;
        Credential::new(name, secret)
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes a key of any length
        <Hmac<Sha256> as Mac>::new_from_slice(&self.secret).expect("HMAC accepts every key length")
    }

    /// The tag of a hello (`role`: its bytes 5..8 — role kind, role index, alloc chains).
    pub fn tag(&self, nonce: u64, role: [u8; 3], timestamp: u64) -> [u8; TAG_LEN] {
        let full = self.mac().chain_update(tagged(self.id, nonce, role, timestamp)).finalize().into_bytes();
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(&full[..TAG_LEN]);
        t
    }

    /// Whether `tag` is this tenant's for these fields (constant-time comparison).
    pub fn verify(&self, nonce: u64, role: [u8; 3], timestamp: u64, tag: &[u8]) -> bool {
        tag.len() == TAG_LEN
            && self.mac().chain_update(tagged(self.id, nonce, role, timestamp)).verify_truncated_left(tag).is_ok()
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// One tenant of the tenants file.
#[derive(Clone, Debug)]
pub struct Tenant {
    pub credential: Credential,
    /// Bytes its CNs may hold together (a multiple of the chunk size).
    pub quota_bytes: u64,
    pub max_cns: u32,
}

impl Tenant {
    pub fn limits(&self, chunk_size: u64) -> TenantLimits {
        TenantLimits { quota: (self.quota_bytes / chunk_size).min(u32::MAX as u64) as u32, max_cns: self.max_cns }
    }

    /// Make the tenant known to one size class's `MemoryNode` (of `chunk_size`-byte chunks):
    /// its group quota there and its CN slots, and `quota_bytes` as its quota over every class
    /// of the MN (the classes learn what it holds in the others: `crate::mn::class_ledger`).
    pub fn register(&self, mn: &mut omw_core::mn::MemoryNode, chunk_size: u64) -> Result<(), TenantError> {
        mn.add_tenant(self.credential.id, self.limits(chunk_size))?;
        mn.set_tenant_byte_quota(self.credential.id, self.quota_bytes)
    }
}

/// Why a tenants file (or a secret file) was refused. Line numbers count from 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConfigError {
    Io {
        path: String,
        detail: String,
    },
    MissingField {
        line: usize,
        field: &'static str,
    },
    UnknownField {
        line: usize,
        field: String,
    },
    BadSecret {
        line: usize,
    },
    SecretTooShort {
        line: usize,
        len: usize,
    },
    BadNumber {
        line: usize,
        field: &'static str,
        value: String,
    },
    QuotaNotChunks {
        line: usize,
        quota: u64,
        chunk_size: u64,
    },
    ZeroLimit {
        line: usize,
        field: &'static str,
    },
    DuplicateTenant {
        line: usize,
        name: String,
    },
    /// Two names hash to one wire id ([`tenant_id`]): rename one.
    IdCollision {
        line: usize,
        name: String,
        other: String,
    },
    TooMany {
        line: usize,
        max: usize,
    },
    Empty,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Io { path, detail } => write!(f, "{path}: {detail}"),
            ConfigError::MissingField { line, field } => write!(f, "line {line}: missing `{field}=`"),
            ConfigError::UnknownField { line, field } => write!(f, "line {line}: unknown field `{field}`"),
            ConfigError::BadSecret { line } => write!(f, "line {line}: `secret` is not an even number of hex digits"),
            ConfigError::SecretTooShort { line, len } => {
                write!(f, "line {line}: `secret` has {len} bytes, at least {MIN_SECRET} are needed")
            }
            ConfigError::BadNumber { line, field, value } => write!(f, "line {line}: `{field}={value}` is not a size"),
            ConfigError::QuotaNotChunks { line, quota, chunk_size } => {
                write!(f, "line {line}: `quota={quota}` is not a multiple of the chunk size {chunk_size}")
            }
            ConfigError::ZeroLimit { line, field } => write!(f, "line {line}: `{field}` must be at least one chunk/CN"),
            ConfigError::DuplicateTenant { line, name } => write!(f, "line {line}: tenant {name:?} appears twice"),
            ConfigError::IdCollision { line, name, other } => {
                write!(f, "line {line}: tenant {name:?} has the same wire id as {other:?}: rename one")
            }
            ConfigError::TooMany { line, max } => write!(f, "line {line}: more than {max} tenants"),
            ConfigError::Empty => f.write_str("no tenant in the file"),
        }
    }
}

impl std::error::Error for ConfigError {}

fn parse_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok()).collect()
}

fn parse_size(s: &str) -> Option<u64> {
    let (num, mul) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let m = match s[i..].to_ascii_lowercase().as_str() {
                "k" | "kib" => 1u64 << 10,
                "m" | "mib" => 1 << 20,
                "g" | "gib" => 1 << 30,
                _ => return None,
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mul)
}

/// Parse a tenants file's text for a pool of `chunk_size`-byte chunks.
pub fn parse_tenants(text: &str, chunk_size: u64) -> Result<Vec<Tenant>, ConfigError> {
    let mut out: Vec<Tenant> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let body = raw.split('#').next().unwrap_or("").trim();
        let mut words = body.split_whitespace();
        let Some(name) = words.next() else { continue };
        let (mut secret, mut quota, mut cns) = (None, None, None);
        for w in words {
            let (k, v) = w.split_once('=').ok_or_else(|| ConfigError::UnknownField { line, field: w.into() })?;
            match k {
                "secret" => {
                    let s = parse_hex(v).ok_or(ConfigError::BadSecret { line })?;
                    if s.len() < MIN_SECRET {
                        return Err(ConfigError::SecretTooShort { line, len: s.len() });
                    }
                    secret = Some(s);
                }
                "quota" => {
                    quota = Some(parse_size(v).ok_or_else(|| ConfigError::BadNumber {
                        line,
                        field: "quota",
                        value: v.into(),
                    })?)
                }
                "cns" => {
                    cns = Some(v.parse::<u32>().map_err(|_| ConfigError::BadNumber {
                        line,
                        field: "cns",
                        value: v.into(),
                    })?)
                }
                _ => return Err(ConfigError::UnknownField { line, field: k.into() }),
            }
        }
        let secret = secret.ok_or(ConfigError::MissingField { line, field: "secret" })?;
        let quota_bytes = quota.ok_or(ConfigError::MissingField { line, field: "quota" })?;
        if quota_bytes == 0 {
            return Err(ConfigError::ZeroLimit { line, field: "quota" });
        }
        if chunk_size == 0 || !quota_bytes.is_multiple_of(chunk_size) {
            return Err(ConfigError::QuotaNotChunks { line, quota: quota_bytes, chunk_size });
        }
        let max_cns = cns.unwrap_or(DEFAULT_TENANT_CNS);
        if max_cns == 0 {
            return Err(ConfigError::ZeroLimit { line, field: "cns" });
        }
        if out.iter().any(|t| t.credential.name == name) {
            return Err(ConfigError::DuplicateTenant { line, name: name.into() });
        }
        let credential = Credential { name: name.into(), id: tenant_id(name), secret };
        if let Some(o) = out.iter().find(|t| t.credential.id == credential.id) {
            return Err(ConfigError::IdCollision { line, name: name.into(), other: o.credential.name.clone() });
        }
        if out.len() >= omw_core::mn::tenant::MAX_TENANTS {
            return Err(ConfigError::TooMany { line, max: omw_core::mn::tenant::MAX_TENANTS });
        }
        out.push(Tenant { credential, quota_bytes, max_cns });
    }
    if out.is_empty() {
        return Err(ConfigError::Empty);
    }
    Ok(out)
}

/// Read a tenants file; the second value is a warning when others than its owner may read it.
pub fn load_tenants(path: &Path, chunk_size: u64) -> Result<(Vec<Tenant>, Option<String>), ConfigError> {
    let io = |e: std::io::Error| ConfigError::Io { path: path.display().to_string(), detail: e.to_string() };
    let text = std::fs::read_to_string(path).map_err(io)?;
    let mode = {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).map_err(io)?.permissions().mode()
    };
    let warn = (mode & 0o077 != 0).then(|| {
        format!(
            "{} is readable by others than its owner (mode {:o}): its secrets are not secret",
            path.display(),
            mode & 0o777
        )
    });
    Ok((parse_tenants(&text, chunk_size)?, warn))
}

/// Why a hello's credential was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CredentialError {
    /// The MN has tenants and the hello carries no credential.
    Missing,
    UnknownTenant(TenantId),
    BadTag(TenantId),
    /// The timestamp is more than [`REPLAY_WINDOW`] from the MN's clock (seconds off).
    Stale {
        tenant: TenantId,
        skew_s: i64,
    },
    /// This (tenant, nonce, role) was seen within the window: a replayed hello.
    Replayed(TenantId),
    /// The tenant has [`SEEN_PER_TENANT`] hellos in the window.
    TooManyHellos(TenantId),
}

impl fmt::Display for CredentialError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CredentialError::Missing => f.write_str("no credential (this MN admits only configured tenants)"),
            CredentialError::UnknownTenant(t) => write!(f, "{t} is not configured"),
            CredentialError::BadTag(t) => write!(f, "{t}: wrong credential (the tag does not verify)"),
            CredentialError::Stale { tenant, skew_s } => {
                write!(f, "{tenant}: timestamp {skew_s:+} s from the MN's clock (window ±{REPLAY_WINDOW_S} s)")
            }
            CredentialError::Replayed(t) => write!(f, "{t}: a hello seen before (replayed)"),
            CredentialError::TooManyHellos(t) => {
                write!(f, "{t}: {SEEN_PER_TENANT} hellos in the last {REPLAY_WINDOW_S} s already")
            }
        }
    }
}

/// The hellos seen within the replay window — per tenant, (nonce, role) → the hello's
/// timestamp. One table for the whole MN process: an MN of several size classes listens on one
/// port per class, and a hello's signature names neither, so a hello captured on one class's
/// port must be refused as a replay on every other (cloning the table shares it).
#[derive(Clone, Debug, Default)]
pub struct ReplayTable(Arc<Mutex<SeenHellos>>);

/// Per tenant: (nonce, role) → the hello's timestamp.
type SeenHellos = HashMap<TenantId, HashMap<(u64, [u8; 3]), u64>>;

/// The MN's side of the credentials: the tenants and the hellos seen within the window.
#[derive(Debug, Default)]
pub struct Authenticator {
    tenants: Vec<Tenant>,
    seen: ReplayTable,
}

impl Authenticator {
    pub fn new(tenants: Vec<Tenant>) -> Self {
        Self::with_replays(tenants, ReplayTable::default())
    }
    /// Checking hellos against `seen`, a table other authenticators of the same MN share.
    pub fn with_replays(tenants: Vec<Tenant>, seen: ReplayTable) -> Self {
        Authenticator { tenants, seen }
    }
    pub fn tenants(&self) -> &[Tenant] {
        &self.tenants
    }
    pub fn tenant(&self, id: TenantId) -> Option<&Tenant> {
        self.tenants.iter().find(|t| t.credential.id == id)
    }

    /// Check a hello's credential at MN time `now` (Unix seconds) and remember it.
    pub fn check(
        &mut self,
        tenant: TenantId,
        nonce: u64,
        role: [u8; 3],
        timestamp: u64,
        tag: &[u8],
        now: u64,
    ) -> Result<(), CredentialError> {
        let t = self.tenant(tenant).ok_or(CredentialError::UnknownTenant(tenant))?;
        // the tag first: nothing an unauthenticated peer sends reaches the replay table
        if !t.credential.verify(nonce, role, timestamp, tag) {
            return Err(CredentialError::BadTag(tenant));
        }
        let skew = timestamp as i64 - now as i64;
        if skew.unsigned_abs() > REPLAY_WINDOW_S {
            return Err(CredentialError::Stale { tenant, skew_s: skew });
        }
        // a panic elsewhere while holding the table leaves it consistent (each insert is whole)
        let mut all = self.seen.0.lock().unwrap_or_else(|p| p.into_inner());
        let seen = all.entry(tenant).or_default();
        // a hello older than the window is refused as stale: its entry can go
        seen.retain(|_, ts| ts.saturating_add(REPLAY_WINDOW_S) >= now);
        if seen.contains_key(&(nonce, role)) {
            return Err(CredentialError::Replayed(tenant));
        }
        if seen.len() >= SEEN_PER_TENANT {
            return Err(CredentialError::TooManyHellos(tenant));
        }
        seen.insert((nonce, role), timestamp);
        Ok(())
    }
}

/// A session nonce from the OS's random source: a half-open session is joined by its nonce, so
/// it must not be guessable.
pub fn random_nonce() -> Result<u64, getrandom::Error> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALICE: &str = "alice secret=00112233445566778899aabbccddeeff quota=16K cns=2\n";

    #[test]
    fn a_tenants_file_parses() {
        let t =
            parse_tenants(&format!("# tenants\n\n{ALICE}bob secret={} quota=4096 # comment\n", "ab".repeat(32)), 4096)
                .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].credential.name, "alice");
        assert_eq!(t[0].limits(4096), TenantLimits { quota: 4, max_cns: 2 });
        assert_eq!(t[1].limits(4096), TenantLimits { quota: 1, max_cns: DEFAULT_TENANT_CNS });
        assert_eq!(t[0].credential.id, tenant_id("alice"));
        assert_ne!(tenant_id("alice"), tenant_id("bob"));
    }

    #[test]
    fn bad_tenants_files_name_the_line_and_field() {
        let e = |s: &str| parse_tenants(s, 4096).unwrap_err();
        assert_eq!(e("a quota=4K\n"), ConfigError::MissingField { line: 1, field: "secret" });
        assert_eq!(
            e("\na secret=00112233445566778899aabbccddeeff\n"),
            ConfigError::MissingField { line: 2, field: "quota" }
        );
        assert_eq!(e("a secret=0g112233445566778899aabbccddeeff quota=4K"), ConfigError::BadSecret { line: 1 });
        assert_eq!(e("a secret=001 quota=4K"), ConfigError::BadSecret { line: 1 });
        assert_eq!(e("a secret=0011 quota=4K"), ConfigError::SecretTooShort { line: 1, len: 2 });
        assert_eq!(
            e("a secret=00112233445566778899aabbccddeeff quota=5000"),
            ConfigError::QuotaNotChunks { line: 1, quota: 5000, chunk_size: 4096 }
        );
        assert_eq!(
            e("a secret=00112233445566778899aabbccddeeff quota=lots"),
            ConfigError::BadNumber { line: 1, field: "quota", value: "lots".into() }
        );
        assert_eq!(
            e("a secret=00112233445566778899aabbccddeeff quota=0"),
            ConfigError::ZeroLimit { line: 1, field: "quota" }
        );
        assert_eq!(
            e("a secret=00112233445566778899aabbccddeeff quota=4K cns=0"),
            ConfigError::ZeroLimit { line: 1, field: "cns" }
        );
        assert_eq!(
            e("a secret=00112233445566778899aabbccddeeff quota=4K color=red"),
            ConfigError::UnknownField { line: 1, field: "color".into() }
        );
        assert_eq!(
            e("a secret=00112233445566778899aabbccddeeff quota=4K oops"),
            ConfigError::UnknownField { line: 1, field: "oops".into() }
        );
        assert_eq!(e(&format!("{ALICE}{ALICE}")), ConfigError::DuplicateTenant { line: 2, name: "alice".into() });
        assert_eq!(e("# nothing\n"), ConfigError::Empty);
        // every error says where
        assert!(e("\n\na quota=4K").to_string().starts_with("line 3: "));
    }

    fn auth() -> (Authenticator, Credential) {
        let t = parse_tenants(ALICE, 4096).unwrap();
        let c = t[0].credential.clone();
        (Authenticator::new(t), c)
    }

    /// The size classes of one MN listen on ports of their own; a hello captured on one is a
    /// replay on every other (their authenticators share the table, as clones of the daemon's
    /// options do), while MNs that do not share it judge alone.
    #[test]
    fn a_hello_replayed_to_another_size_class_is_refused() {
        let t = parse_tenants(ALICE, 4096).unwrap();
        let c = t[0].credential.clone();
        let shared = ReplayTable::default();
        let mut class_4k = Authenticator::with_replays(t.clone(), shared.clone());
        let mut class_64k = Authenticator::with_replays(t.clone(), shared);
        let now = 1_800_000_000;
        let tag = c.tag(9, [0, 0, 1], now);
        assert_eq!(class_4k.check(c.id, 9, [0, 0, 1], now, &tag, now), Ok(()));
        assert_eq!(class_64k.check(c.id, 9, [0, 0, 1], now, &tag, now + 2), Err(CredentialError::Replayed(c.id)));
        // another MN process (its own table) judges alone
        let mut elsewhere = Authenticator::new(t);
        assert_eq!(elsewhere.check(c.id, 9, [0, 0, 1], now, &tag, now + 2), Ok(()));
    }

    #[test]
    fn a_good_credential_passes_once_and_a_wrong_one_never() {
        let (mut a, c) = auth();
        let now = 1_800_000_000;
        let tag = c.tag(7, [0, 0, 1], now);
        assert_eq!(a.check(c.id, 7, [0, 0, 1], now, &tag, now), Ok(()));
        // the same hello again: replayed
        assert_eq!(a.check(c.id, 7, [0, 0, 1], now, &tag, now + 1), Err(CredentialError::Replayed(c.id)));
        // the same session's next role has its own tag
        assert_eq!(a.check(c.id, 7, [1, 0, 1], now, &c.tag(7, [1, 0, 1], now), now), Ok(()));
        // a tag for other fields, a truncated tag, another key
        assert_eq!(a.check(c.id, 8, [0, 0, 1], now, &tag, now), Err(CredentialError::BadTag(c.id)));
        assert_eq!(
            a.check(c.id, 8, [0, 0, 1], now, &c.tag(8, [0, 0, 1], now)[..10], now),
            Err(CredentialError::BadTag(c.id))
        );
        let mallory = Credential::new("alice", vec![0x55; 16]).unwrap();
        assert_eq!(
            a.check(c.id, 9, [0, 0, 1], now, &mallory.tag(9, [0, 0, 1], now), now),
            Err(CredentialError::BadTag(c.id))
        );
        let bob = Credential::new("bob", vec![0x55; 16]).unwrap();
        assert_eq!(
            a.check(bob.id, 9, [0, 0, 1], now, &bob.tag(9, [0, 0, 1], now), now),
            Err(CredentialError::UnknownTenant(bob.id))
        );
    }

    #[test]
    fn the_replay_window_bounds_time_and_memory() {
        let (mut a, c) = auth();
        let now = 1_800_000_000;
        let old = now - REPLAY_WINDOW_S - 1;
        assert!(matches!(
            a.check(c.id, 1, [0, 0, 1], old, &c.tag(1, [0, 0, 1], old), now),
            Err(CredentialError::Stale { skew_s: -31, .. })
        ));
        let future = now + REPLAY_WINDOW_S + 5;
        assert!(matches!(
            a.check(c.id, 1, [0, 0, 1], future, &c.tag(1, [0, 0, 1], future), now),
            Err(CredentialError::Stale { skew_s: 35, .. })
        ));
        // at the edge of the window: accepted
        let edge = now - REPLAY_WINDOW_S;
        assert_eq!(a.check(c.id, 2, [0, 0, 1], edge, &c.tag(2, [0, 0, 1], edge), now), Ok(()));
        // fill the tenant's table: then refused, until the entries age out
        for n in 3..3 + SEEN_PER_TENANT as u64 - 1 {
            assert_eq!(a.check(c.id, n, [0, 0, 1], now, &c.tag(n, [0, 0, 1], now), now), Ok(()));
        }
        let n = 1 << 40;
        assert_eq!(
            a.check(c.id, n, [0, 0, 1], now, &c.tag(n, [0, 0, 1], now), now),
            Err(CredentialError::TooManyHellos(c.id))
        );
        let later = now + REPLAY_WINDOW_S + 1;
        assert_eq!(a.check(c.id, n, [0, 0, 1], later, &c.tag(n, [0, 0, 1], later), later), Ok(()));
    }

    #[test]
    fn nonces_are_random() {
        let a: Vec<u64> = (0..4).map(|_| random_nonce().unwrap()).collect();
        assert!(a.windows(2).all(|w| w[0] != w[1]), "{a:?}");
    }

    #[test]
    fn secret_files_load_and_world_readable_tenants_files_warn() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("omw-adm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sf = dir.join("secret");
        std::fs::write(&sf, "00112233445566778899aabbccddeeff\n").unwrap();
        let c = Credential::load("alice", &sf).unwrap();
        assert_eq!(c, auth().1);
        assert!(!format!("{c:?}").contains("0011"), "Debug shows no secret");
        let tf = dir.join("tenants");
        std::fs::write(&tf, ALICE).unwrap();
        std::fs::set_permissions(&tf, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(load_tenants(&tf, 4096).unwrap().1.is_none());
        std::fs::set_permissions(&tf, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(load_tenants(&tf, 4096).unwrap().1.unwrap().contains("readable by others"));
        assert!(matches!(load_tenants(&dir.join("nope"), 4096), Err(ConfigError::Io { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
