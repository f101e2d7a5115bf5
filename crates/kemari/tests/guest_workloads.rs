//! The project's test guest (guest/, see docs/test-guest.md) under kemari:
//! one test per workload (counter, dirty, disk write + verify, TCP echo
//! through a TAP device) and the failure paths (a guest fault, a malformed
//! command line). The guest ELF is built first with
//! `cargo build -p guest --target x86_64-unknown-none --release`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, UdpSocket};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kemari_testkit::scenario::one_at_a_time;
use kemari_testkit::*;

/// A guest run under kemari: its serial lines, each with the time since
/// kemari was started.
struct GuestRun {
    child: KillOnDrop,
    lines: mpsc::Receiver<(Duration, String)>,
    seen: Vec<(Duration, String)>,
    stderr: std::process::ChildStderr,
    /// Last, so it is released after the VM is gone (fields drop in order).
    _turn: std::sync::MutexGuard<'static, ()>,
}

impl GuestRun {
    fn start(memory: &str, cmdline: &str, extra: &[&str]) -> Self {
        let mut cmd = kemari();
        cmd.arg("--kernel")
            .arg(guest_elf())
            .args(["--memory", memory, "--cmdline", cmdline])
            .args(extra);
        Self::spawn(cmd)
    }

    /// Runs `cmd` (a kemari command line) and collects its serial lines.
    fn spawn(mut cmd: Command) -> Self {
        let turn = one_at_a_time();
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn kemari");
        let start = Instant::now();
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send((start.elapsed(), line)).is_err() {
                    break;
                }
            }
        });
        Self {
            child: KillOnDrop(child),
            lines: rx,
            seen: Vec::new(),
            stderr,
            _turn: turn,
        }
    }

    /// Waits for a line starting with `prefix`; panics after `timeout`.
    fn wait_line(&mut self, prefix: &str, timeout: Duration) -> (Duration, String) {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.1.starts_with(prefix) {
                        return l;
                    }
                }
                Err(_) => panic!(
                    "no line starting with {prefix:?} within {timeout:?}; output so far:\n{}",
                    self.output()
                ),
            }
        }
    }

    /// Waits for kemari to exit; returns its status with all output read.
    fn finish(mut self, timeout: Duration) -> (ExitStatus, Vec<(Duration, String)>, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.0.try_wait().expect("wait") {
                break s;
            }
            if Instant::now() > deadline {
                panic!(
                    "kemari did not exit within {timeout:?}; output:\n{}",
                    self.output()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(2)) {
            self.seen.push(l);
        }
        let mut err = String::new();
        let _ = self.stderr.read_to_string(&mut err);
        (status, std::mem::take(&mut self.seen), err)
    }

    fn output(&self) -> String {
        self.seen
            .iter()
            .map(|(t, l)| format!("[{:>8.3}s] {l}\n", t.as_secs_f64()))
            .collect()
    }
}

/// Runs the guest to completion.
fn run_guest(
    memory: &str,
    cmdline: &str,
    extra: &[&str],
    timeout: Duration,
) -> (ExitStatus, Vec<(Duration, String)>, String) {
    GuestRun::start(memory, cmdline, extra).finish(timeout)
}

fn show(lines: &[(Duration, String)]) -> String {
    lines
        .iter()
        .map(|(t, l)| format!("[{:>8.3}s] {l}\n", t.as_secs_f64()))
        .collect()
}

