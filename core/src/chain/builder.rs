//! What the alloc and free chain builders share: the environment a chain is built for (QP
//! numbers, memory keys, the memory map) and a small step-list builder that wires patches and
//! the lap re-arm tail.

use crate::access::AccessFlags;
use crate::chain::{ChainKind, ChainLayout, Loc, Rearm, RecvTarget, Ring, Step, MAX_STEPS};
use crate::geometry::PoolGeometry;
use crate::ids::CnId;
use crate::wire::memory_map::{MnKeys, MnMemoryMap};
use crate::wire::wqe::{Opcode, QueueSel, Wqe, WqeField, WqeFlags};

/// Everything a chain's bytes depend on besides the request: fixed when the CN connects.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ChainEnv {
    pub map: MnMemoryMap,
    /// The CN's connection slot (selects its scratch area).
    pub slot: u32,
    pub cn: CnId,
    /// MN end of the chain's loopback QP pair.
    pub loop_qpn: u32,
    /// MN end of the management QP (Alloc QP for the alloc chain, Free QP for the free chain).
    pub mgmt_qpn: u32,
    /// MN end of the CN's Free QP: MW\[0\] of every group the CN allocates is bound there.
    pub free_qpn: u32,
    /// The MN's registrations: `meta_*` over the whole metadata region (queue, table,
    /// scratch), `table_rkey` over the MWTable only (entry addresses from the network are
    /// dereferenced through it), `ring_*` over the rings (chains patch and bump their own
    /// WQEs) — all in the loop QPs' private domain — and the CN-facing local-only keys that
    /// WQEs and receives on the management QP use.
    pub keys: MnKeys,
    pub queue_depth: u16,
    /// Rights of the access windows MW[1..G).
    pub window_access: AccessFlags,
    /// Rights of MW\[0\] (bound to the Free QP; it proves ownership, it is not for data).
    pub owner_window_access: AccessFlags,
    /// The alloc chain pops the next request's group before that request arrives
    /// (`chain::alloc`); otherwise after it, on the request's path.
    pub pop_ahead: bool,
    /// The layout variant the device's answers chose (`chain::variant`).
    pub variant: crate::chain::variant::ChainVariant,
    /// Each lap publishes the next receive itself through the receive doorbell record
    /// (`Capabilities::RECV_DOORBELL_RECORD`), right after its receive ENABLE: one receive
    /// available at a time under either receive answer, so a second request on the chain waits
    /// (RNR) until the lap before it is done with the receive's targets, instead of scattering
    /// into it. Without it, a device whose doorbell makes every posted receive available lets
    /// pipelined requests on one chain land in a running lap.
    pub posts_receives: bool,
    /// With `ChainVariant::binds_to_poster`: the CN's proof word and the key of the MR that
    /// covers it and nothing else (`chain::free`; the MN registers one per CN slot,
    /// `MnDriver::register_owner_proofs`). The free chain needs it; `None` elsewhere.
    pub owner_proof: Option<OwnerProof>,
}

/// One CN slot's proof of ownership under `ChainVariant::binds_to_poster`: an 8-byte word
/// outside every other registration of the MN's private domain, and the local key of the MR
/// over exactly that word. The alloc chain stamps the key into every entry it hands the CN
/// (`MwTableEntry::proof_lkey`); the free chain READs into the word with the key the entry
/// names — only the owner's key covers the requester's word, so any other entry fails the
/// READ with a local protection error and stops the lap.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct OwnerProof {
    pub addr: u64,
    pub lkey: u32,
}

impl OwnerProof {
    /// Bytes of one proof word.
    pub const LEN: u32 = 8;
}

impl ChainEnv {
    pub fn geometry(&self) -> &PoolGeometry {
        &self.map.geometry
    }
    pub fn scratch(&self) -> u64 {
        // slot < max_cns is checked where the env is created (MN connect)
        self.map.scratch(self.slot).unwrap_or(self.map.scratch_base)
    }
}

/// wr_id of a chain step: kind, connection slot and step index, so a completion (error) names
/// exactly which step of which CN's chain it came from.
pub const fn chain_wr_id(kind: ChainKind, slot: u32, step: u8) -> u64 {
    let k = match kind {
        ChainKind::Alloc => 1u64,
        ChainKind::Free => 2u64,
    };
    (0x4F4D_u64 << 48) | (k << 40) | ((slot as u64 & 0xFF_FFFF) << 8) | step as u64
}

/// Inverse of [`chain_wr_id`]; None for wr_ids that are not chain steps.
pub fn parse_chain_wr_id(wr_id: u64) -> Option<(ChainKind, u32, u8)> {
    if wr_id >> 48 != 0x4F4D {
        return None;
    }
    let kind = match (wr_id >> 40) & 0xFF {
        1 => ChainKind::Alloc,
        2 => ChainKind::Free,
        _ => return None,
    };
    Some((kind, ((wr_id >> 8) & 0xFF_FFFF) as u32, (wr_id & 0xFF) as u8))
}

