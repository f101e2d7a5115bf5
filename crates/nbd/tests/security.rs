//! TLS (STARTTLS with PSK and X.509) and the client allow-list, against
//! real clients: nbdinfo (libnbd, GnuTLS) and qemu-img / qemu-io.

mod common;

use std::io::Read;
use std::net::TcpStream;
use std::process::{Command, Output};
use std::time::Duration;

use common::*;
use kemari_testkit::*;

/// A target requiring TLS with the test certificates in `d/pki/server`.
fn serve_x509(d: &TempDir, export: &str) -> (KillOnDrop, u16) {
    let server = d.path("pki/server").display().to_string();
    serve_args(&args(&[
        "--export",
        export,
        "--tls",
        "require",
        "--tls-certificates",
        &server,
    ]))
}

fn image(d: &TempDir) -> String {
    sparse_image(&d.path("a.img"), 4 << 20, &[0, 1 << 20]);
    format!("a={}", d.path("a.img").display())
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn output(cmd: &mut Command) -> Output {
    run_with_timeout(cmd, Duration::from_secs(60))
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr)
}

#[test]
#[cfg_attr(no_nbdinfo, ignore = "needs nbdinfo (libnbd-bin)")]
fn psk_clients_get_in_and_a_wrong_key_is_refused() {
    let d = TempDir::new("psk");
    let ex = image(&d);
    make_psk(&d.path("keys.psk"), "alice", 1);
    make_psk(&d.path("wrong.psk"), "alice", 2);
    let mut a = args(&["--export", &ex, "--tls", "require", "--tls-psk"]);
    a.push(d.path("keys.psk").display().to_string());
    let (_t, port) = serve_args(&a);
    let url = |file: &str| {
        format!(
            "nbds://alice@127.0.0.1:{port}/a?tls-psk-file={}",
            d.path(file).display()
        )
    };
    let ok = output(Command::new("nbdinfo").arg(url("keys.psk")));
    assert!(ok.status.success(), "{}", text(&ok));
    let t = text(&ok);
    assert!(t.contains("with TLS"), "{t}");
    assert!(t.contains("export-size: 4194304"), "{t}");
    let bad = output(Command::new("nbdinfo").arg(url("wrong.psk")));
    assert!(!bad.status.success(), "a wrong key got in: {}", text(&bad));
    // A key for an identity the server does not know.
    make_psk(&d.path("bob.psk"), "bob", 1);
    let bob = output(Command::new("nbdinfo").arg(format!(
        "nbds://bob@127.0.0.1:{port}/a?tls-psk-file={}",
        d.path("bob.psk").display()
    )));
    assert!(!bob.status.success(), "{}", text(&bob));
    // Data through the TLS relay, several connections at once.
    if tool("nbdcopy") {
        nbdcopy_in_and_back(&d.0, &url("keys.psk"), 4 << 20, 9);
    }
}

#[test]
#[cfg_attr(
    any(no_nbdinfo, no_openssl),
    ignore = "needs nbdinfo (libnbd-bin) and openssl"
)]
fn x509_with_nbdinfo_and_tls_require_refuses_a_plain_client() {
    let d = TempDir::new("x509");
    let ex = image(&d);
    make_pki(&d.path("pki"));
    let (_t, port) = serve_x509(&d, &ex);
    let client = d.path("pki/client").display().to_string();
    let ok = output(Command::new("nbdinfo").arg(format!(
        "nbds://localhost:{port}/a?tls-certificates={client}"
    )));
    assert!(ok.status.success(), "{}", text(&ok));
    assert!(text(&ok).contains("with TLS"), "{}", text(&ok));
    // Without TLS: refused.
    let plain = output(Command::new("nbdinfo").arg(format!("nbd://127.0.0.1:{port}/a")));
    assert!(!plain.status.success(), "{}", text(&plain));
    // On the wire: every option but STARTTLS gets NBD_REP_ERR_TLS_REQD.
    use nbd_client::protocol::*;
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).unwrap();
    let mut req = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    req.extend(encode_option(OPT_GO, &encode_info_request("a", &[])));
    std::io::Write::write_all(&mut s, &req).unwrap();
    let mut rep = [0u8; OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut rep).unwrap();
    let h = decode_option_reply_header(&rep, 1 << 16).unwrap();
    assert_eq!(h.reply_type, REP_ERR_TLS_REQD);
}

