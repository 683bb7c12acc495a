//! Chain layouts: a pre-posted WR chain as data. Its builders are `builder` (shared), `alloc`
//! and `free`; its static validator `validate`; its Markdown form `render`; its arming
//! `arm`; its mlx5 form `mlx5`; its device-dependent layout choices `variant`.
//!
//! A chain spans three queues of the MN: the receive queue of a management QP (whose RECV
//! scatters the request bytes), the send queue of the MN end of that management QP (`Mgmt`),
//! and the send queue of the MN's loopback QP (`Loop`, which reaches the MN's own memory for
//! the queue atomics, the MWTable READs and the WQE patches). Steps are listed in a global
//! order that is a valid sequential execution (the host engine runs exactly that order); the
//! NIC instead runs each ring independently, gated only by WAIT and ENABLE, and ordered within
//! a QP by FENCE and the fence after a bind. The validator proves the two agree: every patched
//! WQE field is complete before its WQE can be *fetched*, every scratch word before the step
//! that reads or overwrites it *executes* ([`ChainLayout::happens_before`]); nothing runs before
//! the empty probe or ownership check has completed, nor the reply or push before the window
//! operations. [`ChainLayout::critical_path`] counts the gated phases to the reply or push.
//!
//! Re-arming: both send rings are managed (they execute only up to an ENABLE limit, and ENABLE
//! advances that limit by a count) and the chain closes each lap by bumping every WAIT's
//! absolute CQ count with a fetch-and-add on the WQE field, then — fenced behind those
//! atomics — enabling the next lap. The MN CPU arms a chain once per connection and
//! again only after a failure.

pub mod alloc;
pub mod arm;
pub mod builder;
pub mod free;
pub mod mlx5;
pub mod render;
pub mod validate;
pub mod variant;

pub use validate::{Gates, HappensBefore};

use crate::wire::wqe::{Opcode, QueueSel, Wqe, WqeField, WQE_SIZE};
use core::fmt;

