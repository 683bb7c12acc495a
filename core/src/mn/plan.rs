//! The MN plan: every security-relevant set-up decision, made once, from the device's
//! [`Capabilities`] and the operator's options — execution mode, which protection domain each
//! registration and QP lives in, the rights of every registration, per-chunk MRs, the
//! software ownership check, and how freed chunks are scrubbed. Every deployment (the
//! loopback cluster, the verbs daemon, the FPGA tests) brings its MN up through
//! [`MnPlan::provision`] — MN-private memory registered by [`MnPlan::register_metadata`], the
//! pool the windows bind in once or per chunk — so the policy cannot drift between backends.
//!
//! The rules (DESIGN.md §9 — isolation from protection domains, never from a key being secret):
//! - CN-facing QPs, the pool and every window are in [`Domain::CnFacing`]. There MN-private
//!   memory (metadata: queue, MWTable, scratch; the WQE rings) is registered **local-only**:
//!   receives scatter into it and sends read from it, but no rkey a CN names opens it.
//! - Offloaded mode's loopback QPs (both ends) are in [`Domain::MnPrivate`], the only domain in
//!   which metadata and rings carry remote rights (the chains READ, WRITE and fetch-and-add
//!   them through the loop QP). A CN has no QP in that domain, so no key — guessed, leaked or
//!   counted — reaches that memory from a CN.
//! - Host-engine mode registers no remote rights on MN-private memory at all: the MN CPU does
//!   the loop operations itself.
//! - The pool is registered `MW_BIND | LOCAL_WRITE` in the CN-facing domain: windows bind in
//!   it, it grants no remote right by itself. When the offloaded free chain scrubs chunks, the
//!   pool is registered once more in the private domain with REMOTE_WRITE, and a chunk-sized
//!   source of zeros local-only there.

use crate::access::AccessFlags;
use crate::device::{Capabilities, Domain, ExecutionMode, ModeError, MrKeys, RdmaBackend};
use crate::geometry::PoolGeometry;
pub use crate::mn::ScrubPath;
use crate::mn::{MnConfig, MnKeys, DEFAULT_AUDIT_NS, DEFAULT_LEASE_NS};
use crate::wire::memory_map::MnMemoryMap;

/// What the operator decides (everything else follows from the device).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MnOptions {
    /// Demand a mode (None: offload if the device can).
    pub mode: Option<ExecutionMode>,
    /// Serve a pool on a device that cannot isolate CNs (never the default).
    pub allow_insecure: bool,
    /// Zero every chunk before it can reach its next owner (the default). Turning it off lets
    /// the next owner read what the last one left; `omw bench` shows what it costs.
    pub scrub: bool,
}

impl Default for MnOptions {
    fn default() -> Self {
        MnOptions { mode: None, allow_insecure: false, scrub: true }
    }
}

/// The decisions. Cheap to copy; see the module doc for the rules.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MnPlan {
    pub caps: Capabilities,
    pub mode: ExecutionMode,
    /// Devices that do not enforce window bounds (soft-RoCE) get one MR per chunk, so the MR's
    /// bounds confine each window to its chunk.
    pub per_chunk_mrs: bool,
    /// Host-engine mode on devices that let any QP invalidate a type-2 window (soft-RoCE): the
    /// engine compares the MWTable owner before the ownership-proving invalidation.
    pub software_ownership_check: bool,
    pub scrub: ScrubPath,
}

/// Rights of MN-private memory where the loop QPs reach it.
const PRIVATE_REMOTE: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC);

/// What one registration covers.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Region {
    /// Queue, head/tail, MWTable, scratch.
    Metadata,
    /// The MWTable alone: entry addresses from the network are dereferenced through it, so an
    /// address outside the table faults.
    Table,
    /// Every WQE ring of the MN.
    Rings,
    /// The pool (or one chunk of it, with per-chunk MRs).
    Pool,
    /// A chunk of zeros the offloaded free chain writes from.
    ZeroSource,
}

/// One registration the plan asks for.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub struct Registration {
    pub region: Region,
    pub domain: Domain,
    pub access: AccessFlags,
}

/// Where a deployment put the memory the plan registers (the rings are the backend's own:
/// [`OffloadRings::ring_keys`](crate::device::OffloadRings::ring_keys)).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MnRegions {
    pub map: MnMemoryMap,
    /// A chunk-sized, zero-filled buffer, when [`MnPlan::needs_zero_source`].
    pub zero_source: Option<u64>,
}

