//! vCPUs: one thread each, running KVM_RUN and dispatching exits to the port and
//! MMIO buses. Other threads control a vCPU through [`VcpuHandle`]: pause,
//! resume, run a closure on the vCPU's fd (to save or restore its state), exit.
//!
//! A request is queued on the vCPU's channel and the thread is kicked out of
//! KVM_RUN with a signal; since a signal that lands just before KVM_RUN is missed,
//! the kick repeats until the vCPU answers.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, Once};
use std::thread::JoinHandle;
use std::time::Duration;

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, CpuId, Msrs};
use kvm_ioctls::{SyncReg, VcpuExit, VcpuFd};
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::devices::bus::Bus;
use crate::persist::vcpu::InPlace;
use crate::vstate::{VmEvent, VmEventSink};

/// Signal used to kick vCPUs out of KVM_RUN.
fn kick_signal() -> i32 {
    SIGRTMIN()
}

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

type VcpuJob = Box<dyn FnOnce(&mut VcpuFd) + Send>;

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

enum VcpuRequest {
    Pause(Sender<()>, PauseLength),
    Resume,
    Run(VcpuJob),
    Exit,
}

/// Initial register state of the boot vCPU.
#[derive(Debug, Clone, Copy)]
pub enum BootEntry {
    /// PVH: 32-bit protected mode, paging off, `ebx` = start info.
    Pvh {
        /// Entry point.
        entry: u64,
        /// Guest-physical address of `hvm_start_info`.
        start_info: u64,
    },
    /// Linux 64-bit boot protocol: long mode with identity page tables already
    /// written by the loader, `rsi` = zero page.
    Linux64 {
        /// Entry point.
        entry: u64,
        /// Guest-physical address of boot_params.
        boot_params: u64,
        /// PML4 address.
        page_tables: u64,
        /// GDT address (flat 64-bit code/data descriptors at 0x08/0x10).
        gdt: u64,
    },
}

/// KVM_EXIT_DIRTY_RING_FULL (not decoded by kvm-ioctls 0.25).
const KVM_EXIT_DIRTY_RING_FULL: u32 = kvm_bindings::KVM_EXIT_DIRTY_RING_FULL;

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

    /// Sets CPUID (adjusted for this vCPU's APIC ID), the LAPIC's LINT pins and
    /// the MSRs firmware would set, for a machine of `vcpus` vCPUs.
    pub fn configure(&self, cpuid: &CpuId, vcpus: u8) -> Result<(), VcpuError> {
        let index = self.index;
        let err = |what| {
            move |source| VcpuError::Kvm {
                index,
                what,
                source,
            }
        };
        let mut cpuid = cpuid.clone();
        super::cpuid::patch_for_vcpu(&mut cpuid, index, vcpus);
        self.fd.set_cpuid2(&cpuid).map_err(err("KVM_SET_CPUID2"))?;
        // LINT0 = ExtINT (the PIC), LINT1 = NMI, as firmware would set them.
        let mut lapic = self.fd.get_lapic().map_err(err("KVM_GET_LAPIC"))?;
        let lint0 = get_lapic_reg(&lapic.regs, 0x350);
        set_lapic_reg(&mut lapic.regs, 0x350, (lint0 & !0x700) | 0x700);
        let lint1 = get_lapic_reg(&lapic.regs, 0x360);
        set_lapic_reg(&mut lapic.regs, 0x360, (lint1 & !0x700) | 0x400);
        self.fd.set_lapic(&lapic).map_err(err("KVM_SET_LAPIC"))?;
        let msrs = Msrs::from_entries(&[kvm_msr_entry {
            index: 0x1a0, // IA32_MISC_ENABLE: fast strings
            data: 1,
            ..Default::default()
        }])
        .map_err(|_| VcpuError::Gone(index))?;
        // Best effort: not every KVM lets userspace set it.
        let _ = self.fd.set_msrs(&msrs);
        Ok(())
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

    /// Sets the boot vCPU's registers for `entry`.
    pub fn set_boot_state(&self, entry: BootEntry) -> Result<(), VcpuError> {
        let index = self.index;
        let err = |what| {
            move |source| VcpuError::Kvm {
                index,
                what,
                source,
            }
        };
        let mut sregs = self.fd.get_sregs().map_err(err("KVM_GET_SREGS"))?;
        let mut regs = kvm_regs {
            rflags: 0x2,
            ..Default::default()
        };
        match entry {
            BootEntry::Pvh { entry, start_info } => {
                set_flat_segments(&mut sregs, 0x10, 0x18, 0x20, false);
                sregs.cr0 = 0x11; // PE | ET
                sregs.cr4 = 0;
                sregs.efer = 0;
                regs.rip = entry;
                regs.rbx = start_info;
            }
            BootEntry::Linux64 {
                entry,
                boot_params,
                page_tables,
                gdt,
            } => {
                sregs.gdt.base = gdt;
                sregs.gdt.limit = 0x1f;
                set_flat_segments(&mut sregs, 0x08, 0x10, 0x18, true);
                sregs.cr3 = page_tables;
                sregs.cr4 = 0x20; // PAE
                sregs.cr0 = 0x8000_0011; // PG | ET | PE
                sregs.efer = 0x500; // LME | LMA
                regs.rip = entry;
                regs.rsi = boot_params;
                regs.rsp = 0x8ff0;
                regs.rbp = 0x8ff0;
            }
        }
        self.fd.set_sregs(&sregs).map_err(err("KVM_SET_SREGS"))?;
        self.fd.set_regs(&regs).map_err(err("KVM_SET_REGS"))?;
        let fpu = kvm_fpu {
            fcw: 0x37f,
            mxcsr: 0x1f80,
            ..Default::default()
        };
        self.fd.set_fpu(&fpu).map_err(err("KVM_SET_FPU"))?;
        Ok(())
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
            .spawn(move || runner.run(start_paused))
            .map_err(|source| VcpuError::Spawn { index, source })?;
        Ok(control.handle(thread))
    }

    fn runner(
        self,
        wiring: RunnerWiring,
        io_bus: Arc<Bus>,
        mmio_bus: Arc<Bus>,
        events: VmEventSink,
    ) -> VcpuRunner {
        VcpuRunner {
            index: self.index,
            fd: self.fd,
            requests: wiring.requests,
            pending: wiring.pending,
            io_bus,
            mmio_bus,
            events,
            counters: wiring.counters,
            dirty_ring_full: self.dirty_ring_full,
            io_in_flight: false,
            sync_regs: self.sync_regs,
            resume_poll: SPIN_WAIT,
        }
    }
}

