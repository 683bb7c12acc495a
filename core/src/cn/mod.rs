//! The CN client state machine (sans-IO): builds requests, decodes replies into
//! [`Allocation`]s, tracks live allocations, follows the MN's notices, and picks the access QP
//! for a traffic class. A backend moves the bytes; this decides what they mean.

use crate::ids::{CnId, Qpn, Rkey};
use crate::mn::MAX_ALLOC_CHAINS;
use crate::wire::message::{
    AllocReply, AllocRequest, ConnectInfo, ErrorCode, FreeRequest, MnMessage, Notice, WireError, MAX_ACCESS_QPS,
};
use core::fmt;

/// A chunk this CN holds: where it is, and one rkey per access QP.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Allocation {
    pub base: u64,
    pub length: u64,
    /// The MWTable entry; the free request names it.
    pub entry_addr: u64,
    /// rkey of MW[i+1], usable only through access QP i.
    pub rkeys: heapless::Vec<Rkey, MAX_ACCESS_QPS>,
    /// rkey of MW\[0\] (bound to the Free QP; proves ownership, not for data).
    pub owner_rkey: Rkey,
    /// The MN's pool generation it was handed out in (`AllocReply::generation`): a `Revoked`
    /// notice takes back every allocation of an older one.
    pub generation: u32,
}

impl Allocation {
    /// rkey for access QP `i`.
    pub fn rkey(&self, access_qp: usize) -> Option<Rkey> {
        self.rkeys.get(access_qp).copied()
    }
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.base && len <= self.length && addr - self.base <= self.length - len
    }
    /// The MN address of `len` bytes at `offset` of the chunk, or [`OutOfChunk`]: an access
    /// past the chunk would fail on the wire (REM_ACCESS_ERR) and break the access QP — or,
    /// where the device does not enforce window bounds, land in another chunk of the same MR
    /// — so the CN refuses it before posting.
    pub fn span(&self, offset: u64, len: u64) -> Result<u64, OutOfChunk> {
        match offset.checked_add(len) {
            Some(end) if end <= self.length => Ok(self.base + offset),
            _ => Err(OutOfChunk { offset, len, chunk: self.length }),
        }
    }
}

/// An access that does not lie inside its chunk ([`Allocation::span`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct OutOfChunk {
    pub offset: u64,
    pub len: u64,
    /// The chunk's length.
    pub chunk: u64,
}

impl fmt::Display for OutOfChunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bytes at offset {} do not fit a chunk of {} bytes", self.len, self.offset, self.chunk)
    }
}

/// Which access QP a request should use: the paper's latency-critical vs background split.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum TrafficClass {
    LatencyCritical,
    Background,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ClientError {
    NotConnected,
    /// The MN said the queue is empty; wait for "available" (or the back-off deadline).
    Backoff {
        until: u64,
    },
    /// An allocation request is already outstanding.
    Busy,
    /// The live-allocation table is full.
    TooManyAllocations,
    NotMine {
        entry_addr: u64,
    },
    Wire(WireError),
    /// A reply arrived with a token we did not send.
    UnexpectedReply {
        token: u32,
    },
    /// A reply for a group the MN took back (a `TakenBack` notice for it arrived first: the
    /// two travel on different QPs). The request it answers is over.
    TakenBackReply {
        token: u32,
        entry_addr: u64,
    },
    /// A reply of a pool generation the MN has revoked since (an RNIC reset): the group is
    /// not ours any more. The request it answers is over.
    RevokedReply {
        token: u32,
        generation: u32,
    },
    /// The reply names another owner or a chunk of the wrong size: refuse to use it.
    ReplyMismatch,
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientError::NotConnected => f.write_str("not connected to a memory node"),
            ClientError::Backoff { until } => write!(f, "MN free queue empty; backing off until t={until}"),
            ClientError::Busy => f.write_str("an allocation is already in flight"),
            ClientError::TooManyAllocations => f.write_str("too many live allocations for this client"),
            ClientError::NotMine { entry_addr } => write!(f, "entry {entry_addr:#x} is not one of our allocations"),
            ClientError::Wire(e) => write!(f, "bad message from MN: {e}"),
            ClientError::UnexpectedReply { token } => write!(f, "reply for unknown token {token}"),
            ClientError::TakenBackReply { token, entry_addr } => {
                write!(f, "reply for token {token}: the MN took entry {entry_addr:#x} back before it landed")
            }
            ClientError::RevokedReply { token, generation } => {
                write!(f, "reply for token {token} of pool generation {generation}, revoked since")
            }
            ClientError::ReplyMismatch => f.write_str("allocation reply is not for us"),
        }
    }
}

impl From<WireError> for ClientError {
    fn from(e: WireError) -> Self {
        ClientError::Wire(e)
    }
}

