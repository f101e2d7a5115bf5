//! The device event loop: one thread per VM that serves virtio queue
//! notifications (ioeventfds, so a guest kick costs no exit to userspace) and
//! backend readiness (TAP fds). It can be paused like a vCPU, so that snapshots
//! and synchronization see devices at rest.
//!
//! It is also the output hook point (see [`crate::output`]): a device's output
//! queue is served only after the [`OutputGate`] released the batch of
//! requests pending on every device's output queue, and only up to what the
//! batch held. With a gate that checkpoints periodically, the loop runs the
//! checkpoints from a timer and releases held outputs after each. A batch
//! the gate releases only once confirmed (an epoch the standby must
//! acknowledge) is kept by the loop, which serves everything else meanwhile
//! — received frames, other queues, the next batch's epoch — and serves the
//! batch when the gate's confirmation descriptors say it may.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use super::virtio::{PendingOutputs, VirtioDevice, TYPE_BLOCK};
use crate::output::{OutputEvent, OutputGate, OutputKind, Release};

/// Errors of the event loop.
#[derive(Debug, thiserror::Error)]
pub enum EventLoopError {
    /// epoll or eventfd set-up failed.
    #[error("device event loop set-up failed")]
    Setup(#[source] std::io::Error),
    /// The loop thread is gone.
    #[error("device event loop thread is not running")]
    Gone,
}

/// One device as the loop sees it.
pub struct LoopDevice {
    /// The device.
    pub device: Arc<Mutex<dyn VirtioDevice>>,
    /// One ioeventfd per queue, in queue order.
    pub queue_events: Vec<EventFd>,
}

enum Request {
    Pause(Sender<()>),
    Resume,
    SetGate(Arc<dyn OutputGate>, Sender<()>),
    Exit,
}

const CONTROL_TOKEN: u64 = u64::MAX;
const CHECKPOINT_TOKEN: u64 = u64::MAX - 1;
/// The gate's confirmation descriptors: `CONFIRMATION_TOKEN - i`.
const CONFIRMATION_TOKEN: u64 = u64::MAX - 2;
const MAX_CONFIRMATION_FDS: u64 = 16;
/// Batches served in a row before other events get a turn.
const MAX_BATCHES_IN_A_ROW: usize = 8;
const BACKEND_QUEUE: u64 = 0xffff;

fn token(device: usize, queue: u64) -> u64 {
    ((device as u64) << 16) | queue
}

/// Handle to the running loop.
pub struct DeviceEventLoop {
    requests: Sender<Request>,
    control: EventFd,
    thread: Option<JoinHandle<()>>,
}

/// A device event loop's thread, with its epoll, timer and control
/// eventfd, made before its devices exist. A restore makes one ahead (see
/// `PreparedVm`): spawning the thread inside the guest's pause cost
/// 35–140 µs on the PVM host. Dropped unused, the thread ends.
pub struct EventLoopAhead {
    epoll: Epoll,
    timer: TimerFd,
    control: EventFd,
    run: Sender<Box<dyn FnOnce() + Send>>,
    thread: JoinHandle<()>,
}

impl EventLoopAhead {
    /// Makes the thread, which waits for its loop.
    pub fn spawn() -> Result<Self, EventLoopError> {
        let epoll = Epoll::new().map_err(EventLoopError::Setup)?;
        let timer = TimerFd::new()
            .map_err(|e| EventLoopError::Setup(std::io::Error::from_raw_os_error(e.errno())))?;
        epoll
            .ctl(
                ControlOperation::Add,
                timer.as_raw_fd(),
                EpollEvent::new(EventSet::IN, CHECKPOINT_TOKEN),
            )
            .map_err(EventLoopError::Setup)?;
        let control = EventFd::new(libc::EFD_NONBLOCK).map_err(EventLoopError::Setup)?;
        epoll
            .ctl(
                ControlOperation::Add,
                control.as_raw_fd(),
                EpollEvent::new(EventSet::IN, CONTROL_TOKEN),
            )
            .map_err(EventLoopError::Setup)?;
        let (run, runs) = channel::<Box<dyn FnOnce() + Send>>();
        let thread = std::thread::Builder::new()
            .name("devices".into())
            .spawn(move || {
                // Its filter now, ahead of the hand-over's pause.
                crate::seccomp::confine_this_thread(crate::seccomp::ThreadFilter::Devices);
                crate::seccomp::make_a_forbidden_call_if_asked("devices");
                if let Ok(run) = runs.recv() {
                    run();
                }
            })
            .map_err(EventLoopError::Setup)?;
        Ok(EventLoopAhead {
            epoll,
            timer,
            control,
            run,
            thread,
        })
    }
}

impl DeviceEventLoop {
    /// Starts the loop over `devices`, outputs passing `gate`, on a new
    /// thread: [`start_on`](Self::start_on) one made ahead.
    pub fn start(
        devices: Vec<LoopDevice>,
        gate: Arc<dyn OutputGate>,
        paused: bool,
    ) -> Result<Self, EventLoopError> {
        Self::start_on(EventLoopAhead::spawn()?, devices, gate, paused)
    }

