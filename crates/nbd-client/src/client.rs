//! A blocking NBD client (fixed newstyle, NBD_OPT_GO, structured replies)
//! for the VMM's virtio-blk backend and for the proxy's upstream links.
//!
//! Requests may be pipelined: [`Client::submit`] sends a request and returns
//! a [`Ticket`]; a receiver thread matches replies to tickets by cookie. The
//! simple calls (`read_at`, `write_at`, ...) submit and wait.
//!
//! URLs: `nbd://HOST[:PORT][/EXPORT]` and `nbd+unix:///EXPORT?socket=PATH`.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;

use crate::protocol::*;
use crate::read_reply::ReplyAssembly;

pub const DEFAULT_PORT: u16 = 10809;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("invalid NBD URL {url:?}: {why}")]
    Url { url: String, why: &'static str },
    #[error("cannot connect to {addr}")]
    Connect {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("i/o with the NBD server")]
    Io(#[from] io::Error),
    #[error("NBD protocol error")]
    Protocol(#[from] ProtocolError),
    #[error("server refused option {option} with reply {reply:#x}: {message}")]
    OptionRefused {
        option: u32,
        reply: u32,
        message: String,
    },
    #[error("server does not speak fixed newstyle")]
    NotFixedNewstyle,
    #[error("request failed on the server with errno {errno} ({message})")]
    Request { errno: u32, message: String },
    #[error("unexpected reply: {0}")]
    Unexpected(&'static str),
    #[error("the connection to the server is closed")]
    Closed,
    #[error("the server did not finish the NBD handshake within {secs} s")]
    HandshakeTimeout { secs: u64 },
    #[error("offset {offset} + length {len} is beyond the export size {size}")]
    OutOfRange { offset: u64, len: u64, size: u64 },
}

type Result<T> = std::result::Result<T, ClientError>;

/// Where an export lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdAddr {
    Tcp(String),
    Unix(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUrl {
    pub addr: NbdAddr,
    pub export: String,
}

impl std::fmt::Display for NbdUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.addr {
            NbdAddr::Tcp(a) => write!(f, "nbd://{a}/{}", self.export),
            NbdAddr::Unix(p) => write!(f, "nbd+unix:///{}?socket={p}", self.export),
        }
    }
}

impl std::str::FromStr for NbdUrl {
    type Err = ClientError;
    fn from_str(s: &str) -> Result<Self> {
        parse_url(s)
    }
}

/// Parses `nbd://host[:port][/export]` or `nbd+unix:///export?socket=path`.
pub fn parse_url(url: &str) -> Result<NbdUrl> {
    let bad = |why| ClientError::Url {
        url: url.to_string(),
        why,
    };
    if let Some(rest) = url.strip_prefix("nbd+unix://") {
        let rest = rest
            .strip_prefix('/')
            .ok_or_else(|| bad("expected nbd+unix:///export?socket=path"))?;
        let (export, query) = rest
            .split_once('?')
            .ok_or_else(|| bad("missing ?socket="))?;
        let sock = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("socket="))
            .ok_or_else(|| bad("missing socket= parameter"))?;
        if sock.is_empty() {
            return Err(bad("empty socket path"));
        }
        return Ok(NbdUrl {
            addr: NbdAddr::Unix(sock.to_string()),
            export: export.to_string(),
        });
    }
    let rest = url
        .strip_prefix("nbd://")
        .ok_or_else(|| bad("scheme must be nbd:// or nbd+unix://"))?;
    let (hostport, export) = match rest.split_once('/') {
        Some((h, e)) => (h, e),
        None => (rest, ""),
    };
    if hostport.is_empty() {
        return Err(bad("missing host"));
    }
    // [v6]:port, host:port, or host.
    let has_port = if let Some(end) = hostport.rfind(']') {
        hostport[end..].contains(':')
    } else {
        hostport.contains(':')
    };
    let addr = if has_port {
        let (_, p) = hostport.rsplit_once(':').ok_or_else(|| bad("bad port"))?;
        p.parse::<u16>().map_err(|_| bad("bad port"))?;
        hostport.to_string()
    } else {
        format!("{hostport}:{DEFAULT_PORT}")
    };
    Ok(NbdUrl {
        addr: NbdAddr::Tcp(addr),
        export: export.to_string(),
    })
}

/// A byte stream to the server (TCP or Unix).
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Connects to `addr`, giving up on each of its addresses after `timeout`.
    fn connect(addr: &NbdAddr, timeout: Duration) -> Result<Stream> {
        match addr {
            NbdAddr::Tcp(a) => {
                let err = |source| ClientError::Connect {
                    addr: a.clone(),
                    source,
                };
                let mut last = None;
                for sa in a.to_socket_addrs().map_err(err)? {
                    match TcpStream::connect_timeout(&sa, timeout) {
                        Ok(s) => {
                            s.set_nodelay(true)?;
                            return Ok(Stream::Tcp(s));
                        }
                        Err(e) => last = Some(e),
                    }
                }
                Err(err(last.unwrap_or_else(|| {
                    io::Error::new(io::ErrorKind::NotFound, "the name has no address")
                })))
            }
            NbdAddr::Unix(p) => Ok(Stream::Unix(UnixStream::connect(p).map_err(|source| {
                ClientError::Connect {
                    addr: p.clone(),
                    source,
                }
            })?)),
        }
    }
    /// Read and write time-outs (`None`: block for as long as it takes).
    fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t).and_then(|()| s.set_write_timeout(t)),
            Stream::Unix(s) => s.set_read_timeout(t).and_then(|()| s.set_write_timeout(t)),
        }
    }
    fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }
    fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(b),
            Stream::Unix(s) => s.read(b),
        }
    }
}
impl Write for Stream {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(b),
            Stream::Unix(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What the server told us about the export.
#[derive(Debug, Clone, Copy)]
pub struct ExportInfo {
    pub size: u64,
    pub flags: u16,
    pub structured: bool,
    pub max_payload: u32,
}

fn send_option(w: &mut impl Write, option: u32, data: &[u8]) -> io::Result<()> {
    w.write_all(&encode_option(option, data))?;
    w.flush()
}

/// Largest option reply the handshake reads: export information, error
/// messages and context names are short (the spec caps strings at 4096
/// bytes), so a server cannot make us allocate more than this.
const MAX_HANDSHAKE_REPLY: u32 = 64 * 1024;
/// Largest access-counter reply ([`query_access_counts`]).
const MAX_ACCESS_COUNTS_REPLY: u32 = 16 * MAX_ACCESS_GROUPS + 16;
/// How long connecting and the handshake may take before
/// [`Client::connect`] gives up (the transmission phase has no limit: an
/// idle disk is no fault).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

fn read_option_reply(r: &mut impl Read, limit: u32) -> Result<(OptionReplyHeader, Vec<u8>)> {
    let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
    r.read_exact(&mut h)?;
    let h = decode_option_reply_header(&h, limit)?;
    let mut d = vec![0u8; h.len as usize];
    r.read_exact(&mut d)?;
    Ok((h, d))
}

fn refused(h: &OptionReplyHeader, d: &[u8]) -> ClientError {
    ClientError::OptionRefused {
        option: h.option,
        reply: h.reply_type,
        message: String::from_utf8_lossy(d).into_owned(),
    }
}

/// Reads the server greeting and sends our flags; returns whether the server
/// omits the 124 zero bytes after NBD_OPT_EXPORT_NAME.
fn greet<S: Read + Write>(s: &mut S) -> Result<bool> {
    let mut hs = [0u8; HANDSHAKE_LEN];
    s.read_exact(&mut hs)?;
    let flags = decode_handshake(&hs)?;
    if flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(ClientError::NotFixedNewstyle);
    }
    let no_zeroes = flags & FLAG_NO_ZEROES != 0;
    let mut cf = CLIENT_FIXED_NEWSTYLE;
    if no_zeroes {
        cf |= CLIENT_NO_ZEROES;
    }
    s.write_all(&cf.to_be_bytes())?;
    Ok(no_zeroes)
}

/// The client's side of the fixed-newstyle handshake over `s` for
/// `export`: structured replies if the server has them, then NBD_OPT_GO
/// (NBD_OPT_EXPORT_NAME with an old server). What the server said about the
/// export, or why it cannot be used; `s` is in the transmission phase after
/// `Ok`.
pub fn negotiate<S: Read + Write>(s: &mut S, export: &str) -> Result<ExportInfo> {
    let no_zeroes = greet(s)?;
    send_option(s, OPT_STRUCTURED_REPLY, &[])?;
    let (h, d) = read_option_reply(s, MAX_HANDSHAKE_REPLY)?;
    let structured = h.reply_type == REP_ACK;
    if !structured && h.reply_type & REP_FLAG_ERROR == 0 {
        return Err(refused(&h, &d));
    }
    send_option(s, OPT_GO, &encode_info_request(export, &[INFO_BLOCK_SIZE]))?;
    let mut info = ExportInfo {
        size: 0,
        flags: 0,
        structured,
        max_payload: MAX_PAYLOAD,
    };
    let mut got_export = false;
    loop {
        let (h, d) = read_option_reply(s, MAX_HANDSHAKE_REPLY)?;
        match h.reply_type {
            REP_INFO => match decode_info(&d)? {
                Info::Export { size, flags } => {
                    info.size = size;
                    info.flags = flags;
                    got_export = true;
                }
                Info::BlockSize { max, .. } => info.max_payload = max.clamp(512, MAX_PAYLOAD),
                Info::Other(_) => {}
            },
            REP_ACK if got_export => return Ok(info),
            REP_ACK => {
                return Err(ClientError::Unexpected(
                    "NBD_OPT_GO acked without export info",
                ))
            }
            REP_ERR_UNSUP => {
                // An old server: fall back to NBD_OPT_EXPORT_NAME.
                send_option(s, OPT_EXPORT_NAME, export.as_bytes())?;
                let mut b = [0u8; 10];
                s.read_exact(&mut b)?;
                if !no_zeroes {
                    let mut z = [0u8; 124];
                    s.read_exact(&mut z)?;
                }
                info.size = be64(&b, 0);
                info.flags = u16::from_be_bytes([b[8], b[9]]);
                return Ok(info);
            }
            _ => return Err(refused(&h, &d)),
        }
    }
}

/// Asks a kemari target for an export's per-group access counters
/// (the `NBD_OPT_KEMARI_ACCESS_COUNTS` extension) without entering transmission.
pub fn query_access_counts(url: &NbdUrl) -> Result<AccessCounts> {
    let mut s = Stream::connect(&url.addr, HANDSHAKE_TIMEOUT)?;
    within(&s, HANDSHAKE_TIMEOUT, greet)?;
    s.set_timeouts(Some(HANDSHAKE_TIMEOUT))?;
    let mut d = (url.export.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(url.export.as_bytes());
    send_option(&mut s, OPT_KEMARI_ACCESS_COUNTS, &d)?;
    let (h, d) = read_option_reply(&mut s, MAX_ACCESS_COUNTS_REPLY)?;
    if h.reply_type != REP_KEMARI_ACCESS_COUNTS {
        return Err(refused(&h, &d));
    }
    let counts = AccessCounts::decode(&d)?;
    let _ = read_option_reply(&mut s, MAX_HANDSHAKE_REPLY);
    let _ = send_option(&mut s, OPT_ABORT, &[]);
    s.shutdown();
    Ok(counts)
}

/// Runs `step` on `s` with `timeout` on each read and write, then clears
/// it; a step that timed out is said as such.
fn within<T>(
    s: &Stream,
    timeout: Duration,
    step: impl FnOnce(&mut Stream) -> Result<T>,
) -> Result<T> {
    s.set_timeouts(Some(timeout))?;
    let mut own = s.try_clone()?;
    match step(&mut own) {
        Err(ClientError::Io(e))
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Err(ClientError::HandshakeTimeout {
                secs: timeout.as_secs().max(1),
            })
        }
        r => {
            s.set_timeouts(None)?;
            r
        }
    }
}

struct Pending {
    /// Expected data length for reads (0 for other commands).
    len: usize,
    tx: SyncSender<Result<Vec<u8>>>,
    /// The structured reply so far.
    reply: ReplyAssembly,
}

struct Shared {
    pending: Mutex<HashMap<u64, Pending>>,
    closed: AtomicBool,
}

/// A connection to one export.
pub struct Client {
    writer: Mutex<BufWriter<Stream>>,
    shared: Arc<Shared>,
    cookie: AtomicU64,
    info: ExportInfo,
    url: NbdUrl,
    receiver: Option<std::thread::JoinHandle<()>>,
    shutdown_handle: Stream,
}

/// A submitted request; `wait` returns the data of a read (empty otherwise).
pub struct Ticket {
    rx: Receiver<Result<Vec<u8>>>,
}

impl Ticket {
    pub fn wait(self) -> Result<Vec<u8>> {
        self.rx.recv().unwrap_or(Err(ClientError::Closed))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Client {
    /// Connects to `url` (see [`parse_url`]).
    pub fn connect(url: &str) -> Result<Client> {
        Self::connect_url(&parse_url(url)?)
    }

    /// Connects to `url`; connecting and the handshake may take
    /// [`HANDSHAKE_TIMEOUT`].
    pub fn connect_url(url: &NbdUrl) -> Result<Client> {
        Self::connect_within(url, HANDSHAKE_TIMEOUT)
    }

    /// [`connect_url`](Self::connect_url) with its own time-out.
    pub fn connect_within(url: &NbdUrl, timeout: Duration) -> Result<Client> {
        let s = Stream::connect(&url.addr, timeout)?;
        let info = within(&s, timeout, |s| negotiate(s, &url.export))?;
        let r = s.try_clone()?;
        let shutdown_handle = s.try_clone()?;
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
        });
        let sh = shared.clone();
        let receiver = std::thread::Builder::new()
            .name("nbd-client-rx".into())
            .spawn(move || receive_loop(BufReader::with_capacity(256 * 1024, r), &sh))?;
        Ok(Client {
            writer: Mutex::new(BufWriter::with_capacity(64 * 1024, s)),
            shared,
            cookie: AtomicU64::new(1),
            info,
            url: url.clone(),
            receiver: Some(receiver),
            shutdown_handle,
        })
    }