/// The controlling side of a vCPU thread, before the thread runs the vCPU.
struct VcpuControl {
    index: u8,
    requests: Sender<VcpuRequest>,
    pending: Arc<AtomicBool>,
    counters: Arc<VcpuExitCounters>,
}

/// The vCPU thread's side of a [`VcpuControl`].
struct RunnerWiring {
    requests: Receiver<VcpuRequest>,
    pending: Arc<AtomicBool>,
    counters: Arc<VcpuExitCounters>,
}

impl VcpuControl {
    fn new(index: u8) -> (Self, RunnerWiring) {
        let (tx, rx) = channel();
        let pending = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(VcpuExitCounters::default());
        (
            VcpuControl {
                index,
                requests: tx,
                pending: pending.clone(),
                counters: counters.clone(),
            },
            RunnerWiring {
                requests: rx,
                pending,
                counters,
            },
        )
    }

    fn handle(self, thread: JoinHandle<()>) -> VcpuHandle {
        VcpuHandle {
            index: self.index,
            requests: self.requests,
            pending: self.pending,
            thread: Mutex::new(Some(thread)),
            counters: self.counters,
        }
    }
}

/// How long a thread made ahead polls for its vCPU once told to get ready
/// ([`VcpuThreadAhead::get_ready`]) before it sleeps again: longer than a
/// restore (0.2-0.4 ms here).
const READY_SPIN: Duration = Duration::from_millis(2);

enum AheadRequest {
    /// Make the vCPU's first KVM_RUN (see [`VcpuThreadAhead::first_run`]).
    FirstRun(FirstRun),
    /// Poll for the start for up to [`READY_SPIN`], away from the CPU of
    /// the thread that restores.
    GetReady,
    /// Run this vCPU.
    Start(Box<(VcpuRunner, bool)>),
}

/// KVM_RUN's request number: `_IO(KVMIO, 0x80)` (include/uapi/linux/kvm.h).
const KVM_RUN: libc::c_ulong = ((kvm_bindings::KVMIO as libc::c_ulong) << 8) | 0x80;

/// A vCPU's first KVM_RUN, made by its thread ahead of the restore.
struct FirstRun {
    /// The vCPU's fd.
    fd: std::os::fd::RawFd,
    /// `immediate_exit` in the vCPU's `kvm_run`.
    immediate_exit: *mut u8,
    /// Answered once the KVM_RUN has returned: its errno (EINTR expected).
    done: Sender<i32>,
}

// SAFETY: `fd` and `immediate_exit` belong to a vCPU whose owner waits for
// `done` (or for the thread's end) before it can drop or use the vCPU again
// (`VcpuThreadAhead::first_run`), so they are valid while the thread uses
// them.
unsafe impl Send for FirstRun {}

/// A vCPU thread started before the vCPU it will run is restored (a live
/// migration's destination makes it while memory is still being copied).
/// It sleeps until [`get_ready`](Self::get_ready), then polls for its
/// [`start`](Self::start) on a CPU other than the restoring thread's, and
/// runs the restored vCPU as soon as that comes. A restore then neither
/// spawns a thread nor
/// wakes a sleeping one (each 0.05-0.25 ms on this host when the other CPU
/// is idle), and the polling never takes the restoring thread's CPU (on two
/// cores a poller woken there held it for a whole time slice, 1.6 ms, with
/// the other CPU idle). (Writing the registers on this thread, in parallel
/// with the devices' set-up, was measured slower here: both took longer.)
/// Dropped unstarted, the thread ends.
pub struct VcpuThreadAhead {
    index: u8,
    requests: Sender<AheadRequest>,
    /// The thread's kernel id, once it has run (0 before).
    tid: Arc<std::sync::atomic::AtomicI32>,
    thread: JoinHandle<()>,
}

