//! The registry in etcd (v3 API, `etcd-client` over gRPC): what an operator already runs and
//! trusts for membership (DESIGN.md §11: Mooncake Store keeps its members in etcd too).
//!
//! The MN's record is a key bound to a lease; the MN keeps the lease alive over a keep-alive
//! stream. A lease etcd no longer has is [`RegistryError::LeaseExpired`]: the MN registers
//! again (and CNs, who saw its record deleted, see a member join). The watch runs on the
//! registry's own runtime thread: a prefix get (a [`RegistryEvent::Resync`]) then a watch from
//! the next revision, so nothing between the two is missed; when the stream breaks (etcd went,
//! the connection died — HTTP/2 keep-alive pings find a silent peer) it reports
//! [`RegistryEvent::Lost`] once and starts over until etcd is back.
//!
//! Calls block the caller for at most [`EtcdRegistry::timeout`].

use crate::registry::{keys, LeaseId, Name, Registry, RegistryError, RegistryEvent, Watch};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, LeaseKeepAliveStream, LeaseKeeper, PutOptions,
    Txn, TxnOp, WatchOptions,
};
use std::collections::HashMap;
use std::future::Future;
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

/// Default bound on one registry call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

/// A pool registry in an etcd cluster.
pub struct EtcdRegistry {
    url: String,
    /// Shared with every watch (a watch outlives the handle it came from).
    rt: std::sync::Arc<tokio::runtime::Runtime>,
    client: Client,
    keepers: Mutex<HashMap<i64, (LeaseKeeper, LeaseKeepAliveStream)>>,
    timeout: Duration,
}

impl std::fmt::Debug for EtcdRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRegistry").field("url", &self.url).finish()
    }
}

fn failed(url: &str, e: impl std::fmt::Display) -> RegistryError {
    RegistryError::Failed { url: url.to_string(), detail: crate::entry::cut(&e.to_string()) }
}

fn unreachable(url: &str, e: impl std::fmt::Display) -> RegistryError {
    RegistryError::Unreachable { url: url.to_string(), detail: crate::entry::cut(&e.to_string()) }
}

/// A transport-level failure (etcd not there) rather than an answer from it.
fn classify(url: &str, e: etcd_client::Error) -> RegistryError {
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => unreachable(url, e),
        etcd_client::Error::GRpcStatus(ref s) if s.code() == tonic::Code::Unavailable => unreachable(url, e),
        other => failed(url, other),
    }
}

impl EtcdRegistry {
    /// Connect to etcd at `url` (`http://127.0.0.1:2379`; several endpoints comma-separated)
    /// and check it answers: unreachable now is an error naming the URL.
    pub fn connect(url: &str) -> Result<EtcdRegistry, RegistryError> {
        Self::connect_with(url, DEFAULT_TIMEOUT)
    }

    pub fn connect_with(url: &str, timeout: Duration) -> Result<EtcdRegistry, RegistryError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("omw-etcd")
            .enable_all()
            .build()
            .map_err(|e| failed(url, format!("cannot start the client's runtime: {e}")))?;
        let endpoints: Vec<String> = url.split(',').map(|s| s.trim().to_string()).collect();
        let opts = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(2))
            .with_keep_alive_while_idle(true);
        let client = rt
            .block_on(async { tokio::time::timeout(timeout, Client::connect(endpoints, Some(opts))).await })
            .map_err(|_| unreachable(url, format!("no answer within {timeout:?}")))?
            .map_err(|e| unreachable(url, e))?;
        let r = EtcdRegistry {
            url: url.to_string(),
            rt: std::sync::Arc::new(rt),
            client,
            keepers: Mutex::new(HashMap::new()),
            timeout,
        };
        // the client connects lazily: ask something, so "unreachable" is said here
        r.call(|mut c| async move { c.get("/omw/", Some(GetOptions::new().with_prefix().with_count_only())).await })?;
        Ok(r)
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Run one request on the runtime, bounded by the timeout.
    fn call<T, F, Fut>(&self, f: F) -> Result<T, RegistryError>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let c = self.client.clone();
        let t = self.timeout;
        match self.rt.block_on(async { tokio::time::timeout(t, f(c)).await }) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(classify(&self.url, e)),
            Err(_) => Err(unreachable(&self.url, format!("no answer within {t:?}"))),
        }
    }

    fn lease_error(&self, lease: LeaseId, e: RegistryError) -> RegistryError {
        match &e {
            RegistryError::Failed { detail, .. } if detail.contains("lease not found") => {
                RegistryError::LeaseExpired(lease)
            }
            _ => e,
        }
    }
}

