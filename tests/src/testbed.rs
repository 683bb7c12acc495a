//! The `Testbed` trait: what a scenario needs from a backend, in protocol terms — start an MN and
//! its CNs, let CNs allocate, free, read and write (honestly, or as the hostile CN of DESIGN.md
//! §9 with any verb, rkey and address on any of its QPs), make CNs crash, vanish or stall, move
//! time, reset the MN's RNIC, and observe what an oracle needs (MN invariants, free groups,
//! window bindings, the MN's keys, every byte each CN received).
//!
//! A backend declares what it can do as [`Caps`]; an operation outside them panics with the
//! capability's name (the runner never calls one: a scenario lists what it needs, and a testbed
//! without it is skipped visibly). Each method documents the capability it needs, if any.

use omw_core::access::AccessFlags;
use omw_core::chain::ChainKind;
use omw_core::cn::Allocation;
use omw_core::device::{ExecutionMode, MwBinding, WcStatus};
use omw_core::ids::{CnId, GroupId, Qpn, Rkey};
use omw_core::mn::MnStats;
use omw_core::wire::message::ErrorCode;
use omw_core::wire::mwtable::MwTableEntry;
use omw_core::wire::wqe::Wqe;
use std::fmt;

/// A set of testbed capabilities.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Caps(pub u32);

