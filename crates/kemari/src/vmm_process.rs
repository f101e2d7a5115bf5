//! The VMM process's main loop: builds the machine, serves the API, and ends
//! the process when the guest powers off or the API asks.
//!
//! Exit status: 0 after a clean guest poweroff, a guest reset, an API shutdown
//! or SIGTERM/SIGINT; 1 when the VMM fails (bad configuration, KVM error);
//! 3 when the guest reports a failure through the exit port (code != 0).

use std::process::ExitCode;
use std::sync::mpsc::{channel, Sender};
use std::sync::Mutex;

use serde_json::json;
use std::time::Instant;

use vmm::machine::{Machine, MachineError, RunState};
use vmm::persist::snapshot::{self, SnapshotError};
use vmm::vstate::{VmEvent, VmEventSink};

use crate::api::routes::ApiRequest;
use crate::api::server::{ApiResponse, ApiServer, PendingRequest, ServerError};
use crate::cli::{Args, CliError};
use crate::migration::{local, tcp};
use std::sync::Arc;

/// Exit status when the guest reported a failure.
pub const EXIT_GUEST_FAILURE: u8 = 3;

/// Errors that end the VMM process.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// Bad command line or config file.
    #[error(transparent)]
    Cli(#[from] CliError),
    /// The machine could not be built or failed.
    #[error(transparent)]
    Machine(#[from] MachineError),
    /// An incoming live migration failed.
    #[error(transparent)]
    LiveMigration(#[from] tcp::MigrationError),
    /// An incoming migration failed.
    #[error(transparent)]
    Migration(#[from] local::LocalMigrationError),
    /// A snapshot could not be read.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The API server could not start.
    #[error(transparent)]
    Api(#[from] ServerError),
    /// The guest or KVM failed while running.
    #[error("VM failed: {0}")]
    VmFailed(String),
    /// Signal handling could not be set up.
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
}

enum Control {
    Vm(VmEvent),
    Api(PendingRequest),
    Signal(i32),
}

fn forwarder<T: Send + 'static>(
    tx: &Sender<Control>,
    wrap: fn(T) -> Control,
) -> impl Fn(T) + Send + Sync + 'static {
    let tx = Mutex::new(tx.clone());
    move |v| {
        let _ = tx.lock().unwrap_or_else(|p| p.into_inner()).send(wrap(v));
    }
}

/// Builds the machine `args` describe: a fresh boot, or a restore from a
/// snapshot directory.
fn make_machine(args: &Args, sink: VmEventSink) -> Result<Machine, ProcessError> {
    let gate = std::sync::Arc::new(vmm::output::PassThroughGate);
    if let Some(dir) = &args.restore {
        let mut state = snapshot::read_state(dir)?;
        args.apply_restore_overrides(&mut state.config)?;
        let memory = snapshot::load_memory(dir, &state, &args.memory_backing())?;
        state.config.memory_backing = memory.backing().clone();
        tracing::info!(dir = %dir.display(), "restoring VM");
        return Ok(Machine::restore(
            &state,
            memory,
            sink,
            args.start_paused,
            gate,
        )?);
    }
    if let Some(listen) = &args.incoming {
        let key_file = args
            .migration_key_file
            .as_ref()
            .ok_or(CliError::Missing("--migration-key-file (with --incoming)"))?;
        let key = tcp::read_key(key_file)?;
        let mut overrides = Ok(());
        let machine = tcp::migrate_in(listen, &key, sink, |config| {
            overrides = args.apply_restore_overrides(config);
        })?;
        overrides?;
        return Ok(machine);
    }
    if let Some(socket) = &args.incoming_local {
        let mut overrides = Ok(());
        let machine = local::migrate_in(socket, sink, |config| {
            overrides = args.apply_restore_overrides(config);
        })?;
        overrides?;
        return Ok(machine);
    }
    let (config, _) = args.machine_config()?;
    Ok(Machine::build_with_gate(
        config,
        sink,
        args.start_paused,
        gate,
    )?)
}

/// Runs the VM described by `args` until it ends.
pub fn run(args: &Args) -> Result<ExitCode, ProcessError> {
    let api_socket = args.api_socket_path()?;
    let (tx, rx) = channel();
    let sink = VmEventSink::new(forwarder(&tx, Control::Vm));
    // The API socket first: a socket in use is refused before any VM exists.
    let migration = Arc::new(tcp::MigrationShared::default());
    let m = migration.clone();
    let _api = match &api_socket {
        Some(path) => Some(ApiServer::start_with_direct(
            path,
            forwarder(&tx, Control::Api),
            move |req| direct_api(&m, req),
        )?),
        None => None,
    };
    let mut machine = make_machine(args, sink)?;
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT])
        .map_err(ProcessError::Signals)?;
    let sig_tx = forwarder(&tx, Control::Signal);
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for s in signals.forever() {
                sig_tx(s);
            }
        })
        .map_err(ProcessError::Signals)?;
    drop(tx);

    loop {
        let Ok(event) = rx.recv() else {
            return Err(ProcessError::VmFailed("all event sources are gone".into()));
        };
        match event {
            Control::Vm(VmEvent::Poweroff { code }) => {
                machine.shutdown();
                if code == 0 {
                    tracing::info!("guest powered off");
                    return Ok(ExitCode::SUCCESS);
                }
                eprintln!("kemari: guest reported failure (exit code {code})");
                return Ok(ExitCode::from(EXIT_GUEST_FAILURE));
            }
            Control::Vm(VmEvent::Reset) => {
                tracing::info!("guest reset: ending the VM");
                machine.shutdown();
                return Ok(ExitCode::SUCCESS);
            }
            Control::Vm(VmEvent::Error(message)) => {
                machine.shutdown();
                return Err(ProcessError::VmFailed(message));
            }
            Control::Signal(sig) => {
                tracing::info!(signal = sig, "signal received: shutting down");
                machine.shutdown();
                return Ok(ExitCode::SUCCESS);
            }
            Control::Api(PendingRequest { request, reply }) => {
                let (resp, next) = handle_api(&mut machine, request, &migration);
                let _ = reply.send(resp);
                if let After::Exit = next {
                    machine.shutdown();
                    return Ok(ExitCode::SUCCESS);
                }
            }
        }
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> ApiResponse {
    match serde_json::to_value(v) {
        Ok(v) => ApiResponse::ok(v),
        Err(e) => ApiResponse::error(500, e),
    }
}

/// What the main loop does after answering a request.
enum After {
    Continue,
    Exit,
}

/// Requests answered on the API thread, even while the main thread migrates.
fn direct_api(migration: &tcp::MigrationShared, request: &ApiRequest) -> Option<ApiResponse> {
    match request {
        ApiRequest::MigrationStatus => Some(to_json(&migration.snapshot())),
        ApiRequest::MigrationCancel => {
            let running = migration.snapshot().status == "running";
            if running {
                migration
                    .cancel
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                Some(ApiResponse::ok(json!({ "cancelling": true })))
            } else {
                Some(ApiResponse::error(409, "no live migration is running"))
            }
        }
        _ => None,
    }
}

fn handle_api(
    machine: &mut Machine,
    request: ApiRequest,
    migration: &tcp::MigrationShared,
) -> (ApiResponse, After) {
    match request {
        ApiRequest::Migrate {
            to,
            key_file,
            max_downtime_ms,
            max_rounds,
        } => {
            let key = match tcp::read_key(&key_file) {
                Ok(k) => k,
                Err(e) => return (ApiResponse::error(400, e), After::Continue),
            };
            let mut limits = tcp::MigrationLimits::default();
            if let Some(ms) = max_downtime_ms {
                limits.max_downtime = std::time::Duration::from_millis(ms);
            }
            if let Some(r) = max_rounds {
                limits.max_rounds = r.max(1);
            }
            match tcp::migrate_out(machine, &to, &key, limits, migration) {
                Ok(report) => (ApiResponse::ok(json!(report)), After::Exit),
                Err(e) => (ApiResponse::error(409, e), After::Continue),
            }
        }
        ApiRequest::Shutdown => (
            ApiResponse::ok(json!({ "state": "shutting_down" })),
            After::Exit,
        ),
        ApiRequest::Snapshot { dir, exit } => snapshot_full(machine, &dir, exit),
        ApiRequest::WarmRestart { dir } => warm_restart(machine, &dir),
        ApiRequest::MigrateLocal { socket } => match local::migrate_out(machine, &socket) {
            Ok(report) => {
                tracing::info!(?report, "local migration done: exiting");
                (ApiResponse::ok(json!(report)), After::Exit)
            }
            Err(e) => (ApiResponse::error(409, e), After::Continue),
        },
        other => (handle_query(machine, other), After::Continue),
    }
}

/// Pauses the machine (if it runs), saves its state and writes it with
/// `write`; on failure resumes the machine. Returns the write's figures, the
/// pause time so far and whether the machine was running.
fn pause_and_save(
    machine: &mut Machine,
    write: impl FnOnce(
        &vmm::persist::VmState,
        &vmm::memory::GuestMemoryFile,
    ) -> Result<snapshot::SnapshotStats, SnapshotError>,
) -> Result<(snapshot::SnapshotStats, u64, bool), String> {
    let started = Instant::now();
    let was_running = machine.state() == RunState::Running;
    if was_running {
        machine.pause().map_err(|e| e.to_string())?;
    }
    let saved = machine
        .save_state()
        .map_err(|e| e.to_string())
        .and_then(|state| write(&state, machine.memory_file()).map_err(|e| e.to_string()));
    match saved {
        Ok(stats) => Ok((stats, started.elapsed().as_millis() as u64, was_running)),
        Err(e) => {
            if was_running {
                if let Err(re) = machine.resume() {
                    tracing::error!(error = %re, "cannot resume the VM after a failed save");
                }
            }
            Err(e)
        }
    }
}

fn snapshot_full(machine: &mut Machine, dir: &std::path::Path, exit: bool) -> (ApiResponse, After) {
    let (stats, paused_ms, was_running) =
        match pause_and_save(machine, |state, mem| snapshot::save_full(dir, state, mem)) {
            Ok(r) => r,
            Err(e) => return (ApiResponse::error(500, e), After::Continue),
        };
    tracing::info!(dir = %dir.display(), paused_ms, "snapshot written");
    let body = json!({
        "dir": dir,
        "state_bytes": stats.state_bytes,
        "memory_bytes_written": stats.memory.bytes_written,
        "memory_bytes_scanned": stats.memory.bytes_scanned,
        "paused_ms": paused_ms,
        "exit": exit,
    });
    if exit {
        return (ApiResponse::ok(body), After::Exit);
    }
    if was_running {
        if let Err(e) = machine.resume() {
            return (ApiResponse::error(500, e), After::Continue);
        }
    }
    (ApiResponse::ok(body), After::Continue)
}

fn warm_restart(machine: &mut Machine, dir: &std::path::Path) -> (ApiResponse, After) {
    match pause_and_save(machine, |state, mem| snapshot::save_warm(dir, state, mem)) {
        Err(e) => (ApiResponse::error(409, e), After::Continue),
        Ok((stats, paused_ms, _)) => {
            tracing::info!(dir = %dir.display(), paused_ms, "warm restart: state saved, exiting");
            (
                ApiResponse::ok(json!({
                    "dir": dir,
                    "state_bytes": stats.state_bytes,
                    "paused_ms": paused_ms,
                })),
                After::Exit,
            )
        }
    }
}

fn handle_query(machine: &mut Machine, request: ApiRequest) -> ApiResponse {
    match request {
        ApiRequest::Info => {
            let c = machine.config();
            ApiResponse::ok(json!({
                "state": machine.state(),
                "vcpus": c.vcpus,
                "memory_bytes": c.memory_bytes,
                "memory_backing": c.memory_backing,
                "kernel": c.kernel,
                "cmdline": c.cmdline,
                "uptime_ms": machine.uptime().as_millis() as u64,
                "pid": std::process::id(),
                "version": env!("CARGO_PKG_VERSION"),
            }))
        }
        ApiRequest::Config => to_json(machine.config()),
        ApiRequest::Devices => to_json(&machine.devices()),
        ApiRequest::Metrics => to_json(&machine.metrics()),
        ApiRequest::Pause => match machine.pause() {
            Ok(()) => ApiResponse::ok(json!({ "state": machine.state() })),
            Err(MachineError::State(s)) => {
                ApiResponse::error(409, format!("the VM is already {s}"))
            }
            Err(e) => ApiResponse::error(500, e),
        },
        ApiRequest::Resume => match machine.resume() {
            Ok(()) => ApiResponse::ok(json!({ "state": machine.state() })),
            Err(MachineError::State(s)) => {
                ApiResponse::error(409, format!("the VM is already {s}"))
            }
            Err(e) => ApiResponse::error(500, e),
        },
        ApiRequest::Shutdown
        | ApiRequest::Snapshot { .. }
        | ApiRequest::WarmRestart { .. }
        | ApiRequest::MigrateLocal { .. }
        | ApiRequest::Migrate { .. }
        | ApiRequest::MigrationStatus
        | ApiRequest::MigrationCancel => ApiResponse::error(500, "not a query"),
    }
}
