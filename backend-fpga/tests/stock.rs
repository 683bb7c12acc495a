//! The stock engine (no extension block): plain READ / WRITE / SEND through the
//! `RdmaBackend` impl, completions rebuilt from the counters, bad inputs refused before
//! anything reaches the engine, and the secure protocol refused.

mod support;

use omw_core::access::AccessFlags;
use omw_core::device::DataPath;
use omw_core::device::OffloadRings;
use omw_core::device::Provision;
use omw_core::device::{Capabilities, Domain, WcOpcode, WcStatus};
use omw_core::wire::wqe::{Opcode, QueueSel, RecvWqe, Wqe, WqeFlags};
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
        // an RC SEND is delivered into the remote vFPGA's stream, not to host memory
        assert_eq!(get(&b.be, B_INBOX, 9), [0; 9]);
        assert_eq!(f.take_stream_rx(b.id), [(2, b"a message".to_vec())]);
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
    assert_eq!(a.be.reg_mr(Domain::CnFacing, A, 4096, AccessFlags::REMOTE_READ).unwrap().rkey, 0);
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
    for i in 0..6 {
        a.be.post_send(q1, &Wqe::read(A + 0x100, 0, 8, B, 0).with_wr_id(100 + i)).unwrap();
    }
    // Coyote's margin (cThread::postCmd: wait while more than CMD_FIFO_DEPTH - CMD_FIFO_THR
    // = 22 are queued): a post with 22 queued goes, the next one waits
    assert_eq!(a.be.mmio().read_csr(regs::CTRL_REG).unwrap(), 22);
    a.be.post_send(q2, &Wqe::write(A, 0, 8, B, 0).with_wr_id(200)).unwrap();
    let e = a.be.post_send(q2, &Wqe::write(A, 0, 8, B, 0)).unwrap_err();
    assert!(matches!(e, Error::Backpressure { limit: Backpressure::CommandFifoFull { in_flight: 23 }, .. }), "{e}");
    let e = a.be.post_send(q1, &Wqe::read(A, 0, 8, B, 0)).unwrap_err();
    assert!(matches!(e, Error::Backpressure { limit: Backpressure::CommandFifoFull { .. }, .. }));
    let s2 = f.stats(a.id);
    assert_eq!(s2.commands_accepted, s.commands_accepted + 7, "refused requests never reached the engine");
    assert_eq!(s2.fifo_overflows, 0);
    // link back: everything completes, in order, and the QPs take requests again
    f.set_paused(a.id, false);
    let c1 = wait_n(&mut a.be, q1, QueueSel::Send, 22);
    let mut ids: Vec<u64> = c1.iter().map(|c| c.wr_id).collect();
    ids.sort();
    assert_eq!(ids, (0..16).chain(100..106).collect::<Vec<_>>());
    assert_eq!(wait_n(&mut a.be, q2, QueueSel::Send, 1).len(), 1);
    for i in 0..2 {
        a.be.post_send(q1, &Wqe::read(A, 0, 8, B, 0).with_wr_id(300 + i)).unwrap();
    }
    let e = a.be.post_send(q1, &Wqe::read(A, 0, 8, B, 0));
    assert!(e.is_ok() || matches!(e, Err(Error::Backpressure { .. })));
    a.be.post_send(q2, &Wqe::write(A, 0, 8, B, 0).with_wr_id(999)).unwrap();
    assert_eq!(wait1(&mut a.be, q2, QueueSel::Send).wr_id, 999);
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
    // 4 + 28 fit, the 33rd push is lost — silently: AXI-Lite gives the host no back-pressure
    // and cnfg_slave has no overflow flag (its ISR bits are CLR_IRQ_PENDING .. INVLDT)
    assert_eq!(m.read_csr(regs::CTRL_REG).unwrap(), 32);
    assert_eq!(f.stats(a.id).fifo_overflows, 1);
    assert_eq!(m.read_csr(regs::ISR_REG).unwrap(), regs::isr::STAT_INVLDT_READY | regs::isr::STAT_PFAULT_READY);
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
    post_command(&m, &Command::rdma(OpcodeEncoding::CoyoteV2, &RdmaRequest::new(RdmaOp::Write, 1, A, B, 8)).unwrap())
        .unwrap();
    f.run(100);
    assert_eq!(f.stats(a.id).commands_completed, 3);
    assert_eq!(m.read_csr(regs::stat_rdma(1)).unwrap(), 1 << 32 | 1, "only the LAST commands count");
    // cnfg_slave: CLR_STAT in CTRL_REG clears the READ counter, in CTRL_REG_2 the WRITE counter
    let clr = CtrlWord::clear_stat(1);
    m.write_csr(regs::CTRL_REG_2, 0).unwrap();
    m.write_csr(regs::CTRL_REG, clr).unwrap();
    assert_eq!(m.read_csr(regs::stat_rdma(1)).unwrap(), 1 << 32);
    post_command(&m, &Command::clear_stat(1)).unwrap();
    assert_eq!(m.read_csr(regs::stat_rdma(1)).unwrap(), 0);
    assert_eq!(f.stats(a.id).commands_accepted, 3, "CLR_STAT posts no command");
}

