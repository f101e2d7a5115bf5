//! `kemari-bench api`: how long the control API takes to answer while
//! others misbehave and while the operations it exists for run — the
//! figures behind issue 23's goal (p99 < 50 ms), which the tests only bound
//! generously.
//!
//! 1. `GET /vm` behind 1,000 idle connections and a client sending one byte
//!    a second (`kemari_api::latency::probe`);
//! 2. `GET /vm` and `GET /vm/migration`, one after the other every 10 ms,
//!    for as long as a live migration of a guest with memory in use runs
//!    (pre-copy over loopback, seconds long).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use clap::Args;
use kemari::api::client::{request_to_end, request_with_timeout};
use kemari::api::latency::{probe, ProbeOptions};

use crate::procs::{wait_listening, Scratch, Vmm};
use crate::report::{Report, Table};
use serde_json::json;

/// Options of `kemari-bench api`.
#[derive(Debug, Args)]
pub struct ApiBenchArgs {
    /// The test guest ELF.
    #[arg(long, default_value = "target/x86_64-unknown-none/release/guest")]
    pub kernel: PathBuf,
    /// Idle connections held open during the first measurement.
    #[arg(long, default_value_t = 1000)]
    pub idle: usize,
    /// Clients sending a request one byte a second.
    #[arg(long, default_value_t = 1)]
    pub slow: usize,
    /// `GET /vm` requests timed in the first measurement.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Memory of the migrated guest.
    #[arg(long, default_value = "2G")]
    pub memory: String,
    /// MiB of it in use (filled with data the pre-copy must send).
    #[arg(long, default_value_t = 1536)]
    pub in_use_mib: u64,
    /// Scratch directory.
    #[arg(long, default_value = "/var/tmp")]
    pub work_dir: PathBuf,
}

