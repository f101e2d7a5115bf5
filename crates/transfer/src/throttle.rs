//! A bandwidth cap for pre-copy rounds (`max_bandwidth_mib_s`, libvirt's
//! unit): a token bucket that lets a frame go at once while the bytes sent
//! stay within the cap plus a small burst, and otherwise says how long to
//! sleep first. Only the rounds while the guest runs are capped; the pages
//! sent with the guest paused are not (QEMU does the same), since holding
//! them back would only lengthen the pause.

use std::time::{Duration, Instant};

/// Bytes that may go ahead of the cap at once (one frame of pages and a
/// bit; a burst this small is invisible to a shaper at any useful rate).
const BURST: u64 = 2 << 20;

/// A bandwidth cap over wall-clock time.
#[derive(Debug, Clone)]
pub struct Throttle {
    bytes_per_s: u64,
    /// When the bytes sent so far would have gone at exactly the cap.
    due: Option<Instant>,
}

impl Throttle {
    /// A cap of `bytes_per_s` (at least 1).
    pub fn new(bytes_per_s: u64) -> Self {
        Throttle {
            bytes_per_s: bytes_per_s.max(1),
            due: None,
        }
    }

    /// A cap of `mib_s` MiB/s.
    pub fn mib_per_s(mib_s: u64) -> Self {
        Throttle::new(mib_s.saturating_mul(1 << 20))
    }

    /// The cap, bytes per second.
    pub fn bytes_per_s(&self) -> u64 {
        self.bytes_per_s
    }

    /// Accounts `bytes` about to be sent at `now`; returns how long to wait
    /// before sending them.
    pub fn delay(&mut self, now: Instant, bytes: u64) -> Duration {
        // An idle spell earns no credit beyond the burst.
        let start = match self.due {
            Some(due) if due > now => due,
            _ => now,
        };
        let due = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_s as f64);
        self.due = Some(due);
        let allowed = Duration::from_secs_f64(BURST as f64 / self.bytes_per_s as f64);
        due.saturating_duration_since(now).saturating_sub(allowed)
    }

    /// Waits as [`delay`](Self::delay) says.
    pub fn wait(&mut self, bytes: u64) {
        let d = self.delay(Instant::now(), bytes);
        if !d.is_zero() {
            std::thread::sleep(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_burst_goes_at_once_then_the_cap_paces() {
        let mut t = Throttle::mib_per_s(10);
        let t0 = Instant::now();
        // 2 MiB: within the burst.
        assert_eq!(t.delay(t0, MIB), Duration::ZERO);
        assert_eq!(t.delay(t0, MIB), Duration::ZERO);
        // The third MiB is due 0.3 s in, 0.2 s of it beyond the burst.
        let d = t.delay(t0, MIB);
        assert!((d.as_secs_f64() - 0.1).abs() < 1e-6, "{d:?}");
        // Sent on time, the next waits another 0.1 s.
        let d = t.delay(t0 + d, MIB);
        assert!((d.as_secs_f64() - 0.1).abs() < 1e-6, "{d:?}");
    }

    #[test]
    fn a_long_run_never_exceeds_the_cap_by_more_than_the_burst() {
        let mut t = Throttle::new(50 * MIB);
        let t0 = Instant::now();
        let mut now = t0;
        let mut sent = 0u64;
        for _ in 0..1000 {
            let frame = MIB + 4096;
            now += t.delay(now, frame);
            sent += frame;
            let elapsed = now.duration_since(t0).as_secs_f64();
            assert!(sent as f64 <= 50.0 * MIB as f64 * elapsed + (BURST + frame) as f64);
        }
        // And it is not much slower than the cap either.
        let rate = sent as f64 / now.duration_since(t0).as_secs_f64();
        assert!(rate > 0.99 * 50.0 * MIB as f64, "{rate}");
    }

    #[test]
    fn an_idle_spell_earns_no_more_than_the_burst() {
        let mut t = Throttle::mib_per_s(1);
        let t0 = Instant::now();
        assert_eq!(t.delay(t0, MIB), Duration::ZERO);
        let later = t0 + Duration::from_secs(60);
        assert_eq!(t.delay(later, MIB), Duration::ZERO);
        assert_eq!(t.delay(later, MIB), Duration::ZERO);
        assert!(t.delay(later, MIB) >= Duration::from_millis(999));
    }
}
