//! The etcd helper process: the etcd client (gRPC on a current-thread
//! runtime), forked from the VMM at start-up, before it confines itself —
//! so the VMM's threads keep their seccomp filters and no async runtime.
//! It takes the VM's key when asked, keeps the lease alive every TTL/3 and
//! reports each renewal's deadline ([`super::wire`]); it dies with the VMM
//! (`PR_SET_PDEATHSIG`), and the lease then runs out on its own.
//!
//! Taking the key: grant a lease of the TTL, then in one transaction put
//! the key bound to it *if the key does not exist* — else read who holds
//! it, give the lease back and try again a moment later. A copy that died
//! leaves its key until its lease expires (at most the TTL after its last
//! renewal); a copy that lives renews it, and a failover gives up once it
//! has seen the same lease hold the key for longer than two TTLs.

use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, Identity, PutOptions, TlsOptions, Txn,
    TxnOp,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::time::timeout;

use super::deadline::{deadline_after, monotonic_ns};
use super::spec::{EtcdSpec, EtcdTls};
use super::wire::{Purpose, Report, Request};

/// How long one etcd call may take before it counts as failed.
fn rpc_timeout(ttl: Duration) -> Duration {
    (ttl / 3).clamp(Duration::from_millis(300), Duration::from_secs(5))
}

/// How often the key is tried while another copy holds it.
const RETRY: Duration = Duration::from_millis(200);

/// Runs the helper on `stream` until the VMM releases the lease or closes
/// its end. Called in the forked child.
pub fn serve(spec: &EtcdSpec, key: &str, stream: std::os::unix::net::UnixStream) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "etcd fence helper: cannot start its runtime");
            return;
        }
    };
    runtime.block_on(async {
        if let Err(e) = stream.set_nonblocking(true) {
            tracing::error!(error = %e, "etcd fence helper: socket");
            return;
        }
        let stream = match tokio::net::UnixStream::from_std(stream) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "etcd fence helper: socket");
                return;
            }
        };
        let (reader, mut writer) = stream.into_split();
        let mut lines = BufReader::new(reader).lines();
        let mut etcd = Etcd::new(spec, key);
        while let Ok(Some(line)) = lines.next_line().await {
            match Request::parse(&line) {
                Some(Request::Acquire(purpose)) => {
                    let taken = etcd.acquire(purpose).await;
                    let report = match &taken {
                        Ok((_, deadline)) => Report::Held(*deadline),
                        Err(why) => Report::Failed(why.clone()),
                    };
                    if send(&mut writer, &report).await.is_err() {
                        return;
                    }
                    if let Ok((lease, _)) = taken {
                        tokio::select! {
                            _ = etcd.keep_alive(lease, &mut writer) => {}
                            line = lines.next_line() => {
                                if let Ok(Some(l)) = line {
                                    if Request::parse(&l) == Some(Request::Release) {
                                        etcd.revoke(lease).await;
                                    }
                                }
                            }
                        }
                        return;
                    }
                }
                Some(Request::Release) => return,
                None => tracing::warn!(line, "etcd fence helper: unknown request"),
            }
        }
    });
}

async fn send(w: &mut OwnedWriteHalf, report: &Report) -> std::io::Result<()> {
    w.write_all(report.line().as_bytes()).await?;
    w.flush().await
}

/// Why one try did not take the key.
enum Miss {
    /// Held by another copy's lease.
    Held(i64),
    /// etcd could not be asked.
    Unreachable(String),
}

struct Etcd<'a> {
    spec: &'a EtcdSpec,
    key: &'a str,
    client: Option<Client>,
    rpc: Duration,
}

impl<'a> Etcd<'a> {
    fn new(spec: &'a EtcdSpec, key: &'a str) -> Self {
        Etcd {
            spec,
            key,
            client: None,
            rpc: rpc_timeout(spec.ttl),
        }
    }

