//! Set-up on a real device (soft-RoCE in the VM): the port query and GID choice, a forced GID
//! index, the teardown fallback to deallocating a window, rdma_cm events of other ids kept
//! while a connect waits, and the remote QP numbers rdma_cm negotiated. Skipped unless OMW_RXE
//! is set.

mod common;
use common::*;
use omw_core::access::AccessFlags;
use omw_core::device::{DataPath, Provision};
use omw_core::wire::wqe::Wqe;
use omw_verbs::cm::{CmEventKind, Hello, Role};
use omw_verbs::device::DeviceChoice;
use omw_verbs::port::{GidType, LinkLayer, PortError};
use omw_verbs::{VerbsBackend, VerbsError};
use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(5);

#[test]
fn port_and_gid_choice_on_rxe() {
    if !rxe() {
        return;
    }
    let b = VerbsBackend::open(Some(&device())).expect("open device");
    let p = b.port_attr();
    assert_eq!(p.link_layer, LinkLayer::Ethernet, "soft-RoCE is RoCE");
    assert!(p.state.is_active(), "{p:?}");
    assert!(p.active_mtu.is_some(), "{p:?}");
    let g = b.gid();
    println!("port {p:?}, chosen GID {g:?}");
    assert!(g.is_ipv4_mapped(), "the IPv4 GID, not fe80:: (which fails to reach RTR)");
    assert_ne!(g.gid_type, GidType::RoceV1, "RoCE v2 is preferred whenever the table has it");
    let forced = g.index;
    drop(b);
    // the same index forced works; a loopback pair connects with it
    let mut b = VerbsBackend::open_choice(&DeviceChoice { device: Some(device()), gid_index: Some(forced) }).unwrap();
    assert_eq!(b.gid_index(), forced);
    b.create_loopback_pair().expect("loopback pair with the forced GID");
    drop(b);
    // an empty index is refused with the valid ones listed
    let e = VerbsBackend::open_choice(&DeviceChoice { device: Some(device()), gid_index: Some(200) }).unwrap_err();
    assert!(matches!(e, VerbsError::Port(PortError::GidIndexInvalid { index: 200, .. })), "{e}");
    assert!(e.to_string().contains(&forced.to_string()), "{e}");
    // auto-pick finds the same device by its port state
    let a = VerbsBackend::open(None).unwrap();
    assert_eq!(a.device_name(), device());
}

/// A window whose invalidation fails at teardown is deallocated instead of left bound.
#[test]
fn teardown_falls_back_to_dealloc() {
    if !rxe() {
        return;
    }
    let mut b = VerbsBackend::open(Some(&device())).unwrap();
    let own = b.alloc_region(1 << 16, 4096).unwrap();
    let k = b
        .reg_mr(omw_core::device::Domain::CnFacing, own, 1 << 16, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)
        .unwrap();
    let mw = b.alloc_mw().unwrap();
    let (q1, _q2) = b.create_loopback_pair().unwrap();
    let new = mw.next_key();
    let w = Wqe::bind_mw(new.0, own, 4096, k.lkey, q1.get(), AccessFlags::DATA_WINDOW).with_wr_id(5);
    assert!(b.post_wait(q1, &w, T).unwrap().status.is_ok());
    assert!(b.mw_state(mw).unwrap().1.is_some(), "bound");
    b.fail_teardown_invalidation_for_tests();
    let t = Instant::now();
    b.destroy_qp(q1).unwrap();
    println!("QP with a bound window destroyed in {:?}", t.elapsed());
    assert_eq!(b.lost_windows(), &[new], "deallocated, recorded with its last key");
    assert!(b.mw_state(mw).is_none(), "gone from the table");
    // binding it again is a typed error, not a crash
    let (q3, _) = b.create_loopback_pair().unwrap();
    let w = Wqe::bind_mw(new.next_key().0, own, 4096, k.lkey, q3.get(), AccessFlags::DATA_WINDOW).with_wr_id(6);
    assert!(matches!(b.post_send(q3, &w), Err(VerbsError::UnknownMw(_))));
}

fn addr(port: u16) -> SocketAddr {
    format!("{}:{port}", std::env::var("OMW_SELF_IP").unwrap_or_else(|_| "192.0.2.1".into())).parse().unwrap()
}

