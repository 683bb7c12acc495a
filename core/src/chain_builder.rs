//! What the alloc and free chain builders share: the environment a chain is built for (QP
//! numbers, memory keys, the memory map) and a small step-list builder that wires patches and
//! the lap re-arm tail.

use crate::access::AccessFlags;
use crate::chain::{ChainKind, ChainLayout, Loc, Rearm, RecvTarget, Ring, Step, MAX_STEPS};
use crate::geometry::PoolGeometry;
use crate::ids::CnId;
use crate::mn_memory::{MnKeys, MnMemoryMap};
use crate::wqe::{Opcode, QueueSel, Wqe, WqeField, WqeFlags};

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
    /// MN end of the CN's Free QP: MW[0] of every group the CN allocates is bound there.
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
    /// Rights of MW[0] (bound to the Free QP; it proves ownership, it is not for data).
    pub owner_window_access: AccessFlags,
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

pub(crate) struct Builder {
    pub layout: ChainLayout,
    slot: u32,
    /// Index of the lap-closing ENABLE once `rearm_tail` has run.
    pub closing: u8,
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
                empty_probe: None,
                ownership_check: None,
            },
            slot: env.slot,
            closing: 0,
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
    /// WAIT until the loop QP's own completions cover everything posted so far on it.
    pub fn fence_loop(&mut self, env: &ChainEnv) -> Result<u8, crate::chain::ChainError> {
        let n = self.signaled_on(Ring::Loop);
        self.push(Ring::Loop, Wqe::wait(env.loop_qpn, QueueSel::Send, n))
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

    /// The lap tail: bump every WAIT by its queue's per-lap completions, then enable one more
    /// lap of every ring and one more RECV. `mid_enables` are ENABLEs the chain already issued
    /// for the Mgmt ring or for the Loop ring's second half (they count towards the lap).
    pub fn rearm_tail(&mut self, env: &ChainEnv, junk: u64) -> Result<(), crate::chain::ChainError> {
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
        // Each ring is padded with unsignaled NOPs to a power-of-two depth (what a real send
        // queue has), and every lap enables exactly one ring's worth: the ring then wraps onto
        // the same bytes, which is what makes the chain re-arm itself.
        let enabled_mgmt: u64 = self.enabled(Ring::Mgmt, env);
        let mgmt_len = self.layout.ring_len(Ring::Mgmt) as u64;
        let mgmt_depth = if mgmt_len == 0 { 0 } else { mgmt_len.next_power_of_two() };
        let extra_mgmt_enable = u64::from(mgmt_depth > enabled_mgmt);
        let loop_final = self.layout.ring_len(Ring::Loop) as u64 + extra_mgmt_enable + 2;
        let loop_depth = loop_final.next_power_of_two();
        if extra_mgmt_enable == 1 {
            self.push(Ring::Loop, Wqe::enable(env.mgmt_qpn, QueueSel::Send, mgmt_depth - enabled_mgmt))?;
        }
        self.push(Ring::Loop, Wqe::enable(env.mgmt_qpn, QueueSel::Recv, 1))?;
        let loop_enabled = self.enabled(Ring::Loop, env);
        let w = Wqe::enable(env.loop_qpn, QueueSel::Send, loop_depth - loop_enabled).with_flags(WqeFlags::FENCE);
        self.push(Ring::Loop, w)?;
        self.closing = self.next() - 1;
        for (ring, depth) in [(Ring::Loop, loop_depth), (Ring::Mgmt, mgmt_depth)] {
            while (self.layout.ring_len(ring) as u64) < depth {
                self.push(ring, Wqe::nop().with_flags(WqeFlags::empty()))?;
            }
        }
        self.layout.ring_depth = [loop_depth as u16, mgmt_depth as u16];
        Ok(())
    }

    fn enabled(&self, ring: Ring, env: &ChainEnv) -> u64 {
        let qpn = match ring {
            Ring::Loop => env.loop_qpn,
            Ring::Mgmt => env.mgmt_qpn,
        };
        self.layout
            .steps
            .iter()
            .filter(|e| e.wqe.opcode == Opcode::Enable && e.wqe.queue_sel() == QueueSel::Send && e.wqe.qpn == qpn)
            .map(|e| e.wqe.operand0)
            .sum()
    }
}

/// An environment for tests and examples: a pool at 4 GiB, metadata at 64 MiB.
#[cfg(test)]
pub(crate) fn test_env(chunk_size: u64, chunks: u32, g: u8) -> ChainEnv {
    let geo = PoolGeometry::new(1 << 32, chunk_size, chunks, g).unwrap();
    let map = MnMemoryMap::new(geo, 8, 64 << 20).unwrap();
    ChainEnv {
        map,
        slot: 1,
        cn: CnId::new(2).unwrap(),
        loop_qpn: 0x100,
        mgmt_qpn: 0x101,
        free_qpn: 0x102,
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
    }
}
