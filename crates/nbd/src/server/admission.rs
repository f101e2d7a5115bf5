//! Which connections the server keeps: at most `--max-connections` at
//! once, and each must finish the NBD handshake (enter transmission) within
//! `--handshake-limit`. A client that opens connections and never
//! negotiates would otherwise hold a thread and a descriptor each for as
//! long as it likes — QEMU's NBD server had exactly that hole
//! (CVE-2024-7409) and closed it the same two ways, with the same defaults
//! (100 connections, 10 s).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use crate::metrics;

/// Counts the connections being served, up to a maximum.
#[derive(Debug, Clone)]
pub struct Admission {
    open: Arc<AtomicUsize>,
    max: usize,
}

impl Admission {
    /// At most `max` connections at once; 0: no limit.
    pub fn new(max: usize) -> Self {
        Admission {
            open: Arc::new(AtomicUsize::new(0)),
            max,
        }
    }

    /// A slot for one more connection, held until it is dropped; `None`
    /// when the maximum are open (the connection is to be refused).
    pub fn admit(&self) -> Option<Slot> {
        let taken = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (self.max == 0 || n < self.max).then_some(n + 1)
            });
        taken.ok().map(|_| {
            metrics::connection_opened();
            Slot {
                open: self.open.clone(),
            }
        })
    }

    /// Connections being served now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// One admitted connection; its place is given back when dropped.
#[derive(Debug)]
pub struct Slot {
    open: Arc<AtomicUsize>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
        metrics::connection_closed();
    }
}

/// Ends a connection whose client has not entered transmission within its
/// limit: a watcher thread runs `expire` (which shuts the socket down, so
/// the session's blocked read fails and its thread ends) unless
/// [`met`](Self::met) came first. Dropped unmet (the session ended on its
/// own), the watcher goes quietly.
#[derive(Debug)]
pub struct HandshakeDeadline {
    met: Option<Sender<()>>,
}

impl HandshakeDeadline {
    /// No limit.
    pub fn none() -> Self {
        HandshakeDeadline { met: None }
    }

    /// Runs `expire` after `limit` unless met by then; `peer` names the
    /// client in the log.
    pub fn start(limit: Duration, peer: String, expire: impl FnOnce() + Send + 'static) -> Self {
        let (met, wait) = mpsc::channel::<()>();
        let who = peer.clone();
        let watcher = std::thread::Builder::new()
            .name("nbd-handshake".into())
            .spawn(move || {
                if let Err(RecvTimeoutError::Timeout) = wait.recv_timeout(limit) {
                    warn!(
                        peer = %who,
                        limit_s = limit.as_secs_f64(),
                        "connection closed: no NBD handshake within the limit (--handshake-limit)"
                    );
                    metrics::connection_refused(metrics::Refusal::HandshakeLimit);
                    expire();
                }
            });
        match watcher {
            Ok(_) => HandshakeDeadline { met: Some(met) },
            Err(e) => {
                // Serving on without a limit beats refusing a client.
                warn!(error = %e, %peer, "cannot watch the handshake's time limit");
                HandshakeDeadline::none()
            }
        }
    }

    /// The client entered transmission: no limit from now on.
    pub fn met(&self) {
        if let Some(m) = &self.met {
            let _ = m.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::time::Instant;

    use super::*;

    #[test]
    fn slots_up_to_the_maximum_and_back() {
        let a = Admission::new(2);
        let one = a.admit().unwrap();
        let two = a.admit().unwrap();
        assert!(a.admit().is_none(), "a third past a maximum of 2");
        assert_eq!(a.open(), 2);
        drop(one);
        let three = a.admit().expect("a place was given back");
        assert_eq!(a.open(), 2);
        drop((two, three));
        assert_eq!(a.open(), 0);
        let unlimited = Admission::new(0);
        let many: Vec<_> = (0..1000).map(|_| unlimited.admit().unwrap()).collect();
        assert_eq!(unlimited.open(), many.len());
    }

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (l.accept().unwrap().0, c)
    }

    #[test]
    fn an_unmet_deadline_shuts_the_connection_a_met_one_does_not() {
        let (server, mut client) = pair();
        let s = server.try_clone().unwrap();
        let t = Instant::now();
        let _d = HandshakeDeadline::start(Duration::from_millis(200), "test".into(), move || {
            let _ = s.shutdown(Shutdown::Both);
        });
        let mut b = [0u8; 1];
        assert_eq!(
            client.read(&mut b).unwrap(),
            0,
            "the server end was not shut"
        );
        assert!(t.elapsed() >= Duration::from_millis(150));

        let (server, mut client) = pair();
        let s = server.try_clone().unwrap();
        let d = HandshakeDeadline::start(Duration::from_millis(200), "test".into(), move || {
            let _ = s.shutdown(Shutdown::Both);
        });
        d.met();
        client
            .set_read_timeout(Some(Duration::from_millis(600)))
            .unwrap();
        let e = client.read(&mut b).unwrap_err();
        assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "{e}"
        );
        drop(server);
    }
}
