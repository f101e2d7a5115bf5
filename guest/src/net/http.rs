//! A small HTTP/1.x server on port 80:
//! - `GET /` answers `requests=<n> uptime_ms=<ms>` (n counts the requests
//!   served since boot, this one included);
//! - `GET /bytes/<N>` answers N bytes, byte i being `b'a' + i % 26`;
//! - `GET /reboot` answers `rebooting`, then the guest resets (once the
//!   answer is acknowledged, or [`REBOOT_GRACE_MS`] after it was queued);
//! - anything else gets 404 (unknown path) or 405 (not GET).
//!
//! Responses carry Content-Length and `Connection: close`; the server waits
//! for the client to close (so it does not sit in TIME-WAIT), and aborts a
//! connection left idle for 10 s.

use alloc::vec::Vec;
use core::fmt::Write;

use guest::httpreq::{head_end, pattern_byte, route, Route};
use smoltcp::iface::{SocketHandle, SocketSet};
use smoltcp::socket::tcp;

use super::HTTP_PORT;

const MAX_REQUEST: usize = 2048;
const IDLE_TIMEOUT_MS: u64 = 10_000;
/// Longest wait after a `/reboot` answer for the client's acknowledgement.
pub const REBOOT_GRACE_MS: u64 = 2_000;

/// A fixed-size text buffer for response heads.
struct Head {
    buf: [u8; 512],
    len: usize,
}

impl Write for Head {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        let end = self.len + s.len();
        if end > self.buf.len() {
            return Err(core::fmt::Error);
        }
        self.buf[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

enum State {
    /// Reading the request head.
    Reading,
    /// Sending `head[sent..]`, then `body_left` pattern bytes.
    Sending { sent: usize, body_sent: u64 },
    /// Response sent; waiting for the client to close.
    Done,
}

struct Conn {
    handle: SocketHandle,
    request: Vec<u8>,
    head: Head,
    body_len: u64,
    state: State,
    last_activity_ms: u64,
}

pub struct Http {
    conns: Vec<Conn>,
    requests: u64,
    /// A `/reboot` was answered on this socket, at this time.
    reboot: Option<(SocketHandle, u64)>,
}

impl Http {
    pub fn new(handles: Vec<SocketHandle>) -> Self {
        let conns = handles
            .into_iter()
            .map(|handle| Conn {
                handle,
                request: Vec::with_capacity(MAX_REQUEST),
                head: Head {
                    buf: [0; 512],
                    len: 0,
                },
                body_len: 0,
                state: State::Reading,
                last_activity_ms: 0,
            })
            .collect();
        Self {
            conns,
            requests: 0,
            reboot: None,
        }
    }

    /// Returns true when it queued data to send.
    pub fn poll(&mut self, sockets: &mut SocketSet<'_>, now_ms: u64) -> bool {
        let mut queued = false;
        for c in &mut self.conns {
            let s = sockets.get_mut::<tcp::Socket>(c.handle);
            if !s.is_open() {
                let _ = s.listen(HTTP_PORT);
                c.request.clear();
                c.state = State::Reading;
                c.last_activity_ms = now_ms;
                continue;
            }
            if !s.is_active() {
                c.last_activity_ms = now_ms; // still listening
                continue;
            }
            if now_ms - c.last_activity_ms > IDLE_TIMEOUT_MS {
                s.abort();
                continue;
            }
            match c.state {
                State::Reading => {
                    let mut chunk = [0u8; 512];
                    while s.can_recv() && c.request.len() < MAX_REQUEST {
                        let room = (MAX_REQUEST - c.request.len()).min(chunk.len());
                        match s.recv_slice(&mut chunk[..room]) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                c.request.extend_from_slice(&chunk[..n]);
                                c.last_activity_ms = now_ms;
                            }
                        }
                    }
                    if let Some(end) = head_end(&c.request) {
                        self.requests += 1;
                        c.head.len = 0;
                        c.body_len = respond(&c.request[..end], &mut c.head, self.requests, now_ms);
                        if route(&c.request[..end]) == Route::Reboot {
                            self.reboot.get_or_insert((c.handle, now_ms));
                        }
                        c.state = State::Sending {
                            sent: 0,
                            body_sent: 0,
                        };
                    } else if c.request.len() >= MAX_REQUEST || peer_closed(s) {
                        s.abort();
                        continue;
                    }
                }
                State::Done => {
                    if !s.may_recv() {
                        s.close();
                    }
                    // Drain whatever else the client sends.
                    let mut sink = [0u8; 512];
                    while let Ok(n) = s.recv_slice(&mut sink) {
                        if n == 0 {
                            break;
                        }
                    }
                }
                State::Sending { .. } => {}
            }
            if let State::Sending {
                mut sent,
                mut body_sent,
            } = c.state
            {
                if sent < c.head.len {
                    if let Ok(n) = s.send_slice(&c.head.buf[sent..c.head.len]) {
                        sent += n;
                        c.last_activity_ms = now_ms;
                    }
                }
                while sent == c.head.len && body_sent < c.body_len && s.can_send() {
                    let left = c.body_len - body_sent;
                    let start = body_sent;
                    let n = s
                        .send(|buf| {
                            let n = (buf.len() as u64).min(left) as usize;
                            for (i, b) in buf[..n].iter_mut().enumerate() {
                                *b = pattern_byte(start + i as u64);
                            }
                            (n, n)
                        })
                        .unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    body_sent += n as u64;
                    c.last_activity_ms = now_ms;
                }
                sent = sent.min(c.head.len);
                c.state = if sent == c.head.len && body_sent == c.body_len {
                    State::Done
                } else {
                    State::Sending { sent, body_sent }
                };
                queued = true;
            }
        }
        queued
    }
}

impl Http {
    /// A `/reboot` was answered and its answer acknowledged (or given up
    /// on): time to reset.
    pub fn reboot_due(&self, sockets: &SocketSet<'_>, now_ms: u64) -> bool {
        let Some((handle, at_ms)) = self.reboot else {
            return false;
        };
        let answered = self.conns.iter().any(|c| {
            c.handle == handle
                && matches!(c.state, State::Done)
                && sockets.get::<tcp::Socket>(handle).send_queue() == 0
        });
        answered || now_ms.saturating_sub(at_ms) > REBOOT_GRACE_MS
    }
}

/// The client closed its side (not merely "not yet established").
fn peer_closed(s: &tcp::Socket<'_>) -> bool {
    matches!(
        s.state(),
        tcp::State::CloseWait | tcp::State::LastAck | tcp::State::Closing | tcp::State::TimeWait
    )
}

/// Writes the response head (and a short body) into `head`; returns the
/// length of the pattern body to stream after it.
fn respond(request: &[u8], head: &mut Head, requests: u64, now_ms: u64) -> u64 {
    let status = |head: &mut Head, code: &str, body: &str| {
        let _ = write!(
            head,
            "HTTP/1.1 {code}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    };
    match route(request) {
        Route::Status => {
            let mut body = Head {
                buf: [0; 512],
                len: 0,
            };
            let _ = writeln!(body, "requests={requests} uptime_ms={now_ms}");
            let text = core::str::from_utf8(&body.buf[..body.len]).unwrap_or("");
            status(head, "200 OK", text);
            0
        }
        Route::Bytes(n) => {
            let _ = write!(
                head,
                "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n"
            );
            n
        }
        Route::Reboot => {
            status(head, "200 OK", "rebooting\n");
            0
        }
        Route::NotFound => {
            status(head, "404 Not Found", "not found\n");
            0
        }
        Route::BadMethod => {
            status(head, "405 Method Not Allowed", "only GET\n");
            0
        }
    }
}
