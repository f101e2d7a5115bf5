//! Unix listening sockets that appear at their path only once they listen.
//!
//! `UnixListener::bind` is `socket` + `bind` + `listen`: between the last two
//! the path exists but a `connect` is refused. A client that waits for the
//! path to appear (scripts, `kemarictl`, a migration source, the benches) can
//! hit that window on a loaded host. [`bind_listening`] binds and listens at a
//! temporary name in the same directory and then renames it into place, so
//! the path is either absent or accepting.

use std::io;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

/// Listens on `path` (an existing file or stale socket there is replaced);
/// the path appears only when connections are accepted.
pub fn bind_listening(path: &Path) -> io::Result<UnixListener> {
    let temporary = temporary_name(path)?;
    let _ = std::fs::remove_file(&temporary);
    let listener = UnixListener::bind(&temporary)?;
    if let Err(e) = std::fs::rename(&temporary, path) {
        let _ = std::fs::remove_file(&temporary);
        return Err(e);
    }
    Ok(listener)
}

/// `.<name>.<pid>.listening` beside `path` (the same directory, so the
/// rename is atomic).
fn temporary_name(path: &Path) -> io::Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("socket path {} has no file name", path.display()),
        )
    })?;
    let mut temporary = std::ffi::OsString::from(".");
    temporary.push(name);
    temporary.push(format!(".{}.listening", std::process::id()));
    Ok(path.with_file_name(temporary))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("unix-socket-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_path_accepts_as_soon_as_it_exists_and_leaves_no_temporary() {
        let dir = scratch("accepts");
        let path = dir.join("api.sock");
        std::fs::write(&path, b"stale").unwrap();
        let listener = bind_listening(&path).unwrap();
        UnixStream::connect(&path).unwrap();
        listener.accept().unwrap();
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("api.sock")]);
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
