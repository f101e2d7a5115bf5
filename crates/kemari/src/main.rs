//! `kemari`: run one virtual machine.

use std::process::ExitCode;

use std::error::Error;

use clap::{CommandFactory, FromArgMatches};
use kemari::cli::Args;

fn main() -> ExitCode {
    let matches = Args::command().get_matches();
    let args = match Args::from_arg_matches(&matches) {
        Ok(args) => args,
        Err(e) => e.exit(),
    };
    // The config file's role and process keys (logging included) count
    // from here on.
    let args = match args.merge_config_roles(&matches) {
        Ok(args) => args,
        Err(e) => {
            // A configuration error, as the rest of the configuration's.
            eprintln!("kemari: error: {}", with_causes(&e));
            return ExitCode::from(1);
        }
    };
    if let Err(e) = kemari_logging::init(&args.log_level, args.log_json) {
        eprintln!("kemari: error: {e}");
        return ExitCode::from(2);
    }
    // Type=notify units: a VMM that waits for its VM is ready once it listens.
    kemari::notify::ready_when_listening();
    match kemari::controller::run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kemari: error: {}", with_causes(&e));
            ExitCode::from(1)
        }
    }
}

/// The error and its chain of causes, each said once: many errors already
/// name their cause in their own message ("snapshot DIR/state.bin: No such
/// file or directory"), and repeating it reads as two failures.
fn with_causes(e: &dyn Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let cause = s.to_string();
        if !msg.contains(&cause) {
            msg.push_str(": ");
            msg.push_str(&cause);
        }
        src = s.source();
    }
    msg
}
