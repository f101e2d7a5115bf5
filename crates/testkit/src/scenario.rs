//! A guest under load for availability tests: the test guest counting,
//! writing flushed blocks and echoing TCP through a TAP, and the checks that it
//! went on across an operation.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use crate::bins::{guest_elf, kemari, kemarictl};
use crate::dirs::read_text;
use crate::net::{EchoChecker, TapNet};
use crate::procs::{run_with_timeout, wait_for, KillOnDrop};

/// One VM scenario at a time in a test binary: the guests poll, so side by
/// side on a small machine they would skew timing and rate checks, and the
/// scenarios reuse TAP subnets.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Numbers `n` of complete `counter: n ...` lines in a console file.
pub fn counters(console: &Path) -> Vec<u64> {
    read_text(console)
        .lines()
        .filter_map(|l| l.strip_prefix("counter: "))
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect()
}

/// Largest `acked=` (or `write done blocks=`) a console shows.
pub fn acked_blocks(console: &Path) -> u64 {
    read_text(console)
        .lines()
        .filter_map(|l| {
            l.strip_prefix("disk: acked=")
                .and_then(|r| r.split_whitespace().next()?.parse().ok())
                .or_else(|| {
                    l.strip_prefix("disk: write done blocks=")?
                        .trim()
                        .parse()
                        .ok()
                })
        })
        .max()
        .unwrap_or(0)
}

pub struct Vmm {
    pub child: KillOnDrop,
    pub console: PathBuf,
    pub api: PathBuf,
}

impl Vmm {
    /// If the VMM has exited: its status and what it wrote to stderr (for
    /// a test's failure message); None while it runs.
    pub fn exit_report(&mut self) -> Option<String> {
        let status = self.child.0.try_wait().ok().flatten()?;
        let mut err = String::new();
        if let Some(e) = self.child.0.stderr.as_mut() {
            let _ = std::io::Read::read_to_string(e, &mut err);
        }
        Some(format!("the VMM exited ({status}); its stderr:\n{err}"))
    }
}

pub fn spawn_vmm(args: &[String], console: &Path, api: &Path, env: &[(&str, &str)]) -> Vmm {
    let mut cmd = kemari();
    cmd.args(args)
        .arg("--serial")
        .arg(format!("file:{}", console.display()))
        .arg("--api-socket")
        .arg(api)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    Vmm {
        child: KillOnDrop(cmd.spawn().expect("spawn kemari")),
        console: console.to_path_buf(),
        api: api.to_path_buf(),
    }
}

pub fn ctl(api: &Path, args: &[&str]) -> std::process::Output {
    run_with_timeout(kemarictl(api).args(args), Duration::from_secs(60))
}

