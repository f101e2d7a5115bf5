//! The byte streams a channel runs over, and the fds that only a Unix
//! socket carries with its bytes (zero-copy migration, warm restart).

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;

/// Most fds one frame may carry.
pub const MAX_FDS: usize = 32;

/// A byte stream a channel reads from, and the fds that may come with its
/// bytes.
pub trait FdRead: Read {
    /// Reads into `buf` like `read`, adding any fds that came with these
    /// bytes to `fds`.
    fn read_with_fds(&mut self, buf: &mut [u8], fds: &mut Vec<File>) -> std::io::Result<usize> {
        let _ = fds;
        self.read(buf)
    }
}

impl FdRead for std::net::TcpStream {}
impl<R: Read> FdRead for std::io::BufReader<R> {}
impl FdRead for &[u8] {}

impl FdRead for UnixStream {
    fn read_with_fds(&mut self, buf: &mut [u8], fds: &mut Vec<File>) -> std::io::Result<usize> {
        use vmm_sys_util::sock_ctrl_msg::ScmSocket;
        let mut raw = [-1 as RawFd; MAX_FDS];
        let mut iov = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        // SAFETY: the iovec points at `buf`, which lives and stays borrowed
        // for the call; recvmsg writes at most its length there and fd
        // numbers into `raw`.
        let (n, nfds) = unsafe { self.recv_with_fds(&mut iov, &mut raw) }
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        // SAFETY: each fd was just received with SCM_RIGHTS and is ours.
        fds.extend(
            raw[..nfds]
                .iter()
                .map(|&fd| unsafe { File::from_raw_fd(fd) }),
        );
        Ok(n)
    }
}

/// A byte stream a channel writes to, and fds sent with its bytes.
pub trait FdWrite: Write {
    /// Writes some of `data` like `write`, with `fds` on its first byte.
    fn write_with_fds(&mut self, data: &[u8], fds: &[RawFd]) -> std::io::Result<usize> {
        if fds.is_empty() {
            return self.write(data);
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "only a Unix socket carries fds",
        ))
    }
}

impl FdWrite for std::net::TcpStream {}
impl<W: Write> FdWrite for std::io::BufWriter<W> {}
impl FdWrite for Vec<u8> {}

impl FdWrite for UnixStream {
    fn write_with_fds(&mut self, data: &[u8], fds: &[RawFd]) -> std::io::Result<usize> {
        use vmm_sys_util::sock_ctrl_msg::ScmSocket;
        if fds.is_empty() {
            return self.write(data);
        }
        self.send_with_fds(&[data], fds)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
    }
}

/// Reads exactly `buf.len()` bytes, the first through
/// [`FdRead::read_with_fds`] (fds ride on a frame's first bytes).
pub(super) fn read_exact_with_fds<S: FdRead>(
    stream: &mut S,
    buf: &mut [u8],
    fds: &mut Vec<File>,
) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match stream.read_with_fds(&mut buf[got..], fds) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
