//! The extension block on the double: capabilities, binds for another QP and the management
//! UNBIND, receive scatter and WRITE_WITH_IMM, stock commands and bad inputs. The memory-window
//! rules themselves are the suite's (`omw_tests::mw`, run here by conformance.rs).

mod support;

use omw_core::access::AccessFlags;
use omw_core::device::DataPath;
use omw_core::device::Provision;
use omw_core::device::WindowState;
use omw_core::device::{Capabilities, Domain, ExecutionMode, MwBinding, QpState, WcOpcode, WcStatus};
use omw_core::ids::Rkey;
use omw_core::wire::wqe::{QueueSel, RecvWqe, Sge, Wqe};
use omw_fpga::double::Fabric;
use omw_fpga::encoding::OpcodeEncoding;
use omw_fpga::{QpConnect, QpSetup};
use support::*;

const CN: u64 = 0x1000_0000;
const MN: u64 = 0x2000_0000;
const POOL: u64 = MN + 0x10_0000;
const WIN: u64 = POOL + 0x1000;

struct World {
    f: Fabric,
    cn: Host,
    mn: Host,
    pool_lkey: u32,
    cn_lkey: u32,
}

/// CN ctid 1,2 ↔ MN ctid 1,2 (access QPs A and B); MN ctid 3 ↔ 4 is a loopback "admin" pair.
fn world() -> World {
    let f = Fabric::new();
    let mut cn = host(&f, 0x0A00_0001, CN, true, OpcodeEncoding::AppOpcodes);
    let mut mn = host(&f, 0x0A00_0002, MN, true, OpcodeEncoding::AppOpcodes);
    for c in [1, 2] {
        setup(&mut cn, c, QpSetup::plain(16, 4));
        setup(&mut mn, c, QpSetup::plain(16, 4));
        connect(&mut cn, c, &mut mn, c, (0, 0), (0, 0));
    }
    setup(&mut mn, 3, QpSetup::plain(16, 0));
    setup(&mut mn, 4, QpSetup::plain(0, 0));
    connect_loop(&mut mn, 3, 4);
    let pool = AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    let pool_lkey = mn.be.reg_mr(Domain::CnFacing, POOL, 0x10000, pool).unwrap().lkey;
    let cn_lkey = cn.be.reg_mr(Domain::CnFacing, CN, 0x10000, AccessFlags::LOCAL_WRITE).unwrap().lkey;
    World { f, cn, mn, pool_lkey, cn_lkey }
}

impl World {
    fn q(&self, h: &Host, c: u8) -> omw_core::ids::Qpn {
        h.be.qpn(c).unwrap()
    }
    /// Post on an MN QP and wait for its completion.
    fn mn_op(&mut self, c: u8, w: Wqe) -> WcStatus {
        let q = self.q(&self.mn, c);
        self.mn.be.post_send(q, &w).unwrap();
        wait1(&mut self.mn.be, q, QueueSel::Send).status
    }
    fn bind(&mut self, rkey: Rkey, to_ctid: u8, len: u32) -> WcStatus {
        let target = self.q(&self.mn, to_ctid).get();
        let w = Wqe::bind_mw(rkey.0, WIN, len, self.pool_lkey, target, AccessFlags::DATA_WINDOW);
        self.mn_op(3, w.with_wr_id(0xB1))
    }
    fn cn_read(&mut self, c: u8, rkey: Rkey, addr: u64, len: u32) -> WcStatus {
        let q = self.q(&self.cn, c);
        self.cn.be.post_send(q, &Wqe::read(CN + 0x800, self.cn_lkey, len, addr, rkey.0).with_wr_id(7)).unwrap();
        let c = wait1(&mut self.cn.be, q, QueueSel::Send);
        assert_eq!(c.wr_id, 7);
        c.status
    }
    fn reset_pair(&mut self, c: u8) {
        let (qc, qm) = (self.q(&self.cn, c), self.q(&self.mn, c));
        self.cn.be.reset_qp(qc).unwrap();
        self.mn.be.reset_qp(qm).unwrap();
    }
}

#[test]
fn extension_block_detected_and_offload_declared() {
    let w = world();
    assert_eq!(w.mn.be.extension(), Some((2, 0)));
    let caps = w.mn.be.capabilities();
    assert!(caps.contains(Capabilities::OFFLOAD), "{caps:?}");
    assert!(caps.contains(Capabilities::MW_BOUNDS_ENFORCED | Capabilities::SEND_WITH_INV));
    assert_eq!(w.mn.be.secure_mode(), Ok(ExecutionMode::Offloaded));
    assert_eq!(w.mn.be.qp_state(w.q(&w.mn, 1)).unwrap(), QpState::Rts);
}

