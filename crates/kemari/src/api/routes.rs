//! The API's routes: an HTTP method, path and body become one [`ApiRequest`].
//! Pure and bounded, so it can be fuzzed (`fuzz/` target `api_request`).
//!
//! | method | path            | action                         |
//! |--------|-----------------|--------------------------------|
//! | GET    | /vm             | VM info and state              |
//! | GET    | /vm/config      | the machine configuration      |
//! | GET    | /vm/devices     | devices and their counters     |
//! | GET    | /vm/metrics     | exits, pages, device counters  |
//! | PUT    | /vm/pause       | pause vCPUs and devices        |
//! | PUT    | /vm/resume      | resume                         |
//! | PUT    | /vm/shutdown    | stop the VM, end the process   |
//! | PUT    | /vm/snapshot    | {"dir", "exit"?}: full snapshot (state + memory image) |
//! | PUT    | /vm/warm-restart| {"dir", "prepare"?}: save state only, keep memory, end the process (hand the VM to a waiting successor); with prepare, only write DIR/config.json for a successor |
//! | PUT    | /vm/migrate-local | {"socket"}: zero-copy migration to another kemari |
//! | PUT    | /vm/migrate     | {"to", "key_file", "max_downtime_ms"?, "max_rounds"?}: live migration |
//! | GET    | /vm/migration   | progress of the running or last live migration |
//! | PUT    | /vm/migration/cancel | cancel the running live migration |
//! | PUT    | /vm/ft/start    | {"peer", "key_file", "periodic_ms"?, "heartbeat_ms"?, "timeout_ms"?, "keep_writable_pages"?}: protect the VM with a standby |
//! | GET    | /vm/ft          | fault-tolerance state and metrics |
//! | PUT    | /vm/ft/stop     | stop protection (the standby exits) |

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Largest request body accepted.
pub const MAX_BODY: usize = 64 << 10;

/// One API action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ApiRequest {
    /// VM info.
    Info,
    /// Machine configuration.
    Config,
    /// Device list.
    Devices,
    /// Metrics.
    Metrics,
    /// Pause.
    Pause,
    /// Resume.
    Resume,
    /// Shut down.
    Shutdown,
    /// Full snapshot into a directory; the process ends afterwards if `exit`.
    Snapshot {
        /// Target directory.
        dir: PathBuf,
        /// End the VMM after saving (suspend to disk).
        exit: bool,
    },
    /// Warm restart: state into `dir`, memory kept in its file, process ends
    /// (handing the VM to a successor waiting on `dir`, if one does).
    WarmRestart {
        /// Target directory.
        dir: PathBuf,
        /// Only write `dir/config.json` for a successor; the VM runs on.
        prepare: bool,
    },
    /// Zero-copy migration into the kemari listening on `socket`.
    MigrateLocal {
        /// The destination's Unix socket (`kemari --incoming-local`).
        socket: PathBuf,
    },
    /// Live migration over TCP.
    Migrate {
        /// Destination `host:port` (`kemari --incoming`).
        to: String,
        /// Pre-shared key file.
        key_file: PathBuf,
        /// Downtime limit in ms.
        max_downtime_ms: Option<u64>,
        /// Round limit.
        max_rounds: Option<u32>,
    },
    /// Progress of the live migration.
    MigrationStatus,
    /// Cancel the live migration.
    MigrationCancel,
    /// Start fault tolerance with the standby at `peer`.
    FtStart(FtStartRequest),
    /// Fault-tolerance state and metrics.
    FtStatus,
    /// Stop fault tolerance.
    FtStop,
}

/// Parameters of `PUT /vm/ft/start`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FtStartRequest {
    /// The standby's `host:port` (`kemari --ft-standby`).
    pub peer: String,
    /// Pre-shared key file (the standby's --migration-key-file).
    pub key_file: PathBuf,
    /// Periodic checkpoints every this many ms (Remus-style) instead of
    /// event-driven synchronization.
    #[serde(default)]
    pub periodic_ms: Option<u64>,
    /// Heartbeat interval on the sync link, ms (default 100).
    #[serde(default)]
    pub heartbeat_ms: Option<u64>,
    /// Peer declared lost after this long without a frame, ms (default 1000).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Pages the guest rewrites from sync to sync left writable, at most
    /// (default 64; 0: every harvested page is write-protected again).
    #[serde(default)]
    pub keep_writable_pages: Option<usize>,
}

