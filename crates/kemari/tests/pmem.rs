//! virtio-pmem (`--pmem PATH`) end to end, with real kemari processes and
//! the test guest's `pmem=` workload (docs/test-guest.md). The window's
//! contents are generations in the self-checking format of
//! `guest::pmemfmt`, so the host and the guest check each other's writes
//! word by word:
//!
//! - a generation the host writes into the file is what the guest reads,
//!   every word of it; the generation the guest writes and flushes is what
//!   the host then reads from the file, while kemari still runs; the device
//!   is listed (`pmem0`, `virtio-pmem`) and counts the flush; fault
//!   tolerance is refused, saying why;
//! - one byte the host damages, deep in the window, is what the guest's
//!   check reports (the check is not blind);
//! - across in-place reboots (same process), each boot reads the generation
//!   the boot before it wrote: the window is the file, not RAM, which a
//!   reboot clears;
//! - across a warm restart, zero-copy migrations away and back, and a
//!   kill -9 followed by a restore of an earlier snapshot, every boot reads
//!   the generation written last, whichever VMM's guest wrote it;
//! - a file of a size kemari cannot map (not a multiple of 2 MiB, empty) or
//!   a missing one is refused at start with an error naming it.
//!
//! Bounds are generous (60 s): the machine is shared.

use std::path::{Path, PathBuf};
use std::time::Duration;

use guest::pmemfmt::{self, PmemState};
use kemari::api::client::request_with_timeout;
use kemari_testkit::scenario::*;
use kemari_testkit::*;
use serde_json::Value;

const PATIENCE: Duration = Duration::from_secs(60);
/// The window: small, so the tests stay quick (the guest checks every word).
const SIZE: usize = 8 << 20;
const BANNER: &str = "kemari-guest: hello";

/// A generation no other run writes: the guest must read this one, not
/// some constant a broken path could produce.
fn host_generation() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    0x5eed_0000_0000 | u64::from(std::process::id()) << 12 | u64::from(nanos & 0xfff)
}

/// `dir/pmem.img` holding `generation` over `SIZE` bytes.
fn pmem_file(dir: &Path, generation: u64) -> PathBuf {
    let path = dir.join("pmem.img");
    let mut window = vec![0u8; SIZE];
    pmemfmt::fill(&mut window, generation);
    std::fs::write(&path, window).unwrap();
    path
}

/// What the file holds, read from the host.
fn file_state(path: &Path) -> PmemState {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(bytes.len(), SIZE, "the pmem file changed size");
    pmemfmt::check(&bytes)
}

fn guest_args(pmem: &Path, cmdline: &str) -> Vec<String> {
    vec![
        "--kernel".into(),
        guest_elf().display().to_string(),
        // Little RAM: the window goes right after it, at 4 GiB.
        "--memory".into(),
        "64M".into(),
        "--cmdline".into(),
        cmdline.into(),
        "--pmem".into(),
        pmem.display().to_string(),
    ]
}