    /// The client (connecting is lazy: endpoints are tried per call).
    async fn client(&mut self) -> Result<Client, String> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.rpc)
            .with_timeout(self.rpc)
            .with_keep_alive(self.rpc, self.rpc)
            .with_keep_alive_while_idle(true)
            // A member cut off from the cluster's leader answers at once
            // instead of hanging (another endpoint is tried next time).
            .with_require_leader(true);
        if let Some(tls) = &self.spec.tls {
            options = options.with_tls(tls_options(tls)?);
        }
        let client = timeout(
            self.rpc,
            Client::connect(self.spec.endpoints.clone(), Some(options)),
        )
        .await
        .map_err(|_| "connecting: no answer".to_owned())?
        .map_err(|e| format!("connecting: {e}"))?;
        self.client = Some(client.clone());
        Ok(client)
    }

    /// Tries until the key is ours (lease id, deadline) or the purpose's
    /// patience ran out (why).
    async fn acquire(&mut self, purpose: Purpose) -> Result<(i64, u64), String> {
        let ttl = self.spec.ttl;
        // Past this, a lease seen holding the key all along was renewed:
        // its copy is alive.
        let held_patience = 2 * ttl + Duration::from_secs(1);
        let started = tokio::time::Instant::now();
        let mut holder: Option<(i64, tokio::time::Instant)> = None;
        let mut last_warning: Option<tokio::time::Instant> = None;
        loop {
            match self.try_once(purpose).await {
                Ok(taken) => return Ok(taken),
                Err(Miss::Held(lease)) => {
                    let since = match holder {
                        Some((l, since)) if l == lease => since,
                        _ => {
                            tracing::info!(key = self.key, lease = format!("{lease:x}"), "etcd fence: the key is held by another copy; waiting for its lease to end");
                            holder = Some((lease, tokio::time::Instant::now()));
                            tokio::time::Instant::now()
                        }
                    };
                    if since.elapsed() > held_patience {
                        return Err(format!(
                            "etcd key {} is held by another copy whose lease {lease:x} stayed alive for {} s (longer than its TTL: that copy runs)",
                            self.key,
                            since.elapsed().as_secs()
                        ));
                    }
                }
                Err(Miss::Unreachable(why)) => {
                    holder = None;
                    self.reconnect_next_time();
                    if purpose == Purpose::Start && started.elapsed() > held_patience {
                        return Err(format!(
                            "etcd at {} cannot be reached: {why}",
                            self.spec.endpoints.join(",")
                        ));
                    }
                    if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(5)) {
                        tracing::warn!(
                            key = self.key,
                            error = why,
                            "etcd fence: cannot reach etcd; trying again"
                        );
                        last_warning = Some(tokio::time::Instant::now());
                    }
                }
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    async fn try_once(&mut self, purpose: Purpose) -> Result<(i64, u64), Miss> {
        let unreachable = |what: &str, e: String| Miss::Unreachable(format!("{what}: {e}"));
        let mut client = self.client().await.map_err(Miss::Unreachable)?;
        let ttl = self.spec.ttl;
        let sent = monotonic_ns();
        let grant = timeout(self.rpc, client.lease_grant(ttl.as_secs() as i64, None))
            .await
            .map_err(|_| unreachable("granting a lease", "no answer".into()))?
            .map_err(|e| unreachable("granting a lease", e.to_string()))?;
        let lease = grant.id();
        let value = holder_value(purpose);
        let txn = Txn::new()
            .when([Compare::create_revision(self.key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                self.key,
                value,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else([TxnOp::get(self.key, None)]);
        let answer = timeout(self.rpc, client.txn(txn)).await;
        let reply = match answer {
            Ok(Ok(r)) => r,
            // The put may or may not have happened: revoking the lease
            // removes the key with it if it did.
            Ok(Err(e)) => {
                self.revoke(lease).await;
                return Err(unreachable("putting the key", e.to_string()));
            }
            Err(_) => {
                self.revoke(lease).await;
                return Err(unreachable("putting the key", "no answer".into()));
            }
        };
        if reply.succeeded() {
            tracing::info!(
                key = self.key,
                lease = format!("{lease:x}"),
                ttl_s = ttl.as_secs(),
                "etcd fence: key taken"
            );
            return Ok((lease, deadline_after(sent, ttl)));
        }
        self.revoke(lease).await;
        let holder = reply
            .op_responses()
            .into_iter()
            .find_map(|op| match op {
                etcd_client::TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.lease()),
                _ => None,
            })
            .unwrap_or(0);
        Err(Miss::Held(holder))
    }

    /// Renews `lease` every TTL/3 and reports each deadline, until etcd
    /// says it is gone or the VMM stops listening.
    async fn keep_alive(&mut self, lease: i64, writer: &mut OwnedWriteHalf) {
        let ttl = self.spec.ttl;
        let every = ttl / 3;
        loop {
            let stream = match self.client().await {
                Ok(mut c) => timeout(self.rpc, c.lease_keep_alive(lease)).await,
                Err(why) => {
                    tracing::warn!(error = why, "etcd fence: cannot renew the lease");
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            };
            let (mut keeper, mut replies) = match stream {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "etcd fence: cannot renew the lease");
                    self.reconnect_next_time();
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
                Err(_) => {
                    tracing::warn!("etcd fence: cannot renew the lease: no answer");
                    self.reconnect_next_time();
                    continue;
                }
            };
            // One renewal at a time on this stream; after any failure the
            // stream is dropped, so a late answer can never be taken for
            // a later renewal's.
            loop {
                let sent = monotonic_ns();
                let renewed = timeout(self.rpc, async {
                    keeper.keep_alive().await?;
                    replies.message().await
                })
                .await;
                match renewed {
                    Ok(Ok(Some(r))) if r.ttl() > 0 => {
                        let granted = Duration::from_secs(r.ttl() as u64).min(ttl);
                        let report = Report::Renewed(deadline_after(sent, granted));
                        if send(writer, &report).await.is_err() {
                            return;
                        }
                    }
                    Ok(Ok(Some(_))) => {
                        let _ = send(
                            writer,
                            &Report::Lost(format!(
                                "etcd says lease {lease:x} on {} has expired",
                                self.key
                            )),
                        )
                        .await;
                        return;
                    }
                    Ok(Ok(None)) => {
                        tracing::warn!("etcd fence: the renewal stream ended");
                        break;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "etcd fence: renewal failed");
                        break;
                    }
                    Err(_) => {
                        tracing::warn!("etcd fence: renewal got no answer");
                        break;
                    }
                }
                tokio::time::sleep(every).await;
            }
            self.reconnect_next_time();
            tokio::time::sleep(RETRY).await;
        }
    }

    /// Drops the cached client after a failed call: its connections may be
    /// to a member that is gone or cut off, and a new client tries every
    /// endpoint again from the start.
    fn reconnect_next_time(&mut self) {
        self.client = None;
    }

    /// Gives `lease` back (best effort: unrevoked, it expires).
    async fn revoke(&mut self, lease: i64) {
        if let Ok(mut c) = self.client().await {
            if let Ok(Err(e)) = timeout(self.rpc, c.lease_revoke(lease)).await {
                tracing::debug!(error = %e, "etcd fence: cannot revoke a lease");
            }
        }
    }
}

/// The TLS configuration of `tls`, its files read now.
pub fn tls_options(tls: &EtcdTls) -> Result<TlsOptions, String> {
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| format!("TLS file {}: {e}", p.display()))
    };
    let mut options = TlsOptions::new().ca_certificate(Certificate::from_pem(read(&tls.ca)?));
    if let Some((cert, key)) = &tls.identity {
        options = options.identity(Identity::from_pem(read(cert)?, read(key)?));
    }
    Ok(options)
}

/// What the key holds: who took it, how, since when (for people and
/// tools reading the cluster).
fn holder_value(purpose: Purpose) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    serde_json::json!({
        "host": host,
        "pid": std::os::unix::process::parent_id(),
        "how": match purpose { Purpose::Start => "start", Purpose::Failover => "failover" },
        "since_unix": since,
    })
    .to_string()
}
