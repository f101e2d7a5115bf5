//! `GET /metrics` (Prometheus text format), with real kemari processes and
//! the test guest:
//!
//! - on the API socket and on `--metrics-listen`: the content type, every
//!   series labelled with the VM's id (as `GET /vm` shows it) and name,
//!   the machine's gauges, exits that grow between two scrapes, histograms
//!   with their `_bucket`/`_sum`/`_count`; only `GET /metrics` on TCP;
//! - a protected primary's (periodic checkpoints) pause and sync
//!   histograms count its syncs, and its standby answers too;
//! - every scrape passes `promtool check metrics` (Debian package
//!   `prometheus`, installed by scripts/setup.sh: a missing promtool fails
//!   the test).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use kemari_testkit::http::{get, over_tcp, over_unix, scrape};
use kemari_testkit::scenario::*;
use kemari_testkit::*;

const PATIENCE: Duration = Duration::from_secs(30);

/// The sum of the samples named `name` whose labels hold every one of `with`.
fn sum(text: &str, name: &str, with: &[&str]) -> f64 {
    sample_sum(text, name, with)
}

fn has(text: &str, name: &str) -> bool {
    samples(text).iter().any(|(n, _, _)| n == name)
}

/// Every sample carries `labels` (e.g. `vm="…"`).
fn all_labelled(text: &str, labels: &[String]) {
    for (name, l, _) in samples(text) {
        for label in labels {
            assert!(l.contains(label.as_str()), "{name}{{{l}}} lacks {label}");
        }
    }
}

fn histogram_parts(text: &str, base: &str) {
    for suffix in ["_bucket", "_sum", "_count"] {
        assert!(has(text, &format!("{base}{suffix}")), "no {base}{suffix}");
    }
    assert!(
        text.contains(&format!("# TYPE {base} histogram")),
        "{base} is not a histogram"
    );
}

