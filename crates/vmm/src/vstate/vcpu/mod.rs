//! vCPUs: one thread each, running KVM_RUN and dispatching exits to the port and
//! MMIO buses. Other threads control a vCPU through [`VcpuHandle`]: pause,
//! resume, run a closure on the vCPU's fd (to save or restore its state), exit.
//!
//! A request is queued on the vCPU's channel and the thread is kicked out of
//! KVM_RUN with a signal, whose handler makes a KVM_RUN about to start
//! return at once; the waiter kicks again every millisecond all the same.
//!
//! - this file: the [`Vcpu`] before its thread starts, errors, exit counters;
//! - `regs.rs`: boot registers, CPUID/LAPIC/MSR set-up of a booting vCPU;
//! - `runner.rs`: the vCPU thread: the KVM_RUN loop and its exits;
//! - `control.rs`: [`VcpuHandle`] and [`VcpuSet`]: requests, pause/resume, jobs;
//! - `ahead.rs`: [`VcpuThreadAhead`], a thread made before its vCPU is restored;
//! - `kick.rs`: the kick signal and the `immediate_exit` it sets;
//! - `flight.rs`: the last exits of a vCPU, for a crash report.

mod ahead;
mod control;
mod flight;
mod kick;
mod regs;
mod runner;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvm_bindings::{kvm_cpuid_entry2, kvm_debugregs, kvm_mp_state, kvm_xcrs, CpuId};
use kvm_ioctls::{SyncReg, VcpuFd};

pub use ahead::VcpuThreadAhead;
pub use control::{VcpuHandle, VcpuSet};
pub use regs::{BootEntry, BOOT_MSRS};
pub use runner::synced_registers;

use crate::devices::bus::Bus;
use crate::vstate::VmEventSink;
use control::VcpuControl;
use kick::install_kick_handler;
use runner::SYNC_REGS_WANTED;

/// Errors of vCPU set-up and control.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// A KVM vCPU ioctl failed.
    #[error("vCPU {index}: KVM {what} failed")]
    Kvm {
        /// vCPU index.
        index: u8,
        /// The operation.
        what: &'static str,
        /// The cause.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The vCPU thread could not be started.
    #[error("cannot start vCPU thread {index}")]
    Spawn {
        /// vCPU index.
        index: u8,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The kick signal handler could not be installed.
    #[error("cannot install the vCPU kick signal handler")]
    Signal(#[source] vmm_sys_util::errno::Error),
    /// The vCPU thread is gone.
    #[error("vCPU {0} thread is not running")]
    Gone(u8),
    /// A vCPU was handed to a thread made for another one.
    #[error("vCPU {vcpu} given to the thread made for vCPU {thread}")]
    WrongThread {
        /// The vCPU's index.
        vcpu: u8,
        /// The index the thread was made for.
        thread: u8,
    },
}

/// Exit counters of one vCPU (metrics).
#[derive(Debug, Default)]
pub struct VcpuExitCounters {
    /// Port reads.
    pub io_in: AtomicU64,
    /// Port writes.
    pub io_out: AtomicU64,
    /// MMIO reads.
    pub mmio_read: AtomicU64,
    /// MMIO writes.
    pub mmio_write: AtomicU64,
    /// KVM_RUN interrupted by a signal (kicks).
    pub interrupted: AtomicU64,
    /// KVM_EXIT_DIRTY_RING_FULL: the vCPU's dirty ring needed harvesting.
    pub dirty_ring_full: AtomicU64,
    /// Every other exit.
    pub other: AtomicU64,
}

impl VcpuExitCounters {
    /// A snapshot of the counters as (reason, count) pairs.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("io_in", self.io_in.load(Ordering::Relaxed)),
            ("io_out", self.io_out.load(Ordering::Relaxed)),
            ("mmio_read", self.mmio_read.load(Ordering::Relaxed)),
            ("mmio_write", self.mmio_write.load(Ordering::Relaxed)),
            ("interrupted", self.interrupted.load(Ordering::Relaxed)),
            (
                "dirty_ring_full",
                self.dirty_ring_full.load(Ordering::Relaxed),
            ),
            ("other", self.other.load(Ordering::Relaxed)),
        ]
    }
}

