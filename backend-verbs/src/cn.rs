//! The compute-node client on libibverbs: connect to an MN over rdma_cm, allocate and free
//! chunks, and read/write them with one-sided RDMA through the access QPs.
//!
//! The CN side is the core's [`CnDriver`] (receive slots, reply/notice/token matching,
//! staging, one-sided accesses) over the verbs backend; this file adds rdma_cm connection
//! set-up and blocking calls with deadlines.
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
use crate::cm::{parse_welcome, Hello, Role};
use crate::error::{Result, VerbsError};
use crate::rejoin::Rejoined;
use omw_core::access::AccessFlags;
use omw_core::cn::driver::{
    prime_receives, ChainConnection, CnDriver, CnError, CnEvent, CnMemory, CnQp, CnQpSet, MessageQueue,
};
pub use omw_core::cn::Allocation;
use omw_core::cn::ClientError;
use omw_core::device::{DataPath, Provision};
use omw_core::device::{Domain, WcStatus};
use omw_core::ids::{CnId, Qpn, Rkey};
use omw_core::testing::hostile::HostileCn;
use omw_core::wire::message::{ConnectInfo, ErrorCode};
use omw_core::wire::wqe::Wqe;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// One-sided operations [`CnClient::post_write`] / [`CnClient::post_read`] may have in flight.
pub const ASYNC_SLOTS: usize = 32;
/// Largest asynchronous READ/WRITE (each in flight has a staging slot of this size).
pub const ASYNC_SLOT: u64 = 128 << 10;
/// Largest single blocking READ/WRITE ([`CnClient::read`], [`CnClient::write`]: staged in
/// slot-sized pieces).
pub const STAGING: u64 = 4 << 20;
const LOCAL_LEN: u64 = CnMemory::local_len_for(ASYNC_SLOTS, ASYNC_SLOT);

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
    op: omw_core::cn::driver::OpId,
    /// READ: how many bytes come back.
    read_len: Option<usize>,
}

#[derive(Clone, Debug)]
pub struct CnOptions {
    pub device: Option<String>,
    /// How long any one operation may take.
    pub timeout: Duration,
    /// The tenant credential the hellos carry (an MN with a tenants file admits no CN
    /// without one; an open MN ignores it).
    pub credential: Option<crate::admission::Credential>,
    /// Source address of the connections (None: the route's).
    pub source: Option<std::net::Ipv4Addr>,
    /// Alloc chains to open (1..=`omw_core::mn::MAX_ALLOC_CHAINS`; at most the MN's
    /// `--alloc-chains`, or the MN refuses the connection with [`VerbsError::Rejected`]): one
    /// Alloc QP each, and up to this many allocations in flight at once.
    pub alloc_chains: u8,
}

impl Default for CnOptions {
    fn default() -> Self {
        CnOptions { device: None, timeout: Duration::from_secs(20), credential: None, source: None, alloc_chains: 1 }
    }
}

/// What the MN said unasked (on the first access QP), besides allocation replies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notice {
    Empty,
    Available,
    Failed {
        token: u32,
        code: ErrorCode,
    },
    Revoked,
    /// The MN bound window MW\[`mw`\] of the allocation at `entry_addr` again under `rkey`
    /// (someone else's SEND_WITH_INV had revoked it); [`CnClient::live`] holds the new key.
    Rekeyed {
        entry_addr: u64,
        mw: u8,
        rkey: Rkey,
    },
}

pub struct CnClient {
    d: CnDriver<VerbsBackend, 256, ASYNC_SLOTS>,
    pub cn: CnId,
    pub info: ConnectInfo,
    replies: HashMap<u32, std::result::Result<Allocation, ClientError>>,
    /// Requests whose SEND failed (token, status).
    send_failures: VecDeque<(Option<u32>, WcStatus)>,
    pub notices: VecDeque<Notice>,
    timeout: Duration,
    t0: Instant,
    next_op: u64,
    /// The MN's QPs at the other end of Alloc, Free, access 0.. (as rdma_cm negotiated them).
    mn_qpns: Vec<Option<Qpn>>,
    in_flight: HashMap<u64, InFlight>,
    /// A receive failure or bad message seen while waiting for an access: reported by the
    /// next [`CnClient::pump`].
    deferred: Option<VerbsError>,
}