/// `w` with the FENCE flag: it executes only after every earlier READ and atomic of its QP
/// completed.
pub(crate) const fn fenced(w: Wqe) -> Wqe {
    let f = w.flags.union(WqeFlags::FENCE);
    w.with_flags(f)
}

pub(crate) struct Builder {
    pub layout: ChainLayout,
    slot: u32,
    /// Index of the lap-closing ENABLE once `lap_tail` has run.
    pub closing: u8,
    /// With `ChainVariant::relays_gates`: each relay, as (the Loop ring's ENABLE of the
    /// management ring that releases it, the management ring's ENABLE of the Loop ring).
    relays: heapless::Vec<(u8, u8), 8>,
}

impl Builder {
    pub fn new(kind: ChainKind, env: &ChainEnv) -> Self {
        Builder {
            layout: ChainLayout {
                kind,
                steps: heapless::Vec::new(),
                recv: heapless::Vec::new(),
                qpns: [env.loop_qpn, env.mgmt_qpn],
                initial_enable: [0, 0],
                initial_recv_enable: if env.variant.lap_enables_its_receive { 0 } else { 1 },
                rearm: Rearm::SelfEnabling,
                queue_depth: env.queue_depth,
                ring_depth: [0, 0],
                // the RECV is posted on the management QP: CN-facing keys
                meta_lkey: env.keys.cn_meta_lkey,
                ring_lkey: env.keys.cn_ring_lkey,
                meta: (env.map.meta_base, env.map.meta_len),
                zero_source: if env.keys.zero_lkey != 0 {
                    (env.keys.zero_addr, env.map.geometry.chunk_size())
                } else {
                    (0, 0)
                },
                proof_sink: match (kind, env.owner_proof) {
                    (ChainKind::Free, Some(p)) if env.variant.binds_to_poster => (p.addr, OwnerProof::LEN as u64),
                    _ => (0, 0),
                },
                empty_probe: None,
                ownership_check: None,
                critical_end: None,
                request_wait: None,
                mlx5: {
                    let (k, s) = (kind as usize, env.scratch());
                    let junk = match kind {
                        ChainKind::Alloc => {
                            crate::wire::memory_map::ALLOC_SCRATCH_OFF + crate::wire::memory_map::alloc_scratch::JUNK
                        }
                        ChainKind::Free => {
                            crate::wire::memory_map::FREE_SCRATCH_OFF + crate::wire::memory_map::free_scratch::JUNK
                        }
                    };
                    crate::chain::Mlx5Scratch {
                        shadows: s + crate::wire::memory_map::MLX5_SHADOW_OFF[k],
                        junk: s + junk,
                        meta_lkey: env.keys.meta_lkey,
                        meta_rkey: env.keys.meta_rkey,
                        ring_lkey: env.keys.ring_lkey,
                        send_en_unit: env.variant.send_en_unit,
                    }
                },
            },
            slot: env.slot,
            closing: 0,
            relays: heapless::Vec::new(),
        }
    }
    pub fn next(&self) -> u8 {
        self.layout.steps.len() as u8
    }
    pub fn push(&mut self, ring: Ring, wqe: Wqe) -> Result<u8, crate::chain::ChainError> {
        let i = self.next();
        let wqe = wqe.with_wr_id(chain_wr_id(self.layout.kind, self.slot, i));
        self.layout
            .steps
            .push(Step { ring, wqe, local: None, remote: None })
            .map_err(|_| crate::chain::ChainError::TooManySteps)?;
        Ok(i)
    }
    pub fn signaled_on(&self, ring: Ring) -> u64 {
        self.layout.steps.iter().filter(|s| s.ring == ring && s.wqe.flags.contains(WqeFlags::SIGNALED)).count() as u64
    }
    pub fn recv(&mut self, loc: Loc, len: u32) -> Result<(), crate::chain::ChainError> {
        self.layout.recv.push(RecvTarget { loc, len }).map_err(|_| crate::chain::ChainError::TooManySteps)
    }
    pub fn set_local(&mut self, step: u8, loc: Loc) {
        if let Some(s) = self.layout.steps.get_mut(step as usize) {
            s.local = Some(loc);
        }
    }

    /// A phase boundary on the Loop ring: a FENCEd ENABLE of the Loop ring itself. The ring
    /// stops at its limit; the ENABLE executes only once every earlier READ and atomic of the
    /// ring completed (and, completions being in order, everything before them), and only then
    /// are the next phase's WQEs — patched by those READs — fetched. A gate that needs no WAIT,
    /// so nothing to bump per lap (ENABLE counts are relative). Its count is set by
    /// [`Self::set_count`] once the next phase is known. Relayed where the variant says so
    /// ([`Self::enable_loop`]).
    pub fn gate_loop(&mut self, env: &ChainEnv) -> Result<u8, crate::chain::ChainError> {
        self.enable_loop(env, true)
    }

