//! The VMM process: builds (or receives) the machine, serves the API, and
//! runs the main loop — guest events, API actions, signals and the ends of
//! long operations in, typed replies out — until the VM ends.
//!
//! ```text
//!  API threads ──queries, progress, cancels──▶ Shared (monitor, FT status, operations)
//!       │ actions                                   ▲
//!       ▼                                           │ progress
//!  main loop ──long operation + the Machine──▶ worker thread
//!       ▲ guest events, signals, Done{machine, result, after} ┘
//! ```
//!
//! The main loop never waits for a long operation: `migrate`,
//! `migrate-local`, `warm-restart`, `snapshot` and `ft start` run on a
//! worker that owns the machine meanwhile, and the API answers at once with
//! the operation (202) or follows it (`?follow`). Only this module's
//! callers choose the process's exit status:
//!
//! A guest reset reboots the guest in place (`reboot.rs`) unless
//! `--on-reboot exit`; a triple fault too with `--on-crash restart`.
//!
//! Exit status: 0 after a clean guest poweroff, a guest reset (with
//! `--on-reboot exit`), an API
//! shutdown or SIGTERM/SIGINT, a completed hand-over, or a fault-tolerance
//! standby whose primary ended protection; 1 when the VMM fails (bad
//! configuration, KVM error, a standby that may not fail over); 3 when the
//! guest reports a failure through the exit port (code != 0); 4 when the
//! guest crashed (a vCPU triple-faulted; its registers are in the log).

mod ending;
mod ft_events;
mod hardening;
mod progress_events;
mod queries;
mod reboot;
pub(crate) mod shared;
mod startup;
mod worker;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use vmm::machine::{Machine, MachineError};
use vmm::persist::snapshot::{self, SnapshotError};
use vmm::vstate::VmEvent;

use ft::fence::{Arbiter, FenceCommand, FenceSpec, HeldFence};
use ft::gate::FtGate;
use ft::status::FtState;
use transfer::modes::warm;
use transfer::precopy::DowntimeEstimate;
use transfer::{ProgressCell, TransferError};

use crate::api::server::ServerError;
use crate::api::{
    ActionError, ApiRequest, ApiServer, FtStartRequest, Reply, Routed, ServerOptions,
};
use crate::cli::{Args, CliError, OnCrash, OnReboot};
use crate::metrics::listener::MetricsListener;
use crate::operation::OpKind;

use self::ending::{end_vm, end_vm_within, finish_at_idle_priority, FENCE_LOST_STOP_BOUND};
use self::shared::{Role, Shared};
use self::worker::{After, Done, Op};

/// Exit status when the guest reported a failure.
pub const EXIT_GUEST_FAILURE: u8 = 3;

/// Exit status when the guest crashed (triple fault).
pub const EXIT_GUEST_CRASHED: u8 = 4;

