//! Guest memory: one file (a memfd by default, or a file under /dev/shm or a
//! hugetlbfs mount) mapped MAP_SHARED, so that it can outlive the process and be
//! handed to another one (warm restart, zero-copy migration).
//!
//! Pages are never touched at start: a 64 GiB guest costs a few mmap calls.
//! The mapping asks for transparent huge pages (MADV_HUGEPAGE), which a
//! memfd or /dev/shm file gets where the host allows shared memory huge
//! pages (`/sys/kernel/mm/transparent_hugepage/shmem_enabled` = `advise`,
//! `within_size` or `always`): KVM then maps the guest's memory in 2 MiB
//! pieces, as it maps an anonymous-memory VMM's, instead of faulting in
//! every 4 KiB page the guest touches.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::dirty::VmmDirtyPages;
use crate::layout;
use crate::sys;

/// The guest memory type used everywhere in the VMM: every write through it is
/// recorded by [`VmmDirtyPages`] while dirty tracking is on.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<VmmDirtyPages>;
/// One region of [`GuestMemoryMmap`].
pub type GuestRegionMmap = vm_memory::GuestRegionMmap<VmmDirtyPages>;
/// A range of guest memory inside one region, as devices fill it: writes
/// through it are recorded by [`VmmDirtyPages`] like any other.
pub type GuestSlice<'a> = vm_memory::VolatileSlice<'a, vm_memory::bitmap::BS<'a, VmmDirtyPages>>;

