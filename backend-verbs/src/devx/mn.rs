//! `omw mn --offload mlx5`: the memory node with its chains inside a ConnectX, on DEVX.
//!
//! The same daemon shape as the verbs one (`crate::mn`): probe, provision through the core's
//! `MnPlan`, listen on rdma_cm, group a CN's connections (`crate::sessions`), hand them to
//! `MnDriver::connect`, turn disconnects into `Event::CnGone`. What differs is only the
//! transport of a CN's connection: its QP is a DEVX QP of [`DevxBackend`] (management QPs with
//! the CORE-Direct roles and a one-lap ring, access QPs plain), connected in rdma_cm's
//! external-QP mode — `rdma_init_qp_attr` for INIT / RTR / RTS applied by DEVX modifies, then
//! `rdma_accept` with `conn_param.qp_num` (librdmacm rdma_accept(3): a QP the caller owns).
//!
//! The capabilities the plan sees are the verbs MW probe's (type-2 binding, bounds, the
//! invalidation check — measured on this device) plus what the DEVX gate established
//! (`cd`: WAIT / SEND_EN; host-endian 8-byte masked fetch-and-add; UMR binds to another QP
//! and self-modifying WQEs, which only hardware can confirm: docs/MLX5.md questions 4, 5).
//! Written without a ConnectX and never run.

use super::backend::{DevxBackend, DevxConfig};
use super::ffi::{self, RealDevx};
use super::{caps, DevxError};
use crate::cm::Role;
use crate::cm::{CmEvent, CmEventKind};
use crate::cm_event::CmChannel;
use crate::device::DeviceChoice;
use crate::error::{human, Result, VerbsError};
use crate::log::Level;
use crate::mn::{checked_sizing, MnOptions};
use crate::probe;
use crate::sessions::{Admission, Sessions, SESSION_PATIENCE};
use omw_core::device::{Capabilities, DataPath, ExecutionMode};
use omw_core::ids::Qpn;
use omw_core::mn::driver::MnDriver;
use omw_core::mn::plan::{MnOptions as PlanOptions, MnPlan};
use omw_core::mn::Event;
use rdma_sys::*;
use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

const TARGET: &str = "omw_verbs::devx::mn";

fn log(msg: impl AsRef<str>) {
    crate::log::log(TARGET, "omw mn", Level::Info, msg.as_ref());
}

/// What offload adds to the probed capabilities on a device the DEVX gate passed.
pub const DEVX_OFFLOAD: Capabilities = Capabilities::WAIT_ENABLE
    .union(Capabilities::SELF_MODIFYING_WQE)
    .union(Capabilities::ATOMICS)
    .union(Capabilities::MASKED_FETCH_ADD)
    .union(Capabilities::BIND_TO_OTHER_QP);

pub struct DevxMnDaemon {
    pub driver: MnDriver<DevxBackend<RealDevx>>,
    cm: CmChannel,
    sessions: Sessions,
    /// rdma_cm id → the DEVX QP accepted for it (rdma_cm does not know our QPs).
    qp_of: HashMap<crate::cm::CmId, Qpn>,
    /// The management QPs' send-ring WQEBBs [Alloc, Free]: one lap of each chain, the same for
    /// every CN (`MemoryNode::chain_ring_depths`).
    mgmt_depths: [u32; 2],
    t0: Instant,
}

impl std::fmt::Debug for DevxMnDaemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevxMnDaemon").finish_non_exhaustive()
    }
}

fn devx(e: DevxError) -> VerbsError {
    VerbsError::Devx(e)
}

