//! Both wrappers in front of an mlx5-form device, arming a real alloc chain: the chain must
//! reach the device in the mlx5 form (ring images written, `arm_mlx5` called, nothing posted
//! as canonical WQEs). Before the device traits were split, `FaultInjector` and `Tracer` took
//! the trait's defaults for the WQE form and the mlx5 arming, so a wrapped mlx5 device was
//! silently armed with canonical chains (issue 21).

use crate::access::AccessFlags;
use crate::chain::alloc::build_alloc_chain;
use crate::chain::arm::arm;
use crate::chain::builder::test_env;
use crate::chain::mlx5::{Mlx5Arm, Mlx5Chain};
use crate::device::{
    Capabilities, Completion, DataPath, Domain, MrKeys, MwBinding, OffloadRings, Provision, QpState, WindowState,
};
use crate::ids::{Qpn, Rkey};
use crate::testing::fault::FaultInjector;
use crate::testing::trace::{TraceEvent, Tracer};
use crate::wire::wqe::{QueueSel, RecvWqe, Wqe};
use std::cell::RefCell;
use std::rc::Rc;
use std::string::{String, ToString};
use std::vec::Vec;

/// A device that records what arming did to it; `mlx5` picks the form it declares.
#[derive(Default)]
struct Stub {
    mlx5: bool,
    posted: u32,
    armed: Vec<usize>,
    writes: Vec<(u64, usize)>,
}

const RING_BASES: [u64; 2] = [0x5_0000_0000, 0x5_0010_0000];

impl DataPath for Stub {
    type Error = &'static str;
    fn capabilities(&self) -> Capabilities {
        let c = Capabilities::OFFLOAD;
        if self.mlx5 {
            c | Capabilities::WQE_FORM_MLX5
        } else {
            c
        }
    }
    fn post_send(&mut self, _: Qpn, _: &Wqe) -> Result<(), Self::Error> {
        self.posted += 1;
        Ok(())
    }
    fn post_recv(&mut self, _: Qpn, _: &RecvWqe) -> Result<(), Self::Error> {
        Ok(())
    }
    fn poll_cq(&mut self, _: Qpn, _: QueueSel, _: &mut [Completion]) -> Result<usize, Self::Error> {
        Ok(0)
    }
    fn enable(&mut self, _: Qpn, _: QueueSel, _: u64) -> Result<(), Self::Error> {
        Ok(())
    }
    fn reset_qp(&mut self, _: Qpn) -> Result<(), Self::Error> {
        Ok(())
    }
    fn destroy_qp(&mut self, _: Qpn) -> Result<(), Self::Error> {
        Ok(())
    }
    fn qp_state(&self, _: Qpn) -> Result<QpState, Self::Error> {
        Ok(QpState::Rts)
    }
    fn read_local(&self, _: u64, _: &mut [u8]) -> Result<(), Self::Error> {
        Ok(())
    }
    fn write_local(&mut self, addr: u64, data: &[u8]) -> Result<(), Self::Error> {
        self.writes.push((addr, data.len()));
        Ok(())
    }
    fn outstanding(&self, _: Qpn, _: QueueSel) -> Option<u64> {
        None
    }
}
impl Provision for Stub {
    fn reg_mr(&mut self, _: Domain, _: u64, _: u64, _: AccessFlags) -> Result<MrKeys, Self::Error> {
        Err("unused")
    }
    fn alloc_mw(&mut self) -> Result<Rkey, Self::Error> {
        Err("unused")
    }
    fn alloc_memory(&mut self, _: u64, _: u64) -> Result<u64, Self::Error> {
        Err("unused")
    }
    fn create_loopback_qp(&mut self, _: Domain, _: Option<u32>) -> Result<Qpn, Self::Error> {
        Err("unused")
    }
}
impl OffloadRings for Stub {
    fn ring_base(&self, qp: Qpn, _: QueueSel) -> Result<u64, Self::Error> {
        // the example environment's loop QP is 0x100, its management QP 0x101
        Ok(if qp.get() == 0x100 { RING_BASES[0] } else { RING_BASES[1] })
    }
    fn ring_keys(&self, _: Domain) -> Result<MrKeys, Self::Error> {
        Ok(MrKeys { lkey: 1, rkey: 2 })
    }
    fn send_wqes_executed(&self, _: Qpn) -> Option<u64> {
        None
    }
    fn recv_doorbell(&self, _: Qpn) -> Result<Option<crate::device::RecvDoorbell>, Self::Error> {
        Ok(None)
    }
}
impl WindowState for Stub {
    fn mw_binding(&self, _: Rkey) -> Option<MwBinding> {
        None
    }
    fn mw_span(&self, _: Rkey) -> Option<(u64, u64)> {
        None
    }
}
impl Mlx5Arm for Stub {
    fn cq_numbers(&self, _: Qpn, _: Qpn) -> Option<[u32; 3]> {
        self.mlx5.then_some([0x21, 0x22, 0x23])
    }
    fn cq_producer_indices(&self, _: Qpn, _: Qpn) -> [u32; 3] {
        [0; 3]
    }
    fn arm_mlx5(&mut self, chain: &Mlx5Chain, _recv_copies: u32) -> Option<Result<(), Self::Error>> {
        if !self.mlx5 {
            return None;
        }
        self.armed.push(chain.rings.iter().map(|r| r.len()).sum::<usize>());
        Some(Ok(()))
    }
}

/// Arm CN 0's alloc chain of the example environment on `stub` behind both wrappers; the
/// stub back and the names of the calls the tracer saw.
fn arm_wrapped(stub: Stub) -> (Stub, Vec<String>) {
    let layout = build_alloc_chain(&test_env(512, 16, 2)).expect("alloc chain");
    let seen = Rc::new(RefCell::new(Vec::new()));
    let log = seen.clone();
    let mut dev =
        FaultInjector::new(Tracer::new(stub, move |e: &TraceEvent<'_>| log.borrow_mut().push(e.name().to_string())), 7);
    arm(&mut dev, &layout, 1).expect("armed");
    let (stub, _) = dev.into_inner().into_inner();
    let names = seen.borrow().clone();
    (stub, names)
}

#[test]
fn a_wrapped_mlx5_device_is_armed_in_the_mlx5_form() {
    let (stub, calls) = arm_wrapped(Stub { mlx5: true, ..Stub::default() });
    assert_eq!(stub.posted, 0, "canonical WQEs posted to an mlx5-form device");
    assert_eq!(stub.armed.len(), 1, "arm_mlx5 not reached through the wrappers");
    // the ring images went to the rings the device named
    for base in RING_BASES {
        assert!(stub.writes.iter().any(|&(a, n)| a == base && n > 0), "no ring image at {base:#x}");
    }
    for name in ["capabilities", "ring_base", "cq_numbers", "cq_producer_indices", "write_local", "arm_mlx5"] {
        assert!(calls.iter().any(|c| c == name), "the tracer did not see {name}: {calls:?}");
    }
    assert!(!calls.iter().any(|c| c == "post_send"));
}

#[test]
fn a_wrapped_canonical_device_gets_canonical_wqes() {
    let (stub, calls) = arm_wrapped(Stub::default());
    assert!(stub.posted > 0, "no canonical WQE posted");
    assert!(stub.armed.is_empty());
    assert!(!calls.iter().any(|c| c == "arm_mlx5"));
}
