//! The whole-VM operations measured by `kemari-bench availability`, each run
//! once from a freshly booted source VM to the first counter line of the VM's
//! next VMM process.
//!
//! Every operation starts its clock when the bench issues the request (an API
//! call, as `kemarictl` sends it, or a QMP command); a migration destination is
//! started and ready *before* the clock starts, for kemari and QEMU alike.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;

use super::console::{self, Line, Outage};
use super::procs::{wait_path, Scratch, Vmm};
use super::qmp::{Qmp, QmpError};
use crate::api::client::{request, ClientError};

/// How long any single step may take before the measurement fails.
const STEP: Duration = Duration::from_secs(60);

/// Errors of one measurement.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// A process could not be started.
    #[error("cannot start {what}: {source}")]
    Spawn {
        /// Which process.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Scratch files could not be made.
    #[error("scratch directory: {0}")]
    Scratch(#[source] std::io::Error),
    /// kemari's API refused or failed.
    #[error("kemari API {call}: {source}")]
    Api {
        /// The call.
        call: &'static str,
        /// The cause.
        #[source]
        source: ClientError,
    },
    /// QMP failed.
    #[error(transparent)]
    Qmp(#[from] QmpError),
    /// QEMU refused `x-ignore-shared`: the caller may fall back.
    #[error("QEMU refused x-ignore-shared: {0}")]
    IgnoreSharedRefused(String),
    /// A VMM did not reach a point in time.
    #[error("timed out waiting for {what} ({tail})")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The VMM's last output.
        tail: String,
    },
    /// The guest did not continue where it stopped.
    #[error("the guest restarted instead of continuing: last count {last_old}, then {first_new}")]
    NotContinued {
        /// The old VMM's last count.
        last_old: u64,
        /// The new VMM's first.
        first_new: u64,
    },
}

/// The guest workload of a measurement.
#[derive(Debug, Clone)]
pub struct Workload {
    /// `counter=` period.
    pub period: Duration,
    /// Pages dirtied per second (0: no dirty workload).
    pub dirty_rate: u64,
    /// Working set of the dirty workload, MiB.
    pub working_set_mib: u64,
}

impl Workload {
    /// The guest command line.
    pub fn cmdline(&self) -> String {
        let mut c = format!("counter={}", self.period.as_millis());
        if self.dirty_rate > 0 {
            c.push_str(&format!(
                " dirty={},{}",
                self.dirty_rate, self.working_set_mib
            ));
        }
        c
    }
}

/// What the bench needs to start VMMs.
#[derive(Debug, Clone)]
pub struct Env {
    /// The test guest ELF.
    pub kernel: PathBuf,
    /// The kemari binary.
    pub kemari: PathBuf,
    /// The QEMU binary.
    pub qemu: String,
    /// Where scratch directories go (a disk file system: snapshots land there).
    pub work_dir: PathBuf,
    /// `--log-level` for kemari (its log is printed with `verbose`).
    pub kemari_log: String,
    /// Print each VMM's log after each measurement.
    pub verbose: bool,
}

/// One measurement.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Guest-visible downtime.
    pub downtime: Duration,
    /// Request issued to the VM running in its new VMM.
    pub total: Duration,
    /// Dirty pages/s the guest reported last before the operation.
    pub dirty_seen: Option<u64>,
    /// The VMM's own downtime figure, when it reports one (ms).
    pub reported_downtime_ms: Option<f64>,
}

/// The operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
pub enum Op {
    /// kemari: stop the VMM, boot a fresh one (the counter restarts).
    Reboot,
    /// kemari: `snapshot --exit` to disk, then `kemari --restore`.
    Snapshot,
    /// kemari: warm restart (memory kept in /dev/shm), then `kemari --restore`.
    Warm,
    /// kemari: zero-copy local migration.
    ZeroCopy,
    /// QEMU: stop, `migrate` to a file, quit, new QEMU with `-incoming`.
    QemuFile,
    /// QEMU: the same with shared memory and `x-ignore-shared` (memory stays
    /// in /dev/shm: QEMU 7.2's closest warm restart).
    QemuWarm,
    /// QEMU: local live migration over a Unix socket with `x-ignore-shared`.
    QemuLocal,
    /// QEMU: local live migration over a Unix socket, memory copied (what
    /// zero-copy migration replaces).
    QemuLocalCopy,
}

impl Op {
    /// Every operation, in table order.
    pub const ALL: [Op; 8] = [
        Op::Reboot,
        Op::Snapshot,
        Op::Warm,
        Op::ZeroCopy,
        Op::QemuFile,
        Op::QemuWarm,
        Op::QemuLocal,
        Op::QemuLocalCopy,
    ];

