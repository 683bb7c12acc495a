//! The register-level test double: several modelled engines ("nodes") on one modelled
//! network, each reachable only through its registers ([`SimMmio`]) and its engine-visible
//! memory ([`SimMemory`]), exactly like the real device.
//!
//! What is modelled, per node (one vFPGA per node):
//! * the Coyote driver's answers ([`crate::driver::CoyoteDriver`]): the shell configuration,
//!   ctid registration (the driver picks the lowest free ctid), the engine's IP address;
//! * the stock engine ([`stock`], which lists the hardware rules it follows and their source):
//!   the legacy config registers, the command FIFO (depth 32; a push into a full FIFO is lost),
//!   control-word decoding as `cnfg_slave` does it (START, the `CTRL_REG_2` latch, CLR_STAT,
//!   truncation to 48-bit addresses and 28-bit lengths), the valid/ready QP-context,
//!   connection and ARP interfaces, PSNs, ARP, READ / WRITE between nodes' memories, SENDs
//!   into the vFPGA stream, per-thread completion counters that move only for commands with
//!   LAST, and the per-QP limits (16 outstanding WRITE/SEND, 8 READ; the FIFO head waits —
//!   head-of-line blocking — while its QP is at a limit);
//! * optionally the omw extension block ([`ext`]) in the vFPGA's user CSR region: the
//!   responder-side key table with protection domains and the chain sequencer, as the
//!   reference model of docs/FPGA.md.
//!
//! Time: [`Fabric::tick`] moves every engine one step (in-flight stock commands complete,
//! the FIFO heads issue, each sequencer runs a few WQEs per QP). By default every register
//! read ticks once, so a host polling a register sees the engine make progress; pausing a
//! node ([`Fabric::set_paused`]) stalls it (its link is down), which is how back-pressure is
//! provoked.

pub mod ext;
pub mod stock;
mod wire;

use crate::driver::{CoyoteDriver, DriverError, ShellConfig, N_CTID_MAX};
use crate::encoding::{split_qpn, OpcodeEncoding, DEFAULT_PMTU};
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
    /// Whether the bitstream carries the omw extension block, and at which word index of the
    /// user CSR region.
    pub extension: Option<usize>,
    /// What `IOCTL_READ_SHELL_CONFIG` reports.
    pub shell: ShellConfig,
    pub pmtu: u32,
    /// Seed of the extension block's key-byte generator (its reset value; see
    /// [`ext::KeyLfsr`]).
    pub key_seed: u64,
    /// Whether the extension block has protection domains (a block built without them has
    /// PD 0 only).
    pub ext_pds: bool,
}

