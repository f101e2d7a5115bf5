//! Until when this copy surely holds its lease: the one number the output
//! gate asks about before every output.
//!
//! The lease is safe until the moment its last renewal was *sent* plus its
//! TTL, less a margin: etcd counts the TTL from when it handled the
//! renewal, which is later. Times are `CLOCK_MONOTONIC` nanoseconds, which
//! the helper process and the VMM read alike. Once the deadline has passed
//! the lease counts as lost for good — a later renewal does not bring it
//! back (another copy may have taken the key meanwhile).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use vmm::output::OutputFence;

/// `CLOCK_MONOTONIC` now, in nanoseconds (the same clock in every process
/// of this host).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own; CLOCK_MONOTONIC
    // always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// What is taken off a lease's TTL before it counts as lost here: a tenth
/// of it, at least 200 ms (clock rates, the time the gate takes to see it).
pub fn margin(ttl: Duration) -> Duration {
    (ttl / 10).max(Duration::from_millis(200))
}

/// The deadline a renewal (or the grant) sent at `sent_ns` gives a lease of
/// `ttl`.
pub fn deadline_after(sent_ns: u64, ttl: Duration) -> u64 {
    let safe = ttl.saturating_sub(margin(ttl));
    sent_ns.saturating_add(safe.as_nanos() as u64)
}

/// The lease's deadline (0: lost for good).
#[derive(Debug)]
pub struct LeaseDeadline(AtomicU64);

impl LeaseDeadline {
    /// A lease held until `deadline_ns`.
    pub fn new(deadline_ns: u64) -> Self {
        LeaseDeadline(AtomicU64::new(deadline_ns.max(1)))
    }

    /// Moves the deadline to `deadline_ns` (never back) if it has not
    /// passed; false if the lease is lost (now or before).
    pub fn extend(&self, deadline_ns: u64) -> bool {
        let mut current = self.0.load(Ordering::Acquire);
        loop {
            if current == 0 {
                return false;
            }
            if monotonic_ns() >= current {
                self.lose();
                return false;
            }
            match self.0.compare_exchange(
                current,
                current.max(deadline_ns),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(seen) => current = seen,
            }
        }
    }

    /// Marks the lease lost for good.
    pub fn lose(&self) {
        self.0.store(0, Ordering::Release);
    }

    /// How long until the deadline (None: lost or passed).
    pub fn remaining(&self) -> Option<Duration> {
        let d = self.0.load(Ordering::Acquire);
        let now = monotonic_ns();
        (d != 0 && now < d).then(|| Duration::from_nanos(d - now))
    }
}

impl OutputFence for LeaseDeadline {
    fn holds(&self) -> bool {
        let d = self.0.load(Ordering::Acquire);
        if d == 0 {
            return false;
        }
        if monotonic_ns() < d {
            return true;
        }
        // Passed: lost for good, unless a renewal moved it meanwhile
        // (then it was not passed when the renewal looked).
        match self
            .0
            .compare_exchange(d, 0, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => false,
            Err(_) => self.holds(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_only_moves_forward_and_once_passed_stays_lost() {
        let now = monotonic_ns();
        let d = LeaseDeadline::new(now + 60_000_000_000);
        assert!(d.holds());
        assert!(d.extend(now + 30_000_000_000), "earlier: kept, still held");
        assert!(d.remaining().unwrap() > Duration::from_secs(50));
        let short = LeaseDeadline::new(monotonic_ns() + 1_000_000);
        std::thread::sleep(Duration::from_millis(5));
        assert!(!short.holds());
        assert!(!short.extend(monotonic_ns() + 60_000_000_000));
        assert!(!short.holds());
        assert_eq!(short.remaining(), None);
        d.lose();
        assert!(!d.holds());
    }

    #[test]
    fn the_margin_comes_off_the_ttl() {
        assert_eq!(margin(Duration::from_secs(5)), Duration::from_millis(500));
        assert_eq!(margin(Duration::from_secs(1)), Duration::from_millis(200));
        assert_eq!(deadline_after(1_000, Duration::from_secs(5)), 4_500_001_000);
    }
}
