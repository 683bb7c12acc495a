//! Memory-window semantics (DESIGN.md §3) as scenarios every device runs: bind, QP association,
//! invalidation (local, remote), rebinding with the next key, bind errors, rights and bounds —
//! strict, or with soft-RoCE's deviations where the device declares `RXE_MW`. Moved from the
//! three copies that tested them with three fixtures: backend-loopback/tests/mw.rs, FPGA
//! ext_mw.rs and verbs rxe_mw.rs (each keeps what is about its own device only).
//!
//! A device is an [`MwDevice`]: an MN side, whose pool windows bind into, and a CN side that
//! makes requests (on loopback and the FPGA double two nodes, on verbs one device with loopback
//! pairs); every step uses a fresh pair, so no scenario needs to revive a QP.

use crate::runner::{run_items, Failure, Outcome, Summary};
use crate::testbed::Caps;
use omw_core::access::AccessFlags;
use omw_core::device::{Completion, MwBinding, QpState, WcOpcode, WcStatus};
use omw_core::ids::{Qpn, Rkey};
use omw_core::wire::wqe::{RecvWqe, Sge, Wqe};

/// Bytes of the pool an [`MwDevice`] registers (filled with `b'o'`).
pub const POOL_LEN: u64 = 64 << 10;
/// Bytes of the requester's buffer.
pub const BUF_LEN: u64 = 4096;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Side {
    /// Where the pool and its windows live.
    Mn,
    /// The requester.
    Cn,
}

/// A device under test for the window rules (the role of rxe_differential.rs's `Dut`, object
/// safe and with two sides).
pub trait MwDevice {
    /// `STRICT_MW` or `RXE_MW`.
    fn caps(&self) -> Caps;
    /// A fresh connected pair: (its MN end — windows bind to it —, its CN end, the requester).
    fn pair(&mut self) -> (Qpn, Qpn);
    fn alloc_mw(&mut self) -> Rkey;
    /// The pool (MN side, `POOL_LEN` bytes, LOCAL_WRITE | MW_BIND): address, lkey, rkey.
    fn pool(&self) -> (u64, u32, u32);
    /// The requester's buffer (CN side, LOCAL_WRITE): address, lkey.
    fn buf(&self) -> (u64, u32);
    /// Post on a QP of `side` and wait for its completion (None: refused at post, or none came).
    fn post(&mut self, side: Side, qp: Qpn, w: &Wqe) -> Option<Completion>;
    fn post_recv(&mut self, side: Side, qp: Qpn, r: &RecvWqe);
    fn wait_recv(&mut self, side: Side, qp: Qpn) -> Option<Completion>;
    fn state(&mut self, side: Side, qp: Qpn) -> QpState;
    fn read_local(&mut self, side: Side, addr: u64, len: usize) -> Vec<u8>;
    fn write_local(&mut self, side: Side, addr: u64, data: &[u8]);
    fn binding(&mut self, rkey: Rkey) -> Option<MwBinding>;
}

/// How a backend starts devices (a fresh one per scenario).
pub trait MwFactory {
    fn name(&self) -> String;
    fn caps(&self) -> Caps;
    fn start(&self) -> Box<dyn MwDevice>;
}

#[derive(Clone, Copy)]
pub struct MwScenario {
    pub name: &'static str,
    pub needs: Caps,
    pub run: fn(&mut dyn MwDevice) -> Outcome,
}

pub const LIST: &[MwScenario] = &[
    MwScenario { name: "mw::a_window_works_only_through_its_qp", needs: Caps::NONE, run: only_its_qp },
    MwScenario { name: "mw::local_invalidate_on_the_bound_qp_kills_the_key", needs: Caps::NONE, run: invalidate },
    MwScenario { name: "mw::rebind_with_the_next_key_and_the_stale_key_is_dead", needs: Caps::NONE, run: rebind },
    MwScenario { name: "mw::binding_a_bound_window_is_a_bind_error", needs: Caps::NONE, run: bind_bound },
    MwScenario { name: "mw::a_read_only_window_refuses_writes", needs: Caps::NONE, run: read_only },
    MwScenario { name: "mw::window_bounds_strict_versus_rxe", needs: Caps::NONE, run: bounds },
    MwScenario {
        name: "mw::local_invalidate_from_another_qp_strict_versus_rxe",
        needs: Caps::NONE,
        run: inv_elsewhere,
    },
    MwScenario { name: "mw::send_with_invalidate_invalidates_remotely", needs: Caps::NONE, run: send_with_inv },
];

