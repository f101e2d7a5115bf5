//! The guest's memory map (E820 types), shared by the PVH and Linux boot paths.

use crate::layout;

/// Usable RAM.
pub const E820_RAM: u32 = 1;
/// Reserved.
pub const E820_RESERVED: u32 = 2;

/// One memory map entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryMapEntry {
    /// Guest-physical start.
    pub addr: u64,
    /// Length in bytes.
    pub size: u64,
    /// E820 type.
    pub kind: u32,
}

/// The memory map of a guest with `mem_size` bytes of RAM: low RAM below the
/// EBDA, the legacy BIOS area reserved, RAM from 1 MiB up to the MMIO gap, and
/// the rest above 4 GiB.
pub fn memory_map(mem_size: u64) -> Vec<MemoryMapEntry> {
    let mut map = vec![
        MemoryMapEntry {
            addr: 0,
            size: layout::EBDA_START,
            kind: E820_RAM,
        },
        MemoryMapEntry {
            addr: layout::EBDA_START,
            size: layout::HIGH_MEMORY_START - layout::EBDA_START,
            kind: E820_RESERVED,
        },
    ];
    for (gpa, len, _) in layout::ram_ranges(mem_size) {
        let start = gpa.max(layout::HIGH_MEMORY_START);
        let end = gpa + len;
        if end > start {
            map.push(MemoryMapEntry {
                addr: start,
                size: end - start,
                kind: E820_RAM,
            });
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_covers_ram_and_skips_the_gap() {
        let m = memory_map(4 << 30);
        let ram: u64 = m
            .iter()
            .filter(|e| e.kind == E820_RAM)
            .map(|e| e.size)
            .sum();
        assert_eq!(
            ram,
            (4 << 30) - (layout::HIGH_MEMORY_START - layout::EBDA_START)
        );
        assert!(m
            .iter()
            .all(|e| e.addr + e.size <= layout::MMIO_GAP_START || e.addr >= layout::MMIO_GAP_END));
        assert_eq!(m.last().unwrap().addr, layout::MMIO_GAP_END);
    }
}
