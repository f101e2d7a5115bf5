//! The VMM confined, by default: a seccomp filter on every thread (the
//! vCPU, device and API threads with their own on top), a call outside a
//! vCPU's filter kills the process with SIGSYS, no capability but the one
//! it may need, no new privileges.

use std::path::Path;
use std::time::Duration;

use kemari_testkit::scenario::*;
use kemari_testkit::*;

/// A field of `/proc/PID/status`.
fn status_field(pid: u32, name: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
        .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
}

fn api_answers(api: &Path) -> bool {
    run_with_timeout(kemarictl(api).arg("info"), Duration::from_secs(10))
        .status
        .success()
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn every_thread_of_a_vmm_and_of_its_prepared_successor_is_filtered() {
    let dir = scratch("harden");
    let memfile =
        std::path::PathBuf::from(format!("/dev/shm/kemari-harden-{}", std::process::id()));
    let _ = std::fs::remove_file(&memfile);
    let disk = dir.join("disk.img");
    std::fs::write(&disk, vec![0u8; 1 << 20]).unwrap();
    let vmm = spawn_vmm(
        &[
            "--kernel".into(),
            guest_elf().display().to_string(),
            "--memory".into(),
            "128M".into(),
            "--vcpus".into(),
            "2".into(),
            "--cmdline".into(),
            "counter=50".into(),
            "--disk".into(),
            disk.display().to_string(),
            "--memory-file".into(),
            memfile.display().to_string(),
            // The metrics listener's thread is filtered too.
            "--metrics-listen".into(),
            "127.0.0.1:0".into(),
        ],
        &dir.join("console-1.log"),
        &dir.join("api-1.sock"),
        &[],
    );
    wait_for("the guest's counter", Duration::from_secs(30), || {
        counters(&vmm.console).len() >= 2
    });
    assert!(api_answers(&vmm.api));
    let pid = vmm.child.0.id();
    let threads = assert_every_thread_filtered(pid, "a running VMM");
    for name in ["vcpu0", "vcpu1", "devices", "api", "signals", "metrics"] {
        assert!(
            threads.iter().any(|t| t.name == name),
            "no thread {name}: {threads:?}"
        );
    }
    // Booted without a network device: no capability at all.
    assert_eq!(status_field(pid, "NoNewPrivs:"), "1");
    assert_eq!(status_field(pid, "CapEff:"), "0000000000000000");
    assert_eq!(status_field(pid, "CapPrm:"), "0000000000000000");
    assert_eq!(status_field(pid, "CapBnd:"), "0000000000000000");

    // Its successor, prepared (KVM VM, vCPU threads ahead) and waiting.
    let state_dir = dir.join("warm");
    let successor = prepared_successor(&vmm, &state_dir, &dir);
    // Its vCPU and device threads are made, and confined, ahead: neither a
    // thread's start nor a filter's installation is in the pause. They are
    // made while it waits (the device thread may come a moment after the
    // socket it waits on).
    let ahead = ["vcpu0", "vcpu1", "devices"];
    let spid = successor.child.0.id();
    wait_for(
        "the waiting successor's vCPU and device threads, confined",
        Duration::from_secs(30),
        || {
            let threads = thread_seccomp(spid);
            ahead
                .iter()
                .all(|n| threads.iter().any(|t| t.name == *n && t.filters == 2))
        },
    );
    let waiting = assert_every_thread_filtered(spid, "a waiting successor");
    for name in ahead {
        assert!(
            waiting.iter().any(|t| t.name == name),
            "the waiting successor has no thread {name}: {waiting:?}"
        );
    }
    // The VM moves: every thread of the successor is still filtered.
    let out = ctl(&vmm.api, &["warm-restart", state_dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut vmm = vmm;
    assert!(wait_exit(&mut vmm.child.0, "the old VMM").success());
    wait_for("the successor's API", Duration::from_secs(30), || {
        api_answers(&successor.api)
    });
    let n = counters(&successor.console).len();
    wait_for("the successor's counter", Duration::from_secs(30), || {
        counters(&successor.console).len() > n
    });
    let threads = assert_every_thread_filtered(successor.child.0.id(), "a successor");
    assert!(threads.iter().any(|t| t.name == "vcpu1"), "{threads:?}");
    let out = ctl(&successor.api, &["shutdown"]);
    assert!(out.status.success());
    let _ = std::fs::remove_file(memfile);
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_vmm_waiting_for_its_vm_is_filtered_and_keeps_only_net_admin() {
    let dir = scratch("harden-wait");
    let key = kemari_testkit::test_key(&dir);
    for (mode, what) in [
        ("--incoming", "a live-migration destination"),
        ("--ft-standby", "a standby"),
    ] {
        let api = dir.join(format!("api{mode}.sock"));
        let vmm = spawn_vmm(
            &[
                mode.into(),
                format!("127.0.0.1:{}", free_port()),
                "--migration-key-file".into(),
                key.display().to_string(),
            ],
            &dir.join("console.log"),
            &api,
            &[],
        );
        wait_for("its API", Duration::from_secs(30), || api_answers(&api));
        let pid = vmm.child.0.id();
        assert_every_thread_filtered(pid, what);
        // It opens this host's TAPs when the VM comes: CAP_NET_ADMIN (12).
        assert_eq!(status_field(pid, "CapEff:"), "0000000000001000", "{what}");
        assert_eq!(status_field(pid, "CapBnd:"), "0000000000001000", "{what}");
    }
}

/// kemari on a stub guest that powers off at once (only a fault can keep
/// it from exiting 0), with fault injection `var=value`.
fn powering_off_vmm(tag: &str, var: &str, value: &str) -> std::process::Command {
    let elf = build_stub(&scratch(tag), false, 0, 1);
    let mut cmd = kemari();
    cmd.arg("--kernel")
        .arg(&elf)
        .args(["--memory", "64M", "--serial", "null"])
        .env(var, value);
    cmd
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "needs --features fault-injection"
)]
fn a_forbidden_call_on_a_vcpu_thread_kills_the_vmm_with_sigsys() {
    use std::os::unix::process::ExitStatusExt;
    let mut cmd = powering_off_vmm("harden-sigsys", "KEMARI_FAULT_FORBIDDEN_SYSCALL", "vcpu");
    let out = run_with_timeout(&mut cmd, Duration::from_secs(30));
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGSYS),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // With --seccomp log the same call is only logged (by the kernel).
    let out = run_with_timeout(cmd.args(["--seccomp", "log"]), Duration::from_secs(30));
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
#[cfg_attr(
    not(feature = "fault-injection"),
    ignore = "needs --features fault-injection"
)]
fn glibcs_own_read_only_open_on_a_device_or_vcpu_thread_is_allowed() {
    // glibc's malloc opens /proc/sys/vm/overcommit_memory, once, on the
    // first thread that shrinks an arena: in the lab that was the device
    // thread after an in-place reboot, and kemari died of SIGSYS.
    let mut cmd = powering_off_vmm(
        "harden-glibc-open",
        "KEMARI_FAULT_GLIBC_OPEN",
        "devices,vcpu",
    );
    let out = run_with_timeout(&mut cmd, Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    // The injection ran on both kinds of thread (the stub powered off after).
    for kind in ["devices", "vcpu"] {
        assert!(
            stderr
                .lines()
                .any(|l| l.contains("glibc's read-only open") && l.contains(kind)),
            "no injected open on the {kind} thread: {stderr}"
        );
    }
}