/// Run every MW scenario on devices from `f`; panics if one failed.
pub fn conform_mw(f: &dyn MwFactory) -> Summary {
    let s = run_items(&f.name(), f.caps(), LIST, |sc| (sc.name, sc.needs), |sc| (sc.run)(&mut *f.start()));
    assert!(s.failed.is_empty(), "{}: MW scenarios failed: {:?}", f.name(), s.failed);
    s
}

const RW: AccessFlags = AccessFlags::DATA_WINDOW;
const OK: WcStatus = WcStatus::Success;
const DENIED: WcStatus = WcStatus::RemAccessErr;
const ERR2: (QpState, QpState) = (QpState::Err, QpState::Err);
const RTS2: (QpState, QpState) = (QpState::Rts, QpState::Rts);

fn status(c: Option<Completion>) -> WcStatus {
    c.map(|c| c.status).unwrap_or(WcStatus::GeneralErr)
}

/// Bind `key` on `mn_qp` (the QP it binds to) over `[pool+off, +len)`.
fn bind(d: &mut dyn MwDevice, mn_qp: Qpn, key: Rkey, off: u64, len: u32, acc: AccessFlags) -> WcStatus {
    let (pool, lkey, _) = d.pool();
    let w = Wqe::bind_mw(key.0, pool + off, len, lkey, mn_qp.get(), acc).with_wr_id(11);
    status(d.post(Side::Mn, mn_qp, &w))
}

fn read(d: &mut dyn MwDevice, cn_qp: Qpn, off: u64, key: Rkey, len: u32) -> WcStatus {
    let ((pool, ..), (buf, lkey)) = (d.pool(), d.buf());
    status(d.post(Side::Cn, cn_qp, &Wqe::read(buf, lkey, len, pool + off, key.0).with_wr_id(12)))
}

fn write(d: &mut dyn MwDevice, cn_qp: Qpn, off: u64, key: Rkey, data: &[u8]) -> WcStatus {
    let ((pool, ..), (buf, lkey)) = (d.pool(), d.buf());
    d.write_local(Side::Cn, buf, data);
    status(d.post(Side::Cn, cn_qp, &Wqe::write(buf, lkey, data.len() as u32, pool + off, key.0).with_wr_id(13)))
}

fn inv(d: &mut dyn MwDevice, mn_qp: Qpn, key: Rkey) -> WcStatus {
    status(d.post(Side::Mn, mn_qp, &Wqe::local_inv(key.0).with_wr_id(14)))
}

fn states(d: &mut dyn MwDevice, p: (Qpn, Qpn)) -> (QpState, QpState) {
    (d.state(Side::Mn, p.0), d.state(Side::Cn, p.1))
}

fn pool_bytes(d: &mut dyn MwDevice, off: u64, n: usize) -> Vec<u8> {
    let pool = d.pool().0;
    d.read_local(Side::Mn, pool + off, n)
}

fn bound_to(d: &mut dyn MwDevice, key: Rkey) -> Option<Qpn> {
    match d.binding(key) {
        Some(MwBinding::Bound { rkey, qpn }) if rkey == key => Some(qpn),
        _ => None,
    }
}

