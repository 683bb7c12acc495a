//! RC connections through rdma_cm: the MN listens on IP:port, CNs connect.
//!
//! Each CN opens one Alloc QP per alloc chain it asks for (1 ..= the MN's `--alloc-chains`), one
//! Free QP and G−1 access QPs. Every connect request carries a [`Hello`] in its private data
//! (role, the alloc chains the CN opens, the CN's session nonce) so the MN can group a CN's
//! connections; the MN's accept of the Alloc connection answers with the pool's group size,
//! which tells the CN how many access QPs to open. A request the MN refuses for a reason the CN
//! can act on (asking more alloc chains than the MN allows) carries a [`Refusal`] in the
//! reject's private data.
//!
//! A CN whose Alloc QP broke (a refused access on it, the MN's repair of its alloc chain) asks
//! for it again with a *rejoin* hello: its session's nonce and the rejoin ticket the MN's
//! welcome gave it (`crate::rejoin`). The MN connects the same MN-side QP to the new CN QP,
//! so the CN keeps everything it holds.
//!
//! The hello's layout (little-endian; rdma_cm RC carries at most 56 bytes of private data in a
//! connect request, and 148 in a reject — the IB CM's REQ and REJ private data):
//!
//! | bytes  | field                                                                       |
//! |--------|-----------------------------------------------------------------------------|
//! | 0..4   | magic `"OWMC"` (`HELLO_MAGIC`)                                              |
//! | 4      | version: 1 plain, 2 with a credential, 4 rejoin (3 is a refusal's)          |
//! | 5      | role kind: 0 Alloc (alloc chain 0), 1 Free, 2 access, 3 Alloc of chain ≥ 1  |
//! | 6      | role index: the access QP's (kind 2), the alloc chain's (kind 3), else 0    |
//! | 7      | alloc chains the CN opens, ≥ 1 (the same on each of its connections)        |
//! | 8..16  | the CN's session nonce                                                      |
//! | 16..20 | (version 2) tenant id                                                       |
//! | 20..28 | (version 2) timestamp, Unix seconds                                         |
//! | 28..48 | (version 2) tag over tenant, nonce, bytes 5..8 and timestamp                |
//! | 16..24 | (version 4) the session's rejoin ticket, from the MN's welcome              |
//!
//! The welcome (the Alloc connection's accept): magic, version 1, group size, two zero bytes,
//! then the session's rejoin ticket (bytes 8..16; an MN that predates rejoins sends 8 bytes).
//!
//! The refusal's layout is `crate::refusal`'s.

use crate::backend::VerbsBackend;
use crate::cm_event::{reject_raw, sockaddr};
pub use crate::cm_event::{CmEvent, CmEventKind, CmId};
use crate::error::{Result, VerbsError};
pub use crate::refusal::{Refusal, REFUSAL_LEN};
use omw_core::ids::Qpn;
use rdma_sys::*;
use std::fmt;
use std::net::SocketAddr;
use std::ptr;
use std::time::{Duration, Instant};

pub const HELLO_MAGIC: u32 = crate::refusal::MAGIC; // "OWMC"
/// A hello without a credential (an MN running open).
pub const HELLO_LEN: usize = 16;
/// A hello with a credential: tenant u32, timestamp u64 (Unix seconds), tag (20 bytes) after
/// the 16 bytes of the plain one — 48 of rdma_cm RC's 56 bytes of private data.
pub const AUTH_HELLO_LEN: usize = HELLO_LEN + 4 + 8 + crate::admission::TAG_LEN;
/// A rejoin hello: the plain one's 16 bytes and the rejoin ticket.
pub const REJOIN_HELLO_LEN: usize = HELLO_LEN + 8;
/// The welcome: the pool's group size and the session's rejoin ticket.
pub const WELCOME_LEN: usize = 16;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Role {
    /// The Alloc QP of the CN's first alloc chain (its connect info and, host engine, the MN's
    /// messages arrive on it).
    Alloc,
    Free,
    Access(u8),
    /// The Alloc QP of the CN's alloc chain `j` (1 ≤ j < the chains its hello names): that
    /// chain's requests and replies only.
    AllocChain(u8),
}

