//! Just enough HTTP/1.1 for the control API: one request per connection, a
//! Content-Length body, strict size limits. Written here rather than taken from
//! a general-purpose server because the API must never let a client make the
//! VMM allocate or wait without bound (tiny_http, for one, allocates whatever
//! Content-Length a client claims). The parser is fuzzed (`fuzz/`).

use std::io::{BufRead, Read, Write};

/// Longest request line or header line.
pub const MAX_LINE: usize = 8 << 10;
/// Most header lines.
pub const MAX_HEADERS: usize = 64;

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

/// Why a request could not be read; each maps to an HTTP status.
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

impl HttpError {
    /// HTTP status code.
    pub fn status(&self) -> u16 {
        match self {
            HttpError::Malformed(_) | HttpError::Incomplete => 400,
            HttpError::HeaderTooLarge => 431,
            HttpError::BodyTooLarge(_) => 413,
            HttpError::UnsupportedEncoding => 501,
        }
    }
}

fn read_line(r: &mut impl BufRead) -> Result<String, HttpError> {
    let mut buf = Vec::new();
    let n = r
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', &mut buf)
        .map_err(|_| HttpError::Incomplete)?;
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

/// Reads one request, refusing bodies over `max_body` bytes before reading them.
pub fn read_request(r: &mut impl BufRead, max_body: usize) -> Result<HttpRequest, HttpError> {
    let line = read_line(r)?;
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
        let h = read_line(r)?;
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
    let mut body = vec![0; length as usize];
    r.read_exact(&mut body).map_err(|_| HttpError::Incomplete)?;
    Ok(HttpRequest {
        method: method.to_owned(),
        path: path.to_owned(),
        body,
    })
}

/// Writes a complete response with a JSON body and closes the exchange.
pub fn write_response(w: &mut impl Write, status: u16, body: &str) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        _ => "Status",
    };
    write!(
        w,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(b: &[u8]) -> Result<HttpRequest, HttpError> {
        read_request(&mut std::io::BufReader::new(b), 1024)
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

    #[test]
    fn refuses_bad_requests() {
        assert_eq!(parse(b"").unwrap_err(), HttpError::Incomplete);
        assert_eq!(
            parse(b"GET /vm HTTP/1.1\r\n").unwrap_err(),
            HttpError::Incomplete
        );
        assert_eq!(parse(b"\x00\x01garbage\r\n\r\n").unwrap_err().status(), 400);
        assert_eq!(parse(b"GET vm HTTP/1.1\r\n\r\n").unwrap_err().status(), 400);
        assert_eq!(parse(b"GET /vm HTTP/2\r\n\r\n").unwrap_err().status(), 400);
        assert_eq!(
            parse(b"GET /vm HTTP/1.1\r\nNoColon\r\n\r\n")
                .unwrap_err()
                .status(),
            400
        );
        assert_eq!(
            parse(b"PUT / HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n").unwrap_err(),
            HttpError::BodyTooLarge(99_999_999_999)
        );
        assert_eq!(
            parse(b"PUT / HTTP/1.1\r\nContent-Length: -1\r\n\r\n")
                .unwrap_err()
                .status(),
            400
        );
        assert_eq!(
            parse(b"PUT / HTTP/1.1\r\nContent-Length: 10\r\n\r\nshort").unwrap_err(),
            HttpError::Incomplete
        );
        assert_eq!(
            parse(b"PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
                .unwrap_err()
                .status(),
            501
        );
        let long = [
            b"GET /".as_slice(),
            &[b'a'; MAX_LINE + 10],
            b" HTTP/1.1\r\n\r\n",
        ]
        .concat();
        assert_eq!(parse(&long).unwrap_err(), HttpError::HeaderTooLarge);
        let many = [
            b"GET / HTTP/1.1\r\n".as_slice(),
            &b"A: b\r\n".repeat(MAX_HEADERS + 2),
            b"\r\n",
        ]
        .concat();
        assert_eq!(parse(&many).unwrap_err(), HttpError::HeaderTooLarge);
    }

    #[test]
    fn writes_responses() {
        let mut out = Vec::new();
        write_response(&mut out, 409, "{\"error\":\"x\"}").unwrap();
        let s = String::from_utf8(out).unwrap();
        assert!(s.starts_with("HTTP/1.1 409 Conflict\r\n"));
        assert!(s.ends_with("\r\n\r\n{\"error\":\"x\"}"));
    }
}
