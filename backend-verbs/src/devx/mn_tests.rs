//! The MN daemon's loop (`crate::mn::MnDaemon`) on the DEVX transport, against the recording
//! mock and a scripted rdma_cm: admission, the external-QP accept (DEVX QP created with the
//! chain roles, connected with rdma_cm's attributes, accepted naming its number), a complete
//! session handed to the core with loop QPs of its own, a departure, a failed accept, teardown.
//! What this cannot show is rdma_cm or a ConnectX doing any of it (docs/MLX5.md).

use super::backend::{DevxBackend, DevxConfig};
use super::cm::{self, Accept, CmQpAttr, ExternalCm, LocalPath};
use super::mn::DevxTransport;
use super::mock::{Call, RecordingDevx};
use super::DevxError;
use crate::cm::{parse_rejoin_ticket, welcome, CmEvent, CmEventKind, CmId, Hello, Role};
use crate::mn::{MnDaemon, MnOptions, Sizing};
use omw_core::device::{Capabilities, DataPath, ExecutionMode, QpState};
use omw_core::ids::Qpn;
use omw_core::mlx5::prm::hca_cap::{self, atomic, HcaCaps};
use omw_core::mlx5::prm::{bits, qp as pq};
use omw_core::mn::plan::{MnOptions as PlanOptions, MnPlan};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

/// What the scripted connection manager was asked, and what it will answer.
#[derive(Default, Debug)]
struct Script {
    events: VecDeque<CmEvent>,
    pending: HashSet<CmId>,
    /// `rdma_init_qp_attr` answers [INIT, RTR, RTS] per request.
    attrs: HashMap<CmId, [CmQpAttr; 3]>,
    /// Requests whose `rdma_accept` fails.
    fail_accept: HashSet<CmId>,
    listening: Option<(SocketAddr, String)>,
    /// (id, qp_num, private data, responder resources, initiator depth, retry, RNR retry)
    accepted: Vec<(CmId, u32, Vec<u8>, [u8; 4])>,
    rejected: Vec<CmId>,
    /// The private data of each reject that carried any.
    refusals: Vec<(CmId, Vec<u8>)>,
    disconnected: Vec<CmId>,
}

#[derive(Debug)]
struct ScriptedCm(Rc<RefCell<Script>>);

impl ExternalCm for ScriptedCm {
    fn listen(&mut self, addr: SocketAddr, device: &str) -> crate::error::Result<()> {
        self.0.borrow_mut().listening = Some((addr, device.into()));
        Ok(())
    }
    fn poll(&mut self, _: Duration) -> crate::error::Result<Option<CmEvent>> {
        let mut s = self.0.borrow_mut();
        let ev = s.events.pop_front();
        if let Some(e) = ev.as_ref().filter(|e| e.kind == CmEventKind::ConnectRequest) {
            s.pending.insert(e.id);
        }
        Ok(ev)
    }
    fn qp_attrs(&mut self, id: CmId) -> Result<[CmQpAttr; 3], DevxError> {
        let s = self.0.borrow();
        assert!(s.pending.contains(&id), "rdma_init_qp_attr on a request that is not pending");
        Ok(s.attrs[&id])
    }
    fn accept(&mut self, id: CmId, a: &Accept<'_>) -> Result<(), DevxError> {
        let mut s = self.0.borrow_mut();
        assert!(s.pending.remove(&id), "rdma_accept of a request that is not pending");
        if s.fail_accept.contains(&id) {
            s.rejected.push(id);
            return Err(DevxError::Call { call: "rdma_accept", errno: libc::ECONNREFUSED });
        }
        let params = [a.responder_resources, a.initiator_depth, a.retry_count, a.rnr_retry_count];
        s.accepted.push((id, a.qp_num, a.private.to_vec(), params));
        Ok(())
    }
    fn reject_with(&mut self, id: CmId, private: &[u8]) {
        let mut s = self.0.borrow_mut();
        if s.pending.remove(&id) {
            s.rejected.push(id);
            if !private.is_empty() {
                s.refusals.push((id, private.to_vec()));
            }
        }
    }
    fn disconnect(&mut self, id: CmId) {
        self.0.borrow_mut().disconnected.push(id);
    }
}

