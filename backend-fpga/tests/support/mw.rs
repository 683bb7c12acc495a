//! The extension double as a memory-window device for the suite's MW scenarios
//! (`omw_tests::mw`): an MN node with the pool, a CN node with the requester's buffer, a fresh
//! connected pair of ctids per `pair()`.

use super::*;
use omw_core::access::AccessFlags;
use omw_core::device::DataPath;
use omw_core::device::Provision;
use omw_core::device::WindowState;
use omw_core::device::{Completion, Domain, MwBinding, QpState};
use omw_core::ids::{Qpn, Rkey};
use omw_core::wire::wqe::{QueueSel, RecvWqe, Wqe, WqeFlags};
use omw_fpga::double::Fabric;
use omw_fpga::encoding::OpcodeEncoding;
use omw_fpga::QpSetup;
use omw_tests::mw::{MwDevice, MwFactory, Side, BUF_LEN, POOL_LEN};
use omw_tests::testbed::Caps;

const CN: u64 = 0x1000_0000;
const MN: u64 = 0x2000_0000;
const POOL: u64 = MN + 0x10_0000;

pub struct DoubleMw;

impl MwFactory for DoubleMw {
    fn name(&self) -> String {
        "FPGA extension double".into()
    }
    fn caps(&self) -> Caps {
        Caps::STRICT_MW
    }
    fn start(&self) -> Box<dyn MwDevice> {
        let f = Fabric::new();
        let cn = host(&f, 0x0A00_0001, CN, true, OpcodeEncoding::AppOpcodes);
        let mut mn = host(&f, 0x0A00_0002, MN, true, OpcodeEncoding::AppOpcodes);
        let pk =
            mn.be.reg_mr(Domain::CnFacing, POOL, POOL_LEN, AccessFlags::MW_BIND | AccessFlags::LOCAL_WRITE).unwrap();
        put(&mut mn.be, POOL, &vec![b'o'; POOL_LEN as usize]);
        let mut cn = cn;
        let bk = cn.be.reg_mr(Domain::CnFacing, CN, BUF_LEN, AccessFlags::LOCAL_WRITE).unwrap();
        Box::new(Dev { _f: f, cn, mn, pool: (POOL, pk.lkey, pk.rkey), buf: (CN, bk.lkey), next: 1 })
    }
}

struct Dev {
    _f: Fabric,
    cn: Host,
    mn: Host,
    pool: (u64, u32, u32),
    buf: (u64, u32),
    next: u8,
}

impl Dev {
    fn be(&mut self, side: Side) -> &mut Be {
        match side {
            Side::Mn => &mut self.mn.be,
            Side::Cn => &mut self.cn.be,
        }
    }
}

fn wait(be: &mut Be, qp: Qpn, sel: QueueSel, wr_id: Option<u64>) -> Option<Completion> {
    let mut buf = [blank(); 8];
    for _ in 0..20_000 {
        let n = be.poll_cq(qp, sel, &mut buf).ok()?;
        if let Some(c) = buf[..n].iter().find(|c| wr_id.is_none_or(|w| c.wr_id == w)) {
            return Some(*c);
        }
    }
    None
}

impl MwDevice for Dev {
    fn caps(&self) -> Caps {
        Caps::STRICT_MW
    }
    fn pair(&mut self) -> (Qpn, Qpn) {
        let c = self.next;
        self.next += 1;
        setup(&mut self.cn, c, QpSetup::plain(16, 4));
        setup(&mut self.mn, c, QpSetup::plain(16, 4));
        let (qc, qm) = connect(&mut self.cn, c, &mut self.mn, c, (0, 0), (0, 0));
        (qm, qc)
    }
    fn alloc_mw(&mut self) -> Rkey {
        self.mn.be.alloc_mw().unwrap()
    }
    fn pool(&self) -> (u64, u32, u32) {
        self.pool
    }
    fn buf(&self) -> (u64, u32) {
        self.buf
    }
    fn post(&mut self, side: Side, qp: Qpn, w: &Wqe) -> Option<Completion> {
        let w = w.with_flags(w.flags | WqeFlags::SIGNALED);
        let be = self.be(side);
        be.post_send(qp, &w).ok()?;
        wait(be, qp, QueueSel::Send, Some(w.wr_id))
    }
    fn post_recv(&mut self, side: Side, qp: Qpn, r: &RecvWqe) {
        self.be(side).post_recv(qp, r).unwrap();
    }
    fn wait_recv(&mut self, side: Side, qp: Qpn) -> Option<Completion> {
        wait(self.be(side), qp, QueueSel::Recv, None)
    }
    fn state(&mut self, side: Side, qp: Qpn) -> QpState {
        self.be(side).qp_state(qp).unwrap()
    }
    fn read_local(&mut self, side: Side, addr: u64, len: usize) -> Vec<u8> {
        get(self.be(side), addr, len)
    }
    fn write_local(&mut self, side: Side, addr: u64, data: &[u8]) {
        put(self.be(side), addr, data)
    }
    fn binding(&mut self, rkey: Rkey) -> Option<MwBinding> {
        self.mn.be.mw_binding(rkey)
    }
}