impl VcpuThreadAhead {
    /// Starts the thread for vCPU `index`; it sleeps until told more.
    pub fn spawn(index: u8) -> Result<Self, VcpuError> {
        install_kick_handler()?;
        let (tx, rx) = channel::<AheadRequest>();
        let tid = Arc::new(std::sync::atomic::AtomicI32::new(0));
        let my_tid = tid.clone();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || thread_ahead(&rx, &my_tid))
            .map_err(|source| VcpuError::Spawn { index, source })?;
        Ok(VcpuThreadAhead {
            index,
            requests: tx,
            tid,
            thread,
        })
    }

    /// The vCPU index the thread is for.
    pub fn index(&self) -> u8 {
        self.index
    }

    /// Makes `vcpu`'s first KVM_RUN on this thread, with `immediate_exit`
    /// set so that the guest runs nothing (KVM returns EINTR before any
    /// entry), and returns once it has. KVM does per-thread set-up at a
    /// vCPU's first KVM_RUN from a new thread (the vCPU's pid; for the
    /// VM's first, its NX huge page recovery worker): made here, while
    /// memory is still being copied, it is not in the restored guest's
    /// first entry. KVM answers EINTR; any other answer is an error.
    pub fn first_run(&self, vcpu: &mut Vcpu) -> Result<(), VcpuError> {
        if vcpu.index != self.index {
            return Err(VcpuError::WrongThread {
                vcpu: vcpu.index,
                thread: self.index,
            });
        }
        let (done, ran) = channel();
        let request = FirstRun {
            fd: std::os::fd::AsRawFd::as_raw_fd(&vcpu.fd),
            immediate_exit: &mut vcpu.fd.get_kvm_run().immediate_exit,
            done,
        };
        self.requests
            .send(AheadRequest::FirstRun(request))
            .map_err(|_| VcpuError::Gone(self.index))?;
        // Until it has run, `vcpu` stays borrowed here (see FirstRun). An
        // error means the thread is gone, and with it the request.
        match ran.recv().map_err(|_| VcpuError::Gone(self.index))? {
            libc::EINTR => Ok(()),
            errno => Err(VcpuError::Kvm {
                index: self.index,
                what: "KVM_RUN (first, ahead, with immediate_exit)",
                source: kvm_ioctls::Error::new(errno),
            }),
        }
    }

    /// Its vCPU comes soon: poll rather than sleep, away from the caller's
    /// CPU (if the caller may use another).
    pub fn get_ready(&self) {
        let tid = self.tid.load(Ordering::Acquire);
        if tid != 0 {
            affinity::keep_off_callers_cpu(tid);
        }
        let _ = self.requests.send(AheadRequest::GetReady);
    }

    /// Runs `vcpu` (of this thread's index, restored) on the thread,
    /// paused if `start_paused`, as [`Vcpu::start`] would on a new one.
    pub fn start(
        self,
        vcpu: Vcpu,
        io_bus: Arc<Bus>,
        mmio_bus: Arc<Bus>,
        events: VmEventSink,
        start_paused: bool,
    ) -> Result<VcpuHandle, VcpuError> {
        if vcpu.index != self.index {
            return Err(VcpuError::WrongThread {
                vcpu: vcpu.index,
                thread: self.index,
            });
        }
        let (control, wiring) = VcpuControl::new(self.index);
        let runner = vcpu.runner(wiring, io_bus, mmio_bus, events);
        self.requests
            .send(AheadRequest::Start(Box::new((runner, start_paused))))
            .map_err(|_| VcpuError::Gone(self.index))?;
        Ok(control.handle(self.thread))
    }
}

/// The body of a [`VcpuThreadAhead`].
fn thread_ahead(rx: &Receiver<AheadRequest>, tid: &std::sync::atomic::AtomicI32) {
    // The CPUs it may use, before get_ready narrows them.
    let allowed = affinity::current();
    // SAFETY: gettid has no preconditions.
    tid.store(unsafe { libc::gettid() }, Ordering::Release);
    let mut ready = false;
    loop {
        let next = if ready {
            spin_recv(rx, READY_SPIN).or_else(|| rx.recv().ok())
        } else {
            rx.recv().ok()
        };
        match next {
            None => return,
            Some(AheadRequest::FirstRun(r)) => {
                // SAFETY: see FirstRun: the fd and the kvm_run mapping are
                // the live vCPU's, whose owner waits for `done`. KVM_RUN
                // takes no argument; with immediate_exit set it returns
                // EINTR without entering the guest.
                let errno = unsafe {
                    std::ptr::write_volatile(r.immediate_exit, 1);
                    let ret = libc::ioctl(r.fd, KVM_RUN, 0);
                    let errno = std::io::Error::last_os_error().raw_os_error();
                    std::ptr::write_volatile(r.immediate_exit, 0);
                    if ret == 0 {
                        0
                    } else {
                        errno.unwrap_or(0)
                    }
                };
                let _ = r.done.send(errno);
            }
            Some(AheadRequest::GetReady) => ready = true,
            Some(AheadRequest::Start(b)) => {
                if ready {
                    if let Some(set) = &allowed {
                        affinity::set(0, set);
                    }
                }
                let (mut runner, start_paused) = *b;
                runner.run(start_paused);
                return;
            }
        }
    }
}

