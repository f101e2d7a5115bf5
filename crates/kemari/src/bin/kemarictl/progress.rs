//! How kemarictl shows a long operation while it follows it: on a terminal,
//! a bar on stderr (pages of the current round or step, bytes, rate, ETA,
//! phase) that moves with each line the VMM sends; otherwise nothing, so
//! that scripts get only the final report on stdout.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;

/// The progress display of one followed operation.
pub struct View {
    bar: Option<ProgressBar>,
    round: Option<u64>,
}

impl View {
    /// A bar if stderr is a terminal, else a silent view.
    pub fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{prefix:.bold} [{bar:30}] {pos}/{len} pages  {msg}  ETA {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        View { bar, round: None }
    }

    /// Shows one line of the operation's view (`GET /vm/operation`).
    pub fn show(&mut self, line: &Value) {
        let Some(bar) = &self.bar else { return };
        let p = &line["progress"];
        let kind = line["kind"].as_str().unwrap_or("operation");
        let phase = line["phase"].as_str().unwrap_or_default();
        let round = p["round"].as_u64();
        if round != self.round {
            // A new round: its own length, from zero.
            self.round = round;
            bar.reset();
        }
        bar.set_prefix(format!("{kind} {}", line["id"]));
        bar.set_length(p["round_pages_total"].as_u64().unwrap_or(0));
        bar.set_position(p["round_pages_sent"].as_u64().unwrap_or(0));
        let bytes = p["bytes_sent"].as_u64().unwrap_or(0);
        let rate = p["rate_mb_s"].as_f64().unwrap_or(0.0);
        bar.set_message(format!(
            "{:.1} MiB sent  {rate:.0} MB/s  {phase}",
            bytes as f64 / (1 << 20) as f64
        ));
    }

    /// The operation ended: the bar goes, the report follows on stdout.
    pub fn done(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}
