//! systemd's readiness protocol (`sd_notify`): `READY=1` and a `STATUS=`
//! line to the socket named by `NOTIFY_SOCKET`, which systemd sets for a
//! `Type=notify` unit (packaging/systemd/kemari@.service); without it
//! nothing is sent. kemari is ready once its VM runs, its API (if any)
//! already answering; a VMM that waits for its VM — a live or zero-copy
//! migration's destination, a warm-restart successor, a fault-tolerance
//! standby — is ready once it listens for it, and says so again when the
//! VM runs here.
//!
//! Both are sent by the main thread, whose seccomp filter (the process's)
//! allows the `socket`, `connect` and `sendto` it takes; the API threads'
//! filter does not.

use sd_notify::NotifyState;

/// Tells the service manager that kemari is ready, and its state.
pub fn ready(status: &str) {
    if let Err(e) = sd_notify::notify(&[NotifyState::Ready, NotifyState::Status(status)]) {
        tracing::warn!(
            error = %e,
            socket = ?std::env::var_os("NOTIFY_SOCKET"),
            "cannot tell the service manager that kemari is ready (NOTIFY_SOCKET)"
        );
    }
}

/// Tells the service manager that kemari is ready whenever it starts
/// listening for its VM (`transfer::listening`).
pub fn ready_when_listening() {
    transfer::listening::on_listening(|addr| ready(&format!("waiting for its VM on {addr}")));
}
