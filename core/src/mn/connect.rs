//! Connections: a CN (of a tenant, or alone) gets an id, a slot, its scratch areas and its chains.

use super::*;
use crate::wire::message::ConnectFlags;

impl MemoryNode {
    /// A CN connected with these MN-side QPs: assign it an id and a slot, prepare its scratch,
    /// arm its chains (or post request buffers), and tell it who it is.
    pub fn connect<P: MnPort>(&mut self, port: &mut P, qps: CnQps) -> Result<CnId, MnError<P::Error>> {
        self.connect_as(port, qps, None)
    }

    /// A tenant the deployment authenticates CNs as: its limits hold over all its CNs.
    pub fn add_tenant(&mut self, id: TenantId, limits: TenantLimits) -> Result<(), TenantError> {
        self.tenants.add(id, limits)
    }

    pub fn tenants(&self) -> &TenantTable {
        &self.tenants
    }

    /// [`MemoryNode::connect`] for a CN the deployment authenticated as `tenant` (None: as
    /// `connect`). Refused — before anything is set up — for an unknown tenant or one whose CN
    /// slots are all taken.
    pub fn connect_as<P: MnPort>(
        &mut self,
        port: &mut P,
        qps: CnQps,
        tenant: Option<TenantId>,
    ) -> Result<CnId, MnError<P::Error>> {
        self.connect_with_chains(port, qps, &[], tenant)
    }

    /// [`MemoryNode::connect_as`] for a CN with alloc chains beyond its first: `extra` names
    /// the MN ends of each one's management QP (the CN's extra Alloc QP) and loop QP. At most
    /// [`MnConfig::alloc_chains`] in all, refused before anything is set up otherwise. Each is
    /// armed, stopped, repaired and counted exactly like the first.
    pub fn connect_with_chains<P: MnPort>(
        &mut self,
        port: &mut P,
        qps: CnQps,
        extra: &[AllocChainQps],
        tenant: Option<TenantId>,
    ) -> Result<CnId, MnError<P::Error>> {
        let asked = 1 + extra.len();
        if asked > self.cfg.alloc_chains as usize
            || (self.cfg.mode == ExecutionMode::Offloaded && extra.iter().any(|c| c.lp.is_none()))
        {
            return Err(MnError::AllocChains { allowed: self.cfg.alloc_chains, asked: asked.min(255) as u8 });
        }
        if let Some(t) = tenant {
            let connected = self.cns().filter(|r| r.tenant == Some(t)).count();
            self.tenants.admit(t, connected).map_err(MnError::Tenant)?;
        }
        let need = self.cfg.geometry.access_windows();
        if qps.access.len() != need {
            return Err(MnError::WrongAccessQpCount { expected: need, got: qps.access.len() });
        }
        if self.cfg.mode == ExecutionMode::Offloaded && (qps.alloc_loop.is_none() || qps.free_loop.is_none()) {
            return Err(MnError::MissingLoopQps);
        }
        let slot = self.cns.iter().position(|c| c.is_none()).ok_or(MnError::TooManyCns)? as u32;
        let cn = CnId::new(self.next_cn).map_err(|_| MnError::BadConfig)?;
        self.next_cn += 1;
        self.stats.events += 1;
        let rec = CnRecord {
            slot,
            cn,
            qps: qps.clone(),
            status: CnStatus::Active,
            alloc_parked: false,
            parked_chains: 0,
            allocs: 0,
            frees: 0,
            forged_frees: 0,
            bad_requests: 0,
            probed_at: self.now,
            probes: 0,
            probe_outstanding: false,
            tenant,
            extra_alloc: extra.iter().copied().collect(),
        };
        self.cns[slot as usize] = Some(rec);
        // the slot's counts were a departed CN's
        self.held[slot as usize] = 0;
        self.audit_pass[slot as usize] = 0;
        self.audit_held[slot as usize] = 0;
        self.counted_at[slot as usize] = (0, 0);
        self.alloc_in_flight[slot as usize] = 0;
        self.init_scratch(port, slot, cn, asked as u8)?;
        let mut flags = ConnectFlags::empty();
        flags.set(ConnectFlags::WINDOW_ATOMICS, self.cfg.window_access.contains(AccessFlags::REMOTE_ATOMIC));
        // chains that bind to the poster bind every window to the Alloc QP's MN end: the CN
        // names it for its access windows and reaches them through its Alloc QP (its access
        // QPs still carry the MN's messages)
        let on_alloc_qp = self.binds_to_poster();
        flags.set(ConnectFlags::WINDOWS_ON_ALLOC_QP, on_alloc_qp);
        let access_qpns = match on_alloc_qp {
            true => qps.access.iter().map(|_| qps.alloc).collect(),
            false => qps.access.clone(),
        };
        let info = ConnectInfo {
            cn,
            group_size: self.cfg.geometry.group_size() as u8,
            chunk_size: self.cfg.geometry.chunk_size(),
            alloc_qpn: qps.alloc,
            free_qpn: qps.free,
            access_qpns,
            quota: self.quota_of(cn),
            flags,
        };
        self.send(port, cn, &info.encode())?;
        self.arm(port, cn, ChainKind::Free)?;
        if self.empty {
            self.park_all(cn);
            self.send(port, cn, &Notice::Empty.encode())?;
        } else {
            self.arm(port, cn, ChainKind::Alloc)?;
        }
        Ok(cn)
    }

    /// Fresh scratch for the CN in `slot` and each of its `chains` alloc chains: every
    /// chain's reply image names the CN as owner.
    pub(super) fn init_scratch<P: MnPort>(&mut self, port: &mut P, slot: u32, cn: CnId, chains: u8) -> R<P::Error> {
        for j in 0..chains {
            let s = self.chain_scratch(slot, j).ok_or(MnError::BadConfig)?;
            port.write(s, &[0u8; SCRATCH_PER_CN as usize]).map_err(MnError::Port)?;
            let a = s + ALLOC_SCRATCH_OFF;
            port.write(a + alloc_scratch::OWNER, &cn.get().to_le_bytes()).map_err(MnError::Port)?;
            // binds to the poster: the stamp the serve phase writes over the entry it hands this
            // CN — its id and its proof key (`alloc_scratch::STAMP`)
            if let (true, Some(p)) = (self.binds_to_poster(), self.owner_proof(slot)) {
                let stamp = (u64::from(p.lkey) << 32) | u64::from(cn.get());
                port.write(a + alloc_scratch::STAMP, &stamp.to_le_bytes()).map_err(MnError::Port)?;
            }
            port.write(a + alloc_scratch::REPLY, &AllocReply::header_image(self.generation)).map_err(MnError::Port)?;
        }
        Ok(())
    }

    /// The MN end of the QP the MN's messages to `cn` travel on: a send queue on which no
    /// bind is ever posted, so a message stuck behind a CN that stopped posting receives can
    /// delay nothing but that CN. Offloaded: its first access QP (binds are posted on the
    /// chain QPs: the Alloc QP's send queue is the alloc chain's). Host engine: its Alloc QP
    /// (binds are posted on the Free and access QPs they bind to; the Alloc QP carries only
    /// replies, to the same CN).
    pub fn message_qp(&self, cn: CnId) -> Option<Qpn> {
        let r = self.cn(cn)?;
        Some(match self.cfg.mode {
            ExecutionMode::Offloaded => r.qps.access[0],
            ExecutionMode::HostEngine => r.qps.alloc,
        })
    }
}
