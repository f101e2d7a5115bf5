//! Just enough HTTP/1.1 for the control API: one request per connection, a
//! Content-Length body, strict size limits. Written here rather than taken from
//! a general-purpose server because the API must never let a client make the
//! VMM allocate or wait without bound (tiny_http, for one, allocates whatever
//! Content-Length a client claims). The parser is fuzzed (`fuzz/`).
//!
//! The server reads without blocking, so it cannot hand the parser a stream:
//! [`RequestBuffer`] gathers a connection's bytes, finds where the request
//! ends (the empty line, then Content-Length bytes) with a cheap scan, and
//! runs the parser once on a complete request, or as soon as a limit is
//! crossed. Its answer is the parser's on the same bytes (the fuzz target
//! checks that).

use std::io::{BufRead, Read, Write};

/// Longest request line or header line.
pub const MAX_LINE: usize = 8 << 10;
/// Most header lines.
pub const MAX_HEADERS: usize = 64;
/// Longest request head (request line and header lines together).
pub const MAX_HEAD: usize = 32 << 10;

/// A parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpRequest {
    /// Method, as sent.
    pub method: String,
    /// Request target (path and query).
    pub path: String,
    /// Body (at most the limit given to [`read_request`]).
    pub body: Vec<u8>,
}

/// Why a request could not be read; each maps to an HTTP status
/// (`status.rs`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    /// Malformed request line or header.
    #[error("malformed request: {0}")]
    Malformed(&'static str),
    /// A line or the header block is too long.
    #[error("request header too large")]
    HeaderTooLarge,
    /// The body is larger than allowed.
    #[error("request body of {0} bytes is larger than allowed")]
    BodyTooLarge(u64),
    /// Chunked or other transfer encodings are not supported.
    #[error("transfer encodings are not supported; send Content-Length")]
    UnsupportedEncoding,
    /// The connection closed or failed before the request was complete.
    #[error("connection closed before the request was complete")]
    Incomplete,
}

/// Request line and headers.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Head {
    method: String,
    path: String,
    content_length: usize,
}

/// Reads one line, counting its bytes into `head_bytes` (limit [`MAX_HEAD`]).
fn read_line(r: &mut impl BufRead, head_bytes: &mut usize) -> Result<String, HttpError> {
    let mut buf = Vec::new();
    let n = r
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', &mut buf)
        .map_err(|_| HttpError::Incomplete)?;
    *head_bytes += n;
    if *head_bytes > MAX_HEAD {
        return Err(HttpError::HeaderTooLarge);
    }
    if n == 0 {
        return Err(HttpError::Incomplete);
    }
    if !buf.ends_with(b"\n") {
        return Err(if n > MAX_LINE {
            HttpError::HeaderTooLarge
        } else {
            HttpError::Incomplete
        });
    }
    while buf.last().is_some_and(|&b| b == b'\n' || b == b'\r') {
        buf.pop();
    }
    String::from_utf8(buf).map_err(|_| HttpError::Malformed("header is not UTF-8"))
}

/// Reads the request line and headers, refusing a Content-Length over
/// `max_body`.
fn read_head(r: &mut impl BufRead, max_body: usize) -> Result<Head, HttpError> {
    let mut head_bytes = 0;
    let line = read_line(r, &mut head_bytes)?;
    let mut parts = line.split(' ');
    let (Some(method), Some(path), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::Malformed("request line"));
    };
    if method.is_empty()
        || !method
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_lowercase())
    {
        return Err(HttpError::Malformed("method"));
    }
    if !path.starts_with('/') {
        return Err(HttpError::Malformed("request target"));
    }
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err(HttpError::Malformed("HTTP version"));
    }
    let mut length: u64 = 0;
    for i in 0.. {
        if i > MAX_HEADERS {
            return Err(HttpError::HeaderTooLarge);
        }
        let h = read_line(r, &mut head_bytes)?;
        if h.is_empty() {
            break;
        }
        let (name, value) = h.split_once(':').ok_or(HttpError::Malformed("header"))?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = value
                .parse()
                .map_err(|_| HttpError::Malformed("Content-Length"))?;
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(HttpError::UnsupportedEncoding);
        }
    }
    if length > max_body as u64 {
        return Err(HttpError::BodyTooLarge(length));
    }
    Ok(Head {
        method: method.to_owned(),
        path: path.to_owned(),
        // At most `max_body`.
        content_length: length as usize,
    })
}

/// Reads one request, refusing bodies over `max_body` bytes before reading them.
pub fn read_request(r: &mut impl BufRead, max_body: usize) -> Result<HttpRequest, HttpError> {
    let head = read_head(r, max_body)?;
    let mut body = vec![0; head.content_length];
    r.read_exact(&mut body).map_err(|_| HttpError::Incomplete)?;
    Ok(HttpRequest {
        method: head.method,
        path: head.path,
        body,
    })
}

