//! `kemari`: run one virtual machine.

use std::process::ExitCode;

use std::error::Error;

use clap::Parser;
use kemari::cli::Args;

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = kemari_logging::init(&args.log_level, args.log_json) {
        eprintln!("kemari: error: {e}");
        return ExitCode::from(2);
    }
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