/// Waits until `count` lines of the console contain `needle`; fails at
/// once, with the VMM's stderr and the console, if the VMM exits first.
fn wait_lines(vmm: &mut Vmm, what: &str, needle: &str, count: usize) {
    let start = std::time::Instant::now();
    loop {
        let text = read_text(&vmm.console);
        if text.lines().filter(|l| l.contains(needle)).count() >= count {
            return;
        }
        if let Some(report) = vmm.exit_report() {
            panic!("waiting for {what}: {report}\nconsole:\n{text}");
        }
        assert!(
            start.elapsed() < PATIENCE,
            "timed out waiting for {what}; console:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The numbers after `prefix` on the console's lines, in order.
fn numbers_after(text: &str, prefix: &str) -> Vec<u64> {
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter_map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// The window's start and size, from the guest's probe line.
fn probed_window(text: &str) -> (u64, u64) {
    let line = text
        .lines()
        .find(|l| l.starts_with("virtio: pmem at "))
        .unwrap_or_else(|| panic!("the guest found no virtio-pmem device:\n{text}"));
    let field = |name: &str| -> u64 {
        let v = line
            .split(' ')
            .find_map(|f| f.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {line:?}"));
        match v.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).unwrap(),
            None => v.parse().unwrap(),
        }
    };
    (field("start="), field("size="))
}

/// The `pmem0` entry of `kemarictl devices`.
fn pmem_device(api: &Path) -> Value {
    let out = ctl(api, &["devices"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let devices: Value = serde_json::from_slice(&out.stdout).unwrap();
    devices
        .as_array()
        .unwrap_or_else(|| panic!("{devices}"))
        .iter()
        .find(|d| d["name"] == "pmem0")
        .cloned()
        .unwrap_or_else(|| panic!("no pmem0 in {devices:#}"))
}

fn shut_down(vmm: Vmm) {
    let out = ctl(&vmm.api, &["shutdown"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut child = vmm.child;
    assert!(wait_exit(&mut child.0, "kemari").success());
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn the_guest_reads_the_hosts_generation_and_the_host_reads_the_guests() {
    let _turn = one_at_a_time();
    let dir = scratch("pmem-round-trip");
    let host = host_generation();
    let file = pmem_file(&dir, host);
    let mut vmm = spawn_vmm(
        &guest_args(&file, "pmem=verify pmem=write,next"),
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[],
    );
    wait_lines(
        &mut vmm,
        "the guest's flush",
        "pmem: flushed generation=",
        1,
    );
    let text = read_text(&vmm.console);
    let (start, size) = probed_window(&text);
    assert_eq!(size, SIZE as u64, "{text}");
    assert!(
        start >= 4 << 30 && start.is_multiple_of(1 << 30),
        "window at {start:#x}: {text}"
    );
    // Every word the host wrote, as the guest read it.
    assert!(
        text.contains(&format!("pmem: read generation {host} ok size={SIZE}")),
        "{text}"
    );
    let next = host + 1;
    assert_eq!(numbers_after(&text, "pmem: flushed generation="), [next]);
    // The guest's stores are in the file, read while the VMM runs.
    assert_eq!(
        file_state(&file),
        PmemState::Valid { generation: next },
        "{text}"
    );
    let device = pmem_device(&vmm.api);
    assert_eq!(device["kind"], "virtio-pmem", "{device}");
    assert_eq!(device["counters"]["requests"], 1, "one flush: {device}");
    assert_eq!(device["counters"]["errors"], 0, "{device}");
    // Fault tolerance would not replicate the window: refused, saying why,
    // before any link is tried, and the VM runs on.
    let key = kemari_testkit::test_key(&dir);
    let out = run_with_timeout(
        kemarictl(&vmm.api)
            .args(["ft", "start", "--peer", "127.0.0.1:9", "--key-file"])
            .arg(&key),
        PATIENCE,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "ft start accepted: {err}");
    assert!(
        err.contains("pmem device") && err.contains("not replicated"),
        "{err}"
    );
    let info = request_with_timeout(&vmm.api, "GET", "/vm", None, PATIENCE).expect("GET /vm");
    assert_eq!(info["state"], "running", "{info}");
    shut_down(vmm);
    assert_eq!(file_state(&file), PmemState::Valid { generation: next });
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_byte_damaged_by_the_host_is_what_the_guest_reports() {
    let _turn = one_at_a_time();
    let dir = scratch("pmem-damage");
    let host = host_generation();
    let file = pmem_file(&dir, host);
    let offset = 5 * (1 << 20) + 4096 * 3 + 21;
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[offset] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let out = run_with_timeout(
        kemari().args(guest_args(&file, "pmem=verify poweroff=done")),
        PATIENCE,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let word = offset & !7;
    assert!(
        text.contains(&format!(
            "pmem: verify FAILED generation={host} bad_words=1 first_bad_offset={word:#x}"
        )),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A failed check fails the guest (exit code 3) and so the VM.
    assert!(!out.status.success(), "{text}");
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn each_boot_reads_the_generation_the_boot_before_flushed() {
    let _turn = one_at_a_time();
    let dir = scratch("pmem-reboot");
    let file = dir.join("pmem.img");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(SIZE as u64)
        .unwrap();
    // Each boot checks the window, writes the next generation and flushes
    // it, then resets 1.5 s after it booted (far longer than the work).
    let mut vmm = spawn_vmm(
        &guest_args(&file, "pmem=verify pmem=write,next reboot_after=1500"),
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[],
    );
    wait_lines(
        &mut vmm,
        "three boots' flushes",
        "pmem: flushed generation=",
        3,
    );
    // Hold the guest still (before its next reset) to compare the file.
    let out = ctl(&vmm.api, &["pause"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = read_text(&vmm.console);
    let info = request_with_timeout(&vmm.api, "GET", "/vm", None, PATIENCE).expect("GET /vm");
    assert_eq!(
        info["pid"].as_u64(),
        Some(u64::from(vmm.child.0.id())),
        "{info}"
    );
    let boots = text.matches(BANNER).count();
    assert!(boots >= 3, "{text}");
    assert_eq!(info["reboots"].as_u64(), Some(boots as u64 - 1), "{info}");
    // The first boot found the fresh file empty and wrote generation 1.
    assert!(text.contains("pmem: verify FAILED empty"), "{text}");
    assert_eq!(text.matches("pmem: verify FAILED").count(), 1, "{text}");
    // Boot k read generation k - 1, written and flushed by boot k - 1.
    let read = numbers_after(&text, "pmem: read generation ");
    let flushed = numbers_after(&text, "pmem: flushed generation=");
    let wrote = numbers_after(&text, "pmem: wrote generation ");
    assert!(read.len() >= 2, "{text}");
    assert_eq!(read, (1..=read.len() as u64).collect::<Vec<_>>(), "{text}");
    assert_eq!(
        flushed[..read.len()],
        read[..],
        "a boot read other than the previous boot flushed: {text}"
    );
    // What the last boot wrote is in the file.
    let last = *wrote.last().unwrap();
    assert_eq!(
        file_state(&file),
        PmemState::Valid { generation: last },
        "{text}"
    );
    let device = pmem_device(&vmm.api);
    assert_eq!(device["kind"], "virtio-pmem", "{device}");
    assert_eq!(device["counters"]["errors"], 0, "{device}");
    shut_down(vmm);
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_pmem_file_kemari_cannot_map_is_refused_naming_it() {
    let dir = scratch("pmem-bad");
    let odd = dir.join("three-mib.img");
    std::fs::File::create(&odd)
        .unwrap()
        .set_len(3 << 20)
        .unwrap();
    let empty = dir.join("empty.img");
    std::fs::File::create(&empty).unwrap();
    let missing = dir.join("no-such-file.img");
    for path in [&odd, &empty, &missing] {
        // Were it accepted, the guest would power off at once: status 0.
        let out = run_with_timeout(kemari().args(guest_args(path, "poweroff=done")), PATIENCE);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{} accepted: {err}", path.display());
        assert!(
            err.contains(&path.display().to_string()),
            "the error does not name {}: {err}",
            path.display()
        );
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains(BANNER),
            "the guest booted with {}",
            path.display()
        );
    }
}

/// The window's generations in the order the guest saw them, over the
/// consoles of the VMMs that ran it one after the other: `(read, wrote)`
/// events, `read` 0 for a check that failed.
fn generation_events(consoles: &[&Path]) -> Vec<(&'static str, u64)> {
    let mut events = Vec::new();
    for console in consoles {
        for l in read_text(console).lines() {
            if let Some(rest) = l.strip_prefix("pmem: read generation ") {
                events.push(("read", numbers_after(rest, "")[0]));
            } else if l.starts_with("pmem: verify FAILED") {
                events.push(("read", 0));
            } else if let Some(rest) = l.strip_prefix("pmem: wrote generation ") {
                events.push(("wrote", numbers_after(rest, "")[0]));
            }
        }
    }
    events
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn no_boot_reads_an_older_generation_across_warm_restart_migrations_and_kill() {
    let _turn = one_at_a_time();
    let dir = scratch("pmem-handovers");
    let host = host_generation();
    let file = pmem_file(&dir, host);
    let memfile = PathBuf::from(format!("/dev/shm/kemari-pmem-test-{}", std::process::id()));
    let _ = std::fs::remove_file(&memfile);
    let mut args = guest_args(&file, "pmem=verify pmem=write,next reboot_after=1500");
    args.extend(["--memory-file".into(), memfile.display().to_string()]);
    let flushed = "pmem: flushed generation=";
    let mut a = spawn_vmm(&args, &dir.join("console-a.log"), &dir.join("a.sock"), &[]);
    wait_lines(&mut a, "two boots' flushes", flushed, 2);

    // A warm restart: the pause syncs the window; the successor maps the
    // same file.
    let warm = dir.join("warm");
    let out = ctl(&a.api, &["warm-restart", warm.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(wait_exit(&mut a.child.0, "the old VMM").success());
    let mut b = spawn_vmm(
        &["--restore".into(), warm.display().to_string()],
        &dir.join("console-b.log"),
        &dir.join("b.sock"),
        &[],
    );
    wait_lines(&mut b, "a flush after the warm restart", flushed, 1);
    // Zero-copy migrations away and back.
    let mut from = b;
    for tag in ["c", "d"] {
        let sock = dir.join(format!("incoming-{tag}.sock"));
        let mut to = spawn_vmm(
            &["--incoming-local".into(), sock.display().to_string()],
            &dir.join(format!("console-{tag}.log")),
            &dir.join(format!("{tag}.sock")),
            &[],
        );
        wait_for("the destination's socket", PATIENCE, || sock.exists());
        let out = ctl(&from.api, &["migrate-local", sock.to_str().unwrap()]);
        assert!(out.status.success(), "{out:?}");
        assert!(wait_exit(&mut from.child.0, "the source VMM").success());
        wait_lines(&mut to, "two flushes after a migration", flushed, 2);
        from = to;
    }
    // A snapshot right after a flush (the guest then idles until its
    // reset), more boots, then kill -9 with the guest held still after a
    // flush, and a restore of the snapshot: its next boot must read what
    // the killed VMM's guest wrote last, not the snapshot's time.
    let mut d = from;
    let snap = dir.join("snap");
    let out = ctl(&d.api, &["snapshot", snap.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let before = read_text(&d.console).matches(flushed).count();
    wait_lines(&mut d, "a flush after the snapshot", flushed, before + 1);
    let out = ctl(&d.api, &["pause"]);
    assert!(out.status.success(), "{out:?}");
    let pid = d.child.0.id();
    // SAFETY: kill(2) on the pid of a child this test spawned and still owns.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let _ = d.child.0.wait();
    let _ = std::fs::remove_file(&memfile);
    let mut e = spawn_vmm(
        &["--restore".into(), snap.display().to_string()],
        &dir.join("console-e.log"),
        &dir.join("e.sock"),
        &[],
    );
    wait_lines(&mut e, "two flushes after kill -9 and restore", flushed, 2);
    let consoles: Vec<PathBuf> = ["a", "b", "c", "d", "e"]
        .iter()
        .map(|t| dir.join(format!("console-{t}.log")))
        .collect();
    let consoles: Vec<&Path> = consoles.iter().map(PathBuf::as_path).collect();
    let all = || {
        consoles
            .iter()
            .map(|c| format!("{}:\n{}", c.display(), read_text(c)))
            .collect::<String>()
    };
    // Every boot read the generation written last before it, whichever
    // VMM wrote it; the first read the host's.
    let mut newest = host;
    let mut reads = 0;
    for (kind, generation) in generation_events(&consoles) {
        match kind {
            "read" => {
                assert_eq!(generation, newest, "a boot read a stale window:\n{}", all());
                reads += 1;
            }
            _ => newest = generation,
        }
    }
    assert!(reads >= 8, "{}", all());
    shut_down(e);
    let _ = std::fs::remove_file(&memfile);
}
