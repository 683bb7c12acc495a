//! The compute-node client on libibverbs: connect to an MN over rdma_cm, allocate and free
//! chunks, and read/write them with one-sided RDMA through the access QPs.
//!
//! The protocol state (tokens, live allocations, notices, reply checks) is the core's
//! [`omw_core::cn::Client`]; this file moves its bytes.
//!
//! Each allocation carries one rkey per access QP (window `i` works only through access QP
//! `i`); pick the QP per traffic class. Blocking calls ([`CnClient::write`],
//! [`CnClient::read`]) wait for their completion; [`CnClient::post_write`] /
//! [`CnClient::post_read`] only post, up to [`ASYNC_SLOTS`] at once, and
//! [`CnClient::poll_ops`] / [`CnClient::wait_ops`] collect the completions (with the bytes of
//! READs). What the MN says unasked — the free queue is empty / available again, a request
//! failed (quota, not the owner), every allocation was revoked — arrives as [`Notice`]s:
//! [`CnClient::pump`] reads them, [`CnClient::take_notices`] hands them over.
//!
//! ```no_run
//! use omw_verbs::cn::{CnClient, CnOptions, Notice};
//! # fn main() -> Result<(), omw_verbs::VerbsError> {
//! let mut c = CnClient::connect("10.0.0.1:7471".parse().unwrap(), &CnOptions::default())?;
//! let a = c.alloc()?; // one chunk: base, length, an rkey per access QP
//! c.write(&a, 0, 0, b"hello")?; // blocking, through access QP 0
//! assert_eq!(c.read(&a, 0, 0, 5)?, b"hello");
//! // a batch: post, then collect the completions
//! let ids: Vec<_> = (0..8u64).map(|i| c.post_write(&a, 1, i * 64, &[i as u8; 64])).collect::<Result<_, _>>()?;
//! for done in c.wait_ops(std::time::Duration::from_secs(5))? {
//!     assert!(ids.contains(&done.id) && done.status.is_ok());
//! }
//! let r = c.post_read(&a, 1, 0, 512)?;
//! let back = c.wait_ops(std::time::Duration::from_secs(5))?;
//! assert_eq!(back[0].id, r);
//! c.free(&a)?;
//! c.pump()?;
//! for n in c.take_notices() {
//!     if n == Notice::Revoked {
//!         // the MN was reset: every allocation is gone, allocate again
//!     }
//! }
//! # Ok(()) }
//! ```

use crate::backend::VerbsBackend;
use crate::cm::{parse_welcome, Hello, Role, MGMT_RECVS};
use crate::error::{Result, VerbsError};
use omw_core::access::AccessFlags;
use omw_core::backend::{Completion, Domain, RdmaBackend, WcOpcode, WcStatus};
pub use omw_core::cn::Allocation;
use omw_core::cn::{Client, ClientError, ClientEvent};
use omw_core::ids::{CnId, Qpn, Rkey};
use omw_core::wire::{ConnectInfo, ErrorCode, FreeRequest, ALLOC_REPLY_LEN};
use omw_core::wqe::{QueueSel, RecvWqe, Sge, Wqe};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Largest single READ/WRITE the client stages.
pub const STAGING: u64 = 4 << 20;
const SLOT: u64 = 64;
const SEND_OFF: u64 = 2 * MGMT_RECVS as u64 * SLOT;
const STAGE_OFF: u64 = 8192;
/// One-sided operations [`CnClient::post_write`] / [`CnClient::post_read`] may have in flight.
pub const ASYNC_SLOTS: usize = 32;
/// Largest asynchronous READ/WRITE (each in flight has a staging slot of this size).
pub const ASYNC_SLOT: u64 = 32 << 10;
const ASYNC_OFF: u64 = STAGE_OFF + STAGING;
const LOCAL_LEN: u64 = ASYNC_OFF + ASYNC_SLOTS as u64 * ASYNC_SLOT;

/// An asynchronous one-sided operation ([`CnClient::post_write`], [`CnClient::post_read`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct OpId(pub u64);

/// A completed asynchronous operation: its status and, for a successful READ, the bytes.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct OpDone {
    pub id: OpId,
    pub status: WcStatus,
    pub data: Vec<u8>,
}

