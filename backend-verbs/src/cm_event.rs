//! What the backend keeps of rdma_cm: copies of events (its backlog of other ids' events) and id
//! handles, and the one rdma_cm call its teardown makes. Apart from cm.rs, which extends the
//! backend with the connection set-up, so that backend.rs does not depend on cm.rs
//! (scripts/import-cycles).

use crate::error::{Result, VerbsError};
use omw_core::ids::Qpn;
use rdma_sys::*;
use std::collections::VecDeque;
use std::net::{SocketAddr, SocketAddrV4};
use std::ptr;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CmEventKind {
    AddrResolved,
    RouteResolved,
    ConnectRequest,
    Established,
    Disconnected,
    Rejected,
    Error(u32),
    Other(u32),
}

/// The rdma_cm id an event is about: a handle, compared by identity. Only the backend turns
/// it back into a pointer, and only while it knows the id to be live (a connection request
/// not yet accepted or rejected, or the id of one of its QPs).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct CmId(pub(crate) *mut rdma_cm_id);

/// An rdma_cm event, copied out and already acknowledged.
#[derive(Clone, Debug)]
pub struct CmEvent {
    pub kind: CmEventKind,
    pub id: CmId,
    pub status: i32,
    pub private_data: Vec<u8>,
    /// The remote QP number rdma_cm negotiated (`param.conn.qp_num`): the requester's QP on a
    /// connect request, the responder's on the active side's ESTABLISHED; None otherwise.
    pub remote_qpn: Option<Qpn>,
    /// On a connect request: the RNR retry count the requester asked the *responder* (us) to use
    /// for its sends to it (the CM REQ field; the passive side's QP takes it as `rnr_retry`).
    /// 7 means "retry forever".
    pub rnr_retry_count: u8,
    /// On a connect request: the requester's IP address (a session is joined only from the
    /// address that opened it).
    pub peer: Option<std::net::IpAddr>,
}

/// Reject and destroy a connection request id that was taken out of the pending table.
pub(crate) fn reject_raw(id: *mut rdma_cm_id) {
    reject_raw_with(id, &[])
}

/// [`reject_raw`] with `private` as the reject's private data (at most the IB CM REJ's 148
/// bytes; longer is cut).
pub(crate) fn reject_raw_with(id: *mut rdma_cm_id, private: &[u8]) {
    let len = private.len().min(148) as u8;
    let data = if len == 0 { ptr::null() } else { private.as_ptr() as *const libc::c_void };
    // SAFETY: id is a live connection-request id owned by the caller (taken out of the
    // backend's pending table, so nothing else uses or destroys it); `private` outlives the
    // call, which copies it.
    unsafe {
        rdma_reject(id, data, len);
        rdma_destroy_id(id);
    }
}

/// The name of the device an id is bound or resolved to (None: no RDMA device yet).
pub(crate) fn id_device(id: *mut rdma_cm_id) -> Option<String> {
    // SAFETY: id is live; verbs/device are set once the address is bound or resolved.
    unsafe {
        let v = (*id).verbs;
        if v.is_null() || (*v).device.is_null() {
            return None;
        }
        let p = ibv_get_device_name((*v).device);
        (!p.is_null()).then(|| std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned())
    }
}

/// The peer address of a connect request's id (IPv4, or IPv6 for an IPv4-mapped peer).
fn peer_ip(id: &rdma_cm_id) -> Option<std::net::IpAddr> {
    // SAFETY: a connect request's id has its route's destination address set; the sockaddr is
    // read by family, within the union's storage.
    unsafe {
        let sa = rdma_get_peer_addr(id) as *const libc::sockaddr;
        match (*sa).sa_family as i32 {
            libc::AF_INET => {
                let v4 = &*(sa as *const libc::sockaddr_in);
                Some(std::net::IpAddr::from(u32::from_be(v4.sin_addr.s_addr).to_be_bytes()))
            }
            libc::AF_INET6 => {
                let v6 = &*(sa as *const libc::sockaddr_in6);
                Some(std::net::IpAddr::from(v6.sin6_addr.s6_addr))
            }
            _ => None,
        }
    }
}

pub(crate) fn sockaddr(addr: SocketAddr) -> Result<libc::sockaddr_in> {
    let v4: SocketAddrV4 = match addr {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(_) => return Err(VerbsError::Config("only IPv4 addresses are supported".into())),
    };
    // SAFETY: sockaddr_in is plain data.
    let mut s: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    s.sin_family = libc::AF_INET as u16;
    s.sin_port = v4.port().to_be();
    s.sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
    Ok(s)
}

