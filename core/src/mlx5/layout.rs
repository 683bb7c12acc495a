//! A sequence of canonical WQEs laid out on an mlx5 send ring, and the patch map.
//!
//! The chains patch WQEs in place (a READ's result lands in a later BIND's fields). On mlx5
//! the same logical chain is a run of WQEBBs: multi-WQEBB WQEs (a bind takes three), a 16-bit
//! WQE index counted in WQEBBs, and big-endian fields at other offsets. [`lay_out`] writes the
//! mlx5 bytes into a ring image and records where each canonical WQE went; [`Mlx5Layout::targets`]
//! answers, for a canonical WQE and field (or canonical byte offset), the ring byte offset,
//! width and encoding of the same field — what a chain patcher for the mlx5 form needs.
//!
//! A WQE that would cross the ring's end is preceded by one-WQEBB NOPs up to the end, so every
//! WQE and every patch target is contiguous (rdma-core instead lets segments wrap; a patch
//! written by a READ cannot wrap). A WQE after a bind or local invalidate carries
//! `INITIATOR_SMALL_FENCE`, as rdma-core's `next_fence` does.

use super::ctrl::FmCeSe;
use super::encode::{self, encode, FieldMapping, QueueResolver, Target};
use super::nop::nop;
use super::wqebb::{wqebbs, WqeIndex, WQEBB};
use super::Mlx5Error;
use crate::wqe::{Wqe, WqeField, WQE_SIZE};
use zerocopy::IntoBytes;

/// Where one mlx5 WQE of the layout lies.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Placement {
    /// Index into the canonical sequence; `None` for a wrap-padding NOP.
    pub canonical: Option<usize>,
    /// The WQE index of its first WQEBB.
    pub pi: WqeIndex,
    pub wqebbs: u8,
    /// Byte offset of the WQE in the ring image.
    pub ring_offset: usize,
}

/// A laid-out chain: at most `N` mlx5 WQEs (canonical ones plus padding).
#[derive(Clone, Debug)]
pub struct Mlx5Layout<const N: usize> {
    placements: heapless::Vec<Placement, N>,
    /// The canonical WQEs as laid out (needed to answer field queries).
    wqes: heapless::Vec<Wqe, N>,
    ring_wqebbs: usize,
    start: WqeIndex,
    end: WqeIndex,
}

/// A patch target in the ring image.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct RingTarget {
    /// Byte offset in the ring image.
    pub ring_offset: usize,
    pub width: u8,
    pub encoding: encode::Encoding,
}

/// Lay `wqes` out on a ring of `ring.len() / 64` WQEBBs, starting at producer index `start`,
/// for send queue `sq_qpn`. Bytes outside the written WQEBBs are left untouched.
pub fn lay_out<const N: usize>(
    wqes: &[Wqe],
    sq_qpn: u32,
    start: WqeIndex,
    ring: &mut [u8],
    resolver: &mut impl QueueResolver,
) -> Result<Mlx5Layout<N>, Mlx5Error> {
    let ring_wqebbs = ring.len() / WQEBB;
    if !ring.len().is_multiple_of(WQEBB) || !ring_wqebbs.is_power_of_two() || ring_wqebbs > 1 << 15 {
        return Err(Mlx5Error::BadRingSize(ring_wqebbs));
    }
    let mut out =
        Mlx5Layout { placements: heapless::Vec::new(), wqes: heapless::Vec::new(), ring_wqebbs, start, end: start };
    let mut pi = start;
    let mut used = 0usize;
    let mut fence_next = false;
    let full = Mlx5Error::TooManyWqes { capacity: N };
    for (i, w) in wqes.iter().enumerate() {
        let n = wqebbs(encode::ds_of(w));
        let slot = pi.slot(ring_wqebbs);
        let pad = if slot + n > ring_wqebbs { ring_wqebbs - slot } else { 0 };
        used += pad + n;
        if used > ring_wqebbs {
            return Err(Mlx5Error::RingOverflow { needed: used, ring: ring_wqebbs });
        }
        for _ in 0..pad {
            let off = pi.slot(ring_wqebbs) * WQEBB;
            ring[off..off + WQEBB].fill(0);
            ring[off..off + 16].copy_from_slice(nop(pi.get(), sq_qpn, FmCeSe::empty()).as_bytes());
            out.placements.push(Placement { canonical: None, pi, wqebbs: 1, ring_offset: off }).map_err(|_| full)?;
            out.wqes.push(Wqe::nop()).map_err(|_| full)?;
            pi = pi.add(1);
        }
        let extra = if fence_next { FmCeSe::INITIATOR_SMALL_FENCE } else { FmCeSe::empty() };
        let e = encode(w, pi, sq_qpn, extra, resolver)?;
        let off = pi.slot(ring_wqebbs) * WQEBB;
        ring[off..off + n * WQEBB].copy_from_slice(e.bytes());
        out.placements
            .push(Placement { canonical: Some(i), pi, wqebbs: n as u8, ring_offset: off })
            .map_err(|_| full)?;
        out.wqes.push(*w).map_err(|_| full)?;
        pi = pi.add(n as u16);
        fence_next = encode::is_umr(w);
    }
    out.end = pi;
    Ok(out)
}

