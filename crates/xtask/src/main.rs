//! Build-time tasks, never shipped (scripts/package.sh runs them):
//!
//! ```text
//! cargo run -p xtask -- man DIR          # DIR/*.1: kemari, kemarictl, kemari-agent, kemari-nbd and their subcommands
//! cargo run -p xtask -- completions DIR  # DIR/{bash,zsh,fish}/: their shell completions
//! ```
//!
//! Both are rendered from the binaries' own clap definitions
//! (`kemari::cli::Args`, `kemari::ctl::Cli`, `kemari::agent_cli::Args`,
//! `kemari_nbd::cli::Cli`), so
//! they say what the flags are, never what they were.

mod man;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use clap_complete::Shell;

/// Renders the package's man pages and shell completions.
#[derive(Debug, Parser)]
#[command(name = "xtask")]
struct Task {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    /// Man pages (section 1) into DIR.
    Man {
        /// Output folder (created if missing).
        dir: PathBuf,
    },
    /// Bash, zsh and fish completions into DIR/bash, DIR/zsh, DIR/fish.
    Completions {
        /// Output folder (created if missing).
        dir: PathBuf,
    },
}

/// A file that could not be written.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {path}: {source}")]
pub struct WriteError {
    /// The file or folder.
    pub path: PathBuf,
    /// The cause.
    pub source: std::io::Error,
}

/// The shipped binaries' command lines.
fn commands() -> [clap::Command; 4] {
    [
        kemari::cli::Args::command(),
        kemari::ctl::Cli::command(),
        kemari::agent_cli::Args::command(),
        kemari_nbd::cli::Cli::command(),
    ]
}

fn create_dir(dir: &Path) -> Result<(), WriteError> {
    std::fs::create_dir_all(dir).map_err(|source| WriteError {
        path: dir.to_path_buf(),
        source,
    })
}

/// Writes each command's completions for bash (`DIR/bash/NAME`), zsh
/// (`DIR/zsh/_NAME`) and fish (`DIR/fish/NAME.fish`): the names Debian's
/// completion folders expect.
fn completions(dir: &Path) -> Result<(), WriteError> {
    for (shell, sub, file) in [
        (Shell::Bash, "bash", "{}"),
        (Shell::Zsh, "zsh", "_{}"),
        (Shell::Fish, "fish", "{}.fish"),
    ] {
        let sub = dir.join(sub);
        create_dir(&sub)?;
        for mut cmd in commands() {
            let name = cmd.get_name().to_owned();
            let path = sub.join(file.replace("{}", &name));
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut cmd, &name, &mut out);
            std::fs::write(&path, out).map_err(|source| WriteError { path, source })?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let task = Task::parse();
    let done = match &task.what {
        What::Man { dir } => create_dir(dir).and_then(|()| man::write_all(&commands(), dir)),
        What::Completions { dir } => completions(dir),
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_lines_are_valid() {
        for cmd in commands() {
            cmd.debug_assert();
        }
    }

    #[test]
    fn completions_for_three_shells_under_debians_names() {
        let dir = std::env::temp_dir().join(format!("xtask-completions-{}", std::process::id()));
        completions(&dir).unwrap();
        for name in ["kemari", "kemarictl", "kemari-nbd"] {
            for file in [
                format!("bash/{name}"),
                format!("zsh/_{name}"),
                format!("fish/{name}.fish"),
            ] {
                let text = std::fs::read_to_string(dir.join(&file)).unwrap();
                assert!(text.contains(name), "{file}");
            }
        }
        let bash = std::fs::read_to_string(dir.join("bash/kemarictl")).unwrap();
        assert!(bash.contains("warm-restart") && bash.contains("--api-socket"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