/// Errors while setting up guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The size is out of range or not page aligned.
    #[error("guest memory size {size} bytes is invalid: {reason}")]
    InvalidSize {
        /// Requested size.
        size: u64,
        /// Why it was refused.
        reason: &'static str,
    },
    /// memfd_create failed.
    #[error("cannot create memfd for guest memory")]
    Memfd(#[source] std::io::Error),
    /// Opening or creating a backing file failed.
    #[error("cannot open guest memory file {path}")]
    OpenFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The backing file has the wrong size.
    #[error("guest memory file is {actual} bytes, expected {expected}")]
    FileSize {
        /// Size of the file.
        actual: u64,
        /// Size the VM needs.
        expected: u64,
    },
    /// ftruncate/fcntl on the backing file failed.
    #[error("cannot size or seal the guest memory file")]
    Resize(#[source] std::io::Error),
    /// The backing file could not be zeroed nor its pages given back (a
    /// reboot).
    #[error("cannot clear guest memory (zeroing its file or punching a hole in it)")]
    Clear(#[source] std::io::Error),
    /// vm-memory refused the mapping.
    #[error("cannot map guest memory")]
    Map(#[source] vm_memory::mmap::FromRangesError),
}

/// Where guest memory lives.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MemoryBacking {
    /// An anonymous memfd (default).
    #[default]
    Memfd,
    /// A memfd of 2 MiB huge pages (needs vm.nr_hugepages).
    MemfdHugetlb,
    /// A named file (under /dev/shm or a hugetlbfs mount); created if missing,
    /// reused as it is if it exists with the right size (warm restart).
    File {
        /// The file's path.
        path: PathBuf,
    },
}

/// The file behind guest memory and its size.
#[derive(Debug, Clone)]
pub struct GuestMemoryFile {
    file: Arc<File>,
    size: u64,
    backing: MemoryBacking,
}

impl GuestMemoryFile {
    /// Creates (or, for a named file that already exists, opens) the backing.
    pub fn create(size: u64, backing: &MemoryBacking) -> Result<Self, MemoryError> {
        validate_size(size)?;
        let file = match backing {
            MemoryBacking::Memfd => memfd("kemari-guest-ram", 0)?,
            MemoryBacking::MemfdHugetlb => memfd("kemari-guest-ram-2m", libc::MFD_HUGETLB)?,
            MemoryBacking::File { path } => open_named(path)?,
        };
        let actual = file.metadata().map_err(MemoryError::Resize)?.len();
        if actual == 0 {
            file.set_len(size).map_err(MemoryError::Resize)?;
        } else if actual != size {
            return Err(MemoryError::FileSize {
                actual,
                expected: size,
            });
        }
        if !matches!(backing, MemoryBacking::File { .. }) {
            seal_size(&file)?;
        }
        if *backing == MemoryBacking::Memfd
            && read_shmem_huge_setting()
                .as_deref()
                .is_some_and(shmem_huge_pages_off)
        {
            tracing::info!(
                "guest memory comes in 4 KiB pages: shared-memory huge pages are off \
                 (/sys/kernel/mm/transparent_hugepage/shmem_enabled); `advise` makes the \
                 guest's first touch of its memory cheaper (docs/operations.md)"
            );
        }
        Ok(GuestMemoryFile {
            file: Arc::new(file),
            size,
            backing: backing.clone(),
        })
    }

    /// Wraps a file received from elsewhere (another kemari process).
    pub fn from_file(file: File, size: u64, backing: MemoryBacking) -> Result<Self, MemoryError> {
        let actual = file.metadata().map_err(MemoryError::Resize)?.len();
        if actual != size {
            return Err(MemoryError::FileSize {
                actual,
                expected: size,
            });
        }
        Ok(GuestMemoryFile {
            file: Arc::new(file),
            size,
            backing,
        })
    }

    /// Guest memory size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The backing file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// How the memory is backed.
    pub fn backing(&self) -> &MemoryBacking {
        &self.backing
    }

    /// Makes guest memory read as zeroes again, as at a cold boot (a
    /// reboot). Nothing may run on it.
    ///
    /// The pages the guest touched are zeroed where they are, not given
    /// back: the next boot uses them again at once, instead of the host
    /// allocating (and zeroing) each one again at its first touch — the
    /// costly part of a guest's first reads into its memory, on a nested
    /// host the most (docs/architecture.md, "Reboot"). Holes stay holes.
    /// A file that cannot be written (hugetlbfs) has its pages given back.
    pub fn clear(&self) -> Result<(), MemoryError> {
        if self.backing != MemoryBacking::MemfdHugetlb {
            match self.zero_in_place() {
                Ok(()) => return Ok(()),
                // A hugetlbfs file is refused here (EINVAL); anything else
                // is worth a look, since the pages then go back.
                Err(e) => tracing::debug!(
                    error = %e,
                    "cannot zero guest memory in place: giving its pages back instead"
                ),
            }
        }
        let len = i64::try_from(self.size).map_err(|_| {
            MemoryError::Clear(std::io::Error::from(std::io::ErrorKind::InvalidInput))
        })?;
        sys::fallocate(
            self.file.as_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            0,
            len,
        )
        .map_err(MemoryError::Clear)
    }

    /// Writes zeroes over every data extent of the file.
    fn zero_in_place(&self) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        const CHUNK: usize = 1 << 20;
        let zeroes = vec![0u8; CHUNK];
        for (start, end) in sys::data_extents(&self.file, self.size) {
            let mut at = start;
            while at < end {
                let n = (end - at).min(CHUNK as u64) as usize;
                self.file.write_all_at(&zeroes[..n], at)?;
                at += n as u64;
            }
        }
        Ok(())
    }

    /// Maps the file as guest memory, split around the MMIO gap.
    pub fn map(&self) -> Result<GuestMemoryMmap, MemoryError> {
        let ranges: Vec<_> = layout::ram_ranges(self.size)
            .into_iter()
            .map(|(gpa, len, off)| {
                let f = self.file.try_clone().map_err(MemoryError::Resize)?;
                Ok((
                    GuestAddress(gpa),
                    len as usize,
                    Some(FileOffset::new(f, off)),
                ))
            })
            .collect::<Result<_, MemoryError>>()?;
        let mem = GuestMemoryMmap::from_ranges_with_files(ranges).map_err(MemoryError::Map)?;
        advise_huge_pages(&mem);
        Ok(mem)
    }
}

/// The host's shared-memory huge page setting, e.g. `always within_size
/// advise [never] deny force` (None where the kernel has no such file).
fn read_shmem_huge_setting() -> Option<String> {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()
}

/// Whether a `shmem_enabled` setting gives a memfd no huge pages, whatever
/// MADV_HUGEPAGE asks.
fn shmem_huge_pages_off(setting: &str) -> bool {
    setting.contains("[never]") || setting.contains("[deny]")
}

/// Asks for transparent huge pages on every region of `mem`; best effort
/// (a kernel or file system without them keeps 4 KiB pages).
fn advise_huge_pages(mem: &GuestMemoryMmap) {
    for region in mem.iter() {
        // SAFETY: madvise only advises on the region's own live mapping
        // (its address and length as vm-memory mapped it); MADV_HUGEPAGE
        // changes no contents.
        let r = unsafe {
            libc::madvise(
                region.as_ptr().cast(),
                region.len() as usize,
                libc::MADV_HUGEPAGE,
            )
        };
        if r != 0 {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "no transparent huge pages for guest memory"
            );
        }
    }
}

