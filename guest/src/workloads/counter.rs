//! `counter=<ms>`: prints `counter: <n> uptime_ms=<ms>` every period, with
//! `n` counting up from 0 — the basis of "the guest continued where it left
//! off" tests. Deadlines advance by whole periods (no drift); after a stall
//! (a paused VM) the missed ticks are skipped, not replayed.

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

    pub fn poll(&mut self, now_ms: u64) {
        if now_ms < self.next_ms {
            return;
        }
        say!("counter: {} uptime_ms={}", self.n, now_ms);
        self.n += 1;
        self.next_ms += self.period_ms;
        if self.next_ms <= now_ms {
            self.next_ms = now_ms + self.period_ms;
        }
    }
}
