//! The machine's raw system calls, each behind a small safe function that
//! returns `io::Result` (crosvm's `base`): memfds and their seals, shared
//! mappings, data and hole extents, `fallocate`, writes on a descriptor,
//! descriptor duplication, non-blocking mode, sockets, signal masks, thread
//! ids and CPU affinity. The `unsafe` of these calls lives here and nowhere
//! else; KVM's own ioctls stay with kvm-ioctls and the modules that drive
//! them (`vstate`, `dirty`).

use std::ffi::{c_int, c_uint, c_void, CStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

/// `-1` from a call as the calling thread's `errno`.
fn check(rc: c_int) -> io::Result<c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// `memfd_create(name, flags)`: a new anonymous memory file.
pub fn memfd_create(name: &CStr, flags: c_uint) -> io::Result<File> {
    // SAFETY: memfd_create reads a valid NUL-terminated string and returns a
    // new fd or -1; no memory is shared with the kernel beyond the call.
    let fd = check(unsafe { libc::memfd_create(name.as_ptr(), flags) })?;
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// `fcntl(F_ADD_SEALS, seals)` on a memfd.
pub fn add_seals(fd: BorrowedFd<'_>, seals: c_int) -> io::Result<()> {
    // SAFETY: fcntl on a valid fd; F_ADD_SEALS takes an int argument.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) }).map(drop)
}

/// Sets `O_NONBLOCK` on `fd`.
pub fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: fcntl on a valid fd; F_GETFL takes no argument.
    let flags = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    // SAFETY: as above; F_SETFL takes an int.
    check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) }).map(drop)
}

/// `lseek(fd, from, whence)`: the new offset.
#[inline]
fn lseek(fd: BorrowedFd<'_>, from: i64, whence: c_int) -> io::Result<i64> {
    // SAFETY: lseek on a valid fd only moves its offset; errors are returned.
    let at = unsafe { libc::lseek(fd.as_raw_fd(), from, whence) };
    if at < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(at)
    }
}

/// The start of the first data extent of `fd` at or after `from`
/// (`SEEK_DATA`; `ENXIO` past the last one).
#[inline]
pub fn seek_data(fd: BorrowedFd<'_>, from: i64) -> io::Result<i64> {
    lseek(fd, from, libc::SEEK_DATA)
}

/// The start of the first hole of `fd` at or after `from` (`SEEK_HOLE`; the
/// end of the file counts as one).
#[inline]
pub fn seek_hole(fd: BorrowedFd<'_>, from: i64) -> io::Result<i64> {
    lseek(fd, from, libc::SEEK_HOLE)
}

/// Data extents `[start, end)` of `file` up to `size` (never-written parts
/// of a sparse file, and pages given back, are holes); the whole range if
/// the file system cannot tell.
pub fn data_extents(file: &File, size: u64) -> Vec<(u64, u64)> {
    let fd = file.as_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < size {
        let data = match seek_data(fd, pos) {
            Ok(d) => d,
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => break,
            Err(_) => return vec![(0, size)],
        };
        let end = seek_hole(fd, data).unwrap_or(size as i64);
        out.push((data as u64, (end as u64).min(size)));
        pos = end;
    }
    out
}

/// `fallocate(fd, mode, offset, len)` (punch a hole, zero a range...).
#[inline]
pub fn fallocate(fd: BorrowedFd<'_>, mode: c_int, offset: i64, len: i64) -> io::Result<()> {
    // SAFETY: fallocate on a valid fd; no memory is passed.
    check(unsafe { libc::fallocate(fd.as_raw_fd(), mode, offset, len) }).map(drop)
}

