//! The VMM process's main loop: builds the machine, serves the API, and ends
//! the process when the guest powers off or the API asks.
//!
//! Exit status: 0 after a clean guest poweroff, a guest reset, an API shutdown
//! or SIGTERM/SIGINT, or a fault-tolerance standby whose primary ended
//! protection; 1 when the VMM fails (bad configuration, KVM error, a standby
//! that may not fail over); 3 when the guest reports a failure through the
//! exit port (code != 0).

use std::process::ExitCode;
use std::sync::mpsc::{channel, Sender};
use std::sync::Mutex;

use serde_json::json;
use std::time::Instant;

use vmm::machine::{Machine, MachineError, RunState};
use vmm::persist::snapshot::{self, SnapshotError};
use vmm::vstate::{VmEvent, VmEventSink};

use crate::api::routes::ApiRequest;
use crate::api::routes::FtStartRequest;
use crate::api::server::{ApiServer, ServerError, ServerOptions};
use crate::api::{ActionError, Reply, Routed};
use crate::cli::{Args, CliError};
use ft::{fence::Fence, gate::FtGate, status::FtShared, status::FtState};
use std::sync::Arc;
use transfer::modes::{live, local, warm};
use transfer::{Cancel, ProgressCell, TransferError};

/// The live migration's progress and cancel switch, shared with the API
/// thread.
#[derive(Debug, Default)]
pub struct MigrationShared {
    progress: ProgressCell,
    cancel: std::sync::Mutex<Arc<Cancel>>,
}

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
    /// An incoming hand-over (migration, warm restart) failed.
    #[error(transparent)]
    Transfer(#[from] TransferError),
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
    /// Fault tolerance (standby, fence).
    #[error(transparent)]
    Ft(#[from] ft::FtError),
}

enum Control {
    Vm(VmEvent),
    Api(PendingRequest),
    Signal(i32),
}

/// The main thread's answer to a request.
#[derive(Debug, Clone, PartialEq)]
struct ApiResponse {
    /// HTTP-like status, turned into a typed reply by [`into_reply`](Self::into_reply).
    status: u16,
    /// JSON body.
    body: serde_json::Value,
}

impl ApiResponse {
    /// 200 with `body`.
    fn ok(body: serde_json::Value) -> Self {
        ApiResponse { status: 200, body }
    }

    /// An error with `status` and a message.
    fn error(status: u16, message: impl std::fmt::Display) -> Self {
        ApiResponse {
            status,
            body: json!({ "error": message.to_string() }),
        }
    }

    /// The typed answer the API server takes.
    fn into_reply(self) -> Result<Reply, ActionError> {
        if self.status == 200 {
            return Ok(Reply::Json(self.body));
        }
        let message = self.body["error"].as_str().unwrap_or("error").to_owned();
        Err(match self.status {
            400 => ActionError::BadRequest(message),
            409 => ActionError::Conflict(message),
            502 => ActionError::PeerFailed(message),
            503 => ActionError::Unavailable(message),
            _ => ActionError::Internal(message),
        })
    }
}

/// A routed request waiting for the main thread.
struct PendingRequest {
    /// The action.
    request: ApiRequest,
    /// Where the answer goes.
    reply: Sender<ApiResponse>,
}

/// The API handler: what can be answered beside the main thread is, the
/// rest waits for the main thread's answer.
fn api_handler(
    forward: impl Fn(PendingRequest) + Send + Sync + 'static,
    migration: Arc<MigrationShared>,
    ft: Arc<FtShared>,
) -> crate::api::Handler {
    Arc::new(move |routed: Routed| {
        if let Some(r) = direct_api(&migration, &ft, &routed.request) {
            return r.into_reply();
        }
        match routed.request {
            ApiRequest::OperationStatus => {
                return Err(ActionError::NotFound(
                    "operation tracking is not implemented yet: GET /vm/migration or GET /vm/ft"
                        .into(),
                ))
            }
            ApiRequest::OperationCancel => {
                return Err(ActionError::Conflict(
                    "operation tracking is not implemented yet: PUT /vm/migration/cancel".into(),
                ))
            }
            _ => {}
        }
        let (tx, rx) = channel();
        forward(PendingRequest {
            request: routed.request,
            reply: tx,
        });
        rx.recv()
            .map_err(|_| ActionError::Unavailable("the VMM is shutting down".into()))?
            .into_reply()
    })
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
    let mut overrides = Ok(());
    let mut adjust = |config: &mut vmm::config::MachineConfig| {
        overrides = args.apply_restore_overrides(config);
    };
    if let (Some(dir), true) = (&args.restore, args.await_state) {
        let prepared = warm::prepare(dir)?;
        let machine = prepared.await_state(sink, args.start_paused, &mut adjust)?;
        overrides?;
        return Ok(machine);
    }
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
        let key = transfer::key::read_key(key_file)?;
        let machine = live::migrate_in(listen, &key, sink, &mut adjust)?;
        overrides?;
        return Ok(machine);
    }
    if let Some(socket) = &args.incoming_local {
        let machine = local::migrate_in(socket, args.memory_file.as_deref(), sink, &mut adjust)?;
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
    let migration = Arc::new(MigrationShared::default());
    let ft_shared = Arc::new(FtShared::default());
    let (m, f) = (migration.clone(), ft_shared.clone());
    let _api = match &api_socket {
        Some(path) => Some(ApiServer::start(
            path,
            ServerOptions {
                socket: args.api_socket_options()?,
                ..ServerOptions::default()
            },
            api_handler(forwarder(&tx, Control::Api), m, f),
        )?),
        None => None,
    };
    // Declared after the server, so dropped before it when `run` returns:
    // requests still queued for the main thread are then answered 503 at
    // once, and the server's shutdown need not wait for them.
    let rx = rx;
    // The fence: a primary holds it for its whole life; a standby takes it
    // before it fails over.
    let mut _fence: Option<Fence> = None;
    let mut machine = if let Some(listen) = &args.ft_standby {
        match standby(args, listen, sink, &ft_shared)? {
            ft::standby::StandbyOutcome::FailedOver(m, fence) => {
                _fence = fence;
                m
            }
            ft::standby::StandbyOutcome::PrimaryStopped(reason) => {
                eprintln!("kemari: standby done: the primary ended protection ({reason})");
                return Ok(ExitCode::SUCCESS);
            }
        }
    } else {
        if let Some(path) = &args.ft_fence {
            _fence =
                Some(Fence::acquire(path, std::time::Duration::ZERO).map_err(ft::FtError::from)?);
        }
        make_machine(args, sink)?
    };
    let mut ft_gate: Option<Arc<FtGate>> = None;
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
        if let (Control::Vm(_) | Control::Signal(_), Some(g)) = (&event, &ft_gate) {
            // The VM ends here on purpose: the standby must not take over.
            g.stop("the primary VM ended");
        }
        match event {
            Control::Vm(VmEvent::Poweroff { code }) => {
                end_vm(machine);
                if code == 0 {
                    tracing::info!("guest powered off");
                    return Ok(ExitCode::SUCCESS);
                }
                eprintln!("kemari: guest reported failure (exit code {code})");
                return Ok(ExitCode::from(EXIT_GUEST_FAILURE));
            }
            Control::Vm(VmEvent::Reset) => {
                tracing::info!("guest reset: ending the VM");
                end_vm(machine);
                return Ok(ExitCode::SUCCESS);
            }
            Control::Vm(VmEvent::Error(message)) => {
                end_vm(machine);
                return Err(ProcessError::VmFailed(message));
            }
            Control::Signal(sig) => {
                tracing::info!(signal = sig, "signal received: shutting down");
                end_vm(machine);
                return Ok(ExitCode::SUCCESS);
            }
            Control::Api(PendingRequest { request, reply }) => {
                let (resp, next) = match request {
                    ApiRequest::FtStart(req) => (
                        ft_start(&mut machine, &req, &ft_shared, &mut ft_gate),
                        After::Continue,
                    ),
                    ApiRequest::FtStop => {
                        (ft_stop(&machine, &ft_shared, &mut ft_gate), After::Continue)
                    }
                    _ if ft_busy(&ft_shared) && request.moves_vm() => (
                        ApiResponse::error(
                            409,
                            "the VM is protected by fault tolerance: `kemarictl ft stop` first",
                        ),
                        After::Continue,
                    ),
                    request => handle_api(&mut machine, request, &migration),
                };
                if let (After::Exit, Some(g)) = (&next, &ft_gate) {
                    g.stop("the primary VMM is shutting down");
                }
                let _ = reply.send(resp);
                if let After::Exit = next {
                    end_vm(machine);
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

/// Follows a primary as its fault-tolerance standby.
fn standby(
    args: &Args,
    listen: &str,
    sink: VmEventSink,
    shared: &Arc<FtShared>,
) -> Result<ft::standby::StandbyOutcome, ProcessError> {
    let key_file = args.migration_key_file.as_ref().ok_or(CliError::Missing(
        "--migration-key-file (with --ft-standby)",
    ))?;
    let opts = ft::standby::StandbyOptions {
        listen: listen.to_owned(),
        key: transfer::key::read_key(key_file)?,
        fence: args.ft_fence.clone(),
        fence_cmd: args.ft_fence_cmd.clone(),
    };
    let mut overrides = Ok(());
    let outcome = ft::standby::run(
        &opts,
        sink,
        &mut |config| overrides = args.apply_restore_overrides(config),
        shared,
    )?;
    overrides?;
    Ok(outcome)
}

/// Whether fault tolerance protects (or is setting up protection for) the VM.
fn ft_busy(shared: &FtShared) -> bool {
    matches!(shared.state(), FtState::Protected | FtState::Syncing)
}

fn ft_start(
    machine: &mut Machine,
    req: &FtStartRequest,
    shared: &Arc<FtShared>,
    gate: &mut Option<Arc<FtGate>>,
) -> ApiResponse {
    let key = match transfer::key::read_key(&req.key_file) {
        Ok(k) => k,
        Err(e) => return ApiResponse::error(400, e),
    };
    let (mode, heartbeat, timeout) =
        match ft::timing(req.periodic_ms, req.heartbeat_ms, req.timeout_ms) {
            Ok(t) => t,
            Err(e) => return ApiResponse::error(400, e),
        };
    let keep_writable = match ft::keep_writable(req.keep_writable_pages) {
        Ok(k) => k,
        Err(e) => return ApiResponse::error(400, e),
    };
    let opts = ft::primary::FtStartOptions {
        peer: req.peer.clone(),
        key,
        mode,
        heartbeat,
        timeout,
        keep_writable,
    };
    match ft::primary::start(machine, &opts, shared, &Cancel::new()) {
        Ok(g) => {
            *gate = Some(g);
            to_json(&shared.report())
        }
        Err(ft::FtError::State(s)) => ApiResponse::error(409, s),
        Err(e) => ApiResponse::error(502, e),
    }
}

fn ft_stop(machine: &Machine, shared: &FtShared, gate: &mut Option<Arc<FtGate>>) -> ApiResponse {
    let Some(g) = gate.take() else {
        return ApiResponse::error(409, "fault tolerance is not active");
    };
    g.stop("stopped through the API");
    if let Err(e) = machine.set_output_gate(Arc::new(vmm::output::PassThroughGate)) {
        return ApiResponse::error(500, e);
    }
    to_json(&shared.report())
}

/// Requests answered on the API thread, even while the main thread migrates
/// or follows a primary.
fn direct_api(
    migration: &MigrationShared,
    ft: &FtShared,
    request: &ApiRequest,
) -> Option<ApiResponse> {
    if let ApiRequest::FtStatus = request {
        return Some(to_json(&ft.report()));
    }
    if matches!(ft.state(), FtState::Standby | FtState::FailingOver) {
        return Some(ApiResponse::error(
            409,
            "this VMM is a fault-tolerance standby: the VM runs on the primary (GET /vm/ft for the sync state)",
        ));
    }
    match request {
        ApiRequest::MigrationStatus => Some(to_json(&migration.progress.snapshot())),
        ApiRequest::MigrationCancel => {
            let running = migration.progress.snapshot().status == "running";
            if running {
                let cancel = migration
                    .cancel
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                Some(match cancel.cancel() {
                    transfer::CancelOutcome::TooLate => {
                        ApiResponse::error(409, "too late: the migration passed its commit point")
                    }
                    _ => ApiResponse::ok(json!({ "cancelling": true })),
                })
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
    migration: &MigrationShared,
) -> (ApiResponse, After) {
    match request {
        ApiRequest::Migrate {
            to,
            key_file,
            max_downtime_ms,
            max_rounds,
        } => {
            let key = match transfer::key::read_key(&key_file) {
                Ok(k) => k,
                Err(e) => return (ApiResponse::error(400, e), After::Continue),
            };
            let mut limits = transfer::precopy::DowntimeEstimate::default();
            if let Some(ms) = max_downtime_ms {
                limits.max_downtime = std::time::Duration::from_millis(ms);
            }
            if let Some(r) = max_rounds {
                limits.max_rounds = r.max(1);
            }
            let cancel = Arc::new(Cancel::new());
            *migration.cancel.lock().unwrap_or_else(|p| p.into_inner()) = cancel.clone();
            match live::migrate_out(machine, &to, &key, limits, &cancel, &migration.progress) {
                Ok(report) => {
                    finish_at_idle_priority();
                    (ApiResponse::ok(json!(report)), After::Exit)
                }
                Err(e) => (
                    ApiResponse::error(409, format!("live migration failed: {e}")),
                    After::Continue,
                ),
            }
        }
        ApiRequest::Shutdown => (
            ApiResponse::ok(json!({ "state": "shutting_down" })),
            After::Exit,
        ),
        ApiRequest::Snapshot { dir, exit } => snapshot_full(machine, &dir, exit),
        ApiRequest::WarmRestart { dir, prepare } => warm_restart(machine, &dir, prepare),
        ApiRequest::MigrateLocal { socket } => {
            match local::migrate_out(machine, &socket, &Cancel::new(), &ProgressCell::default()) {
                Ok(report) => {
                    tracing::info!(?report, "local migration done: exiting");
                    finish_at_idle_priority();
                    (ApiResponse::ok(json!(report)), After::Exit)
                }
                Err(e) => (
                    ApiResponse::error(409, format!("zero-copy migration failed: {e}")),
                    After::Continue,
                ),
            }
        }
        other => (handle_query(machine, other), After::Continue),
    }
}

/// Once the VM runs in another process, this one only has to end: it does
/// so at idle priority (SCHED_IDLE, inherited by the reaper it forks to
/// destroy the KVM VM), so that its exit never takes a CPU from the new
/// VMM's vCPUs, which are starting on the same host. Every thread of it:
/// the vCPU, device and console threads end too, and with only the main
/// thread lowered, a 4 GiB live migration's guest-visible pause on this
/// host had a median of 0.73 ms against 0.61 with all of them (idle guest,
/// 24 runs each, alternated).
fn finish_at_idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    let threads: Vec<libc::pid_t> = std::fs::read_dir("/proc/self/task")
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        // At least this thread (pid 0 = the caller).
        .unwrap_or_else(|_| vec![0]);
    for tid in threads {
        // SAFETY: sched_setscheduler only reads `param`; `tid` is a thread
        // of this process (one that ended since is refused with ESRCH).
        if unsafe { libc::sched_setscheduler(tid, libc::SCHED_IDLE, &param) } != 0 {
            tracing::debug!(
                tid,
                error = %std::io::Error::last_os_error(),
                "cannot lower a thread's priority for the exit"
            );
        }
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
    let saved = machine
        .pause_and_save()
        .map_err(|e| e.to_string())
        .and_then(|state| write(&state, machine.memory_file()).map_err(|e| e.to_string()));
    match saved {
        Ok(stats) => Ok((stats, started.elapsed().as_millis() as u64, was_running)),
        Err(e) => {
            if was_running && machine.state() == RunState::Paused {
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
        drop(release_backends(machine));
        return (ApiResponse::ok(body), After::Exit);
    }
    if was_running {
        if let Err(e) = machine.resume() {
            return (ApiResponse::error(500, e), After::Continue);
        }
    }
    (ApiResponse::ok(body), After::Continue)
}

/// Ends the VM as this process ends: stops it, lets go of its disks and
/// TAPs (the VM's next VMM may open them at once), leaves the KVM VM's
/// destruction to a reaper process (`teardown.rs`: 15–17 ms in the kernel
/// here, which whoever waits for this process's exit would otherwise wait
/// for too), and shuts the machine down.
fn end_vm(mut machine: Machine) {
    if machine.state() == RunState::Running {
        if let Err(e) = machine.pause() {
            // A vCPU that already ended (guest error) cannot be asked.
            tracing::debug!(error = %e, "cannot stop the VM before ending it");
        }
    }
    if machine.state() == RunState::Paused {
        drop(release_backends(&mut machine));
    }
    crate::teardown::fork_reaper();
    machine.shutdown();
}

/// Lets go of the disks and TAPs of a machine paused for good, so that the
/// VM's next VMM can open them while this process still exits; returns the
/// TAP fds (to hand over, or drop).
fn release_backends(machine: &mut Machine) -> Vec<std::fs::File> {
    machine.release_backends().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot release the device backends before exiting");
        Vec::new()
    })
}

fn warm_restart(
    machine: &mut Machine,
    dir: &std::path::Path,
    prepare: bool,
) -> (ApiResponse, After) {
    if prepare {
        return match warm::write_config(dir, machine.config()) {
            Ok(config) => (
                ApiResponse::ok(json!({ "dir": dir, "config": config })),
                After::Continue,
            ),
            Err(e) => (ApiResponse::error(409, e), After::Continue),
        };
    }
    let cancel = Cancel::new();
    match warm::restart_out(machine, dir, &cancel, &ProgressCell::default()) {
        Ok(report) => {
            if report.successor.is_some() {
                finish_at_idle_priority();
            }
            (ApiResponse::ok(json!(report)), After::Exit)
        }
        Err(e) if cancel.is_committed() => {
            // The state is saved all the same: nothing is lost.
            let message = format!(
                "state saved in {}, but the successor failed ({e}): `kemari --restore {}` resumes the VM",
                dir.display(),
                dir.display()
            );
            tracing::error!("warm restart: {message}");
            (ApiResponse::error(502, message), After::Exit)
        }
        Err(e) => (
            ApiResponse::error(409, format!("warm restart failed: {e}")),
            After::Continue,
        ),
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
        | ApiRequest::MigrationCancel
        | ApiRequest::FtStart(_)
        | ApiRequest::FtStatus
        | ApiRequest::FtStop
        | ApiRequest::OperationStatus
        | ApiRequest::OperationCancel => ApiResponse::error(500, "not a query"),
    }
}
