//! The exposition: every metric, in the Prometheus text format (0.0.4),
//! built with `prometheus-client` at each scrape.
//!
//! Counters and gauges are read from what `GET /vm/metrics`, `GET /vm/ft`
//! and `GET /vm/migration` report, so the two views never disagree; the
//! histograms are recorded as the samples happen (`ft::status::FtShared`,
//! [`OperationMetrics`]). Every series carries the VM's id as `vm` and,
//! if it has one, its name as `name`. The list with types and units is in
//! docs/api.md ("`GET /metrics`").

use std::borrow::Cow;

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use serde_json::Value;

use crate::controller::shared::{Role, Shared};

/// The `Content-Type` of the exposition.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Labels of a family of series.
type Labels = Vec<(&'static str, String)>;

/// Static labels (operation kind and outcome).
type OpLabels = Vec<(&'static str, &'static str)>;

/// A histogram family's constructor.
type NewHistogram = fn() -> Histogram;

/// Bounds of a hand-over's downtime: 1 ms to ~8 s.
fn downtime_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-3, 2.0, 14))
}

/// What the long operations record as they end: how many ended, by kind
/// and outcome, and the downtime of those that handed the VM over.
#[derive(Debug, Clone)]
pub struct OperationMetrics {
    ended: Family<OpLabels, Counter>,
    downtime: Family<OpLabels, Histogram, NewHistogram>,
}

/// Every operation kind (`OpKind::as_str`) and outcome.
const KINDS: [&str; 5] = [
    "migrate",
    "migrate_local",
    "warm_restart",
    "snapshot",
    "ft_start",
];
const OUTCOMES: [&str; 3] = ["completed", "failed", "cancelled"];
/// The kinds that hand the VM over (their report says the downtime).
const HANDOVERS: [&str; 3] = ["migrate", "migrate_local", "warm_restart"];

impl Default for OperationMetrics {
    /// Every series present from the start, at zero (a rate over a series
    /// that appears at its first increment misses that increment).
    fn default() -> Self {
        let m = OperationMetrics {
            ended: Family::default(),
            downtime: Family::new_with_constructor(downtime_histogram),
        };
        for kind in KINDS {
            for outcome in OUTCOMES {
                drop(
                    m.ended
                        .get_or_create(&vec![("kind", kind), ("outcome", outcome)]),
                );
            }
        }
        for kind in HANDOVERS {
            drop(m.downtime.get_or_create(&vec![("kind", kind)]));
        }
        m
    }
}

impl OperationMetrics {
    /// An operation of `kind` ended with `outcome` (`completed`, `failed`,
    /// `cancelled`) and, if it succeeded, `result` (a hand-over's report
    /// says its downtime).
    pub fn ended(&self, kind: &'static str, outcome: &'static str, result: Option<&Value>) {
        self.ended
            .get_or_create(&vec![("kind", kind), ("outcome", outcome)])
            .inc();
        if let Some(ms) = result
            .and_then(|r| r.get("downtime_ms"))
            .and_then(Value::as_f64)
        {
            self.downtime
                .get_or_create(&vec![("kind", kind)])
                .observe(ms / 1000.0);
        }
    }
}

/// Every run state a VMM reports (`kemari_vm_state`).
const VM_STATES: [&str; 5] = ["running", "paused", "standby", "starting", "ending"];

/// Every fault-tolerance state (`kemari_ft_state`).
const FT_STATES: [&str; 7] = [
    "unprotected",
    "syncing",
    "protected",
    "degraded",
    "standby",
    "failing_over",
    "failed_over",
];

/// The exposition of this VMM's metrics now.
pub fn exposition(shared: &Shared) -> String {
    let registry = registry(shared);
    let mut text = String::new();
    if let Err(e) = prometheus_text::encode(&mut text, &registry) {
        // Writing into a String fails only if a metric's encoding does.
        tracing::warn!(error = %e, "cannot encode the metrics");
    }
    text
}

fn const_gauge(value: f64) -> ConstGauge<f64> {
    ConstGauge::new(value)
}

/// A family of gauges, one per `(label value, value)`.
fn gauges<'a>(
    label: &'static str,
    values: impl IntoIterator<Item = (&'a str, f64)>,
) -> Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>> {
    let family = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    for (name, value) in values {
        family
            .get_or_create(&vec![(label, name.to_owned())])
            .set(value);
    }
    family
}

