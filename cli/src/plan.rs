//! `omw plan`: does a pool fit a device, and what will it cost? From a device profile (a named
//! ConnectX profile with sourced limits, the limits of a real device as `omw probe` reads them,
//! or limits given by hand) and a pool spec, it prints the windows, registrations and QPs the
//! MN needs against the device's limits (`omw_core::mn::capacity`, the check `omw mn` makes
//! before provisioning), the MN's metadata, the provisioning time and the alloc latency and
//! throughput the loopback model gives for the pool's geometry — and refuses an impossible
//! pool naming every limit it breaks (exit status 1).

use clap::{Args, ValueEnum};
use omw_core::device::{Capabilities, ExecutionMode};
use omw_core::mn::capacity::{max_chunks, DeviceLimits, Footprint};
use omw_core::mn::plan::{MnOptions, MnPlan};
use omw_core::mn::provision::PoolSpec;
use std::fmt::Write as _;
use std::process::ExitCode;

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// ConnectX-6 (mlx5): 2^24 keys shared by windows and MRs, 2^17 QPs (sources: `omw plan --help`).
    Cx6,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The chains in the NIC (a ConnectX with CORE-Direct).
    Offloaded,
    /// The MN CPU runs the chains (every upstream rdma-core device).
    HostEngine,
}

#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    /// A named device profile: `cx6` = ConnectX-6 — max_mw = max_mr = 1 << log_max_mkey = 2^24
    /// (Linux drivers/infiniband/hw/mlx5/main.c; ≈16 M windows per function, FineMem OSDI'25
    /// Table 1), max_qp = 2^17 (ibv_devinfo -v of a ConnectX-6 Dx, firmware 22.36).
    #[arg(long, value_enum, conflicts_with = "probe")]
    pub profile: Option<Profile>,
    /// Read the limits of a real device (as `omw probe` does; needs an RDMA device).
    #[arg(long)]
    pub probe: bool,
    /// RDMA device for --probe (default: as `omw mn` picks).
    #[arg(long, requires = "probe")]
    pub device: Option<String>,
    /// Override the profile's limits (a device not profiled yet).
    #[arg(long)]
    pub max_mw: Option<u64>,
    #[arg(long)]
    pub max_mr: Option<u64>,
    #[arg(long)]
    pub max_qp: Option<u64>,
    /// Bytes of pool memory (K/M/G/T suffixes).
    #[arg(long, value_parser = size, default_value = "64G")]
    pub pool_size: u64,
    /// Chunk size, a power of two ≥ 512.
    #[arg(long, value_parser = size, default_value = "4K")]
    pub chunk_size: u64,
    /// Memory windows per chunk (G): MW[0] for the Free QP, G − 1 access QPs per CN.
    #[arg(long, default_value_t = 2)]
    pub group_size: u8,
    /// Most CNs served at once.
    #[arg(long, default_value_t = 16)]
    pub max_cns: u32,
    /// Alloc chains each CN may open (`omw mn --alloc-chains`): each extra one costs a CN an
    /// Alloc QP and, offloaded, a loop QP (both ends on the MN) and a scratch area.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=omw_core::mn::MAX_ALLOC_CHAINS as i64))]
    pub alloc_chains: u8,
    /// Execution mode (default: offloaded for a ConnectX profile, host engine for a probed
    /// device without CORE-Direct).
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,
    /// Skip the loopback-model measurement of alloc latency and throughput.
    #[arg(long)]
    pub no_model: bool,
    /// Size classes, `SIZE:COUNT,…` as `omw mn --classes` takes them (e.g. 4K:256,64K:32,2M:4):
    /// every class its own MWTable, free queue and chains on the one device, checked together
    /// against its limits. Replaces --pool-size and --chunk-size.
    #[arg(long, value_parser = crate::verbs::parse_class_list, conflicts_with_all = ["pool_size", "chunk_size"])]
    pub classes: Option<crate::verbs::ClassList>,
}

fn size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let m = match s[i..].to_ascii_lowercase().as_str() {
                "k" | "kib" | "kb" => 1u64 << 10,
                "m" | "mib" | "mb" => 1 << 20,
                "g" | "gib" | "gb" => 1 << 30,
                "t" | "tib" | "tb" => 1 << 40,
                "b" => 1,
                u => return Err(format!("unknown unit {u:?} (use K, M, G, T)")),
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    let n = num.trim().parse::<u64>().map_err(|e| format!("{s:?}: {e}"))?;
    n.checked_mul(mul).ok_or_else(|| format!("{s:?} is too large"))
}

fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", U[i])
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// Capabilities of an offloading ConnectX, as the plan decides from them.
fn connectx_caps() -> Capabilities {
    Capabilities::SECURE_MINIMUM
        | Capabilities::ATOMICS
        | Capabilities::MASKED_FETCH_ADD
        | Capabilities::WAIT_ENABLE
        | Capabilities::SELF_MODIFYING_WQE
        | Capabilities::BIND_TO_OTHER_QP
        | Capabilities::MW_QP_CHECK_ON_INVALIDATE
        | Capabilities::MW_BOUNDS_ENFORCED
}

/// The verdict and what it rests on, as text; `Ok` when the pool fits.
pub fn report(a: &PlanArgs, device: &str, limits: DeviceLimits) -> Result<String, String> {
    let mode = match a.mode {
        Some(Mode::HostEngine) => ExecutionMode::HostEngine,
        _ => ExecutionMode::Offloaded,
    };
    let plan = MnPlan::decide(connectx_caps(), MnOptions { mode: Some(mode), allow_insecure: false, scrub: true })
        .map_err(|e| format!("plan: {e}"))?;
    if let Some(classes) = &a.classes {
        return classes_report(a, &classes.0, device, &plan, limits);
    }
    let mut s = String::new();
    if a.chunk_size == 0 || a.pool_size < a.chunk_size {
        return Err("--pool-size must hold at least one chunk".into());
    }
    let chunks64 = a.pool_size / a.chunk_size;
    let _ = writeln!(
        s,
        "device: {device} — max_mw {}, max_mr {}{}, max_qp {}",
        limits.max_mw,
        limits.max_mr,
        if limits.shared_keys { " (one key table for windows and MRs)" } else { "" },
        limits.max_qp
    );
    let _ = writeln!(
        s,
        "pool: {} in {} chunks of {}, G = {} ({} access QP(s) per CN), {} CNs of {} alloc chain(s), {}",
        human(a.pool_size),
        chunks64,
        human(a.chunk_size),
        a.group_size,
        a.group_size.saturating_sub(1),
        a.max_cns,
        a.alloc_chains,
        plan.mode
    );
    let suggest = |s: &mut String| {
        let fit = max_chunks(&limits, &plan, a.group_size).max(1) as u64;
        let need = a.pool_size.div_ceil(fit).next_power_of_two().max(512);
        let _ = writeln!(
            s,
            "  at G = {}: at most {fit} chunks fit; this pool needs chunks of at least {} (or fewer windows per chunk)",
            a.group_size,
            human(need)
        );
    };
    let chunks = match u32::try_from(chunks64) {
        Ok(n) => n,
        Err(_) => {
            let _ = writeln!(s, "REFUSED: {chunks64} chunks is more than a pool can have");
            suggest(&mut s);
            return Err(s);
        }
    };
    let spec = PoolSpec {
        chunk_size: a.chunk_size,
        chunks,
        group_size: a.group_size,
        max_cns: a.max_cns,
        quota: 0,
        lease_ns: 0,
        queue_depth: None,
    };
    let f = match Footprint::of_chains(&plan, &spec, a.alloc_chains) {
        Ok(f) => f,
        Err(e) => {
            let windows = chunks64 * a.group_size as u64;
            let _ = writeln!(s, "REFUSED: {e}");
            if windows > limits.max_mw {
                let _ =
                    writeln!(s, "  and it needs {windows} memory windows; the device's max_mw is {}", limits.max_mw);
            }
            suggest(&mut s);
            return Err(s);
        }
    };
    let _ = writeln!(
        s,
        "needs: {} windows, {} registrations, {} QPs; MN metadata {} ({:.1} B per chunk), {} pinned",
        f.windows,
        f.registrations,
        f.qps,
        human(f.metadata_bytes),
        f.metadata_per_chunk(),
        human(f.pinned_bytes)
    );
    let broken = f.check(&limits);
    let cost = omw_loopback::CostModel::CX6;
    let _ = writeln!(
        s,
        "provisioning (modelled): {:.2} s of device time — one window allocation per window at {} ns (FineMem's ConnectX-6 bind; an allocation is a firmware key command of the same kind, an assumption) — plus registering and formatting {}",
        f.windows as f64 * cost.bind_ns as f64 / 1e9,
        cost.bind_ns,
        human(f.pinned_bytes)
    );
    if plan.mode == ExecutionMode::Offloaded {
        let batch = omw_core::mn::DEFAULT_AUDIT_BATCH as u64;
        let ticks = (chunks as u64).div_ceil(batch);
        let _ = writeln!(
            s,
            "audit: {batch} entries per tick, the whole table every {ticks} tick(s) ({:.1} s at the default {:.1} s tick)",
            ticks as f64 * omw_core::mn::DEFAULT_AUDIT_NS as f64 / 1e9,
            omw_core::mn::DEFAULT_AUDIT_NS as f64 / 1e9
        );
    }
    if !a.no_model {
        let _ = writeln!(s, "{}", model_line(&plan, &spec)?);
    }
    if broken.is_empty() {
        let _ = writeln!(s, "FITS");
        Ok(s)
    } else {
        for e in broken.iter() {
            let _ = writeln!(s, "REFUSED: {e}");
        }
        suggest(&mut s);
        Err(s)
    }
}

