//! Reading an mlx5 WQE back from its bytes: what a NIC model executing the mlx5 form fetches
//! (issue 13 part 3), and the check that [`super::encode`] is invertible.
//!
//! The result is an [`Mlx5Op`] in the device's own terms — WAIT names a CQ number and a 24-bit
//! producer index, SEND_EN / RECV_EN an absolute 16-bit WQE index — not a canonical
//! [`crate::wire::wqe::Wqe`], because those two are not the canonical counts. Only the forms
//! `encode` produces are accepted; anything else is a typed error (bad input never panics).

use super::atomic::{AtomicSeg, MaskedFetchAdd64Seg};
use super::ctrl::{CtrlSeg, FmCeSe, CTRL_SEG_SIZE};
use super::data::DataSeg;
use super::raddr::RaddrSeg;
use super::umr::{KlmSeg, MkeyAccess, MkeyContextSeg, MkeyMask, UmrCtrlSeg, UmrFlags, MKEY_CONTEXT_FREE};
use super::wait::QueueSeg;
use super::wqebb::{CqIndex, WqeIndex};
use super::{opcode, Mlx5Error};
use crate::access::AccessFlags;
use zerocopy::FromBytes;

/// The local buffer of a transfer (absent for a zero-length one).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Local {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The local buffers of a scatter READ, in order (a fixed array: a decoded op stays `Copy`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Sges {
    list: [Local; super::wqebb::MAX_SCATTER_SGES],
    len: u8,
}

impl Sges {
    pub fn as_slice(&self) -> &[Local] {
        &self.list[..self.len as usize]
    }
    fn push(&mut self, l: Local) -> Result<(), ()> {
        let slot = self.list.get_mut(self.len as usize).ok_or(())?;
        *slot = l;
        self.len += 1;
        Ok(())
    }
}

// a decoded op is a plain value (no heap in the core): the scatter list is inline
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mlx5Op {
    Nop,
    Send {
        local: Option<Local>,
        imm: Option<u32>,
    },
    SendInv {
        local: Option<Local>,
        rkey: u32,
    },
    Write {
        remote: u64,
        rkey: u32,
        local: Option<Local>,
        imm: Option<u32>,
    },
    Read {
        remote: u64,
        rkey: u32,
        local: Option<Local>,
    },
    /// A READ scattered over several local buffers, in order (the chains' byte-order copies).
    ScatterRead {
        remote: u64,
        rkey: u32,
        sges: Sges,
    },
    FetchAdd {
        remote: u64,
        rkey: u32,
        local: Local,
        add: u64,
    },
    MaskedFetchAdd {
        remote: u64,
        rkey: u32,
        local: Local,
        add: u64,
        boundary: u64,
    },
    CompareSwap {
        remote: u64,
        rkey: u32,
        local: Local,
        compare: u64,
        swap: u64,
    },
    /// Type-2 bind (rdma-core's layout): the window named by its current key `mkey` (the
    /// control segment's `imm`: index and current key byte) gets key byte `new_key` (the low
    /// byte of `qpn_mkey`).
    Bind {
        mkey: u32,
        new_key: u8,
        addr: u64,
        length: u32,
        lkey: u32,
        qpn: u32,
        access: AccessFlags,
    },
    /// Invalidate the window `mkey`; `check_qpn`: only if bound to the posting QP.
    Invalidate {
        mkey: u32,
        check_qpn: bool,
    },
    Wait {
        cqn: u32,
        pi: CqIndex,
    },
    SendEn {
        qpn: u32,
        max_index: WqeIndex,
    },
    RecvEn {
        qpn: u32,
        max_index: WqeIndex,
    },
}

/// A decoded WQE: its control fields and operation.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Decoded {
    pub index: WqeIndex,
    pub qpn: u32,
    pub ds: u8,
    pub fm_ce_se: FmCeSe,
    pub op: Mlx5Op,
}

fn seg<T: FromBytes>(b: &[u8], at: usize) -> Result<T, Mlx5Error> {
    let n = core::mem::size_of::<T>();
    let s = b.get(at..at + n).ok_or(Mlx5Error::Truncated { need: at + n, got: b.len() })?;
    T::read_from_bytes(s).map_err(|_| Mlx5Error::Truncated { need: at + n, got: b.len() })
}

