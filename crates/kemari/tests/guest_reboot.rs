//! In-place guest reboot, with real kemari processes and the test guest:
//!
//! - a guest that resets (`GET /reboot`: the i8042) boots again in the same
//!   kemari process, three times: same pid, id and name, the API answers
//!   throughout, the boot banner comes again each time, the blocks written
//!   before each reboot are read back intact after it (by the guest, through
//!   the re-wired disk), the TAP carries echo traffic after each reboot, and
//!   `reset`/`rebooted` events and the reboot count (`GET /vm`, `GET
//!   /metrics`) follow;
//! - a guest rebooted once warm-restarts into a new kemari process, which
//!   reboots it again: a restored machine reboots too, from a named memory
//!   file, with the devices handed over;
//! - a guest that reboots every 200 ms of uptime keeps rebooting (memory
//!   cleared and the kernel loaded again each time) until shut down;
//! - `--on-reboot exit` ends the VM at the reset with status 0, as before;
//! - `--on-crash restart` boots a triple-faulting guest again (the default,
//!   status 4, is tested in vmm_process.rs).
//!
//! Bounds are generous (60 s): the machine is shared.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use kemari::api::client::request_with_timeout;
use kemari_testkit::scenario::*;
use kemari_testkit::*;
use serde_json::Value;

const PATIENCE: Duration = Duration::from_secs(60);
const SUBNET: u8 = 41;
/// Blocks each boot verifies (written by the boot before), then writes.
const BLOCKS: u64 = 64;
const BANNER: &str = "kemari-guest: hello";

/// A rebooted guest's uptime counts from the reboot: no more than the
/// machine's (rebuilt then; 2 ms for the rounding of two readings).
fn rebooted_uptime(now: &Value) {
    let guest = now["guest_uptime_ms"].as_u64().expect("guest_uptime_ms");
    let machine = now["uptime_ms"].as_u64().expect("uptime_ms");
    assert!(
        guest <= machine + 2,
        "a reboot starts the guest's uptime again: {now}"
    );
}

fn info(api: &Path) -> Value {
    request_with_timeout(api, "GET", "/vm", None, PATIENCE).expect("GET /vm")
}

/// `GET /metrics` on the API socket: the body.
fn prometheus(api: &Path) -> String {
    let mut s = UnixStream::connect(api).expect("the API socket");
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: kemari\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    answer
}

fn occurrences(console: &Path, needle: &str) -> usize {
    read_text(console).matches(needle).count()
}

