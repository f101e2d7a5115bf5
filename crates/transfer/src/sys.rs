//! The few system calls the transfer layer makes that std does not wrap,
//! each behind a safe function (every `unsafe` of the crate is here).

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, BorrowedFd};

/// Writes every buffer of `bufs` at `offset` of `file` (`pwritev`,
/// resumed after short writes); `bufs` is consumed.
pub fn pwritev_all(
    file: &std::fs::File,
    bufs: &mut [IoSlice<'_>],
    mut offset: u64,
) -> io::Result<()> {
    let mut bufs = bufs;
    while !bufs.is_empty() {
        // SAFETY: IoSlice is ABI-compatible with iovec; the buffers are
        // valid for their lengths for the call; the fd is open (borrowed
        // from `file`).
        let n = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                bufs.as_ptr().cast(),
                bufs.len().min(1024) as libc::c_int,
                offset as libc::off_t,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        offset += n as u64;
        IoSlice::advance_slices(&mut bufs, n as usize);
    }
    Ok(())
}

pub use vmm::sys::data_extents;

/// Which socket buffer.
#[derive(Debug, Clone, Copy)]
pub enum SocketBuffer {
    /// SO_SNDBUF.
    Send,
    /// SO_RCVBUF.
    Receive,
}

/// Asks for a socket buffer of `bytes` (the kernel caps it at
/// net.core.[rw]mem_max).
pub fn set_socket_buffer(
    socket: BorrowedFd<'_>,
    which: SocketBuffer,
    bytes: i32,
) -> io::Result<()> {
    let option = match which {
        SocketBuffer::Send => libc::SO_SNDBUF,
        SocketBuffer::Receive => libc::SO_RCVBUF,
    };
    // SAFETY: setsockopt reads an int from a valid pointer for its size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&bytes as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bytes readable on a socket right now.
pub fn bytes_waiting(socket: BorrowedFd<'_>) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int to the pointer we pass, which points
    // to a live local.
    let rc = unsafe { libc::ioctl(socket.as_raw_fd(), libc::FIONREAD, &mut n) };
    if rc < 0 {
        0
    } else {
        n.max(0) as usize
    }
}

/// Whether the peer of a connected `socket` has closed it and everything it
/// sent has been read (a read would return end of file now).
pub fn peer_closed(socket: BorrowedFd<'_>) -> bool {
    let mut byte = 0u8;
    // SAFETY: recv writes at most one byte into the live local; MSG_PEEK
    // leaves it in the socket, MSG_DONTWAIT never blocks.
    let rc = unsafe {
        libc::recv(
            socket.as_raw_fd(),
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    rc == 0
}

/// CPU time the calling thread has used, ms (for debug logs).
pub fn thread_cpu_ms() -> f64 {
    // SAFETY: getrusage fills the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_THREAD reads the calling thread's counters.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
        return 0.0;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1000.0 + t.tv_usec as f64 / 1000.0;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// The uid of the process at the other end of a Unix socket.
pub fn peer_uid(socket: BorrowedFd<'_>) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which we
    // own, and updates `len`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    #[test]
    fn pwritev_writes_every_buffer_and_extents_see_them() {
        let dir = std::env::temp_dir().join(format!("transfer-sys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        f.set_len(1 << 20).unwrap();
        let (a, b) = ([1u8; 4096], [2u8; 4096]);
        let mut bufs = [IoSlice::new(&a), IoSlice::new(&b)];
        pwritev_all(&f, &mut bufs, 8192).unwrap();
        let mut x = [0u8; 2];
        f.read_exact_at(&mut x[..1], 8192).unwrap();
        f.read_exact_at(&mut x[1..], 8192 + 4096).unwrap();
        assert_eq!(x, [1, 2]);
        let extents = data_extents(&f, 1 << 20);
        assert!(
            extents.iter().any(|&(s, e)| s <= 8192 && e >= 16384),
            "{extents:?}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_peer_of_a_socket_pair_is_this_user() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(peer_uid(a.as_fd()).unwrap(), euid());
        assert_eq!(bytes_waiting(a.as_fd()), 0);
        assert!(thread_cpu_ms() >= 0.0);
    }
}
