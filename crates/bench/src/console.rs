//! Guest console lines timestamped on the host, and the guest-visible downtime
//! computed from them.
//!
//! The test guest's `counter=<ms>` workload prints
//! `counter: <n> uptime_ms=<ms> uptime_us=<us> gap_us=<us>` once per period,
//! where `gap_us` is the longest time its main loop did not run since the
//! previous line (see guest/src/workloads/counter.rs). A reader thread per VMM
//! timestamps every line as it arrives through the pipe (monotonic clock).
//! When a VM moves from an old VMM to a new one, take the old VMM's last
//! counter line and the new VMM's first:
//!
//! ```text
//! stalled  = gap_us(first)                          the guest saw its loop stop
//! frozen   = (t(first) - t(last)) - (uptime_us(first) - uptime_us(last))
//!                                                   the guest's clock stood still
//! downtime = stalled + frozen (when frozen > 0.5 ms, else stalled)
//! ```
//!
//! KVM keeps the guest's TSC running across a pause and a move between VMMs
//! on one host (measured for kemari and QEMU alike), so `frozen` is normally
//! zero within the console path's jitter (±70 µs at p99) and is counted only
//! when clearly above it, for a VMM that restores an old TSC value. The
//! resolution is the loop's own stall floor with nothing happening, which the
//! old VMM's lines show: see [`Outage::resolution`].
//!
//! Lines without `gap_us` (guests built before it), and a guest that rebooted,
//! fall back to `host gap - period`, good to one period only.

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
    /// It ended with a newline (the last output of a VMM that stopped the
    /// guest in the middle of a line does not).
    pub whole: bool,
}

/// A parsed `counter: <n> uptime_ms=<ms> [uptime_us=<us> gap_us=<us>]` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterLine {
    /// The count.
    pub n: u64,
    /// The guest's uptime.
    pub uptime_ms: u64,
    /// The guest's uptime to the microsecond, and the longest stall of its
    /// main loop since the previous line (guests before these were added
    /// print only `uptime_ms`).
    pub fine: Option<FineTime>,
}

/// The microsecond fields of a counter line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FineTime {
    /// The guest's uptime.
    pub uptime_us: u64,
    /// The longest main-loop stall since the previous line.
    pub gap_us: u64,
}

/// Parses a counter line; None for any other line.
pub fn parse_counter(line: &str) -> Option<CounterLine> {
    let rest = line.trim_end().strip_prefix("counter: ")?;
    let mut words = rest.split_whitespace();
    let n = words.next()?.parse().ok()?;
    let uptime_ms = words.next()?.strip_prefix("uptime_ms=")?.parse().ok()?;
    let mut field = |name: &str| -> Option<u64> { words.next()?.strip_prefix(name)?.parse().ok() };
    let fine = match (field("uptime_us="), field("gap_us=")) {
        (Some(uptime_us), Some(gap_us)) => Some(FineTime { uptime_us, gap_us }),
        _ => None,
    };
    Some(CounterLine { n, uptime_ms, fine })
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
    /// What `downtime` can tell apart: with the microsecond fields, the 90th
    /// percentile of the old VMM's `gap_us` (the loop's stalls with nothing
    /// happening); else one period.
    pub resolution: Duration,
    /// Whether the microsecond fields were used.
    pub fine: bool,
    /// The old VMM's last count.
    pub last_old: u64,
    /// The new VMM's first count.
    pub first_new: u64,
    /// The pause fell while the guest printed a line: the old VMM's output
    /// ends inside it. The guest then goes on inside its console code (run
    /// by emulation on this PVM host: ~10 µs per byte), and the first turn
    /// after the move is slower than after a pause between lines.
    pub mid_line: bool,
}

impl Outage {
    /// Whether the guest went on counting (rather than rebooting: a counter
    /// restarted at 0 or 1).
    pub fn continued(&self) -> bool {
        self.first_new > self.last_old
    }
}

/// A guest clock that lagged the host's by less than this between two lines
/// did not stand still: the console path's jitter.
const FROZEN_MIN: Duration = Duration::from_micros(500);

/// Whole counter lines compared on each side by [`clock_shift`].
pub const SHIFT_LINES: usize = 5;

/// How far the guest's clock fell behind the host's across the operation:
/// the smallest (host arrival − guest uptime) of the new VMM's first whole
/// counter lines (after `since`) less that of the old VMM's last ones. A
/// line reaches the host some time after the guest printed it — more when
/// its reader waits for a CPU — so one line's offset is an upper bound, and
/// the smallest of a few is the offset itself: a clock that stood still
/// shifts every later line, a late line only itself.
fn clock_shift(old: &[Line], new: &[Line], since: Instant) -> Duration {
    // Host arrival less guest uptime: the instant the guest's clock read 0
    // as seen from each line (shifted by a constant so that it cannot fall
    // before the host clock's start).
    let epoch = |l: &Line| -> Option<Instant> {
        let us = parse_counter(&l.text)?.fine?.uptime_us;
        (l.at + Duration::from_secs(1 << 20)).checked_sub(Duration::from_micros(us))
    };
    let before = old.iter().rev().filter_map(epoch).take(SHIFT_LINES).min();
    let after = new
        .iter()
        .filter(|l| l.at >= since)
        .filter_map(epoch)
        .take(SHIFT_LINES)
        .min();
    match (before, after) {
        (Some(b), Some(a)) => a.saturating_duration_since(b),
        _ => Duration::ZERO,
    }
}

