//! The NBD server: accepts connections (TCP or Unix), negotiates with
//! fixed-newstyle options, then serves pipelined requests against a
//! [`Backend`]. One thread per connection reads requests and answers the fast
//! ones inline (flushing its buffered replies whenever the input runs dry);
//! requests the backend says may block are answered from helper threads, in
//! any order, as NBD allows.

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use thiserror::Error;
use tracing::{debug, info, warn};

use crate::backend::Backend;
use crate::splice::{Pipe, SpliceError};
use nbd_client::page_buf::PageBuf;
use nbd_client::protocol::*;

/// Replies to at most this many blocking requests at once per connection;
/// beyond it, requests are served inline (back-pressure on a hostile client).
const MAX_HELPERS_PER_CONN: usize = 256;
/// Reads and writes at least this large are served on helper threads.
const OFFLOAD_MIN: u32 = 256 * 1024;
/// Worker threads per connection for large transfers.
const LARGE_WORKERS: usize = 4;
/// Writes at least this large are spliced from the socket into the file
/// when the backend allows it (one copy instead of two).
const SPLICE_MIN: u32 = 64 * 1024;
/// How long a connection that has answered everything it had polls its
/// socket for the next request before it sleeps in `read` (see
/// [`await_request`]).
const REQUEST_POLL: std::time::Duration = std::time::Duration::from_micros(50);

type Job = Box<dyn FnOnce() + Send>;

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
}

/// Where to listen: `HOST:PORT` or `unix:PATH`.
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listener {
    pub fn bind(addr: &str) -> io::Result<Listener> {
        if let Some(path) = addr.strip_prefix("unix:") {
            let _ = std::fs::remove_file(path);
            Ok(Listener::Unix(UnixListener::bind(path)?))
        } else {
            Ok(Listener::Tcp(TcpListener::bind(addr)?))
        }
    }
}

