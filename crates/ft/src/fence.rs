//! The split-brain rule: only the process holding the fence runs the VM.
//!
//! The fence is an exclusive `flock` on a file both ends can reach (the disk
//! image's directory on one host; a shared filesystem across hosts). The
//! primary holds it for its whole life; the kernel drops it the moment the
//! primary dies (crash, SIGKILL, power failure of a host that shared the file
//! through its own kernel). A standby that lost the sync link tries to take it
//! before running the VM: if the primary is alive — the link was cut, not the
//! primary — the lock is still held and the standby does **not** fail over.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Why the fence could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// The lock file cannot be opened.
    #[error("fence {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Another process holds it.
    #[error(
        "fence {0} is held by another process (the primary is alive): not running the VM here"
    )]
    Held(PathBuf),
    /// The fence command did not confirm the primary is off.
    #[error("fence command `{command}` did not confirm the primary is off ({outcome}): not running the VM here")]
    Command {
        /// The command.
        command: String,
        /// Its exit status or why it could not run.
        outcome: String,
    },
}

/// Runs the STONITH-style fence command (`sh -c`), waiting up to `patience`;
/// Ok only if it exited 0.
pub fn run_fence_command(command: &str, peer: &str, patience: Duration) -> Result<(), FenceError> {
    let fail = |outcome: String| FenceError::Command {
        command: command.to_owned(),
        outcome,
    };
    let mut child = std::process::Command::new("sh")
        .args(["-c", command])
        .env("KEMARI_FT_PEER", peer)
        .stdin(std::process::Stdio::null())
        .spawn()
        .map_err(|e| fail(e.to_string()))?;
    let deadline = Instant::now() + patience;
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return Ok(()),
            Ok(Some(st)) => return Err(fail(st.to_string())),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!(
                    "no answer within {} ms",
                    patience.as_millis()
                )));
            }
            Err(e) => return Err(fail(e.to_string())),
        }
    }
}

/// A held fence; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub struct Fence {
    _file: File,
    path: PathBuf,
}

impl Fence {
    /// Takes the fence at `path`, retrying until `patience` has passed.
    pub fn acquire(path: &Path, patience: Duration) -> Result<Fence, FenceError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|source| FenceError::Open {
                path: path.to_path_buf(),
                source,
            })?;
        let deadline = Instant::now() + patience;
        loop {
            // SAFETY: flock on an fd we own; no memory is involved.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc == 0 {
                return Ok(Fence {
                    _file: file,
                    path: path.to_path_buf(),
                });
            }
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(FenceError::Open {
                    path: path.to_path_buf(),
                    source: err,
                });
            }
            if Instant::now() >= deadline {
                return Err(FenceError::Held(path.to_path_buf()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_one_holder_and_release_on_drop() {
        let p = std::env::temp_dir().join(format!("kemari-fence-{}", std::process::id()));
        let first = Fence::acquire(&p, Duration::ZERO).unwrap();
        assert!(matches!(
            Fence::acquire(&p, Duration::from_millis(50)),
            Err(FenceError::Held(_))
        ));
        drop(first);
        let again = Fence::acquire(&p, Duration::ZERO).unwrap();
        assert_eq!(again.path(), p);
        drop(again);
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn fence_command_must_succeed_in_time() {
        let t = Duration::from_secs(5);
        run_fence_command("test \"$KEMARI_FT_PEER\" = h:1", "h:1", t).unwrap();
        assert!(matches!(
            run_fence_command("exit 3", "h:1", t),
            Err(FenceError::Command { .. })
        ));
        assert!(run_fence_command("sleep 5", "h:1", Duration::from_millis(100)).is_err());
    }
}