/// While a connect waits for its ESTABLISHED, a DISCONNECTED of an earlier connection arrives:
/// it is kept for `poll_cm`, not dropped. The remote QP numbers rdma_cm negotiated match on
/// both sides.
#[test]
fn cm_events_of_other_ids_are_kept_and_remote_qpns_match() {
    if !rxe() {
        return;
    }
    let a = addr(7481);
    let (to_mn, mn_rx) = mpsc::channel::<()>();
    let (mn_tx, from_mn) = mpsc::channel::<Vec<(u32, Option<u32>)>>();
    let (ready_tx, ready) = mpsc::channel::<()>();
    let mn = std::thread::spawn(move || {
        let mut l = VerbsBackend::open(Some(&device())).unwrap();
        l.listen(a, 8).unwrap();
        ready_tx.send(()).unwrap();
        let mut seen = Vec::new(); // (MN QP, remote QPN from the request)
        let mut established = 0;
        let deadline = Instant::now() + Duration::from_secs(30);
        while established < 2 && Instant::now() < deadline {
            let Some(ev) = l.poll_cm(Duration::from_millis(50)).unwrap() else { continue };
            match ev.kind {
                CmEventKind::ConnectRequest => {
                    let q = l.accept(ev.id, &[]).unwrap();
                    seen.push((q.get(), ev.remote_qpn.map(|r| r.get())));
                }
                CmEventKind::Established => {
                    established += 1;
                    if established == 1 {
                        // drop the first connection before the second is accepted
                        mn_rx.recv().unwrap();
                        let q = omw_core::ids::Qpn::new(seen[0].0).unwrap();
                        l.destroy_qp(q).unwrap();
                    }
                }
                _ => {}
            }
        }
        mn_tx.send(seen).unwrap();
        std::thread::sleep(Duration::from_secs(1));
    });
    ready.recv().unwrap();
    let mut c = VerbsBackend::open(Some(&device())).unwrap();
    let h = Hello::new(Role::Alloc, 1);
    let c1 = c.connect(a, &h, Duration::from_secs(20), |_, _| Ok(())).unwrap();
    to_mn.send(()).unwrap();
    let c2 = c.connect(a, &Hello::new(Role::Free, 1), Duration::from_secs(20), |_, _| Ok(())).unwrap();
    // c1's DISCONNECTED: kept in the backlog (or still on the channel), never lost
    let t = Instant::now();
    let mut got = false;
    while !got && t.elapsed() < Duration::from_secs(10) {
        if let Some(ev) = c.poll_cm(Duration::from_millis(100)).unwrap() {
            got = ev.kind == CmEventKind::Disconnected && c.qp_of_id(ev.id) == Some(c1.qp);
        }
    }
    assert!(got, "the first connection's DISCONNECTED reached poll_cm");
    let seen = from_mn.recv().unwrap();
    mn.join().unwrap();
    // each side knows the other's QP number
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].1, Some(c1.qp.get()), "MN saw the CN's QP in the request");
    assert_eq!(seen[1].1, Some(c2.qp.get()));
    assert_eq!(c1.remote_qpn.map(|q| q.get()), Some(seen[0].0), "CN knows the MN's QP");
    assert_eq!(c2.remote_qpn.map(|q| q.get()), Some(seen[1].0));
}

/// `omw mn --offload mlx5` on soft-RoCE: the DEVX gate refuses before anything is probed or
/// pinned, with the reason (a build with `devx`: rxe0 is not an mlx5 device, through the real
/// `ibv_get_device_list` / `mlx5dv_is_supported`; without it: rebuild with the feature), and
/// the process exits 1 — no silent fallback to the host engine.
#[test]
fn offload_mlx5_refuses_on_a_device_that_is_not_a_connectx() {
    if !rxe() {
        return;
    }
    let out = std::process::Command::new(node())
        .args(["mn", "--device", &device(), "--listen", "192.0.2.1:7499", "--pool-size", "65536"])
        .args(["--chunk-size", "4096", "--offload", "mlx5"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("omw mn: error: --offload mlx5: "), "{err}");
    // scripts/rxe-test builds omw with devx: the real device list says why
    assert!(
        err.contains("not an mlx5") || (std::env::var_os("OMW_NODE_BIN").is_none() && err.contains("--features devx")),
        "{err}"
    );
    assert!(!err.contains("listening on"), "{err}");
}

/// A CN repeating a role within its session: the MN daemon rejects the second connection
/// (accepting it would replace, and leak, the first QP — a CN repeating it could pin MN
/// memory without end); the session's other roles are still accepted.
#[test]
fn the_mn_accepts_each_role_of_a_session_once() {
    if !rxe() {
        return;
    }
    let (mn, a) = Mn::start_local(7482, &[]);
    mn.wait_log("listening on");
    let a: SocketAddr = a.parse().unwrap();
    let mut c = VerbsBackend::open(Some(&device())).unwrap();
    let h = Hello::new(Role::Alloc, 0x5e55);
    c.connect(a, &h, Duration::from_secs(20), |_, _| Ok(())).unwrap();
    let again = c.connect(a, &h, Duration::from_secs(20), |_, _| Ok(()));
    assert!(matches!(again, Err(VerbsError::PeerUnreachable { .. })), "{again:?}");
    c.connect(a, &Hello::new(Role::Free, 0x5e55), Duration::from_secs(20), |_, _| Ok(())).unwrap();
    mn.wait_log("that connection exists already");
    mn.stop();
}
