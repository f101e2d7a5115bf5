//! The proxy's control socket: one JSON request per line over a Unix
//! socket, one JSON reply per line.
//!
//! Requests: `{"cmd":"status"}`, `{"cmd":"pause"}`, `{"cmd":"resume"}`,
//! `{"cmd":"cutover"}`. Replies: `{"ok":true,"status":{...}}` or
//! `{"ok":false,"error":"..."}`.
//!
//! A connection whose first byte is not `{` speaks HTTP/1.1 instead: one
//! request, `GET /metrics` (the Prometheus exposition, [`crate::metrics`]),
//! then the connection closes —
//! `curl --unix-socket CONTROL http://localhost/metrics`.

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use thiserror::Error;
use tracing::warn;

use crate::proxy::Proxy;
use crate::shutdown::OwnedSocket;

#[derive(Debug, Error)]
pub enum ControlError {
    #[error("cannot listen on the control socket")]
    Bind(#[from] kemari_unix_socket::BindError),
    #[error("cannot start the control socket's thread")]
    Thread(#[source] io::Error),
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ControlRequest {
    pub cmd: String,
}

fn handle(proxy: &Proxy, line: &str) -> Value {
    let req: ControlRequest = match serde_json::from_str(line) {
        Ok(r) => r,
        Err(e) => return json!({"ok": false, "error": format!("bad request: {e}")}),
    };
    match req.cmd.as_str() {
        "status" => {}
        "pause" => proxy.pause(true),
        "resume" => proxy.pause(false),
        "cutover" => proxy.force_cutover(),
        other => return json!({"ok": false, "error": format!("unknown command {other:?}")}),
    }
    json!({"ok": true, "status": proxy.shared.status()})
}

/// A bound control socket, not yet served.
pub struct ControlSocket {
    listener: UnixListener,
    owned: OwnedSocket,
}

/// Binds the control socket at `path` (a stale socket there is replaced;
/// anything else is refused and left intact).
pub fn bind(path: &Path) -> Result<ControlSocket, ControlError> {
    let (listener, owned) = OwnedSocket::bind(path)?;
    Ok(ControlSocket { listener, owned })
}

impl ControlSocket {
    /// Serves `proxy`'s commands on a background thread.
    pub fn serve(self, proxy: Arc<Proxy>) -> Result<(), ControlError> {
        let ControlSocket { listener, owned } = self;
        std::thread::Builder::new()
            .name("nbd-control".into())
            .spawn(move || {
                let _owned = owned;
                for s in listener.incoming() {
                    let Ok(s) = s else { continue };
                    let p = proxy.clone();
                    std::thread::spawn(move || {
                        if let Err(e) = serve_one(s, &p) {
                            warn!(error = %e, "control connection failed");
                        }
                    });
                }
            })
            .map_err(ControlError::Thread)?;
        Ok(())
    }
}

fn serve_one(s: UnixStream, proxy: &Proxy) -> io::Result<()> {
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    if r.fill_buf()?.first().is_some_and(|b| *b != b'{') {
        return serve_http(&mut r, &mut w, proxy);
    }
    for line in r.lines() {
        let line = line?;
        if line.len() > 4096 {
            break;
        }
        let mut out = handle(proxy, &line).to_string();
        out.push('\n');
        w.write_all(out.as_bytes())?;
    }
    Ok(())
}

/// Answers one HTTP request: `GET /metrics`, or a refusal.
fn serve_http(r: &mut impl BufRead, w: &mut impl Write, proxy: &Proxy) -> io::Result<()> {
    let (status, content_type, body) = match kemari_api::http::read_request(r, 0) {
        Err(e) => (e.status(), "text/plain", format!("{e}\n")),
        Ok(req) => {
            let path = req
                .path
                .split_once('?')
                .map_or(req.path.as_str(), |(p, _)| p);
            if path != "/metrics" {
                (
                    404,
                    "text/plain",
                    "only /metrics is served over HTTP here\n".into(),
                )
            } else if !req.method.eq_ignore_ascii_case("GET") {
                (405, "text/plain", "only GET is allowed\n".into())
            } else {
                (200, crate::metrics::CONTENT_TYPE, proxy.exposition())
            }
        }
    };
    kemari_api::http::write_response(w, status, content_type, body.as_bytes())
}

/// Sends one command to a control socket and returns the JSON reply.
pub fn request(path: &Path, cmd: &str) -> io::Result<Value> {
    let mut s = UnixStream::connect(path)?;
    let mut line = json!({ "cmd": cmd }).to_string();
    line.push('\n');
    s.write_all(line.as_bytes())?;
    let mut r = BufReader::new(s);
    let mut reply = String::new();
    r.read_line(&mut reply)?;
    serde_json::from_str(&reply).map_err(io::Error::other)
}
