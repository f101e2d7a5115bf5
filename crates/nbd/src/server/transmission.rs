//! The transmission phase: pipelined requests against a [`Backend`]. One
//! thread per connection reads requests and answers the fast ones inline
//! (flushing its buffered replies whenever the input runs dry); requests the
//! backend says may block, and large transfers, are answered from helper
//! threads, in any order, as NBD allows.

use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tracing::warn;

use super::read_buf::ReadBuf;
use super::request_poll::RequestPoll;
use super::{lock, read_exact_or_eof, ServerError};
use crate::backend::{Backend, Extent};
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

type Job = Box<dyn FnOnce() + Send>;

/// What the session negotiated that requests depend on.
#[derive(Debug, Clone, Copy)]
pub struct Negotiated {
    pub structured: bool,
    /// The `base:allocation` context's id, if the client selected it.
    pub base_allocation: Option<u32>,
}

/// A request's outcome: data for reads, extents for block status, or an errno.
enum Outcome {
    Ok,
    Data(ReadBuf),
    Extents(u32, Vec<BlockDescriptor>),
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
    crate::metrics::record(req.command, req.len, !matches!(outcome, Outcome::Err(..)));
    let is_read = req.command == CMD_READ;
    // Block status is only ever negotiated with structured replies, and
    // answered with structured chunks, errors included.
    let chunked = is_read || req.command == CMD_BLOCK_STATUS;
    match outcome {
        Outcome::Ok if structured && is_read => w.write_all(&encode_structured_header(
            REPLY_FLAG_DONE,
            REPLY_TYPE_NONE,
            req.cookie,
            0,
        )),
        Outcome::Ok => w.write_all(&encode_simple_reply(0, req.cookie)),
        Outcome::Data(d) => write_data(w, structured, req, d.data()),
        Outcome::Extents(id, d) => write_chunk(
            w,
            REPLY_TYPE_BLOCK_STATUS,
            req.cookie,
            &encode_block_status(*id, d),
        ),
        Outcome::Err(e, msg) if structured && chunked => write_chunk(
            w,
            REPLY_TYPE_ERROR,
            req.cookie,
            &encode_error_chunk(*e, msg),
        ),
        Outcome::Err(e, _) => w.write_all(&encode_simple_reply(*e, req.cookie)),
    }
}