fn ttl_secs(ttl: Duration) -> i64 {
    (ttl.as_millis().div_ceil(1000) as i64).max(1)
}

impl Registry for EtcdRegistry {
    fn url(&self) -> String {
        self.url.clone()
    }

    fn register(&self, pool: &Name, mn: &Name, value: &[u8], ttl: Duration) -> Result<LeaseId, RegistryError> {
        let key = keys::mn(pool, mn);
        let lease = self.call(|mut c| async move { c.lease_grant(ttl_secs(ttl), None).await })?.id();
        let (k, v) = (key.clone(), value.to_vec());
        let txn = Txn::new().when([Compare::create_revision(k.clone(), CompareOp::Equal, 0)]).and_then([TxnOp::put(
            k,
            v,
            Some(PutOptions::new().with_lease(lease)),
        )]);
        let done = self.call(|mut c| async move { c.txn(txn).await });
        match done {
            Ok(r) if r.succeeded() => Ok(LeaseId(lease)),
            other => {
                let _ = self.call(|mut c| async move { c.lease_revoke(lease).await });
                match other {
                    Ok(_) => Err(RegistryError::NameTaken(mn.to_string())),
                    Err(e) => Err(e),
                }
            }
        }
    }

    fn keep_alive(&self, lease: LeaseId) -> Result<(), RegistryError> {
        let mut keepers = self.keepers.lock().unwrap_or_else(|p| p.into_inner());
        if let std::collections::hash_map::Entry::Vacant(v) = keepers.entry(lease.0) {
            let pair = self.call(|mut c| async move { c.lease_keep_alive(lease.0).await })?;
            v.insert(pair);
        }
        let Some((keeper, stream)) = keepers.get_mut(&lease.0) else { return Err(RegistryError::LeaseExpired(lease)) };
        let t = self.timeout;
        let r = self.rt.block_on(async {
            tokio::time::timeout(t, async {
                keeper.keep_alive().await?;
                stream.message().await
            })
            .await
        });
        let out = match r {
            Ok(Ok(Some(resp))) if resp.ttl() > 0 => return Ok(()),
            // etcd answers a keep-alive of a lease it no longer has with TTL 0
            Ok(Ok(Some(_))) => Err(RegistryError::LeaseExpired(lease)),
            Ok(Ok(None)) => Err(unreachable(&self.url, "the keep-alive stream ended")),
            Ok(Err(e)) => Err(self.lease_error(lease, classify(&self.url, e))),
            Err(_) => Err(unreachable(&self.url, format!("no keep-alive answer within {t:?}"))),
        };
        // a broken stream is opened afresh next time
        keepers.remove(&lease.0);
        out
    }

    fn update(&self, pool: &Name, mn: &Name, value: &[u8], lease: LeaseId) -> Result<(), RegistryError> {
        let (k, v) = (keys::mn(pool, mn), value.to_vec());
        self.call(|mut c| async move { c.put(k, v, Some(PutOptions::new().with_lease(lease.0))).await })
            .map(|_| ())
            .map_err(|e| self.lease_error(lease, e))
    }

    fn deregister(&self, pool: &Name, mn: &Name, lease: LeaseId) -> Result<(), RegistryError> {
        self.keepers.lock().unwrap_or_else(|p| p.into_inner()).remove(&lease.0);
        let k = keys::mn(pool, mn);
        // only our own record: a successor under the same name has another lease
        let txn =
            Txn::new().when([Compare::lease(k.clone(), CompareOp::Equal, lease.0)]).and_then([TxnOp::delete(k, None)]);
        self.call(|mut c| async move { c.txn(txn).await })?;
        match self.call(|mut c| async move { c.lease_revoke(lease.0).await }) {
            Ok(_) => Ok(()),
            Err(e) => match self.lease_error(lease, e) {
                RegistryError::LeaseExpired(_) => Ok(()),
                e => Err(e),
            },
        }
    }

    fn members(&self, pool: &Name) -> Result<Vec<(String, Vec<u8>)>, RegistryError> {
        let prefix = keys::mn_prefix(pool);
        let p = prefix.clone();
        let r = self.call(|mut c| async move { c.get(p, Some(GetOptions::new().with_prefix())).await })?;
        Ok(records(&prefix, r.kvs()))
    }

