//! The server against real clients, with a small handler instead of a VMM:
//! misbehaving clients and slow handlers must not delay anyone else. Bounds
//! on time are generous (a loaded host must not fail them); the claims are
//! measured with `kemari_api::latency` (docs/api.md).

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::{raise_fd_limit, raw_exchange, scratch, Scratch};
use kemari_api::client::{self, ClientError};
use kemari_api::latency::{probe, ProbeOptions};
use kemari_api::{ActionError, ApiRequest, ApiServer, LineStream, Reply, Routed, ServerOptions};
use serde_json::json;

/// What a `GET /vm` may take at most here, whatever else goes on.
const PROMPT: Duration = Duration::from_secs(1);

/// The test handler: `GET /vm` answers at once, `PUT /vm/pause` when the
/// test lets it go ([`TestVmm::release`]) or after `pause_for`, `GET
/// /vm/operation?follow` streams what `streams` hands out, and a few actions
/// answer with each kind of error. The tests wait for a pause to be in its
/// handler ([`TestVmm::wait_paused`]) rather than sleep and hope.
struct TestVmm {
    pause_for: Duration,
    streams: Mutex<Option<mpsc::Receiver<LineStream>>>,
    /// Pauses in their handler so far, and whether they may answer.
    pauses: Mutex<(usize, bool)>,
    changed: Condvar,
}

impl TestVmm {
    /// The pause handler: counted, then held until released or `pause_for`.
    fn pause(&self) {
        let mut p = self.pauses.lock().unwrap();
        p.0 += 1;
        self.changed.notify_all();
        let deadline = Instant::now() + self.pause_for;
        while !p.1 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            p = self.changed.wait_timeout(p, left).unwrap().0;
        }
    }

    /// Waits until `n` pauses are in the handler (a minute at most).
    fn wait_paused(&self, n: usize) {
        let p = self.pauses.lock().unwrap();
        let (p, timeout) = self
            .changed
            .wait_timeout_while(p, Duration::from_secs(60), |p| p.0 < n)
            .unwrap();
        assert!(
            !timeout.timed_out(),
            "{} of {n} pauses reached the handler",
            p.0
        );
    }

    /// Lets every held pause answer.
    fn release(&self) {
        self.pauses.lock().unwrap().1 = true;
        self.changed.notify_all();
    }
}

fn start(path: &Path, options: ServerOptions, vmm: impl Into<Arc<TestVmm>>) -> ApiServer {
    let vmm: Arc<TestVmm> = vmm.into();
    ApiServer::start(
        path,
        options,
        Arc::new(move |routed: Routed| match routed.request {
            ApiRequest::Info => Ok(Reply::Json(json!({ "state": "running" }))),
            ApiRequest::Pause => {
                vmm.pause();
                Ok(Reply::Json(json!({ "state": "paused" })))
            }
            ApiRequest::Snapshot { dir, .. } => Ok(Reply::Accepted(json!({ "snapshot": dir }))),
            ApiRequest::OperationStatus if routed.follow => {
                let streams = vmm.streams.lock().unwrap();
                match streams.as_ref().and_then(|s| s.recv().ok()) {
                    Some(stream) => Ok(Reply::Stream(stream)),
                    None => Err(ActionError::NotFound("no stream".into())),
                }
            }
            ApiRequest::Resume => Err(ActionError::Busy("a migration runs".into())),
            ApiRequest::Shutdown => Err(ActionError::PeerFailed("the successor failed".into())),
            ApiRequest::MigrationCancel => Err(ActionError::Unavailable("ending".into())),
            _ => Err(ActionError::Internal("not in the test".into())),
        }),
    )
    .unwrap()
}

fn test_vmm() -> TestVmm {
    TestVmm {
        pause_for: Duration::from_secs(60),
        streams: Mutex::new(None),
        pauses: Mutex::new((0, false)),
        changed: Condvar::new(),
    }
}

/// Asserts that `result` is an error answer with `status` and a message
/// holding `words`.
fn assert_refused(result: Result<serde_json::Value, ClientError>, status: u16, words: &str) {
    match result {
        Err(ClientError::Status { status: s, message }) if s == status => {
            assert!(message.contains(words), "{message}")
        }
        other => panic!("expected {status}, got {other:?}"),
    }
}

/// `PUT /vm/pause` from a thread of its own.
fn pause_in_background(
    sock: &Path,
) -> std::thread::JoinHandle<Result<serde_json::Value, ClientError>> {
    let sock = sock.to_owned();
    std::thread::spawn(move || client::call(&sock, &ApiRequest::Pause))
}

fn timed_info(sock: &Path) -> Duration {
    let started = Instant::now();
    let info = client::call(sock, &ApiRequest::Info).unwrap();
    assert_eq!(info["state"], "running");
    started.elapsed()
}

