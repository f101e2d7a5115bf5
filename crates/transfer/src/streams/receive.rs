//! The destination's page streams: the listener stays open after the main
//! connection until the offered streams joined (or a timeout), then closes;
//! a connection that fails the handshake or shows another session is
//! refused. One thread per stream writes its page batches into memory and
//! reports each round end ([`RoundTally`]).

use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm::memory::GuestMemoryFile;

use super::tally::{RoundStatus, RoundTally, StreamEvent};
use crate::channel::{Auth, Channel};
use crate::error::{Peer, TransferError};
use crate::message::{Kind, Message};
use crate::net;
use crate::pages::{write_batch, PageError};

/// How long a joining connection may take over its handshake.
const JOIN_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The listener a live-migration destination keeps for the page streams.
pub struct Joiner<'k> {
    listener: TcpListener,
    key: Auth<'k>,
    timeout: Duration,
}

impl<'k> Joiner<'k> {
    /// Streams join on `listener` (the one the main connection came on),
    /// with `key`, within `timeout`.
    pub fn new(listener: TcpListener, key: Auth<'k>, timeout: Duration) -> Self {
        Joiner {
            listener,
            key,
            timeout,
        }
    }

    /// Accepts the `extra` page streams of `session` and starts a thread
    /// per stream writing its pages into `memory`. The listener closes
    /// when this returns.
    pub fn join(
        self,
        extra: u32,
        session: u64,
        memory: &GuestMemoryFile,
    ) -> Result<ReceivingStreams, TransferError> {
        let mut joined: Vec<Option<Channel<TcpStream>>> = (0..extra).map(|_| None).collect();
        let deadline = Instant::now() + self.timeout;
        self.listener
            .set_nonblocking(true)
            .map_err(|e| TransferError::io(Peer::Source, "accepting page streams", None, e))?;
        while joined.iter().any(Option::is_none) {
            let stream = match self.listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let n = joined.iter().filter(|j| j.is_some()).count();
                        return Err(TransferError::Mismatch(format!(
                            "only {n} of the {extra} page streams the source offered joined within {} s",
                            self.timeout.as_secs()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => {
                    return Err(TransferError::io(
                        Peer::Source,
                        "accepting page streams",
                        None,
                        e,
                    ))
                }
            };
            match self.admit(stream, session, extra) {
                Ok((i, ch)) if joined[i].is_none() => joined[i] = Some(ch),
                Ok((i, _)) => tracing::warn!(stream = i + 1, "refused a page stream joined twice"),
                Err(e) => {
                    tracing::warn!(error = %e, "refused a connection while page streams join")
                }
            }
        }
        drop(self.listener);
        let (events_tx, events) = mpsc::channel();
        let mut streams = ReceivingStreams {
            tally: RoundTally::new(extra as usize),
            events,
            threads: Vec::new(),
            sockets: Vec::new(),
        };
        for (i, ch) in joined.into_iter().flatten().enumerate() {
            let _ = ch.stream().set_read_timeout(Some(self.timeout));
            if let Ok(s) = ch.stream().try_clone() {
                streams.sockets.push(s);
            }
            let memory = memory.clone();
            let tx = events_tx.clone();
            let t = std::thread::Builder::new()
                .name(format!("mig-stream-{}", i + 1))
                .spawn(move || receiver(i, ch, memory, tx))
                .map_err(|e| TransferError::Memory(format!("cannot start a thread: {e}")))?;
            streams.threads.push(t);
        }
        tracing::info!(streams = extra, "live migration: page streams joined");
        Ok(streams)
    }

    /// The handshake and `Join` of one connection: its stream index.
    fn admit(
        &self,
        stream: TcpStream,
        session: u64,
        extra: u32,
    ) -> Result<(usize, Channel<TcpStream>), TransferError> {
        let io = |e| TransferError::io(Peer::Source, "accepting a page stream", None, e);
        stream.set_nonblocking(false).map_err(io)?;
        net::tune(
            &stream,
            Peer::Source,
            Some((
                crate::sys::SocketBuffer::Receive,
                net::MIGRATION_SOCKET_BUFFER,
            )),
            Some(JOIN_HANDSHAKE_TIMEOUT),
        )?;
        let mut ch = Channel::accept(stream, self.key, Peer::Source)?;
        ch.set_phase("waiting for a page stream to join");
        let mut buf = Vec::new();
        if ch.recv(&mut buf)? != Kind::Control {
            return Err(ch.malformed("a page stream's first frame is not Join"));
        }
        match serde_json::from_slice(&buf) {
            Ok(Message::Join { session: s, stream }) if s == session => {
                if stream == 0 || stream > extra {
                    return Err(ch.malformed(format!("page stream {stream} of {extra}")));
                }
                Ok((stream as usize - 1, ch))
            }
            Ok(Message::Join { .. }) => Err(TransferError::Mismatch(
                "a connection joined another migration's session".into(),
            )),
            _ => Err(ch.malformed("a page stream's first frame is not Join")),
        }
    }
}

/// The destination's page streams while the pre-copy runs.
pub struct ReceivingStreams {
    tally: RoundTally,
    events: Receiver<StreamEvent>,
    threads: Vec<JoinHandle<()>>,
    sockets: Vec<TcpStream>,
}

impl ReceivingStreams {
    /// Waits until every stream ended round `round` (its pages are all in
    /// memory), or one ended before it did.
    pub fn wait_round(&mut self, round: u32, timeout: Duration) -> Result<(), TransferError> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.tally.status(round) {
                RoundStatus::Complete => return Ok(()),
                RoundStatus::Failed(why) => return Err(stream_failed(why)),
                RoundStatus::Pending => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(ev) => self.tally.note(ev).map_err(stream_failed)?,
                Err(_) => {
                    return Err(stream_failed(format!(
                        "round {round} did not end on every page stream within {} s",
                        timeout.as_secs()
                    )))
                }
            }
        }
    }

