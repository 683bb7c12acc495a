//! The register double is as strict as the Coyote v2 hardware it models, so a driver that
//! would fail on hardware fails here: shell configuration and ctids from the driver, the
//! valid/ready interfaces of `cnfg_slave.sv` (f1ef0b0), ARP before traffic, PSNs checked as
//! `rx_ibh_fsm` does (`ib_transport_protocol.cpp`, bca3563), no same-node loopback, SENDs into
//! the vFPGA stream. Each test drives either the shim or, where the shim no longer makes the mistake, the
//! raw registers the way a faulty driver (or the shim before issue 15) did.

mod support;

use omw_core::device::DataPath;
use omw_core::device::Provision;
use omw_core::wire::wqe::{QueueSel, Wqe};
use omw_fpga::double::{Fabric, NodeConfig};
use omw_fpga::driver::{CoyoteDriver, DriverError, ShellConfig};
use omw_fpga::encoding::{Command, ConnContext, OpcodeEncoding, QpContext, RdmaOp, RdmaRequest, DEFAULT_PMTU};
use omw_fpga::mmio::{post_command, write_block, Mmio};
use omw_fpga::{regs, Error, FpgaBackend, FpgaConfig, QpConnect};
use support::*;

const A: u64 = 0x1000_0000;
const B: u64 = 0x2000_0000;
const IP_A: u32 = 0x0A00_0001;
const IP_B: u32 = 0x0A00_0002;

fn open(f: &Fabric, id: omw_fpga::double::NodeId, threads: u8) -> Result<Be, Error> {
    FpgaBackend::open(
        f.mmio(id),
        f.user_csr(id),
        f.memory(id),
        FpgaConfig::new(0, OpcodeEncoding::CoyoteV2, 0).with_threads(threads),
    )
}

#[test]
fn avx_and_rdma_less_shells_are_refused_at_open() {
    let f = Fabric::new();
    let avx = ShellConfig { en_avx: true, en_rdma: true, ..ShellConfig::default() };
    let id = f.add_node(NodeConfig::stock(IP_A, A, 1 << 16).with_shell(avx));
    let e = open(&f, id, 0).unwrap_err();
    assert!(matches!(e, Error::AvxShell(c) if c == avx), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("EN_AVX=1") && msg.contains("cnfg_slave_avx"), "{msg}");
    let id = f.add_node(NodeConfig::stock(IP_B, B, 1 << 16).with_shell(ShellConfig::default()));
    assert!(matches!(open(&f, id, 0), Err(Error::NoRdma(_))));
}

#[test]
fn ctids_come_from_the_driver() {
    let f = Fabric::new();
    let id = f.add_node(NodeConfig::stock(IP_A, A, 1 << 16));
    let _b = f.add_node(NodeConfig::stock(IP_B, B, 1 << 16));
    let mut one = open(&f, id, 2).unwrap();
    let mut two = open(&f, id, 1).unwrap();
    assert_eq!(one.threads().collect::<Vec<_>>(), [0, 1]);
    assert_eq!(two.threads().collect::<Vec<_>>(), [2], "the driver picks the next free ctid");
    assert_eq!(one.config().local_ip, IP_A, "the address comes from IOCTL_GET_IP_ADDRESS");
    let c = QpConnect { remote_qpn: 5, remote_ip: IP_B, ..QpConnect::default() };
    assert!(matches!(one.connect_qp(2, &c), Err(Error::CtidNotRegistered(2))), "ctid 2 is the other thread's");
    assert!(matches!(two.connect_qp(7, &c), Err(Error::CtidNotRegistered(7))));
    two.connect_qp(2, &c).unwrap();
    // all 64 taken: the driver refuses the next one
    let mut three = open(&f, id, 61).unwrap();
    assert!(matches!(three.register_thread(), Err(Error::Driver(DriverError::NoFreeCtid))));
    f.mmio(id).unregister_ctid(0).unwrap();
    assert_eq!(three.register_thread().unwrap(), 0);
}

