//! Man pages: clap_mangen's rendering of each command and subcommand (name,
//! synopsis, description, options, subcommands, version), and for the
//! three main pages the sections a command line cannot tell — exit status,
//! files, environment, see also.

use std::io::Write;
use std::path::Path;

use clap_mangen::Man;
use roff::{bold, italic, roman, Roff};

use crate::WriteError;

/// The extra sections of `name`'s page: (heading, paragraphs).
fn extra_sections(name: &str) -> Vec<(&'static str, Vec<String>)> {
    let see_also = |others: &[&str]| -> (&'static str, Vec<String>) {
        let mut refs: Vec<String> = others.iter().map(|o| format!("{o}(1)")).collect();
        refs.push("systemd.service(5)".into());
        ("SEE ALSO", vec![refs.join(", ")])
    };
    match name {
        "kemari" => vec![
            (
                "EXIT STATUS",
                vec![
                    "0: a clean guest poweroff, a guest reset, an API shutdown, SIGTERM or SIGINT, a completed hand-over, or a standby whose primary ended protection.".into(),
                    "1: the VMM failed (bad configuration, missing kernel, KVM failure), or a standby may not fail over (its fence is held).".into(),
                    "2: a command-line syntax error.".into(),
                    "3: the guest reported a failure through the exit port 0xf4.".into(),
                    "4: the guest crashed (a vCPU triple-faulted; its registers are logged).".into(),
                    "Killed by SIGSYS: a thread made a system call its seccomp filter forbids (rerun with --seccomp log and read dmesg).".into(),
                ],
            ),
            (
                "FILES",
                vec![
                    "/etc/kemari/NAME.toml: the configuration the systemd unit kemari@NAME.service starts kemari with (--config; the same settings as the flags).".into(),
                    "/run/kemari/: the units' runtime folder, for API sockets (api_socket = \"/run/kemari/NAME.sock\").".into(),
                    "/var/lib/kemari/: the units' state folder, for disks, memory files and snapshots.".into(),
                ],
            ),
            (
                "ENVIRONMENT",
                vec![
                    "KEMARI_LOG: the log filter (--log-level). KEMARI_SECCOMP: --seccomp.".into(),
                    "NOTIFY_SOCKET: set by systemd for a Type=notify unit; kemari sends READY=1 and a STATUS= line once its VM runs, or once it listens for its VM (--incoming, --incoming-local, --ft-standby, --restore DIR --await-state).".into(),
                ],
            ),
            see_also(&["kemarictl", "kemari-nbd"]),
        ],
        "kemarictl" => vec![see_also(&["kemari", "kemari-agent", "kemari-nbd"])],
        "kemari-agent" => vec![
            (
                "ENVIRONMENT",
                vec![
                    "KEMARI_ETCD: --etcd. KEMARI_LOG: the log filter (--log-level).".into(),
                ],
            ),
            see_also(&["kemari", "kemarictl"]),
        ],
        "kemari-nbd" => vec![
            (
                "ENVIRONMENT",
                vec![
                    "KEMARI_LOG: the log filter (--log-level).".into(),
                    "NOTIFY_SOCKET: set by systemd for a Type=notify unit; serve and proxy send READY=1 and a STATUS= line once they listen.".into(),
                ],
            ),
            see_also(&["kemari", "kemarictl"]),
        ],
        _ => Vec::new(),
    }
}

/// Renders `cmd`'s page, with its extra sections.
fn render(cmd: clap::Command, out: &mut dyn Write) -> std::io::Result<()> {
    let name = cmd.get_name().to_owned();
    Man::new(cmd).render(out)?;
    let sections = extra_sections(&name);
    if sections.is_empty() {
        return Ok(());
    }
    let mut roff = Roff::new();
    for (heading, paragraphs) in sections {
        roff.control("SH", [heading]);
        for p in paragraphs {
            roff.control("PP", []);
            // A leading "NAME:" (a file, a variable, a status) in bold.
            match p.split_once(": ") {
                Some((term, rest)) if !term.contains(' ') || term.starts_with('/') => {
                    roff.text([bold(term), roman(": "), roman(rest)]);
                }
                _ if p.contains("(1)") => {
                    let refs: Vec<_> = p.split(", ").collect();
                    for (i, r) in refs.iter().enumerate() {
                        let sep = if i + 1 < refs.len() { ", " } else { "" };
                        roff.text([italic(*r), roman(sep)]);
                    }
                }
                _ => {
                    roff.text([roman(p)]);
                }
            }
        }
    }
    roff.to_writer(out)
}

/// Writes `DIR/NAME.1` for each command and each of its visible
/// subcommands (`kemarictl-ft-start.1`).
pub fn write_all(commands: &[clap::Command], dir: &Path) -> Result<(), WriteError> {
    fn each(cmd: clap::Command, dir: &Path) -> Result<(), WriteError> {
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            each(sub.clone(), dir)?;
        }
        let file = cmd.get_display_name().unwrap_or(cmd.get_name()).to_owned();
        let path = dir.join(format!("{file}.1"));
        let mut out = Vec::new();
        render(cmd, &mut out)
            .and_then(|()| std::fs::write(&path, out))
            .map_err(|source| WriteError { path, source })
    }
    for cmd in commands {
        let mut cmd = cmd.clone().disable_help_subcommand(true);
        cmd.build();
        each(cmd, dir)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_and_subcommand_gets_a_page_with_its_flags() {
        let dir = std::env::temp_dir().join(format!("xtask-man-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_all(&crate::commands(), &dir).unwrap();
        // roff writes a flag's hyphens as \-.
        let page = |name: &str| {
            std::fs::read_to_string(dir.join(format!("{name}.1")))
                .unwrap()
                .replace("\\-", "-")
        };
        let kemari = page("kemari");
        for text in [
            "--api-socket",
            "--config",
            "EXIT STATUS",
            "NOTIFY_SOCKET",
            "kemarictl",
        ] {
            assert!(kemari.contains(text), "kemari.1 lacks {text}");
        }
        assert!(page("kemarictl-migrate").contains("--max-downtime-ms"));
        assert!(page("kemarictl-ft-start").contains("--peer"));
        assert!(page("kemari-nbd-proxy").contains("--upstream"));
        assert!(page("kemari-agent").contains("--standby-args"));
        assert!(page("kemarictl-fleet").contains("--etcd"));
        // Hidden subcommands (benchmark helpers) get none.
        assert!(!dir.join("kemari-nbd-relay.1").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
