//! A write-through read cache in front of a disk backend (`--disk
//! nbd://…,cache=SIZE`): what keeps a guest's reads fast right after its
//! reboot, when its own page cache is gone (docs/warm-cache.md).
//!
//! Rules, which keep it from ever serving stale data:
//!
//! - **write-through**: a write goes to the disk first; only once the disk
//!   took it are the cached blocks it covers updated (whole blocks are
//!   cached as written, partial ones patched if present). A failed write
//!   drops the blocks it covers: what the disk holds there is unknown.
//! - discard and write-zeroes drop the blocks they cover (whatever the
//!   outcome);
//! - reads fill the cache with whole 4 KiB blocks; the disk's last block, if
//!   shorter, is never cached;
//! - the cache belongs to this backend and dies with it: releasing the disk
//!   to another VMM (migration, warm restart) drops it, and a new process
//!   starts cold. It is only right while this VMM is the disk's only
//!   writer, which it is for a VM's own disk.

use std::ffi::CString;
use std::io;

use nbd_client::page_buf::PageBuf;

use super::block_backend::BlockBackend;
use super::disk_cache::{BlockStore, CacheCounters, CACHE_BLOCK};
use crate::memory::GuestSlice;

const BLOCK: u64 = CACHE_BLOCK as u64;

/// Where a read lands: a buffer of the caller's or guest memory.
trait ReadDest {
    fn len(&self) -> usize;
    /// Copies `data` to `at`.
    fn put(&mut self, at: usize, data: &[u8]) -> io::Result<()>;
}

impl ReadDest for [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }

    fn put(&mut self, at: usize, data: &[u8]) -> io::Result<()> {
        self[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }
}

impl ReadDest for &GuestSlice<'_> {
    fn len(&self) -> usize {
        vm_memory::VolatileSlice::len(*self)
    }

    fn put(&mut self, at: usize, data: &[u8]) -> io::Result<()> {
        // Through the slice, so the write is recorded for dirty tracking.
        self.subslice(at, data.len())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?
            .copy_from(data);
        Ok(())
    }
}

/// A backend with a warm read cache.
pub struct CachedBackend {
    inner: Box<dyn BlockBackend>,
    store: BlockStore,
    /// Whole blocks of the disk (a shorter last block is not cached).
    blocks: u64,
    scratch: Vec<u8>,
}

impl CachedBackend {
    /// Puts a cache of `capacity` bytes (a memfd named after `name`) in
    /// front of `inner`.
    pub fn new(inner: Box<dyn BlockBackend>, name: &str, capacity: u64) -> io::Result<Self> {
        let memfd_name = CString::new(format!("kemari-cache-{name}"))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let store = BlockStore::new(&memfd_name, capacity)?;
        tracing::info!(
            disk = %inner.id(),
            capacity_bytes = store.counters().capacity_bytes,
            "disk cache on"
        );
        Ok(CachedBackend {
            blocks: inner.size() / BLOCK,
            inner,
            store,
            scratch: Vec::new(),
        })
    }

    /// Reads blocks `first..end` from the disk into the cache; the part of
    /// them the guest asked for (`len` bytes from `off`) starts at the
    /// returned index of `self.scratch`.
    fn fill(&mut self, first: u64, end: u64, off: u64, len: usize) -> io::Result<usize> {
        let start = first * BLOCK;
        let stop = (end * BLOCK).min(self.inner.size());
        self.scratch.resize((stop - start) as usize, 0);
        self.inner.read_at(start, &mut self.scratch)?;
        for b in first..end.min(self.blocks) {
            let at = ((b - first) * BLOCK) as usize;
            self.store.put(b, &self.scratch[at..at + CACHE_BLOCK]);
        }
        self.store.count_misses(end - first, len as u64);
        Ok((off - start) as usize)
    }