#[test]
#[cfg_attr(
    any(no_qemu_img, no_qemu_io, no_nbdinfo, no_openssl),
    ignore = "needs qemu-img, qemu-io (qemu-utils), nbdinfo and openssl"
)]
fn x509_client_certificates_and_psk_with_qemu() {
    let d = TempDir::new("qemu-tls");
    let ex = image(&d);
    make_pki(&d.path("pki"));
    // ca-cert.pem beside the server's certificate: clients must show one.
    std::fs::copy(d.path("pki/ca-cert.pem"), d.path("pki/server/ca-cert.pem")).unwrap();
    let (_t, port) = serve_x509(&d, &ex);
    let client = d.path("pki/client").display().to_string();
    let io = output(Command::new("qemu-io").args([
        "--object",
        &format!("tls-creds-x509,id=tls0,dir={client},endpoint=client"),
        "-c",
        "read -P 0x41 0 65536",
        "-c",
        "write -P 0x33 2097152 4096",
        "-c",
        "read -P 0x33 2097152 4096",
        "--image-opts",
        &format!("driver=nbd,host=localhost,port={port},export=a,tls-creds=tls0"),
    ]));
    let t = text(&io);
    assert!(io.status.success() && !t.contains("failed"), "{t}");
    // No client certificate: refused.
    std::fs::create_dir_all(d.path("anon")).unwrap();
    std::fs::copy(d.path("pki/ca-cert.pem"), d.path("anon/ca-cert.pem")).unwrap();
    let anon = output(Command::new("nbdinfo").arg(format!(
        "nbds://localhost:{port}/a?tls-certificates={}",
        d.path("anon").display()
    )));
    assert!(!anon.status.success(), "{}", text(&anon));
    // TLS-PSK with qemu (its keys file is DIR/keys.psk), --tls on.
    std::fs::create_dir_all(d.path("psk")).unwrap();
    make_psk(&d.path("psk/keys.psk"), "alice", 3);
    let psk = d.path("psk/keys.psk").display().to_string();
    let (_p, port) = serve_args(&args(&["--export", &ex, "--tls", "on", "--tls-psk", &psk]));
    let info = output(Command::new("qemu-img").args([
        "info",
        "--output=json",
        "--object",
        &format!(
            "tls-creds-psk,id=tls0,dir={},username=alice,endpoint=client",
            d.path("psk").display()
        ),
        "--image-opts",
        &format!("driver=nbd,host=127.0.0.1,port={port},export=a,tls-creds=tls0"),
    ]));
    assert!(info.status.success(), "{}", text(&info));
    assert!(
        text(&info).contains("\"virtual-size\": 4194304"),
        "{}",
        text(&info)
    );
    // --tls on serves plain clients too.
    let plain =
        output(Command::new("qemu-img").args(["info", &format!("nbd://127.0.0.1:{port}/a")]));
    assert!(plain.status.success(), "{}", text(&plain));
}

#[test]
fn tls_flags_are_checked() {
    let d = TempDir::new("tls-flags");
    let ex = image(&d);
    let fails = |extra: &[&str], needle: &str| {
        let o = output(
            Command::new(BIN)
                .args(["serve", "--export", &ex])
                .args(extra),
        );
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {}", text(&o));
        assert!(text(&o).contains(needle), "{extra:?}: {}", text(&o));
    };
    fails(
        &["--tls", "on"],
        "need --tls-certificates DIR or --tls-psk FILE",
    );
    make_psk(&d.path("k.psk"), "alice", 1);
    let psk = d.path("k.psk").display().to_string();
    fails(&["--tls-psk", &psk], "--tls is off");
    std::fs::write(d.path("bad.psk"), "alice:xyz\n").unwrap();
    let bad = d.path("bad.psk").display().to_string();
    fails(&["--tls", "on", "--tls-psk", &bad], "line 1");
    let dir = d.0.display().to_string();
    fails(
        &["--tls", "on", "--tls-certificates", &dir],
        "no server-cert.pem",
    );
    let o = output(Command::new(BIN).args(["serve", "--export", &ex, "--tls", "maybe"]));
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    fails(
        &["--allow", "10.0.0.0/8", "--listen", "unix:/tmp/x.sock"],
        "TCP listeners",
    );
    fails(
        &["--allow", "10.0.0.0/40"],
        "invalid --allow \"10.0.0.0/40\"",
    );
}

