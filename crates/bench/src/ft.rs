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
//! Then this host's floor per sync ([`super::floor`]) and the goals of
//! issue 7 as ratios, each request/response ratio next to the most the
//! floor allows.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

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
}

#[derive(Debug, Default, Clone)]
struct Row {
    rr_per_s: f64,
    stream_mb_s: f64,
    osync_per_s: f64,
    buffered_per_s: f64,
    pause_p50: u64,
    pause_p99: u64,
    sync_p50: u64,
    sync_p99: u64,
    buffered_link_bytes: u64,
    buffered_syncs: u64,
    buffered_pages: u64,
    writeback_link_bytes: u64,
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
    _standby: Option<Vmm>,
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
    if mode != "unprotected" {
        let mut body = serde_json::json!({
            "peer": format!("127.0.0.1:{port}"),
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
        let r = api(&api_sock, "PUT", "/vm/ft/start", Some(body))
            .map_err(|e| format!("{e}: {}", primary.tail()))?;
        if r["state"] != "protected" {
            return Err(format!("ft start: {r}"));
        }
    }
    api(&api_sock, "PUT", "/vm/resume", None).map_err(|e| format!("{e}: {}", primary.tail()))?;
    Ok(Setup {
        primary,
        _standby: standby,
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

/// 64-byte request/response exchanges per second.
fn request_response(ip: &str, secs: u64) -> Result<f64, String> {
    let mut s = connect_echo(ip)?;
    let msg = [0x5au8; 64];
    let mut back = [0u8; 64];
    let started = Instant::now();
    let mut n = 0u64;
    while started.elapsed() < Duration::from_secs(secs) {
        s.write_all(&msg).map_err(|e| e.to_string())?;
        s.read_exact(&mut back).map_err(|e| e.to_string())?;
        if back != msg {
            return Err("echo differs".into());
        }
        n += 1;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

/// Bytes echoed per second with 64 KiB chunks in flight.
fn stream(ip: &str, secs: u64) -> Result<f64, String> {
    let s = connect_echo(ip)?;
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
    let started = Instant::now();
    let mut bytes = 0u64;
    while started.elapsed() < Duration::from_secs(secs) {
        match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => bytes += n as u64,
            Err(e) => return Err(e.to_string()),
        }
    }
    let rate = bytes as f64 / started.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = reader.shutdown(std::net::Shutdown::Both);
    let _ = sender.join();
    Ok(rate)
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

fn measure(
    env: &Env,
    args: &FtBenchArgs,
    seq: &mut usize,
    size: &str,
    mode: &str,
) -> Result<Row, String> {
    let mut row = Row::default();
    let ip = env.guest_ip.clone();
    // Network.
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
    // The median of three windows: this machine's load comes in bursts.
    let mut rr = [0.0; 3];
    for r in &mut rr {
        *r = request_response(&ip, args.seconds)?;
    }
    rr.sort_by(f64::total_cmp);
    row.rr_per_s = rr[1];
    let st = ft_status(&s);
    row.pause_p50 = st["pause_us_p50"].as_u64().unwrap_or(0);
    row.pause_p99 = st["pause_us_p99"].as_u64().unwrap_or(0);
    row.sync_p50 = st["sync_us_p50"].as_u64().unwrap_or(0);
    row.sync_p99 = st["sync_us_p99"].as_u64().unwrap_or(0);
    row.stream_mb_s = stream(&ip, args.seconds)? / 1e6;
    finish(s);
    // O_SYNC-style writes.
    let job =
        |seq: &mut usize, cmdline: String| disk_run(env, seq, size, mode, args.period_ms, &cmdline);
    row.osync_per_s = job(seq, format!("disk=write,{},seq,flush", args.sync_blocks))?.rate;
    // Buffered writes, and the link bytes they cost.
    let r = job(seq, format!("disk=write,{},seq", args.buffered_blocks))?;
    row.buffered_per_s = r.rate;
    (
        row.buffered_link_bytes,
        row.buffered_syncs,
        row.buffered_pages,
    ) = (r.link_bytes, r.syncs, r.pages);
    // Buffered writes the way an OS does them: the application keeps
    // rewriting its hot pages while the file cache goes to disk in bursts.
    let r = job(
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
    (row.writeback_link_bytes, row.writeback_syncs) = (r.link_bytes, r.syncs);
    Ok(row)
}

/// Runs the benchmark and prints the table and the goals.
pub fn run(args: &FtBenchArgs, kemari: PathBuf) -> Result<(), String> {
    let kemari = args.kemari.clone().unwrap_or(kemari);
    if !args.kernel.exists() {
        return Err(format!(
            "the test guest {} is missing (cargo build -p guest --target x86_64-unknown-none --release)",
            args.kernel.display()
        ));
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
    };
    println!(
        "fault tolerance: test guest, TCP echo (rr 64 B, stream 64 KiB), disk jobs \
         ({} O_SYNC-style blocks, {} buffered), periodic = every {} ms, {} s per network figure",
        args.sync_blocks, args.buffered_blocks, args.period_ms, args.seconds
    );
    println!(
        "{:<6} {:<12} {:>9} {:>11} {:>10} {:>12} {:>16} {:>16} {:>12} {:>16} {:>11} {:>8}",
        "size",
        "mode",
        "rr/s",
        "stream MB/s",
        "osync w/s",
        "buffered w/s",
        "pause p50/p99us",
        "sync p50/p99us",
        "link MB(buf)",
        "syncs/pages(buf)",
        "link MB(wb)",
        "syncs(wb)"
    );
    let mut results = Vec::new();
    let mut seq = 0;
    for size in &args.sizes {
        for mode in &args.modes {
            let row = measure(&env, args, &mut seq, size, mode);
            match &row {
                Ok(r) => println!(
                    "{:<6} {:<12} {:>9.0} {:>11.2} {:>10.1} {:>12.1} {:>16} {:>16} {:>12.2} {:>16} {:>11.2} {:>8}",
                    size,
                    mode,
                    r.rr_per_s,
                    r.stream_mb_s,
                    r.osync_per_s,
                    r.buffered_per_s,
                    format!("{}/{}", r.pause_p50, r.pause_p99),
                    format!("{}/{}", r.sync_p50, r.sync_p99),
                    r.buffered_link_bytes as f64 / 1e6,
                    format!("{}/{}", r.buffered_syncs, r.buffered_pages),
                    r.writeback_link_bytes as f64 / 1e6,
                    r.writeback_syncs
                ),
                Err(e) => println!("{size:<6} {mode:<12} failed: {e}"),
            }
            results.push((size.clone(), mode.clone(), row.ok()));
        }
    }
    let _ = std::fs::remove_file(&key);
    let get = |size: &str, mode: &str| {
        results
            .iter()
            .find(|(s, m, _)| s == size && m == mode)
            .and_then(|(_, _, r)| r.clone())
    };
    // Measured after the VMs, so it does not disturb them.
    let floor = super::floor::Floor::measure();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    match &floor {
        Ok(f) => println!(
            "host floor per sync (added to every protected request): vCPU state save p50 {:.1} us; \
             loopback round trip p50 {:.1} us with both ends sleeping in read, {:.1} us with both polling",
            us(f.vcpu_save),
            us(f.round_trip_sleeping),
            us(f.round_trip_polling)
        ),
        Err(e) => println!("host floor per sync: not measured: {e}"),
    }
    println!("goals:");
    for size in &args.sizes {
        if let (Some(a), Some(b)) = (get(size, "unprotected"), get(size, "event")) {
            let r = b.rr_per_s / a.rr_per_s.max(1e-9);
            let unprotected = Duration::from_secs_f64(1.0 / a.rr_per_s.max(1e-9));
            let ceiling = floor
                .as_ref()
                .map(|f| {
                    format!(
                        "; at most {:.2} possible here with sleeping ends, {:.2} with polling ones \
                         (unprotected {:.1} us + the floor)",
                        f.ceiling(unprotected, f.round_trip_sleeping),
                        f.ceiling(unprotected, f.round_trip_polling),
                        us(unprotected)
                    )
                })
                .unwrap_or_default();
            println!(
                "  {size}: event-driven rr = {:.2} of unprotected (goal >= 0.33): {}{ceiling}",
                r,
                if r >= 1.0 / 3.0 { "met" } else { "missed" },
            );
        }
        if let (Some(e), Some(p)) = (get(size, "event"), get(size, "event-plaintext")) {
            let rr = e.rr_per_s / p.rr_per_s.max(1e-9);
            let stream = e.stream_mb_s / p.stream_mb_s.max(1e-9);
            println!(
                "  {size}: encrypted vs plaintext link: rr {rr:.2}x, stream {stream:.2}x, sync p50 {} vs {} us (goal: rr cost <= 10%: {})",
                e.sync_p50,
                p.sync_p50,
                if rr >= 0.9 { "met" } else { "missed" },
            );
        }
        if let (Some(b), Some(c)) = (get(size, "event"), get(size, "periodic")) {
            let w = b.buffered_per_s / c.buffered_per_s.max(1e-9);
            let bytes = b.buffered_link_bytes as f64 / (c.buffered_link_bytes.max(1) as f64);
            let wb = b.writeback_link_bytes as f64 / (c.writeback_link_bytes.max(1) as f64);
            println!(
                "  {size}: buffered writes event/periodic = {:.2}x (goal >= 1.6x): {}",
                w,
                if w >= 1.6 { "met" } else { "missed" },
            );
            println!(
                "  {size}: link bytes event/periodic: writeback job {:.2} (goal <= 0.70): {}; \
                 full-speed buffered job {:.2} (every page written once: no saving possible)",
                wb,
                if wb <= 0.70 { "met" } else { "missed" },
                bytes,
            );
        }
    }
    if let (Some(first), Some(last)) = (args.sizes.first(), args.sizes.last()) {
        if let (Some(s), Some(l)) = (get(first, "event"), get(last, "event")) {
            let r = l.rr_per_s / s.rr_per_s.max(1e-9);
            println!(
                "  event-driven rr {last} vs {first} = {:.2} (goal: no decline, >= 0.9): {}",
                r,
                if r >= 0.9 { "met" } else { "missed" }
            );
            println!(
                "  sync pause p50 {last} vs {first}: {} vs {} us",
                l.pause_p50, s.pause_p50
            );
        }
    }
    Ok(())
}
