//! Disk backends behind virtio-blk: the [`BlockBackend`] trait, a raw image file
//! ([`RawFileBackend`]) and an in-memory disk ([`MemoryBackend`], for tests and
//! fuzzing).
//!
//! Offsets and lengths are in bytes. The virtio-blk device checks every request
//! against [`BlockBackend::size`] before it reaches a backend, so backends see
//! only in-range requests; they still check, because other callers may not.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use nbd_client::page_buf::PageBuf;

use crate::memory::GuestSlice;
use crate::sys;

/// Sector size of the virtio-blk protocol; image sizes must be a multiple of it.
pub const SECTOR_SIZE: u64 = 512;

/// Errors while opening a disk backend.
#[derive(Debug, thiserror::Error)]
pub enum BlockBackendError {
    /// The image file cannot be opened.
    #[error("cannot open disk image {path} ({mode})")]
    Open {
        /// The image.
        path: PathBuf,
        /// "read-only" or "read-write".
        mode: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The image's size cannot be read.
    #[error("cannot read the size of disk image {path}")]
    Metadata {
        /// The image.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The image is not a whole number of sectors.
    #[error("disk image {path} is {size} bytes, not a multiple of 512")]
    Unaligned {
        /// The image.
        path: PathBuf,
        /// Its size.
        size: u64,
    },
    /// The NBD export cannot be reached or opened.
    #[error("cannot open NBD disk {url}")]
    Nbd {
        /// The URL.
        url: String,
        /// The cause.
        #[source]
        source: nbd_client::client::ClientError,
    },
    /// The disk's warm cache cannot be made (its memfd).
    #[error("cannot make the disk's cache")]
    Cache {
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The image is not a regular file or block device.
    #[error("disk image {path} is not a regular file")]
    NotAFile {
        /// The image.
        path: PathBuf,
    },
}

/// A disk as seen by virtio-blk.
pub trait BlockBackend: Send {
    /// Disk size in bytes (a multiple of [`SECTOR_SIZE`]).
    fn size(&self) -> u64;
    /// Whether writes are refused.
    fn read_only(&self) -> bool;
    /// Reads `buf.len()` bytes at `off`.
    fn read_at(&mut self, off: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Reads `dst.len()` bytes at `off` into guest memory. By default
    /// through [`read_at`](Self::read_at) into `bounce` (the caller's,
    /// reused from request to request) and a copy; a backend that can fill
    /// guest memory itself (a file by `pread`, the warm cache from its
    /// store) saves that copy.
    fn read_to_guest(
        &mut self,
        off: u64,
        dst: &GuestSlice<'_>,
        bounce: &mut PageBuf,
    ) -> io::Result<()> {
        let len = dst.len();
        if bounce.len() < len {
            bounce.set_len(len);
        }
        self.read_at(off, &mut bounce[..len])?;
        dst.copy_from(&bounce[..len]);
        Ok(())
    }
    /// Writes `buf` at `off`.
    fn write_at(&mut self, off: u64, buf: &[u8]) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&mut self) -> io::Result<()>;
    /// Whether [`discard`](Self::discard) does anything (offered to the guest as
    /// VIRTIO_BLK_F_DISCARD).
    fn supports_discard(&self) -> bool {
        false
    }
    /// Tells the backend that `len` bytes at `off` are no longer needed.
    fn discard(&mut self, _off: u64, _len: u64) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }
    /// Whether [`write_zeroes`](Self::write_zeroes) is offered to the guest
    /// (VIRTIO_BLK_F_WRITE_ZEROES).
    fn supports_write_zeroes(&self) -> bool {
        false
    }
    /// Makes `len` bytes at `off` read as zeroes; `unmap` allows freeing them.
    fn write_zeroes(&mut self, _off: u64, _len: u64, _unmap: bool) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::Unsupported))
    }
    /// Identity of the backend for saved state ("file:/path", "nbd://...").
    fn id(&self) -> String;
    /// What the backend's warm cache did, if it has one
    /// ([`crate::devices::cached_backend`]).
    fn cache_counters(&self) -> Option<crate::devices::disk_cache::CacheCounters> {
        None
    }
    /// Times the backend's connection was lost and made again (an NBD
    /// disk's: [`NbdBackend`]).
    fn reconnects(&self) -> u64 {
        0
    }
}

fn check_range(size: u64, off: u64, len: u64) -> io::Result<()> {
    match off.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("range {off}+{len} is outside the {size}-byte disk"),
        )),
    }
}

fn read_only_error() -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, "disk is read-only")
}

/// A raw disk image in a regular file (or a block device).
#[derive(Debug)]
pub struct RawFileBackend {
    file: File,
    path: PathBuf,
    size: u64,
    read_only: bool,
}

