//! A CN arrives as G + K rdma_cm connections (an Alloc QP per alloc chain — K of them, at most
//! the MN's `--alloc-chains` —, Free, G − 1 access QPs), each opening with an omw hello that
//! names its role, K and the CN's session nonce. This is the MN's bookkeeping of them: which
//! connection requests to accept, which connections belong together, when a CN is complete
//! (every connection established), and what to tear down when one goes. The MN daemon
//! (`crate::mn`) uses it on every transport and decides nothing else: the CN's QPs go to the
//! core's `MnDriver::connect_with_chains`.
//!
//! A complete session's chain connections (its Alloc QPs and its Free QP) may be *rejoined*: a
//! hello carrying the session's rejoin ticket (`crate::rejoin`) from the session's address
//! reconnects the MN-side QP of that role to a new CN QP, and the CN keeps what it holds.

use crate::admission::{unix_now, Authenticator, CredentialError};
use crate::cm::{welcome, CmEvent, CmId, Hello, HelloError, Refusal, Role};
use crate::rejoin::RejoinKey;
use omw_core::ids::{CnId, Qpn};
use omw_core::mn::tenant::TenantId;
use omw_core::mn::CnQps;
use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::time::Instant;

/// How long a CN may take to open all its connections before its half-open session is
/// dropped. A CN opens its G + 1 connections back to back (each takes milliseconds, well under
/// a second on soft-RoCE under load); a longer patience only lets a peer hold slots longer.
pub const SESSION_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);
/// Half-open sessions one source address may have at once (a host starting two CNs at once
/// is served; one opening sessions it never completes holds at most this many).
pub const HALF_OPEN_PER_SOURCE: usize = 2;
/// Half-open sessions one tenant may have at once, from any address.
pub const HALF_OPEN_PER_TENANT: usize = 2;

#[derive(Default, Debug)]
pub struct Session {
    pub alloc: Option<Qpn>,
    pub free: Option<Qpn>,
    pub access: Vec<Option<Qpn>>,
    /// Alloc chains the CN opens (its hellos' count; 0 until its first connection).
    pub alloc_chains: u8,
    /// The Alloc QPs of its alloc chains beyond the first ([`Role::AllocChain`] j at j − 1).
    pub extra_alloc: Vec<Option<Qpn>>,
    established: Vec<Qpn>,
    /// Its connections and the role each was accepted for.
    ids: Vec<(CmId, Role)>,
    pub cn: Option<CnId>,
    pub opened: Option<Instant>,
    /// The address that opened it: the only one that may join it.
    pub source: Option<IpAddr>,
    /// The tenant it authenticated as (None: an MN running open).
    pub tenant: Option<TenantId>,
}

impl Session {
    /// Every QP accepted for this session.
    pub fn qps(&self) -> impl Iterator<Item = Qpn> + '_ {
        [self.alloc, self.free]
            .into_iter()
            .flatten()
            .chain(self.access.iter().flatten().copied())
            .chain(self.extra_alloc.iter().flatten().copied())
    }
    fn half_open(&self) -> bool {
        self.cn.is_none()
    }
    /// The MN-side QP accepted for `role`.
    pub fn qp_of(&self, role: Role) -> Option<Qpn> {
        match role {
            Role::Alloc => self.alloc,
            Role::Free => self.free,
            Role::Access(i) => self.access.get(i as usize).copied().flatten(),
            Role::AllocChain(j) => self.extra_alloc.get((j as usize).wrapping_sub(1)).copied().flatten(),
        }
    }
}

/// Why a connection request was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// No omw hello in the private data: why not.
    BadHello(HelloError),
    /// The CN asked for more alloc chains than the MN allows (the core's
    /// `MnError::AllocChains`, refused before any QP is set up; the CN gets it as a
    /// [`Refusal`]).
    AllocChains {
        allowed: u8,
        asked: u8,
    },
    /// A join naming another alloc-chain count than the session's first hello did.
    ChainsDiffer {
        nonce: u64,
        session: u8,
        hello: u8,
    },
    /// It asked the MN to retry RNR forever (rnr_retry_count 7).
    RnrForever {
        role: Role,
        nonce: u64,
    },
    /// An access index outside the pool's group.
    BadRole {
        role: Role,
        nonce: u64,
    },
    Credential(CredentialError),
    /// Every CN slot of the MN is taken (complete and half-open sessions).
    Full {
        max: usize,
    },
    /// The tenant has its CN slots taken (complete and half-open sessions).
    TenantSlots {
        tenant: TenantId,
        max: u32,
    },
    HalfOpenPerSource {
        source: Option<IpAddr>,
        max: usize,
    },
    HalfOpenPerTenant {
        tenant: TenantId,
        max: usize,
    },
    /// A join of a session from another address than the one that opened it.
    OtherSource {
        nonce: u64,
        source: Option<IpAddr>,
    },
    /// A join of a session opened by another tenant.
    OtherTenant {
        nonce: u64,
    },
    /// That role of the session is connected already (a second QP would leak the first).
    RoleTaken {
        role: Role,
        nonce: u64,
    },
    /// The session is complete: no new connection joins it.
    Registered {
        nonce: u64,
    },
    /// A rejoin of a session that is not (or not yet) complete: a half-open session's roles
    /// are joined, not rejoined.
    RejoinNoSession {
        nonce: u64,
    },
    /// A rejoin with a ticket that is not the session's.
    RejoinTicket {
        nonce: u64,
    },
    /// A rejoin of a role that is rejoined by no MN (the access QPs: the MN's messages and, in
    /// the paper's layout, windows ride on them), or that the session does not have.
    RejoinRole {
        role: Role,
        nonce: u64,
    },
    /// This MN could draw no key for rejoin tickets: it rejoins nothing.
    RejoinOff {
        nonce: u64,
    },
}