pub const MAX_STEPS: usize = 120;
pub const MAX_RECV_TARGETS: usize = crate::wire::wqe::MAX_RECV_SGES;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Ring {
    /// Send queue of the MN's loopback QP (MN → MN memory).
    Loop = 0,
    /// Send queue of the MN end of the CN's management QP.
    Mgmt = 1,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum ChainKind {
    Alloc,
    Free,
}

impl ChainKind {
    /// The CN's other chain.
    pub const fn other(self) -> ChainKind {
        match self {
            ChainKind::Alloc => ChainKind::Free,
            ChainKind::Free => ChainKind::Alloc,
        }
    }
}

/// Where bytes go or come from, resolved when the chain is armed.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Loc {
    /// A concrete MN-memory address (scratch, queue, table).
    Mem(u64),
    /// A field (or span of consecutive fields starting at `field`) of a chain WQE.
    Field { step: u8, field: WqeField },
    /// The doorbell record of the management QP's receive queue
    /// (`crate::device::RecvDoorbell`), resolved when the chain is armed: the remote of the
    /// fetch-and-add by which a lap publishes the next receive.
    RecvDoorbell,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Step {
    pub ring: Ring,
    /// The template, with lap-0 values; addresses given by `local`/`remote` are filled at arm.
    pub wqe: Wqe,
    /// If `Some(Loc::Field)`, the local address is that WQE field (a patch).
    pub local: Option<Loc>,
    /// If `Some(Loc::Field)`, the remote address is that WQE field (a lap bump).
    pub remote: Option<Loc>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct RecvTarget {
    pub loc: Loc,
    pub len: u32,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Rearm {
    /// The chain bumps its own WAIT counts / ENABLE limits and enables its next lap.
    SelfEnabling,
    /// The MN CPU re-posts it after each run (portable host-engine mode).
    Host,
}

#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ChainLayout {
    pub kind: ChainKind,
    pub steps: heapless::Vec<Step, MAX_STEPS>,
    /// Scatter list of the trigger RECV on the management QP.
    pub recv: heapless::Vec<RecvTarget, MAX_RECV_TARGETS>,
    /// QP numbers of the MN ends: [Loop, Mgmt].
    pub qpns: [u32; 2],
    /// Entries of each ring enabled when the chain is armed (the first lap's prefix).
    pub initial_enable: [u16; 2],
    /// Receives the arm enables on the management QP: 1 where each lap's tail admits the next
    /// lap's request, 0 where each lap opens by admitting its own
    /// (`ChainVariant::lap_enables_its_receive`).
    pub initial_recv_enable: u16,
    pub rearm: Rearm,
    /// Largest send-queue depth the chain's QPs may have.
    pub queue_depth: u16,
    /// Send-queue depth each ring needs ([Loop, Mgmt]): its length, a power of two (the
    /// builders pad with NOPs). The chain's QPs must be created with exactly these depths.
    pub ring_depth: [u16; 2],
    /// Keys the arm step needs for the RECV scatter entries: metadata MR and ring MR lkeys.
    pub meta_lkey: u32,
    pub ring_lkey: u32,
    /// MN memory the chain's steps may name: `[meta_base, meta_base + meta_len)`.
    pub meta: (u64, u64),
    /// A read-only source the chain may read from besides the metadata: the MN-private chunk
    /// of zeros the free chain scrubs from (`(0, 0)`: none). Nothing may write it.
    pub zero_source: (u64, u64),
    /// A write-only sink outside the metadata: the requester's proof word the free chain's
    /// ownership proof READs into under `ChainVariant::binds_to_poster` (`(0, 0)`: none).
    pub proof_sink: (u64, u64),
    /// Step index whose failure means "the free queue is empty" (alloc chain).
    pub empty_probe: Option<u8>,
    /// Step index whose failure means "the caller does not own that chunk" (free chain).
    pub ownership_check: Option<u8>,
    /// The step the chain exists for — the reply WRITE (alloc), the push onto the free queue
    /// (free): [`ChainLayout::critical_path`] counts the gates before it.
    pub critical_end: Option<u8>,
    /// The WAIT for the request's RECV, where a chain prepares before it (the alloc chain pops
    /// its group ahead): what comes before it runs before the request arrives, and
    /// [`ChainLayout::critical_path`] counts from it. `None`: the chain starts with it.
    pub request_wait: Option<u8>,
    /// What the mlx5 form adds in MN memory and with which keys (unused by the canonical form).
    pub mlx5: Mlx5Scratch,
}

impl ChainLayout {
    /// The step that publishes the next receive through the receive doorbell record
    /// ([`Loc::RecvDoorbell`]), where the chain does (`ChainEnv::posts_receives`).
    pub fn recv_publish(&self) -> Option<u8> {
        self.steps.iter().position(|s| s.remote == Some(Loc::RecvDoorbell)).map(|i| i as u8)
    }
}

/// The scratch and the loop-domain keys the mlx5 form of a chain uses besides the canonical
/// steps' own (`crate::chain::mlx5`): its little-endian lap counters and a junk word for bytes
/// a byte-reversing copy or a fetch-and-add must put somewhere.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct Mlx5Scratch {
    pub shadows: u64,
    pub junk: u64,
    pub meta_lkey: u32,
    pub meta_rkey: u32,
    pub ring_lkey: u32,
    /// The unit the device counts SEND_EN indices in (the chain's variant,
    /// `chain::variant`): the mlx5 form's enable indices and their lap counters use it.
    pub send_en_unit: crate::device::behaviour::SendEnUnit,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ChainError {
    /// More steps on one ring than the QP's send queue holds.
    ChainTooLong {
        ring: Ring,
        steps: usize,
        depth: u16,
    },
    /// A step or scatter entry names a step that does not exist.
    BadStepRef {
        step: u8,
    },
    /// A patch writes a field the target opcode does not allow to be patched.
    NotPatchable {
        step: u8,
        field: WqeField,
    },
    /// A patch's length does not cover exactly whole patchable fields.
    PatchOutsideField {
        step: u8,
        field: WqeField,
        len: u32,
    },
    /// The producer of a patched field is not guaranteed complete when the consumer can be
    /// fetched: the NIC may execute the stale template.
    UngatedPatch {
        producer: Producer,
        consumer: u8,
    },
    /// A step reads MN memory an earlier step writes, without a gate between them.
    UngatedDependency {
        producer: Producer,
        consumer: u8,
    },
    /// A step beyond a ring's initial enable is never released by an ENABLE.
    NeverEnabled {
        step: u8,
    },
    /// A WAIT waits for more completions than the lap produces before it.
    WaitNeverSatisfied {
        step: u8,
    },
    /// A self-enabling chain lacks a bump for a WAIT/ENABLE or a lap-closing ENABLE.
    MissingRearm {
        step: u8,
    },
    /// An address outside the MN's metadata region.
    OutOfRegion {
        step: u8,
    },
    /// A patch target comes before its producer in the global order.
    PatchBackwards {
        producer: Producer,
        consumer: u8,
    },
    /// A step after the empty probe or the ownership check can execute before that check has
    /// completed: it could take effect although the check fails.
    UncheckedEffect {
        check: u8,
        step: u8,
    },
    /// Something the next lap's request overwrites (a RECV target) is still being read or
    /// written when the next RECV is enabled.
    RecvReuse {
        step: u8,
    },
    /// An address or key the request scatters into a WQE is not cleared for the next lap: a
    /// later request too short to supply its own would reuse this one's.
    Replayable {
        step: u8,
        field: WqeField,
    },
    TooManySteps,
    /// The receive doorbell is written other than by one unsignaled fetch-and-add of 1 on the
    /// Loop ring right after the lap's receive ENABLE, or is named as a local address or a
    /// receive target.
    MisplacedRecvDoorbell {
        step: u8,
    },
    /// The chain has no mlx5 form within that form's fixed capacities (`crate::chain::mlx5`).
    NoMlx5Form,
    /// A free chain that binds to the poster (`ChainVariant::binds_to_poster`) needs the CN's
    /// proof word and key (`ChainEnv::owner_proof`), and none was given.
    NoOwnerProof,
}

/// Who wrote a byte: a step, or the trigger RECV.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Producer {
    Step(u8),
    Recv,
}

impl fmt::Display for Producer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Producer::Step(s) => write!(f, "step {s}"),
            Producer::Recv => f.write_str("the trigger RECV"),
        }
    }
}

