//! The page codec: a batch of guest pages in one frame, built in place on
//! the sending side (one copy per page, straight from guest memory) and
//! written into the memory file on the receiving side (one `pwritev` per
//! run of pages at consecutive offsets). Pure and bounded: fuzzed.
//!
//! Layout: `[round u32][count u32]`, then per page `[pfn u64][flag u8]`
//! and, for flag 1, its 4096 bytes; flag 0 is a page of zeros (a marker).
//! At most [`MAX_PAGES_PER_FRAME`] pages; a PFN outside guest RAM, an
//! unknown flag, a short or over-long batch is refused.

use std::io::IoSlice;

use vmm::layout;

use crate::sys;

/// Guest page size.
pub const PAGE: usize = 4096;
/// Most pages in one frame.
pub const MAX_PAGES_PER_FRAME: usize = 256;
/// Bytes of one page entry with data: `[pfn u64][flag u8]` + the page.
const ENTRY: usize = 9 + PAGE;

/// Why a page batch was refused.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    /// It does not parse or breaks a limit.
    #[error("{0}")]
    Malformed(String),
    /// The memory file could not be written.
    #[error("writing guest memory: {0}")]
    Io(#[from] std::io::Error),
}

fn bad(m: &str) -> PageError {
    PageError::Malformed(m.to_owned())
}

/// One page of a batch, for [`encode_pages`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PageData<'a> {
    /// A page of zeros (sent as a marker only).
    Zero,
    /// The page's bytes.
    Data(&'a [u8]),
}