fn access_from_mkey(a: u8) -> AccessFlags {
    let m = MkeyAccess::from_bits_truncate(a);
    let mut f = AccessFlags::empty();
    f.set(AccessFlags::LOCAL_WRITE, m.contains(MkeyAccess::LOCAL_WRITE));
    f.set(AccessFlags::REMOTE_WRITE, m.contains(MkeyAccess::REMOTE_WRITE));
    f.set(AccessFlags::REMOTE_READ, m.contains(MkeyAccess::REMOTE_READ));
    f.set(AccessFlags::REMOTE_ATOMIC, m.contains(MkeyAccess::ATOMIC));
    f
}

/// Decode the WQE at the start of `b` (its WQEBBs contiguous, as the layout keeps them).
pub fn decode(b: &[u8]) -> Result<Decoded, Mlx5Error> {
    let c: CtrlSeg = seg(b, 0)?;
    let fm_ce_se = FmCeSe::from_bits(c.fm_ce_se).ok_or(Mlx5Error::BadFmCeSe(c.fm_ce_se))?;
    let (op, opmod, ds) = (c.opcode(), c.opmod(), c.ds());
    let need = ds as usize * 16;
    if b.len() < need {
        return Err(Mlx5Error::Truncated { need, got: b.len() });
    }
    let bad = Mlx5Error::BadDs { opcode: op, ds };
    let imm = c.imm.get();
    let data = |at: usize| -> Result<Option<Local>, Mlx5Error> {
        if need <= at {
            return Ok(None);
        }
        let d: DataSeg = seg(b, at)?;
        Ok(Some(Local { addr: d.addr.get(), length: d.byte_count.get(), lkey: d.lkey.get() }))
    };
    let want_ds = |lo: u8, hi: u8| if (lo..=hi).contains(&ds) { Ok(()) } else { Err(bad) };
    const C: usize = CTRL_SEG_SIZE;
    let decoded = match (op, opmod) {
        (opcode::NOP, 0) => {
            want_ds(1, 1)?;
            Mlx5Op::Nop
        }
        (opcode::SEND | opcode::SEND_IMM, 0) => {
            want_ds(1, 2)?;
            Mlx5Op::Send { local: data(C)?, imm: (op == opcode::SEND_IMM).then_some(imm) }
        }
        (opcode::SEND_INVAL, 0) => {
            want_ds(1, 2)?;
            Mlx5Op::SendInv { local: data(C)?, rkey: imm }
        }
        (opcode::RDMA_READ, 0) if ds > 3 => {
            want_ds(4, super::encode::scatter_read_ds(super::wqebb::MAX_SCATTER_SGES))?;
            let r: RaddrSeg = seg(b, C)?;
            let mut sges = Sges::default();
            for k in 0..(ds as usize - 2) {
                let l = data(C + 16 + 16 * k)?.ok_or(bad)?;
                sges.push(l).map_err(|_| bad)?;
            }
            Mlx5Op::ScatterRead { remote: r.raddr.get(), rkey: r.rkey.get(), sges }
        }
        (opcode::RDMA_WRITE | opcode::RDMA_WRITE_IMM | opcode::RDMA_READ, 0) => {
            want_ds(2, 3)?;
            let r: RaddrSeg = seg(b, C)?;
            let (remote, rkey, local) = (r.raddr.get(), r.rkey.get(), data(C + 16)?);
            match op {
                opcode::RDMA_READ => Mlx5Op::Read { remote, rkey, local },
                _ => Mlx5Op::Write { remote, rkey, local, imm: (op == opcode::RDMA_WRITE_IMM).then_some(imm) },
            }
        }
        (opcode::ATOMIC_FA | opcode::ATOMIC_CS, 0) | (opcode::ATOMIC_MASKED_FA, opcode::OPMOD_EXT_ATOMIC_8B) => {
            want_ds(4, 4)?;
            let r: RaddrSeg = seg(b, C)?;
            let local = data(C + 32)?.ok_or(bad)?;
            let (remote, rkey) = (r.raddr.get(), r.rkey.get());
            match op {
                opcode::ATOMIC_FA => {
                    let a: AtomicSeg = seg(b, C + 16)?;
                    Mlx5Op::FetchAdd { remote, rkey, local, add: a.swap_add.get() }
                }
                opcode::ATOMIC_CS => {
                    let a: AtomicSeg = seg(b, C + 16)?;
                    Mlx5Op::CompareSwap { remote, rkey, local, compare: a.compare.get(), swap: a.swap_add.get() }
                }
                _ => {
                    let m: MaskedFetchAdd64Seg = seg(b, C + 16)?;
                    Mlx5Op::MaskedFetchAdd { remote, rkey, local, add: m.add.get(), boundary: m.field_boundary.get() }
                }
            }
        }
        (opcode::UMR, 0) => decode_umr(b, ds, imm)?,
        (opcode::WAIT, opcode::OPMOD_WAIT_CQ_PI) => {
            want_ds(2, 2)?;
            let q: QueueSeg = seg(b, C)?;
            Mlx5Op::Wait { cqn: q.qpn_cqn.get() & 0x00FF_FFFF, pi: CqIndex::from_count(q.max_index.get() as u64) }
        }
        (opcode::SEND_EN | opcode::RECV_EN, 0) => {
            want_ds(2, 2)?;
            let q: QueueSeg = seg(b, C)?;
            let (qpn, max_index) = (q.qpn_cqn.get() & 0x00FF_FFFF, WqeIndex::new(q.max_index.get() as u16));
            if op == opcode::SEND_EN {
                Mlx5Op::SendEn { qpn, max_index }
            } else {
                Mlx5Op::RecvEn { qpn, max_index }
            }
        }
        _ => return Err(Mlx5Error::UnknownOpcode { opcode: op, opmod }),
    };
    Ok(Decoded { index: WqeIndex::new(c.wqe_index()), qpn: c.qpn(), ds, fm_ce_se, op: decoded })
}