/// `warm-restart DIR --prepare` on `old`, then a successor on DIR, ready.
pub fn prepared_successor(old: &Vmm, state_dir: &Path, dir: &Path) -> Vmm {
    let out = ctl(
        &old.api,
        &["warm-restart", state_dir.to_str().unwrap(), "--prepare"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(state_dir.join("config.json").exists());
    let successor = spawn_vmm(
        &[
            "--restore".into(),
            state_dir.display().to_string(),
            "--await-state".into(),
        ],
        &dir.join("console-2.log"),
        &dir.join("api-2.sock"),
        &[],
    );
    wait_for("the successor's socket", Duration::from_secs(30), || {
        state_dir.join("successor.sock").exists()
    });
    successor
}

pub const BLOCKS: u64 = 3000;

/// The self-checking dirty workload every scenario guest runs: 2,048 pages
/// (8 MiB) rewritten once a second, each write checking that the page still
/// holds the previous pass's value (docs/test-guest.md).
pub const DIRTY: &str = "dirty=2000,8";

/// Boots the guest with counter + flushed sequential disk writes + network
/// (256 MiB, [`DIRTY`], on `net`); waits until it runs and its echo service
/// answers.
pub fn start_source(dir: &Path, net: &TapNet, disk: &Path, extra: &[String]) -> (Vmm, EchoChecker) {
    LoadedGuest {
        memory: "256M",
        ip: net.guest_ip(),
        tap: &net.name,
        dirty: DIRTY,
        disk,
        extra,
    }
    .start(dir)
}

/// The guest a scenario operates on: counting, writing [`BLOCKS`] flushed
/// blocks to `disk`, dirtying memory and echoing TCP at `ip` behind `tap`.
pub struct LoadedGuest<'a> {
    pub memory: &'a str,
    /// The guest's address, in a /24 with the host.
    pub ip: String,
    pub tap: &'a str,
    /// The dirty workload (`dirty=RATE,MIB`; [`DIRTY`] unless a test wants another).
    pub dirty: &'a str,
    pub disk: &'a Path,
    /// More kemari flags.
    pub extra: &'a [String],
}

impl LoadedGuest<'_> {
    /// Boots it with its console and API in `dir` (`console-1.log`,
    /// `api-1.sock`); returns once it runs mid-way through its disk job with
    /// its echo stream flowing.
    pub fn start(&self, dir: &Path) -> (Vmm, EchoChecker) {
        let mut args: Vec<String> = vec![
            "--kernel".into(),
            guest_elf().display().to_string(),
            "--memory".into(),
            self.memory.into(),
            "--cmdline".into(),
            format!(
                "counter=100 ip={}/24 disk=write,{BLOCKS},seq,flush {}",
                self.ip, self.dirty
            ),
            "--disk".into(),
            self.disk.display().to_string(),
            "--net".into(),
            format!("tap={}", self.tap),
        ];
        args.extend_from_slice(self.extra);
        let vmm = spawn_vmm(
            &args,
            &dir.join("console-1.log"),
            &dir.join("api-1.sock"),
            &[],
        );
        wait_for("guest network up", Duration::from_secs(30), || {
            read_text(&vmm.console).contains("net: up")
        });
        let echo = EchoChecker::start(&self.ip);
        // Operate mid-way through the disk job: some blocks acknowledged, more to come.
        wait_for(
            "echo traffic, counter and disk writes",
            Duration::from_secs(60),
            || {
                echo.verified() > 8192
                    && counters(&vmm.console).len() >= 3
                    && acked_blocks(&vmm.console) >= 1000
            },
        );
        (vmm, echo)
    }
}

/// `(ws_pages, total, bad)` of each report of the guest's dirty workload.
pub fn dirty_reports(console: &Path) -> Vec<(u64, u64, u64)> {
    read_text(console)
        .lines()
        .filter_map(|l| {
            let mut fields = l.strip_prefix("dirty: rate=")?.split(' ').skip(1);
            let mut field =
                |name: &str| -> Option<u64> { fields.next()?.strip_prefix(name)?.parse().ok() };
            Some((field("ws_pages=")?, field("total=")?, field("bad=")?))
        })
        .collect()
}

/// The dirty workload found every page as it left it, before and after the
/// operation: no write was lost or rolled back in moving the VM. The new
/// VMM's guest must have checked one whole pass after the operation, past
/// its first pass (which only finds zeros).
pub fn check_no_lost_writes(old: &Path, new: &Path) {
    wait_for(
        "the dirty workload to check its pages after the operation",
        Duration::from_secs(60),
        || {
            let r = dirty_reports(new);
            match (r.first(), r.last()) {
                (Some(&(ws, first, _)), Some(&(_, last, _))) => last >= first + ws && last > 2 * ws,
                _ => false,
            }
        },
    );
    for console in [old, new] {
        let text = read_text(console);
        let lost: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("dirty: lost write"))
            .collect();
        assert!(lost.is_empty(), "{}: {lost:?}", console.display());
        let reports = dirty_reports(console);
        assert!(
            reports.iter().all(|&(_, _, bad)| bad == 0),
            "{}: {reports:?}",
            console.display()
        );
    }
}

