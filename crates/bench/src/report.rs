//! `--json FILE|-`: a bench's results in a machine-readable file, the input of
//! `scripts/bench-report` (docs/benchmarks.md).
//!
//! Every file has the same envelope — `schema`, `bench`, the command line,
//! start and end dates, facts about the host (CPUs, kernel, KVM module, load
//! average before and after), the bench's parameters, its raw samples (`runs`:
//! one object per measurement) and the tables it printed (`tables`: a title,
//! column names and rows) plus `notes` (goal lines, the host's floor). With
//! `-` the JSON goes to standard output and the text the bench prints goes to
//! standard error instead.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::time::SystemTime;

use serde_json::{json, Map, Value};

/// The envelope's version: bump it when a field changes meaning.
pub const SCHEMA: u32 = 1;

/// Why the JSON could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The output file.
    #[error("cannot write the JSON results to {path}: {source}")]
    File {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Standard output could not be set aside for the JSON.
    #[error("cannot set standard output aside for the JSON results: {0}")]
    Stdout(#[source] std::io::Error),
}

/// A table as the bench printed it: numbers stay numbers, text stays text.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    /// What the table shows, with its unit.
    pub title: String,
    /// Column names.
    pub columns: Vec<String>,
    /// One row per line of the printed table, as many cells as columns.
    pub rows: Vec<Vec<Value>>,
}

