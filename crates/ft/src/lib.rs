//! Fault tolerance: event-driven VM synchronization with transparent failover
//! (the Kemari design; docs/fault-tolerance.md).
//!
//! The primary runs freely until the guest is about to produce an output
//! visible outside the VM (a virtio-blk request, a virtio-net frame). At that
//! point — the device event loop's output gate, see [`vmm::output`] — it
//! pauses the vCPUs, captures the pages dirtied since the last sync and the
//! whole VM state, lets the vCPUs run again, sends the epoch to the standby
//! and releases the outputs once the standby acknowledged it. The standby
//! stages each epoch, acknowledges it only when complete and applies it
//! atomically; when the primary is lost it takes the fence and runs the VM
//! from the last complete epoch.
//!
//! The sync link is the transfer layer's channel and message set
//! (`transfer::message`: `EpochEnd`, `Ack`, `Heartbeat`, `Stop`), and the
//! initial synchronization is its pre-copy loop with the
//! [`FirstConvergence`](transfer::precopy::FirstConvergence) rule.
//!
//! - [`primary`]: connecting, the initial synchronization, then the gate;
//! - [`gate`]: the synchronizing output gate (one epoch per sync);
//! - [`link`]: the primary's end of the link, heartbeats, loss detection;
//! - [`kept`]: the pages left writable from sync to sync;
//! - [`epoch`]: an epoch's state, packed as a delta of the previous one;
//! - [`standby`]: staging, applying, failure detection and failover;
//! - [`fence`]: the split-brain rule (a lock only the running copy holds);
//! - [`status`]: state and metrics served by the API;
//! - [`rate`]: rates over a sliding window (syncs per second).

pub mod epoch;
pub mod fence;
pub mod gate;
pub mod kept;
pub mod link;
pub mod primary;
pub mod rate;
pub mod standby;
pub mod status;

use std::time::Duration;

use transfer::TransferError;

/// Default heartbeat interval on the sync link.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_millis(100);
/// Default time without a frame after which the peer is lost.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(1000);

/// Errors of fault tolerance.
#[derive(Debug, thiserror::Error)]
pub enum FtError {
    /// The link, the peer or the machine failed (the transfer layer's one
    /// error type).
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// The operation does not apply now.
    #[error("{0}")]
    State(String),
    /// The fence is held by another process, or could not be taken.
    #[error(transparent)]
    Fence(#[from] fence::FenceError),
}

impl From<vmm::machine::MachineError> for FtError {
    fn from(e: vmm::machine::MachineError) -> Self {
        FtError::Transfer(e.into())
    }
}

/// Default of `keep_writable_pages` (see `ft start`).
pub const DEFAULT_KEEP_WRITABLE: usize = 64;
/// Largest `keep_writable_pages`: well inside a vCPU's dirty ring (4,032
/// entries before KVM asks for a harvest), and each kept page costs a 4 KiB
/// comparison in every sync's pause.
pub const MAX_KEEP_WRITABLE: usize = 1024;

/// Checks `keep_writable_pages` (default when absent).
pub fn keep_writable(pages: Option<usize>) -> Result<usize, String> {
    match pages {
        None => Ok(DEFAULT_KEEP_WRITABLE),
        Some(p) if p <= MAX_KEEP_WRITABLE => Ok(p),
        Some(p) => Err(format!(
            "keep_writable_pages must be 0..={MAX_KEEP_WRITABLE}, not {p}"
        )),
    }
}

/// Default of `epochs_in_flight` (see `ft start`): on a loopback or LAN
/// link each epoch's acknowledgement comes back before the next capture
/// would be worth it.
pub const DEFAULT_EPOCHS_IN_FLIGHT: usize = 1;
/// Largest `epochs_in_flight`.
pub const MAX_EPOCHS_IN_FLIGHT: usize = 64;

/// Checks `epochs_in_flight` (default when absent).
pub fn epochs_in_flight(n: Option<usize>) -> Result<usize, String> {
    match n {
        None => Ok(DEFAULT_EPOCHS_IN_FLIGHT),
        Some(n) if (1..=MAX_EPOCHS_IN_FLIGHT).contains(&n) => Ok(n),
        Some(n) => Err(format!(
            "epochs_in_flight must be 1..={MAX_EPOCHS_IN_FLIGHT}, not {n}"
        )),
    }
}

/// Checks the timing an `ft start` asks for: periodic checkpoints (ms) or
/// event-driven, heartbeat interval and peer timeout (defaults when absent).
/// Out-of-range values are refused with the reason, not clamped.
pub fn timing(
    periodic_ms: Option<u64>,
    heartbeat_ms: Option<u64>,
    timeout_ms: Option<u64>,
) -> Result<(SyncMode, Duration, Duration), String> {
    let check = |name: &str, v: u64, lo: u64, hi: u64| {
        if (lo..=hi).contains(&v) {
            Ok(Duration::from_millis(v))
        } else {
            Err(format!("{name} must be {lo}..={hi} ms, not {v}"))
        }
    };
    let mode = match periodic_ms {
        Some(p) => SyncMode::Periodic(check("periodic_ms", p, 1, 60_000)?),
        None => SyncMode::EventDriven,
    };
    let heartbeat = match heartbeat_ms {
        Some(h) => check("heartbeat_ms", h, 1, 60_000)?,
        None => DEFAULT_HEARTBEAT,
    };
    let timeout = match timeout_ms {
        Some(t) => check("timeout_ms", t, 10, 600_000)?,
        None => DEFAULT_TIMEOUT,
    };
    if timeout <= heartbeat {
        return Err(format!(
            "timeout_ms ({}) must exceed heartbeat_ms ({})",
            timeout.as_millis(),
            heartbeat.as_millis()
        ));
    }
    Ok((mode, heartbeat, timeout))
}

/// How the primary synchronizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMode {
    /// One sync before each batch of outputs (Kemari).
    EventDriven,
    /// A checkpoint every period; outputs wait for the next one (Remus).
    Periodic(Duration),
}

