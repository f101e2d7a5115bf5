//! Waiting for a connection's next request: poll the socket briefly before
//! sleeping in `read`, but only while polling pays.
//!
//! A client with requests in flight sends the next one as soon as a reply
//! lands; a connection that went to sleep in `read` in between has to be
//! woken for it, and on a small VM host that wake-up (an IPI) costs the
//! *client* more CPU time than the request itself. So after flushing its
//! replies a connection polls its socket for up to [`MAX_SPIN`]. When the
//! machine is busy, though, the client often is not running within that
//! time, and every spin that ends empty-handed burns [`MAX_SPIN`] of a CPU
//! the client (and everyone else) needed: 4 KiB reads at QD1 on the shared
//! 2-CPU development host cost ~60 µs of server CPU per request with a
//! fixed spin against ~38 for nbdkit, at half its throughput. The spin is
//! therefore adaptive: it halves after each miss down to nothing, returns to
//! the full length after a hit, and while it is off one wait in
//! [`PROBE_EVERY`] spins in full (a probe) to find out whether it pays again.
//! And since the clients need CPUs too, connections spin only while there
//! are no more of them than half the CPUs (at least one): on the 2-CPU
//! development host one spinning connection of four left the other three
//! and their clients one CPU, and 4 KiB QD1 reads over four connections ran
//! at 0.65x nbdkit while spending less CPU per request.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The longest a connection polls for its next request.
pub const MAX_SPIN: Duration = Duration::from_micros(50);
/// Below this a spin is not worth starting.
const MIN_SPIN: Duration = Duration::from_micros(4);
/// While spinning is off, every this many waits spin in full once.
const PROBE_EVERY: u32 = 32;

/// Connections in the transmission phase, process-wide.
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// Up to how many open connections spin: half the CPUs, at least one.
fn max_spinning() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        std::thread::available_parallelism()
            .map(|n| n.get() / 2)
            .unwrap_or(1)
            .max(1)
    })
}

/// One connection's spin budget (counted as open while it lives).
#[derive(Debug)]
pub struct RequestPoll {
    spin: Duration,
    idle_waits: u32,
}

impl Default for RequestPoll {
    fn default() -> Self {
        OPEN.fetch_add(1, Ordering::Relaxed);
        RequestPoll {
            spin: MAX_SPIN,
            idle_waits: 0,
        }
    }
}

impl Drop for RequestPoll {
    fn drop(&mut self) {
        OPEN.fetch_sub(1, Ordering::Relaxed);
    }
}

impl RequestPoll {
    /// How long the next wait should spin.
    pub fn budget(&mut self) -> Duration {
        if self.spin >= MIN_SPIN {
            return self.spin;
        }
        self.idle_waits += 1;
        if self.idle_waits >= PROBE_EVERY {
            self.idle_waits = 0;
            return MAX_SPIN;
        }
        Duration::ZERO
    }

    /// Records whether a spin of `budget` found a request.
    pub fn record(&mut self, budget: Duration, hit: bool) {
        if budget.is_zero() {
            return;
        }
        self.spin = if hit {
            MAX_SPIN
        } else if self.spin < MIN_SPIN {
            // A probe that missed: stay off.
            Duration::ZERO
        } else {
            budget / 2
        };
    }

    /// Polls `fd` for up to the current budget until it is readable, and
    /// learns from the outcome. The caller then reads as usual, blocking if
    /// nothing came.
    pub fn wait(&mut self, fd: RawFd) {
        if OPEN.load(Ordering::Relaxed) > max_spinning() {
            // More connections than spare CPUs: sleep, learn nothing.
            return;
        }
        self.spin_once(fd);
    }

    /// One wait's spin, whatever the number of connections.
    fn spin_once(&mut self, fd: RawFd) {
        let budget = self.budget();
        if budget.is_zero() {
            return;
        }
        let hit = spin_until_readable(fd, budget);
        self.record(budget, hit);
    }
}

/// Polls `fd` without blocking until it is readable (true) or `limit` has
/// passed (false).
fn spin_until_readable(fd: RawFd, limit: Duration) -> bool {
    let start = Instant::now();
    loop {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call; a zero
        // timeout never blocks.
        if unsafe { libc::poll(&mut p, 1, 0) } != 0 {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::hint::spin_loop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn misses_halve_the_spin_until_it_stops_and_a_hit_restores_it() {
        let mut p = RequestPoll::default();
        let mut b = p.budget();
        assert_eq!(b, MAX_SPIN);
        let mut misses = 0;
        while !b.is_zero() {
            p.record(b, false);
            b = p.budget();
            misses += 1;
        }
        // 50 -> 25 -> 12.5 -> 6.25 -> 3.1 (below the minimum: off).
        assert_eq!(misses, 4);
        // Off (that wait was the first of them): the 32nd wait probes with
        // a full spin.
        let mut waits = 1;
        loop {
            waits += 1;
            if !p.budget().is_zero() {
                break;
            }
        }
        assert_eq!(waits, PROBE_EVERY);
        // A probe that misses leaves it off; one that hits turns it on.
        p.record(MAX_SPIN, false);
        assert!(p.budget().is_zero());
        p.record(MAX_SPIN, true);
        assert_eq!(p.budget(), MAX_SPIN);
    }

    #[test]
    fn a_waiting_request_is_a_hit() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let mut p = RequestPoll::default();
        p.record(MAX_SPIN, false);
        a.write_all(b"x").unwrap();
        p.spin_once(b.as_raw_fd());
        assert_eq!(p.budget(), MAX_SPIN);
        // Nothing to read: a miss shortens the next spin.
        let (_c, d) = UnixStream::pair().unwrap();
        p.spin_once(d.as_raw_fd());
        assert_eq!(p.budget(), MAX_SPIN / 2);
        assert!(max_spinning() >= 1);
    }
}