/// From rxe_mw.rs (`bind_access_invalidate_rebind_statuses`), loopback mw.rs
/// (`bound_window_works_only_through_its_qp`) and FPGA ext_mw.rs (`memory_window_rules`).
fn only_its_qp(d: &mut dyn MwDevice) -> Outcome {
    let mw = d.alloc_mw();
    // unbound: nothing reaches it
    let p0 = d.pair();
    assert_eq!(read(d, p0.1, 0, mw, 8), DENIED, "an unbound window");
    let p1 = d.pair();
    let k1 = mw.next_key();
    assert_eq!(bind(d, p1.0, k1, 0, 4096, RW), OK, "bind on the MN end of pair 1");
    assert_eq!(bound_to(d, k1), Some(p1.0), "bound to the QP it was posted on");
    assert_eq!(write(d, p1.1, 0, k1, b"hello through a type-2 MW"), OK);
    assert_eq!(pool_bytes(d, 0, 25), b"hello through a type-2 MW");
    assert_eq!(read(d, p1.1, 4000, k1, 96), OK, "a read ending at the window's end");
    // the pool MR has no remote rights of its own
    let pm = d.pair();
    let mr_rkey = Rkey(d.pool().2);
    assert_eq!(read(d, pm.1, 0, mr_rkey, 8), DENIED, "the MR's rkey without remote rights");
    // a wrong key byte on the right index
    let pk = d.pair();
    assert_eq!(read(d, pk.1, 0, k1.next_key(), 8), DENIED, "a wrong key byte");
    // QP association: another pair with the right rkey is refused, both its QPs to ERR
    let p2 = d.pair();
    assert_eq!(read(d, p2.1, 0, k1, 8), DENIED);
    assert_eq!(states(d, p2), ERR2);
    assert_eq!(states(d, p1), RTS2, "the bound pair is unaffected");
    let p3 = d.pair();
    let before = pool_bytes(d, 128, 16);
    assert_eq!(write(d, p3.1, 128, k1, b"SHOULD-NOT-LAND!"), DENIED);
    assert_eq!(pool_bytes(d, 128, 16), before, "a refused write left the bytes unchanged");
    assert_eq!(read(d, p1.1, 0, k1, 8), OK, "the bound pair still works");
    Ok(())
}

/// From rxe_mw.rs, loopback mw.rs (`local_invalidate_then_access_is_refused`) and ext_mw.rs.
fn invalidate(d: &mut dyn MwDevice) -> Outcome {
    let mw = d.alloc_mw();
    let p = d.pair();
    let k = mw.next_key();
    assert_eq!(bind(d, p.0, k, 0, 4096, RW), OK);
    assert_eq!(inv(d, p.0, k), OK, "LOCAL_INV on the bound QP");
    assert_eq!(bound_to(d, k), None);
    assert_eq!(read(d, p.1, 0, k, 8), DENIED);
    assert_eq!(states(d, p), ERR2);
    Ok(())
}

/// From rxe_mw.rs, loopback mw.rs (`rebind_with_next_key_and_stale_key_rejected`), ext_mw.rs.
fn rebind(d: &mut dyn MwDevice) -> Outcome {
    let mw = d.alloc_mw();
    let p = d.pair();
    let k1 = mw.next_key();
    assert_eq!(bind(d, p.0, k1, 0, 4096, RW), OK);
    assert_eq!(inv(d, p.0, k1), OK);
    let p2 = d.pair();
    let k2 = k1.next_key();
    assert_eq!(bind(d, p2.0, k2, 0, 4096, RW), OK, "rebind with the next key");
    assert_eq!(read(d, p2.1, 0, k2, 8), OK);
    assert_eq!(write(d, p2.1, 0, k2, b"12345678"), OK);
    assert_eq!(read(d, p2.1, 0, k1, 8), DENIED, "the stale rkey");
    assert_eq!(states(d, p2), ERR2);
    Ok(())
}

/// From rxe_mw.rs, loopback mw.rs (`bind_errors`) and ext_mw.rs.
fn bind_bound(d: &mut dyn MwDevice) -> Outcome {
    let mw = d.alloc_mw();
    let p = d.pair();
    let k = mw.next_key();
    assert_eq!(bind(d, p.0, k, 0, 4096, RW), OK);
    let p2 = d.pair();
    assert_eq!(bind(d, p2.0, k.next_key(), 0, 4096, RW), WcStatus::MwBindErr);
    assert_eq!(d.state(Side::Mn, p2.0), QpState::Err, "the failed bind's QP to ERR");
    assert_eq!(bound_to(d, k), Some(p.0), "the window stays where it was");
    assert_eq!(read(d, p.1, 0, k, 8), OK);
    Ok(())
}

