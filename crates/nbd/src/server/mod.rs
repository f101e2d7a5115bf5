//! The NBD server: listeners and the life of a connection, from accept
//! (allow-list) through negotiation ([`negotiate`], with STARTTLS) to the
//! transmission phase ([`transmission`]). The layout follows nbdkit's
//! `connections.c`, `protocol-handshake-newstyle.c` and `protocol.c`.
//!
//! ```text
//!  accept ─► allowed? ─no─► close (logged, no NBD byte sent)
//!              │yes
//!              ▼
//!   greet, haggle ─STARTTLS─► TLS handshake ─► relay thread ◄─► socket pair ─► haggle ─► transmission
//!              └──────────────────────────── GO ─────────────────────────────────────► transmission
//! ```
//!
//! A TLS connection's records are decrypted and encrypted by a relay thread
//! ([`crate::tls`]); the session itself runs over the plain end of a Unix
//! socket pair, so that negotiation, transmission and the splice path are the
//! same code with or without TLS.

mod admission;
pub mod negotiate;
mod read_buf;
mod request_poll;
pub mod transmission;

use std::collections::BTreeMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;
use tracing::{debug, info, warn};

use crate::allow::AllowList;
use crate::backend::Backend;
use crate::metrics::{self, Refusal};
use crate::shutdown::OwnedSocket;
use crate::tls::{TlsError, TlsServer};
use admission::{Admission, HandshakeDeadline};
use nbd_client::protocol::ProtocolError;
use negotiate::{Haggled, Negotiation};
use transmission::{transmission, Negotiated};

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("i/o on the client connection")]
    Io(#[from] io::Error),
    #[error("protocol violation by the client")]
    Protocol(#[from] ProtocolError),
    #[error("client requested unsupported handshake flags {0:#x}")]
    ClientFlags(u32),
    #[error("client asked for unknown export {0:?} with NBD_OPT_EXPORT_NAME")]
    UnknownExport(String),
    #[error("client chose an export with NBD_OPT_EXPORT_NAME before STARTTLS; this server requires TLS (--tls require)")]
    TlsRequired,
    #[error("client sent data after NBD_OPT_STARTTLS before the TLS handshake")]
    DataBeforeTls,
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// One named export.
#[derive(Clone)]
pub struct Export {
    pub name: String,
    pub description: String,
    pub backend: Arc<dyn Backend>,
}

/// The set of exports a server offers, by name.
#[derive(Clone, Default)]
pub struct Exports {
    map: BTreeMap<String, Export>,
}

impl Exports {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn add(&mut self, name: &str, backend: Arc<dyn Backend>) {
        self.map.insert(
            name.to_string(),
            Export {
                name: name.to_string(),
                description: String::new(),
                backend,
            },
        );
    }
    /// Looks an export up; an empty name means the only (or first) export.
    pub fn get(&self, name: &str) -> Option<&Export> {
        if name.is_empty() {
            return self.map.values().next();
        }
        self.map.get(name)
    }
    /// The exports' names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(String::as_str)
    }
}

/// What `--tls` asks of clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// STARTTLS is refused.
    Off,
    /// STARTTLS is offered; plain clients are served too.
    On,
    /// Nothing but STARTTLS (and ABORT) is answered before TLS is up.
    Require,
}

impl std::str::FromStr for TlsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(TlsMode::Off),
            "on" => Ok(TlsMode::On),
            "require" => Ok(TlsMode::Require),
            _ => Err(format!("invalid TLS mode {s:?}: use off, on or require")),
        }
    }
}

/// The server's TLS set-up: a mode, and the credentials unless it is off.
#[derive(Clone, Default)]
pub enum Tls {
    #[default]
    Off,
    On(Arc<TlsServer>),
    Require(Arc<TlsServer>),
}

