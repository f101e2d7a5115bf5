//! `kemari-bench ft`: what fault tolerance costs the guest, side by side in
//! one run — the test guest unprotected, under event-driven synchronization
//! and under periodic checkpoints — at several memory sizes:
//!
//! - TCP request/response rate (64-byte ping-pong with the guest's echo
//!   service) and TCP stream throughput (64 KiB chunks echoed back);
//! - O_SYNC-style disk writes (each block written then flushed, one at a
//!   time) and buffered writes (no flush, the guest's full queue depth);
//! - the guest pause per sync and the output delay per sync (p50/p99);
//! - sync-link bytes during the buffered-write job and during a writeback
//!   job (the application rewrites a hot working set while its file cache is
//!   written back in bursts — buffered writes the way an OS does them).
//!
//! Request/response and stream run on 1, 4 and 8 connections at once
//! (`--connections`). Each measurement runs in every mode before the next
//! one, the modes' order rotated every round (`--rounds`), so that load from
//! elsewhere on the machine hits every mode alike; the ratios to unprotected
//! are taken round by round.
//!
//! Then this host's floor per sync ([`super::floor`]) and the goals of
//! issues 7 and 28 as ratios, each request/response ratio next to the most
//! the floor allows, each stream ratio next to where the host's CPUs went
//! during it ([`super::cpu`]: busy and idle, the standby's, the client's).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::report::{Report, Table};

use super::cpu::{CpuMark, CpuUse};
use super::procs::{wait_path, Scratch, Vmm};
use kemari::api::client::request_to_end as request;

/// Command-line arguments.
#[derive(Debug, clap::Args)]
pub struct FtBenchArgs {
    /// The test guest ELF.
    #[arg(long, default_value = "target/x86_64-unknown-none/release/guest")]
    pub kernel: PathBuf,
    /// Memory sizes.
    #[arg(long, value_delimiter = ',', default_value = "256M,1G,4G")]
    pub sizes: Vec<String>,
    /// Modes: unprotected, event, periodic, event-plaintext (event-driven on
    /// an authenticated but unencrypted link: what the encryption costs).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "unprotected,event,periodic"
    )]
    pub modes: Vec<String>,
    /// Concurrent TCP connections of the request/response and stream
    /// measurements (each count measured; the guest echoes on up to 8).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub connections: Vec<usize>,
    /// Rounds: each runs every measurement in every mode, the modes
    /// alternated (the tables show medians over rounds, the ratios the
    /// median of each round's ratio).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Checkpoint period of the periodic mode, ms.
    #[arg(long, default_value_t = 25)]
    pub period_ms: u64,
    /// Seconds per network measurement (request/response: the median of
    /// three such windows).
    #[arg(long, default_value_t = 2)]
    pub seconds: u64,
    /// Blocks of the O_SYNC-style job.
    #[arg(long, default_value_t = 100)]
    pub sync_blocks: u64,
    /// Blocks of the buffered-write job.
    #[arg(long, default_value_t = 1000)]
    pub buffered_blocks: u64,
    /// Writeback job: blocks written in all.
    #[arg(long, default_value_t = 128)]
    pub writeback_blocks: u64,
    /// Writeback job: blocks per burst.
    #[arg(long, default_value_t = 32)]
    pub burst_blocks: u64,
    /// Writeback job: one burst every this many ms.
    #[arg(long, default_value_t = 500)]
    pub burst_ms: u64,
    /// Writeback job: the application rewrites its hot pages at this rate.
    #[arg(long, default_value_t = 4000)]
    pub hot_pages_per_s: u64,
    /// Writeback job: the hot working set, MiB.
    #[arg(long, default_value_t = 1)]
    pub hot_mib: u64,
    /// Third octet of the TAP subnet 10.202.N.0/24.
    #[arg(long, default_value_t = 41)]
    pub subnet: u8,
    /// The kemari binary (default: next to this one), e.g. an older build to
    /// compare with.
    #[arg(long)]
    pub kemari: Option<PathBuf>,
    /// `ft start --keep-writable-pages` (default: kemari's own, 64; 0 turns
    /// it off).
    #[arg(long)]
    pub keep_writable_pages: Option<usize>,
    /// `ft start --epochs-in-flight` (default: kemari's own, 1).
    #[arg(long)]
    pub epochs_in_flight: Option<usize>,
    /// Put a relay that delays every chunk this many µs each way between
    /// primary and standby (a sync link with latency; the relay's own
    /// thread hand-offs add to it). 0: a direct link.
    #[arg(long, default_value_t = 0)]
    pub link_delay_us: u64,
}

/// One mode's figures at one size in one round (a field stays `None` when
/// its measurement failed or has not run yet).
#[derive(Debug, Default, Clone)]
struct Row {
    /// Request/response exchanges per second, by concurrent connections.
    rr_per_s: BTreeMap<usize, f64>,
    /// Stream throughput, MB/s, by concurrent connections.
    stream_mb_s: BTreeMap<usize, f64>,
    /// Where the host's CPUs went during the stream.
    stream_cpu: BTreeMap<usize, StreamCpu>,
    osync_per_s: Option<f64>,
    buffered_per_s: Option<f64>,
    pause_p50: u64,
    pause_p99: u64,
    sync_p50: u64,
    sync_p99: u64,
    buffered_link_bytes: u64,
    buffered_syncs: u64,
    buffered_pages: u64,
    writeback_link_bytes: Option<u64>,
    writeback_syncs: u64,
}

struct Env {
    kemari: PathBuf,
    kernel: PathBuf,
    tap: String,
    guest_ip: String,
    key: PathBuf,
    scratch_root: PathBuf,
    keep_writable_pages: Option<usize>,
    epochs_in_flight: Option<usize>,
    link_delay: Option<Duration>,
}

