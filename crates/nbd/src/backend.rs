//! What an export is served from: the [`Backend`] trait, and [`FileBackend`]
//! (a plain image file, with per-group access counters) for the target;
//! [`file_extents`] tells the holes of a sparse file (SEEK_DATA/SEEK_HOLE)
//! for block status.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use nbd_client::protocol::AccessCounts;

/// Size of the groups whose reads and writes the target counts for proxies.
pub const ACCESS_GROUP_SIZE: u64 = 16 << 20;

/// A run of an export's bytes with one allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub len: u64,
    /// Not allocated; reads as zeroes.
    pub hole: bool,
}

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
    /// The allocation of `[offset, offset + len)` from `offset` on, in at
    /// most `max` extents (they may cover less than `len`, never more).
    /// Default: all data, which is always a correct answer.
    fn extents(&self, _offset: u64, len: u64, _max: usize) -> io::Result<Vec<Extent>> {
        Ok(vec![Extent { len, hole: false }])
    }
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
    /// Reads `buf.len()` bytes at `offset` if they can be had without
    /// waiting for a disk (all in the page cache): true when `buf` was
    /// filled; false when the read would block, failed, or the backend
    /// cannot tell (the caller then reads with [`Backend::read_at`], which
    /// reports errors). Lets the server answer cached reads on the
    /// connection's own thread instead of handing them to a helper.
    fn read_cached(&self, _buf: &mut [u8], _offset: u64) -> bool {
        false
    }
}

/// Fills `buf` from `file` at `offset` with `preadv2(RWF_NOWAIT)`: true
/// only if every byte came from the page cache. A short read (part of the
/// range not cached, or the end of the file), `EAGAIN`, or a kernel or file
/// system without `RWF_NOWAIT` all give false and leave the read to the
/// ordinary, blocking path.
pub fn read_cached_at(file: &File, buf: &mut [u8], offset: u64) -> bool {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        let iov = libc::iovec {
            iov_base: rest.as_mut_ptr().cast(),
            iov_len: rest.len(),
        };
        // SAFETY: one iovec over our own live, writable slice; the fd is
        // owned by `file`; preadv2 writes at most `iov_len` bytes.
        let n = unsafe {
            libc::preadv2(
                file.as_raw_fd(),
                &iov,
                1,
                (offset + done as u64) as libc::off_t,
                libc::RWF_NOWAIT,
            )
        };
        match n {
            n if n > 0 => done += n as usize,
            -1 if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
            // 0: end of file; -1: EAGAIN (not cached), EOPNOTSUPP, ...
            _ => return false,
        }
    }
    true
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

/// `lseek(fd, offset, whence)`; `None` for ENXIO (no data at or after
/// `offset` for SEEK_DATA).
fn seek(file: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    // SAFETY: lseek only reads its integer arguments; the fd is owned by
    // `file`. The file offset it moves is used by nothing: every read and
    // write of an image is positional.
    let r = unsafe { libc::lseek(file.as_raw_fd(), offset as libc::off_t, whence) };
    if r >= 0 {
        return Ok(Some(r as u64));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENXIO) => Ok(None),
        _ => Err(e),
    }
}

/// The data and holes of `file` in `[offset, offset + len)`, at most `max`
/// extents, found with SEEK_DATA / SEEK_HOLE. A file system without them
/// reports everything as data.
pub fn file_extents(file: &File, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent>> {
    let end = offset.saturating_add(len);
    let mut out: Vec<Extent> = Vec::new();
    let mut pos = offset;
    while pos < end && out.len() < max {
        let data = match seek(file, pos, libc::SEEK_DATA) {
            Ok(d) => d.unwrap_or(end).min(end),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP)) => {
                out.push(Extent {
                    len: end - pos,
                    hole: false,
                });
                break;
            }
            Err(e) => return Err(e),
        };
        let (next, hole) = if data > pos {
            (data, true)
        } else {
            // At data: it runs to the next hole (the end of file at worst).
            let h = seek(file, pos, libc::SEEK_HOLE)?.unwrap_or(end);
            (h.clamp(pos + 1, end), false)
        };
        push_extent(
            &mut out,
            Extent {
                len: next - pos,
                hole,
            },
        );
        pos = next;
    }
    Ok(out)
}

/// Appends `e` to `out`, merged into the last extent if it is of its kind.
pub fn push_extent(out: &mut Vec<Extent>, e: Extent) {
    match out.last_mut() {
        Some(last) if last.hole == e.hole => last.len += e.len,
        _ => out.push(e),
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
    fn extents(&self, offset: u64, len: u64, max: usize) -> io::Result<Vec<Extent>> {
        file_extents(&self.file, offset, len, max)
    }
    fn access_counts(&self) -> Option<AccessCounts> {
        Some(self.counters.snapshot())
    }
    fn read_cached(&self, buf: &mut [u8], offset: u64) -> bool {
        let ok = read_cached_at(&self.file, buf, offset);
        if ok {
            self.counters.record(offset, buf.len() as u64, false);
        }
        ok
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
    fn extents_of_a_sparse_file_and_their_limit() {
        let path = std::env::temp_dir().join(format!("knbd-extents-{}", std::process::id()));
        let f = File::create(&path).unwrap();
        f.set_len(256 << 10).unwrap();
        f.write_all_at(&[7u8; 4096], 64 << 10).unwrap();
        let _ = std::fs::remove_file(&path);
        let e = file_extents(&f, 0, 256 << 10, 16).unwrap();
        let hole = |len| Extent { len, hole: true };
        let data = |len| Extent { len, hole: false };
        assert_eq!(e, vec![hole(64 << 10), data(4096), hole(188 << 10)]);
        assert_eq!(
            file_extents(&f, 66 << 10, 100, 16).unwrap(),
            vec![data(100)]
        );
        assert_eq!(
            file_extents(&f, 0, 256 << 10, 1).unwrap(),
            vec![hole(64 << 10)]
        );
    }

    #[test]
    fn cached_reads_fill_the_buffer_or_report_false() {
        let path = std::env::temp_dir().join(format!("knbd-nowait-{}", std::process::id()));
        let data: Vec<u8> = (0..20_000u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let f = File::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        // Just written: cached.
        let mut buf = vec![0u8; 9000];
        assert!(read_cached_at(&f, &mut buf, 1001));
        assert!(buf[..] == data[1001..10_001]);
        // Past the end: a short read is not a cached read.
        assert!(!read_cached_at(&f, &mut buf, 15_000));
        assert!(read_cached_at(&f, &mut [], 30_000));
        // The backend counts only reads it served.
        let b = FileBackend {
            file: f,
            size: 20_000,
            read_only: true,
            counters: AccessCounters::new(20_000),
        };
        assert!(b.read_cached(&mut buf[..100], 0));
        assert!(!b.read_cached(&mut buf, 19_000));
        assert_eq!(b.counters.snapshot().groups, vec![(1, 0)]);
    }

    #[test]
    fn counters_span_groups() {
        let c = AccessCounters::new(3 * ACCESS_GROUP_SIZE);
        c.record(ACCESS_GROUP_SIZE - 1, 2, false);
        c.record(2 * ACCESS_GROUP_SIZE, 4096, true);
        let s = c.snapshot();
        assert_eq!(s.groups, vec![(1, 0), (1, 0), (0, 1)]);
    }
}