/// An MN of several size classes: each class's footprint, and their sum against the device.
fn classes_report(
    a: &PlanArgs,
    classes: &[omw_pool::entry::ClassSpec],
    device: &str,
    plan: &MnPlan,
    limits: DeviceLimits,
) -> Result<String, String> {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "device: {device} — max_mw {}, max_mr {}{}, max_qp {}",
        limits.max_mw,
        limits.max_mr,
        if limits.shared_keys { " (one key table for windows and MRs)" } else { "" },
        limits.max_qp
    );
    let mut each = Vec::new();
    for c in classes {
        let spec = PoolSpec {
            chunk_size: c.chunk_size,
            chunks: c.chunks,
            group_size: a.group_size,
            max_cns: a.max_cns,
            quota: 0,
            lease_ns: 0,
            queue_depth: None,
        };
        let f = match Footprint::of_chains(plan, &spec, a.alloc_chains) {
            Ok(f) => f,
            Err(e) => {
                let _ = writeln!(s, "REFUSED: class {}: {e}", human(c.chunk_size));
                return Err(s);
            }
        };
        let _ = writeln!(
            s,
            "class {}: {} chunks ({}), {} windows, {} registrations, {} QPs, metadata {}",
            human(c.chunk_size),
            c.chunks,
            human(c.chunk_size * c.chunks as u64),
            f.windows,
            f.registrations,
            f.qps,
            human(f.metadata_bytes)
        );
        each.push(f);
    }
    let f = Footprint::combined(each);
    let _ = writeln!(
        s,
        "all {} classes, G = {}, {} CNs, {}: {} windows, {} registrations, {} QPs; MN metadata {}, {} pinned",
        classes.len(),
        a.group_size,
        a.max_cns,
        plan.mode,
        f.windows,
        f.registrations,
        f.qps,
        human(f.metadata_bytes),
        human(f.pinned_bytes)
    );
    let broken = f.check(&limits);
    if broken.is_empty() {
        let _ = writeln!(s, "FITS");
        Ok(s)
    } else {
        for e in broken.iter() {
            let _ = writeln!(s, "REFUSED: {e}");
        }
        Err(s)
    }
}

/// Alloc latency and throughput the loopback model gives for the pool's G and chunk size (the
/// chunk size capped at 1 MiB on the model: an alloc does not touch the chunk's bytes).
fn model_line(plan: &MnPlan, spec: &PoolSpec) -> Result<String, String> {
    let cost = omw_loopback::CostModel::CX6;
    let inp = omw_bench::inputs::measure_inputs(cost, 1, cost.nic_units as usize)?;
    let chunk = spec.chunk_size.min(1 << 20);
    let m = omw_bench::inputs::measure_geometry(&inp, spec.group_size, chunk, 24)?;
    Ok(match plan.mode {
        ExecutionMode::Offloaded => {
            let mean = m.osmw_batch.iter().sum::<u64>() as f64 / m.osmw_batch.len().max(1) as f64;
            format!(
                "modelled alloc (loopback model, CostModel::CX6): {:.1} µs alone, {:.1} µs mean with 24 at once; NIC-bound throughput ≈ {:.2} M allocs/s ({} units × 1 / {} ns of unit time per alloc); per CN at most ≈ {:.0} k allocs/s (its alloc chain runs one lap at a time, re-armed {:.1} µs after each reply)",
                m.osmw.alloc_ns as f64 / 1e3,
                mean / 1e3,
                inp.nic_units as f64 * 1e3 / m.osmw.alloc_nic_ns.max(1) as f64,
                inp.nic_units,
                m.osmw.alloc_nic_ns,
                1e6 / (m.osmw.alloc_ns + m.osmw.alloc_rearm_ns).max(1) as f64,
                m.osmw.alloc_rearm_ns as f64 / 1e3
            )
        }
        ExecutionMode::HostEngine => {
            let work = m.host_engine.alloc_cpu_ns + m.host_engine.alloc_dev_ns;
            format!(
                "modelled alloc (host engine on the loopback model): {:.1} µs alone; one MN core serves ≈ {:.0} k allocs/s ({:.1} µs of CPU and device time each)",
                m.host_engine.alloc_ns as f64 / 1e3,
                1e6 / work.max(1) as f64,
                work as f64 / 1e3
            )
        }
    })
}

