//! UMR: how mlx5 binds and invalidates memory windows. A type-2 BIND_MW and a LOCAL_INV are
//! both UMR WQEs (opcode 0x25) that rewrite the window's mkey context.
//!
//! Sources (rdma-core 44.0): `struct mlx5_wqe_umr_ctrl_seg` (mlx5dv.h:1346),
//! `struct mlx5_wqe_mkey_context_seg` (mlx5dv.h:1397), `struct mlx5_wqe_umr_klm_seg`
//! (mlx5dv.h:1358) and the way providers/mlx5/qp.c (tag v44.0) fills them in
//! `set_umr_control_seg`, `set_umr_mkey_seg`, `set_umr_data_seg` and `set_bind_wr`.
//!
//! UMR control segment (48 bytes):
//! ```text
//! off len field
//!   0  1  flags            INLINE | CHECK_FREE | TRNSLATION_OFFSET | CHECK_QPN
//!   1  3  reserved
//!   4  2  klm_octowords    BE16 (4 for one KLM: ALIGN(1, 3) / 2; 0 for invalidate)
//!   6  2  translation_offset BE16 (0)
//!   8  8  mkey_mask        BE64: which mkey-context fields the UMR writes
//!  16 32  reserved
//! ```
//! Mkey context segment (64 bytes):
//! ```text
//! off len field
//!   0  1  free             0x40 = MLX5_WQE_MKEY_CONTEXT_FREE (invalidate)
//!   1  1  reserved
//!   2  1  access_flags     MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_*
//!   3  1  sf
//!   4  4  qpn_mkey         BE32: bound QPN << 8 | new key byte (0xFFFFFF00 | key: no QP)
//!   8  4  reserved
//!  12  4  flags_pd
//!  16  8  start_addr       BE64
//!  24  8  len              BE64
//!  32  4  bsf_octword_size
//!  36 16  reserved
//!  52  4  translations_octword_size
//!  56  3  reserved
//!  59  1  log_page_size
//!  60  4  reserved
//! ```
//! Bind (type 2) = ctrl + UMR ctrl | mkey context | one KLM padded to 64 bytes: 3 WQEBBs,
//! ds = 12. Local invalidate = ctrl + UMR ctrl | mkey context with `free`: 2 WQEBBs, ds = 8.
//! In both, the control segment's `imm` names the window's mkey (rdma-core: the MW's current
//! rkey for a bind, the invalidated rkey for LOCAL_INV).

use crate::access::AccessFlags;
use zerocopy::big_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

pub const UMR_CTRL_SEG_SIZE: usize = 48;
pub const MKEY_CONTEXT_SEG_SIZE: usize = 64;
pub const KLM_SEG_SIZE: usize = 16;
/// The KLM is padded to a whole WQEBB (`set_umr_data_seg`'s 64-byte union).
pub const UMR_DATA_SEG_SIZE: usize = 64;

bitflags::bitflags! {
    /// UMR control `flags`, mlx5dv.h:1326 (`MLX5_WQE_UMR_CTRL_FLAG_*`).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
    pub struct UmrFlags: u8 {
        const CHECK_QPN = 1 << 3;
        const TRNSLATION_OFFSET = 1 << 4;
        const CHECK_FREE = 1 << 5;
        const INLINE = 1 << 7;
    }
}

bitflags::bitflags! {
    /// UMR control `mkey_mask`, mlx5dv.h:1333 (`MLX5_WQE_UMR_CTRL_MKEY_MASK_*`).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
    pub struct MkeyMask: u64 {
        const LEN = 1 << 0;
        const START_ADDR = 1 << 6;
        const SIG_ERR = 1 << 9;
        const BSF_ENABLE = 1 << 12;
        const MKEY = 1 << 13;
        const QPN = 1 << 14;
        const ACCESS_LOCAL_WRITE = 1 << 18;
        const ACCESS_REMOTE_READ = 1 << 19;
        const ACCESS_REMOTE_WRITE = 1 << 20;
        const ACCESS_ATOMIC = 1 << 21;
        const FREE = 1 << 29;
    }
}

bitflags::bitflags! {
    /// Mkey context `access_flags`, mlx5dv.h:1389 (`MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_*`).
    #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
    pub struct MkeyAccess: u8 {
        const LOCAL_READ = 1 << 2;
        const LOCAL_WRITE = 1 << 3;
        const REMOTE_READ = 1 << 4;
        const REMOTE_WRITE = 1 << 5;
        const ATOMIC = 1 << 6;
    }
}

/// `MLX5_WQE_MKEY_CONTEXT_FREE = 1 << 6` (mlx5dv.h:1386).
pub const MKEY_CONTEXT_FREE: u8 = 1 << 6;

impl MkeyAccess {
    /// As `set_umr_mkey_seg`: local read is set by the kernel, so it is never written here.
    pub fn from_verbs(a: AccessFlags) -> Self {
        let mut m = MkeyAccess::empty();
        m.set(MkeyAccess::LOCAL_WRITE, a.contains(AccessFlags::LOCAL_WRITE));
        m.set(MkeyAccess::REMOTE_WRITE, a.contains(AccessFlags::REMOTE_WRITE));
        m.set(MkeyAccess::REMOTE_READ, a.contains(AccessFlags::REMOTE_READ));
        m.set(MkeyAccess::ATOMIC, a.contains(AccessFlags::REMOTE_ATOMIC));
        m
    }
}

