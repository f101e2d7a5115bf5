//! Linux bzImage boot (the x86 64-bit boot protocol): load the protected-mode
//! kernel at 1 MiB, write the zero page (`boot_params`: E820 map, command
//! line, initramfs, RSDP), identity page tables and a GDT, and say where the
//! boot vCPU starts.
//!
//! Guest-physical layout (all below [`layout::CMDLINE_START`]):
//!
//! ```text
//! 0x0500  GDT: null, 0x08 flat 64-bit code, 0x10 flat data, 0x18 TSS
//! 0x8ff0  initial stack pointer (BootEntry::Linux64 sets rsp there)
//! 0x9000  zero page (boot_params)
//! 0xa000  PML4 ─> 0xb000 PDPT ─> 0xc000..0xf000 four page directories:
//!         0..4 GiB identity-mapped with 2 MiB pages
//! CMDLINE_START  command line, NUL-terminated
//! 0x100000       kernel (protected-mode part of the bzImage)
//! top of low RAM initramfs (page-aligned, below initrd_addr_max)
//! ```
//!
//! The VMM core starts the boot vCPU with `BootEntry::Linux64 { entry:
//! boot.entry_64, boot_params: boot.zero_page, page_tables: boot.page_tables,
//! gdt: boot.gdt }`: long mode (CR0 = PG|ET|PE, CR4 = PAE, EFER = LME|LMA),
//! CR3 = PML4, CS = 0x08 (64-bit code), DS/ES/SS = 0x10, RSI = zero page,
//! interrupts off. The other vCPUs wait for INIT/SIPI from the in-kernel LAPIC.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::KernelLoader;
use vm_memory::{Bytes, GuestAddress};

use crate::boot::memmap;
use crate::layout;
use crate::memory::GuestMemoryMmap;

/// The GDT the loader writes (4 entries; the core loads limit 0x1f).
pub const GDT_START: u64 = 0x500;
/// The zero page (`boot_params`).
pub const ZERO_PAGE_START: u64 = 0x9000;
/// PML4 of the identity page tables.
pub const PML4_START: u64 = 0xa000;
const PDPT_START: u64 = 0xb000;
const PD_START: u64 = 0xc000;
/// Identity-mapped gigabytes (one page directory each).
const IDENTITY_GIB: u64 = 4;

/// Where the kernel's protected-mode code is loaded.
const KERNEL_START: u64 = layout::HIGH_MEMORY_START;
/// `type_of_loader`: "undefined" boot loader.
const LOADER_TYPE_UNDEFINED: u8 = 0xff;
/// xloadflags: the kernel has a 64-bit entry point at load address + 0x200.
const XLF_KERNEL_64: u16 = 1 << 0;
/// Offset of the 64-bit entry from the load address.
const ENTRY_64_OFFSET: u64 = 0x200;
/// Oldest boot protocol with the fields we use (cmdline_size, 64-bit entry).
const MIN_PROTOCOL: u16 = 0x020c;
/// "HdrS" at 0x202 marks a bzImage.
const HDRS_MAGIC: u32 = 0x5372_6448;
const HDRS_OFFSET: u64 = 0x202;
/// Page-table entry bits.
const PTE_PRESENT_RW: u64 = 0x3;
const PDE_HUGE: u64 = 0x80;

/// Inputs of a bzImage boot.
#[derive(Debug, Clone, Copy)]
pub struct BzImageSpec<'a> {
    /// The bzImage (e.g. /boot/vmlinuz-*).
    pub kernel: &'a Path,
    /// Optional initramfs.
    pub initramfs: Option<&'a Path>,
    /// Full command line.
    pub cmdline: &'a str,
    /// RSDP address from [`crate::acpi::create_acpi_tables`], if any.
    pub rsdp: Option<u64>,
}

