//! One request's structured reply, chunk by chunk, checked as the NBD spec
//! asks (doc/proto.md, "Structured reply chunk message types"), the way
//! libnbd is strict about it:
//!
//! - data and hole chunks lie inside the request, are never empty and
//!   never overlap; a successful read is answered only once its chunks
//!   cover every byte — a reply that ends short fails the read (EIO) instead
//!   of handing back zeroes where the server sent nothing;
//! - an error chunk fails the request, but the reply goes on until the
//!   chunk flagged DONE (a server may send more chunks after an error), so
//!   the connection stays in step.
//!
//! A chunk that breaks the framing's rules is a [`ChunkError`]: the caller
//! must drop the connection. Pure, no I/O (fuzzed: `crates/nbd-client/fuzz`).

use std::collections::BTreeMap;

use crate::protocol::{EIO, REPLY_TYPE_OFFSET_DATA, REPLY_TYPE_OFFSET_HOLE};

/// Most separate covered ranges a read may have at once. Chunks that come
/// in order merge into one range; a server that scatters a read into more
/// disjoint pieces than this is refused rather than followed.
pub const MAX_PIECES: usize = 4096;

/// A chunk that breaks the protocol: the connection cannot be trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ChunkError(pub &'static str);

/// A failed request: the server's errno and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyFailure {
    pub errno: u32,
    pub message: String,
}

/// The structured reply of one request, as it arrives.
#[derive(Debug)]
pub struct ReplyAssembly {
    offset: u64,
    len: usize,
    /// The read's data (allocated at the first data or hole chunk).
    buf: Option<Vec<u8>>,
    /// Covered ranges of the request, `start -> end` (relative), merged.
    covered: BTreeMap<u64, u64>,
    covered_bytes: u64,
    failure: Option<ReplyFailure>,
}

impl ReplyAssembly {
    /// The reply to a request at `offset` expecting `len` bytes of data
    /// (0 for anything but a read).
    pub fn new(offset: u64, len: usize) -> Self {
        ReplyAssembly {
            offset,
            len,
            buf: None,
            covered: BTreeMap::new(),
            covered_bytes: 0,
            failure: None,
        }
    }

    /// Takes one chunk of type `reply_type` with `payload`.
    pub fn chunk(&mut self, reply_type: u16, payload: &[u8]) -> Result<(), ChunkError> {
        match reply_type {
            REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE => {
                let head = payload
                    .get(..8)
                    .ok_or(ChunkError("a data or hole chunk shorter than its offset"))?;
                let at = u64::from_be_bytes(head.try_into().expect("8 bytes"));
                let n = if reply_type == REPLY_TYPE_OFFSET_DATA {
                    payload.len() - 8
                } else {
                    let size = payload
                        .get(8..12)
                        .filter(|_| payload.len() == 12)
                        .ok_or(ChunkError("a hole chunk that is not 12 bytes"))?;
                    u32::from_be_bytes(size.try_into().expect("4 bytes")) as usize
                };
                let rel = self.place(at, n)?;
                let len = self.len;
                let buf = self.buf.get_or_insert_with(|| vec![0u8; len]);
                if reply_type == REPLY_TYPE_OFFSET_DATA {
                    buf[rel..rel + n].copy_from_slice(&payload[8..]);
                } else {
                    buf[rel..rel + n].fill(0);
                }
            }
            t if t & (1 << 15) != 0 => {
                let failure = decode_error(payload)?;
                // The first error is the one the request fails with.
                self.failure.get_or_insert(failure);
            }
            // NONE (with DONE) ends the reply; other types (block status)
            // carry nothing a read or a write keeps.
            _ => {}
        }
        Ok(())
    }

