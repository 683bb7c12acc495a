//! The device profile: what `omw-mlx5-bringup questions` found one ConnectX does about each
//! open question of `omw_core::device::behaviour` (docs/MLX5.md "The question table"), as a
//! small text file `omw mn --offload mlx5 --profile FILE` reads back.
//!
//! ```text
//! # comments and blank lines are ignored
//! format = 1
//! device = mlx5_0
//! firmware = 16.35.2000
//! date = 2026-08-21T09:30:00Z
//! wait_prefetch = stops
//! recv_enable = unknown
//! send_en_unit = wqebb
//! self_enable = honoured
//! foreign_bind = honoured
//! recv_publish = honoured
//! unchecked_unbind = honoured
//! ```
//!
//! Rules, each refused with a [`ParseError`] naming the line and the key:
//! - UTF-8, at most [`MAX_PROFILE_BYTES`] bytes, lines of at most [`MAX_LINE`] bytes;
//! - a line is blank, a comment (`#` first after leading blanks), or `key = value` (blanks
//!   around both trimmed);
//! - `format` is the first key and says [`FORMAT_VERSION`];
//! - every key below appears exactly once, no other key:
//!   `device`, `firmware` (1..=64 characters of `A-Z a-z 0-9 . _ - : / +`), `date` (UTC,
//!   `YYYY-MM-DDTHH:MM:SSZ`), and each question's [`Question::key`] with one of its answers
//!   ([`answer_names`]) or `unknown`; and, optionally (profiles written before it was asked
//!   lack it: unknown), [`RECV_PUBLISH`] `= honoured | ignored | unknown` and
//!   [`UNCHECKED_UNBIND`] `= honoured | refused | unknown`.
//!
//! The tool writes why an answer is unknown as a comment above it; the parser skips comments.

use omw_core::device::behaviour::{
    DeviceAnswers, ForeignBind, Question, RecvEnable, RecvPublish, SelfEnable, SendEnUnit, UncheckedUnbind,
    WaitPrefetch,
};
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The format this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// A larger file is refused before it is parsed.
pub const MAX_PROFILE_BYTES: usize = 16 * 1024;
pub const MAX_LINE: usize = 256;
const MAX_NAME: usize = 64;
/// The value of a question nobody could answer.
pub const UNKNOWN: &str = "unknown";

/// A UTC time of day to the second, as a profile records when it was measured.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug, Hash)]
pub struct Timestamp {
    pub year: u16,
    pub month: u8,
    pub day: u8,
    pub hour: u8,
    pub minute: u8,
    pub second: u8,
}

fn leap(y: u16) -> bool {
    (y.is_multiple_of(4) && !y.is_multiple_of(100)) || y.is_multiple_of(400)
}

fn days_in(y: u16, m: u8) -> u8 {
    match m {
        2 if leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

impl Timestamp {
    /// Seconds since the Unix epoch as a UTC date and time (proleptic Gregorian calendar, the
    /// days-to-civil algorithm of Howard Hinnant's "chrono-Compatible Low-Level Date
    /// Algorithms"). Years past 9999 are clamped to the last second of 9999.
    pub fn from_unix(secs: u64) -> Timestamp {
        const MAX: u64 = 253_402_300_799; // 9999-12-31T23:59:59Z
        let secs = secs.min(MAX);
        let days = (secs / 86_400) as i64;
        let rem = secs % 86_400;
        let z = days + 719_468;
        let era = z / 146_097;
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u8;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u8;
        let year = (yoe + era * 400 + i64::from(month <= 2)) as u16;
        Timestamp {
            year,
            month,
            day,
            hour: (rem / 3600) as u8,
            minute: (rem / 60 % 60) as u8,
            second: (rem % 60) as u8,
        }
    }

    /// Exactly `YYYY-MM-DDTHH:MM:SSZ` with a real calendar date.
    pub fn parse(s: &str) -> Option<Timestamp> {
        let b = s.as_bytes();
        if b.len() != 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[13] != b':' || b[16] != b':' {
            return None;
        }
        if b[19] != b'Z' {
            return None;
        }
        let num = |r: core::ops::Range<usize>| -> Option<u16> {
            let d = b.get(r)?;
            d.iter().try_fold(0u16, |a, c| c.is_ascii_digit().then(|| a * 10 + u16::from(c - b'0')))
        };
        let t = Timestamp {
            year: num(0..4)?,
            month: num(5..7)? as u8,
            day: num(8..10)? as u8,
            hour: num(11..13)? as u8,
            minute: num(14..16)? as u8,
            second: num(17..19)? as u8,
        };
        let ok = (1..=12).contains(&t.month)
            && t.day >= 1
            && t.day <= days_in(t.year, t.month)
            && t.hour < 24
            && t.minute < 60
            && t.second < 60;
        ok.then_some(t)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
            self.year, self.month, self.day, self.hour, self.minute, self.second
        )
    }
}

/// What one device answered, and which device, firmware and when.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Profile {
    /// The device's name on the host it was measured on (`mlx5_0`), for the operator.
    pub device: String,
    /// The firmware version the answers hold for (`ibv_device_attr.fw_ver`): `omw mn` refuses a
    /// profile measured on other firmware.
    pub firmware: String,
    pub date: Timestamp,
    pub answers: DeviceAnswers,
    /// Whether the HCA takes a receive doorbell record its own DMA wrote (`bringup::
    /// recv_publish`); `None`: unknown.
    pub recv_publish: Option<RecvPublish>,
    /// Whether an invalidate without the QPN check revokes a window bound to another QP
    /// (`bringup::unchecked_unbind`); `None`: unknown. The MN offloads only on `Honoured`.
    pub unchecked_unbind: Option<UncheckedUnbind>,
}