impl fmt::Display for ChainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ChainTooLong { ring, steps, depth } => {
                write!(f, "{steps} steps on the {ring:?} ring exceed the queue depth {depth}")
            }
            Self::BadStepRef { step } => write!(f, "reference to missing step {step}"),
            Self::NotPatchable { step, field } => write!(f, "field {field:?} of step {step} is not patchable"),
            Self::PatchOutsideField { step, field, len } => {
                write!(f, "patch of {len} bytes at {field:?} of step {step} does not cover whole patchable fields")
            }
            Self::UngatedPatch { producer, consumer } => write!(
                f,
                "step {consumer} is patched by {producer} but not gated on its completion (the NIC may fetch it first)"
            ),
            Self::UngatedDependency { producer, consumer } => {
                write!(f, "step {consumer} reads memory written by {producer} without a gate")
            }
            Self::NeverEnabled { step } => write!(f, "step {step} is never enabled"),
            Self::WaitNeverSatisfied { step } => write!(f, "WAIT at step {step} can never be satisfied"),
            Self::MissingRearm { step } => write!(f, "step {step} is not re-armed for the next lap"),
            Self::OutOfRegion { step } => write!(f, "step {step} addresses memory outside the MN metadata region"),
            Self::PatchBackwards { producer, consumer } => {
                write!(f, "step {consumer} is patched by the later {producer}")
            }
            Self::UncheckedEffect { check, step } => {
                write!(f, "step {step} can execute before the check at step {check} has completed")
            }
            Self::RecvReuse { step } => {
                write!(f, "step {step} may still use a RECV target when the next RECV is enabled")
            }
            Self::Replayable { step, field } => {
                write!(f, "{field:?} of step {step} comes from the request but is not cleared for the next lap")
            }
            Self::TooManySteps => write!(f, "chain exceeds {MAX_STEPS} steps"),
            Self::MisplacedRecvDoorbell { step } => write!(
                f,
                "step {step} writes the receive doorbell other than as the lap's one publish after its receive ENABLE"
            ),
            Self::NoMlx5Form => f.write_str("chain has no mlx5 form within its fixed capacities"),
            Self::NoOwnerProof => f.write_str("a free chain with binds to the poster needs the CN's owner proof"),
        }
    }
}