macro_rules! caps {
    ($($(#[$m:meta])* $name:ident = $bit:expr;)*) => {
        impl Caps {
            $($(#[$m])* pub const $name: Caps = Caps(1 << $bit);)*
            const NAMES: &'static [(&'static str, Caps)] = &[$((stringify!($name), Caps::$name)),*];
        }
    };
}

caps! {
    /// The chains run in the MN's NIC (offloaded mode).
    OFFLOAD = 0;
    /// The MN CPU serves requests (host-engine mode).
    HOST_ENGINE = 1;
    /// Modelled time: `advance` moves the clock (leases, delays) without waiting.
    TIME_CONTROL = 2;
    /// `reset_mn_rnic`.
    RNIC_RESET = 3;
    /// `crash`: a CN's host dies (its QPs are gone; the MN is told or finds out).
    CRASH = 4;
    /// `vanish`: a CN's host goes silent without any disconnect (only the lease finds it).
    VANISH = 5;
    /// `stall`: a CN stops posting receives and reading what arrives.
    STALL = 6;
    /// `mw_binding`: which QP a window is bound to.
    WINDOW_STATE = 7;
    /// `mn_mrs`: the MN's registrations with their exact keys, domains and rights.
    MN_KEYS = 8;
    /// `mn_read` / `mn_write`: the MN's memory (entries, corrupting them).
    MN_MEMORY = 9;
    /// `set_interleaving`: the MN CPU may act between any two NIC steps.
    INTERLEAVING = 10;
    /// The device keeps every §3 rule (window bounds, LOCAL_INV only on the bound QP).
    STRICT_MW = 11;
    /// The device has soft-RoCE's §3 deviations (per-chunk MRs, software ownership check).
    RXE_MW = 12;
    /// `cn_post`: any work request on any of a CN's QPs (Alloc, Free, access).
    HOSTILE_QPS = 13;
    /// `received`: every byte string each CN received from the MN.
    CN_MESSAGES = 14;
    /// `drop_next`, `delay_next`, `corrupt_next`: message faults on a CN's Alloc QP.
    FAULTS = 15;
    /// `nic_steps`: run the fabric a given number of NIC steps (a crash mid-lap).
    NIC_STEPS = 16;
    /// `mn_activity`: MN CPU events and WQEs the MN NIC executed.
    MN_ACTIVITY = 17;
    /// `alloc_naming`: an alloc request naming any QPNs for the access windows.
    NAMED_QPS = 18;
    /// `alloc_begin` / `alloc_finish` / `free_begin` / `pump`: requests of several CNs in one run.
    CONTENTION = 19;
    /// `send_raw`: any bytes as a request on a CN's Alloc or Free QP.
    RAW_REQUESTS = 20;
    /// The backend tells the MN a bound window's span (`RdmaBackend::mw_span`): the offloaded
    /// audit's defence against a corrupted table entry.
    WINDOW_SPANS = 21;
    /// A CN's QP pair comes back after a refused access (the testbed reconnects it, as a CN
    /// would), so one CN can be refused many times; without it (rdma_cm QPs cannot be reset) a
    /// refused access leaves that QP dead and only the first refusal on it is a `REM_ACCESS_ERR`.
    REVIVE = 22;
    /// `send_with_inv`: a SEND_WITH_INV naming any rkey on one of a CN's own QPs (a remote
    /// invalidation, DESIGN.md §9). Only bound windows are ever named: on soft-RoCE a free
    /// window's last key panics the kernel (docs/VERBS.md).
    SEND_WITH_INV = 23;
}

impl Caps {
    pub const NONE: Caps = Caps(0);
    pub const fn union(self, o: Caps) -> Caps {
        Caps(self.0 | o.0)
    }
    pub const fn contains(self, o: Caps) -> bool {
        self.0 & o.0 == o.0
    }
    /// What of `self` is not in `have`.
    pub fn missing(self, have: Caps) -> Caps {
        Caps(self.0 & !have.0)
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl std::ops::BitOr for Caps {
    type Output = Caps;
    fn bitor(self, o: Caps) -> Caps {
        self.union(o)
    }
}

impl fmt::Debug for Caps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Caps::NAMES.iter().filter(|(_, c)| self.contains(*c)).map(|(n, _)| *n).collect();
        if names.is_empty() {
            return f.write_str("nothing");
        }
        f.write_str(&names.join(" | "))
    }
}

impl fmt::Display for Caps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// The MN and CNs a scenario starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MnSpec {
    pub cns: usize,
    pub chunks: u32,
    /// `None`: the backend's default (4 KiB on every backend so far).
    pub chunk_size: Option<u64>,
    pub group_size: u8,
    pub quota: u32,
    pub scrub: bool,
}

impl MnSpec {
    /// `cns` CNs on `chunks` chunks, group size 3, quota = the pool, scrubbing on.
    pub const fn new(cns: usize, chunks: u32) -> MnSpec {
        MnSpec { cns, chunks, chunk_size: None, group_size: 3, quota: chunks, scrub: true }
    }
    pub const fn quota(mut self, q: u32) -> MnSpec {
        self.quota = q;
        self
    }
    pub const fn scrub(mut self, on: bool) -> MnSpec {
        self.scrub = on;
        self
    }
    pub const fn chunk_size(mut self, s: u64) -> MnSpec {
        self.chunk_size = Some(s);
        self
    }
}

/// Why an operation of a CN did not yield what it asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The MN said no (empty queue, not the owner, quota, bad request, …).
    Mn(ErrorCode),
    /// The CN's own client refused to send (backing off after "empty", a pending request).
    Client(String),
    /// Nothing came back (the CN's management QP is gone, the request was lost).
    NoReply,
    /// The CN's transport failed or it has crashed.
    Transport(String),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Mn(c) => write!(f, "MN refused: {c:?}"),
            Refusal::Client(s) => write!(f, "client: {s}"),
            Refusal::NoReply => f.write_str("no reply"),
            Refusal::Transport(s) => write!(f, "transport: {s}"),
        }
    }
}

/// One of a CN's own QPs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CnQp {
    Alloc,
    Free,
    Access(usize),
}

/// What the MN told a CN unasked (decoded by the CN's client).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Heard {
    Empty,
    Available,
    Failed(ErrorCode),
    Revoked,
    /// Window MW\[`mw`\] of the allocation at `entry_addr` was bound again under `rkey`.
    Rekeyed {
        entry_addr: u64,
        mw: u8,
        rkey: Rkey,
    },
}

/// One registration of MN memory, as the device holds it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct MnMr {
    pub addr: u64,
    pub len: u64,
    pub key: u32,
    /// Any remote right (READ, WRITE or atomic).
    pub remote: bool,
    /// In the MN-private protection domain (no CN-facing QP is in it).
    pub private: bool,
}

