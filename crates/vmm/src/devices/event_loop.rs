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
//!
//! A gate may also answer a batch with a ticket ([`Release::AtTicket`]: an
//! epoch sent to the standby, not yet acknowledged). The loop then keeps
//! the batch *in flight* and goes on serving everything else — other
//! devices' queues, the TAP, the outputs the guest publishes meanwhile
//! (which the gate may send as the next epoch) — and performs in-flight
//! batches in order, each once the gate's [`OutputGate::released`] reached
//! its ticket (the gate's [`OutputGate::release_fds`] wake the loop).

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
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
const RELEASE_TOKEN: u64 = u64::MAX - 2;
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
            let mut lp = Loop::new(devices, gate, timer, epoll);
            lp.arm_timer();
            lp.watch_release_fds();
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

/// A batch the gate answered with a ticket: each device's part, served up
/// to its avail index once the ticket is released.
struct InFlight {
    ticket: u64,
    parts: Vec<(usize, u16)>,
}

struct Loop {
    devices: Vec<LoopDevice>,
    /// Each device's output queue and output kind, if it has one.
    outputs: Vec<Option<(usize, OutputKind)>>,
    gate: Arc<dyn OutputGate>,
    timer: TimerFd,
    epoll: Epoll,
    /// Batches waiting for their tickets, oldest first.
    in_flight: VecDeque<InFlight>,
    /// Per device: the avail index up to which its outputs are in flight
    /// (the next batch starts there).
    claimed: Vec<Option<u16>>,
    /// The gate's release fds the epoll watches.
    watched: Vec<RawFd>,
}

impl Loop {
    fn new(
        devices: Vec<LoopDevice>,
        gate: Arc<dyn OutputGate>,
        timer: TimerFd,
        epoll: Epoll,
    ) -> Self {
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
        let claimed = vec![None; devices.len()];
        Loop {
            devices,
            outputs,
            gate,
            timer,
            epoll,
            in_flight: VecDeque::new(),
            claimed,
            watched: Vec::new(),
        }
    }

