//! The memory image's index, `memory.extents`: every data extent of
//! `memory.bin` (a run of non-zero pages, at most 1 MiB) with its CRC-32, so
//! that a restore refuses a damaged image — naming the extent — instead of
//! running the guest on it. A pure codec: its decoder takes file input and
//! is fuzzed (`crates/vmm/fuzz`, target `state_file`).
//!
//! ```text
//! offset    size  field
//!      0       8  magic "KEMARIMX"
//!      8       4  version (u32 LE): 1
//!     12       4  reserved (0)
//!     16       8  guest memory size (u64 LE), the image's size
//!     24       8  extent count n (u64 LE)
//!     32    16*n  extents in offset order: offset u64 LE, length u32 LE, CRC-32 (IEEE) u32 LE
//!  32+16n      4  CRC-32 of everything before
//! ```
//!
//! The checksums guard against accidental damage (a flipped bit, a bad
//! copy), not against tampering: whoever can write `memory.bin` can write
//! its index too (both are 0600).

/// File magic.
pub const MAGIC: &[u8; 8] = b"KEMARIMX";
/// Index version written and read.
pub const VERSION: u32 = 1;
/// Largest extent (the copy buffer).
pub const MAX_EXTENT: u32 = 1 << 20;
const HEADER_LEN: usize = 32;
const ENTRY_LEN: usize = 16;
const PAGE: u64 = 4096;

/// One data extent of the image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Offset in the image (= in guest memory's file).
    pub offset: u64,
    /// Length in bytes (1..=[`MAX_EXTENT`]).
    pub len: u32,
    /// CRC-32 (IEEE) of the extent's bytes.
    pub crc: u32,
}

impl Extent {
    /// The extent of `data`, at `offset`.
    pub fn of(offset: u64, data: &[u8]) -> Self {
        Extent {
            offset,
            len: data.len() as u32,
            crc: crc32fast::hash(data),
        }
    }

    fn end(&self) -> u64 {
        self.offset + u64::from(self.len)
    }
}

/// Why an index was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// Shorter than its header and trailer.
    #[error("is truncated ({0} bytes)")]
    Truncated(usize),
    /// Another kind of file.
    #[error("is not a kemari memory image index (bad magic)")]
    BadMagic,
    /// Another version.
    #[error("has version {0}, this kemari reads version {VERSION}")]
    Version(u32),
    /// The count does not match the length.
    #[error("declares {count} extents, which do not fill its {len} bytes")]
    Count {
        /// Declared extents.
        count: u64,
        /// File length.
        len: usize,
    },
    /// Longer than any index of this memory.
    #[error("is {0} bytes, longer than any index of this memory")]
    TooLong(u64),
    /// Its own checksum does not match.
    #[error("is corrupt (its checksum does not match)")]
    Checksum,
    /// Written for another memory size.
    #[error("describes {found} bytes of memory, the VM has {expected}")]
    Size {
        /// Size in the index.
        found: u64,
        /// The VM's memory size.
        expected: u64,
    },
    /// An extent out of order, overlapping, empty, too long or past the end.
    #[error("lists an invalid extent #{number} (offset {offset:#x}, {len} bytes)")]
    Extent {
        /// Its position in the index.
        number: u64,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u32,
    },
}

/// The largest index of memory of `size` bytes: at worst every other page
/// is a (one-page) extent.
pub fn max_len(size: u64) -> u64 {
    (size / PAGE / 2 + 1) * ENTRY_LEN as u64 + HEADER_LEN as u64 + 4
}

