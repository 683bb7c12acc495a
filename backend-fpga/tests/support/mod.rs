//! Shared test plumbing: modelled nodes with a backend each, QP wiring, polling.
#![allow(dead_code)]

pub mod mn;
pub mod mw;

use omw_core::device::DataPath;
use omw_core::device::{Completion, WcOpcode, WcStatus};
use omw_core::ids::Qpn;
use omw_core::wire::wqe::QueueSel;
use omw_fpga::double::{Fabric, NodeConfig, NodeId, SimMemory, SimMmio};
use omw_fpga::encoding::OpcodeEncoding;
use omw_fpga::{FpgaBackend, FpgaConfig, QpConnect, QpSetup};

pub type Be = FpgaBackend<SimMmio, SimMemory>;

pub struct Host {
    pub id: NodeId,
    pub be: Be,
    pub ip: u32,
    pub mem_base: u64,
}

pub const MEM_LEN: usize = 4 << 20;
/// The last MiB of every node's memory holds the backend's rings.
pub const ARENA_OFF: u64 = 3 << 20;

/// A modelled node and a backend on it that holds all 64 ctids (the MN daemon owns its vFPGA).
pub fn host(f: &Fabric, ip: u32, mem_base: u64, ext: bool, enc: OpcodeEncoding) -> Host {
    host_with(f, ip, mem_base, ext, enc, |c| c)
}

pub fn host_with(
    f: &Fabric,
    ip: u32,
    mem_base: u64,
    ext: bool,
    enc: OpcodeEncoding,
    tweak: impl FnOnce(FpgaConfig) -> FpgaConfig,
) -> Host {
    let mut cfg = NodeConfig::stock(ip, mem_base, MEM_LEN).with_encoding(enc);
    if ext {
        cfg = cfg.with_extension();
    }
    let id = f.add_node(cfg);
    let mut bcfg = FpgaConfig::new(0, enc, ip).with_threads(64);
    if ext {
        bcfg = bcfg.with_ring_arena(mem_base + ARENA_OFF, 1 << 20);
    }
    let be = FpgaBackend::open(f.mmio(id), f.user_csr(id), f.memory(id), tweak(bcfg)).expect("open backend");
    Host { id, be, ip, mem_base }
}

/// Connect `a.ctid_a` with `b.ctid_b` (both directions). For the stock engine, `rkey_*` /
/// `vaddr_*` are what the other side's context names.
pub fn connect(a: &mut Host, ca: u8, b: &mut Host, cb: u8, a_sees: (u32, u64), b_sees: (u32, u64)) -> (Qpn, Qpn) {
    let qa = a.be.qpn(ca).unwrap();
    let qb = b.be.qpn(cb).unwrap();
    a.be.connect_qp(
        ca,
        &QpConnect {
            remote_qpn: qb.get(),
            remote_ip: b.ip,
            local_psn: 0x100,
            remote_psn: 0x200,
            remote_rkey: a_sees.0,
            remote_vaddr: a_sees.1,
            port: 18488,
        },
    )
    .unwrap();
    b.be.connect_qp(
        cb,
        &QpConnect {
            remote_qpn: qa.get(),
            remote_ip: a.ip,
            local_psn: 0x200,
            remote_psn: 0x100,
            remote_rkey: b_sees.0,
            remote_vaddr: b_sees.1,
            port: 18488,
        },
    )
    .unwrap();
    (qa, qb)
}

/// Same node loopback pair.
pub fn connect_loop(a: &mut Host, ca: u8, cb: u8) {
    let ip = a.ip;
    for (x, y) in [(ca, cb), (cb, ca)] {
        let qy = a.be.qpn(y).unwrap();
        a.be.connect_qp(x, &QpConnect { remote_qpn: qy.get(), remote_ip: ip, ..QpConnect::default() }).unwrap();
    }
}

pub fn setup(h: &mut Host, ctid: u8, s: QpSetup) -> Qpn {
    h.be.create_qp(ctid, s).unwrap()
}

pub fn blank() -> Completion {
    Completion {
        wr_id: 0,
        status: WcStatus::GeneralErr,
        opcode: WcOpcode::Recv,
        qpn: Qpn::default(),
        byte_len: 0,
        imm: None,
        invalidated: None,
    }
}

/// Poll until `n` completions arrived (every poll reads registers, which advances the model).
pub fn wait_n(be: &mut Be, qp: Qpn, q: QueueSel, n: usize) -> Vec<Completion> {
    let mut got = Vec::new();
    let mut buf = [blank(); 16];
    for _ in 0..20_000 {
        let k = be.poll_cq(qp, q, &mut buf).unwrap();
        got.extend_from_slice(&buf[..k]);
        if got.len() >= n {
            return got;
        }
    }
    panic!("timed out waiting for {n} completions on {qp} {q:?}; got {got:?}");
}

pub fn wait1(be: &mut Be, qp: Qpn, q: QueueSel) -> Completion {
    wait_n(be, qp, q, 1)[0]
}

/// Poll a few times and return whatever arrived (for "nothing arrives" checks).
pub fn drain(be: &mut Be, qp: Qpn, q: QueueSel, polls: usize) -> Vec<Completion> {
    let mut got = Vec::new();
    let mut buf = [blank(); 16];
    for _ in 0..polls {
        let k = be.poll_cq(qp, q, &mut buf).unwrap();
        got.extend_from_slice(&buf[..k]);
    }
    got
}

pub fn put(be: &mut Be, addr: u64, data: &[u8]) {
    be.write_local(addr, data).unwrap();
}

pub fn get(be: &Be, addr: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    be.read_local(addr, &mut v).unwrap();
    v
}