impl<const N: usize> Mlx5Layout<N> {
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }
    /// The placement of canonical WQE `index`.
    pub fn placement(&self, index: usize) -> Option<&Placement> {
        self.placements.iter().find(|p| p.canonical == Some(index))
    }
    pub fn start(&self) -> WqeIndex {
        self.start
    }
    /// The producer index after the last WQE (what the doorbell record receives).
    pub fn end(&self) -> WqeIndex {
        self.end
    }
    /// WQEBBs the layout occupies, padding included.
    pub fn wqebbs(&self) -> u16 {
        self.end.since(self.start)
    }
    pub fn ring_wqebbs(&self) -> usize {
        self.ring_wqebbs
    }

    /// Where `field` of canonical WQE `index` lies in the ring image. `None` if `index` is not
    /// in the layout; an empty list if the field has no bytewise mlx5 form (see
    /// [`encode::Unmapped`]).
    pub fn targets(&self, index: usize, field: WqeField) -> Option<heapless::Vec<RingTarget, 2>> {
        let (k, p) = self.placements.iter().enumerate().find(|(_, p)| p.canonical == Some(index))?;
        let mut v = heapless::Vec::new();
        if let FieldMapping::Targets(ts) = encode::field_mapping(&self.wqes[k], field) {
            for Target { offset, width, encoding } in ts {
                let _ = v.push(RingTarget { ring_offset: p.ring_offset + offset, width, encoding });
            }
        }
        Some(v)
    }

    /// The same for a canonical byte offset (`index * 64 + field offset` in the canonical
    /// ring): the offset must be the start of a [`WqeField`].
    pub fn targets_at(&self, canonical_offset: usize) -> Option<heapless::Vec<RingTarget, 2>> {
        let index = canonical_offset / WQE_SIZE;
        let within = canonical_offset % WQE_SIZE;
        let field = WqeField::ALL.into_iter().find(|f| f.offset() == within)?;
        self.targets(index, field)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::AccessFlags;
    use crate::mlx5::ctrl::CtrlSeg;
    use crate::mlx5::opcode;
    use crate::mlx5::wqebb::WqeIndex;
    use crate::wqe::QueueSel;
    use zerocopy::FromBytes;

    struct Fixed;
    impl QueueResolver for Fixed {
        fn cqn(&self, qpn: u32, _q: QueueSel) -> Option<u32> {
            Some(qpn + 0x100)
        }
        fn enable_index(&mut self, _qpn: u32, _q: QueueSel, count: u64) -> Option<WqeIndex> {
            Some(WqeIndex::new(count as u16))
        }
    }

    fn ctrl_at(ring: &[u8], off: usize) -> CtrlSeg {
        CtrlSeg::read_from_bytes(&ring[off..off + 16]).unwrap()
    }

    fn chain() -> [Wqe; 4] {
        [
            Wqe::read(0x1000, 1, 8, 0x2000, 2),
            Wqe::bind_mw(0x0000_0105, 0x7000, 4096, 0x77, 0x42, AccessFlags::DATA_WINDOW),
            Wqe::write(0x1000, 1, 8, 0x3000, 3),
            Wqe::wait(5, QueueSel::Recv, 1),
        ]
    }

    #[test]
    fn wrap_padding_keeps_wqes_contiguous() {
        // 8-WQEBB ring, start at slot 6: READ at 6, the 3-WQEBB bind cannot fit in slot 7 →
        // one NOP at 7, bind at 0..3, WRITE at 3 (fenced after the UMR), WAIT at 4.
        let mut ring = [0xEEu8; 8 * 64];
        let l: Mlx5Layout<8> = lay_out(&chain(), 0x99, WqeIndex::new(0xFFFE), &mut ring, &mut Fixed).unwrap();
        let p = l.placements();
        assert_eq!(p.len(), 5);
        assert_eq!((p[0].canonical, p[0].ring_offset, p[0].pi.get()), (Some(0), 6 * 64, 0xFFFE));
        assert_eq!((p[1].canonical, p[1].ring_offset, p[1].pi.get()), (None, 7 * 64, 0xFFFF));
        assert_eq!((p[2].canonical, p[2].ring_offset, p[2].pi.get(), p[2].wqebbs), (Some(1), 0, 0, 3));
        assert_eq!((p[3].canonical, p[3].ring_offset, p[3].pi.get()), (Some(2), 3 * 64, 3));
        assert_eq!((p[4].canonical, p[4].ring_offset, p[4].pi.get()), (Some(3), 4 * 64, 4));
        assert_eq!(l.end().get(), 5);
        assert_eq!(l.wqebbs(), 7);
        let nop = ctrl_at(&ring, 7 * 64);
        assert_eq!((nop.opcode(), nop.ds(), nop.wqe_index()), (opcode::NOP, 1, 0xFFFF));
        let bind = ctrl_at(&ring, 0);
        assert_eq!((bind.opcode(), bind.ds(), bind.wqe_index()), (opcode::UMR, 12, 0));
        let wr = ctrl_at(&ring, 3 * 64);
        assert_eq!(wr.opcode(), opcode::RDMA_WRITE);
        assert_eq!(wr.fm_ce_se & FmCeSe::INITIATOR_SMALL_FENCE.bits(), FmCeSe::INITIATOR_SMALL_FENCE.bits());
        // untouched bytes stay untouched
        assert!(ring[5 * 64..6 * 64].iter().all(|b| *b == 0xEE));
    }

    #[test]
    fn patch_map_points_into_the_ring() {
        let mut ring = [0u8; 8 * 64];
        let l: Mlx5Layout<8> = lay_out(&chain(), 0x99, WqeIndex::new(0xFFFE), &mut ring, &mut Fixed).unwrap();
        // the bind's QPN: bytes 0..3 of qpn_mkey in the mkey context (ring offset 0 + 64 + 4)
        let t = l.targets(1, WqeField::Qpn).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!((t[0].ring_offset, t[0].width), (68, 3));
        assert_eq!(&ring[68..71], &[0, 0, 0x42]);
        // by canonical offset: WQE 1's imm (64 + 4) → ctrl imm and the key byte
        let t = l.targets_at(64 + 4).unwrap();
        assert_eq!(t.iter().map(|t| (t.ring_offset, t.width)).collect::<heapless::Vec<_, 2>>(), [(12, 4), (71, 1)]);
        assert_eq!(&ring[12..16], &0x0000_0105u32.to_be_bytes());
        assert_eq!(ring[71], 0x05);
        // the READ's remote address, at slot 6
        let t = l.targets(0, WqeField::RemoteAddr).unwrap();
        assert_eq!((t[0].ring_offset, t[0].width), (6 * 64 + 16, 8));
        assert_eq!(&ring[6 * 64 + 16..6 * 64 + 24], &0x2000u64.to_be_bytes());
        // wr_id has no mlx5 bytes; an offset inside a field is not a field start
        assert!(l.targets(0, WqeField::WrId).unwrap().is_empty());
        assert!(l.targets_at(64 + 5).is_none());
        assert!(l.targets(9, WqeField::Imm).is_none());
    }

    #[test]
    fn overflow_and_bad_rings_are_errors() {
        let mut small = [0u8; 4 * 64];
        let r: Result<Mlx5Layout<8>, _> = lay_out(&chain(), 1, WqeIndex::new(0), &mut small, &mut Fixed);
        assert!(matches!(r, Err(Mlx5Error::RingOverflow { .. })));
        let mut odd = [0u8; 3 * 64];
        let r: Result<Mlx5Layout<8>, _> = lay_out(&chain(), 1, WqeIndex::new(0), &mut odd, &mut Fixed);
        assert_eq!(r.unwrap_err(), Mlx5Error::BadRingSize(3));
        let mut ring = [0u8; 16 * 64];
        let r: Result<Mlx5Layout<2>, _> = lay_out(&chain(), 1, WqeIndex::new(0), &mut ring, &mut Fixed);
        assert_eq!(r.unwrap_err(), Mlx5Error::TooManyWqes { capacity: 2 });
    }

    mod prop {
        use super::*;
        use crate::mlx5::encode::{ds_of, field_mapping, Encoding};
        use crate::mlx5::umr::MkeyAccess;
        use crate::mlx5::wqebb::wqebbs;
        use proptest::prelude::*;

        fn wqe() -> impl Strategy<Value = Wqe> {
            let a = any::<u64>();
            let k = any::<u32>();
            let q = 0u32..(1 << 24);
            prop_oneof![
                Just(Wqe::nop()),
                (a, k, 0u32..4096, a, k).prop_map(|(l, lk, n, r, rk)| Wqe::read(l, lk, n, r, rk)),
                (a, k, 1u32..4096, a, k, k).prop_map(|(l, lk, n, r, rk, i)| Wqe::write_imm(l, lk, n, r, rk, i)),
                (a, k, a, k, a, a).prop_map(|(l, lk, r, rk, x, b)| Wqe::masked_fetch_add(l, lk, r & !7, rk, x, b)),
                (k, a, 1u32..(1 << 31), k, q.clone()).prop_map(|(rk, ad, n, lk, qp)| Wqe::bind_mw(
                    rk,
                    ad,
                    n,
                    lk,
                    qp,
                    AccessFlags::DATA_WINDOW
                )),
                k.prop_map(Wqe::local_inv),
                k.prop_map(Wqe::unbind_mw),
                (q.clone(), a).prop_map(|(qp, c)| Wqe::wait(qp, QueueSel::Recv, c)),
                (q, 0u64..1000).prop_map(|(qp, c)| Wqe::enable(qp, QueueSel::Send, c)),
            ]
        }

        fn read_be(b: &[u8]) -> u64 {
            b.iter().fold(0u64, |a, x| (a << 8) | *x as u64)
        }

        proptest! {
            #[test]
            fn layouts_are_contiguous_ordered_and_patchable(
                wqes in proptest::collection::vec(wqe(), 0..12),
                log_ring in 3u32..7,
                start in any::<u16>(),
            ) {
                let n = 1usize << log_ring;
                let mut ring = std::vec![0u8; n * 64];
                let need: usize = wqes.iter().map(|w| wqebbs(ds_of(w))).sum();
                let r: Result<Mlx5Layout<64>, _> = lay_out(&wqes, 0x99, WqeIndex::new(start), &mut ring, &mut Fixed);
                let l = match r {
                    Err(Mlx5Error::RingOverflow { needed, ring }) => {
                        // one pass wraps at most once and pads fewer than 3 WQEBBs
                        prop_assert!(needed > ring && ring == n && need + 2 > n);
                        return Ok(());
                    }
                    Err(e) => return Err(TestCaseError::fail(std::format!("{e}"))),
                    Ok(l) => l,
                };
                prop_assert!(l.wqebbs() as usize <= n);
                let mut pi = WqeIndex::new(start);
                let mut next = 0usize;
                for p in l.placements() {
                    prop_assert_eq!(p.pi, pi);
                    let slot = p.pi.slot(n);
                    prop_assert_eq!(p.ring_offset, slot * 64);
                    prop_assert!(slot + p.wqebbs as usize <= n, "a WQE crosses the ring end");
                    let c = ctrl_at(&ring, p.ring_offset);
                    prop_assert_eq!(c.wqe_index(), p.pi.get());
                    match p.canonical {
                        None => prop_assert_eq!((c.opcode(), c.ds()), (opcode::NOP, 1)),
                        Some(i) => {
                            prop_assert_eq!(i, next);
                            next += 1;
                            prop_assert_eq!(c.ds(), ds_of(&wqes[i]));
                            prop_assert_eq!(p.wqebbs as usize, wqebbs(c.ds()));
                        }
                    }
                    pi = pi.add(p.wqebbs as u16);
                }
                prop_assert_eq!(next, wqes.len());
                prop_assert_eq!(l.end(), pi);
                // every mapped field reads back its canonical value from the ring bytes
                for (i, w) in wqes.iter().enumerate() {
                    let canon = w.to_bytes();
                    let cb = zerocopy::IntoBytes::as_bytes(&canon);
                    for f in WqeField::ALL {
                        let ts = l.targets(i, f).unwrap();
                        prop_assert_eq!(ts.is_empty(), !matches!(field_mapping(w, f), crate::mlx5::encode::FieldMapping::Targets(_)));
                        let v = if f.width() == 4 {
                            u32::from_le_bytes(cb[f.offset()..f.offset() + 4].try_into().unwrap()) as u64
                        } else {
                            u64::from_le_bytes(cb[f.offset()..f.offset() + 8].try_into().unwrap())
                        };
                        for t in ts {
                            let got = read_be(&ring[t.ring_offset..t.ring_offset + t.width as usize]);
                            let want = match t.encoding {
                                Encoding::BigEndian { value_bits: 64 } => v,
                                Encoding::BigEndian { value_bits } => v & ((1u64 << value_bits) - 1),
                                Encoding::MkeyAccess => MkeyAccess::from_verbs(AccessFlags::from_bits_truncate(v as u32)).bits() as u64,
                            };
                            let want = if t.width < 8 { want & ((1u64 << (8 * t.width as u32)) - 1) } else { want };
                            prop_assert_eq!(got, want, "WQE {} {:?} field {:?}", i, w.opcode, f);
                        }
                    }
                }
            }
        }
    }
}
