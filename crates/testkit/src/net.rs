//! The network side of tests: free ports, TAP devices and bridges made with
//! `ip` (root: tests that make them carry the probe's `no_tap` cfg), a
//! checker of the test guest's TCP echo, and a capture of the RARP
//! announces a moved VM sends.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A TCP port free on 127.0.0.1 a moment ago.
pub fn free_port() -> u16 {
    // Never the same port twice in one test process: two tests running in
    // parallel could otherwise both get a port the kernel just freed, and
    // one would wait on the other's server.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("no free port");
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// Waits up to 10 s until something listens on 127.0.0.1:`port`.
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

/// Whether a socket listens on TCP `port` now (IPv4), seen without
/// connecting to it (a kemari waiting for a migration or a primary accepts
/// exactly one connection: a probe would be it).
pub fn listening(port: u16) -> bool {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table.lines().skip(1).any(|l| {
        let mut f = l.split_whitespace();
        let local = f.nth(1).unwrap_or_default();
        let state = f.nth(1).unwrap_or_default();
        state == "0A"
            && local
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok())
                == Some(port)
    })
}

/// Waits up to 10 s until a socket listens on TCP `port`, without
/// connecting to it ([`listening`]).
pub fn wait_listening(port: u16) {
    let t = Instant::now();
    while !listening(port) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "nothing listens on port {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `ip ARGS`, which must succeed.
fn ip(args: &[&str]) {
    let st = Command::new("ip").args(args).status().expect("ip");
    assert!(st.success(), "ip {args:?} failed (tests need root)");
}

/// `ip link del NAME`, quietly: it may not be there.
fn delete_link(name: &str) {
    let _ = Command::new("ip")
        .args(["link", "del", name])
        .stderr(Stdio::null())
        .status();
}

/// A TAP device with the host end at 10.201.N.1/24, removed on drop.
pub struct TapNet {
    pub name: String,
    pub subnet: u8,
}

impl TapNet {
    pub fn create(tag: &str, subnet: u8) -> TapNet {
        let name = format!("kav{tag}{}", std::process::id() % 10000);
        remove_stale_holder(&format!("10.201.{subnet}.1/24"), &format!("kav{tag}"), &[]);
        delete_link(&name);
        ip(&["tuntap", "add", &name, "mode", "tap"]);
        ip(&[
            "addr",
            "add",
            &format!("10.201.{subnet}.1/24"),
            "dev",
            &name,
        ]);
        ip(&["link", "set", &name, "up"]);
        TapNet { name, subnet }
    }

    pub fn guest_ip(&self) -> String {
        format!("10.201.{}.2", self.subnet)
    }

    pub fn host_ip(&self) -> String {
        format!("10.201.{}.1", self.subnet)
    }
}

impl Drop for TapNet {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.name])
            .status();
    }
}

/// A bridge with the host at 10.202.N.1/24 and two TAPs (source, destination).
pub struct Bridge {
    pub name: String,
    pub taps: [String; 2],
    pub subnet: u8,
}

impl Bridge {
    pub fn create(tag: &str, subnet: u8) -> Bridge {
        let id = std::process::id() % 10000;
        let name = format!("klb{tag}{id}");
        let taps = [format!("kla{tag}{id}"), format!("klz{tag}{id}")];
        remove_stale_holder(
            &format!("10.202.{subnet}.1/24"),
            &format!("klb{tag}"),
            &[format!("kla{tag}"), format!("klz{tag}")],
        );
        delete_link(&name);
        taps.iter().for_each(|t| delete_link(t));
        ip(&["link", "add", &name, "type", "bridge"]);
        ip(&[
            "addr",
            "add",
            &format!("10.202.{subnet}.1/24"),
            "dev",
            &name,
        ]);
        ip(&["link", "set", &name, "up"]);
        for t in &taps {
            ip(&["tuntap", "add", t, "mode", "tap"]);
            ip(&["link", "set", t, "master", &name]);
            ip(&["link", "set", t, "up"]);
        }
        Bridge { name, taps, subnet }
    }