/// Turns recording of VMM writes to guest memory on or off.
pub fn set_vmm_dirty_tracking(mem: &GuestMemoryMmap, enabled: bool) {
    for region in mem.iter() {
        region.bitmap().set_enabled(enabled);
    }
}

/// Guest page frame numbers written by the VMM since the last call, each once.
pub fn harvest_vmm_dirty(mem: &GuestMemoryMmap) -> Vec<u64> {
    let mut pfns = Vec::new();
    for region in mem.iter() {
        let base = region.start_addr().0 / crate::dirty::PAGE_SIZE as u64;
        pfns.extend(region.bitmap().harvest().into_iter().map(|p| base + p));
    }
    pfns
}

fn validate_size(size: u64) -> Result<(), MemoryError> {
    let reason = if size < layout::MIN_MEMORY {
        "below the 16 MiB minimum"
    } else if size > layout::MAX_MEMORY {
        "above the 1 TiB maximum"
    } else if !size.is_multiple_of(2 << 20) {
        "not a multiple of 2 MiB"
    } else {
        return Ok(());
    };
    Err(MemoryError::InvalidSize { size, reason })
}

fn memfd(name: &str, extra_flags: libc::c_uint) -> Result<File, MemoryError> {
    let cname = CString::new(name).expect("static name has no NUL");
    sys::memfd_create(
        &cname,
        libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | extra_flags,
    )
    .map_err(MemoryError::Memfd)
}

/// Opens a named memory file, creating it 0600 if absent (a file that
/// exists keeps the mode its owner gave it).
fn open_named(path: &Path) -> Result<File, MemoryError> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(|source| MemoryError::OpenFile {
            path: path.to_owned(),
            source,
        })
}

