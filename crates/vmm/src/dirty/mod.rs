//! Dirty-page tracking: pages written by the guest (KVM) and by the VMM.
//!
//! - [`tracker`]: [`DirtyTracker`], the one interface callers use (start,
//!   harvest, stop), over either
//! - [`ring`]: KVM's per-vCPU dirty rings (O(dirty) harvests), or
//! - [`bitmap`]: KVM's per-slot dirty bitmaps (O(memory), the fallback);
//! - [`vmm_pages`]: pages the VMM itself writes, merged into every harvest.

pub mod bitmap;
pub mod page_writer;
pub mod ring;
pub mod tracker;
pub mod vmm_pages;

pub use ring::DirtyRing;
pub use tracker::{
    DirtyError, DirtyStats, DirtyTracker, DirtyTrackerConfig, DirtyTrackerKind, DirtyTrackingMode,
    KeptHarvest, DEFAULT_RING_ENTRIES,
};
pub use vmm_pages::{VmmDirtyPages, PAGE_SIZE};
