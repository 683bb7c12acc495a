//! What differs between the MN daemon's transports, and nothing else: how a CN connection's QP
//! is made and accepted, which device the MN runs on and how it is opened. The loop, sessions,
//! timers, evictions, counters and logs are the daemon's (`super::MnDaemon`), once.
//!
//! Two implement it: the verbs transport (`super::verbs`: the QP is rdma_cm's, created on the
//! connection request's id) and the DEVX one (`crate::devx::mn`: the QP is a DEVX QP, connected
//! in rdma_cm's external-QP mode).

use super::{MnOptions, Sizing};
use crate::cm::{CmEvent, CmId, Role};
use crate::error::{Result, VerbsError};
use crate::probe::ProbeReport;
use crate::sessions::Session;
use omw_core::chain::arm::MnDevice;
use omw_core::device::DataPath;
use omw_core::ids::Qpn;
use omw_core::mn::driver::MnDriver;
use omw_core::mn::plan::MnPlan;
use omw_core::mn::provision::ProvisionError;
use std::net::SocketAddr;
use std::time::Duration;

/// The error of a transport's device.
pub type DeviceError<T> = <<T as Transport>::Device as DataPath>::Error;

/// How CNs reach the MN's device: connection requests become QPs of [`Transport::Device`].
pub trait Transport {
    /// The MN's device: the core's `MnDriver` runs on it.
    type Device: MnDevice;
    /// How CNs connect, as the last start-up line says it: "listening on ADDR (…)".
    const LISTENING: &'static str;
    /// The send-queue depth the MN's host-engine QPs were created with (`PoolSpec`), if the
    /// transport fixes one.
    const QUEUE_DEPTH: Option<u16>;

    /// Why the core's provisioning failed, as the daemon reports it.
    fn provision_error(e: ProvisionError<DeviceError<Self>>) -> VerbsError;
    /// The MN is provisioned (before anything listens and any chain is laid out): take what the
    /// transport needs of it, set what the device needs of it (the chains' variant).
    fn provisioned(&mut self, driver: &mut MnDriver<Self::Device>) -> Result<()>;
    /// Listen for CNs on `addr`, an address of the MN's device.
    fn listen(&mut self, dev: &mut Self::Device, addr: SocketAddr) -> Result<()>;
    /// What the start-up line about the device adds for this transport (may be empty).
    fn describe(&self, dev: &Self::Device) -> String;

    /// The next connection event, waiting at most `timeout` (zero: do not wait).
    fn poll_cm(&mut self, dev: &mut Self::Device, timeout: Duration) -> Result<Option<CmEvent>>;
    /// Refuse the pending connection request `id`, with `private` as the reject's private data
    /// (empty: none; else a [`crate::refusal::Refusal`] the CN reads).
    fn reject(&mut self, dev: &mut Self::Device, id: CmId, private: &[u8]);
    /// Give the admitted connection request `id` (a CN's `role` connection) a QP and accept it
    /// with `private` as the reply's private data. On failure the request is refused and
    /// nothing of it is left.
    fn accept(
        &mut self,
        dev: &mut Self::Device,
        id: CmId,
        role: Role,
        private: &[u8],
    ) -> std::result::Result<Qpn, DeviceError<Self>>;
    /// The QP accepted for `id`.
    fn qp_of(&self, dev: &Self::Device, id: CmId) -> Option<Qpn>;

    /// Whether a complete session's chain connection can be rejoined (`crate::rejoin`): the
    /// MN-side QP reconnected to the CN QP of a new request. Only a transport whose QPs are
    /// the MN's own (DEVX, rdma_cm's external-QP mode) can; an rdma_cm QP belongs to its id.
    const REJOINS: bool;
    /// A rejoin, first half: take the path of the new connection request `id` for `qp` (the MN
    /// end of the connection it replaces) without touching the QP. The repair of `qp`'s chain
    /// that follows resets it and connects it on that path.
    fn rejoin_path(&mut self, dev: &mut Self::Device, id: CmId, qp: Qpn) -> std::result::Result<(), DeviceError<Self>>;
    /// A rejoin, second half, once `qp` is connected on the new path: accept `id` naming
    /// `qp`, with `private` as the reply's private data, and end the connection `old` it
    /// replaces. On failure the request is refused.
    fn rejoin_accept(
        &mut self,
        dev: &mut Self::Device,
        id: CmId,
        old: CmId,
        qp: Qpn,
        private: &[u8],
    ) -> std::result::Result<(), DeviceError<Self>>;
    /// A session is over: destroy its QPs and end its connections.
    fn release(&mut self, dev: &mut Self::Device, session: &Session);
    /// Windows the device gave up at teardown (the `lost_windows` gauge).
    fn lost_windows(&self, dev: &Self::Device) -> u64;
    /// Window-state queries the device did not answer (the `window_query_failures` counter);
    /// a device that answers from its own bookkeeping never fails one.
    fn window_query_failures(&self, _dev: &Self::Device) -> u64 {
        0
    }
}

/// A transport the daemon can start on a real device (`MnDaemon::start`): after the probe,
/// open the device it measured and decide the plan.
pub trait StartUp: Transport + Sized {
    /// Bytes the transport pins besides the pool, its metadata and the QPs, for `cns` CNs.
    fn extra_pinned(opts: &MnOptions, cns: u32) -> u64;
    /// Refuse what the probe found unsafe, open the device `probe` measured, and decide the MN's
    /// plan for it.
    fn open(opts: &MnOptions, probe: &ProbeReport, sizing: Sizing) -> Result<(Self, Self::Device, MnPlan)>;
}
