//! Pages of guest memory dirtied by the VMM itself (device emulation: used rings,
//! block reads, received packets).
//!
//! KVM only sees writes made by the guest's vCPUs. Everything the VMM writes goes
//! through `vm-memory`, which calls the region's [`Bitmap`] after each write; this
//! module plugs an O(dirty) structure in there — the design of the KVM-Kemari
//! paper: a queue of dirtied page numbers plus a per-page flag so that a page is
//! queued once between two harvests. Harvesting costs O(pages dirtied), never
//! O(guest memory).
//!
//! Ordering argument: `mark_dirty` runs *after* the write it reports. A harvest
//! first takes the queue, then clears the flags of the pages it took, and only then
//! does the caller read the pages. A write whose mark found the flag still set
//! finished before the flag was cleared, so the caller's read sees it; a write
//! marked after the clear queues the page again for the next harvest.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vm_memory::bitmap::{Bitmap, BitmapSlice, NewBitmap, WithBitmapSlice};

/// Guest page size used for dirty tracking (KVM's granularity too).
pub const PAGE_SIZE: usize = 4096;

struct DirtyQueue {
    /// One bit per page: set while the page sits in `queue`.
    flags: Box<[AtomicU64]>,
    /// Region-relative page numbers, each at most once.
    queue: Mutex<Vec<u64>>,
    enabled: AtomicBool,
    pages: usize,
}

/// The `vm-memory` bitmap of one guest memory region (or a slice of it).
///
/// Cloning is cheap: clones share the queue.
#[derive(Clone, Default)]
pub struct VmmDirtyPages {
    queue: Option<Arc<DirtyQueue>>,
    /// Offset of this slice within its region, in bytes.
    base: usize,
}

impl fmt::Debug for VmmDirtyPages {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VmmDirtyPages")
            .field("pages", &self.queue.as_ref().map(|q| q.pages))
            .field("base", &self.base)
            .finish()
    }
}

impl VmmDirtyPages {
    /// Starts (or stops) recording. While stopped, `mark_dirty` costs one load.
    pub fn set_enabled(&self, enabled: bool) {
        if let Some(q) = &self.queue {
            q.enabled.store(enabled, Ordering::SeqCst);
        }
    }

    /// Whether writes are being recorded.
    pub fn is_enabled(&self) -> bool {
        self.queue
            .as_ref()
            .is_some_and(|q| q.enabled.load(Ordering::SeqCst))
    }

    /// Takes the region-relative page numbers dirtied since the last harvest,
    /// in the order they were first dirtied, each once.
    pub fn harvest(&self) -> Vec<u64> {
        let Some(q) = &self.queue else {
            return Vec::new();
        };
        let pages = std::mem::take(&mut *q.queue.lock().unwrap_or_else(|e| e.into_inner()));
        for &page in &pages {
            let (word, bit) = ((page / 64) as usize, page % 64);
            q.flags[word].fetch_and(!(1u64 << bit), Ordering::SeqCst);
        }
        pages
    }

    /// Number of pages waiting in the queue.
    pub fn pending(&self) -> usize {
        self.queue.as_ref().map_or(0, |q| {
            q.queue.lock().unwrap_or_else(|e| e.into_inner()).len()
        })
    }
}

impl WithBitmapSlice<'_> for VmmDirtyPages {
    type S = Self;
}

impl BitmapSlice for VmmDirtyPages {}

impl Bitmap for VmmDirtyPages {
    fn mark_dirty(&self, offset: usize, len: usize) {
        let Some(q) = &self.queue else { return };
        if len == 0 || !q.enabled.load(Ordering::Relaxed) {
            return;
        }
        let start = self.base.saturating_add(offset);
        let first = start / PAGE_SIZE;
        let last = (start.saturating_add(len - 1) / PAGE_SIZE).min(q.pages.saturating_sub(1));
        let mut fresh = Vec::new();
        for page in first..=last {
            let (word, bit) = (page / 64, page % 64);
            let old = q.flags[word].fetch_or(1u64 << bit, Ordering::SeqCst);
            if old & (1u64 << bit) == 0 {
                fresh.push(page as u64);
            }
        }
        if !fresh.is_empty() {
            q.queue
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(&fresh);
        }
    }

    fn dirty_at(&self, offset: usize) -> bool {
        let Some(q) = &self.queue else { return false };
        let page = self.base.saturating_add(offset) / PAGE_SIZE;
        if page >= q.pages {
            return false;
        }
        q.flags[page / 64].load(Ordering::SeqCst) & (1u64 << (page % 64)) != 0
    }

    fn slice_at(&self, offset: usize) -> Self {
        VmmDirtyPages {
            queue: self.queue.clone(),
            base: self.base.saturating_add(offset),
        }
    }
}

impl NewBitmap for VmmDirtyPages {
    fn with_len(len: usize) -> Self {
        let pages = len.div_ceil(PAGE_SIZE);
        let flags = (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
        VmmDirtyPages {
            queue: Some(Arc::new(DirtyQueue {
                flags,
                queue: Mutex::new(Vec::new()),
                enabled: AtomicBool::new(false),
                pages,
            })),
            base: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_records_nothing() {
        let b = VmmDirtyPages::with_len(16 * PAGE_SIZE);
        b.mark_dirty(0, 100);
        assert!(b.harvest().is_empty());
        assert!(!b.dirty_at(0));
    }

    #[test]
    fn queues_each_page_once_in_order() {
        let b = VmmDirtyPages::with_len(16 * PAGE_SIZE);
        b.set_enabled(true);
        b.mark_dirty(5 * PAGE_SIZE + 10, 1);
        b.mark_dirty(2 * PAGE_SIZE, 2 * PAGE_SIZE + 1); // pages 2, 3, 4
        b.mark_dirty(5 * PAGE_SIZE, 8); // page 5 again
        assert_eq!(b.pending(), 4);
        assert!(b.dirty_at(3 * PAGE_SIZE));
        assert_eq!(b.harvest(), vec![5, 2, 3, 4]);
        assert!(!b.dirty_at(3 * PAGE_SIZE));
        assert!(b.harvest().is_empty());
        b.mark_dirty(5 * PAGE_SIZE, 1);
        assert_eq!(b.harvest(), vec![5]);
    }

    #[test]
    fn slices_are_offset_and_clamped() {
        let b = VmmDirtyPages::with_len(4 * PAGE_SIZE);
        b.set_enabled(true);
        let s = b.slice_at(2 * PAGE_SIZE);
        s.mark_dirty(PAGE_SIZE, 1);
        // A range running past the end is clamped to the region.
        s.mark_dirty(PAGE_SIZE, 100 * PAGE_SIZE);
        assert_eq!(b.harvest(), vec![3]);
    }

    #[test]
    fn concurrent_marks_are_not_lost() {
        let b = VmmDirtyPages::with_len(1024 * PAGE_SIZE);
        b.set_enabled(true);
        let writers: Vec<_> = (0..4)
            .map(|t| {
                let b = b.clone();
                std::thread::spawn(move || {
                    for p in 0..256 {
                        b.mark_dirty((t * 256 + p) * PAGE_SIZE, 1);
                    }
                })
            })
            .collect();
        let mut seen = Vec::new();
        for w in writers {
            w.join().unwrap();
        }
        seen.extend(b.harvest());
        seen.sort_unstable();
        assert_eq!(seen, (0..1024).collect::<Vec<u64>>());
    }
}
