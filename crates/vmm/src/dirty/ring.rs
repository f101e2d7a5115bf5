//! One vCPU's KVM dirty ring: an array of `kvm_dirty_gfn` shared with the
//! kernel through an mmap of the vCPU fd at `KVM_DIRTY_LOG_PAGE_OFFSET` pages.
//!
//! Protocol (Documentation/virt/kvm/api.rst, KVM_CAP_DIRTY_LOG_RING): the
//! kernel fills entries in ring order and publishes each by setting
//! `flags = DIRTY` last (a release store under ACQ_REL; program order on
//! x86). We read entries in the same order starting at our own fetch index,
//! stop at the first entry without DIRTY, load `flags` with *acquire* before
//! reading `slot`/`offset`, and hand each entry back with a *release* store of
//! `flags = RESET`. KVM_RESET_DIRTY_RINGS (a VM ioctl, see
//! [`Vm::reset_dirty_rings`](crate::vstate::vm::Vm::reset_dirty_rings)) then
//! re-protects those pages and frees the entries for reuse.
//!
//! The ring is `entries` long (a power of two); indices are free-running
//! `u32`s taken modulo `entries`, like the kernel's.

use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use kvm_bindings::{kvm_dirty_gfn, KVM_DIRTY_LOG_PAGE_OFFSET};

use crate::sys;

/// `flags` bit: the kernel published this entry.
pub const KVM_DIRTY_GFN_F_DIRTY: u32 = 1 << 0;
/// `flags` bit: userspace harvested this entry; the kernel may reset it.
pub const KVM_DIRTY_GFN_F_RESET: u32 = 1 << 1;

/// Smallest ring KVM accepts: one host page of 16-byte entries.
pub const MIN_RING_ENTRIES: u32 = 256;

/// Errors of ring set-up.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// The size is not a power of two or is too small.
    #[error("dirty ring of {0} entries: need a power of two >= {MIN_RING_ENTRIES}")]
    BadSize(u32),
    /// mmap of the vCPU fd failed.
    #[error("cannot map the dirty ring of vCPU fd {fd} ({entries} entries)")]
    Map {
        /// The vCPU fd.
        fd: RawFd,
        /// Ring size in entries.
        entries: u32,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// What holds the ring's memory: kept for its drop, which frees it.
#[allow(dead_code)]
enum Backing {
    /// The kernel's ring, mapped from the vCPU fd; unmapped on drop.
    Mmap(sys::SharedMapping),
    /// Plain memory standing in for the kernel's ring (unit tests).
    #[cfg(test)]
    Heap(Box<[kvm_dirty_gfn]>),
}

/// One vCPU's dirty ring and our position in it.
pub struct DirtyRing {
    base: NonNull<kvm_dirty_gfn>,
    entries: u32,
    /// Index of the next entry to harvest (free-running).
    fetch: u32,
    /// Where `base` points; never read, dropped with the ring.
    _backing: Backing,
}

// SAFETY: the ring memory is owned by this value (an mmap or a boxed slice)
// and only reached through `&mut self` or atomics; moving it to another
// thread moves that ownership.
unsafe impl Send for DirtyRing {}

impl std::fmt::Debug for DirtyRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirtyRing")
            .field("entries", &self.entries)
            .field("fetch", &self.fetch)
            .finish()
    }
}

fn check_size(entries: u32) -> Result<(), RingError> {
    if entries < MIN_RING_ENTRIES || !entries.is_power_of_two() {
        return Err(RingError::BadSize(entries));
    }
    Ok(())
}

impl DirtyRing {
    /// Maps the ring of the vCPU whose fd is `vcpu_fd`. The VM must have the
    /// dirty ring enabled with exactly `entries` entries. The mapping keeps the
    /// vCPU file alive on its own, so it may outlive the borrow of the fd.
    pub fn map(vcpu_fd: RawFd, entries: u32) -> Result<Self, RingError> {
        check_size(entries)?;
        let len = entries as usize * std::mem::size_of::<kvm_dirty_gfn>();
        let offset = i64::from(KVM_DIRTY_LOG_PAGE_OFFSET) * sys::page_size() as i64;
        let mapping =
            sys::SharedMapping::new(vcpu_fd, len, offset).map_err(|source| RingError::Map {
                fd: vcpu_fd,
                entries,
                source,
            })?;
        let base = mapping.as_ptr().cast();
        Ok(DirtyRing {
            base,
            entries,
            fetch: 0,
            _backing: Backing::Mmap(mapping),
        })
    }

