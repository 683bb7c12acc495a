//! What kind of NIC the model is: conformance mode, prefetching, offload switch, and the
//! [`CostModel`] that turns executed WQEs into *modelled* time.

use omw_core::device::behaviour::DeviceBehaviour;
use omw_core::device::Capabilities;

/// Which memory-window semantics the model follows (DESIGN.md §3).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Conformance {
    /// The InfiniBand spec: LOCAL_INV (and SEND_WITH_INV) must name a window bound to the QP
    /// it arrives on, and remote accesses are checked against the window's own bounds.
    Strict,
    /// Linux soft-RoCE (`rdma_rxe`) as measured in §3: invalidation from any QP succeeds and
    /// only the underlying MR's bounds are checked. For differential tests against real rxe.
    RxeCompatible,
}

/// Configuration of every NIC of a [`crate::Fabric`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct NicConfig {
    pub conformance: Conformance,
    /// Prefetch WQE bytes into a per-QP cache as soon as entries are posted or enabled (the
    /// way real NICs fetch ahead). A chain that patches a WQE without WAIT/ENABLE gating then
    /// executes the stale bytes. Off: bytes are fetched when the WQE executes.
    pub prefetch: bool,
    /// Entries a QP may hold fetched-but-not-executed when `prefetch` is on (≥ 1).
    pub prefetch_depth: u32,
    /// Offload capabilities (CORE-Direct WAIT/ENABLE, self-modifying WQEs, BIND_MW targeting
    /// another QP). Off models a NIC without them ("host-engine mode"): WAIT and ENABLE
    /// complete with `LocQpOpErr`, and a BIND_MW must be posted on the QP it binds to.
    pub offload: bool,
    pub cost: CostModel,
    /// Bytes of each host's ring arena: one MR holding every send and receive ring of the host
    /// (64 B per send entry, `RECV_WQE_SIZE` per receive entry). Fixed at host creation.
    pub ring_arena_bytes: u64,
    /// Upper bound of each host's allocated memory (including the ring arena).
    pub mem_limit: u64,
    /// Completions a CQ holds before the oldest is dropped (mlx5 "ignore overrun" CQs, which
    /// chains use because nobody polls them; the CQ count still advances).
    pub cq_capacity: u32,
    /// Step budget of one `poll_cq` through [`crate::HostView`] (it runs the fabric first).
    pub poll_max_steps: u64,
    /// Record every completion in [`crate::Fabric::trace`] (allocates; off for benchmarks).
    pub trace: bool,
    /// Seed of the only pseudo-random source (fault-injection corruption patterns).
    pub seed: u64,
    /// The form the NIC fetches **managed** queues (the chains' rings) in: canonical 64-byte
    /// WQEs, or ConnectX WQEBBs decoded by `omw_core::mlx5::decode` (`crate::mlx5_fetch`).
    /// Unmanaged queues, which CPUs post to, stay canonical either way.
    pub wqe_format: omw_core::wire::wqe_format::WqeFormat,
    /// How the NIC answers the open CORE-Direct questions (DESIGN.md §6.4): prefetch past an
    /// unsatisfied WAIT, what makes a receive available, SEND_EN's unit, self-enables, binds
    /// naming another QP. The model executes whichever answer it is given
    /// (`backend-loopback/README.md`, "Device behaviour"); default
    /// [`NicConfig::DEFAULT_BEHAVIOUR`]: the paper's device's answers but prefetch past WAITs.
    pub behaviour: DeviceBehaviour,
    /// With offload, each managed receive queue keeps its doorbell record in the ring arena,
    /// where a chain's loop QP can write it (`Capabilities::RECV_DOORBELL_RECORD`): the chains
    /// publish their own receives, one per lap. Off: the CPU hands each polled receive back,
    /// so all of a chain's receive slots may be available at once under
    /// `RecvEnable::Doorbell` (what the chains did before; kept to show the difference).
    pub recv_doorbell_records: bool,
    /// With offload, how the device answers an invalidate without the QPN check of a window
    /// bound to another QP (`UncheckedUnbind`, docs/MLX5.md question 21): the chains and the
    /// MN's own unbinds rest on `Honoured` (the default); `Refused` shows what breaks.
    pub unchecked_unbind: omw_core::device::behaviour::UncheckedUnbind,
}

