//! Frames on an encrypted link: each frame `[len u32][kind u8][payload]` is
//! cut into Noise messages of at most 65,535 bytes, each sent as
//! `[ciphertext length u16][ciphertext]` and encrypted and authenticated
//! with AES-256-GCM under the next counter nonce of its direction. A frame
//! altered, cut, replayed or reordered fails to open.

use std::fs::File;
use std::io::Read;

use snow::StatelessTransportState;

use super::fds::{read_exact_with_fds, FdRead};
use crate::message::Kind;

/// AES-GCM's tag.
const TAG: usize = 16;
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
/// is this direction's next message counter.
pub(super) fn seal(
    t: &StatelessTransportState,
    nonce: &mut u64,
    kind: Kind,
    payload: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), snow::Error> {
    let first = payload.len().min(CHUNK - HEAD);
    let mut head = Vec::with_capacity(HEAD + first);
    head.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    head.push(kind as u8);
    head.extend_from_slice(&payload[..first]);
    seal_one(t, nonce, &head, out)?;
    for piece in payload[first..].chunks(CHUNK) {
        seal_one(t, nonce, piece, out)?;
    }
    Ok(())
}

fn seal_one(
    t: &StatelessTransportState,
    nonce: &mut u64,
    plain: &[u8],
    out: &mut Vec<u8>,
) -> Result<(), snow::Error> {
    let at = out.len();
    out.resize(at + 2 + plain.len() + TAG, 0);
    let n = t.write_message(*nonce, plain, &mut out[at + 2..])?;
    out[at..at + 2].copy_from_slice(&(n as u16).to_le_bytes());
    out.truncate(at + 2 + n);
    *nonce += 1;
    Ok(())
}

/// Reads and opens one frame into `buf` (its payload); returns its kind
/// byte. Fds that came with its first bytes go to `fds`; no payload over
/// `max` bytes is accepted, nor allocated for.
pub(super) fn open<S: FdRead>(
    t: &StatelessTransportState,
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
    buf.resize(first - TAG, 0);
    let n = t
        .read_message(*nonce, &scratch[..first], buf)
        .map_err(|_| OpenError::Tag)?;
    *nonce += 1;
    let total = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    let kind = buf[4];
    if total > max {
        return Err(OpenError::Malformed(format!("a frame of {total} bytes")));
    }
    buf.truncate(n);
    buf.drain(..HEAD);
    while buf.len() < total {
        let mut len = [0u8; 2];
        stream.read_exact(&mut len)?;
        let size = read_message(stream, u16::from_le_bytes(len), scratch)?;
        let at = buf.len();
        if size < TAG || at + size - TAG > total {
            return Err(OpenError::Malformed(
                "a message past its frame's end".into(),
            ));
        }
        buf.resize(at + size - TAG, 0);
        let n = t
            .read_message(*nonce, &scratch[..size], &mut buf[at..])
            .map_err(|_| OpenError::Tag)?;
        *nonce += 1;
        buf.truncate(at + n);
    }
    if buf.len() != total {
        return Err(OpenError::Malformed("a frame longer than it said".into()));
    }
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
