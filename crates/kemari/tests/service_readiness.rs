//! systemd readiness (`sd_notify`, packaging/systemd/kemari@.service is
//! `Type=notify`), with real kemari processes and the test guest: a
//! test-owned Unix datagram socket in `NOTIFY_SOCKET`, as systemd sets it.
//!
//! - a booted VM: `READY=1` once the VM runs, and the API answers the
//!   moment it arrives; the send passed kemari's seccomp filters (the VMM
//!   lives on);
//! - a live migration's destination: `READY=1` once it listens (the port
//!   is in LISTEN when it arrives, and the API answers), then again with
//!   the VM's state when the VM has arrived;
//! - a fault-tolerance standby: `READY=1` once it listens;
//! - without `NOTIFY_SOCKET`, nothing is sent and nothing fails (every
//!   other test).

use std::path::Path;
use std::time::Duration;

use kemari_testkit::scenario::*;
use kemari_testkit::*;

const PATIENCE: Duration = Duration::from_secs(60);

fn info(api: &Path) -> serde_json::Value {
    let out = ctl(api, &["info"]);
    assert!(
        out.status.success(),
        "the API does not answer: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn boot_args(cmdline: &str) -> Vec<String> {
    vec![
        "--kernel".into(),
        guest_elf().display().to_string(),
        "--memory".into(),
        "64M".into(),
        "--cmdline".into(),
        cmdline.into(),
    ]
}

/// Shuts the VMM down through its API; it must exit 0.
fn shut_down(vmm: &mut Vmm) {
    assert!(ctl(&vmm.api, &["shutdown"]).status.success());
    let status = wait_exit(&mut vmm.child.0, "kemari after shutdown");
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_booted_vm_is_ready_once_it_runs_and_its_api_answers() {
    let dir = scratch("notify-boot");
    let notify = NotifySocket::bind(&dir);
    let mut vmm = spawn_vmm(
        &boot_args("counter=50"),
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[notify.env()],
    );
    let ready = notify.next("kemari's readiness", PATIENCE);
    // At once: the API answers, and the VM runs.
    let vm = info(&vmm.api);
    assert_eq!(
        ready.get("READY").map(String::as_str),
        Some("1"),
        "{ready:?}"
    );
    assert_eq!(
        ready.get("STATUS").map(String::as_str),
        Some("VM running (boot)"),
        "{ready:?}"
    );
    assert_eq!(vm["state"], "running", "{vm}");
    // The send passed the main thread's seccomp filter: the VMM lives on.
    wait_for("the guest's counter", PATIENCE, || {
        counters(&vmm.console).len() >= 2
    });
    assert!(vmm.child.0.try_wait().unwrap().is_none());
    assert!(notify.pending().is_none(), "one notification only");
    shut_down(&mut vmm);
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_migration_destination_is_ready_when_it_listens_and_again_when_its_vm_runs() {
    let _turn = one_at_a_time();
    let dir = scratch("notify-incoming");
    let key = test_key(&dir);
    let notify = NotifySocket::bind(&dir);
    let port = free_port();
    let to = format!("127.0.0.1:{port}");
    let mut dst = spawn_vmm(
        &[
            "--incoming".into(),
            to.clone(),
            "--migration-key-file".into(),
            key.display().to_string(),
        ],
        &dir.join("console-2.log"),
        &dir.join("api-2.sock"),
        &[notify.env()],
    );
    let listening_now = notify.next("the destination's readiness", PATIENCE);
    // At once: the port listens (seen without connecting: it accepts one
    // connection only) and the API answers.
    assert!(listening(port), "READY=1 before the port listens");
    let waiting = info(&dst.api);
    assert_eq!(listening_now.get("READY").map(String::as_str), Some("1"));
    assert_eq!(
        listening_now.get("STATUS"),
        Some(&format!("waiting for its VM on {to}")),
        "{listening_now:?}"
    );
    assert!(waiting["state"] != "running", "{waiting}");

    let mut src = spawn_vmm(
        &boot_args("counter=50"),
        &dir.join("console-1.log"),
        &dir.join("api-1.sock"),
        &[],
    );
    wait_for("the source's counter", PATIENCE, || {
        counters(&src.console).len() >= 2
    });
    let out = run_with_timeout(
        kemarictl(&src.api).args(["migrate", "--to", &to, "--key-file", key.to_str().unwrap()]),
        Duration::from_secs(120),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let arrived = notify.next("the destination's VM running", PATIENCE);
    assert_eq!(arrived.get("READY").map(String::as_str), Some("1"));
    assert_eq!(
        arrived.get("STATUS").map(String::as_str),
        Some("VM running (live_migration)"),
        "{arrived:?}"
    );
    assert_eq!(info(&dst.api)["state"], "running");
    wait_exit(&mut src.child.0, "the source after the migration");
    shut_down(&mut dst);
}

#[test]
fn a_standby_is_ready_when_it_listens_for_its_primary() {
    let dir = scratch("notify-standby");
    let key = test_key(&dir);
    let notify = NotifySocket::bind(&dir);
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let standby = spawn_vmm(
        &[
            "--ft-standby".into(),
            listen.clone(),
            "--migration-key-file".into(),
            key.display().to_string(),
        ],
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[notify.env()],
    );
    let ready = notify.next("the standby's readiness", PATIENCE);
    assert!(listening(port), "READY=1 before the port listens");
    let vm = info(&standby.api);
    assert_eq!(ready.get("READY").map(String::as_str), Some("1"));
    assert_eq!(
        ready.get("STATUS"),
        Some(&format!("waiting for its VM on {listen}")),
        "{ready:?}"
    );
    assert_eq!(vm["role"], "standby", "{vm}");
}