fn decode_umr(b: &[u8], ds: u8, imm: u32) -> Result<Mlx5Op, Mlx5Error> {
    let u: UmrCtrlSeg = seg(b, CTRL_SEG_SIZE)?;
    let m: MkeyContextSeg = seg(b, CTRL_SEG_SIZE + 48)?;
    let flags = UmrFlags::from_bits(u.flags).ok_or(Mlx5Error::UnsupportedUmr)?;
    let mask = MkeyMask::from_bits(u.mkey_mask.get()).ok_or(Mlx5Error::UnsupportedUmr)?;
    let base = UmrFlags::WINDOW_BASE;
    let inv = MkeyMask::WINDOW_KEY;
    let bind = MkeyMask::TYPE2_BIND;
    match (ds, flags, mask, m.free) {
        (12, f, k, 0) if f == base | UmrFlags::CHECK_FREE && k == bind && u.klm_octowords.get() == 4 => {
            let klm: KlmSeg = seg(b, CTRL_SEG_SIZE + 48 + 64)?;
            let qpn_mkey = m.qpn_mkey.get();
            Ok(Mlx5Op::Bind {
                mkey: imm,
                new_key: qpn_mkey as u8,
                addr: klm.address.get(),
                length: klm.byte_count.get(),
                lkey: klm.mkey.get(),
                qpn: qpn_mkey >> 8,
                access: access_from_mkey(m.access_flags),
            })
        }
        (8, f, k, MKEY_CONTEXT_FREE) if f == base | UmrFlags::CHECK_QPN && k == inv | MkeyMask::QPN => {
            Ok(Mlx5Op::Invalidate { mkey: imm, check_qpn: true })
        }
        (8, f, k, MKEY_CONTEXT_FREE) if f == base && k == inv => Ok(Mlx5Op::Invalidate { mkey: imm, check_qpn: false }),
        _ => Err(Mlx5Error::UnsupportedUmr),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mlx5::ctrl::{CeSe, FenceMode, PrevWqe};
    use crate::mlx5::encode::{encode, QueueResolver};
    use crate::wire::wqe::{Opcode, QueueSel, Wqe, WqeFlags};
    use proptest::prelude::*;

    struct Fixed;
    impl QueueResolver for Fixed {
        fn cqn(&self, qpn: u32, q: QueueSel) -> Option<u32> {
            Some((qpn + 0x100 + q as u32) & 0xFF_FFFF)
        }
        fn enable_index(&mut self, _qpn: u32, _q: QueueSel, count: u64) -> Option<WqeIndex> {
            Some(WqeIndex::new(count as u16))
        }
    }

    fn local(w: &Wqe) -> Option<Local> {
        (w.length != 0).then_some(Local { addr: w.local_addr, length: w.length, lkey: w.lkey })
    }

    /// What `decode(encode(w))` must give for a canonical WQE.
    fn expected(w: &Wqe) -> Mlx5Op {
        let l8 = Local { addr: w.local_addr, length: 8, lkey: w.lkey };
        match w.opcode {
            Opcode::Nop => Mlx5Op::Nop,
            Opcode::Send => Mlx5Op::Send { local: local(w), imm: None },
            Opcode::SendWithImm => Mlx5Op::Send { local: local(w), imm: Some(w.imm) },
            Opcode::SendWithInv => Mlx5Op::SendInv { local: local(w), rkey: w.imm },
            Opcode::Write => Mlx5Op::Write { remote: w.remote_addr, rkey: w.rkey, local: local(w), imm: None },
            Opcode::WriteWithImm => {
                Mlx5Op::Write { remote: w.remote_addr, rkey: w.rkey, local: local(w), imm: Some(w.imm) }
            }
            Opcode::Read => Mlx5Op::Read { remote: w.remote_addr, rkey: w.rkey, local: local(w) },
            Opcode::FetchAdd => Mlx5Op::FetchAdd { remote: w.remote_addr, rkey: w.rkey, local: l8, add: w.operand0 },
            Opcode::MaskedFetchAdd => Mlx5Op::MaskedFetchAdd {
                remote: w.remote_addr,
                rkey: w.rkey,
                local: l8,
                add: w.operand0,
                boundary: w.operand1,
            },
            Opcode::CompareSwap => Mlx5Op::CompareSwap {
                remote: w.remote_addr,
                rkey: w.rkey,
                local: l8,
                compare: w.operand0,
                swap: w.operand1,
            },
            Opcode::BindMw if w.flags.contains(WqeFlags::UNBIND) => {
                Mlx5Op::Invalidate { mkey: w.imm, check_qpn: false }
            }
            Opcode::BindMw => Mlx5Op::Bind {
                mkey: w.rkey,
                new_key: w.imm as u8,
                addr: w.local_addr,
                length: w.length,
                lkey: w.lkey,
                qpn: w.qpn,
                access: w.access() & (AccessFlags::LOCAL_WRITE | AccessFlags::DATA_WINDOW | AccessFlags::REMOTE_ATOMIC),
            },
            Opcode::LocalInv => Mlx5Op::Invalidate { mkey: w.imm, check_qpn: true },
            Opcode::Wait => {
                Mlx5Op::Wait { cqn: Fixed.cqn(w.qpn, w.queue_sel()).unwrap(), pi: CqIndex::from_count(w.operand0) }
            }
            Opcode::Enable if w.queue_sel() == QueueSel::Send => {
                Mlx5Op::SendEn { qpn: w.qpn, max_index: WqeIndex::new(w.operand0 as u16) }
            }
            Opcode::Enable => Mlx5Op::RecvEn { qpn: w.qpn, max_index: WqeIndex::new(w.operand0 as u16) },
        }
    }

    proptest! {
        #[test]
        fn decode_inverts_encode(
            op in 0usize..14, flags in 0u8..16, imm in any::<u32>(), a in any::<u64>(),
            len in 0u32..(1 << 31), k in any::<u32>(), q in 0u32..(1 << 24), o0 in any::<u64>(),
            o1 in 0u64..64, pi in any::<u16>(),
        ) {
            let mut w = Wqe::blank(Opcode::ALL[op]);
            w.flags = WqeFlags::from_bits_truncate(flags);
            if w.opcode != Opcode::BindMw {
                w.flags.remove(WqeFlags::UNBIND);
            }
            (w.imm, w.local_addr, w.length, w.lkey, w.remote_addr, w.rkey, w.qpn, w.operand0, w.operand1) =
                (imm, a, len, k, a.rotate_left(7), k ^ imm, q, o0, o1);
            if w.opcode.is_atomic() {
                w.length = 8;
            }
            if matches!(w.opcode, Opcode::Wait | Opcode::Enable) {
                w.operand1 &= 1;
            }
            if w.opcode == Opcode::BindMw {
                w.operand1 &= !(AccessFlags::ZERO_BASED.bits() as u64);
            }
            let e = encode(&w, WqeIndex::new(pi), 0x42, PrevWqe::Other, &mut Fixed).unwrap();
            let d = decode(e.bytes()).unwrap();
            prop_assert_eq!(d.op, expected(&w));
            prop_assert_eq!((d.index.get(), d.qpn, d.ds), (pi, 0x42, e.ds()));
            prop_assert_eq!(d.fm_ce_se.signaled(), w.flags.contains(WqeFlags::SIGNALED));
            prop_assert_eq!(d.fm_ce_se.flags.contains(CeSe::SOLICITED), w.flags.contains(WqeFlags::SOLICITED));
            prop_assert_eq!(d.fm_ce_se.fence, FenceMode::for_wqe(w.flags.contains(WqeFlags::FENCE), PrevWqe::Other));
            // every strict prefix is refused as truncated, never misread
            for cut in [0, 8, e.ds() as usize * 16 - 1] {
                let truncated = matches!(decode(&e.bytes()[..cut]), Err(Mlx5Error::Truncated { .. }));
                prop_assert!(truncated, "prefix of {} bytes", cut);
            }
        }

        /// Arbitrary bytes: a decoded WQE or a typed error, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&b);
        }
    }

    #[test]
    fn scatter_reads_round_trip() {
        use crate::mlx5::data::DataSeg;
        use crate::mlx5::encode::encode_scatter_read;
        let sges: std::vec::Vec<DataSeg> = (0..16u64).map(|i| DataSeg::new(1, 7, 0x1000 + 15 - i)).collect();
        let fenced = FmCeSe::new(FenceMode::SmallAndFence, CeSe::empty());
        for n in 1..=16 {
            let e = encode_scatter_read(0x2000, 9, &sges[..n], WqeIndex::new(3), 0x42, fenced).unwrap();
            assert_eq!(e.ds() as usize, 2 + n);
            let d = decode(e.bytes()).unwrap();
            let got: std::vec::Vec<Local> = match d.op {
                Mlx5Op::ScatterRead { remote: 0x2000, rkey: 9, sges } => sges.as_slice().to_vec(),
                Mlx5Op::Read { remote: 0x2000, rkey: 9, local: Some(l) } if n == 1 => std::vec![l],
                other => panic!("{other:?}"),
            };
            let want: std::vec::Vec<Local> =
                sges[..n].iter().map(|s| Local { addr: s.addr.get(), length: 1, lkey: 7 }).collect();
            assert_eq!(got, want);
            assert_eq!(d.fm_ce_se, fenced);
        }
        assert_eq!(
            encode_scatter_read(0, 0, &[], WqeIndex::new(0), 1, FmCeSe::default()),
            Err(Mlx5Error::TooManySges(0))
        );
        let many = std::vec![DataSeg::new(1, 1, 1); 17];
        assert_eq!(
            encode_scatter_read(0, 0, &many, WqeIndex::new(0), 1, FmCeSe::default()),
            Err(Mlx5Error::TooManySges(17))
        );
    }

    #[test]
    fn foreign_forms_are_refused() {
        let mut w =
            encode(&Wqe::local_inv(5), WqeIndex::new(0), 1, PrevWqe::Other, &mut Fixed).unwrap().bytes().to_vec();
        w[16] |= UmrFlags::CHECK_FREE.bits();
        assert_eq!(decode(&w), Err(Mlx5Error::UnsupportedUmr));
        let mut b = encode(&Wqe::nop(), WqeIndex::new(0), 1, PrevWqe::Other, &mut Fixed).unwrap().bytes().to_vec();
        b[3] = 0x2f;
        assert_eq!(decode(&b), Err(Mlx5Error::UnknownOpcode { opcode: 0x2f, opmod: 0 }));
        b[3] = 0;
        b[7] = 2;
        assert_eq!(decode(&b), Err(Mlx5Error::BadDs { opcode: 0, ds: 2 }));
        b[7] = 1;
        // an undefined fence mode (5 << 5, what OR-ing two fence "flags" made) is refused
        b[11] = 0xa8;
        assert_eq!(decode(&b), Err(Mlx5Error::BadFmCeSe(0xa8)));
        b[11] = 0x88;
        let d = decode(&b).unwrap();
        assert_eq!((d.fm_ce_se.fence, d.fm_ce_se.signaled()), (FenceMode::SmallAndFence, true));
    }
}