impl ApiRequest {
    /// Whether the request moves the VM to another VMM (which a protected VM
    /// must not do: its standby follows this VMM, and live migration would
    /// share the dirty-page tracker with fault tolerance).
    pub fn moves_vm(&self) -> bool {
        matches!(
            self,
            ApiRequest::WarmRestart { prepare: false, .. }
                | ApiRequest::MigrateLocal { .. }
                | ApiRequest::Migrate { .. }
        )
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MigrateBody {
    to: String,
    key_file: PathBuf,
    #[serde(default)]
    max_downtime_ms: Option<u64>,
    #[serde(default)]
    max_rounds: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    dir: PathBuf,
    #[serde(default)]
    exit: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WarmRestartBody {
    dir: PathBuf,
    #[serde(default)]
    prepare: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SocketBody {
    socket: PathBuf,
}

fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, RouteError> {
    serde_json::from_slice(body).map_err(|e| RouteError::BadBody(e.to_string()))
}

/// Why a request was refused before reaching the VM.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No such path.
    #[error("no such API path: {0}")]
    NotFound(String),
    /// Path exists, method does not.
    #[error("method {method} not allowed on {path} (allowed: {allowed})")]
    MethodNotAllowed {
        /// The method used.
        method: String,
        /// The path.
        path: String,
        /// What is allowed.
        allowed: &'static str,
    },
    /// Body too large or not valid for the action.
    #[error("bad request body: {0}")]
    BadBody(String),
}

impl RouteError {
    /// HTTP status code for the error.
    pub fn status(&self) -> u16 {
        match self {
            RouteError::NotFound(_) => 404,
            RouteError::MethodNotAllowed { .. } => 405,
            RouteError::BadBody(_) => 400,
        }
    }
}

/// Maps a request to an action.
pub fn route(method: &str, path: &str, body_bytes: &[u8]) -> Result<ApiRequest, RouteError> {
    let body = body_bytes;
    if body.len() > MAX_BODY {
        return Err(RouteError::BadBody(format!(
            "{} bytes, limit {MAX_BODY}",
            body.len()
        )));
    }
    let path = path.split('?').next().unwrap_or("");
    let path = path
        .strip_suffix('/')
        .filter(|p| !p.is_empty())
        .unwrap_or(path);
    let (req, allowed) = match path {
        "/vm" => (ApiRequest::Info, "GET"),
        "/vm/config" => (ApiRequest::Config, "GET"),
        "/vm/devices" => (ApiRequest::Devices, "GET"),
        "/vm/metrics" => (ApiRequest::Metrics, "GET"),
        "/vm/pause" => (ApiRequest::Pause, "PUT"),
        "/vm/resume" => (ApiRequest::Resume, "PUT"),
        "/vm/shutdown" => (ApiRequest::Shutdown, "PUT"),
        "/vm/migration" => (ApiRequest::MigrationStatus, "GET"),
        "/vm/migration/cancel" => (ApiRequest::MigrationCancel, "PUT"),
        "/vm/ft" => (ApiRequest::FtStatus, "GET"),
        "/vm/ft/stop" => (ApiRequest::FtStop, "PUT"),
        "/vm/snapshot" | "/vm/warm-restart" | "/vm/migrate-local" | "/vm/migrate"
        | "/vm/ft/start" => {
            if !method.eq_ignore_ascii_case("PUT") {
                return Err(RouteError::MethodNotAllowed {
                    method: truncate(method),
                    path: path.to_owned(),
                    allowed: "PUT",
                });
            }
            return Ok(match path {
                "/vm/snapshot" => {
                    let b: SnapshotBody = parse_body(body_bytes)?;
                    ApiRequest::Snapshot {
                        dir: b.dir,
                        exit: b.exit,
                    }
                }
                "/vm/warm-restart" => {
                    let b: WarmRestartBody = parse_body(body_bytes)?;
                    ApiRequest::WarmRestart {
                        dir: b.dir,
                        prepare: b.prepare,
                    }
                }
                "/vm/ft/start" => ApiRequest::FtStart(parse_body(body_bytes)?),
                "/vm/migrate" => {
                    let b: MigrateBody = parse_body(body_bytes)?;
                    ApiRequest::Migrate {
                        to: b.to,
                        key_file: b.key_file,
                        max_downtime_ms: b.max_downtime_ms,
                        max_rounds: b.max_rounds,
                    }
                }
                _ => ApiRequest::MigrateLocal {
                    socket: parse_body::<SocketBody>(body_bytes)?.socket,
                },
            });
        }
        _ => return Err(RouteError::NotFound(truncate(path))),
    };
    if !method.eq_ignore_ascii_case(allowed) {
        return Err(RouteError::MethodNotAllowed {
            method: truncate(method),
            path: path.to_owned(),
            allowed,
        });
    }
    // Actions without parameters accept an empty body or a JSON object.
    if !body.iter().all(u8::is_ascii_whitespace) {
        serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body)
            .map_err(|e| RouteError::BadBody(e.to_string()))?;
    }
    Ok(req)
}

fn truncate(s: &str) -> String {
    s.chars().take(128).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(route("GET", "/vm", b"").unwrap(), ApiRequest::Info);
        assert_eq!(
            route("get", "/vm/metrics/", b"").unwrap(),
            ApiRequest::Metrics
        );
        assert_eq!(route("PUT", "/vm/pause", b"{}").unwrap(), ApiRequest::Pause);
        assert_eq!(
            route("PUT", "/vm/shutdown?x=1", b" \n").unwrap(),
            ApiRequest::Shutdown
        );
    }

    #[test]
    fn errors() {
        assert_eq!(route("GET", "/nope", b"").unwrap_err().status(), 404);
        assert_eq!(route("POST", "/vm/pause", b"").unwrap_err().status(), 405);
        assert_eq!(
            route("PUT", "/vm/pause", b"{not json")
                .unwrap_err()
                .status(),
            400
        );
        assert_eq!(route("PUT", "/vm/pause", b"[1]").unwrap_err().status(), 400);
        assert_eq!(
            route("PUT", "/vm/snapshot", b"{}").unwrap_err().status(),
            400
        );
        assert_eq!(
            route("PUT", "/vm/snapshot", br#"{"dir":"/s","bogus":1}"#)
                .unwrap_err()
                .status(),
            400
        );
        assert_eq!(
            route("GET", "/vm/warm-restart", b"").unwrap_err().status(),
            405
        );
        assert_eq!(
            route("PUT", "/vm/ft/start", br#"{"peer":"h:1"}"#)
                .unwrap_err()
                .status(),
            400
        );
        assert!(matches!(
            route(
                "PUT",
                "/vm/ft/start",
                br#"{"peer":"h:1","key_file":"/k","periodic_ms":25}"#
            ),
            Ok(ApiRequest::FtStart(FtStartRequest {
                periodic_ms: Some(25),
                ..
            }))
        ));
        assert!(matches!(
            route(
                "PUT",
                "/vm/ft/start",
                br#"{"peer":"h:1","key_file":"/k","keep_writable_pages":0}"#
            ),
            Ok(ApiRequest::FtStart(FtStartRequest {
                keep_writable_pages: Some(0),
                ..
            }))
        ));
        assert_eq!(route("GET", "/vm/ft", b"").unwrap(), ApiRequest::FtStatus);
        assert_eq!(
            route("PUT", "/vm/warm-restart", br#"{"dir":"/w","prepare":true}"#).unwrap(),
            ApiRequest::WarmRestart {
                dir: "/w".into(),
                prepare: true
            }
        );
        assert!(route("PUT", "/vm/warm-restart", br#"{"dir":"/w"}"#)
            .unwrap()
            .moves_vm());
        assert!(
            !route("PUT", "/vm/warm-restart", br#"{"dir":"/w","prepare":true}"#)
                .unwrap()
                .moves_vm()
        );
        let big = vec![b' '; MAX_BODY + 1];
        assert_eq!(route("PUT", "/vm/pause", &big).unwrap_err().status(), 400);
        let long = "/".repeat(10_000);
        assert!(route("GET", &long, b"").unwrap_err().to_string().len() < 300);
    }
}
