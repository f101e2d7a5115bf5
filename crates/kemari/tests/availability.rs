//! Whole-VM state end to end with the test guest: snapshot/restore, warm
//! restart and zero-copy local migration, each while the guest counts, writes
//! flushed blocks to its disk and echoes a TCP stream from the host. After each
//! operation the counter continues (it does not restart), every block whose
//! write the guest saw acknowledged verifies, and the TCP connection keeps
//! echoing byte-exact. Plus the failure rules: corrupt, truncated or foreign
//! state is refused and loses nothing; a destination killed mid-migration
//! leaves the source VM running.

use std::path::PathBuf;
use std::time::Duration;

use kemari_testkit::scenario::*;
use kemari_testkit::*;

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn snapshot_and_restore_keep_counter_disk_and_tcp() {
    let _turn = one_at_a_time();
    let dir = scratch("av-snap");
    let net = TapNet::create("s", 11);
    let disk = disk_image(&dir);
    let (mut src, echo) = start_source(&dir, &net, &disk, &[]);
    let snap = dir.join("snap");
    let out = ctl(&src.api, &["snapshot", snap.to_str().unwrap(), "--exit"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(wait_exit(&mut src.child.0, "the source VMM").success());
    let new = spawn_vmm(
        &["--restore".into(), snap.display().to_string()],
        &dir.join("console-2.log"),
        &dir.join("api-2.sock"),
        &[],
    );
    check_continuity(&src.console, &new, echo, &disk);
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn warm_restart_keeps_memory_and_continues() {
    let _turn = one_at_a_time();
    let dir = scratch("av-warm");
    let net = TapNet::create("w", 12);
    let disk = disk_image(&dir);
    let memfile = PathBuf::from(format!("/dev/shm/kemari-av-warm-{}", std::process::id()));
    let _ = std::fs::remove_file(&memfile);
    let (mut src, echo) = start_source(
        &dir,
        &net,
        &disk,
        &["--memory-file".into(), memfile.display().to_string()],
    );
    let state_dir = dir.join("warm");
    let out = ctl(&src.api, &["warm-restart", state_dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(wait_exit(&mut src.child.0, "the old VMM").success());
    assert!(
        !state_dir.join("memory.bin").exists(),
        "a warm restart must not copy guest memory"
    );
    let new = spawn_vmm(
        &["--restore".into(), state_dir.display().to_string()],
        &dir.join("console-2.log"),
        &dir.join("api-2.sock"),
        &[],
    );
    check_continuity(&src.console, &new, echo, &disk);
    let _ = std::fs::remove_file(memfile);
}

/// A fresh `/dev/shm` path for a test VM's memory.
fn shm_file(tag: &str) -> PathBuf {
    let p = PathBuf::from(format!("/dev/shm/kemari-av-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn warm_restart_into_a_prepared_successor_keeps_counter_disk_and_tcp() {
    let _turn = one_at_a_time();
    let dir = scratch("av-warm-prep");
    let net = TapNet::create("r", 15);
    let disk = disk_image(&dir);
    let memfile = shm_file("warm-prep");
    let (mut src, echo) = start_source(
        &dir,
        &net,
        &disk,
        &["--memory-file".into(), memfile.display().to_string()],
    );
    let state_dir = dir.join("warm");
    let successor = prepared_successor(&src, &state_dir, &dir);
    // The guest still runs in the old VMM while the successor waits.
    let n = counters(&src.console).len();
    wait_for("the VM runs on", Duration::from_secs(30), || {
        counters(&src.console).len() > n + 2
    });
    assert!(counters(&successor.console).is_empty());
    let out = ctl(&src.api, &["warm-restart", state_dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["successor"]["running"], true, "{report}");
    assert!(wait_exit(&mut src.child.0, "the old VMM").success());
    // The state stays: a plain restore would still find it.
    assert!(state_dir.join("state.bin").exists());
    assert!(!state_dir.join("successor.sock").exists());
    check_continuity(&src.console, &successor, echo, &disk);
    let _ = std::fs::remove_file(memfile);
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn successor_killed_before_the_restart_leaves_a_plain_restore() {
    let _turn = one_at_a_time();
    let dir = scratch("av-warm-prep-kill");
    let net = TapNet::create("q", 16);
    let disk = disk_image(&dir);
    let memfile = shm_file("warm-prep-kill");
    let (mut src, echo) = start_source(
        &dir,
        &net,
        &disk,
        &["--memory-file".into(), memfile.display().to_string()],
    );
    let state_dir = dir.join("warm");
    let mut successor = prepared_successor(&src, &state_dir, &dir);
    successor.child.0.kill().unwrap();
    let _ = successor.child.0.wait();
    // Its socket is left behind: nobody answers on it.
    let out = ctl(&src.api, &["warm-restart", state_dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(report["successor"].is_null(), "{report}");
    assert!(wait_exit(&mut src.child.0, "the old VMM").success());
    let new = spawn_vmm(
        &["--restore".into(), state_dir.display().to_string()],
        &dir.join("console-3.log"),
        &dir.join("api-3.sock"),
        &[],
    );
    check_continuity(&src.console, &new, echo, &disk);
    let _ = std::fs::remove_file(memfile);
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_successor_refuses_another_vm_and_waits_for_its_own() {
    let _turn = one_at_a_time();
    let dir = scratch("av-warm-prep-other");
    let mem_a = shm_file("prep-a");
    let mem_b = shm_file("prep-b");
    let vm = |tag: &str, mem: &PathBuf| {
        spawn_vmm(
            &[
                "--kernel".into(),
                guest_elf().display().to_string(),
                "--memory".into(),
                "128M".into(),
                "--memory-file".into(),
                mem.display().to_string(),
                "--cmdline".into(),
                "counter=100".into(),
            ],
            &dir.join(format!("console-{tag}.log")),
            &dir.join(format!("api-{tag}.sock")),
            &[],
        )
    };
    let mut a = vm("a", &mem_a);
    let b = vm("b", &mem_b);
    for v in [&a, &b] {
        wait_for("counter", Duration::from_secs(30), || {
            counters(&v.console).len() >= 2
        });
    }
    let state_dir = dir.join("warm-a");
    let successor = prepared_successor(&a, &state_dir, &dir);
    // VM b is not the one the successor prepared for: refused before it
    // pauses, and it runs on.
    let out = ctl(&b.api, &["warm-restart", state_dir.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("prepared for a different VM") && err.contains(mem_a.to_str().unwrap()),
        "unclear error: {err}"
    );
    let n = counters(&b.console).len();
    wait_for("VM b runs on", Duration::from_secs(30), || {
        counters(&b.console).len() > n + 2
    });
    assert!(!state_dir.join("state.bin").exists());
    // A successor for a memory file that is not there refuses to start.
    std::fs::create_dir_all(dir.join("gone")).unwrap();
    let cfg = std::fs::read_to_string(state_dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("gone/config.json"),
        cfg.replace(mem_a.to_str().unwrap(), "/dev/shm/kemari-av-no-such-file"),
    )
    .unwrap();
    let out = run_with_timeout(
        kemari()
            .arg("--restore")
            .arg(dir.join("gone"))
            .args(["--await-state", "--serial", "null"]),
        Duration::from_secs(30),
    );
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("kemari-av-no-such-file"), "{text}");
    // The successor still waits, and takes VM a.
    let out = ctl(&a.api, &["warm-restart", state_dir.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(wait_exit(&mut a.child.0, "VM a's old VMM").success());
    let last = *counters(&a.console).last().unwrap();
    wait_for("counter in the successor", Duration::from_secs(30), || {
        counters(&successor.console).len() >= 2
    });
    let first = counters(&successor.console)[0];
    assert!(first > 1 && first <= last + 2, "{last} -> {first}");
    for v in [&successor, &b] {
        assert!(ctl(&v.api, &["shutdown"]).status.success());
    }
    let _ = std::fs::remove_file(mem_a);
    let _ = std::fs::remove_file(mem_b);
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn zero_copy_local_migration_keeps_counter_disk_and_tcp() {
    let _turn = one_at_a_time();
    let dir = scratch("av-local");
    let net = TapNet::create("m", 13);
    let disk = disk_image(&dir);
    let (mut src, echo) = start_source(&dir, &net, &disk, &[]);
    let sock = dir.join("incoming.sock");
    let dst = spawn_vmm(
        &["--incoming-local".into(), sock.display().to_string()],
        &dir.join("console-2.log"),
        &dir.join("api-2.sock"),
        &[],
    );
    wait_for("the destination's socket", Duration::from_secs(30), || {
        sock.exists()
    });
    let out = ctl(&src.api, &["migrate-local", sock.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        report["state_bytes"].as_u64().unwrap() < 1 << 20,
        "only state moves, not memory"
    );
    // The progress kemarictl showed ends with what went over the socket.
    let shown = String::from_utf8_lossy(&out.stderr);
    let last = shown.lines().last().unwrap_or_default();
    assert!(
        last.contains("completed") && last.contains("KiB sent"),
        "{shown}"
    );
    // The source left only once the destination said the guest runs there.
    let running = report["running_ms"].as_f64().expect("running_ms");
    assert!(
        running >= report["downtime_ms"].as_f64().unwrap(),
        "{report}"
    );
    assert!(wait_exit(&mut src.child.0, "the source VMM").success());
    check_continuity(&src.console, &dst, echo, &disk);
}

#[test]
#[cfg_attr(
    any(no_kvm, no_tap),
    ignore = "needs a usable /dev/kvm and TAP devices (root)"
)]
fn destination_killed_mid_migration_leaves_the_source_running() {
    let _turn = one_at_a_time();
    let dir = scratch("av-kill");
    let net = TapNet::create("k", 14);
    let disk = disk_image(&dir);
    let (src, echo) = start_source(&dir, &net, &disk, &[]);
    let sock = dir.join("incoming.sock");
    let hold = FaultHold::new(&dir, "KEMARI_FAULT_HOLD_MIGRATE_IN_MS", 60_000);
    let mut dst = spawn_vmm(
        &["--incoming-local".into(), sock.display().to_string()],
        &dir.join("console-2.log"),
        &dir.join("api-2.sock"),
        &hold.env(),
    );
    wait_for("the destination's socket", Duration::from_secs(30), || {
        sock.exists()
    });
    let api = src.api.clone();
    let sock2 = sock.clone();
    let migrate =
        std::thread::spawn(move || ctl(&api, &["migrate-local", sock2.to_str().unwrap()]));
    // The destination holds after receiving the state: the source is paused.
    hold.wait_reached();
    dst.child.0.kill().unwrap();
    let _ = dst.child.0.wait();
    let out = migrate.join().unwrap();
    assert!(!out.status.success(), "the migration cannot have succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("migration"), "unclear error: {err}");
    // The source resumed: counter and echo go on, the API says running.
    let n = counters(&src.console).len();
    wait_for(
        "counter after the failed migration",
        Duration::from_secs(30),
        || counters(&src.console).len() > n + 3,
    );
    let info: serde_json::Value = serde_json::from_slice(&ctl(&src.api, &["info"]).stdout).unwrap();
    assert_eq!(info["state"], "running");
    let echoed = echo.verified();
    wait_for(
        "echo after the failed migration",
        Duration::from_secs(30),
        || echo.verified() > echoed + 8192,
    );
    echo.finish();
    assert!(ctl(&src.api, &["shutdown"]).status.success());
}

/// `kemari --incoming-local SOCK --memory-file PATH` builds its VM around
/// PATH before the source connects. Offered another VM's memory it refuses
/// with a clear error (the source runs on); offered PATH it takes the VM over.
#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn zero_copy_into_a_destination_built_ahead_refuses_other_memory() {
    let _turn = one_at_a_time();
    let dir = scratch("av-ahead");
    let memfile = shm_file("ahead");
    let other = shm_file("ahead-other");
    std::fs::File::create(&other)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    let src = guest_vm(&dir, "256M", Some(&memfile), "counter=100");
    wait_for("counter", Duration::from_secs(30), || {
        counters(&src.console).len() >= 2
    });
    let destination = |tag: &str, memory: &std::path::Path| {
        let sock = dir.join(format!("incoming-{tag}.sock"));
        let vmm = spawn_vmm(
            &[
                "--incoming-local".into(),
                sock.display().to_string(),
                "--memory-file".into(),
                memory.display().to_string(),
            ],
            &dir.join(format!("console-{tag}.log")),
            &dir.join(format!("api-{tag}.sock")),
            &[],
        );
        wait_for("the destination's socket", Duration::from_secs(30), || {
            sock.exists()
        });
        (vmm, sock)
    };

    // Built around another file: refused, and nothing is lost.
    let (mut wrong, sock) = destination("wrong", &other);
    let out = ctl(&src.api, &["migrate-local", sock.to_str().unwrap()]);
    assert!(!out.status.success(), "another VM's memory must be refused");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is not") && err.contains(&*other.to_string_lossy()),
        "unclear error: {err}"
    );
    assert!(!wait_exit(&mut wrong.child.0, "the refusing destination").success());
    let n = counters(&src.console).len();
    wait_for("counter after the refusal", Duration::from_secs(30), || {
        counters(&src.console).len() > n + 2
    });
    let info: serde_json::Value = serde_json::from_slice(&ctl(&src.api, &["info"]).stdout).unwrap();
    assert_eq!(info["state"], "running");

    // Built around the VM's own file: taken over, the counter continues.
    let (dst, sock) = destination("right", &memfile);
    let out = ctl(&src.api, &["migrate-local", sock.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut src = src;
    assert!(wait_exit(&mut src.child.0, "the source VMM").success());
    let last = *counters(&src.console).last().unwrap();
    wait_for(
        "counter on the destination",
        Duration::from_secs(30),
        || counters(&dst.console).len() >= 2,
    );
    let first = counters(&dst.console)[0];
    assert!(first > 1 && first <= last + 2, "{last} -> {first}");
    assert!(ctl(&dst.api, &["shutdown"]).status.success());
    let _ = std::fs::remove_file(memfile);
    let _ = std::fs::remove_file(other);
}

/// The dirty workload's check, which every continuity test relies on to
/// show that no write was lost, does catch a damaged page: the test pauses
/// the guest, overwrites one page of its working set through the memory
/// file, and resumes it.
#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn the_dirty_check_catches_a_page_damaged_behind_the_guest() {
    let _turn = one_at_a_time();
    let dir = scratch("av-damage");
    let memfile = shm_file("damage");
    let vm = guest_vm(&dir, "128M", Some(&memfile), "dirty=5000,1");
    wait_for("two clean passes", Duration::from_secs(30), || {
        dirty_reports(&vm.console)
            .last()
            .is_some_and(|&(ws, total, bad)| total > 2 * ws && bad == 0)
    });
    let base = read_text(&vm.console)
        .lines()
        .find_map(|l| {
            let hex = l
                .strip_prefix("dirty: working set at 0x")?
                .split(',')
                .next()?;
            u64::from_str_radix(hex, 16).ok()
        })
        .expect("the guest names its working set");
    assert!(ctl(&vm.api, &["pause"]).status.success());
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&memfile)
            .unwrap();
        // Below 3 GiB a guest-physical address is its offset in the file.
        f.write_all_at(&u64::MAX.to_le_bytes(), base + 7 * 4096)
            .unwrap();
    }
    assert!(ctl(&vm.api, &["resume"]).status.success());
    wait_for("the damage to be reported", Duration::from_secs(30), || {
        read_text(&vm.console).contains("dirty: lost write page=")
            && dirty_reports(&vm.console)
                .last()
                .is_some_and(|&(_, _, bad)| bad > 0)
    });
    let text = read_text(&vm.console);
    assert!(
        text.contains(&format!("found={}", u64::MAX)),
        "the report names what it found"
    );
    assert!(ctl(&vm.api, &["shutdown"]).status.success());
    let _ = std::fs::remove_file(memfile);
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn corrupt_truncated_and_foreign_state_is_refused_and_nothing_is_lost() {
    let _turn = one_at_a_time();
    let dir = scratch("av-bad");
    let mut vmm = counting_vm(&dir);
    wait_for("counter", Duration::from_secs(30), || {
        counters(&vmm.console).len() >= 3
    });
    let snap = dir.join("snap");
    assert!(
        ctl(&vmm.api, &["snapshot", snap.to_str().unwrap(), "--exit"])
            .status
            .success()
    );
    assert!(wait_exit(&mut vmm.child.0, "the VMM").success());
    let good = std::fs::read(snap.join("state.bin")).unwrap();

    let variants: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "corrupt",
            {
                let mut b = good.clone();
                let i = b.len() / 2;
                b[i] ^= 0x5a;
                b
            },
            "checksum",
        ),
        ("truncated", good[..good.len() / 2].to_vec(), "length"),
        ("header-only", good[..10].to_vec(), "truncated"),
        ("foreign", std::fs::read("/bin/true").unwrap(), "bad magic"),
        (
            "future",
            {
                let mut b = good.clone();
                b[8] = 99;
                b
            },
            "version 99",
        ),
        (
            "bincode",
            bincode_state("0.0.9-old"),
            "written by kemari 0.0.9-old, is no longer read",
        ),
    ];
    for (name, bytes, needle) in variants {
        let bad = dir.join(name);
        std::fs::create_dir_all(&bad).unwrap();
        std::fs::write(bad.join("state.bin"), &bytes).unwrap();
        std::fs::copy(snap.join("memory.bin"), bad.join("memory.bin")).unwrap();
        let out = run_with_timeout(
            kemari()
                .arg("--restore")
                .arg(&bad)
                .args(["--serial", "null"]),
            Duration::from_secs(30),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(
            err.contains(needle),
            "{name}: expected {needle:?} in: {err}"
        );
        assert!(!err.contains("panicked"), "{name}: {err}");
    }
    // Nothing was lost: the real snapshot still restores and continues.
    assert_eq!(std::fs::read(snap.join("state.bin")).unwrap(), good);
    let last = *counters(&vmm.console).last().unwrap();
    let new = spawn_vmm(
        &["--restore".into(), snap.display().to_string()],
        &dir.join("console-2.log"),
        &dir.join("api-2.sock"),
        &[],
    );
    wait_for("counter after restore", Duration::from_secs(30), || {
        counters(&new.console).len() >= 2
    });
    let first = counters(&new.console)[0];
    assert!(first > 1 && first <= last + 2, "{last} -> {first}");
    assert!(ctl(&new.api, &["shutdown"]).status.success());
}

/// A state file of the retired format 2 (bincode, kemari until 2026-11-25):
/// the container with a payload whose first field is the JSON head behind
/// bincode's one-byte length, as that kemari wrote it; the rest is not read.
fn bincode_state(written_by: &str) -> Vec<u8> {
    let head = format!(r#"{{"kemari_version":"{written_by}","saved_at_ms":1}}"#);
    let mut payload = vec![head.len() as u8];
    payload.extend_from_slice(head.as_bytes());
    payload.extend_from_slice(&[0xfd; 512]);
    let mut b = b"KEMARIVM".to_vec();
    b.extend_from_slice(&2u32.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    b.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b.extend_from_slice(&payload);
    b
}

fn mode(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

/// The extents `memory.extents` lists: (offset, length).
fn image_extents(dir: &std::path::Path) -> Vec<(u64, u32)> {
    let b = std::fs::read(dir.join("memory.extents")).unwrap();
    assert_eq!(&b[..8], b"KEMARIMX");
    b[32..b.len() - 4]
        .chunks_exact(16)
        .map(|e| {
            (
                u64::from_le_bytes(e[..8].try_into().unwrap()),
                u32::from_le_bytes(e[8..12].try_into().unwrap()),
            )
        })
        .collect()
}

/// Issue 24: every file kemari writes for a VM is 0600 (whatever the
/// umask); a snapshot is not written over an existing one without
/// `--force`; a memory image with one byte flipped inside an extent is
/// refused naming that extent, the image left as it is and the VM that
/// wrote it running on.
#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn snapshot_files_are_private_checked_and_kept_unless_forced() {
    let _turn = one_at_a_time();
    let dir = scratch("av-private");
    let memfile = shm_file("private");
    // Under the usual umask (022) these files were 0644 before issue 24.
    let vmm = guest_vm(&dir, "128M", Some(&memfile), "counter=100");
    wait_for("counter", Duration::from_secs(30), || {
        counters(&vmm.console).len() >= 3
    });
    assert_eq!(mode(&memfile), 0o600, "the memory file kemari created");
    let snap = dir.join("snap");
    let out = ctl(&vmm.api, &["snapshot", snap.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in ["state.bin", "memory.bin", "memory.extents"] {
        assert_eq!(mode(&snap.join(f)), 0o600, "{f}");
    }

    // Not overwritten without --force; the VM is not even paused.
    let state = std::fs::read(snap.join("state.bin")).unwrap();
    let out = ctl(&vmm.api, &["snapshot", snap.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("already holds a snapshot") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(std::fs::read(snap.join("state.bin")).unwrap(), state);
    let out = ctl(&vmm.api, &["snapshot", snap.to_str().unwrap(), "--force"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_ne!(
        std::fs::read(snap.join("state.bin")).unwrap(),
        state,
        "replaced"
    );

    // One byte flipped inside an extent of the guest's memory (past the
    // first MiB: the kernel's image), same size.
    let (offset, len) = *image_extents(&snap)
        .iter()
        .find(|&&(offset, _)| offset >= 1 << 20)
        .expect("the image has extents");
    let at = offset + u64::from(len) / 2;
    let image = snap.join("memory.bin");
    let size = std::fs::metadata(&image).unwrap().len();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&image)
            .unwrap();
        let mut b = [0u8];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0xff], at).unwrap();
    }
    let damaged = std::fs::read(&image).unwrap();
    let out = run_with_timeout(
        kemari()
            .arg("--restore")
            .arg(&snap)
            .args(["--serial", "null"]),
        Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for needle in [
        image.display().to_string(),
        format!("the extent at offset {offset:#x} ({len} bytes)"),
        "memory.extents".into(),
        "take a new snapshot".into(),
    ] {
        assert!(err.contains(&needle), "expected {needle:?} in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), size);
    assert!(
        std::fs::read(&image).unwrap() == damaged,
        "the image is left as it is"
    );
    // The VM that wrote it runs on, and a new snapshot of it restores.
    let n = counters(&vmm.console).len();
    wait_for("the VM runs on", Duration::from_secs(30), || {
        counters(&vmm.console).len() > n + 2
    });
    let again = dir.join("again");
    let out = ctl(&vmm.api, &["snapshot", again.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let restored = spawn_vmm(
        &["--restore".into(), again.display().to_string()],
        &dir.join("console-2.log"),
        &dir.join("api-2.sock"),
        &[],
    );
    wait_for("counter after restore", Duration::from_secs(30), || {
        counters(&restored.console).len() >= 2
    });
    assert!(ctl(&restored.api, &["shutdown"]).status.success());

    // Warm restart: config.json and state.bin.
    let warm = dir.join("warm");
    let out = ctl(
        &vmm.api,
        &["warm-restart", warm.to_str().unwrap(), "--prepare"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(mode(&warm.join("config.json")), 0o600);
    let out = ctl(&vmm.api, &["warm-restart", warm.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(mode(&warm.join("state.bin")), 0o600);
    let mut vmm = vmm;
    assert!(wait_exit(&mut vmm.child.0, "the VMM").success());
    let _ = std::fs::remove_file(memfile);
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn warm_restart_without_a_named_memory_file_is_refused_and_the_vm_runs_on() {
    let _turn = one_at_a_time();
    let dir = scratch("av-warm-memfd");
    let vmm = counting_vm(&dir);
    wait_for("counter", Duration::from_secs(30), || {
        counters(&vmm.console).len() >= 2
    });
    let out = ctl(&vmm.api, &["warm-restart", dir.join("w").to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--memory-file"));
    let n = counters(&vmm.console).len();
    wait_for("the VM runs on", Duration::from_secs(30), || {
        counters(&vmm.console).len() > n + 2
    });
    assert!(ctl(&vmm.api, &["shutdown"]).status.success());
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn several_vms_warm_restart_in_parallel() {
    let _turn = one_at_a_time();
    let dir = scratch("av-warm-many");
    let vms: Vec<(Vmm, PathBuf)> = (0..3)
        .map(|i| {
            let memfile = PathBuf::from(format!(
                "/dev/shm/kemari-av-many-{}-{i}",
                std::process::id()
            ));
            let _ = std::fs::remove_file(&memfile);
            let vmm = spawn_vmm(
                &[
                    "--kernel".into(),
                    guest_elf().display().to_string(),
                    "--memory".into(),
                    "256M".into(),
                    "--memory-file".into(),
                    memfile.display().to_string(),
                    "--cmdline".into(),
                    "counter=200".into(),
                ],
                &dir.join(format!("console-{i}-a.log")),
                &dir.join(format!("api-{i}-a.sock")),
                &[],
            );
            (vmm, memfile)
        })
        .collect();
    for (vmm, _) in &vms {
        wait_for("counter", Duration::from_secs(30), || {
            counters(&vmm.console).len() >= 2
        });
    }
    // All three save at once.
    let saves: Vec<_> = vms
        .iter()
        .enumerate()
        .map(|(i, (vmm, _))| {
            let api = vmm.api.clone();
            let state = dir.join(format!("warm-{i}"));
            std::thread::spawn(move || ctl(&api, &["warm-restart", state.to_str().unwrap()]))
        })
        .collect();
    for s in saves {
        let out = s.join().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut restored = Vec::new();
    for (i, (mut vmm, memfile)) in vms.into_iter().enumerate() {
        assert!(wait_exit(&mut vmm.child.0, "an old VMM").success());
        let last = *counters(&vmm.console).last().unwrap();
        let new = spawn_vmm(
            &[
                "--restore".into(),
                dir.join(format!("warm-{i}")).display().to_string(),
            ],
            &dir.join(format!("console-{i}-b.log")),
            &dir.join(format!("api-{i}-b.sock")),
            &[],
        );
        restored.push((new, last, memfile));
    }
    for (new, last, memfile) in restored {
        wait_for("counter after restore", Duration::from_secs(30), || {
            counters(&new.console).len() >= 2
        });
        let first = counters(&new.console)[0];
        assert!(first > 1 && first <= last + 2, "{last} -> {first}");
        assert!(ctl(&new.api, &["shutdown"]).status.success());
        let _ = std::fs::remove_file(memfile);
    }
}

/// A 128 MiB test guest that only counts, with its console and API in `dir`.
fn counting_vm(dir: &std::path::Path) -> Vmm {
    guest_vm(dir, "128M", None, "counter=100")
}

/// The test guest with `memory` (in `memory_file` if given) running
/// `cmdline`, its console and API in `dir` (`console-1.log`, `api-1.sock`).
fn guest_vm(
    dir: &std::path::Path,
    memory: &str,
    memory_file: Option<&std::path::Path>,
    cmdline: &str,
) -> Vmm {
    let mut args = vec![
        "--kernel".into(),
        guest_elf().display().to_string(),
        "--memory".into(),
        memory.into(),
        "--cmdline".into(),
        cmdline.into(),
    ];
    if let Some(f) = memory_file {
        args.push("--memory-file".into());
        args.push(f.display().to_string());
    }
    spawn_vmm(
        &args,
        &dir.join("console-1.log"),
        &dir.join("api-1.sock"),
        &[],
    )
}
