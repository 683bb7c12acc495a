//! Golden vectors for `omw_core::mlx5`.
//!
//! Part 1 compiles `mlx5_golden.c` against the installed rdma-core headers
//! (`/usr/include/infiniband/mlx5dv.h`; Debian libibverbs-dev — this suite was written against
//! 44.0-2, the version is printed) and compares every constant, struct layout and WQE it prints
//! with the Rust encoding, byte for byte.
//!
//! Part 2 covers what mlx5dv.h does not define, with bytes written by hand from the cited
//! sources: the masked fetch-and-add segment (UCX master 9466d104a317c8ffddd9734e72055d8bbda021b3,
//! src/uct/ib/mlx5/ib_mlx5.h `uct_ib_mlx5_atomic_masked_fadd64_seg`, rc_mlx5.inl), the WAIT /
//! SEND_EN queue segment (DPDK main 38f72e500b3b159eca3ba2f4ca0e46a26a7cb057,
//! drivers/common/mlx5/mlx5_prm.h `mlx5_wqe_qseg`, drivers/net/mlx5/mlx5_txpp.c) and the PRM
//! commands (DPDK mlx5_prm.h at that commit, and rdma-core v44.0
//! e018d7f3876c315df29060d0a6c95b8abca2b09d providers/mlx5/mlx5_ifc.h for the fields it has —
//! the two agree on every one; `cqc`, `create_cq_in`, `wq_umem_offset`, `qpc_ext` and
//! `sq_ts_format` / `rq_ts_format` are DPDK's alone: each expected byte below is the DEVX_SET
//! result for the field's bit offset there — `dword = off / 32`,
//! `shift = 32 - off % 32 - width`).

use omw_core::access::AccessFlags;
use omw_core::mlx5::ctrl::{CeSe, CtrlSeg, FenceMode, FmCeSe, PrevWqe};
use omw_core::mlx5::encode::{encode, QueueResolver};
use omw_core::mlx5::prm::hca_cap::{self, HcaCaps, MissingCap};
use omw_core::mlx5::prm::{cq, qp};
use omw_core::mlx5::umr::{self, MkeyAccess, MkeyMask, UmrFlags};
use omw_core::mlx5::wqebb::WqeIndex;
use omw_core::mlx5::{ctrl, data, opcode, raddr, Mlx5Error};
use omw_core::wire::wqe::{QueueSel, Wqe};
use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use zerocopy::IntoBytes;

const HEADER: &str = "/usr/include/infiniband/mlx5dv.h";

struct Golden {
    bytes: HashMap<String, Vec<u8>>,
    values: HashMap<String, u64>,
}

/// Compiled and run once per test process (the tests run in parallel).
fn golden() -> &'static Golden {
    static G: std::sync::OnceLock<Golden> = std::sync::OnceLock::new();
    G.get_or_init(build_golden)
}