/// The window rules themselves (QP association, bounds, key bytes, bind while bound, LOCAL_INV
/// only on the bound QP, rebinding) are the suite's `mw::*` scenarios, run on this block by
/// conformance.rs; here, what only the extension's management path does: a BIND posted on one
/// QP for another (BIND_TO_OTHER_QP), and the UNBIND form with no QP check.
#[test]
fn binds_for_another_qp_and_the_management_unbind() {
    let mut w = world();
    w.mn.be.write_local(WIN, b"window contents, 256 bytes long.").unwrap();
    let mw = w.mn.be.alloc_mw().unwrap();
    assert_eq!(w.f.mw(w.mn.id, mw.0).unwrap().bound, None);
    // bind to access QP A, posted on the admin QP
    let rk = mw.next_key();
    assert_eq!(w.bind(rk, 1, 256), WcStatus::Success);
    let qa_mn = w.q(&w.mn, 1);
    assert_eq!(w.mn.be.mw_binding(rk), Some(MwBinding::Bound { rkey: rk, qpn: qa_mn }));
    assert_eq!(w.cn_read(1, rk, WIN, 32), WcStatus::Success);
    assert_eq!(get(&w.cn.be, CN + 0x800, 32), b"window contents, 256 bytes long.");
    // binding a bound window from the admin QP: MW bind error
    assert_eq!(w.bind(rk.next_key(), 2, 64), WcStatus::MwBindErr);
    w.mn.be.reset_qp(w.q(&w.mn, 3)).unwrap();
    // LOCAL_INV from the admin QP (not the bound one): refused, window intact
    assert_eq!(w.mn_op(3, Wqe::local_inv(rk.0)), WcStatus::MwBindErr);
    w.mn.be.reset_qp(w.q(&w.mn, 3)).unwrap();
    assert_eq!(w.f.mw(w.mn.id, rk.0).unwrap().bound.map(|b| b.qpn), Some(qa_mn.get()));
    // the management UNBIND form needs no QP check
    assert_eq!(w.mn_op(3, Wqe::unbind_mw(rk.0)), WcStatus::Success);
    assert_eq!(w.f.mw(w.mn.id, rk.0).unwrap().bound, None);
    assert_eq!(w.cn_read(1, rk, WIN, 8), WcStatus::RemAccessErr);
    w.reset_pair(1);
    // UNBIND of a window that is not bound: error
    assert_eq!(w.mn_op(3, Wqe::unbind_mw(rk.0)), WcStatus::MwBindErr);
}

#[test]
fn send_with_invalidate_and_receive_scatter() {
    let mut w = world();
    let mw = w.mn.be.alloc_mw().unwrap();
    assert_eq!(w.bind(mw, 1, 128), WcStatus::Success);
    let (qa, qa_mn) = (w.q(&w.cn, 1), w.q(&w.mn, 1));
    let mut r = RecvWqe { wr_id: 0x77, sges: heapless::Vec::new() };
    r.sges.push(Sge { addr: POOL + 0x100, length: 4, lkey: w.pool_lkey }).unwrap();
    r.sges.push(Sge { addr: POOL + 0x200, length: 16, lkey: w.pool_lkey }).unwrap();
    w.mn.be.post_recv(qa_mn, &r).unwrap();
    put(&mut w.cn.be, CN + 0x100, b"abcdefgh");
    w.cn.be.post_send(qa, &Wqe::send_with_inv(CN + 0x100, w.cn_lkey, 8, mw.0).with_wr_id(3)).unwrap();
    assert_eq!(wait1(&mut w.cn.be, qa, QueueSel::Send).status, WcStatus::Success);
    let c = wait1(&mut w.mn.be, qa_mn, QueueSel::Recv);
    assert_eq!((c.wr_id, c.status, c.opcode, c.byte_len), (0x77, WcStatus::Success, WcOpcode::Recv, 8));
    assert_eq!(c.invalidated, Some(mw));
    assert_eq!(get(&w.mn.be, POOL + 0x100, 4), b"abcd");
    assert_eq!(get(&w.mn.be, POOL + 0x200, 4), b"efgh");
    assert_eq!(w.f.mw(w.mn.id, mw.0).unwrap().bound, None);
    // WRITE_WITH_IMM consumes a receive and carries the immediate
    w.mn.be.post_recv(qa_mn, &RecvWqe { wr_id: 0x78, sges: heapless::Vec::new() }).unwrap();
    let mrk =
        w.mn.be
            .reg_mr(Domain::CnFacing, POOL + 0x400, 64, AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE)
            .unwrap()
            .rkey;
    w.cn.be.post_send(qa, &Wqe::write_imm(CN + 0x100, w.cn_lkey, 8, POOL + 0x400, mrk, 0xFEED).with_wr_id(4)).unwrap();
    let c = wait1(&mut w.mn.be, qa_mn, QueueSel::Recv);
    assert_eq!((c.wr_id, c.opcode, c.imm), (0x78, WcOpcode::RecvRdmaWithImm, Some(0xFEED)));
    assert_eq!(get(&w.mn.be, POOL + 0x400, 8), b"abcdefgh");
}

