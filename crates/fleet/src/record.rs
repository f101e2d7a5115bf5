//! The registry's records and keys. Everything lives under the etcd
//! fence's prefix (`PREFIX`, default `/kemari/vms`), beside the fence's own
//! per-VM keys `PREFIX/ID`:
//!
//! ```text
//! PREFIX/ID                      the fence: who runs VM ID (crates/ft)
//! PREFIX/_fleet/hosts/NAME       HostRecord, bound to the host agent's lease
//! PREFIX/_fleet/vms/ID           VmRecord, written by the agent of the VM's primary
//! PREFIX/_fleet/standby/ID       Claim: the host protecting ID, bound to its agent's lease
//! ```

use serde::{Deserialize, Serialize};

/// A host that can serve as a standby; gone with its agent's lease.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostRecord {
    /// The host's name (`--host-name`), unique in the fleet.
    pub name: String,
    /// The address its standbys listen on (a primary connects there).
    pub address: String,
    /// The agent's fleet page, if it serves one.
    #[serde(default)]
    pub http: Option<String>,
    /// How many standbys it may run.
    pub slots: u32,
    /// How many it runs.
    pub standbys: u32,
    /// Its `MemAvailable`, bytes.
    pub free_memory_bytes: u64,
    /// Which migration key it holds ([`crate::agent::key_id`]): a primary
    /// is protected only by a host with the same key.
    pub key_id: String,
    /// Registered since (Unix seconds).
    pub since_unix: u64,
}

impl HostRecord {
    /// Standbys it may still start.
    pub fn free_slots(&self) -> u32 {
        self.slots.saturating_sub(self.standbys)
    }
}

/// A failover, as the new primary's agent saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Failover {
    /// When the agent saw it (Unix seconds).
    pub at_unix: u64,
    /// The host that lost the VM.
    pub from: String,
    /// The host that runs it since.
    pub to: String,
    /// From the loss of the primary to the guest running (the standby's
    /// `failover_ms`).
    #[serde(default)]
    pub failover_ms: Option<u64>,
}

/// Where a VM runs and who protects it; kept by its primary's agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmRecord {
    /// The VM's id (`--id`).
    pub id: String,
    /// The host that runs it.
    pub primary: String,
    /// The host whose standby protects it (or is being synchronized).
    #[serde(default)]
    pub standby: Option<String>,
    /// Its fault-tolerance state on the primary (`unprotected`, `syncing`,
    /// `protected`, `degraded`, `failed_over`), or `down` once no copy
    /// runs.
    pub state: String,
    /// The last epoch synchronized.
    pub epoch: u64,
    /// Synchronizations per second.
    pub syncs_per_s: f64,
    /// The guest's memory: a standby's host needs this much free.
    #[serde(default)]
    pub memory_bytes: Option<u64>,
    /// Runs on `primary` since (Unix seconds).
    pub since_unix: u64,
    /// Failovers seen by the registry.
    #[serde(default)]
    pub failovers: u64,
    /// The last of them.
    #[serde(default)]
    pub last_failover: Option<Failover>,
    /// Last written (Unix seconds).
    pub updated_unix: u64,
}

impl VmRecord {
    /// Whether the VM runs without a standby and should get one.
    pub fn needs_standby(&self) -> bool {
        needs_standby(&self.state)
    }
}

/// Whether a primary in fault-tolerance state `state` runs unprotected.
pub fn needs_standby(state: &str) -> bool {
    matches!(state, "unprotected" | "degraded" | "failed_over")
}

/// A host's claim to protect a VM: created (only if absent) before it
/// starts the standby, then given the standby's address once it listens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claim {
    /// The claiming host.
    pub host: String,
    /// The standby's `host:port` once it waits for its primary.
    #[serde(default)]
    pub peer: Option<String>,
    /// Claimed at (Unix seconds).
    pub since_unix: u64,
}

/// The registry's keys under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// Keys under `prefix` (the fence's, without a trailing `/`).
    pub fn new(prefix: &str) -> Keys {
        Keys {
            prefix: prefix.trim_end_matches('/').to_owned(),
        }
    }

    /// Every registry key starts with this.
    pub fn root(&self) -> String {
        format!("{}/_fleet/", self.prefix)
    }

    /// The fence key of VM `id`.
    pub fn fence(&self, id: &str) -> String {
        format!("{}/{id}", self.prefix)
    }

    /// The record of host `name`.
    pub fn host(&self, name: &str) -> String {
        format!("{}hosts/{name}", self.root())
    }

    /// The record of VM `id`.
    pub fn vm(&self, id: &str) -> String {
        format!("{}vms/{id}", self.root())
    }

    /// The standby claim of VM `id`.
    pub fn claim(&self, id: &str) -> String {
        format!("{}standby/{id}", self.root())
    }

    /// Which record a registry key holds, and its name.
    pub fn classify<'k>(&self, key: &'k str) -> Option<(Kind, &'k str)> {
        let rest = key.strip_prefix(&self.root())?;
        let (kind, name) = rest.split_once('/')?;
        let kind = match kind {
            "hosts" => Kind::Host,
            "vms" => Kind::Vm,
            "standby" => Kind::Claim,
            _ => return None,
        };
        (!name.is_empty() && !name.contains('/')).then_some((kind, name))
    }
}

/// What a registry key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A [`HostRecord`].
    Host,
    /// A [`VmRecord`].
    Vm,
    /// A [`Claim`].
    Claim,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sit_beside_the_fence_keys_and_classify_back() {
        let k = Keys::new("/kemari/vms/");
        assert_eq!(k.fence("web-1"), "/kemari/vms/web-1");
        assert_eq!(k.host("h1"), "/kemari/vms/_fleet/hosts/h1");
        assert_eq!(k.vm("web-1"), "/kemari/vms/_fleet/vms/web-1");
        assert_eq!(k.claim("web-1"), "/kemari/vms/_fleet/standby/web-1");
        assert_eq!(k.classify(&k.host("h1")), Some((Kind::Host, "h1")));
        assert_eq!(k.classify(&k.vm("a")), Some((Kind::Vm, "a")));
        assert_eq!(k.classify(&k.claim("a")), Some((Kind::Claim, "a")));
        assert_eq!(k.classify("/kemari/vms/web-1"), None);
        assert_eq!(k.classify("/kemari/vms/_fleet/other/x"), None);
        assert_eq!(k.classify("/kemari/vms/_fleet/vms/"), None);
    }

    #[test]
    fn records_round_trip_and_old_fields_default() {
        let v: VmRecord = serde_json::from_str(
            r#"{"id":"a","primary":"h1","state":"protected","epoch":3,"syncs_per_s":2.5,"since_unix":1,"updated_unix":2}"#,
        )
        .unwrap();
        assert_eq!(v.standby, None);
        assert_eq!(v.failovers, 0);
        assert!(!v.needs_standby());
        let back: VmRecord = serde_json::from_str(&serde_json::to_string(&v).unwrap()).unwrap();
        assert_eq!(back, v);
        for s in ["unprotected", "degraded", "failed_over"] {
            assert!(needs_standby(s), "{s}");
        }
        for s in ["syncing", "protected", "down", "standby"] {
            assert!(!needs_standby(s), "{s}");
        }
    }
}
