//! The in-process registry: etcd's keys, leases and watches for a pool that lives in one
//! process (the loopback demo, tests). Time is the deployment's: leases expire when the owner
//! moves the clock past their deadline ([`InProcessRegistry::set_now`]) — on the model that is
//! modelled time, so a run is deterministic. Its reachability can be switched off to play a
//! registry that went away ([`InProcessRegistry::set_reachable`]).

use crate::registry::{keys, LeaseId, Name, Registry, RegistryError, RegistryEvent, Watch};
use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Debug, Default)]
struct State {
    now_ns: u64,
    reachable: bool,
    next_lease: i64,
    /// key → (value, lease)
    kv: BTreeMap<String, (Vec<u8>, Option<LeaseId>)>,
    /// lease → (deadline, ttl)
    leases: HashMap<LeaseId, (u64, u64)>,
    watchers: Vec<(String, mpsc::Sender<RegistryEvent>)>,
}

/// A registry in this process; clones share it.
#[derive(Clone, Debug)]
pub struct InProcessRegistry {
    state: Arc<Mutex<State>>,
}

impl Default for InProcessRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl InProcessRegistry {
    pub fn new() -> Self {
        InProcessRegistry { state: Arc::new(Mutex::new(State { reachable: true, next_lease: 1, ..State::default() })) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // a panic while holding the lock cannot leave the maps half-updated in a way that
        // matters more than the panic itself: keep going with what is there
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The deployment's clock moved to `now_ns`: leases whose deadline passed expire, and their
    /// keys go (watchers see them deleted).
    pub fn set_now(&self, now_ns: u64) {
        let mut s = self.lock();
        s.now_ns = s.now_ns.max(now_ns);
        let now = s.now_ns;
        let expired: Vec<LeaseId> = s.leases.iter().filter(|(_, (d, _))| *d <= now).map(|(l, _)| *l).collect();
        for l in expired {
            s.leases.remove(&l);
            let gone: Vec<String> = s.kv.iter().filter(|(_, (_, kl))| *kl == Some(l)).map(|(k, _)| k.clone()).collect();
            for k in gone {
                s.kv.remove(&k);
                notify(&mut s, &k, None);
            }
        }
    }

    pub fn now(&self) -> u64 {
        self.lock().now_ns
    }

    /// Make the registry unreachable (every call fails, watchers are told) or reachable again
    /// (watchers get a fresh [`RegistryEvent::Resync`]). Leases keep running meanwhile, as an
    /// etcd cluster's do while a client is cut off.
    pub fn set_reachable(&self, on: bool) {
        let mut s = self.lock();
        if s.reachable == on {
            return;
        }
        s.reachable = on;
        let err = unreachable();
        let watchers = std::mem::take(&mut s.watchers);
        let mut kept = Vec::new();
        for (prefix, tx) in watchers {
            let ev = if on { RegistryEvent::Resync(snapshot(&s, &prefix)) } else { RegistryEvent::Lost(err.clone()) };
            if tx.send(ev).is_ok() {
                kept.push((prefix, tx));
            }
        }
        s.watchers = kept;
    }

    fn reachable(s: &State) -> Result<(), RegistryError> {
        if s.reachable {
            Ok(())
        } else {
            Err(unreachable())
        }
    }
}

fn unreachable() -> RegistryError {
    RegistryError::Unreachable { url: "in-process".into(), detail: "switched off".into() }
}

fn snapshot(s: &State, prefix: &str) -> Vec<(String, Vec<u8>)> {
    s.kv.range(prefix.to_string()..)
        .take_while(|(k, _)| k.starts_with(prefix))
        .map(|(k, (v, _))| (k[prefix.len()..].to_string(), v.clone()))
        .collect()
}

/// Tell every watcher whose prefix covers `key` (value None: deleted). Watchers whose
/// receiver is gone are dropped.
fn notify(s: &mut State, key: &str, value: Option<&[u8]>) {
    if !s.reachable {
        // an unreachable registry tells nobody; the Resync on its return does
        return;
    }
    s.watchers.retain(|(prefix, tx)| {
        let Some(name) = key.strip_prefix(prefix.as_str()) else { return true };
        let ev = match value {
            Some(v) => RegistryEvent::Put { name: name.to_string(), value: v.to_vec() },
            None => RegistryEvent::Delete { name: name.to_string() },
        };
        tx.send(ev).is_ok()
    });
}

impl Registry for InProcessRegistry {
    fn url(&self) -> String {
        "in-process".into()
    }

    fn register(&self, pool: &Name, mn: &Name, value: &[u8], ttl: Duration) -> Result<LeaseId, RegistryError> {
        let mut s = self.lock();
        Self::reachable(&s)?;
        let key = keys::mn(pool, mn);
        if s.kv.contains_key(&key) {
            return Err(RegistryError::NameTaken(mn.to_string()));
        }
        let l = LeaseId(s.next_lease);
        s.next_lease += 1;
        let ttl = ttl.as_nanos().min(u64::MAX as u128) as u64;
        let deadline = s.now_ns.saturating_add(ttl);
        s.leases.insert(l, (deadline, ttl));
        s.kv.insert(key.clone(), (value.to_vec(), Some(l)));
        notify(&mut s, &key, Some(value));
        Ok(l)
    }

    fn keep_alive(&self, lease: LeaseId) -> Result<(), RegistryError> {
        let mut s = self.lock();
        Self::reachable(&s)?;
        let now = s.now_ns;
        match s.leases.get_mut(&lease) {
            Some((d, ttl)) => {
                *d = now.saturating_add(*ttl);
                Ok(())
            }
            None => Err(RegistryError::LeaseExpired(lease)),
        }
    }

    fn update(&self, pool: &Name, mn: &Name, value: &[u8], lease: LeaseId) -> Result<(), RegistryError> {
        let mut s = self.lock();
        Self::reachable(&s)?;
        if !s.leases.contains_key(&lease) {
            return Err(RegistryError::LeaseExpired(lease));
        }
        let key = keys::mn(pool, mn);
        s.kv.insert(key.clone(), (value.to_vec(), Some(lease)));
        notify(&mut s, &key, Some(value));
        Ok(())
    }

    fn deregister(&self, pool: &Name, mn: &Name, lease: LeaseId) -> Result<(), RegistryError> {
        let mut s = self.lock();
        Self::reachable(&s)?;
        let key = keys::mn(pool, mn);
        if s.kv.get(&key).is_some_and(|(_, l)| *l == Some(lease)) {
            s.kv.remove(&key);
            notify(&mut s, &key, None);
        }
        s.leases.remove(&lease);
        Ok(())
    }

    fn members(&self, pool: &Name) -> Result<Vec<(String, Vec<u8>)>, RegistryError> {
        let s = self.lock();
        Self::reachable(&s)?;
        Ok(snapshot(&s, &keys::mn_prefix(pool)))
    }

    fn watch(&self, pool: &Name) -> Result<Watch, RegistryError> {
        let mut s = self.lock();
        Self::reachable(&s)?;
        let prefix = keys::mn_prefix(pool);
        let (tx, rx) = mpsc::channel();
        let _ = tx.send(RegistryEvent::Resync(snapshot(&s, &prefix)));
        s.watchers.push((prefix, tx));
        Ok(Watch { rx, _keep: None })
    }

    fn request_drain(&self, pool: &Name, mn: &Name, on: bool) -> Result<(), RegistryError> {
        let mut s = self.lock();
        Self::reachable(&s)?;
        let key = keys::drain(pool, mn);
        if on {
            s.kv.insert(key, (b"1".to_vec(), None));
        } else {
            s.kv.remove(&key);
        }
        Ok(())
    }

    fn drain_requested(&self, pool: &Name, mn: &Name) -> Result<bool, RegistryError> {
        let s = self.lock();
        Self::reachable(&s)?;
        Ok(s.kv.contains_key(&keys::drain(pool, mn)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> Name {
        Name::new(s).unwrap()
    }

    #[test]
    fn a_record_lives_as_long_as_its_lease() {
        let r = InProcessRegistry::new();
        let w = r.watch(&n("p")).unwrap();
        assert_eq!(w.drain(), vec![RegistryEvent::Resync(vec![])]);
        let l = r.register(&n("p"), &n("a"), b"one", Duration::from_secs(2)).unwrap();
        assert_eq!(
            r.register(&n("p"), &n("a"), b"x", Duration::from_secs(2)),
            Err(RegistryError::NameTaken("a".into()))
        );
        r.set_now(1_500_000_000);
        r.keep_alive(l).unwrap();
        r.update(&n("p"), &n("a"), b"two", l).unwrap();
        r.set_now(3_000_000_000);
        assert_eq!(r.members(&n("p")).unwrap(), vec![("a".to_string(), b"two".to_vec())]);
        // another pool sees nothing of it
        assert_eq!(r.members(&n("q")).unwrap(), vec![]);
        r.set_now(3_500_000_001);
        assert_eq!(r.members(&n("p")).unwrap(), vec![]);
        assert_eq!(r.keep_alive(l), Err(RegistryError::LeaseExpired(l)));
        assert_eq!(
            w.drain(),
            vec![
                RegistryEvent::Put { name: "a".into(), value: b"one".to_vec() },
                RegistryEvent::Put { name: "a".into(), value: b"two".to_vec() },
                RegistryEvent::Delete { name: "a".into() },
            ]
        );
        // the name is free again: a rejoin
        let l2 = r.register(&n("p"), &n("a"), b"three", Duration::from_secs(2)).unwrap();
        r.deregister(&n("p"), &n("a"), l2).unwrap();
        assert_eq!(r.members(&n("p")).unwrap(), vec![]);
    }

    #[test]
    fn an_unreachable_registry_fails_calls_and_resyncs_watchers_on_return() {
        let r = InProcessRegistry::new();
        let l = r.register(&n("p"), &n("a"), b"one", Duration::from_secs(2)).unwrap();
        let w = r.watch(&n("p")).unwrap();
        w.drain();
        r.set_reachable(false);
        assert!(matches!(r.keep_alive(l), Err(RegistryError::Unreachable { .. })));
        assert!(matches!(w.drain().as_slice(), [RegistryEvent::Lost(_)]));
        r.set_reachable(true);
        assert_eq!(w.drain(), vec![RegistryEvent::Resync(vec![("a".into(), b"one".to_vec())])]);
    }

    #[test]
    fn drain_requests_are_keys_of_their_own() {
        let r = InProcessRegistry::new();
        assert!(!r.drain_requested(&n("p"), &n("a")).unwrap());
        r.request_drain(&n("p"), &n("a"), true).unwrap();
        assert!(r.drain_requested(&n("p"), &n("a")).unwrap());
        assert!(!r.drain_requested(&n("p"), &n("b")).unwrap());
        // not an MN record
        assert_eq!(r.members(&n("p")).unwrap(), vec![]);
        r.request_drain(&n("p"), &n("a"), false).unwrap();
        assert!(!r.drain_requested(&n("p"), &n("a")).unwrap());
    }
}
