//! Guest physical address map (x86_64).
//!
//! ```text
//! 0x0000_0000  ┬ low RAM (real-mode area, boot structures, kernel at 1 MiB, ...)
//!              │
//! 0xC000_0000  ┼ MMIO gap: virtio-mmio devices, IOAPIC, LAPIC
//! 0x1_0000_0000┼ high RAM (whatever did not fit below the gap)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_split_around_the_gap() {
        assert_eq!(ram_ranges(256 << 20), vec![(0, 256 << 20, 0)]);
        assert_eq!(
            ram_ranges(4 << 30),
            vec![(0, 3 << 30, 0), (4 << 30, 1 << 30, 3 << 30)]
        );
    }
}
