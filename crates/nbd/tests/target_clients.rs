//! The target against real NBD clients (nbdinfo, nbdcopy, qemu-img,
//! qemu-io, fio) and our own client library (also against qemu-nbd).

mod common;

use common::*;
use kemari_testkit::*;
use nbd_client::client::Client;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;

const SIZE: usize = 64 << 20;

#[test]
#[cfg_attr(no_nbdinfo, ignore = "needs nbdinfo (libnbd-bin)")]
fn nbdinfo_lists_exports_and_block_sizes() {
    let d = TempDir::new("info");
    make_image(&d.path("a.img"), SIZE, 1);
    make_image(&d.path("b.img"), 1 << 20, 2);
    let (_t, port) = serve(&[
        format!("a={}", d.path("a.img").display()),
        format!("b={},ro", d.path("b.img").display()),
    ]);
    let out =
        run(Command::new("nbdinfo").args(["--list", "--json", &format!("nbd://127.0.0.1:{port}")]));
    let v: serde_json::Value = serde_json::from_slice(&out).expect("nbdinfo json");
    let ex = v["exports"].as_array().expect("exports");
    assert_eq!(ex.len(), 2);
    let b = ex.iter().find(|e| e["export-name"] == "b").expect("b");
    assert_eq!(b["is_read_only"], true);
    assert_eq!(b["export-size"], 1 << 20);
    let a = ex.iter().find(|e| e["export-name"] == "a").expect("a");
    assert_eq!(a["can_multi_conn"], true);
    assert_eq!(a["block_size_preferred"], 4096);
    assert_eq!(v["protocol"], "newstyle-fixed");
}

#[test]
#[cfg_attr(no_nbdcopy, ignore = "needs nbdcopy (libnbd-bin)")]
fn nbdcopy_out_and_in_checksums_equal() {
    let d = TempDir::new("copy");
    let img = make_image(&d.path("a.img"), SIZE, 3);
    let (_t, port) = serve(&[format!("a={}", d.path("a.img").display())]);
    let url = format!("nbd://127.0.0.1:{port}/a");
    run(Command::new("nbdcopy").arg(&url).arg(d.path("out.img")));
    assert!(std::fs::read(d.path("out.img")).unwrap() == img);
    // Copy in with 4 connections (multi-conn) and compare.
    let src = nbdcopy_in_and_back(&d.0, &url, SIZE, 4);
    assert!(std::fs::read(d.path("a.img")).unwrap() == src);
}

#[test]
#[cfg_attr(
    any(no_qemu_img, no_qemu_io),
    ignore = "needs qemu-img and qemu-io (qemu-utils)"
)]
fn qemu_img_and_qemu_io() {
    let d = TempDir::new("qemu");
    let img = make_image(&d.path("a.img"), SIZE, 5);
    make_image(&d.path("r.img"), 1 << 20, 6);
    let (_t, port) = serve(&[
        format!("a={}", d.path("a.img").display()),
        format!("r={},ro", d.path("r.img").display()),
    ]);
    let url = format!("nbd://127.0.0.1:{port}/a");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", &url])
        .arg(d.path("conv.img")));
    assert!(std::fs::read(d.path("conv.img")).unwrap() == img);
    let out = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0x5a 1000 70000",
        "-c",
        "write -z 1048576 65536",
        "-c",
        "discard 2097152 65536",
        "-c",
        "write -f -P 0x33 200704 4096",
        "-c",
        "flush",
        "-c",
        "read -P 0x5a 1000 70000",
        "-c",
        "read -P 0 1048576 65536",
        "-c",
        "read -P 0x33 200704 4096",
        &url,
    ]));
    let out = String::from_utf8_lossy(&out);
    assert!(!out.contains("Pattern verification failed"), "{out}");
    // A read-only export refuses writes.
    let ro = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "write 0 4096",
            &format!("nbd://127.0.0.1:{port}/r"),
        ])
        .output()
        .unwrap();
    let msg =
        String::from_utf8_lossy(&ro.stdout).to_string() + &String::from_utf8_lossy(&ro.stderr);
    assert!(
        !ro.status.success() || msg.contains("denied") || msg.contains("failed"),
        "{msg}"
    );
}

