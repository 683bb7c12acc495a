//! `omw mn --offload mlx5`: the memory node with its chains inside a ConnectX, on DEVX — the
//! daemon of `crate::mn` on [`DevxTransport`].
//!
//! What this transport does differently is the QP of a CN's connection: a DEVX QP of
//! [`DevxBackend`] (management QPs with the CORE-Direct roles and a one-lap ring, access QPs
//! plain), connected in rdma_cm's external-QP mode — `rdma_init_qp_attr` for INIT / RTR / RTS
//! applied by DEVX modifies, then `rdma_accept` with `conn_param.qp_num` (librdmacm
//! rdma_accept(3): a QP the caller owns) — through [`ExternalCm`], so that the accept path
//! runs against the recording mock in the tests (`mn_tests.rs`).
//!
//! The capabilities the plan sees are the verbs MW probe's (type-2 binding, bounds, the
//! invalidation check — measured on this device) plus what the DEVX gate established
//! (`cd`: WAIT / SEND_EN; host-endian 8-byte masked fetch-and-add; UMR binds to another QP
//! and self-modifying WQEs, which only hardware can confirm: docs/MLX5.md questions 4, 5).
//! Written without a ConnectX and never run on one.

use super::backend::DevxBackend;
use super::cm::{merge_states, Accept, CmQpAttr, ExternalCm};
use super::device::DevxDevice;
use super::profile::{self, Profile};
use super::DevxError;
use crate::cm::{CmEvent, CmId, Role};
use crate::error::{human, Result, VerbsError};
use crate::mn::transport::{DeviceError, Transport};
use crate::sessions::Session;
use omw_core::chain::variant::ChainVariant;
use omw_core::device::behaviour::{DeviceAnswers, DeviceBehaviour, Question, UncheckedUnbind};
use omw_core::device::{Capabilities, DataPath};
use omw_core::ids::Qpn;
use omw_core::mn::driver::MnDriver;
use omw_core::mn::provision::ProvisionError;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::time::Duration;

/// What offload adds to the probed capabilities on a device the DEVX gate passed.
pub const DEVX_OFFLOAD: Capabilities = Capabilities::WAIT_ENABLE
    .union(Capabilities::SELF_MODIFYING_WQE)
    .union(Capabilities::ATOMICS)
    .union(Capabilities::MASKED_FETCH_ADD)
    .union(Capabilities::BIND_TO_OTHER_QP);

/// The names of the answers to `q` under which some chain layout is correct.
fn tolerated(q: Question) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    let correct = |b: &&DeviceBehaviour| ChainVariant::ALL.iter().any(|v| v.needs().hold_for(b));
    for b in DeviceBehaviour::ALL.iter().filter(correct) {
        if let Some(n) = profile::answer_name(&DeviceAnswers::exactly(*b), q) {
            if !out.contains(&n) {
                out.push(n);
            }
        }
    }
    out
}

/// The device answers the MN's chains are laid out for — the profile's (none: every answer
/// unknown) — and the chain variant correct under every behaviour they allow; refused with
/// the question they leave open, or answer wrongly, when no variant is.
pub fn chain_answers(profile: Option<&Profile>) -> Result<(DeviceAnswers, ChainVariant), DevxError> {
    let answers = profile.map_or(DeviceAnswers::UNKNOWN, |p| p.answers);
    match ChainVariant::choose(&answers) {
        // every layout, and the MN's own repairs, unbind windows bound to the CNs' QPs without
        // the QPN check (`UncheckedUnbind`): no layout varies over it
        Ok(_) if profile.and_then(|p| p.unchecked_unbind) != Some(UncheckedUnbind::Honoured) => {
            Err(DevxError::UncheckedUnbind(profile.and_then(|p| p.unchecked_unbind)))
        }
        Ok(v) => Ok((answers, v)),
        Err(no) => {
            // the closest layout's unmet question is what the operator can answer next
            let question = no.question.unwrap_or(Question::ALL[0]);
            Err(DevxError::Unsuited {
                question,
                answer: profile::answer_name(&answers, question),
                tolerated: tolerated(question),
            })
        }
    }
}

/// The answers as one log line.
pub fn describe_answers(a: &DeviceAnswers) -> String {
    Question::ALL
        .map(|q| format!("{} = {}", q.key(), profile::answer_name(a, q).unwrap_or(profile::UNKNOWN)))
        .join(", ")
}