/// A client that sends a request one byte per second; returns what the
/// server answered and when.
fn slow_client(sock: &Path) -> std::thread::JoinHandle<(String, Duration)> {
    let mut conn = UnixStream::connect(sock).unwrap();
    std::thread::spawn(move || {
        let started = Instant::now();
        conn.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut answer = Vec::new();
        for byte in b"GET /vm HTTP/1.1\r\nHost: slow\r\n\r\n" {
            if conn.write_all(std::slice::from_ref(byte)).is_err() {
                break;
            }
            let mut buf = [0u8; 1024];
            match conn.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    answer.extend_from_slice(&buf[..n]);
                    break;
                }
                Err(_) => {}
            }
        }
        (
            String::from_utf8_lossy(&answer).into_owned(),
            started.elapsed(),
        )
    })
}

#[test]
fn idle_and_slow_clients_delay_no_one_and_the_slow_one_gets_408() {
    raise_fd_limit();
    let dir = scratch("idle");
    let sock = dir.join("api.sock");
    let options = ServerOptions {
        request_timeout: Duration::from_secs(2),
        ..ServerOptions::default()
    };
    let server = start(&sock, options, test_vmm());
    let idle: Vec<UnixStream> = (0..1000)
        .map(|_| UnixStream::connect(&sock).unwrap())
        .collect();
    let slow = slow_client(&sock);
    std::thread::sleep(Duration::from_millis(200));
    for i in 0..20 {
        let took = timed_info(&sock);
        assert!(took < PROMPT, "GET /vm #{i} took {took:?}");
    }
    let (answer, after) = slow.join().unwrap();
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    assert!(answer.contains("not complete within 2000 ms"), "{answer}");
    assert!(
        after >= Duration::from_millis(1500) && after < Duration::from_secs(10),
        "the slow client was answered after {after:?}"
    );
    // The same, measured by the probe the benchmarks use.
    let report = probe(
        &sock,
        &ProbeOptions {
            spacing: Duration::from_millis(20),
            ..ProbeOptions::new(1000, 1, 20)
        },
    )
    .unwrap();
    assert_eq!(report.answered, 20, "{report:?}");
    assert!(report.max < PROMPT, "{report:?}");
    drop(idle);
    server.shutdown(Duration::from_secs(1));
    assert!(!sock.exists());
}

#[test]
fn a_slow_handler_does_not_delay_another_request() {
    let dir = scratch("slowhandler");
    let sock = dir.join("api.sock");
    let vmm = Arc::new(test_vmm());
    let server = start(&sock, ServerOptions::default(), vmm.clone());
    let pause = pause_in_background(&sock);
    vmm.wait_paused(1);
    for _ in 0..5 {
        timed_info(&sock);
    }
    // Answered while the pause is held in its handler: nothing waited for it.
    assert!(
        !pause.is_finished(),
        "the pause answered before it was released"
    );
    vmm.release();
    assert_eq!(pause.join().unwrap().unwrap()["state"], "paused");
    server.shutdown(Duration::from_secs(1));
}

#[test]
fn handlers_beyond_the_limit_are_refused_with_503() {
    let dir = scratch("handlers");
    let sock = dir.join("api.sock");
    let options = ServerOptions {
        max_handlers: 2,
        ..ServerOptions::default()
    };
    let vmm = Arc::new(test_vmm());
    let server = start(&sock, options, vmm.clone());
    let busy: Vec<_> = (0..2).map(|_| pause_in_background(&sock)).collect();
    vmm.wait_paused(2);
    assert_refused(client::call(&sock, &ApiRequest::Info), 503, "busy");
    vmm.release();
    for b in busy {
        b.join().unwrap().unwrap();
    }
    timed_info(&sock);
    server.shutdown(Duration::from_secs(1));
}