impl MnMr {
    /// An MR as a testbed lists it: `remote` is any remote right in `access`.
    pub fn new(addr: u64, len: u64, key: u32, access: AccessFlags, private: bool) -> MnMr {
        let remote = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        MnMr { addr, len, key, remote: access.intersects(remote), private }
    }
}

/// MN CPU events and the WQEs the MN NIC executed, so far.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Activity {
    /// Events the MN driver handled.
    pub cpu_events: u64,
    /// The MN host's CPU accesses the model counted (0 where not modelled).
    pub cpu_accesses: u64,
    /// WQEs the MN ends of the chains' loop QPs executed.
    pub nic_wqes: u64,
}

/// A backend under test with one MN and its CNs (CN `i` is the i-th connected).
pub trait Testbed {
    fn caps(&self) -> Caps;
    fn mode(&self) -> ExecutionMode;
    fn spec(&self) -> MnSpec;
    fn chunk_size(&self) -> u64;

    // ---- honest CNs
    fn alloc(&mut self, cn: usize) -> Result<Allocation, Refusal>;
    /// Free; a refusal the MN sends back is the error.
    fn free(&mut self, cn: usize, a: &Allocation) -> Result<(), Refusal>;
    fn write(&mut self, cn: usize, a: &Allocation, window: usize, offset: u64, data: &[u8]) -> WcStatus {
        let rkey = a.rkey(window).unwrap_or_default();
        self.write_raw(cn, window, a.base + offset, rkey, data)
    }
    fn read(&mut self, cn: usize, a: &Allocation, window: usize, offset: u64, len: usize) -> (WcStatus, Vec<u8>) {
        let rkey = a.rkey(window).unwrap_or_default();
        self.read_raw(cn, window, a.base + offset, rkey, len)
    }

    // ---- hostile CNs
    /// A free request naming any entry address.
    fn free_entry(&mut self, cn: usize, entry_addr: u64) -> Result<(), Refusal>;
    /// One-sided WRITE with any address and rkey through access QP `window` (a failed access
    /// costs the CN a reconnect of that pair, which the testbed does).
    fn write_raw(&mut self, cn: usize, window: usize, addr: u64, rkey: Rkey, data: &[u8]) -> WcStatus;
    fn read_raw(&mut self, cn: usize, window: usize, addr: u64, rkey: Rkey, len: usize) -> (WcStatus, Vec<u8>);
    /// `HOSTILE_QPS`: any work request on any of the CN's QPs; a WQE naming no local buffer
    /// (lkey 0) uses the CN's own. Returns its completion status; the pair is brought back after.
    fn cn_post(&mut self, cn: usize, _qp: CnQp, _w: Wqe) -> WcStatus {
        needs(cn, Caps::HOSTILE_QPS)
    }
    /// `SEND_WITH_INV`: CN `cn` sends 8 bytes with SEND_WITH_INV naming `rkey` on its own QP
    /// `qp`; returns the SEND's completion status once everything ran (a pair left in error is
    /// brought back where the testbed can).
    fn send_with_inv(&mut self, cn: usize, qp: CnQp, rkey: Rkey) -> WcStatus {
        if !self.caps().contains(Caps::SEND_WITH_INV) {
            needs(cn, Caps::SEND_WITH_INV)
        }
        self.cn_post(cn, qp, Wqe::send_with_inv(0, 0, 8, rkey.0))
    }
    /// The allocations CN `cn`'s client holds now, with the keys it would use (a rekeyed
    /// window's new one).
    fn live(&mut self, cn: usize) -> Vec<Allocation>;
    /// `RAW_REQUESTS`: any bytes on the CN's Alloc or Free QP, then everything runs.
    fn send_raw(&mut self, cn: usize, _kind: ChainKind, _bytes: &[u8]) {
        needs(cn, Caps::RAW_REQUESTS)
    }
    /// `NAMED_QPS`: an alloc request naming `qpns` (MN ends) for the access windows.
    fn alloc_naming(&mut self, cn: usize, _qpns: &[Qpn]) -> Result<Allocation, Refusal> {
        needs(cn, Caps::NAMED_QPS)
    }
    /// The MN ends of CN `cn`'s access QPs (what an honest request names).
    fn access_qpns(&self, cn: usize) -> Vec<Qpn>;
    /// The MN ends of CN `cn`'s Alloc and Free QPs.
    fn mgmt_qpns(&self, cn: usize) -> [Qpn; 2];
    /// Whether CN `cn`'s windows all live on its Alloc QP, as its connect info says
    /// (`ConnectFlags::WINDOWS_ON_ALLOC_QP`: the MN's chains bind only to the QP that posts the
    /// bind, `ChainVariant::binds_to_poster`).
    fn windows_on_alloc_qp(&self, _cn: usize) -> bool {
        false
    }