#[test]
fn context_read_back_is_the_ready_bit_and_an_early_commit_overwrites() {
    let f = Fabric::new();
    let a = host(&f, IP_A, A, false, OpcodeEncoding::CoyoteV2);
    let m = f.mmio(a.id);
    let ctx = |qpn: u32, psn: u32| {
        QpContext { local_qpn: qpn, remote_rkey: 0, local_psn: psn, remote_psn: psn, remote_vaddr: 0 }.encode().unwrap()
    };
    // word 2 reads back the interface's ready, words 0-1 their data (cnfg_slave read process)
    assert_eq!(m.read_csr(regs::RDMA_CTX_REG_2).unwrap(), 1);
    f.set_auto_tick(false);
    write_block(&m, regs::RDMA_CTX_REG_0, ctx(3, 0x33)).unwrap();
    assert_eq!(m.read_csr(regs::RDMA_CTX_REG_0).unwrap(), 3);
    f.tick(); // the stack takes the context and is busy for a while
    assert_eq!(m.read_csr(regs::RDMA_CTX_REG_2).unwrap(), 0);
    assert_eq!(f.qp_context(a.id, 3).map(|c| c.local_psn), Some(0x33));
    // a driver that does not wait for ready: its next commit is still pending when it writes
    // the one after, and the interface's data is the registers themselves
    write_block(&m, regs::RDMA_CTX_REG_0, ctx(4, 0x44)).unwrap();
    write_block(&m, regs::RDMA_CTX_REG_0, ctx(5, 0x55)).unwrap();
    f.run(20);
    assert_eq!(f.qp_context(a.id, 4), None, "the first commit was replaced before the stack took it");
    assert_eq!(f.qp_context(a.id, 5).map(|c| c.local_psn), Some(0x55));
    assert!(f.stats(a.id).interface_overwrites >= 3);
    assert_eq!(m.read_csr(regs::RDMA_CTX_REG_2).unwrap(), 1);
    // the shim waits for ready before each commit: no overwrite
    f.set_auto_tick(true);
    let mut a = a;
    let before = f.stats(a.id).interface_overwrites;
    for c in 10..14 {
        a.be.connect_qp(
            c,
            &QpConnect { remote_qpn: c as u32, remote_ip: IP_B, local_psn: c as u32, ..QpConnect::default() },
        )
        .unwrap();
    }
    assert_eq!(f.stats(a.id).interface_overwrites, before);
    for c in 10..14u8 {
        assert_eq!(f.qp_context(a.id, c).map(|x| x.local_psn), Some(c as u32));
    }
}

/// Connect A.1 → B.1 through raw registers, the way a driver without ARP (or with the raw
/// address in CONN) would.
fn raw_connect(f: &Fabric, a: &Host, b: &Host, conn_ip_word: u32, arp: bool) {
    for (h, ip) in [(a, conn_ip_word), (b, IP_A.swap_bytes())] {
        let m = f.mmio(h.id);
        let peer_qpn = 1;
        write_block(&m, regs::RDMA_CTX_REG_0, QpContext { local_qpn: 1, ..QpContext::default() }.encode().unwrap())
            .unwrap();
        while m.read_csr(regs::RDMA_CTX_REG_2).unwrap() & 1 == 0 {}
        let mut w = ConnContext { local_qpn: 1, remote_qpn: peer_qpn, port: 18488, remote_ip: 0 }.encode().unwrap();
        w[1] = (ip as u64) << 32 | ip as u64;
        w[2] = w[1];
        write_block(&m, regs::RDMA_CONN_REG_0, w).unwrap();
        while m.read_csr(regs::RDMA_CONN_REG_2).unwrap() & 1 == 0 {}
        if arp {
            let peer = if h.id == a.id { IP_B } else { IP_A };
            m.write_csr(regs::NET_ARP_REG, peer as u64).unwrap();
            while m.read_csr(regs::NET_ARP_REG).unwrap() & 1 == 0 {}
        }
    }
}

fn raw_write(f: &Fabric, a: &Host, remote: u64) {
    let c = Command::rdma(OpcodeEncoding::CoyoteV2, &RdmaRequest::new(RdmaOp::Write, 1, A, remote, 8)).unwrap();
    post_command(&f.mmio(a.id), &c).unwrap();
    f.run(200);
}

#[test]
fn the_raw_ip_in_conn_words_reaches_nobody() {
    let f = Fabric::new();
    let a = host(&f, IP_A, A, false, OpcodeEncoding::CoyoteV2);
    let b = host(&f, IP_B, B, false, OpcodeEncoding::CoyoteV2);
    // the pre-issue-15 shim wrote the address unswapped: 10.0.0.2 became 2.0.0.10
    raw_connect(&f, &a, &b, IP_B, true);
    raw_write(&f, &a, B + 0x10);
    let s = f.stats(a.id);
    assert_eq!((s.unroutable, s.commands_completed), (1, 0), "nobody answers: the write hangs");
    // gidToUint's byte order reaches B
    raw_connect(&f, &a, &b, IP_B.swap_bytes(), true);
    f.run(50);
    assert_eq!(f.stats(a.id).commands_completed, 1, "the retransmission now reaches B");
}

