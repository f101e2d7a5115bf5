//! What only the NBD tests share: the real `kemari-nbd` binary (target,
//! proxy, control commands) and disk images; the rest is `kemari_testkit`.

#![allow(dead_code)]

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use kemari_testkit::{free_port, wait_port, KillOnDrop};

pub const BIN: &str = env!("CARGO_BIN_EXE_kemari-nbd");

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

pub fn serve(exports: &[String]) -> (KillOnDrop, u16) {
    let port = free_port();
    let mut c = Command::new(BIN);
    c.arg("serve")
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"));
    for e in exports {
        c.arg("--export").arg(e);
    }
    let p = KillOnDrop(c.env("RUST_LOG", "warn").spawn().expect("spawn target"));
    wait_port(port);
    (p, port)
}

pub fn proxy(upstream: &str, cache: &Path, control: &Path, extra: &[&str]) -> (KillOnDrop, u16) {
    let port = free_port();
    let p = proxy_on(upstream, cache, control, port, extra);
    (p, port)
}

pub fn proxy_on(
    upstream: &str,
    cache: &Path,
    control: &Path,
    port: u16,
    extra: &[&str],
) -> KillOnDrop {
    let p = KillOnDrop(
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