/// The profile key of [`Profile::recv_publish`].
pub const RECV_PUBLISH: &str = "recv_publish";
const RECV_PUBLISH_NAMES: [&str; 2] = ["honoured", "ignored"];
/// The profile key of [`Profile::unchecked_unbind`].
pub const UNCHECKED_UNBIND: &str = "unchecked_unbind";
const UNCHECKED_UNBIND_NAMES: [&str; 2] = ["honoured", "refused"];
/// The profile's name of an unchecked-unbind answer (`unknown` for none).
pub fn unchecked_unbind_name(u: Option<UncheckedUnbind>) -> &'static str {
    u.map_or(UNKNOWN, |u| UNCHECKED_UNBIND_NAMES[u as usize])
}

/// The names of `q`'s answers in a profile, in declaration order.
pub fn answer_names(q: Question) -> &'static [&'static str] {
    match q {
        Question::WaitPrefetch => &["stops", "fetches_past"],
        Question::RecvEnable => &["doorbell", "recv_en_only"],
        Question::SendEnUnit => &["wqebb", "wqe"],
        Question::SelfEnable => &["honoured", "ignored"],
        Question::ForeignBind => &["honoured", "refused", "bound_to_poster"],
    }
}

/// `a`'s answer to `q` as a profile names it; `None`: unknown.
pub fn answer_name(a: &DeviceAnswers, q: Question) -> Option<&'static str> {
    let names = answer_names(q);
    let i = match q {
        Question::WaitPrefetch => a.wait_prefetch.map(|x| x as usize),
        Question::RecvEnable => a.recv_enable.map(|x| x as usize),
        Question::SendEnUnit => a.send_en_unit.map(|x| x as usize),
        Question::SelfEnable => a.self_enable.map(|x| x as usize),
        Question::ForeignBind => a.foreign_bind.map(|x| x as usize),
    }?;
    names.get(i).copied()
}

/// Set `a`'s answer to `q` from its profile name (`unknown` clears it); `false` for a name
/// that is none of `q`'s.
pub fn set_answer(a: &mut DeviceAnswers, q: Question, name: &str) -> bool {
    if name == UNKNOWN {
        match q {
            Question::WaitPrefetch => a.wait_prefetch = None,
            Question::RecvEnable => a.recv_enable = None,
            Question::SendEnUnit => a.send_en_unit = None,
            Question::SelfEnable => a.self_enable = None,
            Question::ForeignBind => a.foreign_bind = None,
        }
        return true;
    }
    let Some(i) = answer_names(q).iter().position(|n| *n == name) else { return false };
    match q {
        Question::WaitPrefetch => a.wait_prefetch = Some([WaitPrefetch::Stops, WaitPrefetch::FetchesPast][i]),
        Question::RecvEnable => a.recv_enable = Some([RecvEnable::Doorbell, RecvEnable::RecvEnOnly][i]),
        Question::SendEnUnit => a.send_en_unit = Some([SendEnUnit::Wqebb, SendEnUnit::Wqe][i]),
        Question::SelfEnable => a.self_enable = Some([SelfEnable::Honoured, SelfEnable::Ignored][i]),
        Question::ForeignBind => {
            a.foreign_bind = Some([ForeignBind::Honoured, ForeignBind::Refused, ForeignBind::BoundToPoster][i])
        }
    }
    true
}

