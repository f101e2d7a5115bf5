//! What the VMM's controller answers: a typed [`Reply`] or an
//! [`ActionError`]. The controller never picks an HTTP status; `status.rs`
//! does, for every answer the API gives.

use std::sync::mpsc::{self, Receiver, Sender};

/// A successful answer to an action.
#[derive(Debug)]
pub enum Reply {
    /// The result (200).
    Json(serde_json::Value),
    /// A long operation started; the body says which (202).
    Accepted(serde_json::Value),
    /// One JSON object per line until the sending side is dropped (200,
    /// `application/x-ndjson`).
    Stream(LineStream),
    /// A body that is not JSON (200): the Prometheus exposition.
    Text {
        /// Its `Content-Type`.
        content_type: &'static str,
        /// The body.
        body: String,
    },
}

/// The lines of a [`Reply::Stream`]: already serialized JSON objects, each
/// written as one line (a newline inside one is written as a space, which
/// keeps valid JSON valid) as soon as it is received.
#[derive(Debug)]
pub struct LineStream {
    lines: Receiver<String>,
}

impl LineStream {
    /// A stream of what `lines` receives.
    pub fn new(lines: Receiver<String>) -> Self {
        LineStream { lines }
    }

    /// A stream and the sender of its lines; the stream ends when every
    /// sender is dropped.
    pub fn channel() -> (Sender<String>, LineStream) {
        let (tx, rx) = mpsc::channel();
        (tx, LineStream::new(rx))
    }

    /// The receiving side.
    pub fn into_receiver(self) -> Receiver<String> {
        self.lines
    }
}

/// Why an action was not done; `status.rs` maps each kind to an HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActionError {
    /// A parameter is wrong (a key file cannot be read, a timing is out of
    /// range…) (400).
    #[error("{0}")]
    BadRequest(String),
    /// There is no such thing (404).
    #[error("{0}")]
    NotFound(String),
    /// The VM is in the wrong state: already paused, protected by fault
    /// tolerance, nothing to cancel (409).
    #[error("{0}")]
    Conflict(String),
    /// Another long operation runs (409).
    #[error("{0}")]
    Busy(String),
    /// The destination, standby or successor refused or failed (502).
    #[error("{0}")]
    PeerFailed(String),
    /// The VMM is shutting down (503).
    #[error("{0}")]
    Unavailable(String),
    /// The VMM failed (500).
    #[error("{0}")]
    Internal(String),
}
