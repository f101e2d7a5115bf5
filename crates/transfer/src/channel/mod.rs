//! The channel every hand-over speaks over: the handshake of
//! [`handshake`] (version, link protection, proof of the pre-shared key),
//! then framed frames — encrypted ([`sealed`]: Noise, AES-256-GCM), or
//! authenticated with BLAKE3 keyed tags on a trusted dedicated link, or bare
//! on a local Unix socket — and, over a Unix socket, fds riding on a frame
//! (zero-copy migration, warm restart). Pure over any `Read + Write`, so it
//! is unit-tested and fuzzed without sockets.
//!
//! A plain or tagged frame is `[len u32][kind u8][payload][tag 32 B]`,
//! `tag = BLAKE3-keyed(key, payload ‖ side ‖ sequence ‖ kind)` (none on a
//! local channel).

mod fds;
mod handshake;
mod sealed;
mod transport;

pub use fds::{FdRead, FdWrite, MAX_FDS};
use handshake::Protection;
pub use handshake::{Auth, Side, MAGIC};

use std::borrow::Cow;
use std::fs::File;
use std::io::{IoSlice, Read, Write};
use std::os::fd::RawFd;
use std::time::Duration;

use serde::Serialize;

use crate::error::{Peer, TransferError};
use crate::message::{Kind, Message};

/// Largest frame payload accepted.
pub const MAX_PAYLOAD: usize = 64 << 20;
const TAG_LEN: usize = 32;

/// An authenticated, framed channel over a byte stream.
pub struct Channel<S> {
    stream: S,
    /// Fds received with frames, until taken.
    fds_in: Vec<File>,
    protection: Protection,
    me: Side,
    peer: Peer,
    phase: Cow<'static, str>,
    timeout: Option<Duration>,
    /// Frames sent and received (the sequence in a tag).
    sent: u64,
    received: u64,
    /// Noise messages sent and received (the nonces of an encrypted link).
    sealed_sent: u64,
    sealed_received: u64,
    /// Buffers of an encrypted link, reused.
    wire: Vec<u8>,
    scratch: Vec<u8>,
    /// Payload bytes sent (for progress reports).
    pub bytes_sent: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// A local initiator reads the acceptor's hello before its first frame.
    hello_pending: bool,
}

/// The payload comes first: BLAKE3 hashes the widest SIMD batches only from
/// a chunk-aligned start (a 10-byte prefix made a 57 KB page frame's tag 27%
/// slower here). The fixed-size suffix keeps the message unambiguous.
fn tag(key: &[u8; 32], side: Side, seq: u64, kind: u8, payload: &[u8]) -> [u8; TAG_LEN] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(payload);
    let mut suffix = [0u8; 10];
    suffix[0] = side as u8;
    suffix[1..9].copy_from_slice(&seq.to_le_bytes());
    suffix[9] = kind;
    h.update(&suffix);
    *h.finalize().as_bytes()
}

