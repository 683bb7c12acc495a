//! The NIC fetching the mlx5 form: managed rings whose bytes are ConnectX WQEBBs
//! ([`crate::NicConfig::wqe_format`]), decoded with `omw_core::mlx5::decode` and translated
//! into the model's own operations — the executor is the canonical one, only fetching differs.
//!
//! What the translation carries over in the device's terms:
//! - send indices count WQEBBs; a WQE of *n* WQEBBs advances the consumer by *n*;
//! - WAIT names a CQ number and a 24-bit producer index: the CQ is the host's object of that
//!   number (a model-made QP's own CQs are numbered `qpn << 1 | queue`), and the index is
//!   unwrapped against the CQ's count (a WAIT is satisfied once the count has reached it modulo
//!   2^24, looking at most 2^23 ahead);
//! - SEND_EN / RECV_EN name an absolute 16-bit index: the target queue's limit moves up to it
//!   (forward, modulo 2^16);
//! - a scatter READ lands its bytes over its data segments in order, each checked like a local
//!   SGE;
//! - UMR binds and invalidations become the model's BIND_MW (to the UMR's QPN) and LOCAL_INV
//!   (`CHECK_QPN`: the bound-QP check) or the management unbind (no check);
//! - a receive WQE is up to [`RQ_SGES`] data segments, ended by one with the invalid lkey
//!   (rdma-core `mlx5_post_recv`);
//! - mlx5 keeps no wr_id in a WQE: completions report the wr_id armed for the WQE's index.
//!
//! - prefetching (`NicConfig::prefetch`) caches whole WQEs' WQEBBs up to the enable limit,
//!   stopping after a WAIT not yet satisfied, as for the canonical form; a WQE runs from the
//!   bytes cached, so a patch landing after the fetch is missed, as on a NIC.
//!
//! The CQE format is not the model's business: its completions are its own; the ConnectX double
//! (`omw-cx-double`) writes them as mlx5 CQEs.

use crate::error::LoopbackError;
use crate::fabric::{Fabric, QpAddr};
pub use crate::qp::{BindForm, HeadForm};
use omw_core::chain::mlx5::{Mlx5Chain, RecvSge};
use omw_core::device::behaviour::{SendEnUnit, WaitPrefetch};
use omw_core::mlx5::decode::{decode, Mlx5Op};
use omw_core::mlx5::wqebb::{wqebbs, CqIndex, MAX_WQEBBS, WQEBB};
use omw_core::wire::wqe::{QueueSel, Sge, Wqe, WqeFlags};

type Result<T> = core::result::Result<T, LoopbackError>;

pub use crate::qp::{MLX5_RQ_SGES as RQ_SGES, MLX5_RQ_STRIDE as RQ_STRIDE};
/// `MLX5_INVALID_LKEY` (rdma-core providers/mlx5/mlx5.h): ends a receive WQE's scatter list.
const INVALID_LKEY: u32 = 0x100;

/// A WQE as fetched: the model's operation, its width, and a scatter READ's buffers.
pub(crate) struct Fetched {
    pub wqe: Option<Wqe>,
    pub wqebbs: u64,
    pub scatter: Vec<Sge>,
    pub form: HeadForm,
}

/// The rights a window's mkey context can carry.
const MKEY_RIGHTS: u8 = omw_core::mlx5::umr::MkeyAccess::LOCAL_WRITE.bits()
    | omw_core::mlx5::umr::MkeyAccess::REMOTE_READ.bits()
    | omw_core::mlx5::umr::MkeyAccess::REMOTE_WRITE.bits()
    | omw_core::mlx5::umr::MkeyAccess::ATOMIC.bits();

/// The mkey context of a UMR bind (after the control and UMR control segments): the window's
/// own start, length and access byte, which `decode` does not report.
fn mkey_context(bytes: &[u8]) -> Option<omw_core::mlx5::umr::MkeyContextSeg> {
    use zerocopy::FromBytes;
    let at = omw_core::mlx5::ctrl::CTRL_SEG_SIZE + omw_core::mlx5::umr::UMR_CTRL_SEG_SIZE;
    let b = bytes.get(at..at + omw_core::mlx5::umr::MKEY_CONTEXT_SEG_SIZE)?;
    omw_core::mlx5::umr::MkeyContextSeg::read_from_bytes(b).ok()
}

/// A consumed receive WQE.
pub(crate) struct Recv {
    pub wr_id: u64,
    pub sges: Vec<Sge>,
}