#[test]
#[cfg_attr(no_fio_nbd, ignore = "needs fio with its nbd engine")]
fn fio_nbd_engine_verifies() {
    let d = TempDir::new("fio");
    make_image(&d.path("a.img"), SIZE, 7);
    let (_t, port) = serve(&[format!("a={}", d.path("a.img").display())]);
    // fio writes its verify state file into the current directory: run it in the temp dir.
    let out = sh(&format!(
        "cd {} && fio --name=v --ioengine=nbd --uri=nbd://127.0.0.1:{port}/a --rw=randwrite --bs=4k \
         --size=16M --iodepth=16 --verify=crc32c --do_verify=1 --output-format=json",
        d.path("").display()
    ));
    // fio prints "connected to NBD server" before the JSON.
    let at = out.iter().position(|&c| c == b'{').expect("fio json");
    let v: serde_json::Value = serde_json::from_slice(&out[at..]).expect("fio json");
    assert_eq!(v["jobs"][0]["error"], 0);
}

#[test]
fn client_library_against_target() {
    let d = TempDir::new("lib");
    let img = make_image(&d.path("a.img"), SIZE, 8);
    let (_t, port) = serve(&[format!("a={}", d.path("a.img").display())]);
    let c = Client::connect(&format!("nbd://127.0.0.1:{port}/a")).unwrap();
    exercise_client(&c, &img);
}

