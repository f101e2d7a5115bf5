//! The channel every hand-over speaks over: a handshake that proves both
//! ends hold the same pre-shared key, then framed, authenticated,
//! sequence-numbered frames; over a Unix socket, fds ride on a frame
//! (zero-copy migration, warm restart). Pure over any `Read + Write`, so it
//! is unit-tested and fuzzed without sockets.
//!
//! ```text
//! initiator (source, primary, old kemari)            acceptor (destination, standby, successor)
//!   Hello{magic "KEMARI-MIG", version, nonce_i} ───▶
//!   ◀─────────────────────────────── Hello{magic, version, nonce_a}  (always: the initiator
//!                                                                     sees a version mismatch)
//!   key = BLAKE3-derive("kemari hand-over v5 session key", psk ‖ nonce_i ‖ nonce_a)
//!   proof_i = BLAKE3-keyed(key, "proof" ‖ 1) ───────▶ checked
//!   ◀───────────────── verdict u8 (0 = key accepted) ‖ proof_a = BLAKE3-keyed(key, "proof" ‖ 2)
//!   every later frame: [len u32][kind u8][payload][tag 32 B]
//!   tag = BLAKE3-keyed(key, payload ‖ side ‖ sequence ‖ kind)
//! ```
//!
//! So a wrong key is named as such at once, on both ends, instead of
//! surfacing as a closed connection later; a frame that was altered,
//! forged, replayed, reordered or reflected fails its tag. A local channel
//! (Unix socket between two processes of one user) has no key and no tags:
//! the socket's permissions and the peer's credentials protect it.

use std::borrow::Cow;
use std::fs::File;
use std::io::{IoSlice, Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use serde::Serialize;

use crate::error::{Peer, TransferError};
use crate::message::{Kind, Message, VERSION};

/// Handshake magic.
pub const MAGIC: &[u8; 10] = b"KEMARI-MIG";
/// Largest frame payload accepted.
pub const MAX_PAYLOAD: usize = 64 << 20;
/// Most fds one frame may carry.
pub const MAX_FDS: usize = 32;
const TAG_LEN: usize = 32;
const HELLO_LEN: usize = 10 + 4 + 32;
const KEY_CONTEXT: &str = "kemari hand-over v5 session key";

/// How the ends know each other.
#[derive(Debug, Clone, Copy)]
pub enum Auth<'a> {
    /// A pre-shared key (≥ 16 bytes): TCP links between hosts.
    Psk(&'a [u8]),
    /// Two processes on one host over a Unix socket: no key, no tags.
    Local,
}

/// Which end of the channel this is (part of each tag, so a frame cannot
/// be reflected back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The end that connects and offers the VM.
    Initiator = 1,
    /// The end that accepts it.
    Acceptor = 2,
}

impl Side {
    fn other(self) -> Side {
        match self {
            Side::Initiator => Side::Acceptor,
            Side::Acceptor => Side::Initiator,
        }
    }
}

/// A byte stream a channel reads from, and the fds that may come with its
/// bytes (only a Unix socket carries them).
pub trait FdRead: Read {
    /// Reads into `buf` like `read`, adding any fds that came with these
    /// bytes to `fds`.
    fn read_with_fds(&mut self, buf: &mut [u8], fds: &mut Vec<File>) -> std::io::Result<usize> {
        let _ = fds;
        self.read(buf)
    }
}

impl FdRead for std::net::TcpStream {}
impl<R: Read> FdRead for std::io::BufReader<R> {}
impl FdRead for &[u8] {}

impl FdRead for UnixStream {
    fn read_with_fds(&mut self, buf: &mut [u8], fds: &mut Vec<File>) -> std::io::Result<usize> {
        use vmm_sys_util::sock_ctrl_msg::ScmSocket;
        let mut raw = [-1 as RawFd; MAX_FDS];
        let mut iov = [libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        }];
        // SAFETY: the iovec points at `buf`, which lives and stays borrowed
        // for the call; recvmsg writes at most its length there and fd
        // numbers into `raw`.
        let (n, nfds) = unsafe { self.recv_with_fds(&mut iov, &mut raw) }
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        // SAFETY: each fd was just received with SCM_RIGHTS and is ours.
        fds.extend(
            raw[..nfds]
                .iter()
                .map(|&fd| unsafe { File::from_raw_fd(fd) }),
        );
        Ok(n)
    }
}

