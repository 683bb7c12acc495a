//! The host engine: runs one lap of a chain layout on the MN CPU (portable mode).
//!
//! For devices without WAIT/ENABLE and self-modifying WQEs (every upstream rdma-core device)
//! the MN executes the *same* layout the NIC would: it applies the RECV scatter to the request
//! bytes itself, performs the loop-QP memory operations (READs, WRITEs, atomics on its own
//! tables) with the same MR checks the NIC would make, patches its private copy of the WQEs,
//! and posts only what needs the device — binds, invalidations, the reply — one at a time,
//! waiting for each completion. WAIT and ENABLE are satisfied by the sequential order; lap
//! bumps are irrelevant because every lap starts from the template again.
//!
//! Two checks exist only here, because real devices do not make them: the ownership check on
//! free compares the MWTable owner with the requesting CN (soft-RoCE lets any QP invalidate a
//! type-2 window), and QP numbers a request asks windows to be bound to must be the
//! requester's own access QPs.

use crate::chain::{ChainKind, ChainLayout, Loc, Ring, MAX_STEPS};
use crate::device::{Completion, RdmaBackend, WcStatus};
use crate::ids::{CnId, Qpn};
use crate::wire::memory_map::{alloc_scratch, free_scratch, ALLOC_SCRATCH_OFF, FREE_SCRATCH_OFF};
use crate::wire::mwtable::{ENTRY_OFF_OWNER, ENTRY_SIZE};
use crate::wire::wqe::{masked_add, Opcode, QueueSel, Wqe, WqeFlags, WQE_SIZE};
use core::fmt;

/// The memory regions the loop QP would reach, with their keys, so the engine refuses
/// exactly what the NIC would refuse (e.g. an entry address outside the MWTable).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct HostRegions {
    pub meta_base: u64,
    pub meta_len: u64,
    pub meta_lkey: u32,
    pub meta_rkey: u32,
    pub table_base: u64,
    pub table_len: u64,
    pub table_rkey: u32,
    pub ring_lkey: u32,
    pub ring_rkey: u32,
    /// Local-only key of the metadata in the CN-facing domain: what WQEs and receives on
    /// CN-facing QPs (messages, host-engine request buffers) use.
    pub cn_meta_lkey: u32,
}

#[derive(Clone, Copy, Debug)]
pub struct LapContext<'a> {
    pub requester: CnId,
    /// The requester's scratch area (its connection slot's).
    pub scratch: u64,
    /// MN ends of the requester's access QPs: request-supplied bind targets must be among them.
    pub access_qpns: &'a [Qpn],
    /// MN end of the requester's Free QP (where MW\[0\] is bound).
    pub free_qpn: Qpn,
    /// Compare the MWTable owner with the requester before the ownership-proving invalidate.
    pub software_ownership_check: bool,
    /// Polls of an empty CQ before a posted step counts as never completing (the lap then
    /// fails with [`LapFailure::Timeout`]: the deadline that keeps one stalled CN from holding
    /// the MN).
    pub max_polls: u32,
    /// The pool: a bind must cover exactly one chunk of it (defence in depth against a
    /// corrupted MWTable entry; the NIC would bind whatever span the entry says).
    pub geometry: crate::geometry::PoolGeometry,
    /// Where the MWTable starts: the lap's popped entry address names its group, and with it
    /// the one chunk that group's windows may cover.
    pub table_base: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum LapFailure {
    /// The request was longer than the RECV scatter list.
    RequestTooLong,
    /// A WQE (after patching) does not decode.
    MalformedWqe,
    /// The device (or the engine's MR check) completed a step with an error.
    Status(WcStatus),
    /// Software ownership check: the requester does not own the group.
    NotOwner,
    /// The request asked for a window on a QP that is not the requester's.
    ForeignQpn(u32),
    /// A bind's span (from the MWTable entry) is not exactly the chunk of the group the lap
    /// popped.
    BadSpan,
    /// A posted step did not complete within the lap's budget: the CN on the other end is not
    /// answering (the MN evicts it; the lap never blocks the MN for longer than the budget).
    Timeout,
}

