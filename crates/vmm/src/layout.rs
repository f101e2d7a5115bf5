//! Guest physical address map (x86_64).
//!
//! ```text
//! 0x0000_0000  ┬ low RAM (real-mode area, boot structures, kernel at 1 MiB, ...)
//!              │
//! 0xC000_0000  ┼ MMIO gap: virtio-mmio devices, IOAPIC, LAPIC
//! 0x1_0000_0000┼ high RAM (whatever did not fit below the gap)
//!              ┼ virtio-pmem windows, each 1 GiB aligned, from 4 GiB or the
//!              │ first GiB boundary after high RAM
//! ```

/// PVH `hvm_start_info` structure.
pub const PVH_INFO_START: u64 = 0x6000;
/// PVH memory map entries (right after the start info).
pub const PVH_MEMMAP_START: u64 = 0x7000;
/// Maximum number of memory map entries we write.
pub const PVH_MEMMAP_MAX_ENTRIES: usize = 64;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x2_0000;
/// Longest command line we accept (bytes, without the NUL).
pub const CMDLINE_MAX_SIZE: usize = 0x1_0000;
/// Start of the BIOS/EBDA area that stays reserved in the memory map.
pub const EBDA_START: u64 = 0x9_fc00;
/// Where ACPI tables go (the legacy BIOS area searched for the RSDP).
pub const ACPI_START: u64 = 0xe_0000;
/// First byte of guest RAM above the legacy area.
pub const HIGH_MEMORY_START: u64 = 0x10_0000;

/// Start of the MMIO gap below 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the MMIO gap (4 GiB).
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// First virtio-mmio device window.
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
/// Size of one virtio-mmio device window.
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// First GSI given to virtio-mmio devices (0-4 are the PIT, i8042, serial...).
pub const VIRTIO_IRQ_BASE: u32 = 5;
/// Most virtio-mmio devices a VM can have (IRQs 5..=23 on the IOAPIC).
pub const VIRTIO_MAX_DEVICES: usize = 19;
/// IOAPIC MMIO base.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// Local APIC MMIO base.
pub const APIC_START: u64 = 0xfee0_0000;

/// Alignment of a virtio-pmem window's guest address (Linux maps device
/// memory in 2 MiB subsections at least; 1 GiB keeps a guest's huge pages).
pub const PMEM_ALIGN: u64 = 1 << 30;
/// A virtio-pmem backing's size must be a multiple of this.
pub const PMEM_SIZE_ALIGN: u64 = 2 << 20;

/// Smallest guest memory we accept.
pub const MIN_MEMORY: u64 = 16 << 20;
/// Largest guest memory we accept.
pub const MAX_MEMORY: u64 = 1 << 40;

/// Guest-physical window of virtio-mmio device `index`.
pub fn virtio_mmio_base(index: usize) -> u64 {
    VIRTIO_MMIO_START + index as u64 * VIRTIO_MMIO_SIZE
}

/// The RAM ranges `(guest address, length)` for `size` bytes of guest memory,
/// and for each the offset of its bytes in the memory file.
pub fn ram_ranges(size: u64) -> Vec<(u64, u64, u64)> {
    if size <= MMIO_GAP_START {
        vec![(0, size, 0)]
    } else {
        vec![
            (0, MMIO_GAP_START, 0),
            (MMIO_GAP_END, size - MMIO_GAP_START, MMIO_GAP_START),
        ]
    }
}

/// Guest addresses of virtio-pmem windows of `sizes` bytes, in order, for
/// a VM of `memory` bytes: after RAM and above 4 GiB, each on a
/// [`PMEM_ALIGN`] boundary.
pub fn pmem_windows(memory: u64, sizes: &[u64]) -> Vec<u64> {
    let ram_end = ram_ranges(memory)
        .last()
        .map_or(0, |&(start, len, _)| start + len);
    let mut next = ram_end.max(MMIO_GAP_END).next_multiple_of(PMEM_ALIGN);
    sizes
        .iter()
        .map(|&size| {
            let base = next;
            next = base + size.next_multiple_of(PMEM_ALIGN);
            base
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pmem_windows_follow_ram_above_4g_on_gib_boundaries() {
        assert_eq!(pmem_windows(256 << 20, &[]), Vec::<u64>::new());
        assert_eq!(
            pmem_windows(256 << 20, &[2 << 20, 1 << 30, 4 << 20]),
            vec![4 << 30, 5 << 30, 6 << 30]
        );
        // 4 GiB of RAM ends at 5 GiB; 4.5 GiB at 5.5, rounded up to 6.
        assert_eq!(pmem_windows(4 << 30, &[2 << 20]), vec![5 << 30]);
        assert_eq!(pmem_windows((9 << 30) / 2, &[2 << 20]), vec![6 << 30]);
    }

    #[test]
    fn ranges_split_around_the_gap() {
        assert_eq!(ram_ranges(256 << 20), vec![(0, 256 << 20, 0)]);
        assert_eq!(
            ram_ranges(4 << 30),
            vec![(0, 3 << 30, 0), (4 << 30, 1 << 30, 3 << 30)]
        );
    }
}
