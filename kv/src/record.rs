//! The bytes of one record in MN memory (little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `OKV1` |
//! | 4 | 2 | key length |
//! | 6 | 2 | reserved (0) |
//! | 8 | 4 | value length |
//! | 12 | 4 | FNV-1a of key ‖ value |
//! | 16 | key length | key |
//! | … | value length | value |
//!
//! The checksum lets a reader tell a record from whatever else the object holds (a stale
//! record, zeroed memory after a reclaim, a torn write): the store checks every read.

use std::fmt;
use zerocopy::little_endian::{U16, U32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const MAGIC: u32 = u32::from_le_bytes(*b"OKV1");
pub const HEADER_LEN: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct RecordHeader {
    pub magic: U32,
    pub key_len: U16,
    pub reserved: U16,
    pub value_len: U32,
    pub checksum: U32,
}

const _: () = assert!(std::mem::size_of::<RecordHeader>() == HEADER_LEN);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordError {
    KeyTooLong {
        len: usize,
    },
    ValueTooLong {
        len: usize,
    },
    Truncated {
        len: usize,
    },
    BadMagic {
        found: u32,
    },
    /// The lengths in the header do not match the record's size.
    BadLength,
    /// The record holds another key than the index says.
    WrongKey,
    BadChecksum {
        stored: u32,
        computed: u32,
    },
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordError::KeyTooLong { len } => write!(f, "key of {len} B (at most 65535)"),
            RecordError::ValueTooLong { len } => write!(f, "value of {len} B (at most 4 GiB)"),
            RecordError::Truncated { len } => write!(f, "{len} B is shorter than a record header"),
            RecordError::BadMagic { found } => write!(f, "magic {found:#010x}, not a record"),
            RecordError::BadLength => f.write_str("lengths in the header do not match"),
            RecordError::WrongKey => f.write_str("the record holds another key"),
            RecordError::BadChecksum { stored, computed } => {
                write!(f, "checksum {stored:#010x}, computed {computed:#010x}")
            }
        }
    }
}

impl std::error::Error for RecordError {}

/// FNV-1a (32 bit) over `parts` in order.
pub fn fnv1a(parts: &[&[u8]]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for p in parts {
        for b in *p {
            h ^= *b as u32;
            h = h.wrapping_mul(0x0100_0193);
        }
    }
    h
}

impl RecordHeader {
    pub fn new(key: &[u8], value: &[u8]) -> Result<Self, RecordError> {
        let kl = u16::try_from(key.len()).map_err(|_| RecordError::KeyTooLong { len: key.len() })?;
        let vl = u32::try_from(value.len()).map_err(|_| RecordError::ValueTooLong { len: value.len() })?;
        Ok(RecordHeader {
            magic: MAGIC.into(),
            key_len: kl.into(),
            reserved: 0.into(),
            value_len: vl.into(),
            checksum: fnv1a(&[key, value]).into(),
        })
    }
}

/// The value of the record in `bytes`, checked to be `key`'s.
pub fn decode<'a>(bytes: &'a [u8], key: &[u8]) -> Result<&'a [u8], RecordError> {
    let (h, rest) = RecordHeader::ref_from_prefix(bytes).map_err(|_| RecordError::Truncated { len: bytes.len() })?;
    if h.magic.get() != MAGIC {
        return Err(RecordError::BadMagic { found: h.magic.get() });
    }
    let (kl, vl) = (h.key_len.get() as usize, h.value_len.get() as usize);
    if rest.len() != kl + vl {
        return Err(RecordError::BadLength);
    }
    let (k, v) = rest.split_at(kl);
    if k != key {
        return Err(RecordError::WrongKey);
    }
    let computed = fnv1a(&[k, v]);
    if computed != h.checksum.get() {
        return Err(RecordError::BadChecksum { stored: h.checksum.get(), computed });
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(key: &[u8], value: &[u8]) -> Vec<u8> {
        let h = RecordHeader::new(key, value).unwrap();
        [h.as_bytes(), key, value].concat()
    }

    #[test]
    fn round_trip_and_every_error() {
        let r = rec(b"k1", b"value");
        assert_eq!(&r[..4], b"OKV1");
        assert_eq!(decode(&r, b"k1"), Ok(&b"value"[..]));
        assert_eq!(decode(&r, b"k2"), Err(RecordError::WrongKey));
        assert_eq!(decode(&r[..10], b"k1"), Err(RecordError::Truncated { len: 10 }));
        assert_eq!(decode(&r[..r.len() - 1], b"k1"), Err(RecordError::BadLength));
        let mut bad = r.clone();
        bad[0] = 0;
        assert!(matches!(decode(&bad, b"k1"), Err(RecordError::BadMagic { .. })));
        let mut flip = r.clone();
        *flip.last_mut().unwrap() ^= 1;
        assert!(matches!(decode(&flip, b"k1"), Err(RecordError::BadChecksum { .. })));
        assert!(matches!(decode(&[0u8; 64], b"k1"), Err(RecordError::BadMagic { found: 0 })), "zeroed memory");
        assert_eq!(RecordHeader::new(&[0; 70_000], b""), Err(RecordError::KeyTooLong { len: 70_000 }));
    }

    #[test]
    fn fnv_reference_values() {
        // FNV-1a 32-bit test vectors (draft-eastlake-fnv): "" and "a"
        assert_eq!(fnv1a(&[b""]), 0x811c_9dc5);
        assert_eq!(fnv1a(&[b"a"]), 0xe40c_292c);
        assert_eq!(fnv1a(&[b"fo", b"obar"]), fnv1a(&[b"foobar"]));
    }
}
