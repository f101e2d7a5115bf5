//! The one message set of every hand-over (live, local, warm, fault
//! tolerance), with one version number. Control messages are JSON frames;
//! pages and states are binary frames (see [`Kind`]). The exchanges:
//!
//! ```text
//! source / primary / old kemari                   destination / standby / successor
//!   (handshake: channel.rs)
//!   Offer{mode, config, memory size, fds} (+ fds) ──▶ check, memory, VM prepared
//!   ◀──────────────────────────────────────────── Ready (or Failed{reason})
//! live, FT:
//!   Pages(round r)… RoundEnd{r, pages} ───────────▶ pages written
//!   ◀──────────────────────────────────────────── RoundAck{r}        (repeated)
//! live, local:
//!   (pause) [Pages(final)…] State ────────────────▶ restore
//!   ◀──────────────────────────────────────────── Restored{restore_ms}
//!   Commit ───────────────────────────────────────▶ run (outputs released)
//!   ◀──────────────────────────────────────────── Running{restore_ms}
//! warm:
//!   (pause, DIR/state.bin written) StateSaved{fds} (+ TAP fds) ─▶ read, restore, run
//!   ◀──────────────────────────────────────────── Running{restore_ms}
//! fault tolerance, after the pre-copy, per sync:
//!   EpochPages… EpochEnd{n, pages, outputs} State(delta) ─▶ staged
//!   ◀──────────────────────────────────────────── Ack{n}          (then applied)
//!   Heartbeat (both ways when idle)   Stop{reason} ──▶ the standby exits
//! ```
//!
//! Rules common to all: until the source's commit point (`Commit`;
//! `StateSaved` for warm) the source owns the VM and resumes it on any
//! failure, and the destination discards what it built; after it, the
//! source never runs the VM again.

use serde::{Deserialize, Serialize};
use vmm::config::MachineConfig;

/// Protocol version (in the handshake). 5: one message set for live, local,
/// warm and fault tolerance, key proofs in the handshake. 6: `State` frames
/// carry state format 3 (postcard, `vmm::persist::format`), which a version-5
/// kemari cannot read — refused at the handshake, before any pause.
pub const VERSION: u32 = 6;

/// Frame kinds (the byte before the payload).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A JSON [`Message`].
    Control = 1,
    /// A page batch written into guest memory at once (pre-copy rounds).
    Pages = 2,
    /// A VM state: the `persist::format` container (packed as an LZ4 delta
    /// in fault tolerance).
    State = 3,
    /// A page batch staged until its epoch is complete (fault tolerance).
    EpochPages = 4,
}

impl Kind {
    /// The kind of a frame's kind byte.
    pub fn from_byte(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Control,
            2 => Kind::Pages,
            3 => Kind::State,
            4 => Kind::EpochPages,
            _ => return None,
        })
    }
}

/// What the offer is for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Pre-copy live migration over TCP.
    Live,
    /// Zero-copy migration on one host: guest memory and TAPs travel as fds.
    Local,
    /// Warm restart into a prepared successor: the state goes through the
    /// state directory, the TAPs as fds.
    Warm,
    /// Fault tolerance: a pre-copy, then one epoch per sync.
    FaultTolerance {
        /// "event" or "periodic".
        sync: String,
        /// Heartbeat interval on the link, ms.
        heartbeat_ms: u64,
        /// The peer is lost after this long without a frame, ms.
        timeout_ms: u64,
    },
}

impl Mode {
    /// The mode's name in logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Mode::Live => "live migration",
            Mode::Local => "zero-copy migration",
            Mode::Warm => "warm restart",
            Mode::FaultTolerance { .. } => "fault tolerance",
        }
    }
}

