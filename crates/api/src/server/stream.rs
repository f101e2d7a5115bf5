//! Streamed answers ([`Reply::Stream`](crate::Reply::Stream)): a thread per
//! stream writes each line as it comes, with blocking writes bounded by a
//! timeout, until the sender side is dropped or the server shuts down.

use std::collections::HashMap;
use std::io::Write;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::http::stream_head;

/// How often a stream waiting for its next line looks whether the server is
/// shutting down.
const TICK: Duration = Duration::from_millis(20);

/// The streams being written.
#[derive(Debug, Default)]
pub(super) struct Streams {
    state: Mutex<State>,
    ended: Condvar,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    /// A handle on each stream's connection, to cut it once the grace is
    /// over.
    open: HashMap<u64, UnixStream>,
    closing: bool,
}

impl Streams {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Streams being written.
    pub(super) fn active(&self) -> usize {
        self.lock().open.len()
    }

    /// Waits, for up to `grace`, until no stream is being written (each
    /// has written its last line and ended).
    pub(super) fn wait_written(&self, grace: Duration) -> bool {
        let deadline = Instant::now() + grace;
        let mut state = self.lock();
        while !state.open.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self
                .ended
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    fn closing(&self) -> bool {
        self.lock().closing
    }

    /// Writes `lines` to `conn` on a thread of its own.
    pub(super) fn start(
        self: &Arc<Self>,
        conn: UnixStream,
        lines: Receiver<String>,
        write_timeout: Duration,
    ) -> std::io::Result<()> {
        let handle = conn.try_clone()?;
        let id = {
            let mut state = self.lock();
            state.next += 1;
            let id = state.next;
            state.open.insert(id, handle);
            id
        };
        let streams = self.clone();
        let spawned = std::thread::Builder::new()
            .name("api-stream".into())
            .spawn(move || {
                if let Err(e) = streams.write(conn, &lines, write_timeout) {
                    tracing::debug!(error = %e, "API stream ended early");
                }
                streams.end(id);
            });
        if let Err(e) = spawned {
            self.end(id);
            return Err(e);
        }
        Ok(())
    }

    fn end(&self, id: u64) {
        self.lock().open.remove(&id);
        self.ended.notify_all();
    }

    fn write(
        &self,
        mut conn: UnixStream,
        lines: &Receiver<String>,
        write_timeout: Duration,
    ) -> std::io::Result<()> {
        conn.set_nonblocking(false)?;
        conn.set_write_timeout(Some(write_timeout))?;
        conn.write_all(&stream_head("application/x-ndjson"))?;
        loop {
            match lines.recv_timeout(TICK) {
                Ok(line) => write_line(&mut conn, &line)?,
                Err(RecvTimeoutError::Disconnected) => return Ok(()),
                Err(RecvTimeoutError::Timeout) if self.closing() => {
                    // What was sent before the shutdown still goes out.
                    loop {
                        match lines.try_recv() {
                            Ok(line) => write_line(&mut conn, &line)?,
                            Err(TryRecvError::Empty | TryRecvError::Disconnected) => return Ok(()),
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Stops every stream: each writes what it already received, for up to
    /// `grace` in all; then their connections are cut.
    pub(super) fn close(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        let mut state = self.lock();
        state.closing = true;
        while !state.open.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state = self
                .ended
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if !state.open.is_empty() {
            tracing::warn!(
                streams = state.open.len(),
                "API streams still writing after the shutdown grace: cut"
            );
            for conn in state.open.values() {
                let _ = conn.shutdown(Shutdown::Both);
            }
        }
    }
}

/// One line, newline-terminated; a newline inside it (JSON whitespace)
/// becomes a space so that the line stays one line.
fn write_line(conn: &mut UnixStream, line: &str) -> std::io::Result<()> {
    let mut bytes = line.replace('\n', " ").into_bytes();
    bytes.push(b'\n');
    conn.write_all(&bytes)
}
