//! The agent's lease, kept alive by a thread of its own (as etcd clients'
//! lease keepers do), whatever a round of the agent is doing: a round that
//! waits on a VMM that does not answer, or on a loaded etcd, must not let
//! the host's registration and its standby claims lapse.
//!
//! The thread has its own runtime and its own connection to etcd, so a
//! step of the agent that blocks its runtime does not stop it. It renews
//! every TTL/3; when etcd says the lease is gone (etcd unreachable longer
//! than the TTL) it takes a new one, and the agent's next round registers
//! the host and its claims again under it.
//!
//! It renews only while the agent's loop shows signs of life
//! ([`Keeper::alive`]): an agent stuck for longer than the stall limit lets
//! its lease expire, and with it its claims, so that other hosts protect
//! the VMs it would not.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ft::fence::etcd::EtcdSpec;

use crate::store::Store;
use crate::FleetError;

/// How soon a failed renewal is tried again.
const RETRY: Duration = Duration::from_millis(200);

#[derive(Debug)]
struct State {
    /// The lease the host's keys are bound to.
    lease: i64,
    /// When the agent's loop last showed life.
    beat: Instant,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    stop: AtomicBool,
}

impl Shared {
    fn with<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// The keep-alive thread of the agent's lease; it stops when dropped.
#[derive(Debug)]
pub struct Keeper {
    shared: Arc<Shared>,
}

/// How long the agent's loop may show no life before its lease is let go:
/// four TTLs, at least a minute (a round's every step has its own time
/// limit; a minute without one ending is a stuck agent).
pub fn stall_limit(ttl: Duration) -> Duration {
    (ttl * 4).max(Duration::from_secs(60))
}

impl Keeper {
    /// Keeps `lease` (granted under `spec`) alive from a new thread.
    pub fn start(spec: &EtcdSpec, lease: i64) -> Result<Keeper, FleetError> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                lease,
                beat: Instant::now(),
            }),
            stop: AtomicBool::new(false),
        });
        let thread = shared.clone();
        let spec = spec.clone();
        std::thread::Builder::new()
            .name("fleet-lease".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                match rt {
                    Ok(rt) => rt.block_on(keep(&spec, &thread)),
                    Err(e) => {
                        tracing::error!(error = %e, "fleet agent: no runtime for the lease keeper")
                    }
                }
            })
            .map_err(|source| FleetError::Thread {
                what: "the lease keeper",
                source,
            })?;
        Ok(Keeper { shared })
    }

    /// The lease the host's keys must be bound to now.
    pub fn lease(&self) -> i64 {
        self.shared.with(|s| s.lease)
    }

    /// The agent's loop is alive (called between the steps of a round).
    pub fn alive(&self) {
        self.shared.with(|s| s.beat = Instant::now());
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

/// The keeper's loop.
async fn keep(spec: &EtcdSpec, shared: &Shared) {
    let period = spec.ttl / 3;
    let limit = stall_limit(spec.ttl);
    let mut store: Option<Store> = None;
    let mut failures = 0u32;
    let mut stalled = false;
    while !shared.stop.load(Ordering::SeqCst) {
        let (lease, quiet) = shared.with(|s| (s.lease, s.beat.elapsed()));
        if quiet > limit {
            if !stalled {
                tracing::error!(
                    quiet_ms = quiet.as_millis() as u64,
                    "fleet agent: its rounds have stalled; no longer renewing its lease \
                     (its claims go, other hosts take over)"
                );
                stalled = true;
            }
            tokio::time::sleep(period).await;
            continue;
        }
        if stalled {
            tracing::info!("fleet agent: its rounds go on again");
            stalled = false;
        }
        if store.is_none() {
            match Store::connect(spec).await {
                Ok(s) => store = Some(s),
                Err(e) => {
                    failures += 1;
                    renew_failed(failures, &e);
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            }
        }
        let Some(s) = &store else { continue };
        match renewal(s, spec, lease).await {
            Ok(new) => {
                if failures > 0 {
                    tracing::info!(failures, "fleet agent: the lease is renewed again");
                }
                failures = 0;
                if new != lease {
                    shared.with(|s| s.lease = new);
                }
                tokio::time::sleep(period).await;
            }
            Err(e) => {
                failures += 1;
                renew_failed(failures, &e);
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

/// Renews `lease`; if etcd let it expire, takes a new one. The lease
/// to use from now on.
async fn renewal(store: &Store, spec: &EtcdSpec, lease: i64) -> Result<i64, FleetError> {
    if store.renew(lease).await? {
        tracing::trace!(lease, "fleet agent: lease renewed");
        return Ok(lease);
    }
    tracing::error!(
        lease,
        "fleet agent: etcd let this host's lease expire; registering again"
    );
    store.grant(spec.ttl).await
}

fn renew_failed(failures: u32, e: &FleetError) {
    // The first failure in a row says so; the following ones are quieter
    // (every 200 ms while etcd is away).
    if failures == 1 || failures.is_power_of_two() {
        tracing::warn!(error = %e, failures, "fleet agent: cannot renew the lease; trying again");
    } else {
        tracing::debug!(error = %e, failures, "fleet agent: cannot renew the lease; trying again");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_counts_as_stuck_after_four_ttls_or_a_minute() {
        assert_eq!(stall_limit(Duration::from_secs(5)), Duration::from_secs(60));
        assert_eq!(
            stall_limit(Duration::from_secs(30)),
            Duration::from_secs(120)
        );
    }
}
