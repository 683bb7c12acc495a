//! QUERY_HCA_CAP through DEVX: the general capabilities, then (if the device has atomics)
//! the atomic capabilities, parsed by `omw_core::mlx5::prm::hca_cap`.

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

/// The capabilities offload needs.
pub fn query<A: DevxApi>(api: &mut A) -> Result<HcaCaps, DevxError> {
    let mut general = vec![0u8; QUERY_HCA_CAP_OUT_LEN];
    api.general_cmd(GENERAL, &hca_cap::query_hca_cap_in(hca_cap::CAP_GENERAL)?, &mut general)?;
    let g = HcaCaps::parse(&general, None).map_err(|e| command_error(GENERAL, e))?;
    if !g.atomic {
        return Ok(g);
    }
    let mut atomic = vec![0u8; QUERY_HCA_CAP_OUT_LEN];
    api.general_cmd(ATOMIC, &hca_cap::query_hca_cap_in(hca_cap::CAP_ATOMIC)?, &mut atomic)?;
    HcaCaps::parse(&general, Some(&atomic)).map_err(|e| command_error(ATOMIC, e))
}
