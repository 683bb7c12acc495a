//! The register-level test double: several modelled engines ("nodes") on one modelled
//! network, each reachable only through its registers ([`SimMmio`]) and its engine-visible
//! memory ([`SimMemory`]), exactly like the real device.
//!
//! What is modelled, per node (one vFPGA per node):
//! * the stock engine ([`stock`]): the command FIFO (depth 32, `CTRL_REG` reads the commands
//!   waiting in it; a push into a full FIFO is lost and flagged), control-word decoding for the
//!   node's opcode encoding, the 28-bit length and 48-bit address limits (violations are
//!   decode errors: dropped and flagged), QP context and connection registers, READ / WRITE /
//!   SEND between nodes' memories, per-thread completion counters that move only for commands
//!   with LAST and that CLR_STAT zeroes, and the per-QP limits (16 outstanding WRITE/SEND,
//!   8 READ; the FIFO head waits — head-of-line blocking — while its QP is at a limit);
//! * optionally the omw extension block ([`ext`]): the responder-side key table and the chain
//!   sequencer, as the reference model of docs/FPGA.md.
//!
//! Time: [`Fabric::tick`] moves every engine one step (in-flight stock commands complete,
//! the FIFO heads issue, each sequencer runs a few WQEs per QP). By default every register
//! read ticks once, so a host polling a register sees the engine make progress; pausing a
//! node ([`Fabric::set_paused`]) stalls it (its link is down), which is how back-pressure is
//! provoked.

pub mod ext;
pub mod stock;

use crate::encoding::{split_qpn, OpcodeEncoding};
use crate::memory::{HostMemory, MemError};
use crate::mmio::{Mmio, MmioError};
use crate::regs;
use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

/// Index of a node in its fabric.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, PartialOrd, Ord)]
pub struct NodeId(pub usize);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeConfig {
    /// IPv4 address (the GID the connection registers name).
    pub ip: u32,
    pub vfid: u8,
    pub encoding: OpcodeEncoding,
    /// Engine-visible memory: `[mem_base, mem_base + mem_len)`.
    pub mem_base: u64,
    pub mem_len: usize,
    /// Whether the bitstream carries the omw extension block, and at which word index.
    pub extension: Option<usize>,
}

impl NodeConfig {
    pub fn stock(ip: u32, mem_base: u64, mem_len: usize) -> Self {
        NodeConfig { ip, vfid: 0, encoding: OpcodeEncoding::AppOpcodes, mem_base, mem_len, extension: None }
    }
    pub fn with_extension(mut self) -> Self {
        self.extension = Some(crate::ext::DEFAULT_BASE);
        self
    }
    pub fn with_encoding(mut self, e: OpcodeEncoding) -> Self {
        self.encoding = e;
        self
    }
    pub fn with_vfid(mut self, v: u8) -> Self {
        self.vfid = v;
        self
    }
}

/// Counters the tests read to prove what did (or did not) reach the engine.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct NodeStats {
    /// Writes to `CTRL_REG` (each one is a push attempt).
    pub ctrl_writes: u64,
    /// Commands accepted into the FIFO.
    pub commands_accepted: u64,
    /// Commands the engine executed to completion (both sides reached).
    pub commands_completed: u64,
    pub decode_errors: u64,
    pub fifo_overflows: u64,
    pub page_faults: u64,
    /// Stock commands the responder's key table refused.
    pub remote_errors: u64,
    /// Largest number of WRITE/SEND (READ) requests one QP had outstanding.
    pub max_outstanding_writes: u32,
    pub max_outstanding_reads: u32,
    /// WQEs the sequencer executed.
    pub wqes_executed: u64,
}

pub(crate) struct Node {
    pub cfg: NodeConfig,
    pub mem: Vec<u8>,
    pub stock: stock::StockEngine,
    pub ext: Option<ext::ExtBlock>,
    pub stats: NodeStats,
    pub paused: bool,
}

