//! Parsing of virtio-blk requests from guest descriptor chains.
//!
//! Everything here is guest-controlled input. [`parse_request`] is a pure
//! function of guest memory and one descriptor chain: it reads the header and
//! (for discard/write-zeroes) the ranges, and checks the chain's shape, but
//! writes nothing, so it can be fuzzed on its own.
//!
//! Layout accepted (virtio 1.2, 5.2.6; any framing of the bytes into
//! descriptors, as VERSION_1 requires):
//! ```text
//! device-readable: header (16 bytes) [data for OUT / DISCARD / WRITE_ZEROES]
//! device-writable: [data for IN / GET_ID] status (1 byte, last)
//! ```

use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use crate::memory::GuestMemoryMmap;

/// Bytes of the request header (type, reserved, sector).
pub const HEADER_SIZE: u64 = 16;
/// Bytes of one discard / write-zeroes range.
pub const RANGE_SIZE: u64 = 16;
/// Longest descriptor chain accepted.
pub const MAX_DESCRIPTORS: usize = 256;
/// Most ranges in one discard / write-zeroes request (advertised in config space).
pub const MAX_RANGES: u32 = 32;
/// Largest range of one discard / write-zeroes, in sectors (advertised).
pub const MAX_RANGE_SECTORS: u32 = 1 << 22;
/// VIRTIO_BLK_ID_BYTES.
pub const ID_BYTES: usize = 20;

/// Request types (VIRTIO_BLK_T_*).
pub mod types {
    /// Read.
    pub const IN: u32 = 0;
    /// Write.
    pub const OUT: u32 = 1;
    /// Flush the write cache.
    pub const FLUSH: u32 = 4;
    /// Device identifier.
    pub const GET_ID: u32 = 8;
    /// Discard ranges.
    pub const DISCARD: u32 = 11;
    /// Zero ranges.
    pub const WRITE_ZEROES: u32 = 13;
}

/// Flag of a write-zeroes range: the device may deallocate the range.
pub const RANGE_FLAG_UNMAP: u32 = 1;

/// One guest buffer (already checked to be inside guest memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Guest-physical address.
    pub addr: GuestAddress,
    /// Length in bytes.
    pub len: u32,
}

/// One range of a discard or write-zeroes request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// First sector.
    pub sector: u64,
    /// Number of sectors.
    pub num_sectors: u32,
    /// VIRTIO_BLK_WRITE_ZEROES_FLAG_* bits.
    pub flags: u32,
}

/// What a well-formed request asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestKind {
    /// Read `len` bytes at the sector into the data segments.
    In,
    /// Write the data segments at the sector.
    Out,
    /// Flush.
    Flush,
    /// Write the device ID into the data segments.
    GetId,
    /// Discard the ranges.
    Discard(Vec<Range>),
    /// Zero the ranges.
    WriteZeroes(Vec<Range>),
    /// A type we do not implement: answered with VIRTIO_BLK_S_UNSUPP.
    Unsupported,
}

/// A parsed, checked request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// VIRTIO_BLK_T_* as sent by the guest.
    pub request_type: u32,
    /// The kind with its arguments.
    pub kind: RequestKind,
    /// First sector (IN, OUT).
    pub sector: u64,
    /// Data buffers: device-readable for OUT, device-writable for IN / GET_ID.
    pub data: Vec<Segment>,
    /// Sum of the data segments' lengths.
    pub data_len: u64,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