/// The index of an image of `size` bytes holding `extents`.
pub fn encode(size: u64, extents: &[Extent]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + extents.len() * ENTRY_LEN + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&size.to_le_bytes());
    out.extend_from_slice(&(extents.len() as u64).to_le_bytes());
    for e in extents {
        out.extend_from_slice(&e.offset.to_le_bytes());
        out.extend_from_slice(&e.len.to_le_bytes());
        out.extend_from_slice(&e.crc.to_le_bytes());
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut v = [0u8; 4];
    v.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(v)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

/// Checks an index against memory of `size` bytes and returns its extents:
/// in order, not overlapping, within `size`, each 1..=[`MAX_EXTENT`] bytes.
pub fn decode(bytes: &[u8], size: u64) -> Result<Vec<Extent>, IndexError> {
    if bytes.len() < HEADER_LEN + 4 {
        return Err(IndexError::Truncated(bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err(IndexError::BadMagic);
    }
    let version = u32_at(bytes, 8);
    if version != VERSION {
        return Err(IndexError::Version(version));
    }
    let count = u64_at(bytes, 24);
    let body = bytes.len() - HEADER_LEN - 4;
    if !body.is_multiple_of(ENTRY_LEN) || count != (body / ENTRY_LEN) as u64 {
        return Err(IndexError::Count {
            count,
            len: bytes.len(),
        });
    }
    let (covered, trailer) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(covered) != u32_at(trailer, 0) {
        return Err(IndexError::Checksum);
    }
    let found = u64_at(bytes, 16);
    if found != size {
        return Err(IndexError::Size {
            found,
            expected: size,
        });
    }
    let mut extents = Vec::with_capacity(body / ENTRY_LEN);
    let mut end = 0u64;
    for (number, entry) in covered[HEADER_LEN..].chunks_exact(ENTRY_LEN).enumerate() {
        let e = Extent {
            offset: u64_at(entry, 0),
            len: u32_at(entry, 8),
            crc: u32_at(entry, 12),
        };
        let fits = e
            .offset
            .checked_add(u64::from(e.len))
            .is_some_and(|x| x <= size);
        if e.len == 0 || e.len > MAX_EXTENT || e.offset < end || !fits {
            return Err(IndexError::Extent {
                number: number as u64,
                offset: e.offset,
                len: e.len,
            });
        }
        end = e.end();
        extents.push(e);
    }
    Ok(extents)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Extent> {
        vec![
            Extent::of(0x1000, &[1; 4096]),
            Extent::of(0x2000, &[2; 8192]),
            Extent::of(0x10_0000, &[3; 4096]),
        ]
    }

    #[test]
    fn round_trip() {
        let b = encode(64 << 20, &sample());
        assert_eq!(decode(&b, 64 << 20).unwrap(), sample());
        assert_eq!(decode(&encode(64 << 20, &[]), 64 << 20).unwrap(), vec![]);
        assert!(b.len() as u64 <= max_len(64 << 20));
    }

    #[test]
    fn refuses_damage_and_nonsense() {
        let good = encode(64 << 20, &sample());
        assert_eq!(
            decode(&good[..20], 64 << 20),
            Err(IndexError::Truncated(20))
        );
        let mut b = good.clone();
        b[0] = b'X';
        assert_eq!(decode(&b, 64 << 20), Err(IndexError::BadMagic));
        let mut b = good.clone();
        b[8] = 9;
        assert_eq!(decode(&b, 64 << 20), Err(IndexError::Version(9)));
        assert!(matches!(
            decode(&good[..good.len() - 1], 64 << 20),
            Err(IndexError::Count { .. })
        ));
        let mut b = good.clone();
        b[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            decode(&b, 64 << 20),
            Err(IndexError::Count { .. })
        ));
        let mut b = good.clone();
        b[HEADER_LEN + 3] ^= 1;
        assert_eq!(decode(&b, 64 << 20), Err(IndexError::Checksum));
        assert_eq!(
            decode(&good, 128 << 20),
            Err(IndexError::Size {
                found: 64 << 20,
                expected: 128 << 20
            })
        );
        let mut bad = sample();
        bad.swap(0, 1);
        assert!(matches!(
            decode(&encode(64 << 20, &bad), 64 << 20),
            Err(IndexError::Extent { number: 1, .. })
        ));
        for e in [
            Extent {
                offset: 0,
                len: 0,
                crc: 0,
            },
            Extent {
                offset: 0,
                len: MAX_EXTENT + 1,
                crc: 0,
            },
            Extent {
                offset: (64 << 20) - 4096,
                len: 8192,
                crc: 0,
            },
            Extent {
                offset: u64::MAX - 1,
                len: 4096,
                crc: 0,
            },
        ] {
            assert!(
                matches!(
                    decode(&encode(64 << 20, &[e]), 64 << 20),
                    Err(IndexError::Extent { number: 0, .. })
                ),
                "{e:?}"
            );
        }
    }
}
