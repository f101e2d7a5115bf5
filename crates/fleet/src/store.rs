//! The registry in etcd, through the same client crate as the etcd fence
//! (`etcd-client`): one read of everything under `PREFIX/_fleet/`, host
//! registration bound to a lease, and compare-and-swap writes so that two
//! agents never overwrite each other's view.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, PutOptions, Txn, TxnOp,
    WatchOptions, WatchStream,
};
use ft::fence::etcd::EtcdSpec;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::timeout;

use crate::record::{Claim, HostRecord, Keys, Kind, VmRecord};
use crate::FleetError;

/// A record as read, with the revision a compare-and-swap must match.
#[derive(Debug, Clone, PartialEq)]
pub struct Versioned<T> {
    /// The record.
    pub value: T,
    /// Its key's `mod_revision`.
    pub revision: i64,
}

/// Everything the registry holds, read at one revision.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    /// Registered hosts, by name.
    pub hosts: BTreeMap<String, HostRecord>,
    /// VM records, by id.
    pub vms: BTreeMap<String, Versioned<VmRecord>>,
    /// Standby claims, by VM id.
    pub claims: BTreeMap<String, Versioned<Claim>>,
}

impl Snapshot {
    /// The hosts as a list (name order).
    pub fn host_list(&self) -> Vec<HostRecord> {
        self.hosts.values().cloned().collect()
    }
}

/// A connection to the registry.
#[derive(Clone)]
pub struct Store {
    client: Client,
    keys: Keys,
    endpoints: String,
    rpc: Duration,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("endpoints", &self.endpoints)
            .field("keys", &self.keys)
            .finish()
    }
}

impl Store {
    /// Connects to the cluster of `spec` (TLS as the fence does); each
    /// call may take a third of the lease's TTL (an agent must renew its
    /// lease in time).
    pub async fn connect(spec: &EtcdSpec) -> Result<Store, FleetError> {
        let rpc = (spec.ttl / 3).clamp(Duration::from_millis(500), Duration::from_secs(5));
        Self::connect_with(spec, rpc).await
    }

    /// [`connect`](Self::connect), each call taking up to `rpc`.
    pub async fn connect_with(spec: &EtcdSpec, rpc: Duration) -> Result<Store, FleetError> {
        let endpoints = spec.endpoints.join(",");
        let fail = |why: String| FleetError::Etcd {
            endpoints: endpoints.clone(),
            why,
        };
        let mut options = ConnectOptions::new()
            .with_connect_timeout(rpc)
            .with_timeout(rpc)
            .with_require_leader(true);
        if let Some(tls) = &spec.tls {
            options = options
                .with_tls(ft::fence::etcd::helper::tls_options(tls).map_err(FleetError::Spec)?);
        }
        let client = timeout(
            rpc * 2,
            Client::connect(spec.endpoints.clone(), Some(options)),
        )
        .await
        .map_err(|_| fail("connecting: no answer".into()))?
        .map_err(|e| fail(format!("connecting: {e}")))?;
        Ok(Store {
            client,
            keys: Keys::new(&spec.prefix),
            endpoints,
            rpc,
        })
    }