/// Why a chain was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// No descriptor could be read.
    #[error("empty descriptor chain")]
    Empty,
    /// More than [`MAX_DESCRIPTORS`] descriptors.
    #[error("descriptor chain longer than {MAX_DESCRIPTORS}")]
    TooLong,
    /// The chain ends on a descriptor that says more follow: it loops, points at
    /// an index outside the table, or at unreadable memory.
    #[error("descriptor chain is cut short (loop, bad next index or unreadable table)")]
    Truncated,
    /// A zero-length descriptor.
    #[error("zero-length descriptor")]
    ZeroLength,
    /// A buffer outside guest memory.
    #[error("buffer {addr:#x}+{len} is outside guest memory")]
    OutOfMemory {
        /// Buffer address.
        addr: u64,
        /// Buffer length.
        len: u32,
    },
    /// A device-readable descriptor after a device-writable one.
    #[error("device-readable descriptor after a device-writable one")]
    ReadableAfterWritable,
    /// The last descriptor is not device-writable.
    #[error("no device-writable status byte at the end of the chain")]
    NoStatus,
    /// Fewer than 16 readable bytes.
    #[error("request header is shorter than 16 bytes")]
    ShortHeader,
    /// Data in the wrong direction for the request type.
    #[error("request type {0} has data in the wrong direction")]
    WrongDirection(u32),
    /// Data length is zero or not a multiple of the sector / range size.
    #[error("request type {request_type} has a bad data length {len}")]
    BadLength {
        /// Type.
        request_type: u32,
        /// Data length.
        len: u64,
    },
    /// The request reaches past the end of the disk.
    #[error("request at sector {sector} of {len} bytes is beyond the disk's {capacity} bytes")]
    BeyondCapacity {
        /// First sector.
        sector: u64,
        /// Length in bytes.
        len: u64,
        /// Disk size.
        capacity: u64,
    },
    /// Guest memory could not be read.
    #[error("cannot read request from guest memory")]
    Memory,
}

/// A rejected chain, and where its status byte is if one could be found (the
/// device then answers VIRTIO_BLK_S_IOERR there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseFailure {
    /// What was wrong.
    pub error: ChainError,
    /// The status byte's address, if the chain's shape allowed finding it.
    pub status: Option<GuestAddress>,
}

/// A descriptor as the parser sees it (decoupled from virtio-queue's type so
/// that tests and fuzzers can feed any sequence).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawDesc {
    /// Guest-physical address.
    pub addr: u64,
    /// Length.
    pub len: u32,
    /// Device-writable.
    pub write: bool,
    /// VRING_DESC_F_NEXT was set.
    pub has_next: bool,
}

impl From<virtio_queue::desc::split::Descriptor> for RawDesc {
    fn from(d: virtio_queue::desc::split::Descriptor) -> Self {
        RawDesc {
            addr: d.addr().raw_value(),
            len: d.len(),
            write: d.is_write_only(),
            has_next: d.has_next(),
        }
    }
}

fn fail(error: ChainError, status: Option<GuestAddress>) -> ParseFailure {
    ParseFailure { error, status }
}

fn total(segments: &[Segment]) -> u64 {
    segments.iter().map(|s| u64::from(s.len)).sum()
}

/// The segments covering bytes `[start, start + len)` of `segments`.
pub fn sub_segments(segments: &[Segment], start: u64, len: u64) -> Vec<Segment> {
    let mut out = Vec::new();
    let (mut skip, mut left) = (start, len);
    for s in segments {
        if left == 0 {
            break;
        }
        let slen = u64::from(s.len);
        if skip >= slen {
            skip -= slen;
            continue;
        }
        let take = (slen - skip).min(left);
        // In range: each segment was checked against guest memory.
        out.push(Segment {
            addr: s.addr.unchecked_add(skip),
            len: take as u32,
        });
        left -= take;
        skip = 0;
    }
    out
}

/// Reads exactly `buf.len()` bytes from the start of `segments`.
pub fn gather(
    mem: &GuestMemoryMmap,
    segments: &[Segment],
    buf: &mut [u8],
) -> Result<(), ChainError> {
    let mut done = 0;
    for s in sub_segments(segments, 0, buf.len() as u64) {
        let n = s.len as usize;
        mem.read_slice(&mut buf[done..done + n], s.addr)
            .map_err(|_| ChainError::Memory)?;
        done += n;
    }
    if done != buf.len() {
        return Err(ChainError::Memory);
    }
    Ok(())
}

