//! Can the memory node run the secure protocol on this engine?
//!
//! The decision is the core's ([`ExecutionMode::choose`]); this module only explains a
//! refusal in the FPGA's terms.

use omw_core::device::{Capabilities, ExecutionMode, ModeError};
use std::fmt;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum SecureProtocolError {
    /// The engine cannot isolate CNs from each other (the stock Coyote v2 / BALBOA engine).
    Insecure { missing: Capabilities },
    /// Another refusal of the core's mode choice.
    Mode(ModeError),
}

impl fmt::Display for SecureProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SecureProtocolError::Insecure { missing } => write!(
                f,
                "this FPGA RoCE engine cannot run the omw secure protocol: it has no memory windows and \
                 no responder-side rkey check (missing {missing:?}), so any compute node holding the \
                 pool's address could read or write every chunk and free chunks it does not own. \
                 The stock Coyote v2 / BALBOA engine only moves bytes; load a bitstream with the omw \
                 extension block (docs/FPGA.md), or run the memory node on an RNIC with type-2 memory \
                 windows"
            ),
            SecureProtocolError::Mode(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for SecureProtocolError {}

/// The execution mode the MN would use with these capabilities, or why it must refuse.
pub fn secure_protocol_mode(caps: Capabilities) -> Result<ExecutionMode, SecureProtocolError> {
    ExecutionMode::choose(caps, None, false).map_err(|e| match e {
        ModeError::Insecure(missing) => SecureProtocolError::Insecure { missing },
        other => SecureProtocolError::Mode(other),
    })
}
