//! One canonical [`Wqe`] as the mlx5 WQE a ConnectX would fetch, and where each canonical
//! field lands in it.
//!
//! The translation follows rdma-core's `mlx5_post_send` (providers/mlx5/qp.c, v44.0) segment by
//! segment; the per-segment files cite the layouts. A bind is rdma-core's exactly: the control
//! segment's `imm` names the window by its *current* rkey (`ctrl->imm = htobe32(wr->bind_mw.mw->rkey)`,
//! the canonical bind's `rkey` field), the mkey context's `qpn_mkey` carries the *new* key byte
//! (`set_umr_mkey_seg`: `(rkey & 0xFF) | qpn << 8`, the canonical `imm`'s low byte). Choices
//! that are ours, not rdma-core's:
//! - a zero-length READ / WRITE / SEND carries no data segment (as UCX's rc_mlx5.inl does);
//! - WAIT names a CQ and ENABLE an absolute WQE index, where the canonical form names a QP and
//!   a count: a [`QueueResolver`] supplies the device numbers.

use super::atomic::{AtomicSeg, MaskedFetchAdd64Seg};
use super::ctrl::{CeSe, CtrlSeg, FenceMode, FmCeSe, PrevWqe, CTRL_SEG_SIZE, IMM_OFFSET};
use super::data::DataSeg;
use super::raddr::RaddrSeg;
use super::umr::{self, Umr};
use super::wait::{self, QueueSeg};
use super::wqebb::{wqebbs, CqIndex, WqeIndex, MAX_WQEBBS, WQEBB};
use super::{opcode, Mlx5Error};
use crate::access::AccessFlags;
use crate::wire::wqe::{Opcode, QueueSel, Wqe, WqeField, WqeFlags};
use zerocopy::IntoBytes;

/// Device numbers the canonical form leaves symbolic.
pub trait QueueResolver {
    /// The CQ number counting completions of `qpn`'s `queue` (what a WAIT names).
    fn cqn(&self, qpn: u32, queue: QueueSel) -> Option<u32>;
    /// The absolute WQE index (in WQEBBs) up to which `qpn`'s managed `queue` may run after an
    /// ENABLE of `count` more canonical entries. Called once per ENABLE, in chain order.
    fn enable_index(&mut self, qpn: u32, queue: QueueSel, count: u64) -> Option<WqeIndex>;
}

/// The resolver of a queue that posts no WAIT or ENABLE (an unmanaged queue): nothing
/// resolves, so encoding a WAIT or ENABLE with it is refused.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unmanaged;

impl QueueResolver for Unmanaged {
    fn cqn(&self, _qpn: u32, _queue: QueueSel) -> Option<u32> {
        None
    }
    fn enable_index(&mut self, _qpn: u32, _queue: QueueSel, _count: u64) -> Option<WqeIndex> {
        None
    }
}

/// An encoded mlx5 WQE: `wqebbs()` basic blocks of `bytes()`.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Mlx5Wqe {
    buf: [u8; MAX_WQEBBS * WQEBB],
    ds: u8,
}

impl Mlx5Wqe {
    /// WQE size in 16-byte units (the control segment's `ds`).
    pub fn ds(&self) -> u8 {
        self.ds
    }
    pub fn wqebbs(&self) -> usize {
        wqebbs(self.ds)
    }
    /// The WQE's bytes, padded with zeros to whole WQEBBs.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[..self.wqebbs() * WQEBB]
    }
}

struct Builder {
    buf: [u8; MAX_WQEBBS * WQEBB],
    at: usize,
}

impl Builder {
    fn new() -> Self {
        Builder { buf: [0; MAX_WQEBBS * WQEBB], at: CTRL_SEG_SIZE }
    }
    fn put(&mut self, seg: &[u8]) {
        self.buf[self.at..self.at + seg.len()].copy_from_slice(seg);
        self.at += seg.len();
    }
    fn finish(mut self, ctrl: impl FnOnce(u8) -> CtrlSeg) -> Mlx5Wqe {
        let ds = (self.at / 16) as u8;
        self.buf[..CTRL_SEG_SIZE].copy_from_slice(ctrl(ds).as_bytes());
        Mlx5Wqe { buf: self.buf, ds }
    }
}

