//! The pool testbed on the loopback model: `omw_pool::loopback::LoopbackPool` (a cluster per
//! class of each MN, the in-process registry, the pool's modelled clock).

use super::{PoolBed, PoolShape};
use omw_core::device::ExecutionMode;
use omw_loopback::NicConfig;
use omw_pool::loopback::{LoopbackConnector, LoopbackMnConfig, LoopbackPool};
use omw_pool::registry::{Name, Registry};
use omw_pool::PoolClient;

/// A pool of model MNs.
pub struct LoopbackBed {
    pub pool: LoopbackPool,
    drained: Vec<String>,
}

impl LoopbackBed {
    /// The MNs of `shape`, each class's MN in `mode` (offloaded chains, or the host engine).
    pub fn new(shape: &PoolShape, mode: ExecutionMode) -> Self {
        let mut cfg = LoopbackMnConfig { mode: Some(mode), ..LoopbackMnConfig::default() };
        if mode == ExecutionMode::HostEngine {
            cfg.nic = NicConfig::strict().with_offload(false).with_prefetch(8);
        }
        let mut pool = LoopbackPool::new("conformance", cfg).expect("pool");
        for (name, classes) in &shape.mns {
            pool.add_mn(name, classes).expect("MN");
        }
        LoopbackBed { pool, drained: Vec::new() }
    }
}

impl PoolBed for LoopbackBed {
    type Connector = LoopbackConnector;
    fn client(&mut self, seed: u64) -> PoolClient<LoopbackConnector> {
        self.pool.client(seed).expect("client")
    }
    fn pass(&mut self, ms: u64) {
        // in steps of 100 ms, so refreshes and lease expiries happen at their own times
        for _ in 0..ms.div_ceil(100) {
            for (mn, r) in self.pool.advance(100_000_000).expect("advance") {
                if r.drained {
                    self.drained.push(mn);
                }
            }
        }
    }
    fn lease_ms(&self) -> u64 {
        self.pool.cfg.ttl.as_millis() as u64
    }
    fn vanish(&mut self, mn: &str) {
        self.pool.vanish(mn).expect("vanish");
    }
    fn drain(&mut self, mn: &str, on: bool) {
        self.pool.drain(mn, on).expect("drain");
    }
    fn restart(&mut self, mn: &str) {
        self.pool.restart(mn).expect("restart");
    }
    fn held(&mut self, mn: &str) -> Option<u64> {
        self.pool.mn(mn).filter(|m| !m.vanished).map(|m| m.held())
    }
    fn drained(&mut self, mn: &str) -> bool {
        self.drained.iter().any(|d| d == mn)
    }
    fn registry(&self) -> &dyn Registry {
        &self.pool.registry
    }
    fn pool(&self) -> Name {
        self.pool.pool.clone()
    }
    fn check(&mut self) -> Result<(), String> {
        for m in self.pool.mns().filter(|m| !m.vanished) {
            m.check_invariants()?;
        }
        Ok(())
    }
}
