//! QEMU's closest equivalents, driven over QMP: stop + `migrate` to a file +
//! `-incoming` (with and without `x-ignore-shared`, and with the new QEMU
//! started in advance), and local live migration over a Unix socket (with
//! `x-ignore-shared`, or copying memory).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;

use super::{
    at_random_phase, continued, no_lost_writes, outage, show_logs, spawn, timeout, unreachable_op,
    wait_exit, wait_first_counter, wait_lines_after, wait_more_counters, wait_steady, Env, Op,
    OpError, QemuLocalMode, Sample, Workload, STEP,
};
use crate::procs::{wait_path, Scratch, Vmm};
use crate::qmp::{Qmp, QmpError};

/// The QEMU migration bandwidth limit we set: effectively none (QEMU 7.2's
/// default is 32 MiB/s, which would measure the limit, not QEMU).
const QEMU_MAX_BANDWIDTH: u64 = 100 << 30;

struct QemuSpec<'a> {
    mem: &'a str,
    w: &'a Workload,
    qmp: &'a Path,
    shared: Option<&'a Path>,
    /// Without `shared`: the memory is still a backend named `mem` (QEMU's
    /// own memory), as a source's file backend requires of its destination.
    named_ram: bool,
    incoming: Option<&'a str>,
}

fn qemu_cmd(env: &Env, s: &QemuSpec) -> Command {
    let mut machine = "microvm,x-option-roms=off,rtc=off,isa-serial=on".to_owned();
    let mut c = Command::new(&env.qemu);
    if let Some(path) = s.shared {
        machine.push_str(",memory-backend=mem");
        c.arg("-object").arg(format!(
            "memory-backend-file,id=mem,size={},mem-path={},share=on",
            s.mem,
            path.display()
        ));
    } else if s.named_ram {
        machine.push_str(",memory-backend=mem");
        c.arg("-object")
            .arg(format!("memory-backend-ram,id=mem,size={}", s.mem));
    }
    c.args(["-accel", "kvm", "-M", &machine, "-cpu", crate::QEMU_CPU])
        .args(["-m", s.mem])
        .args(["-nodefaults", "-no-user-config", "-nographic"])
        .args(["-serial", "stdio"])
        .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=4"])
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", s.qmp.display()))
        .arg("-append")
        .arg(s.w.cmdline())
        .arg("-kernel")
        .arg(&env.kernel);
    if let Some(inc) = s.incoming {
        c.args(["-incoming", inc]);
    }
    c
}

fn qmp_of(vmm: &Vmm, socket: &Path) -> Result<Qmp, OpError> {
    Qmp::connect(socket, Duration::from_secs(30)).map_err(|e| match e {
        QmpError::Io { .. } | QmpError::Closed(_) => timeout(&format!("QMP ({e})"), vmm),
        other => OpError::Qmp(other),
    })
}

fn set_bandwidth(q: &mut Qmp) -> Result<(), OpError> {
    q.execute(
        "migrate-set-parameters",
        Some(json!({ "max-bandwidth": QEMU_MAX_BANDWIDTH })),
    )?;
    Ok(())
}

fn ignore_shared(q: &mut Qmp) -> Result<(), OpError> {
    q.set_capabilities(&["x-ignore-shared"])
        .map_err(|e| match e {
            QmpError::Command { desc, .. } => OpError::IgnoreSharedRefused(desc),
            other => OpError::Qmp(other),
        })
}

const POLL: Duration = Duration::from_millis(2);

/// Waits until an incoming QEMU has loaded its state (its run state leaves
/// `inmigrate`).
fn wait_loaded(q: &mut Qmp, vmm: &Vmm) -> Result<(), OpError> {
    let deadline = Instant::now() + STEP;
    loop {
        let st = q.execute("query-status", None)?;
        match st["status"].as_str() {
            Some("inmigrate") | None => {}
            Some(_) => return Ok(()),
        }
        if Instant::now() >= deadline {
            return Err(timeout("QEMU to load the saved state", vmm));
        }
        std::thread::sleep(POLL);
    }
}