    /// The registry's keys.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    fn fail(&self, what: &str, why: impl std::fmt::Display) -> FleetError {
        FleetError::Etcd {
            endpoints: self.endpoints.clone(),
            why: format!("{what}: {why}"),
        }
    }

    /// Everything under `PREFIX/_fleet/`; records that do not parse are
    /// skipped (and logged).
    pub async fn snapshot(&self) -> Result<Snapshot, FleetError> {
        let mut client = self.client.clone();
        let reply = timeout(
            self.rpc,
            client.get(self.keys.root(), Some(GetOptions::new().with_prefix())),
        )
        .await
        .map_err(|_| self.fail("reading the registry", "no answer"))?
        .map_err(|e| self.fail("reading the registry", e))?;
        let mut snap = Snapshot::default();
        for kv in reply.kvs() {
            let Ok(key) = kv.key_str() else { continue };
            let Some((kind, name)) = self.keys.classify(key) else {
                continue;
            };
            let revision = kv.mod_revision();
            let bytes = kv.value();
            match kind {
                Kind::Host => {
                    if let Some(h) = parse::<HostRecord>(key, bytes) {
                        snap.hosts.insert(name.to_owned(), h);
                    }
                }
                Kind::Vm => {
                    if let Some(value) = parse::<VmRecord>(key, bytes) {
                        snap.vms
                            .insert(name.to_owned(), Versioned { value, revision });
                    }
                }
                Kind::Claim => {
                    if let Some(value) = parse::<Claim>(key, bytes) {
                        snap.claims
                            .insert(name.to_owned(), Versioned { value, revision });
                    }
                }
            }
        }
        Ok(snap)
    }

    /// Watches everything under `PREFIX/_fleet/`: the stream yields on
    /// each change.
    pub async fn watch(&self) -> Result<WatchStream, FleetError> {
        let mut client = self.client.clone();
        timeout(
            self.rpc,
            client.watch(self.keys.root(), Some(WatchOptions::new().with_prefix())),
        )
        .await
        .map_err(|_| self.fail("watching the registry", "no answer"))?
        .map_err(|e| self.fail("watching the registry", e))
    }

    /// Whether the fence key of VM `id` is held (some copy runs it).
    pub async fn fence_held(&self, id: &str) -> Result<bool, FleetError> {
        let mut client = self.client.clone();
        let reply = timeout(
            self.rpc,
            client.get(
                self.keys.fence(id),
                Some(GetOptions::new().with_count_only()),
            ),
        )
        .await
        .map_err(|_| self.fail("reading a fence key", "no answer"))?
        .map_err(|e| self.fail("reading a fence key", e))?;
        Ok(reply.count() > 0)
    }

    /// A new lease of `ttl`.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, FleetError> {
        let mut client = self.client.clone();
        let g = timeout(self.rpc, client.lease_grant(ttl.as_secs() as i64, None))
            .await
            .map_err(|_| self.fail("granting a lease", "no answer"))?
            .map_err(|e| self.fail("granting a lease", e))?;
        Ok(g.id())
    }

    /// Renews `lease` once; false if etcd says it is gone.
    pub async fn renew(&self, lease: i64) -> Result<bool, FleetError> {
        let mut client = self.client.clone();
        // The client's keep-alive sends one renewal and reads its answer:
        // an error "lease not found" when etcd answers with no TTL left.
        match timeout(self.rpc, client.lease_keep_alive(lease))
            .await
            .map_err(|_| self.fail("renewing a lease", "no answer"))?
        {
            Ok(_) => Ok(true),
            Err(etcd_client::Error::LeaseKeepAliveError(why)) if why == "lease not found" => {
                Ok(false)
            }
            Err(e) => Err(self.fail("renewing a lease", e)),
        }
    }

    /// Gives `lease` back: every key bound to it goes.
    pub async fn revoke(&self, lease: i64) {
        let mut client = self.client.clone();
        let _ = timeout(self.rpc, client.lease_revoke(lease)).await;
    }

    /// Writes this host's record, bound to `lease`.
    pub async fn put_host(&self, host: &HostRecord, lease: i64) -> Result<(), FleetError> {
        let mut client = self.client.clone();
        timeout(
            self.rpc,
            client.put(
                self.keys.host(&host.name),
                json(host),
                Some(PutOptions::new().with_lease(lease)),
            ),
        )
        .await
        .map_err(|_| self.fail("registering the host", "no answer"))?
        .map_err(|e| self.fail("registering the host", e))?;
        Ok(())
    }

    /// Writes `key` only if it still has `revision` (0: only if absent),
    /// bound to `lease` if given; whether it was written.
    async fn swap(
        &self,
        key: String,
        revision: i64,
        value: String,
        lease: Option<i64>,
    ) -> Result<bool, FleetError> {
        let compare = if revision == 0 {
            Compare::create_revision(key.clone(), CompareOp::Equal, 0)
        } else {
            Compare::mod_revision(key.clone(), CompareOp::Equal, revision)
        };
        let options = lease.map(|l| PutOptions::new().with_lease(l));
        let txn = Txn::new()
            .when([compare])
            .and_then([TxnOp::put(key, value, options)]);
        let mut client = self.client.clone();
        let reply = timeout(self.rpc, client.txn(txn))
            .await
            .map_err(|_| self.fail("writing the registry", "no answer"))?
            .map_err(|e| self.fail("writing the registry", e))?;
        Ok(reply.succeeded())
    }

    /// Writes VM `vm.id`'s record if it is still at `revision` (0: absent).
    pub async fn swap_vm(&self, revision: i64, vm: &VmRecord) -> Result<bool, FleetError> {
        self.swap(self.keys.vm(&vm.id), revision, json(vm), None)
            .await
    }

    /// Claims VM `id` for a standby on this host: only if nobody has.
    pub async fn claim(&self, id: &str, claim: &Claim, lease: i64) -> Result<bool, FleetError> {
        self.swap(self.keys.claim(id), 0, json(claim), Some(lease))
            .await
    }

    /// Rewrites a claim held at `revision` (the standby's address).
    pub async fn update_claim(
        &self,
        id: &str,
        revision: i64,
        claim: &Claim,
        lease: i64,
    ) -> Result<bool, FleetError> {
        self.swap(self.keys.claim(id), revision, json(claim), Some(lease))
            .await
    }

    /// Deletes VM `id`'s claim if it is still at `revision`.
    pub async fn drop_claim(&self, id: &str, revision: i64) -> Result<bool, FleetError> {
        let key = self.keys.claim(id);
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key.clone(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::delete(key, None::<DeleteOptions>)]);
        let mut client = self.client.clone();
        let reply = timeout(self.rpc, client.txn(txn))
            .await
            .map_err(|_| self.fail("dropping a claim", "no answer"))?
            .map_err(|e| self.fail("dropping a claim", e))?;
        Ok(reply.succeeded())
    }
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