/// A successful READ's reply: one `OFFSET_DATA` chunk, or a simple reply.
fn write_data<W: Write>(
    w: &mut BufWriter<W>,
    structured: bool,
    req: &Request,
    d: &[u8],
) -> io::Result<()> {
    if !structured {
        return write_header_and_data(w, &encode_simple_reply(0, req.cookie), d);
    }
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

/// One final structured chunk with a small payload.
fn write_chunk<W: Write>(
    w: &mut BufWriter<W>,
    reply_type: u16,
    cookie: u64,
    payload: &[u8],
) -> io::Result<()> {
    w.write_all(&encode_structured_header(
        REPLY_FLAG_DONE,
        reply_type,
        cookie,
        payload.len() as u32,
    ))?;
    w.write_all(payload)
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
fn execute(
    b: &dyn Backend,
    neg: Negotiated,
    req: &Request,
    payload: &[u8],
    buf: PageBuf,
) -> Outcome {
    let fua = req.flags & CMD_FLAG_FUA != 0;
    let len = u64::from(req.len);
    let res = match req.command {
        CMD_READ => {
            let mut buf = ReadBuf::from(buf);
            match b.read_at(buf.fill(req.len as usize, req.offset), req.offset) {
                Ok(()) => return Outcome::Data(buf),
                Err(e) => Err(e),
            }
        }
        CMD_WRITE => b.write_at(payload, req.offset, fua),
        CMD_FLUSH => b.flush(),
        CMD_TRIM => b.trim(req.offset, len),
        CMD_WRITE_ZEROES => b.write_zeroes(req.offset, len, req.flags & CMD_FLAG_NO_HOLE == 0, fua),
        CMD_CACHE => Ok(()),
        CMD_BLOCK_STATUS => match neg.base_allocation {
            Some(id) => return block_status(b, id, req),
            None => return Outcome::Err(EINVAL, "no metadata context negotiated"),
        },
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

/// Answers NBD_CMD_BLOCK_STATUS for `base:allocation`: the allocation of
/// the range from its offset on (at most [`MAX_BLOCK_STATUS_DESCRIPTORS`]
/// extents, one with `REQ_ONE`; covering less than asked is allowed).
fn block_status(b: &dyn Backend, id: u32, req: &Request) -> Outcome {
    let max = if req.flags & CMD_FLAG_REQ_ONE != 0 {
        1
    } else {
        MAX_BLOCK_STATUS_DESCRIPTORS
    };
    match b.extents(req.offset, u64::from(req.len), max) {
        Ok(extents) => {
            let d: Vec<BlockDescriptor> = extents
                .iter()
                .filter(|e| e.len > 0)
                .take(max)
                .map(|e: &Extent| BlockDescriptor {
                    // Within the request, whose length is a u32.
                    len: e.len.min(u64::from(req.len)) as u32,
                    flags: if e.hole { STATE_HOLE | STATE_ZERO } else { 0 },
                })
                .collect();
            if d.is_empty() {
                // A backend must describe at least the first byte.
                return Outcome::Extents(
                    id,
                    vec![BlockDescriptor {
                        len: req.len,
                        flags: 0,
                    }],
                );
            }
            Outcome::Extents(id, d)
        }
        Err(e) => {
            warn!(offset = req.offset, len = req.len, error = %e, "block status failed");
            Outcome::Err(errno_of(&e), "i/o error")
        }
    }
}

/// Checks a request against the export before it runs; `None` when valid.
fn validate(b: &dyn Backend, neg: Negotiated, req: &Request) -> Option<Outcome> {
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
        CMD_BLOCK_STATUS => {
            if neg.base_allocation.is_none() {
                Some(Outcome::Err(EINVAL, "no metadata context negotiated"))
            } else if req.len == 0 || !in_range {
                Some(Outcome::Err(EINVAL, "range empty or beyond end of export"))
            } else {
                None
            }
        }
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

pub fn transmission<R, W>(
    mut r: BufReader<R>,
    w: BufWriter<W>,
    backend: Arc<dyn Backend>,
    neg: Negotiated,
    sock: Option<RawFd>,
) -> Result<(), ServerError>
where
    R: Read,
    W: Write + Send + 'static,
{
    let structured = neg.structured;
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
    let mut poll = RequestPoll::default();
    let mut splice_ok = sock.is_some();
    // After a spliced write the next header is read on its own, so that the
    // read buffer does not swallow (and force a copy of) the next payload.
    let mut exact_header = false;
    let result = loop {
        if r.buffer().is_empty() {
            lock(&w).flush()?;
            // Not while helpers run large transfers: they need the CPU.
            if let (Some(fd), 0) = (sock, helpers.active.load(Ordering::Relaxed)) {
                poll.wait(fd);
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
                && validate(backend.as_ref(), neg, &req).is_none()
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
        if let Some(bad) = validate(backend.as_ref(), neg, &req) {
            write_reply(&mut *lock(&w), structured, &req, &bad)?;
            if payload.capacity() > 0 {
                pbuf = payload;
            }
            continue;
        }
        // Large transfers also go to helpers, so that receiving the next
        // request overlaps with this one's file I/O — unless a read's data
        // is all in the page cache: then there is no I/O to overlap, and
        // handing it over would cost two thread wake-ups.
        let large = req.len >= OFFLOAD_MIN && matches!(req.command, CMD_READ | CMD_WRITE);
        if large && req.command == CMD_READ {
            let mut rb = ReadBuf::from(std::mem::take(&mut buf));
            let cached = backend.read_cached(rb.fill(req.len as usize, req.offset), req.offset);
            if cached {
                crate::metrics::record(req.command, req.len, true);
                write_data(&mut *lock(&w), structured, &req, rb.data())?;
            }
            buf = rb.into_inner();
            if cached {
                if payload.capacity() > 0 {
                    pbuf = payload;
                }
                continue;
            }
        }
        if (large || backend.may_block(req.command, req.offset, req.len))
            && helpers.active.load(Ordering::Relaxed) < MAX_HELPERS_PER_CONN
        {
            helpers.active.fetch_add(1, Ordering::Relaxed);
            *lock(&helpers.count) += 1;
            let (b, w2, h2) = (backend.clone(), w.clone(), helpers.clone());
            let blocking = !large;
            let job = move || {
                let out = execute(b.as_ref(), neg, &req, &payload, h2.take());
                {
                    let mut g = lock(&w2);
                    let _ = write_reply(&mut *g, structured, &req, &out).and_then(|_| g.flush());
                }
                h2.give(payload);
                if let Outcome::Data(d) = out {
                    h2.give(d.into_inner());
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
        let out = execute(
            backend.as_ref(),
            neg,
            &req,
            &payload,
            std::mem::take(&mut buf),
        );
        if payload.capacity() > 0 {
            pbuf = payload;
        }
        write_reply(&mut *lock(&w), structured, &req, &out)?;
        if let Outcome::Data(d) = out {
            buf = d.into_inner();
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
