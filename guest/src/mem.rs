//! Guest-physical memory: a bump allocator over the RAM the memory map
//! reports above the image, and the heap (`alloc`) carved from it.
//!
//! Memory is identity mapped, so an address is both physical (what virtio
//! devices see) and virtual. Nothing is ever freed: the guest allocates its
//! queues, buffers and working sets once, at start.

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;

use crate::start_info::{RamRange, MAX_RAM_RANGES};

extern "C" {
    static __image_end: u8;
}

struct Ranges {
    ranges: [RamRange; MAX_RAM_RANGES],
    count: usize,
    /// Index of the range being allocated from.
    current: usize,
    /// Next free address in `ranges[current]`.
    next: u64,
}

/// Single vCPU, no interrupts: nothing runs concurrently with an allocation.
struct PhysAllocator(UnsafeCell<Ranges>);

// SAFETY: the guest is single-threaded (one vCPU, interrupts off), so the
// cell is never accessed from two places at once.
unsafe impl Sync for PhysAllocator {}

static PHYS: PhysAllocator = PhysAllocator(UnsafeCell::new(Ranges {
    ranges: [RamRange { start: 0, end: 0 }; MAX_RAM_RANGES],
    count: 0,
    current: 0,
    next: 0,
}));

/// Registers the RAM ranges (clipped to what the page tables map and to
/// above the guest image).
pub fn init(ram: &[RamRange], mapped_limit: u64) {
    // A linker-script symbol: only its address means anything.
    let image_end = core::ptr::addr_of!(__image_end) as u64;
    // SAFETY: single-threaded, see `PhysAllocator`; no reference escapes.
    let r = unsafe { &mut *PHYS.0.get() };
    for range in ram {
        let start = range.start.max(image_end).next_multiple_of(4096);
        let end = range.end.min(mapped_limit) & !4095;
        if start < end && r.count < MAX_RAM_RANGES {
            r.ranges[r.count] = RamRange { start, end };
            r.count += 1;
        }
    }
    r.ranges[..r.count].sort_unstable_by_key(|x| x.start);
    r.current = 0;
    r.next = r.ranges.first().map_or(0, |x| x.start);
}

/// Allocates `bytes` of physical memory aligned to `align` (a power of two).
/// The memory is not zeroed by the allocator: RAM the VMM gives starts
/// zeroed and is handed out once.
pub fn alloc_phys(bytes: u64, align: u64) -> Option<u64> {
    // SAFETY: single-threaded, see `PhysAllocator`; no reference escapes.
    let r = unsafe { &mut *PHYS.0.get() };
    let saved = (r.current, r.next);
    while r.current < r.count {
        let range = r.ranges[r.current];
        let start = r.next.max(range.start).next_multiple_of(align);
        if let Some(end) = start.checked_add(bytes) {
            if end <= range.end {
                r.next = end;
                return Some(start);
            }
        }
        r.current += 1;
        r.next = r.ranges.get(r.current).map_or(0, |x| x.start);
    }
    // Nothing fits: leave the free space to smaller allocations.
    (r.current, r.next) = saved;
    None
}

/// Free bytes left (in all ranges).
pub fn free_bytes() -> u64 {
    // SAFETY: single-threaded, see `PhysAllocator`; read only.
    let r = unsafe { &*PHYS.0.get() };
    (r.current..r.count)
        .map(|i| {
            let range = r.ranges[i];
            range.end - r.next.max(range.start).min(range.end)
        })
        .sum()
}

/// The Rust heap (used by smoltcp's socket set and buffers): never frees.
struct BumpHeap;

// SAFETY: returns fresh, aligned, never-reused memory or null.
unsafe impl GlobalAlloc for BumpHeap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        alloc_phys(layout.size().max(1) as u64, layout.align() as u64)
            .map_or(core::ptr::null_mut(), |a| a as *mut u8)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as `alloc`.
        let p = unsafe { self.alloc(layout) };
        if !p.is_null() {
            // SAFETY: `p` points to `layout.size()` fresh bytes.
            unsafe { core::ptr::write_bytes(p, 0, layout.size()) };
        }
        p
    }

    unsafe fn dealloc(&self, _ptr: *mut u8, _layout: Layout) {}
}

#[global_allocator]
static HEAP: BumpHeap = BumpHeap;