#[test]
fn a_full_server_closes_its_oldest_incomplete_connection_for_a_new_one() {
    let dir = scratch("full");
    let sock = dir.join("api.sock");
    let options = ServerOptions {
        max_connections: 4,
        max_handlers: 2,
        ..ServerOptions::default()
    };
    let server = start(&sock, options, test_vmm());
    let mut idle: Vec<UnixStream> = (0..4)
        .map(|_| UnixStream::connect(&sock).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    timed_info(&sock);
    let oldest = &mut idle[0];
    oldest
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut answer = String::new();
    let _ = oldest.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    assert!(answer.contains("too many connections"), "{answer}");
    server.shutdown(Duration::from_secs(1));
}

#[test]
fn answers_carry_the_status_of_their_kind() {
    let dir = scratch("statuses");
    let sock = dir.join("api.sock");
    let server = start(&sock, ServerOptions::default(), test_vmm());
    let status = |request: ApiRequest| match client::call(&sock, &request) {
        Err(ClientError::Status { status, .. }) => status,
        Ok(_) => 200,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(status(ApiRequest::Resume), 409);
    assert_eq!(status(ApiRequest::Shutdown), 502);
    assert_eq!(status(ApiRequest::MigrationCancel), 503);
    assert_eq!(status(ApiRequest::Metrics), 500);
    let snapshot = ApiRequest::Snapshot {
        dir: "/snap".into(),
        exit: false,
        force: false,
    };
    assert_eq!(client::call(&sock, &snapshot).unwrap()["snapshot"], "/snap");
    let raw = raw_exchange(
        &sock,
        b"PUT /vm/snapshot HTTP/1.1\r\nContent-Length: 12\r\n\r\n{\"dir\":\"/s\"}",
    );
    assert!(raw.starts_with("HTTP/1.1 202 Accepted\r\n"), "{raw}");
    // Refused before any handler: path, method, query, body, HTTP.
    for (bytes, expected) in [
        (&b"GET /nope HTTP/1.1\r\n\r\n"[..], "HTTP/1.1 404 "),
        (b"DELETE /vm HTTP/1.1\r\n\r\n", "HTTP/1.1 405 "),
        (b"GET /vm?verbose HTTP/1.1\r\n\r\n", "HTTP/1.1 400 "),
        (
            b"PUT /vm/pause HTTP/1.1\r\nContent-Length: 5\r\n\r\n{nope",
            "HTTP/1.1 400 ",
        ),
        (
            b"PUT /vm/pause HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n",
            "HTTP/1.1 413 ",
        ),
        (b"GET /vm HTTP/1.1\r\n", "HTTP/1.1 400 "),
    ] {
        let raw = raw_exchange(&sock, bytes);
        assert!(raw.starts_with(expected), "{raw}");
        assert!(raw.contains("\"error\""), "{raw}");
    }
    let raw = raw_exchange(&sock, &vec![b'A'; 1 << 20]);
    assert!(raw.starts_with("HTTP/1.1 431 "), "{raw}");
    server.shutdown(Duration::from_secs(1));
}

type Follower = std::thread::JoinHandle<(Vec<serde_json::Value>, serde_json::Value)>;

/// A server whose `GET /vm/operation?follow` streams what the returned
/// sender sends, and a client following it.
fn follow_a_stream(name: &str) -> (ApiServer, Scratch, mpsc::Sender<String>, Follower) {
    let dir = scratch(name);
    let sock = dir.join("api.sock");
    let (give, streams) = mpsc::channel();
    let vmm = TestVmm {
        streams: Mutex::new(Some(streams)),
        ..test_vmm()
    };
    let server = start(&sock, ServerOptions::default(), vmm);
    let (tx, stream) = LineStream::channel();
    give.send(stream).unwrap();
    let s = sock.clone();
    let follower = std::thread::spawn(move || {
        let mut lines = Vec::new();
        let last =
            client::follow(&s, &ApiRequest::OperationStatus, |v| lines.push(v.clone())).unwrap();
        (lines, last)
    });
    (server, dir, tx, follower)
}

#[test]
fn a_stream_delivers_every_line_in_order() {
    let (server, _dir, tx, follower) = follow_a_stream("stream");
    for i in 0..200 {
        // Pretty JSON: its newlines must not split the line.
        tx.send(serde_json::to_string_pretty(&json!({ "step": i })).unwrap())
            .unwrap();
        if i % 50 == 0 {
            std::thread::sleep(Duration::from_millis(30));
        }
    }
    drop(tx);
    let (lines, last) = follower.join().unwrap();
    let steps: Vec<u64> = lines.iter().map(|v| v["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (0..200).collect::<Vec<_>>());
    assert_eq!(last["step"], 199);
    server.shutdown(Duration::from_secs(1));
}

#[test]
fn the_shutdown_grace_flushes_what_a_stream_was_sent() {
    let (server, dir, tx, follower) = follow_a_stream("grace");
    let sock = dir.join("api.sock");
    tx.send(json!({ "step": "first" }).to_string()).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    for i in 0..1000 {
        tx.send(json!({ "step": i }).to_string()).unwrap();
    }
    tx.send(json!({ "step": "last" }).to_string()).unwrap();
    // The sender lives on: only the shutdown ends the stream.
    let started = Instant::now();
    server.shutdown(Duration::from_secs(2));
    assert!(started.elapsed() < Duration::from_secs(5));
    let (lines, last) = follower.join().unwrap();
    assert_eq!(lines.len(), 1002);
    assert_eq!(last["step"], "last");
    assert!(!sock.exists());
    drop(tx);
}

#[test]
fn an_answer_in_flight_at_shutdown_is_still_written_within_the_grace() {
    let dir = scratch("inflight");
    let sock = dir.join("api.sock");
    let vmm = Arc::new(TestVmm {
        pause_for: Duration::from_millis(300),
        ..test_vmm()
    });
    let server = start(&sock, ServerOptions::default(), vmm.clone());
    let pause = pause_in_background(&sock);
    vmm.wait_paused(1);
    server.shutdown(Duration::from_secs(5));
    assert_eq!(pause.join().unwrap().unwrap()["state"], "paused");

    // An answer not ready within the grace: 503, and the shutdown does not
    // wait for the handler.
    let vmm = Arc::new(test_vmm());
    let server = start(&sock, ServerOptions::default(), vmm.clone());
    let pause = pause_in_background(&sock);
    vmm.wait_paused(1);
    server.shutdown(Duration::from_millis(100));
    // Refused while the handler still holds it (it would for a minute).
    assert_refused(pause.join().unwrap(), 503, "shutting down");
    vmm.release();
}