    // ---- contention (`CONTENTION`)
    fn alloc_begin(&mut self, cn: usize) -> Result<u32, Refusal> {
        needs(cn, Caps::CONTENTION)
    }
    /// Post CN `cn`'s free of `a` without running anything (so NIC steps, the MN's tick or a
    /// crash can land mid-lap).
    fn free_begin(&mut self, cn: usize, _a: &Allocation) -> Result<(), Refusal> {
        needs(cn, Caps::CONTENTION)
    }
    fn alloc_finish(&mut self, cn: usize, _token: u32) -> Result<Allocation, Refusal> {
        needs(cn, Caps::CONTENTION)
    }

    // ---- CN failures
    /// `CRASH`: CN `cn`'s host dies; returns once the MN dealt with it.
    fn crash(&mut self, cn: usize) {
        needs(cn, Caps::CRASH)
    }
    /// `VANISH`: CN `cn` goes silent, nobody tells the MN.
    fn vanish(&mut self, cn: usize) {
        needs(cn, Caps::VANISH)
    }
    /// `STALL`: CN `cn` stops posting receives and reading.
    fn stall(&mut self, cn: usize) {
        needs(cn, Caps::STALL)
    }
    /// (`STALL`) the stalled CN asks for a chunk and never looks at the answer.
    fn alloc_unread(&mut self, cn: usize) {
        needs(cn, Caps::STALL)
    }
    /// Whether the MN still serves CN `cn`.
    fn is_served(&mut self, cn: usize) -> bool;

    // ---- the MN
    /// The MN's timer (its audit, tickets, lease), then everything that follows runs.
    fn tick(&mut self);
    /// Offloaded mode's quota audit (the management QPs' counters sampled); a tick elsewhere.
    fn audit(&mut self) {
        self.tick()
    }
    /// `TIME_CONTROL`: `ns` of time pass, then the MN's timer.
    fn advance(&mut self, _ns: u64) {
        needs(0, Caps::TIME_CONTROL)
    }
    /// `TIME_CONTROL`: the clock, in ns.
    fn now(&self) -> u64 {
        needs(0, Caps::TIME_CONTROL)
    }
    /// `RNIC_RESET`: the MN's RNIC resets (every QP and window gone); the MN rebuilds.
    fn reset_mn_rnic(&mut self) {
        needs(0, Caps::RNIC_RESET)
    }
    /// `NIC_STEPS`: run `n` NIC steps, nothing else.
    fn nic_steps(&mut self, _n: u64) {
        needs(0, Caps::NIC_STEPS)
    }
    /// `INTERLEAVING`: the MN CPU may act between NIC steps with probability `per_mille`/1000.
    fn set_interleaving(&mut self, _seed: u64, _per_mille: u16) {
        needs(0, Caps::INTERLEAVING)
    }
    /// `FAULTS`: the next `n` messages on CN `cn`'s Alloc QP are lost.
    fn drop_next(&mut self, cn: usize, _n: u32) {
        needs(cn, Caps::FAULTS)
    }
    /// `FAULTS`: the next message on CN `cn`'s Alloc QP is delayed by `ns`.
    fn delay_next(&mut self, cn: usize, _ns: u64) {
        needs(cn, Caps::FAULTS)
    }
    /// `FAULTS`: the next `bytes` bytes CN `cn` sends on its Alloc QP are corrupted.
    fn corrupt_next(&mut self, cn: usize, _bytes: usize) {
        needs(cn, Caps::FAULTS)
    }

