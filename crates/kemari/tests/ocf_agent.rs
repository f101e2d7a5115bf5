//! The Pacemaker resource agent (`packaging/ocf/kemari`) with a real kemari
//! and the test guest: `ocf-tester` (Debian's `resource-agents`) passes on
//! it, and its live migration (migrate_to on the source, migrate_from on
//! the target) moves a running VM — two "nodes" on this host, the target
//! reached through a stand-in for ssh that runs the command here with the
//! target's socket and console.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kemari_testkit::bins::bin;
use kemari_testkit::scenario::counters;
use kemari_testkit::*;

/// The agent, copied where `ocf-tester` can run it as `nobody`.
fn agent(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/ocf/kemari");
    let dst = dir.join("kemari-agent");
    std::fs::copy(&src, &dst).unwrap();
    sh(&format!("chmod 755 {} {}", dir.display(), dst.display()));
    dst
}

/// The resource's parameters: the test guest counting.
fn params() -> Vec<(String, String)> {
    [
        ("binary", bin("kemari").display().to_string()),
        ("ctl", bin("kemarictl").display().to_string()),
        ("kernel", guest_elf().display().to_string()),
        ("memory", "64M".into()),
        ("cmdline", "counter=50".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

#[test]
#[cfg_attr(
    any(no_kvm, no_ocf_tester),
    ignore = "needs /dev/kvm and ocf-tester (Debian resource-agents)"
)]
fn ocf_tester_passes_with_a_real_kemari() {
    let dir = scratch("ocf-tester");
    let agent = agent(&dir);
    let mut cmd = Command::new("ocf-tester");
    cmd.args(["-n", "kemari-ocf-test"]);
    let mut p = params();
    p.push((
        "api_socket".into(),
        dir.join("api.sock").display().to_string(),
    ));
    p.push((
        "serial".into(),
        format!("file:{}", dir.join("console.log").display()),
    ));
    for (k, v) in &p {
        cmd.arg("-o").arg(format!("{k}={v}"));
    }
    let out = run_with_timeout(cmd.arg(&agent), Duration::from_secs(300));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("passed all tests"),
        "ocf-tester: {text}"
    );
    // The guest really ran (ocf-tester starts it twice).
    assert!(
        counters(&dir.join("console.log")).len() >= 2,
        "{}",
        read_text(&dir.join("console.log"))
    );
    assert!(!dir.join("api.sock.pid").exists(), "stopped at the end");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs the agent's `action` with `params` and `extra`; its exit code.
fn action(
    agent: &Path,
    action: &str,
    params: &[(String, String)],
    extra: &[(&str, String)],
) -> i32 {
    let mut cmd = Command::new(agent);
    cmd.arg(action)
        .env("OCF_ROOT", "/usr/lib/ocf")
        .env("OCF_RESOURCE_INSTANCE", "kemari-ocf-migrate");
    for (k, v) in params {
        cmd.env(format!("OCF_RESKEY_{k}"), v);
    }
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let out = run_with_timeout(&mut cmd, Duration::from_secs(180));
    eprintln!(
        "{action}: {:?} {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    out.status.code().unwrap_or(-1)
}

#[test]
#[cfg_attr(
    any(no_kvm, no_ocf_tester),
    ignore = "needs /dev/kvm and the OCF shell functions (Debian resource-agents)"
)]
fn migrate_to_and_migrate_from_move_the_running_vm() {
    let dir = scratch("ocf-migrate");
    let agent = agent(&dir);
    let key = dir.join("key");
    write_key(&key, "ocf-migration-test-key-0123456789\n");
    let node = |n: &str| {
        (
            dir.join(format!("{n}.sock")).display().to_string(),
            dir.join(format!("console-{n}.log")),
        )
    };
    let (sock_a, console_a) = node("a");
    let (sock_b, console_b) = node("b");
    // ssh to the target, here: the same host, the target's socket and console.
    let rsh = dir.join("rsh");
    std::fs::write(
        &rsh,
        format!(
            "#!/bin/sh\nshift\ncmd=$(printf '%s' \"$*\" | sed -e 's#{sock_a}#{sock_b}#g' -e 's#{}#{}#g')\nexec sh -c \"$cmd\"\n",
            console_a.display(),
            console_b.display()
        ),
    )
    .unwrap();
    sh(&format!("chmod 755 {}", rsh.display()));
    let mut p = params();
    p.push(("migration_key".into(), key.display().to_string()));
    p.push(("migration_port".into(), free_port().to_string()));
    p.push(("remote_shell".into(), rsh.display().to_string()));
    let on = |sock: &str, console: &Path| {
        let mut q = p.clone();
        q.push(("api_socket".into(), sock.to_owned()));
        q.push(("serial".into(), format!("file:{}", console.display())));
        q
    };
    let (a, b) = (on(&sock_a, &console_a), on(&sock_b, &console_b));
    assert_eq!(action(&agent, "validate-all", &a, &[]), 0);
    assert_eq!(action(&agent, "start", &a, &[]), 0);
    wait_for("the guest to count", Duration::from_secs(30), || {
        counters(&console_a).len() >= 3
    });
    let target = [("OCF_RESKEY_CRM_meta_migrate_target", "localhost".to_owned())];
    assert_eq!(action(&agent, "migrate_to", &a, &target), 0);
    let source = [("OCF_RESKEY_CRM_meta_migrate_source", "localhost".to_owned())];
    assert_eq!(action(&agent, "migrate_from", &b, &source), 0);
    assert_eq!(action(&agent, "monitor", &b, &[]), 0, "runs on the target");
    assert_eq!(
        action(&agent, "monitor", &a, &[]),
        7,
        "gone from the source"
    );
    // The guest went on where it was.
    let last_a = *counters(&console_a).last().unwrap();
    wait_for(
        "the guest to count on the target",
        Duration::from_secs(30),
        || counters(&console_b).len() >= 3,
    );
    let after = counters(&console_b);
    assert!(
        after[0] > 1 && after[0] <= last_a + 2,
        "the counter restarted or jumped: {last_a} then {after:?}"
    );
    assert_eq!(action(&agent, "stop", &b, &[]), 0);
    assert_eq!(action(&agent, "monitor", &b, &[]), 7);
    assert_eq!(action(&agent, "stop", &a, &[]), 0, "stopping a stopped VM");
    let _ = std::fs::remove_dir_all(&dir);
}