impl Default for NicConfig {
    fn default() -> Self {
        Self::strict()
    }
}

impl NicConfig {
    /// Spec semantics, offload on, no prefetching.
    pub const fn strict() -> Self {
        NicConfig {
            conformance: Conformance::Strict,
            prefetch: false,
            prefetch_depth: 8,
            offload: true,
            cost: CostModel::CX6,
            ring_arena_bytes: 1 << 20,
            mem_limit: 1 << 32,
            cq_capacity: 4096,
            poll_max_steps: 10_000_000,
            trace: false,
            seed: 0x5EED_0F0E_5EED,
            wqe_format: omw_core::wire::wqe_format::WqeFormat::Canonical,
            behaviour: NicConfig::DEFAULT_BEHAVIOUR,
            recv_doorbell_records: true,
            unchecked_unbind: omw_core::device::behaviour::UncheckedUnbind::Honoured,
        }
    }
    /// The model's answers to the open CORE-Direct questions unless told otherwise: the
    /// paper's device's, but the NIC **fetches past an unsatisfied WAIT** (up to the producer
    /// index or a `cd_slave_send` queue's enable limit). No source says a WAIT stops prefetch,
    /// and mlx4's `stamp_send_wqe` ("invalid if prefetched") shows these NICs fetch ahead; the
    /// documented fetch bound is the enable limit (issue 22, docs/MLX5.md). So every test on
    /// the model runs the chains on the less forgiving answer.
    pub const DEFAULT_BEHAVIOUR: DeviceBehaviour = DeviceBehaviour {
        wait_prefetch: omw_core::device::behaviour::WaitPrefetch::FetchesPast,
        ..DeviceBehaviour::PAPER
    };
    /// Soft-RoCE semantics (§3 deviations), offload on.
    pub const fn rxe_compatible() -> Self {
        let mut c = Self::strict();
        c.conformance = Conformance::RxeCompatible;
        c
    }
    /// Strict semantics on a NIC without offload capabilities: the MN must use the host engine.
    pub const fn host_engine() -> Self {
        let mut c = Self::strict();
        c.offload = false;
        c
    }
    /// Managed queues in `f` ([`NicConfig::wqe_format`]).
    pub const fn with_wqe_format(mut self, f: omw_core::wire::wqe_format::WqeFormat) -> Self {
        self.wqe_format = f;
        self
    }
    /// The NIC answers the open questions as `b` ([`NicConfig::behaviour`]).
    pub const fn with_unchecked_unbind(mut self, u: omw_core::device::behaviour::UncheckedUnbind) -> Self {
        self.unchecked_unbind = u;
        self
    }
    pub const fn with_behaviour(mut self, b: DeviceBehaviour) -> Self {
        self.behaviour = b;
        self
    }
    pub const fn with_prefetch(mut self, depth: u32) -> Self {
        self.prefetch = true;
        self.prefetch_depth = if depth == 0 { 1 } else { depth };
        self
    }
    pub const fn with_offload(mut self, on: bool) -> Self {
        self.offload = on;
        self
    }
    pub const fn with_conformance(mut self, c: Conformance) -> Self {
        self.conformance = c;
        self
    }
    pub const fn with_cost(mut self, cost: CostModel) -> Self {
        self.cost = cost;
        self
    }
    pub const fn with_trace(mut self, on: bool) -> Self {
        self.trace = on;
        self
    }
    pub const fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Exactly what this configuration makes the model do.
    pub fn capabilities(&self) -> Capabilities {
        let mut c = Capabilities::ATOMICS
            | Capabilities::MASKED_FETCH_ADD
            | Capabilities::MW_TYPE2
            | Capabilities::SEND_WITH_INV
            | Capabilities::MW_QP_BINDING_ENFORCED;
        if self.conformance == Conformance::Strict {
            c |= Capabilities::MW_QP_CHECK_ON_INVALIDATE | Capabilities::MW_BOUNDS_ENFORCED;
        }
        if self.offload {
            c |= Capabilities::WAIT_ENABLE | Capabilities::SELF_MODIFYING_WQE | Capabilities::BIND_TO_OTHER_QP;
            if self.recv_doorbell_records {
                c |= Capabilities::RECV_DOORBELL_RECORD;
            }
        }
        if self.wqe_format == omw_core::wire::wqe_format::WqeFormat::Mlx5 {
            c |= Capabilities::WQE_FORM_MLX5;
        } else {
            // the model of ConnectX (mlx5 form) carries no atomics through windows, as the
            // device does not (DESIGN.md §6.4); the canonical model does, as rxe does
            c |= Capabilities::MW_ATOMICS;
        }
        c
    }
}