impl LapFailure {
    /// The CN on the other end is not answering: the device's transport gave up on a step
    /// (retries or RNR retries exhausted), or a host-engine step ran out of its budget.
    pub const fn unresponsive(self) -> bool {
        matches!(self, LapFailure::Timeout | LapFailure::Status(WcStatus::RetryExcErr | WcStatus::RnrRetryExcErr))
    }
    /// The request did not fit the chain's receive (the NIC completes that RECV with a local
    /// length error).
    pub const fn request_too_long(self) -> bool {
        matches!(self, LapFailure::RequestTooLong | LapFailure::Status(WcStatus::LocLenErr))
    }
    /// The requester proved it does not own the group: its free's invalidation of MW\[0\] on its
    /// own Free QP was refused by the NIC (a bind error), or the host engine's software
    /// ownership check said so.
    pub const fn not_owner(self) -> bool {
        matches!(self, LapFailure::NotOwner | LapFailure::Status(WcStatus::MwBindErr))
    }
    /// The `detail` an [`ErrorReply`](crate::wire::message::ErrorReply) carries to the CN: the
    /// `ibv_wc_status` number the step completed with; for a finding of the host engine's own
    /// checks, the status the NIC reports for the same condition (so a CN reads one code
    /// whichever mode the MN runs).
    pub const fn wire_detail(self) -> u32 {
        let s = match self {
            LapFailure::Status(s) => s,
            LapFailure::NotOwner => WcStatus::MwBindErr,
            LapFailure::RequestTooLong => WcStatus::LocLenErr,
            LapFailure::MalformedWqe | LapFailure::ForeignQpn(_) => WcStatus::LocQpOpErr,
            LapFailure::Timeout => WcStatus::RetryExcErr,
            LapFailure::BadSpan => WcStatus::LocProtErr,
        };
        s as u32
    }
}

/// One change of an MWTable entry's owner field made by a lap's own memory operation (its
/// write-back): the MN's per-CN held counts follow every such change, committed or not, so
/// they stay exact without scanning the table (`MemoryNode::account_owner_write`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct OwnerWrite {
    /// The entry's address.
    pub entry: u64,
    /// Owner before the lap's first write of it, and after its last.
    pub from: u32,
    pub to: u32,
}

/// Most MWTable entries one lap writes back: the alloc and free chains write one each; room
/// for a layout that writes two (a group popped ahead) with margin.
pub const MAX_OWNER_WRITES: usize = 4;

/// The owner changes of one lap, merged per entry (first `from`, last `to`).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct OwnerWrites {
    n: u8,
    w: [Option<OwnerWrite>; MAX_OWNER_WRITES],
}

impl OwnerWrites {
    pub const NONE: OwnerWrites = OwnerWrites { n: 0, w: [None; MAX_OWNER_WRITES] };