    /// Marks `[at, at + n)` covered and returns its start within the
    /// request; refuses an empty, outside or overlapping range.
    fn place(&mut self, at: u64, n: usize) -> Result<usize, ChunkError> {
        if n == 0 {
            return Err(ChunkError("an empty data or hole chunk"));
        }
        let start = at
            .checked_sub(self.offset)
            .ok_or(ChunkError("chunk outside the request"))?;
        let end = start
            .checked_add(n as u64)
            .filter(|&e| e <= self.len as u64)
            .ok_or(ChunkError("chunk outside the request"))?;
        let before = self
            .covered
            .range(..=start)
            .next_back()
            .map(|(&s, &e)| (s, e));
        let after = self.covered.range(start..).next().map(|(&s, &e)| (s, e));
        if before.is_some_and(|(_, e)| e > start) || after.is_some_and(|(s, _)| s < end) {
            return Err(ChunkError("chunks of one reply overlap"));
        }
        let (mut lo, mut hi) = (start, end);
        if let Some((s, e)) = before.filter(|&(_, e)| e == start) {
            self.covered.remove(&s);
            lo = s;
            debug_assert_eq!(e, start);
        }
        if let Some((s, e)) = after.filter(|&(s, _)| s == end) {
            self.covered.remove(&s);
            hi = e;
        }
        if self.covered.len() >= MAX_PIECES {
            return Err(ChunkError("a reply split into too many separate pieces"));
        }
        self.covered.insert(lo, hi);
        self.covered_bytes += n as u64;
        Ok(start as usize)
    }

    /// The reply ended (a chunk flagged DONE): the read's data, or why the
    /// request failed.
    pub fn finish(self) -> Result<Vec<u8>, ReplyFailure> {
        if let Some(f) = self.failure {
            return Err(f);
        }
        if self.covered_bytes != self.len as u64 {
            return Err(ReplyFailure {
                errno: EIO,
                message: format!(
                    "the server's reply covered {} of the {} bytes read",
                    self.covered_bytes, self.len
                ),
            });
        }
        Ok(self.buf.unwrap_or_default())
    }
}