/// Measures one QEMU operation.
pub fn run_qemu(
    env: &Env,
    op: Op,
    mem: &str,
    w: &Workload,
    seq: usize,
    local_mode: QemuLocalMode,
) -> Result<Sample, OpError> {
    let mut scratch = Scratch::create(&env.work_dir, seq).map_err(OpError::Scratch)?;
    let qmp1 = scratch.path("qmp-1.sock");
    let qmp2 = scratch.path("qmp-2.sock");
    let shared = match op {
        Op::QemuWarm | Op::QemuWarmPrepared => Some(scratch.shm_file("qemu-mem")),
        Op::QemuLocal if local_mode == QemuLocalMode::IgnoreShared => {
            Some(scratch.shm_file("qemu-mem"))
        }
        _ => None,
    };
    // Memory in use (--in-use-mib): the source's memory is a file filled as
    // kemari's is (ops::fill_in_use), mapped shared but migrated by copy
    // (no x-ignore-shared); the destination's is QEMU's own.
    let filled = match op {
        Op::QemuLocalCopy if env.in_use_mib > 0 => {
            let f = scratch.shm_file("qemu-mem");
            let size = vmm::config::parse_size(mem)
                .map_err(|e| OpError::Scratch(std::io::Error::other(e.to_string())))?;
            super::fill_in_use(&f, size, env.in_use_mib).map_err(OpError::Scratch)?;
            Some(f)
        }
        _ => None,
    };
    let mut src = spawn(
        "source QEMU",
        qemu_cmd(
            env,
            &QemuSpec {
                mem,
                w,
                qmp: &qmp1,
                shared: shared.as_deref().or(filled.as_deref()),
                named_ram: false,
                incoming: None,
            },
        ),
    )?;
    let mut q1 = qmp_of(&src, &qmp1)?;
    set_bandwidth(&mut q1)?;
    if shared.is_some() {
        ignore_shared(&mut q1)?;
    }
    let dirty_seen = wait_steady(&src, w)?;
    let file = scratch.path("qemu-state");
    let unix = scratch.path("qemu-migrate.sock");
    let unix_uri = format!("unix:{}", unix.display());
    // The local-migration destination, and the new QEMU of the prepared warm
    // restart, are ready before the clock starts.
    let mut pre_dst = None;
    if op == Op::QemuWarmPrepared {
        let d = spawn(
            "pre-started QEMU",
            qemu_cmd(
                env,
                &QemuSpec {
                    mem,
                    w,
                    qmp: &qmp2,
                    shared: shared.as_deref(),
                    named_ram: false,
                    incoming: Some("defer"),
                },
            ),
        )?;
        let mut q2 = qmp_of(&d, &qmp2)?;
        ignore_shared(&mut q2)?;
        pre_dst = Some((d, q2));
        wait_more_counters(&src, 3)?;
    }
    let mut pre_local = None;
    if matches!(op, Op::QemuLocal | Op::QemuLocalCopy) {
        let d = spawn(
            "destination QEMU",
            qemu_cmd(
                env,
                &QemuSpec {
                    mem,
                    w,
                    qmp: &qmp2,
                    shared: shared.as_deref(),
                    named_ram: filled.is_some(),
                    incoming: Some("defer"),
                },
            ),
        )?;
        let mut q2 = qmp_of(&d, &qmp2)?;
        if shared.is_some() {
            ignore_shared(&mut q2)?;
        }
        q2.execute("migrate-incoming", Some(json!({ "uri": unix_uri })))?;
        if !wait_path(&unix, STEP) {
            return Err(timeout("the destination's migration socket", &d));
        }
        pre_local = Some(d);
        wait_more_counters(&src, 3)?;
    }
    at_random_phase(w);
    let t0 = Instant::now();
    let mut phases = Vec::new();
    let mut mark = |name: &'static str| phases.push((name, t0.elapsed()));
    let (dst, t_done, st) = match op {
        Op::QemuFile | Op::QemuWarm => {
            // Suspend: stop the guest, then write its state (and, without
            // x-ignore-shared, its memory) to the file.
            q1.execute("stop", None)?;
            q1.execute(
                "migrate",
                Some(json!({ "uri": format!("exec:cat > {}", file.display()) })),
            )?;
            let st = q1.wait_migration(POLL, STEP)?;
            mark("migration completed");
            q1.quit()?;
            wait_exit(&mut src)?;
            mark("old VMM exited");
            let uri = format!("exec:cat {}", file.display());
            let (incoming, shared) = if op == Op::QemuFile {
                (uri.as_str(), None)
            } else {
                ("defer", shared.as_deref())
            };
            let dst = spawn(
                "restored QEMU",
                qemu_cmd(
                    env,
                    &QemuSpec {
                        mem,
                        w,
                        qmp: &qmp2,
                        shared,
                        named_ram: false,
                        incoming: Some(incoming),
                    },
                ),
            )?;
            let mut q2 = qmp_of(&dst, &qmp2)?;
            if shared.is_some() {
                ignore_shared(&mut q2)?;
                q2.execute("migrate-incoming", Some(json!({ "uri": uri })))?;
            }
            // The guest was stopped when saved, so QEMU restores it stopped
            // (its global state): `cont` once the state is in.
            mark("new VMM answers QMP");
            wait_loaded(&mut q2, &dst)?;
            mark("state loaded");
            q2.execute("cont", None)?;
            (dst, t0, st)
        }
        Op::QemuWarmPrepared => {
            let Some((dst, mut q2)) = pre_dst.take() else {
                return Err(timeout("a pre-started QEMU", &src));
            };
            q1.execute("stop", None)?;
            q1.execute(
                "migrate",
                Some(json!({ "uri": format!("exec:cat > {}", file.display()) })),
            )?;
            let st = q1.wait_migration(POLL, STEP)?;
            mark("migration completed");
            // As kemari's prepared successor: the old process's exit is not
            // waited for (it no longer touches the shared memory).
            q1.quit()?;
            q2.execute(
                "migrate-incoming",
                Some(json!({ "uri": format!("exec:cat {}", file.display()) })),
            )?;
            wait_loaded(&mut q2, &dst)?;
            mark("state loaded");
            q2.execute("cont", None)?;
            (dst, t0, st)
        }
        Op::QemuLocal | Op::QemuLocalCopy => {
            q1.execute("migrate", Some(json!({ "uri": unix_uri })))?;
            let st = q1.wait_migration(POLL, STEP)?;
            let t_done = Instant::now();
            mark("migration completed");
            q1.quit()?;
            wait_exit(&mut src)?;
            mark("old VMM exited");
            match pre_local.take() {
                Some(d) => (d, t_done, st),
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
    continued(&o)?;
    no_lost_writes(&[&src, &dst])?;
    show_logs(env, &[&src, &dst]);
    Ok(Sample {
        downtime: o.downtime,
        resolution: o.resolution,
        mid_line: o.mid_line,
        total: t_first.max(t_done) - t0,
        dirty_seen,
        reported_downtime_ms: st.downtime_ms.map(|d| d as f64),
        bytes: matches!(op, Op::QemuLocal | Op::QemuLocalCopy)
            .then_some(st.ram_bytes)
            .flatten(),
        phases,
    })
}