/// The events of an events file, by kind.
fn events(file: &Path) -> Vec<Value> {
    read_text(file)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn of_kind<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["event"] == kind).collect()
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn a_guest_reboots_in_place_three_times_with_its_disk_network_and_api() {
    let _one = one_at_a_time();
    let dir = scratch("reboot-3");
    let net = TapNet::create("rb", SUBNET);
    let disk = disk_image(&dir);
    let events_file = dir.join("events.jsonl");
    let ip = net.guest_ip();
    let vmm = spawn_vmm(
        &[
            "--kernel".into(),
            guest_elf().display().to_string(),
            "--memory".into(),
            "128M".into(),
            "--cmdline".into(),
            format!("counter=500 ip={ip}/24 disk=verify,{BLOCKS} disk=write,{BLOCKS},seq,flush"),
            "--disk".into(),
            disk.display().to_string(),
            "--net".into(),
            format!("tap={}", net.name),
            "--name".into(),
            "rebooter".into(),
            "--events-file".into(),
            events_file.display().to_string(),
        ],
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[],
    );
    let console = vmm.console.clone();
    let write_done = format!("disk: write done blocks={BLOCKS}");
    wait_for("the first boot's disk writes", PATIENCE, || {
        occurrences(&console, &write_done) == 1
    });
    // The first boot found nothing: the check sees a lost disk.
    assert!(
        read_text(&console).contains(&format!("disk: verify FAILED missing={BLOCKS} corrupt=0")),
        "{}",
        read_text(&console)
    );
    let first = info(&vmm.api);
    let pid = first["pid"].as_u64().unwrap();
    assert_eq!(pid, u64::from(vmm.child.0.id()));
    assert_eq!(first["name"], "rebooter");
    assert_eq!(first["reboots"], 0);
    for boot in 2..=4usize {
        echo_works(&ip);
        let answer = ask_guest_reboot(&ip);
        assert!(answer.ends_with("rebooting\n"), "{answer}");
        wait_for("the guest's next boot", PATIENCE, || {
            occurrences(&console, BANNER) == boot
        });
        // The API answered during and answers after, for the same VMM and VM.
        let now = info(&vmm.api);
        assert_eq!(now["pid"].as_u64(), Some(pid), "{now}");
        assert_eq!(now["id"], first["id"], "{now}");
        assert_eq!(now["name"], "rebooter", "{now}");
        assert_eq!(now["reboots"].as_u64(), Some(boot as u64 - 1), "{now}");
        rebooted_uptime(&now);
        assert_eq!(now["state"], "running", "{now}");
        // The blocks the previous boot wrote (and flushed) are read back.
        wait_for("the disk check and writes of this boot", PATIENCE, || {
            occurrences(&console, &write_done) == boot
        });
        assert_eq!(
            occurrences(&console, &format!("disk: verify ok blocks={BLOCKS}")),
            boot - 1,
            "{}",
            read_text(&console)
        );
    }
    // The TAP carries traffic after the last reboot too.
    echo_works(&ip);
    let metrics = prometheus(&vmm.api);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kemari_vm_reboots_total{") && l.ends_with(" 3")),
        "{metrics}"
    );
    let out = ctl(&vmm.api, &["shutdown"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut child = vmm.child;
    assert!(wait_exit(&mut child.0, "kemari").success());
    assert_eq!(occurrences(&console, BANNER), 4);
    assert!(!read_text(&console).contains("panic"));
    let written = events(&events_file);
    assert_eq!(of_kind(&written, "reset").len(), 3, "{written:#?}");
    let rebooted = of_kind(&written, "rebooted");
    let counts: Vec<_> = rebooted.iter().map(|e| e["reboots"].as_u64()).collect();
    assert_eq!(counts, [Some(1), Some(2), Some(3)], "{written:#?}");
    assert!(rebooted.iter().all(|e| e["cause"] == "reset"));
    assert_eq!(of_kind(&written, "started").len(), 1, "{written:#?}");
}

/// Some echo traffic through the TAP, on a new connection.
fn echo_works(ip: &str) {
    let echo = EchoChecker::start(ip);
    wait_for("echo traffic", PATIENCE, || echo.verified() > 16384);
    echo.finish();
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn a_rebooted_guest_warm_restarts_and_its_successor_reboots_it_again() {
    let _one = one_at_a_time();
    let dir = scratch("reboot-warm");
    let net = TapNet::create("rw", SUBNET + 1);
    let disk = disk_image(&dir);
    let memfile = std::path::PathBuf::from(format!(
        "/dev/shm/kemari-reboot-warm-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&memfile);
    let ip = net.guest_ip();
    let mut old = spawn_vmm(
        &[
            "--kernel".into(),
            guest_elf().display().to_string(),
            "--memory".into(),
            "128M".into(),
            "--memory-file".into(),
            memfile.display().to_string(),
            "--cmdline".into(),
            format!("counter=200 ip={ip}/24 disk=verify,{BLOCKS} disk=write,{BLOCKS},seq,flush"),
            "--disk".into(),
            disk.display().to_string(),
            "--net".into(),
            format!("tap={}", net.name),
        ],
        &dir.join("console-1.log"),
        &dir.join("api-1.sock"),
        &[],
    );
    let write_done = format!("disk: write done blocks={BLOCKS}");
    let verified = format!("disk: verify ok blocks={BLOCKS}");
    wait_for("the first boot's disk writes", PATIENCE, || {
        occurrences(&old.console, &write_done) == 1
    });
    ask_guest_reboot(&ip);
    wait_for("the second boot's disk check and writes", PATIENCE, || {
        occurrences(&old.console, &write_done) == 2
    });
    assert_eq!(occurrences(&old.console, &verified), 1);
    echo_works(&ip);
    let state_dir = dir.join("warm");
    let out = ctl(&old.api, &["warm-restart", state_dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(wait_exit(&mut old.child.0, "the old VMM").success());
    let new = spawn_vmm(
        &["--restore".into(), state_dir.display().to_string()],
        &dir.join("console-2.log"),
        &dir.join("api-2.sock"),
        &[],
    );
    // The rebooted guest runs on in the new process, its network too.
    wait_for("the guest's counter in the new VMM", PATIENCE, || {
        counters(&new.console).len() >= 3
    });
    assert_eq!(occurrences(&new.console, BANNER), 0);
    echo_works(&ip);
    ask_guest_reboot(&ip);
    wait_for("the boot in the new VMM", PATIENCE, || {
        occurrences(&new.console, &write_done) == 1
    });
    assert_eq!(occurrences(&new.console, BANNER), 1);
    assert_eq!(occurrences(&new.console, &verified), 1);
    echo_works(&ip);
    let now = info(&new.api);
    assert_eq!(now["reboots"], 1, "{now}");
    // The guest came with its uptime from the old VMM; its reboot here
    // started it again.
    rebooted_uptime(&now);
    assert_eq!(now["pid"].as_u64(), Some(u64::from(new.child.0.id())));
    let out = ctl(&new.api, &["shutdown"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut child = new.child;
    assert!(wait_exit(&mut child.0, "the new VMM").success());
    let _ = std::fs::remove_file(memfile);
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_guest_that_keeps_rebooting_keeps_booting_until_shut_down() {
    let dir = scratch("reboot-loop");
    let vmm = spawn_vmm(
        &[
            "--kernel".into(),
            guest_elf().display().to_string(),
            "--memory".into(),
            "64M".into(),
            "--cmdline".into(),
            "reboot_after=200".into(),
        ],
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[],
    );
    wait_for("five boots", PATIENCE, || {
        occurrences(&vmm.console, BANNER) >= 5
    });
    let now = info(&vmm.api);
    assert!(now["reboots"].as_u64().unwrap() >= 4, "{now}");
    let out = ctl(&vmm.api, &["shutdown"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut child = vmm.child;
    assert!(wait_exit(&mut child.0, "kemari").success());
    let text = read_text(&vmm.console);
    // Every boot got as far as its command line: nothing of the last one's
    // memory misled the next.
    assert!(!text.contains("error"), "{text}");
    assert!(!text.contains("fault"), "{text}");
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn on_reboot_exit_ends_the_vm_at_the_reset_with_status_0() {
    let dir = scratch("reboot-exit");
    let out = run_with_timeout(
        kemari()
            .arg("--kernel")
            .arg(guest_elf())
            .args(["--memory", "64M", "--cmdline", "reboot_after=200"])
            .args(["--on-reboot", "exit"]),
        PATIENCE,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.matches(BANNER).count(), 1, "{stdout}");
    assert!(stdout.contains("\nreboot\n"), "{stdout}");
    drop(dir);
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn on_crash_restart_boots_a_triple_faulting_guest_again() {
    let dir = scratch("reboot-crash");
    // An empty IDT, then an exception: #UD, #GP, #DF, shutdown; every boot.
    let elf = build_stub_mode(&dir, 3, 0, 1);
    let events_file = dir.join("events.jsonl");
    let vmm = spawn_vmm(
        &[
            "--kernel".into(),
            elf.display().to_string(),
            "--memory".into(),
            "64M".into(),
            "--on-crash".into(),
            "restart".into(),
            "--events-file".into(),
            events_file.display().to_string(),
        ],
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[],
    );
    wait_for("three restarts after crashes", PATIENCE, || {
        of_kind(&events(&events_file), "rebooted").len() >= 3
    });
    let out = ctl(&vmm.api, &["shutdown"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut child = vmm.child;
    assert!(wait_exit(&mut child.0, "kemari").success());
    let written = events(&events_file);
    let crashed = of_kind(&written, "crashed");
    assert!(crashed.len() >= 3, "{written:#?}");
    assert!(
        crashed.iter().all(|e| e["then"] == "restart"),
        "{written:#?}"
    );
    assert!(of_kind(&written, "rebooted")
        .iter()
        .all(|e| e["cause"] == "crash"));
    assert!(occurrences(&vmm.console, "stub: hello") >= 3);
}