/// One rdma_cm event channel and the ids on it: the ids this side created and still owns, the
/// connection requests not yet accepted or rejected, and events read while waiting for
/// another id's (handed out by [`CmChannel::poll`] first, in order). The verbs backend holds
/// one; the DEVX MN holds its own (its QPs are not rdma_cm's).
#[derive(Debug)]
pub struct CmChannel {
    channel: *mut rdma_event_channel,
    ids: Vec<*mut rdma_cm_id>,
    requests: Vec<*mut rdma_cm_id>,
    backlog: VecDeque<CmEvent>,
}

impl Default for CmChannel {
    fn default() -> Self {
        CmChannel { channel: ptr::null_mut(), ids: Vec::new(), requests: Vec::new(), backlog: VecDeque::new() }
    }
}

impl CmChannel {
    pub(crate) fn channel_ptr(&mut self) -> Result<*mut rdma_event_channel> {
        if self.channel.is_null() {
            // SAFETY: creates a channel owned by the backend (destroyed in Drop).
            let ch = unsafe { rdma_create_event_channel() };
            if ch.is_null() {
                return Err(VerbsError::last("rdma_create_event_channel"));
            }
            // SAFETY: ch->fd is the channel's open file descriptor.
            unsafe {
                let fd = (*ch).fd;
                let fl = libc::fcntl(fd, libc::F_GETFL);
                libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            }
            self.channel = ch;
        }
        Ok(self.channel)
    }

    pub(crate) fn new_id(&mut self) -> Result<*mut rdma_cm_id> {
        let ch = self.channel_ptr()?;
        let mut id: *mut rdma_cm_id = ptr::null_mut();
        // SAFETY: ch is live; id receives the new cm id.
        let rc = unsafe { rdma_create_id(ch, &mut id, ptr::null_mut(), rdma_port_space::RDMA_PS_TCP) };
        if rc != 0 {
            return Err(VerbsError::rc("rdma_create_id", rc));
        }
        self.ids.push(id);
        Ok(id)
    }

    pub(crate) fn forget_id(&mut self, id: *mut rdma_cm_id) {
        self.ids.retain(|x| *x != id);
    }