/// What a [`RequestBuffer`] knows after the bytes it was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// More bytes are needed.
    Incomplete,
    /// A complete request (bytes after it are ignored).
    Complete(HttpRequest),
    /// The request is refused.
    Failed(HttpError),
}

/// A connection's bytes until they hold a complete request: at most about
/// [`MAX_HEAD`] + `max_body` bytes, each looked at once before the request is
/// complete.
#[derive(Debug)]
pub struct RequestBuffer {
    bytes: Vec<u8>,
    max_body: usize,
    /// Bytes already scanned for line ends.
    scanned: usize,
    /// Where the current line starts.
    line_start: usize,
    /// Whether the current line holds anything but `\r`.
    line_has_text: bool,
    /// Complete lines so far.
    lines: usize,
    /// Once the head is read: where the request ends.
    end: Option<usize>,
}

impl RequestBuffer {
    /// An empty buffer for a request whose body may hold `max_body` bytes.
    pub fn new(max_body: usize) -> Self {
        RequestBuffer {
            bytes: Vec::new(),
            max_body,
            scanned: 0,
            line_start: 0,
            line_has_text: false,
            lines: 0,
            end: None,
        }
    }

    /// Bytes gathered so far.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether nothing was gathered yet.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Adds bytes that arrived and says whether the request is complete.
    pub fn push(&mut self, data: &[u8]) -> Progress {
        self.bytes.extend_from_slice(data);
        if self.end.is_none() {
            match self.scan_head() {
                Some(Err(e)) => return Progress::Failed(e),
                Some(Ok(end)) => self.end = Some(end),
                None => return Progress::Incomplete,
            }
        }
        match self.end {
            Some(end) if self.bytes.len() >= end => self.parse(end),
            _ => Progress::Incomplete,
        }
    }

    /// The connection ended: the parser's verdict on what arrived.
    pub fn finish(&self) -> Progress {
        let end = self.end.unwrap_or(self.bytes.len()).min(self.bytes.len());
        self.parse(end)
    }

    fn parse(&self, end: usize) -> Progress {
        match read_request(&mut &self.bytes[..end], self.max_body) {
            Ok(request) => Progress::Complete(request),
            Err(e) => Progress::Failed(e),
        }
    }

    /// Scans new bytes for the empty line that ends the head. Returns where
    /// the request ends once the head is complete (the parser read it), an
    /// error once a limit is crossed, `None` while more is needed.
    fn scan_head(&mut self) -> Option<Result<usize, HttpError>> {
        while self.scanned < self.bytes.len() {
            let b = self.bytes[self.scanned];
            self.scanned += 1;
            if b == b'\n' {
                self.lines += 1;
                if !self.line_has_text {
                    return Some(self.read_head_at(self.scanned));
                }
                self.line_start = self.scanned;
                self.line_has_text = false;
                // Request line + one header line more than allowed.
                if self.lines > MAX_HEADERS + 1 {
                    return Some(self.read_head_at(self.scanned));
                }
            } else if b != b'\r' {
                self.line_has_text = true;
            }
        }
        if self.bytes.len() - self.line_start > MAX_LINE || self.bytes.len() > MAX_HEAD {
            return Some(self.read_head_at(self.bytes.len()));
        }
        None
    }

    /// Runs the parser on the first `end` bytes, which hold the whole head or
    /// cross a limit. A head that still reads as incomplete here crossed a
    /// limit the scan saw and the parser did not reach first; it is refused
    /// as too large rather than buffered further.
    fn read_head_at(&self, end: usize) -> Result<usize, HttpError> {
        let mut r = &self.bytes[..end];
        match read_head(&mut r, self.max_body) {
            Ok(head) => Ok(end - r.len() + head.content_length),
            Err(HttpError::Incomplete) => Err(HttpError::HeaderTooLarge),
            Err(e) => Err(e),
        }
    }
}

/// Writes a complete response with a body of `content_type` and closes the
/// exchange.
pub fn write_response(
    w: &mut impl Write,
    status: u16,
    content_type: &str,
    body: &[u8],
) -> std::io::Result<()> {
    w.write_all(&response_bytes(status, content_type, body))?;
    w.flush()
}

