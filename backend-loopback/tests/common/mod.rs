//! Shared fixtures: one MN and one CN, a registered pool on the MN, a buffer on the CN, and a
//! connected QP pair between them.
#![allow(dead_code)]

use omw_core::access::AccessFlags;
use omw_core::device::{Completion, MrKeys, WcOpcode, WcStatus};
use omw_core::wire::wqe::{QueueSel, RecvWqe, Sge};
use omw_loopback::{Fabric, HostId, NicConfig, PdId, QpAddr, QpConfig};

pub const ALL_REMOTE: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC)
    .union(AccessFlags::MW_BIND);

pub struct Env {
    pub f: Fabric,
    pub mn: HostId,
    pub cn: HostId,
    /// MN pool: 64 KiB, every right including MW_BIND.
    pub pool: u64,
    pub pool_k: MrKeys,
    /// CN buffer: 4 KiB, LOCAL_WRITE | REMOTE_WRITE.
    pub buf: u64,
    pub buf_k: MrKeys,
    /// CN end and MN end of the connected pair.
    pub c: QpAddr,
    pub m: QpAddr,
}

pub fn env(cfg: NicConfig) -> Env {
    let mut f = Fabric::new(cfg.with_trace(true));
    let mn = f.add_host("mn").unwrap();
    let cn = f.add_host("cn").unwrap();
    let (pool, pool_k) = f.alloc_mr(mn, PdId(0), 64 << 10, 4096, ALL_REMOTE).unwrap();
    let (buf, buf_k) = f.alloc_mr(cn, PdId(0), 4096, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    let (c, m) = f.create_connected_pair(cn, QpConfig::default(), mn, QpConfig::default()).unwrap();
    Env { f, mn, cn, pool, pool_k, buf, buf_k, c, m }
}

pub fn blank() -> Completion {
    Completion {
        wr_id: 0,
        status: WcStatus::GeneralErr,
        opcode: WcOpcode::Recv,
        qpn: Default::default(),
        byte_len: 0,
        imm: None,
        invalidated: None,
    }
}

/// Run the fabric until idle and drain every completion of a CQ (advancing the clock to
/// them like a spinning CPU).
pub fn drain(f: &mut Fabric, qp: QpAddr, q: QueueSel) -> Vec<Completion> {
    let mut out = Vec::new();
    let mut buf = [blank(); 16];
    loop {
        let n = f.poll_cq(qp, q, &mut buf).unwrap();
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    f.check_invariants().unwrap();
    out
}

pub fn statuses(v: &[Completion]) -> Vec<WcStatus> {
    v.iter().map(|c| c.status).collect()
}

/// The single completion of a send CQ.
pub fn one(f: &mut Fabric, qp: QpAddr) -> Completion {
    let v = drain(f, qp, QueueSel::Send);
    assert_eq!(v.len(), 1, "{v:?}");
    v[0]
}

pub fn recv(wr_id: u64, sges: &[(u64, u32, u32)]) -> RecvWqe {
    let mut r = RecvWqe { wr_id, sges: heapless::Vec::new() };
    for (addr, length, lkey) in sges {
        r.sges.push(Sge { addr: *addr, length: *length, lkey: *lkey }).unwrap();
    }
    r
}

pub fn read_bytes(f: &Fabric, h: HostId, addr: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    f.read(h, addr, &mut v).unwrap();
    v
}
