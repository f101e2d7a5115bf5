//! The PVH `hvm_start_info` the VMM leaves in guest memory (its address
//! arrives in `ebx`): the command line and the e820-style memory map.

use core::ptr::read_volatile;

const MAGIC: u32 = 0x336e_c578;
/// Most RAM ranges kept from the memory map.
pub const MAX_RAM_RANGES: usize = 16;
/// Longest command line kept.
pub const MAX_CMDLINE: usize = 4096;
const E820_RAM: u32 = 1;

#[derive(Clone, Copy, Debug, Default)]
pub struct RamRange {
    pub start: u64,
    pub end: u64,
}

/// What the guest keeps of the start info: copied out at boot, because the
/// VMM may have placed it in memory the guest later allocates.
pub struct BootInfo {
    cmdline: [u8; MAX_CMDLINE],
    cmdline_len: usize,
    pub ram: [RamRange; MAX_RAM_RANGES],
    pub ram_ranges: usize,
}

#[derive(Debug)]
pub enum StartInfoError {
    BadMagic(u32),
    CmdlineNotUtf8,
}

impl core::fmt::Display for StartInfoError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            StartInfoError::BadMagic(m) => write!(f, "bad magic {m:#x}"),
            StartInfoError::CmdlineNotUtf8 => write!(f, "command line is not UTF-8"),
        }
    }
}

impl BootInfo {
    pub fn cmdline(&self) -> &str {
        core::str::from_utf8(&self.cmdline[..self.cmdline_len]).unwrap_or("")
    }

    pub fn ram(&self) -> &[RamRange] {
        &self.ram[..self.ram_ranges]
    }

    pub fn ram_bytes(&self) -> u64 {
        self.ram().iter().map(|r| r.end - r.start).sum()
    }
}

/// Reads the start info at guest-physical (= virtual) address `paddr`.
///
/// # Safety
/// `paddr` must be the address the VMM passed in `ebx`; the structures it
/// points to must be mapped (the first 512 GiB are identity mapped).
pub unsafe fn read(paddr: u64, out: &mut BootInfo) -> Result<(), StartInfoError> {
    let base = paddr as *const u8;
    // SAFETY: per the function contract, `base` points to an hvm_start_info
    // (fields at fixed offsets); reads are volatile because the VMM wrote it.
    unsafe {
        let magic = read_volatile(base as *const u32);
        if magic != MAGIC {
            return Err(StartInfoError::BadMagic(magic));
        }
        let version = read_volatile(base.add(4) as *const u32);
        let cmdline = read_volatile(base.add(24) as *const u64);
        if cmdline != 0 {
            let p = cmdline as *const u8;
            while out.cmdline_len < MAX_CMDLINE {
                let b = read_volatile(p.add(out.cmdline_len));
                if b == 0 {
                    break;
                }
                out.cmdline[out.cmdline_len] = b;
                out.cmdline_len += 1;
            }
        }
        if version >= 1 {
            let memmap = read_volatile(base.add(40) as *const u64) as *const u8;
            let entries = read_volatile(base.add(48) as *const u32);
            // Far more than any VMM passes; bounds a corrupt count.
            for i in 0..entries.min(1024) as usize {
                let e = memmap.add(i * 24);
                let addr = read_volatile(e as *const u64);
                let size = read_volatile(e.add(8) as *const u64);
                let kind = read_volatile(e.add(16) as *const u32);
                if kind == E820_RAM && size > 0 && out.ram_ranges < MAX_RAM_RANGES {
                    out.ram[out.ram_ranges] = RamRange {
                        start: addr,
                        end: addr.saturating_add(size),
                    };
                    out.ram_ranges += 1;
                }
            }
        }
    }
    if core::str::from_utf8(&out.cmdline[..out.cmdline_len]).is_err() {
        return Err(StartInfoError::CmdlineNotUtf8);
    }
    Ok(())
}

impl BootInfo {
    pub const fn empty() -> Self {
        Self {
            cmdline: [0; MAX_CMDLINE],
            cmdline_len: 0,
            ram: [RamRange { start: 0, end: 0 }; MAX_RAM_RANGES],
            ram_ranges: 0,
        }
    }
}