    /// A fresh id bound to `addr` (before [`CmChannel::listen`]: the caller checks which
    /// device it belongs to).
    pub fn bind(&mut self, addr: SocketAddr) -> Result<*mut rdma_cm_id> {
        let id = self.new_id()?;
        let mut sa = sockaddr(addr)?;
        // SAFETY: id is live; sa is a valid sockaddr_in for the call's duration.
        let rc = unsafe { rdma_bind_addr(id, &mut sa as *mut libc::sockaddr_in as *mut libc::sockaddr) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EADDRINUSE) => VerbsError::AddressInUse { addr: addr.to_string() },
                _ => VerbsError::AddressNotRdma { addr: addr.to_string(), detail: format!("rdma_bind_addr: {e}") },
            });
        }
        Ok(id)
    }

    /// Listen on an id from [`CmChannel::bind`].
    pub fn listen(&mut self, id: *mut rdma_cm_id, addr: SocketAddr, backlog: i32) -> Result<()> {
        // SAFETY: id is a bound id of this channel.
        let rc = unsafe { rdma_listen(id, backlog) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::EADDRINUSE) => VerbsError::AddressInUse { addr: addr.to_string() },
                _ => VerbsError::rc("rdma_listen", rc),
            });
        }
        Ok(())
    }

    /// Next event, waiting at most `timeout` (zero: do not wait); the backlog first.
    pub fn poll(&mut self, timeout: Duration) -> Result<Option<CmEvent>> {
        if let Some(ev) = self.backlog.pop_front() {
            return Ok(Some(ev));
        }
        self.read_event(timeout)
    }

    /// Read one event from the channel (not the backlog).
    fn read_event(&mut self, timeout: Duration) -> Result<Option<CmEvent>> {
        let ch = self.channel_ptr()?;
        // SAFETY: ch is live; pollfd is plain data.
        unsafe {
            let mut p = libc::pollfd { fd: (*ch).fd, events: libc::POLLIN, revents: 0 };
            // ppoll, not poll: an idle MN waits in steps shorter than a millisecond
            let t = libc::timespec {
                tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
                tv_nsec: timeout.subsec_nanos() as libc::c_long,
            };
            if libc::ppoll(&mut p, 1, &t, ptr::null()) <= 0 {
                return Ok(None);
            }
            let mut ev: *mut rdma_cm_event = ptr::null_mut();
            if rdma_get_cm_event(ch, &mut ev) != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EAGAIN) {
                    return Ok(None);
                }
                return Err(VerbsError::last("rdma_get_cm_event"));
            }
            let e = &*ev;
            let kind = match e.event {
                rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED => CmEventKind::AddrResolved,
                rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED => CmEventKind::RouteResolved,
                rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST => CmEventKind::ConnectRequest,
                rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED => CmEventKind::Established,
                rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED => CmEventKind::Disconnected,
                rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => CmEventKind::Rejected,
                rdma_cm_event_type::RDMA_CM_EVENT_ADDR_ERROR
                | rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_ERROR
                | rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_ERROR
                | rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE
                | rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL => CmEventKind::Error(e.event),
                other => CmEventKind::Other(other),
            };
            let conn = &e.param.conn;
            let private_data = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(conn.private_data as *const u8, conn.private_data_len as usize).to_vec()
            };
            if kind == CmEventKind::ConnectRequest {
                // a new id, ours until accepted (then its QP owns it) or rejected
                self.requests.push(e.id);
            }
            let remote_qpn = match kind {
                CmEventKind::ConnectRequest | CmEventKind::Established => {
                    Qpn::new(conn.qp_num).ok().filter(|q| q.get() != 0)
                }
                _ => None,
            };
            let rnr_retry_count = if kind == CmEventKind::ConnectRequest { conn.rnr_retry_count } else { 0 };
            let peer = if kind == CmEventKind::ConnectRequest { peer_ip(&*e.id) } else { None };
            let out =
                CmEvent { kind, id: CmId(e.id), status: e.status, private_data, remote_qpn, rnr_retry_count, peer };
            rdma_ack_cm_event(ev);
            Ok(Some(out))
        }
    }

    /// Take a pending connection request out of the table (None: not one).
    pub(crate) fn take_request(&mut self, id: CmId) -> Option<*mut rdma_cm_id> {
        let i = self.requests.iter().position(|x| *x == id.0)?;
        Some(self.requests.swap_remove(i))
    }

    /// `id` is a connection request not yet accepted or rejected.
    #[cfg(feature = "devx")]
    pub(crate) fn is_request(&self, id: CmId) -> bool {
        self.requests.contains(&id.0)
    }

    /// Refuse a pending connection request (ignored if `id` is not one), with `private` as the
    /// reject's private data (empty: none; else a [`crate::refusal::Refusal`]).
    pub fn reject_with(&mut self, id: CmId, private: &[u8]) {
        if let Some(raw) = self.take_request(id) {
            reject_raw_with(raw, private);
        }
    }

    pub(crate) fn wait_event_for(
        &mut self,
        id: *mut rdma_cm_id,
        want: CmEventKind,
        peer: &str,
        deadline: Instant,
    ) -> Result<CmEvent> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(VerbsError::PeerUnreachable {
                    addr: peer.into(),
                    detail: format!("timed out waiting for {want:?}"),
                });
            }
            let ev = match self.backlog.iter().position(|e| e.id.0 == id) {
                Some(i) => self.backlog.remove(i),
                None => self.read_event(left.min(Duration::from_millis(100)))?,
            };
            let Some(ev) = ev else { continue };
            if ev.id.0 != id {
                // another id's event (a connection request, another connect): keep it for
                // poll_cm instead of dropping it
                self.backlog.push_back(ev);
                continue;
            }
            if ev.kind == want {
                return Ok(ev);
            }
            // the MN said why, in the reject's private data
            if let Some(r) =
                (ev.kind == CmEventKind::Rejected).then(|| crate::refusal::Refusal::decode(&ev.private_data)).flatten()
            {
                return Err(VerbsError::Rejected(r));
            }
            let detail = match ev.kind {
                CmEventKind::Rejected => {
                    "connection rejected (is an omw MN listening on that port, and is the CN limit reached?)"
                        .to_string()
                }
                k => format!("{k:?} (status {})", ev.status),
            };
            return Err(VerbsError::PeerUnreachable { addr: peer.into(), detail });
        }
    }

    /// Reject what is pending, destroy the ids, close the channel (before the device goes).
    pub fn close(&mut self) {
        // SAFETY: ids without QPs and the channel are ours; events were acked as they came.
        unsafe {
            for id in self.requests.drain(..) {
                reject_raw(id);
            }
            for id in self.ids.drain(..) {
                rdma_destroy_id(id);
            }
            if !self.channel.is_null() {
                rdma_destroy_event_channel(self.channel);
                self.channel = ptr::null_mut();
            }
        }
    }
}

impl Drop for CmChannel {
    fn drop(&mut self) {
        self.close();
    }
}