    // ---- oracles
    /// The core's invariant checker over MN memory and window state (and the model's own).
    fn check_invariants(&mut self) -> Result<(), String>;
    /// Groups in the free queue now.
    fn free_groups(&mut self) -> u32;
    /// Groups the MN's alloc chains hold popped ahead for their CNs' next requests (offloaded
    /// mode, `omw_core::chain::alloc`): not in the queue, not handed to any CN yet.
    fn ahead(&mut self) -> u32;
    /// Whether CN `cn`'s alloc chain holds a group popped ahead (any of its chains, where it
    /// has several).
    fn ahead_of(&mut self, cn: usize) -> bool;
    /// How many groups CN `cn`'s alloc chains hold popped ahead (one per chain at most).
    fn ahead_count(&mut self, cn: usize) -> u32 {
        u32::from(self.ahead_of(cn))
    }
    /// Alloc chains each CN connects with (`omw_core::mn::MnConfig::alloc_chains`): a CN may
    /// have that many allocations in flight.
    fn alloc_chains(&self) -> u8 {
        1
    }
    /// Groups no CN has been handed: in the queue, or popped ahead.
    fn unallocated(&mut self) -> u32 {
        self.free_groups() + self.ahead()
    }
    fn stats(&mut self) -> MnStats;
    /// The MN's lease period in ns (0: off).
    fn lease_ns(&mut self) -> u64;
    /// The MWTable entry of group `g`.
    fn entry(&mut self, g: GroupId) -> Option<MwTableEntry>;
    fn group_of(&mut self, a: &Allocation) -> Option<GroupId>;
    /// Forged frees the MN counted for CN `cn` (its record; 0 once it is gone).
    fn forged_frees_of(&mut self, cn: usize) -> u64;
    /// The CN id the MN gave CN `cn`.
    fn cn_id(&self, cn: usize) -> CnId;
    /// Whether the MN is in its "queue empty" state.
    fn is_empty_state(&mut self) -> bool;
    /// What CN `cn` heard from the MN unasked, in order.
    fn heard(&mut self, cn: usize) -> Vec<Heard>;
    /// `CN_MESSAGES`: every byte string CN `cn` received from the MN (messages and replies).
    fn received(&mut self, cn: usize) -> Vec<Vec<u8>> {
        needs(cn, Caps::CN_MESSAGES)
    }
    /// `WINDOW_STATE`.
    fn mw_binding(&mut self, _rkey: Rkey) -> Option<MwBinding> {
        needs(0, Caps::WINDOW_STATE)
    }
    /// `MN_KEYS`.
    fn mn_mrs(&mut self) -> Vec<MnMr> {
        needs(0, Caps::MN_KEYS)
    }
    /// `MN_MEMORY`.
    fn mn_read(&mut self, _addr: u64, _len: usize) -> Vec<u8> {
        needs(0, Caps::MN_MEMORY)
    }
    /// `MN_MEMORY`.
    fn mn_write(&mut self, _addr: u64, _data: &[u8]) {
        needs(0, Caps::MN_MEMORY)
    }
    /// The MN memory map (where the table, queue and scratch are).
    fn mn_map(&mut self) -> omw_core::wire::memory_map::MnMemoryMap;
    /// `MN_ACTIVITY`.
    fn activity(&mut self) -> Activity {
        needs(0, Caps::MN_ACTIVITY)
    }
}

#[track_caller]
fn needs(cn: usize, c: Caps) -> ! {
    panic!("this testbed does not have {c} (called for cn{cn}); the scenario must declare it in `needs`")
}

/// How a backend starts testbeds: each scenario starts the MNs it needs.
pub trait Factory {
    /// e.g. "loopback offloaded".
    fn name(&self) -> String;
    fn caps(&self) -> Caps;
    fn start(&self, spec: MnSpec) -> Box<dyn Testbed>;
}