#[test]
#[cfg_attr(no_qemu_nbd, ignore = "needs qemu-nbd (qemu-utils)")]
fn client_library_against_qemu_nbd() {
    let d = TempDir::new("qnbd");
    let img = make_image(&d.path("a.img"), SIZE, 9);
    let sock = d.path("q.sock");
    let _q = KillOnDrop(
        Command::new("qemu-nbd")
            .args(["-f", "raw", "-x", "a", "-k"])
            .arg(&sock)
            .arg(d.path("a.img"))
            .spawn()
            .unwrap(),
    );
    let t = std::time::Instant::now();
    while !sock.exists() {
        assert!(t.elapsed().as_secs() < 10);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let c = Client::connect(&format!("nbd+unix:///a?socket={}", sock.display())).unwrap();
    exercise_client(&c, &img);
}

fn exercise_client(c: &Client, img: &[u8]) {
    assert_eq!(c.size(), img.len() as u64);
    assert!(!c.read_only());
    let mut b = vec![0u8; 100_000];
    c.read_at(12345, &mut b).unwrap();
    assert!(b == img[12345..112345]);
    c.write_at(5000, &[9u8; 3000]).unwrap();
    c.write_at_fua(8000, &[8u8; 10]).unwrap();
    c.flush().unwrap();
    c.write_zeroes(1 << 20, 8192).unwrap();
    c.trim(2 << 20, 4096).unwrap();
    let mut b = vec![0u8; 5010];
    c.read_at(5000, &mut b).unwrap();
    assert!(b[..3000].iter().all(|&x| x == 9));
    assert!(b[3000..3010].iter().all(|&x| x == 8));
    let mut z = vec![1u8; 8192];
    c.read_at(1 << 20, &mut z).unwrap();
    assert!(z.iter().all(|&x| x == 0));
    assert!(c.read_at(img.len() as u64 - 10, &mut [0u8; 20]).is_err());
    // Large transfers (the target splices writes from the socket into the
    // file and sends reads with sendfile): unaligned, FUA, read back.
    let big: Vec<u8> = (0..1_500_001u32).map(|i| (i % 253) as u8).collect();
    c.write_at(3_000_017, &big).unwrap();
    c.write_at_fua(5_000_000, &big[..300_000]).unwrap();
    let mut back = vec![0u8; big.len()];
    c.read_at(3_000_017, &mut back).unwrap();
    assert!(back == big);
    let mut back = vec![0u8; 300_000];
    c.read_at(5_000_000, &mut back).unwrap();
    assert!(back[..] == big[..300_000]);
    c.write_at(3_000_017, &img[3_000_017..3_000_017 + big.len()])
        .unwrap();
    c.write_at(5_000_000, &img[5_000_000..5_300_000]).unwrap();
    // Large writes and reads interleaved with small ones, pipelined from
    // several threads on one connection.
    std::thread::scope(|s| {
        for t in 0..3u64 {
            s.spawn(move || {
                let base = (6 << 20) + t * (1 << 20);
                let data = vec![t as u8 + 1; 1 << 20];
                for _ in 0..4 {
                    c.write_at(base, &data).unwrap();
                    let mut small = [0u8; 4096];
                    c.read_at(base + 8192, &mut small).unwrap();
                    assert!(small.iter().all(|&x| x == t as u8 + 1));
                    let mut b = vec![0u8; 1 << 20];
                    c.read_at(base, &mut b).unwrap();
                    assert!(b == data);
                }
                c.write_at(base, &img[base as usize..base as usize + (1 << 20)])
                    .unwrap();
            });
        }
    });
    // Pipelined reads from several threads.
    std::thread::scope(|s| {
        for t in 0..4u64 {
            s.spawn(move || {
                for i in 0..50u64 {
                    let off = ((t * 50 + i) * 7919 * 4096) % (img.len() as u64 - 4096);
                    let off = off.max(3 << 20);
                    let mut b = [0u8; 4096];
                    c.read_at(off, &mut b).unwrap();
                    assert!(b[..] == img[off as usize..off as usize + 4096]);
                }
            });
        }
    });
}

/// Hostile traffic: the server answers with errors or hangs up, and keeps
/// serving other clients.
#[test]
fn hostile_traffic_never_kills_the_server() {
    let d = TempDir::new("hostile");
    let img = make_image(&d.path("a.img"), 1 << 20, 10);
    let (_t, port) = serve(&[format!("a={}", d.path("a.img").display())]);
    let send = |bytes: &[u8]| {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let _ = s.write_all(bytes);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
        sink
    };
    use nbd_client::protocol::*;
    // Garbage instead of client flags.
    send(&[0xff; 64]);
    // Bad option magic.
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend_from_slice(&[0x41; 40]);
    send(&v);
    // Huge option length.
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend(IHAVEOPT.to_be_bytes());
    v.extend(OPT_GO.to_be_bytes());
    v.extend(u32::MAX.to_be_bytes());
    let out = send(&v);
    assert!(out.len() > 18, "expected an error reply");
    // Options out of order: meta context before structured replies; garbage GO data.
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend(encode_option(OPT_SET_META_CONTEXT, &[1, 2, 3]));
    v.extend(encode_option(OPT_GO, &[0xff, 0xff, 0xff, 0xff, 0, 0]));
    v.extend(encode_option(OPT_GO, &encode_info_request("nope", &[])));
    v.extend(encode_option(OPT_GO, &encode_info_request("a", &[])));
    // Transmission: out-of-range read, huge read, bad command, bad magic.
    for (cmd, off, len) in [
        (CMD_READ, 1u64 << 40, 4096u32),
        (CMD_READ, u64::MAX - 10, 4096),
        (CMD_READ, 0, u32::MAX),
        (99, 0, 0),
        (CMD_TRIM, 1 << 30, 10),
    ] {
        v.extend(
            Request {
                flags: 0,
                command: cmd,
                cookie: 1,
                offset: off,
                len,
            }
            .encode(),
        );
    }
    v.extend([0u8; 28]);
    let out = send(&v);
    assert!(out.len() > 100);
    // Still alive and correct.
    let c = Client::connect(&format!("nbd://127.0.0.1:{port}/a")).unwrap();
    let mut b = [0u8; 16];
    c.read_at(0, &mut b).unwrap();
    // A huge write header: error reply, then hang-up; server survives.
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend(encode_option(OPT_GO, &encode_info_request("a", &[])));
    v.extend(
        Request {
            flags: 0,
            command: CMD_WRITE,
            cookie: 2,
            offset: 0,
            len: u32::MAX,
        }
        .encode(),
    );
    send(&v);
    let c = Client::connect(&format!("nbd://127.0.0.1:{port}/a")).unwrap();
    c.read_at(0, &mut b).unwrap();
    // Large writes (spliced from the socket) that are out of range, or whose
    // payload stops short before the client hangs up; a large read beyond
    // the end: errors or a hang-up, the server survives, data is intact.
    let mut v = CLIENT_FIXED_NEWSTYLE.to_be_bytes().to_vec();
    v.extend(encode_option(OPT_GO, &encode_info_request("a", &[])));
    for (cmd, off, len, payload) in [
        (CMD_WRITE, (1u64 << 20) - 4096, 1u32 << 20, 1usize << 20),
        (CMD_READ, (1 << 20) - 4096, 1 << 20, 0),
        (CMD_WRITE, 0, 512 << 10, 300_000),
    ] {
        v.extend(
            Request {
                flags: 0,
                command: cmd,
                cookie: 3,
                offset: off,
                len,
            }
            .encode(),
        );
        v.extend(std::iter::repeat_n(0xee, payload));
    }
    let out = send(&v);
    assert!(out.len() > 32, "expected error replies");
    let c = Client::connect(&format!("nbd://127.0.0.1:{port}/a")).unwrap();
    c.read_at(0, &mut b).unwrap();
    // The out-of-range write touched nothing.
    let mut tail = vec![0u8; 4096];
    c.read_at((1 << 20) - 4096, &mut tail).unwrap();
    assert!(tail[..] == img[(1 << 20) - 4096..]);
}

#[test]
fn unix_socket_listener_and_access_counts() {
    let d = TempDir::new("unix");
    let img = make_image(&d.path("a.img"), 32 << 20, 11);
    let sock = d.path("t.sock");
    let _t = KillOnDrop(
        Command::new(BIN)
            .args(["serve", "--export"])
            .arg(format!("a={}", d.path("a.img").display()))
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .spawn()
            .unwrap(),
    );
    let t = std::time::Instant::now();
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(t.elapsed().as_secs() < 10, "unix socket never opened");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let url = format!("nbd+unix:///a?socket={}", sock.display());
    let c = Client::connect(&url).unwrap();
    let mut b = vec![0u8; 8192];
    c.read_at(20 << 20, &mut b).unwrap();
    assert!(b[..] == img[20 << 20..(20 << 20) + 8192]);
    c.write_at(0, &[1; 4096]).unwrap();
    // The kemari extension: reads counted in group 1 (16 MiB groups), a write in group 0.
    let counts =
        nbd_client::client::query_access_counts(&nbd_client::client::parse_url(&url).unwrap())
            .unwrap();
    assert_eq!(counts.group_size, 16 << 20);
    assert_eq!(counts.groups.len(), 2);
    assert!(counts.groups[1].0 >= 1);
    assert!(counts.groups[0].1 >= 1);
}

/// Forwards one connection to the target at `port` and cuts it, both ways,
/// once the client has sent `after` bytes; returns the relay's port.
fn cutting_relay(port: u16, after: usize) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let server = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (mut from_server, mut to_client) =
            (server.try_clone().unwrap(), client.try_clone().unwrap());
        std::thread::spawn(move || std::io::copy(&mut from_server, &mut to_client));
        let (mut from_client, mut to_server) =
            (client.try_clone().unwrap(), server.try_clone().unwrap());
        let mut sent = 0;
        let mut buf = [0u8; 512];
        while sent < after {
            match from_client.read(&mut buf[..(after - sent).min(512)]) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to_server.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    sent += n;
                }
            }
        }
        let _ = client.shutdown(std::net::Shutdown::Both);
        let _ = server.shutdown(std::net::Shutdown::Both);
    });
    relay_port
}

