//! The VMs on this host: every kemari whose API socket lies in the
//! agent's VM folder (`ID.sock`), and what its `GET /vm/ft` says.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

/// How long one VMM may take to answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// A VM's API socket in the folder.
#[derive(Debug, Clone)]
pub struct Local {
    /// The VM's id (the socket's name without `.sock`).
    pub id: String,
    /// The socket.
    pub socket: PathBuf,
    /// What the VMM said.
    pub seen: Seen,
}

/// What a socket's VMM said.
#[derive(Debug, Clone)]
pub enum Seen {
    /// Its fault-tolerance status.
    Ft(FtView),
    /// No process listens there any more (it ended or was killed).
    Gone,
    /// It did not answer in time, or answered something else.
    Silent(String),
}

/// The parts of `GET /vm/ft` the agent uses.
#[derive(Debug, Clone, PartialEq)]
pub struct FtView {
    /// `none`, `primary`, `standby`.
    pub role: String,
    /// `unprotected`, `syncing`, `protected`, `degraded`, `standby`,
    /// `failing_over`, `failed_over`.
    pub state: String,
    /// The peer (`host:port`), if any.
    pub peer: String,
    /// The last epoch.
    pub epoch: u64,
    /// Synchronizations per second.
    pub syncs_per_s: f64,
    /// Failovers this VMM did.
    pub failovers: u64,
    /// Its last failover's time, ms.
    pub failover_ms: Option<u64>,
    /// The guest's memory (`GET /vm`), for a VM that runs.
    pub memory_bytes: Option<u64>,
}

impl FtView {
    /// From the JSON of `GET /vm/ft`.
    pub fn parse(v: &Value) -> Option<FtView> {
        Some(FtView {
            role: v["role"].as_str()?.to_owned(),
            state: v["state"].as_str()?.to_owned(),
            peer: v["peer"].as_str().unwrap_or_default().to_owned(),
            epoch: v["epoch"].as_u64().unwrap_or(0),
            syncs_per_s: v["syncs_per_s"].as_f64().unwrap_or(0.0),
            failovers: v["failovers"].as_u64().unwrap_or(0),
            failover_ms: v["failover_ms"].as_u64(),
            memory_bytes: None,
        })
    }

    /// A standby (waiting, or taking over): not a running VM yet.
    pub fn is_standby(&self) -> bool {
        matches!(self.state.as_str(), "standby" | "failing_over")
    }

    /// A VMM started as a standby that took over: the VM runs there. (One
    /// that has not yet begun to listen for its primary says `none`,
    /// `unprotected`, as a VM that runs without protection does.)
    pub fn took_over(&self) -> bool {
        self.failovers > 0 || self.state == "failed_over"
    }
}

/// The socket of VM `id` in `dir`.
pub fn socket_of(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.sock"))
}

/// Asks every `*.sock` in `dir`. Blocking (one short call per VM).
pub fn scan(dir: &Path) -> Vec<Local> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<Local> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let path = e.path();
            let id = path
                .file_name()?
                .to_str()?
                .strip_suffix(".sock")?
                .to_owned();
            Some(Local {
                seen: ask(&path),
                id,
                socket: path,
            })
        })
        .collect();
    found.sort_by(|a, b| a.id.cmp(&b.id));
    found
}

fn ask(socket: &Path) -> Seen {
    use kemari_api::client::{request_with_timeout, ClientError};
    match request_with_timeout(socket, "GET", "/vm/ft", None, ASK_TIMEOUT) {
        Ok(v) => match FtView::parse(&v) {
            Some(mut f) => {
                if !f.is_standby() {
                    f.memory_bytes = request_with_timeout(socket, "GET", "/vm", None, ASK_TIMEOUT)
                        .ok()
                        .and_then(|i| i["memory_bytes"].as_u64());
                }
                Seen::Ft(f)
            }
            None => Seen::Silent(format!("unexpected answer: {v}")),
        },
        Err(ClientError::Connect { source, .. })
            if matches!(
                source.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            ) =>
        {
            Seen::Gone
        }
        Err(e) => Seen::Silent(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_ft_status_and_finds_dead_sockets() {
        let v = serde_json::json!({"role": "none", "state": "failed_over", "peer": "",
            "epoch": 7, "syncs_per_s": 3.5, "failovers": 1, "failover_ms": 25});
        let f = FtView::parse(&v).unwrap();
        assert_eq!(
            (f.state.as_str(), f.epoch, f.failover_ms),
            ("failed_over", 7, Some(25))
        );
        assert!(!f.is_standby());
        assert!(f.took_over());
        // A standby whose API answers before it listens for its primary.
        let starting = FtView::parse(&serde_json::json!({"role": "none",
            "state": "unprotected", "peer": "", "epoch": 0, "failovers": 0}))
        .unwrap();
        assert!(!starting.is_standby() && !starting.took_over());
        // Protected again after its failover.
        let again = FtView::parse(&serde_json::json!({"role": "primary",
            "state": "protected", "peer": "h:1", "epoch": 3, "failovers": 1}))
        .unwrap();
        assert!(again.took_over());
        assert!(FtView::parse(&serde_json::json!({"state": 1})).is_none());

        let dir = std::env::temp_dir().join(format!("fleet-local-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A socket nobody listens on any more, and a file that is no socket.
        let path = socket_of(&dir, "vm-a");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        std::fs::write(dir.join("notes.txt"), "x").unwrap();
        let found = scan(&dir);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].id, "vm-a");
        assert!(matches!(found[0].seen, Seen::Gone), "{:?}", found[0].seen);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