impl Table {
    /// An empty table.
    pub fn new(title: impl Into<String>, columns: &[&str]) -> Self {
        Table {
            title: title.into(),
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<Value>) {
        self.rows.push(cells);
    }

    fn to_json(&self) -> Value {
        json!({ "title": self.title, "columns": self.columns, "rows": self.rows })
    }
}

/// The results of one bench invocation.
#[derive(Debug)]
pub struct Report {
    bench: String,
    command: Vec<String>,
    started: SystemTime,
    host: Value,
    params: Map<String, Value>,
    runs: Vec<Value>,
    tables: Vec<Table>,
    notes: Vec<String>,
}

impl Report {
    /// A report for `bench`, started now with this process's arguments.
    pub fn new(bench: &str) -> Self {
        Report {
            bench: bench.to_owned(),
            command: std::env::args().collect(),
            started: SystemTime::now(),
            host: host_facts(),
            params: Map::new(),
            runs: Vec::new(),
            tables: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// Records a parameter of the run (memory sizes, rounds, ...).
    pub fn param(&mut self, key: &str, value: impl Into<Value>) {
        self.params.insert(key.to_owned(), value.into());
    }

    /// Records one raw measurement.
    pub fn run(&mut self, sample: Value) {
        self.runs.push(sample);
    }

    /// Records a summary table.
    pub fn table(&mut self, table: Table) {
        self.tables.push(table);
    }

    /// Records a line of the summary that is not a table (a goal, a floor).
    pub fn note(&mut self, line: impl Into<String>) {
        self.notes.push(line.into());
    }

    /// The raw measurements recorded so far.
    pub fn runs(&self) -> &[Value] {
        &self.runs
    }

    /// The tables recorded so far.
    pub fn tables(&self) -> &[Table] {
        &self.tables
    }

    /// The whole document, ended now.
    pub fn to_json(&self) -> Value {
        let mut host = self.host.clone();
        host["loadavg_end"] = loadavg();
        json!({
            "schema": SCHEMA,
            "bench": self.bench,
            "command": self.command.join(" "),
            "argv": self.command,
            "version": env!("CARGO_PKG_VERSION"),
            "git_commit": git_commit(),
            "started": rfc3339(self.started),
            "finished": rfc3339(SystemTime::now()),
            "host": host,
            "params": self.params,
            "runs": self.runs,
            "tables": self.tables.iter().map(Table::to_json).collect::<Vec<_>>(),
            "notes": self.notes,
        })
    }
}

/// Where `--json` sends the document.
#[derive(Debug)]
pub enum Sink {
    /// No `--json`.
    None,
    /// A file.
    File(PathBuf),
    /// The original standard output, set aside (fd 1 now goes to stderr).
    Stdout(OwnedFd),
}

impl Sink {
    /// Opens the sink for `--json ARG`; with `-`, points fd 1 at standard
    /// error so that the bench's text does not mix with the JSON.
    pub fn open(arg: Option<&str>) -> Result<Sink, ReportError> {
        match arg {
            None => Ok(Sink::None),
            Some("-") => {
                let out = std::io::stdout();
                let saved = out
                    .as_fd()
                    .try_clone_to_owned()
                    .map_err(ReportError::Stdout)?;
                let err = std::io::stderr();
                // SAFETY: dup2 on two fds this process holds open (0-2 are
                // the process's own); it closes fd 1 and makes it a copy of
                // fd 2, which no Rust object owns exclusively.
                let rc = unsafe { libc::dup2(err.as_fd().as_raw_fd(), out.as_fd().as_raw_fd()) };
                if rc < 0 {
                    return Err(ReportError::Stdout(std::io::Error::last_os_error()));
                }
                Ok(Sink::Stdout(saved))
            }
            Some(path) => Ok(Sink::File(PathBuf::from(path))),
        }
    }

    /// Writes `report` (pretty-printed, one trailing newline).
    pub fn write(self, report: &Report) -> Result<(), ReportError> {
        let mut text =
            serde_json::to_string_pretty(&report.to_json()).unwrap_or_else(|_| "{}".to_owned());
        text.push('\n');
        match self {
            Sink::None => Ok(()),
            Sink::File(path) => std::fs::write(&path, text).map_err(|source| ReportError::File {
                path: path.clone(),
                source,
            }),
            Sink::Stdout(fd) => {
                let _ = std::io::stdout().flush();
                File::from(fd)
                    .write_all(text.as_bytes())
                    .map_err(ReportError::Stdout)
            }
        }
    }
}

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

fn read_trim(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

/// The 1, 5 and 15 minute load averages.
fn loadavg() -> Value {
    read_trim("/proc/loadavg")
        .map(|s| {
            s.split_whitespace()
                .take(3)
                .filter_map(|v| v.parse::<f64>().ok())
                .collect::<Vec<_>>()
        })
        .map_or(Value::Null, Value::from)
}

fn git_commit() -> Value {
    std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=7"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map_or(Value::Null, |s| Value::from(s.trim()))
}

/// The KVM module behind /dev/kvm (`kvm_pvm`, `kvm_intel`, `kvm_amd`).
fn kvm_module() -> Value {
    ["kvm_pvm", "kvm_intel", "kvm_amd"]
        .into_iter()
        .find(|m| std::path::Path::new("/sys/module").join(m).exists())
        .map_or(Value::Null, Value::from)
}

fn host_facts() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned());
    let mem_kib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
    });
    json!({
        "hostname": read_trim("/proc/sys/kernel/hostname"),
        "kernel": read_trim("/proc/sys/kernel/osrelease"),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).ok(),
        "cpu_model": model,
        "memory_mib": mem_kib.map(|k| k / 1024),
        "kvm_module": kvm_module(),
        "loadavg_start": loadavg(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_envelope_has_every_field() {
        let mut r = Report::new("unit");
        r.param("runs", 3);
        r.run(json!({ "ms": 1.5 }));
        let mut t = Table::new("times, ms", &["size", "ms"]);
        t.row(vec!["256M".into(), 1.5.into()]);
        r.table(t);
        r.note("goal: met");
        let v = r.to_json();
        assert_eq!(v["schema"], SCHEMA);
        assert_eq!(v["bench"], "unit");
        assert!(v["command"].is_string());
        assert!(v["started"].as_str().unwrap().ends_with('Z'));
        assert!(v["host"]["cpus"].as_u64().unwrap() >= 1);
        assert!(v["host"]["kernel"].is_string());
        assert_eq!(v["params"]["runs"], 3);
        assert_eq!(v["runs"][0]["ms"], 1.5);
        assert_eq!(v["tables"][0]["columns"][1], "ms");
        assert_eq!(v["tables"][0]["rows"][0][0], "256M");
        assert_eq!(v["notes"][0], "goal: met");
    }

    #[test]
    fn a_file_sink_writes_parseable_json() {
        let path =
            std::env::temp_dir().join(format!("kemari-bench-report-{}.json", std::process::id()));
        let mut r = Report::new("unit");
        r.run(json!({ "x": 1 }));
        Sink::open(Some(path.to_str().unwrap()))
            .unwrap()
            .write(&r)
            .unwrap();
        let v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(v["runs"][0]["x"], 1);
    }
}