impl Node {
    pub fn mem_range(&self, addr: u64, len: u64) -> Option<std::ops::Range<usize>> {
        let off = addr.checked_sub(self.cfg.mem_base)?;
        let end = off.checked_add(len)?;
        (end <= self.mem.len() as u64).then_some(off as usize..end as usize)
    }
    pub fn read(&self, addr: u64, len: u64) -> Option<Vec<u8>> {
        self.mem_range(addr, len).map(|r| self.mem[r].to_vec())
    }
    pub fn write(&mut self, addr: u64, data: &[u8]) -> bool {
        match self.mem_range(addr, data.len() as u64) {
            Some(r) => {
                self.mem[r].copy_from_slice(data);
                true
            }
            None => false,
        }
    }
    pub fn read_u64(&self, addr: u64) -> Option<u64> {
        let b = self.read(addr, 8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&b);
        Some(u64::from_le_bytes(a))
    }
    /// The ctid of one of this node's QP numbers.
    pub fn ctid_of(&self, qpn: u32) -> Option<u8> {
        split_qpn(qpn).filter(|(v, _)| *v == self.cfg.vfid).map(|(_, c)| c)
    }
    pub fn qpn(&self, ctid: u8) -> u32 {
        ((self.cfg.vfid as u32) << 6) | ctid as u32
    }
}

pub(crate) struct World {
    pub nodes: Vec<Node>,
    pub now: u64,
    pub auto_tick: bool,
    pub prefetch: usize,
    pub burst: usize,
}

impl World {
    /// The other end of a QP, from its committed connection: (node, ctid).
    pub fn peer(&self, n: usize, ctid: u8) -> Option<(usize, u8)> {
        let conn = self.nodes[n].stock.qps[ctid as usize].conn?;
        let r = self.nodes.iter().position(|x| x.cfg.ip == conn.remote_ip)?;
        let rc = self.nodes[r].ctid_of(conn.remote_qpn)?;
        Some((r, rc))
    }

    /// One step of every engine; true if anything happened.
    pub fn tick(&mut self) -> bool {
        self.now += 1;
        let mut progress = false;
        for n in 0..self.nodes.len() {
            if self.nodes[n].paused {
                continue;
            }
            progress |= stock::complete_in_flight(self, n);
            progress |= stock::issue(self, n);
        }
        for n in 0..self.nodes.len() {
            if self.nodes[n].paused || self.nodes[n].ext.is_none() {
                continue;
            }
            for c in 0..64u8 {
                for _ in 0..self.burst {
                    if !ext::step(self, n, c) {
                        break;
                    }
                    progress = true;
                }
            }
        }
        progress
    }
}

/// The modelled network and its engines. Cheap to clone (shared).
#[derive(Clone)]
pub struct Fabric {
    world: Rc<RefCell<World>>,
}

impl std::fmt::Debug for Fabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let w = self.world.borrow();
        f.debug_struct("Fabric").field("nodes", &w.nodes.len()).field("now", &w.now).finish()
    }
}

impl Default for Fabric {
    fn default() -> Self {
        Self::new()
    }
}

