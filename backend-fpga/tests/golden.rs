//! Golden vectors: every expected word below is derived from the Coyote v2 source, which is
//! cited at each test. The sources (fpgasystems/Coyote; the `sw/include/coyote/` layout and
//! 2025 MIT headers are Coyote v2's):
//!
//! * `sw/include/coyote/cDefs.hpp`, `sw/include/coyote/cOps.hpp`, `sw/src/cThread.cpp` at
//!   commit 4459debfbb7ba8107c2058c9c283cbc96de6d566 ("SW");
//! * `hw/hdl/shell/cnfg_slave.sv` at f1ef0b0fa439720af6d3da95b6d3d67587f60069 ("SHELL");
//! * `hw/services/network/hls/ib_transport_protocol/ib_transport_protocol.{hpp,cpp}` and
//!   `hw/hdl/network/rdma/rdma_req_parser.sv` at bca35638224a22fc03101915354bb68628ba91a8
//!   ("STACK");
//! * `cmake/FindCoyoteHW.cmake` at c81d68f314d9ad1cc5100b660524649a17640144 ("CMAKE");
//! * `hw/scripts/wr_hdl/template_gen/lynx_pkg.txt` at bca3563 and 05090aa802cb75d4c57c12d11e0331d90382312d;
//! * IB wire opcodes: Linux `include/rdma/ib_pack.h`, `enum { IB_OPCODE_* }`.
//!
//! Where a test re-implements a Coyote function (`uintToGid` / `gidToUint`, the
//! `cThread::invoke` word formulas), it does so line by line from the source so the shim's
//! encoder is compared with Coyote's algorithm, not with itself.

use omw_core::device::DataPath;
use omw_core::wire::wqe::Wqe;
use omw_fpga::double::{Fabric, NodeConfig, SimMmio};
use omw_fpga::driver::{self, CoyoteDriver, DriverError, ShellConfig};
use omw_fpga::encoding::*;
use omw_fpga::ext::{self, wire, Cqe};
use omw_fpga::mmio::{Mmio, MmioError};
use omw_fpga::{regs, FpgaBackend, FpgaConfig, QpConnect};
use std::cell::RefCell;

// ---- SW cDefs.hpp / cOps.hpp constants --------------------------------------------------------

const CTRL_STRM_OFFS: u64 = 8;
const CTRL_PID_OFFS: u64 = 10;
const CTRL_DEST_OFFS: u64 = 16;
const CTRL_LAST: u64 = 1 << 20;
const CTRL_START: u64 = 1 << 21;
const CTRL_CLR_STAT: u64 = 1 << 22;
const CTRL_LEN_OFFS: u64 = 32;
const STRM_HOST: u64 = 1;
const STRM_RDMA: u64 = 2;
/// `CoyoteOper`: REMOTE_RDMA_READ = 6, REMOTE_RDMA_WRITE = 7, REMOTE_RDMA_SEND = 8.
const REMOTE_RDMA_READ: u64 = 6;
const REMOTE_RDMA_WRITE: u64 = 7;
const REMOTE_RDMA_SEND: u64 = 8;
const REMOTE_OFFS_OPS: u64 = 6;

/// `cThread::invoke(CoyoteOper, rdmaSg, bool last)`, the non-memcpy branch: returns
/// `(offs_3, offs_2, offs_1, offs_0)` as passed to `postCmd`, i.e.
/// `(VADDR_WR, CTRL_REG_2, VADDR_RD, CTRL_REG)`.
fn coyote_invoke(oper: u64, ctid: u64, local: u64, remote: u64, len: u64, last: bool) -> [u64; 4] {
    let op = (oper - REMOTE_OFFS_OPS) & 0x1f;
    let last = if last { CTRL_LAST } else { 0 };
    let l = op | (ctid & 0x3f) << CTRL_PID_OFFS | last | (STRM_HOST & 3) << CTRL_STRM_OFFS | len << CTRL_LEN_OFFS;
    let r = op
        | (ctid & 0x3f) << CTRL_PID_OFFS
        | last
        | (STRM_RDMA & 3) << CTRL_STRM_OFFS
        | CTRL_START
        | len << CTRL_LEN_OFFS;
    let read = oper == REMOTE_RDMA_READ;
    let (src, asrc, dst, adst) = if read { (r, remote, l, local) } else { (l, local, r, remote) };
    [adst, dst, asrc, src]
}