impl Tls {
    pub fn new(mode: TlsMode, server: Option<Arc<TlsServer>>) -> Option<Tls> {
        match (mode, server) {
            (TlsMode::Off, _) => Some(Tls::Off),
            (TlsMode::On, Some(s)) => Some(Tls::On(s)),
            (TlsMode::Require, Some(s)) => Some(Tls::Require(s)),
            (_, None) => None,
        }
    }
    pub fn mode(&self) -> TlsMode {
        match self {
            Tls::Off => TlsMode::Off,
            Tls::On(_) => TlsMode::On,
            Tls::Require(_) => TlsMode::Require,
        }
    }
    fn server(&self) -> Option<&TlsServer> {
        match self {
            Tls::Off => None,
            Tls::On(s) | Tls::Require(s) => Some(s),
        }
    }
}

/// Everything a server needs besides its listener.
#[derive(Clone, Default)]
pub struct ServerConfig {
    pub exports: Exports,
    pub tls: Tls,
    /// Client addresses served on TCP listeners (empty: everyone).
    pub allow: AllowList,
    /// A client must enter transmission within this; `None`: no limit
    /// (the command line's default is 10 s).
    pub handshake_limit: Option<Duration>,
    /// Most connections served at once, more are closed at once; 0: no
    /// limit (the command line's default is 100).
    pub max_connections: usize,
}

impl ServerConfig {
    pub fn new(exports: Exports) -> Self {
        ServerConfig {
            exports,
            ..ServerConfig::default()
        }
    }
}

/// Where to listen: `HOST:PORT` or `unix:PATH`.
pub enum Listener {
    Tcp(TcpListener),
    /// The socket file is removed when the listener is dropped (or the
    /// process is stopped by SIGTERM/SIGINT), if it is still ours.
    Unix(UnixListener, OwnedSocket),
}

/// Why a listener could not be set up.
#[derive(Debug, Error)]
pub enum ListenError {
    #[error("cannot listen on the Unix socket")]
    Unix(#[from] kemari_unix_socket::BindError),
    #[error("cannot listen on TCP address {addr}")]
    Tcp {
        addr: String,
        #[source]
        source: io::Error,
    },
}

impl Listener {
    /// Binds `HOST:PORT`, or `unix:PATH` where only a stale socket is ever
    /// replaced (a regular file, or a socket another server answers on, is
    /// refused and left alone).
    pub fn bind(addr: &str) -> Result<Listener, ListenError> {
        if let Some(path) = addr.strip_prefix("unix:") {
            let (l, owned) = OwnedSocket::bind(Path::new(path))?;
            Ok(Listener::Unix(l, owned))
        } else {
            TcpListener::bind(addr)
                .map(Listener::Tcp)
                .map_err(|source| ListenError::Tcp {
                    addr: addr.to_string(),
                    source,
                })
        }
    }
}

/// A socket the session can run on: TCP, Unix, or the plain end of a TLS relay.
trait Socket: Read + Write + AsRawFd + Send + 'static {
    fn duplicate(&self) -> io::Result<Self>
    where
        Self: Sized;
}

impl Socket for TcpStream {
    fn duplicate(&self) -> io::Result<Self> {
        self.try_clone()
    }
}

impl Socket for UnixStream {
    fn duplicate(&self) -> io::Result<Self> {
        self.try_clone()
    }
}