/// A byte stream a channel writes to, and fds sent with its bytes (only a
/// Unix socket carries them).
pub trait FdWrite: Write {
    /// Writes some of `data` like `write`, with `fds` on its first byte.
    fn write_with_fds(&mut self, data: &[u8], fds: &[RawFd]) -> std::io::Result<usize> {
        if fds.is_empty() {
            return self.write(data);
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "only a Unix socket carries fds",
        ))
    }
}

impl FdWrite for std::net::TcpStream {}
impl<W: Write> FdWrite for std::io::BufWriter<W> {}
impl FdWrite for Vec<u8> {}

impl FdWrite for UnixStream {
    fn write_with_fds(&mut self, data: &[u8], fds: &[RawFd]) -> std::io::Result<usize> {
        use vmm_sys_util::sock_ctrl_msg::ScmSocket;
        if fds.is_empty() {
            return self.write(data);
        }
        self.send_with_fds(&[data], fds)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
    }
}

/// An authenticated, framed channel over a byte stream.
pub struct Channel<S> {
    stream: S,
    /// Fds received with frames, until taken.
    fds_in: Vec<File>,
    /// None: a local channel, frames carry no tag.
    key: Option<[u8; 32]>,
    me: Side,
    peer: Peer,
    phase: Cow<'static, str>,
    timeout: Option<Duration>,
    sent: u64,
    received: u64,
    /// Payload bytes sent (for progress reports).
    pub bytes_sent: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
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

fn proof(key: &[u8; 32], side: Side) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(b"proof");
    h.update(&[side as u8]);
    *h.finalize().as_bytes()
}

fn session_key(psk: &[u8], nonce_i: &[u8; 32], nonce_a: &[u8; 32]) -> [u8; 32] {
    let mut material = Vec::with_capacity(psk.len() + 64);
    material.extend_from_slice(psk);
    material.extend_from_slice(nonce_i);
    material.extend_from_slice(nonce_a);
    blake3::derive_key(KEY_CONTEXT, &material)
}

fn hello(nonce: &[u8; 32]) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[..10].copy_from_slice(MAGIC);
    h[10..14].copy_from_slice(&VERSION.to_le_bytes());
    h[14..].copy_from_slice(nonce);
    h
}

/// The nonce and version of a peer's `Hello`.
fn parse_hello(h: &[u8; HELLO_LEN], peer: Peer) -> Result<([u8; 32], u32), TransferError> {
    if &h[..10] != MAGIC {
        return Err(TransferError::NotKemari { peer });
    }
    let version = u32::from_le_bytes([h[10], h[11], h[12], h[13]]);
    let mut nonce = [0u8; 32];
    nonce.copy_from_slice(&h[14..]);
    Ok((nonce, version))
}