/// What the rejection counters count ([`Sessions::rejections`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rejections {
    /// No, a wrong, stale or replayed credential.
    pub credential: u64,
    /// A limit: CN slots, half-open caps.
    pub limit: u64,
    /// Anything else: no hello, a bad role, a join from elsewhere, a role twice.
    pub session: u64,
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::BadHello(e) => write!(f, "a connection without an omw hello ({e})"),
            Rejection::AllocChains { allowed, asked } => {
                write!(f, "a CN asking for {asked} alloc chains: this MN allows at most {allowed} (--alloc-chains)")
            }
            Rejection::ChainsDiffer { nonce, session, hello } => {
                write!(f, "a join of session {nonce:#x} naming {hello} alloc chain(s), the session {session}")
            }
            Rejection::RnrForever { role, nonce } => {
                write!(f, "{role:?} of session {nonce:#x}: it asked the MN to retry RNR forever (rnr_retry_count 7)")
            }
            Rejection::BadRole { role, nonce } => {
                write!(f, "{role:?} of session {nonce:#x}: no such role in this pool")
            }
            Rejection::Credential(e) => write!(f, "credential: {e}"),
            Rejection::Full { max } => write!(f, "a new session: all {max} CN slots are taken"),
            Rejection::TenantSlots { tenant, max } => {
                write!(f, "a new session: {tenant} has its {max} CN slot(s) taken")
            }
            Rejection::HalfOpenPerSource { source, max } => {
                write!(f, "a new session: {source:?} has {max} half-open session(s) already")
            }
            Rejection::HalfOpenPerTenant { tenant, max } => {
                write!(f, "a new session: {tenant} has {max} half-open session(s) already")
            }
            Rejection::OtherSource { nonce, source } => {
                write!(f, "a join of session {nonce:#x} from {source:?}, not the address that opened it")
            }
            Rejection::OtherTenant { nonce } => write!(f, "a join of session {nonce:#x} as another tenant"),
            Rejection::RoleTaken { role, nonce } => {
                write!(f, "{role:?} of session {nonce:#x}: that connection exists already")
            }
            Rejection::Registered { nonce } => write!(f, "a join of session {nonce:#x}, which is complete"),
            Rejection::RejoinNoSession { nonce } => {
                write!(f, "a rejoin of session {nonce:#x}, which is not a complete session here")
            }
            Rejection::RejoinTicket { nonce } => write!(f, "a rejoin of session {nonce:#x} with a wrong ticket"),
            Rejection::RejoinRole { role, nonce } => {
                write!(f, "a rejoin of {role:?} of session {nonce:#x}: only its Alloc and Free connections rejoin")
            }
            Rejection::RejoinOff { nonce } => {
                write!(f, "a rejoin of session {nonce:#x}: this MN drew no rejoin key (the OS's random source failed)")
            }
        }
    }
}

impl Rejection {
    /// What the CN is told in the reject's private data: only a refusal it can act on (the
    /// rest is for the MN's log).
    pub fn refusal(&self) -> Option<Refusal> {
        match *self {
            Rejection::AllocChains { allowed, asked } => Some(Refusal::AllocChains { allowed, asked }),
            _ => None,
        }
    }
}

/// A CN whose connections are all established ([`Sessions::established`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Complete {
    pub nonce: u64,
    /// Its QPs (without loop QPs: the MN adds its own).
    pub qps: CnQps,
    /// The MN ends of the Alloc QPs of its alloc chains beyond the first, in chain order.
    pub extra_alloc: Vec<Qpn>,
    pub tenant: Option<TenantId>,
}

/// Whether to accept a connection request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Accept with this private data (the welcome on the Alloc connection).
    Accept { hello: Hello, private: Vec<u8>, source: Option<IpAddr> },
    /// Reconnect `qp`, the MN end of `cn`'s `role` connection (its cm id `old`), to the CN QP
    /// of this request, and accept it with this private data (`Sessions::rejoined` after).
    Rejoin { role: Role, cn: CnId, qp: Qpn, old: CmId, private: Vec<u8> },
    /// Reject; the reason, for the log.
    Reject(Rejection),
}

#[derive(Debug)]
pub struct Sessions {
    group_size: u8,
    /// Alloc chains a CN may open (the MN's `MnConfig::alloc_chains`).
    alloc_chains: u8,
    max_cns: usize,
    sessions: HashMap<u64, Session>,
    by_id: HashMap<CmId, u64>,
    /// The tenants' credentials (None: the MN runs open — any hello is admitted).
    auth: Option<Authenticator>,
    /// The key of the sessions' rejoin tickets (None: the OS gave no random key; no rejoins).
    rejoin: Option<RejoinKey>,
    rejected: Rejections,
}

impl Sessions {
    pub fn new(group_size: u8, max_cns: usize) -> Self {
        Sessions {
            group_size,
            alloc_chains: 1,
            max_cns,
            sessions: HashMap::new(),
            by_id: HashMap::new(),
            auth: None,
            rejoin: RejoinKey::random().ok(),
            rejected: Rejections::default(),
        }
    }

