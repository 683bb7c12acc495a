//! Levelled logging to stderr with a `RUST_LOG`-style filter: `OMW_LOG`, else `RUST_LOG`, a
//! comma-separated list of `level` or `target=level` directives (`info`,
//! `omw_verbs::mn=debug,warn`); the longest matching target prefix wins; default `info`.
//! Lines carry wall-clock seconds (mod 10⁴) with milliseconds, which the tests and the CNs'
//! logs line up with.

use std::sync::OnceLock;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Level {
    Off = 0,
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
    Trace = 5,
}

impl Level {
    pub fn parse(s: &str) -> Option<Level> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "off" => Level::Off,
            "error" => Level::Error,
            "warn" | "warning" => Level::Warn,
            "info" => Level::Info,
            "debug" => Level::Debug,
            "trace" => Level::Trace,
            _ => return None,
        })
    }
    fn tag(self) -> &'static str {
        match self {
            Level::Off => "",
            Level::Error => "ERROR ",
            Level::Warn => "WARN ",
            Level::Info => "",
            Level::Debug => "DEBUG ",
            Level::Trace => "TRACE ",
        }
    }
}

/// A parsed filter: the default level and per-target levels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    default: Level,
    targets: Vec<(String, Level)>,
}

impl Filter {
    /// Parse directives; unparseable ones are ignored (a typo must not silence errors).
    pub fn parse(spec: &str) -> Filter {
        let mut f = Filter { default: Level::Info, targets: Vec::new() };
        for d in spec.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            match d.split_once('=') {
                Some((t, l)) => {
                    if let Some(l) = Level::parse(l) {
                        f.targets.push((t.trim().to_string(), l));
                    }
                }
                None => {
                    if let Some(l) = Level::parse(d) {
                        f.default = l;
                    }
                }
            }
        }
        f
    }
    pub fn level_for(&self, target: &str) -> Level {
        self.targets
            .iter()
            .filter(|(t, _)| target.starts_with(t.as_str()))
            .max_by_key(|(t, _)| t.len())
            .map_or(self.default, |(_, l)| *l)
    }
    pub fn enabled(&self, target: &str, level: Level) -> bool {
        level != Level::Off && level <= self.level_for(target)
    }
}

fn filter() -> &'static Filter {
    static F: OnceLock<Filter> = OnceLock::new();
    F.get_or_init(|| {
        let spec = std::env::var("OMW_LOG").or_else(|_| std::env::var("RUST_LOG")).unwrap_or_default();
        Filter::parse(&spec)
    })
}

pub fn enabled(target: &str, level: Level) -> bool {
    filter().enabled(target, level)
}

/// Write one line if `target` logs at `level`; `prefix` is what the line starts with
/// ("omw mn").
pub fn log(target: &str, prefix: &str, level: Level, msg: &str) {
    if !enabled(target, level) {
        return;
    }
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    eprintln!("{prefix}: [{:04}.{:03}] {}{msg}", t.as_secs() % 10_000, t.subsec_millis(), level.tag());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_like_rust_log() {
        let f = Filter::parse("warn,omw_verbs::mn=debug,omw_verbs::mn::cm=error,bogus=loud,xyz");
        assert_eq!(f.level_for("omw_verbs::cn"), Level::Warn);
        assert_eq!(f.level_for("omw_verbs::mn"), Level::Debug);
        assert_eq!(f.level_for("omw_verbs::mn::cm"), Level::Error);
        assert!(f.enabled("omw_verbs::mn", Level::Info));
        assert!(!f.enabled("omw_verbs::backend", Level::Info));
        assert!(f.enabled("omw_verbs::backend", Level::Warn));
        assert_eq!(Filter::parse("").level_for("x"), Level::Info);
        assert!(!Filter::parse("off").enabled("x", Level::Error));
        assert!(!Filter::parse("trace").enabled("x", Level::Off));
        assert_eq!(Level::parse("WARNING"), Some(Level::Warn));
    }
}
