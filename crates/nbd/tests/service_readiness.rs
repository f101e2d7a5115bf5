//! systemd readiness (`sd_notify`, packaging/systemd/kemari-nbd@.service
//! is `Type=notify`): with a test-owned Unix datagram socket in
//! `NOTIFY_SOCKET`, as systemd sets it, the target and the proxy send
//! `READY=1` and a `STATUS=` line once they serve — a client connecting the
//! moment it arrives gets the NBD greeting.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::Duration;

use common::*;
use kemari_testkit::*;

const PATIENCE: Duration = Duration::from_secs(30);

/// The first 8 bytes a new client reads: the NBD greeting's magic.
fn greeting(mut s: impl Read) -> [u8; 8] {
    let mut magic = [0u8; 8];
    s.read_exact(&mut magic).expect("the NBD greeting");
    magic
}

#[test]
fn the_target_is_ready_once_it_serves() {
    let d = TempDir::new("notify-target");
    make_image(&d.path("a.img"), 1 << 20, 1);
    let notify = NotifySocket::bind(&d.path(""));
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let (k, v) = notify.env();
    let _target = KillOnDrop(
        Command::new(BIN)
            .args(["serve", "--listen", &listen, "--export"])
            .arg(format!("a={}", d.path("a.img").display()))
            .env(k, v)
            .spawn()
            .expect("spawn kemari-nbd serve"),
    );
    let ready = notify.next("the target's readiness", PATIENCE);
    let s = TcpStream::connect(("127.0.0.1", port)).expect("READY=1 before the port listens");
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    assert_eq!(&greeting(s), b"NBDMAGIC");
    assert_eq!(
        ready.get("READY").map(String::as_str),
        Some("1"),
        "{ready:?}"
    );
    assert_eq!(
        ready.get("STATUS"),
        Some(&format!("target serving on {listen}")),
        "{ready:?}"
    );
    assert!(notify.pending().is_none(), "one notification only");
}

#[test]
fn the_proxy_is_ready_once_it_serves() {
    let d = TempDir::new("notify-proxy");
    make_image(&d.path("a.img"), 1 << 20, 2);
    let (_target, port) = serve(&[format!("a={}", d.path("a.img").display())]);
    let notify = NotifySocket::bind(&d.path(""));
    let sock = d.path("proxy.sock");
    let listen = format!("unix:{}", sock.display());
    let (k, v) = notify.env();
    let _proxy = KillOnDrop(
        Command::new(BIN)
            .args(["proxy", "--upstream", &format!("nbd://127.0.0.1:{port}/a")])
            .arg("--cache")
            .arg(d.path("cache"))
            .args(["--listen", &listen])
            .env(k, v)
            .spawn()
            .expect("spawn kemari-nbd proxy"),
    );
    let ready = notify.next("the proxy's readiness", PATIENCE);
    let s = UnixStream::connect(&sock).expect("READY=1 before the socket listens");
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    assert_eq!(&greeting(s), b"NBDMAGIC");
    assert_eq!(
        ready.get("READY").map(String::as_str),
        Some("1"),
        "{ready:?}"
    );
    assert_eq!(
        ready.get("STATUS"),
        Some(&format!("proxy serving on {listen}")),
        "{ready:?}"
    );
}