/// `ibvQ::uintToGid(idx, ip)` (`%08x`, 8 characters) then `ibvQ::gidToUint(idx)`
/// (`sscanf("%x")`, `ntohl`) — on the little-endian hosts Coyote runs on.
fn coyote_gid_to_uint(ip: u32) -> u32 {
    let gid = format!("{ip:08x}");
    let v32 = u32::from_str_radix(&gid, 16).unwrap();
    u32::from_be(v32) // ntohl
}

#[test]
fn rdma_opcodes_are_coyote_oper_minus_remote_offs_ops() {
    // SW cOps.hpp CoyoteOper, cDefs.hpp REMOTE_OFFS_OPS = 6, cThread::invoke
    let e = OpcodeEncoding::CoyoteV2;
    assert_eq!(e.encode(RdmaOp::Read) as u64, REMOTE_RDMA_READ - REMOTE_OFFS_OPS);
    assert_eq!(e.encode(RdmaOp::Write) as u64, REMOTE_RDMA_WRITE - REMOTE_OFFS_OPS);
    assert_eq!(e.encode(RdmaOp::Send) as u64, REMOTE_RDMA_SEND - REMOTE_OFFS_OPS);
    assert_eq!([e.encode(RdmaOp::Read), e.encode(RdmaOp::Write), e.encode(RdmaOp::Send)], [0, 1, 2]);
    // the APP_* numbering is another encoding; neither decodes the other's numbers
    let a = OpcodeEncoding::AppOpcodes;
    assert_eq!([a.encode(RdmaOp::Read), a.encode(RdmaOp::Write), a.encode(RdmaOp::Send)], [0x12, 0x13, 0x14]);
    assert_eq!(e.decode(0x12), None);
    assert_eq!(a.decode(1), None);
}

#[test]
fn command_words_are_what_cthread_invoke_posts() {
    // SW cThread::invoke(oper, rdmaSg, last) and cThread::postCmd's write order
    for (oper, op) in
        [(REMOTE_RDMA_READ, RdmaOp::Read), (REMOTE_RDMA_WRITE, RdmaOp::Write), (REMOTE_RDMA_SEND, RdmaOp::Send)]
    {
        for (ctid, len, last) in [(5u8, 64u32, true), (0, 1, false), (63, (1 << 28) - 1, true)] {
            let mut r = RdmaRequest::new(op, ctid, 0x7000_1000, 0x0000_2000_0040, len);
            r.last = last;
            let c = Command::rdma(OpcodeEncoding::CoyoteV2, &r).unwrap();
            let want = coyote_invoke(oper, ctid as u64, r.local_addr, r.remote_addr, len as u64, last);
            assert_eq!([c.vaddr_wr, c.ctrl_dst, c.vaddr_rd, c.ctrl_src], want, "{op:?} ctid {ctid} len {len}");
        }
    }
    // one literal: READ of 64 bytes by ctid 5
    let c = Command::rdma(OpcodeEncoding::CoyoteV2, &RdmaRequest::new(RdmaOp::Read, 5, 0x1000, 0x2000, 64)).unwrap();
    assert_eq!((c.ctrl_src, c.ctrl_dst), (0x0000_0040_0030_1600, 0x0000_0040_0010_1500));
    // cThread::clearCompleted: CTRL_REG_2 then CTRL_REG = CTRL_CLR_STAT | ctid << CTRL_PID_OFFS
    let clr = CTRL_CLR_STAT | 5 << CTRL_PID_OFFS;
    let c = Command::clear_stat(5);
    assert_eq!((c.ctrl_dst, c.ctrl_src), (clr, clr));
    assert_eq!(clr, 0x0040_1400);
    assert_eq!(CTRL_DEST_OFFS, DEST_OFFS as u64);
}