/// CN connections as DEVX QPs of a `DevxBackend<D>`, accepted through `C`.
#[derive(Debug)]
pub struct DevxTransport<D, C: ExternalCm> {
    cm: C,
    /// The device's name: the listen address must be one of its.
    device: String,
    /// rdma_cm id → the DEVX QP accepted for it (rdma_cm does not know our QPs).
    accepted: HashMap<CmId, Qpn>,
    /// The management QPs' send-ring WQEBBs [Alloc, Free]: one lap of each chain, the same for
    /// every CN (`MemoryNode::chain_ring_depths`); known once the MN is provisioned.
    mgmt_depths: [u32; 2],
    /// The chain layout the device's answers chose (`chain_answers`).
    pub variant: ChainVariant,
    device_type: PhantomData<fn() -> D>,
}

impl<D, C: ExternalCm> DevxTransport<D, C> {
    /// Accept CNs through `cm` for the device named `device`.
    pub fn new(cm: C, device: &str) -> Self {
        DevxTransport {
            cm,
            device: device.into(),
            accepted: HashMap::new(),
            mgmt_depths: [0; 2],
            variant: ChainVariant::default(),
            device_type: PhantomData,
        }
    }
}

/// The path of the pending connection request `id`: the attributes rdma_cm gives for INIT, RTR
/// and RTS (as it gave them, and folded into one), and the next hop's MAC.
fn path_of<D: DevxDevice, C: ExternalCm>(
    cm: &mut C,
    b: &mut DevxBackend<D>,
    id: CmId,
) -> std::result::Result<([CmQpAttr; 3], CmQpAttr, [u8; 6]), DevxError> {
    let [init, rtr, rts] = cm.qp_attrs(id)?;
    let rmac = if rtr.ah_is_global { b.device_mut().next_hop_mac(&rtr)? } else { [0; 6] };
    Ok(([init, rtr, rts], merge_states(&init, &rtr, &rts), rmac))
}

/// `rdma_accept` of the pending request `id` naming our QP `qp`, with `private` as the reply's
/// private data and the RTR / RTS parameters rdma_cm negotiated (`attrs`, its three answers).
fn accept_naming<C: ExternalCm>(
    cm: &mut C,
    id: CmId,
    qp: Qpn,
    attrs: &[CmQpAttr; 3],
    private: &[u8],
) -> std::result::Result<(), DevxError> {
    let [_, rtr, rts] = attrs;
    cm.accept(id, &Accept::of(qp.get(), rtr, rts, private))
}

/// Connect the CN-facing DEVX QP `qp` on the path of the pending connection request `id`, then
/// `rdma_accept` it naming `qp`, with `private` as the reply's private data.
fn connect_and_accept<D: DevxDevice, C: ExternalCm>(
    cm: &mut C,
    b: &mut DevxBackend<D>,
    id: CmId,
    qp: Qpn,
    private: &[u8],
) -> std::result::Result<(), DevxError> {
    let (attrs, attr, rmac) = path_of(cm, b, id)?;
    b.connect_cn_qp(qp, &attr, rmac)?;
    accept_naming(cm, id, qp, &attrs, private)
}

impl<D: DevxDevice, C: ExternalCm> Transport for DevxTransport<D, C> {
    type Device = DevxBackend<D>;
    const LISTENING: &'static str = "rdma_cm, external DEVX QPs";
    const QUEUE_DEPTH: Option<u16> = None;

