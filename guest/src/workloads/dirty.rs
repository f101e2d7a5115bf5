//! `dirty=<pages_per_s>,<MiB>[,seq|rand]`: writes one word into 4 KiB pages
//! of a working set at a steady rate (0 = as fast as possible), cycling
//! through it in order, or in a fixed pseudo-random permutation with `rand`
//! (the same `i·a + c mod n` as the disk workload), like the VMBeam paper's
//! page-dirtying experiment. Once a
//! second it prints `dirty: rate=<pages/s> ws_pages=<n> total=<pages>
//! bad=<n>`, the rate achieved over that second.
//!
//! Every write also checks the page's previous value: step s of pass k
//! writes the running total k·n + s, so the page must still hold the value of
//! pass k−1, k·n + s − n (0 in the first pass: RAM starts zeroed). A page a
//! migration or a failover lost, or brought back stale, shows up as
//! `dirty: lost write page=<p> expected=<e> found=<f>` (the first few), and
//! the report's `bad=<count>` stays non-zero.

use guest::blockfmt::Permutation;

use crate::say;

const PAGE: u64 = 4096;
/// Most pages written per poll, so other workloads and the network keep
/// running...
const BATCH: u64 = 1024;
/// ...and most time spent per poll: a first write to a page can cost ~70 µs
/// under shadow paging, so 1024 of them would hold the loop for 70 ms.
const POLL_BUDGET_NS: u64 = 2_000_000;

pub struct Dirty {
    base: u64,
    pages: u64,
    pages_per_s: u64,
    order: Permutation,
    /// Step within the current pass (0..pages).
    next_page: u64,
    total: u64,
    /// Pages the rate allows but not yet written, capped at 100 ms worth so
    /// a stall is not followed by a burst.
    credit: u64,
    last_ns: u64,
    report_ms: u64,
    report_total: u64,
    /// Pages whose previous value was not the one written one pass earlier.
    bad: u64,
}

/// Lost writes printed in full; the rest only counted.
const BAD_REPORTED: u64 = 8;

impl Dirty {
    /// `base` is the working set: `pages` pages of RAM owned by the workload.
    pub fn new(base: u64, pages: u64, pages_per_s: u64, random: bool, now_ns: u64) -> Self {
        Self {
            base,
            pages,
            pages_per_s,
            order: Permutation::new(random, pages),
            next_page: 0,
            total: 0,
            credit: 0,
            last_ns: now_ns,
            report_ms: now_ns / 1_000_000,
            report_total: 0,
            bad: 0,
        }
    }

    pub fn poll(&mut self, now_ns: u64) {
        let todo = if self.pages_per_s == 0 {
            BATCH
        } else {
            let elapsed = now_ns.saturating_sub(self.last_ns);
            let earned = (elapsed as u128 * self.pages_per_s as u128 / 1_000_000_000) as u64;
            if earned > 0 {
                // Keep the remainder of the interval for the next poll.
                self.last_ns += (earned as u128 * 1_000_000_000 / self.pages_per_s as u128) as u64;
                self.credit = (self.credit + earned).min(self.pages_per_s / 10 + BATCH);
            }
            self.credit.min(BATCH)
        };
        let mut done = 0;
        while done < todo {
            if done % 32 == 31 && crate::time::now_ns() - now_ns > POLL_BUDGET_NS {
                break;
            }
            done += 1;
            let page = self.order.at(self.next_page);
            let addr = self.base + page * PAGE;
            let expected = self.total.saturating_sub(self.pages);
            // SAFETY: `addr` is inside the working set this workload owns
            // (page < pages), identity mapped and 8-byte aligned.
            let found = unsafe { core::ptr::read_volatile(addr as *const u64) };
            if found != expected {
                self.bad += 1;
                if self.bad <= BAD_REPORTED {
                    say!(
                        "dirty: lost write page={} expected={} found={}",
                        page,
                        expected,
                        found
                    );
                }
            }
            // SAFETY: as above.
            unsafe { core::ptr::write_volatile(addr as *mut u64, self.total) };
            self.total += 1;
            self.next_page += 1;
            if self.next_page == self.pages {
                self.next_page = 0;
            }
        }
        self.credit -= done.min(self.credit);

        let now_ms = now_ns / 1_000_000;
        let window = now_ms - self.report_ms;
        if window >= 1000 {
            let rate = (self.total - self.report_total) * 1000 / window;
            say!(
                "dirty: rate={} ws_pages={} total={} bad={}",
                rate,
                self.pages,
                self.total,
                self.bad
            );
            self.report_ms = now_ms;
            self.report_total = self.total;
        }
    }
}