/// The timing model. All figures are nanoseconds of **modelled** time; nothing in the model
/// reads a wall clock. Every input names its source (docs/COST-MODEL.md §1 tabulates them);
/// none was chosen to bring an output closer to the OneSidedMW paper, except the two marked
/// *from the paper*, whose dependent rows the benchmark marks "calibrated".
///
/// Structure (DESIGN.md §10): each NIC has [`CostModel::nic_units`] processing units. A QP is
/// pinned to one unit (its local index modulo the count) and its WQEs run in order; different
/// QPs run in parallel on their units. Incoming requests are handled by the responder QP's
/// unit. A bind or invalidation occupies its unit briefly but fences its own QP for
/// [`CostModel::bind_ns`]. Host memory is reached over PCIe: a DMA read is a round trip, a
/// write is posted. Same-address atomics serialise in the responder NIC.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct CostModel {
    /// Processing units per NIC. No vendor publishes the count; Kalia et al. (ATC'16, "Design
    /// Guidelines for High Performance RDMA Systems") show that one QP's WQEs are processed in
    /// order and that peak message rate needs many QPs on parallel units. Default 10 =
    /// ConnectX-5's ≈ 200 M messages/s (NVIDIA ConnectX-5 product brief) ÷ the 20 M WQEs/s
    /// one unit issues at [`CostModel::wqe_ns`]. Not measured: `omw bench` sweeps 1…16.
    pub nic_units: u32,
    /// Unit time to decode and issue one WQE (NOP, WAIT, ENABLE, the issue part of a remote
    /// operation). No public per-WQE figure: 50 ns is an estimate (a unit's pipeline), kept
    /// consistent with the NIC-wide message rate through `nic_units`.
    pub wqe_ns: u64,
    /// Responder unit time per incoming request (transport + access check + DMA set-up):
    /// the same per-unit message-rate bound as `wqe_ns` (200 M msg/s ÷ 10 units); estimate.
    pub responder_ns: u64,
    /// BIND_MW, UNBIND and LOCAL_INV latency (UMR WQEs on mlx5): 1.33 µs to bind a 4 MB
    /// window on ConnectX-6, invalidation the same — FineMem (OSDI'25, Table 1; DESIGN.md
    /// §10). The OneSidedMW paper states no bind latency of its own. Paid as a fence on the
    /// posting QP (mlx5 sets a small fence on the WQE after a UMR, rdma-core
    /// providers/mlx5/qp.c), not as unit occupancy.
    pub bind_ns: u64,
    /// Unit occupancy of a bind / invalidation (the rest of `bind_ns` is the QP's fence). No
    /// measurement; taken equal to `wqe_ns` (the UMR is one WQE to issue).
    pub bind_unit_ns: u64,
    /// PCIe DMA read round trip (WQE fetch, payload read, a loopback READ's source):
    /// ≈ 0.5 µs median without IOMMU, Neugebauer et al., "Understanding PCIe performance for
    /// end host networking", SIGCOMM'18 (Fig. 4/5: 400–600 ns for small reads).
    pub pcie_read_ns: u64,
    /// PCIe posted write, one way (data placement, a loopback WRITE's destination): ≈ 250 ns,
    /// half the round trip, same source.
    pub pcie_write_ns: u64,
    /// One way NIC → wire → switch → NIC between two hosts. *From the paper*: set so that an
    /// 8-byte one-sided READ (`wqe_ns + wire_ns + responder_ns + pcie_read_ns + wire_ns +
    /// pcie_write_ns`) takes the 2.9 µs of DESIGN.md §2; no independent measurement of the
    /// testbed's path is used.
    pub wire_ns: u64,
    /// Serialisation time per payload byte on the host's link, in picoseconds (80 ps =
    /// 100 Gb/s, the testbed's link rate, §2). The link is shared by all of a host's QPs.
    pub per_byte_ps: u64,
    /// PCIe bandwidth, ps per payload byte in each direction (DMA reads and writes are
    /// separate lanes): PCIe 3.0 x16 carries 8 GT/s × 16 lanes × 128/130 = 15.75 GB/s raw,
    /// ≈ 12.5 GB/s of payload with 256-byte TLPs and their headers (Neugebauer et al.,
    /// SIGCOMM'18, §3's PCIe model) → 80 ps. A transfer between hosts is pipelined with its
    /// link serialisation (the slower of the two sets its pace); a loopback transfer (a
    /// chain's copy, the free chain's scrub) never touches the link, so its DMAs set it: a
    /// 1 MiB scrub takes ≈ 84 µs of PCIe, not the 8 bytes' cost.
    pub pcie_per_byte_ps: u64,
    /// Memory-key contexts (mlx5 mkeys: MRs and windows; the MPT) the NIC keeps on chip,
    /// direct-mapped by key index (0: no cache modelled, every access hits). A remote access
    /// or bind whose key is not cached fetches its context over PCIe (`pcie_read_ns`) first.
    /// **Unmeasured**: no vendor document or paper states ConnectX's cache size; Husky
    /// (NSDI'23) and SRNIC (NSDI'23) show commercial RNICs slowing once thousands of
    /// objects are live, LITE (SOSP'17) once many MRs are. 4096 is an assumption `omw bench`
    /// sweeps (¼×…4×). Address translation (the MTT) is not modelled.
    pub key_cache_entries: u32,
    /// Responder time one atomic holds its 8-byte address: same-address atomics serialise at
    /// ≈ 2.7 M ops/s on ConnectX-3 (Kalia et al., rdma_bench "atomics" sequencer, ATC'16) →
    /// 370 ns. Atomics on different addresses do not wait for each other.
    pub atomic_same_addr_ns: u64,
    /// NIC time to flush one WQE of an errored QP (estimate; only orders error paths).
    pub flush_ns: u64,
    /// MN CPU time of one host-engine step (a post + poll on one weak MN core), used by
    /// callers of [`crate::Fabric::advance_cpu`]; the model never charges it itself.
    /// **Calibrated**: no independent figure exists — 400 ns is the value with which the
    /// host engine reproduces the paper's 170 µs for RPC-MW at 24 threads, so that row is
    /// marked calibrated and `omw bench` sweeps the RPC-MW baselines' per-request CPU cost
    /// over a sourced range instead (eRPC, NSDI'19: ≈ 100 ns per small RPC on one core).
    pub host_engine_step_ns: u64,
    /// How long a SEND (or WRITE_WITH_IMM) waits for a receive WQE before completing with
    /// `RnrRetryExcErr`: one RNR NAK period at the verbs default `min_rnr_timer` = 12
    /// (655.36 µs, IBTA table 45); the model folds the retry count into this single budget.
    pub rnr_timeout_ns: u64,
    /// How long a requester retries an unanswered request (dropped message, crashed or
    /// errored peer) before `RetryExcErr`: the local ACK timeout at `timeout` = 8
    /// (4.096 µs × 2⁸ ≈ 1.05 ms, IBTA 9.7.6.1.3), retry count folded in.
    pub retry_timeout_ns: u64,
}