/// An error chunk: `[errno u32][message length u16][message]`, and for
/// ERROR_OFFSET an offset after it.
fn decode_error(payload: &[u8]) -> Result<ReplyFailure, ChunkError> {
    let head = payload
        .get(..6)
        .ok_or(ChunkError("an error chunk shorter than 6 bytes"))?;
    let errno = u32::from_be_bytes(head[..4].try_into().expect("4 bytes"));
    let n = u16::from_be_bytes([head[4], head[5]]) as usize;
    let message = payload
        .get(6..6 + n)
        .ok_or(ChunkError("an error chunk shorter than its message"))?;
    Ok(ReplyFailure {
        // Zero would read as success.
        errno: if errno == 0 { EIO } else { errno },
        message: String::from_utf8_lossy(message).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{REPLY_TYPE_ERROR, REPLY_TYPE_ERROR_OFFSET, REPLY_TYPE_NONE};

    fn data(at: u64, bytes: &[u8]) -> Vec<u8> {
        let mut p = at.to_be_bytes().to_vec();
        p.extend_from_slice(bytes);
        p
    }

    fn hole(at: u64, n: u32) -> Vec<u8> {
        let mut p = at.to_be_bytes().to_vec();
        p.extend_from_slice(&n.to_be_bytes());
        p
    }

    fn error(errno: u32, msg: &str, offset: Option<u64>) -> Vec<u8> {
        let mut p = errno.to_be_bytes().to_vec();
        p.extend_from_slice(&(msg.len() as u16).to_be_bytes());
        p.extend_from_slice(msg.as_bytes());
        if let Some(o) = offset {
            p.extend_from_slice(&o.to_be_bytes());
        }
        p
    }

    #[test]
    fn chunks_in_any_order_tile_the_read() {
        let mut r = ReplyAssembly::new(1000, 10);
        r.chunk(REPLY_TYPE_OFFSET_DATA, &data(1006, b"wxyz"))
            .unwrap();
        r.chunk(REPLY_TYPE_OFFSET_HOLE, &hole(1002, 4)).unwrap();
        r.chunk(REPLY_TYPE_OFFSET_DATA, &data(1000, b"ab")).unwrap();
        assert_eq!(r.covered.len(), 1, "adjacent pieces merge");
        r.chunk(REPLY_TYPE_NONE, &[]).unwrap();
        assert_eq!(r.finish().unwrap(), b"ab\0\0\0\0wxyz");
    }

    #[test]
    fn a_reply_that_ends_short_fails_the_read_instead_of_giving_zeroes() {
        let mut r = ReplyAssembly::new(0, 8);
        r.chunk(REPLY_TYPE_OFFSET_DATA, &data(0, b"abcd")).unwrap();
        let f = r.finish().unwrap_err();
        assert_eq!(f.errno, EIO);
        assert!(
            f.message.contains("covered 4 of the 8 bytes"),
            "{}",
            f.message
        );
        // Nothing at all for a read is short too; for a write it is right.
        assert!(ReplyAssembly::new(0, 8).finish().is_err());
        assert_eq!(ReplyAssembly::new(0, 0).finish().unwrap(), b"");
    }

    #[test]
    fn overlapping_empty_and_outside_chunks_break_the_connection() {
        let mut r = ReplyAssembly::new(100, 8);
        r.chunk(REPLY_TYPE_OFFSET_DATA, &data(102, b"cd")).unwrap();
        for (what, t, p) in [
            ("overlap before", REPLY_TYPE_OFFSET_DATA, data(101, b"xy")),
            ("overlap after", REPLY_TYPE_OFFSET_HOLE, hole(103, 2)),
            ("duplicate", REPLY_TYPE_OFFSET_DATA, data(102, b"cd")),
            ("empty", REPLY_TYPE_OFFSET_DATA, data(100, b"")),
            ("empty hole", REPLY_TYPE_OFFSET_HOLE, hole(100, 0)),
            ("before", REPLY_TYPE_OFFSET_DATA, data(99, b"a")),
            ("past the end", REPLY_TYPE_OFFSET_HOLE, hole(107, 2)),
            ("wrapping", REPLY_TYPE_OFFSET_HOLE, hole(u64::MAX, 2)),
            ("short", REPLY_TYPE_OFFSET_DATA, vec![0; 7]),
            (
                "long hole",
                REPLY_TYPE_OFFSET_HOLE,
                [hole(100, 1), vec![0]].concat(),
            ),
        ] {
            assert!(r.chunk(t, &p).is_err(), "{what} accepted");
        }
        // A non-read takes no data at all.
        assert!(ReplyAssembly::new(0, 0)
            .chunk(REPLY_TYPE_OFFSET_DATA, &data(0, b"a"))
            .is_err());
    }

    #[test]
    fn an_error_fails_the_request_with_the_first_errno_and_its_message_only() {
        let mut r = ReplyAssembly::new(0, 4);
        r.chunk(REPLY_TYPE_ERROR_OFFSET, &error(28, "no space", Some(2)))
            .unwrap();
        // More chunks may follow an error; the reply stays in step.
        r.chunk(REPLY_TYPE_OFFSET_DATA, &data(0, b"ab")).unwrap();
        r.chunk(REPLY_TYPE_ERROR, &error(5, "later", None)).unwrap();
        let f = r.finish().unwrap_err();
        assert_eq!((f.errno, f.message.as_str()), (28, "no space"));
        let mut r = ReplyAssembly::new(0, 0);
        r.chunk(REPLY_TYPE_ERROR, &error(0, "", None)).unwrap();
        assert_eq!(r.finish().unwrap_err().errno, EIO, "errno 0 is no success");
        let mut r = ReplyAssembly::new(0, 0);
        assert!(r.chunk(REPLY_TYPE_ERROR, &[0, 0, 0, 5, 0]).is_err());
        assert!(r
            .chunk(REPLY_TYPE_ERROR, &[0, 0, 0, 5, 0, 9, b'x'])
            .is_err());
    }

    #[test]
    fn a_read_scattered_into_too_many_pieces_is_refused() {
        let n = 2 * MAX_PIECES + 2;
        let mut r = ReplyAssembly::new(0, n);
        let mut refused = false;
        for i in (0..n as u64).step_by(2) {
            if r.chunk(REPLY_TYPE_OFFSET_DATA, &data(i, b"x")).is_err() {
                refused = true;
                break;
            }
        }
        assert!(refused);
        assert!(r.covered.len() <= MAX_PIECES);
    }
}