#[test]
fn the_allow_list_closes_other_clients_before_any_byte() {
    let d = TempDir::new("allow");
    let ex = image(&d);
    // 192.0.2.0/24 is TEST-NET-1: never this machine.
    let log = std::fs::File::create(d.path("log")).unwrap();
    let port = free_port();
    let _t = KillOnDrop(
        Command::new(BIN)
            .args(["serve", "--export", &ex, "--allow", "192.0.2.0/24"])
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    wait_port(port);
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(got.is_empty(), "a refused client got {got:?}");
    wait_for("the refusal in the log", Duration::from_secs(10), || {
        read_text(&d.path("log")).contains("address not allowed")
    });
    assert!(nbd_client::client::Client::connect(&format!("nbd://127.0.0.1:{port}/a")).is_err());
    // Allowed: the loopback network and one address.
    let (_a, port) = serve_args(&args(&[
        "--export",
        &ex,
        "--allow",
        "192.0.2.0/24",
        "--allow",
        "127.0.0.0/8",
    ]));
    let c = nbd_client::client::Client::connect(&format!("nbd://127.0.0.1:{port}/a")).unwrap();
    assert_eq!(c.size(), 4 << 20);
    let (_b, port) = serve_args(&args(&["--export", &ex, "--allow", "127.0.0.1"]));
    assert!(nbd_client::client::Client::connect(&format!("nbd://127.0.0.1:{port}/a")).is_ok());
}

/// CVE-2024-7409's two holes, closed: a client that connects and never
/// negotiates is closed after --handshake-limit, and past
/// --max-connections a connection is closed at once; once places are
/// free a real client gets in. Both refusals show in /metrics.
#[test]
#[cfg_attr(no_nbdinfo, ignore = "needs nbdinfo (libnbd-bin)")]
fn silent_clients_are_closed_and_connections_are_capped() {
    use kemari_testkit::http::{get, over_tcp, scrape};
    use std::time::Instant;

    let d = TempDir::new("limits");
    let ex = image(&d);
    let metrics = free_port();
    let (_t, port) = serve_args(&args(&[
        "--export",
        &ex,
        "--handshake-limit",
        "1",
        "--max-connections",
        "2",
        "--metrics-listen",
        &format!("127.0.0.1:{metrics}"),
    ]));
    let addr = format!("127.0.0.1:{port}");
    let greeted = |s: &mut TcpStream| {
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello).is_ok() && &hello[..8] == b"NBDMAGIC"
    };
    // The readiness probe's connection has gone.
    let scraped = || scrape(over_tcp(metrics, &get("/metrics")));
    wait_for("no connection open", Duration::from_secs(10), || {
        scraped().contains("\nkemari_nbd_connections 0\n")
    });
    // Two clients that say nothing take both places.
    let mut silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    let opened = Instant::now();
    for s in &mut silent {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        assert!(greeted(s), "an admitted client was not greeted");
    }
    // A third is closed at once, without a greeting.
    let mut third = TcpStream::connect(&addr).unwrap();
    third
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut rest = Vec::new();
    assert_eq!(
        third.read_to_end(&mut rest).unwrap(),
        0,
        "past the limit, yet served"
    );
    // The silent two are closed once their second is up.
    for s in &mut silent {
        let _ = s.read_to_end(&mut rest);
    }
    let waited = opened.elapsed();
    assert!(
        waited >= Duration::from_millis(800),
        "closed after {waited:?}"
    );
    assert!(waited < Duration::from_secs(15), "closed after {waited:?}");
    // Their places are free again (their threads gone): a client that
    // negotiates gets in.
    wait_for(
        "the closed connections' places",
        Duration::from_secs(10),
        || scraped().contains("\nkemari_nbd_connections 0\n"),
    );
    let info = output(Command::new("nbdinfo").arg(format!("nbd://127.0.0.1:{port}/a")));
    assert!(info.status.success(), "{}", text(&info));
    let m = scraped();
    for line in [
        "kemari_nbd_connections_refused_total{reason=\"connection_limit\"} 1\n",
        "kemari_nbd_connections_refused_total{reason=\"handshake_limit\"} 2\n",
        "kemari_nbd_connections_refused_total{reason=\"not_allowed\"} 0\n",
    ] {
        assert!(m.contains(line), "no {line:?} in\n{m}");
    }
}