    fn provision_error(e: ProvisionError<DevxError>) -> VerbsError {
        VerbsError::Config(format!("bringing the MN up on DEVX: {e}"))
    }
    fn provisioned(&mut self, driver: &mut MnDriver<DevxBackend<D>>) -> Result<()> {
        // no CN is connected yet: every chain is laid out for the device's answers
        // (a layout that binds to the poster registers one proof-word MR per CN slot first)
        let set = driver
            .set_chain_variant(self.variant)
            .map_err(|e| VerbsError::Config(format!("registering the CN slots' proof words: {e}")))?;
        if !set {
            return Err(VerbsError::Config(format!(
                "the MN refused the chain layout {:?}: it is set before any CN connects, and one that binds \
                 to the poster needs one alloc chain per CN",
                self.variant
            )));
        }
        let d = driver
            .mn
            .chain_ring_depths()
            .map_err(|e| VerbsError::Config(format!("the chains' mlx5 ring sizes: {e}")))?;
        self.mgmt_depths = [u32::from(d[0][1]), u32::from(d[1][1])];
        Ok(())
    }
    fn listen(&mut self, _: &mut DevxBackend<D>, addr: SocketAddr) -> Result<()> {
        self.cm.listen(addr, &self.device)
    }
    fn describe(&self, dev: &DevxBackend<D>) -> String {
        format!(" | DEVX ring arena {}", human(dev.config().ring_arena_bytes as u64))
    }
    fn poll_cm(&mut self, _: &mut DevxBackend<D>, timeout: Duration) -> Result<Option<CmEvent>> {
        self.cm.poll(timeout)
    }
    fn reject(&mut self, _: &mut DevxBackend<D>, id: CmId, private: &[u8]) {
        self.cm.reject_with(id, private)
    }
    fn accept(
        &mut self,
        b: &mut DevxBackend<D>,
        id: CmId,
        role: Role,
        private: &[u8],
    ) -> std::result::Result<Qpn, DeviceError<Self>> {
        let managed = match role {
            Role::Alloc | Role::AllocChain(_) => Some(self.mgmt_depths[0]),
            Role::Free => Some(self.mgmt_depths[1]),
            Role::Access(_) => None,
        };
        let q = match b.create_cn_qp(managed) {
            Ok(q) => q,
            Err(e) => {
                self.cm.reject(id);
                return Err(e);
            }
        };
        if let Err(e) = connect_and_accept(&mut self.cm, b, id, q, private) {
            let _ = b.destroy_qp(q);
            // ignored if the failed accept rejected it already
            self.cm.reject(id);
            return Err(e);
        }
        self.accepted.insert(id, q);
        Ok(q)
    }
    fn qp_of(&self, _: &DevxBackend<D>, id: CmId) -> Option<Qpn> {
        self.accepted.get(&id).copied()
    }
    /// The QP is a DEVX object of the MN's: any connection request's path can be put on it.
    const REJOINS: bool = true;
    fn rejoin_path(&mut self, b: &mut DevxBackend<D>, id: CmId, qp: Qpn) -> std::result::Result<(), DevxError> {
        let (_, attr, rmac) = path_of(&mut self.cm, b, id)?;
        b.set_cn_path(qp, &attr, rmac)
    }
    fn rejoin_accept(
        &mut self,
        _: &mut DevxBackend<D>,
        id: CmId,
        old: CmId,
        qp: Qpn,
        private: &[u8],
    ) -> std::result::Result<(), DevxError> {
        // the request's attributes again: `rejoin_path` ran before the chain's repair, and
        // rdma_cm keeps them for the pending request
        let accepted = self.cm.qp_attrs(id).and_then(|a| accept_naming(&mut self.cm, id, qp, &a, private));
        if let Err(e) = accepted {
            // ignored if the failed accept rejected it already
            self.cm.reject(id);
            return Err(e);
        }
        // the old connection's QP is this one, now the new connection's: only its id goes
        if self.accepted.remove(&old).is_some() {
            self.cm.disconnect(old);
        }
        self.accepted.insert(id, qp);
        Ok(())
    }
    fn release(&mut self, b: &mut DevxBackend<D>, session: &Session) {
        for q in session.qps() {
            let _ = b.destroy_qp(q);
        }
        let ids: Vec<CmId> =
            self.accepted.iter().filter(|(_, q)| session.qps().any(|x| x == **q)).map(|(i, _)| *i).collect();
        for id in ids {
            self.accepted.remove(&id);
            self.cm.disconnect(id);
        }
    }
    /// The DEVX backend deallocates its windows with the device; none is given up on the way.
    fn lost_windows(&self, _: &DevxBackend<D>) -> u64 {
        0
    }
    /// QUERY_MKEYs that got no answer (`DevxBackend::window_query_failures`).
    fn window_query_failures(&self, dev: &DevxBackend<D>) -> u64 {
        dev.window_query_failures()
    }
}

impl<D, C: ExternalCm> Drop for DevxTransport<D, C> {
    /// The connections go before the channel (which the transport's `C` closes as it drops).
    fn drop(&mut self) {
        for (id, _) in self.accepted.drain() {
            self.cm.disconnect(id);
        }
    }
}

#[cfg(feature = "devx")]
mod start {
    use super::*;
    use crate::device::DeviceChoice;
    use crate::devx::backend::DevxConfig;
    use crate::devx::caps;
    use crate::devx::ffi::{RealCm, RealDevx};
    use crate::mn::{log, MnDaemon, MnOptions, Sizing, StartUp};
    use crate::probe::ProbeReport;
    use omw_core::device::ExecutionMode;
    use omw_core::mn::plan::{MnOptions as PlanOptions, MnPlan};