impl Fabric {
    pub fn new() -> Self {
        Fabric {
            world: Rc::new(RefCell::new(World { nodes: Vec::new(), now: 0, auto_tick: true, prefetch: 4, burst: 4 })),
        }
    }
    pub fn add_node(&self, cfg: NodeConfig) -> NodeId {
        let mut w = self.world.borrow_mut();
        let ext = cfg.extension.map(|_| ext::ExtBlock::new());
        let mem = vec![0u8; cfg.mem_len];
        w.nodes.push(Node {
            cfg,
            mem,
            stock: stock::StockEngine::new(),
            ext,
            stats: NodeStats::default(),
            paused: false,
        });
        NodeId(w.nodes.len() - 1)
    }
    pub fn mmio(&self, node: NodeId) -> SimMmio {
        SimMmio { world: self.world.clone(), node: node.0 }
    }
    pub fn memory(&self, node: NodeId) -> SimMemory {
        SimMemory { world: self.world.clone(), node: node.0 }
    }
    pub fn tick(&self) -> bool {
        self.world.borrow_mut().tick()
    }
    /// Tick until nothing happens any more (or `max` ticks); returns the ticks used.
    pub fn run(&self, max: u64) -> u64 {
        let mut w = self.world.borrow_mut();
        for i in 0..max {
            if !w.tick() {
                return i + 1;
            }
        }
        max
    }
    /// A paused engine neither issues nor completes anything (its link is down).
    pub fn set_paused(&self, node: NodeId, paused: bool) {
        self.world.borrow_mut().nodes[node.0].paused = paused;
    }
    /// Whether register reads advance time (default true).
    pub fn set_auto_tick(&self, on: bool) {
        self.world.borrow_mut().auto_tick = on;
    }
    /// How many WQEs the sequencer fetches ahead of execution (default 4; WAIT stops it).
    pub fn set_prefetch(&self, entries: usize) {
        self.world.borrow_mut().prefetch = entries.max(1);
    }
    pub fn stats(&self, node: NodeId) -> NodeStats {
        self.world.borrow().nodes[node.0].stats
    }
    pub fn ip(&self, node: NodeId) -> u32 {
        self.world.borrow().nodes[node.0].cfg.ip
    }
    /// A window's state in a node's key table, for assertions.
    pub fn mw(&self, node: NodeId, rkey: u32) -> Option<ext::MwInfo> {
        self.world.borrow().nodes[node.0].ext.as_ref().and_then(|e| e.mw_info(rkey))
    }
}

/// A node's registers, as the host sees them.
pub struct SimMmio {
    world: Rc<RefCell<World>>,
    node: usize,
}

impl std::fmt::Debug for SimMmio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimMmio").field("node", &self.node).finish()
    }
}

impl Mmio for SimMmio {
    fn read_csr(&self, reg: usize) -> Result<u64, MmioError> {
        if reg >= regs::CNFG_REGION_WORDS {
            return Err(MmioError::OutOfRange { reg, words: regs::CNFG_REGION_WORDS });
        }
        let mut w = self.world.borrow_mut();
        if w.auto_tick {
            w.tick();
        }
        let n = &w.nodes[self.node];
        if let (Some(base), Some(e)) = (n.cfg.extension, n.ext.as_ref()) {
            if (base..base + crate::ext::BLOCK_WORDS).contains(&reg) {
                return Ok(e.read(n, reg - base));
            }
        }
        Ok(n.stock.read(reg))
    }
    fn write_csr(&self, reg: usize, value: u64) -> Result<(), MmioError> {
        if reg >= regs::CNFG_REGION_WORDS {
            return Err(MmioError::OutOfRange { reg, words: regs::CNFG_REGION_WORDS });
        }
        let mut w = self.world.borrow_mut();
        let base = w.nodes[self.node].cfg.extension;
        if let (Some(base), true) = (base, w.nodes[self.node].ext.is_some()) {
            if (base..base + crate::ext::BLOCK_WORDS).contains(&reg) {
                ext::write(&mut w, self.node, reg - base, value);
                return Ok(());
            }
        }
        stock::write(&mut w, self.node, reg, value);
        Ok(())
    }
}

/// A node's engine-visible memory, as its host sees it.
pub struct SimMemory {
    world: Rc<RefCell<World>>,
    node: usize,
}

impl std::fmt::Debug for SimMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimMemory").field("node", &self.node).finish()
    }
}

impl HostMemory for SimMemory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<(), MemError> {
        let w = self.world.borrow();
        let n = &w.nodes[self.node];
        let r = n.mem_range(addr, buf.len() as u64).ok_or(MemError::Unmapped { addr, len: buf.len() as u64 })?;
        buf.copy_from_slice(&n.mem[r]);
        Ok(())
    }
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), MemError> {
        let mut w = self.world.borrow_mut();
        if w.nodes[self.node].write(addr, data) {
            Ok(())
        } else {
            Err(MemError::Unmapped { addr, len: data.len() as u64 })
        }
    }
}

pub(crate) type Fifo<T> = VecDeque<T>;
