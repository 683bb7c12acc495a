//! Bringing an MN up: the plan's decisions ([`MnPlan`]) carried out on a device, ending in a
//! running [`MnDriver`] over a formatted pool. The plan decides; this file provisions what it
//! decided — so the policy never imports the mechanism it builds.

use crate::chain::arm::MnDevice;
use crate::geometry::{GeometryError, PoolGeometry, MAX_GROUP_SIZE};
use crate::ids::{GroupId, Rkey};
use crate::mn::driver::{DriverError, MnDriver};
use crate::mn::host_engine::HostRegions;
use crate::mn::plan::{MnPlan, MnRegions, PlanError};
use crate::mn::{MemoryNode, MnConfig, MnError};
use crate::wire::memory_map::MnMemoryMap;

/// The pool an MN serves, in the operator's terms.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PoolSpec {
    /// Bytes per chunk (a power of two, 512 B–1 GiB).
    pub chunk_size: u64,
    pub chunks: u32,
    /// Windows per chunk G (2..=4): MW\[0\] proves ownership, MW[1..G) carry data.
    pub group_size: u8,
    pub max_cns: u32,
    /// Groups one CN may hold at once (0: the whole pool).
    pub quota: u32,
    /// CN lease (ns, 0: off).
    pub lease_ns: u64,
    /// Send-queue depth of the MN's CN-facing QPs, if not the default.
    pub queue_depth: Option<u16>,
}

/// Why [`MnPlan::provision`] could not bring an MN up.
#[derive(Debug)]
#[non_exhaustive]
pub enum ProvisionError<E> {
    Geometry(GeometryError),
    /// The backend's memory is not aligned as the metadata map needs.
    Misaligned {
        addr: u64,
        align: u64,
    },
    Register(PlanError<E>),
    Backend(E),
    Node(MnError<core::convert::Infallible>),
    Driver(DriverError<E>),
}

impl<E: core::fmt::Display> core::fmt::Display for ProvisionError<E> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            ProvisionError::Geometry(e) => write!(f, "pool geometry: {e}"),
            ProvisionError::Misaligned { addr, align } => {
                write!(f, "metadata at {addr:#x} is not aligned to {align:#x} as the memory map needs")
            }
            ProvisionError::Register(e) => write!(f, "{e}"),
            ProvisionError::Backend(e) => write!(f, "setting up the device: {e}"),
            ProvisionError::Node(e) => write!(f, "MN configuration: {e}"),
            ProvisionError::Driver(e) => write!(f, "formatting the pool: {e}"),
        }
    }
}

impl MnPlan {
    /// Bring an MN up on `backend` through the [`MnDevice`] traits alone: memory for the
    /// pool, the metadata and the zero source; every registration with the rights this plan
    /// gives it; the admin QP (CN-facing: it unbinds CN-facing windows) and, offloaded, the MN
    /// CPU's atomic QP in the private domain; the windows, whose table keys follow
    /// [`MnPlan::initial_table_key`]; a formatted MWTable and full free queue. Every deployment
    /// and test starts its MN here, so none of them decides policy.
    pub fn provision<B: MnDevice>(&self, backend: B, spec: &PoolSpec) -> Result<MnDriver<B>, ProvisionError<B::Error>> {
        self.provision_chains(backend, spec, 1)
    }