/// At most this many processing units per NIC (fixed storage per host).
pub const MAX_NIC_UNITS: u32 = 64;

impl CostModel {
    /// ConnectX-5/6-like defaults (see each field for its source).
    pub const CX6: CostModel = CostModel {
        nic_units: 10,
        wqe_ns: 50,
        responder_ns: 50,
        bind_ns: 1300,
        bind_unit_ns: 50,
        pcie_read_ns: 500,
        pcie_write_ns: 250,
        wire_ns: 1025,
        per_byte_ps: 80,
        pcie_per_byte_ps: 80,
        key_cache_entries: 4096,
        atomic_same_addr_ns: 370,
        flush_ns: 10,
        host_engine_step_ns: 400,
        rnr_timeout_ns: 655_360,
        retry_timeout_ns: 1_048_576,
    };
    /// Every cost zero except the timeouts: ordering only, for tests that ignore time.
    pub const ZERO: CostModel = CostModel {
        nic_units: 1,
        wqe_ns: 0,
        responder_ns: 0,
        bind_ns: 0,
        bind_unit_ns: 0,
        pcie_read_ns: 0,
        pcie_write_ns: 0,
        wire_ns: 0,
        per_byte_ps: 0,
        pcie_per_byte_ps: 0,
        key_cache_entries: 0,
        atomic_same_addr_ns: 0,
        flush_ns: 0,
        host_engine_step_ns: 0,
        rnr_timeout_ns: 1000,
        retry_timeout_ns: 1000,
    };

