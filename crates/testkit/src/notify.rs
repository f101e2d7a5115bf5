//! A stand-in for systemd's notification socket: a Unix datagram socket the
//! test owns, named to the process under test by `NOTIFY_SOCKET`, as
//! systemd does for a `Type=notify` unit (sd_notify(3)).

use std::collections::BTreeMap;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The socket; its file is removed on drop.
pub struct NotifySocket {
    socket: UnixDatagram,
    path: PathBuf,
}

/// One notification: its `KEY=VALUE` lines.
pub type Notification = BTreeMap<String, String>;

impl NotifySocket {
    /// Binds `dir/notify.sock`.
    pub fn bind(dir: &Path) -> NotifySocket {
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let socket =
            UnixDatagram::bind(&path).unwrap_or_else(|e| panic!("binding {}: {e}", path.display()));
        NotifySocket { socket, path }
    }

    /// `("NOTIFY_SOCKET", path)`, for the child's environment.
    pub fn env(&self) -> (&'static str, &str) {
        ("NOTIFY_SOCKET", self.path.to_str().expect("a UTF-8 path"))
    }

    /// The next notification; panics, naming `what`, if none comes within
    /// `patience`.
    pub fn next(&self, what: &str, patience: Duration) -> Notification {
        self.socket.set_read_timeout(Some(patience)).unwrap();
        let mut buf = [0u8; 4096];
        let n = self
            .socket
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("no notification ({what}) within {patience:?}: {e}"));
        let text = String::from_utf8_lossy(&buf[..n]);
        text.lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }

    /// A notification already waiting, if any.
    pub fn pending(&self) -> Option<Notification> {
        self.socket.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 4096];
        let got = self.socket.recv(&mut buf).ok();
        self.socket.set_nonblocking(false).unwrap();
        got.map(|n| {
            String::from_utf8_lossy(&buf[..n])
                .lines()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        })
    }
}

impl Drop for NotifySocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
