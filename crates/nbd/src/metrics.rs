//! kemari-nbd's metrics for Prometheus: `GET /metrics` on the proxy's
//! control socket ([`crate::control`]) and, with `--metrics-listen ADDR`,
//! over TCP (kemari-api's listener, as kemari's).
//!
//! The request path only bumps relaxed atomics ([`record`]: one array slot
//! per NBD command); the exposition is built with `prometheus-client` at
//! each scrape from them and, for a proxy, from its status (the same
//! numbers `kemari-nbd status` prints) and its cache hit/miss counters.
//! The list with types is in docs/nbd.md ("Metrics").

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

use crate::proxy::Status;

/// The `Content-Type` of the exposition.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// The commands counted, by their NBD number; anything else is `other`.
const COMMANDS: [&str; 9] = [
    "read",
    "write",
    "disc",
    "flush",
    "trim",
    "cache",
    "write_zeroes",
    "block_status",
    "other",
];

/// Requests answered since the process started, per command.
struct Requests {
    started: Instant,
    answered: [AtomicU64; COMMANDS.len()],
    failed: [AtomicU64; COMMANDS.len()],
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
}

fn requests() -> &'static Requests {
    static REQUESTS: OnceLock<Requests> = OnceLock::new();
    REQUESTS.get_or_init(|| Requests {
        started: Instant::now(),
        answered: Default::default(),
        failed: Default::default(),
        bytes_read: AtomicU64::new(0),
        bytes_written: AtomicU64::new(0),
    })
}

/// Why a connection was closed by the server before it was served.
#[derive(Debug, Clone, Copy)]
pub enum Refusal {
    /// Its address is not in `--allow`.
    NotAllowed,
    /// `--max-connections` were open.
    Limit,
    /// No handshake within `--handshake-limit`.
    HandshakeLimit,
}

const REFUSALS: [&str; 3] = ["not_allowed", "connection_limit", "handshake_limit"];

/// Connections open now, and those refused by reason.
struct Connections {
    open: AtomicU64,
    refused: [AtomicU64; REFUSALS.len()],
}

fn connections() -> &'static Connections {
    static CONNECTIONS: Connections = Connections {
        open: AtomicU64::new(0),
        refused: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
    };
    &CONNECTIONS
}

/// A connection is being served.
pub fn connection_opened() {
    connections().open.fetch_add(1, Ordering::Relaxed);
}

/// A served connection ended.
pub fn connection_closed() {
    connections().open.fetch_sub(1, Ordering::Relaxed);
}

/// The server closed a connection before serving it.
pub fn connection_refused(why: Refusal) {
    connections().refused[why as usize].fetch_add(1, Ordering::Relaxed);
}

/// Starts the process's clock (`kemari_nbd_process_uptime_seconds`).
pub fn init() {
    requests();
}

fn slot(command: u16) -> usize {
    usize::from(command).min(COMMANDS.len() - 1)
}

/// A request of `command` for `len` bytes was answered, with an error
/// (`ok` false) or not. A successful read counts its bytes as read, a
/// successful write as written.
pub fn record(command: u16, len: u32, ok: bool) {
    let r = requests();
    let i = slot(command);
    r.answered[i].fetch_add(1, Ordering::Relaxed);
    if !ok {
        r.failed[i].fetch_add(1, Ordering::Relaxed);
        return;
    }
    match command {
        nbd_client::protocol::CMD_READ => r.bytes_read.fetch_add(u64::from(len), Ordering::Relaxed),
        nbd_client::protocol::CMD_WRITE => {
            r.bytes_written.fetch_add(u64::from(len), Ordering::Relaxed)
        }
        _ => 0,
    };
}

/// What a proxy adds to the exposition.
#[derive(Debug, Clone)]
pub struct ProxyView {
    /// Its status now.
    pub status: Status,
    /// Client reads served from the cache alone.
    pub cache_hits: u64,
    /// Client reads that waited for blocks from upstream.
    pub cache_misses: u64,
}

type Labels = Vec<(&'static str, &'static str)>;

/// A family of gauges with the given values.
fn gauges(label: &'static str, values: &[(&'static str, u64)]) -> Family<Labels, Gauge> {
    let family = Family::<Labels, Gauge>::default();
    for (name, v) in values {
        family
            .get_or_create(&vec![(label, *name)])
            .set(i64::try_from(*v).unwrap_or(i64::MAX));
    }
    family
}

