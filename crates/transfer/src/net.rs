//! TCP connections of the hand-overs between hosts (live migration, fault
//! tolerance): resolve, connect with a bound, tune, accept one peer.

use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::time::Duration;

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

/// Listens on `addr` and accepts one `peer`, tuned like [`connect`]'s.
pub fn accept_one(
    addr: &str,
    peer: Peer,
    receive_buffer: Option<i32>,
    read_timeout: Option<Duration>,
) -> Result<(TcpStream, std::net::SocketAddr), TransferError> {
    let listener = bind(addr)?;
    match listener.local_addr() {
        Ok(bound) => crate::listening::listening(&bound.to_string()),
        Err(_) => crate::listening::listening(addr),
    }
    accept_on(&listener, addr, peer, receive_buffer, read_timeout)
}

/// Listens on `addr`.
pub fn bind(addr: &str) -> Result<TcpListener, TransferError> {
    TcpListener::bind(addr).map_err(|source| TransferError::Listen {
        addr: addr.to_owned(),
        source,
    })
}

/// Accepts one `peer` on `listener` (bound to `addr`), tuned like
/// [`connect`]'s; the listener stays open.
pub fn accept_on(
    listener: &TcpListener,
    addr: &str,
    peer: Peer,
    receive_buffer: Option<i32>,
    read_timeout: Option<Duration>,
) -> Result<(TcpStream, std::net::SocketAddr), TransferError> {
    tracing::info!(listen = addr, "waiting for the {peer}");
    let (stream, from) = listener
        .accept()
        .map_err(|e| TransferError::io(peer, "accepting", None, e))?;
    tracing::info!(%from, "the {peer} connected");
    tune(
        &stream,
        peer,
        receive_buffer.map(|b| (SocketBuffer::Receive, b)),
        read_timeout,
    )?;
    Ok((stream, from))
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
