//! A CN's chain connection breaks and the library rejoins it (`Transport::rejoin`,
//! `omw_verbs::rejoin`): the MN's end of the connection — and every window bound to it — stays,
//! the CN gets a new connection to it, and the application keeps its chunks. Each test breaks
//! one connection the way a wire does: the model drops the next message the CN's QP sends, the
//! RC transport retries until it gives up (`RetryExcErr`) and both ends go to the error state,
//! the MN's chain on that connection with them.

use omw_client::model::{Model, ModelConfig, ModelDevice};
use omw_client::{Cn, Error, Options};
use omw_core::device::behaviour::ForeignBind;
use omw_core::device::{ExecutionMode, WcStatus};
use omw_loopback::{MessageFilter, NicConfig, QpAddr};

const CHUNKS: u32 = 16;

/// An offloading MN on a device that honours binds naming another QP (the paper's layout:
/// windows on the access QPs) or refuses them (the layout that binds to the poster: windows on
/// the Alloc QP).
fn model(foreign_bind: ForeignBind) -> Model {
    let mut b = NicConfig::DEFAULT_BEHAVIOUR;
    b.foreign_bind = foreign_bind;
    Model::start(ModelConfig {
        chunks: CHUNKS,
        mode: Some(ExecutionMode::Offloaded),
        nic: NicConfig::strict().with_behaviour(b),
        ..Default::default()
    })
    .unwrap()
}

/// A CN on `m`, and its Alloc and Free QPs as the model addresses them.
fn connect(m: &Model) -> (Cn<ModelDevice>, QpAddr, QpAddr) {
    let c = m.connect().unwrap();
    let (host, alloc, free) = (c.device.host(), c.qps.alloc, c.qps.free);
    (Cn::new(c, Options::default()).unwrap(), QpAddr::new(host, alloc), QpAddr::new(host, free))
}

/// The next message `qp` sends is lost on the wire.
fn drop_next_from(m: &Model, qp: QpAddr) {
    m.with_cluster(move |c| c.fabric.borrow_mut().faults_mut().drop_next(MessageFilter::from_qp(qp), 1)).unwrap();
}

fn read(cn: &Cn<ModelDevice>, c: &omw_client::Chunk, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    cn.read(c, 0, &mut b).unwrap();
    b
}

/// Groups no CN holds (in the free queue, or popped ahead by a chain).
fn unallocated(m: &Model) -> u32 {
    m.with_cluster(|c| c.unallocated()).unwrap()
}

/// The MN at rest: every group is free or popped ahead again, and no invariant is broken.
fn all_back(m: &Model, total: u32) {
    m.with_cluster(|c| c.pump().map(|_| ())).unwrap().unwrap();
    m.with_cluster(|c| c.check_invariants()).unwrap().unwrap();
    assert_eq!(unallocated(m), total, "nothing leaked");
}

/// Windows on the Alloc QP: an access lost on the wire breaks the Alloc QP. The access
/// reports its failure; the library rejoins, and every chunk it holds — on windows bound to
/// the MN's end of that connection — still reads what was written; the alloc chain serves
/// again; the frees give everything back.
#[test]
fn an_access_that_broke_the_alloc_qp_costs_the_cn_nothing_it_holds() {
    let m = model(ForeignBind::Refused);
    assert!(m.with_cluster(|c| c.driver.mn.config().chain_variant.binds_to_poster).unwrap());
    let (cn, alloc, _) = connect(&m);
    let total = unallocated(&m);
    let (a, b) = (cn.alloc().unwrap(), cn.alloc().unwrap());
    cn.write(&a, 0, b"first").unwrap();
    cn.write(&b, 0, b"second").unwrap();
    drop_next_from(&m, alloc);
    assert_eq!(cn.write(&a, 0, b"lost!"), Err(Error::Access(WcStatus::RetryExcErr)));
    assert_eq!(cn.stats().rejoins, 1, "the Alloc QP was rejoined once");
    assert_eq!(read(&cn, &a, 5), b"first");
    assert_eq!(read(&cn, &b, 6), b"second");
    assert_eq!(cn.held_chunks(), 2);
    let c = cn.alloc().unwrap();
    cn.write(&c, 0, b"third").unwrap();
    assert_eq!(read(&cn, &c, 5), b"third");
    assert_eq!(unallocated(&m), total - 3, "nothing taken back: three held");
    for x in [a, b, c] {
        cn.free(x).unwrap();
    }
    cn.progress().unwrap();
    all_back(&m, total);
    assert_eq!(cn.stats().rejoins, 1);
}

/// The paper's layout (windows on the access QPs): the allocation request is lost on the wire
/// and the Alloc QP breaks under it. The caller never sees it: the library rejoins and asks
/// again, and the chunk it already held is untouched.
#[test]
fn an_allocation_whose_request_was_lost_is_asked_again_on_the_rejoined_qp() {
    let m = model(ForeignBind::Honoured);
    assert!(!m.with_cluster(|c| c.driver.mn.config().chain_variant.binds_to_poster).unwrap());
    let (cn, alloc, _) = connect(&m);
    let total = unallocated(&m);
    let a = cn.alloc().unwrap();
    cn.write(&a, 0, b"held").unwrap();
    drop_next_from(&m, alloc);
    let b = cn.alloc().expect("asked again after the rejoin");
    assert_eq!(cn.stats().rejoins, 1);
    cn.write(&b, 0, b"new").unwrap();
    assert_eq!(read(&cn, &a, 4), b"held");
    assert_eq!(read(&cn, &b, 3), b"new");
    assert_ne!(a, b);
    assert_eq!(unallocated(&m), total - 2);
    cn.free(a).unwrap();
    cn.free(b).unwrap();
    cn.progress().unwrap();
    all_back(&m, total);
}

/// A free lost on the wire breaks the Free QP: the library rejoins it and the driver sends the
/// free again, so the chunk goes back to the pool instead of staying held until the CN leaves.
#[test]
fn a_free_lost_with_the_free_qp_is_sent_again() {
    for fb in [ForeignBind::Honoured, ForeignBind::Refused] {
        let m = model(fb);
        let (cn, _, free) = connect(&m);
        let total = unallocated(&m);
        let (a, b) = (cn.alloc().unwrap(), cn.alloc().unwrap());
        drop_next_from(&m, free);
        cn.free(a).unwrap();
        for _ in 0..8 {
            cn.progress().unwrap();
            m.with_cluster(|c| c.pump().map(|_| ())).unwrap().unwrap();
        }
        assert_eq!(cn.stats().rejoins, 1, "{fb:?}");
        assert_eq!(unallocated(&m), total - 1, "{fb:?}: the free landed");
        cn.write(&b, 0, b"still mine").unwrap();
        assert_eq!(read(&cn, &b, 10), b"still mine");
        cn.free(b).unwrap();
        cn.progress().unwrap();
        all_back(&m, total);
    }
}

/// Nothing to rejoin when the MN is gone: the connection is lost, as before.
#[test]
fn without_an_mn_a_broken_chain_connection_is_a_lost_connection() {
    let m = model(ForeignBind::Refused);
    let (cn, alloc, _) = connect(&m);
    let a = cn.alloc().unwrap();
    m.kill_mn().unwrap();
    drop_next_from(&m, alloc);
    assert!(cn.write(&a, 0, b"x").is_err());
    assert_eq!(cn.alloc(), Err(Error::Disconnected));
    assert_eq!(cn.stats().rejoins, 0);
}
