//! What an export is served from: the [`Backend`] trait, and [`FileBackend`]
//! (a plain image file, with per-group access counters) for the target.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use nbd_client::protocol::AccessCounts;

/// Size of the groups whose reads and writes the target counts for proxies.
pub const ACCESS_GROUP_SIZE: u64 = 16 << 20;

/// An export's storage. Offsets and lengths are already checked against
/// [`Backend::size`] by the server.
pub trait Backend: Send + Sync + 'static {
    fn size(&self) -> u64;
    fn read_only(&self) -> bool;
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> io::Result<()>;
    fn flush(&self) -> io::Result<()>;
    fn trim(&self, offset: u64, len: u64) -> io::Result<()>;
    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool, fua: bool) -> io::Result<()>;
    /// Per-group access counters, if this backend keeps them.
    fn access_counts(&self) -> Option<AccessCounts> {
        None
    }
    /// True when serving this request may wait on the network (a proxy's
    /// uncached blocks): the server then runs it on a helper thread so that
    /// later pipelined requests are not held up behind it.
    fn may_block(&self, _command: u16, _offset: u64, _len: u32) -> bool {
        false
    }
    /// A write of `len` bytes at `offset` whose data `fill` puts straight
    /// into the file that holds the export's bytes at the same offsets (the
    /// server splices the payload from the socket). Returns `None`, without
    /// calling `fill`, when the backend has no such file; otherwise the
    /// write's outcome (FUA honoured as by [`Backend::write_at`]).
    fn write_via_file(
        &self,
        _offset: u64,
        _len: u64,
        _fua: bool,
        _fill: &mut dyn FnMut(&File) -> io::Result<()>,
    ) -> Option<io::Result<()>> {
        None
    }
}

/// Read and write counters per [`ACCESS_GROUP_SIZE`] group.
pub struct AccessCounters {
    reads: Vec<AtomicU64>,
    writes: Vec<AtomicU64>,
}

