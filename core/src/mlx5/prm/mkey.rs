//! Memory windows as DEVX mkeys: CREATE_MKEY (0x200) shaped as the kernel shapes a type-2
//! memory window, QUERY_MKEY (0x201) and the mkey context it answers with.
//!
//! Why not `ibv_alloc_mw`: DEVX can query only objects it created. Linux
//! drivers/infiniband/hw/mlx5/devx.c `devx_is_obj_query_cmd` admits QUERY_MKEY, but
//! `devx_is_valid_obj_id` then accepts the object handle only if it is a DEVX object
//! (`MLX5_IB_OBJECT_DEVX_OBJ`) or a verbs CQ / SRQ / QP / WQ / RWQ indirection table — there is
//! no case for a verbs MW, so a QUERY_MKEY on one fails with EINVAL; and rdma-core's mlx5dv has
//! no MW query of its own. A window the MN must be able to inspect (its audit: DESIGN §9) is
//! therefore created through `mlx5dv_devx_obj_create`, and destroyed through
//! `mlx5dv_devx_obj_destroy`, for which the kernel builds DESTROY_MKEY (0x202) itself
//! (devx.c `devx_obj_build_destroy_cmd`, `case MLX5_CMD_OP_CREATE_MKEY`).
//!
//! The context is the one Linux drivers/infiniband/hw/mlx5/mr.c `mlx5_ib_alloc_mw` writes for a
//! window: `free = 1`, `translations_octword_size` = the KLMs a bind may write (rounded up to
//! 4), `pd`, `umr_en = 1`, `lr = 1`, `access_mode_1_0 = MLX5_MKC_ACCESS_MODE_KLMS`,
//! `en_rinval = 1` (type 2: SEND_WITH_INV may invalidate it), `qpn = 0xffffff` (bound to no
//! QP); `mlx5_ib_create_mkey` adds the variant byte `mkey_7_0`. The window's rkey is
//! `mkey_index << 8 | mkey_7_0`.
//!
//! Offsets: Linux include/linux/mlx5/mlx5_ifc.h (torvalds/linux
//! 00679b631eddaa0aa0ceba719fcb1f60c65da5a3) `struct mlx5_ifc_mkc_bits` (0x200 bits),
//! `mlx5_ifc_create_mkey_in_bits` (`memory_key_mkey_entry` at 0x80, 0x880 bits without the
//! KLM list), `mlx5_ifc_create_mkey_out_bits` (`mkey_index` at 0x48),
//! `mlx5_ifc_query_mkey_in_bits` (`mkey_index` at 0x48, 0x80 bits) and
//! `mlx5_ifc_query_mkey_out_bits` (`memory_key_mkey_entry` at 0x80, then 0x600 reserved bits
//! and two 16-byte descriptor arrays: 0x980 bits), each computed from the field widths. The
//! opcodes are `MLX5_CMD_OP_CREATE_MKEY` / `QUERY_MKEY` / `DESTROY_MKEY` (include/linux/mlx5/
//! mlx5_ifc.h, same values in DPDK's mlx5_prm.h).

use super::{bits, op, Field, IN_OPCODE};
use crate::access::AccessFlags;
use crate::device::MwBinding;
use crate::ids::{Qpn, Rkey};
use crate::mlx5::Mlx5Error;

pub const CREATE_MKEY_IN_LEN: usize = 0x880 / 8;
pub const CREATE_MKEY_OUT_LEN: usize = 0x80 / 8;
pub const QUERY_MKEY_IN_LEN: usize = 0x80 / 8;
pub const QUERY_MKEY_OUT_LEN: usize = 0x980 / 8;
/// Where the mkey context starts, in CREATE_MKEY's input and in QUERY_MKEY's output alike.
pub const MKC_BASE: u32 = 0x80;