impl Role {
    /// The role as the hello encodes it: kind, index.
    pub fn wire(self) -> [u8; 2] {
        match self {
            Role::Alloc => [0, 0],
            Role::Free => [1, 0],
            Role::Access(i) => [2, i],
            Role::AllocChain(j) => [3, j],
        }
    }
}

/// Why private data is no hello: the MN refuses the request with it (hostile or foreign peers
/// send anything).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum HelloError {
    /// Fewer bytes than a hello (or, version 2, than a hello with its credential).
    TooShort { len: usize, need: usize },
    /// Not an omw hello at all.
    BadMagic,
    /// A version this MN does not speak.
    Version(u8),
    /// A role kind outside 0..=3, or an alloc chain index of 0 (that is the Alloc role).
    Role { kind: u8, index: u8 },
    /// No alloc chain at all: every CN opens at least its first.
    NoAllocChains,
    /// An alloc chain index at or past the chains the hello names.
    ChainIndex { index: u8, chains: u8 },
}

impl fmt::Display for HelloError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HelloError::TooShort { len, need } => write!(f, "{len} bytes of private data, a hello needs {need}"),
            HelloError::BadMagic => f.write_str("no omw hello magic"),
            HelloError::Version(v) => write!(f, "hello version {v} (this MN speaks 1, 2 and 4)"),
            HelloError::Role { kind, index } => write!(f, "no role of kind {kind} index {index}"),
            HelloError::NoAllocChains => f.write_str("a hello naming 0 alloc chains"),
            HelloError::ChainIndex { index, chains } => {
                write!(f, "alloc chain {index} of a CN opening {chains} alloc chain(s)")
            }
        }
    }
}

impl std::error::Error for HelloError {}

/// A hello's credential ([`crate::admission`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct HelloAuth {
    pub tenant: omw_core::mn::tenant::TenantId,
    pub timestamp: u64,
    pub tag: [u8; crate::admission::TAG_LEN],
}

/// CN → MN private data of a connect request.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Hello {
    pub role: Role,
    /// Alloc chains the CN opens (one Alloc QP each, [`Role::Alloc`] and [`Role::AllocChain`]).
    pub alloc_chains: u8,
    pub nonce: u64,
    pub auth: Option<HelloAuth>,
    /// A rejoin: the session's rejoin ticket (the welcome's). It stands in for the credential:
    /// a rejoin opens no session and takes no slot, it reconnects one of a complete session's.
    pub rejoin: Option<u64>,
}

impl Hello {
    /// An unsigned hello of a CN with one alloc chain.
    pub fn new(role: Role, nonce: u64) -> Hello {
        Hello { role, alloc_chains: 1, nonce, auth: None, rejoin: None }
    }

    /// A rejoin of connection `role` of the complete session `nonce` (whose CN opened
    /// `alloc_chains` alloc chains), with the session's rejoin `ticket`.
    pub fn rejoin(role: Role, alloc_chains: u8, nonce: u64, ticket: u64) -> Hello {
        Hello { role, alloc_chains, nonce, auth: None, rejoin: Some(ticket) }
    }

    /// A hello of a CN opening `alloc_chains` alloc chains, signed with `cred` at Unix time
    /// `timestamp`.
    pub fn signed_with_chains(
        role: Role,
        alloc_chains: u8,
        nonce: u64,
        cred: &crate::admission::Credential,
        timestamp: u64,
    ) -> Hello {
        let mut h = Hello { role, alloc_chains, nonce, auth: None, rejoin: None };
        let tag = cred.tag(nonce, h.signed_fields(), timestamp);
        h.auth = Some(HelloAuth { tenant: cred.id, timestamp, tag });
        h
    }

    /// [`Hello::signed_with_chains`] for one alloc chain.
    pub fn signed(role: Role, nonce: u64, cred: &crate::admission::Credential, timestamp: u64) -> Hello {
        Self::signed_with_chains(role, 1, nonce, cred, timestamp)
    }