/// The `fm_ce_se` of a WQE with canonical `flags` following `prev` on its send queue: the
/// fence mode as the providers' `get_fence` computes it ([`FenceMode::for_wqe`]), a CQE if
/// SIGNALED, the solicited bit if SOLICITED.
pub fn fm_ce_se(flags: WqeFlags, prev: PrevWqe) -> FmCeSe {
    let mut f = CeSe::empty();
    f.set(CeSe::CQ_UPDATE, flags.contains(WqeFlags::SIGNALED));
    f.set(CeSe::SOLICITED, flags.contains(WqeFlags::SOLICITED));
    FmCeSe::new(FenceMode::for_wqe(flags.contains(WqeFlags::FENCE), prev), f)
}

fn check_qpn(q: u32) -> Result<u32, Mlx5Error> {
    if q > crate::ids::Qpn::MAX {
        Err(Mlx5Error::QpnOverflow(q))
    } else {
        Ok(q)
    }
}

/// True for the operations rdma-core follows with a small initiator fence on the next WQE
/// (their mlx5 form is a UMR: a bind, an unbind or a local invalidate).
pub fn is_umr(w: &Wqe) -> bool {
    matches!(w.opcode, Opcode::BindMw | Opcode::LocalInv)
}

/// What `w` leaves for the WQE after it on its send queue.
pub fn prev_of(w: &Wqe) -> PrevWqe {
    if is_umr(w) {
        PrevWqe::Umr
    } else {
        PrevWqe::Other
    }
}

/// The `ds` (16-byte units) of `w`'s mlx5 form, without encoding it (the layout needs the size
/// before it knows the index; `encode` must agree — tested).
pub fn ds_of(w: &Wqe) -> u8 {
    let data = if w.length != 0 || w.opcode.is_atomic() { 1 } else { 0 };
    match w.opcode {
        Opcode::Nop => 1,
        Opcode::Send | Opcode::SendWithImm | Opcode::SendWithInv => 1 + data,
        Opcode::Write | Opcode::WriteWithImm | Opcode::Read => 2 + data,
        Opcode::FetchAdd | Opcode::CompareSwap | Opcode::MaskedFetchAdd => 4,
        Opcode::BindMw if w.flags.contains(WqeFlags::UNBIND) => 8,
        Opcode::BindMw => 12,
        Opcode::LocalInv => 8,
        Opcode::Wait | Opcode::Enable => 2,
    }
}