    /// [`MnPlan::provision`] for an MN whose CNs may connect with up to `alloc_chains` alloc
    /// chains each ([`MnConfig::alloc_chains`], clamped to 1..=[`crate::mn::MAX_ALLOC_CHAINS`]):
    /// a scratch area per chain in the memory map, and room in the free queue's ring for one
    /// ticket per chain.
    pub fn provision_chains<B: MnDevice>(
        &self,
        mut backend: B,
        spec: &PoolSpec,
        alloc_chains: u8,
    ) -> Result<MnDriver<B>, ProvisionError<B::Error>> {
        let max_cns = spec.max_cns.clamp(1, crate::mn::MAX_CNS as u32);
        let alloc_chains = alloc_chains.clamp(1, crate::mn::MAX_ALLOC_CHAINS as u8);
        let scratch_slots = MemoryNode::scratch_slots(max_cns, alloc_chains);
        let sizing = PoolGeometry::new(spec.chunk_size, spec.chunk_size, spec.chunks, spec.group_size)
            .map_err(ProvisionError::Geometry)?;
        let pool = backend.alloc_memory(sizing.pool_len(), spec.chunk_size).map_err(ProvisionError::Backend)?;
        let geo =
            PoolGeometry::new(pool, spec.chunk_size, spec.chunks, spec.group_size).map_err(ProvisionError::Geometry)?;
        let align = MnMemoryMap::required_alignment(&geo, scratch_slots).max(64);
        let meta =
            backend.alloc_memory(MnMemoryMap::len_for(&geo, scratch_slots), align).map_err(ProvisionError::Backend)?;
        let map = MnMemoryMap::new(geo, scratch_slots, meta).ok_or(ProvisionError::Misaligned { addr: meta, align })?;
        let zero_source = match self.needs_zero_source() {
            true => Some(backend.alloc_memory(geo.chunk_size(), 64).map_err(ProvisionError::Backend)?),
            false => None,
        };
        let keys =
            self.register_metadata(&mut backend, &MnRegions { map, zero_source }).map_err(ProvisionError::Register)?;
        let pool_lkey = match self.per_chunk_mrs {
            true => None,
            false => {
                Some(self.register_chunks(&mut backend, geo.base(), geo.pool_len()).map_err(ProvisionError::Backend)?)
            }
        };
        let admin = backend.create_loopback_qp(self.cn_facing_domain(), None).map_err(ProvisionError::Backend)?;
        let atomic = match self.loop_domain() {
            Some(d) => Some(backend.create_loopback_qp(d, None).map_err(ProvisionError::Backend)?),
            None => None,
        };
        let quota = if spec.quota == 0 { spec.chunks } else { spec.quota };
        let mut cfg = MnConfig::from_plan(self, geo, max_cns, quota);
        cfg.lease_ns = spec.lease_ns;
        cfg.alloc_chains = alloc_chains;
        // every alloc chain holds a group ahead
        cfg.pop_ahead =
            MnConfig::pop_ahead_pays(self.mode, geo.chunk_count(), max_cns.saturating_mul(alloc_chains.into()));
        if let Some(d) = spec.queue_depth {
            cfg.queue_depth = d;
        }
        let node = MemoryNode::new(cfg, map, keys).map_err(|e| match e.split() {
            Ok(r) => ProvisionError::Node(r),
            Err(never) => match never {},
        })?;
        let regions = HostRegions::new(&map, &keys);
        let mut driver = MnDriver::new(backend, node, regions, admin);
        if let Some(q) = atomic {
            driver = driver.with_atomic_qp(q);
        }
        driver.format_begin().map_err(ProvisionError::Driver)?;
        for i in 0..geo.chunk_count() {
            let g = GroupId(i);
            let lkey = match pool_lkey {
                Some(k) => k,
                None => {
                    let base = geo.chunk_base(g).ok_or(ProvisionError::Geometry(GeometryError::RegionOverflows))?;
                    self.register_chunks(&mut driver.backend, base, geo.chunk_size())
                        .map_err(ProvisionError::Backend)?
                }
            };
            let mut rkeys: heapless::Vec<Rkey, MAX_GROUP_SIZE> = heapless::Vec::new();
            for _ in 0..geo.group_size() {
                let k = driver.backend.alloc_mw().map_err(ProvisionError::Backend)?;
                let pushed = rkeys.push(self.initial_table_key(k));
                debug_assert!(pushed.is_ok(), "one key per window: G <= MAX_GROUP_SIZE (PoolGeometry::new)");
            }
            driver.format_group(g, lkey, &rkeys).map_err(ProvisionError::Driver)?;
        }
        driver.format_end().map_err(ProvisionError::Driver)?;
        Ok(driver)
    }
}