/// How soon a pause is expected to end, which decides how a paused vCPU
/// thread waits for its resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseLength {
    /// A fault-tolerance sync's pause (~100 µs): the thread polls for the
    /// resume for up to [`SPIN_WAIT`] before it sleeps, since a futex
    /// wake-up costs ~25 µs on this kind of host.
    Brief,
    /// A migration's, a warm restart's, a snapshot's or the API's pause:
    /// the thread sleeps at once, leaving the CPU to the threads that end
    /// the pause (on two cores a polling vCPU took one from a migration's
    /// final round and the destination's restore).
    Long,
}

/// Called on the vCPU thread (with the vCPU index) when KVM_RUN exits with
/// KVM_EXIT_DIRTY_RING_FULL. It must harvest the vCPU's ring and issue
/// KVM_RESET_DIRTY_RINGS before returning (or block until someone has): the
/// vCPU re-enters KVM_RUN right after, and a ring still full exits again.
pub type DirtyRingFullHandler = Arc<dyn Fn(u8) + Send + Sync>;

/// A vCPU before its thread starts.
pub struct Vcpu {
    index: u8,
    fd: VcpuFd,
    dirty_ring_full: Option<DirtyRingFullHandler>,
    /// What a vCPU made ahead of a restore holds: its CPUID from
    /// [`preset_cpuid`](Self::preset_cpuid), the rest from
    /// [`read_in_place`](Self::read_in_place).
    in_place: Option<InPlace>,
    /// KVM stores registers in `kvm_run` at every exit (KVM_CAP_SYNC_REGS).
    sync_regs: bool,
}

impl Vcpu {
    /// Creates vCPU `index`.
    pub fn new(vm: &kvm_ioctls::VmFd, index: u8) -> Result<Self, VcpuError> {
        let sync_regs = u64::try_from(vm.check_extension_int(kvm_ioctls::Cap::SyncRegs))
            .is_ok_and(|mask| mask & SYNC_REGS_WANTED == SYNC_REGS_WANTED);
        let mut fd = vm
            .create_vcpu(u64::from(index))
            .map_err(|source| VcpuError::Kvm {
                index,
                what: "KVM_CREATE_VCPU",
                source,
            })?;
        if sync_regs {
            for reg in [SyncReg::Register, SyncReg::SystemRegister] {
                fd.set_sync_valid_reg(reg);
            }
        }
        Ok(Vcpu {
            index,
            fd,
            dirty_ring_full: None,
            in_place: None,
            sync_regs,
        })
    }

    /// Gives a vCPU made ahead of a restore the CPUID kemari would boot it
    /// with (`base`, adjusted for this vCPU of `vcpus`), so that a restore of
    /// a state holding the same CPUID (a VM kemari booted on this kind of
    /// host) can skip KVM_SET_CPUID2 inside the guest's pause (see
    /// [`take_in_place`](Self::take_in_place)).
    pub fn preset_cpuid(&mut self, base: &CpuId, vcpus: u8) -> Result<(), VcpuError> {
        let mut cpuid = base.clone();
        super::cpuid::patch_for_vcpu(&mut cpuid, self.index, vcpus);
        self.fd
            .set_cpuid2(&cpuid)
            .map_err(|source| VcpuError::Kvm {
                index: self.index,
                what: "KVM_SET_CPUID2",
                source,
            })?;
        // What KVM holds, which is not always what was set: a PVM host, whose
        // guests run CPUID natively, reports the CPU's own leaf 1.
        let held = self
            .fd
            .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
            .map_err(|source| VcpuError::Kvm {
                index: self.index,
                what: "KVM_GET_CPUID2",
                source,
            })?;
        self.in_place.get_or_insert_with(InPlace::default).cpuid = Some(held.as_slice().to_vec());
        Ok(())
    }