/// Why provisioning failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum PlanError<E> {
    Mode(ModeError),
    /// Scrubbing by the NIC needs a chunk of zeros the deployment did not provide.
    NoZeroSource,
    Backend(E),
}

impl<E: core::fmt::Display> core::fmt::Display for PlanError<E> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PlanError::Mode(e) => write!(f, "{e}"),
            PlanError::NoZeroSource => {
                f.write_str("offloaded scrubbing needs a chunk-sized zero buffer (MnRegions::zero_source)")
            }
            PlanError::Backend(e) => write!(f, "registering MN memory: {e}"),
        }
    }
}

impl MnPlan {
    /// One CN-facing registration of pool memory with the rights windows bind in.
    pub(crate) fn register_chunks<B: RdmaBackend>(&self, b: &mut B, base: u64, len: u64) -> Result<u32, B::Error> {
        b.reg_mr(Domain::CnFacing, base, len, self.pool_access()).map(|k| k.lkey)
    }

    /// Decide everything from the device and the operator.
    pub fn decide(caps: Capabilities, opts: MnOptions) -> Result<MnPlan, ModeError> {
        let mode = ExecutionMode::choose(caps, opts.mode, opts.allow_insecure)?;
        let scrub = match (opts.scrub, mode) {
            (false, _) => ScrubPath::Off,
            (true, ExecutionMode::Offloaded) => ScrubPath::Nic,
            (true, ExecutionMode::HostEngine) => ScrubPath::Cpu,
        };
        Ok(MnPlan {
            caps,
            mode,
            per_chunk_mrs: !caps.contains(Capabilities::MW_BOUNDS_ENFORCED),
            software_ownership_check: mode == ExecutionMode::HostEngine
                && !caps.contains(Capabilities::MW_QP_CHECK_ON_INVALIDATE),
            scrub,
        })
    }

    /// The domain of the MN's loopback QPs (both ends), if the mode has any.
    pub fn loop_domain(&self) -> Option<Domain> {
        (self.mode == ExecutionMode::Offloaded).then_some(Domain::MnPrivate)
    }

    /// The domain of every CN-facing QP (Alloc, Free, access) and of the MN's admin QP (it
    /// invalidates windows, which live there).
    pub const fn cn_facing_domain(&self) -> Domain {
        Domain::CnFacing
    }

    /// Whether the deployment must provide a chunk-sized zero buffer.
    pub fn needs_zero_source(&self) -> bool {
        self.scrub == ScrubPath::Nic
    }

    /// Every registration of MN-private memory and of the pool, in the order
    /// [`MnPlan::register_metadata`] makes them, the pool's CN-facing registration last
    /// ([`MnPlan::provision`] makes it, once or per chunk).
    pub fn registrations(&self) -> heapless::Vec<Registration, 8> {
        let mut v = heapless::Vec::new();
        let mut add = |region, domain, access| {
            let pushed = v.push(Registration { region, domain, access });
            debug_assert!(pushed.is_ok(), "at most 8: two CN-facing, five private (offloaded), the pool");
        };
        let local = AccessFlags::LOCAL_WRITE;
        add(Region::Metadata, Domain::CnFacing, local);
        add(Region::Rings, Domain::CnFacing, local);
        match self.mode {
            ExecutionMode::Offloaded => {
                add(Region::Metadata, Domain::MnPrivate, PRIVATE_REMOTE);
                add(Region::Table, Domain::MnPrivate, local | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE);
                add(Region::Rings, Domain::MnPrivate, PRIVATE_REMOTE);
                if self.scrub == ScrubPath::Nic {
                    add(Region::Pool, Domain::MnPrivate, local | AccessFlags::REMOTE_WRITE);
                    add(Region::ZeroSource, Domain::MnPrivate, AccessFlags::empty());
                }
            }
            ExecutionMode::HostEngine => {
                // the engine's software checks distinguish table and metadata by key: a second
                // local-only registration of the table gives it a key of its own
                add(Region::Table, Domain::CnFacing, local);
            }
        }
        add(Region::Pool, Domain::CnFacing, self.pool_access());
        v
    }

