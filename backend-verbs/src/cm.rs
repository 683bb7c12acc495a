//! RC connections through rdma_cm: the MN listens on IP:port, CNs connect.
//!
//! Each CN opens one Alloc QP, one Free QP and G−1 access QPs. Every connect request carries a
//! [`Hello`] in its private data (role, access index, the CN's session nonce) so the MN can
//! group a CN's connections; the MN's accept of the Alloc connection answers with the pool's
//! group size, which tells the CN how many access QPs to open.

use crate::backend::VerbsBackend;
use crate::cm_event::{reject_raw, sockaddr};
pub use crate::cm_event::{CmEvent, CmEventKind, CmId};
use crate::error::{Result, VerbsError};
use omw_core::ids::Qpn;
use rdma_sys::*;
use std::net::SocketAddr;
use std::ptr;
use std::time::{Duration, Instant};

pub const HELLO_MAGIC: u32 = 0x434D_574F; // "OWMC"
/// A hello without a credential (an MN running open).
pub const HELLO_LEN: usize = 16;
/// A hello with a credential: tenant u32, timestamp u64 (Unix seconds), tag (20 bytes) after
/// the 16 bytes of the plain one — 48 of rdma_cm RC's 56 bytes of private data.
pub const AUTH_HELLO_LEN: usize = HELLO_LEN + 4 + 8 + crate::admission::TAG_LEN;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum Role {
    Alloc,
    Free,
    Access(u8),
}

impl Role {
    /// The role as the hello encodes (and the credential tags) it: kind, access index.
    pub fn wire(self) -> [u8; 2] {
        match self {
            Role::Alloc => [0, 0],
            Role::Free => [1, 0],
            Role::Access(i) => [2, i],
        }
    }
}

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
    pub nonce: u64,
    pub auth: Option<HelloAuth>,
}

impl Hello {
    /// A hello signed with `cred` at Unix time `timestamp`.
    pub fn signed(role: Role, nonce: u64, cred: &crate::admission::Credential, timestamp: u64) -> Hello {
        let tag = cred.tag(nonce, role.wire(), timestamp);
        Hello { role, nonce, auth: Some(HelloAuth { tenant: cred.id, timestamp, tag }) }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; if self.auth.is_some() { AUTH_HELLO_LEN } else { HELLO_LEN }];
        b[..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[4] = if self.auth.is_some() { 2 } else { 1 };
        b[5..7].copy_from_slice(&self.role.wire());
        b[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        if let Some(a) = &self.auth {
            b[16..20].copy_from_slice(&a.tenant.0.to_le_bytes());
            b[20..28].copy_from_slice(&a.timestamp.to_le_bytes());
            b[28..].copy_from_slice(&a.tag);
        }
        b
    }
    pub fn decode(b: &[u8]) -> Option<Hello> {
        if b.len() < HELLO_LEN || b[..4] != HELLO_MAGIC.to_le_bytes() {
            return None;
        }
        let role = match b[5] {
            0 => Role::Alloc,
            1 => Role::Free,
            2 => Role::Access(b[6]),
            _ => return None,
        };
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let auth = match b[4] {
            1 => None,
            2 if b.len() >= AUTH_HELLO_LEN => {
                let mut tag = [0u8; crate::admission::TAG_LEN];
                tag.copy_from_slice(&b[28..AUTH_HELLO_LEN]);
                let tenant = omw_core::mn::tenant::TenantId(u32::from_le_bytes([b[16], b[17], b[18], b[19]]));
                Some(HelloAuth { tenant, timestamp: u64_at(20), tag })
            }
            _ => return None,
        };
        Some(Hello { role, nonce: u64_at(8), auth })
    }
}

/// MN → CN private data of the Alloc connection's accept: the pool's group size.
pub fn welcome(group_size: u8) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4] = 1;
    b[5] = group_size;
    b
}
pub fn parse_welcome(b: &[u8]) -> Option<u8> {
    (b.len() >= 8 && b[..4] == HELLO_MAGIC.to_le_bytes() && b[4] == 1).then_some(b[5])
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
    fn hellos_round_trip_and_fit_rdma_cm() {
        let cred = crate::admission::Credential::new("alice", vec![7; 16]).unwrap();
        for h in
            [Hello { role: Role::Access(1), nonce: 0xdead_beef, auth: None }, Hello::signed(Role::Free, 9, &cred, 1234)]
        {
            let b = h.encode();
            assert!(b.len() <= 56);
            assert_eq!(Hello::decode(&b), Some(h));
        }
        let b = Hello::signed(Role::Alloc, 9, &cred, 1234).encode();
        assert_eq!(Hello::decode(&b[..HELLO_LEN + 4]), None, "a cut credential is no hello");
        assert_eq!(Hello::decode(&[0; 16]), None);
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

    /// MN side: refuse a pending connection request (ignored if `id` is not one).
    pub fn reject(&mut self, id: CmId) {
        self.cm.reject(id)
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
