//! A small QMP (QEMU Machine Protocol) client over a Unix socket, enough to
//! drive QEMU's migration for side-by-side figures:
//!
//! ```text
//! bench                                   QEMU (-qmp unix:PATH,server=on,wait=off)
//!   connect ─────────────────────────────▶
//!   ◀───────────────────────────────────── {"QMP": {"version": ..., "capabilities": [...]}}
//!   {"execute": "qmp_capabilities"} ─────▶
//!   ◀───────────────────────────────────── {"return": {}}
//!   {"execute": "migrate", ...} ─────────▶
//!   ◀───────────────────────────────────── {"event": "MIGRATION", ...}   (skipped)
//!   ◀───────────────────────────────────── {"return": {}} | {"error": {"class", "desc"}}
//! ```
//!
//! Messages are one JSON object per line. Events may arrive at any time and are
//! skipped while waiting for a command's answer.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Longest line accepted from QEMU.
const MAX_LINE: usize = 1 << 20;

/// Errors talking QMP.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// Connecting or socket I/O failed.
    #[error("QMP socket {path}: {source}")]
    Io {
        /// The socket.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// QEMU closed the connection.
    #[error("QMP socket {0}: QEMU closed the connection")]
    Closed(String),
    /// QEMU sent something that is not a QMP message.
    #[error("QMP: malformed message from QEMU: {0}")]
    Malformed(String),
    /// QEMU answered a command with an error.
    #[error("QMP {command}: {class}: {desc}")]
    Command {
        /// The command.
        command: String,
        /// QEMU's error class.
        class: String,
        /// QEMU's description.
        desc: String,
    },
    /// A migration ended in a state other than `completed`.
    #[error("QEMU migration ended in state {status}: {detail}")]
    Migration {
        /// The final status.
        status: String,
        /// QEMU's error description, if any.
        detail: String,
    },
    /// A wait ran out of time.
    #[error("QMP: timed out after {0:?} waiting for {1}")]
    Timeout(Duration, &'static str),
}

/// One message from QEMU.
#[derive(Debug, Clone, PartialEq)]
pub enum QmpMessage {
    /// The greeting sent on connect: QEMU's version string.
    Greeting {
        /// "major.minor.micro".
        version: String,
    },
    /// A command's success, with its value.
    Return(Value),
    /// A command's failure.
    Error {
        /// The error class (e.g. `GenericError`).
        class: String,
        /// The description.
        desc: String,
    },
    /// An asynchronous event.
    Event {
        /// The event name (e.g. `MIGRATION`).
        name: String,
        /// Its data (Null if none).
        data: Value,
    },
}

/// Parses one line QEMU sent.
pub fn parse_message(line: &str) -> Result<QmpMessage, QmpError> {
    let v: Value = serde_json::from_str(line.trim())
        .map_err(|e| QmpError::Malformed(format!("{e}: {}", truncate(line))))?;
    let Value::Object(obj) = &v else {
        return Err(QmpError::Malformed(truncate(line)));
    };
    if let Some(g) = obj.get("QMP") {
        let q = &g["version"]["qemu"];
        let version = match (
            q["major"].as_u64(),
            q["minor"].as_u64(),
            q["micro"].as_u64(),
        ) {
            (Some(a), Some(b), Some(c)) => format!("{a}.{b}.{c}"),
            _ => "unknown".to_owned(),
        };
        return Ok(QmpMessage::Greeting { version });
    }
    if let Some(r) = obj.get("return") {
        return Ok(QmpMessage::Return(r.clone()));
    }
    if let Some(e) = obj.get("error") {
        return Ok(QmpMessage::Error {
            class: e["class"].as_str().unwrap_or("unknown").to_owned(),
            desc: e["desc"].as_str().unwrap_or("").to_owned(),
        });
    }
    if let Some(name) = obj.get("event").and_then(Value::as_str) {
        return Ok(QmpMessage::Event {
            name: name.to_owned(),
            data: obj.get("data").cloned().unwrap_or(Value::Null),
        });
    }
    Err(QmpError::Malformed(truncate(line)))
}

fn truncate(s: &str) -> String {
    s.chars().take(200).collect()
}

/// The state of a migration, from `query-migrate`.
#[derive(Debug, Clone, PartialEq)]
pub struct MigrationStatus {
    /// `setup`, `active`, `completed`, `failed`, ... (`none` before any).
    pub status: String,
    /// QEMU's own downtime figure in ms, when completed.
    pub downtime_ms: Option<u64>,
    /// QEMU's own total time in ms, when completed.
    pub total_ms: Option<u64>,
    /// RAM bytes transferred, if reported.
    pub ram_bytes: Option<u64>,
    /// The error description of a failed migration.
    pub error: Option<String>,
}

impl MigrationStatus {
    /// Reads a `query-migrate` answer.
    pub fn from_value(v: &Value) -> MigrationStatus {
        MigrationStatus {
            status: v["status"].as_str().unwrap_or("none").to_owned(),
            downtime_ms: v["downtime"].as_u64(),
            total_ms: v["total-time"].as_u64(),
            ram_bytes: v["ram"]["transferred"].as_u64(),
            error: v["error-desc"].as_str().map(str::to_owned),
        }
    }

    /// Whether the migration has ended (well or not).
    pub fn finished(&self) -> bool {
        matches!(self.status.as_str(), "completed" | "failed" | "cancelled")
    }
}

/// A connected, negotiated QMP session.
pub struct Qmp {
    path: String,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// QEMU's version from the greeting.
    pub version: String,
}

impl Qmp {
    /// Connects to `socket` (retrying until `timeout`, QEMU may still be
    /// starting), reads the greeting and enters command mode.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let path = socket.display().to_string();
        let io = |source| QmpError::Io {
            path: path.clone(),
            source,
        };
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(socket) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => return Err(io(e)),
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .map_err(io)?;
        let writer = stream.try_clone().map_err(io)?;
        let mut qmp = Qmp {
            path: path.clone(),
            reader: BufReader::new(stream),
            writer,
            version: String::new(),
        };
        match qmp.read_message()? {
            QmpMessage::Greeting { version } => qmp.version = version,
            other => {
                return Err(QmpError::Malformed(format!(
                    "expected the greeting, got {other:?}"
                )))
            }
        }
        qmp.execute("qmp_capabilities", None)?;
        Ok(qmp)
    }

    fn read_message(&mut self) -> Result<QmpMessage, QmpError> {
        let mut line = String::new();
        let n = (&mut self.reader)
            .take(MAX_LINE as u64)
            .read_line(&mut line)
            .map_err(|source| QmpError::Io {
                path: self.path.clone(),
                source,
            })?;
        if n == 0 {
            return Err(QmpError::Closed(self.path.clone()));
        }
        parse_message(&line)
    }

    /// Runs one command; returns its value or QEMU's error.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        let mut msg = json!({ "execute": command });
        if let Some(a) = arguments {
            msg["arguments"] = a;
        }
        let mut text = msg.to_string();
        text.push('\n');
        self.writer
            .write_all(text.as_bytes())
            .map_err(|source| QmpError::Io {
                path: self.path.clone(),
                source,
            })?;
        loop {
            match self.read_message()? {
                QmpMessage::Return(v) => return Ok(v),
                QmpMessage::Error { class, desc } => {
                    return Err(QmpError::Command {
                        command: command.to_owned(),
                        class,
                        desc,
                    })
                }
                QmpMessage::Event { .. } => continue,
                QmpMessage::Greeting { .. } => {
                    return Err(QmpError::Malformed("a second greeting".into()))
                }
            }
        }
    }

    /// Turns migration capabilities on (`x-ignore-shared`, ...).
    pub fn set_capabilities(&mut self, names: &[&str]) -> Result<(), QmpError> {
        if names.is_empty() {
            return Ok(());
        }
        let caps: Vec<Value> = names
            .iter()
            .map(|n| json!({ "capability": n, "state": true }))
            .collect();
        self.execute(
            "migrate-set-capabilities",
            Some(json!({ "capabilities": caps })),
        )?;
        Ok(())
    }

    /// `query-migrate`.
    pub fn query_migrate(&mut self) -> Result<MigrationStatus, QmpError> {
        Ok(MigrationStatus::from_value(
            &self.execute("query-migrate", None)?,
        ))
    }

    /// Polls `query-migrate` every `interval` until the migration ends;
    /// `completed` is Ok, anything else an error.
    pub fn wait_migration(
        &mut self,
        interval: Duration,
        timeout: Duration,
    ) -> Result<MigrationStatus, QmpError> {
        let deadline = Instant::now() + timeout;
        loop {
            let st = self.query_migrate()?;
            if st.finished() {
                if st.status == "completed" {
                    return Ok(st);
                }
                return Err(QmpError::Migration {
                    detail: st.error.clone().unwrap_or_default(),
                    status: st.status,
                });
            }
            if Instant::now() >= deadline {
                return Err(QmpError::Timeout(timeout, "the migration to finish"));
            }
            std::thread::sleep(interval);
        }
    }

    /// Asks QEMU to exit; a connection closed by the exit is success.
    pub fn quit(mut self) -> Result<(), QmpError> {
        match self.execute("quit", None) {
            Ok(_) | Err(QmpError::Closed(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_greeting_return_error_and_event() {
        let g = r#"{"QMP": {"version": {"qemu": {"micro": 19, "minor": 2, "major": 7}, "package": "Debian 1:7.2+dfsg-7"}, "capabilities": ["oob"]}}"#;
        assert_eq!(
            parse_message(g).unwrap(),
            QmpMessage::Greeting {
                version: "7.2.19".into()
            }
        );
        assert_eq!(
            parse_message("{\"return\": {}}\r\n").unwrap(),
            QmpMessage::Return(json!({}))
        );
        assert_eq!(
            parse_message(r#"{"error": {"class": "GenericError", "desc": "x-ignore-shared needs shared memory"}}"#)
                .unwrap(),
            QmpMessage::Error {
                class: "GenericError".into(),
                desc: "x-ignore-shared needs shared memory".into()
            }
        );
        match parse_message(r#"{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "MIGRATION", "data": {"status": "setup"}}"#).unwrap() {
            QmpMessage::Event { name, data } => {
                assert_eq!(name, "MIGRATION");
                assert_eq!(data["status"], "setup");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn rejects_what_is_not_qmp() {
        assert!(parse_message("").is_err());
        assert!(parse_message("[1, 2]").is_err());
        assert!(parse_message("{\"foo\": 1}").is_err());
        assert!(parse_message("{\"return\": ").is_err());
    }

    #[test]
    fn reads_query_migrate() {
        let done = json!({"status": "completed", "downtime": 12, "total-time": 345,
                          "ram": {"transferred": 1000}});
        let st = MigrationStatus::from_value(&done);
        assert!(st.finished());
        assert_eq!(st.downtime_ms, Some(12));
        assert_eq!(st.total_ms, Some(345));
        assert_eq!(st.ram_bytes, Some(1000));
        let failed =
            MigrationStatus::from_value(&json!({"status": "failed", "error-desc": "boom"}));
        assert!(failed.finished());
        assert_eq!(failed.error.as_deref(), Some("boom"));
        assert!(!MigrationStatus::from_value(&json!({"status": "active"})).finished());
        assert_eq!(MigrationStatus::from_value(&json!({})).status, "none");
    }
}