/// Serves `config`'s exports on `listener` forever, one thread per
/// connection, at most `config.max_connections` at once, each closed if its
/// client has not entered transmission within `config.handshake_limit`
/// (admission.rs). A failed accept (a client that reset before it was
/// accepted, or no file descriptors left for a moment) is logged, never
/// fatal.
pub fn serve(listener: Listener, config: Arc<ServerConfig>) -> io::Result<()> {
    let admission = Admission::new(config.max_connections);
    loop {
        match &listener {
            Listener::Tcp(l) => {
                let (s, peer) = match l.accept() {
                    Ok(a) => a,
                    Err(e) => {
                        accept_failed(e);
                        continue;
                    }
                };
                if !config.allow.allows(peer.ip()) {
                    warn!(%peer, "connection refused: address not allowed (--allow)");
                    metrics::connection_refused(Refusal::NotAllowed);
                    drop(s);
                    continue;
                }
                let Some(slot) = admitted(&admission, &peer.to_string()) else {
                    continue;
                };
                let _ = s.set_nodelay(true);
                let deadline = deadline(&config, peer.to_string(), s.try_clone(), |s| {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                });
                let cfg = config.clone();
                spawn_conn(format!("{peer}"), move || {
                    let _slot = slot;
                    serve_stream(s, &cfg, None, &deadline)
                });
            }
            Listener::Unix(l, _) => {
                let s = match l.accept() {
                    Ok((s, _)) => s,
                    Err(e) => {
                        accept_failed(e);
                        continue;
                    }
                };
                let Some(slot) = admitted(&admission, "unix") else {
                    continue;
                };
                let deadline = deadline(&config, "unix".into(), s.try_clone(), |s| {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                });
                let cfg = config.clone();
                spawn_conn("unix".to_string(), move || {
                    let _slot = slot;
                    serve_stream(s, &cfg, None, &deadline)
                });
            }
        }
    }
}

/// A slot for `peer`'s connection, or `None` (logged, counted) when
/// `--max-connections` are open.
fn admitted(admission: &Admission, peer: &str) -> Option<admission::Slot> {
    let slot = admission.admit();
    if slot.is_none() {
        warn!(
            %peer,
            open = admission.open(),
            "connection refused: too many connections (--max-connections)"
        );
        metrics::connection_refused(Refusal::Limit);
    }
    slot
}

/// The handshake's deadline for a connection whose socket's `copy` lets
/// `shut` end it; none without a limit (or without a copy).
fn deadline<S: Send + 'static>(
    config: &ServerConfig,
    peer: String,
    copy: io::Result<S>,
    shut: fn(&S),
) -> HandshakeDeadline {
    match (config.handshake_limit, copy) {
        (Some(limit), Ok(s)) => HandshakeDeadline::start(limit, peer, move || shut(&s)),
        (Some(_), Err(e)) => {
            warn!(error = %e, %peer, "cannot watch the handshake's time limit");
            HandshakeDeadline::none()
        }
        (None, _) => HandshakeDeadline::none(),
    }
}