/// How long the ending VMM lets the API write what followers of the last
/// operation are owed (its final line).
const FLUSH_GRACE: Duration = Duration::from_millis(500);
/// How long a VMM that handed its VM over waits, at normal priority, for
/// its operation's report to be written to the followers.
const HANDED_OVER_REPORT_GRACE: Duration = Duration::from_millis(50);

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
    /// The guest asked for a reboot (or crashed, with `--on-crash
    /// restart`) and its machine could not be built again.
    #[error("cannot reboot the guest")]
    Reboot(#[source] MachineError),
    /// Signal handling could not be set up.
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    /// Fault tolerance (standby, fence).
    #[error(transparent)]
    Ft(#[from] ft::FtError),
    /// The VMM could not confine itself (capabilities, seccomp).
    #[error(transparent)]
    Hardening(#[from] hardening::HardeningError),
    /// The fence command's helper process could not be started.
    #[error("cannot start the fence command's helper process")]
    FenceHelper(#[source] std::io::Error),
    /// The metrics listener (`--metrics-listen`) could not start.
    #[error(transparent)]
    Metrics(#[from] crate::metrics::listener::ListenError),
    /// The events file (`--events-file`) could not be opened, or its
    /// writer started.
    #[error("events file {path}: {cause}")]
    EventsFile {
        /// The file.
        path: std::path::PathBuf,
        /// The cause (in the message).
        cause: std::io::Error,
    },
}

/// An event to publish: its kind and details.
type Event = (&'static str, Value);

type Answer = Result<Reply, ActionError>;

enum Control {
    /// A guest event of the machine of this generation (each reboot makes
    /// a new one: a late event of the old machine is ignored).
    Vm(u64, VmEvent),
    /// The fence was lost (an etcd lease not renewed in time).
    FenceLost(String),
    Api(Routed, Sender<Answer>),
    Signal(i32),
    Done(Box<Done>),
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

/// The API handler: queries, progress and cancels from shared state on the
/// API's thread; actions through the main loop, which answers at once.
fn api_handler(shared: Arc<Shared>, tx: Sender<Control>) -> crate::api::Handler {
    let tx = Mutex::new(tx);
    Arc::new(move |routed: Routed| {
        if let Some(answer) = queries::answer(&shared, &routed.request, routed.follow) {
            return answer;
        }
        let (reply, answer) = channel();
        let sent = tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(Control::Api(routed, reply));
        if sent.is_err() {
            return Err(ActionError::Unavailable("the VMM is shutting down".into()));
        }
        answer
            .recv()
            .unwrap_or_else(|_| Err(ActionError::Unavailable("the VMM is shutting down".into())))
    })
}

/// Where the machine is.
enum Slot {
    /// With the main loop.
    Here(Machine),
    /// With the worker running operation `id`.
    Away(u64),
}

/// Why the VMM ends once the machine is back.
enum Ending {
    /// With this status.
    Status(ExitCode),
    /// With this error.
    Failed(String),
    /// With this error, the fence lost: the VM's outputs are held for good,
    /// so its devices are given a bounded time to stop (one blocked on a
    /// disk server that no longer answers cannot) and the process ends
    /// regardless.
    FenceLost(String),
}

struct Controller {
    slot: Slot,
    ft_gate: Option<Arc<FtGate>>,
    shared: Arc<Shared>,
    tx: Sender<Control>,
    ending: Option<Ending>,
    /// The event of that ending (`shutdown`…), published when the VM ends.
    ending_event: Option<Event>,
    /// The API's streamed answers (an operation's followers).
    streams: Option<kemari_api::server::StreamsWritten>,
    /// The machine's generation: one more at each reboot.
    generation: u64,
    /// `--on-reboot`.
    on_reboot: OnReboot,
    /// `--on-crash`.
    on_crash: OnCrash,
    /// A reboot to make once the running operation returns the machine.
    reboot_pending: Option<reboot::Cause>,
}

/// Runs the VM described by `args` until it ends.
pub fn run(args: &Args) -> Result<ExitCode, ProcessError> {
    let api_socket = args.api_socket_path()?;
    let shared = Shared::new(startup::describe(args));
    let _ = shared.process.set(args.process_settings());
    // Until the VM is here (a standby, a destination): what the flags say.
    let (id, name) = args.identity()?;
    let fence_id = id.clone();
    shared.events.set_identity(id, name);
    // Opened with the privileges of the start (a FIFO: once read).
    let events_file = match args.events_file()? {
        Some(path) => Some((open_events_file(&path)?, path)),
        None => None,
    };
    let (tx, rx) = channel();
    let sink = reboot::vm_sink(&tx, 0);
    // Forked while this is the only thread, with the privileges the
    // command may need (no thread of the VMM may execute a program).
    let fence_cmd = match &args.ft_fence_cmd {
        Some(cmd) => Some(FenceCommand::start(cmd).map_err(ProcessError::FenceHelper)?),
        None => None,
    };
    // The etcd fence's helper process too (the etcd client runs there). A
    // signal ends a wait for its key.
    let signalled = Arc::new(AtomicBool::new(false));
    let arbiter = match &args.ft_fence {
        Some(spec) => {
            refuse_etcd_fence_on_hand_over(args, spec)?;
            Some(
                Arbiter::start(spec, fence_id.as_deref(), signalled.clone())
                    .map_err(ft::FtError::from)?,
            )
        }
        None => None,
    };
    // The API socket first: a socket in use is refused before any VM exists.
    let listening = match &api_socket {
        Some(path) => Some(ApiServer::listen(
            path,
            ServerOptions {
                socket: args.api_socket_options()?,
                ..ServerOptions::default()
            },
        )?),
        None => None,
    };
    let metrics = match args.metrics_listen()? {
        Some(addr) => Some(MetricsListener::bind(&addr)?),
        None => None,
    };
    // Still the only thread: every thread made from here on inherits it.
    hardening::harden(args)?;
    if let Some((file, path)) = events_file {
        shared
            .events
            .write_to(file)
            .map_err(|cause| ProcessError::EventsFile { path, cause })?;
    }
    ft_events::watch(&shared);
    let api = match listening {
        Some(l) => Some(l.serve(api_handler(shared.clone(), tx.clone()), || {
            vmm::seccomp::confine_this_thread(vmm::seccomp::ThreadFilter::Api)
        })?),
        None => None,
    };
    if let Some(listener) = metrics {
        crate::metrics::listener::serve(listener, shared.clone())?;
    }
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT])
        .map_err(ProcessError::Signals)?;
    let sig_tx = forwarder(&tx, Control::Signal);
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for s in signals.forever() {
                signalled.store(true, Ordering::SeqCst);
                sig_tx(s);
            }
        })
        .map_err(ProcessError::Signals)?;
    // The fence: a primary holds it for its whole life; a standby takes it
    // before it fails over.
    let mut fence: Option<HeldFence> = None;
    let machine = if let Some(listen) = &args.ft_standby {
        shared.set_role(Role::Standby);
        match startup::standby(args, listen, sink, &shared.ft, arbiter, fence_cmd)? {
            ft::standby::StandbyOutcome::FailedOver(m, held) => {
                fence = held;
                m
            }
            ft::standby::StandbyOutcome::PrimaryStopped(reason) => {
                eprintln!("kemari: standby done: the primary ended protection ({reason})");
                shared.events.publish(
                    "shutdown",
                    json!({ "reason": format!("standby: the primary ended protection ({reason})") }),
                );
                shared.events.close();
                shared.events.wait_writers(FLUSH_GRACE);
                if let Some(api) = api {
                    api.shutdown(FLUSH_GRACE);
                }
                return Ok(ExitCode::SUCCESS);
            }
        }
    } else {
        if let Some(arbiter) = &arbiter {
            fence = Some(arbiter.acquire_to_start().map_err(ft::FtError::from)?);
        }
        let output_fence = fence.as_ref().and_then(HeldFence::output_fence);
        startup::make_machine(args, sink, output_fence)?
    };
    if let Some(f) = &fence {
        // A lease not renewed in time: the VM stops here, and nothing it
        // did since reaches the outside.
        let lost = forwarder(&tx, Control::FenceLost);
        f.on_lost(lost);
    }
    // From this thread: a vCPU thread, under its seccomp filter, may not
    // start it (it would write partial lines at once instead).
    machine.start_console_flusher();
    shared.set_machine(machine.monitor());
    // A failover shows as such before the VM's start.
    ft_events::observe(&shared);
    shared.events.publish(
        "started",
        json!({ "how": startup::how(args), "state": machine.state(), "pid": std::process::id() }),
    );
    crate::notify::ready(&format!("VM {} ({})", machine.state(), startup::how(args)));
    let mut controller = Controller {
        slot: Slot::Here(machine),
        ft_gate: None,
        shared: shared.clone(),
        tx,
        ending: None,
        ending_event: None,
        streams: api.as_ref().map(|a| a.streams_written()),
        generation: 0,
        on_reboot: args.on_reboot,
        on_crash: args.on_crash,
        reboot_pending: None,
    };
    if let Some(request) = args.ft_at_start() {
        start_ft_at_start(&controller.tx, request);
    }
    let status = loop {
        let Ok(event) = rx.recv() else {
            break Err(ProcessError::VmFailed("all event sources are gone".into()));
        };
        if let Some(status) = controller.handle(event) {
            break status;
        }
    };
    shared.set_role(Role::Ending);
    // Event streams end after the last event (and the file gets it).
    shared.events.close();
    shared.events.wait_writers(FLUSH_GRACE);
    if let Some(api) = api {
        // The followers of the last operation get their final line.
        api.shutdown(FLUSH_GRACE);
    }
    status
}

/// `--ft-peer`: `ft start` through the main loop, as the API would; an
/// answer that refuses it is logged (a start that fails later is reported
/// as every operation is: a log line and an `operation_failed` event).
fn start_ft_at_start(tx: &Sender<Control>, request: FtStartRequest) {
    let peer = request.peer.clone();
    let (answer_tx, answer_rx) = channel();
    let routed = Routed {
        request: ApiRequest::FtStart(request),
        follow: false,
    };
    if tx.send(Control::Api(routed, answer_tx)).is_err() {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("ft-at-start".into())
        .spawn(move || match answer_rx.recv() {
            Ok(Ok(_)) => tracing::info!(%peer, "--ft-peer: fault tolerance starting"),
            Ok(Err(e)) => {
                tracing::error!(%peer, error = %e, "--ft-peer: fault tolerance not started")
            }
            Err(_) => {}
        });
}

/// An etcd fence holds the key of a VM that runs here; a hand-over's
/// destination would wait for the key its source holds.
fn refuse_etcd_fence_on_hand_over(args: &Args, spec: &FenceSpec) -> Result<(), CliError> {
    let hand_over = args.incoming.is_some()
        || args.incoming_local.is_some()
        || (args.restore.is_some() && args.await_state);
    if matches!(spec, FenceSpec::Etcd(_)) && hand_over {
        return Err(CliError::Setting {
            input: "--ft-fence etcd://…".into(),
            reason: "not with --incoming, --incoming-local or --await-state: the VM's key stays with the source of a hand-over".into(),
        });
    }
    Ok(())
}

/// Opens `--events-file` for appending (a FIFO: waits for its reader).
fn open_events_file(path: &std::path::Path) -> Result<std::fs::File, ProcessError> {
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .map_err(|cause| ProcessError::EventsFile {
            path: path.to_path_buf(),
            cause,
        })
}

impl Controller {
    /// Handles one event; `Some` once the VMM ends.
    fn handle(&mut self, event: Control) -> Option<Result<ExitCode, ProcessError>> {
        if let Control::FenceLost(why) = event {
            // Not a reason to tell the standby to stand down: handled first.
            return self.fence_lost(why);
        }
        if let Control::Vm(generation, e) = &event {
            if *generation != self.generation {
                tracing::debug!(event = ?e, "an event of the VM before its reboot: ignored");
                return None;
            }
        }
        let restart = match &event {
            Control::Vm(_, VmEvent::Reset) => self.on_reboot == OnReboot::Restart,
            Control::Vm(_, VmEvent::Crashed { .. }) => self.on_crash == OnCrash::Restart,
            _ => false,
        };
        if let (Control::Vm(..) | Control::Signal(_), Some(g)) = (&event, &self.ft_gate) {
            // The VM ends (or its guest boots anew) here on purpose: the
            // standby must not take over.
            g.stop(if restart {
                "the primary's guest rebooted: protect it again with `kemarictl ft start`"
            } else {
                "the primary VM ended"
            });
        }
        match event {
            Control::Vm(_, VmEvent::Reset) if restart => {
                tracing::info!("guest reset: rebooting it in place");
                self.shared
                    .events
                    .publish("reset", json!({ "then": "restart" }));
                self.reboot(reboot::Cause::Reset)
            }
            Control::Vm(_, VmEvent::Crashed { vcpu, reason }) if restart => {
                eprintln!("kemari: guest crashed: {reason} on vCPU {vcpu}; restarting it");
                self.shared.events.publish(
                    "crashed",
                    json!({ "reason": reason, "vcpu": vcpu, "then": "restart" }),
                );
                self.reboot(reboot::Cause::Crash)
            }
            Control::Vm(_, VmEvent::Poweroff { code: 0 }) => {
                tracing::info!("guest powered off");
                self.end(
                    Ending::Status(ExitCode::SUCCESS),
                    ("shutdown", json!({ "reason": "guest poweroff" })),
                )
            }
            Control::Vm(_, VmEvent::Poweroff { code }) => {
                eprintln!("kemari: guest reported failure (exit code {code})");
                self.end(
                    Ending::Status(ExitCode::from(EXIT_GUEST_FAILURE)),
                    (
                        "shutdown",
                        json!({ "reason": "guest poweroff reporting a failure", "exit_code": code }),
                    ),
                )
            }
            Control::Vm(_, VmEvent::Reset) => {
                tracing::info!("guest reset: ending the VM (--on-reboot exit)");
                self.end(
                    Ending::Status(ExitCode::SUCCESS),
                    ("reset", json!({ "then": "the VMM ends" })),
                )
            }
            Control::Vm(_, VmEvent::Crashed { vcpu, reason }) => {
                eprintln!("kemari: guest crashed: {reason} on vCPU {vcpu}");
                let event = ("crashed", json!({ "reason": reason, "vcpu": vcpu }));
                self.end(Ending::Status(ExitCode::from(EXIT_GUEST_CRASHED)), event)
            }
            Control::Vm(_, VmEvent::Error(message)) => {
                let event = (
                    "crashed",
                    json!({ "reason": "internal error", "message": message }),
                );
                self.end(Ending::Failed(message), event)
            }
            Control::Signal(sig) => {
                tracing::info!(signal = sig, "signal received: shutting down");
                self.end(
                    Ending::Status(ExitCode::SUCCESS),
                    ("shutdown", json!({ "reason": "signal", "signal": sig })),
                )
            }
            Control::Api(routed, reply) => {
                let (answer, exit) = self.act(routed);
                let _ = reply.send(answer);
                if exit {
                    if let Some(g) = &self.ft_gate {
                        g.stop("the primary VMM is shutting down");
                    }
                    return self.end(
                        Ending::Status(ExitCode::SUCCESS),
                        ("shutdown", json!({ "reason": "api" })),
                    );
                }
                None
            }
            Control::Done(done) => self.operation_done(*done),
            Control::FenceLost(why) => self.fence_lost(why),
        }
    }

    /// The fence is lost: another copy may run the VM by now. Outputs are
    /// held for good already; the standby, if any, is left to fail over
    /// (the link closes without a `Stop`), and the VMM ends in failure.
    fn fence_lost(&mut self, why: String) -> Option<Result<ExitCode, ProcessError>> {
        if let Some(g) = self.ft_gate.take() {
            g.degrade(&why);
        }
        self.end(
            Ending::FenceLost(why.clone()),
            ("fence_lost", json!({ "reason": why })),
        )
    }

    /// Ends the VMM now (publishing `event`), or once the running
    /// operation hands the machine back (it is cancelled).
    fn end(&mut self, why: Ending, event: Event) -> Option<Result<ExitCode, ProcessError>> {
        self.end_with(why, Some(event))
    }

    fn end_with(
        &mut self,
        why: Ending,
        event: Option<Event>,
    ) -> Option<Result<ExitCode, ProcessError>> {
        match std::mem::replace(&mut self.slot, Slot::Away(0)) {
            Slot::Here(machine) => {
                self.shared.set_role(Role::Ending);
                if let Some((kind, details)) = event {
                    self.shared.events.publish(kind, details);
                }
                if matches!(why, Ending::FenceLost(_)) {
                    end_vm_within(machine, FENCE_LOST_STOP_BOUND);
                } else {
                    end_vm(machine);
                }
                Some(match why {
                    Ending::Status(code) => Ok(code),
                    Ending::Failed(message) | Ending::FenceLost(message) => {
                        Err(ProcessError::VmFailed(message))
                    }
                })
            }
            Slot::Away(id) => {
                self.slot = Slot::Away(id);
                if let Err(e) = self.shared.operations.cancel(None) {
                    tracing::info!(error = %e, "ending once the running operation returns the VM");
                }
                self.ending.get_or_insert(why);
                if let Some(event) = event {
                    self.ending_event.get_or_insert(event);
                }
                None
            }
        }
    }

    fn operation_done(&mut self, done: Done) -> Option<Result<ExitCode, ProcessError>> {
        let Done {
            id,
            machine,
            result,
            after,
            gate,
        } = done;
        self.slot = Slot::Here(machine);
        if let Some(g) = gate {
            self.ft_gate = Some(g);
        }
        let exit = after != After::Continue;
        if exit {
            self.shared.set_role(Role::Ending);
        }
        let kind = self.shared.operations.running().map(|(k, _)| k);
        // Fault tolerance's new state (protected) before the operation's end.
        ft_events::observe(&self.shared);
        self.publish_operation_end(id, kind, &result);
        self.shared.operations.finish(id, result);
        if exit {
            if let Some(g) = &self.ft_gate {
                g.stop("the primary VMM is shutting down");
            }
            if self.reboot_pending.take().is_some() {
                tracing::warn!(
                    "the guest asked for a reboot while its VM was handed over: the VM's next VMM runs it on from where it was"
                );
            }
            // The last events: the operation's end (and the shutdown asked
            // for meanwhile); then every event stream ends.
            if let Some((kind, details)) = self.ending_event.take() {
                self.shared.events.publish(kind, details);
            }
            self.shared.events.close();
            self.shared.operations.wait_followers(FLUSH_GRACE);
            if after == After::HandedOver {
                // The report reaches its caller at normal priority (each hop
                // at idle priority waited for a CPU the new VMM's vCPUs were
                // using: 2–4 ms more to the answer); the rest of the end does
                // not.
                if let Some(s) = &self.streams {
                    s.wait(HANDED_OVER_REPORT_GRACE);
                }
                finish_at_idle_priority();
            }
            let ending = self
                .ending
                .take()
                .unwrap_or(Ending::Status(ExitCode::SUCCESS));
            return self.end_with(ending, None);
        }
        if let Some(ending) = self.ending.take() {
            let event = self.ending_event.take();
            return self.end_with(ending, event);
        }
        if let Some(cause) = self.reboot_pending.take() {
            if let Some(g) = &self.ft_gate {
                g.stop("the primary's guest rebooted: protect it again with `kemarictl ft start`");
            }
            return self.reboot(cause);
        }
        None
    }

    /// `operation_completed`, `_failed` or `_cancelled` (after the last
    /// `operation_progress`).
    fn publish_operation_end(
        &self,
        id: u64,
        kind: Option<OpKind>,
        result: &Result<Value, (String, bool)>,
    ) {
        let mut details = json!({
            "operation": id,
            "kind": kind,
            "description": kind.map(OpKind::describe),
        });
        self.shared.progress_gate.close();
        let event = match result {
            Ok(report) => {
                details["result"] = report.clone();
                "operation_completed"
            }
            Err((error, cancelled)) => {
                details["error"] = Value::from(error.as_str());
                if *cancelled {
                    "operation_cancelled"
                } else {
                    "operation_failed"
                }
            }
        };
        self.shared.events.publish(event, details);
    }

    /// Answers an action; `true` if the VMM ends now.
    fn act(&mut self, routed: Routed) -> (Answer, bool) {
        let Routed { request, follow } = routed;
        let machine = match &mut self.slot {
            Slot::Here(m) => m,
            Slot::Away(_) => return (self.act_while_away(request), false),
        };
        let protected = matches!(
            self.shared.ft.state(),
            FtState::Protected | FtState::Syncing
        );
        let op = match request {
            ApiRequest::Pause | ApiRequest::Resume => {
                let pause = request == ApiRequest::Pause;
                let answer = pause_or_resume(machine, pause);
                if answer.is_ok() {
                    let event = if pause { "paused" } else { "resumed" };
                    self.shared.events.publish(event, json!({ "by": "api" }));
                }
                return (answer, false);
            }
            ApiRequest::Shutdown => {
                return (Ok(Reply::Json(json!({ "state": "shutting_down" }))), true)
            }
            ApiRequest::FtStop => return (self.ft_stop(), false),
            ApiRequest::WarmRestart { dir, prepare: true } => {
                return (
                    match warm::write_config(&dir, machine.config()) {
                        Ok(config) => Ok(Reply::Json(json!({ "dir": dir, "config": config }))),
                        Err(e) => Err(ActionError::Conflict(e.to_string())),
                    },
                    false,
                )
            }
            ApiRequest::Migrate { .. }
            | ApiRequest::MigrateLocal { .. }
            | ApiRequest::WarmRestart { .. }
                if protected =>
            {
                return (
                    Err(ActionError::Conflict(
                        "the VM is protected by fault tolerance: `kemarictl ft stop` first".into(),
                    )),
                    false,
                )
            }
            ApiRequest::FtStart(_) if protected => {
                return (
                    Err(ActionError::Conflict("the VM is already protected".into())),
                    false,
                )
            }
            ApiRequest::Migrate {
                to,
                key_file,
                max_downtime_ms,
                max_rounds,
                max_bandwidth_mib_s,
                connections,
                plaintext,
            } => {
                let key = match transfer::key::read_key(&key_file) {
                    Ok(k) => k,
                    Err(e) => return (Err(ActionError::BadRequest(e.to_string())), false),
                };
                let mut rule = DowntimeEstimate::default();
                if let Some(ms) = max_downtime_ms {
                    rule.max_downtime = Duration::from_millis(ms);
                }
                if let Some(r) = max_rounds {
                    rule.max_rounds = r.max(1);
                }
                if max_bandwidth_mib_s == Some(0) {
                    return (
                        Err(ActionError::BadRequest(
                            "max_bandwidth_mib_s must be at least 1 (leave it out for no cap)"
                                .into(),
                        )),
                        false,
                    );
                }
                let connections = connections.unwrap_or(1);
                if !(1..=transfer::streams::MAX_CONNECTIONS).contains(&connections) {
                    return (
                        Err(ActionError::BadRequest(format!(
                            "connections must be 1 to {} (leave it out for one)",
                            transfer::streams::MAX_CONNECTIONS
                        ))),
                        false,
                    );
                }
                Op::Migrate {
                    to,
                    key,
                    plaintext,
                    connections,
                    rule,
                    throttle: max_bandwidth_mib_s.map(transfer::throttle::Throttle::mib_per_s),
                }
            }
            ApiRequest::MigrateLocal { socket } => Op::MigrateLocal { socket },
            ApiRequest::WarmRestart { dir, .. } => Op::WarmRestart { dir },
            ApiRequest::Snapshot { dir, exit, force } => {
                // Refused before an operation starts: the VM is not paused.
                if let Err(e) = snapshot::check_target(&dir, force) {
                    return (Err(ActionError::Conflict(e.to_string())), false);
                }
                Op::Snapshot { dir, exit, force }
            }
            ApiRequest::FtStart(req) => match ft_options(&req) {
                Ok(o) => Op::FtStart(Box::new(o)),
                Err(e) => return (Err(e), false),
            },
            other => {
                return (
                    Err(ActionError::Internal(format!(
                        "{other:?} is answered by the API itself"
                    ))),
                    false,
                )
            }
        };
        (self.start_operation(op, follow), false)
    }

    fn act_while_away(&mut self, request: ApiRequest) -> Answer {
        let busy = || {
            let (kind, id) = self
                .shared
                .operations
                .running()
                .unwrap_or((OpKind::Migrate, 0));
            ActionError::Busy(format!(
                "a {} is running (operation {id}): wait for it, or cancel it with `kemarictl operation cancel`",
                kind.describe()
            ))
        };
        match request {
            ApiRequest::Shutdown => {
                let cancelling = self.shared.operations.cancel(None).ok();
                self.ending.get_or_insert(Ending::Status(ExitCode::SUCCESS));
                self.ending_event
                    .get_or_insert(("shutdown", json!({ "reason": "api" })));
                Ok(Reply::Json(json!({
                    "state": "shutting_down",
                    "after_operation": cancelling,
                })))
            }
            ApiRequest::FtStop => match self.shared.operations.running() {
                Some((OpKind::FtStart, _)) => match self.shared.operations.cancel(Some(OpKind::FtStart)) {
                    Ok(id) => Ok(Reply::Json(json!({ "cancelling": true, "operation": id }))),
                    Err(_) => Err(ActionError::Conflict(
                        "protection is being set up (its first epoch is on its way): `ft stop` again in a moment".into(),
                    )),
                },
                _ => Err(busy()),
            },
            _ => Err(busy()),
        }
    }

    fn start_operation(&mut self, op: Op, follow: bool) -> Answer {
        let kind = op.kind();
        let target = op.target();
        // `GET /vm/migration` shows the running or last live migration,
        // `GET /vm/ft` fault tolerance's initial synchronization.
        let progress = match kind {
            OpKind::Migrate => self.shared.migration.clone(),
            OpKind::FtStart => self.shared.ft.initial.clone(),
            _ => Arc::new(ProgressCell::default()),
        };
        let started = self
            .shared
            .operations
            .begin(kind, &target, progress)
            .map_err(|e| ActionError::Busy(e.to_string()))?;
        let Slot::Here(machine) = std::mem::replace(&mut self.slot, Slot::Away(started.id)) else {
            return Err(ActionError::Internal("the machine is not here".into()));
        };
        let tx = Mutex::new(self.tx.clone());
        let id = started.id;
        let spawned = worker::spawn(op, machine, started, self.shared.clone(), move |done| {
            let _ = tx
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .send(Control::Done(Box::new(done)));
        });
        self.shared.events.publish(
            "operation_started",
            json!({ "operation": id, "kind": kind, "description": kind.describe(), "target": target }),
        );
        self.shared.progress_gate.open(id);
        progress_events::watch(&self.shared, id, kind);
        if let Err((e, machine)) = spawned {
            if let Some(m) = machine {
                self.slot = Slot::Here(m);
            }
            let result = Err((format!("cannot start a worker thread: {e}"), false));
            self.publish_operation_end(id, Some(kind), &result);
            self.shared.operations.finish(id, result);
            return Err(ActionError::Internal(format!(
                "cannot start a worker thread: {e}"
            )));
        }
        if follow {
            return Ok(Reply::Stream(queries::follower(&self.shared, id)));
        }
        Ok(Reply::Accepted(
            self.shared
                .operations
                .view()
                .unwrap_or_else(|| json!({ "id": id, "kind": kind, "status": "running" })),
        ))
    }

    fn ft_stop(&mut self) -> Answer {
        let Some(g) = self.ft_gate.take() else {
            return Err(ActionError::Conflict(
                "fault tolerance is not active".into(),
            ));
        };
        g.stop("stopped through the API");
        if let Slot::Here(machine) = &self.slot {
            if let Err(e) = machine.set_output_gate(Arc::new(vmm::output::PassThroughGate)) {
                return Err(ActionError::Internal(e.to_string()));
            }
        }
        Ok(Reply::Json(
            serde_json::to_value(self.shared.ft.report())
                .map_err(|e| ActionError::Internal(e.to_string()))?,
        ))
    }
}

fn pause_or_resume(machine: &mut Machine, pause: bool) -> Answer {
    let done = if pause {
        machine.pause()
    } else {
        machine.resume()
    };
    match done {
        Ok(()) => Ok(Reply::Json(json!({ "state": machine.state() }))),
        Err(MachineError::State(s)) => Err(ActionError::Conflict(format!("the VM is already {s}"))),
        Err(e) => Err(ActionError::Internal(e.to_string())),
    }
}

fn ft_options(req: &FtStartRequest) -> Result<ft::primary::FtStartOptions, ActionError> {
    let bad = |e: String| ActionError::BadRequest(e);
    let key = transfer::key::read_key(&req.key_file).map_err(|e| bad(e.to_string()))?;
    let (mode, heartbeat, timeout) =
        ft::timing(req.periodic_ms, req.heartbeat_ms, req.timeout_ms).map_err(bad)?;
    let keep_writable = ft::keep_writable(req.keep_writable_pages).map_err(bad)?;
    let epochs_in_flight = ft::epochs_in_flight(req.epochs_in_flight).map_err(bad)?;
    Ok(ft::primary::FtStartOptions {
        peer: req.peer.clone(),
        key,
        mode,
        heartbeat,
        timeout,
        keep_writable,
        epochs_in_flight,
        plaintext: req.plaintext,
    })
}