/// The header keys, in the order the tool writes them.
const HEADER: [&str; 4] = ["format", "device", "firmware", "date"];

/// Why a profile's text is not a profile. `line` is 1-based; 0 where the whole file is meant.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ParseError {
    TooLarge {
        len: usize,
    },
    NotUtf8 {
        line: usize,
    },
    LineTooLong {
        line: usize,
        len: usize,
    },
    /// Neither blank, a comment, nor `key = value`.
    NoEquals {
        line: usize,
    },
    /// A key that is no profile key (its first characters, as found).
    UnknownKey {
        line: usize,
        key: String,
    },
    Duplicate {
        line: usize,
        key: &'static str,
        first: usize,
    },
    /// A key before `format`.
    FormatNotFirst {
        line: usize,
        key: &'static str,
    },
    /// A format version this code does not read.
    Format {
        line: usize,
        value: String,
    },
    /// A value the key does not allow (its first characters, as found).
    BadValue {
        line: usize,
        key: &'static str,
        value: String,
    },
    Missing {
        key: &'static str,
    },
}

/// At most 40 characters of untrusted text, for messages (printed with `{:?}`, so control
/// characters are escaped).
fn excerpt(s: &str) -> String {
    s.chars().take(40).collect()
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::TooLarge { len } => {
                write!(f, "{len} bytes: a profile is at most {MAX_PROFILE_BYTES} bytes")
            }
            ParseError::NotUtf8 { line } => write!(f, "line {line}: not UTF-8"),
            ParseError::LineTooLong { line, len } => {
                write!(f, "line {line}: {len} bytes, lines are at most {MAX_LINE}")
            }
            ParseError::NoEquals { line } => write!(f, "line {line}: expected `key = value`, a comment or nothing"),
            ParseError::UnknownKey { line, key } => write!(
                f,
                "line {line}: unknown key {key:?} (keys: {}, {})",
                HEADER.join(", "),
                Question::ALL.map(|q| q.key()).join(", ")
            ),
            ParseError::Duplicate { line, key, first } => {
                write!(f, "line {line}: `{key}` again (first on line {first})")
            }
            ParseError::FormatNotFirst { line, key } => {
                write!(f, "line {line}: `{key}` before `format = {FORMAT_VERSION}` (it must be the first key)")
            }
            ParseError::Format { line, value } => write!(
                f,
                "line {line}: format {value:?}: this omw reads format {FORMAT_VERSION} (run this omw's omw-mlx5-bringup again)"
            ),
            ParseError::BadValue { line, key, value } => {
                write!(f, "line {line}: `{key} = {value:?}`: ")?;
                match *key {
                    "device" | "firmware" => {
                        write!(f, "1..={MAX_NAME} characters of A-Z a-z 0-9 . _ - : / +")
                    }
                    "date" => f.write_str("a UTC time YYYY-MM-DDTHH:MM:SSZ"),
                    k => match Question::ALL.into_iter().find(|q| q.key() == k) {
                        Some(q) => write!(f, "one of {}, {UNKNOWN}", answer_names(q).join(", ")),
                        None => f.write_str("not a value of this key"),
                    },
                }
            }
            ParseError::Missing { key } => write!(f, "no `{key}` line (every key is required; `unknown` answers too)"),
        }
    }
}

impl std::error::Error for ParseError {}

fn name_ok(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= MAX_NAME
        && v.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-' | b':' | b'/' | b'+'))
}

