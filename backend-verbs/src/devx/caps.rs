//! QUERY_HCA_CAP through DEVX: the general capabilities, then (if the device has atomics)
//! the atomic capabilities, then (if it speaks RoCE) the RoCE capabilities — whose
//! `qp_ts_format` decides the timestamp format of every QP — parsed by
//! `omw_core::mlx5::prm::hca_cap`.

use super::api::DevxApi;
use super::DevxError;
use omw_core::mlx5::prm::hca_cap::{self, HcaCaps, QUERY_HCA_CAP_OUT_LEN};
use omw_core::mlx5::Mlx5Error;

pub(crate) fn command_error(command: &'static str, e: Mlx5Error) -> DevxError {
    match e {
        Mlx5Error::CommandFailed { opcode, status, syndrome } => {
            DevxError::Command { command, opcode, status, syndrome, errno: 0 }
        }
        e => DevxError::Encode(e),
    }
}

pub const GENERAL: &str = "QUERY_HCA_CAP(general)";
pub const ATOMIC: &str = "QUERY_HCA_CAP(atomic)";
pub const ROCE: &str = "QUERY_HCA_CAP(roce)";

/// One QUERY_HCA_CAP of capability type `cap`; its output, or the firmware's refusal.
fn query_one<A: DevxApi>(api: &mut A, command: &'static str, cap: u16) -> Result<Vec<u8>, DevxError> {
    let mut out = vec![0u8; QUERY_HCA_CAP_OUT_LEN];
    api.general_cmd(command, &hca_cap::query_hca_cap_in(cap)?, &mut out)?;
    omw_core::mlx5::prm::check_status(omw_core::mlx5::prm::op::QUERY_HCA_CAP, &out)
        .map_err(|e| command_error(command, e))?;
    Ok(out)
}

/// The capabilities offload needs.
pub fn query<A: DevxApi>(api: &mut A) -> Result<HcaCaps, DevxError> {
    let general = query_one(api, GENERAL, hca_cap::CAP_GENERAL)?;
    let g = HcaCaps::parse(&general, None, None).map_err(|e| command_error(GENERAL, e))?;
    let atomic = if g.atomic { Some(query_one(api, ATOMIC, hca_cap::CAP_ATOMIC)?) } else { None };
    let roce = if g.roce { Some(query_one(api, ROCE, hca_cap::CAP_ROCE)?) } else { None };
    HcaCaps::parse(&general, atomic.as_deref(), roce.as_deref()).map_err(|e| command_error(GENERAL, e))
}
