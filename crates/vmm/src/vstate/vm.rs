//! The KVM VM: creation, in-kernel irqchip and PIT, memory slots, irqfds and
//! ioeventfds.

use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, RawFd};
use std::sync::{Arc, Mutex};

use kvm_bindings::{
    kvm_clear_dirty_log, kvm_clear_dirty_log__bindgen_ty_1, kvm_dirty_log,
    kvm_dirty_log__bindgen_ty_1, kvm_enable_cap, kvm_pit_config, kvm_userspace_memory_region,
    KVM_CAP_DIRTY_LOG_RING, KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, IoEventAddress, Kvm, VmFd};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::ioctl::{ioctl, ioctl_with_ref};
use vmm_sys_util::{ioctl_io_nr, ioctl_iow_nr, ioctl_iowr_nr};

use crate::memory::GuestMemoryMmap;
use crate::sys;

/// Where KVM puts the TSS it needs on Intel (three pages below the MMIO gap's top
/// would collide with nothing we map).
const KVM_TSS_ADDRESS: usize = 0xfffb_d000;
const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;

const KVMIO: u32 = 0xAE;
// Not wrapped by kvm-ioctls 0.25.
ioctl_io_nr!(KVM_RESET_DIRTY_RINGS, KVMIO, 0xc7);
ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);
// kvm-ioctls has it, but allocates the bitmap on every call.
ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);

/// Which flavour of the KVM dirty ring a VM has enabled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirtyRingCap {
    /// KVM_CAP_DIRTY_LOG_RING_ACQ_REL: the kernel publishes entries with
    /// release and reads our RESET marks with acquire (any architecture).
    AcqRel,
    /// KVM_CAP_DIRTY_LOG_RING: the original x86 (TSO) flavour.
    Tso,
}

impl DirtyRingCap {
    fn number(self) -> u32 {
        match self {
            DirtyRingCap::AcqRel => KVM_CAP_DIRTY_LOG_RING_ACQ_REL,
            DirtyRingCap::Tso => KVM_CAP_DIRTY_LOG_RING,
        }
    }
}