impl RawFileBackend {
    /// Opens `path`; `read_only` opens it O_RDONLY and refuses writes.
    pub fn open(path: &Path, read_only: bool) -> Result<Self, BlockBackendError> {
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|source| BlockBackendError::Open {
                path: path.to_owned(),
                mode: if read_only { "read-only" } else { "read-write" },
                source,
            })?;
        let meta = file
            .metadata()
            .map_err(|source| BlockBackendError::Metadata {
                path: path.to_owned(),
                source,
            })?;
        let size = if meta.is_file() {
            meta.len()
        } else {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_block_device() {
                return Err(BlockBackendError::NotAFile {
                    path: path.to_owned(),
                });
            }
            let mut f = &file;
            io::Seek::seek(&mut f, io::SeekFrom::End(0)).map_err(|source| {
                BlockBackendError::Metadata {
                    path: path.to_owned(),
                    source,
                }
            })?
        };
        if !size.is_multiple_of(SECTOR_SIZE) {
            return Err(BlockBackendError::Unaligned {
                path: path.to_owned(),
                size,
            });
        }
        Ok(RawFileBackend {
            file,
            path: path.to_owned(),
            size,
            read_only,
        })
    }

    /// The image's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn fallocate(&self, mode: libc::c_int, off: u64, len: u64) -> io::Result<()> {
        let (Ok(off), Ok(len)) = (libc::off_t::try_from(off), libc::off_t::try_from(len)) else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        sys::fallocate(self.file.as_fd(), mode, off, len)
    }

    fn write_zero_bytes(&self, mut off: u64, len: u64) -> io::Result<()> {
        let zeroes = vec![0u8; len.min(1 << 20) as usize];
        let end = off + len;
        while off < end {
            let n = (end - off).min(zeroes.len() as u64) as usize;
            self.file.write_all_at(&zeroes[..n], off)?;
            off += n as u64;
        }
        Ok(())
    }
}

impl BlockBackend for RawFileBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&mut self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        check_range(self.size, off, buf.len() as u64)?;
        self.file.read_exact_at(buf, off)
    }

    fn read_to_guest(
        &mut self,
        off: u64,
        dst: &GuestSlice<'_>,
        _bounce: &mut PageBuf,
    ) -> io::Result<()> {
        check_range(self.size, off, dst.len() as u64)?;
        sys::pread_exact_volatile(self.file.as_fd(), dst, off)
    }

    fn write_at(&mut self, off: u64, buf: &[u8]) -> io::Result<()> {
        if self.read_only {
            return Err(read_only_error());
        }
        check_range(self.size, off, buf.len() as u64)?;
        self.file.write_all_at(buf, off)
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        self.file.sync_data()
    }

    fn supports_discard(&self) -> bool {
        !self.read_only
    }

    fn discard(&mut self, off: u64, len: u64) -> io::Result<()> {
        if self.read_only {
            return Err(read_only_error());
        }
        check_range(self.size, off, len)?;
        match self.fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off,
            len,
        ) {
            // Discard is a hint: a file system without hole punching keeps the data.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            other => other,
        }
    }

    fn supports_write_zeroes(&self) -> bool {
        !self.read_only
    }

    fn write_zeroes(&mut self, off: u64, len: u64, unmap: bool) -> io::Result<()> {
        if self.read_only {
            return Err(read_only_error());
        }
        check_range(self.size, off, len)?;
        let mode = if unmap {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        match self.fallocate(mode, off, len) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => self.write_zero_bytes(off, len),
            other => other,
        }
    }

    fn id(&self) -> String {
        format!("file:{}", self.path.display())
    }
}

/// A disk held in memory: for tests and fuzzing.
#[derive(Debug, Clone)]
pub struct MemoryBackend {
    data: Vec<u8>,
    read_only: bool,
}

impl MemoryBackend {
    /// A zeroed disk of `size` bytes (rounded down to whole sectors).
    pub fn new(size: u64, read_only: bool) -> Self {
        let size = size - size % SECTOR_SIZE;
        MemoryBackend {
            data: vec![0; size as usize],
            read_only,
        }
    }

    /// The disk's contents.
    pub fn data(&self) -> &[u8] {
        &self.data
    }
}

impl BlockBackend for MemoryBackend {
    fn size(&self) -> u64 {
        self.data.len() as u64
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&mut self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        check_range(self.size(), off, buf.len() as u64)?;
        let off = off as usize;
        buf.copy_from_slice(&self.data[off..off + buf.len()]);
        Ok(())
    }