/// `pread(2)` of `dst.len()` bytes at `offset` of `fd` straight into guest
/// memory, retried on `EINTR` and short reads; the bytes read are marked
/// in `dst`'s bitmap (dirty tracking), as vm-memory's own writes are. A file
/// shorter than the range is `UnexpectedEof`.
pub fn pread_exact_volatile<B: vm_memory::bitmap::BitmapSlice>(
    fd: BorrowedFd<'_>,
    dst: &vm_memory::VolatileSlice<'_, B>,
    offset: u64,
) -> io::Result<()> {
    let guard = dst.ptr_guard_mut();
    let base = guard.as_ptr();
    let mut done = 0usize;
    let result = loop {
        if done == dst.len() {
            break Ok(());
        }
        let Ok(at) = libc::off_t::try_from(offset + done as u64) else {
            break Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        // SAFETY: `base` points at `dst.len()` bytes of mapped guest memory
        // (the VolatileSlice's invariant, held by `guard`); the kernel writes
        // at most the `dst.len() - done` bytes from `base + done`, and no
        // Rust reference to that memory exists.
        let n = unsafe { libc::pread(fd.as_raw_fd(), base.add(done).cast(), dst.len() - done, at) };
        match n {
            0 => break Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    break Err(e);
                }
            }
        }
    };
    dst.bitmap().mark_dirty(0, done);
    result
}

/// One `write(2)` of `buf` to `fd`: the bytes written. `fd` is a
/// descriptor the caller holds open (a device's TAP); a stale number only
/// makes the call fail or write elsewhere, it touches no memory.
#[inline]
pub fn write(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: write() reads `buf`, valid for its length, and keeps nothing.
    let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// `dup(fd)`: a new descriptor of the same open file. `fd` is a descriptor
/// the caller holds open (kvm-ioctls' types give no `BorrowedFd`).
pub fn dup(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: dup of a descriptor number; the result is checked.
    let new = check(unsafe { libc::dup(fd) })?;
    // SAFETY: `new` was just returned by dup and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// `socket(domain, kind, protocol)`.
pub fn socket(domain: c_int, kind: c_int, protocol: c_int) -> io::Result<OwnedFd> {
    // SAFETY: socket() takes no pointers; the result is checked.
    let fd = check(unsafe { libc::socket(domain, kind, protocol) })?;
    // SAFETY: `fd` was just returned by socket() and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The size of a page of memory.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// A read-write `MAP_SHARED` mapping of a file, unmapped when dropped. The
/// mapping keeps the file open on its own.
pub struct SharedMapping {
    ptr: NonNull<c_void>,
    len: usize,
}

impl SharedMapping {
    /// Maps `len` bytes of `fd` from `offset`, where the kernel chooses.
    pub fn new(fd: RawFd, len: usize, offset: i64) -> io::Result<Self> {
        // SAFETY: a new shared mapping chosen by the kernel (no fixed
        // address), so no existing memory changes; the result is checked
        // before use and unmapped only in Drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr).ok_or_else(|| io::Error::other("mmap returned NULL"))?;
        Ok(SharedMapping { ptr, len })
    }

    /// The first byte of the mapping.
    pub fn as_ptr(&self) -> NonNull<c_void> {
        self.ptr
    }

    /// The mapping's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: mmap refuses a zero length).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

// SAFETY: the mapping belongs to the process, not to a thread: it may be
// used and unmapped from any thread. `SharedMapping` gives out only its
// address; whoever dereferences it synchronizes access.
unsafe impl Send for SharedMapping {}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `new`, unmapped
        // once, here; whoever reads through `as_ptr` does not outlive `self`.
        unsafe { libc::munmap(self.ptr.as_ptr(), self.len) };
    }
}

/// Every signal blocked on this thread until dropped (then the previous mask
/// again; a signal that came meanwhile is delivered then).
pub struct SignalsBlocked(libc::sigset_t);

impl SignalsBlocked {
    /// Blocks every signal on the calling thread.
    pub fn new() -> Self {
        // SAFETY: zeroed sigset_t values are valid; sigfillset and
        // pthread_sigmask only write the sets passed.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
            SignalsBlocked(old)
        }
    }
}

impl Default for SignalsBlocked {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for SignalsBlocked {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved by `new` on the same thread.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut());
        }
    }
}