/// Checks one chain and extracts the request it carries.
///
/// `capacity` is the disk size in bytes.
pub fn parse_request(
    mem: &GuestMemoryMmap,
    descriptors: impl IntoIterator<Item = RawDesc>,
    capacity: u64,
) -> Result<Request, ParseFailure> {
    let mut readable = Vec::new();
    let mut writable: Vec<Segment> = Vec::new();
    let mut last = None;
    let mut count = 0usize;
    let mut shape_error = None;
    for d in descriptors {
        count += 1;
        if count > MAX_DESCRIPTORS {
            return Err(fail(ChainError::TooLong, None));
        }
        last = Some(d);
        if shape_error.is_some() {
            continue;
        }
        if d.len == 0 {
            shape_error = Some(ChainError::ZeroLength);
        } else if !mem.check_range(GuestAddress(d.addr), d.len as usize) {
            shape_error = Some(ChainError::OutOfMemory {
                addr: d.addr,
                len: d.len,
            });
        } else if d.write {
            writable.push(Segment {
                addr: GuestAddress(d.addr),
                len: d.len,
            });
        } else if !writable.is_empty() {
            shape_error = Some(ChainError::ReadableAfterWritable);
        } else {
            readable.push(Segment {
                addr: GuestAddress(d.addr),
                len: d.len,
            });
        }
    }
    let Some(last) = last else {
        return Err(fail(ChainError::Empty, None));
    };
    if last.has_next {
        return Err(fail(ChainError::Truncated, None));
    }
    // The status byte: last byte of the last descriptor, if that is writable and
    // inside guest memory.
    let status =
        (last.write && last.len > 0 && mem.check_range(GuestAddress(last.addr), last.len as usize))
            .then(|| GuestAddress(last.addr).unchecked_add(u64::from(last.len) - 1));
    if let Some(e) = shape_error {
        return Err(fail(e, status));
    }
    let Some(status) = status else {
        return Err(fail(ChainError::NoStatus, None));
    };
    let fail_here = |e| Err(fail(e, Some(status)));

    let readable_len = total(&readable);
    let writable_len = total(&writable) - 1;
    if readable_len < HEADER_SIZE {
        return fail_here(ChainError::ShortHeader);
    }
    let mut header = [0u8; HEADER_SIZE as usize];
    if let Err(e) = gather(mem, &readable, &mut header) {
        return fail_here(e);
    }
    let request_type = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let mut sector_bytes = [0u8; 8];
    sector_bytes.copy_from_slice(&header[8..16]);
    let sector = u64::from_le_bytes(sector_bytes);
    let in_data = sub_segments(&writable, 0, writable_len);
    let out_data = sub_segments(&readable, HEADER_SIZE, readable_len - HEADER_SIZE);
    let out_len = readable_len - HEADER_SIZE;

    let request = |kind, data: Vec<Segment>, data_len| Request {
        request_type,
        kind,
        sector,
        data,
        data_len,
        status,
    };
    let bad_len = |len| ChainError::BadLength { request_type, len };
    match request_type {
        types::IN | types::OUT => {
            let (data, len, wrong) = if request_type == types::IN {
                (in_data, writable_len, out_len != 0)
            } else {
                (out_data, out_len, writable_len != 0)
            };
            if wrong {
                return fail_here(ChainError::WrongDirection(request_type));
            }
            if len == 0 || !len.is_multiple_of(512) {
                return fail_here(bad_len(len));
            }
            if let Err(e) = check_capacity(sector, len, capacity) {
                return fail_here(e);
            }
            let kind = if request_type == types::IN {
                RequestKind::In
            } else {
                RequestKind::Out
            };
            Ok(request(kind, data, len))
        }
        types::FLUSH => {
            if out_len != 0 || writable_len != 0 {
                return fail_here(ChainError::WrongDirection(request_type));
            }
            Ok(request(RequestKind::Flush, Vec::new(), 0))
        }
        types::GET_ID => {
            if out_len != 0 {
                return fail_here(ChainError::WrongDirection(request_type));
            }
            Ok(request(RequestKind::GetId, in_data, writable_len))
        }
        types::DISCARD | types::WRITE_ZEROES => {
            if writable_len != 0 {
                return fail_here(ChainError::WrongDirection(request_type));
            }
            if out_len == 0
                || !out_len.is_multiple_of(RANGE_SIZE)
                || out_len / RANGE_SIZE > u64::from(MAX_RANGES)
            {
                return fail_here(bad_len(out_len));
            }
            let mut raw = vec![0u8; out_len as usize];
            if let Err(e) = gather(mem, &out_data, &mut raw) {
                return fail_here(e);
            }
            let mut ranges = Vec::with_capacity(raw.len() / RANGE_SIZE as usize);
            for r in raw.chunks_exact(RANGE_SIZE as usize) {
                let mut s = [0u8; 8];
                s.copy_from_slice(&r[0..8]);
                let range = Range {
                    sector: u64::from_le_bytes(s),
                    num_sectors: u32::from_le_bytes([r[8], r[9], r[10], r[11]]),
                    flags: u32::from_le_bytes([r[12], r[13], r[14], r[15]]),
                };
                if let Err(e) =
                    check_capacity(range.sector, u64::from(range.num_sectors) * 512, capacity)
                {
                    return fail_here(e);
                }
                ranges.push(range);
            }
            let kind = if request_type == types::DISCARD {
                RequestKind::Discard(ranges)
            } else {
                RequestKind::WriteZeroes(ranges)
            };
            Ok(request(kind, Vec::new(), 0))
        }
        _ => Ok(request(RequestKind::Unsupported, Vec::new(), 0)),
    }
}