impl Recv {
    pub fn total_len(&self) -> u64 {
        self.sges.iter().map(|s| s.length as u64).sum()
    }
}

/// `struct mlx5_wqe_data_seg` (`omw_core::mlx5::data`): BE32 byte_count, BE32 lkey, BE64 addr.
fn data_seg(out: &mut [u8], len: u32, lkey: u32, addr: u64) {
    out[0..4].copy_from_slice(&len.to_be_bytes());
    out[4..8].copy_from_slice(&lkey.to_be_bytes());
    out[8..16].copy_from_slice(&addr.to_be_bytes());
}

impl Fabric {
    /// The CQ number of a QP's queue as an mlx5 WAIT names it.
    pub fn cq_number(&self, qp: QpAddr, queue: QueueSel) -> Result<u32> {
        let g = self.gq(qp)?;
        Ok(self.cq_of(g, queue).number)
    }

    /// A WAIT on CQ `cqn` of host `h` for producer index `pi`: the CQ (fabric-wide index) and
    /// the count it waits for — the count at which the CQ reaches `pi` modulo 2^24, looking at
    /// most 2^23 ahead.
    pub(crate) fn mlx5_wait(&self, h: u32, cqn: u32, pi: CqIndex) -> (Option<u32>, u64) {
        let Some(c) = self.cq_by_number(h, cqn) else { return (None, 0) };
        let count = self.cqs[c as usize].count;
        let d = (pi.get().wrapping_sub(count as u32) & CqIndex::MASK) as u64;
        (Some(c), if d < 1 << 23 { count + d } else { count.saturating_sub((1 << 24) - d) })
    }

    /// Take an armed mlx5 chain's rings as posted: their bytes are in the ring arena already
    /// (the core writes them); record each WQEBB's wr_id, let each ring run to the chain's
    /// first enable index (the doorbell), post `recv_copies` RECVs.
    pub fn arm_mlx5(&mut self, qps: [QpAddr; 2], chain: &Mlx5Chain, recv_copies: u32) -> Result<()> {
        for (r, ring) in [omw_core::chain::Ring::Loop, omw_core::chain::Ring::Mgmt].into_iter().enumerate() {
            let g = self.gq(qps[r])?;
            let q = &mut self.qps[g as usize];
            let want = chain.ring_wqebbs(ring);
            if !q.mlx5 || !q.sq.managed || q.sq.depth as usize != want {
                return Err(LoopbackError::BadArgument("mlx5 chain QPs need managed mlx5 rings of the chain's WQEBBs"));
            }
            for (k, p) in chain.placed[r].iter().enumerate() {
                for j in 0..p.wqebbs as usize {
                    if let Some(w) = q.sq_wr_ids.get_mut(p.pi as usize + j) {
                        *w = chain.wr_id_of(ring, k);
                    }
                }
            }
            q.sq.producer = q.sq.depth as u64;
            q.sq.limit = chain.initial_index[r] as u64;
            self.activate(g);
        }
        let wr_id = omw_core::chain::builder::chain_wr_id(chain.kind, 0, 0xFF);
        // the receives are posted through the doorbell record only, as `DevxBackend` arms
        // them: DEVX has no host-side RECV_EN (docs/MLX5.md question 16), so a device that
        // makes receives available only by RECV_EN (`RecvEnable::RecvEnOnly`) lands the first
        // request only if the chain itself enables it
        for _ in 0..recv_copies.max(1) {
            self.post_recv_mlx5(qps[1], wr_id, &chain.recv)?;
        }
        // a chain that publishes its receives: the record says how many are available, from
        // the arm's count on (the posts above only filled the slots)
        if let Some(n) = chain.published_at_arm() {
            let g = self.gq(qps[1])?;
            let record = self.qps[g as usize]
                .rq_doorbell
                .ok_or(LoopbackError::BadArgument("the chain publishes its receives; its QP keeps no record"))?;
            self.write(qps[1].host, record, &u32::from(n).to_be_bytes())?;
        }
        Ok(())
    }

