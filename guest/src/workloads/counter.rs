//! `counter=<ms>`: prints `counter: <n> uptime_ms=<ms> uptime_us=<us> gap_us=<us>`
//! every period, with `n` counting up from 0 — the basis of "the guest
//! continued where it left off" tests. Deadlines advance by whole periods (no
//! drift); after a stall (a paused VM) the missed ticks are skipped, not
//! replayed.
//!
//! `gap_us` is the longest stall of the guest's main loop since the previous
//! line: the longest time between two consecutive turns, less the cost of a
//! console line when the earlier turn printed one (the cheapest print seen so
//! far; a print is one console exit, ~0.5 ms here). A turn is otherwise
//! microseconds, so a VMM's pause shows in the next line to within the
//! print's jitter (tens of µs), whatever the period. The clock is the TSC,
//! which KVM keeps running while a VMM holds the VM paused and across a move
//! to another VMM on the same host. Were it to stand still instead (a VMM
//! restoring an old TSC value), the host's time between two lines minus
//! `uptime_us`'s would show the pause.

use crate::say;

pub struct Counter {
    period_ms: u64,
    next_ms: u64,
    n: u64,
}

impl Counter {
    pub fn new(period_ms: u64, now_ms: u64) -> Self {
        Self {
            period_ms,
            next_ms: now_ms,
            n: 0,
        }
    }

    /// `gap_us`: the longest stall since the last call that printed.
    /// Returns whether it printed (the caller then starts a new maximum).
    pub fn poll(&mut self, now_us: u64, gap_us: u64) -> bool {
        let now_ms = now_us / 1000;
        if now_ms < self.next_ms {
            return false;
        }
        say!(
            "counter: {} uptime_ms={} uptime_us={} gap_us={}",
            self.n,
            now_ms,
            now_us,
            gap_us
        );
        self.n += 1;
        self.next_ms += self.period_ms;
        if self.next_ms <= now_ms {
            self.next_ms = now_ms + self.period_ms;
        }
        true
    }
}
