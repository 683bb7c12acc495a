//! Locked memory: how much a configuration pins, and whether this process may pin it.
//!
//! Pinning is bounded by RLIMIT_MEMLOCK unless the process has CAP_IPC_LOCK in its *effective*
//! set — which root in a container often lacks, so the check reads the capability, not the
//! uid. Registered memory is not all: providers pin each QP's and CQ's buffers too.

/// Bytes a provider pins per RC QP for its queues and their CQs, against RLIMIT_MEMLOCK: mlx5
/// allocates the send queue (256 WQEs of up to 4 basic blocks of 64 B = 64 KiB), the receive
/// queue (64 × 16 B × 8 scatter entries = 8 KiB), two CQs (320 CQEs × 64 B ≈ 20 KiB) and
/// doorbell pages in user memory it registers — about 100 KiB per QP (rdma-core
/// `providers/mlx5/verbs.c`: `mlx5_alloc_qp_buf`, `mlx5_alloc_cq_buf`). Rounded up.
pub const PINNED_PER_QP: u64 = 128 << 10;

/// What a configuration pins, for the locked-memory check and its message.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct MemlockNeed {
    /// Registered pool (MN) or staging buffers (CN).
    pub registered: u64,
    /// MN metadata (queue, MWTable, per-CN scratch).
    pub metadata: u64,
    /// RC QPs the configuration implies (each with its CQs).
    pub qps: u64,
    /// Slack for what the provider and libibverbs pin besides (doorbells, the context).
    pub slack: u64,
}

impl MemlockNeed {
    /// Just `bytes` (one registration).
    pub fn bytes(bytes: u64) -> Self {
        MemlockNeed { registered: bytes, ..Default::default() }
    }
    /// An MN: pool + metadata, every CN's `2 + (G − 1)` QPs, the admin loopback pair.
    pub fn mn(pool: u64, metadata: u64, max_cns: u32, group_size: u8) -> Self {
        let per_cn = 2 + (group_size.max(1) as u64 - 1);
        MemlockNeed { registered: pool, metadata, qps: max_cns as u64 * per_cn + 2, slack: 1 << 20 }
    }
    /// A CN: its staging and reply buffers and its `2 + (G − 1)` QPs (G at most 4).
    pub fn cn(buffers: u64) -> Self {
        MemlockNeed { registered: buffers, metadata: 0, qps: 5, slack: 1 << 20 }
    }
    pub fn total(&self) -> u64 {
        self.registered
            .saturating_add(self.metadata)
            .saturating_add(self.qps.saturating_mul(PINNED_PER_QP))
            .saturating_add(self.slack)
    }
}

/// `CapEff` of `/proc/self/status` (hex), or None when the line is missing or malformed.
pub fn cap_eff(status: &str) -> Option<u64> {
    let l = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(l.trim(), 16).ok()
}

/// `CAP_IPC_LOCK` (bit 14, `linux/capability.h`): pinning is not limited by RLIMIT_MEMLOCK.
pub const CAP_IPC_LOCK: u32 = 14;

pub fn has_cap(cap_eff: u64, cap: u32) -> bool {
    cap < 64 && cap_eff & (1 << cap) != 0
}

/// What [`ensure_memlock`] concludes from the capability and the limits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Verdict {
    Enough,
    /// The hard limit suffices: raise the soft limit to it.
    RaiseSoftTo(u64),
    TooLow,
}

/// `cur`/`max`: RLIMIT_MEMLOCK (u64::MAX: unlimited).
pub fn verdict(cap_ipc_lock: bool, cur: u64, max: u64, need: u64) -> Verdict {
    if cap_ipc_lock || cur >= need {
        Verdict::Enough
    } else if max >= need {
        Verdict::RaiseSoftTo(max)
    } else {
        Verdict::TooLow
    }
}

/// Whether this process has CAP_IPC_LOCK in effect (None: /proc cannot tell).
pub fn cap_ipc_lock() -> Option<bool> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    cap_eff(&s).map(|c| has_cap(c, CAP_IPC_LOCK))
}

fn rlimit() -> Option<(u64, u64)> {
    // SAFETY: getrlimit writes only into `r`.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) != 0 {
            return None;
        }
        let f = |v: libc::rlim_t| if v == libc::RLIM_INFINITY { u64::MAX } else { v };
        Some((f(r.rlim_cur), f(r.rlim_max)))
    }
}

/// Why [`ensure_memlock`] or a registration refused; it becomes
/// [`VerbsError::MemlockTooLow`](crate::VerbsError) (`From`) or the DEVX backend's
/// `DevxError::MemlockTooLow`; its message says what the configuration pins and how to allow
/// it. Its own type so that this module does not depend on the crates' error modules, which
/// name [`MemlockNeed`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct TooLow {
    /// The soft RLIMIT_MEMLOCK, bytes.
    pub limit: u64,
    pub need: MemlockNeed,
    /// Whether the process has CAP_IPC_LOCK in its effective set (None: cannot tell).
    pub cap_ipc_lock: Option<bool>,
}

