//! What only the NBD tests share: the real `kemari-nbd` binary (target,
//! proxy, control commands) and disk images; the rest is `kemari_testkit`.

#![allow(dead_code)]

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use kemari_testkit::{free_port, run, wait_port, KillOnDrop};

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
    let p = KillOnDrop(c.spawn().expect("spawn target"));
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

/// A target with `args` after `serve` (exports, TLS, allow-list) on a free
/// port of 127.0.0.1.
pub fn serve_args(args: &[String]) -> (KillOnDrop, u16) {
    let port = free_port();
    let p = KillOnDrop(
        Command::new(BIN)
            .arg("serve")
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .args(args)
            .spawn()
            .expect("spawn target"),
    );
    wait_port(port);
    (p, port)
}

/// A sparse image of `size` bytes with `fill` bytes written at each of
/// `data` offsets (64 KiB each); the rest are holes.
pub fn sparse_image(path: &Path, size: u64, data: &[u64]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::create(path).expect("create image");
    f.set_len(size).expect("size image");
    for (i, at) in data.iter().enumerate() {
        f.write_all_at(&vec![0x41 + i as u8; 64 << 10], *at)
            .expect("write image");
    }
    f.sync_all().expect("sync image");
}

/// Test certificates made with the openssl CLI in `dir`: a CA, `server/`
/// (server-cert.pem, server-key.pem for localhost and 127.0.0.1) and
/// `client/` (ca-cert.pem, client-cert.pem, client-key.pem), as nbdkit,
/// qemu and libnbd expect them. Nothing is kept after the test.
pub fn make_pki(dir: &Path) {
    let ossl = |args: &[&str]| {
        run(Command::new("openssl").current_dir(dir).args(args));
    };
    std::fs::create_dir_all(dir.join("server")).unwrap();
    std::fs::create_dir_all(dir.join("client")).unwrap();
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca-key.pem",
        "-out",
        "ca-cert.pem",
        "-days",
        "2",
        "-subj",
        "/CN=kemari test CA",
    ]);
    ossl(&ca);
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for (who, cn) in [
        ("server", "/CN=localhost"),
        ("client", "/CN=kemari test client"),
    ] {
        let key = format!("{who}/{who}-key.pem");
        let cert = format!("{who}/{who}-cert.pem");
        let csr = format!("{who}.csr");
        let ext = format!("{who}.ext");
        let mut req = vec!["req"];
        req.extend(ec);
        req.extend(["-keyout", &key, "-out", &csr, "-subj", cn]);
        ossl(&req);
        ossl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca-cert.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            &ext,
        ]);
    }
    std::fs::copy(dir.join("ca-cert.pem"), dir.join("client/ca-cert.pem")).unwrap();
}

/// A PSK file (psktool's format): `identity` with a 32-byte key made from `seed`.
pub fn make_psk(path: &Path, identity: &str, seed: u64) {
    let key: String = pattern(32, seed)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    std::fs::write(path, format!("{identity}:{key}\n")).unwrap();
}

/// Copies a fresh `size`-byte image (from `seed`) into the export at `url`
/// with nbdcopy over 4 connections, copies the export back out and checks
/// it; returns the image.
pub fn nbdcopy_in_and_back(d: &Path, url: &str, size: usize, seed: u64) -> Vec<u8> {
    let src = make_image(&d.join("src.img"), size, seed);
    run(Command::new("nbdcopy")
        .args(["--connections=4", "--requests=16"])
        .arg(d.join("src.img"))
        .arg(url));
    run(Command::new("nbdcopy").arg(url).arg(d.join("back.img")));
    assert!(std::fs::read(d.join("back.img")).expect("copied back") == src);
    src
}
