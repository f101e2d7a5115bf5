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
