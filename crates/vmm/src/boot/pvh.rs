//! PVH boot: load an ELF kernel with a XEN_ELFNOTE_PHYS32_ENTRY note and write
//! `hvm_start_info`, the memory map, the command line and the initramfs (as the
//! first module). The boot vCPU starts in 32-bit protected mode at the entry
//! with `ebx` pointing at the start info.

use std::fs::File;
use std::path::Path;

use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{load_cmdline, KernelLoader};
use vm_memory::GuestAddress;

use super::memmap::memory_map;
use super::BootError;
use crate::layout;
use crate::memory::GuestMemoryMmap;

const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
/// Where the module list goes (after the memory map).
const PVH_MODLIST_START: u64 = layout::PVH_MEMMAP_START + 0x800;

/// What the boot vCPU needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PvhBoot {
    /// 32-bit entry point.
    pub entry: u64,
    /// Guest-physical address of `hvm_start_info`.
    pub start_info: u64,
    /// First byte after the kernel image.
    pub kernel_end: u64,
}

/// Inputs of a PVH boot.
pub struct PvhBootSpec<'a> {
    /// ELF kernel.
    pub kernel: &'a Path,
    /// Optional initramfs, passed as module 0.
    pub initramfs: Option<&'a Path>,
    /// Full command line.
    pub cmdline: &'a str,
    /// RSDP address, if ACPI tables were written.
    pub rsdp: Option<u64>,
}

/// Loads the kernel and writes all PVH boot structures into `mem`.
pub fn load(
    mem: &GuestMemoryMmap,
    mem_size: u64,
    spec: &PvhBootSpec<'_>,
) -> Result<PvhBoot, BootError> {
    let kpath = spec.kernel.to_path_buf();
    let mut kernel = File::open(spec.kernel).map_err(|source| BootError::KernelFile {
        path: kpath.clone(),
        source,
    })?;
    let loaded = Elf::load(
        mem,
        None,
        &mut kernel,
        Some(GuestAddress(layout::HIGH_MEMORY_START)),
    )
    .map_err(|e| BootError::KernelFormat {
        path: kpath.clone(),
        reason: e.to_string(),
    })?;
    let entry = match loaded.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(addr) => addr.0,
        _ => return Err(BootError::NoPvhEntry(kpath)),
    };

    // Command line.
    let mut cmdline =
        Cmdline::new(layout::CMDLINE_MAX_SIZE).map_err(|e| BootError::Cmdline(e.to_string()))?;
    cmdline
        .insert_str(spec.cmdline)
        .map_err(|e| BootError::Cmdline(e.to_string()))?;
    load_cmdline(mem, GuestAddress(layout::CMDLINE_START), &cmdline)
        .map_err(|_| BootError::Write("command line"))?;

    // Initramfs at the top of low RAM, page aligned.
    let module = match spec.initramfs {
        Some(path) => Some(load_initramfs(mem, mem_size, path, loaded.kernel_end)?),
        None => None,
    };

    let entries: Vec<hvm_memmap_table_entry> = memory_map(mem_size)
        .into_iter()
        .map(|e| hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind,
            reserved: 0,
        })
        .collect();
    let start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        flags: 0,
        nr_modules: u32::from(module.is_some()),
        modlist_paddr: if module.is_some() {
            PVH_MODLIST_START
        } else {
            0
        },
        cmdline_paddr: layout::CMDLINE_START,
        rsdp_paddr: spec.rsdp.unwrap_or(0),
        memmap_paddr: layout::PVH_MEMMAP_START,
        memmap_entries: entries.len() as u32,
        reserved: 0,
    };
    let mut params = BootParams::new(&start_info, GuestAddress(layout::PVH_INFO_START));
    params.set_sections(&entries, GuestAddress(layout::PVH_MEMMAP_START));
    if let Some((addr, size)) = module {
        params.set_modules(
            &[hvm_modlist_entry {
                paddr: addr,
                size,
                cmdline_paddr: 0,
                reserved: 0,
            }],
            GuestAddress(PVH_MODLIST_START),
        );
    }
    PvhBootConfigurator::write_bootparams::<GuestMemoryMmap>(&params, mem)
        .map_err(|_| BootError::Write("PVH start info"))?;

    Ok(PvhBoot {
        entry,
        start_info: layout::PVH_INFO_START,
        kernel_end: loaded.kernel_end,
    })
}

/// Copies the initramfs to the highest page-aligned address below the MMIO gap
/// (or the end of RAM) that stays above the kernel. Returns (address, size).
pub fn load_initramfs(
    mem: &GuestMemoryMmap,
    mem_size: u64,
    path: &Path,
    kernel_end: u64,
) -> Result<(u64, u64), BootError> {
    let top = mem_size.min(layout::MMIO_GAP_START);
    super::place_initramfs(mem, path, top, kernel_end).map_err(|reason| BootError::Initramfs {
        path: path.to_path_buf(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{GuestMemoryFile, MemoryBacking};
    use std::io::Write;
    use vm_memory::Bytes;

    fn mem(size: u64) -> GuestMemoryMmap {
        GuestMemoryFile::create(size, &MemoryBacking::Memfd)
            .unwrap()
            .map()
            .unwrap()
    }

    fn temp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("kemari-{}-{name}", std::process::id()));
        std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    #[test]
    fn missing_and_garbage_kernels_are_clear_errors() {
        let m = mem(64 << 20);
        let spec = |k: &'static Path| PvhBootSpec {
            kernel: k,
            initramfs: None,
            cmdline: "",
            rsdp: None,
        };
        let e = load(&m, 64 << 20, &spec(Path::new("/nonexistent/kernel"))).unwrap_err();
        assert!(matches!(e, BootError::KernelFile { .. }), "{e}");
        let garbage = temp("garbage", &[0x7f, b'E', b'L', b'F', 1, 2, 3]);
        let g: &'static Path = Box::leak(garbage.clone().into_boxed_path());
        let e = load(&m, 64 << 20, &spec(g)).unwrap_err();
        assert!(matches!(e, BootError::KernelFormat { .. }), "{e}");
        std::fs::remove_file(garbage).unwrap();
    }

    #[test]
    fn initramfs_goes_high_and_must_fit() {
        let m = mem(64 << 20);
        let p = temp("initrd", &[0xab; 10000]);
        let (addr, size) = load_initramfs(&m, 64 << 20, &p, 2 << 20).unwrap();
        assert_eq!(size, 10000);
        assert_eq!(addr % 4096, 0);
        assert!(addr + size <= 64 << 20);
        assert_eq!(m.read_obj::<u8>(GuestAddress(addr + 9999)).unwrap(), 0xab);
        assert!(load_initramfs(&m, 64 << 20, &p, (64 << 20) - 4096).is_err());
        std::fs::remove_file(p).unwrap();
    }
}
