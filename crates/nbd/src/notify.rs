//! systemd's readiness protocol (`sd_notify`): once the target or the proxy
//! listens, `READY=1` and a `STATUS=` line go to the socket named by
//! `NOTIFY_SOCKET`, which systemd sets for a `Type=notify` unit
//! (packaging/systemd/kemari-nbd@.service); without it nothing is sent.

use sd_notify::NotifyState;

/// Tells the service manager that kemari-nbd serves on `listen`.
pub fn ready(what: &str, listen: &str) {
    let status = format!("{what} serving on {listen}");
    if let Err(e) = sd_notify::notify(&[NotifyState::Ready, NotifyState::Status(&status)]) {
        tracing::warn!(
            error = %e,
            socket = ?std::env::var_os("NOTIFY_SOCKET"),
            "cannot tell the service manager that kemari-nbd is ready (NOTIFY_SOCKET)"
        );
    }
}
