//! Dirty-page tracking: pages written by the guest (KVM) and by the VMM.

pub mod vmm_pages;

pub use vmm_pages::{VmmDirtyPages, PAGE_SIZE};