/// Value of `key=` in a line of `key=value` words.
fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn counter_boots_fast_and_keeps_wall_time() {
    let (status, lines, err) = run_guest(
        "256M",
        "counter=100 poweroff_after=3000",
        &[],
        Duration::from_secs(30),
    );
    let out = show(&lines);
    assert!(status.success(), "status {status:?}\n{out}{err}");
    assert_eq!(lines[0].1, "kemari-guest: hello", "{out}");
    assert!(
        lines[0].0 < Duration::from_millis(500),
        "boot to first line took {:?}",
        lines[0].0
    );
    let counters: Vec<_> = lines
        .iter()
        .filter(|(_, l)| l.starts_with("counter: "))
        .collect();
    assert!(counters.len() >= 25, "{out}");
    for (i, (_, l)) in counters.iter().enumerate() {
        let n: u64 = l["counter: ".len()..]
            .split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .expect("counter number");
        assert_eq!(n, i as u64, "counter lines must count up by one: {out}");
    }
    // The guest's uptime advances like the host's clock.
    let (t0, l0) = counters[0];
    let (t1, l1) = counters[counters.len() - 1];
    let guest_ms = field(l1, "uptime_ms").unwrap() - field(l0, "uptime_ms").unwrap();
    let host_ms = (*t1 - *t0).as_millis() as u64;
    assert!(
        guest_ms.abs_diff(host_ms) <= host_ms / 20 + 50,
        "guest {guest_ms} ms vs host {host_ms} ms\n{out}"
    );
    assert_eq!(lines.last().unwrap().1, "poweroff", "{out}");
    eprintln!(
        "boot to first line: {:?}; counter: guest {guest_ms} ms, host {host_ms} ms",
        lines[0].0
    );
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn dirty_reaches_10000_pages_per_second_over_1gib() {
    let (status, lines, err) = run_guest(
        "1536M",
        "dirty=0,1024 poweroff_after=5000",
        &[],
        Duration::from_secs(60),
    );
    let out = show(&lines);
    assert!(status.success(), "status {status:?}\n{out}{err}");
    let rates: Vec<u64> = lines
        .iter()
        .filter(|(_, l)| l.starts_with("dirty: rate="))
        .map(|(_, l)| {
            assert_eq!(field(l, "ws_pages"), Some(262_144), "{l}");
            field(l, "rate").expect("rate=")
        })
        .collect();
    assert!(rates.len() >= 3, "{out}");
    assert!(
        rates.iter().all(|&r| r >= 10_000),
        "every second must dirty at least 10,000 pages: {rates:?}"
    );
    eprintln!("dirty rates over 1 GiB (pages/s): {rates:?}");
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn dirty_keeps_the_requested_rate() {
    let (status, lines, err) = run_guest(
        "256M",
        "dirty=5000,16 poweroff_after=4500",
        &[],
        Duration::from_secs(30),
    );
    let out = show(&lines);
    assert!(status.success(), "status {status:?}\n{out}{err}");
    let rates: Vec<u64> = lines
        .iter()
        .filter_map(|(_, l)| l.strip_prefix("dirty: ").filter(|r| r.starts_with("rate=")))
        .map(|l| field(l, "rate").expect("rate="))
        .collect();
    assert!(rates.len() >= 3, "{out}");
    for &r in &rates[1..] {
        assert!(r.abs_diff(5000) <= 500, "rate {r} not ~5000: {rates:?}");
    }
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn disk_write_then_verify_10000_blocks() {
    let dir = scratch("guest-disk");
    let img = dir.join("disk.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(64 << 20))
        .expect("disk image");
    let disk = ["--disk", img.to_str().unwrap()];

    let (status, lines, err) = run_guest(
        "256M",
        "disk=write,10000,rand poweroff=done",
        &disk,
        Duration::from_secs(120),
    );
    let out = show(&lines);
    assert!(status.success(), "status {status:?}\n{out}{err}");
    assert!(
        lines
            .iter()
            .any(|(_, l)| l == "disk: write done blocks=10000"),
        "{out}"
    );

    // A second boot reads them all back.
    let (status, lines, err) = run_guest(
        "256M",
        "disk=verify,10000 poweroff=done",
        &disk,
        Duration::from_secs(120),
    );
    let out = show(&lines);
    assert!(status.success(), "status {status:?}\n{out}{err}");
    assert!(
        lines
            .iter()
            .any(|(_, l)| l == "disk: verify ok blocks=10000"),
        "{out}"
    );

    // One flipped byte and one block past the written range are caught.
    let mut f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(4096 * 1234 + 999)).unwrap();
    f.write_all(b"X").unwrap();
    drop(f);
    let (status, lines, _) = run_guest(
        "256M",
        "disk=verify,10001 poweroff=done",
        &disk,
        Duration::from_secs(120),
    );
    let out = show(&lines);
    assert!(!status.success(), "a failed verify must fail the VM\n{out}");
    assert!(
        lines
            .iter()
            .any(|(_, l)| l == "disk: verify FAILED missing=1 corrupt=1"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The basis of "no acknowledged write lost": kill kemari in the middle of
/// a flushed sequential write; every block acknowledged before the kill
/// must read back valid in the next boot.
#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn acknowledged_disk_writes_survive_killing_the_vmm() {
    let dir = scratch("guest-disk-kill");
    let img = dir.join("disk.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(64 << 20))
        .expect("disk image");
    let disk = ["--disk", img.to_str().unwrap()];

    let mut run = GuestRun::start("256M", "disk=write,10000,seq,flush", &disk);
    run.wait_line("disk: acked=2000 ", Duration::from_secs(60));
    let _ = run.child.0.kill(); // SIGKILL: no chance to clean up
    let (_, lines, _) = run.finish(Duration::from_secs(10));
    // Lines that made it out before the kill may acknowledge more.
    let acked = lines
        .iter()
        .filter_map(|(_, l)| field(l, "acked"))
        .max()
        .unwrap_or(0);
    assert!(acked >= 2000, "{}", show(&lines));

    let (status, lines, err) = run_guest(
        "256M",
        &format!("disk=verify,{acked} poweroff=done"),
        &disk,
        Duration::from_secs(60),
    );
    let out = show(&lines);
    assert!(status.success(), "status {status:?}\n{out}{err}");
    assert!(
        lines
            .iter()
            .any(|(_, l)| *l == format!("disk: verify ok blocks={acked}")),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn tcp_echo_of_1_mib_through_a_tap() {
    let tap = TapNet::create("g", 21);
    let guest_ip = tap.guest_ip();
    let mut run = GuestRun::start(
        "256M",
        &format!("ip={guest_ip}/24 poweroff_after=60000"),
        &["--net", &format!("tap={}", tap.name)],
    );
    run.wait_line("net: up", Duration::from_secs(10));

    let data: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let stream = TcpStream::connect((guest_ip.as_str(), 7)).expect("connect to echo");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut writer = stream.try_clone().unwrap();
    let to_send = data.clone();
    let start = Instant::now();
    let sender = std::thread::spawn(move || writer.write_all(&to_send));
    let mut echoed = Vec::with_capacity(data.len());
    let mut reader = stream;
    let mut buf = [0u8; 65536];
    while echoed.len() < data.len() {
        let n = reader.read(&mut buf).expect("read echo");
        assert!(n > 0, "echo closed after {} bytes", echoed.len());
        echoed.extend_from_slice(&buf[..n]);
    }
    let elapsed = start.elapsed();
    sender.join().unwrap().expect("send");
    assert!(echoed == data, "echo differs from what was sent");
    eprintln!("tcp echo: 1 MiB byte-exact in {elapsed:?}");

    let udp = UdpSocket::bind(format!("{}:0", tap.host_ip())).unwrap();
    udp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    udp.send_to(b"kemari udp echo", (guest_ip.as_str(), 7))
        .unwrap();
    let mut b = [0u8; 64];
    let (n, _) = udp.recv_from(&mut b).expect("udp echo");
    assert_eq!(&b[..n], b"kemari udp echo");

    let mut http = TcpStream::connect((guest_ip.as_str(), 80)).expect("connect to http");
    http.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    http.write_all(b"GET /bytes/5000 HTTP/1.0\r\n\r\n").unwrap();
    let mut resp = Vec::new();
    let mut b = [0u8; 8192];
    loop {
        let n = http.read(&mut b).expect("http read");
        resp.extend_from_slice(&b[..n]);
        let text = String::from_utf8_lossy(&resp);
        if n == 0
            || text
                .find("\r\n\r\n")
                .is_some_and(|p| resp.len() >= p + 4 + 5000)
        {
            break;
        }
    }
    let text = String::from_utf8_lossy(&resp).into_owned();
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    let body = &resp[text.find("\r\n\r\n").unwrap() + 4..];
    assert_eq!(body.len(), 5000);
    assert!(body
        .iter()
        .enumerate()
        .all(|(i, &c)| c == b'a' + (i % 26) as u8));
}

fn counter_value(line: &str) -> Option<u64> {
    line.strip_prefix("counter: ")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The basis of "the guest continued where it left off": a snapshot
/// restored in a new kemari process carries on counting from where the
/// snapshot was taken, neither restarting nor skipping.
#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn counter_continues_after_snapshot_and_restore() {
    let dir = scratch("guest-restore");
    let socket = dir.join("api.sock");
    let snap = dir.join("snap");
    let mut run = GuestRun::start(
        "256M",
        "counter=100 poweroff_after=6000",
        &["--api-socket", socket.to_str().unwrap()],
    );
    let (_, line) = run.wait_line("counter: 5 ", Duration::from_secs(10));
    let before = counter_value(&line).unwrap();
    let out = run_with_timeout(
        kemarictl(&socket).arg("snapshot").arg(&snap),
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "snapshot: {out:?}");
    let _ = run_with_timeout(kemarictl(&socket).arg("shutdown"), Duration::from_secs(30));
    let (_, first_run, _) = run.finish(Duration::from_secs(30));
    let last_printed = first_run
        .iter()
        .filter_map(|(_, l)| counter_value(l))
        .max()
        .unwrap();

    let mut cmd = kemari();
    cmd.arg("--restore").arg(&snap);
    let (status, lines, err) = GuestRun::spawn(cmd).finish(Duration::from_secs(30));
    let out = show(&lines);
    assert!(status.success(), "status {status:?}\n{out}{err}");
    assert!(
        !lines
            .iter()
            .any(|(_, l)| l.starts_with("kemari-guest: hello")),
        "the restored guest booted again:\n{out}"
    );
    let counters: Vec<u64> = lines.iter().filter_map(|(_, l)| counter_value(l)).collect();
    let first = counters[0];
    assert!(
        first > before && first <= last_printed + 1,
        "first counter after restore {first}, snapshot taken after {before}, \
         first run printed up to {last_printed}:\n{out}"
    );
    for w in counters.windows(2) {
        assert_eq!(w[1], w[0] + 1, "counter skipped after restore:\n{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Warm restart (memory kept in its file, the VMM replaced) in the middle
/// of a flushed disk write: the guest finishes the job, its verify finds
/// every block, and the counter carries on.
#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn workloads_continue_across_a_warm_restart() {
    let dir = scratch("guest-warm");
    let socket = dir.join("api.sock");
    let state = dir.join("state");
    let memfile = PathBuf::from(format!("/dev/shm/kemari-guest-test-{}", std::process::id()));
    let img = dir.join("disk.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(64 << 20))
        .expect("disk image");
    let mut run = GuestRun::start(
        "256M",
        "counter=100 disk=write,3000,seq,flush disk=verify,3000 poweroff=done",
        &[
            "--api-socket",
            socket.to_str().unwrap(),
            "--memory-file",
            memfile.to_str().unwrap(),
            "--disk",
            img.to_str().unwrap(),
        ],
    );
    run.wait_line("disk: acked=1000 ", Duration::from_secs(60));
    let (_, line) = run.wait_line("counter: ", Duration::from_secs(10));
    let before = counter_value(&line).unwrap();
    let out = run_with_timeout(
        kemarictl(&socket).arg("warm-restart").arg(&state),
        Duration::from_secs(30),
    );
    assert!(out.status.success(), "warm-restart: {out:?}");
    let (_, first_run, _) = run.finish(Duration::from_secs(30));
    let out1 = show(&first_run);
    assert!(
        !first_run
            .iter()
            .any(|(_, l)| l.starts_with("disk: write done")),
        "the write finished before the restart; make it longer:\n{out1}"
    );

    let mut cmd = kemari();
    cmd.arg("--restore").arg(&state);
    let (status, lines, err) = GuestRun::spawn(cmd).finish(Duration::from_secs(120));
    let _ = std::fs::remove_file(&memfile);
    let out = show(&lines);
    assert!(status.success(), "status {status:?}\n{out}{err}");
    assert!(
        !lines
            .iter()
            .any(|(_, l)| l.starts_with("kemari-guest: hello")),
        "the restored guest booted again:\n{out}"
    );
    let first = lines
        .iter()
        .find_map(|(_, l)| counter_value(l))
        .expect("counter lines after the restart");
    assert!(
        first > before,
        "counter went back: {first} <= {before}\n{out}"
    );
    for want in [
        "disk: write done blocks=3000",
        "disk: verify ok blocks=3000",
    ] {
        assert!(lines.iter().any(|(_, l)| l == want), "no {want:?}:\n{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn guest_fault_is_reported_and_fails_the_vm() {
    let (status, lines, _) = run_guest("256M", "fault=page", &[], Duration::from_secs(30));
    let out = show(&lines);
    assert!(!status.success(), "{out}");
    let fault = lines
        .iter()
        .find(|(_, l)| l.starts_with("fault: "))
        .unwrap_or_else(|| panic!("no fault line:\n{out}"));
    assert!(
        fault.1.starts_with("fault: page fault vector=14 rip=0x"),
        "{out}"
    );
    assert!(fault.1.contains("addr=0x8000000000"), "{out}");
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn malformed_cmdline_is_reported_and_fails_the_vm() {
    let (status, lines, _) = run_guest(
        "256M",
        "console=ttyS0 dirty=fast",
        &[],
        Duration::from_secs(30),
    );
    let out = show(&lines);
    assert!(!status.success(), "{out}");
    assert!(
        lines
            .iter()
            .any(|(_, l)| l.starts_with("cmdline error: dirty=fast")),
        "{out}"
    );
}