    /// An ENABLE of the Loop ring issued by the Loop ring (FENCEd or not); returns the step
    /// whose count is the release. With `ChainVariant::relays_gates` the Loop ring enables the
    /// management ring instead — by exactly the one entry that is the relay, an ENABLE of the
    /// Loop ring ([`Self::settle_relays`] sets the management counts) — so no queue enables
    /// itself: the relay runs after the Loop ENABLE (its release), and that after everything
    /// the FENCE or a WAIT before it holds back.
    pub fn enable_loop(&mut self, env: &ChainEnv, fence: bool) -> Result<u8, crate::chain::ChainError> {
        let fence_if = |w: Wqe| if fence { fenced(w) } else { w };
        if !env.variant.relays_gates {
            return self.push(Ring::Loop, fence_if(Wqe::enable(env.loop_qpn, QueueSel::Send, 0)));
        }
        let release = self.push(Ring::Loop, fence_if(Wqe::enable(env.mgmt_qpn, QueueSel::Send, 1)))?;
        let relay = self.push(Ring::Mgmt, Wqe::enable(env.loop_qpn, QueueSel::Send, 0))?;
        self.relays.push((release, relay)).map_err(|_| crate::chain::ChainError::TooManySteps)?;
        Ok(relay)
    }

    /// With relayed gates, once every step is placed: the count of each Loop-ring ENABLE of the
    /// management ring. A relay's releasing ENABLE releases exactly up to and including it;
    /// every other one up to the next relay not yet released (a management step behind a
    /// relay in the order runs after the relay's gate, which the sequential order allows); the
    /// last one to the ring's end, padding included — one lap of the ring per lap.
    pub fn settle_relays(&mut self) {
        if self.relays.is_empty() {
            return;
        }
        let depth = self.layout.ring_depth[Ring::Mgmt as usize] as usize;
        let mgmt_qpn = self.layout.qpns[1];
        let enablers: heapless::Vec<u8, MAX_STEPS> = (0..self.layout.steps.len())
            .filter(|&i| {
                let s = &self.layout.steps[i];
                s.ring == Ring::Loop
                    && s.wqe.opcode == Opcode::Enable
                    && s.wqe.queue_sel() == QueueSel::Send
                    && s.wqe.qpn == mgmt_qpn
            })
            .map(|i| i as u8)
            .collect();
        let mut limit = self.layout.initial_enable[Ring::Mgmt as usize] as usize;
        for (k, e) in enablers.iter().copied().enumerate() {
            let next =
                self.relays.iter().map(|(_, r)| (*r, self.layout.position(*r as usize))).find(|(_, p)| *p >= limit);
            let end = if k + 1 == enablers.len() {
                depth
            } else {
                match next {
                    Some((r, p)) if self.relays.iter().any(|(rel, rr)| *rel == e && *rr == r) => p + 1,
                    Some((_, p)) => p,
                    None => depth,
                }
            };
            self.set_count(e, end.saturating_sub(limit) as u64);
            limit = limit.max(end);
        }
    }
    /// Set the count of ENABLE `step`.
    pub fn set_count(&mut self, step: u8, count: u64) {
        if let Some(s) = self.layout.steps.get_mut(step as usize) {
            s.wqe.operand0 = count;
        }
    }

    /// The lap head of a variant whose laps enable their own receive
    /// (`ChainVariant::lap_enables_its_receive`): the receive ENABLE that admits this lap's
    /// request — in mlx5 form a RECV_EN to the absolute index `lap + 1` — in place of the tail's
    /// for the next lap, and the arm enables none ([`ChainLayout::initial_recv_enable`]). Lap 0's
    /// request then lands on a device that makes receives available only through RECV_EN. First,
    /// so it runs in every lap whatever the request does; the previous lap is over with the
    /// RECV's targets by then (its closing ENABLE released this one: `validate`).
    pub fn lap_head(&mut self, env: &ChainEnv) -> Result<(), crate::chain::ChainError> {
        if env.variant.lap_enables_its_receive {
            self.push(Ring::Loop, Wqe::enable(env.mgmt_qpn, QueueSel::Recv, 1))?;
            self.publish_receive(env)?;
        }
        Ok(())
    }

    /// Behind the receive ENABLE: publish one more receive through the doorbell record, where
    /// the chain does (`ChainEnv::posts_receives`). Unsignaled: the CQ counts stay the lap's.
    fn publish_receive(&mut self, env: &ChainEnv) -> Result<(), crate::chain::ChainError> {
        if env.posts_receives {
            let k = env.keys;
            let w = Wqe::fetch_add(self.layout.mlx5.junk, k.meta_lkey, 0, k.ring_rkey, 1).with_flags(WqeFlags::empty());
            let i = self.push(Ring::Loop, w)?;
            self.layout.steps[i as usize].remote = Some(Loc::RecvDoorbell);
        }
        Ok(())
    }

