//! Moving a running VM to another VMM process.

pub mod local;
pub mod tcp;
pub mod warm;
pub mod wire;

use std::fmt::{Debug, Display};
use std::time::{Duration, Instant};

/// How long a source waits for the destination's `Running` after `Commit`.
const RUNNING_TIMEOUT: Duration = Duration::from_secs(5);

/// The source's reading of the destination's answer to `Commit`: the time
/// from the pause if it said `Running`. Anything else is only logged: nothing
/// can undo a `Commit`, so the source exits either way.
fn running_after_commit<M: Debug, E: Display>(
    answer: Result<M, E>,
    is_running: impl FnOnce(&M) -> bool,
    paused_at: Instant,
) -> Option<Duration> {
    match answer {
        Ok(m) if is_running(&m) => Some(paused_at.elapsed()),
        Ok(other) => {
            tracing::warn!(got = ?other, "migration: the destination did not confirm it runs");
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "migration: the destination did not confirm it runs");
            None
        }
    }
}

/// The destination's debug timeline, µs from the state's arrival.
fn log_destination_timeline(kind: &str, started: Instant, restored: Duration, committed: Duration) {
    let us = |d: Duration| d.as_micros() as u64;
    tracing::debug!(
        migration = kind,
        restored_us = us(restored),
        commit_received_us = us(committed),
        running_us = us(started.elapsed()),
        "migration: destination timeline (from the state's arrival)"
    );
}
