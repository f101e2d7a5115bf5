//! The warm disk cache's store: 4 KiB blocks of a disk held in a memfd,
//! indexed by block number, least recently used evicted first.
//!
//! The store knows nothing of backends: [`crate::devices::cached_backend`]
//! decides what goes in and when (write-through, invalidation). Its data
//! lives in a memfd of `capacity` bytes (pages taken only as blocks are
//! filled), so it outlives the guest's boots in the same process and is
//! freed with the process; its index is an [`lru::LruCache`] from block
//! number to slot.

use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use lru::LruCache;

use crate::sys::{self, SharedMapping};

/// Size of a cached block.
pub const CACHE_BLOCK: usize = 4096;

/// What a disk cache did, as exposed in the device's metrics.
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct CacheCounters {
    /// Blocks of guest reads served from the cache.
    pub hits: u64,
    /// Blocks of guest reads that went to the disk.
    pub misses: u64,
    /// Bytes of guest reads served from the cache.
    pub hit_bytes: u64,
    /// Bytes of guest reads that went to the disk.
    pub miss_bytes: u64,
    /// Blocks dropped to make room.
    pub evictions: u64,
    /// Blocks dropped because the disk's copy changed behind them (discard,
    /// write-zeroes, a failed write).
    pub invalidations: u64,
    /// Bytes of cached data held now.
    pub resident_bytes: u64,
    /// The cache's size.
    pub capacity_bytes: u64,
}

/// A fixed-size store of disk blocks.
pub struct BlockStore {
    map: SharedMapping,
    _file: File,
    index: LruCache<u64, u32>,
    free: Vec<u32>,
    slots: u32,
    counters: CacheCounters,
}

impl std::fmt::Debug for BlockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockStore")
            .field("slots", &self.slots)
            .field("resident", &self.index.len())
            .finish()
    }
}

impl BlockStore {
    /// A store of `capacity` bytes (rounded down to whole blocks, at least
    /// one), its data in a new memfd named `name`.
    pub fn new(name: &CStr, capacity: u64) -> io::Result<Self> {
        let slots = u32::try_from((capacity / CACHE_BLOCK as u64).max(1))
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "cache larger than 16 TiB"))?;
        let len = slots as usize * CACHE_BLOCK;
        let file = sys::memfd_create(name, libc::MFD_CLOEXEC)?;
        file.set_len(len as u64)?;
        let map = SharedMapping::new(file.as_raw_fd(), len, 0)?;
        Ok(BlockStore {
            map,
            _file: file,
            index: LruCache::unbounded(),
            free: (0..slots).rev().collect(),
            slots,
            counters: CacheCounters {
                capacity_bytes: len as u64,
                ..Default::default()
            },
        })
    }

    fn slot(&self, slot: u32) -> *mut u8 {
        debug_assert!(slot < self.slots);
        // In bounds: slot < slots, the mapping holds slots blocks.
        self.map
            .as_ptr()
            .as_ptr()
            .cast::<u8>()
            .wrapping_add(slot as usize * CACHE_BLOCK)
    }

    /// `len` bytes of cached block `block` from `offset` within it, the
    /// block marked used; `None` if not cached.
    pub fn cached(&mut self, block: u64, offset: usize, len: usize) -> Option<&[u8]> {
        assert!(offset + len <= CACHE_BLOCK);
        let &slot = self.index.get(&block)?;
        // SAFETY: the slot lies inside the live mapping (see `slot`), and
        // `offset + len` stays within its block. Only this store writes the
        // mapping (a memfd of its own, never guest memory), through `&mut
        // self`, which the returned borrow holds.
        Some(unsafe { std::slice::from_raw_parts(self.slot(slot).add(offset), len) })
    }

    /// Copies cached block `block` into `out` (from `offset` within the
    /// block, `out.len()` bytes) and marks it used; false if not cached.
    pub fn get(&mut self, block: u64, offset: usize, out: &mut [u8]) -> bool {
        match self.cached(block, offset, out.len()) {
            Some(data) => {
                out.copy_from_slice(data);
                true
            }
            None => false,
        }
    }

    /// Whether `block` is cached (without marking it used).
    pub fn contains(&self, block: u64) -> bool {
        self.index.contains(&block)
    }

    /// Stores a whole block (replacing what was cached for it), evicting the
    /// least recently used block if the store is full.
    pub fn put(&mut self, block: u64, data: &[u8]) {
        assert_eq!(data.len(), CACHE_BLOCK);
        let slot = match self.index.get(&block) {
            Some(&slot) => slot,
            None => {
                let slot = match self.free.pop() {
                    Some(s) => s,
                    None => {
                        let (_, s) = self
                            .index
                            .pop_lru()
                            .expect("a full store has an entry to evict");
                        self.counters.evictions += 1;
                        s
                    }
                };
                self.index.put(block, slot);
                slot
            }
        };
        // SAFETY: a whole block at a slot inside the live mapping; `data` is
        // the caller's buffer, not part of the mapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.slot(slot), CACHE_BLOCK) };
    }

    /// Overwrites part of `block` if it is cached (a partial write through
    /// the cache); returns whether it was.
    pub fn patch(&mut self, block: u64, offset: usize, data: &[u8]) -> bool {
        assert!(offset + data.len() <= CACHE_BLOCK);
        let Some(&slot) = self.index.peek(&block) else {
            return false;
        };
        // SAFETY: within the slot's block of the live mapping; `data` is the
        // caller's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.slot(slot).add(offset), data.len())
        };
        true
    }

    /// Drops blocks `first..end` from the cache.
    pub fn invalidate(&mut self, first: u64, end: u64) {
        if end <= first {
            return;
        }
        let doomed: Vec<u64> = if end - first > self.index.len() as u64 {
            self.index
                .iter()
                .map(|(&b, _)| b)
                .filter(|b| (first..end).contains(b))
                .collect()
        } else {
            (first..end).filter(|b| self.index.contains(b)).collect()
        };
        for b in doomed {
            if let Some(slot) = self.index.pop(&b) {
                self.free.push(slot);
                self.counters.invalidations += 1;
            }
        }
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.counters.invalidations += self.index.len() as u64;
        self.index.clear();
        self.free = (0..self.slots).rev().collect();
    }

    /// Counts a read served from the cache (`blocks` blocks, `bytes` bytes).
    pub fn count_hits(&mut self, blocks: u64, bytes: u64) {
        self.counters.hits += blocks;
        self.counters.hit_bytes += bytes;
    }

    /// Counts a read that went to the disk.
    pub fn count_misses(&mut self, blocks: u64, bytes: u64) {
        self.counters.misses += blocks;
        self.counters.miss_bytes += bytes;
    }

    /// The counters, with the bytes held now.
    pub fn counters(&self) -> CacheCounters {
        CacheCounters {
            resident_bytes: (self.index.len() * CACHE_BLOCK) as u64,
            ..self.counters.clone()
        }
    }
}