    /// Changes that did not come back to where they started.
    pub fn iter(&self) -> impl Iterator<Item = OwnerWrite> + '_ {
        self.w.iter().flatten().copied().filter(|w| w.from != w.to)
    }

    fn record(&mut self, entry: u64, from: u32, to: u32) {
        if let Some(w) = self.w.iter_mut().flatten().find(|w| w.entry == entry) {
            w.to = to;
            return;
        }
        // a layout's laps write back a fixed, small number of entries (MAX_OWNER_WRITES
        // bounds every layout the builders make; `chain::tests` would show a new one)
        debug_assert!((self.n as usize) < MAX_OWNER_WRITES, "a lap writes back at most MAX_OWNER_WRITES entries");
        if let Some(slot) = self.w.get_mut(self.n as usize) {
            *slot = Some(OwnerWrite { entry, from, to });
            self.n += 1;
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LapOutcome {
    Committed {
        device_ops: u32,
        cpu_steps: u32,
        /// The lap's changes of MWTable owners.
        owners: OwnerWrites,
    },
    /// `step` is None when the RECV itself failed.
    Failed {
        step: Option<u8>,
        failure: LapFailure,
        device_ops: u32,
        cpu_steps: u32,
        /// The owner changes the lap made before it failed (the MN's repair decides from the
        /// table, which already shows them).
        owners: OwnerWrites,
    },
}

impl LapOutcome {
    /// The lap's changes of MWTable owners, whatever its outcome.
    pub fn owners(&self) -> OwnerWrites {
        match self {
            LapOutcome::Committed { owners, .. } | LapOutcome::Failed { owners, .. } => *owners,
        }
    }
    fn with_owners(mut self, o: OwnerWrites) -> Self {
        match &mut self {
            LapOutcome::Committed { owners, .. } | LapOutcome::Failed { owners, .. } => *owners = o,
        }
        self
    }
}

#[derive(Debug)]
#[non_exhaustive]
pub enum HostEngineError<E> {
    Backend(E),
    /// A posted WQE never completed within the poll budget.
    Timeout {
        step: u8,
    },
}

impl<E: fmt::Display> fmt::Display for HostEngineError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostEngineError::Backend(e) => write!(f, "backend error in host engine: {e}"),
            HostEngineError::Timeout { step } => write!(f, "step {step} posted but never completed"),
        }
    }
}

impl HostRegions {
    /// The regions of an MN's memory map with its registration keys.
    pub fn new(map: &crate::wire::memory_map::MnMemoryMap, keys: &crate::mn::MnKeys) -> Self {
        HostRegions {
            meta_base: map.meta_base,
            meta_len: map.meta_len,
            meta_lkey: keys.meta_lkey,
            meta_rkey: keys.meta_rkey,
            table_base: map.table_base,
            table_len: map.table_len(),
            table_rkey: keys.table_rkey,
            ring_lkey: keys.ring_lkey,
            ring_rkey: keys.ring_rkey,
            cn_meta_lkey: keys.cn_meta_lkey,
        }
    }

    /// Which region an rkey opens, if the access fits in it.
    fn remote_ok(&self, addr: u64, len: u64, rkey: u32) -> bool {
        let (b, l) = if rkey == self.table_rkey {
            (self.table_base, self.table_len)
        } else if rkey == self.meta_rkey {
            (self.meta_base, self.meta_len)
        } else {
            return false;
        };
        addr >= b && len <= l && addr - b <= l - len
    }
    fn local_ok(&self, addr: u64, len: u64, lkey: u32) -> bool {
        lkey == self.meta_lkey
            && addr >= self.meta_base
            && len <= self.meta_len
            && addr - self.meta_base <= self.meta_len - len
    }
}

/// A step the lap posted to the device and now waits for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Waiting {
    pub qp: Qpn,
    pub wr_id: u64,
    pub step: u8,
}

/// Where a resumable lap stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Progress {
    /// A device operation is posted: call [`Lap::complete`] with its completion status (or
    /// [`Lap::timed_out`]), then [`Lap::advance`] again.
    Waiting(Waiting),
    Done(LapOutcome),
}

/// One lap of a chain layout on the MN CPU, resumable: the CPU steps run at once, each
/// device step is posted and the lap returns to its caller until the completion arrives — so
/// the driver can run laps of different CNs side by side instead of busy-waiting on one.
/// The semantics are exactly those of [`run_lap`] (which drives a `Lap` to the end).
#[derive(Clone, Debug)]
pub struct Lap {
    copies: heapless::Vec<[u8; WQE_SIZE], MAX_STEPS>,
    next: usize,
    device_ops: u32,
    cpu_steps: u32,
    waiting: Option<Waiting>,
    owners: OwnerWrites,
}

