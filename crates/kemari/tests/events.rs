//! The VM's identity and events, with real kemari processes and the test
//! guest:
//!
//! - `GET /vm/events` (and `kemarictl events`, and `--events-file`) gets
//!   pause, resume, a snapshot's start and end and the shutdown, in order,
//!   each with the VM's id, name and a timestamp; the stream ends after the
//!   shutdown;
//! - `--id`/`--name` show in `GET /vm` and survive a zero-copy migration:
//!   the destination's `started` event and `GET /vm` carry them; the
//!   source's stream ends after the migration's `operation_completed`;
//! - a live migration's source streams `operation_started`, then
//!   `operation_progress` (phase, round, bytes; at each new phase or round
//!   and every second), then `operation_completed`; a migration to
//!   nowhere, `operation_started` then `operation_failed`;
//! - the guest's uptime (`guest_uptime_ms`) goes on across a snapshot
//!   restore, a zero-copy and a live migration;
//! - a fault-tolerance standby answers `GET /vm` with its role, pid,
//!   version, uptime and name, and still refuses actions;
//! - a guest's triple fault is a `crashed` event, in the events file
//!   before kemari exits.
//!
//! Bounds are generous (30 s): the machine is shared.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Stdio;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use kemari::api::client::request_with_timeout;
use kemari_testkit::scenario::*;
use kemari_testkit::*;
use serde_json::Value;

const PATIENCE: Duration = Duration::from_secs(30);

/// A subscription to `GET /vm/events`, made once the answer's head came
/// (the VMM subscribed before it wrote it): each event, then `None` at the
/// stream's end.
fn subscribe(api: &Path) -> Receiver<Option<Value>> {
    let mut s = UnixStream::connect(api).expect("connect to the API");
    s.write_all(
        b"GET /vm/events HTTP/1.1\r\nHost: kemari\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    s.set_read_timeout(Some(PATIENCE * 4)).unwrap();
    let mut r = BufReader::new(s);
    let mut status = String::new();
    r.read_line(&mut status).unwrap();
    let mut ndjson = false;
    loop {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        if line.trim().is_empty() {
            break;
        }
        ndjson |= line.to_ascii_lowercase().contains("application/x-ndjson");
    }
    assert!(status.contains(" 200 ") && ndjson, "{status}");
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        for line in r.lines() {
            let Ok(line) = line else { break };
            let v: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("event line is not JSON: {e}: {line}"));
            if tx.send(Some(v)).is_err() {
                return;
            }
        }
        let _ = tx.send(None);
    });
    rx
}

/// Every event until the stream ends (panics if it does not within
/// [`PATIENCE`]).
fn to_the_end(rx: &Receiver<Option<Value>>) -> Vec<Value> {
    let deadline = Instant::now() + PATIENCE;
    let mut events = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Some(v)) => events.push(v),
            Ok(None) | Err(RecvTimeoutError::Disconnected) => return events,
            Err(RecvTimeoutError::Timeout) => {
                panic!("the event stream did not end; so far: {events:#?}")
            }
        }
    }
}

/// The next event of kind `kind`, skipping others.
fn next_of(rx: &Receiver<Option<Value>>, kind: &str) -> Value {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Some(v)) if v["event"] == kind => return v,
            Ok(Some(_)) => {}
            other => panic!("no {kind} event: {other:?}"),
        }
    }
}

/// The kinds of `events`, without `operation_progress` (how many come
/// depends on how long an operation takes; [`progress_in_order`] checks
/// where they stand).
fn kinds(events: &[Value]) -> Vec<&str> {
    events
        .iter()
        .map(|e| e["event"].as_str().unwrap_or("?"))
        .filter(|k| *k != "operation_progress")
        .collect()
}

