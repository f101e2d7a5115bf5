//! Binding a Unix listening socket without ever destroying a file, and
//! removing it again only if it is still ours: the API socket, the VMM's
//! other sockets (`vmm::unix_socket`) and `kemari-nbd`'s listen and control
//! sockets all go through [`bind`].
//!
//! What is at the path decides: nothing, a socket no process answers on (a
//! crashed server's; replaced), a socket a process answers on (refused:
//! "another process is serving this socket"), anything else (refused, left
//! intact). The new socket is bound in a private directory beside the path
//! (mode 0700, so nobody can connect while its permissions are set), given
//! its mode and group, listening, and only then linked to the path. A link
//! never replaces what it finds, so a file that appeared meanwhile is kept
//! too: the path is absent or accepting, with the final permissions, at every
//! moment. A stale socket is first moved aside and removed only if what was
//! moved is the socket that was looked at.

use std::ffi::CString;
use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Permissions of a socket: whoever may write to it may connect (for the
/// API socket: control the VM).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketOptions {
    /// File mode (default 0600: only the VMM's user).
    pub mode: u32,
    /// Group owning the socket (a name or a numeric id), e.g. to give a group
    /// access with mode 0660. Default: the process's group.
    pub group: Option<String>,
}

impl Default for SocketOptions {
    fn default() -> Self {
        SocketOptions {
            mode: 0o600,
            group: None,
        }
    }
}

/// Why the socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Something other than a socket is at the path.
    #[error("{path} exists and is not a socket; not replacing it")]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// A process accepts connections on the socket.
    #[error("another process is serving this socket ({path})")]
    InUse {
        /// The path.
        path: PathBuf,
    },
    /// The socket's state cannot be told (connect failed otherwise than
    /// "refused").
    #[error("cannot tell whether {path} is in use: {source}")]
    Unknown {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A socket mode outside 0..=0o777.
    #[error("invalid socket mode {0:o}: use permission bits only (e.g. 0600, 0660)")]
    Mode(u32),
    /// The group does not exist.
    #[error("no such group {0:?}")]
    NoGroup(String),
    /// A system call failed.
    #[error("cannot {what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> BindError + 'a {
    move |source| BindError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

/// The identity of the socket file a server created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketIdentity {
    dev: u64,
    ino: u64,
}

impl SocketIdentity {
    fn of(meta: &std::fs::Metadata) -> Self {
        SocketIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }
}

/// A listening socket at `path`, with `options`' permissions; see the
/// module's doc for what is refused.
pub fn bind(
    path: &Path,
    options: &SocketOptions,
) -> Result<(UnixListener, SocketIdentity), BindError> {
    if options.mode > 0o777 {
        return Err(BindError::Mode(options.mode));
    }
    let gid = options.group.as_deref().map(group_id).transpose()?;
    if path.file_name().is_none() {
        return Err(io_err("bind", path)(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the socket path has no file name",
        )));
    }
    check_existing(path)?;
    let private = PrivateDir::create(path)?;
    let temporary = private.path.join("s");
    let listener = UnixListener::bind(&temporary).map_err(io_err("bind", path))?;
    std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(options.mode))
        .map_err(io_err("set the mode of", path))?;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(&temporary, None, Some(gid))
            .map_err(io_err("set the group of", path))?;
    }
    let identity = SocketIdentity::of(
        &std::fs::symlink_metadata(&temporary).map_err(io_err("inspect", path))?,
    );
    let mut linked = std::fs::hard_link(&temporary, path);
    if linked
        .as_ref()
        .is_err_and(|e| e.kind() == io::ErrorKind::AlreadyExists)
    {
        // Something appeared there meanwhile: look again, once.
        check_existing(path)?;
        linked = std::fs::hard_link(&temporary, path);
    }
    match linked {
        Ok(()) => Ok((listener, identity)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(BindError::InUse {
            path: path.to_owned(),
        }),
        Err(e) => Err(io_err("create", path)(e)),
    }
}

/// Removes the socket at `path` if it is still the one `identity` names.
pub fn remove_if_ours(path: &Path, identity: SocketIdentity) {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if SocketIdentity::of(&meta) == identity => {
            if let Err(e) = std::fs::remove_file(path) {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove the socket");
            }
        }
        Ok(_) => tracing::info!(
            path = %path.display(),
            "the socket path was taken over by another file: left in place"
        ),
        Err(_) => {}
    }
}