    /// The lap tail: bump every WAIT by its queue's per-lap completions, enable one more RECV
    /// and — fenced behind the bumps — one more lap of the Loop ring; then pad both rings with
    /// NOPs to power-of-two depths (a real send queue's), so every lap wraps onto the same
    /// bytes, which is what makes the chain re-arm itself. The chain sets the counts of its
    /// own ENABLEs from the depths afterwards; `closing` is left pointing at the lap-closing
    /// ENABLE (count 0 until then).
    pub fn lap_tail(&mut self, env: &ChainEnv) -> Result<(), crate::chain::ChainError> {
        let junk = self.layout.mlx5.junk;
        let waits: heapless::Vec<u8, MAX_STEPS> = self
            .layout
            .steps
            .iter()
            .enumerate()
            .filter(|(_, s)| s.wqe.opcode == Opcode::Wait)
            .map(|(i, _)| i as u8)
            .collect();
        // per-lap completions, including the tail's own bumps (all signaled)
        let loop_now = self.signaled_on(Ring::Loop) + waits.len() as u64;
        let mgmt = self.signaled_on(Ring::Mgmt);
        for w in waits.iter().copied() {
            let wq = self.layout.steps[w as usize].wqe;
            let per_lap = if wq.queue_sel() == QueueSel::Recv {
                1
            } else if wq.qpn == env.loop_qpn {
                loop_now
            } else {
                mgmt
            };
            let i = self.push(Ring::Loop, Wqe::fetch_add(junk, env.keys.meta_lkey, 0, env.keys.ring_rkey, per_lap))?;
            self.layout.steps[i as usize].remote = Some(Loc::Field { step: w, field: WqeField::Operand0 });
        }
        // The next request may land as soon as its RECV is enabled: the FENCE (behind the
        // bumps, themselves behind the lap's clears) keeps it from landing on anything this
        // lap still uses.
        if !env.variant.lap_enables_its_receive {
            self.push(Ring::Loop, fenced(Wqe::enable(env.mgmt_qpn, QueueSel::Recv, 1)))?;
            self.publish_receive(env)?;
        }
        self.closing = self.enable_loop(env, true)?;
        for ring in [Ring::Loop, Ring::Mgmt] {
            let len = self.layout.ring_len(ring) as u64;
            let depth = if len == 0 { 0 } else { len.next_power_of_two() };
            while (self.layout.ring_len(ring) as u64) < depth {
                self.push(ring, Wqe::nop().with_flags(WqeFlags::empty()))?;
            }
            self.layout.ring_depth[ring as usize] = depth as u16;
        }
        Ok(())
    }
}

impl ChainEnv {
    /// A self-consistent environment for tests, examples and tools that need a chain without an
    /// MN: a pool at 4 GiB, metadata for 8 CN slots at 64 MiB, CN slot 1 (id 2), the given QP
    /// numbers, placeholder MN keys. `None` if the geometry is invalid.
    pub fn example(chunk_size: u64, chunks: u32, g: u8, qpns: [u32; 3]) -> Option<ChainEnv> {
        let geo = PoolGeometry::new(1 << 32, chunk_size, chunks, g).ok()?;
        let map = MnMemoryMap::new(geo, 8, 64 << 20)?;
        Some(ChainEnv {
            map,
            slot: 1,
            cn: CnId::new(2).ok()?,
            loop_qpn: qpns[0],
            mgmt_qpn: qpns[1],
            free_qpn: qpns[2],
            keys: MnKeys {
                meta_lkey: 0x11,
                meta_rkey: 0x12,
                table_rkey: 0x13,
                ring_lkey: 0x14,
                ring_rkey: 0x15,
                cn_meta_lkey: 0x16,
                cn_ring_lkey: 0x17,
                ..MnKeys::default()
            },
            queue_depth: 128,
            window_access: AccessFlags::DATA_WINDOW,
            owner_window_access: AccessFlags::REMOTE_READ,
            pop_ahead: true,
            variant: crate::chain::variant::ChainVariant::default(),
            posts_receives: false,
            owner_proof: Some(OwnerProof { addr: 0x3000_0000, lkey: 0x18 }),
        })
    }
}

/// [`ChainEnv::example`] with QPs 0x100..=0x102.
#[cfg(test)]
pub(crate) fn test_env(chunk_size: u64, chunks: u32, g: u8) -> ChainEnv {
    ChainEnv::example(chunk_size, chunks, g, [0x100, 0x101, 0x102]).expect("a valid example geometry")
}
