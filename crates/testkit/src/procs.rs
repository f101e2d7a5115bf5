//! Child processes: killed on drop, run with a timeout, waited for; polling
//! for a condition; external tools.

use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// A child process killed on drop.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl KillOnDrop {
    /// SIGKILL, as in a crash.
    pub fn crash(self) {
        drop(self);
    }
}

/// Runs a command to completion with a timeout, killing it if it hangs.
pub fn run_with_timeout(cmd: &mut Command, timeout: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "command timed out after {timeout:?}; stdout: {} stderr: {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `cmd`, asserts it succeeded, returns its stdout.
pub fn run(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.output().expect("spawn tool");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// [`run`] for a shell script.
pub fn sh(script: &str) -> Vec<u8> {
    run(Command::new("sh").args(["-c", script]))
}

/// Whether `name` is installed. For an optional step of a test; a test that
/// needs the tool says so with the probe's `no_<name>` cfg instead.
pub fn tool(name: &str) -> bool {
    let ok = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIP: {name} is not installed");
    }
    ok
}

/// Waits until `cond` holds, polling; panics with `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits up to 30 s for `child` to exit; panics naming `what` otherwise.
pub fn wait_exit(child: &mut Child, what: &str) -> ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "{what} did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `cmd` with its stdout a pipe nobody reads (closed before the
/// command writes: `cmd | true`) and checks that it ends quietly: exit 0 or
/// killed by SIGPIPE, as coreutils end, never a panic, nothing on stderr.
pub fn assert_quiet_on_closed_stdout(cmd: &mut Command, what: &str) {
    use std::os::unix::process::ExitStatusExt;
    /// SIGPIPE's number on Linux.
    const SIGPIPE: i32 = 13;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    drop(child.stdout.take());
    let status = wait_exit(&mut child, what);
    let out = child.wait_with_output().expect("output");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        status.success() || status.signal() == Some(SIGPIPE),
        "{what} into a closed pipe: {status:?}: {err}"
    );
    assert_eq!(err, "", "{what} into a closed pipe wrote to stderr");
}

/// Runs `cmd`, which passes the log filter `verbose`, and checks that it is
/// refused as a command-line error (status 2) naming the filter and an example.
pub fn assert_verbose_log_filter_refused(cmd: &mut Command) {
    let out = cmd.output().expect("spawn");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("\"verbose\" is not a level"), "{err}");
    assert!(err.contains("e.g. --log-level info"), "{err}");
}

/// A thread of a process as `/proc/PID/task/TID/status` shows it: its name,
/// its seccomp mode (2: filtered) and how many filters it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadSeccomp {
    pub name: String,
    pub mode: u32,
    pub filters: u32,
}

/// The seccomp state of every thread of process `pid` (threads that end
/// while they are read are left out).
pub fn thread_seccomp(pid: u32) -> Vec<ThreadSeccomp> {
    let field = |status: &str, name: &str| -> Option<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
    };
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            let name = std::fs::read_to_string(dir.join("comm")).ok()?;
            Some(ThreadSeccomp {
                name: name.trim().to_owned(),
                mode: field(&status, "Seccomp:")?,
                filters: field(&status, "Seccomp_filters:").unwrap_or(0),
            })
        })
        .collect()
}

/// Asserts that every thread of `pid` is filtered, and that vCPU, device
/// and API threads have their own filter on top of the process's; returns
/// the threads.
pub fn assert_every_thread_filtered(pid: u32, what: &str) -> Vec<ThreadSeccomp> {
    let threads = thread_seccomp(pid);
    assert!(!threads.is_empty(), "{what}: no threads of {pid}");
    for t in &threads {
        assert_eq!(
            t.mode, 2,
            "{what}: thread {t:?} has no seccomp filter ({threads:?})"
        );
        let own = t.name.starts_with("vcpu") || t.name == "devices" || t.name == "api";
        if own {
            // The process's and its own: one filter more would be installed
            // twice, each install costing 0.2-0.3 ms and every call one
            // more program to pass.
            assert_eq!(
                t.filters, 2,
                "{what}: {t:?} lacks its own filter or has it twice ({threads:?})"
            );
        }
    }
    threads
}

/// A hand-over held at a fault-injection point (kemari's `fault-injection`
/// feature): the variables that set the hold, and the file its start
/// creates, so that a test acts once the hold begins instead of guessing
/// how long the hand-over takes to get there.
pub struct FaultHold {
    variable: &'static str,
    ms: String,
    reached: std::path::PathBuf,
    reached_text: String,
}

impl FaultHold {
    /// A hold of `ms` at the point `variable` names
    /// (`KEMARI_FAULT_HOLD_MIGRATE_IN_MS`, …), noted in `dir`.
    pub fn new(dir: &std::path::Path, variable: &'static str, ms: u64) -> Self {
        let reached = dir.join(format!("{variable}.reached"));
        let _ = std::fs::remove_file(&reached);
        FaultHold {
            variable,
            ms: ms.to_string(),
            reached_text: reached.display().to_string(),
            reached,
        }
    }

    /// The environment of the process that holds.
    pub fn env(&self) -> [(&str, &str); 2] {
        [
            (self.variable, &self.ms),
            // transfer::faults::REACHED_FILE (testkit depends on no kemari crate).
            ("KEMARI_FAULT_HOLD_REACHED_FILE", &self.reached_text),
        ]
    }

    /// Waits (a minute at most) until the hold has begun.
    pub fn wait_reached(&self) {
        wait_for(
            &format!("the hand-over to reach {}", self.variable),
            Duration::from_secs(60),
            || self.reached.exists(),
        );
    }
}
