//! The device event loop: one thread per VM that serves virtio queue
//! notifications (ioeventfds, so a guest kick costs no exit to userspace) and
//! backend readiness (TAP fds). It can be paused like a vCPU, so that snapshots
//! and synchronization see devices at rest.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::virtio::VirtioDevice;

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
    Exit,
}

const CONTROL_TOKEN: u64 = u64::MAX;
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

impl DeviceEventLoop {
    /// Starts the loop over `devices`.
    pub fn start(devices: Vec<LoopDevice>) -> Result<Self, EventLoopError> {
        let epoll = Epoll::new().map_err(EventLoopError::Setup)?;
        let control = EventFd::new(libc::EFD_NONBLOCK).map_err(EventLoopError::Setup)?;
        epoll
            .ctl(
                ControlOperation::Add,
                control.as_raw_fd(),
                EpollEvent::new(EventSet::IN, CONTROL_TOKEN),
            )
            .map_err(EventLoopError::Setup)?;
        let mut backends: Vec<Option<RawFd>> = Vec::new();
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
            backends.push(fd);
        }
        let (tx, rx) = channel();
        let ctl = control.try_clone().map_err(EventLoopError::Setup)?;
        let thread = std::thread::Builder::new()
            .name("devices".into())
            .spawn(move || run(epoll, ctl, rx, devices))
            .map_err(EventLoopError::Setup)?;
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
}

impl Drop for DeviceEventLoop {
    fn drop(&mut self) {
        let _ = self.send(Request::Exit);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(epoll: Epoll, control: EventFd, requests: Receiver<Request>, devices: Vec<LoopDevice>) {
    let mut events = vec![EpollEvent::default(); 64];
    let mut paused = false;
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
                    match req {
                        Request::Pause(ack) => {
                            paused = true;
                            let _ = ack.send(());
                        }
                        Request::Resume => paused = false,
                        Request::Exit => return,
                    }
                }
                continue;
            }
            let (dev, queue) = ((data >> 16) as usize, data & 0xffff);
            let Some(d) = devices.get(dev) else { continue };
            if queue == BACKEND_QUEUE {
                d.device
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .backend_ready();
            } else if let Some(evt) = d.queue_events.get(queue as usize) {
                let _ = evt.read();
                d.device
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .queue_notified(queue as usize);
            }
        }
    }
}