/// From rxe_mw.rs (`read_only_window_refuses_writes`) and loopback mw.rs (`insufficient_rights`).
fn read_only(d: &mut dyn MwDevice) -> Outcome {
    let mw = d.alloc_mw();
    let p = d.pair();
    let k = mw.next_key();
    assert_eq!(bind(d, p.0, k, 0, 256, AccessFlags::REMOTE_READ), OK);
    assert_eq!(read(d, p.1, 0, k, 256), OK);
    assert_eq!(write(d, p.1, 0, k, b"nope"), DENIED);
    assert_eq!(pool_bytes(d, 0, 4), b"oooo");
    Ok(())
}

/// From loopback mw.rs (`window_bounds_strict_versus_rxe`), ext_mw.rs and DESIGN.md §3's
/// deviation (b): rxe checks only the MR's bounds.
fn bounds(d: &mut dyn MwDevice) -> Outcome {
    let outside = if d.caps().contains(Caps::RXE_MW) { OK } else { DENIED };
    // a refused access kills its pair: each check on a fresh window and pair
    let checks = [
        (1024 + 256, outside, "past the window, inside the MR"),
        (1000, outside, "before the window, inside the MR"),
        (POOL_LEN - 4, DENIED, "never past the MR"),
    ];
    for (off, want, what) in checks {
        let mw = d.alloc_mw();
        let p = d.pair();
        let k = mw.next_key();
        assert_eq!(bind(d, p.0, k, 1024, 256, RW), OK);
        assert_eq!(read(d, p.1, 1024, k, 256), OK, "the whole window");
        assert_eq!(read(d, p.1, off, k, 8), want, "{what}");
    }
    Ok(())
}

/// From loopback mw.rs (`local_invalidate_from_another_qp_strict_versus_rxe`), ext_mw.rs and
/// DESIGN.md §3's deviation (a).
fn inv_elsewhere(d: &mut dyn MwDevice) -> Outcome {
    let rxe = d.caps().contains(Caps::RXE_MW);
    let mw = d.alloc_mw();
    let p = d.pair();
    let other = d.pair();
    let k = mw.next_key();
    assert_eq!(bind(d, p.0, k, 0, 64, RW), OK);
    let st = inv(d, other.0, k);
    if rxe {
        assert_eq!(st, OK, "rxe: LOCAL_INV on another QP succeeds");
        assert_eq!(bound_to(d, k), None);
    } else {
        assert_eq!(st, WcStatus::MwBindErr, "strict: LOCAL_INV only on the bound QP");
        assert_eq!(d.state(Side::Mn, other.0), QpState::Err);
        assert_eq!(bound_to(d, k), Some(p.0), "the window intact");
        assert_eq!(read(d, p.1, 0, k, 8), OK);
    }
    Ok(())
}

/// From rxe_mw.rs (`send_with_inv_invalidates_remotely`), loopback mw.rs (`send_with_invalidate`,
/// the bound-pair case) and ext_mw.rs (`send_with_invalidate_and_receive_scatter`).
fn send_with_inv(d: &mut dyn MwDevice) -> Outcome {
    let mw = d.alloc_mw();
    let p = d.pair();
    let k = mw.next_key();
    assert_eq!(bind(d, p.0, k, 0, 4096, RW), OK);
    let (pool, lkey, _) = d.pool();
    let mut r = RecvWqe { wr_id: 77, sges: heapless::Vec::new() };
    r.sges.push(Sge { addr: pool + 8192, length: 64, lkey }).map_err(|_| Failure("sge".into()))?;
    d.post_recv(Side::Mn, p.0, &r);
    let (buf, blkey) = d.buf();
    d.write_local(Side::Cn, buf, b"bye");
    let c = d.post(Side::Cn, p.1, &Wqe::send_with_inv(buf, blkey, 3, k.0).with_wr_id(78));
    assert_eq!(status(c), OK);
    let rc = d.wait_recv(Side::Mn, p.0).expect("the receive completed");
    assert_eq!((rc.status, rc.wr_id, rc.opcode, rc.invalidated), (OK, 77, WcOpcode::Recv, Some(k)));
    assert_eq!(pool_bytes(d, 8192, 3), b"bye");
    assert_eq!(bound_to(d, k), None, "the receiver saw the remote invalidation");
    assert_eq!(read(d, p.1, 0, k, 8), DENIED);
    Ok(())
}
