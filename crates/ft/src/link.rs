//! The primary's end of the sync link. No thread sits in a read: whoever
//! waits for an answer reads the socket itself — the device event loop
//! watches it and reads acknowledgements when it is readable
//! ([`Link::poll_acks`]), the initial synchronization blocks in a read —
//! so an acknowledgement costs no extra thread wake-up. The heartbeat
//! thread drains what arrived while nobody read (telling the event loop
//! through [`Link::wake_fd`] when that was an acknowledgement), and notices
//! a standby that went silent or stopped acknowledging.

use std::collections::VecDeque;
use std::io::{BufReader, BufWriter};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use transfer::channel::Channel;
use transfer::link::RoundLink;
use transfer::message::{Kind, Message};
use transfer::{Peer, TransferError};
use vmm_sys_util::eventfd::EventFd;

use crate::gate::FtGate;

type Writer = Channel<BufWriter<TcpStream>>;
type Reader = (Channel<BufReader<TcpStream>>, Vec<u8>);

/// The primary's end of the link to its standby.
pub struct Link {
    writer: Mutex<Writer>,
    reader: Mutex<Reader>,
    socket: TcpStream,
    closed: AtomicBool,
    last_sent: Mutex<Instant>,
    last_heard: Mutex<Instant>,
    /// Answers read so far, by whichever thread read them.
    acked: AtomicU64,
    round_acked: AtomicU32,
    timeout: Duration,
    /// Written when the heartbeat thread read an acknowledgement (the
    /// event loop, watching the socket, may have slept through it).
    wake: EventFd,
    /// Whether `wake` was written since the event loop last read it (so it
    /// reads it only then: one system call less per acknowledgement).
    woken: AtomicBool,
    /// Epochs sent and not yet acknowledged, with when they were sent.
    unacked: Mutex<VecDeque<(u64, Instant)>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("closed", &self.closed.load(Ordering::SeqCst))
            .finish()
    }
}

impl Link {
    /// Splits an authenticated channel whose offer the standby accepted
    /// into the link's halves and starts the heartbeat thread; `on_lost`
    /// is told when the standby stops answering while no sync waits for
    /// it.
    pub fn start(
        channel: Channel<TcpStream>,
        heartbeat: Duration,
        timeout: Duration,
        on_lost: Arc<OnceLock<Weak<FtGate>>>,
    ) -> Result<Arc<Link>, TransferError> {
        let io = |e| TransferError::io(Peer::Standby, "setting up the sync link", None, e);
        let socket = channel.stream().try_clone().map_err(io)?;
        socket.set_read_timeout(Some(timeout)).map_err(io)?;
        socket.set_write_timeout(Some(timeout)).map_err(io)?;
        let (mut reader, mut writer) = channel.split(|s| {
            Ok((
                BufReader::with_capacity(64 << 10, s.try_clone()?),
                BufWriter::with_capacity(1 << 20, s),
            ))
        })?;
        reader.note_timeout(Some(timeout));
        writer.note_timeout(Some(timeout));
        let link = Arc::new(Link {
            writer: Mutex::new(writer),
            reader: Mutex::new((reader, Vec::new())),
            socket,
            closed: AtomicBool::new(false),
            last_sent: Mutex::new(Instant::now()),
            last_heard: Mutex::new(Instant::now()),
            acked: AtomicU64::new(0),
            round_acked: AtomicU32::new(0),
            timeout,
            wake: EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC).map_err(io)?,
            woken: AtomicBool::new(false),
            unacked: Mutex::new(VecDeque::new()),
        });
        let beat = Arc::downgrade(&link);
        std::thread::Builder::new()
            .name("ft-heartbeat".into())
            .spawn(move || heartbeat_loop(&beat, heartbeat, &on_lost))
            .map_err(io)?;
        Ok(link)
    }

    /// The socket (to shut down on cancel).
    pub fn socket(&self) -> &TcpStream {
        &self.socket
    }

    /// Sends what `f` writes, as one flush; returns the payload bytes.
    pub fn send(
        &self,
        f: impl FnOnce(&mut Writer) -> Result<(), TransferError>,
    ) -> Result<u64, TransferError> {
        let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let before = w.bytes_sent;
        f(&mut w)?;
        w.flush()?;
        *self.last_sent.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        Ok(w.bytes_sent - before)
    }

    /// Sends a control message.
    pub fn send_msg(&self, msg: &Message) -> Result<u64, TransferError> {
        self.send(|w| w.send_msg(msg))
    }

    /// Reads one frame (the lock is held); heartbeats only refresh
    /// `last_heard`. An acknowledgement writes [`wake_fd`](Self::wake_fd)
    /// if `tell` (read by a thread the event loop does not wait for).
    fn read_one(&self, reader: &mut Reader, tell: bool) -> Result<(), TransferError> {
        let (ch, buf) = reader;
        let msg = ch.recv_msg(buf)?;
        *self.last_heard.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        match msg {
            Message::Ack { epoch } => {
                self.acked.fetch_max(epoch, Ordering::SeqCst);
                if tell {
                    self.wake_loop();
                }
                Ok(())
            }
            Message::RoundAck { round } => {
                self.round_acked.fetch_max(round, Ordering::SeqCst);
                Ok(())
            }
            Message::Heartbeat => Ok(()),
            other => Err(ch.unexpected("an acknowledgement or a heartbeat", other)),
        }
    }

    /// Waits until the standby's answers satisfy `done`, up to the timeout
    /// (answers the heartbeat thread read meanwhile count too).
    pub fn wait(
        &self,
        what: &'static str,
        done: impl Fn(&Link) -> bool,
    ) -> Result<(), TransferError> {
        let mut reader = self.reader.lock().unwrap_or_else(|p| p.into_inner());
        reader.0.set_phase(what);
        let deadline = Instant::now() + self.timeout;
        loop {
            if done(self) {
                return Ok(());
            }
            if self.closed.load(Ordering::SeqCst) {
                return Err(TransferError::Closed {
                    peer: Peer::Standby,
                    phase: what.into(),
                });
            }
            self.read_one(&mut reader, false)?;
            if Instant::now() >= deadline {
                return Err(TransferError::Timeout {
                    peer: Peer::Standby,
                    phase: what.into(),
                    after: self.timeout,
                });
            }
        }
    }

    /// The last epoch the standby acknowledged.
    pub fn acked(&self) -> u64 {
        self.acked.load(Ordering::SeqCst)
    }

    /// Reads whatever complete frames wait, without blocking for more
    /// (unless another thread is reading: then it hears the standby
    /// itself). `tell`: see [`read_one`](Self::read_one).
    fn drain(&self, tell: bool) -> Result<(), TransferError> {
        let Ok(mut reader) = self.reader.try_lock() else {
            return Ok(());
        };
        let mut read = false;
        while !reader.0.stream().buffer().is_empty()
            || transfer::sys::bytes_waiting(self.socket.as_fd()) > 0
        {
            self.read_one(&mut reader, tell)?;
            read = true;
        }
        // A socket readable with nothing to read is at its end (checked
        // only then: a system call less per acknowledgement).
        if !read && transfer::sys::peer_closed(self.socket.as_fd()) {
            return Err(TransferError::Closed {
                peer: Peer::Standby,
                phase: "waiting for the standby's acknowledgements".into(),
            });
        }
        Ok(())
    }

    /// For the device event loop, when the socket or
    /// [`wake_fd`](Self::wake_fd) is readable: reads the acknowledgements
    /// that arrived, without blocking; returns the last epoch acknowledged.
    /// Fails if the standby closed the link.
    pub fn poll_acks(&self) -> Result<u64, TransferError> {
        if self.woken.swap(false, Ordering::SeqCst) {
            let _ = self.wake.read();
        }
        self.drain(false)?;
        Ok(self.acked())
    }

    /// The socket, readable when the standby answered.
    pub fn socket_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }

    /// Readable when the heartbeat thread read an acknowledgement.
    pub fn wake_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    /// Epoch `epoch` was sent now; its acknowledgement is due within the
    /// timeout.
    pub fn note_sent(&self, epoch: u64) {
        self.unacked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back((epoch, Instant::now()));
    }

    /// The oldest epoch not acknowledged within the timeout, if any.
    fn overdue(&self) -> Option<u64> {
        let acked = self.acked();
        let mut unacked = self.unacked.lock().unwrap_or_else(|p| p.into_inner());
        while unacked.front().is_some_and(|(e, _)| *e <= acked) {
            unacked.pop_front();
        }
        unacked
            .front()
            .filter(|(_, at)| at.elapsed() > self.timeout)
            .map(|(e, _)| *e)
    }

    /// Closes the link (a blocked read or write returns at once).
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _ = self.socket.shutdown(Shutdown::Both);
        self.wake_loop();
    }

    /// Written before it is flagged: a loop that sees the flag finds the
    /// count to read; one that missed it is woken again by the count.
    fn wake_loop(&self) {
        let _ = self.wake.write(1);
        self.woken.store(true, Ordering::SeqCst);
    }

    /// Payload bytes sent.
    pub fn bytes(&self) -> u64 {
        self.writer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .bytes_sent
    }
}