    /// Registrations besides the pool's CN-facing one (which is one, or one per chunk): what
    /// [`MnPlan::registrations`] lists before it, the rings' included (a backend registers its
    /// ring arena per domain).
    pub fn metadata_registrations(&self) -> u64 {
        self.registrations().len().saturating_sub(1) as u64
    }

    /// The key the MWTable records for a window freshly allocated with `allocated`: the key of
    /// its *next* bind, never the allocation's own (§3: a rebind must use a new key, so no key
    /// the device ever handed out becomes valid again). One policy for every backend.
    pub fn initial_table_key(&self, allocated: crate::ids::Rkey) -> crate::ids::Rkey {
        allocated.next_key()
    }

    /// Rights of the pool registration(s) the windows bind in.
    pub const fn pool_access(&self) -> AccessFlags {
        AccessFlags::MW_BIND.union(AccessFlags::LOCAL_WRITE)
    }

    /// Register MN-private memory (metadata, table, rings, and for NIC scrubbing the pool's
    /// private registration and the zero source). Returns the keys the chains, the host engine
    /// and the driver use.
    pub fn register_metadata<B: RdmaBackend>(
        &self,
        backend: &mut B,
        regions: &MnRegions,
    ) -> Result<MnKeys, PlanError<B::Error>> {
        let map = &regions.map;
        let geo = map.geometry;
        let mut keys = MnKeys::default();
        let meta = |b: &mut B, d, a| b.reg_mr(d, map.meta_base, map.meta_len, a).map_err(PlanError::Backend);
        let cn_meta = meta(backend, Domain::CnFacing, AccessFlags::LOCAL_WRITE)?;
        keys.cn_meta_lkey = cn_meta.lkey;
        // the ring registration is the backend's own (its rings are its memory)
        keys.cn_ring_lkey = backend.ring_keys(Domain::CnFacing).map_err(PlanError::Backend)?.lkey;
        match self.mode {
            ExecutionMode::Offloaded => {
                let m = meta(backend, Domain::MnPrivate, PRIVATE_REMOTE)?;
                let t = backend
                    .reg_mr(
                        Domain::MnPrivate,
                        map.table_base,
                        map.table_len(),
                        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
                    )
                    .map_err(PlanError::Backend)?;
                let r: MrKeys = backend.ring_keys(Domain::MnPrivate).map_err(PlanError::Backend)?;
                keys.meta_lkey = m.lkey;
                keys.meta_rkey = m.rkey;
                keys.table_rkey = t.rkey;
                keys.ring_lkey = r.lkey;
                keys.ring_rkey = r.rkey;
                if self.scrub == ScrubPath::Nic {
                    let zero = regions.zero_source.ok_or(PlanError::NoZeroSource)?;
                    let p = backend
                        .reg_mr(
                            Domain::MnPrivate,
                            geo.base(),
                            geo.pool_len(),
                            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
                        )
                        .map_err(PlanError::Backend)?;
                    let z = backend
                        .reg_mr(Domain::MnPrivate, zero, geo.chunk_size(), AccessFlags::empty())
                        .map_err(PlanError::Backend)?;
                    keys.pool_scrub_rkey = p.rkey;
                    keys.zero_addr = zero;
                    keys.zero_lkey = z.lkey;
                }
            }
            ExecutionMode::HostEngine => {
                let t = backend
                    .reg_mr(Domain::CnFacing, map.table_base, map.table_len(), AccessFlags::LOCAL_WRITE)
                    .map_err(PlanError::Backend)?;
                // No remote right anywhere: the "rkeys" the host engine checks are names for
                // its software region check. They are the registrations' *lkeys* — distinct per
                // MR, where a device may report the same rkey (rxe: 0) for every MR without
                // remote rights — and no remote access can use them.
                keys.meta_lkey = cn_meta.lkey;
                keys.meta_rkey = cn_meta.lkey;
                keys.table_rkey = t.lkey;
                keys.ring_lkey = keys.cn_ring_lkey;
                keys.ring_rkey = keys.cn_ring_lkey;
            }
        }
        Ok(keys)
    }
}

