//! The stock engine (no extension block): plain READ / WRITE / SEND through the
//! `RdmaBackend` impl, completions rebuilt from the counters, bad inputs refused before
//! anything reaches the engine, and the secure protocol refused.

mod support;

use omw_core::access::AccessFlags;
use omw_core::backend::{Capabilities, RdmaBackend, WcOpcode, WcStatus};
use omw_core::wqe::{Opcode, QueueSel, RecvWqe, Wqe, WqeFlags};
use omw_fpga::backend::Backpressure;
use omw_fpga::device::{DevMmio, DeviceConfig, DeviceError};
use omw_fpga::double::Fabric;
use omw_fpga::encoding::{self, Command, CtrlWord, OpcodeEncoding, RdmaOp, RdmaRequest, Stream};
use omw_fpga::mmio::{post_command, Mmio};
use omw_fpga::{regs, Error, SecureProtocolError};
use support::*;

const A: u64 = 0x1000_0000;
const B: u64 = 0x2000_0000;
/// Where SENDs from A land on B (the buffer A's QP context names).
const B_INBOX: u64 = B + 0x8000;

fn pair(enc: OpcodeEncoding) -> (Fabric, Host, Host) {
    let f = Fabric::new();
    let mut a = host(&f, 0x0A00_0001, A, false, enc);
    let mut b = host(&f, 0x0A00_0002, B, false, enc);
    connect(&mut a, 1, &mut b, 2, (0, B_INBOX), (0, A + 0x8000));
    (f, a, b)
}

#[test]
fn read_write_send_between_two_nodes_both_encodings() {
    for enc in [OpcodeEncoding::CoyoteV2, OpcodeEncoding::AppOpcodes] {
        let (f, mut a, mut b) = pair(enc);
        let qa = a.be.qpn(1).unwrap();
        put(&mut a.be, A + 0x100, b"written by A");
        put(&mut b.be, B + 0x200, b"read from B!");
        put(&mut a.be, A + 0x300, b"a message");
        a.be.post_send(qa, &Wqe::write(A + 0x100, 0, 12, B + 0x400, 0).with_wr_id(11)).unwrap();
        a.be.post_send(qa, &Wqe::read(A + 0x500, 0, 12, B + 0x200, 0).with_wr_id(12)).unwrap();
        a.be.post_send(qa, &Wqe::send(A + 0x300, 0, 9).with_wr_id(13)).unwrap();
        // unsignaled: counted by the engine, no completion
        let quiet = Wqe::write(A + 0x100, 0, 4, B + 0x600, 0).with_wr_id(14).with_flags(WqeFlags::empty());
        a.be.post_send(qa, &quiet).unwrap();
        a.be.post_send(qa, &Wqe::write(A + 0x100, 0, 1, B + 0x700, 0).with_wr_id(15)).unwrap();
        let c = wait_n(&mut a.be, qa, QueueSel::Send, 4);
        let ids: Vec<u64> = c.iter().map(|c| c.wr_id).collect();
        assert_eq!(ids, [11, 12, 13, 15], "{enc:?}: completions in posting order, with WR ids");
        assert!(c.iter().all(|c| c.status == WcStatus::Success && c.qpn == qa));
        assert_eq!(c[1].opcode, WcOpcode::Send(Opcode::Read));
        assert_eq!(c[2].byte_len, 9);
        assert_eq!(get(&b.be, B + 0x400, 12), b"written by A");
        assert_eq!(get(&a.be, A + 0x500, 12), b"read from B!");
        assert_eq!(get(&b.be, B_INBOX, 9), b"a message");
        assert_eq!(get(&b.be, B + 0x600, 4), b"writ");
        // the counters: 1 READ, 4 WRITE/SEND, every command with LAST
        let stat = a.be.mmio().read_csr(regs::stat_rdma(1)).unwrap();
        assert_eq!((regs::reads_done(stat), regs::writes_done(stat)), (1, 4));
        assert_eq!(f.stats(a.id).commands_completed, 5);
        assert!(drain(&mut a.be, qa, QueueSel::Send, 10).is_empty());
    }
}