    /// Reads back what the vCPU holds besides its CPUID (TSC rate, run
    /// state, XCRs, debug registers), for a restore into it to skip what
    /// the saved state has the same: call it once the vCPU is set up ahead.
    pub fn read_in_place(&mut self) {
        let cpuid = self.in_place.take().and_then(|p| p.cpuid);
        self.in_place = Some(InPlace::read(&self.fd, cpuid));
    }

    /// What the vCPU held when made ahead (see
    /// [`preset_cpuid`](Self::preset_cpuid) and
    /// [`read_in_place`](Self::read_in_place)); a restore compares it with
    /// the saved state.
    pub fn take_in_place(&mut self) -> Option<InPlace> {
        self.in_place.take()
    }

    /// The TSC frequency KVM gives this vCPU, if it knows it.
    pub fn tsc_khz(&self) -> Option<u32> {
        self.fd.get_tsc_khz().ok().filter(|&k| k > 0)
    }

    /// vCPU index (= APIC ID).
    pub fn index(&self) -> u8 {
        self.index
    }

    /// The KVM vCPU fd (for state save/restore before the thread starts).
    pub fn fd(&mut self) -> &mut VcpuFd {
        &mut self.fd
    }

    /// Installs what the vCPU thread calls on KVM_EXIT_DIRTY_RING_FULL (see
    /// [`DirtyRingFullHandler`]). Without one, a full ring stops the vCPU with
    /// an error rather than spinning.
    pub fn set_dirty_ring_full_handler(&mut self, handler: DirtyRingFullHandler) {
        self.dirty_ring_full = Some(handler);
    }

    /// Whether a dirty-ring tracker has attached this vCPU's ring (see
    /// [`set_dirty_ring_full_handler`](Self::set_dirty_ring_full_handler)).
    pub fn dirty_ring_attached(&self) -> bool {
        self.dirty_ring_full.is_some()
    }
    /// Starts the vCPU thread. It begins paused if `start_paused`.
    pub fn start(
        self,
        io_bus: Arc<Bus>,
        mmio_bus: Arc<Bus>,
        events: VmEventSink,
        start_paused: bool,
    ) -> Result<VcpuHandle, VcpuError> {
        install_kick_handler()?;
        let index = self.index;
        let (control, wiring) = VcpuControl::new(index);
        let mut runner = self.runner(wiring, io_bus, mmio_bus, events);
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || {
                runner.run(start_paused);
                Some(runner.into_vcpu())
            })
            .map_err(|source| VcpuError::Spawn { index, source })?;
        Ok(control.handle(thread))
    }
}

/// What a vCPU made ahead of a restore already holds, read back from KVM
/// then, so that the restore writes only what differs: each ioctl costs
/// ~6 µs on the PVM host, inside the guest's pause.
#[derive(Debug, Clone, Default)]
pub struct InPlace {
    /// The CPUID it was given ([`Vcpu::preset_cpuid`]):
    /// KVM_SET_CPUID2 is skipped when the saved one is equivalent.
    pub cpuid: Option<Vec<kvm_cpuid_entry2>>,
    /// Its TSC frequency (spares the KVM_GET_TSC_KHZ that decides whether
    /// to set the saved one).
    pub tsc_khz: Option<u32>,
    /// Its run state.
    pub mp_state: Option<kvm_mp_state>,
    /// Its extended control registers.
    pub xcrs: Option<kvm_xcrs>,
    /// Its debug registers.
    pub debugregs: Option<kvm_debugregs>,
}

impl InPlace {
    /// Reads what `fd` holds besides its CPUID.
    pub fn read(fd: &VcpuFd, cpuid: Option<Vec<kvm_cpuid_entry2>>) -> Self {
        InPlace {
            cpuid,
            tsc_khz: fd.get_tsc_khz().ok().filter(|&k| k > 0),
            mp_state: fd.get_mp_state().ok(),
            xcrs: fd.get_xcrs().ok(),
            debugregs: fd.get_debug_regs().ok(),
        }
    }
}
