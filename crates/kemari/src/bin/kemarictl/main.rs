//! `kemarictl`: control a running kemari VMM through its API socket.
//!
//! A long operation (migrate, migrate-local, warm-restart, snapshot, ft
//! start) is followed until it ends — a progress bar on a terminal, nothing
//! otherwise — and its final report printed as before; `--detach` returns
//! at once with the operation (`kemarictl operation` shows it later).

mod progress;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kemari::api::client::{call, events, follow, run_operation};
use kemari::api::{ApiRequest, FtStartRequest};
use serde_json::Value;

/// Control a running kemari VM.
#[derive(Debug, Parser)]
#[command(name = "kemarictl", version)]
struct Cli {
    /// The VMM's API socket (kemari --api-socket).
    #[arg(long, short = 's', env = "KEMARI_API_SOCKET")]
    api_socket: PathBuf,
    /// Start a long operation and return at once (its id and state) instead
    /// of following it to its end.
    #[arg(long, global = true)]
    detach: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// VM info and state.
    Info,
    /// The machine configuration.
    Config,
    /// Devices and their request counters.
    Devices,
    /// Metrics: exits by reason, memory pages, device counters.
    Metrics,
    /// Pause the vCPUs and devices.
    Pause,
    /// Resume a paused VM.
    Resume,
    /// Stop the VM and end the VMM process.
    Shutdown,
    /// Full snapshot (state + sparse memory image, every data extent
    /// checksummed) into DIR; restore it with `kemari --restore DIR`.
    Snapshot {
        /// Snapshot directory (created if missing).
        dir: PathBuf,
        /// End the VMM once saved (suspend to disk).
        #[arg(long)]
        exit: bool,
        /// Replace a snapshot already in DIR (refused otherwise, before the
        /// VM is paused).
        #[arg(long)]
        force: bool,
    },
    /// Warm restart: save the small state file into DIR, keep guest memory in
    /// its file (kemari --memory-file), end this VMM; `kemari --restore DIR`
    /// (possibly a newer binary) resumes the VM without copying memory. If a
    /// successor waits on DIR (`--prepare`, then `kemari --restore DIR
    /// --await-state`), it resumes the VM at once.
    WarmRestart {
        /// State directory.
        dir: PathBuf,
        /// Do not restart yet: write DIR/config.json (the VM runs on) so that
        /// a successor, `kemari --restore DIR --await-state`, can build the
        /// new VM in advance; the next `warm-restart DIR` hands the VM to it.
        #[arg(long)]
        prepare: bool,
    },
    /// Live migration (pre-copy over TCP) to the kemari started with
    /// `--incoming HOST:PORT`; prints the final report.
    Migrate {
        /// Destination HOST:PORT.
        #[arg(long)]
        to: String,
        /// Pre-shared key file (the destination's --migration-key-file).
        #[arg(long)]
        key_file: PathBuf,
        /// Downtime limit in ms (default 300): pause once the rest can move
        /// within it and rounds stop shrinking it (docs/migration-protocol.md).
        #[arg(long)]
        max_downtime_ms: Option<u64>,
        /// Pause the guest after this many rounds whatever remains (default 30).
        #[arg(long)]
        max_rounds: Option<u32>,
        /// An authenticated but unencrypted link, for a trusted, dedicated
        /// one (the destination must be started with --plaintext-link).
        #[arg(long)]
        plaintext_link: bool,
    },
    /// Progress of the running (or last) live migration.
    Migration,
    /// Cancel the running live migration (the VM keeps running here).
    MigrateCancel,
    /// Zero-copy migration into the kemari started with `--incoming-local SOCKET`.
    MigrateLocal {
        /// The destination's socket.
        socket: PathBuf,
    },
    /// Fault tolerance: protect this VM with a standby, show its state, stop it.
    Ft {
        #[command(subcommand)]
        command: FtCommand,
    },
    /// The running or last long operation (migrate, migrate-local,
    /// warm-restart, snapshot, ft start): its state, progress and result.
    Operation {
        #[command(subcommand)]
        command: Option<OperationCommand>,
    },
    /// Follow the VM's events (started, paused, resumed, shutdown, reset,
    /// crashed, operation_*, ft_*): one JSON line each, until the VMM ends.
    Events,
}

#[derive(Debug, Subcommand)]
enum OperationCommand {
    /// Follow it until it ends, with a progress bar on a terminal.
    Follow,
    /// Cancel it (before its commit point the VM keeps running here).
    Cancel,
}

#[derive(Debug, Subcommand)]
enum FtCommand {
    /// Synchronize the standby started with `kemari --ft-standby HOST:PORT`
    /// (a live pre-copy, then one sync per output event or per period).
    Start {
        /// The standby's HOST:PORT.
        #[arg(long)]
        peer: String,
        /// Pre-shared key file (the standby's --migration-key-file).
        #[arg(long)]
        key_file: PathBuf,
        /// Periodic checkpoints every MS (Remus-style, outputs held until the
        /// checkpoint is acknowledged) instead of event-driven synchronization.
        #[arg(long)]
        periodic_ms: Option<u64>,
        /// Heartbeat interval on the sync link (default 100 ms).
        #[arg(long)]
        heartbeat_ms: Option<u64>,
        /// The peer is lost after this long without a frame (default 1000 ms).
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// Leave up to N pages that the guest rewrites from sync to sync
        /// writable (no write-protection fault on them; each is compared and
        /// sent only if changed). Default 64; 0 re-protects every page.
        #[arg(long, value_name = "N")]
        keep_writable_pages: Option<usize>,
        /// An authenticated but unencrypted link, for a trusted, dedicated
        /// one (the standby must be started with --plaintext-link).
        #[arg(long)]
        plaintext_link: bool,
    },
    /// State (protected, degraded, standby, failed over) and metrics.
    Status,
    /// Stop protection; the standby exits.
    Stop,
}

