//! A rate over a sliding window: per-second counts of the last
//! [`WINDOW_SECS`] seconds, so that a reading right after protection began
//! (one sync in a few milliseconds) is not an absurd thousands per second,
//! and a reading after hours says what happens now, not on average.

use std::time::{Duration, Instant};

/// The window, seconds.
pub const WINDOW_SECS: u64 = 10;

/// Events per second over the last [`WINDOW_SECS`] seconds, or since the
/// first event if that is shorter (but never over less than one second).
#[derive(Debug, Default)]
pub struct WindowedRate {
    start: Option<Instant>,
    /// (second since `start`, events in it), slot = second % WINDOW_SECS.
    buckets: [(u64, u64); WINDOW_SECS as usize],
}

impl WindowedRate {
    /// Forgets every event.
    pub fn clear(&mut self) {
        *self = WindowedRate::default();
    }

    /// One event at `now`.
    pub fn record(&mut self, now: Instant) {
        let start = *self.start.get_or_insert(now);
        let second = now.saturating_duration_since(start).as_secs();
        let slot = &mut self.buckets[(second % WINDOW_SECS) as usize];
        if slot.0 != second {
            *slot = (second, 0);
        }
        slot.1 += 1;
    }

    /// Events per second at `now`.
    pub fn per_second(&self, now: Instant) -> f64 {
        let Some(start) = self.start else {
            return 0.0;
        };
        let elapsed = now.saturating_duration_since(start);
        let current = elapsed.as_secs();
        // The current (partial) second and the WINDOW_SECS - 1 before it.
        let oldest = (current + 1).saturating_sub(WINDOW_SECS);
        let events: u64 = self
            .buckets
            .iter()
            .filter(|(second, _)| (oldest..=current).contains(second))
            .map(|(_, n)| n)
            .sum();
        let covered = elapsed - Duration::from_secs(oldest);
        events as f64 / covered.max(Duration::from_secs(1)).as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_recorded_reads_zero() {
        assert_eq!(WindowedRate::default().per_second(Instant::now()), 0.0);
    }

    #[test]
    fn a_burst_right_at_the_start_is_not_read_per_millisecond() {
        let t0 = Instant::now();
        let mut r = WindowedRate::default();
        r.record(t0);
        r.record(t0 + Duration::from_micros(30));
        // Two events 30 µs apart: 2 per second (the one-second floor), not
        // 66,666.
        assert_eq!(r.per_second(t0 + Duration::from_millis(1)), 2.0);
    }

    #[test]
    fn a_steady_rate_is_read_as_such_and_old_events_leave_the_window() {
        let t0 = Instant::now();
        let mut r = WindowedRate::default();
        // 100 per second for 30 s.
        for i in 0..3000u64 {
            r.record(t0 + Duration::from_millis(10 * i));
        }
        let rate = r.per_second(t0 + Duration::from_millis(29_995));
        assert!((rate - 100.0).abs() < 2.0, "{rate}");
        // Then 10 per second for 20 s: the window forgets the 100s.
        for i in 0..200u64 {
            r.record(t0 + Duration::from_secs(30) + Duration::from_millis(100 * i));
        }
        let rate = r.per_second(t0 + Duration::from_millis(49_950));
        assert!((rate - 10.0).abs() < 0.5, "{rate}");
        // And nothing for a minute: zero.
        assert_eq!(r.per_second(t0 + Duration::from_secs(120)), 0.0);
    }
}