impl Lap {
    /// Apply the RECV scatter of `request` (what the NIC's receive would do). An outcome
    /// instead of a lap when the request cannot even be scattered.
    pub fn start<B: RdmaBackend>(
        backend: &mut B,
        layout: &ChainLayout,
        request: &[u8],
    ) -> Result<Result<Lap, LapOutcome>, HostEngineError<B::Error>> {
        let copies: heapless::Vec<[u8; WQE_SIZE], MAX_STEPS> = layout.steps.iter().map(|s| s.wqe.encode()).collect();
        let mut lap = Lap { copies, next: 0, device_ops: 0, cpu_steps: 1, waiting: None, owners: OwnerWrites::NONE };
        let total: u64 = layout.recv.iter().map(|r| r.len as u64).sum();
        if request.len() as u64 > total {
            return Ok(Err(LapOutcome::Failed {
                step: None,
                failure: LapFailure::RequestTooLong,
                device_ops: 0,
                cpu_steps: 1,
                owners: OwnerWrites::NONE,
            }));
        }
        let mut off = 0usize;
        for r in layout.recv.iter() {
            if off >= request.len() {
                break;
            }
            let n = (r.len as usize).min(request.len() - off);
            let data = &request[off..off + n];
            match r.loc {
                Loc::Mem(a) => backend.write_local(a, data).map_err(HostEngineError::Backend)?,
                Loc::Field { step, field } => {
                    if let Some(c) = lap.copies.get_mut(step as usize) {
                        field.patch(c, data);
                    }
                }
                // no layout scatters there (`ChainLayout::validate`)
                Loc::RecvDoorbell => {}
            }
            off += n;
        }
        Ok(Ok(lap))
    }

    /// The lap's changes of MWTable owners so far (a lap stopped part-way made them too).
    pub fn owner_writes(&self) -> OwnerWrites {
        self.owners
    }

    /// The step being waited for, if any.
    pub fn waiting(&self) -> Option<Waiting> {
        self.waiting
    }

    /// The waited-for step completed with `status`; `Some` outcome when that failed the lap.
    pub fn complete(&mut self, status: WcStatus) -> Option<LapOutcome> {
        let w = self.waiting.take()?;
        (!status.is_ok()).then_some(LapOutcome::Failed {
            step: Some(w.step),
            failure: LapFailure::Status(status),
            device_ops: self.device_ops,
            cpu_steps: self.cpu_steps,
            owners: self.owners,
        })
    }

    /// The waited-for step did not complete within the lap's budget.
    pub fn timed_out(&mut self) -> LapOutcome {
        let step = self.waiting.take().map(|w| w.step);
        LapOutcome::Failed {
            step,
            failure: LapFailure::Timeout,
            device_ops: self.device_ops,
            cpu_steps: self.cpu_steps,
            owners: self.owners,
        }
    }

    /// Run CPU steps until the next device step is posted, or the lap ends.
    pub fn advance<B: RdmaBackend>(
        &mut self,
        backend: &mut B,
        layout: &ChainLayout,
        regions: &HostRegions,
        ctx: &LapContext<'_>,
    ) -> Result<Progress, HostEngineError<B::Error>> {
        Ok(match self.run_steps(backend, layout, regions, ctx)? {
            Progress::Done(o) => Progress::Done(o.with_owners(self.owners)),
            p => p,
        })
    }

