//! The proxy's local copy: a sparse cache file the size of the export, and a
//! bitmap of the 4 KiB blocks whose contents in the cache file are valid.
//!
//! Crash safety (write ordering):
//! 1. block data is written to the cache file (pwrite) and only then its bit
//!    is set in memory (Release);
//! 2. [`Cache::persist`] snapshots the in-memory bits, then fdatasyncs the
//!    cache file, then writes the snapshot into the bitmap file and
//!    fdatasyncs it.
//!
//! So every bit that reaches the bitmap file covers data that was durable
//! before it. Bits only go from 0 to 1, so a torn bitmap write mixes two
//! valid states. After a crash only persisted bits are trusted: a block
//! fetched or written after the last persist is simply fetched again (an
//! unflushed client write may be lost, which NBD allows; FLUSH and FUA
//! persist before they are acknowledged).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use thiserror::Error;

pub const BLOCK: u64 = 4096;
const MAGIC: &[u8; 8] = b"KNBDBMAP";
const VERSION: u32 = 1;
const HEADER_LEN: u64 = 64;
const STRIPES: usize = 1024;

#[derive(Debug, Error)]
pub enum CacheError {
    #[error("cannot open cache file {path}")]
    Open {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("bitmap file {path} belongs to another export (size {found}, expected {expected}) or is corrupt")]
    Mismatch {
        path: String,
        found: u64,
        expected: u64,
    },
    #[error("cache i/o")]
    Io(#[from] io::Error),
}

pub struct Cache {
    data: File,
    meta: File,
    size: u64,
    nblocks: u64,
    bits: Vec<AtomicU64>,
    cached: AtomicU64,
    dirty: AtomicBool,
    persist_lock: Mutex<()>,
    stripes: Vec<Mutex<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The export size recorded in an existing bitmap file in `dir`, if any.
pub fn existing_size(dir: &Path) -> Option<u64> {
    let f = File::open(dir.join("cache.bitmap")).ok()?;
    let mut h = [0u8; HEADER_LEN as usize];
    f.read_exact_at(&mut h, 0).ok()?;
    (&h[0..8] == MAGIC).then(|| u64::from_le_bytes(h[16..24].try_into().unwrap_or([0; 8])))
}

impl Cache {
    /// Opens (or creates) `dir/cache.img` and `dir/cache.bitmap` for an
    /// export of `size` bytes. An existing bitmap must describe the same size.
    pub fn open(dir: &Path, size: u64) -> Result<Cache, CacheError> {
        std::fs::create_dir_all(dir).map_err(|source| CacheError::Open {
            path: dir.display().to_string(),
            source,
        })?;
        let open = |name: &str| {
            let p = dir.join(name);
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&p)
                .map_err(|source| CacheError::Open {
                    path: p.display().to_string(),
                    source,
                })
        };
        let data = open("cache.img")?;
        let meta = open("cache.bitmap")?;
        let nblocks = size.div_ceil(BLOCK);
        let words = nblocks.div_ceil(64) as usize;
        let mut words_v = vec![0u64; words];
        let meta_len = meta.metadata()?.len();
        let bitmap_path = dir.join("cache.bitmap").display().to_string();
        if meta_len == 0 {
            data.set_len(size)?;
            let mut h = [0u8; HEADER_LEN as usize];
            h[0..8].copy_from_slice(MAGIC);
            h[8..12].copy_from_slice(&VERSION.to_le_bytes());
            h[12..16].copy_from_slice(&(BLOCK as u32).to_le_bytes());
            h[16..24].copy_from_slice(&size.to_le_bytes());
            meta.write_all_at(&h, 0)?;
            meta.write_all_at(&vec![0u8; words * 8], HEADER_LEN)?;
            meta.sync_all()?;
            data.sync_all()?;
        } else {
            let mut h = [0u8; HEADER_LEN as usize];
            meta.read_exact_at(&mut h, 0)?;
            let found = u64::from_le_bytes(h[16..24].try_into().unwrap_or([0; 8]));
            let ok = &h[0..8] == MAGIC
                && h[8..12] == VERSION.to_le_bytes()
                && h[12..16] == (BLOCK as u32).to_le_bytes()
                && found == size
                && meta_len >= HEADER_LEN + words as u64 * 8
                && data.metadata()?.len() == size;
            if !ok {
                return Err(CacheError::Mismatch {
                    path: bitmap_path,
                    found,
                    expected: size,
                });
            }
            let mut raw = vec![0u8; words * 8];
            meta.read_exact_at(&mut raw, HEADER_LEN)?;
            for (w, c) in words_v.iter_mut().zip(raw.chunks_exact(8)) {
                *w = u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
            }
            // Bits past the end are meaningless: clear them.
            if nblocks & 63 != 0 {
                if let Some(last) = words_v.last_mut() {
                    *last &= (1u64 << (nblocks % 64)) - 1;
                }
            }
        }
        let cached = words_v.iter().map(|w| u64::from(w.count_ones())).sum();
        Ok(Cache {
            data,
            meta,
            size,
            nblocks,
            bits: words_v.into_iter().map(AtomicU64::new).collect(),
            cached: AtomicU64::new(cached),
            dirty: AtomicBool::new(false),
            persist_lock: Mutex::new(()),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn nblocks(&self) -> u64 {
        self.nblocks
    }
    pub fn cached_blocks(&self) -> u64 {
        self.cached.load(Ordering::Relaxed)
    }
    pub fn complete(&self) -> bool {
        self.cached_blocks() == self.nblocks
    }

    pub fn is_cached(&self, block: u64) -> bool {
        self.bits[(block / 64) as usize].load(Ordering::Acquire) & (1 << (block % 64)) != 0
    }

    /// Whether every block overlapping `[offset, offset+len)` is cached.
    pub fn range_cached(&self, offset: u64, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        let (first, last) = (offset / BLOCK, (offset + len - 1) / BLOCK);
        (first..=last).all(|b| self.is_cached(b))
    }

    fn set_cached(&self, block: u64) {
        let bit = 1u64 << (block % 64);
        let old = self.bits[(block / 64) as usize].fetch_or(bit, Ordering::Release);
        if old & bit == 0 {
            self.cached.fetch_add(1, Ordering::Relaxed);
            self.dirty.store(true, Ordering::Release);
        }
    }

    /// Locks the stripes of blocks `first..=last` in ascending order.
    fn lock_range(&self, first: u64, last: u64) -> Vec<MutexGuard<'_, ()>> {
        let n = (last - first + 1).min(STRIPES as u64);
        let mut idx: Vec<u64> = (first..first + n).map(|b| b % STRIPES as u64).collect();
        idx.sort_unstable();
        idx.into_iter()
            .map(|i| lock(&self.stripes[i as usize]))
            .collect()
    }

    /// Stores fetched upstream data for blocks starting at `first_block`,
    /// skipping blocks that became cached meanwhile (their local copy,
    /// possibly written by a client, is newer than upstream's).
    ///
    /// Each run of uncached blocks goes to the cache file in one write, not
    /// one per block: the page cache then holds the run in large folios, as
    /// it would after a sequential copy. Filled 4 KiB at a time, the cache
    /// file kept order-0 folios, and every later 1 MiB client write through
    /// the proxy paid ~256 per-folio steps (docs/benchmarks.md).
    pub fn install(&self, first_block: u64, data: &[u8]) -> io::Result<u64> {
        if data.is_empty() || first_block >= self.nblocks {
            return Ok(0);
        }
        let blocks = (data.len() as u64).div_ceil(BLOCK);
        let end_block = (first_block + blocks).min(self.nblocks);
        let _g = self.lock_range(first_block, end_block - 1);
        let mut installed = 0;
        let mut b = first_block;
        while b < end_block {
            if self.is_cached(b) {
                b += 1;
                continue;
            }
            let run_start = b;
            while b < end_block && !self.is_cached(b) {
                b += 1;
            }
            let from = ((run_start - first_block) * BLOCK) as usize;
            let to = (((b - first_block) * BLOCK) as usize).min(data.len());
            self.data.write_all_at(&data[from..to], run_start * BLOCK)?;
            for cached in run_start..b {
                self.set_cached(cached);
            }
            installed += b - run_start;
        }
        Ok(installed)
    }

    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.data.read_exact_at(buf, offset)
    }