#[test]
fn traffic_needs_the_arp_lookup() {
    let f = Fabric::new();
    let a = host(&f, IP_A, A, false, OpcodeEncoding::CoyoteV2);
    let b = host(&f, IP_B, B, false, OpcodeEncoding::CoyoteV2);
    raw_connect(&f, &a, &b, IP_B.swap_bytes(), false);
    raw_write(&f, &a, B + 0x10);
    let s = f.stats(a.id);
    assert_eq!((s.arp_misses, s.commands_completed), (1, 0));
    // doArpLookup: the shell byte-swaps the written address into network order
    f.mmio(a.id).write_csr(regs::NET_ARP_REG, IP_B as u64).unwrap();
    f.run(50);
    assert_eq!(f.arp_table(a.id), [IP_B]);
    assert_eq!(f.stats(a.id).commands_completed, 1);
    // the shim looks the peer up itself
    let mut c = host(&f, 0x0A00_0003, 0x3000_0000, false, OpcodeEncoding::CoyoteV2);
    c.be.connect_qp(1, &QpConnect { remote_qpn: 1, remote_ip: IP_B, ..QpConnect::default() }).unwrap();
    assert_eq!(f.arp_table(c.id), [IP_B]);
}

#[test]
fn a_psn_mistake_hangs_the_qp() {
    let f = Fabric::new();
    let mut a = host(&f, IP_A, A, false, OpcodeEncoding::CoyoteV2);
    let mut b = host(&f, IP_B, B, false, OpcodeEncoding::CoyoteV2);
    let qb = b.be.qpn(1).unwrap().get();
    let qa = a.be.qpn(1).unwrap();
    // A starts sending at 0x100, B expects 0x101
    a.be.connect_qp(
        1,
        &QpConnect { remote_qpn: qb, remote_ip: IP_B, local_psn: 0x100, remote_psn: 0x200, ..QpConnect::default() },
    )
    .unwrap();
    b.be.connect_qp(
        1,
        &QpConnect {
            remote_qpn: qa.get(),
            remote_ip: IP_A,
            local_psn: 0x200,
            remote_psn: 0x101,
            ..QpConnect::default()
        },
    )
    .unwrap();
    a.be.post_send(qa, &Wqe::write(A, 0, 8, B, 0).with_wr_id(1)).unwrap();
    assert!(drain(&mut a.be, qa, QueueSel::Send, 200).is_empty(), "dropped and retransmitted with the same PSN");
    assert_eq!(f.stats(a.id).psn_drops, 1);
    // matching PSNs: each request moves both ends on by its packets (ceil(len / PMTU))
    b.be.connect_qp(
        1,
        &QpConnect {
            remote_qpn: qa.get(),
            remote_ip: IP_A,
            local_psn: 0x200,
            remote_psn: 0x100,
            ..QpConnect::default()
        },
    )
    .unwrap();
    assert_eq!(wait1(&mut a.be, qa, QueueSel::Send).wr_id, 1);
    a.be.post_send(qa, &Wqe::write(A, 0, 3 * DEFAULT_PMTU, B, 0).with_wr_id(2)).unwrap();
    assert_eq!(wait1(&mut a.be, qa, QueueSel::Send).wr_id, 2);
    assert_eq!(f.psns(a.id, 1).0, 0x100 + 1 + 3);
    assert_eq!(f.psns(b.id, 1).1, 0x100 + 1 + 3);
}

#[test]
fn the_stock_engine_does_not_loop_back() {
    let f = Fabric::new();
    let mut a = host(&f, IP_A, A, false, OpcodeEncoding::CoyoteV2);
    let q2 = a.be.qpn(2).unwrap().get();
    let e = a.be.connect_qp(1, &QpConnect { remote_qpn: q2, remote_ip: IP_A, ..QpConnect::default() }).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }) && e.to_string().contains("loop back"), "{e}");
    // through raw registers the request goes out and nothing comes back
    let m = f.mmio(a.id);
    for (c, peer) in [(1u32, 2u32), (2, 1)] {
        write_block(&m, regs::RDMA_CTX_REG_0, QpContext { local_qpn: c, ..QpContext::default() }.encode().unwrap())
            .unwrap();
        while m.read_csr(regs::RDMA_CTX_REG_2).unwrap() & 1 == 0 {}
        let w = ConnContext { local_qpn: c, remote_qpn: peer, port: 18488, remote_ip: IP_A }.encode().unwrap();
        write_block(&m, regs::RDMA_CONN_REG_0, w).unwrap();
        while m.read_csr(regs::RDMA_CONN_REG_2).unwrap() & 1 == 0 {}
    }
    post_command(
        &m,
        &Command::rdma(OpcodeEncoding::CoyoteV2, &RdmaRequest::new(RdmaOp::Write, 1, A, A + 0x100, 8)).unwrap(),
    )
    .unwrap();
    f.run(100);
    let s = f.stats(a.id);
    assert_eq!((s.loopback_drops, s.commands_completed), (1, 0));
}

