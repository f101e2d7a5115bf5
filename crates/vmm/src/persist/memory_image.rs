//! Guest memory images for snapshots: a sparse file the size of guest memory in
//! which only non-zero pages are written. Saving walks the data extents of the
//! memory file (SEEK_DATA/SEEK_HOLE, so never-touched memory costs nothing) and
//! skips zero pages inside them; loading copies the image's data extents into a
//! fresh memory file.

use std::fs::{File, OpenOptions};
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::memory::{GuestMemoryFile, MemoryBacking, MemoryError};
use crate::sys;

const PAGE: usize = 4096;
const CHUNK: usize = 1 << 20;

/// Errors writing or reading a memory image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// I/O on the image or the memory file.
    #[error("memory image {path}: {source}")]
    Io {
        /// The image.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The image does not match the VM.
    #[error("memory image {path} is {actual} bytes, the VM has {expected}")]
    Size {
        /// The image.
        path: String,
        /// Image size.
        actual: u64,
        /// Guest memory size.
        expected: u64,
    },
    /// The new memory file could not be created.
    #[error(transparent)]
    Memory(#[from] MemoryError),
}

/// What a save wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ImageStats {
    /// Bytes of page data written.
    pub bytes_written: u64,
    /// Bytes of the source scanned (its data extents).
    pub bytes_scanned: u64,
}

/// The data extents `[start, end)` of `file` up to `size` (the whole range if
/// the file system does not report holes).
fn data_extents(file: &File, size: u64) -> Vec<(u64, u64)> {
    let fd = file.as_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < size {
        let data = match sys::seek_data(fd, pos) {
            Ok(data) => data,
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => break, // no more data
            Err(_) => return vec![(0, size)], // no hole support: copy everything
        };
        let end = sys::seek_hole(fd, data).unwrap_or(size as i64);
        out.push((data as u64, (end as u64).min(size)));
        pos = end;
    }
    out
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Copies the non-zero pages of `src` (the first `size` bytes) into `dst` at the
/// same offsets.
fn copy_sparse(
    src: &File,
    dst: &File,
    size: u64,
    err: &dyn Fn(std::io::Error) -> ImageError,
) -> Result<ImageStats, ImageError> {
    let mut stats = ImageStats::default();
    let mut buf = vec![0u8; CHUNK];
    for (start, end) in data_extents(src, size) {
        let mut off = start;
        while off < end {
            let n = ((end - off) as usize).min(CHUNK);
            src.read_exact_at(&mut buf[..n], off).map_err(err)?;
            stats.bytes_scanned += n as u64;
            // Write runs of non-zero pages.
            let mut p = 0;
            while p < n {
                let page_end = (p + PAGE).min(n);
                if buf[p..page_end].iter().all(|&b| b == 0) {
                    p = page_end;
                    continue;
                }
                let mut q = page_end;
                while q < n {
                    let qe = (q + PAGE).min(n);
                    if buf[q..qe].iter().all(|&b| b == 0) {
                        break;
                    }
                    q = qe;
                }
                dst.write_all_at(&buf[p..q], off + p as u64).map_err(err)?;
                stats.bytes_written += (q - p) as u64;
                p = q;
            }
            off += n as u64;
        }
    }
    Ok(stats)
}

/// Writes guest memory to a sparse image at `path` (replaced if present) and
/// syncs it.
pub fn save(mem: &GuestMemoryFile, path: &Path) -> Result<ImageStats, ImageError> {
    let err = io_err(path);
    let out = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(&err)?;
    out.set_len(mem.size()).map_err(&err)?;
    let stats = copy_sparse(mem.file(), &out, mem.size(), &err)?;
    out.sync_all().map_err(&err)?;
    Ok(stats)
}

/// Creates guest memory of `size` bytes with `backing` and fills it from the
/// image at `path`.
pub fn load(
    path: &Path,
    size: u64,
    backing: &MemoryBacking,
) -> Result<GuestMemoryFile, ImageError> {
    let err = io_err(path);
    let image = File::open(path).map_err(&err)?;
    let actual = image.metadata().map_err(&err)?.len();
    if actual != size {
        return Err(ImageError::Size {
            path: path.display().to_string(),
            actual,
            expected: size,
        });
    }
    let mem = GuestMemoryFile::create(size, backing)?;
    copy_sparse(&image, mem.file(), size, &err)?;
    Ok(mem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_round_trip() {
        let dir = std::env::temp_dir().join(format!("kemari-img-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = dir.join("memory.bin");
        let mem = GuestMemoryFile::create(64 << 20, &MemoryBacking::Memfd).unwrap();
        mem.file().write_all_at(b"hello", 0x1234).unwrap();
        mem.file().write_all_at(&[7u8; 3 * PAGE], 40 << 20).unwrap();
        mem.file().write_all_at(&[0u8; PAGE], 50 << 20).unwrap(); // zero page: skipped
        let stats = save(&mem, &img).unwrap();
        assert_eq!(stats.bytes_written, 4 * PAGE as u64);
        let on_disk = std::fs::metadata(&img).unwrap();
        assert_eq!(on_disk.len(), 64 << 20);
        let back = load(&img, 64 << 20, &MemoryBacking::Memfd).unwrap();
        let mut b = [0u8; 5];
        back.file().read_exact_at(&mut b, 0x1234).unwrap();
        assert_eq!(&b, b"hello");
        let mut p = vec![0u8; 3 * PAGE];
        back.file().read_exact_at(&mut p, 40 << 20).unwrap();
        assert!(p.iter().all(|&x| x == 7));
        assert!(matches!(
            load(&img, 128 << 20, &MemoryBacking::Memfd),
            Err(ImageError::Size { .. })
        ));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