/// Serves `exports` on `listener` forever, one thread per connection.
pub fn serve(listener: Listener, exports: Arc<Exports>) -> io::Result<()> {
    loop {
        match &listener {
            Listener::Tcp(l) => {
                let (s, peer) = l.accept()?;
                let _ = s.set_nodelay(true);
                let ex = exports.clone();
                spawn_conn(format!("{peer}"), move || {
                    let r = s.try_clone()?;
                    let fd = r.as_raw_fd();
                    serve_socket(r, s, &ex, Some(fd))
                });
            }
            Listener::Unix(l) => {
                let (s, _) = l.accept()?;
                let ex = exports.clone();
                spawn_conn("unix".to_string(), move || {
                    let r: UnixStream = s.try_clone()?;
                    let fd = r.as_raw_fd();
                    serve_socket(r, s, &ex, Some(fd))
                });
            }
        }
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

/// Runs the handshake and then the transmission phase on one connection.
pub fn serve_connection<R, W>(reader: R, writer: W, exports: &Exports) -> Result<(), ServerError>
where
    R: Read,
    W: Write + Send + 'static,
{
    serve_socket(reader, writer, exports, None)
}

/// [`serve_connection`] where `sock` is the file descriptor `reader` reads
/// from (a socket), so that large writes can be spliced from it.
fn serve_socket<R, W>(
    reader: R,
    writer: W,
    exports: &Exports,
    sock: Option<RawFd>,
) -> Result<(), ServerError>
where
    R: Read,
    W: Write + Send + 'static,
{
    let mut r = BufReader::with_capacity(256 * 1024, reader);
    let mut w = BufWriter::with_capacity(256 * 1024, writer);
    match negotiate(&mut r, &mut w, exports)? {
        Some((export, structured)) => {
            info!(export = %export.name, structured, "client entered transmission");
            transmission(r, w, export.backend.clone(), structured, sock)
        }
        None => Ok(()),
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

fn transmission_flags(b: &dyn Backend) -> u16 {
    let mut f = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_SEND_TRIM
        | TFLAG_SEND_WRITE_ZEROES
        | TFLAG_CAN_MULTI_CONN;
    if b.read_only() {
        f = (f | TFLAG_READ_ONLY) & !(TFLAG_SEND_FUA | TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES);
    }
    f
}

fn opt_reply<W: Write>(w: &mut W, option: u32, ty: u32, data: &[u8]) -> io::Result<()> {
    w.write_all(&encode_option_reply(option, ty, data))
}

/// The option haggling phase. Returns the chosen export, or `None` when the
/// client aborted or went away.
fn negotiate<R: Read, W: Write>(
    r: &mut R,
    w: &mut W,
    exports: &Exports,
) -> Result<Option<(Export, bool)>, ServerError> {
    w.write_all(&encode_handshake(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))?;
    w.flush()?;
    let mut cf = [0u8; 4];
    if !read_exact_or_eof(r, &mut cf)? {
        return Ok(None);
    }
    let cflags = u32::from_be_bytes(cf);
    if cflags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
        return Err(ServerError::ClientFlags(cflags));
    }
    let no_zeroes = cflags & CLIENT_NO_ZEROES != 0;
    let mut structured = false;
    loop {
        w.flush()?;
        let mut hb = [0u8; OPTION_HEADER_LEN];
        if !read_exact_or_eof(r, &mut hb)? {
            return Ok(None);
        }
        let h = match decode_option_header(&hb) {
            Ok(h) => h,
            Err(e @ ProtocolError::TooLong { .. }) => {
                let opt = u32::from_be_bytes([hb[8], hb[9], hb[10], hb[11]]);
                opt_reply(w, opt, REP_ERR_TOO_BIG, b"option too long")?;
                w.flush()?;
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        let mut data = vec![0u8; h.len as usize];
        r.read_exact(&mut data)?;
        let opt = h.option;
        match opt {
            OPT_EXPORT_NAME => {
                let name = decode_export_name(&data)?;
                let Some(ex) = exports.get(&name) else {
                    return Err(ServerError::UnknownExport(name));
                };
                let b = &ex.backend;
                w.write_all(&b.size().to_be_bytes())?;
                w.write_all(&transmission_flags(b.as_ref()).to_be_bytes())?;
                if !no_zeroes {
                    w.write_all(&[0u8; 124])?;
                }
                w.flush()?;
                return Ok(Some((ex.clone(), structured)));
            }
            OPT_ABORT => {
                let _ = opt_reply(w, opt, REP_ACK, &[]);
                let _ = w.flush();
                return Ok(None);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    opt_reply(w, opt, REP_ERR_INVALID, b"NBD_OPT_LIST takes no data")?;
                    continue;
                }
                for name in exports.map.keys() {
                    let mut d = (name.len() as u32).to_be_bytes().to_vec();
                    d.extend_from_slice(name.as_bytes());
                    opt_reply(w, opt, REP_SERVER, &d)?;
                }
                opt_reply(w, opt, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                let req = match decode_info_request(&data) {
                    Ok(req) => req,
                    Err(e) => {
                        opt_reply(w, opt, REP_ERR_INVALID, e.to_string().as_bytes())?;
                        continue;
                    }
                };
                let Some(ex) = exports.get(&req.name) else {
                    opt_reply(w, opt, REP_ERR_UNKNOWN, b"no such export")?;
                    continue;
                };
                let b = &ex.backend;
                opt_reply(
                    w,
                    opt,
                    REP_INFO,
                    &encode_info_export(b.size(), transmission_flags(b.as_ref())),
                )?;
                opt_reply(
                    w,
                    opt,
                    REP_INFO,
                    &encode_info_block_size(1, 4096, MAX_PAYLOAD),
                )?;
                if req.requests.contains(&INFO_NAME) {
                    let mut d = INFO_NAME.to_be_bytes().to_vec();
                    d.extend_from_slice(ex.name.as_bytes());
                    opt_reply(w, opt, REP_INFO, &d)?;
                }
                opt_reply(w, opt, REP_ACK, &[])?;
                if opt == OPT_GO {
                    w.flush()?;
                    return Ok(Some((ex.clone(), structured)));
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    opt_reply(w, opt, REP_ERR_INVALID, b"takes no data")?;
                } else if structured {
                    opt_reply(w, opt, REP_ERR_INVALID, b"already negotiated")?;
                } else {
                    structured = true;
                    opt_reply(w, opt, REP_ACK, &[])?;
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT if !structured => {
                opt_reply(w, opt, REP_ERR_INVALID, b"structured replies first")?;
            }
            OPT_KEMARI_ACCESS_COUNTS => {
                let name = match decode_name_prefixed(&data, "access counts request") {
                    Ok((n, _)) => n,
                    Err(e) => {
                        opt_reply(w, opt, REP_ERR_INVALID, e.to_string().as_bytes())?;
                        continue;
                    }
                };
                match exports.get(&name).and_then(|e| e.backend.access_counts()) {
                    Some(c) => {
                        opt_reply(w, opt, REP_KEMARI_ACCESS_COUNTS, &c.encode())?;
                        opt_reply(w, opt, REP_ACK, &[])?;
                    }
                    None => opt_reply(w, opt, REP_ERR_UNKNOWN, b"no counters for export")?,
                }
            }
            _ => opt_reply(w, opt, REP_ERR_UNSUP, b"unsupported option")?,
        }
    }
}

/// A request's outcome: data for reads, or an errno.
enum Outcome {
    Ok,
    Data(PageBuf),
    Err(u32, &'static str),
}

fn errno_of(e: &io::Error) -> u32 {
    match e.raw_os_error() {
        Some(libc::ENOSPC) => ENOSPC,
        Some(libc::EPERM) | Some(libc::EROFS) => EPERM,
        Some(libc::ENOMEM) => ENOMEM,
        _ => EIO,
    }
}

fn write_reply<W: Write>(
    w: &mut BufWriter<W>,
    structured: bool,
    req: &Request,
    outcome: &Outcome,
) -> io::Result<()> {
    let is_read = req.command == CMD_READ;
    match outcome {
        Outcome::Ok if structured && is_read => w.write_all(&encode_structured_header(
            REPLY_FLAG_DONE,
            REPLY_TYPE_NONE,
            req.cookie,
            0,
        )),
        Outcome::Ok => w.write_all(&encode_simple_reply(0, req.cookie)),
        Outcome::Data(d) if structured => {
            let mut h = [0u8; STRUCTURED_REPLY_HEADER_LEN + 8];
            h[..STRUCTURED_REPLY_HEADER_LEN].copy_from_slice(&encode_structured_header(
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                req.cookie,
                8 + d.len() as u32,
            ));
            h[STRUCTURED_REPLY_HEADER_LEN..].copy_from_slice(&req.offset.to_be_bytes());
            write_header_and_data(w, &h, d)
        }
        Outcome::Data(d) => write_header_and_data(w, &encode_simple_reply(0, req.cookie), d),
        Outcome::Err(e, msg) if structured && is_read => {
            let p = encode_error_chunk(*e, msg);
            w.write_all(&encode_structured_header(
                REPLY_FLAG_DONE,
                REPLY_TYPE_ERROR,
                req.cookie,
                p.len() as u32,
            ))?;
            w.write_all(&p)
        }
        Outcome::Err(e, _) => w.write_all(&encode_simple_reply(*e, req.cookie)),
    }
}

/// Small replies are buffered; a large one goes out as one vectored write
/// (header and data together), after whatever is buffered.
fn write_header_and_data<W: Write>(w: &mut BufWriter<W>, h: &[u8], d: &[u8]) -> io::Result<()> {
    if h.len() + d.len() <= w.capacity() - w.buffer().len() {
        w.write_all(h)?;
        return w.write_all(d);
    }
    w.flush()?;
    let inner = w.get_mut();
    let (mut h, mut d) = (h, d);
    while !h.is_empty() || !d.is_empty() {
        let n = inner.write_vectored(&[io::IoSlice::new(h), io::IoSlice::new(d)])?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let from_h = n.min(h.len());
        h = &h[from_h..];
        d = &d[n - from_h..];
    }
    Ok(())
}

/// Executes one request (a WRITE's payload already read into `payload`).
fn execute(b: &dyn Backend, req: &Request, payload: &[u8], mut buf: PageBuf) -> Outcome {
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let len = u64::from(req.len);
    let res = match req.command {
        CMD_READ => {
            buf.set_len(req.len as usize);
            match b.read_at(&mut buf, req.offset) {
                Ok(()) => return Outcome::Data(buf),
                Err(e) => Err(e),
            }
        }
        CMD_WRITE => b.write_at(payload, req.offset, fua),
        CMD_FLUSH => b.flush(),
        CMD_TRIM => b.trim(req.offset, len),
        CMD_WRITE_ZEROES => b.write_zeroes(req.offset, len, req.flags & CMD_FLAG_NO_HOLE == 0, fua),
        CMD_CACHE => Ok(()),
        _ => return Outcome::Err(EINVAL, "unknown command"),
    };
    match res {
        Ok(()) => Outcome::Ok,
        Err(e) => {
            warn!(command = req.command, offset = req.offset, len = req.len, error = %e, "request failed");
            Outcome::Err(errno_of(&e), "i/o error")
        }
    }
}

/// Checks a request against the export before it runs; `None` when valid.
fn validate(b: &dyn Backend, req: &Request) -> Option<Outcome> {
    let end = req.offset.checked_add(u64::from(req.len));
    let in_range = end.is_some_and(|e| e <= b.size());
    match req.command {
        CMD_READ | CMD_CACHE => {
            if req.len > MAX_PAYLOAD {
                Some(Outcome::Err(EOVERFLOW, "request too large"))
            } else if !in_range {
                Some(Outcome::Err(EINVAL, "range beyond end of export"))
            } else {
                None
            }
        }
        CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES => {
            if b.read_only() {
                Some(Outcome::Err(EPERM, "export is read-only"))
            } else if !in_range {
                Some(Outcome::Err(ENOSPC, "range beyond end of export"))
            } else {
                None
            }
        }
        CMD_FLUSH => None,
        _ => Some(Outcome::Err(EINVAL, "unknown command")),
    }
}

struct Helpers {
    count: Mutex<usize>,
    idle: Condvar,
    active: AtomicUsize,
    /// Recycled data buffers (so large transfers do not allocate and zero
    /// a fresh buffer per request; a [`PageBuf`] grows without a memset).
    pool: Mutex<Vec<PageBuf>>,
}

impl Helpers {
    fn take(&self) -> PageBuf {
        lock(&self.pool).pop().unwrap_or_default()
    }
    fn give(&self, b: PageBuf) {
        let mut p = lock(&self.pool);
        if p.len() < 32 && b.capacity() > 0 {
            p.push(b);
        }
    }
}

/// Reads and discards `n` bytes of the request stream.
fn discard<R: Read>(r: &mut BufReader<R>, n: u64) -> io::Result<()> {
    let got = io::copy(&mut r.take(n), &mut io::sink())?;
    if got != n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Serves a validated WRITE by moving its payload straight from the socket
/// into the backend's file. `Ok(None)` when the backend has no file (nothing
/// consumed); `Err` when the connection is unusable.
fn write_spliced<R: Read>(
    r: &mut BufReader<R>,
    sock: RawFd,
    pipe: &mut Option<Pipe>,
    splice_ok: &mut bool,
    b: &dyn Backend,
    req: &Request,
) -> io::Result<Option<Outcome>> {
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let len = req.len as usize;
    let mut fatal: Option<io::Error> = None;
    let mut fill = |file: &std::fs::File| -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        // Part of the payload may already sit in the read buffer.
        let head = r.buffer().len().min(len);
        let mut res = file.write_all_at(&r.buffer()[..head], req.offset);
        r.consume(head);
        let rest = len - head;
        if rest == 0 {
            return res;
        }
        let at = req.offset + head as u64;
        if res.is_err() {
            // Stay in step with the client: consume the payload anyway.
            if let Err(e) = discard(r, rest as u64) {
                fatal = Some(e);
            }
            return res;
        }
        if pipe.is_none() && *splice_ok {
            match Pipe::new() {
                Ok(p) => *pipe = Some(p),
                Err(_) => *splice_ok = false,
            }
        }
        if let (Some(p), true) = (pipe.as_ref(), *splice_ok) {
            match p.socket_to_file(sock, file, at, rest) {
                Ok(()) => return Ok(()),
                Err(SpliceError::File(e)) => return Err(e),
                Err(SpliceError::Socket(e)) => {
                    fatal = Some(e);
                    return Err(io::Error::other("client connection failed"));
                }
                Err(SpliceError::Unsupported) => *splice_ok = false,
            }
        }
        // No splice on this socket: read the rest and write it.
        let mut buf = Vec::with_capacity(rest);
        match r.take(rest as u64).read_to_end(&mut buf) {
            Ok(n) if n == rest => {}
            Ok(_) => {
                fatal = Some(io::ErrorKind::UnexpectedEof.into());
                return Err(io::Error::other("client connection failed"));
            }
            Err(e) => {
                fatal = Some(e);
                return Err(io::Error::other("client connection failed"));
            }
        }
        res = file.write_all_at(&buf, at);
        res
    };
    let out = b.write_via_file(req.offset, u64::from(req.len), fua, &mut fill);
    if let Some(e) = fatal {
        return Err(e);
    }
    Ok(out.map(|res| match res {
        Ok(()) => Outcome::Ok,
        Err(e) => {
            warn!(command = req.command, offset = req.offset, len = req.len, error = %e, "request failed");
            Outcome::Err(errno_of(&e), "i/o error")
        }
    }))
}

fn transmission<R, W>(
    mut r: BufReader<R>,
    w: BufWriter<W>,
    backend: Arc<dyn Backend>,
    structured: bool,
    sock: Option<RawFd>,
) -> Result<(), ServerError>
where
    R: Read,
    W: Write + Send + 'static,
{
    let w = Arc::new(Mutex::new(w));
    let helpers = Arc::new(Helpers {
        count: Mutex::new(0),
        idle: Condvar::new(),
        active: AtomicUsize::new(0),
        pool: Mutex::new(Vec::new()),
    });
    let mut buf = PageBuf::new();
    let mut pbuf = PageBuf::new();
    let mut workers: Option<std::sync::mpsc::Sender<Job>> = None;
    let mut pipe: Option<Pipe> = None;
    let mut splice_ok = sock.is_some();
    // After a spliced write the next header is read on its own, so that the
    // read buffer does not swallow (and force a copy of) the next payload.
    let mut exact_header = false;
    let result = loop {
        if r.buffer().is_empty() {
            lock(&w).flush()?;
            // Not while helpers run large transfers: they need the CPU.
            if let (Some(fd), 0) = (sock, helpers.active.load(Ordering::Relaxed)) {
                await_request(fd, REQUEST_POLL);
            }
        }
        let mut hb = [0u8; REQUEST_LEN];
        let got = if exact_header && r.buffer().is_empty() {
            read_exact_or_eof(r.get_mut(), &mut hb)?
        } else {
            read_exact_or_eof(&mut r, &mut hb)?
        };
        if !got {
            break Ok(());
        }
        let req = Request::decode(&hb)?;
        if req.command == CMD_DISC {
            break Ok(());
        }
        exact_header = false;
        if let (Some(fd), true) = (sock, splice_ok) {
            if req.command == CMD_WRITE
                && req.len >= SPLICE_MIN
                && req.len <= MAX_PAYLOAD
                && validate(backend.as_ref(), &req).is_none()
            {
                if let Some(out) = write_spliced(
                    &mut r,
                    fd,
                    &mut pipe,
                    &mut splice_ok,
                    backend.as_ref(),
                    &req,
                )? {
                    write_reply(&mut *lock(&w), structured, &req, &out)?;
                    exact_header = true;
                    continue;
                }
                // The backend cannot take this one in place: buffered path.
            }
        }
        // Only a WRITE needs a payload buffer. Handing a pooled one to any
        // other request would cost a memset of its whole capacity when the
        // (cleared) buffer goes back to the pool.
        let mut payload = if !req.has_payload() {
            PageBuf::new()
        } else if pbuf.capacity() > 0 {
            std::mem::take(&mut pbuf)
        } else {
            helpers.take()
        };
        payload.clear();
        if req.has_payload() {
            if req.len > MAX_PAYLOAD {
                // The payload cannot be skipped safely: answer and hang up.
                let mut g = lock(&w);
                write_reply(
                    &mut *g,
                    structured,
                    &req,
                    &Outcome::Err(EOVERFLOW, "write too large"),
                )?;
                g.flush()?;
                break Err(ProtocolError::TooLong {
                    what: "write payload",
                    len: req.len.into(),
                    limit: MAX_PAYLOAD.into(),
                }
                .into());
            }
            // Within its capacity a PageBuf grows without zeroing.
            payload.set_len(req.len as usize);
            r.read_exact(&mut payload)?;
        }
        if let Some(bad) = validate(backend.as_ref(), &req) {
            write_reply(&mut *lock(&w), structured, &req, &bad)?;
            if payload.capacity() > 0 {
                pbuf = payload;
            }
            continue;
        }
        // Large transfers also go to helpers, so that receiving the next
        // request overlaps with this one's file I/O.
        let large = req.len >= OFFLOAD_MIN && matches!(req.command, CMD_READ | CMD_WRITE);
        if (large || backend.may_block(req.command, req.offset, req.len))
            && helpers.active.load(Ordering::Relaxed) < MAX_HELPERS_PER_CONN
        {
            helpers.active.fetch_add(1, Ordering::Relaxed);
            *lock(&helpers.count) += 1;
            let (b, w2, h2) = (backend.clone(), w.clone(), helpers.clone());
            let blocking = !large;
            let job = move || {
                let out = execute(b.as_ref(), &req, &payload, h2.take());
                {
                    let mut g = lock(&w2);
                    let _ = write_reply(&mut *g, structured, &req, &out).and_then(|_| g.flush());
                }
                h2.give(payload);
                if let Outcome::Data(d) = out {
                    h2.give(d);
                }
                h2.active.fetch_sub(1, Ordering::Relaxed);
                let mut c = lock(&h2.count);
                *c -= 1;
                if *c == 0 {
                    h2.idle.notify_all();
                }
            };
            if blocking {
                // May wait on the network for a long time: its own thread.
                std::thread::spawn(job);
            } else {
                // Large local transfers: a small per-connection worker pool.
                if workers.is_none() {
                    let (tx, rx) = std::sync::mpsc::channel::<Job>();
                    let rx = Arc::new(Mutex::new(rx));
                    for _ in 0..LARGE_WORKERS {
                        let rx = rx.clone();
                        std::thread::spawn(move || loop {
                            let next = lock(&rx).recv();
                            match next {
                                Ok(job) => job(),
                                Err(_) => break,
                            }
                        });
                    }
                    workers = Some(tx);
                }
                if let Some(tx) = &workers {
                    if let Err(e) = tx.send(Box::new(job)) {
                        (e.0)();
                    }
                }
            }
            continue;
        }
        let out = execute(backend.as_ref(), &req, &payload, std::mem::take(&mut buf));
        if payload.capacity() > 0 {
            pbuf = payload;
        }
        write_reply(&mut *lock(&w), structured, &req, &out)?;
        if let Outcome::Data(d) = out {
            buf = d;
        }
    };
    // Let outstanding helper replies go out before the connection closes.
    let mut c = lock(&helpers.count);
    while *c > 0 {
        c = helpers.idle.wait(c).unwrap_or_else(|e| e.into_inner());
    }
    drop(c);
    let _ = lock(&w).flush();
    result
}

/// Polls `fd` for up to `limit` until it is readable. A client with requests
/// in flight sends the next one as soon as a reply lands; a connection that
/// went to sleep in `read` in between has to be woken for it, and on a
/// small VM host that wake-up (an IPI) costs the *client* more CPU time than
/// the request itself. The caller then reads as usual, blocking if nothing
/// came.
fn await_request(fd: RawFd, limit: std::time::Duration) {
    if limit.is_zero() {
        return;
    }
    let start = std::time::Instant::now();
    loop {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call; a zero
        // timeout never blocks.
        if unsafe { libc::poll(&mut p, 1, 0) } != 0 || start.elapsed() >= limit {
            return;
        }
        std::hint::spin_loop();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Feeds `input` to a server session over in-memory streams and returns what
/// it wrote (used by tests and the fuzzers).
pub fn run_session_on_bytes(input: &[u8], exports: &Exports) -> (Vec<u8>, Result<(), ServerError>) {
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
    let res = serve_connection(io::Cursor::new(input.to_vec()), Sink(out.clone()), exports);
    let v = lock(&out).clone();
    (v, res)
}

/// Connects a socket pair to a session thread (tests).
pub fn spawn_unix_session(exports: Arc<Exports>) -> io::Result<UnixStream> {
    let (a, b) = UnixStream::pair()?;
    std::thread::spawn(move || {
        if let Ok(r) = b.try_clone() {
            let _ = serve_connection(r, b, &exports);
        }
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
mod tests {
    use super::*;
    use crate::backend::MemBackend;

    fn exports() -> Exports {
        let mut e = Exports::new();
        e.add("a", Arc::new(MemBackend::new(1 << 20, false)));
        e.add("ro", Arc::new(MemBackend::new(4096, true)));
        e
    }

    fn go(name: &str) -> Vec<u8> {
        let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        v.extend(encode_option(OPT_STRUCTURED_REPLY, &[]));
        v.extend(encode_option(OPT_GO, &encode_info_request(name, &[])));
        v
    }

    #[test]
    fn bad_request_magic_closes_with_error() {
        let mut v = go("a");
        v.extend_from_slice(&[0xde; 28]);
        let (_, r) = run_session_on_bytes(&v, &exports());
        assert!(matches!(r, Err(ServerError::Protocol(_))));
    }

    #[test]
    fn out_of_range_and_read_only_get_errors() {
        let mut v = go("ro");
        let rd = Request {
            flags: 0,
            command: CMD_READ,
            cookie: 1,
            offset: 4000,
            len: 200,
        };
        v.extend(rd.encode());
        let wr = Request {
            command: CMD_WRITE,
            cookie: 2,
            offset: 0,
            len: 4,
            ..rd
        };
        v.extend(wr.encode());
        v.extend([1, 2, 3, 4]);
        let (out, r) = run_session_on_bytes(&v, &exports());
        assert!(r.is_ok(), "{r:?}");
        // Last reply is the simple EPERM reply for the write.
        assert_eq!(&out[out.len() - 16..], &encode_simple_reply(EPERM, 2));
    }

    #[test]
    fn huge_write_is_refused() {
        let mut v = go("a");
        let wr = Request {
            flags: 0,
            command: CMD_WRITE,
            cookie: 3,
            offset: 0,
            len: u32::MAX,
        };
        v.extend(wr.encode());
        let (_, r) = run_session_on_bytes(&v, &exports());
        assert!(r.is_err());
    }

    #[test]
    fn unknown_option_and_meta_context_order() {
        let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        v.extend(encode_option(0x1234, &[]));
        v.extend(encode_option(OPT_SET_META_CONTEXT, &[]));
        v.extend(encode_option(OPT_ABORT, &[]));
        let (out, r) = run_session_on_bytes(&v, &exports());
        assert!(r.is_ok());
        let h = decode_option_reply_header(&out[18..], 1000).unwrap();
        assert_eq!(h.reply_type, REP_ERR_UNSUP);
        let at = 18 + 20 + h.len as usize;
        let h = decode_option_reply_header(&out[at..], 1000).unwrap();
        assert_eq!(h.reply_type, REP_ERR_INVALID);
    }
}
