//! A minimal HTTP/1.1 client over a Unix socket, for `kemarictl` and tests.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Errors talking to the API.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Cannot connect (no VMM there?).
    #[error("cannot connect to API socket {path}: {source}")]
    Connect {
        /// Socket path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// I/O error during the exchange.
    #[error("API request failed: {0}")]
    Io(#[from] std::io::Error),
    /// The answer is not HTTP/JSON.
    #[error("malformed API response: {0}")]
    Malformed(String),
    /// The VMM answered with an error status.
    #[error("{message} (HTTP {status})")]
    Status {
        /// HTTP status.
        status: u16,
        /// The VMM's message.
        message: String,
    },
}

/// Sends `method path` with an optional JSON body; returns the JSON answer.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> Result<serde_json::Value, ClientError> {
    let mut s = UnixStream::connect(socket).map_err(|source| ClientError::Connect {
        path: socket.display().to_string(),
        source,
    })?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: kemari\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = BufReader::new(s);
    let mut status_line = String::new();
    r.read_line(&mut status_line)?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ClientError::Malformed(status_line.trim().to_owned()))?;
    let mut length = None;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse::<usize>().ok();
            }
        }
    }
    let mut text = Vec::new();
    match length {
        Some(n) => {
            text.resize(n.min(16 << 20), 0);
            r.read_exact(&mut text)?;
        }
        None => {
            r.take(16 << 20).read_to_end(&mut text)?;
        }
    }
    let value: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| ClientError::Malformed(format!("body is not JSON: {e}")))?;
    if !(200..300).contains(&status) {
        let message = value
            .get("error")
            .and_then(|m| m.as_str())
            .unwrap_or("error")
            .to_owned();
        return Err(ClientError::Status { status, message });
    }
    Ok(value)
}