    fn run_steps<B: RdmaBackend>(
        &mut self,
        backend: &mut B,
        layout: &ChainLayout,
        regions: &HostRegions,
        ctx: &LapContext<'_>,
    ) -> Result<Progress, HostEngineError<B::Error>> {
        if let Some(w) = self.waiting {
            return Ok(Progress::Waiting(w));
        }
        let owners = &mut self.owners;
        let copies = &mut self.copies;
        let mut device_ops = self.device_ops;
        let mut cpu_steps = self.cpu_steps;
        let fail = |step: Option<u8>, failure, device_ops, cpu_steps| {
            Ok(Progress::Done(LapOutcome::Failed { step, failure, device_ops, cpu_steps, owners: OwnerWrites::NONE }))
        };
        for i in self.next..layout.steps.len() {
            let step = &layout.steps[i];
            let si = i as u8;
            let w = match Wqe::decode(&copies[i]) {
                Ok(w) => w,
                Err(_) => return fail(Some(si), LapFailure::MalformedWqe, device_ops, cpu_steps),
            };
            match w.opcode {
                Opcode::Nop | Opcode::Wait | Opcode::Enable => continue,
                _ => {}
            }
            // lap bumps rewrite WAIT counts for the NIC's next lap: meaningless here (a READ whose
            // remote side is a field copies that field out of this lap's WQE: see below)
            if matches!(step.remote, Some(Loc::Field { .. })) && w.opcode != Opcode::Read {
                continue;
            }
            // the engine posts its own receives: a publish through the doorbell record is the
            // NIC's business
            if step.remote == Some(Loc::RecvDoorbell) {
                continue;
            }
            let loop_mem_op = step.ring == Ring::Loop && (w.opcode.is_remote());
            if loop_mem_op {
                cpu_steps += 1;
                let len = w.length as u64;
                // source bytes
                let mut buf = [0u8; 64];
                let n = (w.length as usize).min(buf.len());
                match w.opcode {
                    Opcode::Read => {
                        if let Some(Loc::Field { step: t, field }) = step.remote {
                            // a ring read: the bytes of this lap's (patched) WQE
                            match copies.get(t as usize).and_then(|c| field.read_span(c, n)) {
                                Some(bytes) if n as u64 == len => buf[..n].copy_from_slice(bytes),
                                _ => {
                                    return fail(
                                        Some(si),
                                        LapFailure::Status(WcStatus::RemAccessErr),
                                        device_ops,
                                        cpu_steps,
                                    )
                                }
                            }
                        } else if !regions.remote_ok(w.remote_addr, len, w.rkey) || n as u64 != len {
                            return fail(Some(si), LapFailure::Status(WcStatus::RemAccessErr), device_ops, cpu_steps);
                        } else {
                            backend.read_local(w.remote_addr, &mut buf[..n]).map_err(HostEngineError::Backend)?;
                        }
                        match step.local {
                            Some(Loc::Field { step: t, field }) => {
                                if let Some(c) = copies.get_mut(t as usize) {
                                    field.patch(c, &buf[..n]);
                                }
                            }
                            _ => {
                                if !regions.local_ok(w.local_addr, len, w.lkey) {
                                    return fail(
                                        Some(si),
                                        LapFailure::Status(WcStatus::LocProtErr),
                                        device_ops,
                                        cpu_steps,
                                    );
                                }
                                store(backend, regions, owners, w.local_addr, &buf[..n])
                                    .map_err(HostEngineError::Backend)?;
                            }
                        }
                    }
                    Opcode::Write | Opcode::WriteWithImm => {
                        if !regions.local_ok(w.local_addr, len, w.lkey) || n as u64 != len {
                            return fail(Some(si), LapFailure::Status(WcStatus::LocProtErr), device_ops, cpu_steps);
                        }
                        if !regions.remote_ok(w.remote_addr, len, w.rkey) {
                            return fail(Some(si), LapFailure::Status(WcStatus::RemAccessErr), device_ops, cpu_steps);
                        }
                        backend.read_local(w.local_addr, &mut buf[..n]).map_err(HostEngineError::Backend)?;
                        store(backend, regions, owners, w.remote_addr, &buf[..n]).map_err(HostEngineError::Backend)?;
                    }
                    Opcode::FetchAdd | Opcode::MaskedFetchAdd | Opcode::CompareSwap => {
                        if !regions.remote_ok(w.remote_addr, 8, w.rkey) {
                            return fail(Some(si), LapFailure::Status(WcStatus::RemAccessErr), device_ops, cpu_steps);
                        }
                        let mut old = [0u8; 8];
                        backend.read_local(w.remote_addr, &mut old).map_err(HostEngineError::Backend)?;
                        let v = u64::from_le_bytes(old);
                        let new = match w.opcode {
                            Opcode::FetchAdd => v.wrapping_add(w.operand0),
                            Opcode::MaskedFetchAdd => masked_add(v, w.operand0, w.operand1),
                            _ if v == w.operand0 => w.operand1,
                            _ => v,
                        };
                        store(backend, regions, owners, w.remote_addr, &new.to_le_bytes())
                            .map_err(HostEngineError::Backend)?;
                        match step.local {
                            Some(Loc::Field { step: t, field }) => {
                                if let Some(c) = copies.get_mut(t as usize) {
                                    field.patch(c, &old);
                                }
                            }
                            _ => {
                                if !regions.local_ok(w.local_addr, 8, w.lkey) {
                                    return fail(
                                        Some(si),
                                        LapFailure::Status(WcStatus::LocProtErr),
                                        device_ops,
                                        cpu_steps,
                                    );
                                }
                                store(backend, regions, owners, w.local_addr, &old)
                                    .map_err(HostEngineError::Backend)?;
                            }
                        }
                    }
                    _ => {}
                }
                continue;
            }

            // --- device operations
            let mgmt = Qpn::new(layout.qpns[1]).map_err(|_| HostEngineError::Timeout { step: si })?;
            let qp = match w.opcode {
                Opcode::BindMw if !w.flags.contains(WqeFlags::UNBIND) => {
                    // Every window goes to one of the requester's own QPs: its access QPs (the
                    // request names them) or its Free QP (MW[0]). A request that named someone
                    // else's QP, or too few, stops here.
                    let q = match Qpn::new(w.qpn) {
                        Ok(q) if ctx.access_qpns.contains(&q) || q == ctx.free_qpn => q,
                        _ => return fail(Some(si), LapFailure::ForeignQpn(w.qpn), device_ops, cpu_steps),
                    };
                    // The span must be exactly the chunk of the group this lap popped (the
                    // geometry pairs entry i with chunk i), not merely some chunk: a corrupted
                    // or forged entry naming another group's chunk would hand it out twice.
                    let g = &ctx.geometry;
                    let popped = {
                        let mut b = [0u8; 8];
                        let at = ctx.scratch + ALLOC_SCRATCH_OFF + alloc_scratch::REPLY_ENTRY_ADDR;
                        backend.read_local(at, &mut b).map_err(HostEngineError::Backend)?;
                        u64::from_le_bytes(b)
                    };
                    let own_chunk = popped
                        .checked_sub(ctx.table_base)
                        .filter(|off| off % ENTRY_SIZE as u64 == 0)
                        .and_then(|off| u32::try_from(off / ENTRY_SIZE as u64).ok())
                        .and_then(|i| g.chunk_base(crate::ids::GroupId(i)));
                    if own_chunk != Some(w.local_addr) || w.length as u64 != g.chunk_size() {
                        return fail(Some(si), LapFailure::BadSpan, device_ops, cpu_steps);
                    }
                    q
                }
                _ => mgmt,
            };
            if layout.kind == ChainKind::Free && layout.ownership_check == Some(si) && ctx.software_ownership_check {
                let mut owner = [0u8; 4];
                let at = ctx.scratch + FREE_SCRATCH_OFF + free_scratch::ENTRY + ENTRY_OFF_OWNER;
                backend.read_local(at, &mut owner).map_err(HostEngineError::Backend)?;
                if u32::from_le_bytes(owner) != ctx.requester.get() {
                    return fail(Some(si), LapFailure::NotOwner, device_ops, cpu_steps);
                }
            }
            let w = w.with_flags(w.flags | WqeFlags::SIGNALED);
            // A device that refuses the post (its QP went away) fails the lap, not the MN.
            if backend.post_send(qp, &w).is_err() {
                return fail(Some(si), LapFailure::Status(WcStatus::LocQpOpErr), device_ops, cpu_steps);
            }
            device_ops += 1;
            let waiting = Waiting { qp, wr_id: w.wr_id, step: si };
            self.waiting = Some(waiting);
            self.next = i + 1;
            self.device_ops = device_ops;
            self.cpu_steps = cpu_steps;
            return Ok(Progress::Waiting(waiting));
        }
        self.next = layout.steps.len();
        self.device_ops = device_ops;
        self.cpu_steps = cpu_steps;
        Ok(Progress::Done(LapOutcome::Committed { device_ops, cpu_steps, owners: OwnerWrites::NONE }))
    }
}