#[test]
fn double_posts_only_with_start_and_repeats_a_stale_ctrl_reg_2() {
    let (f, a, _b) = pair(OpcodeEncoding::CoyoteV2);
    let m = f.mmio(a.id);
    let w0 = f.stats(a.id).ctrl_writes;
    // a WRITE: CTRL_REG is the local word (no START), CTRL_REG_2 the remote one (START)
    let c = Command::rdma(OpcodeEncoding::CoyoteV2, &RdmaRequest::new(RdmaOp::Write, 1, A, B + 0x40, 8)).unwrap();
    // neither word active: nothing is posted
    m.write_csr(regs::CTRL_REG_2, c.ctrl_dst & !encoding::CTRL_START).unwrap();
    m.write_csr(regs::CTRL_REG, c.ctrl_src).unwrap();
    f.run(50);
    assert_eq!((f.stats(a.id).commands_accepted, f.stats(a.id).ctrl_writes - w0), (0, 1));
    // the real command
    post_command(&m, &c).unwrap();
    f.run(50);
    assert_eq!(f.stats(a.id).commands_completed, 1);
    // a driver that writes only CTRL_REG next (e.g. a CLR_STAT without rewriting CTRL_REG_2)
    // re-posts the WRITE: CTRL_REG_2 still holds START
    m.write_csr(regs::CTRL_REG, CtrlWord::clear_stat(1)).unwrap();
    f.run(50);
    let s = f.stats(a.id);
    assert_eq!((s.commands_accepted, s.stale_reposts, s.commands_completed), (2, 1, 2));
    // the shim's clearCompleted rewrites CTRL_REG_2 first, so it posts nothing
    post_command(&m, &Command::clear_stat(1)).unwrap();
    f.run(50);
    assert_eq!(f.stats(a.id).commands_accepted, 2);
}

#[test]
fn double_truncates_over_width_fields_and_drops_what_is_no_command() {
    let (f, a, b) = pair(OpcodeEncoding::AppOpcodes);
    let m = f.mmio(a.id);
    let mut mb = b.be;
    mb.write_local(B + 0x100, &[0xEE; 16]).unwrap();
    // an address beyond 48 bits: the shell takes [47:0], the request goes to B + 0x100
    let mut c =
        Command::rdma(OpcodeEncoding::AppOpcodes, &RdmaRequest::new(RdmaOp::Read, 1, A + 0x80, B + 0x100, 8)).unwrap();
    c.vaddr_rd |= 1 << 60;
    post_command(&m, &c).unwrap();
    // a length word beyond 28 bits: the shell takes [27:0] (here 4)
    let mut c =
        Command::rdma(OpcodeEncoding::AppOpcodes, &RdmaRequest::new(RdmaOp::Read, 1, A + 0x90, B + 0x100, 4)).unwrap();
    let big = |w: u64| w | (1u64 << 28) << 32;
    c.ctrl_src = big(c.ctrl_src);
    c.ctrl_dst = big(c.ctrl_dst);
    post_command(&m, &c).unwrap();
    f.run(100);
    let s = f.stats(a.id);
    assert_eq!((s.commands_accepted, s.commands_completed, s.decode_errors), (2, 2, 0), "truncated, not flagged");
    assert_eq!(get(&a.be, A + 0x80, 8), [0xEE; 8]);
    assert_eq!(get(&a.be, A + 0x90, 8), [0xEE, 0xEE, 0xEE, 0xEE, 0, 0, 0, 0]);
    assert_eq!(m.read_csr(regs::VADDR_RD_REG).unwrap(), B + 0x100, "read back [47:0]");
    // the other encoding's opcode, and two words neither of which is an active RDMA word
    let c = Command::rdma(OpcodeEncoding::CoyoteV2, &RdmaRequest::new(RdmaOp::Write, 1, A, B, 8)).unwrap();
    post_command(&m, &c).unwrap();
    let w = CtrlWord {
        opcode: 0x13,
        stream: Stream::Rdma,
        pid: 1,
        dest: 0,
        last: true,
        start: false,
        clr_stat: false,
        len: 8,
    }
    .encode()
    .unwrap();
    post_command(&m, &Command { vaddr_wr: B, ctrl_dst: w, vaddr_rd: A, ctrl_src: w }).unwrap();
    let s = f.stats(a.id);
    assert_eq!((s.decode_errors, s.commands_accepted), (1, 2), "one dropped by the parser, one never posted");
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
    assert_eq!(m.read_csr(regs::ISR_LEN_MISS_REG).unwrap(), 8);
}