    /// Post a receive WQE in mlx5 form (data segments, then the invalid-lkey terminator).
    pub fn post_recv_mlx5(&mut self, qp: QpAddr, wr_id: u64, sges: &[RecvSge]) -> Result<()> {
        if sges.len() > RQ_SGES {
            return Err(LoopbackError::BadArgument("more scatter entries than an mlx5 receive WQE holds"));
        }
        let g = self.gq(qp)?;
        let q = &mut self.qps[g as usize];
        if !q.mlx5 {
            return Err(LoopbackError::BadArgument("not an mlx5-form queue"));
        }
        if !q.rq.has_room() {
            return Err(LoopbackError::RingFull { host: qp.host, qpn: qp.qpn.get(), queue: QueueSel::Recv });
        }
        q.rq.producer = q.rq.producer.max(q.rq.consumer);
        let slot = (q.rq.producer % q.rq.depth as u64) as usize;
        let addr = q.rq.slot_addr(q.rq.producer);
        q.rq.producer += 1;
        if let Some(w) = q.rq_wr_ids.get_mut(slot) {
            *w = wr_id;
        }
        let mut bytes = vec![0u8; RQ_STRIDE as usize];
        for (k, s) in sges.iter().enumerate() {
            data_seg(&mut bytes[16 * k..16 * k + 16], s.length, s.lkey, s.addr);
        }
        if sges.len() < RQ_SGES {
            let k = sges.len();
            data_seg(&mut bytes[16 * k..16 * k + 16], 0, INVALID_LKEY, 0);
        }
        let err = q.state == omw_core::device::QpState::Err;
        let h = q.host as usize;
        self.hosts[h].mem.write(addr, &bytes);
        if err {
            self.flush_recvs(g);
        }
        Ok(())
    }

