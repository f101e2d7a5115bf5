//! Pacing of an agent's `ft start`s that fail one after the other.
//!
//! A failed `ft start` gives its standby's claim up at once, so that another
//! host may be chosen; but when every attempt fails (the primary cannot
//! reach any standby, a key differs), the claims, standby starts and `ft
//! start`s would follow each other as fast as the agents go round. The
//! primary's agent therefore waits before its next `ft start` of the same
//! VM: [`FIRST`], then twice as long after each further failure, at most
//! [`CAP`]. A success forgets the failures. (A few lines of state in the
//! agent's poll loop; the retry crates wrap a future to retry, which this
//! loop has no use for.)

use std::time::{Duration, Instant};

/// The pause after a first failure.
pub const FIRST: Duration = Duration::from_secs(1);
/// The longest pause.
pub const CAP: Duration = Duration::from_secs(30);

/// The pause after `failures` failures in a row.
pub fn delay(failures: u32) -> Duration {
    match failures {
        0 => Duration::ZERO,
        n => FIRST.saturating_mul(1 << (n - 1).min(16)).min(CAP),
    }
}

/// One VM's failures in a row and when the next attempt may start.
#[derive(Debug, Default)]
pub struct Backoff {
    failures: u32,
    until: Option<Instant>,
}

impl Backoff {
    /// Records a failure at `now`; returns the pause before the next attempt.
    pub fn failed(&mut self, now: Instant) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let d = delay(self.failures);
        self.until = Some(now + d);
        d
    }

    /// Failures in a row so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Whether the next attempt may start at `now`.
    pub fn ready(&self, now: Instant) -> bool {
        self.until.is_none_or(|u| now >= u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pause_doubles_up_to_the_cap() {
        let secs: Vec<u64> = (0..8).map(|n| delay(n).as_secs()).collect();
        assert_eq!(secs, [0, 1, 2, 4, 8, 16, 30, 30]);
        assert_eq!(delay(u32::MAX), CAP);
    }

    #[test]
    fn an_attempt_waits_for_the_pause() {
        let t0 = Instant::now();
        let mut b = Backoff::default();
        assert!(b.ready(t0));
        assert_eq!(b.failed(t0), FIRST);
        assert!(!b.ready(t0 + Duration::from_millis(999)));
        assert!(b.ready(t0 + FIRST));
        assert_eq!(b.failed(t0 + FIRST), 2 * FIRST);
        assert_eq!(b.failures(), 2);
    }
}