fn registry(shared: &Shared) -> Registry {
    let (id, name) = shared.events.identity();
    let labels = [("vm", id), ("name", name)]
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (Cow::Borrowed(k), Cow::Owned(v))));
    let mut r = Registry::with_prefix_and_labels("kemari", labels);

    let build = Family::<Labels, Gauge>::default();
    build
        .get_or_create(&vec![("version", env!("CARGO_PKG_VERSION").to_owned())])
        .set(1);
    r.register("build_info", "The kemari version, as a label", build);
    r.register(
        "process_uptime_seconds",
        "Time since this kemari process started",
        const_gauge(shared.started.elapsed().as_secs_f64()),
    );

    let monitor = shared.monitor();
    let role = shared.role();
    let state = match (&monitor, role) {
        (_, Role::Ending) => "ending",
        (Some(m), _) => match m.state() {
            vmm::machine::RunState::Running => "running",
            vmm::machine::RunState::Paused => "paused",
        },
        (None, Role::Standby) => "standby",
        (None, _) => "starting",
    };
    r.register(
        "vm_state",
        "1 for the state this VMM is in (running, paused, standby, starting, ending), 0 for the others",
        gauges(
            "state",
            VM_STATES
                .iter()
                .map(|s| (*s, if *s == state { 1.0 } else { 0.0 })),
        ),
    );

    if let Some(m) = &monitor {
        machine(&mut r, m);
        r.register(
            "vm_reboots",
            "In-place guest reboots (resets, restarted crashes) in this process",
            ConstCounter::new(shared.reboots()),
        );
    }
    ft(&mut r, shared);
    operations(&mut r, shared);
    r
}

/// The machine's gauges and counters (`GET /vm/metrics`).
fn machine(r: &mut Registry, m: &vmm::machine::MachineMonitor) {
    let c = m.config();
    let metrics = m.metrics();
    r.register(
        "vm_vcpus",
        "vCPUs of the VM",
        const_gauge(f64::from(c.vcpus)),
    );
    r.register(
        "vm_memory_bytes",
        "Guest memory size",
        const_gauge(c.memory_bytes as f64),
    );
    r.register(
        "vm_uptime_seconds",
        "Time since the machine was built (or last rebooted) in this process",
        const_gauge(m.uptime().as_secs_f64()),
    );
    r.register(
        "vm_guest_uptime_seconds",
        "Time since the guest booted, carried across snapshots, warm restarts, migrations and failovers (reset by a reboot)",
        const_gauge(m.guest_uptime().as_secs_f64()),
    );
    r.register(
        "vm_pauses",
        "Pauses of the VM since the machine was built (or last rebooted)",
        ConstCounter::new(metrics.pauses),
    );
    let exits = Family::<Labels, Counter>::default();
    for (reason, n) in &metrics.exits {
        exits
            .get_or_create(&vec![("reason", reason.clone())])
            .inc_by(*n);
    }
    r.register(
        "vcpu_exits",
        "KVM exits by reason, summed over the vCPUs",
        exits,
    );
    let requests = Family::<Labels, Counter>::default();
    let bytes = Family::<Labels, Counter>::default();
    let errors = Family::<Labels, Counter>::default();
    let bad = Family::<Labels, Counter>::default();
    let reconnects = Family::<Labels, Counter>::default();
    for d in &metrics.devices {
        let labels = || vec![("device", d.name.clone()), ("kind", d.kind.clone())];
        let n = &d.counters;
        requests.get_or_create(&labels()).inc_by(n.requests);
        for (direction, count) in [("in", n.bytes_in), ("out", n.bytes_out)] {
            let mut l = labels();
            l.push(("direction", direction.to_owned()));
            bytes.get_or_create(&l).inc_by(count);
        }
        errors.get_or_create(&labels()).inc_by(n.errors);
        bad.get_or_create(&labels()).inc_by(n.bad_descriptors);
        if d.kind == "virtio-blk" {
            reconnects.get_or_create(&labels()).inc_by(n.reconnects);
        }
    }
    r.register(
        "device_requests",
        "Requests or packets a device completed successfully",
        requests,
    );
    r.register(
        "device_bytes",
        "Bytes a device moved: direction in = from its backend into the guest, out = from the guest to its backend",
        bytes,
    );
    r.register(
        "device_errors",
        "Requests that completed with an error status, or packets dropped",
        errors,
    );
    r.register(
        "device_bad_descriptors",
        "Malformed descriptor chains a device rejected",
        bad,
    );
    if metrics.devices.iter().any(|d| d.kind == "virtio-blk") {
        r.register(
            "device_reconnects",
            "Times a disk's NBD connection was lost and made again (0 for image files)",
            reconnects,
        );
    }
    disk_caches(r, &metrics.devices);
}

