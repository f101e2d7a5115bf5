//! `kemari`: run one virtual machine.

use std::process::ExitCode;

use std::error::Error;

use clap::Parser;
use kemari::cli::Args;

fn main() -> ExitCode {
    let args = Args::parse();
    init_logging(&args.log_level, args.log_json);
    match kemari::controller::run(&args) {
        Ok(code) => code,
        Err(e) => {
            let mut msg = format!("kemari: error: {e}");
            let mut src = e.source();
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("{msg}");
            ExitCode::from(1)
        }
    }
}

fn init_logging(level: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colours only for a person: a log file or a test reads plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