    /// A stream's failure reported so far, if any (to name the cause when
    /// the main connection broke because of it).
    pub fn failure(&mut self) -> Option<TransferError> {
        while let Ok(ev) = self.events.try_recv() {
            let _ = self.tally.note(ev);
        }
        self.tally
            .failure()
            .filter(|f| !f.contains("closed by the source"))
            .map(stream_failed)
    }
}

impl Drop for ReceivingStreams {
    fn drop(&mut self) {
        // The pre-copy is over (or failed): the source closes its streams;
        // shut them down here too so that no thread waits on one.
        for s in &self.sockets {
            let _ = s.shutdown(Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn stream_failed(why: String) -> TransferError {
    TransferError::Stream { detail: why }
}

/// A stream's thread: writes each batch into memory, reports round ends,
/// and how the stream ended.
fn receiver(
    index: usize,
    mut ch: Channel<TcpStream>,
    memory: GuestMemoryFile,
    events: Sender<StreamEvent>,
) {
    ch.set_phase("receiving memory (page stream)");
    let mut buf = Vec::new();
    let reason = loop {
        match ch.recv(&mut buf) {
            Ok(Kind::Pages) => {
                if let Err(e) = write_batch(memory.file(), memory.size(), &buf) {
                    break match e {
                        PageError::Malformed(d) => format!("a malformed page batch: {d}"),
                        PageError::Io(e) => format!("writing guest memory: {e}"),
                    };
                }
            }
            Ok(Kind::Control) => match serde_json::from_slice(&buf) {
                Ok(Message::RoundEnd { round, .. }) => {
                    if events
                        .send(StreamEvent::RoundEnded {
                            stream: index,
                            round,
                        })
                        .is_err()
                    {
                        return;
                    }
                }
                _ => break "an unexpected control message".to_owned(),
            },
            Ok(other) => break format!("an unexpected {other:?} frame"),
            Err(TransferError::Closed { .. }) => break "closed by the source".to_owned(),
            Err(e) => break e.to_string(),
        }
    };
    tracing::debug!(stream = index + 1, reason, "page stream ended");
    let _ = events.send(StreamEvent::Closed {
        stream: index,
        reason,
    });
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use vmm::memory::MemoryBacking;

    use super::*;
    use crate::pages::{encode_pages, PageData, PAGE};

    const KEY: &[u8] = b"kemari-stream-test-key-0123456789";

    fn join_stream(addr: &str, key: &[u8], session: u64, stream: u32) -> Channel<TcpStream> {
        let s = TcpStream::connect(addr).unwrap();
        let mut ch = Channel::connect(s, Auth::Psk(key), Peer::Destination).unwrap();
        ch.send_msg(&Message::Join { session, stream }).unwrap();
        ch
    }

    /// Over real loopback TCP: strangers are refused while the streams
    /// join, each stream's pages land in memory, a round completes only
    /// once it ended on every stream, and a stream closed before a round
    /// ended fails that round.
    #[test]
    fn streams_join_write_pages_and_fail_a_round_when_one_ends_early() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let memory = GuestMemoryFile::create(16 << 20, &MemoryBacking::Memfd).unwrap();
        let mem2 = memory.clone();
        let joiner = std::thread::spawn(move || {
            Joiner::new(listener, Auth::Psk(KEY), Duration::from_secs(20)).join(2, 7, &mem2)
        });
        // Another key: refused in the handshake.
        let s = TcpStream::connect(&addr).unwrap();
        assert!(
            Channel::connect(s, Auth::Psk(b"another-key-0123456789"), Peer::Destination).is_err()
        );
        // The right key but another migration's session: dropped.
        let mut stranger = join_stream(&addr, KEY, 8, 1);
        let mut s1 = join_stream(&addr, KEY, 7, 1);
        let mut s2 = join_stream(&addr, KEY, 7, 2);
        let mut streams = joiner.join().unwrap().unwrap();
        assert!(
            stranger.recv(&mut Vec::new()).is_err(),
            "the stranger was refused"
        );

        let page = vec![0xa5u8; PAGE];
        let mut batch = Vec::new();
        encode_pages(1, &[(3, PageData::Data(&page))], &mut batch);
        s1.send(Kind::Pages, &batch).unwrap();
        s1.send_msg(&Message::RoundEnd { round: 1, pages: 1 })
            .unwrap();
        s2.send_msg(&Message::RoundEnd { round: 1, pages: 0 })
            .unwrap();
        streams.wait_round(1, Duration::from_secs(20)).unwrap();
        let mut got = vec![0u8; PAGE];
        memory
            .file()
            .read_exact_at(&mut got, 3 * PAGE as u64)
            .unwrap();
        assert_eq!(
            got, page,
            "round 1's page is in memory once the round ended"
        );

        s1.send_msg(&Message::RoundEnd { round: 2, pages: 1 })
            .unwrap();
        drop(s2);
        let e = streams.wait_round(2, Duration::from_secs(20)).unwrap_err();
        assert!(e.to_string().contains("page stream 2"), "{e}");
    }
}