#[test]
fn stock_commands_are_checked_by_the_extension_responder() {
    let mut w = world();
    let mw = w.mn.be.alloc_mw().unwrap();
    assert_eq!(w.bind(mw, 1, 64), WcStatus::Success);
    w.mn.be.write_local(WIN, b"stock!").unwrap();
    let qa = w.q(&w.cn, 1);
    // the stock command path: the rkey is the QP context's (the stack puts it in every RETH),
    // and the responder's key table checks it
    let mn_qpn = w.q(&w.mn, 1).get();
    let ctx = |rkey: u32| QpConnect {
        remote_qpn: mn_qpn,
        remote_ip: w.mn.ip,
        local_psn: 0x100,
        remote_psn: 0x200,
        remote_rkey: rkey,
        remote_vaddr: 0,
        port: 18488,
    };
    w.cn.be.connect_qp(1, &ctx(mw.0)).unwrap();
    w.cn.be.post_stock(qa, &Wqe::read(CN + 0x300, 0, 6, WIN, mw.0).with_wr_id(1)).unwrap();
    // another rkey cannot be expressed on the stock path
    assert!(matches!(
        w.cn.be.post_stock(qa, &Wqe::read(CN + 0x400, 0, 6, WIN, mw.next_key().0)),
        Err(omw_fpga::Error::RkeyNotInContext { .. })
    ));
    w.f.run(100);
    assert_eq!(get(&w.cn.be, CN + 0x300, 6), b"stock!");
    // a context naming a stale key: refused at the responder
    let before = w.f.stats(w.cn.id).remote_errors;
    let mut cn_be = w.cn.be;
    let psn = w.f.psns(w.cn.id, 1).0;
    cn_be.connect_qp(1, &QpConnect { local_psn: psn, ..ctx(mw.next_key().0) }).unwrap();
    cn_be.post_stock(qa, &Wqe::read(CN + 0x400, 0, 6, WIN, mw.next_key().0).with_wr_id(2)).unwrap();
    w.f.run(100);
    assert_eq!(get(&cn_be, CN + 0x400, 6), [0; 6]);
    assert_eq!(w.f.stats(w.cn.id).remote_errors, before + 1);
}

#[test]
fn extension_bad_inputs_refused_before_the_ring() {
    let mut w = world();
    let qa = w.q(&w.cn, 1);
    let pi = w.f.stats(w.cn.id).wqes_executed;
    assert!(matches!(
        w.cn.be.post_send(qa, &Wqe::write(CN, 0, 1 << 28, MN, 0)),
        Err(omw_fpga::Error::LengthOverflow { .. })
    ));
    assert!(matches!(
        w.cn.be.post_send(qa, &Wqe::read(CN, 0, 8, 1 << 48, 0)),
        Err(omw_fpga::Error::AddressOverflow { .. })
    ));
    // a ring deeper than CAPS[55:48] allows, or not a power of two
    assert!(matches!(w.cn.be.create_qp(9, QpSetup::plain(1 << 21, 0)), Err(omw_fpga::Error::Unsupported { .. })));
    assert!(matches!(w.cn.be.create_qp(9, QpSetup::plain(3, 0)), Err(omw_fpga::Error::Unsupported { .. })));
    let mut bad = Wqe::nop();
    bad.operand1 = 0;
    bad.flags = omw_core::wire::wqe::WqeFlags::UNBIND;
    assert!(matches!(w.cn.be.post_send(qa, &bad), Err(omw_fpga::Error::Wqe(_))));
    // a full ring refuses the next entry (the QP has 16 send entries; stall its engine)
    w.f.set_paused(w.cn.id, true);
    for i in 0..16 {
        w.cn.be.post_send(qa, &Wqe::nop().with_wr_id(i)).unwrap();
    }
    assert!(matches!(w.cn.be.post_send(qa, &Wqe::nop()), Err(omw_fpga::Error::QueueFull { .. })));
    assert_eq!(w.f.stats(w.cn.id).wqes_executed, pi);
    w.f.set_paused(w.cn.id, false);
    assert_eq!(wait_n(&mut w.cn.be, qa, QueueSel::Send, 16).len(), 16);
}
