//! The etcd fence: who runs a VM is decided by an etcd cluster.
//!
//! Per VM one key (`PREFIX/ID`, [`spec`]) bound to a lease only the
//! running copy keeps alive:
//!
//! - a primary takes the key before its VM is built, and waits out (up to
//!   two TTLs) the lease of a copy that just died;
//! - a standby whose primary is lost takes the key before it runs the VM:
//!   only once the primary's lease has expired (or was given back), and it
//!   waits as long as etcd cannot be reached; it gives up when the key
//!   stays held by a lease that is being renewed (a cut sync link: the
//!   primary lives);
//! - the copy holding the key lets outputs out only until its last
//!   renewal's send time plus the TTL, less a margin ([`deadline`]): a
//!   copy cut off from etcd stops releasing outputs before etcd can give
//!   the key to another, says so, and stands down.
//!
//! The client runs in a helper process ([`helper`]) forked at start-up;
//! the VMM side here ([`EtcdFence`], [`EtcdLease`]) reads its reports on a
//! socket pair ([`wire`]).

pub mod deadline;
pub mod helper;
pub mod spec;
pub mod wire;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm::output::OutputFence;

use self::deadline::LeaseDeadline;
pub use self::spec::EtcdSpec;
use self::wire::{Purpose, Report, Request};
use super::helper_process::fork_helper;
use super::FenceError;

/// The VMM's end of its etcd helper process, ready to take the key of one
/// VM.
#[derive(Debug)]
pub struct EtcdFence {
    spec: EtcdSpec,
    key: String,
    helper: Mutex<Option<UnixStream>>,
    /// Set (by a signal) to end a wait for the key.
    stop: Arc<AtomicBool>,
}

impl EtcdFence {
    /// Forks the helper for the key of VM `id`. Call it while the process
    /// has one thread (the child runs Rust code after the fork). Setting
    /// `stop` ends a wait for the key (a SIGTERM to a waiting standby).
    pub fn start(spec: &EtcdSpec, id: &str, stop: Arc<AtomicBool>) -> std::io::Result<EtcdFence> {
        let key = spec.key(id);
        let ours = fork_helper(|theirs| helper::serve(spec, &key, theirs))?;
        Ok(EtcdFence {
            spec: spec.clone(),
            key,
            helper: Mutex::new(Some(ours)),
            stop,
        })
    }

    /// The VM's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The lease's TTL.
    pub fn ttl(&self) -> Duration {
        self.spec.ttl
    }

    /// Takes the key (see the module documentation for how long each
    /// purpose waits); the lease is then kept alive until the returned
    /// [`EtcdLease`] is dropped or lost. Once only.
    pub fn acquire(&self, purpose: Purpose) -> Result<EtcdLease, FenceError> {
        let fail = |why: String| FenceError::Etcd {
            key: self.key.clone(),
            why,
        };
        let stream = self
            .helper
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| fail("the key was taken once already".into()))?;
        let gone = |e: std::io::Error| fail(format!("the etcd helper process: {e}"));
        (&stream)
            .write_all(Request::Acquire(purpose).line().as_bytes())
            .map_err(gone)?;
        let mut reader = BufReader::new(stream.try_clone().map_err(gone)?);
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .map_err(gone)?;
        let mut line = String::new();
        // A partial line stays in `line` across timeouts.
        loop {
            match reader.read_line(&mut line) {
                Ok(0) => return Err(fail("the etcd helper process is gone".into())),
                Ok(_) => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if self.stop.load(Ordering::SeqCst) {
                        return Err(fail("a signal ended the wait for the key".into()));
                    }
                }
                Err(e) => return Err(gone(e)),
            }
        }
        match Report::parse(&line) {
            Some(Report::Held(deadline)) => {
                Ok(EtcdLease::start(self.key.clone(), deadline, reader, stream))
            }
            Some(Report::Failed(why)) => Err(fail(why)),
            _ => Err(fail(format!(
                "unexpected answer from the etcd helper: {}",
                line.trim_end()
            ))),
        }
    }
}

type OnLost = Box<dyn FnOnce(String) + Send>;

