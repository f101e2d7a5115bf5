//! TCP connections of the hand-overs between hosts (live migration, fault
//! tolerance): resolve, connect with a bound, tune, listen, and accept the
//! one peer that passes the handshake.

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::time::Duration;

use crate::channel::{Auth, Channel};
use crate::error::{Peer, TransferError};
use crate::sys::{self, SocketBuffer};

/// How long a connect may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Socket buffer asked for on each end of a migration: several 1 MiB frames
/// in flight, so that neither end waits for the other to be scheduled
/// after every few hundred KiB (the kernel caps it at net.core.[rw]mem_max).
pub const MIGRATION_SOCKET_BUFFER: i32 = 4 << 20;

/// Connects to the `peer` at `addr`, with TCP_NODELAY and, if given, a
/// send buffer of `send_buffer` bytes and a read timeout.
pub fn connect(
    addr: &str,
    peer: Peer,
    send_buffer: Option<i32>,
    read_timeout: Option<Duration>,
) -> Result<TcpStream, TransferError> {
    let fail = |source: std::io::Error| TransferError::Connect {
        peer,
        addr: addr.to_owned(),
        source,
    };
    let resolved = addr
        .to_socket_addrs()
        .map_err(fail)?
        .next()
        .ok_or_else(|| fail(std::io::Error::other("the address resolves to nothing")))?;
    let stream = TcpStream::connect_timeout(&resolved, CONNECT_TIMEOUT).map_err(fail)?;
    tune(
        &stream,
        peer,
        send_buffer.map(|b| (SocketBuffer::Send, b)),
        read_timeout,
    )?;
    Ok(stream)
}

/// How long an accepted connection may take over the handshake before a
/// waiting destination refuses it and waits on.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Listens on `addr` and says so ([`crate::listening`]: with port 0, the
/// port the kernel chose).
pub fn listen(addr: &str) -> Result<TcpListener, TransferError> {
    let listener = bind(addr)?;
    match listener.local_addr() {
        Ok(bound) => crate::listening::listening(&bound.to_string()),
        Err(_) => crate::listening::listening(addr),
    }
    Ok(listener)
}

/// Listens on `addr`.
pub fn bind(addr: &str) -> Result<TcpListener, TransferError> {
    TcpListener::bind(addr).map_err(|source| TransferError::Listen {
        addr: addr.to_owned(),
        source,
    })
}

/// How the connection of an accepted peer is set up once it is in.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tuning {
    /// Receive buffer to ask for, bytes.
    pub receive_buffer: Option<i32>,
    /// Read timeout after the handshake.
    pub read_timeout: Option<Duration>,
}

/// Waits on `listener` (bound to `addr`) for the `peer` and returns the
/// first connection that passes the handshake with `auth`. Every other one
/// — a wrong key, another program, a port probe, a connection silent for
/// `handshake_timeout` — is refused and logged with its address, and the
/// wait goes on: no stray connection ends a waiting destination (the peer
/// with a wrong key is told so and may try again). Connections are taken
/// one at a time, so a silent one delays the peer by `handshake_timeout`
/// at most.
pub fn accept_authenticated(
    listener: &TcpListener,
    addr: &str,
    peer: Peer,
    auth: Auth<'_>,
    tuning: Tuning,
    handshake_timeout: Duration,
) -> Result<(Channel<TcpStream>, SocketAddr), TransferError> {
    tracing::info!(listen = addr, "waiting for the {peer}");
    let mut refused = 0u64;
    loop {
        let (stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            // The connection went before it was taken.
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionAborted
                        | ErrorKind::ConnectionReset
                        | ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(e) => return Err(TransferError::io(peer, "accepting", None, e)),
        };
        let buffer = tuning.receive_buffer.map(|b| (SocketBuffer::Receive, b));
        let admitted = tune(&stream, peer, buffer, Some(handshake_timeout))
            .and_then(|()| Channel::accept(stream, auth, peer))
            .and_then(|ch| {
                ch.stream()
                    .set_read_timeout(tuning.read_timeout)
                    .map_err(|e| TransferError::io(peer, "setting up the connection", None, e))?;
                Ok(ch)
            });
        match admitted {
            Ok(ch) => {
                tracing::info!(%from, refused, "the {peer} connected");
                return Ok((ch, from));
            }
            Err(e) => {
                refused += 1;
                tracing::warn!(%from, error = %e, refused, "refused a connection: waiting on for the {peer}");
            }
        }
    }
}

/// TCP_NODELAY, the socket buffer if given, the read timeout.
pub fn tune(
    stream: &TcpStream,
    peer: Peer,
    buffer: Option<(SocketBuffer, i32)>,
    read_timeout: Option<Duration>,
) -> Result<(), TransferError> {
    let io = |e| TransferError::io(peer, "setting up the connection", None, e);
    if let Some((which, bytes)) = buffer {
        // A refusal only costs speed.
        if let Err(e) = sys::set_socket_buffer(stream.as_fd(), which, bytes) {
            tracing::debug!(error = %e, "cannot size the socket buffer");
        }
    }
    stream.set_nodelay(true).map_err(io)?;
    stream.set_read_timeout(read_timeout).map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::time::Instant;

    use super::*;

    const KEY: &[u8] = b"the-right-key-of-32-bytes-length";

    /// A port probe, a silent connection and a source with the wrong key
    /// are refused one after another; the source with the right key gets in.
    #[test]
    fn a_waiting_destination_outlasts_stray_connections() {
        let listener = listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let waiting = std::thread::spawn(move || {
            let (ch, from) = accept_authenticated(
                &listener,
                &addr.to_string(),
                Peer::Source,
                Auth::Psk(KEY),
                Tuning::default(),
                Duration::from_millis(300),
            )
            .unwrap();
            assert!(ch.is_encrypted());
            from
        });
        let mut probe = TcpStream::connect(addr).unwrap();
        probe.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        drop(probe);
        let silent = TcpStream::connect(addr).unwrap();
        let started = Instant::now();
        let wrong = TcpStream::connect(addr).unwrap();
        let refused = Channel::connect(
            wrong,
            Auth::Psk(b"a-wrong-key-of-32-bytes-length!!"),
            Peer::Destination,
        );
        assert!(refused.is_err(), "a wrong key got in");
        assert!(
            started.elapsed() >= Duration::from_millis(250),
            "the silent one was not waited out"
        );
        let right = TcpStream::connect(addr).unwrap();
        let mine = right.local_addr().unwrap();
        let ch = Channel::connect(right, Auth::Psk(KEY), Peer::Destination).unwrap();
        assert!(ch.is_encrypted());
        assert_eq!(waiting.join().unwrap(), mine);
        drop(silent);
    }
}
