//! `DEVX_SET` / `DEVX_GET` over a byte buffer.
//!
//! mlx5_ifc.h describes each command as a struct of `u8 name[bits]` members; a member's bit
//! offset counts from the most significant bit of byte 0, and the hardware reads the buffer as
//! big-endian dwords. rdma-core's `DEVX_SET(typ, p, fld, v)` (providers/mlx5/mlx5dv.h's
//! `__devx_*` helpers, v44.0) masks `v` to the field and shifts it into its dword. Here a value
//! wider than its field is an error instead of being silently cut.

use crate::mlx5::Mlx5Error;

/// A field of a PRM structure: bit offset and width, as mlx5_ifc.h gives them.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Field {
    pub name: &'static str,
    pub bit_off: u32,
    pub bits: u32,
}

impl Field {
    pub const fn new(name: &'static str, bit_off: u32, bits: u32) -> Self {
        Field { name, bit_off, bits }
    }
    /// The same field inside a structure embedded at `base` bits (e.g. `qpc` in CREATE_QP).
    pub const fn at(self, base: u32) -> Self {
        Field { name: self.name, bit_off: base + self.bit_off, bits: self.bits }
    }
    pub const fn byte_offset(self) -> usize {
        (self.bit_off / 8) as usize
    }
}

fn check(buf_len: usize, f: Field) -> Result<(), Mlx5Error> {
    let end = f.bit_off.checked_add(f.bits).map(|e| e as u64);
    if f.bits == 0 || end.is_none_or(|e| e > buf_len as u64 * 8) {
        return Err(Mlx5Error::FieldOutOfRange { field: f.name });
    }
    Ok(())
}

/// Write `v` into field `f` (up to 64 bits wide).
pub fn set(buf: &mut [u8], f: Field, v: u64) -> Result<(), Mlx5Error> {
    check(buf.len(), f)?;
    if f.bits > 64 || (f.bits < 64 && v >> f.bits != 0) {
        return Err(Mlx5Error::FieldOverflow { field: f.name, value: v });
    }
    for i in 0..f.bits {
        let p = (f.bit_off + i) as usize;
        let bit = (v >> (f.bits - 1 - i)) & 1;
        let mask = 0x80u8 >> (p % 8);
        if bit == 1 {
            buf[p / 8] |= mask;
        } else {
            buf[p / 8] &= !mask;
        }
    }
    Ok(())
}

/// Read field `f` (up to 64 bits wide).
pub fn get(buf: &[u8], f: Field) -> Result<u64, Mlx5Error> {
    check(buf.len(), f)?;
    if f.bits > 64 {
        return Err(Mlx5Error::FieldOutOfRange { field: f.name });
    }
    let mut v = 0u64;
    for i in 0..f.bits {
        let p = (f.bit_off + i) as usize;
        v = (v << 1) | ((buf[p / 8] >> (7 - p % 8)) & 1) as u64;
    }
    Ok(v)
}

/// Copy `bytes` into a byte-aligned field of exactly that many bytes (a GID, `rgid_rip`).
pub fn set_bytes(buf: &mut [u8], f: Field, bytes: &[u8]) -> Result<(), Mlx5Error> {
    check(buf.len(), f)?;
    if !f.bit_off.is_multiple_of(8) || f.bits as usize != bytes.len() * 8 {
        return Err(Mlx5Error::FieldOutOfRange { field: f.name });
    }
    let o = f.byte_offset();
    buf[o..o + bytes.len()].copy_from_slice(bytes);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DEVX_SET(…, fld at bit 0x22c width 1, 1): dword 17 (bytes 68..72), shift 32-12-1 = 19
    /// → big-endian 0x0008_0000 → byte 69 = 0x08.
    #[test]
    fn matches_devx_set_arithmetic() {
        let mut b = [0u8; 256];
        set(&mut b, Field::new("cd", 0x22c, 1), 1).unwrap();
        assert_eq!(&b[68..72], &0x0008_0000u32.to_be_bytes());
        // 24-bit field at the low end of a dword (pd at qpc 0x28): dword 1, shift 0
        let mut q = [0u8; 8];
        set(&mut q, Field::new("pd", 0x28, 0x18), 0xAB_CDEF).unwrap();
        assert_eq!(q, [0, 0, 0, 0, 0, 0xAB, 0xCD, 0xEF]);
        assert_eq!(get(&q, Field::new("pd", 0x28, 0x18)).unwrap(), 0xAB_CDEF);
        // 64-bit field
        let mut d = [0u8; 16];
        set(&mut d, Field::new("dbr_addr", 0x40, 0x40), 0x0102_0304_0506_0708).unwrap();
        assert_eq!(&d[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        // clearing writes zeros back
        set(&mut q, Field::new("pd", 0x28, 0x18), 0).unwrap();
        assert_eq!(q, [0; 8]);
    }

    #[test]
    fn refuses_what_devx_set_would_truncate() {
        let mut b = [0u8; 8];
        assert_eq!(
            set(&mut b, Field::new("st", 0x8, 0x8), 0x100),
            Err(Mlx5Error::FieldOverflow { field: "st", value: 0x100 })
        );
        assert_eq!(set(&mut b, Field::new("x", 0x3f, 2), 0), Err(Mlx5Error::FieldOutOfRange { field: "x" }));
        assert_eq!(get(&b, Field::new("y", 0x40, 1)), Err(Mlx5Error::FieldOutOfRange { field: "y" }));
        assert_eq!(b, [0; 8]);
        assert_eq!(get(&b, Field::new("z", u32::MAX, 2)), Err(Mlx5Error::FieldOutOfRange { field: "z" }));
    }

    proptest::proptest! {
        /// Any field and value: a typed error or a round trip, never a panic.
        #[test]
        fn set_get_round_trip_or_refuse(off in 0u32..2200, bits in 0u32..70, v in proptest::prelude::any::<u64>()) {
            let mut b = [0u8; 256];
            let f = Field::new("f", off, bits);
            match set(&mut b, f, v) {
                Ok(()) => proptest::prop_assert_eq!(get(&b, f).unwrap(), v),
                Err(Mlx5Error::FieldOutOfRange { .. }) => proptest::prop_assert!(bits == 0 || off + bits > 2048),
                Err(Mlx5Error::FieldOverflow { .. }) => proptest::prop_assert!(bits > 64 || v >> bits != 0),
                Err(e) => return Err(proptest::test_runner::TestCaseError::fail(std::format!("{e}"))),
            }
        }
    }
}
