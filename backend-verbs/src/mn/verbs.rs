//! `omw mn`: the MN daemon on libibverbs — host-engine mode (libibverbs has no WAIT/ENABLE), a
//! CN connection's QP created by rdma_cm on the connection request's id (`VerbsBackend::accept`).

use super::transport::{DeviceError, StartUp, Transport};
use super::{log, MnDaemon, MnOptions, Sizing};
use crate::backend::{VerbsBackend, SEND_DEPTH};
use crate::cm::{CmEvent, CmId, Role};
use crate::device::DeviceChoice;
use crate::error::{Result, VerbsError};
use crate::probe::ProbeReport;
use crate::sessions::Session;
use omw_core::device::{DataPath, ExecutionMode};
use omw_core::ids::Qpn;
use omw_core::mn::driver::MnDriver;
use omw_core::mn::plan::{MnOptions as PlanOptions, MnPlan, PlanError};
use omw_core::mn::provision::ProvisionError;
use std::net::SocketAddr;
use std::time::Duration;

/// The verbs transport: rdma_cm lives in the backend (its QPs are rdma_cm's), so this holds
/// nothing of its own.
#[derive(Debug, Default)]
pub struct VerbsTransport;

/// The host-engine MN daemon on libibverbs.
pub type MemoryNodeDaemon = MnDaemon<VerbsTransport>;

impl Transport for VerbsTransport {
    type Device = VerbsBackend;
    const LISTENING: &'static str = "rdma_cm";
    const QUEUE_DEPTH: Option<u16> = Some(SEND_DEPTH as u16);

    /// A device error during set-up stays the device error it was (memlock, a failed verb…);
    /// anything else names the provisioning step.
    fn provision_error(e: ProvisionError<VerbsError>) -> VerbsError {
        match e {
            ProvisionError::Backend(e) => e,
            ProvisionError::Register(PlanError::Backend(e)) => e,
            other => VerbsError::Provision(Box::new(other)),
        }
    }
    fn provisioned(&mut self, _: &mut MnDriver<VerbsBackend>) -> Result<()> {
        Ok(())
    }
    fn listen(&mut self, dev: &mut VerbsBackend, addr: SocketAddr) -> Result<()> {
        dev.listen(addr, 64)
    }
    fn describe(&self, _: &VerbsBackend) -> String {
        String::new()
    }
    fn poll_cm(&mut self, dev: &mut VerbsBackend, timeout: Duration) -> Result<Option<CmEvent>> {
        dev.poll_cm(timeout)
    }
    fn reject(&mut self, dev: &mut VerbsBackend, id: CmId, private: &[u8]) {
        dev.reject(id, private)
    }
    fn accept(&mut self, dev: &mut VerbsBackend, id: CmId, _: Role, private: &[u8]) -> Result<Qpn, DeviceError<Self>> {
        dev.accept(id, private)
    }
    fn qp_of(&self, dev: &VerbsBackend, id: CmId) -> Option<Qpn> {
        dev.qp_of_id(id)
    }
    /// Destroying an rdma_cm QP disconnects and destroys its id too.
    /// An rdma_cm QP is its id's: a new request gets a new QP, which the MN's tables do not
    /// name. The CN starts a new session instead (told so by `Refusal::NoRejoin`).
    const REJOINS: bool = false;
    fn rejoin_path(&mut self, _: &mut VerbsBackend, _: CmId, _: Qpn) -> Result<()> {
        Err(VerbsError::Unsupported("rejoining an rdma_cm connection (its QP is the id's)"))
    }
    fn rejoin_accept(&mut self, _: &mut VerbsBackend, _: CmId, _: CmId, _: Qpn, _: &[u8]) -> Result<()> {
        Err(VerbsError::Unsupported("rejoining an rdma_cm connection (its QP is the id's)"))
    }
    fn release(&mut self, dev: &mut VerbsBackend, session: &Session) {
        for q in session.qps() {
            let _ = dev.destroy_qp(q);
        }
    }
    fn lost_windows(&self, dev: &VerbsBackend) -> u64 {
        dev.lost_windows().len() as u64
    }
}

impl StartUp for VerbsTransport {
    fn extra_pinned(_: &MnOptions, _: u32) -> u64 {
        0
    }

    fn open(opts: &MnOptions, report: &ProbeReport, _: Sizing) -> Result<(Self, VerbsBackend, MnPlan)> {
        if report.basic_failed {
            return Err(VerbsError::Insecure(format!(
                "device {}: type-2 memory windows do not work (bind/access/invalidate failed in the probe)",
                report.device
            )));
        }
        let caps = report.capabilities;
        if report.stale_rkey_accepted && !opts.insecure {
            return Err(VerbsError::Insecure(
                "refusing to start: the device accepted a stale rkey after a rebind. Pass --insecure to run anyway"
                    .into(),
            ));
        }
        // every security decision is the core's MN plan; libibverbs has no chain offload, so
        // the plan is always asked for the host engine here
        let plan = MnPlan::decide(
            caps,
            PlanOptions { mode: Some(ExecutionMode::HostEngine), allow_insecure: opts.insecure, scrub: opts.scrub },
        )
        .map_err(|e| {
            VerbsError::Insecure(format!(
                "refusing to start: {e}. Pass --insecure to run without isolation between CNs"
            ))
        })?;
        let choice = DeviceChoice { device: Some(report.device.clone()), gid_index: opts.gid_index };
        let mut b = VerbsBackend::open_choice(&choice)?;
        b.set_probed(caps);
        Ok((VerbsTransport, b, plan))
    }
}

/// `omw mn`: start, run until SIGINT/SIGTERM, tear down.
pub fn serve(opts: MnOptions) -> Result<()> {
    let stop = crate::signals::install()?;
    let mut d = MemoryNodeDaemon::start(opts)?;
    d.run(stop)?;
    drop(d);
    log("stopped");
    Ok(())
}