/// A lap's write to MN memory, with any change it makes to an MWTable entry's owner field
/// recorded (the only writes of owners the MN CPU does not make itself).
fn store<B: RdmaBackend>(
    backend: &mut B,
    regions: &HostRegions,
    owners: &mut OwnerWrites,
    addr: u64,
    data: &[u8],
) -> Result<(), B::Error> {
    let (tb, tl) = (regions.table_base, regions.table_len);
    let end = addr.saturating_add(data.len() as u64);
    if data.is_empty() || end <= tb || addr >= tb.saturating_add(tl) {
        return backend.write_local(addr, data);
    }
    // the entries the write overlaps (a WQE moves at most 64 bytes: two or three entries)
    let first = (addr.max(tb) - tb) / ENTRY_SIZE as u64;
    let last = (end.min(tb + tl) - 1 - tb) / ENTRY_SIZE as u64;
    let owner_at = |b: &mut B, i: u64| -> Result<(u64, u32), B::Error> {
        let e = tb + i * ENTRY_SIZE as u64;
        let mut o = [0u8; 4];
        b.read_local(e + ENTRY_OFF_OWNER, &mut o)?;
        Ok((e, u32::from_le_bytes(o)))
    };
    let mut before = [(0u64, 0u32); 3];
    let n = ((last - first + 1) as usize).min(before.len());
    for (k, b) in before.iter_mut().enumerate().take(n) {
        *b = owner_at(backend, first + k as u64)?;
    }
    backend.write_local(addr, data)?;
    for (k, (e, from)) in before.iter().enumerate().take(n) {
        let (_, to) = owner_at(backend, first + k as u64)?;
        if to != *from {
            owners.record(*e, *from, to);
        }
    }
    Ok(())
}

