//! The API server: HTTP/1.1 + JSON on a Unix socket. Each request is routed,
//! handed to the VMM's main thread over a channel, and answered with what the
//! main thread sends back. Malformed requests are answered here, never reach the
//! VM, and never stop the server; a client gets a few seconds to send its
//! request, so a stalled client cannot hold the API.

use std::io::BufReader;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::http::{read_request, write_response};
use super::routes::{route, ApiRequest, MAX_BODY};

/// How long a client has to send its request.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(3);

/// The main thread's answer to a request.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiResponse {
    /// HTTP status.
    pub status: u16,
    /// JSON body.
    pub body: serde_json::Value,
}

impl ApiResponse {
    /// 200 with `body`.
    pub fn ok(body: serde_json::Value) -> Self {
        ApiResponse { status: 200, body }
    }

    /// An error with `status` and a message.
    pub fn error(status: u16, message: impl std::fmt::Display) -> Self {
        ApiResponse {
            status,
            body: serde_json::json!({ "error": message.to_string() }),
        }
    }
}

/// A routed request waiting for the main thread.
pub struct PendingRequest {
    /// The action.
    pub request: ApiRequest,
    /// Where the answer goes.
    pub reply: Sender<ApiResponse>,
}

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket could not be bound.
    #[error("cannot listen on API socket {path}: {message}")]
    Bind {
        /// Socket path.
        path: PathBuf,
        /// The cause.
        message: String,
    },
}

/// The running server; the socket file is removed on drop.
pub struct ApiServer {
    path: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Listens on `path` and forwards routed requests to `requests`.
    pub fn start(
        path: &Path,
        requests: impl Fn(PendingRequest) + Send + 'static,
    ) -> Result<Self, ServerError> {
        Self::start_with_direct(path, requests, |_| None)
    }

    /// Like [`start`](Self::start); `direct` may answer a request on the API
    /// thread itself (status of a long operation the main thread is busy with).
    pub fn start_with_direct(
        path: &Path,
        requests: impl Fn(PendingRequest) + Send + 'static,
        direct: impl Fn(&ApiRequest) -> Option<ApiResponse> + Send + 'static,
    ) -> Result<Self, ServerError> {
        let bind_err = |message: String| ServerError::Bind {
            path: path.into(),
            message,
        };
        if path.exists() {
            // A stale socket from a dead process: refuse to steal a live one.
            if UnixStream::connect(path).is_ok() {
                return Err(bind_err("another process is serving this socket".into()));
            }
        }
        let listener =
            vmm::unix_socket::bind_listening(path).map_err(|e| bind_err(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("api".into())
            .spawn(move || serve(&listener, &s, requests, direct))
            .map_err(|e| bind_err(e.to_string()))?;
        Ok(ApiServer {
            path: path.into(),
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(
    listener: &UnixListener,
    stop: &AtomicBool,
    requests: impl Fn(PendingRequest),
    direct: impl Fn(&ApiRequest) -> Option<ApiResponse>,
) {
    for stream in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let _ = stream.set_read_timeout(Some(CLIENT_TIMEOUT));
        let _ = stream.set_write_timeout(Some(CLIENT_TIMEOUT));
        let mut reader = BufReader::new(&stream);
        let resp = match read_request(&mut reader, MAX_BODY) {
            Err(e) => ApiResponse::error(e.status(), e),
            Ok(req) => match route(&req.method, &req.path, &req.body) {
                Err(e) => ApiResponse::error(e.status(), e),
                Ok(request) => {
                    if let Some(r) = direct(&request) {
                        r
                    } else {
                        let (tx, rx) = channel();
                        requests(PendingRequest { request, reply: tx });
                        rx.recv()
                            .unwrap_or_else(|_| ApiResponse::error(503, "the VMM is shutting down"))
                    }
                }
            },
        };
        let text = serde_json::to_string_pretty(&resp.body).unwrap_or_default() + "\n";
        let _ = write_response(&mut &stream, resp.status, &text);
    }
}