#[derive(Clone, Copy, Debug)]
struct InFlight {
    qp: Qpn,
    slot: usize,
    /// READ: how many bytes come back.
    read_len: Option<usize>,
}

#[derive(Clone, Debug)]
pub struct CnOptions {
    pub device: Option<String>,
    /// How long any one operation may take.
    pub timeout: Duration,
}

impl Default for CnOptions {
    fn default() -> Self {
        CnOptions { device: None, timeout: Duration::from_secs(20) }
    }
}

/// What the MN said unasked (on the first access QP), besides allocation replies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    Empty,
    Available,
    Failed { token: u32, code: ErrorCode },
    Revoked,
}

pub struct CnClient {
    b: VerbsBackend,
    client: Client<256>,
    pub cn: CnId,
    pub info: ConnectInfo,
    alloc_qp: Qpn,
    free_qp: Qpn,
    access: Vec<Qpn>,
    local: u64,
    local_lkey: u32,
    reply: u64,
    reply_rkey: u32,
    replies: VecDeque<u32>,
    pub notices: VecDeque<Notice>,
    timeout: Duration,
    t0: Instant,
    wr: u64,
    /// The MN's QPs at the other end of Alloc, Free, access 0.. (as rdma_cm negotiated them).
    mn_qpns: Vec<Option<Qpn>>,
    /// Send completions reaped and not yet claimed, by wr_id (blocking and asynchronous
    /// operations share the CQs, so nobody may drop another's completion).
    done: HashMap<u64, Completion>,
    in_flight: HashMap<u64, InFlight>,
    free_slots: Vec<usize>,
}

impl std::fmt::Debug for CnClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CnClient").field("cn", &self.cn).field("access_qps", &self.access.len()).finish()
    }
}

fn nonce() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    (t as u64) ^ ((std::process::id() as u64) << 40) ^ 0x9E37_79B9_7F4A_7C15
}