const PDN: u32 = 0x51;
const G: u8 = 3;

fn caps() -> HcaCaps {
    HcaCaps {
        cd: true,
        imaicl: true,
        rc: true,
        atomic: true,
        atomic_operations: atomic::OPS_MASKED_FETCH_ADD as u16 | 0x3,
        atomic_size_qp: atomic::SIZE_8_BYTES as u16,
        atomic_8b_endianness_mode: atomic::REQ_MODE_HOST_ENDIANNESS,
        log_max_qp_sz: 15,
        log_max_cq_sz: 22,
        log_max_mkey: 24,
        log_max_msg: 30,
        umr_fence: 0,
        roce: true,
        sq_ts_format: 0,
        rq_ts_format: 0,
        roce_qp_ts_format: Some(hca_cap::TS_CAP_FREE_RUNNING_AND_REAL_TIME),
    }
}

type Daemon = MnDaemon<DevxTransport<RecordingDevx, ScriptedCm>>;

/// The DEVX MN daemon up on the mock: G = 3, 16 chunks of 4 KiB, 4 CNs, no lease.
fn daemon() -> (Daemon, Rc<RefCell<Script>>) {
    daemon_with_chains(1)
}

/// [`daemon`] admitting CNs of up to `alloc_chains` alloc chains.
fn daemon_with_chains(alloc_chains: u8) -> (Daemon, Rc<RefCell<Script>>) {
    let mut cfg = DevxConfig::new(Capabilities::OFFLOAD | Capabilities::MW_BOUNDS_ENFORCED);
    cfg.ring_arena_bytes = 16 << 20;
    cfg.log_cqes = 6;
    let b = DevxBackend::new(RecordingDevx::numbered(PDN), caps(), cfg).unwrap();
    let plan = MnPlan::decide(
        b.capabilities(),
        PlanOptions { mode: Some(ExecutionMode::Offloaded), allow_insecure: false, scrub: true },
    )
    .unwrap();
    let opts = MnOptions {
        device: Some("mlx5_0".into()),
        gid_index: None,
        listen: "192.0.2.1:7471".parse().unwrap(),
        pool_size: 16 * 4096,
        chunk_size: 4096,
        group_size: G,
        max_cns: 4,
        alloc_chains,
        quota: 0,
        insecure: false,
        stats_every: Duration::ZERO,
        scrub: true,
        metrics: None,
        stats_json: false,
        lease: Duration::ZERO,
        serial_engine: false,
        tenants: None,
        offload_profile: None,
        replays: Default::default(),
    };
    let script = Rc::new(RefCell::new(Script::default()));
    let t = DevxTransport::new(ScriptedCm(script.clone()), "mlx5_0");
    let d = MnDaemon::up(opts, t, b, plan, Sizing { chunks: 16, max_cns: 4 }, "mlx5_0").unwrap();
    (d, script)
}

fn id(n: usize) -> CmId {
    CmId(n as *mut rdma_sys::rdma_cm_id)
}

/// rdma_cm's attributes of a CN's connection to QP `peer` (its PSNs, no atomics, a finite RNR
/// retry), as `rdma_init_qp_attr` gives them per state.
fn attrs(peer: u32) -> [CmQpAttr; 3] {
    let mut gid = [0u8; 16];
    gid[10..].copy_from_slice(&[0xff, 0xff, 192, 0, 2, 9]);
    let path = LocalPath { port: 1, gid_index: 3, gid, mac: [2, 0, 0, 0, 0, 9], mtu: 3 };
    let a = CmQpAttr { qp_access_flags: 0x6, rq_psn: 0x11, ..CmQpAttr::to_self(&path, peer) };
    // each state answers for its own fields, and only those are set apart here
    let rtr = CmQpAttr { max_dest_rd_atomic: 8, max_rd_atomic: 0, retry_cnt: 0, rnr_retry: 0, ..a };
    let rts = CmQpAttr { sq_psn: 0x22, max_rd_atomic: 4, retry_cnt: 6, rnr_retry: 3, max_dest_rd_atomic: 0, ..a };
    [a, rtr, rts]
}