    /// The head WQE of mlx5 QP `g`, fetched from its ring and translated (`wqe: None`: the bytes
    /// do not decode).
    pub(crate) fn mlx5_head(&self, g: u32) -> Fetched {
        let q = &self.qps[g as usize];
        let slot = (q.sq.consumer % q.sq.depth as u64) as usize;
        let wr_id = self.mlx5_send_wr_id(g);
        let addr = q.sq.slot_addr(q.sq.consumer);
        // a WQE never crosses the ring's end (wrap padding): read at most to the end
        let room = (q.sq.depth as usize - slot).min(MAX_WQEBBS) * WQEBB;
        let mut cached = Vec::new();
        let bytes = if q.pf.len > 0 {
            // prefetched: the bytes as they were when fetched
            for i in 0..q.pf.len.min(MAX_WQEBBS) {
                cached.extend_from_slice(q.pf.get(i).map_or(&[0u8; WQEBB][..], |b| &b[..]));
            }
            &cached[..]
        } else {
            self.hosts[q.host as usize].mem.slice(addr, room as u64).unwrap_or(&[])
        };
        let width = bytes.get(7).map_or(1, |ds| wqebbs(ds & 0x3F).max(1) as u64);
        let mut form = HeadForm::default();
        let bad = Fetched { wqe: None, wqebbs: width, scatter: Vec::new(), form };
        let Ok(d) = decode(bytes) else { return bad };
        let mut flags = WqeFlags::empty();
        use omw_core::mlx5::ctrl::CeSe;
        flags.set(WqeFlags::SIGNALED, d.fm_ce_se.signaled());
        flags.set(WqeFlags::FENCE, d.fm_ce_se.fence.fences_reads_and_atomics());
        flags.set(WqeFlags::SOLICITED, d.fm_ce_se.flags.contains(CeSe::SOLICITED));
        let mut scatter = Vec::new();
        let local = |l: Option<omw_core::mlx5::decode::Local>| l.unwrap_or_default();
        let w = match d.op {
            Mlx5Op::Nop => Wqe::nop(),
            Mlx5Op::Send { local: l, imm } => {
                let l = local(l);
                let mut w = Wqe::send(l.addr, l.lkey, l.length);
                if let Some(i) = imm {
                    w.opcode = omw_core::wire::wqe::Opcode::SendWithImm;
                    w.imm = i;
                }
                w
            }
            Mlx5Op::SendInv { local: l, rkey } => {
                let l = local(l);
                Wqe::send_with_inv(l.addr, l.lkey, l.length, rkey)
            }
            Mlx5Op::Write { remote, rkey, local: l, imm } => {
                let l = local(l);
                match imm {
                    Some(i) => Wqe::write_imm(l.addr, l.lkey, l.length, remote, rkey, i),
                    None => Wqe::write(l.addr, l.lkey, l.length, remote, rkey),
                }
            }
            Mlx5Op::Read { remote, rkey, local: l } => {
                let l = local(l);
                Wqe::read(l.addr, l.lkey, l.length, remote, rkey)
            }
            Mlx5Op::ScatterRead { remote, rkey, sges } => {
                scatter =
                    sges.as_slice().iter().map(|l| Sge { addr: l.addr, length: l.length, lkey: l.lkey }).collect();
                let total: u32 = scatter.iter().map(|s| s.length).sum();
                let first = scatter.first().copied().unwrap_or_default();
                Wqe::read(first.addr, first.lkey, total, remote, rkey)
            }
            Mlx5Op::FetchAdd { remote, rkey, local: l, add } => Wqe::fetch_add(l.addr, l.lkey, remote, rkey, add),
            Mlx5Op::MaskedFetchAdd { remote, rkey, local: l, add, boundary } => {
                Wqe::masked_fetch_add(l.addr, l.lkey, remote, rkey, add, boundary)
            }
            Mlx5Op::CompareSwap { remote, rkey, local: l, compare, swap } => {
                Wqe::compare_swap(l.addr, l.lkey, remote, rkey, compare, swap)
            }
            // rdma-core's layout: the window is found by the index of the key it holds (`imm`);
            // its new key byte is `qpn_mkey`'s. Whether firmware also checks `imm`'s key byte
            // is a hardware question: the model does not (docs/MLX5.md).
            Mlx5Op::Bind { mkey, new_key, addr, length, lkey, qpn, access } => {
                // the window is the mkey context's range, mapped onto the KLM's: start_addr 0
                // is a zero-based window (rdma-core `set_umr_mkey_seg`: IBV_ACCESS_ZERO_BASED)
                let (mut access, mut len) = (access, length);
                if let Some(m) = mkey_context(bytes) {
                    let (start, wlen, rights) = (m.start_addr.get(), m.len.get(), m.access_flags);
                    if rights & !MKEY_RIGHTS != 0 {
                        form.bind_refused = Some(BindForm::Rights(rights));
                    } else if start == 0 && addr != 0 {
                        access |= omw_core::access::AccessFlags::ZERO_BASED;
                    } else if start != addr {
                        form.bind_refused = Some(BindForm::Start { start, klm: addr });
                    }
                    match u32::try_from(wlen) {
                        Ok(l) if l <= length => len = l,
                        _ => {
                            form.bind_refused = form.bind_refused.or(Some(BindForm::Length { len: wlen, klm: length }))
                        }
                    }
                }
                Wqe::bind_mw((mkey & !0xFF) | new_key as u32, addr, len, lkey, qpn, access).with_current_rkey(mkey)
            }
            Mlx5Op::Invalidate { mkey, check_qpn: true } => Wqe::local_inv(mkey),
            Mlx5Op::Invalidate { mkey, check_qpn: false } => Wqe::unbind_mw(mkey),
            Mlx5Op::Wait { cqn, pi } => {
                // a CQ object, not a QP's queue: the canonical WAIT's QP field is unused
                let (cq, target) = self.mlx5_wait(q.host, cqn, pi);
                form.wait = Some((cq, target));
                Wqe::wait(0, QueueSel::Send, target)
            }
            Mlx5Op::SendEn { qpn, max_index } | Mlx5Op::RecvEn { qpn, max_index } => {
                let sel = if matches!(d.op, Mlx5Op::SendEn { .. }) { QueueSel::Send } else { QueueSel::Recv };
                // SEND_EN's index in WQEs (`SendEnUnit::Wqe`) moves the target's WQE limit
                form.enable_in_wqes = sel == QueueSel::Send && self.cfg.behaviour.send_en_unit == SendEnUnit::Wqe;
                let limit = self.resolve(q.host, qpn).map_or(0, |t| {
                    let tq = &self.qps[t as usize].queue(sel);
                    if form.enable_in_wqes {
                        tq.wqe_limit
                    } else {
                        tq.limit
                    }
                });
                let delta = max_index.get().wrapping_sub(limit as u16) as u64;
                Wqe::enable(qpn, sel, delta)
            }
        };
        let w = w.with_flags(flags | (w.flags & WqeFlags::UNBIND)).with_wr_id(wr_id);
        Fetched { wqe: Some(w), wqebbs: width, scatter, form }
    }

