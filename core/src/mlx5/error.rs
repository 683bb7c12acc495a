//! Why a canonical WQE or chain has no mlx5 form, or a PRM field cannot hold a value.

use core::fmt;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Mlx5Error {
    /// The ring size (in WQEBBs) is not a power of two between 1 and 2^15.
    BadRingSize(usize),
    /// The ring buffer handed in is not `ring_wqebbs * 64` bytes.
    RingBufferSize { expected: usize, got: usize },
    /// The chain needs more WQEBBs than the ring has.
    RingOverflow { needed: usize, ring: usize },
    /// More WQEs (with padding) than the placement table can record.
    TooManyWqes { capacity: usize },
    /// A QP number does not fit in 24 bits.
    QpnOverflow(u32),
    /// A type-2 bind longer than 2 GiB: one KLM covers at most 2^31 bytes (rdma-core
    /// providers/mlx5/qp.c `set_bind_wr` refuses the same with EOPNOTSUPP).
    BindTooLong(u32),
    /// An atomic whose length is not 8: the mlx5 form carries 8-byte atomics only.
    AtomicLength(u32),
    /// A WAIT or ENABLE names a queue the caller could not resolve to a CQ number or an
    /// enable index.
    Unresolved { qpn: u32, recv: bool },
    /// Fewer bytes than the WQE's `ds` (or than a control segment) claims.
    Truncated { need: usize, got: usize },
    /// An mlx5 opcode (with opmod) this crate does not execute.
    UnknownOpcode { opcode: u8, opmod: u8 },
    /// A WQE whose `ds` does not fit its opcode.
    BadDs { opcode: u8, ds: u8 },
    /// A control segment's `fm_ce_se` that is not a form the encoder writes: an undefined
    /// fence mode (5..7 << 5), `ce` 1 or 3, or a reserved bit.
    BadFmCeSe(u8),
    /// A UMR whose flags / mkey mask are neither the bind nor the invalidate form, or a bind
    /// whose key byte and control `imm` disagree.
    UnsupportedUmr,
    /// A scatter READ with no data segment or more than
    /// [`super::wqebb::MAX_SCATTER_SGES`].
    TooManySges(usize),
    /// A PRM field value wider than the field.
    FieldOverflow { field: &'static str, value: u64 },
    /// A PRM field outside the command buffer.
    FieldOutOfRange { field: &'static str },
    /// A PRM command output reported a non-zero status.
    CommandFailed { opcode: u16, status: u8, syndrome: u32 },
    /// QUERY_MKEY reported an mkey in use that names no QP (or no valid rkey): not a type-2
    /// window binding.
    MkeyNotAWindow { index: u32 },
}

impl fmt::Display for Mlx5Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadRingSize(n) => write!(f, "mlx5 ring of {n} WQEBBs: must be a power of two in 1..=32768"),
            Self::RingBufferSize { expected, got } => {
                write!(f, "mlx5 ring buffer is {got} bytes, expected {expected}")
            }
            Self::RingOverflow { needed, ring } => {
                write!(f, "chain needs {needed} WQEBBs but the ring has {ring}")
            }
            Self::TooManyWqes { capacity } => write!(f, "more than {capacity} mlx5 WQEs in one layout"),
            Self::QpnOverflow(q) => write!(f, "QP number {q:#x} exceeds 24 bits"),
            Self::BindTooLong(l) => write!(f, "type-2 bind of {l} bytes exceeds the 2 GiB a KLM can cover"),
            Self::AtomicLength(l) => write!(f, "atomic of {l} bytes: the mlx5 form carries 8-byte atomics only"),
            Self::Unresolved { qpn, recv } => write!(
                f,
                "no CQ number / enable index known for the {} queue of QP {qpn:#x}",
                if *recv { "receive" } else { "send" }
            ),
            Self::Truncated { need, got } => write!(f, "mlx5 WQE needs {need} bytes, {got} given"),
            Self::UnknownOpcode { opcode, opmod } => {
                write!(f, "mlx5 opcode {opcode:#04x} (opmod {opmod:#04x}) is not one omw executes")
            }
            Self::BadDs { opcode, ds } => write!(f, "mlx5 opcode {opcode:#04x} with ds {ds} is malformed"),
            Self::BadFmCeSe(b) => write!(
                f,
                "fm_ce_se {b:#04x} is not one omw writes (fence modes are 0..=4 << 5, completion 0 or 2 << 2, solicited 1 << 1)"
            ),
            Self::UnsupportedUmr => f.write_str("UMR WQE is neither omw's type-2 bind nor its invalidate form"),
            Self::TooManySges(n) => {
                write!(f, "scatter READ with {n} data segments (1..={} allowed)", super::wqebb::MAX_SCATTER_SGES)
            }
            Self::FieldOverflow { field, value } => write!(f, "value {value:#x} does not fit PRM field {field}"),
            Self::FieldOutOfRange { field } => write!(f, "PRM field {field} lies outside the command buffer"),
            Self::CommandFailed { opcode, status, syndrome } => {
                write!(f, "PRM command {opcode:#06x} failed: status {status:#04x}, syndrome {syndrome:#010x}")
            }
            Self::MkeyNotAWindow { index } => {
                write!(f, "mkey {index:#x} is in use but bound to no QP: not a type-2 window binding")
            }
        }
    }
}
