//! Guest console lines timestamped on the host, and the guest-visible downtime
//! computed from them.
//!
//! The test guest's `counter=<ms>` workload prints `counter: <n> uptime_ms=<ms>`
//! once per period. A reader thread per VMM timestamps every line as it
//! arrives through the pipe (monotonic clock). When a VM moves from an old
//! VMM to a new one, the guest should have printed its next line one period
//! after the old VMM's last; any later is downtime:
//!
//! ```text
//! downtime = t(first counter line of the new VMM) - t(last counter line of the old VMM) - period
//! ```
//!
//! clamped at 0. Resolution: one period (the pause can begin anywhere within
//! the period after the last line), plus pipe and scheduling latency.

use std::io::{BufRead, BufReader, Read};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One line the guest printed, with the host time it arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// Host monotonic time of arrival.
    pub at: Instant,
    /// The line, without its newline.
    pub text: String,
}

/// A parsed `counter: <n> uptime_ms=<ms>` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterLine {
    /// The count.
    pub n: u64,
    /// The guest's uptime.
    pub uptime_ms: u64,
}

/// Parses a counter line; None for any other line.
pub fn parse_counter(line: &str) -> Option<CounterLine> {
    let rest = line.trim_end().strip_prefix("counter: ")?;
    let mut words = rest.split_whitespace();
    let n = words.next()?.parse().ok()?;
    let uptime_ms = words.next()?.strip_prefix("uptime_ms=")?.parse().ok()?;
    Some(CounterLine { n, uptime_ms })
}

/// The last counter line in `lines`.
pub fn last_counter(lines: &[Line]) -> Option<(Instant, CounterLine)> {
    lines
        .iter()
        .rev()
        .find_map(|l| parse_counter(&l.text).map(|c| (l.at, c)))
}

/// The first counter line in `lines` at or after `after`.
pub fn first_counter_after(lines: &[Line], after: Instant) -> Option<(Instant, CounterLine)> {
    lines
        .iter()
        .filter(|l| l.at >= after)
        .find_map(|l| parse_counter(&l.text).map(|c| (l.at, c)))
}

/// What the counter lines say about one operation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outage {
    /// Guest-visible downtime (see the module doc), clamped at 0.
    pub downtime: Duration,
    /// The old VMM's last count.
    pub last_old: u64,
    /// The new VMM's first count.
    pub first_new: u64,
}

impl Outage {
    /// Whether the guest went on counting (rather than rebooting: a counter
    /// restarted at 0 or 1).
    pub fn continued(&self) -> bool {
        self.first_new > self.last_old
    }
}

/// The outage between the old VMM's last counter line and the new VMM's first
/// counter line at or after `since` (lines of a new VMM that existed before
/// the operation, e.g. a migration destination, cannot count).
pub fn outage(old: &[Line], new: &[Line], since: Instant, period: Duration) -> Option<Outage> {
    let (t_old, last) = last_counter(old)?;
    let (t_new, first) = first_counter_after(new, since)?;
    let gap = t_new.saturating_duration_since(t_old);
    Some(Outage {
        downtime: gap.saturating_sub(period),
        last_old: last.n,
        first_new: first.n,
    })
}

#[derive(Default)]
struct Shared {
    lines: Vec<Line>,
    eof: bool,
}