/// A CN's connection requests: session `nonce`, each role once, from 192.0.2.9.
fn request(s: &mut Script, cm_id: CmId, role: Role, nonce: u64, peer: u32) {
    request_chains(s, cm_id, Hello::new(role, nonce), peer)
}

/// [`request`] with this hello (a CN of several alloc chains).
fn request_chains(s: &mut Script, cm_id: CmId, hello: Hello, peer: u32) {
    s.attrs.insert(cm_id, attrs(peer));
    s.events.push_back(CmEvent {
        kind: CmEventKind::ConnectRequest,
        id: cm_id,
        status: 0,
        private_data: hello.encode(),
        remote_qpn: Qpn::new(peer).ok(),
        rnr_retry_count: 6,
        peer: Some("192.0.2.9".parse().unwrap()),
    });
}

fn event(s: &mut Script, cm_id: CmId, kind: CmEventKind) {
    s.events.push_back(CmEvent {
        kind,
        id: cm_id,
        status: 0,
        private_data: Vec::new(),
        remote_qpn: None,
        rnr_retry_count: 0,
        peer: None,
    });
}

const ROLES: [Role; 4] = [Role::Alloc, Role::Free, Role::Access(0), Role::Access(1)];

fn roles_of(input: &[u8]) -> (u64, u64, u64) {
    let f = |fl: omw_core::mlx5::prm::Field| bits::get(input, fl.at(pq::QPC_BASE)).unwrap();
    (f(pq::qpc::CD_MASTER), f(pq::qpc::CD_SLAVE_SEND), f(pq::qpc::CD_SLAVE_RECEIVE))
}

/// One CN's four connections requested and established: its CN id.
fn connect_cn(d: &mut Daemon, s: &Rc<RefCell<Script>>, nonce: u64, first_id: usize) {
    for (k, r) in ROLES.iter().enumerate() {
        request(&mut s.borrow_mut(), id(first_id + k), *r, nonce, 0x900 + k as u32);
    }
    d.step().unwrap();
    for k in 0..ROLES.len() {
        event(&mut s.borrow_mut(), id(first_id + k), CmEventKind::Established);
    }
    d.step().unwrap();
}