/// The calling thread's kernel id.
pub fn gettid() -> libc::pid_t {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

/// The CPU the calling thread runs on (as of the call).
pub fn current_cpu() -> io::Result<usize> {
    // SAFETY: sched_getcpu has no preconditions.
    let cpu = check(unsafe { libc::sched_getcpu() })?;
    Ok(cpu as usize)
}

/// A set of CPUs (`cpu_set_t`).
#[derive(Clone, Copy)]
pub struct CpuSet(libc::cpu_set_t);

impl CpuSet {
    /// Takes `cpu` out of the set (below `CPU_SETSIZE`, as the kernel's CPU
    /// numbers are).
    pub fn remove(&mut self, cpu: usize) {
        // SAFETY: CPU_CLR writes one bit of the set; it panics on a CPU
        // beyond the set rather than write past it.
        unsafe { libc::CPU_CLR(cpu, &mut self.0) };
    }

    /// Whether `cpu` is in the set.
    pub fn contains(&self, cpu: usize) -> bool {
        // SAFETY: CPU_ISSET reads one bit of the set (and panics beyond it).
        unsafe { libc::CPU_ISSET(cpu, &self.0) }
    }

    /// How many CPUs the set holds.
    pub fn count(&self) -> usize {
        // SAFETY: CPU_COUNT reads the set.
        unsafe { libc::CPU_COUNT(&self.0) as usize }
    }
}

/// The CPUs thread `tid` (0: the caller) may run on.
pub fn thread_affinity(tid: libc::pid_t) -> io::Result<CpuSet> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a cpu_set_t of the size given; a bad tid only makes
    // the call fail.
    check(unsafe {
        libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set)
    })?;
    Ok(CpuSet(set))
}

/// Lets thread `tid` (0: the caller) run only on the CPUs of `set`.
pub fn set_thread_affinity(tid: libc::pid_t, set: &CpuSet) -> io::Result<()> {
    // SAFETY: `set` is a valid cpu_set_t of the size given; a bad tid only
    // makes the call fail.
    check(unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set.0) })
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsFd;

    #[test]
    fn a_sealed_memfd_keeps_its_size() {
        let f = memfd_create(c"sys-test", libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING).unwrap();
        f.set_len(8192).unwrap();
        add_seals(f.as_fd(), libc::F_SEAL_GROW | libc::F_SEAL_SHRINK).unwrap();
        assert!(f.set_len(4096).is_err());
        assert_eq!(f.metadata().unwrap().len(), 8192);
    }

    #[test]
    fn holes_and_data_are_found() {
        let f = memfd_create(c"sys-test", libc::MFD_CLOEXEC).unwrap();
        f.set_len(3 * 4096).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[1; 4096], 4096).unwrap();
        assert_eq!(seek_data(f.as_fd(), 0).unwrap(), 4096);
        assert_eq!(seek_hole(f.as_fd(), 4096).unwrap(), 8192);
        let past = seek_data(f.as_fd(), 8192).unwrap_err();
        assert_eq!(past.raw_os_error(), Some(libc::ENXIO));
    }

    #[test]
    fn a_shared_mapping_sees_the_file() {
        let f = memfd_create(c"sys-test", libc::MFD_CLOEXEC).unwrap();
        let page = page_size();
        f.set_len(page as u64).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"kemari", 0).unwrap();
        let m = SharedMapping::new(f.as_raw_fd(), page, 0).unwrap();
        assert_eq!(m.len(), page);
        // SAFETY: the mapping is `page` bytes long and lives across the read.
        let head = unsafe { std::slice::from_raw_parts(m.as_ptr().as_ptr().cast::<u8>(), 6) };
        assert_eq!(head, b"kemari");
    }

    #[test]
    fn writes_dups_and_nonblocking_reads() {
        let (mut rx, tx) = std::os::unix::net::UnixStream::pair().unwrap();
        let tx2 = dup(tx.as_raw_fd()).unwrap();
        assert_eq!(write(tx2.as_raw_fd(), b"hi").unwrap(), 2);
        let mut buf = [0u8; 2];
        rx.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hi");
        set_nonblocking(rx.as_fd()).unwrap();
        assert_eq!(
            rx.read(&mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
    }

    #[test]
    fn affinity_round_trips() {
        let set = thread_affinity(0).unwrap();
        assert!(set.count() >= 1);
        assert!(set.contains(current_cpu().unwrap()));
        set_thread_affinity(0, &set).unwrap();
        assert!(gettid() > 0);
    }
}