    /// Starts the loop over `devices` on the thread made ahead, outputs
    /// passing `gate`. With `paused` it serves nothing until the first
    /// [`resume`](Self::resume), as if [`pause`](Self::pause) had been
    /// called, without waiting for the thread to say so (a restore pays
    /// that inside the guest's pause).
    pub fn start_on(
        ahead: EventLoopAhead,
        devices: Vec<LoopDevice>,
        gate: Arc<dyn OutputGate>,
        paused: bool,
    ) -> Result<Self, EventLoopError> {
        let EventLoopAhead {
            epoll,
            timer,
            control,
            run,
            thread,
        } = ahead;
        for (i, d) in devices.iter().enumerate() {
            for (q, evt) in d.queue_events.iter().enumerate() {
                epoll
                    .ctl(
                        ControlOperation::Add,
                        evt.as_raw_fd(),
                        EpollEvent::new(EventSet::IN, token(i, q as u64)),
                    )
                    .map_err(EventLoopError::Setup)?;
            }
            let fd = d
                .device
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .backend_fd();
            if let Some(fd) = fd {
                // Edge-triggered: a device that cannot take more input (no guest
                // buffers) must not make the loop spin; it retries when the guest
                // adds buffers (a queue notification).
                epoll
                    .ctl(
                        ControlOperation::Add,
                        fd,
                        EpollEvent::new(
                            EventSet::IN | EventSet::EDGE_TRIGGERED,
                            token(i, BACKEND_QUEUE),
                        ),
                    )
                    .map_err(EventLoopError::Setup)?;
            }
        }
        let (tx, rx) = channel();
        let ctl = control.try_clone().map_err(EventLoopError::Setup)?;
        run.send(Box::new(move || {
            let mut lp = Loop::new(devices, timer, epoll);
            lp.install_gate(gate);
            lp.run(ctl, rx, paused)
        }))
        .map_err(|_| EventLoopError::Gone)?;
        Ok(DeviceEventLoop {
            requests: tx,
            control,
            thread: Some(thread),
        })
    }

    fn send(&self, r: Request) -> Result<(), EventLoopError> {
        self.requests.send(r).map_err(|_| EventLoopError::Gone)?;
        self.control.write(1).map_err(|_| EventLoopError::Gone)
    }

    /// Stops serving events; returns once the loop is idle.
    pub fn pause(&self) -> Result<(), EventLoopError> {
        let (ack_tx, ack_rx) = channel();
        self.send(Request::Pause(ack_tx))?;
        loop {
            match ack_rx.recv_timeout(Duration::from_secs(5)) {
                Ok(()) => return Ok(()),
                Err(RecvTimeoutError::Timeout) => {
                    tracing::warn!("device event loop slow to pause (a backend is blocking?)")
                }
                Err(RecvTimeoutError::Disconnected) => return Err(EventLoopError::Gone),
            }
        }
    }

    /// Serves events again.
    pub fn resume(&self) -> Result<(), EventLoopError> {
        self.send(Request::Resume)
    }

