//! The API's actions, as typed values.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// One API action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
        #[serde(default)]
        exit: bool,
        /// Replace a snapshot already in `dir` (refused otherwise).
        #[serde(default)]
        force: bool,
    },
    /// Warm restart: state into `dir`, memory kept in its file, process ends
    /// (handing the VM to a successor waiting on `dir`, if one does).
    WarmRestart {
        /// Target directory.
        dir: PathBuf,
        /// Only write `dir/config.json` for a successor; the VM runs on.
        #[serde(default)]
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
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_downtime_ms: Option<u64>,
        /// Round limit.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_rounds: Option<u32>,
        /// Bandwidth cap of the rounds while the guest runs, MiB/s.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        max_bandwidth_mib_s: Option<u64>,
        /// TCP connections (1–8, default 1): the main one and N−1 page
        /// streams (docs/migration-protocol.md, "Several streams").
        #[serde(default, skip_serializing_if = "Option::is_none")]
        connections: Option<u8>,
        /// An authenticated but unencrypted link (a trusted, dedicated
        /// link; the destination must be started with `--plaintext-link`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        plaintext: bool,
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
    /// The current or last long operation.
    OperationStatus,
    /// Cancel the current long operation.
    OperationCancel,
    /// The VM's events, as they happen (a stream held open).
    Events,
    /// The metrics in the Prometheus text exposition format.
    PrometheusMetrics,
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub periodic_ms: Option<u64>,
    /// Heartbeat interval on the sync link, ms (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_ms: Option<u64>,
    /// Peer declared lost after this long without a frame, ms (default 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    /// Pages the guest rewrites from sync to sync left writable, at most
    /// (default 64; 0: every harvested page is write-protected again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_writable_pages: Option<usize>,
    /// Epochs sent and not yet acknowledged at once, at most (event-driven
    /// mode; default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epochs_in_flight: Option<usize>,
    /// An authenticated but unencrypted link (a trusted, dedicated link;
    /// the standby must be started with `--plaintext-link`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub plaintext: bool,
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

    /// Whether the request starts a long operation: the VMM answers at once
    /// (202, or its progress with `?follow`) and runs it on a worker.
    pub fn is_operation(&self) -> bool {
        matches!(
            self,
            ApiRequest::Migrate { .. }
                | ApiRequest::MigrateLocal { .. }
                | ApiRequest::Snapshot { .. }
                | ApiRequest::WarmRestart { prepare: false, .. }
                | ApiRequest::FtStart(_)
        )
    }
}
