//! Arming: turning a validated [`ChainLayout`] into WQE bytes in a backend's rings.
//!
//! Symbolic locations become addresses here, because only now are the ring addresses known:
//! a field of step *i* lives at `ring_base + position(i) × 64 + offset(field)`. The same code
//! arms the chain on every offload-capable backend (loopback model, FPGA extension block).

use crate::chain::builder::chain_wr_id;
use crate::chain::mlx5::{Mlx5Arm, Mlx5Chain, Mlx5Queues};
use crate::chain::{ChainLayout, Loc, Ring};
use crate::device::RdmaBackend;
use crate::ids::Qpn;
use crate::wire::wqe::{QueueSel, RecvWqe, Sge, Wqe, WQE_SIZE};
use crate::wire::wqe_format::WqeFormat;
use core::fmt;

/// A device chains can be armed on: the MN's device. Arming lays a chain out in the form the
/// device fetches ([`Capabilities::wqe_format`](crate::device::Capabilities::wqe_format)), and
/// for the mlx5 form hands the rings to the device ([`Mlx5Arm`]), so the MN needs both.
pub trait MnDevice: RdmaBackend + Mlx5Arm {}
impl<T: RdmaBackend + Mlx5Arm> MnDevice for T {}

#[derive(Debug)]
#[non_exhaustive]
pub enum ArmError<E> {
    Backend(E),
    BadQpn(u32),
    /// The layout failed validation.
    Invalid(crate::chain::ChainError),
    /// The device fetches the mlx5 form and the chain has none, or the backend cannot arm it.
    Mlx5(crate::chain::mlx5::Mlx5ChainError),
    /// The device fetches the mlx5 form but the backend offers no mlx5 arming.
    NoMlx5Arming,
    /// The chain publishes its receives through the management QP's receive doorbell record,
    /// and the device names none for that QP (`OffloadRings::recv_doorbell`).
    NoRecvDoorbell(u32),
}

impl<E: fmt::Display> fmt::Display for ArmError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ArmError::Backend(e) => write!(f, "backend refused while arming a chain: {e}"),
            ArmError::BadQpn(q) => write!(f, "chain names invalid QP number {q:#x}"),
            ArmError::Invalid(e) => write!(f, "chain layout invalid: {e}"),
            ArmError::Mlx5(e) => write!(f, "chain has no mlx5 form: {e}"),
            ArmError::NoMlx5Arming => {
                f.write_str("the device fetches mlx5 WQEs but its backend cannot arm mlx5 chains")
            }
            ArmError::NoRecvDoorbell(q) => write!(
                f,
                "the chain publishes its own receives but the device names no receive doorbell record for QP {q:#x}"
            ),
        }
    }
}

/// Concrete WQEs and RECV of one chain, ready to be posted.
#[derive(Clone, Debug)]
pub struct ResolvedChain {
    pub wqes: heapless::Vec<Wqe, { crate::chain::MAX_STEPS }>,
    pub recv: RecvWqe,
}

/// Address of a WQE field of step `step` given the send-ring bases [Loop, Mgmt].
pub fn field_addr(layout: &ChainLayout, bases: [u64; 2], step: u8, field: crate::wire::wqe::WqeField) -> u64 {
    let i = step as usize;
    let ring = layout.steps.get(i).map(|s| s.ring).unwrap_or(Ring::Loop);
    bases[ring as usize] + (layout.position(i) * WQE_SIZE) as u64 + field.offset() as u64
}

/// The layout's WQEs and RECV with every symbolic location made an address: ring fields from
/// the send-ring `bases` [Loop, Mgmt], the receive doorbell record from `recv_doorbell` (0
/// where the chain does not publish its receives).
pub fn resolve(layout: &ChainLayout, bases: [u64; 2], recv_doorbell: u64) -> ResolvedChain {
    let mut wqes = heapless::Vec::new();
    for s in layout.steps.iter() {
        let mut w = s.wqe;
        if let Some(Loc::Field { step, field }) = s.local {
            w.local_addr = field_addr(layout, bases, step, field);
        }
        match s.remote {
            Some(Loc::Field { step, field }) => w.remote_addr = field_addr(layout, bases, step, field),
            Some(Loc::RecvDoorbell) => w.remote_addr = recv_doorbell,
            _ => {}
        }
        let pushed = wqes.push(w);
        debug_assert!(pushed.is_ok(), "one WQE per step: both hold MAX_STEPS");
    }
    let mut recv = RecvWqe { wr_id: chain_wr_id(layout.kind, 0, 0xFF), sges: heapless::Vec::new() };
    for r in layout.recv.iter() {
        let sge = match r.loc {
            Loc::Mem(a) => Sge { addr: a, length: r.len, lkey: layout.meta_lkey },
            Loc::Field { step, field } => {
                Sge { addr: field_addr(layout, bases, step, field), length: r.len, lkey: layout.ring_lkey }
            }
            // refused by validation; an unchecked arm gets what it asked for
            Loc::RecvDoorbell => Sge { addr: recv_doorbell, length: r.len, lkey: layout.ring_lkey },
        };
        let pushed = recv.sges.push(sge);
        debug_assert!(pushed.is_ok(), "one entry per RECV target: MAX_RECV_TARGETS = MAX_RECV_SGES");
    }
    ResolvedChain { wqes, recv }
}