impl DevxMnDaemon {
    pub fn start(opts: MnOptions) -> Result<Self> {
        let sizes = DevxConfig::new(Capabilities::empty());
        let arena = |cns: u32| DevxConfig::arena_for(cns, opts.group_size, &sizes) as u64;
        let (chunks, max_cns) = checked_sizing(&opts, arena)?;
        // the MW semantics of this device, measured (verbs, on a context of its own)
        let choice = DeviceChoice { device: opts.device.clone(), gid_index: opts.gid_index };
        let report = probe::run_choice(&choice)?;
        log(format!("{report}"));
        if report.basic_failed || report.stale_rkey_accepted {
            return Err(VerbsError::Insecure(format!(
                "device {}: type-2 memory windows failed the probe (bind/access/invalidate, or a stale rkey accepted): no offload",
                report.device
            )));
        }
        let mut dev = RealDevx::open(Some(&report.device)).map_err(devx)?.with_gid_index(report.gid.index);
        let hca = caps::query(&mut dev).map_err(devx)?;
        if let Some(m) = hca.missing_for_offload() {
            return Err(devx(DevxError::MissingCapability(m)));
        }
        let capabilities = report.capabilities | DEVX_OFFLOAD;
        let plan = MnPlan::decide(
            capabilities,
            PlanOptions { mode: Some(ExecutionMode::Offloaded), allow_insecure: opts.insecure, scrub: opts.scrub },
        )
        .map_err(|e| VerbsError::Insecure(format!("refusing to start with --offload mlx5: {e}")))?;
        let mut cfg = DevxConfig::new(capabilities);
        cfg.ring_arena_bytes = DevxConfig::arena_for(max_cns, opts.group_size, &cfg);
        let b = DevxBackend::new(dev, hca, cfg).map_err(devx)?;
        let spec = opts.pool_spec(chunks, max_cns, None);
        let mut driver =
            plan.provision(b, &spec).map_err(|e| VerbsError::Config(format!("bringing the MN up on DEVX: {e}")))?;
        let d = driver
            .mn
            .chain_ring_depths()
            .map_err(|e| VerbsError::Config(format!("the chains' mlx5 ring sizes: {e}")))?;
        let mgmt_depths = [u32::from(d[0][1]), u32::from(d[1][1])];
        let sessions = crate::mn::admission(&opts, max_cns, &mut driver.mn, log)?;
        let mut cm = CmChannel::default();
        let id = cm.bind(opts.listen)?;
        match crate::backend::VerbsBackend::id_device(id) {
            Some(d) if d == report.device => {}
            other => {
                return Err(VerbsError::Config(format!(
                    "{} belongs to {} , not {}: pass --device with the device that owns it",
                    opts.listen,
                    other.as_deref().unwrap_or("no RDMA device"),
                    report.device
                )))
            }
        }
        cm.listen(id, opts.listen, 64)?;
        log(format!(
            "device {} | pool {} in {chunks} chunks of {} | group size {} | execution: offloaded on DEVX (chains in the NIC) | ring arena {}",
            report.device,
            human(opts.pool_size),
            human(opts.chunk_size),
            opts.group_size,
            human(cfg.ring_arena_bytes as u64),
        ));
        log(format!("listening on {} (rdma_cm, external DEVX QPs)", opts.listen));
        Ok(DevxMnDaemon { driver, cm, sessions, qp_of: HashMap::new(), mgmt_depths, t0: Instant::now() })
    }