impl Profile {
    /// Parse a profile's bytes (never panics, whatever they are).
    pub fn parse(bytes: &[u8]) -> Result<Profile, ParseError> {
        if bytes.len() > MAX_PROFILE_BYTES {
            return Err(ParseError::TooLarge { len: bytes.len() });
        }
        let keys: Vec<&'static str> =
            HEADER.into_iter().chain(Question::ALL.map(|q| q.key())).chain([RECV_PUBLISH, UNCHECKED_UNBIND]).collect();
        let mut seen: Vec<Option<usize>> = vec![None; keys.len()];
        let (mut device, mut firmware, mut date) = (None, None, None);
        let mut answers = DeviceAnswers::UNKNOWN;
        let mut recv_publish = None;
        let mut unchecked_unbind = None;
        for (i, raw) in bytes.split(|b| *b == b'\n').enumerate() {
            let line = i + 1;
            if raw.len() > MAX_LINE {
                return Err(ParseError::LineTooLong { line, len: raw.len() });
            }
            let text = std::str::from_utf8(raw).map_err(|_| ParseError::NotUtf8 { line })?;
            let text = text.trim();
            if text.is_empty() || text.starts_with('#') {
                continue;
            }
            let (k, v) = text.split_once('=').ok_or(ParseError::NoEquals { line })?;
            let (k, v) = (k.trim(), v.trim());
            let slot = keys.iter().position(|x| *x == k).ok_or(ParseError::UnknownKey { line, key: excerpt(k) })?;
            let key = keys[slot];
            if let Some(first) = seen[slot] {
                return Err(ParseError::Duplicate { line, key, first });
            }
            if key != "format" && seen[0].is_none() {
                return Err(ParseError::FormatNotFirst { line, key });
            }
            seen[slot] = Some(line);
            let bad = || ParseError::BadValue { line, key, value: excerpt(v) };
            match key {
                "format" => {
                    if v.parse::<u32>().ok() != Some(FORMAT_VERSION) {
                        return Err(ParseError::Format { line, value: excerpt(v) });
                    }
                }
                "device" if name_ok(v) => device = Some(v.to_string()),
                "firmware" if name_ok(v) => firmware = Some(v.to_string()),
                "date" => date = Some(Timestamp::parse(v).ok_or_else(bad)?),
                "device" | "firmware" => return Err(bad()),
                RECV_PUBLISH => {
                    recv_publish = match RECV_PUBLISH_NAMES.iter().position(|n| *n == v) {
                        Some(i) => Some([RecvPublish::Honoured, RecvPublish::Ignored][i]),
                        None if v == UNKNOWN => None,
                        None => return Err(bad()),
                    }
                }
                UNCHECKED_UNBIND => {
                    unchecked_unbind = match UNCHECKED_UNBIND_NAMES.iter().position(|n| *n == v) {
                        Some(i) => Some([UncheckedUnbind::Honoured, UncheckedUnbind::Refused][i]),
                        None if v == UNKNOWN => None,
                        None => return Err(bad()),
                    }
                }
                _ => {
                    let q = Question::ALL[slot - HEADER.len()];
                    if !set_answer(&mut answers, q, v) {
                        return Err(bad());
                    }
                }
            }
        }
        // every key but the optional last two (`recv_publish`, `unchecked_unbind`)
        if let Some(i) =
            seen.iter().position(Option::is_none).filter(|i| ![RECV_PUBLISH, UNCHECKED_UNBIND].contains(&keys[*i]))
        {
            return Err(ParseError::Missing { key: keys[i] });
        }
        match (device, firmware, date) {
            (Some(device), Some(firmware), Some(date)) => {
                Ok(Profile { device, firmware, date, answers, recv_publish, unchecked_unbind })
            }
            // every key was seen, and a seen header key was stored
            _ => Err(ParseError::Missing { key: "device" }),
        }
    }

    /// The profile as text, with `notes` (why an answer is what it is, or unknown) as comments
    /// above the answers they are about.
    pub fn to_text(&self, notes: &[(Question, &str)]) -> String {
        let mut s = String::new();
        s.push_str("# omw device profile: what omw-mlx5-bringup found this ConnectX does (docs/MLX5.md)\n");
        s.push_str(&format!("format = {FORMAT_VERSION}\n"));
        s.push_str(&format!("device = {}\nfirmware = {}\ndate = {}\n", self.device, self.firmware, self.date));
        for q in Question::ALL {
            s.push_str(&format!("# {}: {q}?\n", q.key()));
            for (_, n) in notes.iter().filter(|(x, _)| *x == q) {
                for l in n.lines() {
                    s.push_str(&format!("#   {l}\n"));
                }
            }
            s.push_str(&format!("{} = {}\n", q.key(), answer_name(&self.answers, q).unwrap_or(UNKNOWN)));
        }
        s.push_str(&format!(
            "# {RECV_PUBLISH}: does a receive doorbell record written by the HCA's own DMA publish the receive?\n"
        ));
        let rp = self.recv_publish.map_or(UNKNOWN, |r| RECV_PUBLISH_NAMES[r as usize]);
        s.push_str(&format!("{RECV_PUBLISH} = {rp}\n"));
        s.push_str(&format!(
            "# {UNCHECKED_UNBIND}: does an invalidate without the QPN check revoke a window bound to another QP?\n"
        ));
        s.push_str(&format!("{UNCHECKED_UNBIND} = {}\n", unchecked_unbind_name(self.unchecked_unbind)));
        s
    }

