//! Control of running vCPU threads: [`VcpuHandle`] queues a request (pause,
//! resume, a job on the vCPU's fd, exit) and kicks the thread out of
//! KVM_RUN; [`VcpuSet`] pauses and resumes all vCPUs of a VM together, with
//! nesting pauses.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_ioctls::VcpuFd;
use vmm_sys_util::signal::Killable;

use super::kick::kick_signal;
use super::{PauseLength, Vcpu, VcpuError, VcpuExitCounters};

pub(super) type VcpuJob = Box<dyn FnOnce(&mut VcpuFd) + Send>;

pub(super) enum VcpuRequest {
    Pause(Sender<()>, PauseLength),
    Resume,
    Run(VcpuJob),
    Exit,
}

/// The controlling side of a vCPU thread, before the thread runs the vCPU.
pub(super) struct VcpuControl {
    index: u8,
    requests: Sender<VcpuRequest>,
    pending: Arc<AtomicBool>,
    counters: Arc<VcpuExitCounters>,
}

/// The vCPU thread's side of a [`VcpuControl`].
pub(super) struct RunnerWiring {
    pub(super) requests: Receiver<VcpuRequest>,
    pub(super) pending: Arc<AtomicBool>,
    pub(super) counters: Arc<VcpuExitCounters>,
}

impl VcpuControl {
    pub(super) fn new(index: u8) -> (Self, RunnerWiring) {
        let (tx, rx) = channel();
        let pending = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(VcpuExitCounters::default());
        (
            VcpuControl {
                index,
                requests: tx,
                pending: pending.clone(),
                counters: counters.clone(),
            },
            RunnerWiring {
                requests: rx,
                pending,
                counters,
            },
        )
    }

    pub(super) fn handle(self, thread: JoinHandle<Option<Vcpu>>) -> VcpuHandle {
        VcpuHandle {
            index: self.index,
            requests: self.requests,
            pending: self.pending,
            thread: Mutex::new(Some(thread)),
            counters: self.counters,
        }
    }
}

/// Control of a running vCPU thread.
pub struct VcpuHandle {
    index: u8,
    requests: Sender<VcpuRequest>,
    pending: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<Option<Vcpu>>>>,
    counters: Arc<VcpuExitCounters>,
}

impl VcpuHandle {
    /// vCPU index.
    pub fn index(&self) -> u8 {
        self.index
    }

    /// Exit counters.
    pub fn counters(&self) -> &VcpuExitCounters {
        &self.counters
    }

    fn send(&self, req: VcpuRequest) -> Result<(), VcpuError> {
        self.requests
            .send(req)
            .map_err(|_| VcpuError::Gone(self.index))?;
        self.pending.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn kick(&self) {
        if let Some(t) = &*self.thread.lock().unwrap_or_else(|p| p.into_inner()) {
            let _ = t.kill(kick_signal());
        }
    }

    /// Stops the vCPU outside KVM_RUN; returns once it is stopped.
    pub fn pause(&self) -> Result<(), VcpuError> {
        let (ack_tx, ack_rx) = channel();
        self.send(VcpuRequest::Pause(ack_tx, PauseLength::Long))?;
        self.wait_kicking(&ack_rx)
    }

    /// Asks the vCPU to stop and then run `job` on its fd, without waiting:
    /// [`wait_job`](Self::wait_job) collects the result. Pausing several
    /// vCPUs this way stops them all at once, and the caller wakes once per
    /// vCPU instead of twice (pause, then a job).
    pub fn start_pause_with<R: Send + 'static>(
        &self,
        length: PauseLength,
        job: impl FnOnce(&mut VcpuFd) -> R + Send + 'static,
    ) -> Result<Receiver<Box<R>>, VcpuError> {
        // Nobody waits on the pause's own acknowledgement: the job's result
        // comes after it.
        // The result travels boxed: a channel allocates its slots in blocks
        // of 31, and a vCPU state (~6 KB) would make each block ~190 KB —
        // above malloc's mmap threshold, so the first pause of a process
        // (a migration's, a warm restart's) paid an mmap, its page faults and
        // an munmap with a TLB shootdown: ~40 µs of the guest's downtime.
        let (ack_tx, _) = channel();
        let (tx, rx) = channel();
        self.send(VcpuRequest::Pause(ack_tx, length))?;
        self.send(VcpuRequest::Run(Box::new(move |fd| {
            let _ = tx.send(Box::new(job(fd)));
        })))?;
        self.kick();
        Ok(rx)
    }

    /// Waits for the result of a job started with
    /// [`start_pause_with`](Self::start_pause_with), kicking the vCPU out of
    /// KVM_RUN until it has it.
    pub fn wait_job<R>(&self, rx: &Receiver<Box<R>>) -> Result<R, VcpuError> {
        // Already kicked: a second signal now would only interrupt the job.
        self.wait_kicked(rx).map(|b| *b)
    }

    /// Lets a paused vCPU run again.
    pub fn resume(&self) -> Result<(), VcpuError> {
        self.send(VcpuRequest::Resume)
    }