    /// The cache file, for zero-copy transfers of ranges whose blocks are
    /// all cached (such a range is read and written in place, no bits change).
    pub fn file(&self) -> &File {
        &self.data
    }

    /// Writes client data; every block it touches must be cached already or
    /// be fully covered by the write.
    pub fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let (first, last) = (offset / BLOCK, (offset + data.len() as u64 - 1) / BLOCK);
        if (first..=last).all(|b| self.is_cached(b)) {
            return self.data.write_all_at(data, offset);
        }
        let _g = self.lock_range(first, last);
        self.data.write_all_at(data, offset)?;
        for b in first..=last {
            self.set_cached(b);
        }
        Ok(())
    }

    /// Zeroes a range (same precondition as [`Cache::write_at`]).
    pub fn zero(&self, offset: u64, len: u64, may_trim: bool) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (first, last) = (offset / BLOCK, (offset + len - 1) / BLOCK);
        let _g = self.lock_range(first, last);
        crate::backend::zero_range(&self.data, offset, len, may_trim)?;
        for b in first..=last {
            self.set_cached(b);
        }
        Ok(())
    }

    /// Makes all cached data and the bitmap durable (see the module doc).
    pub fn persist(&self) -> io::Result<()> {
        let _g = lock(&self.persist_lock);
        let dirty = self.dirty.swap(false, Ordering::AcqRel);
        let snap: Vec<u64> = self
            .bits
            .iter()
            .map(|w| w.load(Ordering::Acquire))
            .collect();
        if let Err(e) = self.data.sync_data() {
            self.dirty.store(true, Ordering::Release);
            return Err(e);
        }
        if dirty {
            let raw: Vec<u8> = snap.iter().flat_map(|w| w.to_le_bytes()).collect();
            let res = self
                .meta
                .write_all_at(&raw, HEADER_LEN)
                .and_then(|_| self.meta.sync_data());
            if let Err(e) = res {
                self.dirty.store(true, Ordering::Release);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Whether bits were set since the last persist.
    pub fn is_dirty(&self) -> bool {
        self.dirty.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("knbd-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn install_writes_the_runs_between_cached_blocks_and_the_partial_tail() {
        let d = tmpdir("runs");
        let c = Cache::open(&d, 10 * BLOCK + 100).unwrap();
        // Client data in blocks 2 and 5..6 must survive an upstream install
        // of everything; the runs 0..2, 3..5 and 7..=10 (the last one 100
        // bytes) are installed.
        c.write_at(&[9u8; 4096], 2 * BLOCK).unwrap();
        c.write_at(&[8u8; 8192], 5 * BLOCK).unwrap();
        let upstream: Vec<u8> = (0..10 * BLOCK + 100)
            .map(|i| (i / BLOCK) as u8 + 100)
            .collect();
        assert_eq!(c.install(0, &upstream).unwrap(), 8);
        assert_eq!(c.cached_blocks(), 11);
        let mut all = vec![0u8; upstream.len()];
        c.read_at(&mut all, 0).unwrap();
        for (block, chunk) in all.chunks(BLOCK as usize).enumerate() {
            let want = match block {
                2 => 9,
                5 | 6 => 8,
                b => b as u8 + 100,
            };
            assert!(chunk.iter().all(|&x| x == want), "block {block}");
        }
        // Data past the end of the export is ignored, not written.
        assert_eq!(c.install(10, &[1u8; 3 * 4096]).unwrap(), 0);
        assert_eq!(c.install(11, &[1u8; 4096]).unwrap(), 0);
        assert_eq!(
            std::fs::metadata(d.join("cache.img")).unwrap().len(),
            10 * BLOCK + 100
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn install_skips_cached_and_persists() {
        let d = tmpdir("a");
        let c = Cache::open(&d, 10 * BLOCK + 100).unwrap();
        assert_eq!(c.nblocks(), 11);
        c.write_at(&[7u8; 4096], BLOCK).unwrap();
        // Upstream data for blocks 0..3 must not overwrite the client's block 1.
        assert_eq!(c.install(0, &[1u8; 3 * 4096]).unwrap(), 2);
        let mut b = [0u8; 4096];
        c.read_at(&mut b, BLOCK).unwrap();
        assert_eq!(b, [7u8; 4096]);
        assert!(c.range_cached(0, 3 * BLOCK));
        assert!(!c.range_cached(0, 3 * BLOCK + 1));
        // Not persisted yet: a reopen sees nothing.
        let c2 = Cache::open(&d, 10 * BLOCK + 100).unwrap();
        assert_eq!(c2.cached_blocks(), 0);
        c.persist().unwrap();
        let c3 = Cache::open(&d, 10 * BLOCK + 100).unwrap();
        assert_eq!(c3.cached_blocks(), 3);
        assert!(Cache::open(&d, 5 * BLOCK).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }
}
