//! The server's event loop: one thread owns the listener and every
//! connection, all non-blocking. A connection is read until its request is
//! complete (or refused), handed to a handler thread, and its answer written
//! back here; a streamed answer is handed to a stream thread.
//!
//! ```text
//!   Reading ──complete, routed──► Handling ──answer──► Writing ──► closed
//!      │                          (not polled)   └─stream──► stream thread
//!      └──refused (4xx, 503)──────────────────────────► Writing
//!   deadline while Reading: 408, closed;  while Writing: closed
//! ```

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::stream::Streams;
use super::{Handler, ServerOptions, Stop};
use crate::http::{response_bytes, HttpRequest, Progress, RequestBuffer};
use crate::reply::{ActionError, Reply};
use crate::routes::{route, MAX_BODY};
use crate::status::{self, Refusal};

const LISTENER: u64 = 0;
const WAKE: u64 = 1;
const FIRST_CONNECTION: u64 = 2;
/// Connections accepted per wake-up, so that a flood of them does not hold
/// the other events back.
const ACCEPT_BATCH: usize = 64;
/// How long the listener rests when the process is out of file descriptors
/// and no connection can be closed for a new one.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// A handler's answer for a connection.
struct Done {
    conn: u64,
    answer: Result<Reply, ActionError>,
}

enum State {
    Reading(RequestBuffer),
    Handling,
    Writing { out: Vec<u8>, written: usize },
}

struct Conn {
    stream: UnixStream,
    state: State,
    /// Reading: the request's deadline; Writing: the answer's.
    deadline: Instant,
    /// Whether the socket is in the epoll set.
    polled: bool,
}

pub(super) struct EventLoop {
    epoll: Epoll,
    listener: UnixListener,
    /// Not polled until this time (out of file descriptors).
    listener_rests_until: Option<Instant>,
    wake: Arc<EventFd>,
    stop: Arc<Stop>,
    options: ServerOptions,
    handler: Handler,
    /// By id, which grows with accept time: the first is the oldest.
    conns: BTreeMap<u64, Conn>,
    next_id: u64,
    handlers: usize,
    done_tx: Sender<Done>,
    done_rx: Receiver<Done>,
    streams: Arc<Streams>,
}

fn error_body(message: &impl std::fmt::Display) -> Vec<u8> {
    json_body(&serde_json::json!({ "error": message.to_string() }))
}

fn json_body(value: &serde_json::Value) -> Vec<u8> {
    let mut text = serde_json::to_string_pretty(value).unwrap_or_default();
    text.push('\n');
    text.into_bytes()
}

