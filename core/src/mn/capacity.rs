//! Whether a pool fits a device: the windows, registrations and queue pairs an MN needs for a
//! pool, and the device limits they must stay within — `omw plan` prints it (the paper's
//! future work 1), and every MN deployment checks it before it provisions anything, so an
//! impossible configuration is refused naming the limit it breaks instead of failing
//! part-way through millions of window allocations.
//!
//! What counts (from what [`MnPlan::provision`](crate::mn::plan::MnPlan::provision) and a CN
//! connection create):
//! - windows: G per chunk (`alloc_mw` at provisioning);
//! - registrations: the plan's metadata registrations ([`MnPlan::metadata_registrations`]) and
//!   the pool's (one, or one per chunk where window bounds are not enforced);
//! - QPs: per CN its Alloc and Free QPs and G − 1 access QPs, offloaded two chain loopback
//!   QPs (both ends on the MN: four), and per extra alloc chain ([`Footprint::of_chains`]) one
//!   more Alloc QP and, offloaded, one more loopback QP (two ends); plus the MN's admin QP pair
//!   and, offloaded, its atomic QP pair;
//! - metadata: a scratch area per alloc chain of every CN slot.
//! - on devices whose windows and MRs are the same kind of object (mlx5: both are mkeys,
//!   `max_mr = max_mw = 1 << log_max_mkey` in Linux `drivers/infiniband/hw/mlx5/main.c`),
//!   windows and registrations together.

use crate::device::ExecutionMode;
use crate::geometry::{GeometryError, PoolGeometry, MAX_CHUNKS};
use crate::mn::plan::MnPlan;
use crate::mn::provision::PoolSpec;
use crate::wire::memory_map::MnMemoryMap;
use core::fmt;

/// What a device allows (from `ibv_query_device`, or a named profile).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DeviceLimits {
    pub max_mw: u64,
    pub max_mr: u64,
    pub max_qp: u64,
    /// Windows and MRs draw from one table (mlx5 mkeys): their sum is bounded by `max_mw`.
    pub shared_keys: bool,
}

impl DeviceLimits {
    /// ConnectX-6 (mlx5): 2^24 mkeys shared by MRs and windows — `max_mw = max_mr = 1 <<
    /// log_max_mkey` (Linux `drivers/infiniband/hw/mlx5/main.c`, `mlx5_ib_query_device`),
    /// about 16 M windows per PCIe function as FineMem measured (OSDI'25, Table 1; DESIGN.md
    /// §10) and as `ibv_devinfo -v` reports (`max_mr`, `max_mw` 16777216); `max_qp = 1 <<
    /// log_max_qp` = 131072 as `ibv_devinfo -v` reports on a ConnectX-6 Dx (firmware 22.36;
    /// a ConnectX-6 on firmware 20.28 reports 262144 — the profile takes the lower).
    pub const CONNECTX6: DeviceLimits =
        DeviceLimits { max_mw: 1 << 24, max_mr: 1 << 24, max_qp: 1 << 17, shared_keys: true };
}

/// What an MN with a given pool needs of its device and its memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Footprint {
    pub chunks: u32,
    pub windows: u64,
    pub registrations: u64,
    pub qps: u64,
    /// MN memory for the free queue, the MWTable and the CNs' scratch
    /// ([`MnMemoryMap::len_for`]): never exported, pinned and registered all the same.
    pub metadata_bytes: u64,
    /// Pool and metadata together: what the MN pins.
    pub pinned_bytes: u64,
}

impl Footprint {
    /// The pool `spec` under `plan`. A geometry the core cannot hold (more than
    /// [`MAX_CHUNKS`] chunks, a chunk size out of range) is the geometry's error.
    pub fn of(plan: &MnPlan, spec: &PoolSpec) -> Result<Footprint, GeometryError> {
        Self::of_chains(plan, spec, 1)
    }

