//! The verbs MN's byte quota across size classes, without a device: each class is a host-engine
//! `MemoryNode` on the loopback model, its tenants registered from a tenants file as `omw mn
//! --tenants` registers them (`Tenant::register`), and the classes kept in step with the
//! bookkeeping `MnDaemon::run_all` runs between steps (`mn::class_ledger`: each class publishes
//! what its tenants hold, then every class learns what they hold in the others).

use omw_core::cn::Allocation;
use omw_core::device::ExecutionMode;
use omw_core::mn::tenant::TenantId;
use omw_core::wire::message::ErrorCode;
use omw_loopback::cluster::{Cluster, ClusterConfig, CnOpError};
use omw_loopback::NicConfig;
use omw_verbs::admission::{parse_tenants, Tenant};
use omw_verbs::mn::class_ledger::{publish_class, ClassLedger, Learned};

const SMALL: u64 = 4096;
const LARGE: u64 = 65536;
/// (chunk size, chunks) of the two classes.
const CLASSES: [(u64, u32); 2] = [(SMALL, 40), (LARGE, 4)];

/// An MN of two classes with the tenants of `tenants` (a tenants file's text).
struct Mn {
    classes: Vec<Cluster>,
    learned: Vec<Learned>,
    ledger: ClassLedger,
    tenants: Vec<Tenant>,
}

impl Mn {
    fn new(tenants: &str) -> Mn {
        let mut classes = Vec::new();
        let mut parsed = Vec::new();
        for (chunk_size, chunks) in CLASSES {
            let mut cc = ClusterConfig::paper_like();
            cc.cns = 0;
            cc.max_cns = Some(8);
            cc.chunk_size = chunk_size;
            cc.chunks = chunks;
            cc.group_size = 2;
            cc.quota = chunks;
            cc.mode = Some(ExecutionMode::HostEngine);
            cc.nic = NicConfig::strict().with_offload(false).with_prefetch(8);
            let mut c = Cluster::new(cc).unwrap();
            // each class reads the same file for its own chunk size, as `omw mn --classes` does
            parsed = parse_tenants(tenants, chunk_size).unwrap();
            for t in &parsed {
                t.register(&mut c.driver.mn, chunk_size).unwrap();
            }
            classes.push(c);
        }
        Mn {
            learned: vec![Learned::default(); classes.len()],
            ledger: ClassLedger::new(classes.len()),
            classes,
            tenants: parsed,
        }
    }

    fn tenant(&self, name: &str) -> TenantId {
        self.tenants.iter().find(|t| t.credential.name == name).unwrap().credential.id
    }

    /// What `run_all` does after a class's step: publish, then every class learns.
    fn sync(&mut self) {
        for (k, c) in self.classes.iter().enumerate() {
            publish_class(&mut self.ledger, k, CLASSES[k].0, &c.driver.mn);
        }
        for (k, c) in self.classes.iter_mut().enumerate() {
            self.learned[k].learn(&self.ledger, k, &mut c.driver.mn);
        }
    }

    /// A CN of `tenant` (None: an open CN) connects to class `k`, told at once what its tenant
    /// holds elsewhere (as `MnDaemon::on_cm` does after `connect_as`).
    fn connect(&mut self, k: usize, tenant: Option<&str>) -> usize {
        let t = tenant.map(|n| self.tenant(n));
        let c = &mut self.classes[k];
        let i = c.connect_cn_as(t).unwrap();
        if let Some(t) = t {
            let id = c.cns[i].id;
            self.learned[k].tell(&mut c.driver.mn, id, t);
        }
        i
    }

    fn alloc(&mut self, k: usize, cn: usize) -> Result<Allocation, CnOpError> {
        let r = self.classes[k].alloc(cn);
        self.sync();
        r
    }

    fn free(&mut self, k: usize, cn: usize, a: &Allocation) {
        self.classes[k].free(cn, a).unwrap();
        self.sync();
    }

    fn check(&mut self) {
        for c in self.classes.iter_mut() {
            c.check_invariants().unwrap();
        }
    }
}

fn refused(r: Result<Allocation, CnOpError>) -> bool {
    matches!(r, Err(CnOpError::Mn(ErrorCode::QuotaExceeded)))
}

const SECRET_A: &str = "00112233445566778899aabbccddeeff";
const SECRET_B: &str = "ffeeddccbbaa99887766554433221100";

fn tenants() -> String {
    // alice: two large chunks' worth over both classes; bob: one
    format!("alice secret={SECRET_A} quota=128K cns=2\nbob secret={SECRET_B} quota=64K cns=2\n")
}

