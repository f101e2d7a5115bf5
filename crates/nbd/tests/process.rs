//! `kemari-nbd` as a process: its sockets (never over a file or a live
//! socket, removed at exit and on SIGTERM/SIGINT), its command-line output
//! on a closed pipe, its logs and its version.

mod common;

use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;
use kemari_testkit::*;

fn spawn_serve(d: &TempDir, listen: &str, extra: &[&str]) -> Child {
    Command::new(BIN)
        .args(["serve", "--export"])
        .arg(format!("a={}", d.path("a.img").display()))
        .args(["--listen", listen])
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kemari-nbd")
}

/// `kemari-nbd proxy` of the target at `port`, with its cache in `d`.
fn proxy_cmd(d: &TempDir, port: u16, control: &Path, listen: &str) -> Command {
    let mut c = Command::new(BIN);
    c.args(["proxy", "--upstream", &format!("nbd://127.0.0.1:{port}/a")])
        .arg("--cache")
        .arg(d.path("cache"))
        .arg("--control")
        .arg(control)
        .args(["--listen", listen]);
    c
}

fn wait_socket(path: &Path) {
    wait_for("the socket to accept", Duration::from_secs(10), || {
        UnixStream::connect(path).is_ok()
    });
}

fn stderr_of(child: Child) -> String {
    let out = child.wait_with_output().expect("output");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_regular_file_at_the_listen_or_control_path_is_refused_and_left_intact() {
    let d = TempDir::new("regular");
    make_image(&d.path("a.img"), 1 << 20, 1);
    let precious = d.path("precious.txt");
    std::fs::write(&precious, b"do not delete").unwrap();
    let mut c = spawn_serve(&d, &format!("unix:{}", precious.display()), &[]);
    let status = wait_exit(&mut c, "kemari-nbd serve");
    let err = stderr_of(c);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("is not a socket; not replacing it"), "{err}");
    assert_eq!(std::fs::read(&precious).unwrap(), b"do not delete");
    // The proxy's control socket too (checked before the proxy starts).
    let (_t, port) = serve(&[format!("a={}", d.path("a.img").display())]);
    let mut p = proxy_cmd(&d, port, &precious, &format!("127.0.0.1:{}", free_port()))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_exit(&mut p, "kemari-nbd proxy");
    let err = stderr_of(p);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&precious).unwrap(), b"do not delete");
}

#[test]
fn a_live_servers_socket_is_refused_and_it_stays_reachable() {
    let d = TempDir::new("live");
    make_image(&d.path("a.img"), 1 << 20, 2);
    let sock = d.path("t.sock");
    let listen = format!("unix:{}", sock.display());
    let _first = KillOnDrop(spawn_serve(&d, &listen, &[]));
    wait_socket(&sock);
    let mut second = spawn_serve(&d, &listen, &[]);
    let status = wait_exit(&mut second, "the second kemari-nbd");
    let err = stderr_of(second);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("another process is serving this socket"),
        "{err}"
    );
    let url = format!("nbd+unix:///a?socket={}", sock.display());
    let c = nbd_client::client::Client::connect(&url).expect("the first server still answers");
    assert_eq!(c.size(), 1 << 20);
}

#[test]
fn sigterm_and_sigint_remove_the_listen_and_control_sockets() {
    let d = TempDir::new("sigterm");
    make_image(&d.path("a.img"), 1 << 20, 3);
    for signal in ["TERM", "INT"] {
        let sock = d.path("t.sock");
        let mut c = spawn_serve(&d, &format!("unix:{}", sock.display()), &[]);
        wait_socket(&sock);
        run(Command::new("kill").args([&format!("-{signal}"), &c.id().to_string()]));
        let status = wait_exit(&mut c, "kemari-nbd after a signal");
        assert_eq!(status.code(), Some(0), "SIG{signal}: {status:?}");
        assert!(!sock.exists(), "SIG{signal} left {} behind", sock.display());
    }
    // A proxy's listen and control sockets.
    let (_t, port) = serve(&[format!("a={}", d.path("a.img").display())]);
    let (ctl, sock) = (d.path("p.ctl"), d.path("p.sock"));
    let mut p = proxy_cmd(&d, port, &ctl, &format!("unix:{}", sock.display()))
        .spawn()
        .unwrap();
    wait_socket(&sock);
    wait_socket(&ctl);
    run(Command::new("kill").args(["-TERM", &p.id().to_string()]));
    assert_eq!(wait_exit(&mut p, "the proxy").code(), Some(0));
    assert!(
        !sock.exists() && !ctl.exists(),
        "the proxy left its sockets"
    );
}

#[test]
fn a_stale_socket_is_replaced() {
    let d = TempDir::new("stale");
    make_image(&d.path("a.img"), 1 << 20, 4);
    let sock = d.path("t.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(std::fs::symlink_metadata(&sock)
        .unwrap()
        .file_type()
        .is_socket());
    let _c = KillOnDrop(spawn_serve(&d, &format!("unix:{}", sock.display()), &[]));
    wait_socket(&sock);
}

#[test]
fn status_into_a_closed_pipe_ends_quietly() {
    let d = TempDir::new("pipe");
    make_image(&d.path("a.img"), 1 << 20, 5);
    let (_t, port) = serve(&[format!("a={}", d.path("a.img").display())]);
    let ctl = d.path("p.ctl");
    let (_p, _) = proxy(
        &format!("nbd://127.0.0.1:{port}/a"),
        &d.path("cache"),
        &ctl,
        &[],
    );
    wait_socket(&ctl);
    // `kemari-nbd status … | head -1`, the reader gone before we write.
    assert_quiet_on_closed_stdout(
        Command::new(BIN).arg("status").arg("--control").arg(&ctl),
        "kemari-nbd status",
    );
    // Through a real shell pipeline as well.
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{BIN}' status --control '{}' | head -1",
            ctl.display()
        ))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "{\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
}

#[test]
fn an_invalid_log_level_is_refused_and_logs_carry_no_escapes() {
    assert_verbose_log_filter_refused(Command::new(BIN).args([
        "serve",
        "--export",
        "a=/nonexistent",
        "--log-level",
        "verbose",
    ]));
    let out = Command::new(BIN)
        .args(["status", "--control", "/nonexistent"])
        .env("KEMARI_LOG", "loud")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // Logs into a file: no colour escapes.
    let d = TempDir::new("logs");
    make_image(&d.path("a.img"), 1 << 20, 6);
    let log = std::fs::File::create(d.path("log")).unwrap();
    let port = free_port();
    let _c = KillOnDrop(
        Command::new(BIN)
            .args(["serve", "--export"])
            .arg(format!("a={}", d.path("a.img").display()))
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--log-level",
                "debug",
            ])
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    wait_port(port);
    let text = log_without_escapes(&d.path("log"), "connection");
    assert!(text.contains("DEBUG"), "{text}");
}

#[test]
fn version_is_printed() {
    let out = run(Command::new(BIN).arg("--version"));
    assert_eq!(
        String::from_utf8_lossy(&out).trim(),
        format!("kemari-nbd {}", env!("CARGO_PKG_VERSION"))
    );
}
