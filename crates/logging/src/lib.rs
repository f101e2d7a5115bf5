//! How kemari's binaries (`kemari`, `kemari-nbd`) log, and how a command
//! ends when its standard output is closed.
//!
//! One convention for every binary:
//!
//! | | |
//! |---|---|
//! | `--log-level FILTER` | a level (`off`, `error`, `warn`, `info`, `debug`, `trace`) or tracing directives, `warn,kemari_nbd=debug`; default [`DEFAULT_LEVEL`] |
//! | [`ENV`] (`KEMARI_LOG`) | the same, when `--log-level` is not given |
//! | `--log-json` | one JSON object per line |
//!
//! Logs go to stderr, with colours only when stderr is a terminal (never
//! into a file or journald). A filter that names no level — `verbose`,
//! which tracing would read as "everything from a target named verbose",
//! i.e. nothing — is refused with the input and an example ([`check_filter`]).
//!
//! [`stdout::write`] prints a command's result and, when stdout is a closed
//! pipe (`kemarictl config | true`, `kemari-nbd status | head -1`), ends the
//! process quietly by SIGPIPE, as coreutils do, instead of panicking. Only
//! for command-line output: a server must never die of a client's pipe.
//!
//! [`progress`] shows a followed operation: a bar on a terminal, plain
//! lines otherwise.

pub mod progress;
pub mod stdout;

use std::io::IsTerminal;

use thiserror::Error;
use tracing_subscriber::EnvFilter;

/// The environment variable that sets the filter when `--log-level` is absent.
pub const ENV: &str = "KEMARI_LOG";
/// The filter when neither `--log-level` nor [`ENV`] is given.
pub const DEFAULT_LEVEL: &str = "warn";
/// The levels a directive may name.
pub const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

#[derive(Debug, Error, PartialEq, Eq)]
pub enum LogError {
    #[error("invalid log filter {input:?}: {why}; give a level (off, error, warn, info, debug, trace) or directives such as \"warn,kemari_nbd=debug\", e.g. --log-level info")]
    Filter { input: String, why: String },
    #[error("logging was already set up")]
    AlreadySet,
}

/// Checks a filter and returns it unchanged (a clap value parser).
pub fn check_filter(input: &str) -> Result<String, LogError> {
    parse(input).map(|_| input.to_string())
}

fn parse(input: &str) -> Result<EnvFilter, LogError> {
    let bad = |why: String| LogError::Filter {
        input: input.to_string(),
        why,
    };
    if input.trim().is_empty() {
        return Err(bad("it is empty".into()));
    }
    for directive in input.split(',').map(str::trim) {
        if directive.is_empty() {
            return Err(bad("it has an empty directive".into()));
        }
        // `level`, or `target[span{field=value}]=level`: the level is what
        // follows the last '='.
        let level = directive.rsplit('=').next().unwrap_or(directive);
        if !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(level.trim())) {
            return Err(bad(if directive.contains('=') {
                format!("{level:?} in {directive:?} is not a level")
            } else {
                format!("{directive:?} is not a level")
            }));
        }
    }
    EnvFilter::builder()
        .parse(input)
        .map_err(|e| bad(e.to_string()))
}

/// Sets up logging to stderr: `level` as checked by [`check_filter`],
/// JSON lines with `json`, colours only on a terminal.
pub fn init(level: &str, json: bool) -> Result<(), LogError> {
    let filter = parse(level)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(!json && std::io::stderr().is_terminal());
    let set = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    set.map_err(|_| LogError::AlreadySet)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_directives_are_accepted() {
        for ok in [
            "warn",
            "INFO",
            "off",
            "warn,kemari_nbd=debug",
            "kemari_nbd::server=trace",
            "info,vmm=warn",
            "warn,kemari[conn{peer=x}]=debug",
        ] {
            assert_eq!(check_filter(ok).as_deref(), Ok(ok), "{ok}");
        }
    }

    #[test]
    fn a_filter_without_a_level_is_refused_with_an_example() {
        for bad in ["verbose", "", "warn,", "kemari_nbd=loud", "warn,,info", "3"] {
            let e = check_filter(bad).unwrap_err();
            let text = e.to_string();
            assert!(text.contains(&format!("{bad:?}")), "{text}");
            assert!(text.contains("e.g. --log-level info"), "{text}");
        }
        let e = check_filter("verbose").unwrap_err().to_string();
        assert!(e.contains("\"verbose\" is not a level"), "{e}");
    }
}
