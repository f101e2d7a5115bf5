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
    /// Full snapshot (state + sparse memory image) into DIR; restore it with
    /// `kemari --restore DIR`.
    Snapshot {
        /// Snapshot directory (created if missing).
        dir: PathBuf,
        /// End the VMM once saved (suspend to disk).
        #[arg(long)]
        exit: bool,
    },
    /// Warm restart: save the small state file into DIR, keep guest memory in
    /// its file (kemari --memory-file), end this VMM; `kemari --restore DIR`
    /// (possibly a newer binary) resumes the VM without copying memory.
    WarmRestart {
        /// State directory.
        dir: PathBuf,
    },
    /// Zero-copy migration into the kemari started with `--incoming-local SOCKET`.
    MigrateLocal {
        /// The destination's socket.
        socket: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let abs = |p: &PathBuf| std::path::absolute(p).unwrap_or_else(|_| p.clone());
    let mut body = None;
    let (method, path) = match &cli.command {
        Command::Snapshot { dir, exit } => {
            body = Some(serde_json::json!({ "dir": abs(dir), "exit": exit }));
            ("PUT", "/vm/snapshot")
        }
        Command::WarmRestart { dir } => {
            body = Some(serde_json::json!({ "dir": abs(dir) }));
            ("PUT", "/vm/warm-restart")
        }
        Command::MigrateLocal { socket } => {
            body = Some(serde_json::json!({ "socket": abs(socket) }));
            ("PUT", "/vm/migrate-local")
        }
        Command::Info => ("GET", "/vm"),
        Command::Config => ("GET", "/vm/config"),
        Command::Devices => ("GET", "/vm/devices"),
        Command::Metrics => ("GET", "/vm/metrics"),
        Command::Pause => ("PUT", "/vm/pause"),
        Command::Resume => ("PUT", "/vm/resume"),
        Command::Shutdown => ("PUT", "/vm/shutdown"),
    };
    match request(&cli.api_socket, method, path, body.as_ref()) {
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