impl std::fmt::Debug for CnClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CnClient").field("cn", &self.cn).field("access_qps", &self.d.qps().access.len()).finish()
    }
}

/// The hello of one of a CN's connections: signed when the CN has a credential.
fn hello(opts: &CnOptions, role: Role, nonce: u64) -> Hello {
    let k = opts.alloc_chains;
    match &opts.credential {
        Some(c) => Hello::signed_with_chains(role, k, nonce, c, crate::admission::unix_now()),
        None => Hello { role, alloc_chains: k, nonce, auth: None, rejoin: None },
    }
}

/// The driver's own refusals keep their meaning; device errors stay the verbs errors they were.
fn cn_err(e: CnError<VerbsError>) -> VerbsError {
    match e {
        CnError::Device(e) => e,
        CnError::SlotsBusy => VerbsError::TooManyInFlight { max: ASYNC_SLOTS },
        CnError::TooLong { max, .. } => VerbsError::Config(format!("at most {max} bytes per asynchronous READ/WRITE")),
        e => VerbsError::Cn(Box::new(e)),
    }
}

/// A CN's connections to its MN, before any driver runs on them: the device, the CN's QPs
/// (receives primed on both message queues), its registered memory (the core's layout, a
/// local region of `local_len` bytes), the MN's QP numbers as rdma_cm negotiated them (Alloc,
/// Free, access 0..; to check against the connect info), the group size the MN's accept
/// named, and the Alloc QPs of its alloc chains beyond the first (for
/// `CnDriver::with_alloc_chains`, with `reply_len` bytes of reply buffer).
#[derive(Debug)]
pub struct Queues {
    pub backend: VerbsBackend,
    pub qps: CnQpSet,
    pub mem: CnMemory,
    pub mn_qpns: Vec<Option<Qpn>>,
    pub group_size: u8,
    pub extra_alloc: Vec<Qpn>,
    pub reply_len: u64,
}

/// Bytes of a CN's reply buffer: a reply slot per alloc chain, in one page.
const REPLY_BUF: u64 = 4096;

