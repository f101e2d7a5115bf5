//! `--metrics-listen ADDR`: `GET /metrics` over TCP for a Prometheus server
//! that cannot reach a Unix socket (kemari's API socket, kemari-nbd's
//! control socket). The caller says how to render the exposition.
//!
//! One thread, one connection at a time, one request per connection: a
//! scrape is a few kilobytes built in microseconds, so nothing queues for
//! long. A client has [`DEADLINE`] to send its request head (at most
//! [`MAX_REQUEST`] bytes, no body) and to read the answer; then it is
//! dropped. Only `GET /metrics` is served (404 elsewhere, 405 for another
//! method). The socket is bound at start-up; the caller may confine the
//! thread as it starts (kemari: the API threads' seccomp filter).

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::http::{response_bytes, Progress, RequestBuffer};

/// Renders the exposition at each scrape: its content type and its text.
pub type Render = Arc<dyn Fn() -> (&'static str, String) + Send + Sync>;

/// How long one client may take to send its request and to read the answer.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// Largest request accepted (its head; a body is refused).
pub const MAX_REQUEST: usize = 8 << 10;

/// Why the listener could not start.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// The address cannot be bound.
    #[error("cannot listen for metrics on {addr} (--metrics-listen): {cause}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        cause: io::Error,
    },
    /// The thread cannot be started.
    #[error("cannot start the metrics listener's thread: {0}")]
    Thread(#[source] io::Error),
}

/// A bound listener, not serving yet.
#[derive(Debug)]
pub struct MetricsListener {
    listener: TcpListener,
}

impl MetricsListener {
    /// Binds `addr` (`host:port`).
    pub fn bind(addr: &str) -> Result<Self, ListenError> {
        let listener = TcpListener::bind(addr).map_err(|cause| ListenError::Bind {
            addr: addr.to_owned(),
            cause,
        })?;
        Ok(MetricsListener { listener })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves what `render` says on a thread of its own (`metrics`), for
    /// the rest of the process's life; the thread first runs `confine`.
    pub fn serve(
        self,
        render: Render,
        confine: impl FnOnce() + Send + 'static,
    ) -> Result<(), ListenError> {
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || {
                confine();
                for stream in self.listener.incoming() {
                    match stream {
                        Ok(s) => {
                            if let Err(e) = answer(s, &render) {
                                tracing::debug!(error = %e, "metrics: a client failed");
                            }
                        }
                        // Out of descriptors, a connection reset before
                        // accept: the next one may do.
                        Err(e) => {
                            tracing::debug!(error = %e, "metrics: accept failed");
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                }
            })
            .map_err(ListenError::Thread)?;
        Ok(())
    }
}

/// Reads one request from `s` and answers it.
fn answer(mut s: TcpStream, render: &Render) -> io::Result<()> {
    let deadline = Instant::now() + DEADLINE;
    let (status, content_type, body) = match read_request(&mut s, deadline)? {
        Err(status) => (status, "text/plain", Vec::new()),
        Ok((method, path)) => {
            let path = path.split_once('?').map_or(path.as_str(), |(p, _)| p);
            if path != "/metrics" {
                (
                    404,
                    "text/plain",
                    b"only /metrics is served here\n".to_vec(),
                )
            } else if !method.eq_ignore_ascii_case("GET") {
                (405, "text/plain", b"only GET is allowed\n".to_vec())
            } else {
                let (content_type, text) = render();
                (200, content_type, text.into_bytes())
            }
        }
    };
    let remaining = deadline.saturating_duration_since(Instant::now());
    s.set_write_timeout(Some(remaining.max(Duration::from_millis(1))))?;
    s.write_all(&response_bytes(status, content_type, &body))?;
    s.flush()
}

/// The request's method and target, or the status refusing it; an error
/// if the client went away or ran out of time.
fn read_request(s: &mut TcpStream, deadline: Instant) -> io::Result<Result<(String, String), u16>> {
    let mut request = RequestBuffer::new(0);
    let mut buf = [0u8; 1024];
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Ok(Err(408));
        }
        s.set_read_timeout(Some(remaining))?;
        let n = match s.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(Err(408))
            }
            Err(e) => return Err(e),
        };
        let progress = if n == 0 {
            request.finish()
        } else if request.len() + n > MAX_REQUEST {
            return Ok(Err(431));
        } else {
            request.push(&buf[..n])
        };
        match progress {
            Progress::Complete(r) => return Ok(Ok((r.method, r.path))),
            Progress::Failed(e) => return Ok(Err(e.status())),
            Progress::Incomplete if n == 0 => return Ok(Err(400)),
            Progress::Incomplete => {}
        }
    }
}