    /// Reads `dst.len()` bytes at `off` into `dst`: cached blocks from the
    /// store, each run of uncached ones with one read from the disk.
    fn read_into<D: ReadDest + ?Sized>(&mut self, off: u64, dst: &mut D) -> io::Result<()> {
        let end = off
            .checked_add(dst.len() as u64)
            .filter(|&e| e <= self.size())
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let mut pos = off;
        while pos < end {
            let b = pos / BLOCK;
            let in_block = (pos % BLOCK) as usize;
            let n = ((BLOCK - pos % BLOCK).min(end - pos)) as usize;
            let at = (pos - off) as usize;
            if let Some(data) = self.store.cached(b, in_block, n) {
                dst.put(at, data)?;
                self.store.count_hits(1, n as u64);
                pos += n as u64;
                continue;
            }
            // A run of blocks not cached: one read from the disk.
            let mut miss_end = b + 1;
            while miss_end * BLOCK < end && !self.store.contains(miss_end) {
                miss_end += 1;
            }
            let stop = (miss_end * BLOCK).min(end);
            let len = (stop - pos) as usize;
            let from = self.fill(b, miss_end, pos, len)?;
            dst.put(at, &self.scratch[from..from + len])?;
            pos = stop;
        }
        Ok(())
    }

    fn covered(off: u64, len: u64) -> (u64, u64) {
        (off / BLOCK, (off + len).div_ceil(BLOCK))
    }
}

impl BlockBackend for CachedBackend {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn read_only(&self) -> bool {
        self.inner.read_only()
    }

    fn read_at(&mut self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        self.read_into(off, buf)
    }

    fn read_to_guest(
        &mut self,
        off: u64,
        dst: &GuestSlice<'_>,
        _bounce: &mut PageBuf,
    ) -> io::Result<()> {
        // Hits are copied from the store straight into guest memory.
        self.read_into(off, &mut &*dst)
    }