    /// The offloaded MN daemon on a ConnectX.
    pub type DevxMnDaemon = MnDaemon<DevxTransport<RealDevx, RealCm>>;

    impl StartUp for DevxTransport<RealDevx, RealCm> {
        /// The ring arena, registered in both domains.
        fn extra_pinned(opts: &MnOptions, cns: u32) -> u64 {
            DevxConfig::arena_for_chains(
                cns,
                opts.group_size,
                opts.alloc_chains,
                &DevxConfig::new(Capabilities::empty()),
            ) as u64
        }

        fn open(
            opts: &MnOptions,
            report: &ProbeReport,
            sizing: Sizing,
        ) -> Result<(Self, DevxBackend<RealDevx>, MnPlan)> {
            if report.basic_failed || report.stale_rkey_accepted {
                return Err(VerbsError::Insecure(format!(
                    "device {}: type-2 memory windows failed the probe (bind/access/invalidate, or a stale rkey accepted): no offload",
                    report.device
                )));
            }
            // the chains must be correct on what the device does (its bring-up profile)
            let (answers, variant) = chain_answers(opts.offload_profile.as_ref()).map_err(VerbsError::Devx)?;
            // the device, port and GID the probe measured
            let choice = DeviceChoice { device: Some(report.device.clone()), gid_index: Some(report.gid.index) };
            let mut dev = RealDevx::open(&choice)?;
            if let Some(p) = &opts.offload_profile {
                if p.firmware != dev.firmware() {
                    return Err(VerbsError::Devx(DevxError::ProfileFirmware {
                        profile: p.firmware.clone(),
                        device: dev.firmware().to_string(),
                    }));
                }
                log(format!(
                    "device profile: measured on {} (firmware {}) at {}: {}",
                    p.device,
                    p.firmware,
                    p.date,
                    describe_answers(&answers)
                ));
            }
            log(format!("chains: {variant:?} (SEND_EN indices in {:?}s)", variant.send_en_unit));
            let hca = caps::query(&mut dev).map_err(VerbsError::Devx)?;
            if let Some(m) = hca.missing_for_offload() {
                return Err(VerbsError::Devx(DevxError::MissingCapability(m)));
            }
            let capabilities = report.capabilities | DEVX_OFFLOAD;
            let plan = MnPlan::decide(
                capabilities,
                PlanOptions { mode: Some(ExecutionMode::Offloaded), allow_insecure: opts.insecure, scrub: opts.scrub },
            )
            .map_err(|e| VerbsError::Insecure(format!("refusing to start with --offload mlx5: {e}")))?;
            let mut cfg = DevxConfig::new(capabilities);
            cfg.ring_arena_bytes =
                DevxConfig::arena_for_chains(sizing.max_cns, opts.group_size, opts.alloc_chains, &cfg);
            // the chains publish their own receives only where the bring-up saw the HCA take a
            // record its own DMA wrote (docs/MLX5.md question 20); otherwise the backend hands
            // receives back, and a CN's pipelined requests on one chain can land in a running
            // lap under doorbell-enabled receives (its own loss, never another CN's)
            let publish = opts.offload_profile.as_ref().and_then(|p| p.recv_publish);
            cfg.chains_publish_receives = publish == Some(omw_core::device::behaviour::RecvPublish::Honoured);
            if !cfg.chains_publish_receives {
                log(format!(
                    "chains: the CPU hands receives back (the profile's recv_publish is {}): pipelined requests on one chain can land in a running lap under doorbell-enabled receives; run omw-mlx5-bringup recv-publish",
                    publish.map_or("unknown", |_| "ignored")
                ));
            }
            let b = DevxBackend::new(dev, hca, cfg).map_err(VerbsError::Devx)?;
            let mut transport = DevxTransport::new(RealCm::default(), &report.device);
            transport.variant = variant;
            Ok((transport, b, plan))
        }
    }

    /// `omw mn --offload mlx5`: start, run until SIGINT/SIGTERM, tear down.
    pub fn serve(opts: MnOptions) -> Result<()> {
        let stop = crate::signals::install()?;
        let mut d = DevxMnDaemon::start(opts)?;
        d.run(stop)?;
        drop(d);
        log("stopped");
        Ok(())
    }
}

#[cfg(feature = "devx")]
pub use start::{serve, DevxMnDaemon};