/// Every `operation_progress` of `events` comes after its operation's
/// `operation_started` and before its end, its counters never go back;
/// returns them.
fn progress_in_order(events: &[Value]) -> Vec<Value> {
    let mut running: Option<u64> = None;
    let mut last: Option<&Value> = None;
    let mut seen = Vec::new();
    for e in events {
        match e["event"].as_str().unwrap_or("?") {
            "operation_started" => running = e["operation"].as_u64(),
            "operation_completed" | "operation_failed" | "operation_cancelled" => {
                assert_eq!(running, e["operation"].as_u64(), "{events:#?}");
                running = None;
                last = None;
            }
            "operation_progress" => {
                assert!(
                    running.is_some() && running == e["operation"].as_u64(),
                    "progress outside its operation: {events:#?}"
                );
                assert!(e["phase"].is_string() && e["kind"].is_string(), "{e}");
                if let Some(l) = last {
                    for counter in ["round", "bytes_sent", "pages_sent"] {
                        assert!(e[counter].as_u64() >= l[counter].as_u64(), "{l}\n{e}");
                    }
                }
                last = Some(e);
                seen.push(e.clone());
            }
            _ => {}
        }
    }
    seen
}

fn info(api: &Path) -> Value {
    request_with_timeout(api, "GET", "/vm", None, PATIENCE).expect("GET /vm")
}