#[test]
fn sends_are_one_packet() {
    let f = Fabric::new();
    let mut a = host(&f, IP_A, A, false, OpcodeEncoding::CoyoteV2);
    let mut b = host(&f, IP_B, B, false, OpcodeEncoding::CoyoteV2);
    connect(&mut a, 1, &mut b, 1, (0, 0), (0, 0));
    let qa = a.be.qpn(1).unwrap();
    let e = a.be.post_send(qa, &Wqe::send(A, 0, DEFAULT_PMTU + 1)).unwrap_err();
    assert!(matches!(e, Error::SendTooLong { len, pmtu: DEFAULT_PMTU } if len == DEFAULT_PMTU + 1), "{e}");
    a.be.post_send(qa, &Wqe::send(A, 0, DEFAULT_PMTU).with_wr_id(9)).unwrap();
    assert_eq!(wait1(&mut a.be, qa, QueueSel::Send).wr_id, 9);
    let rx = f.take_stream_rx(b.id);
    assert_eq!((rx.len(), rx[0].0, rx[0].1.len()), (1, 1, DEFAULT_PMTU as usize));
    // the stack itself splits a longer SEND into FIRST/MIDDLE/LAST (rdma_req_parser.sv), one PSN
    // each: the shim's one-packet limit is its own, conservative choice (docs/FPGA.md §9)
    let c =
        Command::rdma(OpcodeEncoding::CoyoteV2, &RdmaRequest::new(RdmaOp::Send, 1, A, 0, DEFAULT_PMTU + 64)).unwrap();
    let psn = f.psns(a.id, 1).0;
    post_command(&f.mmio(a.id), &c).unwrap();
    f.run(100);
    assert_eq!(f.take_stream_rx(b.id)[0].1.len(), DEFAULT_PMTU as usize + 64);
    assert_eq!(f.psns(a.id, 1).0, psn + 2);
}

#[test]
fn sequencer_requests_obey_the_same_psn_rule() {
    let f = Fabric::new();
    let mut a = host(&f, IP_A, A, true, OpcodeEncoding::CoyoteV2);
    let mut b = host(&f, IP_B, B, true, OpcodeEncoding::CoyoteV2);
    setup(&mut a, 1, omw_fpga::QpSetup::plain(16, 0));
    setup(&mut b, 1, omw_fpga::QpSetup::plain(16, 0));
    let (qa, qb) = (a.be.qpn(1).unwrap(), b.be.qpn(1).unwrap());
    let lkey =
        a.be.reg_mr(omw_core::device::Domain::CnFacing, A, 0x1000, omw_core::access::AccessFlags::LOCAL_WRITE)
            .unwrap()
            .lkey;
    let rights = omw_core::access::AccessFlags::LOCAL_WRITE | omw_core::access::AccessFlags::REMOTE_WRITE;
    let rkey = b.be.reg_mr(omw_core::device::Domain::CnFacing, B, 0x1000, rights).unwrap().rkey;
    a.be.connect_qp(
        1,
        &QpConnect { remote_qpn: qb.get(), remote_ip: IP_B, local_psn: 7, remote_psn: 9, ..QpConnect::default() },
    )
    .unwrap();
    b.be.connect_qp(
        1,
        &QpConnect { remote_qpn: qa.get(), remote_ip: IP_A, local_psn: 9, remote_psn: 8, ..QpConnect::default() },
    )
    .unwrap();
    a.be.post_send(qa, &Wqe::write(A, lkey, 8, B, rkey).with_wr_id(1)).unwrap();
    assert!(drain(&mut a.be, qa, QueueSel::Send, 200).is_empty(), "the ring hangs on its head WQE");
    assert_eq!(f.stats(a.id).psn_drops, 1, "counted once, retransmitted silently");
    b.be.connect_qp(
        1,
        &QpConnect { remote_qpn: qa.get(), remote_ip: IP_A, local_psn: 9, remote_psn: 7, ..QpConnect::default() },
    )
    .unwrap();
    assert_eq!(wait1(&mut a.be, qa, QueueSel::Send).status, omw_core::device::WcStatus::Success);
    assert_eq!((f.psns(a.id, 1).0, f.psns(b.id, 1).1), (8, 8));
}