// SAFETY: the mapping is owned by the store and only touched through
// `&mut self` (or `&self` for nothing that reads it), so moving the store to
// another thread moves sole access with it.
unsafe impl Send for BlockStore {}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(fill: u8) -> Vec<u8> {
        vec![fill; CACHE_BLOCK]
    }

    fn read(s: &mut BlockStore, b: u64) -> Option<Vec<u8>> {
        let mut out = block(0);
        s.get(b, 0, &mut out).then_some(out)
    }

    #[test]
    fn stores_and_reads_blocks_and_parts_of_them() {
        let mut s = BlockStore::new(c"test", 4 * CACHE_BLOCK as u64).unwrap();
        assert_eq!(read(&mut s, 7), None);
        s.put(7, &block(0xaa));
        assert_eq!(read(&mut s, 7), Some(block(0xaa)));
        let mut part = [0u8; 16];
        assert!(s.get(7, 100, &mut part));
        assert_eq!(part, [0xaa; 16]);
        // Replacing a block keeps one copy.
        s.put(7, &block(0xbb));
        assert_eq!(read(&mut s, 7), Some(block(0xbb)));
        assert_eq!(s.counters().resident_bytes, CACHE_BLOCK as u64);
        assert_eq!(s.counters().capacity_bytes, 4 * CACHE_BLOCK as u64);
    }

    #[test]
    fn the_least_recently_used_block_is_evicted_first() {
        let mut s = BlockStore::new(c"test", 3 * CACHE_BLOCK as u64).unwrap();
        for b in 0..3 {
            s.put(b, &block(b as u8));
        }
        // Block 0 is used again: block 1 is now the oldest.
        assert!(read(&mut s, 0).is_some());
        s.put(3, &block(3));
        assert_eq!(read(&mut s, 1), None);
        for b in [0, 2, 3] {
            assert_eq!(read(&mut s, b), Some(block(b as u8)), "block {b}");
        }
        assert_eq!(s.counters().evictions, 1);
        assert_eq!(s.counters().resident_bytes, 3 * CACHE_BLOCK as u64);
    }

    #[test]
    fn a_patch_changes_only_a_cached_block() {
        let mut s = BlockStore::new(c"test", 2 * CACHE_BLOCK as u64).unwrap();
        assert!(!s.patch(1, 0, b"x"));
        assert!(!s.contains(1));
        s.put(1, &block(0));
        assert!(s.patch(1, 4090, b"abcdef"));
        let got = read(&mut s, 1).unwrap();
        assert_eq!(&got[4090..], b"abcdef");
        assert!(got[..4090].iter().all(|&b| b == 0));
    }

    #[test]
    fn invalidated_blocks_are_gone_and_their_slots_reused() {
        let mut s = BlockStore::new(c"test", 4 * CACHE_BLOCK as u64).unwrap();
        for b in [1, 2, 3, 1000] {
            s.put(b, &block(b as u8));
        }
        s.invalidate(2, 4);
        assert_eq!((read(&mut s, 2), read(&mut s, 3)), (None, None));
        assert!(read(&mut s, 1).is_some());
        // A range wider than the index: found by walking the index.
        s.invalidate(500, u64::MAX);
        assert_eq!(read(&mut s, 1000), None);
        assert_eq!(s.counters().invalidations, 3);
        // Freed slots take new blocks without evicting.
        for b in 10..13 {
            s.put(b, &block(9));
        }
        assert_eq!(s.counters().evictions, 0);
        s.clear();
        assert_eq!(read(&mut s, 1), None);
        assert_eq!(s.counters().resident_bytes, 0);
    }
}
