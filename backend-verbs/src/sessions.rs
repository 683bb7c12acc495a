//! A CN arrives as G + 1 rdma_cm connections (Alloc, Free, G − 1 access QPs), each opening with
//! an omw hello that names its role and the CN's session nonce. This is the MN's bookkeeping of
//! them: which connection requests to accept, which connections belong together, when a CN is
//! complete (every connection established), and what to tear down when one goes. Both MN
//! daemons use it — the verbs one (`mn.rs`) and the DEVX one (`devx/mn.rs`) — and neither
//! decides anything else: the CN's QPs go to the core's `MnDriver::connect`.

use crate::cm::{welcome, CmEvent, CmId, Hello, Role};
use omw_core::ids::{CnId, Qpn};
use omw_core::mn::CnQps;
use std::collections::HashMap;
use std::time::Instant;

/// How long a CN may take to open all its connections (it opens them one after another, each
/// within its connect timeout) before its half-open session is dropped.
pub const SESSION_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Default, Debug)]
pub struct Session {
    pub alloc: Option<Qpn>,
    pub free: Option<Qpn>,
    pub access: Vec<Option<Qpn>>,
    established: Vec<Qpn>,
    ids: Vec<CmId>,
    pub cn: Option<CnId>,
    pub opened: Option<Instant>,
}

impl Session {
    /// Every QP accepted for this session.
    pub fn qps(&self) -> impl Iterator<Item = Qpn> + '_ {
        [self.alloc, self.free].into_iter().flatten().chain(self.access.iter().flatten().copied())
    }
}

/// Whether to accept a connection request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Accept with this private data (the welcome on the Alloc connection).
    Accept { hello: Hello, private: Vec<u8> },
    /// Reject; the reason, for the log.
    Reject(String),
}

#[derive(Debug)]
pub struct Sessions {
    group_size: u8,
    max_cns: usize,
    sessions: HashMap<u64, Session>,
    by_id: HashMap<CmId, u64>,
}

impl Sessions {
    pub fn new(group_size: u8, max_cns: usize) -> Self {
        Sessions { group_size, max_cns, sessions: HashMap::new(), by_id: HashMap::new() }
    }

    /// An omw hello, a finite RNR retry count for our sends, a role the group size has, and
    /// room for a new session.
    pub fn admit(&self, ev: &CmEvent) -> Admission {
        let Some(hello) = Hello::decode(&ev.private_data) else {
            return Admission::Reject("a connection without an omw hello".into());
        };
        // The CM request sets how often *our* QP retries a send the CN answers with RNR: 7 is
        // forever. A CN-facing QP must have a finite count (the MN's own step budget and lease
        // bound it anyway; this keeps stuck sends from outliving the CN).
        if ev.rnr_retry_count >= 7 {
            return Admission::Reject(format!(
                "{:?} of session {:#x}: it asked the MN to retry RNR forever (rnr_retry_count 7)",
                hello.role, hello.nonce
            ));
        }
        let ok_role = match hello.role {
            Role::Access(i) => (i as usize) < self.group_size as usize - 1,
            _ => true,
        };
        let full = !self.sessions.contains_key(&hello.nonce) && self.sessions.len() >= self.max_cns;
        if !ok_role || full {
            return Admission::Reject(format!("{:?} of session {:#x}", hello.role, hello.nonce));
        }
        // one connection per role: a second one would replace (and leak) the first QP, so a
        // CN repeating a role could pin MN memory without end
        if let Some(s) = self.sessions.get(&hello.nonce) {
            let taken = match hello.role {
                Role::Alloc => s.alloc.is_some(),
                Role::Free => s.free.is_some(),
                Role::Access(i) => s.access.get(i as usize).is_some_and(|q| q.is_some()),
            };
            if taken || s.cn.is_some() {
                return Admission::Reject(format!(
                    "{:?} of session {:#x}: that connection exists already",
                    hello.role, hello.nonce
                ));
            }
        }
        let private = if hello.role == Role::Alloc { welcome(self.group_size).to_vec() } else { Vec::new() };
        Admission::Accept { hello, private }
    }

    /// Connection `id` of `hello`'s session was accepted with QP `q`.
    pub fn accepted(&mut self, id: CmId, hello: Hello, q: Qpn) {
        let g = self.group_size as usize;
        let s = self.sessions.entry(hello.nonce).or_default();
        s.opened.get_or_insert_with(Instant::now);
        if s.access.len() < g - 1 {
            s.access.resize(g - 1, None);
        }
        match hello.role {
            Role::Alloc => s.alloc = Some(q),
            Role::Free => s.free = Some(q),
            Role::Access(i) => s.access[i as usize] = Some(q),
        }
        s.ids.push(id);
        self.by_id.insert(id, hello.nonce);
    }