/// CPU affinity, for [`VcpuThreadAhead`].
mod affinity {
    use std::mem::size_of;

    /// The calling thread's allowed CPUs.
    pub(super) fn current() -> Option<libc::cpu_set_t> {
        // SAFETY: a zeroed cpu_set_t is a valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a cpu_set_t of the size given.
        let r = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
        (r == 0).then_some(set)
    }

    /// Sets thread `tid`'s (0: the caller's) allowed CPUs; best effort.
    pub(super) fn set(tid: libc::pid_t, set: &libc::cpu_set_t) -> bool {
        // SAFETY: `set` is a valid cpu_set_t of the size given; a bad tid
        // only makes the call fail.
        unsafe { libc::sched_setaffinity(tid, size_of::<libc::cpu_set_t>(), set) == 0 }
    }

    /// Lets thread `tid` use the caller's allowed CPUs but the one the
    /// caller runs on, if that leaves any; best effort. Returns the CPU
    /// kept off.
    pub(super) fn keep_off_callers_cpu(tid: libc::pid_t) -> Option<usize> {
        // SAFETY: sched_getcpu has no preconditions.
        let cpu = usize::try_from(unsafe { libc::sched_getcpu() }).ok()?;
        let mut others = current()?;
        // SAFETY: `cpu` is below the set's capacity (the kernel gave it).
        unsafe { libc::CPU_CLR(cpu, &mut others) };
        // SAFETY: `others` is a valid cpu_set_t.
        if unsafe { libc::CPU_COUNT(&others) } == 0 {
            return None;
        }
        set(tid, &others).then_some(cpu)
    }
}

/// Control of a running vCPU thread.
pub struct VcpuHandle {
    index: u8,
    requests: Sender<VcpuRequest>,
    pending: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
    counters: Arc<VcpuExitCounters>,
}

impl VcpuHandle {
    /// vCPU index.
    pub fn index(&self) -> u8 {
        self.index
    }

    /// Exit counters.
    pub fn counters(&self) -> &VcpuExitCounters {
        &self.counters
    }

    fn send(&self, req: VcpuRequest) -> Result<(), VcpuError> {
        self.requests
            .send(req)
            .map_err(|_| VcpuError::Gone(self.index))?;
        self.pending.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn kick(&self) {
        if let Some(t) = &*self.thread.lock().unwrap_or_else(|p| p.into_inner()) {
            let _ = t.kill(kick_signal());
        }
    }

    /// Stops the vCPU outside KVM_RUN; returns once it is stopped.
    pub fn pause(&self) -> Result<(), VcpuError> {
        let (ack_tx, ack_rx) = channel();
        self.send(VcpuRequest::Pause(ack_tx, PauseLength::Long))?;
        self.wait_kicking(&ack_rx)
    }

    /// Asks the vCPU to stop and then run `job` on its fd, without waiting:
    /// [`wait_job`](Self::wait_job) collects the result. Pausing several
    /// vCPUs this way stops them all at once, and the caller wakes once per
    /// vCPU instead of twice (pause, then a job).
    pub fn start_pause_with<R: Send + 'static>(
        &self,
        length: PauseLength,
        job: impl FnOnce(&mut VcpuFd) -> R + Send + 'static,
    ) -> Result<Receiver<Box<R>>, VcpuError> {
        // Nobody waits on the pause's own acknowledgement: the job's result
        // comes after it.
        // The result travels boxed: a channel allocates its slots in blocks
        // of 31, and a vCPU state (~6 KB) would make each block ~190 KB —
        // above malloc's mmap threshold, so the first pause of a process
        // (a migration's, a warm restart's) paid an mmap, its page faults and
        // an munmap with a TLB shootdown: ~40 µs of the guest's downtime.
        let (ack_tx, _) = channel();
        let (tx, rx) = channel();
        self.send(VcpuRequest::Pause(ack_tx, length))?;
        self.send(VcpuRequest::Run(Box::new(move |fd| {
            let _ = tx.send(Box::new(job(fd)));
        })))?;
        self.kick();
        Ok(rx)
    }

    /// Waits for the result of a job started with
    /// [`start_pause_with`](Self::start_pause_with), kicking the vCPU out of
    /// KVM_RUN until it has it.
    pub fn wait_job<R>(&self, rx: &Receiver<Box<R>>) -> Result<R, VcpuError> {
        // Already kicked: a second signal now would only interrupt the job.
        self.wait_kicked(rx).map(|b| *b)
    }

    /// Lets a paused vCPU run again.
    pub fn resume(&self) -> Result<(), VcpuError> {
        self.send(VcpuRequest::Resume)
    }

