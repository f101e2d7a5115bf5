//! Buffers for READ data, placed so that the kernel's copies into and out
//! of them run at full speed.
//!
//! On this project's development host (AMD EPYC, `rep movsb` with FSRM,
//! which the kernel uses for every copy to and from user memory) a copy is
//! 5–10 times slower when the destination lies 1 to 31 bytes past the
//! source modulo 4096 — 750–890 µs per MiB instead of 80–110
//! (docs/benchmarks.md, "NBD"). A READ reply is copied twice by the server:
//! `pread` from the page cache into this buffer, then `write` from it into
//! the socket's buffer, where the data follows the reply header (16 or 28
//! bytes) and therefore starts a few dozen bytes into a page when the
//! socket's page is fresh. Data at the page offset of the file range, as in
//! a page-aligned buffer, gets the first copy right and the second one
//! wrong (destination 28 bytes past the source). Placing the data 32 bytes
//! *before* the file range's page offset keeps both out of the slow window:
//! the `pread` writes 32 bytes behind its source (4064 modulo 4096), and the
//! socket copy writes ahead of it by the header's length plus 32.

use std::ops::Range;

use nbd_client::page_buf::{PageBuf, ALIGN};

/// How far before the file range's page offset the data starts.
pub const LEAD: usize = 32;

/// A recycled [`PageBuf`] holding one READ's data at a chosen offset.
#[derive(Debug, Default)]
pub struct ReadBuf {
    buf: PageBuf,
    data: Range<usize>,
}

impl ReadBuf {
    /// Where in the buffer data for file offset `offset` starts.
    pub fn start_for(offset: u64) -> usize {
        (offset as usize % ALIGN + ALIGN - LEAD) % ALIGN
    }

    /// The buffer, sized for `len` bytes of the file at `offset`, to be
    /// filled by the caller (the bytes hold whatever they held before).
    pub fn fill(&mut self, len: usize, offset: u64) -> &mut [u8] {
        let start = Self::start_for(offset);
        self.buf.set_len(start + len);
        self.data = start..start + len;
        &mut self.buf[start..]
    }

    /// The data last filled in.
    pub fn data(&self) -> &[u8] {
        &self.buf[self.data.clone()]
    }

    /// Gives the allocation back (for a pool shared with write payloads).
    pub fn into_inner(self) -> PageBuf {
        self.buf
    }
}

impl From<PageBuf> for ReadBuf {
    fn from(buf: PageBuf) -> Self {
        ReadBuf { buf, data: 0..0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// True when a copy from `src` to `dst` falls in the slow window.
    fn slow(dst: usize, src: usize) -> bool {
        (1..32).contains(&(dst.wrapping_sub(src) % ALIGN))
    }

    #[test]
    fn pread_into_it_is_never_in_the_slow_window() {
        for offset in [
            0u64,
            1,
            16,
            28,
            512,
            4064,
            4095,
            4096,
            1 << 20,
            (1 << 20) + 17,
        ] {
            let mut b = ReadBuf::default();
            let dst = b.fill(4096, offset).as_ptr() as usize;
            assert!(!slow(dst, offset as usize), "offset {offset}");
            assert_eq!(b.data().len(), 4096);
        }
    }

    #[test]
    fn socket_copy_after_a_header_at_a_fresh_page_is_not_slow() {
        // The socket's page fragment: header at 0, data right behind it.
        for header in [16usize, 28] {
            let src = ReadBuf::start_for(0);
            assert!(!slow(header, src), "header {header}");
        }
    }

    #[test]
    fn refill_reuses_the_allocation_and_tracks_the_range() {
        let mut b = ReadBuf::default();
        b.fill(1 << 20, 0).fill(7);
        let cap = b.buf.capacity();
        b.fill(100, 4096 + 40)[..3].copy_from_slice(b"abc");
        assert_eq!(b.buf.capacity(), cap);
        assert_eq!(&b.data()[..3], b"abc");
        assert_eq!(b.data().len(), 100);
        let inner = b.into_inner();
        assert_eq!(inner.capacity(), cap);
    }
}