    /// Sign rejoin tickets with `key` (tests; `new` draws one from the OS).
    pub fn with_rejoin_key(mut self, key: RejoinKey) -> Self {
        self.rejoin = Some(key);
        self
    }

    /// The welcome of session `nonce`'s Alloc connection: the group size and its rejoin ticket
    /// (0, which no MN verifies, when this MN has no key).
    fn welcome(&self, nonce: u64) -> Vec<u8> {
        welcome(self.group_size, self.rejoin.as_ref().map_or(0, |k| k.ticket(nonce))).to_vec()
    }

    /// Admit CNs with up to `k` alloc chains each (the MN's `MnConfig::alloc_chains`; 1
    /// unless set).
    pub fn with_alloc_chains(mut self, k: u8) -> Self {
        self.alloc_chains = k;
        self
    }

    /// Admit only the authenticator's tenants, each within its CN slots.
    pub fn with_tenants(mut self, auth: Authenticator) -> Self {
        self.auth = Some(auth);
        self
    }

    pub fn rejections(&self) -> Rejections {
        self.rejected
    }

    /// [`Sessions::admit_at`] at the MN's clock.
    pub fn admit(&mut self, ev: &CmEvent) -> Admission {
        self.admit_at(ev, unix_now())
    }

    /// An omw hello, a finite RNR retry count for our sends, a role the group size has, a
    /// credential of a configured tenant (with tenants), and room for a new session — or a
    /// join of a half-open session from its address and tenant. `now`: Unix seconds.
    pub fn admit_at(&mut self, ev: &CmEvent, now: u64) -> Admission {
        let r = self.decide(ev, now);
        if let Err(why) = &r {
            let c = match why {
                Rejection::Credential(_) => &mut self.rejected.credential,
                Rejection::Full { .. }
                | Rejection::TenantSlots { .. }
                | Rejection::HalfOpenPerSource { .. }
                | Rejection::HalfOpenPerTenant { .. }
                | Rejection::AllocChains { .. } => &mut self.rejected.limit,
                _ => &mut self.rejected.session,
            };
            *c += 1;
        }
        match r {
            Ok(a) => a,
            Err(why) => Admission::Reject(why),
        }
    }

    fn decide(&mut self, ev: &CmEvent, now: u64) -> Result<Admission, Rejection> {
        let hello = Hello::decode(&ev.private_data).map_err(Rejection::BadHello)?;
        let (role, nonce) = (hello.role, hello.nonce);
        // The CM request sets how often *our* QP retries a send the CN answers with RNR: 7 is
        // forever. A CN-facing QP must have a finite count (the MN's own step budget and lease
        // bound it anyway; this keeps stuck sends from outliving the CN).
        if ev.rnr_retry_count >= 7 {
            return Err(Rejection::RnrForever { role, nonce });
        }
        if let Some(ticket) = hello.rejoin {
            return self.decide_rejoin(ev, &hello, ticket);
        }
        if let Role::Access(i) = role {
            if i as usize >= self.group_size as usize - 1 {
                return Err(Rejection::BadRole { role, nonce });
            }
        }
        let tenant = match (&mut self.auth, &hello.auth) {
            (None, _) => None,
            (Some(_), None) => return Err(Rejection::Credential(CredentialError::Missing)),
            (Some(a), Some(h)) => {
                a.check(h.tenant, nonce, hello.signed_fields(), h.timestamp, &h.tag, now)
                    .map_err(Rejection::Credential)?;
                Some(h.tenant)
            }
        };
        // the core's check (`MemoryNode::connect_with_chains`), made on the first connection
        // so the CN hears why before it opens the rest
        if hello.alloc_chains > self.alloc_chains {
            return Err(Rejection::AllocChains { allowed: self.alloc_chains, asked: hello.alloc_chains });
        }
        if let Some(s) = self.sessions.get(&nonce) {
            // a join: from the address and as the tenant that opened the session
            if s.source != ev.peer {
                return Err(Rejection::OtherSource { nonce, source: ev.peer });
            }
            if s.tenant != tenant {
                return Err(Rejection::OtherTenant { nonce });
            }
            if s.cn.is_some() {
                return Err(Rejection::Registered { nonce });
            }
            if s.alloc_chains != hello.alloc_chains {
                return Err(Rejection::ChainsDiffer { nonce, session: s.alloc_chains, hello: hello.alloc_chains });
            }
            // one connection per role: a second one would replace (and leak) the first QP, so a
            // CN repeating a role could pin MN memory without end
            let taken = match role {
                Role::Alloc => s.alloc.is_some(),
                Role::Free => s.free.is_some(),
                Role::Access(i) => s.access.get(i as usize).is_some_and(|q| q.is_some()),
                Role::AllocChain(j) => s.extra_alloc.get(j as usize - 1).is_some_and(|q| q.is_some()),
            };
            if taken {
                return Err(Rejection::RoleTaken { role, nonce });
            }
        } else {
            if self.sessions.len() >= self.max_cns {
                return Err(Rejection::Full { max: self.max_cns });
            }
            let half_open_from = self.sessions.values().filter(|s| s.half_open() && s.source == ev.peer).count();
            if half_open_from >= HALF_OPEN_PER_SOURCE {
                return Err(Rejection::HalfOpenPerSource { source: ev.peer, max: HALF_OPEN_PER_SOURCE });
            }
            if let (Some(t), Some(a)) = (tenant, &self.auth) {
                let of_t = || self.sessions.values().filter(move |s| s.tenant == Some(t));
                if of_t().filter(|s| s.half_open()).count() >= HALF_OPEN_PER_TENANT {
                    return Err(Rejection::HalfOpenPerTenant { tenant: t, max: HALF_OPEN_PER_TENANT });
                }
                let max = a.tenant(t).map_or(0, |x| x.max_cns);
                if of_t().count() >= max as usize {
                    return Err(Rejection::TenantSlots { tenant: t, max });
                }
            }
        }
        let private = if role == Role::Alloc { self.welcome(nonce) } else { Vec::new() };
        Ok(Admission::Accept { hello, private, source: ev.peer })
    }

