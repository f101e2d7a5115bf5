//! How a command shows a long operation while it follows it (`kemarictl
//! migrate`, `snapshot`, `warm-restart`, `ft start`, `operation follow`;
//! `kemari-nbd status --watch`): on a terminal an `indicatif` bar (done of
//! total, rate, ETA, a message) that starts again from zero at each new
//! step (a pre-copy round, a phase); otherwise plain lines, one at each new
//! step and at most one a [`LINE_EVERY`] within a step, plus the last
//! state at the end — for logs and scripts:
//!
//! ```text
//! migrate 1: round 2: 1200/4096 pages (29%) 60.1 MiB sent 118 MB/s
//! ```

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Longest time between two lines within one step.
pub const LINE_EVERY: Duration = Duration::from_secs(1);

/// Where a step stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Who (`migrate 3`, the proxy's upstream).
    pub prefix: String,
    /// Which step (`round 2`, a phase); a new one restarts the bar.
    pub step: String,
    /// Units done in this step.
    pub done: u64,
    /// Units in this step (0: not known).
    pub total: u64,
    /// The unit (`pages`, `blocks`).
    pub unit: &'static str,
    /// The rest (bytes sent, rate).
    pub message: String,
}

impl Step {
    /// The plain line for this step.
    pub fn line(&self) -> String {
        let mut line = format!("{}: {}", self.prefix, self.step);
        if self.total > 0 {
            let pct = self.done as f64 * 100.0 / self.total as f64;
            line.push_str(&format!(
                ": {}/{} {} ({pct:.0}%)",
                self.done, self.total, self.unit
            ));
        }
        if !self.message.is_empty() {
            line.push(' ');
            line.push_str(&self.message);
        }
        line
    }
}

enum Output {
    Bar(ProgressBar),
    Lines(Box<dyn Write + Send>),
}

/// The progress display of one followed operation.
pub struct ProgressDisplay {
    output: Output,
    last: Option<Step>,
    /// When the last line was written, and whether `last` was.
    written: Option<(Instant, bool)>,
}

impl ProgressDisplay {
    /// A bar on stderr if it is a terminal, else lines on stderr (stdout
    /// keeps the command's result).
    pub fn on_stderr() -> Self {
        if std::io::stderr().is_terminal() {
            Self::bar(ProgressDrawTarget::stderr())
        } else {
            Self::lines(Box::new(std::io::stderr()))
        }
    }

    /// A bar on stdout if it is a terminal, else lines on stdout (when
    /// the progress is the command's output).
    pub fn on_stdout() -> Self {
        if std::io::stdout().is_terminal() {
            Self::bar(ProgressDrawTarget::stdout())
        } else {
            Self::lines(Box::new(std::io::stdout()))
        }
    }

    /// Plain lines into `w`.
    pub fn lines(w: Box<dyn Write + Send>) -> Self {
        ProgressDisplay {
            output: Output::Lines(w),
            last: None,
            written: None,
        }
    }

    fn bar(target: ProgressDrawTarget) -> Self {
        let bar = ProgressBar::with_draw_target(Some(0), target);
        bar.set_style(
            ProgressStyle::with_template("{prefix:.bold} [{bar:30}] {pos}/{len} {msg}  ETA {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        ProgressDisplay {
            output: Output::Bar(bar),
            last: None,
            written: None,
        }
    }

    /// Shows `step`.
    pub fn show(&mut self, step: Step) {
        let new_step = self
            .last
            .as_ref()
            .is_none_or(|l| l.step != step.step || l.prefix != step.prefix);
        match &mut self.output {
            Output::Bar(bar) => {
                if new_step {
                    bar.reset();
                }
                bar.set_prefix(step.prefix.clone());
                bar.set_length(step.total);
                bar.set_position(step.done);
                bar.set_message(format!("{}  {}  {}", step.unit, step.message, step.step));
            }
            Output::Lines(w) => {
                let due = new_step
                    || self
                        .written
                        .is_none_or(|(at, _)| at.elapsed() >= LINE_EVERY);
                let changed = self.last.as_ref() != Some(&step);
                if due && changed {
                    // A closed stderr is no reason to stop following.
                    let _ = writeln!(w, "{}", step.line()).and_then(|()| w.flush());
                    self.written = Some((Instant::now(), true));
                } else if changed {
                    self.written = self.written.map(|(at, _)| (at, false));
                }
            }
        }
        self.last = Some(step);
    }

    /// The operation ended: the bar goes (the result follows), or the last
    /// state is written if it was not yet.
    pub fn finish(&mut self) {
        self.end(false);
    }

    /// As [`finish`](Self::finish), but the bar stays, at its last state
    /// (when nothing follows it).
    pub fn finish_and_keep(&mut self) {
        self.end(true);
    }

    fn end(&mut self, keep: bool) {
        match &mut self.output {
            Output::Bar(bar) if keep => bar.finish(),
            Output::Bar(bar) => bar.finish_and_clear(),
            Output::Lines(w) => {
                if let (Some(last), Some((_, false))) = (&self.last, self.written) {
                    let _ = writeln!(w, "{}", last.line()).and_then(|()| w.flush());
                }
            }
        }
        self.written = None;
        self.last = None;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().write(buf)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn step(step: &str, done: u64) -> Step {
        Step {
            prefix: "migrate 1".into(),
            step: step.into(),
            done,
            total: 4096,
            unit: "pages",
            message: format!("{done} sent"),
        }
    }

    #[test]
    fn one_line_per_new_step_and_the_last_state_at_the_end() {
        let out = Shared::default();
        let mut d = ProgressDisplay::lines(Box::new(out.clone()));
        d.show(step("round 1", 0));
        // Within a second of the last line: not written yet.
        d.show(step("round 1", 2048));
        d.show(step("round 2", 10));
        d.show(step("round 2", 10));
        d.show(step("round 2", 4096));
        d.finish();
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert_eq!(
            text,
            "migrate 1: round 1: 0/4096 pages (0%) 0 sent\n\
             migrate 1: round 2: 10/4096 pages (0%) 10 sent\n\
             migrate 1: round 2: 4096/4096 pages (100%) 4096 sent\n"
        );
    }

    #[test]
    fn a_step_of_unknown_size_has_no_count() {
        let s = Step {
            total: 0,
            message: String::new(),
            ..step("connecting", 0)
        };
        assert_eq!(s.line(), "migrate 1: connecting");
    }

    #[test]
    fn nothing_to_add_at_the_end_when_the_last_state_was_written() {
        let out = Shared::default();
        let mut d = ProgressDisplay::lines(Box::new(out.clone()));
        d.show(step("round 1", 5));
        d.finish();
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
    }
}