    /// Runs `job` on the vCPU thread (with its fd) and returns its result. The
    /// vCPU should be paused: a running one is kicked out of KVM_RUN first.
    pub fn with_fd<R: Send + 'static>(
        &self,
        job: impl FnOnce(&mut VcpuFd) -> R + Send + 'static,
    ) -> Result<R, VcpuError> {
        // Boxed: see start_pause_with.
        let (tx, rx) = channel();
        self.send(VcpuRequest::Run(Box::new(move |fd| {
            let _ = tx.send(Box::new(job(fd)));
        })))?;
        self.wait_kicking(&rx).map(|b| *b)
    }

    fn wait_kicking<T>(&self, rx: &Receiver<T>) -> Result<T, VcpuError> {
        self.kick();
        self.wait_kicked(rx)
    }

    /// Waits for `rx` after a kick (which cannot be lost: see
    /// [`kick_handler`]); kicks again every millisecond all the same.
    fn wait_kicked<T>(&self, rx: &Receiver<T>) -> Result<T, VcpuError> {
        // A stop and a state save take tens of µs: poll for that long before
        // sleeping, since a futex wake-up costs about as much again here.
        if let Some(v) = spin_recv(rx, SPIN_WAIT) {
            return Ok(v);
        }
        loop {
            self.kick();
            match rx.recv_timeout(Duration::from_millis(1)) {
                Ok(v) => return Ok(v),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return Err(VcpuError::Gone(self.index)),
            }
        }
    }

    /// Ends the vCPU thread and waits for it.
    pub fn exit(&self) {
        if self.send(VcpuRequest::Exit).is_ok() {
            self.kick();
        }
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            // Keep kicking until the thread leaves KVM_RUN.
            while !t.is_finished() {
                let _ = t.kill(kick_signal());
                std::thread::sleep(Duration::from_millis(1));
            }
            let _ = t.join();
        }
    }
}

/// How long a waiter polls before it sleeps (see [`spin_recv`]).
const SPIN_WAIT: Duration = Duration::from_micros(200);

/// Polls `rx` for up to `limit`; `None` if nothing came (or the sender is
/// gone: the caller's blocking receive reports that).
fn spin_recv<T>(rx: &Receiver<T>, limit: Duration) -> Option<T> {
    let start = std::time::Instant::now();
    loop {
        match rx.try_recv() {
            Ok(v) => return Some(v),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return None,
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
        }
        if start.elapsed() >= limit {
            return None;
        }
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}

/// All vCPUs of a VM, paused and resumed together. Pauses nest: the machine
/// (API pause, snapshot) and a synchronizer (fault tolerance) may each pause
/// them, and they run again only when every pause has been undone.
pub struct VcpuSet {
    handles: Vec<VcpuHandle>,
    pauses: Mutex<u32>,
}

impl VcpuSet {
    /// The set of started vCPUs; `paused` if they were started paused.
    pub fn new(handles: Vec<VcpuHandle>, paused: bool) -> Self {
        VcpuSet {
            handles,
            pauses: Mutex::new(u32::from(paused)),
        }
    }

    /// The vCPUs.
    pub fn handles(&self) -> &[VcpuHandle] {
        &self.handles
    }

    /// Whether at least one pause is in effect.
    pub fn is_paused(&self) -> bool {
        *self.pauses.lock().unwrap_or_else(|p| p.into_inner()) > 0
    }

    /// Stops every vCPU outside KVM_RUN (if not stopped already); returns once
    /// all are stopped.
    pub fn pause(&self) -> Result<(), VcpuError> {
        let mut pauses = self.pauses.lock().unwrap_or_else(|p| p.into_inner());
        if *pauses == 0 {
            for v in &self.handles {
                v.pause()?;
            }
        }
        *pauses += 1;
        Ok(())
    }

    /// Pauses every vCPU (one more nested pause, as [`pause`](Self::pause))
    /// and runs `job` on each vCPU's own thread right after it stopped, all
    /// vCPUs at once; returns the results in vCPU order. Undo the pause with
    /// [`resume`](Self::resume), also when this fails.
    pub fn pause_with<R: Send + 'static>(
        &self,
        length: PauseLength,
        job: impl Fn(u8, &mut VcpuFd) -> R + Clone + Send + 'static,
    ) -> Result<Vec<R>, VcpuError> {
        let mut pauses = self.pauses.lock().unwrap_or_else(|p| p.into_inner());
        *pauses += 1;
        if *pauses > 1 {
            // Already stopped: the jobs only.
            return self
                .handles
                .iter()
                .map(|v| {
                    let (job, index) = (job.clone(), v.index());
                    v.with_fd(move |fd| job(index, fd))
                })
                .collect();
        }
        let pending: Vec<_> = self
            .handles
            .iter()
            .map(|v| {
                let (job, index) = (job.clone(), v.index());
                v.start_pause_with(length, move |fd| job(index, fd))
            })
            .collect::<Result<_, _>>()?;
        self.handles
            .iter()
            .zip(&pending)
            .map(|(v, rx)| v.wait_job(rx))
            .collect()
    }

    /// Undoes one [`pause`](Self::pause); the vCPUs run again after the last.
    pub fn resume(&self) -> Result<(), VcpuError> {
        let mut pauses = self.pauses.lock().unwrap_or_else(|p| p.into_inner());
        if *pauses == 1 {
            for v in &self.handles {
                v.resume()?;
            }
        }
        *pauses = pauses.saturating_sub(1);
        Ok(())
    }

    /// Ends every vCPU thread.
    pub fn exit_all(&self) {
        for v in &self.handles {
            v.exit();
        }
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.exit();
    }
}