    /// The hello's bytes 5..8 (role kind, role index, alloc chains), which the credential's tag
    /// covers besides tenant, nonce and timestamp.
    pub fn signed_fields(&self) -> [u8; 3] {
        let [k, i] = self.role.wire();
        [k, i, self.alloc_chains]
    }

    /// The hello's bytes (a rejoin carries its ticket and no credential).
    pub fn encode(&self) -> Vec<u8> {
        let (len, version) = match (self.rejoin, self.auth) {
            (Some(_), _) => (REJOIN_HELLO_LEN, 4),
            (None, Some(_)) => (AUTH_HELLO_LEN, 2),
            (None, None) => (HELLO_LEN, 1),
        };
        let mut b = vec![0u8; len];
        b[..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4] = version;
        b[5..8].copy_from_slice(&self.signed_fields());
        b[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        if let Some(t) = self.rejoin {
            b[16..24].copy_from_slice(&t.to_le_bytes());
        } else if let Some(a) = &self.auth {
            b[16..20].copy_from_slice(&a.tenant.0.to_le_bytes());
            b[20..28].copy_from_slice(&a.timestamp.to_le_bytes());
            b[28..].copy_from_slice(&a.tag);
        }
        b
    }

    /// The hello in `b` (extra bytes after it are ignored: rdma_cm may pad private data).
    pub fn decode(b: &[u8]) -> std::result::Result<Hello, HelloError> {
        if b.len() < HELLO_LEN {
            return Err(HelloError::TooShort { len: b.len(), need: HELLO_LEN });
        }
        if b[..4] != HELLO_MAGIC.to_le_bytes() {
            return Err(HelloError::BadMagic);
        }
        let chains = b[7];
        if chains == 0 {
            return Err(HelloError::NoAllocChains);
        }
        let role = match (b[5], b[6]) {
            (0, 0) => Role::Alloc,
            (1, 0) => Role::Free,
            (2, i) => Role::Access(i),
            (3, j) if j >= 1 && j < chains => Role::AllocChain(j),
            (3, j) if j >= 1 => return Err(HelloError::ChainIndex { index: j, chains }),
            (kind, index) => return Err(HelloError::Role { kind, index }),
        };
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let mut rejoin = None;
        let auth = match b[4] {
            1 => None,
            4 if b.len() < REJOIN_HELLO_LEN => {
                return Err(HelloError::TooShort { len: b.len(), need: REJOIN_HELLO_LEN })
            }
            4 => {
                rejoin = Some(u64_at(16));
                None
            }
            2 if b.len() < AUTH_HELLO_LEN => return Err(HelloError::TooShort { len: b.len(), need: AUTH_HELLO_LEN }),
            2 => {
                let mut tag = [0u8; crate::admission::TAG_LEN];
                tag.copy_from_slice(&b[28..AUTH_HELLO_LEN]);
                let tenant = omw_core::mn::tenant::TenantId(u32::from_le_bytes([b[16], b[17], b[18], b[19]]));
                Some(HelloAuth { tenant, timestamp: u64_at(20), tag })
            }
            v => return Err(HelloError::Version(v)),
        };
        Ok(Hello { role, alloc_chains: chains, nonce: u64_at(8), auth, rejoin })
    }
}

/// MN → CN private data of the Alloc connection's accept: the pool's group size.
pub fn welcome(group_size: u8, rejoin_ticket: u64) -> [u8; WELCOME_LEN] {
    let mut b = [0u8; WELCOME_LEN];
    b[..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4] = 1;
    b[5] = group_size;
    b[8..].copy_from_slice(&rejoin_ticket.to_le_bytes());
    b
}
/// The welcome's group size.
pub fn parse_welcome(b: &[u8]) -> Option<u8> {
    (b.len() >= 8 && b[..4] == HELLO_MAGIC.to_le_bytes() && b[4] == 1).then_some(b[5])
}
/// The welcome's rejoin ticket (None: an MN that predates rejoins, or no welcome).
pub fn parse_rejoin_ticket(b: &[u8]) -> Option<u64> {
    parse_welcome(b)?;
    let t: [u8; 8] = b.get(8..WELCOME_LEN)?.try_into().ok()?;
    Some(u64::from_le_bytes(t))
}

/// RNR retry count the CN asks the MN's QP to use for sends to it: finite (7 is infinite), so a
/// CN that stops posting receives makes the MN's send fail instead of retrying forever. The MN
/// refuses a CN that asks for 7.
pub const CN_REQUESTED_RNR_RETRY: u8 = 6;

/// A connection the CN side set up ([`VerbsBackend::connect`]).
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rejoin_carries_its_ticket_and_a_short_one_is_refused() {
        let b = Hello::rejoin(Role::Alloc, 2, 0x77, 0xfeed).encode();
        assert_eq!((b.len(), b[4]), (REJOIN_HELLO_LEN, 4));
        assert_eq!(Hello::decode(&b).unwrap().rejoin, Some(0xfeed));
        assert_eq!(
            Hello::decode(&b[..HELLO_LEN]),
            Err(HelloError::TooShort { len: HELLO_LEN, need: REJOIN_HELLO_LEN })
        );
        // the welcome names the ticket; an 8-byte one (an MN before rejoins) names none
        let w = welcome(5, 0xfeed);
        assert_eq!((parse_welcome(&w), parse_rejoin_ticket(&w)), (Some(5), Some(0xfeed)));
        assert_eq!((parse_welcome(&w[..8]), parse_rejoin_ticket(&w[..8])), (Some(5), None));
    }

