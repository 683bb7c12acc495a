//! omw-loopback: a deterministic in-memory RNIC model that executes omw's canonical WQE bytes.
//!
//! A [`Fabric`] holds hosts (an MN and CNs — the model does not distinguish), each with
//! byte-addressable memory, protection domains, MRs, type-2 memory windows, RC queue pairs
//! whose send and receive rings live **in host memory** (one ring-arena MR per host, so chains
//! can patch and bump their own WQEs), completion queues with modelled timestamps, and one
//! NIC of several processing units. Work runs when the fabric is stepped: [`Fabric::step`] executes one WQE,
//! [`Fabric::run_until_idle`] runs until nothing is runnable (bounded). No threads, no wall
//! clock, no unseeded randomness: the same calls give the same bytes, completions, times and
//! counters.
//!
//! Map of the crate (one concept per file):
//! * [`config`] — [`NicConfig`] (strict / rxe-compatible, prefetch, offload switch) and the
//!   [`CostModel`] of modelled time;
//! * [`fabric`] — hosts, the control-plane API, host faults (crash, RNIC reset), invariants;
//! * [`sched`](crate::Fabric::step) — which QP runs next and when (round-robin, earliest ready
//!   time, WAIT parking, prefetching);
//! * `exec` — what each opcode does and when (the cost model), the §3 checks' outcomes, error
//!   states, flushes;
//! * `nic` — a NIC's processing units (send and responder clocks), link, atomic serialiser;
//! * [`protection`] — PDs, MRs, type-2 MWs; the checks themselves are `omw_core::device::mw_rules`;
//! * [`qp`], [`cq`] — rings, managed queues, prefetch cache; CQs with numbers, counts,
//!   timestamps and an overrun limit;
//! * [`device_terms`] — the model as a PRM driver sees it: CQ objects, QPs at given ring
//!   addresses in mlx5 form, one-sided state transitions, doorbells;
//! * [`fault`] — the fault plan and middlewares every request message passes through;
//! * [`view`] — [`HostView`], the `omw_core::device::RdmaBackend` implementation;
//! * [`counters`] — counters, statistics, trace and digest.
//!
//! See `README.md` in the crate for the model's semantics, the cost model's calibration, and
//! what is and is not modelled. All times the model reports are **modelled** nanoseconds.
//!
//! ```
//! use omw_loopback::{Fabric, NicConfig, QpConfig, PdId};
//! use omw_core::access::AccessFlags;
//! use omw_core::wire::wqe::{Wqe, QueueSel};
//!
//! let mut f = Fabric::new(NicConfig::strict());
//! let mn = f.add_host("mn").unwrap();
//! let cn = f.add_host("cn").unwrap();
//! let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
//! let (pool, pool_keys) = f.alloc_mr(mn, PdId(0), 4096, 64, rw).unwrap();
//! let (buf, buf_keys) = f.alloc_mr(cn, PdId(0), 64, 64, rw).unwrap();
//! f.write(mn, pool, b"hello").unwrap();
//! let (c, _m) = f
//!     .create_connected_pair(cn, QpConfig::default(), mn, QpConfig::default())
//!     .unwrap();
//! f.post_send(c, &Wqe::read(buf, buf_keys.lkey, 5, pool, pool_keys.rkey)).unwrap();
//! let mut out = [omw_core::device::Completion {
//!     wr_id: 0,
//!     status: omw_core::device::WcStatus::GeneralErr,
//!     opcode: omw_core::device::WcOpcode::Recv,
//!     qpn: Default::default(),
//!     byte_len: 0,
//!     imm: None,
//!     invalidated: None,
//! }; 4];
//! assert_eq!(f.poll_cq(c, QueueSel::Send, &mut out).unwrap(), 1);
//! assert!(out[0].status.is_ok());
//! let mut got = [0u8; 5];
//! f.read(cn, buf, &mut got).unwrap();
//! assert_eq!(&got, b"hello");
//! assert_eq!(f.now(), 2900); // modelled: one READ round trip between two hosts
//! ```
#![forbid(unsafe_code)]
#![warn(missing_debug_implementations)]

pub mod addr;
pub mod cluster;
pub mod config;
pub mod counters;
pub mod cq;
pub mod device_terms;
pub mod error;
mod exec;
pub mod fabric;
pub mod fault;
mod memory;
pub mod mlx5_fetch;
mod nic;
pub mod protection;
pub mod qp;
mod sched;
pub mod view;

pub use config::{Conformance, CostModel, NicConfig};
pub use counters::{Counters, HostStats, QpStats, StepInfo, StepKind, TraceEvent};
pub use cq::TimedCompletion;
pub use device_terms::{CqStatus, DeviceQp, RingAt, Transition};
pub use error::LoopbackError;
pub use fabric::{qpn_of, Fabric, HostId, QpAddr, MAX_HOSTS, MAX_QPS_PER_HOST};
pub use fault::{FaultAction, FaultPlan, FaultRule, Message, MessageFilter, Middleware, Recorder, Verdict};
pub use memory::host_base;
pub use protection::{MrInfo, MwInfo, MwOpFail, MwState, PdId, WindowBinding};
pub use qp::QpConfig;
pub use view::HostView;