/// What the boot vCPU needs (see the module doc for the register state).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BzImageBoot {
    /// 64-bit entry point (load address + 0x200).
    pub entry_64: u64,
    /// Guest-physical address of `boot_params` (goes in RSI).
    pub zero_page: u64,
    /// PML4 (goes in CR3).
    pub page_tables: u64,
    /// GDT base (limit 0x1f).
    pub gdt: u64,
    /// Where the kernel was loaded.
    pub kernel_load: u64,
    /// First byte after the loaded kernel.
    pub kernel_end: u64,
    /// Initramfs (address, size), if any.
    pub initramfs: Option<(u64, u64)>,
}

/// Errors of a bzImage boot.
#[derive(Debug, thiserror::Error)]
pub enum BzImageError {
    /// The kernel file cannot be opened or read.
    #[error("cannot read kernel {path}")]
    KernelFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// linux-loader refused the image.
    #[error("kernel {path} is not a loadable bzImage: {source}")]
    Load {
        /// The file.
        path: PathBuf,
        /// The loader's error.
        #[source]
        source: linux_loader::loader::Error,
    },
    /// The image is a bzImage we cannot enter in 64-bit mode.
    #[error("kernel {path}: {reason}")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The command line is too long or has a NUL byte.
    #[error("kernel command line is invalid: {0}")]
    Cmdline(String),
    /// The initramfs cannot be read or does not fit.
    #[error("initramfs {path}: {reason}")]
    Initramfs {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The memory map does not fit in the zero page.
    #[error("memory map has {0} entries, the zero page holds 128")]
    MemoryMap(usize),
    /// A boot structure could not be written to guest memory.
    #[error("cannot write the {what} to guest memory")]
    Write {
        /// Which structure.
        what: &'static str,
        /// The cause.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// linux-loader could not write the zero page.
    #[error("cannot write the zero page: {0}")]
    ZeroPage(#[source] linux_loader::configurator::Error),
}

/// True if `path` is a bzImage (has the "HdrS" boot header), false for
/// anything else (an ELF vmlinux, say).
pub fn is_bzimage(path: &Path) -> std::io::Result<bool> {
    let mut f = File::open(path)?;
    if f.metadata()?.len() < HDRS_OFFSET + 4 {
        return Ok(false);
    }
    f.seek(SeekFrom::Start(HDRS_OFFSET))?;
    let mut magic = [0u8; 4];
    f.read_exact(&mut magic)?;
    Ok(u32::from_le_bytes(magic) == HDRS_MAGIC)
}

/// Loads the bzImage and writes every boot structure into `mem` (`mem_size`
/// bytes of RAM laid out by [`layout::ram_ranges`]).
pub fn load(
    mem: &GuestMemoryMmap,
    mem_size: u64,
    spec: &BzImageSpec<'_>,
) -> Result<BzImageBoot, BzImageError> {
    let kpath = spec.kernel.to_path_buf();
    let mut kernel = File::open(spec.kernel).map_err(|source| BzImageError::KernelFile {
        path: kpath.clone(),
        source,
    })?;
    let loaded = BzImage::load(
        mem,
        Some(GuestAddress(KERNEL_START)),
        &mut kernel,
        Some(GuestAddress(layout::HIGH_MEMORY_START)),
    )
    .map_err(|source| BzImageError::Load {
        path: kpath.clone(),
        source,
    })?;
    let unsupported = |reason: String| BzImageError::Unsupported {
        path: kpath.clone(),
        reason,
    };
    let mut hdr = loaded
        .setup_header
        .ok_or_else(|| unsupported("no setup header".into()))?;
    let version = hdr.version;
    if version < MIN_PROTOCOL {
        return Err(unsupported(format!(
            "boot protocol {version:#x} is older than {MIN_PROTOCOL:#x}"
        )));
    }
    if hdr.xloadflags & XLF_KERNEL_64 == 0 {
        return Err(unsupported("no 64-bit entry point (XLF_KERNEL_64)".into()));
    }

    // Command line.
    let max_cmdline = (hdr.cmdline_size as usize).min(layout::CMDLINE_MAX_SIZE);
    if spec.cmdline.len() > max_cmdline {
        return Err(BzImageError::Cmdline(format!(
            "{} bytes, the kernel accepts {max_cmdline}",
            spec.cmdline.len()
        )));
    }
    if spec.cmdline.contains('\0') {
        return Err(BzImageError::Cmdline("contains a NUL byte".into()));
    }
    let mut cmdline = spec.cmdline.as_bytes().to_vec();
    cmdline.push(0);
    write(mem, &cmdline, layout::CMDLINE_START, "command line")?;

    // Initramfs, as high as the kernel allows.
    let initramfs = match spec.initramfs {
        Some(path) => Some(load_initramfs(
            mem,
            mem_size,
            path,
            loaded.kernel_end,
            hdr.initrd_addr_max,
        )?),
        None => None,
    };

    hdr.type_of_loader = LOADER_TYPE_UNDEFINED;
    hdr.cmd_line_ptr = layout::CMDLINE_START as u32;
    // cmdline_size stays the kernel's own limit (a read-only field for loaders).
    let mut params = boot_params {
        hdr,
        ..Default::default()
    };
    if let Some((addr, size)) = initramfs {
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
        params.ext_ramdisk_image = (addr >> 32) as u32;
        params.ext_ramdisk_size = (size >> 32) as u32;
    }
    params.acpi_rsdp_addr = spec.rsdp.unwrap_or(0);
    let map = memmap::memory_map(mem_size);
    if map.len() > params.e820_table.len() {
        return Err(BzImageError::MemoryMap(map.len()));
    }
    for (slot, e) in params.e820_table.iter_mut().zip(&map) {
        *slot = boot_e820_entry {
            addr: e.addr,
            size: e.size,
            r#type: e.kind,
        };
    }
    params.e820_entries = map.len() as u8;
    LinuxBootConfigurator::write_bootparams::<GuestMemoryMmap>(
        &BootParams::new::<boot_params>(&params, GuestAddress(ZERO_PAGE_START)),
        mem,
    )
    .map_err(BzImageError::ZeroPage)?;

    write_gdt(mem)?;
    write_page_tables(mem)?;

    Ok(BzImageBoot {
        entry_64: loaded.kernel_load.0 + ENTRY_64_OFFSET,
        zero_page: ZERO_PAGE_START,
        page_tables: PML4_START,
        gdt: GDT_START,
        kernel_load: loaded.kernel_load.0,
        kernel_end: loaded.kernel_end,
        initramfs,
    })
}

fn write(
    mem: &GuestMemoryMmap,
    bytes: &[u8],
    addr: u64,
    what: &'static str,
) -> Result<(), BzImageError> {
    mem.write_slice(bytes, GuestAddress(addr))
        .map_err(|source| BzImageError::Write { what, source })
}

/// Null, 64-bit code (0x08), data (0x10) and a TSS (0x18), as the core's
/// `BootEntry::Linux64` segment registers describe them.
fn write_gdt(mem: &GuestMemoryMmap) -> Result<(), BzImageError> {
    let gdt: [u64; 4] = [
        0,
        0x00af_9b00_0000_ffff, // code: present, DPL0, exec/read, accessed, L, G
        0x00cf_9300_0000_ffff, // data: present, DPL0, read/write, accessed, D/B, G
        0x0000_8b00_0000_0067, // TSS: present, busy 64-bit TSS, limit 0x67
    ];
    let bytes: Vec<u8> = gdt.iter().flat_map(|d| d.to_le_bytes()).collect();
    write(mem, &bytes, GDT_START, "GDT")
}

/// Identity map of the first 4 GiB with 2 MiB pages.
fn write_page_tables(mem: &GuestMemoryMmap) -> Result<(), BzImageError> {
    write(
        mem,
        &(PDPT_START | PTE_PRESENT_RW).to_le_bytes(),
        PML4_START,
        "page tables",
    )?;
    let mut pdpt = Vec::with_capacity(IDENTITY_GIB as usize * 8);
    let mut pds = Vec::with_capacity(IDENTITY_GIB as usize * 4096);
    for gib in 0..IDENTITY_GIB {
        let pd = PD_START + gib * 0x1000;
        pdpt.extend_from_slice(&(pd | PTE_PRESENT_RW).to_le_bytes());
        for i in 0..512u64 {
            let addr = (gib << 30) | (i << 21);
            pds.extend_from_slice(&(addr | PTE_PRESENT_RW | PDE_HUGE).to_le_bytes());
        }
    }
    write(mem, &pdpt, PDPT_START, "page tables")?;
    write(mem, &pds, PD_START, "page tables")
}

/// Copies the initramfs to the highest page-aligned address that is below the
/// MMIO gap, the end of RAM and the kernel's `initrd_addr_max`, and above the
/// kernel. Returns (address, size).
fn load_initramfs(
    mem: &GuestMemoryMmap,
    mem_size: u64,
    path: &Path,
    kernel_end: u64,
    initrd_addr_max: u32,
) -> Result<(u64, u64), BzImageError> {
    // initrd_addr_max is the highest address the last byte may occupy.
    let top = mem_size
        .min(layout::MMIO_GAP_START)
        .min(u64::from(initrd_addr_max) + 1);
    super::place_initramfs(mem, path, top, kernel_end).map_err(|reason| BzImageError::Initramfs {
        path: path.to_path_buf(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{GuestMemoryFile, MemoryBacking};
    use std::io::Write;

    const MEM: u64 = 128 << 20;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryFile::create(MEM, &MemoryBacking::Memfd)
            .unwrap()
            .map()
            .unwrap()
    }

    /// A file holding `bytes`, removed when dropped.
    fn temp(bytes: &[u8]) -> tempfile::TempPath {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        f.into_temp_path()
    }

    /// A minimal bzImage: a boot sector and one setup sector carrying the
    /// setup header, then `payload` as the protected-mode kernel.
    fn fake_bzimage(version: u16, xloadflags: u16, payload: &[u8]) -> Vec<u8> {
        let mut img = vec![0u8; 1024];
        img[0x1f1] = 1; // setup_sects
        img[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
        img[0x202..0x206].copy_from_slice(&HDRS_MAGIC.to_le_bytes());
        img[0x206..0x208].copy_from_slice(&version.to_le_bytes());
        img[0x211] = 0x01; // loadflags: LOADED_HIGH
        img[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes()); // code32_start
        img[0x22c..0x230].copy_from_slice(&0x37ff_ffffu32.to_le_bytes()); // initrd_addr_max
        img[0x236..0x238].copy_from_slice(&xloadflags.to_le_bytes());
        img[0x238..0x23c].copy_from_slice(&2048u32.to_le_bytes()); // cmdline_size
        img.extend_from_slice(payload);
        img
    }

    fn read_u64(m: &GuestMemoryMmap, addr: u64) -> u64 {
        m.read_obj(GuestAddress(addr)).unwrap()
    }

    #[test]
    fn loads_kernel_and_writes_zero_page() {
        let m = mem();
        let payload: Vec<u8> = (0..8192u32).map(|i| i as u8).collect();
        let kernel = temp(&fake_bzimage(0x020f, 0x3, &payload));
        let initrd = temp(&[0x5a; 10000]);
        assert!(is_bzimage(&kernel).unwrap());
        let boot = load(
            &m,
            MEM,
            &BzImageSpec {
                kernel: &kernel,
                initramfs: Some(&initrd),
                cmdline: "console=ttyS0 quiet",
                rsdp: Some(layout::ACPI_START),
            },
        )
        .unwrap();
        assert_eq!(boot.kernel_load, 0x10_0000);
        assert_eq!(boot.entry_64, 0x10_0200);
        assert_eq!(boot.zero_page, ZERO_PAGE_START);

        // The kernel payload is at 1 MiB.
        let mut k = vec![0u8; payload.len()];
        m.read_slice(&mut k, GuestAddress(0x10_0000)).unwrap();
        assert_eq!(k, payload);

        // The initramfs: page-aligned, at the top of RAM, above the kernel.
        let (iaddr, isize) = boot.initramfs.unwrap();
        assert_eq!(isize, 10000);
        assert_eq!(iaddr % 4096, 0);
        assert!(iaddr >= boot.kernel_end && iaddr + isize <= MEM);
        assert!(MEM - (iaddr + isize) < 4096);

        // boot_params as the kernel reads it.
        let p: boot_params = m.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        let hdr = p.hdr;
        assert_eq!({ hdr.type_of_loader }, 0xff);
        assert_eq!({ hdr.boot_flag }, 0xaa55);
        assert_eq!({ hdr.header }, HDRS_MAGIC);
        assert_eq!({ hdr.cmd_line_ptr }, layout::CMDLINE_START as u32);
        assert_eq!({ hdr.ramdisk_image }, iaddr as u32);
        assert_eq!({ hdr.ramdisk_size }, 10000);
        assert_eq!({ p.acpi_rsdp_addr }, layout::ACPI_START);
        let map = memmap::memory_map(MEM);
        assert_eq!(p.e820_entries as usize, map.len());
        for (e, want) in p.e820_table.iter().zip(&map) {
            assert_eq!(
                ({ e.addr }, { e.size }, { e.r#type }),
                (want.addr, want.size, want.kind)
            );
        }
        let mut cmd = vec![0u8; 20];
        m.read_slice(&mut cmd, GuestAddress(layout::CMDLINE_START))
            .unwrap();
        assert_eq!(&cmd, b"console=ttyS0 quiet\0");

        // GDT and identity page tables.
        assert_eq!(read_u64(&m, GDT_START + 8), 0x00af_9b00_0000_ffff);
        assert_eq!(read_u64(&m, PML4_START), PDPT_START | 3);
        assert_eq!(read_u64(&m, PDPT_START + 8), (PD_START + 0x1000) | 3);
        // 0x4020_0000 (1 GiB + 2 MiB) maps to itself.
        assert_eq!(read_u64(&m, PD_START + 0x1000 + 8), 0x4020_0000 | 0x83);
    }

    #[test]
    fn refuses_what_it_cannot_boot() {
        let m = mem();
        fn spec(kernel: &Path) -> BzImageSpec<'_> {
            BzImageSpec {
                kernel,
                initramfs: None,
                cmdline: "",
                rsdp: None,
            }
        }
        let e = load(&m, MEM, &spec(Path::new("/nonexistent/bzImage"))).unwrap_err();
        assert!(matches!(e, BzImageError::KernelFile { .. }), "{e}");

        let garbage = temp(&[0x7f; 4096]);
        let e = load(&m, MEM, &spec(&garbage)).unwrap_err();
        assert!(matches!(e, BzImageError::Load { .. }), "{e}");

        let no64 = temp(&fake_bzimage(0x020f, 0x0, &[0; 512]));
        assert!(!is_bzimage(Path::new("/dev/null")).unwrap());
        let e = load(&m, MEM, &spec(&no64)).unwrap_err();
        assert!(matches!(e, BzImageError::Unsupported { .. }), "{e}");

        let old = temp(&fake_bzimage(0x0206, 0x1, &[0; 512]));
        let e = load(&m, MEM, &spec(&old)).unwrap_err();
        assert!(matches!(e, BzImageError::Unsupported { .. }), "{e}");
    }

    #[test]
    fn refuses_long_cmdline_and_huge_initramfs() {
        let m = mem();
        let kernel = temp(&fake_bzimage(0x020f, 0x1, &[0; 512]));
        let long = "x".repeat(4096);
        let e = load(
            &m,
            MEM,
            &BzImageSpec {
                kernel: &kernel,
                initramfs: None,
                cmdline: &long,
                rsdp: None,
            },
        )
        .unwrap_err();
        assert!(matches!(e, BzImageError::Cmdline(_)), "{e}");

        let big = temp(&vec![0u8; (MEM + 4096) as usize]);
        let e = load(
            &m,
            MEM,
            &BzImageSpec {
                kernel: &kernel,
                initramfs: Some(&big),
                cmdline: "",
                rsdp: None,
            },
        )
        .unwrap_err();
        assert!(matches!(e, BzImageError::Initramfs { .. }), "{e}");
    }
}