    fn write_at(&mut self, off: u64, buf: &[u8]) -> io::Result<()> {
        if self.read_only {
            return Err(read_only_error());
        }
        check_range(self.size(), off, buf.len() as u64)?;
        let off = off as usize;
        self.data[off..off + buf.len()].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn supports_discard(&self) -> bool {
        !self.read_only
    }

    fn discard(&mut self, off: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(off, len, true)
    }

    fn supports_write_zeroes(&self) -> bool {
        !self.read_only
    }

    fn write_zeroes(&mut self, off: u64, len: u64, _unmap: bool) -> io::Result<()> {
        if self.read_only {
            return Err(read_only_error());
        }
        check_range(self.size(), off, len)?;
        self.data[off as usize..(off + len) as usize].fill(0);
        Ok(())
    }

    fn id(&self) -> String {
        format!("memory:{}", self.data.len())
    }
}

/// What stays behind a disk whose backend was released to the VM's next VMM
/// ([`crate::devices::virtio::VirtioDevice::release_backend`]): the same size
/// and identity, and every request fails.
#[derive(Debug, Clone)]
pub struct ReleasedBackend {
    size: u64,
    read_only: bool,
    id: String,
}

impl ReleasedBackend {
    /// Stands in for `backend`, which the caller then drops (closing it).
    pub fn of(backend: &dyn BlockBackend) -> Self {
        ReleasedBackend {
            size: backend.size(),
            read_only: backend.read_only(),
            id: backend.id(),
        }
    }
}

fn released_error() -> io::Error {
    io::Error::other("the disk was released to the next VMM")
}

impl BlockBackend for ReleasedBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn read_at(&mut self, _off: u64, _buf: &mut [u8]) -> io::Result<()> {
        Err(released_error())
    }

    fn write_at(&mut self, _off: u64, _buf: &[u8]) -> io::Result<()> {
        Err(released_error())
    }

    fn flush(&mut self) -> io::Result<()> {
        Err(released_error())
    }

    fn id(&self) -> String {
        self.id.clone()
    }
}

/// Whether a disk path names an NBD export (`nbd://HOST[:PORT]/EXPORT` or
/// `nbd+unix:///EXPORT?socket=PATH`).
pub fn is_nbd_url(path: &str) -> bool {
    path.starts_with("nbd://") || path.starts_with("nbd+unix://")
}

pub use super::nbd_backend::NbdBackend;

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_image(tag: &str, size: u64) -> PathBuf {
        let path =
            std::env::temp_dir().join(format!("kemari-backend-{tag}-{}.img", std::process::id()));
        let f = File::create(&path).unwrap();
        f.set_len(size).unwrap();
        path
    }

    #[test]
    fn a_released_disk_keeps_its_identity_and_serves_nothing() {
        let disk = MemoryBackend::new(8192, true);
        let mut r = ReleasedBackend::of(&disk);
        assert_eq!((r.size(), r.read_only(), r.id()), (8192, true, disk.id()));
        assert!(r.read_at(0, &mut [0u8; 512]).is_err());
        assert!(r.write_at(0, &[0u8; 512]).is_err());
        assert!(r.flush().is_err());
    }

    #[test]
    fn raw_file_round_trip_and_bounds() {
        let path = temp_image("rw", 1 << 20);
        let mut b = RawFileBackend::open(&path, false).unwrap();
        assert_eq!(b.size(), 1 << 20);
        assert!(b.id().contains(path.to_str().unwrap()));
        b.write_at(4096, b"hello").unwrap();
        let mut buf = [0u8; 5];
        b.read_at(4096, &mut buf).unwrap();
        assert_eq!(&buf, b"hello");
        b.flush().unwrap();
        assert!(b.read_at((1 << 20) - 2, &mut buf).is_err());
        assert!(b.write_at(u64::MAX - 1, b"xx").is_err());
        b.write_zeroes(4096, 512, false).unwrap();
        b.read_at(4096, &mut buf).unwrap();
        assert_eq!(buf, [0; 5]);
        b.write_at(8192, b"abc").unwrap();
        b.discard(8192, 4096).unwrap();
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn raw_file_read_only_and_errors_name_the_file() {
        let path = temp_image("ro", 4096);
        let mut b = RawFileBackend::open(&path, true).unwrap();
        assert!(b.read_only());
        assert!(!b.supports_discard());
        assert!(b.write_at(0, b"x").is_err());
        std::fs::remove_file(&path).unwrap();

        let odd = temp_image("odd", 1000);
        let err = RawFileBackend::open(&odd, false).unwrap_err();
        assert!(err.to_string().contains(odd.to_str().unwrap()), "{err}");
        std::fs::remove_file(&odd).unwrap();

        let missing = Path::new("/nonexistent/kemari/disk.img");
        let err = RawFileBackend::open(missing, true).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/kemari/disk.img"));
    }
}