/// What a message from the MN meant.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum ClientEvent {
    Connected(CnId),
    Empty,
    Available,
    /// A request failed; for an allocation the pending request is cleared.
    Failed {
        token: u32,
        code: ErrorCode,
    },
    /// Every allocation was revoked (MN RNIC reset); the client forgot them.
    Revoked,
    /// The MN's lease probe arrived (nothing to do: receiving it renewed the lease).
    Probed,
    /// Alloc chain `chain` found the queue empty popping ahead and is parked until
    /// "available" ([`Notice::ChainParked`]); the CN's other chains still serve. Once every
    /// chain is parked the client reports [`ClientEvent::Empty`] instead.
    ChainParked {
        chain: u8,
    },
    /// The MN bound window MW\[`mw`\] of the allocation at `entry_addr` again under `rkey`
    /// (someone invalidated it, see [`crate::wire::message::Rebound`]); the live allocation now holds
    /// the new key, so an access retried through [`Client::live`] succeeds.
    Rekeyed {
        entry_addr: u64,
        mw: u8,
        rkey: Rkey,
    },
    /// The MN took the allocation at `entry_addr` back ([`crate::wire::message::TakenBack`]):
    /// the client forgot it (its windows no longer work; its bytes are gone). `held`: whether
    /// the client held it under the keys the notice names — false for a notice about a group
    /// it never got, or got again since under new keys, which changed nothing.
    TakenBack {
        entry_addr: u64,
        held: bool,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Pending {
    token: u32,
    since: u64,
    /// The alloc chain it went out on.
    chain: u8,
}

/// Where each live allocation sits in [`Client::live`], by entry address, so a free (and a
/// rebind notice) finds its allocation in O(1) expected instead of searching the list
/// (issue 23). Open addressing with linear probing over `2N` slots — two arrays of `N`, so
/// the load stays at most one half without const-generic arithmetic — and backward-shift
/// deletion (no tombstones, so probe runs stay short however long the client lives).
///
/// A slot holds the address's 32-bit hash (the upper half) and its position + 1 (the lower
/// half; 0: empty). The hash gives a member's home slot without reading its allocation, so
/// probing past other members of a run and shifting them back on deletion stay inside the
/// index: a lookup reads one allocation record (the one whose hash matches), where it used to
/// read one per slot of the run — with a million live allocations each of those was a cache
/// and TLB miss in a table of tens of MiB (`omw bench --scale`, docs/BENCH.md).
#[derive(Debug)]
struct LiveIndex<const N: usize> {
    slots: [[u64; N]; 2],
    /// Slots examined by lookups (`Client::index_probes`): tests count them.
    probes: u64,
    /// Allocation records read by lookups to confirm a hash match (`Client::index_record_reads`).
    record_reads: u64,
}

impl<const N: usize> LiveIndex<N> {
    const fn new() -> Self {
        LiveIndex { slots: [[0; N]; 2], probes: 0, record_reads: 0 }
    }
    const fn len() -> usize {
        2 * N
    }
    fn get(&self, i: usize) -> u64 {
        self.slots[i / N][i % N]
    }
    fn set(&mut self, i: usize, v: u64) {
        self.slots[i / N][i % N] = v;
    }
    fn slot(hash: u32, pos: usize) -> u64 {
        (hash as u64) << 32 | (pos as u64 + 1)
    }
    fn hash_of(v: u64) -> u32 {
        (v >> 32) as u32
    }
    /// The position in `live` a non-empty slot holds.
    fn pos_of(v: u64) -> usize {
        (v as u32 as usize).wrapping_sub(1)
    }
    /// An entry address's 32-bit hash: MurmurHash3's 64-bit finalizer (Appleby's `fmix64`),
    /// upper half. MWTable entries are 40 bytes apart: a bare multiplicative hash spreads such
    /// an arithmetic sequence so evenly that the keys added while others are freed pile into
    /// runs (5 slots per lookup at 256 Ki live, measured); the finalizer keeps lookups at the
    /// 1.5 linear probing promises at half load.
    fn hash(addr: u64) -> u32 {
        let mut k = addr;
        k ^= k >> 33;
        k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
        k ^= k >> 33;
        k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        k ^= k >> 33;
        (k >> 32) as u32
    }
    /// The home slot of a hash, by multiply-shift.
    fn home(hash: u32) -> usize {
        ((hash as u64 * Self::len() as u64) >> 32) as usize
    }
    fn next(i: usize) -> usize {
        if i + 1 == Self::len() {
            0
        } else {
            i + 1
        }
    }
    /// The slot and the position in `live` of `addr`.
    fn find(&mut self, live: &[Allocation], addr: u64) -> Option<(usize, usize)> {
        if N == 0 {
            return None;
        }
        let h = Self::hash(addr);
        let mut i = Self::home(h);
        for _ in 0..Self::len() {
            self.probes += 1;
            let v = self.get(i);
            if v == 0 {
                return None;
            }
            if Self::hash_of(v) == h {
                let pos = Self::pos_of(v);
                self.record_reads += 1;
                if live.get(pos).is_some_and(|a| a.entry_addr == addr) {
                    return Some((i, pos));
                }
            }
            i = Self::next(i);
        }
        None
    }
    /// The slot holding position `pos` for `addr` (known to be indexed there): no allocation
    /// record is read, the position itself tells the members of the run apart.
    fn find_at(&mut self, addr: u64, pos: usize) -> Option<usize> {
        if N == 0 {
            return None;
        }
        let want = Self::slot(Self::hash(addr), pos);
        let mut i = Self::home(Self::hash_of(want));
        for _ in 0..Self::len() {
            self.probes += 1;
            match self.get(i) {
                0 => return None,
                v if v == want => return Some(i),
                _ => i = Self::next(i),
            }
        }
        None
    }
    /// Index `live[pos]` (there is always an empty slot: at most N of 2N are used).
    fn insert(&mut self, live: &[Allocation], pos: usize) {
        let Some(a) = live.get(pos) else { return };
        let h = Self::hash(a.entry_addr);
        let mut i = Self::home(h);
        while self.get(i) != 0 {
            i = Self::next(i);
        }
        self.set(i, Self::slot(h, pos));
    }
    /// Slot `i` now points at position `pos` (its allocation moved there).
    fn repoint(&mut self, i: usize, pos: usize) {
        let v = self.get(i);
        self.set(i, Self::slot(Self::hash_of(v), pos));
    }
    /// Empty slot `i`, moving later members of its probe run back so none is cut off.
    fn remove(&mut self, mut i: usize) {
        let mut j = i;
        loop {
            j = Self::next(j);
            let v = self.get(j);
            if v == 0 {
                break;
            }
            let k = Self::home(Self::hash_of(v));
            // move it back unless its home lies cyclically in (i, j]
            let stays = if i <= j { i < k && k <= j } else { i < k || k <= j };
            if !stays {
                self.set(i, v);
                i = j;
            }
        }
        self.set(i, 0);
    }
}

/// `N`: most live allocations tracked.
#[derive(Debug)]
pub struct Client<const N: usize> {
    info: Option<ConnectInfo>,
    live: heapless::Vec<Allocation, N>,
    index: LiveIndex<N>,
    /// Allocations in flight, one per alloc chain at most (oldest first).
    pending: heapless::Vec<Pending, MAX_ALLOC_CHAINS>,
    /// How many may be in flight: the CN's alloc chains ([`Client::set_alloc_chains`]).
    alloc_chains: u8,
    /// Alloc chains the MN said are parked on an empty queue (bit j: chain j), until
    /// "available" or the back-off runs out. All of them: `empty`.
    parked: u8,
    next_token: u32,
    /// The newest pool generation a `Revoked` notice announced (0 before any).
    generation: u32,
    /// Taken-back notices about allocations not (yet) ours, `(entry, MW[0] rkey)`: their
    /// replies may still land, after the notice.
    taken_back: heapless::Vec<(u64, Rkey), TAKEN_BACK_MEMORY>,
    /// A reply of a newer generation revoked older allocations ([`Client::take_revocation`]).
    revocation_unreported: bool,
    empty: bool,
    backoff_until: u64,
    /// How long to back off after "empty" if no "available" arrives (ns of the caller's clock).
    pub backoff: u64,
}

impl<const N: usize> Default for Client<N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<const N: usize> Client<N> {
    pub const fn new() -> Self {
        Client {
            info: None,
            live: heapless::Vec::new(),
            index: LiveIndex::new(),
            pending: heapless::Vec::new(),
            alloc_chains: 1,
            parked: 0,
            next_token: 1,
            generation: 0,
            taken_back: heapless::Vec::new(),
            revocation_unreported: false,
            empty: false,
            backoff_until: 0,
            backoff: 1_000_000,
        }
    }
    pub fn info(&self) -> Option<&ConnectInfo> {
        self.info.as_ref()
    }
    pub fn id(&self) -> Option<CnId> {
        self.info.as_ref().map(|i| i.cn)
    }
    pub fn live(&self) -> &[Allocation] {
        &self.live
    }
    /// Index slots examined so far finding allocations by entry address (frees, rebinds): a
    /// small constant per lookup whatever the number of live allocations.
    pub fn index_probes(&self) -> u64 {
        self.index.probes
    }
    /// Allocation records read so far by those lookups: one per lookup that finds its
    /// allocation (the slot's hash matched), none for the slots passed on the way.
    pub fn index_record_reads(&self) -> u64 {
        self.index.record_reads
    }
    /// The live allocation at `entry_addr`, found in O(1) expected.
    pub fn live_at(&mut self, entry_addr: u64) -> Option<&Allocation> {
        let (_, pos) = self.index.find(&self.live, entry_addr)?;
        self.live.get(pos)
    }
    pub fn is_backing_off(&self, now: u64) -> bool {
        self.empty && now < self.backoff_until
    }
    /// When the "empty" back-off ends, while one is in force.
    pub fn backoff_until(&self) -> Option<u64> {
        (self.empty && self.backoff_until > 0).then_some(self.backoff_until)
    }
    /// The back-off ran out without an "available": allocations may go out again.
    pub fn expire_backoff(&mut self, now: u64) {
        if self.empty && now >= self.backoff_until {
            self.empty = false;
            self.parked = 0;
            self.backoff_until = 0;
        }
    }
    /// Whether the MN said alloc chain `j` is parked on an empty queue: a request on it would
    /// wait for "available", so an allocation goes on another chain if one is free.
    pub fn chain_parked(&self, j: u8) -> bool {
        self.parked & (1 << j) != 0
    }
    fn all_chains(&self) -> u8 {
        ((1u16 << self.alloc_chains) - 1) as u8
    }
    /// Chain `j` is parked (bit), or all of them (`None`); once all are, the client backs off.
    /// True when every chain is now parked.
    fn park(&mut self, now: u64, j: Option<u8>) -> bool {
        self.parked |= j.map_or(self.all_chains(), |j| 1 << j);
        let all = self.parked & self.all_chains() == self.all_chains();
        if all {
            self.empty = true;
            self.backoff_until = now.saturating_add(self.backoff);
        }
        all
    }
    /// The oldest allocation in flight.
    pub fn pending_token(&self) -> Option<u32> {
        self.pending.first().map(|p| p.token)
    }
    /// Whether the allocation with this token is in flight.
    pub fn is_pending(&self, token: u32) -> bool {
        self.pending.iter().any(|p| p.token == token)
    }
    /// Allocations in flight.
    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }
    /// Let up to `k` allocations be in flight at once (1..=[`MAX_ALLOC_CHAINS`]): one per alloc
    /// chain the CN connected with — each chain serves one lap at a time.
    pub fn set_alloc_chains(&mut self, k: u8) {
        self.alloc_chains = k.clamp(1, MAX_ALLOC_CHAINS as u8);
    }
    pub fn alloc_chains(&self) -> u8 {
        self.alloc_chains
    }
    /// The chain the allocation with `token` was in flight on, now forgotten.
    fn forget_pending(&mut self, token: u32) -> Option<u8> {
        let i = self.pending.iter().position(|p| p.token == token)?;
        Some(self.pending.remove(i).chain)
    }

    /// A message from the MN (it arrives on the first access QP, see `wire::MnMessage`).
    pub fn on_message(&mut self, now: u64, bytes: &[u8]) -> Result<ClientEvent, ClientError> {
        match MnMessage::decode(bytes)? {
            MnMessage::ConnectInfo(ci) => {
                let cn = ci.cn;
                self.info = Some(ci);
                Ok(ClientEvent::Connected(cn))
            }
            MnMessage::Notice(Notice::Empty) => {
                self.park(now, None);
                Ok(ClientEvent::Empty)
            }
            MnMessage::Notice(Notice::ChainParked { chain }) => {
                if chain >= self.alloc_chains {
                    return Err(ClientError::Wire(WireError::BadChain(chain as u64)));
                }
                Ok(if self.park(now, Some(chain)) { ClientEvent::Empty } else { ClientEvent::ChainParked { chain } })
            }
            MnMessage::Notice(Notice::Available { .. }) => {
                self.empty = false;
                self.parked = 0;
                self.backoff_until = 0;
                Ok(ClientEvent::Available)
            }
            MnMessage::Notice(Notice::Probe { .. }) => Ok(ClientEvent::Probed),
            MnMessage::Rebound(r) => self.on_rebound(r),
            MnMessage::TakenBack(t) => {
                let held = self
                    .index
                    .find(&self.live, t.entry_addr)
                    .is_some_and(|(_, pos)| self.live.get(pos).is_some_and(|a| a.owner_rkey == t.owner_rkey));
                if held {
                    self.forget_live(t.entry_addr);
                } else if !self.pending.is_empty() {
                    // The notice may have overtaken the reply it is about (they travel on
                    // different QPs): remember it, so that reply is refused when it lands.
                    // Bounded: a notice is about a lap of ours, one per alloc chain at a time.
                    if self.taken_back.is_full() {
                        self.taken_back.remove(0);
                    }
                    let _ = self.taken_back.push((t.entry_addr, t.owner_rkey));
                }
                Ok(ClientEvent::TakenBack { entry_addr: t.entry_addr, held })
            }
            MnMessage::Error(e) => {
                if e.code == ErrorCode::Revoked {
                    // The MN rebuilt its pool: nothing we got in an older generation is valid,
                    // and the queue is full. A reply of the new generation may have come
                    // first (it travels on another QP): that allocation is good. Requests in
                    // flight stay in flight — the reset killed the laps serving them, but one
                    // may still be served by a re-armed chain (its reply then says the new
                    // generation), and one that is not times out.
                    self.enter_generation(e.detail);
                    self.revocation_unreported = false;
                    self.empty = false;
                    self.parked = 0;
                    self.backoff_until = 0;
                    return Ok(ClientEvent::Revoked);
                }
                let chain = self.forget_pending(e.token);
                if e.code == ErrorCode::Empty {
                    // the chain that took the request is parked (an "empty" for no request
                    // of ours: all of them)
                    self.park(now, chain);
                }
                Ok(ClientEvent::Failed { token: e.token, code: e.code })
            }
        }
    }

    /// Adopt a window's new key. Only for an allocation this client holds, a window its group
    /// has, and the same window index (a rebind changes the key byte, never the window):
    /// anything else is refused and changes nothing.
    fn on_rebound(&mut self, r: crate::wire::message::Rebound) -> Result<ClientEvent, ClientError> {
        let (_, pos) =
            self.index.find(&self.live, r.entry_addr).ok_or(ClientError::NotMine { entry_addr: r.entry_addr })?;
        let a = self.live.get_mut(pos).ok_or(ClientError::NotMine { entry_addr: r.entry_addr })?;
        let slot = match r.mw {
            0 => &mut a.owner_rkey,
            i => a.rkeys.get_mut(i as usize - 1).ok_or(ClientError::Wire(WireError::BadRebound))?,
        };
        if slot.index() != r.rkey.index() {
            return Err(ClientError::Wire(WireError::BadRebound));
        }
        *slot = r.rkey;
        Ok(ClientEvent::Rekeyed { entry_addr: r.entry_addr, mw: r.mw, rkey: r.rkey })
    }

    /// The QP index (into the access QPs) for a traffic class.
    pub fn access_qp(&self, class: TrafficClass) -> usize {
        let n = self.info.as_ref().map(|i| i.access_qpns.len()).unwrap_or(1).max(1);
        match class {
            TrafficClass::LatencyCritical => 0,
            TrafficClass::Background => 1 % n,
        }
    }

    /// Build an alloc request; the reply will be WRITTEN to `reply_addr` (`reply_rkey`). It
    /// goes on [`Client::idle_chain`].
    pub fn alloc_request(
        &mut self,
        now: u64,
        reply_addr: u64,
        reply_rkey: u32,
        out: &mut [u8],
    ) -> Result<(u32, usize), ClientError> {
        self.info.as_ref().ok_or(ClientError::NotConnected)?;
        let chain = self.idle_chain().ok_or(ClientError::Busy)?;
        self.alloc_request_on(now, chain, reply_addr, reply_rkey, out)
    }

    /// The alloc chain an allocation should go on: one with nothing in flight, not parked if
    /// any such is left (a request on a parked chain waits for "available").
    pub fn idle_chain(&self) -> Option<u8> {
        self.idle_chain_from(0)
    }

    /// [`Client::idle_chain`], going round the chains from `start` (a driver that spreads its
    /// requests over the chains passes the one after its last).
    pub fn idle_chain_from(&self, start: u8) -> Option<u8> {
        let n = self.alloc_chains;
        let idle = |j: &u8| !self.pending.iter().any(|p| p.chain == *j);
        let round = (0..n).map(|i| (start % n + i) % n);
        round.clone().filter(idle).find(|j| !self.chain_parked(*j)).or_else(|| round.clone().find(idle))
    }

    /// Build an alloc request for alloc chain `chain` (the caller sends it on that chain's
    /// Alloc QP); refused while that chain has one in flight — each serves one lap at a time.
    pub fn alloc_request_on(
        &mut self,
        now: u64,
        chain: u8,
        reply_addr: u64,
        reply_rkey: u32,
        out: &mut [u8],
    ) -> Result<(u32, usize), ClientError> {
        let info = self.info.as_ref().ok_or(ClientError::NotConnected)?;
        if self.is_backing_off(now) {
            return Err(ClientError::Backoff { until: self.backoff_until });
        }
        if chain >= self.alloc_chains || self.pending.iter().any(|p| p.chain == chain) {
            return Err(ClientError::Busy);
        }
        // room for this reply beside those of the allocations already in flight
        if self.live.len() + self.pending.len() >= N {
            return Err(ClientError::TooManyAllocations);
        }
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(1);
        let access_qpns: heapless::Vec<Qpn, MAX_ACCESS_QPS> = info.access_qpns.clone();
        let req = AllocRequest { token, reply_addr, reply_rkey, access_qpns };
        let n = req.encode(out)?;
        let pushed = self.pending.push(Pending { token, since: now, chain });
        debug_assert!(pushed.is_ok(), "fewer than alloc_chains <= MAX_ALLOC_CHAINS in flight, checked above");
        Ok((token, n))
    }

    /// The reply WRITE landed (`imm` is its immediate): decode and adopt the allocation.
    pub fn on_alloc_reply(&mut self, imm: u32, bytes: &[u8]) -> Result<Allocation, ClientError> {
        if self.info.is_none() {
            return Err(ClientError::NotConnected);
        }
        if self.forget_pending(imm).is_none() {
            return Err(ClientError::UnexpectedReply { token: imm });
        }
        let info = self.info.as_ref().ok_or(ClientError::NotConnected)?;
        let (cn, chunk_size, g) = (info.cn.get(), info.chunk_size, info.group_size as usize);
        let r = AllocReply::decode(bytes)?;
        if r.entry.owner() != cn || r.entry.length.get() as u64 != chunk_size || r.entry_addr == 0 {
            return Err(ClientError::ReplyMismatch);
        }
        if newer(self.generation, r.generation) {
            // handed out before an RNIC reset we heard of: the reset took it back
            return Err(ClientError::RevokedReply { token: imm, generation: r.generation });
        }
        if newer(r.generation, self.generation) {
            // a reply of a newer generation: the MN's RNIC was reset, whether or not its
            // `Revoked` reaches us (it travels on a QP the reset may have broken) — everything
            // older is gone now ([`Client::take_revocation`] tells the caller)
            self.enter_generation(r.generation);
            self.revocation_unreported = true;
        }
        let key = (r.entry_addr, r.entry.rkey(0));
        if let Some(i) = self.taken_back.iter().position(|t| *t == key) {
            // the MN took it back, and said so before this reply landed
            self.taken_back.remove(i);
            return Err(ClientError::TakenBackReply { token: imm, entry_addr: r.entry_addr });
        }
        let a = Allocation {
            base: r.entry.base.get(),
            length: r.entry.length.get() as u64,
            entry_addr: r.entry_addr,
            rkeys: (1..g).map(|i| r.entry.rkey(i)).collect(),
            owner_rkey: r.entry.rkey(0),
            generation: r.generation,
        };
        self.live.push(a.clone()).map_err(|_| ClientError::TooManyAllocations)?;
        self.index.insert(&self.live, self.live.len() - 1);
        Ok(a)
    }

    /// Build a free request for one of our allocations and forget it.
    pub fn free_request(
        &mut self,
        entry_addr: u64,
    ) -> Result<[u8; crate::wire::message::free_request::LEN], ClientError> {
        self.forget_live(entry_addr).ok_or(ClientError::NotMine { entry_addr })?;
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(1);
        Ok(FreeRequest { token, entry_addr }.encode())
    }

    /// Take a live allocation out of the list and the index (O(1)).
    fn forget_live(&mut self, entry_addr: u64) -> Option<Allocation> {
        let (slot, pos) = self.index.find(&self.live, entry_addr)?;
        self.index.remove(slot);
        // the last allocation moves into the freed position: its slot follows it
        let last = self.live.len() - 1;
        if pos != last {
            let moved = self.live[last].entry_addr;
            if let Some(s) = self.index.find_at(moved, last) {
                self.index.repoint(s, pos);
            }
        }
        Some(self.live.swap_remove(pos))
    }

    /// The pool is in generation `g` (if it is newer than ours): every allocation of an older
    /// one is gone.
    fn enter_generation(&mut self, g: u32) {
        if newer(g, self.generation) {
            self.generation = g;
        }
        let gen = self.generation;
        let mut i = 0;
        while let Some(a) = self.live.get(i) {
            if newer(gen, a.generation) {
                let addr = a.entry_addr;
                if self.forget_live(addr).is_none() {
                    // (the index always finds a live allocation; never spin if it did not)
                    i += 1;
                }
            } else {
                i += 1;
            }
        }
    }

    /// Whether an alloc reply of a newer pool generation revoked older allocations since the
    /// last call, before any `Revoked` notice said so (then reported once, like the notice).
    pub fn take_revocation(&mut self) -> bool {
        core::mem::take(&mut self.revocation_unreported)
    }

    /// Forget every in-flight allocation (the caller gave up on them, e.g. its QPs were reset).
    pub fn abandon_pending(&mut self) {
        self.pending.clear();
    }
    /// Forget one in-flight allocation (its request failed or timed out).
    pub fn abandon(&mut self, token: u32) {
        self.forget_pending(token);
    }
}