#[test]
fn the_daemon_accepts_a_cn_into_devx_qps_and_arms_its_chains() {
    let (mut d, s) = daemon();
    assert_eq!(d.mode, ExecutionMode::Offloaded);
    assert_eq!(s.borrow().listening, Some(("192.0.2.1:7471".parse().unwrap(), "mlx5_0".into())));
    let creates_before = d.driver.backend.device().inputs("CREATE_QP").len();
    // a request without a hello is refused, the CN's four are accepted
    event(&mut s.borrow_mut(), id(0x99), CmEventKind::ConnectRequest);
    s.borrow_mut().pending.insert(id(0x99));
    for (k, r) in ROLES.iter().enumerate() {
        request(&mut s.borrow_mut(), id(0x10 + k), *r, 0xabc, 0x900 + k as u32);
    }
    d.step().unwrap();
    let accepted = s.borrow().accepted.clone();
    assert_eq!(s.borrow().rejected, [id(0x99)]);
    assert_eq!(accepted.len(), 4);
    let dev = d.driver.backend.device();
    // one DEVX QP per connection: the management QPs with all three CORE-Direct roles
    let creates = dev.inputs("CREATE_QP")[creates_before..].to_vec();
    assert_eq!(creates.iter().map(|i| roles_of(i)).collect::<Vec<_>>(), [(1, 1, 1), (1, 1, 1), (0, 0, 0), (0, 0, 0)]);
    for (k, (cm_id, qp_num, private, params)) in accepted.iter().enumerate() {
        assert_eq!(*cm_id, id(0x10 + k));
        // the accept names the DEVX QP, connected (RTS) before rdma_accept
        let q = Qpn::new(*qp_num).unwrap();
        assert_eq!(d.driver.backend.qp_state(q).unwrap(), QpState::Rts);
        // … with exactly rdma_cm's attributes and the next hop's MAC (the mock's: from the GID)
        let [init, rtr, rts] = attrs(0x900 + k as u32);
        let a = cm::merge_states(&init, &rtr, &rts);
        let modify = |c: &str| -> Vec<u8> {
            dev.inputs(c).into_iter().find(|i| i[9..12] == qp_num.to_be_bytes()[1..]).expect(c).to_vec()
        };
        let rtr_in = pq::init2rtr_in(&cm::init2rtr(*qp_num, &a, 30, [0x02, 0, 192, 0, 2, 9])).unwrap();
        assert_eq!(modify("INIT2RTR_QP"), rtr_in);
        assert_eq!(modify("RTR2RTS_QP"), pq::rtr2rts_in(&cm::rtr2rts(*qp_num, &a)).unwrap());
        assert_eq!(bits::get(&rtr_in, pq::qpc::REMOTE_QPN.at(pq::QPC_BASE)).unwrap(), 0x900 + k as u64);
        // the Alloc connection's reply tells the CN the group size; what rdma_cm negotiated
        // goes back as it came
        if k == 0 {
            let ticket = parse_rejoin_ticket(private).expect("the welcome names the rejoin ticket");
            assert_eq!(private[..], welcome(G, ticket)[..]);
        } else {
            assert!(private.is_empty());
        }
        assert_eq!(*params, [rtr.max_dest_rd_atomic, rts.max_rd_atomic, rts.retry_cnt, rts.rnr_retry]);
        assert_eq!(*params, [8, 4, 6, 3]);
    }
    drop(dev);
    assert_eq!(d.driver.mn.cns().count(), 0, "no CN before every connection is established");
    // established: the session is complete, the MN makes its loop QPs and arms both chains
    let creates_before = d.driver.backend.device().inputs("CREATE_QP").len();
    for k in 0..4 {
        event(&mut s.borrow_mut(), id(0x10 + k), CmEventKind::Established);
    }
    d.step().unwrap();
    assert_eq!(d.driver.mn.cns().count(), 1);
    let cn = d.driver.mn.cns().next().unwrap();
    let qps = cn.qps.clone();
    assert_eq!(
        [qps.alloc.get(), qps.free.get(), qps.access[0].get(), qps.access[1].get()],
        [accepted[0].1, accepted[1].1, accepted[2].1, accepted[3].1]
    );
    let loops =
        d.driver.backend.device().inputs("CREATE_QP")[creates_before..].iter().map(|i| roles_of(i)).collect::<Vec<_>>();
    assert_eq!(loops.iter().filter(|r| **r == (1, 1, 0)).count(), 2, "two loop QPs (master + slave_send): {loops:?}");
    for q in [qps.alloc_loop.unwrap(), qps.free_loop.unwrap()] {
        assert_eq!(d.driver.backend.qp_state(q).unwrap(), QpState::Rts);
    }
    assert!(d.driver.backend.device().calls.iter().any(|c| matches!(c, Call::WriteUar { .. })), "chains rung");
    let nonce = d.sessions().nonce_of(id(0x10)).unwrap();
    assert_eq!(d.sessions().get(nonce).and_then(|x| x.cn), Some(cn.cn));
    // the CN leaves: the MN takes its chunks back, its QPs and connections go
    event(&mut s.borrow_mut(), id(0x11), CmEventKind::Disconnected);
    d.step().unwrap();
    assert_eq!(d.driver.mn.cns().count(), 0);
    assert!(d.sessions().get(nonce).is_none());
    let mut gone = s.borrow().disconnected.clone();
    gone.sort_by_key(|i| i.0 as usize);
    assert_eq!(gone, [id(0x10), id(0x11), id(0x12), id(0x13)]);
    for (_, q, _, _) in &accepted {
        assert!(d.driver.backend.qp_state(Qpn::new(*q).unwrap()).is_err(), "QP {q:#x} destroyed");
    }
    assert_eq!(d.counters().cns, 0);
}