fn info(api: &Path) -> serde_json::Value {
    let out = ctl(api, &["info"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn metrics_over_the_api_socket_and_tcp() {
    let _one = one_at_a_time();
    let dir = scratch("prom");
    let port = free_port();
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
            "--name".into(),
            "web-1".into(),
            "--metrics-listen".into(),
            format!("127.0.0.1:{port}"),
        ],
        &dir.join("console.log"),
        &dir.join("api.sock"),
        &[],
    );
    wait_for("the guest's counter", PATIENCE, || {
        counters(&vmm.console).len() >= 2
    });
    let vm = info(&vmm.api);
    let id = vm["id"].as_str().expect("GET /vm shows an id").to_owned();
    assert_eq!(vm["name"], "web-1");
    let labels = [format!("vm=\"{id}\""), "name=\"web-1\"".to_owned()];

    let first = scrape(over_unix(&vmm.api, &get("/metrics")));
    all_labelled(&first, &labels);
    assert_eq!(sum(&first, "kemari_vm_vcpus", &[]), 2.0);
    assert_eq!(
        sum(&first, "kemari_vm_memory_bytes", &[]),
        (128u64 << 20) as f64
    );
    assert_eq!(sum(&first, "kemari_vm_state", &["state=\"running\""]), 1.0);
    assert_eq!(sum(&first, "kemari_vm_state", &[]), 1.0);
    assert_eq!(
        sum(&first, "kemari_ft_state", &["state=\"unprotected\""]),
        1.0
    );
    assert!(sum(&first, "kemari_vm_uptime_seconds", &[]) > 0.0);
    assert!(
        sum(
            &first,
            "kemari_device_bytes_total",
            &["device=\"serial0\"", "direction=\"out\""]
        ) > 0.0
    );
    assert!(first.contains("# TYPE kemari_vcpu_exits_total counter"));
    for h in ["kemari_ft_pause_seconds", "kemari_ft_sync_seconds"] {
        histogram_parts(&first, h);
    }
    let exits = sum(&first, "kemari_vcpu_exits_total", &[]);
    assert!(exits > 0.0, "no exits counted:\n{first}");

    // The guest prints (port writes) on: the exits grow.
    let before = counters(&vmm.console).len();
    wait_for("more counter lines", PATIENCE, || {
        counters(&vmm.console).len() > before
    });
    let second = scrape(over_tcp(port, &get("/metrics")));
    all_labelled(&second, &labels);
    let later = sum(&second, "kemari_vcpu_exits_total", &[]);
    assert!(later > exits, "exits {exits} then {later}");
    assert!(sum(&second, "kemari_vcpu_exits_total", &["reason=\"io_out\""]) > 0.0);

    // A pause is counted, and shows in the state.
    assert!(ctl(&vmm.api, &["pause"]).status.success());
    let paused = scrape(over_tcp(port, &get("/metrics?x=1")));
    assert_eq!(sum(&paused, "kemari_vm_state", &["state=\"paused\""]), 1.0);
    assert!(sum(&paused, "kemari_vm_pauses_total", &[]) >= 1.0);
    assert!(ctl(&vmm.api, &["resume"]).status.success());

    // Operations are counted by kind and outcome, every series from the start.
    let snap = |t: &str| {
        sum(
            t,
            "kemari_operations_total",
            &["kind=\"snapshot\"", "outcome=\"completed\""],
        )
    };
    assert_eq!(snap(&paused), 0.0);
    histogram_parts(&paused, "kemari_handover_downtime_seconds");
    let out = ctl(&vmm.api, &["snapshot", dir.join("snap").to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(snap(&scrape(over_unix(&vmm.api, &get("/metrics")))), 1.0);

    // Only GET /metrics on TCP; a bad request gets an answer, not a hang.
    assert_eq!(over_tcp(port, &get("/vm")).0, 404);
    assert_eq!(
        over_tcp(port, "PUT /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").0,
        405
    );
    assert_eq!(over_tcp(port, "nonsense\r\n\r\n").0, 400);
    let mut big = String::from("GET /metrics HTTP/1.1\r\nX: ");
    big.push_str(&"a".repeat(16 << 10));
    big.push_str("\r\n\r\n");
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    // The listener may close while the rest is still being written.
    let mut w = &s;
    let _ = w.write_all(big.as_bytes());
    let mut answer = String::new();
    let _ = (&s).read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    // A client that sends nothing is dropped; the next one is served.
    let idle = TcpStream::connect(("127.0.0.1", port)).unwrap();
    scrape(over_tcp(port, &get("/metrics")));
    drop(idle);

    assert!(ctl(&vmm.api, &["shutdown"]).status.success());
    let mut child = vmm.child;
    assert!(wait_exit(&mut child.0, "kemari").success());
}

#[test]
#[cfg_attr(no_kvm, ignore = "needs a usable /dev/kvm")]
fn a_protected_primary_records_its_syncs_in_histograms() {
    let _one = one_at_a_time();
    let dir = scratch("prom-ft");
    let key = test_key(&dir);
    let port = free_port();
    let standby = spawn_vmm(
        &[
            "--ft-standby".into(),
            format!("127.0.0.1:{port}"),
            "--migration-key-file".into(),
            key.display().to_string(),
            "--name".into(),
            "db".into(),
        ],
        &dir.join("console-standby.log"),
        &dir.join("api-standby.sock"),
        &[],
    );
    wait_listening(port);
    let primary = spawn_vmm(
        &[
            "--kernel".into(),
            guest_elf().display().to_string(),
            "--memory".into(),
            "128M".into(),
            "--cmdline".into(),
            "counter=20".into(),
            "--name".into(),
            "db".into(),
        ],
        &dir.join("console-primary.log"),
        &dir.join("api-primary.sock"),
        &[],
    );
    wait_for("the guest's counter", PATIENCE, || {
        counters(&primary.console).len() >= 2
    });
    let peer = format!("127.0.0.1:{port}");
    let out = ctl(
        &primary.api,
        &[
            "ft",
            "start",
            "--peer",
            &peer,
            "--key-file",
            key.to_str().unwrap(),
            "--periodic-ms",
            "20",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Periodic checkpoints: syncs without device outputs (the serial
    // console is not one).
    let mut text = String::new();
    wait_for("syncs in the histograms", PATIENCE, || {
        text = scrape(over_unix(&primary.api, &get("/metrics")));
        sum(&text, "kemari_ft_sync_seconds_count", &[]) >= 5.0
    });
    assert_eq!(sum(&text, "kemari_ft_state", &["state=\"protected\""]), 1.0);
    let syncs = sum(&text, "kemari_ft_syncs_total", &[]);
    let pauses = sum(&text, "kemari_ft_pause_seconds_count", &[]);
    assert!(syncs >= 5.0 && pauses >= 5.0, "{text}");
    assert!(sum(&text, "kemari_ft_pause_seconds_sum", &[]) > 0.0);
    assert!(sum(&text, "kemari_ft_epoch", &[]) >= 5.0);
    // The +Inf bucket holds every sample.
    assert_eq!(
        sum(&text, "kemari_ft_sync_seconds_bucket", &["le=\"+Inf\""]),
        sum(&text, "kemari_ft_sync_seconds_count", &[])
    );
    assert!(text.contains("name=\"db\""));

    // The standby answers in its role, labelled with the name it was given.
    let s = scrape(over_unix(&standby.api, &get("/metrics")));
    assert_eq!(sum(&s, "kemari_vm_state", &["state=\"standby\""]), 1.0);
    assert_eq!(sum(&s, "kemari_ft_state", &["state=\"standby\""]), 1.0);
    assert!(!has(&s, "kemari_vcpu_exits_total"), "{s}");
    all_labelled(&s, &["name=\"db\"".to_owned()]);

    assert!(ctl(&primary.api, &["ft", "stop"]).status.success());
    let mut sb = standby.child;
    let _ = wait_exit(&mut sb.0, "the standby");
    assert!(ctl(&primary.api, &["shutdown"]).status.success());
    let mut p = primary.child;
    assert!(wait_exit(&mut p.0, "the primary").success());
}
