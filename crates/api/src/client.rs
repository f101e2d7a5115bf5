//! A minimal HTTP/1.1 client over a Unix socket, for `kemarictl`, the
//! benchmarks and tests: [`call`] and [`follow`] speak in [`ApiRequest`]s
//! (through the route table), [`request`] in methods and paths.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::routes::{ApiRequest, EncodeError, Routed};

/// How long an answer (or, when following, the next line) may take.
const READ_TIMEOUT: Duration = Duration::from_secs(120);
/// Largest answer body read.
const MAX_ANSWER: usize = 16 << 20;
/// Longest line of a streamed answer.
const MAX_LINE: usize = 1 << 20;

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
    /// The request cannot be written as HTTP.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// I/O error during the exchange.
    #[error("API request failed: {0}")]
    Io(#[from] std::io::Error),
    /// The answer is not HTTP/JSON.
    #[error("malformed API response: {0}")]
    Malformed(String),
    /// A long operation ended without success (failed or cancelled).
    #[error("{message}")]
    Operation {
        /// "failed" or "cancelled".
        status: String,
        /// Why.
        message: String,
    },
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
    body: Option<&Value>,
) -> Result<Value, ClientError> {
    request_with_timeout(socket, method, path, body, READ_TIMEOUT)
}

/// [`request`], waiting at most `timeout` for each read and write.
pub fn request_with_timeout(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<Value, ClientError> {
    let (status, head, mut r) = send(socket, method, path, body, timeout)?;
    let value = read_json_body(&mut r, head.content_length)?;
    check_status(status, value)
}

/// Asks for `request`; returns the JSON answer (200 or 202).
pub fn call(socket: &Path, request: &ApiRequest) -> Result<Value, ClientError> {
    let call = request.to_http()?;
    self::request(socket, call.method.as_str(), &call.path, call.body.as_ref())
}

/// Asks for `request` with `?follow` and calls `on_line` with each JSON line
/// of the streamed answer as it arrives; returns the last one. An answer
/// that is not a stream (one JSON object) counts as one line.
pub fn follow(
    socket: &Path,
    request: &ApiRequest,
    mut on_line: impl FnMut(&Value),
) -> Result<Value, ClientError> {
    let call = Routed {
        request: request.clone(),
        follow: true,
    }
    .to_http()?;
    let (status, head, mut r) = send(
        socket,
        call.method.as_str(),
        &call.path,
        call.body.as_ref(),
        READ_TIMEOUT,
    )?;
    if !head.ndjson || !(200..300).contains(&status) {
        let value = check_status(status, read_json_body(&mut r, head.content_length)?)?;
        on_line(&value);
        return Ok(value);
    }
    read_lines(&mut r, on_line)?
        .ok_or_else(|| ClientError::Malformed("the stream ended without a line".into()))
}

/// Follows `GET /vm/events` until the VMM ends it (the VMM ends, or this
/// client was too slow for it); `on_line` gets each event as it arrives.
/// No time limit: a VM may have nothing to say for days.
pub fn events(socket: &Path, on_line: impl FnMut(&Value)) -> Result<(), ClientError> {
    let call = ApiRequest::Events.to_http()?;
    let (status, head, mut r) = send(socket, call.method.as_str(), &call.path, None, READ_TIMEOUT)?;
    if !head.ndjson || !(200..300).contains(&status) {
        check_status(status, read_json_body(&mut r, head.content_length)?)?;
        return Err(ClientError::Malformed(
            "the answer to GET /vm/events is not a stream".into(),
        ));
    }
    r.get_ref().set_read_timeout(None)?;
    read_lines(&mut r, on_line)?;
    Ok(())
}

/// Reads a streamed answer's JSON lines to its end, calling `on_line` with
/// each; returns the last.
fn read_lines(
    r: &mut BufReader<UnixStream>,
    mut on_line: impl FnMut(&Value),
) -> Result<Option<Value>, ClientError> {
    let mut last = None;
    loop {
        let mut line = Vec::new();
        let n = (&mut *r)
            .take(MAX_LINE as u64)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            break;
        }
        if !line.ends_with(b"\n") && n == MAX_LINE {
            return Err(ClientError::Malformed(format!(
                "a streamed line is longer than {MAX_LINE} bytes"
            )));
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let value: Value = serde_json::from_slice(&line)
            .map_err(|e| ClientError::Malformed(format!("streamed line is not JSON: {e}")))?;
        on_line(&value);
        last = Some(value);
    }
    Ok(last)
}

/// Runs the long operation `request` starts to its end, following it
/// (`on_line` gets each view of it); returns its final report, or
/// [`ClientError::Operation`] if it failed or was cancelled. A request that
/// is not an operation is simply asked.
pub fn run_operation(
    socket: &Path,
    request: &ApiRequest,
    on_line: impl FnMut(&Value),
) -> Result<Value, ClientError> {
    if !request.is_operation() {
        return call(socket, request);
    }
    let last = follow(socket, request, on_line)?;
    match last["status"].as_str() {
        Some("completed") => Ok(last["result"].clone()),
        Some(status @ ("failed" | "cancelled")) => Err(ClientError::Operation {
            status: status.to_owned(),
            message: last["error"]
                .as_str()
                .unwrap_or("the operation failed")
                .to_owned(),
        }),
        _ => Err(ClientError::Malformed(format!(
            "the VMM ended before the operation did (last seen: {last})"
        ))),
    }
}

/// [`request`], but a long operation is followed to its end (see
/// [`run_operation`]): for callers that speak in methods and paths and want
/// the final report (benchmarks).
pub fn request_to_end(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Value, ClientError> {
    let bytes = body.map(|b| b.to_string()).unwrap_or_default();
    match crate::routes::route(method, path, bytes.as_bytes()) {
        Ok(routed) if routed.request.is_operation() => {
            run_operation(socket, &routed.request, |_| {})
        }
        _ => request(socket, method, path, body),
    }
}

/// What the client needs from a response head.
struct Head {
    content_length: Option<usize>,
    ndjson: bool,
}

/// Sends a request and reads the response's status line and head.
fn send(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<(u16, Head, BufReader<UnixStream>), ClientError> {
    let mut s = UnixStream::connect(socket).map_err(|source| ClientError::Connect {
        path: socket.display().to_string(),
        source,
    })?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
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
    let mut head = Head {
        content_length: None,
        ndjson: false,
    };
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
                head.content_length = v.trim().parse::<usize>().ok();
            } else if k.eq_ignore_ascii_case("content-type") {
                head.ndjson = v.trim().eq_ignore_ascii_case("application/x-ndjson");
            }
        }
    }
    Ok((status, head, r))
}

fn read_json_body(r: &mut impl Read, length: Option<usize>) -> Result<Value, ClientError> {
    let mut text = Vec::new();
    match length {
        Some(n) => {
            text.resize(n.min(MAX_ANSWER), 0);
            r.read_exact(&mut text)?;
        }
        None => {
            r.take(MAX_ANSWER as u64).read_to_end(&mut text)?;
        }
    }
    serde_json::from_slice(&text)
        .map_err(|e| ClientError::Malformed(format!("body is not JSON: {e}")))
}

fn check_status(status: u16, value: Value) -> Result<Value, ClientError> {
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
