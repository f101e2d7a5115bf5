//! Zero-copy transfers between the client socket and an image file.
//!
//! A WRITE's payload is moved from the socket into the file with splice(2)
//! through a per-connection pipe: the socket's buffers are handed to the pipe
//! without a copy, and the kernel copies them once, into the page cache. The
//! ordinary path (`recv` into a buffer, then `pwrite`) copies every byte
//! twice. On loopback, where the sender's copy also runs on this machine's
//! CPUs, that second copy is what limits sequential write throughput.
//! READ replies do not take the mirror path (sendfile(2)): measured side by
//! side on loopback it halved read throughput at every size, for a reason
//! not found, so reads use buffers (docs/nbd.md).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Pipe capacity asked for (the default `/proc/sys/fs/pipe-max-size`).
const PIPE_SIZE: libc::c_int = 1 << 20;

/// Why a spliced transfer stopped.
#[derive(Debug)]
pub enum SpliceError {
    /// splice(2) does not work on this socket: nothing was consumed, the
    /// caller should fall back to reading the payload.
    Unsupported,
    /// The socket failed or closed mid-payload: the connection is unusable.
    Socket(io::Error),
    /// The file failed; the whole payload was still consumed from the
    /// socket (and discarded), so the connection stays in step.
    File(io::Error),
}

/// A pipe used as the in-kernel staging area between socket and file.
pub struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
    cap: usize,
}

impl Pipe {
    pub fn new() -> io::Result<Pipe> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 writes two fds into the array we pass; we own them after.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both fds were just created by pipe2 and are owned by nobody else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // A larger pipe moves a 1 MiB payload in one round; if the system
        // limit forbids it, the default (64 KiB) only costs more rounds.
        // SAFETY: F_SETPIPE_SZ / F_GETPIPE_SZ take and return integers only.
        let cap = unsafe {
            libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE);
            libc::fcntl(write.as_raw_fd(), libc::F_GETPIPE_SZ)
        };
        Ok(Pipe {
            read,
            write,
            cap: if cap > 0 { cap as usize } else { 65536 },
        })
    }

    /// Moves exactly `len` bytes from `sock` into `file` at `offset`.
    pub fn socket_to_file(
        &self,
        sock: RawFd,
        file: &File,
        offset: u64,
        len: usize,
    ) -> Result<(), SpliceError> {
        let mut remaining = len;
        let mut off = offset as libc::loff_t;
        let mut file_err: Option<io::Error> = None;
        let mut scratch: Vec<u8> = Vec::new();
        while remaining > 0 {
            let want = remaining.min(self.cap);
            // SAFETY: splice with null offsets on a socket and our pipe's write end.
            let n = unsafe {
                libc::splice(
                    sock,
                    std::ptr::null_mut(),
                    self.write.as_raw_fd(),
                    std::ptr::null_mut(),
                    want,
                    libc::SPLICE_F_MOVE,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EINVAL) if remaining == len => return Err(SpliceError::Unsupported),
                    _ => return Err(SpliceError::Socket(e)),
                }
            }
            if n == 0 {
                return Err(SpliceError::Socket(io::ErrorKind::UnexpectedEof.into()));
            }
            let n = n as usize;
            remaining -= n;
            // Empty the pipe: into the file, or (after a file error) away.
            let mut left = n;
            while left > 0 {
                if file_err.is_none() {
                    // SAFETY: splice from our pipe's read end into the file at
                    // `off`, which splice advances; `file` outlives the call.
                    let m = unsafe {
                        libc::splice(
                            self.read.as_raw_fd(),
                            std::ptr::null_mut(),
                            file.as_raw_fd(),
                            &mut off,
                            left,
                            libc::SPLICE_F_MOVE,
                        )
                    };
                    if m > 0 {
                        left -= m as usize;
                        continue;
                    }
                    let e = if m == 0 {
                        io::ErrorKind::WriteZero.into()
                    } else {
                        io::Error::last_os_error()
                    };
                    if e.kind() != io::ErrorKind::Interrupted {
                        file_err = Some(e);
                    }
                    continue;
                }
                if scratch.is_empty() {
                    scratch = vec![0u8; 65536];
                }
                let k = left.min(scratch.len());
                // SAFETY: reads at most `k` bytes into our own buffer of at least `k` bytes.
                let m =
                    unsafe { libc::read(self.read.as_raw_fd(), scratch.as_mut_ptr().cast(), k) };
                if m > 0 {
                    left -= m as usize;
                } else if m < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                } else {
                    // The pipe holds data we put there; failing to read it is
                    // not recoverable for this connection.
                    return Err(SpliceError::Socket(io::Error::other("pipe drain failed")));
                }
            }
        }
        match file_err {
            None => Ok(()),
            Some(e) => Err(SpliceError::File(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    use std::os::unix::net::UnixStream;

    #[test]
    fn moves_payload_from_socket_into_file_at_offset() {
        let dir = std::env::temp_dir().join(format!("knbd-splice-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(4 << 20).unwrap();
        let (mut a, b) = UnixStream::pair().unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let d2 = data.clone();
        let t = std::thread::spawn(move || {
            a.write_all(&d2).unwrap();
            a.write_all(b"tail").unwrap();
        });
        let p = Pipe::new().unwrap();
        p.socket_to_file(b.as_raw_fd(), &file, 4097, data.len())
            .unwrap();
        t.join().unwrap();
        let mut got = vec![0u8; data.len()];
        file.read_exact_at(&mut got, 4097).unwrap();
        assert!(got == data);
        // The bytes after the payload are still in the socket.
        let mut tail = [0u8; 4];
        std::io::Read::read_exact(&mut &b, &mut tail).unwrap();
        assert_eq!(&tail, b"tail");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn file_error_still_consumes_the_payload() {
        // A read-only file: splice into it fails, the payload is drained.
        let dir = std::env::temp_dir().join(format!("knbd-splice-ro-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let file = File::open(&path).unwrap();
        let (mut a, b) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            a.write_all(&[7u8; 200_000]).unwrap();
            a.write_all(b"next").unwrap();
        });
        let p = Pipe::new().unwrap();
        let r = p.socket_to_file(b.as_raw_fd(), &file, 0, 200_000);
        assert!(matches!(r, Err(SpliceError::File(_))), "{r:?}");
        t.join().unwrap();
        let mut tail = [0u8; 4];
        std::io::Read::read_exact(&mut &b, &mut tail).unwrap();
        assert_eq!(&tail, b"next");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
