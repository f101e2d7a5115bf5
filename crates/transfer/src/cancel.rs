//! Cancelling a hand-over in any phase before its commit point.
//!
//! A [`Cancel`] is shared by the thread that runs a hand-over and whoever
//! may cancel it (the API). Cancelling sets the flag *and* shuts down the
//! connections the hand-over registered, so an end blocked in a read or a
//! write — a peer that never answers, a link that stalled — returns at
//! once; the hand-over then reports [`TransferError::Cancelled`] and the
//! source resumes its VM. The commit point is a compare-and-swap on the
//! same state: once the source passed it, a cancel is refused as too late,
//! and once cancelled, the source can no longer commit.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

use crate::error::TransferError;

const RUNNING: u8 = 0;
const CANCELLED: u8 = 1;
const COMMITTED: u8 = 2;

/// What a cancel request found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The hand-over stops; its source keeps the VM.
    Cancelling,
    /// It was cancelled before.
    AlreadyCancelled,
    /// It passed its commit point: the destination owns the VM.
    TooLate,
}

type Shutdown = Box<dyn Fn() + Send>;

/// The cancel switch of one hand-over.
#[derive(Default)]
pub struct Cancel {
    state: AtomicU8,
    shutdowns: Mutex<Vec<Shutdown>>,
}

impl std::fmt::Debug for Cancel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cancel")
            .field("state", &self.state.load(Ordering::SeqCst))
            .finish()
    }
}

impl Cancel {
    /// A switch not yet thrown.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cancels the hand-over unless it passed its commit point.
    pub fn cancel(&self) -> CancelOutcome {
        match self
            .state
            .compare_exchange(RUNNING, CANCELLED, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => {
                for shut in self.lock().iter() {
                    shut();
                }
                CancelOutcome::Cancelling
            }
            Err(CANCELLED) => CancelOutcome::AlreadyCancelled,
            Err(_) => CancelOutcome::TooLate,
        }
    }

    /// Whether it was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.state.load(Ordering::SeqCst) == CANCELLED
    }

    /// Whether the commit point was passed.
    pub fn is_committed(&self) -> bool {
        self.state.load(Ordering::SeqCst) == COMMITTED
    }

    /// Err(Cancelled) if cancelled.
    pub fn check(&self, phase: &str) -> Result<(), TransferError> {
        if self.is_cancelled() {
            return Err(TransferError::Cancelled {
                phase: phase.to_owned(),
            });
        }
        Ok(())
    }

    /// Passes the commit point: from now on cancelling is refused. Err if
    /// it was cancelled first.
    pub fn commit(&self, phase: &str) -> Result<(), TransferError> {
        match self
            .state
            .compare_exchange(RUNNING, COMMITTED, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) | Err(COMMITTED) => Ok(()),
            Err(_) => Err(TransferError::Cancelled {
                phase: phase.to_owned(),
            }),
        }
    }

    /// Registers what shuts a connection down on cancel (a clone of the
    /// socket's `shutdown`); runs it at once if already cancelled.
    pub fn on_cancel(&self, shutdown: impl Fn() + Send + 'static) {
        if self.is_cancelled() {
            shutdown();
        }
        self.lock().push(Box::new(shutdown));
    }

    /// Registers a TCP or Unix stream to be shut down on cancel.
    pub fn watch_tcp(&self, socket: &std::net::TcpStream) {
        if let Ok(s) = socket.try_clone() {
            self.on_cancel(move || {
                let _ = s.shutdown(std::net::Shutdown::Both);
            });
        }
    }

    /// Registers a Unix stream to be shut down on cancel.
    pub fn watch_unix(&self, socket: &std::os::unix::net::UnixStream) {
        if let Ok(s) = socket.try_clone() {
            self.on_cancel(move || {
                let _ = s.shutdown(std::net::Shutdown::Both);
            });
        }
    }

    /// `result`, or Cancelled (naming the phase) if the failure came from
    /// a cancel: a shut-down socket fails with a closed connection.
    pub fn explain<T>(
        &self,
        result: Result<T, TransferError>,
        phase: &str,
    ) -> Result<T, TransferError> {
        match result {
            Err(e) if self.is_cancelled() && !e.is_cancelled() => {
                tracing::debug!(error = %e, "the hand-over failed after a cancel");
                Err(TransferError::Cancelled {
                    phase: phase.to_owned(),
                })
            }
            other => other,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Shutdown>> {
        self.shutdowns.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn cancel_before_commit_wakes_a_blocked_read_and_commit_then_fails() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let c = std::sync::Arc::new(Cancel::new());
        c.watch_unix(&a);
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            c2.cancel()
        });
        // Blocks until the cancel shuts the socket down.
        let n = (&a).read(&mut [0u8; 8]).unwrap();
        assert_eq!(n, 0);
        assert_eq!(t.join().unwrap(), CancelOutcome::Cancelling);
        assert!(c.commit("committing").is_err());
        assert_eq!(c.cancel(), CancelOutcome::AlreadyCancelled);
        let e = c
            .explain::<()>(
                Err(TransferError::Closed {
                    peer: crate::error::Peer::Destination,
                    phase: "x".into(),
                }),
                "sending memory",
            )
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "cancelled while sending memory: the VM keeps running here"
        );
    }

    #[test]
    fn after_the_commit_point_a_cancel_is_too_late() {
        let c = Cancel::new();
        c.commit("committing").unwrap();
        assert_eq!(c.cancel(), CancelOutcome::TooLate);
        assert!(!c.is_cancelled() && c.is_committed());
        c.check("after").unwrap();
    }
}
