//! The API server: HTTP/1.1 + JSON on a Unix socket, serving clients
//! concurrently with bounded resources.
//!
//! ```text
//!   clients ──► event loop (one thread, epoll, every socket non-blocking)
//!                 │  accept; gather bytes per connection (http::RequestBuffer);
//!                 │  route a complete request (routes::route); answer parse
//!                 │  and route errors, deadlines (408) and refusals (503) itself
//!                 ├──► handler thread per request (at most max_handlers)
//!                 │      handler(Routed) -> Result<Reply, ActionError>
//!                 │◄──── its answer (channel + eventfd); the loop writes it
//!                 └──► stream thread per Reply::Stream (at most max_streams):
//!                        blocking writes with a timeout, one line at a time
//! ```
//!
//! An idle connection costs a buffer and no thread, so neither idle nor slow
//! clients, nor a handler that waits for the VM, delay another client. When
//! every connection slot is taken, the oldest connection without a complete
//! request is closed (503) so that a new client always gets in.

mod event_loop;
mod stream;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::bind::{self, BindError, SocketIdentity, SocketOptions};
use crate::reply::{ActionError, Reply};
use crate::routes::Routed;

/// What the server calls, on a thread of its own, for each routed request.
pub type Handler = Arc<dyn Fn(Routed) -> Result<Reply, ActionError> + Send + Sync>;

/// The server's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerOptions {
    /// Open connections at most (default 256), streams not counted; when
    /// full, the oldest connection without a complete request is closed for
    /// a new one.
    pub max_connections: usize,
    /// Time from accepting a connection to its complete request (default
    /// 5 s), then 408; also the time a client has to read its answer.
    pub request_timeout: Duration,
    /// Requests handled at once at most (default 16); beyond, 503.
    pub max_handlers: usize,
    /// Streamed answers at once at most (default 16); beyond, 503.
    pub max_streams: usize,
    /// Time one line of a stream may take to write (default 5 s): a client
    /// that stops reading is dropped.
    pub stream_write_timeout: Duration,
    /// The socket's permissions.
    pub socket: SocketOptions,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_connections: 256,
            request_timeout: Duration::from_secs(5),
            max_handlers: 16,
            max_streams: 16,
            stream_write_timeout: Duration::from_secs(5),
            socket: SocketOptions::default(),
        }
    }
}