/// Errors while creating or configuring the VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// /dev/kvm could not be opened.
    #[error("cannot open /dev/kvm (is KVM available and are you allowed to use it?)")]
    OpenKvm(#[source] kvm_ioctls::Error),
    /// The KVM API version is not the stable one.
    #[error("unsupported KVM API version {0} (need 12)")]
    ApiVersion(i32),
    /// A capability we need is missing.
    #[error("KVM lacks a capability kemari needs: {0}")]
    MissingCap(&'static str),
    /// A dirty-log call was given arguments that do not fit the slot.
    #[error("dirty log: {0}")]
    DirtyLogArgs(&'static str),
    /// A KVM ioctl failed.
    #[error("KVM {what} failed")]
    Kvm {
        /// The operation.
        what: &'static str,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::Kvm { what, source }
}

/// A KVM virtual machine with its memory registered.
pub struct Vm {
    kvm: Kvm,
    fd: VmFd,
    /// Which VM of this process it is ([`id`](Self::id)); shared with clones.
    id: u64,
    slots: Arc<std::sync::atomic::AtomicU32>,
    /// The slots as registered (flags aside), for dirty logging to re-register
    /// them; shared with clones.
    regions: Arc<Mutex<Vec<kvm_userspace_memory_region>>>,
}

impl Vm {
    /// Opens /dev/kvm and creates a VM with the in-kernel irqchip and PIT.
    pub fn new() -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let version = kvm.get_api_version();
        if version != 12 {
            return Err(VmError::ApiVersion(version));
        }
        for (cap, name) in [
            (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
            (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
            (Cap::Ioeventfd, "KVM_CAP_IOEVENTFD"),
            (Cap::Irqfd, "KVM_CAP_IRQFD"),
            (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
        ] {
            if !kvm.check_extension(cap) {
                return Err(VmError::MissingCap(name));
            }
        }
        let fd = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
        // Both are only needed by VT-x and may be refused elsewhere (PVM): best effort.
        let _ = fd.set_tss_address(KVM_TSS_ADDRESS);
        let _ = fd.set_identity_map_address(KVM_IDENTITY_MAP_ADDRESS);
        fd.create_irq_chip()
            .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        fd.create_pit2(pit).map_err(kvm_err("KVM_CREATE_PIT2"))?;
        static CREATED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Ok(Vm {
            kvm,
            fd,
            id: CREATED.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1,
            slots: Arc::new(std::sync::atomic::AtomicU32::new(0)),
            regions: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// Which KVM VM of this process this is (1 for the first made; the
    /// same for its clones): an in-place reboot keeps it, a restore does not.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The /dev/kvm handle.
    pub fn kvm(&self) -> &Kvm {
        &self.kvm
    }

    /// The VM file descriptor.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// Registers every region of `mem` as a KVM memory slot. KVM's cost here
    /// grows with memory size (per-page metadata), so callers may run it in a
    /// thread of its own while they set up the rest; it must finish before any
    /// vCPU runs.
    pub fn register_memory(&self, mem: &GuestMemoryMmap) -> Result<(), VmError> {
        for region in mem.iter() {
            let host = region
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .map_err(|_| VmError::MissingCap("host address of guest memory"))?;
            let index = self.slots.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let slot = kvm_userspace_memory_region {
                slot: index,
                flags: 0,
                guest_phys_addr: region.start_addr().raw_value(),
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: the region stays mapped for the VM's lifetime: the machine keeps
            // `mem` (and so the mapping) alive at least as long as the VM fd.
            unsafe { self.fd.set_user_memory_region(slot) }
                .map_err(kvm_err("KVM_SET_USER_MEMORY_REGION"))?;
            self.regions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(slot);
        }
        Ok(())
    }

    /// Maps `len` bytes at host address `host` into the guest at `guest`, as a
    /// memory slot that dirty logging leaves alone (device memory such as a
    /// virtio-pmem window, which lives in its own file, not in guest RAM).
    /// Returns the slot, for [`unmap_device_memory`](Self::unmap_device_memory).
    ///
    /// # Safety
    ///
    /// `host..host + len` must stay mapped until the slot is unmapped or the
    /// VM closed (the guest reads and writes it through KVM).
    pub unsafe fn map_device_memory(
        &self,
        guest: u64,
        len: u64,
        host: u64,
    ) -> Result<u32, VmError> {
        let slot = kvm_userspace_memory_region {
            slot: self.slots.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
            flags: 0,
            guest_phys_addr: guest,
            memory_size: len,
            userspace_addr: host,
        };
        // SAFETY: the caller keeps the range mapped for the slot's lifetime.
        unsafe { self.fd.set_user_memory_region(slot) }
            .map_err(kvm_err("KVM_SET_USER_MEMORY_REGION (device memory)"))?;
        Ok(slot.slot)
    }

    /// Removes a slot made by [`map_device_memory`](Self::map_device_memory).
    pub fn unmap_device_memory(&self, slot: u32, guest: u64) -> Result<(), VmError> {
        let region = kvm_userspace_memory_region {
            slot,
            flags: 0,
            guest_phys_addr: guest,
            memory_size: 0,
            userspace_addr: 0,
        };
        // SAFETY: a zero-sized region deletes the slot; KVM keeps no mapping.
        unsafe { self.fd.set_user_memory_region(region) }
            .map_err(kvm_err("KVM_SET_USER_MEMORY_REGION (delete)"))
    }

    /// Number of memory slots registered.
    pub fn memory_slots(&self) -> u32 {
        self.slots.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Routes writes of `evt` to interrupt line `gsi`.
    pub fn register_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<(), VmError> {
        self.fd
            .register_irqfd(evt, gsi)
            .map_err(kvm_err("KVM_IRQFD"))
    }

    /// Makes 4-byte guest writes of `datamatch` at MMIO `addr` signal `evt`
    /// without an exit to userspace.
    pub fn register_mmio_ioevent(
        &self,
        evt: &EventFd,
        addr: u64,
        datamatch: u32,
    ) -> Result<(), VmError> {
        self.fd
            .register_ioevent(evt, &IoEventAddress::Mmio(addr), datamatch)
            .map_err(kvm_err("KVM_IOEVENTFD"))
    }

    /// Undoes [`register_irqfd`](Self::register_irqfd).
    pub fn unregister_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<(), VmError> {
        self.fd
            .unregister_irqfd(evt, gsi)
            .map_err(kvm_err("KVM_IRQFD (deassign)"))
    }

    /// Undoes [`register_mmio_ioevent`](Self::register_mmio_ioevent).
    pub fn unregister_mmio_ioevent(
        &self,
        evt: &EventFd,
        addr: u64,
        datamatch: u32,
    ) -> Result<(), VmError> {
        self.fd
            .unregister_ioevent(evt, &IoEventAddress::Mmio(addr), datamatch)
            .map_err(kvm_err("KVM_IOEVENTFD (deassign)"))
    }

    /// A second handle on the same KVM VM (duplicated file descriptors), for
    /// components that outlive borrows of the machine (the dirty tracker).
    pub fn try_clone(&self) -> Result<Vm, VmError> {
        let dup = |fd: RawFd, what: &'static str| {
            sys::dup(fd)
                .map(IntoRawFd::into_raw_fd)
                .map_err(|e| VmError::Kvm {
                    what,
                    source: kvm_ioctls::Error::new(e.raw_os_error().unwrap_or(libc::EIO)),
                })
        };
        let kvm_fd = dup(self.kvm.as_raw_fd(), "dup of /dev/kvm")?;
        // SAFETY: `kvm_fd` is a fresh duplicate of an open /dev/kvm descriptor,
        // owned by nothing else.
        let kvm = unsafe { Kvm::from_raw_fd(kvm_fd) };
        let vm_fd = dup(self.fd.as_raw_fd(), "dup of the VM fd")?;
        // SAFETY: `vm_fd` is a fresh duplicate of this VM's descriptor, owned by
        // nothing else.
        let fd = unsafe { kvm.create_vmfd_from_rawfd(vm_fd) }.map_err(kvm_err("VM fd clone"))?;
        Ok(Vm {
            kvm,
            fd,
            id: self.id,
            slots: self.slots.clone(),
            regions: self.regions.clone(),
        })
    }

    /// The memory slots registered so far, with the flags they were given.
    pub fn memory_slot_regions(&self) -> Vec<kvm_userspace_memory_region> {
        self.regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The dirty ring flavour KVM offers and its largest ring in bytes, if any.
    pub fn dirty_ring_support(&self) -> Option<(DirtyRingCap, usize)> {
        [DirtyRingCap::AcqRel, DirtyRingCap::Tso]
            .into_iter()
            .find_map(|cap| {
                let max = self.fd.check_extension_raw(u64::from(cap.number()));
                (max > 0).then_some((cap, max as usize))
            })
    }

    /// Enables the per-vCPU dirty ring with `entries` entries (a power of two,
    /// at least 256). Must run before the first vCPU is created.
    pub fn enable_dirty_ring(&self, cap: DirtyRingCap, entries: u32) -> Result<(), VmError> {
        let bytes = u64::from(entries) * std::mem::size_of::<kvm_bindings::kvm_dirty_gfn>() as u64;
        let mut enable = kvm_enable_cap {
            cap: cap.number(),
            ..Default::default()
        };
        enable.args[0] = bytes;
        self.fd
            .enable_cap(&enable)
            .map_err(kvm_err("KVM_ENABLE_CAP(DIRTY_LOG_RING)"))
    }

    /// Turns on KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 if KVM has it: then
    /// KVM_GET_DIRTY_LOG only reads and KVM_CLEAR_DIRTY_LOG re-protects.
    /// Returns whether it is on.
    pub fn enable_manual_dirty_protect(&self) -> Result<bool, VmError> {
        let supported = self
            .fd
            .check_extension_raw(u64::from(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2));
        if supported <= 0 || supported as u32 & KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE == 0 {
            return Ok(false);
        }
        let mut enable = kvm_enable_cap {
            cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
            ..Default::default()
        };
        enable.args[0] = u64::from(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE);
        self.fd
            .enable_cap(&enable)
            .map_err(kvm_err("KVM_ENABLE_CAP(MANUAL_DIRTY_LOG_PROTECT2)"))?;
        Ok(true)
    }

    /// Sets or clears KVM_MEM_LOG_DIRTY_PAGES on every registered slot (the
    /// dirty ring and the dirty bitmap both log only such slots). Turning it
    /// on write-protects the slot's pages, O(memory), once.
    pub fn set_dirty_logging(&self, enabled: bool) -> Result<(), VmError> {
        let mut regions = self.regions.lock().unwrap_or_else(|p| p.into_inner());
        for region in regions.iter_mut() {
            if enabled {
                region.flags |= KVM_MEM_LOG_DIRTY_PAGES;
            } else {
                region.flags &= !KVM_MEM_LOG_DIRTY_PAGES;
            }
            // SAFETY: same slot, same host mapping as registered by
            // `register_memory` (still alive, see there); only the flags change.
            unsafe { self.fd.set_user_memory_region(*region) }
                .map_err(kvm_err("KVM_SET_USER_MEMORY_REGION(LOG_DIRTY_PAGES)"))?;
        }
        Ok(())
    }

    /// KVM_RESET_DIRTY_RINGS: re-protects the pages of every ring entry marked
    /// RESET and frees those entries. Returns the number of entries reset.
    ///
    /// Signals are blocked for the call. The kernel (6.16 on) stops a reset
    /// with EINTR when a signal is pending, and on this host an interrupted
    /// reset left pages writable that it had already taken off the ring: the
    /// guest's next writes to them were never logged. This showed as a
    /// page written but not harvested in 6–8 of 60 stress runs whenever
    /// vCPU threads — which reset their own ring after
    /// KVM_EXIT_DIRTY_RING_FULL and receive kick signals — did it; with
    /// signals blocked, none in 120 (docs/dirty-tracking.md).
    pub fn reset_dirty_rings(&self) -> Result<u32, VmError> {
        let _blocked = sys::SignalsBlocked::new();
        loop {
            // SAFETY: the ioctl takes no argument and only touches the VM's rings.
            let ret = unsafe { ioctl(&self.fd, KVM_RESET_DIRTY_RINGS()) };
            if ret >= 0 {
                return Ok(ret as u32);
            }
            let err = kvm_ioctls::Error::last();
            // Not expected with signals blocked; the remaining entries are
            // still marked RESET, so going on resets them.
            if err.errno() != libc::EINTR {
                return Err(VmError::Kvm {
                    what: "KVM_RESET_DIRTY_RINGS",
                    source: err,
                });
            }
        }
    }

    /// KVM_GET_DIRTY_LOG of `slot` into `bitmap` (one bit per page; at least
    /// pages/64 words, rounded up).
    pub fn get_dirty_log_into(&self, slot: u32, bitmap: &mut [u64]) -> Result<(), VmError> {
        let pages = self
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|r| r.slot == slot)
            .map(|r| r.memory_size / 4096)
            .ok_or(VmError::DirtyLogArgs(
                "KVM_GET_DIRTY_LOG of an unknown slot",
            ))?;
        if (pages as usize).div_ceil(64) > bitmap.len() {
            return Err(VmError::DirtyLogArgs("KVM_GET_DIRTY_LOG bitmap too short"));
        }
        let log = kvm_dirty_log {
            slot,
            padding1: 0,
            __bindgen_anon_1: kvm_dirty_log__bindgen_ty_1 {
                dirty_bitmap: bitmap.as_mut_ptr().cast(),
            },
        };
        // SAFETY: KVM writes the slot's pages/64 words (rounded up) into
        // `bitmap`, which is that long (checked above) and outlives the call.
        let ret = unsafe { ioctl_with_ref(&self.fd, KVM_GET_DIRTY_LOG(), &log) };
        if ret < 0 {
            return Err(VmError::Kvm {
                what: "KVM_GET_DIRTY_LOG",
                source: kvm_ioctls::Error::last(),
            });
        }
        Ok(())
    }

    /// KVM_CLEAR_DIRTY_LOG: re-protects the pages of `slot` whose bits are set
    /// in `bitmap`, bit 0 being page `first_page` (a multiple of 64);
    /// `num_pages` is a multiple of 64 or reaches the end of the slot.
    pub fn clear_dirty_log(
        &self,
        slot: u32,
        first_page: u64,
        num_pages: u32,
        bitmap: &[u64],
    ) -> Result<(), VmError> {
        if (num_pages as usize).div_ceil(64) > bitmap.len() {
            return Err(VmError::DirtyLogArgs(
                "KVM_CLEAR_DIRTY_LOG bitmap too short",
            ));
        }
        let clear = kvm_clear_dirty_log {
            slot,
            num_pages,
            first_page,
            __bindgen_anon_1: kvm_clear_dirty_log__bindgen_ty_1 {
                dirty_bitmap: bitmap.as_ptr() as *mut libc::c_void,
            },
        };
        // SAFETY: KVM reads num_pages bits from `bitmap`, which is long enough
        // (checked above) and outlives the call.
        let ret = unsafe { ioctl_with_ref(&self.fd, KVM_CLEAR_DIRTY_LOG(), &clear) };
        if ret < 0 {
            return Err(VmError::Kvm {
                what: "KVM_CLEAR_DIRTY_LOG",
                source: kvm_ioctls::Error::last(),
            });
        }
        Ok(())
    }
}