struct VcpuRunner {
    index: u8,
    fd: VcpuFd,
    requests: Receiver<VcpuRequest>,
    pending: Arc<AtomicBool>,
    io_bus: Arc<Bus>,
    mmio_bus: Arc<Bus>,
    events: VmEventSink,
    counters: Arc<VcpuExitCounters>,
    dirty_ring_full: Option<DirtyRingFullHandler>,
    /// The last exit was port or MMIO I/O, which KVM completes (an IN's
    /// value into RAX, RIP past the instruction) only at the next KVM_RUN.
    io_in_flight: bool,
    /// KVM stores registers in `kvm_run` at every exit.
    sync_regs: bool,
    /// How long a paused thread polls for its next request before it
    /// sleeps: set by the last pause's [`PauseLength`].
    resume_poll: Duration,
}

/// Most KVM_RUN calls spent completing one I/O (a long string I/O exits once
/// per chunk).
const MAX_COMPLETION_RUNS: usize = 1024;

enum Flow {
    Continue,
    Stop,
}

impl VcpuRunner {
    fn run(&mut self, start_paused: bool) {
        let flag: *mut u8 = &mut self.fd.get_kvm_run().immediate_exit;
        KICK_EXIT_FLAG.with(|f| f.set(flag));
        self.run_loop(start_paused);
        // The flag dies with the fd: a late kick must not write to it.
        KICK_EXIT_FLAG.with(|f| f.set(std::ptr::null_mut()));
    }

    fn run_loop(&mut self, start_paused: bool) {
        let mut paused = start_paused;
        loop {
            if paused || self.pending.swap(false, Ordering::SeqCst) {
                if let Flow::Stop = self.complete_io() {
                    paused = true;
                }
                match self.handle_requests(&mut paused) {
                    Flow::Continue => {}
                    Flow::Stop => return,
                }
                if paused {
                    continue;
                }
            }
            let flow = self.run_once();
            // A kick since the last look at `pending` made KVM_RUN return at
            // once (or cut it short); `pending` is looked at next.
            self.fd.set_kvm_immediate_exit(0);
            if let Flow::Stop = flow {
                // Park until told to exit, so the machine decides what happens.
                paused = true;
            }
        }
    }

    /// Serves queued requests. While paused, blocks for the next one.
    fn handle_requests(&mut self, paused: &mut bool) -> Flow {
        loop {
            let req = if *paused {
                // A synchronizer's pause lasts ~100 µs: poll for the resume
                // that long before sleeping (not through a long pause).
                match spin_recv(&self.requests, self.resume_poll)
                    .map_or_else(|| self.requests.recv(), Ok)
                {
                    Ok(r) => r,
                    Err(_) => return Flow::Stop,
                }
            } else {
                match self.requests.try_recv() {
                    Ok(r) => r,
                    Err(std::sync::mpsc::TryRecvError::Empty) => return Flow::Continue,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => return Flow::Stop,
                }
            };
            match req {
                VcpuRequest::Pause(ack, length) => {
                    *paused = true;
                    self.resume_poll = match length {
                        PauseLength::Brief => SPIN_WAIT,
                        PauseLength::Long => Duration::ZERO,
                    };
                    let _ = ack.send(());
                }
                VcpuRequest::Resume => *paused = false,
                VcpuRequest::Run(job) => {
                    job(&mut self.fd);
                    // A job may have set registers: the sync area is stale
                    // until the next exit.
                    REGS_SYNCED.with(|s| s.set(false));
                }
                VcpuRequest::Exit => return Flow::Stop,
            }
        }
    }

    /// Lets KVM finish the I/O of the last exit without running the guest
    /// (KVM_RUN with `immediate_exit`), so that a pause leaves the vCPU at an
    /// instruction boundary: registers saved now are complete, and a restored
    /// VM neither repeats the I/O (an OUT written twice, an IN that consumes a
    /// second byte) nor loses an IN's value. As Firecracker and Cloud
    /// Hypervisor do before saving a vCPU; one extra KVM_RUN, only when the
    /// pause came right after an I/O exit (a kicked vCPU has nothing pending).
    fn complete_io(&mut self) -> Flow {
        if !self.io_in_flight {
            return Flow::Continue;
        }
        self.fd.set_kvm_immediate_exit(1);
        let mut flow = Flow::Continue;
        for _ in 0..MAX_COMPLETION_RUNS {
            // A string I/O may need more chunks: each is served as usual.
            if let Flow::Stop = self.run_once() {
                flow = Flow::Stop;
                break;
            }
            if !self.io_in_flight {
                break;
            }
        }
        self.fd.set_kvm_immediate_exit(0);
        flow
    }