impl std::fmt::Display for TooLow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let TooLow { limit, need, cap_ipc_lock } = self;
        write!(
            f,
            "locked-memory limit too low: RLIMIT_MEMLOCK is {} but this configuration pins about {} (",
            human(*limit),
            approx(need.total())
        )?;
        if need.metadata > 0 {
            write!(f, "pool {}, metadata {}", human(need.registered), approx(need.metadata))?;
        } else {
            write!(f, "buffers {}", human(need.registered))?;
        }
        if need.qps > 0 {
            write!(f, ", {} QPs with their CQs × {}", need.qps, human(PINNED_PER_QP))?;
        }
        f.write_str(")")?;
        match cap_ipc_lock {
            Some(false) => {
                f.write_str(", and the process lacks CAP_IPC_LOCK (as root in a container: `--cap-add IPC_LOCK`)")?
            }
            None => f.write_str(" (CAP_IPC_LOCK: unknown)")?,
            Some(true) => {}
        }
        f.write_str(". Raise the limit with `ulimit -l unlimited` (as root), a `memlock` line in /etc/security/limits.conf, LimitMEMLOCK=infinity in a systemd unit, or `docker run --ulimit memlock=-1`; or run with fewer --max-cns / a smaller --pool-size")
    }
}

/// Make sure `need` can be pinned: nothing to do with CAP_IPC_LOCK or a high enough soft
/// limit; the soft limit raised to the hard one if that suffices; else [`TooLow`].
pub fn ensure_memlock(need: MemlockNeed) -> Result<(), TooLow> {
    let Some((cur, max)) = rlimit() else { return Ok(()) }; // cannot tell: registration reports
    let cap = cap_ipc_lock();
    match verdict(cap == Some(true), cur, max, need.total()) {
        Verdict::Enough => Ok(()),
        Verdict::RaiseSoftTo(m) => {
            let want = libc::rlimit { rlim_cur: m as libc::rlim_t, rlim_max: max as libc::rlim_t };
            // SAFETY: setrlimit reads only `want`.
            if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &want) } == 0 {
                Ok(())
            } else {
                Err(TooLow { limit: cur, need, cap_ipc_lock: cap })
            }
        }
        Verdict::TooLow => Err(TooLow { limit: cur, need, cap_ipc_lock: cap }),
    }
}

/// The current soft memlock limit, for reports.
pub fn memlock_limit() -> String {
    rlimit().map_or_else(|| "unknown".into(), |(cur, _)| human(cur))
}

/// Bytes for a message: exact binary units where they divide, "unlimited" for RLIM_INFINITY.
/// Bytes to one decimal in the largest unit that fits (for figures that are estimates).
pub(crate) fn approx(b: u64) -> String {
    const K: f64 = 1024.0;
    let x = b as f64;
    if x >= K * K * K {
        format!("{:.1} GiB", x / (K * K * K))
    } else if x >= K * K {
        format!("{:.1} MiB", x / (K * K))
    } else if x >= K {
        format!("{:.1} KiB", x / K)
    } else {
        format!("{b} B")
    }
}

pub(crate) fn human(b: u64) -> String {
    if b == u64::MAX || b == libc::RLIM_INFINITY {
        return "unlimited".into();
    }
    const K: u64 = 1024;
    if b >= K * K * K && b.is_multiple_of(K * K * K) {
        format!("{} GiB", b / (K * K * K))
    } else if b >= K * K && b.is_multiple_of(K * K) {
        format!("{} MiB", b / (K * K))
    } else if b >= K && b.is_multiple_of(K) {
        format!("{} KiB", b / K)
    } else {
        format!("{b} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_need_counts_qps() {
        let n = MemlockNeed::mn(64 << 20, 1 << 20, 16, 3);
        assert_eq!(n.qps, 16 * 4 + 2);
        assert_eq!(n.total(), (64 << 20) + (1 << 20) + 66 * PINNED_PER_QP + (1 << 20));
        assert_eq!(MemlockNeed::bytes(4096).total(), 4096);
        assert_eq!(MemlockNeed::cn(1 << 20).qps, 5);
    }

    #[test]
    fn capabilities_from_proc_status() {
        let s = "Name:\tomw\nCapInh:\t0000000000000000\nCapEff:\t00000000a80425fb\n";
        let e = cap_eff(s).unwrap();
        assert_eq!(e, 0xa80425fb);
        assert!(!has_cap(e, CAP_IPC_LOCK), "docker's default set has no IPC_LOCK");
        assert!(has_cap(0x4000, CAP_IPC_LOCK));
        assert!(has_cap(0x000001ffffffffff, CAP_IPC_LOCK));
        assert_eq!(cap_eff("Name: x\n"), None);
        assert_eq!(cap_eff("CapEff:\tzz\n"), None);
        assert!(!has_cap(u64::MAX, 99));
    }

    #[test]
    fn verdicts() {
        assert_eq!(verdict(true, 0, 0, 1 << 30), Verdict::Enough, "CAP_IPC_LOCK: no limit applies");
        assert_eq!(verdict(false, 64 << 20, 64 << 20, 1 << 20), Verdict::Enough);
        assert_eq!(verdict(false, 8 << 20, u64::MAX, 1 << 30), Verdict::RaiseSoftTo(u64::MAX));
        assert_eq!(verdict(false, 8 << 20, 8 << 20, 1 << 30), Verdict::TooLow);
    }
}