fn random_nonce() -> Result<[u8; 32], TransferError> {
    let mut n = [0u8; 32];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .map_err(TransferError::file("/dev/urandom"))?;
    Ok(n)
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
        let closed = |e: std::io::Error| handshake_io(peer, e);
        let nonce_i = random_nonce()?;
        stream.write_all(&hello(&nonce_i)).map_err(closed)?;
        let mut h = [0u8; HELLO_LEN];
        stream.read_exact(&mut h).map_err(closed)?;
        let (nonce_a, version) = parse_hello(&h, peer)?;
        same_version(version, peer)?;
        let Auth::Psk(psk) = auth else {
            return Ok(Self::new(stream, None, Side::Initiator, peer));
        };
        let key = session_key(psk, &nonce_i, &nonce_a);
        stream
            .write_all(&proof(&key, Side::Initiator))
            .map_err(closed)?;
        let mut answer = [0u8; 1 + 32];
        stream.read_exact(&mut answer).map_err(closed)?;
        if answer[0] != 0 {
            return Err(TransferError::KeyRefused { peer });
        }
        if blake3::Hash::from(proof(&key, Side::Acceptor))
            != blake3::Hash::from(<[u8; 32]>::try_from(&answer[1..]).unwrap_or([0; 32]))
        {
            return Err(TransferError::KeyMismatch { peer });
        }
        Ok(Self::new(stream, Some(key), Side::Initiator, peer))
    }

    /// The acceptor's handshake, with the `peer` (for messages).
    pub fn accept(mut stream: S, auth: Auth<'_>, peer: Peer) -> Result<Self, TransferError> {
        let closed = |e: std::io::Error| handshake_io(peer, e);
        let mut h = [0u8; HELLO_LEN];
        stream.read_exact(&mut h).map_err(closed)?;
        let (nonce_i, version) = parse_hello(&h, peer)?;
        let nonce_a = random_nonce()?;
        // Our hello even to another version: its end then names the
        // mismatch too, instead of seeing a closed connection.
        stream.write_all(&hello(&nonce_a)).map_err(closed)?;
        same_version(version, peer)?;
        let Auth::Psk(psk) = auth else {
            return Ok(Self::new(stream, None, Side::Acceptor, peer));
        };
        let key = session_key(psk, &nonce_i, &nonce_a);
        let mut theirs = [0u8; 32];
        stream.read_exact(&mut theirs).map_err(closed)?;
        let ok = blake3::Hash::from(proof(&key, Side::Initiator)) == blake3::Hash::from(theirs);
        let mut answer = [0u8; 1 + 32];
        if ok {
            answer[1..].copy_from_slice(&proof(&key, Side::Acceptor));
        } else {
            answer[0] = 1;
        }
        stream.write_all(&answer).map_err(closed)?;
        if !ok {
            return Err(TransferError::KeyMismatch { peer });
        }
        Ok(Self::new(stream, Some(key), Side::Acceptor, peer))
    }
}

/// Err unless the peer speaks this version.
fn same_version(theirs: u32, peer: Peer) -> Result<(), TransferError> {
    if theirs != VERSION {
        return Err(TransferError::Version {
            peer,
            theirs,
            ours: VERSION,
        });
    }
    Ok(())
}

/// An I/O error in the handshake: a peer that hangs up there is most likely
/// refusing our key or not kemari at all.
fn handshake_io(peer: Peer, e: std::io::Error) -> TransferError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof
        | std::io::ErrorKind::ConnectionReset
        | std::io::ErrorKind::BrokenPipe => TransferError::ClosedInHandshake { peer },
        _ => TransferError::io(peer, "in the handshake", None, e),
    }
}

impl<S> Channel<S> {
    /// A local channel over `stream` without a handshake: for the fuzzers
    /// of the frame reader only.
    #[doc(hidden)]
    pub fn over_stream_for_fuzzing(stream: S) -> Self {
        Self::new(stream, None, Side::Acceptor, Peer::Source)
    }

    fn new(stream: S, key: Option<[u8; 32]>, me: Side, peer: Peer) -> Self {
        Channel {
            stream,
            fds_in: Vec::new(),
            key,
            me,
            peer,
            phase: Cow::Borrowed("starting"),
            timeout: None,
            sent: 0,
            received: 0,
            bytes_sent: 0,
            bytes_received: 0,
        }
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
        if self.key.is_some() {
            TAG_LEN
        } else {
            0
        }
    }

