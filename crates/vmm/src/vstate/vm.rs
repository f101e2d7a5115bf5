//! The KVM VM: creation, in-kernel irqchip and PIT, memory slots, irqfds and
//! ioeventfds.

use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Cap, IoEventAddress, Kvm, VmFd};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::memory::GuestMemoryMmap;

/// Where KVM puts the TSS it needs on Intel (three pages below the MMIO gap's top
/// would collide with nothing we map).
const KVM_TSS_ADDRESS: usize = 0xfffb_d000;
const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;

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
    slots: std::sync::atomic::AtomicU32,
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
        Ok(Vm {
            kvm,
            fd,
            slots: std::sync::atomic::AtomicU32::new(0),
        })
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
        }
        Ok(())
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
}