/// Control messages.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Message {
    /// Source: the VM on offer, and how many fds ride on this message.
    Offer {
        /// What for.
        mode: Mode,
        /// The machine configuration.
        config: Box<MachineConfig>,
        /// Guest memory size.
        memory_size: u64,
        /// Fds carried by this message (local: memory, then TAPs).
        fds: u32,
        /// TCP connections of a live migration (1, left out on the wire:
        /// the main one only). More must be acknowledged with
        /// [`Message::StreamsReady`]: a kemari that ignores the field
        /// answers `Ready`, which the source refuses.
        #[serde(default = "one", skip_serializing_if = "is_one")]
        streams: u32,
    },
    /// Destination: memory ready for pages (the VM is built meanwhile or
    /// already).
    Ready,
    /// Destination, to an offer of several streams: ready, and accepting
    /// `streams − 1` more connections that join with `session`.
    StreamsReady {
        /// The connections in all, main one included.
        streams: u32,
        /// What each joining connection must show (random per migration).
        session: u64,
    },
    /// Source, first frame on an extra connection: it is page stream
    /// `stream` (1 ..= streams − 1) of migration `session`.
    Join {
        /// The destination's session number.
        session: u64,
        /// The stream's index.
        stream: u32,
    },
    /// Source: end of a pre-copy round.
    RoundEnd {
        /// Round number (1 = every page in use).
        round: u32,
        /// Pages sent so far, all rounds.
        pages: u64,
    },
    /// Destination: every page up to that round's end is in memory (the
    /// first one also says its VM is built: the source never pauses
    /// before it is).
    RoundAck {
        /// The round.
        round: u32,
    },
    /// Old kemari (warm): paused for good, the state is in the state
    /// directory; `fds` TAP fds ride on this message.
    StateSaved {
        /// TAP fds carried.
        fds: u32,
    },
    /// Destination: restored, waiting for `Commit`.
    Restored {
        /// Time the restore took.
        restore_ms: u64,
    },
    /// Source: the destination owns the VM now.
    Commit,
    /// Destination: the guest runs here (the source exits only then, so
    /// that its exit does not take the CPU the new vCPUs need).
    Running {
        /// Time the restore took, ms.
        restore_ms: f64,
    },
    /// Primary: every page of epoch `epoch` is sent; the state follows.
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
    /// Either side of a fault-tolerance link: alive.
    Heartbeat,
    /// Primary: protection ends on purpose; the standby exits.
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

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

impl Message {
    /// The message's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Offer { .. } => "Offer",
            Message::Ready => "Ready",
            Message::StreamsReady { .. } => "StreamsReady",
            Message::Join { .. } => "Join",
            Message::RoundEnd { .. } => "RoundEnd",
            Message::RoundAck { .. } => "RoundAck",
            Message::StateSaved { .. } => "StateSaved",
            Message::Restored { .. } => "Restored",
            Message::Commit => "Commit",
            Message::Running { .. } => "Running",
            Message::EpochEnd { .. } => "EpochEnd",
            Message::Ack { .. } => "Ack",
            Message::Heartbeat => "Heartbeat",
            Message::Stop { .. } => "Stop",
            Message::Failed { .. } => "Failed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_and_unknown_bytes_are_refused() {
        for k in [Kind::Control, Kind::Pages, Kind::State, Kind::EpochPages] {
            assert_eq!(Kind::from_byte(k as u8), Some(k));
        }
        assert_eq!(Kind::from_byte(0), None);
        assert_eq!(Kind::from_byte(5), None);
    }

    #[test]
    fn messages_are_plain_json() {
        let m = Message::Offer {
            mode: Mode::FaultTolerance {
                sync: "event".into(),
                heartbeat_ms: 100,
                timeout_ms: 1000,
            },
            config: Box::new(crate::destination::test_config("/m")),
            memory_size: 64 << 20,
            fds: 0,
            streams: 1,
        };
        let text = serde_json::to_string(&m).unwrap();
        assert!(text.contains("fault_tolerance"), "{text}");
        let back: Message = serde_json::from_str(&text).unwrap();
        assert_eq!(back.name(), "Offer");
        assert!(serde_json::from_str::<Message>(r#"{"Bogus":1}"#).is_err());
        // One stream is today's offer on the wire, field left out.
        assert!(!text.contains("streams"), "{text}");
    }

    #[test]
    fn several_streams_are_in_the_offer_and_default_to_one() {
        let m = Message::Offer {
            mode: Mode::Live,
            config: Box::new(crate::destination::test_config("/m")),
            memory_size: 64 << 20,
            fds: 0,
            streams: 4,
        };
        let text = serde_json::to_string(&m).unwrap();
        assert!(text.contains(r#""streams":4"#), "{text}");
        let old = text.replace(r#","streams":4"#, "");
        match serde_json::from_str::<Message>(&old).unwrap() {
            Message::Offer { streams, .. } => assert_eq!(streams, 1),
            other => panic!("{other:?}"),
        }
    }
}