#[test]
fn stock_engine_declares_nothing_and_secure_protocol_refused() {
    let (_f, mut a, _b) = pair(OpcodeEncoding::AppOpcodes);
    assert_eq!(a.be.extension(), None);
    assert_eq!(a.be.capabilities(), Capabilities::empty());
    let e = a.be.secure_mode().unwrap_err();
    assert!(matches!(e, SecureProtocolError::Insecure { missing } if missing.contains(Capabilities::MW_TYPE2)
        && missing.contains(Capabilities::MW_QP_BINDING_ENFORCED)));
    let msg = e.to_string();
    assert!(msg.contains("no memory windows"), "{msg}");
    assert!(msg.contains("responder-side rkey check"), "{msg}");
    assert!(msg.contains("extension block"), "{msg}");
    // and what cannot be done is refused, not faked
    let qa = a.be.qpn(1).unwrap();
    assert!(matches!(a.be.alloc_mw(), Err(Error::Unsupported { .. })));
    assert!(matches!(a.be.post_recv(qa, &RecvWqe::default()), Err(Error::Unsupported { .. })));
    assert!(matches!(a.be.enable(qa, QueueSel::Send, 1), Err(Error::Unsupported { .. })));
    assert!(matches!(a.be.ring_base(qa, QueueSel::Send), Err(Error::Unsupported { .. })));
    assert!(matches!(a.be.poll_cq(qa, QueueSel::Recv, &mut [blank()]), Err(Error::Unsupported { .. })));
    assert_eq!(a.be.reg_mr(A, 4096, AccessFlags::REMOTE_READ).unwrap().rkey, 0);
}

#[test]
fn bad_inputs_are_typed_errors_and_nothing_is_sent() {
    let (f, mut a, _b) = pair(OpcodeEncoding::AppOpcodes);
    let qa = a.be.qpn(1).unwrap();
    let before = f.stats(a.id);
    type Check = fn(&Error) -> bool;
    let cases: Vec<(Wqe, Check)> = vec![
        (Wqe::write(A, 0, 1 << 28, B, 0), |e| matches!(e, Error::LengthOverflow { len } if *len == 1 << 28)),
        (Wqe::read(A, 0, u32::MAX, B, 0), |e| matches!(e, Error::LengthOverflow { .. })),
        (Wqe::write(A, 0, (1 << 27) + 1, B, 0), |e| matches!(e, Error::TransferTooLarge { .. })),
        (Wqe::write(1 << 48, 0, 8, B, 0), |e| matches!(e, Error::AddressOverflow { addr } if *addr == 1 << 48)),
        (Wqe::read(A, 0, 8, u64::MAX, 0), |e| matches!(e, Error::AddressOverflow { .. })),
        (Wqe::write(A, 0, 8, B, 0x1234), |e| matches!(e, Error::RkeyNotInContext { rkey: 0x1234, .. })),
        (Wqe::fetch_add(A, 0, B, 0, 1), |e| matches!(e, Error::Unsupported { what: "FETCH_ADD", .. })),
        (Wqe::bind_mw(0x100, A, 8, 0, 1, AccessFlags::REMOTE_READ), |e| matches!(e, Error::Unsupported { .. })),
    ];
    for (w, ok) in cases {
        let e = a.be.post_send(qa, &w).unwrap_err();
        assert!(ok(&e), "{w:?} gave {e:?}");
        assert!(!e.to_string().is_empty());
    }
    // a QP number of another vFPGA, and an unconnected QP
    let foreign = omw_core::ids::Qpn::new(0x40 | 1).unwrap();
    assert!(matches!(a.be.post_send(foreign, &Wqe::write(A, 0, 8, B, 0)), Err(Error::UnknownQp(0x41))));
    let idle = a.be.qpn(9).unwrap();
    assert!(matches!(a.be.post_send(idle, &Wqe::write(A, 0, 8, B, 0)), Err(Error::QpNotConnected(_))));
    let after = f.stats(a.id);
    assert_eq!(after.ctrl_writes, before.ctrl_writes, "nothing reached CTRL_REG");
    assert_eq!(after.commands_accepted, before.commands_accepted);
}