    /// A rejoin: of a complete session, from its address, with its ticket, of a chain
    /// connection it has. The ticket stands in for the credential (a rejoin takes no slot).
    fn decide_rejoin(&self, ev: &CmEvent, hello: &Hello, ticket: u64) -> Result<Admission, Rejection> {
        let (role, nonce) = (hello.role, hello.nonce);
        let key = self.rejoin.as_ref().ok_or(Rejection::RejoinOff { nonce })?;
        let s = self.sessions.get(&nonce).ok_or(Rejection::RejoinNoSession { nonce })?;
        // the ticket first: a peer without it learns nothing about the session
        if !key.verify(nonce, ticket) {
            return Err(Rejection::RejoinTicket { nonce });
        }
        if s.source != ev.peer {
            return Err(Rejection::OtherSource { nonce, source: ev.peer });
        }
        let cn = s.cn.ok_or(Rejection::RejoinNoSession { nonce })?;
        if s.alloc_chains != hello.alloc_chains {
            return Err(Rejection::ChainsDiffer { nonce, session: s.alloc_chains, hello: hello.alloc_chains });
        }
        let chain_role = matches!(role, Role::Alloc | Role::AllocChain(_) | Role::Free);
        let qp = s.qp_of(role).filter(|_| chain_role).ok_or(Rejection::RejoinRole { role, nonce })?;
        let old =
            s.ids.iter().find(|(_, r)| *r == role).map(|(i, _)| *i).ok_or(Rejection::RejoinRole { role, nonce })?;
        let private = if role == Role::Alloc { self.welcome(nonce) } else { Vec::new() };
        Ok(Admission::Rejoin { role, cn, qp, old, private })
    }

    /// The rejoin of connection `old` was accepted as `new`: `new` is that role's connection
    /// now, and `old` (which the transport ends) no longer belongs to the session — its
    /// disconnect is not the CN's departure.
    pub fn rejoined(&mut self, old: CmId, new: CmId) {
        let Some(nonce) = self.by_id.remove(&old) else { return };
        if let Some(s) = self.sessions.get_mut(&nonce) {
            for (id, _) in s.ids.iter_mut().filter(|(id, _)| *id == old) {
                *id = new;
            }
        }
        self.by_id.insert(new, nonce);
    }

    /// Connection `id` of `hello`'s session, from `source`, was accepted with QP `q`.
    pub fn accepted(&mut self, id: CmId, hello: Hello, source: Option<IpAddr>, q: Qpn) {
        let g = self.group_size as usize;
        let tenant = if self.auth.is_some() { hello.auth.map(|a| a.tenant) } else { None };
        let s = self.sessions.entry(hello.nonce).or_insert_with(|| Session {
            source,
            tenant,
            alloc_chains: hello.alloc_chains,
            extra_alloc: vec![None; hello.alloc_chains.saturating_sub(1) as usize],
            ..Session::default()
        });
        s.opened.get_or_insert_with(Instant::now);
        if s.access.len() < g - 1 {
            s.access.resize(g - 1, None);
        }
        // admitted: the role fits the group and the session's chain count (`decide`)
        match hello.role {
            Role::Alloc => s.alloc = Some(q),
            Role::Free => s.free = Some(q),
            Role::Access(i) => s.access[i as usize] = Some(q),
            Role::AllocChain(j) => s.extra_alloc[j as usize - 1] = Some(q),
        }
        s.ids.push((id, hello.role));
        self.by_id.insert(id, hello.nonce);
    }

    /// Connection `id` (QP `q`) is established. When that completes its session — every
    /// connection established and no CN registered yet — the CN.
    pub fn established(&mut self, id: CmId, q: Qpn) -> Option<Complete> {
        let nonce = *self.by_id.get(&id)?;
        let s = self.sessions.get_mut(&nonce)?;
        if !s.established.contains(&q) {
            s.established.push(q);
        }
        let up = |q: Option<Qpn>| q.is_some_and(|q| s.established.contains(&q));
        let complete = s.cn.is_none()
            && up(s.alloc)
            && up(s.free)
            && s.access.iter().all(|a| up(*a))
            && s.extra_alloc.iter().all(|a| up(*a));
        complete.then(|| {
            let qps = CnQps {
                alloc: s.alloc.unwrap_or_default(),
                free: s.free.unwrap_or_default(),
                access: s.access.iter().flatten().copied().collect(),
                alloc_loop: None,
                free_loop: None,
            };
            Complete { nonce, qps, extra_alloc: s.extra_alloc.iter().flatten().copied().collect(), tenant: s.tenant }
        })
    }