    pub fn guest_ip(&self) -> String {
        format!("10.202.{}.2", self.subnet)
    }
}

/// Removes a link `<prefix><n>` (a bridge or a TAP, with its companions
/// `<companion><n>`) of an ended test run that still holds `address`, the
/// subnet about to be made (a test process killed before its drop ran):
/// with it, the route to the guest goes to a dead link ("no route to
/// host"). A link whose process (`pid % 10000` = n) may still run is left
/// alone.
fn remove_stale_holder(address: &str, prefix: &str, companions: &[String]) {
    let Ok(out) = Command::new("ip")
        .args(["-o", "-4", "addr", "show"])
        .output()
    else {
        return;
    };
    let address = format!(" {address} ");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if !line.contains(&address) {
            continue;
        }
        let Some(dev) = line.split_whitespace().nth(1) else {
            continue;
        };
        let Some(suffix) = dev.strip_prefix(prefix).and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let may_run = std::fs::read_dir("/proc")
            .map(|d| {
                d.flatten().any(|e| {
                    e.file_name()
                        .to_str()
                        .and_then(|n| n.parse::<u32>().ok())
                        .is_some_and(|pid| pid % 10000 == suffix && pid != std::process::id())
                })
            })
            .unwrap_or(true);
        if !may_run {
            for c in companions {
                delete_link(&format!("{c}{suffix}"));
            }
            delete_link(dev);
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        for n in self.taps.iter().chain(std::iter::once(&self.name)) {
            let _ = Command::new("ip").args(["link", "del", n]).status();
        }
    }
}

/// Streams random chunks to the guest's echo port and checks every byte.
pub struct EchoChecker {
    stop: Arc<AtomicBool>,
    verified: Arc<AtomicU64>,
    /// The longest time between two echoed chunks, in microseconds.
    longest_gap_us: Arc<AtomicU64>,
    thread: Option<JoinHandle<Result<(), String>>>,
}

impl EchoChecker {
    pub fn start(ip: &str) -> EchoChecker {
        let mut s = None;
        // Generous: a guest's network comes up late on a loaded host.
        let deadline = Instant::now() + Duration::from_secs(60);
        while s.is_none() {
            match TcpStream::connect_timeout(
                &format!("{ip}:7").parse().unwrap(),
                Duration::from_secs(2),
            ) {
                Ok(c) => s = Some(c),
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "cannot connect to the guest's echo service: {e}"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        let mut s = s.unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let verified = Arc::new(AtomicU64::new(0));
        let longest_gap_us = Arc::new(AtomicU64::new(0));
        let (st, v, gap) = (stop.clone(), verified.clone(), longest_gap_us.clone());
        let thread = std::thread::spawn(move || {
            let mut seed: u32 = 0x1234_5678;
            let mut last = Instant::now();
            while !st.load(Ordering::SeqCst) {
                let chunk: Vec<u8> = (0..2048)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 17;
                        seed ^= seed << 5;
                        seed as u8
                    })
                    .collect();
                s.write_all(&chunk).map_err(|e| format!("send: {e}"))?;
                let mut back = vec![0u8; chunk.len()];
                s.read_exact(&mut back)
                    .map_err(|e| format!("receive: {e}"))?;
                if back != chunk {
                    return Err("echoed bytes differ".into());
                }
                v.fetch_add(chunk.len() as u64, Ordering::SeqCst);
                gap.fetch_max(last.elapsed().as_micros() as u64, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(20));
                last = Instant::now();
            }
            Ok(())
        });
        EchoChecker {
            stop,
            verified,
            longest_gap_us,
            thread: Some(thread),
        }
    }

    pub fn verified(&self) -> u64 {
        self.verified.load(Ordering::SeqCst)
    }