fn write_all_vectored(
    stream: &mut impl Write,
    mut bufs: &mut [IoSlice<'_>],
) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match stream.write_vectored(bufs) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl<S: Read + Write> Channel<S> {
    /// The initiator's handshake, with the `peer` (for messages).
    pub fn connect(mut stream: S, auth: Auth<'_>, peer: Peer) -> Result<Self, TransferError> {
        let protection = handshake::initiate(&mut stream, auth, peer)?;
        let mut ch = Self::new(stream, protection, Side::Initiator, peer);
        ch.hello_pending = matches!(auth, Auth::Local);
        Ok(ch)
    }

    /// The acceptor's handshake, with the `peer` (for messages).
    pub fn accept(mut stream: S, auth: Auth<'_>, peer: Peer) -> Result<Self, TransferError> {
        let protection = handshake::accept(&mut stream, auth, peer)?;
        Ok(Self::new(stream, protection, Side::Acceptor, peer))
    }
}

impl<S> Channel<S> {
    /// A local channel over `stream` without a handshake: for the fuzzers
    /// of the frame reader only.
    #[doc(hidden)]
    pub fn over_stream_for_fuzzing(stream: S) -> Self {
        Self::new(stream, Protection::None, Side::Acceptor, Peer::Source)
    }

    fn new(stream: S, protection: Protection, me: Side, peer: Peer) -> Self {
        Channel {
            stream,
            fds_in: Vec::new(),
            protection,
            me,
            peer,
            phase: Cow::Borrowed("starting"),
            timeout: None,
            sent: 0,
            received: 0,
            sealed_sent: 0,
            sealed_received: 0,
            wire: Vec::new(),
            scratch: Vec::new(),
            bytes_sent: 0,
            bytes_received: 0,
            hello_pending: false,
        }
    }

    /// Whether frames are encrypted.
    pub fn is_encrypted(&self) -> bool {
        matches!(self.protection, Protection::Encrypted(_))
    }

    /// The underlying stream.
    pub fn stream(&self) -> &S {
        &self.stream
    }

    /// The other end.
    pub fn peer(&self) -> Peer {
        self.peer
    }

    /// What this end is doing now, for error messages ("sending memory
    /// (round 2)").
    pub fn set_phase(&mut self, phase: impl Into<Cow<'static, str>>) {
        self.phase = phase.into();
    }

    /// The phase set last.
    pub fn phase(&self) -> &str {
        &self.phase
    }

    /// Remembers the read timeout set on the stream, for error messages.
    pub fn note_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// Maps an I/O error on the stream, in the current phase.
    pub fn io_error(&self, e: std::io::Error) -> TransferError {
        TransferError::io(self.peer, &self.phase, self.timeout, e)
    }

    /// A malformed-frame error, in the current phase.
    pub fn malformed(&self, detail: impl Into<String>) -> TransferError {
        TransferError::Malformed {
            peer: self.peer,
            phase: self.phase.to_string(),
            detail: detail.into(),
        }
    }

    fn tag_len(&self) -> usize {
        if let Protection::Tagged(_) = self.protection {
            TAG_LEN
        } else {
            0
        }
    }

    /// Splits the channel into a receiving and a sending half over the two
    /// halves `split` makes of the stream (each direction keeps its own
    /// sequence and nonces, so the halves may be used from different
    /// threads).
    pub fn split<R, W>(
        self,
        split: impl FnOnce(S) -> std::io::Result<(R, W)>,
    ) -> Result<(Channel<R>, Channel<W>), TransferError> {
        let (peer, phase, timeout) = (self.peer, self.phase.clone(), self.timeout);
        let (r, w) = split(self.stream).map_err(|e| TransferError::io(peer, &phase, timeout, e))?;
        let me = self.me;
        let mut rx = Channel::new(r, self.protection.clone(), me, peer);
        rx.phase = phase.clone();
        rx.timeout = timeout;
        rx.received = self.received;
        rx.sealed_received = self.sealed_received;
        rx.bytes_received = self.bytes_received;
        let mut tx = Channel::new(w, self.protection, me, peer);
        tx.phase = phase;
        tx.timeout = timeout;
        tx.sent = self.sent;
        tx.sealed_sent = self.sealed_sent;
        tx.bytes_sent = self.bytes_sent;
        Ok((rx, tx))
    }

    fn frame_heads(&self, frames: &[(Kind, &[u8])]) -> Vec<([u8; 5], [u8; TAG_LEN])> {
        frames
            .iter()
            .zip(self.sent..)
            .map(|(&(kind, payload), seq)| {
                let mut head = [0u8; 5];
                head[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
                head[4] = kind as u8;
                let t = match &self.protection {
                    Protection::Tagged(key) => tag(key, self.me, seq, kind as u8, payload),
                    _ => [0; TAG_LEN],
                };
                (head, t)
            })
            .collect()
    }

    fn check_tag(&self, kind: u8, payload: &[u8], got: &[u8]) -> Result<(), TransferError> {
        let Protection::Tagged(key) = &self.protection else {
            return Ok(());
        };
        let expected = tag(key, self.me.other(), self.received, kind, payload);
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(got);
        // Constant-time comparison.
        if blake3::Hash::from(expected) != blake3::Hash::from(t) {
            return Err(self.unauthentic());
        }
        Ok(())
    }

    fn unauthentic(&self) -> TransferError {
        TransferError::Authentication {
            peer: self.peer,
            phase: self.phase.to_string(),
        }
    }

    /// Seals `frames` into `self.wire` (an encrypted link).
    fn seal(&mut self, frames: &[(Kind, &[u8])]) -> Result<(), TransferError> {
        let Protection::Encrypted(t) = &self.protection else {
            return Ok(());
        };
        self.wire.clear();
        for &(kind, payload) in frames {
            sealed::seal(t, &mut self.sealed_sent, kind, payload, &mut self.wire);
        }
        Ok(())
    }

    /// Checks and decodes a received control frame.
    fn decode_message(&self, kind: Kind, buf: &[u8]) -> Result<Message, TransferError> {
        match kind {
            Kind::Control => {
                serde_json::from_slice(buf).map_err(|e| self.malformed(format!("message: {e}")))
            }
            other => Err(TransferError::Unexpected {
                peer: self.peer,
                phase: self.phase.to_string(),
                got: format!("a {other:?} frame"),
                expected: "a control message",
            }),
        }
    }

    /// The error for message `got` where `expected` was due: the peer's own
    /// reason if it gave up.
    pub fn unexpected(&self, expected: &'static str, got: Message) -> TransferError {
        match got {
            Message::Failed { reason } => TransferError::Refused {
                peer: self.peer,
                reason,
            },
            other => TransferError::Unexpected {
                peer: self.peer,
                phase: self.phase.to_string(),
                got: other.name().to_owned(),
                expected,
            },
        }
    }
}

impl<S: Write> Channel<S> {
    /// Sends one frame.
    pub fn send(&mut self, kind: Kind, payload: &[u8]) -> Result<(), TransferError> {
        self.send_frames(&[(kind, payload)])
    }

    /// Sends frames, in order, with one writev: one system call, and a
    /// reader that finds them all at one wake-up (the final round's last
    /// pages and the state, inside the guest's pause).
    pub fn send_frames(&mut self, frames: &[(Kind, &[u8])]) -> Result<(), TransferError> {
        if let Some((_, p)) = frames.iter().find(|(_, p)| p.len() > MAX_PAYLOAD) {
            return Err(TransferError::Memory(format!(
                "a frame of {} bytes is over the {MAX_PAYLOAD}-byte limit",
                p.len()
            )));
        }
        if self.is_encrypted() {
            self.seal(frames)?;
            self.stream
                .write_all(&self.wire)
                .map_err(|e| TransferError::io(self.peer, &self.phase, self.timeout, e))?;
        } else {
            let heads = self.frame_heads(frames);
            let tag_len = self.tag_len();
            // Head, payload and tag of each frame: no small segment for a
            // head on its own.
            let mut slices: Vec<IoSlice<'_>> = frames
                .iter()
                .zip(&heads)
                .flat_map(|(&(_, payload), (head, t))| {
                    [
                        IoSlice::new(head),
                        IoSlice::new(payload),
                        IoSlice::new(&t[..tag_len]),
                    ]
                })
                .collect();
            write_all_vectored(&mut self.stream, &mut slices).map_err(|e| self.io_error(e))?;
        }
        self.sent += frames.len() as u64;
        self.bytes_sent += frames.iter().map(|(_, p)| p.len() as u64).sum::<u64>();
        Ok(())
    }

    /// Sends a control message.
    pub fn send_msg(&mut self, msg: &Message) -> Result<(), TransferError> {
        let bytes = encode_json(msg)?;
        self.send(Kind::Control, &bytes)
    }

    /// Pushes out buffered frames (for a buffered stream).
    pub fn flush(&mut self) -> Result<(), TransferError> {
        self.stream.flush().map_err(|e| self.io_error(e))
    }
}

fn encode_json<T: Serialize>(msg: &T) -> Result<Vec<u8>, TransferError> {
    serde_json::to_vec(msg).map_err(|e| TransferError::Memory(format!("encoding a message: {e}")))
}

impl<S: FdRead> Channel<S> {
    /// Receives one frame into `buf`; returns its kind. The payload is only
    /// returned once its tag verifies. Fds that came with it wait for
    /// [`take_fds`](Self::take_fds).
    pub fn recv(&mut self, buf: &mut Vec<u8>) -> Result<Kind, TransferError> {
        if let Protection::Encrypted(t) = &self.protection {
            let opened = sealed::open(
                t,
                &mut self.sealed_received,
                &mut self.stream,
                &mut self.fds_in,
                &mut self.scratch,
                buf,
                MAX_PAYLOAD,
            );
            let kind = match opened {
                Ok(k) => k,
                Err(sealed::OpenError::Io(e)) => return Err(self.io_error(e)),
                Err(sealed::OpenError::Tag) => return Err(self.unauthentic()),
                Err(sealed::OpenError::Malformed(m)) => return Err(self.malformed(m)),
            };
            let kind = Kind::from_byte(kind)
                .ok_or_else(|| self.malformed(format!("frame kind {kind}")))?;
            self.received += 1;
            self.bytes_received += buf.len() as u64;
            return Ok(kind);
        }
        if self.hello_pending {
            let mut hello = [0u8; handshake::HELLO_LEN];
            fds::read_exact_with_fds(&mut self.stream, &mut hello, &mut self.fds_in).map_err(
                |e| match e.kind() {
                    std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe => {
                        TransferError::ClosedInHandshake { peer: self.peer }
                    }
                    _ => self.io_error(e),
                },
            )?;
            handshake::check_local_hello(&hello, self.peer)?;
            self.hello_pending = false;
        }
        let mut head = [0u8; 5];
        fds::read_exact_with_fds(&mut self.stream, &mut head, &mut self.fds_in)
            .map_err(|e| self.io_error(e))?;
        self.recv_rest(head, buf)
    }

    /// The fds received so far (with the frames read), in order.
    pub fn take_fds(&mut self) -> Vec<File> {
        std::mem::take(&mut self.fds_in)
    }

    fn recv_rest(&mut self, head: [u8; 5], buf: &mut Vec<u8>) -> Result<Kind, TransferError> {
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if len > MAX_PAYLOAD {
            return Err(self.malformed(format!("a frame of {len} bytes")));
        }
        let kind = Kind::from_byte(head[4])
            .ok_or_else(|| self.malformed(format!("frame kind {}", head[4])))?;
        // Payload and tag in one read.
        let tag_len = self.tag_len();
        buf.resize(len + tag_len, 0);
        self.stream.read_exact(buf).map_err(|e| self.io_error(e))?;
        let mut t = [0u8; TAG_LEN];
        t[..tag_len].copy_from_slice(&buf[len..]);
        buf.truncate(len);
        self.check_tag(head[4], buf, &t[..tag_len])?;
        self.received += 1;
        self.bytes_received += len as u64;
        Ok(kind)
    }

    /// Receives a control message (any other frame here is out of order).
    pub fn recv_msg(&mut self, buf: &mut Vec<u8>) -> Result<Message, TransferError> {
        let kind = self.recv(buf)?;
        self.decode_message(kind, buf)
    }

    /// Receives the message `expected`, which `is` recognises; the peer's
    /// `Failed` becomes its refusal, anything else an error naming both.
    pub fn expect(
        &mut self,
        buf: &mut Vec<u8>,
        expected: &'static str,
        is: impl Fn(&Message) -> bool,
    ) -> Result<Message, TransferError> {
        match self.recv_msg(buf)? {
            m if is(&m) => Ok(m),
            other => Err(self.unexpected(expected, other)),
        }
    }
}

impl<S: FdWrite> Channel<S> {
    /// Sends a control message with `fds` (SCM_RIGHTS) on its first bytes
    /// (a Unix socket only).
    pub fn send_msg_with_fds(&mut self, msg: &Message, fds: &[RawFd]) -> Result<(), TransferError> {
        if fds.is_empty() {
            return self.send_msg(msg);
        }
        if fds.len() > MAX_FDS {
            return Err(TransferError::Memory(format!(
                "{} fds in one message, at most {MAX_FDS}",
                fds.len()
            )));
        }
        let payload = encode_json(msg)?;
        if self.is_encrypted() {
            self.seal(&[(Kind::Control, &payload)])?;
        } else {
            let heads = self.frame_heads(&[(Kind::Control, &payload)]);
            let (head, t) = &heads[0];
            self.wire.clear();
            self.wire.extend_from_slice(head);
            self.wire.extend_from_slice(&payload);
            self.wire.extend_from_slice(&t[..self.tag_len()]);
        }
        // The fds ride on the first bytes.
        sealed::write_sealed(&mut self.stream, &self.wire, fds)
            .map_err(|e| TransferError::io(self.peer, &self.phase, self.timeout, e))?;
        self.sent += 1;
        self.bytes_sent += payload.len() as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    type Ends = (
        Result<Channel<UnixStream>, TransferError>,
        Result<Channel<UnixStream>, TransferError>,
    );

    fn pair_with(auth_i: Auth<'static>, auth_a: Auth<'static>) -> Ends {
        let (a, b) = UnixStream::pair().unwrap();
        let acceptor = std::thread::spawn(move || Channel::accept(b, auth_a, Peer::Source));
        let initiator = Channel::connect(a, auth_i, Peer::Destination);
        (initiator, acceptor.join().unwrap())
    }

    fn pair(psk_i: &'static [u8], psk_a: &'static [u8]) -> Ends {
        pair_with(Auth::Psk(psk_i), Auth::Psk(psk_a))
    }

    const ALL: [Auth<'static>; 3] = [
        Auth::Psk(b"secret"),
        Auth::PskPlaintext(b"secret"),
        Auth::Local,
    ];

    #[test]
    fn round_trips_on_every_protection() {
        for auth in ALL {
            let (s, d) = pair_with(auth, auth);
            let (mut s, mut d) = (s.unwrap(), d.unwrap());
            assert_eq!(s.is_encrypted(), matches!(auth, Auth::Psk(_)));
            s.send_msg(&Message::Ready).unwrap();
            let mut buf = Vec::new();
            assert!(matches!(d.recv_msg(&mut buf).unwrap(), Message::Ready));
            d.send_msg(&Message::Commit).unwrap();
            assert!(matches!(s.recv_msg(&mut buf).unwrap(), Message::Commit));
        }
    }

    #[test]
    fn a_wrong_key_is_named_on_both_ends_in_the_handshake() {
        for (i, a) in [
            (Auth::Psk(b"secret"), Auth::Psk(b"other")),
            (Auth::PskPlaintext(b"secret"), Auth::PskPlaintext(b"other")),
        ] {
            let (s, d) = pair_with(i, a);
            let s = s.err().unwrap();
            assert!(matches!(s, TransferError::KeyRefused { .. }), "{s}");
            assert_eq!(
                s.to_string(),
                "the destination refused our key: the key files of the two ends differ"
            );
            let d = d.err().unwrap();
            assert!(matches!(d, TransferError::KeyMismatch { .. }), "{d}");
        }
    }

    #[test]
    fn ends_that_protect_the_link_differently_say_so() {
        let (s, d) = pair_with(Auth::Psk(b"secret"), Auth::PskPlaintext(b"secret"));
        let s = s.err().unwrap().to_string();
        assert!(s.contains("--plaintext-link"), "{s}");
        assert!(d.err().unwrap().to_string().contains("an encrypted link"));
    }

    #[test]
    fn a_peer_that_hangs_up_or_is_not_kemari_is_named() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        let e = Channel::connect(a, Auth::Psk(b"k"), Peer::Standby)
            .err()
            .unwrap();
        assert_eq!(
            e.to_string(),
            "the standby closed the connection during the handshake: wrong key or not a kemari standby?"
        );
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&[0x42; handshake::HELLO_LEN]).unwrap();
        assert!(matches!(
            Channel::accept(b, Auth::Psk(b"k"), Peer::Source),
            Err(TransferError::NotKemari { .. })
        ));
    }

    #[test]
    fn another_version_is_named_on_both_ends() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let acceptor = std::thread::spawn(move || Channel::accept(b, Auth::Local, Peer::Source));
        a.write_all(&handshake::hello_for_test(4, 0)).unwrap();
        let mut back = [0u8; handshake::HELLO_LEN];
        a.read_exact(&mut back).unwrap();
        assert_eq!(
            handshake::parse_hello(&back, Peer::Destination)
                .unwrap()
                .version,
            crate::message::VERSION
        );
        let e = acceptor.join().unwrap().err().unwrap();
        assert!(e.to_string().contains("version 4"), "{e}");
    }

    #[test]
    fn a_local_initiator_sends_at_once_and_names_another_version_at_its_first_read() {
        let (a, mut b) = UnixStream::pair().unwrap();
        // No round trip: connect and the first frame go out before the
        // acceptor said anything.
        let mut ch = Channel::connect(a, Auth::Local, Peer::Destination).unwrap();
        ch.send_msg(&Message::Ready).unwrap();
        let mut hello = [0u8; handshake::HELLO_LEN];
        b.read_exact(&mut hello).unwrap();
        assert_eq!(
            handshake::parse_hello(&hello, Peer::Source)
                .unwrap()
                .version,
            crate::message::VERSION
        );
        b.write_all(&handshake::hello_for_test(4, 0)).unwrap();
        let e = ch.recv(&mut Vec::new()).unwrap_err();
        assert!(e.to_string().contains("version 4"), "{e}");

        // An acceptor that hangs up instead: the handshake is named.
        let (a, b) = UnixStream::pair().unwrap();
        let mut ch = Channel::connect(a, Auth::Local, Peer::Destination).unwrap();
        drop(b);
        let e = ch.recv(&mut Vec::new()).unwrap_err();
        assert!(matches!(e, TransferError::ClosedInHandshake { .. }), "{e}");
    }

    #[test]
    fn frames_sent_together_arrive_in_order_each_authenticated() {
        for auth in ALL {
            let (s, d) = pair_with(auth, auth);
            let (mut s, mut d) = (s.unwrap(), d.unwrap());
            s.send_msg(&Message::Ready).unwrap();
            let before = s.bytes_sent;
            let big = vec![0x5au8; 200_000];
            s.send_frames(&[(Kind::Pages, &big), (Kind::State, b"state")])
                .unwrap();
            assert_eq!(s.bytes_sent - before, 200_005);
            s.send_msg(&Message::Commit).unwrap();
            let mut buf = Vec::new();
            assert!(matches!(d.recv_msg(&mut buf).unwrap(), Message::Ready));
            assert_eq!(d.recv(&mut buf).unwrap(), Kind::Pages);
            assert_eq!(buf, big);
            assert_eq!(d.recv(&mut buf).unwrap(), Kind::State);
            assert_eq!(buf, b"state");
            assert!(matches!(d.recv_msg(&mut buf).unwrap(), Message::Commit));
        }
    }

    /// A stream that records what crosses it.
    struct Tee(UnixStream, std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Read for Tee {
        fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
            self.0.read(b)
        }
    }

    impl Write for Tee {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            let n = self.0.write(b)?;
            self.1.lock().unwrap().extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.0.flush()
        }
    }

    impl FdRead for Tee {}

    #[test]
    fn an_encrypted_link_shows_no_page_in_clear_and_a_plaintext_one_does() {
        let page: Vec<u8> = b"KEMARI-GUEST-PAGE-"
            .iter()
            .cycle()
            .take(4096)
            .copied()
            .collect();
        for (auth, visible) in [
            (Auth::Psk(b"secret"), false),
            (Auth::PskPlaintext(b"secret"), true),
        ] {
            let (a, b) = UnixStream::pair().unwrap();
            let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let acceptor = std::thread::spawn(move || Channel::accept(b, auth, Peer::Source));
            let mut s = Channel::connect(Tee(a, seen.clone()), auth, Peer::Destination).unwrap();
            let mut d = acceptor.join().unwrap().unwrap();
            s.send(Kind::Pages, &page).unwrap();
            let mut buf = Vec::new();
            d.recv(&mut buf).unwrap();
            assert_eq!(buf, page);
            let wire = seen.lock().unwrap().clone();
            let found = wire.windows(18).any(|w| w == b"KEMARI-GUEST-PAGE-");
            assert_eq!(found, visible, "{auth:?}");
        }
    }

    #[test]
    fn halves_of_an_encrypted_link_work_from_two_threads() {
        let (s, d) = pair(b"secret", b"secret");
        let (s, mut d) = (s.unwrap(), d.unwrap());
        let (mut rx, mut tx) = s.split(|st| Ok((st.try_clone()?, st))).unwrap();
        let sender = std::thread::spawn(move || {
            for i in 0..50u32 {
                tx.send(Kind::Pages, &i.to_le_bytes()).unwrap();
            }
        });
        let mut buf = Vec::new();
        for i in 0..50u32 {
            assert_eq!(d.recv(&mut buf).unwrap(), Kind::Pages);
            assert_eq!(buf, i.to_le_bytes());
            d.send_msg(&Message::Ack {
                epoch: u64::from(i),
            })
            .unwrap();
        }
        sender.join().unwrap();
        for i in 0..50u64 {
            assert!(matches!(rx.recv_msg(&mut buf).unwrap(), Message::Ack { epoch } if epoch == i));
        }
    }

    #[test]
    fn an_altered_or_forged_frame_fails_on_every_protected_link() {
        for auth in [Auth::Psk(b"secret"), Auth::PskPlaintext(b"secret")] {
            let (s, d) = pair_with(auth, auth);
            let (mut s, mut d) = (s.unwrap(), d.unwrap());
            s.send(Kind::Pages, b"one").unwrap();
            let mut buf = Vec::new();
            d.recv(&mut buf).unwrap();
            // A frame forged straight on the stream, in either layout.
            let forged: Vec<u8> = if matches!(auth, Auth::Psk(_)) {
                let mut f = 40u16.to_le_bytes().to_vec();
                f.extend_from_slice(&[0xab; 40]);
                f
            } else {
                let mut f = 3u32.to_le_bytes().to_vec();
                f.push(Kind::Pages as u8);
                f.extend_from_slice(b"two");
                f.extend_from_slice(&[0u8; TAG_LEN]);
                f
            };
            (&s.stream).write_all(&forged).unwrap();
            d.set_phase("receiving memory");
            let e = d.recv(&mut buf).err().unwrap();
            assert!(
                matches!(e, TransferError::Authentication { .. }),
                "{auth:?}: {e}"
            );
            assert!(e.to_string().contains("receiving memory"), "{e}");
        }
    }

    #[test]
    fn a_local_channel_carries_fds_and_no_tags() {
        let (s, d) = pair_with(Auth::Local, Auth::Local);
        let (mut s, mut d) = (s.unwrap(), d.unwrap());
        let f = File::open("/dev/null").unwrap();
        use std::os::fd::AsRawFd;
        s.send_msg_with_fds(&Message::StateSaved { fds: 1 }, &[f.as_raw_fd()])
            .unwrap();
        s.send_msg(&Message::Ready).unwrap();
        let mut buf = Vec::new();
        let m = d.recv_msg(&mut buf).unwrap();
        assert!(matches!(m, Message::StateSaved { fds: 1 }));
        assert_eq!(d.take_fds().len(), 1);
        assert!(matches!(d.recv_msg(&mut buf).unwrap(), Message::Ready));
        assert!(d.take_fds().is_empty());
    }

    #[test]
    fn oversized_and_unknown_frames_are_refused_before_use() {
        let (s, d) = pair_with(Auth::Local, Auth::Local);
        let (s, mut d) = (s.unwrap(), d.unwrap());
        let mut buf = Vec::new();
        let mut big = ((MAX_PAYLOAD + 1) as u32).to_le_bytes().to_vec();
        big.push(1);
        (&s.stream).write_all(&big).unwrap();
        assert!(matches!(
            d.recv(&mut buf),
            Err(TransferError::Malformed { .. })
        ));
        let (s, d) = pair_with(Auth::Local, Auth::Local);
        let (s, mut d) = (s.unwrap(), d.unwrap());
        (&s.stream).write_all(&[0, 0, 0, 0, 9]).unwrap();
        assert!(matches!(
            d.recv(&mut buf),
            Err(TransferError::Malformed { .. })
        ));
    }
}