impl SyncMode {
    /// Name in the API.
    pub fn name(&self) -> &'static str {
        match self {
            SyncMode::EventDriven => "event",
            SyncMode::Periodic(_) => "periodic",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_defaults_ranges_and_order() {
        assert_eq!(
            timing(None, None, None),
            Ok((SyncMode::EventDriven, DEFAULT_HEARTBEAT, DEFAULT_TIMEOUT))
        );
        assert_eq!(
            timing(Some(25), Some(50), Some(500)),
            Ok((
                SyncMode::Periodic(Duration::from_millis(25)),
                Duration::from_millis(50),
                Duration::from_millis(500)
            ))
        );
        assert!(timing(Some(0), None, None).is_err());
        assert!(timing(None, None, Some(u64::MAX)).is_err());
        assert!(timing(None, Some(u64::MAX), None).is_err());
        assert!(timing(None, Some(500), Some(400)).is_err());
    }

    #[test]
    fn epochs_in_flight_default_and_range() {
        assert_eq!(epochs_in_flight(None), Ok(DEFAULT_EPOCHS_IN_FLIGHT));
        assert_eq!(epochs_in_flight(Some(1)), Ok(1));
        assert_eq!(
            epochs_in_flight(Some(MAX_EPOCHS_IN_FLIGHT)),
            Ok(MAX_EPOCHS_IN_FLIGHT)
        );
        for bad in [0, MAX_EPOCHS_IN_FLIGHT + 1] {
            let e = epochs_in_flight(Some(bad)).unwrap_err();
            assert!(e.contains("epochs_in_flight"), "{e}");
        }
    }

    #[test]
    fn keep_writable_default_and_range() {
        assert_eq!(keep_writable(None), Ok(DEFAULT_KEEP_WRITABLE));
        assert_eq!(keep_writable(Some(0)), Ok(0));
        assert_eq!(
            keep_writable(Some(MAX_KEEP_WRITABLE)),
            Ok(MAX_KEEP_WRITABLE)
        );
        let e = keep_writable(Some(MAX_KEEP_WRITABLE + 1)).unwrap_err();
        assert!(e.contains("keep_writable_pages"), "{e}");
    }
}
