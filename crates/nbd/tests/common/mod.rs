//! Helpers for the integration tests: start the real `kemari-nbd` binary,
//! make images, find external tools.

#![allow(dead_code)]

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_kemari-nbd");

/// A child process killed on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// SIGKILL, as in a crash.
    pub fn crash(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn tool(name: &str) -> bool {
    let ok = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIP: {name} is not installed");
    }
    ok
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
}

pub fn wait_port(port: u16) {
    let t = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "port {port} never opened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!(
            "knbd-it-{tag}-{}-{}",
            std::process::id(),
            free_port()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        TempDir(d)
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic pseudo-random bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

pub fn make_image(path: &Path, size: usize, seed: u64) -> Vec<u8> {
    let v = pattern(size, seed);
    let mut f = std::fs::File::create(path).expect("create image");
    f.write_all(&v).expect("write image");
    v
}

pub fn serve(exports: &[String]) -> (Proc, u16) {
    let port = free_port();
    let mut c = Command::new(BIN);
    c.arg("serve")
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"));
    for e in exports {
        c.arg("--export").arg(e);
    }
    let p = Proc(c.env("RUST_LOG", "warn").spawn().expect("spawn target"));
    wait_port(port);
    (p, port)
}

pub fn proxy(upstream: &str, cache: &Path, control: &Path, extra: &[&str]) -> (Proc, u16) {
    let port = free_port();
    let p = proxy_on(upstream, cache, control, port, extra);
    (p, port)
}

pub fn proxy_on(upstream: &str, cache: &Path, control: &Path, port: u16, extra: &[&str]) -> Proc {
    let p = Proc(
        Command::new(BIN)
            .args(["proxy", "--upstream", upstream, "--export", "disk"])
            .arg("--cache")
            .arg(cache)
            .arg("--control")
            .arg(control)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .args(extra)
            .env("RUST_LOG", "warn")
            .spawn()
            .expect("spawn proxy"),
    );
    wait_port(port);
    p
}

pub fn status(control: &Path) -> serde_json::Value {
    let out = Command::new(BIN)
        .arg("status")
        .arg("--control")
        .arg(control)
        .output()
        .expect("status");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status json");
    v["status"].clone()
}

pub fn control_cmd(cmd: &str, control: &Path) {
    let st = Command::new(BIN)
        .arg(cmd)
        .arg("--control")
        .arg(control)
        .stdout(Stdio::null())
        .status()
        .expect("control");
    assert!(st.success(), "{cmd} failed");
}

pub fn run(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.output().expect("spawn tool");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

pub fn sh(script: &str) -> Vec<u8> {
    run(Command::new("sh").args(["-c", script]))
}