    /// Table label.
    pub fn label(self) -> &'static str {
        match self {
            Op::Reboot => "kemari cold reboot",
            Op::Snapshot => "kemari snapshot+restore",
            Op::Warm => "kemari warm restart",
            Op::ZeroCopy => "kemari zero-copy migration",
            Op::QemuFile => "qemu migrate-to-file+restore",
            Op::QemuWarm => "qemu x-ignore-shared file+restore",
            Op::QemuLocal => "qemu local migration",
            Op::QemuLocalCopy => "qemu local migration (copy, unix:)",
        }
    }

    /// Whether the operation is measured under several dirty rates.
    pub fn takes_dirty_rates(self) -> bool {
        matches!(self, Op::ZeroCopy | Op::QemuLocal | Op::QemuLocalCopy)
    }
}

/// Options of the QEMU local migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QemuLocalMode {
    /// Shared memory backend + `x-ignore-shared` on both sides.
    IgnoreShared,
    /// A plain migration over the Unix socket (the fallback).
    Plain,
}

fn spawn(what: &str, cmd: Command) -> Result<Vmm, OpError> {
    Vmm::spawn(what, cmd).map_err(|source| OpError::Spawn {
        what: what.to_owned(),
        source,
    })
}

fn api(
    socket: &Path,
    call: &'static str,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> Result<serde_json::Value, OpError> {
    request(socket, method, path, body.as_ref()).map_err(|source| OpError::Api { call, source })
}

fn timeout(what: &str, vmm: &Vmm) -> OpError {
    OpError::Timeout {
        what: what.to_owned(),
        tail: vmm.tail(),
    }
}

/// Waits for the guest's steady state: some counter lines and, with a dirty
/// workload, its first rate report (the workload has run a full second).
fn wait_steady(vmm: &Vmm, w: &Workload) -> Result<Option<u64>, OpError> {
    let need_dirty = w.dirty_rate > 0;
    let got = vmm.console.wait_for(STEP, |lines: &[Line]| {
        let counters = lines
            .iter()
            .filter(|l| console::parse_counter(&l.text).is_some())
            .count();
        let dirty = last_dirty_rate(lines);
        (counters >= 10 && (!need_dirty || dirty.is_some())).then_some(dirty)
    });
    got.ok_or_else(|| timeout("the guest's steady state", vmm))
}

/// Waits until `vmm` has printed `n` more counter lines: lets the machine
/// settle after a destination VMM started, so its start does not overlap the
/// measurement.
fn wait_more_counters(vmm: &Vmm, n: usize) -> Result<(), OpError> {
    let count = |lines: &[Line]| {
        lines
            .iter()
            .filter(|l| console::parse_counter(&l.text).is_some())
            .count()
    };
    let have = count(&vmm.console.lines());
    vmm.console
        .wait_for(STEP, |lines: &[Line]| {
            (count(lines) >= have + n).then_some(())
        })
        .ok_or_else(|| timeout("counter lines after the destination started", vmm))
}

