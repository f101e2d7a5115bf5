//! Fault tolerance's state changes as events (`ft_syncing`, `ft_protected`,
//! `ft_degraded`, `ft_standby`, `ft_failing_over`, `ft_failed_over`,
//! `ft_unprotected`). The state lives in `FtShared`, which the primary's
//! and the standby's threads set; a watcher thread looks at it every
//! [`EVERY`], and the main loop at the moments it knows one changed (an FT
//! start's end, a failover), so those come in order with the rest. A state
//! held for less than [`EVERY`] between two looks may go unseen.

use std::sync::Arc;
use std::time::Duration;

use ft::status::FtState;
use serde_json::json;

use super::shared::Shared;

/// How often the watcher looks.
const EVERY: Duration = Duration::from_millis(100);

/// Publishes the change of fault tolerance's state since the last look, if
/// any.
pub fn observe(shared: &Shared) {
    let mut seen = shared.ft_seen.lock().unwrap_or_else(|p| p.into_inner());
    if shared.ft.state() == *seen {
        return;
    }
    let report = shared.ft.report();
    let name = |s: FtState| {
        serde_json::to_value(s)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
    };
    let Some(now) = name(report.state) else {
        return;
    };
    shared.events.publish(
        match report.state {
            FtState::Unprotected => "ft_unprotected",
            FtState::Syncing => "ft_syncing",
            FtState::Protected => "ft_protected",
            FtState::Degraded => "ft_degraded",
            FtState::Standby => "ft_standby",
            FtState::FailingOver => "ft_failing_over",
            FtState::FailedOver => "ft_failed_over",
        },
        json!({
            "state": now,
            "previous": name(*seen),
            "peer": report.peer,
            "epoch": report.epoch,
            "failover_ms": report.failover_ms,
            "last_error": report.last_error,
        }),
    );
    *seen = report.state;
}

/// Starts the watcher thread (it ends when the events do).
pub fn watch(shared: &Arc<Shared>) {
    let shared = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("ft-events".into())
        .spawn(move || {
            while !shared.events.is_closed() {
                std::thread::sleep(EVERY);
                observe(&shared);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no fault-tolerance events: cannot start their watcher");
    }
}