impl MnConfig {
    /// The configuration an [`MnPlan`] implies for a pool (queue depth 128, data windows
    /// read/write, and atomic where the device carries atomics through a window:
    /// [`Capabilities::MW_ATOMICS`]).
    pub fn from_plan(plan: &MnPlan, geometry: PoolGeometry, max_cns: u32, quota: u32) -> Self {
        MnConfig {
            geometry,
            max_cns,
            quota,
            mode: plan.mode,
            software_ownership_check: plan.software_ownership_check,
            queue_depth: 128,
            window_access: if plan.caps.contains(Capabilities::MW_ATOMICS) {
                AccessFlags::DATA_WINDOW.union(AccessFlags::REMOTE_ATOMIC)
            } else {
                AccessFlags::DATA_WINDOW
            },
            scrub: plan.scrub,
            lease_ns: DEFAULT_LEASE_NS,
            audit_ns: DEFAULT_AUDIT_NS,
            pop_ahead: MnConfig::pop_ahead_pays(plan.mode, geometry.chunk_count(), max_cns),
            chain_variant: crate::chain::variant::ChainVariant::default(),
            audit_batch: crate::mn::DEFAULT_AUDIT_BATCH,
            alloc_chains: 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chain::mlx5::{Mlx5Arm, Mlx5Chain};
    use crate::device::{Completion, DataPath, MwBinding, OffloadRings, Provision, QpState, WindowState};
    use crate::ids::{Qpn, Rkey};
    use crate::wire::wqe::{QueueSel, RecvWqe, Wqe};

    /// Records registrations; reports rkey 0 for MRs without remote rights (as rxe does).
    #[derive(Default)]
    struct Recorder {
        regs: heapless::Vec<(Domain, u64, u64, AccessFlags), 16>,
    }
    impl DataPath for Recorder {
        type Error = &'static str;
        fn capabilities(&self) -> Capabilities {
            Capabilities::SECURE_MINIMUM
        }
        fn post_send(&mut self, _: Qpn, _: &Wqe) -> Result<(), Self::Error> {
            Err("unused")
        }
        fn post_recv(&mut self, _: Qpn, _: &RecvWqe) -> Result<(), Self::Error> {
            Err("unused")
        }
        fn poll_cq(&mut self, _: Qpn, _: QueueSel, _: &mut [Completion]) -> Result<usize, Self::Error> {
            Ok(0)
        }
        fn enable(&mut self, _: Qpn, _: QueueSel, _: u64) -> Result<(), Self::Error> {
            Err("unused")
        }
        fn reset_qp(&mut self, _: Qpn) -> Result<(), Self::Error> {
            Ok(())
        }
        fn destroy_qp(&mut self, _: Qpn) -> Result<(), Self::Error> {
            Ok(())
        }
        fn qp_state(&self, _: Qpn) -> Result<QpState, Self::Error> {
            Ok(QpState::Rts)
        }
        fn read_local(&self, _: u64, _: &mut [u8]) -> Result<(), Self::Error> {
            Ok(())
        }
        fn write_local(&mut self, _: u64, _: &[u8]) -> Result<(), Self::Error> {
            Ok(())
        }
        fn outstanding(&self, _qp: Qpn, _queue: QueueSel) -> Option<u64> {
            None
        }
    }

    impl Provision for Recorder {
        fn reg_mr(&mut self, d: Domain, addr: u64, len: u64, a: AccessFlags) -> Result<MrKeys, Self::Error> {
            self.regs.push((d, addr, len, a)).map_err(|_| "full")?;
            let lkey = 0x100 * self.regs.len() as u32 + 7;
            let remote =
                a.intersects(AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC);
            Ok(MrKeys { lkey, rkey: if remote { lkey } else { 0 } })
        }
        fn alloc_mw(&mut self) -> Result<Rkey, Self::Error> {
            Err("unused")
        }
        fn alloc_memory(&mut self, _: u64, _: u64) -> Result<u64, Self::Error> {
            Err("unused")
        }
        fn create_loopback_qp(&mut self, _: Domain, _: Option<u32>) -> Result<Qpn, Self::Error> {
            Err("unused")
        }
    }

    impl OffloadRings for Recorder {
        fn ring_base(&self, _: Qpn, _: QueueSel) -> Result<u64, Self::Error> {
            Err("unused")
        }
        fn ring_keys(&self, d: Domain) -> Result<MrKeys, Self::Error> {
            match d {
                Domain::CnFacing => Ok(MrKeys { lkey: 0x55, rkey: 0 }),
                Domain::MnPrivate => Ok(MrKeys { lkey: 0x66, rkey: 0x66 }),
            }
        }
        fn send_wqes_executed(&self, _: Qpn) -> Option<u64> {
            None
        }
        fn recv_doorbell(&self, _: Qpn) -> Result<Option<crate::device::RecvDoorbell>, Self::Error> {
            Ok(None)
        }
    }

    impl WindowState for Recorder {
        fn mw_binding(&self, _rkey: Rkey) -> Option<MwBinding> {
            None
        }
        fn mw_span(&self, _rkey: Rkey) -> Option<(u64, u64)> {
            None
        }
    }

    impl Mlx5Arm for Recorder {
        fn cq_numbers(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> Option<[u32; 3]> {
            None
        }
        fn cq_producer_indices(&self, _loop_qp: Qpn, _mgmt_qp: Qpn) -> [u32; 3] {
            [0; 3]
        }
        fn arm_mlx5(&mut self, _chain: &Mlx5Chain, _recv_copies: u32) -> Option<Result<(), Self::Error>> {
            None
        }
    }

    fn map() -> MnMemoryMap {
        let geo = PoolGeometry::new(1 << 30, 4096, 16, 3).unwrap();
        MnMemoryMap::new(geo, 4, 1 << 20).unwrap()
    }

    const REMOTE: AccessFlags =
        AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE).union(AccessFlags::REMOTE_ATOMIC);

    #[test]
    fn host_engine_registers_no_remote_rights_and_names_regions_apart() {
        let plan = MnPlan::decide(Capabilities::SECURE_MINIMUM, MnOptions::default()).unwrap();
        assert_eq!(plan.mode, ExecutionMode::HostEngine);
        assert!(plan.per_chunk_mrs && plan.software_ownership_check);
        assert_eq!(plan.scrub, ScrubPath::Cpu);
        let mut b = Recorder::default();
        let k = plan.register_metadata(&mut b, &MnRegions { map: map(), zero_source: None }).unwrap();
        assert!(b.regs.iter().all(|r| !r.3.intersects(REMOTE) && r.0 == Domain::CnFacing));
        // the device reported rkey 0 for both: the engine's region names must still differ
        assert_ne!(k.meta_rkey, k.table_rkey);
        assert_eq!(k.cn_meta_lkey, k.meta_lkey);
        assert!(plan.registrations().iter().all(|r| !r.access.intersects(REMOTE)));
    }

    #[test]
    fn offload_keeps_remote_rights_in_the_private_domain_only() {
        let plan =
            MnPlan::decide(Capabilities::OFFLOAD | Capabilities::MW_BOUNDS_ENFORCED, MnOptions::default()).unwrap();
        assert_eq!(plan.mode, ExecutionMode::Offloaded);
        assert_eq!(plan.loop_domain(), Some(Domain::MnPrivate));
        assert!(!plan.per_chunk_mrs && plan.needs_zero_source());
        let mut b = Recorder::default();
        assert!(matches!(
            plan.register_metadata(&mut b, &MnRegions { map: map(), zero_source: None }),
            Err(PlanError::NoZeroSource)
        ));
        let mut b = Recorder::default();
        let k = plan.register_metadata(&mut b, &MnRegions { map: map(), zero_source: Some(1 << 29) }).unwrap();
        for (d, _, _, a) in b.regs.iter() {
            assert!(*d == Domain::MnPrivate || !a.intersects(REMOTE), "{d:?} {a:?}");
        }
        assert!(k.pool_scrub_rkey != 0 && k.zero_lkey != 0);
        assert_ne!(k.cn_meta_lkey, k.meta_lkey, "loop and CN-facing WQEs use different registrations");
        let off = MnPlan::decide(Capabilities::OFFLOAD, MnOptions { scrub: false, ..MnOptions::default() }).unwrap();
        assert_eq!(off.scrub, ScrubPath::Off);
        assert!(!off.needs_zero_source());
    }

    #[test]
    fn an_insecure_device_is_refused_unless_asked() {
        assert!(MnPlan::decide(Capabilities::MW_TYPE2, MnOptions::default()).is_err());
        let p = MnPlan::decide(Capabilities::MW_TYPE2, MnOptions { allow_insecure: true, ..MnOptions::default() });
        assert!(p.is_ok());
        let table_key = MnPlan::decide(Capabilities::SECURE_MINIMUM, MnOptions::default()).unwrap();
        let k = Rkey::new(5, 0xFF).unwrap();
        assert_ne!(table_key.initial_table_key(k), k, "the table never records the allocation's own key");
    }
}
