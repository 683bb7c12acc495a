//! Golden bit layouts: every register word and command, for both opcode encodings.

use omw_fpga::encoding::*;
use omw_fpga::ext::{self, Cqe};
use omw_fpga::regs;

fn read(ctid: u8) -> RdmaRequest {
    RdmaRequest::new(RdmaOp::Read, ctid, 0x1000, 0x2000, 64)
}

#[test]
fn opcode_numbering_per_firmware() {
    use OpcodeEncoding::*;
    assert_eq!(
        [CoyoteV2.encode(RdmaOp::Read), CoyoteV2.encode(RdmaOp::Write), CoyoteV2.encode(RdmaOp::Send)],
        [0, 1, 2]
    );
    assert_eq!(
        [AppOpcodes.encode(RdmaOp::Read), AppOpcodes.encode(RdmaOp::Write), AppOpcodes.encode(RdmaOp::Send)],
        [0x12, 0x13, 0x14]
    );
    // one firmware's numbers are not the other's
    assert_eq!(CoyoteV2.decode(0x12), None);
    assert_eq!(AppOpcodes.decode(1), None);
    for e in [CoyoteV2, AppOpcodes] {
        for op in RdmaOp::ALL {
            assert_eq!(e.decode(e.encode(op)), Some(op));
        }
    }
}

#[test]
fn read_command_words() {
    // remote side = source (CTRL_REG): opcode | stream RDMA | pid 5 | LAST | START | len 64
    let c = Command::rdma(OpcodeEncoding::AppOpcodes, &read(5)).unwrap();
    assert_eq!(c.vaddr_rd, 0x2000);
    assert_eq!(c.ctrl_src, 0x0000_0040_0030_1612);
    // local side = destination (CTRL_REG_2): stream HOST, no START
    assert_eq!(c.vaddr_wr, 0x1000);
    assert_eq!(c.ctrl_dst, 0x0000_0040_0010_1512);
    let c = Command::rdma(OpcodeEncoding::CoyoteV2, &read(5)).unwrap();
    assert_eq!(c.ctrl_src, 0x0000_0040_0030_1600);
    assert_eq!(c.ctrl_dst, 0x0000_0040_0010_1500);
}

#[test]
fn write_and_send_command_words() {
    for (op, app, leg) in [(RdmaOp::Write, 0x13u64, 1u64), (RdmaOp::Send, 0x14, 2)] {
        let r = RdmaRequest::new(op, 5, 0x1000, 0x2000, 64);
        for (enc, opc) in [(OpcodeEncoding::AppOpcodes, app), (OpcodeEncoding::CoyoteV2, leg)] {
            let c = Command::rdma(enc, &r).unwrap();
            // local side = source (CTRL_REG), remote side = destination (CTRL_REG_2)
            assert_eq!(c.vaddr_rd, 0x1000);
            assert_eq!(c.ctrl_src, 0x0000_0040_0010_1500 | opc);
            assert_eq!(c.vaddr_wr, 0x2000);
            assert_eq!(c.ctrl_dst, 0x0000_0040_0030_1600 | opc);
        }
    }
}

#[test]
fn control_word_fields() {
    let w = CtrlWord {
        opcode: 0x1f,
        stream: Stream::Tcp,
        pid: 63,
        dest: 15,
        last: true,
        start: true,
        clr_stat: true,
        len: 0x0FFF_FFFF,
    };
    assert_eq!(w.encode().unwrap(), 0x0FFF_FFFF_007F_FF1F);
    assert_eq!(CtrlWord::clear_stat(5), 0x0040_1400);
    let c = Command::clear_stat(5);
    assert_eq!((c.ctrl_src, c.ctrl_dst, c.vaddr_rd, c.vaddr_wr), (0x0040_1400, 0x0040_1400, 0, 0));
    // non-LAST
    let mut r = read(0);
    r.last = false;
    assert_eq!(Command::rdma(OpcodeEncoding::AppOpcodes, &r).unwrap().ctrl_src, 0x0000_0040_0020_0212);
}

#[test]
fn qp_context_words() {
    let ctx = QpContext {
        local_qpn: 0xC5,
        remote_rkey: 0xDEAD_BEEF,
        local_psn: 0x12_3456,
        remote_psn: 0xAB_CDEF,
        remote_vaddr: 0x7FFF_1234_5678,
    };
    assert_eq!(ctx.encode().unwrap(), [0xDEAD_BEEF_0000_00C5, 0x0000_ABCD_EF12_3456, 0x7FFF_1234_5678]);
    assert_eq!(QpContext::decode(ctx.encode().unwrap()), ctx);
    let bad = QpContext { remote_vaddr: 1 << 48, ..ctx };
    assert_eq!(bad.encode(), Err(EncodeError::AddressOverflow { addr: 1 << 48 }));
    let bad = QpContext { local_psn: 1 << 24, ..ctx };
    assert_eq!(bad.encode(), Err(EncodeError::PsnOverflow(1 << 24)));
}

#[test]
fn connection_words() {
    let c = ConnContext { local_qpn: 0xC5, remote_qpn: 0x12_3456, port: 18488, remote_ip: 0x0A00_0001 };
    assert_eq!(c.encode().unwrap(), [0x0048_3812_3456_00C5, 0x0A00_0001_0A00_0001, 0x0A00_0001_0A00_0001]);
    assert_eq!(ConnContext::decode(c.encode().unwrap()), c);
}

#[test]
fn qpn_layout() {
    assert_eq!(qpn(0, 0), Ok(0));
    assert_eq!(qpn(1, 0), Ok(0x40));
    assert_eq!(qpn(15, 63), Ok(0x3FF));
    assert_eq!(split_qpn(0x3FF), Some((15, 63)));
}

#[test]
fn stock_register_map() {
    assert_eq!(
        [regs::CTRL_REG, regs::VADDR_RD_REG, regs::CTRL_REG_2, regs::VADDR_WR_REG, regs::ISR_REG],
        [0, 1, 2, 3, 4]
    );
    assert_eq!(
        [regs::RDMA_CTX_REG_0, regs::RDMA_CONN_REG_0, regs::STAT_DMA_REG, regs::STAT_RDMA_REG],
        [40, 44, 64, 128]
    );
    assert_eq!(regs::stat_rdma(3), 131);
    assert_eq!(regs::reads_done(0x0000_0002_0000_0007), 7);
    assert_eq!(regs::writes_done(0x0000_0002_0000_0007), 2);
    assert_eq!((CMD_FIFO_DEPTH, MAX_OUTSTANDING_WRITES, MAX_OUTSTANDING_READS), (32, 16, 8));
    assert_eq!((MAX_LEN_FIELD, MAX_VADDR, MAX_TRANSFER_SIZE), ((1 << 28) - 1, (1 << 48) - 1, 1 << 27));
}

#[test]
fn extension_block_map() {
    assert_eq!(ext::id_word(), 0x4F4D_5758_0001_0000);
    assert_eq!(ext::DEFAULT_BASE * 8, 0x1000);
    assert_eq!(ext::qp_reg(3, ext::qp::SQ_PI), 64 + 3 * 32 + 10);
    assert_eq!(ext::BLOCK_WORDS, 64 + 64 * 32);
    const { assert!(ext::DEFAULT_BASE + ext::BLOCK_WORDS <= regs::CNFG_REGION_WORDS) };
    // the block must not overlap the stock registers
    const { assert!(ext::DEFAULT_BASE >= regs::STAT_RDMA_REG + 64) };
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
