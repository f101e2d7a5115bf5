//! What `kemari` and `kemarictl` write, without a VM: `kemarictl` into a
//! closed pipe ends quietly, `kemari` refuses a log filter that would log
//! nothing, and its logs carry no colour escapes into a file.

use std::process::Command;
use std::sync::Arc;

use kemari::api::{ApiServer, Reply, ServerOptions};
use kemari_testkit::*;

#[test]
fn kemarictl_into_a_closed_pipe_ends_quietly() {
    let dir = scratch("closed-pipe");
    let sock = dir.join("api.sock");
    // An API that answers every request with a large JSON body.
    let big: Vec<String> = (0..5000).map(|i| format!("device-{i}")).collect();
    let _server = ApiServer::start(
        &sock,
        ServerOptions::default(),
        Arc::new(move |_| Ok(Reply::Json(serde_json::json!({ "devices": big })))),
    )
    .unwrap();
    // `kemarictl -s SOCK config | true`, the reader gone before the answer.
    assert_quiet_on_closed_stdout(kemarictl(&sock).arg("config"), "kemarictl config");
    // Through a shell pipeline.
    let bin = kemari_testkit::bins::bin("kemarictl");
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{}' -s '{}' config | true",
            bin.display(),
            sock.display()
        ))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
}

#[test]
fn an_invalid_log_level_is_refused() {
    assert_verbose_log_filter_refused(kemari().args([
        "--kernel",
        "/nonexistent",
        "--log-level",
        "verbose",
    ]));
    assert_verbose_log_filter_refused(
        kemari()
            .args(["--kernel", "/nonexistent"])
            .env("KEMARI_LOG", "verbose"),
    );
}

#[test]
fn logs_into_a_file_carry_no_escape_codes() {
    let dir = scratch("log-file");
    let log = std::fs::File::create(dir.join("kemari.log")).unwrap();
    // Waiting for a zero-copy migration logs at info level before any VM
    // exists (no KVM needed).
    let _k = KillOnDrop(
        kemari()
            .arg("--incoming-local")
            .arg(dir.join("in.sock"))
            .args(["--log-level", "info"])
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let text = log_without_escapes(&dir.join("kemari.log"), "waiting");
    assert!(text.contains("INFO"), "{text}");
}

/// The lines `kemarictl` wrote on stderr for an operation, checked to be
/// progress lines of `prefix`; its stdout is the JSON report.
fn progress_lines(out: &std::process::Output, prefix: &str) -> Vec<String> {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not the report ({e}): {err}"));
    assert!(report.is_object(), "{report}");
    let lines: Vec<String> = err.lines().map(str::to_owned).collect();
    assert!(!lines.is_empty(), "no progress lines");
    for l in &lines {
        assert!(
            l.starts_with(prefix),
            "{l:?} is not a progress line of {prefix}"
        );
        assert!(!l.contains('\u{1b}'), "escape codes off a terminal: {l:?}");
    }
    lines
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn off_a_terminal_kemarictl_writes_progress_as_plain_lines() {
    use kemari_testkit::scenario::*;
    let _one = one_at_a_time();
    let dir = scratch("progress-lines");
    let key = test_key(&dir);
    let port = free_port();
    let standby = spawn_vmm(
        &[
            "--ft-standby".into(),
            format!("127.0.0.1:{port}"),
            "--migration-key-file".into(),
            key.display().to_string(),
        ],
        &dir.join("console-standby.log"),
        &dir.join("api-standby.sock"),
        &[],
    );
    wait_listening(port);
    let vmm = spawn_vmm(
        &[
            "--kernel".into(),
            guest_elf().display().to_string(),
            "--memory".into(),
            "128M".into(),
            "--cmdline".into(),
            "counter=20".into(),
        ],
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[],
    );
    wait_for(
        "the guest's counter",
        std::time::Duration::from_secs(30),
        || counters(&vmm.console).len() >= 2,
    );

    // A snapshot: its phase, with pages of guest memory gone through.
    let out = ctl(&vmm.api, &["snapshot", dir.join("snap").to_str().unwrap()]);
    let lines = progress_lines(&out, "snapshot 1: ");
    // Its phases while the display saw it running (a quiet machine may
    // finish the 128 MiB before the first look: then only the last line),
    // and one end, last.
    assert!(
        lines[..lines.len() - 1]
            .iter()
            .all(|l| !l.contains(": completed") && !l.contains(": failed")),
        "{lines:#?}"
    );
    let last = lines.last().unwrap();
    assert!(last.starts_with("snapshot 1: completed: "), "{lines:#?}");
    // Every page of guest memory gone through.
    assert!(last.contains("32768/32768 pages (100%)"), "{lines:#?}");

    // Fault tolerance's initial synchronization: its pre-copy rounds.
    let peer = format!("127.0.0.1:{port}");
    let out = ctl(
        &vmm.api,
        &[
            "ft",
            "start",
            "--peer",
            &peer,
            "--key-file",
            key.to_str().unwrap(),
        ],
    );
    let lines = progress_lines(&out, "ft_start 2: ");
    assert!(
        lines.last().unwrap().starts_with("ft_start 2: completed"),
        "{lines:#?}"
    );
    // The pre-copy's pages: the first round's when it was seen running,
    // else the last round's in the final line.
    assert!(lines.iter().any(|l| l.contains(" pages (")), "{lines:#?}");

    assert!(ctl(&vmm.api, &["ft", "stop"]).status.success());
    let mut sb = standby.child;
    let _ = wait_exit(&mut sb.0, "the standby");
    assert!(ctl(&vmm.api, &["shutdown"]).status.success());
    let mut v = vmm.child;
    assert!(wait_exit(&mut v.0, "kemari").success());
}