/// Run one lap to its end, waiting on each device step in turn (at most `ctx.max_polls` polls
/// each). Memory faults and device errors are *outcomes* (the chain failed, the MN repairs);
/// only backend failures are errors.
pub fn run_lap<B: RdmaBackend>(
    backend: &mut B,
    layout: &ChainLayout,
    regions: &HostRegions,
    request: &[u8],
    ctx: &LapContext<'_>,
) -> Result<LapOutcome, HostEngineError<B::Error>> {
    let mut lap = match Lap::start(backend, layout, request)? {
        Ok(l) => l,
        Err(o) => return Ok(o),
    };
    loop {
        match lap.advance(backend, layout, regions, ctx)? {
            Progress::Done(o) => return Ok(o),
            Progress::Waiting(w) => match wait_for(backend, w.qp, w.wr_id, ctx.max_polls) {
                Ok(st) => {
                    if let Some(o) = lap.complete(st) {
                        return Ok(o);
                    }
                }
                Err(WaitError::Backend(e)) => return Err(HostEngineError::Backend(e)),
                Err(WaitError::Timeout) => return Ok(lap.timed_out()),
            },
        }
    }
}

#[derive(Debug)]
pub enum WaitError<E> {
    Backend(E),
    Timeout,
}

/// Poll `qp`'s send CQ until the completion of `wr_id` shows up; other completions are
/// dropped (in host-engine mode the MN's management QPs carry nothing else it waits for).
pub fn wait_for<B: RdmaBackend>(
    backend: &mut B,
    qp: Qpn,
    wr_id: u64,
    max_polls: u32,
) -> Result<WcStatus, WaitError<B::Error>> {
    let mut buf = [Completion::EMPTY; 8];
    for _ in 0..max_polls.max(1) {
        let n = backend.poll_cq(qp, QueueSel::Send, &mut buf).map_err(WaitError::Backend)?;
        if let Some(c) = buf[..n].iter().find(|c| c.wr_id == wr_id) {
            return Ok(c.status);
        }
    }
    Err(WaitError::Timeout)
}
