//! The split-brain rule: only the copy holding the fence runs the VM.
//!
//! A primary holds the fence for its whole life; a standby that lost its
//! primary takes it before it runs the VM, and does **not** fail over while
//! another copy holds it (the sync link was cut, the primary lives). Three
//! kinds (`--ft-fence`, `--ft-fence-cmd`):
//!
//! - [`file`]: an exclusive `flock` on a file both ends can reach (one
//!   host, or a shared filesystem with working locks);
//! - [`etcd`]: a key per VM in an etcd cluster, bound to a lease only the
//!   running copy renews; a copy that cannot renew stops releasing outputs
//!   before the lease can expire;
//! - [`command`]: a STONITH-style command the standby runs, which must make
//!   sure the primary is off.

pub mod command;
pub mod etcd;
pub mod file;
mod helper_process;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use vmm::output::OutputFence;

pub use command::{run_fence_command, FenceCommand};
pub use file::Fence;

use etcd::wire::Purpose;
use etcd::{EtcdFence, EtcdLease, EtcdSpec};

/// Why the fence could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// The lock file cannot be opened.
    #[error("fence {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Another process holds it.
    #[error(
        "fence {0} is held by another process (the primary is alive): not running the VM here"
    )]
    Held(PathBuf),
    /// The fence command did not confirm the primary is off.
    #[error("fence command `{command}` did not confirm the primary is off ({outcome}): not running the VM here")]
    Command {
        /// The command.
        command: String,
        /// Its exit status or why it could not run.
        outcome: String,
    },
    /// The etcd key could not be taken.
    #[error("etcd fence {key}: {why}: not running the VM here")]
    Etcd {
        /// The VM's key.
        key: String,
        /// Why.
        why: String,
    },
    /// An etcd fence names the VM's key by its id.
    #[error(
        "--ft-fence etcd://… needs the VM's --id (its key is PREFIX/ID, the same for both copies)"
    )]
    NeedsId,
    /// The etcd helper process could not be started.
    #[error("cannot start the etcd fence's helper process")]
    Helper(#[source] std::io::Error),
}

/// What `--ft-fence` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceSpec {
    /// A lock file.
    File(PathBuf),
    /// An etcd cluster (`etcd://…`).
    Etcd(EtcdSpec),
}

impl FenceSpec {
    /// `etcd://…` or a path.
    pub fn parse(text: &str) -> Result<FenceSpec, String> {
        if text.starts_with("etcd://") {
            EtcdSpec::parse(text).map(FenceSpec::Etcd)
        } else if text.contains("://") {
            Err(format!(
                "{text:?}: a fence is a file path or etcd://HOST:PORT[,HOST:PORT…][/PREFIX][?ttl=SECONDS]"
            ))
        } else if text.is_empty() {
            Err("the fence path is empty".into())
        } else {
            Ok(FenceSpec::File(PathBuf::from(text)))
        }
    }
}

/// A fence ready to be taken (an etcd fence's helper runs).
#[derive(Debug)]
pub enum Arbiter {
    /// A lock file.
    File(PathBuf),
    /// An etcd key.
    Etcd(EtcdFence),
}

impl Arbiter {
    /// Makes `spec` ready for the VM `id` (an etcd fence forks its helper:
    /// call it while the process has one thread). Setting `stop` ends a
    /// wait for an etcd key.
    pub fn start(
        spec: &FenceSpec,
        id: Option<&str>,
        stop: Arc<AtomicBool>,
    ) -> Result<Arbiter, FenceError> {
        Ok(match spec {
            FenceSpec::File(path) => Arbiter::File(path.clone()),
            FenceSpec::Etcd(etcd) => {
                let id = id.ok_or(FenceError::NeedsId)?;
                Arbiter::Etcd(EtcdFence::start(etcd, id, stop).map_err(FenceError::Helper)?)
            }
        })
    }

    /// Takes the fence for a primary that starts: a lock file at once; an
    /// etcd key once a previous copy's lease ran out (two TTLs at most).
    pub fn acquire_to_start(&self) -> Result<HeldFence, FenceError> {
        match self {
            Arbiter::File(path) => Ok(HeldFence::File(Fence::acquire(path, Duration::ZERO)?)),
            Arbiter::Etcd(e) => {
                tracing::info!(key = e.key(), "etcd fence: taking the VM's key");
                Ok(HeldFence::Etcd(e.acquire(Purpose::Start)?))
            }
        }
    }

    /// Takes the fence for a standby whose primary was lost (`timeout`: the
    /// sync link's): a lock file within `timeout`; an etcd key once the
    /// primary's lease has expired, however long etcd is out of reach.
    pub fn acquire_to_fail_over(&self, timeout: Duration) -> Result<HeldFence, FenceError> {
        match self {
            Arbiter::File(path) => Ok(HeldFence::File(Fence::acquire(path, timeout)?)),
            Arbiter::Etcd(e) => {
                tracing::warn!(
                    key = e.key(),
                    ttl_s = e.ttl().as_secs(),
                    "etcd fence: waiting for the primary's lease to end before failing over"
                );
                Ok(HeldFence::Etcd(e.acquire(Purpose::Failover)?))
            }
        }
    }
}

/// A held fence; dropping it (or the process ending) releases it.
#[derive(Debug)]
pub enum HeldFence {
    /// A lock file.
    File(Fence),
    /// An etcd key and its lease.
    Etcd(EtcdLease),
}

impl HeldFence {
    /// What the machine's outputs must wait for (an etcd lease's deadline);
    /// None for a lock, which holds as long as the process lives.
    pub fn output_fence(&self) -> Option<Arc<dyn OutputFence>> {
        match self {
            HeldFence::File(_) => None,
            HeldFence::Etcd(l) => Some(l.output_fence()),
        }
    }

    /// Calls `notify` with the reason if the fence is lost while held (an
    /// etcd lease not renewed in time); never for a lock.
    pub fn on_lost(&self, notify: impl FnOnce(String) + Send + 'static) {
        if let HeldFence::Etcd(l) = self {
            l.on_lost(notify);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_is_a_path_or_an_etcd_url() {
        assert_eq!(
            FenceSpec::parse("/run/vm.fence"),
            Ok(FenceSpec::File("/run/vm.fence".into()))
        );
        assert!(matches!(
            FenceSpec::parse("etcd://127.0.0.1:2379/k?ttl=3"),
            Ok(FenceSpec::Etcd(_))
        ));
        assert!(FenceSpec::parse("etcd://nohost").is_err());
        assert!(FenceSpec::parse("http://x:1").is_err());
        assert!(matches!(
            Arbiter::start(
                &FenceSpec::parse("etcd://h:1").unwrap(),
                None,
                Arc::default()
            ),
            Err(FenceError::NeedsId)
        ));
    }
}
