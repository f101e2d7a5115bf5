//! Finds the blocks an ext2/3/4 file system in an image uses, from its
//! superblock, group descriptors and block bitmaps, so that the proxy's
//! background copy can fetch live data before free space.

use std::io;

use thiserror::Error;

const SUPERBLOCK_OFFSET: u64 = 1024;
const EXT_MAGIC: u16 = 0xef53;
const INCOMPAT_META_BG: u32 = 0x10;
const INCOMPAT_64BIT: u32 = 0x80;
const BG_BLOCK_UNINIT: u16 = 0x2;
/// Upper bound on groups we are willing to parse (a 512 TiB fs at 128 MiB groups).
const MAX_GROUPS: u64 = 1 << 22;

#[derive(Debug, Error)]
pub enum ExtError {
    #[error("reading the image")]
    Io(#[from] io::Error),
    #[error("ext superblock field {field} is invalid ({value})")]
    Invalid { field: &'static str, value: u64 },
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// A bitset over the image's 4 KiB cache blocks: set = in use by the file system.
#[derive(Debug, Clone)]
pub struct UsedBlocks {
    pub bits: Vec<u64>,
    pub fs_block_size: u64,
    pub used_fs_blocks: u64,
}

impl UsedBlocks {
    pub fn contains(&self, block: u64) -> bool {
        self.bits
            .get((block / 64) as usize)
            .is_some_and(|w| w & (1 << (block % 64)) != 0)
    }
}

/// Parses the file system through `read(offset, buf)`. Returns `Ok(None)`
/// when the image holds no ext file system this parser understands.
pub fn used_blocks(
    read: &mut dyn FnMut(u64, &mut [u8]) -> io::Result<()>,
    image_size: u64,
    cache_block: u64,
) -> Result<Option<UsedBlocks>, ExtError> {
    if image_size < SUPERBLOCK_OFFSET + 1024 {
        return Ok(None);
    }
    let mut sb = vec![0u8; 1024];
    read(SUPERBLOCK_OFFSET, &mut sb)?;
    if le16(&sb, 56) != EXT_MAGIC {
        return Ok(None);
    }
    let log = le32(&sb, 24);
    if log > 6 {
        return Err(ExtError::Invalid {
            field: "s_log_block_size",
            value: log.into(),
        });
    }
    let bs = 1024u64 << log;
    let incompat = le32(&sb, 96);
    if incompat & INCOMPAT_META_BG != 0 {
        return Ok(None);
    }
    let mut blocks = u64::from(le32(&sb, 4));
    let desc_size = if incompat & INCOMPAT_64BIT != 0 {
        blocks |= u64::from(le32(&sb, 0x150)) << 32;
        u64::from(le16(&sb, 0xfe)).max(32)
    } else {
        32
    };
    let first = u64::from(le32(&sb, 20));
    let bpg = u64::from(le32(&sb, 32));
    if bpg == 0 || bpg > bs * 8 {
        return Err(ExtError::Invalid {
            field: "s_blocks_per_group",
            value: bpg,
        });
    }
    if blocks <= first || blocks.saturating_mul(bs) > image_size.saturating_mul(2) {
        return Err(ExtError::Invalid {
            field: "s_blocks_count",
            value: blocks,
        });
    }
    let groups = (blocks - first).div_ceil(bpg);
    if groups > MAX_GROUPS {
        return Err(ExtError::Invalid {
            field: "group count",
            value: groups,
        });
    }
    let gdt_off = (first + 1) * bs;
    let gdt_len = groups * desc_size;
    if gdt_off + gdt_len > image_size {
        return Err(ExtError::Invalid {
            field: "group descriptor table end",
            value: gdt_off + gdt_len,
        });
    }
    let mut gdt = vec![0u8; gdt_len as usize];
    read(gdt_off, &mut gdt)?;

    let nblocks = image_size.div_ceil(cache_block);
    let mut bits = vec![0u64; nblocks.div_ceil(64) as usize];
    let mut mark = |fs_block: u64, count: u64| {
        let start = fs_block * bs / cache_block;
        let end = ((fs_block + count) * bs).div_ceil(cache_block).min(nblocks);
        for b in start..end {
            bits[(b / 64) as usize] |= 1 << (b % 64);
        }
    };
    // Everything up to the end of the descriptor table is metadata.
    mark(0, (gdt_off + gdt_len).div_ceil(bs));
    let mut used_fs_blocks = 0;
    let mut bitmap = vec![0u8; bs as usize];
    for g in 0..groups {
        let d = &gdt[(g * desc_size) as usize..((g + 1) * desc_size) as usize];
        let flags = le16(d, 0x12);
        if flags & BG_BLOCK_UNINIT != 0 {
            continue;
        }
        let mut loc = u64::from(le32(d, 0));
        if desc_size >= 64 {
            loc |= u64::from(le32(d, 0x20)) << 32;
        }
        if loc == 0 || (loc + 1) * bs > image_size {
            return Err(ExtError::Invalid {
                field: "bg_block_bitmap",
                value: loc,
            });
        }
        read(loc * bs, &mut bitmap)?;
        let base = first + g * bpg;
        let in_group = bpg.min(blocks - base);
        let mut run: Option<(u64, u64)> = None;
        for j in 0..in_group {
            let used = bitmap[(j / 8) as usize] & (1 << (j % 8)) != 0;
            if used {
                used_fs_blocks += 1;
                run = match run {
                    Some((s, n)) => Some((s, n + 1)),
                    None => Some((base + j, 1)),
                };
            } else if let Some((s, n)) = run.take() {
                mark(s, n);
            }
        }
        if let Some((s, n)) = run {
            mark(s, n);
        }
    }
    Ok(Some(UsedBlocks {
        bits,
        fs_block_size: bs,
        used_fs_blocks,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_ext_is_none() {
        let img = vec![0u8; 1 << 20];
        let mut rd = |o: u64, b: &mut [u8]| {
            b.copy_from_slice(&img[o as usize..o as usize + b.len()]);
            Ok(())
        };
        assert!(used_blocks(&mut rd, img.len() as u64, 4096)
            .unwrap()
            .is_none());
    }

    #[test]
    fn hostile_superblock_is_rejected() {
        let mut img = vec![0u8; 1 << 20];
        img[1024 + 56] = 0x53;
        img[1024 + 57] = 0xef;
        img[1024 + 24] = 200; // absurd block size
        let mut rd = |o: u64, b: &mut [u8]| {
            b.copy_from_slice(&img[o as usize..o as usize + b.len()]);
            Ok(())
        };
        assert!(used_blocks(&mut rd, 1 << 20, 4096).is_err());
    }

    /// A hand-built 1-group ext2 image with 4 KiB blocks: blocks 0..3 and 10 used.
    #[test]
    fn minimal_image() {
        let bs = 4096usize;
        let mut img = vec![0u8; 64 * bs];
        let sb = &mut img[1024..2048];
        sb[4..8].copy_from_slice(&64u32.to_le_bytes());
        sb[24..28].copy_from_slice(&2u32.to_le_bytes());
        sb[32..36].copy_from_slice(&32768u32.to_le_bytes());
        sb[56..58].copy_from_slice(&EXT_MAGIC.to_le_bytes());
        // GDT at block 1: bitmap in block 2.
        img[bs..bs + 4].copy_from_slice(&2u32.to_le_bytes());
        img[2 * bs] = 0b0000_1111;
        img[2 * bs + 1] = 0b0000_0100;
        let mut rd = |o: u64, b: &mut [u8]| {
            b.copy_from_slice(&img[o as usize..o as usize + b.len()]);
            Ok(())
        };
        let u = used_blocks(&mut rd, (64 * bs) as u64, 4096)
            .unwrap()
            .unwrap();
        assert_eq!(u.used_fs_blocks, 5);
        assert!(u.contains(0) && u.contains(3) && u.contains(10));
        assert!(!u.contains(4) && !u.contains(11));
    }
}
