//! `kemarictl`: control a running kemari VMM through its API socket.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kemari::api::client::request;

/// Control a running kemari VM.
#[derive(Debug, Parser)]
#[command(name = "kemarictl", version)]
struct Cli {
    /// The VMM's API socket (kemari --api-socket).
    #[arg(long, short = 's', env = "KEMARI_API_SOCKET")]
    api_socket: PathBuf,
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (method, path) = match cli.command {
        Command::Info => ("GET", "/vm"),
        Command::Config => ("GET", "/vm/config"),
        Command::Devices => ("GET", "/vm/devices"),
        Command::Metrics => ("GET", "/vm/metrics"),
        Command::Pause => ("PUT", "/vm/pause"),
        Command::Resume => ("PUT", "/vm/resume"),
        Command::Shutdown => ("PUT", "/vm/shutdown"),
    };
    match request(&cli.api_socket, method, path, None) {
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kemarictl: {e}");
            ExitCode::from(1)
        }
    }
}
