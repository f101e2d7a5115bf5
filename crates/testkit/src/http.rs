//! Raw HTTP/1.1 exchanges with kemari's and kemari-nbd's endpoints (API
//! socket, control socket, `--metrics-listen`), and a checked `/metrics`
//! scrape.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::promtool::promtool_check;

const PATIENCE: Duration = Duration::from_secs(30);

/// What came back: the status, the head and the body.
pub type Answer = (u16, String, String);

/// A `GET path` request that closes the connection after the answer.
pub fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: kemari\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
}

/// Sends `request` and reads the whole answer.
pub fn exchange(mut s: impl Read + Write, request: &str) -> Answer {
    s.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no end of head: {answer}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line: {head}"));
    (status, head.to_owned(), body.to_owned())
}

/// `request` over a Unix socket (an API or control socket).
pub fn over_unix(socket: &Path, request: &str) -> Answer {
    let s = UnixStream::connect(socket)
        .unwrap_or_else(|e| panic!("connect to {}: {e}", socket.display()));
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    exchange(s, request)
}

/// `request` over TCP to 127.0.0.1:`port` (`--metrics-listen`).
pub fn over_tcp(port: u16, request: &str) -> Answer {
    let s = TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("connect to 127.0.0.1:{port}: {e}"));
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    exchange(s, request)
}

/// A successful scrape's body: status 200, Prometheus' text content type,
/// and an exposition `promtool check metrics` accepts.
pub fn scrape(answer: Answer) -> String {
    let (status, head, body) = answer;
    assert_eq!(status, 200, "{head}\n{body}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    promtool_check(&body);
    body
}
