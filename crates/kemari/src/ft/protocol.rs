//! Messages on the sync link (on top of the authenticated frames of
//! [`crate::migration::wire`]).
//!
//! ```text
//! primary                                                  standby
//!   Hello{config, memory size, mode, heartbeat, timeout} ──▶ memory + VM prepared
//!   ◀──────────────────────────────────────────────── Ready
//!   Pages{epoch 0}… (live pre-copy, applied at once) ─────▶
//!   Pages{epoch n}… EpochEnd{n, pages} Blob(state) ───────▶ staged
//!   ◀──────────────────────────────────────────────── Ack{n}   (then applied)
//!   Heartbeat (both ways, every heartbeat interval when idle)
//!   Stop{reason} ─────────────────────────────────────────▶ standby exits
//! ```
//!
//! An epoch is complete with its state blob; the standby acknowledges it only
//! then, and discards an epoch the link cut off.

use serde::{Deserialize, Serialize};
use vmm::config::MachineConfig;

/// Control messages (JSON frames).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum FtMessage {
    /// Primary: the VM to protect and the link's timing.
    Hello {
        /// The machine configuration.
        config: Box<MachineConfig>,
        /// Guest memory size.
        memory_size: u64,
        /// "event" or "periodic".
        mode: String,
        /// Heartbeat interval, ms.
        heartbeat_ms: u64,
        /// Peer lost after this long without a frame, ms.
        timeout_ms: u64,
    },
    /// Standby: memory and VM prepared.
    Ready,
    /// Primary: end of a live pre-copy round (epoch 0).
    RoundEnd {
        /// Round number.
        round: u32,
        /// Pages sent so far.
        pages: u64,
    },
    /// Primary: every page of epoch `epoch` is sent; the state blob follows.
    EpochEnd {
        /// Epoch number (1 = the first complete image).
        epoch: u64,
        /// Pages in the epoch.
        pages: u64,
        /// Output requests the epoch precedes.
        outputs: u64,
    },
    /// Standby: epoch received complete.
    Ack {
        /// The epoch.
        epoch: u64,
    },
    /// Either side: alive.
    Heartbeat,
    /// Primary: protection ends normally (guest powered off, `ft stop`);
    /// the standby exits without failing over.
    Stop {
        /// Why.
        reason: String,
    },
    /// Either side: giving up, with the reason.
    Failed {
        /// Why.
        reason: String,
    },
}