/// After an operation that moved the VM from `old` to `new`: the counter goes
/// on, the echo stream goes on, and every acknowledged block verifies.
pub fn check_continuity(old: &Path, new: &Vmm, echo: EchoChecker, disk: &Path) {
    check_continuity_blocks(old, new, echo, disk, BLOCKS)
}

/// [`check_continuity`] for a guest whose disk job writes `blocks` blocks.
pub fn check_continuity_blocks(old: &Path, new: &Vmm, echo: EchoChecker, disk: &Path, blocks: u64) {
    let before = counters(old);
    let last_old = *before.last().expect("the source printed counter lines");
    wait_for(
        "counter lines from the new VMM",
        Duration::from_secs(30),
        || counters(&new.console).len() >= 3,
    );
    let after = counters(&new.console);
    assert!(
        after[0] > 1 && after[0] <= last_old + 2,
        "counter restarted or jumped: source ended at {last_old}, new VMM began at {}",
        after[0]
    );
    assert!(
        after.windows(2).all(|w| w[1] == w[0] + 1),
        "counter not monotonic: {after:?}"
    );
    check_no_lost_writes(old, &new.console);
    let echoed = echo.verified();
    wait_for(
        "echo traffic after the operation",
        Duration::from_secs(30),
        || echo.verified() > echoed + 8192,
    );
    echo.finish();
    // The disk job started before the operation; it finishes before or after
    // it, depending on how fast this machine flushes.
    let done = format!("disk: write done blocks={blocks}");
    wait_for("the disk job to finish", Duration::from_secs(120), || {
        read_text(old).contains(&done) || read_text(&new.console).contains(&done)
    });
    let acked = acked_blocks(old).max(acked_blocks(&new.console));
    assert_eq!(acked, blocks);
    assert!(ctl(&new.api, &["shutdown"]).status.success());
    let out = run_with_timeout(
        kemari()
            .arg("--kernel")
            .arg(guest_elf())
            .args(["--memory", "256M", "--cmdline"])
            .arg(format!("disk=verify,{acked} poweroff=done"))
            .arg("--disk")
            .arg(disk),
        Duration::from_secs(60),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains(&format!("disk: verify ok blocks={acked}")),
        "acknowledged blocks lost: {text}"
    );
}

/// A `kemari-nbd serve` of a fresh 64 MiB image ([`disk_image`]) on a Unix
/// socket in `dir`, stopped when dropped.
pub struct NbdExport {
    _child: KillOnDrop,
    /// The exported image.
    pub disk: PathBuf,
    /// `nbd+unix:///vmdisk?socket=…`, as `--disk` takes it.
    pub url: String,
}

impl NbdExport {
    /// Stops the server (SIGSTOP): its connections stay open and nothing
    /// is answered, as with a server cut off the network.
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Lets a frozen server go on (SIGCONT).
    pub fn thaw(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill takes no memory; the pid is our child's, not reaped
        // before `self` is dropped.
        unsafe { libc::kill(self._child.0.id() as i32, sig) };
    }
}

pub fn serve_nbd(dir: &Path) -> NbdExport {
    let disk = disk_image(dir);
    let sock = dir.join("nbd.sock");
    let child =
        std::process::Command::new(crate::bins::built_debug_bin("kemari-nbd", "kemari-nbd"))
            .args(["serve", "--export"])
            .arg(format!("vmdisk={}", disk.display()))
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn kemari-nbd");
    let child = KillOnDrop(child);
    wait_for("the NBD server", Duration::from_secs(30), || sock.exists());
    NbdExport {
        _child: child,
        disk,
        url: format!("nbd+unix:///vmdisk?socket={}", sock.display()),
    }
}

pub fn disk_image(dir: &Path) -> PathBuf {
    let p = dir.join("disk.img");
    std::fs::File::create(&p)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    p
}
