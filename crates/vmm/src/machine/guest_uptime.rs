//! The guest's uptime: time since the guest booted, carried in the saved
//! state across snapshots, warm restarts, migrations and failovers, and
//! reset by a reboot — apart from the machine's uptime in this process
//! (`uptime`, since it was built here). Time a VM spent saved on disk or in
//! flight between two VMMs does not count (the guest did not run).

use std::time::{Duration, Instant};

/// The guest's clock of uptime.
#[derive(Debug, Clone, Copy)]
pub struct GuestUptime {
    /// Guest uptime when this machine was built (0 for a boot).
    before: Duration,
    /// When this machine was built.
    since: Instant,
}

impl GuestUptime {
    /// A machine built at `since` for a guest that had run `before`
    /// (from its saved state; zero for a boot or a reboot).
    pub fn new(before: Duration, since: Instant) -> Self {
        GuestUptime { before, since }
    }

    /// The guest's uptime now.
    pub fn now(&self) -> Duration {
        self.before + self.since.elapsed()
    }

    /// As the saved state carries it.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.now().as_millis()).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restored_guest_counts_on_from_its_saved_uptime() {
        let since = Instant::now();
        let booted = GuestUptime::new(Duration::ZERO, since);
        let restored = GuestUptime::new(Duration::from_secs(3600), since);
        assert!(restored.now() >= Duration::from_secs(3600));
        assert!(restored.now() - booted.now() >= Duration::from_secs(3599));
        assert!(restored.now_ms() >= 3_600_000);
    }
}