/// Encode `w` as the WQE at producer index `pi` of send queue `sq_qpn`, following `prev` on
/// that queue (after a UMR it carries the initiator small fence, as rdma-core's does).
pub fn encode(
    w: &Wqe,
    pi: WqeIndex,
    sq_qpn: u32,
    prev: PrevWqe,
    resolver: &mut impl QueueResolver,
) -> Result<Mlx5Wqe, Mlx5Error> {
    let sq_qpn = check_qpn(sq_qpn)?;
    let f = fm_ce_se(w.flags, prev);
    let mut b = Builder::new();
    let ctrl = |op: u8, opmod: u8, imm: u32| move |ds| CtrlSeg::new(pi.get(), op, opmod, sq_qpn, f, ds, imm);
    let data = |b: &mut Builder| {
        if w.length != 0 {
            b.put(DataSeg::new(w.length, w.lkey, w.local_addr).as_bytes());
        }
    };
    let atomic_prefix = |b: &mut Builder| -> Result<(), Mlx5Error> {
        if w.length != 8 {
            return Err(Mlx5Error::AtomicLength(w.length));
        }
        b.put(RaddrSeg::new(w.remote_addr, w.rkey).as_bytes());
        Ok(())
    };
    Ok(match w.opcode {
        Opcode::Nop => b.finish(ctrl(opcode::NOP, 0, 0)),
        Opcode::Send | Opcode::SendWithImm | Opcode::SendWithInv => {
            data(&mut b);
            let (op, imm) = match w.opcode {
                Opcode::Send => (opcode::SEND, 0),
                Opcode::SendWithImm => (opcode::SEND_IMM, w.imm),
                _ => (opcode::SEND_INVAL, w.imm),
            };
            b.finish(ctrl(op, 0, imm))
        }
        Opcode::Write | Opcode::WriteWithImm | Opcode::Read => {
            b.put(RaddrSeg::new(w.remote_addr, w.rkey).as_bytes());
            data(&mut b);
            let (op, imm) = match w.opcode {
                Opcode::Write => (opcode::RDMA_WRITE, 0),
                Opcode::WriteWithImm => (opcode::RDMA_WRITE_IMM, w.imm),
                _ => (opcode::RDMA_READ, 0),
            };
            b.finish(ctrl(op, 0, imm))
        }
        Opcode::FetchAdd | Opcode::CompareSwap => {
            atomic_prefix(&mut b)?;
            let (op, seg) = if w.opcode == Opcode::FetchAdd {
                (opcode::ATOMIC_FA, AtomicSeg::fetch_add(w.operand0))
            } else {
                (opcode::ATOMIC_CS, AtomicSeg::compare_swap(w.operand0, w.operand1))
            };
            b.put(seg.as_bytes());
            data(&mut b);
            b.finish(ctrl(op, 0, 0))
        }
        Opcode::MaskedFetchAdd => {
            atomic_prefix(&mut b)?;
            b.put(MaskedFetchAdd64Seg::new(w.operand0, w.operand1).as_bytes());
            data(&mut b);
            b.finish(ctrl(opcode::ATOMIC_MASKED_FA, opcode::OPMOD_EXT_ATOMIC_8B, 0))
        }
        Opcode::BindMw if w.flags.contains(WqeFlags::UNBIND) => {
            umr_wqe(b, Umr::invalidate(false), ctrl(opcode::UMR, 0, w.imm))
        }
        Opcode::BindMw => {
            if w.length > 1 << 31 {
                return Err(Mlx5Error::BindTooLong(w.length));
            }
            let qpn = check_qpn(w.qpn)?;
            let access = AccessFlags::from_bits_truncate(w.operand1 as u32);
            let u = Umr::bind_type2(w.imm as u8, w.local_addr, w.length, w.lkey, qpn, access);
            umr_wqe(b, u, ctrl(opcode::UMR, 0, w.rkey))
        }
        Opcode::LocalInv => umr_wqe(b, Umr::invalidate(true), ctrl(opcode::UMR, 0, w.imm)),
        Opcode::Wait => {
            let qpn = check_qpn(w.qpn)?;
            let q = w.queue_sel();
            let cqn = resolver.cqn(qpn, q).ok_or(Mlx5Error::Unresolved { qpn, recv: q == QueueSel::Recv })?;
            b.put(QueueSeg::wait_cq(cqn, CqIndex::from_count(w.operand0)).as_bytes());
            b.finish(ctrl(opcode::WAIT, opcode::OPMOD_WAIT_CQ_PI, 0))
        }
        Opcode::Enable => {
            let qpn = check_qpn(w.qpn)?;
            let q = w.queue_sel();
            let idx = resolver
                .enable_index(qpn, q, w.operand0)
                .ok_or(Mlx5Error::Unresolved { qpn, recv: q == QueueSel::Recv })?;
            b.put(QueueSeg::enable(qpn, idx).as_bytes());
            let op = if q == QueueSel::Send { opcode::SEND_EN } else { opcode::RECV_EN };
            b.finish(ctrl(op, 0, 0))
        }
    })
}

