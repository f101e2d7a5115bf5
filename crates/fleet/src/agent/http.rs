//! The agent's fleet page: `GET /fleet` (HTML, reloading itself) and
//! `GET /fleet.json`, from the registry as the agent last read it.

use std::sync::{Arc, Mutex};

use tiny_http::{Header, Response, Server};

use crate::view::{html, Fleet};
use crate::FleetError;

/// How often the page reloads itself, seconds.
pub const REFRESH_S: u32 = 2;

/// What the page shows; the agent replaces it after each read.
pub type Shown = Arc<Mutex<Option<Fleet>>>;

/// Serves the page on `addr` from a thread; returns the bound address.
pub fn serve(addr: &str, host: String, shown: Shown) -> Result<String, FleetError> {
    let server = Server::http(addr).map_err(|e| FleetError::Http {
        addr: addr.to_owned(),
        why: e.to_string(),
    })?;
    let bound = server
        .server_addr()
        .to_ip()
        .map(|a| a.to_string())
        .unwrap_or_else(|| addr.to_owned());
    std::thread::Builder::new()
        .name("fleet-http".into())
        .spawn(move || {
            for request in server.incoming_requests() {
                let fleet = shown.lock().unwrap_or_else(|p| p.into_inner()).clone();
                let path = request.url().split('?').next().unwrap_or("").to_owned();
                let (status, body, kind) = match (path.as_str(), fleet) {
                    ("/" | "/fleet", Some(f)) => {
                        (200, html(&f, &host, REFRESH_S), "text/html; charset=utf-8")
                    }
                    ("/fleet.json", Some(f)) => (
                        200,
                        serde_json::to_string_pretty(&f).unwrap_or_default(),
                        "application/json",
                    ),
                    ("/" | "/fleet" | "/fleet.json", None) => (
                        503,
                        "the registry has not been read yet\n".to_owned(),
                        "text/plain",
                    ),
                    _ => (404, "not found: try /fleet\n".to_owned(), "text/plain"),
                };
                let mut response = Response::from_string(body).with_status_code(status);
                if let Ok(h) = Header::from_bytes("Content-Type", kind) {
                    response = response.with_header(h);
                }
                if let Err(e) = request.respond(response) {
                    tracing::debug!(error = %e, "fleet page: answer not sent");
                }
            }
        })
        .map_err(|e| FleetError::Http {
            addr: addr.to_owned(),
            why: e.to_string(),
        })?;
    Ok(bound)
}
