//! The two forms a chain's WQEs take in a send ring.
//!
//! A chain is described once, symbolically ([`crate::chain::ChainLayout`]: steps and
//! [`crate::chain::Loc`]s); the format decides the bytes when it is resolved. The canonical form
//! (one 64-byte little-endian [`crate::wire::wqe::Wqe`] per entry) is what the loopback model, the
//! FPGA double and the host engine execute; the mlx5 form ([`crate::chain::mlx5`]) is what a
//! ConnectX fetches: big-endian segments in 64-byte WQEBBs, WAIT on a CQ producer index,
//! SEND_EN to an absolute WQE index. MN memory (MWTable, free queue, scratch) and the wire have
//! one layout, little-endian, in both: the format converts where a value crosses into a WQE.

/// How WQE fields are laid out.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Default)]
pub enum WqeFormat {
    /// omw's own 64-byte WQE, fields little-endian ([`crate::wire::wqe`]).
    #[default]
    Canonical,
    /// ConnectX WQEs (docs/MLX5.md), fields big-endian.
    Mlx5,
}

/// Byte order of multi-byte values.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum ByteOrder {
    Little,
    Big,
}

impl WqeFormat {
    /// The byte order of values in WQE fields. MN memory is always little-endian; where the
    /// two differ, a chain copies with byte-reversing scatter READs.
    pub const fn field_order(self) -> ByteOrder {
        match self {
            WqeFormat::Canonical => ByteOrder::Little,
            WqeFormat::Mlx5 => ByteOrder::Big,
        }
    }
    pub const fn name(self) -> &'static str {
        match self {
            WqeFormat::Canonical => "canonical",
            WqeFormat::Mlx5 => "mlx5",
        }
    }
}