    fn watch(&self, pool: &Name) -> Result<Watch, RegistryError> {
        // the first snapshot here, so an unreachable etcd is the caller's error
        let prefix = keys::mn_prefix(pool);
        let p = prefix.clone();
        let first = self.call(|mut c| async move { c.get(p, Some(GetOptions::new().with_prefix())).await })?;
        let rev = first.header().map_or(0, |h| h.revision());
        let (tx, rx) = mpsc::channel();
        let _ = tx.send(RegistryEvent::Resync(records(&prefix, first.kvs())));
        let client = self.client.clone();
        let url = self.url.clone();
        self.rt.spawn(watch_loop(client, url, prefix, rev, tx));
        Ok(Watch { rx, _keep: Some(self.rt.clone()) })
    }

    fn request_drain(&self, pool: &Name, mn: &Name, on: bool) -> Result<(), RegistryError> {
        let k = keys::drain(pool, mn);
        if on {
            self.call(|mut c| async move { c.put(k, "1", None).await }).map(|_| ())
        } else {
            self.call(|mut c| async move { c.delete(k, None).await }).map(|_| ())
        }
    }

    fn drain_requested(&self, pool: &Name, mn: &Name) -> Result<bool, RegistryError> {
        let k = keys::drain(pool, mn);
        let r = self.call(|mut c| async move { c.get(k, Some(GetOptions::new().with_count_only())).await })?;
        Ok(r.count() > 0)
    }
}

/// `(name, value)` of the records under `prefix` (keys that are not UTF-8 cannot be names and
/// are left out; the client judges the values).
fn records(prefix: &str, kvs: &[etcd_client::KeyValue]) -> Vec<(String, Vec<u8>)> {
    kvs.iter()
        .filter_map(|kv| {
            let k = std::str::from_utf8(kv.key()).ok()?;
            Some((k.strip_prefix(prefix)?.to_string(), kv.value().to_vec()))
        })
        .collect()
}

/// Follow the prefix from `rev + 1`; on any break, say `Lost` once and start over (snapshot,
/// watch) until etcd is back. Ends when the watcher is dropped.
async fn watch_loop(mut client: Client, url: String, prefix: String, mut rev: i64, tx: mpsc::Sender<RegistryEvent>) {
    let mut resync = false;
    let mut lost = false;
    loop {
        if resync {
            match client.get(prefix.clone(), Some(GetOptions::new().with_prefix())).await {
                Ok(r) => {
                    rev = r.header().map_or(rev, |h| h.revision());
                    if tx.send(RegistryEvent::Resync(records(&prefix, r.kvs()))).is_err() {
                        return;
                    }
                    lost = false;
                }
                Err(e) => {
                    if !lost && tx.send(RegistryEvent::Lost(classify(&url, e))).is_err() {
                        return;
                    }
                    lost = true;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    continue;
                }
            }
        }
        resync = true;
        let opts = WatchOptions::new().with_prefix().with_start_revision(rev + 1);
        let mut stream = match client.watch(prefix.clone(), Some(opts)).await {
            Ok(s) => s,
            Err(e) => {
                if !lost && tx.send(RegistryEvent::Lost(classify(&url, e))).is_err() {
                    return;
                }
                lost = true;
                tokio::time::sleep(Duration::from_millis(300)).await;
                continue;
            }
        };
        loop {
            match stream.message().await {
                Ok(Some(resp)) => {
                    if resp.canceled() {
                        // compacted past our revision, or cancelled by etcd: start over
                        break;
                    }
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        rev = rev.max(kv.mod_revision());
                        let Some(name) = std::str::from_utf8(kv.key()).ok().and_then(|k| k.strip_prefix(&prefix))
                        else {
                            continue;
                        };
                        let e = match ev.event_type() {
                            EventType::Put => RegistryEvent::Put { name: name.to_string(), value: kv.value().to_vec() },
                            EventType::Delete => RegistryEvent::Delete { name: name.to_string() },
                        };
                        if tx.send(e).is_err() {
                            return;
                        }
                    }
                }
                Ok(None) => {
                    if !lost && tx.send(RegistryEvent::Lost(unreachable(&url, "the watch stream ended"))).is_err() {
                        return;
                    }
                    lost = true;
                    break;
                }
                Err(e) => {
                    if !lost && tx.send(RegistryEvent::Lost(classify(&url, e))).is_err() {
                        return;
                    }
                    lost = true;
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