    /// A ring in ordinary memory, for tests that play the kernel's part.
    #[cfg(test)]
    pub(crate) fn fake(entries: u32) -> Self {
        check_size(entries).expect("test ring size");
        let mut mem = vec![kvm_dirty_gfn::default(); entries as usize].into_boxed_slice();
        let base = NonNull::new(mem.as_mut_ptr()).expect("boxed slice is non-null");
        DirtyRing {
            base,
            entries,
            fetch: 0,
            _backing: Backing::Heap(mem),
        }
    }

    /// Ring size in entries.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Free-running index of the next entry to harvest.
    pub fn fetch_index(&self) -> u32 {
        self.fetch
    }

    /// Position in the ring of free-running index `index`.
    pub fn slot_of(&self, index: u32) -> usize {
        (index & (self.entries - 1)) as usize
    }

    fn entry(&self, index: u32) -> *mut kvm_dirty_gfn {
        // SAFETY: `slot_of` is < entries, so the pointer stays inside the ring.
        unsafe { self.base.as_ptr().add(self.slot_of(index)) }
    }

    fn flags(&self, index: u32) -> &AtomicU32 {
        let e = self.entry(index);
        // SAFETY: `flags` is the first field, a 4-byte aligned u32 inside the
        // live ring; the kernel accesses it concurrently, hence the atomic view
        // (AtomicU32 has the layout of u32).
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*e).flags)) }
    }

    /// Harvests every published entry in ring order, calling `f(slot, offset)`
    /// for each, and marks each RESET. At most one ring's worth per call.
    /// Returns the number harvested; the caller then issues one
    /// KVM_RESET_DIRTY_RINGS before reading the pages.
    pub fn harvest(&mut self, mut f: impl FnMut(u32, u64)) -> u32 {
        let mut n = 0;
        while n < self.entries {
            let flags = self.flags(self.fetch);
            if flags.load(Ordering::Acquire) & KVM_DIRTY_GFN_F_DIRTY == 0 {
                break;
            }
            let e = self.entry(self.fetch);
            // SAFETY: the entry is inside the ring; the acquire load above
            // orders these reads after the kernel's publication of the entry,
            // and the kernel does not touch a DIRTY entry until we mark it.
            let (slot, offset) = unsafe {
                (
                    std::ptr::read_volatile(std::ptr::addr_of!((*e).slot)),
                    std::ptr::read_volatile(std::ptr::addr_of!((*e).offset)),
                )
            };
            // Release: our reads of slot/offset happen before the kernel may
            // recycle the entry.
            flags.store(KVM_DIRTY_GFN_F_RESET, Ordering::Release);
            self.fetch = self.fetch.wrapping_add(1);
            n += 1;
            f(slot, offset);
        }
        n
    }

    /// Test helper playing the kernel: publishes (slot, offset) at free-running
    /// index `index`.
    #[cfg(test)]
    pub(crate) fn kernel_push(&self, index: u32, slot: u32, offset: u64) {
        let e = self.entry(index);
        // SAFETY: in-bounds entry of the test's own heap ring.
        unsafe {
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).slot), slot);
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*e).offset), offset);
        }
        self.flags(index)
            .store(KVM_DIRTY_GFN_F_DIRTY, Ordering::Release);
    }

    /// Test helper playing KVM_RESET_DIRTY_RINGS: frees entries marked RESET
    /// from `from` on; returns the index after the last one freed.
    #[cfg(test)]
    pub(crate) fn kernel_reset(&self, from: u32) -> u32 {
        let mut i = from;
        while self.flags(i).load(Ordering::Acquire) & KVM_DIRTY_GFN_F_RESET != 0 {
            self.flags(i).store(0, Ordering::Release);
            i = i.wrapping_add(1);
        }
        i
    }

    /// Test helper: the raw flags of free-running index `index`.
    #[cfg(test)]
    pub(crate) fn flags_at(&self, index: u32) -> u32 {
        self.flags(index).load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_checked() {
        for bad in [0, 64, 255, 300, 1000] {
            assert!(matches!(check_size(bad), Err(RingError::BadSize(_))));
        }
        for good in [256, 4096, 65536] {
            assert!(check_size(good).is_ok());
        }
    }

    #[test]
    fn harvests_in_order_and_marks_reset() {
        let mut ring = DirtyRing::fake(256);
        ring.kernel_push(0, 1, 10);
        ring.kernel_push(1, 0, 20);
        let mut got = Vec::new();
        assert_eq!(ring.harvest(|s, o| got.push((s, o))), 2);
        assert_eq!(got, vec![(1, 10), (0, 20)]);
        assert_eq!(ring.flags_at(0), KVM_DIRTY_GFN_F_RESET);
        assert_eq!(ring.flags_at(1), KVM_DIRTY_GFN_F_RESET);
        assert_eq!(ring.fetch_index(), 2);
        // Nothing new: nothing harvested, RESET entries are not DIRTY.
        assert_eq!(ring.harvest(|_, _| panic!("no entry")), 0);
        assert_eq!(ring.kernel_reset(0), 2);
        assert_eq!(ring.flags_at(0), 0);
    }

    #[test]
    fn stops_at_first_unpublished_entry() {
        let mut ring = DirtyRing::fake(256);
        ring.kernel_push(0, 0, 1);
        // Index 1 not yet published; index 2 is (cannot happen with a real
        // kernel, but must not be skipped to).
        ring.kernel_push(2, 0, 3);
        let mut got = Vec::new();
        ring.harvest(|_, o| got.push(o));
        assert_eq!(got, vec![1]);
        ring.kernel_push(1, 0, 2);
        ring.harvest(|_, o| got.push(o));
        assert_eq!(got, vec![1, 2, 3]);
    }

    #[test]
    fn wraps_around_many_times() {
        let mut ring = DirtyRing::fake(256);
        let mut kernel_next = 0u32;
        let mut reset_from = 0u32;
        let mut got = Vec::new();
        // 10.5 laps in uneven batches.
        let mut value = 0u64;
        while value < 2688 {
            let batch = (value % 97 + 1).min(2688 - value);
            for _ in 0..batch {
                ring.kernel_push(kernel_next, 0, value);
                kernel_next = kernel_next.wrapping_add(1);
                value += 1;
            }
            ring.harvest(|_, o| got.push(o));
            reset_from = ring.kernel_reset(reset_from);
        }
        assert_eq!(got, (0..2688).collect::<Vec<u64>>());
        assert_eq!(ring.slot_of(ring.fetch_index()), 2688 % 256);
    }

    #[test]
    fn free_running_index_wraps_at_u32_max() {
        let mut ring = DirtyRing::fake(256);
        ring.fetch = u32::MAX - 1;
        for (k, i) in [u32::MAX - 1, u32::MAX, 0, 1].into_iter().enumerate() {
            ring.kernel_push(i, 3, k as u64);
        }
        let mut got = Vec::new();
        assert_eq!(ring.harvest(|s, o| got.push((s, o))), 4);
        assert_eq!(got, vec![(3, 0), (3, 1), (3, 2), (3, 3)]);
        assert_eq!(ring.fetch_index(), 2);
        assert_eq!(ring.slot_of(u32::MAX), 255);
    }

    #[test]
    fn a_full_ring_is_harvested_once_per_call() {
        let mut ring = DirtyRing::fake(256);
        for i in 0..256 {
            ring.kernel_push(i, 0, u64::from(i));
        }
        // Every entry DIRTY: the loop must stop after one lap.
        assert_eq!(ring.harvest(|_, _| {}), 256);
        assert_eq!(ring.harvest(|_, _| {}), 0);
    }
}
