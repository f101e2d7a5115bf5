//! Guest memory images for snapshots: a sparse file the size of guest memory in
//! which only non-zero pages are written, and its index (`image_index.rs`):
//! each data extent written, with its CRC-32. Saving walks the data extents
//! of the memory file (SEEK_DATA/SEEK_HOLE, so never-touched memory costs
//! nothing) and skips zero pages inside them; loading copies the indexed
//! extents into a fresh memory file, checking each one's CRC-32 on the way
//! (~20 GB/s here: a few percent of the copy), and refuses the image at the
//! first extent that does not match. Both files are created 0600.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::image_index::{self, Extent, IndexError, MAX_EXTENT};
use crate::memory::{GuestMemoryFile, MemoryBacking, MemoryError};
use crate::sys;

const PAGE: usize = 4096;
const CHUNK: usize = MAX_EXTENT as usize;

/// Errors writing or reading a memory image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// I/O on the image, its index or the memory file.
    #[error("memory image {path}: {source}")]
    Io {
        /// The file.
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
    /// The index is missing or cannot be used: the image cannot be checked.
    #[error("memory image index {path} {reason}: the image cannot be checked, so nothing was restored and the snapshot's files are left as they are; restore an intact copy of the snapshot, or take a new one")]
    Index {
        /// The index.
        path: String,
        /// What is wrong with it.
        reason: IndexError,
    },
    /// An extent does not match its checksum.
    #[error("memory image {path} is damaged: the extent at offset {offset:#x} ({len} bytes) does not match its checksum in {index}; nothing was restored and the image is left as it is: restore an intact copy of the snapshot, or take a new snapshot of the VM")]
    Corrupt {
        /// The image.
        path: String,
        /// Its index.
        index: String,
        /// The extent's offset in the image.
        offset: u64,
        /// The extent's length.
        len: u32,
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
    /// Data extents written (each checksummed in the index).
    pub extents: u64,
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn is_zero(page: &[u8]) -> bool {
    page.iter().all(|&b| b == 0)
}

/// Copies the non-zero pages of `src` (the first `size` bytes) into `dst` at
/// the same offsets, in runs of at most [`CHUNK`] bytes: the image's extents.
fn write_extents(
    src: &File,
    dst: &File,
    size: u64,
    err: &dyn Fn(std::io::Error) -> ImageError,
    progress: &dyn Fn(u64, u64),
) -> Result<(ImageStats, Vec<Extent>), ImageError> {
    let mut stats = ImageStats::default();
    let mut extents = Vec::new();
    let mut buf = vec![0u8; CHUNK];
    for (start, end) in sys::data_extents(src, size) {
        let mut off = start;
        while off < end {
            let n = ((end - off) as usize).min(CHUNK);
            src.read_exact_at(&mut buf[..n], off).map_err(err)?;
            stats.bytes_scanned += n as u64;
            // Write runs of non-zero pages.
            let mut p = 0;
            while p < n {
                let page_end = (p + PAGE).min(n);
                if is_zero(&buf[p..page_end]) {
                    p = page_end;
                    continue;
                }
                let mut q = page_end;
                while q < n {
                    let qe = (q + PAGE).min(n);
                    if is_zero(&buf[q..qe]) {
                        break;
                    }
                    q = qe;
                }
                let at = off + p as u64;
                dst.write_all_at(&buf[p..q], at).map_err(err)?;
                extents.push(Extent::of(at, &buf[p..q]));
                stats.bytes_written += (q - p) as u64;
                p = q;
            }
            off += n as u64;
            progress(off, size);
        }
    }
    progress(size, size);
    stats.extents = extents.len() as u64;
    Ok((stats, extents))
}

/// Writes guest memory to a sparse image at `image` (replaced if present)
/// and its index at `index`, both 0600 and synced.
pub fn save(mem: &GuestMemoryFile, image: &Path, index: &Path) -> Result<ImageStats, ImageError> {
    save_reporting(mem, image, index, &|_, _| {})
}

/// [`save`], telling `progress` how far through guest memory it is (bytes
/// done, bytes in all) after each chunk it read.
pub fn save_reporting(
    mem: &GuestMemoryFile,
    image: &Path,
    index: &Path,
    progress: &dyn Fn(u64, u64),
) -> Result<ImageStats, ImageError> {
    let err = io_err(image);
    let out = super::create_private(image).map_err(&err)?;
    out.set_len(mem.size()).map_err(&err)?;
    let (stats, extents) = write_extents(mem.file(), &out, mem.size(), &err, progress)?;
    out.sync_all().map_err(&err)?;
    super::write_private(index, &image_index::encode(mem.size(), &extents), true)
        .map_err(io_err(index))?;
    Ok(stats)
}

/// Reads and checks the index at `path` of memory of `size` bytes.
fn read_index(path: &Path, size: u64) -> Result<Vec<Extent>, ImageError> {
    let refused = |reason| ImageError::Index {
        path: path.display().to_string(),
        reason,
    };
    let file = File::open(path).map_err(|e| ImageError::Io {
        path: path.display().to_string(),
        source: super::explain_missing(
            e,
            "the image cannot be checked without it (restore the snapshot directory whole, or take a new snapshot)",
        ),
    })?;
    let len = file.metadata().map_err(io_err(path))?.len();
    if len > image_index::max_len(size) {
        return Err(refused(IndexError::TooLong(len)));
    }
    let mut bytes = vec![0u8; len as usize];
    file.read_exact_at(&mut bytes, 0).map_err(io_err(path))?;
    image_index::decode(&bytes, size).map_err(refused)
}

/// Creates guest memory of `size` bytes with `backing` and fills it from the
/// image at `image`, checking every extent against the index at `index`.
/// A damaged image is refused at its first bad extent; neither file is
/// changed.
pub fn load(
    image: &Path,
    index: &Path,
    size: u64,
    backing: &MemoryBacking,
) -> Result<GuestMemoryFile, ImageError> {
    let extents = read_index(index, size)?;
    let err = io_err(image);
    let file = File::open(image).map_err(&err)?;
    let actual = file.metadata().map_err(&err)?.len();
    if actual != size {
        return Err(ImageError::Size {
            path: image.display().to_string(),
            actual,
            expected: size,
        });
    }
    if let MemoryBacking::File { path } = backing {
        clear_named(path)?;
    }
    let mem = GuestMemoryFile::create(size, backing)?;
    let mut buf = vec![0u8; CHUNK];
    for e in extents {
        let data = &mut buf[..e.len as usize];
        file.read_exact_at(data, e.offset).map_err(&err)?;
        if crc32fast::hash(data) != e.crc {
            tracing::error!(image = %image.display(), offset = e.offset, len = e.len, "memory image extent does not match its checksum");
            return Err(ImageError::Corrupt {
                path: image.display().to_string(),
                index: index.display().to_string(),
                offset: e.offset,
                len: e.len,
            });
        }
        mem.file().write_all_at(data, e.offset).map_err(&err)?;
    }
    Ok(mem)
}

/// Empties a named memory file that already exists: the image writes only
/// non-zero pages, so whatever an earlier VM left there would show through
/// every zero page of the restored guest.
fn clear_named(path: &Path) -> Result<(), ImageError> {
    match std::fs::OpenOptions::new().write(true).open(path) {
        Ok(f) => {
            tracing::debug!(path = %path.display(), "emptying the memory file before the restore");
            f.set_len(0).map_err(io_err(path))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(path)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory for `tag`, and the image and index paths in it.
    fn files(tag: &str) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("kemari-img-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (img, idx) = (dir.join("memory.bin"), dir.join("memory.extents"));
        (dir, img, idx)
    }

    #[test]
    fn sparse_round_trip() {
        let (dir, img, idx) = files("sparse");
        let mem = GuestMemoryFile::create(64 << 20, &MemoryBacking::Memfd).unwrap();
        mem.file().write_all_at(b"hello", 0x1234).unwrap();
        mem.file().write_all_at(&[7u8; 3 * PAGE], 40 << 20).unwrap();
        mem.file().write_all_at(&[0u8; PAGE], 50 << 20).unwrap(); // zero page: skipped
        let stats = save(&mem, &img, &idx).unwrap();
        assert_eq!(stats.bytes_written, 4 * PAGE as u64);
        assert_eq!(stats.extents, 2);
        let on_disk = std::fs::metadata(&img).unwrap();
        assert_eq!(on_disk.len(), 64 << 20);
        let back = load(&img, &idx, 64 << 20, &MemoryBacking::Memfd).unwrap();
        let mut b = [0u8; 5];
        back.file().read_exact_at(&mut b, 0x1234).unwrap();
        assert_eq!(&b, b"hello");
        let mut p = vec![0u8; 3 * PAGE];
        back.file().read_exact_at(&mut p, 40 << 20).unwrap();
        assert!(p.iter().all(|&x| x == 7));
        assert!(matches!(
            load(&img, &idx, 128 << 20, &MemoryBacking::Memfd),
            Err(ImageError::Index {
                reason: IndexError::Size { .. },
                ..
            })
        ));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_restore_into_an_existing_memory_file_leaves_nothing_of_its_old_content() {
        let (dir, img, idx) = files("named");
        let mem = GuestMemoryFile::create(32 << 20, &MemoryBacking::Memfd).unwrap();
        mem.file().write_all_at(&[7u8; PAGE], 4 << 20).unwrap();
        save(&mem, &img, &idx).unwrap();
        // The file an earlier VM ran in, filled with its data.
        let target = dir.join("guest-memory");
        std::fs::write(&target, vec![0xaau8; 32 << 20]).unwrap();
        let backing = MemoryBacking::File {
            path: target.clone(),
        };
        let back = load(&img, &idx, 32 << 20, &backing).unwrap();
        let mut p = vec![0u8; PAGE];
        back.file().read_exact_at(&mut p, 4 << 20).unwrap();
        assert!(p.iter().all(|&x| x == 7));
        for offset in [0u64, (4 << 20) + PAGE as u64, (32 << 20) - PAGE as u64] {
            back.file().read_exact_at(&mut p, offset).unwrap();
            assert!(p.iter().all(|&x| x == 0), "old data at {offset:#x}");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn files_are_private_whatever_the_umask() {
        use std::os::unix::fs::PermissionsExt;
        let (dir, img, idx) = files("mode");
        // An earlier file with a looser mode is tightened too.
        std::fs::write(&img, b"old").unwrap();
        std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mem = GuestMemoryFile::create(32 << 20, &MemoryBacking::Memfd).unwrap();
        mem.file().write_all_at(b"x", 0).unwrap();
        save(&mem, &img, &idx).unwrap();
        for f in [&img, &idx] {
            let mode = std::fs::metadata(f).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", f.display());
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_flipped_byte_is_refused_naming_its_extent_and_nothing_is_changed() {
        let (dir, img, idx) = files("bad");
        let mem = GuestMemoryFile::create(64 << 20, &MemoryBacking::Memfd).unwrap();
        mem.file()
            .write_all_at(&[7u8; 2 * PAGE], 0x10_0000)
            .unwrap();
        mem.file()
            .write_all_at(&[9u8; 3 * PAGE], 0x30_0000)
            .unwrap();
        save(&mem, &img, &idx).unwrap();
        // Same size, one byte flipped inside the second extent.
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(&[9 ^ 0xff], 0x30_0000 + 5000).unwrap();
        let damaged = std::fs::read(&img).unwrap();
        let index = std::fs::read(&idx).unwrap();
        let e = load(&img, &idx, 64 << 20, &MemoryBacking::Memfd).unwrap_err();
        assert!(
            matches!(e, ImageError::Corrupt { offset: 0x30_0000, len, .. } if len == 3 * PAGE as u32),
            "{e:?}"
        );
        let text = e.to_string();
        for needle in [
            "memory.bin",
            "offset 0x300000",
            "memory.extents",
            "take a new snapshot",
        ] {
            assert!(text.contains(needle), "{needle:?} in {text}");
        }
        assert_eq!(
            std::fs::read(&img).unwrap(),
            damaged,
            "the image is left as it is"
        );
        assert_eq!(std::fs::read(&idx).unwrap(), index);
        // Without its index the image is not restored either.
        std::fs::remove_file(&idx).unwrap();
        let e = load(&img, &idx, 64 << 20, &MemoryBacking::Memfd).unwrap_err();
        assert!(e.to_string().contains("memory.extents"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