    /// Prefetch for mlx5 QP `g`: whole WQEs from the one after the cached ones, up to the enable
    /// limit and the cache's room — and, under `WaitPrefetch::Stops`, not past a WAIT whose CQ
    /// count has not been reached.
    pub(crate) fn mlx5_refill(&mut self, g: u32) {
        let stops = self.cfg.behaviour.wait_prefetch == WaitPrefetch::Stops;
        loop {
            let q = &self.qps[g as usize];
            if q.pf.len > 0 && stops {
                if let Some((c, count)) = q.pf_wait {
                    if !self.cqs[c as usize].reached(count, self.now) {
                        return;
                    }
                }
            }
            let next = q.sq.consumer + q.pf.len as u64;
            if next >= q.sq.consumer + q.sq.depth as u64 || !q.sq.may_fetch(next, 1, q.pf.wqes) {
                return;
            }
            let slot = (next % q.sq.depth as u64) as usize;
            let room = (q.sq.depth as usize - slot).min(MAX_WQEBBS) * WQEBB;
            let addr = q.sq.slot_addr(next);
            let mem = &self.hosts[q.host as usize].mem;
            let Some(bytes) = mem.slice(addr, room as u64) else { return };
            let width = bytes.get(7).map_or(1, |ds| wqebbs(ds & 0x3F).max(1));
            if !q.sq.may_fetch(next, width as u64, q.pf.wqes)
                || next + width as u64 > q.sq.consumer + q.sq.depth as u64
                || q.pf.len + width > q.pf.cap()
                || width * WQEBB > bytes.len()
            {
                return;
            }
            let wait = match decode(bytes).map(|d| d.op) {
                Ok(Mlx5Op::Wait { cqn, pi }) => match self.mlx5_wait(q.host, cqn, pi) {
                    (Some(c), count) => Some((c, count)),
                    (None, _) => None,
                },
                _ => None,
            };
            let mut blocks = [[0u8; WQEBB]; MAX_WQEBBS];
            for (k, b) in blocks.iter_mut().enumerate().take(width) {
                b.copy_from_slice(&bytes[k * WQEBB..(k + 1) * WQEBB]);
            }
            let q = &mut self.qps[g as usize];
            for b in blocks.iter().take(width) {
                *q.pf.push_slot() = *b;
            }
            q.pf.wqes += 1;
            q.pf_wait = wait;
        }
    }

    /// The wr_id a completion of the head send WQE of mlx5 QP `g` reports: the one armed for
    /// its index, or (a QP on a device's terms) the index itself, as a CQE's `wqe_counter`.
    pub(crate) fn mlx5_send_wr_id(&self, g: u32) -> u64 {
        let q = &self.qps[g as usize];
        if q.index_wr_ids {
            return q.sq.consumer & 0xFFFF;
        }
        q.sq_wr_ids.get((q.sq.consumer % q.sq.depth as u64) as usize).copied().unwrap_or(0)
    }

    /// Consume the next receive WQE of mlx5 QP `p` (data segments up to its stride, ended by
    /// the invalid lkey). `Err(wr_id)` if its bytes cannot be read.
    pub(crate) fn mlx5_take_recv(&mut self, p: u32) -> core::result::Result<Recv, u64> {
        let wr_id = self.mlx5_recv_wr_id(p);
        let q = &mut self.qps[p as usize];
        let (addr, stride) = (q.rq.slot_addr(q.rq.consumer), q.rq.stride);
        q.rq.consumer += 1;
        let Some(b) = self.hosts[q.host as usize].mem.slice(addr, stride as u64) else {
            return Err(wr_id);
        };
        let mut sges = Vec::new();
        for k in 0..stride as usize / 16 {
            let d = &b[16 * k..16 * k + 16];
            let be32 = |o: usize| u32::from_be_bytes([d[o], d[o + 1], d[o + 2], d[o + 3]]);
            let lkey = be32(4);
            if lkey == INVALID_LKEY {
                break;
            }
            let addr = (be32(8) as u64) << 32 | be32(12) as u64;
            sges.push(Sge { addr, length: be32(0), lkey });
        }
        Ok(Recv { wr_id, sges })
    }

    /// The wr_id the head receive WQE of mlx5 QP `g` was posted with (its index, on a device's
    /// terms).
    pub(crate) fn mlx5_recv_wr_id(&self, g: u32) -> u64 {
        let q = &self.qps[g as usize];
        if q.index_wr_ids {
            return q.rq.consumer & 0xFFFF;
        }
        q.rq_wr_ids.get((q.rq.consumer % q.rq.depth as u64) as usize).copied().unwrap_or(0)
    }
}