/// Refuses what must not be replaced and removes a stale socket.
fn check_existing(path: &Path) -> Result<(), BindError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err("inspect", path)(e)),
    };
    if !meta.file_type().is_socket() {
        return Err(BindError::NotASocket {
            path: path.to_owned(),
        });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(BindError::InUse {
            path: path.to_owned(),
        }),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            remove_stale(path, SocketIdentity::of(&meta))
        }
        // Gone since it was looked at.
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(BindError::Unknown {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Moves the stale socket aside and removes it if it is what was looked at;
/// anything else that got there meanwhile is put back.
fn remove_stale(path: &Path, stale: SocketIdentity) -> Result<(), BindError> {
    let private = PrivateDir::create(path)?;
    let aside = private.path.join("stale");
    match std::fs::rename(path, &aside) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err("replace the stale socket", path)(e)),
    }
    let moved = std::fs::symlink_metadata(&aside).ok();
    if moved.is_some_and(|m| m.file_type().is_socket() && SocketIdentity::of(&m) == stale) {
        tracing::info!(path = %path.display(), "replacing a stale socket");
        return std::fs::remove_file(&aside).map_err(io_err("remove the stale socket", path));
    }
    // Not what was looked at: put it back, never over something newer.
    if let Err(e) = rename_no_replace(&aside, path) {
        let kept = private.keep();
        return Err(BindError::Io {
            what: "put back (it is kept in the directory beside it) what replaced",
            path: kept.join("stale"),
            source: e,
        });
    }
    Err(BindError::InUse {
        path: path.to_owned(),
    })
}

/// `rename` that fails rather than replace what is at `to`.
fn rename_no_replace(from: &Path, to: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))
    };
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: both paths are NUL-terminated strings that live across the
    // call; renameat2 only reads them.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A directory only this process can enter, beside the socket path (the same
/// file system, so a link or rename between them works), removed on drop.
struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    fn create(socket: &Path) -> Result<Self, BindError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        loop {
            let name = format!(
                ".kemari-socket.{}.{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            );
            let path = socket.with_file_name(name);
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(PrivateDir { path }),
                // A leftover of an earlier process with this pid: not ours
                // to remove; take the next name.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err("create a directory beside", socket)(e)),
            }
        }
    }

    /// Leaves the directory and what is in it in place.
    fn keep(mut self) -> PathBuf {
        std::mem::take(&mut self.path)
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        if self.path.as_os_str().is_empty() {
            return;
        }
        // Only the socket this module binds there; the directory itself
        // only if that leaves it empty.
        let _ = std::fs::remove_file(self.path.join("s"));
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// A group's id, from its name or number.
fn group_id(group: &str) -> Result<u32, BindError> {
    if let Ok(gid) = group.parse::<u32>() {
        return Ok(gid);
    }
    let name = CString::new(group).map_err(|_| BindError::NoGroup(group.to_owned()))?;
    let mut buf = vec![0u8; 4096];
    loop {
        // SAFETY: an all-zero `group` is a valid value of this plain C struct
        // (null pointers, zero id); getgrnam_r overwrites it.
        let mut entry: libc::group = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::group = std::ptr::null_mut();
        // SAFETY: `name` is a NUL-terminated string; `entry`, `buf` (with its
        // true length) and `found` are valid for writes for the call; the
        // strings getgrnam_r stores point into `buf`, which is not read.
        let rc = unsafe {
            libc::getgrnam_r(
                name.as_ptr(),
                &mut entry,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut found,
            )
        };
        if rc == libc::ERANGE && buf.len() < (1 << 20) {
            buf.resize(buf.len() * 2, 0);
            continue;
        }
        if rc != 0 || found.is_null() {
            return Err(BindError::NoGroup(group.to_owned()));
        }
        return Ok(entry.gr_gid);
    }
}

/// Parses a socket mode written in octal (`600`, `0660`, `0o660`).
pub fn parse_mode(text: &str) -> Result<u32, String> {
    let digits = text.strip_prefix("0o").unwrap_or(text);
    match u32::from_str_radix(digits, 8) {
        Ok(mode) if mode <= 0o777 => Ok(mode),
        _ => Err(format!(
            "invalid socket mode {text:?}: octal permission bits, e.g. 0600 or 0660"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_in_octal() {
        assert_eq!(parse_mode("0600"), Ok(0o600));
        assert_eq!(parse_mode("660"), Ok(0o660));
        assert_eq!(parse_mode("0o640"), Ok(0o640));
        assert!(parse_mode("0800").is_err());
        assert!(parse_mode("1777").is_err());
        assert!(parse_mode("rw").is_err());
    }

    #[test]
    fn groups_resolve_by_name_or_number() {
        assert_eq!(group_id("0").unwrap(), 0);
        assert_eq!(group_id("root").unwrap(), 0);
        assert!(matches!(
            group_id("no-such-group-kemari"),
            Err(BindError::NoGroup(_))
        ));
    }
}