    /// Sessions still incomplete `patience` after their first connection: a CN that opened
    /// some of its connections and never the rest holds a CN slot (and QPs) until dropped.
    pub fn incomplete_since(&self, now: Instant, patience: std::time::Duration) -> Vec<u64> {
        self.sessions
            .iter()
            .filter(|(_, s)| s.cn.is_none() && s.opened.is_some_and(|t| now.duration_since(t) >= patience))
            .map(|(n, _)| *n)
            .collect()
    }

    pub fn set_cn(&mut self, nonce: u64, cn: CnId) {
        if let Some(s) = self.sessions.get_mut(&nonce) {
            s.cn = Some(cn);
        }
    }
    pub fn nonce_of(&self, id: CmId) -> Option<u64> {
        self.by_id.get(&id).copied()
    }
    pub fn nonce_of_cn(&self, cn: CnId) -> Option<u64> {
        self.sessions.iter().find(|(_, s)| s.cn == Some(cn)).map(|(n, _)| *n)
    }
    pub fn get(&self, nonce: u64) -> Option<&Session> {
        self.sessions.get(&nonce)
    }
    /// Forget a session and its connections; the caller destroys its QPs.
    pub fn remove(&mut self, nonce: u64) -> Option<Session> {
        let s = self.sessions.remove(&nonce)?;
        for (id, _) in &s.ids {
            self.by_id.remove(id);
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{parse_tenants, Credential};
    use crate::cm::CmEventKind;

    const HOST: [u8; 4] = [192, 0, 2, 2];
    const NOW: u64 = 1_800_000_000;

    fn ev(id: usize, hello: Hello, rnr: u8, peer: [u8; 4]) -> CmEvent {
        CmEvent {
            kind: CmEventKind::ConnectRequest,
            id: CmId(id as *mut rdma_sys::rdma_cm_id),
            status: 0,
            private_data: hello.encode(),
            remote_qpn: None,
            rnr_retry_count: rnr,
            peer: Some(IpAddr::from(peer)),
        }
    }
    fn req(id: usize, role: Role, nonce: u64, rnr: u8) -> CmEvent {
        ev(id, Hello::new(role, nonce), rnr, HOST)
    }
    fn q(n: u32) -> Qpn {
        Qpn::new(n).unwrap()
    }
    /// Admit and accept (QP id + 0x100); the rejection otherwise.
    fn open(s: &mut Sessions, e: &CmEvent) -> Result<(), Rejection> {
        match s.admit_at(e, NOW) {
            Admission::Accept { hello, source, .. } => {
                s.accepted(e.id, hello, source, q(0x100 + e.id.0 as u32));
                Ok(())
            }
            Admission::Reject(r) => Err(r),
            a @ Admission::Rejoin { .. } => panic!("a plain hello admitted as a rejoin: {a:?}"),
        }
    }

    /// Session `nonce` of `s` (G = 3) complete as CN 1 from HOST: Alloc (id 0x10, QP 0x110),
    /// Free (0x11), two access QPs; each hello signed with `cred` if given.
    fn complete_in(mut s: Sessions, nonce: u64, cred: Option<&Credential>) -> Sessions {
        for (k, r) in [Role::Alloc, Role::Free, Role::Access(0), Role::Access(1)].into_iter().enumerate() {
            let hello = match cred {
                Some(c) => Hello::signed(r, nonce, c, NOW),
                None => Hello::new(r, nonce),
            };
            let e = ev(0x10 + k, hello, 6, HOST);
            let Admission::Accept { hello, source, .. } = s.admit_at(&e, NOW) else { panic!("{r:?} refused") };
            s.accepted(e.id, hello, source, q(0x110 + k as u32));
            s.established(e.id, q(0x110 + k as u32));
        }
        s.set_cn(nonce, CnId::new(1).unwrap());
        s
    }
    fn complete(nonce: u64, key: RejoinKey) -> Sessions {
        complete_in(Sessions::new(3, 4).with_rejoin_key(key), nonce, None)
    }

    #[test]
    fn a_complete_sessions_chain_connection_rejoins_with_its_ticket_only() {
        let key = RejoinKey::from_bytes([3; 32]);
        let mut s = complete(0x51, key.clone());
        let ticket = key.ticket(0x51);
        // the welcome carried the ticket
        let w = Sessions::new(3, 4).with_rejoin_key(key.clone()).welcome(0x51);
        assert_eq!(crate::cm::parse_rejoin_ticket(&w), Some(ticket));
        let rejoin = |id: usize, role: Role, t: u64, peer: [u8; 4]| ev(id, Hello::rejoin(role, 1, 0x51, t), 6, peer);
        // the Alloc connection: its QP, its old id, the welcome again
        match s.admit_at(&rejoin(0x20, Role::Alloc, ticket, HOST), NOW) {
            Admission::Rejoin { role, cn, qp, old, private } => {
                assert_eq!((role, cn, qp, old), (Role::Alloc, CnId::new(1).unwrap(), q(0x110), CmId(0x10 as *mut _)));
                assert_eq!(private, w);
            }
            a => panic!("{a:?}"),
        }
        assert!(matches!(s.admit_at(&rejoin(0x21, Role::Free, ticket, HOST), NOW),
            Admission::Rejoin { qp, private, .. } if qp == q(0x111) && private.is_empty()));
        // a wrong ticket, another address, an access QP, a chain it does not have, another count
        let no = |s: &mut Sessions, e: CmEvent| match s.admit_at(&e, NOW) {
            Admission::Reject(r) => r,
            a => panic!("admitted {a:?}"),
        };
        assert_eq!(no(&mut s, rejoin(0x22, Role::Alloc, ticket ^ 1, HOST)), Rejection::RejoinTicket { nonce: 0x51 });
        assert!(matches!(no(&mut s, rejoin(0x22, Role::Alloc, ticket, [192, 0, 2, 9])), Rejection::OtherSource { .. }));
        assert_eq!(
            no(&mut s, rejoin(0x22, Role::Access(0), ticket, HOST)),
            Rejection::RejoinRole { role: Role::Access(0), nonce: 0x51 }
        );
        let two = ev(0x22, Hello::rejoin(Role::AllocChain(1), 2, 0x51, ticket), 6, HOST);
        assert!(matches!(no(&mut s, two), Rejection::ChainsDiffer { .. }));
        // another session's ticket, an unknown session
        let other = ev(0x22, Hello::rejoin(Role::Alloc, 1, 0x52, ticket), 6, HOST);
        assert_eq!(no(&mut s, other), Rejection::RejoinNoSession { nonce: 0x52 });
        // accepted: the new id is the role's connection; the old one's end is no departure
        s.rejoined(CmId(0x10 as *mut _), CmId(0x20 as *mut _));
        assert_eq!(s.nonce_of(CmId(0x10 as *mut _)), None);
        assert_eq!(s.nonce_of(CmId(0x20 as *mut _)), Some(0x51));
        // an ESTABLISHED of the rejoined connection completes nothing again
        assert!(s.established(CmId(0x20 as *mut _), q(0x110)).is_none());
        // and it rejoins again under the same ticket (the connection it replaces is the new one)
        assert!(matches!(s.admit_at(&rejoin(0x23, Role::Alloc, ticket, HOST), NOW),
            Admission::Rejoin { old, .. } if old == CmId(0x20 as *mut _)));
        assert_eq!(s.remove(0x51).unwrap().qps().count(), 4);
        assert_eq!(s.nonce_of(CmId(0x20 as *mut _)), None, "removing the session forgets the new id");
    }

    #[test]
    fn a_half_open_session_is_not_rejoined_and_a_rejoin_needs_no_credential() {
        let key = RejoinKey::from_bytes([4; 32]);
        let mut s = Sessions::new(3, 4).with_rejoin_key(key.clone());
        open(&mut s, &req(1, Role::Alloc, 0x61, 6)).unwrap();
        let e = ev(2, Hello::rejoin(Role::Alloc, 1, 0x61, key.ticket(0x61)), 6, HOST);
        assert!(matches!(s.admit_at(&e, NOW), Admission::Reject(Rejection::RejoinNoSession { nonce: 0x61 })));
        // a tenant's complete session rejoins without signing: the ticket is the session's
        let (t, a, _) = tenants();
        let mut s = complete_in(t.with_rejoin_key(key.clone()), 0x62, Some(&a));
        let e = ev(3, Hello::rejoin(Role::Alloc, 1, 0x62, key.ticket(0x62)), 6, HOST);
        assert!(matches!(s.admit_at(&e, NOW), Admission::Rejoin { .. }));
        // an MN without a key rejoins nothing
        let mut s = complete(0x63, key.clone());
        s.rejoin = None;
        let e = ev(4, Hello::rejoin(Role::Alloc, 1, 0x63, key.ticket(0x63)), 6, HOST);
        assert!(matches!(s.admit_at(&e, NOW), Admission::Reject(Rejection::RejoinOff { nonce: 0x63 })));
    }

    #[test]
    fn a_cn_is_complete_when_all_its_connections_are_established() {
        let mut s = Sessions::new(3, 1);
        let roles = [Role::Alloc, Role::Free, Role::Access(0), Role::Access(1)];
        for (k, r) in roles.iter().enumerate() {
            let ev = req(0x10 + k, *r, 7, 6);
            let Admission::Accept { hello, private, source } = s.admit_at(&ev, NOW) else { panic!("{r:?} refused") };
            assert_eq!(private.is_empty(), *r != Role::Alloc, "only the Alloc connection carries the welcome");
            s.accepted(ev.id, hello, source, q(0x100 + k as u32));
        }
        for k in 0..3 {
            assert!(s.established(CmId((0x10 + k) as *mut _), q(0x100 + k as u32)).is_none());
        }
        let Complete { nonce, qps, extra_alloc, tenant } = s.established(CmId(0x13 as *mut _), q(0x103)).unwrap();
        assert_eq!(
            (nonce, qps.alloc, qps.free, qps.access.as_slice(), tenant),
            (7, q(0x100), q(0x101), &[q(0x102), q(0x103)][..], None)
        );
        assert!(extra_alloc.is_empty());
        s.set_cn(7, CnId::new(1).unwrap());
        // registered: a repeated ESTABLISHED does not complete it again
        assert!(s.established(CmId(0x13 as *mut _), q(0x103)).is_none());
        assert_eq!(s.nonce_of_cn(CnId::new(1).unwrap()), Some(7));
        assert_eq!(s.remove(7).unwrap().qps().count(), 4);
        assert!(s.nonce_of(CmId(0x10 as *mut _)).is_none());
    }

    #[test]
    fn a_role_is_accepted_once_and_a_half_open_session_goes_stale() {
        let mut s = Sessions::new(3, 4);
        open(&mut s, &req(1, Role::Alloc, 9, 6)).unwrap();
        assert_eq!(open(&mut s, &req(2, Role::Alloc, 9, 6)), Err(Rejection::RoleTaken { role: Role::Alloc, nonce: 9 }));
        assert!(matches!(s.admit_at(&req(3, Role::Free, 9, 6), NOW), Admission::Accept { .. }));
        let t = s.get(9).unwrap().opened.unwrap();
        assert!(s.incomplete_since(t, SESSION_PATIENCE - std::time::Duration::from_millis(1)).is_empty());
        assert_eq!(s.incomplete_since(t + SESSION_PATIENCE, SESSION_PATIENCE), vec![9]);
        // a complete one never is
        s.set_cn(9, CnId::new(1).unwrap());
        assert!(s.incomplete_since(t + SESSION_PATIENCE, SESSION_PATIENCE).is_empty());
        assert_eq!(open(&mut s, &req(4, Role::Free, 9, 6)), Err(Rejection::Registered { nonce: 9 }));
    }

    #[test]
    fn requests_are_refused_for_a_reason() {
        let mut s = Sessions::new(3, 0);
        let mut bad = req(1, Role::Alloc, 1, 6);
        bad.private_data = vec![1, 2, 3];
        assert_eq!(open(&mut s, &bad), Err(Rejection::BadHello(HelloError::TooShort { len: 3, need: 16 })));
        assert!(matches!(open(&mut s, &req(1, Role::Alloc, 1, 7)), Err(Rejection::RnrForever { .. })));
        // no room (max 0 CNs); an access index outside the group
        assert_eq!(open(&mut s, &req(1, Role::Alloc, 1, 6)), Err(Rejection::Full { max: 0 }));
        let mut s = Sessions::new(3, 4);
        assert!(matches!(open(&mut s, &req(1, Role::Access(2), 1, 6)), Err(Rejection::BadRole { .. })));
        assert!(matches!(s.admit_at(&req(1, Role::Access(1), 1, 6), NOW), Admission::Accept { .. }));
        assert_eq!(s.rejections(), Rejections { credential: 0, limit: 0, session: 1 });
    }

    /// The issue-20 lock-out: one peer opening sessions it never completes. It holds at most
    /// HALF_OPEN_PER_SOURCE of them; an honest CN elsewhere still gets a slot.
    #[test]
    fn half_open_sessions_are_capped_per_source_and_joined_only_from_their_source() {
        let mut s = Sessions::new(3, 16);
        for n in 0..HALF_OPEN_PER_SOURCE as u64 {
            open(&mut s, &req(10 + n as usize, Role::Alloc, 100 + n, 6)).unwrap();
        }
        assert!(matches!(
            open(&mut s, &req(20, Role::Alloc, 200, 6)),
            Err(Rejection::HalfOpenPerSource { max: 2, .. })
        ));
        // a join of the attacker's session from another host is refused, whatever the nonce
        let other = [192, 0, 2, 3];
        let join = ev(21, Hello::new(Role::Free, 100), 6, other);
        assert!(matches!(open(&mut s, &join), Err(Rejection::OtherSource { nonce: 100, .. })));
        // an honest CN on another host opens its session
        open(&mut s, &ev(22, Hello::new(Role::Alloc, 300), 6, other)).unwrap();
        // completing a session frees a half-open place of its source
        s.set_cn(100, CnId::new(1).unwrap());
        open(&mut s, &req(23, Role::Alloc, 400, 6)).unwrap();
        assert_eq!(s.rejections().limit, 1);
    }

    fn tenants() -> (Sessions, Credential, Credential) {
        let text = "alice secret=00112233445566778899aabbccddeeff quota=16K cns=1\n\
                    mallory secret=ffeeddccbbaa99887766554433221100 quota=16K cns=3\n";
        let t = parse_tenants(text, 4096).unwrap();
        let (a, m) = (t[0].credential.clone(), t[1].credential.clone());
        (Sessions::new(3, 16).with_tenants(Authenticator::new(t)), a, m)
    }
    fn signed(id: usize, role: Role, nonce: u64, c: &Credential, peer: [u8; 4]) -> CmEvent {
        ev(id, Hello::signed(role, nonce, c, NOW), 6, peer)
    }

    #[test]
    fn with_tenants_only_a_valid_fresh_credential_is_admitted() {
        let (mut s, alice, _) = tenants();
        assert_eq!(open(&mut s, &req(1, Role::Alloc, 1, 6)), Err(Rejection::Credential(CredentialError::Missing)));
        let wrong = Credential::new("alice", vec![9; 16]).unwrap();
        assert_eq!(
            open(&mut s, &signed(2, Role::Alloc, 2, &wrong, HOST)),
            Err(Rejection::Credential(CredentialError::BadTag(alice.id)))
        );
        let good = signed(3, Role::Alloc, 3, &alice, HOST);
        open(&mut s, &good).unwrap();
        // the captured hello, replayed from the same or another host
        let mut again = good.clone();
        again.id = CmId(0x40 as *mut rdma_sys::rdma_cm_id);
        assert_eq!(open(&mut s, &again), Err(Rejection::Credential(CredentialError::Replayed(alice.id))));
        again.peer = Some(IpAddr::from([192, 0, 2, 9]));
        assert_eq!(open(&mut s, &again), Err(Rejection::Credential(CredentialError::Replayed(alice.id))));
        let stale = ev(5, Hello::signed(Role::Alloc, 5, &alice, NOW - 3600), 6, HOST);
        assert!(matches!(open(&mut s, &stale), Err(Rejection::Credential(CredentialError::Stale { .. }))));
        // the session's other roles, signed: joined
        open(&mut s, &signed(6, Role::Free, 3, &alice, HOST)).unwrap();
        assert_eq!(s.get(3).unwrap().tenant, Some(alice.id));
        assert_eq!(s.rejections().credential, 5);
    }

    /// Sybil: more sessions of one tenant gain nothing — its CN slots count all of them, and its
    /// half-open sessions are capped across every address it uses.
    #[test]
    fn a_tenants_sessions_are_limited_across_addresses() {
        let (mut s, alice, mallory) = tenants();
        for n in 0..HALF_OPEN_PER_TENANT {
            open(&mut s, &signed(10 + n, Role::Alloc, 10 + n as u64, &mallory, [10, 0, 0, n as u8])).unwrap();
        }
        assert!(matches!(
            open(&mut s, &signed(20, Role::Alloc, 20, &mallory, [10, 0, 1, 0])),
            Err(Rejection::HalfOpenPerTenant { max: 2, .. })
        ));
        // complete both; the third slot is its last
        s.set_cn(10, CnId::new(1).unwrap());
        s.set_cn(11, CnId::new(2).unwrap());
        open(&mut s, &signed(21, Role::Alloc, 21, &mallory, [10, 0, 2, 0])).unwrap();
        s.set_cn(21, CnId::new(3).unwrap());
        assert!(matches!(
            open(&mut s, &signed(22, Role::Alloc, 22, &mallory, [10, 0, 3, 0])),
            Err(Rejection::TenantSlots { max: 3, .. })
        ));
        // a session of one tenant is not joined as another
        assert_eq!(
            open(&mut s, &signed(23, Role::Free, 21, &alice, [10, 0, 2, 0])),
            Err(Rejection::OtherTenant { nonce: 21 })
        );
        // alice is unaffected
        open(&mut s, &signed(24, Role::Alloc, 24, &alice, HOST)).unwrap();
        let Complete { tenant: t, .. } = {
            for (k, r) in [Role::Free, Role::Access(0), Role::Access(1)].iter().enumerate() {
                open(&mut s, &signed(30 + k, *r, 24, &alice, HOST)).unwrap();
            }
            for id in [24usize, 30, 31] {
                assert!(s.established(CmId(id as *mut _), q(0x100 + id as u32)).is_none());
            }
            s.established(CmId(32 as *mut _), q(0x100 + 32)).unwrap()
        };
        assert_eq!(t, Some(alice.id));
    }

    fn chains_req(id: usize, role: Role, chains: u8, nonce: u64) -> CmEvent {
        ev(id, Hello { role, alloc_chains: chains, nonce, auth: None, rejoin: None }, 6, HOST)
    }

    /// A CN with K alloc chains is complete once its K Alloc QPs are up too; the extra ones
    /// come out in chain order, whatever order they connected in.
    #[test]
    fn a_cn_with_several_alloc_chains_is_complete_with_all_its_alloc_qps() {
        let mut s = Sessions::new(2, 4).with_alloc_chains(3);
        let roles = [Role::Alloc, Role::Free, Role::Access(0), Role::AllocChain(2), Role::AllocChain(1)];
        for (k, r) in roles.iter().enumerate() {
            open(&mut s, &chains_req(0x10 + k, *r, 3, 7)).unwrap();
        }
        // a chain's Alloc QP twice, or one past the count
        assert_eq!(
            open(&mut s, &chains_req(0x20, Role::AllocChain(1), 3, 7)),
            Err(Rejection::RoleTaken { role: Role::AllocChain(1), nonce: 7 })
        );
        assert_eq!(
            open(&mut s, &chains_req(0x21, Role::Free, 2, 7)),
            Err(Rejection::ChainsDiffer { nonce: 7, session: 3, hello: 2 })
        );
        for k in 0..4 {
            assert!(s.established(CmId((0x10 + k) as *mut _), q(0x110 + k as u32)).is_none());
        }
        let c = s.established(CmId(0x14 as *mut _), q(0x114)).unwrap();
        assert_eq!(c.extra_alloc, vec![q(0x114), q(0x113)], "chain 1's QP, then chain 2's");
        assert_eq!(s.get(7).unwrap().qps().count(), 5);
    }

    /// More chains than the MN allows: refused on the first connection, with the refusal the
    /// CN reads; nothing of the session is kept.
    #[test]
    fn more_alloc_chains_than_allowed_are_refused_with_a_reason() {
        let mut s = Sessions::new(3, 4).with_alloc_chains(2);
        let r = open(&mut s, &chains_req(1, Role::Alloc, 3, 9));
        assert_eq!(r, Err(Rejection::AllocChains { allowed: 2, asked: 3 }));
        assert_eq!(r.unwrap_err().refusal(), Some(Refusal::AllocChains { allowed: 2, asked: 3 }));
        assert!(s.get(9).is_none());
        assert_eq!(s.rejections().limit, 1);
        // the other reasons stay the MN's
        assert_eq!(Rejection::Full { max: 1 }.refusal(), None);
        // a hello of an MN-allowed count is admitted; one chain is every MN's floor
        open(&mut s, &chains_req(2, Role::Alloc, 2, 10)).unwrap();
        let mut one = Sessions::new(3, 4);
        assert!(matches!(open(&mut one, &chains_req(3, Role::Alloc, 2, 11)), Err(Rejection::AllocChains { .. })));
    }
}