#[test]
fn qp_context_words_are_write_qp_context() {
    // SW cThread::writeQpContext: offs[0] = qpn[23:0] << 0 | rkey << 32,
    // offs[1] = lpsn[23:0] | rpsn[23:0] << 24, offs[2] = vaddr[47:0]
    let ctx = QpContext {
        local_qpn: 0xC5,
        remote_rkey: 0xDEAD_BEEF,
        local_psn: 0x12_3456,
        remote_psn: 0xAB_CDEF,
        remote_vaddr: 0x7FFF_1234_5678,
    };
    let want = [0xC5 | 0xDEAD_BEEFu64 << 32, 0x12_3456 | 0xAB_CDEFu64 << 24, 0x7FFF_1234_5678];
    assert_eq!(ctx.encode().unwrap(), want);
    assert_eq!(QpContext::decode(want), ctx);
}

#[test]
fn connection_words_carry_gid_to_uint_of_the_remote_ip() {
    // SW cDefs.hpp ibvQ::gidToUint / uintToGid, cThread::writeQpContext:
    // offs[0] = port << 40 | rqpn[23:0] << 16 | lqpn[15:0]
    // offs[1] = gidToUint(8) << 32 | gidToUint(0), offs[2] = gidToUint(24) << 32 | gidToUint(16)
    let ip = 0x0A00_0001; // 10.0.0.1 as IOCTL_GET_IP_ADDRESS reports it
    let g = coyote_gid_to_uint(ip) as u64;
    assert_eq!(g, 0x0100_000A);
    let c = ConnContext { local_qpn: 0xC5, remote_qpn: 0x12_3456, port: 18488, remote_ip: ip };
    let w = c.encode().unwrap();
    assert_eq!(w, [18488u64 << 40 | 0x12_3456 << 16 | 0xC5, g << 32 | g, g << 32 | g]);
    assert_eq!(w[1], 0x0100_000A_0100_000A, "what Coyote writes for 10.0.0.1");
    assert_eq!(ConnContext::decode(w), c);
    for ip in [0xC0A8_0102u32, 0x0102_0304, 0xFFFF_FFFF, 0] {
        assert_eq!(gid_word(ip), coyote_gid_to_uint(ip));
    }
}

#[test]
fn ioctl_numbers_and_shell_config_bits() {
    // SW cDefs.hpp: _IOW('F', 1/2, unsigned long), _IOR('F', 13/15, unsigned long) on x86-64
    // (_IOC: dir << 30 | size << 16 | type << 8 | nr, _IOC_WRITE = 1, _IOC_READ = 2)
    assert_eq!(driver::IOCTL_REGISTER_CTID, 0x4008_4601);
    assert_eq!(driver::IOCTL_UNREGISTER_CTID, 0x4008_4602);
    assert_eq!(driver::IOCTL_GET_IP_ADDRESS, 0x8008_460D);
    assert_eq!(driver::IOCTL_READ_SHELL_CONFIG, 0x8008_460F);
    assert_eq!((driver::MAX_USER_ARGS, driver::N_CTID_MAX), (32, 64));
    // fpgaCnfg::parseCnfg: avx 0, wb 1, strm 2, mem 3, pr 4, rdma 16, tcp 17, xdma [39:32], regions [55:48]
    let c = ShellConfig::parse(1 | 1 << 16 | 3 << 32 | 2 << 48);
    assert!(c.en_avx && c.en_rdma && !c.en_tcp && !c.en_wb);
    assert_eq!((c.n_xdma_chan, c.n_fpga_reg), (3, 2));
    assert_eq!(ShellConfig::parse(c.encode()), c);
    assert!(ShellConfig::parse(1 << 17).en_tcp && ShellConfig::parse(1 << 2).en_strm);
}