impl NodeConfig {
    pub fn stock(ip: u32, mem_base: u64, mem_len: usize) -> Self {
        NodeConfig {
            ip,
            vfid: 0,
            encoding: OpcodeEncoding::CoyoteV2,
            mem_base,
            mem_len,
            extension: None,
            shell: ShellConfig { en_rdma: true, en_strm: true, n_fpga_reg: 1, ..ShellConfig::default() },
            pmtu: DEFAULT_PMTU,
            key_seed: 0x9E37_79B9_7F4A_7C15 ^ ip as u64,
            ext_pds: true,
        }
    }
    pub fn with_extension(mut self) -> Self {
        self.extension = Some(crate::ext::DEFAULT_BASE);
        self
    }
    /// An extension block built without protection domains.
    pub fn without_protection_domains(mut self) -> Self {
        self.ext_pds = false;
        self
    }
    pub fn with_shell(mut self, shell: ShellConfig) -> Self {
        self.shell = shell;
        self
    }
    pub fn with_key_seed(mut self, seed: u64) -> Self {
        self.key_seed = seed;
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
    /// RDMA commands accepted into the FIFO.
    pub commands_accepted: u64,
    /// Commands the engine executed to completion (both sides reached).
    pub commands_completed: u64,
    /// Posted words the request parser dropped (no RDMA command of this encoding). The
    /// hardware reports nothing: this counter is the double's.
    pub decode_errors: u64,
    /// Pushes into a full FIFO (lost; the hardware reports nothing).
    pub fifo_overflows: u64,
    /// Local DMA commands (host/card streams), queued but not modelled.
    pub local_commands: u64,
    /// Commands posted by a `CTRL_REG` write without START from a `CTRL_REG_2` that was not
    /// rewritten since the previous command (it still held that command's active word).
    pub stale_reposts: u64,
    pub page_faults: u64,
    /// Stock commands the responder's key table refused.
    pub remote_errors: u64,
    /// Requests dropped at the responder for a wrong PSN (counted once per request).
    pub psn_drops: u64,
    /// Requests to a peer whose address was never resolved (`NET_ARP_REG`).
    pub arp_misses: u64,
    /// Requests whose connection names an address (or QPN) no node has.
    pub unroutable: u64,
    /// Requests to the node itself on a stock engine (no loopback).
    pub loopback_drops: u64,
    /// Writes into a context / connection / ARP interface while its previous commit was
    /// still waiting for `ready` (the earlier one is changed or lost).
    pub interface_overwrites: u64,
    /// `ISR_INVLDT` pulses.
    pub invalidations_posted: u64,
    /// Writes to the extension block's key mailbox while it was busy (ignored).
    pub mailbox_collisions: u64,
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
    /// Ctids the driver handed out.
    pub ctids: [bool; N_CTID_MAX],
    /// SEND payloads delivered into the vFPGA stream: (receiving ctid, bytes).
    pub stream_rx: Vec<(u8, Vec<u8>)>,
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
            progress |= stock::accept_config(self, n);
            progress |= stock::complete_in_flight(self, n);
            progress |= stock::issue(self, n);
        }
        for n in 0..self.nodes.len() {
            if self.nodes[n].paused || self.nodes[n].ext.is_none() {
                continue;
            }
            progress |= xb_tick(self, n);
            progress |= ext::run_qp_cmds(self, n);
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

fn xb_tick(w: &mut World, n: usize) -> bool {
    w.nodes[n].ext.as_mut().is_some_and(|e| e.tick())
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
        let ext = cfg.extension.map(|_| ext::ExtBlock::new(cfg.key_seed, cfg.ext_pds));
        let mem = vec![0u8; cfg.mem_len];
        w.nodes.push(Node {
            cfg,
            mem,
            stock: stock::StockEngine::new(),
            ext,
            stats: NodeStats::default(),
            paused: false,
            ctids: [false; N_CTID_MAX],
            stream_rx: Vec::new(),
        });
        NodeId(w.nodes.len() - 1)
    }
    /// The node's config region (`MMAP_CNFG`), which also answers the driver's `ioctl`s.
    pub fn mmio(&self, node: NodeId) -> SimMmio {
        SimMmio { world: self.world.clone(), node: node.0, region: Region::Cnfg }
    }
    /// The node's user CSR region (`MMAP_CTRL`): the extension block, when present.
    pub fn user_csr(&self, node: NodeId) -> SimMmio {
        SimMmio { world: self.world.clone(), node: node.0, region: Region::UserCsr }
    }
    /// SEND payloads the node's vFPGA stream received (and forget them).
    pub fn take_stream_rx(&self, node: NodeId) -> Vec<(u8, Vec<u8>)> {
        std::mem::take(&mut self.world.borrow_mut().nodes[node.0].stream_rx)
    }
    /// The QP context the stack took for a QP (None until one was accepted).
    pub fn qp_context(&self, node: NodeId, ctid: u8) -> Option<crate::encoding::QpContext> {
        self.world.borrow().nodes[node.0].stock.qps[ctid as usize].ctx
    }
    /// Addresses the node resolved by ARP, host order.
    pub fn arp_table(&self, node: NodeId) -> Vec<u32> {
        self.world.borrow().nodes[node.0].stock.arp.iter().map(|a| a.swap_bytes()).collect()
    }
    /// A QP's PSN state as the stack holds it: (next PSN sent, PSN expected).
    pub fn psns(&self, node: NodeId, ctid: u8) -> (u32, u32) {
        let w = self.world.borrow();
        let q = &w.nodes[node.0].stock.qps[ctid as usize];
        (q.sq_psn, q.epsn)
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
    /// Every MR in a node's key table (empty without the extension block), for assertions.
    pub fn mrs(&self, node: NodeId) -> Vec<ext::MrInfo> {
        self.world.borrow().nodes[node.0].ext.as_ref().map(|e| e.mrs()).unwrap_or_default()
    }
    /// The PD a QP's INIT took (None without the extension block), for assertions.
    pub fn qp_pd(&self, node: NodeId, ctid: u8) -> Option<u32> {
        self.world.borrow().nodes[node.0].ext.as_ref().map(|e| e.qp_pd(ctid))
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Region {
    Cnfg,
    UserCsr,
}

/// One register region of a node, as the host sees it.
pub struct SimMmio {
    world: Rc<RefCell<World>>,
    node: usize,
    region: Region,
}

impl std::fmt::Debug for SimMmio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimMmio").field("node", &self.node).field("region", &self.region).finish()
    }
}

impl SimMmio {
    fn words(&self) -> usize {
        match self.region {
            Region::Cnfg => regs::CNFG_REGION_WORDS,
            Region::UserCsr => regs::CTRL_REGION_WORDS,
        }
    }
}

impl Mmio for SimMmio {
    fn read_csr(&self, reg: usize) -> Result<u64, MmioError> {
        if reg >= self.words() {
            return Err(MmioError::OutOfRange { reg, words: self.words() });
        }
        let mut w = self.world.borrow_mut();
        if w.auto_tick {
            w.tick();
        }
        let n = &w.nodes[self.node];
        if self.region == Region::Cnfg {
            return Ok(n.stock.read(reg));
        }
        // the user CSR region: decoded by the user logic; without the block it reads 0
        match (n.cfg.extension, n.ext.as_ref()) {
            (Some(base), Some(e)) if (base..base + crate::ext::BLOCK_WORDS).contains(&reg) => Ok(e.read(n, reg - base)),
            _ => Ok(0),
        }
    }
    fn write_csr(&self, reg: usize, value: u64) -> Result<(), MmioError> {
        if reg >= self.words() {
            return Err(MmioError::OutOfRange { reg, words: self.words() });
        }
        let mut w = self.world.borrow_mut();
        if self.region == Region::Cnfg {
            stock::write(&mut w, self.node, reg, value);
            return Ok(());
        }
        let base = w.nodes[self.node].cfg.extension;
        if let (Some(base), true) = (base, w.nodes[self.node].ext.is_some()) {
            if (base..base + crate::ext::BLOCK_WORDS).contains(&reg) {
                ext::write(&mut w, self.node, reg - base, value);
            }
        }
        Ok(())
    }
}

impl CoyoteDriver for SimMmio {
    fn shell_config(&self) -> Result<ShellConfig, DriverError> {
        Ok(self.world.borrow().nodes[self.node].cfg.shell)
    }
    fn register_ctid(&self, _hpid: u32) -> Result<u8, DriverError> {
        let mut w = self.world.borrow_mut();
        let t = &mut w.nodes[self.node].ctids;
        let c = t.iter().position(|used| !used).ok_or(DriverError::NoFreeCtid)?;
        t[c] = true;
        Ok(c as u8)
    }
    fn unregister_ctid(&self, ctid: u8) -> Result<(), DriverError> {
        let mut w = self.world.borrow_mut();
        match w.nodes[self.node].ctids.get_mut(ctid as usize) {
            Some(c) => {
                *c = false;
                Ok(())
            }
            None => Err(DriverError::BadCtid(ctid as u64)),
        }
    }
    fn ip_address(&self) -> Result<u32, DriverError> {
        Ok(self.world.borrow().nodes[self.node].cfg.ip)
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
