//! The VMM process end to end with a tiny PVH stub kernel: boot, exit codes,
//! bad input, and the control API (pause/resume/shutdown, malformed requests).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use kemari_testkit::*;

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn boots_stub_prints_and_powers_off() {
    let dir = scratch("boot");
    let elf = build_stub(&dir, false, 0, 1);
    let out = run_with_timeout(
        kemari().arg("--kernel").arg(&elf).args(["--memory", "64M"]),
        Duration::from_secs(30),
    );
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "stub: hello\n");
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn guest_failure_code_gives_exit_status_3() {
    let dir = scratch("fail");
    let elf = build_stub(&dir, false, 7, 1);
    let out = run_with_timeout(
        kemari().arg("--kernel").arg(&elf).args(["--memory", "64M"]),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("exit code 7"));
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_triple_fault_is_a_crash_with_exit_status_4_and_the_registers_logged() {
    let dir = scratch("crash");
    // An empty IDT, then an exception: #UD, #GP, #DF, shutdown.
    let elf = build_stub_mode(&dir, 3, 0, 1);
    let out = run_with_timeout(
        kemari().arg("--kernel").arg(&elf).args(["--memory", "64M"]),
        Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "stderr: {err}");
    assert!(
        err.contains("guest crashed: triple fault on vCPU 0"),
        "{err}"
    );
    let logged = err
        .lines()
        .find(|l| l.contains("ERROR") && l.contains("guest crashed: triple fault"))
        .unwrap_or_else(|| panic!("no ERROR line with the registers: {err}"));
    for reg in [
        "rip=", "rsp=", "rflags=", "cs=", "ss=", "cr0=", "cr3=", "cr4=", "efer=",
    ] {
        assert!(logged.contains(reg), "{reg} missing from {logged}");
    }
    // Where KVM resets the vCPU before reporting the crash (AMD-V), those
    // are the reset vector's: the exits before it say where the guest was.
    let exits = err
        .lines()
        .find(|l| l.contains("ERROR") && l.contains("last exits before the crash"))
        .unwrap_or_else(|| panic!("no ERROR line with the last exits: {err}"));
    assert!(
        exits.contains(" out 0x") && exits.contains("rip=0x") && exits.contains("cr3=0x"),
        "the stub's port output before its crash, with its registers: {exits}"
    );
}

fn expect_error(args: &[&str], needle: &str) {
    let out = run_with_timeout(kemari().args(args), Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(
        out.status.code().is_some(),
        "{args:?} died of a signal: {err}"
    );
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(
        err.contains(needle),
        "{args:?}: expected {needle:?} in {err}"
    );
}

#[test]
fn bad_input_is_a_clear_error_not_a_panic() {
    let dir = scratch("bad");
    let garbage = dir.join("garbage.elf");
    std::fs::write(&garbage, b"\x7fELF this is not a kernel").unwrap();
    let g = garbage.to_str().unwrap();
    let empty = dir.join("empty");
    std::fs::write(&empty, b"").unwrap();
    let e = empty.to_str().unwrap();
    expect_error(
        &["--kernel", "/nonexistent/k.elf", "--memory", "64M"],
        "cannot read kernel",
    );
    expect_error(&["--kernel", g, "--memory", "64M"], "not a loadable ELF");
    expect_error(&["--kernel", e, "--memory", "64M"], "not a loadable ELF");
    expect_error(
        &["--kernel", g, "--memory", "1M"],
        "--memory 1M: must be at least 16M",
    );
    expect_error(
        &["--kernel", g, "--memory", "lots"],
        "--memory lots: not a size",
    );
    expect_error(&["--kernel", g], "missing --memory");
    expect_error(
        &["--kernel", g, "--memory", "64M", "--vcpus", "0"],
        "--vcpus 0: must be between 1 and 8",
    );
    expect_error(
        &["--kernel", g, "--memory", "64M", "--bogus"],
        "unexpected argument",
    );
    expect_error(
        &["--kernel", g, "--memory", "64M", "--serial", "tty"],
        "--serial tty: use stdout, null, file:PATH or socket:PATH",
    );
    expect_error(
        &["--config", "/nonexistent.toml"],
        "cannot read config file",
    );
}

/// Issue 24: a missing config file's error was printed twice, and a size
/// from the config file was echoed back in bytes.
#[test]
fn config_file_errors_are_said_once_and_as_written() {
    let dir = scratch("bad-config");
    let missing = dir.join("missing.toml");
    let out = run_with_timeout(
        kemari().arg("--config").arg(&missing),
        Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains(&format!("{} (--config)", missing.display())),
        "{err}"
    );
    let cfg = dir.join("vm.toml");
    std::fs::write(&cfg, "kernel = \"/k\"\nmemory = \"255M\"\n").unwrap();
    let out = run_with_timeout(kemari().arg("--config").arg(&cfg), Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let expected = format!(
        "memory = \"255M\" in {}: must be a multiple of 2M (try 256M)",
        cfg.display()
    );
    assert!(err.contains(&expected), "expected {expected:?} in {err}");
    assert!(!err.contains("267386880"), "{err}");
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn elf_without_a_pvh_note_is_a_clear_error_not_a_panic() {
    let dir = scratch("bad-elf");
    let plain = dir.join("plain.elf");
    std::fs::copy("/bin/true", &plain).unwrap();
    expect_error(
        &["--kernel", plain.to_str().unwrap(), "--memory", "64M"],
        "",
    );
}

fn count_dots(path: &std::path::Path) -> usize {
    read_text(path).matches('.').count()
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn api_pause_resume_shutdown() {
    let dir = scratch("api");
    let elf = build_stub(&dir, true, 0, 20_000);
    let sock = dir.join("api.sock");
    let console = dir.join("console.log");
    let child = kemari()
        .arg("--kernel")
        .arg(&elf)
        .args(["--memory", "64M", "--serial"])
        .arg(format!("file:{}", console.display()))
        .arg("--api-socket")
        .arg(&sock)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut vmm = KillOnDrop(child);
    wait_for("ticks", Duration::from_secs(30), || {
        count_dots(&console) >= 3
    });

    let info = run_with_timeout(kemarictl(&sock).arg("info"), Duration::from_secs(10));
    assert!(info.status.success());
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["state"], "running");
    assert_eq!(info["memory_bytes"], 64 << 20);

    assert!(
        run_with_timeout(kemarictl(&sock).arg("pause"), Duration::from_secs(10))
            .status
            .success()
    );
    let paused_at = count_dots(&console);
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(
        count_dots(&console),
        paused_at,
        "a paused guest made progress"
    );
    // Pausing twice is a clear conflict, not a crash.
    let again = run_with_timeout(kemarictl(&sock).arg("pause"), Duration::from_secs(10));
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already paused"));

    assert!(
        run_with_timeout(kemarictl(&sock).arg("resume"), Duration::from_secs(10))
            .status
            .success()
    );
    wait_for("progress after resume", Duration::from_secs(30), || {
        count_dots(&console) > paused_at + 2
    });

    let metrics = run_with_timeout(kemarictl(&sock).arg("metrics"), Duration::from_secs(10));
    let m: serde_json::Value = serde_json::from_slice(&metrics.stdout).unwrap();
    assert!(m["exits"]["io_out"].as_u64().unwrap() > 3);
    assert_eq!(m["pauses"], 1);
    let devices = run_with_timeout(kemarictl(&sock).arg("devices"), Duration::from_secs(10));
    let d: serde_json::Value = serde_json::from_slice(&devices.stdout).unwrap();
    assert_eq!(d[0]["name"], "serial0");
    assert!(d[0]["counters"]["bytes_out"].as_u64().unwrap() > 12);

    assert!(
        run_with_timeout(kemarictl(&sock).arg("shutdown"), Duration::from_secs(10))
            .status
            .success()
    );
    let status = vmm.0.wait().unwrap();
    assert!(status.success());
    assert!(!sock.exists(), "the API socket is removed at exit");
    // The reaper that destroys the KVM VM after the exit (it inherits the
    // VMM's command line, socket path included) goes right after it.
    let needle = sock.display().to_string();
    wait_for("the reaper to end", Duration::from_secs(10), || {
        processes_with_arg(&needle).is_empty()
    });
}

/// Live processes (not zombies) with `needle` among their arguments.
fn processes_with_arg(needle: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if cmdline
            .split(|&b| b == 0)
            .any(|arg| arg == needle.as_bytes())
        {
            found.push(pid);
        }
    }
    found
}

fn raw_exchange(sock: &std::path::Path, bytes: &[u8]) -> String {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn malformed_api_requests_are_refused_and_the_vmm_lives_on() {
    let dir = scratch("apibad");
    let elf = build_stub(&dir, true, 0, 200_000);
    let sock = dir.join("api.sock");
    let child = kemari()
        .arg("--kernel")
        .arg(&elf)
        .args(["--memory", "64M", "--serial", "null", "--api-socket"])
        .arg(&sock)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _vmm = KillOnDrop(child);
    wait_for("API socket", Duration::from_secs(30), || sock.exists());

    let r = raw_exchange(&sock, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(r.starts_with("HTTP/1.1 404"), "{r}");
    let r = raw_exchange(&sock, b"DELETE /vm HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(r.starts_with("HTTP/1.1 405"), "{r}");
    let r = raw_exchange(
        &sock,
        b"PUT /vm/pause HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{nope",
    );
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    let _ = raw_exchange(&sock, b"\x00\x01garbage\r\n\r\n");
    let _ = raw_exchange(&sock, &vec![b'A'; 1 << 20]);
    let _ = raw_exchange(
        &sock,
        b"PUT /vm/pause HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n{}",
    );

    // Still alive, and running (the API answers from before the machine
    // is built: on a loaded host it may still be starting).
    let mut state = serde_json::Value::Null;
    wait_for("the VM running", Duration::from_secs(30), || {
        let info = run_with_timeout(kemarictl(&sock).arg("info"), Duration::from_secs(10));
        assert!(
            info.status.success(),
            "{}",
            String::from_utf8_lossy(&info.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
        state = v["state"].clone();
        state == "running"
    });
    assert_eq!(state, "running");
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn second_vmm_on_the_same_api_socket_is_refused() {
    let dir = scratch("apidup");
    let elf = build_stub(&dir, true, 0, 200_000);
    let sock = dir.join("api.sock");
    let first = kemari()
        .arg("--kernel")
        .arg(&elf)
        .args(["--memory", "64M", "--serial", "null", "--api-socket"])
        .arg(&sock)
        .spawn()
        .unwrap();
    let _first = KillOnDrop(first);
    wait_for("API socket", Duration::from_secs(30), || sock.exists());
    let out = run_with_timeout(
        kemari()
            .arg("--kernel")
            .arg(&elf)
            .args(["--memory", "64M", "--serial", "null", "--api-socket"])
            .arg(&sock),
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("another process is serving"));
}

/// testkit takes `kemari` and `kemarictl` from beside the test executable
/// (`kemari_testkit::bins`): that must be where cargo built them, or the
/// folder `KEMARI_TEST_BIN_DIR` names.
#[test]
fn testkit_finds_the_binaries_cargo_built() {
    let named = std::env::var_os(kemari_testkit::bins::BIN_DIR_VAR).map(PathBuf::from);
    for (name, built) in [
        ("kemari", env!("CARGO_BIN_EXE_kemari")),
        ("kemarictl", env!("CARGO_BIN_EXE_kemarictl")),
    ] {
        let expected = match &named {
            Some(dir) => dir.join(name),
            None => PathBuf::from(built),
        };
        let found = kemari_testkit::bins::bin(name);
        assert_eq!(
            found.canonicalize().unwrap(),
            expected.canonicalize().unwrap(),
            "{name}"
        );
    }
}