impl AccessCounters {
    pub fn new(size: u64) -> Self {
        let n = size.div_ceil(ACCESS_GROUP_SIZE) as usize;
        AccessCounters {
            reads: (0..n).map(|_| AtomicU64::new(0)).collect(),
            writes: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub fn record(&self, offset: u64, len: u64, write: bool) {
        if len == 0 {
            return;
        }
        let v = if write { &self.writes } else { &self.reads };
        let first = (offset / ACCESS_GROUP_SIZE) as usize;
        let last = ((offset + len - 1) / ACCESS_GROUP_SIZE) as usize;
        for c in v.iter().take(last + 1).skip(first) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn snapshot(&self) -> AccessCounts {
        AccessCounts {
            group_size: ACCESS_GROUP_SIZE,
            groups: self
                .reads
                .iter()
                .zip(&self.writes)
                .map(|(r, w)| (r.load(Ordering::Relaxed), w.load(Ordering::Relaxed)))
                .collect(),
        }
    }
}

/// An image file served as is.
pub struct FileBackend {
    file: File,
    size: u64,
    read_only: bool,
    counters: AccessCounters,
}

impl FileBackend {
    pub fn open(path: &Path, read_only: bool) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(!read_only).open(path)?;
        let size = file.metadata()?.len();
        Ok(FileBackend {
            file,
            size,
            read_only,
            counters: AccessCounters::new(size),
        })
    }
}

/// Punches a hole or zeroes a range with fallocate(2); returns `Ok(false)`
/// when the file system does not support the mode.
pub fn fallocate_range(file: &File, mode: libc::c_int, offset: u64, len: u64) -> io::Result<bool> {
    // SAFETY: fallocate only reads its integer arguments; the fd is owned by `file`.
    let r = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            mode,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => Ok(false),
        _ => Err(e),
    }
}

/// Writes zeroes through the page cache in 1 MiB pieces (fallback).
pub fn write_zeroes_slow(file: &File, mut offset: u64, mut len: u64) -> io::Result<()> {
    let zeros = vec![0u8; (1 << 20).min(len as usize)];
    while len > 0 {
        let n = (zeros.len() as u64).min(len) as usize;
        file.write_all_at(&zeros[..n], offset)?;
        offset += n as u64;
        len -= n as u64;
    }
    Ok(())
}

/// Zeroes `[offset, offset+len)` of `file`, deallocating if allowed.
pub fn zero_range(file: &File, offset: u64, len: u64, may_trim: bool) -> io::Result<()> {
    let keep = libc::FALLOC_FL_KEEP_SIZE;
    if may_trim && fallocate_range(file, libc::FALLOC_FL_PUNCH_HOLE | keep, offset, len)? {
        return Ok(());
    }
    if fallocate_range(file, libc::FALLOC_FL_ZERO_RANGE | keep, offset, len)? {
        return Ok(());
    }
    write_zeroes_slow(file, offset, len)
}

impl Backend for FileBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.counters.record(offset, buf.len() as u64, false);
        self.file.read_exact_at(buf, offset)
    }
    fn write_at(&self, data: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.counters.record(offset, data.len() as u64, true);
        self.file.write_all_at(data, offset)?;
        if fua {
            self.file.sync_data()?;
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.counters.record(offset, len, true);
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        fallocate_range(&self.file, mode, offset, len).map(|_| ())
    }
    fn write_zeroes(&self, offset: u64, len: u64, may_trim: bool, fua: bool) -> io::Result<()> {
        self.counters.record(offset, len, true);
        zero_range(&self.file, offset, len, may_trim)?;
        if fua {
            self.file.sync_data()?;
        }
        Ok(())
    }
    fn access_counts(&self) -> Option<AccessCounts> {
        Some(self.counters.snapshot())
    }
    fn write_via_file(
        &self,
        offset: u64,
        len: u64,
        fua: bool,
        fill: &mut dyn FnMut(&File) -> io::Result<()>,
    ) -> Option<io::Result<()>> {
        if self.read_only {
            return None;
        }
        self.counters.record(offset, len, true);
        Some(fill(&self.file).and_then(|()| {
            if fua {
                self.file.sync_data()?;
            }
            Ok(())
        }))
    }
}

/// An in-memory backend for tests and fuzzing.
pub struct MemBackend {
    data: std::sync::RwLock<Vec<u8>>,
    read_only: bool,
}

impl MemBackend {
    pub fn new(size: usize, read_only: bool) -> Self {
        MemBackend {
            data: std::sync::RwLock::new(vec![0; size]),
            read_only,
        }
    }
}

impl Backend for MemBackend {
    fn size(&self) -> u64 {
        self.data.read().map(|d| d.len() as u64).unwrap_or(0)
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let d = self.data.read().map_err(|_| io::Error::other("poisoned"))?;
        let o = offset as usize;
        buf.copy_from_slice(&d[o..o + buf.len()]);
        Ok(())
    }
    fn write_at(&self, data: &[u8], offset: u64, _fua: bool) -> io::Result<()> {
        let mut d = self
            .data
            .write()
            .map_err(|_| io::Error::other("poisoned"))?;
        let o = offset as usize;
        d[o..o + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn trim(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64, _may_trim: bool, _fua: bool) -> io::Result<()> {
        let mut d = self
            .data
            .write()
            .map_err(|_| io::Error::other("poisoned"))?;
        d[offset as usize..(offset + len) as usize].fill(0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_span_groups() {
        let c = AccessCounters::new(3 * ACCESS_GROUP_SIZE);
        c.record(ACCESS_GROUP_SIZE - 1, 2, false);
        c.record(2 * ACCESS_GROUP_SIZE, 4096, true);
        let s = c.snapshot();
        assert_eq!(s.groups, vec![(1, 0), (1, 0), (0, 1)]);
    }
}
