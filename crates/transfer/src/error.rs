//! The one error type of a hand-over, worded for the operator: which end,
//! what it was doing, and what to check — "the destination closed the
//! connection during the handshake: wrong key or not a kemari destination?",
//! never "failed to fill whole buffer".

use std::fmt;
use std::io;
use std::time::Duration;

use vmm::machine::MachineError;

/// The other end of a hand-over, as the operator knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// The VMM a VM migrates from.
    Source,
    /// The VMM a VM migrates to.
    Destination,
    /// A fault-tolerance primary.
    Primary,
    /// A fault-tolerance standby.
    Standby,
    /// A warm-restart successor (`kemari --restore DIR --await-state`).
    Successor,
    /// The kemari a warm-restart successor takes the VM from.
    OldVmm,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Peer::Source => "source",
            Peer::Destination => "destination",
            Peer::Primary => "primary",
            Peer::Standby => "standby",
            Peer::Successor => "successor",
            Peer::OldVmm => "old kemari",
        })
    }
}

/// Everything that can end a hand-over.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// No connection to the peer.
    #[error("cannot reach the {peer} at {addr}: {source}")]
    Connect {
        /// Who.
        peer: Peer,
        /// Where.
        addr: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The listening socket could not be made.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// Where.
        addr: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The peer hung up before the handshake completed.
    #[error(
        "the {peer} closed the connection during the handshake: wrong key or not a kemari {peer}?"
    )]
    ClosedInHandshake {
        /// Who.
        peer: Peer,
    },
    /// The peer checked our proof of the key and refused it.
    #[error("the {peer} refused our key: the key files of the two ends differ")]
    KeyRefused {
        /// Who.
        peer: Peer,
    },
    /// The peer could not prove it holds our key.
    #[error("the {peer} does not hold this key: the key files of the two ends differ")]
    KeyMismatch {
        /// Who.
        peer: Peer,
    },
    /// Whatever answered is not kemari.
    #[error("the {peer} at the other end is not a kemari VMM (it answered something else)")]
    NotKemari {
        /// Who was expected.
        peer: Peer,
    },
    /// Another protocol version.
    #[error("the {peer} speaks hand-over protocol version {theirs}, this kemari version {ours}: run the same kemari release on both ends")]
    Version {
        /// Who.
        peer: Peer,
        /// Its version.
        theirs: u32,
        /// Ours.
        ours: u32,
    },
    /// The peer hung up.
    #[error("the {peer} closed the connection while {phase}")]
    Closed {
        /// Who.
        peer: Peer,
        /// What this end was doing.
        phase: String,
    },
    /// The peer went silent.
    #[error("no answer from the {peer} for {} s while {phase}", .after.as_secs_f64())]
    Timeout {
        /// Who.
        peer: Peer,
        /// What this end was doing.
        phase: String,
        /// How long it waited.
        after: Duration,
    },
    /// Another I/O failure on the connection.
    #[error("the connection to the {peer} failed while {phase}: {source}")]
    Io {
        /// Who.
        peer: Peer,
        /// What this end was doing.
        phase: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A frame whose tag does not verify.
    #[error("a frame from the {peer} failed authentication while {phase} (the stream was altered, replayed or reordered)")]
    Authentication {
        /// Who.
        peer: Peer,
        /// What this end was doing.
        phase: String,
    },
    /// A frame that does not parse or breaks a limit.
    #[error("the {peer} sent a malformed frame while {phase}: {detail}")]
    Malformed {
        /// Who.
        peer: Peer,
        /// What this end was doing.
        phase: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A message out of order.
    #[error("the {peer} sent {got} while {phase} (expected {expected})")]
    Unexpected {
        /// Who.
        peer: Peer,
        /// What this end was doing.
        phase: String,
        /// What came.
        got: String,
        /// What was due.
        expected: &'static str,
    },
    /// The peer gave up and said why.
    #[error("the {peer} refused the VM: {reason}")]
    Refused {
        /// Who.
        peer: Peer,
        /// Its reason.
        reason: String,
    },
    /// The operator cancelled it.
    #[error("cancelled while {phase}: the VM keeps running here")]
    Cancelled {
        /// What this end was doing.
        phase: String,
    },
    /// The pre-shared key file is unusable.
    #[error("key file {path}: {reason}")]
    Key {
        /// The file.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// What was offered does not fit here (another VM, other memory).
    #[error("{0}")]
    Mismatch(String),
    /// A local file (state file, memory file, socket path).
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The machine could not be saved, prepared or restored.
    #[error(transparent)]
    Machine(#[from] MachineError),
    /// Guest memory could not be read or written.
    #[error("guest memory: {0}")]
    Memory(String),
    /// A page stream of a migration over several connections failed.
    #[error("a page stream of the migration failed: {detail}")]
    Stream {
        /// Which stream, and what happened.
        detail: String,
    },
}

impl TransferError {
    /// Whether the operator cancelled the hand-over.
    pub fn is_cancelled(&self) -> bool {
        matches!(self, TransferError::Cancelled { .. })
    }

    /// Whether the other end is at fault (it refused, vanished or is not
    /// kemari), as opposed to this end or the operator.
    pub fn is_peer_failure(&self) -> bool {
        !matches!(
            self,
            TransferError::Cancelled { .. }
                | TransferError::Key { .. }
                | TransferError::Machine(_)
                | TransferError::Memory(_)
                | TransferError::File { .. }
                | TransferError::Listen { .. }
        )
    }

    /// A local file error.
    pub fn file(path: impl fmt::Display) -> impl FnOnce(io::Error) -> TransferError {
        let path = path.to_string();
        move |source| TransferError::File { path, source }
    }

    /// Maps an I/O error on the connection to the peer, in `phase`.
    pub fn io(peer: Peer, phase: &str, timeout: Option<Duration>, e: io::Error) -> TransferError {
        let phase = phase.to_owned();
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionAborted => TransferError::Closed { peer, phase },
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => TransferError::Timeout {
                peer,
                phase,
                after: timeout.unwrap_or_default(),
            },
            _ => TransferError::Io {
                peer,
                phase,
                source: e,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_say_what_happened_in_the_operators_terms() {
        let eof = TransferError::io(
            Peer::Destination,
            "sending memory (round 1)",
            None,
            io::ErrorKind::UnexpectedEof.into(),
        );
        assert_eq!(
            eof.to_string(),
            "the destination closed the connection while sending memory (round 1)"
        );
        let silent = TransferError::io(
            Peer::Standby,
            "waiting for the acknowledgement of epoch 3",
            Some(Duration::from_secs(2)),
            io::ErrorKind::WouldBlock.into(),
        );
        assert_eq!(
            silent.to_string(),
            "no answer from the standby for 2 s while waiting for the acknowledgement of epoch 3"
        );
        assert!(!silent.to_string().contains("fill whole buffer"));
        let hs = TransferError::ClosedInHandshake {
            peer: Peer::Standby,
        };
        assert_eq!(
            hs.to_string(),
            "the standby closed the connection during the handshake: wrong key or not a kemari standby?"
        );
        assert!(TransferError::Cancelled { phase: "x".into() }.is_cancelled());
    }
}