/// A CN of two alloc chains on the offloaded MN: its second Alloc QP is a management QP like
/// the first, the MN makes a third loop QP for it and connects the CN with both chains armed;
/// its departure destroys all of it. A CN asking for three is refused on its first connection
/// with the reason in the reject.
#[test]
fn a_cn_of_two_alloc_chains_gets_a_loop_qp_per_chain_and_three_are_refused() {
    use crate::cm::Refusal;
    let (mut d, s) = daemon_with_chains(2);
    let roles = [Role::Alloc, Role::Free, Role::Access(0), Role::Access(1), Role::AllocChain(1)];
    let creates_before = d.driver.backend.device().inputs("CREATE_QP").len();
    for (k, r) in roles.iter().enumerate() {
        let h = Hello { role: *r, alloc_chains: 2, nonce: 0xc4, auth: None, rejoin: None };
        request_chains(&mut s.borrow_mut(), id(0x50 + k), h, 0x900 + k as u32);
    }
    d.step().unwrap();
    let accepted = s.borrow().accepted.clone();
    assert_eq!(accepted.len(), 5);
    let created =
        d.driver.backend.device().inputs("CREATE_QP")[creates_before..].iter().map(|i| roles_of(i)).collect::<Vec<_>>();
    assert_eq!(
        created,
        [(1, 1, 1), (1, 1, 1), (0, 0, 0), (0, 0, 0), (1, 1, 1)],
        "the extra Alloc QP is a management QP"
    );
    let creates_before = d.driver.backend.device().inputs("CREATE_QP").len();
    for k in 0..roles.len() {
        event(&mut s.borrow_mut(), id(0x50 + k), CmEventKind::Established);
    }
    d.step().unwrap();
    let cn = d.driver.mn.cns().next().expect("the CN connected").clone();
    assert_eq!(cn.extra_alloc.len(), 1);
    let chain = cn.extra_alloc[0];
    assert_eq!(chain.mgmt.get(), accepted[4].1);
    let loops =
        d.driver.backend.device().inputs("CREATE_QP")[creates_before..].iter().map(|i| roles_of(i)).collect::<Vec<_>>();
    assert_eq!(loops.iter().filter(|r| **r == (1, 1, 0)).count(), 3, "a loop QP per chain: {loops:?}");
    let lp = chain.lp.expect("offloaded: the extra chain has its loop QP");
    assert_eq!(d.driver.backend.qp_state(lp).unwrap(), QpState::Rts);
    // a CN asking for three: refused at once, told why; no session, no QP
    let accepted_before = s.borrow().accepted.len();
    let h = Hello { role: Role::Alloc, alloc_chains: 3, nonce: 0xc5, auth: None, rejoin: None };
    request_chains(&mut s.borrow_mut(), id(0x60), h, 0x990);
    d.step().unwrap();
    assert_eq!(s.borrow().accepted.len(), accepted_before);
    let (who, private) = s.borrow().refusals.last().cloned().expect("a reject with a reason");
    assert_eq!(who, id(0x60));
    assert_eq!(Refusal::decode(&private), Some(Refusal::AllocChains { allowed: 2, asked: 3 }));
    assert!(d.sessions().nonce_of(id(0x60)).is_none());
    assert_eq!(d.counters().rejected_limit, 1);
    // the CN of two leaves: every QP of it goes, the extra chain's loop QP too
    event(&mut s.borrow_mut(), id(0x51), CmEventKind::Disconnected);
    d.step().unwrap();
    assert_eq!(d.driver.mn.cns().count(), 0);
    for q in [chain.mgmt, lp] {
        assert!(d.driver.backend.qp_state(q).is_err(), "QP {q} destroyed");
    }
    d.driver.check_invariants().unwrap();
}

#[test]
fn a_failed_accept_leaves_no_qp_and_refuses_the_request() {
    let (mut d, s) = daemon();
    s.borrow_mut().fail_accept.insert(id(0x20));
    request(&mut s.borrow_mut(), id(0x20), Role::Alloc, 0x77, 0x900);
    d.step().unwrap();
    let dev = d.driver.backend.device();
    let created = dev
        .calls
        .iter()
        .filter_map(|c| match c {
            Call::ObjCreate { command: "CREATE_QP", obj, .. } => Some(*obj),
            _ => None,
        })
        .next_back()
        .unwrap();
    assert!(dev.calls.contains(&Call::ObjDestroy(created)), "the DEVX QP of the failed accept is destroyed");
    drop(dev);
    assert_eq!(s.borrow().rejected, [id(0x20)]);
    assert!(s.borrow().accepted.is_empty());
    assert!(d.sessions().nonce_of(id(0x20)).is_none(), "no session remembers it");
    // the next CN is served as if nothing happened
    connect_cn(&mut d, &s, 0x78, 0x30);
    assert_eq!(d.driver.mn.cns().count(), 1);
}