    /// Watches what the gate lists in [`OutputGate::release_fds`] (and no
    /// longer what it dropped).
    fn watch_release_fds(&mut self) {
        let fds = self.gate.release_fds();
        for fd in self.watched.iter().filter(|fd| !fds.contains(fd)) {
            // Closed meanwhile (then already gone from the epoll): ignored.
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, *fd, EpollEvent::default());
        }
        for fd in fds.iter().filter(|fd| !self.watched.contains(fd)) {
            if let Err(e) = self.epoll.ctl(
                ControlOperation::Add,
                *fd,
                EpollEvent::new(EventSet::IN, RELEASE_TOKEN),
            ) {
                tracing::error!(error = %e, "device event loop: cannot watch the output gate");
            }
        }
        self.watched = fds;
    }

    /// Stops watching every release fd (the gate is being replaced).
    fn unwatch_release_fds(&mut self) {
        for fd in self.watched.drain(..) {
            let _ = self
                .epoll
                .ctl(ControlOperation::Delete, fd, EpollEvent::default());
        }
    }

    /// Performs, in order, the in-flight batches whose tickets are at most
    /// `upto`; returns how many batches went.
    fn release_tickets(&mut self, upto: u64) -> usize {
        let mut done = 0;
        while self.in_flight.front().is_some_and(|b| b.ticket <= upto) {
            let Some(batch) = self.in_flight.pop_front() else {
                break;
            };
            for (i, limit) in batch.parts {
                self.devices[i]
                    .device
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .serve_outputs_until(limit);
                let still = self
                    .in_flight
                    .iter()
                    .any(|b| b.parts.iter().any(|(d, _)| *d == i));
                if !still {
                    self.claimed[i] = None;
                }
            }
            done += 1;
        }
        done
    }

    /// The gate's release fds woke the loop: perform what it released, then
    /// whatever the guest published meanwhile.
    fn on_released(&mut self) {
        let upto = self.gate.released();
        let done = self.release_tickets(upto);
        self.watch_release_fds();
        if done > 0 {
            self.serve_outputs();
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
            // Beyond what is already in flight.
            let pending = match (pending, self.claimed[i]) {
                (Some(p), Some(claimed)) => {
                    let new = p.limit.wrapping_sub(claimed);
                    (new != 0).then_some(PendingOutputs {
                        limit: p.limit,
                        requests: new.min(p.requests),
                    })
                }
                (p, _) => p,
            };
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
    fn serve_outputs(&mut self) {
        for _ in 0..MAX_BATCHES_IN_A_ROW {
            let batch = self.pending_outputs();
            if batch.is_empty() {
                return;
            }
            let events: Vec<OutputEvent> = batch.iter().map(|b| b.2).collect();
            match self.gate.before_output(&events) {
                Release::AtCheckpoint => return,
                Release::AtTicket(ticket) => {
                    for (i, p, _) in &batch {
                        self.claimed[*i] = Some(p.limit);
                    }
                    self.in_flight.push_back(InFlight {
                        ticket,
                        parts: batch.iter().map(|(i, p, _)| (*i, p.limit)).collect(),
                    });
                }
                Release::Now => {
                    // Whatever is still in flight came first.
                    self.release_tickets(u64::MAX);
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
                // What the old gate released goes; what it did not is
                // handed to the new gate as not yet decided (the device
                // state never showed it served).
                let upto = self.gate.released();
                self.release_tickets(upto);
                self.in_flight.clear();
                self.claimed.iter_mut().for_each(|c| *c = None);
                self.unwatch_release_fds();
                self.gate = gate;
                self.arm_timer();
                self.watch_release_fds();
                let _ = ack.send(());
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
                if data == RELEASE_TOKEN {
                    if !paused {
                        self.on_released();
                    }
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

    /// A device whose output queue the test fills: `avail` published,
    /// `served` served (by the loop, through the gate); its queue 1 only
    /// counts notifications.
    #[derive(Default)]
    struct Ring {
        avail: u16,
        served: u16,
        notified: usize,
    }

    struct Outputs(Arc<Mutex<Ring>>, u32);

    impl VirtioDevice for Outputs {
        fn device_type(&self) -> u32 {
            self.1
        }
        fn name(&self) -> &str {
            "outputs"
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[8, 8]
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
            self.0.lock().unwrap().notified += 1;
        }
        fn output_queue(&self) -> Option<usize> {
            Some(0)
        }
        fn pending_outputs(&self) -> Option<PendingOutputs> {
            let r = self.0.lock().unwrap();
            let requests = r.avail.wrapping_sub(r.served);
            (requests != 0).then_some(PendingOutputs {
                limit: r.avail,
                requests,
            })
        }
        fn serve_outputs_until(&mut self, limit: u16) -> u16 {
            let mut r = self.0.lock().unwrap();
            let n = limit.wrapping_sub(r.served);
            r.served = limit;
            n
        }
        fn reset(&mut self) {}
        fn counters(&self) -> DeviceCounters {
            DeviceCounters::default()
        }
    }

    /// A gate that answers every batch with the next ticket and releases
    /// tickets when the test says (as an epoch's acknowledgement would).
    #[derive(Debug)]
    struct Tickets {
        issued: Mutex<Vec<Vec<OutputEvent>>>,
        released: std::sync::atomic::AtomicU64,
        wake: EventFd,
    }

    impl OutputGate for Tickets {
        fn before_output(&self, batch: &[OutputEvent]) -> Release {
            let mut issued = self.issued.lock().unwrap();
            issued.push(batch.to_vec());
            Release::AtTicket(issued.len() as u64)
        }
        fn release_fds(&self) -> Vec<RawFd> {
            vec![self.wake.as_raw_fd()]
        }
        fn released(&self) -> u64 {
            let _ = self.wake.read();
            self.released.load(Ordering::SeqCst)
        }
    }

    fn wait_until(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting: {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn batches_in_flight_go_in_order_once_released_and_the_loop_serves_on_meanwhile() {
        let disk = Arc::new(Mutex::new(Ring::default()));
        let net = Arc::new(Mutex::new(Ring::default()));
        let mut kicks = Vec::new();
        let mut devices = Vec::new();
        for (ring, kind) in [(&disk, TYPE_BLOCK), (&net, TYPE_NET)] {
            let evts: Vec<EventFd> = (0..2)
                .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
                .collect();
            kicks.push(
                evts.iter()
                    .map(|e| e.try_clone().unwrap())
                    .collect::<Vec<_>>(),
            );
            let device: Arc<Mutex<dyn VirtioDevice>> =
                Arc::new(Mutex::new(Outputs(ring.clone(), kind)));
            devices.push(LoopDevice {
                device,
                queue_events: evts,
            });
        }
        let gate = Arc::new(Tickets {
            issued: Mutex::new(Vec::new()),
            released: std::sync::atomic::AtomicU64::new(0),
            wake: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        });
        let lp = DeviceEventLoop::start(devices, gate.clone(), false).unwrap();
        let issued = || gate.issued.lock().unwrap().len();
        // Two disk requests: epoch 1, in flight.
        disk.lock().unwrap().avail = 2;
        kicks[0][0].write(1).unwrap();
        wait_until("the disk batch's ticket", || issued() == 1);
        // The loop is not held by it: the net device's other queue is
        // served, and its frame gets epoch 2 while epoch 1 is in flight.
        kicks[1][1].write(1).unwrap();
        wait_until("the net device's notification", || {
            net.lock().unwrap().notified == 1
        });
        net.lock().unwrap().avail = 1;
        kicks[1][0].write(1).unwrap();
        wait_until("the frame's ticket", || issued() == 2);
        // A third disk request: only the new one is in its batch.
        disk.lock().unwrap().avail = 3;
        kicks[0][0].write(1).unwrap();
        wait_until("the third request's ticket", || issued() == 3);
        {
            let issued = gate.issued.lock().unwrap();
            assert_eq!(issued[0].len(), 1);
            assert_eq!(issued[0][0].requests, 2);
            assert_eq!(issued[1][0].kind, OutputKind::NetTransmits);
            assert_eq!(issued[2][0].kind, OutputKind::BlockRequests);
            assert_eq!(issued[2][0].requests, 1, "in-flight requests batched again");
        }
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(disk.lock().unwrap().served, 0, "served before its ticket");
        assert_eq!(net.lock().unwrap().served, 0, "served before its ticket");
        // Ticket 1: the first two disk requests only.
        gate.released.store(1, Ordering::SeqCst);
        gate.wake.write(1).unwrap();
        wait_until("ticket 1's requests", || disk.lock().unwrap().served == 2);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(net.lock().unwrap().served, 0, "ticket 2 went early");
        assert_eq!(disk.lock().unwrap().served, 2, "ticket 3 went early");
        // Tickets 2 and 3 at once: in order.
        gate.released.store(3, Ordering::SeqCst);
        gate.wake.write(1).unwrap();
        wait_until("tickets 2 and 3", || {
            net.lock().unwrap().served == 1 && disk.lock().unwrap().served == 3
        });
        assert_eq!(issued(), 3, "a batch was handed to the gate twice");
        drop(lp);
    }
}
