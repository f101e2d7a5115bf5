//! `kemarictl`: control a running kemari VMM through its API socket.
//!
//! A long operation (migrate, migrate-local, warm-restart, snapshot, ft
//! start) is followed until it ends — a progress bar on a terminal, plain
//! lines on stderr otherwise — and its final report printed on stdout; `--detach` returns
//! at once with the operation (`kemarictl operation` shows it later).

mod progress;
mod rounding;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kemari::api::client::{call, events, follow, run_operation};
use kemari::api::{ApiRequest, FtStartRequest};
use kemari::ctl::{Cli, Command, FtCommand, OperationCommand};
use serde_json::Value;

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
            max_bandwidth,
            connections,
            plaintext_link,
        } => ApiRequest::Migrate {
            to,
            key_file: abs(key_file),
            max_downtime_ms,
            max_rounds,
            max_bandwidth_mib_s: max_bandwidth,
            connections,
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
                    epochs_in_flight,
                    plaintext_link,
                },
        } => ApiRequest::FtStart(FtStartRequest {
            peer,
            key_file: abs(key_file),
            periodic_ms,
            heartbeat_ms,
            timeout_ms,
            keep_writable_pages,
            epochs_in_flight,
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
        Command::Fleet { .. } => unreachable!("`fleet` asks etcd, not a VMM (main)"),
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

/// `kemarictl fleet`: the registry as a table or JSON.
fn fleet(etcd: &str, json: bool) -> ExitCode {
    let shown = ft::fence::etcd::EtcdSpec::parse(etcd)
        .map_err(|e| format!("--etcd: {e}"))
        .and_then(|spec| fleet::store::read_once(&spec).map_err(|e| e.to_string()))
        .map(|snap| fleet::view::fleet(&snap))
        .map(|f| {
            if json {
                serde_json::to_string_pretty(&f).unwrap_or_default()
            } else {
                fleet::view::table(&f).trim_end().to_owned()
            }
        });
    match shown {
        Ok(text) => match kemari_logging::stdout::line(&text) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kemarictl: cannot write the fleet: {e}");
                ExitCode::from(1)
            }
        },
        Err(e) => {
            eprintln!("kemarictl: {e}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Fleet { etcd, json } = &cli.command {
        return fleet(etcd, *json);
    }
    let Some(api_socket) = cli.api_socket.clone() else {
        eprintln!("kemarictl: give the VMM's API socket (--api-socket PATH, or KEMARI_API_SOCKET)");
        return ExitCode::from(2);
    };
    let follow_op = matches!(
        cli.command,
        Command::Operation {
            command: Some(OperationCommand::Follow)
        }
    );
    let request = action(cli.command);
    if request == ApiRequest::Events {
        return follow_events(&api_socket);
    }
    let answer = if (request.is_operation() && !cli.detach) || follow_op {
        run_following(&api_socket, &request)
    } else {
        call(&api_socket, &request).map_err(|e| e.to_string())
    };
    match answer {
        Ok(v) => {
            // A closed stdout (`kemarictl config | head -1`) ends us quietly.
            let text = serde_json::to_string_pretty(&rounding::rounded(v)).unwrap_or_default();
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