#[test]
fn register_maps_and_regions() {
    // SW cDefs.hpp CnfgLegRegs
    assert_eq!(
        [regs::CTRL_REG, regs::VADDR_RD_REG, regs::CTRL_REG_2, regs::VADDR_WR_REG, regs::ISR_REG],
        [0, 1, 2, 3, 4]
    );
    assert_eq!(
        [regs::ISR_PID_MISS_REG, regs::ISR_VADDR_MISS_REG, regs::ISR_LEN_MISS_REG, regs::STAT_REG_0],
        [5, 6, 7, 8]
    );
    assert_eq!(regs::NET_ARP_REG, 36);
    assert_eq!(
        [regs::RDMA_CTX_REG_0, regs::RDMA_CTX_REG_2, regs::RDMA_CONN_REG_0, regs::RDMA_CONN_REG_2],
        [40, 42, 44, 46]
    );
    assert_eq!([regs::STAT_DMA_REG, regs::STAT_RDMA_REG, regs::stat_rdma(3)], [64, 128, 131]);
    // SW cDefs.hpp CnfgAvxRegs (the map the shim refuses)
    assert_eq!(
        [
            regs::avx::CTRL_REG,
            regs::avx::ISR_REG,
            regs::avx::NET_ARP_REG,
            regs::avx::RDMA_CTX_REG,
            regs::avx::RDMA_CONN_REG
        ],
        [0, 1, 9, 10, 11]
    );
    // SW cDefs.hpp MMAP_* (<< PAGE_SHIFT 12) and region sizes
    assert_eq!((regs::MMAP_CNFG_OFFSET, regs::MMAP_CNFG_AVX_OFFSET, regs::MMAP_CTRL_OFFSET), (0x1000, 0x2000, 0x3000));
    assert_eq!(
        (regs::CNFG_REGION_WORDS * 8, regs::CTRL_REGION_WORDS * 8, regs::avx::REGION_BYTES),
        (65536, 65536, 262144)
    );
    // SHELL cnfg_slave.sv ISR_* write bits
    use regs::isr::*;
    assert_eq!(
        [CLR_IRQ_PENDING, RESTART_RD, RESTART_WR, SUCCESS, INVLDT, INVLDT_LAST, INVLDT_LOCK],
        [1, 2, 4, 8, 16, 32, 64]
    );
    assert_eq!((STAT_INVLDT_READY, STAT_PFAULT_READY), (1 << 32, 1 << 33));
    // SW cDefs.hpp CMD_FIFO_DEPTH / CMD_FIFO_THR / MAX_TRANSFER_SIZE
    assert_eq!((CMD_FIFO_DEPTH, CMD_FIFO_THR, CMD_FIFO_LIMIT), (32, 10, 22));
    assert_eq!(MAX_TRANSFER_SIZE, 128 * 1024 * 1024);
    assert_eq!((MAX_LEN_FIELD, MAX_VADDR), ((1 << 28) - 1, (1 << 48) - 1));
    // CMAKE defaults: PMTU_BYTES 4096, N_OUTSTANDING 8 (outstanding READs per QP)
    assert_eq!((DEFAULT_PMTU, MAX_OUTSTANDING_READS), (4096, 8));
    assert_eq!(regs::reads_done(0x0000_0002_0000_0007), 7);
    assert_eq!(regs::writes_done(0x0000_0002_0000_0007), 2);
}