fn seal_size(file: &File) -> Result<(), MemoryError> {
    sys::add_seals(
        file.as_fd(),
        libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL,
    )
    .map_err(MemoryError::Resize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn rejects_bad_sizes() {
        for size in [0, 1 << 20, (256 << 20) + 4096, 2 << 40] {
            assert!(matches!(
                GuestMemoryFile::create(size, &MemoryBacking::Memfd),
                Err(MemoryError::InvalidSize { .. })
            ));
        }
    }

    #[test]
    fn shmem_huge_page_settings_read_as_the_kernel_means_them() {
        assert!(shmem_huge_pages_off(
            "always within_size advise [never] deny force\n"
        ));
        assert!(shmem_huge_pages_off(
            "always within_size advise never [deny] force"
        ));
        assert!(!shmem_huge_pages_off(
            "always within_size [advise] never deny force"
        ));
        assert!(!shmem_huge_pages_off(
            "[always] within_size advise never deny force"
        ));
    }

    #[test]
    fn guest_memory_asks_for_transparent_huge_pages() {
        let m = GuestMemoryFile::create(64 << 20, &MemoryBacking::Memfd).unwrap();
        let mem = m.map().unwrap();
        let start = mem.iter().next().unwrap().as_ptr() as usize;
        // The mapping's entry in smaps: its VmFlags carry `hg` (MADV_HUGEPAGE).
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let entry = smaps
            .split_inclusive('\n')
            .skip_while(|l| !l.starts_with(&format!("{start:x}-")))
            .take_while(|l| !l.starts_with("VmFlags") || !l.is_empty())
            .find(|l| l.starts_with("VmFlags"))
            .expect("the guest memory mapping in smaps");
        assert!(entry.split_whitespace().any(|f| f == "hg"), "{entry}");
    }

    #[test]
    fn memfd_is_sealed_and_shared() {
        let m = GuestMemoryFile::create(64 << 20, &MemoryBacking::Memfd).unwrap();
        assert!(m.file().set_len(128 << 20).is_err(), "size must be sealed");
        let mem = m.map().unwrap();
        mem.write_obj(0xdead_beefu32, GuestAddress(0x1000)).unwrap();
        // A second mapping of the same file sees the write (MAP_SHARED).
        let again = m.map().unwrap();
        assert_eq!(
            again.read_obj::<u32>(GuestAddress(0x1000)).unwrap(),
            0xdead_beef
        );
    }

    #[test]
    fn clear_zeroes_every_page_and_keeps_the_size() {
        let m = GuestMemoryFile::create(64 << 20, &MemoryBacking::Memfd).unwrap();
        let mem = m.map().unwrap();
        for gpa in [0, 0x1000, (64 << 20) - 8] {
            mem.write_obj(0x5a5a_5a5a_5a5a_5a5au64, GuestAddress(gpa))
                .unwrap();
        }
        m.clear().unwrap();
        assert_eq!(m.file().metadata().unwrap().len(), 64 << 20);
        // The mapping that wrote (and a new one) read zeroes.
        for map in [&mem, &m.map().unwrap()] {
            for gpa in [0, 0x1000, (64 << 20) - 8] {
                assert_eq!(map.read_obj::<u64>(GuestAddress(gpa)).unwrap(), 0);
            }
        }
    }

    #[test]
    fn large_memory_maps_around_gap_without_touching() {
        let m = GuestMemoryFile::create(8 << 30, &MemoryBacking::Memfd).unwrap();
        let mem = m.map().unwrap();
        assert_eq!(mem.num_regions(), 2);
        assert!(mem.address_in_range(GuestAddress((4 << 30) + (5 << 30) - 1)));
        assert!(!mem.address_in_range(GuestAddress(layout::MMIO_GAP_START)));
    }

    #[test]
    fn vmm_writes_are_harvested_as_pfns() {
        let m = GuestMemoryFile::create(4 << 30, &MemoryBacking::Memfd).unwrap();
        let mem = m.map().unwrap();
        set_vmm_dirty_tracking(&mem, true);
        mem.write_obj(1u64, GuestAddress(0x5000)).unwrap();
        mem.write_obj(1u64, GuestAddress(layout::MMIO_GAP_END + 0x2000))
            .unwrap();
        let mut pfns = harvest_vmm_dirty(&mem);
        pfns.sort_unstable();
        assert_eq!(pfns, vec![5, (layout::MMIO_GAP_END >> 12) + 2]);
    }

    #[test]
    fn named_file_is_reused_with_contents() {
        let dir = std::env::temp_dir().join(format!("kemari-mem-{}", std::process::id()));
        let backing = MemoryBacking::File { path: dir.clone() };
        {
            let m = GuestMemoryFile::create(32 << 20, &backing).unwrap();
            m.map().unwrap().write_obj(7u8, GuestAddress(100)).unwrap();
        }
        let m = GuestMemoryFile::create(32 << 20, &backing).unwrap();
        assert_eq!(
            m.map().unwrap().read_obj::<u8>(GuestAddress(100)).unwrap(),
            7
        );
        // Created by kemari: only its owner may read the guest's memory.
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(matches!(
            GuestMemoryFile::create(64 << 20, &backing),
            Err(MemoryError::FileSize { .. })
        ));
        std::fs::remove_file(dir).unwrap();
    }
}