fn accept_failed(e: io::Error) {
    warn!(error = %e, "accepting a connection failed");
    // Out of descriptors or memory: give the other connections a moment.
    if !matches!(
        e.raw_os_error(),
        Some(libc::ECONNABORTED | libc::EINTR | libc::EPROTO)
    ) {
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn spawn_conn(peer: String, f: impl FnOnce() -> Result<(), ServerError> + Send + 'static) {
    let _ = std::thread::Builder::new()
        .name("nbd-conn".into())
        .spawn(move || {
            debug!(%peer, "connection opened");
            match f() {
                Ok(()) => debug!(%peer, "connection closed"),
                Err(ServerError::Io(e))
                    if matches!(
                        e.kind(),
                        io::ErrorKind::UnexpectedEof
                            | io::ErrorKind::ConnectionReset
                            | io::ErrorKind::BrokenPipe
                    ) =>
                {
                    debug!(%peer, "client went away")
                }
                Err(e) => warn!(%peer, error = %e, cause = ?std::error::Error::source(&e), "connection ended with an error"),
            }
        });
}

/// How a session ended.
enum Ended<'a> {
    Closed,
    /// STARTTLS was acknowledged: upgrade the stream, then resume.
    StartTls(Negotiation<'a>),
}

/// Negotiates (from the greeting, or `resumed` after STARTTLS) and, if the
/// client gets that far, runs the transmission phase.
fn session<'a, R, W>(
    mut r: BufReader<R>,
    mut w: BufWriter<W>,
    config: &'a ServerConfig,
    resumed: Option<Negotiation<'a>>,
    sock: Option<RawFd>,
    deadline: &HandshakeDeadline,
) -> Result<Ended<'a>, ServerError>
where
    R: Read,
    W: Write + Send + 'static,
{
    let mut neg = match resumed {
        Some(n) => n,
        None => match Negotiation::greet(&mut r, &mut w, &config.exports, config.tls.mode())? {
            Some(n) => n,
            None => return Ok(Ended::Closed),
        },
    };
    match neg.haggle(&mut r, &mut w)? {
        Haggled::Done => Ok(Ended::Closed),
        Haggled::Transmit(s) => {
            deadline.met();
            info!(export = %s.export.name, structured = s.structured, base_allocation = s.base_allocation.is_some(), "client entered transmission");
            let neg = Negotiated {
                structured: s.structured,
                base_allocation: s.base_allocation,
            };
            transmission(r, w, s.export.backend.clone(), neg, sock)?;
            Ok(Ended::Closed)
        }
        Haggled::StartTls => {
            // The client must wait for the ACK before its handshake.
            if !r.buffer().is_empty() {
                return Err(ServerError::DataBeforeTls);
            }
            Ok(Ended::StartTls(neg))
        }
    }
}

/// Serves one accepted socket; after STARTTLS, the plain end of its TLS relay.
fn serve_stream<S: Socket>(
    s: S,
    config: &ServerConfig,
    resumed: Option<Negotiation<'_>>,
    deadline: &HandshakeDeadline,
) -> Result<(), ServerError> {
    let fd = s.as_raw_fd();
    let r = BufReader::with_capacity(256 * 1024, s.duplicate()?);
    let w = BufWriter::with_capacity(256 * 1024, s.duplicate()?);
    match session(r, w, config, resumed, Some(fd), deadline)? {
        Ended::Closed => Ok(()),
        Ended::StartTls(mut neg) => {
            let Some(tls) = config.tls.server() else {
                // Negotiation acknowledges STARTTLS only when TLS is set up.
                return Err(ServerError::Tls(TlsError::NotConfigured));
            };
            let plain = tls.accept(s)?;
            neg.secured();
            serve_stream(plain, config, Some(neg), deadline)
        }
    }
}

/// Runs the handshake and then the transmission phase on one connection
/// over in-memory or other streams without TLS (a STARTTLS acknowledged
/// here ends the session).
pub fn serve_connection<R, W>(
    reader: R,
    writer: W,
    config: &ServerConfig,
) -> Result<(), ServerError>
where
    R: Read,
    W: Write + Send + 'static,
{
    let r = BufReader::with_capacity(256 * 1024, reader);
    let w = BufWriter::with_capacity(256 * 1024, writer);
    match session(r, w, config, None, None, &HandshakeDeadline::none())? {
        Ended::Closed => Ok(()),
        Ended::StartTls(_) => {
            debug!("STARTTLS on a stream that cannot carry TLS: session ends");
            Ok(())
        }
    }
}

fn read_exact_or_eof<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Feeds `input` to a server session over in-memory streams and returns what
/// it wrote (used by tests and the fuzzers).
pub fn run_session_on_bytes(
    input: &[u8],
    config: &ServerConfig,
) -> (Vec<u8>, Result<(), ServerError>) {
    let out = Arc::new(Mutex::new(Vec::new()));
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            lock(&self.0).extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let res = serve_connection(io::Cursor::new(input.to_vec()), Sink(out.clone()), config);
    let v = lock(&out).clone();
    (v, res)
}

/// Connects a socket pair to a session thread (tests).
pub fn spawn_unix_session(config: Arc<ServerConfig>) -> io::Result<UnixStream> {
    let (a, b) = UnixStream::pair()?;
    std::thread::spawn(move || {
        let _ = serve_stream(b, &config, None, &HandshakeDeadline::none());
    });
    Ok(a)
}

/// Connects to a TCP server with Nagle disabled.
pub fn tcp_connect(addr: &str) -> io::Result<TcpStream> {
    let s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    Ok(s)
}

#[cfg(test)]
mod tests;