    fn now(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    pub fn run(&mut self, stop: &AtomicBool) -> Result<()> {
        crate::mn::run_until(stop, || self.step())
    }

    /// One turn: connection events, the driver (which drains the chain CQs), timers.
    pub fn step(&mut self) -> Result<bool> {
        let mut busy = false;
        while let Some(ev) = self.cm.poll(Duration::ZERO)? {
            busy = true;
            self.on_cm(ev);
        }
        let now = self.now();
        match self.driver.poll(now) {
            Ok(r) => busy |= r.events > 0,
            Err(e) => log(format!("MN driver: {e} (serving on)")),
        }
        if self.driver.poll_timeout().is_some_and(|t| now >= t) {
            if let Err(e) = self.driver.handle_timeout(now) {
                log(format!("MN driver (timer): {e} (serving on)"));
            }
        }
        for cn in self.driver.mn.take_evicted() {
            log(format!("{cn} evicted: it stopped answering; its chunks were reclaimed"));
            if let Some(n) = self.sessions.nonce_of_cn(cn) {
                self.drop_session(n);
            }
        }
        for nonce in self.sessions.incomplete_since(Instant::now(), SESSION_PATIENCE) {
            log(format!("session {nonce:#x} dropped: not all its connections arrived within {SESSION_PATIENCE:?}"));
            self.drop_session(nonce);
        }
        Ok(busy)
    }

    fn accept(&mut self, ev: &CmEvent, role: Role, private: &[u8]) -> std::result::Result<Qpn, DevxError> {
        let managed = match role {
            Role::Alloc => Some(self.mgmt_depths[0]),
            Role::Free => Some(self.mgmt_depths[1]),
            Role::Access(_) => None,
        };
        let raw = self
            .cm
            .take_request(ev.id)
            .ok_or(DevxError::Call { call: "rdma_accept (not a pending connection request)", errno: libc::EINVAL })?;
        let q = match self.driver.backend.create_cn_qp(managed) {
            Ok(q) => q,
            Err(e) => {
                crate::cm_event::reject_raw(raw);
                return Err(e);
            }
        };
        // SAFETY: `raw` is a live connection request this channel reported and nobody has
        // accepted or rejected (take_request removed it from the pending table).
        let r = unsafe { ffi::accept_external(raw, &mut self.driver.backend, q, private) };
        if let Err(e) = r {
            let _ = self.driver.backend.destroy_qp(q);
            crate::cm_event::reject_raw(raw);
            return Err(e);
        }
        self.qp_of.insert(ev.id, q);
        Ok(q)
    }

    fn on_cm(&mut self, ev: CmEvent) {
        match ev.kind {
            CmEventKind::ConnectRequest => match self.sessions.admit(&ev) {
                Admission::Reject(why) => {
                    log(format!("rejected {why}"));
                    self.cm.reject(ev.id);
                }
                Admission::Accept { hello, private, source } => match self.accept(&ev, hello.role, &private) {
                    Ok(q) => self.sessions.accepted(ev.id, hello, source, q),
                    Err(e) => log(format!("accept of {:?} failed: {e}", hello.role)),
                },
            },
            CmEventKind::Established => {
                let Some(q) = self.qp_of.get(&ev.id).copied() else { return };
                let Some((nonce, mut qps, tenant)) = self.sessions.established(ev.id, q) else { return };
                let r = self.driver.create_loop_qps().and_then(|l| {
                    if let Some((a, f)) = l {
                        qps.alloc_loop = Some(a);
                        qps.free_loop = Some(f);
                    }
                    self.driver.connect_as(qps, tenant)
                });
                match r {
                    Ok(cn) => {
                        self.sessions.set_cn(nonce, cn);
                        log(format!("{cn} connected (session {nonce:#x}); its chains are armed in the NIC"));
                    }
                    Err(e) => {
                        log(format!("could not admit session {nonce:#x}: {e}"));
                        self.drop_session(nonce);
                    }
                }
            }
            CmEventKind::Disconnected | CmEventKind::Error(_) | CmEventKind::Rejected => {
                let Some(nonce) = self.sessions.nonce_of(ev.id) else { return };
                if let Some(cn) = self.sessions.get(nonce).and_then(|s| s.cn) {
                    let now = self.now();
                    if let Err(e) = self.driver.handle(now, Event::CnGone { cn }) {
                        log(format!("{cn} gone: {e}"));
                    }
                    log(format!("{cn} disconnected"));
                }
                self.drop_session(nonce);
            }
            _ => {}
        }
    }

    fn drop_session(&mut self, nonce: u64) {
        let Some(s) = self.sessions.remove(nonce) else { return };
        for q in s.qps() {
            let _ = self.driver.backend.destroy_qp(q);
        }
        let ids: Vec<_> = self.qp_of.iter().filter(|(_, q)| s.qps().any(|x| x == **q)).map(|(i, _)| *i).collect();
        for id in ids {
            self.qp_of.remove(&id);
            // SAFETY: an id this daemon accepted; its QP (ours, not rdma_cm's) is gone.
            unsafe {
                rdma_disconnect(id.0);
                rdma_destroy_id(id.0);
            }
        }
    }
}

impl Drop for DevxMnDaemon {
    fn drop(&mut self) {
        for (id, _) in self.qp_of.drain() {
            // SAFETY: ids this daemon accepted and still owns; destroyed once.
            unsafe {
                rdma_disconnect(id.0);
                rdma_destroy_id(id.0);
            }
        }
        self.cm.close();
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
