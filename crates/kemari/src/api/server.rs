//! The API server: HTTP/1.1 + JSON on a Unix socket. Each request is routed,
//! handed to the VMM's main thread over a channel, and answered with what the
//! main thread sends back. Malformed requests are answered here, never reach the
//! VM, and never stop the server.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::thread::JoinHandle;

use tiny_http::{Header, Response, Server};

use super::routes::{route, ApiRequest, MAX_BODY};

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
    server: std::sync::Arc<Server>,
    thread: Option<JoinHandle<()>>,
}

impl ApiServer {
    /// Listens on `path` and forwards routed requests to `requests`.
    pub fn start(
        path: &Path,
        requests: impl Fn(PendingRequest) + Send + 'static,
    ) -> Result<Self, ServerError> {
        if path.exists() {
            // A stale socket from a dead process: refuse to steal a live one.
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(ServerError::Bind {
                    path: path.into(),
                    message: "another process is serving this socket".into(),
                });
            }
            let _ = std::fs::remove_file(path);
        }
        let server = Server::http_unix(path).map_err(|e| ServerError::Bind {
            path: path.into(),
            message: e.to_string(),
        })?;
        let server = std::sync::Arc::new(server);
        let s = server.clone();
        let thread = std::thread::Builder::new()
            .name("api".into())
            .spawn(move || serve(&s, requests))
            .map_err(|e| ServerError::Bind {
                path: path.into(),
                message: e.to_string(),
            })?;
        Ok(ApiServer {
            path: path.into(),
            server,
            thread: Some(thread),
        })
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(server: &Server, requests: impl Fn(PendingRequest)) {
    for mut req in server.incoming_requests() {
        let mut body = Vec::new();
        let read = req
            .as_reader()
            .take(MAX_BODY as u64 + 1)
            .read_to_end(&mut body);
        let resp = match read {
            Err(e) => ApiResponse::error(400, format!("cannot read body: {e}")),
            Ok(_) => match route(req.method().as_str(), req.url(), &body) {
                Err(e) => ApiResponse::error(e.status(), e),
                Ok(request) => {
                    let (tx, rx) = channel();
                    requests(PendingRequest { request, reply: tx });
                    rx.recv()
                        .unwrap_or_else(|_| ApiResponse::error(503, "the VMM is shutting down"))
                }
            },
        };
        let text = serde_json::to_string_pretty(&resp.body).unwrap_or_default();
        let header = Header::from_bytes("Content-Type", "application/json").ok();
        let mut r = Response::from_string(text + "\n").with_status_code(resp.status);
        if let Some(h) = header {
            r = r.with_header(h);
        }
        let _ = req.respond(r);
    }
}