#[test]
fn dropping_the_daemon_ends_every_connection() {
    let (mut d, s) = daemon();
    connect_cn(&mut d, &s, 0x5, 0x40);
    assert_eq!(d.driver.mn.cns().count(), 1);
    assert!(s.borrow().disconnected.is_empty());
    drop(d);
    let mut gone = s.borrow().disconnected.clone();
    gone.sort_by_key(|i| i.0 as usize);
    assert_eq!(gone, [id(0x40), id(0x41), id(0x42), id(0x43)]);
}

/// The chains' needs against device profiles: without one every answer is unknown and the
/// refusal names the first question and the tool that answers it; an answer the chains cannot
/// run under is refused naming it; the paper's behaviour is accepted.
#[test]
fn start_up_takes_the_chains_answers_from_the_profile() {
    use super::mn::chain_answers;
    use super::profile::{Profile, Timestamp};
    use omw_core::chain::variant::ChainVariant;
    use omw_core::device::behaviour::{DeviceAnswers, DeviceBehaviour, ForeignBind, Question, WaitPrefetch};
    // some layout tolerates either prefetch answer and either receive answer: the first
    // question that must be answered is the SEND_EN unit, which layouts exist for either way
    let e = chain_answers(None).unwrap_err();
    assert!(
        matches!(&e, DevxError::Unsuited { question: Question::SendEnUnit, answer: None, tolerated } if tolerated[..] == ["wqebb", "wqe"]),
        "{e:?}"
    );
    let s = e.to_string();
    assert!(s.contains("send_en_unit = wqebb or wqe") && s.contains("omw-mlx5-bringup questions"), "{s}");
    let profile = |answers| Profile {
        device: "mlx5_0".into(),
        firmware: "16.35.2000".into(),
        date: Timestamp::from_unix(0),
        answers,
        recv_publish: None,
        unchecked_unbind: Some(omw_core::device::behaviour::UncheckedUnbind::Honoured),
    };
    let paper = profile(DeviceAnswers::exactly(DeviceBehaviour::PAPER));
    assert_eq!(chain_answers(Some(&paper)).unwrap(), (paper.answers, ChainVariant::WQEBB_ENABLES));
    // the unbinds every layout and the MN itself rest on: refused or not known, no offload
    for (u, says) in [
        (None, "no device profile says"),
        (Some(omw_core::device::behaviour::UncheckedUnbind::Refused), "unchecked_unbind = refused"),
    ] {
        let p = Profile { unchecked_unbind: u, ..paper.clone() };
        let e = chain_answers(Some(&p)).unwrap_err();
        assert!(matches!(e, DevxError::UncheckedUnbind(x) if x == u), "{e:?}");
        assert!(e.to_string().contains(says) && e.to_string().contains("without --offload"), "{e}");
    }
    // a device counting SEND_EN in WQEs gets the variant laid out in WQEs
    let in_wqes = profile(DeviceAnswers {
        send_en_unit: Some(omw_core::device::behaviour::SendEnUnit::Wqe),
        ..DeviceAnswers::exactly(DeviceBehaviour::PAPER)
    });
    assert_eq!(chain_answers(Some(&in_wqes)).unwrap().1, ChainVariant::WQE_ENABLES);
    // every question the chains depend on settled but the bind's: the layout that binds to the
    // poster, correct whatever the answer; the prefetch answer left open does not matter
    let open_bind = profile(DeviceAnswers {
        wait_prefetch: Some(WaitPrefetch::FetchesPast),
        foreign_bind: None,
        ..DeviceAnswers::exactly(DeviceBehaviour::PAPER)
    });
    assert_eq!(chain_answers(Some(&open_bind)).unwrap().1, ChainVariant::WQEBB_ENABLES.binding_to_poster());
    let open_prefetch =
        profile(DeviceAnswers { wait_prefetch: None, ..DeviceAnswers::exactly(DeviceBehaviour::PAPER) });
    assert!(chain_answers(Some(&open_prefetch)).is_ok());
    // a bind naming another QP refused or redirected: the layout that binds to the poster
    for fb in [ForeignBind::Refused, ForeignBind::BoundToPoster] {
        let p = profile(DeviceAnswers { foreign_bind: Some(fb), ..paper.answers });
        assert_eq!(chain_answers(Some(&p)).unwrap().1, ChainVariant::WQEBB_ENABLES.binding_to_poster(), "{fb:?}");
    }
    // the SEND_EN unit left open: no layout tolerates it, refused naming the question
    let open_unit = profile(DeviceAnswers { send_en_unit: None, ..paper.answers });
    let e = chain_answers(Some(&open_unit)).unwrap_err();
    assert!(matches!(&e, DevxError::Unsuited { question: Question::SendEnUnit, answer: None, .. }), "{e:?}");
    assert!(e.to_string().contains("without --offload"), "{e}");
    // every behaviour a layout accepts is one chain_answers starts on, every other refused
    for b in DeviceBehaviour::ALL {
        assert_eq!(
            chain_answers(Some(&profile(DeviceAnswers::exactly(b)))).is_ok(),
            ChainVariant::choose(&DeviceAnswers::exactly(b)).is_ok(),
            "{b:?}"
        );
    }
}

