//! How kemarictl shows a long operation while it follows it: each line the
//! VMM sends (the operation's view, `GET /vm/operation`) becomes a step of
//! kemari-logging's display — a bar on stderr when it is a terminal (pages
//! of the current round or step, bytes, rate, ETA, phase), plain lines on
//! stderr otherwise; stdout gets only the final report.

use kemari_logging::progress::{ProgressDisplay, Step};
use serde_json::Value;

/// The progress display of one followed operation.
pub struct View {
    display: ProgressDisplay,
}

impl View {
    /// A bar if stderr is a terminal, else lines.
    pub fn new() -> Self {
        View {
            display: ProgressDisplay::on_stderr(),
        }
    }

    /// Shows one line of the operation's view (`GET /vm/operation`).
    pub fn show(&mut self, line: &Value) {
        if let Some(step) = step(line) {
            self.display.show(step);
        }
    }

    /// The operation ended: the bar goes, the report follows on stdout.
    pub fn done(&mut self) {
        self.display.finish();
    }
}

/// The step a view line shows: its phase while it runs, then how it ended
/// (`completed`, `failed`, `cancelled`) with the last counters.
fn step(line: &Value) -> Option<Step> {
    let p = &line["progress"];
    let phase = line["phase"]
        .as_str()
        .filter(|p| !p.is_empty())
        .or_else(|| line["status"].as_str().filter(|s| *s != "running"))?;
    // A warm restart or a snapshot sends nothing: no "0 B sent" then.
    let mut message = match p["bytes_sent"].as_u64().unwrap_or(0) {
        0 => String::new(),
        bytes => format!("{} sent", amount(bytes)),
    };
    if let Some(rate) = p["rate_mb_s"].as_f64().filter(|r| *r > 0.0) {
        if !message.is_empty() {
            message.push(' ');
        }
        message.push_str(&format!("{rate:.0} MB/s"));
    }
    Some(Step {
        prefix: format!(
            "{} {}",
            line["kind"].as_str().unwrap_or("operation"),
            line["id"]
        ),
        step: phase.to_owned(),
        done: p["round_pages_sent"].as_u64().unwrap_or(0),
        total: p["round_pages_total"].as_u64().unwrap_or(0),
        unit: "pages",
        message,
    })
}

/// `bytes` in the unit that shows it: a zero-copy hand-over sends a few
/// KiB of state, a migration GiB of pages.
fn amount(bytes: u64) -> String {
    match bytes {
        0..1024 => format!("{bytes} B"),
        1024..1_048_576 => format!("{:.1} KiB", bytes as f64 / 1024.0),
        _ => format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_view_is_its_phase_then_how_it_ended() {
        let running = json!({
            "id": 3, "kind": "snapshot", "status": "running",
            "phase": "paused: saving the state and the memory image",
            "progress": {"round_pages_sent": 512, "round_pages_total": 16384,
                         "bytes_sent": 2097152, "rate_mb_s": 0.0},
        });
        let s = step(&running).unwrap();
        assert_eq!(
            s.line(),
            "snapshot 3: paused: saving the state and the memory image: 512/16384 pages (3%) 2.0 MiB sent"
        );
        let ended = json!({"id": 3, "kind": "snapshot", "status": "completed", "phase": "",
                           "progress": {"round_pages_sent": 16384, "round_pages_total": 16384}});
        assert_eq!(
            step(&ended).unwrap().line(),
            "snapshot 3: completed: 16384/16384 pages (100%)"
        );
        let warm = json!({"id": 4, "kind": "warm_restart", "status": "completed", "phase": "",
                          "progress": {"bytes_sent": 0}});
        assert_eq!(step(&warm).unwrap().line(), "warm_restart 4: completed");
        assert!(step(&json!({"status": "running", "phase": ""})).is_none());
    }

    #[test]
    fn amounts_are_shown_in_the_unit_that_fits() {
        assert_eq!(amount(0), "0 B");
        assert_eq!(amount(1023), "1023 B");
        assert_eq!(amount(11921), "11.6 KiB");
        assert_eq!(amount(1 << 20), "1.0 MiB");
        assert_eq!(amount(63 << 20), "63.0 MiB");
    }
}