impl EventLoop {
    pub(super) fn new(
        listener: UnixListener,
        wake: Arc<EventFd>,
        stop: Arc<Stop>,
        options: ServerOptions,
        handler: Handler,
        streams: Arc<Streams>,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, LISTENER),
        )?;
        epoll.ctl(
            ControlOperation::Add,
            wake.as_raw_fd(),
            EpollEvent::new(EventSet::IN, WAKE),
        )?;
        let (done_tx, done_rx) = channel();
        Ok(EventLoop {
            epoll,
            listener,
            listener_rests_until: None,
            wake,
            stop,
            options,
            handler,
            conns: BTreeMap::new(),
            next_id: FIRST_CONNECTION,
            handlers: 0,
            done_tx,
            done_rx,
            streams,
        })
    }

    pub(super) fn run(mut self) {
        let mut events = vec![EpollEvent::default(); 128];
        let deadline = loop {
            if let Some(deadline) = self.stop.deadline() {
                break deadline;
            }
            if !self.turn(&mut events, None) {
                return self.close_all();
            }
        };
        // Stopping: no new connection or request; answers in flight are
        // still written until the deadline.
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            self.listener.as_raw_fd(),
            EpollEvent::default(),
        );
        self.listener_rests_until = None;
        let reading: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| matches!(c.state, State::Reading(_)))
            .map(|(&id, _)| id)
            .collect();
        for id in reading {
            if let Some(conn) = self.conns.remove(&id) {
                send_refusal(&conn.stream, &Refusal::ShuttingDown);
            }
        }
        while !self.conns.is_empty() && Instant::now() < deadline {
            if !self.turn(&mut events, Some(deadline)) {
                break;
            }
        }
        self.close_all();
    }

    /// Waits for events (until the next deadline, or `until` at the latest)
    /// and serves them. False if the loop cannot go on.
    fn turn(&mut self, events: &mut [EpollEvent], until: Option<Instant>) -> bool {
        let mut timeout = self.next_timeout(until.is_none());
        if let Some(until) = until {
            let left = millis_until(until);
            timeout = if timeout < 0 { left } else { timeout.min(left) };
        }
        let n = match self.epoll.wait(timeout, events) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
            Err(e) => {
                tracing::error!(error = %e, "API event loop: epoll_wait failed; the API stops");
                return false;
            }
        };
        for event in &events[..n] {
            match event.data() {
                LISTENER => self.accept(),
                WAKE => {
                    let _ = self.wake.read();
                }
                id => self.on_ready(id),
            }
        }
        self.take_answers();
        self.expire();
        true
    }

    /// Milliseconds until the next deadline (rounded up), or -1; puts the
    /// listener back when its rest is over (if `accepting`).
    fn next_timeout(&mut self, accepting: bool) -> i32 {
        let now = Instant::now();
        if accepting && self.listener_rests_until.is_some_and(|t| t <= now) {
            self.listener_rests_until = None;
            if let Err(e) = self.epoll.ctl(
                ControlOperation::Add,
                self.listener.as_raw_fd(),
                EpollEvent::new(EventSet::IN, LISTENER),
            ) {
                tracing::error!(error = %e, "cannot poll the API socket again");
            }
        }
        let next = self
            .conns
            .values()
            .filter(|c| !matches!(c.state, State::Handling))
            .map(|c| c.deadline)
            .chain(self.listener_rests_until)
            .min();
        next.map_or(-1, millis_until)
    }

    fn accept(&mut self) {
        for _ in 0..ACCEPT_BATCH {
            match self.listener.accept() {
                Ok((stream, _)) => self.add(stream),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    if self.evict_oldest() {
                        continue;
                    }
                    tracing::warn!("API: out of file descriptors; not accepting for a moment");
                    self.rest_listener();
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "API: accept failed");
                    return;
                }
            }
        }
    }

    fn rest_listener(&mut self) {
        let _ = self.epoll.ctl(
            ControlOperation::Delete,
            self.listener.as_raw_fd(),
            EpollEvent::default(),
        );
        self.listener_rests_until = Some(Instant::now() + ACCEPT_BACKOFF);
    }

    fn add(&mut self, stream: UnixStream) {
        if let Err(e) = stream.set_nonblocking(true) {
            tracing::warn!(error = %e, "API: cannot make a connection non-blocking");
            return;
        }
        while self.conns.len() >= self.options.max_connections {
            if !self.evict_oldest() {
                break;
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let polled = self
            .epoll
            .ctl(
                ControlOperation::Add,
                stream.as_raw_fd(),
                EpollEvent::new(EventSet::IN | EventSet::READ_HANG_UP, id),
            )
            .map_err(|e| tracing::warn!(error = %e, "API: cannot poll a connection"))
            .is_ok();
        if !polled {
            return;
        }
        self.conns.insert(
            id,
            Conn {
                stream,
                state: State::Reading(RequestBuffer::new(MAX_BODY)),
                deadline: Instant::now() + self.options.request_timeout,
                polled,
            },
        );
    }

    /// Closes the oldest connection without a complete request (503), or
    /// else the oldest still being answered. False if there is none.
    fn evict_oldest(&mut self) -> bool {
        let oldest = self
            .conns
            .iter()
            .find(|(_, c)| matches!(c.state, State::Reading(_)))
            .or_else(|| {
                self.conns
                    .iter()
                    .find(|(_, c)| matches!(c.state, State::Writing { .. }))
            })
            .map(|(&id, _)| id);
        let Some(id) = oldest else {
            return false;
        };
        if let Some(conn) = self.conns.remove(&id) {
            if let State::Reading(_) = conn.state {
                tracing::debug!(conn = id, "API: too many connections, closing the oldest");
                send_refusal(&conn.stream, &Refusal::TooManyConnections);
            }
        }
        true
    }

    fn on_ready(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        match &mut conn.state {
            State::Reading(buffer) => match read_some(&conn.stream, buffer) {
                Progress::Incomplete => {}
                Progress::Complete(request) => self.dispatch(id, request),
                Progress::Failed(e) => {
                    tracing::debug!(conn = id, error = %e, "API: bad request");
                    self.answer(id, e.status(), error_body(&e));
                }
            },
            State::Writing { .. } => self.write(id),
            State::Handling => {}
        }
    }

    /// Routes a complete request and hands it to a handler thread.
    fn dispatch(&mut self, id: u64, request: HttpRequest) {
        let routed = match route(&request.method, &request.path, &request.body) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(conn = id, error = %e, "API: request refused");
                return self.answer(id, e.status(), error_body(&e));
            }
        };
        if self.handlers >= self.options.max_handlers {
            let refusal = Refusal::TooManyRequests(self.handlers);
            return self.answer(id, refusal.status(), error_body(&refusal));
        }
        if !self.conns.contains_key(&id) {
            return;
        }
        self.unpoll(id);
        let handler = self.handler.clone();
        let done = self.done_tx.clone();
        let wake = self.wake.clone();
        let spawned = std::thread::Builder::new()
            .name("api-handler".into())
            .spawn(move || {
                let answer =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(routed)))
                        .unwrap_or_else(|_| {
                            Err(ActionError::Internal("the API handler panicked".into()))
                        });
                // The loop may be gone (shut down): nobody to answer then.
                if done.send(Done { conn: id, answer }).is_ok() {
                    let _ = wake.write(1);
                }
            });
        match spawned {
            Ok(_) => {
                self.handlers += 1;
                if let Some(conn) = self.conns.get_mut(&id) {
                    conn.state = State::Handling;
                }
            }
            Err(e) => {
                let error = ActionError::Unavailable(format!("cannot start a handler thread: {e}"));
                self.answer(id, error.status(), error_body(&error));
            }
        }
    }

    /// Answers that handler threads sent.
    fn take_answers(&mut self) {
        while let Ok(Done { conn: id, answer }) = self.done_rx.try_recv() {
            self.handlers = self.handlers.saturating_sub(1);
            match answer {
                Ok(Reply::Json(v)) => self.answer(id, status::success(false), json_body(&v)),
                Ok(Reply::Accepted(v)) => self.answer(id, status::success(true), json_body(&v)),
                Ok(Reply::Stream(lines)) => self.stream(id, lines.into_receiver()),
                Ok(Reply::Text { content_type, body }) => {
                    self.answer_as(id, status::success(false), content_type, body.into_bytes())
                }
                Err(e) => self.answer(id, e.status(), error_body(&e)),
            }
        }
    }

    fn stream(&mut self, id: u64, lines: Receiver<String>) {
        let active = self.streams.active();
        if active >= self.options.max_streams {
            let refusal = Refusal::TooManyStreams(active);
            return self.answer(id, refusal.status(), error_body(&refusal));
        }
        self.unpoll(id);
        let Some(conn) = self.conns.remove(&id) else {
            return;
        };
        if let Err(e) = self
            .streams
            .start(conn.stream, lines, self.options.stream_write_timeout)
        {
            tracing::warn!(error = %e, "API: cannot start a stream");
        }
    }

    /// Starts writing a complete JSON response; the connection closes after it.
    fn answer(&mut self, id: u64, status: u16, body: Vec<u8>) {
        self.answer_as(id, status, "application/json", body)
    }

    /// Starts writing a complete response of `content_type`; the connection
    /// closes after it.
    fn answer_as(&mut self, id: u64, status: u16, content_type: &str, body: Vec<u8>) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let out = response_bytes(status, content_type, &body);
        conn.state = State::Writing { out, written: 0 };
        conn.deadline = Instant::now() + self.options.request_timeout;
        let event = EpollEvent::new(EventSet::OUT, id);
        let op = if conn.polled {
            ControlOperation::Modify
        } else {
            ControlOperation::Add
        };
        conn.polled = self.epoll.ctl(op, conn.stream.as_raw_fd(), event).is_ok();
        self.write(id);
    }

    fn write(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let State::Writing { out, written } = &mut conn.state else {
            return;
        };
        loop {
            match (&conn.stream).write(&out[*written..]) {
                Ok(n) => {
                    *written += n;
                    if *written == out.len() || n == 0 {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && conn.polled => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        self.conns.remove(&id);
    }

    fn unpoll(&mut self, id: u64) {
        if let Some(conn) = self.conns.get_mut(&id) {
            if conn.polled {
                let _ = self.epoll.ctl(
                    ControlOperation::Delete,
                    conn.stream.as_raw_fd(),
                    EpollEvent::default(),
                );
                conn.polled = false;
            }
        }
    }

    /// Requests not complete in time get a 408; answers not taken in time
    /// are dropped.
    fn expire(&mut self) {
        let now = Instant::now();
        let late: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| !matches!(c.state, State::Handling) && c.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            if let Some(conn) = self.conns.remove(&id) {
                if let State::Reading(_) = conn.state {
                    tracing::debug!(conn = id, "API: request not complete in time");
                    send_refusal(
                        &conn.stream,
                        &Refusal::Timeout(self.options.request_timeout.as_millis()),
                    );
                }
            }
        }
    }

    /// At the end: requests not yet answered get a 503, answers being
    /// written get one more try.
    fn close_all(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            if let Some(conn) = self.conns.get(&id) {
                if matches!(conn.state, State::Writing { .. }) {
                    self.write(id);
                }
            }
            if let Some(conn) = self.conns.remove(&id) {
                if !matches!(conn.state, State::Writing { .. }) {
                    send_refusal(&conn.stream, &Refusal::ShuttingDown);
                }
            }
        }
    }
}

/// Milliseconds from now until `t`, rounded up (an epoll timeout).
fn millis_until(t: Instant) -> i32 {
    let left = t.saturating_duration_since(Instant::now());
    left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
}

/// Reads what has arrived until the request is decided or nothing more is
/// there.
fn read_some(stream: &UnixStream, buffer: &mut RequestBuffer) -> Progress {
    let mut chunk = [0u8; 4096];
    loop {
        match (&*stream).read(&mut chunk) {
            Ok(0) => return buffer.finish(),
            Ok(n) => match buffer.push(&chunk[..n]) {
                Progress::Incomplete => {}
                decided => return decided,
            },
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Incomplete,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return buffer.finish(),
        }
    }
}

/// A refusal written without waiting; a client that cannot take it loses it.
fn send_refusal(stream: &UnixStream, refusal: &Refusal) {
    let bytes = response_bytes(refusal.status(), "application/json", &error_body(refusal));
    let _ = (&*stream).write(&bytes);
}
