//! Live migration over TCP (127.0.0.1) between two kemari processes, with the
//! test guest counting, writing flushed blocks and echoing a TCP stream from
//! the host. The two VMMs have a TAP each on one bridge; the destination
//! announces the guest's MAC, and the host's connection must survive. Plus the
//! failure rules: wrong key, destination killed, source killed, link cut.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kemari_testkit::scenario::*;
use kemari_testkit::*;

fn port(n: u16) -> u16 {
    20000 + (std::process::id() % 2000) as u16 * 4 + n
}

fn key_file(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join(format!("key-{}", text.len()));
    kemari_testkit::write_key(&p, text);
    p
}

const KEY: &str = "kemari-test-key-0123456789abcdef";

/// The source: test guest with counter, flushed disk writes, echo over the
/// bridge; 512 MiB, `extra_cmdline` may set another dirty workload.
fn start(dir: &Path, br: &Bridge, disk: &Path, extra_cmdline: &str) -> (Vmm, EchoChecker) {
    LoadedGuest {
        memory: "512M",
        ip: br.guest_ip(),
        tap: &br.taps[0],
        dirty: if extra_cmdline.contains("dirty=") {
            extra_cmdline
        } else {
            DIRTY
        },
        disk,
        extra: &[],
    }
    .start(dir)
}

fn destination(dir: &Path, br: &Bridge, listen: &str, key: &Path, env: &[(&str, &str)]) -> Vmm {
    let args: Vec<String> = vec![
        "--incoming".into(),
        listen.into(),
        "--migration-key-file".into(),
        key.display().to_string(),
        "--net".into(),
        format!("tap={}", br.taps[1]),
    ];
    let vmm = spawn_vmm(
        &args,
        &dir.join("console-2.log"),
        &dir.join("api-2.sock"),
        env,
    );
    // A migration started before the destination listens is refused
    // (CI once saw it when the source's guest was quick): wait, without
    // connecting (a connection would only be refused, in its log).
    let port = listen.rsplit(':').next().and_then(|p| p.parse().ok());
    wait_listening(port.expect("the destination's address has a port"));
    vmm
}

fn migrate(api: &Path, to: &str, key: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["migrate", "--to", to, "--key-file", key.to_str().unwrap()];
    args.extend_from_slice(extra);
    run_with_timeout(kemarictl(api).args(&args), Duration::from_secs(120))
}

/// The guest's MAC, as its VMM's configuration reports it.
fn guest_mac(api: &Path) -> String {
    let out = run_with_timeout(kemarictl(api).arg("config"), Duration::from_secs(10));
    let config: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    config["nets"][0]["mac"]
        .as_str()
        .unwrap_or_else(|| panic!("no MAC in the configuration: {config}"))
        .to_owned()
}

fn mac_text(mac: &[u8; 6]) -> String {
    mac.map(|b| format!("{b:02x}")).join(":")
}

/// The source must still run its guest: counter, echo and API.
fn assert_source_runs(src: &Vmm, echo: EchoChecker) {
    let n = counters(&src.console).len();
    wait_for("the source's counter", Duration::from_secs(30), || {
        counters(&src.console).len() > n + 3
    });
    let info = run_with_timeout(kemarictl(&src.api).arg("info"), Duration::from_secs(10));
    let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(v["state"], "running");
    let e = echo.verified();
    wait_for("echo on the source", Duration::from_secs(30), || {
        echo.verified() > e + 8192
    });
    echo.finish();
    let st = run_with_timeout(kemarictl(&src.api).arg("shutdown"), Duration::from_secs(10));
    assert!(st.status.success());
}