#[test]
fn backpressure_refuses_before_sending() {
    let f = Fabric::new();
    let mut a = host(&f, 1, A, false, OpcodeEncoding::AppOpcodes);
    let mut b = host(&f, 2, B, false, OpcodeEncoding::AppOpcodes);
    connect(&mut a, 1, &mut b, 1, (0, B_INBOX), (0, A));
    connect(&mut a, 2, &mut b, 2, (0, B_INBOX), (0, A));
    let (q1, q2) = (a.be.qpn(1).unwrap(), a.be.qpn(2).unwrap());
    f.set_paused(a.id, true); // the engine's link is down: nothing issues, nothing completes
    for i in 0..16 {
        a.be.post_send(q1, &Wqe::write(A, 0, 8, B, 0).with_wr_id(i)).unwrap();
    }
    let s = f.stats(a.id);
    let e = a.be.post_send(q1, &Wqe::write(A, 0, 8, B, 0)).unwrap_err();
    assert!(matches!(e, Error::Backpressure { limit: Backpressure::OutstandingWrites { limit: 16 }, .. }), "{e}");
    let e = a.be.post_send(q1, &Wqe::send(A, 0, 8)).unwrap_err();
    assert!(matches!(e, Error::Backpressure { limit: Backpressure::OutstandingWrites { .. }, .. }));
    for i in 0..8 {
        a.be.post_send(q1, &Wqe::read(A + 0x100, 0, 8, B, 0).with_wr_id(100 + i)).unwrap();
    }
    let e = a.be.post_send(q1, &Wqe::read(A, 0, 8, B, 0)).unwrap_err();
    assert!(matches!(e, Error::Backpressure { limit: Backpressure::OutstandingReads { limit: 8 }, .. }));
    // the FIFO (32 deep) fills from a second QP
    for i in 0..8 {
        a.be.post_send(q2, &Wqe::write(A, 0, 8, B, 0).with_wr_id(200 + i)).unwrap();
    }
    assert_eq!(a.be.mmio().read_csr(regs::CTRL_REG).unwrap(), 32);
    let e = a.be.post_send(q2, &Wqe::write(A, 0, 8, B, 0)).unwrap_err();
    assert!(matches!(e, Error::Backpressure { limit: Backpressure::CommandFifoFull { in_flight: 32 }, .. }), "{e}");
    let s2 = f.stats(a.id);
    assert_eq!(s2.commands_accepted, s.commands_accepted + 16, "refused requests never reached the engine");
    assert_eq!(s2.fifo_overflows, 0);
    // link back: everything completes, in order, and the QPs take requests again
    f.set_paused(a.id, false);
    let c1 = wait_n(&mut a.be, q1, QueueSel::Send, 24);
    let mut ids: Vec<u64> = c1.iter().map(|c| c.wr_id).collect();
    ids.sort();
    assert_eq!(ids, (0..16).chain(100..108).collect::<Vec<_>>());
    assert_eq!(wait_n(&mut a.be, q2, QueueSel::Send, 8).len(), 8);
    a.be.post_send(q1, &Wqe::write(A, 0, 8, B, 0).with_wr_id(999)).unwrap();
    assert_eq!(wait1(&mut a.be, q1, QueueSel::Send).wr_id, 999);
    // the engine itself never held more than its per-QP limits in flight
    let s3 = f.stats(a.id);
    assert!(s3.max_outstanding_writes <= 16 && s3.max_outstanding_reads <= 8);
}

#[test]
fn unknown_device_file_is_a_typed_error() {
    let cfg = DeviceConfig { path: "/dev/coyote_fpga_99_v9".into(), ..DeviceConfig::coyote(99, 9) };
    let e = DevMmio::open(&cfg).unwrap_err();
    assert!(matches!(&e, DeviceError::NotFound { path } if path.to_str() == Some("/dev/coyote_fpga_99_v9")));
    assert!(e.to_string().contains("does not exist"));
}

// ---- the double's own model of the engine (raw registers) -----------------------------------

fn raw_write(ctid: u8, len: u32) -> Command {
    Command::rdma(OpcodeEncoding::AppOpcodes, &RdmaRequest::new(RdmaOp::Write, ctid, A, B, len)).unwrap()
}