/// The 90th percentile of the `gap_us` of the counter lines in `lines`.
fn stall_floor(lines: &[Line]) -> Option<Duration> {
    let mut gaps: Vec<u64> = lines
        .iter()
        .filter_map(|l| parse_counter(&l.text)?.fine.map(|f| f.gap_us))
        .collect();
    // The first line's gap covers the guest's start-up.
    if gaps.len() < 2 {
        return None;
    }
    gaps.remove(0);
    gaps.sort_unstable();
    Some(Duration::from_micros(
        gaps[(gaps.len() * 9).div_ceil(10) - 1],
    ))
}

/// The outage between the old VMM's last counter line and the new VMM's first
/// counter line at or after `since` (lines of a new VMM that existed before
/// the operation, e.g. a migration destination, cannot count).
pub fn outage(old: &[Line], new: &[Line], since: Instant, period: Duration) -> Option<Outage> {
    let (t_old, last) = last_counter(old)?;
    let (t_new, first) = first_counter_after(new, since)?;
    let coarse = Outage {
        downtime: t_new
            .saturating_duration_since(t_old)
            .saturating_sub(period),
        resolution: period,
        fine: false,
        last_old: last.n,
        first_new: first.n,
        mid_line: old.last().is_some_and(|l| !l.whole),
    };
    // A pause often falls while the guest prints a line (a print is a good
    // part of its time), and the old VMM then shows only the line's start and
    // the new VMM its end. So take the last and first lines that are whole:
    // the pause is in the stall the next whole line reports.
    let whole = |l: &Line| {
        let c = parse_counter(&l.text)?;
        Some((l.at, c.n, c.fine?))
    };
    let last_whole = old.iter().rev().find_map(whole);
    let mut new_whole = new.iter().filter(|l| l.at >= since).filter_map(whole);
    let first_whole = new_whole.next();
    // The line after it: when the guest's clock lagged after the move and
    // then caught up (kvmclock brought up to date after the restore), the
    // first line reports too short a stall and the catch-up shows as one in
    // the next.
    let second_gap_us = new_whole.next().map_or(0, |(_, _, c)| c.gap_us);
    let (Some((_, n_a, a)), Some((_, n_b, b))) = (last_whole, first_whole) else {
        return Some(coarse);
    };
    if first.n <= last.n || n_b <= n_a || b.uptime_us < a.uptime_us {
        return Some(coarse); // rebooted: its clock started again
    }
    let frozen = clock_shift(old, new, since);
    let stalled = Duration::from_micros(b.gap_us.max(second_gap_us));
    Some(Outage {
        downtime: if frozen > FROZEN_MIN {
            stalled + frozen
        } else {
            stalled
        },
        resolution: stall_floor(old).unwrap_or(period),
        fine: true,
        ..coarse
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
                let whole = buf.ends_with(b"\n");
                let text = String::from_utf8_lossy(&buf).trim_end().to_owned();
                g.lines.push(Line { at, text, whole });
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
            whole: true,
        }
    }

    #[test]
    fn parses_counter_lines_only() {
        assert_eq!(
            parse_counter("counter: 42 uptime_ms=4200"),
            Some(CounterLine {
                n: 42,
                uptime_ms: 4200,
                fine: None,
            })
        );
        assert_eq!(
            parse_counter("counter: 7 uptime_ms=70\r"),
            Some(CounterLine {
                n: 7,
                uptime_ms: 70,
                fine: None,
            })
        );
        assert_eq!(
            parse_counter("counter: 8 uptime_ms=80 uptime_us=80123 gap_us=41\r"),
            Some(CounterLine {
                n: 8,
                uptime_ms: 80,
                fine: Some(FineTime {
                    uptime_us: 80_123,
                    gap_us: 41
                }),
            })
        );
        // Half the fine fields: the line still counts, coarsely.
        assert_eq!(
            parse_counter("counter: 8 uptime_ms=80 uptime_us=80123")
                .unwrap()
                .fine,
            None
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
        assert!(!o.fine);
        assert_eq!((o.last_old, o.first_new), (11, 12));
        assert!(o.continued());
        assert!(!o.mid_line);
    }

    #[test]
    fn a_pause_inside_a_line_is_told_apart() {
        let t0 = Instant::now();
        let mut cut = line(t0, 12, "counter: 12 upt");
        cut.whole = false;
        let old = vec![line(t0, 10, "counter: 11 uptime_ms=110"), cut];
        let new = vec![
            line(t0, 14, "ime_ms=120"),
            line(t0, 20, "counter: 13 uptime_ms=130"),
        ];
        let o = outage(
            &old,
            &new,
            t0 + Duration::from_millis(13),
            Duration::from_millis(10),
        )
        .unwrap();
        assert!(o.mid_line);
        assert_eq!((o.last_old, o.first_new), (11, 13));
    }

    #[test]
    fn downtime_is_the_stall_the_guest_saw() {
        let t0 = Instant::now();
        let old = vec![
            line(
                t0,
                0,
                "counter: 9 uptime_ms=100 uptime_us=100000 gap_us=900",
            ),
            line(
                t0,
                10,
                "counter: 10 uptime_ms=110 uptime_us=110000 gap_us=60",
            ),
            line(
                t0,
                20,
                "counter: 11 uptime_ms=120 uptime_us=120000 gap_us=80",
            ),
        ];
        // The guest's clock ran on with the host's (12 ms each): the pause
        // shows only as the loop's stall, 1.7 ms, shorter than the period.
        let new = vec![line(
            t0,
            32,
            "counter: 12 uptime_ms=132 uptime_us=132000 gap_us=1700",
        )];
        let o = outage(&old, &new, t0, Duration::from_millis(10)).unwrap();
        assert_eq!(o.downtime, Duration::from_micros(1_700));
        // The first line's start-up gap (900) does not count.
        assert_eq!(o.resolution, Duration::from_micros(80));
        assert!(o.fine && o.continued());
        // A clock that stood still 3 ms of the host's 12: that is added.
        let frozen = vec![line(
            t0,
            32,
            "counter: 12 uptime_ms=129 uptime_us=129000 gap_us=200",
        )];
        let o = outage(&old, &frozen, t0, Duration::from_millis(10)).unwrap();
        assert_eq!(o.downtime, Duration::from_micros(3_200));
        // The pause fell while line 12 was printed: the old VMM shows its
        // start, the new one its end; line 13 reports the stall.
        let mut torn_old = old.clone();
        torn_old.push(line(t0, 30, "counter: 12 uptime_ms=130 upt"));
        let torn_new = vec![
            line(t0, 33, "ime_us=130000 gap_us=70"),
            line(
                t0,
                40,
                "counter: 13 uptime_ms=140 uptime_us=140000 gap_us=2100",
            ),
        ];
        let o = outage(&torn_old, &torn_new, t0, Duration::from_millis(10)).unwrap();
        assert_eq!(o.downtime, Duration::from_micros(2_100));
        assert!(o.fine);
        // A guest clock that went back (a reboot) falls back to the period.
        let rebooted = vec![line(
            t0,
            40,
            "counter: 0 uptime_ms=0 uptime_us=40 gap_us=10",
        )];
        let o = outage(&old, &rebooted, t0, Duration::from_millis(10)).unwrap();
        assert_eq!(o.downtime, Duration::from_millis(10));
        assert_eq!(o.resolution, Duration::from_millis(10));
        assert!(!o.fine && !o.continued());
    }

    #[test]
    fn a_line_that_reached_the_host_late_is_not_a_frozen_clock() {
        let t0 = Instant::now();
        // Counter line `n` printed at guest time `uptime_us` with stall
        // `gap_us`, read by the host at `host_us`.
        let fine = |host_us: u64, n: u64, uptime_us: u64, gap_us: u64| Line {
            at: t0 + Duration::from_micros(host_us),
            text: format!(
                "counter: {n} uptime_ms={} uptime_us={uptime_us} gap_us={gap_us}",
                uptime_us / 1000
            ),
            whole: true,
        };
        let old: Vec<Line> = (0..4).map(|i| fine(2000 * i, i, 2000 * i, 50)).collect();
        let period = Duration::from_millis(2);
        // Line 4 was printed on time but its reader ran 0.7 ms late; lines 5
        // and 6 arrived on time: the guest's clock kept up, the stall is 0.6.
        let late = [
            fine(8_700, 4, 8_000, 600),
            fine(10_020, 5, 10_000, 200),
            fine(12_010, 6, 12_000, 60),
        ];
        let o = outage(&old, &late, t0, period).unwrap();
        assert_eq!(o.downtime, Duration::from_micros(600));
        // The same first line with every later one as late: a clock that
        // stood still 0.7 ms (then it is added).
        let frozen = [fine(8_700, 4, 8_000, 600), fine(10_700, 5, 10_000, 60)];
        let o = outage(&old, &frozen, t0, period).unwrap();
        assert_eq!(o.downtime, Duration::from_micros(1_300));
        // A clock that lagged after the move and caught up: the first line
        // (late on the host by the lag) reports a short stall, the next the
        // catch-up; the later lines are on time. The stall is the larger.
        let caught_up = [
            fine(8_720, 4, 8_000, 65),
            fine(10_010, 5, 10_000, 690),
            fine(12_005, 6, 12_000, 90),
        ];
        let o = outage(&old, &caught_up, t0, period).unwrap();
        assert_eq!(o.downtime, Duration::from_micros(690));
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
