//! Telling the process's owner that a destination listens: the receiving
//! end of a hand-over (live or zero-copy migration, a warm-restart
//! successor, a fault-tolerance standby) waits on a socket, and whoever
//! supervises the process (kemari: systemd's `READY=1`) may want to know
//! the moment that socket accepts connections.

use std::sync::OnceLock;

type Hook = Box<dyn Fn(&str) + Send + Sync>;

static HOOK: OnceLock<Hook> = OnceLock::new();

/// Calls `hook` with the address (`HOST:PORT` or a socket's path) each time
/// a destination of this process starts listening, on the thread that
/// listens. Set once per process; a second call is ignored.
pub fn on_listening(hook: impl Fn(&str) + Send + Sync + 'static) {
    let _ = HOOK.set(Box::new(hook));
}

/// A destination listens on `addr`.
pub(crate) fn listening(addr: &str) {
    if let Some(hook) = HOOK.get() {
        hook(addr);
    }
}
