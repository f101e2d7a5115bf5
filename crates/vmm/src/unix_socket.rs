//! Unix listening sockets that appear at their path only once they listen,
//! and never over a file that is not a stale socket.
//!
//! `UnixListener::bind` is `socket` + `bind` + `listen`: between the last two
//! the path exists but a `connect` is refused. A client that waits for the
//! path to appear (scripts, `kemarictl`, a migration source, the benches) can
//! hit that window on a loaded host. [`bind_listening`] binds and listens
//! elsewhere and only then links the socket to its path, so the path is
//! either absent or accepting — through `kemari_unix_socket::bind`, which
//! also refuses a regular file (left intact) and a socket another process
//! still serves, and replaces only a stale socket.

use std::io;
use std::os::unix::net::UnixListener;
use std::path::Path;

use kemari_unix_socket::{BindError, SocketOptions};

/// Listens on `path` (mode 0600; a stale socket there is replaced, anything
/// else refused); the path appears only when connections are accepted.
pub fn bind_listening(path: &Path) -> io::Result<UnixListener> {
    match kemari_unix_socket::bind(path, &SocketOptions::default()) {
        Ok((listener, _)) => Ok(listener),
        Err(e) => {
            let kind = match &e {
                BindError::NotASocket { .. } | BindError::InUse { .. } => {
                    io::ErrorKind::AlreadyExists
                }
                BindError::Io { source, .. } | BindError::Unknown { source, .. } => source.kind(),
                BindError::Mode(_) | BindError::NoGroup(_) => io::ErrorKind::InvalidInput,
            };
            Err(io::Error::new(kind, e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;
    use std::path::PathBuf;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("unix-socket-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &Path) -> Vec<std::ffi::OsString> {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn the_path_accepts_as_soon_as_it_exists_and_leaves_no_temporary() {
        let dir = scratch("accepts");
        let path = dir.join("api.sock");
        // A stale socket (its server is gone) is replaced.
        drop(UnixListener::bind(&path).unwrap());
        let listener = bind_listening(&path).unwrap();
        UnixStream::connect(&path).unwrap();
        listener.accept().unwrap();
        assert_eq!(names(&dir), vec![std::ffi::OsString::from("api.sock")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_regular_file_or_a_live_socket_is_refused_and_kept() {
        let dir = scratch("refused");
        let file = dir.join("console.log");
        std::fs::write(&file, b"precious").unwrap();
        let e = bind_listening(&file).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
        assert!(e.to_string().contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&file).unwrap(), b"precious");
        let live = dir.join("live.sock");
        let first = bind_listening(&live).unwrap();
        let e = bind_listening(&live).unwrap_err();
        assert!(e.to_string().contains("another process"), "{e}");
        UnixStream::connect(&live).unwrap();
        first.accept().unwrap();
        assert_eq!(names(&dir), vec!["console.log", "live.sock"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_directory_is_an_error() {
        let path = std::env::temp_dir()
            .join(format!("unix-socket-{}-missing", std::process::id()))
            .join("api.sock");
        assert!(bind_listening(&path).is_err());
        assert!(bind_listening(Path::new("/")).is_err());
    }
}