    /// Connection `id` (QP `q`) is established. When that completes its session — every
    /// connection established and no CN registered yet — the session's nonce and the CN's
    /// QPs (without loop QPs: the MN adds its own).
    pub fn established(&mut self, id: CmId, q: Qpn) -> Option<(u64, CnQps)> {
        let nonce = *self.by_id.get(&id)?;
        let s = self.sessions.get_mut(&nonce)?;
        if !s.established.contains(&q) {
            s.established.push(q);
        }
        let up = |q: Option<Qpn>| q.is_some_and(|q| s.established.contains(&q));
        let complete = s.cn.is_none() && up(s.alloc) && up(s.free) && s.access.iter().all(|a| up(*a));
        complete.then(|| {
            let qps = CnQps {
                alloc: s.alloc.unwrap_or_default(),
                free: s.free.unwrap_or_default(),
                access: s.access.iter().flatten().copied().collect(),
                alloc_loop: None,
                free_loop: None,
            };
            (nonce, qps)
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
        for id in &s.ids {
            self.by_id.remove(id);
        }
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cm::CmEventKind;

    fn req(id: usize, role: Role, nonce: u64, rnr: u8) -> CmEvent {
        CmEvent {
            kind: CmEventKind::ConnectRequest,
            id: CmId(id as *mut rdma_sys::rdma_cm_id),
            status: 0,
            private_data: Hello { role, nonce }.encode().to_vec(),
            remote_qpn: None,
            rnr_retry_count: rnr,
        }
    }
    fn q(n: u32) -> Qpn {
        Qpn::new(n).unwrap()
    }

    #[test]
    fn a_cn_is_complete_when_all_its_connections_are_established() {
        let mut s = Sessions::new(3, 1);
        let roles = [Role::Alloc, Role::Free, Role::Access(0), Role::Access(1)];
        for (k, r) in roles.iter().enumerate() {
            let ev = req(0x10 + k, *r, 7, 6);
            let Admission::Accept { hello, private } = s.admit(&ev) else { panic!("{r:?} refused") };
            assert_eq!(private.is_empty(), *r != Role::Alloc, "only the Alloc connection carries the welcome");
            s.accepted(ev.id, hello, q(0x100 + k as u32));
        }
        for k in 0..3 {
            assert!(s.established(CmId((0x10 + k) as *mut _), q(0x100 + k as u32)).is_none());
        }
        let (nonce, qps) = s.established(CmId(0x13 as *mut _), q(0x103)).unwrap();
        assert_eq!(
            (nonce, qps.alloc, qps.free, qps.access.as_slice()),
            (7, q(0x100), q(0x101), &[q(0x102), q(0x103)][..])
        );
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
        let ev = req(1, Role::Alloc, 9, 6);
        let Admission::Accept { hello, .. } = s.admit(&ev) else { panic!() };
        s.accepted(ev.id, hello, q(0x10));
        assert!(matches!(s.admit(&req(2, Role::Alloc, 9, 6)), Admission::Reject(r) if r.contains("exists already")));
        assert!(matches!(s.admit(&req(3, Role::Free, 9, 6)), Admission::Accept { .. }));
        let t = s.get(9).unwrap().opened.unwrap();
        let d = std::time::Duration::from_secs(10);
        assert!(s.incomplete_since(t, d).is_empty());
        assert_eq!(s.incomplete_since(t + d, d), vec![9]);
        // a complete one never is
        s.set_cn(9, CnId::new(1).unwrap());
        assert!(s.incomplete_since(t + d, d).is_empty());
        assert!(
            matches!(s.admit(&req(4, Role::Free, 9, 6)), Admission::Reject(_)),
            "no new connection once registered"
        );
    }

    #[test]
    fn requests_are_refused_for_a_reason() {
        let s = Sessions::new(3, 0);
        let mut bad = req(1, Role::Alloc, 1, 6);
        bad.private_data = vec![1, 2, 3];
        assert!(matches!(s.admit(&bad), Admission::Reject(r) if r.contains("hello")));
        assert!(matches!(s.admit(&req(1, Role::Alloc, 1, 7)), Admission::Reject(r) if r.contains("forever")));
        // no room (max 0 CNs); an access index outside the group
        assert!(matches!(s.admit(&req(1, Role::Alloc, 1, 6)), Admission::Reject(_)));
        let s = Sessions::new(3, 4);
        assert!(matches!(s.admit(&req(1, Role::Access(2), 1, 6)), Admission::Reject(_)));
        assert!(matches!(s.admit(&req(1, Role::Access(1), 1, 6)), Admission::Accept { .. }));
    }
}