    fn run_once(&mut self) -> Flow {
        let c = &self.counters;
        self.io_in_flight = false;
        let exit = self.fd.run();
        // KVM stores the sync area on the way out of a KVM_RUN that ran or
        // was interrupted (a kick); after any other failure, assume not.
        let stored = match &exit {
            Ok(_) => true,
            Err(e) => e.errno() == libc::EINTR,
        };
        REGS_SYNCED.with(|s| s.set(self.sync_regs && stored));
        match exit {
            Ok(VcpuExit::IoOut(port, data)) => {
                c.io_out.fetch_add(1, Ordering::Relaxed);
                self.io_bus.write(u64::from(port), data);
                self.io_in_flight = true;
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                c.io_in.fetch_add(1, Ordering::Relaxed);
                self.io_bus.read(u64::from(port), data);
                self.io_in_flight = true;
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                c.mmio_read.fetch_add(1, Ordering::Relaxed);
                self.mmio_bus.read(addr, data);
                self.io_in_flight = true;
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                c.mmio_write.fetch_add(1, Ordering::Relaxed);
                self.mmio_bus.write(addr, data);
                self.io_in_flight = true;
            }
            Ok(VcpuExit::Hlt) => {
                c.other.fetch_add(1, Ordering::Relaxed);
            }
            Ok(VcpuExit::Shutdown) => {
                c.other.fetch_add(1, Ordering::Relaxed);
                let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                tracing::warn!(
                    vcpu = self.index,
                    rip = format_args!("{rip:#x}"),
                    "guest triple fault: VM reset"
                );
                self.events.send(VmEvent::Reset);
                return Flow::Stop;
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                c.other.fetch_add(1, Ordering::Relaxed);
                let event = match kind {
                    kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => VmEvent::Poweroff { code: 0 },
                    kvm_bindings::KVM_SYSTEM_EVENT_RESET => VmEvent::Reset,
                    other => VmEvent::Error(format!("vCPU {}: system event {other}", self.index)),
                };
                self.events.send(event);
                return Flow::Stop;
            }
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                self.events.send(VmEvent::Error(format!(
                    "vCPU {}: KVM entry failed (reason {reason:#x}, cpu {cpu})",
                    self.index
                )));
                return Flow::Stop;
            }
            Ok(VcpuExit::InternalError) => {
                let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                self.events.send(VmEvent::Error(format!(
                    "vCPU {}: KVM internal error (emulation failure?) at rip {rip:#x}",
                    self.index
                )));
                return Flow::Stop;
            }
            Ok(VcpuExit::Unsupported(KVM_EXIT_DIRTY_RING_FULL)) => {
                c.dirty_ring_full.fetch_add(1, Ordering::Relaxed);
                let Some(handler) = &self.dirty_ring_full else {
                    self.events.send(VmEvent::Error(format!(
                        "vCPU {}: dirty ring full and nobody harvests it",
                        self.index
                    )));
                    return Flow::Stop;
                };
                // Harvest + KVM_RESET_DIRTY_RINGS, then re-enter.
                handler(self.index);
            }
            Ok(VcpuExit::Intr) => {
                c.interrupted.fetch_add(1, Ordering::Relaxed);
            }
            Ok(other) => {
                c.other.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(vcpu = self.index, exit = ?other, "unhandled vCPU exit");
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                c.interrupted.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.events.send(VmEvent::Error(format!(
                    "vCPU {}: KVM_RUN failed: {e}",
                    self.index
                )));
                return Flow::Stop;
            }
        }
        Flow::Continue
    }
}

/// Flat code and data segments (base 0, 4 GiB) and a 32-bit busy TSS, as the
/// boot protocols expect them loaded.
fn set_flat_segments(
    sregs: &mut kvm_bindings::kvm_sregs,
    code: u16,
    data: u16,
    tss: u16,
    long: bool,
) {
    let d = flat_segment(data, 0x3, false);
    sregs.cs = flat_segment(code, 0xb, long);
    sregs.ds = d;
    sregs.es = d;
    sregs.fs = d;
    sregs.gs = d;
    sregs.ss = d;
    sregs.tr = kvm_segment {
        base: 0,
        limit: 0x67,
        selector: tss,
        type_: 0xb,
        present: 1,
        s: 0,
        ..Default::default()
    };
}