fn kemari_cmd(kemari: &Path) -> Command {
    Command::new(kemari)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Runs both measurements and prints their tables.
pub fn run(args: &ApiBenchArgs, kemari: &Path, report: &mut Report) -> Result<(), String> {
    report.param("idle", args.idle);
    report.param("slow", args.slow);
    report.param("requests", args.requests);
    report.param("memory", args.memory.as_str());
    report.param("in_use_mib", args.in_use_mib);
    let mut scratch = Scratch::create(&args.work_dir, 0).map_err(|e| e.to_string())?;
    let mut table = Table::new(
        "control API answer times, ms",
        &["request", "while", "p50", "p99", "max", "answers"],
    );
    let idle = idle_and_slow(args, kemari, &scratch, &mut table)?;
    report.run(idle);
    let result = during_migration(args, kemari, &mut scratch, &mut table, report);
    report.table(table);
    result
}

fn idle_and_slow(
    args: &ApiBenchArgs,
    kemari: &Path,
    scratch: &Scratch,
    table: &mut Table,
) -> Result<serde_json::Value, String> {
    let sock = scratch.path("idle.sock");
    let mut cmd = kemari_cmd(kemari);
    cmd.arg("--kernel")
        .arg(&args.kernel)
        .args([
            "--memory",
            "64M",
            "--cmdline",
            "counter=500",
            "--serial",
            "null",
        ])
        .arg("--api-socket")
        .arg(&sock);
    let mut vmm = Vmm::spawn("kemari", cmd).map_err(|e| e.to_string())?;
    let t = Instant::now();
    while !sock.exists() {
        if t.elapsed() > Duration::from_secs(30) {
            return Err(format!("kemari never served its API: {}", vmm.tail()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let report = probe(
        &sock,
        &ProbeOptions::new(args.idle, args.slow, args.requests),
    )
    .map_err(|e| e.to_string())?;
    table.row(vec![
        "GET /vm".into(),
        format!(
            "{} idle connections, {} slow client(s)",
            report.idle_opened, args.slow
        )
        .into(),
        ms(report.p50).into(),
        ms(report.p99).into(),
        ms(report.max).into(),
        report.answered.into(),
    ]);
    println!(
        "GET /vm behind {} idle connections and {} client(s) at 1 byte/s: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} answered, {} failed)",
        report.idle_opened,
        args.slow,
        ms(report.p50),
        ms(report.p99),
        ms(report.max),
        report.answered,
        report.failed
    );
    let _ = request_with_timeout(&sock, "PUT", "/vm/shutdown", None, Duration::from_secs(5));
    vmm.wait_exit(Duration::from_secs(10));
    let mut raw = serde_json::to_value(&report).unwrap_or_default();
    raw["request"] = "GET /vm".into();
    raw["while"] = "idle connections and slow clients".into();
    Ok(raw)
}

fn during_migration(
    args: &ApiBenchArgs,
    kemari: &Path,
    scratch: &mut Scratch,
    table: &mut Table,
    report: &mut Report,
) -> Result<(), String> {
    let size = vmm::config::parse_size(&args.memory).map_err(|e| e.to_string())?;
    let memfile = scratch.shm_file("api-src");
    crate::ops::fill_in_use(&memfile, size, args.in_use_mib).map_err(|e| e.to_string())?;
    let key = scratch.path("key");
    crate::procs::write_key(&key, "kemari-bench-api-key-0123456789").map_err(|e| e.to_string())?;
    let (src_sock, dst_sock) = (scratch.path("src.sock"), scratch.path("dst.sock"));
    let mut src_cmd = kemari_cmd(kemari);
    src_cmd
        .arg("--kernel")
        .arg(&args.kernel)
        .args([
            "--memory",
            &args.memory,
            "--cmdline",
            "counter=100 dirty=1000,8",
        ])
        .arg("--memory-file")
        .arg(&memfile)
        .args(["--serial", "null", "--api-socket"])
        .arg(&src_sock);
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let mut dst_cmd = kemari_cmd(kemari);
    dst_cmd
        .args(["--incoming", &format!("127.0.0.1:{port}")])
        .arg("--migration-key-file")
        .arg(&key)
        .args(["--serial", "null", "--api-socket"])
        .arg(&dst_sock);
    let _src = Vmm::spawn("source kemari", src_cmd).map_err(|e| e.to_string())?;
    let _dst = Vmm::spawn("destination kemari", dst_cmd).map_err(|e| e.to_string())?;
    if !wait_listening(port, Duration::from_secs(30)) {
        return Err("the destination never listened".into());
    }
    let t = Instant::now();
    while !src_sock.exists() {
        if t.elapsed() > Duration::from_secs(30) {
            return Err("the source never served its API".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_secs(2));
    let body = serde_json::json!({ "to": format!("127.0.0.1:{port}"), "key_file": key });
    let api = src_sock.clone();
    let migration = std::thread::spawn(move || {
        request_to_end(&api, "PUT", "/vm/migrate", Some(&body)).map_err(|e| e.to_string())
    });
    let mut info = Vec::new();
    let mut progress = Vec::new();
    loop {
        let t = Instant::now();
        let Ok(p) = request_with_timeout(
            &src_sock,
            "GET",
            "/vm/migration",
            None,
            Duration::from_secs(5),
        ) else {
            break;
        };
        let took = t.elapsed();
        match p["status"].as_str() {
            Some("running") => progress.push(took),
            Some("completed" | "failed" | "cancelled") => break,
            _ => {}
        }
        let t = Instant::now();
        if request_with_timeout(&src_sock, "GET", "/vm", None, Duration::from_secs(5)).is_err() {
            break;
        }
        info.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(10));
    }
    let migrated = migration
        .join()
        .map_err(|_| "the migration thread panicked".to_string())??;
    let total_ms = migrated["total_ms"].as_f64().unwrap_or(0.0);
    for (what, mut v) in [("GET /vm/migration", progress), ("GET /vm", info)] {
        report.run(json!({
            "request": what,
            "while": "live migration",
            "migration_total_ms": total_ms,
            "ms": v.iter().map(|d| ms(*d)).collect::<Vec<_>>(),
        }));
        v.sort_unstable();
        table.row(vec![
            what.into(),
            format!(
                "live migration of {} ({} MiB in use, {total_ms:.0} ms)",
                args.memory, args.in_use_mib
            )
            .into(),
            ms(percentile(&v, 0.5)).into(),
            ms(percentile(&v, 0.99)).into(),
            ms(v.last().copied().unwrap_or_default()).into(),
            v.len().into(),
        ]);
        println!(
            "{what} during a live migration of {} ({} MiB in use, total {:.0} ms): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} answers)",
            args.memory,
            args.in_use_mib,
            total_ms,
            ms(percentile(&v, 0.5)),
            ms(percentile(&v, 0.99)),
            ms(v.last().copied().unwrap_or_default()),
            v.len()
        );
    }
    let _ = request_with_timeout(
        &dst_sock,
        "PUT",
        "/vm/shutdown",
        None,
        Duration::from_secs(5),
    );
    Ok(())
}