    /// [`Footprint::of`] for an MN whose CNs connect with `alloc_chains` alloc chains each
    /// ([`crate::mn::MnConfig::alloc_chains`], clamped as
    /// [`MnPlan::provision_chains`](crate::mn::plan::MnPlan::provision_chains) does).
    pub fn of_chains(plan: &MnPlan, spec: &PoolSpec, alloc_chains: u8) -> Result<Footprint, GeometryError> {
        let geo = PoolGeometry::new(spec.chunk_size, spec.chunk_size, spec.chunks, spec.group_size)?;
        let k = alloc_chains.clamp(1, crate::mn::MAX_ALLOC_CHAINS as u8);
        let cns = spec.max_cns.clamp(1, crate::mn::MAX_CNS as u32) as u64;
        let chunks = spec.chunks as u64;
        let g = spec.group_size as u64;
        let offloaded = plan.mode == ExecutionMode::Offloaded;
        let pool_mrs = if plan.per_chunk_mrs { chunks } else { 1 };
        let extra = k as u64 - 1;
        let per_cn = 2 + (g - 1) + if offloaded { 4 } else { 0 } + extra * (1 + if offloaded { 2 } else { 0 });
        let mn_own = 2 + if offloaded { 2 } else { 0 };
        let metadata = MnMemoryMap::len_for(&geo, crate::mn::MemoryNode::scratch_slots(cns as u32, k));
        Ok(Footprint {
            chunks: spec.chunks,
            windows: chunks * g,
            registrations: plan.metadata_registrations() + pool_mrs,
            qps: cns * per_cn + mn_own,
            metadata_bytes: metadata,
            pinned_bytes: geo.pool_len() + metadata,
        })
    }

    /// MN metadata per chunk, the scratch of the CNs shared out: the queue slot (the ring
    /// rounded up to a power of two) and the MWTable entry.
    pub fn metadata_per_chunk(&self) -> f64 {
        self.metadata_bytes as f64 / self.chunks.max(1) as f64
    }

    /// An MN of several size classes (one MWTable, free queue and set of chains per class, on
    /// one device): what the classes need together — the device's limits hold for their sum.
    pub fn combined(classes: impl IntoIterator<Item = Footprint>) -> Footprint {
        classes.into_iter().fold(
            Footprint { chunks: 0, windows: 0, registrations: 0, qps: 0, metadata_bytes: 0, pinned_bytes: 0 },
            |a, f| Footprint {
                chunks: a.chunks.saturating_add(f.chunks),
                windows: a.windows + f.windows,
                registrations: a.registrations + f.registrations,
                qps: a.qps + f.qps,
                metadata_bytes: a.metadata_bytes + f.metadata_bytes,
                pinned_bytes: a.pinned_bytes + f.pinned_bytes,
            },
        )
    }

    /// Check against `limits`: every limit this footprint breaks (empty: it fits).
    pub fn check(&self, limits: &DeviceLimits) -> heapless::Vec<Exceeded, 3> {
        let mut out = heapless::Vec::new();
        let mut add = |e: Exceeded| {
            let pushed = out.push(e);
            debug_assert!(pushed.is_ok(), "three limits, one finding each");
        };
        if limits.shared_keys {
            let need = self.windows + self.registrations;
            if need > limits.max_mw {
                add(Exceeded { limit: Limit::WindowsAndRegistrations, need, have: limits.max_mw });
            }
        } else {
            if self.windows > limits.max_mw {
                add(Exceeded { limit: Limit::Windows, need: self.windows, have: limits.max_mw });
            }
            if self.registrations > limits.max_mr {
                add(Exceeded { limit: Limit::Registrations, need: self.registrations, have: limits.max_mr });
            }
        }
        if self.qps > limits.max_qp {
            add(Exceeded { limit: Limit::QueuePairs, need: self.qps, have: limits.max_qp });
        }
        out
    }
}