    pub fn url(&self) -> &NbdUrl {
        &self.url
    }
    pub fn size(&self) -> u64 {
        self.info.size
    }
    pub fn read_only(&self) -> bool {
        self.info.flags & TFLAG_READ_ONLY != 0
    }
    pub fn info(&self) -> ExportInfo {
        self.info
    }
    /// Whether the connection has failed or been closed.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    fn check(&self, offset: u64, len: u64) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.info.size) {
            return Err(ClientError::OutOfRange {
                offset,
                len,
                size: self.info.size,
            });
        }
        Ok(())
    }

    /// Sends one request without waiting for its reply.
    pub fn submit(
        &self,
        command: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> Result<Ticket> {
        let (tx, rx) = sync_channel(1);
        let cookie = self.cookie.fetch_add(1, Ordering::Relaxed);
        let rlen = if command == CMD_READ { len as usize } else { 0 };
        {
            let mut w = lock(&self.writer);
            {
                // Checked under the pending lock, which the receiver holds
                // while it marks the connection closed and fails what is
                // pending: a request is either refused here or failed there,
                // never left waiting on a connection that is gone.
                let mut pending = lock(&self.shared.pending);
                if self.is_closed() {
                    return Err(ClientError::Closed);
                }
                pending.insert(
                    cookie,
                    Pending {
                        len: rlen,
                        tx,
                        reply: ReplyAssembly::new(offset, rlen),
                    },
                );
            }
            let req = Request {
                flags,
                command,
                cookie,
                offset,
                len,
            };
            let res = w
                .write_all(&req.encode())
                .and_then(|_| w.write_all(payload))
                .and_then(|_| w.flush());
            if let Err(e) = res {
                lock(&self.shared.pending).remove(&cookie);
                return Err(e.into());
            }
        }
        Ok(Ticket { rx })
    }

    /// Reads `buf.len()` bytes at `offset`, split into requests the server accepts.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len() as u64)?;
        let max = self.info.max_payload as usize;
        let mut tickets = Vec::new();
        for (i, chunk) in buf.chunks(max).enumerate() {
            let off = offset + (i * max) as u64;
            tickets.push(self.submit(CMD_READ, 0, off, chunk.len() as u32, &[])?);
        }
        for (t, chunk) in tickets.into_iter().zip(buf.chunks_mut(max)) {
            let d = t.wait()?;
            chunk.copy_from_slice(&d);
        }
        Ok(())
    }

    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.write_at_flags(offset, data, 0)
    }

    /// Writes with NBD_CMD_FLAG_FUA: durable when this returns.
    pub fn write_at_fua(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.write_at_flags(offset, data, CMD_FLAG_FUA)
    }

    fn write_at_flags(&self, offset: u64, data: &[u8], flags: u16) -> Result<()> {
        self.check(offset, data.len() as u64)?;
        let max = self.info.max_payload as usize;
        let mut tickets = Vec::new();
        for (i, chunk) in data.chunks(max).enumerate() {
            let off = offset + (i * max) as u64;
            tickets.push(self.submit(CMD_WRITE, flags, off, chunk.len() as u32, chunk)?);
        }
        for t in tickets {
            t.wait()?;
        }
        Ok(())
    }

    pub fn flush(&self) -> Result<()> {
        self.submit(CMD_FLUSH, 0, 0, 0, &[])?.wait().map(|_| ())
    }

    pub fn trim(&self, offset: u64, len: u64) -> Result<()> {
        self.ranged(CMD_TRIM, 0, offset, len)
    }

    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.ranged(CMD_WRITE_ZEROES, 0, offset, len)
    }

    fn ranged(&self, cmd: u16, flags: u16, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len)?;
        let max = u64::from(!0xfffu32);
        let mut tickets = Vec::new();
        let mut off = offset;
        while off < offset + len {
            let n = max.min(offset + len - off);
            tickets.push(self.submit(cmd, flags, off, n as u32, &[])?);
            off += n;
        }
        for t in tickets {
            t.wait()?;
        }
        Ok(())
    }

    /// Sends NBD_CMD_DISC and closes the connection.
    pub fn disconnect(mut self) {
        self.close();
    }

    fn close(&mut self) {
        {
            let mut w = lock(&self.writer);
            if !self.is_closed() {
                let req = Request {
                    flags: 0,
                    command: CMD_DISC,
                    cookie: 0,
                    offset: 0,
                    len: 0,
                };
                let _ = w.write_all(&req.encode()).and_then(|_| w.flush());
            }
        }
        self.shared.closed.store(true, Ordering::Release);
        self.shutdown_handle.shutdown();
        if let Some(h) = self.receiver.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.close();
    }
}