/// How long an ending VMM waits for its helper to give the lease back.
const RELEASE_PATIENCE: Duration = Duration::from_secs(2);

#[derive(Default)]
struct LostState {
    /// Why, once lost.
    why: Option<String>,
    /// The VM ended here and the lease was given back: not a loss.
    released: bool,
    /// Called once with the reason.
    notify: Option<OnLost>,
}

/// A held key: its deadline (the machine's output fence), the thread that
/// follows the renewals, and what is done when it is lost.
pub struct EtcdLease {
    key: String,
    deadline: Arc<LeaseDeadline>,
    lost: Arc<Mutex<LostState>>,
    helper: Arc<UnixStream>,
    /// Says when the renewals' thread ended (the helper exited).
    followed: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

impl std::fmt::Debug for EtcdLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdLease")
            .field("key", &self.key)
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl EtcdLease {
    fn start(
        key: String,
        deadline: u64,
        reader: BufReader<UnixStream>,
        stream: UnixStream,
    ) -> EtcdLease {
        let (ended, followed) = std::sync::mpsc::channel();
        let lease = EtcdLease {
            key,
            deadline: Arc::new(LeaseDeadline::new(deadline)),
            lost: Arc::new(Mutex::new(LostState::default())),
            helper: Arc::new(stream),
            followed: Mutex::new(Some(followed)),
        };
        let (key, deadline, lost, helper) = (
            lease.key.clone(),
            lease.deadline.clone(),
            lease.lost.clone(),
            lease.helper.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("etcd-lease".into())
            .spawn(move || {
                follow_renewals(&key, &deadline, &lost, &helper, reader);
                let _ = ended.send(());
            });
        if let Err(e) = spawned {
            // Without renewals the deadline passes: outputs stop then.
            tracing::error!(error = %e, "etcd fence: cannot follow the lease's renewals");
        }
        lease
    }

    /// The key held.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The fence for the machine's outputs: holds until the deadline.
    pub fn output_fence(&self) -> Arc<dyn OutputFence> {
        self.deadline.clone()
    }

    /// Calls `notify` once with the reason when the lease is lost (at once
    /// if it already is).
    pub fn on_lost(&self, notify: impl FnOnce(String) + Send + 'static) {
        let mut state = self.lost.lock().unwrap_or_else(|p| p.into_inner());
        match &state.why {
            Some(why) => {
                let why = why.clone();
                drop(state);
                notify(why);
            }
            None => state.notify = Some(Box::new(notify)),
        }
    }
}

impl Drop for EtcdLease {
    fn drop(&mut self) {
        // The VM no longer runs here: the key may go at once.
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).released = true;
        let _ = (&*self.helper).write_all(Request::Release.line().as_bytes());
        // The helper revokes the lease and exits; it dies with this
        // process, so give it a moment (else the key waits out its TTL).
        let followed = self
            .followed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(f) = followed {
            let _ = f.recv_timeout(RELEASE_PATIENCE);
        }
    }
}

/// The `etcd-lease` thread: moves the deadline with each renewal; when the
/// deadline passes first (or etcd says the lease is gone, or the helper
/// ends) the lease is lost for good: said once, at ERROR, and the helper
/// told to give it back.
fn follow_renewals(
    key: &str,
    deadline: &LeaseDeadline,
    lost: &Mutex<LostState>,
    helper: &UnixStream,
    mut reader: BufReader<UnixStream>,
) {
    let mut line = String::new();
    let why = loop {
        let Some(left) = deadline.remaining() else {
            break "its lease was not renewed in time (etcd out of reach)".to_owned();
        };
        let left = left.max(Duration::from_millis(1));
        if let Err(e) = reader.get_ref().set_read_timeout(Some(left)) {
            break format!("the etcd helper process: {e}");
        }
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) => break "the etcd helper process ended".to_owned(),
            Ok(_) => match Report::parse(&line) {
                Some(Report::Renewed(d)) => {
                    if !deadline.extend(d) {
                        break "its lease was not renewed in time (etcd out of reach)".to_owned();
                    }
                }
                Some(Report::Lost(why)) => break why,
                _ => tracing::debug!(line = line.trim_end(), "etcd fence: unexpected report"),
            },
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => break format!("the etcd helper process: {e}"),
        }
    };
    deadline.lose();
    if lost.lock().unwrap_or_else(|p| p.into_inner()).released {
        return;
    }
    let why = format!("lost the etcd key {key}: {why}; outputs are held for good");
    tracing::error!(key, "etcd fence: {why}");
    let _ = (&*helper).write_all(Request::Release.line().as_bytes());
    let notify = {
        let mut state = lost.lock().unwrap_or_else(|p| p.into_inner());
        state.why = Some(why.clone());
        state.notify.take()
    };
    if let Some(n) = notify {
        n(why);
    }
}

