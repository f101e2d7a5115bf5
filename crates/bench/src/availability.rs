//! `kemari-bench availability`: guest-visible downtime and total time of
//! kemari's whole-VM operations (cold reboot, snapshot/restore, warm restart,
//! zero-copy local migration) side by side with QEMU's closest equivalents,
//! at several memory sizes and guest dirty rates, in one run; then the ratios
//! issue 5 sets as goals.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use std::cell::RefCell;

use serde_json::json;

use super::ops::{self, Env, Op, OpError, QemuLocalMode, Sample, Workload};
use super::report::{Report, Table};

/// What to measure.
#[derive(Debug, Clone)]
pub struct Options {
    /// Processes and files.
    pub env: Env,
    /// Memory sizes (`256M`, `4G`, ...), smallest first.
    pub memory: Vec<String>,
    /// Dirty rates (pages/s; 0 = no dirty workload) for the migrations.
    pub rates: Vec<u64>,
    /// Operations.
    pub ops: Vec<Op>,
    /// Repetitions per cell (the median is shown).
    pub runs: usize,
    /// The guest's counter period.
    pub period: Duration,
    /// The dirty workload's working set, MiB.
    pub working_set_mib: u64,
}

/// Errors that stop the whole benchmark.
#[derive(Debug, thiserror::Error)]
pub enum AvailabilityError {
    /// Nothing to do.
    #[error("nothing to measure: {0}")]
    Empty(&'static str),
    /// Options that do not go together.
    #[error("{0}")]
    Usage(&'static str),
    /// A file the bench needs is missing.
    #[error("{what} not found at {path}")]
    Missing {
        /// What.
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// Every measurement failed.
    #[error("every measurement failed; the first: {0}")]
    AllFailed(#[source] OpError),
    /// The signal handlers could not be installed.
    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    /// SIGINT or SIGTERM: stopped after cleaning up.
    #[error("interrupted: every VMM, socket, /dev/shm file and snapshot it made is gone")]
    Interrupted,
}

/// One table cell: an operation at a memory size and dirty rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Cell {
    op: Op,
    rate: u64,
    mem: usize,
}

#[derive(Debug, Default)]
struct Results {
    samples: BTreeMap<Cell, Vec<Sample>>,
    failures: BTreeMap<Cell, Vec<String>>,
}

fn median_by(samples: &[Sample], f: impl Fn(&Sample) -> Duration) -> Option<Duration> {
    let mut v: Vec<Duration> = samples.iter().map(f).collect();
    v.sort();
    v.get(v.len().checked_sub(1)? / 2).copied()
}

fn median_f(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len().checked_sub(1)? / 2).copied()
}

impl Results {
    /// The median resolution of a cell's downtimes.
    fn resolution(&self, c: Cell) -> Option<Duration> {
        median_by(self.samples.get(&c)?, |s| s.resolution)
    }
    /// The coarser resolution of the cells compared (a cold reboot's counter
    /// restarts: one period).
    fn floor(&self, cells: &[Cell], period: Duration) -> Duration {
        cells
            .iter()
            .map(|&c| {
                if c.op == Op::Reboot {
                    period
                } else {
                    self.resolution(c).unwrap_or(period)
                }
            })
            .max()
            .unwrap_or(period)
    }
    fn downtime(&self, c: Cell) -> Option<Duration> {
        median_by(self.samples.get(&c)?, |s| s.downtime)
    }
    /// The median downtime of the runs whose pause fell inside a console
    /// line (`mid_line`) or between lines, and how many runs that was.
    fn downtime_where(&self, c: Cell, mid_line: bool) -> Option<(Duration, usize)> {
        let runs: Vec<Sample> = self
            .samples
            .get(&c)?
            .iter()
            .filter(|s| s.mid_line == mid_line)
            .cloned()
            .collect();
        Some((median_by(&runs, |s| s.downtime)?, runs.len()))
    }
    fn total(&self, c: Cell) -> Option<Duration> {
        median_by(self.samples.get(&c)?, |s| s.total)
    }
    fn reported(&self, c: Cell) -> Option<f64> {
        median_f(
            self.samples
                .get(&c)?
                .iter()
                .filter_map(|s| s.reported_downtime_ms)
                .collect(),
        )
    }
    fn bytes(&self, c: Cell) -> Option<u64> {
        let mut v: Vec<u64> = self
            .samples
            .get(&c)?
            .iter()
            .filter_map(|s| s.bytes)
            .collect();
        v.sort_unstable();
        v.get(v.len().checked_sub(1)? / 2).copied()
    }
    fn dirty_seen(&self, c: Cell) -> Option<u64> {
        self.samples
            .get(&c)?
            .iter()
            .filter_map(|s| s.dirty_seen)
            .min()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Runs the benchmark and prints its tables.
pub fn run(opts: &Options, report: &mut Report) -> Result<(), AvailabilityError> {
    if opts.memory.is_empty() || opts.ops.is_empty() {
        return Err(AvailabilityError::Empty("no memory size or operation"));
    }
    if opts.env.in_use_mib > 0
        && opts
            .ops
            .iter()
            .any(|op| !matches!(op, Op::ZeroCopy | Op::Precopy | Op::QemuLocalCopy))
    {
        return Err(AvailabilityError::Usage(
            "--in-use-mib fills the source's memory file: use it with --ops zero-copy,precopy,qemu-local-copy only",
        ));
    }
    if !opts.env.kernel.exists() {
        return Err(AvailabilityError::Missing {
            what: "the test guest",
            path: opts.env.kernel.clone(),
        });
    }
    let mut rates = opts.rates.clone();
    if rates.is_empty() {
        rates.push(0);
    }
    report.param("memory", opts.memory.clone());
    report.param("rates", rates.clone());
    report.param(
        "ops",
        opts.ops.iter().map(|o| o.label()).collect::<Vec<_>>(),
    );
    report.param("runs", opts.runs);
    report.param("period_ms", opts.period.as_millis() as u64);
    report.param("working_set_mib", opts.working_set_mib);
    report.param("in_use_mib", opts.env.in_use_mib);
    report.param("plaintext_link", opts.env.plaintext_link);
    let mut cells = Vec::new();
    for &op in &opts.ops {
        let op_rates: &[u64] = if op.takes_dirty_rates() { &rates } else { &[0] };
        for &rate in op_rates {
            for mem in 0..opts.memory.len() {
                cells.push(Cell { op, rate, mem });
            }
        }
    }
    let period_ms = opts.period.as_millis();
    println!(
        "availability: guest-visible downtime and total time of whole-VM operations \
         (median of {} run(s))",
        opts.runs
    );
    println!(
        "guest: {} with counter={period_ms} (+ dirty=<rate>,{} where a rate is given); \
         downtime resolution: {period_ms} ms",
        opts.env.kernel.display(),
        opts.working_set_mib
    );
    let mut results = Results::default();
    let mut local_mode = QemuLocalMode::IgnoreShared;
    let mut refused: Option<String> = None;
    let mut first_error = None;
    let mut seq = 0;
    // Ctrl-C reaches the child VMMs too (same process group) and ends the
    // measurement under way; the flag then stops the loop so that every drop
    // guard runs instead of the process dying with files left behind.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).map_err(AvailabilityError::Signals)?;
    }
    // Interleave the cells run by run so that machine noise hits all alike.
    for run in 0..opts.runs {
        for &cell in &cells {
            if stop.load(Ordering::SeqCst) {
                return Err(AvailabilityError::Interrupted);
            }
            seq += 1;
            let mem = &opts.memory[cell.mem];
            let w = Workload {
                period: opts.period,
                dirty_rate: cell.rate,
                working_set_mib: opts.working_set_mib,
            };
            // Let the last run's processes finish dying (a kemari's reaper
            // destroys its KVM VM for ~15 ms after the process is gone) so
            // that their teardown does not land in this run's pause.
            std::thread::sleep(SETTLE);
            let mut attempt = measure(&opts.env, cell.op, mem, &w, seq, local_mode);
            if let Err(OpError::IgnoreSharedRefused(msg)) = &attempt {
                if cell.op == Op::QemuLocal {
                    eprintln!("  QEMU refused x-ignore-shared ({msg}): falling back to a plain unix: migration");
                    refused = Some(msg.clone());
                    local_mode = QemuLocalMode::Plain;
                    attempt = measure(&opts.env, cell.op, mem, &w, seq, local_mode);
                }
            }
            let mut raw = json!({
                "run": run,
                "op": op_id(cell.op),
                "operation": label(cell.op, local_mode),
                "memory": mem,
                "dirty_rate": cell.rate,
            });
            match &attempt {
                Ok(s) => {
                    raw["downtime_ms"] = ms(s.downtime).into();
                    raw["resolution_ms"] = ms(s.resolution).into();
                    raw["total_ms"] = ms(s.total).into();
                    raw["mid_line"] = s.mid_line.into();
                    raw["reported_downtime_ms"] = s.reported_downtime_ms.into();
                    raw["bytes"] = s.bytes.into();
                    raw["dirty_seen"] = s.dirty_seen.into();
                    raw["phases_ms"] = s
                        .phases
                        .iter()
                        .map(|(n, d)| json!([n, ms(*d)]))
                        .collect::<Vec<_>>()
                        .into();
                }
                Err(e) => raw["error"] = e.to_string().into(),
            }
            report.run(raw);
            match attempt {
                Ok(s) => {
                    eprintln!(
                        "  run {} {:<34} {:>5} dirty={:<6} downtime {:>8.2} ms (resolution {:.2})  total {:>8.1} ms{}",
                        run + 1,
                        cell.op.label(),
                        mem,
                        cell.rate,
                        ms(s.downtime),
                        ms(s.resolution),
                        ms(s.total),
                        if s.mid_line { "  (mid-line)" } else { "" }
                    );
                    if opts.env.verbose {
                        let steps: Vec<String> = s
                            .phases
                            .iter()
                            .map(|(n, d)| format!("{n} {:.1}", ms(*d)))
                            .collect();
                        eprintln!("    steps (ms from the request): {}", steps.join(", "));
                    }
                    results.samples.entry(cell).or_default().push(s);
                }
                Err(e) => {
                    eprintln!(
                        "  run {} {:<34} {:>5} dirty={:<6} FAILED: {e}",
                        run + 1,
                        cell.op.label(),
                        mem,
                        cell.rate
                    );
                    results
                        .failures
                        .entry(cell)
                        .or_default()
                        .push(e.to_string());
                    if first_error.is_none() {
                        first_error = Some(e);
                    }
                }
            }
        }
    }
    if results.samples.is_empty() {
        if let Some(e) = first_error {
            return Err(AvailabilityError::AllFailed(e));
        }
    }
    print_tables(opts, &rates, &results, local_mode, refused.as_deref());
    report.table(summary_table(opts, &rates, &results, local_mode));
    for line in print_goals(opts, &rates, &results, local_mode) {
        report.note(line);
    }
    Ok(())
}

/// The operation's name on the command line (`zero-copy`, `qemu-local-copy`).
fn op_id(op: Op) -> String {
    use clap::ValueEnum;
    op.to_possible_value()
        .map_or_else(|| format!("{op:?}"), |v| v.get_name().to_owned())
}

/// The medians of every cell, one row per cell (the `--json` summary).
fn summary_table(opts: &Options, rates: &[u64], r: &Results, local_mode: QemuLocalMode) -> Table {
    let mut t = Table::new(
        "whole-VM operations: guest-visible downtime and total time, ms (median)",
        &[
            "op",
            "operation",
            "dirty/s",
            "memory",
            "downtime",
            "total",
            "reported downtime",
            "MB sent",
            "runs",
            "failed",
        ],
    );
    for &op in &opts.ops {
        let op_rates: &[u64] = if op.takes_dirty_rates() { rates } else { &[0] };
        for &rate in op_rates {
            for (mem, name) in opts.memory.iter().enumerate() {
                let c = Cell { op, rate, mem };
                let n = r.samples.get(&c).map_or(0, Vec::len);
                let failed = r.failures.get(&c).map_or(0, Vec::len);
                if n == 0 && failed == 0 {
                    continue;
                }
                t.row(vec![
                    op_id(op).into(),
                    label(op, local_mode).into(),
                    rate.into(),
                    name.as_str().into(),
                    r.downtime(c).map(ms).into(),
                    r.total(c).map(ms).into(),
                    r.reported(c).into(),
                    r.bytes(c).map(|b| b as f64 / 1e6).into(),
                    n.into(),
                    failed.into(),
                ]);
            }
        }
    }
    t
}

/// Pause between two measurements.
const SETTLE: Duration = Duration::from_millis(100);

fn measure(
    env: &Env,
    op: Op,
    mem: &str,
    w: &Workload,
    seq: usize,
    local_mode: QemuLocalMode,
) -> Result<Sample, OpError> {
    match op {
        Op::Reboot | Op::Snapshot | Op::Warm | Op::WarmPrepared | Op::ZeroCopy | Op::Precopy => {
            ops::run_kemari(env, op, mem, w, seq)
        }
        Op::QemuFile | Op::QemuWarm | Op::QemuWarmPrepared | Op::QemuLocal => {
            ops::run_qemu(env, op, mem, w, seq, local_mode)
        }
        Op::QemuLocalCopy => ops::run_qemu(env, op, mem, w, seq, QemuLocalMode::Plain),
    }
}

fn label(op: Op, local_mode: QemuLocalMode) -> String {
    match (op, local_mode) {
        (Op::QemuLocal, QemuLocalMode::IgnoreShared) => {
            "qemu local migration (x-ignore-shared)".into()
        }
        (Op::QemuLocal, QemuLocalMode::Plain) => "qemu local migration (plain unix:)".into(),
        _ => op.label().into(),
    }
}

/// One row per operation and dirty rate, a column per memory size: `cell`
/// gives a cell's text ("-" where it gives none). Rows without any text are
/// left out unless `keep_empty`.
fn table_rows(
    opts: &Options,
    rates: &[u64],
    local_mode: QemuLocalMode,
    width: usize,
    keep_empty: bool,
    cell: &dyn Fn(Cell) -> Option<String>,
) -> Vec<String> {
    let mut rows = Vec::new();
    for &op in &opts.ops {
        let op_rates: &[u64] = if op.takes_dirty_rates() { rates } else { &[0] };
        for &rate in op_rates {
            let mut row = format!("{:<40} {:>7}", label(op, local_mode), rate);
            let mut any = false;
            for mem in 0..opts.memory.len() {
                let text = cell(Cell { op, rate, mem });
                any |= text.is_some();
                let text = text.unwrap_or_else(|| "-".into());
                row.push_str(&format!(" {text:>width$}"));
            }
            if any || keep_empty {
                rows.push(row);
            }
        }
    }
    rows
}

fn print_tables(
    opts: &Options,
    rates: &[u64],
    r: &Results,
    local_mode: QemuLocalMode,
    refused: Option<&str>,
) {
    println!();
    println!("downtime / total, ms (median)");
    let mut head = format!("{:<40} {:>7}", "operation", "dirty/s");
    for m in &opts.memory {
        head.push_str(&format!(" {:>19}", m));
    }
    println!("{head}");
    let rows = |width, keep_empty, cell: &dyn Fn(Cell) -> Option<String>| {
        table_rows(opts, rates, local_mode, width, keep_empty, cell)
    };
    let downtime_rows = rows(19, true, &|c| match (r.downtime(c), r.total(c)) {
        (Some(d), Some(t)) => Some(format!("{:.2} / {:.1}", ms(d), ms(t))),
        _ if r.failures.contains_key(&c) => Some("failed".into()),
        _ => None,
    });
    for row in downtime_rows {
        println!("{row}");
    }
    println!();
    println!("the VMM's own figures, ms (median): kemari snapshot/warm = paused until state saved; kemari zero-copy and warm with a prepared successor = paused until the new VMM restored; QEMU = query-migrate downtime");
    for row in rows(19, false, &|c| r.reported(c).map(|v| format!("{v:.1}"))) {
        println!("{row}");
    }
    println!();
    println!("downtime by where the pause fell, ms (median, runs): between two console lines | inside a line (the guest then resumes inside its emulated console code)");
    let by_mode = |c: Cell| {
        let part = |mid| match r.downtime_where(c, mid) {
            Some((d, n)) => format!("{:.2} ({n})", ms(d)),
            None => "-".into(),
        };
        Some(format!("{} | {}", part(false), part(true)))
    };
    for row in rows(25, true, &by_mode) {
        println!("{row}");
    }
    let bytes_rows = rows(19, false, &|c| {
        r.bytes(c).map(|b| format!("{:.1}", b as f64 / 1e6))
    });
    if !bytes_rows.is_empty() {
        println!();
        println!("bytes sent, MB (median): kemari = bytes_sent of its report (pages, markers, state); QEMU = query-migrate ram.transferred");
        for row in bytes_rows {
            println!("{row}");
        }
    }
    let mut seen = Vec::new();
    for (c, _) in r.samples.iter().filter(|(c, _)| c.rate > 0) {
        if let Some(d) = r.dirty_seen(*c) {
            seen.push(format!(
                "{} {}@{}: {d}",
                opts.memory[c.mem],
                c.rate,
                label(c.op, local_mode)
            ));
        }
    }
    if !seen.is_empty() {
        println!();
        println!(
            "dirty pages/s the guest reported just before the operation (lowest run): {}",
            seen.join("; ")
        );
    }
    if let Some(msg) = refused {
        println!();
        println!("QEMU refused x-ignore-shared: {msg}");
    }
    for (c, errs) in &r.failures {
        println!(
            "failed: {} {} dirty={}: {}",
            label(c.op, local_mode),
            opts.memory[c.mem],
            c.rate,
            errs.join("; ")
        );
    }
}

/// `num / den` as text; values under the resolution count as the resolution
/// and the ratio is then a bound.
fn ratio(num: Option<Duration>, den: Option<Duration>, floor: Duration) -> String {
    match (num, den) {
        (Some(n), Some(d)) => {
            let (nf, df) = (n < floor, d < floor);
            let v = n.max(floor).as_secs_f64() / d.max(floor).as_secs_f64();
            match (nf, df) {
                (true, true) => "both below resolution".into(),
                (false, true) => format!(">= {v:.1}x"),
                (true, false) => format!("<= {v:.2}x"),
                (false, false) => format!("{v:.2}x"),
            }
        }
        _ => "n/a".into(),
    }
}

/// Whether a ratio text meets `goal` (a ratio at least `goal` if `at_least`,
/// else at most).
fn verdict(text: &str, goal: f64, at_least: bool) -> &'static str {
    let num = |s: &str| s.trim_end_matches('x').trim().parse::<f64>().ok();
    let (bound, v) = if let Some(r) = text.strip_prefix(">= ") {
        (Some(true), num(r))
    } else if let Some(r) = text.strip_prefix("<= ") {
        (Some(false), num(r))
    } else if text == "both below resolution" {
        return if at_least { "unknown" } else { "met" };
    } else {
        (None, num(text))
    };
    let Some(v) = v else { return "n/a" };
    let met = if at_least { v >= goal } else { v <= goal };
    // A bound on the goal's side can only show a success, one on the other
    // side only a miss.
    let goal_side = bound.map(|lower| lower == at_least);
    match (goal_side, met) {
        (None, true) | (Some(true), true) => "met",
        (None, false) | (Some(false), false) => "missed",
        (Some(_), _) => "unknown",
    }
}

fn print_goals(
    opts: &Options,
    rates: &[u64],
    r: &Results,
    local_mode: QemuLocalMode,
) -> Vec<String> {
    let goals = RefCell::new(Vec::new());
    // Prints a goal line and keeps it for the `--json` notes.
    let say = |text: String| {
        println!("  {text}");
        goals.borrow_mut().push(text);
    };
    let period = opts.period;
    let (small, large) = (0, opts.memory.len() - 1);
    let has = |op: Op| opts.ops.contains(&op);
    println!();
    println!(
        "goals (a downtime below the resolution of the cells compared, the 90th percentile of the \
         guest's loop stalls before the operation, counts as that: the ratio is then a bound)"
    );
    let line = |what: String,
                num: Option<Duration>,
                den: Option<Duration>,
                floor: Duration,
                goal: f64,
                at_least: bool| {
        let text = ratio(num, den, floor);
        let v = verdict(&text, goal, at_least);
        let cmp = if at_least { ">=" } else { "<=" };
        let figures = match (num, den) {
            (Some(n), Some(d)) => format!(" ({:.2} / {:.2} ms)", ms(n), ms(d)),
            _ => String::new(),
        };
        say(format!("{what}: {text}{figures}, goal {cmp} {goal}x: {v}"));
    };
    if large > small {
        let (ms_, ml) = (&opts.memory[small], &opts.memory[large]);
        for op in [Op::Warm, Op::WarmPrepared, Op::ZeroCopy] {
            if has(op) {
                let c = |mem| Cell { op, rate: 0, mem };
                line(
                    format!("{} downtime {ml} vs {ms_}", op.label()),
                    r.downtime(c(large)),
                    r.downtime(c(small)),
                    r.floor(&[c(large), c(small)], period),
                    1.5,
                    false,
                );
            }
        }
    }
    if has(Op::ZeroCopy) && rates.len() > 1 {
        for (mem, name) in opts.memory.iter().enumerate() {
            let cells: Vec<Cell> = rates
                .iter()
                .map(|&rate| Cell {
                    op: Op::ZeroCopy,
                    rate,
                    mem,
                })
                .collect();
            let d: Vec<Option<Duration>> = cells.iter().map(|&c| r.downtime(c)).collect();
            let max = d.iter().flatten().max().copied();
            let min = d.iter().flatten().min().copied();
            line(
                format!("zero-copy downtime, max/min over dirty rates {rates:?}, {name}"),
                max,
                min,
                r.floor(&cells, period),
                1.5,
                false,
            );
        }
    }
    if has(Op::ZeroCopy) && has(Op::Precopy) {
        for &rate in rates {
            for (mem, name) in opts.memory.iter().enumerate() {
                let c = |op| Cell { op, rate, mem };
                line(
                    format!("TCP pre-copy vs zero-copy: total, {name}, dirty {rate}/s"),
                    r.total(c(Op::Precopy)),
                    r.total(c(Op::ZeroCopy)),
                    Duration::from_micros(1),
                    20.0,
                    true,
                );
            }
        }
    }
    if has(Op::Precopy) && has(Op::QemuLocalCopy) {
        for &rate in rates {
            for (mem, name) in opts.memory.iter().enumerate() {
                let c = |op| Cell { op, rate, mem };
                line(
                    format!("kemari pre-copy vs qemu copying migration: downtime, {name}, dirty {rate}/s"),
                    r.downtime(c(Op::Precopy)),
                    r.downtime(c(Op::QemuLocalCopy)),
                    r.floor(&[c(Op::Precopy), c(Op::QemuLocalCopy)], period),
                    0.5,
                    false,
                );
                line(
                    format!(
                        "kemari pre-copy vs qemu copying migration: total, {name}, dirty {rate}/s"
                    ),
                    r.total(c(Op::Precopy)),
                    r.total(c(Op::QemuLocalCopy)),
                    Duration::from_micros(1),
                    1.0,
                    false,
                );
                let (kb, qb) = (r.bytes(c(Op::Precopy)), r.bytes(c(Op::QemuLocalCopy)));
                let text = match (kb, qb) {
                    (Some(k), Some(q)) if q > 0 => format!("{:.2}x", k as f64 / q as f64),
                    _ => "n/a".into(),
                };
                let figures = match (kb, qb) {
                    (Some(k), Some(q)) => {
                        format!(" ({:.1} / {:.1} MB)", k as f64 / 1e6, q as f64 / 1e6)
                    }
                    _ => String::new(),
                };
                say(format!(
                    "kemari pre-copy vs qemu copying migration: bytes, {name}, dirty {rate}/s: {text}{figures}, goal <= 1.1x: {}",
                    verdict(&text, 1.1, false)
                ));
            }
        }
    }
    let pairs = [
        (Op::Snapshot, Op::QemuFile),
        (Op::Warm, Op::QemuWarm),
        (Op::WarmPrepared, Op::QemuWarm),
        (Op::WarmPrepared, Op::QemuWarmPrepared),
        (Op::ZeroCopy, Op::QemuLocal),
        (Op::ZeroCopy, Op::QemuLocalCopy),
    ];
    for (k, q) in pairs {
        if !(has(k) && has(q)) {
            continue;
        }
        let k_rates: &[u64] = if k.takes_dirty_rates() { rates } else { &[0] };
        for &rate in k_rates {
            for (mem, name) in opts.memory.iter().enumerate() {
                let kc = Cell { op: k, rate, mem };
                let qc = Cell { op: q, rate, mem };
                let suffix = if k.takes_dirty_rates() {
                    format!("{name}, dirty {rate}/s")
                } else {
                    name.clone()
                };
                line(
                    format!(
                        "{} vs {}: downtime, {suffix}",
                        label(q, local_mode),
                        k.label()
                    ),
                    r.downtime(qc),
                    r.downtime(kc),
                    r.floor(&[qc, kc], period),
                    10.0,
                    true,
                );
                line(
                    format!("{} vs {}: total, {suffix}", label(q, local_mode), k.label()),
                    r.total(qc),
                    r.total(kc),
                    Duration::from_micros(1),
                    10.0,
                    true,
                );
            }
        }
    }
    goals.into_inner()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn ratios_respect_the_resolution() {
        let f = 5 * MS;
        assert_eq!(ratio(Some(30 * MS), Some(10 * MS), f), "3.00x");
        assert_eq!(ratio(Some(30 * MS), Some(MS), f), ">= 6.0x");
        assert_eq!(ratio(Some(MS), Some(20 * MS), f), "<= 0.25x");
        assert_eq!(ratio(Some(MS), Some(2 * MS), f), "both below resolution");
        assert_eq!(ratio(None, Some(MS), f), "n/a");
    }

    #[test]
    fn verdicts() {
        assert_eq!(verdict("1.20x", 1.5, false), "met");
        assert_eq!(verdict("2.00x", 1.5, false), "missed");
        assert_eq!(verdict(">= 12.0x", 10.0, true), "met");
        assert_eq!(verdict(">= 6.0x", 10.0, true), "unknown");
        assert_eq!(verdict("<= 0.25x", 1.5, false), "met");
        assert_eq!(verdict("both below resolution", 1.5, false), "met");
        assert_eq!(verdict("both below resolution", 10.0, true), "unknown");
        assert_eq!(verdict("n/a", 10.0, true), "n/a");
        assert_eq!(verdict("9.00x", 10.0, true), "missed");
    }

    #[test]
    fn medians() {
        let s = |d: u32| Sample {
            downtime: d * MS,
            resolution: MS,
            ..Sample::default()
        };
        assert_eq!(median_by(&[s(5), s(1), s(3)], |x| x.downtime), Some(3 * MS));
        assert_eq!(median_by(&[], |x| x.downtime), None);
        assert_eq!(median_f(vec![2.0, 1.0]), Some(1.0));
    }
}

/// The `kemari-bench availability` command line.
#[derive(Debug, clap::Args)]
pub struct AvailabilityArgs {
    /// The test guest ELF (`cargo build -p guest --target x86_64-unknown-none --release`).
    #[arg(long, default_value = "target/x86_64-unknown-none/release/guest")]
    pub kernel: PathBuf,
    /// Memory sizes, smallest first.
    #[arg(long, value_delimiter = ',', default_values = ["256M", "1G", "4G"])]
    pub memory: Vec<String>,
    /// Guest dirty rates (pages/s, 0 = none) for the migrations.
    #[arg(long, value_delimiter = ',', default_values_t = [0u64, 1000, 10000])]
    pub rates: Vec<u64>,
    /// Operations to measure (default: all).
    #[arg(long, value_delimiter = ',', value_enum)]
    pub ops: Vec<Op>,
    /// Runs per cell (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Quick run: 256M and 1G only, 1 run.
    #[arg(long)]
    pub quick: bool,
    /// The guest's counter period in ms (the downtime resolution).
    #[arg(long, default_value_t = 2)]
    pub period_ms: u64,
    /// Working set of the dirty workload, MiB.
    #[arg(long, default_value_t = 64)]
    pub working_set_mib: u64,
    /// Memory in use by the guest's applications, MiB: before each zero-copy,
    /// pre-copy or QEMU copying local migration run, the top of the source's
    /// memory (a /dev/shm file, for QEMU a shared memory backend migrated
    /// by copy) is filled with the same data, which a pre-copy must send and
    /// a zero-copy migration hands over (the test guest itself touches only
    /// ~70 MiB, at the bottom, and expects the rest zeroed: capped at
    /// memory − 192 MiB). Only with --ops zero-copy,precopy,qemu-local-copy.
    #[arg(long, default_value_t = 0)]
    pub in_use_mib: u64,
    /// Pre-copy on an authenticated but unencrypted link (`--plaintext-link`
    /// on both ends), to compare with the default encrypted one.
    #[arg(long)]
    pub plaintext_link: bool,
    /// Directory for scratch files (snapshots: use a disk, not tmpfs).
    #[arg(long, default_value = "/var/tmp")]
    pub work_dir: PathBuf,
    /// kemari's --log-level (with --verbose its log is printed: `debug` shows
    /// its set-up timing).
    #[arg(long, default_value = "warn")]
    pub kemari_log_level: String,
    /// Print every VMM's log after each measurement.
    #[arg(long)]
    pub verbose: bool,
    /// Start the new kemari as soon as the old one has saved the state,
    /// without waiting for its exit (reboot, snapshot, warm restart; the
    /// bench's guest has no TAP, and a rebooting kemari holds its TAPs until
    /// it exits): measures what the old process's exit costs.
    #[arg(long)]
    pub overlap_exit: bool,
    /// The kemari binary (default: next to this one).
    #[arg(long)]
    pub kemari: Option<PathBuf>,
    /// The QEMU binary.
    #[arg(long, default_value = "qemu-system-x86_64")]
    pub qemu: String,
}

impl AvailabilityArgs {
    /// The options these arguments select; `default_kemari` is used without
    /// `--kemari`.
    pub fn options(self, default_kemari: PathBuf) -> Options {
        let (memory, runs) = if self.quick {
            (vec!["256M".to_owned(), "1G".to_owned()], 1)
        } else {
            (self.memory, self.runs.max(1))
        };
        let ops = if self.ops.is_empty() {
            Op::ALL.to_vec()
        } else {
            self.ops
        };
        Options {
            env: Env {
                kernel: self.kernel,
                kemari: self.kemari.unwrap_or(default_kemari),
                qemu: self.qemu,
                work_dir: self.work_dir,
                kemari_log: self.kemari_log_level,
                verbose: self.verbose,
                overlap_exit: self.overlap_exit,
                in_use_mib: self.in_use_mib,
                plaintext_link: self.plaintext_link,
            },
            memory,
            rates: self.rates,
            ops,
            runs,
            period: Duration::from_millis(self.period_ms.max(1)),
            working_set_mib: self.working_set_mib.max(1),
        }
    }
}