/// Post a chain into freshly reset managed queues and enable its first lap. `recv_copies`
/// identical RECVs fill the management QP's receive ring (its depth).
pub fn arm<B: MnDevice>(backend: &mut B, layout: &ChainLayout, recv_copies: u32) -> Result<(), ArmError<B::Error>> {
    layout.validate().map_err(ArmError::Invalid)?;
    match backend.capabilities().wqe_format() {
        WqeFormat::Canonical => arm_unchecked(backend, layout, recv_copies),
        WqeFormat::Mlx5 => arm_mlx5(backend, layout, recv_copies, true),
    }
}

/// [`arm`] for a device that fetches the mlx5 form: the chain laid out in WQEBBs
/// ([`Mlx5Chain::build`]), its ring images and lap counters written into MN memory here, the
/// rest (wr_id map, RECVs, first enables) by the backend.
fn arm_mlx5<B: MnDevice>(
    backend: &mut B,
    layout: &ChainLayout,
    recv_copies: u32,
    checked: bool,
) -> Result<(), ArmError<B::Error>> {
    let q = |v: u32| Qpn::new(v).map_err(|_| ArmError::BadQpn(v));
    let qpns = [q(layout.qpns[0])?, q(layout.qpns[1])?];
    let ring_bases = [
        backend.ring_base(qpns[0], QueueSel::Send).map_err(ArmError::Backend)?,
        backend.ring_base(qpns[1], QueueSel::Send).map_err(ArmError::Backend)?,
    ];
    let cqns = backend.cq_numbers(qpns[0], qpns[1]).ok_or(ArmError::NoMlx5Arming)?;
    let doorbell = recv_doorbell(backend, layout, qpns[1])?;
    let queues = Mlx5Queues {
        cqns,
        ring_bases,
        cq_base: backend.cq_producer_indices(qpns[0], qpns[1]),
        recv_doorbell: doorbell.map_or(0, |d| d.addr),
    };
    let recv_copies = doorbell.map_or(recv_copies, |d| d.slots);
    let chain = if checked { Mlx5Chain::build(layout, queues) } else { Mlx5Chain::build_unchecked(layout, queues) };
    let chain = chain.map_err(ArmError::Mlx5)?;
    for (base, ring) in ring_bases.iter().zip(chain.rings.iter()) {
        backend.write_local(*base, ring).map_err(ArmError::Backend)?;
    }
    for sh in chain.shadows.iter() {
        backend.write_local(sh.addr, &sh.initial.to_le_bytes()).map_err(ArmError::Backend)?;
    }
    backend.arm_mlx5(&chain, recv_copies.max(1)).ok_or(ArmError::NoMlx5Arming)?.map_err(ArmError::Backend)
}

/// The receive doorbell record of the management QP, where the chain publishes its receives.
fn recv_doorbell<B: MnDevice>(
    backend: &B,
    layout: &ChainLayout,
    mgmt: Qpn,
) -> Result<Option<crate::device::RecvDoorbell>, ArmError<B::Error>> {
    if layout.recv_publish().is_none() {
        return Ok(None);
    }
    match backend.recv_doorbell(mgmt).map_err(ArmError::Backend)? {
        Some(d) => Ok(Some(d)),
        None => Err(ArmError::NoRecvDoorbell(mgmt.get())),
    }
}

/// [`arm`] without validation: only for demonstrating what an invalid chain does on a device
/// (e.g. an ungated patch under prefetching). Never use it for a real chain.
pub fn arm_unchecked<B: MnDevice>(
    backend: &mut B,
    layout: &ChainLayout,
    recv_copies: u32,
) -> Result<(), ArmError<B::Error>> {
    if backend.capabilities().wqe_format() == WqeFormat::Mlx5 {
        return arm_mlx5(backend, layout, recv_copies, false);
    }
    let q = |v: u32| Qpn::new(v).map_err(|_| ArmError::BadQpn(v));
    let qpns = [q(layout.qpns[0])?, q(layout.qpns[1])?];
    let bases = [
        backend.ring_base(qpns[0], QueueSel::Send).map_err(ArmError::Backend)?,
        backend.ring_base(qpns[1], QueueSel::Send).map_err(ArmError::Backend)?,
    ];
    let doorbell = recv_doorbell(backend, layout, qpns[1])?;
    let resolved = resolve(layout, bases, doorbell.map_or(0, |d| d.addr));
    for ring in [Ring::Loop, Ring::Mgmt] {
        for (s, w) in layout.steps.iter().zip(resolved.wqes.iter()) {
            if s.ring == ring {
                backend.post_send(qpns[ring as usize], w).map_err(ArmError::Backend)?;
            }
        }
    }
    // a chain that publishes its receives: the chain's receive in every slot, and the record
    // counting the ones published (a little-endian u64 in canonical form) — none yet, or the
    // first lap's where the lap's tail admits the next request
    let copies = doorbell.map_or(recv_copies.max(1), |d| d.slots.max(1));
    for _ in 0..copies {
        backend.post_recv(qpns[1], &resolved.recv).map_err(ArmError::Backend)?;
    }
    if let Some(d) = doorbell {
        let published = u64::from(layout.initial_recv_enable);
        backend.write_local(d.addr, &published.to_le_bytes()).map_err(ArmError::Backend)?;
    }
    for ring in [Ring::Loop, Ring::Mgmt] {
        let n = layout.initial_enable[ring as usize] as u64;
        if n > 0 {
            backend.enable(qpns[ring as usize], QueueSel::Send, n).map_err(ArmError::Backend)?;
        }
    }
    if layout.initial_recv_enable > 0 {
        backend.enable(qpns[1], QueueSel::Recv, layout.initial_recv_enable as u64).map_err(ArmError::Backend)?;
    }
    Ok(())
}
