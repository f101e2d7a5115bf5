//! The file fence (`--ft-fence PATH`): an exclusive `flock` on a file both
//! ends can reach (the disk image's directory on one host; a shared
//! filesystem across hosts). The primary holds it for its whole life; the
//! kernel drops it the moment the primary dies (crash, SIGKILL, power
//! failure of a host that shared the file through its own kernel).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::FenceError;

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
        let mut attempt = 0;
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
            std::thread::sleep(
                retry_delay(attempt).min(deadline.saturating_duration_since(Instant::now())),
            );
            attempt += 1;
        }
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The wait before retry `attempt` (from 0). A standby asks for the fence
/// when its link to the primary closes, as the primary's process ends; the
/// kernel drops that process's lock some milliseconds later, once it has
/// torn down the rest (its VM, its guest memory mapping: 8–15 ms for a
/// 256 MiB guest here). Every millisecond for the first 100 ms, so that the
/// failover waits no longer than it must; then every 20 ms.
fn retry_delay(attempt: u32) -> Duration {
    Duration::from_millis(if attempt < 100 { 1 } else { 20 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_come_every_millisecond_then_every_20_ms() {
        assert_eq!(retry_delay(0), Duration::from_millis(1));
        assert_eq!(retry_delay(99), Duration::from_millis(1));
        assert_eq!(retry_delay(100), Duration::from_millis(20));
        assert_eq!(retry_delay(u32::MAX), Duration::from_millis(20));
    }

    #[test]
    fn a_fence_released_while_waiting_is_taken() {
        let p = std::env::temp_dir().join(format!("kemari-fence-wait-{}", std::process::id()));
        let first = Fence::acquire(&p, Duration::ZERO).unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            drop(first);
        });
        let second = Fence::acquire(&p, Duration::from_secs(30)).unwrap();
        release.join().unwrap();
        drop(second);
        std::fs::remove_file(p).unwrap();
    }

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
}