/// A family of counters with the given totals.
fn counter_family(
    label: &'static str,
    values: &[(&'static str, u64)],
) -> Family<Labels, prometheus_client::metrics::counter::Counter> {
    let family = Family::<Labels, prometheus_client::metrics::counter::Counter>::default();
    for (name, v) in values {
        family.get_or_create(&vec![(label, *name)]).inc_by(*v);
    }
    family
}

/// The exposition now: the request counters and, for a proxy, its view.
/// `role` is `target` or `proxy`.
pub fn exposition(role: &'static str, proxy: Option<&ProxyView>) -> String {
    let mut r = Registry::with_prefix("kemari_nbd");
    let build = Family::<Labels, Gauge>::default();
    build
        .get_or_create(&vec![
            ("version", env!("CARGO_PKG_VERSION")),
            ("role", role),
        ])
        .set(1);
    r.register(
        "build_info",
        "The kemari-nbd version and role, as labels",
        build,
    );
    let q = requests();
    r.register(
        "process_uptime_seconds",
        "Time since this kemari-nbd process started",
        ConstGauge::new(q.started.elapsed().as_secs_f64()),
    );
    let load = |a: &[AtomicU64; COMMANDS.len()]| -> Vec<(&'static str, u64)> {
        COMMANDS
            .iter()
            .zip(a)
            .map(|(c, n)| (*c, n.load(Ordering::Relaxed)))
            .collect()
    };
    r.register(
        "requests",
        "NBD requests answered, by command",
        counter_family("command", &load(&q.answered)),
    );
    r.register(
        "request_errors",
        "NBD requests answered with an error, by command",
        counter_family("command", &load(&q.failed)),
    );
    r.register(
        "bytes",
        "Payload bytes of successful reads (read) and writes (written)",
        counter_family(
            "direction",
            &[
                ("read", q.bytes_read.load(Ordering::Relaxed)),
                ("written", q.bytes_written.load(Ordering::Relaxed)),
            ],
        ),
    );
    let c = connections();
    r.register(
        "connections",
        "NBD connections being served",
        ConstGauge::new(c.open.load(Ordering::Relaxed) as i64),
    );
    let refused: Vec<(&'static str, u64)> = REFUSALS
        .iter()
        .zip(&c.refused)
        .map(|(why, n)| (*why, n.load(Ordering::Relaxed)))
        .collect();
    r.register(
        "connections_refused",
        "Connections the server closed unserved: not allowed (--allow), over --max-connections, no handshake within --handshake-limit",
        counter_family("reason", &refused),
    );
    if let Some(p) = proxy {
        register_proxy(&mut r, p);
    }
    let mut text = String::new();
    if let Err(e) = prometheus_text::encode(&mut text, &r) {
        tracing::warn!(error = %e, "cannot encode the metrics");
    }
    text
}

/// Every phase a proxy reports (`kemari_nbd_proxy_phase`).
const PHASES: [&str; 4] = ["planning", "copying", "complete", "cut-over"];

fn register_proxy(r: &mut Registry, p: &ProxyView) {
    let s = &p.status;
    let r = r.sub_registry_with_prefix("proxy");
    r.register(
        "size_bytes",
        "Size of the relocated export",
        ConstGauge::new(s.size as f64),
    );
    r.register(
        "blocks",
        "Blocks of the export (the cache's unit)",
        ConstGauge::new(s.blocks as f64),
    );
    r.register(
        "cached_blocks",
        "Blocks held locally (fetched, copied or written)",
        ConstGauge::new(s.cached_blocks as f64),
    );
    r.register(
        "copy_ratio",
        "Share of the export held locally, 0 to 1: the background copy's progress",
        ConstGauge::new(s.cached_percent / 100.0),
    );
    r.register(
        "fetched_bytes",
        "Bytes fetched from upstream: on demand for a client, or by the background copy",
        counter_family(
            "link",
            &[
                ("ondemand", s.ondemand_bytes),
                ("background", s.background_bytes),
            ],
        ),
    );
    r.register(
        "ondemand_fetches",
        "Fetches from upstream on behalf of a client",
        ConstCounter::new(s.ondemand_requests),
    );
    r.register(
        "cache_reads",
        "Client reads, by whether the cache held every block (hit) or blocks were fetched first (miss)",
        counter_family("result", &[("hit", p.cache_hits), ("miss", p.cache_misses)]),
    );
    r.register(
        "queue_depth",
        "Upstream requests in flight, by link",
        gauges(
            "link",
            &[
                ("ondemand", s.ondemand_queue_depth),
                ("background", s.background_queue_depth),
            ],
        ),
    );
    r.register(
        "background_paused",
        "1 while the background copy is paused",
        ConstGauge::new(i64::from(s.paused)),
    );
    r.register(
        "cut_over",
        "1 once the proxy has cut over (every block local, upstream disconnected)",
        ConstGauge::new(i64::from(s.cut_over)),
    );
    let phase = Family::<Labels, Gauge>::default();
    for name in PHASES {
        phase
            .get_or_create(&vec![("phase", name)])
            .set(i64::from(s.phase == name));
    }
    r.register(
        "phase",
        "1 for the phase the proxy is in (planning, copying, complete, cut-over), 0 for the others",
        phase,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_beyond_the_known_ones_count_as_other() {
        assert_eq!(COMMANDS[slot(0)], "read");
        assert_eq!(COMMANDS[slot(7)], "block_status");
        assert_eq!(COMMANDS[slot(99)], "other");
    }

    #[test]
    fn recorded_requests_show_in_the_exposition() {
        record(nbd_client::protocol::CMD_TRIM, 4096, true);
        record(nbd_client::protocol::CMD_TRIM, 4096, false);
        let text = exposition("target", None);
        assert!(
            text.contains("# TYPE kemari_nbd_requests_total counter"),
            "{text}"
        );
        let line = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no {name} in {text}"))
                .rsplit_once(' ')
                .and_then(|(_, v)| v.parse::<f64>().ok())
                .unwrap()
        };
        // Other tests of this process may record too: at least ours.
        assert!(line("kemari_nbd_requests_total{command=\"trim\"}") >= 2.0);
        assert!(line("kemari_nbd_request_errors_total{command=\"trim\"}") >= 1.0);
        assert!(!text.contains("kemari_nbd_proxy_"));
    }
}