#[test]
fn a_lost_connection_fails_every_request() {
    // Requests submitted while the connection is being lost either fail at
    // once or complete with an error: none is left waiting. (A submit that
    // checked the connection just before the receiver failed what was
    // pending could leave its request waiting for ever; the window is too
    // narrow for this test to hit reliably — it guards the behaviour.)
    let d = TempDir::new("lost");
    make_image(&d.path("a.img"), 1 << 20, 9);
    let (_t, port) = serve(&[format!("a={}", d.path("a.img").display())]);
    for round in 0..40 {
        // The handshake, then a few dozen 28-byte read requests.
        let relay = cutting_relay(port, 200 + 28 * (10 + round));
        let c =
            std::sync::Arc::new(Client::connect(&format!("nbd://127.0.0.1:{relay}/a")).unwrap());
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        for t in 0..4u64 {
            let (c, done_tx) = (c.clone(), done_tx.clone());
            std::thread::spawn(move || {
                let mut tickets = Vec::new();
                let mut failed = 0;
                for i in 0..100_000u64 {
                    match c.submit(
                        nbd_client::protocol::CMD_READ,
                        0,
                        ((t * 64 + i) % 256) * 4096,
                        4096,
                        &[],
                    ) {
                        Ok(ticket) => tickets.push(ticket),
                        Err(_) => {
                            failed += 1;
                            if failed > 10 {
                                break;
                            }
                        }
                    }
                }
                for ticket in tickets {
                    let _ = ticket.wait();
                }
                done_tx.send(()).unwrap();
            });
        }
        for _ in 0..4 {
            done_rx
                .recv_timeout(std::time::Duration::from_secs(20))
                .unwrap_or_else(|_| {
                    panic!("round {round}: a request was left waiting on a lost connection")
                });
        }
    }
}