    fn write_at(&mut self, off: u64, buf: &[u8]) -> io::Result<()> {
        let (first, end) = Self::covered(off, buf.len() as u64);
        if let Err(e) = self.inner.write_at(off, buf) {
            self.store.invalidate(first, end);
            return Err(e);
        }
        for b in first..end {
            let start = (b * BLOCK).max(off);
            let stop = ((b + 1) * BLOCK).min(off + buf.len() as u64);
            let data = &buf[(start - off) as usize..(stop - off) as usize];
            if data.len() == CACHE_BLOCK && b < self.blocks {
                self.store.put(b, data);
            } else {
                self.store.patch(b, (start % BLOCK) as usize, data);
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }

    fn supports_discard(&self) -> bool {
        self.inner.supports_discard()
    }

    fn discard(&mut self, off: u64, len: u64) -> io::Result<()> {
        let (first, end) = Self::covered(off, len);
        self.store.invalidate(first, end);
        self.inner.discard(off, len)
    }

    fn supports_write_zeroes(&self) -> bool {
        self.inner.supports_write_zeroes()
    }

    fn write_zeroes(&mut self, off: u64, len: u64, unmap: bool) -> io::Result<()> {
        let (first, end) = Self::covered(off, len);
        self.store.invalidate(first, end);
        self.inner.write_zeroes(off, len, unmap)
    }

    fn id(&self) -> String {
        self.inner.id()
    }

    fn cache_counters(&self) -> Option<CacheCounters> {
        Some(self.store.counters())
    }

    fn reconnects(&self) -> u64 {
        self.inner.reconnects()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::devices::block_backend::MemoryBackend;

    /// A memory disk that counts the bytes read from it and can be made to
    /// fail writes: the disk behind the cache.
    #[derive(Clone)]
    struct Disk {
        data: Arc<Mutex<MemoryBackend>>,
        reads: Arc<Mutex<u64>>,
        fail_writes: Arc<Mutex<bool>>,
    }

    impl Disk {
        fn new(size: u64) -> Self {
            Disk {
                data: Arc::new(Mutex::new(MemoryBackend::new(size, false))),
                reads: Arc::default(),
                fail_writes: Arc::default(),
            }
        }
        fn reads(&self) -> u64 {
            *self.reads.lock().unwrap()
        }
        fn contents(&self, off: usize, len: usize) -> Vec<u8> {
            self.data.lock().unwrap().data()[off..off + len].to_vec()
        }
    }

    impl BlockBackend for Disk {
        fn size(&self) -> u64 {
            self.data.lock().unwrap().size()
        }
        fn read_only(&self) -> bool {
            false
        }
        fn read_at(&mut self, off: u64, buf: &mut [u8]) -> io::Result<()> {
            *self.reads.lock().unwrap() += buf.len() as u64;
            self.data.lock().unwrap().read_at(off, buf)
        }
        fn write_at(&mut self, off: u64, buf: &[u8]) -> io::Result<()> {
            if *self.fail_writes.lock().unwrap() {
                // Fails halfway: the disk's copy is now unknown to the cache.
                let half = buf.len() / 2;
                self.data.lock().unwrap().write_at(off, &buf[..half])?;
                return Err(io::Error::other("injected write failure"));
            }
            self.data.lock().unwrap().write_at(off, buf)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
        fn supports_discard(&self) -> bool {
            true
        }
        fn discard(&mut self, off: u64, len: u64) -> io::Result<()> {
            self.data.lock().unwrap().discard(off, len)
        }
        fn supports_write_zeroes(&self) -> bool {
            true
        }
        fn write_zeroes(&mut self, off: u64, len: u64, unmap: bool) -> io::Result<()> {
            self.data.lock().unwrap().write_zeroes(off, len, unmap)
        }
        fn id(&self) -> String {
            "test-disk".into()
        }
    }

    fn cached(size: u64, capacity: u64) -> (Disk, CachedBackend) {
        let disk = Disk::new(size);
        let c = CachedBackend::new(Box::new(disk.clone()), "test", capacity).unwrap();
        (disk, c)
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
    }

    #[test]
    fn a_second_read_is_served_from_the_cache() {
        let (disk, mut c) = cached(1 << 20, 1 << 20);
        disk.data
            .lock()
            .unwrap()
            .write_at(0, &pattern(1 << 20, 3))
            .unwrap();
        let mut a = vec![0; 64 << 10];
        c.read_at(8192, &mut a).unwrap();
        assert_eq!(disk.reads(), 64 << 10);
        let mut b = vec![0; 64 << 10];
        c.read_at(8192, &mut b).unwrap();
        assert_eq!(a, b);
        assert_eq!(a, pattern(1 << 20, 3)[8192..8192 + (64 << 10)]);
        assert_eq!(disk.reads(), 64 << 10, "the second read went to the disk");
        let n = c.cache_counters().unwrap();
        assert_eq!((n.hits, n.misses), (16, 16));
        assert_eq!((n.hit_bytes, n.miss_bytes), (64 << 10, 64 << 10));
    }

    #[test]
    fn unaligned_reads_fetch_whole_blocks_and_mix_hits_and_misses() {
        let (disk, mut c) = cached(1 << 20, 1 << 20);
        let all = pattern(1 << 20, 9);
        disk.data.lock().unwrap().write_at(0, &all).unwrap();
        // Block 2 only, from an odd offset.
        let mut a = vec![0; 100];
        c.read_at(2 * 4096 + 513, &mut a).unwrap();
        assert_eq!(a, all[2 * 4096 + 513..2 * 4096 + 613]);
        assert_eq!(disk.reads(), 4096);
        // Blocks 1..=3 across the cached block 2: 1 and 3 come from the disk.
        let mut b = vec![0; 3 * 4096 - 1024];
        c.read_at(4096 + 512, &mut b).unwrap();
        assert_eq!(b, all[4096 + 512..4 * 4096 - 512]);
        assert_eq!(disk.reads(), 3 * 4096);
        let n = c.cache_counters().unwrap();
        assert_eq!((n.hits, n.misses), (1, 3));
    }

    #[test]
    fn writes_go_through_and_update_the_cache() {
        let (disk, mut c) = cached(1 << 20, 1 << 20);
        let mut buf = vec![0; 16384];
        c.read_at(0, &mut buf).unwrap();
        // A whole-block write and a partial one over cached blocks.
        c.write_at(4096, &pattern(4096, 1)).unwrap();
        c.write_at(8192 + 100, b"newest").unwrap();
        // A partial write over an uncached block changes only the disk.
        c.write_at(65536 + 10, b"disk only").unwrap();
        assert_eq!(disk.contents(4096, 4096), pattern(4096, 1));
        assert_eq!(disk.contents(8192 + 100, 6), b"newest");
        let reads = disk.reads();
        c.read_at(0, &mut buf).unwrap();
        assert_eq!(disk.reads(), reads, "cached blocks were read again");
        assert_eq!(&buf[4096..8192], &pattern(4096, 1)[..]);
        assert_eq!(&buf[8192 + 100..8192 + 106], b"newest");
        let mut tail = [0u8; 9];
        c.read_at(65536 + 10, &mut tail).unwrap();
        assert_eq!(&tail, b"disk only");
        // Whole blocks written are cached without a read.
        c.write_at(1 << 19, &pattern(8192, 2)).unwrap();
        let reads = disk.reads();
        let mut w = vec![0; 8192];
        c.read_at(1 << 19, &mut w).unwrap();
        assert_eq!((w, disk.reads()), (pattern(8192, 2), reads));
    }

    #[test]
    fn a_failed_write_leaves_nothing_stale() {
        let (disk, mut c) = cached(1 << 20, 1 << 20);
        c.write_at(0, &pattern(16384, 4)).unwrap();
        *disk.fail_writes.lock().unwrap() = true;
        assert!(c.write_at(0, &pattern(16384, 5)).is_err());
        *disk.fail_writes.lock().unwrap() = false;
        // The disk holds half of each; the cache must show the disk's copy.
        let mut buf = vec![0; 16384];
        c.read_at(0, &mut buf).unwrap();
        assert_eq!(buf, disk.contents(0, 16384));
        assert_eq!(&buf[..8192], &pattern(16384, 5)[..8192]);
    }

    #[test]
    fn discard_and_write_zeroes_invalidate() {
        let (disk, mut c) = cached(1 << 20, 1 << 20);
        c.write_at(0, &pattern(32768, 6)).unwrap();
        c.discard(0, 8192).unwrap();
        c.write_zeroes(16384, 4096, false).unwrap();
        let mut buf = vec![0; 32768];
        c.read_at(0, &mut buf).unwrap();
        assert_eq!(buf, disk.contents(0, 32768));
        assert!(buf[..8192].iter().all(|&b| b == 0));
        assert!(buf[16384..20480].iter().all(|&b| b == 0));
        assert_eq!(&buf[8192..16384], &pattern(32768, 6)[8192..16384]);
        assert!(c.cache_counters().unwrap().invalidations >= 3);
    }

    #[test]
    fn a_small_cache_evicts_and_stays_correct() {
        let (disk, mut c) = cached(1 << 20, 4 * 4096);
        let all = pattern(1 << 20, 8);
        disk.data.lock().unwrap().write_at(0, &all).unwrap();
        for round in 0..3 {
            for b in 0..16u64 {
                let mut buf = vec![0; 4096];
                c.read_at(b * 4096, &mut buf).unwrap();
                assert_eq!(buf, all[(b * 4096) as usize..][..4096], "round {round}");
            }
        }
        let n = c.cache_counters().unwrap();
        assert_eq!(n.resident_bytes, 4 * 4096);
        assert!(n.evictions >= 40, "{n:?}");
    }

    #[test]
    fn the_disks_short_last_block_is_read_but_not_cached() {
        // 8 KiB + 512: block 2 is 512 bytes long.
        let (disk, mut c) = cached(8192 + 512, 1 << 20);
        disk.data
            .lock()
            .unwrap()
            .write_at(0, &pattern(8704, 2))
            .unwrap();
        let mut buf = vec![0; 8704];
        c.read_at(0, &mut buf).unwrap();
        assert_eq!(buf, pattern(8704, 2));
        c.read_at(0, &mut buf).unwrap();
        assert_eq!(c.cache_counters().unwrap().resident_bytes, 8192);
        assert_eq!(disk.reads(), 8704 + 512);
        c.write_at(8192, &[1; 512]).unwrap();
        let mut last = [0u8; 512];
        c.read_at(8192, &mut last).unwrap();
        assert_eq!(last, [1; 512]);
        assert!(c.read_at(8192, &mut [0u8; 1024]).is_err());
    }
}
