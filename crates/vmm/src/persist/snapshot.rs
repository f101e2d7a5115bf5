//! Snapshot directories.
//!
//! ```text
//! DIR/state.bin    the VM state (format.rs), written last: its presence marks
//!                  a complete snapshot
//! DIR/memory.bin   a sparse image of guest memory (full snapshots only)
//! ```
//!
//! A *full* snapshot (suspend-to-disk) copies guest memory into `memory.bin`. A
//! *warm* snapshot (Warm-VM Reboot) writes only `state.bin`: guest memory stays
//! in its named file (under /dev/shm or hugetlbfs) and the next process maps
//! that same file — nothing is copied, so the cost does not grow with memory.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::format::{self, FormatError};
use super::memory_image::{self, ImageError, ImageStats};
use super::VmState;
use crate::memory::{GuestMemoryFile, MemoryBacking, MemoryError};

/// State file name.
pub const STATE_FILE: &str = "state.bin";
/// Memory image name.
pub const MEMORY_FILE: &str = "memory.bin";
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
    let tmp = dir.join(format!("{STATE_FILE}.tmp"));
    let mut f = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(&bytes).map_err(io_err(&tmp))?;
    if durable {
        f.sync_all().map_err(io_err(&tmp))?;
    }
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    Ok(bytes.len() as u64)
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

/// A full snapshot: memory image, then state.
pub fn save_full(
    dir: &Path,
    state: &VmState,
    memory: &GuestMemoryFile,
) -> Result<SnapshotStats, SnapshotError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    // A stale state file must not pair with the new image if we fail midway.
    let _ = std::fs::remove_file(dir.join(STATE_FILE));
    let memory = memory_image::save(memory, &dir.join(MEMORY_FILE))?;
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
/// memory with `backing` if there is one, otherwise the named file the VM had
/// (warm restart: mapped again, not copied).
pub fn load_memory(
    dir: &Path,
    state: &VmState,
    backing: &MemoryBacking,
) -> Result<GuestMemoryFile, SnapshotError> {
    let image = dir.join(MEMORY_FILE);
    if image.exists() {
        return Ok(memory_image::load(&image, state.memory.size, backing)?);
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