    #[test]
    fn hellos_round_trip_and_fit_rdma_cm() {
        let cred = crate::admission::Credential::new("alice", vec![7; 16]).unwrap();
        for h in [
            Hello::new(Role::Access(1), 0xdead_beef),
            Hello::signed(Role::Free, 9, &cred, 1234),
            Hello { role: Role::AllocChain(3), alloc_chains: 4, nonce: 5, auth: None, rejoin: None },
            Hello::signed_with_chains(Role::AllocChain(1), 2, 9, &cred, 1234),
            Hello::rejoin(Role::Alloc, 1, 9, 0x0123_4567_89ab_cdef),
            Hello::rejoin(Role::AllocChain(2), 3, 9, 1),
        ] {
            let b = h.encode();
            assert!(b.len() <= 56);
            assert_eq!(Hello::decode(&b), Ok(h));
        }
        let b = Hello::signed(Role::Alloc, 9, &cred, 1234).encode();
        assert_eq!(
            Hello::decode(&b[..HELLO_LEN + 4]),
            Err(HelloError::TooShort { len: HELLO_LEN + 4, need: AUTH_HELLO_LEN }),
            "a cut credential is no hello"
        );
        assert_eq!(Hello::decode(&[0; 16]), Err(HelloError::BadMagic));
        assert_eq!(Hello::decode(&[1, 2, 3]), Err(HelloError::TooShort { len: 3, need: HELLO_LEN }));
    }

    /// What a hostile peer can put in bytes 4..8: each a typed error, none a panic.
    #[test]
    fn hostile_hellos_are_typed_errors() {
        let good = Hello { role: Role::AllocChain(1), alloc_chains: 2, nonce: 7, auth: None, rejoin: None }.encode();
        let with = |i: usize, v: u8| {
            let mut b = good.clone();
            b[i] = v;
            Hello::decode(&b)
        };
        assert_eq!(with(7, 0), Err(HelloError::NoAllocChains));
        assert_eq!(with(6, 2), Err(HelloError::ChainIndex { index: 2, chains: 2 }));
        assert_eq!(with(6, 255), Err(HelloError::ChainIndex { index: 255, chains: 2 }));
        assert_eq!(with(6, 0), Err(HelloError::Role { kind: 3, index: 0 }), "chain 0 is the Alloc role");
        assert_eq!(with(5, 4), Err(HelloError::Role { kind: 4, index: 1 }));
        assert_eq!(with(4, 9), Err(HelloError::Version(9)));
        assert_eq!(with(4, 2), Err(HelloError::TooShort { len: HELLO_LEN, need: AUTH_HELLO_LEN }));
        // the Alloc and Free roles have no index
        let mut b = Hello::new(Role::Free, 7).encode();
        b[6] = 1;
        assert_eq!(Hello::decode(&b), Err(HelloError::Role { kind: 1, index: 1 }));
        // any count the byte holds decodes: the MN's limit is the MN's to apply (a refusal)
        assert_eq!(with(7, 255).map(|h| h.alloc_chains), Ok(255));
        // every value of each of bytes 4..8: typed, never a panic
        for v in 0..=255u8 {
            for i in 4..8 {
                let _ = with(i, v);
            }
        }
    }

