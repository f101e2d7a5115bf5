//! Frames on an encrypted link: each frame `[len u32][kind u8][payload]` is
//! cut into Noise messages of at most 65,535 bytes, each sent as
//! `[ciphertext length u16][ciphertext]` and encrypted and authenticated
//! with AES-256-GCM under the next counter nonce of its direction. A frame
//! altered, cut, replayed or reordered fails to open.

use std::fs::File;
use std::io::Read;

use super::fds::{read_exact_with_fds, FdRead};
use super::transport::{NoiseCiphers, TAG};
use crate::message::Kind;

/// Largest Noise message.
const MAX_MESSAGE: usize = 65535;
/// Plaintext per Noise message.
const CHUNK: usize = MAX_MESSAGE - TAG;
/// A frame's head inside its first message: `[len u32][kind u8]`.
const HEAD: usize = 5;

/// Why a frame did not open.
#[derive(Debug)]
pub(super) enum OpenError {
    /// Reading the stream.
    Io(std::io::Error),
    /// A message failed its tag (or its nonce).
    Tag,
    /// A length or kind out of bounds.
    Malformed(String),
}

impl From<std::io::Error> for OpenError {
    fn from(e: std::io::Error) -> Self {
        OpenError::Io(e)
    }
}

/// Appends the sealed messages of frame `(kind, payload)` to `out`; `nonce`
/// is this direction's next message counter. Each message is encrypted
/// where it is built in `out`.
pub(super) fn seal(
    t: &NoiseCiphers,
    nonce: &mut u64,
    kind: Kind,
    payload: &[u8],
    out: &mut Vec<u8>,
) {
    let first = payload.len().min(CHUNK - HEAD);
    let mut head = [0u8; HEAD];
    head[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    head[4] = kind as u8;
    seal_one(t, nonce, &[&head, &payload[..first]], out);
    for piece in payload[first..].chunks(CHUNK) {
        seal_one(t, nonce, &[piece], out);
    }
}

/// Appends `[len u16][ciphertext of parts][tag]`.
fn seal_one(t: &NoiseCiphers, nonce: &mut u64, parts: &[&[u8]], out: &mut Vec<u8>) {
    let plain: usize = parts.iter().map(|p| p.len()).sum();
    out.extend_from_slice(&((plain + TAG) as u16).to_le_bytes());
    let at = out.len();
    for p in parts {
        out.extend_from_slice(p);
    }
    let tag = t.seal_in_place(*nonce, &mut out[at..]);
    out.extend_from_slice(&tag);
    *nonce += 1;
}

/// Reads and opens one frame into `buf` (its payload); returns its kind
/// byte. Fds that came with its first bytes go to `fds`; no payload over
/// `max` bytes is accepted, nor allocated for. Messages after the first are
/// read into `buf` where their plaintext belongs and opened there.
pub(super) fn open<S: FdRead>(
    t: &NoiseCiphers,
    nonce: &mut u64,
    stream: &mut S,
    fds: &mut Vec<File>,
    scratch: &mut Vec<u8>,
    buf: &mut Vec<u8>,
    max: usize,
) -> Result<u8, OpenError> {
    let mut len = [0u8; 2];
    read_exact_with_fds(stream, &mut len, fds)?;
    let first = read_message(stream, u16::from_le_bytes(len), scratch)?;
    if first < TAG + HEAD {
        return Err(OpenError::Malformed(format!(
            "a first message of {first} bytes"
        )));
    }
    let n = t
        .open_in_place(*nonce, &mut scratch[..first])
        .map_err(|_| OpenError::Tag)?;
    *nonce += 1;
    let total = u32::from_le_bytes([scratch[0], scratch[1], scratch[2], scratch[3]]) as usize;
    let kind = scratch[4];
    if total > max {
        return Err(OpenError::Malformed(format!("a frame of {total} bytes")));
    }
    let mut at = n - HEAD;
    if at > total {
        return Err(OpenError::Malformed("a frame longer than it said".into()));
    }
    // Room for the payload and one message's tag; a buffer reused from the
    // last frame is not filled again.
    if buf.len() < total + TAG {
        buf.resize(total + TAG, 0);
    }
    buf[..at].copy_from_slice(&scratch[HEAD..n]);
    while at < total {
        let mut len = [0u8; 2];
        stream.read_exact(&mut len)?;
        let size = usize::from(u16::from_le_bytes(len));
        if size <= TAG || at + size - TAG > total {
            return Err(OpenError::Malformed(
                "a message past its frame's end".into(),
            ));
        }
        let message = &mut buf[at..at + size];
        stream.read_exact(message)?;
        at += t
            .open_in_place(*nonce, message)
            .map_err(|_| OpenError::Tag)?;
        *nonce += 1;
    }
    buf.truncate(total);
    Ok(kind)
}

fn read_message<S: Read>(
    stream: &mut S,
    len: u16,
    scratch: &mut Vec<u8>,
) -> Result<usize, OpenError> {
    let len = usize::from(len);
    scratch.resize(len, 0);
    stream.read_exact(&mut scratch[..len])?;
    Ok(len)
}

/// Writes `bytes` (whole sealed frames), fds on the first byte if any.
pub(super) fn write_sealed<S: super::fds::FdWrite>(
    stream: &mut S,
    bytes: &[u8],
    fds: &[std::os::fd::RawFd],
) -> std::io::Result<()> {
    let mut done = 0;
    if !fds.is_empty() {
        done = stream.write_with_fds(bytes, fds)?;
        if done == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
    }
    stream.write_all(&bytes[done..])
}
