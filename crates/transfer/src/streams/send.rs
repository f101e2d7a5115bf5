//! The source's page streams: N − 1 extra connections, one sender thread
//! each, fed full page frames by the pre-copy's thread (which reads the
//! pages into frames as with one stream) and handing each frame back empty
//! once sealed and written: a small pool of frames, no allocation per
//! frame.

use std::net::{Shutdown, TcpStream};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::cancel::Cancel;
use crate::channel::{Auth, Channel};
use crate::error::{Peer, TransferError};
use crate::link::RoundLink;
use crate::message::{Kind, Message};
use crate::net;
use crate::pages::PageFrame;

/// Frames queued per stream beyond the one it writes.
const QUEUED_PER_STREAM: usize = 2;

enum Job {
    Frame(PageFrame, u32),
    EndRound(u32),
}

/// The first failure of any stream.
type Failure = Arc<Mutex<Option<TransferError>>>;

/// The page streams of one migration, while the pre-copy runs.
pub struct PageStreams {
    jobs: Vec<SyncSender<Job>>,
    free: Receiver<PageFrame>,
    free_tx: Sender<PageFrame>,
    frames_made: usize,
    failed: Failure,
    threads: Vec<JoinHandle<()>>,
    sockets: Vec<TcpStream>,
    next: usize,
    /// Page bytes handed to the streams.
    pub bytes: u64,
}

impl PageStreams {
    /// Opens `extra` page streams to the destination at `to` that offered
    /// `session`, each with the full handshake under `key`, and starts their
    /// sender threads. `cancel` shuts them down.
    pub fn open(
        to: &str,
        key: Auth<'_>,
        extra: u32,
        session: u64,
        timeout: Duration,
        cancel: &Cancel,
    ) -> Result<Self, TransferError> {
        let failed: Failure = Arc::new(Mutex::new(None));
        let (free_tx, free) = mpsc::channel();
        let mut streams = PageStreams {
            jobs: Vec::new(),
            free,
            free_tx,
            frames_made: 0,
            failed,
            threads: Vec::new(),
            sockets: Vec::new(),
            next: 0,
            bytes: 0,
        };
        for i in 1..=extra {
            let stream = net::connect(
                to,
                Peer::Destination,
                Some(net::MIGRATION_SOCKET_BUFFER),
                Some(timeout),
            )?;
            cancel.watch_tcp(&stream);
            let _ = stream.set_write_timeout(Some(timeout));
            if let Ok(s) = stream.try_clone() {
                streams.sockets.push(s);
            }
            let mut ch = Channel::connect(stream, key, Peer::Destination)?;
            ch.note_timeout(Some(timeout));
            ch.set_phase(format!("joining page stream {i}"));
            ch.send_msg(&Message::Join { session, stream: i })?;
            ch.set_phase(format!("sending memory (page stream {i})"));
            let (tx, rx) = mpsc::sync_channel(QUEUED_PER_STREAM);
            let free = streams.free_tx.clone();
            let failed = streams.failed.clone();
            let t = std::thread::Builder::new()
                .name(format!("mig-stream-{i}"))
                .spawn(move || sender(ch, rx, free, failed))
                .map_err(|e| TransferError::Memory(format!("cannot start a thread: {e}")))?;
            streams.jobs.push(tx);
            streams.threads.push(t);
        }
        tracing::info!(streams = extra, "live migration: page streams joined");
        Ok(streams)
    }

    fn check(&self) -> Result<(), TransferError> {
        match lock(&self.failed).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// An empty frame: a returned one, a new one while the pool is small,
    /// else the next one a stream hands back.
    fn free_frame(&mut self) -> Result<PageFrame, TransferError> {
        if let Ok(f) = self.free.try_recv() {
            return Ok(f);
        }
        if self.frames_made < self.jobs.len() * (QUEUED_PER_STREAM + 1) {
            self.frames_made += 1;
            return Ok(PageFrame::new());
        }
        loop {
            self.check()?;
            match self.free.recv_timeout(Duration::from_millis(100)) {
                Ok(f) => return Ok(f),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(TransferError::Memory(
                        "the page streams' threads ended".into(),
                    ))
                }
            }
        }
    }