fn parse<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Option<T> {
    match serde_json::from_slice(bytes) {
        Ok(v) => Some(v),
        Err(e) => {
            tracing::warn!(key, error = %e, "fleet: a registry record does not parse; skipped");
            None
        }
    }
}

/// Runs `f` on a current-thread runtime (for callers without one, such as
/// `kemarictl fleet`).
pub fn block_on<F: std::future::Future>(f: F) -> Result<F::Output, FleetError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| FleetError::Etcd {
            endpoints: String::new(),
            why: format!("cannot start a runtime: {e}"),
        })?;
    Ok(rt.block_on(f))
}

/// How long a one-shot reader (`kemarictl fleet`) waits for etcd.
const READ_PATIENCE: Duration = Duration::from_secs(10);

/// Reads the registry of `spec` once (blocking). The client spreads its
/// requests over the endpoints, a dead member's too (seen in the lab: one
/// member killed, a read failed with "tcp connect error"): if the read
/// fails, each member is asked on its own.
pub fn read_once(spec: &EtcdSpec) -> Result<Snapshot, FleetError> {
    block_on(async {
        let read = |spec: EtcdSpec| async move {
            let store = Store::connect_with(&spec, READ_PATIENCE).await?;
            store.snapshot().await
        };
        let first = read(spec.clone()).await;
        if first.is_ok() || spec.endpoints.len() < 2 {
            return first;
        }
        for endpoint in &spec.endpoints {
            let one = EtcdSpec {
                endpoints: vec![endpoint.clone()],
                ..spec.clone()
            };
            if let Ok(snap) = read(one).await {
                return Ok(snap);
            }
        }
        first
    })?
}
