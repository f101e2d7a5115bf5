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

use super::console::{self, Line, Outage};
use super::procs::Vmm;
use super::qmp::QmpError;
use ::kemari::api::client::{request_to_end as request, ClientError};

mod kemari;
pub(crate) use kemari::fill_in_use;
mod qemu;

pub use kemari::run_kemari;
pub use qemu::run_qemu;

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
    /// The guest's dirty workload found a page without its last write.
    #[error("the guest found a page that lost a write ({vmm}): {line}")]
    LostWrite {
        /// Which VMM's console reported it.
        vmm: String,
        /// The guest's report.
        line: String,
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
    /// kemari reboot/snapshot/warm restart: start the new VMM as soon as the
    /// old one has answered (state saved), not after it has exited. Shows
    /// what the old process's exit costs. Safe with TAPs after a snapshot
    /// with exit or a warm restart (released before the answer), not after
    /// a shutdown (held until the exit).
    pub overlap_exit: bool,
    /// MiB of "application data" written into the top of the source's
    /// memory file before a zero-copy or pre-copy run (0: none).
    pub in_use_mib: u64,
    /// Pre-copy on an authenticated but unencrypted link (both ends
    /// `--plaintext-link`): what the encryption costs.
    pub plaintext_link: bool,
}

/// One measurement.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// Guest-visible downtime.
    pub downtime: Duration,
    /// What `downtime` can tell apart (see `console::Outage::resolution`).
    pub resolution: Duration,
    /// Request issued to the VM running in its new VMM.
    pub total: Duration,
    /// Dirty pages/s the guest reported last before the operation.
    pub dirty_seen: Option<u64>,
    /// The pause fell while the guest printed a line (see
    /// `console::Outage::mid_line`).
    pub mid_line: bool,
    /// The VMM's own downtime figure, when it reports one (ms).
    pub reported_downtime_ms: Option<f64>,
    /// Bytes a migration sent, as the VMM reports them (kemari: `bytes_sent`,
    /// QEMU: `query-migrate` `ram.transferred`).
    pub bytes: Option<u64>,
    /// When each step ended, from the request (printed with `--verbose`).
    pub phases: Vec<(&'static str, Duration)>,
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
    /// kemari: warm restart into a successor started and prepared before it
    /// (`kemari --restore DIR --await-state`).
    WarmPrepared,
    /// kemari: zero-copy local migration (memory in a /dev/shm file, the destination built around it before the clock starts, as QEMU's x-ignore-shared destination is).
    ZeroCopy,
    /// kemari: pre-copy live migration over TCP (loopback), memory copied.
    Precopy,
    /// QEMU: stop, `migrate` to a file, quit, new QEMU with `-incoming`.
    QemuFile,
    /// QEMU: the same with shared memory and `x-ignore-shared` (memory stays
    /// in /dev/shm: QEMU 7.2's closest warm restart).
    QemuWarm,
    /// QEMU: the same, with the new QEMU started before (`-incoming defer`
    /// on the same memory file) and the old one's exit not waited for.
    QemuWarmPrepared,
    /// QEMU: local live migration over a Unix socket with `x-ignore-shared`.
    QemuLocal,
    /// QEMU: local live migration over a Unix socket, memory copied (what
    /// zero-copy migration replaces).
    QemuLocalCopy,
}

impl Op {
    /// Every operation, in table order.
    pub const ALL: [Op; 11] = [
        Op::Reboot,
        Op::Snapshot,
        Op::Warm,
        Op::WarmPrepared,
        Op::ZeroCopy,
        Op::Precopy,
        Op::QemuFile,
        Op::QemuWarm,
        Op::QemuWarmPrepared,
        Op::QemuLocal,
        Op::QemuLocalCopy,
    ];