#[test]
fn a_tenant_is_refused_at_its_bytes_over_both_classes_and_a_free_in_one_makes_room_in_the_other() {
    let mut mn = Mn::new(&tenants());
    let large = mn.connect(1, Some("alice"));
    let small = mn.connect(0, Some("alice"));
    let big = mn.alloc(1, large).unwrap();
    // 64 KiB held in the large class: sixteen 4-KiB chunks make the tenant's 128 KiB
    let mut held: Vec<_> = (0..16).map(|_| mn.alloc(0, small).unwrap()).collect();
    // the small class has room (40 chunks) and alice's group quota there is 32: the bytes refuse
    assert!(refused(mn.alloc(0, small)));
    // and a second large chunk would be 192 KiB
    assert!(refused(mn.alloc(1, large)));
    // one small chunk freed: still no room for 64 KiB
    let a = held.pop().unwrap();
    mn.free(0, small, &a);
    assert!(refused(mn.alloc(1, large)));
    for a in held.drain(..) {
        mn.free(0, small, &a);
    }
    let second = mn.alloc(1, large).unwrap();
    // 128 KiB in the large class: nothing in the small one
    assert!(refused(mn.alloc(0, small)));
    mn.free(1, large, &big);
    mn.free(1, large, &second);
    assert!(mn.alloc(0, small).is_ok());
    assert_eq!(mn.classes.iter().map(|c| c.driver.mn.stats().quota_disconnects).sum::<u64>(), 0);
    mn.check();
}

#[test]
fn a_tenants_second_cn_in_a_class_gains_nothing() {
    let mut mn = Mn::new(&tenants());
    let large = mn.connect(1, Some("alice"));
    let s1 = mn.connect(0, Some("alice"));
    mn.alloc(1, large).unwrap();
    for _ in 0..16 {
        mn.alloc(0, s1).unwrap();
    }
    // a second session of alice in the small class, connected at her limit: told at connect
    // what she holds in the large class, so its very first request is refused
    let s2 = mn.connect(0, Some("alice"));
    assert!(refused(mn.alloc(0, s2)));
    assert!(refused(mn.alloc(0, s1)));
    mn.check();
}

#[test]
fn a_disconnect_drops_the_holders_share_in_the_other_classes() {
    let mut mn = Mn::new(&tenants());
    let large = mn.connect(1, Some("alice"));
    let small = mn.connect(0, Some("alice"));
    mn.alloc(1, large).unwrap();
    mn.alloc(1, large).unwrap();
    assert!(refused(mn.alloc(0, small)));
    // the large-class CN's host goes: its chunks are reclaimed, and the small class learns it
    mn.classes[1].crash_cn(large).unwrap();
    mn.sync();
    assert_eq!(mn.ledger.total(mn.tenant("alice")), 0);
    for _ in 0..32 {
        mn.alloc(0, small).unwrap();
    }
    // now alice's group quota in the small class (128 KiB / 4 KiB) is what refuses
    assert!(refused(mn.alloc(0, small)));
    mn.check();
}

#[test]
fn two_tenants_are_held_apart() {
    let mut mn = Mn::new(&tenants());
    let a_large = mn.connect(1, Some("alice"));
    let b_large = mn.connect(1, Some("bob"));
    let b_small = mn.connect(0, Some("bob"));
    let a_small = mn.connect(0, Some("alice"));
    mn.alloc(1, b_large).unwrap();
    // bob is at his 64 KiB: refused in both classes
    assert!(refused(mn.alloc(0, b_small)));
    assert!(refused(mn.alloc(1, b_large)));
    // alice is not charged for bob's chunk
    mn.alloc(1, a_large).unwrap();
    for _ in 0..16 {
        mn.alloc(0, a_small).unwrap();
    }
    assert!(refused(mn.alloc(0, a_small)));
    mn.check();
}

#[test]
fn an_open_cn_is_its_own_holder_in_each_class() {
    let mut mn = Mn::new(&tenants());
    // without a tenant nothing ties two sessions together: each is held to its class's group
    // quota alone, and the ledger does not know it
    let small = mn.connect(0, None);
    let large = mn.connect(1, None);
    for _ in 0..4 {
        mn.alloc(1, large).unwrap();
    }
    for _ in 0..20 {
        mn.alloc(0, small).unwrap();
    }
    assert_eq!(mn.ledger.version(), 0);
    for c in &mn.classes {
        let id = c.cns[0].id;
        assert_eq!(c.driver.mn.byte_quota_of(id), None);
        assert_eq!(c.driver.mn.held_elsewhere(id), 0);
    }
    mn.check();
}
