//! The fleet as rows — one per VM: where it runs, who protects it, since
//! when — for `kemarictl fleet` (a table or JSON) and the agent's page.

use serde::Serialize;

use crate::record::HostRecord;
use crate::store::Snapshot;

/// One VM of the fleet.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// The VM's id.
    pub vm: String,
    /// The host that runs it.
    pub primary: String,
    /// The host protecting it (or claiming to), if any.
    pub standby: Option<String>,
    /// Its fault-tolerance state on the primary; `host-lost` when the
    /// primary's agent is no longer registered and no failover was seen.
    pub state: String,
    /// The last epoch synchronized.
    pub epoch: u64,
    /// Synchronizations per second.
    pub syncs_per_s: f64,
    /// Runs on `primary` since (Unix seconds).
    pub since_unix: u64,
    /// Failovers seen.
    pub failovers: u64,
    /// The last one: when (Unix seconds), from which host to which.
    pub last_failover: Option<crate::record::Failover>,
}

/// The whole view: VMs and hosts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fleet {
    /// One row per VM, by id.
    pub vms: Vec<Row>,
    /// Registered hosts, by name.
    pub hosts: Vec<HostRecord>,
}

/// The view of a registry snapshot.
pub fn fleet(snap: &Snapshot) -> Fleet {
    let vms = snap
        .vms
        .values()
        .map(|v| {
            let v = &v.value;
            let standby = match (&v.standby, snap.claims.get(&v.id)) {
                (Some(s), _) => Some(s.clone()),
                (None, Some(c)) => Some(format!("{} (starting)", c.value.host)),
                (None, None) => None,
            };
            let state = if v.state != "down" && !snap.hosts.contains_key(&v.primary) {
                "host-lost".to_owned()
            } else {
                v.state.clone()
            };
            Row {
                vm: v.id.clone(),
                primary: v.primary.clone(),
                standby,
                state,
                epoch: v.epoch,
                syncs_per_s: v.syncs_per_s,
                since_unix: v.since_unix,
                failovers: v.failovers,
                last_failover: v.last_failover.clone(),
            }
        })
        .collect();
    Fleet {
        vms,
        hosts: snap.host_list(),
    }
}

