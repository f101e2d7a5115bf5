//! kemari across hosts, on etcd.
//!
//! - [`record`]: what the registry holds (hosts, VMs, standby claims) and
//!   under which keys, next to the etcd fence's keys;
//! - [`store`]: reading and writing it (the fence's etcd client);
//! - [`rank`]: which free host should protect a VM next;
//! - [`view`]: the fleet as rows: `kemarictl fleet`'s table and JSON, the
//!   agent's page;
//! - [`agent`]: the host agent (`kemari-agent`): registers its host, keeps
//!   the records of the VMs it runs, and re-protects a VM after a failover
//!   by starting a standby on a free host.

pub mod agent;
pub mod rank;
pub mod record;
pub mod store;
pub mod view;

/// What can go wrong talking to the registry, in the user's terms.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// etcd did not answer or refused.
    #[error("etcd at {endpoints}: {why}")]
    Etcd {
        /// The endpoints tried.
        endpoints: String,
        /// What failed.
        why: String,
    },
    /// The `--etcd` address is malformed.
    #[error("{0}")]
    Spec(String),
    /// A file the agent needs.
    #[error("{what} {path}: {source}")]
    File {
        /// Which file.
        what: &'static str,
        /// Where.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A thread of the agent.
    #[error("cannot start {what}: {source}")]
    Thread {
        /// Which thread.
        what: &'static str,
        /// The cause.
        source: std::io::Error,
    },
    /// The fleet page's listener.
    #[error("cannot serve the fleet page on {addr}: {why}")]
    Http {
        /// The address asked for.
        addr: String,
        /// Why.
        why: String,
    },
}

/// Seconds since the Unix epoch.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}