/// The warm disk caches (`--disk …,cache=SIZE`), for the disks that have one.
fn disk_caches(r: &mut Registry, devices: &[vmm::devices::DeviceInfo]) {
    let cached: Vec<_> = devices
        .iter()
        .filter_map(|d| Some((d, d.counters.cache.as_ref()?)))
        .collect();
    if cached.is_empty() {
        return;
    }
    let blocks = Family::<Labels, Counter>::default();
    let bytes = Family::<Labels, Counter>::default();
    let dropped = Family::<Labels, Counter>::default();
    let resident = Family::<Labels, Gauge>::default();
    let capacity = Family::<Labels, Gauge>::default();
    for (d, c) in cached {
        let labels = |key: &'static str, value: &str| {
            vec![
                ("device", d.name.clone()),
                ("kind", d.kind.clone()),
                (key, value.to_owned()),
            ]
        };
        for (result, n, b) in [
            ("hit", c.hits, c.hit_bytes),
            ("miss", c.misses, c.miss_bytes),
        ] {
            blocks.get_or_create(&labels("result", result)).inc_by(n);
            bytes.get_or_create(&labels("result", result)).inc_by(b);
        }
        for (reason, n) in [("evicted", c.evictions), ("invalidated", c.invalidations)] {
            dropped.get_or_create(&labels("reason", reason)).inc_by(n);
        }
        let plain = vec![("device", d.name.clone()), ("kind", d.kind.clone())];
        resident
            .get_or_create(&plain)
            .set(i64::try_from(c.resident_bytes).unwrap_or(i64::MAX));
        capacity
            .get_or_create(&plain)
            .set(i64::try_from(c.capacity_bytes).unwrap_or(i64::MAX));
    }
    r.register(
        "device_cache_blocks",
        "4 KiB blocks of guest reads a disk's warm cache served (result hit) or sent to the disk (result miss)",
        blocks,
    );
    r.register(
        "device_cache_read_bytes",
        "Bytes of guest reads a disk's warm cache served (result hit) or sent to the disk (result miss)",
        bytes,
    );
    r.register(
        "device_cache_dropped_blocks",
        "Blocks a disk's warm cache dropped: evicted for room, or invalidated (discard, write-zeroes, a failed write)",
        dropped,
    );
    r.register(
        "device_cache_resident_bytes",
        "Bytes a disk's warm cache holds",
        resident,
    );
    r.register(
        "device_cache_capacity_bytes",
        "Size of a disk's warm cache",
        capacity,
    );
}

/// Fault tolerance (`GET /vm/ft`) and its histograms.
fn ft(r: &mut Registry, shared: &Shared) {
    let f = shared.ft.report();
    let state = serde_json::to_value(f.state).unwrap_or_default();
    let state = state.as_str().unwrap_or_default();
    r.register(
        "ft_state",
        "1 for the fault-tolerance state this VMM is in, 0 for the others",
        gauges(
            "state",
            FT_STATES
                .iter()
                .map(|s| (*s, if *s == state { 1.0 } else { 0.0 })),
        ),
    );
    r.register(
        "ft_epoch",
        "Last complete fault-tolerance epoch (sent and acknowledged, or received and applied)",
        const_gauge(f.epoch as f64),
    );
    r.register(
        "ft_kept_writable_pages",
        "Primary: pages left writable after the last sync",
        const_gauge(f.kept_writable_pages as f64),
    );
    for (name, help, value) in [
        (
            "ft_syncs",
            "Fault-tolerance syncs (epochs) since the current protection began",
            f.syncs,
        ),
        (
            "ft_outputs",
            "Output requests released after a sync since the current protection began",
            f.outputs,
        ),
        (
            "ft_pages",
            "Pages sent or received in epochs since the current protection began",
            f.pages,
        ),
        (
            "ft_unchanged_pages_skipped",
            "Primary: kept-writable pages found unchanged at a sync and not sent, since the current protection began",
            f.unchanged_pages_skipped,
        ),
        (
            "ft_link_bytes",
            "Sync-link payload bytes sent and received since the current protection began, initial copy included",
            f.link_bytes,
        ),
        (
            "ft_failovers",
            "Failovers this VMM performed",
            f.failovers,
        ),
    ] {
        r.register(name, help, ConstCounter::new(value));
    }
    if let Some(ms) = f.initial_sync_ms {
        r.register(
            "ft_initial_sync_seconds",
            "Duration of the last initial synchronization",
            const_gauge(ms as f64 / 1000.0),
        );
    }
    if let Some(ms) = f.failover_ms {
        r.register(
            "ft_failover_seconds",
            "Duration of the last failover (primary lost to VM running)",
            const_gauge(ms as f64 / 1000.0),
        );
    }
    r.register(
        "ft_pause_seconds",
        "Guest pause per fault-tolerance sync (capture of pages and state)",
        shared.ft.pause_seconds.clone(),
    );
    r.register(
        "ft_sync_seconds",
        "Output delay per fault-tolerance sync (pause, transfer and acknowledgement)",
        shared.ft.sync_seconds.clone(),
    );
}

/// The long operations and the live migration's progress.
fn operations(r: &mut Registry, shared: &Shared) {
    let m = &shared.operations.metrics;
    r.register(
        "operations",
        "Long operations that ended, by kind (migrate, migrate_local, warm_restart, snapshot, ft_start) and outcome (completed, failed, cancelled)",
        m.ended.clone(),
    );
    r.register(
        "handover_downtime_seconds",
        "Downtime of a completed hand-over as the source saw it (pause to commit), by kind",
        m.downtime.clone(),
    );
    let p = shared.migration.snapshot();
    r.register(
        "migration_remaining_pages",
        "Pages the running or last live migration still had to send at its last dirty-page harvest",
        const_gauge(p.remaining_pages as f64),
    );
}