/// Grace given to streams when the server is dropped without
/// [`ApiServer::shutdown`].
const DROP_GRACE: Duration = Duration::from_millis(200);

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket could not be bound.
    #[error("cannot listen on API socket {path}: {source}")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: BindError,
    },
    /// The options cannot work.
    #[error("invalid API server options: {0}")]
    Options(&'static str),
    /// The event loop could not be set up.
    #[error("cannot start the API server: {0}")]
    Setup(#[source] std::io::Error),
}

/// The running server. [`shutdown`](Self::shutdown) (or dropping it) stops
/// it and removes its socket file.
pub struct ApiServer {
    path: PathBuf,
    identity: SocketIdentity,
    stop: Arc<Stop>,
    wake: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    streams: Arc<stream::Streams>,
}

/// Waits for the server's streamed answers to be written: for a VMM that
/// hands its VM over and then ends at idle priority, the last line of an
/// operation's stream goes out first, at normal priority.
#[derive(Debug, Clone)]
pub struct StreamsWritten(Arc<stream::Streams>);

impl StreamsWritten {
    /// Waits, for up to `grace`, until no stream is being written; false if
    /// some still were.
    pub fn wait(&self, grace: Duration) -> bool {
        self.0.wait_written(grace)
    }
}

/// A bound API socket, not served yet: [`ApiServer::listen`] then
/// [`serve`](Self::serve), for a process that drops its privileges between
/// the two (binding may need them to give the socket its group; serving
/// starts the server's threads, which inherit what the process kept).
pub struct Listening {
    path: PathBuf,
    /// Taken by `serve`.
    listener: Option<std::os::unix::net::UnixListener>,
    identity: SocketIdentity,
    options: ServerOptions,
}

impl Drop for Listening {
    fn drop(&mut self) {
        // Never served: the socket goes with it.
        if self.listener.is_some() {
            bind::remove_if_ours(&self.path, self.identity);
        }
    }
}

impl ApiServer {
    /// Listens on `path` (see [`bind::bind`] for what is refused there) and
    /// serves each routed request with `handler`.
    pub fn start(
        path: &Path,
        options: ServerOptions,
        handler: Handler,
    ) -> Result<Self, ServerError> {
        Self::listen(path, options)?.serve(handler, || {})
    }

    /// Binds `path` (see [`bind::bind`] for what is refused there), checking
    /// `options`; nothing is served until [`Listening::serve`].
    pub fn listen(path: &Path, options: ServerOptions) -> Result<Listening, ServerError> {
        if options.max_connections <= options.max_handlers || options.max_handlers == 0 {
            return Err(ServerError::Options(
                "max_handlers must be at least 1 and below max_connections",
            ));
        }
        if options.request_timeout.is_zero() || options.stream_write_timeout.is_zero() {
            return Err(ServerError::Options("timeouts must not be zero"));
        }
        let (listener, identity) =
            bind::bind(path, &options.socket).map_err(|source| ServerError::Bind {
                path: path.into(),
                source,
            })?;
        Ok(Listening {
            path: path.into(),
            listener: Some(listener),
            identity,
            options,
        })
    }
}

impl Listening {
    /// Serves each routed request with `handler`. The server's event loop
    /// thread first calls `on_thread_start` (to confine itself: its handler
    /// and stream threads inherit what it set).
    pub fn serve(
        mut self,
        handler: Handler,
        on_thread_start: impl FnOnce() + Send + 'static,
    ) -> Result<ApiServer, ServerError> {
        let (path, identity, options) = (self.path.clone(), self.identity, self.options.clone());
        let Some(listener) = self.listener.take() else {
            return Err(ServerError::Options("the socket was served already"));
        };
        let stop = Arc::new(Stop::default());
        let streams = Arc::new(stream::Streams::default());
        let started = EventFd::new(EFD_NONBLOCK).and_then(|wake| {
            let wake = Arc::new(wake);
            let event_loop = event_loop::EventLoop::new(
                listener,
                wake.clone(),
                stop.clone(),
                options,
                handler,
                streams.clone(),
            )?;
            let thread = std::thread::Builder::new()
                .name("api".into())
                .spawn(move || {
                    on_thread_start();
                    event_loop.run()
                })?;
            Ok((wake, thread))
        });
        let (wake, thread) = started.map_err(|e| {
            bind::remove_if_ours(&path, identity);
            ServerError::Setup(e)
        })?;
        tracing::info!(path = %path.display(), "API server listening");
        Ok(ApiServer {
            path,
            identity,
            stop,
            wake,
            thread: Some(thread),
            streams,
        })
    }
}

impl ApiServer {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A handle that waits until the streams being written have ended
    /// (see [`StreamsWritten::wait`]).
    pub fn streams_written(&self) -> StreamsWritten {
        StreamsWritten(self.streams.clone())
    }

    /// Stops accepting (the socket file is removed first) and, for up to
    /// `grace`, finishes what is in flight: answers of requests being
    /// handled are still written (those not ready by then get a 503), and
    /// streams write the lines their senders already sent.
    pub fn shutdown(mut self, grace: Duration) {
        self.stop_serving(grace);
    }

    fn stop_serving(&mut self, grace: Duration) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        let deadline = Instant::now() + grace;
        bind::remove_if_ours(&self.path, self.identity);
        self.stop.request(deadline);
        if let Err(e) = self.wake.write(1) {
            tracing::warn!(error = %e, "cannot wake the API event loop");
        }
        if thread.join().is_err() {
            tracing::error!("the API event loop panicked");
        }
        self.streams
            .close(deadline.saturating_duration_since(Instant::now()));
        tracing::info!(path = %self.path.display(), "API server stopped");
    }
}

/// Whether the server was asked to stop, and until when what is in flight
/// may finish.
#[derive(Debug, Default)]
pub(super) struct Stop(Mutex<Option<Instant>>);

impl Stop {
    fn request(&self, deadline: Instant) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(deadline);
    }

    /// The deadline, once asked to stop.
    pub(super) fn deadline(&self) -> Option<Instant> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop_serving(DROP_GRACE);
    }
}