fn check_capacity(sector: u64, len: u64, capacity: u64) -> Result<(), ChainError> {
    let end = sector.checked_mul(512).and_then(|off| off.checked_add(len));
    match end {
        Some(end) if end <= capacity => Ok(()),
        _ => Err(ChainError::BeyondCapacity {
            sector,
            len,
            capacity,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{GuestMemoryFile, MemoryBacking};

    fn mem() -> GuestMemoryMmap {
        GuestMemoryFile::create(16 << 20, &MemoryBacking::Memfd)
            .unwrap()
            .map()
            .unwrap()
    }

    fn header(mem: &GuestMemoryMmap, addr: u64, t: u32, sector: u64) {
        mem.write_obj(t, GuestAddress(addr)).unwrap();
        mem.write_obj(0u32, GuestAddress(addr + 4)).unwrap();
        mem.write_obj(sector, GuestAddress(addr + 8)).unwrap();
    }

    fn d(addr: u64, len: u32, write: bool, has_next: bool) -> RawDesc {
        RawDesc {
            addr,
            len,
            write,
            has_next,
        }
    }

    const CAP: u64 = 1 << 20;

    #[test]
    fn read_request_any_framing() {
        let m = mem();
        header(&m, 0x1000, types::IN, 3);
        let r = parse_request(
            &m,
            [
                d(0x1000, 16, false, true),
                d(0x2000, 512, true, true),
                d(0x3000, 1, true, false),
            ],
            CAP,
        )
        .unwrap();
        assert_eq!(r.kind, RequestKind::In);
        assert_eq!(
            (r.sector, r.data_len, r.status),
            (3, 512, GuestAddress(0x3000))
        );
        // Data and status in one descriptor.
        let r = parse_request(
            &m,
            [d(0x1000, 16, false, true), d(0x2000, 1025, true, false)],
            CAP,
        )
        .unwrap();
        assert_eq!(
            r.data,
            vec![Segment {
                addr: GuestAddress(0x2000),
                len: 1024
            }]
        );
        assert_eq!(r.status, GuestAddress(0x2400));
    }

    #[test]
    fn write_request_header_and_data_in_one_descriptor() {
        let m = mem();
        header(&m, 0x1000, types::OUT, 0);
        let r = parse_request(
            &m,
            [d(0x1000, 16 + 512, false, true), d(0x3000, 1, true, false)],
            CAP,
        )
        .unwrap();
        assert_eq!(r.kind, RequestKind::Out);
        assert_eq!(
            r.data,
            vec![Segment {
                addr: GuestAddress(0x1010),
                len: 512
            }]
        );
    }

    #[test]
    fn rejections() {
        let m = mem();
        header(&m, 0x1000, types::IN, 0);
        let err = |descs: Vec<RawDesc>, cap| parse_request(&m, descs, cap).unwrap_err();
        // Wrong direction: readable data on a read; status is still found.
        let e = err(
            vec![d(0x1000, 528, false, true), d(0x3000, 1, true, false)],
            CAP,
        );
        assert_eq!(e.error, ChainError::WrongDirection(0));
        assert_eq!(e.status, Some(GuestAddress(0x3000)));
        // Beyond capacity, also through overflow.
        header(&m, 0x1000, types::IN, (CAP / 512) - 1);
        let e = err(
            vec![
                d(0x1000, 16, false, true),
                d(0x2000, 1024, true, true),
                d(0x3000, 1, true, false),
            ],
            CAP,
        );
        assert!(matches!(e.error, ChainError::BeyondCapacity { .. }));
        header(&m, 0x1000, types::IN, u64::MAX / 256);
        let e = err(
            vec![
                d(0x1000, 16, false, true),
                d(0x2000, 512, true, true),
                d(0x3000, 1, true, false),
            ],
            CAP,
        );
        assert!(matches!(e.error, ChainError::BeyondCapacity { .. }));
        // Outside guest memory; the status is still usable.
        let e = err(
            vec![
                d(0x1000, 16, false, true),
                d(1 << 40, 512, true, true),
                d(0x3000, 1, true, false),
            ],
            CAP,
        );
        assert!(matches!(e.error, ChainError::OutOfMemory { .. }));
        assert_eq!(e.status, Some(GuestAddress(0x3000)));
        // Straddling the end of memory.
        let e = err(
            vec![
                d(0x1000, 16, false, true),
                d((16 << 20) - 256, 512, true, true),
                d(0x3000, 1, true, false),
            ],
            CAP,
        );
        assert!(matches!(e.error, ChainError::OutOfMemory { .. }));
        // Status outside memory: nothing to answer.
        let e = err(
            vec![d(0x1000, 16, false, true), d(u64::MAX, 1, true, false)],
            CAP,
        );
        assert_eq!(e.status, None);
        // Last descriptor readable.
        let e = err(vec![d(0x1000, 16, false, false)], CAP);
        assert_eq!(e.error, ChainError::NoStatus);
        // Cut short (loop / bad next).
        let e = err(
            vec![d(0x1000, 16, false, true), d(0x3000, 1, true, true)],
            CAP,
        );
        assert_eq!(e.error, ChainError::Truncated);
        // Too long.
        let e = err(vec![d(0x1000, 16, false, true); MAX_DESCRIPTORS + 1], CAP);
        assert_eq!(e.error, ChainError::TooLong);
        assert_eq!(err(vec![], CAP).error, ChainError::Empty);
        // Readable after writable.
        let e = err(
            vec![
                d(0x1000, 16, false, true),
                d(0x2000, 512, true, true),
                d(0x2000, 512, false, true),
                d(0x3000, 1, true, false),
            ],
            CAP,
        );
        assert_eq!(e.error, ChainError::ReadableAfterWritable);
        // Short header, zero length, unaligned length.
        let e = err(
            vec![d(0x1000, 8, false, true), d(0x3000, 1, true, false)],
            CAP,
        );
        assert_eq!(e.error, ChainError::ShortHeader);
        let e = err(
            vec![
                d(0x1000, 16, false, true),
                d(0x2000, 0, true, true),
                d(0x3000, 1, true, false),
            ],
            CAP,
        );
        assert_eq!(e.error, ChainError::ZeroLength);
        header(&m, 0x1000, types::IN, 0);
        let e = err(
            vec![
                d(0x1000, 16, false, true),
                d(0x2000, 100, true, true),
                d(0x3000, 1, true, false),
            ],
            CAP,
        );
        assert!(matches!(e.error, ChainError::BadLength { .. }));
    }

    #[test]
    fn discard_ranges_are_checked() {
        let m = mem();
        header(&m, 0x1000, types::DISCARD, 0);
        m.write_obj(8u64, GuestAddress(0x1010)).unwrap();
        m.write_obj(16u32, GuestAddress(0x1018)).unwrap();
        m.write_obj(0u32, GuestAddress(0x101c)).unwrap();
        let r = parse_request(
            &m,
            [d(0x1000, 32, false, true), d(0x3000, 1, true, false)],
            CAP,
        )
        .unwrap();
        assert_eq!(
            r.kind,
            RequestKind::Discard(vec![Range {
                sector: 8,
                num_sectors: 16,
                flags: 0
            }])
        );
        m.write_obj(CAP / 512, GuestAddress(0x1010)).unwrap();
        let e = parse_request(
            &m,
            [d(0x1000, 32, false, true), d(0x3000, 1, true, false)],
            CAP,
        )
        .unwrap_err();
        assert!(matches!(e.error, ChainError::BeyondCapacity { .. }));
        let e = parse_request(
            &m,
            [d(0x1000, 24, false, true), d(0x3000, 1, true, false)],
            CAP,
        )
        .unwrap_err();
        assert!(matches!(e.error, ChainError::BadLength { .. }));
    }
}
