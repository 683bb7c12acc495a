//! Pool scenarios (issue 24): many MNs in one registry, placement and routing on the CN — run on
//! every pool testbed that can: the loopback model with the in-process registry
//! ([`loopback::LoopbackBed`]) here, the soft-RoCE VMs with etcd beside omw-verbs' tests.
//!
//! A testbed is a [`PoolBed`]: pool clients for new CNs, time that passes (modelled, or real),
//! and the faults and operator actions the scenarios need. The scenarios ([`scenarios`]) are
//! generic over it; [`run`] runs the list and reports each one.

pub mod loopback;
pub mod scenarios;

use crate::runner::Outcome;
use omw_pool::entry::ClassSpec;
use omw_pool::registry::{Name, Registry};
use omw_pool::session::Connector;
use omw_pool::PoolClient;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The pool a scenario asks for: MNs by name, each with its size classes.
#[derive(Clone, Debug)]
pub struct PoolShape {
    pub mns: Vec<(String, Vec<ClassSpec>)>,
}

impl PoolShape {
    /// `n` MNs `mn0…` with the same classes.
    pub fn uniform(n: usize, classes: &[ClassSpec]) -> Self {
        PoolShape { mns: (0..n).map(|i| (format!("mn{i}"), classes.to_vec())).collect() }
    }
}

/// What a pool testbed offers the scenarios.
pub trait PoolBed {
    type Connector: Connector;
    /// A pool client for a new CN.
    fn client(&mut self, seed: u64) -> PoolClient<Self::Connector>;
    /// Let `ms` of the pool's time pass (the model: modelled time, every MN's timers and
    /// refreshes; real hosts: wall-clock time).
    fn pass(&mut self, ms: u64);
    /// The MNs' registry lease (ms): how long a vanished MN stays a member.
    fn lease_ms(&self) -> u64;
    /// MN `mn` vanishes without a goodbye.
    fn vanish(&mut self, mn: &str);
    /// The operator asks MN `mn` to drain (or to stop).
    fn drain(&mut self, mn: &str, on: bool);
    /// MN `mn` starts again (a new incarnation, nothing of its previous run).
    fn restart(&mut self, mn: &str);
    /// Chunks CNs hold on MN `mn`, as the MN counts them.
    fn held(&mut self, mn: &str) -> Option<u64>;
    /// Whether MN `mn` has said it is drained (draining and holding nothing).
    fn drained(&mut self, mn: &str) -> bool;
    /// The registry the pool lives in (scenarios plant bad records there).
    fn registry(&self) -> &dyn Registry;
    fn pool(&self) -> Name;
    /// The protocol's invariants on every live MN.
    fn check(&mut self) -> Result<(), String>;
}

/// A pool scenario's body: given a way to start a pool of a shape on the testbed under test.
pub type PoolRun<B> = fn(&mut dyn FnMut(&PoolShape) -> B) -> Outcome;

/// One pool scenario.
pub struct PoolScenario<B: PoolBed> {
    pub name: &'static str,
    pub run: PoolRun<B>,
}

/// Run `list` with testbeds from `make` (scenarios whose name contains `OMW_SCENARIO`, if
/// set); print each outcome; the names of the failed ones.
pub fn run<B: PoolBed>(list: &[PoolScenario<B>], make: &mut dyn FnMut(&PoolShape) -> B) -> Vec<String> {
    let filter = std::env::var("OMW_SCENARIO").ok();
    let mut failed = Vec::new();
    for s in list.iter().filter(|s| filter.as_deref().is_none_or(|f| s.name.contains(f))) {
        match catch_unwind(AssertUnwindSafe(|| (s.run)(make))) {
            Ok(Ok(())) => println!("PASS pool::{}", s.name),
            Ok(Err(e)) => {
                println!("FAIL pool::{}: {}", s.name, e.0);
                failed.push(s.name.to_string());
            }
            Err(_) => {
                println!("FAIL pool::{}: panicked", s.name);
                failed.push(s.name.to_string());
            }
        }
    }
    failed
}
