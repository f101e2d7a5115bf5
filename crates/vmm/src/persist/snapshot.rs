//! Snapshot directories.
//!
//! ```text
//! DIR/state.bin        the VM state (format.rs), written last: its presence
//!                      marks a complete snapshot
//! DIR/memory.bin       a sparse image of guest memory (full snapshots only)
//! DIR/memory.extents   its data extents and their CRC-32s (image_index.rs),
//!                      checked on restore
//! ```
//!
//! Every file is created 0600. A full snapshot does not replace an existing
//! one (a `state.bin` or `memory.bin` in DIR) unless told to (`--force`).
//!
//! A *full* snapshot (suspend-to-disk) copies guest memory into `memory.bin`. A
//! *warm* snapshot (Warm-VM Reboot) writes only `state.bin`: guest memory stays
//! in its named file (under /dev/shm or hugetlbfs) and the next process maps
//! that same file — nothing is copied, so the cost does not grow with memory.

use std::path::{Path, PathBuf};

use super::format::{self, FormatError};
use super::memory_image::{self, ImageError, ImageStats};
use super::VmState;
use crate::memory::{GuestMemoryFile, MemoryBacking, MemoryError};

/// State file name.
pub const STATE_FILE: &str = "state.bin";
/// Memory image name.
pub const MEMORY_FILE: &str = "memory.bin";
/// The memory image's index.
pub const EXTENTS_FILE: &str = "memory.extents";
/// Largest state file read.
const MAX_STATE_FILE: u64 = format::MAX_PAYLOAD + format::HEADER_LEN as u64;

/// Errors writing or reading a snapshot directory.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Directory or state file I/O.
    #[error("snapshot {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The state file is not valid.
    #[error("snapshot state {path}: {source}")]
    Format {
        /// The state file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: FormatError,
    },
    /// The state file is larger than any valid one.
    #[error("snapshot state {0} is larger than {MAX_STATE_FILE} bytes")]
    TooLarge(PathBuf),
    /// The memory image failed.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// Opening the named memory file failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A warm snapshot needs memory in a named file.
    #[error("warm restart needs guest memory in a named file (start kemari with --memory-file /dev/shm/NAME); this VM uses {0}")]
    NotNamedMemory(String),
    /// A snapshot is already there and may not be replaced.
    #[error("{dir} already holds a snapshot ({files}): choose another directory, or replace it with `kemarictl snapshot DIR --force` (API: \"force\": true)")]
    Exists {
        /// The directory.
        dir: PathBuf,
        /// The snapshot files found there.
        files: String,
    },
    /// The snapshot has no memory to restore from.
    #[error("snapshot {0} has no memory.bin and its memory was not in a named file")]
    NoMemory(PathBuf),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `state` as `dir/state.bin` atomically (temporary file, fsync, rename).
pub fn write_state(dir: &Path, state: &VmState) -> Result<u64, SnapshotError> {
    write_state_file(dir, state, true)
}

/// [`write_state`], with the fsync only if `durable`.
fn write_state_file(dir: &Path, state: &VmState, durable: bool) -> Result<u64, SnapshotError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let path = dir.join(STATE_FILE);
    let bytes = format::encode(state).map_err(|source| SnapshotError::Format {
        path: path.clone(),
        source,
    })?;
    super::write_private(&path, &bytes, durable).map_err(io_err(&path))?;
    Ok(bytes.len() as u64)
}

/// Checks that a full snapshot may be written into `dir`: not over an
/// existing one (its `state.bin` or `memory.bin`) unless `replace`. Called
/// before the VM is paused, and again by [`save_full`].
pub fn check_target(dir: &Path, replace: bool) -> Result<(), SnapshotError> {
    if replace {
        return Ok(());
    }
    let found: Vec<&str> = [STATE_FILE, MEMORY_FILE]
        .into_iter()
        .filter(|f| dir.join(f).symlink_metadata().is_ok())
        .collect();
    if found.is_empty() {
        return Ok(());
    }
    Err(SnapshotError::Exists {
        dir: dir.to_path_buf(),
        files: found.join(", "),
    })
}

/// Reads and checks `dir/state.bin`.
pub fn read_state(dir: &Path) -> Result<VmState, SnapshotError> {
    let path = dir.join(STATE_FILE);
    let len = std::fs::metadata(&path).map_err(io_err(&path))?.len();
    if len > MAX_STATE_FILE {
        return Err(SnapshotError::TooLarge(path));
    }
    let bytes = std::fs::read(&path).map_err(io_err(&path))?;
    format::decode(&bytes).map_err(|source| SnapshotError::Format { path, source })
}