fn receive_loop<R: Read>(mut r: R, sh: &Shared) {
    let err = loop {
        match receive_one(&mut r, sh) {
            Ok(()) => {}
            Err(e) => break e,
        }
    };
    let msg = err.to_string();
    let mut pending = lock(&sh.pending);
    sh.closed.store(true, Ordering::Release);
    for (_, p) in pending.drain() {
        let _ = p.tx.send(Err(ClientError::Request {
            errno: ESHUTDOWN,
            message: format!("connection lost: {msg}"),
        }));
    }
}

fn receive_one<R: Read>(r: &mut R, sh: &Shared) -> Result<()> {
    let mut h = [0u8; STRUCTURED_REPLY_HEADER_LEN];
    r.read_exact(&mut h[..4])?;
    let n = reply_header_len(&h[..4])?;
    r.read_exact(&mut h[4..n])?;
    match decode_reply_header(&h[..n])? {
        ReplyHeader::Simple { error, cookie } => {
            let p = lock(&sh.pending)
                .remove(&cookie)
                .ok_or(ClientError::Unexpected("reply to an unknown cookie"))?;
            if error != 0 {
                let _ = p.tx.send(Err(ClientError::Request {
                    errno: error,
                    message: String::new(),
                }));
                return Ok(());
            }
            let mut d = vec![0u8; p.len];
            r.read_exact(&mut d)?;
            let _ = p.tx.send(Ok(d));
        }
        ReplyHeader::Structured {
            flags,
            reply_type,
            cookie,
            len,
        } => {
            let mut payload = vec![0u8; len as usize];
            r.read_exact(&mut payload)?;
            let mut pend = lock(&sh.pending);
            let p = pend.get_mut(&cookie).ok_or(ClientError::Unexpected(
                "structured reply to an unknown cookie",
            ))?;
            p.reply
                .chunk(reply_type, &payload)
                .map_err(|e| ClientError::Unexpected(e.0))?;
            if flags & REPLY_FLAG_DONE != 0 {
                if let Some(p) = pend.remove(&cookie) {
                    let res = p.reply.finish().map_err(|f| ClientError::Request {
                        errno: f.errno,
                        message: f.message,
                    });
                    let _ = p.tx.send(res);
                }
            }
        }
    }
    Ok(())
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = parse_url("nbd://127.0.0.1:10810/disk").unwrap();
        assert_eq!(u.addr, NbdAddr::Tcp("127.0.0.1:10810".into()));
        assert_eq!(u.export, "disk");
        let u = parse_url("nbd://host").unwrap();
        assert_eq!(u.addr, NbdAddr::Tcp("host:10809".into()));
        assert_eq!(u.export, "");
        let u = parse_url("nbd://[::1]:99/x").unwrap();
        assert_eq!(u.addr, NbdAddr::Tcp("[::1]:99".into()));
        let u = parse_url("nbd+unix:///e?socket=/tmp/s.sock").unwrap();
        assert_eq!(u.addr, NbdAddr::Unix("/tmp/s.sock".into()));
        assert_eq!(u.export, "e");
        assert!(parse_url("http://x").is_err());
        assert!(parse_url("nbd://h:port/x").is_err());
        assert!(parse_url("nbd+unix:///e").is_err());
        assert_eq!(parse_url("nbd://h:1/e").unwrap().to_string(), "nbd://h:1/e");
    }

    /// A server that accepts and says nothing: the connect gives up, in
    /// the user's terms.
    #[test]
    fn a_silent_server_ends_the_handshake_with_a_timeout() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = parse_url(&format!("nbd://{}/x", l.local_addr().unwrap())).unwrap();
        let held = std::thread::spawn(move || l.accept().map(|(s, _)| s));
        let t = std::time::Instant::now();
        let e = Client::connect_within(&url, Duration::from_millis(300))
            .err()
            .unwrap();
        assert!(t.elapsed() < Duration::from_secs(10));
        assert!(matches!(e, ClientError::HandshakeTimeout { .. }), "{e:?}");
        assert!(
            e.to_string().contains("did not finish the NBD handshake"),
            "{e}"
        );
        drop(held.join());
    }

    /// A scripted server: the handshake (structured replies, one export of
    /// 1 MiB), then for each request the chunks `answer` gives it.
    fn scripted_server(
        answer: impl Fn(&Request) -> Vec<(u16, u16, Vec<u8>)> + Send + 'static,
    ) -> NbdUrl {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = parse_url(&format!("nbd://{}/x", l.local_addr().unwrap())).unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(&encode_handshake(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))
                .unwrap();
            let mut b = [0u8; 4];
            s.read_exact(&mut b).unwrap();
            for _ in 0..2 {
                let mut h = [0u8; 16];
                s.read_exact(&mut h).unwrap();
                let h = decode_option_header(&h).unwrap();
                let mut d = vec![0u8; h.len as usize];
                s.read_exact(&mut d).unwrap();
                if h.option == OPT_GO {
                    let info = encode_info_export(1 << 20, 0);
                    s.write_all(&encode_option_reply(OPT_GO, REP_INFO, &info))
                        .unwrap();
                }
                s.write_all(&encode_option_reply(h.option, REP_ACK, &[]))
                    .unwrap();
            }
            let mut r = [0u8; REQUEST_LEN];
            while s.read_exact(&mut r).is_ok() {
                let req = Request::decode(&r).unwrap();
                if req.command == CMD_DISC {
                    return;
                }
                for (flags, ty, payload) in answer(&req) {
                    let h = encode_structured_header(flags, ty, req.cookie, payload.len() as u32);
                    s.write_all(&h).unwrap();
                    s.write_all(&payload).unwrap();
                }
            }
        });
        url
    }

    fn data_at(offset: u64, bytes: &[u8]) -> Vec<u8> {
        [&offset.to_be_bytes()[..], bytes].concat()
    }

    #[test]
    fn a_read_the_server_answers_short_fails_and_the_connection_goes_on() {
        let url = scripted_server(|req| {
            let mut data = vec![7u8; req.len as usize];
            if req.offset == 0 {
                // Half the read, then DONE: the rest was never sent.
                data.truncate(data.len() / 2);
            }
            vec![(
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                data_at(req.offset, &data),
            )]
        });
        let c = Client::connect_url(&url).unwrap();
        let mut b = [1u8; 4096];
        let e = c.read_at(0, &mut b).unwrap_err();
        assert!(
            matches!(&e, ClientError::Request { errno: EIO, message } if message.contains("covered 2048 of the 4096")),
            "{e:?}"
        );
        assert!(!c.is_closed());
        c.read_at(8192, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 7));
    }

    #[test]
    fn an_error_chunk_before_done_fails_only_its_request() {
        let url = scripted_server(|req| {
            if req.offset == 0 {
                let err = encode_error_chunk(ENOSPC, "full");
                vec![
                    (0, REPLY_TYPE_ERROR, err),
                    (REPLY_FLAG_DONE, REPLY_TYPE_NONE, Vec::new()),
                ]
            } else {
                let data = vec![3u8; req.len as usize];
                vec![(
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_OFFSET_DATA,
                    data_at(req.offset, &data),
                )]
            }
        });
        let c = Client::connect_url(&url).unwrap();
        let mut b = [0u8; 512];
        let e = c.read_at(0, &mut b).unwrap_err();
        assert!(
            matches!(&e, ClientError::Request { errno: ENOSPC, message } if message == "full"),
            "{e:?}"
        );
        c.read_at(512, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 3));
    }

    #[test]
    fn overlapping_chunks_end_the_connection() {
        let url = scripted_server(|req| {
            vec![
                (0, REPLY_TYPE_OFFSET_DATA, data_at(req.offset, &[1; 300])),
                (
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_OFFSET_DATA,
                    data_at(req.offset + 200, &[2; 312]),
                ),
            ]
        });
        let c = Client::connect_url(&url).unwrap();
        let e = c.read_at(0, &mut [0u8; 512]).unwrap_err();
        assert!(
            e.to_string().contains("overlap") || format!("{e:?}").contains("overlap"),
            "{e:?}"
        );
        assert!(c.is_closed());
    }
}