    /// Replaces the output gate; returns once the loop uses the new one (no
    /// output is released by the old gate after this returns).
    pub fn set_gate(&self, gate: Arc<dyn OutputGate>) -> Result<(), EventLoopError> {
        let (ack_tx, ack_rx) = channel();
        self.send(Request::SetGate(gate, ack_tx))?;
        ack_rx.recv().map_err(|_| EventLoopError::Gone)
    }
}

impl Drop for DeviceEventLoop {
    fn drop(&mut self) {
        let _ = self.send(Request::Exit);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A batch the gate released once its ticket is confirmed: how far each
/// device may then serve its output queue.
struct HeldBatch {
    ticket: u64,
    limits: Vec<(usize, u16)>,
}

struct Loop {
    devices: Vec<LoopDevice>,
    /// Each device's output queue and output kind, if it has one.
    outputs: Vec<Option<(usize, OutputKind)>>,
    gate: Arc<dyn OutputGate>,
    timer: TimerFd,
    epoll: Epoll,
    /// Copies of the gate's confirmation descriptors, as watched.
    confirmation_fds: Vec<OwnedFd>,
    /// Batches waiting for their confirmation, oldest first.
    held: VecDeque<HeldBatch>,
}

/// A copy of `fd` the loop owns (the gate may close its own at any time).
fn dup_fd(fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: `fd` is open (the gate lends it for this call);
    // F_DUPFD_CLOEXEC makes a new descriptor and touches no memory.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if new < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `new` was just made by fcntl and nothing else owns it.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(new) })
}

impl Loop {
    fn new(devices: Vec<LoopDevice>, timer: TimerFd, epoll: Epoll) -> Self {
        let outputs = devices
            .iter()
            .map(|d| {
                let d = d.device.lock().unwrap_or_else(|p| p.into_inner());
                let kind = if d.device_type() == TYPE_BLOCK {
                    OutputKind::BlockRequests
                } else {
                    OutputKind::NetTransmits
                };
                d.output_queue().map(|q| (q, kind))
            })
            .collect();
        Loop {
            devices,
            outputs,
            gate: Arc::new(crate::output::PassThroughGate),
            timer,
            confirmation_fds: Vec::new(),
            held: VecDeque::new(),
            epoll,
        }
    }

    /// Puts `gate` in place: its timer and confirmation descriptors. Batches
    /// the old gate held are pending again: the new gate decides on them.
    fn install_gate(&mut self, gate: Arc<dyn OutputGate>) {
        self.stop_watching_confirmations();
        self.held.clear();
        self.gate = gate;
        self.arm_timer();
        for (i, fd) in self.gate.confirmation_fds().into_iter().enumerate() {
            if i as u64 >= MAX_CONFIRMATION_FDS {
                tracing::error!("device event loop: an output gate gave too many descriptors");
                break;
            }
            let watched = dup_fd(fd).and_then(|own| {
                self.epoll
                    .ctl(
                        ControlOperation::Add,
                        own.as_raw_fd(),
                        EpollEvent::new(EventSet::IN, CONFIRMATION_TOKEN - i as u64),
                    )
                    .map(|()| own)
            });
            match watched {
                Ok(own) => self.confirmation_fds.push(own),
                Err(e) => {
                    tracing::error!(error = %e, "device event loop: cannot watch the output gate")
                }
            }
        }
    }

    fn stop_watching_confirmations(&mut self) {
        for fd in self.confirmation_fds.drain(..) {
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                fd.as_raw_fd(),
                EpollEvent::default(),
            );
        }
    }

    fn arm_timer(&mut self) {
        let res = match self.gate.checkpoint_interval() {
            Some(every) => self.timer.reset(every, Some(every)),
            None => self.timer.clear(),
        };
        if let Err(e) = res {
            tracing::error!(error = %e, "device event loop: cannot arm the checkpoint timer");
        }
    }

    /// What waits on every output queue now, device by device.
    fn pending_outputs(&self) -> Vec<(usize, PendingOutputs, OutputEvent)> {
        let mut batch = Vec::new();
        for (i, d) in self.devices.iter().enumerate() {
            let Some((_, kind)) = self.outputs[i] else {
                continue;
            };
            let pending = d
                .device
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pending_outputs();
            if let Some(p) = pending {
                batch.push((
                    i,
                    p,
                    OutputEvent {
                        device: i,
                        kind,
                        requests: p.requests,
                    },
                ));
            }
        }
        batch
    }

    /// Lets each device serve its part of `batch`; returns requests served.
    fn release(&self, batch: &[(usize, PendingOutputs, OutputEvent)]) -> usize {
        batch
            .iter()
            .map(|(i, p, _)| {
                usize::from(
                    self.devices[*i]
                        .device
                        .lock()
                        .unwrap_or_else(|pe| pe.into_inner())
                        .serve_outputs_until(p.limit),
                )
            })
            .sum()
    }

    /// How far device `i`'s held batches reach, if any is held.
    fn held_limit(&self, i: usize) -> Option<u16> {
        self.held
            .iter()
            .rev()
            .find_map(|h| h.limits.iter().find(|(d, _)| *d == i).map(|(_, l)| *l))
    }

    /// What waits beyond the held batches: each device's pending outputs
    /// with `requests` counting only those no held batch covers.
    fn fresh_outputs(&self) -> Vec<(usize, PendingOutputs, OutputEvent)> {
        let mut batch = self.pending_outputs();
        batch.retain_mut(|(i, p, e)| {
            if let Some(h) = self.held_limit(*i) {
                let beyond = p.limit.wrapping_sub(h);
                // Beyond what waits in all (a ring reset under us): all new.
                if beyond <= p.requests {
                    e.requests = beyond;
                }
            }
            e.requests != 0
        });
        batch
    }

    /// Serves the held batches whose ticket is `confirmed` or lower; true
    /// if it served any.
    fn release_upto(&mut self, confirmed: u64) -> bool {
        let mut upto: Vec<(usize, u16)> = Vec::new();
        while self.held.front().is_some_and(|h| h.ticket <= confirmed) {
            let Some(h) = self.held.pop_front() else {
                break;
            };
            for (d, l) in h.limits {
                match upto.iter_mut().find(|(u, _)| *u == d) {
                    Some(u) => u.1 = l,
                    None => upto.push((d, l)),
                }
            }
        }
        for (d, limit) in &upto {
            self.devices[*d]
                .device
                .lock()
                .unwrap_or_else(|pe| pe.into_inner())
                .serve_outputs_until(*limit);
        }
        !upto.is_empty()
    }

    /// A confirmation descriptor is readable (`hung_up`: for good).
    fn confirmation_ready(&mut self, hung_up: bool) {
        // Asked once: the gate consumes what woke the loop.
        let confirmed = self.gate.confirmed();
        let released = self.release_upto(confirmed);
        if self.held.is_empty() && (hung_up || confirmed == u64::MAX) {
            // Nothing will need a confirmation again (protection ended):
            // a closed link must not wake the loop forever.
            self.stop_watching_confirmations();
        }
        if released {
            // Outputs published meanwhile may have waited for a free slot.
            self.serve_outputs();
        }
    }

    /// A guest published outputs: pass them through the gate batch by batch.
    fn serve_outputs(&mut self) {
        for _ in 0..MAX_BATCHES_IN_A_ROW {
            if self.held.len() >= self.gate.max_unconfirmed().max(1) {
                // Served once a held batch is confirmed.
                return;
            }
            let batch = self.fresh_outputs();
            if batch.is_empty() {
                return;
            }
            let events: Vec<OutputEvent> = batch.iter().map(|b| b.2).collect();
            match self.gate.before_output(&events) {
                Release::AtCheckpoint => return,
                Release::WhenConfirmed(ticket) => {
                    let limits = batch.iter().map(|(i, p, _)| (*i, p.limit)).collect();
                    self.held.push_back(HeldBatch { ticket, limits });
                    // Its confirmation wakes the loop; the next epoch
                    // captures what is published from now on.
                    return;
                }
                Release::Now => {
                    // Held batches go too: they come first in each ring.
                    self.held.clear();
                    if self.release(&batch) == 0 {
                        // A ring that cannot be served (corrupt indices): the
                        // device counted it; wait for the guest's next kick.
                        return;
                    }
                }
            }
        }
        // Still busy: give other events a turn, then come back.
        for (i, d) in self.devices.iter().enumerate() {
            if let Some((q, _)) = self.outputs[i] {
                if let Some(evt) = d.queue_events.get(q) {
                    let _ = evt.write(1);
                }
            }
        }
    }

    /// The periodic checkpoint, then the outputs it covers.
    fn checkpoint(&mut self) {
        let batch = self.pending_outputs();
        let events: Vec<OutputEvent> = batch.iter().map(|b| b.2).collect();
        if self.gate.checkpoint(&events) == Release::Now {
            self.release(&batch);
        }
    }

    /// Serves one control request; false on `Exit`.
    fn handle(&mut self, req: Request, paused: &mut bool) -> bool {
        match req {
            Request::Pause(ack) => {
                *paused = true;
                let _ = ack.send(());
            }
            Request::Resume => *paused = false,
            Request::SetGate(gate, ack) => {
                self.install_gate(gate);
                let _ = ack.send(());
                if !*paused {
                    self.serve_outputs();
                }
            }
            Request::Exit => return false,
        }
        true
    }

    fn run(&mut self, control: EventFd, requests: Receiver<Request>, mut paused: bool) {
        let mut events = vec![EpollEvent::default(); 64];
        // Started paused: wait for the requests that end it before looking at
        // any event. The control eventfd's count is left to the loop below,
        // which then finds the queue empty.
        while paused {
            match requests.recv() {
                Ok(req) => {
                    if !self.handle(req, &mut paused) {
                        return;
                    }
                }
                Err(_) => return,
            }
        }
        loop {
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!(error = %e, "device event loop: epoll_wait failed");
                    return;
                }
            };
            for ev in &events[..n] {
                let data = ev.data();
                if data == CONTROL_TOKEN {
                    let _ = control.read();
                    // Serve every queued request; while paused, block for the next.
                    loop {
                        let req = if paused {
                            match requests.recv() {
                                Ok(r) => r,
                                Err(_) => return,
                            }
                        } else {
                            match requests.try_recv() {
                                Ok(r) => r,
                                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                                Err(_) => return,
                            }
                        };
                        if !self.handle(req, &mut paused) {
                            return;
                        }
                    }
                    continue;
                }
                if data == CHECKPOINT_TOKEN {
                    let _ = self.timer.wait();
                    self.checkpoint();
                    continue;
                }
                if data <= CONFIRMATION_TOKEN && data > CONFIRMATION_TOKEN - MAX_CONFIRMATION_FDS {
                    let hung_up = ev
                        .event_set()
                        .intersects(EventSet::HANG_UP | EventSet::ERROR);
                    self.confirmation_ready(hung_up);
                    continue;
                }
                let (dev, queue) = ((data >> 16) as usize, data & 0xffff);
                let Some(d) = self.devices.get(dev) else {
                    continue;
                };
                if queue == BACKEND_QUEUE {
                    d.device
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .backend_ready();
                } else if let Some(evt) = d.queue_events.get(queue as usize) {
                    let _ = evt.read();
                    if self.outputs[dev].map(|(q, _)| q as u64) == Some(queue) {
                        self.serve_outputs();
                    } else {
                        d.device
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .queue_notified(queue as usize);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;

    use super::*;
    use crate::devices::virtio::{Activation, DeviceCounters, VirtioError, TYPE_NET};
    use crate::output::PassThroughGate;

    /// A device that counts the notifications the loop hands it and, with
    /// a `ring`, has an output queue the test fills.
    struct TestDevice {
        notified: Arc<AtomicUsize>,
        ring: Option<Arc<Ring>>,
    }

    impl VirtioDevice for TestDevice {
        fn device_type(&self) -> u32 {
            TYPE_NET
        }
        fn name(&self) -> &str {
            "test"
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[256]
        }
        fn features(&self) -> u64 {
            0
        }
        fn read_config(&self, _offset: u64, _data: &mut [u8]) {}
        fn activate(&mut self, _activation: Activation) -> Result<(), VirtioError> {
            Ok(())
        }
        fn is_activated(&self) -> bool {
            true
        }
        fn queue_notified(&mut self, _index: usize) {
            self.notified.fetch_add(1, Ordering::SeqCst);
        }
        fn output_queue(&self) -> Option<usize> {
            self.ring.as_ref().map(|_| 0)
        }
        fn pending_outputs(&self) -> Option<PendingOutputs> {
            let ring = self.ring.as_ref()?;
            let limit = ring.published.load(Ordering::SeqCst);
            let requests = limit.wrapping_sub(ring.served.load(Ordering::SeqCst));
            (requests != 0).then_some(PendingOutputs { limit, requests })
        }
        fn serve_outputs_until(&mut self, limit: u16) -> u16 {
            self.ring.as_ref().map_or(0, |ring| {
                limit.wrapping_sub(ring.served.swap(limit, Ordering::SeqCst))
            })
        }
        fn reset(&mut self) {}
        fn counters(&self) -> DeviceCounters {
            DeviceCounters::default()
        }
    }

    fn wait_for(count: &AtomicUsize, want: usize) -> bool {
        until(|| count.load(Ordering::SeqCst) == want)
    }

    /// A device counting its queue notifications: the count, the eventfd
    /// that notifies it, and the device as the loop takes it.
    fn counting_device() -> (Arc<AtomicUsize>, EventFd, LoopDevice) {
        let count = Arc::new(AtomicUsize::new(0));
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let kick = evt.try_clone().unwrap();
        let device: Arc<Mutex<dyn VirtioDevice>> = Arc::new(Mutex::new(TestDevice {
            notified: count.clone(),
            ring: None,
        }));
        let loop_device = LoopDevice {
            device,
            queue_events: vec![evt],
        };
        (count, kick, loop_device)
    }

    /// An output queue the test fills: `published` requests so far,
    /// `served` of them served.
    #[derive(Default)]
    struct Ring {
        published: std::sync::atomic::AtomicU16,
        served: std::sync::atomic::AtomicU16,
    }

    /// A gate releasing each batch once the test confirms its ticket;
    /// records the requests of each batch it saw.
    #[derive(Debug)]
    struct Confirming {
        in_flight: usize,
        wake: EventFd,
        confirmed: std::sync::atomic::AtomicU64,
        batches: Mutex<Vec<u16>>,
    }

    impl Confirming {
        fn new(in_flight: usize) -> Arc<Self> {
            Arc::new(Confirming {
                in_flight,
                wake: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
                confirmed: Default::default(),
                batches: Mutex::new(Vec::new()),
            })
        }
        fn confirm(&self, ticket: u64) {
            self.confirmed.store(ticket, Ordering::SeqCst);
            self.wake.write(1).unwrap();
        }
        fn batches(&self) -> Vec<u16> {
            self.batches.lock().unwrap().clone()
        }
    }

    impl OutputGate for Confirming {
        fn before_output(&self, batch: &[OutputEvent]) -> Release {
            let mut seen = self.batches.lock().unwrap();
            seen.push(batch.iter().map(|e| e.requests).sum());
            Release::WhenConfirmed(seen.len() as u64)
        }
        fn confirmed(&self) -> u64 {
            let _ = self.wake.read();
            self.confirmed.load(Ordering::SeqCst)
        }
        fn confirmation_fds(&self) -> Vec<RawFd> {
            vec![self.wake.as_raw_fd()]
        }
        fn max_unconfirmed(&self) -> usize {
            self.in_flight
        }
    }

    /// Waits until `f` holds (5 s at most).
    fn until(f: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    fn output_device() -> (Arc<Ring>, EventFd, LoopDevice) {
        let ring = Arc::new(Ring::default());
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let kick = evt.try_clone().unwrap();
        let device: Arc<Mutex<dyn VirtioDevice>> = Arc::new(Mutex::new(TestDevice {
            notified: Arc::default(),
            ring: Some(ring.clone()),
        }));
        (
            ring,
            kick,
            LoopDevice {
                device,
                queue_events: vec![evt],
            },
        )
    }

    fn publish(ring: &Ring, kick: &EventFd, n: u16) {
        ring.published.fetch_add(n, Ordering::SeqCst);
        kick.write(1).unwrap();
    }

    #[test]
    fn a_batch_waits_for_its_confirmation_and_later_outputs_wait_their_turn() {
        let (ring, kick, device) = output_device();
        let gate = Confirming::new(1);
        let lp = DeviceEventLoop::start(vec![device], gate.clone(), false).unwrap();
        publish(&ring, &kick, 1);
        assert!(until(|| gate.batches() == [1]));
        // Published while batch 1 is unconfirmed: not even shown to the gate
        // (one in flight at most), and nothing served.
        publish(&ring, &kick, 2);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(gate.batches(), [1]);
        assert_eq!(
            ring.served.load(Ordering::SeqCst),
            0,
            "served before its confirmation"
        );
        // Confirmed: batch 1 goes, and the two that waited make batch 2.
        gate.confirm(1);
        assert!(until(|| gate.batches() == [1, 2]));
        assert_eq!(
            ring.served.load(Ordering::SeqCst),
            1,
            "batch 2 served early"
        );
        gate.confirm(2);
        assert!(until(|| ring.served.load(Ordering::SeqCst) == 3));
        drop(lp);
    }

    #[test]
    fn with_two_in_flight_the_next_batch_does_not_wait_and_a_later_confirmation_releases_both() {
        let (ring, kick, device) = output_device();
        let gate = Confirming::new(2);
        let lp = DeviceEventLoop::start(vec![device], gate.clone(), false).unwrap();
        publish(&ring, &kick, 1);
        assert!(until(|| gate.batches() == [1]));
        // Only what batch 1 does not cover is counted in batch 2.
        publish(&ring, &kick, 3);
        assert!(until(|| gate.batches() == [1, 3]));
        publish(&ring, &kick, 1);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            gate.batches(),
            [1, 3],
            "a third batch while two are unconfirmed"
        );
        assert_eq!(ring.served.load(Ordering::SeqCst), 0);
        // Confirming ticket 2 confirms 1 as well; the waiting one goes next.
        gate.confirm(2);
        assert!(until(|| gate.batches() == [1, 3, 1]));
        assert_eq!(ring.served.load(Ordering::SeqCst), 4);
        drop(lp);
    }

    #[test]
    fn a_new_gate_decides_on_the_outputs_the_old_one_held() {
        let (ring, kick, device) = output_device();
        let gate = Confirming::new(1);
        let lp = DeviceEventLoop::start(vec![device], gate.clone(), false).unwrap();
        publish(&ring, &kick, 2);
        assert!(until(|| gate.batches() == [2]));
        // Protection ends (e.g. `ft stop`): the pass-through gate lets the
        // held outputs go at once.
        lp.set_gate(Arc::new(PassThroughGate)).unwrap();
        assert!(until(|| ring.served.load(Ordering::SeqCst) == 2));
        drop(lp);
    }

    #[test]
    fn a_loop_started_paused_serves_nothing_until_resumed() {
        let (count, kick, device) = counting_device();
        let lp = DeviceEventLoop::start(vec![device], Arc::new(PassThroughGate), true).unwrap();
        kick.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(count.load(Ordering::SeqCst), 0, "served while paused");
        lp.resume().unwrap();
        assert!(
            wait_for(&count, 1),
            "the notification made while paused was lost"
        );
        // Pausing again works as for a loop started running.
        lp.pause().unwrap();
        kick.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(count.load(Ordering::SeqCst), 1, "served while paused");
        lp.resume().unwrap();
        assert!(wait_for(&count, 2));
    }

    #[test]
    fn a_loop_on_a_thread_made_ahead_serves_its_devices_and_an_unused_one_ends() {
        // Made ahead, unused: its thread ends with it.
        let EventLoopAhead { run, thread, .. } = EventLoopAhead::spawn().unwrap();
        drop(run);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !thread.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(thread.is_finished(), "an unused loop thread lingers");

        let ahead = EventLoopAhead::spawn().unwrap();
        // The devices come later, as in a restore.
        std::thread::sleep(Duration::from_millis(20));
        let (count, kick, device) = counting_device();
        let lp = DeviceEventLoop::start_on(ahead, vec![device], Arc::new(PassThroughGate), false)
            .unwrap();
        kick.write(1).unwrap();
        assert!(wait_for(&count, 1), "the loop made ahead did not serve");
        lp.pause().unwrap();
        drop(lp);
    }
}