/// What a snapshot wrote.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct SnapshotStats {
    /// Bytes of the state file.
    pub state_bytes: u64,
    /// Memory image figures (zero for a warm snapshot).
    pub memory: ImageStats,
}

/// A full snapshot: memory image and its index, then state. An existing
/// snapshot in `dir` is refused unless `replace`. `progress` hears how far
/// through guest memory the image is (bytes done, bytes in all).
pub fn save_full(
    dir: &Path,
    state: &VmState,
    memory: &GuestMemoryFile,
    replace: bool,
    progress: &dyn Fn(u64, u64),
) -> Result<SnapshotStats, SnapshotError> {
    check_target(dir, replace)?;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    // A stale state file must not pair with the new image if we fail midway.
    let _ = std::fs::remove_file(dir.join(STATE_FILE));
    let memory = memory_image::save_reporting(
        memory,
        &dir.join(MEMORY_FILE),
        &dir.join(EXTENTS_FILE),
        progress,
    )?;
    let state_bytes = write_state(dir, state)?;
    Ok(SnapshotStats {
        state_bytes,
        memory,
    })
}

/// A warm snapshot: only the state; memory stays in its named file.
pub fn save_warm(
    dir: &Path,
    state: &VmState,
    memory: &GuestMemoryFile,
) -> Result<SnapshotStats, SnapshotError> {
    if !matches!(memory.backing(), MemoryBacking::File { .. }) {
        return Err(SnapshotError::NotNamedMemory(format!(
            "{:?}",
            memory.backing()
        )));
    }
    let _ = std::fs::remove_file(dir.join(MEMORY_FILE));
    let _ = std::fs::remove_file(dir.join(EXTENTS_FILE));
    // No fsync (it cost 1-7 ms of the guest's pause on a disk here): the
    // state is only of use with guest memory, which is not synced either (it
    // lives in tmpfs, hugetlbfs or the page cache), so a host crash loses
    // the pair regardless. The rename keeps it atomic for the next process.
    let state_bytes = write_state_file(dir, state, false)?;
    Ok(SnapshotStats {
        state_bytes,
        memory: ImageStats::default(),
    })
}

/// Guest memory for restoring `state` from `dir`: the image copied into fresh
/// memory with `backing` if there is one (every extent checked against
/// `memory.extents`), otherwise the named file the VM had (warm restart:
/// mapped again, not copied).
pub fn load_memory(
    dir: &Path,
    state: &VmState,
    backing: &MemoryBacking,
) -> Result<GuestMemoryFile, SnapshotError> {
    let image = dir.join(MEMORY_FILE);
    if image.exists() {
        return Ok(memory_image::load(
            &image,
            &dir.join(EXTENTS_FILE),
            state.memory.size,
            backing,
        )?);
    }
    match &state.memory.backing {
        MemoryBacking::File { path } => {
            if !path.exists() {
                return Err(SnapshotError::Io {
                    path: path.clone(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "the VM's memory file is gone",
                    ),
                });
            }
            Ok(GuestMemoryFile::create(
                state.memory.size,
                &state.memory.backing,
            )?)
        }
        _ => Err(SnapshotError::NoMemory(dir.to_path_buf())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_existing_snapshot_is_replaced_only_when_asked() {
        let dir = std::env::temp_dir().join(format!("kemari-snap-force-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        check_target(&dir, false).unwrap();
        std::fs::create_dir_all(&dir).unwrap();
        check_target(&dir, false).unwrap();
        std::fs::write(dir.join(MEMORY_FILE), b"").unwrap();
        let e = check_target(&dir, false).unwrap_err().to_string();
        assert!(e.contains("memory.bin") && e.contains("--force"), "{e}");
        std::fs::write(dir.join(STATE_FILE), b"").unwrap();
        let e = check_target(&dir, false).unwrap_err().to_string();
        assert!(e.contains("state.bin, memory.bin"), "{e}");
        check_target(&dir, true).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn state_files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("kemari-snap-mode-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A leftover temporary file with a looser mode does not loosen it.
        std::fs::write(dir.join("state.bin.tmp"), b"").unwrap();
        std::fs::set_permissions(
            dir.join("state.bin.tmp"),
            std::fs::Permissions::from_mode(0o666),
        )
        .unwrap();
        write_state(&dir, &crate::persist::format::tests::sample_state()).unwrap();
        let mode = std::fs::metadata(dir.join(STATE_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