    /// Splits the channel into a receiving and a sending half over the two
    /// halves `split` makes of the stream (each direction keeps its own
    /// sequence, so the halves may be used from different threads).
    pub fn split<R, W>(
        self,
        split: impl FnOnce(S) -> std::io::Result<(R, W)>,
    ) -> Result<(Channel<R>, Channel<W>), TransferError> {
        let (peer, phase, timeout) = (self.peer, self.phase.clone(), self.timeout);
        let (r, w) = split(self.stream).map_err(|e| TransferError::io(peer, &phase, timeout, e))?;
        let (key, me) = (self.key, self.me);
        let mut rx = Channel::new(r, key, me, peer);
        rx.phase = phase.clone();
        rx.timeout = timeout;
        rx.received = self.received;
        rx.bytes_received = self.bytes_received;
        let mut tx = Channel::new(w, key, me, peer);
        tx.phase = phase;
        tx.timeout = timeout;
        tx.sent = self.sent;
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
                let t = match &self.key {
                    Some(key) => tag(key, self.me, seq, kind as u8, payload),
                    None => [0; TAG_LEN],
                };
                (head, t)
            })
            .collect()
    }

    fn check_tag(&self, kind: u8, payload: &[u8], got: &[u8]) -> Result<(), TransferError> {
        let Some(key) = &self.key else {
            return Ok(());
        };
        let expected = tag(key, self.me.other(), self.received, kind, payload);
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(got);
        // Constant-time comparison.
        if blake3::Hash::from(expected) != blake3::Hash::from(t) {
            return Err(TransferError::Authentication {
                peer: self.peer,
                phase: self.phase.to_string(),
            });
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
        let heads = self.frame_heads(frames);
        let tag_len = self.tag_len();
        // Head, payload and tag of each frame: no small segment for a head
        // on its own.
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
        let mut head = [0u8; 5];
        let mut got = 0;
        while got < head.len() {
            match self
                .stream
                .read_with_fds(&mut head[got..], &mut self.fds_in)
            {
                Ok(0) => return Err(self.io_error(std::io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error(e)),
            }
        }
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
        let heads = self.frame_heads(&[(Kind::Control, &payload)]);
        let (head, t) = &heads[0];
        let mut frame = Vec::with_capacity(5 + payload.len() + TAG_LEN);
        frame.extend_from_slice(head);
        frame.extend_from_slice(&payload);
        frame.extend_from_slice(&t[..self.tag_len()]);
        // The fds ride on the first bytes; a stream socket may take fewer
        // than all, the rest follows.
        let n = self
            .stream
            .write_with_fds(&frame, fds)
            .map_err(|e| self.io_error(e))?;
        if n == 0 {
            return Err(self.io_error(std::io::ErrorKind::WriteZero.into()));
        }
        self.stream
            .write_all(&frame[n..])
            .map_err(|e| self.io_error(e))?;
        self.sent += 1;
        self.bytes_sent += payload.len() as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(
        psk_i: &'static [u8],
        psk_a: &'static [u8],
    ) -> (
        Result<Channel<UnixStream>, TransferError>,
        Result<Channel<UnixStream>, TransferError>,
    ) {
        let (a, b) = UnixStream::pair().unwrap();
        let acceptor =
            std::thread::spawn(move || Channel::accept(b, Auth::Psk(psk_a), Peer::Source));
        let initiator = Channel::connect(a, Auth::Psk(psk_i), Peer::Destination);
        (initiator, acceptor.join().unwrap())
    }

    #[test]
    fn authenticated_round_trip() {
        let (s, d) = pair(b"secret", b"secret");
        let (mut s, mut d) = (s.unwrap(), d.unwrap());
        s.send_msg(&Message::Ready).unwrap();
        let mut buf = Vec::new();
        assert!(matches!(d.recv_msg(&mut buf).unwrap(), Message::Ready));
        d.send_msg(&Message::Commit).unwrap();
        assert!(matches!(s.recv_msg(&mut buf).unwrap(), Message::Commit));
    }

    #[test]
    fn a_wrong_key_is_named_on_both_ends_in_the_handshake() {
        let (s, d) = pair(b"secret", b"other");
        let s = s.err().unwrap();
        assert!(matches!(s, TransferError::KeyRefused { .. }), "{s}");
        assert_eq!(
            s.to_string(),
            "the destination refused our key: the key files of the two ends differ"
        );
        let d = d.err().unwrap();
        assert!(matches!(d, TransferError::KeyMismatch { .. }), "{d}");
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
        a.write_all(&[0x42; HELLO_LEN]).unwrap();
        assert!(matches!(
            Channel::accept(b, Auth::Psk(b"k"), Peer::Source),
            Err(TransferError::NotKemari { .. })
        ));
    }

    #[test]
    fn another_version_is_named_on_both_ends() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let acceptor = std::thread::spawn(move || Channel::accept(b, Auth::Local, Peer::Source));
        let mut old = hello(&[7; 32]);
        old[10..14].copy_from_slice(&4u32.to_le_bytes());
        a.write_all(&old).unwrap();
        let mut back = [0u8; HELLO_LEN];
        a.read_exact(&mut back).unwrap();
        assert_eq!(parse_hello(&back, Peer::Destination).unwrap().1, VERSION);
        let e = acceptor.join().unwrap().err().unwrap();
        assert!(e.to_string().contains("version 4"), "{e}");
    }

    #[test]
    fn frames_sent_together_arrive_in_order_each_authenticated() {
        let (s, d) = pair(b"secret", b"secret");
        let (mut s, mut d) = (s.unwrap(), d.unwrap());
        s.send_msg(&Message::Ready).unwrap();
        let before = s.bytes_sent;
        s.send_frames(&[(Kind::Pages, b"pages"), (Kind::State, b"state")])
            .unwrap();
        assert_eq!(s.bytes_sent - before, 10);
        s.send_msg(&Message::Commit).unwrap();
        let mut buf = Vec::new();
        assert!(matches!(d.recv_msg(&mut buf).unwrap(), Message::Ready));
        assert_eq!(d.recv(&mut buf).unwrap(), Kind::Pages);
        assert_eq!(buf, b"pages");
        assert_eq!(d.recv(&mut buf).unwrap(), Kind::State);
        assert_eq!(buf, b"state");
        assert!(matches!(d.recv_msg(&mut buf).unwrap(), Message::Commit));
    }

    #[test]
    fn an_altered_or_replayed_frame_fails_its_tag() {
        // Two sessions with the same key: a frame of one is not valid in
        // the other (another session key, and the sequence is in the tag).
        let (s, d) = pair(b"secret", b"secret");
        let (mut s, mut d) = (s.unwrap(), d.unwrap());
        s.send(Kind::Pages, b"one").unwrap();
        let mut buf = Vec::new();
        d.recv(&mut buf).unwrap();
        // Write a frame with a forged tag straight on the stream.
        let mut forged = Vec::new();
        forged.extend_from_slice(&3u32.to_le_bytes());
        forged.push(Kind::Pages as u8);
        forged.extend_from_slice(b"two");
        forged.extend_from_slice(&[0u8; TAG_LEN]);
        (&s.stream).write_all(&forged).unwrap();
        d.set_phase("receiving memory");
        let e = d.recv(&mut buf).err().unwrap();
        assert!(matches!(e, TransferError::Authentication { .. }), "{e}");
        assert!(e.to_string().contains("receiving memory"), "{e}");
    }

    #[test]
    fn a_local_channel_carries_fds_and_no_tags() {
        let (a, b) = UnixStream::pair().unwrap();
        let acceptor = std::thread::spawn(move || Channel::accept(b, Auth::Local, Peer::Source));
        let mut s = Channel::connect(a, Auth::Local, Peer::Destination).unwrap();
        let mut d = acceptor.join().unwrap().unwrap();
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
        let (a, b) = UnixStream::pair().unwrap();
        let acceptor = std::thread::spawn(move || Channel::accept(b, Auth::Local, Peer::Source));
        let s = Channel::connect(a, Auth::Local, Peer::Destination).unwrap();
        let mut d = acceptor.join().unwrap().unwrap();
        let mut buf = Vec::new();
        let mut big = ((MAX_PAYLOAD + 1) as u32).to_le_bytes().to_vec();
        big.push(1);
        (&s.stream).write_all(&big).unwrap();
        assert!(matches!(
            d.recv(&mut buf),
            Err(TransferError::Malformed { .. })
        ));
        let (a, b) = UnixStream::pair().unwrap();
        let acceptor = std::thread::spawn(move || Channel::accept(b, Auth::Local, Peer::Source));
        let s = Channel::connect(a, Auth::Local, Peer::Destination).unwrap();
        let mut d = acceptor.join().unwrap().unwrap();
        (&s.stream).write_all(&[0, 0, 0, 0, 9]).unwrap();
        assert!(matches!(
            d.recv(&mut buf),
            Err(TransferError::Malformed { .. })
        ));
    }
}