fn flat_segment(selector: u16, type_: u8, long: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_,
        present: 1,
        dpl: 0,
        db: u8::from(!long),
        s: 1,
        l: u8::from(long),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

fn get_lapic_reg(regs: &[std::os::raw::c_char; 1024], offset: usize) -> u32 {
    let b: [u8; 4] = std::array::from_fn(|i| regs[offset + i] as u8);
    u32::from_le_bytes(b)
}

fn set_lapic_reg(regs: &mut [std::os::raw::c_char; 1024], offset: usize, value: u32) {
    for (i, b) in value.to_le_bytes().into_iter().enumerate() {
        regs[offset + i] = b as std::os::raw::c_char;
    }
}

thread_local! {
    /// The `immediate_exit` byte of the `kvm_run` of the vCPU this thread
    /// runs (null on other threads).
    static KICK_EXIT_FLAG: std::cell::Cell<*mut u8> = const { std::cell::Cell::new(std::ptr::null_mut()) };
    /// The sync area of this thread's vCPU's `kvm_run` holds its current
    /// registers (see [`synced_registers`]).
    static REGS_SYNCED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// What KVM_RUN asks KVM to store in `kvm_run` at every exit
/// (KVM_CAP_SYNC_REGS): general and special registers. Not the pending
/// events: an NMI can be queued for a vCPU after its exit (another vCPU's
/// IPI), and only KVM_GET_VCPU_EVENTS, which folds queued NMIs in, sees it.
const SYNC_REGS_WANTED: u64 = SyncReg::Register as u64 | SyncReg::SystemRegister as u64;

/// The registers and special registers of `fd` (in the returned
/// `kvm_sync_regs`, whose `events` are not kept up to date), as KVM stored
/// them in its `kvm_run` at the vCPU's last exit — if the caller is that
/// vCPU's thread, no job has run since that exit, and KVM supports it;
/// `None` otherwise (the caller then reads them with KVM_GET_REGS and
/// KVM_GET_SREGS). Nothing but an ioctl changes them while the vCPU is out
/// of KVM_RUN. Spares a save two ioctls (~6 µs each on this PVM host), which
/// a fault-tolerance sync pays at every output.
pub fn synced_registers(fd: &VcpuFd) -> Option<kvm_bindings::kvm_sync_regs> {
    REGS_SYNCED.with(|s| s.get()).then(|| fd.sync_regs())
}

/// A kick that lands while its vCPU thread is outside KVM_RUN — between its
/// look at the request queue and the ioctl — would otherwise be lost until
/// the next exit: setting `immediate_exit` makes that KVM_RUN return at once
/// (KVM's race-free way of kicking, as in Cloud Hypervisor).
extern "C" fn kick_handler(_: i32, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // `try_with`: nothing to do on a thread being torn down.
    let _ = KICK_EXIT_FLAG.try_with(|f| {
        let flag = f.get();
        if !flag.is_null() {
            // SAFETY: the vCPU thread points the flag at its own kvm_run
            // (mapped as long as its VcpuFd lives) and nulls it before the fd
            // is dropped; a handler runs on that same thread, so the mapping
            // is live. A volatile byte store is async-signal-safe.
            unsafe { std::ptr::write_volatile(flag, 1) };
        }
    });
}

fn install_kick_handler() -> Result<(), VcpuError> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = register_signal_handler(kick_signal(), kick_handler).map_err(VcpuError::Signal);
    });
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn a_kick_sets_the_immediate_exit_flag_of_its_own_thread_only() {
        install_kick_handler().unwrap();
        let mut flag = 0u8;
        KICK_EXIT_FLAG.with(|f| f.set(&mut flag));
        // Another thread's kick (no flag registered there) changes nothing.
        std::thread::spawn(|| {
            // SAFETY: raise() sends the kick signal to this thread; its
            // handler is installed above.
            unsafe { libc::raise(kick_signal()) };
        })
        .join()
        .unwrap();
        // SAFETY: `flag` is a live local; the handler writes it only on this
        // thread.
        assert_eq!(unsafe { std::ptr::read_volatile(&flag) }, 0);
        // SAFETY: as above, on this thread.
        unsafe { libc::raise(kick_signal()) };
        // SAFETY: as above.
        assert_eq!(unsafe { std::ptr::read_volatile(&flag) }, 1);
        KICK_EXIT_FLAG.with(|f| f.set(std::ptr::null_mut()));
    }

    /// `tid`'s allowed CPUs.
    fn affinity_of(tid: libc::pid_t) -> libc::cpu_set_t {
        // SAFETY: a zeroed cpu_set_t is a valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a cpu_set_t of the size given.
        let r = unsafe {
            libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set)
        };
        assert_eq!(r, 0);
        set
    }

    fn wait_for_tid(t: &VcpuThreadAhead) -> libc::pid_t {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let tid = t.tid.load(Ordering::Acquire);
            if tid != 0 {
                return tid;
            }
            assert!(std::time::Instant::now() < deadline, "the thread never ran");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_thread_ahead_polls_off_the_callers_cpu_and_ends_unstarted() {
        let t = VcpuThreadAhead::spawn(3).unwrap();
        assert_eq!(t.index(), 3);
        let tid = wait_for_tid(&t);
        let before = affinity_of(tid);
        // SAFETY: `before` is a valid cpu_set_t.
        let cpus = unsafe { libc::CPU_COUNT(&before) };
        let kept_off = affinity::keep_off_callers_cpu(tid);
        if cpus >= 2 {
            let cpu = kept_off.expect("two CPUs allowed, one kept off");
            let after = affinity_of(tid);
            // SAFETY: valid sets, `cpu` below their capacity.
            unsafe {
                assert!(libc::CPU_ISSET(cpu, &before));
                assert!(!libc::CPU_ISSET(cpu, &after));
                assert_eq!(libc::CPU_COUNT(&after), cpus - 1);
            }
        } else {
            assert_eq!(kept_off, None, "the only CPU cannot be kept off");
        }
        t.get_ready();
        // Dropped unstarted: the thread ends (after its poll at most).
        drop(t);
        let task = format!("/proc/self/task/{tid}");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while Path::new(&task).exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "the thread did not end"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