impl CnClient {
    /// Connect to the MN at `addr`: Alloc QP, Free QP, then the G−1 access QPs the MN asks for.
    pub fn connect(addr: SocketAddr, opts: &CnOptions) -> Result<Self> {
        crate::device::device_names()?;
        let device = match &opts.device {
            Some(d) => d.clone(),
            None => crate::cm::route_device(addr, opts.timeout)?,
        };
        crate::memlock::ensure_memlock(crate::memlock::MemlockNeed::cn(LOCAL_LEN + 4096))?;
        let mut b = VerbsBackend::open_cn(Some(&device))?;
        let local = b.alloc_region(LOCAL_LEN, 4096)?;
        let lk = b.reg_mr(Domain::CnFacing, local, LOCAL_LEN, AccessFlags::LOCAL_WRITE)?;
        let reply = b.alloc_region(4096, 4096)?;
        // the MN's alloc reply is a WRITE_WITH_IMM into this buffer: the only remote right
        let rk = b.reg_mr(Domain::CnFacing, reply, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
        let n = nonce();
        let recvs = |b: &mut VerbsBackend, q: Qpn| -> Result<()> {
            for i in 0..MGMT_RECVS as u64 {
                post_slot(b, q, local, lk.lkey, i)?;
            }
            Ok(())
        };
        let alloc = b.connect(addr, &Hello { role: Role::Alloc, nonce: n }, opts.timeout, recvs)?;
        let alloc_qp = alloc.qp;
        let g = parse_welcome(&alloc.private_data)
            .ok_or_else(|| VerbsError::Protocol("the MN's accept carried no group size".into()))?;
        if !(2..=4).contains(&g) {
            return Err(VerbsError::Protocol(format!("group size {g} from the MN")));
        }
        let free = b.connect(addr, &Hello { role: Role::Free, nonce: n }, opts.timeout, |_, _| Ok(()))?;
        let free_qp = free.qp;
        let mut mn_qpns = vec![alloc.remote_qpn, free.remote_qpn];
        // MN → CN messages (connect info, notices, error replies, lease probes) arrive on the
        // Alloc QP (host-engine MN) or on access QP 0 (offloading MN) — never on a queue the
        // MN posts binds on; allocation replies (WRITE_WITH_IMM) consume receives of the Alloc
        // QP. Both QPs keep buffered receives posted and are pumped.
        let mut access = Vec::new();
        for i in 0..g - 1 {
            let msgs = |b: &mut VerbsBackend, q: Qpn| -> Result<()> {
                if i == 0 {
                    for s in MGMT_RECVS as u64..2 * MGMT_RECVS as u64 {
                        post_slot(b, q, local, lk.lkey, s)?;
                    }
                }
                Ok(())
            };
            let c = b.connect(addr, &Hello { role: Role::Access(i), nonce: n }, opts.timeout, msgs)?;
            access.push(c.qp);
            mn_qpns.push(c.remote_qpn);
        }
        let mut c = CnClient {
            b,
            client: Client::new(),
            cn: CnId::new(1).map_err(|_| VerbsError::Protocol("cn id".into()))?,
            info: ConnectInfo {
                cn: CnId::new(1).map_err(|_| VerbsError::Protocol("cn id".into()))?,
                group_size: g,
                chunk_size: 0,
                alloc_qpn: Qpn::default(),
                free_qpn: Qpn::default(),
                access_qpns: heapless::Vec::new(),
                quota: 0,
            },
            alloc_qp,
            free_qp,
            access,
            local,
            local_lkey: lk.lkey,
            reply,
            reply_rkey: rk.rkey,
            replies: VecDeque::new(),
            notices: VecDeque::new(),
            timeout: opts.timeout,
            t0: Instant::now(),
            wr: 1,
            mn_qpns: Vec::new(),
            done: HashMap::new(),
            in_flight: HashMap::new(),
            free_slots: (0..ASYNC_SLOTS).rev().collect(),
        };
        let deadline = Instant::now() + opts.timeout;
        while c.client.info().is_none() {
            if Instant::now() > deadline {
                return Err(VerbsError::Timeout { what: "the MN's connect info".into() });
            }
            c.pump()?;
        }
        if let Some(i) = c.client.info() {
            c.info = i.clone();
            c.cn = i.cn;
        }
        // the MN's connect info names its ends of our QPs: they must be the QPs rdma_cm
        // connected us to, or the MN mixed up sessions
        let told: Vec<Qpn> =
            [c.info.alloc_qpn, c.info.free_qpn].into_iter().chain(c.info.access_qpns.iter().copied()).collect();
        for (i, (t, n)) in told.iter().zip(&mn_qpns).enumerate() {
            if let Some(n) = n {
                if t != n {
                    return Err(VerbsError::Protocol(format!(
                        "the MN's connect info names QP {t} for connection {i}, but rdma_cm connected it to QP {n}"
                    )));
                }
            }
        }
        c.mn_qpns = mn_qpns;
        Ok(c)
    }

    fn now(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    /// Access QPs (CN ends), index i carries window MW[i+1].
    pub fn access_qps(&self) -> &[Qpn] {
        &self.access
    }

    /// The MN's QP numbers for Alloc, Free and each access QP, as rdma_cm negotiated them
    /// (checked against the MN's connect info at connect).
    pub fn mn_qpns(&self) -> &[Option<Qpn>] {
        &self.mn_qpns
    }

    /// Process what arrived on the Alloc QP. Returns how many messages were handled.
    pub fn pump(&mut self) -> Result<usize> {
        let mut total = 0;
        for q in [self.alloc_qp, self.access[0]] {
            total += self.pump_qp(q)?;
        }
        Ok(total)
    }

    fn pump_qp(&mut self, q: Qpn) -> Result<usize> {
        let mut buf = [Completion::EMPTY; 8];
        let n = self.b.poll_cq(q, QueueSel::Recv, &mut buf)?;
        for c in &buf[..n] {
            if !c.status.is_ok() {
                if c.status == WcStatus::WrFlushErr {
                    return Err(VerbsError::Disconnected);
                }
                return Err(VerbsError::Completion { what: format!("receive on QP {q}"), status: c.status });
            }
            let slot = c.wr_id;
            if c.opcode == WcOpcode::RecvRdmaWithImm {
                self.replies.push_back(c.imm.unwrap_or(0));
            } else {
                let bytes = self.b.slice(self.local + slot * SLOT, (c.byte_len as usize).min(SLOT as usize))?.to_vec();
                let now = self.now();
                if let Ok(omw_core::wire::MnMessage::Error(e)) = omw_core::wire::MnMessage::decode(&bytes) {
                    if crate::log::enabled("omw_verbs::cn", crate::log::Level::Debug)
                        || std::env::var_os("OMW_DEBUG").is_some()
                    {
                        eprintln!(
                            "omw cn: error reply token {} {:?} detail {} ({})",
                            e.token,
                            e.code,
                            e.detail,
                            WcStatus::from_u32(e.detail)
                        );
                    }
                }
                match self.client.on_message(now, &bytes) {
                    Ok(ClientEvent::Connected(_)) => {}
                    Ok(ClientEvent::Empty) => self.notices.push_back(Notice::Empty),
                    Ok(ClientEvent::Available) => self.notices.push_back(Notice::Available),
                    Ok(ClientEvent::Failed { token, code }) => self.notices.push_back(Notice::Failed { token, code }),
                    Ok(ClientEvent::Revoked) => self.notices.push_back(Notice::Revoked),
                    // the MN's lease probe: receiving it was the point
                    Ok(ClientEvent::Probed) => {}
                    Err(e) => return Err(VerbsError::Protocol(format!("message from the MN: {e}"))),
                }
            }
            post_slot(&mut self.b, q, self.local, self.local_lkey, slot)?;
        }
        Ok(n)
    }

    fn send(&mut self, qp: Qpn, bytes: &[u8]) -> Result<()> {
        let at = self.local + SEND_OFF;
        self.b.write_local(at, bytes)?;
        self.wr += 1;
        let w = Wqe::send(at, self.local_lkey, bytes.len() as u32).with_wr_id(self.wr);
        let c = self.post_and_wait(qp, &w)?;
        if !c.status.is_ok() {
            return Err(VerbsError::Completion { what: "SEND to the MN".into(), status: c.status });
        }
        Ok(())
    }

    /// Allocate one chunk (waits for "available" if the MN said the queue is empty, until the
    /// timeout; then [`VerbsError::PoolEmpty`]).
    /// A hostile or hung CN, for tests of the MN: send an allocation request and never look
    /// at the answer (no polling, no receive reposted for it). Each answer the MN delivers
    /// uses up one of the receives posted earlier; once they are gone the MN's sends to this
    /// CN find none, and the MN must evict it without delaying anyone else.
    pub fn send_alloc_unread(&mut self) -> Result<()> {
        let mut req = [0u8; 64];
        let now = self.now();
        let (_, n) = self
            .client
            .alloc_request(now, self.reply, self.reply_rkey, &mut req)
            .map_err(|e| VerbsError::Protocol(e.to_string()))?;
        self.client.abandon_pending();
        let alloc_qp = self.alloc_qp;
        self.send(alloc_qp, &req[..n])
    }

    pub fn alloc(&mut self) -> Result<Allocation> {
        self.alloc_inner(true)
    }

    /// Allocate one chunk, or [`VerbsError::PoolEmpty`] as soon as the MN answers this request
    /// "empty" (or said so and has not said "available" since).
    pub fn try_alloc(&mut self) -> Result<Allocation> {
        self.alloc_inner(false)
    }

    fn alloc_inner(&mut self, wait: bool) -> Result<Allocation> {
        let deadline = Instant::now() + self.timeout;
        self.pump()?;
        loop {
            let mut req = [0u8; 64];
            let now = self.now();
            let (token, n) = match self.client.alloc_request(now, self.reply, self.reply_rkey, &mut req) {
                Ok(x) => x,
                Err(ClientError::Backoff { .. }) => {
                    if !wait || Instant::now() > deadline {
                        return Err(VerbsError::PoolEmpty);
                    }
                    self.pump()?;
                    continue;
                }
                Err(e) => return Err(VerbsError::Protocol(e.to_string())),
            };
            let alloc_qp = self.alloc_qp;
            self.send(alloc_qp, &req[..n])?;
            loop {
                if let Some(pos) = self.replies.iter().position(|t| *t == token) {
                    self.replies.remove(pos);
                    let bytes = self.b.slice(self.reply, ALLOC_REPLY_LEN)?.to_vec();
                    return self
                        .client
                        .on_alloc_reply(token, &bytes)
                        .map_err(|e| VerbsError::Protocol(format!("allocation reply: {e}")));
                }
                if let Some(pos) =
                    self.notices.iter().position(|n| matches!(n, Notice::Failed { token: t, .. } if *t == token))
                {
                    let Some(Notice::Failed { code, .. }) = self.notices.remove(pos) else { continue };
                    if code == ErrorCode::Empty {
                        if !wait {
                            return Err(VerbsError::PoolEmpty);
                        }
                        break; // back off, wait for "available", retry
                    }
                    if code == ErrorCode::QuotaExceeded {
                        return Err(VerbsError::QuotaExceeded);
                    }
                    return Err(VerbsError::Refused(format!("allocation refused: {code:?}")));
                }
                if Instant::now() > deadline {
                    self.client.abandon_pending();
                    return Err(VerbsError::Timeout { what: "the allocation reply".into() });
                }
                self.pump()?;
            }
        }
    }

    /// Free a chunk this client holds. The MN does not confirm a free; it reports a refusal.
    pub fn free(&mut self, a: &Allocation) -> Result<u32> {
        let bytes = self.client.free_request(a.entry_addr).map_err(|e| VerbsError::Protocol(format!("free: {e}")))?;
        let token = FreeRequest::decode(&bytes).map(|f| f.token).unwrap_or(0);
        let q = self.free_qp;
        self.send(q, &bytes)?;
        Ok(token)
    }

    /// Send a free request for any entry address (even one this client does not hold), then
    /// wait up to `wait` for a refusal. `Ok(None)`: none arrived.
    pub fn free_entry(&mut self, entry_addr: u64, wait: Duration) -> Result<Option<ErrorCode>> {
        let token = 0x00F0_0000 | (self.wr as u32 & 0xFFFF);
        let bytes = FreeRequest { token, entry_addr }.encode();
        let q = self.free_qp;
        self.send(q, &bytes)?;
        self.wait_failure(token, wait)
    }

    /// Wait up to `wait` for an error reply with this token.
    pub fn wait_failure(&mut self, token: u32, wait: Duration) -> Result<Option<ErrorCode>> {
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            self.pump()?;
            if let Some(pos) =
                self.notices.iter().position(|n| matches!(n, Notice::Failed { token: t, .. } if *t == token))
            {
                if let Some(Notice::Failed { code, .. }) = self.notices.remove(pos) {
                    return Ok(Some(code));
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(None)
    }

    fn qp(&self, window: usize) -> Result<Qpn> {
        self.access.get(window).copied().ok_or_else(|| VerbsError::Config(format!("no access QP {window}")))
    }

    /// One-sided WRITE of `data` at `offset` of the chunk through access QP `window`.
    pub fn write(&mut self, a: &Allocation, window: usize, offset: u64, data: &[u8]) -> Result<()> {
        let rkey = a.rkey(window).ok_or_else(|| VerbsError::Config(format!("no window {window}")))?;
        let st = self.write_raw(window, a.base + offset, rkey, data)?;
        if !st.is_ok() {
            return Err(VerbsError::Completion { what: "RDMA WRITE".into(), status: st });
        }
        Ok(())
    }

    /// One-sided READ of `len` bytes at `offset` of the chunk through access QP `window`.
    pub fn read(&mut self, a: &Allocation, window: usize, offset: u64, len: usize) -> Result<Vec<u8>> {
        let rkey = a.rkey(window).ok_or_else(|| VerbsError::Config(format!("no window {window}")))?;
        let (st, v) = self.read_raw(window, a.base + offset, rkey, len)?;
        if !st.is_ok() {
            return Err(VerbsError::Completion { what: "RDMA READ".into(), status: st });
        }
        Ok(v)
    }

    /// WRITE any address/rkey through access QP `window`; returns the completion status
    /// (after an error that QP pair is dead: the device moves both ends to ERR).
    pub fn write_raw(&mut self, window: usize, addr: u64, rkey: Rkey, data: &[u8]) -> Result<WcStatus> {
        if data.len() as u64 > STAGING {
            return Err(VerbsError::Config(format!("at most {STAGING} bytes per WRITE")));
        }
        let q = self.qp(window)?;
        self.b.write_local(self.local + STAGE_OFF, data)?;
        self.wr += 1;
        let w =
            Wqe::write(self.local + STAGE_OFF, self.local_lkey, data.len() as u32, addr, rkey.0).with_wr_id(self.wr);
        Ok(self.post_and_wait(q, &w)?.status)
    }

    /// READ any address/rkey through access QP `window`.
    pub fn read_raw(&mut self, window: usize, addr: u64, rkey: Rkey, len: usize) -> Result<(WcStatus, Vec<u8>)> {
        if len as u64 > STAGING {
            return Err(VerbsError::Config(format!("at most {STAGING} bytes per READ")));
        }
        let q = self.qp(window)?;
        self.wr += 1;
        let w = Wqe::read(self.local + STAGE_OFF, self.local_lkey, len as u32, addr, rkey.0).with_wr_id(self.wr);
        let st = self.post_and_wait(q, &w)?.status;
        let v = if st.is_ok() { self.b.slice(self.local + STAGE_OFF, len)?.to_vec() } else { Vec::new() };
        Ok((st, v))
    }

    /// A request on the Alloc QP the MN cannot parse: answered with an error reply by the MN
    /// loop (what `omw cn bench` uses as the round-trip baseline on the same QPs).
    pub fn bad_request_round_trip(&mut self) -> Result<Option<ErrorCode>> {
        let mut b = [0u8; 8];
        b.copy_from_slice(omw_core::wire::Header::new(omw_core::wire::Kind::AllocRequest, 0x00E0_0001).as_bytes_le());
        let q = self.alloc_qp;
        self.send(q, &b)?;
        self.wait_failure(0x00E0_0001, self.timeout)
    }

    pub fn backend(&mut self) -> &mut VerbsBackend {
        &mut self.b
    }

    /// Every notice received so far (call [`Self::pump`] first to read what arrived).
    pub fn take_notices(&mut self) -> Vec<Notice> {
        self.notices.drain(..).collect()
    }

    // ------------------------------------------------------- completions, async operations

    /// Poll `q`'s send CQ and keep every completion for whoever claims its wr_id.
    fn reap(&mut self, q: Qpn) -> Result<usize> {
        let mut buf = [Completion::EMPTY; 16];
        let n = self.b.poll_cq(q, QueueSel::Send, &mut buf)?;
        for c in &buf[..n] {
            self.done.insert(c.wr_id, *c);
        }
        Ok(n)
    }

    /// Post `w` signaled on `q` and wait (bounded by the client's timeout) for its completion,
    /// keeping the completions of operations in flight.
    fn post_and_wait(&mut self, q: Qpn, w: &Wqe) -> Result<Completion> {
        let w = w.with_flags(w.flags | omw_core::wqe::WqeFlags::SIGNALED);
        self.b.post_send(q, &w)?;
        let t0 = Instant::now();
        loop {
            if let Some(c) = self.done.remove(&w.wr_id) {
                return Ok(c);
            }
            if self.reap(q)? == 0 {
                if t0.elapsed() > self.timeout {
                    return Err(VerbsError::Timeout { what: format!("a send completion on QP {q}") });
                }
                std::hint::spin_loop();
            }
        }
    }

    fn post_async(&mut self, window: usize, w: Wqe, slot: usize, read_len: Option<usize>) -> Result<OpId> {
        let q = match self.qp(window) {
            Ok(q) => q,
            Err(e) => {
                self.free_slots.push(slot);
                return Err(e);
            }
        };
        let w = w.with_flags(w.flags | omw_core::wqe::WqeFlags::SIGNALED);
        if let Err(e) = self.b.post_send(q, &w) {
            self.free_slots.push(slot);
            return Err(e);
        }
        self.in_flight.insert(w.wr_id, InFlight { qp: q, slot, read_len });
        Ok(OpId(w.wr_id))
    }

    fn take_slot(&mut self, len: u64) -> Result<(usize, u64)> {
        if len > ASYNC_SLOT {
            return Err(VerbsError::Config(format!("at most {ASYNC_SLOT} bytes per asynchronous READ/WRITE")));
        }
        let slot = self.free_slots.pop().ok_or(VerbsError::TooManyInFlight { max: ASYNC_SLOTS })?;
        Ok((slot, self.local + ASYNC_OFF + slot as u64 * ASYNC_SLOT))
    }

    /// Post a one-sided WRITE of `data` at `offset` of the chunk through access QP `window`;
    /// returns at once. Collect it with [`Self::poll_ops`] / [`Self::wait_ops`].
    pub fn post_write(&mut self, a: &Allocation, window: usize, offset: u64, data: &[u8]) -> Result<OpId> {
        let rkey = a.rkey(window).ok_or_else(|| VerbsError::Config(format!("no window {window}")))?;
        let (slot, at) = self.take_slot(data.len() as u64)?;
        if let Err(e) = self.b.write_local(at, data) {
            self.free_slots.push(slot);
            return Err(e);
        }
        self.wr += 1;
        let w = Wqe::write(at, self.local_lkey, data.len() as u32, a.base + offset, rkey.0).with_wr_id(self.wr);
        self.post_async(window, w, slot, None)
    }

    /// Post a one-sided READ of `len` bytes at `offset` of the chunk through access QP
    /// `window`; the bytes come with its [`OpDone`].
    pub fn post_read(&mut self, a: &Allocation, window: usize, offset: u64, len: usize) -> Result<OpId> {
        let rkey = a.rkey(window).ok_or_else(|| VerbsError::Config(format!("no window {window}")))?;
        let (slot, at) = self.take_slot(len as u64)?;
        self.wr += 1;
        let w = Wqe::read(at, self.local_lkey, len as u32, a.base + offset, rkey.0).with_wr_id(self.wr);
        self.post_async(window, w, slot, Some(len))
    }

    /// Asynchronous operations posted and not yet collected.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Collect the asynchronous operations that completed (in no particular order across QPs;
    /// in posting order within one QP). Does not wait. A failed operation leaves its QP pair in
    /// ERR, as a blocking one does.
    pub fn poll_ops(&mut self) -> Result<Vec<OpDone>> {
        let mut qps: Vec<Qpn> = self.in_flight.values().map(|f| f.qp).collect();
        qps.sort_unstable();
        qps.dedup();
        for q in qps {
            self.reap(q)?;
        }
        let mut ids: Vec<u64> = self.in_flight.keys().filter(|id| self.done.contains_key(id)).copied().collect();
        ids.sort_unstable();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let (Some(f), Some(c)) = (self.in_flight.remove(&id), self.done.remove(&id)) else { continue };
            let at = self.local + ASYNC_OFF + f.slot as u64 * ASYNC_SLOT;
            let data = match f.read_len {
                Some(n) if c.status.is_ok() => self.b.slice(at, n)?.to_vec(),
                _ => Vec::new(),
            };
            self.free_slots.push(f.slot);
            out.push(OpDone { id: OpId(id), status: c.status, data });
        }
        Ok(out)
    }

    /// Collect every asynchronous operation in flight, waiting at most `timeout`.
    pub fn wait_ops(&mut self, timeout: Duration) -> Result<Vec<OpDone>> {
        let t0 = Instant::now();
        let mut out = Vec::new();
        while !self.in_flight.is_empty() {
            let got = self.poll_ops()?;
            if got.is_empty() {
                if t0.elapsed() > timeout {
                    return Err(VerbsError::Timeout {
                        what: format!("{} one-sided operation(s)", self.in_flight.len()),
                    });
                }
                std::hint::spin_loop();
            }
            out.extend(got);
        }
        Ok(out)
    }
}

trait HeaderBytes {
    fn as_bytes_le(&self) -> &[u8];
}
impl HeaderBytes for omw_core::wire::Header {
    fn as_bytes_le(&self) -> &[u8] {
        zerocopy::IntoBytes::as_bytes(self)
    }
}

fn post_slot(b: &mut VerbsBackend, q: Qpn, local: u64, lkey: u32, slot: u64) -> Result<()> {
    let mut r = RecvWqe { wr_id: slot, sges: heapless::Vec::new() };
    let _ = r.sges.push(Sge { addr: local + slot * SLOT, length: SLOT as u32, lkey });
    b.post_recv(q, &r)
}