/// `struct mlx5_ifc_mkc_bits`, offsets from the context's start.
pub mod mkc {
    use super::Field;
    pub const FREE: Field = Field::new("mkc.free", 0x1, 0x1);
    pub const ACCESS_MODE_4_2: Field = Field::new("mkc.access_mode_4_2", 0x3, 0x3);
    pub const UMR_EN: Field = Field::new("mkc.umr_en", 0x10, 0x1);
    /// Remote atomic, remote write, remote read, local write, local read.
    pub const A: Field = Field::new("mkc.a", 0x11, 0x1);
    pub const RW: Field = Field::new("mkc.rw", 0x12, 0x1);
    pub const RR: Field = Field::new("mkc.rr", 0x13, 0x1);
    pub const LW: Field = Field::new("mkc.lw", 0x14, 0x1);
    pub const LR: Field = Field::new("mkc.lr", 0x15, 0x1);
    pub const ACCESS_MODE_1_0: Field = Field::new("mkc.access_mode_1_0", 0x16, 0x2);
    /// The QP a bound window is bound to; 0xffffff: none.
    pub const QPN: Field = Field::new("mkc.qpn", 0x20, 0x18);
    /// The key byte (the rkey's low 8 bits).
    pub const MKEY_7_0: Field = Field::new("mkc.mkey_7_0", 0x38, 0x8);
    /// The window covers the whole 64-bit space (`len` is then ignored).
    pub const LENGTH64: Field = Field::new("mkc.length64", 0x60, 0x1);
    pub const EN_RINVAL: Field = Field::new("mkc.en_rinval", 0x67, 0x1);
    pub const PD: Field = Field::new("mkc.pd", 0x68, 0x18);
    pub const START_ADDR: Field = Field::new("mkc.start_addr", 0x80, 0x40);
    pub const LEN: Field = Field::new("mkc.len", 0xc0, 0x40);
    pub const TRANSLATIONS_OCTWORD_SIZE: Field = Field::new("mkc.translations_octword_size", 0x1a0, 0x20);
}

/// `create_mkey_out.mkey_index` (and `query_mkey_in.mkey_index`: the same offset).
pub const MKEY_INDEX: Field = Field::new("mkey_index", 0x48, 0x18);
/// `MLX5_MKC_ACCESS_MODE_KLMS`.
pub const ACCESS_MODE_KLMS: u64 = 0x2;
/// `mkc.qpn` of a window bound to no QP.
pub const QPN_NONE: u32 = 0x00FF_FFFF;
/// KLM octowords a window is created with: `mlx5_ib_alloc_mw` with no `num_klms` request,
/// `roundup(1, 4)` — a bind writes one KLM (`umr.rs`).
pub const WINDOW_KLM_OCTOWORDS: u32 = 4;

/// A type-2 memory window to create: its PD and its first key byte.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct CreateWindow {
    pub pdn: u32,
    pub key: u8,
}

/// CREATE_MKEY for a free, UMR-enabled, KLM-mode window in `p.pdn` (see the module doc).
pub fn create_window_in(p: &CreateWindow) -> Result<[u8; CREATE_MKEY_IN_LEN], Mlx5Error> {
    let mut b = [0u8; CREATE_MKEY_IN_LEN];
    let c = |f: Field| f.at(MKC_BASE);
    bits::set(&mut b, IN_OPCODE, op::CREATE_MKEY as u64)?;
    bits::set(&mut b, c(mkc::FREE), 1)?;
    bits::set(&mut b, c(mkc::TRANSLATIONS_OCTWORD_SIZE), WINDOW_KLM_OCTOWORDS as u64)?;
    bits::set(&mut b, c(mkc::PD), p.pdn as u64)?;
    bits::set(&mut b, c(mkc::UMR_EN), 1)?;
    bits::set(&mut b, c(mkc::LR), 1)?;
    bits::set(&mut b, c(mkc::ACCESS_MODE_1_0), ACCESS_MODE_KLMS)?;
    bits::set(&mut b, c(mkc::EN_RINVAL), 1)?;
    bits::set(&mut b, c(mkc::QPN), QPN_NONE as u64)?;
    bits::set(&mut b, c(mkc::MKEY_7_0), p.key as u64)?;
    Ok(b)
}

/// The mkey index CREATE_MKEY answered with (a failed status is an error).
pub fn created_mkey_index(out: &[u8]) -> Result<u32, Mlx5Error> {
    super::check_status(op::CREATE_MKEY, out)?;
    Ok(bits::get(out, MKEY_INDEX)? as u32)
}

/// QUERY_MKEY of mkey `index`.
pub fn query_mkey_in(index: u32) -> Result<[u8; QUERY_MKEY_IN_LEN], Mlx5Error> {
    let mut b = [0u8; QUERY_MKEY_IN_LEN];
    bits::set(&mut b, IN_OPCODE, op::QUERY_MKEY as u64)?;
    bits::set(&mut b, MKEY_INDEX, index as u64)?;
    Ok(b)
}