#[test]
fn atomic_wire_opcodes_do_not_collide_with_coyote_opcodes() {
    // ib_pack.h: IB_OPCODE_ATOMIC_ACKNOWLEDGE 0x12, COMPARE_SWAP 0x13, FETCH_ADD 0x14
    assert_eq!((wire::IB_ATOMIC_ACKNOWLEDGE, wire::IB_COMPARE_SWAP, wire::IB_FETCH_ADD), (0x12, 0x13, 0x14));
    // STACK ib_transport_protocol.hpp ibOpCode: RC_SEND_ONLY 0x04 .. RC_ACK 0x11 is the last
    assert_eq!(wire::COYOTE_RC_ACK, 0x11);
    // hw/scripts/wr_hdl/template_gen/lynx_pkg.txt (bca3563, 05090aa): APP_READ .. APP_IMMED = 0..3,
    // what cThread writes too; they share the field with IB opcodes (RC SEND_* 0x00-0x03)
    assert_eq!(wire::COYOTE_APP_LYNX_PKG, [0, 1, 2, 3]);
    let v2 = OpcodeEncoding::CoyoteV2;
    assert_eq!([v2.encode(RdmaOp::Read), v2.encode(RdmaOp::Write), v2.encode(RdmaOp::Send)], [0, 1, 2]);
    // the collision the issue names: in DESIGN.md's reading APP_* sit on the IB atomics
    for ib in [wire::IB_ATOMIC_ACKNOWLEDGE, wire::IB_COMPARE_SWAP, wire::IB_FETCH_ADD] {
        assert!(wire::COYOTE_APP_DESIGN.contains(&ib));
    }
    // the block's internal encoding avoids both APP_* numberings, every stock ibOpCode, every
    // IB RC opcode defined in ib_pack.h (0x00..=0x17) and the 5-bit field's limit
    for x in wire::EXT_ATOMICS {
        assert!(!wire::COYOTE_APP_DESIGN.contains(&x) && !wire::COYOTE_APP_LYNX_PKG.contains(&x), "{x:#x}");
        assert!(x > 0x17 && x <= 0x1F, "{x:#x}");
        assert_eq!(wire::to_wire(x).and_then(wire::from_wire).unwrap_or(x), x);
    }
    assert_eq!(wire::to_wire(wire::EXT_MASKED_FETCH_ADD), None, "masked fetch-add never leaves the engine");
    assert_eq!(wire::from_wire(0x0A), None, "RC_RDMA_WRITE_ONLY is not an atomic");
}

#[test]
fn extension_block_map() {
    assert_eq!(ext::id_word(), 0x4F4D_5758_0002_0000);
    assert_eq!(ext::DEFAULT_BASE, 0);
    assert_eq!(ext::qp_reg(3, ext::qp::SQ_PI), 64 + 3 * 32 + 10);
    assert_eq!(ext::BLOCK_WORDS, 64 + 64 * 32);
    // the block lives in the user CSR region (MMAP_CTRL), which the user logic decodes
    const { assert!(ext::DEFAULT_BASE + ext::BLOCK_WORDS <= regs::CTRL_REGION_WORDS) };
    const { assert!(ext::qp::CMD_STATUS < ext::QP_STRIDE) };
    assert_eq!(ext::key_cmd_word(ext::key_cmd::REG_MR, 0xAB), 0xAB01);
    assert_eq!(ext::key_result_tag(ext::KEY_RESULT_DONE | 0xAB << 40), 0xAB);
    let c = Cqe {
        wr_id: 0x0102_0304_0506_0708,
        status: 10,
        opcode: 0x81,
        flags: 3,
        byte_len: 0x40,
        imm: 0xAABB_CCDD,
        qpn: 0xC5,
        invalidated: 0x1234,
    };
    let b = c.encode();
    assert_eq!(&b[0..8], &0x0102_0304_0506_0708u64.to_le_bytes());
    assert_eq!((b[8], b[9], b[10], b[11]), (10, 0x81, 3, 0));
    assert_eq!(&b[12..16], &0x40u32.to_le_bytes());
    assert_eq!(&b[16..20], &0xAABB_CCDDu32.to_le_bytes());
    assert_eq!(&b[20..24], &0xC5u32.to_le_bytes());
    assert_eq!(&b[24..28], &0x1234u32.to_le_bytes());
    assert_eq!(&b[28..32], &[0; 4]);
    assert_eq!(Cqe::decode(&b), c);
}

// ---- the register writes of a whole connection and a command --------------------------------

/// Logs every write into a region, passing it on to the double.
struct Rec {
    inner: SimMmio,
    log: RefCell<Vec<(usize, u64)>>,
}

impl Mmio for Rec {
    fn read_csr(&self, reg: usize) -> Result<u64, MmioError> {
        self.inner.read_csr(reg)
    }
    fn write_csr(&self, reg: usize, value: u64) -> Result<(), MmioError> {
        self.log.borrow_mut().push((reg, value));
        self.inner.write_csr(reg, value)
    }
}