    #[test]
    fn the_tag_covers_the_alloc_chains() {
        let cred = crate::admission::Credential::new("alice", vec![7; 16]).unwrap();
        let h = Hello::signed_with_chains(Role::Alloc, 2, 9, &cred, 1234);
        let tag = h.auth.unwrap().tag;
        assert!(cred.verify(9, [0, 0, 2], 1234, &tag));
        assert!(!cred.verify(9, [0, 0, 4], 1234, &tag), "a changed chain count fails the tag");
    }
}

#[derive(Clone, Debug)]
pub struct Connected {
    /// The local QP.
    pub qp: Qpn,
    /// The MN's QP at the other end, as rdma_cm negotiated it.
    pub remote_qpn: Option<Qpn>,
    /// The accept's private data.
    pub private_data: Vec<u8>,
}

impl VerbsBackend {
    /// Listen for CNs on `addr` (an address of this backend's device).
    pub fn listen(&mut self, addr: SocketAddr, backlog: i32) -> Result<()> {
        let id = self.cm.bind(addr)?;
        // SAFETY: id is bound; verbs is set when the address belongs to an RDMA device.
        let verbs = unsafe { (*id).verbs };
        if !verbs.is_null() && verbs != self.raw_context() {
            return Err(VerbsError::Config(format!(
                "{addr} belongs to another RDMA device than {}: pass --device with the device that owns it",
                self.device_name()
            )));
        }
        self.cm.listen(id, addr, backlog)
    }

    /// Next rdma_cm event, waiting at most `timeout` (zero: do not wait). Events read earlier
    /// while a connect waited for its own come first, in the order they arrived.
    pub fn poll_cm(&mut self, timeout: Duration) -> Result<Option<CmEvent>> {
        self.cm.poll(timeout)
    }

    /// MN side: create the QP of a connection request and accept it with `private` as the
    /// reply's private data (the MN driver posts the QP's receives when the CN is complete).
    /// `id` must be a connection request [`Self::poll_cm`] reported and nobody accepted or
    /// rejected yet; on failure it is rejected.
    pub fn accept(&mut self, id: CmId, private: &[u8]) -> Result<Qpn> {
        let id = self
            .cm
            .take_request(id)
            .ok_or_else(|| VerbsError::Config("accept: not a pending connection request".into()))?;
        let q = match self.create_cm_qp(id) {
            Ok(q) => q,
            Err(e) => {
                reject_raw(id);
                return Err(e);
            }
        };
        let rd = (self.device_info().max_qp_rd_atom.clamp(1, 16)) as u8;
        // SAFETY: rdma_conn_param is plain data; private outlives the call.
        let rc = unsafe {
            let mut p: rdma_conn_param = std::mem::zeroed();
            p.private_data = private.as_ptr() as *const libc::c_void;
            p.private_data_len = private.len() as u8;
            p.responder_resources = rd;
            p.initiator_depth = rd;
            p.rnr_retry_count = 7;
            p.retry_count = 7;
            rdma_accept(id, &mut p)
        };
        if rc != 0 {
            let e = VerbsError::rc("rdma_accept", rc);
            let _ = omw_core::device::DataPath::destroy_qp(self, q);
            return Err(e);
        }
        self.short_rnr_timer(q);
        Ok(q)
    }