    /// Table label.
    pub fn label(self) -> &'static str {
        match self {
            Op::Reboot => "kemari cold reboot",
            Op::Snapshot => "kemari snapshot+restore",
            Op::Warm => "kemari warm restart",
            Op::WarmPrepared => "kemari warm restart, successor prepared",
            Op::ZeroCopy => "kemari zero-copy migration",
            Op::Precopy => "kemari TCP pre-copy migration",
            Op::QemuFile => "qemu migrate-to-file+restore",
            Op::QemuWarm => "qemu x-ignore-shared file+restore",
            Op::QemuWarmPrepared => "qemu x-ignore-shared file, new pre-started",
            Op::QemuLocal => "qemu local migration",
            Op::QemuLocalCopy => "qemu local migration (copy, unix:)",
        }
    }

    /// Whether the operation is measured under several dirty rates.
    pub fn takes_dirty_rates(self) -> bool {
        matches!(
            self,
            Op::ZeroCopy | Op::Precopy | Op::QemuLocal | Op::QemuLocalCopy
        )
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

/// Sleeps a random part of the guest's counter period. Every wait before a
/// request ends when a counter line arrives, so without this each request
/// would come at the same point of the guest's print cycle, and so would the
/// pause (an idle guest then always resumed right into its next line, on
/// cold shadow page tables). Both VMMs' requests go through here.
fn at_random_phase(w: &Workload) {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    std::thread::sleep(phase(w.period, seed));
}

/// A point in `[0, period)` picked by `seed` (splitmix64: the clock's low
/// bits alone do not spread evenly).
fn phase(period: Duration, seed: u64) -> Duration {
    let period = period.as_nanos().clamp(1, u128::from(u64::MAX)) as u64;
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    Duration::from_nanos(z % period)
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

/// Lets the new VMM print [`console::SHIFT_LINES`] counter lines after
/// `since` (10 ms at the default period), so that a late first line is not
/// taken for a clock that stood still; goes on with fewer after a while.
fn wait_lines_after(vmm: &Vmm, since: Instant) {
    let enough = |lines: &[Line]| {
        (lines
            .iter()
            .filter(|l| l.at >= since && console::parse_counter(&l.text).is_some())
            .count()
            >= console::SHIFT_LINES)
            .then_some(())
    };
    let _ = vmm.console.wait_for(Duration::from_secs(1), enough);
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

/// The guest's self-checking dirty workload (docs/test-guest.md) reported
/// no lost write on either console, as far as they go.
fn no_lost_writes(vmms: &[&Vmm]) -> Result<(), OpError> {
    for v in vmms {
        if let Some(l) = v
            .console
            .lines()
            .into_iter()
            .find(|l| l.text.starts_with("dirty: lost write"))
        {
            return Err(OpError::LostWrite {
                vmm: v.name.clone(),
                line: l.text,
            });
        }
    }
    Ok(())
}

fn show_logs(env: &Env, vmms: &[&Vmm]) {
    if !env.verbose {
        return;
    }
    // The guest's own account of the move: its last lines on the old VMM,
    // its first on the new one (their gap_us and how late the first came).
    // Host arrival times are relative to the old console's last line: with
    // uptime_us they show whether the guest's clock ran with the host's.
    if let [old, new, ..] = vmms {
        let old_lines = old.console.lines();
        let skip = old_lines.len().saturating_sub(2);
        let Some(base) = old_lines.last().map(|l| l.at) else {
            return;
        };
        let rel = |at: std::time::Instant| {
            if at >= base {
                (at - base).as_micros() as i64
            } else {
                -((base - at).as_micros() as i64)
            }
        };
        for l in &old_lines[skip..] {
            eprintln!(
                "    [{} console, host {:+} us] {}",
                old.name,
                rel(l.at),
                l.text
            );
        }
        for l in new.console.lines().iter().take(3) {
            eprintln!(
                "    [{} console, host {:+} us] {}",
                new.name,
                rel(l.at),
                l.text
            );
        }
    }
    for v in vmms {
        for l in v.log.lines() {
            eprintln!("    [{}] {}", v.name, l.text);
        }
    }
}

fn unreachable_op(op: Op) -> ! {
    // The callers dispatch kemari and QEMU operations separately.
    panic!("operation {op:?} dispatched to the wrong runner")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_stay_within_the_period_and_cover_it() {
        let period = Duration::from_millis(2);
        let mut quarters = [0u32; 4];
        // Consecutive seeds, as nanosecond clock readings a few apart are.
        for seed in 1_000_000..1_000_400u64 {
            let p = phase(period, seed);
            assert!(p < period);
            quarters[(p.as_nanos() * 4 / period.as_nanos()) as usize] += 1;
        }
        assert!(quarters.iter().all(|&n| n > 60), "{quarters:?}");
    }
}
