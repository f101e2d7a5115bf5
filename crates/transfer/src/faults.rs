//! Fault-injection hooks, read in this one place and compiled only with the
//! `fault-injection` feature (the test builds; never a release build): a
//! hand-over holds at a chosen step for as long as an environment variable
//! says, so that a test can kill an end or cut the link exactly there.
//! With `KEMARI_FAULT_HOLD_REACHED_FILE` set, the hold creates that file as
//! it begins: the test acts when the file appears, not after a guess of how
//! long the hand-over takes to get there.

use std::time::Duration;

/// Where a hand-over may be held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldPoint {
    /// Destination: the whole VM received, the source paused, nothing
    /// restored (`KEMARI_FAULT_HOLD_MIGRATE_IN_MS`).
    StateReceived,
    /// Live destination: the guest runs here with its outputs held, the
    /// source not yet told (`KEMARI_FAULT_HOLD_BEFORE_COMMIT_MS`).
    BeforeCommit,
    /// Source: before each pre-copy round's pages are sent
    /// (`KEMARI_FAULT_HOLD_ROUND_MS`), so a test can act during a round.
    Round,
}

impl HoldPoint {
    /// The variable that sets the hold, in milliseconds.
    pub fn variable(self) -> &'static str {
        match self {
            HoldPoint::StateReceived => "KEMARI_FAULT_HOLD_MIGRATE_IN_MS",
            HoldPoint::BeforeCommit => "KEMARI_FAULT_HOLD_BEFORE_COMMIT_MS",
            HoldPoint::Round => "KEMARI_FAULT_HOLD_ROUND_MS",
        }
    }
}

/// The variable naming the file a hold creates as it begins.
pub const REACHED_FILE: &str = "KEMARI_FAULT_HOLD_REACHED_FILE";

/// Holds at `point` if the test asked for it.
#[cfg(feature = "fault-injection")]
pub fn hold(point: HoldPoint) {
    if let Some(ms) = std::env::var(point.variable())
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        tracing::warn!(?point, ms, "fault injection: holding the hand-over");
        if let Some(path) = std::env::var_os(REACHED_FILE) {
            if let Err(e) = std::fs::write(&path, point.variable()) {
                tracing::error!(error = %e, "fault injection: cannot create {REACHED_FILE}");
            }
        }
        std::thread::sleep(Duration::from_millis(ms));
    }
}

/// Without the feature: nothing.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub fn hold(point: HoldPoint) {
    let _ = (point, Duration::ZERO);
}