/// A device limit a configuration can break.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Limit {
    /// `max_mw`: G windows per chunk.
    Windows,
    /// `max_mr`.
    Registrations,
    /// Windows and registrations together, where they share one table (mlx5 mkeys).
    WindowsAndRegistrations,
    /// `max_qp`.
    QueuePairs,
}

/// A limit a configuration breaks: what it needs, what the device has.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Exceeded {
    pub limit: Limit,
    pub need: u64,
    pub have: u64,
}

impl fmt::Display for Exceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (what, how) = match self.limit {
            Limit::Windows => ("memory windows", "max_mw"),
            Limit::Registrations => ("memory registrations", "max_mr"),
            Limit::WindowsAndRegistrations => ("memory windows and registrations (one key table)", "max_mw"),
            Limit::QueuePairs => ("queue pairs", "max_qp"),
        };
        write!(f, "needs {} {what}, the device's {how} is {}", self.need, self.have)
    }
}

/// The largest pool of `chunk_size` chunks and groups of `group_size` a device's windows
/// allow (and the core's [`MAX_CHUNKS`]): what to offer instead of a refused pool.
pub fn max_chunks(limits: &DeviceLimits, plan: &MnPlan, group_size: u8) -> u32 {
    let g = group_size.max(1) as u64;
    let room = if limits.shared_keys {
        // each chunk costs G windows, and one MR more when MRs are per chunk
        let per = g + u64::from(plan.per_chunk_mrs);
        limits.max_mw.saturating_sub(plan.metadata_registrations() + u64::from(!plan.per_chunk_mrs)) / per
    } else {
        let by_mr =
            if plan.per_chunk_mrs { limits.max_mr.saturating_sub(plan.metadata_registrations()) } else { u64::MAX };
        (limits.max_mw / g).min(by_mr)
    };
    room.min(MAX_CHUNKS as u64) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Capabilities;
    use crate::mn::plan::MnOptions;

    fn offloaded() -> MnPlan {
        let caps = Capabilities::SECURE_MINIMUM
            | Capabilities::ATOMICS
            | Capabilities::MASKED_FETCH_ADD
            | Capabilities::WAIT_ENABLE
            | Capabilities::SELF_MODIFYING_WQE
            | Capabilities::BIND_TO_OTHER_QP
            | Capabilities::MW_QP_CHECK_ON_INVALIDATE
            | Capabilities::MW_BOUNDS_ENFORCED;
        let p = MnPlan::decide(caps, MnOptions::default()).unwrap();
        assert_eq!(p.mode, ExecutionMode::Offloaded);
        p
    }

    fn spec(chunks: u32, g: u8) -> PoolSpec {
        PoolSpec { chunk_size: 4096, chunks, group_size: g, max_cns: 16, quota: 0, lease_ns: 0, queue_depth: None }
    }

    #[test]
    fn a_million_chunks_fit_a_connectx6_and_the_footprint_is_what_provisioning_makes() {
        let plan = offloaded();
        let f = Footprint::of(&plan, &spec(1 << 20, 3)).unwrap();
        assert_eq!(f.windows, 3 << 20);
        assert_eq!(f.registrations, plan.metadata_registrations() + 1);
        // 16 CNs × (Alloc, Free, 2 access, 4 loop ends) + admin and atomic pairs
        assert_eq!(f.qps, 16 * 8 + 4);
        assert!(f.check(&DeviceLimits::CONNECTX6).is_empty());
        // 56 B of MWTable entry, 2 × 8 B of queue slot (the ring rounded up to 2^21 slots)
        // per chunk
        assert!((72.0..73.0).contains(&f.metadata_per_chunk()), "{}", f.metadata_per_chunk());
    }

    #[test]
    fn extra_alloc_chains_count_their_qps_and_scratch() {
        let plan = offloaded();
        let one = Footprint::of(&plan, &spec(1024, 3)).unwrap();
        let three = Footprint::of_chains(&plan, &spec(1024, 3), 3).unwrap();
        // per CN and extra chain: an Alloc QP and a loop QP's two ends
        assert_eq!(three.qps, one.qps + 16 * 2 * 3);
        // a scratch area per chain (and the ring's room for a ticket per chain)
        assert!(three.metadata_bytes >= one.metadata_bytes + 16 * 2 * crate::wire::memory_map::SCRATCH_PER_CN);
        assert_eq!(three.metadata_bytes, MnMemoryMap::len_for(&PoolGeometry::new(4096, 4096, 1024, 3).unwrap(), 48));
        // clamped as provisioning clamps
        assert_eq!(Footprint::of_chains(&plan, &spec(1024, 3), 9), Footprint::of_chains(&plan, &spec(1024, 3), 4));
        assert_eq!(Footprint::of_chains(&plan, &spec(1024, 3), 0), Ok(one));
        // the host engine: one more Alloc QP per extra chain, no loop QPs
        let host = MnPlan::decide(Capabilities::SECURE_MINIMUM, MnOptions::default()).unwrap();
        assert_eq!(host.mode, ExecutionMode::HostEngine);
        let h1 = Footprint::of(&host, &spec(1024, 3)).unwrap();
        let h2 = Footprint::of_chains(&host, &spec(1024, 3), 2).unwrap();
        assert_eq!(h2.qps, h1.qps + 16);
    }

    #[test]
    fn windows_beyond_the_key_table_are_refused_naming_the_limit() {
        let plan = offloaded();
        let cx6 = DeviceLimits::CONNECTX6;
        // 2^20 chunks at G = 3: a device with 2^21 keys cannot
        let small = DeviceLimits { max_mw: 1 << 21, max_mr: 1 << 21, ..cx6 };
        let f = Footprint::of(&plan, &spec(1 << 20, 3)).unwrap();
        let broken = f.check(&small);
        assert_eq!(broken.len(), 1);
        assert_eq!(broken[0].limit, Limit::WindowsAndRegistrations);
        assert_eq!(broken[0].need, (3 << 20) + plan.metadata_registrations() + 1);
        assert!(std::format!("{}", broken[0]).contains("max_mw is 2097152"));
        assert_eq!(max_chunks(&small, &plan, 3), ((1u64 << 21) - plan.metadata_registrations() - 1) as u32 / 3);
        // beyond the core's bound the geometry refuses
        assert_eq!(Footprint::of(&plan, &spec(MAX_CHUNKS + 1, 2)), Err(GeometryError::TooManyChunks(MAX_CHUNKS + 1)));
        // the core's bound is the key index space's, so on a ConnectX-6 it is the device that
        // bounds: 2^22 chunks fit at G = 2, 2^23 (the core's bound) need every key and more
        assert!(Footprint::of(&plan, &spec(1 << 22, 2)).unwrap().check(&cx6).is_empty());
        let all = Footprint::of(&plan, &spec(MAX_CHUNKS, 2)).unwrap().check(&cx6);
        assert_eq!((all.len(), all[0].need), (1, (1 << 24) + plan.metadata_registrations() + 1));
        assert_eq!(max_chunks(&cx6, &plan, 2), ((1u64 << 24) - plan.metadata_registrations() - 1) as u32 / 2);
        assert!(max_chunks(&cx6, &plan, 2) < MAX_CHUNKS && max_chunks(&cx6, &plan, 2) > 1 << 22);
        // queue pairs: a device with 64
        let few = DeviceLimits { max_qp: 64, ..cx6 };
        let broken = Footprint::of(&plan, &spec(1024, 3)).unwrap().check(&few);
        assert_eq!(broken[0].limit, Limit::QueuePairs);
        // separate tables: windows and MRs each against their own limit
        let split = DeviceLimits { max_mw: 1000, max_mr: 1 << 20, max_qp: 1 << 17, shared_keys: false };
        let broken = Footprint::of(&plan, &spec(1024, 2)).unwrap().check(&split);
        assert_eq!(broken[0].limit, Limit::Windows);
        assert_eq!((broken[0].need, broken[0].have), (2048, 1000));
    }
}