    /// Runs `job` on the vCPU thread (with its fd) and returns its result. The
    /// vCPU should be paused: a running one is kicked out of KVM_RUN first.
    pub fn with_fd<R: Send + 'static>(
        &self,
        job: impl FnOnce(&mut VcpuFd) -> R + Send + 'static,
    ) -> Result<R, VcpuError> {
        // Boxed: see start_pause_with.
        let (tx, rx) = channel();
        self.send(VcpuRequest::Run(Box::new(move |fd| {
            let _ = tx.send(Box::new(job(fd)));
        })))?;
        self.wait_kicking(&rx).map(|b| *b)
    }

    fn wait_kicking<T>(&self, rx: &Receiver<T>) -> Result<T, VcpuError> {
        self.kick();
        self.wait_kicked(rx)
    }

    /// Waits for `rx` after a kick (which cannot be lost: see
    /// [`kick_handler`](super::kick)); kicks again every millisecond all the same.
    fn wait_kicked<T>(&self, rx: &Receiver<T>) -> Result<T, VcpuError> {
        // A stop and a state save take tens of µs: poll for that long before
        // sleeping, since a futex wake-up costs about as much again here.
        if let Some(v) = spin_recv(rx, SPIN_WAIT) {
            return Ok(v);
        }
        loop {
            self.kick();
            match rx.recv_timeout(Duration::from_millis(1)) {
                Ok(v) => return Ok(v),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return Err(VcpuError::Gone(self.index)),
            }
        }
    }

    /// Ends the vCPU thread and waits for it.
    pub fn exit(&self) {
        drop(self.exit_keeping_vcpu());
    }

    /// Ends the vCPU thread, waits for it and returns its vCPU (an I/O in
    /// flight completed, as at every stop); `None` if the thread had ended
    /// already or never ran it.
    pub fn exit_keeping_vcpu(&self) -> Option<Vcpu> {
        if self.send(VcpuRequest::Exit).is_ok() {
            self.kick();
        }
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        let t = thread?;
        // Keep kicking until the thread leaves KVM_RUN.
        while !t.is_finished() {
            let _ = t.kill(kick_signal());
            std::thread::sleep(Duration::from_millis(1));
        }
        t.join().ok().flatten()
    }
}
impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.exit();
    }
}

/// How long a waiter polls before it sleeps (see [`spin_recv`]).
pub(super) const SPIN_WAIT: Duration = Duration::from_micros(200);

/// Polls `rx` for up to `limit`; `None` if nothing came (or the sender is
/// gone: the caller's blocking receive reports that).
pub(super) fn spin_recv<T>(rx: &Receiver<T>, limit: Duration) -> Option<T> {
    let start = std::time::Instant::now();
    loop {
        match rx.try_recv() {
            Ok(v) => return Some(v),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return None,
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
        }
        if start.elapsed() >= limit {
            return None;
        }
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}

/// All vCPUs of a VM, paused and resumed together. Pauses nest: the machine
/// (API pause, snapshot) and a synchronizer (fault tolerance) may each pause
/// them, and they run again only when every pause has been undone.
pub struct VcpuSet {
    handles: Vec<VcpuHandle>,
    pauses: Mutex<u32>,
}

impl VcpuSet {
    /// The set of started vCPUs; `paused` if they were started paused.
    pub fn new(handles: Vec<VcpuHandle>, paused: bool) -> Self {
        VcpuSet {
            handles,
            pauses: Mutex::new(u32::from(paused)),
        }
    }

    /// The vCPUs.
    pub fn handles(&self) -> &[VcpuHandle] {
        &self.handles
    }

    /// Whether at least one pause is in effect.
    pub fn is_paused(&self) -> bool {
        *self.pauses.lock().unwrap_or_else(|p| p.into_inner()) > 0
    }

    /// Stops every vCPU outside KVM_RUN (if not stopped already); returns once
    /// all are stopped.
    pub fn pause(&self) -> Result<(), VcpuError> {
        let mut pauses = self.pauses.lock().unwrap_or_else(|p| p.into_inner());
        if *pauses == 0 {
            for v in &self.handles {
                v.pause()?;
            }
        }
        *pauses += 1;
        Ok(())
    }

    /// Pauses every vCPU (one more nested pause, as [`pause`](Self::pause))
    /// and runs `job` on each vCPU's own thread right after it stopped, all
    /// vCPUs at once; returns the results in vCPU order. Undo the pause with
    /// [`resume`](Self::resume), also when this fails.
    pub fn pause_with<R: Send + 'static>(
        &self,
        length: PauseLength,
        job: impl Fn(u8, &mut VcpuFd) -> R + Clone + Send + 'static,
    ) -> Result<Vec<R>, VcpuError> {
        let mut pauses = self.pauses.lock().unwrap_or_else(|p| p.into_inner());
        *pauses += 1;
        if *pauses > 1 {
            // Already stopped: the jobs only.
            return self
                .handles
                .iter()
                .map(|v| {
                    let (job, index) = (job.clone(), v.index());
                    v.with_fd(move |fd| job(index, fd))
                })
                .collect();
        }
        let pending: Vec<_> = self
            .handles
            .iter()
            .map(|v| {
                let (job, index) = (job.clone(), v.index());
                v.start_pause_with(length, move |fd| job(index, fd))
            })
            .collect::<Result<_, _>>()?;
        self.handles
            .iter()
            .zip(&pending)
            .map(|(v, rx)| v.wait_job(rx))
            .collect()
    }

    /// Undoes one [`pause`](Self::pause); the vCPUs run again after the last.
    pub fn resume(&self) -> Result<(), VcpuError> {
        let mut pauses = self.pauses.lock().unwrap_or_else(|p| p.into_inner());
        if *pauses == 1 {
            for v in &self.handles {
                v.resume()?;
            }
        }
        *pauses = pauses.saturating_sub(1);
        Ok(())
    }

    /// Ends every vCPU thread.
    pub fn exit_all(&self) {
        for v in &self.handles {
            v.exit();
        }
    }

    /// Ends every vCPU thread and returns the vCPUs, in index order, to run
    /// again on new threads; `None` if any is missing (its thread had
    /// ended, or panicked).
    pub fn exit_all_keeping_vcpus(&self) -> Option<Vec<Vcpu>> {
        let vcpus: Vec<Option<Vcpu>> = self
            .handles
            .iter()
            .map(VcpuHandle::exit_keeping_vcpu)
            .collect();
        vcpus.into_iter().collect()
    }
}
