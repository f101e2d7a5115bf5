//! The TLS relay: one thread per TLS connection owns the TLS stream and
//! moves bytes between it and one end of a Unix socket pair, both
//! non-blocking, waiting in poll(2) for whatever OpenSSL or the session
//! needs next. The NBD session runs, as on any socket, on the other end.
//!
//! ```text
//!  client ══TLS══ socket ─► relay: ssl_read  ─► down ─► pair ─► session
//!                 socket ◄─ relay: ssl_write ◄─ up   ◄─ pair ◄─ session
//! ```
//!
//! Each direction holds at most one buffer of bytes in flight, so a slow
//! reader on one side stops the other side's reads (back-pressure). The
//! client's close (close_notify or EOF) is passed on as the pair's EOF; the
//! session's close ends the TLS session with close_notify.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use openssl::ssl::{ErrorCode, SslStream};
use tracing::debug;

const BUFFER: usize = 256 * 1024;

/// Sets (or clears, with `None`) a socket's receive and send timeouts.
pub fn set_timeouts(fd: RawFd, timeout: Option<Duration>) -> io::Result<()> {
    let t = timeout.unwrap_or_default();
    let tv = libc::timeval {
        tv_sec: t.as_secs() as libc::time_t,
        tv_usec: t.subsec_micros() as libc::suseconds_t,
    };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: `tv` is a valid timeval for the duration of the call and
        // its size is passed; setsockopt does not keep the pointer.
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns, integer arguments only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Starts the relay of an established TLS stream; returns the plain end.
pub fn spawn<S>(tls: SslStream<S>) -> io::Result<UnixStream>
where
    S: Read + Write + AsRawFd + Send + 'static,
{
    let (ours, theirs) = UnixStream::pair()?;
    set_nonblocking(tls.get_ref().as_raw_fd())?;
    ours.set_nonblocking(true)?;
    std::thread::Builder::new()
        .name("nbd-tls".into())
        .spawn(move || match run(tls, ours) {
            Ok(()) => debug!("TLS relay ended"),
            Err(e) => debug!(error = %e, "TLS relay ended with an error"),
        })?;
    Ok(theirs)
}

/// Bytes read from one side, not yet all written to the other.
struct Pending {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Pending {
    fn new() -> Self {
        Pending {
            buf: vec![0; BUFFER],
            start: 0,
            end: 0,
        }
    }
    fn is_empty(&self) -> bool {
        self.start == self.end
    }
    fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }
    fn filled(&mut self, n: usize) {
        self.start = 0;
        self.end = n;
    }
    fn consumed(&mut self, n: usize) {
        self.start += n;
    }
}

/// What the next poll waits for.
#[derive(Default)]
struct Wants {
    net: libc::c_short,
    plain: libc::c_short,
}

impl Wants {
    fn tls(&mut self, code: ErrorCode) -> bool {
        match code {
            ErrorCode::WANT_READ => self.net |= libc::POLLIN,
            ErrorCode::WANT_WRITE => self.net |= libc::POLLOUT,
            _ => return false,
        }
        true
    }
}

fn would_block(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

fn run<S: Read + Write + AsRawFd>(mut tls: SslStream<S>, mut plain: UnixStream) -> io::Result<()> {
    let mut down = Pending::new();
    let mut up = Pending::new();
    let (mut net_eof, mut plain_eof) = (false, false);
    loop {
        let mut wants = Wants::default();
        let mut progress = false;
        // Client → session.
        if !net_eof && down.is_empty() {
            match tls.ssl_read(&mut down.buf) {
                Ok(n) => {
                    down.filled(n);
                    progress = true;
                }
                Err(e) if wants.tls(e.code()) => {}
                Err(e)
                    if e.code() == ErrorCode::ZERO_RETURN
                        || (e.code() == ErrorCode::SYSCALL && e.io_error().is_none()) =>
                {
                    // close_notify, or the connection's EOF.
                    net_eof = true;
                    progress = true;
                }
                Err(e) => return Err(io::Error::other(e.to_string())),
            }
        }
        if !down.is_empty() {
            match plain.write(down.bytes()) {
                Ok(n) => {
                    down.consumed(n);
                    progress = true;
                }
                Err(e) if would_block(&e) => wants.plain |= libc::POLLOUT,
                Err(e) => return Err(e),
            }
        }
        if net_eof && down.is_empty() {
            // Tell the session; it closes its end when done answering.
            let _ = plain.shutdown(std::net::Shutdown::Write);
        }
        // Session → client.
        if !plain_eof && up.is_empty() {
            match plain.read(&mut up.buf) {
                Ok(0) => {
                    plain_eof = true;
                    progress = true;
                }
                Ok(n) => {
                    up.filled(n);
                    progress = true;
                }
                Err(e) if would_block(&e) => wants.plain |= libc::POLLIN,
                Err(e) => return Err(e),
            }
        }
        if !up.is_empty() {
            match tls.ssl_write(up.bytes()) {
                Ok(n) => {
                    up.consumed(n);
                    progress = true;
                }
                Err(e) if wants.tls(e.code()) => {}
                Err(e) => return Err(io::Error::other(e.to_string())),
            }
        }
        if plain_eof && up.is_empty() {
            // The session is over and everything it said is sent.
            let _ = tls.shutdown();
            return Ok(());
        }
        if net_eof && down.is_empty() && wants.plain & libc::POLLIN != 0 && up.is_empty() {
            // The client is gone: wait only for the session to close.
            wants.net = 0;
        }
        if progress {
            continue;
        }
        poll(
            tls.get_ref().as_raw_fd(),
            wants.net,
            plain.as_raw_fd(),
            wants.plain,
        )?;
    }
}

fn poll(
    net: RawFd,
    net_events: libc::c_short,
    plain: RawFd,
    plain_events: libc::c_short,
) -> io::Result<()> {
    let mut fds = [
        libc::pollfd {
            fd: if net_events == 0 { -1 } else { net },
            events: net_events,
            revents: 0,
        },
        libc::pollfd {
            fd: if plain_events == 0 { -1 } else { plain },
            events: plain_events,
            revents: 0,
        },
    ];
    // SAFETY: two valid pollfds for the duration of the call; negative
    // descriptors are ignored by poll.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}
