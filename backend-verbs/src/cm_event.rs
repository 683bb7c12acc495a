//! What the backend keeps of rdma_cm: copies of events (its backlog of other ids' events) and id
//! handles, and the one rdma_cm call its teardown makes. Apart from cm.rs, which extends the
//! backend with the connection set-up, so that backend.rs does not depend on cm.rs
//! (scripts/import-cycles).

use omw_core::ids::Qpn;
use rdma_sys::*;
use std::ptr;

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
}

/// Reject and destroy a connection request id that was taken out of the pending table.
pub(crate) fn reject_raw(id: *mut rdma_cm_id) {
    // SAFETY: id is a live connection-request id owned by the caller (taken out of the
    // backend's pending table, so nothing else uses or destroys it).
    unsafe {
        rdma_reject(id, ptr::null(), 0);
        rdma_destroy_id(id);
    }
}
