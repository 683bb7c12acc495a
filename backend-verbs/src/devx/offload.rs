//! What `omw probe` reports about the DEVX path and why `omw mn --offload mlx5` refuses.
//!
//! The capabilities are what the firmware *reports*; none of them has been exercised by
//! running a chain (docs/MLX5.md: what only hardware can settle).

use super::DevxError;
use crate::error::VerbsError;
use omw_core::mlx5::prm::hca_cap::HcaCaps;
use std::fmt;

/// The DEVX section of `omw probe`.
#[derive(Debug)]
pub struct DevxProbe {
    pub device: Option<String>,
    /// The capabilities, or why they could not be read (the device could not be chosen or
    /// opened for DEVX, or the query failed).
    pub caps: Result<HcaCaps, VerbsError>,
}

impl fmt::Display for DevxProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "DEVX (mlx5 direct path) on {}", self.device.as_deref().unwrap_or("the first device"))?;
        let c = match &self.caps {
            Ok(c) => c,
            // "--offload mlx5:" is what VerbsError::Devx prefixes; here it goes without saying
            Err(VerbsError::Devx(e)) => return write!(f, "  DEVX                        NO: {e}"),
            Err(e) => return write!(f, "  DEVX                        NO: {e}"),
        };
        let yes = |b: bool| if b { "yes" } else { "NO" };
        writeln!(f, "  DEVX context                yes")?;
        writeln!(f, "  cd (CORE-Direct)            {}", yes(c.cd))?;
        writeln!(f, "  imaicl (type-2 windows)     {}", yes(c.imaicl))?;
        writeln!(f, "  rc                          {}", yes(c.rc))?;
        writeln!(
            f,
            "  atomics                     {} (operations {:#06x}, sizes {:#06x}, 8-byte endianness mode {})",
            yes(c.atomic),
            c.atomic_operations,
            c.atomic_size_qp,
            c.atomic_8b_endianness_mode
        )?;
        writeln!(f, "  masked fetch-add, 8 B, host {}", yes(c.masked_fetch_add_8b()))?;
        writeln!(f, "  log_max_qp_sz / cq_sz / mkey {} / {} / {}", c.log_max_qp_sz, c.log_max_cq_sz, c.log_max_mkey)?;
        writeln!(
            f,
            "  QP timestamp format         {} (capability: RoCE QPs {}, SQs {})",
            match c.qp_ts_format() {
                omw_core::mlx5::prm::hca_cap::QPC_TS_FORMAT_FREE_RUNNING => "free running",
                _ => "default",
            },
            c.roce_qp_ts_format.map_or("-".to_string(), |v| v.to_string()),
            c.sq_ts_format
        )?;
        match verdict(c) {
            Some(e) => write!(f, "  omw mn --offload mlx5       refused: {e}")?,
            None => f.write_str(
                "  omw mn --offload mlx5       runs the DEVX MN (chains in the NIC); never run on a ConnectX, try `omw-mlx5-bringup offload` first (docs/MLX5.md)",
            )?,
        }
        f.write_str("\n  (capabilities as reported by the firmware; no chain has run on this device)")
    }
}

/// Why offload cannot run on a device with capabilities `c`; `None`: it can.
pub fn verdict(c: &HcaCaps) -> Option<DevxError> {
    c.missing_for_offload().map(DevxError::MissingCapability)
}

/// Read the DEVX capabilities of `device` (or the first mlx5 device).
pub fn probe(device: Option<&str>) -> DevxProbe {
    DevxProbe { device: device.map(str::to_string), caps: query_device(device) }
}

#[cfg(feature = "devx")]
fn query_device(device: Option<&str>) -> Result<HcaCaps, VerbsError> {
    let mut d = super::ffi::RealDevx::open(&crate::device::DeviceChoice::named(device))?;
    super::caps::query(&mut d).map_err(VerbsError::Devx)
}

#[cfg(not(feature = "devx"))]
fn query_device(_device: Option<&str>) -> Result<HcaCaps, VerbsError> {
    Err(VerbsError::Devx(DevxError::NotBuilt))
}

/// Whether `omw mn --offload mlx5` can run on `device`: its DEVX capabilities, or why not —
/// the DEVX open or capability query that failed (no mlx5 device, no DEVX, a build without
/// the `devx` feature), or the capability that is missing.
pub fn ready(device: Option<&str>) -> Result<HcaCaps, VerbsError> {
    let c = query_device(device)?;
    match verdict(&c) {
        Some(e) => Err(VerbsError::Devx(e)),
        None => Ok(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omw_core::mlx5::prm::hca_cap::MissingCap;

    fn full() -> HcaCaps {
        HcaCaps {
            cd: true,
            imaicl: true,
            rc: true,
            atomic: true,
            atomic_operations: 0xf,
            atomic_size_qp: 0x8,
            atomic_8b_endianness_mode: 1,
            ..Default::default()
        }
    }

    #[test]
    fn refusals_name_the_capability_and_the_way_out() {
        let e = verdict(&HcaCaps { cd: false, ..full() }).unwrap();
        assert!(matches!(e, DevxError::MissingCapability(MissingCap::CoreDirect)));
        let s = e.to_string();
        assert!(s.contains("cmd_hca_cap.cd") && s.contains("without --offload"), "{s}");
        let e = verdict(&HcaCaps { imaicl: false, ..full() }).unwrap();
        assert!(e.to_string().contains("cmd_hca_cap.imaicl"));
        let e = verdict(&HcaCaps { atomic_8b_endianness_mode: 0, ..full() }).unwrap();
        assert!(e.to_string().contains("atomic_req_8B_endianness_mode"));
        assert!(verdict(&full()).is_none(), "a device with every capability runs");
    }

    #[test]
    fn probe_report_says_what_was_not_verified() {
        let p = DevxProbe { device: Some("mlx5_0".into()), caps: Ok(full()) };
        let s = p.to_string();
        assert!(s.contains("cd (CORE-Direct)            yes"), "{s}");
        assert!(s.contains("no chain has run"), "{s}");
        let p = DevxProbe { device: None, caps: Err(VerbsError::Devx(DevxError::NotBuilt)) };
        assert!(p.to_string().contains("--features devx"));
    }

    #[cfg(not(feature = "devx"))]
    #[test]
    fn without_the_feature_offload_refuses_with_the_rebuild_hint() {
        assert!(matches!(ready(None), Err(VerbsError::Devx(DevxError::NotBuilt))));
    }
}
