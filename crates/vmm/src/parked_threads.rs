//! Threads started ahead of the moment they are needed.
//!
//! Starting a thread costs 20–90 µs on this kind of host (the clone, the
//! mapping of its stack, the new thread's own set-up), and a restore starts
//! three kinds of them: the device loop's, one per vCPU, and the console's
//! flusher (on the first partial line the guest prints, from the vCPU's
//! thread). A restore into a prepared VM (a migration's destination, a warm
//! restart's successor, a fault-tolerance standby) would pay that inside the
//! guest's pause. [`ParkedThreads`] starts them while the guest still runs
//! elsewhere; each sleeps until it is given the one job it will run.

use std::ffi::CString;
use std::io;
use std::sync::mpsc::{channel, Sender};
use std::sync::Mutex;
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send>;

/// One thread waiting for its job.
pub struct ParkedThread {
    job: Sender<(CString, Job)>,
    handle: JoinHandle<()>,
}

impl ParkedThread {
    fn start() -> io::Result<Self> {
        let (tx, rx) = channel::<(CString, Job)>();
        let handle = std::thread::Builder::new()
            .name("parked".into())
            .spawn(move || {
                // Dropped unused (its owner gave up): the thread just ends.
                if let Ok((name, job)) = rx.recv() {
                    // SAFETY: PR_SET_NAME reads a NUL-terminated string of
                    // at most 16 bytes from a live CString; it names only
                    // the calling thread.
                    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr()) };
                    job();
                }
            })?;
        Ok(ParkedThread { job: tx, handle })
    }

    /// Runs `job` on this thread, which takes the OS name `name` (at most 15
    /// bytes are kept); the handle joins it when the job returns.
    pub fn run(
        self,
        name: &str,
        job: impl FnOnce() + Send + 'static,
    ) -> io::Result<JoinHandle<()>> {
        let name: Vec<u8> = name.bytes().filter(|&b| b != 0).take(15).collect();
        // No NUL inside: filtered above.
        let name = CString::new(name).unwrap_or_default();
        self.job
            .send((name, Box::new(job)))
            .map_err(|_| io::Error::other("a parked thread ended before its job came"))?;
        Ok(self.handle)
    }
}

/// Threads waiting for jobs, handed out one per job; new threads are started
/// once none are left (or none were started).
#[derive(Default)]
pub struct ParkedThreads {
    parked: Mutex<Vec<ParkedThread>>,
}

impl ParkedThreads {
    /// Starts `count` threads that sleep until given a job.
    pub fn start(count: usize) -> io::Result<Self> {
        let parked = (0..count)
            .map(|_| ParkedThread::start())
            .collect::<io::Result<Vec<_>>>()?;
        Ok(ParkedThreads {
            parked: Mutex::new(parked),
        })
    }

    /// Threads still waiting.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none are waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A waiting thread, if one is left.
    pub fn take(&self) -> Option<ParkedThread> {
        self.lock().pop()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<ParkedThread>> {
        self.parked.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Runs `job` on `parked` if given, else on a new thread named `name`.
pub fn spawn_on(
    parked: Option<ParkedThread>,
    name: &str,
    job: impl FnOnce() + Send + 'static,
) -> io::Result<JoinHandle<()>> {
    match parked {
        Some(t) => t.run(name, job),
        None => std::thread::Builder::new().name(name.into()).spawn(job),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    fn os_name() -> String {
        std::fs::read_to_string("/proc/thread-self/comm")
            .unwrap()
            .trim_end()
            .to_string()
    }

    #[test]
    fn a_parked_thread_runs_its_job_under_its_new_name() {
        let threads = ParkedThreads::start(2).unwrap();
        assert_eq!(threads.len(), 2);
        let (tx, rx) = channel();
        let t = threads.take().unwrap();
        let handle = t
            .run("vcpu0-with-a-long-name", move || {
                tx.send(os_name()).unwrap()
            })
            .unwrap();
        assert_eq!(rx.recv().unwrap(), "vcpu0-with-a-lo");
        handle.join().unwrap();
        assert_eq!(threads.len(), 1);
    }

    #[test]
    fn without_parked_threads_a_new_one_is_started() {
        let threads = ParkedThreads::default();
        assert!(threads.is_empty());
        let (tx, rx) = channel();
        spawn_on(threads.take(), "devices", move || {
            tx.send(os_name()).unwrap()
        })
        .unwrap()
        .join()
        .unwrap();
        assert_eq!(rx.recv().unwrap(), "devices");
    }

    #[test]
    fn unused_parked_threads_end_when_dropped() {
        let threads = ParkedThreads::start(1).unwrap();
        let t = threads.take().unwrap();
        let ParkedThread { job, handle } = t;
        drop(job);
        handle.join().unwrap();
    }
}
