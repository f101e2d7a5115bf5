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
use vmm::machine::{Machine, MachineError};
use vmm::vstate::{VmEvent, VmEventSink};

use crate::api::routes::ApiRequest;
use crate::api::server::{ApiResponse, ApiServer, PendingRequest, ServerError};
use crate::cli::{Args, CliError};

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

/// Runs the VM described by `args` until it ends.
pub fn run(args: &Args) -> Result<ExitCode, ProcessError> {
    let (config, api_socket) = args.machine_config()?;
    let (tx, rx) = channel();
    let sink = VmEventSink::new(forwarder(&tx, Control::Vm));
    // The API socket first: a socket in use is refused before any VM exists.
    let _api = match &api_socket {
        Some(path) => Some(ApiServer::start(path, forwarder(&tx, Control::Api))?),
        None => None,
    };
    let mut machine = Machine::build(config, sink, args.start_paused)?;
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
                let shutdown = request == ApiRequest::Shutdown;
                let resp = handle_api(&mut machine, request);
                let _ = reply.send(resp);
                if shutdown {
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

fn handle_api(machine: &mut Machine, request: ApiRequest) -> ApiResponse {
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
        ApiRequest::Shutdown => ApiResponse::ok(json!({ "state": "shutting_down" })),
    }
}