/// The remote QPN each `INIT2RTR_QP` of QP `qp` named, in order.
fn init2rtr_remotes(d: &Daemon, qp: Qpn) -> Vec<u64> {
    let dev = d.driver.backend.device();
    dev.inputs("INIT2RTR_QP")
        .into_iter()
        .filter(|i| i[9..12] == qp.get().to_be_bytes()[1..])
        .map(|i| bits::get(i, pq::qpc::REMOTE_QPN.at(pq::QPC_BASE)).unwrap())
        .collect()
}

/// A CN whose Alloc connection broke rejoins it with its session's ticket (`crate::rejoin`):
/// the MN repairs the alloc chain — its management QP reset and connected on the new
/// request's path — and accepts the request naming the same QP, with the welcome again; the
/// old connection ends without the CN's departure (nothing reclaimed, the session and CN
/// stay). A wrong ticket, a rejoin of an access QP and a rejoin from another address are
/// refused without touching anything; the CN rejoins again later on the new connection.
#[test]
fn a_cn_rejoins_its_alloc_connection_without_losing_its_session() {
    let (mut d, s) = daemon();
    connect_cn(&mut d, &s, 0xabc, 0x10);
    let (cn, mgmt) = {
        let r = d.driver.mn.cns().next().unwrap();
        (r.cn, r.qps.alloc)
    };
    let ticket = parse_rejoin_ticket(&s.borrow().accepted[0].2).unwrap();
    let reclaimed = d.driver.mn.stats().groups_reclaimed;
    let resets = |d: &Daemon, q: Qpn| {
        d.driver.backend.device().inputs("2RST_QP").iter().filter(|i| i[9..12] == q.get().to_be_bytes()[1..]).count()
    };
    let resets_before = resets(&d, mgmt);
    let uar_before = d.driver.backend.device().calls.iter().filter(|c| matches!(c, Call::WriteUar { .. })).count();
    assert_eq!(init2rtr_remotes(&d, mgmt), [0x900]);
    // refused: a wrong ticket, an access QP, another host; nothing is touched
    request_chains(&mut s.borrow_mut(), id(0x30), Hello::rejoin(Role::Alloc, 1, 0xabc, ticket ^ 1), 0xa00);
    request_chains(&mut s.borrow_mut(), id(0x31), Hello::rejoin(Role::Access(0), 1, 0xabc, ticket), 0xa01);
    d.step().unwrap();
    let mut elsewhere = CmEvent {
        kind: CmEventKind::ConnectRequest,
        id: id(0x32),
        status: 0,
        private_data: Hello::rejoin(Role::Alloc, 1, 0xabc, ticket).encode(),
        remote_qpn: Qpn::new(0xa02).ok(),
        rnr_retry_count: 6,
        peer: Some("192.0.2.66".parse().unwrap()),
    };
    s.borrow_mut().attrs.insert(id(0x32), attrs(0xa02));
    s.borrow_mut().events.push_back(elsewhere.clone());
    d.step().unwrap();
    assert_eq!(s.borrow().rejected, [id(0x30), id(0x31), id(0x32)]);
    assert!(s.borrow().refusals.is_empty(), "a bad rejoin learns nothing");
    assert_eq!(init2rtr_remotes(&d, mgmt), [0x900]);
    assert_eq!(resets(&d, mgmt), resets_before);
    // the rejoin: the chain repaired, the QP on the new path, the same QP accepted
    request_chains(&mut s.borrow_mut(), id(0x40), Hello::rejoin(Role::Alloc, 1, 0xabc, ticket), 0xb00);
    d.step().unwrap();
    assert_eq!(resets(&d, mgmt), resets_before + 1, "the chain was repaired: its management QP reset");
    assert_eq!(init2rtr_remotes(&d, mgmt), [0x900, 0xb00], "connected to the CN's new QP");
    assert_eq!(d.driver.backend.qp_state(mgmt).unwrap(), QpState::Rts);
    let (acc_id, acc_qp, acc_private, _) = s.borrow().accepted.last().cloned().unwrap();
    assert_eq!((acc_id, acc_qp), (id(0x40), mgmt.get()));
    assert_eq!(acc_private[..], welcome(G, ticket)[..]);
    let uar_after = d.driver.backend.device().calls.iter().filter(|c| matches!(c, Call::WriteUar { .. })).count();
    assert!(uar_after > uar_before, "the chain re-armed and rung");
    assert_eq!(s.borrow().disconnected, [id(0x10)], "only the old connection ended");
    assert_eq!((d.driver.mn.cns().count(), d.driver.mn.stats().groups_reclaimed), (1, reclaimed));
    assert_eq!(d.counters().rejoins, 1);
    let nonce = d.sessions().nonce_of(id(0x40)).unwrap();
    assert_eq!(d.sessions().get(nonce).and_then(|x| x.cn), Some(cn));
    assert_eq!(d.sessions().nonce_of(id(0x10)), None);
    // the old connection's DISCONNECTED (rdma_disconnect's echo) is no departure
    event(&mut s.borrow_mut(), id(0x10), CmEventKind::Disconnected);
    // the new connection's ESTABLISHED completes nothing again
    event(&mut s.borrow_mut(), id(0x40), CmEventKind::Established);
    d.step().unwrap();
    assert_eq!(d.driver.mn.cns().count(), 1);
    // the same ticket rejoins again, replacing the new connection
    request_chains(&mut s.borrow_mut(), id(0x41), Hello::rejoin(Role::Alloc, 1, 0xabc, ticket), 0xc00);
    d.step().unwrap();
    assert_eq!(init2rtr_remotes(&d, mgmt), [0x900, 0xb00, 0xc00]);
    assert_eq!(s.borrow().disconnected, [id(0x10), id(0x40)]);
    // the Free connection rejoins the same way
    let free = d.driver.mn.cns().next().unwrap().qps.free;
    request_chains(&mut s.borrow_mut(), id(0x42), Hello::rejoin(Role::Free, 1, 0xabc, ticket), 0xd00);
    d.step().unwrap();
    assert_eq!(init2rtr_remotes(&d, free), [0x901, 0xd00]);
    assert_eq!(d.counters().rejoins, 3);
    // the CN leaving on its newest connection is its departure
    event(&mut s.borrow_mut(), id(0x41), CmEventKind::Disconnected);
    d.step().unwrap();
    assert_eq!(d.driver.mn.cns().count(), 0);
    elsewhere.id = id(0x43);
    s.borrow_mut().events.push_back(elsewhere);
    d.step().unwrap();
    assert_eq!(s.borrow().rejected.last(), Some(&id(0x43)), "no session to rejoin any more");
}