fn build_golden() -> Golden {
    assert!(
        Path::new(HEADER).exists(),
        "{HEADER} is missing: install libibverbs-dev (scripts/setup does) — the golden vectors come from it"
    );
    let version = Command::new("dpkg-query")
        .args(["-W", "-f=${Version}", "libibverbs-dev"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    eprintln!("mlx5 golden vectors from {HEADER}, libibverbs-dev {version:?} (written against 44.0-2)");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let exe = dir.join("mlx5_golden");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/mlx5_golden.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .args(["-std=gnu11", "-O0", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?}: {e}"));
    assert!(st.success(), "compiling {} failed", src.display());
    let out = Command::new(&exe).output().expect("run mlx5_golden");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let mut g = Golden { bytes: HashMap::new(), values: HashMap::new() };
    for line in text.lines() {
        if let Some((k, v)) = line.split_once(" = ") {
            g.values.insert(k.to_string(), v.parse().unwrap());
        } else if let Some((k, v)) = line.split_once(' ') {
            let b = (0..v.len()).step_by(2).map(|i| u8::from_str_radix(&v[i..i + 2], 16).unwrap()).collect();
            g.bytes.insert(k.to_string(), b);
        }
    }
    g
}

impl Golden {
    fn v(&self, k: &str) -> u64 {
        *self.values.get(k).unwrap_or_else(|| panic!("C program printed no {k}"))
    }
    fn b(&self, k: &str) -> &[u8] {
        self.bytes.get(k).unwrap_or_else(|| panic!("C program printed no {k}"))
    }
}

struct Cqns;
impl QueueResolver for Cqns {
    fn cqn(&self, qpn: u32, q: QueueSel) -> Option<u32> {
        (qpn == 3 && q == QueueSel::Recv).then_some(0x456)
    }
    fn enable_index(&mut self, _qpn: u32, _q: QueueSel, _count: u64) -> Option<WqeIndex> {
        Some(WqeIndex::new(0x1234))
    }
}

fn enc(w: &Wqe, pi: u16) -> Vec<u8> {
    encode(w, WqeIndex::new(pi), 0x99, PrevWqe::Other, &mut Cqns).unwrap().bytes().to_vec()
}

#[test]
fn constants_match_mlx5dv_h() {
    let g = golden();
    let ops = [
        ("MLX5_OPCODE_NOP", opcode::NOP),
        ("MLX5_OPCODE_SEND_INVAL", opcode::SEND_INVAL),
        ("MLX5_OPCODE_RDMA_WRITE", opcode::RDMA_WRITE),
        ("MLX5_OPCODE_RDMA_WRITE_IMM", opcode::RDMA_WRITE_IMM),
        ("MLX5_OPCODE_SEND", opcode::SEND),
        ("MLX5_OPCODE_SEND_IMM", opcode::SEND_IMM),
        ("MLX5_OPCODE_RDMA_READ", opcode::RDMA_READ),
        ("MLX5_OPCODE_ATOMIC_CS", opcode::ATOMIC_CS),
        ("MLX5_OPCODE_ATOMIC_FA", opcode::ATOMIC_FA),
        ("MLX5_OPCODE_ATOMIC_MASKED_CS", opcode::ATOMIC_MASKED_CS),
        ("MLX5_OPCODE_ATOMIC_MASKED_FA", opcode::ATOMIC_MASKED_FA),
        ("MLX5_OPCODE_UMR", opcode::UMR),
    ];
    for (k, v) in ops {
        assert_eq!(g.v(k), v as u64, "{k}");
    }
    assert_eq!(g.v("MLX5_WQE_CTRL_CQ_UPDATE"), CeSe::CQ_UPDATE.bits() as u64);
    assert_eq!(g.v("MLX5_WQE_CTRL_SOLICITED"), CeSe::SOLICITED.bits() as u64);
    // mlx5dv.h's "FENCE" is the fence mode SMALL_AND_FENCE (4 << 5) of Linux
    // include/linux/mlx5/qp.h, its INITIATOR_SMALL_FENCE the mode INITIATOR_SMALL (1 << 5)
    assert_eq!(g.v("MLX5_WQE_CTRL_FENCE"), FenceMode::SmallAndFence as u64);
    assert_eq!(g.v("MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE"), FenceMode::InitiatorSmall as u64);
    // the modes mlx5dv.h does not name, by hand from Linux include/linux/mlx5/qp.h
    // `MLX5_FENCE_MODE_*`: NONE 0 << 5, FENCE 2 << 5, STRONG_ORDERING 3 << 5
    assert_eq!([FenceMode::None as u8, FenceMode::Fence as u8, FenceMode::StrongOrdering as u8], [0x00, 0x40, 0x60]);
    assert_eq!(g.v("MLX5_SEND_WQE_BB"), omw_core::mlx5::wqebb::WQEBB as u64);
    assert_eq!(g.v("MLX5_SEND_WQE_SHIFT"), omw_core::mlx5::wqebb::WQEBB_SHIFT as u64);
    assert_eq!(g.v("MLX5_WQE_UMR_CTRL_FLAG_INLINE"), UmrFlags::INLINE.bits() as u64);
    assert_eq!(g.v("MLX5_WQE_UMR_CTRL_FLAG_CHECK_FREE"), UmrFlags::CHECK_FREE.bits() as u64);
    assert_eq!(g.v("MLX5_WQE_UMR_CTRL_FLAG_TRNSLATION_OFFSET"), UmrFlags::TRNSLATION_OFFSET.bits() as u64);
    assert_eq!(g.v("MLX5_WQE_UMR_CTRL_FLAG_CHECK_QPN"), UmrFlags::CHECK_QPN.bits() as u64);
    for (k, m) in [
        ("LEN", MkeyMask::LEN),
        ("START_ADDR", MkeyMask::START_ADDR),
        ("MKEY", MkeyMask::MKEY),
        ("QPN", MkeyMask::QPN),
        ("ACCESS_LOCAL_WRITE", MkeyMask::ACCESS_LOCAL_WRITE),
        ("ACCESS_REMOTE_READ", MkeyMask::ACCESS_REMOTE_READ),
        ("ACCESS_REMOTE_WRITE", MkeyMask::ACCESS_REMOTE_WRITE),
        ("ACCESS_ATOMIC", MkeyMask::ACCESS_ATOMIC),
        ("FREE", MkeyMask::FREE),
    ] {
        assert_eq!(g.v(&format!("MLX5_WQE_UMR_CTRL_MKEY_MASK_{k}")), m.bits(), "{k}");
    }
    assert_eq!(g.v("MLX5_WQE_MKEY_CONTEXT_FREE"), umr::MKEY_CONTEXT_FREE as u64);
    for (k, a) in [
        ("ATOMIC", MkeyAccess::ATOMIC),
        ("REMOTE_WRITE", MkeyAccess::REMOTE_WRITE),
        ("REMOTE_READ", MkeyAccess::REMOTE_READ),
        ("LOCAL_WRITE", MkeyAccess::LOCAL_WRITE),
        ("LOCAL_READ", MkeyAccess::LOCAL_READ),
    ] {
        assert_eq!(g.v(&format!("MLX5_WQE_MKEY_CONTEXT_ACCESS_FLAGS_{k}")), a.bits() as u64, "{k}");
    }
}

#[test]
fn segment_layouts_match_mlx5dv_h() {
    let g = golden();
    let sizes = [
        ("mlx5_wqe_ctrl_seg", ctrl::CTRL_SEG_SIZE),
        ("mlx5_wqe_data_seg", data::DATA_SEG_SIZE),
        ("mlx5_wqe_raddr_seg", raddr::RADDR_SEG_SIZE),
        ("mlx5_wqe_atomic_seg", omw_core::mlx5::atomic::ATOMIC_SEG_SIZE),
        ("mlx5_wqe_umr_ctrl_seg", umr::UMR_CTRL_SEG_SIZE),
        ("mlx5_wqe_mkey_context_seg", umr::MKEY_CONTEXT_SEG_SIZE),
        ("mlx5_wqe_umr_klm_seg", umr::KLM_SEG_SIZE),
    ];
    for (t, n) in sizes {
        assert_eq!(g.v(&format!("sizeof({t})")), n as u64, "{t}");
    }
    let offs = [
        ("mlx5_wqe_ctrl_seg.qpn_ds", 4),
        ("mlx5_wqe_ctrl_seg.signature", 8),
        ("mlx5_wqe_ctrl_seg.dci_stream_channel_id", 9),
        ("mlx5_wqe_ctrl_seg.fm_ce_se", 11),
        ("mlx5_wqe_ctrl_seg.imm", ctrl::IMM_OFFSET),
        ("mlx5_wqe_data_seg.lkey", data::LKEY_OFFSET),
        ("mlx5_wqe_data_seg.addr", data::ADDR_OFFSET),
        ("mlx5_wqe_raddr_seg.rkey", raddr::RKEY_OFFSET),
        ("mlx5_wqe_atomic_seg.compare", omw_core::mlx5::atomic::COMPARE_OFFSET),
        ("mlx5_wqe_umr_ctrl_seg.klm_octowords", 4),
        ("mlx5_wqe_umr_ctrl_seg.translation_offset", 6),
        ("mlx5_wqe_umr_ctrl_seg.mkey_mask", 8),
        ("mlx5_wqe_mkey_context_seg.access_flags", umr::MKEY_ACCESS_OFFSET),
        ("mlx5_wqe_mkey_context_seg.qpn_mkey", umr::MKEY_QPN_MKEY_OFFSET),
        ("mlx5_wqe_mkey_context_seg.flags_pd", 12),
        ("mlx5_wqe_mkey_context_seg.start_addr", umr::MKEY_START_ADDR_OFFSET),
        ("mlx5_wqe_mkey_context_seg.len", umr::MKEY_LEN_OFFSET),
        ("mlx5_wqe_mkey_context_seg.translations_octword_size", 52),
        ("mlx5_wqe_mkey_context_seg.log_page_size", 59),
        ("mlx5_wqe_umr_klm_seg.mkey", umr::KLM_MKEY_OFFSET),
        ("mlx5_wqe_umr_klm_seg.address", umr::KLM_ADDRESS_OFFSET),
    ];
    for (f, o) in offs {
        assert_eq!(g.v(&format!("offsetof({f})")), o as u64, "{f}");
    }
}

#[test]
fn cqe_layout_matches_mlx5dv_h() {
    use omw_core::mlx5::cqe::{self, opcode as op, syndrome as sy};
    let g = golden();
    assert_eq!(g.v("sizeof(mlx5_cqe64)"), cqe::CQE_SIZE as u64);
    assert_eq!(g.v("sizeof(mlx5_err_cqe)"), cqe::CQE_SIZE as u64);
    for (f, o) in [
        ("mlx5_cqe64.imm_inval_pkey", cqe::IMM_OFFSET),
        ("mlx5_cqe64.byte_cnt", cqe::BYTE_CNT_OFFSET),
        ("mlx5_cqe64.sop_drop_qpn", cqe::SOP_DROP_QPN_OFFSET),
        ("mlx5_cqe64.wqe_counter", cqe::WQE_COUNTER_OFFSET),
        ("mlx5_cqe64.op_own", cqe::OP_OWN_OFFSET),
        ("mlx5_err_cqe.vendor_err_synd", cqe::VENDOR_ERR_SYND_OFFSET),
        ("mlx5_err_cqe.syndrome", cqe::SYNDROME_OFFSET),
        ("mlx5_err_cqe.s_wqe_opcode_qpn", cqe::SOP_DROP_QPN_OFFSET),
        ("mlx5_err_cqe.wqe_counter", cqe::WQE_COUNTER_OFFSET),
    ] {
        assert_eq!(g.v(&format!("offsetof({f})")), o as u64, "{f}");
    }
    for (k, v) in [
        ("MLX5_CQE_REQ", op::REQ),
        ("MLX5_CQE_RESP_WR_IMM", op::RESP_WR_IMM),
        ("MLX5_CQE_RESP_SEND", op::RESP_SEND),
        ("MLX5_CQE_RESP_SEND_IMM", op::RESP_SEND_IMM),
        ("MLX5_CQE_RESP_SEND_INV", op::RESP_SEND_INV),
        ("MLX5_CQE_REQ_ERR", op::REQ_ERR),
        ("MLX5_CQE_RESP_ERR", op::RESP_ERR),
        ("MLX5_CQE_INVALID", op::INVALID),
        ("MLX5_CQE_OWNER_MASK", 1),
        ("MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR", sy::LOCAL_LENGTH_ERR),
        ("MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR", sy::LOCAL_QP_OP_ERR),
        ("MLX5_CQE_SYNDROME_LOCAL_PROT_ERR", sy::LOCAL_PROT_ERR),
        ("MLX5_CQE_SYNDROME_WR_FLUSH_ERR", sy::WR_FLUSH_ERR),
        ("MLX5_CQE_SYNDROME_MW_BIND_ERR", sy::MW_BIND_ERR),
        ("MLX5_CQE_SYNDROME_BAD_RESP_ERR", sy::BAD_RESP_ERR),
        ("MLX5_CQE_SYNDROME_LOCAL_ACCESS_ERR", sy::LOCAL_ACCESS_ERR),
        ("MLX5_CQE_SYNDROME_REMOTE_INVAL_REQ_ERR", sy::REMOTE_INVAL_REQ_ERR),
        ("MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR", sy::REMOTE_ACCESS_ERR),
        ("MLX5_CQE_SYNDROME_REMOTE_OP_ERR", sy::REMOTE_OP_ERR),
        ("MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR", sy::TRANSPORT_RETRY_EXC_ERR),
        ("MLX5_CQE_SYNDROME_RNR_RETRY_EXC_ERR", sy::RNR_RETRY_EXC_ERR),
        ("MLX5_CQE_SYNDROME_REMOTE_ABORTED_ERR", sy::REMOTE_ABORTED_ERR),
    ] {
        assert_eq!(g.v(k), v as u64, "{k}");
    }
}

#[test]
fn setters_match_mlx5dv_set_ctrl_seg_and_set_data_seg() {
    let g = golden();
    let f = FmCeSe::new(FenceMode::SmallAndFence, CeSe::CQ_UPDATE);
    let c = CtrlSeg::new(0xBEEF, opcode::RDMA_READ, 0x09, 0x12_3456, f, 3, 0xA1B2_C3D4);
    // the C buffer was memset to 0xff first: every byte the Rust side writes, the setter
    // writes too (dci_stream_channel_id, which the setter leaves alone, is cleared in C)
    assert_eq!(c.as_bytes(), g.b("ctrl"));
    let d = data::DataSeg::new(0x1122_3344, 0x5566_7788, 0x0102_0304_0506_0708);
    assert_eq!(d.as_bytes(), g.b("data"));
}

#[test]
fn whole_wqes_match_rdma_core() {
    let g = golden();
    let cases = [
        ("wqe_read", Wqe::read(0x1111_2222_3333_4444, 0x55, 64, 0x6666_7777_8888_9990, 0xAA_BBCC), 7),
        ("wqe_write_imm", Wqe::write_imm(0x10, 0x20, 8, 0x30, 0x40, 0xDEAD_BEEF), 8),
        ("wqe_send_inv", Wqe::send_with_inv(0x10, 0x20, 16, 0x1234_5601), 9),
        ("wqe_fetch_add", Wqe::fetch_add(0x100, 1, 0x200, 2, 0x0102_0304_0506_0708), 10),
        ("wqe_compare_swap", Wqe::compare_swap(0x100, 1, 0x200, 2, 7, 9), 11),
        ("wqe_bind_mw", Wqe::bind_mw(0x0012_3405, 0x7000_0000, 4096, 0x77, 0x00AB_CDEF, AccessFlags::DATA_WINDOW), 12),
        ("wqe_local_inv", Wqe::local_inv(0x0012_3405), 13),
        ("wqe_nop", Wqe::nop().with_flags(omw_core::wire::wqe::WqeFlags::empty()), 0xFFFF),
    ];
    for (name, w, pi) in cases {
        assert_eq!(enc(&w, pi), g.b(name), "{name}");
    }
}

/// The fence each WQE of a sequence carries, against rdma-core's `mlx5_post_send` rule
/// (emulated in the C program with the header's constants): a FENCEd WQE
/// `MLX5_WQE_CTRL_FENCE` whatever precedes it, an unfenced one after a BIND_MW / LOCAL_INV
/// `MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE`, the rest none — never the undefined 5 << 5.
#[test]
fn fence_modes_follow_mlx5_post_send() {
    use omw_core::wire::wqe::WqeFlags as F;
    let g = golden();
    let (s, f, so) = (F::SIGNALED, F::FENCE, F::SOLICITED);
    let read = |fl: F| Wqe::read(0x10, 1, 8, 0x20, 2).with_flags(fl);
    let bind =
        |fl: F| Wqe::bind_mw(0x0012_3405, 0x7000_0000, 4096, 0x77, 0xAB, AccessFlags::DATA_WINDOW).with_flags(fl);
    let seq = [
        read(s),
        bind(s),
        read(s),
        bind(F::empty()),
        Wqe::write(0x10, 1, 8, 0x20, 2).with_flags(f | s),
        Wqe::local_inv(0x0012_3405).with_flags(s),
        Wqe::nop().with_flags(F::empty()),
        read(f),
        Wqe::send(0x10, 1, 8).with_flags(so),
        bind(F::empty()),
        bind(f),
        Wqe::send(0x10, 1, 8).with_flags(F::empty()),
    ];
    let mut prev = PrevWqe::Other;
    let mut pi = 0u16;
    let mut got = Vec::new();
    for w in &seq {
        let e = encode(w, WqeIndex::new(pi), 0x99, prev, &mut Cqns).unwrap();
        got.push(e.bytes()[11]);
        prev = omw_core::mlx5::encode::prev_of(w);
        pi += e.wqebbs() as u16;
    }
    assert_eq!(got, g.b("fence_sequence"));
    // the whole WQE: a FENCEd signaled READ after a bind is 0x88 (not 0xa8)
    let w = read(f | s);
    let w = Wqe {
        local_addr: 0x1111_2222_3333_4444,
        lkey: 0x55,
        length: 64,
        remote_addr: 0x6666_7777_8888_9990,
        rkey: 0xAA_BBCC,
        ..w
    };
    let e = encode(&w, WqeIndex::new(15), 0x99, PrevWqe::Umr, &mut Cqns).unwrap();
    assert_eq!(e.bytes(), g.b("wqe_fenced_read_after_bind"));
    assert_eq!(e.bytes()[11], 0x88);
}

/// Masked FA: UCX rc_mlx5.inl — raddr, then `{add, field_boundary}` big-endian, then the data
/// segment; opcode 0x15 with opmod `UCT_IB_MLX5_OPMOD_EXT_ATOMIC(3)` = 0x09; ds = 4.
#[test]
fn masked_fetch_add_by_hand() {
    let w = Wqe::masked_fetch_add(0x100, 1, 0x200, 2, 5, 0x8000_0000_0000_8000);
    #[rustfmt::skip]
    let want: [u8; 64] = [
        0x09, 0x00, 0x0e, 0x15,  0x00, 0x00, 0x99, 0x04,  0x00, 0x00, 0x00, 0x08,  0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0x02, 0x00,  0, 0, 0, 0x02,  0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0x05,  0x80, 0, 0, 0, 0, 0, 0x80, 0x00,
        0, 0, 0, 0x08,  0, 0, 0, 0x01,  0, 0, 0, 0, 0, 0, 0x01, 0x00,
    ];
    assert_eq!(enc(&w, 14), want);
}

/// WAIT on a CQ PI and SEND_EN / RECV_EN: DPDK mlx5_txpp.c builds exactly `ctrl (ds 2) +
/// mlx5_wqe_qseg { 0, 0, BE32 max_index, BE32 qpn_cqn }`; the WAIT index is masked to 24 bits.
#[test]
fn wait_and_enable_by_hand() {
    #[rustfmt::skip]
    let wait: [u8; 64] = {
        let mut b = [0u8; 64];
        b[..32].copy_from_slice(&[
            0x00, 0x00, 0x0f, 0x0f,  0x00, 0x00, 0x99, 0x02,  0, 0, 0, 0,  0, 0, 0, 0,
            0, 0, 0, 0,  0, 0, 0, 0,  0x00, 0x67, 0x89, 0xab,  0x00, 0x00, 0x04, 0x56,
        ]);
        b
    };
    assert_eq!(enc(&Wqe::wait(3, QueueSel::Recv, 0x0123_4567_89AB), 15), wait);
    for (q, op) in [(QueueSel::Send, 0x17u8), (QueueSel::Recv, 0x16)] {
        let mut want = [0u8; 64];
        want[..32].copy_from_slice(&[
            0x00, 0x00, 0x10, op, 0x00, 0x00, 0x99, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x00, 0x00,
            0x12, 0x34, 0x00, 0x00, 0x00, 0x42,
        ]);
        assert_eq!(enc(&Wqe::enable(0x42, q, 17), 16), want, "{q:?}");
    }
}

/// Expected command bytes: all zero except the listed (offset, bytes).
fn expect(len: usize, set: &[(usize, &[u8])]) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (o, b) in set {
        v[*o..*o + b.len()].copy_from_slice(b);
    }
    v
}

#[test]
fn query_hca_cap_by_hand() {
    assert_eq!(
        hca_cap::query_hca_cap_in(hca_cap::CAP_GENERAL).unwrap().to_vec(),
        expect(16, &[(0, &[1, 0]), (6, &[0, 1])])
    );
    assert_eq!(
        hca_cap::query_hca_cap_in(hca_cap::CAP_ATOMIC).unwrap().to_vec(),
        expect(16, &[(0, &[1, 0]), (6, &[0, 7])])
    );
    // general caps: atomic (cap bit 0x21e → out byte 16+67, 0x02), cd (0x22c → 16+69, 0x08),
    // imaicl (0x231 → 16+70, 0x40), rc (0x23f → 16+71, 0x01)
    // log_max_msg (0x1c3, 5 bits → dword 14 of the cap, shift 24 → out byte 16+56) = 30
    let mut general = expect(
        hca_cap::QUERY_HCA_CAP_OUT_LEN,
        &[(72, &[30]), (83, &[0x02]), (85, &[0x08]), (86, &[0x40]), (87, &[0x01])],
    );
    // atomic caps: endianness mode (0x40, 2 bits → out byte 24 top bits) 1 = host, operations
    // (0x90 → bytes 34..36) = CS | FA | masked CS | masked FA, size_qp (0xb0 → 38..40) = 8 | 4
    let mut atomic = expect(hca_cap::QUERY_HCA_CAP_OUT_LEN, &[(24, &[0x40]), (34, &[0x00, 0x0f]), (38, &[0x00, 0x0c])]);
    let c = HcaCaps::parse(&general, Some(&atomic), None).unwrap();
    assert!(c.cd && c.imaicl && c.rc && c.atomic && c.masked_fetch_add_8b());
    assert_eq!((c.atomic_operations, c.atomic_size_qp, c.log_max_msg), (0x0f, 0x0c, 30));
    assert_eq!(c.missing_for_offload(), None);
    assert_eq!(c.atomic_8b_endianness_mode, 1);
    // big-endian 8-byte atomics (mode 0) would read the chains' little-endian counters
    // byte-swapped
    atomic[24] = 0;
    let c = HcaCaps::parse(&general, Some(&atomic), None).unwrap();
    assert_eq!(c.atomic_8b_endianness_mode, 0);
    assert_eq!(c.missing_for_offload(), Some(MissingCap::MaskedFetchAdd));
    general[85] = 0;
    let c = HcaCaps::parse(&general, Some(&atomic), None).unwrap();
    assert_eq!(c.missing_for_offload(), Some(MissingCap::CoreDirect));
}

fn create_qp_params() -> qp::CreateQp {
    qp::CreateQp {
        pd: 0x12_3456,
        uar_page: 0xabc,
        cqn_snd: 0x101,
        cqn_rcv: 0x102,
        log_sq_size: 6,
        log_rq_size: Some(5),
        log_rq_stride: 2,
        log_page_size: 0,
        cd: qp::CdRole::MASTER | qp::CdRole::SLAVE_SEND,
        wq_umem_id: 0x1122_3344,
        wq_umem_offset: 0x1000,
        dbr_umem_id: 0x5566_7788,
        dbr_offset: 0x40,
        user_index: 0,
        ts_format: 1,
    }
}

#[test]
fn create_qp_by_hand() {
    // opcode 0x500; qpc at bit 0xc0: pm_state (0xd3, 2 bits) = 3 → byte 26 0x18; pd (0xe8) →
    // 29..32; dword 8 (bytes 32..36): log_rq_size 5 << 19 | log_rq_stride 2 << 16 |
    // log_sq_size 6 << 11 | ts_format (0x118, 2 bits) 1 << 6 = 0x002a3040 (DPDK mlx5_prm.h
    // `mlx5_ifc_qpc_bits.ts_format` at qpc bit 0x58, rdma-core's the same);
    // uar_page (0x128) → 37..40; cqn_snd (0x4a8) →
    // 149..152; byte 171: cd_master 0x01 | cd_slave_send 0x02 (cd_slave_receive 0x04);
    // cqn_rcv (0x5a8) → 181..184; dbr_addr (0x5c0, 64 bits) → 184..192; dbr_umem_valid
    // (0x743) → byte 232 0x10; dbr_umem_id (0x7e0) → 252..256; wq_umem_offset (0x800) →
    // 256..264; wq_umem_id (0x840) → 264..268; wq_umem_valid (0x860) → byte 268 0x80.
    let want = expect(
        qp::CREATE_QP_IN_LEN,
        &[
            (0, &[0x05, 0x00]),
            (26, &[0x18]),
            (29, &[0x12, 0x34, 0x56]),
            (32, &[0x00, 0x2a, 0x30, 0x40]),
            (37, &[0x00, 0x0a, 0xbc]),
            (149, &[0x00, 0x01, 0x01]),
            (171, &[0x03]),
            (181, &[0x00, 0x01, 0x02]),
            (191, &[0x40]),
            (232, &[0x10]),
            (252, &[0x55, 0x66, 0x77, 0x88]),
            (262, &[0x10, 0x00]),
            (264, &[0x11, 0x22, 0x33, 0x44]),
            (268, &[0x80]),
        ],
    );
    assert_eq!(qp::create_qp_in(&create_qp_params()).unwrap().to_vec(), want);
    // no receive queue (rq_type 3 at 0x625 → byte 196 0x03), receive slave only
    let p = qp::CreateQp { log_rq_size: None, cd: qp::CdRole::SLAVE_RECEIVE, ts_format: 0, ..create_qp_params() };
    let b = qp::create_qp_in(&p).unwrap();
    assert_eq!((b[171], b[196], &b[32..36]), (0x04, 0x03, &[0x00, 0x00, 0x30, 0x00][..]));
    // a format the field cannot hold is refused
    let p = qp::CreateQp { ts_format: 4, ..create_qp_params() };
    assert_eq!(qp::create_qp_in(&p), Err(Mlx5Error::FieldOverflow { field: "qpc.ts_format", value: 4 }));
    // out: status, then qpn at 0x48
    let out = expect(16, &[(9, &[0x00, 0x12, 0x34])]);
    assert_eq!(qp::created_qpn(&out).unwrap(), 0x1234);
    let failed = expect(16, &[(0, &[0x05]), (4, &[0xde, 0xad, 0xbe, 0xef])]);
    assert_eq!(
        qp::created_qpn(&failed),
        Err(Mlx5Error::CommandFailed { opcode: 0x500, status: 5, syndrome: 0xdead_beef })
    );
    // a value wider than its field is refused, not truncated as DEVX_SET would
    let p = qp::CreateQp { pd: 1 << 24, ..create_qp_params() };
    assert_eq!(qp::create_qp_in(&p), Err(Mlx5Error::FieldOverflow { field: "qpc.pd", value: 1 << 24 }));
}

#[test]
fn qp_transitions_by_hand() {
    let qpn = 0xA_BCDE;
    // 2RST (0x50a): 16 bytes, the opcode and qpn (0x48 → bytes 9..12) only (DPDK mlx5_prm.h
    // `mlx5_ifc_2rst_qp_in_bits`)
    assert_eq!(qp::qp_2rst_in(qpn).unwrap().to_vec(), expect(16, &[(0, &[0x05, 0x0a]), (9, &[0x0a, 0xbc, 0xde])]));
    assert!(qp::qp_2rst_in(1 << 24).is_err());
    // RST2INIT (0x502): qpn (0x48) → 9..12; pm_state → byte 26; vhca_port_num (0x2a8) → byte
    // 85; dword 42: atomic_mode (0x54c, 4 bits) 3 << 16 | rre 1 << 15 | rwe 1 << 14 | rae 1 << 13
    let b = qp::rst2init_in(&qp::Rst2Init {
        qpn,
        port: 1,
        pkey_index: 0,
        remote_read: true,
        remote_write: true,
        remote_atomic: true,
        atomic_mode: qp::ATOMIC_MODE_8B as u8,
    })
    .unwrap();
    let want = expect(
        qp::MODIFY_QP_IN_LEN,
        &[(0, &[0x05, 0x02]), (9, &[0x0a, 0xbc, 0xde]), (26, &[0x18]), (85, &[0x01]), (168, &[0x00, 0x03, 0xe0, 0x00])],
    );
    assert_eq!(b.to_vec(), want);

    // INIT2RTR (0x503): dword 8: mtu (0x100) 3 << 29 | log_msg_max (0x103) 30 << 24 = 0x7e000000;
    // remote_qpn (0x168) → 45..48; ads at 0x180: grh (0x1a8) → byte 53 0x80, src_addr_index
    // (0x1c8) → byte 57, hop_limit (0x1d8) → byte 59, rgid (0x200) → 64..80, udp_sport (0x290)
    // → 82..84, vhca_port_num → byte 85, rmac_47_32 (0x2b0) → 86..88, rmac_31_0 (0x2c0) →
    // 88..92; log_rra_max (0x548) 4 << 21 → byte 169 0x80; min_rnr_nak (0x563) 12 << 24 →
    // byte 172; next_rcv_psn (0x568) → 173..176.
    let mut rgid = [0u8; 16];
    rgid[10..].copy_from_slice(&[0xff, 0xff, 192, 0, 2, 2]);
    let b = qp::init2rtr_in(&qp::Init2Rtr {
        qpn,
        remote_qpn: 0x321,
        mtu: 3,
        log_msg_max: 30,
        next_rcv_psn: 0xaaaa,
        log_rra_max: 4,
        min_rnr_nak: 12,
        path: qp::AddressPath {
            port: 1,
            grh: true,
            sgid_index: 3,
            hop_limit: 64,
            rgid,
            rmac: [0x02, 0, 0, 0, 0, 0x02],
            udp_sport: 0xc000,
            ..Default::default()
        },
    })
    .unwrap();
    let want = expect(
        qp::MODIFY_QP_IN_LEN,
        &[
            (0, &[0x05, 0x03]),
            (9, &[0x0a, 0xbc, 0xde]),
            (32, &[0x7e]),
            (45, &[0x00, 0x03, 0x21]),
            (53, &[0x80]),
            (57, &[0x03]),
            (59, &[0x40]),
            (74, &[0xff, 0xff, 0xc0, 0x00, 0x02, 0x02]),
            (82, &[0xc0, 0x00]),
            (85, &[0x01, 0x02, 0x00, 0x00, 0x00, 0x00, 0x02]),
            (169, &[0x80]),
            (172, &[0x0c, 0x00, 0xaa, 0xaa]),
        ],
    );
    assert_eq!(b.to_vec(), want);

    // RTR2RTS (0x504): ack_timeout (0x1c0, 5 bits) 14 << 27 → byte 56 0x70; dword 34:
    // log_sra_max (0x448) 4 << 21 | retry_count (0x44d) 7 << 16 | rnr_retry (0x450) 7 << 13 =
    // 0x0087e000; next_send_psn (0x488) → 145..148.
    let b = qp::rtr2rts_in(&qp::Rtr2Rts {
        qpn,
        next_send_psn: 0xbbbb,
        ack_timeout: 14,
        retry_count: 7,
        rnr_retry: 7,
        log_sra_max: 4,
    })
    .unwrap();
    let want = expect(
        qp::MODIFY_QP_IN_LEN,
        &[
            (0, &[0x05, 0x04]),
            (9, &[0x0a, 0xbc, 0xde]),
            (56, &[0x70]),
            (136, &[0x00, 0x87, 0xe0, 0x00]),
            (145, &[0x00, 0xbb, 0xbb]),
        ],
    );
    assert_eq!(b.to_vec(), want);
}

#[test]
fn create_cq_by_hand() {
    // opcode 0x400; cqc at 0x80 (DPDK mlx5_prm.h `mlx5_ifc_cqc_bits`, rdma-core's mlx5_ifc.h
    // has no cqc): dbr_umem_valid (0x86) → byte 16 0x02; oi (0x8e) → byte 17 0x02;
    // dbr_umem_id (0xa0) →
    // 20..24; log_cq_size (0xe3, 5 bits) → byte 28; uar_page (0xe8) → 29..32; c_eqn (0x138) →
    // byte 39; dbr_addr (0x240) → 72..80; cq_umem_id (0x2c0) → 88..92; cq_umem_valid (0x2e0)
    // → byte 92 0x80.
    let b = cq::create_cq_in(&cq::CreateCq {
        log_cq_size: 8,
        uar_page: 0xabc,
        eqn: 5,
        log_page_size: 0,
        umem_id: 0x0102_0304,
        umem_offset: 0,
        dbr_umem_id: 0x0506_0708,
        dbr_offset: 0x80,
        overrun_ignore: true,
    })
    .unwrap();
    let want = expect(
        cq::CREATE_CQ_IN_LEN,
        &[
            (0, &[0x04, 0x00]),
            (16, &[0x02, 0x02]),
            (20, &[0x05, 0x06, 0x07, 0x08]),
            (28, &[0x08, 0x00, 0x0a, 0xbc]),
            (39, &[0x05]),
            (79, &[0x80]),
            (88, &[0x01, 0x02, 0x03, 0x04]),
            (92, &[0x80]),
        ],
    );
    assert_eq!(b.to_vec(), want);
    assert_eq!(cq::created_cqn(&expect(16, &[(11, &[0x07])])).unwrap(), 7);
}