    /// MN side: refuse a pending connection request (ignored if `id` is not one), with
    /// `private` as the reject's private data (empty: none).
    pub fn reject(&mut self, id: CmId, private: &[u8]) {
        self.cm.reject_with(id, private)
    }

    /// CN side, step 1: resolve the MN's address and route with a fresh id; returns the id
    /// and the name of the local device the route uses.
    pub(crate) fn resolve(
        ch_owner: &mut Self,
        src: Option<std::net::Ipv4Addr>,
        addr: SocketAddr,
        deadline: Instant,
    ) -> Result<*mut rdma_cm_id> {
        let id = ch_owner.cm.new_id()?;
        let mut sa = sockaddr(addr)?;
        let mut src_sa = src.map(|ip| sockaddr(SocketAddr::new(ip.into(), 0))).transpose()?;
        let src_ptr = src_sa.as_mut().map_or(ptr::null_mut(), |s| s as *mut libc::sockaddr_in as *mut libc::sockaddr);
        let peer = addr.to_string();
        let left = deadline.saturating_duration_since(Instant::now()).as_millis().clamp(100, 10_000) as i32;
        // SAFETY: id live; sa and src_sa (if any) valid for the call.
        let rc =
            unsafe { rdma_resolve_addr(id, src_ptr, &mut sa as *mut libc::sockaddr_in as *mut libc::sockaddr, left) };
        if rc != 0 {
            return Err(VerbsError::PeerUnreachable {
                addr: peer,
                detail: format!("rdma_resolve_addr: {}", std::io::Error::last_os_error()),
            });
        }
        ch_owner.cm.wait_event_for(id, CmEventKind::AddrResolved, &peer, deadline)?;
        // SAFETY: the address is resolved.
        let rc = unsafe { rdma_resolve_route(id, left) };
        if rc != 0 {
            return Err(VerbsError::PeerUnreachable {
                addr: peer,
                detail: format!("rdma_resolve_route: {}", std::io::Error::last_os_error()),
            });
        }
        ch_owner.cm.wait_event_for(id, CmEventKind::RouteResolved, &peer, deadline)?;
        Ok(id)
    }

    /// CN side: connect to the MN with `hello`; `prepare` posts receives before the connect.
    /// Returns the QP, the MN's QP number and the accept's private data.
    pub fn connect(
        &mut self,
        addr: SocketAddr,
        hello: &Hello,
        timeout: Duration,
        prepare: impl FnOnce(&mut Self, Qpn) -> Result<()>,
    ) -> Result<Connected> {
        self.connect_from(None, addr, hello, timeout, prepare)
    }

    /// [`Self::connect`] from source address `src` (None: the route's) — a host with several
    /// addresses, or a test playing several hosts on one device.
    pub fn connect_from(
        &mut self,
        src: Option<std::net::Ipv4Addr>,
        addr: SocketAddr,
        hello: &Hello,
        timeout: Duration,
        prepare: impl FnOnce(&mut Self, Qpn) -> Result<()>,
    ) -> Result<Connected> {
        let deadline = Instant::now() + timeout;
        let id = Self::resolve(self, src, addr, deadline)?;
        let q = self.create_cm_qp(id)?;
        self.cm.forget_id(id); // owned by the QP entry from now on
        let r = self.connect_qp(q, id, addr, hello, deadline, prepare);
        if r.is_err() {
            // refused, unreachable, timed out: nothing of the attempt stays (its QP and id)
            let _ = omw_core::device::DataPath::destroy_qp(self, q);
        }
        r
    }