/// The rate of the last `dirty: rate=<n> ...` report.
fn last_dirty_rate(lines: &[Line]) -> Option<u64> {
    lines.iter().rev().find_map(|l| {
        l.text
            .strip_prefix("dirty: rate=")?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// Waits for the new VMM's first counter line at or after `since`; returns
/// its arrival time.
fn wait_first_counter(vmm: &Vmm, since: Instant) -> Result<Instant, OpError> {
    vmm.console
        .wait_for(STEP, |lines: &[Line]| {
            console::first_counter_after(lines, since).map(|(t, _)| t)
        })
        .ok_or_else(|| timeout("the first counter line of the new VMM", vmm))
}

fn wait_exit(vmm: &mut Vmm) -> Result<(), OpError> {
    vmm.wait_exit(STEP)
        .map(|_| ())
        .ok_or_else(|| timeout("the old VMM to exit", vmm))
}

fn outage(old: &Vmm, new: &Vmm, since: Instant, w: &Workload) -> Result<Outage, OpError> {
    console::outage(&old.console.lines(), &new.console.lines(), since, w.period)
        .ok_or_else(|| timeout("counter lines on both sides", new))
}

fn continued(o: &Outage) -> Result<(), OpError> {
    if o.continued() {
        Ok(())
    } else {
        Err(OpError::NotContinued {
            last_old: o.last_old,
            first_new: o.first_new,
        })
    }
}

fn show_logs(env: &Env, vmms: &[&Vmm]) {
    if !env.verbose {
        return;
    }
    for v in vmms {
        for l in v.log.lines() {
            eprintln!("    [{}] {}", v.name, l.text);
        }
    }
}

// ---------------------------------------------------------------- kemari

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
    let memfile = (op == Op::Warm).then(|| scratch.shm_file("mem"));
    let mut src = spawn(
        "source kemari",
        kemari_boot(env, mem, w, &api1, memfile.as_deref()),
    )?;
    let dirty_seen = wait_steady(&src, w)?;
    let mut reported = None;
    // A migration destination is ready before the clock starts.
    let incoming = scratch.path("incoming.sock");
    let mut pre_dst = None;
    if op == Op::ZeroCopy {
        let d = spawn(
            "destination kemari",
            kemari_new(env, "--incoming-local", &incoming, &api2),
        )?;
        if !wait_path(&incoming, STEP) {
            return Err(timeout("the destination's socket", &d));
        }
        pre_dst = Some(d);
        wait_more_counters(&src, 3)?;
    }
    let t0 = Instant::now();
    let mut t_done = t0;
    let dst = match op {
        Op::Reboot => {
            api(&api1, "shutdown", "PUT", "/vm/shutdown", None)?;
            wait_exit(&mut src)?;
            spawn("rebooted kemari", kemari_boot(env, mem, w, &api2, None))?
        }
        Op::Snapshot | Op::Warm => {
            let dir = scratch.path("state");
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
            wait_exit(&mut src)?;
            spawn("restored kemari", kemari_new(env, "--restore", &dir, &api2))?
        }
        Op::ZeroCopy => {
            let r = api(
                &api1,
                "migrate-local",
                "PUT",
                "/vm/migrate-local",
                Some(json!({ "socket": incoming })),
            )?;
            t_done = Instant::now();
            reported = r["downtime_ms"].as_f64();
            wait_exit(&mut src)?;
            match pre_dst.take() {
                Some(d) => d,
                None => return Err(timeout("a destination", &src)),
            }
        }
        _ => unreachable_op(op),
    };
    let t_first = wait_first_counter(&dst, t0)?;
    let o = outage(&src, &dst, t0, w)?;
    if op != Op::Reboot {
        continued(&o)?;
    }
    show_logs(env, &[&src, &dst]);
    Ok(Sample {
        downtime: o.downtime,
        total: t_first.max(t_done) - t0,
        dirty_seen,
        reported_downtime_ms: reported,
    })
}

fn unreachable_op(op: Op) -> ! {
    // The callers dispatch kemari and QEMU operations separately.
    panic!("operation {op:?} dispatched to the wrong runner")
}

// ---------------------------------------------------------------- QEMU

/// The QEMU migration bandwidth limit we set: effectively none (QEMU 7.2's
/// default is 32 MiB/s, which would measure the limit, not QEMU).
const QEMU_MAX_BANDWIDTH: u64 = 100 << 30;

struct QemuSpec<'a> {
    mem: &'a str,
    w: &'a Workload,
    qmp: &'a Path,
    shared: Option<&'a Path>,
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
    }
    c.args(["-accel", "kvm", "-M", &machine, "-cpu", "host", "-m", s.mem])
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
        Op::QemuWarm => Some(scratch.shm_file("qemu-mem")),
        Op::QemuLocal if local_mode == QemuLocalMode::IgnoreShared => {
            Some(scratch.shm_file("qemu-mem"))
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
                shared: shared.as_deref(),
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
    // The local-migration destination is ready before the clock starts.
    let mut pre_dst = None;
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
        pre_dst = Some(d);
        wait_more_counters(&src, 3)?;
    }
    let t0 = Instant::now();
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
            q1.quit()?;
            wait_exit(&mut src)?;
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
            wait_loaded(&mut q2, &dst)?;
            q2.execute("cont", None)?;
            (dst, t0, st)
        }
        Op::QemuLocal | Op::QemuLocalCopy => {
            q1.execute("migrate", Some(json!({ "uri": unix_uri })))?;
            let st = q1.wait_migration(POLL, STEP)?;
            let t_done = Instant::now();
            q1.quit()?;
            wait_exit(&mut src)?;
            match pre_dst.take() {
                Some(d) => (d, t_done, st),
                None => return Err(timeout("a destination", &src)),
            }
        }
        _ => unreachable_op(op),
    };
    let t_first = wait_first_counter(&dst, t0)?;
    let o = outage(&src, &dst, t0, w)?;
    continued(&o)?;
    show_logs(env, &[&src, &dst]);
    Ok(Sample {
        downtime: o.downtime,
        total: t_first.max(t_done) - t0,
        dirty_seen,
        reported_downtime_ms: st.downtime_ms.map(|d| d as f64),
    })
}