    /// The same model with `n` processing units per NIC (clamped to 1..=[`MAX_NIC_UNITS`]).
    pub const fn with_units(mut self, n: u32) -> Self {
        self.nic_units = if n == 0 {
            1
        } else if n > MAX_NIC_UNITS {
            MAX_NIC_UNITS
        } else {
            n
        };
        self
    }

    /// Serialisation time of `len` payload bytes.
    pub const fn bytes_ns(&self, len: u64) -> u64 {
        len.saturating_mul(self.per_byte_ps) / 1000
    }

    /// PCIe time of `len` payload bytes in one direction.
    pub const fn pcie_ns(&self, len: u64) -> u64 {
        len.saturating_mul(self.pcie_per_byte_ps) / 1000
    }

    /// An 8-byte one-sided READ between two idle hosts (the figure `wire_ns` is set from).
    pub const fn read_rtt_ns(&self) -> u64 {
        self.wqe_ns + 2 * self.wire_ns + self.responder_ns + self.pcie_read_ns + self.pcie_write_ns + self.bytes_ns(8)
    }
}

impl Default for CostModel {
    fn default() -> Self {
        Self::CX6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_follow_config() {
        let s = NicConfig::strict().capabilities();
        assert!(s.contains(Capabilities::OFFLOAD));
        assert!(s.contains(Capabilities::MW_BOUNDS_ENFORCED));
        let r = NicConfig::rxe_compatible().capabilities();
        assert!(!r.contains(Capabilities::MW_QP_CHECK_ON_INVALIDATE));
        assert!(!r.contains(Capabilities::MW_BOUNDS_ENFORCED));
        assert!(r.contains(Capabilities::MW_QP_BINDING_ENFORCED));
        let h = NicConfig::host_engine().capabilities();
        assert!(!h
            .intersects(Capabilities::WAIT_ENABLE | Capabilities::SELF_MODIFYING_WQE | Capabilities::BIND_TO_OTHER_QP));
        assert!(h.contains(Capabilities::SECURE_MINIMUM));
        assert!(s.contains(Capabilities::MW_ATOMICS) && r.contains(Capabilities::MW_ATOMICS));
        let m = NicConfig::strict().with_wqe_format(omw_core::wire::wqe_format::WqeFormat::Mlx5).capabilities();
        assert!(!m.contains(Capabilities::MW_ATOMICS));
    }

    #[test]
    fn read_round_trip_is_calibrated() {
        let c = CostModel::CX6;
        assert!((2850..=2950).contains(&c.read_rtt_ns()), "{}", c.read_rtt_ns());
        assert_eq!(c.bind_ns, 1300);
    }

    #[test]
    fn units_are_clamped() {
        assert_eq!(CostModel::CX6.with_units(0).nic_units, 1);
        assert_eq!(CostModel::CX6.with_units(1000).nic_units, MAX_NIC_UNITS);
        assert_eq!(CostModel::CX6.with_units(4).nic_units, 4);
    }
}
