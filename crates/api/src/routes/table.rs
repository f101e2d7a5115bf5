//! The route table: every action's method, path, body fields and summary.

/// An HTTP method the API uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// A query.
    Get,
    /// An action.
    Put,
}

impl Method {
    /// As written in a request line.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Put => "PUT",
        }
    }
}

/// The JSON type of a body field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldType {
    /// A string.
    String,
    /// A file path (a string).
    Path,
    /// `true` or `false`.
    Boolean,
    /// A non-negative integer.
    Integer,
}

/// One field of a request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// Its name.
    pub name: &'static str,
    /// Its type.
    pub ty: FieldType,
    /// Whether the request must give it.
    pub required: bool,
}

const fn required(name: &'static str, ty: FieldType) -> Field {
    Field {
        name,
        ty,
        required: true,
    }
}

const fn optional(name: &'static str, ty: FieldType) -> Field {
    Field {
        name,
        ty,
        required: false,
    }
}

/// One route: a method and path, the action it builds, its body and what it
/// does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// The method.
    pub method: Method,
    /// The path.
    pub path: &'static str,
    /// The [`ApiRequest`] variant built.
    pub action: &'static str,
    /// The body's fields; none: the body may be empty or any JSON object.
    pub body: &'static [Field],
    /// Whether `?follow` is accepted (the answer is a stream of progress
    /// lines until the operation ends).
    pub follow: bool,
    /// What it does.
    pub summary: &'static str,
}

const fn query(path: &'static str, action: &'static str, summary: &'static str) -> Route {
    Route {
        method: Method::Get,
        path,
        action,
        body: &[],
        follow: false,
        summary,
    }
}

const fn command(path: &'static str, action: &'static str, summary: &'static str) -> Route {
    Route {
        method: Method::Put,
        path,
        action,
        body: &[],
        follow: false,
        summary,
    }
}

/// A long operation: a PUT with a body, `?follow` accepted.
const fn operation(
    path: &'static str,
    action: &'static str,
    body: &'static [Field],
    summary: &'static str,
) -> Route {
    Route {
        method: Method::Put,
        path,
        action,
        body,
        follow: true,
        summary,
    }
}

use FieldType::{Boolean, Integer, Path, String as Text};

/// Every route of the API.
pub const ROUTES: &[Route] = &[
    query("/vm", "Info", "VM info and state"),
    query("/vm/config", "Config", "the machine configuration"),
    query("/vm/devices", "Devices", "devices and their request counters"),
    query("/vm/metrics", "Metrics", "KVM exits by reason, memory pages, device counters, pauses"),
    command("/vm/pause", "Pause", "pause the vCPUs, then the devices"),
    command("/vm/resume", "Resume", "resume a paused VM"),
    command("/vm/shutdown", "Shutdown", "stop the VM; the kemari process exits 0"),
    operation(
        "/vm/snapshot",
        "Snapshot",
        &[required("dir", Path), optional("exit", Boolean), optional("force", Boolean)],
        "full snapshot (state + sparse memory image with per-extent checksums) into dir; exit: end the VMM once saved; force: replace a snapshot already in dir (refused otherwise)",
    ),
    operation(
        "/vm/warm-restart",
        "WarmRestart",
        &[required("dir", Path), optional("prepare", Boolean)],
        "save the small state, keep memory in its file, end the VMM (or hand the VM to a successor waiting on dir); prepare: only write dir/config.json",
    ),
    operation(
        "/vm/migrate-local",
        "MigrateLocal",
        &[required("socket", Path)],
        "zero-copy migration to the kemari started with --incoming-local socket",
    ),
    operation(
        "/vm/migrate",
        "Migrate",
        &[
            required("to", Text),
            required("key_file", Path),
            optional("max_downtime_ms", Integer),
            optional("max_rounds", Integer),
            optional("max_bandwidth_mib_s", Integer),
            optional("connections", Integer),
            optional("plaintext", Boolean),
        ],
        "live migration over TCP to the kemari started with --incoming to",
    ),
    query("/vm/migration", "MigrationStatus", "progress of the running or last live migration"),
    command("/vm/migration/cancel", "MigrationCancel", "cancel the running live migration"),
    operation(
        "/vm/ft/start",
        "FtStart",
        &[
            required("peer", Text),
            required("key_file", Path),
            optional("periodic_ms", Integer),
            optional("heartbeat_ms", Integer),
            optional("timeout_ms", Integer),
            optional("keep_writable_pages", Integer),
            optional("epochs_in_flight", Integer),
            optional("plaintext", Boolean),
        ],
        "protect the VM with the standby started with --ft-standby peer",
    ),
    query("/vm/ft", "FtStatus", "fault-tolerance role, state and metrics"),
    command("/vm/ft/stop", "FtStop", "end protection; the standby exits"),
    Route {
        follow: true,
        ..query("/vm/operation", "OperationStatus", "the current or last long operation")
    },
    command("/vm/operation/cancel", "OperationCancel", "cancel the current long operation"),
    query(
        "/vm/events",
        "Events",
        "the VM's events as they happen: a stream (application/x-ndjson) held open until the VMM ends",
    ),
    query(
        "/metrics",
        "PrometheusMetrics",
        "counters, gauges and histograms in the Prometheus text format (text/plain; version=0.0.4)",
    ),
];