    /// The part of [`Self::connect_from`] after the QP exists: prepare it, connect, wait.
    fn connect_qp(
        &mut self,
        q: Qpn,
        id: *mut rdma_cm_id,
        addr: SocketAddr,
        hello: &Hello,
        deadline: Instant,
        prepare: impl FnOnce(&mut Self, Qpn) -> Result<()>,
    ) -> Result<Connected> {
        prepare(self, q)?;
        let private = hello.encode();
        debug_assert!(private.len() <= 56, "rdma_cm RC private data is at most 56 bytes");
        let rd = (self.device_info().max_qp_rd_atom.clamp(1, 16)) as u8;
        // SAFETY: conn param is plain data; private outlives the call.
        let rc = unsafe {
            let mut p: rdma_conn_param = std::mem::zeroed();
            p.private_data = private.as_ptr() as *const libc::c_void;
            p.private_data_len = private.len() as u8;
            p.responder_resources = rd;
            p.initiator_depth = rd;
            p.retry_count = 7;
            p.rnr_retry_count = CN_REQUESTED_RNR_RETRY;
            rdma_connect(id, &mut p)
        };
        if rc != 0 {
            return Err(VerbsError::PeerUnreachable {
                addr: addr.to_string(),
                detail: format!("rdma_connect: {}", std::io::Error::last_os_error()),
            });
        }
        let ev = self.cm.wait_event_for(id, CmEventKind::Established, &addr.to_string(), deadline)?;
        // the QP's own attributes say the same where the event did not carry it
        let remote_qpn = ev.remote_qpn.or_else(|| self.dest_qpn(q));
        self.short_rnr_timer(q);
        Ok(Connected { qp: q, remote_qpn, private_data: ev.private_data })
    }

    /// rdma_cm leaves the responder's RNR timer at its longest (see
    /// [`VerbsBackend::set_min_rnr_timer`]); a device that refuses the change keeps it.
    fn short_rnr_timer(&mut self, q: Qpn) {
        if let Err(e) = self.set_min_rnr_timer(q, 12) {
            crate::log::log("omw_verbs::cm", "omw-verbs", crate::log::Level::Warn, &format!("QP {q}: {e}"));
        }
    }

    /// The QP created for an rdma_cm id, if any.
    pub fn qp_of_id(&self, id: CmId) -> Option<Qpn> {
        self.qpns().into_iter().find(|q| self.cm_id_of(*q) == Some(id.0))
    }
}

/// Which local RDMA device routes to `addr` (resolved with a throw-away rdma_cm id).
pub fn route_device(addr: SocketAddr, timeout: Duration) -> Result<String> {
    let mut sa = sockaddr(addr)?;
    let peer = addr.to_string();
    // SAFETY: a private channel and id, both destroyed before returning; events are acked.
    unsafe {
        let ch = rdma_create_event_channel();
        if ch.is_null() {
            return Err(VerbsError::last("rdma_create_event_channel"));
        }
        let mut id: *mut rdma_cm_id = ptr::null_mut();
        if rdma_create_id(ch, &mut id, ptr::null_mut(), rdma_port_space::RDMA_PS_TCP) != 0 {
            let e = VerbsError::last("rdma_create_id");
            rdma_destroy_event_channel(ch);
            return Err(e);
        }
        let ms = timeout.as_millis().clamp(100, 10_000) as i32;
        let mut result =
            Err(VerbsError::PeerUnreachable { addr: peer.clone(), detail: "address resolution failed".into() });
        if rdma_resolve_addr(id, ptr::null_mut(), &mut sa as *mut libc::sockaddr_in as *mut libc::sockaddr, ms) == 0 {
            let mut ev: *mut rdma_cm_event = ptr::null_mut();
            if rdma_get_cm_event(ch, &mut ev) == 0 {
                if (*ev).event == rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED {
                    result = crate::cm_event::id_device(id).ok_or(VerbsError::PeerUnreachable {
                        addr: peer.clone(),
                        detail: "no local RDMA device routes there".into(),
                    });
                } else {
                    result = Err(VerbsError::PeerUnreachable {
                        addr: peer.clone(),
                        detail: format!("address resolution: event {} status {}", (*ev).event, (*ev).status),
                    });
                }
                rdma_ack_cm_event(ev);
            }
        } else {
            result = Err(VerbsError::PeerUnreachable {
                addr: peer,
                detail: format!("rdma_resolve_addr: {}", std::io::Error::last_os_error()),
            });
        }
        rdma_destroy_id(id);
        rdma_destroy_event_channel(ch);
        result
    }
}
