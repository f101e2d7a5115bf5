//! `GET /metrics` of the real `kemari-nbd` binary: a target on
//! `--metrics-listen`, a relocation proxy on its control socket and on
//! `--metrics-listen`; requests, bytes and errors per command, cache
//! hits and misses, the background copy's progress and the cut-over. Every
//! scrape passes `promtool check metrics` (Debian package `prometheus`,
//! installed by scripts/setup.sh: a missing promtool fails the test).

mod common;

use std::process::Command;

use common::*;
use kemari_testkit::http::{get, over_tcp, over_unix, scrape};
use kemari_testkit::*;
use nbd_client::client::Client;

const SIZE: usize = 16 << 20;

#[test]
fn target_and_proxy_metrics_follow_requests_the_copy_and_the_cut_over() {
    let d = TempDir::new("nbd-metrics");
    let image = make_image(&d.path("t.img"), SIZE, 7);
    let target_metrics = free_port();
    let (_target, tport) = serve_args(&[
        "--export".into(),
        format!("disk={}", d.path("t.img").display()),
        "--metrics-listen".into(),
        format!("127.0.0.1:{target_metrics}"),
    ]);
    let ctl = d.path("ctl.sock");
    let proxy_metrics = free_port();
    let metrics_flag = format!("127.0.0.1:{proxy_metrics}");
    let (_proxy, pport) = proxy(
        &format!("nbd://127.0.0.1:{tport}/disk"),
        &d.path("cache"),
        &ctl,
        &["--no-background", "--metrics-listen", &metrics_flag],
    );

    // Nothing read yet: every series is there, at zero.
    let first = scrape(over_unix(&ctl, &get("/metrics")));
    assert!(
        first.contains("# TYPE kemari_nbd_requests_total counter"),
        "{first}"
    );
    assert!(first.contains("role=\"proxy\""), "{first}");
    assert_eq!(
        sample_sum(&first, "kemari_nbd_proxy_cache_reads_total", &[]),
        0.0
    );
    assert_eq!(sample_sum(&first, "kemari_nbd_proxy_cut_over", &[]), 0.0);
    assert_eq!(
        sample_sum(&first, "kemari_nbd_proxy_blocks", &[]),
        sample_sum(&first, "kemari_nbd_proxy_size_bytes", &[]) / 4096.0
    );

    // A read of uncached blocks (a miss: fetched upstream), then the same
    // again (a hit), then one past the end (answered with an error).
    let c = Client::connect(&format!("nbd://127.0.0.1:{pport}/disk")).unwrap();
    let mut buf = vec![0u8; 64 << 10];
    c.read_at(1 << 20, &mut buf).unwrap();
    assert_eq!(buf, image[1 << 20..(1 << 20) + (64 << 10)]);
    c.read_at(1 << 20, &mut buf).unwrap();
    c.write_at(4 << 20, &[0x5a; 4096]).unwrap();
    // Past the end: the client checks that itself, so the raw request.
    let past = c
        .submit(nbd_client::protocol::CMD_READ, 0, SIZE as u64, 4096, &[])
        .unwrap();
    assert!(past.wait().is_err());
    drop(c);

    let m = scrape(over_tcp(proxy_metrics, &get("/metrics")));
    let read = |t: &str, name: &str, label: &str| sample_sum(t, name, &[label]);
    assert!(
        read(&m, "kemari_nbd_requests_total", "command=\"read\"") >= 3.0,
        "{m}"
    );
    assert!(
        read(&m, "kemari_nbd_requests_total", "command=\"write\"") >= 1.0,
        "{m}"
    );
    assert!(
        read(&m, "kemari_nbd_request_errors_total", "command=\"read\"") >= 1.0,
        "{m}"
    );
    assert!(read(&m, "kemari_nbd_bytes_total", "direction=\"read\"") >= (128 << 10) as f64);
    assert!(read(&m, "kemari_nbd_bytes_total", "direction=\"written\"") >= 4096.0);
    assert!(
        read(&m, "kemari_nbd_proxy_cache_reads_total", "result=\"miss\"") >= 1.0,
        "{m}"
    );
    assert!(
        read(&m, "kemari_nbd_proxy_cache_reads_total", "result=\"hit\"") >= 1.0,
        "{m}"
    );
    assert!(
        read(
            &m,
            "kemari_nbd_proxy_fetched_bytes_total",
            "link=\"ondemand\""
        ) >= (64 << 10) as f64
    );
    assert_eq!(
        sample_sum(&m, "kemari_nbd_proxy_background_paused", &[]),
        1.0
    );
    assert!(sample_sum(&m, "kemari_nbd_proxy_copy_ratio", &[]) < 1.0);

    // The target served the proxy's fetches.
    let t = scrape(over_tcp(target_metrics, &get("/metrics")));
    assert!(t.contains("role=\"target\""), "{t}");
    assert!(!t.contains("kemari_nbd_proxy_"), "{t}");
    assert!(
        read(&t, "kemari_nbd_requests_total", "command=\"read\"") >= 1.0,
        "{t}"
    );

    // The background copy runs to the end and the proxy cuts over.
    control_cmd("resume", &ctl);
    let out = Command::new(BIN)
        .args(["cutover", "--wait", "--control"])
        .arg(&ctl)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let end = scrape(over_unix(&ctl, &get("/metrics?after=cutover")));
    assert_eq!(sample_sum(&end, "kemari_nbd_proxy_cut_over", &[]), 1.0);
    assert_eq!(sample_sum(&end, "kemari_nbd_proxy_copy_ratio", &[]), 1.0);
    assert_eq!(
        sample_sum(&end, "kemari_nbd_proxy_phase", &["phase=\"cut-over\""]),
        1.0
    );
    assert_eq!(sample_sum(&end, "kemari_nbd_proxy_phase", &[]), 1.0);
    assert!(
        read(
            &end,
            "kemari_nbd_proxy_fetched_bytes_total",
            "link=\"background\""
        ) > 0.0
    );

    // HTTP on the control socket serves /metrics only; its JSON commands
    // work as before.
    assert_eq!(over_unix(&ctl, &get("/status")).0, 404);
    assert_eq!(over_tcp(proxy_metrics, &get("/status")).0, 404);
    assert_eq!(status(&ctl)["cut_over"], true);
}