/// `2026-11-26 07:09:07Z` (UTC), or `-` for 0.
pub fn when(unix: u64) -> String {
    if unix == 0 {
        return "-".into();
    }
    let days = (unix / 86_400) as i64;
    let secs = unix % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

fn last_failover(r: &Row) -> String {
    match &r.last_failover {
        Some(f) => format!("{} {}→{}", when(f.at_unix), f.from, f.to),
        None => "-".into(),
    }
}

/// The text table of `kemarictl fleet`.
pub fn table(f: &Fleet) -> String {
    let header = [
        "VM",
        "PRIMARY",
        "STANDBY",
        "STATE",
        "EPOCH",
        "SYNCS/S",
        "SINCE",
        "LAST FAILOVER",
    ];
    let rows: Vec<[String; 8]> = f
        .vms
        .iter()
        .map(|r| {
            [
                r.vm.clone(),
                r.primary.clone(),
                r.standby.clone().unwrap_or_else(|| "-".into()),
                r.state.clone(),
                r.epoch.to_string(),
                format!("{:.1}", r.syncs_per_s),
                when(r.since_unix),
                last_failover(r),
            ]
        })
        .collect();
    let mut widths = header.map(|h| h.chars().count());
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == cells.len() {
                s += c;
            } else {
                s += &format!("{c}{}  ", " ".repeat(w - c.chars().count()));
            }
        }
        s.trim_end().to_owned() + "\n"
    };
    let mut out = line(header.to_vec());
    for r in &rows {
        out += &line(r.iter().map(String::as_str).collect());
    }
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The agent's fleet page: the same rows, and the hosts; it reloads itself
/// every `refresh_s` seconds. `seen_by` names the serving host.
pub fn html(f: &Fleet, seen_by: &str, refresh_s: u32) -> String {
    let mut vms = String::new();
    for r in &f.vms {
        vms += &format!(
            "<tr class=\"vm state-{state}\" data-vm=\"{vm}\"><td class=\"id\">{vm}</td><td class=\"primary\">{p}</td><td class=\"standby\">{s}</td><td class=\"state\">{state}</td><td>{e}</td><td>{r:.1}</td><td>{since}</td><td>{lf}</td></tr>\n",
            vm = esc(&r.vm),
            p = esc(&r.primary),
            s = esc(r.standby.as_deref().unwrap_or("-")),
            state = esc(&r.state),
            e = r.epoch,
            r = r.syncs_per_s,
            since = when(r.since_unix),
            lf = esc(&last_failover(r)),
        );
    }
    if f.vms.is_empty() {
        vms = "<tr><td colspan=\"8\">no VM registered</td></tr>\n".into();
    }
    let mut hosts = String::new();
    for h in &f.hosts {
        hosts += &format!(
            "<tr class=\"host\" data-host=\"{n}\"><td>{n}</td><td>{a}</td><td>{u}/{s}</td><td>{m} MiB</td><td>{since}</td></tr>\n",
            n = esc(&h.name),
            a = esc(&h.address),
            u = h.standbys,
            s = h.slots,
            m = h.free_memory_bytes >> 20,
            since = when(h.since_unix),
        );
    }
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{refresh_s}">
<title>kemari fleet</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; background: #f7f7f5; color: #222; }}
h1 {{ font-size: 1.4em; }} h2 {{ font-size: 1.1em; margin-top: 1.5em; }}
table {{ border-collapse: collapse; background: #fff; }}
th, td {{ border: 1px solid #bbb; padding: 0.3em 0.7em; text-align: left; }}
th {{ background: #2b4a6f; color: #fff; }}
tr.state-protected td.state {{ background: #b8e0b0; }}
tr.state-syncing td.state {{ background: #f3e3a0; }}
tr.state-unprotected td.state, tr.state-degraded td.state, tr.state-failed_over td.state {{ background: #f4c08c; }}
tr.state-down td.state, tr.state-host-lost td.state {{ background: #e88; }}
footer {{ margin-top: 1.5em; font-size: 0.8em; color: #666; }}
</style></head>
<body>
<h1>kemari fleet</h1>
<table id="vms"><thead><tr><th>VM</th><th>primary</th><th>standby</th><th>state</th><th>epoch</th><th>syncs/s</th><th>since</th><th>last failover</th></tr></thead>
<tbody>
{vms}</tbody></table>
<h2>Hosts</h2>
<table id="hosts"><thead><tr><th>host</th><th>address</th><th>standbys</th><th>free memory</th><th>registered since</th></tr></thead>
<tbody>
{hosts}</tbody></table>
<footer>served by {by}; refreshes every {refresh_s} s</footer>
</body></html>
"#,
        by = esc(seen_by),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{Claim, Failover, VmRecord};
    use crate::store::Versioned;

    fn snap() -> Snapshot {
        let mut s = Snapshot::default();
        for n in ["h0", "h2"] {
            s.hosts.insert(
                n.into(),
                HostRecord {
                    name: n.into(),
                    address: "10.0.0.1".into(),
                    http: None,
                    slots: 4,
                    standbys: 1,
                    free_memory_bytes: 3 << 30,
                    key_id: "k".into(),
                    since_unix: 1_764_140_947,
                },
            );
        }
        let vm = |id: &str, primary: &str, state: &str, standby: Option<&str>| VmRecord {
            id: id.into(),
            primary: primary.into(),
            standby: standby.map(Into::into),
            state: state.into(),
            epoch: 42,
            syncs_per_s: 12.34,
            memory_bytes: Some(1 << 30),
            since_unix: 1_764_140_947,
            failovers: 1,
            last_failover: Some(Failover {
                at_unix: 1_764_140_947,
                from: "h1".into(),
                to: primary.into(),
                failover_ms: Some(30),
            }),
            updated_unix: 0,
        };
        for v in [
            vm("web-1", "h2", "protected", Some("h0")),
            vm("db<1>", "h0", "failed_over", None),
            vm("old", "h9", "degraded", None),
        ] {
            s.vms.insert(
                v.id.clone(),
                Versioned {
                    value: v,
                    revision: 1,
                },
            );
        }
        s.claims.insert(
            "db<1>".into(),
            Versioned {
                value: Claim {
                    host: "h2".into(),
                    peer: None,
                    since_unix: 0,
                },
                revision: 2,
            },
        );
        s
    }

    #[test]
    fn rows_say_where_each_vm_runs_and_who_protects_it() {
        let f = fleet(&snap());
        let r: Vec<_> = f
            .vms
            .iter()
            .map(|r| {
                (
                    r.vm.as_str(),
                    r.primary.as_str(),
                    r.standby.as_deref(),
                    r.state.as_str(),
                )
            })
            .collect();
        assert_eq!(
            r,
            [
                ("db<1>", "h0", Some("h2 (starting)"), "failed_over"),
                ("old", "h9", None, "host-lost"),
                ("web-1", "h2", Some("h0"), "protected"),
            ]
        );
        let t = table(&f);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("VM     PRIMARY  STANDBY"), "{t}");
        assert!(lines[3].contains("web-1  h2       h0"), "{t}");
        assert!(lines[3].contains("12.3"), "{t}");
        assert!(lines[3].contains("2025-11-26 07:09:07Z h1→h2"), "{t}");
    }

    #[test]
    fn the_page_escapes_names_and_refreshes() {
        let page = html(&fleet(&snap()), "h<0>", 2);
        assert!(page.contains("<meta http-equiv=\"refresh\" content=\"2\">"));
        assert!(page.contains("data-vm=\"db&lt;1&gt;\""), "{page}");
        assert!(!page.contains("db<1>"));
        assert!(page.contains("<td class=\"standby\">h0</td>"));
        assert!(page.contains("served by h&lt;0&gt;"));
        assert!(html(
            &Fleet {
                vms: vec![],
                hosts: vec![]
            },
            "h",
            2
        )
        .contains("no VM registered"));
    }

    #[test]
    fn dates_are_utc() {
        assert_eq!(when(0), "-");
        assert_eq!(when(951_782_400), "2000-02-29 00:00:00Z");
        assert_eq!(when(1_764_140_947), "2025-11-26 07:09:07Z");
    }
}