/// What QUERY_MKEY says of a window's mkey.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MkeyContext {
    /// Invalidated (or never bound): no rkey of it validates.
    pub free: bool,
    pub qpn: u32,
    pub key: u8,
    pub pd: u32,
    pub start_addr: u64,
    pub len: u64,
    pub length64: bool,
    pub access: AccessFlags,
    pub umr_en: bool,
    pub en_rinval: bool,
    /// `access_mode_4_2 << 2 | access_mode_1_0`.
    pub access_mode: u8,
}

/// Decode QUERY_MKEY's answer (a failed status is an error).
pub fn parse_query_mkey_out(out: &[u8]) -> Result<MkeyContext, Mlx5Error> {
    super::check_status(op::QUERY_MKEY, out)?;
    if out.len() < QUERY_MKEY_OUT_LEN {
        return Err(Mlx5Error::FieldOutOfRange { field: "query_mkey_out" });
    }
    let g = |f: Field| bits::get(out, f.at(MKC_BASE));
    let mut access = AccessFlags::empty();
    access.set(AccessFlags::REMOTE_ATOMIC, g(mkc::A)? == 1);
    access.set(AccessFlags::REMOTE_WRITE, g(mkc::RW)? == 1);
    access.set(AccessFlags::REMOTE_READ, g(mkc::RR)? == 1);
    access.set(AccessFlags::LOCAL_WRITE, g(mkc::LW)? == 1);
    Ok(MkeyContext {
        free: g(mkc::FREE)? == 1,
        qpn: g(mkc::QPN)? as u32,
        key: g(mkc::MKEY_7_0)? as u8,
        pd: g(mkc::PD)? as u32,
        start_addr: g(mkc::START_ADDR)?,
        len: g(mkc::LEN)?,
        length64: g(mkc::LENGTH64)? == 1,
        access,
        umr_en: g(mkc::UMR_EN)? == 1,
        en_rinval: g(mkc::EN_RINVAL)? == 1,
        access_mode: ((g(mkc::ACCESS_MODE_4_2)? << 2) | g(mkc::ACCESS_MODE_1_0)?) as u8,
    })
}

