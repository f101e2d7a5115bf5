//! Parsing of the HTTP requests the guest's small web server answers
//! (network input: kept pure and tested on the host).

/// What a request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `GET /`: the request counter and uptime.
    Status,
    /// `GET /bytes/<n>`: n pattern bytes.
    Bytes(u64),
    /// `GET /reboot`: answered, then the guest resets.
    Reboot,
    /// A GET of any other path.
    NotFound,
    /// Any other method, or a request line that is not one.
    BadMethod,
}

/// Length of the request head (through the blank line), once complete.
/// Accepts bare `\n` line ends too.
pub fn head_end(req: &[u8]) -> Option<usize> {
    let crlf = req.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4);
    let lf = req.windows(2).position(|w| w == b"\n\n").map(|p| p + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Routes a request by its first line (`<method> <path> <version>`).
pub fn route(head: &[u8]) -> Route {
    let line = head.split(|&b| b == b'\n').next().unwrap_or(&[]);
    let line = core::str::from_utf8(line).unwrap_or("").trim_end();
    let mut parts = line.split(' ');
    if parts.next() != Some("GET") {
        return Route::BadMethod;
    }
    match parts.next().unwrap_or("") {
        "/" => Route::Status,
        "/reboot" => Route::Reboot,
        path => match path.strip_prefix("/bytes/").map(crate::num::parse_u64) {
            Some(Some(n)) => Route::Bytes(n),
            _ => Route::NotFound,
        },
    }
}

/// Byte `i` of a `/bytes/<n>` body.
pub fn pattern_byte(i: u64) -> u8 {
    b'a' + (i % 26) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), Some(27));
        assert_eq!(head_end(b"GET / HTTP/1.0\n\n"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
        assert_eq!(head_end(b""), None);
    }

    #[test]
    fn routes() {
        assert_eq!(route(b"GET / HTTP/1.1\r\n\r\n"), Route::Status);
        assert_eq!(
            route(b"GET /bytes/1048576 HTTP/1.1\r\n"),
            Route::Bytes(1 << 20)
        );
        assert_eq!(route(b"GET /bytes/0 HTTP/1.0\n"), Route::Bytes(0));
        assert_eq!(route(b"GET /bytes/ HTTP/1.1\r\n"), Route::NotFound);
        assert_eq!(route(b"GET /bytes/-1 HTTP/1.1\r\n"), Route::NotFound);
        assert_eq!(
            route(b"GET /bytes/99999999999999999999999 HTTP/1.1\r\n"),
            Route::NotFound
        );
        assert_eq!(route(b"GET /other HTTP/1.1\r\n"), Route::NotFound);
        assert_eq!(route(b"GET /reboot HTTP/1.1\r\n\r\n"), Route::Reboot);
        assert_eq!(route(b"GET /reboot/now HTTP/1.1\r\n"), Route::NotFound);
        assert_eq!(route(b"POST / HTTP/1.1\r\n"), Route::BadMethod);
        assert_eq!(route(b"\xff\xfe garbage"), Route::BadMethod);
        assert_eq!(route(b""), Route::BadMethod);
    }

    #[test]
    fn pattern() {
        assert_eq!(pattern_byte(0), b'a');
        assert_eq!(pattern_byte(25), b'z');
        assert_eq!(pattern_byte(26), b'a');
    }
}