/// The pre-copy of the initial synchronization over the link.
impl RoundLink for &Link {
    fn send_pages(&mut self, payload: &[u8]) -> Result<(), TransferError> {
        self.send(|w| w.send(Kind::Pages, payload)).map(drop)
    }

    fn end_round(&mut self, round: u32, pages: u64) -> Result<(), TransferError> {
        self.send_msg(&Message::RoundEnd { round, pages })?;
        self.wait(
            "waiting for the standby to acknowledge a pre-copy round",
            |l| l.round_acked.load(Ordering::SeqCst) >= round,
        )
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes()
    }

    fn set_phase(&mut self, phase: String) {
        self.writer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .set_phase(phase);
    }
}

/// Sends heartbeats when the link is idle and notices a standby that went
/// silent between syncs.
fn heartbeat_loop(link: &Weak<Link>, every: Duration, on_lost: &OnceLock<Weak<FtGate>>) {
    loop {
        std::thread::sleep(every);
        let Some(link) = link.upgrade() else { return };
        if link.closed.load(Ordering::SeqCst) {
            return;
        }
        let idle = link
            .last_sent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed();
        let mut lost = None;
        if idle >= every {
            if let Err(e) = link.send_msg(&Message::Heartbeat) {
                lost = Some(e.to_string());
            }
        }
        if lost.is_none() {
            if let Err(e) = link.drain(true) {
                lost = Some(e.to_string());
            }
        }
        if lost.is_none() {
            if let Some(epoch) = link.overdue() {
                lost = Some(format!(
                    "the standby did not acknowledge epoch {epoch} within {} ms",
                    link.timeout.as_millis()
                ));
            }
        }
        let silent = link
            .last_heard
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed();
        if lost.is_none() && silent > link.timeout && link.reader.try_lock().is_ok() {
            lost = Some(format!(
                "no frame from the standby for {} ms",
                silent.as_millis()
            ));
        }
        if let Some(why) = lost {
            match on_lost.get().and_then(Weak::upgrade) {
                Some(gate) => gate.degrade(&why),
                // Still in the initial synchronization: it fails by itself.
                None => link.close(),
            }
            return;
        }
    }
}