#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct UmrCtrlSeg {
    pub flags: u8,
    pub rsvd0: [u8; 3],
    pub klm_octowords: U16,
    pub translation_offset: U16,
    pub mkey_mask: U64,
    pub rsvd1: [u8; 32],
}

#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct MkeyContextSeg {
    pub free: u8,
    pub reserved1: u8,
    pub access_flags: u8,
    pub sf: u8,
    pub qpn_mkey: U32,
    pub reserved2: U32,
    pub flags_pd: U32,
    pub start_addr: U64,
    pub len: U64,
    pub bsf_octword_size: U32,
    pub reserved3: [U32; 4],
    pub translations_octword_size: U32,
    pub reserved4: [u8; 3],
    pub log_page_size: u8,
    pub reserved: U32,
}

#[derive(Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned, Default, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct KlmSeg {
    pub byte_count: U32,
    pub mkey: U32,
    pub address: U64,
}

const _: () = assert!(core::mem::size_of::<UmrCtrlSeg>() == UMR_CTRL_SEG_SIZE);
const _: () = assert!(core::mem::size_of::<MkeyContextSeg>() == MKEY_CONTEXT_SEG_SIZE);
const _: () = assert!(core::mem::size_of::<KlmSeg>() == KLM_SEG_SIZE);

/// Offsets inside the mkey context the chains patch.
pub const MKEY_QPN_MKEY_OFFSET: usize = 4;
pub const MKEY_START_ADDR_OFFSET: usize = 16;
pub const MKEY_LEN_OFFSET: usize = 24;
pub const MKEY_ACCESS_OFFSET: usize = 2;
/// Offsets inside the KLM.
pub const KLM_BYTE_COUNT_OFFSET: usize = 0;
pub const KLM_MKEY_OFFSET: usize = 4;
pub const KLM_ADDRESS_OFFSET: usize = 8;

/// The three segments after the control segment of a UMR WQE.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Umr {
    pub ctrl: UmrCtrlSeg,
    pub mkey: MkeyContextSeg,
    /// Present for a bind, absent for an invalidate.
    pub klm: Option<KlmSeg>,
}

impl MkeyMask {
    /// The mkey-context fields every UMR of a window writes (its free bit and key).
    pub const WINDOW_KEY: Self = Self::FREE.union(Self::MKEY);
    /// What a type-2 bind writes: the key, the QP it binds to, the range and the rights.
    pub const TYPE2_BIND: Self = Self::WINDOW_KEY
        .union(Self::QPN)
        .union(Self::LEN)
        .union(Self::START_ADDR)
        .union(Self::ACCESS_LOCAL_WRITE)
        .union(Self::ACCESS_REMOTE_READ)
        .union(Self::ACCESS_REMOTE_WRITE)
        .union(Self::ACCESS_ATOMIC);
}

impl UmrFlags {
    /// Set on every window UMR: inline mkey context, the translation offset taken from it.
    pub const WINDOW_BASE: Self = Self::TRNSLATION_OFFSET.union(Self::INLINE);
}

impl Umr {
    /// Type-2 bind of `[addr, addr+len)` of the MR `lkey` to QP `qpn`, new key byte `key`, as
    /// `set_bind_wr(qp, IBV_MW_TYPE_2, rkey, bind_info, qpn, …)` with `bind_info->length != 0`.
    pub fn bind_type2(key: u8, addr: u64, len: u32, lkey: u32, qpn: u32, access: AccessFlags) -> Self {
        let mask = MkeyMask::TYPE2_BIND;
        let ctrl = UmrCtrlSeg {
            flags: (UmrFlags::WINDOW_BASE | UmrFlags::CHECK_FREE).bits(),
            klm_octowords: U16::new(4),
            mkey_mask: U64::new(mask.bits()),
            ..Default::default()
        };
        let start = if access.contains(AccessFlags::ZERO_BASED) { 0 } else { addr };
        let mkey = MkeyContextSeg {
            free: 0,
            access_flags: MkeyAccess::from_verbs(access).bits(),
            qpn_mkey: U32::new(((qpn & 0x00FF_FFFF) << 8) | key as u32),
            start_addr: U64::new(start),
            len: U64::new(len as u64),
            ..Default::default()
        };
        let klm = KlmSeg { byte_count: U32::new(len), mkey: U32::new(lkey), address: U64::new(addr) };
        Umr { ctrl, mkey, klm: Some(klm) }
    }

    /// Invalidate: `set_bind_wr(qp, IBV_MW_TYPE_2, 0, &{length: 0}, …)` — the LOCAL_INV form,
    /// with `CHECK_QPN` (the device refuses unless the window is bound to the posting QP).
    /// `check_qpn = false` is the MN's management "unbind": the same UMR without the QPN check
    /// (and without QPN in the mask) — a form rdma-core never emits; whether firmware accepts it
    /// is a hardware question (docs/MLX5.md).
    pub fn invalidate(check_qpn: bool) -> Self {
        let mut mask = MkeyMask::WINDOW_KEY;
        let mut flags = UmrFlags::WINDOW_BASE;
        if check_qpn {
            mask |= MkeyMask::QPN;
            flags |= UmrFlags::CHECK_QPN;
        }
        let ctrl = UmrCtrlSeg {
            flags: flags.bits(),
            klm_octowords: U16::new(0),
            mkey_mask: U64::new(mask.bits()),
            ..Default::default()
        };
        let mkey = MkeyContextSeg { free: MKEY_CONTEXT_FREE, qpn_mkey: U32::new(0xFFFF_FF00), ..Default::default() };
        Umr { ctrl, mkey, klm: None }
    }
}