pub fn plan(a: PlanArgs) -> ExitCode {
    let (device, mut limits) = match (a.probe, a.profile) {
        (true, _) => {
            let choice = omw_verbs::device::DeviceChoice::named(a.device.as_deref());
            match omw_verbs::probe::device_limits(&choice) {
                Ok((name, l)) => (name, l),
                Err(e) => {
                    eprintln!("omw plan: reading the device's limits: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        (false, Some(Profile::Cx6) | None) => ("ConnectX-6 profile".to_string(), DeviceLimits::CONNECTX6),
    };
    if let Some(v) = a.max_mw {
        limits.max_mw = v;
    }
    if let Some(v) = a.max_mr {
        limits.max_mr = v;
    }
    if let Some(v) = a.max_qp {
        limits.max_qp = v;
    }
    match report(&a, &device, limits) {
        Ok(s) => {
            print!("{s}");
            ExitCode::SUCCESS
        }
        Err(s) => {
            print!("{s}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct P {
        #[command(flatten)]
        a: PlanArgs,
    }

    fn args(extra: &[&str]) -> PlanArgs {
        let mut v = vec!["plan", "--no-model"];
        v.extend_from_slice(extra);
        P::try_parse_from(v).unwrap().a
    }

    #[test]
    fn a_64_gib_pool_of_4_kib_chunks_is_refused_on_a_connectx6_naming_the_limit() {
        let a = args(&["--pool-size", "64G", "--chunk-size", "4K"]);
        let out = report(&a, "cx6", DeviceLimits::CONNECTX6).unwrap_err();
        // 16 Mi chunks: beyond the core's pool bound (2^23, the key index space at G = 2), and
        // 32 Mi windows for 16 Mi keys
        assert!(out.contains("REFUSED: 16777216 chunks exceeds the maximum of 8388608"), "{out}");
        assert!(out.contains("33554432 memory windows"), "{out}");
        // 4 Mi chunks of 16 KiB: the device bounds, not the core (8 Mi chunks of 8 KiB would
        // need every key and the MN's registrations besides)
        assert!(out.contains("at most 8388604 chunks fit; this pool needs chunks of at least 16 KiB"), "{out}");
        let fits = report(&args(&["--pool-size", "64G", "--chunk-size", "16K"]), "cx6", DeviceLimits::CONNECTX6);
        assert!(fits.as_ref().is_ok_and(|o| o.contains("FITS") && o.contains("8388608 windows")), "{fits:?}");
        let out = report(&args(&["--pool-size", "32G", "--chunk-size", "4K"]), "cx6", DeviceLimits::CONNECTX6);
        let out = out.unwrap_err();
        assert!(out.contains("needs 16777224 memory windows and registrations (one key table)"), "{out}");
    }

    #[test]
    fn a_pool_within_the_limits_fits_and_a_tight_device_refuses_it() {
        let a = args(&["--pool-size", "4G", "--chunk-size", "4K", "--group-size", "3"]);
        let out = report(&a, "cx6", DeviceLimits::CONNECTX6).unwrap();
        assert!(out.contains("FITS") && out.contains("3145728 windows"), "{out}");
        let tight = DeviceLimits { max_mw: 1 << 21, max_mr: 1 << 21, ..DeviceLimits::CONNECTX6 };
        let out = report(&a, "small", tight).unwrap_err();
        assert!(out.contains("REFUSED: needs 3145") && out.contains("max_mw is 2097152"), "{out}");
        let few_qps = DeviceLimits { max_qp: 100, ..DeviceLimits::CONNECTX6 };
        let out = report(&a, "small", few_qps).unwrap_err();
        assert!(out.contains("queue pairs, the device's max_qp is 100"), "{out}");
    }

    /// The classes share the device: each fits alone, together they break its key table.
    #[test]
    fn size_classes_are_checked_together_against_the_device() {
        let a = args(&["--classes", "4K:1048576,64K:65536", "--group-size", "2"]);
        let out = report(&a, "cx6", DeviceLimits::CONNECTX6).unwrap();
        assert!(out.contains("FITS") && out.contains("2228224 windows"), "{out}");
        // 2 × 2^20 + 2 × 2^16 windows against a key table of 2^21: each class fits, not both
        let tight = DeviceLimits { max_mw: 1 << 21, max_mr: 1 << 21, ..DeviceLimits::CONNECTX6 };
        let one = report(&args(&["--classes", "4K:1048576"]), "small", tight);
        assert!(one.is_err(), "2^21 windows + registrations exceed 2^21 keys: {one:?}");
        let small = report(&args(&["--classes", "4K:524288", "--group-size", "2"]), "small", tight).unwrap();
        assert!(small.contains("FITS"), "{small}");
        let both = report(&args(&["--classes", "4K:524288,64K:524288", "--group-size", "2"]), "small", tight);
        let out = both.unwrap_err();
        assert!(out.contains("REFUSED") && out.contains("2097152"), "{out}");
        // a class the core cannot hold is named
        let out = report(&args(&["--classes", "4K:16777216"]), "cx6", DeviceLimits::CONNECTX6).unwrap_err();
        assert!(out.contains("REFUSED: class 4 KiB"), "{out}");
    }

    /// `omw mn --classes` refuses at start-up what `omw plan --classes` refuses: the classes'
    /// footprints together against every limit (`omw_verbs::mn::classes_fit_device`), not only
    /// the windows.
    #[test]
    fn the_mn_checks_its_classes_as_plan_does() {
        let plan = MnPlan::decide(connectx_caps(), MnOptions::default()).unwrap();
        let spec = |chunk_size: u64, chunks: u32| PoolSpec {
            chunk_size,
            chunks,
            group_size: 2,
            max_cns: 16,
            quota: 0,
            lease_ns: 0,
            queue_depth: None,
        };
        let tight = DeviceLimits { max_mw: 1 << 21, max_mr: 1 << 21, ..DeviceLimits::CONNECTX6 };
        let fits = omw_verbs::mn::classes_fit_device;
        assert!(fits(&plan, &[spec(4096, 524_288)], 1, &tight).is_ok());
        assert!(fits(&plan, &[spec(65536, 524_288)], 1, &tight).is_ok());
        let both = fits(&plan, &[spec(4096, 524_288), spec(65536, 524_288)], 1, &tight).unwrap_err();
        assert!(both.to_string().contains("2 classes together"), "{both}");
        // a QP limit the windows alone would not show: room for one alloc chain per CN, not four
        let classes = [spec(4096, 1024), spec(65536, 1024)];
        let qps = Footprint::combined(classes.iter().map(|s| Footprint::of_chains(&plan, s, 1).unwrap())).qps;
        let few_qps = DeviceLimits { max_qp: qps, ..DeviceLimits::CONNECTX6 };
        assert!(fits(&plan, &classes, 1, &few_qps).is_ok());
        let e = fits(&plan, &classes, 4, &few_qps).unwrap_err();
        assert!(e.to_string().contains("queue pairs"), "{e}");
    }

    /// Each extra alloc chain costs every CN QPs: a device that holds one chain per CN can
    /// refuse four.
    #[test]
    fn extra_alloc_chains_count_in_the_qp_check() {
        let one = args(&["--pool-size", "1G", "--chunk-size", "64K", "--group-size", "3"]);
        let four = args(&["--pool-size", "1G", "--chunk-size", "64K", "--group-size", "3", "--alloc-chains", "4"]);
        let plan = MnPlan::decide(connectx_caps(), MnOptions::default()).unwrap();
        let spec = PoolSpec {
            chunk_size: 64 << 10,
            chunks: 1 << 14,
            group_size: 3,
            max_cns: 16,
            quota: 0,
            lease_ns: 0,
            queue_depth: None,
        };
        let (q1, q4) =
            (Footprint::of_chains(&plan, &spec, 1).unwrap().qps, Footprint::of_chains(&plan, &spec, 4).unwrap().qps);
        // offloaded: per CN and extra chain an Alloc QP and a loop QP's two ends
        assert_eq!(q4, q1 + 16 * 3 * 3);
        let limits = DeviceLimits { max_qp: q1, ..DeviceLimits::CONNECTX6 };
        let out = report(&one, "dev", limits).unwrap();
        assert!(out.contains("FITS") && out.contains(&format!("{q1} QPs")), "{out}");
        let out = report(&four, "dev", limits).unwrap_err();
        assert!(out.contains(&format!("{q4} QPs")) && out.contains("4 alloc chain(s)"), "{out}");
        assert!(out.contains(&format!("queue pairs, the device's max_qp is {q1}")), "{out}");
        assert!(P::try_parse_from(["plan", "--alloc-chains", "5"]).is_err());
    }

    #[test]
    fn sizes_with_units_parse() {
        assert_eq!(size("64G"), Ok(64 << 30));
        assert_eq!(size("1T"), Ok(1 << 40));
        assert!(size("3X").is_err());
    }
}