/// A TAP with the host end at 10.202.N.1/24, removed on drop.
struct Tap(String);

impl Tap {
    fn create(subnet: u8) -> Result<Tap, String> {
        let name = format!("kbft{}", std::process::id() % 100_000);
        let ip = |args: &[&str]| -> Result<(), String> {
            let st = Command::new("ip")
                .args(args)
                .status()
                .map_err(|e| format!("ip: {e}"))?;
            st.success()
                .then_some(())
                .ok_or_else(|| format!("ip {args:?} failed (the benchmark needs root)"))
        };
        // A TAP left over by an interrupted run (usually there is none).
        let _ = Command::new("ip")
            .args(["link", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
        ip(&["tuntap", "add", &name, "mode", "tap"])?;
        let tap = Tap(name);
        ip(&[
            "addr",
            "add",
            &format!("10.202.{subnet}.1/24"),
            "dev",
            &tap.0,
        ])?;
        ip(&["link", "set", &tap.0, "up"])?;
        Ok(tap)
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).status();
    }
}

fn api(socket: &Path, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
    request(socket, method, path, body.as_ref()).map_err(|e| format!("{path}: {e}"))
}

/// A primary (and its standby, when protected) for one measurement.
struct Setup {
    primary: Vmm,
    standby: Option<Vmm>,
    _relay: Option<kemari_testkit::relay::Relay>,
    api: PathBuf,
    _scratch: Scratch,
}

fn start(
    env: &Env,
    seq: usize,
    size: &str,
    mode: &str,
    period_ms: u64,
    cmdline: &str,
    disk: bool,
) -> Result<Setup, String> {
    let scratch = Scratch::create(&env.scratch_root, seq).map_err(|e| e.to_string())?;
    let api_sock = scratch.path("primary.sock");
    let mut standby = None;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    if mode != "unprotected" {
        let mut cmd = Command::new(&env.kemari);
        cmd.args(["--ft-standby", &format!("127.0.0.1:{port}")])
            .arg("--migration-key-file")
            .arg(&env.key)
            .args(["--net", &format!("tap={}", env.tap), "--serial", "null"])
            .arg("--api-socket")
            .arg(scratch.path("standby.sock"));
        if mode == "event-plaintext" {
            cmd.arg("--plaintext-link");
        }
        let s = Vmm::spawn("standby", cmd).map_err(|e| e.to_string())?;
        if !wait_path(&scratch.path("standby.sock"), Duration::from_secs(10)) {
            return Err(format!("the standby did not start: {}", s.tail()));
        }
        standby = Some(s);
    }
    let mut cmd = Command::new(&env.kemari);
    cmd.arg("--kernel")
        .arg(&env.kernel)
        .args(["--memory", size, "--cmdline", cmdline])
        .args([
            "--net",
            &format!("tap={}", env.tap),
            "--serial",
            "stdout",
            "--start-paused",
        ])
        .arg("--api-socket")
        .arg(&api_sock);
    if disk {
        let img = scratch.path("disk.img");
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(256 << 20))
            .map_err(|e| e.to_string())?;
        cmd.arg("--disk").arg(img);
    }
    let primary = Vmm::spawn("primary", cmd).map_err(|e| e.to_string())?;
    if !wait_path(&api_sock, Duration::from_secs(30)) {
        return Err(format!("the primary did not start: {}", primary.tail()));
    }
    // The API answers while the VM is still being built.
    let built = Instant::now();
    while api(&api_sock, "GET", "/vm", None).is_ok_and(|v| v["state"] == "starting") {
        if built.elapsed() > Duration::from_secs(30) {
            return Err(format!("the primary built no VM: {}", primary.tail()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let relay = (mode != "unprotected")
        .then_some(env.link_delay)
        .flatten()
        .map(|d| kemari_testkit::relay::Relay::delay_only(port, d));
    let peer_port = relay.as_ref().map_or(port, |r| r.port);
    if mode != "unprotected" {
        let mut body = serde_json::json!({
            "peer": format!("127.0.0.1:{peer_port}"),
            "key_file": env.key,
            "timeout_ms": 5000,
        });
        if mode == "periodic" {
            body["periodic_ms"] = period_ms.into();
        }
        if mode == "event-plaintext" {
            body["plaintext"] = true.into();
        }
        if let Some(k) = env.keep_writable_pages {
            body["keep_writable_pages"] = k.into();
        }
        if let Some(n) = env.epochs_in_flight {
            body["epochs_in_flight"] = n.into();
        }
        let r = api(&api_sock, "PUT", "/vm/ft/start", Some(body))
            .map_err(|e| format!("{e}: {}", primary.tail()))?;
        if r["state"] != "protected" {
            return Err(format!("ft start: {r}"));
        }
    }
    api(&api_sock, "PUT", "/vm/resume", None).map_err(|e| format!("{e}: {}", primary.tail()))?;
    Ok(Setup {
        primary,
        standby,
        _relay: relay,
        api: api_sock,
        _scratch: scratch,
    })
}

fn ft_status(setup: &Setup) -> Value {
    api(&setup.api, "GET", "/vm/ft", None).unwrap_or(Value::Null)
}

fn connect_echo(ip: &str) -> Result<TcpStream, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match TcpStream::connect_timeout(
            &format!("{ip}:7").parse().map_err(|e| format!("{e}"))?,
            Duration::from_secs(2),
        ) {
            Ok(s) => {
                s.set_nodelay(true).map_err(|e| e.to_string())?;
                s.set_read_timeout(Some(Duration::from_secs(10)))
                    .map_err(|e| e.to_string())?;
                return Ok(s);
            }
            Err(e) if Instant::now() > deadline => return Err(format!("echo service: {e}")),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// 64-byte request/response exchanges per second, on `conns` connections
/// each running its own ping-pong at once (their sum).
fn request_response(ip: &str, secs: u64, conns: usize) -> Result<f64, String> {
    let socks = (0..conns.max(1))
        .map(|_| connect_echo(ip))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let window = Duration::from_secs(secs);
    let threads: Vec<_> = socks
        .into_iter()
        .map(|mut s| {
            std::thread::spawn(move || -> Result<u64, String> {
                let msg = [0x5au8; 64];
                let mut back = [0u8; 64];
                let mut n = 0u64;
                while started.elapsed() < window {
                    s.write_all(&msg).map_err(|e| e.to_string())?;
                    s.read_exact(&mut back).map_err(|e| e.to_string())?;
                    if back != msg {
                        return Err("echo differs".into());
                    }
                    n += 1;
                }
                Ok(n)
            })
        })
        .collect();
    let mut n = 0;
    for t in threads {
        n += t
            .join()
            .map_err(|_| "a request/response thread panicked".to_string())??;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// Bytes echoed per second with 64 KiB chunks in flight on `conns`
/// connections at once (their sum).
fn stream(ip: &str, secs: u64, conns: usize) -> Result<f64, String> {
    let socks = (0..conns.max(1))
        .map(|_| connect_echo(ip))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let window = Duration::from_secs(secs);
    let threads: Vec<_> = socks
        .into_iter()
        .map(|s| std::thread::spawn(move || stream_one(s, started, window)))
        .collect();
    let mut bytes = 0;
    for t in threads {
        bytes += t
            .join()
            .map_err(|_| "a stream thread panicked".to_string())??;
    }
    Ok(bytes as f64 / started.elapsed().as_secs_f64())
}

/// One connection of [`stream`]: bytes read back until `window` has passed
/// since `started`.
fn stream_one(s: TcpStream, started: Instant, window: Duration) -> Result<u64, String> {
    let mut writer = s.try_clone().map_err(|e| e.to_string())?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let st = stop.clone();
    let sender = std::thread::spawn(move || {
        let chunk = vec![0xa5u8; 64 << 10];
        while !st.load(std::sync::atomic::Ordering::SeqCst) {
            if writer.write_all(&chunk).is_err() {
                return;
            }
        }
    });
    let mut reader = s;
    let mut buf = vec![0u8; 64 << 10];
    let mut bytes = 0u64;
    let mut result = Ok(());
    while started.elapsed() < window {
        match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => bytes += n as u64,
            Err(e) => {
                result = Err(e.to_string());
                break;
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = reader.shutdown(std::net::Shutdown::Both);
    let _ = sender.join();
    result.map(|()| bytes)
}

/// Runs a disk job to completion; blocks per second as the guest measured.
fn disk_job(setup: &Setup) -> Result<f64, String> {
    let found = setup
        .primary
        .console
        .wait_for(Duration::from_secs(600), |lines| {
            lines.iter().find_map(|l| {
                let rest = l.text.strip_prefix("disk: job took ms=")?;
                rest.split("blocks_per_s=")
                    .nth(1)?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
        });
    found.ok_or_else(|| format!("the disk job did not finish: {}", setup.primary.tail()))
}

/// What one disk job did: its rate and what fault tolerance sent meanwhile.
struct DiskRun {
    rate: f64,
    link_bytes: u64,
    syncs: u64,
    pages: u64,
}

/// Boots a guest running the disk job `cmdline`, runs it to the end.
fn disk_run(
    env: &Env,
    seq: &mut usize,
    size: &str,
    mode: &str,
    period_ms: u64,
    cmdline: &str,
) -> Result<DiskRun, String> {
    *seq += 1;
    let s = start(env, *seq, size, mode, period_ms, cmdline, true)?;
    let before = ft_status(&s);
    let rate = disk_job(&s)?;
    let after = ft_status(&s);
    finish(s);
    let delta = |k: &str| {
        after[k]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(before[k].as_u64().unwrap_or(0))
    };
    Ok(DiskRun {
        rate,
        link_bytes: delta("link_bytes"),
        syncs: delta("syncs"),
        pages: delta("pages"),
    })
}

fn finish(setup: Setup) {
    let _ = api(&setup.api, "PUT", "/vm/shutdown", None);
    let mut s = setup;
    let _ = s.primary.wait_exit(Duration::from_secs(10));
}

/// The network figures of one mode: request/response and stream at every
/// connection count, on one freshly started VM; `raw` gets every window.
fn network(
    env: &Env,
    args: &FtBenchArgs,
    seq: &mut usize,
    size: &str,
    mode: &str,
    row: &mut Row,
    raw: &mut Value,
) -> Result<(), String> {
    let ip = env.guest_ip.clone();
    *seq += 1;
    let s = start(
        env,
        *seq,
        size,
        mode,
        args.period_ms,
        &format!("ip={ip}/24"),
        false,
    )?;
    s.primary
        .console
        .wait_for(Duration::from_secs(30), |l| {
            l.iter().any(|l| l.text.contains("net: up")).then_some(())
        })
        .ok_or_else(|| format!("guest network: {}", s.primary.tail()))?;
    for &conns in &args.connections {
        // The median of three windows: this machine's load comes in bursts.
        let mut rr = [0.0; 3];
        for r in &mut rr {
            *r = request_response(&ip, args.seconds, conns)?;
        }
        raw["rr_per_s"][conns.to_string()] = rr.to_vec().into();
        rr.sort_by(f64::total_cmp);
        row.rr_per_s.insert(conns, rr[1]);
        if conns == args.connections[0] {
            // The pause and sync times of the single-connection exchanges.
            let st = ft_status(&s);
            row.pause_p50 = st["pause_us_p50"].as_u64().unwrap_or(0);
            row.pause_p99 = st["pause_us_p99"].as_u64().unwrap_or(0);
            row.sync_p50 = st["sync_us_p50"].as_u64().unwrap_or(0);
            row.sync_p99 = st["sync_us_p99"].as_u64().unwrap_or(0);
        }
    }
    // The CPU each stream took, whose: this process is the client. In the
    // order of PRIMARY, CLIENT, STANDBY.
    let mut pids = vec![s.primary.pid(), std::process::id()];
    pids.extend(s.standby.as_ref().map(Vmm::pid));
    for &conns in &args.connections {
        let mark = CpuMark::take(&pids);
        let mb = stream(&ip, args.seconds, conns)? / 1e6;
        let cpu = mark.since();
        raw["stream_mb_s"][conns.to_string()] = mb.into();
        row.stream_mb_s.insert(conns, mb);
        let moved = mb * cpu.wall_s;
        raw["stream_cpu"][conns.to_string()] = json!({
            "wall_s": cpu.wall_s,
            "mb": moved,
            "host_busy_s": cpu.host_busy_s,
            "idle_share": cpu.idle_share,
            "steal_share": cpu.steal_share,
            "primary_s": cpu.procs_s[PRIMARY],
            "client_s": cpu.procs_s[CLIENT],
            "standby_s": cpu.procs_s.get(STANDBY).copied().flatten(),
        });
        if let Some(c) = StreamCpu::of(&cpu) {
            row.stream_cpu.insert(conns, c);
        }
    }
    raw["pause_us_p50"] = row.pause_p50.into();
    raw["pause_us_p99"] = row.pause_p99.into();
    raw["sync_us_p50"] = row.sync_p50.into();
    raw["sync_us_p99"] = row.sync_p99.into();
    finish(s);
    Ok(())
}

/// The measurements of one mode, each on a VM of its own: alternating the
/// modes measurement by measurement means every mode sees the same load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Job {
    Network,
    Osync,
    Buffered,
    Writeback,
}

impl Job {
    const ALL: [Job; 4] = [Job::Network, Job::Osync, Job::Buffered, Job::Writeback];

    fn name(self) -> &'static str {
        match self {
            Job::Network => "network",
            Job::Osync => "osync",
            Job::Buffered => "buffered",
            Job::Writeback => "writeback",
        }
    }
}

/// Runs one measurement of one mode into `row`; returns its raw record.
fn measure(
    env: &Env,
    args: &FtBenchArgs,
    seq: &mut usize,
    size: &str,
    mode: &str,
    job: Job,
    row: &mut Row,
) -> Result<Value, String> {
    let mut raw = json!({ "size": size, "mode": mode, "job": job.name() });
    let disk =
        |seq: &mut usize, cmdline: String| disk_run(env, seq, size, mode, args.period_ms, &cmdline);
    match job {
        Job::Network => network(env, args, seq, size, mode, row, &mut raw)?,
        Job::Osync => {
            let r = disk(seq, format!("disk=write,{},seq,flush", args.sync_blocks))?;
            row.osync_per_s = Some(r.rate);
            raw["blocks_per_s"] = r.rate.into();
        }
        Job::Buffered => {
            // Buffered writes, and the link bytes they cost.
            let r = disk(seq, format!("disk=write,{},seq", args.buffered_blocks))?;
            row.buffered_per_s = Some(r.rate);
            (
                row.buffered_link_bytes,
                row.buffered_syncs,
                row.buffered_pages,
            ) = (r.link_bytes, r.syncs, r.pages);
            raw["blocks_per_s"] = r.rate.into();
            raw["link_bytes"] = r.link_bytes.into();
            raw["syncs"] = r.syncs.into();
            raw["pages"] = r.pages.into();
        }
        Job::Writeback => {
            // Buffered writes the way an OS does them: the application keeps
            // rewriting its hot pages while the file cache goes to disk in
            // bursts.
            let r = disk(
                seq,
                format!(
                    "dirty={},{} disk=write,{},seq,burst={}/{}",
                    args.hot_pages_per_s,
                    args.hot_mib,
                    args.writeback_blocks,
                    args.burst_blocks,
                    args.burst_ms
                ),
            )?;
            (row.writeback_link_bytes, row.writeback_syncs) = (Some(r.link_bytes), r.syncs);
            raw["link_bytes"] = r.link_bytes.into();
            raw["syncs"] = r.syncs.into();
        }
    }
    Ok(raw)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len().checked_sub(1)? / 2).copied()
}

/// The median over rounds of one mode's figures at one size.
fn summarize(rounds: &[&Row], connections: &[usize]) -> Row {
    let f =
        |get: &dyn Fn(&Row) -> Option<f64>| median(rounds.iter().filter_map(|r| get(r)).collect());
    let u = |get: &dyn Fn(&Row) -> u64| {
        let mut v: Vec<u64> = rounds.iter().map(|r| get(r)).collect();
        v.sort_unstable();
        v.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0)
    };
    let mut row = Row::default();
    for &c in connections {
        if let Some(v) = f(&|r| r.rr_per_s.get(&c).copied()) {
            row.rr_per_s.insert(c, v);
        }
        if let Some(v) = f(&|r| r.stream_mb_s.get(&c).copied()) {
            row.stream_mb_s.insert(c, v);
        }
        let cpu = |get: fn(&StreamCpu) -> f64| f(&|r| r.stream_cpu.get(&c).map(get));
        if let (Some(busy), Some(idle), Some(standby), Some(client)) = (
            cpu(|s| s.busy),
            cpu(|s| s.idle),
            cpu(|s| s.standby),
            cpu(|s| s.client),
        ) {
            row.stream_cpu.insert(
                c,
                StreamCpu {
                    busy,
                    idle,
                    standby,
                    client,
                },
            );
        }
    }
    row.osync_per_s = f(&|r| r.osync_per_s);
    row.buffered_per_s = f(&|r| r.buffered_per_s);
    row.pause_p50 = u(&|r| r.pause_p50);
    row.pause_p99 = u(&|r| r.pause_p99);
    row.sync_p50 = u(&|r| r.sync_p50);
    row.sync_p99 = u(&|r| r.sync_p99);
    row.buffered_link_bytes = u(&|r| r.buffered_link_bytes);
    row.buffered_syncs = u(&|r| r.buffered_syncs);
    row.buffered_pages = u(&|r| r.buffered_pages);
    row.writeback_link_bytes = median(
        rounds
            .iter()
            .filter_map(|r| r.writeback_link_bytes.map(|b| b as f64))
            .collect(),
    )
    .map(|b| b as u64);
    row.writeback_syncs = u(&|r| r.writeback_syncs);
    row
}

/// The figures compared across modes: a name and how to read it off a row.
type Metric = (String, Box<dyn Fn(&Row) -> Option<f64>>);

fn metrics(connections: &[usize]) -> Vec<Metric> {
    let mut m: Vec<Metric> = Vec::new();
    for &c in connections {
        m.push((
            format!("rr x{c}"),
            Box::new(move |r: &Row| r.rr_per_s.get(&c).copied()),
        ));
    }
    for &c in connections {
        m.push((
            format!("stream x{c}"),
            Box::new(move |r: &Row| r.stream_mb_s.get(&c).copied()),
        ));
    }
    m.push(("osync".into(), Box::new(|r: &Row| r.osync_per_s)));
    m.push(("buffered".into(), Box::new(|r: &Row| r.buffered_per_s)));
    m
}

/// The processes a stream's [`CpuMark`] samples, by index.
const PRIMARY: usize = 0;
const CLIENT: usize = 1;
const STANDBY: usize = 2;

/// Where the host's CPUs went during a stream (CPUs busy on average).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct StreamCpu {
    /// The whole host's busy CPUs.
    busy: f64,
    /// Share of the host's CPU time idle, 0–1.
    idle: f64,
    /// The standby's (0 unprotected).
    standby: f64,
    /// The client's (this process: the stream's threads).
    client: f64,
}

impl StreamCpu {
    fn of(cpu: &CpuUse) -> Option<StreamCpu> {
        let per = |s: Option<f64>| s.map(|s| s / cpu.wall_s);
        (cpu.wall_s > 0.0 && cpu.host_busy_s > 0.0).then(|| StreamCpu {
            busy: cpu.busy_cpus(),
            idle: cpu.idle_share,
            standby: per(cpu.procs_s.get(STANDBY).copied().flatten()).unwrap_or(0.0),
            client: per(cpu.procs_s.get(CLIENT).copied().flatten()).unwrap_or(0.0),
        })
    }
}

/// Host idle below this share of its CPU time: the host's CPUs are the limit.
const SATURATED_IDLE: f64 = 0.1;

/// Whether the host's CPUs limited a stream of `c` connections both
/// unprotected and under protection (`event`), and what the standby and the
/// client took: with every CPU busy either way, what protection adds per
/// byte (the standby, the syncs) is taken from the guest's and the client's
/// share of the same CPUs.
fn stream_cpu_bound(unprotected: &Row, event: &Row, c: usize) -> Option<String> {
    let (u, e) = (unprotected.stream_cpu.get(&c)?, event.stream_cpu.get(&c)?);
    let bound = if u.idle < SATURATED_IDLE && e.idle < SATURATED_IDLE {
        "CPU-bound both ways"
    } else {
        "not CPU-bound both ways"
    };
    Some(format!(
        "; host CPUs busy {:.2} / {:.2} (idle {:.0}% / {:.0}%): {bound}; the standby took {:.2} CPU, the client {:.2} / {:.2}",
        u.busy,
        e.busy,
        u.idle * 100.0,
        e.idle * 100.0,
        e.standby,
        u.client,
        e.client
    ))
}

/// A mode's figure ÷ the unprotected one of the same round, per round.
fn round_ratios(
    rows: &[Vec<Vec<Row>>],
    size: usize,
    mode: usize,
    base: usize,
    get: &dyn Fn(&Row) -> Option<f64>,
) -> Vec<f64> {
    rows.iter()
        .filter_map(|round| {
            let (a, b) = (get(&round[size][mode])?, get(&round[size][base])?);
            (b > 0.0).then_some(a / b)
        })
        .collect()
}

/// Runs the benchmark and prints the table and the goals.
pub fn run(args: &FtBenchArgs, kemari: PathBuf, report: &mut Report) -> Result<(), String> {
    let kemari = args.kemari.clone().unwrap_or(kemari);
    if !args.kernel.exists() {
        return Err(format!(
            "the test guest {} is missing (cargo build -p guest --target x86_64-unknown-none --release)",
            args.kernel.display()
        ));
    }
    if args.connections.is_empty() || args.connections.contains(&0) {
        return Err("--connections needs one or more counts, each at least 1".into());
    }
    if args.modes.is_empty() || args.sizes.is_empty() {
        return Err("--modes and --sizes need at least one entry each".into());
    }
    let tap = Tap::create(args.subnet)?;
    let root = std::env::temp_dir();
    let key = root.join(format!("kemari-bench-ft-key-{}", std::process::id()));
    crate::procs::write_key(&key, "kemari-bench-fault-tolerance-key\n")
        .map_err(|e| e.to_string())?;
    let env = Env {
        kemari,
        kernel: args.kernel.clone(),
        tap: tap.0.clone(),
        guest_ip: format!("10.202.{}.2", args.subnet),
        key: key.clone(),
        scratch_root: root,
        keep_writable_pages: args.keep_writable_pages,
        epochs_in_flight: args.epochs_in_flight,
        link_delay: (args.link_delay_us > 0).then(|| Duration::from_micros(args.link_delay_us)),
    };
    let rounds = args.rounds.max(1);
    for (k, v) in [
        ("sizes", json!(args.sizes)),
        ("modes", json!(args.modes)),
        ("connections", json!(args.connections)),
        ("rounds", json!(rounds)),
        ("period_ms", json!(args.period_ms)),
        ("seconds", json!(args.seconds)),
        ("sync_blocks", json!(args.sync_blocks)),
        ("buffered_blocks", json!(args.buffered_blocks)),
        ("writeback_blocks", json!(args.writeback_blocks)),
    ] {
        report.param(k, v);
    }
    println!(
        "fault tolerance: test guest, TCP echo (rr 64 B, stream 64 KiB) on {:?} connection(s), disk jobs \
         ({} O_SYNC-style blocks, {} buffered), periodic = every {} ms, {} s per network figure; \
         {rounds} round(s), the modes alternated measurement by measurement (medians over rounds)",
        args.connections, args.sync_blocks, args.buffered_blocks, args.period_ms, args.seconds
    );
    let (nsizes, nmodes) = (args.sizes.len(), args.modes.len());
    let mut rows: Vec<Vec<Vec<Row>>> = vec![vec![vec![Row::default(); nmodes]; nsizes]; rounds];
    let mut failed: Vec<(usize, usize, String)> = Vec::new();
    let mut seq = 0;
    for (round, round_rows) in rows.iter_mut().enumerate() {
        for (si, size) in args.sizes.iter().enumerate() {
            for job in Job::ALL {
                // Each measurement in every mode before the next one, the
                // first mode rotated by one each round.
                for k in 0..nmodes {
                    let mi = (k + round) % nmodes;
                    let mode = &args.modes[mi];
                    let row = &mut round_rows[si][mi];
                    let mut raw = match measure(&env, args, &mut seq, size, mode, job, row) {
                        Ok(raw) => raw,
                        Err(e) => {
                            eprintln!(
                                "  round {} {size} {mode} {}: failed: {e}",
                                round + 1,
                                job.name()
                            );
                            failed.push((si, mi, format!("{}: {e}", job.name())));
                            json!({ "size": size, "mode": mode, "job": job.name(), "error": e })
                        }
                    };
                    raw["round"] = round.into();
                    report.run(raw);
                }
            }
        }
        eprintln!("  round {} of {rounds} done", round + 1);
    }
    let _ = std::fs::remove_file(&key);
    let summary: Vec<Vec<Row>> = (0..nsizes)
        .map(|si| {
            (0..nmodes)
                .map(|mi| {
                    let per: Vec<&Row> = rows.iter().map(|r| &r[si][mi]).collect();
                    summarize(&per, &args.connections)
                })
                .collect()
        })
        .collect();
    print_table(args, &summary, report);
    for (si, mi, e) in &failed {
        let line = format!("failed: {} {}: {e}", args.sizes[*si], args.modes[*mi]);
        println!("{line}");
        report.note(line);
    }
    let mode_index = |m: &str| args.modes.iter().position(|x| x == m);
    // Measured after the VMs, so it does not disturb them.
    let floor = super::floor::Floor::measure();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let note = |report: &mut Report, line: String| {
        println!("{line}");
        report.note(line);
    };
    match &floor {
        Ok(f) => {
            report.run(json!({
                "job": "floor",
                "vcpu_stop_us": us(f.vcpu_stop),
                "vcpu_save_us": us(f.vcpu_save),
                "round_trip_sleeping_us": us(f.round_trip_sleeping),
                "round_trip_polling_us": us(f.round_trip_polling),
            }));
            note(
                report,
                format!(
                    "host floor per sync (added to every protected request): vCPU state save p50 {:.1} us; \
                     loopback round trip p50 {:.1} us with both ends sleeping in read, {:.1} us with both polling; \
                     stopping the running vCPU (kick until its thread can save it) p50 {:.1} us",
                    us(f.vcpu_save),
                    us(f.round_trip_sleeping),
                    us(f.round_trip_polling),
                    us(f.vcpu_stop)
                ),
            );
        }
        Err(e) => note(report, format!("host floor per sync: not measured: {e}")),
    }
    // Ratios to unprotected, per round (the modes ran side by side).
    if let Some(base) = mode_index("unprotected") {
        let mets = metrics(&args.connections);
        let mut cols = vec!["size", "mode"];
        let names: Vec<String> = mets.iter().map(|(n, _)| n.clone()).collect();
        cols.extend(names.iter().map(String::as_str));
        cols.push("rr x1 ceiling (sleeping)");
        cols.push("rr x1 ceiling (polling)");
        cols.push("rr x1 ceiling (polling, vCPU stop counted)");
        let mut table = Table::new(
            "ratio to unprotected: median of the per-round ratios (min-max)",
            &cols,
        );
        println!("ratio to unprotected, median of the per-round ratios (min-max):");
        for (si, size) in args.sizes.iter().enumerate() {
            let one = summary[si][base].rr_per_s.get(&1).copied();
            let ceilings = match (&floor, one) {
                (Ok(f), Some(rr)) if rr > 0.0 => {
                    let t = Duration::from_secs_f64(1.0 / rr);
                    (
                        Some(f.ceiling(t, f.round_trip_sleeping)),
                        Some(f.ceiling(t, f.round_trip_polling)),
                        Some(f.ceiling_with_stop(t, f.round_trip_polling)),
                    )
                }
                _ => (None, None, None),
            };
            for (mi, mode) in args.modes.iter().enumerate() {
                if mi == base {
                    continue;
                }
                let mut cells: Vec<Value> = vec![size.as_str().into(), mode.as_str().into()];
                let mut text = Vec::new();
                for (name, get) in &mets {
                    let v = round_ratios(&rows, si, mi, base, get.as_ref());
                    let m = median(v.clone());
                    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
                    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    cells.push(m.into());
                    if let Some(m) = m {
                        text.push(format!("{name} {m:.2} ({lo:.2}-{hi:.2})"));
                    }
                }
                cells.push(ceilings.0.into());
                cells.push(ceilings.1.into());
                cells.push(ceilings.2.into());
                table.row(cells);
                println!("  {size} {mode}: {}", text.join(", "));
            }
        }
        report.table(table);
    }
    println!("goals:");
    let get = |si: usize, m: &str| mode_index(m).map(|mi| &summary[si][mi]);
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let verdict = |ok: bool| if ok { "met" } else { "missed" };
    for (si, size) in args.sizes.iter().enumerate() {
        if let (Some(a), Some(b)) = (get(si, "unprotected"), get(si, "event")) {
            if let Some(r) = ratio(b.rr_per_s.get(&1).copied(), a.rr_per_s.get(&1).copied()) {
                let unprotected = Duration::from_secs_f64(1.0 / a.rr_per_s[&1].max(1e-9));
                let ceiling = floor
                    .as_ref()
                    .map(|f| {
                        let polling = f.ceiling(unprotected, f.round_trip_polling);
                        let stopped = f.ceiling_with_stop(unprotected, f.round_trip_polling);
                        format!(
                            "; at most {:.2} possible here with sleeping ends, {polling:.2} with polling ones \
                             (unprotected {:.1} us + the floor): {:.2} of the polling ceiling (goal >= 0.8): {}; \
                             {stopped:.2} with the vCPU's stop counted too: {:.2} of that",
                            f.ceiling(unprotected, f.round_trip_sleeping),
                            us(unprotected),
                            r / polling,
                            verdict(r / polling >= 0.8),
                            r / stopped
                        )
                    })
                    .unwrap_or_default();
                note(
                    report,
                    format!(
                        "  {size}: event-driven rr x1 = {r:.2} of unprotected (goal >= 0.33): {}{ceiling}",
                        verdict(r >= 1.0 / 3.0)
                    ),
                );
            }
            for &c in args.connections.iter().filter(|&&c| c > 1) {
                if let Some(r) = ratio(b.rr_per_s.get(&c).copied(), a.rr_per_s.get(&c).copied()) {
                    note(
                        report,
                        format!(
                            "  {size}: event-driven rr x{c} = {r:.2} of unprotected{}",
                            if c >= 8 {
                                format!(" (goal >= 0.6): {}", verdict(r >= 0.6))
                            } else {
                                String::new()
                            }
                        ),
                    );
                }
            }
            for &c in &args.connections {
                if let Some(r) = ratio(
                    b.stream_mb_s.get(&c).copied(),
                    a.stream_mb_s.get(&c).copied(),
                ) {
                    note(
                        report,
                        format!(
                            "  {size}: event-driven stream x{c} = {r:.2} of unprotected (goal >= 0.9): {}{}",
                            verdict(r >= 0.9),
                            stream_cpu_bound(a, b, c).unwrap_or_default()
                        ),
                    );
                }
            }
        }
        if let (Some(e), Some(p)) = (get(si, "event"), get(si, "event-plaintext")) {
            if let (Some(rr), Some(stream)) = (
                ratio(e.rr_per_s.get(&1).copied(), p.rr_per_s.get(&1).copied()),
                ratio(
                    e.stream_mb_s.get(&1).copied(),
                    p.stream_mb_s.get(&1).copied(),
                ),
            ) {
                note(
                    report,
                    format!(
                        "  {size}: encrypted vs plaintext link: rr {rr:.2}x, stream {stream:.2}x, sync p50 {} vs {} us (goal: rr cost <= 10%: {})",
                        e.sync_p50,
                        p.sync_p50,
                        verdict(rr >= 0.9),
                    ),
                );
            }
        }
        if let (Some(b), Some(c)) = (get(si, "event"), get(si, "periodic")) {
            if let Some(w) = ratio(b.buffered_per_s, c.buffered_per_s) {
                note(
                    report,
                    format!(
                        "  {size}: buffered writes event/periodic = {w:.2}x (goal >= 1.6x): {}",
                        verdict(w >= 1.6)
                    ),
                );
            }
            let bytes = b.buffered_link_bytes as f64 / (c.buffered_link_bytes.max(1) as f64);
            if let (Some(bw), Some(cw)) = (b.writeback_link_bytes, c.writeback_link_bytes) {
                let wb = bw as f64 / cw.max(1) as f64;
                note(
                    report,
                    format!(
                        "  {size}: link bytes event/periodic: writeback job {wb:.2} (goal <= 0.70): {}; \
                         full-speed buffered job {bytes:.2} (every page written once: no saving possible)",
                        verdict(wb <= 0.70),
                    ),
                );
            }
        }
    }
    if nsizes > 1 {
        if let (Some(s), Some(l)) = (get(0, "event"), get(nsizes - 1, "event")) {
            let (first, last) = (&args.sizes[0], &args.sizes[nsizes - 1]);
            if let Some(r) = ratio(l.rr_per_s.get(&1).copied(), s.rr_per_s.get(&1).copied()) {
                note(
                    report,
                    format!(
                        "  event-driven rr {last} vs {first} = {r:.2} (goal: no decline, >= 0.9): {}",
                        verdict(r >= 0.9)
                    ),
                );
            }
            note(
                report,
                format!(
                    "  sync pause p50 {last} vs {first}: {} vs {} us",
                    l.pause_p50, s.pause_p50
                ),
            );
        }
    }
    Ok(())
}

/// Prints the medians, one line per size and mode, and records them.
fn print_table(args: &FtBenchArgs, summary: &[Vec<Row>], report: &mut Report) {
    let mut cols: Vec<String> = vec!["size".into(), "mode".into()];
    cols.extend(args.connections.iter().map(|c| format!("rr/s x{c}")));
    cols.extend(args.connections.iter().map(|c| format!("stream MB/s x{c}")));
    for c in [
        "osync w/s",
        "buffered w/s",
        "pause p50 us",
        "pause p99 us",
        "sync p50 us",
        "sync p99 us",
        "link MB (buf)",
        "syncs (buf)",
        "pages (buf)",
        "link MB (wb)",
        "syncs (wb)",
    ] {
        cols.push(c.into());
    }
    let col_refs: Vec<&str> = cols.iter().map(String::as_str).collect();
    let mut table = Table::new(
        format!(
            "fault tolerance, median of {} round(s) (rr: 64 B exchanges/s; stream: 64 KiB chunks echoed)",
            args.rounds.max(1)
        ),
        &col_refs,
    );
    println!("{}", cols.join(" | "));
    for (si, size) in args.sizes.iter().enumerate() {
        for (mi, mode) in args.modes.iter().enumerate() {
            let r = &summary[si][mi];
            let mut cells: Vec<Value> = vec![size.as_str().into(), mode.as_str().into()];
            for c in &args.connections {
                cells.push(r.rr_per_s.get(c).copied().into());
            }
            for c in &args.connections {
                cells.push(r.stream_mb_s.get(c).copied().into());
            }
            cells.extend([
                r.osync_per_s.into(),
                r.buffered_per_s.into(),
                r.pause_p50.into(),
                r.pause_p99.into(),
                r.sync_p50.into(),
                r.sync_p99.into(),
                (r.buffered_link_bytes as f64 / 1e6).into(),
                r.buffered_syncs.into(),
                r.buffered_pages.into(),
                r.writeback_link_bytes.map(|b| b as f64 / 1e6).into(),
                r.writeback_syncs.into(),
            ]);
            let text: Vec<String> = cells
                .iter()
                .map(|v| match v {
                    Value::Number(n) if n.is_f64() => format!("{:.2}", n.as_f64().unwrap_or(0.0)),
                    Value::String(s) => s.clone(),
                    Value::Null => "-".into(),
                    v => v.to_string(),
                })
                .collect();
            println!("{}", text.join(" | "));
            table.row(cells);
        }
    }
    report.table(table);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(rr: f64, stream: f64) -> Row {
        let mut r = Row::default();
        r.rr_per_s.insert(1, rr);
        r.stream_mb_s.insert(1, stream);
        r.osync_per_s = Some(rr / 10.0);
        r
    }

    #[test]
    fn summaries_take_the_median_of_the_rounds() {
        let (a, b, c) = (row(100.0, 5.0), row(300.0, 1.0), row(200.0, 3.0));
        let s = summarize(&[&a, &b, &c], &[1]);
        assert_eq!(s.rr_per_s[&1], 200.0);
        assert_eq!(s.stream_mb_s[&1], 3.0);
        assert_eq!(s.osync_per_s, Some(20.0));
        assert_eq!(s.writeback_link_bytes, None);
    }

    fn cpu(mut r: Row, busy: f64, idle: f64, standby: f64) -> Row {
        let client = 0.5 - standby;
        r.stream_cpu.insert(
            1,
            StreamCpu {
                busy,
                idle,
                standby,
                client,
            },
        );
        r
    }

    #[test]
    fn a_stream_is_cpu_bound_only_when_both_modes_leave_no_cpu_idle() {
        let u = cpu(row(100.0, 130.0), 1.98, 0.01, 0.0);
        let e = cpu(row(20.0, 60.0), 1.96, 0.02, 0.3);
        let line = stream_cpu_bound(&u, &e, 1).unwrap();
        assert!(
            line.contains("busy 1.98 / 1.96 (idle 1% / 2%): CPU-bound both ways"),
            "{line}"
        );
        assert!(
            line.contains("standby took 0.30 CPU, the client 0.50 / 0.20"),
            "{line}"
        );
        let idle = cpu(row(20.0, 60.0), 1.2, 0.4, 0.3);
        let line = stream_cpu_bound(&u, &idle, 1).unwrap();
        assert!(line.contains(": not CPU-bound both ways;"), "{line}");
        assert_eq!(stream_cpu_bound(&u, &row(20.0, 60.0), 1), None);
        let s = summarize(&[&u, &e, &cpu(row(1.0, 1.0), 1.97, 0.05, 0.1)], &[1]);
        assert_eq!(s.stream_cpu[&1].busy, 1.97);
        assert_eq!(s.stream_cpu[&1].idle, 0.02);
        assert_eq!(s.stream_cpu[&1].standby, 0.1);
    }

    #[test]
    fn ratios_pair_modes_of_the_same_round() {
        // Round 1 is slow for everyone, round 2 fast: the per-round ratio
        // stays 0.5 where a ratio of medians would mix the rounds.
        let rows = vec![
            vec![vec![row(100.0, 1.0), row(50.0, 1.0)]],
            vec![vec![row(1000.0, 1.0), row(500.0, 1.0)]],
        ];
        let get = |r: &Row| r.rr_per_s.get(&1).copied();
        assert_eq!(round_ratios(&rows, 0, 1, 0, &get), vec![0.5, 0.5]);
        let none = |_: &Row| None;
        assert!(round_ratios(&rows, 0, 1, 0, &none).is_empty());
    }
}