/// A READ of `remote` scattered over several local buffers — the form the mlx5 chains use to
/// turn a little-endian value in MN memory into a big-endian WQE field and back (one one-byte
/// data segment per byte, in reverse order; ODRP's technique), and to land one value in the
/// two places a bind keeps it. The total length is the sum of the segments.
pub fn encode_scatter_read(
    remote: u64,
    rkey: u32,
    sges: &[DataSeg],
    pi: WqeIndex,
    sq_qpn: u32,
    f: FmCeSe,
) -> Result<Mlx5Wqe, Mlx5Error> {
    let sq_qpn = check_qpn(sq_qpn)?;
    if sges.is_empty() || sges.len() > super::wqebb::MAX_SCATTER_SGES {
        return Err(Mlx5Error::TooManySges(sges.len()));
    }
    let mut b = Builder::new();
    b.put(RaddrSeg::new(remote, rkey).as_bytes());
    for s in sges {
        b.put(s.as_bytes());
    }
    Ok(b.finish(|ds| CtrlSeg::new(pi.get(), opcode::RDMA_READ, 0, sq_qpn, f, ds, 0)))
}

/// `ds` of a scatter READ with `sges` data segments.
pub const fn scatter_read_ds(sges: usize) -> u8 {
    2 + sges as u8
}

fn umr_wqe(mut b: Builder, u: Umr, ctrl: impl FnOnce(u8) -> CtrlSeg) -> Mlx5Wqe {
    b.put(u.ctrl.as_bytes());
    b.put(u.mkey.as_bytes());
    if let Some(k) = u.klm {
        let mut padded = [0u8; umr::UMR_DATA_SEG_SIZE];
        padded[..umr::KLM_SEG_SIZE].copy_from_slice(k.as_bytes());
        b.put(&padded);
    }
    b.finish(ctrl)
}

/// How a canonical value is written at a target.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Encoding {
    /// The low `value_bits` bits of the canonical value, zero-extended to `width` bytes,
    /// big-endian.
    BigEndian { value_bits: u8 },
    /// The canonical `AccessFlags` translated to [`umr::MkeyAccess`] bits (one byte).
    MkeyAccess,
}

/// One place a canonical field's value lives in the mlx5 WQE.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Target {
    /// Byte offset from the start of the WQE (the layout adds the ring offset).
    pub offset: usize,
    pub width: u8,
    pub encoding: Encoding,
}

/// Places one canonical field is kept in an mlx5 WQE.
pub const MAX_TARGETS: usize = 2;

/// Where a canonical field goes in the mlx5 form.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum FieldMapping {
    /// Written at each target (a bind's address, for example, is in the mkey context and in the
    /// KLM: a patch must write both).
    Targets(heapless::Vec<Target, MAX_TARGETS>),
    /// The field does not exist in the mlx5 WQE or is not a byte copy of the canonical value.
    Unmapped(Unmapped),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Unmapped {
    /// The operation does not use the field.
    NotUsed,
    /// mlx5 keeps no wr_id in the WQE: software maps the WQE index back to it.
    WrIdInSoftware,
    /// The value is turned into a device number by the [`QueueResolver`] (WAIT's QP → CQN,
    /// the queue selector → the opcode): a chain cannot patch it bytewise.
    Resolved,
}

/// The targets of one field: at most [`MAX_TARGETS`] (a compile-time bound).
fn targets<const N: usize>(ts: [Target; N]) -> FieldMapping {
    const { assert!(N <= MAX_TARGETS) };
    let mut v = heapless::Vec::new();
    for x in ts {
        let pushed = v.push(x);
        debug_assert!(pushed.is_ok(), "N <= MAX_TARGETS, asserted at compile time");
    }
    FieldMapping::Targets(v)
}

const fn be(offset: usize, width: u8, value_bits: u8) -> Target {
    Target { offset, width, encoding: Encoding::BigEndian { value_bits } }
}