#[test]
fn double_fifo_depth_limits_and_overflow() {
    let (f, a, _b) = pair(OpcodeEncoding::AppOpcodes);
    let m = f.mmio(a.id);
    f.set_auto_tick(false);
    for _ in 0..20 {
        post_command(&m, &raw_write(1, 8)).unwrap();
    }
    assert_eq!(m.read_csr(regs::CTRL_REG).unwrap(), 20);
    f.tick(); // issues up to the QP's 16 outstanding writes; the head then blocks
    assert_eq!(m.read_csr(regs::CTRL_REG).unwrap(), 4);
    assert_eq!(f.stats(a.id).max_outstanding_writes, 16);
    f.set_paused(a.id, true);
    for _ in 0..29 {
        post_command(&m, &raw_write(1, 8)).unwrap();
    }
    // 4 + 28 fit, the 33rd push is lost and flagged
    assert_eq!(m.read_csr(regs::CTRL_REG).unwrap(), 32);
    assert_eq!(f.stats(a.id).fifo_overflows, 1);
    assert_ne!(m.read_csr(regs::ISR_REG).unwrap() & regs::ISR_FIFO_OVERFLOW, 0);
    f.set_paused(a.id, false);
    f.run(1000);
    assert_eq!(m.read_csr(regs::CTRL_REG).unwrap(), 0);
    assert_eq!(regs::writes_done(m.read_csr(regs::stat_rdma(1)).unwrap()), 48);
}

#[test]
fn double_counters_move_only_with_last_and_clear_on_clr_stat() {
    let (f, a, _b) = pair(OpcodeEncoding::CoyoteV2);
    let m = f.mmio(a.id);
    let mut r = RdmaRequest::new(RdmaOp::Read, 1, A, B, 8);
    r.last = false;
    post_command(&m, &Command::rdma(OpcodeEncoding::CoyoteV2, &r).unwrap()).unwrap();
    r.last = true;
    post_command(&m, &Command::rdma(OpcodeEncoding::CoyoteV2, &r).unwrap()).unwrap();
    f.run(100);
    assert_eq!(f.stats(a.id).commands_completed, 2);
    assert_eq!(m.read_csr(regs::stat_rdma(1)).unwrap(), 1, "only the LAST command counts");
    post_command(&m, &Command::clear_stat(1)).unwrap();
    assert_eq!(m.read_csr(regs::stat_rdma(1)).unwrap(), 0);
}

#[test]
fn double_rejects_words_outside_the_engine_limits() {
    let (f, a, _b) = pair(OpcodeEncoding::AppOpcodes);
    let m = f.mmio(a.id);
    // a length word beyond 28 bits, written by hand (the encoder refuses to build it)
    let mut c = raw_write(1, 8);
    let big = |w: u64| (w & 0xFFFF_FFFF) | (1u64 << 28) << 32;
    c.ctrl_src = big(c.ctrl_src);
    c.ctrl_dst = big(c.ctrl_dst);
    post_command(&m, &c).unwrap();
    // an address beyond 48 bits
    let mut c = raw_write(1, 8);
    c.vaddr_wr = 1 << 48;
    post_command(&m, &c).unwrap();
    // the other firmware's opcode
    let c = Command::rdma(OpcodeEncoding::CoyoteV2, &RdmaRequest::new(RdmaOp::Write, 1, A, B, 8)).unwrap();
    post_command(&m, &c).unwrap();
    // two words that do not form an RDMA command
    let w = CtrlWord {
        opcode: 0x13,
        stream: Stream::Host,
        pid: 1,
        dest: 0,
        last: true,
        start: false,
        clr_stat: false,
        len: 8,
    };
    let w = w.encode().unwrap();
    post_command(&m, &Command { vaddr_wr: B, ctrl_dst: w, vaddr_rd: A, ctrl_src: w }).unwrap();
    let s = f.stats(a.id);
    assert_eq!((s.decode_errors, s.commands_accepted), (4, 0));
    assert_ne!(m.read_csr(regs::ISR_REG).unwrap() & regs::ISR_DECODE_ERROR, 0);
    assert_eq!(m.read_csr(regs::ISR_LEN_MISS_REG).unwrap(), 1 << 28);
    assert_eq!(encoding::MAX_LEN_FIELD, (1 << 28) - 1);
}

#[test]
fn double_models_page_faults_without_completion() {
    let (f, mut a, _b) = pair(OpcodeEncoding::AppOpcodes);
    let qa = a.be.qpn(1).unwrap();
    // legal for the encoder, but not memory the remote engine has mapped
    a.be.post_send(qa, &Wqe::write(A, 0, 8, 0x7000_0000, 0).with_wr_id(1)).unwrap();
    assert!(drain(&mut a.be, qa, QueueSel::Send, 20).is_empty(), "the stock engine reports no error status");
    assert_eq!(f.stats(a.id).page_faults, 1);
    let m = f.mmio(a.id);
    assert_eq!(m.read_csr(regs::ISR_VADDR_MISS_REG).unwrap(), 0x7000_0000);
}
