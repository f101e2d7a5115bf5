//! Ending cleanly: the Unix sockets `kemari-nbd` bound (listen and control
//! sockets) are removed when it ends — when their owner is dropped, and on
//! SIGTERM or SIGINT, which end the process at once with status 0 — but
//! only while they are still the sockets it created
//! (`kemari_unix_socket::remove_if_ours`).

use std::io;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use kemari_unix_socket::{BindError, SocketIdentity, SocketOptions};
use signal_hook::consts::{SIGINT, SIGTERM};
use tracing::info;

/// The sockets to remove at exit, by registration number.
static SOCKETS: Mutex<Vec<(u64, PathBuf, SocketIdentity)>> = Mutex::new(Vec::new());

fn sockets() -> std::sync::MutexGuard<'static, Vec<(u64, PathBuf, SocketIdentity)>> {
    SOCKETS.lock().unwrap_or_else(|e| e.into_inner())
}

/// A socket file this process bound: removed on drop and at a signalled
/// exit, if it is still ours.
#[derive(Debug)]
pub struct OwnedSocket {
    id: u64,
    path: PathBuf,
    identity: SocketIdentity,
}

impl OwnedSocket {
    /// Binds `path` (mode 0600): a stale socket there is replaced; a regular
    /// file, or a socket another process serves, is refused and left intact.
    pub fn bind(path: &Path) -> Result<(UnixListener, OwnedSocket), BindError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let (listener, identity) = kemari_unix_socket::bind(path, &SocketOptions::default())?;
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        sockets().push((id, path.to_owned(), identity));
        let owned = OwnedSocket {
            id,
            path: path.to_owned(),
            identity,
        };
        Ok((listener, owned))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for OwnedSocket {
    fn drop(&mut self) {
        sockets().retain(|(id, _, _)| *id != self.id);
        kemari_unix_socket::remove_if_ours(&self.path, self.identity);
    }
}

/// Removes every socket still registered (at exit).
pub fn remove_sockets() {
    for (_, path, identity) in sockets().drain(..) {
        kemari_unix_socket::remove_if_ours(&path, identity);
    }
}

/// On SIGTERM or SIGINT: remove the sockets and exit with status 0.
pub fn exit_on_signals() -> io::Result<()> {
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])?;
    std::thread::Builder::new()
        .name("nbd-signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                info!(signal, "stopping");
                remove_sockets();
                std::process::exit(0);
            }
        })?;
    Ok(())
}