/// The targets of `field` in the mlx5 form of a WQE with opcode `op` and flags `flags` (the
/// data-segment targets assume a non-zero length; a zero-length transfer has none).
pub fn field_mapping(w: &Wqe, field: WqeField) -> FieldMapping {
    use FieldMapping::*;
    use WqeField as F;
    const C: usize = CTRL_SEG_SIZE;
    let imm = be(IMM_OFFSET, 4, 32);
    if field == F::WrId {
        return Unmapped(self::Unmapped::WrIdInSoftware);
    }
    // data segment position by operation
    let data_at = match w.opcode {
        Opcode::Send | Opcode::SendWithImm | Opcode::SendWithInv => Some(C),
        Opcode::Write | Opcode::WriteWithImm | Opcode::Read => Some(C + 16),
        o if o.is_atomic() => Some(C + 32),
        _ => None,
    }
    .filter(|_| w.length != 0 || w.opcode.is_atomic());
    let mkey = C + umr::UMR_CTRL_SEG_SIZE;
    let klm = mkey + umr::MKEY_CONTEXT_SEG_SIZE;
    let unbind = w.flags.contains(WqeFlags::UNBIND);
    match (w.opcode, field) {
        (Opcode::SendWithImm | Opcode::WriteWithImm | Opcode::SendWithInv | Opcode::LocalInv, F::Imm) => targets([imm]),
        (Opcode::BindMw, F::Imm) if unbind => targets([imm]),
        // the new key: its byte in qpn_mkey; the current key names the window in ctrl.imm
        (Opcode::BindMw, F::Imm) => targets([be(mkey + umr::MKEY_QPN_MKEY_OFFSET + 3, 1, 8)]),
        (Opcode::BindMw, _) if unbind => Unmapped(self::Unmapped::NotUsed),
        (Opcode::BindMw, F::Rkey) => targets([imm]),
        (Opcode::BindMw, F::LocalAddr) => {
            if w.access().contains(AccessFlags::ZERO_BASED) {
                targets([be(klm + umr::KLM_ADDRESS_OFFSET, 8, 64)])
            } else {
                targets([be(mkey + umr::MKEY_START_ADDR_OFFSET, 8, 64), be(klm + umr::KLM_ADDRESS_OFFSET, 8, 64)])
            }
        }
        (Opcode::BindMw, F::Length) => {
            targets([be(mkey + umr::MKEY_LEN_OFFSET, 8, 32), be(klm + umr::KLM_BYTE_COUNT_OFFSET, 4, 32)])
        }
        (Opcode::BindMw, F::Lkey) => targets([be(klm + umr::KLM_MKEY_OFFSET, 4, 32)]),
        (Opcode::BindMw, F::Qpn) => targets([be(mkey + umr::MKEY_QPN_MKEY_OFFSET, 3, 24)]),
        (Opcode::BindMw, F::Operand1) => {
            targets([Target { offset: mkey + umr::MKEY_ACCESS_OFFSET, width: 1, encoding: Encoding::MkeyAccess }])
        }
        (o, F::RemoteAddr) if o.is_remote() => targets([be(C, 8, 64)]),
        (o, F::Rkey) if o.is_remote() => targets([be(C + 8, 4, 32)]),
        (_, F::LocalAddr) => data_at.map_or(Unmapped(self::Unmapped::NotUsed), |d| targets([be(d + 8, 8, 64)])),
        (_, F::Length) => data_at.map_or(Unmapped(self::Unmapped::NotUsed), |d| targets([be(d, 4, 32)])),
        (_, F::Lkey) => data_at.map_or(Unmapped(self::Unmapped::NotUsed), |d| targets([be(d + 4, 4, 32)])),
        (Opcode::FetchAdd | Opcode::MaskedFetchAdd, F::Operand0) => targets([be(C + 16, 8, 64)]),
        (Opcode::CompareSwap, F::Operand0) => targets([be(C + 24, 8, 64)]),
        (Opcode::CompareSwap, F::Operand1) => targets([be(C + 16, 8, 64)]),
        (Opcode::MaskedFetchAdd, F::Operand1) => targets([be(C + 24, 8, 64)]),
        (Opcode::Wait, F::Operand0) => targets([be(C + wait::MAX_INDEX_OFFSET, 4, 24)]),
        (Opcode::Enable, F::Operand0) => targets([be(C + wait::MAX_INDEX_OFFSET, 4, 16)]),
        (Opcode::Enable, F::Qpn) => targets([be(C + wait::QPN_CQN_OFFSET, 4, 24)]),
        (Opcode::Wait | Opcode::Enable, F::Qpn | F::Operand1) => Unmapped(self::Unmapped::Resolved),
        _ => Unmapped(self::Unmapped::NotUsed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::AccessFlags;

    pub(crate) struct Fixed;
    impl QueueResolver for Fixed {
        fn cqn(&self, qpn: u32, q: QueueSel) -> Option<u32> {
            Some(qpn + 0x100 + q as u32)
        }
        fn enable_index(&mut self, _qpn: u32, _q: QueueSel, count: u64) -> Option<WqeIndex> {
            Some(WqeIndex::new(count as u16))
        }
    }

    fn value_at(bytes: &[u8], t: &Target) -> u64 {
        bytes[t.offset..t.offset + t.width as usize].iter().fold(0u64, |a, b| (a << 8) | *b as u64)
    }

    /// Every mapped field reads back the canonical value from the encoded bytes: the map and
    /// the encoder agree.
    #[test]
    fn mapping_reads_back_every_field() {
        let wqes = [
            Wqe::read(0x1111_2222_3333_4444, 0x55, 64, 0x6666_7777_8888_9990, 0xAA_BBCC),
            Wqe::write_imm(0x10, 0x20, 8, 0x30, 0x40, 0xDEAD_BEEF),
            Wqe::send_with_inv(0x10, 0x20, 16, 0x1234_5601),
            Wqe::fetch_add(0x100, 1, 0x200, 2, 0x0102_0304_0506_0708),
            Wqe::masked_fetch_add(0x100, 1, 0x200, 2, 5, 0x8000_0000_0000_8000),
            Wqe::compare_swap(0x100, 1, 0x200, 2, 7, 9),
            Wqe::bind_mw(0x0012_3405, 0x7000_0000, 4096, 0x77, 0x00AB_CDEF, AccessFlags::DATA_WINDOW),
            Wqe::local_inv(0x0012_3405),
            Wqe::wait(3, QueueSel::Recv, 0x0123_4567_89AB),
            Wqe::enable(0x42, QueueSel::Send, 17),
        ];
        for w in wqes {
            let e = encode(&w, WqeIndex::new(9), 0x99, PrevWqe::Other, &mut Fixed).unwrap();
            let canon = w.to_bytes();
            let cb = zerocopy::IntoBytes::as_bytes(&canon);
            for f in WqeField::ALL {
                let FieldMapping::Targets(ts) = field_mapping(&w, f) else { continue };
                let v = match f.width() {
                    4 => u32::from_le_bytes(cb[f.offset()..f.offset() + 4].try_into().unwrap()) as u64,
                    _ => u64::from_le_bytes(cb[f.offset()..f.offset() + 8].try_into().unwrap()),
                };
                for t in ts {
                    let got = value_at(e.bytes(), &t);
                    let want = match t.encoding {
                        Encoding::BigEndian { value_bits } if value_bits < 64 => v & ((1u64 << value_bits) - 1),
                        Encoding::BigEndian { .. } => v,
                        Encoding::MkeyAccess => {
                            umr::MkeyAccess::from_verbs(AccessFlags::from_bits_truncate(v as u32)).bits() as u64
                        }
                    };
                    let want = if (t.width as u32) < 8 { want & ((1u64 << (8 * t.width as u32)) - 1) } else { want };
                    assert_eq!(got, want, "{:?} {:?} at {}", w.opcode, f, t.offset);
                }
            }
        }
    }

    #[test]
    fn sizes() {
        let mut r = Fixed;
        let n = |w: Wqe, r: &mut Fixed| encode(&w, WqeIndex::new(0), 1, PrevWqe::Other, r).unwrap().ds();
        assert_eq!(n(Wqe::nop(), &mut r), 1);
        assert_eq!(n(Wqe::send(1, 2, 3), &mut r), 2);
        assert_eq!(n(Wqe::read(1, 2, 3, 4, 5), &mut r), 3);
        assert_eq!(n(Wqe::read(1, 2, 0, 4, 5), &mut r), 2);
        assert_eq!(n(Wqe::fetch_add(1, 2, 8, 4, 5), &mut r), 4);
        assert_eq!(n(Wqe::bind_mw(1, 2, 3, 4, 5, AccessFlags::REMOTE_READ), &mut r), 12);
        assert_eq!(n(Wqe::local_inv(1), &mut r), 8);
        assert_eq!(n(Wqe::unbind_mw(1), &mut r), 8);
        assert_eq!(n(Wqe::wait(1, QueueSel::Send, 1), &mut r), 2);
        for w in [
            Wqe::nop(),
            Wqe::send(1, 2, 0),
            Wqe::write(1, 2, 3, 4, 5),
            Wqe::unbind_mw(3),
            Wqe::enable(1, QueueSel::Recv, 2),
        ] {
            assert_eq!(ds_of(&w), n(w, &mut r));
        }
    }

    proptest::proptest! {
        /// Arbitrary canonical bytes (valid or not): `encode` answers Ok with the size `ds_of`
        /// predicts, or a typed error — never a panic.
        #[test]
        fn arbitrary_wqes_encode_or_refuse(
            op in 0usize..14, flags in 0u8..16, imm in proptest::prelude::any::<u32>(),
            a in proptest::prelude::any::<u64>(), len in proptest::prelude::any::<u32>(),
            k in proptest::prelude::any::<u32>(), q in proptest::prelude::any::<u32>(),
            o0 in proptest::prelude::any::<u64>(), o1 in 0u64..4, pi in proptest::prelude::any::<u16>(),
        ) {
            let mut w = Wqe::blank(crate::wire::wqe::Opcode::ALL[op]);
            w.flags = WqeFlags::from_bits_truncate(flags);
            (w.imm, w.local_addr, w.length, w.lkey, w.remote_addr, w.rkey, w.qpn, w.operand0, w.operand1) =
                (imm, a, len, k, a ^ o0, k ^ imm, q, o0, o1);
            match encode(&w, WqeIndex::new(pi), 0x42, PrevWqe::Other, &mut Fixed) {
                Ok(e) => {
                    proptest::prop_assert_eq!(e.ds(), ds_of(&w));
                    proptest::prop_assert_eq!(e.bytes().len(), e.wqebbs() * WQEBB);
                }
                Err(Mlx5Error::AtomicLength(_) | Mlx5Error::BindTooLong(_) | Mlx5Error::QpnOverflow(_)) => {}
                Err(e) => return Err(proptest::test_runner::TestCaseError::fail(std::format!("{e}"))),
            }
        }
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let mut r = Fixed;
        let mut a = Wqe::fetch_add(1, 2, 8, 4, 5);
        a.length = 4;
        assert_eq!(encode(&a, WqeIndex::new(0), 1, PrevWqe::Other, &mut r), Err(Mlx5Error::AtomicLength(4)));
        let big = Wqe::bind_mw(1, 0, (1 << 31) + 1, 4, 5, AccessFlags::REMOTE_READ);
        assert_eq!(
            encode(&big, WqeIndex::new(0), 1, PrevWqe::Other, &mut r),
            Err(Mlx5Error::BindTooLong((1 << 31) + 1))
        );
        assert_eq!(
            encode(&Wqe::nop(), WqeIndex::new(0), 1 << 24, PrevWqe::Other, &mut r),
            Err(Mlx5Error::QpnOverflow(1 << 24))
        );
        let w = Wqe::wait(7, QueueSel::Recv, 1);
        assert_eq!(
            encode(&w, WqeIndex::new(0), 1, PrevWqe::Other, &mut Unmanaged),
            Err(Mlx5Error::Unresolved { qpn: 7, recv: true })
        );
    }
}