impl CoyoteDriver for Rec {
    fn shell_config(&self) -> Result<ShellConfig, DriverError> {
        self.inner.shell_config()
    }
    fn register_ctid(&self, hpid: u32) -> Result<u8, DriverError> {
        self.inner.register_ctid(hpid)
    }
    fn unregister_ctid(&self, ctid: u8) -> Result<(), DriverError> {
        self.inner.unregister_ctid(ctid)
    }
    fn ip_address(&self) -> Result<u32, DriverError> {
        self.inner.ip_address()
    }
}

#[test]
fn init_rdma_register_sequence() {
    // SW cThread::cThread → clearCompleted (CTRL_REG_2 then CTRL_REG = CLR_STAT | ctid);
    // cThread::initRDMA → writeQpContext(port) (CTX 0,1,2 then CONN 0,1,2) →
    // doArpLookup(remote.ip_addr) (NET_ARP_REG = ip); then an invoke → postCmd (VADDR_WR,
    // CTRL_REG_2, VADDR_RD, CTRL_REG)
    let f = Fabric::new();
    let (ip_a, ip_b) = (0x0A00_0001, 0x0A00_0002);
    let a = f.add_node(NodeConfig::stock(ip_a, 0x1000_0000, 1 << 20));
    let _b = f.add_node(NodeConfig::stock(ip_b, 0x2000_0000, 1 << 20));
    let cnfg = Rec { inner: f.mmio(a), log: RefCell::new(Vec::new()) };
    let csr = Rec { inner: f.user_csr(a), log: RefCell::new(Vec::new()) };
    let mut be =
        FpgaBackend::open(&cnfg, &csr, f.memory(a), FpgaConfig::new(0, OpcodeEncoding::CoyoteV2, ip_a).with_threads(1))
            .unwrap();
    let ctid = be.threads().next().unwrap();
    assert_eq!(ctid, 0, "the driver hands out ctid 0 first");
    let conn = QpConnect {
        remote_qpn: 0x02,
        remote_ip: ip_b,
        local_psn: 0x11_1111,
        remote_psn: 0x22_2222,
        remote_rkey: 0,
        remote_vaddr: 0x2000_0100,
        port: 18488,
    };
    let qp = be.connect_qp(ctid, &conn).unwrap();
    be.post_send(qp, &Wqe::write(0x1000_0000, 0, 64, 0x2000_0200, 0).with_wr_id(1)).unwrap();
    let g = coyote_gid_to_uint(ip_b) as u64;
    let clr = CTRL_CLR_STAT;
    let inv = coyote_invoke(REMOTE_RDMA_WRITE, 0, 0x1000_0000, 0x2000_0200, 64, true);
    let want = vec![
        // the constructor's clearCompleted for the registered thread
        (regs::VADDR_WR_REG, 0),
        (regs::CTRL_REG_2, clr),
        (regs::VADDR_RD_REG, 0),
        (regs::CTRL_REG, clr),
        // initRDMA: writeQpContext, doArpLookup
        (regs::RDMA_CTX_REG_0, 0),
        (regs::RDMA_CTX_REG_1, 0x11_1111 | 0x22_2222 << 24),
        (regs::RDMA_CTX_REG_2, 0x2000_0100),
        (regs::RDMA_CONN_REG_0, 18488 << 40 | 0x02 << 16),
        (regs::RDMA_CONN_REG_1, g << 32 | g),
        (regs::RDMA_CONN_REG_2, g << 32 | g),
        (regs::NET_ARP_REG, ip_b as u64),
        // invoke → postCmd
        (regs::VADDR_WR_REG, inv[0]),
        (regs::CTRL_REG_2, inv[1]),
        (regs::VADDR_RD_REG, inv[2]),
        (regs::CTRL_REG, inv[3]),
    ];
    assert_eq!(*cnfg.log.borrow(), want);
    assert!(csr.log.borrow().is_empty(), "a stock build has no extension block: nothing written there");
}
