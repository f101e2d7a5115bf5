//! The device event loop: one thread per VM that serves virtio queue
//! notifications (ioeventfds, so a guest kick costs no exit to userspace) and
//! backend readiness (TAP fds). It can be paused like a vCPU, so that snapshots
//! and synchronization see devices at rest.
//!
//! It is also the output hook point (see [`crate::output`]): a device's output
//! queue is served only after the [`OutputGate`] released the batch of
//! requests pending on every device's output queue, and only up to what the
//! batch held. With a gate that checkpoints periodically, the loop runs the
//! checkpoints from a timer and releases held outputs after each.

use std::os::fd::AsRawFd;
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
            let mut lp = Loop::new(devices, gate, timer);
            lp.arm_timer();
            lp.run(epoll, ctl, rx, paused)
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

struct Loop {
    devices: Vec<LoopDevice>,
    /// Each device's output queue and output kind, if it has one.
    outputs: Vec<Option<(usize, OutputKind)>>,
    gate: Arc<dyn OutputGate>,
    timer: TimerFd,
}

impl Loop {
    fn new(devices: Vec<LoopDevice>, gate: Arc<dyn OutputGate>, timer: TimerFd) -> Self {
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
            gate,
            timer,
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

    /// A guest published outputs: pass them through the gate batch by batch.
    fn serve_outputs(&self) {
        for _ in 0..MAX_BATCHES_IN_A_ROW {
            let batch = self.pending_outputs();
            if batch.is_empty() {
                return;
            }
            let events: Vec<OutputEvent> = batch.iter().map(|b| b.2).collect();
            if self.gate.before_output(&events) == Release::AtCheckpoint {
                return;
            }
            if self.release(&batch) == 0 {
                // A ring that cannot be served (corrupt indices): the device
                // counted it; wait for the guest's next kick.
                return;
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
    fn checkpoint(&self) {
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
                self.gate = gate;
                self.arm_timer();
                let _ = ack.send(());
            }
            Request::Exit => return false,
        }
        true
    }

    fn run(
        &mut self,
        epoll: Epoll,
        control: EventFd,
        requests: Receiver<Request>,
        mut paused: bool,
    ) {
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
            let n = match epoll.wait(-1, &mut events) {
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

    /// A device that only counts the notifications the loop hands it.
    struct Counting(Arc<AtomicUsize>);

    impl VirtioDevice for Counting {
        fn device_type(&self) -> u32 {
            TYPE_NET
        }
        fn name(&self) -> &str {
            "counting"
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[8]
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
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        fn reset(&mut self) {}
        fn counters(&self) -> DeviceCounters {
            DeviceCounters::default()
        }
    }

    fn wait_for(count: &AtomicUsize, want: usize) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if count.load(Ordering::SeqCst) == want {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    /// A device counting its queue notifications: the count, the eventfd
    /// that notifies it, and the device as the loop takes it.
    fn counting_device() -> (Arc<AtomicUsize>, EventFd, LoopDevice) {
        let count = Arc::new(AtomicUsize::new(0));
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let kick = evt.try_clone().unwrap();
        let device: Arc<Mutex<dyn VirtioDevice>> = Arc::new(Mutex::new(Counting(count.clone())));
        let loop_device = LoopDevice {
            device,
            queue_events: vec![evt],
        };
        (count, kick, loop_device)
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
