//! Requests answered on the API's own threads from [`Shared`] state —
//! queries, progress and cancels — so that they are answered at once
//! whatever the main loop or a worker is doing (a migration through a slow
//! link, a standby following its primary, a VM still arriving).

use std::time::Duration;

use serde_json::{json, Value};

use crate::api::{ActionError, ApiRequest, LineStream, Reply};
use crate::operation::{OpError, OpKind};

use super::shared::{Role, Shared};

/// How often a follower of an operation gets a line while nothing else
/// changes (progress counters move without a notification).
const FOLLOW_EVERY: Duration = Duration::from_millis(250);

/// The answer to `request` if it needs neither the main loop nor the
/// machine's owner; `None` otherwise.
pub fn answer(
    shared: &Shared,
    request: &ApiRequest,
    follow: bool,
) -> Option<Result<Reply, ActionError>> {
    let json = |v: Value| Some(Ok(Reply::Json(v)));
    match request {
        ApiRequest::Info => json(info(shared)),
        ApiRequest::Config => Some(config(shared)),
        ApiRequest::Devices => Some(with_monitor(shared, |m| to_value(&m.devices()))),
        ApiRequest::Metrics => Some(with_monitor(shared, |m| to_value(&m.metrics()))),
        ApiRequest::FtStatus => json(to_value(&shared.ft.report())),
        ApiRequest::MigrationStatus => {
            let mut p = shared.migration.snapshot();
            if p.status.is_empty() {
                p.status = "idle".into();
            }
            json(to_value(&p))
        }
        ApiRequest::OperationStatus => Some(operation(shared, follow)),
        ApiRequest::MigrationCancel => Some(cancel(shared, Some(OpKind::Migrate))),
        // Whatever this VMM is: a standby's failover is an event too.
        ApiRequest::Events => Some(Ok(Reply::Stream(LineStream::new(
            shared.events.subscribe(),
        )))),
        ApiRequest::OperationCancel => Some(cancel(shared, None)),
        // In every role, like the events.
        ApiRequest::PrometheusMetrics => Some(Ok(Reply::Text {
            content_type: crate::metrics::CONTENT_TYPE,
            body: crate::metrics::exposition(shared),
        })),
        // Actions: refused here while there is nothing to act on.
        _ => match shared.role() {
            Role::Standby => Some(Err(ActionError::Conflict(
                "this VMM is a fault-tolerance standby: the VM runs on the primary (GET /vm/ft for the sync state)".into(),
            ))),
            Role::Starting(what) => Some(Err(ActionError::Conflict(format!(
                "this VMM is {what}: there is no VM here to act on yet"
            )))),
            Role::Ending => Some(Err(ActionError::Unavailable(
                "the VMM is shutting down".into(),
            ))),
            Role::Running => None,
        },
    }
}

fn to_value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or_else(|e| json!({ "error": e.to_string() }))
}

fn with_monitor(
    shared: &Shared,
    f: impl FnOnce(&vmm::machine::MachineMonitor) -> Value,
) -> Result<Reply, ActionError> {
    match shared.monitor() {
        Some(m) => Ok(Reply::Json(f(&m))),
        None => Err(ActionError::Conflict(match shared.role() {
            Role::Standby => "this VMM is a fault-tolerance standby: the VM runs on the primary (GET /vm for this VMM, GET /vm/ft for the sync state)".into(),
            Role::Starting(what) => format!("this VMM is {what}: there is no VM here yet"),
            _ => "there is no VM here".into(),
        })),
    }
}

/// `GET /vm/config`: the machine's configuration with, as `process`, the
/// role and process settings in effect; a VMM without its VM (a standby, a
/// destination) answers with `process` alone.
fn config(shared: &Shared) -> Result<Reply, ActionError> {
    let process = shared.process.get().cloned().unwrap_or(Value::Null);
    Ok(Reply::Json(match shared.monitor() {
        Some(m) => {
            let mut v = to_value(m.config());
            if let Some(obj) = v.as_object_mut() {
                obj.insert("process".into(), process);
            }
            v
        }
        None => json!({ "process": process }),
    }))
}

/// `GET /vm`: the VM, or — on a standby or a VMM still waiting for its VM
/// — what this VMM is, so that a monitor always sees its pid, version,
/// uptime and, if known, the VM's id and name.
fn info(shared: &Shared) -> Value {
    let (id, name) = shared.events.identity();
    let operation = shared
        .operations
        .running()
        .map(|(kind, id)| json!({ "id": id, "kind": kind }));
    let process = json!({
        "pid": std::process::id(),
        "version": env!("CARGO_PKG_VERSION"),
        "process_uptime_ms": shared.started.elapsed().as_millis() as u64,
        "id": id,
        "name": name,
    });
    let mut v = match (shared.monitor(), shared.role()) {
        (Some(m), role) => {
            let c = m.config();
            json!({
                "state": m.state(),
                "role": if role == Role::Ending { "ending" } else if shared.ft.report().role == "primary" { "primary" } else { "vm" },
                "vcpus": c.vcpus,
                "memory_bytes": c.memory_bytes,
                "memory_backing": c.memory_backing,
                "kernel": c.kernel,
                "cmdline": c.cmdline,
                "uptime_ms": m.uptime().as_millis() as u64,
                "guest_uptime_ms": m.guest_uptime().as_millis() as u64,
                "reboots": shared.reboots(),
                "operation": operation,
            })
        }
        (None, Role::Standby) => json!({
            "state": "standby",
            "role": "standby",
            "ft_state": shared.ft.report().state,
            "uptime_ms": shared.started.elapsed().as_millis() as u64,
        }),
        (None, Role::Starting(what)) => json!({ "state": "starting", "role": what }),
        (None, _) => json!({ "state": "ending", "role": "none" }),
    };
    if let (Some(obj), Some(p)) = (v.as_object_mut(), process.as_object()) {
        obj.extend(p.clone());
    }
    v
}

fn operation(shared: &Shared, follow: bool) -> Result<Reply, ActionError> {
    let Some(view) = shared.operations.view() else {
        return Err(ActionError::NotFound(
            "no long operation has run in this VMM".into(),
        ));
    };
    if !follow {
        return Ok(Reply::Json(view));
    }
    let id = view["id"].as_u64().unwrap_or_default();
    Ok(Reply::Stream(LineStream::new(
        shared.operations.follow(id, FOLLOW_EVERY),
    )))
}

/// A follower of operation `id`.
pub fn follower(shared: &Shared, id: u64) -> LineStream {
    LineStream::new(shared.operations.follow(id, FOLLOW_EVERY))
}

fn cancel(shared: &Shared, kind: Option<OpKind>) -> Result<Reply, ActionError> {
    match shared.operations.cancel(kind) {
        Ok(id) => Ok(Reply::Json(json!({ "cancelling": true, "operation": id }))),
        Err(OpError::NothingRunning) if kind == Some(OpKind::Migrate) => {
            Err(ActionError::Conflict("no live migration is running".into()))
        }
        Err(e) => Err(ActionError::Conflict(e.to_string())),
    }
}