fn succeeded(out: &std::process::Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

/// Each event names the VM and carries an RFC 3339 UTC timestamp with
/// microseconds, in order.
fn check_stamped(events: &[Value], id: &str, name: Option<&str>) {
    let mut last = String::new();
    for e in events {
        assert_eq!(e["vm"], id, "{e}");
        assert_eq!(e["name"].as_str(), name, "{e}");
        let t = e["timestamp"].as_str().unwrap_or_else(|| panic!("{e}"));
        // 2026-11-25T10:00:00.123456Z
        assert_eq!(t.len(), 27, "{t}");
        assert!(
            t.ends_with('Z') && &t[10..11] == "T" && &t[19..20] == ".",
            "{t}"
        );
        assert!(t[20..26].chars().all(|c| c.is_ascii_digit()), "{t}");
        assert!(*t >= *last, "{t} after {last}");
        last = t.to_owned();
    }
}

fn guest_args(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "--kernel".into(),
        guest_elf().display().to_string(),
        "--memory".into(),
        "64M".into(),
        "--cmdline".into(),
        "counter=100".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// `GET /vm` of a VM that arrived (restored, migrated) with a guest that
/// had run `before` ms: its guest uptime went on from there — at least
/// `before` plus the time this process has run the machine (`uptime_ms`;
/// 2 ms for the rounding of two readings).
fn guest_uptime_carried(before: u64, after: &Value) {
    let guest = after["guest_uptime_ms"].as_u64().expect("guest_uptime_ms");
    let here = after["uptime_ms"].as_u64().expect("uptime_ms");
    assert!(
        guest + 2 >= before + here,
        "guest uptime {before} ms before: {after}"
    );
}

/// The guest's uptime now, ms.
fn guest_uptime(api: &Path) -> u64 {
    info(api)["guest_uptime_ms"]
        .as_u64()
        .expect("guest_uptime_ms")
}

fn wait_api(api: &Path) {
    wait_for("the API socket", PATIENCE, || {
        api.exists() && request_with_timeout(api, "GET", "/vm", None, PATIENCE).is_ok()
    });
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn pause_resume_snapshot_and_shutdown_arrive_in_order_then_the_stream_ends() {
    let dir = scratch("events-order");
    let api = dir.join("api.sock");
    let file = dir.join("events.jsonl");
    let mut vmm = spawn_vmm(
        &guest_args(&[
            "--name",
            "events-a",
            "--id",
            "vm-events-a",
            "--events-file",
            file.to_str().unwrap(),
        ]),
        &dir.join("console.log"),
        &api,
        &[],
    );
    wait_api(&api);
    let stream = subscribe(&api);
    let mut ctl_events = kemarictl(&api)
        .arg("events")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ctl_out = ctl_events.stdout.take().unwrap();
    let printed = std::thread::spawn(move || {
        let mut text = String::new();
        ctl_out.read_to_string(&mut text).unwrap();
        text
    });
    wait_for("the guest to count", PATIENCE, || {
        !counters(&vmm.console).is_empty()
    });
    let v = info(&api);
    assert_eq!(
        (v["id"].as_str(), v["name"].as_str()),
        (Some("vm-events-a"), Some("events-a")),
        "{v}"
    );
    succeeded(&ctl(&api, &["pause"]));
    succeeded(&ctl(&api, &["resume"]));
    let snap = dir.join("snap");
    let before_snapshot = guest_uptime(&api);
    succeeded(&ctl(&api, &["snapshot", snap.to_str().unwrap()]));
    succeeded(&ctl(&api, &["shutdown"]));

    let events = to_the_end(&stream);
    let seen: Vec<&str> = kinds(&events)
        .into_iter()
        .filter(|k| *k != "started")
        .collect();
    assert_eq!(
        seen,
        [
            "paused",
            "resumed",
            "operation_started",
            "operation_completed",
            "shutdown"
        ],
        "{events:#?}"
    );
    check_stamped(&events, "vm-events-a", Some("events-a"));
    let op = |k: &str| events.iter().find(|e| e["event"] == k).unwrap().clone();
    assert_eq!(op("operation_started")["kind"], "snapshot");
    assert_eq!(
        op("operation_completed")["operation"],
        op("operation_started")["operation"]
    );
    assert_eq!(op("operation_completed")["result"]["exit"], false);
    assert_eq!(op("shutdown")["reason"], "api");
    assert!(wait_exit(&mut vmm.child.0, "kemari").success());

    // kemarictl printed the same lines (from whenever it subscribed) and
    // ended with the stream.
    let status = wait_exit(&mut ctl_events, "kemarictl events");
    let text = printed.join().unwrap();
    assert!(status.success(), "{text}");
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(kinds(&lines).last(), Some(&"shutdown"), "{text}");
    assert!(kinds(&lines).contains(&"operation_completed"), "{text}");

    // The events file has them all, `started` (a boot) first.
    let written: Vec<Value> = read_text(&file)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        kinds(&written),
        [
            "started",
            "paused",
            "resumed",
            "operation_started",
            "operation_completed",
            "shutdown"
        ]
    );
    assert_eq!(written[0]["how"], "boot");
    progress_in_order(&written);
    check_stamped(&written, "vm-events-a", Some("events-a"));

    // Restored from the snapshot: the guest's uptime goes on, the
    // machine's in this process starts again.
    let restored_api = dir.join("api-restored.sock");
    let mut restored = spawn_vmm(
        &["--restore".into(), snap.display().to_string()],
        &dir.join("console-restored.log"),
        &restored_api,
        &[],
    );
    wait_api(&restored_api);
    let mut v = Value::Null;
    wait_for("the restored VM to run", PATIENCE, || {
        v = info(&restored_api);
        v["state"] == "running"
    });
    guest_uptime_carried(before_snapshot, &v);
    succeeded(&ctl(&restored_api, &["shutdown"]));
    assert!(wait_exit(&mut restored.child.0, "the restored kemari").success());
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn the_id_and_name_survive_a_zero_copy_migration() {
    let dir = scratch("events-identity");
    let src_api = dir.join("api-1.sock");
    let mut src = spawn_vmm(
        &guest_args(&["--name", "mover", "--id", "0123456789abcdef"]),
        &dir.join("console-1.log"),
        &src_api,
        &[],
    );
    wait_api(&src_api);
    // Without --id, a first boot gets 16 hex digits; this one has its own.
    let v = info(&src_api);
    assert_eq!(v["id"], "0123456789abcdef", "{v}");
    assert_eq!(v["name"], "mover", "{v}");
    let src_events = subscribe(&src_api);

    let sock = dir.join("incoming.sock");
    let dst_api = dir.join("api-2.sock");
    let mut dst = spawn_vmm(
        &["--incoming-local".into(), sock.display().to_string()],
        &dir.join("console-2.log"),
        &dst_api,
        &[],
    );
    wait_api(&dst_api);
    let waiting = info(&dst_api);
    assert_eq!(waiting["state"], "starting", "{waiting}");
    assert_eq!(waiting["id"], Value::Null, "not known yet: {waiting}");
    let dst_events = subscribe(&dst_api);
    wait_for("the destination's socket", PATIENCE, || sock.exists());
    wait_for("the guest to count", PATIENCE, || {
        !counters(&src.console).is_empty()
    });
    let before_migration = guest_uptime(&src_api);
    let report = succeeded(&ctl(&src_api, &["migrate-local", sock.to_str().unwrap()]));
    assert!(report["downtime_ms"].is_number(), "{report}");

    // The source: the operation, then the end of its stream (its own
    // `started` first if the subscription came before the boot ended: the
    // API answers while the VM is still starting).
    let mut gone = to_the_end(&src_events);
    if gone.first().is_some_and(|e| e["event"] == "started") {
        assert_eq!(gone[0]["how"], "boot", "{gone:#?}");
        gone.remove(0);
    }
    assert_eq!(
        kinds(&gone),
        ["operation_started", "operation_completed"],
        "{gone:#?}"
    );
    progress_in_order(&gone);
    gone.retain(|e| e["event"] != "operation_progress");
    assert_eq!(gone[1]["kind"], "migrate_local");
    check_stamped(&gone, "0123456789abcdef", Some("mover"));
    assert!(wait_exit(&mut src.child.0, "the source").success());

    // The destination: the same VM.
    let started = next_of(&dst_events, "started");
    assert_eq!(started["how"], "zero_copy_migration", "{started}");
    check_stamped(
        std::slice::from_ref(&started),
        "0123456789abcdef",
        Some("mover"),
    );
    let v = info(&dst_api);
    assert_eq!(v["id"], "0123456789abcdef", "{v}");
    assert_eq!(v["name"], "mover", "{v}");
    assert_eq!(v["state"], "running", "{v}");
    guest_uptime_carried(before_migration, &v);
    succeeded(&ctl(&dst_api, &["shutdown"]));
    let last = to_the_end(&dst_events);
    assert_eq!(kinds(&last), ["shutdown"], "{last:#?}");
    assert!(wait_exit(&mut dst.child.0, "the destination").success());
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_standby_answers_get_vm_with_its_role() {
    let dir = scratch("events-standby");
    let key = test_key(&dir);
    let api = dir.join("api.sock");
    let mut standby = spawn_vmm(
        &[
            "--ft-standby".into(),
            format!("127.0.0.1:{}", free_port()),
            "--migration-key-file".into(),
            key.display().to_string(),
            "--name".into(),
            "spare".into(),
        ],
        &dir.join("console.log"),
        &api,
        &[],
    );
    wait_api(&api);
    let v = info(&api);
    assert_eq!(v["role"], "standby", "{v}");
    assert_eq!(v["state"], "standby", "{v}");
    assert_eq!(v["pid"], standby.child.0.id(), "{v}");
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"), "{v}");
    assert!(v["uptime_ms"].is_u64(), "{v}");
    assert_eq!(v["name"], "spare", "{v}");
    assert_eq!(
        v["id"],
        Value::Null,
        "its primary's VM is not known yet: {v}"
    );
    // Actions are still refused.
    let out = ctl(&api, &["pause"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("standby"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Its events can be followed (a failover would be one).
    drop(subscribe(&api));
    assert!(standby.child.0.try_wait().unwrap().is_none());
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_triple_fault_is_a_crashed_event_written_before_the_exit() {
    let dir = scratch("events-crash");
    // An empty IDT, then an exception: #UD, #GP, #DF, shutdown.
    let elf = build_stub_mode(&dir, 3, 0, 1);
    let file = dir.join("events.jsonl");
    let out = run_with_timeout(
        kemari()
            .arg("--kernel")
            .arg(&elf)
            .args(["--memory", "64M", "--name", "crasher", "--events-file"])
            .arg(&file),
        PATIENCE,
    );
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written: Vec<Value> = read_text(&file)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(kinds(&written), ["started", "crashed"], "{written:#?}");
    assert!(
        written[1]["reason"]
            .as_str()
            .unwrap()
            .contains("triple fault"),
        "{}",
        written[1]
    );
    let id = written[0]["vm"].as_str().unwrap().to_owned();
    assert!(
        id.len() == 16 && id.chars().all(|c| c.is_ascii_hexdigit()),
        "{id}"
    );
    check_stamped(&written, &id, Some("crasher"));
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_live_migration_streams_its_start_progress_and_end_in_order() {
    let _one = one_at_a_time();
    let dir = scratch("events-live");
    let key = test_key(&dir);
    let src_api = dir.join("api-1.sock");
    let mut args = guest_args(&["--name", "live"]);
    // A guest that keeps dirtying memory: several pre-copy rounds.
    args[5] = "counter=100 dirty=10000,64".into();
    args[3] = "128M".into();
    let mut src = spawn_vmm(&args, &dir.join("console-1.log"), &src_api, &[]);
    wait_api(&src_api);
    wait_for("the guest to count", PATIENCE, || {
        !counters(&src.console).is_empty()
    });
    let events = subscribe(&src_api);

    // Nobody listens there: the migration fails, the VM runs on.
    let nowhere = format!("127.0.0.1:{}", free_port());
    let out = ctl(
        &src_api,
        &[
            "migrate",
            "--to",
            &nowhere,
            "--key-file",
            key.to_str().unwrap(),
        ],
    );
    assert!(!out.status.success());
    let failed = next_of(&events, "operation_failed");
    assert_eq!(failed["kind"], "migrate", "{failed}");

    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let dst_api = dir.join("api-2.sock");
    let mut dst = spawn_vmm(
        &[
            "--incoming".into(),
            listen.clone(),
            "--migration-key-file".into(),
            key.display().to_string(),
        ],
        &dir.join("console-2.log"),
        &dst_api,
        &[],
    );
    wait_listening(port);
    let before_migration = guest_uptime(&src_api);
    let report = succeeded(&ctl(
        &src_api,
        &[
            "migrate",
            "--to",
            &listen,
            "--key-file",
            key.to_str().unwrap(),
            "--max-rounds",
            "4",
            "--max-downtime-ms",
            "20",
        ],
    ));
    let all = to_the_end(&events);
    let progress = progress_in_order(&all);
    assert_eq!(
        kinds(&all),
        ["operation_started", "operation_completed"],
        "{all:#?}"
    );
    let last = all.last().unwrap();
    assert_eq!(last["event"], "operation_completed", "{all:#?}");
    assert_eq!(last["kind"], "migrate");
    // Its progress: at least one event unless the whole migration was
    // quicker than the progress thread's first look.
    let total_ms = report["total_ms"].as_f64().unwrap_or(0.0);
    if total_ms >= 500.0 {
        assert!(
            !progress.is_empty(),
            "no progress in {total_ms} ms: {all:#?}"
        );
        assert!(progress.iter().all(|p| p["kind"] == "migrate"));
        assert!(progress.iter().any(|p| p["bytes_sent"].as_u64() > Some(0)));
    } else {
        eprintln!("the migration took {total_ms} ms: progress events not required");
    }
    let arrived = info(&dst_api);
    guest_uptime_carried(before_migration, &arrived);
    check_stamped(&all, arrived["id"].as_str().unwrap(), Some("live"));
    assert!(wait_exit(&mut src.child.0, "the source").success());
    assert!(ctl(&dst_api, &["shutdown"]).status.success());
    assert!(wait_exit(&mut dst.child.0, "the destination").success());
}
