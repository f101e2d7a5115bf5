//! kemari's operations: cold reboot, snapshot/restore, warm restart,
//! zero-copy local migration, TCP pre-copy live migration, driven through its
//! API as `kemarictl` does.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use serde_json::json;

use super::{
    api, at_random_phase, continued, no_lost_writes, outage, show_logs, spawn, timeout,
    unreachable_op, wait_exit, wait_first_counter, wait_lines_after, wait_more_counters,
    wait_steady, Env, Op, OpError, Sample, Workload, STEP,
};
use crate::procs::{wait_listening, wait_path, Scratch};

fn kemari_boot(
    env: &Env,
    mem: &str,
    w: &Workload,
    api_sock: &Path,
    memfile: Option<&Path>,
) -> Command {
    let mut c = Command::new(&env.kemari);
    c.arg("--kernel")
        .arg(&env.kernel)
        .args(["--memory", mem, "--cmdline"])
        .arg(w.cmdline())
        .args(["--serial", "stdout", "--log-level", &env.kemari_log])
        .arg("--api-socket")
        .arg(api_sock);
    if let Some(f) = memfile {
        c.arg("--memory-file").arg(f);
    }
    c
}

/// Creates the memory file `path` of `size` bytes with its top `mib` MiB
/// (at most `size` − 192 MiB, which the test guest uses and expects zeroed)
/// full of non-zero data, as memory in use by applications would be.
pub(crate) fn fill_in_use(path: &Path, size: u64, mib: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    const CHUNK: usize = 1 << 20;
    let file = std::fs::File::create(path)?;
    file.set_len(size)?;
    let bytes = (mib << 20).min(size.saturating_sub(192 << 20));
    // Pseudo-random, never zero: no page of it is skipped as a zero page.
    let chunk: Vec<u8> = (0..CHUNK as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8 | 1)
        .collect();
    let mut at = size - bytes;
    while at < size {
        let n = ((size - at) as usize).min(CHUNK);
        file.write_all_at(&chunk[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

fn kemari_new(env: &Env, flag: &str, from: &Path, api_sock: &Path) -> Command {
    let mut c = Command::new(&env.kemari);
    c.arg(flag)
        .arg(from)
        .args(["--serial", "stdout", "--log-level", &env.kemari_log])
        .arg("--api-socket")
        .arg(api_sock);
    c
}

/// Measures one kemari operation.
pub fn run_kemari(
    env: &Env,
    op: Op,
    mem: &str,
    w: &Workload,
    seq: usize,
) -> Result<Sample, OpError> {
    let mut scratch = Scratch::create(&env.work_dir, seq).map_err(OpError::Scratch)?;
    let api1 = scratch.path("api-1.sock");
    let api2 = scratch.path("api-2.sock");
    // Zero-copy too, as QEMU's x-ignore-shared needs a shared memory file:
    // its destination then builds its VM around the file before the clock.
    let memfile = (matches!(op, Op::Warm | Op::WarmPrepared | Op::ZeroCopy)
        || (op == Op::Precopy && env.in_use_mib > 0))
        .then(|| scratch.shm_file("mem"));
    if let (Some(f), true) = (&memfile, env.in_use_mib > 0) {
        let size = vmm::config::parse_size(mem)
            .map_err(|e| OpError::Scratch(std::io::Error::other(e.to_string())))?;
        fill_in_use(f, size, env.in_use_mib).map_err(OpError::Scratch)?;
    }
    let mut src = spawn(
        "source kemari",
        kemari_boot(env, mem, w, &api1, memfile.as_deref()),
    )?;
    let dirty_seen = wait_steady(&src, w)?;
    let mut reported = None;
    let mut bytes = None;
    // A migration destination is ready before the clock starts.
    let incoming = scratch.path("incoming.sock");
    let mut pre_dst = None;
    let key = scratch.path("migration.key");
    let port = 30000 + (std::process::id() % 1000) as u16 * 20 + (seq % 20) as u16;
    let to = format!("127.0.0.1:{port}");
    if op == Op::ZeroCopy {
        let mut c = kemari_new(env, "--incoming-local", &incoming, &api2);
        if let Some(f) = &memfile {
            c.arg("--memory-file").arg(f);
        }
        let d = spawn("destination kemari", c)?;
        if !wait_path(&incoming, STEP) {
            return Err(timeout("the destination's socket", &d));
        }
        pre_dst = Some(d);
        wait_more_counters(&src, 3)?;
    }
    let state_dir = scratch.path("state");
    if op == Op::WarmPrepared {
        api(
            &api1,
            "warm-restart --prepare",
            "PUT",
            "/vm/warm-restart",
            Some(json!({ "dir": state_dir, "prepare": true })),
        )?;
        let mut c = kemari_new(env, "--restore", &state_dir, &api2);
        c.arg("--await-state");
        let d = spawn("successor kemari", c)?;
        if !wait_path(&state_dir.join("successor.sock"), STEP) {
            return Err(timeout("the successor's socket", &d));
        }
        pre_dst = Some(d);
        wait_more_counters(&src, 3)?;
    }
    if op == Op::Precopy {
        crate::procs::write_key(&key, "kemari-bench-precopy-key-0123456789")
            .map_err(OpError::Scratch)?;
        let mut c = Command::new(&env.kemari);
        c.args(["--incoming", &to, "--migration-key-file"])
            .arg(&key)
            .args(["--serial", "stdout", "--log-level", &env.kemari_log])
            .arg("--api-socket")
            .arg(&api2);
        if env.plaintext_link {
            c.arg("--plaintext-link");
        }
        let d = spawn("destination kemari", c)?;
        // Not by connecting: that would be taken for the migration.
        if !wait_listening(port, STEP) {
            return Err(timeout("the destination to listen", &d));
        }
        pre_dst = Some(d);
        wait_more_counters(&src, 3)?;
    }
    at_random_phase(w);
    let t0 = Instant::now();
    let mut t_done = t0;
    let mut phases = Vec::new();
    let mut mark = |name: &'static str| phases.push((name, t0.elapsed()));
    let dst = match op {
        Op::Reboot => {
            api(&api1, "shutdown", "PUT", "/vm/shutdown", None)?;
            mark("request answered");
            if !env.overlap_exit {
                wait_exit(&mut src)?;
                mark("old VMM exited");
            }
            spawn("rebooted kemari", kemari_boot(env, mem, w, &api2, None))?
        }
        Op::Snapshot | Op::Warm => {
            let dir = state_dir;
            let (call, path, body) = if op == Op::Snapshot {
                (
                    "snapshot",
                    "/vm/snapshot",
                    json!({ "dir": dir, "exit": true }),
                )
            } else {
                ("warm-restart", "/vm/warm-restart", json!({ "dir": dir }))
            };
            let r = api(&api1, call, "PUT", path, Some(body))?;
            reported = r["paused_ms"].as_f64();
            mark("request answered");
            if !env.overlap_exit {
                wait_exit(&mut src)?;
                mark("old VMM exited");
            }
            spawn("restored kemari", kemari_new(env, "--restore", &dir, &api2))?
        }
        Op::WarmPrepared => {
            let r = api(
                &api1,
                "warm-restart",
                "PUT",
                "/vm/warm-restart",
                Some(json!({ "dir": state_dir })),
            )?;
            // Answered once the successor runs the VM, as a migration is.
            t_done = Instant::now();
            mark("request answered");
            reported = r["successor"]["downtime_ms"].as_f64();
            wait_exit(&mut src)?;
            mark("old VMM exited");
            match pre_dst.take() {
                Some(d) => d,
                None => return Err(timeout("a successor", &src)),
            }
        }
        Op::ZeroCopy | Op::Precopy => {
            let (call, path, body) = if op == Op::ZeroCopy {
                (
                    "migrate-local",
                    "/vm/migrate-local",
                    json!({ "socket": incoming }),
                )
            } else {
                (
                    "migrate",
                    "/vm/migrate",
                    json!({ "to": to, "key_file": key, "plaintext": env.plaintext_link }),
                )
            };
            let r = api(&api1, call, "PUT", path, Some(body))?;
            t_done = Instant::now();
            mark("request answered");
            reported = r["downtime_ms"].as_f64();
            bytes = r["bytes_sent"].as_u64();
            wait_exit(&mut src)?;
            mark("old VMM exited");
            match pre_dst.take() {
                Some(d) => d,
                None => return Err(timeout("a destination", &src)),
            }
        }
        _ => unreachable_op(op),
    };
    let t_first = wait_first_counter(&dst, t0)?;
    wait_lines_after(&dst, t0);
    phases.push(("first counter line", t_first - t0));
    wait_exit(&mut src)?;
    let o = outage(&src, &dst, t0, w)?;
    if op != Op::Reboot {
        continued(&o)?;
    }
    no_lost_writes(&[&src, &dst])?;
    show_logs(env, &[&src, &dst]);
    Ok(Sample {
        downtime: o.downtime,
        resolution: o.resolution,
        mid_line: o.mid_line,
        total: t_first.max(t_done) - t0,
        dirty_seen,
        reported_downtime_ms: reported,
        bytes,
        phases,
    })
}