    /// The longest stall of the stream so far: the longest round trip of
    /// one chunk (the 20 ms pause between chunks not counted).
    pub fn longest_stall(&self) -> Duration {
        Duration::from_micros(self.longest_gap_us.load(Ordering::SeqCst))
    }

    pub fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        let r = self.thread.take().unwrap().join().unwrap();
        if let Err(e) = r {
            panic!("TCP echo through the operation failed: {e}");
        }
        self.verified()
    }
}

/// The source MACs of the RARP frames (EtherType 0x8035, what a moved VM
/// announces itself with) seen on interface `ifname`, collected on a thread
/// from the moment [`start`](Self::start) returns.
pub struct AnnounceCapture {
    stop: Arc<AtomicBool>,
    /// Announces seen so far.
    seen: Arc<AtomicU64>,
    thread: Option<JoinHandle<Vec<[u8; 6]>>>,
}

const ETH_P_RARP: u16 = 0x8035;

impl AnnounceCapture {
    /// Listens on `ifname` (a bridge sees what every port floods).
    pub fn start(ifname: &str) -> AnnounceCapture {
        let name = std::ffi::CString::new(ifname).unwrap();
        // SAFETY: if_nametoindex reads a NUL-terminated string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert!(ifindex != 0, "no interface {ifname}");
        let proto = ETH_P_RARP.to_be();
        // SAFETY: socket() takes no pointers; the result is checked.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(proto)) };
        assert!(
            fd >= 0,
            "packet socket: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `fd` was just returned by socket() and is owned by nobody else.
        let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        // SAFETY: a zeroed sockaddr_ll is valid; the fields set are plain data.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = proto;
        addr.sll_ifindex = ifindex as i32;
        // SAFETY: bind reads `addr`, a sockaddr_ll of the size given.
        let rc = unsafe {
            libc::bind(
                fd,
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: setsockopt reads a timeval of the size given.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        let stop = Arc::new(AtomicBool::new(false));
        let seen_count = Arc::new(AtomicU64::new(0));
        let (st, count) = (stop.clone(), seen_count.clone());
        let thread = std::thread::spawn(move || {
            let mut file = std::fs::File::from(sock);
            let mut seen = Vec::new();
            let mut frame = [0u8; 2048];
            while !st.load(Ordering::SeqCst) {
                // A timeout (EAGAIN) only lets the loop look at `stop`.
                if let Ok(n) = file.read(&mut frame) {
                    if n >= 14 && frame[12..14] == ETH_P_RARP.to_be_bytes() {
                        seen.push(frame[6..12].try_into().unwrap());
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
            seen
        });
        AnnounceCapture {
            stop,
            seen: seen_count,
            thread: Some(thread),
        }
    }

    /// Stops and returns the source MAC of every announce seen, once one
    /// was (or after `patience`).
    pub fn finish(mut self, patience: Duration) -> Vec<[u8; 6]> {
        let deadline = Instant::now() + patience;
        while self.seen.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        // What came with the first one (an announce is a burst).
        std::thread::sleep(Duration::from_millis(100));
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

/// `GET /reboot` on the test guest's HTTP server at `ip`: its whole answer
/// (the guest resets once the client has it).
pub fn ask_guest_reboot(ip: &str) -> String {
    let mut s = TcpStream::connect_timeout(
        &format!("{ip}:80").parse().unwrap(),
        Duration::from_secs(60),
    )
    .expect("the guest's HTTP server");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(b"GET /reboot HTTP/1.1\r\nHost: guest\r\n\r\n")
        .unwrap();
    // The server closes after the client does: read up to the body's end.
    let mut answer = Vec::new();
    let mut buf = [0u8; 512];
    while !answer.ends_with(b"\r\n\r\nrebooting\n") {
        let n = s.read(&mut buf).expect("the answer to /reboot");
        assert!(n > 0, "{}", String::from_utf8_lossy(&answer));
        answer.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&answer).into_owned()
}