/// A complete response with a body of `content_type`, as bytes to send.
pub fn response_bytes(status: u16, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        crate::status::reason(status),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// The head of a response whose body runs until the connection closes (a
/// stream of lines).
pub fn stream_head(content_type: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 {}\r\nContent-Type: {content_type}\r\nConnection: close\r\n\r\n",
        crate::status::reason(200)
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(b: &[u8]) -> Result<HttpRequest, HttpError> {
        read_request(&mut std::io::BufReader::new(b), 1024)
    }

    /// What a buffer fed `b` in pieces of `chunk` bytes says, then at the end.
    fn framed(b: &[u8], chunk: usize) -> Result<HttpRequest, HttpError> {
        let mut buffer = RequestBuffer::new(1024);
        for piece in b.chunks(chunk) {
            match buffer.push(piece) {
                Progress::Incomplete => {}
                Progress::Complete(r) => return Ok(r),
                Progress::Failed(e) => return Err(e),
            }
        }
        match buffer.finish() {
            Progress::Complete(r) => Ok(r),
            Progress::Failed(e) => Err(e),
            Progress::Incomplete => unreachable!("finish always decides"),
        }
    }

    #[test]
    fn parses_requests() {
        let r = parse(b"PUT /vm/pause HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}").unwrap();
        assert_eq!(
            (r.method.as_str(), r.path.as_str(), r.body.as_slice()),
            ("PUT", "/vm/pause", &b"{}"[..])
        );
        let r = parse(b"GET /vm HTTP/1.0\n\n").unwrap();
        assert!(r.body.is_empty());
    }

    fn bad_requests() -> Vec<Vec<u8>> {
        vec![
            b"".to_vec(),
            b"GET /vm HTTP/1.1\r\n".to_vec(),
            b"\x00\x01garbage\r\n\r\n".to_vec(),
            b"GET vm HTTP/1.1\r\n\r\n".to_vec(),
            b"GET /vm HTTP/2\r\n\r\n".to_vec(),
            b"GET /vm HTTP/1.1\r\nNoColon\r\n\r\n".to_vec(),
            b"PUT / HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n".to_vec(),
            b"PUT / HTTP/1.1\r\nContent-Length: -1\r\n\r\n".to_vec(),
            b"PUT / HTTP/1.1\r\nContent-Length: 10\r\n\r\nshort".to_vec(),
            b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(),
            [
                b"GET /".as_slice(),
                &[b'a'; MAX_LINE + 10],
                b" HTTP/1.1\r\n\r\n",
            ]
            .concat(),
            [
                b"GET / HTTP/1.1\r\n".as_slice(),
                &b"A: b\r\n".repeat(MAX_HEADERS + 2),
                b"\r\n",
            ]
            .concat(),
            [
                b"GET / HTTP/1.1\r\n".as_slice(),
                &[b"A: ".as_slice(), &[b'b'; 6000], b"\r\n"]
                    .concat()
                    .repeat(6),
                b"\r\n",
            ]
            .concat(),
        ]
    }

    #[test]
    fn refuses_bad_requests() {
        let statuses: Vec<_> = bad_requests()
            .iter()
            .map(|r| parse(r).unwrap_err())
            .collect();
        use HttpError::*;
        assert_eq!(
            statuses,
            vec![
                Incomplete,
                Incomplete,
                Malformed("request line"),
                Malformed("request target"),
                Malformed("HTTP version"),
                Malformed("header"),
                BodyTooLarge(99_999_999_999),
                Malformed("Content-Length"),
                Incomplete,
                UnsupportedEncoding,
                HeaderTooLarge,
                HeaderTooLarge,
                HeaderTooLarge,
            ]
        );
    }

    #[test]
    fn the_buffer_agrees_with_the_parser_in_any_pieces() {
        let good =
            b"PUT /vm/pause HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}trailing".to_vec();
        let mut all = bad_requests();
        all.push(good);
        all.push(b"GET /vm HTTP/1.0\n\r\n".to_vec());
        all.push(b"\r\n\r\n".to_vec());
        for request in &all {
            for chunk in [1, 3, 7, 4096] {
                assert_eq!(
                    framed(request, chunk),
                    parse(request),
                    "{:?} in pieces of {chunk}",
                    String::from_utf8_lossy(&request[..request.len().min(80)])
                );
            }
        }
    }

    #[test]
    fn the_buffer_decides_a_long_line_without_waiting_for_its_end() {
        let mut buffer = RequestBuffer::new(1024);
        assert_eq!(buffer.push(b"GET /"), Progress::Incomplete);
        assert_eq!(
            buffer.push(&[b'a'; MAX_LINE]),
            Progress::Failed(HttpError::HeaderTooLarge)
        );
        let mut buffer = RequestBuffer::new(1024);
        assert_eq!(
            buffer.push(b"PUT / HTTP/1.1\r\nContent-Length: 2000\r\n\r\n"),
            Progress::Failed(HttpError::BodyTooLarge(2000))
        );
    }

    #[test]
    fn writes_responses() {
        let mut out = Vec::new();
        write_response(&mut out, 409, "application/json", b"{\"error\":\"x\"}").unwrap();
        let s = String::from_utf8(out).unwrap();
        assert!(s.starts_with("HTTP/1.1 409 Conflict\r\n"));
        assert!(s.ends_with("\r\n\r\n{\"error\":\"x\"}"));
    }
}