/// Lines read from one child's output by a thread of their own.
pub struct Console {
    shared: Arc<(Mutex<Shared>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

/// Keep at most this many lines (a long run at 1 ms periods stays bounded).
const MAX_LINES: usize = 200_000;

impl Console {
    /// Starts reading `pipe` line by line.
    pub fn start(pipe: impl Read + Send + 'static) -> Console {
        let shared = Arc::new((Mutex::new(Shared::default()), Condvar::new()));
        let s = shared.clone();
        let thread = std::thread::spawn(move || {
            let mut r = BufReader::new(pipe);
            let mut buf = Vec::new();
            loop {
                buf.clear();
                let n = r.read_until(b'\n', &mut buf).unwrap_or(0);
                let at = Instant::now();
                let (m, cv) = &*s;
                let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
                if n == 0 {
                    g.eof = true;
                    cv.notify_all();
                    return;
                }
                if g.lines.len() >= MAX_LINES {
                    g.lines.drain(..MAX_LINES / 2);
                }
                let text = String::from_utf8_lossy(&buf).trim_end().to_owned();
                g.lines.push(Line { at, text });
                cv.notify_all();
            }
        });
        Console {
            shared,
            thread: Some(thread),
        }
    }

    /// A copy of every line so far.
    pub fn lines(&self) -> Vec<Line> {
        let (m, _) = &*self.shared;
        m.lock().unwrap_or_else(|p| p.into_inner()).lines.clone()
    }

    /// Waits until `found` returns Some for the lines so far, or the output
    /// ends, or `timeout` passes.
    pub fn wait_for<T>(
        &self,
        timeout: Duration,
        mut found: impl FnMut(&[Line]) -> Option<T>,
    ) -> Option<T> {
        let deadline = Instant::now() + timeout;
        let (m, cv) = &*self.shared;
        let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(v) = found(&g.lines) {
                return Some(v);
            }
            let now = Instant::now();
            if g.eof || now >= deadline {
                return None;
            }
            g = cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Waits until the output ends (the process exited); false on timeout.
    pub fn wait_eof(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let (m, cv) = &*self.shared;
        let mut g = m.lock().unwrap_or_else(|p| p.into_inner());
        while !g.eof {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            g = cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        // The thread ends when the pipe closes (the child is gone); do not
        // block a drop on it if the child somehow lives on.
        if let Some(t) = self.thread.take() {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(base: Instant, ms: u64, text: &str) -> Line {
        Line {
            at: base + Duration::from_millis(ms),
            text: text.to_owned(),
        }
    }

    #[test]
    fn parses_counter_lines_only() {
        assert_eq!(
            parse_counter("counter: 42 uptime_ms=4200"),
            Some(CounterLine {
                n: 42,
                uptime_ms: 4200
            })
        );
        assert_eq!(
            parse_counter("counter: 7 uptime_ms=70\r"),
            Some(CounterLine {
                n: 7,
                uptime_ms: 70
            })
        );
        assert_eq!(
            parse_counter("dirty: rate=1000 ws_pages=16384 total=5"),
            None
        );
        assert_eq!(parse_counter("counter: x uptime_ms=1"), None);
        assert_eq!(parse_counter("counter: 3"), None);
        assert_eq!(parse_counter("counter: 3 uptime=1"), None);
    }

    #[test]
    fn downtime_is_the_gap_beyond_one_period() {
        let t0 = Instant::now();
        let old = vec![
            line(t0, 0, "counter: 10 uptime_ms=100"),
            line(t0, 10, "counter: 11 uptime_ms=110"),
            line(t0, 15, "dirty: rate=1000 ws_pages=16384 total=9"),
        ];
        let new = vec![
            line(t0, 5, "counter: 0 uptime_ms=0"), // before the operation: ignored
            line(t0, 40, "kemari-guest: hello"),
            line(t0, 57, "counter: 12 uptime_ms=157"),
            line(t0, 60, "counter: 13 uptime_ms=160"),
        ];
        let o = outage(
            &old,
            &new,
            t0 + Duration::from_millis(12),
            Duration::from_millis(10),
        )
        .unwrap();
        assert_eq!(o.downtime, Duration::from_millis(37)); // 57 - 10 - 10
        assert_eq!((o.last_old, o.first_new), (11, 12));
        assert!(o.continued());
    }

    #[test]
    fn downtime_clamps_at_zero_and_sees_a_reboot() {
        let t0 = Instant::now();
        let old = vec![line(t0, 0, "counter: 5 uptime_ms=50")];
        let new = vec![line(t0, 4, "counter: 0 uptime_ms=0")];
        let o = outage(&old, &new, t0, Duration::from_millis(10)).unwrap();
        assert_eq!(o.downtime, Duration::ZERO);
        assert!(!o.continued());
        assert!(outage(&[], &new, t0, Duration::from_millis(10)).is_none());
        assert!(outage(&old, &[], t0, Duration::from_millis(10)).is_none());
    }

    #[test]
    fn console_collects_lines_and_sees_the_end() {
        let c = Console::start(std::io::Cursor::new(
            b"a\ncounter: 1 uptime_ms=2\n".to_vec(),
        ));
        assert!(c.wait_eof(Duration::from_secs(5)));
        let got = c.wait_for(Duration::from_secs(1), |l| last_counter(l).map(|x| x.1.n));
        assert_eq!(got, Some(1));
        assert_eq!(c.lines().len(), 2);
    }
}