#[cfg(test)]
mod tests {
    use super::deadline::monotonic_ns;
    use super::*;
    use std::sync::mpsc::channel;

    /// A lease whose "helper" is the other end of a socket pair.
    fn fake_lease(valid_for: Duration) -> (EtcdLease, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let reader = BufReader::new(ours.try_clone().unwrap());
        let deadline = monotonic_ns() + valid_for.as_nanos() as u64;
        (
            EtcdLease::start("/k/vm".into(), deadline, reader, ours),
            theirs,
        )
    }

    #[test]
    fn renewals_keep_it_and_their_absence_loses_it_for_good_once() {
        // Generous bounds: a loaded machine may stall this thread a while.
        let (lease, helper) = fake_lease(Duration::from_secs(1));
        let fence = lease.output_fence();
        let (tx, rx) = channel();
        lease.on_lost(move |why| tx.send(why).unwrap());
        for _ in 0..4 {
            std::thread::sleep(Duration::from_millis(100));
            let d = monotonic_ns() + 1_000_000_000;
            (&helper)
                .write_all(Report::Renewed(d).line().as_bytes())
                .unwrap();
            assert!(fence.holds());
        }
        // No more renewals: lost at the deadline, said once.
        let why = rx.recv_timeout(Duration::from_secs(30)).unwrap();
        assert!(why.contains("lost the etcd key /k/vm"), "{why}");
        assert!(why.contains("not renewed in time"), "{why}");
        assert!(!fence.holds());
        // A late renewal brings nothing back; the helper was told to let go.
        let late = monotonic_ns() + 60_000_000_000;
        let _ = (&helper).write_all(Report::Renewed(late).line().as_bytes());
        assert!(!fence.holds());
        let mut line = String::new();
        BufReader::new(&helper).read_line(&mut line).unwrap();
        assert_eq!(Request::parse(&line), Some(Request::Release));
        // Registered after the loss: told at once.
        let (tx, rx) = channel();
        lease.on_lost(move |why| tx.send(why).unwrap());
        assert!(rx.try_recv().is_ok());
    }

    #[test]
    fn etcd_saying_it_expired_loses_it_at_once_and_a_release_is_no_loss() {
        let (lease, helper) = fake_lease(Duration::from_secs(60));
        let (tx, rx) = channel();
        lease.on_lost(move |why| tx.send(why).unwrap());
        (&helper)
            .write_all(
                Report::Lost("etcd says lease 7 has expired".into())
                    .line()
                    .as_bytes(),
            )
            .unwrap();
        let why = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(why.contains("has expired"), "{why}");
        assert!(!lease.output_fence().holds());

        let (lease, helper) = fake_lease(Duration::from_secs(60));
        let (tx, rx) = channel::<String>();
        lease.on_lost(move |why| tx.send(why).unwrap());
        let fence = lease.output_fence();
        // The helper revokes and exits when told: its end closes.
        let helper_side = std::thread::spawn(move || {
            let mut line = String::new();
            BufReader::new(&helper).read_line(&mut line).unwrap();
            assert_eq!(Request::parse(&line), Some(Request::Release));
        });
        drop(lease);
        helper_side.join().unwrap();
        assert!(rx.recv_timeout(Duration::from_millis(500)).is_err());
        assert!(!fence.holds());
    }
}