impl MkeyContext {
    /// The window's state as the MN's audit reads it: free is unbound; in use, bound to the
    /// context's QP under its current key. An mkey in use that names no QP is no type-2
    /// window binding (a type-2 bind always names its QP): an error, never a guess.
    pub fn binding(&self, index: u32) -> Result<MwBinding, Mlx5Error> {
        if self.free {
            return Ok(MwBinding::Unbound);
        }
        if self.qpn == QPN_NONE {
            return Err(Mlx5Error::MkeyNotAWindow { index });
        }
        let rkey = Rkey::new(index, self.key).map_err(|_| Mlx5Error::MkeyNotAWindow { index })?;
        let qpn = Qpn::new(self.qpn).map_err(|_| Mlx5Error::QpnOverflow(self.qpn))?;
        Ok(MwBinding::Bound { rkey, qpn })
    }
    /// `(start, len)` of a window in use (`length64`: to the end of the address space);
    /// `None` when free.
    pub fn span(&self) -> Option<(u64, u64)> {
        (!self.free).then(|| (self.start_addr, if self.length64 { u64::MAX - self.start_addr } else { self.len }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The window CREATE_MKEY, byte by byte from mlx5_ifc.h's offsets (mkc at byte 16):
    /// opcode 0x200 → bytes 0..2; mkc bit 0x1 (free) → byte 16 bit 6 = 0x40; bit 0x10 (umr_en)
    /// → byte 18 bit 7 = 0x80; bit 0x15 (lr) → byte 18 bit 2 = 0x04; bits 0x16..0x18
    /// (access_mode_1_0 = 2) → byte 18 bits 1..0 = 0x02; qpn (0x20, 24 bits) → bytes 20..23;
    /// mkey_7_0 (0x38) → byte 23; en_rinval (0x67) → byte 28 bit 0 = 0x01; pd (0x68, 24 bits)
    /// → bytes 29..32; translations_octword_size (0x1a0, 32 bits) → bytes 68..72.
    #[test]
    fn create_window_matches_the_kernel_s_type_2_window() {
        let b = create_window_in(&CreateWindow { pdn: 0x12_3456, key: 0xA5 }).unwrap();
        let mut want = [0u8; CREATE_MKEY_IN_LEN];
        want[0..2].copy_from_slice(&[0x02, 0x00]);
        want[16] = 0x40;
        want[18] = 0x80 | 0x04 | 0x02;
        want[20..24].copy_from_slice(&[0xFF, 0xFF, 0xFF, 0xA5]);
        want[28..32].copy_from_slice(&[0x01, 0x12, 0x34, 0x56]);
        want[68..72].copy_from_slice(&4u32.to_be_bytes());
        assert_eq!(b[..], want[..]);
        assert_eq!(CREATE_MKEY_IN_LEN, 272);
        // too wide a PD number is refused, not cut
        assert!(matches!(
            create_window_in(&CreateWindow { pdn: 0x100_0000, key: 0 }),
            Err(Mlx5Error::FieldOverflow { .. })
        ));
    }

    #[test]
    fn query_names_the_mkey_index_and_the_answer_is_read_from_its_bytes() {
        let q = query_mkey_in(0xAB_CDEF).unwrap();
        assert_eq!(q, [0x02, 0x01, 0, 0, 0, 0, 0, 0, 0, 0xAB, 0xCD, 0xEF, 0, 0, 0, 0]);
        let mut out = [0u8; CREATE_MKEY_OUT_LEN];
        out[9..12].copy_from_slice(&[0x00, 0x12, 0x34]);
        assert_eq!(created_mkey_index(&out), Ok(0x1234));
        // a bound window: in use (free clear), rr|rw|a, qpn 0x1103, key 0x07, KLMs,
        // start 0x7000_0000_1000 (bytes 32..40), len 0x2000 (bytes 40..48)
        let mut a = [0u8; QUERY_MKEY_OUT_LEN];
        a[18] = 0x80 | 0x40 | 0x20 | 0x10 | 0x04 | 0x02; // umr_en a rw rr lr, KLMs
        a[20..24].copy_from_slice(&[0x00, 0x11, 0x03, 0x07]);
        a[28] = 0x01;
        a[29..32].copy_from_slice(&[0, 0, 0x10]);
        a[32..40].copy_from_slice(&0x7000_0000_1000u64.to_be_bytes());
        a[40..48].copy_from_slice(&0x2000u64.to_be_bytes());
        assert_eq!(QUERY_MKEY_OUT_LEN, 304);
        let c = parse_query_mkey_out(&a).unwrap();
        assert_eq!(
            c,
            MkeyContext {
                free: false,
                qpn: 0x1103,
                key: 0x07,
                pd: 0x10,
                start_addr: 0x7000_0000_1000,
                len: 0x2000,
                length64: false,
                access: AccessFlags::REMOTE_ATOMIC | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
                umr_en: true,
                en_rinval: true,
                access_mode: 2,
            }
        );
        let rkey = Rkey::new(0x2001, 0x07).unwrap();
        assert_eq!(c.binding(0x2001), Ok(MwBinding::Bound { rkey, qpn: Qpn::new(0x1103).unwrap() }));
        assert_eq!(c.span(), Some((0x7000_0000_1000, 0x2000)));
        // invalidated: free set → unbound, no span
        a[16] |= 0x40;
        let f = parse_query_mkey_out(&a).unwrap();
        assert_eq!((f.binding(0x2001), f.span()), (Ok(MwBinding::Unbound), None));
    }

    #[test]
    fn what_is_not_a_window_binding_is_an_error() {
        let mut a = [0u8; QUERY_MKEY_OUT_LEN];
        a[20..24].copy_from_slice(&[0xFF, 0xFF, 0xFF, 0x01]);
        let c = parse_query_mkey_out(&a).unwrap();
        assert_eq!(c.binding(9), Err(Mlx5Error::MkeyNotAWindow { index: 9 }));
        // a failed command: its status, not a context
        let mut e = [0u8; QUERY_MKEY_OUT_LEN];
        e[0] = 0x05;
        e[4..8].copy_from_slice(&0x1234u32.to_be_bytes());
        assert_eq!(
            parse_query_mkey_out(&e),
            Err(Mlx5Error::CommandFailed { opcode: op::QUERY_MKEY, status: 5, syndrome: 0x1234 })
        );
        // a short answer
        assert!(parse_query_mkey_out(&[0u8; 64]).is_err());
    }
}