/// Taken-back notices remembered for replies that have not landed yet (one per alloc chain
/// in flight is all a well-behaved MN can send; twice that absorbs duplicates).
const TAKEN_BACK_MEMORY: usize = 2 * MAX_ALLOC_CHAINS;

/// Whether pool generation `a` is newer than `b` (generations wrap: the later of two within
/// 2^31 of each other).
fn newer(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) > 0
}

pub mod driver;
#[cfg(all(test, feature = "test-nic"))]
mod driver_tests;
pub mod object_alloc;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::message::ErrorReply;
    use crate::wire::mwtable::MwTableEntry;

    fn info() -> ConnectInfo {
        ConnectInfo {
            cn: CnId::new(3).unwrap(),
            group_size: 3,
            chunk_size: 4096,
            alloc_qpn: Qpn::new(10).unwrap(),
            free_qpn: Qpn::new(11).unwrap(),
            access_qpns: [Qpn::new(12).unwrap(), Qpn::new(13).unwrap()].into_iter().collect(),
            quota: 4,
            flags: Default::default(),
        }
    }

    #[test]
    fn rebound_updates_only_the_named_window_of_a_live_allocation() {
        use crate::wire::message::Rebound;
        let mut c: Client<4> = Client::new();
        let mut buf = [0u8; 64];
        c.on_message(0, &info().encode()).unwrap();
        let (tok, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        let mut e = MwTableEntry::new(0x10000, 4096, 1, &[Rkey(0x100), Rkey(0x200), Rkey(0x300)]);
        e.owner = 3.into();
        c.on_alloc_reply(tok, &AllocReply { entry_addr: 0x5000, entry: e, generation: 0 }.encode()).unwrap();
        let r = Rebound { entry_addr: 0x5000, mw: 2, rkey: Rkey(0x301) };
        assert_eq!(
            c.on_message(1, &r.encode()),
            Ok(ClientEvent::Rekeyed { entry_addr: 0x5000, mw: 2, rkey: Rkey(0x301) })
        );
        assert_eq!(c.live()[0].rkey(1), Some(Rkey(0x301)));
        assert_eq!(c.live()[0].rkey(0), Some(Rkey(0x200)));
        let r0 = Rebound { entry_addr: 0x5000, mw: 0, rkey: Rkey(0x101) };
        assert!(c.on_message(1, &r0.encode()).is_ok());
        assert_eq!(c.live()[0].owner_rkey, Rkey(0x101));
        // another window index, a window the group lacks, an entry we do not hold: refused
        let before = c.live()[0].clone();
        let bad = Rebound { entry_addr: 0x5000, mw: 1, rkey: Rkey(0x301) };
        assert_eq!(c.on_message(1, &bad.encode()), Err(ClientError::Wire(WireError::BadRebound)));
        let bad = Rebound { entry_addr: 0x5000, mw: 3, rkey: Rkey(0x401) };
        assert_eq!(c.on_message(1, &bad.encode()), Err(ClientError::Wire(WireError::BadRebound)));
        let bad = Rebound { entry_addr: 0x6000, mw: 1, rkey: Rkey(0x201) };
        assert_eq!(c.on_message(1, &bad.encode()), Err(ClientError::NotMine { entry_addr: 0x6000 }));
        assert_eq!(c.live()[0], before);
    }

    #[test]
    fn taken_back_forgets_only_the_allocation_held_under_those_keys() {
        use crate::wire::message::TakenBack;
        let mut c: Client<4> = Client::new();
        let mut buf = [0u8; 64];
        c.on_message(0, &info().encode()).unwrap();
        let mut adopt = |c: &mut Client<4>, entry_addr: u64, k: u32| {
            let (tok, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
            let mut e = MwTableEntry::new(0x10000, 4096, 1, &[Rkey(k), Rkey(k + 0x100), Rkey(k + 0x200)]);
            e.owner = 3.into();
            c.on_alloc_reply(tok, &AllocReply { entry_addr, entry: e, generation: 0 }.encode()).unwrap();
        };
        adopt(&mut c, 0x5000, 0x100);
        adopt(&mut c, 0x6000, 0x400);
        adopt(&mut c, 0x7000, 0x700);
        // a late notice about an earlier allocation of the same group (other keys), and one
        // about a group it does not hold: nothing changes
        let stale = TakenBack { entry_addr: 0x6000, owner_rkey: Rkey(0x3ff) };
        assert_eq!(c.on_message(1, &stale.encode()), Ok(ClientEvent::TakenBack { entry_addr: 0x6000, held: false }));
        let other = TakenBack { entry_addr: 0x8000, owner_rkey: Rkey(0x400) };
        assert_eq!(c.on_message(1, &other.encode()), Ok(ClientEvent::TakenBack { entry_addr: 0x8000, held: false }));
        assert_eq!(c.live().len(), 3);
        // the one it holds under those keys is forgotten, and the index still finds the others
        let t = TakenBack { entry_addr: 0x6000, owner_rkey: Rkey(0x400) };
        assert_eq!(c.on_message(1, &t.encode()), Ok(ClientEvent::TakenBack { entry_addr: 0x6000, held: true }));
        assert_eq!(c.live().len(), 2);
        assert!(c.live().iter().all(|a| a.entry_addr != 0x6000));
        assert_eq!(c.free_request(0x6000), Err(ClientError::NotMine { entry_addr: 0x6000 }));
        assert!(c.free_request(0x7000).is_ok());
        assert!(c.free_request(0x5000).is_ok());
        assert!(c.live().is_empty());
    }

    /// An alloc reply to CN 3 (`info()`) for `entry_addr`, window keys from `k`, in pool
    /// generation `generation`.
    fn reply_for_cn3(entry_addr: u64, k: u32, generation: u32) -> [u8; crate::wire::message::ALLOC_REPLY_LEN] {
        let mut e = MwTableEntry::new(0x10000, 4096, 1, &[Rkey(k), Rkey(k + 0x100), Rkey(k + 0x200)]);
        e.owner = 3.into();
        AllocReply { entry_addr, entry: e, generation }.encode()
    }

    /// A taken-back notice may overtake the reply it is about (different QPs): the reply is
    /// refused when it lands, once; other replies, and a later allocation of the same group
    /// under new keys, are not.
    #[test]
    fn taken_back_before_its_reply_refuses_that_reply() {
        use crate::wire::message::TakenBack;
        let mut c: Client<4> = Client::new();
        c.set_alloc_chains(2);
        let mut buf = [0u8; 64];
        c.on_message(0, &info().encode()).unwrap();
        let reply = |entry_addr: u64, k: u32| reply_for_cn3(entry_addr, k, 0);
        // no request in flight: nothing to remember
        let early = TakenBack { entry_addr: 0x4000, owner_rkey: Rkey(0x100) };
        assert_eq!(c.on_message(1, &early.encode()), Ok(ClientEvent::TakenBack { entry_addr: 0x4000, held: false }));
        let (t1, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        let (t2, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        c.on_alloc_reply(t1, &reply(0x4000, 0x100)).unwrap();
        c.free_request(0x4000).unwrap();
        // the notice about t2's group lands first
        let t = TakenBack { entry_addr: 0x5000, owner_rkey: Rkey(0x500) };
        assert_eq!(c.on_message(1, &t.encode()), Ok(ClientEvent::TakenBack { entry_addr: 0x5000, held: false }));
        assert_eq!(
            c.on_alloc_reply(t2, &reply(0x5000, 0x500)),
            Err(ClientError::TakenBackReply { token: t2, entry_addr: 0x5000 })
        );
        assert!(c.live().is_empty());
        // remembered once: the same group handed out again (new keys) is ours
        let (t3, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        c.on_alloc_reply(t3, &reply(0x5000, 0x501)).unwrap();
        assert_eq!(c.live().len(), 1);
    }

    /// An RNIC reset's `Revoked` and the replies travel on different QPs: whichever comes
    /// first, the generation decides. A reply of the new generation seen before the notice
    /// survives it; one of the old generation seen after it is refused; requests in flight
    /// stay in flight; a late copy of an older notice takes nothing.
    #[test]
    fn revoked_takes_back_only_older_generations() {
        use crate::wire::message::ErrorReply;
        let mut c: Client<4> = Client::new();
        c.set_alloc_chains(3);
        let mut buf = [0u8; 64];
        c.on_message(0, &info().encode()).unwrap();
        let reply = reply_for_cn3;
        let revoked = |generation: u32| ErrorReply { token: 0, code: ErrorCode::Revoked, detail: generation }.encode();
        let (t0, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        c.on_alloc_reply(t0, &reply(0x5000, 0x100, 0)).unwrap();
        // three requests in flight when the MN's RNIC resets
        let (t1, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        let (t2, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        let (t3, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        // the new generation's reply to one overtakes the notice
        let fresh = c.on_alloc_reply(t1, &reply(0x6000, 0x400, 1)).unwrap();
        assert_eq!(fresh.generation, 1);
        assert_eq!(c.on_message(1, &revoked(1)), Ok(ClientEvent::Revoked));
        assert_eq!(c.live(), &[fresh.clone()][..], "the old generation's allocation is gone, the new one kept");
        assert_eq!(c.free_request(0x5000), Err(ClientError::NotMine { entry_addr: 0x5000 }));
        // an old generation's reply that lagged behind the notice is refused, and its request
        // is over; the other request in flight is still answered
        assert_eq!(
            c.on_alloc_reply(t2, &reply(0x7000, 0x700, 0)),
            Err(ClientError::RevokedReply { token: t2, generation: 0 })
        );
        assert_eq!(c.on_alloc_reply(t2, &reply(0x7000, 0x700, 1)), Err(ClientError::UnexpectedReply { token: t2 }));
        c.on_alloc_reply(t3, &reply(0x8000, 0x800, 1)).unwrap();
        assert_eq!(c.live().len(), 2);
        // a late copy of an older notice changes nothing; the next reset's takes everything
        assert_eq!(c.on_message(2, &revoked(1)), Ok(ClientEvent::Revoked));
        assert_eq!(c.on_message(2, &revoked(0)), Ok(ClientEvent::Revoked));
        assert_eq!(c.live().len(), 2);
        assert_eq!(c.on_message(3, &revoked(2)), Ok(ClientEvent::Revoked));
        assert!(c.live().is_empty());
        assert_eq!(c.free_request(0x8000), Err(ClientError::NotMine { entry_addr: 0x8000 }));
        // generations wrap
        assert!(newer(0, u32::MAX) && !newer(u32::MAX, 0) && !newer(5, 5));
        assert!(!c.take_revocation(), "every revocation so far came with its notice");
        // a reply of a newer generation before (or without) its notice: the reset happened,
        // everything older is gone, and the caller is told once
        let (t4, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        c.on_alloc_reply(t4, &reply(0x5000, 0x900, 2)).unwrap();
        let (t5, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        let newest = c.on_alloc_reply(t5, &reply(0x6000, 0xa00, 3)).unwrap();
        assert!(c.take_revocation());
        assert!(!c.take_revocation());
        assert_eq!(c.live(), &[newest][..]);
        // its notice, late, takes nothing more and is not a second revocation
        assert_eq!(c.on_message(4, &revoked(3)), Ok(ClientEvent::Revoked));
        assert_eq!(c.live().len(), 1);
        assert!(!c.take_revocation());
    }

    #[test]
    fn span_refuses_every_range_outside_the_chunk() {
        let a = Allocation {
            base: 0x1_0000,
            length: 4096,
            entry_addr: 0x5000,
            rkeys: heapless::Vec::new(),
            owner_rkey: Rkey(1),
            generation: 0,
        };
        assert_eq!(a.span(0, 4096), Ok(0x1_0000));
        assert_eq!(a.span(4088, 8), Ok(0x1_0000 + 4088));
        assert_eq!(a.span(4096, 0), Ok(0x1_0000 + 4096));
        assert_eq!(a.span(4089, 8), Err(OutOfChunk { offset: 4089, len: 8, chunk: 4096 }));
        assert_eq!(a.span(0, 4097), Err(OutOfChunk { offset: 0, len: 4097, chunk: 4096 }));
        assert_eq!(a.span(u64::MAX, 2), Err(OutOfChunk { offset: u64::MAX, len: 2, chunk: 4096 }));
        assert!(a.span(1, u64::MAX).is_err());
    }

    #[test]
    fn alloc_free_cycle() {
        let mut c: Client<4> = Client::new();
        let mut buf = [0u8; 64];
        assert_eq!(c.alloc_request(0, 0x100, 1, &mut buf), Err(ClientError::NotConnected));
        assert_eq!(c.on_message(0, &info().encode()), Ok(ClientEvent::Connected(CnId::new(3).unwrap())));
        let (tok, n) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        let req = AllocRequest::decode(&buf[..n], 2).unwrap();
        assert_eq!(req.access_qpns.as_slice(), info().access_qpns.as_slice());
        assert_eq!(c.alloc_request(0, 0x100, 1, &mut buf), Err(ClientError::Busy));
        let mut e = MwTableEntry::new(0x10000, 4096, 1, &[Rkey(0x100), Rkey(0x200), Rkey(0x300)]);
        e.owner = 3.into();
        let reply = AllocReply { entry_addr: 0x5000, entry: e, generation: 0 }.encode();
        assert_eq!(c.on_alloc_reply(tok + 1, &reply), Err(ClientError::UnexpectedReply { token: tok + 1 }));
        let a = c.on_alloc_reply(tok, &reply).unwrap();
        assert_eq!(a.rkey(0), Some(Rkey(0x200)));
        assert_eq!(a.rkey(1), Some(Rkey(0x300)));
        assert_eq!(c.access_qp(TrafficClass::Background), 1);
        assert_eq!(c.live().len(), 1);
        let f = c.free_request(0x5000).unwrap();
        assert_eq!(FreeRequest::decode(&f).unwrap().entry_addr, 0x5000);
        assert_eq!(c.free_request(0x5000), Err(ClientError::NotMine { entry_addr: 0x5000 }));
    }

    fn reply(c: &mut Client<256>, entry_addr: u64) {
        let mut buf = [0u8; 64];
        let (tok, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        let mut e = MwTableEntry::new(0x10000, 4096, 1, &[Rkey(0x100), Rkey(0x200), Rkey(0x300)]);
        e.owner = 3.into();
        c.on_alloc_reply(tok, &AllocReply { entry_addr, entry: e, generation: 0 }.encode()).unwrap();
    }

    /// Issue 23: a free finds its allocation in O(1) expected. Counted: index slots examined
    /// (and allocation records read) per free, with 8 and with 256 allocations live (MWTable entries 40 bytes apart, in a
    /// scattered order), each freed in another scattered order; the list used to be searched
    /// from the start (up to 256 comparisons here).
    #[test]
    fn a_free_examines_a_few_index_slots_however_many_allocations_are_live() {
        fn probes_per_free(n: u64) -> (f64, f64) {
            let mut c: Client<256> = Client::new();
            c.on_message(0, &info().encode()).unwrap();
            let mut rng = crate::rng::SeededRng::new(n);
            let mut addrs: std::vec::Vec<u64> = (0..n).map(|i| 0x10_0000 + 40 * (i * 7919 % n)).collect();
            for a in &addrs {
                reply(&mut c, *a);
            }
            assert_eq!(c.live().len() as u64, n);
            for i in (1..addrs.len()).rev() {
                addrs.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let (before, reads) = (c.index_probes(), c.index_record_reads());
            for (k, a) in addrs.iter().enumerate() {
                assert!(c.live_at(*a).is_some());
                c.free_request(*a).unwrap();
                assert_eq!(c.free_request(*a), Err(ClientError::NotMine { entry_addr: *a }));
                assert_eq!(c.live().len(), addrs.len() - k - 1);
            }
            ((c.index_probes() - before) as f64 / n as f64, (c.index_record_reads() - reads) as f64 / n as f64)
        }
        let ((small, small_reads), (large, large_reads)) = (probes_per_free(8), probes_per_free(256));
        // a lookup, a miss and the moved allocation's lookup per free, each a short run
        assert!(small < 12.0 && large < 12.0, "index slots per free: {small} (8 live), {large} (256 live)");
        // allocation records read: one for `live_at`, one for the free's own lookup; none for
        // the slots passed, the miss, the moved allocation or the run shifted back (the slot's
        // hash tells them apart without the record)
        assert!(
            small_reads <= 2.0 && large_reads <= 2.0,
            "records read per free: {small_reads} (8 live), {large_reads} (256 live)"
        );
    }

    #[test]
    fn reply_for_someone_else_refused() {
        let mut c: Client<4> = Client::new();
        c.on_message(0, &info().encode()).unwrap();
        let mut buf = [0u8; 64];
        let (tok, _) = c.alloc_request(0, 0x100, 1, &mut buf).unwrap();
        let mut e = MwTableEntry::new(0x10000, 4096, 1, &[Rkey(1), Rkey(2), Rkey(3)]);
        e.owner = 9.into();
        let reply = AllocReply { entry_addr: 0x5000, entry: e, generation: 0 }.encode();
        assert_eq!(c.on_alloc_reply(tok, &reply), Err(ClientError::ReplyMismatch));
        assert!(c.live().is_empty());
    }

    #[test]
    fn empty_backoff_and_available() {
        let mut c: Client<4> = Client::new();
        c.on_message(0, &info().encode()).unwrap();
        assert_eq!(c.on_message(10, &Notice::Empty.encode()), Ok(ClientEvent::Empty));
        let mut buf = [0u8; 64];
        assert!(matches!(c.alloc_request(20, 0, 0, &mut buf), Err(ClientError::Backoff { .. })));
        // back-off expires on its own…
        assert!(c.alloc_request(10 + c.backoff, 0, 0, &mut buf).is_ok());
        c.abandon_pending();
        // …or on "available"
        c.on_message(0, &Notice::Empty.encode()).unwrap();
        assert_eq!(c.on_message(1, &Notice::Available { free_groups: 3 }.encode()), Ok(ClientEvent::Available));
        assert!(c.alloc_request(1, 0, 0, &mut buf).is_ok());
        // an error reply clears the pending request
        let tok = c.pending_token().unwrap();
        let ev = c.on_message(2, &ErrorReply { token: tok, code: ErrorCode::AllocFailed, detail: 0 }.encode()).unwrap();
        assert_eq!(ev, ClientEvent::Failed { token: tok, code: ErrorCode::AllocFailed });
        assert!(c.pending_token().is_none());
        assert!(c.on_message(0, &[1, 2, 3]).is_err());
    }

    /// Several alloc chains popping ahead: a parked chain is set aside alone, "empty" comes
    /// once every chain is parked (from the notice, or an "empty" error for a request on the
    /// last unparked chain), and "available" or the back-off brings them all back.
    #[test]
    fn a_parked_chain_is_set_aside_alone() {
        let mut c: Client<8> = Client::new();
        c.set_alloc_chains(3);
        c.on_message(0, &info().encode()).unwrap();
        let mut buf = [0u8; 64];
        let parked = |chain| Notice::ChainParked { chain }.encode();
        assert_eq!(c.on_message(1, &parked(0)), Ok(ClientEvent::ChainParked { chain: 0 }));
        assert!(c.chain_parked(0) && !c.chain_parked(1));
        // allocations go on the chains still serving, then on the parked one (it waits there)
        assert_eq!(c.idle_chain(), Some(1));
        let (t1, _) = c.alloc_request(2, 0, 0, &mut buf).unwrap();
        assert_eq!(c.idle_chain(), Some(2));
        let (t2, _) = c.alloc_request(2, 0, 0, &mut buf).unwrap();
        assert_eq!(c.idle_chain(), Some(0));
        assert_eq!(c.alloc_request_on(2, 1, 0, 0, &mut buf), Err(ClientError::Busy), "one lap per chain");
        assert_eq!(c.alloc_request_on(2, 3, 0, 0, &mut buf), Err(ClientError::Busy), "no such chain");
        // chain 1's request met its chain empty: only chain 1 is parked with it
        let e = ErrorReply { token: t1, code: ErrorCode::Empty, detail: 0 }.encode();
        assert_eq!(c.on_message(3, &e), Ok(ClientEvent::Failed { token: t1, code: ErrorCode::Empty }));
        assert!(c.chain_parked(1) && !c.is_backing_off(3));
        // the last one: empty, back off
        assert_eq!(c.on_message(4, &parked(2)), Ok(ClientEvent::Empty));
        assert!(c.is_backing_off(5));
        assert!(matches!(c.alloc_request(5, 0, 0, &mut buf), Err(ClientError::Backoff { .. })));
        assert!(c.is_pending(t2), "chain 2's request stays in flight");
        c.on_message(6, &Notice::Available { free_groups: 1 }.encode()).unwrap();
        assert!(!(0..3).any(|j| c.chain_parked(j)));
        assert_eq!(c.idle_chain(), Some(0));
        // a chain this CN does not have is bad input, and changes nothing
        assert_eq!(c.on_message(7, &parked(3)), Err(ClientError::Wire(WireError::BadChain(3))));
        assert!(!c.chain_parked(3) && !c.is_backing_off(7));
        // the back-off running out forgets the parked chains too
        c.on_message(8, &Notice::Empty.encode()).unwrap();
        assert!((0..3).all(|j| c.chain_parked(j)));
        c.expire_backoff(8 + c.backoff);
        assert!(!(0..3).any(|j| c.chain_parked(j)) && !c.is_backing_off(8 + c.backoff));
        // one chain: parked is empty, as before
        let mut one: Client<4> = Client::new();
        one.on_message(0, &info().encode()).unwrap();
        assert_eq!(one.on_message(1, &parked(0)), Ok(ClientEvent::Empty));
        assert!(one.is_backing_off(2));
    }
}