/// Encodes a batch of pages (the reference encoding; [`PageFrame`] builds
/// the same bytes in place).
pub fn encode_pages(round: u32, pages: &[(u64, PageData<'_>)], out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&round.to_le_bytes());
    out.extend_from_slice(&(pages.len() as u32).to_le_bytes());
    for (pfn, data) in pages {
        out.extend_from_slice(&pfn.to_le_bytes());
        match data {
            PageData::Zero => out.push(0),
            PageData::Data(d) => {
                out.push(1);
                out.extend_from_slice(d);
            }
        }
    }
}

/// A batch built in place, in the layout of [`encode_pages`]: each page is
/// copied once, straight from guest memory into the frame, and checked for
/// zeros there. One buffer, allocated once, for a whole transfer.
pub struct PageFrame {
    buf: Vec<u8>,
    len: usize,
    count: u32,
}

impl Default for PageFrame {
    fn default() -> Self {
        Self::new()
    }
}

impl PageFrame {
    /// An empty frame with room for [`MAX_PAGES_PER_FRAME`] pages.
    pub fn new() -> Self {
        PageFrame {
            buf: vec![0; 8 + MAX_PAGES_PER_FRAME * ENTRY],
            len: 8,
            count: 0,
        }
    }

    /// Pages in the frame.
    pub fn count(&self) -> usize {
        self.count as usize
    }

    /// Whether no more pages fit.
    pub fn is_full(&self) -> bool {
        self.count() == MAX_PAGES_PER_FRAME
    }

    /// Appends page `pfn`, whose 4096 bytes `fill` writes into the frame. A
    /// page of zeros becomes a zero marker, or, with `drop_zero`, is left
    /// out. Returns whether the page was all zeros. The frame must not be
    /// full.
    pub fn push_with<E>(
        &mut self,
        pfn: u64,
        drop_zero: bool,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<bool, E> {
        assert!(!self.is_full(), "page frame overflow");
        let at = self.len;
        self.buf[at..at + 8].copy_from_slice(&pfn.to_le_bytes());
        let data = &mut self.buf[at + 9..at + ENTRY];
        fill(data)?;
        let zero = is_zero(data);
        if zero && drop_zero {
            return Ok(true);
        }
        self.buf[at + 8] = u8::from(!zero);
        self.len = if zero { at + 9 } else { at + ENTRY };
        self.count += 1;
        Ok(zero)
    }

    /// The payload of the pages pushed so far, as round `round`. Call
    /// [`clear`](Self::clear) once it is sent.
    pub fn payload(&mut self, round: u32) -> &[u8] {
        self.buf[0..4].copy_from_slice(&round.to_le_bytes());
        self.buf[4..8].copy_from_slice(&self.count.to_le_bytes());
        &self.buf[..self.len]
    }

    /// Bytes of the payload so far.
    pub fn payload_len(&self) -> usize {
        self.len
    }

    /// Empties the frame.
    pub fn clear(&mut self) {
        self.len = 8;
        self.count = 0;
    }
}

/// Whether `data` is all zeros (OR-reduced in blocks the compiler
/// vectorizes, stopping at the first non-zero block).
pub fn is_zero(data: &[u8]) -> bool {
    data.chunks(512)
        .all(|block| block.iter().fold(0u8, |acc, &b| acc | b) == 0)
}

/// The page count a batch announces (0 if it is too short to say).
pub fn batch_count(payload: &[u8]) -> u64 {
    payload.get(4..8).map_or(0, |c| {
        u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
    })
}

/// Decodes a batch, calling `f(pfn, Some(bytes) | None for zeros)` per
/// page; checks every length before use. Returns (round, count).
pub fn decode_pages<'p>(
    payload: &'p [u8],
    mut f: impl FnMut(u64, Option<&'p [u8]>) -> Result<(), PageError>,
) -> Result<(u32, u32), PageError> {
    if payload.len() < 8 {
        return Err(bad("page batch header"));
    }
    let word = |at: usize| {
        u32::from_le_bytes([
            payload[at],
            payload[at + 1],
            payload[at + 2],
            payload[at + 3],
        ])
    };
    let (round, count) = (word(0), word(4));
    if count as usize > MAX_PAGES_PER_FRAME {
        return Err(bad("too many pages in one frame"));
    }
    let mut at = 8;
    for _ in 0..count {
        let head = payload.get(at..at + 9).ok_or_else(|| bad("page entry"))?;
        let mut pfn = [0u8; 8];
        pfn.copy_from_slice(&head[..8]);
        let pfn = u64::from_le_bytes(pfn);
        at += 9;
        match head[8] {
            0 => f(pfn, None)?,
            1 => {
                let data = payload.get(at..at + PAGE).ok_or_else(|| bad("page data"))?;
                at += PAGE;
                f(pfn, Some(data))?;
            }
            _ => return Err(bad("page flag")),
        }
    }
    if at != payload.len() {
        return Err(bad("trailing bytes after the pages"));
    }
    Ok((round, count))
}

/// Offset in the memory file of guest page `pfn`, if it is RAM.
pub fn pfn_offset(mem_size: u64, pfn: u64) -> Option<u64> {
    let gpa = pfn.checked_mul(PAGE as u64)?;
    layout::ram_ranges(mem_size)
        .into_iter()
        .find(|&(base, len, _)| gpa >= base && gpa - base < len)
        .map(|(base, _, off)| gpa - base + off)
}

/// Checks that every page of a batch lies in guest RAM (without writing).
pub fn check_batch(mem_size: u64, payload: &[u8]) -> Result<u64, PageError> {
    let ram = layout::ram_ranges(mem_size);
    let (_, count) = decode_pages(payload, |pfn, _| {
        in_ram(&ram, pfn)
            .map(|_| ())
            .ok_or_else(|| PageError::Malformed(format!("page {pfn:#x} is outside guest memory")))
    })?;
    Ok(u64::from(count))
}

fn in_ram(ram: &[(u64, u64, u64)], pfn: u64) -> Option<u64> {
    let gpa = pfn.checked_mul(PAGE as u64)?;
    ram.iter()
        .find(|&&(base, len, _)| gpa >= base && gpa - base < len)
        .map(|&(base, _, off)| gpa - base + off)
}

/// Writes a batch's pages into the memory file: runs of pages at
/// consecutive file offsets go in one `pwritev` each. Writing the file (not
/// a mapping) allocates each new page without a page fault and without
/// zeroing it first, since it is fully overwritten.
struct PageWriter<'a> {
    file: &'a std::fs::File,
    ram: Vec<(u64, u64, u64)>,
    iov: Vec<IoSlice<'a>>,
    run_start: u64,
}

const ZERO_PAGE: [u8; PAGE] = [0; PAGE];

/// Most pages in one `pwritev` (the kernel takes at most 1024 buffers).
const MAX_RUN: usize = 1024;

impl<'a> PageWriter<'a> {
    fn new(file: &'a std::fs::File, mem_size: u64) -> Self {
        PageWriter {
            file,
            ram: layout::ram_ranges(mem_size),
            iov: Vec::with_capacity(MAX_RUN),
            run_start: 0,
        }
    }

    /// Queues page `pfn` (`None`: zeros); a page outside guest RAM is
    /// refused.
    fn page(&mut self, pfn: u64, data: Option<&'a [u8]>) -> Result<(), PageError> {
        let off = in_ram(&self.ram, pfn).ok_or_else(|| {
            PageError::Malformed(format!("page {pfn:#x} is outside guest memory"))
        })?;
        let next = self.run_start + (self.iov.len() * PAGE) as u64;
        if !self.iov.is_empty() && (off != next || self.iov.len() == MAX_RUN) {
            self.flush()?;
        }
        if self.iov.is_empty() {
            self.run_start = off;
        }
        self.iov.push(IoSlice::new(data.unwrap_or(&ZERO_PAGE)));
        Ok(())
    }

    fn flush(&mut self) -> Result<(), PageError> {
        sys::pwritev_all(self.file, &mut self.iov, self.run_start)?;
        self.iov.clear();
        Ok(())
    }
}

/// Writes one batch into the memory file of a guest of `mem_size` bytes;
/// returns its page count.
pub fn write_batch(file: &std::fs::File, mem_size: u64, payload: &[u8]) -> Result<u64, PageError> {
    let mut w = PageWriter::new(file, mem_size);
    let (_, count) = decode_pages(payload, |pfn, data| w.page(pfn, data))?;
    w.flush()?;
    Ok(u64::from(count))
}

/// The guest page ranges `[first, end)` behind the memory file's data
/// `extents`, ascending.
pub fn ranges_of_extents(extents: &[(u64, u64)], mem_size: u64) -> Vec<(u64, u64)> {
    let page = PAGE as u64;
    let mut out = Vec::new();
    for &(start, end) in extents {
        for (base, len, foff) in layout::ram_ranges(mem_size) {
            let (lo, hi) = (start.max(foff), end.min(foff + len));
            if lo < hi {
                let first = (base + lo - foff) / page;
                let last = (base + hi - foff).div_ceil(page);
                out.push((first, last));
            }
        }
    }
    out.sort_unstable();
    out
}

/// Whether a walk of the ranges `ahead`, now at page `cursor` (sent), will
/// still visit page `pfn`.
pub fn will_visit(ahead: &[(u64, u64)], cursor: u64, pfn: u64) -> bool {
    if pfn <= cursor {
        return false;
    }
    let i = ahead.partition_point(|&(_, end)| end <= pfn);
    ahead.get(i).is_some_and(|&(first, _)| first <= pfn)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm::memory::{GuestMemoryFile, MemoryBacking};

    #[test]
    fn page_frame_matches_the_reference_encoding() {
        let page = vec![7u8; PAGE];
        let mut reference = Vec::new();
        encode_pages(
            4,
            &[(5, PageData::Data(&page)), (9, PageData::Zero)],
            &mut reference,
        );
        let mut f = PageFrame::new();
        let fill = |v: u8| {
            move |d: &mut [u8]| -> Result<(), ()> {
                d.fill(v);
                Ok(())
            }
        };
        assert_eq!(f.push_with(5, false, fill(7)), Ok(false));
        // Dropped: not in the payload.
        assert_eq!(f.push_with(6, true, fill(0)), Ok(true));
        assert_eq!(f.push_with(9, false, fill(0)), Ok(true));
        assert_eq!(f.count(), 2);
        assert_eq!(f.payload(4), &reference[..]);
        assert_eq!(batch_count(f.payload(4)), 2);
        f.clear();
        assert_eq!(f.payload(4), &[4, 0, 0, 0, 0, 0, 0, 0]);
        for pfn in 0..MAX_PAGES_PER_FRAME as u64 {
            f.push_with(pfn, false, fill(1)).unwrap();
        }
        assert!(f.is_full());
        let (_, count) = decode_pages(f.payload(1), |_, d| {
            assert_eq!(d.map(|d| d[4095]), Some(1));
            Ok(())
        })
        .unwrap();
        assert_eq!(count as usize, MAX_PAGES_PER_FRAME);
    }

    #[test]
    fn zero_detection() {
        let mut p = vec![0u8; PAGE];
        assert!(is_zero(&p));
        p[PAGE - 1] = 1;
        assert!(!is_zero(&p));
        p[PAGE - 1] = 0;
        p[0] = 0x80;
        assert!(!is_zero(&p));
    }

    #[test]
    fn pages_round_trip_and_reject_malformed() {
        let page = vec![7u8; PAGE];
        let mut out = Vec::new();
        encode_pages(
            3,
            &[(5, PageData::Data(&page)), (9, PageData::Zero)],
            &mut out,
        );
        let mut seen = Vec::new();
        let (round, count) = decode_pages(&out, |pfn, d| {
            seen.push((pfn, d.map(|d| d[0])));
            Ok(())
        })
        .unwrap();
        assert_eq!((round, count), (3, 2));
        assert_eq!(seen, vec![(5, Some(7)), (9, None)]);
        let ok = |_: u64, _: Option<&[u8]>| Ok(());
        assert!(decode_pages(&out[..out.len() - 1], ok).is_err());
        let mut extra = out.clone();
        extra.push(0);
        assert!(decode_pages(&extra, ok).is_err());
        let mut flag = out.clone();
        flag[16] = 9;
        assert!(decode_pages(&flag, ok).is_err());
        let mut many = out.clone();
        many[4..8].copy_from_slice(&100_000u32.to_le_bytes());
        assert!(decode_pages(&many, ok).is_err());
    }

    #[test]
    fn received_pages_land_at_their_offsets_and_outside_ram_is_refused() {
        use std::os::unix::fs::FileExt;
        let size = 4u64 << 30;
        let file = GuestMemoryFile::create(size, &MemoryBacking::Memfd).unwrap();
        let (a, b) = ([3u8; PAGE], [4u8; PAGE]);
        let high = layout::MMIO_GAP_END / 4096;
        let low_end = layout::MMIO_GAP_START / 4096 - 1;
        let mut frame = Vec::new();
        // A run across the MMIO gap (contiguous in the file), a zero page
        // over an earlier write, a lone page.
        encode_pages(
            1,
            &[
                (5, PageData::Data(&a)),
                (7, PageData::Data(&a)),
                (7, PageData::Zero),
                (low_end, PageData::Data(&a)),
                (high, PageData::Data(&b)),
                (high + 1, PageData::Data(&a)),
            ],
            &mut frame,
        );
        assert_eq!(check_batch(size, &frame).unwrap(), 6);
        assert_eq!(write_batch(file.file(), size, &frame).unwrap(), 6);
        let byte = |off: u64| {
            let mut x = [0u8; 1];
            file.file().read_exact_at(&mut x, off).unwrap();
            x[0]
        };
        assert_eq!(byte(5 * 4096 + 9), 3);
        assert_eq!(byte(6 * 4096), 0);
        assert_eq!(byte(7 * 4096 + 1), 0);
        assert_eq!(byte(low_end * 4096), 3);
        assert_eq!(byte(layout::MMIO_GAP_START), 4);
        assert_eq!(byte(layout::MMIO_GAP_START + 4096 + 4095), 3);
        for pfn in [layout::MMIO_GAP_START / 4096, high + (1 << 20), u64::MAX] {
            encode_pages(1, &[(pfn, PageData::Data(&a))], &mut frame);
            assert!(matches!(
                write_batch(file.file(), size, &frame),
                Err(PageError::Malformed(_))
            ));
            assert!(check_batch(size, &frame).is_err());
            assert_eq!(pfn_offset(size, pfn), None);
        }
    }

    #[test]
    fn extents_become_page_ranges_visited_in_order() {
        let size = 4u64 << 30;
        let gap = layout::MMIO_GAP_START;
        let high = layout::MMIO_GAP_END / 4096;
        // One extent across the end of low RAM (the file continues with
        // the RAM above the MMIO gap), one inside the first page.
        let ranges = ranges_of_extents(&[(100, 200), (gap - 8192, gap + 4096)], size);
        assert_eq!(
            ranges,
            vec![(0, 1), (gap / 4096 - 2, gap / 4096), (high, high + 1)]
        );
        assert!(will_visit(&ranges, 0, high));
        assert!(will_visit(&ranges, gap / 4096 - 2, gap / 4096 - 1));
        // Behind the cursor, or in a hole: not visited.
        assert!(!will_visit(&ranges, gap / 4096 - 1, gap / 4096 - 2));
        assert!(!will_visit(&ranges, 0, 5));
        assert!(!will_visit(&ranges, 0, high + 1));
    }
}