    /// Read and parse the profile at `path`.
    pub fn load(path: &Path) -> Result<Profile, ProfileError> {
        let err = |kind| ProfileError { path: path.to_path_buf(), kind };
        let f = std::fs::File::open(path).map_err(|e| err(ProfileErrorKind::Read(e.kind())))?;
        let mut bytes = Vec::new();
        f.take(MAX_PROFILE_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| err(ProfileErrorKind::Read(e.kind())))?;
        Profile::parse(&bytes).map_err(|e| err(ProfileErrorKind::Parse(e)))
    }
}

/// A profile file that could not be used.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ProfileError {
    pub path: PathBuf,
    pub kind: ProfileErrorKind,
}

#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ProfileErrorKind {
    Read(std::io::ErrorKind),
    Parse(ParseError),
}

impl fmt::Display for ProfileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device profile {}: ", self.path.display())?;
        match &self.kind {
            ProfileErrorKind::Read(k) => write!(
                f,
                "cannot read it ({}): omw-mlx5-bringup questions --profile FILE writes one on the ConnectX",
                std::io::Error::from(*k)
            ),
            ProfileErrorKind::Parse(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ProfileError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            ProfileErrorKind::Parse(e) => Some(e),
            ProfileErrorKind::Read(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omw_core::device::behaviour::DeviceBehaviour;
    use proptest::prelude::*;

    fn sample() -> Profile {
        Profile {
            device: "mlx5_0".into(),
            firmware: "16.35.2000".into(),
            date: Timestamp::parse("2026-08-21T09:30:00Z").unwrap(),
            answers: DeviceAnswers { send_en_unit: None, ..DeviceAnswers::exactly(DeviceBehaviour::PAPER) },
            recv_publish: Some(RecvPublish::Honoured),
            unchecked_unbind: Some(UncheckedUnbind::Honoured),
        }
    }

    /// `unchecked_unbind`: optional (unknown when absent), each value read, once only.
    #[test]
    fn the_unchecked_unbind_key() {
        let base = Profile { unchecked_unbind: None, ..sample() }.to_text(&[]);
        assert!(base.contains("unchecked_unbind = unknown"), "{base}");
        let without: String =
            base.lines().filter(|l| !l.starts_with("unchecked_unbind")).map(|l| format!("{l}\n")).collect();
        assert_eq!(Profile::parse(without.as_bytes()).unwrap().unchecked_unbind, None);
        for u in [UncheckedUnbind::Honoured, UncheckedUnbind::Refused] {
            let p = Profile { unchecked_unbind: Some(u), ..sample() };
            assert_eq!(Profile::parse(p.to_text(&[]).as_bytes()), Ok(p));
        }
        let twice = format!("{without}unchecked_unbind = honoured\nunchecked_unbind = refused\n");
        assert!(matches!(Profile::parse(twice.as_bytes()), Err(ParseError::Duplicate { .. })));
        let bad = format!("{without}unchecked_unbind = sometimes\n");
        assert!(matches!(Profile::parse(bad.as_bytes()), Err(ParseError::BadValue { .. })));
    }

    #[test]
    fn every_behaviour_round_trips() {
        for b in DeviceBehaviour::ALL {
            let p = Profile { answers: DeviceAnswers::exactly(b), ..sample() };
            assert_eq!(Profile::parse(p.to_text(&[]).as_bytes()), Ok(p));
        }
        let p = Profile { answers: DeviceAnswers::UNKNOWN, ..sample() };
        let text = p.to_text(&[(Question::SendEnUnit, "no SEND_EN ran\nsecond line")]);
        assert!(text.contains("#   no SEND_EN ran\n#   second line\nsend_en_unit = unknown"), "{text}");
        assert_eq!(Profile::parse(text.as_bytes()), Ok(p));
        // every question's every answer name maps to a distinct answer and back
        for q in Question::ALL {
            for n in answer_names(q) {
                let mut a = DeviceAnswers::UNKNOWN;
                assert!(set_answer(&mut a, q, n));
                assert_eq!(answer_name(&a, q), Some(*n));
            }
        }
    }

    #[test]
    fn the_documented_example_parses() {
        let doc = "# comments and blank lines are ignored\nformat = 1\ndevice = mlx5_0\nfirmware = 16.35.2000\n\
                   date = 2026-08-21T09:30:00Z\nwait_prefetch = stops\nrecv_enable = unknown\n\
                   send_en_unit = wqebb\nself_enable = honoured\nforeign_bind = honoured\n";
        let p = Profile::parse(doc.as_bytes()).unwrap();
        assert_eq!((p.device.as_str(), p.firmware.as_str()), ("mlx5_0", "16.35.2000"));
        assert_eq!(p.answers.wait_prefetch, Some(WaitPrefetch::Stops));
        assert_eq!(p.answers.recv_enable, None);
        assert_eq!(p.answers.foreign_bind, Some(ForeignBind::Honoured));
        // blanks around keys and values, CRLF line ends
        let crlf = doc.replace('\n', "\r\n").replace("device = mlx5_0", "  device=mlx5_0  ");
        assert_eq!(Profile::parse(crlf.as_bytes()), Ok(p.clone()));
        // written before recv_publish was asked: unknown; with it, read; once only; its values
        assert_eq!(p.recv_publish, None);
        let with = format!("{doc}recv_publish = honoured\n");
        assert_eq!(Profile::parse(with.as_bytes()).unwrap().recv_publish, Some(RecvPublish::Honoured));
        let ignored = format!("{doc}recv_publish = ignored\n");
        assert_eq!(Profile::parse(ignored.as_bytes()).unwrap().recv_publish, Some(RecvPublish::Ignored));
        let twice = format!("{doc}recv_publish = honoured\nrecv_publish = ignored\n");
        assert!(matches!(Profile::parse(twice.as_bytes()), Err(ParseError::Duplicate { key: RECV_PUBLISH, .. })));
        let bad = format!("{doc}recv_publish = maybe\n");
        assert!(matches!(Profile::parse(bad.as_bytes()), Err(ParseError::BadValue { key: RECV_PUBLISH, .. })));
    }

    #[test]
    fn hostile_input_is_a_typed_error_naming_the_line_and_key() {
        let good = sample().to_text(&[]);
        let with = |from: &str, to: &str| {
            assert!(good.contains(from), "{from}");
            Profile::parse(good.replacen(from, to, 1).as_bytes())
        };
        let line_of = |key: &str| good.lines().position(|l| l.starts_with(key)).unwrap() + 1;
        assert_eq!(
            with("wait_prefetch = stops", "wait_prefetch = maybe"),
            Err(ParseError::BadValue { line: line_of("wait_prefetch"), key: "wait_prefetch", value: "maybe".into() })
        );
        assert_eq!(
            with("foreign_bind = honoured", "foreign_bind = stops"),
            Err(ParseError::BadValue { line: line_of("foreign_bind"), key: "foreign_bind", value: "stops".into() })
        );
        assert!(
            matches!(with("self_enable =", "self_enabled ="), Err(ParseError::UnknownKey { key, .. }) if key == "self_enabled")
        );
        assert!(matches!(with("format = 1", "format = 2"), Err(ParseError::Format { value, .. }) if value == "2"));
        assert!(matches!(
            with("date = 2026-08-21T09:30:00Z", "date = 2026-02-30T09:30:00Z"),
            Err(ParseError::BadValue { key: "date", .. })
        ));
        assert!(matches!(with("device = mlx5_0", "device = mlx5 0"), Err(ParseError::BadValue { key: "device", .. })));
        assert!(matches!(
            with("firmware = 16.35.2000", "firmware ="),
            Err(ParseError::BadValue { key: "firmware", .. })
        ));
        assert_eq!(with("recv_enable = doorbell\n", ""), Err(ParseError::Missing { key: "recv_enable" }));
        assert!(matches!(
            with("device = mlx5_0", "device = mlx5_0\ndevice = mlx5_1"),
            Err(ParseError::Duplicate { key: "device", .. })
        ));
        assert!(matches!(with("format = 1\n", ""), Err(ParseError::FormatNotFirst { key: "device", .. })));
        assert!(matches!(with("format = 1\n", "format = 1\njunk\n"), Err(ParseError::NoEquals { line: 3 })));
        let long = format!("# {}\n{good}", "x".repeat(MAX_LINE));
        assert!(matches!(Profile::parse(long.as_bytes()), Err(ParseError::LineTooLong { line: 1, .. })));
        let mut bin = good.clone().into_bytes();
        bin.splice(0..0, *b"\xff\xfe\n");
        assert_eq!(Profile::parse(&bin), Err(ParseError::NotUtf8 { line: 1 }));
        assert!(matches!(Profile::parse(&vec![b'#'; MAX_PROFILE_BYTES + 1]), Err(ParseError::TooLarge { .. })));
        assert_eq!(Profile::parse(b""), Err(ParseError::Missing { key: "format" }));
        // messages name the line and the key; untrusted text is cut short and escaped
        let e = with("self_enable =", &format!("\u{1b}[2J{} =", "k".repeat(100))).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("\\u{1b}") && !s.contains('\u{1b}') && s.len() < 400, "{s}");
        let e = with("send_en_unit = unknown", "send_en_unit = bytes").unwrap_err().to_string();
        assert!(e.contains(&format!("line {}", line_of("send_en_unit"))) && e.contains("wqebb, wqe, unknown"), "{e}");
    }

    #[test]
    fn load_names_the_file() {
        let dir = std::env::temp_dir().join(format!("omw-profile-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("none.txt");
        let e = Profile::load(&missing).unwrap_err();
        assert_eq!(e.kind, ProfileErrorKind::Read(std::io::ErrorKind::NotFound));
        assert!(e.to_string().contains("none.txt") && e.to_string().contains("omw-mlx5-bringup"), "{e}");
        let f = dir.join("p.txt");
        std::fs::write(&f, sample().to_text(&[])).unwrap();
        assert_eq!(Profile::load(&f), Ok(sample()));
        std::fs::write(&f, "format = 1\ndevice = ?\n").unwrap();
        let e = Profile::load(&f).unwrap_err().to_string();
        assert!(e.contains("p.txt") && e.contains("line 2") && e.contains("device"), "{e}");
        std::fs::write(&f, vec![b'#'; MAX_PROFILE_BYTES * 2]).unwrap();
        assert!(matches!(Profile::load(&f).unwrap_err().kind, ProfileErrorKind::Parse(ParseError::TooLarge { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn timestamps() {
        assert_eq!(Timestamp::from_unix(0).to_string(), "1970-01-01T00:00:00Z");
        assert_eq!(Timestamp::from_unix(951_782_400).to_string(), "2000-02-29T00:00:00Z");
        assert_eq!(Timestamp::from_unix(1_787_304_600).to_string(), "2026-08-21T09:30:00Z");
        assert_eq!(Timestamp::from_unix(u64::MAX).to_string(), "9999-12-31T23:59:59Z");
        for bad in [
            "2026-13-01T00:00:00Z",
            "2026-01-01T24:00:00Z",
            "2026-01-01 00:00:00Z",
            "2026-01-01T00:00:00",
            "2100-02-29T00:00:00Z",
            "+026-01-01T00:00:00Z",
        ] {
            assert_eq!(Timestamp::parse(bad), None, "{bad}");
        }
        assert!(Timestamp::parse("2024-02-29T23:59:59Z").is_some());
    }

    proptest! {
        /// Any bytes: a profile or a typed error, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Profile::parse(&b);
        }
        /// Arbitrary lines built from the profile's own words.
        #[test]
        fn arbitrary_lines_never_panic(lines in proptest::collection::vec(
            ("[a-z_]{0,14}", "[ =#]{0,2}", "[a-z0-9_.:TZ-]{0,22}"), 0..14)) {
            let text: String = lines.iter().map(|(k, s, v)| format!("{k}{s}{v}\n")).collect();
            let _ = Profile::parse(text.as_bytes());
        }
        /// Every second of the calendar formats and parses back.
        #[test]
        fn timestamps_round_trip(secs in 0u64..253_402_300_799) {
            let t = Timestamp::from_unix(secs);
            prop_assert_eq!(Timestamp::parse(&t.to_string()), Some(t));
        }
    }
}