/// The destination's TAP has another name and no `mac=` is given: the MAC
/// is guest-visible state, so the destination keeps the guest's and
/// announces it (not one derived from its own TAP's name, which stalled
/// TCP until the guest spoke first); its threads are confined too.
#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn live_migration_keeps_counter_disk_and_tcp() {
    let _turn = one_at_a_time();
    let dir = scratch("lm-ok");
    let br = Bridge::create("o", 21);
    let disk = disk_image(&dir);
    let key = key_file(&dir, KEY);
    let (mut src, echo) = start(&dir, &br, &disk, "dirty=1000,32");
    let mac = guest_mac(&src.api);
    let to = format!("127.0.0.1:{}", port(0));
    let dst = destination(&dir, &br, &to, &key, &[]);
    let capture = AnnounceCapture::start(&br.name);
    let out = migrate(&src.api, &to, &key, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["status"], "completed");
    assert!(report["round"].as_u64().unwrap() >= 2, "{report}");
    let downtime = report["downtime_ms"].as_f64().unwrap();
    // The source left only once the destination said the guest runs there.
    let running = report["running_ms"].as_f64().expect("running_ms");
    assert!(running >= downtime, "{report}");
    let status = src.child.0.wait().unwrap();
    assert!(status.success());
    // The announce follows the destination's resume at once.
    let announced: Vec<String> = capture
        .finish(Duration::from_secs(5))
        .iter()
        .map(mac_text)
        .collect();
    assert!(!announced.is_empty(), "no RARP announce on {}", br.name);
    assert!(
        announced.iter().all(|m| *m == mac),
        "announced {announced:?}, the guest's MAC is {mac}"
    );
    assert_eq!(guest_mac(&dst.api), mac);
    assert_every_thread_filtered(dst.child.0.id(), "a live-migration destination");
    eprintln!(
        "longest TCP echo stall across the migration: {:?}",
        echo.longest_stall()
    );
    check_continuity(&src.console, &dst, echo, &disk);
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn heavy_dirtier_converges_or_stops_at_the_round_limit() {
    let _turn = one_at_a_time();
    let dir = scratch("lm-dirty");
    let br = Bridge::create("d", 22);
    let disk = disk_image(&dir);
    let key = key_file(&dir, KEY);
    let (mut src, echo) = start(&dir, &br, &disk, "dirty=10000,128");
    let to = format!("127.0.0.1:{}", port(1));
    let dst = destination(&dir, &br, &to, &key, &[]);
    let out = migrate(
        &src.api,
        &to,
        &key,
        &["--max-rounds", "4", "--max-downtime-ms", "20"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let reason = report["stop_reason"].as_str().unwrap();
    assert!(reason == "converged" || reason == "round limit", "{report}");
    assert!(report["round"].as_u64().unwrap() <= 5, "{report}");
    assert!(src.child.0.wait().unwrap().success());
    check_continuity(&src.console, &dst, echo, &disk);
}

/// `--max-bandwidth` caps the rounds sent while the guest runs: the
/// bandwidth the source measured over them stays within the cap (its 2 MiB
/// burst included), where loopback alone runs at hundreds of MB/s. A busy
/// machine can only lower the rate, never raise it.
#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn a_bandwidth_cap_holds_the_rounds_to_it() {
    let _turn = one_at_a_time();
    let dir = scratch("lm-cap");
    let br = Bridge::create("b", 28);
    let disk = disk_image(&dir);
    let key = key_file(&dir, KEY);
    // Dirtying 4 MB/s, well below the cap: the rounds converge.
    let (mut src, echo) = start(&dir, &br, &disk, "dirty=1000,16");
    let to = format!("127.0.0.1:{}", port(3) + 2000);
    let dst = destination(&dir, &br, &to, &key, &[]);
    // Enough memory touched to tell a cap from a burst: the dirty workload
    // has written each page of its 16 MiB working set (~4 s at 1,000
    // pages/s).
    wait_for(
        "the dirty workload to cover its working set",
        Duration::from_secs(60),
        || {
            dirty_reports(&src.console)
                .last()
                .is_some_and(|&(ws, total, _)| total >= ws)
        },
    );
    let cap_mib_s = 16.0;
    let out = migrate(
        &src.api,
        &to,
        &key,
        &["--max-bandwidth", "16", "--max-rounds", "6"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["status"], "completed", "{report}");
    let rate = report["rate_mb_s"].as_f64().expect("rate_mb_s") * 1e6 / f64::from(1u32 << 20);
    let mib = report["bytes_sent"].as_f64().expect("bytes_sent") / f64::from(1u32 << 20);
    eprintln!("capped at {cap_mib_s} MiB/s: {rate:.2} MiB/s over {mib:.0} MiB");
    // What the guest touched so far (9–70 MiB here).
    assert!(mib > 8.0, "too little sent to tell a cap: {report}");
    // The burst may put 2 MiB ahead of the cap once.
    let allowed = cap_mib_s * (1.0 + 2.0 / (mib - 2.0)) * 1.05;
    assert!(
        rate <= allowed,
        "{rate:.2} MiB/s over a {cap_mib_s} MiB/s cap: {report}"
    );
    assert!(src.child.0.wait().unwrap().success());
    check_continuity(&src.console, &dst, echo, &disk);
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn wrong_key_and_a_probe_are_refused_and_the_destination_waits_on() {
    let _turn = one_at_a_time();
    let dir = scratch("lm-key");
    let br = Bridge::create("k", 23);
    let disk = disk_image(&dir);
    let key = key_file(&dir, KEY);
    let other = key_file(&dir, "a-different-key-of-some-length!!!");
    let (mut src, echo) = start(&dir, &br, &disk, "");
    let to = format!("127.0.0.1:{}", port(2));
    let mut dst = destination(&dir, &br, &to, &other, &[]);
    let out = migrate(&src.api, &to, &key, &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // Named in the handshake, in the operator's terms.
    assert!(
        err.contains("refused our key: the key files of the two ends differ"),
        "{err}"
    );
    // Something else that finds the port: refused too.
    let mut probe = TcpStream::connect(&to).unwrap();
    probe.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut answer = Vec::new();
    let _ = probe.read_to_end(&mut answer);
    // Neither ended the destination, nor touched the source.
    assert!(
        dst.child.0.try_wait().unwrap().is_none(),
        "the destination gave up"
    );
    let info = run_with_timeout(kemarictl(&src.api).arg("info"), Duration::from_secs(10));
    let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(v["state"], "running");
    // The source with the destination's key gets in.
    let out = migrate(&src.api, &to, &other, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(src.child.0.wait().unwrap().success());
    check_continuity(&src.console, &dst, echo, &disk);
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn destination_killed_mid_migration_leaves_the_source_running() {
    let _turn = one_at_a_time();
    let dir = scratch("lm-kill-dst");
    let br = Bridge::create("x", 24);
    let disk = disk_image(&dir);
    let key = key_file(&dir, KEY);
    let (src, echo) = start(&dir, &br, &disk, "");
    let to = format!("127.0.0.1:{}", port(3));
    let hold = FaultHold::new(&dir, "KEMARI_FAULT_HOLD_MIGRATE_IN_MS", 60_000);
    let mut dst = destination(&dir, &br, &to, &key, &hold.env());
    let api = src.api.clone();
    let (to2, key2) = (to.clone(), key.clone());
    let m = std::thread::spawn(move || migrate(&api, &to2, &key2, &[]));
    // The destination holds with the VM received, the source paused.
    hold.wait_reached();
    dst.child.0.kill().unwrap();
    let _ = dst.child.0.wait();
    let out = m.join().unwrap();
    assert!(!out.status.success());
    assert_source_runs(&src, echo);
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn source_killed_mid_migration_leaves_nothing_half_made() {
    let _turn = one_at_a_time();
    let dir = scratch("lm-kill-src");
    let br = Bridge::create("y", 25);
    let disk = disk_image(&dir);
    let key = key_file(&dir, KEY);
    let (mut src, echo) = start(&dir, &br, &disk, "");
    let to = format!("127.0.0.1:{}", port(0) + 2000);
    let hold = FaultHold::new(&dir, "KEMARI_FAULT_HOLD_MIGRATE_IN_MS", 2000);
    let mut dst = destination(&dir, &br, &to, &key, &hold.env());
    let api = src.api.clone();
    let (to2, key2) = (to.clone(), key.clone());
    let m = std::thread::spawn(move || migrate(&api, &to2, &key2, &[]));
    hold.wait_reached();
    src.child.0.kill().unwrap(); // power failure of the source, mid-migration
    let _ = src.child.0.wait();
    let _ = m.join();
    drop(echo);
    let st = dst.child.0.wait().unwrap();
    assert_eq!(
        st.code(),
        Some(1),
        "the destination must not run a half-made VM"
    );
    assert!(
        counters(&dst.console).is_empty(),
        "the destination's guest ran: {}",
        read_text(&dst.console)
    );
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn source_killed_before_the_commit_leaves_nothing_of_the_destinations_run() {
    let _turn = one_at_a_time();
    let dir = scratch("lm-kill-src-run");
    let br = Bridge::create("w", 27);
    let disk = disk_image(&dir);
    let key = key_file(&dir, KEY);
    let (mut src, echo) = start(&dir, &br, &disk, "");
    let to = format!("127.0.0.1:{}", port(0) + 2001);
    // The destination restores the VM and runs it (its outputs held) for
    // 2 s before it tells the source; the source dies meanwhile.
    let hold = FaultHold::new(&dir, "KEMARI_FAULT_HOLD_BEFORE_COMMIT_MS", 2000);
    let mut dst = destination(&dir, &br, &to, &key, &hold.env());
    let api = src.api.clone();
    let (to2, key2) = (to.clone(), key.clone());
    let m = std::thread::spawn(move || migrate(&api, &to2, &key2, &[]));
    hold.wait_reached();
    src.child.0.kill().unwrap(); // power failure of the source, before its commit
    let _ = src.child.0.wait();
    let _ = m.join();
    drop(echo);
    // The source is gone: the disk holds what it wrote. The destination's
    // guest has been writing too, into its held requests.
    let disk_then = std::fs::read(&disk).unwrap();
    let st = dst.child.0.wait().unwrap();
    assert_eq!(st.code(), Some(1), "the destination must discard the VM");
    let mut log = String::new();
    let _ = dst.child.0.stderr.take().unwrap().read_to_string(&mut log);
    // It did run the guest: what it printed was held, and then dropped.
    let log = strip_ansi(&log);
    let held: u64 = log
        .lines()
        .find(|l| l.contains("no commit; the run of the guest here is discarded"))
        .and_then(|l| l.split("held_console_bytes=").nth(1))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no discard report in the destination's log:\n{log}"));
    assert!(held > 0, "the destination's guest did not run:\n{log}");
    assert!(
        counters(&dst.console).is_empty(),
        "the discarded run reached the console: {}",
        read_text(&dst.console)
    );
    assert!(
        std::fs::read(&disk).unwrap() == disk_then,
        "the discarded run wrote to the disk"
    );
}

/// `text` without its terminal colour sequences (`ESC [ … m`).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A TCP relay the test can cut: forwards both ways until `cut` is set.
/// Returns its two sockets, so that a cut takes effect at once (shut them
/// down) rather than when the next bytes arrive.
fn relay(
    listen: u16,
    to: String,
    cut: Arc<AtomicBool>,
    moved: Arc<AtomicU64>,
) -> Arc<Mutex<Vec<TcpStream>>> {
    let l = TcpListener::bind(("127.0.0.1", listen)).unwrap();
    let sockets = Arc::new(Mutex::new(Vec::new()));
    let held = sockets.clone();
    std::thread::spawn(move || {
        let Ok((a, _)) = l.accept() else { return };
        let Ok(b) = TcpStream::connect(&to) else {
            return;
        };
        held.lock()
            .unwrap()
            .extend([a.try_clone().unwrap(), b.try_clone().unwrap()]);
        let pipe = |mut from: TcpStream,
                    mut to: TcpStream,
                    cut: Arc<AtomicBool>,
                    moved: Arc<AtomicU64>| {
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                loop {
                    if cut.load(Ordering::SeqCst) {
                        let _ = from.shutdown(Shutdown::Both);
                        let _ = to.shutdown(Shutdown::Both);
                        return;
                    }
                    match from.read(&mut buf) {
                        Ok(0) | Err(_) => {
                            let _ = to.shutdown(Shutdown::Both);
                            return;
                        }
                        Ok(n) => {
                            moved.fetch_add(n as u64, Ordering::SeqCst);
                            if to.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    }
                }
            })
        };
        let _ = pipe(
            a.try_clone().unwrap(),
            b.try_clone().unwrap(),
            cut.clone(),
            moved.clone(),
        );
        let _ = pipe(b, a, cut, moved);
    });
    sockets
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn link_cut_mid_migration_leaves_the_source_running() {
    let _turn = one_at_a_time();
    let dir = scratch("lm-cut");
    let br = Bridge::create("c", 26);
    let disk = disk_image(&dir);
    let key = key_file(&dir, KEY);
    let (src, echo) = start(&dir, &br, &disk, "");
    let real = format!("127.0.0.1:{}", port(1) + 2000);
    let hold = FaultHold::new(&dir, "KEMARI_FAULT_HOLD_MIGRATE_IN_MS", 2000);
    let mut dst = destination(&dir, &br, &real, &key, &hold.env());
    let cut = Arc::new(AtomicBool::new(false));
    let moved = Arc::new(AtomicU64::new(0));
    let relay_port = port(2) + 2000;
    let sockets = relay(relay_port, real, cut.clone(), moved.clone());
    let api = src.api.clone();
    let key2 = key.clone();
    let m =
        std::thread::spawn(move || migrate(&api, &format!("127.0.0.1:{relay_port}"), &key2, &[]));
    // Cut when the destination has the whole VM and waits to restore it.
    hold.wait_reached();
    assert!(moved.load(Ordering::SeqCst) > 64 << 10, "no memory moved");
    cut.store(true, Ordering::SeqCst);
    for s in sockets.lock().unwrap().iter() {
        let _ = s.shutdown(Shutdown::Both);
    }
    let out = m.join().unwrap();
    assert!(
        !out.status.success(),
        "the migration cannot have succeeded over a cut link"
    );
    let st = dst.child.0.wait().unwrap();
    assert_eq!(
        st.code(),
        Some(1),
        "the destination must discard the partial VM"
    );
    assert!(counters(&dst.console).is_empty());
    assert_source_runs(&src, echo);
}

/// `--connections 4`: the main connection and three page streams, each
/// sealed, written and received by a thread of its own; the guest keeps
/// its counter, its disk and the host's TCP echo.
#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn migration_over_four_connections_keeps_counter_disk_and_tcp() {
    let _turn = one_at_a_time();
    let dir = scratch("lm-four");
    let br = Bridge::create("f", 29);
    let disk = disk_image(&dir);
    let key = key_file(&dir, KEY);
    let (mut src, echo) = start(&dir, &br, &disk, "dirty=1000,32");
    let to = format!("127.0.0.1:{}", port(0) + 2000);
    let dst = destination(&dir, &br, &to, &key, &[]);
    // Enough pages written (2048, 8 MiB, each distinct on the first pass)
    // that the streams carry far more than the state: a quick start on a
    // quiet host migrated after 782 pages.
    wait_for(
        "the guest to write 2048 pages",
        Duration::from_secs(60),
        || dirty_total(&read_text(&src.console)) >= 2048,
    );
    let out = migrate(&src.api, &to, &key, &["--connections", "4"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["status"], "completed", "{report}");
    assert!(report["round"].as_u64().unwrap() >= 2, "{report}");
    // The pages went over the streams: far more than the state alone.
    assert!(report["bytes_sent"].as_u64().unwrap() > 4 << 20, "{report}");
    assert!(src.child.0.wait().unwrap().success());
    check_continuity(&src.console, &dst, echo, &disk);
}

/// A relay that forwards every connection it accepts (in order) to `to`;
/// returns, per connection, its two sockets and the bytes it moved, so that
/// a test can cut one of them.
type Relayed = Arc<Mutex<Vec<(TcpStream, TcpStream, Arc<AtomicU64>)>>>;

fn relay_each(listen: u16, to: String) -> Relayed {
    let l = TcpListener::bind(("127.0.0.1", listen)).unwrap();
    let conns: Relayed = Arc::new(Mutex::new(Vec::new()));
    let held = conns.clone();
    std::thread::spawn(move || {
        for a in l.incoming() {
            let Ok(a) = a else { return };
            let Ok(b) = TcpStream::connect(&to) else {
                return;
            };
            let moved = Arc::new(AtomicU64::new(0));
            held.lock().unwrap().push((
                a.try_clone().unwrap(),
                b.try_clone().unwrap(),
                moved.clone(),
            ));
            for (mut from, mut to) in [(a.try_clone().unwrap(), b.try_clone().unwrap()), (b, a)] {
                let moved = moved.clone();
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 65536];
                    loop {
                        match from.read(&mut buf) {
                            Ok(0) | Err(_) => {
                                let _ = to.shutdown(Shutdown::Both);
                                return;
                            }
                            Ok(n) => {
                                moved.fetch_add(n as u64, Ordering::SeqCst);
                                if to.write_all(&buf[..n]).is_err() {
                                    let _ = from.shutdown(Shutdown::Both);
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        }
    });
    conns
}

/// One page stream's TCP connection cut while pages flow over it (the
/// rounds capped so that the cut comes mid-migration): the migration
/// fails, the source runs on, the destination discards what it built.
#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn a_page_stream_cut_mid_migration_leaves_the_source_running() {
    let _turn = one_at_a_time();
    let dir = scratch("lm-stream-cut");
    let br = Bridge::create("s", 30);
    let disk = disk_image(&dir);
    let key = key_file(&dir, KEY);
    let (src, echo) = start(&dir, &br, &disk, "dirty=1000,32");
    let real = format!("127.0.0.1:{}", port(0) + 4000);
    let mut dst = destination(&dir, &br, &real, &key, &[]);
    let relay_port = port(1) + 4000;
    let conns = relay_each(relay_port, real);
    let api = src.api.clone();
    let key2 = key.clone();
    let m = std::thread::spawn(move || {
        migrate(
            &api,
            &format!("127.0.0.1:{relay_port}"),
            &key2,
            &["--connections", "3", "--max-bandwidth", "8"],
        )
    });
    wait_for(
        "pages flowing over the first page stream",
        Duration::from_secs(30),
        || {
            conns
                .lock()
                .unwrap()
                .get(1)
                .is_some_and(|c| c.2.load(Ordering::SeqCst) > 1 << 20)
        },
    );
    {
        let held = conns.lock().unwrap();
        let (a, b, _) = &held[1];
        let _ = a.shutdown(Shutdown::Both);
        let _ = b.shutdown(Shutdown::Both);
    }
    let out = m.join().unwrap();
    assert!(
        !out.status.success(),
        "the migration cannot have succeeded over a cut stream"
    );
    let stderr = strip_ansi(&String::from_utf8_lossy(&out.stderr));
    eprintln!("kemarictl: {stderr}");
    let st = dst.child.0.wait().unwrap();
    assert_eq!(
        st.code(),
        Some(1),
        "the destination must discard the partial VM"
    );
    assert!(counters(&dst.console).is_empty());
    assert_source_runs(&src, echo);
}

/// The `total=` of the test guest's last `dirty: rate=…` line (0 if none).
fn dirty_total(console: &str) -> u64 {
    console
        .lines()
        .filter(|l| l.starts_with("dirty: rate="))
        .filter_map(|l| {
            l.split(" total=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .next_back()
        .unwrap_or(0)
}
