//! How long `GET /vm` takes while other clients misbehave: connections held
//! open without a request, and clients that send their request one byte at a
//! time. The measurement behind the API's claims (docs/api.md); it works
//! against any server of the API, this one or an older one.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::request_with_timeout;

/// What a probe does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeOptions {
    /// Connections opened first and held without sending anything.
    pub idle_connections: usize,
    /// Clients that each send a request one byte per `slow_interval`, again
    /// whenever the server closes theirs.
    pub slow_clients: usize,
    /// `GET /vm` requests measured, one after the other.
    pub requests: usize,
    /// Pause between two measured requests (default 100 ms).
    pub spacing: Duration,
    /// A measured request that takes longer fails (default 30 s).
    pub request_timeout: Duration,
    /// A slow client's pace (default 1 s per byte).
    pub slow_interval: Duration,
}

impl ProbeOptions {
    /// `requests` measured behind `idle_connections` idle and `slow_clients`
    /// slow clients, with the default pace and timeouts.
    pub fn new(idle_connections: usize, slow_clients: usize, requests: usize) -> Self {
        ProbeOptions {
            idle_connections,
            slow_clients,
            requests,
            spacing: Duration::from_millis(100),
            request_timeout: Duration::from_secs(30),
            slow_interval: Duration::from_secs(1),
        }
    }
}

/// What a probe measured. A failed request counts with the time it took to
/// fail.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LatencyReport {
    /// Median time to a complete answer.
    #[serde(rename = "p50_ms", serialize_with = "milliseconds")]
    pub p50: Duration,
    /// 99th percentile.
    #[serde(rename = "p99_ms", serialize_with = "milliseconds")]
    pub p99: Duration,
    /// Slowest.
    #[serde(rename = "max_ms", serialize_with = "milliseconds")]
    pub max: Duration,
    /// Requests answered with 2xx.
    pub answered: usize,
    /// Requests that failed (error status, timeout, connection refused).
    pub failed: usize,
    /// The first failure's message.
    pub first_error: Option<String>,
    /// Idle connections the probe could open.
    pub idle_opened: usize,
    /// Answers the slow clients received (408s from a server with a request
    /// deadline).
    pub slow_answers: usize,
}

fn milliseconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1000.0)
}

/// Why a probe could not run.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// Nothing to measure.
    #[error("a probe needs at least one request")]
    NoRequests,
    /// A slow client's thread could not start.
    #[error("cannot start a slow client: {0}")]
    Thread(#[source] std::io::Error),
}

/// Measures `GET /vm` on `socket` as `options` say.
pub fn probe(socket: &Path, options: &ProbeOptions) -> Result<LatencyReport, ProbeError> {
    if options.requests == 0 {
        return Err(ProbeError::NoRequests);
    }
    let idle: Vec<UnixStream> = (0..options.idle_connections)
        .filter_map(|_| UnixStream::connect(socket).ok())
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let slow_answers = Arc::new(AtomicUsize::new(0));
    let mut slow = Vec::new();
    for _ in 0..options.slow_clients {
        let (socket, stopped, answers) = (socket.to_owned(), stop.clone(), slow_answers.clone());
        let interval = options.slow_interval;
        let spawned = std::thread::Builder::new()
            .name("slow-client".into())
            .spawn(move || slow_client(&socket, interval, &stopped, &answers));
        match spawned {
            Ok(t) => slow.push(t),
            Err(e) => {
                stop.store(true, Ordering::SeqCst);
                return Err(ProbeError::Thread(e));
            }
        }
    }
    // Let the slow clients connect and start sending.
    std::thread::sleep(options.spacing);
    let mut times = Vec::with_capacity(options.requests);
    let (mut answered, mut first_error) = (0, None);
    for i in 0..options.requests {
        if i > 0 {
            std::thread::sleep(options.spacing);
        }
        let started = Instant::now();
        let result = request_with_timeout(socket, "GET", "/vm", None, options.request_timeout);
        times.push(started.elapsed());
        match result {
            Ok(_) => answered += 1,
            Err(e) => {
                first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    for t in slow {
        let _ = t.join();
    }
    let idle_opened = idle.len();
    drop(idle);
    times.sort();
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize];
    Ok(LatencyReport {
        p50: at(0.5),
        p99: at(0.99),
        max: at(1.0),
        answered,
        failed: options.requests - answered,
        first_error,
        idle_opened,
        slow_answers: slow_answers.load(Ordering::SeqCst),
    })
}

/// Sends `GET /vm` one byte per `interval`, starting again whenever the
/// server answers or closes, until `stop`.
fn slow_client(socket: &PathBuf, interval: Duration, stop: &AtomicBool, answers: &AtomicUsize) {
    const REQUEST: &[u8] = b"GET /vm HTTP/1.1\r\nHost: kemari\r\n\r\n";
    while !stop.load(Ordering::SeqCst) {
        let Ok(mut conn) = UnixStream::connect(socket) else {
            std::thread::sleep(interval);
            continue;
        };
        if conn.set_nonblocking(true).is_err() {
            return;
        }
        for byte in REQUEST {
            if stop.load(Ordering::SeqCst) {
                return;
            }
            if conn.write(std::slice::from_ref(byte)).is_err() {
                break;
            }
            if sleep_until_answered(&mut conn, interval, stop) {
                answers.fetch_add(1, Ordering::SeqCst);
                break;
            }
        }
    }
}

/// Waits `interval` (looking at `stop` often); true if the server answered
/// or closed meanwhile.
fn sleep_until_answered(conn: &mut UnixStream, interval: Duration, stop: &AtomicBool) -> bool {
    let until = Instant::now() + interval;
    let mut buf = [0u8; 512];
    while Instant::now() < until && !stop.load(Ordering::SeqCst) {
        match conn.read(&mut buf) {
            Ok(_) => return true,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(_) => return true,
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}