/// The API action a subcommand asks for; paths become absolute, since the
/// VMM may run in another directory.
fn action(command: Command) -> ApiRequest {
    let abs = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
    match command {
        Command::Info => ApiRequest::Info,
        Command::Config => ApiRequest::Config,
        Command::Devices => ApiRequest::Devices,
        Command::Metrics => ApiRequest::Metrics,
        Command::Pause => ApiRequest::Pause,
        Command::Resume => ApiRequest::Resume,
        Command::Shutdown => ApiRequest::Shutdown,
        Command::Snapshot { dir, exit, force } => ApiRequest::Snapshot {
            dir: abs(dir),
            exit,
            force,
        },
        Command::WarmRestart { dir, prepare } => ApiRequest::WarmRestart {
            dir: abs(dir),
            prepare,
        },
        Command::Migrate {
            to,
            key_file,
            max_downtime_ms,
            max_rounds,
            plaintext_link,
        } => ApiRequest::Migrate {
            to,
            key_file: abs(key_file),
            max_downtime_ms,
            max_rounds,
            plaintext: plaintext_link,
        },
        Command::Migration => ApiRequest::MigrationStatus,
        Command::MigrateCancel => ApiRequest::MigrationCancel,
        Command::MigrateLocal { socket } => ApiRequest::MigrateLocal {
            socket: abs(socket),
        },
        Command::Ft {
            command:
                FtCommand::Start {
                    peer,
                    key_file,
                    periodic_ms,
                    heartbeat_ms,
                    timeout_ms,
                    keep_writable_pages,
                    plaintext_link,
                },
        } => ApiRequest::FtStart(FtStartRequest {
            peer,
            key_file: abs(key_file),
            periodic_ms,
            heartbeat_ms,
            timeout_ms,
            keep_writable_pages,
            plaintext: plaintext_link,
        }),
        Command::Ft {
            command: FtCommand::Status,
        } => ApiRequest::FtStatus,
        Command::Ft {
            command: FtCommand::Stop,
        } => ApiRequest::FtStop,
        Command::Operation {
            command: None | Some(OperationCommand::Follow),
        } => ApiRequest::OperationStatus,
        Command::Operation {
            command: Some(OperationCommand::Cancel),
        } => ApiRequest::OperationCancel,
        Command::Events => ApiRequest::Events,
    }
}

/// Follows an operation to its end: its final report, or its error.
fn run_following(socket: &std::path::Path, request: &ApiRequest) -> Result<Value, String> {
    let mut view = progress::View::new();
    let answer = if request.is_operation() {
        run_operation(socket, request, |line| view.show(line))
    } else {
        // `operation follow`: the running (or last) one, to its end.
        follow(socket, request, |line| view.show(line)).and_then(|last| {
            if last["status"] == "completed" {
                Ok(last["result"].clone())
            } else {
                Err(kemari::api::client::ClientError::Operation {
                    status: last["status"].as_str().unwrap_or("?").to_owned(),
                    message: last["error"]
                        .as_str()
                        .unwrap_or("the operation failed")
                        .to_owned(),
                })
            }
        })
    };
    view.done();
    answer.map_err(|e| e.to_string())
}

/// Prints each event as one JSON line until the VMM ends the stream; a
/// closed stdout (`kemarictl events | head -3`) ends us quietly.
fn follow_events(socket: &std::path::Path) -> ExitCode {
    let mut failed = None;
    let answer = events(socket, |event| {
        if failed.is_none() {
            if let Err(e) = kemari_logging::stdout::line(&event.to_string()) {
                failed = Some(e);
            }
        }
    });
    if let Some(e) = failed {
        eprintln!("kemarictl: cannot write the events: {e}");
        return ExitCode::from(1);
    }
    match answer {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kemarictl: {e}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let follow_op = matches!(
        cli.command,
        Command::Operation {
            command: Some(OperationCommand::Follow)
        }
    );
    let request = action(cli.command);
    if request == ApiRequest::Events {
        return follow_events(&cli.api_socket);
    }
    let answer = if (request.is_operation() && !cli.detach) || follow_op {
        run_following(&cli.api_socket, &request)
    } else {
        call(&cli.api_socket, &request).map_err(|e| e.to_string())
    };
    match answer {
        Ok(v) => {
            // A closed stdout (`kemarictl config | head -1`) ends us quietly.
            let text = serde_json::to_string_pretty(&v).unwrap_or_default();
            if let Err(e) = kemari_logging::stdout::line(&text) {
                eprintln!("kemarictl: cannot write the answer: {e}");
                return ExitCode::from(1);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kemarictl: {e}");
            ExitCode::from(1)
        }
    }
}
