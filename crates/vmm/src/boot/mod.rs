//! Loading a kernel and writing what it needs to boot: the PVH start info or
//! (lab) the Linux zero page, the memory map, command line and initramfs.

pub mod bzimage;
pub mod memmap;
pub mod pvh;

use std::path::PathBuf;

/// Errors while loading the kernel and boot structures.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel file cannot be opened or read.
    #[error("cannot read kernel {path}")]
    KernelFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The kernel is not a loadable ELF (or is corrupt).
    #[error("kernel {path} is not a loadable ELF image: {reason}")]
    KernelFormat {
        /// The file.
        path: PathBuf,
        /// The loader's complaint.
        reason: String,
    },
    /// The ELF has no PVH entry note.
    #[error("kernel {0} has no PVH entry point (XEN_ELFNOTE_PHYS32_ENTRY); kemari boots PVH ELF kernels")]
    NoPvhEntry(PathBuf),
    /// The initramfs cannot be read or does not fit.
    #[error("initramfs {path}: {reason}")]
    Initramfs {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The command line is too long or has a NUL byte.
    #[error("kernel command line is invalid: {0}")]
    Cmdline(String),
    /// A boot structure could not be written to guest memory.
    #[error("cannot write {0} to guest memory")]
    Write(&'static str),
}

/// Copies the file at `path` into guest memory at the highest page-aligned
/// address whose end stays below `top` and whose start stays above the kernel
/// and the legacy area. Returns (address, size) or why it cannot.
pub fn place_initramfs(
    mem: &crate::memory::GuestMemoryMmap,
    path: &std::path::Path,
    top: u64,
    kernel_end: u64,
) -> Result<(u64, u64), String> {
    use vm_memory::bitmap::Bitmap;
    use vm_memory::{GuestAddress, GuestMemoryBackend, ReadVolatile};

    let mut f = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let size = f.metadata().map_err(|e| e.to_string())?.len();
    let addr = top
        .checked_sub(size)
        .map(|a| a & !0xfff)
        .filter(|&a| a >= kernel_end.max(crate::layout::HIGH_MEMORY_START))
        .ok_or_else(|| format!("{size} bytes do not fit below {top:#x}"))?;
    let slice = mem
        .get_slice(GuestAddress(addr), size as usize)
        .map_err(|e| e.to_string())?;
    f.read_exact_volatile(&mut slice.clone())
        .map_err(|e| e.to_string())?;
    // Keep dirty tracking honest: this write bypassed `Bytes`.
    slice.bitmap().mark_dirty(0, size as usize);
    Ok((addr, size))
}