    fn dispatch(&mut self, job: Job, to: usize) -> Result<(), TransferError> {
        if self.jobs[to].send(job).is_err() {
            self.check()?;
            return Err(TransferError::Memory(format!(
                "page stream {}'s thread ended",
                to + 1
            )));
        }
        Ok(())
    }

    /// Hands the full `frame` of round `round` to the next stream and puts
    /// an empty one in its place.
    pub fn send_frame(&mut self, frame: &mut PageFrame, round: u32) -> Result<(), TransferError> {
        self.check()?;
        let empty = self.free_frame()?;
        let full = std::mem::replace(frame, empty);
        self.bytes += full_len(&full);
        let to = self.next;
        self.next = (self.next + 1) % self.jobs.len();
        self.dispatch(Job::Frame(full, round), to)
    }

    /// Ends round `round` on every stream (after the frames queued on it).
    pub fn end_round(&mut self, round: u32) -> Result<(), TransferError> {
        self.check()?;
        for i in 0..self.jobs.len() {
            self.dispatch(Job::EndRound(round), i)?;
        }
        Ok(())
    }

    /// Waits until every stream wrote what it was given and closes them;
    /// the first failure, if any.
    pub fn finish(mut self) -> Result<(), TransferError> {
        self.jobs.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.check()
    }
}

impl Drop for PageStreams {
    fn drop(&mut self) {
        // A failed migration: stop the threads even if they are blocked.
        if !self.threads.is_empty() {
            for s in &self.sockets {
                let _ = s.shutdown(Shutdown::Both);
            }
            self.jobs.clear();
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        }
    }
}

fn full_len(frame: &PageFrame) -> u64 {
    frame.payload_len() as u64
}

fn lock(f: &Failure) -> std::sync::MutexGuard<'_, Option<TransferError>> {
    f.lock().unwrap_or_else(|p| p.into_inner())
}

/// A stream's thread: seals and writes each frame, hands it back empty;
/// after a failure it only hands frames back (the pre-copy's thread finds
/// the failure at its next frame).
fn sender(
    mut ch: Channel<TcpStream>,
    jobs: Receiver<Job>,
    free: Sender<PageFrame>,
    failed: Failure,
) {
    let mut ok = true;
    let mut pages = 0u64;
    for job in jobs {
        let result = match job {
            Job::Frame(mut frame, round) => {
                let r = if ok {
                    pages += frame.count() as u64;
                    ch.send(Kind::Pages, frame.payload(round))
                } else {
                    Ok(())
                };
                frame.clear();
                let _ = free.send(frame);
                r
            }
            Job::EndRound(round) if ok => ch.send_msg(&Message::RoundEnd { round, pages }),
            Job::EndRound(_) => Ok(()),
        };
        if let Err(e) = result {
            if ok {
                tracing::warn!(error = %e, "a page stream failed");
                lock(&failed).get_or_insert(e);
                let _ = ch.stream().shutdown(Shutdown::Both);
            }
            ok = false;
        }
    }
}

/// The pre-copy's link over the main channel and the page streams: frames
/// go to the streams, round ends to all, control on the main channel.
pub struct MultiLink<'a> {
    /// The main connection.
    pub main: &'a mut Channel<TcpStream>,
    /// The page streams.
    pub streams: &'a mut PageStreams,
}

impl RoundLink for MultiLink<'_> {
    fn send_pages(&mut self, payload: &[u8]) -> Result<(), TransferError> {
        self.main.send(Kind::Pages, payload)
    }

    fn send_frame(&mut self, frame: &mut PageFrame, round: u32) -> Result<(), TransferError> {
        self.streams.send_frame(frame, round)
    }

    fn end_round(&mut self, round: u32, pages: u64) -> Result<(), TransferError> {
        self.streams.end_round(round)?;
        self.main.end_round(round, pages)?;
        self.streams.check()
    }

    fn bytes_sent(&self) -> u64 {
        self.main.bytes_sent + self.streams.bytes
    }

    fn set_phase(&mut self, phase: String) {
        RoundLink::set_phase(self.main, phase);
    }
}