/// Open the device that routes to `addr`, register the CN's memory and connect its G + K QPs
/// (K: its alloc chains; what [`CnClient::connect`] and omw-client's verbs transport share).
/// With `events`, the CQs are made on a completion channel first
/// ([`VerbsBackend::enable_completion_events`]).
pub fn connect_queues(addr: SocketAddr, opts: &CnOptions, local_len: u64, events: bool) -> Result<Queues> {
    let k = opts.alloc_chains;
    if k == 0 || k as usize > omw_core::mn::MAX_ALLOC_CHAINS || k as u64 * CnMemory::REPLY_LEN > REPLY_BUF {
        return Err(VerbsError::Config(format!("{k} alloc chains: a CN opens 1..={}", omw_core::mn::MAX_ALLOC_CHAINS)));
    }
    crate::device::device_names()?;
    let device = match &opts.device {
        Some(d) => d.clone(),
        None => crate::cm::route_device(addr, opts.timeout)?,
    };
    let mut need = crate::memlock::MemlockNeed::cn(local_len + REPLY_BUF);
    need.qps += k as u64 - 1;
    crate::memlock::ensure_memlock(need)?;
    let mut b = VerbsBackend::open_cn(Some(&device))?;
    if events {
        b.enable_completion_events()?;
    }
    let local = b.alloc_memory(local_len, 4096)?;
    let lk = b.reg_mr(Domain::CnFacing, local, local_len, AccessFlags::LOCAL_WRITE)?;
    let reply = b.alloc_memory(REPLY_BUF, 4096)?;
    // the MN's alloc reply is a WRITE_WITH_IMM into this buffer (a slot per alloc chain): the
    // only remote right
    let rk = b.reg_mr(Domain::CnFacing, reply, REPLY_BUF, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let mem = CnMemory { local, local_len, lkey: lk.lkey, reply, reply_rkey: rk.rkey };
    // unguessable: a half-open session is joined by its nonce
    let n = crate::admission::random_nonce()
        .map_err(|e| VerbsError::Config(format!("the OS's random source failed: {e}")))?;
    // MN → CN messages (connect info, notices, error replies, lease probes) arrive on the
    // Alloc QP (host-engine MN) or on access QP 0 (offloading MN) — never on a queue the
    // MN posts binds on; allocation replies (WRITE_WITH_IMM) consume receives of the Alloc
    // QP. Both get their receives before they connect: the MN may send at once.
    let alloc = b.connect_from(opts.source, addr, &hello(opts, Role::Alloc, n), opts.timeout, |b, q| {
        prime_receives(b, &mem, MessageQueue::Alloc, q)
    })?;
    let g = parse_welcome(&alloc.private_data)
        .ok_or_else(|| VerbsError::Protocol("the MN's accept carried no group size".into()))?;
    if !(2..=4).contains(&g) {
        return Err(VerbsError::Protocol(format!("group size {g} from the MN")));
    }
    let free = b.connect_from(opts.source, addr, &hello(opts, Role::Free, n), opts.timeout, |_, _| Ok(()))?;
    let mut mn_qpns = vec![alloc.remote_qpn, free.remote_qpn];
    let mut access = heapless::Vec::new();
    for i in 0..g - 1 {
        let c = b.connect_from(opts.source, addr, &hello(opts, Role::Access(i), n), opts.timeout, |b, q| match i {
            0 => prime_receives(b, &mem, MessageQueue::Access0, q),
            _ => Ok(()),
        })?;
        let _ = access.push(c.qp);
        mn_qpns.push(c.remote_qpn);
    }
    // each further alloc chain's Alloc QP carries only that chain's requests and replies: its
    // receives are posted once the driver takes it over (`CnDriver::with_alloc_chains`), before
    // the CN sends anything on it
    let mut extra_alloc = Vec::new();
    let mut mn_alloc = vec![alloc.remote_qpn];
    for j in 1..k {
        let c = b.connect_from(opts.source, addr, &hello(opts, Role::AllocChain(j), n), opts.timeout, |_, _| Ok(()))?;
        extra_alloc.push(c.qp);
        mn_alloc.push(c.remote_qpn);
    }
    let rejoiner = crate::cm::parse_rejoin_ticket(&alloc.private_data).map(|ticket| crate::rejoin::Rejoiner {
        addr,
        source: opts.source,
        timeout: opts.timeout,
        alloc_chains: k,
        nonce: n,
        ticket,
        mn_alloc,
        mn_free: free.remote_qpn,
    });
    // an MN that predates rejoins names no ticket: the CN's chain connections are then lost
    // with their QPs
    b.set_rejoiner(rejoiner);
    let qps = CnQpSet { alloc: alloc.qp, free: free.qp, access };
    Ok(Queues { backend: b, qps, mem, mn_qpns, group_size: g, extra_alloc, reply_len: REPLY_BUF })
}

/// Whether the MN's connect info names, for each connection, the QP rdma_cm connected it to
/// (else the MN mixed up sessions); the first mismatch as an error.
pub fn check_connect_info(info: &ConnectInfo, mn_qpns: &[Option<Qpn>]) -> Result<()> {
    let told: Vec<Qpn> = [info.alloc_qpn, info.free_qpn].into_iter().chain(info.access_qpns.iter().copied()).collect();
    for (i, (t, n)) in told.iter().zip(mn_qpns).enumerate() {
        if let Some(n) = n {
            if t != n {
                return Err(VerbsError::Protocol(format!(
                    "the MN's connect info names QP {t} for connection {i}, but rdma_cm connected it to QP {n}"
                )));
            }
        }
    }
    Ok(())
}

impl VerbsBackend {
    /// Connect chain connection `c` anew to the same MN-side QP (`crate::rejoin`) with the
    /// session this backend connected (`set_rejoiner`): a new QP with a rejoin hello (its
    /// receives posted first where the MN may write at once: the first Alloc QP's, which alloc
    /// replies consume), checked to be on the MN QP the old one was connected to. None where no
    /// rejoin is possible: no ticket from the MN, or an MN that refused with
    /// `Refusal::NoRejoin` (its QPs are rdma_cm's). The caller hands the new QP to its driver
    /// (`CnDriver::replace_chain_qp`) and destroys the old one.
    pub fn rejoin_chain(&mut self, c: ChainConnection, mem: &CnMemory) -> Result<Option<Rejoined>> {
        let Some(r) = self.rejoiner().cloned() else { return Ok(None) };
        let (role, want) = match c {
            ChainConnection::Alloc(0) => (Role::Alloc, r.mn_alloc.first().copied().flatten()),
            ChainConnection::Alloc(j) => (Role::AllocChain(j), r.mn_alloc.get(j as usize).copied().flatten()),
            ChainConnection::Free => (Role::Free, r.mn_free),
        };
        let hello = Hello::rejoin(role, r.alloc_chains, r.nonce, r.ticket);
        let primed = c == ChainConnection::Alloc(0);
        let got = match self.connect_from(r.source, r.addr, &hello, r.timeout, |b, q| {
            if primed {
                prime_receives(b, mem, MessageQueue::Alloc, q)?;
            }
            Ok(())
        }) {
            Ok(g) => g,
            Err(VerbsError::Rejected(crate::refusal::Refusal::NoRejoin)) => return Ok(None),
            Err(e) => return Err(e),
        };
        if want.is_some() && got.remote_qpn.is_some() && got.remote_qpn != want {
            let _ = self.destroy_qp(got.qp);
            return Err(VerbsError::Protocol(format!(
                "the MN rejoined {role:?} on QP {:?}, the connection it replaces was on {want:?}",
                got.remote_qpn
            )));
        }
        Ok(Some(Rejoined { qp: got.qp, primed }))
    }
}

impl CnClient {
    /// Connect to the MN at `addr`: Alloc QP, Free QP, then the G−1 access QPs the MN asks for.
    pub fn connect(addr: SocketAddr, opts: &CnOptions) -> Result<Self> {
        let Queues { backend: b, qps, mem, mn_qpns, group_size: g, extra_alloc, reply_len } =
            connect_queues(addr, opts, LOCAL_LEN, false)?;
        let mut d = CnDriver::with_primed_receives(b, qps, mem).map_err(cn_err)?;
        if !extra_alloc.is_empty() {
            d = d.with_alloc_chains(&extra_alloc, reply_len).map_err(cn_err)?;
        }
        let timeout_ns = opts.timeout.as_nanos().min(u64::MAX as u128) as u64;
        d.reply_timeout = timeout_ns;
        let placeholder = ConnectInfo {
            cn: CnId::UNASSIGNED,
            group_size: g,
            chunk_size: 0,
            alloc_qpn: Qpn::default(),
            free_qpn: Qpn::default(),
            access_qpns: heapless::Vec::new(),
            quota: 0,
            flags: Default::default(),
        };
        let mut c = CnClient {
            d,
            cn: CnId::UNASSIGNED,
            info: placeholder,
            replies: HashMap::new(),
            send_failures: VecDeque::new(),
            notices: VecDeque::new(),
            timeout: opts.timeout,
            t0: Instant::now(),
            next_op: 1,
            mn_qpns: Vec::new(),
            in_flight: HashMap::new(),
            deferred: None,
        };
        let deadline = Instant::now() + opts.timeout;
        while c.d.client().info().is_none() {
            if Instant::now() > deadline {
                return Err(VerbsError::Timeout { what: "the MN's connect info".into() });
            }
            c.pump()?;
        }
        if let Some(i) = c.d.client().info() {
            c.info = i.clone();
            c.cn = i.cn;
        }
        // the MN's connect info names its ends of our QPs: they must be the QPs rdma_cm
        // connected us to, or the MN mixed up sessions
        check_connect_info(&c.info, &mn_qpns)?;
        c.mn_qpns = mn_qpns;
        Ok(c)
    }

    fn now(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    /// Reconnect chain connection `c`, whose QP broke (a refused access on it, the MN's repair
    /// of its chain), to the same MN-side QP (`crate::rejoin`): everything the CN holds stays
    /// reachable. What was in flight on the old QP is over — an allocation on it is given up
    /// (`CnDriver::replace_chain_qp`) — and the old QP is destroyed. An MN that rejoins
    /// nothing refuses ([`VerbsError::Rejected`] with `Refusal::NoRejoin`): connect anew.
    pub fn rejoin(&mut self, c: ChainConnection) -> Result<()> {
        let mem = *self.d.memory();
        let new = self.d.backend.rejoin_chain(c, &mem)?.ok_or(VerbsError::Unsupported(
            "rejoining: the MN named no rejoin ticket, or refused (its QPs are rdma_cm's): connect anew",
        ))?;
        let now = self.now();
        let replaced = match self.d.replace_chain_qp(now, c, new.qp, new.primed) {
            Ok(x) => x,
            Err(e) => {
                let _ = self.d.backend.destroy_qp(new.qp);
                return Err(cn_err(e));
            }
        };
        if let Some(t) = replaced.abandoned {
            self.replies.remove(&t);
        }
        self.d.backend.destroy_qp(replaced.old)
    }

    /// Alloc chains this CN opened (its Alloc QPs): how many allocations may be in flight.
    pub fn alloc_chains(&self) -> usize {
        self.d.alloc_chains()
    }

    /// Allocation requests sent and not yet answered (at most [`Self::alloc_chains`]).
    pub fn allocs_in_flight(&self) -> usize {
        self.d.client().pending_count()
    }

    /// Access QPs (CN ends), index i carries window MW[i+1].
    pub fn access_qps(&self) -> &[Qpn] {
        &self.d.qps().access
    }

    /// The MN's QP numbers for Alloc, Free and each access QP, as rdma_cm negotiated them
    /// (checked against the MN's connect info at connect).
    pub fn mn_qpns(&self) -> &[Option<Qpn>] {
        &self.mn_qpns
    }

    /// Process what arrived (messages, replies, completions). Returns how many events. A
    /// failed receive (the QP pair is gone) is an error here, also when an access noticed it
    /// first.
    pub fn pump(&mut self) -> Result<usize> {
        let n = self.absorb()?;
        match self.deferred.take() {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }

    /// Take what arrived into the client's queues; a receive failure is kept for `pump`.
    fn absorb(&mut self) -> Result<usize> {
        let now = self.now();
        self.d.poll(now).map_err(cn_err)?;
        self.d.handle_timeout(now);
        let mut n = 0;
        while let Some(ev) = self.d.next_event() {
            n += 1;
            match ev {
                CnEvent::Allocated { token, result } => {
                    self.replies.insert(token, result);
                }
                CnEvent::Refused { token, code, .. } => {
                    if crate::log::enabled("omw_verbs::cn", crate::log::Level::Debug)
                        || std::env::var_os("OMW_DEBUG").is_some()
                    {
                        eprintln!("omw cn: error reply token {token} {code:?}");
                    }
                    self.notices.push_back(Notice::Failed { token, code });
                }
                CnEvent::Empty => self.notices.push_back(Notice::Empty),
                CnEvent::Available => self.notices.push_back(Notice::Available),
                CnEvent::Revoked => self.notices.push_back(Notice::Revoked),
                CnEvent::Rekeyed { entry_addr, mw, rkey } => {
                    self.notices.push_back(Notice::Rekeyed { entry_addr, mw, rkey })
                }
                CnEvent::ReceiveFailed { status: WcStatus::WrFlushErr, .. } => {
                    self.deferred.get_or_insert(VerbsError::Disconnected);
                }
                CnEvent::ReceiveFailed { qp, status } => {
                    self.deferred.get_or_insert(VerbsError::Completion { what: format!("receive on QP {qp}"), status });
                }
                CnEvent::SendFailed { token, status, .. } => self.send_failures.push_back((token, status)),
                CnEvent::Undecodable(e) => {
                    self.deferred.get_or_insert(VerbsError::Client(e));
                }
                // the lease probe: receiving it was the point; a timed-out reply is seen by
                // the caller waiting for it
                _ => {}
            }
        }
        Ok(n)
    }

    fn send_failed(&mut self, token: Option<u32>) -> Option<WcStatus> {
        let pos = self.send_failures.iter().position(|(t, _)| *t == token)?;
        self.send_failures.remove(pos).map(|(_, s)| s)
    }

    /// A hostile or hung CN, for tests of the MN: send an allocation request and never look
    /// at the answer (no polling, no receive reposted for it). Each answer the MN delivers
    /// uses up one of the receives posted earlier; once they are gone the MN's sends to this
    /// CN find none, and the MN must evict it without delaying anyone else.
    pub fn send_alloc_unread(&mut self) -> Result<()> {
        let now = self.now();
        let token = self.d.alloc(now).map_err(cn_err)?;
        self.d.client_mut().abandon_pending();
        // wait for the SEND itself (the MN takes one request at a time: the transport retries
        // the rest), never for the answer
        let t0 = Instant::now();
        while self.d.sends_in_flight() > 0 {
            self.d.poll_sends_only().map_err(cn_err)?;
            while let Some(ev) = self.d.next_event() {
                if let CnEvent::SendFailed { token: Some(t), status, .. } = ev {
                    if t == token {
                        return Err(VerbsError::Completion { what: "SEND to the MN".into(), status });
                    }
                }
            }
            if t0.elapsed() > self.timeout {
                return Err(VerbsError::Timeout { what: "a SEND completion".into() });
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// Allocate one chunk (waits for "available" if the MN said the queue is empty, until the
    /// timeout; then [`VerbsError::PoolEmpty`]).
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
            let now = self.now();
            let token = match self.d.alloc(now) {
                Ok(t) => t,
                Err(CnError::Client(ClientError::Backoff { .. })) => {
                    if !wait || Instant::now() > deadline {
                        return Err(VerbsError::PoolEmpty);
                    }
                    self.pump()?;
                    continue;
                }
                // every send slot holds a request the MN has not taken yet (frees sent faster
                // than it serves them): wait for one, as for any answer
                Err(CnError::SlotsBusy) if Instant::now() < deadline => {
                    self.pump()?;
                    continue;
                }
                Err(e) => return Err(cn_err(e)),
            };
            match self.alloc_answer(token, deadline) {
                // back off, wait for "available", retry
                Err(VerbsError::PoolEmpty) if wait => continue,
                r => return r,
            }
        }
    }

    /// Send an allocation request without waiting for its answer (several CNs' requests can
    /// then contend; with several alloc chains, one CN has up to one in flight per chain);
    /// collect it with [`Self::alloc_finish`].
    pub fn alloc_begin(&mut self) -> Result<u32> {
        self.pump()?;
        let now = self.now();
        match self.d.alloc(now) {
            Err(CnError::Client(ClientError::Backoff { .. })) => Err(VerbsError::PoolEmpty),
            r => r.map_err(cn_err),
        }
    }

    /// The answer to the allocation request `token` (waits up to the client's timeout).
    pub fn alloc_finish(&mut self, token: u32) -> Result<Allocation> {
        let deadline = Instant::now() + self.timeout;
        self.alloc_answer(token, deadline)
    }

    /// Allocate, but name `access_qpns` (MN ends) for the access windows instead of this CN's
    /// own — what a confused or hostile CN can send; the MN must refuse it or bind the windows
    /// where they hurt nobody but the caller.
    pub fn alloc_naming(&mut self, access_qpns: &[Qpn]) -> Result<Allocation> {
        self.pump()?;
        let now = self.now();
        let token = self.d.alloc_naming(now, access_qpns).map_err(cn_err)?;
        self.alloc_finish(token)
    }

    /// The allocations this client holds, with the keys it uses now (a window the MN bound
    /// again after a remote invalidation carries its new key: retry an access with these).
    pub fn live(&self) -> &[Allocation] {
        self.d.client().live()
    }

    /// A hostile CN, for tests of the MN: a SEND_WITH_INV of 8 bytes naming `rkey` on this
    /// CN's own QP `qp`; returns its completion status. Name only a **bound** window's rkey:
    /// on soft-RoCE a free window's last key panics the MN's kernel (docs/VERBS.md).
    pub fn send_with_inv(&mut self, qp: CnQp, rkey: Rkey) -> Result<WcStatus> {
        let op = self.d.post_wqe(qp, Wqe::send_with_inv(0, 0, 8, rkey.0)).map_err(cn_err)?;
        self.wait_op(op, &mut [])
    }

    /// Any bytes on this CN's Alloc or Free QP (a broken or hostile CN).
    pub fn send_raw(&mut self, qp: CnQp, bytes: &[u8]) -> Result<()> {
        self.d.send_raw(qp, bytes).map_err(cn_err)
    }

    fn alloc_answer(&mut self, token: u32, deadline: Instant) -> Result<Allocation> {
        self.first_answer(&[token], deadline)?.1
    }

    /// The first answer to any of the allocation requests `tokens` (waits up to the client's
    /// timeout): its token, and the allocation or why it failed. An allocation that arrived is
    /// handed out before any refusal, so a CN with several chains never waits on a request the
    /// MN could not serve while chunks it was sent sit unread.
    pub fn alloc_finish_any(&mut self, tokens: &[u32]) -> Result<(u32, Result<Allocation>)> {
        let deadline = Instant::now() + self.timeout;
        self.first_answer(tokens, deadline)
    }

    fn first_answer(&mut self, tokens: &[u32], deadline: Instant) -> Result<(u32, Result<Allocation>)> {
        loop {
            if let Some(t) = tokens.iter().copied().find(|t| matches!(self.replies.get(t), Some(Ok(_)))) {
                if let Some(r) = self.replies.remove(&t) {
                    return Ok((t, r.map_err(VerbsError::Client)));
                }
            }
            for &token in tokens {
                if let Some(r) = self.replies.remove(&token) {
                    return Ok((token, r.map_err(VerbsError::Client)));
                }
                if let Some(status) = self.send_failed(Some(token)) {
                    return Ok((token, Err(VerbsError::Completion { what: "SEND to the MN".into(), status })));
                }
                if let Some(pos) =
                    self.notices.iter().position(|n| matches!(n, Notice::Failed { token: t, .. } if *t == token))
                {
                    if let Some(Notice::Failed { code, .. }) = self.notices.remove(pos) {
                        return Ok((
                            token,
                            Err(match code {
                                ErrorCode::Empty => VerbsError::PoolEmpty,
                                ErrorCode::QuotaExceeded => VerbsError::QuotaExceeded,
                                code => VerbsError::Refused(code),
                            }),
                        ));
                    }
                }
            }
            let pending = tokens.iter().any(|t| self.d.client().is_pending(*t));
            if Instant::now() > deadline || !pending {
                for &t in tokens {
                    if self.d.client().is_pending(t) {
                        // its chain is idle again; other requests stay in flight
                        self.d.abandon_alloc(t);
                    }
                }
                return Err(VerbsError::Timeout { what: "the allocation reply".into() });
            }
            self.pump()?;
        }
    }

    /// Free a chunk this client holds. The MN does not confirm a free; it reports a refusal.
    /// With every send slot taken (frees sent faster than the MN takes them: each waits in RNR
    /// retries for the MN's one request buffer on the Free QP, holding its slot) it waits for
    /// one, up to the client's timeout — back-pressure, not an error.
    pub fn free(&mut self, a: &Allocation) -> Result<u32> {
        let deadline = Instant::now() + self.timeout;
        loop {
            match self.d.free(a) {
                Err(CnError::SlotsBusy) if Instant::now() < deadline => {
                    self.pump()?;
                }
                r => return r.map_err(cn_err),
            }
        }
    }

    /// Send a free request for any entry address (even one this client does not hold), then
    /// wait up to `wait` for a refusal. `Ok(None)`: none arrived.
    pub fn free_entry(&mut self, entry_addr: u64, wait: Duration) -> Result<Option<ErrorCode>> {
        let token = self.d.free_entry(entry_addr).map_err(cn_err)?;
        self.wait_failure(token, wait)
    }

    /// Wait up to `wait` for an error reply with this token.
    pub fn wait_failure(&mut self, token: u32, wait: Duration) -> Result<Option<ErrorCode>> {
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            self.pump()?;
            if let Some(status) = self.send_failed(Some(token)) {
                return Err(VerbsError::Completion { what: "SEND to the MN".into(), status });
            }
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

    fn window_rkey(a: &Allocation, window: usize) -> Result<Rkey> {
        a.rkey(window).ok_or_else(|| VerbsError::Config(format!("no window {window}")))
    }

    /// One-sided WRITE of `data` at `offset` of the chunk through access QP `window`.
    pub fn write(&mut self, a: &Allocation, window: usize, offset: u64, data: &[u8]) -> Result<()> {
        let rkey = Self::window_rkey(a, window)?;
        let st = self.write_raw(window, a.base + offset, rkey, data)?;
        if !st.is_ok() {
            return Err(VerbsError::Completion { what: "RDMA WRITE".into(), status: st });
        }
        Ok(())
    }

    /// One-sided READ of `len` bytes at `offset` of the chunk through access QP `window`.
    pub fn read(&mut self, a: &Allocation, window: usize, offset: u64, len: usize) -> Result<Vec<u8>> {
        let rkey = Self::window_rkey(a, window)?;
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
        for (k, piece) in data.chunks(ASYNC_SLOT as usize).enumerate() {
            let op = self.d.post_write(window, addr + (k as u64 * ASYNC_SLOT), rkey, piece).map_err(cn_err)?;
            let done = self.wait_op(op, &mut [])?;
            if !done.is_ok() {
                return Ok(done);
            }
        }
        Ok(WcStatus::Success)
    }

    /// READ any address/rkey through access QP `window`.
    pub fn read_raw(&mut self, window: usize, addr: u64, rkey: Rkey, len: usize) -> Result<(WcStatus, Vec<u8>)> {
        if len as u64 > STAGING {
            return Err(VerbsError::Config(format!("at most {STAGING} bytes per READ")));
        }
        let mut v = vec![0u8; len];
        for (k, piece) in v.chunks_mut(ASYNC_SLOT as usize).enumerate() {
            let op = self.d.post_read(window, addr + (k as u64 * ASYNC_SLOT), rkey, piece.len()).map_err(cn_err)?;
            let st = self.wait_op(op, piece)?;
            if !st.is_ok() {
                return Ok((st, Vec::new()));
            }
        }
        Ok((WcStatus::Success, v))
    }

    /// Wait (bounded by the client's timeout) for one access, keeping everything else.
    fn wait_op(&mut self, op: omw_core::cn::driver::OpId, out: &mut [u8]) -> Result<WcStatus> {
        let t0 = Instant::now();
        loop {
            self.absorb()?;
            if let Some(d) = self.d.access_done(op, out).map_err(cn_err)? {
                return Ok(d.status);
            }
            if t0.elapsed() > self.timeout {
                return Err(VerbsError::Timeout { what: "a one-sided access's completion".into() });
            }
            std::hint::spin_loop();
        }
    }

    /// A request on the Alloc QP the MN cannot parse: answered with an error reply by the MN
    /// loop (what `omw cn bench` uses as the round-trip baseline on the same QPs).
    pub fn bad_request_round_trip(&mut self) -> Result<Option<ErrorCode>> {
        let h = omw_core::wire::message::Header::new(omw_core::wire::message::Kind::AllocRequest, 0x00E0_0001);
        self.d.send_raw(CnQp::Alloc, zerocopy::IntoBytes::as_bytes(&h)).map_err(cn_err)?;
        self.wait_failure(0x00E0_0001, self.timeout)
    }

    pub fn backend(&mut self) -> &mut VerbsBackend {
        &mut self.d.backend
    }

    /// Every notice received so far (call [`Self::pump`] first to read what arrived).
    pub fn take_notices(&mut self) -> Vec<Notice> {
        self.notices.drain(..).collect()
    }

    // ------------------------------------------------------- asynchronous operations

    fn track(&mut self, op: omw_core::cn::driver::OpId, read_len: Option<usize>) -> OpId {
        let id = self.next_op;
        self.next_op += 1;
        self.in_flight.insert(id, InFlight { op, read_len });
        OpId(id)
    }

    /// Post a one-sided WRITE of `data` at `offset` of the chunk through access QP `window`;
    /// returns at once. Collect it with [`Self::poll_ops`] / [`Self::wait_ops`].
    pub fn post_write(&mut self, a: &Allocation, window: usize, offset: u64, data: &[u8]) -> Result<OpId> {
        let rkey = Self::window_rkey(a, window)?;
        let op = self.d.post_write(window, a.base + offset, rkey, data).map_err(cn_err)?;
        Ok(self.track(op, None))
    }

    /// Post a one-sided READ of `len` bytes at `offset` of the chunk through access QP
    /// `window`; the bytes come with its [`OpDone`].
    pub fn post_read(&mut self, a: &Allocation, window: usize, offset: u64, len: usize) -> Result<OpId> {
        let rkey = Self::window_rkey(a, window)?;
        let op = self.d.post_read(window, a.base + offset, rkey, len).map_err(cn_err)?;
        Ok(self.track(op, Some(len)))
    }

    /// Asynchronous operations posted and not yet collected.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Collect the asynchronous operations that completed (in posting order within one QP).
    /// Does not wait. A failed operation leaves its QP pair in ERR, as a blocking one does.
    pub fn poll_ops(&mut self) -> Result<Vec<OpDone>> {
        self.absorb()?;
        let mut ids: Vec<u64> = self.in_flight.keys().copied().collect();
        ids.sort_unstable();
        let mut out = Vec::new();
        for id in ids {
            let f = self.in_flight[&id];
            let mut data = vec![0u8; f.read_len.unwrap_or(0)];
            if let Some(d) = self.d.access_done(f.op, &mut data).map_err(cn_err)? {
                self.in_flight.remove(&id);
                data.truncate(d.len);
                out.push(OpDone { id: OpId(id), status: d.status, data });
            }
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
